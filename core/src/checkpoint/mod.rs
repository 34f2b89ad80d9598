//! `Checkpoint::open`: the one place that decides how a checkpoint is read. Every front end (each
//! CLI command, the desktop viewer, the browser, `doctor`, `gather`) hands it a [`Source`] and
//! [`ReadOptions`] and reads the [`Checkpoint`] it returns; none of them makes a reading decision
//! of its own.
//!
//! It finds the files (DCP `.metadata`, safetensors, per-rank `torch.save` sets: all of them, or
//! the ones `--model-files`/`--optim-files` name; without names, the per-rank JSON and raw items
//! beside them too, and a note naming the files not read), classifies each set (model,
//! optimizer, extra state), reads the hints the checkpoint states (world size, API, HSDP shard group), and applies
//! the view that makes its tensors global:
//! - FSDP2 per-rank files: the raw optimizer's integer ids are named by FQN
//!   ([`crate::view::fsdp2`]), the description helping when given; extra state is kept.
//! - FSDP1 per-rank files with a model description: flat parameters and raw optimizer state read
//!   as the original parameters ([`crate::view::fsdp1`]) through the layout the flags give.
//!
//! What a user should know about how it was read is in [`Checkpoint::notes`]; a front end shows
//! them (the CLI on stderr).

#[cfg(test)]
mod deepspeed_tests;
mod describe;
mod files;
mod model_only;
mod written_by;

pub use describe::{AutoDescribed, DescribeOptions, Described, is_block, repeated_blocks};
pub use files::{RANK_PLACEHOLDER, pattern_rank};
pub use model_only::{app_state_prefix, is_model_tensor, model_fqns, optimizer_roots};
pub use written_by::{megatron_backend, megatron_companions, written_by};

use crate::dtype::DType;
use crate::index::{
    self, CheckpointIndex, CheckpointKind, EntryKind, IndexError, PathSeg, ReadSet, Role,
};
use crate::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, LayoutError, Strategy};
use crate::model::ModelDescription;
use crate::source::Source;
use crate::view::fsdp1::{self as fsdp1_view, ViewError};
use crate::view::fsdp2::{self as fsdp2_view, Fsdp2ViewError};
use crate::view::hints::{self, LayoutHints};

/// Why a checkpoint could not be opened (or described). Each names the checkpoint (`label`: its
/// path or URL).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// No model description can be derived from it.
    #[error("{label}: {what}: {source}")]
    Describe {
        label: String,
        what: &'static str,
        #[source]
        source: Box<crate::index::from_index::FromIndexError>,
    },
    /// `--model-only` found no model part.
    #[error("{label}: --model-only: {reason}")]
    ModelOnly { label: String, reason: String },
    /// The files could not be indexed.
    #[error("cannot read {label}: {source}")]
    Index {
        label: String,
        #[source]
        source: Box<IndexError>,
    },
    /// The named per-rank files do not form complete sets.
    #[error("{label}: {reason}")]
    Files { label: String, reason: String },
    /// Several sets could be the model's (or the optimizer's).
    #[error("{label}: {reason}")]
    Ambiguous { label: String, reason: String },
    /// The description and the FSDP1 flags give no layout.
    #[error("{label}: layout of {model}: {source}")]
    Layout {
        label: String,
        model: String,
        #[source]
        source: Box<LayoutError>,
    },
    /// The per-rank pieces do not fit the FSDP1 layout.
    #[error("{label}: cannot read it through the FSDP1 layout of {model} ({world_size} ranks{orig}): {source}", orig = if *use_orig_params { ", use_orig_params" } else { "" })]
    Fsdp1View {
        label: String,
        model: String,
        world_size: u64,
        use_orig_params: bool,
        #[source]
        source: Box<ViewError>,
    },
    /// Read through the FSDP1 layout, the pieces leave parts of parameters uncovered.
    #[error(
        "{label}: read through the FSDP1 layout of {model}, its pieces do not cover the parameters ({count} problems; first: {first})\nhint: check --use-orig-params, --world-size, --strategy and --param-dtype against how the model was wrapped"
    )]
    NotCovered {
        label: String,
        model: String,
        count: usize,
        first: String,
    },
    /// The optimizer's integer ids could not be named with the description given.
    #[error("{label}: cannot name the optimizer's parameters: {source}")]
    Fsdp2View {
        label: String,
        #[source]
        source: Box<Fsdp2ViewError>,
    },
}

