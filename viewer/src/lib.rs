//! shardscope viewer: "who holds what, and why is my shard that size" for a whole model or
//! checkpoint. Every panel is a plain `ui` function over [`view::LayoutView`] (or a
//! [`trace::Trace`]); [`Viewer`] arranges them, and the native binary and the web entry wrap it.

pub mod app;
mod app_open;
pub mod checkpoint;
pub mod compare;
pub mod deepspeed_view;
pub mod docs;
pub mod format;
pub mod hf_names;
pub mod job;
pub mod manifest_check;
pub mod map_marks;
pub mod panels;
pub mod report;
pub mod theme;
pub mod trace;
pub mod values;
pub mod view;
pub mod window_fit;

pub use app::{Tab, Viewer};
pub use shardscope_core as core;

/// The parameter selected in any panel; every panel highlights it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Clean FQN of the selected parameter.
    pub fqn: Option<String>,
    /// Set when a panel changed the selection this frame (other panels then scroll to it).
    pub changed: bool,
}

impl Selection {
    /// Selects `fqn` and tells the other panels to reveal it.
    pub fn select(&mut self, fqn: String) {
        self.fqn = Some(fqn);
        self.changed = true;
    }
}
