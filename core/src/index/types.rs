//! The canonical index types: entries, chunks, files, problems, errors.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::Serialize;

use crate::dtype::DType;
use crate::formats::dcp::{self, DcpError};
use crate::formats::safetensors::SafetensorsError;
use crate::formats::torch_zip::TorchZipError;
use crate::shape::Dims;
use crate::source::SourceError;

/// What went wrong while indexing or reading a checkpoint. Each names the file and key involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum IndexError {
    /// Reading from the source failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// A `torch.save` archive (a file or a DCP item) could not be read.
    #[error("{file}: {source}")]
    TorchZip {
        file: String,
        #[source]
        source: TorchZipError,
    },
    /// A safetensors file or index could not be read.
    #[error("{file}: {source}")]
    Safetensors {
        file: String,
        #[source]
        source: SafetensorsError,
    },
    /// The DCP `.metadata` could not be read.
    #[error("{}", dcp_error_text(file, source))]
    Dcp {
        file: String,
        #[source]
        source: DcpError,
    },
    /// Metadata refers to something that is not there or does not fit.
    #[error("{file}: {what}")]
    Inconsistent { file: String, what: String },
    /// The source holds no checkpoint this reader recognises.
    #[error("no checkpoint found: {reason}")]
    NotACheckpoint { reason: String },
    /// A folder holds several distinct checkpoints (e.g. `rank*_full.pt` and `rank*_optim.pt`).
    #[error("the folder holds {} different checkpoints: {}", groups.len(), groups.join(", "))]
    SeveralCheckpoints { groups: Vec<String> },
    /// A chunk's bytes do not decode to what the index says.
    #[error("{key}: chunk in {file} at bytes {offset}..{end}: {what}")]
    BadChunk {
        key: String,
        file: String,
        offset: u64,
        end: u64,
        what: String,
    },
    /// The entry has no values to read this way (bytes item, rank-local tensor without a global shape).
    #[error("{key}: {what}")]
    NotReadable { key: String, what: String },
    /// The checkpoint uses a feature shardscope cannot read (a DCP transform extension other than
    /// `stream.zstd/1`).
    #[error("{key} in {file}: {what}")]
    Unsupported {
        key: String,
        file: String,
        what: String,
    },
}

/// `file: reason` for a `.metadata` error, without saying `.metadata` twice (a [`DcpError`] names
/// the `.metadata` itself).
fn dcp_error_text(file: &str, source: &DcpError) -> String {
    let text = source.to_string();
    match text.strip_prefix(".metadata: ") {
        Some(rest) if file.ends_with(".metadata") => format!("{file}: {rest}"),
        _ => format!("{file}: {text}"),
    }
}

/// Bytes a DCP item's `torch.save` archive may hold besides the tensor's elements (zip headers,
/// pickle, records): bounds the decompression of `stream.zstd/1` tensor items.
pub const ITEM_ARCHIVE_OVERHEAD: u64 = 64 * 1024;

/// The most bytes a compressed DCP bytes item (a pickled non-tensor value) may decompress to.
pub const MAX_BYTES_ITEM: u64 = 64 << 20;

/// The on-disk format of the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `torch.distributed.checkpoint` directory.
    Dcp,
    /// One or more `torch.save` files.
    TorchSave,
    /// One or more safetensors files.
    Safetensors,
}

