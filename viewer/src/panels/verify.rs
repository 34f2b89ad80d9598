//! Verification: a `diff`/`verify` report with every problem listed; clicking an entry selects the
//! tensor everywhere.

use egui::{Sense, Ui};
use egui_extras::{Column, TableBuilder};

use crate::Selection;
use crate::format::{count, shape as fmt_shape};
use crate::report::{Report, Status};

/// Filter of the entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyState {
    pub only_problems: bool,
}

/// Whether the report's key `key` names a parameter of the layout `view`: as it is, or under the
/// checkpoint's app-state wrapper (`model.embed.weight` is the layout's `embed.weight`).
pub fn in_layout(view: Option<&crate::view::LayoutView>, wrapper: Option<&str>, key: &str) -> bool {
    view.is_some_and(|v| {
        v.by_fqn.contains_key(key)
            || wrapper
                .and_then(|w| key.strip_prefix(w)?.strip_prefix('.'))
                .is_some_and(|f| v.by_fqn.contains_key(f))
    })
}

fn status_color(ui: &Ui, s: Status) -> egui::Color32 {
    match s {
        Status::Match => ui.visuals().weak_text_color(),
        Status::Mismatch | Status::Error => ui.visuals().error_fg_color,
        Status::Missing | Status::Unexpected => ui.visuals().warn_fg_color,
    }
}

/// Draws the report.
pub fn ui(
    ui: &mut Ui,
    report: &Report,
    st: &mut VerifyState,
    selection: &mut Selection,
    known: &dyn Fn(&str) -> bool,
) {
    ui.horizontal(|ui| {
        ui.strong(&report.name);
        if let (Some(l), Some(r)) = (&report.left, &report.right) {
            ui.weak(format!("{l}  vs  {r}"));
        }
    });
    ui.label(report.summary());
    ui.checkbox(&mut st.only_problems, "only problems");
    let rows: Vec<usize> = (0..report.entries.len())
        .filter(|&i| !st.only_problems || report.entries[i].status.is_problem())
        .collect();
    TableBuilder::new(ui)
        .id_salt("verify_table")
        .striped(true)
        .sense(Sense::click())
        .column(Column::initial(90.0))
        .column(Column::initial(280.0).clip(true))
        .column(Column::initial(90.0))
        .column(Column::initial(90.0))
        .column(Column::initial(110.0))
        .column(Column::initial(90.0))
        .column(Column::remainder().clip(true))
        .header(20.0, |mut h| {
            for t in [
                "status",
                "tensor",
                "dtype",
                "shape",
                "mismatched",
                "max |diff|",
                "message",
            ] {
                h.col(|ui| {
                    ui.strong(t);
                });
            }
        })
        .body(|body| {
            body.rows(20.0, rows.len(), |mut row| {
                let e = &report.entries[rows[row.index()]];
                row.set_selected(selection.fqn.as_deref() == Some(e.fqn.as_str()));
                row.col(|ui| {
                    ui.colored_label(status_color(ui, e.status), e.status.label());
                });
                row.col(|ui| {
                    let text = if known(&e.fqn) {
                        e.fqn.clone()
                    } else {
                        format!("{} (not in the layout)", e.fqn)
                    };
                    ui.add(egui::Label::new(text).selectable(false));
                });
                row.col(|ui| {
                    ui.label(e.dtype.as_deref().unwrap_or(""));
                });
                row.col(|ui| {
                    ui.label(e.shape.as_deref().map(fmt_shape).unwrap_or_default());
                });
                row.col(|ui| {
                    ui.label(e.mismatched_elements.map(count).unwrap_or_default());
                });
                row.col(|ui| {
                    ui.label(
                        e.max_abs_diff
                            .map(|d| format!("{d:.3e}"))
                            .unwrap_or_default(),
                    );
                });
                row.col(|ui| {
                    let mut m = e.message.clone().unwrap_or_default();
                    if let Some(at) = &e.first_mismatch {
                        m = format!("first at {} {m}", fmt_shape(at));
                    }
                    ui.add(egui::Label::new(m).selectable(false));
                });
                if row.response().clicked() {
                    selection.select(e.fqn.clone());
                }
            });
        });
}

/// Draws `shardscope doctor` findings (the opened checkpoint checked alone): severity, code,
/// message, fix, and the keys, each of which selects its tensor when clicked.
pub fn doctor_ui(
    ui: &mut Ui,
    findings: &[shardscope_core::doctor::Finding],
    selection: &mut Selection,
) {
    use shardscope_core::doctor::Severity;
    ui.strong(format!("doctor: {} finding(s)", findings.len()));
    for (i, f) in findings.iter().enumerate() {
        let color = match f.severity {
            Severity::Error => ui.visuals().error_fg_color,
            Severity::Warning => ui.visuals().warn_fg_color,
        };
        ui.horizontal_wrapped(|ui| {
            ui.colored_label(color, format!("{}[{}]", severity_label(f.severity), f.code));
            ui.label(&f.message);
        });
        ui.horizontal_wrapped(|ui| {
            ui.weak("fix:");
            ui.monospace(&f.fix);
        });
        egui::CollapsingHeader::new(format!("{} key(s)", f.keys.len()))
            .id_salt(("doctor_keys", i))
            .show(ui, |ui| {
                ui.horizontal_wrapped(|ui| {
                    for k in &f.keys {
                        let key = shardscope_core::model::fqn::clean_tensor_name(k);
                        let selected = selection.fqn.as_deref() == Some(key.as_str());
                        if ui.selectable_label(selected, k).clicked() {
                            selection.select(key);
                        }
                    }
                });
            });
    }
}

fn severity_label(s: shardscope_core::doctor::Severity) -> &'static str {
    match s {
        shardscope_core::doctor::Severity::Error => "error",
        shardscope_core::doctor::Severity::Warning => "warning",
    }
}
