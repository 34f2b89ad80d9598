//! The shard map: per FSDP unit, one bar per rank; every parameter slice in its own colour,
//! alignment padding hatched `/`, shard-tail padding hatched `\`. Hover for details, click to
//! select, drag to pan, Ctrl+wheel (or pinch, or the buttons) to zoom.
//!
//! Drawing is culled to the visible rows and, inside a row, to the visible byte range (binary
//! search); runs of slices thinner than a pixel merge into one grey rect. A frame therefore costs
//! O(visible rows x (visible wide slices + pixels)), whatever the number of chunks.

use egui::{Align2, Color32, FontId, Pos2, Rect, Sense, Stroke, Ui, Vec2};
use std::fmt::Write as _;

use crate::Selection;
use crate::format::{bytes as fmt_bytes, count};
use crate::map_marks::{MapMarks, Mark, MarkKind};
use crate::panels::overlay::{EXTRA, MISSING};
use crate::theme::{Hatch, Theme, hatch};
use crate::view::{LayoutView, Seg, SegKind, UnitView};

const RANK_GUTTER: f32 = 64.0;
const TOTALS_GUTTER: f32 = 170.0;
const HEADER_H: f32 = 34.0;
/// Draws the computed-vs-stored marks of one bar: a band over the elements (orange, lower half:
/// extra; red, upper half: missing) in an outline of its colour, at least 2 points wide so that
/// one element still shows.
fn draw_marks(
    painter: &egui::Painter,
    marks: &[Mark],
    bar_bytes: u64,
    y: f32,
    h: f32,
    area: Rect,
    st: &ShardMapState,
) {
    let bb = bar_bytes as f64;
    for m in marks {
        let x0 = x_of(m.x_bytes as f64, bb, area, st).max(area.left());
        let x1 = x_of((m.x_bytes + m.len_bytes) as f64, bb, area, st)
            .min(area.right())
            .max(x0 + 2.0);
        if x0 > area.right() || x1 < area.left() {
            continue;
        }
        // Extra in the lower half, missing in the upper: both show where both are.
        let (color, r) = match m.kind {
            MarkKind::Extra { .. } => (
                EXTRA,
                Rect::from_min_max(Pos2::new(x0, y + h * 0.55), Pos2::new(x1, y + h)),
            ),
            MarkKind::Missing { .. } => (
                MISSING,
                Rect::from_min_max(Pos2::new(x0, y), Pos2::new(x1, y + h * 0.45)),
            ),
        };
        painter.rect_filled(r, 0.0, color);
        painter.rect_stroke(
            Rect::from_min_max(Pos2::new(x0, y), Pos2::new(x1, y + h)),
            0.0,
            Stroke::new(1.5, color),
            egui::StrokeKind::Inside,
        );
    }
}

/// Slices narrower than this merge into a dense run.
const MIN_SLICE_PX: f32 = 1.5;

/// Zoom, pan and row height of the shard map.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardMapState {
    /// 1 = each bar fits the width.
    pub zoom: f64,
    /// Left edge of the view as a fraction of a bar.
    pub pan: f64,
    /// Vertical scroll in points.
    pub scroll_y: f32,
    pub row_height: f32,
    /// Scroll to the selected parameter on the next frame.
    pub reveal_selection: bool,
    /// Where the map was last drawn (tests and benchmarks aim pointer events with it).
    pub last_canvas: Option<Rect>,
    /// Draw the computed-vs-stored differences of an opened checkpoint on the bars.
    pub show_differences: bool,
}

impl Default for ShardMapState {
    fn default() -> Self {
        Self {
            zoom: 1.0,
            pan: 0.0,
            scroll_y: 0.0,
            row_height: 16.0,
            reveal_selection: false,
            last_canvas: None,
            show_differences: true,
        }
    }
}

impl ShardMapState {
    fn clamp(&mut self, content_h: f32, view_h: f32) {
        self.zoom = self.zoom.clamp(1.0, 1e9);
        self.pan = self.pan.clamp(0.0, (1.0 - 1.0 / self.zoom).max(0.0));
        self.scroll_y = self.scroll_y.clamp(0.0, (content_h - view_h).max(0.0));
    }

