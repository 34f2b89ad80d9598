//! FSDP1 per-rank checkpoints: a folder holding, for every rank `r`, the LOCAL model state dict
//! (`model.state_dict()` under `StateDictType.LOCAL_STATE_DICT`) and the raw optimizer state dict
//! (`optim.state_dict()`), each written with `torch.save`.
//!
//! - [`Converter`]: the full (unsharded) model state dict that `FULL_STATE_DICT` returns and the
//!   full FQN-keyed optimizer state dict that `FSDP.optim_state_dict` returns.
//! - [`reshard`]: the same checkpoint at another world size: per-rank files that torch loads with
//!   `LOCAL_STATE_DICT` and `optim.load_state_dict` (the offline `optim_state_dict` +
//!   `optim_state_dict_to_load`).
//!
//! File names: every file whose name contains a decimal number is grouped by its name with the
//! *last* number replaced by `{r}` (`model_rank3.pt` → `model_rank{r}.pt`). A group qualifies
//! when it holds exactly ranks `0..N`. Which group is the model and which the optimizer is decided
//! by content (an optimizer state dict has `state` and `param_groups`), unless given explicitly
//! ([`RankFiles::model_pattern`], [`RankFiles::optim_pattern`]). Outputs keep the input names.
//!
//! Optimizer ids: the optimizer is assumed to have been built over `model.parameters()` of the
//! FSDP-wrapped model (in one or several groups, in that order), so id `i` is the `i`-th parameter
//! of the wrapped model's `named_parameters()` ([`Fsdp1Model::wrapped_params`]).
//!
//! # Streaming
//!
//! Peak memory stays near one output tensor, whatever the checkpoint size:
//!
//! - Inputs: each file's zip directory and pickle are read once (through the memory-mapped
//!   [`crate::file_source::FileSource`], then unmapped) into a *skeleton*: the state dict with
//!   dtype and shape of every tensor but no bytes (`lazy`). Tensor bytes are read later with
//!   positioned reads of exactly the elements an output tensor needs, straight into that tensor's
//!   buffer.
//! - Outputs: every file is planned from a skeleton (`torch.save` needs the pickle before the
//!   storages; safetensors its header) and written with `TorchSaveWriter` / `SafetensorsWriter`
//!   one storage at a time, each produced when the writer asks for it.
//! - Model state: the key order of the FULL and LOCAL dicts comes from names only
//!   ([`shardscope_core::transform::reshard::full_key_plan`], `local_key_plan`); a full parameter
//!   or a destination flat shard (padding segments filled with 42.0 as torch does) is assembled
//!   from the source ranks' shard ranges that hold it.
//! - Optimizer state: the structure (keys, state names and their order, scalar states,
//!   `param_groups`, and every check PyTorch makes) comes from the in-memory transforms
//!   (`full_optim_from_local`, `local_optim_from_full`) run on one piece at a time (the state of
//!   one flat parameter, one state name per run), with every positive-dimension state replaced by
//!   a zero 1-byte stand-in of the same shape. Those tensors' real bytes are then read from the
//!   source ranks a destination tensor at a time: each output element is one element of one
//!   parameter's full state, found through the source layout.
//!
//! Outputs are byte-identical to what the whole-in-memory transforms give (checked against them on
//! torch-made checkpoints of several layouts). `bench/fsdp1_reshard.py` measures the memory
//! (BENCHMARKS.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use shardscope_core::DType;
use shardscope_core::layout::fsdp1::PieceKind;
use shardscope_core::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::bridge::{BridgeError, RootDict};
use shardscope_core::model::tree::{
    ChunkMeta, Dict, DistKind, DistTensor, Key, Node, Tensor, fill_bytes,
};
use shardscope_core::transform::model_state::{
    TORCH_PADDING_FILL, param_copies, shard_of_local_entry, unpadded_shard_numel,
};
use shardscope_core::transform::optim_state::{full_optim_from_local, local_optim_from_full};
use shardscope_core::transform::reshard::{FullKey, LocalKey, full_key_plan, local_key_plan};
use shardscope_core::transform::{Fsdp1Model, ParamRef, TransformError};

/// Lazy `torch.save` inputs and tensor-at-a-time outputs (also used by the FSDP2 per-rank convert).
pub mod lazy;

use lazy::LazyFile;

/// What went wrong with a per-rank FSDP1 checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum Fsdp1LocalError {
    /// A file or folder could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The model description is invalid.
    #[error("{0}")]
    Description(#[from] shardscope_core::model::DescriptionError),
    /// No FSDP1 layout for the description and flags.
    #[error("layout: {0}")]
    Layout(#[from] layout::LayoutError),
    /// The folder does not hold one complete set of per-rank files.
    #[error("{dir}: {reason}")]
    Files { dir: PathBuf, reason: String },
    /// A file could not be read as a torch archive of a state dict.
    #[error("{0}")]
    Bridge(#[from] BridgeError),
    /// A file holds something other than what its role needs.
    #[error("{file}: {reason}")]
    Content { file: PathBuf, reason: String },
    /// A transform rejected the data (messages follow PyTorch's where PyTorch rejects too).
    #[error("{what}: {source}")]
    Transform {
        what: String,
        #[source]
        source: Box<TransformError>,
    },
    /// The safetensors output could not be produced.
    #[error("safetensors output: {0}")]
    Safetensors(String),
}

type Result<T> = std::result::Result<T, Fsdp1LocalError>;

/// The per-rank files of one checkpoint, as found in its folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFiles {
    pub dir: PathBuf,
    /// File-name pattern of the LOCAL model state dicts (`{r}` stands for the rank).
    pub model_pattern: String,
    /// File-name pattern of the raw optimizer state dicts, when the folder has them.
    pub optim_pattern: Option<String>,
    pub world_size: usize,
}

impl RankFiles {
    pub fn model_file(&self, rank: usize) -> PathBuf {
        self.dir
            .join(self.model_pattern.replace("{r}", &rank.to_string()))
    }

    pub fn optim_file(&self, rank: usize) -> Option<PathBuf> {
        self.optim_pattern
            .as_ref()
            .map(|p| self.dir.join(p.replace("{r}", &rank.to_string())))
    }
}

/// `name` with its last decimal number replaced by `{r}`, and that number.
fn rank_pattern(name: &str) -> Option<(String, usize)> {
    let bytes = name.as_bytes();
    let end = bytes.iter().rposition(u8::is_ascii_digit)? + 1;
    let start = bytes[..end]
        .iter()
        .rposition(|b| !b.is_ascii_digit())
        .map_or(0, |i| i + 1);
    let rank: usize = name[start..end].parse().ok()?;
    // `rank01` is not rank 1 of a `{r}` pattern.
    if end - start > 1 && name.as_bytes()[start] == b'0' {
        return None;
    }
    Some((format!("{}{{r}}{}", &name[..start], &name[end..]), rank))
}

fn is_optimizer_dict(node: &Node) -> bool {
    node.as_dict()
        .is_some_and(|d| d.get_str("state").is_some() && d.get_str("param_groups").is_some())
}

/// Finds the per-rank model and optimizer files in `dir`. `model_pattern`/`optim_pattern` (with
/// `{r}`) override the detection.
pub fn find_rank_files(
    dir: &Path,
    model_pattern: Option<&str>,
    optim_pattern: Option<&str>,
) -> Result<RankFiles> {
    let io = |source| Fsdp1LocalError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut groups: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        if !entry.file_type().map_err(io)?.is_file() {
            continue;
        }
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        if let Some((pattern, rank)) = rank_pattern(&name) {
            groups.entry(pattern).or_default().insert(rank);
        }
    }
    let files_err = |reason: String| Fsdp1LocalError::Files {
        dir: dir.to_path_buf(),
        reason,
    };
    let complete = |pattern: &str| -> Result<usize> {
        let ranks = groups.get(pattern).ok_or_else(|| {
            files_err(format!(
                "no file matches `{pattern}` (`{{r}}` is the rank number)"
            ))
        })?;
        let n = ranks.len();
        if ranks.iter().copied().eq(0..n) {
            Ok(n)
        } else {
            let missing: Vec<String> = (0..ranks.last().map_or(0, |l| l + 1))
                .filter(|r| !ranks.contains(r))
                .map(|r| pattern.replace("{r}", &r.to_string()))
                .collect();
            Err(files_err(format!(
                "per-rank files `{pattern}` are not ranks 0..N: missing {}",
                missing.join(", ")
            )))
        }
    };
    let (model, optim) = match (model_pattern, optim_pattern) {
        (Some(m), o) => (m.to_owned(), o.map(str::to_owned)),
        (None, given_optim) => {
            let candidates: Vec<&String> = groups
                .iter()
                .filter(|(_, ranks)| ranks.iter().copied().eq(0..ranks.len()))
                .map(|(p, _)| p)
                .filter(|p| Some(p.as_str()) != given_optim)
                .collect();
            let mut models = Vec::new();
            let mut optims = Vec::new();
            for p in candidates {
                let file = dir.join(p.replace("{r}", "0"));
                // Files that are not torch archives are not per-rank state (logs, configs). Only
                // the archive structure is read, no tensor bytes.
                let Ok((_, node)) = LazyFile::open(&file) else {
                    continue;
                };
                if is_optimizer_dict(&node) {
                    optims.push(p.clone());
                } else if node.as_dict().is_some_and(|d| {
                    // A model state dict maps names to tensors (or nests one under `model`);
                    // extra state (lr_scheduler, rng, as trainers save it next to the model)
                    // nests dicts of other things.
                    d.get_str("model").is_some()
                        || d.iter()
                            .any(|(_, v)| matches!(v, Node::Tensor(_) | Node::Dist(_)))
                }) {
                    models.push(p.clone());
                }
            }
            let optim = match given_optim {
                Some(o) => Some(o.to_owned()),
                None if optims.len() <= 1 => optims.pop(),
                None => {
                    return Err(files_err(format!(
                        "several optimizer file sets ({}); choose one with --optim-files",
                        optims.join(", ")
                    )));
                }
            };
            match models.as_slice() {
                [one] => (one.clone(), optim),
                [] => {
                    return Err(files_err(
                        "no per-rank model state dicts (torch.save files named with the rank, e.g. model_rank0.pt) found".to_owned(),
                    ));
                }
                many => {
                    return Err(files_err(format!(
                        "several model file sets ({}); choose one with --model-files",
                        many.join(", ")
                    )));
                }
            }
        }
    };
    let world_size = complete(&model)?;
    if let Some(o) = &optim {
        let n = complete(o)?;
        if n != world_size {
            return Err(files_err(format!(
                "{world_size} model files `{model}` but {n} optimizer files `{o}`"
            )));
        }
    }
    Ok(RankFiles {
        dir: dir.to_path_buf(),
        model_pattern: model,
        optim_pattern: optim,
        world_size,
    })
}

