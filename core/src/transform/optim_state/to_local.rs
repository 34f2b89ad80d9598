//! A rank's raw optimizer state dict (`optim.state_dict()` over the wrapped model) from the full
//! FQN-keyed one: `FSDP.optim_state_dict_to_load`, with PyTorch's checks and messages.

use std::collections::{BTreeSet, HashMap};

use super::parts::{
    dict_at, group_params, groups_of, is_pos_tensor, is_structure_only, is_zero_dim, slice_elems,
    state_of,
};
use super::runs::{StateRun, local_state_runs};
use crate::dtype::DType;
use crate::layout::{Fsdp1Model, ParamRef};
use crate::model::tree::{Dict, Key, Node, Tensor};
use crate::transform::{TransformError, pyrepr, sub};

/// `FSDP.optim_state_dict_to_load` / `shard_full_optim_state_dict` (FULL input) and
/// `flatten_sharded_optim_state_dict` (after [`full_from_sharded_tree`]): the local optimizer state
/// dict of `rank`, keyed by that rank's optimizer ids (`optim_params`, wrapped or clean names in id
/// order).
#[allow(
    clippy::too_many_lines,
    reason = "follows torch's optim_state_dict_to_load steps in order (rekey, flatten, shard)"
)]
pub fn local_optim_from_full(
    model: &Fsdp1Model<'_>,
    full: &Dict,
    rank: u64,
    optim_params: &[String],
) -> Result<Dict, TransformError> {
    let state = state_of(full, "")?;
    let mut consumed: BTreeSet<String> = BTreeSet::new();
    let mut flat_state: Vec<(Vec<String>, Dict)> = Vec::new();
    for (_, param) in model.wrapped_params() {
        let fqns = model.fqns_of(&param);
        let Some(first) = state.get_str(&fqns[0]) else {
            continue;
        };
        for name in &fqns {
            consumed.insert(name.clone());
        }
        match &param {
            ParamRef::Orig { flat, index } => {
                let d = dict_at(first, &sub("state", &fqns[0]))?;
                let sharded = shard_orig_param_state(model, *flat, *index, rank, d)?;
                if !sharded.is_empty() {
                    flat_state.push((fqns, sharded));
                }
            }
            ParamRef::Flat(f) => {
                let d = flatten_optim_state(model, *f, state, &fqns, rank)?;
                if d.is_empty() {
                    return Err(TransformError::EmptyFlatState {
                        key: format!(
                            "_OptimStateKey(unflat_param_names={}, is_fsdp_managed=True)",
                            pyrepr::str_tuple(&fqns)
                        ),
                    });
                }
                flat_state.push((fqns, d));
            }
            ParamRef::Plain(_) => {
                let d = dict_at(first, &sub("state", &fqns[0]))?;
                flat_state.push((fqns, d.clone()));
            }
        }
    }

    // Rekey with this rank's optimizer (`_rekey_sharded_optim_state_dict`).
    let mut key_of_fqns: HashMap<Vec<String>, i64> = HashMap::new();
    let mut key_of_fqn: HashMap<String, i64> = HashMap::new();
    for (id, name) in optim_params.iter().enumerate() {
        let p = model
            .param_ref(name)
            .ok_or_else(|| TransformError::UnknownParam {
                path: format!("rank {rank} optimizer"),
                what: "parameter",
                name: name.clone(),
            })?;
        let fqns = model.fqns_of(&p);
        for f in &fqns {
            key_of_fqn.insert(f.clone(), id as i64);
        }
        key_of_fqns.insert(fqns, id as i64);
    }
    let mut out_state = Dict::new();
    for (fqns, d) in flat_state {
        let id = key_of_fqns
            .get(&fqns)
            .ok_or_else(|| TransformError::UnknownParam {
                path: format!("rank {rank} optimizer"),
                what: "state of parameter(s)",
                name: pyrepr::str_tuple(&fqns),
            })?;
        out_state.insert(Key::Int(*id), Node::Dict(d));
    }
    for (k, v) in state.iter() {
        let is_param = matches!(k, Key::Str(s) if consumed.contains(s));
        if !is_param {
            out_state.insert(k.clone(), v.clone());
        }
    }
    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(out_state));
    if let Some(groups) = groups_of(full, "")? {
        let mut new_groups = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let gpath = format!("param_groups/{g}");
            let group = dict_at(group, &gpath)?;
            let names = group_params(group, &gpath)?;
            let mut ids = BTreeSet::new();
            for n in names {
                let Node::Str(n) = n else {
                    return Err(TransformError::WrongKind {
                        path: sub(&gpath, "params"),
                        expected: "str",
                        found: n.kind_name(),
                    });
                };
                ids.insert(
                    *key_of_fqn
                        .get(n)
                        .ok_or_else(|| TransformError::UnknownParam {
                            path: sub(&gpath, "params"),
                            what: "parameter",
                            name: n.clone(),
                        })?,
                );
            }
            let mut new_group = group.clone();
            new_group.insert(
                Key::str("params"),
                Node::List(ids.into_iter().map(Node::Int).collect()),
            );
            new_groups.push(Node::Dict(new_group));
        }
        out.insert(Key::str("param_groups"), Node::List(new_groups));
    }
    Ok(out)
}