    /// Zooms by `factor` keeping the bar fraction under `anchor` (0..1 of the bar area) fixed.
    pub fn zoom_at(&mut self, factor: f64, anchor: f64) {
        let frac = self.pan + anchor / self.zoom;
        self.zoom = (self.zoom * factor).clamp(1.0, 1e9);
        self.pan = frac - anchor / self.zoom;
        self.pan = self.pan.clamp(0.0, (1.0 - 1.0 / self.zoom).max(0.0));
    }
}

/// What the pointer is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    pub unit: usize,
    pub rank_index: usize,
    pub seg: Option<usize>,
}

/// Vertical geometry of the stacked units (content coordinates, 0 = top).
#[derive(Debug, Clone)]
pub struct Geometry {
    /// Top of each unit's header.
    pub unit_tops: Vec<f32>,
    pub row_h: f32,
    pub content_h: f32,
}

impl Geometry {
    pub fn new(view: &LayoutView, row_h: f32) -> Self {
        let mut y = 0.0;
        let mut unit_tops = Vec::with_capacity(view.units.len());
        for u in &view.units {
            unit_tops.push(y);
            y += HEADER_H + u.ranks.len() as f32 * row_h + 8.0;
        }
        Self {
            unit_tops,
            row_h,
            content_h: y,
        }
    }

    /// Content y of rank row `rank_index` of unit `unit`.
    pub fn row_top(&self, unit: usize, rank_index: usize) -> f32 {
        self.unit_tops[unit] + HEADER_H + rank_index as f32 * self.row_h
    }

    /// The (unit, rank row) at content y, if any.
    pub fn row_at(&self, view: &LayoutView, y: f32) -> Option<(usize, usize)> {
        let unit = self.unit_tops.partition_point(|&t| t <= y).checked_sub(1)?;
        let rel = y - self.unit_tops[unit] - HEADER_H;
        if rel < 0.0 {
            return None;
        }
        let idx = (rel / self.row_h) as usize;
        (idx < view.units[unit].ranks.len()).then_some((unit, idx))
    }
}

/// The bar area of a canvas rect.
pub fn bar_area(canvas: Rect) -> Rect {
    Rect::from_min_max(
        Pos2::new(canvas.left() + RANK_GUTTER, canvas.top()),
        Pos2::new(
            (canvas.right() - TOTALS_GUTTER).max(canvas.left() + RANK_GUTTER + 40.0),
            canvas.bottom(),
        ),
    )
}

/// Screen x of a byte position in a bar of `bar_bytes`.
fn x_of(bytes: f64, bar_bytes: f64, area: Rect, st: &ShardMapState) -> f32 {
    let frac = if bar_bytes > 0.0 {
        bytes / bar_bytes
    } else {
        0.0
    };
    area.left() + ((frac - st.pan) * st.zoom * f64::from(area.width())) as f32
}

/// Screen x range of a parameter's first slice, for tests and "reveal": `(unit, rank_index, rect)`.
pub fn slice_rect(
    view: &LayoutView,
    st: &ShardMapState,
    canvas: Rect,
    param: usize,
) -> Option<(usize, usize, Rect)> {
    let geo = Geometry::new(view, st.row_height);
    let area = bar_area(canvas);
    for (ui_idx, unit) in view.units.iter().enumerate() {
        for (ri, bar) in unit.ranks.iter().enumerate() {
            for seg in &bar.segs {
                if matches!(seg.kind, SegKind::Param { param: p, .. } if p == param) {
                    let top = canvas.top() + geo.row_top(ui_idx, ri) - st.scroll_y;
                    let bb = unit.bar_bytes as f64;
                    let x0 = x_of(seg.x_bytes as f64, bb, area, st);
                    let x1 = x_of((seg.x_bytes + seg.len_bytes) as f64, bb, area, st);
                    let rect = Rect::from_min_max(
                        Pos2::new(x0, top),
                        Pos2::new(x1, top + st.row_height - 1.0),
                    );
                    return Some((ui_idx, ri, rect));
                }
            }
        }
    }
    None
}

