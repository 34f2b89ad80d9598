//! Whole model state dicts (FULL / LOCAL / SHARDED, and FSDP2's DTensor state dict) from one
//! another, with PyTorch's key order.

use std::collections::{HashMap, HashSet};

use crate::layout::Fsdp1Model;
use crate::layout::key_plan::{FullKey, depth, full_key_plan, managed_aliases};
use crate::model::fqn;
use crate::model::tree::Tensor;
use crate::model::tree::{Dict, Key, Node};
use crate::transform::TransformError;
use crate::transform::reference::chunk::sharded_chunk_from_full;
use crate::transform::reference::flat_shards::{
    flat_shard_from_full_params, full_params_from_flat_shards, local_flat_param_entry,
    orig_param_views, shard_of_local_entry,
};

fn tensor_entry<'d>(d: &'d Dict, key: &str) -> Result<&'d Tensor, TransformError> {
    match d.get_str(key) {
        Some(Node::Tensor(t)) => Ok(t),
        Some(other) => Err(TransformError::WrongKind {
            path: key.to_owned(),
            expected: "Tensor",
            found: other.kind_name(),
        }),
        None => Err(TransformError::MissingKey {
            path: "state dict".to_owned(),
            key: key.to_owned(),
        }),
    }
}

/// Every rank's (padded) shard of every flat parameter, rebuilt from a FULL model state dict.
fn shards_from_full(
    model: &Fsdp1Model<'_>,
    rank: u64,
    full: &Dict,
    fill: f64,
) -> Result<Vec<Tensor>, TransformError> {
    model
        .layout
        .flat_params
        .iter()
        .map(|flat| {
            let mut params: HashMap<&str, &Tensor> = HashMap::new();
            for name in &flat.fqns {
                params.insert(name.as_str(), tensor_entry(full, name)?);
            }
            flat_shard_from_full_params(flat, rank, |n| params.get(n).copied(), fill, true)
        })
        .collect()
}

/// `model.state_dict()` under LOCAL_STATE_DICT on `rank`, from a FULL state dict. Padding segments
/// get `fill` ([`TORCH_PADDING_FILL`] reproduces PyTorch 2.15).
///
/// Key order as PyTorch: with `use_orig_params=False` a unit's `_flat_param` sits where the unit's
/// subtree starts; with `True` the original names stay (as 1-D views of the rank's shard) and each
/// `_flat_param` follows its unit's subtree (the state-dict post-hook appends it).
pub fn model_local_from_full(
    model: &Fsdp1Model<'_>,
    rank: u64,
    full: &Dict,
    fill: f64,
) -> Result<Dict, TransformError> {
    let shards = shards_from_full(model, rank, full, fill)?;
    let aliases = managed_aliases(model);
    let flats = &model.layout.flat_params;
    let mut entries: Vec<(Key, Node)> = Vec::new();
    if model.use_orig_params() {
        let mut views: HashMap<String, Tensor> = HashMap::new();
        for (flat, shard) in flats.iter().zip(&shards) {
            views.extend(orig_param_views(flat, rank, shard)?);
        }
        for (k, v) in full.iter() {
            let name = k.to_string();
            let primary = aliases.get(&name).unwrap_or(&name);
            match views.get(primary) {
                Some(view) => entries.push((k.clone(), Node::Tensor(view.clone()))),
                None => entries.push((k.clone(), v.clone())),
            }
        }
        // Innermost units first, so an outer unit's key lands after its inner units' keys.
        let mut order: Vec<usize> = (0..flats.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(depth(&flats[i].unit_prefix)));
        for i in order {
            let prefix = &flats[i].unit_prefix;
            let last = entries
                .iter()
                .rposition(|(k, _)| prefix.is_empty() || fqn::is_under(&k.to_string(), prefix));
            let at = last.map_or(entries.len(), |p| p + 1);
            let value = Node::Dist(local_flat_param_entry(&flats[i], rank, &shards[i])?);
            entries.insert(at, (Key::Str(flats[i].flat_param_fqn.clone()), value));
        }
    } else {
        let mut emitted: HashSet<usize> = HashSet::new();
        let mut outer_first: Vec<usize> = (0..flats.len()).collect();
        outer_first.sort_by_key(|&i| depth(&flats[i].unit_prefix));
        for (k, v) in full.iter() {
            let name = k.to_string();
            for &i in &outer_first {
                let prefix = &flats[i].unit_prefix;
                if (prefix.is_empty() || fqn::is_under(&name, prefix)) && emitted.insert(i) {
                    let value = Node::Dist(local_flat_param_entry(&flats[i], rank, &shards[i])?);
                    entries.push((Key::Str(flats[i].flat_param_fqn.clone()), value));
                }
            }
            if model.managed_position(&name).is_none() && !aliases.contains_key(&name) {
                entries.push((k.clone(), v.clone()));
            }
        }
    }
    Ok(entries.into_iter().collect())
}

