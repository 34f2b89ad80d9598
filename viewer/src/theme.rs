//! Colours and the hatching used for padding, for the dark and the light theme.

use egui::{Color32, Painter, Pos2, Rect, Stroke, ecolor::Hsva};

/// The two themes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Theme {
    #[default]
    Dark,
    Light,
}

impl Theme {
    pub fn visuals(self) -> egui::Visuals {
        match self {
            Theme::Dark => egui::Visuals::dark(),
            Theme::Light => egui::Visuals::light(),
        }
    }

    pub const fn is_dark(self) -> bool {
        matches!(self, Theme::Dark)
    }

    /// Colour of parameter slot `slot`: hues spaced by the golden angle so neighbours differ.
    pub fn param_color(self, slot: usize) -> Color32 {
        let hue = (slot as f32 * 0.618_034).fract();
        let (s, v) = if self.is_dark() {
            (0.55, 0.85)
        } else {
            (0.60, 0.80)
        };
        // Vary saturation and value with the slot too, so hues that land close still separate.
        let s = s + [0.0, 0.2, -0.15][(slot / 2) % 3];
        let v = if slot.is_multiple_of(2) { v } else { v - 0.12 };
        Hsva::new(hue, s, v, 1.0).into()
    }

    /// Fill under alignment-padding hatching.
    pub fn align_pad_fill(self) -> Color32 {
        if self.is_dark() {
            Color32::from_rgb(58, 58, 66)
        } else {
            Color32::from_rgb(222, 222, 230)
        }
    }

    /// Lines of alignment-padding hatching (`/`).
    pub fn align_pad_line(self) -> Color32 {
        if self.is_dark() {
            Color32::from_rgb(150, 150, 170)
        } else {
            Color32::from_rgb(120, 120, 140)
        }
    }

    /// Fill under shard-tail-padding hatching.
    pub fn tail_pad_fill(self) -> Color32 {
        if self.is_dark() {
            Color32::from_rgb(70, 40, 40)
        } else {
            Color32::from_rgb(250, 225, 220)
        }
    }

    /// Lines of shard-tail hatching (`\`).
    pub fn tail_pad_line(self) -> Color32 {
        if self.is_dark() {
            Color32::from_rgb(230, 110, 100)
        } else {
            Color32::from_rgb(200, 70, 60)
        }
    }

    /// Outline of the selected parameter.
    pub fn selection(self) -> Color32 {
        if self.is_dark() {
            Color32::WHITE
        } else {
            Color32::BLACK
        }
    }

    /// Background of a rank bar (empty space).
    pub fn bar_bg(self) -> Color32 {
        if self.is_dark() {
            Color32::from_gray(32)
        } else {
            Color32::from_gray(245)
        }
    }

    /// Colour of a run of slices too thin to draw one by one.
    pub fn dense_fill(self) -> Color32 {
        if self.is_dark() {
            Color32::from_gray(120)
        } else {
            Color32::from_gray(150)
        }
    }

    /// Dims a colour that is not selected while something is selected.
    pub fn dim(self, c: Color32) -> Color32 {
        let bg = self.bar_bg();
        lerp(c, bg, 0.55)
    }
}

fn lerp(a: Color32, b: Color32, t: f32) -> Color32 {
    let m = |x: u8, y: u8| (f32::from(x) + (f32::from(y) - f32::from(x)) * t).round() as u8;
    Color32::from_rgb(m(a.r(), b.r()), m(a.g(), b.g()), m(a.b(), b.b()))
}

/// Hatch direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hatch {
    /// `/` lines: alignment padding.
    Forward,
    /// `\` lines: shard-tail padding.
    Backward,
}

/// Fills `rect` and draws diagonal lines spaced `spacing` px apart, clipped to `rect`.
pub fn hatch(
    painter: &Painter,
    rect: Rect,
    fill: Color32,
    line: Color32,
    dir: Hatch,
    spacing: f32,
) {
    painter.rect_filled(rect, 0.0, fill);
    if rect.width() < 2.0 || rect.height() < 2.0 {
        return;
    }
    let stroke = Stroke::new(1.0, line);
    let h = rect.height();
    // Lines x - y = c (Forward) or x + y = c (Backward), c stepping by `spacing` over the rect.
    let mut c = -h;
    let max_lines = 400;
    let mut drawn = 0;
    while c < rect.width() && drawn < max_lines {
        // Segment of the line inside [0, w] x [0, h] in rect-local coordinates (y down).
        let (x0, x1) = (c.max(0.0), (c + h).min(rect.width()));
        if x1 > x0 {
            let (p0, p1) = match dir {
                Hatch::Forward => (
                    Pos2::new(rect.left() + x0, rect.bottom() - (x0 - c)),
                    Pos2::new(rect.left() + x1, rect.bottom() - (x1 - c)),
                ),
                Hatch::Backward => (
                    Pos2::new(rect.left() + x0, rect.top() + (x0 - c)),
                    Pos2::new(rect.left() + x1, rect.top() + (x1 - c)),
                ),
            };
            painter.line_segment([p0, p1], stroke);
        }
        c += spacing;
        drawn += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_slots_get_distinct_colours() {
        for theme in [Theme::Dark, Theme::Light] {
            for slot in 0..64 {
                assert_ne!(theme.param_color(slot), theme.param_color(slot + 1));
            }
        }
    }
}
