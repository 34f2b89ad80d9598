//! FSDP1 per-rank checkpoint folders: which files are the model's and which the optimizer's, the
//! model description, and the lazy `torch.save` reader and tensor-at-a-time writer ([`lazy`]).
//! Reading and writing them is the index's job: `core::model::fsdp1_view` reads the files as
//! original parameters and FQN-keyed optimizer state, and the runner's `convert::to_fsdp1` writes
//! per-rank files for any layout (`shardscope reshard`).
//!
//! File names: files whose names differ only in one number that runs `0..N` form a per-rank set,
//! written as a pattern with that number replaced by `{r}` (`model_rank3.pt` →
//! `model_rank{r}.pt`, `ckpt_3_model.pt` → `ckpt_{r}_model.pt`; numbers that are the same in every
//! name are not the rank: `model_rank{r}_of_3.pt`); `shardscope_core::model::index::group_rank_files`
//! says how. Which set is the model and which the optimizer is decided by content (an optimizer
//! state dict has `state` and `param_groups`), unless given explicitly ([`RankFiles::model_pattern`],
//! [`RankFiles::optim_pattern`], `--model-files`/`--optim-files`). Outputs keep the input names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use shardscope_core::layout::{self, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::bridge::BridgeError;
use shardscope_core::model::index;
use shardscope_core::model::tree::Node;

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
    /// The folder holds several sets that could be the model's (or the optimizer's).
    #[error("{dir}: {reason}")]
    Ambiguous { dir: PathBuf, reason: String },
    /// A file could not be read as a torch archive of a state dict.
    #[error("{0}")]
    Bridge(Box<BridgeError>),
    /// A file holds something other than what its role needs.
    #[error("{file}: {reason}")]
    Content { file: PathBuf, reason: String },
}

impl From<BridgeError> for Fsdp1LocalError {
    fn from(e: BridgeError) -> Self {
        Self::Bridge(Box::new(e))
    }
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

/// The rank of `name` in the per-rank set `pattern` (`{r}` stands for the rank, written as
/// `rank.to_string()` writes it; digits may follow `{r}`).
pub fn pattern_rank(pattern: &str, name: &str) -> Option<usize> {
    let (head, tail) = pattern.split_once("{r}")?;
    let digits = name.strip_prefix(head)?.strip_suffix(tail)?;
    let rank: usize = digits.parse().ok()?;
    (rank.to_string() == digits).then_some(rank)
}

fn is_optimizer_dict(node: &Node) -> bool {
    node.as_dict()
        .is_some_and(|d| d.get_str("state").is_some() && d.get_str("param_groups").is_some())
}

/// Finds the per-rank model and optimizer files in `dir`. `model_pattern`/`optim_pattern` (with
/// `{r}`) override the detection.
#[allow(
    clippy::too_many_lines,
    reason = "groups a folder's files into per-rank sets with the explicit-pattern overrides and their errors"
)]
pub fn find_rank_files(
    dir: &Path,
    model_pattern: Option<&str>,
    optim_pattern: Option<&str>,
) -> Result<RankFiles> {
    let io = |source| Fsdp1LocalError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut names = Vec::new();
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
        names.push(name);
    }
    names.sort();
    // Sets of files that differ only in the rank (see the module doc), as `{r}` patterns.
    let groups: BTreeMap<String, BTreeSet<usize>> = index::group_rank_files(&names)
        .into_iter()
        .filter(|g| g.pattern.contains("{R}") && g.files.iter().all(|(_, r)| r.is_some()))
        .map(|g| {
            let ranks = g.files.iter().filter_map(|(_, r)| *r).map(|r| r as usize);
            (g.pattern.replace("{R}", "{r}"), ranks.collect())
        })
        .collect();
    let files_err = |reason: String| Fsdp1LocalError::Files {
        dir: dir.to_path_buf(),
        reason,
    };
    let found = || {
        if groups.is_empty() {
            "no per-rank file sets found".to_owned()
        } else {
            let sets: Vec<&str> = groups.keys().map(String::as_str).collect();
            format!("per-rank file sets found: {}", sets.join(", "))
        }
    };
    let complete = |pattern: &str| -> Result<usize> {
        if !pattern.contains("{r}") {
            return Err(files_err(format!(
                "the file pattern `{pattern}` has no `{{r}}` (it stands for the rank number, e.g. `model_rank{{r}}.pt`)"
            )));
        }
        let ranks: BTreeSet<usize> = names
            .iter()
            .filter_map(|n| pattern_rank(pattern, n))
            .collect();
        if ranks.is_empty() {
            return Err(files_err(format!(
                "no file matches `{pattern}` (`{{r}}` is the rank number); {}",
                found()
            )));
        }
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
            let ambiguous = |reason: String| Fsdp1LocalError::Ambiguous {
                dir: dir.to_path_buf(),
                reason,
            };
            let optim = match given_optim {
                Some(o) => Some(o.to_owned()),
                None if optims.len() <= 1 => optims.pop(),
                None => {
                    return Err(ambiguous(format!(
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
                    return Err(ambiguous(format!(
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pattern_ranks() {
        assert_eq!(
            pattern_rank("model_rank{r}.pt", "model_rank12.pt"),
            Some(12)
        );
        assert_eq!(pattern_rank("m{r}_ws3.pt", "m2_ws3.pt"), Some(2));
        assert_eq!(
            pattern_rank("ckpt_{r}_model.pt", "ckpt_0_model.pt"),
            Some(0)
        );
        assert_eq!(pattern_rank("ckpt_{r}_model.pt", "ckpt_0_optim.pt"), None);
        assert_eq!(pattern_rank("rank{r}.pt", "rank01.pt"), None);
        assert_eq!(pattern_rank("rank{r}.pt", "rank.pt"), None);
        assert_eq!(pattern_rank("model.pt", "model.pt"), None);
    }
}
