//! Model state: full parameters ⇄ FSDP1 flat-parameter shards (the `_flat_param` entries of
//! LOCAL_STATE_DICT and the raw per-rank storage), one parameter or one shard at a time.
//!
//! Padding: alignment and world-size padding *segments* (`use_orig_params=True`) are written with
//! a caller-chosen fill; PyTorch 2.15 uses `42.0` ([`TORCH_PADDING_FILL`]). The per-rank right
//! padding of a shard (`_shard_numel_padded`) is always zeros, as `F.pad` writes it.

use crate::layout::FlatParamLayout;
use crate::layout::fsdp1::PieceKind;
use crate::model::tree::{ChunkMeta, DistKind, DistTensor, Tensor, fill_bytes};
use crate::transform::TransformError;

/// The value PyTorch 2.15 writes into padding segments of flat parameters.
pub const TORCH_PADDING_FILL: f64 = 42.0;

/// One contiguous run copied between a rank's flat shard and an original parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatCopy {
    pub rank: u64,
    /// First element in the rank's shard.
    pub offset_in_shard: u64,
    /// First element in the flattened original parameter.
    pub offset_in_param: u64,
    pub numel: u64,
}

/// The runs that make up real parameter `param` of `flat`, in parameter order. With `no_shard`
/// every rank holds everything; the runs read rank 0.
pub fn param_copies(flat: &FlatParamLayout, param: usize) -> Vec<FlatCopy> {
    let no_shard = flat.padded_unsharded_numel.is_none();
    let mut out = Vec::new();
    for rank in &flat.ranks {
        let Some(info) = rank.shard_param_infos.get(param) else {
            continue;
        };
        if let (true, Some(offset), Some(numel), Some(start)) = (
            info.in_shard,
            info.offset_in_shard,
            info.numel_in_shard,
            info.intra_param_start_idx,
        ) {
            out.push(FlatCopy {
                rank: rank.rank,
                offset_in_shard: offset,
                offset_in_param: start,
                numel,
            });
        }
        if no_shard {
            break;
        }
    }
    out
}

/// Number of elements rank `rank` stores without its right padding (the LOCAL state dict length).
pub fn unpadded_shard_numel(flat: &FlatParamLayout, rank: u64) -> u64 {
    let pad = flat
        .ranks
        .get(rank as usize)
        .map_or(0, |r| r.shard_numel_padded);
    flat.sharded_numel - pad
}

fn check_shard(flat: &FlatParamLayout, rank: usize, shard: &Tensor) -> Result<(), TransformError> {
    let len = shard.numel();
    let padded = flat.sharded_numel;
    let unpadded = unpadded_shard_numel(flat, rank as u64);
    if shard.dim() != 1 || (len != padded && len != unpadded) || shard.dtype != flat.dtype {
        return Err(TransformError::BadTensor {
            path: format!("{} (rank {rank})", flat.flat_param_fqn),
            reason: format!(
                "expected a 1-D {} shard of {padded} (padded) or {unpadded} elements, got {} {:?}",
                flat.dtype, shard.dtype, shard.shape
            ),
        });
    }
    Ok(())
}

/// Rebuilds real parameter `param` of `flat` (original shape) from every rank's shard.
pub fn full_param_from_flat_shards(
    flat: &FlatParamLayout,
    param: usize,
    shards: &[&Tensor],
) -> Result<Tensor, TransformError> {
    let need = if flat.padded_unsharded_numel.is_none() {
        1
    } else {
        flat.ranks.len()
    };
    if shards.len() < need {
        return Err(TransformError::RankCount {
            expected: flat.ranks.len(),
            found: shards.len(),
        });
    }
    let itemsize = flat.dtype.size_bytes();
    let mut out = Tensor::zeros(flat.dtype, flat.shapes[param].clone());
    for copy in param_copies(flat, param) {
        let shard = shards[copy.rank as usize];
        check_shard(flat, copy.rank as usize, shard)?;
        let src = copy.offset_in_shard as usize * itemsize;
        let dst = copy.offset_in_param as usize * itemsize;
        let n = copy.numel as usize * itemsize;
        out.data[dst..dst + n].copy_from_slice(&shard.data[src..src + n]);
    }
    Ok(out)
}

/// Every real parameter of `flat`, `(clean FQN, full tensor)` in flat order.
pub fn full_params_from_flat_shards(
    flat: &FlatParamLayout,
    shards: &[&Tensor],
) -> Result<Vec<(String, Tensor)>, TransformError> {
    (0..flat.fqns.len())
        .map(|i| {
            Ok((
                flat.fqns[i].clone(),
                full_param_from_flat_shards(flat, i, shards)?,
            ))
        })
        .collect()
}

