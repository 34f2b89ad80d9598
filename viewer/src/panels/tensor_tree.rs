//! The tensor tree: parameters grouped by module path, with a filter box, dtype, shape, bytes and
//! the ranks holding each.

use std::collections::BTreeMap;

use egui::{RichText, Ui};

use crate::Selection;
use crate::format::{bytes as fmt_bytes, ranks as fmt_ranks, shape as fmt_shape};
use crate::theme::Theme;
use crate::view::LayoutView;

/// Filter text and the tree built for it.
#[derive(Debug, Default)]
pub struct TreeState {
    pub filter: String,
    /// `(view generation, filter, tree)`: rebuilt only when either changes.
    cache: Option<(u64, String, Node)>,
}

/// A module in the tree: children modules and parameter leaves (indices into the view's params).
#[derive(Debug, Default)]
pub struct Node {
    pub children: BTreeMap<String, Node>,
    pub leaves: Vec<(String, usize)>,
    /// Parameters below this node.
    pub params: usize,
    pub bytes: u64,
}

/// Builds the module tree of the parameters matching `filter` (case-insensitive substring).
pub fn build(view: &LayoutView, filter: &str) -> Node {
    let needle = filter.to_lowercase();
    let mut root = Node::default();
    for (i, p) in view.params.iter().enumerate() {
        if !needle.is_empty() && !p.fqn.to_lowercase().contains(&needle) {
            continue;
        }
        let mut parts: Vec<&str> = p.fqn.split('.').collect();
        let leaf = parts.pop().unwrap_or_default();
        let mut node = &mut root;
        node.params += 1;
        node.bytes += p.bytes();
        for part in parts {
            node = node.children.entry(part.to_owned()).or_default();
            node.params += 1;
            node.bytes += p.bytes();
        }
        node.leaves.push((leaf.to_owned(), i));
    }
    root
}

/// Draws the tree.
pub fn ui(
    ui: &mut Ui,
    view: &LayoutView,
    st: &mut TreeState,
    selection: &mut Selection,
    theme: Theme,
) {
    ui.horizontal(|ui| {
        let label = ui.label("Filter");
        ui.add(
            egui::TextEdit::singleline(&mut st.filter)
                .hint_text("part of an FQN")
                .id_salt("tree_filter")
                .desired_width(f32::INFINITY),
        )
        .labelled_by(label.id);
    });
    let fresh = st
        .cache
        .as_ref()
        .is_some_and(|(g, f, _)| *g == view.generation && *f == st.filter);
    if !fresh {
        st.cache = Some((view.generation, st.filter.clone(), build(view, &st.filter)));
    }
    let Some((_, _, root)) = &st.cache else {
        return;
    };
    ui.label(format!(
        "{} parameters, {}",
        root.params,
        fmt_bytes(root.bytes)
    ));
    let open = if st.filter.is_empty() {
        None
    } else {
        Some(true)
    };
    egui::ScrollArea::vertical()
        .id_salt("tree_scroll")
        .auto_shrink([false, false])
        .show(ui, |ui| {
            node_ui(ui, view, root, "", open, selection, theme);
        });
}

fn node_ui(
    ui: &mut Ui,
    view: &LayoutView,
    node: &Node,
    path: &str,
    open: Option<bool>,
    selection: &mut Selection,
    theme: Theme,
) {
    for (name, child) in &node.children {
        let selected = selection.fqn.clone();
        super::Branch {
            salt: "tree",
            path,
            name,
            count: child.params,
            bytes: child.bytes,
            open,
            siblings: node.children.len(),
        }
        .show(ui, selected.as_deref(), |ui, child_path| {
            node_ui(ui, view, child, child_path, open, selection, theme);
        });
    }
    for (leaf, i) in &node.leaves {
        let p = &view.params[*i];
        let selected = selection.fqn.as_deref() == Some(p.fqn.as_str());
        ui.horizontal(|ui| {
            let (swatch, _) = ui.allocate_exact_size(egui::Vec2::splat(10.0), egui::Sense::hover());
            ui.painter()
                .rect_filled(swatch, 2.0, theme.param_color(p.color_slot));
            let text = RichText::new(leaf).monospace();
            let response = ui.selectable_label(selected, text).on_hover_text(format!(
                "{}\n{} {}  {}\n{}\nranks {}",
                p.fqn,
                fmt_shape(&p.shape),
                p.dtype,
                fmt_bytes(p.bytes()),
                p.status.label(),
                fmt_ranks(&p.ranks)
            ));
            if response.clicked() {
                selection.select(p.fqn.clone());
            }
            ui.weak(format!(
                "{} {} {} · ranks {}",
                p.dtype.name(),
                fmt_shape(&p.shape),
                fmt_bytes(p.bytes()),
                fmt_ranks(&p.ranks)
            ));
        });
    }
}
