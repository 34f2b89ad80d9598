//! Frame-time benchmark of the viewer at scale, headless (no GPU: it measures what the CPU does per
//! frame, `Context::run` (layout + painting) plus tessellation into triangles).
//!
//! `cargo run --release -p shardscope-viewer --example frame_time [-- FRAMES]`
//!
//! It builds a synthetic FSDP2 model of 98 parameters over 1 024 ranks (100 352 chunks), shows the
//! shard map, presses the mouse and drags (panning) for FRAMES frames, and prints the median, p95
//! and worst frame time. The same run measures the bundled tiny example as the baseline and
//! prints the ratio.
//!
//! Then it builds synthetic checkpoint indexes (a DCP-like index of 98 tensors x 1 024 rank chunks
//! = 100 352 chunks, and one tensor of 100 000 chunks), opens them in the viewer, selects a tensor
//! and drags in the **Chunks** map (zoom 1 and 8) and over the checkpoint tree / key table.

use std::time::{Duration, Instant};

use egui::{Event, Modifiers, PointerButton, Pos2, RawInput, Rect, Vec2};
use shardscope_core::DType;
use shardscope_core::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, EntryKind, FileInfo, Format, IndexEntry,
    PathSeg,
};
use shardscope_core::layout::{Api, Strategy};
use shardscope_core::model::{ModelDescription, ParamSpec};
use shardscope_viewer::Viewer;
use shardscope_viewer::app::Tab;
use shardscope_viewer::checkpoint::CheckpointView;

/// A DCP-like index: `tensors` 2-D tensors, each split into `grid.0 x grid.1` chunks (row bands x
/// column blocks), chunk `k` written by rank `k % ranks` into `__{rank}_0.distcp`.
fn synthetic_checkpoint(tensors: usize, grid: (u64, u64), ranks: u32) -> CheckpointView {
    let (gr, gc) = grid;
    let mut files: std::collections::BTreeMap<String, FileInfo> = (0..ranks)
        .map(|r| {
            (
                format!("__{r}_0.distcp"),
                FileInfo {
                    size: 0,
                    rank: Some(r),
                    unreferenced_bytes: 0,
                },
            )
        })
        .collect();
    let mut file_end = vec![0u64; ranks as usize];
    let mut entries = Vec::with_capacity(tensors);
    for t in 0..tensors {
        let key = format!("model.layers.{}.{}", t / 4, ["wq", "wk", "wv", "wo"][t % 4]);
        let (rows, cols) = (gr * 8, gc * 16);
        let mut chunks = Vec::with_capacity((gr * gc) as usize);
        for k in 0..gr * gc {
            let (i, j) = (k / gc, k % gc);
            let rank = u32::try_from(k % u64::from(ranks)).expect("rank fits");
            let byte_length = 8 * 16 * 4;
            let end = &mut file_end[rank as usize];
            chunks.push(Chunk {
                offsets: vec![i * 8, j * 16].into(),
                sizes: vec![8, 16].into(),
                file: format!("__{rank}_0.distcp").into(),
                byte_offset: *end,
                byte_length,
                rank: Some(rank),
                encoding: ChunkEncoding::TorchSaveItem,
            });
            *end += byte_length;
        }
        entries.push(IndexEntry {
            path: key.split('.').map(|p| PathSeg::Key(p.to_owned())).collect(),
            key,
            raw_key: None,
            kind: EntryKind::Tensor,
            dtype: Some(DType::Float32),
            shape: Some(vec![rows, cols]),
            chunks,
            fsdp: None,
            role: None,
            flat_param: false,
            value: None,
            position: None,
            object: None,
        });
    }
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    for (r, end) in file_end.iter().enumerate() {
        if let Some(f) = files.get_mut(&format!("__{r}_0.distcp")) {
            f.size = *end;
        }
    }
    let index = CheckpointIndex {
        format: Format::Dcp,
        kind: CheckpointKind::DcpTorchSave,
        has_optimizer_state: false,
        entries,
        files,
        dcp: None,
    };
    CheckpointView::from_index("synthetic", index, &std::collections::BTreeMap::new())
}

