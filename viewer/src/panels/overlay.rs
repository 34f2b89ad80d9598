//! Computed vs stored (Ranks tab): per parameter, one strip per rank over the parameter's
//! flattened elements, the stored chunks on top and the layout's pieces below; elements both hold
//! are green, stored where the layout does not predict them orange, predicted but stored by no
//! chunk red. The comparison is `core::view::overlay::compare`.

use egui::{Color32, Pos2, Rect, Sense, Stroke, StrokeKind, Ui, Vec2};
use shardscope_core::view::overlay::{ElementRange, Overlay};

use crate::panels::controls::Origins;

/// Elements stored and predicted.
pub const MATCHED: Color32 = Color32::from_rgb(70, 170, 90);
/// Stored, not predicted.
pub const EXTRA: Color32 = Color32::from_rgb(235, 150, 30);
/// Predicted, not stored.
pub const MISSING: Color32 = Color32::from_rgb(215, 50, 50);

/// Where the layout's configuration came from, for people (`world size 2: from the checkpoint: …`).
pub fn origins_line(origins: &Origins, world_size: u64, api: &str) -> String {
    let or_default = |o: &Option<String>| o.clone().unwrap_or_else(|| "default".to_owned());
    format!(
        "layout {api}, world size {world_size} · API {} · world size {}",
        or_default(&origins.api),
        or_default(&origins.world_size)
    )
}

fn legend(ui: &mut Ui) {
    ui.horizontal(|ui| {
        for (color, label) in [
            (MATCHED, "stored and computed"),
            (EXTRA, "stored, not in the layout"),
            (MISSING, "in the layout, not stored"),
        ] {
            let (rect, _) = ui.allocate_exact_size(Vec2::new(14.0, 10.0), Sense::hover());
            ui.painter().rect_filled(rect, 1.0, color);
            ui.label(label);
        }
    });
}

fn strip(ui: &mut Ui, numel: u64, parts: &[(&[ElementRange], Color32)]) {
    let w = ui.available_width().max(60.0);
    let (rect, _) = ui.allocate_exact_size(Vec2::new(w, 8.0), Sense::hover());
    let p = ui.painter();
    p.rect_filled(rect, 0.0, ui.visuals().extreme_bg_color);
    let scale = w / numel.max(1) as f32;
    for (ranges, color) in parts {
        for &(a, b) in *ranges {
            let x0 = rect.left() + a as f32 * scale;
            let x1 = (rect.left() + b as f32 * scale).max(x0 + 1.0);
            p.rect_filled(
                Rect::from_min_max(Pos2::new(x0, rect.top()), Pos2::new(x1, rect.bottom())),
                0.0,
                *color,
            );
        }
    }
    p.rect_stroke(
        rect,
        0.0,
        Stroke::new(0.5, ui.visuals().weak_text_color()),
        StrokeKind::Inside,
    );
}

fn ranges_text(r: &[ElementRange]) -> String {
    r.iter()
        .map(|(a, b)| format!("{a}..{b}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Draws the comparison: summary, legend, configuration differences, notes, then per parameter
/// and rank a stored strip over a computed strip (differences listed beside).
pub fn ui(ui: &mut Ui, overlay: &Overlay, origins_line: &str) {
    ui.strong("Computed vs stored");
    ui.label(overlay.summary());
    ui.weak(origins_line);
    if !overlay.applicable {
        return;
    }
    legend(ui);
    for d in &overlay.config_differences {
        ui.colored_label(MISSING, d);
    }
    for n in &overlay.notes {
        ui.weak(n);
    }
    egui::ScrollArea::vertical()
        .id_salt("overlay_scroll")
        .max_height(ui.available_height() * 0.5)
        .show(ui, |ui| {
            egui::Grid::new("overlay_grid")
                .num_columns(3)
                .striped(true)
                .show(ui, |ui| {
                    for p in &overlay.params {
                        for r in &p.ranks {
                            ui.label(format!("{} · rank {}", p.fqn, r.rank));
                            ui.vertical(|ui| {
                                ui.set_width(240.0);
                                // Stored: matched + extra; computed: matched + missing.
                                strip(ui, p.numel, &[(&r.matched, MATCHED), (&r.extra, EXTRA)]);
                                strip(ui, p.numel, &[(&r.matched, MATCHED), (&r.missing, MISSING)]);
                            });
                            if r.matches() {
                                ui.label("match");
                            } else {
                                let mut parts = Vec::new();
                                if !r.extra.is_empty() {
                                    parts.push(format!("extra {}", ranges_text(&r.extra)));
                                }
                                if !r.missing.is_empty() {
                                    parts.push(format!("missing {}", ranges_text(&r.missing)));
                                }
                                ui.colored_label(EXTRA, parts.join("; "));
                            }
                            ui.end_row();
                        }
                    }
                });
        });
    ui.separator();
}
