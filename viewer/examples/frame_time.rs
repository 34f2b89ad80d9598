//! Frame-time benchmark of the viewer at scale, headless (no GPU: it measures what the CPU does per
//! frame, `Context::run` (layout + painting) plus tessellation into triangles).
//!
//! `cargo run --release -p shardscope-viewer --example frame_time [-- FRAMES]`
//!
//! It builds a synthetic FSDP2 model of 98 parameters over 1 024 ranks (100 352 chunks), shows the
//! shard map, presses the mouse and drags (panning) for FRAMES frames, and prints the median, p95
//! and worst frame time. The same run measures the bundled tiny example as the baseline and
//! prints the ratio.

use std::time::{Duration, Instant};

use egui::{Event, Modifiers, PointerButton, Pos2, RawInput, Rect, Vec2};
use shardscope_core::DType;
use shardscope_core::layout::{Api, Strategy};
use shardscope_core::model::{ModelDescription, ParamSpec};
use shardscope_viewer::Viewer;

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
