//! The panels: plain `ui` functions over view-model types.

pub mod checkpoint;
pub mod chunk_map;
pub mod compare;
pub mod controls;
pub mod fqn_map;
pub mod overlay;
pub mod ranks;
pub mod shard_map;
pub mod tensor_tree;
pub mod timeline;
pub mod values;
pub mod verify;

/// One branch of a module tree (shared by the layout and checkpoint trees).
pub(crate) struct Branch<'a> {
    /// egui id namespace of the tree.
    pub salt: &'a str,
    /// Dotted path of the parent ("" at the top).
    pub path: &'a str,
    pub name: &'a str,
    /// What the header counts (parameters or keys) and their bytes.
    pub count: usize,
    pub bytes: u64,
    /// `Some` forces every branch open or closed (e.g. while filtering).
    pub open: Option<bool>,
    /// Number of branches next to this one.
    pub siblings: usize,
}

impl Branch<'_> {
    /// Draws the header `name  (count, bytes)`, opened when `open` forces it or when it holds the
    /// selected FQN, open by default at the top level of a small tree. `body` draws the children;
    /// it gets the branch's path.
    pub(crate) fn show(
        &self,
        ui: &mut egui::Ui,
        selected_fqn: Option<&str>,
        body: impl FnOnce(&mut egui::Ui, &str),
    ) {
        let child_path = if self.path.is_empty() {
            self.name.to_owned()
        } else {
            format!("{}.{}", self.path, self.name)
        };
        let holds_selection = selected_fqn
            .is_some_and(|f| f.starts_with(&child_path) && f[child_path.len()..].starts_with('.'));
        egui::CollapsingHeader::new(format!(
            "{}  ({}, {})",
            self.name,
            self.count,
            crate::format::bytes(self.bytes)
        ))
        .id_salt((self.salt, &child_path))
        .open(self.open.or(holds_selection.then_some(true)))
        .default_open(self.path.is_empty() && self.siblings <= 8)
        .show(ui, |ui| body(ui, &child_path));
    }
}
