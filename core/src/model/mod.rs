//! Basic model types shared by every layer above: the model description (parameters, units, tied
//! aliases), FQN rules (wrapper prefixes, key paths) and the value tree the transforms take.
//!
//! Format quirks (wrapper prefixes, pickle classes, DCP flattening) are resolved before data reaches
//! these types; code that uses them never sees them.

pub mod description;
pub mod fqn;
pub mod tree;

pub use description::{DescriptionError, ModelDescription, ParamSpec};
