//! A checkpoint split into the parts a diagnosis looks at one by one: model parts (a flat state
//! dict, or one per top-level key of a nested checkpoint) and optimizer parts.

use std::collections::{BTreeMap, BTreeSet};

use crate::index::{CheckpointIndex, EntryKind, IndexEntry, PathSeg, Role};

/// A model part of the checkpoint: keys relative to the part.
pub(super) struct ModelPart<'a> {
    /// The top-level key of a nested checkpoint (`model`), or `None` for a flat one.
    pub(super) name: Option<String>,
    /// Relative clean key -> entry (tensors only).
    pub(super) entries: BTreeMap<String, &'a IndexEntry>,
}

/// An optimizer part: `state[param][name]` entries and the `param_groups` leaves.
pub(super) struct OptimPart<'a> {
    pub(super) prefix: Vec<PathSeg>,
    pub(super) state_params: BTreeSet<PathSeg>,
    pub(super) group_ids: Vec<i64>,
    pub(super) group_names: Vec<String>,
    pub(super) entries: Vec<&'a IndexEntry>,
}

pub(super) struct Parts<'a> {
    pub(super) models: Vec<ModelPart<'a>>,
    pub(super) optims: Vec<OptimPart<'a>>,
}

pub(super) fn join(path: &[PathSeg]) -> String {
    path.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

fn optim_prefix(e: &IndexEntry) -> Option<Vec<PathSeg>> {
    match &e.role {
        // Flattened (`state.<fqn>.<name>` one key): the part is the key's parent.
        Some(Role::OptimizerState { .. }) if matches!(e.path.last(), Some(PathSeg::Key(k)) if k.starts_with("state.")) =>
        {
            let n = e.path.len().checked_sub(1)?;
            Some(e.path[..n].to_vec())
        }
        Some(Role::OptimizerState { .. }) => {
            let n = e.path.len().checked_sub(3)?;
            Some(e.path[..n].to_vec())
        }
        Some(Role::ParamGroup { .. }) => {
            let at = e
                .path
                .iter()
                .position(|s| *s == PathSeg::Key("param_groups".into()))?;
            Some(e.path[..at].to_vec())
        }
        None => None,
    }
}

pub(super) fn split_parts(index: &CheckpointIndex) -> Parts<'_> {
    let mut optims: BTreeMap<Vec<PathSeg>, OptimPart<'_>> = BTreeMap::new();
    let mut model_entries: Vec<&IndexEntry> = Vec::new();
    for e in &index.entries {
        if let Some(prefix) = optim_prefix(e) {
            let part = optims.entry(prefix.clone()).or_insert_with(|| OptimPart {
                prefix,
                state_params: BTreeSet::new(),
                group_ids: Vec::new(),
                group_names: Vec::new(),
                entries: Vec::new(),
            });
            part.entries.push(e);
            match &e.role {
                Some(Role::OptimizerState { param, .. }) => {
                    part.state_params.insert(param.clone());
                }
                Some(Role::ParamGroup { .. })
                    if e.path.last() == Some(&PathSeg::Key("params".into())) =>
                {
                    if let Some(serde_json::Value::Array(items)) = &e.value {
                        for v in items {
                            if let Some(i) = v.as_i64() {
                                part.group_ids.push(i);
                            } else if let Some(s) = v.as_str() {
                                part.group_names.push(s.to_owned());
                            }
                        }
                    }
                }
                _ => {}
            }
        } else if e.kind == EntryKind::Tensor {
            model_entries.push(e);
        }
    }
    // Nested when every model tensor sits at least two levels deep: one part per top-level key.
    let nested = !model_entries.is_empty()
        && model_entries
            .iter()
            .all(|e| e.path.len() >= 2 && matches!(e.path[0], PathSeg::Key(_)));
    let mut models: BTreeMap<Option<String>, ModelPart<'_>> = BTreeMap::new();
    for e in model_entries {
        let (name, rel) = if nested {
            (Some(e.path[0].to_string()), join(&e.path[1..]))
        } else {
            (None, e.key.clone())
        };
        // The training state beside a model and its optimizer (RNG, scheduler, counters: the
        // `extra` sets of a trainer's folder) is not a model.
        if name.as_deref() == Some("extra") {
            continue;
        }
        models
            .entry(name.clone())
            .or_insert_with(|| ModelPart {
                name,
                entries: BTreeMap::new(),
            })
            .entries
            .insert(rel, e);
    }
    Parts {
        models: models.into_values().collect(),
        optims: optims.into_values().collect(),
    }
}

/// The key as stored, relative to its part.
pub(super) fn raw_rel(e: &IndexEntry, part: Option<&str>) -> String {
    let raw = e.raw_key.clone().unwrap_or_else(|| e.key.clone());
    match part {
        Some(p) => raw
            .strip_prefix(p)
            .and_then(|r| r.strip_prefix('.'))
            .map_or_else(|| raw.clone(), ToOwned::to_owned),
        None => raw,
    }
}
