//! The gather/flatten executor: FSDP's unshard path replayed on real data.
//!
//! Every rank loads its padded shards (cut from full parameters with the layout, or read as torch
//! saved them), copies them into its all-gather input exactly as FSDP does, all-gathers per unit,
//! copies the output back out into the original parameters and, on request, compares each one with
//! the checkpoint bit for bit. Every step is timed into a [`Trace`].
//!
//! - [`plan`]: the byte-level plan computed from core's layout.
//! - [`source`]: where shards come from (full checkpoint, synthetic data, rank-local tensors).
//! - [`ckpt`]: those sources over any checkpoint core's index reads (`.pt`, DCP, safetensors), lazily.
//! - [`engine`]: the per-rank loop every backend runs, over a small [`engine::Device`] trait.
//! - [`cpu`]: the `cpu` backend, N ranks as threads of one process with a real exchange.
//! - `faults` (tests): the engine on the `cpu` backend through a device that corrupts or fails.
//! - [`summary`]: per-unit bandwidth table (nccl-tests' algbw/busbw).
//! - `rendezvous` (feature `cuda`): the TCP exchange of the NCCL unique id for the `cuda` backend.
//! - `candle` (feature `candle`): the engine's device over candle tensors; without a GPU it runs on
//!   candle's CPU device with ranks as threads (what the default tests check).
//! - `cuda` (feature `cuda`): one process per GPU, the candle device on the GPU with NCCL.

#[cfg(feature = "candle")]
pub mod candle;
pub mod ckpt;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod engine;
#[cfg(test)]
mod faults;
pub mod output;
pub mod plan;
#[cfg(any(feature = "cuda", test))]
pub(crate) mod rendezvous;
pub mod source;
pub mod summary;

use std::collections::BTreeMap;

use serde::Serialize;
use shardscope_core::DType;

pub use plan::{GatherPlan, ParamPlan, ShardPlan, UnitPlan};
pub use source::{FullSource, RankSource, Source, SourceError};
pub use summary::Summary;

use crate::trace::Trace;

/// Why a gather failed (a mismatch found by `--verify` is not an error: see [`VerifyReport`]).
#[derive(Debug, thiserror::Error)]
pub enum GatherError {
    /// The plan cannot be built.
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    /// A rank could not load its shards or the verification reference.
    #[error("rank {rank}, unit `{unit}`")]
    Source {
        rank: u64,
        unit: String,
        #[source]
        source: Box<SourceError>,
    },
    /// A rank-local tensor has neither the padded nor the unpadded size the layout expects.
    #[error(
        "rank {rank}: `{key}` from {source_name} has {found_bytes} bytes; this layout expects {local_bytes} (unpadded) or {padded_bytes} (padded)"
    )]
    ShardSize {
        rank: u64,
        key: String,
        source_name: String,
        found_bytes: u64,
        local_bytes: u64,
        padded_bytes: u64,
    },
    /// A buffer would not fit in this machine's address space.
    #[error("unit `{unit}`: {bytes} bytes do not fit in memory on this machine")]
    TooLarge { unit: String, bytes: u64 },
    /// More ranks than the cpu backend runs as threads.
    #[error(
        "the cpu backend runs every rank as a thread; {world_size} ranks is more than the limit of {limit}"
    )]
    TooManyRanks { world_size: u64, limit: u64 },
    /// A rank thread panicked (a bug).
    #[error("rank {rank} thread panicked")]
    Panicked { rank: u64 },
    /// The GPU backend failed.
    #[error("{0}")]
    Device(String),
}

/// What the executor should do besides gathering.
#[derive(Debug, Clone, Copy, Default)]
pub struct GatherOptions {
    /// Compare every gathered parameter on every rank with the checkpoint.
    pub verify: bool,
    /// Return rank 0's gathered parameters (for `-o`).
    pub keep_params: bool,
}

/// Hooks into the executor (tests look at the copy-in buffers; the CLI drives its progress bar).
/// Called from the rank threads.
pub trait Observer: Sync {
    /// Whether the all-gather input and output should be downloaded for [`Observer::all_gather_input`]
    /// and [`Observer::all_gather_output`] on a device with its own memory (host-memory devices
    /// always call them).
    fn wants_device_buffers(&self) -> bool {
        false
    }
    /// A rank's padded shard, as loaded, before copy-in.
    fn shard(&self, _rank: u64, _unit: &UnitPlan, _shard: &ShardPlan, _bytes: &[u8]) {}
    /// A rank's all-gather input after copy-in.
    fn all_gather_input(&self, _rank: u64, _unit: &UnitPlan, _bytes: &[u8]) {}
    /// A rank's all-gather output.
    fn all_gather_output(&self, _rank: u64, _unit: &UnitPlan, _bytes: &[u8]) {}
    /// A parameter after copy-out.
    fn param(&self, _rank: u64, _param: &ParamPlan, _bytes: &[u8]) {}
    /// A rank finished a unit.
    fn unit_done(&self, _rank: u64, _unit_index: usize) {}
}

/// An observer that does nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoObserver;
impl Observer for NoObserver {}

/// A gathered parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatheredParam {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

/// One parameter that differs from the checkpoint on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    pub rank: u64,
    pub fqn: String,
    /// First differing byte.
    pub first_byte: u64,
    /// Number of differing elements.
    pub elements: u64,
}

/// The result of `--verify`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Parameter checks done (parameters × ranks).
    pub checks: u64,
    pub bytes_compared: u64,
    pub mismatches: Vec<Mismatch>,
    /// Parameters without a reference in the source (e.g. a tied alias not stored).
    pub unchecked: Vec<String>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.mismatches.is_empty()
    }

    fn merge(&mut self, other: VerifyReport) {
        self.checks += other.checks;
        self.bytes_compared += other.bytes_compared;
        self.mismatches.extend(other.mismatches);
        for u in other.unchecked {
            if !self.unchecked.contains(&u) {
                self.unchecked.push(u);
            }
        }
    }
}

/// Compares `got` with `want` element by element; `None` when equal.
fn compare(rank: u64, fqn: &str, es: usize, got: &[u8], want: &[u8]) -> Option<Mismatch> {
    if got == want {
        return None;
    }
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let elements = got
        .chunks(es.max(1))
        .zip(want.chunks(es.max(1)))
        .filter(|(a, b)| a != b)
        .count() as u64
        + (got.len().abs_diff(want.len()) / es.max(1)) as u64;
    Some(Mismatch {
        rank,
        fqn: fqn.to_owned(),
        first_byte: first as u64,
        elements,
    })
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct GatherOutcome {
    pub trace: Trace,
    pub summary: Summary,
    pub verify: Option<VerifyReport>,
    /// Rank 0's gathered parameters by FQN, tied aliases included (with `keep_params`).
    pub params: Option<BTreeMap<String, GatheredParam>>,
    /// True in the process that prints and writes outputs (always for `cpu`; rank 0 for `cuda`).
    pub writes_outputs: bool,
}
