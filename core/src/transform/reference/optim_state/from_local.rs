//! `FSDP.optim_state_dict` (FULL or SHARDED) from every rank's raw `optim.state_dict()`: the
//! flat parameters' states all-gathered and unflattened, original parameters' pieces joined.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use crate::dtype::DType;
use crate::layout::{Fsdp1Model, ParamRef};
use crate::model::tree::{Dict, DistKind, Key, Node, Tensor};
use crate::transform::optim_state::parts::{
    dict_at, group_params, groups_of, is_pos_tensor, is_zero_dim, slice_elems, state_of,
};
use crate::transform::reference::chunk::sharded_chunk_from_full;
use crate::transform::{TransformError, pyrepr, sub};

/// Which optimizer parameter each id is, on one rank.
#[derive(Debug, Clone)]
struct IdMap {
    params: Vec<ParamRef>,
}

impl IdMap {
    fn new(model: &Fsdp1Model<'_>, names: &[String], rank: usize) -> Result<Self, TransformError> {
        let params = names
            .iter()
            .map(|n| {
                model
                    .param_ref(n)
                    .ok_or_else(|| TransformError::UnknownParam {
                        path: format!("rank {rank} optimizer"),
                        what: "parameter",
                        name: n.clone(),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { params })
    }

    fn get(&self, id: i64) -> Option<&ParamRef> {
        usize::try_from(id).ok().and_then(|i| self.params.get(i))
    }
}

/// Start of every real parameter in the unsharded flat parameter (padding segments skipped).
fn real_starts(flat: &crate::layout::FlatParamLayout) -> Vec<u64> {
    flat.segment_starts()
        .into_iter()
        .zip(&flat.is_padding_mask)
        .filter(|(_, pad)| !**pad)
        .map(|(s, _)| s)
        .collect()
}

fn maybe_chunk(
    t: Tensor,
    shard: Option<DistKind>,
    rank: u64,
    world_size: u64,
) -> Result<Node, TransformError> {
    match shard {
        Some(kind) if t.dim() > 0 => Ok(Node::Dist(sharded_chunk_from_full(
            &t, rank, world_size, kind,
        )?)),
        _ => Ok(Node::Tensor(t)),
    }
}

/// `FSDP.optim_state_dict` (FULL when `shard` is `None`, SHARDED otherwise) as computed on
/// `target_rank`, from every rank's raw `optim.state_dict()`.
///
/// `optim_params[r]` lists rank `r`'s optimizer parameters in id order, by wrapped or clean name.
/// `locals` holds one shard group's ranks (for HYBRID_SHARD: one replica). Under
/// LOCAL_STATE_DICT torch returns the SHARDED form too (spec 8.8).
#[allow(
    clippy::too_many_lines,
    reason = "follows torch's full_optim_state_dict steps in order, which share the per-rank id maps"
)]
pub fn full_optim_from_local(
    model: &Fsdp1Model<'_>,
    locals: &[&Dict],
    optim_params: &[Vec<String>],
    target_rank: usize,
    shard: Option<DistKind>,
) -> Result<Dict, TransformError> {
    let ws = model.shard_group_size() as usize;
    if locals.len() != ws || optim_params.len() != ws {
        return Err(TransformError::RankCount {
            expected: ws,
            found: locals.len().min(optim_params.len()),
        });
    }
    if target_rank >= ws {
        return Err(TransformError::RankCount {
            expected: ws,
            found: target_rank + 1,
        });
    }
    let maps: Vec<IdMap> = optim_params
        .iter()
        .enumerate()
        .map(|(r, names)| IdMap::new(model, names, r))
        .collect::<Result<_, _>>()?;
    let states: Vec<&Dict> = locals
        .iter()
        .enumerate()
        .map(|(r, osd)| state_of(osd, &format!("rank{r}")))
        .collect::<Result<_, _>>()?;
    // (fqns, is_fsdp_managed) -> id, per rank, for ids that have state.
    let keyed: Keyed = maps
        .iter()
        .zip(&states)
        .map(|(map, state)| {
            map.params
                .iter()
                .enumerate()
                .filter(|(id, _)| state.contains(&Key::Int(*id as i64)))
                .map(|(id, p)| {
                    (
                        (model.fqns_of(p), Fsdp1Model::is_managed(p)),
                        id as i64,
                        p.clone(),
                    )
                })
                .collect()
        })
        .collect();
    let lookup: Lookup = keyed
        .iter()
        .map(|ks| ks.iter().map(|(k, id, _)| (k.clone(), *id)).collect())
        .collect();

    let mut out_state = if model.use_orig_params() {
        convert_orig_params(model, &states, &keyed, &lookup, target_rank, shard)?
    } else {
        convert_flat_params(model, &states, &keyed, &lookup, target_rank, shard)?
    };

    // Entries FSDP cannot map (user states, ids outside the optimizer) are copied.
    let target_map = &maps[target_rank];
    for (key, value) in states[target_rank].iter() {
        let known = match key {
            Key::Str(s) => {
                out_state.contains(key)
                    || model
                        .layout
                        .flat_params
                        .iter()
                        .any(|f| &f.flat_param_fqn == s)
            }
            Key::Int(id) => out_state.contains(key) || target_map.get(*id).is_some(),
        };
        if !known {
            out_state.insert(key.clone(), value.clone());
        }
    }

    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(out_state));
    let target_path = format!("rank{target_rank}");
    if let Some(groups) = groups_of(locals[target_rank], &target_path)? {
        let mut new_groups = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let gpath = sub(&sub(&target_path, "param_groups"), g);
            let group = dict_at(group, &gpath)?;
            let ids = group_params(group, &gpath)?;
            let mut names = Vec::new();
            for id in ids {
                let Node::Int(id) = id else {
                    return Err(TransformError::WrongKind {
                        path: sub(&gpath, "params"),
                        expected: "int",
                        found: id.kind_name(),
                    });
                };
                let p = target_map
                    .get(*id)
                    .ok_or_else(|| TransformError::UnknownParam {
                        path: sub(&gpath, "params"),
                        what: "optimizer id",
                        name: id.to_string(),
                    })?;
                names.extend(model.fqns_of(p).into_iter().map(Node::Str));
            }
            let mut new_group = group.clone();
            new_group.insert(Key::str("params"), Node::List(names));
            new_groups.push(Node::Dict(new_group));
        }
        out.insert(Key::str("param_groups"), Node::List(new_groups));
    }
    Ok(out)
}

