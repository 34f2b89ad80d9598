//! Optimizer state dicts in the three shapes of spec section 3.1, converted offline the way
//! FSDP1's `_optim_utils.py` converts them with collectives (spec 3.3, 3.4, 3.6, 3.9).
//!
//! - local: what `optim.state_dict()` returns on one rank (integer ids over the wrapped model's
//!   parameters: FlatParameters, or original parameters with 1-D `numel_in_shard` pieces);
//! - full: `FSDP.optim_state_dict` under FULL_STATE_DICT (FQN keys, original shapes);
//! - sharded: the same under SHARDED_STATE_DICT (positive-dim states chunked on dim 0).
//!
//! Optimizer ids are positions in the optimizer's parameter list; callers give that list as the
//! wrapped model's parameter names per rank (`Fsdp1Model::wrapped_params` gives the default order,
//! `model.parameters()`).
//!
//! Key order follows PyTorch: with `use_orig_params=False` the full state follows rank 0's ids;
//! with `True` non-FSDP keys come first, then FSDP keys sorted per flat parameter. Inside a
//! FlatParameter's flattened local state the state-name order of PyTorch depends on Python's set
//! order (random per process); here it follows the first parameter's dict.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use crate::dtype::DType;
use crate::layout::{Fsdp1Model, ParamRef};
use crate::model::tree::{Dict, DistKind, Key, Node, Tensor};
use crate::transform::chunk::{full_from_sharded_chunks, sharded_chunk_from_full};
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

fn dict_at<'n>(node: &'n Node, path: &str) -> Result<&'n Dict, TransformError> {
    node.as_dict().ok_or_else(|| TransformError::WrongKind {
        path: path.to_owned(),
        expected: "dict",
        found: node.kind_name(),
    })
}

fn state_of<'n>(osd: &'n Dict, path: &str) -> Result<&'n Dict, TransformError> {
    match osd.get_str("state") {
        Some(s) => dict_at(s, &sub(path, "state")),
        None => Err(TransformError::NoStateKey),
    }
}

fn groups_of<'n>(osd: &'n Dict, path: &str) -> Result<Option<&'n [Node]>, TransformError> {
    match osd.get_str("param_groups") {
        None => Ok(None),
        Some(g) => g
            .as_list()
            .map(Some)
            .ok_or_else(|| TransformError::WrongKind {
                path: sub(path, "param_groups"),
                expected: "list",
                found: g.kind_name(),
            }),
    }
}

fn is_pos_tensor(n: &Node) -> bool {
    matches!(n, Node::Tensor(t) if t.dim() > 0) || matches!(n, Node::Dist(_))
}

fn is_zero_dim(n: &Node) -> bool {
    matches!(n, Node::Tensor(t) if t.dim() == 0)
}

/// Elements `[start, start + numel)` of `t` with `shape`; a structure-only tensor (no bytes, see
/// [`local_optim_from_full`]) gives one too.
fn slice_elems(t: &Tensor, start: u64, numel: u64, shape: Vec<u64>) -> Tensor {
    let s = t.dtype.size_bytes();
    let data = if is_structure_only(t) {
        Vec::new()
    } else {
        t.data[start as usize * s..(start + numel) as usize * s].to_vec()
    };
    Tensor {
        dtype: t.dtype,
        shape,
        data,
    }
}

/// A tensor given by dtype and shape only (positive size, no bytes).
fn is_structure_only(t: &Tensor) -> bool {
    t.data.is_empty() && t.numel() > 0
}

/// A run of elements of a rank's raw optimizer state tensor, as [`local_optim_from_full`] lays
/// it out: elements `[start, start + len)` of parameter `fqn`'s flattened full state, or zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateRun {
    Param { fqn: String, start: u64, len: u64 },
    Zeros(u64),
}

