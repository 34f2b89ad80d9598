//! FSDP2 (`fully_shard`) per-rank state dicts to the full ones, offline: what
//! `get_model_state_dict` / `get_optimizer_state_dict(model, optim,
//! options=StateDictOptions(full_state_dict=True))` of `torch.distributed.checkpoint.state_dict`
//! return, computed from every rank's `model.state_dict()` and raw `optim.state_dict()`.
//!
//! - Model: every `DTensor` is replaced by the full tensor gathered from all ranks' pieces
//!   (spec 4.3, 4.4); buffers (plain tensors, the same on every rank) are rank 0's.
//! - Optimizer (spec 3.1 (a) → 4.6): integer ids become FQNs — in `state` (keeping the raw
//!   dict's order, as DSD's in-place rekeying keeps it) and in `param_groups[i]["params"]`
//!   (keeping the group's order). Positive-dim states (`exp_avg`, `exp_avg_sq`) are DTensors
//!   gathered like parameters; 0-dim `step` tensors and non-tensor states must agree on every rank
//!   and are rank 0's.
//!
//! Ids: FSDP2 keeps clean names, and DSD maps id `i` to the FQN of the `i`-th parameter of the
//! optimizer's groups (group by group) by identity with `model.named_parameters()`. Offline the
//! caller gives those names in id order ([`full_optim_from_fsdp2`]'s `names`): when the optimizer
//! was built over `model.parameters()` (in one group or cut into consecutive groups) they are the
//! parameters in `named_parameters()` order, which [`dtensor_param_names`] reads off a model state
//! dict (FSDP2 turns every managed parameter into a `DTensor`; buffers stay plain tensors).
//!
//! Every error names the rank's file (the labels the caller passes) and the key.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::tree::{Dict, DistKind, DistTensor, Key, Node, Tensor};
use crate::transform::TransformError;
use crate::transform::reference::chunk::full_from_sharded_chunks;

/// Why per-rank FSDP2 state dicts cannot be combined.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Fsdp2OptimError {
    /// No rank was given.
    #[error("no per-rank state dicts were given")]
    NoRanks,
    /// A value does not have the shape of a state dict / optimizer state dict.
    #[error("{file}: {key}: expected {expected}, found {found}")]
    WrongKind {
        file: String,
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    /// A key present on the first rank is missing on another (or the other way round).
    #[error("{file}: {key}: present in {first_file} but missing here")]
    MissingKey {
        file: String,
        key: String,
        first_file: String,
    },
    /// A key is present on this rank but not on the first.
    #[error("{file}: {key}: not present in {first_file}")]
    ExtraKey {
        file: String,
        key: String,
        first_file: String,
    },
    /// The state names of one parameter differ between ranks.
    #[error(
        "{file}: {key}: optimizer state names [{names}] differ from [{first_names}] in {first_file}"
    )]
    StateNames {
        file: String,
        key: String,
        names: String,
        first_names: String,
        first_file: String,
    },
    /// A replicated value (0-dim `step`, a non-tensor state, a buffer, a hyperparameter) differs
    /// between ranks.
    #[error("{file}: {key}: the value differs from the one in {first_file}")]
    ValueDiffers {
        file: String,
        key: String,
        first_file: String,
    },
    /// A tensor state is a DTensor on one rank and not on another.
    #[error("{file}: {key}: a {found} here but a {expected} in {first_file}")]
    KindDiffers {
        file: String,
        key: String,
        found: &'static str,
        expected: &'static str,
        first_file: String,
    },
    /// An optimizer id has no parameter name (the names list is shorter).
    #[error(
        "{file}: {key}: optimizer id {id} has no parameter name: {count} names are known ({origin})"
    )]
    NoName {
        file: String,
        key: String,
        id: i64,
        count: usize,
        origin: String,
    },
    /// The same id appears twice in the param groups.
    #[error("{file}: {key}: optimizer id {id} is listed twice in the param groups")]
    DuplicateId { file: String, key: String, id: i64 },
    /// A gathered state's shape differs from its parameter's.
    #[error(
        "{file}: {key}: the state has shape {found:?} but parameter `{fqn}` has shape {expected:?}; the optimizer ids do not follow these parameter names"
    )]
    Shape {
        file: String,
        key: String,
        fqn: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    /// The DTensor pieces of one value do not tile its global shape.
    #[error("{file}: {key}: the pieces of the ranks do not make up the tensor: {reason}")]
    Pieces {
        file: String,
        key: String,
        reason: String,
    },
}

