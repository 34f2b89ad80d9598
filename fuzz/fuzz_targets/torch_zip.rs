//! A torch.save archive on arbitrary bytes: open it, then read every tensor view it names.
#![no_main]
use shardscope_core::{MemorySource, index};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let src = MemorySource::new().with("f.pt", data.to_vec());
    if let Ok(idx) = index::index_torch_files(&src, &["f.pt".to_owned()]) {
        for e in &idx.entries {
            for c in &e.chunks {
                let _ = idx.read_chunk(&src, e, c);
            }
        }
    }
});
