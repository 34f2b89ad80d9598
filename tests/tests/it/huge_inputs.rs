//! Inputs that claim many GiB (a junk `.pt`, `.metadata`, HF index or safetensors file behind a
//! URL) give a clear error naming the file, after reading little: no reader asks for the whole
//! file, none allocates what the input claims, none panics. The source here reports a size of
//! 6 GiB and serves zeros except where a test places bytes, as a remote source does over HTTP
//! ranges; it refuses (and records) any single read over 256 MiB, so a reader that falls back
//! to a whole-file read fails the test instead of exhausting memory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_core::formats::torch_zip;
use shardscope_core::index;
use shardscope_core::{Source, SourceError};

const HUGE: u64 = 6 << 30;
const REFUSED_OVER: u64 = 256 << 20;

/// Bytes placed at an offset of a sparse file.
type Island = (u64, Vec<u8>);

/// Files of a claimed size: zeros, except the bytes placed at given offsets.
#[derive(Default)]
struct Sparse {
    files: BTreeMap<String, (u64, Vec<Island>)>,
    largest_read: Cell<u64>,
    total_read: Cell<u64>,
    refused: RefCell<Vec<(String, u64)>>,
}

impl Sparse {
    fn with(mut self, name: &str, size: u64, islands: Vec<Island>) -> Self {
        self.files.insert(name.to_owned(), (size, islands));
        self
    }

    /// The reads were few and small: no single read over `largest`, none refused, `total` in
    /// all.
    fn assert_read_at_most(&self, what: &str, largest: u64, total: u64) {
        assert!(
            self.refused.borrow().is_empty(),
            "{what}: whole-file reads asked for: {:?}",
            self.refused.borrow()
        );
        assert!(
            self.largest_read.get() <= largest,
            "{what}: a read of {} bytes",
            self.largest_read.get()
        );
        assert!(
            self.total_read.get() <= total,
            "{what}: {} bytes read in all",
            self.total_read.get()
        );
    }

    fn assert_read_little(&self, what: &str) {
        self.assert_read_at_most(what, 1 << 20, 4 << 20);
    }
}

impl Source for Sparse {
    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.files
            .get(name)
            .map(|f| f.0)
            .ok_or_else(|| SourceError::NotFound {
                name: name.to_owned(),
            })
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let (size, islands) = self.files.get(name).ok_or_else(|| SourceError::NotFound {
            name: name.to_owned(),
        })?;
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= *size)
            .ok_or_else(|| SourceError::OutOfRange {
                name: name.to_owned(),
                offset,
                len,
                size: *size,
            })?;
        if len > REFUSED_OVER {
            self.refused.borrow_mut().push((name.to_owned(), len));
            return Err(SourceError::Io {
                name: name.to_owned(),
                message: format!("test source: refused a read of {len} bytes"),
            });
        }
        self.largest_read.set(self.largest_read.get().max(len));
        self.total_read.set(self.total_read.get() + len);
        let mut out = vec![0u8; usize::try_from(len).unwrap()];
        for (at, bytes) in islands {
            let island_end = at + bytes.len() as u64;
            let (from, to) = ((*at).max(offset), island_end.min(end));
            if from < to {
                let dst = usize::try_from(from - offset).unwrap();
                let src = usize::try_from(from - at).unwrap();
                let n = usize::try_from(to - from).unwrap();
                out[dst..dst + n].copy_from_slice(&bytes[src..src + n]);
            }
        }
        Ok(Cow::Owned(out))
    }
}

/// A zip end-of-central-directory record claiming `entries` members in a directory of `cd_size`
/// bytes at `cd_offset`.
fn eocd(entries: u16, cd_size: u32, cd_offset: u32) -> Vec<u8> {
    let mut b = b"PK\x05\x06".to_vec();
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&entries.to_le_bytes());
    b.extend_from_slice(&entries.to_le_bytes());
    b.extend_from_slice(&cd_size.to_le_bytes());
    b.extend_from_slice(&cd_offset.to_le_bytes());
    b.extend_from_slice(&[0; 2]);
    b
}

fn open_err(src: &Sparse, label: &str) -> String {
    match Checkpoint::open(src, label, &ReadOptions::default()) {
        Ok(_) => panic!("{label}: opened"),
        Err(e) => {
            let mut text = e.to_string();
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                text.push_str(": ");
                text.push_str(&c.to_string());
                cause = c.source();
            }
            text
        }
    }
}

