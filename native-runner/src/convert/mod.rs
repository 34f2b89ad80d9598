//! The conversion engine behind `shardscope convert`: any indexed checkpoint (DCP directory, full
//! safetensors or `torch.save` file) to safetensors (one file or HF shards), to a `torch.save` file
//! nested as `dcp_to_torch_save` nests it, or to a DCP directory sharded for N ranks.
//!
//! # Streaming
//! The reads of each output file are jobs run by [`exec`] (`--threads` readers, `--memory-limit`,
//! written in order: the same bytes for any thread count); tensors stored as contiguous dim-0 slabs
//! are read by byte range ([`Reader::slab_pieces`]: 16 MiB pieces for safetensors, DCP output
//! chunks in place). Multi-file outputs can be split over processes with [`part`].
//!
//! The checkpoint is indexed through [`Input`] (a memory-mapped local file set, or range reads of a
//! remote one; only metadata and each DCP
//! item's small zip directory are touched there); tensor bytes are read with `pread` straight into
//! the job's buffer ([`Reader::tensor_as`], [`Reader::range_as`]): a dim-0 slab chunk (the FSDP
//! case, and every single-chunk tensor) lands at its place with one read and no intermediate copy;
//! other boxes go through a reusable scratch buffer. Buffers are pooled under the memory limit, and
//! page-cache pages of the input never count against the process (as they would when copying out
//! of the mmap).
//!
//! Per-rank folders go the same way: their index is read through a view first (FSDP2:
//! `shardscope_core::view::fsdp2` names the optimizer ids; FSDP1 with `--model`:
//! `shardscope_core::view::fsdp1` turns flat pieces into original parameters), as
//! `shardscope_core::checkpoint::Checkpoint::open` decides.

//!
//! One file per job: [`reader`] (positioned reads into buffers, slabs, box copies), [`select`]
//! (what is converted, tied aliases dropped), [`jobs`] (reads as executor jobs under the memory
//! limit), [`multi`] (atomic or `--part` multi-file outputs), [`values`] (non-tensor values as
//! Python values), [`mapped`] (an index in another naming: `--to hf`), [`surgery`] (`--rename`,
//! `--drop`, `--strip-wrappers`), [`manifest`] (`--write-manifest`: digests of the bytes as they are
//! written), and the writers [`to_safetensors`], [`to_torch_save`], [`to_dcp`],
//! [`to_fsdp1`], [`to_fsdp2`].

pub mod exec;
mod jobs;
pub mod manifest;
pub mod mapped;
mod multi;
pub mod part;
mod reader;
mod select;
pub mod surgery;
mod to_dcp;
pub mod to_fsdp1;
pub mod to_fsdp2;
mod to_safetensors;
mod to_torch_save;
mod values;

use std::path::Path;

use anyhow::{Result, bail};
use shardscope_core::index::CheckpointIndex;

pub use reader::{Reader, SlabPiece, tensor_meta};
pub use select::{drop_tied, own_prefix_left_out, own_prefix_warning, select};
pub use to_dcp::{ShardApi, to_dcp};
pub use to_safetensors::to_safetensors;
pub use to_torch_save::to_torch_save;

/// Fails unless the chunks of `index` (read from `src`) tile every tensor.
pub fn ensure_consistent(src: &Path, index: &CheckpointIndex) -> Result<()> {
    let problems = index.check();
    if let Some(first) = problems.first() {
        bail!(
            "{}: the checkpoint is inconsistent ({} problems; first: {first})\nhint: `shardscope inspect {}` lists them",
            src.display(),
            problems.len(),
            src.display()
        );
    }
    Ok(())
}

/// Something that hears how many tensor bytes were written.
pub trait Progress {
    fn advance(&self, bytes: u64);
}

/// What a conversion wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Written {
    /// The output paths (a file, or a directory and its files); with `--part`, what this process
    /// wrote.
    pub outputs: Vec<String>,
    pub tensors: usize,
    pub values: usize,
    pub tensor_bytes: u64,
    /// The largest tensor, which bounds the memory the conversion needs.
    pub largest_tensor_bytes: u64,
    /// The limit on tensor buffers alive at once that the executor ran under.
    pub memory_limit_bytes: u64,
    /// `--part`: whether this process wrote the index (the output is complete). Always true
    /// without `--part`.
    pub complete: bool,
    /// `--write-manifest`: where the output's content manifest was written.
    pub manifest: Option<String>,
    /// `--write-manifest`: files of the output the manifest has no digest of (a `.pt` whose storages
    /// were written in parts: their checksums are patched in after their bytes).
    pub undigested: Vec<String>,
}

/// How a conversion runs: the executor's threads and memory, and which part of a multi-process
/// conversion this process writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteOptions {
    pub exec: exec::ExecOptions,
    /// `--part R/N`: write the files `i % N == R` of a multi-file output (see [`part`]).
    pub part: Option<part::Part>,
    /// `--finalize`: write no data, only the index of a multi-part output whose parts are done.
    pub finalize_only: bool,
    /// `--write-manifest`: write the output's content manifest with this algorithm, from the bytes as
    /// they are written ([`manifest`]).
    pub manifest: Option<shardscope_core::manifest::Algorithm>,
}
