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

fn synthetic_model(params: usize) -> ModelDescription {
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
    let units = (0..params.div_ceil(4))
        .map(|l| format!("layers.{l}"))
        .collect();
    ModelDescription::new(specs, units, Vec::new()).expect("valid synthetic model")
}

struct Stats {
    median: Duration,
    p95: Duration,
    worst: Duration,
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
        std::hint::black_box(prims);
    }
    times.sort();
    Stats {
        median: times[times.len() / 2],
        p95: times[times.len() * 95 / 100],
        worst: times[times.len() - 1],
    }
}

fn main() {
    let frames: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300);

    let mut tiny = Viewer::with_example();
    let base = run(&mut tiny, frames, 16.0, 1.0);

    let model = synthetic_model(98);
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
    let chunks = view.chunk_count();
    println!(
        "synthetic FSDP2: {} params x {} ranks = {} chunks in {} units; layout + view built in {:.1} ms",
        view.params.len(),
        view.shard_group_size,
        chunks,
        view.units.len(),
        build.as_secs_f64() * 1e3
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("frames: {frames} per case, 1600x1000 points, CPU (Context::run + tessellate)");
    println!(
        "baseline tiny example : median {:.2} ms  p95 {:.2} ms  worst {:.2} ms",
        ms(base.median),
        ms(base.p95),
        ms(base.worst)
    );
    for (label, row_h, zoom) in [
        ("100k chunks, rows 16 pt, zoom 1 ", 16.0, 1.0),
        ("100k chunks, rows 3 pt, zoom 1  ", 3.0, 1.0),
        ("100k chunks, rows 16 pt, zoom 8 ", 16.0, 8.0),
    ] {
        let s = run(&mut big, frames, row_h, zoom);
        println!(
            "{label}: median {:.2} ms  p95 {:.2} ms  worst {:.2} ms  (median {:.1}x baseline)",
            ms(s.median),
            ms(s.p95),
            ms(s.worst),
            s.median.as_secs_f64() / base.median.as_secs_f64().max(1e-9)
        );
    }
}
