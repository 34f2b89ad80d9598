//! Computed vs stored: the Ranks tab lays what each rank of an opened checkpoint stores over what
//! the layout computes (`core::view::overlay`). Checkpoints torch wrote with FSDP2 at a known world
//! size (`tests/fixtures/formats/fsdp2`: 2 ranks; `tests/fixtures/fsdp2_hsdp/ws4_2x2`: 4 ranks,
//! mesh 2x2; `examples/fsdp2_dcp`: 2 ranks, DCP) match at the world size the checkpoint states
//! and show differences once the world size control is changed.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use shardscope_viewer::Tab;
use shardscope_viewer::app::Viewer;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn open(dir: &Path) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    for p in names {
        v.open_bytes(
            p.file_name().unwrap().to_str().unwrap(),
            std::fs::read(&p).unwrap(),
        );
    }
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    v.tab = Tab::Ranks;
    v
}

/// Opens `dir`, checks the Ranks tab says "match" at the checkpoint's own world size, then sets
/// the world size control to `other` and checks the differences are reported.
fn match_then_differ(dir: &Path, own: u64, other: u64) {
    let v = open(dir);
    assert_eq!(
        v.controls.world_size, own,
        "the control follows the checkpoint"
    );
    assert!(
        v.controls
            .origins
            .world_size
            .as_deref()
            .is_some_and(|o| o.starts_with("from the checkpoint")),
        "{:?}",
        v.controls.origins
    );
    let mut h = Harness::builder()
        .with_size(egui::vec2(1400.0, 900.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), v);
    h.run();
    let summary = h.state().overlay.as_ref().unwrap().summary();
    assert!(
        summary.starts_with("stored chunks match the layout"),
        "{summary}"
    );
    h.get_by_label(&summary);
    assert!(h.state().status_line().contains(&summary));
    // The status says where the layout's world size came from.
    h.get_by_label_contains("world size from the checkpoint");
    // Another world size in the controls: the stored pieces no longer match.
    h.state_mut().controls.world_size = other;
    h.state_mut().recompute();
    h.run();
    let o = h.state().overlay.clone().unwrap();
    let (extra, missing) = o.piece_differences();
    assert!(extra + missing > 0, "{}", o.summary());
    assert!(
        o.config_differences
            .iter()
            .any(|d| d.starts_with(&format!("world size {own} in the checkpoint"))),
        "{:?}",
        o.config_differences
    );
    let summary = o.summary();
    assert!(summary.contains(" differences: "), "{summary}");
    h.get_by_label(&summary);
    h.get_by_label("in the layout, not stored");
}

#[test]
fn fsdp2_per_rank_files() {
    match_then_differ(&root().join("tests/fixtures/formats/fsdp2"), 2, 3);
}

#[test]
fn fsdp2_hsdp_per_rank_files() {
    match_then_differ(&root().join("tests/fixtures/fsdp2_hsdp/ws4_2x2"), 4, 2);
}

#[test]
fn fsdp2_dcp_example() {
    match_then_differ(&root().join("examples/fsdp2_dcp"), 2, 4);
}

/// The Ranks tab of `examples/fsdp2_dcp` viewed at world size 4, under Xvfb (the desktop binary),
/// for the docs (`docs/img/overlay.png` is this screenshot with `SHARDSCOPE_DOCS_OVERLAY_SCREENSHOT` set);
/// skipped where Xvfb is missing.
#[test]
fn screenshot_of_the_overlay() {
    // Relative (the script runs from the repository root): the window shows this path.
    super::compare::screenshot(
        &["--world-size", "4", "--tab", "ranks", "examples/fsdp2_dcp"],
        "SHARDSCOPE_DOCS_OVERLAY_SCREENSHOT",
    );
}
