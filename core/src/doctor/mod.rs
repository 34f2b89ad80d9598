//! `doctor`: why a checkpoint will not load into a model, and how to fix it.
//!
//! [`diagnose`] takes a [`CheckpointIndex`] (and the [`Source`] it was read from, for the few value
//! reads a diagnosis needs), optionally a [`Target`] (the model the checkpoint should load into,
//! from a reference checkpoint or a model description) and returns [`Finding`]s: a stable `code`,
//! a severity, the keys involved, a message in plain words and a fix (a `shardscope` command or a
//! line of Python). No file is opened here; the CLI opens the inputs and scans `torch.save`
//! pickles for globals ([`unsafe_globals`]); [`unsafe_loader_pickles`] reads the pickles torch's
//! DCP and `torch_checkpointing` loaders unpickle from the [`Source`] it is given.
//!
//! A nested checkpoint (`{"model": …, "optim": …}`, DCP app states) is diagnosed part by part: each
//! model part against the target, each optimizer part against the target's parameters.
//!
//! - [`report`]: findings, severities and the JSON report;
//! - [`target`]: the model the checkpoint should load into;
//! - [`coverage`], [`model`], [`optim`]: the rules, by area (coverage and world size, model parts,
//!   optimizer parts), over the checkpoint split into [`parts`];
//! - [`files`], [`pickle_globals`]: findings about whole files (unreadable, unsupported, unsafe
//!   pickle globals);
//! - [`safety`]: `unsafe-pickle` for the pickles torch's loaders unpickle with no restriction
//!   (`.metadata`, `.distcp` bytes items, `metadata.pkl`), file by file, before anything is parsed;
//! - [`storage`]: `bloated-storage`, tensors saved as views of larger storages;
//! - [`text`]: how findings write shapes, key lists and shell arguments.

mod coverage;
mod files;
mod model;
mod moments;
mod optim;
mod parts;
mod pickle_globals;
mod report;
mod safety;
mod storage;
mod target;
mod text;

use std::collections::BTreeSet;

use crate::index::{CheckpointIndex, EntryKind, Problem};
use crate::source::Source;

pub use files::{deepspeed_folder, deepspeed_padding, unreadable_file, unsupported_file};
pub use pickle_globals::{
    deepspeed_own, torch_save_pickle_finding, unsafe_globals, unsafe_pickle, weights_only_allows,
};
pub use report::{Finding, REPORT_VERSION, Report, Severity};
pub use safety::{metadata_allows, unsafe_loader_pickles, unsafe_loader_pickles_indexed};
pub use target::{Target, TargetKind, TargetTensor};

/// Options of one diagnosis.
#[derive(Debug, Clone, Default)]
pub struct Options<'a> {
    /// The model the checkpoint should load into.
    pub target: Option<&'a Target>,
    /// The number of ranks that will load the checkpoint.
    pub world_size: Option<u64>,
    /// The checkpoint as the user names it in commands (paths joined by spaces).
    pub label: String,
    /// `--model` path for fix commands that need a description, when one was given.
    pub model_path: Option<String>,
    /// FSDP1 `use_orig_params=True` (passed on to fix commands).
    pub use_orig_params: bool,
    /// `fsdp1` or `fsdp2`: the chunking of suggested DCP conversions.
    pub api: Option<&'static str>,
}

/// Diagnoses one checkpoint. `problems` are the index's own [`CheckpointIndex::check`] results
/// (passed in so the caller can add what it found while opening files).
pub fn diagnose(
    index: &CheckpointIndex,
    source: &dyn Source,
    problems: &[Problem],
    options: &Options<'_>,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    coverage::coverage(index, problems, &mut findings);
    coverage::world_size(index, options, &mut findings);
    let parts = parts::split_parts(index);
    let flat_model: BTreeSet<String> = parts
        .models
        .iter()
        .flat_map(|p| p.entries.keys().map(|k| model::strip_compile_ddp(k)))
        .collect();
    for part in &parts.models {
        model::diagnose_model(index, source, part, options, &mut findings);
    }
    if parts.models.is_empty()
        && parts.optims.is_empty()
        && index.entries.iter().all(|e| e.kind != EntryKind::Tensor)
    {
        findings.push(Finding {
            code: "empty-tensor",
            severity: Severity::Error,
            keys: index.files.keys().cloned().collect(),
            message: format!(
                "the checkpoint holds no tensors at all ({} key(s)){}: a state dict taken with rank0_only=True (FSDP1 FullStateDictConfig, or get_model_state_dict with full_state_dict and cpu_offload) is empty on every rank but 0, and this file was written by one of them",
                index.entries.len(),
                options.target.map_or_else(String::new, |t| format!(", where the target expects {} tensors", t.tensors.len()))
            ),
            fix: "save on rank 0 only: `if dist.get_rank() == 0: torch.save(sd, path)`, and use rank 0's file".into(),
        });
    }
    if parts.models.is_empty()
        && let Some(target) = options.target
        && !target.tensors.is_empty()
        && index.entries.iter().any(|e| e.kind == EntryKind::Tensor)
    {
        // Optimizer state or training state only: nothing here can be compared with the model
        // the target describes, so nothing here says it would load.
        findings.push(Finding {
            code: "missing-key",
            severity: Severity::Error,
            keys: target.tensors.keys().cloned().collect(),
            message: format!(
                "the checkpoint holds no model part to compare with {} ({} tensor(s)): only optimizer or training state was found{}",
                target.label,
                target.tensors.len(),
                if parts.optims.is_empty() { "" } else { " (the optimizer part is checked against the target's parameters)" }
            ),
            fix: "point at the folder or file set that holds the model's weights (--model-files PATTERN for per-rank sets)".into(),
        });
    }
    for part in &parts.optims {
        optim::diagnose_optim(part, &flat_model, &parts, options, &mut findings);
    }
    moments::diagnose_moments(index, source, &parts, &mut findings);
    storage::bloated_storages(index, &options.label, &mut findings);
    findings
}
