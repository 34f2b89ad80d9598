//! The viewer against real PyTorch: for every layout fixture of `tests/fixtures/layout` (written by
//! `gen_layout.py` with torch 2.15), open its `model.json` with the controls of its `case.json`,
//! and check what the viewer shows against torch's own per-rank report (`expected.json`):
//! the padding totals of the Ranks tab, which ranks hold each parameter, and the raw (wrapped)
//! names of the FQN map.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use serde_json::Value;
use shardscope_viewer::{Tab, Viewer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/layout")
}

fn itemsize(dtype: &str) -> u64 {
    match dtype.trim_start_matches("torch.") {
        "float32" | "int32" => 4,
        "bfloat16" | "float16" => 2,
        "float64" | "int64" => 8,
        other => panic!("dtype {other} not used by the fixtures"),
    }
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

/// What torch reports, reduced to what the viewer shows.
#[derive(Debug, Default)]
struct TorchFacts {
    align_pad_bytes: u64,
    tail_pad_bytes: u64,
    /// Clean FQN -> shard-group ranks holding at least one element.
    ranks: BTreeMap<String, BTreeSet<u64>>,
    wrapped_names: BTreeSet<String>,
}

/// Reads torch's per-rank report. Only the ranks of the first shard group count (the others are
/// replicas with identical shards), which are the global ranks whose shard rank equals their rank.
fn torch_facts(expected: &Value, group_size: u64) -> TorchFacts {
    let mut f = TorchFacts::default();
    for r in expected["ranks"].as_array().unwrap() {
        let rank = u(&r["rank"]);
        if rank >= group_size {
            continue;
        }
        let shard_rank = u(&r["shard_rank"]);
        assert_eq!(shard_rank, rank);
        for name in r["wrapped_named_parameters"].as_array().unwrap() {
            f.wrapped_names.insert(name.as_str().unwrap().to_owned());
        }
        if let Some(flats) = r["flat_params"].as_array() {
            for flat in flats {
                let size = itemsize(flat["dtype"].as_str().unwrap());
                let sharded = u(&flat["sharded_numel"]);
                // The rank's window in the padded flat parameter (the whole of it for NO_SHARD).
                let (lo, hi) = if flat["padded_unsharded_numel"].is_null() {
                    (0, u(&flat["unpadded_unsharded_numel"]))
                } else {
                    (shard_rank * sharded, (shard_rank + 1) * sharded)
                };
                let mut start = 0;
                for (n, pad) in flat["numels_with_padding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .zip(flat["is_padding_mask"].as_array().unwrap())
                {
                    let end = start + u(n);
                    if pad.as_bool().unwrap() {
                        f.align_pad_bytes += end.min(hi).saturating_sub(start.max(lo)) * size;
                    }
                    start = end;
                }
                f.tail_pad_bytes += u(&flat["shard_numel_padded"]) * size;
                for (fqn, info) in flat["fqns"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .zip(flat["shard_param_infos"].as_array().unwrap())
                {
                    let entry = f.ranks.entry(fqn.as_str().unwrap().to_owned()).or_default();
                    if info["in_shard"].as_bool().unwrap() {
                        entry.insert(rank);
                    }
                }
            }
        }
        if let Some(units) = r["units"].as_array() {
            for unit in units {
                for p in unit["params"].as_array().unwrap() {
                    let size = itemsize(p["dtype"].as_str().unwrap());
                    let numel =
                        |k: &str| -> u64 { p[k].as_array().unwrap().iter().map(u).product() };
                    f.tail_pad_bytes +=
                        (numel("padded_sharded_shape") - numel("local_shape")) * size;
                    let entry = f
                        .ranks
                        .entry(p["fqn"].as_str().unwrap().to_owned())
                        .or_default();
                    if numel("local_shape") > 0 {
                        entry.insert(rank);
                    }
                }
            }
        }
    }
    f
}

fn fmt_bytes(n: u64) -> String {
    shardscope_viewer::format::bytes(n)
}

#[test]
fn viewer_matches_torch_on_every_layout_fixture() {
    let mut checked = 0;
    let mut cases: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").exists())
        .collect();
    cases.sort();
    assert!(
        cases.len() >= 20,
        "layout fixtures missing: {}",
        fixtures().display()
    );
    for dir in cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let case: Value =
            serde_json::from_slice(&std::fs::read(dir.join("case.json")).unwrap()).unwrap();
        let model = std::fs::read(dir.join("model.json")).unwrap();

        let mut v = Viewer::new();
        v.loader.synchronous = true;
        v.controls.api = case["api"].as_str().unwrap().parse().unwrap();
        v.controls.world_size = u(&case["world_size"]);
        v.controls.use_orig_params = case["use_orig_params"].as_bool().unwrap();
        v.controls.strategy = case["strategy"].as_str().unwrap().parse().unwrap();
        if let Some(k) = case["shard_group_size"].as_u64() {
            v.controls.shard_group_size = k;
        }
        v.controls.param_dtype = case["param_dtype"].as_str().map(|d| d.parse().unwrap());
        v.open_bytes("model.json", model);
        v.poll_loader();

        if case.get("expected_error").is_some() {
            assert!(
                v.view.is_none(),
                "{name}: torch rejects this layout, the viewer drew one"
            );
            assert!(v.layout_error.is_some(), "{name}: no error shown");
            checked += 1;
            continue;
        }
        let expected: Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let view = v
            .view
            .clone()
            .unwrap_or_else(|| panic!("{name}: {:?}", v.layout_error));
        let facts = torch_facts(&expected, view.shard_group_size);

        // Which ranks hold each parameter.
        for (fqn, ranks) in &facts.ranks {
            let row = view
                .param(fqn)
                .unwrap_or_else(|| panic!("{name}: {fqn} not shown"));
            let shown: BTreeSet<u64> = row.ranks.iter().copied().collect();
            assert_eq!(&shown, ranks, "{name}: ranks holding {fqn}");
        }
        // Raw names: with use_orig_params (and FSDP2) every parameter's raw name is one torch
        // prints; with flat parameters, every flat parameter's.
        if view.api_label == "FSDP1" && !v.controls.use_orig_params {
            for unit in &view.units {
                let flat = unit.flat_param.as_ref().unwrap();
                assert!(
                    facts.wrapped_names.contains(flat),
                    "{name}: flat parameter {flat} not in torch's names"
                );
            }
        } else {
            for row in view
                .params
                .iter()
                .filter(|p| p.status == shardscope_viewer::view::ParamStatus::Sharded)
            {
                assert!(
                    facts.wrapped_names.contains(&row.raw_name),
                    "{name}: raw name {} not in torch's {:?}",
                    row.raw_name,
                    facts.wrapped_names
                );
            }
        }

        // The Ranks tab shows torch's padding totals.
        v.tab = Tab::Ranks;
        let mut h = Harness::builder()
            .with_size(egui::Vec2::new(1400.0, 900.0))
            .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), v);
        h.run();
        let want = format!(
            "padding {} alignment + {} shard tail",
            fmt_bytes(facts.align_pad_bytes),
            fmt_bytes(facts.tail_pad_bytes)
        );
        assert!(
            h.query_by_label_contains(&want).is_some(),
            "{name}: the Ranks tab does not show `{want}`"
        );
        checked += 1;
    }
    assert!(checked >= 20);
}
