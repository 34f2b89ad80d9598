//! Opening a checkpoint in the viewer reads its metadata, never its tensors (issue 38: the
//! browser's open of a 1 GiB DCP had grown to seconds and +180 MiB). The steps of the browser's
//! open (`web/src/lib.rs`: `Checkpoint::open`, the values the panels show, the derived model, the
//! view) run here over a source that records every byte range read; no read may touch a tensor's
//! stored bytes, but for the few values the panels show (`CheckpointView::value_ranges`: pickled
//! bytes items and scalar `step` tensors).
//!
//! Expected values: the tensor byte ranges are the index's chunks, whose placement in the files
//! is proven against torch elsewhere (`native-runner/tests/it/formats_read.rs`).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::borrow::Cow;
use std::cell::RefCell;
use std::path::{Path, PathBuf};

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_core::index::{ChunkEncoding, EntryKind};
use shardscope_core::source::{Source, SourceError};
use shardscope_viewer::checkpoint::{CheckpointView, FsSource};

/// Every range read, as `(file, offset, len)`. Like the browser's source (`web/src/lazy.rs`), it
/// has no `read_ends` of its own: a reader asking for both ends of a range gets the whole range.
struct Recording<'a> {
    inner: &'a dyn Source,
    reads: RefCell<Vec<(String, u64, u64)>>,
}

impl Recording<'_> {
    fn note(&self, name: &str, offset: u64, len: u64) {
        self.reads.borrow_mut().push((name.to_owned(), offset, len));
    }
}

impl Source for Recording<'_> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.inner.size(name)
    }
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        self.note(name, offset, len);
        self.inner.read_range(name, offset, len)
    }
    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        self.note(name, offset, out.len() as u64);
        self.inner.read_range_into(name, offset, out)
    }
}

/// What the tie probes may read of each stored tensor: its first bytes (`index::ties`).
const PROBE_BYTES: u64 = 256;
/// What is read of each end of a DCP item to parse it (`index::values`): its zip headers,
/// `data.pkl` and directory; a small tensor's bytes lie within them.
const ITEM_HEAD: u64 = 64 << 10;
const ITEM_TAIL: u64 = 16 << 10;

