//! Trace timeline: one lane per rank, spans coloured by phase, bytes and bandwidth on hover, and a
//! plot of the total bandwidth over time.

use egui::{Align2, FontId, Pos2, Rect, Sense, Stroke, Ui, Vec2};
use egui_plot::{Line, Plot, PlotPoints};
use std::fmt::Write as _;

use crate::Selection;
use crate::format::{bandwidth, bytes as fmt_bytes};
use crate::theme::Theme;
use crate::trace::{Span, Trace};

const LANE_GUTTER: f32 = 90.0;

/// Visible time window.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineState {
    pub zoom: f64,
    /// Left edge as a fraction of the trace duration.
    pub pan: f64,
    pub lane_height: f32,
    pub scroll_y: f32,
}

impl Default for TimelineState {
    fn default() -> Self {
        Self {
            zoom: 1.0,
            pan: 0.0,
            lane_height: 22.0,
            scroll_y: 0.0,
        }
    }
}

/// The hover text of a span.
pub fn describe(trace: &Trace, span: &Span) -> String {
    let mut s = format!(
        "{}\n{} · {}\nstart {:.1} µs, duration {:.1} µs",
        span.name,
        trace.lanes[span.lane].label,
        span.phase(),
        span.start_us - trace.start_us,
        span.duration_us
    );
    if let Some(b) = span.bytes {
        let _ = write!(s, "\n{} ({b} bytes)", fmt_bytes(b));
    }
    if let Some(bw) = span.bandwidth_bytes_per_sec() {
        let _ = write!(s, "\nbandwidth {}", bandwidth(bw));
    }
    for (k, v) in &span.args {
        let _ = write!(s, "\n{k} = {v}");
    }
    s
}