/// What kind of checkpoint the index looks like. Serialized as its name ([`CheckpointKind::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(into = "&'static str")]
pub enum CheckpointKind {
    /// A DCP directory with the default (`torch.save` items) serialization.
    DcpTorchSave,
    /// A DCP directory written with `SerializationFormat.SAFETENSORS`.
    DcpSafetensors,
    /// HF-style safetensors (one file, or sharded with an index), without DCP sharding info.
    HfSafetensors,
    /// Safetensors pieces with `DCP_SHARDING_INFO` (HuggingFaceStorageWriter, distributed).
    HfDistributedSafetensors,
    /// FSDP1 FULL_STATE_DICT per-rank files (every rank holds the same full tensors).
    Fsdp1Full,
    /// FSDP1 SHARDED_STATE_DICT (ShardedTensor, dim-0 chunks of each parameter).
    Fsdp1Sharded,
    /// FSDP1 LOCAL_STATE_DICT (ShardedTensor flat parameters `<unit>._flat_param`).
    Fsdp1Local,
    /// FSDP2 / DTensor state dicts.
    Fsdp2,
    /// FSDP1 per-rank files read through the model's layout: original parameters and FQN-keyed
    /// optimizer state (`core::view::fsdp1`).
    Fsdp1Unflattened,
    /// Per-rank optimizer state with rank-local (flat or per-parameter) pieces and no global metadata.
    RankLocal,
    /// A plain `torch.save` state dict.
    Plain,
    /// DeepSpeed ZeRO partitions (`global_stepN/`: model states and per-rank optimizer states),
    /// read as DeepSpeed's `zero_to_fp32` reads them (`index::read::deepspeed`).
    DeepSpeedZero { stage: u8, precision: ZeroPrecision },
    /// A DeepSpeed universal checkpoint (`ds_to_universal` output: a whole tensor per parameter
    /// and state under `zero/<name>/`) of a ZeRO `stage` save (`index::read::deepspeed::universal`).
    DeepSpeedUniversal { stage: u8 },
}

/// The training precision of a DeepSpeed ZeRO checkpoint (its master weights are fp32 in every
/// case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ZeroPrecision {
    Fp32,
    Bf16,
    Fp16,
}

impl From<CheckpointKind> for &'static str {
    fn from(kind: CheckpointKind) -> Self {
        kind.name()
    }
}

impl CheckpointKind {
    /// Its name in JSON (`inspect --json`, the Python module's `kind`): the variant in snake case;
    /// `deepspeed_zero1`, `deepspeed_zero2`, `deepspeed_zero3` for DeepSpeed.
    pub fn name(self) -> &'static str {
        match self {
            CheckpointKind::DcpTorchSave => "dcp_torch_save",
            CheckpointKind::DcpSafetensors => "dcp_safetensors",
            CheckpointKind::HfSafetensors => "hf_safetensors",
            CheckpointKind::HfDistributedSafetensors => "hf_distributed_safetensors",
            CheckpointKind::Fsdp1Full => "fsdp1_full",
            CheckpointKind::Fsdp1Sharded => "fsdp1_sharded",
            CheckpointKind::Fsdp1Local => "fsdp1_local",
            CheckpointKind::Fsdp2 => "fsdp2",
            CheckpointKind::Fsdp1Unflattened => "fsdp1_unflattened",
            CheckpointKind::RankLocal => "rank_local",
            CheckpointKind::Plain => "plain",
            CheckpointKind::DeepSpeedZero { stage: 1, .. } => "deepspeed_zero1",
            CheckpointKind::DeepSpeedZero { stage: 2, .. } => "deepspeed_zero2",
            CheckpointKind::DeepSpeedZero { stage: 3, .. } => "deepspeed_zero3",
            CheckpointKind::DeepSpeedZero { .. } => "deepspeed_zero",
            CheckpointKind::DeepSpeedUniversal { .. } => "deepspeed_universal",
        }
    }

    /// A phrase for people.
    pub fn describe(self) -> &'static str {
        match self {
            CheckpointKind::DcpTorchSave => "DCP (torch.distributed.checkpoint, torch.save items)",
            CheckpointKind::DcpSafetensors => {
                "DCP (torch.distributed.checkpoint, SAFETENSORS serialization)"
            }
            CheckpointKind::HfSafetensors => "HF safetensors",
            CheckpointKind::HfDistributedSafetensors => {
                "HF safetensors pieces with DCP sharding info"
            }
            CheckpointKind::Fsdp1Full => "FSDP1 FULL_STATE_DICT (full tensors on every rank)",
            CheckpointKind::Fsdp1Sharded => "FSDP1 SHARDED_STATE_DICT (ShardedTensor)",
            CheckpointKind::Fsdp1Local => "FSDP1 LOCAL_STATE_DICT (flat parameters)",
            CheckpointKind::Fsdp1Unflattened => {
                "FSDP1 per-rank files read through the model's layout (original parameters)"
            }
            CheckpointKind::Fsdp2 => "FSDP2 (DTensor)",
            CheckpointKind::RankLocal => {
                "per-rank local state (no global metadata, e.g. raw FSDP1 optimizer state)"
            }
            CheckpointKind::Plain => "plain torch.save state dict",
            CheckpointKind::DeepSpeedZero { stage, precision } => deepspeed_text(stage, precision),
            CheckpointKind::DeepSpeedUniversal { stage: 1 } => {
                "DeepSpeed universal checkpoint (ds_to_universal, from ZeRO stage 1)"
            }
            CheckpointKind::DeepSpeedUniversal { stage: 2 } => {
                "DeepSpeed universal checkpoint (ds_to_universal, from ZeRO stage 2)"
            }
            CheckpointKind::DeepSpeedUniversal { stage: 3 } => {
                "DeepSpeed universal checkpoint (ds_to_universal, from ZeRO stage 3)"
            }
            CheckpointKind::DeepSpeedUniversal { .. } => "DeepSpeed universal checkpoint",
        }
    }

    /// True for DeepSpeed's checkpoints (ZeRO folders and universal ones): the model is what
    /// `zero_to_fp32` gives, the optimizer state per parameter name beside it.
    pub fn is_deepspeed(self) -> bool {
        matches!(
            self,
            CheckpointKind::DeepSpeedZero { .. } | CheckpointKind::DeepSpeedUniversal { .. }
        )
    }
}

