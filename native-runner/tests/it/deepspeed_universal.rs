//! DeepSpeed universal checkpoints written by DeepSpeed 0.19.8's own `ds_to_universal` from two of
//! the ZeRO fixtures (`tests/fixtures/deepspeed/gen_universal.py`: ZeRO-2 bf16 and ZeRO-3 fp32):
//! `inspect` names them, `convert` gives the model bit for bit as `zero_to_fp32` gives the ZeRO
//! checkpoint converted, each trainable parameter and its moments and step equal to what the
//! universal files hold (`expected/universal_<case>.*`, read by torch) and to the live engine's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use crate::common::python;
use crate::deepspeed::{deepspeed, expected, fails, ok, python_ok, run, s, safetensors_of};

/// (universal fixture, the ZeRO fixture it was converted from, stage).
const CASES: &[(&str, &str, u8)] = &[
    ("universal_zero2_bf16", "zero2_bf16", 2),
    ("universal_zero3_fp32", "zero3_fp32", 3),
];

const TAG: &str = "global_step2_universal";

/// The trainable parameters `(name, group)` of `param_shapes`, in order
/// (`expected/universal_<case>.json`).
fn params(case: &str) -> Vec<(String, u64)> {
    let path = deepspeed().join("expected").join(format!("{case}.json"));
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    meta["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_str().unwrap().to_owned(), p[1].as_u64().unwrap()))
        .collect()
}

#[test]
fn inspect_names_deepspeed_universal_checkpoints() {
    for (case, _, stage) in CASES {
        for input in [deepspeed().join(case), deepspeed().join(case).join(TAG)] {
            let text = ok(&run(&["inspect", s(&input)]), case);
            let want = format!(
                "looks like: DeepSpeed universal checkpoint (ds_to_universal, from ZeRO stage {stage})"
            );
            assert!(text.contains(&want), "{case}: want `{want}` in\n{text}");
            assert!(
                text.contains("written by: DeepSpeed 0.19.8 (ds_to_universal"),
                "{case}: {text}"
            );
            let json = ok(&run(&["inspect", s(&input), "--json"]), case);
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert_eq!(v["kind"], "deepspeed_universal", "{case}");
            assert_eq!(v["has_optimizer_state"], true, "{case}");
        }
    }
}

#[test]
fn convert_universal_to_safetensors_is_zero_to_fp32_and_the_universal_files() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, source, _) in CASES {
        let want = expected(source);
        let files = safetensors_of(
            &deepspeed()
                .join("expected")
                .join(format!("{case}.safetensors")),
        );
        let out = tmp.path().join(format!("{case}.safetensors"));
        let summary: serde_json::Value = serde_json::from_str(&ok(
            &run(&[
                "convert",
                s(&deepspeed().join(case)),
                "-o",
                s(&out),
                "--json",
            ]),
            case,
        ))
        .unwrap();
        assert_eq!(summary["source_kind"], "deepspeed_universal", "{case}");
        let got = safetensors_of(&out);
        let aliases: Vec<&str> = want.ties.iter().map(|(a, _)| a.as_str()).collect();
        let names: Vec<&String> = want
            .keys
            .iter()
            .filter(|k| !aliases.contains(&k.as_str()))
            .collect();
        assert_eq!(got.len(), names.len(), "{case}: {:?}", got.keys());
        for name in names {
            assert_eq!(got.get(name), want.tensors.get(name), "{case}: {name}");
        }
        // Each trainable parameter is its `zero/<name>/fp32.pt`, bit for bit.
        for (name, _) in params(case) {
            let (dtype, shape, bytes) = &got[&name];
            let (fdtype, fshape, fbytes) = &files[&format!("fp32.{name}")];
            assert_eq!(
                (dtype, shape, bytes),
                (fdtype, fshape, fbytes),
                "{case}: {name}"
            );
        }
        let dropped = summary["tied_dropped"].as_array().unwrap();
        assert_eq!(dropped.len(), want.ties.len(), "{case}: {summary}");
    }
}

/// Compares a `.pt` output of a universal checkpoint in torch: the model in zero_to_fp32's order
/// and bits (of the ZeRO checkpoint converted), the optimizer per parameter equal to the universal
/// files (`fp32`, `exp_avg`, `exp_avg_sq`, `step`) and to the live engine's moments, the groups
/// naming `param_shapes`' groups. Prints `OK`.
const UNIVERSAL_AS_DEEPSPEED: &str = r#"
import json, sys, torch
from safetensors.torch import load_file
got = torch.load(sys.argv[1], weights_only=True)
files = load_file(sys.argv[2])
meta = json.load(open(sys.argv[3]))
exp = sys.argv[4]
src = meta["source"]
want = load_file(f"{exp}/{src}.zero_to_fp32.safetensors")
live = load_file(f"{exp}/{src}.live.safetensors")
src_meta = json.load(open(f"{exp}/{src}.json"))
model = [k for k in got if k not in ("optimizer", "extra")]
assert model == src_meta["keys"], (model, src_meta["keys"])
for k in model:
    assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
