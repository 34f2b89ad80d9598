//! Damaged and hostile inputs give a clear error (or a reported problem), never a panic and
//! never an allocation the input does not justify. Corpus: `tests/fixtures/malformed/` (written by
//! `gen_formats.py`, DCP metadata built with torch's own classes) plus damage applied in-test to
//! the real fixtures (truncation at many points, flipped bytes, removed files).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use shardscope_core::index::{self, CheckpointIndex, EntryKind, IndexError};
use shardscope_core::{MemorySource, Source};
use shardscope_tests::{fixtures_dir, memory_source};

fn formats() -> PathBuf {
    fixtures_dir().join("formats")
}

fn malformed(name: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join("malformed").join(name)).unwrap()
}

/// Indexes, checks and reads every value; returns the error or the problems found.
fn exercise(src: &dyn Source) -> Result<Vec<String>, IndexError> {
    let idx: CheckpointIndex = index::index_source(src)?;
    let problems: Vec<String> = idx.check().iter().map(ToString::to_string).collect();
    if problems.is_empty() {
        for e in &idx.entries {
            match e.kind {
                EntryKind::Tensor if e.shape.is_some() => {
                    idx.read_tensor(src, e)?;
                }
                EntryKind::Tensor => {
                    for c in &e.chunks {
                        idx.read_chunk(src, e, c)?;
                    }
                }
                EntryKind::Bytes => {
                    idx.read_bytes_value(src, e)?;
                }
                EntryKind::Scalar => {}
            }
        }
    }
    Ok(problems)
}

fn dcp_with_metadata(meta: Vec<u8>) -> MemorySource {
    let mut src = memory_source(&formats().join("dcp_torch_save"));
    src.insert(".metadata", meta);
    src
}

fn problems_of(meta: &str) -> Vec<String> {
    exercise(&dcp_with_metadata(malformed(meta))).unwrap()
}

#[test]
fn overlapping_chunks_are_reported_with_key_file_and_range() {
    let p = problems_of("dcp_overlap.metadata");
    assert!(
        p.iter().any(|p| p.starts_with("model.embed.weight:")
            && p.contains("overlaps")
            && p.contains("__1_0.distcp, bytes")),
        "{p:?}"
    );
}

#[test]
fn gaps_bounds_and_out_of_file_ranges_are_reported() {
    let p = problems_of("dcp_gap.metadata");
    assert!(
        p.iter()
            .any(|p| p.starts_with("model.embed.weight:") && p.contains("gap")),
        "{p:?}"
    );
    let p = problems_of("dcp_out_of_bounds.metadata");
    assert!(
        p.iter()
            .any(|p| p.starts_with("model.head.bias:") && p.contains("outside shape")),
        "{p:?}"
    );
    let p = problems_of("dcp_out_of_file.metadata");
    assert!(
        p.iter().any(|p| p.starts_with("model.buf:")
            && p.contains("outside the file")
            && p.contains("bytes 1000000000..")),
        "{p:?}"
    );
    let p = problems_of("dcp_overflow.metadata");
    assert!(
        p.iter()
            .any(|p| p.starts_with("model.embed.weight: shape") && p.contains("overflows")),
        "{p:?}"
    );
}

#[test]
fn missing_records_and_files_are_errors() {
    let err = exercise(&dcp_with_metadata(malformed(
        "dcp_no_storage_record.metadata",
    )))
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("model.buf: no storage_data record"),
        "{err}"
    );
    let mut src = memory_source(&formats().join("dcp_torch_save"));
    src.remove("__1_0.distcp");
    let err = exercise(&src).unwrap_err().to_string();
    assert!(
        err.contains("__1_0.distcp") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn hostile_pickles_and_zips_are_refused() {
    for (name, needle) in [
        ("memo_bomb.pt", "memo bomb"),
        ("recursive.pt", "nesting depth"),
        ("zip_bomb.pt", "compressed"),
        ("missing_storage.pt", "no member data/0"),
        ("view_past_storage.pt", "reaches element"),
    ] {
        let src = MemorySource::new().with(name, malformed(name));
        let err = exercise(&src).unwrap_err().to_string();
        assert!(
            err.starts_with(name) && err.contains(needle),
            "{name}: {err}"
        );
    }
    let src = MemorySource::new().with("overflow.safetensors", malformed("overflow.safetensors"));
    let err = exercise(&src).unwrap_err().to_string();
    assert!(
        err.starts_with("overflow.safetensors: invalid safetensors"),
        "{err}"
    );
}

/// Every prefix of a file is either refused or (for data files whose ranges are described
/// elsewhere) reported as a range outside the file.
fn source_for(dir: &str, file: &str) -> MemorySource {
    // Per-rank torch files are damaged one at a time, alone in their source.
    if std::path::Path::new(file)
        .extension()
        .is_some_and(|e| e == "pt")
    {
        MemorySource::new().with(file, std::fs::read(formats().join(dir).join(file)).unwrap())
    } else {
        memory_source(&formats().join(dir))
    }
}

fn truncations(dir: &str, file: &str) {
    let full = source_for(dir, file);
    let bytes = full.read_all(file).unwrap().into_owned();
    let step = (bytes.len() / 150).max(1);
    for len in (0..bytes.len()).step_by(step) {
        let mut src = full.clone();
        src.insert(file, bytes[..len].to_vec());
        match exercise(&src) {
            Err(_) => {}
            Ok(p) => assert!(
                !p.is_empty(),
                "{dir}/{file} truncated to {len} bytes was accepted"
            ),
        }
    }
}

#[test]
fn truncated_files_never_pass() {
    truncations("dcp_torch_save", ".metadata");
    truncations("dcp_torch_save", "__1_0.distcp");
    truncations("dcp_safetensors", "__1_0.distcp");
    truncations("fsdp2", "rank1_optim.pt");
    truncations("plain", "state_dict.pt");
    truncations("hf_sharded", "model-00002-of-00002.safetensors");
}

/// Flipping bytes anywhere never panics (values may legitimately change; structure errors are
/// reported).
fn flips(dir: &str, file: &str) {
    let full = source_for(dir, file);
    let bytes = full.read_all(file).unwrap().into_owned();
    let step = (bytes.len() / 400).max(1);
    for at in (0..bytes.len()).step_by(step) {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[at] ^= mask;
            let mut src = full.clone();
            src.insert(file, b);
            let _ = exercise(&src);
        }
    }
}

#[test]
fn flipped_bytes_never_panic() {
    flips("dcp_torch_save", ".metadata");
    flips("fsdp1_orig0", "rank0_sharded.pt");
    flips("fsdp2", "rank0_model.pt");
    flips(
        "hf_distributed",
        "shard-00001-model-00001-of-00001.safetensors",
    );
}
