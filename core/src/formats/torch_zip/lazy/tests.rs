#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::borrow::Cow;
use std::cell::RefCell;
use std::path::{Path, PathBuf};

use super::*;
use crate::formats::torch_zip::read_archive;
use crate::source::MemorySource;

/// Every `torch.save` file torch wrote for the tests (`tests/fixtures/**/*.pt|.pth|.bin`).
fn fixtures() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p
                .extension()
                .is_some_and(|e| e == "pt" || e == "pth" || e == "bin")
            {
                out.push(p);
            }
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let mut out = Vec::new();
    walk(&root, &mut out);
    assert!(out.len() > 20, "few fixtures under {}", root.display());
    out
}

/// A source that records every range read, and can fail reads at or past an offset.
struct Counting<S> {
    inner: S,
    reads: RefCell<Vec<(u64, u64)>>,
    fail_from: Option<u64>,
}

impl<S: Source> Counting<S> {
    fn new(inner: S) -> Self {
        Counting {
            inner,
            reads: RefCell::new(Vec::new()),
            fail_from: None,
        }
    }
    fn bytes_read(&self) -> u64 {
        self.reads.borrow().iter().map(|r| r.1).sum()
    }
}

impl<S: Source> Source for Counting<S> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.inner.size(name)
    }
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        if self
            .fail_from
            .is_some_and(|f| offset.saturating_add(len) > f)
        {
            return Err(SourceError::Io {
                name: name.to_owned(),
                message: "connection reset".into(),
            });
        }
        self.reads.borrow_mut().push((offset, len));
        self.inner.read_range(name, offset, len)
    }
}

const TINY: Limits = Limits {
    tail: 22,
    coalesce_gap: 0,
};

/// What `read_archive_from` gives with these limits (the lazy answer, or the whole-file one
/// when the ranges did not parse), the bytes read, and whether the ranges parsed.
fn lazy(bytes: &[u8], limits: Limits) -> (Result<TorchArchive, TorchZipError>, u64, bool) {
    let source = Counting::new(MemorySource::new().with("f.pt", bytes.to_vec()));
    let (result, parsed) = match read_lazily(&source, "f.pt", limits) {
        Ok(Some(a)) => (Ok(a), true),
        Err(ArchiveFileError::Archive(e)) => (Err(e), true),
        Err(ArchiveFileError::Source(e)) => panic!("source error {e}"),
        Ok(None) => (read_archive(&source.read_all("f.pt").unwrap()), false),
    };
    (result, source.bytes_read(), parsed)
}

#[test]
fn lazy_archive_equals_read_archive_for_every_fixture() {
    let (mut parsed, mut big_storages) = (0, 0);
    for path in fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        let whole = read_archive(&bytes);
        for limits in [
            Limits::DEFAULT,
            TINY,
            Limits {
                tail: 100,
                coalesce_gap: 64,
            },
        ] {
            let source = Counting::new(MemorySource::new().with("f.pt", bytes.clone()));
            let got = match read_lazily(&source, "f.pt", limits) {
                Ok(Some(a)) => Ok(a),
                // Only a file that is no archive at all falls back.
                Ok(None) => {
                    assert!(
                        whole.is_err(),
                        "{}: not read lazily ({limits:?})",
                        path.display()
                    );
                    whole.clone()
                }
                Err(ArchiveFileError::Archive(e)) => Err(e),
                Err(ArchiveFileError::Source(e)) => panic!("{}: {e}", path.display()),
            };
            assert_eq!(got, whole, "{} ({limits:?})", path.display());
            // Nothing read twice: every fetched byte is new.
            let mut reads = source.reads.borrow().clone();
            reads.sort_unstable();
            for w in reads.windows(2) {
                assert!(
                    w[0].0 + w[0].1 <= w[1].0,
                    "{}: overlapping reads {reads:?}",
                    path.display()
                );
            }
            // With a tiny tail, no tensor bytes: away from its first and last KiB (local headers
            // and slack around data.pkl, and the slack of the central directory's read when the
            // storage is the archive's last big record, may reach into them), no storage is read.
            if let (Ok(a), true) = (&got, limits.coalesce_gap == 0) {
                for r in a.storages.values().filter(|r| r.len > 2048) {
                    let (from, to) = (r.offset + 1024, r.offset + r.len - 1024);
                    let read = source.reads.borrow().clone();
                    assert!(
                        read.iter().all(|&(o, l)| o + l <= from || o >= to),
                        "{}: storage bytes {from}..{to} were read: {read:?}",
                        path.display()
                    );
                    big_storages += 1;
                }
            }
            // And through the public function (default limits, fallback included).
            let public = read_archive_from(&source, "f.pt").map_err(|e| match e {
                ArchiveFileError::Archive(e) => e,
                ArchiveFileError::Source(e) => panic!("{e}"),
            });
            assert_eq!(public, whole, "{}", path.display());
        }
        parsed += usize::from(whole.is_ok());
    }
    assert!(parsed > 20, "only {parsed} fixtures parsed");
    assert!(big_storages >= 4, "only {big_storages} storages over 1 KiB");
}

