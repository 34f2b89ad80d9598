//! The checkpoint panels, over a [`CheckpointView`]: the key tree, the key table (FQN map with raw
//! names and FSDP facts), the chunk map of one entry drawn from its real chunk offsets, and the
//! optimizer state per parameter.

use std::collections::BTreeMap;

use egui::{Pos2, Rect, RichText, Sense, Stroke, Ui, Vec2};
use egui_extras::{Column, TableBuilder};
use shardscope_core::index::{EntryKind, FsdpInfo, IndexEntry};

use crate::Selection;
use crate::checkpoint::{CheckpointView, value_text};
use crate::format::{bytes as fmt_bytes, count, ranks as fmt_ranks, shape as fmt_shape};
use crate::theme::Theme;

/// Filter texts, caches and the chunk map's view transform.
#[derive(Debug, Default)]
pub struct CheckpointState {
    pub tree_filter: String,
    tree_cache: Option<(u64, String, Node)>,
    pub table_filter: String,
    table_cache: Option<(u64, String, Vec<usize>)>,
    /// Chunk map zoom (1 = fit) and pan in fractions of the tensor.
    pub zoom: f32,
    pub pan: Vec2,
    pub reveal_selection: bool,
    /// Where the chunk map was last drawn.
    pub last_canvas: Option<Rect>,
    /// Rows of the key table drawn last frame: `(entry index, rect)` (scripts aim clicks).
    pub row_rects: Vec<(usize, Rect)>,
}

/// A module of the key tree.
#[derive(Debug, Default)]
pub struct Node {
    pub children: BTreeMap<String, Node>,
    /// `(leaf name, entry index)`.
    pub leaves: Vec<(String, usize)>,
    pub entries: usize,
    pub bytes: u64,
}

/// The module tree of the keys matching `filter` (case-insensitive substring), split on `.`.
pub fn build_tree(view: &CheckpointView, filter: &str) -> Node {
    let needle = filter.to_lowercase();
    let mut root = Node::default();
    for (i, e) in view.index.entries.iter().enumerate() {
        if !needle.is_empty() && !e.key.to_lowercase().contains(&needle) {
            continue;
        }
        let bytes = e.nbytes().unwrap_or(0);
        let mut parts: Vec<&str> = e.key.split('.').collect();
        let leaf = parts.pop().unwrap_or_default();
        let mut node = &mut root;
        node.entries += 1;
        node.bytes += bytes;
        for part in parts {
            node = node.children.entry(part.to_owned()).or_default();
            node.entries += 1;
            node.bytes += bytes;
        }
        node.leaves.push((leaf.to_owned(), i));
    }
    root
}

/// dtype, shape and bytes of an entry, or its value for non-tensors.
pub fn entry_facts(e: &IndexEntry) -> String {
    match e.kind {
        EntryKind::Tensor => format!(
            "{} {} {}",
            e.dtype.map_or("?", |d| d.name()),
            e.shape
                .as_deref()
                .map_or("[rank-local]".to_owned(), fmt_shape),
            e.nbytes().map_or(String::new(), fmt_bytes)
        ),
        EntryKind::Bytes | EntryKind::Scalar => {
            format!("= {}", e.value.as_ref().map_or("?".to_owned(), value_text))
        }
    }
}

/// The FSDP facts of an entry in words.
pub fn fsdp_text(e: &IndexEntry) -> String {
    let mut out = match &e.fsdp {
        Some(FsdpInfo::ShardedTensor { shards }) => {
            format!("ShardedTensor, {} shards", shards.len())
        }
        Some(FsdpInfo::DTensor {
            placements,
            mesh_shape,
        }) => format!(
            "DTensor {} mesh {}",
            placements.join(", "),
            mesh_shape.as_deref().map_or("?".to_owned(), fmt_shape)
        ),
        None => String::new(),
    };
    if e.flat_param {
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str("flat parameter");
    }
    out
}

