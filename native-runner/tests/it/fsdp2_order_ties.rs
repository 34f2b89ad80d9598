//! FSDP2 per-rank folders (tests/fixtures/fsdp2_order, written by torch 2.15): `layout --from FOLDER`
//! must list the parameters in registration order and mark tied weights, as `--from` one file
//! does, and `convert FOLDER` must name the optimizer ids of a model with tied weights. Expected
//! values are torch's: `expected/CASE_model.json` is `named_parameters(remove_duplicate=False)`
//! (aliases with `shared_with`), `expected/CASE_full.pt` is `{"model": get_model_state_dict(...),
//! "optim": get_optimizer_state_dict(...)}` with `full_state_dict=True`.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shardscope_core::bridge::node_from_torch_save;
use shardscope_core::model::tree::Node;

fn fixtures() -> PathBuf {
    shardscope_tests::fixtures_dir().join("fsdp2_order")
}

fn shardscope(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(crate::common::shardscope_bin())
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&std::ffi::OsStr]) -> String {
    let o = shardscope(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "shardscope {args:?} failed: {err}");
    err
}

fn read(path: &Path) -> Node {
    node_from_torch_save(&std::fs::read(path).unwrap(), &path.display().to_string()).unwrap()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `(fqn, shared_with)` of every parameter of a description, in order.
fn params(desc: &serde_json::Value) -> Vec<(String, Option<String>)> {
    desc["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["fqn"].as_str().unwrap().to_owned(),
                p["shared_with"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

/// `layout --from DIR --select model` writing the derived description to `out`.
fn derive(dir: &Path, units: &str, out: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args: Vec<std::ffi::OsString> = vec!["layout".into(), "--from".into(), dir.into()];
    for a in [
        "--select",
        "model",
        "--root-unit",
        "--units",
        units,
        "--world-size",
        "2",
        "--api",
        "fsdp2",
    ]
    .iter()
    .chain(extra)
    {
        args.push(a.into());
    }
    args.push("--emit-model".into());
    args.push(out.into());
    let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsString::as_os_str).collect();
    ok(&args);
    json(out)
}

fn convert(dir: &Path, out: &Path, model: Option<&Path>) -> String {
    let mut args = vec![
        "convert".as_ref(),
        dir.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ];
    if let Some(m) = model {
        args.push("--model".as_ref());
        args.push(m.as_os_str());
    }
    ok(&args)
}

fn expected(case: &str) -> Node {
    read(&fixtures().join("expected").join(format!("{case}_full.pt")))
}

#[test]
fn folder_gives_registration_order_and_the_right_optimizer_state() {
    // `zz` is registered before `aa`, both [4, 4]: a sorted order swaps their Adam state silently.
    let tmp = tempfile::tempdir().unwrap();
    let desc = derive(
        &fixtures().join("swap"),
        "NONE",
        &tmp.path().join("swap.json"),
        &[],
    );
    let torch = json(&fixtures().join("expected/swap_model.json"));
    assert_eq!(params(&desc), params(&torch), "registration order");
    let out = tmp.path().join("swap.pt");
    convert(
        &fixtures().join("swap"),
        &out,
        Some(&tmp.path().join("swap.json")),
    );
    assert_eq!(read(&out), expected("swap"), "differs from torch");
}

#[test]
fn folder_marks_tied_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("tied");
    let derived = tmp.path().join("tied.json");
    let desc = derive(&dir, "mid", &derived, &[]);
    let torch = json(&fixtures().join("expected/tied_model.json"));
    // head.weight shared_with embed.weight, as torch's named_parameters(remove_duplicate=False).
    assert_eq!(params(&desc), params(&torch), "order and ties");
    assert_eq!(desc["units"], torch["units"]);
    let out = tmp.path().join("derived.pt");
    convert(&dir, &out, Some(&derived));
    assert_eq!(read(&out), expected("tied"), "with --model derived");

    // --no-tie-detection: both listed, no `shared_with`.
    let desc = derive(
        &dir,
        "mid",
        &tmp.path().join("n.json"),
        &["--no-tie-detection"],
    );
    assert!(params(&desc).iter().all(|(_, s)| s.is_none()));
    assert_eq!(params(&desc).len(), 4);
}

#[test]
fn convert_of_tied_folder_counts_the_tie_once() {
    // The optimizer holds 3 parameters, the model state dict 4 DTensors (`head.weight` is
    // `embed.weight`: one storage in every rank's model file).
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("tied");
    let torch_desc = fixtures().join("expected/tied_model.json");
    let want = expected("tied");

    // Without --model: the tie comes from the model files' shared storage.
    let out = tmp.path().join("plain.pt");
    let err = convert(&dir, &out, None);
    assert!(
        err.contains("`head.weight` is `embed.weight`"),
        "the note names the tie: {err}"
    );
    assert_eq!(read(&out), want, "without --model");

    // With torch's description, and torch's without `shared_with`
    // (named_parameters(remove_duplicate=False) as written by hand).
    let mut unmarked = json(&torch_desc);
    for p in unmarked["params"].as_array_mut().unwrap() {
        p.as_object_mut().unwrap().remove("shared_with");
    }
    let unmarked_path = tmp.path().join("unmarked.json");
    std::fs::write(&unmarked_path, unmarked.to_string()).unwrap();
    for (name, model) in [("torch", &torch_desc), ("unmarked", &unmarked_path)] {
        let out = tmp.path().join(format!("{name}.pt"));
        convert(&dir, &out, Some(model));
        assert_eq!(read(&out), want, "with --model {name}");
    }
}

#[test]
fn fsdp2_optim_folder_gives_named_parameters_order() {
    // The ws2 folder of tests/fixtures/fsdp2_optim (model and optimizer files per rank): its
    // derived order must be torch's named_parameters() order (`model.json`), not sorted.
    let tmp = tempfile::tempdir().unwrap();
    let base = shardscope_tests::fixtures_dir().join("fsdp2_optim");
    let desc = derive(
        &base.join("ws2"),
        "block",
        &tmp.path().join("ws2.json"),
        &["--exclude", "buf"],
    );
    let torch = json(&base.join("model.json"));
    assert_eq!(params(&desc), params(&torch));
    assert_eq!(desc["units"], torch["units"]);
}
