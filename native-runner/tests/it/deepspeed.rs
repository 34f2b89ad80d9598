//! DeepSpeed ZeRO checkpoints written by DeepSpeed 0.19.8 itself on CPU
//! (`tests/fixtures/deepspeed/gen_deepspeed.py`: ZeRO-1/2/3 in fp32 and bf16, a tied weight, a
//! frozen parameter, two buffers) through the command: `inspect` names them, and `convert` gives
//! the model as DeepSpeed's `zero_to_fp32` gives it, compared bit for bit with the state dict
//! DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` returned (`expected/<case>.*`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shardscope_tests::fixtures_dir;

use crate::common::{python, shardscope_bin};

use shardscope_tests::deepspeed_cases;

pub(crate) fn deepspeed() -> PathBuf {
    fixtures_dir().join("deepspeed")
}

pub(crate) fn run(args: &[&str]) -> Output {
    Command::new(shardscope_bin()).args(args).output().unwrap()
}

pub(crate) fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub(crate) fn ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{stdout}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A safetensors file's tensors: name -> (dtype, shape, bytes).
pub(crate) type Tensors = BTreeMap<String, (String, Vec<u64>, Vec<u8>)>;

pub(crate) fn safetensors_of(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().iter().map(|&d| d as u64).collect(),
                    v.data().to_vec(),
                ),
            )
        })
        .collect()
}

/// What DeepSpeed wrote down: `zero_to_fp32`'s tensors (every name), its key order and ties.
pub(crate) struct Expected {
    pub(crate) tensors: Tensors,
    pub(crate) keys: Vec<String>,
    /// `(alias, name)`: names zero_to_fp32 gives as one tensor.
    pub(crate) ties: Vec<(String, String)>,
}

pub(crate) fn expected(case: &str) -> Expected {
    let dir = deepspeed().join("expected");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("{case}.json"))).unwrap()).unwrap();
    let strs = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_owned())
            .collect()
    };
    let mut tensors = safetensors_of(&dir.join(format!("{case}.zero_to_fp32.safetensors")));
    let mut keys = strs(&meta["keys"]);
    // The frozen parameters zero_to_fp32 leaves out (ZeRO-1), as the live engine's module holds
    // them, before the first trainable parameter (zero_to_fp32's place for frozen ones).
    let live = safetensors_of(&dir.join(format!("{case}.live.safetensors")));
    for (name, value) in &live {
        let Some(frozen) = name.strip_prefix("frozen.") else {
            continue;
        };
        if tensors.contains_key(frozen) {
            continue;
        }
        let at = keys
            .iter()
            .position(|k| live.contains_key(&format!("param.{k}")))
            .unwrap();
        keys.insert(at, frozen.to_owned());
        tensors.insert(frozen.to_owned(), value.clone());
    }
    Expected {
        tensors,
        keys,
        ties: meta["ties"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let p = strs(p);
                (p[0].clone(), p[1].clone())
            })
            .collect(),
    }
}

#[test]
fn inspect_names_the_stage_precision_and_ranks() {
    for case in deepspeed_cases() {
        let text = ok(&run(&["inspect", s(&deepspeed().join(case))]), case);
        let stage = &case[4..5];
        let precision = if case.contains("bf16") {
            "bf16 (fp32 master weights)"
        } else {
            "fp32"
        };
        let ranks = if case.ends_with("_ws3") { 3 } else { 2 };
        let want = format!("looks like: DeepSpeed ZeRO stage {stage}, {precision}, {ranks} ranks");
        assert!(text.contains(&want), "{case}: want `{want}` in\n{text}");
        // ZeRO partitions hold padding the storage count does not see: never "none found".
        assert!(
            !text.contains("padding: none found") && text.contains("padding: not counted"),
            "{case}: {text}"
        );
        let json = ok(
            &run(&["inspect", s(&deepspeed().join(case)), "--json"]),
            case,
        );
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            v["kind"],
            format!("deepspeed_zero{stage}").as_str(),
            "{case}"
        );
    }
}