/// The key tree (left panel).
pub fn tree_ui(
    ui: &mut Ui,
    view: &CheckpointView,
    st: &mut CheckpointState,
    selection: &mut Selection,
) {
    ui.horizontal(|ui| {
        let label = ui.label("Filter keys");
        ui.add(
            egui::TextEdit::singleline(&mut st.tree_filter)
                .hint_text("part of a key")
                .id_salt("ckpt_tree_filter")
                .desired_width(f32::INFINITY),
        )
        .labelled_by(label.id);
    });
    let fresh = st
        .tree_cache
        .as_ref()
        .is_some_and(|(g, f, _)| *g == view.generation && *f == st.tree_filter);
    if !fresh {
        st.tree_cache = Some((
            view.generation,
            st.tree_filter.clone(),
            build_tree(view, &st.tree_filter),
        ));
    }
    let Some((_, _, root)) = &st.tree_cache else {
        return;
    };
    ui.label(format!("{} keys, {}", root.entries, fmt_bytes(root.bytes)));
    let open = (!st.tree_filter.is_empty()).then_some(true);
    egui::ScrollArea::vertical()
        .id_salt("ckpt_tree_scroll")
        .auto_shrink([false, false])
        .max_height(ui.available_height())
        .show(ui, |ui| node_ui(ui, view, root, "", open, selection));
}

fn node_ui(
    ui: &mut Ui,
    view: &CheckpointView,
    node: &Node,
    path: &str,
    open: Option<bool>,
    selection: &mut Selection,
) {
    for (name, child) in &node.children {
        let selected = selection.fqn.clone();
        super::Branch {
            salt: "ckpt_tree",
            path,
            name,
            count: child.entries,
            bytes: child.bytes,
            open,
            siblings: node.children.len(),
        }
        .show(ui, selected.as_deref(), |ui, child_path| {
            node_ui(ui, view, child, child_path, open, selection);
        });
    }
    for (leaf, i) in &node.leaves {
        let e = &view.index.entries[*i];
        let selected = selection.fqn.as_deref() == Some(e.key.as_str());
        ui.horizontal(|ui| {
            let response = ui
                .selectable_label(selected, RichText::new(leaf).monospace())
                .on_hover_text(&e.key);
            if response.clicked() {
                selection.select(e.key.clone());
            }
            ui.weak(format!(
                "{} · ranks {}",
                entry_facts(e),
                fmt_ranks(&view.ranks[*i])
            ));
        });
    }
}

fn table_rows(view: &CheckpointView, filter: &str) -> Vec<usize> {
    let needle = filter.to_lowercase();
    (0..view.index.entries.len())
        .filter(|&i| {
            let e = &view.index.entries[i];
            needle.is_empty()
                || e.key.to_lowercase().contains(&needle)
                || e.raw_key
                    .as_deref()
                    .is_some_and(|r| r.to_lowercase().contains(&needle))
        })
        .collect()
}

