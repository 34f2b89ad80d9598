//! `shardscope convert` against real torch: runs `tests/interop/check_convert.py`, which writes a DCP
//! checkpoint with two FSDP2 ranks (gloo, CPU, spawned processes), converts it with the binary to
//! `torch.save`, safetensors and HF shards, and compares them with torch's own `dcp_to_torch_save`;
//! then converts a full state dict to DCP for 2 ranks (FSDP1 and FSDP2 chunking) and `dcp.load`s it
//! into a real FSDP2 model. Every expected value comes from torch. Python comes from
//! `SHARDSCOPE_PYTHON`, else `~/torch-venv/bin/python`; without torch the test prints
//! "skipped: no torch" and passes (CI always has torch).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn python() -> Option<PathBuf> {
    shardscope_tests::torch_python()
}

#[test]
fn convert_outputs_load_in_torch_and_match_torch_own_conversion() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let bin = shardscope_tests::shardscope_bin();
    let work = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("interop/check_convert.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(&bin)
        .arg(work.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "check_convert.py failed:\n{stdout}\n{stderr}"
    );
}