/// The state dict in a `torch.save` file with every tensor's dtype and shape but none of its bytes
/// (only the zip directory and the pickle are read): enough to tell what a file holds.
pub fn read_skeleton(path: &Path) -> Result<Node> {
    LazyFile::open(path).map(|(_, node)| node)
}

/// The layout flags of a per-rank checkpoint (its world size is the number of rank files).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutFlags {
    pub use_orig_params: bool,
    pub strategy: Strategy,
    /// HYBRID_SHARD / `_HYBRID_SHARD_ZERO2`: ranks per shard group. Ranks `g*S..(g+1)*S` form
    /// replica `g` (the layout of `init_device_mesh(("replicate", "shard"))`); rank `r` holds the
    /// shard of group rank `r % S`.
    pub shard_group_size: Option<u64>,
}

impl Default for LayoutFlags {
    fn default() -> Self {
        Self {
            use_orig_params: false,
            strategy: Strategy::FullShard,
            shard_group_size: None,
        }
    }
}

/// Reads a model description (`shardscope layout --model` format).
pub fn read_description(path: &Path) -> Result<ModelDescription> {
    let bytes = std::fs::read(path).map_err(|source| Fsdp1LocalError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(ModelDescription::from_json_bytes(
        &bytes,
        &path.display().to_string(),
    )?)
}

fn fsdp1_layout(
    desc: &ModelDescription,
    world_size: usize,
    flags: LayoutFlags,
) -> Result<Fsdp1Layout> {
    let config = LayoutConfig {
        api: Api::Fsdp1,
        world_size: world_size as u64,
        shard_group_size: flags.shard_group_size,
        use_orig_params: flags.use_orig_params,
        strategy: flags.strategy,
        param_dtype: None,
    };
    match layout::compute(desc, &config)? {
        Layout::Fsdp1(l) => Ok(l),
        Layout::Fsdp2(_) => Err(Fsdp1LocalError::Files {
            dir: PathBuf::new(),
            reason: "an FSDP2 layout was computed for an FSDP1 checkpoint".to_owned(),
        }),
    }
}

/// The opened inputs of a per-rank checkpoint: archive structures and skeletons, no tensor bytes.
#[derive(Debug)]
struct Inputs {
    files: RankFiles,
    models: Vec<LazyFile>,
    /// Each rank's LOCAL model state dict, tensors unread.
    model_skeletons: Vec<Dict>,
    optims: Option<(Vec<LazyFile>, Vec<Dict>)>,
}

fn open_dict(path: &Path) -> Result<(LazyFile, Dict)> {
    match LazyFile::open(path)? {
        (f, Node::Dict(d)) => Ok((f, d)),
        (_, other) => Err(Fsdp1LocalError::Content {
            file: path.to_path_buf(),
            reason: format!("expected a state dict, found {}", other.kind_name()),
        }),
    }
}

fn open_inputs(files: RankFiles) -> Result<Inputs> {
    let mut models = Vec::with_capacity(files.world_size);
    let mut model_skeletons = Vec::with_capacity(files.world_size);
    for r in 0..files.world_size {
        let (f, d) = open_dict(&files.model_file(r))?;
        models.push(f);
        model_skeletons.push(d);
    }
    let optims = match &files.optim_pattern {
        Some(_) => {
            let mut lazies = Vec::with_capacity(files.world_size);
            let mut dicts = Vec::with_capacity(files.world_size);
            for r in 0..files.world_size {
                let path = files.optim_file(r).unwrap_or_default();
                let (f, d) = open_dict(&path)?;
                if !is_optimizer_dict(&Node::Dict(d.clone())) {
                    return Err(Fsdp1LocalError::Content {
                        file: path,
                        reason: "not an optimizer state dict (no `state` and `param_groups` keys)"
                            .to_owned(),
                    });
                }
                lazies.push(f);
                dicts.push(d);
            }
            Some((lazies, dicts))
        }
        None => None,
    };
    Ok(Inputs {
        files,
        models,
        model_skeletons,
        optims,
    })
}

/// The optimizer parameter names in id order (see the module doc), checked against every rank's
/// `param_groups`.
fn optim_param_names(
    model: &Fsdp1Model<'_>,
    optims: &[Dict],
    files: &RankFiles,
) -> Result<Vec<String>> {
    let names: Vec<String> = model.wrapped_params().into_iter().map(|(n, _)| n).collect();
    for (r, osd) in optims.iter().enumerate() {
        let ids: usize = osd
            .get_str("param_groups")
            .and_then(Node::as_list)
            .map_or(0, |groups| {
                groups
                    .iter()
                    .filter_map(|g| g.as_dict()?.get_str("params")?.as_list().map(<[Node]>::len))
                    .sum()
            });
        if ids != names.len() {
            return Err(Fsdp1LocalError::Content {
                file: files.optim_file(r).unwrap_or_default(),
                reason: format!(
                    "param_groups list {ids} parameters, but the FSDP-wrapped model has {} ({}); hint: the optimizer must be built over model.parameters() of the wrapped model, and --use-orig-params must match how it was wrapped",
                    names.len(),
                    if model.use_orig_params() {
                        "use_orig_params=True"
                    } else {
                        "use_orig_params=False"
                    }
                ),
            });
        }
    }
    Ok(names)
}

fn transform_err(what: impl Into<String>) -> impl FnOnce(TransformError) -> Fsdp1LocalError {
    let what = what.into();
    move |source| Fsdp1LocalError::Transform {
        what,
        source: Box::new(source),
    }
}

// ------------------------------------------------------------------------------------------------
// Model state, read a parameter range at a time.

/// The source model: flat shards are read from the rank files on demand.
struct ModelSource<'a> {
    model: &'a Fsdp1Model<'a>,
    inputs: &'a Inputs,
    /// NO_SHARD: torch saves the FULL state dict on every rank whatever the state-dict type, so
    /// each model file is already the full model; rank 0's is read.
    full_files: bool,
}

