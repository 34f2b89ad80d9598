//! The canonical checkpoint index: one type for every format.
//!
//! [`index_source`] turns a [`Source`] (a DCP directory, a folder of per-rank `torch.save` files,
//! sharded safetensors, or one file) into a [`CheckpointIndex`]: every entry's key path, kind,
//! dtype, global shape and chunks (offsets, sizes, file, byte range, writing rank), plus what the
//! format says about FSDP. Tensor bytes are never read while indexing; [`CheckpointIndex::read_chunk`]
//! and [`CheckpointIndex::read_tensor`] read values on demand. Format quirks end here.

pub mod from_index;
pub mod ties;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use crate::dtype::DType;
use crate::formats::dcp::{self, DcpError, ItemMeta, PlannerStep};
use crate::formats::pickle::{Placement, PyValue, StorageRef, TensorRef};
use crate::formats::safetensors::{self as st, SafetensorsError};
use crate::formats::torch_zip::{self, TorchZipError};
use crate::model::fqn::clean_tensor_name;
use crate::source::{Source, SourceError};

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

/// What kind of checkpoint the index looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
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
}

impl CheckpointKind {
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
        }
    }
}

/// One step of an entry's nesting path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(untagged)]
pub enum PathSeg {
    Key(String),
    Index(i64),
}

impl std::fmt::Display for PathSeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathSeg::Key(k) => f.write_str(k),
            PathSeg::Index(i) => write!(f, "{i}"),
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
    pub offsets: Vec<u64>,
    /// Its shape.
    pub sizes: Vec<u64>,
    pub file: String,
    pub byte_offset: u64,
    pub byte_length: u64,
    /// The rank that wrote it, when the file name or format says.
    pub rank: Option<u32>,
    #[serde(flatten)]
    pub encoding: ChunkEncoding,
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
        self.chunks.iter().filter_map(|c| c.rank).collect()
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
const GAP_NOTE: &str = "(a gap: some part of the tensor is stored nowhere)";

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

// ---------------------------------------------------------------------------------------------
// Building.

fn file_ext(name: &str) -> &str {
    name.rsplit('/')
        .next()
        .unwrap_or(name)
        .rsplit_once('.')
        .map_or("", |(_, e)| e)
}

/// A `torch.save` file by its extension (`.pt`, `.pth`, `.bin`, `.ckpt`, `.tar`).
pub fn is_torch_file(name: &str) -> bool {
    matches!(file_ext(name), "pt" | "pth" | "bin" | "ckpt" | "tar")
}

/// The rank in a per-rank file name (`rank3_model.pt`, `model_rank_3.pt`, `shard-00004-…`), and
/// the name with the rank replaced by `{R}` (files of one checkpoint share it).
pub fn rank_from_name(name: &str) -> (Option<u32>, String) {
    let base = name.rsplit('/').next().unwrap_or(name);
    // HF distributed pieces: shard-0000R-model-…, 1-based.
    if let Some(rest) = base.strip_prefix("shard-")
        && let Some((digits, tail)) = rest.split_once('-')
        && let Ok(r) = digits.parse::<u32>()
    {
        return (r.checked_sub(1), format!("shard-{{R}}-{tail}"));
    }
    let lower = base.to_ascii_lowercase();
    let pos = lower.find("rank").map(|p| p + 4);
    let bytes = base.as_bytes();
    let find_digits = |from: usize| -> Option<(usize, usize)> {
        let start = (from..bytes.len()).find(|&i| bytes[i].is_ascii_digit())?;
        let end = (start..bytes.len())
            .find(|&i| !bytes[i].is_ascii_digit())
            .unwrap_or(bytes.len());
        Some((start, end))
    };
    let span = match pos {
        Some(p) => {
            let skip = (p..bytes.len())
                .find(|&i| bytes[i] != b'_' && bytes[i] != b'-')
                .unwrap_or(p);
            if bytes.get(skip).is_some_and(u8::is_ascii_digit) {
                find_digits(skip)
            } else {
                None
            }
        }
        None => None,
    };
    match span {
        Some((s, e)) => {
            let r = base[s..e].parse::<u32>().ok();
            (r, format!("{}{{R}}{}", &base[..s], &base[e..]))
        }
        None => (None, base.to_owned()),
    }
}

/// One set of per-rank files: names that differ only in the rank number (see
/// [`group_rank_files`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGroup {
    /// The file name (without its folder) with the rank replaced by `{R}`; for a file that is not
    /// part of a per-rank set, its name.
    pub pattern: String,
    /// The files with their ranks (`None`: no rank in the name), in rank order.
    pub files: Vec<(String, Option<u32>)>,
}

/// Files with their ranks, as in [`RankGroup::files`].
pub type RankedFiles = Vec<(String, Option<u32>)>;

/// Names of one folder with the same text between their numbers, keyed by (folder, texts).
type NameClasses<'a> = BTreeMap<(String, Vec<String>), Vec<(&'a String, NameShape<'a>)>>;

/// A file name cut at its decimal numbers: the text between them and the numbers.
struct NameShape<'a> {
    dir: &'a str,
    texts: Vec<&'a str>,
    numbers: Vec<&'a str>,
}

fn name_shape(name: &str) -> NameShape<'_> {
    let (dir, base) = match name.rfind('/') {
        Some(i) => (&name[..=i], &name[i + 1..]),
        None => ("", name),
    };
    let bytes = base.as_bytes();
    let mut texts = Vec::new();
    let mut numbers = Vec::new();
    let mut text_start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            texts.push(&base[text_start..start]);
            numbers.push(&base[start..i]);
            text_start = i;
        } else {
            i += 1;
        }
    }
    texts.push(&base[text_start..]);
    NameShape {
        dir,
        texts,
        numbers,
    }
}

/// A number that can stand for `{R}`: written as `R.to_string()` writes it (`01` is not rank 1).
fn canonical_rank(digits: &str) -> Option<u32> {
    let r: u32 = digits.parse().ok()?;
    (r.to_string() == digits).then_some(r)
}

impl NameShape<'_> {
    /// The base name with number `at` replaced by `{R}`.
    fn pattern(&self, at: usize) -> String {
        let mut s = String::new();
        for (i, text) in self.texts.iter().enumerate() {
            s.push_str(text);
            if let Some(n) = self.numbers.get(i) {
                s.push_str(if i == at { "{R}" } else { n });
            }
        }
        s
    }
}

/// Groups file names into per-rank sets. Names that have the same text and differ in exactly one
/// number form a set whose ranks are that number (`model_{R}.pt`, `ckpt_{R}_model.pt`,
/// `model_rank{R}_of_3.pt`, `m{R}_ws3.pt`: numbers that are the same across the set are not the
/// rank). Where several numbers vary, the number that splits the names into sets of ranks
/// `0..N` each is the rank (`model_world_size_{2,3}_rank_{R}.pt`), the one after `rank` first.
/// A single varying number whose values leave small gaps still forms a set (ranks 0 and 2: rank 1
/// is missing, which the index reports as a gap rather than reading two unrelated files). Other
/// names keep the rule of [`rank_from_name`] (the number after `rank`). Groups come in name order.
pub fn group_rank_files(names: &[String]) -> Vec<RankGroup> {
    let mut classes: NameClasses<'_> = BTreeMap::new();
    for name in names {
        let shape = name_shape(name);
        let key = (
            shape.dir.to_owned(),
            shape.texts.iter().map(|t| (*t).to_owned()).collect(),
        );
        classes.entry(key).or_default().push((name, shape));
    }
    let mut groups: BTreeMap<(String, String), RankedFiles> = BTreeMap::new();
    let mut add = |dir: &str, pattern: String, name: &str, rank: Option<u32>| {
        groups
            .entry((dir.to_owned(), pattern))
            .or_default()
            .push((name.to_owned(), rank));
    };
    for ((dir, texts), members) in classes {
        let count = members[0].1.numbers.len();
        let varying: Vec<usize> = (0..count)
            .filter(|&i| {
                members
                    .iter()
                    .any(|(_, s)| s.numbers[i] != members[0].1.numbers[i])
            })
            .collect();
        // Candidates for the rank: the number after `rank` first, then from the last one.
        let mut candidates = varying.clone();
        candidates.reverse();
        candidates.sort_by_key(|&i| {
            !texts[i].to_ascii_lowercase().ends_with("rank")
                && !texts[i]
                    .to_ascii_lowercase()
                    .trim_end_matches(['_', '-'])
                    .ends_with("rank")
        });
        let split = |at: usize| -> Option<BTreeMap<Vec<&str>, Vec<u32>>> {
            let mut sets: BTreeMap<Vec<&str>, Vec<u32>> = BTreeMap::new();
            for (_, s) in &members {
                let rest: Vec<&str> = (0..count)
                    .filter(|&i| i != at)
                    .map(|i| s.numbers[i])
                    .collect();
                sets.entry(rest)
                    .or_default()
                    .push(canonical_rank(s.numbers[at])?);
            }
            Some(sets)
        };
        let full = candidates.iter().copied().find(|&at| {
            split(at).is_some_and(|sets| {
                sets.into_values().all(|mut ranks| {
                    ranks.sort_unstable();
                    ranks.iter().copied().eq(0..ranks.len() as u32)
                })
            })
        });
        let gapped = || match varying.as_slice() {
            [at] => split(*at).and_then(|sets| {
                let ranks = sets.into_values().next()?;
                let last = *ranks.iter().max()?;
                let mut distinct = ranks.clone();
                distinct.sort_unstable();
                distinct.dedup();
                (distinct.len() == ranks.len() && u64::from(last) < 4 * ranks.len() as u64)
                    .then_some(*at)
            }),
            _ => None,
        };
        match full.or_else(gapped) {
            Some(at) => {
                for (name, s) in &members {
                    add(&dir, s.pattern(at), name, canonical_rank(s.numbers[at]));
                }
            }
            None => {
                for (name, _) in &members {
                    let (rank, pattern) = rank_from_name(name);
                    add(&dir, pattern, name, rank);
                }
            }
        }
    }
    groups
        .into_iter()
        .map(|((_, pattern), mut files)| {
            files.sort_by_key(|(name, rank)| (*rank, name.clone()));
            RankGroup { pattern, files }
        })
        .collect()
}

/// Indexes whatever checkpoint the source holds.
pub fn index_source(source: &dyn Source) -> Result<CheckpointIndex, IndexError> {
    index_source_sets(source).map(|(index, _)| index)
}

