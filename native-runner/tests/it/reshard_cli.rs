//! `shardscope reshard` (`shardscope_runner::fsdp1_local`) and the per-rank convert:
//!
//! - interop with real torch (`tests/interop/fsdp1_reshard.py`): a gloo CPU job trains FSDP1
//!   NestedModel for 2 Adam steps and saves per-rank LOCAL model and raw optimizer state dicts plus
//!   torch's own FULL dicts; we reshard 2→4 (and 4→2 with `use_orig_params`); the new world size
//!   loads our files with `LOCAL_STATE_DICT` + `optim.load_state_dict` and must hold the same
//!   parameters and optimizer state as torch's own `optim_state_dict_to_load` path, also after one
//!   more step. `convert` must equal torch's `FULL_STATE_DICT` and `FSDP.optim_state_dict`.
//!   HYBRID_SHARD too: torch trains on 2 replicas x 2 ranks (explicit shard/replicate groups of a
//!   2-D device mesh) and saves the first replica's files; we reshard to 2 x 3 (every new rank
//!   loads its own files) and, with `use_orig_params`, to FULL_SHARD on 2 ranks. NO_SHARD (whose
//!   per-rank files torch writes as FULL state dicts) to FULL_SHARD and back. FSDP2 per-rank
//!   folders (torch-written fixtures, 1-D and HSDP meshes) to FSDP1 LOCAL files (`--to-api
//!   fsdp1`, with and without `use_orig_params`): torch loads them at the new world size and
//!   matches its own path from the fixtures' full state dicts.
//! - atomicity: `reshard` killed with SIGKILL at 20 pseudo-random moments leaves the destination
//!   absent or complete (byte-identical to an uninterrupted run) and the inputs unchanged.
//! - CLI errors: exit code 2 and messages naming the file.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use crate::common::python;

use shardscope_core::bridge::{self, RootDict};
use shardscope_core::layout::Strategy;
use shardscope_core::model::tree::{Dict, Key, Node};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/optim")
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/fsdp1_reshard.py")
}

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .unwrap()
}

fn run_python(python: &Path, args: &[&str]) {
    run_python_env(python, args, &[]);
}

