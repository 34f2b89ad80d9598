//! The values heatmap: per-tensor statistics over the layers of a module list (rows: layer
//! number, columns: parameter name within the block). Each column is coloured on its own scale
//! (log of max |x|, or the mean), so the layer out of line with its siblings stands out; cells
//! holding NaN or infinity are red and say so.

use egui::{Color32, Rect, RichText, Sense, Ui, Vec2};

use crate::Selection;
use crate::values::{Cell, LayerGrid, ValueMap};

/// What the cells show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Metric {
    /// `max(|min|, |max|)` over finite values, log scale.
    #[default]
    MaxAbs,
    /// Mean over finite values.
    Mean,
}

/// State of the values panel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ValuesState {
    pub metric: Metric,
    /// Which grid (module list) is shown.
    pub grid: usize,
}

fn metric_value(cell: &Cell, metric: Metric) -> Option<f64> {
    match metric {
        Metric::MaxAbs => cell.max_abs().map(|v| (v.max(1e-30)).log10()),
        Metric::Mean => cell.stats.as_ref().ok()?.mean,
    }
}

/// Statistics as one line (hover text).
pub fn stats_text(cell: &Cell) -> String {
    match &cell.stats {
        Ok(s) => {
            let f = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.4e}"));
            format!(
                "{}\ncount {} · min {} · max {} · mean {} · NaN {} · inf {}",
                cell.fqn,
                s.count,
                f(s.min),
                f(s.max),
                f(s.mean),
                s.nan,
                s.inf
            )
        }
        Err(e) => format!("{}\n{e}", cell.fqn),
    }
}

/// A colour from blue (low) to yellow (high) for `t` in `[0, 1]`.
fn ramp(t: f64) -> Color32 {
    let t = t.clamp(0.0, 1.0);
    let lerp = |a: f64, b: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped to 0..=255"
        )]
        let v = (a + (b - a) * t).round().clamp(0.0, 255.0) as u8;
        v
    };
    Color32::from_rgb(lerp(40.0, 250.0), lerp(60.0, 220.0), lerp(140.0, 40.0))
}

/// Draws the statistics.
pub fn ui(ui: &mut Ui, map: &ValueMap, st: &mut ValuesState, selection: &mut Selection) {
    let bad: Vec<&Cell> = map
        .tensors
        .values()
        .filter(|c| c.non_finite() > 0)
        .collect();
    ui.label(
        RichText::new(format!(
            "{}: {} tensors read, {} with NaN or infinity",
            map.label,
            map.tensors.len(),
            bad.len()
        ))
        .strong(),
    );
    if !bad.is_empty() {
        ui.horizontal_wrapped(|ui| {
            ui.colored_label(ui.visuals().error_fg_color, "NaN/inf in:");
            for c in &bad {
                if ui
                    .selectable_label(selection.fqn.as_deref() == Some(c.fqn.as_str()), &c.fqn)
                    .on_hover_text(stats_text(c))
                    .clicked()
                {
                    selection.select(c.fqn.clone());
                }
            }
        });
    }
    if map.grids.is_empty() {
        ui.label("No module list (`<list>.<n>.…`) with more than one block: nothing to lay out by layer.");
        return;
    }
    ui.horizontal(|ui| {
        ui.label("module list");
        st.grid = st.grid.min(map.grids.len() - 1);
        for (i, g) in map.grids.iter().enumerate() {
            ui.selectable_value(&mut st.grid, i, &g.list);
        }
        ui.separator();
        ui.selectable_value(&mut st.metric, Metric::MaxAbs, "max |x| (log)");
        ui.selectable_value(&mut st.metric, Metric::Mean, "mean");
    });
    ui.weak("each column on its own scale: blue low, yellow high; red: NaN or infinity");
    grid_ui(ui, &map.grids[st.grid], st.metric, selection);
}

fn grid_ui(ui: &mut Ui, g: &LayerGrid, metric: Metric, selection: &mut Selection) {
    let ranges: Vec<Option<(f64, f64)>> = (0..g.columns.len())
        .map(|c| {
            g.cells
                .iter()
                .filter_map(|row| row[c].as_ref().and_then(|cell| metric_value(cell, metric)))
                .filter(|v| v.is_finite())
                .fold(None, |acc: Option<(f64, f64)>, v| {
                    Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
                })
        })
        .collect();
    egui::ScrollArea::both()
        .id_salt("values_grid")
        .show(ui, |ui| {
            let label_w = 70.0;
            #[allow(clippy::cast_precision_loss, reason = "a column count")]
            let cell_w = ((ui.available_width() - label_w) / g.columns.len().max(1) as f32)
                .clamp(48.0, 160.0);
            let cell_h = 18.0;
            // Column headers.
            ui.horizontal(|ui| {
                ui.add_sized(
                    [label_w, cell_h],
                    egui::Label::new(RichText::new("layer").strong()),
                );
                for c in &g.columns {
                    ui.add_sized(
                        [cell_w, cell_h],
                        egui::Label::new(RichText::new(c).small()).truncate(),
                    )
                    .on_hover_text(c);
                }
            });
            for (r, layer) in g.layers.iter().enumerate() {
                ui.horizontal(|ui| {
                    ui.add_sized([label_w, cell_h], egui::Label::new(layer.to_string()));
                    for (c, cell) in g.cells[r].iter().enumerate() {
                        let (rect, resp) =
                            ui.allocate_exact_size(Vec2::new(cell_w, cell_h), Sense::click());
                        let Some(cell) = cell else {
                            continue;
                        };
                        let (fill, text) = if cell.non_finite() > 0 {
                            let s = cell.stats.as_ref().ok();
                            let what = match s {
                                Some(s) if s.nan > 0 => "NaN",
                                _ => "inf",
                            };
                            (Color32::from_rgb(220, 30, 30), what.to_owned())
                        } else {
                            match (metric_value(cell, metric), ranges[c]) {
                                (Some(v), Some((lo, hi))) => {
                                    let t = if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };
                                    (ramp(t), String::new())
                                }
                                _ => (ui.visuals().faint_bg_color, "-".to_owned()),
                            }
                        };
                        let rect = Rect::from_min_size(rect.min, rect.size() - Vec2::splat(1.0));
                        ui.painter().rect_filled(rect, 1.0, fill);
                        if selection.fqn.as_deref() == Some(cell.fqn.as_str()) {
                            ui.painter().rect_stroke(
                                rect,
                                1.0,
                                egui::Stroke::new(2.0, ui.visuals().strong_text_color()),
                                egui::StrokeKind::Inside,
                            );
                        }
                        if !text.is_empty() {
                            ui.painter().text(
                                rect.center(),
                                egui::Align2::CENTER_CENTER,
                                &text,
                                egui::FontId::proportional(11.0),
                                Color32::WHITE,
                            );
                        }
                        let resp = resp.on_hover_text(stats_text(cell));
                        resp.widget_info(|| {
                            egui::WidgetInfo::labeled(egui::Role::Button, true, &cell.fqn)
                        });
                        if resp.clicked() {
                            selection.select(cell.fqn.clone());
                        }
                    }
                });
            }
        });
}
