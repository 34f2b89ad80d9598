//! FSDP1 per-rank checkpoints: a folder holding, for every rank `r`, the LOCAL model state dict
//! (`model.state_dict()` under `StateDictType.LOCAL_STATE_DICT`) and the raw optimizer state dict
//! (`optim.state_dict()`), each written with `torch.save`.
//!
//! - [`convert`]: the full (unsharded) model state dict that `FULL_STATE_DICT` returns and the full
//!   FQN-keyed optimizer state dict that `FSDP.optim_state_dict` returns.
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
//! of the wrapped model's `named_parameters()` ([`Fsdp1Model::wrapped_params`]). Files are read
//! whole into memory; the full model and optimizer state are held in memory once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use shardscope_core::formats::write::TensorRef;
use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};
use shardscope_core::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::bridge::{self, BridgeError, RootDict};
use shardscope_core::model::tree::{Dict, Node};
use shardscope_core::transform::model_state::{
    TORCH_PADDING_FILL, model_full_from_local, model_local_from_full,
};
use shardscope_core::transform::optim_state::{full_optim_from_local, local_optim_from_full};
use shardscope_core::transform::{Fsdp1Model, TransformError};

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
                let bytes = std::fs::read(&file).map_err(|source| Fsdp1LocalError::Io {
                    path: file.clone(),
                    source,
                })?;
                // Files that are not torch archives are not per-rank state (logs, configs).
                let Ok(node) = bridge::node_from_torch_save(&bytes, &file.display().to_string())
                else {
                    continue;
                };
                if is_optimizer_dict(&node) {
                    optims.push(p.clone());
                } else if node.as_dict().is_some() {
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

/// The layout flags of a per-rank checkpoint (its world size is the number of rank files).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutFlags {
    pub use_orig_params: bool,
    pub strategy: Strategy,
}