/// How [`CheckpointKind::describe`] names a DeepSpeed ZeRO checkpoint.
fn deepspeed_text(stage: u8, precision: ZeroPrecision) -> &'static str {
    use ZeroPrecision::{Bf16, Fp16, Fp32};
    match (stage, precision) {
        (1, Fp32) => "DeepSpeed ZeRO stage 1, fp32",
        (1, Bf16) => "DeepSpeed ZeRO stage 1, bf16 (fp32 master weights)",
        (1, Fp16) => "DeepSpeed ZeRO stage 1, fp16 (fp32 master weights)",
        (2, Fp32) => "DeepSpeed ZeRO stage 2, fp32",
        (2, Bf16) => "DeepSpeed ZeRO stage 2, bf16 (fp32 master weights)",
        (2, Fp16) => "DeepSpeed ZeRO stage 2, fp16 (fp32 master weights)",
        (3, Fp32) => "DeepSpeed ZeRO stage 3, fp32",
        (3, Bf16) => "DeepSpeed ZeRO stage 3, bf16 (fp32 master weights)",
        (3, Fp16) => "DeepSpeed ZeRO stage 3, fp16 (fp32 master weights)",
        _ => "DeepSpeed ZeRO",
    }
}

/// One step of an entry's nesting path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(untagged)]
pub enum PathSeg {
    Key(String),
    /// A list position (and, in a DCP, any integer step: torch's `dcp_to_torch_save` makes lists
    /// of them).
    Index(i64),
    /// An integer key of a dict (`torch.save` of an optimizer's `state_dict()`: `state` is keyed
    /// by parameter id): written back as a dict, never a list.
    IntKey(i64),
}

impl PathSeg {
    /// The integer of a list position or an integer dict key.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            PathSeg::Key(_) => None,
            PathSeg::Index(i) | PathSeg::IntKey(i) => Some(*i),
        }
    }
}

