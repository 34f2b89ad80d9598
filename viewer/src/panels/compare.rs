//! The A/B compare view: `diff`'s verdict per tensor, grouped by module, filterable by status and
//! name, with a summary line; clicking a tensor selects it in every panel.

use std::collections::BTreeSet;

use egui::{RichText, Sense, Ui};
use egui_extras::{Column, TableBuilder};

use crate::Selection;
use crate::compare::{Comparer, Comparison, Filter, Line, RowStatus, lines, tolerance_flags};
use crate::format::count;

/// Filter and collapsed modules of the compare view.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompareState {
    pub filter: Filter,
    /// Modules whose rows are hidden.
    pub collapsed: BTreeSet<String>,
}

pub fn status_color(ui: &Ui, s: RowStatus) -> egui::Color32 {
    match s {
        RowStatus::Equal => ui.visuals().weak_text_color(),
        RowStatus::Differs | RowStatus::Error => ui.visuals().error_fg_color,
        RowStatus::Changed | RowStatus::OnlyA | RowStatus::OnlyB => ui.visuals().warn_fg_color,
    }
}

fn counts_text(counts: &[usize; 6]) -> String {
    RowStatus::ALL
        .iter()
        .zip(counts)
        .filter(|(_, n)| **n > 0)
        .map(|(s, n)| format!("{n} {}", s.label()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn number(v: Option<f64>) -> String {
    v.map(|d| format!("{d:.3e}")).unwrap_or_default()
}

/// The **Compare** tab: progress of a running comparison, the tolerance controls and the
/// comparison shown.
pub fn tab_ui(
    ui: &mut Ui,
    comparison: Option<&Comparison>,
    comparer: &mut Comparer,
    st: &mut CompareState,
    selection: &mut Selection,
) {
    if comparer.running() {
        ui.horizontal(|ui| {
            ui.spinner();
            ui.label(comparer.progress().text());
        });
        let p = comparer.progress();
        if p.total > 0 {
            #[allow(clippy::cast_precision_loss, reason = "a progress fraction")]
            let f = p.done as f32 / p.total as f32;
            ui.add(egui::ProgressBar::new(f).show_percentage());
        }
        ui.separator();
    }
    if comparison.is_some() || comparer.running() {
        tolerance_ui(ui, comparer);
        ui.separator();
    }
    match comparison {
        Some(c) => self::ui(ui, c, st, selection),
        None if comparer.running() => {}
        None => {
            ui.label(
                "Open a checkpoint, then Compare with... another one (or start the viewer with A --compare B).",
            );
        }
    }
}

/// The tolerance controls: every valid change compares again, as `diff --rtol --atol` would.
fn tolerance_ui(ui: &mut Ui, comparer: &mut Comparer) {
    let applied = comparer.tolerance;
    let input = &mut comparer.tolerance_input;
    let before = input.clone();
    let change = ui.horizontal_wrapped(|ui| {
        ui.checkbox(&mut input.on, "tolerance")
            .on_hover_text("Floating-point values equal when |a-b| <= atol + rtol*|b| (torch.allclose); off: bitwise");
        ui.add_enabled_ui(input.on, |ui| {
            let label = ui.label("rtol");
            ui.add(
                egui::TextEdit::singleline(&mut input.rtol)
                    .id_salt("compare-rtol")
                    .desired_width(80.0),
            )
            .labelled_by(label.id);
            let label = ui.label("atol");
            ui.add(
                egui::TextEdit::singleline(&mut input.atol)
                    .id_salt("compare-atol")
                    .desired_width(80.0),
            )
            .labelled_by(label.id);
            ui.checkbox(&mut input.equal_nan, "equal NaN");
        });
        match input.tolerance() {
            Ok(t) => {
                let flags = tolerance_flags(applied);
                ui.weak(if flags.is_empty() {
                    "as shardscope diff (bitwise)".to_owned()
                } else {
                    format!("as shardscope diff {flags}")
                });
                (*input != before && t != applied).then_some(t)
            }
            Err(e) => {
                ui.colored_label(ui.visuals().error_fg_color, e);
                None
            }
        }
    });
    if let Some(t) = change.inner {
        comparer.set_tolerance(t);
    }
}

/// Draws the comparison.
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the table's columns laid out in drawing order"
)]
pub fn ui(ui: &mut Ui, c: &Comparison, st: &mut CompareState, selection: &mut Selection) {
    ui.horizontal_wrapped(|ui| {
        ui.strong("A");
        ui.monospace(&c.left);
        ui.strong("B");
        ui.monospace(&c.right);
    });
    ui.label(RichText::new(c.summary()).strong());
    for note in &c.notes {
        ui.weak(format!("note: {note}"));
    }
    ui.horizontal_wrapped(|ui| {
        for (s, n) in RowStatus::ALL.iter().zip(c.counts) {
            let mut on = st.filter.statuses.contains(s);
            if ui
                .checkbox(&mut on, format!("{} ({n})", s.label()))
                .changed()
            {
                if on {
                    st.filter.statuses.insert(*s);
                } else {
                    st.filter.statuses.remove(s);
                }
            }
        }
        ui.separator();
        if ui.small_button("only differences").clicked() {
            st.filter.statuses = RowStatus::ALL
                .into_iter()
                .filter(|s| *s != RowStatus::Equal)
                .collect();
        }
        if ui.small_button("all").clicked() {
            st.filter.statuses = RowStatus::ALL.into_iter().collect();
        }
    });
    ui.horizontal(|ui| {
        let label = ui.label("name");
        ui.add(
            egui::TextEdit::singleline(&mut st.filter.name)
                .id_salt("compare-filter")
                .hint_text("substring of the tensor name"),
        )
        .labelled_by(label.id);
        if ui.small_button("collapse all").clicked() {
            st.collapsed = c.rows.iter().map(|r| r.module.clone()).collect();
        }
        if ui.small_button("expand all").clicked() {
            st.collapsed.clear();
        }
    });
    let shown = lines(c, &st.filter, &st.collapsed);
    let mut toggle: Option<String> = None;
    TableBuilder::new(ui)
        .id_salt("compare_table")
        .striped(true)
        .sense(Sense::click())
        .column(Column::initial(130.0))
        .column(Column::initial(240.0).clip(true))
        .column(Column::initial(150.0).clip(true))
        .column(Column::initial(140.0).clip(true))
        .column(Column::initial(90.0))
        .column(Column::initial(85.0))
        .column(Column::initial(85.0))
        .column(Column::remainder().clip(true))
        .header(20.0, |mut h| {
            for t in [
                "status",
                "tensor",
                "dtype",
                "shape",
                "differing",
                "max |a-b|",
                "max rel",
                "message",
            ] {
                h.col(|ui| {
                    ui.strong(t);
                });
            }
        })
        .body(|body| {
            body.rows(20.0, shown.len(), |mut row| match &shown[row.index()] {
                Line::Module {
                    module,
                    counts,
                    collapsed,
                } => {
                    let name = if module.is_empty() {
                        "(top level)"
                    } else {
                        module
                    };
                    row.col(|ui| {
                        ui.add(
                            egui::Label::new(if *collapsed {
                                "[+] module"
                            } else {
                                "[-] module"
                            })
                            .selectable(false),
                        );
                    });
                    row.col(|ui| {
                        ui.add(egui::Label::new(RichText::new(name).strong()).selectable(false));
                    });
                    row.col(|ui| {
                        ui.add(egui::Label::new(counts_text(counts)).selectable(false));
                    });
                    for _ in 0..5 {
                        row.col(|_| {});
                    }
                    if row.response().clicked() {
                        toggle = Some(module.clone());
                    }
                }
                Line::Row(index) => {
                    let r = &c.rows[*index];
                    let e = &r.entry;
                    row.set_selected(selection.fqn.as_deref() == Some(e.fqn.as_str()));
                    row.col(|ui| {
                        ui.colored_label(status_color(ui, r.status), r.status.label());
                    });
                    row.col(|ui| {
                        ui.add(egui::Label::new(format!("  {}", r.name)).selectable(false))
                            .on_hover_text(&e.fqn);
                    });
                    row.col(|ui| {
                        ui.label(r.dtype_text());
                    });
                    row.col(|ui| {
                        ui.label(r.shape_text());
                    });
                    row.col(|ui| {
                        ui.label(e.mismatched_elements.map(count).unwrap_or_default());
                    });
                    row.col(|ui| {
                        ui.label(number(e.max_abs_diff));
                    });
                    row.col(|ui| {
                        ui.label(number(e.max_rel_diff));
                    });
                    row.col(|ui| {
                        let mut m = e.message.clone().unwrap_or_default();
                        if let (Some(at), Some([a, b])) = (&e.first_mismatch, &e.first_values) {
                            m = format!("first at {}: {a} vs {b}; {m}", crate::format::shape(at));
                        }
                        ui.add(egui::Label::new(m).selectable(false));
                    });
                    if row.response().clicked() {
                        selection.select(e.fqn.clone());
                    }
                }
            });
        });
    if let Some(m) = toggle
        && !st.collapsed.remove(&m)
    {
        st.collapsed.insert(m);
    }
}
