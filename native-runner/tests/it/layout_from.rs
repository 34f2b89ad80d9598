//! `shardscope layout --from CKPT --units REGEX` and the core conversion behind it, against the
//! torch-written checkpoints of `fixtures/formats`.
//!
//! Expected values come from torch: `fixtures/formats/derived/key_order.json` is the key order torch
//! reports for each checkpoint (`torch.load(...).keys()`, DCP's `read_metadata()`), and
//! `fixtures/formats/derived/model.json` is `Net().named_parameters()` (both written by
//! `derived/gen_derived.py`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::shardscope_bin;
use shardscope_core::index::from_index::{
    FromIndexOptions, description_from_index, stored_key_order,
};
use shardscope_core::index::index_source;
use shardscope_tests::{fixtures_dir, memory_source};

fn formats() -> PathBuf {
    fixtures_dir().join("formats")
}

fn torch_order(name: &str) -> Vec<String> {
    let text = std::fs::read_to_string(formats().join("derived/key_order.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["orders"][name]
        .as_array()
        .unwrap_or_else(|| panic!("no order for {name}"))
        .iter()
        .map(|k| k.as_str().unwrap().to_owned())
        .collect()
}

/// A source holding just the given files of `fixtures/formats` (names: their file names).
fn files_source(rel: &[&str]) -> shardscope_core::MemorySource {
    let mut s = shardscope_core::MemorySource::new();
    for r in rel {
        let p = formats().join(r);
        let name = p.file_name().unwrap().to_str().unwrap().to_owned();
        s.insert(name, std::fs::read(&p).unwrap());
    }
    s
}

fn derive_fqns(source: &shardscope_core::MemorySource, select: Option<&str>) -> Vec<String> {
    let index = index_source(source).unwrap();
    let order = stored_key_order(source, &index).unwrap();
    assert!(order.registration_order);
    let no_units = |_: &str| false;
    let derived = description_from_index(
        &index,
        &order,
        &FromIndexOptions {
            select,
            exclude: None,
            is_unit: &no_units,
            root_unit: true,
            tied: None,
        },
    )
    .unwrap();
    derived.model.params.iter().map(|p| p.fqn.clone()).collect()
}

#[test]
fn derived_keys_follow_torchs_order_for_pt_and_dcp() {
    for file in ["fsdp1_orig0/rank0_full.pt", "fsdp1_orig1/rank0_full.pt"] {
        assert_eq!(
            derive_fqns(&files_source(&[file]), None),
            torch_order(file),
            "{file}"
        );
    }
    // FSDP2 per-rank DTensor files: both ranks together, the order of rank 0's dict.
    assert_eq!(
        derive_fqns(
            &files_source(&["fsdp2/rank0_model.pt", "fsdp2/rank1_model.pt"]),
            None
        ),
        torch_order("fsdp2/rank0_model.pt")
    );
    // FSDP1 SHARDED per-rank files keep the same order as the FULL ones torch wrote.
    assert_eq!(
        derive_fqns(
            &files_source(&[
                "fsdp1_orig0/rank0_sharded.pt",
                "fsdp1_orig0/rank1_sharded.pt"
            ]),
            None
        ),
        torch_order("fsdp1_orig0/rank0_full.pt")
    );
    for dir in ["dcp_torch_save", "dcp_safetensors"] {
        let want: Vec<String> = torch_order(dir)
            .into_iter()
            .filter_map(|k| k.strip_prefix("model.").map(str::to_owned))
            .collect();
        assert_eq!(want.len(), 7, "{dir}");
        assert_eq!(
            derive_fqns(&memory_source(&formats().join(dir)), Some("model")),
            want,
            "{dir}"
        );
    }
}

#[test]
fn optimizer_state_is_skipped_and_units_are_full_matches() {
    let source = memory_source(&formats().join("dcp_torch_save"));
    let index = index_source(&source).unwrap();
    let order = stored_key_order(&source, &index).unwrap();
    let re_block = |p: &str| p == "block" || p == "model.block";
    let derived = description_from_index(
        &index,
        &order,
        &FromIndexOptions {
            select: None,
            exclude: None,
            is_unit: &re_block,
            root_unit: false,
            tied: None,
        },
    )
    .unwrap();
    let fqns: Vec<&str> = derived
        .model
        .params
        .iter()
        .map(|p| p.fqn.as_str())
        .collect();
    // No optimizer state; the int64 `extra.ids` is not floating point; `extra.cols` (bf16) is kept.
    assert!(fqns.iter().all(|f| !f.starts_with("optim.")), "{fqns:?}");
    assert!(!fqns.contains(&"extra.ids"));
    assert!(fqns.contains(&"extra.cols"));
    assert_eq!(derived.model.units, vec!["model.block".to_owned()]);
    assert!(
        derived
            .skipped
            .iter()
            .any(|(k, why)| k == "optim.state.0.exp_avg" && *why == "optimizer state")
    );
    // FSDP1 LOCAL files hold flat parameters only: nothing to derive, and the error says why.
    let local = files_source(&["fsdp1_orig0/rank0_local.pt", "fsdp1_orig0/rank1_local.pt"]);
    let index = index_source(&local).unwrap();
    let order = stored_key_order(&local, &index).unwrap();
    let exclude_buf = |f: &str| f == "buf";
    let err = description_from_index(
        &index,
        &order,
        &FromIndexOptions {
            select: None,
            exclude: Some(&exclude_buf),
            is_unit: &re_block,
            root_unit: true,
            tied: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("LOCAL flat parameters"), "{err}");
}

fn shardscope(args: &[&str]) -> Output {
    std::process::Command::new(shardscope_bin())
        .args(args)
        .output()
        .expect("run shardscope")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok_stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn layout_from_checkpoint_equals_layout_of_torchs_description() {
    let model = formats().join("derived/model.json");
    let f = formats();
    let fsdp1_full = f.join("fsdp1_orig0/rank0_full.pt");
    let fsdp2_0 = f.join("fsdp2/rank0_model.pt");
    let fsdp2_1 = f.join("fsdp2/rank1_model.pt");
    let dcp = f.join("dcp_safetensors");
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--from", s(&fsdp1_full)], vec![]),
        (vec!["--from", s(&fsdp1_full)], vec!["--use-orig-params"]),
        (
            vec!["--from", s(&fsdp2_0), s(&fsdp2_1)],
            vec!["--api", "fsdp2"],
        ),
        (
            vec!["--from", s(&dcp), "--select", "model"],
            vec!["--api", "fsdp2", "--world-size", "3"],
        ),
        (vec!["--from", s(&dcp), "--select", "model"], vec![]),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (from, config)) in cases.iter().enumerate() {
        let emitted = dir.path().join(format!("model{i}.json"));
        let mut a: Vec<&str> = vec!["layout", "--json"];
        a.extend(from);
        a.extend([
            "--units",
            r"bl\w+",
            "--root-unit",
            "--exclude",
            "buf",
            "--emit-model",
            s(&emitted),
        ]);
        a.extend(config);
        if !config.contains(&"--world-size") {
            a.extend(["--world-size", "2"]);
        }
        let derived = ok_stdout(&shardscope(&a));
        let mut b: Vec<&str> = vec!["layout", "--json", "--model", s(&model)];
        b.extend(config);
        if !config.contains(&"--world-size") {
            b.extend(["--world-size", "2"]);
        }
        let given = ok_stdout(&shardscope(&b));
        assert_eq!(derived, given, "case {i}: {a:?}");
        // The emitted description is the torch description (same params, order, units).
        let mut c: Vec<&str> = vec!["layout", "--json", "--model", s(&emitted)];
        c.extend(config);
        if !config.contains(&"--world-size") {
            c.extend(["--world-size", "2"]);
        }
        assert_eq!(ok_stdout(&shardscope(&c)), given, "case {i}: emitted model");
    }
}

#[test]
fn layout_from_safetensors_warns_about_sorted_keys_and_bad_regex_exits_2() {
    let hf = formats().join("hf_sharded");
    let out = shardscope(&[
        "layout",
        "--from",
        s(&hf),
        "--units",
        "block",
        "--world-size",
        "2",
    ]);
    ok_stdout(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sorted by name"), "{err}");

    let out = shardscope(&[
        "layout",
        "--from",
        s(&hf),
        "--units",
        "(",
        "--world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--units") && err.contains("invalid"), "{err}");
}

/// `layout --from CKPT --world-size N` with no `--units` and no `--select`: the app-state prefix
/// (`model`) is found and the units are the repeated blocks (`model.layers.N`) and the root, as
/// torch's `transformer_auto_wrap_policy` wraps them. Expected: the FlatParameters torch built for
/// the same model (`fixtures/app_state/auto_wrap_ws2.json`, `gen_auto_wrap.py`).
#[test]
fn layout_from_a_checkpoint_alone_equals_torchs_transformer_auto_wrap() {
    let app = fixtures_dir().join("app_state");
    let out = shardscope(&[
        "layout",
        "--from",
        s(&app.join("dcp")),
        "--world-size",
        "2",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        err.contains("`model.layers.N` (2 blocks) and the root") && err.contains("--units"),
        "{err}"
    );
    let ours: serde_json::Value = serde_json::from_str(&ok_stdout(&out)).unwrap();
    let torch: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(app.join("auto_wrap_ws2.json")).unwrap())
            .unwrap();
    let ours_fp = ours["flat_params"].as_array().unwrap();
    for rank in torch["ranks"].as_array().unwrap() {
        let r = usize::try_from(rank["rank"].as_u64().unwrap()).unwrap();
        let torch_fp = rank["flat_params"].as_array().unwrap();
        assert_eq!(
            ours_fp.len(),
            torch_fp.len(),
            "rank {r}: number of flat params"
        );
        for (o, t) in ours_fp.iter().zip(torch_fp) {
            for field in [
                "unit_prefix",
                "fqns",
                "numels",
                "unpadded_unsharded_numel",
                "sharded_numel",
            ] {
                assert_eq!(o[field], t[field], "rank {r} {}: {field}", t["unit_prefix"]);
            }
            assert_eq!(
                o["ranks"][r]["shard_numel_padded"], t["shard_numel_padded"],
                "rank {r} {}",
                t["unit_prefix"]
            );
        }
    }
}