/// A 6 GiB `.pt` of zeros, and one that starts and ends like a zip (its end record claims a
/// directory as large as the file): errors naming the file, a few small reads.
#[test]
fn junk_torch_save_files_read_by_range() {
    let zeros = Sparse::default().with("model.pt", HUGE, vec![]);
    let err = torch_zip::read_archive_from(&zeros, "model.pt").unwrap_err();
    assert!(err.to_string().contains("torch.save"), "{err}");
    let err = index::index_torch_files(&zeros, &["model.pt".to_owned()]).unwrap_err();
    assert!(err.to_string().contains("model.pt"), "{err}");
    assert!(torch_zip::pickle_globals_from(&zeros, "model.pt").is_err());
    zeros.assert_read_little("zeros");

    // A local header at 0 and an end record claiming a 4 GiB directory at offset 0.
    let tail = eocd(60_000, u32::MAX - 100, 0);
    let zipish = Sparse::default().with(
        "model.pt",
        HUGE,
        vec![
            (0, b"PK\x03\x04".to_vec()),
            (HUGE - tail.len() as u64, tail),
        ],
    );
    let err = torch_zip::read_archive_from(&zipish, "model.pt").unwrap_err();
    assert!(!err.to_string().is_empty());
    let err = open_err(&zipish, "model.pt");
    assert!(err.contains("model.pt"), "{err}");
    // The zip parser searches the file for the directory the end record misplaces: the search
    // stops after 8 rounds or the directory limit (256 MiB; twice here: the reader and the
    // index), one read at most half of it.
    assert!(err.contains("broken zip archive"), "{err}");
    zipish.assert_read_at_most("zip-like", 128 << 20, 2 * (256 << 20));

    // An end record pointing at a directory of junk near the end of the file.
    let at = HUGE - (1 << 20);
    let tail = eocd(3, 1 << 19, u32::MAX);
    let junk_dir = Sparse::default().with(
        "model.pt",
        HUGE,
        vec![
            (0, b"PK\x03\x04".to_vec()),
            (at, vec![0xab; 1 << 19]),
            (HUGE - tail.len() as u64, tail),
        ],
    );
    assert!(torch_zip::read_archive_from(&junk_dir, "model.pt").is_err());
    junk_dir.assert_read_at_most("junk directory", 128 << 20, 256 << 20);
}

/// A 6 GiB `.metadata` is refused before it is read, the limit named.
#[test]
fn oversized_dcp_metadata_is_refused_by_size() {
    let src = Sparse::default()
        .with(".metadata", HUGE, vec![(0, b"\x80\x02".to_vec())])
        .with("__0_0.distcp", 1024, vec![]);
    let err = index::index_source(&src).unwrap_err().to_string();
    assert!(err.contains(".metadata"), "{err}");
    assert!(err.contains("limit of 1073741824 bytes"), "{err}");
    let err = open_err(&src, "ckpt");
    assert!(err.contains("limit"), "{err}");
    // doctor's scan of the pickles torch would run skips what it will not read.
    assert!(shardscope_core::doctor::unsafe_loader_pickles(&src).is_empty());
    assert_eq!(src.largest_read.get(), 0, "nothing of it was read");
    src.assert_read_little(".metadata");
}

/// A 6 GiB HF index file is refused before it is read; a 6 GiB safetensors file whose header
/// claims 6 GiB is refused by the header limit.
#[test]
fn oversized_hf_index_and_safetensors_headers() {
    let src = Sparse::default()
        .with(
            "model.safetensors.index.json",
            HUGE,
            vec![(0, b"{".to_vec())],
        )
        .with(
            "model-00001-of-00001.safetensors",
            16,
            vec![(0, 8u64.to_le_bytes().to_vec()), (8, b"{}      ".to_vec())],
        );
    let err = index::index_source(&src).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors.index.json") && err.contains("limit"),
        "{err}"
    );
    assert_eq!(src.largest_read.get(), 0);

    let header = Sparse::default().with(
        "model.safetensors",
        HUGE,
        vec![(0, (HUGE - 8).to_le_bytes().to_vec())],
    );
    let err = index::index_source(&header).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    header.assert_read_little("safetensors");
}