/// A per-rank set of files read into an index, with the class of what it holds ([`set_class`]).
pub type ReadSet = (RankGroup, &'static str);

/// [`index_source`], also giving the per-rank sets of `torch.save` files it read (none for a DCP
/// directory or safetensors files).
pub fn index_source_sets(
    source: &dyn Source,
) -> Result<(CheckpointIndex, Vec<ReadSet>), IndexError> {
    let names = source.names();
    if names
        .iter()
        .any(|n| n == ".metadata" || n.ends_with("/.metadata"))
    {
        let meta = names
            .iter()
            .find(|n| n.as_str() == ".metadata")
            .or_else(|| names.iter().find(|n| n.ends_with("/.metadata")))
            .cloned()
            .unwrap_or_default();
        return Ok((index_dcp(source, &meta)?, Vec::new()));
    }
    let safetensors: Vec<&String> = names
        .iter()
        .filter(|n| file_ext(n) == "safetensors")
        .collect();
    let torch: Vec<&String> = names.iter().filter(|n| is_torch_file(n)).collect();
    if !safetensors.is_empty() && torch.is_empty() {
        return Ok((index_safetensors(source, &names)?, Vec::new()));
    }
    if !torch.is_empty() && safetensors.is_empty() {
        let torch: Vec<String> = torch.into_iter().cloned().collect();
        let groups = group_rank_files(&torch);
        let (index, classes) = index_torch_sets(source, &groups)?;
        return Ok((index, groups.into_iter().zip(classes).collect()));
    }
    if names.is_empty() {
        return Err(IndexError::NotACheckpoint {
            reason: "the source is empty".into(),
        });
    }
    Err(IndexError::NotACheckpoint {
        reason: if safetensors.is_empty() {
            format!(
                "no .metadata, .safetensors or torch.save (.pt/.pth/.bin) files among {} files",
                names.len()
            )
        } else {
            "the folder mixes safetensors and torch.save files".into()
        },
    })
}

// ----- torch.save files -------------------------------------------------------------------------

struct Leaf<'a> {
    path: Vec<PathSeg>,
    value: &'a PyValue,
}

fn path_seg_of_key(k: &PyValue) -> Option<PathSeg> {
    match k {
        PyValue::Str(s) => Some(PathSeg::Key(s.clone())),
        PyValue::Int(i) => Some(PathSeg::Index(*i)),
        PyValue::Bool(b) => Some(PathSeg::Key(if *b { "True" } else { "False" }.into())),
        _ => None,
    }
}

fn is_tensorish(v: &PyValue) -> bool {
    matches!(
        v,
        PyValue::Tensor(_) | PyValue::ShardedTensor(_) | PyValue::DTensor(_)
    )
}

/// DCP's traversal: mappings are always descended; a list/tuple is descended when it holds a
/// tensor or a container; everything else is a leaf.
fn flatten<'a>(v: &'a PyValue, path: &mut Vec<PathSeg>, out: &mut Vec<Leaf<'a>>) {
    match v {
        PyValue::Dict(items) if items.iter().all(|(k, _)| path_seg_of_key(k).is_some()) => {
            for (k, val) in items {
                if let Some(seg) = path_seg_of_key(k) {
                    path.push(seg);
                    flatten(val, path, out);
                    path.pop();
                }
            }
        }
        PyValue::List(items) | PyValue::Tuple(items)
            if items.iter().any(|i| {
                is_tensorish(i)
                    || matches!(i, PyValue::Dict(_) | PyValue::List(_) | PyValue::Tuple(_))
            }) =>
        {
            for (i, val) in items.iter().enumerate() {
                path.push(PathSeg::Index(i as i64));
                flatten(val, path, out);
                path.pop();
            }
        }
        _ => out.push(Leaf {
            path: path.clone(),
            value: v,
        }),
    }
}

fn join_path(path: &[PathSeg]) -> String {
    path.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

fn clean_path(path: &[PathSeg]) -> Vec<PathSeg> {
    path.iter()
        .map(|s| match s {
            PathSeg::Key(k) => PathSeg::Key(
                clean_tensor_name(&format!("{k}."))
                    .trim_end_matches('.')
                    .to_owned(),
            ),
            PathSeg::Index(i) => PathSeg::Index(*i),
        })
        .collect()
}

/// A Python value as JSON (for scalars and decoded bytes items).
pub fn json_of(v: &PyValue) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        PyValue::None => J::Null,
        PyValue::Bool(b) => J::Bool(*b),
        PyValue::Int(i) => J::from(*i),
        PyValue::BigInt(b) => J::String(format!("<int of {} bytes>", b.len())),
        PyValue::Float(f) => {
            serde_json::Number::from_f64(*f).map_or_else(|| J::String(f.to_string()), J::Number)
        }
        PyValue::Str(s) => J::String(s.clone()),
        PyValue::Bytes(b) => J::String(format!("<{} bytes>", b.len())),
        PyValue::Tuple(items) | PyValue::List(items) | PyValue::Set(items) => {
            J::Array(items.iter().map(json_of).collect())
        }
        PyValue::Dict(items) => {
            if items.iter().all(|(k, _)| path_seg_of_key(k).is_some()) {
                J::Object(
                    items
                        .iter()
                        .filter_map(|(k, v)| {
                            path_seg_of_key(k).map(|s| (s.to_string(), json_of(v)))
                        })
                        .collect(),
                )
            } else {
                J::Array(
                    items
                        .iter()
                        .map(|(k, v)| J::Array(vec![json_of(k), json_of(v)]))
                        .collect(),
                )
            }
        }
        PyValue::Global(g) => J::String(g.to_string()),
        PyValue::DType(d) => J::String(d.torch_name()),
        PyValue::Size(s) => J::Array(s.iter().map(|&d| J::from(d)).collect()),
        other => J::String(format!("<{}>", other.type_name())),
    }
}

fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    strides
}

fn raw_chunk(
    file: &str,
    rank: Option<u32>,
    archive: &torch_zip::TorchArchive,
    t: &TensorRef,
    offsets: Vec<u64>,
) -> Result<Chunk, IndexError> {
    let range = archive
        .storage_range(t)
        .map_err(|source| IndexError::TorchZip {
            file: file.to_owned(),
            source,
        })?;
    Ok(Chunk {
        offsets,
        sizes: t.shape.clone(),
        file: file.to_owned(),
        byte_offset: range.offset,
        byte_length: range.len,
        rank,
        encoding: ChunkEncoding::Raw {
            storage_offset: t.storage_offset,
            strides: t.stride.clone(),
        },
    })
}

/// §4.4: the local shape and global offset of mesh coordinate `coord` under `placements`.
fn dtensor_offsets(
    global: &[u64],
    placements: &[Placement],
    mesh: &[u64],
    coord: &[u64],
) -> Option<Vec<u64>> {
    let mut local: Vec<u64> = global.to_vec();
    let mut offsets = vec![0u64; global.len()];
    for (i, p) in placements.iter().enumerate() {
        match p {
            Placement::Replicate | Placement::Partial { .. } => {}
            Placement::Shard { dim } => {
                let tensor_dim = usize::try_from(if *dim < 0 {
                    *dim + global.len() as i64
                } else {
                    *dim
                })
                .ok()?;
                let mesh_size = *mesh.get(i)?;
                let coordinate = *coord.get(i)?;
                let current = *local.get(tensor_dim)?;
                if mesh_size == 0 {
                    return None;
                }
                let (size, offset) = if current % mesh_size == 0 {
                    (current / mesh_size, coordinate * (current / mesh_size))
                } else {
                    let full_chunk = current.div_ceil(mesh_size);
                    let start = full_chunk * coordinate;
                    if start >= current {
                        (0, current)
                    } else {
                        (current.min(start + full_chunk) - start, start)
                    }
                };
                local[tensor_dim] = size;
                offsets[tensor_dim] += offset;
            }
            Placement::StridedShard { .. } | Placement::Other { .. } => return None,
        }
    }
    Some(offsets)
}

struct Partial {
    entry: IndexEntry,
    /// Per rank: the local shape of a plain tensor (to tell replicated from rank-local).
    plain_shapes: Vec<Vec<u64>>,
}

/// Indexes one or more per-rank `torch.save` files of the same checkpoint.
/// A folder of several sets of per-rank files, as training runs write them (model, optimizer and
/// extra state, e.g. `model_world_size_2_rank_{r}.pt`, `optim_…`, `extra_state_…`): one checkpoint
/// with a subtree per set, as a DCP app state nests them. Each set is classified by its content:
/// `optim` (optimizer state: `state`/`param_groups`), `model` (floating-point tensors), `extra`
/// (the rest: schedulers, RNG state); two sets of one class are told apart by their name patterns
/// (`model.rank{R}_full`, `model.rank{R}_sharded`, ...). Every set must index on its own.
/// Indexes `torch.save` files grouped into per-rank sets ([`group_rank_files`], or the sets a
/// caller names): one set is read as one checkpoint; several become subtrees named by what they
/// hold (`model`, `optim`, `extra`).
pub fn index_torch_groups(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<CheckpointIndex, IndexError> {
    index_torch_sets(source, groups).map(|(index, _)| index)
}

/// What one per-rank set of `torch.save` files holds, judged by its content: optimizer state
/// (`state`/`param_groups`), a model (floating-point tensors), or extra state (anything else:
/// lr scheduler, RNG state, counters).
pub fn set_class(index: &CheckpointIndex) -> &'static str {
    if index.has_optimizer_state || index.entries.iter().any(|e| e.role.is_some()) {
        "optim"
    } else if index
        .entries
        .iter()
        .any(|e| e.kind == EntryKind::Tensor && e.dtype.is_some_and(DType::is_floating_point))
    {
        "model"
    } else {
        "extra"
    }
}

