//! The restricted pickle machine on arbitrary bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shardscope_core::formats::pickle::parse(data);
});