impl ModelSource<'_> {
    fn what(&self) -> String {
        format!(
            "{}: LOCAL model state dicts",
            self.inputs
                .files
                .dir
                .join(&self.inputs.files.model_pattern)
                .display()
        )
    }

    /// Every rank's `_flat_param` entry exists and has the length and dtype of the layout (what
    /// `model_full_from_local` checks), without reading it.
    fn check(&self) -> Result<()> {
        if self.full_files {
            return self.check_full();
        }
        for flat in &self.model.layout.flat_params {
            for (r, d) in self.inputs.model_skeletons.iter().enumerate() {
                let entry =
                    d.get_str(&flat.flat_param_fqn)
                        .ok_or_else(|| TransformError::MissingKey {
                            path: "LOCAL state dict".to_owned(),
                            key: flat.flat_param_fqn.clone(),
                        });
                let shard = entry.and_then(|e| shard_of_local_entry(flat, e));
                let shard = shard.map_err(transform_err(self.what()))?;
                let len = shard.numel();
                let padded = flat.sharded_numel;
                let unpadded = unpadded_shard_numel(flat, r as u64 % self.model.shard_group_size());
                if shard.dim() != 1
                    || (len != padded && len != unpadded)
                    || shard.dtype != flat.dtype
                {
                    return Err(transform_err(self.what())(TransformError::BadTensor {
                        path: format!("{} (rank {r})", flat.flat_param_fqn),
                        reason: format!(
                            "expected a 1-D {} shard of {padded} (padded) or {unpadded} elements, got {} {:?}",
                            flat.dtype, shard.dtype, shard.shape
                        ),
                    }));
                }
            }
        }
        Ok(())
    }

    /// NO_SHARD files: rank 0's file holds every parameter with its full shape and dtype.
    fn check_full(&self) -> Result<()> {
        let first = self.inputs.model_skeletons.first();
        for flat in &self.model.layout.flat_params {
            for (i, fqn) in flat.fqns.iter().enumerate() {
                let entry = first.and_then(|d| d.get_str(fqn));
                let ok = entry
                    .and_then(Node::as_tensor)
                    .is_some_and(|t| t.shape == flat.shapes[i] && t.dtype == flat.dtype);
                if !ok {
                    let err = match entry {
                        None => TransformError::MissingKey {
                            path: "state dict (NO_SHARD files hold the full model)".to_owned(),
                            key: fqn.clone(),
                        },
                        Some(v) => TransformError::BadTensor {
                            path: fqn.clone(),
                            reason: format!(
                                "expected a {} tensor of shape {:?}, got {}",
                                flat.dtype,
                                flat.shapes[i],
                                v.as_tensor().map_or_else(
                                    || v.kind_name().to_owned(),
                                    |t| format!("{} {:?}", t.dtype, t.shape)
                                )
                            ),
                        },
                    };
                    return Err(transform_err(self.what())(err));
                }
            }
        }
        Ok(())
    }

    /// Elements `first..` of rank `rank`'s shard of flat parameter `f`, into `out`.
    fn shard_into(&self, f: usize, rank: u64, first: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let flat = self.model.flat(f);
        let file = &self.inputs.models[rank as usize];
        file.read_elems_into(&format!("/{}", flat.flat_param_fqn), first, out)
    }

    /// Elements `first..` of the flattened full parameter `param` of flat parameter `f`, into
    /// `out` (zeroed by the caller; left zero where no rank holds the parameter, as
    /// `full_param_from_flat_shards`).
    fn param_into(&self, f: usize, param: usize, first: u64, out: &mut [u8]) -> Result<()> {
        let flat = self.model.flat(f);
        if self.full_files {
            let path = format!("/{}", flat.fqns[param]);
            return self.inputs.models[0].read_elems_into(&path, first, out);
        }
        let item = flat.dtype.size_bytes();
        let n = (out.len() / item) as u64;
        for copy in param_copies(flat, param) {
            let lo = first.max(copy.offset_in_param);
            let hi = (first + n).min(copy.offset_in_param + copy.numel);
            if lo < hi {
                let at = (lo - first) as usize * item;
                let end = (hi - first) as usize * item;
                self.shard_into(
                    f,
                    copy.rank,
                    copy.offset_in_shard + (lo - copy.offset_in_param),
                    &mut out[at..end],
                )?;
            }
        }
        Ok(())
    }

    fn full_param(&self, f: usize, param: usize) -> Result<Vec<u8>> {
        let flat = self.model.flat(f);
        let mut out = vec![0u8; flat.numels[param] as usize * flat.dtype.size_bytes()];
        self.param_into(f, param, 0, &mut out)?;
        Ok(out)
    }

    /// Rank `rank`'s padded shard of flat parameter `di` of `dst`, padding segments filled with
    /// [`TORCH_PADDING_FILL`] (what `model_local_from_full` stores).
    fn dst_shard(&self, dst: &Fsdp1Model<'_>, di: usize, rank: u64) -> Result<Vec<u8>> {
        let flat = dst.flat(di);
        let item = flat.dtype.size_bytes();
        let fill_one = fill_bytes(flat.dtype, TORCH_PADDING_FILL).ok_or_else(|| {
            transform_err("destination layout")(TransformError::FillDType { dtype: flat.dtype })
        })?;
        let len = flat.sharded_numel;
        let mut data = vec![0u8; len as usize * item];
        for piece in flat.rank_pieces(rank) {
            let start = piece.offset_in_shard.min(len);
            let end = (piece.offset_in_shard + piece.numel).min(len);
            let bytes = &mut data[start as usize * item..end as usize * item];
            match piece.kind {
                PieceKind::Param { param, intra_start } => {
                    let name = &flat.fqns[param];
                    let (sf, si) = self.model.managed_position(name).ok_or_else(|| {
                        transform_err(self.what())(TransformError::MissingKey {
                            path: flat.flat_param_fqn.clone(),
                            key: name.clone(),
                        })
                    })?;
                    self.param_into(sf, si, intra_start, bytes)?;
                }
                PieceKind::SegmentPadding => {
                    for chunk in bytes.chunks_exact_mut(item) {
                        chunk.copy_from_slice(&fill_one);
                    }
                }
                PieceKind::ShardTail => {}
            }
        }
        Ok(data)
    }

    fn first_keys(&self) -> Vec<String> {
        self.inputs
            .model_skeletons
            .first()
            .map(|d| d.keys().map(ToString::to_string).collect())
            .unwrap_or_default()
    }

    /// The source entry `key` of rank 0 (a skeleton), with the paths of its tensors.
    fn plain(&self, key: &str, fills: &mut HashMap<String, Fill>) -> Node {
        let node = self
            .inputs
            .model_skeletons
            .first()
            .and_then(|d| d.get_str(key))
            .cloned()
            .unwrap_or(Node::None);
        let mut paths = Vec::new();
        lazy::tensor_paths(&node, &format!("/{key}"), &mut paths);
        for p in paths {
            fills.insert(p.clone(), Fill::Source(p));
        }
        node
    }

    /// The bytes of one output tensor.
    fn fill(
        &self,
        fill: &Fill,
        dst: Option<&Fsdp1Model<'_>>,
        rank: u64,
        cache: &mut ShardCache,
    ) -> Result<Vec<u8>> {
        match fill {
            Fill::Source(path) => self.inputs.models[0].read_tensor(path),
            Fill::Param { flat, param } => self.full_param(*flat, *param),
            Fill::Shard { flat, len }
            | Fill::View {
                flat,
                start: _,
                len,
            } if dst.is_none() => {
                let _ = (flat, len);
                Ok(Vec::new())
            }
            Fill::Shard { flat, len } => {
                // The flat entry comes after its unit's views: hand the shard over.
                cache.get(self, dst, *flat, rank)?;
                let mut shard = std::mem::take(&mut cache.data);
                cache.key = None;
                shard.truncate(*len);
                Ok(shard)
            }
            Fill::View { flat, start, len } => {
                let shard = cache.get(self, dst, *flat, rank)?;
                Ok(shard[*start..*start + *len].to_vec())
            }
        }
    }
}