fn seg_param(seg: &Seg) -> Option<usize> {
    match seg.kind {
        SegKind::Param { param, .. } | SegKind::TailPad { param: Some(param) } => Some(param),
        _ => None,
    }
}

/// Draws the toolbar, legend and the map.
pub fn ui(
    ui: &mut Ui,
    view: &LayoutView,
    marks: Option<&MapMarks>,
    st: &mut ShardMapState,
    selection: &mut Selection,
    theme: Theme,
) {
    toolbar(ui, view, st);
    legend(ui, theme, view.is_deepspeed());
    if let Some(m) = marks {
        differences_legend(ui, m, st);
    }
    ui.separator();
    let marks = marks.filter(|_| st.show_differences);
    canvas(ui, view, marks, st, selection, theme);
}

/// The computed-vs-stored line: a toggle, its summary and the colours of its marks.
fn differences_legend(ui: &mut Ui, m: &MapMarks, st: &mut ShardMapState) {
    ui.horizontal_wrapped(|ui| {
        ui.checkbox(&mut st.show_differences, m.summary())
            .on_hover_text("What each rank's stored chunks hold, laid over what this layout gives it (as the Ranks tab lists it)");
        for (color, text) in [
            (EXTRA, "stored by another rank than the layout's (extra)"),
            (MISSING, "in the layout, stored by no chunk of that rank (missing)"),
        ] {
            let (rect, _) = ui.allocate_exact_size(Vec2::new(28.0, 14.0), Sense::hover());
            ui.painter().rect_filled(rect, 0.0, color);
            ui.label(text);
        }
    });
}

fn toolbar(ui: &mut Ui, view: &LayoutView, st: &mut ShardMapState) {
    ui.horizontal(|ui| {
        ui.label(format!(
            "{} units, {} ranks per shard group{}, {} chunks",
            view.units.len(),
            view.shard_group_size,
            if view.replica_groups() > 1 {
                format!(" x {} replicas", view.replica_groups())
            } else {
                String::new()
            },
            count(view.chunk_count() as u64)
        ));
        ui.separator();
        if ui.button("-").on_hover_text("Zoom out").clicked() {
            st.zoom_at(0.5, 0.5);
        }
        ui.label(format!("zoom {:.1}x", st.zoom));
        if ui
            .button("+")
            .on_hover_text("Zoom in (or Ctrl + wheel)")
            .clicked()
        {
            st.zoom_at(2.0, 0.5);
        }
        if ui.button("Fit").clicked() {
            st.zoom = 1.0;
            st.pan = 0.0;
        }
        ui.separator();
        let label = ui.label("row height");
        ui.add(egui::Slider::new(&mut st.row_height, 3.0..=32.0).show_value(false))
            .labelled_by(label.id);
    });
}

/// The colour legend, in DeepSpeed's words for a ZeRO checkpoint's partitions (`deepspeed`).
pub fn legend(ui: &mut Ui, theme: Theme, deepspeed: bool) {
    let (align, tail) = if deepspeed {
        (
            "alignment padding (inside a flat group)",
            "padding after a parameter's last part",
        )
    } else {
        (
            "alignment padding (inside the flat parameter)",
            "shard-tail padding (zeros to equal shard size)",
        )
    };
    ui.horizontal_wrapped(|ui| {
        let swatch = |ui: &mut Ui, draw: &dyn Fn(&egui::Painter, Rect), text: &str| {
            let (rect, _) = ui.allocate_exact_size(Vec2::new(28.0, 14.0), Sense::hover());
            draw(ui.painter(), rect);
            ui.label(text);
            ui.add_space(8.0);
        };
        swatch(
            ui,
            &|p, r| {
                let third = r.width() / 3.0;
                for i in 0..3 {
                    let rr = Rect::from_min_size(
                        Pos2::new(r.left() + third * i as f32, r.top()),
                        Vec2::new(third, r.height()),
                    );
                    p.rect_filled(rr, 0.0, theme.param_color(i));
                }
            },
            "parameter slices (one colour each)",
        );
        swatch(
            ui,
            &|p, r| {
                hatch(
                    p,
                    r,
                    theme.align_pad_fill(),
                    theme.align_pad_line(),
                    Hatch::Forward,
                    5.0,
                );
            },
            align,
        );
        swatch(
            ui,
            &|p, r| {
                hatch(
                    p,
                    r,
                    theme.tail_pad_fill(),
                    theme.tail_pad_line(),
                    Hatch::Backward,
                    5.0,
                );
            },
            tail,
        );
        swatch(
            ui,
            &|p, r| {
                p.rect_filled(r, 0.0, theme.dense_fill());
            },
            "many slices thinner than a pixel (zoom in)",
        );
        swatch(
            ui,
            &|p, r| {
                p.rect_filled(r, 0.0, theme.param_color(4));
                p.rect_stroke(
                    r,
                    0.0,
                    Stroke::new(2.0, theme.selection()),
                    egui::StrokeKind::Inside,
                );
            },
            "selected parameter",
        );
    });
}