/// `_OptimStateKey`: the FQNs a parameter stands for and whether FSDP manages it.
type StateKey = (Vec<String>, bool);
/// Per rank: the keys of ids with state, in id order, with the id and the parameter.
type Keyed = Vec<Vec<(StateKey, i64, ParamRef)>>;
/// Per rank: key -> id.
type Lookup = Vec<HashMap<StateKey, i64>>;

fn convert_flat_params(
    model: &Fsdp1Model<'_>,
    states: &[&Dict],
    keyed: &Keyed,
    lookup: &Lookup,
    target: usize,
    shard: Option<DistKind>,
) -> Result<Dict, TransformError> {
    let ws = states.len();
    // Rank 0's keys, in its id order; every rank must have them.
    let mut details = String::new();
    for (r, rank_lookup) in lookup.iter().enumerate().skip(1) {
        let missing: Vec<String> = keyed[0]
            .iter()
            .filter(|(k, _, _)| !rank_lookup.contains_key(k))
            .map(|(k, _, _)| pyrepr::str_tuple(&k.0))
            .collect();
        if !missing.is_empty() {
            let _ = write!(
                details,
                "\nRank {r} is missing states for the parameters: [{}]",
                missing.join(", ")
            );
        }
    }
    if !details.is_empty() {
        return Err(TransformError::MissingRank0Keys { details });
    }
    let mut out = Dict::new();
    for (key, _, param) in &keyed[0] {
        let ids: Vec<i64> = (0..ws).map(|r| lookup[r][key]).collect();
        let value_of = |r: usize| -> Result<&Dict, TransformError> {
            let v = states[r]
                .get(&Key::Int(ids[r]))
                .ok_or_else(|| TransformError::MissingKey {
                    path: format!("rank{r}/state"),
                    key: ids[r].to_string(),
                })?;
            dict_at(v, &format!("rank{r}/state/{}", ids[r]))
        };
        if let ParamRef::Flat(f) = param {
            let flat = model.flat(*f);
            let no_shard = flat.padded_unsharded_numel.is_none() || ws == 1;
            let target_state = value_of(target)?;
            let mut names: Vec<&Key> = target_state.keys().collect();
            names.sort();
            let mut tensor_states: Vec<(Key, Tensor)> = Vec::new();
            let mut zero_dim: Vec<(Key, Node)> = Vec::new();
            let mut non_tensor: Vec<(Key, Node)> = Vec::new();
            for name in names {
                let v = target_state.get(name).unwrap_or(&Node::None);
                let path = format!("rank{target}/state/{}/{name}", ids[target]);
                if is_pos_tensor(v) {
                    let full = if no_shard {
                        v.as_tensor()
                            .cloned()
                            .ok_or_else(|| TransformError::WrongKind {
                                path: path.clone(),
                                expected: "Tensor",
                                found: v.kind_name(),
                            })?
                    } else {
                        gather_flat(flat, &value_of, name, ws)?
                    };
                    tensor_states.push((name.clone(), full));
                } else if is_zero_dim(v) {
                    zero_dim.push((name.clone(), v.clone()));
                } else {
                    non_tensor.push((name.clone(), v.clone()));
                }
            }
            let starts = real_starts(flat);
            for (i, fqn) in flat.fqns.iter().enumerate() {
                let mut d = Dict::new();
                for (name, full) in &tensor_states {
                    let t = slice_elems(full, starts[i], flat.numels[i], flat.shapes[i].clone());
                    d.insert(
                        name.clone(),
                        maybe_chunk(t, shard, target as u64, ws as u64)?,
                    );
                }
                for (name, v) in zero_dim.iter().chain(&non_tensor) {
                    d.insert(name.clone(), v.clone());
                }
                out.insert(Key::Str(fqn.clone()), Node::Dict(d));
            }
        } else {
            let name = key.0.first().cloned().unwrap_or_default();
            out.insert(Key::Str(name), Node::Dict(value_of(target)?.clone()));
        }
    }
    Ok(out)
}