type Result<T> = std::result::Result<T, Fsdp2OptimError>;

/// The names of the parameters in a FSDP2 model state dict, in its order: the keys whose value is
/// a `DTensor` (buffers and parameters FSDP2 does not manage are plain tensors and are skipped).
/// Keys of a `model.state_dict()` follow module pre-order with each module's parameters first, so
/// these are `named_parameters()` order.
pub fn dtensor_param_names(model: &Dict) -> Vec<String> {
    model
        .iter()
        .filter(|(_, v)| matches!(v, Node::Dist(d) if d.kind == DistKind::DTensor))
        .map(|(k, _)| k.to_string())
        .collect()
}

/// The number of entries of all `param_groups[i]["params"]` lists of a raw optimizer state dict
/// (0 when it has no groups).
pub fn optimizer_param_count(osd: &Dict) -> usize {
    osd.get_str("param_groups")
        .and_then(Node::as_list)
        .map_or(0, |groups| {
            groups
                .iter()
                .filter_map(|g| g.as_dict()?.get_str("params")?.as_list().map(<[Node]>::len))
                .sum()
        })
}

fn kind_of(n: &Node) -> &'static str {
    match n {
        Node::Dist(d) if d.kind == DistKind::DTensor => "DTensor",
        Node::Dist(_) => "ShardedTensor",
        other => other.kind_name(),
    }
}

/// One rank's value with the label of its file.
struct Ranked<'a, T> {
    file: &'a str,
    value: &'a T,
}

fn dict<'a>(n: &'a Node, file: &str, key: &str) -> Result<&'a Dict> {
    n.as_dict().ok_or_else(|| Fsdp2OptimError::WrongKind {
        file: file.to_owned(),
        key: key.to_owned(),
        expected: "dict",
        found: n.kind_name(),
    })
}

/// One `DTensor` value of every rank, to be made into the full tensor by a [`Gather`] function.
#[derive(Debug, Clone, Copy)]
pub struct DTensorValue<'a> {
    /// The keys leading to the value in every rank's dict (the same on every rank), e.g.
    /// `state`, `3`, `exp_avg`.
    pub source: &'a [Key],
    /// The keys leading to the full value in the output dict, e.g. `state`, `layer.weight`,
    /// `exp_avg`.
    pub target: &'a [Key],
    /// Every rank's DTensor, in rank order.
    pub pieces: &'a [&'a DistTensor],
    /// For every rank, where its local piece lies in the full tensor (flattened in row-major
    /// order): `(first element, element count)`. Checked: the pieces tile the tensor exactly.
    pub placement: &'a [(u64, u64)],
    /// The value's key and rank 0's file, for messages.
    pub key: &'a str,
    pub file: &'a str,
}

/// Makes the full tensor of one [`DTensorValue`]: [`gather_in_memory`] copies the pieces' bytes;
/// a streaming caller returns a tensor without bytes (dtype and global shape) and reads the
/// pieces later.
pub type Gather<'g> = dyn FnMut(&DTensorValue<'_>) -> Result<Tensor> + 'g;

/// The full tensor from pieces that hold their bytes.
pub fn gather_in_memory(v: &DTensorValue<'_>) -> Result<Tensor> {
    full_from_sharded_chunks(v.pieces, v.key).map_err(|e| Fsdp2OptimError::Pieces {
        file: v.file.to_owned(),
        key: v.key.to_owned(),
        reason: match e {
            TransformError::BadTensor { reason, .. } => reason,
            other => other.to_string(),
        },
    })
}