#[test]
fn convert_to_safetensors_is_zero_to_fp32_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    for case in deepspeed_cases() {
        let want = expected(case);
        // The run folder (through `latest`) and the tag folder, whole and --model-only.
        let inputs = [
            deepspeed().join(case),
            deepspeed().join(case).join("global_step2"),
        ];
        for (i, input) in inputs.iter().enumerate() {
            for model_only in [false, true] {
                let out = tmp
                    .path()
                    .join(format!("{case}-{i}-{model_only}.safetensors"));
                let mut args = vec!["convert", s(input), "-o", s(&out), "--json"];
                if model_only {
                    args.push("--model-only");
                }
                let summary: serde_json::Value =
                    serde_json::from_str(&ok(&run(&args), case)).unwrap();
                let got = safetensors_of(&out);
                // One copy of a tied weight: every name but the aliases, values bit for bit.
                let aliases: Vec<&str> = want.ties.iter().map(|(a, _)| a.as_str()).collect();
                let names: Vec<&String> = want
                    .keys
                    .iter()
                    .filter(|k| !aliases.contains(&k.as_str()))
                    .collect();
                assert_eq!(
                    got.keys().collect::<Vec<_>>().len(),
                    names.len(),
                    "{case}: {:?}",
                    got.keys()
                );
                for name in names {
                    assert_eq!(got.get(name), want.tensors.get(name), "{case}: {name}");
                }
                let dropped = summary["tied_dropped"].as_array().unwrap();
                assert_eq!(dropped.len(), want.ties.len(), "{case}: {summary}");
                for (alias, name) in &want.ties {
                    assert!(
                        dropped
                            .iter()
                            .any(|d| d["dropped"] == alias.as_str() && d["kept"] == name.as_str()),
                        "{case}: {alias} -> {name}: {summary}"
                    );
                }
            }
        }
    }
}

/// Compares `.pt` outputs with zero_to_fp32's state dict in torch: the same keys in the same
/// order, each tensor equal in dtype, shape and bits, tied names one storage; ZeRO-1's frozen
/// parameters (which zero_to_fp32 leaves out) as the live engine's module holds them. Prints `OK`.
const SAME_AS_ZERO_TO_FP32: &str = r#"
import json, sys, torch
from safetensors.torch import load_file
got = torch.load(sys.argv[1], weights_only=True)
want = load_file(sys.argv[2])
meta = json.load(open(sys.argv[3]))
live = load_file(sys.argv[4])
# The frozen parameters zero_to_fp32 leaves out (ZeRO-1), as the live engine's module holds them,
# before the first trainable parameter.
keys = list(meta["keys"])
trainable = {k[len("param."):] for k in live if k.startswith("param.")}
for k, v in live.items():
    name = k[len("frozen."):]
    if k.startswith("frozen.") and name not in want:
        keys.insert(next(i for i, n in enumerate(keys) if n in trainable), name)
        want[name] = v
assert list(got.keys()) == keys, (list(got.keys()), keys)
for k in keys:
    a, b = got[k], want[k]
    assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), k
for alias, name in meta["ties"]:
    assert got[alias].untyped_storage().data_ptr() == got[name].untyped_storage().data_ptr(), (alias, name)
print("OK")
"#;

