//! A safetensors file on arbitrary bytes: index it, check it, read every tensor.
#![no_main]
use shardscope_core::{MemorySource, index};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let src = MemorySource::new().with("m.safetensors", data.to_vec());
    if let Ok(idx) = index::index_source(&src)
        && idx.check().is_empty()
    {
        for e in &idx.entries {
            let _ = idx.read_tensor(&src, e);
        }
    }
});