#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the canvas's reveal, interaction and one-mesh painting share its transform"
)]
fn canvas(
    ui: &mut Ui,
    view: &LayoutView,
    marks: Option<&MapMarks>,
    st: &mut ShardMapState,
    selection: &mut Selection,
    theme: Theme,
) {
    let size = ui.available_size().max(Vec2::new(200.0, 120.0));
    let (rect, response) = ui.allocate_exact_size(size, Sense::click_and_drag());
    st.last_canvas = Some(rect);
    let geo = Geometry::new(view, st.row_height);
    let area = bar_area(rect);

    // Reveal the selection: scroll to its first row and make its slice visible.
    if st.reveal_selection {
        st.reveal_selection = false;
        if let Some(param) = selection
            .fqn
            .as_deref()
            .and_then(|f| view.by_fqn.get(f))
            .copied()
        {
            let param = view.params[param]
                .shared_with
                .as_deref()
                .and_then(|p| view.by_fqn.get(p).copied())
                .unwrap_or(param);
            if let Some((u, ri, _)) = slice_rect(view, st, rect, param) {
                let row_top = geo.row_top(u, ri);
                let visible =
                    row_top >= st.scroll_y && row_top + geo.row_h <= st.scroll_y + rect.height();
                if !visible {
                    st.scroll_y = row_top - HEADER_H - 4.0;
                }
            }
        }
    }

    // Interaction: drag pans, wheel scrolls, Ctrl+wheel / pinch zooms around the pointer.
    if response.dragged() {
        let d = response.drag_delta();
        st.pan -= f64::from(d.x) / (st.zoom * f64::from(area.width()));
        st.scroll_y -= d.y;
    }
    if response.hovered() {
        let (scroll, zoom_delta, pointer) =
            ui.input(|i| (i.smooth_scroll_delta, i.zoom_delta(), i.pointer.hover_pos()));
        if (zoom_delta - 1.0).abs() > f32::EPSILON {
            let anchor = pointer.map_or(0.5, |p| f64::from((p.x - area.left()) / area.width()));
            st.zoom_at(f64::from(zoom_delta), anchor.clamp(0.0, 1.0));
        } else {
            st.scroll_y -= scroll.y;
            st.pan -= f64::from(scroll.x) / (st.zoom * f64::from(area.width()));
        }
    }
    st.clamp(geo.content_h, rect.height());

    let painter = ui.painter_at(rect);
    let selected = selection
        .fqn
        .as_deref()
        .and_then(|f| view.by_fqn.get(f))
        .map(|&i| {
            view.params[i]
                .shared_with
                .as_deref()
                .and_then(|p| view.by_fqn.get(p).copied())
                .unwrap_or(i)
        });
    let text_color = ui.visuals().text_color();
    let weak = ui.visuals().weak_text_color();
    let font = FontId::proportional(12.0);
    let small = FontId::monospace(10.5);

    let view_top = st.scroll_y;
    let view_bottom = st.scroll_y + rect.height();
    // Every fill goes into one mesh (4 vertices a rect, no per-shape tessellation), painted
    // below the hatching, text and outlines added after this slot.
    let mesh_slot = painter.add(egui::Shape::Noop);
    let mut mesh = egui::Mesh::default();
    let mut outlines: Vec<Rect> = Vec::new();
    for (ui_idx, unit) in view.units.iter().enumerate() {
        let top = geo.unit_tops[ui_idx];
        let bottom = top + HEADER_H + unit.ranks.len() as f32 * geo.row_h;
        if bottom < view_top || top > view_bottom {
            continue;
        }
        // Header.
        let hy = rect.top() + top - st.scroll_y;
        if hy + HEADER_H > rect.top() {
            let name = match &unit.flat_param {
                Some(flat) => format!("{}   {}", unit.display_name(), flat),
                None => unit.display_name().to_owned(),
            };
            painter.text(
                Pos2::new(rect.left() + 4.0, hy + 3.0),
                Align2::LEFT_TOP,
                name,
                font.clone(),
                text_color,
            );
            painter.text(
                Pos2::new(rect.left() + 4.0, hy + 18.0),
                Align2::LEFT_TOP,
                format!(
                    "{}   imbalance {:.1}%",
                    unit.summary,
                    unit.imbalance() * 100.0
                ),
                small.clone(),
                weak,
            );
        }
        // Visible rows of this unit.
        let rows_top = top + HEADER_H;
        let first = (((view_top - rows_top) / geo.row_h).floor().max(0.0)) as usize;
        let last = ((((view_bottom - rows_top) / geo.row_h).ceil()).max(0.0) as usize)
            .min(unit.ranks.len());
        for ri in first..last {
            let y = rect.top() + rows_top + ri as f32 * geo.row_h - st.scroll_y;
            let h = if geo.row_h >= 6.0 {
                geo.row_h - 1.0
            } else {
                geo.row_h
            };
            draw_row(
                &painter,
                &mut mesh,
                &mut outlines,
                view,
                unit,
                ri,
                y,
                h,
                area,
                st,
                theme,
                selected,
            );
            if let Some(m) = marks {
                draw_marks(&painter, m.row(ui_idx, ri), unit.bar_bytes, y, h, area, st);
            }
            let bar = &unit.ranks[ri];
            if geo.row_h >= 10.0 {
                painter.text(
                    Pos2::new(area.left() - 6.0, y + h / 2.0),
                    Align2::RIGHT_CENTER,
                    format!("rank {}", bar.rank),
                    small.clone(),
                    text_color,
                );
                let pad = bar.align_pad_bytes + bar.tail_pad_bytes;
                painter.text(
                    Pos2::new(area.right() + 6.0, y + h / 2.0),
                    Align2::LEFT_CENTER,
                    if pad > 0 {
                        format!("{} +{} pad", fmt_bytes(bar.real_bytes), fmt_bytes(pad))
                    } else {
                        fmt_bytes(bar.real_bytes)
                    },
                    small.clone(),
                    weak,
                );
            }
        }
    }

    painter.set(mesh_slot, egui::Shape::mesh(mesh));
    for r in outlines {
        painter.rect_stroke(
            r,
            0.0,
            Stroke::new(2.0, theme.selection()),
            egui::StrokeKind::Inside,
        );
    }

    // Hover and click.
    let pointer = response.hover_pos();
    if let Some(pos) = pointer
        && let Some(hit) = hit_test(view, st, rect, pos)
    {
        let unit = &view.units[hit.unit];
        let bar = &unit.ranks[hit.rank_index];
        if let Some(si) = hit.seg {
            let seg = bar.segs[si];
            let mut text = describe(view, unit, bar.rank, &seg);
            if let Some(m) = marks {
                let bb = unit.bar_bytes as f64;
                for mark in m.row(hit.unit, hit.rank_index) {
                    let x0 = x_of(mark.x_bytes as f64, bb, area, st);
                    let x1 = x_of((mark.x_bytes + mark.len_bytes) as f64, bb, area, st);
                    if pos.x >= x0 - 1.0 && pos.x <= x1.max(x0 + 2.0) + 1.0 {
                        text.push('\n');
                        text.push_str(&mark.describe());
                    }
                }
            }
            response.clone().on_hover_ui_at_pointer(|ui| {
                ui.label(text);
            });
            if response.clicked() {
                match seg_param(&seg) {
                    Some(p) => selection.select(view.params[p].fqn.clone()),
                    None => selection.fqn = None,
                }
            }
        } else if response.clicked() {
            selection.fqn = None;
        }
    }
}