/// The key table: raw (wrapped) key ⇄ clean key ⇄ FSDP facts, kind, dtype, shape, bytes, chunks,
/// ranks. Rows are virtualised.
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the table's header, rows and columns laid out in drawing order"
)]
pub fn table_ui(
    ui: &mut Ui,
    view: &CheckpointView,
    st: &mut CheckpointState,
    selection: &mut Selection,
) {
    let fresh = st
        .table_cache
        .as_ref()
        .is_some_and(|(g, f, _)| *g == view.generation && *f == st.table_filter);
    if !fresh {
        st.table_cache = Some((
            view.generation,
            st.table_filter.clone(),
            table_rows(view, &st.table_filter),
        ));
    }
    st.row_rects.clear();
    let shown = st
        .table_cache
        .as_ref()
        .map(|c| c.2.clone())
        .unwrap_or_default();
    ui.horizontal(|ui| {
        let label = ui.label("Search keys");
        ui.add(
            egui::TextEdit::singleline(&mut st.table_filter)
                .hint_text("clean or raw key")
                .id_salt("ckpt_table_search"),
        )
        .labelled_by(label.id);
        ui.label(format!(
            "{} of {} keys · {} chunks · {} files",
            shown.len(),
            view.index.entries.len(),
            count(view.chunk_count as u64),
            view.index.files.len()
        ));
    });
    let selected_row = selection
        .fqn
        .as_deref()
        .and_then(|f| shown.iter().position(|&i| view.index.entries[i].key == f));
    let mut table = TableBuilder::new(ui)
        .id_salt("ckpt_table")
        .striped(true)
        .resizable(true)
        .sense(Sense::click())
        .column(Column::initial(240.0).at_least(80.0).clip(true))
        .column(Column::initial(260.0).at_least(80.0).clip(true))
        .column(Column::initial(80.0))
        .column(Column::initial(90.0))
        .column(Column::initial(80.0))
        .column(Column::initial(60.0))
        .column(Column::initial(90.0).clip(true))
        .column(Column::remainder().clip(true));
    if st.reveal_selection {
        st.reveal_selection = false;
        if let Some(r) = selected_row {
            table = table.scroll_to_row(r, Some(egui::Align::Center));
        }
    }
    table
        .header(22.0, |mut h| {
            for title in [
                "Key (clean FQN)",
                "Raw (wrapped) key",
                "dtype",
                "Shape",
                "Bytes",
                "Chunks",
                "Ranks",
                "FSDP / value",
            ] {
                h.col(|ui| {
                    ui.strong(title);
                });
            }
        })
        .body(|body| {
            body.rows(20.0, shown.len(), |mut row| {
                let i = shown[row.index()];
                let e = &view.index.entries[i];
                row.set_selected(selection.fqn.as_deref() == Some(e.key.as_str()));
                let cell = |row: &mut egui_extras::TableRow<'_, '_>, text: String| {
                    row.col(|ui| {
                        ui.add(egui::Label::new(text).selectable(false));
                    });
                };
                cell(&mut row, e.key.clone());
                cell(&mut row, e.raw_key.clone().unwrap_or_default());
                cell(
                    &mut row,
                    e.dtype.map_or(String::new(), |d| d.name().to_owned()),
                );
                cell(
                    &mut row,
                    e.shape.as_deref().map_or(String::new(), fmt_shape),
                );
                cell(&mut row, e.nbytes().map_or(String::new(), fmt_bytes));
                cell(&mut row, e.chunks.len().to_string());
                cell(&mut row, fmt_ranks(&view.ranks[i]));
                let last = if e.kind == EntryKind::Tensor {
                    fsdp_text(e)
                } else {
                    entry_facts(e)
                };
                cell(&mut row, last);
                st.row_rects.push((i, row.response().rect));
                if row.response().clicked() {
                    selection.select(e.key.clone());
                }
            });
        });
}

