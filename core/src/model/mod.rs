//! Canonical types shared by layouts, transforms, the CLI and the viewer.
//!
//! Format quirks (wrapper prefixes, pickle classes, DCP flattening) are resolved before data reaches
//! this module; code that uses these types never sees them.

pub mod bridge;
pub mod description;
pub mod fqn;
pub mod from_index;
pub mod fsdp1_view;
pub mod fsdp2_view;
pub mod hints;
pub mod index;
pub mod ties;
pub mod tree;

pub use description::{DescriptionError, ModelDescription, ParamSpec};