/// All-gather of one flat state: every rank's 1-D shard in rank order, truncated to T.
fn gather_flat<'d>(
    flat: &crate::layout::FlatParamLayout,
    value_of: &dyn Fn(usize) -> Result<&'d Dict, TransformError>,
    name: &Key,
    ws: usize,
) -> Result<Tensor, TransformError> {
    let c = flat.sharded_numel;
    let total = flat.unpadded_unsharded_numel;
    let mut data: Vec<u8> = Vec::new();
    let mut dtype: Option<DType> = None;
    for r in 0..ws {
        let path = format!("rank{r}/{}/{name}", flat.flat_param_fqn);
        let d = value_of(r)?;
        let t =
            d.get(name)
                .and_then(Node::as_tensor)
                .ok_or_else(|| TransformError::MissingKey {
                    path: path.clone(),
                    key: name.to_string(),
                })?;
        if t.dim() != 1 || t.numel() != c || dtype.is_some_and(|d| d != t.dtype) {
            return Err(TransformError::BadTensor {
                path,
                reason: format!(
                    "expected a 1-D shard of {c} elements (the flat parameter's sharded size), got {} {:?}",
                    t.dtype, t.shape
                ),
            });
        }
        dtype = Some(t.dtype);
        data.extend_from_slice(&t.data);
    }
    let dtype = dtype.unwrap_or(flat.dtype);
    data.truncate(total as usize * dtype.size_bytes());
    Ok(Tensor {
        dtype,
        shape: vec![total],
        data,
    })
}