/// The runs of a positive-dimension state of optimizer parameter `param` on `rank`, in the raw
/// `optim.state_dict()` that [`local_optim_from_full`] builds (`_flatten_optim_state` and
/// `_shard_orig_param_state`): a flat parameter's state is its parameters' flattened states
/// concatenated (zeros for a parameter `has_state` says has none), cut to the rank's `torch.chunk`
/// piece and right-padded with zeros; an original parameter's is its slice in the rank's shard
/// (none when it has no elements there); an unmanaged parameter's is all of it.
pub fn local_state_runs(
    model: &Fsdp1Model<'_>,
    param: &ParamRef,
    rank: u64,
    has_state: impl Fn(&str) -> bool,
) -> Vec<StateRun> {
    let numel = |shape: &[u64]| shape.iter().product::<u64>();
    match param {
        ParamRef::Flat(f) => {
            let flat = model.flat(*f);
            let mut runs = Vec::with_capacity(flat.fqns.len() + 1);
            let mut total = 0u64;
            for (i, fqn) in flat.fqns.iter().enumerate() {
                let n = flat.numels[i];
                runs.push((total, n, has_state(fqn).then_some(fqn)));
                total += n;
            }
            let ws = flat.ranks.len() as u64;
            let (lo, hi, padded) = if flat.padded_unsharded_numel.is_none() || ws == 1 {
                (0, total, total)
            } else {
                let (lo, hi) = crate::shape::chunk_range(total, ws, rank);
                (lo, hi, crate::shape::chunk_size(total, ws))
            };
            let mut out = Vec::new();
            for (at, n, fqn) in runs {
                let (a, b) = (at.max(lo), (at + n).min(hi));
                if a >= b {
                    continue;
                }
                out.push(match fqn {
                    Some(fqn) => StateRun::Param {
                        fqn: fqn.clone(),
                        start: a - at,
                        len: b - a,
                    },
                    None => StateRun::Zeros(b - a),
                });
            }
            if padded > hi - lo {
                out.push(StateRun::Zeros(padded - (hi - lo)));
            }
            out
        }
        ParamRef::Orig { flat, index } => {
            let layout = model.flat(*flat);
            let fqn = layout.fqns[*index].clone();
            let info = layout
                .ranks
                .get(rank as usize)
                .and_then(|r| r.shard_param_infos.get(*index));
            match info.map(|i| (i.in_shard, i.intra_param_start_idx, i.intra_param_end_idx)) {
                Some((true, Some(_), Some(_))) if layout.padded_unsharded_numel.is_none() => {
                    let len = numel(&layout.shapes[*index]);
                    vec![StateRun::Param { fqn, start: 0, len }]
                }
                Some((true, Some(start), Some(end))) => vec![StateRun::Param {
                    fqn,
                    start,
                    len: end - start + 1,
                }],
                _ => Vec::new(),
            }
        }
        ParamRef::Plain(fqn) => {
            let len = model
                .description
                .params
                .iter()
                .find(|p| &p.fqn == fqn)
                .map_or(0, |p| numel(&p.shape));
            vec![StateRun::Param {
                fqn: fqn.clone(),
                start: 0,
                len,
            }]
        }
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

/// The `params` list of one param group (`path` names the group in errors).
fn group_params<'d>(group: &'d Dict, path: &str) -> Result<&'d [Node], TransformError> {
    group
        .get_str("params")
        .and_then(Node::as_list)
        .ok_or_else(|| TransformError::MissingKey {
            path: path.to_owned(),
            key: "params".to_owned(),
        })
}

/// Replaces every ShardedTensor/DTensor in rank 0's tree by the full tensor gathered from all
/// ranks' trees at the same path (the offline `_gather_state_dict`).
pub fn full_from_sharded_tree(per_rank: &[&Node]) -> Result<Node, TransformError> {
    gather_node(per_rank, "")
}

fn gather_node(nodes: &[&Node], path: &str) -> Result<Node, TransformError> {
    let first = nodes[0];
    match first {
        Node::Dist(_) => {
            let mut pieces = Vec::with_capacity(nodes.len());
            for (r, n) in nodes.iter().enumerate() {
                match n {
                    Node::Dist(d) => pieces.push(d),
                    other => {
                        return Err(TransformError::WrongKind {
                            path: format!("rank{r}{path}"),
                            expected: "ShardedTensor or DTensor",
                            found: other.kind_name(),
                        });
                    }
                }
            }
            Ok(Node::Tensor(full_from_sharded_chunks(&pieces, path)?))
        }
        Node::Dict(d) => {
            let mut out = Dict::new();
            for (k, _) in d.iter() {
                let p = sub(path, k);
                let children: Vec<&Node> = nodes
                    .iter()
                    .enumerate()
                    .map(|(r, n)| {
                        n.as_dict().and_then(|d| d.get(k)).ok_or_else(|| {
                            TransformError::MissingKey {
                                path: format!("rank{r}{path}"),
                                key: k.to_string(),
                            }
                        })
                    })
                    .collect::<Result<_, _>>()?;
                out.insert(k.clone(), gather_node(&children, &p)?);
            }
            Ok(Node::Dict(out))
        }
        Node::List(items) | Node::Tuple(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let children: Vec<&Node> = nodes
                    .iter()
                    .map(|n| n.as_list().and_then(|l| l.get(i)).unwrap_or(item))
                    .collect();
                out.push(gather_node(&children, &sub(path, i))?);
            }
            Ok(if matches!(first, Node::Tuple(_)) {
                Node::Tuple(out)
            } else {
                Node::List(out)
            })
        }
        other => Ok(other.clone()),
    }
}

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