/// Where every rank's local piece lies in the full tensor, checking that the pieces are dim-0
/// chunks that tile it exactly (the checks of [`full_from_sharded_chunks`], without bytes).
fn placement(pieces: &[&DistTensor], key: &str, file: &str) -> Result<Vec<(u64, u64)>> {
    let bad = |reason: String| Fsdp2OptimError::Pieces {
        file: file.to_owned(),
        key: key.to_owned(),
        reason,
    };
    let Some(first) = pieces.first() else {
        return Err(bad("no rank holds this tensor".to_owned()));
    };
    let shape = &first.global_shape;
    let Some(&rows) = shape.first() else {
        return Err(bad(
            "a sharded tensor must have at least one dimension".to_owned()
        ));
    };
    let row_numel =
        crate::shape::numel(&shape[1..]).ok_or_else(|| bad("global shape overflows".to_owned()))?;
    let numel = row_numel
        .checked_mul(rows)
        .ok_or_else(|| bad("global shape overflows".to_owned()))?;
    // Row ranges claimed so far (start, end), to find rows held twice without a per-row table.
    let mut claimed: Vec<(u64, u64)> = Vec::with_capacity(pieces.len());
    let mut out = Vec::with_capacity(pieces.len());
    let mut covered = 0u64;
    for piece in pieces {
        if &piece.global_shape != shape || piece.dtype != first.dtype {
            return Err(bad(format!(
                "ranks disagree on the global tensor: {:?} {} vs {:?} {}",
                piece.global_shape, piece.dtype, shape, first.dtype
            )));
        }
        let Some((offsets, local)) = &piece.local else {
            out.push((0, 0));
            continue;
        };
        let rows_here = local.shape.first().copied().unwrap_or(0);
        if local.dtype != first.dtype
            || local.shape.get(1..) != shape.get(1..)
            || offsets.iter().skip(1).any(|&o| o != 0)
        {
            return Err(bad(format!(
                "local shard {:?} at {offsets:?} is not a dim-0 chunk of {shape:?}",
                local.shape
            )));
        }
        if rows_here == 0 {
            out.push((0, 0));
            continue;
        }
        let start = offsets[0];
        let end = start
            .checked_add(rows_here)
            .filter(|&e| e <= rows)
            .ok_or_else(|| bad(format!("local shard at row {start} runs past {shape:?}")))?;
        // The same rows as an earlier rank: a replica (HSDP `(Replicate, Shard(0))`: rank r and
        // r + S hold one shard); the first replica's piece is read.
        if claimed.contains(&(start, end)) {
            out.push((0, 0));
            continue;
        }
        // The first row of this piece that an earlier piece holds.
        if let Some(row) = claimed
            .iter()
            .filter(|&&(s, e)| start < e && s < end)
            .map(|&(s, _)| start.max(s))
            .min()
        {
            return Err(bad(format!("row {row} is held by two ranks")));
        }
        claimed.push((start, end));
        // Both fit: end <= rows and rows * row_numel did not overflow.
        out.push((start * row_numel, rows_here * row_numel));
        covered += rows_here * row_numel;
    }
    if covered != numel {
        return Err(bad(format!(
            "the ranks' shards cover {covered} of {numel} elements"
        )));
    }
    Ok(out)
}

