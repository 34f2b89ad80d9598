//! FSDP1 per-rank folders read through the model's layout (`--model`): real torch (gloo, CPU)
//! trains the nested FSDP1 model and saves per-rank LOCAL model and raw optimizer state dicts plus
//! its own FULL_STATE_DICT and `FSDP.optim_state_dict` (`tests/interop/fsdp1_reshard.py make`).
//! Expected values are torch's files:
//!
//! - `diff FOLDER --model` equals torch's full model and full optimizer state bit for bit
//!   (`use_orig_params` False at 2 ranks, True at 3 ranks with uneven shards), and so does a folder
//!   holding only the optimizer files;
//! - `inspect --model` lists the original parameters (no `_flat_param`); `verify --model` passes;
//! - `convert` of an optimizer-only folder gives a file torch loads equal to
//!   `FSDP.optim_state_dict`; `convert --select model` to DCP for 3 ranks gives what torch's
//!   `dcp_to_torch_save` reads as the FULL_STATE_DICT;
//! - wrong layout flags give exit 2 and name the flat parameter.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::python;

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn model_json() -> PathBuf {
    manifest().join("../tests/fixtures/optim/nested_ws2_uop0/model.json")
}

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .unwrap()
}

fn run_python(python: &Path, script: &Path, args: &[&str]) -> String {
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} {args:?} failed:\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{stdout}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The rank files of `src` whose names start with one of `prefixes`, copied into `dst`.
fn copy_rank_files(src: &Path, dst: &Path, prefixes: &[&str]) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_file() && prefixes.iter().any(|p| name.starts_with(p)) {
            std::fs::copy(e.path(), dst.join(&name)).unwrap();
        }
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "one fixture case checked through diff, inspect and convert in turn"
)]
fn case(world_size: usize, uop: bool) {
    let Some(python) = python() else {
        eprintln!("skipped: no torch (set SHARDSCOPE_PYTHON)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let made = tmp.path().join("made");
    std::fs::create_dir_all(made.join("full")).unwrap();
    run_python(
        &python,
        &manifest().join("tests/interop/fsdp1_reshard.py"),
        &[
            "make",
            made.to_str().unwrap(),
            &world_size.to_string(),
            if uop { "1" } else { "0" },
        ],
    );
    let full_model = made.join("full/full_model.pt");
    let full_optim = made.join("full/full_optim.pt");
    let folder = tmp.path().join("ranks");
    copy_rank_files(&made, &folder, &["model_rank", "optim_rank"]);
    let optim_only = tmp.path().join("optim_only");
    copy_rank_files(&made, &optim_only, &["optim_rank"]);
    let model = model_json();
    let mut layout: Vec<&str> = vec!["--model", model.to_str().unwrap()];
    if uop {
        layout.push("--use-orig-params");
    }
    let with = |args: &[&str]| -> Vec<String> {
        args.iter()
            .chain(layout.iter())
            .map(|s| (*s).to_owned())
            .collect()
    };
    let run = |args: Vec<String>| shardscope(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let s = |p: &Path| p.to_str().unwrap().to_owned();

    // diff against torch's own full dicts.
    for (side, reference) in [("model", &full_model), ("optim", &full_optim)] {
        let out = run(with(&[
            "diff",
            &s(&folder),
            &s(reference),
            "--select",
            side,
            "--quiet",
        ]));
        let text = ok(&out, &format!("diff {side}"));
        assert!(
            text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
            "{text}"
        );
    }
    let out = run(with(&["diff", &s(&optim_only), &s(&full_optim), "--quiet"]));
    let text = ok(&out, "diff optimizer-only folder");
    assert!(text.contains(" 0 mismatch, 0 missing"), "{text}");

    // inspect: original parameters with their global shapes.
    let out = run(with(&["inspect", &s(&folder), "--json"]));
    let index: serde_json::Value = serde_json::from_str(&ok(&out, "inspect --json")).unwrap();
    let entries = index["entries"].as_array().unwrap();
    assert!(entries.iter().all(|e| e.get("flat_param").is_none()));
    let weight = entries
        .iter()
        .find(|e| e["key"] == "model.block2.1.weight")
        .unwrap();
    assert_eq!(weight["shape"], serde_json::json!([9, 9]));
    assert!(
        entries
            .iter()
            .any(|e| e["key"] == "optim.state.block2.1.weight.exp_avg"
                && e["shape"] == serde_json::json!([9, 9]))
    );
    ok(
        &run(with(&["inspect", &s(&folder), "--values"])),
        "inspect --values",
    );

    // convert: optimizer-only folder -> FSDP.optim_state_dict; model -> DCP for 3 ranks.
    let check = manifest().join("../tests/interop/check_fsdp1_view.py");
    let out_optim = tmp.path().join("out/optim.pt");
    std::fs::create_dir_all(out_optim.parent().unwrap()).unwrap();
    ok(
        &run(with(&[
            "convert",
            &s(&optim_only),
            "-o",
            &s(&out_optim),
            "-q",
        ])),
        "convert optimizer-only folder",
    );
    let said = run_python(&python, &check, &["same", &s(&out_optim), &s(&full_optim)]);
    assert!(said.contains("ok"), "{said}");
    let out_dcp = tmp.path().join("out/dcp");
    ok(
        &run(with(&[
            "convert",
            &s(&folder),
            "--select",
            "model",
            "--nest",
            "model",
            "--world-size",
            "3",
            "-o",
            &s(&out_dcp),
            "-q",
        ])),
        "convert to DCP",
    );
    let said = run_python(&python, &check, &["dcp", &s(&out_dcp), &s(&full_model)]);
    assert!(said.contains("ok"), "{said}");

    // Two model file sets (an EMA copy next to the model): convert names the flag that chooses.
    let two_sets = tmp.path().join("two_sets");
    copy_rank_files(&made, &two_sets, &["model_rank", "optim_rank"]);
    for r in 0..world_size {
        std::fs::copy(
            made.join(format!("model_rank{r}.pt")),
            two_sets.join(format!("ema_rank{r}.pt")),
        )
        .unwrap();
    }
    let out_pt = tmp.path().join("out/two.pt");
    let o = run(with(&["convert", &s(&two_sets), "-o", &s(&out_pt)]));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--model-files"), "{stderr}");
    ok(
        &run(with(&[
            "convert",
            &s(&two_sets),
            "-o",
            &s(&out_pt),
            "--model-files",
            "model_rank{r}.pt",
            "-q",
        ])),
        "convert --model-files",
    );
    let said = run_python(&python, &check, &["same", &s(&out_pt), &s(&full_model)]);
    assert!(said.contains("ok"), "{said}");

    // The wrong layout: exit 2, naming the flat parameter and the flags to check.
    let mut wrong: Vec<String> = ["diff", &s(&folder), &s(&full_model), "--select", "model"]
        .iter()
        .map(|x| (*x).to_owned())
        .collect();
    wrong.extend(["--model".to_owned(), s(&model)]);
    if !uop {
        wrong.push("--use-orig-params".to_owned());
    }
    wrong.extend(["--world-size".to_owned(), (world_size + 1).to_string()]);
    let out = run(wrong);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("_flat_param") || stderr.contains("optim.state."),
        "{stderr}"
    );
    assert!(stderr.contains("hint: check --use-orig-params"), "{stderr}");
}

#[test]
fn flat_parameters_at_two_ranks() {
    case(2, false);
}

#[test]
fn original_params_at_three_ranks() {
    case(3, true);
}

/// A folder as verl leaves it with FSDP1 (`tests/fixtures/trainer_folders/gen_trainer_folders.py`):
/// DTensor model files (SHARDED_STATE_DICT with a device mesh), raw optimizer files whose ids are
/// flat parameters (3 units' worth for 6 parameters), and extra state. With the layout every command
/// reads it as torch's FULL_STATE_DICT and `FSDP.optim_state_dict` (torch wrote the expected files).
#[test]
fn verl_fsdp1_folder_with_flat_optimizer_state() {
    let t = manifest().join("../tests/fixtures/trainer_folders");
    let folder = t.join("verl_fsdp1");
    let model = t.join("verl_fsdp1_model.json");
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let full_model = t.join("expected/verl_fsdp1_model.pt");
    let full_optim = t.join("expected/verl_fsdp1_optim.pt");
    for (side, reference) in [("model", &full_model), ("optim", &full_optim)] {
        let out = shardscope(&[
            "diff",
            &s(&folder),
            &s(reference),
            "--select",
            side,
            "--model",
            &s(&model),
            "-q",
        ]);
        let text = ok(&out, &format!("diff {side}"));
        assert!(
            text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
            "{text}"
        );
    }
    // Without the layout: the model converts alone; the optimizer is refused with the way out.
    let tmp = tempfile::tempdir().unwrap();
    let st = tmp.path().join("model.safetensors");
    ok(
        &shardscope(&[
            "convert",
            &s(&folder),
            "--select",
            "model",
            "-o",
            &s(&st),
            "-q",
        ]),
        "convert --select model",
    );
    let text = ok(
        &shardscope(&["diff", &s(&st), &s(&full_model), "-q"]),
        "diff",
    );
    assert!(
        text.contains(" 0 mismatch, 0 missing, 0 unexpected"),
        "{text}"
    );
    let out = shardscope(&["convert", &s(&folder), "-o", &s(&tmp.path().join("x.pt"))]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("rank-local") && stderr.contains("--model"),
        "{stderr}"
    );
    assert!(!tmp.path().join("x.pt").exists());
    // With it: the optimizer converts to what FSDP.optim_state_dict returned.
    let optim = tmp.path().join("optim.pt");
    ok(
        &shardscope(&[
            "convert",
            &s(&folder),
            "--model",
            &s(&model),
            "--select",
            "optim",
            "-o",
            &s(&optim),
            "-q",
        ]),
        "convert --select optim",
    );
    let text = ok(
        &shardscope(&["diff", &s(&optim), &s(&full_optim), "-q"]),
        "diff optim",
    );
    assert!(
        text.contains(" 0 mismatch, 0 missing, 0 unexpected"),
        "{text}"
    );
    if let Some(python) = python() {
        let said = run_python(
            &python,
            &manifest().join("../tests/interop/check_fsdp1_view.py"),
            &["same", &s(&optim), &s(&full_optim)],
        );
        assert!(said.contains("ok"), "{said}");
    }
}
