//! The shard map of a DeepSpeed ZeRO checkpoint: each rank's fp32 flat partitions as saved, a bar
//! per rank and flat group, a segment per parameter piece, the padding drawn as padding. Opened
//! from the folders DeepSpeed 0.19.8 wrote (`tests/fixtures/deepspeed`, `gen_deepspeed.py`).
//! Expected: `expected/<case>.partitions.json`, which the generator wrote from DeepSpeed's own
//! bookkeeping on the live engine (ZeRO-1/2: each parameter's `_hp_mapping` fragment addresses,
//! `round_robin_bit16_offsets`/`_padding`, `partition_size`, `groups_padding`; ZeRO-3:
//! `grad_position` and `ds_numel`), never from shardscope.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::PathBuf;

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use serde_json::Value;
use shardscope_viewer::Viewer;
use shardscope_viewer::panels::shard_map;
use shardscope_viewer::view::{LayoutView, SegKind};

use shardscope_tests::deepspeed_cases;

fn deepspeed() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspeed")
}

fn open(case: &str) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.open_path(deepspeed().join(case));
    assert_eq!(v.poll_loader(), 0);
    assert!(v.checkpoint.is_some(), "{case}: {:?}", v.messages);
    v
}

/// `(name, at, start, numel)` of every piece a bar draws, and `(at, numel)` of its padding.
type Drawn = (Vec<(String, u64, u64, u64)>, Vec<(u64, u64)>);

fn drawn(view: &LayoutView, unit: usize, rank_index: usize) -> Drawn {
    let (mut pieces, mut padding) = (Vec::new(), Vec::new());
    for seg in &view.units[unit].ranks[rank_index].segs {
        match seg.kind {
            SegKind::Param { param, intra_start } => pieces.push((
                view.params[param].fqn.clone(),
                seg.offset_in_shard,
                intra_start,
                seg.numel,
            )),
            SegKind::AlignPad | SegKind::TailPad { .. } => {
                padding.push((seg.offset_in_shard, seg.numel));
            }
        }
    }
    (pieces, padding)
}

fn expected_bar(group: &Value) -> (u64, Drawn) {
    let mut pieces: Vec<(String, u64, u64, u64)> = group["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["at"].as_u64().unwrap(),
                p["start"].as_u64().unwrap(),
                p["numel"].as_u64().unwrap(),
            )
        })
        .collect();
    pieces.sort_by_key(|p| p.1);
    let padding = group["padding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_u64().unwrap()))
        .collect();
    (group["numel"].as_u64().unwrap(), (pieces, padding))
}

