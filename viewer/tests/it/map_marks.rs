//! Computed vs stored in the shard map (`viewer::map_marks`, the state the Shard map tab draws):
//! checkpoints torch wrote with FSDP2 (per-rank files at 2 ranks, HSDP 2x2 files at 4 ranks, a DCP
//! at 2 ranks) have no mark at their own world size; at another world size every extra and
//! missing range of the overlay is placed on the bars, each where the layout draws its elements:
//! a missing piece on the bar of the rank that should hold it, a piece stored by the wrong rank
//! on the bar of the rank the layout gives it to.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use shardscope_viewer::Tab;
use shardscope_viewer::app::Viewer;
use shardscope_viewer::map_marks::MarkKind;
use shardscope_viewer::view::SegKind;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn open(dir: &Path) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.open_path(dir.to_owned());
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    v.tab = Tab::ShardMap;
    v.recompute();
    v
}

/// (kind, fqn, element range) of every difference, from the overlay or from the marks.
type Diffs = BTreeSet<(MarkKind, String, u64, u64)>;

fn overlay_diffs(v: &Viewer) -> Diffs {
    let o = v.overlay.as_ref().unwrap();
    let mut out = Diffs::new();
    for p in &o.params {
        for r in &p.ranks {
            for &(a, b) in &r.extra {
                out.insert((MarkKind::Extra { rank: r.rank }, p.fqn.clone(), a, b));
            }
            for &(a, b) in &r.missing {
                out.insert((MarkKind::Missing { rank: r.rank }, p.fqn.clone(), a, b));
            }
        }
    }
    out
}

/// Marks joined back into whole ranges per (kind, fqn).
fn mark_diffs(v: &Viewer) -> Diffs {
    let m = v.map_marks.as_ref().unwrap();
    let mut parts: Vec<(MarkKind, String, u64, u64)> = m
        .marks()
        .map(|k| (k.kind, k.fqn.clone(), k.elements.0, k.elements.1))
        .collect();
    parts.sort();
    let mut out: Vec<(MarkKind, String, u64, u64)> = Vec::new();
    for p in parts {
        match out.last_mut() {
            Some(last) if last.0 == p.0 && last.1 == p.1 && last.3 == p.2 => last.3 = p.3,
            _ => out.push(p),
        }
    }
    out.into_iter().collect()
}

fn check(dir: &Path, own: u64, other: u64) {
    let mut v = open(dir);
    assert_eq!(v.controls.world_size, own);
    let m = v
        .map_marks
        .as_ref()
        .expect("marks for a per-rank checkpoint");
    assert_eq!((m.extra, m.missing, m.count), (0, 0, 0), "{}", m.summary());

    v.controls.world_size = other;
    v.recompute();
    let (extra, missing) = v.overlay.as_ref().unwrap().piece_differences();
    let m = v.map_marks.clone().unwrap();
    assert!(extra + missing > 0);
    assert_eq!((m.extra, m.missing), (extra, missing));
    assert_eq!(m.unplaced, 0, "{}", m.summary());
    // Every difference is drawn, whole: the marks join back into the overlay's ranges.
    assert_eq!(mark_diffs(&v), overlay_diffs(&v));
    let view = v.view.as_ref().unwrap();
    let group = view.shard_group_size;
    for mark in m.marks() {
        let bar = &view.units[mark.unit].ranks[mark.rank_index];
        // On a slice of its parameter that draws exactly these elements at these bytes.
        let param = view.by_fqn[&mark.fqn];
        let seg = bar
            .segs
            .iter()
            .find(|s| {
                matches!(s.kind, SegKind::Param { param: p, intra_start }
                    if p == param
                        && intra_start <= mark.elements.0
                        && mark.elements.1 <= intra_start + s.numel)
            })
            .unwrap_or_else(|| panic!("{mark:?} is on no slice of its parameter"));
        let SegKind::Param { intra_start, .. } = seg.kind else {
            unreachable!()
        };
        let per = seg.len_bytes / seg.numel;
        assert_eq!(
            mark.x_bytes,
            seg.x_bytes + (mark.elements.0 - intra_start) * per
        );
        assert_eq!(mark.len_bytes, (mark.elements.1 - mark.elements.0) * per);
        // On the bar of the rank it concerns, unless that bar draws none of these elements.
        let (MarkKind::Extra { rank } | MarkKind::Missing { rank }) = mark.kind;
        let own = (rank < view.world_size).then_some(rank % group);
        if Some(bar.rank) != own
            && let Some(own) = own
        {
            let own_bar = view.units[mark.unit]
                .ranks
                .iter()
                .find(|b| b.rank == own)
                .unwrap();
            assert!(
                !own_bar.segs.iter().any(|s| matches!(s.kind, SegKind::Param { param: p, intra_start }
                    if p == param && intra_start < mark.elements.1 && mark.elements.0 < intra_start + s.numel)),
                "{mark:?} is drawn on bar {} though rank {rank}'s bar draws these elements",
                bar.rank
            );
        }
    }
    assert!(m.count > 0);

    // The Shard map tab: the toggle with the summary, the legend; off hides the marks.
    let mut h = Harness::builder()
        .with_size(egui::vec2(1400.0, 900.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), v);
    h.run();
    h.get_by_label("in the layout, stored by no chunk of that rank (missing)");
    h.get_by_label(&m.summary()).click_accesskit();
    h.run();
    assert!(!h.state().shard_map.show_differences);
}

#[test]
fn fsdp2_per_rank_files() {
    check(&root().join("tests/fixtures/formats/fsdp2"), 2, 3);
}

#[test]
fn fsdp2_hsdp_per_rank_files() {
    check(&root().join("tests/fixtures/fsdp2_hsdp/ws4_2x2"), 4, 2);
}

#[test]
fn fsdp2_dcp_example() {
    check(&root().join("examples/fsdp2_dcp"), 2, 4);
}

/// The Shard map tab of `examples/fsdp2_dcp` (FSDP2) at world size 4 with its marks, under Xvfb:
/// `docs/img/shard_map_overlay.png` with `SHARDSCOPE_DOCS_MAP_SCREENSHOT` set.
#[test]
fn screenshot_of_the_marks() {
    super::compare::screenshot(
        &[
            "--api",
            "fsdp2",
            "--world-size",
            "4",
            "--tab",
            "shard-map",
            "examples/fsdp2_dcp",
        ],
        "SHARDSCOPE_DOCS_MAP_SCREENSHOT",
    );
}