/// [`index_torch_groups`], also giving each set's class ([`set_class`]) in `groups` order. With
/// several sets, each is a subtree named by its class (`model`, `optim`, `extra`; by class and
/// name pattern when a class has several sets).
pub fn index_torch_sets(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<(CheckpointIndex, Vec<&'static str>), IndexError> {
    match groups {
        [] => Err(IndexError::NotACheckpoint {
            reason: "no torch.save files".into(),
        }),
        [one] => {
            let index = index_torch_files_ranked(source, &one.files)?;
            let class = set_class(&index);
            Ok((index, vec![class]))
        }
        _ => index_file_sets(source, groups),
    }
}

fn index_file_sets(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<(CheckpointIndex, Vec<&'static str>), IndexError> {
    let mut parts = Vec::with_capacity(groups.len());
    for RankGroup { pattern, files } in groups {
        let index = index_torch_files_ranked(source, files)?;
        parts.push((set_class(&index), pattern.clone(), index));
    }
    let classes: Vec<&'static str> = parts.iter().map(|(c, _, _)| *c).collect();
    let count = |class: &str| parts.iter().filter(|(c, _, _)| *c == class).count();
    let names: Vec<String> = parts
        .iter()
        .map(|(class, pattern, _)| {
            if count(class) == 1 {
                (*class).to_owned()
            } else {
                // The set's name pattern without its extension, one path segment.
                let stem = pattern
                    .rsplit_once('.')
                    .map_or(pattern.as_str(), |(s, _)| s);
                format!("{class}.{}", stem.replace('.', "_"))
            }
        })
        .collect();
    let kind = parts
        .iter()
        .find(|(c, _, _)| *c == "model")
        .or(parts.first())
        .map_or(CheckpointKind::Plain, |(_, _, i)| i.kind);
    let mut merged = CheckpointIndex {
        format: parts
            .first()
            .map_or(Format::TorchSave, |(_, _, i)| i.format),
        kind,
        has_optimizer_state: parts.iter().any(|(_, _, i)| i.has_optimizer_state),
        entries: Vec::new(),
        files: BTreeMap::new(),
        dcp: None,
    };
    for ((_, _, index), name) in parts.into_iter().zip(names) {
        let prefix: Vec<PathSeg> = name
            .split('.')
            .map(|s| PathSeg::Key(s.to_owned()))
            .collect();
        let base = merged.entries.len() as u64;
        for mut e in index.entries {
            e.position = e.position.map(|p| p + base);
            e.key = format!("{name}.{}", e.key);
            e.raw_key = e.raw_key.map(|k| format!("{name}.{k}"));
            e.path.splice(0..0, prefix.iter().cloned());
            merged.entries.push(e);
        }
        merged.files.extend(index.files);
    }
    merged.entries.sort_by(|a, b| a.key.cmp(&b.key));
    Ok((merged, classes))
}

/// Indexes `torch.save` files as one checkpoint, their ranks read from their names
/// ([`group_rank_files`]).
pub fn index_torch_files(
    source: &dyn Source,
    files: &[String],
) -> Result<CheckpointIndex, IndexError> {
    let ranks: HashMap<String, Option<u32>> = group_rank_files(files)
        .into_iter()
        .flat_map(|g| g.files)
        .collect();
    let ranked: Vec<(String, Option<u32>)> = files
        .iter()
        .map(|f| (f.clone(), ranks.get(f).copied().flatten()))
        .collect();
    index_torch_files_ranked(source, &ranked)
}

/// Indexes `torch.save` files as one checkpoint, each with its rank.
#[allow(
    clippy::too_many_lines,
    reason = "indexes every torch.save entry kind (tensors, ShardedTensor, DTensor, rank-local pieces, values) from one pass"
)]
pub fn index_torch_files_ranked(
    source: &dyn Source,
    files: &[(String, Option<u32>)],
) -> Result<CheckpointIndex, IndexError> {
    let mut merged: BTreeMap<String, Partial> = BTreeMap::new();
    let mut file_infos = BTreeMap::new();
    let mut saw_sharded = false;
    let mut saw_dtensor = false;
    let mut saw_flat = false;
    let many = files.len() > 1;
    for (file, rank) in files {
        let rank = rank.or(if many { None } else { Some(0) });
        // By range: the zip directory, local headers and data.pkl, not the tensor bytes.
        let archive = torch_zip::read_archive_from(source, file).map_err(|e| match e {
            torch_zip::ArchiveFileError::Source(e) => IndexError::from(e),
            torch_zip::ArchiveFileError::Archive(source) => IndexError::TorchZip {
                file: file.clone(),
                source,
            },
        })?;
        let mut leaves = Vec::new();
        flatten(&archive.root, &mut Vec::new(), &mut leaves);
        for leaf in leaves {
            let raw_key = join_path(&leaf.path);
            let path = clean_path(&leaf.path);
            let key = join_path(&path);
            let flat_param = key.ends_with("_flat_param");
            let mut chunks = Vec::new();
            let mut plain_shape = None;
            let mut object = None;
            let (kind, dtype, shape, fsdp, value) = match leaf.value {
                PyValue::Tensor(t) => {
                    chunks.push(raw_chunk(file, rank, &archive, t, vec![0; t.shape.len()])?);
                    plain_shape = Some(t.shape.clone());
                    (
                        EntryKind::Tensor,
                        Some(t.storage.dtype),
                        Some(t.shape.clone()),
                        None,
                        None,
                    )
                }
                PyValue::ShardedTensor(s) => {
                    saw_sharded = true;
                    saw_flat |= flat_param;
                    for ls in &s.local_shards {
                        chunks.push(raw_chunk(
                            file,
                            rank,
                            &archive,
                            &ls.tensor,
                            ls.offsets.clone(),
                        )?);
                    }
                    let info = FsdpInfo::ShardedTensor {
                        shards: s
                            .shards
                            .iter()
                            .map(|m| ShardPlacement {
                                offsets: m.offsets.clone(),
                                sizes: m.sizes.clone(),
                                placement: m.placement.clone(),
                            })
                            .collect(),
                    };
                    (
                        EntryKind::Tensor,
                        Some(s.dtype),
                        Some(s.global_shape.clone()),
                        Some(info),
                        None,
                    )
                }
                PyValue::DTensor(d) => {
                    saw_dtensor = true;
                    // Without a readable mesh, a 1-D mesh over the given rank files.
                    let mesh = d
                        .mesh_shape
                        .clone()
                        .unwrap_or_else(|| vec![files.len() as u64; d.placements.len()]);
                    let coord = d
                        .mesh_coordinate
                        .clone()
                        .or_else(|| rank.map(|r| vec![u64::from(r)]))
                        .unwrap_or_default();
                    let offsets = dtensor_offsets(&d.global_shape, &d.placements, &mesh, &coord).ok_or_else(|| {
                        IndexError::Unsupported {
                            key: key.clone(),
                            file: file.clone(),
                            what: format!(
                                "cannot place the DTensor's local piece (placements {:?}, mesh {mesh:?}, coordinate {coord:?}): per-rank DTensor files are read for Shard(0) and Replicate placements (FSDP2, HSDP); tensor-parallel and _StridedShard placements are read from DCP checkpoints (dcp.save)",
                                d.placements
                            ),
                        }
                    })?;
                    chunks.push(raw_chunk(file, rank, &archive, &d.local, offsets)?);
                    let info = FsdpInfo::DTensor {
                        placements: d.placements.iter().map(ToString::to_string).collect(),
                        mesh_shape: d.mesh_shape.clone(),
                    };
                    (
                        EntryKind::Tensor,
                        Some(d.dtype),
                        Some(d.global_shape.clone()),
                        Some(info),
                        None,
                    )
                }
                other => {
                    object = Some(Box::new(other.clone()));
                    (EntryKind::Scalar, None, None, None, Some(json_of(other)))
                }
            };
            let position = merged.len() as u64;
            let p = merged.entry(key.clone()).or_insert_with(|| Partial {
                entry: IndexEntry {
                    position: Some(position),
                    key: key.clone(),
                    raw_key: (raw_key != key).then(|| raw_key.clone()),
                    path,
                    kind,
                    dtype,
                    shape: shape.clone(),
                    chunks: Vec::new(),
                    fsdp,
                    role: None,
                    flat_param,
                    value: value.clone(),
                    object,
                },
                plain_shapes: Vec::new(),
            });
            if p.entry.kind != kind || p.entry.dtype != dtype {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!(
                        "{key}: kind or dtype differs from the same key in another rank's file"
                    ),
                });
            }
            if kind == EntryKind::Scalar && p.entry.value != value {
                p.entry.value = Some(serde_json::Value::String("<differs across ranks>".into()));
            }
            if let Some(s) = plain_shape {
                p.plain_shapes.push(s);
            } else if p.entry.shape != shape {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!(
                        "{key}: global shape {shape:?} differs from another rank's {:?}",
                        p.entry.shape
                    ),
                });
            }
            p.entry.chunks.extend(chunks);
        }
        let unreferenced = unreferenced_bytes(&archive);
        file_infos.insert(
            file.clone(),
            FileInfo {
                size: source.size(file)?,
                rank,
                unreferenced_bytes: unreferenced,
            },
        );
    }
    let mut rank_local = false;
    let mut entries: Vec<IndexEntry> = merged
        .into_values()
        .map(|mut p| {
            if !p.plain_shapes.is_empty() && p.plain_shapes.iter().any(|s| *s != p.plain_shapes[0])
            {
                // Plain tensors whose shapes differ across ranks: rank-local pieces, no global shape.
                p.entry.shape = None;
                rank_local = true;
            }
            p.entry
        })
        .collect();
    let has_optimizer_state = assign_roles(&mut entries);
    // Raw `optim.state_dict()` files (state keyed by int ids) from several ranks of an FSDP job hold
    // each rank's own piece, even when the pieces happen to have equal shapes (padded flat shards).
    if many {
        for e in &mut entries {
            if e.kind == EntryKind::Tensor
                && e.fsdp.is_none()
                && matches!(
                    e.role,
                    Some(Role::OptimizerState {
                        param: PathSeg::Index(_),
                        ..
                    })
                )
            {
                e.shape = None;
                rank_local = true;
            }
        }
    }
    let all_plain_replicated = entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
        .all(|e| e.fsdp.is_none() && e.shape.is_some());
    let kind = if saw_flat {
        CheckpointKind::Fsdp1Local
    } else if saw_sharded {
        CheckpointKind::Fsdp1Sharded
    } else if saw_dtensor {
        CheckpointKind::Fsdp2
    } else if rank_local {
        CheckpointKind::RankLocal
    } else if many && all_plain_replicated {
        CheckpointKind::Fsdp1Full
    } else {
        CheckpointKind::Plain
    };
    Ok(CheckpointIndex {
        format: Format::TorchSave,
        kind,
        has_optimizer_state,
        entries,
        files: file_infos,
        dcp: None,
    })
}

/// Storage bytes that no tensor view of the archive reaches.
fn unreferenced_bytes(archive: &torch_zip::TorchArchive) -> u64 {
    let mut used: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for t in archive.tensors() {
        let Some(extent) = t.storage_extent() else {
            continue;
        };
        if extent > t.storage_offset {
            used.entry(t.storage.key.as_str())
                .or_default()
                .push((t.storage_offset, extent));
        }
    }
    let mut total = 0u64;
    let mut item_of: HashMap<&str, u64> = HashMap::new();
    for t in archive.tensors() {
        item_of.insert(t.storage.key.as_str(), t.storage.dtype.size_bytes() as u64);
    }
    for (key, range) in &archive.storages {
        let item = item_of.get(key.as_str()).copied().unwrap_or(1);
        let mut spans = used.remove(key.as_str()).unwrap_or_default();
        spans.sort_unstable();
        let mut covered = 0u64;
        let mut cur: Option<(u64, u64)> = None;
        for (a, b) in spans {
            match cur {
                Some((ca, cb)) if a <= cb => cur = Some((ca, cb.max(b))),
                Some((ca, cb)) => {
                    covered += cb - ca;
                    cur = Some((a, b));
                }
                None => cur = Some((a, b)),
            }
        }
        if let Some((ca, cb)) = cur {
            covered += cb - ca;
        }
        total += range.len.saturating_sub(covered.saturating_mul(item));
    }
    total
}