/// Drags from `start` for `frames` frames in the given tab and reports the frame times.
fn run_checkpoint(viewer: &mut Viewer, frames: usize, start: Pos2, zoom: f32) -> Stats {
    let ctx = egui::Context::default();
    let screen = Rect::from_min_size(Pos2::ZERO, Vec2::new(1600.0, 1000.0));
    let input = |events: Vec<Event>| RawInput {
        screen_rect: Some(screen),
        events,
        ..RawInput::default()
    };
    for _ in 0..3 {
        let out = ctx.run_ui(input(Vec::new()), |ui| viewer.ui(ui));
        let _ = ctx.tessellate(out.shapes, out.pixels_per_point);
    }
    viewer.ckpt.zoom = zoom;
    viewer.ckpt.pan = Vec2::ZERO;
    let pan_before = viewer.ckpt.pan;
    let mut pos = start;
    let mut times = Vec::with_capacity(frames);
    let mut vertices = 0;
    let mut scrolled = 0.0f32;
    let mut events = vec![
        Event::PointerMoved(pos),
        Event::PointerButton {
            pos,
            button: PointerButton::Primary,
            pressed: true,
            modifiers: Modifiers::NONE,
        },
    ];
    for i in 0..frames {
        let dir = if (i / 50) % 2 == 0 { 1.0 } else { -1.0 };
        pos += Vec2::new(-3.0 * dir, -4.0 * dir);
        events.push(Event::PointerMoved(pos));
        let t = Instant::now();
        let out = ctx.run_ui(input(std::mem::take(&mut events)), |ui| viewer.ui(ui));
        let prims = ctx.tessellate(out.shapes, out.pixels_per_point);
        times.push(t.elapsed());
        vertices = prims
            .iter()
            .map(|p| match &p.primitive {
                egui::epaint::Primitive::Mesh(m) => m.vertices.len(),
                egui::epaint::Primitive::Callback(_) => 0,
            })
            .sum();
        // Chunk map pan in points (fractions of the canvas times its size).
        let canvas = viewer.ckpt.last_canvas.map_or(Vec2::ZERO, |c| c.size());
        scrolled = scrolled.max(((viewer.ckpt.pan - pan_before) * canvas * zoom).length());
    }
    times.sort();
    Stats {
        median: times[times.len() / 2],
        p95: times[times.len() * 95 / 100],
        worst: times[times.len() - 1],
        vertices,
        scrolled,
    }
}

fn checkpoint_cases(frames: usize, base: &Stats) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for (label, tensors, grid) in [
        ("DCP-like, 98 tensors x 1024 rank chunks", 98, (32, 32)),
        ("1 tensor of 100 000 chunks (1000 x 100)", 1, (1000, 100)),
    ] {
        let t = Instant::now();
        let view = synthetic_checkpoint(tensors, grid, 1024);
        let build = t.elapsed();
        println!(
            "checkpoint {label}: {} entries, {} chunks, {} ranks; view built in {:.1} ms",
            view.index.entries.len(),
            view.chunk_count,
            view.all_ranks.len(),
            ms(build)
        );
        let key = view.index.entries[0].key.clone();
        let mut v = Viewer::new();
        v.loader.synchronous = true;
        v.checkpoint = Some(view);
        v.selection.select(key);
        for (case, tab, zoom) in [
            ("  chunk map, zoom 1  ", Tab::Chunks, 1.0),
            ("  chunk map, zoom 8  ", Tab::Chunks, 8.0),
            ("  key table + tree   ", Tab::Checkpoint, 1.0),
        ] {
            v.tab = tab;
            v.stay_on_tab = true;
            // One frame to place the panels, then drag from the middle of the chunk map (or of
            // the key table) / the tree.
            let ctx = egui::Context::default();
            let out = ctx.run_ui(
                RawInput {
                    screen_rect: Some(Rect::from_min_size(Pos2::ZERO, Vec2::new(1600.0, 1000.0))),
                    ..RawInput::default()
                },
                |ui| v.ui(ui),
            );
            drop(out);
            let start = if tab == Tab::Chunks {
                v.ckpt
                    .last_canvas
                    .map_or(Pos2::new(800.0, 500.0), |c| c.center())
            } else {
                Pos2::new(150.0, 600.0)
            };
            let s = run_checkpoint(&mut v, frames, start, zoom);
            println!(
                "{case}: median {:.2} ms  p95 {:.2} ms  worst {:.2} ms  (median {:.1}x baseline; {} vertices/frame, panned {:.0} pt)",
                ms(s.median),
                ms(s.p95),
                ms(s.worst),
                s.median.as_secs_f64() / base.median.as_secs_f64().max(1e-9),
                s.vertices,
                s.scrolled
            );
        }
    }
}

fn synthetic_model(params: usize, one_unit: bool) -> ModelDescription {
    let specs = (0..params)
        .map(|i| ParamSpec {
            fqn: format!("layers.{}.{}", i / 4, ["wq", "wk", "wv", "wo"][i % 4]),
            shape: vec![4096 + (i as u64 % 7) * 129, 1024],
            dtype: if i % 3 == 0 {
                DType::BFloat16
            } else {
                DType::Float32
            },
            requires_grad: true,
            shared_with: None,
        })
        .collect();
    let units = if one_unit {
        vec![String::new()]
    } else {
        (0..params.div_ceil(4))
            .map(|l| format!("layers.{l}"))
            .collect()
    };
    ModelDescription::new(specs, units, Vec::new()).expect("valid synthetic model")
}

struct Stats {
    median: Duration,
    p95: Duration,
    worst: Duration,
    /// Triangles' vertices in the last frame (how much was drawn).
    vertices: usize,
    /// How far the drag moved the view (points), proof the frames panned.
    scrolled: f32,
}

