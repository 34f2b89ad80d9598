//! Panel tests: the whole viewer runs headless under `egui_kittest`, opens fixture files and is
//! driven through its widgets; assertions read the accessibility tree (what a user sees as text).
//!
//! Expected numbers come from `FSDP_SPEC.md` (worked example A of §1.6 and §4.4, checked against
//! torch 2.15); see `fixtures/README.md`.
#![allow(clippy::unwrap_used)]

use egui::accesskit::Role;
use egui_kittest::Harness;
use egui_kittest::kittest::{NodeT, Queryable};
use shardscope_core::layout::Api;
use shardscope_viewer::{Tab, Viewer};

const SPEC_A: &[u8] = include_bytes!("../fixtures/spec_example_a.json");

fn harness(viewer: Viewer) -> Harness<'static, Viewer> {
    Harness::builder()
        .with_size(egui::Vec2::new(1400.0, 900.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), viewer)
}

/// A viewer with the spec example open, parsed synchronously.
fn spec_viewer(api: Api, use_orig_params: bool) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.controls.api = api;
    v.controls.world_size = 4;
    v.controls.use_orig_params = use_orig_params;
    v.open_bytes("spec_example_a.json", SPEC_A.to_vec());
    assert_eq!(v.poll_loader(), 0);
    assert!(v.view.is_some(), "layout error: {:?}", v.layout_error);
    v
}

fn label_texts(h: &Harness<'_, Viewer>, contains: &str) -> Vec<String> {
    h.query_all_by_label_contains(contains)
        .filter_map(|n| n.accesskit_node().label().or_else(|| n.value()))
        .collect()
}

#[test]
fn ranks_tab_shows_fsdp1_padding_totals_from_the_spec() {
    // use_orig_params=True: 5 alignment-padding elements (20 B), no shard tail.
    let mut v = spec_viewer(Api::Fsdp1, true);
    v.tab = Tab::Ranks;
    let mut h = harness(v);
    h.run();
    h.get_by_label_contains("padding 20 B alignment + 0 B shard tail");
    h.get_by_label_contains("imbalance");

    // Flip use_orig_params off through the checkbox: one zero on rank 3 (4 B), no alignment.
    h.get_by_label("use_orig_params").click();
    h.run();
    h.get_by_label_contains("padding 0 B alignment + 4 B shard tail");
    assert!(!h.state().controls.use_orig_params);
}

#[test]
fn fsdp2_padding_and_chunk_table_match_the_spec() {
    let mut v = spec_viewer(Api::Fsdp1, true);
    v.tab = Tab::Ranks;
    let mut h = harness(v);
    h.run();
    // Switch the API through its button: the layout is recomputed at once.
    h.get_by_label("FSDP2").click();
    h.run();
    assert_eq!(h.state().controls.api, Api::Fsdp2);
    h.get_by_label_contains("padding 0 B alignment + 20 B shard tail");

    // Select `a` in the tensor tree; the inspector shows its per-rank chunks: sizes 2, 2, 1, 0.
    h.get_by_label("a").click();
    h.run();
    assert_eq!(h.state().selection.fqn.as_deref(), Some("a"));
    h.get_by_label_contains("padded to 2 rows");
    h.get_by_label("held by ranks 0-2");
    for range in ["[0, 2)", "[2, 4)", "[4, 5)", "[5, 5)"] {
        h.get_by_label(range);
    }
}

#[test]
fn selection_is_shared_between_tree_fqn_map_and_status_bar() {
    let mut v = spec_viewer(Api::Fsdp1, true);
    v.tab = Tab::FqnMap;
    let mut h = harness(v);
    h.run();
    // The FQN map lists raw and clean names and the flat range of `b` ([8, 14) with alignment).
    h.get_by_label("_fsdp_wrapped_module.b");
    h.get_by_label("[8, 14)");
    h.get_by_label("2 of 2 parameters");

    // Click `b` in the tree: the status bar and the inspector show it; the map highlights it.
    let leaves: Vec<_> = h.get_all_by_label("b").collect();
    assert!(!leaves.is_empty());
    h.get_all_by_label("b").next().unwrap().click();
    h.run();
    assert_eq!(h.state().selection.fqn.as_deref(), Some("b"));
    h.get_by_label("Selected:");
    h.get_by_label("held by ranks 2-3");

    // Search in the FQN map narrows the rows.
    h.get_by_role_and_label(Role::TextInput, "Search").focus();
    h.run();
    h.get_by_role_and_label(Role::TextInput, "Search")
        .type_text("b");
    h.run();
    assert_eq!(h.state().fqn_map.filter, "b");
    assert_eq!(
        label_texts(&h, "of 2 parameters"),
        vec!["1 of 2 parameters".to_owned()]
    );
}

