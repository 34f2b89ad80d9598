//! Per-tensor chunk map: which rank holds which part of one parameter, drawn over the tensor viewed
//! as 2-D `[dim0, rest]` (a single strip for 1-D tensors). FSDP2 chunks are row bands (`Shard(0)`);
//! FSDP1 chunks are runs of the flattened parameter and may cut rows.

use egui::{Align2, Color32, FontId, Pos2, Rect, Sense, Stroke, Ui, Vec2, ecolor::Hsva};
use std::fmt::Write as _;

use crate::format::{count, ranks as fmt_ranks, shape as fmt_shape};
use crate::theme::{Hatch, Theme, hatch};
use crate::view::ParamRow;

/// Colour of rank `rank` (a palette distinct from the parameter palette).
pub fn rank_color(theme: Theme, rank: u64) -> Color32 {
    let hue = (rank as f32 * 0.381_966 + 0.08).fract();
    let v = if theme.is_dark() { 0.78 } else { 0.86 };
    Hsva::new(hue, 0.45, v, 1.0).into()
}

/// The rects of elements `[start, end)` of a row-major `[rows, cols]` grid of cell size `cell`.
pub fn range_rects(start: u64, end: u64, cols: u64, origin: Pos2, cell: Vec2) -> Vec<Rect> {
    let mut out = Vec::new();
    if end <= start || cols == 0 {
        return out;
    }
    let rect = |r0: u64, c0: u64, r1: u64, c1: u64| {
        Rect::from_min_max(
            Pos2::new(origin.x + c0 as f32 * cell.x, origin.y + r0 as f32 * cell.y),
            Pos2::new(origin.x + c1 as f32 * cell.x, origin.y + r1 as f32 * cell.y),
        )
    };
    let (r0, c0) = (start / cols, start % cols);
    let last = end - 1;
    let (r1, c1) = (last / cols, last % cols);
    if r0 == r1 {
        out.push(rect(r0, c0, r0 + 1, c1 + 1));
        return out;
    }
    // Partial first row, full middle rows, partial last row (full edge rows join the middle).
    let middle_start = if c0 == 0 { r0 } else { r0 + 1 };
    let middle_end = if c1 == cols - 1 { r1 + 1 } else { r1 };
    if c0 != 0 {
        out.push(rect(r0, c0, r0 + 1, cols));
    }
    if middle_end > middle_start {
        out.push(rect(middle_start, 0, middle_end, cols));
    }
    if c1 != cols - 1 {
        out.push(rect(r1, 0, r1 + 1, c1 + 1));
    }
    out
}

