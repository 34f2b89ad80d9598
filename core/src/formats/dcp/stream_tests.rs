//! The streaming reader against the general path: on every torch-written `.metadata` in the
//! repository it must take the fast path and give the table the general path gives; on damaged
//! and hostile bytes it may give up, but never give anything the general path would not.

use std::path::PathBuf;

use super::stream::read_table_by;
use super::test_pickle::{GenTensor, metadata};
use super::window::Unrecognised;
use super::{MetadataTable, TableItemKind, read_metadata};
use crate::source::MemorySource;
use crate::source::recording::Recording;

/// Every torch-written `.metadata` of the repository (the same list the reader's robustness
/// tests walk), at least 10 of them.
fn fixtures() -> Vec<(PathBuf, Vec<u8>)> {
    let out = super::tests::robustness::fixtures();
    assert!(out.len() >= 10, "found {} DCP fixtures", out.len());
    out
}

fn streamed(bytes: &[u8], window: u64) -> Result<MetadataTable, Unrecognised> {
    let mut source = MemorySource::new();
    source.insert(".metadata", bytes.to_vec());
    read_table_by(&source, ".metadata", bytes.len() as u64, window)
}

/// The table read through a source that copies what it reads (as local files and the browser
/// do), and whether every pass read the file once, front to back: each read starts where the one
/// before ended, or at 0 (the next pass).
fn streamed_copying(bytes: &[u8], window: u64) -> (Result<MetadataTable, Unrecognised>, bool) {
    let mut inner = MemorySource::new();
    inner.insert(".metadata", bytes.to_vec());
    let source = Recording::new(inner);
    let table = read_table_by(&source, ".metadata", bytes.len() as u64, window);
    let mut end = 0u64;
    let mut in_order = true;
    for &(_, offset, len) in source.reads.borrow().iter() {
        in_order &= offset == end || offset == 0;
        end = offset + len;
    }
    (table, in_order)
}

fn general(bytes: &[u8]) -> Option<MetadataTable> {
    read_metadata(bytes).ok().map(MetadataTable::from_metadata)
}

/// The streaming result, checked against the general path: equal when it succeeds.
fn agrees(bytes: &[u8], window: u64, what: &str) -> bool {
    match streamed(bytes, window) {
        Ok(table) => {
            let Some(expected) = general(bytes) else {
                panic!("{what}: the streaming reader accepted what the general path refuses");
            };
            assert!(table == expected, "{what}: the tables differ");
            true
        }
        Err(Unrecognised) => false,
    }
}

fn chunks(t: &MetadataTable) -> usize {
    t.items
        .iter()
        .map(|i| match &i.kind {
            TableItemKind::Tensor { chunks, .. } => chunks.len(),
            TableItemKind::Bytes { .. } => 1,
        })
        .sum()
}

/// `.metadata` files whose storage records come in another order than their chunks (Megatron's
/// `dist_checkpointing` with tensor parallelism 2 writes one tensor's rank pieces interleaved with
/// other tensors'): the streaming reader gives up on them by design and the general path reads
/// them (checked below).
const RECORDS_OUT_OF_ORDER: &[&str] = &["megatron_gpt/dist/.metadata"];

fn out_of_order(path: &std::path::Path) -> bool {
    RECORDS_OUT_OF_ORDER
        .iter()
        .any(|f| path.to_string_lossy().ends_with(f))
}

#[test]
fn records_out_of_chunk_order_go_to_the_general_path() {
    let mut seen = 0;
    for (path, bytes) in fixtures() {
        if out_of_order(&path) {
            seen += 1;
            let what = path.display().to_string();
            general(&bytes).unwrap_or_else(|| panic!("{what}: general path fails"));
            assert!(
                streamed(&bytes, 4 << 20).is_err(),
                "{what}: now streams: remove it from the list"
            );
        }
    }
    assert_eq!(seen, RECORDS_OUT_OF_ORDER.len());
}

