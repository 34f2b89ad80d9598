//! The optimizer state of a DeepSpeed ZeRO checkpoint per parameter name, in the shape of torch's
//! FQN-keyed full optimizer state dict (`get_optimizer_state_dict(full_state_dict=True)`):
//! `optimizer.state.<fqn>.<name>` and `optimizer.param_groups.<g>.<key>` (`params` listing the
//! FQNs).
//!
//! DeepSpeed wraps a torch optimizer whose parameters are its flat partitions (one per group on
//! each rank), so each rank's `exp_avg`/`exp_avg_sq` of group `g` is laid out like its fp32
//! partition of group `g`: the parameter plans that place the fp32 weights ([`super::plan`]) place
//! them too. A 0-d state (`step`) is the group's, given to each of its parameters, as torch keeps
//! one per parameter. Hyperparameters come from rank 0's `param_groups`.

use std::collections::HashMap;

use crate::formats::pickle::PyValue;
use crate::index::read::torch::join_path;
use crate::index::{EntryKind, IndexEntry, IndexError, PathSeg, Role, json_of};

use super::plan::{self, ParamPlan};
use super::records::{BaseOptim, Flat, ModelStates, OptimStates, StateValue, bad};

/// The key under which the optimizer state is kept.
pub(super) const OPTIMIZER: &str = "optimizer";

/// The state id of group `g`: the one int of `param_groups[g]["params"]`.
pub(super) fn group_id(base: &BaseOptim, g: usize) -> Option<i64> {
    let group = base.param_groups.get(g)?;
    let params = group.iter().find(|(k, _)| k == "params")?.1.as_seq()?;
    match params {
        [one] => one.as_i64(),
        _ => None,
    }
}

pub(super) fn state_of(base: &BaseOptim, id: i64) -> Option<&[(String, StateValue)]> {
    base.state
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, v)| v.as_slice())
}

pub(super) fn tensor_entry(
    path: Vec<PathSeg>,
    role: Role,
    dtype: crate::dtype::DType,
    shape: Vec<u64>,
    chunks: Vec<crate::index::Chunk>,
) -> IndexEntry {
    IndexEntry {
        dtype: Some(dtype),
        shape: Some(shape),
        chunks,
        role: Some(role),
        ..super::entry(join_path(&path), path, EntryKind::Tensor)
    }
}

/// The optimizer entries (empty when the files hold no torch state dict of the wrapped
/// optimizer: a note says so).
pub(super) fn entries(
    zero: &ModelStates,
    optim: &[OptimStates],
    plans: &[ParamPlan],
    notes: &mut Vec<String>,
) -> Result<Vec<IndexEntry>, IndexError> {
    let Some(base0) = &optim[0].base else {
        notes.push(
            "the optimizer state is not read: the files hold no torch state dict of the wrapped optimizer (DeepSpeed's elastic layout, or none)".to_owned(),
        );
        return Ok(Vec::new());
    };
    let ids = group_ids(optim)?;
    // The parameter's group is its `param_shapes` group.
    let group_of: HashMap<&str, usize> = zero
        .param_shapes
        .iter()
        .enumerate()
        .flat_map(|(g, shapes)| shapes.iter().map(move |(n, _)| (n.as_str(), g)))
        .collect();
    let mut out = Vec::new();
    for p in plans {
        let Some(&g) = group_of.get(p.name.as_str()) else {
            continue;
        };
        // No state (no step taken yet): torch leaves the parameter out of `state`.
        if let Some(state) = ids.get(g).and_then(|&id| state_of(base0, id)) {
            param_state(p, state, optim, &ids, &mut out)?;
        }
    }
    param_groups(zero, base0, &mut out);
    Ok(out)
}

