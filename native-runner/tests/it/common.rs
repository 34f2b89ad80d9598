//! Helpers shared by the runner's integration tests.
#![allow(clippy::missing_panics_doc)]

use std::path::PathBuf;

/// Python with torch, or `None` (then the test skips): [`shardscope_tests::torch_python`].
pub fn python() -> Option<PathBuf> {
    shardscope_tests::torch_python()
}

/// The `shardscope` binary of this package. Cargo builds it before the tests of this package and
/// names it in `CARGO_BIN_EXE_shardscope` (defined only for the tests of the package that owns the
/// binary, which is why every test that runs the binary is in this test binary).
pub fn shardscope_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_shardscope"))
}

/// [`shardscope_tests::run_interop_script`] with this package's `shardscope` binary.
pub fn run_interop_script(script: &str) -> bool {
    shardscope_tests::run_interop_script(script, &shardscope_bin())
}
