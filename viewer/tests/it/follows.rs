//! The layout panel follows what was opened: world size, API and HSDP shard group come from the
//! checkpoint where it states them (torch-written fixtures: `tests/fixtures/hints/gen_hints.py`, a
//! 2x2 HSDP mesh; `tests/fixtures/formats`, 2-rank DCP and FSDP2 files), each with where it came
//! from; values set on the command line are kept; the shard group shown is the one the layout uses.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use shardscope_core::layout::{Api, Strategy};
use shardscope_viewer::{Tab, Viewer};

fn harness(viewer: Viewer) -> Harness<'static, Viewer> {
    Harness::builder()
        .with_size(egui::Vec2::new(1500.0, 1000.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), viewer)
}

fn open(mut v: Viewer, dir: &str, files: &[&str]) -> Viewer {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(dir);
    v.loader.synchronous = true;
    for f in files {
        v.open_bytes(*f, std::fs::read(root.join(f)).unwrap());
    }
    assert_eq!(v.poll_loader(), 0);
    assert!(v.checkpoint.is_some(), "not opened: {:?}", v.messages);
    v
}

const HSDP: [&str; 4] = [
    "rank0_model.pt",
    "rank1_model.pt",
    "rank2_model.pt",
    "rank3_model.pt",
];

#[test]
fn hsdp_files_set_world_api_and_shard_group() {
    let v = open(Viewer::new(), "hints/hsdp", &HSDP);
    // gen_hints.py: init_device_mesh("cpu", (2, 2)), fully_shard(..., mesh=mesh) on 4 ranks.
    assert_eq!(v.controls.world_size, 4);
    assert_eq!(v.controls.api, Api::Fsdp2);
    assert_eq!(v.controls.strategy, Strategy::HybridShard);
    assert_eq!(v.controls.shard_group_size, 2);
    let mut h = harness(v);
    h.run();
    h.get_by_label_contains("from the checkpoint: DTensor mesh [2, 2]");
    h.get_by_label_contains("from the checkpoint: HSDP mesh [2, 2]");
    h.get_by_label_contains("is a DTensor");
}

#[test]
fn dcp_sets_the_world_from_its_rank_files_and_keeps_the_rest() {
    let files = [
        "dcp_torch_save/.metadata",
        "dcp_torch_save/__0_0.distcp",
        "dcp_torch_save/__1_0.distcp",
    ];
    let v = open(Viewer::new(), "formats", &files);
    assert_eq!(v.controls.world_size, 2);
    // DCP does not say whether DTensors or ShardedTensors wrote it: the API stays as it was.
    assert_eq!(v.controls.api, Api::Fsdp1);
    assert_eq!(v.controls.strategy, Strategy::FullShard);
    let mut h = harness(v);
    h.run();
    h.get_by_label_contains("from the checkpoint: 2 per-rank files");
    h.get_by_label_contains("default");
}

#[test]
fn command_line_values_win_over_the_checkpoint() {
    let mut v = Viewer::new();
    v.controls.world_size = 8;
    v.controls.origins.world_size = Some("set on the command line".into());
    let v = open(v, "hints/hsdp", &HSDP);
    assert_eq!(v.controls.world_size, 8);
    assert_eq!(v.controls.api, Api::Fsdp2);
}

#[test]
fn shard_group_shown_is_the_one_the_layout_uses() {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.controls.world_size = 3;
    v.tab = Tab::Ranks;
    v.open_bytes(
        "spec_example_a.json",
        include_bytes!("../fixtures/spec_example_a.json").to_vec(),
    );
    assert_eq!(v.poll_loader(), 0);
    let mut h = harness(v);
    h.run();
    h.get_by_label_contains("3 ranks per shard group");
    h.get_by_label_contains("3 ranks (the world)");
    assert!(h.query_by_label_contains("2 ranks").is_none());
    h.state_mut().controls.world_size = 2;
    h.run();
    h.get_by_label_contains("2 ranks per shard group");
    h.get_by_label_contains("2 ranks (the world)");
}
