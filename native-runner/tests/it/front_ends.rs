//! `shardscope inspect` (and so `verify`, `diff`, `convert`: one `Checkpoint::open`) reads each
//! torch-written per-rank fixture as torch's own full state dicts (`expected/*.pt`, saved by the
//! generators): the same tensors, dtypes and shapes. viewer/tests/it/front_ends.rs checks the viewer
//! against the same files; `doctor` reads the same folders without a complaint about their keys.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// `key -> (dtype, shape)` of the tensors under `model.`/`optim.` (after `prefix`).
type Tensors = BTreeMap<String, (String, Value)>;

fn inspect(args: &[&Path], extra: &[&str], prefix: &str) -> Tensors {
    let out = Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .arg("inspect")
        .args(args)
        .args(extra)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "inspect {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "tensor")
        .map(|e| {
            (
                format!("{prefix}{}", e["key"].as_str().unwrap()),
                (e["dtype"].as_str().unwrap().to_owned(), e["shape"].clone()),
            )
        })
        .filter(|(k, _)| k.starts_with("model.") || k.starts_with("optim."))
        .collect()
}

fn doctor_loadable(dir: &Path, extra: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .arg("doctor")
        .arg(dir)
        .args(extra)
        .arg("--json")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor {}: {e}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(v["loadable"], true, "doctor {}: {v:#}", dir.display());
}

#[test]
fn per_rank_folders_read_as_torch_full_state_dicts() {
    let f = fixtures();
    for (dir, full) in [
        ("fsdp2_optim/ws2", "fsdp2_optim/expected/ws2_full.pt"),
        ("fsdp2_hsdp/ws4_2x2", "fsdp2_hsdp/expected/ws4_2x2_full.pt"),
        (
            "trainer_folders/verl_fsdp2",
            "trainer_folders/expected/verl_fsdp2_full.pt",
        ),
    ] {
        let expected = inspect(&[&f.join(full)], &[], "");
        assert!(!expected.is_empty(), "{full}");
        assert_eq!(inspect(&[&f.join(dir)], &[], ""), expected, "{dir}");
        doctor_loadable(&f.join(dir), &[]);
    }
}

#[test]
fn fsdp1_folder_reads_through_its_description() {
    let f = fixtures().join("trainer_folders");
    let mut expected = inspect(&[&f.join("expected/verl_fsdp1_model.pt")], &[], "model.");
    expected.extend(inspect(
        &[&f.join("expected/verl_fsdp1_optim.pt")],
        &[],
        "optim.",
    ));
    let model = f.join("verl_fsdp1_model.json");
    let got = inspect(
        &[&f.join("verl_fsdp1")],
        &["--model", model.to_str().unwrap()],
        "",
    );
    assert_eq!(got, expected);
}