/// The chunk map of one entry: the global tensor as a grid (`[dim0, dim1]`; a strip for 1-D; the
/// first two dims for more), every stored chunk at its real offsets, coloured by writing rank.
/// Drag to pan, wheel to zoom. Returns the painted canvas.
#[allow(
    clippy::too_many_lines,
    reason = "immediate-mode UI: the chunk map's layout, interaction and painting in drawing order"
)]
pub fn chunk_map_ui(
    ui: &mut Ui,
    view: &CheckpointView,
    entry: usize,
    st: &mut CheckpointState,
    theme: Theme,
) -> Option<Rect> {
    let e = view.index.entries.get(entry)?;
    let ranks = &view.ranks[entry];
    ui.label(format!(
        "{}: {} chunks on ranks {}",
        e.key,
        e.chunks.len(),
        fmt_ranks(ranks)
    ));
    let Some(shape) = e.shape.as_deref() else {
        ui.weak("No global shape (rank-local pieces): no chunk map.");
        return None;
    };
    let (rows, cols) = match shape {
        [] => (1, 1),
        [n] => (1, *n),
        [r, c, ..] => (*r, *c),
    };
    if shape.len() > 2 {
        ui.weak(format!(
            "{}-D tensor: the grid shows dims 0 and 1",
            shape.len()
        ));
    }
    ui.horizontal(|ui| {
        if ui.button("Fit").clicked() {
            st.zoom = 1.0;
            st.pan = Vec2::ZERO;
        }
        ui.weak("drag to pan, wheel to zoom");
    });
    let size = Vec2::new(
        ui.available_width(),
        ui.available_height().clamp(120.0, 520.0),
    );
    let (canvas, response) = ui.allocate_exact_size(size, Sense::click_and_drag());
    if st.zoom < 1.0 {
        st.zoom = 1.0;
    }
    if response.dragged() {
        st.pan += response.drag_delta() / (canvas.size() * st.zoom);
    }
    if response.hovered() {
        let wheel = ui.input(|i| i.smooth_scroll_delta.y);
        if wheel != 0.0 {
            st.zoom = (st.zoom * (1.0 + wheel * 0.002)).clamp(1.0, 4096.0);
        }
    }
    let painter = ui.painter_at(canvas);
    painter.rect_filled(canvas, 0.0, theme.bar_bg());
    // Fit the tensor's aspect into the canvas (1-D: a strip).
    let aspect = if rows == 1 {
        0.08
    } else {
        rows as f32 / cols.max(1) as f32
    };
    let fit_w = canvas.width().min(canvas.height() / aspect.max(1e-6));
    let base = Vec2::new(fit_w, (fit_w * aspect).max(12.0)) * st.zoom;
    let origin = canvas.min + st.pan * canvas.size() * st.zoom;
    let tensor_rect = Rect::from_min_size(origin, base);
    painter.rect_stroke(
        tensor_rect,
        0.0,
        Stroke::new(1.0, ui.visuals().weak_text_color()),
        egui::StrokeKind::Outside,
    );
    let dims = (rows.max(1) as f32, cols.max(1) as f32);
    let mut mesh = egui::Mesh::default();
    let mut hovered: Option<usize> = None;
    let pointer = response.hover_pos();
    for (ci, c) in e.chunks.iter().enumerate() {
        let (r0, c0, rn, cn) = match (c.offsets.as_slice(), c.sizes.as_slice()) {
            ([], _) | (_, []) => (0, 0, 1, 1),
            ([o], [s]) => (0, *o, 1, *s),
            ([o0, o1, ..], [s0, s1, ..]) => (*o0, *o1, *s0, *s1),
            _ => continue,
        };
        let min = tensor_rect.min
            + Vec2::new(
                c0 as f32 / dims.1 * tensor_rect.width(),
                r0 as f32 / dims.0 * tensor_rect.height(),
            );
        let r = Rect::from_min_size(
            min,
            Vec2::new(
                cn as f32 / dims.1 * tensor_rect.width(),
                rn as f32 / dims.0 * tensor_rect.height(),
            ),
        );
        if !r.intersects(canvas) {
            continue;
        }
        let slot = c.rank.map_or(ci, |r| r as usize);
        mesh.add_colored_rect(r.shrink(0.5), theme.param_color(slot));
        if pointer.is_some_and(|p| r.contains(p)) {
            hovered = Some(ci);
        }
    }
    painter.add(egui::Shape::mesh(mesh));
    if let Some(ci) = hovered {
        let c = &e.chunks[ci];
        response.clone().on_hover_text(format!(
            "chunk {ci}: rank {}\noffsets {} sizes {}\n{} bytes {}..{}",
            c.rank.map_or("?".to_owned(), |r| r.to_string()),
            fmt_shape(&c.offsets),
            fmt_shape(&c.sizes),
            c.file,
            c.byte_offset,
            c.byte_offset.saturating_add(c.byte_length)
        ));
    }
    Some(canvas)
}

/// The chunk table of one entry (virtualised).
pub fn chunk_table_ui(ui: &mut Ui, e: &IndexEntry) {
    TableBuilder::new(ui)
        .id_salt("ckpt_chunks")
        .striped(true)
        .column(Column::initial(50.0))
        .column(Column::initial(90.0))
        .column(Column::initial(90.0))
        .column(Column::remainder().clip(true))
        .header(20.0, |mut h| {
            for t in ["Rank", "Offsets", "Sizes", "File, bytes"] {
                h.col(|ui| {
                    ui.strong(t);
                });
            }
        })
        .body(|body| {
            body.rows(18.0, e.chunks.len(), |mut row| {
                let c = &e.chunks[row.index()];
                row.col(|ui| {
                    ui.label(c.rank.map_or("?".to_owned(), |r| r.to_string()));
                });
                row.col(|ui| {
                    ui.label(fmt_shape(&c.offsets));
                });
                row.col(|ui| {
                    ui.label(fmt_shape(&c.sizes));
                });
                row.col(|ui| {
                    ui.label(format!(
                        "{} {}..{}",
                        c.file,
                        c.byte_offset,
                        c.byte_offset.saturating_add(c.byte_length)
                    ));
                });
            });
        });
}