/// The FSDP1 wrapping a folder of FSDP1 per-rank files was written with (with a description).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fsdp1Flags {
    /// Ranks that wrote the checkpoint (default: the number of rank files).
    pub world_size: Option<u64>,
    pub use_orig_params: bool,
    pub strategy: Strategy,
    pub shard_group_size: Option<u64>,
    /// Mixed-precision compute dtype (sets the alignment unit).
    pub param_dtype: Option<DType>,
}

impl Default for Fsdp1Flags {
    fn default() -> Self {
        Self {
            world_size: None,
            use_orig_params: false,
            strategy: Strategy::FullShard,
            shard_group_size: None,
            param_dtype: None,
        }
    }
}

/// How to read a checkpoint: what a user can say beyond its files.
#[derive(Debug, Clone, Default)]
pub struct ReadOptions {
    /// The model description (`--model`) and the name it is shown by in messages.
    pub description: Option<(ModelDescription, String)>,
    /// FSDP1 layout flags, used with a description.
    pub fsdp1: Fsdp1Flags,
    /// `--model-files`: the model's per-rank set, `{r}` for the rank.
    pub model_files: Option<String>,
    /// `--optim-files`: the optimizer's per-rank set, `{r}` for the rank.
    pub optim_files: Option<String>,
    /// `--model-only`: keep the model part alone, with the model's own names
    /// ([`model_only`]).
    pub model_only: bool,
}

/// Which view the index was read through.
#[derive(Debug, Clone, PartialEq)]
pub enum View {
    /// As stored: the checkpoint's tensors are global already, or nothing could place them.
    Stored,
    /// FSDP1 per-rank pieces as the original parameters, through this layout.
    Fsdp1(Box<Fsdp1Layout>),
    /// FSDP2 per-rank files with the raw optimizer's ids keyed by FQN (`how`: by what).
    Fsdp2 { how: Option<String> },
}

/// One per-rank set of files that was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSet {
    /// `model`, `optim` or `extra` (what its content holds).
    pub class: &'static str,
    /// File name with [`RANK_PLACEHOLDER`] for the rank (`model_rank{r}.pt`); a file that is not
    /// part of a per-rank set has its own name.
    pub pattern: String,
    /// Files in the set.
    pub files: usize,
}

/// A checkpoint as every front end reads it.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Its path or URL, as messages name it.
    pub label: String,
    /// The index consumers read (after the view).
    pub index: CheckpointIndex,
    pub view: View,
    /// What the checkpoint states about its FSDP configuration (read before the view).
    pub hints: LayoutHints,
    /// The per-rank `torch.save` sets read (none for DCP and safetensors).
    pub sets: Vec<FileSet>,
    /// Several sets of one class were read (their entries are told apart by set name), which a
    /// conversion must not mix; the reason, with the flag that chooses.
    pub ambiguous: Option<String>,
    /// What a user should know about how it was read.
    pub notes: Vec<String>,
    /// What wrote it, when its files say (a trainer's folder layout: [`written_by`]).
    pub written_by: Option<String>,
}

/// The number of ranks whose files `index` holds (highest rank + 1), or 1.
pub fn ranks_in(index: &CheckpointIndex) -> u64 {
    index
        .files
        .values()
        .filter_map(|f| f.rank)
        .max()
        .map_or(1, |r| u64::from(r) + 1)
}

/// True when `index` has pieces that only a layout can place (flat parameters, raw optimizer ids).
pub fn needs_layout(index: &CheckpointIndex) -> bool {
    matches!(
        index.kind,
        CheckpointKind::Fsdp1Local | CheckpointKind::RankLocal
    ) || index.entries.iter().any(|e| {
        e.flat_param
            || matches!(
                &e.role,
                Some(Role::OptimizerState {
                    param: PathSeg::Index(_),
                    ..
                })
            )
    })
}