/// Where one output tensor's bytes come from (byte offsets for `Shard`/`View`).
#[derive(Debug, Clone)]
enum Fill {
    /// The tensor at the same path in rank 0's model file.
    Source(String),
    /// A full parameter of the source.
    Param { flat: usize, param: usize },
    /// The first `len` bytes of the destination rank's shard of flat parameter `flat`.
    Shard { flat: usize, len: usize },
    /// Bytes `start..start + len` of that shard (a `use_orig_params` view).
    View {
        flat: usize,
        start: usize,
        len: usize,
    },
}

/// The destination shard last built (views and the flat entry of one unit share it).
#[derive(Default)]
struct ShardCache {
    key: Option<usize>,
    data: Vec<u8>,
}

impl ShardCache {
    fn get(
        &mut self,
        src: &ModelSource<'_>,
        dst: Option<&Fsdp1Model<'_>>,
        flat: usize,
        rank: u64,
    ) -> Result<&[u8]> {
        if self.key != Some(flat) {
            self.data = Vec::new();
            let Some(dst) = dst else {
                return Ok(&[]);
            };
            self.data = src.dst_shard(dst, flat, rank)?;
            self.key = Some(flat);
        }
        Ok(&self.data)
    }
}

/// The FULL model state dict as a skeleton, with the source of each tensor.
/// The FULL model state dict's keys: rank 0's own order for NO_SHARD files (they are FULL state
/// dicts), else [`full_key_plan`].
fn full_plan(src: &ModelSource<'_>) -> Vec<(String, FullKey)> {
    if src.full_files {
        src.first_keys()
            .into_iter()
            .map(|k| (k, FullKey::Plain))
            .collect()
    } else {
        full_key_plan(src.model, &src.first_keys())
    }
}

fn full_model_skeleton(src: &ModelSource<'_>) -> (Dict, HashMap<String, Fill>) {
    let mut fills = HashMap::new();
    let mut out = Dict::new();
    for (name, key) in full_plan(src) {
        let node = match key {
            FullKey::Managed { flat, param } => {
                let f = src.model.flat(flat);
                fills.insert(format!("/{name}"), Fill::Param { flat, param });
                Node::Tensor(Tensor {
                    dtype: f.dtype,
                    shape: f.shapes[param].clone(),
                    data: Vec::new(),
                })
            }
            FullKey::Plain => src.plain(&name, &mut fills),
        };
        out.insert(Key::Str(name), node);
    }
    (out, fills)
}

/// Rank `rank`'s LOCAL model state dict of `dst` as a skeleton (as `model_local_from_full`).
fn local_model_skeleton(
    src: &ModelSource<'_>,
    dst: &Fsdp1Model<'_>,
    rank: u64,
) -> (Dict, HashMap<String, Fill>) {
    let full = full_plan(src);
    let mut fills = HashMap::new();
    let mut out = Dict::new();
    for (name, key) in local_key_plan(dst, &full) {
        let node = match key {
            LocalKey::Flat(i) => {
                let flat = dst.flat(i);
                let item = flat.dtype.size_bytes();
                let chunks = flat
                    .ranks
                    .iter()
                    .filter(|r| unpadded_shard_numel(flat, r.rank) > 0)
                    .map(|r| ChunkMeta {
                        offsets: vec![r.rank * flat.sharded_numel],
                        sizes: vec![unpadded_shard_numel(flat, r.rank)],
                        placement: Some(format!("rank:{}/cpu", r.rank)),
                    })
                    .collect();
                let n = unpadded_shard_numel(flat, rank);
                let local = (n > 0).then(|| {
                    (
                        vec![rank * flat.sharded_numel],
                        Tensor {
                            dtype: flat.dtype,
                            shape: vec![n],
                            data: Vec::new(),
                        },
                    )
                });
                fills.insert(
                    format!("/{name}"),
                    Fill::Shard {
                        flat: i,
                        len: n as usize * item,
                    },
                );
                Node::Dist(DistTensor {
                    kind: DistKind::ShardedTensor,
                    dtype: flat.dtype,
                    global_shape: vec![flat.unpadded_unsharded_numel],
                    local,
                    chunks,
                })
            }
            LocalKey::View { flat, param } => {
                let f = dst.flat(flat);
                let item = f.dtype.size_bytes();
                let info = &f.ranks[rank as usize].shard_param_infos[param];
                let (offset, n) = match (info.offset_in_shard, info.numel_in_shard) {
                    (Some(o), Some(n)) if info.in_shard => (o, n),
                    _ => (0, 0),
                };
                fills.insert(
                    format!("/{name}"),
                    Fill::View {
                        flat,
                        start: offset as usize * item,
                        len: n as usize * item,
                    },
                );
                Node::Tensor(Tensor {
                    dtype: f.dtype,
                    shape: vec![n],
                    data: Vec::new(),
                })
            }
            LocalKey::Plain => src.plain(&name, &mut fills),
        };
        out.insert(Key::Str(name), node);
    }
    (out, fills)
}

fn missing_fill(path: &str) -> Fsdp1LocalError {
    Fsdp1LocalError::Content {
        file: PathBuf::from("<output>"),
        reason: format!("no source for output tensor `{path}`"),
    }
}

// ------------------------------------------------------------------------------------------------
// Optimizer state.
//
// Structure (keys, state names, scalar states, `param_groups`, and PyTorch's checks) comes from the
// in-memory transforms (`full_optim_from_local`, `local_optim_from_full`) run one *piece* at a time:
// the state of one flat parameter, of one unmanaged parameter, or the entries FSDP does not map.
// For flat-parameter pieces every positive-dimension state tensor is replaced by a 1-byte stand-in
// of the same shape (a 1-byte dtype per real dtype), so the transforms move a quarter of the bytes
// of float32 state and nothing else changes. The real bytes of those tensors are then read
// straight from the source files a destination tensor at a time: every such output element is one
// element of one parameter's full state, which lives at a known place in one source rank's
// tensor (the flat parameter's state, or the original parameter's piece).