for alias, name in src_meta["ties"]:
    assert got[alias].untyped_storage().data_ptr() == got[name].untyped_storage().data_ptr(), (alias, name)
opt = got["optimizer"]
names = [n for n, g, s in meta["params"]]
assert list(opt["state"]) == names, (list(opt["state"]), names)
for n in names:
    assert torch.equal(got[n], files[f"fp32.{n}"]), n
    s = opt["state"][n]
    assert list(s) == ["step", "exp_avg", "exp_avg_sq"], list(s)
    assert s["step"].dim() == 0 and torch.equal(s["step"], files[f"step.{n}"]), (n, s["step"])
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(s[k], files[f"{k}.{n}"]), (n, k)
        assert torch.equal(s[k], live[f"{k}.{n}"]), (n, k, "live")
groups = [[n for n, g, _ in meta["params"] if g == i] for i in range(len(opt["param_groups"]))]
assert [g["params"] for g in opt["param_groups"]] == groups, opt["param_groups"]
assert opt["param_groups"][0]["weight_decay"] == 0.1 and opt["param_groups"][1]["weight_decay"] == 0.0
print("OK")
"#;

#[test]
fn convert_universal_to_torch_save_holds_model_and_optimizer() {
    let Some(py) = python() else {
        eprintln!("skipped: no Python with torch");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = deepspeed().join("expected");
    for (case, _, _) in CASES {
        let out = tmp.path().join(format!("{case}.pt"));
        ok(
            &run(&["convert", s(&deepspeed().join(case)), "-o", s(&out), "-q"]),
            case,
        );
        let args = [
            out,
            dir.join(format!("{case}.safetensors")),
            dir.join(format!("{case}.json")),
            dir.clone(),
        ];
        python_ok(&py, UNIVERSAL_AS_DEEPSPEED, &args, case);
    }
}

/// Copies a folder tree.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_tree(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

fn copy_case(case: &str, tmp: &Path) -> PathBuf {
    let to = tmp.join(case);
    copy_tree(&deepspeed().join(case), &to);
    to
}

#[test]
fn damaged_universal_folders_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.safetensors");
    // A parameter's fp32 file gone.
    let dir = copy_case("universal_zero3_fp32", &tmp.path().join("f"));
    std::fs::remove_file(dir.join(TAG).join("zero/up.weight/fp32.pt")).unwrap();
    let err = fails(&["convert", s(&dir), "-o", s(&out)]);
    assert!(
        err.contains("zero/up.weight/fp32.pt: missing") && err.contains("`up.weight`"),
        "{err}"
    );
    assert!(!out.exists());
    // A parameter's file of another parameter's size.
    let dir = copy_case("universal_zero2_bf16", &tmp.path().join("s"));
    let zero = dir.join(TAG).join("zero");
    std::fs::copy(zero.join("up.bias/fp32.pt"), zero.join("up.weight/fp32.pt")).unwrap();
    let err = fails(&["inspect", s(&dir)]);
    assert!(
        err.contains("zero/up.weight/fp32.pt") && err.contains("the shape [7, 6]"),
        "{err}"
    );
    // A ZeRO-3 model states file gone.
    let dir = copy_case("universal_zero3_fp32", &tmp.path().join("r"));
    std::fs::remove_file(
        dir.join(TAG)
            .join("zero_pp_rank_1_mp_rank_00_model_states.pt"),
    )
    .unwrap();
    let err = fails(&["inspect", s(&dir)]);
    assert!(
        err.contains("missing: global_step2_universal/zero_pp_rank_1_mp_rank_00_model_states.pt"),
        "{err}"
    );
    // `latest_universal` naming a folder that is not there.
    let dir = copy_case("universal_zero2_bf16", &tmp.path().join("l"));
    std::fs::write(dir.join("latest_universal"), "global_step9_universal").unwrap();
    let err = fails(&["inspect", s(&dir)]);
    assert!(
        err.contains("latest_universal") && err.contains("global_step9_universal"),
        "{err}"
    );
    // A truncated common file.
    let dir = copy_case("universal_zero2_bf16", &tmp.path().join("t"));
    let common = dir.join(TAG).join("zero/optimizer_state.pt");
    let bytes = std::fs::read(&common).unwrap();
    std::fs::write(&common, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&["inspect", s(&dir)]);
    assert!(err.contains("zero/optimizer_state.pt"), "{err}");
}
