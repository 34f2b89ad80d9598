//! The FQN map: raw (wrapped) name ⇄ clean FQN ⇄ flat parameter and offset range, searchable and
//! sortable, with the Hugging Face name beside each when a `config.json` is opened
//! ([`crate::hf_names`]). Rows are virtualised, so 100 000 parameters scroll as smoothly as ten.

use egui::{Sense, Ui};
use egui_extras::{Column, TableBuilder};

use crate::Selection;
use crate::format::{count, ranks as fmt_ranks, shape as fmt_shape};
use crate::hf_names::HfNames;
use crate::view::{LayoutView, ParamRow};

/// Sortable columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SortKey {
    /// Registration order.
    #[default]
    Order,
    Fqn,
    Raw,
    Flat,
    Numel,
    Hf,
}

/// Search text and sort order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FqnMapState {
    pub filter: String,
    pub sort: SortKey,
    pub descending: bool,
    /// Scroll to the selected row on the next frame.
    pub reveal_selection: bool,
    /// `(view generation, HF names shown, filter, sort, descending, rows)`: recomputed only
    /// when one changes.
    cache: Option<(u64, bool, String, SortKey, bool, Vec<usize>)>,
}

/// Whether `p` matches a case-insensitive search over its names (its HF names included).
pub fn matches(p: &ParamRow, hf: Option<&HfNames>, needle_lower: &str) -> bool {
    needle_lower.is_empty()
        || p.fqn.to_lowercase().contains(needle_lower)
        || hf.is_some_and(|h| h.matches(&p.fqn, needle_lower))
        || p.raw_name.to_lowercase().contains(needle_lower)
        || p.flat_param
            .as_deref()
            .is_some_and(|f| f.to_lowercase().contains(needle_lower))
}

/// The rows shown, in order.
pub fn rows(view: &LayoutView, hf: Option<&HfNames>, st: &FqnMapState) -> Vec<usize> {
    let needle = st.filter.to_lowercase();
    let mut rows: Vec<usize> = (0..view.params.len())
        .filter(|&i| matches(&view.params[i], hf, &needle))
        .collect();
    let key = |i: &usize| &view.params[*i];
    match st.sort {
        SortKey::Order => {}
        SortKey::Fqn => rows.sort_by(|a, b| key(a).fqn.cmp(&key(b).fqn)),
        SortKey::Raw => rows.sort_by(|a, b| key(a).raw_name.cmp(&key(b).raw_name)),
        SortKey::Flat => rows.sort_by(|a, b| {
            (key(a).flat_param.as_deref(), key(a).flat_range)
                .cmp(&(key(b).flat_param.as_deref(), key(b).flat_range))
        }),
        SortKey::Numel => rows.sort_by_key(|i| view.params[*i].numel),
        SortKey::Hf => {
            if let Some(h) = hf {
                rows.sort_by_cached_key(|i| h.label(&view.params[*i].fqn));
            }
        }
    }
    if st.descending {
        rows.reverse();
    }
    rows
}

fn sort_button(ui: &mut Ui, st: &mut FqnMapState, key: SortKey, label: &str) {
    let arrow = if st.sort == key {
        if st.descending { " (desc)" } else { " (asc)" }
    } else {
        ""
    };
    if ui.button(format!("{label}{arrow}")).clicked() {
        if st.sort == key {
            st.descending = !st.descending;
        } else {
            st.sort = key;
            st.descending = false;
        }
    }
}