/// True when the optimizer state holds rank-local pieces with no global shape under integer ids
/// (FSDP1 flat parameters next to DTensor model files: FSDP1 SHARDED_STATE_DICT with a device
/// mesh, as verl saves FSDP1): only the FSDP1 layout places them.
pub fn rank_local_optimizer_state(index: &CheckpointIndex) -> bool {
    index.entries.iter().any(|e| {
        e.kind == EntryKind::Tensor
            && e.shape.is_none()
            && e.chunks.iter().any(|c| !c.sizes.is_empty())
            && matches!(
                &e.role,
                Some(Role::OptimizerState {
                    param: PathSeg::Index(_),
                    ..
                })
            )
    })
}

/// The reason several sets of one class make a folder ambiguous, if they do.
fn ambiguity(sets: &[FileSet]) -> Option<String> {
    for (class, flag) in [("model", "--model-files"), ("optim", "--optim-files")] {
        let of: Vec<&str> = sets
            .iter()
            .filter(|s| s.class == class)
            .map(|s| s.pattern.as_str())
            .collect();
        if of.len() > 1 {
            let what = if class == "model" {
                "model"
            } else {
                "optimizer"
            };
            return Some(format!(
                "several {what} file sets ({}); choose one with {flag}",
                of.join(", ")
            ));
        }
    }
    None
}

/// For a folder of `torch.save` files only, with some at its top level and some in subfolders: the
/// top-level names (all of them: the JSON and raw items beside the sets too) and the nested
/// `torch.save` files.
fn top_level_torch(names: &[String]) -> Option<(Vec<String>, Vec<String>)> {
    // A torch_checkpointing folder (`metadata.pkl`) reads itself: its subfolders hold its items.
    let other = names
        .iter()
        .any(|n| n.ends_with(".metadata") || n.ends_with(".safetensors") || n == "metadata.pkl")
        // A DeepSpeed tag folder beside the files of a trainer (HF Trainer's `checkpoint-N/`).
        || index::looks_like_deepspeed(names);
    let (nested, top): (Vec<String>, Vec<String>) = names
        .iter()
        .filter(|n| index::is_torch_file(n))
        .cloned()
        .partition(|n| n.contains('/'));
    let top_names = names.iter().filter(|n| !n.contains('/')).cloned().collect();
    (!other && !top.is_empty() && !nested.is_empty()).then_some((top_names, nested))
}

/// Checks that the per-rank sets read (of more than one file) are ranks `0..N` and that the model's and the optimizer's
/// have the same `N`: a missing rank file of the model or the optimizer is an error naming it; of
/// extra state (saved by some ranks only, or partly lost), a note.
fn complete(label: &str, read: &[ReadSet], notes: &mut Vec<String>) -> Result<(), CheckpointError> {
    let mut counts: Vec<(&str, String, usize)> = Vec::new();
    for (group, class) in read {
        if !group.pattern.contains("{R}") {
            continue;
        }
        let pattern = group.pattern.replace("{R}", RANK_PLACEHOLDER);
        let ranks: std::collections::BTreeSet<u32> =
            group.files.iter().filter_map(|(_, r)| *r).collect();
        let last = ranks.last().copied().unwrap_or(0);
        let missing: Vec<String> = (0..=last)
            .filter(|r| !ranks.contains(r))
            .map(|r| pattern.replace(RANK_PLACEHOLDER, &r.to_string()))
            .collect();
        // One rank's file alone (`inspect rank1.pt`) is read as what it is.
        if !missing.is_empty() && group.files.len() > 1 {
            let what = format!(
                "per-rank files `{pattern}` do not hold every rank 0..N; missing: {}",
                missing.join(", ")
            );
            if *class == "extra" {
                notes.push(format!("{label}: {what}"));
            } else {
                return Err(CheckpointError::Files {
                    label: label.to_owned(),
                    reason: what,
                });
            }
        }
        counts.push((class, pattern, group.files.len()));
    }
    let first_of = |class: &str| counts.iter().find(|(c, _, _)| *c == class);
    if let (Some((_, model, m)), Some((_, optim, o))) = (first_of("model"), first_of("optim"))
        && m != o
    {
        return Err(CheckpointError::Files {
            label: label.to_owned(),
            reason: format!("{m} model files `{model}` but {o} optimizer files `{optim}`"),
        });
    }
    Ok(())
}

