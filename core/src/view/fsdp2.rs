//! FSDP2 per-rank folders (`model.state_dict()` with DTensor values and the raw
//! `optim.state_dict()` of every rank) read as torch's full state: the optimizer state keyed by FQN,
//! as `get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))`
//! keys it (`state.<fqn>.<name>`, FQNs in `param_groups[i].params`).
//!
//! The DTensor states already have global shapes and their pieces are ordinary chunks; only the
//! ids need names. torch maps id `i` to the `i`-th parameter of the optimizer's groups by object
//! identity. Offline the optimizer is assumed to have been built over `model.parameters()` (one
//! group, or consecutive slices of it), so the names are, in order:
//! - without a description: the model state dict's DTensor keys in stored order (FSDP2 makes every
//!   managed parameter a DTensor; plain tensors are taken to be buffers), tied aliases (a DTensor
//!   whose pieces share the storage of an earlier one in every rank's file) dropped;
//! - with a description: its `params` (named_parameters order, tied aliases dropped: those marked
//!   `shared_with` and those the model files show to share storage), or, when the
//!   optimizer holds fewer, only those with `requires_grad`.
//!
//! When the count of ids matches none of these the mapping cannot be decided and the error says
//! so. Each tensor state must have its parameter's shape.

use std::collections::{BTreeMap, HashMap};

use crate::index::{CheckpointIndex, EntryKind, FsdpInfo, IndexEntry, PathSeg, Role};
use crate::model::ModelDescription;
use crate::view::fsdp1::prefix_of;

/// Why a per-rank FSDP2 optimizer cannot be keyed by FQN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fsdp2ViewError {
    #[error(
        "{0}\nhint: the optimizer must have been built over model.parameters() (one group, or consecutive slices of it); pass --model MODEL.json (params in named_parameters() order, with requires_grad) when it holds only the trainable ones"
    )]
    Ids(String),
    #[error("`{key}`: {what}")]
    Mismatch { key: String, what: String },
    /// The ranks' optimizer files disagree, or name an id no group lists.
    #[error("{0}")]
    Files(String),
}

fn py_list(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    format!("[{}]", quoted.join(", "))
}

/// Every rank holds the same state names for each id (torch's `_check_optim_state` agreement).
fn check_state_names(index: &CheckpointIndex, optim_prefix: &str) -> Result<(), Fsdp2ViewError> {
    let mut names: BTreeMap<i64, BTreeMap<u32, Vec<String>>> = BTreeMap::new();
    let mut file_of: BTreeMap<u32, &str> = BTreeMap::new();
    for e in index
        .entries
        .iter()
        .filter(|e| e.key.starts_with(optim_prefix))
    {
        let Some(Role::OptimizerState {
            param: PathSeg::Index(id),
            state,
        }) = &e.role
        else {
            continue;
        };
        let mut ranks: Vec<u32> = e.chunks.iter().filter_map(|c| c.rank).collect();
        ranks.dedup();
        for c in &e.chunks {
            if let Some(r) = c.rank {
                file_of.entry(r).or_insert(c.file.as_ref());
            }
        }
        for r in ranks {
            let list = names.entry(*id).or_default().entry(r).or_default();
            if !list.contains(state) {
                list.push(state.clone());
            }
        }
    }
    for (id, per_rank) in &names {
        let mut it = per_rank.iter();
        let Some((r0, n0)) = it.next() else { continue };
        let mut n0 = n0.clone();
        n0.sort();
        for (r, n) in it {
            let mut n = n.clone();
            n.sort();
            if n != n0 {
                return Err(Fsdp2ViewError::Files(format!(
                    "{}: state.{id}: optimizer state names {} differ from {}'s {} (rank {r0})",
                    file_of.get(r).copied().unwrap_or("?"),
                    py_list(&n),
                    file_of.get(r0).copied().unwrap_or("?"),
                    py_list(&n0)
                )));
            }
        }
    }
    Ok(())
}

/// How the ids were named, for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Naming {
    pub names: Vec<String>,
    pub how: String,
}

/// The ids listed in the `param_groups[*].params` entries under `prefix`, in group order.
fn listed_ids(index: &CheckpointIndex, prefix: &str) -> Vec<u64> {
    let mut groups: Vec<(i64, Vec<u64>)> = index
        .entries
        .iter()
        .filter(|e| e.key.starts_with(prefix))
        .filter_map(|e| {
            let Some(Role::ParamGroup { group }) = &e.role else {
                return None;
            };
            if e.path.last() != Some(&PathSeg::Key("params".to_owned())) {
                return None;
            }
            let list = e.value.as_ref()?.as_array()?;
            Some((
                *group,
                list.iter().filter_map(serde_json::Value::as_u64).collect(),
            ))
        })
        .collect();
    groups.sort_by_key(|(g, _)| *g);
    groups.into_iter().flat_map(|(_, ids)| ids).collect()
}