/// Which part of the optimizer state a state entry belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum PieceKey {
    /// Every parameter of one flat parameter (its FlatParameter id, or its original parameters).
    Flat(usize),
    /// One parameter FSDP does not manage.
    Plain(String),
    /// Entries FSDP cannot map (user states, ids outside the optimizer); always present, so that
    /// `param_groups` come out even without any state.
    Extras,
}

/// 1-byte dtypes that stand in for the real dtypes of positive-dimension states.
const STAND_INS: [DType; 5] = [
    DType::UInt8,
    DType::Int8,
    DType::Bool,
    DType::Float8E4M3Fn,
    DType::Float8E5M2,
];

struct OptimSource<'a> {
    model: &'a Fsdp1Model<'a>,
    files: &'a [LazyFile],
    skeletons: &'a [Dict],
    names: Vec<Vec<String>>,
    pieces: Vec<PieceKey>,
    /// Per rank: state key -> piece index.
    assign: Vec<HashMap<Key, usize>>,
    /// Per rank: flat parameter -> path of its FlatParameter's state (`/state/<id>`).
    flat_state: Vec<HashMap<usize, String>>,
    /// Per rank: (flat parameter, parameter) -> path of the original parameter's state.
    orig_state: Vec<HashMap<(usize, usize), String>>,
    /// Real dtype -> stand-in, `None` when there are more dtypes than stand-ins (then the
    /// structure pass reads real bytes).
    stand_in: Option<HashMap<DType, DType>>,
    what: String,
}

impl<'a> OptimSource<'a> {
    fn new(model: &'a Fsdp1Model<'a>, inputs: &'a Inputs) -> Result<Option<Self>> {
        let Some((files, skeletons)) = &inputs.optims else {
            return Ok(None);
        };
        let names = optim_param_names(model, skeletons, &inputs.files)?;
        // Hybrid sharding: the first replica's shard group holds everything.
        let group = usize::try_from(model.shard_group_size())
            .unwrap_or(usize::MAX)
            .min(skeletons.len());
        let (files, skeletons) = (&files[..group], &skeletons[..group]);
        let names = vec![names; skeletons.len()];
        let mut pieces: Vec<PieceKey> = Vec::new();
        let mut index: HashMap<PieceKey, usize> = HashMap::new();
        let mut assign = Vec::with_capacity(skeletons.len());
        let mut flat_state = Vec::with_capacity(skeletons.len());
        let mut orig_state = Vec::with_capacity(skeletons.len());
        let mut dtypes: BTreeSet<DType> = BTreeSet::new();
        for (r, osd) in skeletons.iter().enumerate() {
            let mut map = HashMap::new();
            let mut flats = HashMap::new();
            let mut origs = HashMap::new();
            if let Some(state) = osd.get_str("state").and_then(Node::as_dict) {
                for (k, v) in state.iter() {
                    let param = match k {
                        Key::Int(id) => usize::try_from(*id)
                            .ok()
                            .and_then(|i| names[r].get(i))
                            .and_then(|n| model.param_ref(n)),
                        Key::Str(_) => None,
                    };
                    let path = format!("/state/{k}");
                    let piece = match param {
                        Some(ParamRef::Flat(f)) => {
                            flats.insert(f, path);
                            PieceKey::Flat(f)
                        }
                        Some(ParamRef::Orig { flat, index }) => {
                            origs.insert((flat, index), path);
                            PieceKey::Flat(flat)
                        }
                        Some(ParamRef::Plain(n)) => PieceKey::Plain(n),
                        None => PieceKey::Extras,
                    };
                    if matches!(piece, PieceKey::Flat(_))
                        && let Some(d) = v.as_dict()
                    {
                        for t in d.iter().filter_map(|(_, x)| x.as_tensor()) {
                            if t.dim() > 0 {
                                dtypes.insert(t.dtype);
                            }
                        }
                    }
                    let next = pieces.len();
                    let i = *index.entry(piece.clone()).or_insert(next);
                    if i == next {
                        pieces.push(piece);
                    }
                    map.insert(k.clone(), i);
                }
            }
            assign.push(map);
            flat_state.push(flats);
            orig_state.push(origs);
        }
        if !index.contains_key(&PieceKey::Extras) {
            pieces.push(PieceKey::Extras);
        }
        let stand_in =
            (dtypes.len() <= STAND_INS.len()).then(|| dtypes.into_iter().zip(STAND_INS).collect());
        let what = format!(
            "{}: optimizer state dicts",
            inputs
                .files
                .dir
                .join(inputs.files.optim_pattern.as_deref().unwrap_or_default())
                .display()
        );
        Ok(Some(OptimSource {
            model,
            files,
            skeletons,
            names,
            pieces,
            assign,
            flat_state,
            orig_state,
            stand_in,
            what,
        }))
    }

    fn is_flat(&self, p: usize) -> bool {
        matches!(self.pieces.get(p), Some(PieceKey::Flat(_)))
    }

    /// Every rank's optimizer state dict with only piece `keep`'s state entries (positive-dim
    /// states of flat pieces as stand-ins, everything else read), or with all entries and
    /// positive-dimension tensors replaced by `None` (`keep` = `None`).
    /// The runs of piece `p` through the transforms: one per positive-dimension state name for a
    /// flat piece with stand-ins (so one run holds one state's bytes), else one.
    fn runs(&self, p: usize) -> Vec<Option<Key>> {
        if !(self.is_flat(p) && self.stand_in.is_some()) {
            return vec![None];
        }
        let mut names: BTreeSet<Key> = BTreeSet::new();
        for (r, osd) in self.skeletons.iter().enumerate() {
            let Some(state) = osd.get_str("state").and_then(Node::as_dict) else {
                continue;
            };
            for (k, v) in state.iter() {
                if self.assign[r].get(k) != Some(&p) {
                    continue;
                }
                for (name, x) in v.as_dict().map(Dict::iter).into_iter().flatten() {
                    if x.as_tensor().is_some_and(|t| t.dim() > 0) {
                        names.insert(name.clone());
                    }
                }
            }
        }
        if names.is_empty() {
            vec![None]
        } else {
            names.into_iter().map(Some).collect()
        }
    }

    fn restricted(&self, keep: Option<usize>, only: Option<&Key>) -> Result<Vec<Dict>> {
        let stand_in = match keep {
            Some(p) if self.is_flat(p) => self.stand_in.as_ref(),
            _ => None,
        };
        let mut out = Vec::with_capacity(self.skeletons.len());
        for (r, osd) in self.skeletons.iter().enumerate() {
            let file = &self.files[r];
            let mut d = Dict::new();
            for (k, v) in osd.iter() {
                let path = format!("/{k}");
                let value = match (k.as_str(), v) {
                    (Some("state"), Node::Dict(state)) => {
                        let mut s = Dict::new();
                        for (sk, sv) in state.iter() {
                            let spath = format!("{path}/{sk}");
                            match keep {
                                Some(p) if self.assign[r].get(sk) == Some(&p) => {
                                    let value = match stand_in {
                                        Some(map) => with_stand_ins(
                                            file,
                                            &only_state(sv, only),
                                            &spath,
                                            map,
                                        )?,
                                        None => file.materialize(sv, &spath)?,
                                    };
                                    s.insert(sk.clone(), value);
                                }
                                Some(_) => {}
                                None => s.insert(sk.clone(), without_tensors(file, sv, &spath)?),
                            }
                        }
                        Node::Dict(s)
                    }
                    _ => file.materialize(v, &path)?,
                };
                d.insert(k.clone(), value);
            }
            out.push(d);
        }
        Ok(out)
    }