#[test]
fn convert_model_only_to_torch_save_is_zero_to_fp32() {
    let Some(py) = python() else {
        eprintln!("skipped: no Python with torch");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    for case in deepspeed_cases() {
        let out = tmp.path().join(format!("{case}.pt"));
        ok(
            &run(&[
                "convert",
                s(&deepspeed().join(case)),
                "--model-only",
                "-o",
                s(&out),
                "-q",
            ]),
            case,
        );
        let dir = deepspeed().join("expected");
        let args = [
            out,
            dir.join(format!("{case}.zero_to_fp32.safetensors")),
            dir.join(format!("{case}.json")),
            dir.join(format!("{case}.live.safetensors")),
        ];
        python_ok(&py, SAME_AS_ZERO_TO_FP32, &args, case);
    }
}

/// Runs the Python `script` with torch on `args`; it must print `OK`.
pub(crate) fn python_ok(py: &Path, script: &str, args: &[PathBuf], what: &str) {
    let check = Command::new(py)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(
        text.lines().any(|l| l == "OK"),
        "{what}: {text}\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

/// Copies the fixture `case` into a fresh folder under `tmp`.
pub(crate) fn copy_case(case: &str, tmp: &Path) -> PathBuf {
    let from = deepspeed().join(case);
    let to = tmp.join(case);
    let tag = to.join("global_step2");
    std::fs::create_dir_all(&tag).unwrap();
    std::fs::copy(from.join("latest"), to.join("latest")).unwrap();
    for e in std::fs::read_dir(from.join("global_step2")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, tag.join(p.file_name().unwrap())).unwrap();
    }
    to
}

pub(crate) fn fails(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{args:?} succeeded:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn damaged_folders_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    // A missing rank.
    let dir = copy_case("zero3_bf16", tmp.path());
    let gone = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt";
    std::fs::remove_file(dir.join("global_step2").join(gone)).unwrap();
    let out = tmp.path().join("a.safetensors");
    let err = fails(&["convert", s(&dir), "-o", s(&out)]);
    assert!(
        err.contains(&format!("missing: global_step2/{gone}")),
        "{err}"
    );
    assert!(!out.exists());
    // A truncated file.
    let dir = copy_case("zero2_fp32", &tmp.path().join("t"));
    let file = dir
        .join("global_step2")
        .join("zero_pp_rank_1_mp_rank_00_optim_states.pt");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&["inspect", s(&dir)]);
    assert!(
        err.contains("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "{err}"
    );
    // Stages mixed: ZeRO-3 model files beside ZeRO-2 optimizer files.
    let dir = copy_case("zero2_fp32", &tmp.path().join("m"));
    for r in 0..2 {
        let name = format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt");
        std::fs::copy(
            deepspeed().join("zero3_fp32/global_step2").join(&name),
            dir.join("global_step2").join(&name),
        )
        .unwrap();
    }
    let err = fails(&["inspect", s(&dir)]);
    assert!(err.contains("ZeRO stages mixed"), "{err}");
}

/// Compares a whole `.pt` output with DeepSpeed's references in torch: the model as
/// zero_to_fp32 gives it, and `optimizer` in the shape of torch's FQN-keyed full optimizer state
/// dict, its `exp_avg`/`exp_avg_sq` equal bit for bit to the live engine's
/// `safe_get_full_optimizer_state`. Prints `OK`.
const OPTIMIZER_AS_THE_LIVE_ENGINE: &str = r#"
import json, sys, torch
from safetensors.torch import load_file
got = torch.load(sys.argv[1], weights_only=True)
want = load_file(sys.argv[2])
live = load_file(sys.argv[3])
meta = json.load(open(sys.argv[4]))
for k in meta["keys"]:
    assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
opt = got["optimizer"]
assert set(opt) == {"state", "param_groups"}, set(opt)
names = [k.split(".", 1)[1] for k in live if k.startswith("exp_avg.")]
assert sorted(opt["state"]) == sorted(names), (sorted(opt["state"]), names)
for n in names:
    s = opt["state"][n]
    assert s["step"].dim() == 0 and float(s["step"]) == 2.0, s["step"]
    for k in ("exp_avg", "exp_avg_sq"):
        assert s[k].dtype == torch.float32 and torch.equal(s[k].view(torch.uint8), live[f"{k}.{n}"].view(torch.uint8)), (n, k)
params = [p for g in opt["param_groups"] for p in g["params"]]
assert sorted(params) == sorted(names), params
assert opt["param_groups"][0]["weight_decay"] == 0.1 and opt["param_groups"][0]["betas"] == (0.9, 0.95), opt["param_groups"][0]
print("OK")
"#;

#[test]
fn convert_to_torch_save_holds_the_optimizer_per_parameter() {
    let Some(py) = python() else {
        eprintln!("skipped: no Python with torch");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    for case in deepspeed_cases() {
        let out = tmp.path().join(format!("{case}.pt"));
        ok(
            &run(&["convert", s(&deepspeed().join(case)), "-o", s(&out), "-q"]),
            case,
        );
        let dir = deepspeed().join("expected");
        let args = [
            out,
            dir.join(format!("{case}.zero_to_fp32.safetensors")),
            dir.join(format!("{case}.live.safetensors")),
            dir.join(format!("{case}.json")),
        ];
        python_ok(&py, OPTIMIZER_AS_THE_LIVE_ENGINE, &args, case);
    }
}

/// `convert <case> -o dcp --world-size N` (N = 2, 3) for every case loads into a fresh FSDP2 model
/// and AdamW on N gloo ranks (`dcp.load` into `get_model_state_dict` + `get_optimizer_state_dict`,
/// then `set_model_state_dict` / `set_optimizer_state_dict`), every parameter, moment and step
/// equal to what DeepSpeed wrote, and trains one more step; a moment changed in DeepSpeed's file
/// is caught (tests/interop/check_deepspeed_fsdp2.py).
#[test]
fn dcp_for_n_ranks_loads_into_fsdp2_and_trains_on() {
    crate::common::run_interop_script("check_deepspeed_fsdp2.py");
}

/// Replaces the one occurrence of `from` in `file` with `to` (the same length: the `data.pkl` member
/// keeps its size, so the archive stays readable).
fn patch_once(file: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(file).unwrap();
    let at: Vec<usize> = bytes
        .windows(from.len())
        .enumerate()
        .filter(|(_, w)| *w == from)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "{}", String::from_utf8_lossy(from));
    bytes[at[0]..at[0] + to.len()].copy_from_slice(to);
    std::fs::write(file, bytes).unwrap();
}

/// `doctor` on DeepSpeed's folders: the optimizer files name DeepSpeed's own record classes
/// (`ZeroStageEnum`, `LossScaler`, `fragment_address`), which torch's `weights_only` load refuses:
/// a `deepspeed-pickle` warning, the checkpoint loadable (exit 0). Any other global in such a file
/// (here DeepSpeed's enum renamed, and a class of another module) stays an `unsafe-pickle` error.
#[test]
fn doctor_knows_deepspeed_records_from_unsafe_pickles() {
    for case in deepspeed_cases() {
        let out = run(&["doctor", s(&deepspeed().join(case)), "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(out.status.code(), Some(0), "{case}: {report}");
        let codes: Vec<&str> = report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["code"].as_str().unwrap())
            .collect();
        assert!(codes.contains(&"deepspeed-pickle"), "{case}: {report}");
        assert!(!codes.contains(&"unsafe-pickle"), "{case}: {report}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let optim = "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt";
    for (i, (from, to, named)) in [
        (
            &b"ZeroStageEnum\n"[..],
            &b"ZeroStageEnuX\n"[..],
            "deepspeed.runtime.zero.config.ZeroStageEnuX",
        ),
        (
            &b"deepspeed.runtime.fp16.loss_scaler\nLossScaler\n"[..],
            &b"subprocess.xxxxxxxxxxxxxxxxxxxxxxx\nPopenXxxxx\n"[..],
            "subprocess.xxxxxxxxxxxxxxxxxxxxxxx.PopenXxxxx",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = copy_case("zero2_fp32", &tmp.path().join(i.to_string()));
        patch_once(&dir.join(optim), from, to);
        let out = run(&["doctor", s(&dir), "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(out.status.code(), Some(1), "{report}");
        let findings = report["findings"].as_array().unwrap();
        let unsafe_pickle = findings
            .iter()
            .find(|f| f["code"] == "unsafe-pickle" && f["keys"][0] == optim)
            .unwrap_or_else(|| panic!("no unsafe-pickle for {optim}: {report}"));
        let message = unsafe_pickle["message"].as_str().unwrap();
        assert!(message.contains(named), "{message}");
        if i == 1 {
            // The folder still reads as DeepSpeed's: rank 0's untouched file stays a warning.
            let rank0 = optim.replace("rank_1", "rank_0");
            assert!(
                findings
                    .iter()
                    .any(|f| f["code"] == "deepspeed-pickle" && f["keys"][0] == rank0.as_str()),
                "{report}"
            );
        }
    }
}

/// `diff <case> --model-only` against DeepSpeed's own `zero_to_fp32` state dict is equal for every
/// case (but ZeRO-1's frozen parameter, which zero_to_fp32 leaves out: the one key missing there); a copy with one fp32 master weight changed in DeepSpeed's optimizer file differs from it in
/// exactly that parameter and its tie (exit 1, the names and the element).
#[test]
fn diff_against_zero_to_fp32_finds_a_changed_master_weight() {
    for case in deepspeed_cases() {
        let reference = deepspeed()
            .join("expected")
            .join(format!("{case}.zero_to_fp32.safetensors"));
        let out = run(&[
            "diff",
            s(&deepspeed().join(case)),
            s(&reference),
            "--model-only",
        ]);
        if !case.starts_with("zero1") {
            ok(&out, case);
            continue;
        }
        // ZeRO-1's frozen parameter, which zero_to_fp32 leaves out, is the one difference.
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{case}: {stdout}");
        let differ: Vec<&str> = stdout
            .lines()
            .filter(|l| {
                ["MISSING", "MISMATCH", "UNEXPECTED"]
                    .iter()
                    .any(|w| l.starts_with(w))
            })
            .collect();
        assert_eq!(differ.len(), 1, "{case}: {stdout}");
        assert!(
            differ[0].starts_with("MISSING    frozen.weight "),
            "{case}: {stdout}"
        );
    }
    // ZeRO-3 on 2 ranks: rank 1's flat group 0 starts with embed.weight's elements 33.. (each rank
    // holds ceil(66 / 2) = 33 of them), found by their bytes in DeepSpeed's file.
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_case("zero3_fp32", tmp.path());
    let want = expected("zero3_fp32");
    let embed = &want.tensors["embed.weight"].2;
    let part = &embed[33 * 4..41 * 4];
    let mut changed = part.to_vec();
    changed[..4].copy_from_slice(
        &(f32::from_le_bytes(part[..4].try_into().unwrap()) * 2.0 + 1.0).to_le_bytes(),
    );
    let file = dir
        .join("global_step2")
        .join("zero_pp_rank_1_mp_rank_00_optim_states.pt");
    patch_once(&file, part, &changed);
    let reference = deepspeed()
        .join("expected")
        .join("zero3_fp32.zero_to_fp32.safetensors");
    let out = run(&["diff", s(&dir), s(&reference), "--model-only"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let mismatches: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("MISMATCH"))
        .collect();
    // The parameter and its tie (`head.weight` is `embed.weight`), element 33 = [5, 3].
    assert_eq!(mismatches.len(), 2, "{stdout}");
    for (line, name) in mismatches.iter().zip(["embed.weight", "head.weight"]) {
        assert!(
            line.contains(&format!("MISMATCH   {name} ")) && line.contains("first at [5, 3]"),
            "{stdout}"
        );
    }
}

/// `doctor` on a DeepSpeed save that does not read as one (a missing rank, ZeRO stages mixed):
/// one `deepspeed-folder` error with the reader's message naming the file, exit 1; its files are
/// not diagnosed as loose `torch.save` files (no `unsafe-pickle` for DeepSpeed's own records, no
/// coverage of `module`).
#[test]
fn doctor_names_what_breaks_a_deepspeed_save() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = copy_case("zero3_bf16", &tmp.path().join("missing"));
    let gone = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt";
    std::fs::remove_file(missing.join("global_step2").join(gone)).unwrap();
    let mixed = copy_case("zero2_fp32", &tmp.path().join("mixed"));
    for r in 0..2 {
        let name = format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt");
        std::fs::copy(
            deepspeed().join("zero3_fp32/global_step2").join(&name),
            mixed.join("global_step2").join(&name),
        )
        .unwrap();
    }
    for (dir, want) in [
        (&missing, format!("missing: global_step2/{gone}")),
        (&mixed, "ZeRO stages mixed".to_owned()),
    ] {
        let out = run(&["doctor", s(dir), "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(out.status.code(), Some(1), "{report}");
        let findings = report["findings"].as_array().unwrap();
        // The files' own pickles are still reported (DeepSpeed's records: warnings).
        assert!(
            findings
                .iter()
                .all(|f| f["code"] == "deepspeed-folder" || f["code"] == "deepspeed-pickle"),
            "{report}"
        );
        let errors: Vec<&serde_json::Value> = findings
            .iter()
            .filter(|f| f["code"] == "deepspeed-folder")
            .collect();
        assert_eq!(errors.len(), 1, "{report}");
        assert!(
            errors[0]["message"].as_str().unwrap().contains(&want),
            "{report}"
        );
    }
}