/// Draws the chunk map of `param` and its per-rank table.
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the chunk map and its per-rank table laid out in drawing order"
)]
pub fn ui(ui: &mut Ui, param: &ParamRow, theme: Theme) {
    let rows = param.shape.first().copied().unwrap_or(1).max(1);
    let cols = param.row_len().max(1);
    let (grid_rows, grid_cols) = if param.shape.len() <= 1 {
        (1, param.numel.max(1))
    } else {
        (rows, cols)
    };
    ui.label(format!(
        "{} {} as a {}x{} grid, {} ranks hold a piece",
        param.fqn,
        fmt_shape(&param.shape),
        grid_rows,
        grid_cols,
        param.chunks.iter().filter(|c| c.end > c.start).count()
    ));
    let width = ui.available_width().clamp(120.0, 520.0);
    let height = if grid_rows == 1 {
        28.0
    } else {
        (width * grid_rows as f32 / grid_cols as f32).clamp(60.0, 320.0)
    };
    let (rect, response) = ui.allocate_exact_size(Vec2::new(width, height), Sense::hover());
    let painter = ui.painter_at(rect);
    painter.rect_filled(rect, 0.0, theme.bar_bg());
    let cell = Vec2::new(width / grid_cols as f32, height / grid_rows as f32);
    let font = FontId::monospace(11.0);
    let mut hovered = None;
    for chunk in &param.chunks {
        let rects = range_rects(chunk.start, chunk.end, grid_cols, rect.min, cell);
        let color = rank_color(theme, chunk.rank);
        for r in &rects {
            painter.rect_filled(*r, 0.0, color);
            painter.rect_stroke(
                *r,
                0.0,
                Stroke::new(1.0, Color32::from_black_alpha(120)),
                egui::StrokeKind::Inside,
            );
            if response.hover_pos().is_some_and(|p| r.contains(p)) {
                hovered = Some(*chunk);
            }
        }
        if let Some(big) = rects.iter().max_by(|a, b| a.area().total_cmp(&b.area()))
            && big.width() > 22.0
            && big.height() > 11.0
        {
            painter.text(
                big.center(),
                Align2::CENTER_CENTER,
                format!("r{}", chunk.rank),
                font.clone(),
                Color32::BLACK,
            );
        }
    }
    if let Some(c) = hovered {
        response.on_hover_ui_at_pointer(|ui| {
            let mut text = format!(
                "rank {}\nelements [{}, {}) of {}",
                c.rank, c.start, c.end, param.fqn
            );
            if param.shape.len() >= 2 {
                let _ = write!(
                    text,
                    "\nrows {}..{} of {}",
                    c.start / cols,
                    c.end.div_ceil(cols),
                    rows
                );
            }
            if c.padding_numel > 0 {
                let _ = write!(
                    text,
                    "\n+{} padding elements in the local tensor",
                    c.padding_numel
                );
            }
            ui.label(text);
        });
    }

    // Per-rank local tensors with their padding, for FSDP2.
    if let Some(padded_rows) = param.padded_rows {
        ui.add_space(4.0);
        ui.label(format!(
            "Each rank's local tensor is padded to {padded_rows} rows (torch.chunk puts the remainder on the last ranks):"
        ));
        let strip_h = 12.0;
        let shown: Vec<_> = param.chunks.iter().take(64).collect();
        let (rect, _) = ui.allocate_exact_size(
            Vec2::new(width, strip_h * shown.len() as f32),
            Sense::hover(),
        );
        let p = ui.painter_at(rect);
        for (i, c) in shown.iter().enumerate() {
            let y = rect.top() + i as f32 * strip_h;
            let total = (c.end - c.start + c.padding_numel).max(1) as f32;
            let real_w = (rect.width() - 40.0) * (c.end - c.start) as f32 / total;
            let row = Rect::from_min_size(
                Pos2::new(rect.left() + 40.0, y),
                Vec2::new(rect.width() - 40.0, strip_h - 2.0),
            );
            p.text(
                Pos2::new(rect.left(), y),
                Align2::LEFT_TOP,
                format!("r{}", c.rank),
                FontId::monospace(10.0),
                ui.visuals().text_color(),
            );
            p.rect_filled(
                Rect::from_min_size(row.min, Vec2::new(real_w, row.height())),
                0.0,
                rank_color(theme, c.rank),
            );
            if c.padding_numel > 0 {
                hatch(
                    &p,
                    Rect::from_min_max(Pos2::new(row.left() + real_w, row.top()), row.max),
                    theme.tail_pad_fill(),
                    theme.tail_pad_line(),
                    Hatch::Backward,
                    5.0,
                );
            }
        }
        if param.chunks.len() > shown.len() {
            ui.weak(format!(
                "(first {} of {} ranks)",
                shown.len(),
                param.chunks.len()
            ));
        }
    }

    ui.add_space(4.0);
    ui.label(format!("held by ranks {}", fmt_ranks(&param.ranks)));
    egui::Grid::new(("chunks", &param.fqn))
        .striped(true)
        .show(ui, |ui| {
            ui.strong("rank");
            ui.strong("elements");
            ui.strong("numel");
            ui.strong("padding");
            ui.end_row();
            for c in param.chunks.iter().take(256) {
                ui.label(c.rank.to_string());
                ui.label(format!("[{}, {})", c.start, c.end));
                ui.label(count(c.end - c.start));
                ui.label(count(c.padding_numel));
                ui.end_row();
            }
        });
    if param.chunks.len() > 256 {
        ui.weak(format!("(first 256 of {} chunks)", param.chunks.len()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_become_at_most_three_rects() {
        let cell = Vec2::new(1.0, 1.0);
        // Whole rows 0-1 of a 3x2 grid: one rect.
        let r = range_rects(0, 4, 2, Pos2::ZERO, cell);
        assert_eq!(r, vec![Rect::from_min_max(Pos2::ZERO, Pos2::new(2.0, 2.0))]);
        // Elements [3, 8) of a 3-column grid: tail of row 1, all of row 2 (..9 would be full).
        let r = range_rects(3, 8, 3, Pos2::ZERO, cell);
        assert_eq!(
            r,
            vec![
                Rect::from_min_max(Pos2::new(0.0, 1.0), Pos2::new(3.0, 2.0)),
                Rect::from_min_max(Pos2::new(0.0, 2.0), Pos2::new(2.0, 3.0)),
            ]
        );
        // [1, 8) of 3 columns: partial first row, full row 1, partial row 2.
        assert_eq!(range_rects(1, 8, 3, Pos2::ZERO, cell).len(), 3);
        // Inside one row.
        assert_eq!(
            range_rects(4, 5, 3, Pos2::ZERO, cell),
            vec![Rect::from_min_max(Pos2::new(1.0, 1.0), Pos2::new(2.0, 2.0))]
        );
        assert!(range_rects(5, 5, 3, Pos2::ZERO, cell).is_empty());
    }
}