#[test]
fn every_fixture_takes_the_fast_path_and_reads_alike() {
    for (path, bytes) in fixtures().into_iter().filter(|(p, _)| !out_of_order(p)) {
        let what = path.display().to_string();
        let expected = general(&bytes).unwrap_or_else(|| panic!("{what}: general path fails"));
        // Windows of every small size cross every opcode and string boundary.
        for window in [1, 2, 3, 5, 8, 13, 64, 4096, 4 << 20] {
            let table = streamed(&bytes, window).unwrap_or_else(|_| {
                panic!(
                    "{what}: the streaming reader gave up at stream.rs:{} (window {window})",
                    super::window::GAVE_UP_AT.with(std::cell::Cell::get)
                )
            });
            assert!(
                table == expected,
                "{what}: the tables differ (window {window})"
            );
            // The same through a source that copies each window (the unread end of a window
            // moves to the front of the next, and only what follows is read).
            let (copied, in_order) = streamed_copying(&bytes, window);
            assert!(
                copied.ok().as_ref() == Some(&expected),
                "{what}: the tables differ, copied windows (window {window})"
            );
            assert!(
                in_order,
                "{what}: windows read out of order (window {window})"
            );
        }
        assert!(chunks(&expected) > 0, "{what}");
    }
}

#[test]
fn damaged_fixtures_never_read_differently() {
    // Deterministic xorshift, as in the general path's robustness test.
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut fast, mut gave_up) = (0usize, 0usize);
    for (path, bytes) in fixtures() {
        let what = path.display().to_string();
        for n in (0..bytes.len()).step_by((bytes.len() / 256).max(1)) {
            assert!(
                streamed(&bytes[..n], 7).is_err(),
                "{what}: a truncation to {n} bytes read"
            );
        }
        let step = (bytes.len() / 400).max(1);
        for i in (0..bytes.len()).step_by(step) {
            for v in [
                0x00,
                bytes[i] ^ 0x80,
                bytes[i].wrapping_add(1),
                bytes[i].wrapping_sub(1),
            ] {
                let mut b = bytes.clone();
                b[i] = v;
                if agrees(&b, 64, &format!("{what} with byte {i} = {v:#04x}")) {
                    fast += 1;
                } else {
                    gave_up += 1;
                }
            }
        }
        for _ in 0..200 {
            let mut b = bytes.clone();
            for _ in 0..=(next() % 4) {
                let at = (next() % b.len() as u64) as usize;
                b[at] = next() as u8;
            }
            if agrees(&b, 4096, &format!("{what} with random bytes")) {
                fast += 1;
            } else {
                gave_up += 1;
            }
        }
    }
    // Both occur: a changed digit of an int still reads (and must read alike), a changed opcode
    // does not.
    assert!(fast > 0 && gave_up > 0, "{fast} read, {gave_up} gave up");
}

/// A fixture with one string replaced by another of the same length.
fn replace(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at = bytes
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .unwrap_or_else(|| panic!("{from} not found"));
    let mut b = bytes.to_vec();
    b[at..at + to.len()].copy_from_slice(to.as_bytes());
    b
}

#[test]
fn hostile_and_unusual_pickles_take_the_general_path() {
    let (_, bytes) = fixtures()
        .into_iter()
        .find(|(p, _)| p.ends_with("dtypes/dcp_zstd/.metadata"))
        .unwrap();
    // A class of another module where a DCP class belongs (the general path matches by name):
    // not recognised, so the general path reads it.
    let other_module = replace(
        &bytes,
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.metadatb",
    );
    assert!(streamed(&other_module, 64).is_err());
    // An unsafe global called at the root: no table, and the general path reports it.
    let mut call = vec![0x80, 4];
    call.extend(b"\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c\x04true\x94\x85\x94R\x94.");
    assert!(streamed(&call, 64).is_err());
    assert!(general(&call).is_none());
    // A path leaving the folder: refused by both.
    let escape = replace(&bytes, "__0_0.distcp", "../_0.distcp");
    assert!(streamed(&escape, 64).is_err());
    assert!(general(&escape).is_none());
    // A memo bomb: a list memoized and fetched (shared mutable values are not followed).
    let mut bomb = vec![0x80, 4, b']', 0x94];
    for _ in 0..100 {
        bomb.extend([b'h', 0, b'a']);
    }
    bomb.push(b'.');
    assert!(streamed(&bomb, 64).is_err());
    // Deep nesting is not followed (and never overflows the stack).
    let mut deep = vec![0x80, 4];
    deep.extend(std::iter::repeat_n(b']', 100_000));
    deep.extend(std::iter::repeat_n(b'a', 99_999));
    deep.push(b'.');
    assert!(streamed(&deep, 4096).is_err());
}