fn run(viewer: &mut Viewer, frames: usize, row_height: f32, zoom: f64) -> Stats {
    let ctx = egui::Context::default();
    let screen = Rect::from_min_size(Pos2::ZERO, Vec2::new(1600.0, 1000.0));
    viewer.shard_map.row_height = row_height;
    let input = |events: Vec<Event>| RawInput {
        screen_rect: Some(screen),
        events,
        ..RawInput::default()
    };
    // Warm up: fonts, first layout.
    for _ in 0..3 {
        let out = ctx.run_ui(input(Vec::new()), |ui| viewer.ui(ui));
        let _ = ctx.tessellate(out.shapes, out.pixels_per_point);
    }
    viewer.shard_map.zoom = zoom;
    let canvas = viewer
        .shard_map
        .last_canvas
        .expect("the shard map was drawn");
    let mut pos = canvas.center();
    let mut times = Vec::with_capacity(frames);
    let mut vertices = 0;
    let scroll_before = viewer.shard_map.scroll_y;
    let mut scrolled = 0.0f32;
    let mut events = vec![
        Event::PointerMoved(pos),
        Event::PointerButton {
            pos,
            button: PointerButton::Primary,
            pressed: true,
            modifiers: Modifiers::NONE,
        },
    ];
    for i in 0..frames {
        // Drag left and down, reversing every 100 frames so the view keeps moving.
        let dir = if (i / 100) % 2 == 0 { 1.0 } else { -1.0 };
        pos += Vec2::new(-7.0 * dir, -5.0 * dir);
        events.push(Event::PointerMoved(pos));
        let t = Instant::now();
        let out = ctx.run_ui(input(std::mem::take(&mut events)), |ui| viewer.ui(ui));
        let prims = ctx.tessellate(out.shapes, out.pixels_per_point);
        times.push(t.elapsed());
        vertices = prims
            .iter()
            .map(|p| match &p.primitive {
                egui::epaint::Primitive::Mesh(m) => m.vertices.len(),
                egui::epaint::Primitive::Callback(_) => 0,
            })
            .sum();
        scrolled = scrolled.max((viewer.shard_map.scroll_y - scroll_before).abs());
    }
    times.sort();
    Stats {
        median: times[times.len() / 2],
        p95: times[times.len() * 95 / 100],
        worst: times[times.len() - 1],
        vertices,
        scrolled,
    }
}

fn main() {
    let frames: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300);

    let mut tiny = Viewer::with_example();
    let base = run(&mut tiny, frames, 16.0, 1.0);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("frames: {frames} per case, 1600x1000 points, CPU (Context::run + tessellate)");
    println!(
        "baseline tiny example : median {:.2} ms  p95 {:.2} ms  worst {:.2} ms  ({} vertices/frame)",
        ms(base.median),
        ms(base.p95),
        ms(base.worst),
        base.vertices
    );
    checkpoint_cases(frames, &base);
    if std::env::var_os("FRAME_TIME_CHECKPOINT_ONLY").is_some() {
        return;
    }
    // 25 units of 4 parameters (a transformer-like wrapping), then every parameter in one unit
    // (98 slices in every rank's bar: the most drawn per row).
    for one_unit in [false, true] {
        let model = synthetic_model(98, one_unit);
        let mut big = Viewer::new();
        big.controls.api = Api::Fsdp2;
        big.controls.strategy = Strategy::FullShard;
        big.controls.world_size = 1024;
        let t = Instant::now();
        big.model = Some(shardscope_viewer::app::LoadedModel {
            name: "synthetic".to_owned(),
            model,
            derived: None,
            example: false,
        });
        big.recompute();
        let build = t.elapsed();
        let view = big.view.as_ref().expect("layout");
        println!(
            "synthetic FSDP2: {} params x {} ranks = {} chunks in {} units; layout + view built in {:.1} ms",
            view.params.len(),
            view.shard_group_size,
            view.chunk_count(),
            view.units.len(),
            build.as_secs_f64() * 1e3
        );
        for (label, row_h, zoom) in [
            ("  rows 16 pt, zoom 1", 16.0, 1.0),
            ("  rows 3 pt, zoom 1 ", 3.0, 1.0),
            ("  rows 16 pt, zoom 8", 16.0, 8.0),
        ] {
            big.shard_map.scroll_y = 0.0;
            big.shard_map.pan = 0.0;
            let s = run(&mut big, frames, row_h, zoom);
            println!(
                "{label}: median {:.2} ms  p95 {:.2} ms  worst {:.2} ms  (median {:.1}x baseline; {} vertices/frame, panned {:.0} pt)",
                ms(s.median),
                ms(s.p95),
                ms(s.worst),
                s.median.as_secs_f64() / base.median.as_secs_f64().max(1e-9),
                s.vertices,
                s.scrolled
            );
        }
    }
}