/// Draws the FQN map.
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the FQN map's filter, rows and details laid out in drawing order"
)]
pub fn ui(
    ui: &mut Ui,
    view: &LayoutView,
    hf: Option<&HfNames>,
    st: &mut FqnMapState,
    selection: &mut Selection,
) {
    let hf_error = hf.and_then(|h| h.error.as_ref().map(|e| (h.config.as_str(), e.as_str())));
    let hf_shown = hf.is_some_and(|h| h.error.is_none());
    let hf = hf.filter(|h| h.error.is_none());
    let fresh = st.cache.as_ref().is_some_and(|(g, h, f, k, d, _)| {
        *g == view.generation
            && *h == hf_shown
            && *f == st.filter
            && *k == st.sort
            && *d == st.descending
    });
    if !fresh {
        let r = rows(view, hf, st);
        st.cache = Some((
            view.generation,
            hf_shown,
            st.filter.clone(),
            st.sort,
            st.descending,
            r,
        ));
    }
    let shown = st.cache.as_ref().map(|c| c.5.clone()).unwrap_or_default();
    ui.horizontal(|ui| {
        let label = ui.label("Search");
        ui.add(
            egui::TextEdit::singleline(&mut st.filter)
                .hint_text("name, raw name or flat parameter")
                .id_salt("fqn_map_search"),
        )
        .labelled_by(label.id);
        if ui.button("Clear").clicked() {
            st.filter.clear();
        }
        ui.label(format!(
            "{} of {} parameters",
            shown.len(),
            view.params.len()
        ));
    });
    if let Some((config, e)) = hf_error {
        ui.label(format!("No HF names from {config}: {e}"));
    }
    if let Some(h) = hf {
        ui.label(format!(
            "HF names from {} by the mapping `{}` (what `shardscope convert --to hf --config {}` writes)",
            h.config,
            h.mapping.as_deref().unwrap_or("?"),
            h.config
        ));
    }
    let selected_row = selection
        .fqn
        .as_deref()
        .and_then(|f| shown.iter().position(|&i| view.params[i].fqn == f));
    let mut table = TableBuilder::new(ui)
        .id_salt("fqn_map_table")
        .striped(true)
        .resizable(true)
        .sense(Sense::click())
        .column(Column::initial(220.0).at_least(80.0).clip(true));
    if hf.is_some() {
        table = table.column(Column::initial(300.0).at_least(80.0).clip(true));
    }
    table = table
        .column(Column::initial(300.0).at_least(80.0).clip(true))
        .column(Column::initial(240.0).at_least(80.0).clip(true))
        .column(Column::initial(110.0))
        .column(Column::initial(80.0))
        .column(Column::initial(70.0))
        .column(Column::initial(80.0))
        .column(Column::remainder().clip(true));
    if st.reveal_selection {
        st.reveal_selection = false;
        if let Some(r) = selected_row {
            table = table.scroll_to_row(r, Some(egui::Align::Center));
        }
    }
    table
        .header(22.0, |mut header| {
            header.col(|ui| sort_button(ui, st, SortKey::Fqn, "Clean FQN"));
            if hf.is_some() {
                header.col(|ui| sort_button(ui, st, SortKey::Hf, "HF name"));
            }
            header.col(|ui| sort_button(ui, st, SortKey::Raw, "Raw (wrapped) name"));
            header.col(|ui| sort_button(ui, st, SortKey::Flat, "Flat parameter"));
            header.col(|ui| {
                ui.strong("Flat range");
            });
            header.col(|ui| {
                ui.strong("Shape");
            });
            header.col(|ui| {
                ui.strong("dtype");
            });
            header.col(|ui| sort_button(ui, st, SortKey::Numel, "numel"));
            header.col(|ui| {
                ui.strong("Ranks");
            });
        })
        .body(|body| {
            body.rows(20.0, shown.len(), |mut row| {
                let p = &view.params[shown[row.index()]];
                row.set_selected(selection.fqn.as_deref() == Some(p.fqn.as_str()));
                row.col(|ui| {
                    ui.add(egui::Label::new(&p.fqn).selectable(false));
                });
                if let Some(h) = hf {
                    row.col(|ui| {
                        let r = ui.add(egui::Label::new(h.label(&p.fqn)).selectable(false));
                        if let Some(all) = h.names.get(&p.fqn).filter(|n| n.len() > 1) {
                            r.on_hover_text(all.join("\n"));
                        }
                    });
                }
                row.col(|ui| {
                    ui.add(egui::Label::new(&p.raw_name).selectable(false));
                });
                row.col(|ui| {
                    let text = match (&p.flat_param, &p.shared_with) {
                        (Some(f), None) => f.clone(),
                        (Some(f), Some(prim)) => format!("{f} (tied to {prim})"),
                        (None, Some(prim)) => format!("tied to {prim}"),
                        (None, None) => p.status.label().to_owned(),
                    };
                    ui.add(egui::Label::new(text).selectable(false));
                });
                row.col(|ui| {
                    if let Some((a, b)) = p.flat_range {
                        ui.add(egui::Label::new(format!("[{a}, {b})")).selectable(false));
                    }
                });
                row.col(|ui| {
                    ui.add(egui::Label::new(fmt_shape(&p.shape)).selectable(false));
                });
                row.col(|ui| {
                    ui.add(egui::Label::new(p.dtype.name()).selectable(false));
                });
                row.col(|ui| {
                    ui.add(egui::Label::new(count(p.numel)).selectable(false));
                });
                row.col(|ui| {
                    ui.add(egui::Label::new(fmt_ranks(&p.ranks)).selectable(false));
                });
                if row.response().clicked() {
                    selection.select(p.fqn.clone());
                }
            });
        });
}