fn check_uniform_keys(state: &Dict) -> Result<Option<bool>, TransformError> {
    let ints = state.keys().filter(|k| matches!(k, Key::Int(_))).count();
    let strs = state.len() - ints;
    if ints > 0 && strs > 0 {
        let keys: Vec<String> = state
            .keys()
            .map(|k| match k {
                Key::Int(i) => i.to_string(),
                Key::Str(s) => pyrepr::string(s),
            })
            .collect();
        return Err(TransformError::InvalidParameterKeys {
            keys: format!("dict_keys([{}])", keys.join(", ")),
        });
    }
    Ok(if state.is_empty() {
        None
    } else {
        Some(ints > 0)
    })
}

/// `FSDP.rekey_optim_state_dict(osd, PARAM_NAME, model, optim=...)` for a model whose optimizer
/// holds `names` (one FQN per id, id order). Name-keyed input is returned unchanged.
pub fn rekey_ids_to_fqns(osd: &Dict, names: &[String]) -> Result<Dict, TransformError> {
    let state = state_of(osd, "")?;
    if check_uniform_keys(state)? == Some(false) {
        return Ok(osd.clone());
    }
    let name_of = |id: i64, path: &str| -> Result<String, TransformError> {
        usize::try_from(id)
            .ok()
            .and_then(|i| names.get(i))
            .cloned()
            .ok_or_else(|| TransformError::UnknownParam {
                path: path.to_owned(),
                what: "optimizer id",
                name: id.to_string(),
            })
    };
    let mut new_state = Dict::new();
    for (k, v) in state.iter() {
        let id = k.as_int().unwrap_or_default();
        new_state.insert(Key::Str(name_of(id, "state")?), v.clone());
    }
    let groups = rekey_groups(osd, |n, path| match n {
        Node::Int(id) => Ok(Node::Str(name_of(*id, path)?)),
        other => Err(TransformError::WrongKind {
            path: path.to_owned(),
            expected: "int",
            found: other.kind_name(),
        }),
    })?;
    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(new_state));
    out.insert(Key::str("param_groups"), Node::List(groups));
    Ok(out)
}

/// `FSDP.rekey_optim_state_dict(osd, PARAM_ID, model, optim=...)`: the inverse of
/// [`rekey_ids_to_fqns`]. Id-keyed input is returned unchanged.
pub fn rekey_fqns_to_ids(osd: &Dict, names: &[String]) -> Result<Dict, TransformError> {
    let state = state_of(osd, "")?;
    if check_uniform_keys(state)? == Some(true) {
        return Ok(osd.clone());
    }
    let ids: HashMap<&str, i64> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i as i64))
        .collect();
    let id_of = |name: &str, path: &str| -> Result<i64, TransformError> {
        ids.get(name)
            .copied()
            .ok_or_else(|| TransformError::UnknownParam {
                path: path.to_owned(),
                what: "parameter",
                name: name.to_owned(),
            })
    };
    let mut new_state = Dict::new();
    for (k, v) in state.iter() {
        new_state.insert(Key::Int(id_of(&k.to_string(), "state")?), v.clone());
    }
    let groups = rekey_groups(osd, |n, path| match n {
        Node::Str(s) => Ok(Node::Int(id_of(s, path)?)),
        other => Err(TransformError::WrongKind {
            path: path.to_owned(),
            expected: "str",
            found: other.kind_name(),
        }),
    })?;
    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(new_state));
    out.insert(Key::str("param_groups"), Node::List(groups));
    Ok(out)
}

fn rekey_groups(
    osd: &Dict,
    map: impl Fn(&Node, &str) -> Result<Node, TransformError>,
) -> Result<Vec<Node>, TransformError> {
    let groups = groups_of(osd, "")?.ok_or_else(|| TransformError::MissingKey {
        path: String::new(),
        key: "param_groups".to_owned(),
    })?;
    let mut out = Vec::with_capacity(groups.len());
    for (g, group) in groups.iter().enumerate() {
        let path = format!("param_groups/{g}/params");
        let group = dict_at(group, &path)?;
        let params = group_params(group, &path)?;
        let mut mapped: Vec<Node> = params
            .iter()
            .map(|p| map(p, &path))
            .collect::<Result<_, _>>()?;
        mapped.sort_by(|a, b| match (a, b) {
            (Node::Int(x), Node::Int(y)) => x.cmp(y),
            (Node::Str(x), Node::Str(y)) => x.cmp(y),
            _ => std::cmp::Ordering::Equal,
        });
        let mut new_group = group.clone();
        new_group.insert(Key::str("params"), Node::List(mapped));
        out.push(Node::Dict(new_group));
    }
    Ok(out)
}