/// `_shard_orig_param_state`: this rank's 1-D piece of every positive-dim state.
fn shard_orig_param_state(
    model: &Fsdp1Model<'_>,
    flat: usize,
    index: usize,
    rank: u64,
    state: &Dict,
) -> Result<Dict, TransformError> {
    if state.is_empty() {
        return Ok(Dict::new());
    }
    let layout = model.flat(flat);
    let no_shard = layout.padded_unsharded_numel.is_none();
    let info = layout
        .ranks
        .get(rank as usize)
        .and_then(|r| r.shard_param_infos.get(index))
        .ok_or(TransformError::RankCount {
            expected: layout.ranks.len(),
            found: rank as usize + 1,
        })?;
    let (true, Some(start), Some(end)) = (
        info.in_shard,
        info.intra_param_start_idx,
        info.intra_param_end_idx,
    ) else {
        return Ok(Dict::new());
    };
    let mut out = Dict::new();
    for (k, v) in state.iter() {
        let v = match v {
            Node::Tensor(t) if t.dim() > 0 && !no_shard => {
                if t.numel() <= end {
                    return Err(TransformError::BadTensor {
                        path: format!("{}/{k}", layout.fqns[index]),
                        reason: format!(
                            "state has {} elements, the parameter {:?}",
                            t.numel(),
                            layout.shapes[index]
                        ),
                    });
                }
                Node::Tensor(slice_elems(
                    t,
                    start,
                    end - start + 1,
                    vec![end - start + 1],
                ))
            }
            other => other.clone(),
        };
        out.insert(k.clone(), v);
    }
    Ok(out)
}

fn python_type(n: &Node) -> &'static str {
    match n {
        Node::Dist(_) | Node::Tensor(_) => "Tensor",
        other => other.kind_name(),
    }
}