/// `model.state_dict()` under FULL_STATE_DICT, from every rank's LOCAL state dict.
///
/// Key order: modules in pre-order (children in description order, buffer-only modules after),
/// each module's own parameters (FSDP-managed tied aliases last, as FSDP re-registers them), then
/// its buffers.
pub fn model_full_from_local(
    model: &Fsdp1Model<'_>,
    locals: &[&Dict],
) -> Result<Dict, TransformError> {
    let first = locals.first().ok_or(TransformError::RankCount {
        expected: model.layout.flat_params.len(),
        found: 0,
    })?;
    let mut managed: HashMap<String, Tensor> = HashMap::new();
    for flat in &model.layout.flat_params {
        let shards: Vec<Tensor> = locals
            .iter()
            .map(|d| {
                let entry =
                    d.get_str(&flat.flat_param_fqn)
                        .ok_or_else(|| TransformError::MissingKey {
                            path: "LOCAL state dict".to_owned(),
                            key: flat.flat_param_fqn.clone(),
                        })?;
                shard_of_local_entry(flat, entry)
            })
            .collect::<Result<_, _>>()?;
        let refs: Vec<&Tensor> = shards.iter().collect();
        managed.extend(full_params_from_flat_shards(flat, &refs)?);
    }
    let first_keys: Vec<String> = first.iter().map(|(k, _)| k.to_string()).collect();
    let mut out = Dict::new();
    for (name, from) in full_key_plan(model, &first_keys) {
        let value = match from {
            FullKey::Managed { flat, param } => {
                let primary = &model.layout.flat_params[flat].fqns[param];
                managed.get(primary).cloned().map(Node::Tensor)
            }
            FullKey::Plain => first.get_str(&name).cloned(),
        };
        if let Some(v) = value {
            out.insert(Key::Str(name), v);
        }
    }
    Ok(out)
}

/// `model.state_dict()` under SHARDED_STATE_DICT on `rank`, from a FULL state dict: every
/// FSDP-managed parameter (tied aliases included) becomes its dim-0 chunk; the rest is copied.
pub fn model_sharded_from_full(
    model: &Fsdp1Model<'_>,
    rank: u64,
    full: &Dict,
    kind: crate::model::tree::DistKind,
) -> Result<Dict, TransformError> {
    let aliases = managed_aliases(model);
    let ws = model.shard_group_size();
    let mut out = Dict::new();
    for (k, v) in full.iter() {
        let name = k.to_string();
        let managed = model.managed_position(&name).is_some() || aliases.contains_key(&name);
        match v {
            Node::Tensor(t) if managed => {
                out.insert(
                    k.clone(),
                    Node::Dist(sharded_chunk_from_full(t, rank, ws, kind)?),
                );
            }
            other => out.insert(k.clone(), other.clone()),
        }
    }
    Ok(out)
}

/// FSDP2 (`fully_shard`) `model.state_dict()` on `rank` of a 1-D mesh of `world_size` ranks, from
/// a full state dict: every parameter inside a `fully_shard` unit becomes a `Shard(0)` DTensor
/// (ranks past the data hold an empty local tensor at offset `dim0`); buffers, ignored and
/// unsharded parameters are copied. Key order is kept (FSDP2 does not reorder).
pub fn fsdp2_sharded_from_full(
    description: &crate::model::ModelDescription,
    rank: u64,
    world_size: u64,
    full: &Dict,
) -> Result<Dict, TransformError> {
    let sharded: HashSet<&str> = description
        .params
        .iter()
        .filter(|p| !description.ignored.contains(&p.fqn) && description.unit_of(&p.fqn).is_some())
        .map(|p| p.fqn.as_str())
        .collect();
    let mut out = Dict::new();
    for (k, v) in full.iter() {
        match (v, k.as_str()) {
            (Node::Tensor(t), Some(name)) if sharded.contains(name) => out.insert(
                k.clone(),
                Node::Dist(sharded_chunk_from_full(
                    t,
                    rank,
                    world_size,
                    crate::model::tree::DistKind::DTensor,
                )?),
            ),
            _ => out.insert(k.clone(), v.clone()),
        }
    }
    Ok(out)
}