/// The tensor bytes the browser's open steps read in `dir`, beyond the values the panels show,
/// the tie probes' first bytes and the ends of DCP items: `(file, offset, len)` of each piece.
fn tensor_reads(dir: &Path) -> Vec<(String, u64, u64)> {
    let fs = FsSource::from_dir(dir).unwrap();
    let rec = Recording {
        inner: &fs,
        reads: RefCell::new(Vec::new()),
    };
    let name = dir.file_name().unwrap().to_str().unwrap();
    let checkpoint = Checkpoint::open(&rec, name, &ReadOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let shown = CheckpointView::value_ranges(&checkpoint.index);
    // Each tensor chunk's stored bytes (past what the probes read), located without recording.
    let mut data: Vec<(String, u64, u64)> = Vec::new();
    let mut free: Vec<(String, u64, u64)> = Vec::new();
    for e in checkpoint
        .index
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
    {
        for c in &e.chunks {
            if shown.contains(&(c.file.to_string(), c.byte_offset, c.byte_length)) {
                continue;
            }
            if c.encoding == ChunkEncoding::TorchSaveItem {
                free.push((
                    c.file.to_string(),
                    c.byte_offset,
                    ITEM_HEAD.min(c.byte_length),
                ));
                let tail = ITEM_TAIL.min(c.byte_length);
                free.push((
                    c.file.to_string(),
                    c.byte_offset + c.byte_length - tail,
                    tail,
                ));
            }
            let l = checkpoint.index.locate_chunk(&fs, e, c).unwrap();
            if l.storage_bytes > PROBE_BYTES {
                data.push((
                    l.file,
                    l.storage_byte_offset + PROBE_BYTES,
                    l.storage_bytes - PROBE_BYTES,
                ));
            }
        }
    }
    let derived = CheckpointView::derive_model(&checkpoint, &rec);
    CheckpointView::from_checkpoint_derived(checkpoint, derived, &rec).unwrap();
    let mut out = Vec::new();
    for (f, o, l) in rec.reads.into_inner() {
        for (df, d0, dl) in &data {
            if df != &f {
                continue;
            }
            let (a, b) = (o.max(*d0), (o + l).min(d0 + dl));
            if a >= b {
                continue;
            }
            // Not counted: the bytes of an item's ends (read to parse the item).
            let mut pieces = vec![(a, b)];
            for (ff, f0, fl) in free.iter().filter(|x| x.0 == f) {
                pieces = pieces
                    .into_iter()
                    .flat_map(|(x, y)| {
                        let (c0, c1) = (*f0, f0 + fl);
                        if c1 <= x || y <= c0 {
                            vec![(x, y)]
                        } else {
                            [(x, c0.max(x)), (c1.min(y), y)]
                                .into_iter()
                                .filter(|(p, q)| p < q)
                                .collect()
                        }
                    })
                    .collect();
                let _ = ff;
            }
            out.extend(pieces.into_iter().map(|(x, y)| (f.clone(), x, y - x)));
        }
    }
    out
}

/// What reading a `torch.save` file's directory may bring along of its tensors, per file: its
/// last 16 KiB (the end records and directory, fetched at once) and a member header's slack.
const ZIP_SPILL: u64 = (16 << 10) + 1024;

fn assert_reads_no_tensor_bytes(dir: &Path) {
    let mut per_file: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for (f, _, l) in tensor_reads(dir) {
        *per_file.entry(f).or_default() += l;
    }
    let read: Vec<(String, u64)> = per_file
        .into_iter()
        .filter(|(f, bytes)| {
            let head = std::fs::read(dir.join(f)).unwrap_or_default();
            // A pickle that is no zip (accelerate's `random_states_N.pkl`) is read whole to be
            // indexed: its tensors are inline.
            let zip = head.starts_with(b"PK\x03\x04");
            let pickle = head.first() == Some(&0x80);
            let read_whole_by_format = pickle && !zip;
            !read_whole_by_format && *bytes > if zip { ZIP_SPILL } else { 0 }
        })
        .collect();
    let bytes: u64 = read.iter().map(|r| r.1).sum();
    assert!(
        read.is_empty(),
        "{}: the open read {bytes} bytes of tensors: {read:?}",
        dir.display(),
    );
}

#[test]
fn opening_a_checkpoint_reads_no_tensor_bytes() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let trainer = root.join("tests/fixtures/trainer_folders");
    for dir in [
        root.join("examples/fsdp2_dcp"),
        root.join("tests/fixtures/app_state/dcp"),
        trainer.join("acc_save_state"),
        trainer.join("step-2"),
        trainer.join("lightning_sharded"),
        trainer.join("one_file_per_rank"),
        trainer.join("tc_safetensors"),
        trainer.join("verl_fsdp2"),
        root.join("tests/fixtures/formats/hf_sharded"),
        root.join("tests/fixtures/hf_mapping/llama3/step-1"),
    ] {
        assert_reads_no_tensor_bytes(&dir);
    }
}

/// Tensors of 1 MiB, larger than what is read of a DCP item's ends: a DCP, a `torch.save` file
/// and a safetensors file, written by torch now (`tests/fixtures/gen_large_open.py`).
#[test]
fn opening_large_tensors_reads_only_their_metadata() {
    let Some(python) = shardscope_tests::torch_python() else {
        eprintln!("skipped: no Python with torch (SHARDSCOPE_PYTHON)");
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gen_large_open.py");
    let status = std::process::Command::new(python)
        .arg(script)
        .arg(out.path())
        .status()
        .unwrap();
    assert!(status.success());
    for format in ["dcp", "pt", "safetensors"] {
        assert_reads_no_tensor_bytes(&out.path().join(format));
    }
}