/// The optimizer state: per parameter, which states exist on which ranks, their shapes and
/// scalar values (`step`); then the param groups.
pub fn optimizer_ui(ui: &mut Ui, view: &CheckpointView, selection: &mut Selection) {
    if view.optimizer.is_empty() && view.param_groups.is_empty() {
        ui.label("This checkpoint holds no optimizer state.");
        return;
    }
    ui.label(format!(
        "{} parameters with state · {} param groups",
        view.optimizer.len(),
        view.param_groups.len()
    ));
    egui::ScrollArea::vertical()
        .id_salt("optim_scroll")
        .auto_shrink([false, false])
        .show(ui, |ui| {
            egui::Grid::new("optim_grid")
                .striped(true)
                .num_columns(5)
                .show(ui, |ui| {
                    for t in ["Parameter", "State", "Shape / value", "dtype", "Ranks"] {
                        ui.strong(t);
                    }
                    ui.end_row();
                    for (param, states) in &view.optimizer {
                        for (k, s) in states.iter().enumerate() {
                            let e = &view.index.entries[s.entry];
                            if k == 0 {
                                ui.monospace(param);
                            } else {
                                ui.label("");
                            }
                            let selected = selection.fqn.as_deref() == Some(e.key.as_str());
                            if ui
                                .selectable_label(selected, &s.name)
                                .on_hover_text(&e.key)
                                .clicked()
                            {
                                selection.select(e.key.clone());
                            }
                            let what = match (&s.value, &e.shape) {
                                (Some(v), _) => format!("{} = {v}", s.name),
                                (None, Some(shape)) => fmt_shape(shape),
                                (None, None) => "rank-local".to_owned(),
                            };
                            ui.label(what);
                            ui.label(e.dtype.map_or(String::new(), |d| d.name().to_owned()));
                            ui.label(fmt_ranks(&s.ranks));
                            ui.end_row();
                        }
                    }
                });
            for (g, leaves) in &view.param_groups {
                ui.separator();
                ui.strong(format!("param_groups[{g}]"));
                egui::Grid::new(("param_group", *g))
                    .striped(true)
                    .show(ui, |ui| {
                        for (k, v) in leaves {
                            ui.monospace(k);
                            ui.label(format!("{k} = {v}"));
                            ui.end_row();
                        }
                    });
            }
        });
}

/// Where chunk `ci` of `entry` is drawn on `canvas` with the current transform (tests aim clicks).
pub fn chunk_center(canvas: Rect, st: &CheckpointState, e: &IndexEntry, ci: usize) -> Option<Pos2> {
    let shape = e.shape.as_deref()?;
    let (rows, cols) = match shape {
        [] => (1, 1),
        [n] => (1, *n),
        [r, c, ..] => (*r, *c),
    };
    let aspect = if rows == 1 {
        0.08
    } else {
        rows as f32 / cols.max(1) as f32
    };
    let fit_w = canvas.width().min(canvas.height() / aspect.max(1e-6));
    let zoom = st.zoom.max(1.0);
    let base = Vec2::new(fit_w, (fit_w * aspect).max(12.0)) * zoom;
    let origin = canvas.min + st.pan * canvas.size() * zoom;
    let c = e.chunks.get(ci)?;
    let (r0, c0, rn, cn) = match (c.offsets.as_slice(), c.sizes.as_slice()) {
        ([o], [s]) => (0, *o, 1, *s),
        ([o0, o1, ..], [s0, s1, ..]) => (*o0, *o1, *s0, *s1),
        _ => (0, 0, 1, 1),
    };
    let x = (c0 as f32 + cn as f32 / 2.0) / cols.max(1) as f32 * base.x;
    let y = (r0 as f32 + rn as f32 / 2.0) / rows.max(1) as f32 * base.y;
    Some(origin + Vec2::new(x, y))
}