/// Draws the timeline and the bandwidth plot.
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the timeline, its axis and the bandwidth plot laid out in drawing order"
)]
pub fn ui(
    ui: &mut Ui,
    trace: &Trace,
    st: &mut TimelineState,
    selection: &mut Selection,
    theme: Theme,
) {
    let total_bytes: u64 = trace.spans.iter().filter_map(|s| s.bytes).sum();
    let duration = (trace.end_us - trace.start_us).max(1e-9);
    ui.horizontal(|ui| {
        ui.label(format!(
            "{} · {} lanes · {} spans · {:.1} ms · {} moved",
            trace.name,
            trace.lanes.len(),
            trace.spans.len(),
            duration / 1000.0,
            fmt_bytes(total_bytes)
        ));
        if ui.button("Fit").clicked() {
            st.zoom = 1.0;
            st.pan = 0.0;
        }
    });
    ui.horizontal_wrapped(|ui| {
        for (i, cat) in trace.categories.iter().enumerate() {
            let (r, _) = ui.allocate_exact_size(Vec2::new(14.0, 12.0), Sense::hover());
            ui.painter()
                .rect_filled(r, 2.0, theme.param_color(i * 3 + 1));
            ui.label(cat);
        }
    });
    let plot_h = 150.0;
    let lanes_h = (ui.available_height() - plot_h - 12.0).max(80.0);
    let (rect, response) = ui.allocate_exact_size(
        Vec2::new(ui.available_width(), lanes_h),
        Sense::click_and_drag(),
    );
    let area = Rect::from_min_max(
        Pos2::new(rect.left() + LANE_GUTTER, rect.top() + 14.0),
        rect.max,
    );
    let content_h = trace.lanes.len() as f32 * st.lane_height;

    if response.dragged() {
        let d = response.drag_delta();
        st.pan -= f64::from(d.x) / (st.zoom * f64::from(area.width()));
        st.scroll_y -= d.y;
    }
    if response.hovered() {
        let (scroll, zoom_delta, pointer) =
            ui.input(|i| (i.smooth_scroll_delta, i.zoom_delta(), i.pointer.hover_pos()));
        if (zoom_delta - 1.0).abs() > f32::EPSILON {
            let anchor = pointer
                .map_or(0.5, |p| f64::from((p.x - area.left()) / area.width()))
                .clamp(0.0, 1.0);
            let frac = st.pan + anchor / st.zoom;
            st.zoom = (st.zoom * f64::from(zoom_delta)).clamp(1.0, 1e7);
            st.pan = frac - anchor / st.zoom;
        } else {
            st.scroll_y -= scroll.y;
        }
    }
    st.pan = st.pan.clamp(0.0, (1.0 - 1.0 / st.zoom).max(0.0));
    st.scroll_y = st.scroll_y.clamp(0.0, (content_h - area.height()).max(0.0));

    let painter = ui.painter_at(rect);
    let x_of = |t: f64| -> f32 {
        area.left()
            + (((t - trace.start_us) / duration - st.pan) * st.zoom * f64::from(area.width()))
                as f32
    };
    // Time axis ticks.
    let weak = ui.visuals().weak_text_color();
    for i in 0..=4 {
        let frac = st.pan + f64::from(i) / 4.0 / st.zoom;
        let x = area.left() + area.width() * i as f32 / 4.0;
        painter.text(
            Pos2::new(x.min(area.right() - 30.0), rect.top()),
            Align2::LEFT_TOP,
            format!("{:.1} ms", frac * duration / 1000.0),
            FontId::monospace(10.0),
            weak,
        );
        painter.line_segment(
            [Pos2::new(x, area.top()), Pos2::new(x, area.bottom())],
            Stroke::new(1.0, weak.gamma_multiply(0.3)),
        );
    }
    let t_lo = trace.start_us + st.pan * duration;
    let t_hi = t_lo + duration / st.zoom;
    let mut hovered: Option<&Span> = None;
    let pointer = response.hover_pos();
    let first_lane = (st.scroll_y / st.lane_height) as usize;
    let lanes_visible = (area.height() / st.lane_height).ceil() as usize + 1;
    for lane in first_lane..(first_lane + lanes_visible).min(trace.lanes.len()) {
        let y = area.top() + lane as f32 * st.lane_height - st.scroll_y;
        painter.text(
            Pos2::new(rect.left() + 4.0, y + st.lane_height / 2.0),
            Align2::LEFT_CENTER,
            &trace.lanes[lane].label,
            FontId::monospace(11.0),
            ui.visuals().text_color(),
        );
        let lane_spans = {
            let lo = trace.spans.partition_point(|s| s.lane < lane);
            let hi = trace.spans.partition_point(|s| s.lane <= lane);
            &trace.spans[lo..hi]
        };
        for span in lane_spans {
            if span.end_us() < t_lo || span.start_us > t_hi {
                continue;
            }
            let x0 = x_of(span.start_us).max(area.left());
            let x1 = x_of(span.end_us()).min(area.right()).max(x0 + 1.0);
            let r = Rect::from_min_max(
                Pos2::new(x0, y + 2.0),
                Pos2::new(x1, y + st.lane_height - 2.0),
            );
            let mut color = theme.param_color(trace.category_index(span) * 3 + 1);
            let linked = span_fqn(span);
            if selection.fqn.is_some() && linked.is_some() && linked != selection.fqn.as_deref() {
                color = theme.dim(color);
            }
            painter.rect_filled(r, 2.0, color);
            if r.width() > 40.0 {
                painter.text(
                    r.left_center() + Vec2::new(3.0, 0.0),
                    Align2::LEFT_CENTER,
                    &span.name,
                    FontId::proportional(10.5),
                    egui::Color32::BLACK,
                );
            }
            if pointer.is_some_and(|p| r.contains(p)) {
                hovered = Some(span);
            }
        }
    }
    if let Some(span) = hovered {
        let text = describe(trace, span);
        let clicked = response.clicked();
        response.on_hover_ui_at_pointer(|ui| {
            ui.label(text);
        });
        if clicked && let Some(fqn) = span_fqn(span) {
            selection.select(fqn.to_owned());
        }
    }

    ui.add_space(6.0);
    let series: Vec<[f64; 2]> = trace
        .bandwidth_series(200)
        .into_iter()
        .map(|(t_us, bps)| [t_us / 1000.0, bps / 1e9])
        .collect();
    Plot::new("bandwidth_plot")
        .height(plot_h)
        .x_axis_label("time (ms)")
        .y_axis_label("GB/s (all ranks)")
        .allow_scroll(false)
        .show(ui, |plot| {
            plot.line(Line::new("bandwidth", PlotPoints::from(series)));
        });
}

/// The parameter a span is about, when its args name one (`fqn` or `param`).
pub fn span_fqn(span: &Span) -> Option<&str> {
    span.args
        .iter()
        .find(|(k, _)| k == "fqn" || k == "param")
        .map(|(_, v)| v.as_str())
}
