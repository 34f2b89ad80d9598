//! A DCP directory: the first 4 bytes split the input into `.metadata` and one data file
//! `__0_0.distcp`; the whole index is built, checked and every value read.
#![no_main]
use shardscope_core::{MemorySource, index};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let split = (u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize) % (data.len() - 3);
    let rest = &data[4..];
    let split = split.min(rest.len());
    let src = MemorySource::new()
        .with(".metadata", rest[..split].to_vec())
        .with("__0_0.distcp", rest[split..].to_vec());
    if let Ok(idx) = index::index_source(&src)
        && idx.check().is_empty()
    {
        for e in &idx.entries {
            match e.kind {
                index::EntryKind::Tensor => {
                    let _ = idx.read_tensor(&src, e);
                }
                _ => {
                    let _ = idx.read_bytes_value(&src, e);
                }
            }
        }
    }
});