/// The FQN of every id listed in the optimizer under `optim_prefix` (see the module doc).
#[allow(
    clippy::too_many_lines,
    reason = "the id-naming rules (stored order, description, tied parameters) share one set of lookups"
)]
pub fn name_ids(
    index: &CheckpointIndex,
    optim_prefix: &str,
    description: Option<&ModelDescription>,
) -> Result<(Vec<u64>, Naming), Fsdp2ViewError> {
    let ids = listed_ids(index, optim_prefix);
    let count = ids.len();
    let model_prefix = "model.";
    let mut dtensors: Vec<&IndexEntry> = index
        .entries
        .iter()
        .filter(|e| {
            e.key.starts_with(model_prefix)
                && e.role.is_none()
                && matches!(e.fsdp, Some(FsdpInfo::DTensor { .. }))
        })
        .collect();
    dtensors.sort_by_key(|e| (e.position.unwrap_or(u64::MAX), e.key.clone()));
    // Tied parameters (`head.weight = embed.weight`): `model.state_dict()` lists both names, whose
    // DTensors share one storage on every rank; `model.parameters()`, and so the optimizer,
    // holds the parameter once, under the first name.
    let ties = storage_ties(index, &dtensors, model_prefix);
    let tie_note = if ties.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = ties
            .iter()
            .map(|(alias, keep)| format!("`{alias}` is `{keep}`"))
            .collect();
        format!(
            " (tied weights, counted once: {}; the model files share their storage)",
            list.join(", ")
        )
    };
    let Some(desc) = description else {
        let names: Vec<String> = dtensors
            .iter()
            .map(|e| e.key[model_prefix.len()..].to_owned())
            .filter(|n| !ties.contains_key(n))
            .collect();
        if names.len() != count {
            let untied = if names.len() > count && ties.is_empty() {
                "; no two of them share storage in the model files, so no tied weight was seen: if the model ties weights, pass --model MODEL.json with `shared_with` on the alias (`shardscope layout --from CKPT --emit-model` marks ties it finds)"
            } else {
                ""
            };
            return Err(Fsdp2ViewError::Ids(format!(
                "the optimizer's param groups hold {count} parameters but the model state dict has {} DTensor parameters{tie_note}: cannot tell which parameter each optimizer id is{untied}",
                names.len()
            )));
        }
        return Ok((
            ids,
            Naming {
                names,
                how: format!("the model state dict's DTensor parameters, in order{tie_note}"),
            },
        ));
    };
    let listed: std::collections::BTreeSet<&str> =
        desc.params.iter().map(|p| p.fqn.as_str()).collect();
    let all: Vec<_> = desc
        .params
        .iter()
        .filter(|p| p.shared_with.is_none())
        // A tie the description does not mark (`named_parameters(remove_duplicate=False)`
        // without `shared_with`): the alias is not an optimizer parameter either.
        .filter(|p| {
            ties.get(&p.fqn)
                .is_none_or(|keep| !listed.contains(keep.as_str()))
        })
        .collect();
    let has_model = index
        .entries
        .iter()
        .any(|e| e.key.starts_with(model_prefix));
    if has_model {
        for p in &all {
            if index.entry(&format!("{model_prefix}{}", p.fqn)).is_none() {
                return Err(Fsdp2ViewError::Ids(format!(
                    "parameter `{}` of the model description is not a key of the model state dict",
                    p.fqn
                )));
            }
        }
    }
    let trainable: Vec<_> = all.iter().copied().filter(|p| p.requires_grad).collect();
    let (chosen, how) = if all.len() == count {
        (all, "the description's parameters, in order")
    } else if trainable.len() == count {
        (
            trainable,
            "the description's parameters with requires_grad, in order",
        )
    } else {
        return Err(Fsdp2ViewError::Ids(format!(
            "the optimizer's param groups hold {count} parameters but the model description lists {} parameters ({} with requires_grad){}: cannot tell which parameter each optimizer id is",
            all.len(),
            trainable.len(),
            if ties.is_empty() {
                " (a tied weight is counted once when its entry has `shared_with`)".to_owned()
            } else {
                tie_note.clone()
            }
        )));
    };
    Ok((
        ids,
        Naming {
            names: chosen.iter().map(|p| p.fqn.clone()).collect(),
            how: format!("{how}{tie_note}"),
        },
    ))
}

/// Among the model's DTensor entries (in stored order): alias FQN -> the FQN of the earlier entry
/// whose storage it shares (the same piece of one storage in every rank's file).
fn storage_ties(
    index: &CheckpointIndex,
    dtensors: &[&IndexEntry],
    model_prefix: &str,
) -> BTreeMap<String, String> {
    let at: HashMap<*const IndexEntry, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (std::ptr::from_ref(e), i))
        .collect();
    let candidates: Vec<usize> = dtensors
        .iter()
        .filter_map(|e| at.get(&std::ptr::from_ref(*e)).copied())
        .collect();
    let fqn = |i: usize| {
        let key = &index.entries[i].key;
        key.strip_prefix(model_prefix).unwrap_or(key).to_owned()
    };
    crate::index::ties::find_storage_ties(index, &candidates)
        .iter()
        .flat_map(|g| g.aliases.iter().map(|&a| (fqn(a), fqn(g.keep))))
        .collect()
}

