//! FSDP1 per-rank checkpoint folders: how per-rank outputs are named ([`RankFiles`]), the model
//! description, and the lazy `torch.save` reader and tensor-at-a-time writer ([`lazy`]).
//! Which files of a folder are read, and how, is `shardscope_core::checkpoint`'s decision:
//! `core::view::fsdp1` reads the files as original parameters and FQN-keyed optimizer
//! state, and the runner's `convert::to_fsdp1` writes per-rank files for any layout (`shardscope
//! reshard`), keeping the input's names.

use std::path::{Path, PathBuf};

use shardscope_core::bridge::BridgeError;
use shardscope_core::layout::{self, Strategy};
use shardscope_core::model::ModelDescription;

/// Lazy `torch.save` inputs and tensor-at-a-time outputs (also used by the FSDP2 per-rank convert).
pub mod lazy;

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