#[test]
fn shard_map_draws_each_ranks_partitions_as_deepspeed_records_them() {
    let mut padded_cases = 0;
    for case in deepspeed_cases() {
        let v = open(case);
        let want: Value = serde_json::from_slice(
            &std::fs::read(
                deepspeed()
                    .join("expected")
                    .join(format!("{case}.partitions.json")),
            )
            .unwrap(),
        )
        .unwrap();
        let view = v
            .view
            .as_ref()
            .unwrap_or_else(|| panic!("{case}: {:?}", v.messages));
        assert!(view.is_deepspeed(), "{case}: {}", view.api_label);
        let stage = want["stage"].as_u64().unwrap();
        assert_eq!(view.strategy_label, format!("ZeRO-{stage}"), "{case}");
        assert_eq!(
            view.world_size,
            want["world_size"].as_u64().unwrap(),
            "{case}"
        );
        let ranks = want["ranks"].as_array().unwrap();
        let groups = ranks[0]["groups"].as_array().unwrap().len();
        assert_eq!(view.units.len(), groups, "{case}");
        let mut case_padding = 0;
        for r in ranks {
            let rank = r["rank"].as_u64().unwrap();
            for (g, group) in r["groups"].as_array().unwrap().iter().enumerate() {
                let unit = &view.units[g];
                let ri = unit.ranks.iter().position(|b| b.rank == rank).unwrap();
                let bar = &unit.ranks[ri];
                let (numel, want_drawn) = expected_bar(group);
                let got = drawn(view, g, ri);
                assert_eq!(got, want_drawn, "{case}: rank {rank}, group {g}");
                // The segments tile the saved partition: fp32 elements, 4 bytes each.
                let seg_numel: u64 = bar.segs.iter().map(|s| s.numel).sum();
                assert_eq!(seg_numel, numel, "{case}: rank {rank}, group {g}");
                let pad_numel: u64 = want_drawn.1.iter().map(|p| p.1).sum();
                assert_eq!(
                    bar.align_pad_bytes + bar.tail_pad_bytes,
                    pad_numel * 4,
                    "{case}: rank {rank}, group {g}"
                );
                assert!(unit.bar_bytes >= numel * 4, "{case}");
                // ZeRO-1/2 padding is alignment padding, ZeRO-3's the padding of a last part.
                for s in &bar.segs {
                    match s.kind {
                        SegKind::AlignPad => assert!(stage <= 2, "{case}"),
                        SegKind::TailPad { param } => {
                            assert_eq!(stage, 3, "{case}");
                            assert!(param.is_some(), "{case}: padding of no parameter");
                        }
                        SegKind::Param { .. } => {}
                    }
                }
                case_padding += pad_numel;
            }
        }
        if case.ends_with("_padded") {
            assert!(case_padding > 0, "{case}: no padding to draw");
            padded_cases += 1;
        }
    }
    assert_eq!(padded_cases, 2);
}

/// Clicking a piece of a parameter split across the ranks selects it; its pieces are on both
/// ranks' bars (the map outlines every piece of the selected parameter), and the padding's
/// hover text says what DeepSpeed put there.
#[test]
fn selecting_a_deepspeed_parameter_names_its_pieces_on_every_rank() {
    let v = open("zero2_fp32_padded");
    let mut h = Harness::builder()
        .with_size(egui::Vec2::new(2400.0, 900.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), v);
    h.state_mut().tab = shardscope_viewer::Tab::ShardMap;
    h.run();
    h.get_by_label_contains("2 units, 2 ranks per shard group");
    let canvas = h.state().shard_map.last_canvas.unwrap();
    let view = h.state().view.clone().unwrap();
    // up.weight lies across the ranks' boundary of group 0 (DeepSpeed's partitions.json: 10
    // elements on rank 0, 32 on rank 1).
    let up = view.by_fqn["up.weight"];
    let (unit, rank_index, rect) =
        shard_map::slice_rect(&view, &h.state().shard_map, canvas, up).unwrap();
    assert_eq!((unit, view.units[unit].ranks[rank_index].rank), (0, 0));
    let pos = rect.center();
    h.hover_at(pos);
    h.run();
    h.drag_at(pos);
    h.run();
    h.drop_at(pos);
    h.run();
    assert_eq!(h.state().selection.fqn.as_deref(), Some("up.weight"));
    h.get_by_label("Selected:");
    let row = view.param("up.weight").unwrap();
    assert_eq!(row.ranks, vec![0, 1]);
    let pieces: Vec<(u64, u64, u64)> = row
        .chunks
        .iter()
        .map(|c| (c.rank, c.start, c.end))
        .collect();
    assert_eq!(pieces, vec![(0, 0, 10), (1, 10, 42)]);
    // The padding after embed.weight on rank 0: 2 fp32 elements at 66.
    let bar = &view.units[0].ranks[0];
    let pad = bar
        .segs
        .iter()
        .find(|s| s.kind == SegKind::AlignPad)
        .unwrap();
    assert_eq!((pad.offset_in_shard, pad.numel, pad.len_bytes), (66, 2, 8));
    let text = shard_map::describe(&view, &view.units[0], 0, pad);
    assert!(
        text.contains("param_alignment_paddings")
            && text.contains("single_partition_of_fp32_groups.0"),
        "{text}"
    );
}