/// What is under screen position `pos`.
pub fn hit_test(view: &LayoutView, st: &ShardMapState, canvas: Rect, pos: Pos2) -> Option<Hit> {
    let area = bar_area(canvas);
    if !area.contains(pos) {
        return None;
    }
    let geo = Geometry::new(view, st.row_height);
    let (unit, rank_index) = geo.row_at(view, pos.y - canvas.top() + st.scroll_y)?;
    let u = &view.units[unit];
    let frac = st.pan + f64::from(pos.x - area.left()) / (st.zoom * f64::from(area.width()));
    let at = frac * u.bar_bytes as f64;
    let segs = &u.ranks[rank_index].segs;
    let i = segs.partition_point(|s| ((s.x_bytes + s.len_bytes) as f64) <= at);
    let seg = (i < segs.len() && (segs[i].x_bytes as f64) <= at).then_some(i);
    Some(Hit {
        unit,
        rank_index,
        seg,
    })
}

/// The hover text of a slice.
pub fn describe(view: &LayoutView, unit: &UnitView, rank: u64, seg: &Seg) -> String {
    let group = if view.replica_groups() > 1 {
        format!(
            " (and its replicas in {} shard groups)",
            view.replica_groups()
        )
    } else {
        String::new()
    };
    match seg.kind {
        SegKind::Param { param, intra_start } => {
            let p = &view.params[param];
            let mut s = format!(
                "{}\nrank {rank}{group}\nshape {:?} {}  ({} elements)\nelements [{}, {}) of the flattened parameter\noffset in shard {}  ({} elements, {})",
                p.fqn,
                p.shape,
                p.dtype,
                count(p.numel),
                intra_start,
                intra_start + seg.numel,
                seg.offset_in_shard,
                count(seg.numel),
                fmt_bytes(seg.len_bytes)
            );
            if let (Some(flat), Some((a, b))) = (&p.flat_param, p.flat_range) {
                let _ = write!(s, "\n{flat} [{a}, {b})");
            }
            s
        }
        SegKind::AlignPad if view.is_deepspeed() => format!(
            "alignment padding in {}\nrank {rank}\noffset in partition {}  ({} elements, {})\nDeepSpeed pads every parameter but a group's last to 16 bytes of the training precision (`zero_optimization.parameter_alignment`, `param_alignment_paddings`); zeros, and the optimizer keeps its moments zero there",
            unit.flat_param.as_deref().unwrap_or(unit.display_name()),
            seg.offset_in_shard,
            count(seg.numel),
            fmt_bytes(seg.len_bytes)
        ),
        SegKind::TailPad { param } if view.is_deepspeed() => format!(
            "padding of {}\nrank {rank}\noffset in partition {}  ({} elements, {})\nZeRO-3 gives every rank ceil(numel / world size) elements of each parameter, the last part padded",
            param.map_or_else(
                || "the partition".to_owned(),
                |p| format!("the last part of {}", view.params[p].fqn)
            ),
            seg.offset_in_shard,
            count(seg.numel),
            fmt_bytes(seg.len_bytes)
        ),
        SegKind::AlignPad => format!(
            "alignment padding in {}\nrank {rank}{group}\noffset in shard {}  ({} elements, {})\nFSDP pads every parameter to a 16-byte boundary with use_orig_params=True, and the flat parameter to a multiple of the shard-group size",
            unit.flat_param.as_deref().unwrap_or(unit.display_name()),
            seg.offset_in_shard,
            count(seg.numel),
            fmt_bytes(seg.len_bytes)
        ),
        SegKind::TailPad { param } => {
            let whose = param.map_or_else(
                || "the shard".to_owned(),
                |p| format!("the local tensor of {}", view.params[p].fqn),
            );
            format!(
                "shard-tail padding of {whose}\nrank {rank}{group}\noffset {}  ({} elements, {})\nzeros so that every rank's shard has the same size (torch.chunk gives the last ranks less)",
                seg.offset_in_shard,
                count(seg.numel),
                fmt_bytes(seg.len_bytes)
            )
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: one row's slices, padding and separators painted in order"
)]
fn draw_row(
    painter: &egui::Painter,
    mesh: &mut egui::Mesh,
    outlines: &mut Vec<Rect>,
    view: &LayoutView,
    unit: &UnitView,
    ri: usize,
    y: f32,
    h: f32,
    area: Rect,
    st: &ShardMapState,
    theme: Theme,
    selected: Option<usize>,
) {
    let bb = unit.bar_bytes as f64;
    let x_end_bar = x_of(bb, bb, area, st).min(area.right());
    let x_start_bar = x_of(0.0, bb, area, st).max(area.left());
    if x_end_bar <= x_start_bar {
        return;
    }
    mesh.add_colored_rect(
        Rect::from_min_max(Pos2::new(x_start_bar, y), Pos2::new(x_end_bar, y + h)),
        theme.bar_bg(),
    );
    let segs = &unit.ranks[ri].segs;
    // Visible byte range.
    let lo = st.pan * bb;
    let hi = (st.pan + 1.0 / st.zoom) * bb;
    let start = segs.partition_point(|s| ((s.x_bytes + s.len_bytes) as f64) <= lo);
    let hatch_ok = h >= 6.0;
    let mut dense: Option<(f32, f32)> = None;
    let selected_rects = outlines;
    let flush = |dense: &mut Option<(f32, f32)>, mesh: &mut egui::Mesh| {
        if let Some((a, b)) = dense.take() {
            mesh.add_colored_rect(
                Rect::from_min_max(Pos2::new(a, y), Pos2::new(b.max(a + 1.0), y + h)),
                theme.dense_fill(),
            );
        }
    };
    for seg in &segs[start..] {
        if seg.x_bytes as f64 > hi {
            break;
        }
        let x0 = x_of(seg.x_bytes as f64, bb, area, st).max(area.left());
        let x1 = x_of((seg.x_bytes + seg.len_bytes) as f64, bb, area, st).min(area.right());
        if x1 - x0 < MIN_SLICE_PX {
            match &mut dense {
                Some((_, b)) if x0 - *b < 1.0 => *b = x1,
                _ => {
                    flush(&mut dense, mesh);
                    dense = Some((x0, x1));
                }
            }
            if selected.is_some() && seg_param(seg) == selected {
                selected_rects.push(Rect::from_min_max(
                    Pos2::new(x0, y),
                    Pos2::new(x0 + 2.0, y + h),
                ));
            }
            continue;
        }
        flush(&mut dense, mesh);
        let r = Rect::from_min_max(Pos2::new(x0, y), Pos2::new(x1, y + h));
        match seg.kind {
            SegKind::Param { param, .. } => {
                let slot = view.params[param].color_slot;
                let mut c = theme.param_color(slot);
                if selected.is_some() && selected != Some(param) {
                    c = theme.dim(c);
                }
                mesh.add_colored_rect(r, c);
                if x1 - x0 > 3.0 {
                    // A 1-pt separator at the slice's right edge.
                    mesh.add_colored_rect(
                        Rect::from_min_max(Pos2::new(x1 - 1.0, y), Pos2::new(x1, y + h)),
                        Color32::from_black_alpha(90),
                    );
                }
            }
            SegKind::AlignPad => {
                if hatch_ok {
                    hatch(
                        painter,
                        r,
                        theme.align_pad_fill(),
                        theme.align_pad_line(),
                        Hatch::Forward,
                        6.0,
                    );
                } else {
                    mesh.add_colored_rect(r, theme.align_pad_line());
                }
            }
            SegKind::TailPad { .. } => {
                if hatch_ok {
                    hatch(
                        painter,
                        r,
                        theme.tail_pad_fill(),
                        theme.tail_pad_line(),
                        Hatch::Backward,
                        6.0,
                    );
                } else {
                    mesh.add_colored_rect(r, theme.tail_pad_line());
                }
            }
        }
        if selected.is_some()
            && seg_param(seg) == selected
            && matches!(seg.kind, SegKind::Param { .. })
        {
            selected_rects.push(r);
        }
    }
    flush(&mut dense, mesh);
}