/// `index` with the raw optimizer state (int ids) keyed by FQN. `None` naming when the index
/// holds no id-keyed optimizer state.
#[allow(
    clippy::too_many_lines,
    reason = "re-keys every kind of optimizer entry (tensor state, step, param_groups) in one pass over the state"
)]
pub fn fqn_keyed_optimizer(
    index: &CheckpointIndex,
    description: Option<&ModelDescription>,
) -> Result<(CheckpointIndex, Option<Naming>), Fsdp2ViewError> {
    let Some(optim_prefix) = index.entries.iter().find_map(|e| match &e.role {
        Some(Role::OptimizerState {
            param: PathSeg::Index(_),
            ..
        }) => Some(prefix_of(&e.path, 3).0),
        _ => None,
    }) else {
        return Ok((index.clone(), None));
    };
    check_state_names(index, &optim_prefix)?;
    let (_, naming) = name_ids(index, &optim_prefix, description)?;
    // Id `i` is the `i`-th parameter (torch numbers the parameters of its groups 0, 1, ...).
    let name_of: HashMap<i64, &str> = (0i64..)
        .zip(&naming.names)
        .map(|(id, n)| (id, n.as_str()))
        .collect();
    let param_shape = |fqn: &str| -> Option<Vec<u64>> {
        index
            .entry(&format!("model.{fqn}"))
            .and_then(|e| e.shape.clone())
            .or_else(|| {
                description?
                    .params
                    .iter()
                    .find(|p| p.fqn == fqn)
                    .map(|p| p.shape.clone())
            })
    };
    let mut out: BTreeMap<String, IndexEntry> = BTreeMap::new();
    for e in &index.entries {
        let mut e = e.clone();
        match e.role.clone() {
            Some(Role::OptimizerState {
                param: PathSeg::Index(id),
                state,
            }) if e.key.starts_with(&optim_prefix) => {
                let fqn = *name_of.get(&id).ok_or_else(|| {
                    Fsdp2ViewError::Files(format!(
                        "{}: state.{id}: optimizer id {id} has no parameter name: {} names are known ({})",
                        e.chunks
                            .first()
                            .map_or("the optimizer files", |c| c.file.as_ref()),
                        naming.names.len(),
                        naming.how
                    ))
                })?;
                let (prefix, mut path) = prefix_of(&e.path, 3);
                if e.kind == EntryKind::Tensor {
                    let zero_dim = e.chunks.iter().all(|c| c.sizes.is_empty());
                    if zero_dim {
                        // `step`: a plain 0-d tensor on every rank (replicas).
                        e.shape = Some(Vec::new());
                        for c in &mut e.chunks {
                            c.offsets = crate::shape::Dims::default();
                        }
                    } else if let (Some(have), Some(want)) = (&e.shape, param_shape(fqn))
                        && *have != want
                    {
                        return Err(Fsdp2ViewError::Mismatch {
                            key: e.key.clone(),
                            what: format!(
                                "the state of `{fqn}` has shape {have:?}, the parameter {want:?} (is id {id} really `{fqn}`? ids named by {})",
                                naming.how
                            ),
                        });
                    }
                }
                e.key = format!("{prefix}state.{fqn}.{state}");
                path.extend([
                    PathSeg::Key("state".to_owned()),
                    PathSeg::Key(fqn.to_owned()),
                    PathSeg::Key(state.clone()),
                ]);
                e.path = path;
                e.role = Some(Role::OptimizerState {
                    param: PathSeg::Key(fqn.to_owned()),
                    state,
                });
            }
            Some(Role::ParamGroup { .. })
                if e.key.starts_with(&optim_prefix)
                    && e.path.last() == Some(&PathSeg::Key("params".to_owned())) =>
            {
                if let Some(serde_json::Value::Array(list)) = &e.value {
                    let names: Vec<serde_json::Value> = list
                        .iter()
                        .map(|v| {
                            v.as_i64().and_then(|id| name_of.get(&id)).map_or_else(
                                || v.clone(),
                                |n| serde_json::Value::String((*n).to_owned()),
                            )
                        })
                        .collect();
                    e.value = Some(serde_json::Value::Array(names));
                    e.object = None;
                }
            }
            _ => {}
        }
        if out.insert(e.key.clone(), e).is_some() {
            return Err(Fsdp2ViewError::Ids(
                "two optimizer ids name the same parameter".to_owned(),
            ));
        }
    }
    Ok((
        CheckpointIndex {
            format: index.format,
            kind: index.kind,
            has_optimizer_state: index.has_optimizer_state,
            entries: out.into_values().collect(),
            files: index.files.clone(),
            dcp: index.dcp.clone(),
        },
        Some(naming),
    ))
}
