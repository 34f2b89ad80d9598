//! `shardscope-core`: read, understand, convert and verify sharded PyTorch (FSDP, DCP) checkpoints
//! without Python or torch.
//!
//! Layers, each importing only from its own layer or those below (`tests/layers.rs` checks it):
//! 1. basic types: [`dtype`], [`shape`] (array arithmetic), [`source`], [`cast`], [`model`] (the model
//!    description, FQN rules, value trees);
//! 2. [`formats`]: bytes in, raw records out (and back);
//! 3. [`index`] (the canonical checkpoint index, ties, descriptions from an index) and [`bridge`]
//!    (`torch.save` archives ⇄ value trees);
//! 4. [`layout`]: FSDP layouts exactly as PyTorch computes them, and what follows from them alone;
//! 5. [`view`]: per-rank indexes re-keyed through a layout, layout hints;
//! 6. [`checkpoint`] (`Checkpoint::open`: how every front end reads a checkpoint), [`transform`],
//!    [`verify`], [`doctor`].
//!
//! This crate does no file I/O at its centre and builds for `wasm32-unknown-unknown`.

pub mod cast;
pub mod dtype;
pub mod model;
pub mod shape;
pub mod source;

pub mod formats;

pub mod bridge;
pub mod index;

pub mod layout;

pub mod view;

pub mod checkpoint;
pub mod doctor;
/// Content manifests: per-tensor digests of logical values (`shardscope hash`).
pub mod manifest;
pub mod transform;
pub mod verify;

pub use dtype::DType;
pub use source::{MemorySource, Source, SourceError};