/// Cutting the file short or corrupting its tail (end records, central directory) never panics:
/// the lazy reader gives exactly what the whole-file reader gives (an error, mostly; for damage
/// the whole-file reader tolerates, the same archive).
#[test]
fn truncated_and_corrupted_tails_give_the_whole_file_answer() {
    let all = fixtures();
    let picks: Vec<&PathBuf> = all.iter().step_by(all.len() / 6).collect();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut errors, mut lazily) = (0, 0);
    for path in picks {
        let bytes = std::fs::read(path).unwrap();
        let n = bytes.len();
        let mut cases: Vec<Vec<u8>> = Vec::new();
        for cut in (1..=n.min(600)).chain((600..n).step_by(97)) {
            cases.push(bytes[..n - cut].to_vec());
        }
        for _ in 0..300 {
            let mut b = bytes.clone();
            let window = n.min(2048);
            for _ in 0..=(next() % 4) {
                let at = n - 1 - (next() as usize % window);
                b[at] = match next() % 3 {
                    0 => b[at] ^ (1 << (next() % 8)),
                    1 => 0xff,
                    _ => next() as u8,
                };
            }
            cases.push(b);
        }
        for case in cases {
            let whole = read_archive(&case);
            for limits in [Limits::DEFAULT, TINY] {
                let (got, _, parsed) = lazy(&case, limits);
                assert_eq!(got, whole, "{} ({} bytes)", path.display(), case.len());
                lazily += usize::from(parsed);
            }
            errors += usize::from(whole.is_err());
        }
    }
    assert!(errors > 100, "only {errors} damaged files were errors");
    assert!(lazily > 0);
}

/// A failing source is reported as such (not as a broken archive, not by reading everything).
#[test]
fn source_errors_are_passed_on() {
    let path = fixtures()
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let mut source = Counting::new(MemorySource::new().with("f.pt", bytes.clone()));
    source.fail_from = Some(bytes.len() as u64 - 10);
    assert!(matches!(
        read_archive_from(&source, "f.pt"),
        Err(ArchiveFileError::Source(SourceError::Io { .. }))
    ));
    let missing = MemorySource::new();
    assert!(matches!(
        read_archive_from(&missing, "f.pt"),
        Err(ArchiveFileError::Source(SourceError::NotFound { .. }))
    ));
}

#[test]
fn the_store_merges_what_it_holds() {
    let mut store = Store::new(100, 0);
    store.insert(10, vec![1; 10]);
    store.insert(30, vec![3; 10]);
    store.insert(20, vec![2; 10]); // touches both: one segment
    assert_eq!(store.segments.len(), 1);
    assert_eq!(store.get(10, 30).unwrap()[9..11], [1, 2]);
    store.insert(5, vec![9; 50]); // covers all
    assert_eq!(store.segments.len(), 1);
    assert_eq!(store.get(5, 50).unwrap(), &[9; 50][..]);
    assert!(store.get(4, 2).is_none());
    assert!(store.get(50, 10).is_none());
    assert_eq!(store.next_held(0), Some(5));
    assert_eq!(store.next_held(5), None);
    let cell = RefCell::new(store);
    let mut r = Sparse::new(&cell);
    let mut buf = [0u8; 4];
    r.seek(SeekFrom::Start(53)).unwrap();
    assert_eq!(r.read(&mut buf).unwrap(), 2);
    assert!(r.read(&mut buf).is_err());
    assert_eq!(cell.borrow().miss, Some((55, 4)));
    assert!(r.seek(SeekFrom::Current(-100)).is_err());
    assert_eq!(r.seek(SeekFrom::End(0)).unwrap(), 100);
    assert_eq!(r.read(&mut buf).unwrap(), 0);
}

/// The globals scan by range equals the whole-file scan, for every fixture, and reads no storage
/// longer than the coalescing gap past its first KiB.
#[test]
fn pickle_globals_from_equals_pickle_globals() {
    for path in fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        let whole = crate::formats::torch_zip::pickle_globals(&bytes);
        let source = Counting::new(MemorySource::new().with("f.pt", bytes.clone()));
        let got = pickle_globals_from(&source, "f.pt").map_err(|e| match e {
            ArchiveFileError::Archive(e) => e,
            ArchiveFileError::Source(e) => panic!("{e}"),
        });
        assert_eq!(got, whole, "{}", path.display());
        if bytes.len() as u64 > TAIL_BYTES
            && let Ok(a) = read_archive(&bytes)
        {
            let read = source.reads.borrow().clone();
            // Storages shorter than the coalescing gap that lie between two member headers are
            // read with them (one request instead of two: megatron_gpt/model.pt's 3-8 KiB ones).
            for r in a.storages.values().filter(|r| r.len > super::COALESCE_GAP) {
                let (from, to) = (r.offset + 1024, r.offset + r.len);
                assert!(
                    read.iter().all(|&(o, l)| o + l <= from || o >= to),
                    "{}: {read:?}",
                    path.display()
                );
            }
        }
    }
}