impl std::fmt::Display for PathSeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathSeg::Key(k) => f.write_str(k),
            PathSeg::Index(i) | PathSeg::IntKey(i) => write!(f, "{i}"),
        }
    }
}

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    Tensor,
    /// A non-tensor value stored as its own item (DCP bytes items): decoded on demand.
    Bytes,
    /// A non-tensor value held in the pickle itself (`torch.save` files).
    Scalar,
}

/// How a chunk's bytes are laid out in its byte range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "encoding", rename_all = "snake_case")]
pub enum ChunkEncoding {
    /// Raw little-endian elements: the byte range is a storage; the chunk is the view
    /// `storage[storage_offset + Σ i_d·strides_d]` (in elements).
    Raw {
        storage_offset: u64,
        strides: Vec<u64>,
    },
    /// The byte range is a complete `torch.save` archive holding the chunk (DCP default items).
    TorchSaveItem,
    /// The byte range is one zstd frame (DCP's `stream.zstd/1` transform extension) that
    /// decompresses to a complete `torch.save` archive holding the chunk.
    ZstdTorchSaveItem,
}

impl Chunk {
    /// The most bytes the chunk's data can decode to: its byte length, or for a compressed item
    /// the byte length times zstd's largest expansion. Allocations for reading it are capped by
    /// this.
    pub fn max_decoded_bytes(&self) -> u64 {
        match self.encoding {
            ChunkEncoding::ZstdTorchSaveItem => {
                self.byte_length.saturating_mul(dcp::ZSTD_MAX_EXPANSION)
            }
            ChunkEncoding::Raw { .. } | ChunkEncoding::TorchSaveItem => self.byte_length,
        }
    }
}

/// One stored piece of an entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// Where the piece starts in the global tensor.
    pub offsets: Dims,
    /// Its shape.
    pub sizes: Dims,
    /// The file holding it; the chunks of one file share the name.
    #[serde(serialize_with = "serialize_str")]
    pub file: Arc<str>,
    pub byte_offset: u64,
    pub byte_length: u64,
    /// The rank that wrote it, when the file name or format says.
    pub rank: Option<u32>,
    #[serde(flatten)]
    pub encoding: ChunkEncoding,
}

fn serialize_str<S: serde::Serializer>(s: &Arc<str>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(s)
}

impl Chunk {
    /// Elements in the chunk.
    pub fn numel(&self) -> Option<u64> {
        self.sizes.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }
}

/// What the format says about FSDP for an entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FsdpInfo {
    /// A `ShardedTensor` (FSDP1 SHARDED/LOCAL): the global shard table.
    ShardedTensor { shards: Vec<ShardPlacement> },
    /// A `DTensor` (FSDP2): its placements per mesh dim and the mesh shape.
    DTensor {
        placements: Vec<String>,
        mesh_shape: Option<Vec<u64>>,
    },
}

/// One row of a `ShardedTensor`'s global shard table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardPlacement {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub placement: Option<String>,
}

/// The role of an entry in an optimizer state dict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Role {
    /// `state[param][name]`; `param` is an int id (raw `optim.state_dict()`) or an FQN.
    OptimizerState { param: PathSeg, state: String },
    /// A leaf of `param_groups[i]`.
    ParamGroup { group: i64 },
}

/// One key of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IndexEntry {
    /// The flattened key as DCP writes it, or the (cleaned) state-dict key.
    pub key: String,
    /// The key as stored, when clean-up changed it (`_fsdp_wrapped_module.` removed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_key: Option<String>,
    /// The nesting of the key.
    pub path: Vec<PathSeg>,
    pub kind: EntryKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    /// The global shape; `None` for non-tensors and for rank-local tensors with no global
    /// metadata (raw optimizer state of FSDP1 flat parameters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    pub chunks: Vec<Chunk>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsdp: Option<FsdpInfo>,
    #[serde(skip_serializing_if = "Option::is_none", flatten)]
    pub role: Option<Role>,
    /// True when the key is an FSDP1 flat parameter (`…_flat_param`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub flat_param: bool,
    /// Scalars: the value; bytes items: filled in by [`CheckpointIndex::decode_bytes_values`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// Where the key comes in the order the checkpoint stores its keys (a `torch.save` dict's
    /// order, which is registration order for a state dict; `.metadata` order for DCP; header
    /// order for safetensors). Entries are sorted by key; this keeps what the sort loses.
    #[serde(skip)]
    pub position: Option<u64>,
    /// Scalars of `torch.save` files: the value as the pickle holds it (tuples stay tuples), for
    /// writers that re-pickle it; `value` is its JSON form.
    #[serde(skip)]
    pub object: Option<Box<crate::formats::pickle::PyValue>>,
}