/// Marks optimizer entries: any path `P + ["state", param, name]` where some entry lies under
/// `P + ["param_groups"]`. Returns whether any was found.
fn assign_roles(entries: &mut [IndexEntry]) -> bool {
    let mut optim_prefixes: BTreeSet<Vec<PathSeg>> = BTreeSet::new();
    for e in entries.iter() {
        for (i, seg) in e.path.iter().enumerate() {
            if *seg == PathSeg::Key("param_groups".into()) {
                optim_prefixes.insert(e.path[..i].to_vec());
            }
        }
    }
    let mut found = false;
    for e in entries.iter_mut() {
        for prefix in &optim_prefixes {
            if !e.path.starts_with(prefix) {
                continue;
            }
            let rest = &e.path[prefix.len()..];
            match rest {
                [PathSeg::Key(s), param, PathSeg::Key(name)] if s == "state" => {
                    e.role = Some(Role::OptimizerState {
                        param: param.clone(),
                        state: name.clone(),
                    });
                    found = true;
                }
                [PathSeg::Key(s), PathSeg::Index(g), ..] if s == "param_groups" => {
                    e.role = Some(Role::ParamGroup { group: *g });
                    found = true;
                }
                _ => {}
            }
        }
    }
    found
}

// ----- safetensors ------------------------------------------------------------------------------

#[allow(
    clippy::too_many_lines,
    reason = "reads the HF index, each file's header and DCP_SHARDING_INFO into entries in one pass"
)]
fn index_safetensors(source: &dyn Source, names: &[String]) -> Result<CheckpointIndex, IndexError> {
    let mut files: Vec<String> = names
        .iter()
        .filter(|n| file_ext(n) == "safetensors")
        .cloned()
        .collect();
    if let Some(index_name) = names
        .iter()
        .find(|n| n.ends_with(".safetensors.index.json"))
    {
        let bytes = source.read_all(index_name)?;
        let index = st::read_index(&bytes).map_err(|source| IndexError::Safetensors {
            file: index_name.clone(),
            source,
        })?;
        let dir = index_name
            .rsplit_once('/')
            .map_or(String::new(), |(d, _)| format!("{d}/"));
        let referenced: BTreeSet<String> = index
            .weight_map
            .values()
            .map(|f| format!("{dir}{f}"))
            .collect();
        for f in &referenced {
            if !source.contains(f) {
                return Err(IndexError::Inconsistent {
                    file: index_name.clone(),
                    what: format!("weight_map names `{f}`, which is missing"),
                });
            }
        }
        files = referenced.into_iter().collect();
    }
    let mut by_key: BTreeMap<String, IndexEntry> = BTreeMap::new();
    let mut file_infos = BTreeMap::new();
    let mut sharding_info = false; // DCP_SHARDING_INFO seen (HF writer); pieces only if offsets say so
    for file in &files {
        let size = source.size(file)?;
        let header = read_st_header(source, file, 0, size)?;
        let (rank, _) = rank_from_name(file);
        for t in header.tensors {
            sharding_info |= t.saved_offsets.is_some();
            let offsets = t
                .saved_offsets
                .clone()
                .unwrap_or_else(|| vec![0; t.shape.len()]);
            let chunk = Chunk {
                offsets,
                sizes: t.shape.clone(),
                file: file.clone(),
                byte_offset: t.offset,
                byte_length: t.len,
                rank,
                encoding: ChunkEncoding::Raw {
                    storage_offset: 0,
                    strides: contiguous_strides(&t.shape),
                },
            };
            let clean = clean_tensor_name(&t.name);
            let position = by_key.len() as u64;
            let e = by_key.entry(clean.clone()).or_insert_with(|| IndexEntry {
                position: Some(position),
                object: None,
                key: clean.clone(),
                raw_key: (clean != t.name).then(|| t.name.clone()),
                path: vec![PathSeg::Key(clean.clone())],
                kind: EntryKind::Tensor,
                dtype: Some(t.dtype),
                shape: Some(vec![0; t.shape.len()]),
                chunks: Vec::new(),
                fsdp: None,
                role: None,
                flat_param: false,
                value: None,
            });
            if e.dtype != Some(t.dtype) || e.shape.as_ref().map(Vec::len) != Some(t.shape.len()) {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!(
                        "{}: dtype or rank differs from another file's piece",
                        t.name
                    ),
                });
            }
            // Global size = max(offset + size) per dim, as HuggingFaceStorageReader does.
            if let Some(shape) = e.shape.as_mut() {
                for ((g, &o), &s) in shape.iter_mut().zip(&chunk.offsets).zip(&chunk.sizes) {
                    *g = (*g).max(o.saturating_add(s));
                }
            }
            e.chunks.push(chunk);
        }
        file_infos.insert(
            file.clone(),
            FileInfo {
                size,
                rank,
                unreferenced_bytes: 0,
            },
        );
    }
    Ok(CheckpointIndex {
        format: Format::Safetensors,
        kind: if sharding_info
            && by_key.values().any(|e| {
                e.chunks.len() > 1 || e.chunks.iter().any(|c| c.offsets.iter().any(|&o| o > 0))
            }) {
            CheckpointKind::HfDistributedSafetensors
        } else {
            CheckpointKind::HfSafetensors
        },
        has_optimizer_state: false,
        entries: by_key.into_values().collect(),
        files: file_infos,
        dcp: None,
    })
}

// ----- DCP --------------------------------------------------------------------------------------

fn dcp_rank(file: &str) -> Option<u32> {
    let base = file.rsplit('/').next().unwrap_or(file);
    base.strip_prefix("__")?.split('_').next()?.parse().ok()
}

/// `storage_data` looked up by (fqn, chunk offsets), as torch's `MetadataIndex` equality does.
/// torch writes the records of a tensor's chunks in the order of its chunk list, so the `i`-th
/// record of an fqn is tried first (no hashing of offsets); a per-fqn map is built only for a
/// tensor whose records are in another order.
struct StorageJoin<'m> {
    storage: &'m [(dcp::StorageIndex, dcp::StorageInfo)],
    by_fqn: FastMap<&'m str, Vec<usize>>,
    by_offsets: FastMap<&'m str, FastMap<Option<&'m [u64]>, usize>>,
}

impl<'m> StorageJoin<'m> {
    fn new(storage: &'m [(dcp::StorageIndex, dcp::StorageInfo)]) -> Self {
        let mut by_fqn: FastMap<&str, Vec<usize>> = FastMap::default();
        for (p, (idx, _)) in storage.iter().enumerate() {
            by_fqn.entry(idx.fqn.as_str()).or_default().push(p);
        }
        StorageJoin {
            storage,
            by_fqn,
            by_offsets: FastMap::default(),
        }
    }

    /// The record of chunk `i` (at `offsets`; `None` for a bytes item) of `fqn`. torch's dict
    /// cannot hold two records of one (fqn, offsets); when a hand-made pickle does, the record at
    /// the chunk's own position is taken if it matches, otherwise the last one (as a dict would).
    fn find(
        &mut self,
        fqn: &str,
        i: usize,
        offsets: Option<&[u64]>,
    ) -> Option<&'m dcp::StorageInfo> {
        let storage = self.storage;
        let (&fqn_key, cands) = self.by_fqn.get_key_value(fqn)?;
        if let Some(&p) = cands.get(i)
            && storage[p].0.offset.as_deref() == offsets
        {
            return Some(&storage[p].1);
        }
        let map = self.by_offsets.entry(fqn_key).or_insert_with(|| {
            cands
                .iter()
                .map(|&q| (storage[q].0.offset.as_deref(), q))
                .collect()
        });
        map.get(&offsets).map(|&q| &storage[q].1)
    }
}