/// `_flatten_optim_state`: one FlatParameter's local state on `rank` from its parameters' full
/// states, with PyTorch's checks.
#[allow(
    clippy::too_many_lines,
    reason = "follows torch's _flatten_optim_state with its checks, in torch's order"
)]
fn flatten_optim_state(
    model: &Fsdp1Model<'_>,
    f: usize,
    state: &Dict,
    fqns: &[String],
    rank: u64,
) -> Result<Dict, TransformError> {
    let flat = model.flat(f);
    let names_repr = pyrepr::str_list(fqns);
    let mut per_param: Vec<Option<&Dict>> = Vec::with_capacity(fqns.len());
    for name in fqns {
        per_param.push(match state.get_str(name) {
            Some(n) => Some(dict_at(n, &sub("state", name))?),
            None => None,
        });
    }
    let Some(first) = per_param.iter().flatten().next() else {
        return Ok(Dict::new());
    };
    let state_names: BTreeSet<&Key> = first.keys().collect();
    for d in per_param.iter().flatten() {
        if d.keys().collect::<BTreeSet<_>>() != state_names {
            return Err(TransformError::DifferingStateNames { names: names_repr });
        }
    }
    let mut out = Dict::new();
    for name in first.keys() {
        let values: Vec<Option<&Node>> = per_param
            .iter()
            .map(|d| {
                d.and_then(|d| d.get(name))
                    .filter(|v| !matches!(v, Node::None))
            })
            .collect();
        let non_none: Vec<&Node> = values.iter().flatten().copied().collect();
        if non_none.is_empty() {
            out.insert(name.clone(), Node::None);
            continue;
        }
        let pos = non_none.iter().all(|v| is_pos_tensor(v));
        let zero = non_none.iter().all(|v| is_zero_dim(v));
        let non_tensor = non_none
            .iter()
            .all(|v| !matches!(v, Node::Tensor(_) | Node::Dist(_)));
        let types: BTreeSet<&str> = non_none.iter().map(|v| python_type(v)).collect();
        if types.len() != 1 || !(pos || zero || non_tensor) {
            let values: Vec<String> = non_none.iter().map(|v| pyrepr::node(v)).collect();
            return Err(TransformError::DifferingStateTypes {
                state: name.to_string(),
                values: format!("[{}]", values.join(", ")),
                names: names_repr,
            });
        }
        if pos {
            let tensors: Vec<Option<&Tensor>> =
                values.iter().map(|v| v.and_then(Node::as_tensor)).collect();
            if tensors
                .iter()
                .zip(&values)
                .any(|(t, v)| t.is_none() && v.is_some())
            {
                return Err(TransformError::WrongKind {
                    path: format!("state/{name}"),
                    expected: "a full Tensor (gather sharded states first)",
                    found: "ShardedTensor or DTensor",
                });
            }
            let dtypes: BTreeSet<DType> = tensors.iter().flatten().map(|t| t.dtype).collect();
            if dtypes.len() != 1 {
                let list: Vec<String> = dtypes.iter().map(|d| d.torch_name()).collect();
                return Err(TransformError::DifferingDTypes {
                    dtypes: format!("{{{}}}", list.join(", ")),
                    state: name.to_string(),
                    names: names_repr,
                });
            }
            let dtype = *dtypes.iter().next().unwrap_or(&flat.dtype);
            let itemsize = dtype.size_bytes();
            let mut by_fqn: HashMap<&str, &Tensor> = HashMap::new();
            for (i, t) in tensors.iter().enumerate() {
                let shape = &flat.shapes[i];
                match t {
                    None if shape.is_empty() => return Err(TransformError::ZeroDimParam),
                    None => {}
                    Some(t) if &t.shape != shape => {
                        return Err(TransformError::ShapeMismatch {
                            found: pyrepr::shape(&t.shape),
                            expected: pyrepr::shape(shape),
                        });
                    }
                    Some(t) => {
                        by_fqn.insert(fqns[i].as_str(), t);
                    }
                }
            }
            // The concatenation, cut to this rank's `torch.chunk` piece (`_get_shard`) and
            // right-padded with zeros; unsharded: all of it.
            let runs = local_state_runs(model, &ParamRef::Flat(f), rank, |fqn| {
                by_fqn.contains_key(fqn)
            });
            let numel: u64 = runs
                .iter()
                .map(|r| match r {
                    StateRun::Param { len, .. } | StateRun::Zeros(len) => *len,
                })
                .sum();
            let structure_only = by_fqn.values().any(|t| is_structure_only(t));
            let mut data = Vec::new();
            if !structure_only {
                data.reserve(numel as usize * itemsize);
                for run in &runs {
                    match run {
                        StateRun::Param { fqn, start, len } => {
                            let t = by_fqn[fqn.as_str()];
                            let (a, b) = (
                                *start as usize * itemsize,
                                (start + len) as usize * itemsize,
                            );
                            data.extend_from_slice(&t.data[a..b]);
                        }
                        StateRun::Zeros(len) => {
                            data.resize(data.len() + *len as usize * itemsize, 0);
                        }
                    }
                }
            }
            let shard = Tensor {
                dtype,
                shape: vec![numel],
                data,
            };
            out.insert(name.clone(), Node::Tensor(shard));
        } else if zero {
            let tensors: Vec<&Tensor> = non_none.iter().filter_map(|v| v.as_tensor()).collect();
            let mut vals: Vec<String> = Vec::new();
            let mut dts: Vec<String> = Vec::new();
            for v in &values {
                let (val, dt) = match v.and_then(|v| v.as_tensor()) {
                    Some(t) => (
                        t.scalar_f64()
                            .map_or_else(|| "?".to_owned(), |x| scalar_repr(t.dtype, x)),
                        t.dtype.torch_name(),
                    ),
                    None => ("None".to_owned(), "None".to_owned()),
                };
                if !vals.contains(&val) {
                    vals.push(val);
                }
                if !dts.contains(&dt) {
                    dts.push(dt);
                }
            }
            if tensors.len() != values.len() || vals.len() != 1 || dts.len() != 1 {
                vals.sort();
                dts.sort();
                return Err(TransformError::DifferingScalars {
                    values: format!("{{{}}}", vals.join(", ")),
                    dtypes: format!("{{{}}}", dts.join(", ")),
                    state: name.to_string(),
                    names: names_repr,
                });
            }
            out.insert(name.clone(), Node::Tensor(tensors[0].clone()));
        } else {
            let mut distinct: Vec<&Node> = Vec::new();
            for v in &non_none {
                if !distinct.contains(v) {
                    distinct.push(v);
                }
            }
            if non_none.len() != values.len() || distinct.len() != 1 {
                let mut reprs: Vec<String> = distinct.iter().map(|v| pyrepr::node(v)).collect();
                if non_none.len() != values.len() {
                    reprs.push("None".to_owned());
                }
                reprs.sort();
                return Err(TransformError::DifferingNonTensors {
                    values: format!("{{{}}}", reprs.join(", ")),
                    state: name.to_string(),
                    names: names_repr,
                });
            }
            out.insert(name.clone(), distinct[0].clone());
        }
    }
    Ok(out)
}

/// `tensor.item()` as Python prints it: floats with a decimal point, integers without.
fn scalar_repr(dtype: DType, v: f64) -> String {
    if dtype.is_floating_point() {
        pyrepr::float(v)
    } else {
        format!("{}", v as i64)
    }
}