    fn full(&self, locals: &[Dict]) -> Result<Dict> {
        let refs: Vec<&Dict> = locals.iter().collect();
        full_optim_from_local(self.model, &refs, &self.names, 0, None)
            .map_err(transform_err(self.what.clone()))
    }

    /// The FULL (FQN-keyed) optimizer state of piece `p` (stand-ins for a flat piece), with only
    /// the positive-dimension state `only` when given.
    fn full_piece(&self, p: usize, only: Option<&Key>) -> Result<Dict> {
        let locals = self.restricted(Some(p), only)?;
        self.full(&locals)
    }

    /// The keys of the whole FULL state in PyTorch's order (computed without tensor bytes).
    fn full_order(&self) -> Result<HashMap<Key, usize>> {
        let locals = self.restricted(None, None)?;
        let full = self.full(&locals)?;
        Ok(full
            .get_str("state")
            .and_then(Node::as_dict)
            .map(|s| s.keys().cloned().enumerate().map(|(i, k)| (k, i)).collect())
            .unwrap_or_default())
    }

    /// The real dtype of a stand-in.
    fn real_dtype(&self, dtype: DType) -> DType {
        self.stand_in
            .as_ref()
            .and_then(|m| m.iter().find(|(_, s)| **s == dtype).map(|(r, _)| *r))
            .unwrap_or(dtype)
    }

    /// Elements `first..` of state `name` of source parameter `param` of flat parameter `f` (its
    /// full state, flattened) into `out` (zeroed by the caller), read from the ranks that hold
    /// them; left zero where no rank has state (frozen parameters), as the transforms fill them.
    fn state_into(
        &self,
        name: &Key,
        flat_index: usize,
        param: usize,
        first: u64,
        dtype: DType,
        out: &mut [u8],
    ) -> Result<()> {
        let flat = self.model.flat(flat_index);
        let item = dtype.size_bytes();
        let count = (out.len() / item) as u64;
        for copy in param_copies(flat, param) {
            let lo = first.max(copy.offset_in_param);
            let hi = (first + count).min(copy.offset_in_param + copy.numel);
            if lo >= hi {
                continue;
            }
            let rank = copy.rank as usize;
            let (path, at) = if let Some(p) = self.flat_state[rank].get(&flat_index) {
                (
                    format!("{p}/{name}"),
                    copy.offset_in_shard + (lo - copy.offset_in_param),
                )
            } else if let Some(p) = self.orig_state[rank].get(&(flat_index, param)) {
                (format!("{p}/{name}"), lo - copy.offset_in_param)
            } else {
                continue;
            };
            let file = &self.files[rank];
            match file.dtype_at(&path) {
                Some(d) if d == dtype => {}
                Some(d) => {
                    return Err(Fsdp1LocalError::Content {
                        file: file.path.clone(),
                        reason: format!("`{path}` is {d}, expected {dtype}"),
                    });
                }
                None => continue,
            }
            let from = (lo - first) as usize * item;
            let to = (hi - first) as usize * item;
            file.read_elems_into(&path, at, &mut out[from..to])?;
        }
        Ok(())
    }

    fn state_vec(
        &self,
        name: &Key,
        f: usize,
        param: usize,
        first: u64,
        n: u64,
        dtype: DType,
    ) -> Result<Vec<u8>> {
        let mut out = vec![0u8; n as usize * dtype.size_bytes()];
        self.state_into(name, f, param, first, dtype, &mut out)?;
        Ok(out)
    }

    /// The source (flat parameter, parameter) of a clean FQN.
    fn position(&self, fqn: &str) -> Result<(usize, usize)> {
        self.model.managed_position(fqn).ok_or_else(|| {
            transform_err(self.what.clone())(TransformError::UnknownParam {
                path: "optimizer state".to_owned(),
                what: "parameter",
                name: fqn.to_owned(),
            })
        })
    }

    /// FULL output `state[fqn][name]`: the parameter's full state.
    fn full_state(&self, fqn: &str, name: &Key, dtype: DType) -> Result<Vec<u8>> {
        let (f, i) = self.position(fqn)?;
        let numel = self.model.flat(f).numels[i];
        self.state_vec(name, f, i, 0, numel, dtype)
    }

    /// LOCAL output of `dst` rank `rank`: `state[id][name]` for destination parameter `param`.
    fn local_state(
        &self,
        dst: &Fsdp1Model<'_>,
        param: &ParamRef,
        rank: u64,
        name: &Key,
        dtype: DType,
    ) -> Result<Vec<u8>> {
        let item = dtype.size_bytes();
        match param {
            // `_flatten_optim_state`: the parameters' states concatenated (no padding segments),
            // this rank's `torch.chunk` piece, right-padded with zeros.
            ParamRef::Flat(df) => {
                let flat = dst.flat(*df);
                let total: u64 = flat.numels.iter().sum();
                let ws = flat.ranks.len() as u64;
                let (lo, hi, len) = if flat.padded_unsharded_numel.is_none() || ws == 1 {
                    (0, total, total)
                } else {
                    let (lo, hi) = layout::chunk::chunk_range(total, ws, rank);
                    (lo, hi, layout::chunk::chunk_size(total, ws))
                };
                let mut out = vec![0u8; len as usize * item];
                let mut start = 0u64;
                for (i, fqn) in flat.fqns.iter().enumerate() {
                    let end = start + flat.numels[i];
                    let (first, last) = (lo.max(start), hi.min(end));
                    if first < last {
                        let (src_flat, src_param) = self.position(fqn)?;
                        let from = (first - lo) as usize * item;
                        let to = (last - lo) as usize * item;
                        let into = &mut out[from..to];
                        self.state_into(name, src_flat, src_param, first - start, dtype, into)?;
                    }
                    start = end;
                }
                Ok(out)
            }
            // `_shard_orig_param_state`: elements `intra_param_start_idx..=end` of the state.
            ParamRef::Orig { flat, index } => {
                let layout = dst.flat(*flat);
                let fqn = &layout.fqns[*index];
                let (f, p) = self.position(fqn)?;
                if layout.padded_unsharded_numel.is_none() {
                    return self.full_state(fqn, name, dtype);
                }
                let info = &layout.ranks[rank as usize].shard_param_infos[*index];
                match (
                    info.in_shard,
                    info.intra_param_start_idx,
                    info.intra_param_end_idx,
                ) {
                    (true, Some(start), Some(end)) => {
                        self.state_vec(name, f, p, start, end - start + 1, dtype)
                    }
                    _ => Ok(Vec::new()),
                }
            }
            ParamRef::Plain(n) => Err(Fsdp1LocalError::Content {
                file: PathBuf::from("<output>"),
                reason: format!("unmanaged parameter `{n}` in a flat-parameter piece"),
            }),
        }
    }
}