/// Gathers one value present on every rank: DTensors into the full tensor (through `gather`);
/// anything else must be equal on every rank (rank 0's is kept). `source` and `target` are the
/// keys of the value in the ranks' dicts and in the output.
fn gather_value(
    ranks: &[Ranked<'_, Node>],
    key: &str,
    (source, target): (&[Key], &[Key]),
    gather: &mut Gather<'_>,
) -> Result<Node> {
    let first = &ranks[0];
    if let Node::Dist(d0) = first.value {
        let mut pieces = Vec::with_capacity(ranks.len());
        let mut local_numel: u64 = 0;
        // Pieces of replicas (the same offsets and shape as an earlier rank's) count once.
        let mut seen: Vec<(&[u64], &[u64])> = Vec::new();
        for r in ranks {
            let Node::Dist(d) = r.value else {
                return Err(Fsdp2OptimError::KindDiffers {
                    file: r.file.to_owned(),
                    key: key.to_owned(),
                    found: kind_of(r.value),
                    expected: kind_of(first.value),
                    first_file: first.file.to_owned(),
                });
            };
            if let Some((offsets, t)) = &d.local {
                let place = (offsets.as_slice(), t.shape.as_slice());
                if !seen.contains(&place) {
                    seen.push(place);
                    local_numel = local_numel.saturating_add(t.numel());
                }
            }
            pieces.push(d);
        }
        // Only allocate what the pieces can fill: Shard(0) pieces tile the tensor exactly.
        let global: Option<u64> = crate::shape::numel(&d0.global_shape);
        if d0.kind != DistKind::DTensor || global != Some(local_numel) {
            return Err(Fsdp2OptimError::Pieces {
                file: first.file.to_owned(),
                key: key.to_owned(),
                reason: format!(
                    "{} of global shape {:?}: the local pieces hold {local_numel} elements",
                    kind_of(first.value),
                    d0.global_shape
                ),
            });
        }
        let placement = placement(&pieces, key, first.file)?;
        let full = gather(&DTensorValue {
            source,
            target,
            pieces: &pieces,
            placement: &placement,
            key,
            file: first.file,
        })?;
        return Ok(Node::Tensor(full));
    }
    for r in &ranks[1..] {
        if r.value != first.value {
            return Err(if matches!(r.value, Node::Dist(_)) {
                Fsdp2OptimError::KindDiffers {
                    file: r.file.to_owned(),
                    key: key.to_owned(),
                    found: kind_of(r.value),
                    expected: kind_of(first.value),
                    first_file: first.file.to_owned(),
                }
            } else {
                Fsdp2OptimError::ValueDiffers {
                    file: r.file.to_owned(),
                    key: key.to_owned(),
                    first_file: first.file.to_owned(),
                }
            });
        }
    }
    Ok(first.value.clone())
}

/// Checks that every rank's dict has exactly the keys of the first, in any order.
fn same_keys(ranks: &[Ranked<'_, Dict>], key: &str) -> Result<()> {
    let first = &ranks[0];
    for r in &ranks[1..] {
        if let Some(k) = first.value.keys().find(|k| !r.value.contains(k)) {
            return Err(Fsdp2OptimError::MissingKey {
                file: r.file.to_owned(),
                key: join(key, k),
                first_file: first.file.to_owned(),
            });
        }
        if let Some(k) = r.value.keys().find(|k| !first.value.contains(k)) {
            return Err(Fsdp2OptimError::ExtraKey {
                file: r.file.to_owned(),
                key: join(key, k),
                first_file: first.file.to_owned(),
            });
        }
    }
    Ok(())
}

fn join(path: &str, k: impl std::fmt::Display) -> String {
    if path.is_empty() {
        k.to_string()
    } else {
        format!("{path}.{k}")
    }
}

/// The full model state dict (`get_model_state_dict(full_state_dict=True)`) from every rank's
/// `model.state_dict()`; `files` labels the ranks in messages.
pub fn full_model_from_fsdp2(per_rank: &[&Dict], files: &[String]) -> Result<Dict> {
    full_model_from_fsdp2_with(per_rank, files, &mut gather_in_memory)
}

/// [`full_model_from_fsdp2`] with every DTensor made by `gather` (a streaming caller gives
/// skeletons: tensors with dtype and shape but no bytes; plain tensors, compared across ranks,
/// must hold their bytes).
pub fn full_model_from_fsdp2_with(
    per_rank: &[&Dict],
    files: &[String],
    gather: &mut Gather<'_>,
) -> Result<Dict> {
    let ranks = ranked(per_rank, files)?;
    same_keys(&ranks, "")?;
    let mut out = Dict::new();
    for (k, _) in ranks[0].value.iter() {
        let values: Vec<Ranked<'_, Node>> = ranks
            .iter()
            .map(|r| Ranked {
                file: r.file,
                value: r.value.get(k).unwrap_or(&Node::None),
            })
            .collect();
        let path = std::slice::from_ref(k);
        out.insert(
            k.clone(),
            gather_value(&values, &k.to_string(), (path, path), gather)?,
        );
    }
    Ok(out)
}

fn ranked<'a>(per_rank: &[&'a Dict], files: &'a [String]) -> Result<Vec<Ranked<'a, Dict>>> {
    if per_rank.is_empty() {
        return Err(Fsdp2OptimError::NoRanks);
    }
    Ok(per_rank
        .iter()
        .enumerate()
        .map(|(r, d)| Ranked {
            file: files.get(r).map_or("<rank>", String::as_str),
            value: *d,
        })
        .collect())
}

/// The parameter names of the optimizer ids, and where they came from (for messages).
#[derive(Debug, Clone, Copy)]
pub struct IdNames<'a> {
    /// The FQN of id `i` at index `i`.
    pub names: &'a [String],
    /// Where the names come from, e.g. "the DTensor parameters of the model state dict".
    pub origin: &'a str,
    /// Parameter shapes to check the gathered states against (e.g. the full model's).
    pub shapes: &'a BTreeMap<String, Vec<u64>>,
}

