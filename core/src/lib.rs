//! `shardscope-core`: read, understand, convert and verify sharded PyTorch (FSDP, DCP) checkpoints
//! without Python or torch.
//!
//! Levels: `formats::*` turns bytes into raw records; `model::*` holds the canonical types the rest
//! of the code uses; `layout` computes FSDP layouts exactly as PyTorch does. This crate does no file
//! I/O at its centre and builds for `wasm32-unknown-unknown`.

pub mod cast;
pub mod checkpoint;
pub mod doctor;
pub mod dtype;
pub mod formats;
pub mod layout;
pub mod model;
pub mod source;
pub mod transform;
pub mod verify;

pub use dtype::DType;
pub use source::{MemorySource, Source, SourceError};
