//! Checkpoint panel tests: the viewer opens torch-written checkpoints of
//! `tests/fixtures/formats` (DCP directory, its `.zip`, FSDP1 SHARDED/LOCAL per-rank files, FSDP2
//! model and optimizer files) and the tests read what is shown through the accessibility tree.
//! Expected keys, chunk tables, ranks and `step` values come from the `expected/*.json` and
//! `expected/*.safetensors` files that the torch generator (`gen_formats.py`) wrote.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use serde_json::Value;
use shardscope_viewer::{Tab, Viewer};

fn formats() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/formats")
}

fn expected(name: &str) -> Value {
    let bytes = std::fs::read(formats().join("expected").join(name)).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

fn harness(viewer: Viewer) -> Harness<'static, Viewer> {
    Harness::builder()
        .with_size(egui::Vec2::new(1500.0, 1000.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), viewer)
}

/// A viewer with `files` (relative to the formats fixtures) opened together as bytes.
fn open(files: &[&str]) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    for f in files {
        let bytes = std::fs::read(formats().join(f)).unwrap();
        v.open_bytes(*f, bytes);
    }
    assert_eq!(v.poll_loader(), 0);
    assert!(v.checkpoint.is_some(), "not opened: {:?}", v.messages);
    v
}

const DCP: [&str; 3] = [
    "dcp_torch_save/.metadata",
    "dcp_torch_save/__0_0.distcp",
    "dcp_torch_save/__1_0.distcp",
];

/// (items, total chunks) of the torch-written DCP metadata.
fn dcp_expected() -> (usize, usize, BTreeMap<String, Value>) {
    let meta = expected("dcp_torch_save_metadata.json");
    let items: BTreeMap<String, Value> = serde_json::from_value(meta["items"].clone()).unwrap();
    // Tensor items have their chunk lists; every bytes item is stored once.
    let chunks = items
        .values()
        .map(|i| i["chunks"].as_array().map_or(1, Vec::len))
        .sum();
    (items.len(), chunks, items)
}

fn check_dcp(mut h: Harness<'_, Viewer>) {
    let (n, chunks, items) = dcp_expected();
    h.run();
    assert_eq!(h.state().tab, Tab::Checkpoint);
    h.get_by_label_contains(&format!("{n} of {n} keys · {chunks} chunks · 3 files"));
    // Every key of the metadata is in the table (rows are virtualised: search by prefix).
    for prefix in ["model.", "extra.", "optim.state.", "optim.param_groups."] {
        prefix.clone_into(&mut h.state_mut().ckpt.table_filter);
        h.run();
        let keys: Vec<&String> = items.keys().filter(|k| k.contains(prefix)).collect();
        h.get_by_label_contains(&format!("{} of {n} keys", keys.len()));
        for key in keys {
            assert!(h.query_by_label(key).is_some(), "{key} not shown");
        }
    }
    "extra.".clone_into(&mut h.state_mut().ckpt.table_filter);
    h.run();
    // The bytes item shows torch's value.
    let step = expected("dcp.json")["entries"]["extra/step"]["value"].clone();
    h.get_by_label(&format!("= {step}"));

    // Click a tensor row: it is selected everywhere and its chunk map shows torch's chunks.
    "model.".clone_into(&mut h.state_mut().ckpt.table_filter);
    h.run();
    h.get_by_label("model.embed.weight").click();
    h.run();
    assert_eq!(
        h.state().selection.fqn.as_deref(),
        Some("model.embed.weight")
    );
    let want = items["model.embed.weight"]["chunks"].as_array().unwrap();
    assert!(h.state().status_line().ends_with(&format!(
        "selected: model.embed.weight ({} chunks)",
        want.len()
    )));
    for c in want {
        let offsets: Vec<u64> = serde_json::from_value(c["offsets"].clone()).unwrap();
        let sizes: Vec<u64> = serde_json::from_value(c["sizes"].clone()).unwrap();
        let fmt = |v: &[u64]| {
            format!(
                "[{}]",
                v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
            )
        };
        assert!(h.query_by_label(&fmt(&offsets)).is_some(), "{offsets:?}");
        assert!(h.query_all_by_label(&fmt(&sizes)).next().is_some());
    }
    h.state_mut().tab = Tab::Chunks;
    h.run();
    h.get_by_label(&format!(
        "model.embed.weight: {} chunks on ranks 0-1",
        want.len()
    ));
}

#[test]
fn dcp_directory_shows_every_key_chunk_and_the_step_value() {
    check_dcp(harness(open(&DCP)));
}

#[test]
fn a_zip_of_the_dcp_folder_opens_the_same() {
    let mut buf = std::io::Cursor::new(Vec::new());
    {
        let mut zip = zip::ZipWriter::new(&mut buf);
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for f in DCP {
            zip.start_file(f, opts).unwrap();
            zip.write_all(&std::fs::read(formats().join(f)).unwrap())
                .unwrap();
        }
        zip.finish().unwrap();
    }
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.open_bytes("dcp_torch_save.zip", buf.into_inner());
    assert_eq!(v.poll_loader(), 0);
    assert!(v.checkpoint.is_some(), "{:?}", v.messages);
    // Names inside the zip keep their folder; three files, like the folder itself.
    check_dcp(harness(v));
}