/// The full FQN-keyed optimizer state dict (`get_optimizer_state_dict(model, optim,
/// options=StateDictOptions(full_state_dict=True))`) from every rank's raw `optim.state_dict()`.
/// `files` labels the ranks in messages.
pub fn full_optim_from_fsdp2(
    per_rank: &[&Dict],
    files: &[String],
    ids: &IdNames<'_>,
) -> Result<Dict> {
    full_optim_from_fsdp2_with(per_rank, files, ids, &mut gather_in_memory)
}

/// [`full_optim_from_fsdp2`] with every DTensor state made by `gather` (see
/// [`full_model_from_fsdp2_with`]).
pub fn full_optim_from_fsdp2_with(
    per_rank: &[&Dict],
    files: &[String],
    ids: &IdNames<'_>,
    gather: &mut Gather<'_>,
) -> Result<Dict> {
    let ranks = ranked(per_rank, files)?;
    let first = &ranks[0];
    same_keys(&ranks, "")?;
    let name_of = |id: &Key, file: &str, key: &str| -> Result<String> {
        let id = match id {
            Key::Int(i) => *i,
            Key::Str(s) => {
                return Err(Fsdp2OptimError::WrongKind {
                    file: file.to_owned(),
                    key: join(key, s),
                    expected: "an integer optimizer id (a raw `optim.state_dict()`)",
                    found: "str",
                });
            }
        };
        usize::try_from(id)
            .ok()
            .and_then(|i| ids.names.get(i))
            .cloned()
            .ok_or_else(|| Fsdp2OptimError::NoName {
                file: file.to_owned(),
                key: key.to_owned(),
                id,
                count: ids.names.len(),
                origin: ids.origin.to_owned(),
            })
    };

    let mut out = Dict::new();
    for (top, _) in first.value.iter() {
        let top_key = top.to_string();
        let values: Vec<Ranked<'_, Node>> = ranks
            .iter()
            .map(|r| Ranked {
                file: r.file,
                value: r.value.get(top).unwrap_or(&Node::None),
            })
            .collect();
        match top.as_str() {
            Some("state") => {
                let states: Vec<Ranked<'_, Dict>> = values
                    .iter()
                    .map(|r| {
                        Ok(Ranked {
                            file: r.file,
                            value: dict(r.value, r.file, "state")?,
                        })
                    })
                    .collect::<Result<_>>()?;
                same_keys(&states, "state")?;
                let mut state_out = Dict::new();
                for (id, _) in states[0].value.iter() {
                    let id_key = join("state", id);
                    let fqn = name_of(id, first.file, &id_key)?;
                    let per_param: Vec<Ranked<'_, Dict>> = states
                        .iter()
                        .map(|r| {
                            let n = r.value.get(id).unwrap_or(&Node::None);
                            Ok(Ranked {
                                file: r.file,
                                value: dict(n, r.file, &id_key)?,
                            })
                        })
                        .collect::<Result<_>>()?;
                    state_out.insert(
                        Key::Str(fqn.clone()),
                        param_state(&per_param, (&id_key, id), &fqn, ids, gather)?,
                    );
                }
                out.insert(top.clone(), Node::Dict(state_out));
            }
            Some("param_groups") => {
                let path = std::slice::from_ref(top);
                let groups = gather_value(&values, "param_groups", (path, path), gather)?;
                out.insert(top.clone(), rekey_groups(&groups, first.file, &name_of)?);
            }
            _ => {
                let path = std::slice::from_ref(top);
                out.insert(
                    top.clone(),
                    gather_value(&values, &top_key, (path, path), gather)?,
                );
            }
        }
    }
    Ok(out)
}