/// Indexes a DCP directory given the name of its `.metadata` file in the source.
#[allow(
    clippy::too_many_lines,
    reason = "turns every `.metadata` item (tensors, bytes, zstd transforms, SAFETENSORS blobs) into entries in one pass"
)]
pub fn index_dcp(source: &dyn Source, metadata_name: &str) -> Result<CheckpointIndex, IndexError> {
    let bytes = source.read_all(metadata_name)?;
    let meta = dcp::read_metadata(&bytes).map_err(|source| IndexError::Dcp {
        file: metadata_name.to_owned(),
        source,
    })?;
    let dir = metadata_name
        .rsplit_once('/')
        .map_or(String::new(), |(d, _)| format!("{d}/"));
    let mut join = StorageJoin::new(&meta.storage);
    // Per data file: its size, and (SAFETENSORS serialization) its blob header.
    let mut file_sizes: BTreeMap<String, u64> = BTreeMap::new();
    // Per `relative_path`: the file's name in the source, its size and rank (100 000 chunks name
    // a few hundred files).
    let mut data_files: FastMap<&str, (String, u64, Option<u32>)> = FastMap::default();
    let mut blobs: HashMap<(String, u64), HashMap<String, (u64, u64)>> = HashMap::new();
    let mut safetensors_serialization = false;
    let mut zip_files: FastMap<String, bool> = FastMap::default();
    let mut entries = Vec::with_capacity(meta.items.len());
    // The items are moved into the index (100 000 chunks' offsets and sizes are not copied).
    for (key_owned, item) in meta.items {
        let key = &key_owned;
        let path: Vec<PathSeg> = match meta.planner_data.get(key) {
            Some(steps) => steps
                .iter()
                .map(|s| match s {
                    PlannerStep::Key(k) => PathSeg::Key(k.clone()),
                    PlannerStep::Index(i) => PathSeg::Index(*i),
                })
                .collect(),
            None => vec![PathSeg::Key(key.clone())],
        };
        let clean_path_v = clean_path(&path);
        let mut chunks = Vec::new();
        let mut lookup =
            |i: usize, offsets: Option<&[u64]>| -> Result<&dcp::StorageInfo, IndexError> {
                join.find(key, i, offsets)
                    .ok_or_else(|| IndexError::Inconsistent {
                        file: metadata_name.to_owned(),
                        what: format!(
                            "{key}: no storage_data record for the chunk at offsets {offsets:?}"
                        ),
                    })
            };
        let (kind, dtype, shape) = match item {
            ItemMeta::Bytes => {
                let info = lookup(0, None)?;
                let encoding = match dcp::item_transform(&info.transforms) {
                    Ok(None) => ChunkEncoding::TorchSaveItem,
                    Ok(Some(dcp::ItemTransform::Zstd)) => ChunkEncoding::ZstdTorchSaveItem,
                    Err(what) => {
                        return Err(IndexError::Unsupported {
                            key: key.clone(),
                            file: format!("{dir}{}", info.relative_path),
                            what,
                        });
                    }
                };
                chunks.push(Chunk {
                    offsets: Vec::new(),
                    sizes: Vec::new(),
                    file: format!("{dir}{}", info.relative_path),
                    byte_offset: info.offset,
                    byte_length: info.length,
                    rank: dcp_rank(&info.relative_path),
                    encoding,
                });
                (EntryKind::Bytes, None, None)
            }
            ItemMeta::Tensor {
                dtype,
                size,
                chunks: metas,
            } => {
                chunks.reserve_exact(metas.len());
                for (i, c) in metas.into_iter().enumerate() {
                    let info = lookup(i, Some(&c.offsets))?;
                    let (file, file_size, rank) = if let Some(facts) =
                        data_files.get(info.relative_path.as_str())
                    {
                        facts.clone()
                    } else {
                        let file = format!("{dir}{}", info.relative_path);
                        let size = source.size(&file).map_err(|_| IndexError::Inconsistent {
                            file: metadata_name.to_owned(),
                            what: format!("{key}: data file `{file}` is missing"),
                        })?;
                        file_sizes.insert(file.clone(), size);
                        let facts = (file, size, dcp_rank(&info.relative_path));
                        data_files.insert(info.relative_path.as_str(), facts.clone());
                        facts
                    };
                    let mut chunk = Chunk {
                        offsets: c.offsets,
                        sizes: c.sizes,
                        file,
                        byte_offset: info.offset,
                        byte_length: info.length,
                        rank,
                        encoding: ChunkEncoding::TorchSaveItem,
                    };
                    match dcp::item_transform(&info.transforms) {
                        Ok(None) => {}
                        Ok(Some(dcp::ItemTransform::Zstd)) => {
                            // A compressed torch.save archive (torch applies extensions to the
                            // TORCH_SAVE serialization): nothing to read while indexing.
                            chunk.encoding = ChunkEncoding::ZstdTorchSaveItem;
                            chunks.push(chunk);
                            continue;
                        }
                        Err(what) => {
                            return Err(IndexError::Unsupported {
                                key: key.clone(),
                                file: chunk.file,
                                what,
                            });
                        }
                    }
                    // The serialization is decided once per file, from its first tensor item:
                    // a torch.save archive (default) or a safetensors blob (SAFETENSORS). Only
                    // that item's first bytes are read, never tensor data.
                    let file = &chunk.file;
                    let zip_file = if let Some(z) = zip_files.get(file) {
                        *z
                    } else {
                        let is_zip = if info.offset >= file_size {
                            true // past the end: `check` reports it with the key
                        } else {
                            let head = source.read_range(
                                file,
                                info.offset,
                                4.min(file_size - info.offset),
                            )?;
                            torch_zip::looks_like_zip(&head)
                        };
                        zip_files.insert(file.clone(), is_zip);
                        is_zip
                    };
                    if !zip_file {
                        safetensors_serialization = true;
                        let blob_key = (file.clone(), info.offset);
                        if !blobs.contains_key(&blob_key) {
                            blobs.insert(
                                blob_key.clone(),
                                read_blob(source, file, info.offset, file_size)?,
                            );
                        }
                        let Some((off, len)) = blobs[&blob_key].get(key.as_str()) else {
                            return Err(IndexError::Inconsistent {
                                file: file.clone(),
                                what: format!(
                                    "{key}: the safetensors blob at byte {} has no tensor of this name",
                                    info.offset
                                ),
                            });
                        };
                        chunk.byte_offset = *off;
                        chunk.byte_length = *len;
                        chunk.encoding = ChunkEncoding::Raw {
                            storage_offset: 0,
                            strides: contiguous_strides(&chunk.sizes),
                        };
                    }
                    chunks.push(chunk);
                }
                (EntryKind::Tensor, Some(dtype), Some(size))
            }
        };
        // A tensor's data files were sized when first seen (`data_files`); a bytes item's were not.
        if matches!(kind, EntryKind::Bytes) {
            for c in &chunks {
                if !file_sizes.contains_key(&c.file) {
                    let size = source.size(&c.file).map_err(|_| IndexError::Inconsistent {
                        file: metadata_name.to_owned(),
                        what: format!("{key}: data file `{}` is missing", c.file),
                    })?;
                    file_sizes.insert(c.file.clone(), size);
                }
            }
        }
        let clean_key = join_path(&clean_path_v);
        let (key_out, raw_key) = if clean_path_v == path {
            (key.clone(), None)
        } else {
            (clean_key, Some(key.clone()))
        };
        entries.push(IndexEntry {
            position: Some(entries.len() as u64),
            object: None,
            flat_param: key_out.ends_with("_flat_param"),
            key: key_out,
            raw_key,
            path: clean_path_v,
            kind,
            dtype,
            shape,
            chunks,
            fsdp: None,
            role: None,
            value: None,
        });
    }
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    let has_optimizer_state = assign_roles(&mut entries);
    let mut files: BTreeMap<String, FileInfo> = file_sizes
        .into_iter()
        .map(|(f, size)| {
            let rank = dcp_rank(&f);
            (
                f,
                FileInfo {
                    size,
                    rank,
                    unreferenced_bytes: 0,
                },
            )
        })
        .collect();
    files.insert(
        metadata_name.to_owned(),
        FileInfo {
            size: bytes.len() as u64,
            rank: None,
            unreferenced_bytes: 0,
        },
    );
    // Data files no item refers to (ranks whose plan was empty write empty files) are listed too.
    for n in source.names() {
        if n.starts_with(&dir) && n.ends_with(".distcp") && !files.contains_key(&n) {
            let size = source.size(&n)?;
            files.insert(
                n.clone(),
                FileInfo {
                    size,
                    rank: dcp_rank(&n),
                    unreferenced_bytes: 0,
                },
            );
        }
    }
    // `storage_data` holds a record (three strings, a vector) per chunk: freed off this thread.
    drop(join);
    drop(data_files);
    drop_in_background((meta.storage, meta.planner_data));
    Ok(CheckpointIndex {
        format: Format::Dcp,
        kind: if safetensors_serialization {
            CheckpointKind::DcpSafetensors
        } else {
            CheckpointKind::DcpTorchSave
        },
        has_optimizer_state,
        entries,
        files,
        dcp: Some(DcpFacts {
            version: meta.version,
            checkpoint_id: meta.checkpoint_id,
            save_id: meta.save_id,
        }),
    })
}

/// Frees `value` on a short-lived thread of its own where threads can be started (a large index
/// frees hundreds of thousands of small allocations), else here (the closure, and `value` with it,
/// is dropped when the thread cannot start).
fn drop_in_background<T: Send + 'static>(value: T) {
    let _ = std::thread::Builder::new()
        .name("shardscope-free".into())
        .spawn(move || drop(value));
}

/// Reads the header of the safetensors blob `offset..offset + len` of `file` from its first bytes
/// alone (the 8-byte length, then the header): no tensor bytes are read.
fn read_st_header(
    source: &dyn Source,
    file: &str,
    offset: u64,
    len: u64,
) -> Result<st::SafetensorsHeader, IndexError> {
    let st_err = |source| IndexError::Safetensors {
        file: file.to_owned(),
        source,
    };
    let first = source.read_range(file, offset, 8.min(len))?;
    let end = st::header_end(&first).map_err(st_err)?;
    if end > len {
        return Err(st_err(SafetensorsError::Invalid {
            message: format!("the header claims {} bytes, the file holds {len}", end - 8),
        }));
    }
    let prefix = source.read_range(file, offset, end)?;
    st::read_header_prefix(&prefix, len).map_err(st_err)
}