#[test]
fn clicking_a_slice_in_the_shard_map_selects_its_parameter() {
    let v = spec_viewer(Api::Fsdp1, false);
    let mut h = harness(v);
    h.run();
    // 1 unit, 4 ranks; use_orig_params=False: a on ranks 0-1, b on ranks 1-3 -> 5 parameter
    // chunks + 1 tail padding = 6 chunks.
    h.get_by_label_contains("1 units, 4 ranks per shard group, 6 chunks");
    let canvas = h.state().shard_map.last_canvas.unwrap();
    let view = h.state().view.clone().unwrap();
    let b = view.by_fqn["b"];
    let (_, rank_index, rect) =
        shardscope_viewer::panels::shard_map::slice_rect(&view, &h.state().shard_map, canvas, b)
            .unwrap();
    // b's first slice is on rank 1 (elements [0, 1) at offset 2 of rank 1's shard).
    assert_eq!(view.units[0].ranks[rank_index].rank, 1);
    let pos = rect.center();
    h.hover_at(pos);
    h.run();
    h.drag_at(pos);
    h.run();
    h.drop_at(pos);
    h.run();
    assert_eq!(h.state().selection.fqn.as_deref(), Some("b"));
    h.get_by_label("held by ranks 1-3");
}

#[test]
fn world_size_and_strategy_changes_recompute_at_once() {
    let mut v = spec_viewer(Api::Fsdp1, true);
    v.tab = Tab::Ranks;
    let mut h = harness(v);
    h.run();
    h.get_by_label_contains("4 ranks per shard group");
    h.state_mut().controls.world_size = 2;
    h.run();
    // ws=2 (spec §1.3): a (5) + 3 alignment elements + b (6) = 14, already a multiple of the
    // world size, so no world-size padding: 3 fp32 elements = 12 B, and C = 7 with no tail.
    h.get_by_label_contains("2 ranks per shard group");
    h.get_by_label_contains("padding 12 B alignment + 0 B shard tail");
    // A hybrid strategy with a group size that does not divide the world shows the engine's error.
    h.state_mut().controls.strategy = shardscope_core::layout::Strategy::HybridShard;
    h.state_mut().controls.world_size = 4;
    h.state_mut().controls.shard_group_size = 3;
    h.run();
    assert!(
        h.get_all_by_label_contains("does not divide world size 4")
            .count()
            >= 1
    );
}

#[test]
fn trace_tab_lists_lanes_and_spans() {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.open_bytes(
        "gather_trace.json",
        include_bytes!("../../../examples/viewer/gather_trace.json").to_vec(),
    );
    v.poll_loader();
    let mut h = harness(v);
    h.run();
    assert_eq!(h.state().tab, Tab::Trace);
    // make_trace.py writes 4 ranks x 3 units x 3 phases.
    h.get_by_label_contains("4 lanes · 36 spans");
    h.get_by_label("all_gather");
}

#[test]
fn theme_toggle_and_bad_input_message() {
    let mut v = spec_viewer(Api::Fsdp1, true);
    v.open_bytes("weights.bin", vec![0x80, 0x02, 0x7d]);
    v.poll_loader();
    let mut h = harness(v);
    h.run();
    // A `.bin` is read as a torch.save checkpoint now; the error names the file.
    h.get_by_label_contains("error: weights.bin: ");
    h.get_by_label("Light theme").click();
    h.run();
    assert!(!h.state().theme.is_dark());
    h.get_by_label("Dark theme");
}

#[test]
fn verify_tab_lists_problems_and_links_them_to_the_layout() {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.open_bytes(
        "tiny_model.json",
        include_bytes!("../../../examples/tiny_model.json").to_vec(),
    );
    v.open_bytes(
        "verify_report.json",
        include_bytes!("../../../examples/viewer/verify_report.json").to_vec(),
    );
    v.poll_loader();
    let mut h = harness(v);
    h.run();
    assert_eq!(h.state().tab, Tab::Verify);
    // The example report has 8 entries: 6 match, 1 mismatch, 1 missing; problems only by default.
    h.get_by_label("8 tensors: 6 match, 1 mismatch, 1 missing");
    assert!(
        h.query_by_label("match").is_none(),
        "matching entries are hidden at first"
    );
    h.get_by_label("mismatch");
    h.get_by_label("missing");
    h.get_by_label("block1.lin.weight").click();
    h.run();
    assert_eq!(
        h.state().selection.fqn.as_deref(),
        Some("block1.lin.weight")
    );
    // The inspector shows where the mismatching tensor lives: FSDP1, 4 ranks, use_orig_params.
    h.get_by_label("_fsdp_wrapped_module.block1._fsdp_wrapped_module._flat_param");
    // Show all entries.
    h.get_by_label("only problems").click();
    h.run();
    assert_eq!(h.query_all_by_label("match").count(), 6);
}