fn shard_ranks(shards: &[Value]) -> String {
    let ranks: Vec<u64> = shards
        .iter()
        .map(|s| {
            s["placement"].as_str().unwrap()["rank:".len()..]
                .split('/')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    shardscope_viewer::format::ranks(&ranks)
}

#[test]
fn fsdp1_sharded_per_rank_files_show_torch_shard_tables() {
    let mut h = harness(open(&[
        "fsdp1_orig0/rank0_sharded.pt",
        "fsdp1_orig0/rank1_sharded.pt",
    ]));
    h.run();
    let want = expected("fsdp1_orig0__rank0_sharded.json");
    let entries = want["entries"].as_object().unwrap();
    for (key, e) in entries {
        let Some(shards) = e["shards"].as_array() else {
            continue;
        };
        h.state_mut().selection.select(key.clone());
        h.run();
        assert!(
            h.state()
                .status_line()
                .contains(&format!("selected: {key} ("))
        );
        // The inspector's facts grid: chunk count and ranks from torch's shard table.
        let v = h.state();
        let (i, entry) = v.checkpoint.as_ref().unwrap().entry(key).unwrap();
        assert_eq!(entry.chunks.len(), shards.len(), "{key}");
        let ranks = shard_ranks(shards);
        assert_eq!(
            shardscope_viewer::format::ranks(&v.checkpoint.as_ref().unwrap().ranks[i]),
            ranks
        );
        assert!(
            h.query_all_by_label(&format!("ShardedTensor, {} shards", shards.len()))
                .next()
                .is_some()
        );
        assert!(
            h.query_all_by_label(&ranks).next().is_some(),
            "{key}: {ranks}"
        );
    }
}

#[test]
fn fsdp1_local_flat_parameters_are_listed_with_their_shards() {
    let mut h = harness(open(&[
        "fsdp1_orig0/rank0_local.pt",
        "fsdp1_orig0/rank1_local.pt",
    ]));
    h.run();
    let want = expected("fsdp1_orig0__rank0_local.json");
    let entries = want["entries"].as_object().unwrap();
    let n = entries.len();
    h.get_by_label_contains(&format!("{n} of {n} keys"));
    let shards = entries["block._flat_param"]["shards"].as_array().unwrap();
    h.get_by_label("block._flat_param").click();
    h.run();
    assert!(
        h.query_all_by_label(&format!(
            "ShardedTensor, {} shards, flat parameter",
            shards.len()
        ))
        .count()
            >= 2,
        "table row and inspector"
    );
}

/// `state/<id>/step` of a torch-written safetensors file, parsed by hand (f32 scalar).
fn step_from_safetensors(name: &str, key: &str) -> f32 {
    let bytes = std::fs::read(formats().join("expected").join(name)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[key]["dtype"], "F32");
    let start = header[key]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
    f32::from_le_bytes(bytes[start..start + 4].try_into().unwrap())
}

#[test]
fn fsdp2_optimizer_state_shows_states_ranks_steps_and_groups() {
    let mut v = open(&["fsdp2/rank0_optim.pt", "fsdp2/rank1_optim.pt"]);
    v.tab = Tab::Optimizer;
    let mut h = harness(v);
    h.run();
    let want = expected("fsdp2__rank0_optim.json");
    let entries = want["entries"].as_object().unwrap();
    let params: std::collections::BTreeSet<&str> = entries
        .keys()
        .filter_map(|k| k.strip_prefix("state/")?.split('/').next())
        .collect();
    let groups = entries
        .keys()
        .filter_map(|k| k.strip_prefix("param_groups/")?.split('/').next())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    h.get_by_label(&format!(
        "{} parameters with state · {groups} param groups",
        params.len()
    ));
    let step = step_from_safetensors("fsdp2__rank0_optim.safetensors", "state/0/step");
    let shown = format!("step = {:.1}", f64::from(step));
    assert_eq!(
        h.query_all_by_label(&shown).count(),
        params.len(),
        "every parameter's step reads {shown}"
    );
    let lr = &entries["param_groups/0/lr"]["value"];
    h.get_by_label(&format!("lr = {lr}"));
    // exp_avg is a DTensor over both ranks with torch's global shape.
    let shape: Vec<u64> =
        serde_json::from_value(entries["state/0/exp_avg"]["global_shape"].clone()).unwrap();
    assert!(
        h.query_all_by_label(&shardscope_viewer::format::shape(&shape))
            .next()
            .is_some()
    );
    assert!(h.query_all_by_label("0-1").next().is_some());
}

#[test]
fn fsdp2_model_shows_dtensor_placements() {
    let mut h = harness(open(&["fsdp2/rank0_model.pt", "fsdp2/rank1_model.pt"]));
    h.run();
    let want = expected("fsdp2__rank0_model.json");
    let e = &want["entries"]["block.lin.weight"];
    let placements: Vec<String> = serde_json::from_value(e["placements"].clone()).unwrap();
    h.get_by_label("block.lin.weight").click();
    h.run();
    let shown = &h.state().checkpoint.as_ref().unwrap();
    let (_, entry) = shown.entry("block.lin.weight").unwrap();
    let fsdp = shardscope_viewer::panels::checkpoint::fsdp_text(entry);
    for p in &placements {
        assert!(fsdp.contains(p.as_str()), "{fsdp} lacks {p}");
    }
    assert!(
        h.query_all_by_label(&fsdp).count() >= 2,
        "table row and inspector"
    );
}