/// Reads the header of the safetensors blob at `offset` of `file`: name -> absolute byte range.
fn read_blob(
    source: &dyn Source,
    file: &str,
    offset: u64,
    size: u64,
) -> Result<HashMap<String, (u64, u64)>, IndexError> {
    let st_err = |source| IndexError::Safetensors {
        file: file.to_owned(),
        source,
    };
    let head = source.read_range(file, offset, 8.min(size.saturating_sub(offset)))?;
    let n = match <[u8; 8]>::try_from(head.as_ref()) {
        Ok(len) => u64::from_le_bytes(len),
        Err(_) => {
            return Err(st_err(SafetensorsError::Invalid {
                message: format!(
                    "item at byte {offset} is neither a torch.save archive nor a safetensors blob"
                ),
            }));
        }
    };
    let header_end = n
        .checked_add(8)
        .filter(|&e| e <= size.saturating_sub(offset))
        .ok_or_else(|| {
            st_err(SafetensorsError::Invalid {
                message: format!(
                    "safetensors header at byte {offset} claims {n} bytes, past the end of the file"
                ),
            })
        })?;
    let header = source.read_range(file, offset, header_end)?;
    let len = st::blob_len(&header).map_err(st_err)?;
    let end = offset.checked_add(len).filter(|&e| e <= size).ok_or_else(|| {
        st_err(SafetensorsError::Invalid {
            message: format!("safetensors blob at byte {offset} ({len} bytes) runs past the end of the file ({size})"),
        })
    })?;
    // The header alone: tensor bytes are never read (browsers read by range).
    let parsed = st::read_header_prefix(&header, end - offset).map_err(st_err)?;
    Ok(parsed
        .tensors
        .into_iter()
        .map(|t| (t.name, (offset + t.offset, t.len)))
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Checking.

impl CheckpointIndex {
    /// The entry with this key.
    pub fn entry(&self, key: &str) -> Option<&IndexEntry> {
        self.entries
            .binary_search_by(|e| e.key.as_str().cmp(key))
            .ok()
            .map(|i| &self.entries[i])
    }

    /// Checks the index against itself and the file sizes: chunks of each tensor tile it exactly
    /// (no gap, no overlap except identical replicas on different ranks, inside bounds), byte
    /// ranges lie inside their files, and byte lengths fit dtype and sizes.
    pub fn check(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        // One hashed lookup per chunk (a large DCP has 100 000 chunks over a few hundred files).
        let sizes: FastMap<&str, u64> = self
            .files
            .iter()
            .map(|(name, f)| (name.as_str(), f.size))
            .collect();
        for e in &self.entries {
            for c in &e.chunks {
                let end = c.byte_offset.checked_add(c.byte_length);
                let size = sizes.get(c.file.as_str()).copied();
                match (end, size) {
                    (Some(end), Some(size)) if end <= size => {}
                    _ => problems.push(Problem {
                        key: e.key.clone(),
                        file: Some(c.file.clone()),
                        byte_range: Some((
                            c.byte_offset,
                            c.byte_offset.saturating_add(c.byte_length),
                        )),
                        what: format!(
                            "byte range lies outside the file ({} bytes)",
                            size.unwrap_or(0)
                        ),
                    }),
                }
                if let (Some(dtype), Some(numel)) = (e.dtype, c.numel()) {
                    let item = dtype.size_bytes() as u64;
                    let needed = match &c.encoding {
                        ChunkEncoding::Raw {
                            storage_offset,
                            strides,
                        } => {
                            let view = TensorRef {
                                storage: StorageRef {
                                    key: String::new(),
                                    dtype,
                                    location: String::new(),
                                    numel: 0,
                                },
                                storage_offset: *storage_offset,
                                shape: c.sizes.clone(),
                                stride: strides.clone(),
                                requires_grad: false,
                                wrapper: None,
                            };
                            if strides.len() == c.sizes.len() {
                                view.storage_extent().and_then(|x| x.checked_mul(item))
                            } else {
                                None
                            }
                        }
                        ChunkEncoding::TorchSaveItem | ChunkEncoding::ZstdTorchSaveItem => {
                            numel.checked_mul(item)
                        }
                    };
                    if needed.is_none_or(|n| n > c.max_decoded_bytes()) {
                        problems.push(Problem {
                            key: e.key.clone(),
                            file: Some(c.file.clone()),
                            byte_range: Some((
                                c.byte_offset,
                                c.byte_offset.saturating_add(c.byte_length),
                            )),
                            what: format!(
                                "{} bytes cannot hold a {:?} chunk of {dtype}",
                                c.byte_length, c.sizes
                            ),
                        });
                    }
                }
            }
            if let Some(shape) = &e.shape {
                check_tiling(e, shape, &mut problems);
            }
        }
        problems
    }
}

/// A chunk's `(offsets, sizes)`.
type ChunkBox<'a> = (&'a [u64], &'a [u64]);

/// A hash map for the per-chunk work of indexing (100 000 chunks and more): foldhash, seeded per
/// process, instead of SipHash.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[allow(
    clippy::too_many_lines,
    reason = "the tiling check's steps (bounds, distinct boxes, replicas, overlap sweep, coverage) share the sorted boxes"
)]
fn check_tiling(e: &IndexEntry, shape: &[u64], problems: &mut Vec<Problem>) {
    let problem = |c: Option<&Chunk>, what: String| Problem {
        key: e.key.clone(),
        file: c.map(|c| c.file.clone()),
        byte_range: c.map(|c| (c.byte_offset, c.byte_offset.saturating_add(c.byte_length))),
        what,
    };
    let Some(total) = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)) else {
        problems.push(problem(None, format!("shape {shape:?} overflows")));
        return;
    };
    // Distinct boxes; identical boxes on different ranks are replicas.
    let mut boxes: Vec<&Chunk> = Vec::with_capacity(e.chunks.len());
    // The ranks each box was seen on: almost always one, so no set is allocated for it.
    let mut seen: FastMap<ChunkBox<'_>, (Option<u32>, Vec<Option<u32>>)> =
        FastMap::with_capacity_and_hasher(e.chunks.len(), foldhash::fast::RandomState::default());
    for c in &e.chunks {
        if c.offsets.len() != shape.len() || c.sizes.len() != shape.len() {
            problems.push(problem(
                Some(c),
                format!(
                    "chunk offsets {:?} / sizes {:?} do not match shape {shape:?}",
                    c.offsets, c.sizes
                ),
            ));
            return;
        }
        let out_of_bounds = c
            .offsets
            .iter()
            .zip(&c.sizes)
            .zip(shape)
            .any(|((&o, &s), &d)| o.checked_add(s).is_none_or(|end| end > d));
        if out_of_bounds {
            problems.push(problem(
                Some(c),
                format!(
                    "chunk at {:?} of size {:?} lies outside shape {shape:?}",
                    c.offsets, c.sizes
                ),
            ));
            return;
        }
        match seen.entry((&c.offsets, &c.sizes)) {
            std::collections::hash_map::Entry::Vacant(v) => {
                boxes.push(c);
                v.insert((c.rank, Vec::new()));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (first, more) = o.get_mut();
                if *first == c.rank || more.contains(&c.rank) || c.rank.is_none() {
                    problems.push(problem(
                        Some(c),
                        format!("chunk at {:?} is stored twice", c.offsets),
                    ));
                } else {
                    more.push(c.rank);
                }
            }
        }
    }
    let mut volume = 0u64;
    for c in &boxes {
        volume = volume.saturating_add(c.numel().unwrap_or(u64::MAX));
    }
    // Overlap: sweep on dim 0 (a compare budget keeps hostile inputs linear-ish).
    let nonempty: Vec<&Chunk> = {
        let mut v: Vec<&Chunk> = boxes
            .iter()
            .copied()
            .filter(|c| c.numel() != Some(0))
            .collect();
        v.sort_by(|a, b| a.offsets.cmp(&b.offsets));
        v
    };
    let mut budget: u64 = 50_000_000;
    'outer: for (i, a) in nonempty.iter().enumerate() {
        for b in &nonempty[i + 1..] {
            if !a.offsets.is_empty() && b.offsets[0] >= a.offsets[0] + a.sizes[0] {
                break;
            }
            budget = budget.saturating_sub(1);
            if budget == 0 {
                break 'outer;
            }
            let overlap = a
                .offsets
                .iter()
                .zip(&a.sizes)
                .zip(b.offsets.iter().zip(&b.sizes))
                .all(|((&ao, &asz), (&bo, &bsz))| ao.max(bo) < (ao + asz).min(bo + bsz));
            if overlap {
                problems.push(problem(
                    Some(b),
                    format!(
                        "chunk at {:?} (size {:?}) overlaps the chunk at {:?} (size {:?}) in {}",
                        b.offsets, b.sizes, a.offsets, a.sizes, a.file
                    ),
                ));
                return;
            }
        }
    }
    if volume != total {
        problems.push(problem(
            None,
            format!("chunks cover {volume} of {total} elements {GAP_NOTE}"),
        ));
    }
}

// ---------------------------------------------------------------------------------------------
// Reading values.

/// Contiguous little-endian values of a tensor or chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

impl CheckpointIndex {
    /// The chunk's values, contiguous little-endian, of shape `chunk.sizes`.
    pub fn read_chunk(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
        chunk: &Chunk,
    ) -> Result<TensorData, IndexError> {
        let dtype = entry.dtype.ok_or_else(|| IndexError::NotReadable {
            key: entry.key.clone(),
            what: "not a tensor".into(),
        })?;
        let bad = |what: String| IndexError::BadChunk {
            key: entry.key.clone(),
            file: chunk.file.clone(),
            offset: chunk.byte_offset,
            end: chunk.byte_offset.saturating_add(chunk.byte_length),
            what,
        };
        let mut bytes = source.read_range(&chunk.file, chunk.byte_offset, chunk.byte_length)?;
        if chunk.encoding == ChunkEncoding::ZstdTorchSaveItem {
            // The archive holds the chunk's elements and a few KiB of zip and pickle.
            let limit = chunk
                .numel()
                .and_then(|n| n.checked_mul(dtype.size_bytes() as u64))
                .and_then(|n| n.checked_add(ITEM_ARCHIVE_OVERHEAD))
                .ok_or_else(|| bad("the chunk's size overflows".into()))?;
            bytes = Cow::Owned(
                dcp::decompress_zstd(&bytes, limit)
                    .map_err(|e| bad(format!("stream.zstd/1 item: {e}")))?,
            );
        }
        let data = match &chunk.encoding {
            ChunkEncoding::Raw {
                storage_offset,
                strides,
            } => {
                let item = dtype.size_bytes() as u64;
                let view = TensorRef {
                    storage: StorageRef {
                        key: entry.key.clone(),
                        dtype,
                        location: String::new(),
                        numel: chunk.byte_length / item,
                    },
                    storage_offset: *storage_offset,
                    shape: chunk.sizes.clone(),
                    stride: strides.clone(),
                    requires_grad: false,
                    wrapper: None,
                };
                if strides.len() != chunk.sizes.len() {
                    return Err(bad("strides and sizes differ in length".into()));
                }
                torch_zip::gather_view(&bytes, &view).map_err(|e| bad(e.to_string()))?
            }
            ChunkEncoding::TorchSaveItem | ChunkEncoding::ZstdTorchSaveItem => {
                let archive = torch_zip::read_archive(&bytes).map_err(|e| bad(e.to_string()))?;
                let PyValue::Tensor(t) = &archive.root else {
                    return Err(bad(format!(
                        "the item holds a {}, not a tensor",
                        archive.root.type_name()
                    )));
                };
                if t.storage.dtype != dtype || t.shape != chunk.sizes {
                    return Err(bad(format!(
                        "the item holds a {} tensor of shape {:?}, the metadata says {dtype} {:?}",
                        t.storage.dtype, t.shape, chunk.sizes
                    )));
                }
                let range = archive.storage_range(t).map_err(|e| bad(e.to_string()))?;
                let storage = &bytes[range.offset as usize..(range.offset + range.len) as usize];
                torch_zip::gather_view(storage, t).map_err(|e| bad(e.to_string()))?
            }
        };
        Ok(TensorData {
            dtype,
            shape: chunk.sizes.clone(),
            bytes: data,
        })
    }

    /// The most bytes the chunks of `entry` can decode to: the sizes of the files holding them
    /// (a compressed chunk counts its byte length times zstd's largest expansion instead).
    pub fn max_decoded_bytes(&self, entry: &IndexEntry) -> u64 {
        let files: BTreeSet<&str> = entry
            .chunks
            .iter()
            .filter(|c| c.encoding != ChunkEncoding::ZstdTorchSaveItem)
            .map(|c| c.file.as_str())
            .collect();
        let plain = files
            .iter()
            .map(|f| self.files.get(*f).map_or(0, |i| i.size))
            .fold(0, u64::saturating_add);
        entry
            .chunks
            .iter()
            .filter(|c| c.encoding == ChunkEncoding::ZstdTorchSaveItem)
            .map(Chunk::max_decoded_bytes)
            .fold(plain, u64::saturating_add)
    }

