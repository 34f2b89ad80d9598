//! Helpers shared by the integration tests: fixture paths, in-memory sources, torch.
//!
//! The tests that run the `shardscope` binary live in the runner's test binary
//! (`native-runner/tests/it`), the one place where Cargo builds the binary first and names it in
//! `CARGO_BIN_EXE_shardscope`; they reach these helpers through a dev-dependency on this crate.

use std::path::PathBuf;

/// The `tests/fixtures` folder.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The DeepSpeed ZeRO folders DeepSpeed itself wrote under `tests/fixtures/deepspeed/`
/// (`gen_deepspeed.py`), each with `expected/<case>.*` from the live engine: the list the generator
/// writes to `cases.txt`, which core's unit tests and `check_deepspeed_fsdp2.py` read too.
pub fn deepspeed_cases() -> Vec<&'static str> {
    include_str!("../fixtures/deepspeed/cases.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

/// Loads every file under `dir` (recursively) into a [`shardscope_core::MemorySource`], with
/// names relative to `dir`.
pub fn memory_source(dir: &std::path::Path) -> shardscope_core::MemorySource {
    fn walk(dir: &std::path::Path, prefix: &str, out: &mut shardscope_core::MemorySource) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        for p in entries {
            let name = format!(
                "{prefix}{}",
                p.file_name().and_then(|n| n.to_str()).expect("utf-8 name")
            );
            if p.is_dir() {
                walk(&p, &format!("{name}/"), out);
            } else {
                out.insert(name, std::fs::read(&p).expect("read fixture"));
            }
        }
    }
    let mut out = shardscope_core::MemorySource::new();
    walk(dir, "", &mut out);
    out
}

/// Python with torch and safetensors for interop tests: `SHARDSCOPE_PYTHON`, else
/// `~/torch-venv/bin/python`, else `~/.cache/shardscope/torch-venv/bin/python` (the venv
/// `.ci/run` installs); `None` when none exists (the caller prints that it skips). A
/// `SHARDSCOPE_PYTHON` that cannot import them is an error: CI sets it and must not skip silently.
pub fn torch_python() -> Option<std::path::PathBuf> {
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
    let ok = std::process::Command::new(&python)
        .args(["-c", "import torch, safetensors"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || explicit.is_none(),
        "SHARDSCOPE_PYTHON={} cannot import torch and safetensors",
        python.display()
    );
    ok.then_some(python)
}

/// Runs `tests/interop/<script> <shardscope> <workdir>` with [`torch_python`] in a fresh
/// temporary folder (removed afterwards) and panics with the script's output unless it exits 0
/// and its last line is `ok`. Returns `false` (after printing "skipped: no torch") when there is
/// no torch.
pub fn run_interop_script(script: &str, shardscope: &std::path::Path) -> bool {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no torch");
        return false;
    };
    let work = std::env::temp_dir().join(format!(
        "shardscope-interop-{}-{}",
        script.trim_end_matches(".py"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", work.display()));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("interop")
        .join(script);
    let out = std::process::Command::new(&python)
        .arg(&path)
        .arg(shardscope)
        .arg(&work)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let _ = std::fs::remove_dir_all(&work);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    true
}
