//! HSDP per-rank folders (FSDP2, mesh `(Replicate, Shard(0))`, written by torch:
//! `tests/fixtures/fsdp2_hsdp`): the first replica's pieces make each tensor, and `verify` compares
//! every other replica's pieces with them. One flipped byte in a replica's copy of a parameter is
//! reported as a disagreement of that key (exit 1), while `convert` still reads the first replica.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::process::Command;

use crate::common::shardscope_bin;
use shardscope_core::index::{self, ChunkEncoding};
use shardscope_tests::{fixtures_dir, memory_source};

#[test]
fn verify_compares_every_replica_with_the_first() {
    let src = fixtures_dir().join("fsdp2_hsdp/ws4_2x2");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let ok = Command::new(shardscope_bin())
        .args(["verify", dir.to_str().unwrap(), "-q"])
        .output()
        .unwrap();
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );

    // A model parameter with a piece on a rank of the second replica (ranks 2, 3).
    let idx = index::index_source(&memory_source(&dir)).unwrap();
    let (key, chunk) = idx
        .entries
        .iter()
        .filter(|e| e.key.starts_with("model.") && e.shape.is_some())
        .find_map(|e| {
            let c = e
                .chunks
                .iter()
                .find(|c| c.rank == Some(2) && c.numel().unwrap_or(0) > 0)?;
            Some((e.key.clone(), c.clone()))
        })
        .expect("a parameter piece on rank 2");
    let ChunkEncoding::Raw { storage_offset, .. } = chunk.encoding else {
        panic!("not a raw chunk")
    };
    let itemsize = idx.entry(&key).unwrap().dtype.unwrap().size_bytes() as u64;
    let at = chunk.byte_offset + storage_offset * itemsize;
    let path = dir.join(&*chunk.file);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[usize::try_from(at).unwrap()] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let bad = Command::new(shardscope_bin())
        .args(["verify", dir.to_str().unwrap(), "-q"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&bad.stdout);
    assert_eq!(bad.status.code(), Some(1), "{report}");
    assert!(
        report
            .lines()
            .any(|l| l.contains(&key) && l.contains("replicas") && l.contains("rank 2")),
        "{key}: {report}"
    );
}