fn generated(n_tensors: usize, chunks: u64, reversed: bool) -> Vec<GenTensor> {
    (0..n_tensors)
        .map(|i| GenTensor {
            fqn: format!("model.layers{i}.weight"),
            rows: chunks * (3 + i as u64 % 5),
            cols: 4 + i as u64 % 3,
            chunks,
            reversed_records: reversed && i % 7 == 3,
            drop_last_record: false,
        })
        .collect()
}

#[test]
fn a_generated_metadata_of_many_chunks_reads_alike() {
    let tensors = generated(30, 1200, false);
    let bytes = metadata(&tensors, 64, Some("extra_state"));
    let expected = general(&bytes).expect("the general path reads the generated pickle");
    assert_eq!(chunks(&expected), 30 * 1200 + 1);
    for window in [1 << 20, 4096, 7] {
        let table = streamed(&bytes, window).expect("fast path");
        assert!(table == expected, "window {window}");
    }
    for item in &expected.items {
        if let TableItemKind::Tensor { chunks, .. } = &item.kind {
            assert!(chunks.iter().all(|c| c.place.is_some()), "{}", item.key);
        }
    }
    // Records in another order than their chunks: the general path reads them.
    let bytes = metadata(&generated(30, 50, true), 64, None);
    assert!(streamed(&bytes, 4096).is_err());
    let expected = general(&bytes).expect("the general path reads it");
    for item in &expected.items {
        if let TableItemKind::Tensor { chunks, .. } = &item.kind {
            assert!(chunks.iter().all(|c| c.place.is_some()), "{}", item.key);
        }
    }
}

/// The table with the per-record shortcut off or on, and how many records it made.
fn with_shortcut(
    bytes: &[u8],
    window: u64,
    on: bool,
) -> (Result<MetadataTable, Unrecognised>, usize) {
    use super::stream::fast::{MADE, OFF};
    OFF.with(|o| o.set(!on));
    MADE.with(|m| m.set(0));
    let table = streamed(bytes, window);
    OFF.with(|o| o.set(false));
    (table, MADE.with(std::cell::Cell::get))
}

#[test]
fn the_record_shortcut_reads_as_the_opcodes_do() {
    let mut made = 0;
    let mut fixtures: Vec<_> = fixtures()
        .into_iter()
        .filter(|(p, _)| !out_of_order(p))
        .collect();
    fixtures.push((
        PathBuf::from("generated"),
        metadata(&generated(12, 700, false), 64, Some("extra_state")),
    ));
    for (path, bytes) in &fixtures {
        let what = path.display().to_string();
        for window in [64, 4 << 20] {
            let (slow, none) = with_shortcut(bytes, window, false);
            let (fast, n) = with_shortcut(bytes, window, true);
            assert_eq!(none, 0);
            let (Ok(slow), Ok(fast)) = (slow, fast) else {
                panic!("{what}: gave up (window {window})");
            };
            assert!(slow == fast, "{what}: the tables differ (window {window})");
            if window == 4 << 20 {
                made += n;
            }
        }
    }
    // Three records a chunk (its metadata, index and storage info) once each is known: all but
    // the first few of the generated pickle's 8 400 chunks go through the shortcut.
    assert!(made > 3 * 8_000, "the shortcut made {made} records");
    // Damaged records: the shortcut and the opcodes agree, or both give up.
    let bytes = metadata(&generated(3, 40, false), 8, None);
    let start = bytes.len() / 2;
    for i in start..start + 400 {
        for v in [bytes[i] ^ 0x01, bytes[i] ^ 0x80, 0x94, b'h', b'u'] {
            let mut b = bytes.clone();
            b[i] = v;
            match (
                with_shortcut(&b, 4096, false).0,
                with_shortcut(&b, 4096, true).0,
            ) {
                (Ok(slow), Ok(fast)) => assert!(slow == fast, "byte {i} = {v:#04x}"),
                (Err(_), Err(_)) => {}
                (slow, fast) => panic!(
                    "byte {i} = {v:#04x}: opcodes {:?}, shortcut {:?}",
                    slow.is_ok(),
                    fast.is_ok()
                ),
            }
        }
    }
}