impl Checkpoint {
    /// Opens the checkpoint `source` holds, read through the view its content and `options` call
    /// for. `label` names it in messages.
    pub fn open(
        source: &dyn Source,
        label: &str,
        options: &ReadOptions,
    ) -> Result<Self, CheckpointError> {
        let mut checkpoint = Self::open_stored(source, label, options)?;
        checkpoint.apply_view(options)?;
        Ok(checkpoint)
    }

    /// The checkpoint as stored: its files found and indexed, no view applied (`verify` checks
    /// the stored pieces before reading them through a layout).
    pub fn open_stored(
        source: &dyn Source,
        label: &str,
        options: &ReadOptions,
    ) -> Result<Self, CheckpointError> {
        let index_err = |source| CheckpointError::Index {
            label: label.to_owned(),
            source: Box::new(source),
        };
        let mut notes = Vec::new();
        let names = source.names();
        let (index, read, read_notes) = if options.model_files.is_some()
            || options.optim_files.is_some()
        {
            let names = source.names();
            let groups = files::named_sets(
                source,
                label,
                &names,
                options.model_files.as_deref(),
                options.optim_files.as_deref(),
            )?;
            let (index, classes) = index::index_torch_sets(source, &groups).map_err(index_err)?;
            let read: Vec<ReadSet> = groups.into_iter().zip(classes).collect();
            (index, read, Vec::new())
        } else if let Some((top, nested)) = top_level_torch(&source.names()) {
            // Per-rank files at the top, other torch.save files in subfolders (a trainer's
            // reference copies, other checkpoints): the top level is the checkpoint.
            notes.push(format!(
                "{label}: torch.save files in subfolders are not read ({}); name one to read it",
                nested.join(", ")
            ));
            index::index_rank_folder(source, &top).map_err(index_err)?
        } else {
            index::index_source_read(source).map_err(index_err)?
        };
        notes.extend(read_notes.into_iter().map(|n| format!("{label}: {n}")));
        complete(label, &read, &mut notes)?;
        let sets: Vec<FileSet> = read
            .into_iter()
            .map(|(group, class)| FileSet {
                class,
                pattern: group.pattern.replace("{R}", RANK_PLACEHOLDER),
                files: group.files.len(),
            })
            .collect();
        let ambiguous = ambiguity(&sets);
        if let Some(why) = &ambiguous {
            notes.push(format!(
                "{label}: {why}; every set is shown under its own name"
            ));
        }
        Ok(Self {
            label: label.to_owned(),
            written_by: written_by(source, &names, &index),
            hints: hints::layout_hints(&index),
            index,
            view: View::Stored,
            sets,
            ambiguous,
            notes,
        })
    }

    /// The FSDP1 layout the description and flags of `options` give for this checkpoint (world
    /// size: the flag, else the number of rank files), or `None` without a description.
    pub fn fsdp1_layout(
        &self,
        options: &ReadOptions,
    ) -> Result<Option<Fsdp1Layout>, CheckpointError> {
        let Some((description, name)) = &options.description else {
            return Ok(None);
        };
        let flags = options.fsdp1;
        let config = LayoutConfig {
            api: Api::Fsdp1,
            world_size: flags.world_size.unwrap_or_else(|| ranks_in(&self.index)),
            shard_group_size: flags.shard_group_size,
            use_orig_params: flags.use_orig_params,
            strategy: flags.strategy,
            param_dtype: flags.param_dtype,
        };
        let layout_err = |source| CheckpointError::Layout {
            label: self.label.clone(),
            model: name.clone(),
            source: Box::new(source),
        };
        match layout::compute(description, &config).map_err(layout_err)? {
            Layout::Fsdp1(l) => Ok(Some(l)),
            // An FSDP1 configuration gives an FSDP1 layout.
            Layout::Fsdp2(_) => Ok(None),
        }
    }