/// The state id of each group, the same on every rank.
fn group_ids(optim: &[OptimStates]) -> Result<Vec<i64>, IndexError> {
    let first = &optim[0];
    let mut ids = Vec::with_capacity(first.groups.len());
    for g in 0..first.groups.len() {
        let of_ranks: Vec<Option<i64>> = optim
            .iter()
            .map(|o| o.base.as_ref().and_then(|b| group_id(b, g)))
            .collect();
        match of_ranks.first().copied().flatten() {
            Some(id) if of_ranks.iter().all(|i| *i == Some(id)) => ids.push(id),
            _ => {
                return Err(bad(
                    &first.file,
                    format!(
                        "the wrapped optimizer's `param_groups.{g}.params` is not the one flat partition of group {g} on every rank ({of_ranks:?})"
                    ),
                ));
            }
        }
    }
    Ok(ids)
}

/// `optimizer.state.<fqn>.<name>` for every state of the parameter's group (`state`: rank 0's).
fn param_state(
    p: &ParamPlan,
    state: &[(String, StateValue)],
    optim: &[OptimStates],
    ids: &[i64],
    out: &mut Vec<IndexEntry>,
) -> Result<(), IndexError> {
    for (name, value) in state {
        let path = vec![
            PathSeg::Key(OPTIMIZER.to_owned()),
            PathSeg::Key("state".to_owned()),
            PathSeg::Key(p.name.clone()),
            PathSeg::Key(name.clone()),
        ];
        let role = Role::OptimizerState {
            param: PathSeg::Key(p.name.clone()),
            state: name.clone(),
        };
        let entry = match value {
            StateValue::Flat(f0) => {
                // Rank r's piece of slot g lies in its state `name` of group g, laid out like
                // its fp32 partition.
                let flat = |r: usize, slot: usize| -> Option<&Flat> {
                    let base = optim.get(r)?.base.as_ref()?;
                    state_of(base, *ids.get(slot)?)?
                        .iter()
                        .find_map(|(n, v)| match v {
                            StateValue::Flat(f) if n == name && f.dtype == f0.dtype => Some(f),
                            _ => None,
                        })
                };
                let chunks = plan::chunks(p, flat)
                    .map_err(|e| bad(&optim[0].file, format!("optimizer state `{name}`: {e}")))?;
                tensor_entry(path, role, f0.dtype, p.shape.clone(), chunks)
            }
            StateValue::Whole(t) => tensor_entry(
                path,
                role,
                t.dtype(),
                t.tensor.shape.clone(),
                vec![t.chunk()],
            ),
            StateValue::Value(v) => IndexEntry {
                value: Some(json_of(v)),
                object: Some(Box::new(v.clone())),
                role: Some(role),
                ..super::entry(join_path(&path), path, EntryKind::Scalar)
            },
        };
        out.push(entry);
    }
    Ok(())
}

/// `optimizer.param_groups.<g>.<key>` from rank 0's groups, `params` naming the group's
/// parameters (its `param_shapes[g]`).
pub(super) fn param_groups(zero: &ModelStates, base0: &BaseOptim, out: &mut Vec<IndexEntry>) {
    for (g, group) in base0.param_groups.iter().enumerate() {
        let names: Vec<PyValue> = zero
            .param_shapes
            .get(g)
            .map(|shapes| {
                shapes
                    .iter()
                    .map(|(n, _)| PyValue::Str(n.clone()))
                    .collect()
            })
            .unwrap_or_default();
        for (k, v) in group {
            let value = if k == "params" {
                PyValue::List(names.clone())
            } else {
                v.clone()
            };
            let path = vec![
                PathSeg::Key(OPTIMIZER.to_owned()),
                PathSeg::Key("param_groups".to_owned()),
                PathSeg::Index(g as i64),
                PathSeg::Key(k.clone()),
            ];
            out.push(IndexEntry {
                value: Some(json_of(&value)),
                object: Some(Box::new(value)),
                role: Some(Role::ParamGroup { group: g as i64 }),
                ..super::entry(join_path(&path), path, EntryKind::Scalar)
            });
        }
    }
}
