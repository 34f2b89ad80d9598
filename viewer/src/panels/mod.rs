//! The panels: plain `ui` functions over view-model types.

pub mod checkpoint;
pub mod chunk_map;
pub mod controls;
pub mod fqn_map;
pub mod ranks;
pub mod shard_map;
pub mod tensor_tree;
pub mod timeline;
pub mod verify;