impl Default for LayoutFlags {
    fn default() -> Self {
        Self {
            use_orig_params: false,
            strategy: Strategy::FullShard,
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
        shard_group_size: None,
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

fn read_dict(path: &Path) -> Result<Dict> {
    let bytes = std::fs::read(path).map_err(|source| Fsdp1LocalError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match bridge::node_from_torch_save(&bytes, &path.display().to_string())? {
        Node::Dict(d) => Ok(d),
        other => Err(Fsdp1LocalError::Content {
            file: path.to_path_buf(),
            reason: format!("expected a state dict, found {}", other.kind_name()),
        }),
    }
}

/// A loaded per-rank checkpoint.
#[derive(Debug)]
struct Loaded {
    models: Vec<Dict>,
    optims: Option<Vec<Dict>>,
}

fn load(files: &RankFiles) -> Result<Loaded> {
    let models = (0..files.world_size)
        .map(|r| read_dict(&files.model_file(r)))
        .collect::<Result<Vec<_>>>()?;
    let optims = match &files.optim_pattern {
        Some(_) => Some(
            (0..files.world_size)
                .map(|r| {
                    let path = files.optim_file(r).unwrap_or_default();
                    let d = read_dict(&path)?;
                    if !is_optimizer_dict(&Node::Dict(d.clone())) {
                        return Err(Fsdp1LocalError::Content {
                            file: path,
                            reason:
                                "not an optimizer state dict (no `state` and `param_groups` keys)"
                                    .to_owned(),
                        });
                    }
                    Ok(d)
                })
                .collect::<Result<Vec<_>>>()?,
        ),
        None => None,
    };
    Ok(Loaded { models, optims })
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

/// Inputs of [`convert`].
#[derive(Debug, Clone)]
pub struct ConvertArgs {
    /// Folder of per-rank files.
    pub src: PathBuf,
    /// Model description JSON (`shardscope layout --model`).
    pub model: PathBuf,
    pub flags: LayoutFlags,
    /// Override the detected model file pattern (`model_rank{r}.pt`).
    pub model_pattern: Option<String>,
    /// Override the detected optimizer file pattern (`optim_rank{r}.pt`).
    pub optim_pattern: Option<String>,
    /// Model output format.
    pub model_format: ModelFormat,
}

/// How [`convert`] encodes the full model state dict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// `torch.save` of the `OrderedDict` (what `torch.save(model.state_dict())` writes).
    TorchSave,
    /// A `.safetensors` file (tensor names are the state-dict keys).
    Safetensors,
}

/// What [`convert`] produces: file bytes ready to be written.
#[derive(Debug)]
pub struct ConvertOutput {
    pub files: RankFiles,
    /// The full model state dict, encoded as asked.
    pub model: Vec<u8>,
    /// The full optimizer state dict (`torch.save`), when the folder has optimizer files.
    pub optim: Option<Vec<u8>>,
}

/// Per-rank FSDP1 LOCAL files → the full model state dict and the full FQN-keyed optimizer state
/// dict (`FSDP.optim_state_dict` under FULL_STATE_DICT).
pub fn convert(args: &ConvertArgs) -> Result<ConvertOutput> {
    let files = find_rank_files(
        &args.src,
        args.model_pattern.as_deref(),
        args.optim_pattern.as_deref(),
    )?;
    let desc = read_description(&args.model)?;
    let layout = fsdp1_layout(&desc, files.world_size, args.flags)?;
    let model = Fsdp1Model::new(&desc, &layout).map_err(|source| Fsdp1LocalError::Transform {
        what: args.model.display().to_string(),
        source: Box::new(source),
    })?;
    let loaded = load(&files)?;
    let full_model = full_model(&model, &loaded, &files)?;
    let model_bytes = match args.model_format {
        ModelFormat::TorchSave => {
            bridge::to_torch_save(&Node::Dict(full_model), RootDict::Ordered, 0, 1)?
        }
        ModelFormat::Safetensors => safetensors_bytes(&full_model)?,
    };
    let optim = match &loaded.optims {
        Some(optims) => {
            let full = full_optim(&model, optims, &files)?;
            Some(bridge::to_torch_save(
                &Node::Dict(full),
                RootDict::Plain,
                0,
                1,
            )?)
        }
        None => None,
    };
    Ok(ConvertOutput {
        files,
        model: model_bytes,
        optim,
    })
}

fn full_model(model: &Fsdp1Model<'_>, loaded: &Loaded, files: &RankFiles) -> Result<Dict> {
    let refs: Vec<&Dict> = loaded.models.iter().collect();
    model_full_from_local(model, &refs).map_err(|source| Fsdp1LocalError::Transform {
        what: format!(
            "{}: LOCAL model state dicts",
            files.dir.join(&files.model_pattern).display()
        ),
        source: Box::new(source),
    })
}

fn full_optim(model: &Fsdp1Model<'_>, optims: &[Dict], files: &RankFiles) -> Result<Dict> {
    let names = optim_param_names(model, optims, files)?;
    let per_rank = vec![names; optims.len()];
    let refs: Vec<&Dict> = optims.iter().collect();
    full_optim_from_local(model, &refs, &per_rank, 0, None).map_err(|source| {
        Fsdp1LocalError::Transform {
            what: format!(
                "{}: optimizer state dicts",
                files
                    .dir
                    .join(files.optim_pattern.as_deref().unwrap_or_default())
                    .display()
            ),
            source: Box::new(source),
        }
    })
}

fn safetensors_bytes(full: &Dict) -> Result<Vec<u8>> {
    let mut tensors = Vec::with_capacity(full.len());
    for (k, v) in full.iter() {
        let Node::Tensor(t) = v else {
            return Err(Fsdp1LocalError::Safetensors(format!(
                "`{k}` is a {}, safetensors holds tensors only",
                v.kind_name()
            )));
        };
        tensors.push((k.to_string(), t));
    }
    let refs: Vec<(String, TensorRef<'_>)> = tensors
        .iter()
        .map(|(k, t)| {
            TensorRef::new(t.dtype, &t.shape, &t.data)
                .map(|r| (k.clone(), r))
                .map_err(|e| Fsdp1LocalError::Safetensors(format!("`{k}`: {e}")))
        })
        .collect::<Result<_>>()?;
    let specs: Vec<TensorSpec> = refs
        .iter()
        .map(|(k, r)| TensorSpec::from_tensor(k, r))
        .collect();
    let err = |e: shardscope_core::formats::write::safetensors::SafetensorsWriteError| {
        Fsdp1LocalError::Safetensors(e.to_string())
    };
    let mut writer = SafetensorsWriter::new(Vec::new(), &specs, None).map_err(err)?;
    let order: Vec<String> = writer.data_order().map(str::to_owned).collect();
    for name in order {
        let data = refs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, r)| r.data)
            .unwrap_or_default();
        writer.write_tensor(&name, data).map_err(err)?;
    }
    writer.finish().map_err(err)
}

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

/// One output file: its name (inside the destination folder) and bytes.
#[derive(Debug)]
pub struct OutputFile {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Per-rank FSDP1 LOCAL files from A ranks to `to_world_size` ranks: `(files found, outputs)`.
/// Model files are LOCAL state dicts (`OrderedDict` with `ShardedTensor` flat parameters),
/// optimizer files raw `optim.state_dict()`s for the new ranks.
pub fn reshard(args: &ReshardArgs) -> Result<(RankFiles, Vec<OutputFile>)> {
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
    let transform_err = |what: &str| {
        let what = what.to_owned();
        move |source| Fsdp1LocalError::Transform {
            what,
            source: Box::new(source),
        }
    };
    let src = Fsdp1Model::new(&desc, &src_layout).map_err(transform_err("source layout"))?;
    let dst = Fsdp1Model::new(&desc, &dst_layout).map_err(transform_err("destination layout"))?;
    let loaded = load(&files)?;
    let full = full_model(&src, &loaded, &files)?;
    let full_osd = match &loaded.optims {
        Some(optims) => Some(full_optim(&src, optims, &files)?),
        None => None,
    };
    let dst_names: Vec<String> = dst.wrapped_params().into_iter().map(|(n, _)| n).collect();
    let mut out = Vec::new();
    let ws = args.to_world_size as u64;
    for rank in 0..ws {
        let local = model_local_from_full(&dst, rank, &full, TORCH_PADDING_FILL).map_err(
            transform_err(&format!("destination rank {rank} model state")),
        )?;
        out.push(OutputFile {
            name: files.model_pattern.replace("{r}", &rank.to_string()),
            bytes: bridge::to_torch_save(&Node::Dict(local), RootDict::Ordered, rank, ws)?,
        });
        if let (Some(full_osd), Some(pattern)) = (&full_osd, &files.optim_pattern) {
            let osd = local_optim_from_full(&dst, full_osd, rank, &dst_names).map_err(
                transform_err(&format!("destination rank {rank} optimizer state")),
            )?;
            out.push(OutputFile {
                name: pattern.replace("{r}", &rank.to_string()),
                bytes: bridge::to_torch_save(&Node::Dict(osd), RootDict::Plain, rank, ws)?,
            });
        }
    }
    Ok((files, out))
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