impl IndexEntry {
    /// Elements of the global tensor.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .as_ref()
            .and_then(|s| s.iter().try_fold(1u64, |a, &d| a.checked_mul(d)))
    }

    /// Bytes of the global tensor.
    pub fn nbytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype?.size_bytes() as u64)
    }

    /// The distinct ranks holding chunks.
    pub fn ranks(&self) -> BTreeSet<u32> {
        // Runs of one rank are collapsed first (chunks come grouped by file), so the set is not
        // built from every chunk of a million-chunk checkpoint.
        let mut runs: Vec<u32> = Vec::new();
        for r in self.chunks.iter().filter_map(|c| c.rank) {
            if runs.last() != Some(&r) {
                runs.push(r);
            }
        }
        runs.into_iter().collect()
    }
}

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileInfo {
    pub size: u64,
    pub rank: Option<u32>,
    /// Storage bytes no tensor view refers to (FSDP1 LOCAL files keep the padded flat storage).
    #[serde(skip_serializing_if = "is_zero")]
    pub unreferenced_bytes: u64,
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// DCP-specific facts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DcpFacts {
    pub version: Option<String>,
    pub checkpoint_id: Option<String>,
    pub save_id: Option<String>,
    /// The globals `.metadata` names (for doctor's `unsafe-pickle`; not in `inspect --json`).
    #[serde(skip)]
    pub metadata_globals: Vec<crate::formats::pickle::Global>,
    /// The keys of `.metadata`'s state-dict metadata as stored, in its order (the stored key
    /// order of [`crate::index::from_index::stored_key_order`], without reading the file again;
    /// not in `inspect --json`).
    #[serde(skip)]
    pub stored_keys: Arc<[String]>,
}

/// The canonical index of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointIndex {
    pub format: Format,
    pub kind: CheckpointKind,
    /// True when entries hold optimizer state (`state`/`param_groups`).
    pub has_optimizer_state: bool,
    /// Entries sorted by key.
    pub entries: Vec<IndexEntry>,
    pub files: BTreeMap<String, FileInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dcp: Option<DcpFacts>,
}

/// A violation of the checkpoint's own promises, found by [`CheckpointIndex::check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub key: String,
    pub file: Option<String>,
    pub byte_range: Option<(u64, u64)>,
    pub what: String,
}

/// How a coverage gap is worded in [`Problem::what`].
pub(crate) const GAP_NOTE: &str = "(a gap: some part of the tensor is stored nowhere)";

impl Problem {
    /// A part of the tensor that no chunk holds (as opposed to an overlap or a bad byte range).
    pub fn is_gap(&self) -> bool {
        self.what.ends_with(GAP_NOTE)
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.what)?;
        if let Some(file) = &self.file {
            write!(f, " (in {file}")?;
            if let Some((a, b)) = self.byte_range {
                write!(f, ", bytes {a}..{b}")?;
            }
            write!(f, ")")?;
        }
        Ok(())
    }
}

impl CheckpointIndex {
    /// The entry with this key.
    pub fn entry(&self, key: &str) -> Option<&IndexEntry> {
        self.entries
            .binary_search_by(|e| e.key.as_str().cmp(key))
            .ok()
            .map(|i| &self.entries[i])
    }
}