/// A state entry with only the positive-dimension state `only` (others dropped) when given.
fn only_state(node: &Node, only: Option<&Key>) -> Node {
    match (node, only) {
        (Node::Dict(d), Some(keep)) => Node::Dict(
            d.iter()
                .filter(|(k, v)| *k == keep || v.as_tensor().is_none_or(|t| t.dim() == 0))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        _ => node.clone(),
    }
}

fn is_pos_state(node: &Node) -> bool {
    node.as_tensor().is_some_and(|t| t.dim() > 0)
}

/// One state entry from two runs of a piece that differ in their positive-dimension states: the
/// other entries are the same; each positive-dimension state keeps its place among them (states
/// at the same place by name, as the transforms sort them).
fn merge_runs(before: Node, new: Node) -> Node {
    let (before, new) = match (before, new) {
        (Node::Dict(b), Node::Dict(n)) => (b, n),
        (_, new) => return new,
    };
    let mut rest: Vec<(Key, Node)> = Vec::new();
    let mut placed: Vec<(usize, Key, Node)> = Vec::new();
    for (k, v) in before.into_entries() {
        if is_pos_state(&v) {
            placed.push((rest.len(), k, v));
        } else {
            rest.push((k, v));
        }
    }
    let mut seen = 0usize;
    for (k, v) in new.into_entries() {
        if is_pos_state(&v) {
            if !placed.iter().any(|(_, pk, _)| *pk == k) {
                placed.push((seen, k, v));
            }
        } else {
            seen += 1;
        }
    }
    placed.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let mut out = Dict::new();
    let mut placed = placed.into_iter().peekable();
    for (i, (k, v)) in rest.into_iter().enumerate() {
        while let Some((_, pk, pv)) = placed.next_if(|(at, _, _)| *at <= i) {
            out.insert(pk, pv);
        }
        out.insert(k, v);
    }
    for (_, pk, pv) in placed {
        out.insert(pk, pv);
    }
    Node::Dict(out)
}

/// `node` with positive-dimension tensors replaced by zero stand-ins of the same shape.
fn with_stand_ins(
    file: &LazyFile,
    node: &Node,
    path: &str,
    map: &HashMap<DType, DType>,
) -> Result<Node> {
    Ok(match node {
        Node::Tensor(t) if t.dim() > 0 => match map.get(&t.dtype) {
            Some(&dtype) => Node::Tensor(Tensor {
                dtype,
                shape: t.shape.clone(),
                data: vec![0u8; usize::try_from(t.numel()).unwrap_or(usize::MAX)],
            }),
            None => file.materialize(node, path)?,
        },
        Node::Dict(d) => Node::Dict(
            d.iter()
                .map(|(k, v)| {
                    Ok((
                        k.clone(),
                        with_stand_ins(file, v, &format!("{path}/{k}"), map)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .collect(),
        ),
        other => file.materialize(other, path)?,
    })
}

/// `node` with positive-dimension tensors replaced by `None` and the others read: enough for the
/// transforms to compute key order.
fn without_tensors(file: &LazyFile, node: &Node, path: &str) -> Result<Node> {
    Ok(match node {
        Node::Tensor(t) if t.dim() > 0 => Node::None,
        Node::Dist(_) => Node::None,
        Node::Dict(d) => Node::Dict(
            d.iter()
                .map(|(k, v)| Ok((k.clone(), without_tensors(file, v, &format!("{path}/{k}"))?)))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .collect(),
        ),
        other => file.materialize(other, path)?,
    })
}

/// Where the bytes of one optimizer output tensor come from.
#[derive(Debug, Clone)]
enum OptimFill {
    /// Known already (scalar states, `param_groups` values).
    Bytes(Vec<u8>),
    /// Tensor of a non-flat piece: recompute that piece.
    Piece(usize),
    /// `state[key][name]` of a flat piece: read from the source files.
    Direct { key: Key, name: Key, dtype: DType },
}

/// One output optimizer state dict, planned from pieces: the skeleton and each tensor's source.
struct OptimPlan {
    skeleton: Dict,
    fills: HashMap<String, OptimFill>,
}

impl OptimPlan {
    fn new() -> Self {
        OptimPlan {
            skeleton: Dict::new(),
            fills: HashMap::new(),
        }
    }

    /// Adds piece `p`'s output `d` (its bytes are dropped right away); `order` ranks state keys.
    fn add(&mut self, optim: &OptimSource<'_>, p: usize, d: Dict, order: impl Fn(&Key) -> usize) {
        let flat = optim.is_flat(p) && optim.stand_in.is_some();
        let mut state = match self.skeleton.remove(&Key::str("state")) {
            Some(Node::Dict(s)) => s,
            _ => Dict::new(),
        };
        let mut others = Dict::new();
        for (k, v) in d.into_entries() {
            if k.as_str() == Some("state")
                && let Node::Dict(piece_state) = v
            {
                for (sk, sv) in piece_state.into_entries() {
                    let path = format!("/state/{sk}");
                    let sv =
                        plan_fills(optim, sv, &path, p, flat, &mut self.fills, |name, dtype| {
                            OptimFill::Direct {
                                key: sk.clone(),
                                name: name.clone(),
                                dtype,
                            }
                        });
                    let sv = match state.remove(&sk) {
                        Some(before) => merge_runs(before, sv),
                        None => sv,
                    };
                    state.insert(sk, sv);
                }
            } else {
                // Every piece carries the same non-state entries (`param_groups`); keep the last.
                let path = format!("/{k}");
                let v = plan_fills(optim, v, &path, p, false, &mut self.fills, |_, _| {
                    OptimFill::Piece(p)
                });
                others.insert(k, v);
            }
        }
        let mut entries: Vec<(Key, Node)> = state.into_entries();
        entries.sort_by_key(|(k, _)| order(k));
        self.skeleton = Dict::new();
        self.skeleton
            .insert(Key::str("state"), Node::Dict(entries.into_iter().collect()));
        for (k, v) in others.into_entries() {
            self.skeleton.insert(k, v);
        }
    }
}

/// Strips the bytes of every tensor of `node` (at `path`, output of piece `p`) and records where
/// they come from: positive-dim direct children `name` of a flat piece's state entry are
/// [`OptimFill::Direct`] (`direct(name, real dtype)`), other tensors of a flat piece keep their
/// bytes, tensors of other pieces are recomputed.
fn plan_fills(
    optim: &OptimSource<'_>,
    node: Node,
    path: &str,
    p: usize,
    flat: bool,
    fills: &mut HashMap<String, OptimFill>,
    direct: impl Fn(&Key, DType) -> OptimFill,
) -> Node {
    let mut bytes = HashMap::new();
    let mut node = lazy::split_tensors(node, path, &mut bytes);
    if flat && let Node::Dict(d) = &mut node {
        let mut out = Dict::new();
        for (name, v) in std::mem::take(d).into_entries() {
            let v = match v {
                Node::Tensor(mut t) if t.dim() > 0 => {
                    t.dtype = optim.real_dtype(t.dtype);
                    let tpath = format!("{path}/{name}");
                    bytes.remove(&tpath);
                    fills.insert(tpath, direct(&name, t.dtype));
                    Node::Tensor(t)
                }
                other => other,
            };
            out.insert(name, v);
        }
        *d = out;
    }
    for (tpath, data) in bytes {
        let fill = if flat || optim.is_flat(p) {
            OptimFill::Bytes(data)
        } else {
            OptimFill::Piece(p)
        };
        fills.insert(tpath, fill);
    }
    node
}

/// Writes `plan`: `direct(key, name, dtype)` computes a [`OptimFill::Direct`] tensor,
/// `produce(piece)` recomputes a piece's tensors (by path), kept until another piece is needed.
fn write_optim<W: Write>(
    out: W,
    plan: &OptimPlan,
    group: (u64, u64),
    global: (u64, u64),
    mut direct: impl FnMut(&Key, &Key, DType) -> Result<Vec<u8>>,
    mut produce: impl FnMut(usize) -> Result<HashMap<String, Vec<u8>>>,
) -> Result<W> {
    let mut cached: Option<(usize, HashMap<String, Vec<u8>>)> = None;
    let skeleton = Node::Dict(plan.skeleton.clone());
    lazy::write_torch_save(
        out,
        &skeleton,
        RootDict::Plain,
        group,
        global,
        |path| match plan.fills.get(path).ok_or_else(|| missing_fill(path))? {
            OptimFill::Bytes(b) => Ok(b.clone()),
            OptimFill::Direct { key, name, dtype } => direct(key, name, *dtype),
            OptimFill::Piece(p) => {
                if cached.as_ref().is_none_or(|(c, _)| c != p) {
                    cached = None;
                    cached = Some((*p, produce(*p)?));
                }
                cached
                    .as_mut()
                    .and_then(|(_, t)| t.remove(path))
                    .ok_or_else(|| missing_fill(path))
            }
        },
    )
}

// ------------------------------------------------------------------------------------------------
// Public entry points.

/// Inputs of [`reshard`].
#[derive(Debug, Clone)]
pub struct ReshardArgs {
    pub src: PathBuf,
    pub model: PathBuf,
    /// Layout flags of the source (and, unless `dst_flags` is given, of the destination).
    pub flags: LayoutFlags,
    pub dst_flags: Option<LayoutFlags>,
    pub to_world_size: usize,
    pub model_pattern: Option<String>,
    pub optim_pattern: Option<String>,
}

/// One file [`reshard`] wrote: its name (inside the destination folder) and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputFile {
    pub name: String,
    pub bytes: u64,
}

/// Per-rank FSDP1 LOCAL files from A ranks to `to_world_size` ranks, written into the folder
/// `out_dir` (the caller makes it appear atomically): `(files found, files written)`. Model files
/// are LOCAL state dicts (`OrderedDict` with `ShardedTensor` flat parameters), optimizer files raw
/// `optim.state_dict()`s for the new ranks. Model tensors are built a destination shard at a
/// time from the source byte ranges they need; optimizer state goes one piece (the state of one
/// flat parameter) at a time through the full (FQN-keyed) form.
pub fn reshard(args: &ReshardArgs, out_dir: &Path) -> Result<(RankFiles, Vec<OutputFile>)> {
    if args.to_world_size == 0 {
        return Err(Fsdp1LocalError::Files {
            dir: args.src.clone(),
            reason: "--to-world-size must be at least 1".to_owned(),
        });
    }
    let files = find_rank_files(
        &args.src,
        args.model_pattern.as_deref(),
        args.optim_pattern.as_deref(),
    )?;
    let desc = read_description(&args.model)?;
    let src_layout = fsdp1_layout(&desc, files.world_size, args.flags)?;
    let dst_flags = args.dst_flags.unwrap_or(args.flags);
    let dst_layout = fsdp1_layout(&desc, args.to_world_size, dst_flags)?;
    let src = Fsdp1Model::new(&desc, &src_layout).map_err(transform_err("source layout"))?;
    let dst = Fsdp1Model::new(&desc, &dst_layout).map_err(transform_err("destination layout"))?;
    let inputs = open_inputs(files)?;
    let model_src = ModelSource {
        model: &src,
        inputs: &inputs,
        full_files: args.flags.strategy == Strategy::NoShard,
    };
    model_src.check()?;
    let optim = OptimSource::new(&src, &inputs)?;
    let dst_names: Vec<String> = dst.wrapped_params().into_iter().map(|(n, _)| n).collect();
    let ws = args.to_world_size as u64;
    // Ranks per destination shard group (all of them unless hybrid); replicas repeat the group.
    let group = dst.shard_group_size();

    // Optimizer plans: every piece's output on every destination rank, without tensor bytes.
    let optim_plans = match &optim {
        Some(optim) => {
            let order = optim.full_order()?;
            let n = dst_names.len();
            // Parameter ids in order, then the entries FSDP does not map, in FULL order.
            let rank_of = |k: &Key| match k {
                Key::Int(id) if usize::try_from(*id).is_ok_and(|i| i < n) => {
                    usize::try_from(*id).unwrap_or(0)
                }
                other => n + order.get(other).copied().unwrap_or(usize::MAX - n),
            };
            let mut plans: Vec<OptimPlan> = (0..group).map(|_| OptimPlan::new()).collect();
            for p in 0..optim.pieces.len() {
                for only in optim.runs(p) {
                    let full = optim.full_piece(p, only.as_ref())?;
                    for (rank, plan) in plans.iter_mut().enumerate() {
                        let local = local_optim_from_full(&dst, &full, rank as u64, &dst_names)
                            .map_err(transform_err(format!(
                                "destination rank {rank} optimizer state"
                            )))?;
                        plan.add(optim, p, local, rank_of);
                    }
                }
            }
            plans
        }
        None => Vec::new(),
    };

    let mut written = Vec::new();
    let mut write_file = |name: String,
                          write: &mut dyn FnMut(BufWriter<File>) -> Result<BufWriter<File>>|
     -> Result<()> {
        let path = out_dir.join(&name);
        let file = File::create(&path).map_err(|source| Fsdp1LocalError::Io {
            path: path.clone(),
            source,
        })?;
        let out = write(BufWriter::new(file))?;
        let file = out.into_inner().map_err(|e| Fsdp1LocalError::Io {
            path: path.clone(),
            source: e.into_error(),
        })?;
        let bytes = file
            .metadata()
            .map_err(|source| Fsdp1LocalError::Io {
                path: path.clone(),
                source,
            })?
            .len();
        written.push(OutputFile { name, bytes });
        Ok(())
    };
    for global in 0..ws {
        let rank = global % group;
        // NO_SHARD: torch saves (and loads) the FULL state dict on every rank.
        let (skeleton, fills) = if dst_flags.strategy == Strategy::NoShard {
            full_model_skeleton(&model_src)
        } else {
            local_model_skeleton(&model_src, &dst, rank)
        };
        let skeleton = Node::Dict(skeleton);
        let mut cache = ShardCache::default();
        write_file(
            inputs
                .files
                .model_pattern
                .replace("{r}", &global.to_string()),
            &mut |out| {
                let pg = ((rank, group), (global, ws));
                lazy::write_torch_save(out, &skeleton, RootDict::Ordered, pg.0, pg.1, |path| {
                    let f = fills.get(path).ok_or_else(|| missing_fill(path))?;
                    model_src.fill(f, Some(&dst), rank, &mut cache)
                })
            },
        )?;
        if let (Some(optim), Some(pattern)) = (&optim, &inputs.files.optim_pattern) {
            let plan = &optim_plans[rank as usize];
            write_file(pattern.replace("{r}", &global.to_string()), &mut |out| {
                write_optim(
                    out,
                    plan,
                    (rank, group),
                    (global, ws),
                    |key, name, dtype| {
                        let param = match key {
                            Key::Int(id) => usize::try_from(*id)
                                .ok()
                                .and_then(|i| dst_names.get(i))
                                .and_then(|n| dst.param_ref(n)),
                            Key::Str(_) => None,
                        };
                        let param = param.ok_or_else(|| missing_fill(&format!("/state/{key}")))?;
                        optim.local_state(&dst, &param, rank, name, dtype)
                    },
                    |p| {
                        let full = optim.full_piece(p, None)?;
                        let local = local_optim_from_full(&dst, &full, rank, &dst_names).map_err(
                            transform_err(format!("destination rank {rank} optimizer state")),
                        )?;
                        drop(full);
                        let mut tensors = HashMap::new();
                        lazy::split_tensors(Node::Dict(local), "", &mut tensors);
                        Ok(tensors)
                    },
                )
            })?;
        }
    }
    Ok((inputs.files, written))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rank_patterns() {
        assert_eq!(
            rank_pattern("model_rank12.pt"),
            Some(("model_rank{r}.pt".to_owned(), 12))
        );
        assert_eq!(rank_pattern("rank0.pt"), Some(("rank{r}.pt".to_owned(), 0)));
        assert_eq!(
            rank_pattern("__3_0.distcp"),
            Some(("__3_{r}.distcp".to_owned(), 0))
        );
        assert_eq!(rank_pattern("rank01.pt"), None);
        assert_eq!(rank_pattern("model.pt"), None);
    }
}
