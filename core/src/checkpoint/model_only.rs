//! `--model-only`: the model part of a training checkpoint, by what the parts are, with the
//! model's own names.
//!
//! A training checkpoint holds the model beside its optimizer and training state, in one of two
//! shapes:
//! - under an app-state key (`model` of a DCP app state, of accelerate's `pytorch_model_fsdp_0/`,
//!   of torch_checkpointing's `model` item; Lightning's `state_dict`; DeepSpeed's `module`): the
//!   key is removed (`model.model.embed_tokens.weight` → `model.embed_tokens.weight`);
//! - at the top level beside `optimizer`, `lr_scheduler`, `train_state`, `dataloader`
//!   (torchtitan): the keys are kept as they are.
//!
//! A top-level `model` beside other model tensors (`lm_head.weight` of HF's `LlamaForCausalLM`)
//! is part of the model's names, not a wrapper: nothing is removed.

use std::collections::BTreeSet;

use crate::dtype::DType;
use crate::index::{CheckpointIndex, EntryKind, IndexEntry, PathSeg};

/// Top-level keys of a training checkpoint that are not the model besides the training-state keys
/// ([`crate::index::EXTRA_KEYS`]): optimizer state, extra state, an EMA copy.
const NOT_MODEL: &[&str] = &[
    "optimizer",
    "optimizers",
    "optim",
    "optimizer_states",
    "optimizer_state_dict",
    "extra",
    "extra_state",
    "dataloaders",
    "meta",
    "common",
    "checkpoint_version",
    "ema",
];

/// Whether a top-level key is training state, not the model.
fn not_model(key: &str) -> bool {
    NOT_MODEL.contains(&key) || crate::index::EXTRA_KEYS.contains(&key)
}

/// Top-level keys that hold an optimizer's state dict, found by what they hold (`K.state.…` and
/// `K.param_groups.…`) whatever they are called (`optim`, `optimizer`, `opt`, ...).
pub fn optimizer_roots(index: &CheckpointIndex) -> BTreeSet<String> {
    let mut state = BTreeSet::new();
    let mut groups = BTreeSet::new();
    for e in &index.entries {
        if let [PathSeg::Key(root), PathSeg::Key(second), ..] = e.path.as_slice() {
            match second.as_str() {
                "state" => {
                    state.insert(root.as_str());
                }
                "param_groups" => {
                    groups.insert(root.as_str());
                }
                _ => {}
            }
        }
    }
    state
        .intersection(&groups)
        .map(|k| (*k).to_owned())
        .collect()
}

/// App-state keys a trainer nests the model under, in the order they are tried.
const WRAPPERS: &[&str] = &["model", "state_dict", "model_state_dict", "module"];

fn top(e: &IndexEntry) -> Option<&str> {
    match e.path.first() {
        Some(PathSeg::Key(k)) => Some(k.as_str()),
        _ => None,
    }
}

/// A floating-point tensor that is no optimizer state: what a model's parameters look like.
pub fn is_model_tensor(e: &IndexEntry) -> bool {
    e.kind == EntryKind::Tensor && e.role.is_none() && e.dtype.is_some_and(DType::is_floating_point)
}

/// The keys of the model tensors under `select.` (prefix removed), or all of them.
pub fn model_fqns<'a>(index: &'a CheckpointIndex, select: Option<&str>) -> Vec<&'a str> {
    index
        .entries
        .iter()
        .filter(|e| is_model_tensor(e))
        .filter_map(|e| match select {
            Some(s) => e.key.strip_prefix(s)?.strip_prefix('.'),
            None => Some(e.key.as_str()),
        })
        .collect()
}

/// The model part of `index`: `Some(wrapper)` when the model sits under an app-state key,
/// `None` when it is the top-level keys that are not training state. Errors name the top-level
/// keys when no part holds model tensors.
fn model_wrapper(index: &CheckpointIndex) -> Result<Option<&'static str>, String> {
    let tops: BTreeSet<&str> = index.entries.iter().filter_map(top).collect();
    // Top-level keys (other than the training-state ones) holding model tensors.
    let holders: BTreeSet<&str> = index
        .entries
        .iter()
        .filter(|e| is_model_tensor(e))
        .filter_map(top)
        .filter(|k| !not_model(k))
        .collect();
    for w in WRAPPERS {
        if holders.len() == 1
            && holders.contains(w)
            && index
                .entries
                .iter()
                .any(|e| e.path.len() > 1 && top(e) == Some(w))
        {
            return Ok(Some(w));
        }
    }
    if holders.is_empty() {
        return Err(format!(
            "no model part found: no floating-point tensors outside optimizer and training state (top-level keys: {})",
            tops.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(None)
}

/// The app-state key the model sits under (`model` of a DCP app state, Lightning's `state_dict`),
/// when the checkpoint nests it so; `None` when the model's keys are at the top level.
pub fn app_state_prefix(index: &CheckpointIndex) -> Option<&'static str> {
    model_wrapper(index).ok().flatten()
}

/// Keeps only the model part of `index` (see the module doc) and says what was left out.
pub fn keep_model_only(index: &mut CheckpointIndex, label: &str) -> Result<String, String> {
    let wrapper = model_wrapper(index)?;
    let before = index.entries.len();
    let mut left_out: BTreeSet<String> = BTreeSet::new();
    let entries = std::mem::take(&mut index.entries);
    for mut e in entries {
        let keep = e.role.is_none()
            && match (wrapper, top(&e)) {
                (Some(w), Some(t)) => t == w && e.path.len() > 1,
                (Some(_), None) => false,
                (None, Some(t)) => !not_model(t),
                (None, None) => true,
            };
        if !keep {
            left_out.insert(top(&e).map_or_else(|| e.key.clone(), str::to_owned));
            continue;
        }
        if let Some(w) = wrapper {
            e.path.remove(0);
            let strip = |k: &str| {
                k.strip_prefix(w)
                    .and_then(|r| r.strip_prefix('.'))
                    .map(str::to_owned)
            };
            if let Some(k) = strip(&e.key) {
                e.key = k;
            }
            e.raw_key = e.raw_key.as_deref().and_then(strip);
        }
        index.entries.push(e);
    }
    index.has_optimizer_state = false;
    let used: BTreeSet<&str> = index
        .entries
        .iter()
        .flat_map(|e| e.chunks.iter().map(|c| c.file.as_ref()))
        .collect();
    let used: BTreeSet<String> = used.into_iter().map(str::to_owned).collect();
    index.files.retain(|f, _| used.contains(f));
    let kept = index.entries.len();
    let part = wrapper.map_or_else(
        || "the top-level model keys".to_owned(),
        |w| format!("`{w}` (the `{w}.` prefix removed)"),
    );
    Ok(format!(
        "{label}: --model-only: {kept} of {before} entries, the model part {part}; left out: {}",
        if left_out.is_empty() {
            "nothing".to_owned()
        } else {
            left_out.into_iter().collect::<Vec<_>>().join(", ")
        }
    ))
}
