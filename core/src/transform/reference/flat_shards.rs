//! Full parameters ⇄ FSDP1 flat-parameter shards (the `_flat_param` entries of LOCAL_STATE_DICT
//! and the raw per-rank storage), one parameter or one shard at a time, in memory.
//!
//! Padding: alignment and world-size padding *segments* (`use_orig_params=True`) are written with
//! a caller-chosen fill; PyTorch 2.15 uses `42.0` ([`TORCH_PADDING_FILL`]). The per-rank right
//! padding of a shard (`_shard_numel_padded`) is always zeros, as `F.pad` writes it.

use crate::layout::FlatParamLayout;
use crate::layout::fsdp1::PieceKind;
use crate::model::tree::{DistTensor, Tensor, fill_bytes};
use crate::transform::TransformError;
use crate::transform::model_state::{local_flat_param_structure, unpadded_shard_numel};

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