/// Rank `rank`'s flat shard built from full parameters. `padded` selects the stored length
/// (`sharded_numel`, zeros at the end) or the LOCAL-state-dict length (without the right padding).
/// Padding segments get `fill` ([`TORCH_PADDING_FILL`] reproduces PyTorch).
pub fn flat_shard_from_full_params<'t>(
    flat: &FlatParamLayout,
    rank: u64,
    full: impl Fn(&str) -> Option<&'t Tensor>,
    fill: f64,
    padded: bool,
) -> Result<Tensor, TransformError> {
    let itemsize = flat.dtype.size_bytes();
    let fill_one =
        fill_bytes(flat.dtype, fill).ok_or(TransformError::FillDType { dtype: flat.dtype })?;
    let len = if padded {
        flat.sharded_numel
    } else {
        unpadded_shard_numel(flat, rank)
    };
    let mut data = vec![0u8; len as usize * itemsize];
    for piece in flat.rank_pieces(rank) {
        let start = piece.offset_in_shard.min(len) as usize * itemsize;
        let end = (piece.offset_in_shard + piece.numel).min(len) as usize * itemsize;
        match piece.kind {
            PieceKind::Param { param, intra_start } => {
                let name = &flat.fqns[param];
                let t = full(name).ok_or_else(|| TransformError::MissingKey {
                    path: flat.flat_param_fqn.clone(),
                    key: name.clone(),
                })?;
                if t.shape != flat.shapes[param] || t.dtype != flat.dtype {
                    return Err(TransformError::BadTensor {
                        path: name.clone(),
                        reason: format!(
                            "expected {} {:?}, got {} {:?}",
                            flat.dtype, flat.shapes[param], t.dtype, t.shape
                        ),
                    });
                }
                let src = intra_start as usize * itemsize;
                data[start..end].copy_from_slice(&t.data[src..src + (end - start)]);
            }
            PieceKind::SegmentPadding => {
                for chunk in data[start..end].chunks_exact_mut(itemsize) {
                    chunk.copy_from_slice(&fill_one);
                }
            }
            PieceKind::ShardTail => {}
        }
    }
    Ok(Tensor {
        dtype: flat.dtype,
        shape: vec![len],
        data,
    })
}

/// The LOCAL_STATE_DICT value of `flat` on `rank`: a 1-D ShardedTensor of global size
/// `_unpadded_unsharded_size`, local shard at `rank * sharded_numel` without the right padding
/// (none on ranks that hold only padding). `shard` is the rank's (padded or unpadded) shard.
pub fn local_flat_param_entry(
    flat: &FlatParamLayout,
    rank: u64,
    shard: &Tensor,
) -> Result<DistTensor, TransformError> {
    check_shard(flat, rank as usize, shard)?;
    let itemsize = flat.dtype.size_bytes();
    let n = unpadded_shard_numel(flat, rank) as usize;
    Ok(local_flat_param_structure(
        flat,
        rank,
        shard.data[..n * itemsize].to_vec(),
    ))
}

/// [`local_flat_param_entry`] with the local shard's bytes given (`data`; empty for a
/// structure-only entry, whose bytes a streaming writer produces later).
pub fn local_flat_param_structure(flat: &FlatParamLayout, rank: u64, data: Vec<u8>) -> DistTensor {
    let chunks = flat
        .ranks
        .iter()
        .filter(|r| unpadded_shard_numel(flat, r.rank) > 0)
        .map(|r| ChunkMeta {
            offsets: vec![r.rank * flat.sharded_numel],
            sizes: vec![unpadded_shard_numel(flat, r.rank)],
            placement: Some(format!("rank:{}/cpu", r.rank)),
        })
        .collect();
    let n = unpadded_shard_numel(flat, rank);
    let local = (n > 0).then(|| {
        (
            vec![rank * flat.sharded_numel],
            Tensor {
                dtype: flat.dtype,
                shape: vec![n],
                data,
            },
        )
    });
    DistTensor {
        kind: DistKind::ShardedTensor,
        dtype: flat.dtype,
        global_shape: vec![flat.unpadded_unsharded_numel],
        local,
        chunks,
    }
}

/// With `use_orig_params=True` every original parameter is a 1-D view of its piece of the rank's
/// shard (size 0 when not in the shard); PyTorch 2.15's LOCAL state dict lists these too.
pub fn orig_param_views(
    flat: &FlatParamLayout,
    rank: u64,
    shard: &Tensor,
) -> Result<Vec<(String, Tensor)>, TransformError> {
    check_shard(flat, rank as usize, shard)?;
    let itemsize = flat.dtype.size_bytes();
    let infos = &flat.ranks[rank as usize].shard_param_infos;
    Ok(flat
        .fqns
        .iter()
        .zip(infos)
        .map(|(name, info)| {
            let (offset, n) = match (info.offset_in_shard, info.numel_in_shard) {
                (Some(o), Some(n)) if info.in_shard => (o, n),
                _ => (0, 0),
            };
            let data =
                shard.data[offset as usize * itemsize..(offset + n) as usize * itemsize].to_vec();
            (
                name.clone(),
                Tensor {
                    dtype: flat.dtype,
                    shape: vec![n],
                    data,
                },
            )
        })
        .collect())
}

/// The local shard inside a LOCAL state-dict entry (ShardedTensor with 0 or 1 local shard, or a
/// plain tensor), as a 1-D tensor; an absent local shard is an empty tensor.
pub fn shard_of_local_entry(
    flat: &FlatParamLayout,
    entry: &crate::model::tree::Node,
) -> Result<Tensor, TransformError> {
    use crate::model::tree::Node;
    match entry {
        Node::Tensor(t) => Ok(t.clone()),
        Node::Dist(d) => Ok(d
            .local
            .as_ref()
            .map_or_else(|| Tensor::zeros(flat.dtype, vec![0]), |(_, t)| t.clone())),
        other => Err(TransformError::WrongKind {
            path: flat.flat_param_fqn.clone(),
            expected: "ShardedTensor or Tensor",
            found: other.kind_name(),
        }),
    }
}

// ------------------------------------------------------------------------------------------------
// Whole model state dicts (FULL / LOCAL / SHARDED), with PyTorch's key order.

use std::collections::{HashMap, HashSet};

use crate::layout::Fsdp1Model;
use crate::layout::key_plan::{FullKey, depth, full_key_plan, managed_aliases};
use crate::model::fqn;
use crate::model::tree::{Dict, Key, Node};
use crate::transform::chunk::sharded_chunk_from_full;

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