/// `fsdp1_reshard.py` with environment variables (`FSDP1_PARAM_DTYPE`: wrap with
/// `MixedPrecision(param_dtype=...)`).
fn run_python_env(python: &Path, args: &[&str], env: &[(&str, &str)]) {
    let out = Command::new(python)
        .arg(script())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fsdp1_reshard.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read(path: &Path) -> Node {
    bridge::node_from_torch_save(&std::fs::read(path).unwrap(), &path.display().to_string())
        .unwrap()
}

/// Sorts the names inside each `state/<fqn>` entry: torch builds them from a Python set.
fn sorted_state(node: &Node) -> Node {
    let d = node.as_dict().unwrap();
    let mut out = Dict::new();
    for (k, v) in d.iter() {
        if k.as_str() == Some("state") {
            let mut state = Dict::new();
            for (pk, pv) in v.as_dict().unwrap().iter() {
                let mut items: Vec<(Key, Node)> = pv.as_dict().unwrap().clone().into_entries();
                items.sort_by(|a, b| a.0.cmp(&b.0));
                state.insert(pk.clone(), Node::Dict(items.into_iter().collect()));
            }
            out.insert(k.clone(), Node::Dict(state));
        } else {
            out.insert(k.clone(), v.clone());
        }
    }
    Node::Dict(out)
}

fn interop(from: usize, to: usize, uop: bool) {
    interop_with(from, "0", to, "0", uop, &[], &[]);
}

/// `from` ranks resharded to `to` ranks; `from_shard`/`to_shard` say how torch wraps each side:
/// `"0"` FULL_SHARD, `"no_shard"`, or a hybrid shard group size (torch then writes the first
/// replica's files only). `flags` go to `reshard`, `convert_flags` to `convert`.
fn interop_with(
    from: usize,
    from_shard: &str,
    to: usize,
    to_shard: &str,
    uop: bool,
    flags: &[&str],
    convert_flags: &[&str],
) {
    interop_env(
        from,
        from_shard,
        to,
        to_shard,
        uop,
        flags,
        convert_flags,
        ("nested", &[]),
    );
}

/// [`interop_with`] for `fsdp1_reshard.py`'s model `model` (`nested`, or `net` with the
/// description of tests/fixtures/fsdp2_optim), torch's side run with `env` (see
/// [`run_python_env`]).
#[allow(clippy::too_many_arguments)]
#[allow(
    clippy::too_many_lines,
    reason = "one interop case end to end: torch writes the folder, then reshard, convert and the torch check, in order"
)]
fn interop_env(
    from: usize,
    from_shard: &str,
    to: usize,
    to_shard: &str,
    uop: bool,
    flags: &[&str],
    convert_flags: &[&str],
    (model, env): (&str, &[(&str, &str)]),
) {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let dst = tmp.path().join("dst");
    let uop_arg = if uop { "1" } else { "0" };
    run_python_env(
        &python,
        &[
            "make",
            src.to_str().unwrap(),
            &from.to_string(),
            uop_arg,
            from_shard,
            model,
        ],
        env,
    );
    let model_json = if model == "nested" {
        fixtures().join("nested_ws2_uop0/model.json")
    } else {
        fixtures().join("../fsdp2_optim/model.json")
    };
    let mut args = vec![
        "reshard",
        src.to_str().unwrap(),
        "-o",
        dst.to_str().unwrap(),
        "--model",
        model_json.to_str().unwrap(),
        "--json",
    ];
    let to_s = to.to_string();
    args.extend(["--to-world-size", &to_s]);
    if uop {
        args.push("--use-orig-params");
    }
    args.extend(flags);
    let out = shardscope(&args);
    assert!(
        out.status.success(),
        "reshard failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["files"].as_array().unwrap().len(), 2 * to);
    run_python_env(
        &python,
        &[
            "check",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
            &to.to_string(),
            uop_arg,
            to_shard,
            model,
        ],
        env,
    );

    // `shardscope convert` on the per-rank folder: equal to torch's FULL_STATE_DICT and
    // FSDP.optim_state_dict.
    let outdir = tempfile::tempdir().unwrap();
    let model_pt = outdir.path().join("full.pt");
    let mut args = vec![
        "convert".to_owned(),
        src.to_str().unwrap().to_owned(),
        "-o".to_owned(),
        model_pt.to_str().unwrap().to_owned(),
        "--model".to_owned(),
        model_json.to_str().unwrap().to_owned(),
        "--quiet".to_owned(),
    ];
    if uop {
        args.push("--use-orig-params".to_owned());
    }
    args.extend(convert_flags.iter().map(|f| (*f).to_owned()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = shardscope(&argv);
    assert!(out.status.success(), "convert failed: {}", stderr_of(&out));
    let torch_model = read(&src.join("full/full_model.pt"));
    let ours = read(&model_pt);
    assert_eq!(
        ours, torch_model,
        "full model state dict differs from torch's"
    );
    let torch_optim = read(&src.join("full/full_optim.pt"));
    let ours = read(&outdir.path().join("full.optim.pt"));
    assert_eq!(
        sorted_state(&ours),
        sorted_state(&torch_optim),
        "full optimizer state dict differs from torch's"
    );
    // The same model as safetensors (each tied weight once, as `save_pretrained` writes it).
    std::fs::create_dir(outdir.path().join("st")).unwrap();
    let st_path = outdir.path().join("st/full.safetensors");
    let mut args = args.clone();
    st_path.to_str().unwrap().clone_into(&mut args[3]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = shardscope(&argv);
    assert!(out.status.success(), "convert failed: {}", stderr_of(&out));
    assert!(outdir.path().join("st/full.optim.pt").exists());
    let st_bytes = std::fs::read(&st_path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    let torch_model = torch_model.as_dict().unwrap();
    assert!(st.len() <= torch_model.len() && !st.is_empty());
    for (k, v) in torch_model.iter() {
        let t = v.as_tensor().unwrap();
        let Ok(view) = st.tensor(&k.to_string()) else {
            continue;
        };
        assert_eq!(view.data(), t.data.as_slice(), "{k}");
    }
}

/// FSDP1 under `MixedPrecision(param_dtype=bfloat16)` with `use_orig_params`: the flat
/// parameter's alignment padding counts bfloat16 elements (8 per 16 bytes; the `Net` of the FSDP2
/// fixtures then has 66 elements in its root flat parameter instead of 51), so the folder reads
/// only with `--param-dtype bfloat16`: reshard 3 -> 2 (torch loads at 2 ranks with the same mixed
/// precision) and convert (equal to torch's FULL_STATE_DICT and `FSDP.optim_state_dict`).
#[test]
fn interop_reshard_mixed_precision_3_to_2_use_orig_params() {
    let dtype = ["--param-dtype", "bfloat16"];
    interop_env(
        3,
        "0",
        2,
        "0",
        true,
        &dtype,
        &dtype,
        ("net", &[("FSDP1_PARAM_DTYPE", "bfloat16")]),
    );
}

#[test]
fn interop_reshard_2_to_4() {
    interop(2, 4, false);
}

#[test]
fn interop_reshard_4_to_2_use_orig_params() {
    interop(4, 2, true);
}

/// HYBRID_SHARD (2 replicas x 2) to HYBRID_SHARD (2 replicas x 3): every one of the 6 new ranks
/// loads its own files (ShardedTensors of the shard group) and matches torch's own path.
#[test]
fn interop_reshard_hybrid_2x2_to_2x3() {
    let hybrid = ["--strategy", "hybrid_shard", "--shard-group-size", "2"];
    let mut flags = hybrid.to_vec();
    flags.extend(["--to-shard-group-size", "3"]);
    interop_with(4, "2", 6, "3", false, &flags, &hybrid);
}

/// HYBRID_SHARD with use_orig_params (2 replicas x 2) to FULL_SHARD on 2 ranks.
#[test]
fn interop_reshard_hybrid_to_full_shard_use_orig_params() {
    let hybrid = ["--strategy", "hybrid_shard", "--shard-group-size", "2"];
    let mut flags = hybrid.to_vec();
    flags.extend(["--to-strategy", "full_shard"]);
    interop_with(4, "2", 2, "0", true, &flags, &hybrid);
}

/// NO_SHARD (torch saves FULL state dicts on every rank) to FULL_SHARD on 3 ranks.
#[test]
fn interop_reshard_no_shard_to_full_shard() {
    let no_shard = ["--strategy", "no_shard"];
    let mut flags = no_shard.to_vec();
    flags.extend(["--to-strategy", "full_shard"]);
    interop_with(2, "no_shard", 3, "0", false, &flags, &no_shard);
}

/// FULL_SHARD with use_orig_params on 2 ranks to NO_SHARD on 3.
#[test]
fn interop_reshard_full_shard_to_no_shard_use_orig_params() {
    interop_with(
        2,
        "0",
        3,
        "no_shard",
        true,
        &["--to-strategy", "no_shard"],
        &[],
    );
}

/// A checkpoint of full tensors (torch's FULL_STATE_DICT and `FSDP.optim_state_dict`, saved by
/// torch as one `{"model", "optim"}` file) resharded to FSDP1 LOCAL files for 3 ranks, with and
/// without `use_orig_params`: torch loads them and matches its own path, also after one more step.
#[test]
fn interop_reshard_from_full_checkpoint() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    run_python(&python, &["make", src.to_str().unwrap(), "2", "0", "0"]);
    let full = tmp.path().join("full.pt");
    let out = Command::new(&python)
        .args([
            "-c",
            "import sys, torch; torch.save({'model': torch.load(sys.argv[1] + '/full/full_model.pt', weights_only=True), 'optim': torch.load(sys.argv[1] + '/full/full_optim.pt', weights_only=True)}, sys.argv[2])",
            src.to_str().unwrap(),
            full.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model_json = fixtures().join("nested_ws2_uop0/model.json");
    for uop in [false, true] {
        let dst = tmp.path().join(format!("dst{uop}"));
        let out = shardscope(&[
            "reshard",
            full.to_str().unwrap(),
            "-o",
            dst.to_str().unwrap(),
            "--model",
            model_json.to_str().unwrap(),
            "--to-world-size",
            "3",
            "--to-use-orig-params",
            if uop { "true" } else { "false" },
            "--json",
        ]);
        assert!(out.status.success(), "reshard failed: {}", stderr_of(&out));
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(summary["files"].as_array().unwrap().len(), 6, "{summary}");
        assert!(summary["from_world_size"].is_null(), "{summary}");
        run_python(
            &python,
            &[
                "check",
                src.to_str().unwrap(),
                dst.to_str().unwrap(),
                "3",
                if uop { "1" } else { "0" },
                "0",
            ],
        );
    }
    // Layout flags of a per-rank folder do not apply to full tensors.
    let out = shardscope(&[
        "reshard",
        full.to_str().unwrap(),
        "-o",
        tmp.path().join("bad").to_str().unwrap(),
        "--model",
        model_json.to_str().unwrap(),
        "--to-world-size",
        "3",
        "--use-orig-params",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("--use-orig-params"),
        "{}",
        stderr_of(&out)
    );
    assert!(!tmp.path().join("bad").exists());
}

/// A DCP directory (torch-written: `examples/fsdp2_dcp`, FSDP2 + AdamW) resharded to FSDP2 and
/// FSDP1 per-rank files gives the files that resharding torch's own `dcp_to_torch_save` of it
/// gives, byte for byte (that path loads in torch: the tests above). DCP keeps the optimizer's
/// `param_groups` values as pickled bytes items; they must reach the outputs as the Python values
/// torch saved (`betas` a tuple), not be refused as "not a list of parameter names".
#[test]
fn reshard_of_a_dcp_equals_reshard_of_torch_own_full_save() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let dcp = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/fsdp2_dcp");
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full.pt");
    let out = Command::new(&python)
        .args([
            "-c",
            "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])",
            dcp.to_str().unwrap(),
            full.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let model = tmp.path().join("model.json");
    let out = shardscope(&[
        "layout",
        "--from",
        dcp.to_str().unwrap(),
        "--select",
        "model",
        "--units",
        r"layers\.\d+",
        "--root-unit",
        "--world-size",
        "2",
        "--emit-model",
        model.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    for api in ["fsdp2", "fsdp1"] {
        let mut outputs = Vec::new();
        for (name, src) in [("from_dcp", &dcp), ("from_full", &full)] {
            let dst = tmp.path().join(format!("{name}_{api}"));
            let out = shardscope(&[
                "reshard",
                src.to_str().unwrap(),
                "-o",
                dst.to_str().unwrap(),
                "--model",
                model.to_str().unwrap(),
                "--to-world-size",
                "3",
                "--to-api",
                api,
                "-q",
            ]);
            assert!(
                out.status.success(),
                "reshard {name} --to-api {api}: {}",
                stderr_of(&out)
            );
            outputs.push(snapshot(&dst));
        }
        assert_eq!(outputs[0].len(), 6, "{api}: 3 model + 3 optimizer files");
        for (a, b) in outputs[0].iter().zip(&outputs[1]) {
            assert_eq!(a.0, b.0);
            assert!(a.1 == b.1, "{api}: {} differs", a.0);
        }
    }
}

/// torch's `{"model", "optim"}` file of full state dicts split into `dir/full/full_model.pt` and
/// `dir/full/full_optim.pt`, where `fsdp1_reshard.py check` reads torch's own path from.
fn split_full(python: &Path, full: &Path, dir: &Path) {
    std::fs::create_dir_all(dir.join("full")).unwrap();
    let out = Command::new(python)
        .args([
            "-c",
            "import sys, torch; f = torch.load(sys.argv[1], weights_only=True); torch.save(f['model'], sys.argv[2] + '/full/full_model.pt'); torch.save(f['optim'], sys.argv[2] + '/full/full_optim.pt')",
            full.to_str().unwrap(),
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
}

/// FSDP2 per-rank folders written by torch 2.15 (`rank{r}_model.pt` + `rank{r}_optim.pt`,
/// DTensors of `Net` from tests/fixtures/fsdp2_optim: a 1-D mesh of 2 ranks, and the HSDP 2x2
/// folder of tests/fixtures/fsdp2_hsdp) resharded to FSDP1 LOCAL files (`--to-api fsdp1`) for 3
/// and 2 ranks. torch wraps `Net` with FSDP1 at the new world size, loads our files with
/// `LOCAL_STATE_DICT` + `optim.load_state_dict`, and must hold the same parameters, LOCAL state
/// dicts and optimizer state, bit for bit, as torch's own path from the fixture's full state dicts
/// (`expected/*_full.pt`: FULL_STATE_DICT + `optim_state_dict_to_load`), also after one more step;
/// our model files must equal torch's own LOCAL state dicts.
///
/// With the fixture's description (units `block` and the root) the root unit mixes frozen and
/// trainable parameters, which FSDP1 flattens only with `use_orig_params=True`: without it
/// `reshard` refuses with torch's reason and writes nothing. With `frozen` and `head` as units too
/// every flat parameter has one `requires_grad` and one parameter group, and the output is flat
/// parameters with flat optimizer state (`use_orig_params=False`).
#[test]
fn interop_reshard_from_fsdp2_folder() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let fsdp2 = fixtures().join("..");
    let model_json = fsdp2.join("fsdp2_optim/model.json");
    let tmp = tempfile::tempdir().unwrap();
    let split_json = tmp.path().join("split.json");
    let mut desc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&model_json).unwrap()).unwrap();
    desc["units"] = serde_json::json!(["", "block", "frozen", "head"]);
    std::fs::write(&split_json, serde_json::to_vec(&desc).unwrap()).unwrap();
    let ws2 = ("fsdp2_optim/ws2", "fsdp2_optim/expected/ws2_full.pt", 2);
    let hsdp = (
        "fsdp2_hsdp/ws4_2x2",
        "fsdp2_hsdp/expected/ws4_2x2_full.pt",
        4,
    );
    // (source, torch's full state dicts, source world size), description, B, use_orig_params,
    // the model `fsdp1_reshard.py check` wraps.
    for (i, ((src, expected, from), model, to, uop, net)) in [
        (ws2, &model_json, 3, true, "net"),
        (hsdp, &model_json, 2, true, "net"),
        (ws2, &split_json, 3, false, "net_split"),
    ]
    .into_iter()
    .enumerate()
    {
        let src = fsdp2.join(src);
        let dst = tmp.path().join(format!("dst{i}"));
        let to_s = to.to_string();
        let out = shardscope(&[
            "reshard",
            src.to_str().unwrap(),
            "-o",
            dst.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--to-api",
            "fsdp1",
            "--to-world-size",
            &to_s,
            "--to-use-orig-params",
            if uop { "true" } else { "false" },
            "--json",
        ]);
        assert!(out.status.success(), "reshard failed: {}", stderr_of(&out));
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(summary["from_world_size"], from, "{summary}");
        let mut names: Vec<String> = summary["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap().to_owned())
            .collect();
        names.sort();
        let mut want: Vec<String> = (0..to)
            .flat_map(|r| [format!("model_rank{r}.pt"), format!("optim_rank{r}.pt")])
            .collect();
        want.sort();
        assert_eq!(names, want, "{summary}");
        // torch's own path reads the fixture's full state dicts (never our output).
        let reference = tmp.path().join(format!("ref{i}"));
        split_full(&python, &fsdp2.join(expected), &reference);
        run_python(
            &python,
            &[
                "check",
                reference.to_str().unwrap(),
                dst.to_str().unwrap(),
                &to_s,
                if uop { "1" } else { "0" },
                "0",
                net,
            ],
        );
    }
    // Without use_orig_params FSDP1 cannot flatten the fixture's root unit: a clear error, nothing
    // left.
    let bad = tmp.path().join("bad");
    let out = shardscope(&[
        "reshard",
        fsdp2.join("fsdp2_optim/ws2").to_str().unwrap(),
        "-o",
        bad.to_str().unwrap(),
        "--model",
        model_json.to_str().unwrap(),
        "--to-api",
        "fsdp1",
        "--to-world-size",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("uniform `requires_grad`"),
        "{}",
        stderr_of(&out)
    );
    assert!(!bad.exists());
}

/// A per-rank folder made without torch: the LOCAL model and raw optimizer state dicts of the
/// `nested_ws2_uop0` fixture (written by torch), rewritten one object per file.
fn fixture_folder(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for rank in 0..2 {
        let bundle = read(&fixtures().join(format!("nested_ws2_uop0/rank{rank}.pt")));
        let bundle = bundle.as_dict().unwrap();
        for (key, name, root) in [
            ("model_local", "model_rank", RootDict::Ordered),
            ("optim_local", "optim_rank", RootDict::Plain),
        ] {
            let node = bundle.get_str(key).unwrap();
            let bytes = bridge::to_torch_save(node, root, rank, 2).unwrap();
            std::fs::write(dir.join(format!("{name}{rank}.pt")), bytes).unwrap();
        }
    }
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn sigkill_leaves_no_partial_output_and_inputs_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fixture_folder(&src);
    let before = snapshot(&src);
    let model_json = fixtures().join("nested_ws2_uop0/model.json");
    let args = |dst: &Path| {
        vec![
            "reshard".to_owned(),
            src.display().to_string(),
            "-o".to_owned(),
            dst.display().to_string(),
            "--model".to_owned(),
            model_json.display().to_string(),
            "--to-world-size".to_owned(),
            "3".to_owned(),
        ]
    };
    // The reference output and how long a full run takes.
    let reference_dir = tmp.path().join("reference");
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args(&reference_dir))
        .output()
        .unwrap();
    let full_run = start.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = snapshot(&reference_dir);
    assert_eq!(reference.len(), 6);

    let mut seed: u64 = 0x5eed_1234;
    let (mut absent, mut complete) = (0, 0);
    for i in 0..20 {
        // xorshift: kill points spread over 0..120% of a full run.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = full_run.mul_f64((seed % 1200) as f64 / 1000.0);
        let dst = tmp.path().join(format!("dst{i}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_shardscope"))
            .args(args(&dst))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        let _ = child.kill(); // SIGKILL on Unix
        let _ = child.wait();
        if dst.exists() {
            assert_eq!(snapshot(&dst), reference, "run {i}: partial destination");
            complete += 1;
        } else {
            absent += 1;
        }
        assert_eq!(snapshot(&src), before, "run {i}: inputs changed");
    }
    eprintln!("sigkill: {absent} runs left no destination, {complete} a complete one");
    assert_eq!(absent + complete, 20);
}

#[test]
fn output_is_deterministic_and_reshard_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fixture_folder(&src);
    let model_json = fixtures().join("nested_ws2_uop0/model.json");
    let m = model_json.to_str().unwrap();
    let run = |from: &Path, to: &Path, ws: &str| {
        let out = shardscope(&[
            "reshard",
            from.to_str().unwrap(),
            "-o",
            to.to_str().unwrap(),
            "--model",
            m,
            "--to-world-size",
            ws,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (a, b, back) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("back"),
    );
    run(&src, &a, "3");
    run(&src, &b, "3");
    assert_eq!(snapshot(&a), snapshot(&b), "same input, different bytes");
    // 2 → 3 → 2 gives back the torch-written LOCAL state dicts and optimizer state.
    run(&a, &back, "2");
    for rank in 0..2 {
        let bundle = read(&fixtures().join(format!("nested_ws2_uop0/rank{rank}.pt")));
        let bundle = bundle.as_dict().unwrap();
        assert_eq!(
            &read(&back.join(format!("model_rank{rank}.pt"))),
            bundle.get_str("model_local").unwrap(),
            "rank {rank} model"
        );
        assert_eq!(
            sorted_state(&read(&back.join(format!("optim_rank{rank}.pt")))),
            sorted_state(bundle.get_str("optim_local").unwrap()),
            "rank {rank} optimizer"
        );
    }
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
#[allow(
    clippy::too_many_lines,
    reason = "one case per refused input, each with its expected message"
)]
fn bad_inputs_exit_2_and_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fixture_folder(&src);
    let model_json = fixtures().join("nested_ws2_uop0/model.json");
    let m = model_json.to_str().unwrap();
    let s = src.to_str().unwrap();
    let dst = tmp.path().join("dst");
    let d = dst.to_str().unwrap();

    // Missing source folder.
    let missing = tmp.path().join("nope");
    let out = shardscope(&[
        "reshard",
        missing.to_str().unwrap(),
        "-o",
        d,
        "--model",
        m,
        "--to-world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("nope"), "{}", stderr_of(&out));

    // Missing model description.
    let out = shardscope(&[
        "reshard",
        s,
        "-o",
        d,
        "--model",
        "/no/such/model.json",
        "--to-world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("/no/such/model.json"),
        "{}",
        stderr_of(&out)
    );

    // Wrong use_orig_params: the optimizer ids do not match the wrapped model.
    let out = shardscope(&[
        "reshard",
        s,
        "-o",
        d,
        "--model",
        m,
        "--to-world-size",
        "2",
        "--use-orig-params",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!dst.exists());

    // A corrupt rank file is named.
    let corrupt = tmp.path().join("corrupt");
    std::fs::create_dir(&corrupt).unwrap();
    for (name, bytes) in snapshot(&src) {
        std::fs::write(corrupt.join(name), bytes).unwrap();
    }
    let mut bytes = std::fs::read(corrupt.join("model_rank1.pt")).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(corrupt.join("model_rank1.pt"), bytes).unwrap();
    let out = shardscope(&[
        "reshard",
        corrupt.to_str().unwrap(),
        "-o",
        d,
        "--model",
        m,
        "--to-world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("model_rank1.pt"),
        "{}",
        stderr_of(&out)
    );
    assert!(!dst.exists());

    // A missing rank is named.
    std::fs::remove_file(corrupt.join("model_rank1.pt")).unwrap();
    std::fs::remove_file(corrupt.join("optim_rank1.pt")).unwrap();
    std::fs::copy(src.join("model_rank1.pt"), corrupt.join("model_rank2.pt")).unwrap();
    let out = shardscope(&[
        "reshard",
        corrupt.to_str().unwrap(),
        "-o",
        d,
        "--model",
        m,
        "--to-world-size",
        "2",
        "--model-files",
        "model_rank{r}.pt",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr_of(&out).contains("model_rank1.pt"),
        "{}",
        stderr_of(&out)
    );

    // A non-empty destination is refused and left alone.
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("keep"), b"x").unwrap();
    let out = shardscope(&["reshard", s, "-o", d, "--model", m, "--to-world-size", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("not empty"), "{}", stderr_of(&out));
    assert_eq!(std::fs::read(dst.join("keep")).unwrap(), b"x");
}

/// The streaming `reshard` and `convert` write exactly the bytes of the whole-in-memory transforms
/// (`model_full_from_local`, `model_local_from_full`, `full_optim_from_local`,
/// `local_optim_from_full`, themselves proven against torch's fixtures) serialised with
/// `bridge::to_torch_save`, for torch-made per-rank files of three layouts (nested units, tied
/// weights, `use_orig_params`), to 3 ranks and with `use_orig_params` flipped.
#[test]
#[allow(
    clippy::too_many_lines,
    reason = "every output kind compared with the in-memory transform, one after the other"
)]
fn streaming_outputs_equal_the_in_memory_transforms() {
    use shardscope_core::layout::Fsdp1Model;
    use shardscope_core::layout::{self, Api, Layout, LayoutConfig};
    use shardscope_core::model::ModelDescription;
    use shardscope_core::transform::model_state::TORCH_PADDING_FILL;
    use shardscope_core::transform::optim_state::local_optim_from_full;
    use shardscope_core::transform::reference::model_state::{
        model_full_from_local, model_local_from_full,
    };
    use shardscope_core::transform::reference::optim_state::full_optim_from_local;

    fn fsdp1(
        desc: &ModelDescription,
        ws: usize,
        uop: bool,
    ) -> shardscope_core::layout::Fsdp1Layout {
        let config = LayoutConfig {
            api: Api::Fsdp1,
            world_size: ws as u64,
            shard_group_size: None,
            use_orig_params: uop,
            strategy: Strategy::FullShard,
            param_dtype: None,
        };
        match layout::compute(desc, &config).unwrap() {
            Layout::Fsdp1(l) => l,
            Layout::Fsdp2(_) => unreachable!(),
        }
    }

    for (case, uop) in [
        ("nested_ws2_uop0", false),
        ("nested_ws2_uop1", true),
        ("tied_ws2_uop0", false),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        let mut models = Vec::new();
        let mut optims = Vec::new();
        for rank in 0..2u64 {
            let bundle = read(&fixtures().join(format!("{case}/rank{rank}.pt")));
            let bundle = bundle.as_dict().unwrap();
            for (key, name, root) in [
                ("model_local", "model_rank", RootDict::Ordered),
                ("optim_local", "optim_rank", RootDict::Plain),
            ] {
                let node = bundle.get_str(key).unwrap();
                let bytes = bridge::to_torch_save(node, root, rank, 2).unwrap();
                std::fs::write(src.join(format!("{name}{rank}.pt")), bytes).unwrap();
            }
            models.push(
                bundle
                    .get_str("model_local")
                    .unwrap()
                    .as_dict()
                    .unwrap()
                    .clone(),
            );
            optims.push(
                bundle
                    .get_str("optim_local")
                    .unwrap()
                    .as_dict()
                    .unwrap()
                    .clone(),
            );
        }
        let model_json = fixtures().join(format!("{case}/model.json"));
        let desc =
            ModelDescription::from_json_bytes(&std::fs::read(&model_json).unwrap(), "m").unwrap();
        let src_layout = fsdp1(&desc, 2, uop);
        let src_model = Fsdp1Model::new(&desc, &src_layout).unwrap();
        let names: Vec<String> = src_model
            .wrapped_params()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let model_refs: Vec<&Dict> = models.iter().collect();
        let optim_refs: Vec<&Dict> = optims.iter().collect();
        let full = model_full_from_local(&src_model, &model_refs).unwrap();
        let full_osd =
            full_optim_from_local(&src_model, &optim_refs, &[names.clone(), names], 0, None)
                .unwrap();
        let m = model_json.to_str().unwrap();
        let s = src.to_str().unwrap();
        let mut args = vec!["--model", m];
        if uop {
            args.push("--use-orig-params");
        }

        // convert
        let full_pt = tmp.path().join("full.pt");
        let mut cmd = vec!["convert", s, "-o", full_pt.to_str().unwrap(), "--quiet"];
        cmd.extend(&args);
        let out = shardscope(&cmd);
        assert!(out.status.success(), "{case}: {}", stderr_of(&out));
        // `convert` streams through the index (another writer than `bridge::to_torch_save`):
        // the same values, keys and key order once read back.
        let back = |bytes: Vec<u8>| bridge::node_from_torch_save(&bytes, "in-memory").unwrap();
        let want = bridge::to_torch_save(&Node::Dict(full.clone()), RootDict::Ordered, 0, 1);
        assert_eq!(read(&full_pt), back(want.unwrap()), "{case}: full model");
        let keys = |n: &Node| -> Vec<String> {
            n.as_dict()
                .unwrap()
                .keys()
                .map(ToString::to_string)
                .collect()
        };
        assert_eq!(
            keys(&read(&full_pt)),
            full.keys().map(ToString::to_string).collect::<Vec<_>>(),
            "{case}: full model key order"
        );
        let want = bridge::to_torch_save(&Node::Dict(full_osd.clone()), RootDict::Plain, 0, 1);
        let got = read(&tmp.path().join("full.optim.pt"));
        let want = back(want.unwrap());
        assert_eq!(got, want, "{case}: full optimizer");
        let state = |n: &Node| keys(n.as_dict().unwrap().get_str("state").unwrap());
        assert_eq!(state(&got), state(&want), "{case}: optimizer state order");

        // reshard to 3 ranks, and with use_orig_params flipped
        for flip in [false, true] {
            let dst_uop = uop ^ flip;
            let dst = tmp.path().join(format!("dst{flip}"));
            let flag = if dst_uop { "true" } else { "false" };
            let mut cmd = vec![
                "reshard",
                s,
                "-o",
                dst.to_str().unwrap(),
                "--to-world-size",
                "3",
            ];
            cmd.extend(&args);
            cmd.extend(["--to-use-orig-params", flag]);
            let out = shardscope(&cmd);
            assert!(out.status.success(), "{case}: {}", stderr_of(&out));
            let dst_layout = fsdp1(&desc, 3, dst_uop);
            let dst_model = Fsdp1Model::new(&desc, &dst_layout).unwrap();
            let dst_names: Vec<String> = dst_model
                .wrapped_params()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            for rank in 0..3u64 {
                let local =
                    model_local_from_full(&dst_model, rank, &full, TORCH_PADDING_FILL).unwrap();
                let want = bridge::to_torch_save(&Node::Dict(local), RootDict::Ordered, rank, 3);
                let got = std::fs::read(dst.join(format!("model_rank{rank}.pt"))).unwrap();
                assert!(
                    got == want.unwrap(),
                    "{case} flip={flip}: model rank {rank}"
                );
                let osd = local_optim_from_full(&dst_model, &full_osd, rank, &dst_names).unwrap();
                let want = bridge::to_torch_save(&Node::Dict(osd), RootDict::Plain, rank, 3);
                let got = std::fs::read(dst.join(format!("optim_rank{rank}.pt"))).unwrap();
                assert!(
                    got == want.unwrap(),
                    "{case} flip={flip}: optimizer rank {rank}"
                );
            }
        }
    }
}