fn names_of(d: &Dict) -> String {
    d.keys()
        .map(|k| format!("'{k}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn param_state(
    per_rank: &[Ranked<'_, Dict>],
    (key, id): (&str, &Key),
    fqn: &str,
    ids: &IdNames<'_>,
    gather: &mut Gather<'_>,
) -> Result<Node> {
    let first = &per_rank[0];
    let first_names: BTreeSet<&Key> = first.value.keys().collect();
    for r in &per_rank[1..] {
        let names: BTreeSet<&Key> = r.value.keys().collect();
        if names != first_names {
            return Err(Fsdp2OptimError::StateNames {
                file: r.file.to_owned(),
                key: key.to_owned(),
                names: names_of(r.value),
                first_names: names_of(first.value),
                first_file: first.file.to_owned(),
            });
        }
    }
    let mut out = Dict::new();
    for (name, _) in first.value.iter() {
        let sub = join(key, name);
        let values: Vec<Ranked<'_, Node>> = per_rank
            .iter()
            .map(|r| Ranked {
                file: r.file,
                value: r.value.get(name).unwrap_or(&Node::None),
            })
            .collect();
        let source = [Key::str("state"), id.clone(), name.clone()];
        let target = [Key::str("state"), Key::str(fqn), name.clone()];
        let value = gather_value(&values, &sub, (&source, &target), gather)?;
        if let (Node::Tensor(t), Some(expected)) = (&value, ids.shapes.get(fqn))
            && t.dim() > 0
            && &t.shape != expected
        {
            return Err(Fsdp2OptimError::Shape {
                file: first.file.to_owned(),
                key: sub,
                fqn: fqn.to_owned(),
                found: t.shape.clone(),
                expected: expected.clone(),
            });
        }
        out.insert(name.clone(), value);
    }
    Ok(Node::Dict(out))
}

fn rekey_groups(
    groups: &Node,
    file: &str,
    name_of: &dyn Fn(&Key, &str, &str) -> Result<String>,
) -> Result<Node> {
    let list = groups.as_list().ok_or_else(|| Fsdp2OptimError::WrongKind {
        file: file.to_owned(),
        key: "param_groups".to_owned(),
        expected: "list",
        found: groups.kind_name(),
    })?;
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (g, group) in list.iter().enumerate() {
        let key = format!("param_groups.{g}");
        let group = dict(group, file, &key)?;
        let mut new_group = Dict::new();
        for (k, v) in group.iter() {
            if k.as_str() != Some("params") {
                new_group.insert(k.clone(), v.clone());
                continue;
            }
            let pkey = join(&key, "params");
            let params = v.as_list().ok_or_else(|| Fsdp2OptimError::WrongKind {
                file: file.to_owned(),
                key: pkey.clone(),
                expected: "list",
                found: v.kind_name(),
            })?;
            let mut names = Vec::with_capacity(params.len());
            for p in params {
                let Node::Int(id) = p else {
                    return Err(Fsdp2OptimError::WrongKind {
                        file: file.to_owned(),
                        key: pkey,
                        expected: "a list of integer optimizer ids",
                        found: p.kind_name(),
                    });
                };
                if !seen.insert(*id) {
                    return Err(Fsdp2OptimError::DuplicateId {
                        file: file.to_owned(),
                        key: pkey,
                        id: *id,
                    });
                }
                names.push(Node::Str(name_of(&Key::Int(*id), file, &pkey)?));
            }
            new_group.insert(k.clone(), Node::List(names));
        }
        out.push(Node::Dict(new_group));
    }
    Ok(if matches!(groups, Node::Tuple(_)) {
        Node::Tuple(out)
    } else {
        Node::List(out)
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::dtype::DType;
    use crate::model::tree::{DistTensor, Tensor};

    fn f32s(values: &[f32], shape: Vec<u64>) -> Tensor {
        Tensor::new(
            DType::Float32,
            shape,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
        .unwrap()
    }

    fn dt(global: Vec<u64>, offset: u64, local: Tensor) -> Node {
        let mut offsets = vec![0; global.len()];
        offsets[0] = offset;
        Node::Dist(DistTensor {
            kind: DistKind::DTensor,
            dtype: DType::Float32,
            global_shape: global,
            local: Some((offsets, local)),
            chunks: Vec::new(),
        })
    }

    fn osd(rank: u64, exp_avg_name: &str) -> Dict {
        // One parameter of 3 elements over 2 ranks: [a, b] and [c].
        let local = if rank == 0 {
            f32s(&[1.0, 2.0], vec![2])
        } else {
            f32s(&[3.0], vec![1])
        };
        let mut st = Dict::new();
        st.insert(Key::str("step"), Node::Tensor(f32s(&[2.0], vec![])));
        st.insert(Key::str(exp_avg_name), dt(vec![3], rank * 2, local));
        let mut state = Dict::new();
        state.insert(Key::Int(0), Node::Dict(st));
        let mut group = Dict::new();
        group.insert(Key::str("lr"), Node::Float(0.1));
        group.insert(
            Key::str("params"),
            Node::List(vec![Node::Int(0), Node::Int(1)]),
        );
        let mut out = Dict::new();
        out.insert(Key::str("state"), Node::Dict(state));
        out.insert(
            Key::str("param_groups"),
            Node::List(vec![Node::Dict(group)]),
        );
        out
    }

    fn files() -> Vec<String> {
        vec!["r0.pt".to_owned(), "r1.pt".to_owned()]
    }

    #[test]
    fn gathers_and_rekeys() {
        let (rank0, rank1) = (osd(0, "exp_avg"), osd(1, "exp_avg"));
        let names = vec!["w".to_owned(), "frozen".to_owned()];
        let shapes = BTreeMap::from([("w".to_owned(), vec![3])]);
        let ids = IdNames {
            names: &names,
            origin: "test",
            shapes: &shapes,
        };
        let full = full_optim_from_fsdp2(&[&rank0, &rank1], &files(), &ids).unwrap();
        let param = full
            .get_str("state")
            .unwrap()
            .as_dict()
            .unwrap()
            .get_str("w")
            .unwrap();
        let exp_avg = param
            .as_dict()
            .unwrap()
            .get_str("exp_avg")
            .unwrap()
            .as_tensor()
            .unwrap();
        assert_eq!(exp_avg, &f32s(&[1.0, 2.0, 3.0], vec![3]));
        let group = &full.get_str("param_groups").unwrap().as_list().unwrap()[0];
        assert_eq!(
            group.as_dict().unwrap().get_str("params").unwrap(),
            &Node::List(vec![Node::Str("w".into()), Node::Str("frozen".into())])
        );
    }

    #[test]
    fn errors_name_file_and_key() {
        let (a, b) = (osd(0, "exp_avg"), osd(1, "exp_avg2"));
        let names = vec!["w".to_owned(), "frozen".to_owned()];
        let shapes = BTreeMap::new();
        let ids = IdNames {
            names: &names,
            origin: "test",
            shapes: &shapes,
        };
        let e = full_optim_from_fsdp2(&[&a, &b], &files(), &ids).unwrap_err();
        assert!(
            matches!(&e, Fsdp2OptimError::StateNames { file, key, .. } if file == "r1.pt" && key == "state.0"),
            "{e}"
        );
        let b = osd(1, "exp_avg");
        let one = vec!["w".to_owned()];
        let ids = IdNames {
            names: &one,
            origin: "test",
            shapes: &shapes,
        };
        let e = full_optim_from_fsdp2(&[&a, &b], &files(), &ids).unwrap_err();
        assert!(matches!(&e, Fsdp2OptimError::NoName { id: 1, .. }), "{e}");
        let shapes = BTreeMap::from([("w".to_owned(), vec![4])]);
        let ids = IdNames {
            names: &names,
            origin: "test",
            shapes: &shapes,
        };
        let e = full_optim_from_fsdp2(&[&a, &b], &files(), &ids).unwrap_err();
        assert!(matches!(&e, Fsdp2OptimError::Shape { .. }), "{e}");
        // A rank with a key the first rank lacks.
        let mut c = osd(1, "exp_avg");
        c.insert(Key::str("extra"), Node::Int(1));
        let e = full_optim_from_fsdp2(&[&a, &c], &files(), &ids).unwrap_err();
        assert!(
            matches!(&e, Fsdp2OptimError::ExtraKey { key, .. } if key == "extra"),
            "{e}"
        );
    }

    #[test]
    fn skeleton_gather_checks_pieces_like_the_in_memory_one() {
        // Two ranks claiming row 1 of a [3] tensor: [0, 1] at 0 and [1, 2] at 1.
        let a = Dict::from_iter([(Key::str("w"), dt(vec![3], 0, f32s(&[1.0, 2.0], vec![2])))]);
        let b = Dict::from_iter([(Key::str("w"), dt(vec![3], 1, f32s(&[3.0], vec![1])))]);
        let c = Dict::from_iter([(Key::str("w"), dt(vec![3], 2, f32s(&[3.0], vec![1])))]);
        let mut skeleton = |v: &DTensorValue<'_>| {
            Ok(Tensor {
                dtype: v.pieces[0].dtype,
                shape: v.pieces[0].global_shape.clone(),
                data: Vec::new(),
            })
        };
        let e_mem = full_model_from_fsdp2(&[&a, &b], &files()).unwrap_err();
        let e_skel = full_model_from_fsdp2_with(&[&a, &b], &files(), &mut skeleton).unwrap_err();
        assert_eq!(e_mem, e_skel);
        assert!(
            e_skel.to_string().contains("row 1 is held by two ranks"),
            "{e_skel}"
        );
        // A good split: the skeleton gather sees where each piece goes.
        let mut seen = Vec::new();
        let full = full_model_from_fsdp2_with(&[&a, &c], &files(), &mut |v| {
            seen.push((v.source.to_vec(), v.target.to_vec(), v.placement.to_vec()));
            skeleton(v)
        })
        .unwrap();
        assert_eq!(
            full.get_str("w").unwrap().as_tensor().unwrap().shape,
            vec![3]
        );
        assert_eq!(
            seen,
            vec![(
                vec![Key::str("w")],
                vec![Key::str("w")],
                vec![(0, 2), (2, 1)]
            )]
        );
    }
}