    /// Reads the stored index through the view its content and `options` call for (a no-op when
    /// a view was applied already).
    pub fn apply_view(&mut self, options: &ReadOptions) -> Result<(), CheckpointError> {
        self.apply_layout_view(options)?;
        if options.model_only {
            let note =
                model_only::keep_model_only(&mut self.index, &self.label).map_err(|reason| {
                    CheckpointError::ModelOnly {
                        label: self.label.clone(),
                        reason,
                    }
                })?;
            self.notes.push(note);
            // The model alone: the other sets no longer make it ambiguous.
            self.ambiguous = None;
        }
        Ok(())
    }

    fn apply_layout_view(&mut self, options: &ReadOptions) -> Result<(), CheckpointError> {
        if self.view != View::Stored {
            return Ok(());
        }
        let label = self.label.clone();
        let description = options.description.as_ref();
        if self.index.kind == CheckpointKind::Fsdp2 && !rank_local_optimizer_state(&self.index) {
            match fsdp2_view::fqn_keyed_optimizer(&self.index, description.map(|(d, _)| d)) {
                Ok((view, naming)) => {
                    let how = naming.map(|n| n.how);
                    if let Some(how) = &how {
                        self.notes
                            .push(format!("{label}: optimizer ids named by {how}"));
                    }
                    self.index = view;
                    self.view = View::Fsdp2 { how };
                }
                Err(e) if description.is_none() => self.notes.push(format!(
                    "{label}: the optimizer state stays keyed by integer ids ({e})\nhint: --model MODEL.json names them"
                )),
                Err(source) => {
                    return Err(CheckpointError::Fsdp2View {
                        label,
                        source: Box::new(source),
                    });
                }
            }
            return Ok(());
        }
        if !needs_layout(&self.index) {
            return Ok(());
        }
        let (Some((description, model)), Some(layout)) = (description, self.fsdp1_layout(options)?)
        else {
            self.notes.push(format!(
                "{label}: holds {}: without the model's layout its pieces stay as stored\nhint: --model MODEL.json reads them as the original parameters (`shardscope layout --from` derives one)",
                self.index.kind.describe()
            ));
            return Ok(());
        };
        let model = model.clone();
        let view =
            fsdp1_view::original_params(&self.index, description, &layout).map_err(|source| {
                CheckpointError::Fsdp1View {
                    label: label.clone(),
                    model: model.clone(),
                    world_size: layout.world_size,
                    use_orig_params: layout.use_orig_params,
                    source: Box::new(source),
                }
            })?;
        let problems = view.check();
        if let Some(first) = problems.first() {
            return Err(CheckpointError::NotCovered {
                label,
                model,
                count: problems.len(),
                first: first.to_string(),
            });
        }
        self.index = view;
        self.view = View::Fsdp1(Box::new(layout));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(class: &'static str, pattern: &str) -> FileSet {
        FileSet {
            class,
            pattern: pattern.to_owned(),
            files: 2,
        }
    }

    #[test]
    fn several_sets_of_a_class_are_ambiguous() {
        assert_eq!(
            ambiguity(&[set("model", "a{r}.pt"), set("optim", "o{r}.pt")]),
            None
        );
        let why = ambiguity(&[set("model", "a{r}.pt"), set("model", "b{r}.pt")]);
        assert!(why.is_some_and(|w| w.contains("a{r}.pt, b{r}.pt") && w.contains("--model-files")));
        let why = ambiguity(&[set("optim", "a{r}.pt"), set("optim", "b{r}.pt")]);
        assert!(why.is_some_and(|w| w.contains("--optim-files")));
    }
}