    /// The whole tensor, assembled from its chunks (replicas are read once).
    pub fn read_tensor(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
    ) -> Result<TensorData, IndexError> {
        let not = |what: &str| IndexError::NotReadable {
            key: entry.key.clone(),
            what: what.into(),
        };
        let dtype = entry.dtype.ok_or_else(|| not("not a tensor"))?;
        let shape = entry.shape.clone().ok_or_else(|| {
            not("rank-local pieces with no global shape: read each chunk instead")
        })?;
        let item = dtype.size_bytes();
        let nbytes = entry.nbytes().ok_or_else(|| not("size overflows"))?;
        // Never allocate more than the chunks' bytes could fill.
        let available = self.max_decoded_bytes(entry);
        if nbytes > available {
            return Err(not(
                "the tensor is larger than the files holding its chunks",
            ));
        }
        let problems: Vec<Problem> = {
            let mut p = Vec::new();
            check_tiling(entry, &shape, &mut p);
            p
        };
        if let Some(p) = problems.first() {
            return Err(not(&p.what));
        }
        let total = usize::try_from(nbytes).map_err(|_| not("too large"))?;
        let mut out = Vec::new();
        let strides = contiguous_strides(&shape);
        let mut done: BTreeSet<(Vec<u64>, Vec<u64>)> = BTreeSet::new();
        for c in &entry.chunks {
            if !done.insert((c.offsets.clone(), c.sizes.clone())) {
                continue;
            }
            let data = self.read_chunk(source, entry, c)?;
            // Allocated once a chunk has been read: a compressed chunk's size is only proven by
            // decoding it, so a lying `.metadata` fails before the whole tensor is allocated.
            if out.len() != total {
                out = vec![0u8; total];
            }
            copy_box(&mut out, &strides, &c.offsets, &c.sizes, &data.bytes, item);
        }
        Ok(TensorData {
            dtype,
            shape,
            bytes: out,
        })
    }

    /// Where the chunk's elements lie in its file, without reading them: for readers that copy
    /// chunk data straight into an output buffer (`shardscope convert`). For a DCP item the item's
    /// zip directory and pickle are parsed (a few hundred bytes); the storage is not touched. The
    /// view is checked to lie inside the storage.
    pub fn locate_chunk(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
        chunk: &Chunk,
    ) -> Result<ChunkLocation, IndexError> {
        let dtype = entry.dtype.ok_or_else(|| IndexError::NotReadable {
            key: entry.key.clone(),
            what: "not a tensor".into(),
        })?;
        let bad = |what: String| IndexError::BadChunk {
            key: entry.key.clone(),
            file: chunk.file.clone(),
            offset: chunk.byte_offset,
            end: chunk.byte_offset.saturating_add(chunk.byte_length),
            what,
        };
        let item = dtype.size_bytes() as u64;
        let location = match &chunk.encoding {
            ChunkEncoding::Raw {
                storage_offset,
                strides,
            } => ChunkLocation {
                file: chunk.file.clone(),
                storage_byte_offset: chunk.byte_offset,
                storage_bytes: chunk.byte_length,
                storage_offset: *storage_offset,
                strides: strides.clone(),
            },
            ChunkEncoding::ZstdTorchSaveItem => {
                return Err(bad(
                    "a stream.zstd/1 (compressed) item: its elements have no location in the file; \
                     read it with read_chunk"
                        .into(),
                ));
            }
            ChunkEncoding::TorchSaveItem => {
                // The item's zip headers, `data.pkl` and central directory sit at its two ends:
                // remote sources fetch only those; the whole item when they do not parse alone.
                // (torch writes `data.pkl` first; its central directory is < 1 KiB per member.)
                const HEAD_BYTES: u64 = 64 << 10;
                const TAIL_BYTES: u64 = 16 << 10;
                let ends = source.read_ends(
                    &chunk.file,
                    chunk.byte_offset,
                    chunk.byte_length,
                    HEAD_BYTES,
                    TAIL_BYTES,
                )?;
                let archive = if let Ok(archive) = torch_zip::read_archive(&ends) {
                    archive
                } else {
                    drop(ends);
                    let bytes =
                        source.read_range(&chunk.file, chunk.byte_offset, chunk.byte_length)?;
                    torch_zip::read_archive(&bytes).map_err(|e| bad(e.to_string()))?
                };
                let PyValue::Tensor(t) = &archive.root else {
                    return Err(bad(format!(
                        "the item holds a {}, not a tensor",
                        archive.root.type_name()
                    )));
                };
                if t.storage.dtype != dtype || t.shape != chunk.sizes {
                    return Err(bad(format!(
                        "the item holds a {} tensor of shape {:?}, the metadata says {dtype} {:?}",
                        t.storage.dtype, t.shape, chunk.sizes
                    )));
                }
                let range = archive.storage_range(t).map_err(|e| bad(e.to_string()))?;
                ChunkLocation {
                    file: chunk.file.clone(),
                    storage_byte_offset: chunk.byte_offset.saturating_add(range.offset),
                    storage_bytes: range.len,
                    storage_offset: t.storage_offset,
                    strides: t.stride.clone(),
                }
            }
        };
        if location.strides.len() != chunk.sizes.len() {
            return Err(bad("strides and sizes differ in length".into()));
        }
        // The view's last element must lie inside the storage bytes.
        let extent = if chunk.sizes.contains(&0) {
            Some(0)
        } else {
            chunk
                .sizes
                .iter()
                .zip(&location.strides)
                .try_fold(location.storage_offset, |acc, (&d, &s)| {
                    acc.checked_add((d - 1).checked_mul(s)?)
                })
                .and_then(|last| last.checked_add(1))
        };
        match extent.and_then(|e| e.checked_mul(item)) {
            Some(end) if end <= location.storage_bytes => Ok(location),
            _ => Err(bad(format!(
                "the view (offset {}, strides {:?}, sizes {:?}) reaches past the {} storage bytes",
                location.storage_offset, location.strides, chunk.sizes, location.storage_bytes
            ))),
        }
    }

    /// The `torch.save` archive of a bytes item, decompressed when it is a `stream.zstd/1` item
    /// (to at most [`MAX_BYTES_ITEM`] bytes).
    fn bytes_item<'s>(
        source: &'s dyn Source,
        entry: &IndexEntry,
        c: &Chunk,
    ) -> Result<Cow<'s, [u8]>, IndexError> {
        let bytes = source.read_range(&c.file, c.byte_offset, c.byte_length)?;
        if c.encoding != ChunkEncoding::ZstdTorchSaveItem {
            return Ok(bytes);
        }
        let limit = c.max_decoded_bytes().min(MAX_BYTES_ITEM);
        dcp::decompress_zstd(&bytes, limit)
            .map(Cow::Owned)
            .map_err(|e| IndexError::BadChunk {
                key: entry.key.clone(),
                file: c.file.clone(),
                offset: c.byte_offset,
                end: c.byte_offset.saturating_add(c.byte_length),
                what: format!("stream.zstd/1 item: {e}"),
            })
    }

    /// Decodes a bytes item (DCP) into the Python value the reader rebuilt (tuples stay tuples):
    /// what a converter writes back with `formats::write::pickle::PyValue::from_read_value`.
    pub fn read_bytes_object(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
    ) -> Result<PyValue, IndexError> {
        let c = entry
            .chunks
            .first()
            .filter(|_| entry.kind == EntryKind::Bytes)
            .ok_or_else(|| IndexError::NotReadable {
                key: entry.key.clone(),
                what: "not a bytes item".into(),
            })?;
        let bytes = Self::bytes_item(source, entry, c)?;
        let archive = torch_zip::read_archive(&bytes).map_err(|e| IndexError::BadChunk {
            key: entry.key.clone(),
            file: c.file.clone(),
            offset: c.byte_offset,
            end: c.byte_offset.saturating_add(c.byte_length),
            what: e.to_string(),
        })?;
        Ok(archive.root)
    }

    /// Decodes a bytes item (DCP) into JSON.
    pub fn read_bytes_value(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
    ) -> Result<serde_json::Value, IndexError> {
        if entry.kind == EntryKind::Scalar {
            return Ok(entry.value.clone().unwrap_or(serde_json::Value::Null));
        }
        Ok(json_of(&self.read_bytes_object(source, entry)?))
    }

    /// Fills `value` of every bytes entry by decoding it, and `object` (the Python value, tuples
    /// kept) for writers that re-pickle it.
    pub fn decode_bytes_values(&mut self, source: &dyn Source) -> Result<(), IndexError> {
        let mut values = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if e.kind == EntryKind::Bytes {
                values.push((i, self.read_bytes_object(source, e)?));
            }
        }
        for (i, v) in values {
            self.entries[i].value = Some(json_of(&v));
            self.entries[i].object = Some(Box::new(v));
        }
        Ok(())
    }
}

/// Where a chunk's elements lie in its file (see [`CheckpointIndex::locate_chunk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLocation {
    pub file: String,
    /// Absolute byte offset of the storage holding the chunk.
    pub storage_byte_offset: u64,
    /// Bytes of that storage.
    pub storage_bytes: u64,
    /// The chunk's first element in the storage, in elements.
    pub storage_offset: u64,
    /// The chunk's strides in the storage, in elements.
    pub strides: Vec<u64>,
}

impl ChunkLocation {
    /// The absolute byte range of the chunk's data when its view is row-major contiguous
    /// (`sizes` are the chunk's sizes, `item` the element size); `None` for a strided view.
    pub fn contiguous_range(&self, sizes: &[u64], item: u64) -> Option<(u64, u64)> {
        let numel = sizes.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        let mut expected = 1u64;
        for (&d, &s) in sizes.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected && numel != 0 {
                return None;
            }
            expected = expected.saturating_mul(d);
        }
        let start = self
            .storage_byte_offset
            .checked_add(self.storage_offset.checked_mul(item)?)?;
        Some((start, numel.checked_mul(item)?))
    }
}