#[allow(
    clippy::too_many_lines,
    reason = "follows torch's _convert_state_with_orig_params steps in order, over the union of all ranks' keys"
)]
fn convert_orig_params(
    model: &Fsdp1Model<'_>,
    states: &[&Dict],
    keyed: &Keyed,
    lookup: &Lookup,
    target: usize,
    shard: Option<DistKind>,
) -> Result<Dict, TransformError> {
    let ws = states.len();
    // Union of all ranks' keys, sorted like Python sorts `_OptimStateKey` tuples.
    let mut all: BTreeMap<(Vec<String>, bool), ParamRef> = BTreeMap::new();
    for ks in keyed {
        for (k, _, p) in ks {
            all.entry(k.clone()).or_insert_with(|| p.clone());
        }
    }
    let mut out = Dict::new();
    // flat index -> fqns in key order, groups in order of first appearance.
    let mut groups: Vec<(usize, Vec<String>)> = Vec::new();
    for (key, param) in &all {
        match param {
            ParamRef::Orig { flat, .. } => {
                let fqn = key.0[0].clone();
                match groups.iter_mut().find(|(f, _)| f == flat) {
                    Some((_, list)) => list.push(fqn),
                    None => groups.push((*flat, vec![fqn])),
                }
            }
            _ => {
                if let Some(id) = lookup[target].get(key) {
                    let v = states[target].get(&Key::Int(*id)).unwrap_or(&Node::None);
                    out.insert(
                        Key::Str(key.0[0].clone()),
                        Node::Dict(dict_at(v, &format!("rank{target}/state/{id}"))?.clone()),
                    );
                }
            }
        }
    }
    for (f, fqns) in groups {
        let flat = model.flat(f);
        let mut sorted_unit: Vec<&String> = flat.fqns.iter().collect();
        sorted_unit.sort();
        let mut sorted_group: Vec<&String> = fqns.iter().collect();
        sorted_group.sort();
        for name in &flat.fqns {
            if !fqns.contains(name) && model.requires_grad(name) {
                return Err(TransformError::NotInOptimizerState {
                    fqn: name.clone(),
                    unit_keys: pyrepr::str_list(&sorted_unit),
                    optim_keys: pyrepr::str_list(&sorted_group),
                });
            }
        }
        // Per rank, per fqn: the local state dict (empty when absent).
        let empty = Dict::new();
        let local = |r: usize, fqn: &str| -> Result<&Dict, TransformError> {
            match lookup[r].get(&(vec![fqn.to_owned()], true)) {
                Some(id) => dict_at(
                    states[r].get(&Key::Int(*id)).unwrap_or(&Node::None),
                    &format!("rank{r}/state/{id}"),
                ),
                None => Ok(&empty),
            }
        };
        let no_shard = flat.padded_unsharded_numel.is_none() || ws == 1;
        if no_shard {
            for fqn in &fqns {
                out.insert(
                    Key::Str(fqn.clone()),
                    Node::Dict(local(target, fqn)?.clone()),
                );
            }
            continue;
        }
        let mut outputs: Vec<(String, Dict)> = Vec::new();
        let mut buffer_names: Vec<Key> = Vec::new();
        let mut dtype: Option<DType> = None;
        for fqn in &fqns {
            let mut tensor_names: BTreeSet<Key> = BTreeSet::new();
            for r in 0..ws {
                for (k, v) in local(r, fqn)?.iter() {
                    if matches!(v, Node::Tensor(t) if t.dim() > 0) {
                        tensor_names.insert(k.clone());
                    }
                }
            }
            let mut empty_ranks: BTreeSet<usize> = BTreeSet::new();
            for name in &tensor_names {
                for r in 0..ws {
                    match local(r, fqn)?.get(name) {
                        Some(Node::Tensor(t)) if t.dim() > 0 => {
                            if t.numel() == 0 {
                                empty_ranks.insert(r);
                            }
                            match dtype {
                                None => dtype = Some(t.dtype),
                                Some(d) if d != t.dtype => {
                                    return Err(TransformError::BadTensor {
                                        path: format!("rank{r}/{fqn}/{name}"),
                                        reason: format!(
                                            "dtype {} differs from {d} of the other states of this flat parameter",
                                            t.dtype
                                        ),
                                    });
                                }
                                Some(_) => {}
                            }
                        }
                        _ => {
                            empty_ranks.insert(r);
                        }
                    }
                }
                if !buffer_names.contains(name) {
                    buffer_names.push(name.clone());
                }
            }
            let mut d = Dict::new();
            for r in (0..ws).filter(|r| !empty_ranks.contains(r)) {
                let mut non_tensors: Vec<(&Key, &Node)> = Vec::new();
                let mut scalars: Vec<(&Key, &Node)> = Vec::new();
                for (k, v) in local(r, fqn)?.iter() {
                    match v {
                        Node::Tensor(t) if t.dim() == 0 => scalars.push((k, v)),
                        Node::Tensor(_) => {}
                        _ => non_tensors.push((k, v)),
                    }
                }
                non_tensors.sort_by(|a, b| a.0.cmp(b.0));
                scalars.sort_by(|a, b| a.0.cmp(b.0));
                for (k, v) in non_tensors.into_iter().chain(scalars) {
                    if let Some(prev) = d.get(k)
                        && prev != v
                        && !matches!(prev, Node::None)
                    {
                        return Err(TransformError::RankValuesDiffer {
                            rank: r,
                            state: k.to_string(),
                            value: pyrepr::node(v),
                            other: pyrepr::node(prev),
                            fqn: fqn.clone(),
                        });
                    }
                    d.insert(k.clone(), v.clone());
                }
            }
            outputs.push((fqn.clone(), d));
        }
        let starts = real_starts(flat);
        let c = flat.sharded_numel;
        for name in &buffer_names {
            let dtype = dtype.unwrap_or(flat.dtype);
            let itemsize = dtype.size_bytes();
            let mut full = vec![0u8; flat.unpadded_unsharded_numel as usize * itemsize];
            for rank in &flat.ranks {
                let r = rank.rank as usize;
                for (i, info) in rank.shard_param_infos.iter().enumerate() {
                    let (Some(offset), Some(numel)) = (info.offset_in_shard, info.numel_in_shard)
                    else {
                        continue;
                    };
                    let fqn = &flat.fqns[i];
                    let has_state = fqns.contains(fqn);
                    if !model.requires_grad(fqn) && !has_state {
                        continue;
                    }
                    let piece = local(r, fqn)?.get(name).and_then(Node::as_tensor);
                    let Some(piece) = piece else {
                        return Err(TransformError::MissingPiece {
                            rank: r,
                            fqn: fqn.clone(),
                            state: name.to_string(),
                        });
                    };
                    if piece.numel() != numel || piece.dtype != dtype {
                        return Err(TransformError::BadTensor {
                            path: format!("rank{r}/{fqn}/{name}"),
                            reason: format!(
                                "expected {numel} elements of {dtype} (numel_in_shard), got {} {:?}",
                                piece.dtype, piece.shape
                            ),
                        });
                    }
                    let at = (rank.rank * c + offset) as usize * itemsize;
                    if at + piece.data.len() <= full.len() {
                        full[at..at + piece.data.len()].copy_from_slice(&piece.data);
                    }
                }
            }
            let full = Tensor {
                dtype,
                shape: vec![flat.unpadded_unsharded_numel],
                data: full,
            };
            for (fqn, d) in &mut outputs {
                let Some((_, i)) = model.managed_position(fqn) else {
                    continue;
                };
                let t = slice_elems(&full, starts[i], flat.numels[i], flat.shapes[i].clone());
                d.insert(
                    name.clone(),
                    maybe_chunk(t, shard, target as u64, ws as u64)?,
                );
            }
        }
        for (fqn, d) in outputs {
            out.insert(Key::Str(fqn), Node::Dict(d));
        }
    }
    Ok(out)
}
