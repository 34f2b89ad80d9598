//! The integration tests of `shardscope-tests`: one test binary (one link, one process start), a
//! module per area, as uv does (`crates/uv/tests/it/main.rs`). These tests call `shardscope_core`
//! in-process; the tests that run the `shardscope` binary are in `native-runner/tests/it`, where
//! Cargo builds the binary first and names it in `CARGO_BIN_EXE_shardscope`.

mod bridge_torch_save;
mod formats_malformed;
mod fuzz_readers;
mod huge_inputs;
mod layout_errors;
mod layout_properties;
mod transform_model;
mod transform_optim;
mod transform_properties;
/// The torch-made fixtures of `tests/fixtures/optim`, shared by the `transform_*` modules and
/// `bridge_torch_save`.
mod transform_support;
mod writers_interop;
