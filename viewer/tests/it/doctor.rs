//! The Verify tab shows `shardscope doctor` findings for the opened checkpoint (checked alone),
//! next to the keys they name: torch-written fixtures of `tests/fixtures/doctor` (see its
//! `gen_doctor.py`). A state dict saved from `torch.compile(model)` carries `_orig_mod.` on every
//! key; a clean save has no finding.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use shardscope_viewer::{Tab, Viewer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/doctor")
}

fn open(file: &str) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    let bytes = std::fs::read(fixtures().join(file)).unwrap();
    v.open_bytes(file, bytes);
    assert_eq!(v.poll_loader(), 0);
    assert!(v.checkpoint.is_some(), "not opened: {:?}", v.messages);
    v
}

fn harness(viewer: Viewer) -> Harness<'static, Viewer> {
    Harness::builder()
        .with_size(egui::Vec2::new(1500.0, 1000.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), viewer)
}

#[test]
fn verify_tab_lists_doctor_findings_and_selects_their_keys() {
    let mut v = open("compiled.pt");
    v.tab = Tab::Verify;
    let mut h = harness(v);
    h.run();
    h.get_by_label("doctor: 1 finding(s)");
    h.get_by_label("error[wrapper-prefix]");
    h.get_by_label_contains("torch.compile");
    h.get_by_label_contains("shardscope convert compiled.pt --select _orig_mod");
    h.get_by_label("9 key(s)").click();
    h.run();
    h.get_by_label("_orig_mod.embed.weight").click();
    h.run();
    assert_eq!(
        h.state().selection.fqn.as_deref(),
        Some("_orig_mod.embed.weight")
    );
}

#[test]
fn healthy_checkpoint_has_no_doctor_section() {
    let v = open("clean.pt");
    assert!(v.checkpoint.as_ref().unwrap().findings.is_empty());
    let mut v = v;
    v.tab = Tab::Verify;
    let mut h = harness(v);
    h.run();
    assert!(h.query_by_label_contains("doctor:").is_none());
}