/// Copies a contiguous box of `sizes` into `out` (contiguous with `strides`) at `offsets`.
fn copy_box(
    out: &mut [u8],
    strides: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    src: &[u8],
    item: usize,
) {
    let numel: u64 = sizes.iter().product();
    if numel == 0 {
        return;
    }
    if sizes.is_empty() {
        out[..item].copy_from_slice(&src[..item]);
        return;
    }
    let ndim = sizes.len();
    let row = sizes[ndim - 1] as usize * item;
    let rows = (numel / sizes[ndim - 1]) as usize;
    let mut index = vec![0u64; ndim - 1];
    for r in 0..rows {
        let mut pos = offsets[ndim - 1];
        for d in 0..ndim - 1 {
            pos += (offsets[d] + index[d]) * strides[d];
        }
        let dst = pos as usize * item;
        out[dst..dst + row].copy_from_slice(&src[r * row..(r + 1) * row]);
        for d in (0..ndim - 1).rev() {
            index[d] += 1;
            if index[d] < sizes[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// Summary statistics of a tensor's values (`--values`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValueStats {
    pub count: u64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub mean: Option<f64>,
    pub nan: u64,
    pub inf: u64,
}

impl TensorData {
    /// Values as f64, one per element (`None` for complex types: see [`TensorData::components`]).
    pub fn to_f64(&self) -> Option<Vec<f64>> {
        if self.dtype.is_complex() {
            return None;
        }
        Some(self.components().collect())
    }

    /// Every real component as f64: one per element, two (real, imaginary) per complex element,
    /// the order of `torch.view_as_real(t).double().flatten()`. Float8 values are decoded exactly
    /// (see [`crate::dtype::f64_from_float8`]).
    pub fn components(&self) -> impl Iterator<Item = f64> + '_ {
        let complex = self.dtype.is_complex();
        self.bytes
            .chunks_exact(self.dtype.size_bytes())
            .flat_map(move |c| {
                let [re, im] = self.dtype.element_f64(c);
                std::iter::once(re).chain(complex.then_some(im))
            })
    }

    /// min / max / mean over finite values, and the number of NaN and infinite values. Complex
    /// tensors count their real and imaginary parts as separate values (`count` stays the number
    /// of elements), as statistics of `torch.view_as_real(t)` do.
    pub fn stats(&self) -> Option<ValueStats> {
        let values = self.components();
        let mut s = ValueStats {
            count: (self.bytes.len() / self.dtype.size_bytes()) as u64,
            min: None,
            max: None,
            mean: None,
            nan: 0,
            inf: 0,
        };
        let mut sum = 0.0;
        let mut finite = 0u64;
        for v in values {
            if v.is_nan() {
                s.nan += 1;
            } else if v.is_infinite() {
                s.inf += 1;
            } else {
                s.min = Some(s.min.map_or(v, |m: f64| m.min(v)));
                s.max = Some(s.max.map_or(v, |m: f64| m.max(v)));
                sum += v;
                finite += 1;
            }
        }
        if finite > 0 {
            s.mean = Some(sum / finite as f64);
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        fqn: &str,
        offsets: Option<Vec<u64>>,
        file: &str,
    ) -> (dcp::StorageIndex, dcp::StorageInfo) {
        (
            dcp::StorageIndex {
                fqn: fqn.into(),
                offset: offsets,
                index: None,
            },
            dcp::StorageInfo {
                relative_path: file.into(),
                offset: 0,
                length: 0,
                transforms: Vec::new(),
            },
        )
    }

    #[test]
    fn storage_join_in_order_out_of_order_and_missing() {
        let storage = vec![
            record("a", Some(vec![0, 0]), "a0"),
            record("a", Some(vec![2, 0]), "a1"),
            record("b", None, "b"),
            // `c`'s records in the reverse order of its chunk list, and one repeated.
            record("c", Some(vec![4]), "c2-first"),
            record("c", Some(vec![2]), "c1"),
            record("c", Some(vec![0]), "c0"),
            record("c", Some(vec![4]), "c2-last"),
        ];
        let mut join = StorageJoin::new(&storage);
        let path = |j: &mut StorageJoin<'_>, f: &str, i: usize, o: Option<&[u64]>| {
            j.find(f, i, o).map(|info| info.relative_path.clone())
        };
        assert_eq!(
            path(&mut join, "a", 0, Some(&[0, 0])).as_deref(),
            Some("a0")
        );
        assert_eq!(
            path(&mut join, "a", 1, Some(&[2, 0])).as_deref(),
            Some("a1")
        );
        assert_eq!(path(&mut join, "b", 0, None).as_deref(), Some("b"));
        assert_eq!(path(&mut join, "c", 0, Some(&[0])).as_deref(), Some("c0"));
        assert_eq!(path(&mut join, "c", 1, Some(&[2])).as_deref(), Some("c1"));
        // Not at its position: the last record of those offsets, as a dict keeps it.
        assert_eq!(
            path(&mut join, "c", 2, Some(&[4])).as_deref(),
            Some("c2-last")
        );
        assert_eq!(path(&mut join, "a", 0, Some(&[1, 0])), None);
        assert_eq!(path(&mut join, "a", 5, Some(&[9, 9])), None);
        assert_eq!(path(&mut join, "zzz", 0, None), None);
        assert_eq!(path(&mut join, "b", 0, Some(&[0])), None);
    }

    /// The groups of `names` as (pattern, [(name, rank)]).
    fn grouped(names: &[&str]) -> Vec<(String, RankedFiles)> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        group_rank_files(&names)
            .into_iter()
            .map(|g| (g.pattern, g.files))
            .collect()
    }

    fn set(pattern: &str, names: &[&str]) -> (String, RankedFiles) {
        let files = names
            .iter()
            .enumerate()
            .map(|(r, n)| ((*n).to_owned(), Some(r as u32)))
            .collect();
        (pattern.to_owned(), files)
    }

    #[test]
    fn rank_sets_are_the_number_that_varies() {
        // Any text around the rank, the rank anywhere (README: `ckpt_{r}_model.pt`).
        assert_eq!(
            grouped(&[
                "ckpt_1_model.pt",
                "ckpt_0_optim.pt",
                "ckpt_0_model.pt",
                "ckpt_1_optim.pt"
            ]),
            vec![
                set("ckpt_{R}_model.pt", &["ckpt_0_model.pt", "ckpt_1_model.pt"]),
                set("ckpt_{R}_optim.pt", &["ckpt_0_optim.pt", "ckpt_1_optim.pt"]),
            ]
        );
        assert_eq!(
            grouped(&["model_0.pt", "model_2.pt", "model_1.pt"]),
            vec![set(
                "model_{R}.pt",
                &["model_0.pt", "model_1.pt", "model_2.pt"]
            )]
        );
        assert_eq!(
            grouped(&["model-1.pt", "model-0.pt"]),
            vec![set("model-{R}.pt", &["model-0.pt", "model-1.pt"])]
        );
        // Numbers that are the same in every name are not the rank, wherever they are.
        assert_eq!(
            grouped(&["model_rank0_of_2.pt", "model_rank1_of_2.pt"]),
            vec![set(
                "model_rank{R}_of_2.pt",
                &["model_rank0_of_2.pt", "model_rank1_of_2.pt"]
            )]
        );
        assert_eq!(
            grouped(&["m0_ws3.pt", "m1_ws3.pt", "m2_ws3.pt"]),
            vec![set("m{R}_ws3.pt", &["m0_ws3.pt", "m1_ws3.pt", "m2_ws3.pt"])]
        );
        assert_eq!(
            grouped(&["model-r1-ws2.pt", "model-r0-ws2.pt"]),
            vec![set(
                "model-r{R}-ws2.pt",
                &["model-r0-ws2.pt", "model-r1-ws2.pt"]
            )]
        );
        // Two numbers vary: the one that gives complete sets is the rank.
        assert_eq!(
            grouped(&[
                "model_world_size_2_rank_0.pt",
                "model_world_size_2_rank_1.pt",
                "model_world_size_1_rank_0.pt",
            ]),
            vec![
                set(
                    "model_world_size_1_rank_{R}.pt",
                    &["model_world_size_1_rank_0.pt"]
                ),
                set(
                    "model_world_size_2_rank_{R}.pt",
                    &[
                        "model_world_size_2_rank_0.pt",
                        "model_world_size_2_rank_1.pt"
                    ]
                ),
            ]
        );
    }

    #[test]
    fn names_that_are_not_rank_sets() {
        // A gap stays one set (the index then reports what is missing), not two checkpoints.
        assert_eq!(
            grouped(&["model_0.pt", "model_2.pt"]),
            vec![(
                "model_{R}.pt".to_owned(),
                vec![
                    ("model_0.pt".into(), Some(0)),
                    ("model_2.pt".into(), Some(2))
                ]
            )]
        );
        // Zero-padded numbers are not `{R}` (HF shards); one file keeps the `rank` rule.
        assert_eq!(
            grouped(&[
                "pytorch_model-00001-of-00002.bin",
                "pytorch_model-00002-of-00002.bin"
            ]),
            vec![
                (
                    "pytorch_model-00001-of-00002.bin".to_owned(),
                    vec![("pytorch_model-00001-of-00002.bin".into(), None)]
                ),
                (
                    "pytorch_model-00002-of-00002.bin".to_owned(),
                    vec![("pytorch_model-00002-of-00002.bin".into(), None)]
                ),
            ]
        );
        assert_eq!(
            grouped(&["rank1_full.pt", "model.pt"]),
            vec![
                ("model.pt".to_owned(), vec![("model.pt".into(), None)]),
                (
                    "rank{R}_full.pt".to_owned(),
                    vec![("rank1_full.pt".into(), Some(1))]
                ),
            ]
        );
    }

    #[test]
    fn ranks_from_names() {
        assert_eq!(
            rank_from_name("rank1_full.pt"),
            (Some(1), "rank{R}_full.pt".into())
        );
        assert_eq!(
            rank_from_name("dir/model_rank_12.pt"),
            (Some(12), "model_rank_{R}.pt".into())
        );
        assert_eq!(
            rank_from_name("shard-00002-model-00001-of-00001.safetensors"),
            (Some(1), "shard-{R}-model-00001-of-00001.safetensors".into())
        );
        assert_eq!(rank_from_name("model.pt"), (None, "model.pt".into()));
    }

    #[test]
    fn dtensor_offsets_follow_chunk_rules() {
        // `a` (5), ws=4: offsets 0, 2, 4, 5 (empty shard's offset is the dim size).
        let p = [Placement::Shard { dim: 0 }];
        let got: Vec<u64> = (0..4)
            .map(|k| dtensor_offsets(&[5], &p, &[4], &[k]).unwrap()[0])
            .collect();
        assert_eq!(got, vec![0, 2, 4, 5]);
        // HSDP (Replicate, Shard(0)) on a (2, 2) mesh.
        let p = [Placement::Replicate, Placement::Shard { dim: 0 }];
        assert_eq!(
            dtensor_offsets(&[5], &p, &[2, 2], &[1, 1]).unwrap(),
            vec![3]
        );
    }

    #[test]
    fn copy_box_places_rows() {
        let mut out = vec![0u8; 6];
        copy_box(&mut out, &[3, 1], &[0, 1], &[2, 2], &[1, 2, 3, 4], 1);
        assert_eq!(out, vec![0, 1, 2, 0, 3, 4]);
    }
}
