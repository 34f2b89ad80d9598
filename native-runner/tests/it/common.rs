//! Helpers shared by the runner's integration tests.
#![allow(clippy::missing_panics_doc)]

use std::path::PathBuf;
use std::process::Command;

/// Python with torch, or `None` (then the test skips). A `SHARDSCOPE_PYTHON` without torch is an
/// error: CI sets it and must not skip silently.
pub fn python() -> Option<PathBuf> {
    let explicit = std::env::var_os("SHARDSCOPE_PYTHON");
    let python = if let Some(p) = &explicit {
        PathBuf::from(p)
    } else {
        // `~/torch-venv` (the guide's), else the venv `.ci/run` installs.
        let home = PathBuf::from(std::env::var_os("HOME")?);
        [
            "torch-venv/bin/python",
            ".cache/shardscope/torch-venv/bin/python",
        ]
        .iter()
        .map(|p| home.join(p))
        .find(|p| p.exists())?
    };
    let ok = Command::new(&python)
        .args(["-c", "import torch"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || explicit.is_none(),
        "SHARDSCOPE_PYTHON={} cannot import torch",
        python.display()
    );
    ok.then_some(python)
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
