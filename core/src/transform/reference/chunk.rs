//! Dim-0 `torch.chunk` sharding of whole tensors, as SHARDED_STATE_DICT (FSDP1), the sharded
//! optimizer state dict and FSDP2 DTensors store them (spec 2.3, 4.4, 8.4), and its inverse.

use crate::model::tree::{ChunkMeta, DistKind, DistTensor, Tensor};
use crate::shape::{chunk_range, shard_size_and_offset};
use crate::transform::TransformError;

/// Elements per dim-0 row (1 for a 1-D tensor).
fn row_numel(shape: &[u64]) -> u64 {
    shape.iter().skip(1).product()
}

fn rows(t: &Tensor, start_row: u64, end_row: u64) -> Tensor {
    let row_bytes = (row_numel(&t.shape) as usize) * t.dtype.size_bytes();
    let mut shape = t.shape.clone();
    shape[0] = end_row - start_row;
    Tensor {
        dtype: t.dtype,
        data: t.data[start_row as usize * row_bytes..end_row as usize * row_bytes].to_vec(),
        shape,
    }
}

/// Rank `rank`'s piece of `full` chunked on dim 0 over `world_size` ranks.
///
/// ShardedTensor (FSDP1 `_create_chunk_sharded_tensor`): only the non-empty chunks exist, with
/// placements `rank:<k>/cpu`; ranks past them hold no local shard. DTensor (`Shard(0)`): every rank
/// holds a local tensor, empty ones with dim 0 of size 0 at offset `dim0`.
pub fn sharded_chunk_from_full(
    full: &Tensor,
    rank: u64,
    world_size: u64,
    kind: DistKind,
) -> Result<DistTensor, TransformError> {
    if full.dim() == 0 {
        return Err(TransformError::BadTensor {
            path: String::new(),
            reason: "a 0-dim tensor cannot be chunked on dim 0".to_owned(),
        });
    }
    if world_size == 0 || rank >= world_size {
        return Err(TransformError::BadTensor {
            path: String::new(),
            reason: format!("rank {rank} is outside world size {world_size}"),
        });
    }
    let dim0 = full.shape[0];
    let zeros_tail = vec![0u64; full.dim() - 1];
    let offsets_of = |row: u64| {
        let mut o = vec![row];
        o.extend_from_slice(&zeros_tail);
        o
    };
    match kind {
        DistKind::ShardedTensor => {
            let mut chunks = Vec::new();
            for k in 0..world_size {
                let (lo, hi) = chunk_range(dim0, world_size, k);
                if hi > lo {
                    let mut sizes = full.shape.clone();
                    sizes[0] = hi - lo;
                    chunks.push(ChunkMeta {
                        offsets: offsets_of(lo),
                        sizes,
                        placement: Some(format!("rank:{k}/cpu")),
                    });
                }
            }
            let (lo, hi) = chunk_range(dim0, world_size, rank);
            let local = (hi > lo).then(|| (offsets_of(lo), rows(full, lo, hi)));
            Ok(DistTensor {
                kind,
                dtype: full.dtype,
                global_shape: full.shape.clone(),
                local,
                chunks,
            })
        }
        DistKind::DTensor => {
            let (size, offset) = shard_size_and_offset(dim0, world_size, rank);
            let start = offset.min(dim0);
            Ok(DistTensor {
                kind,
                dtype: full.dtype,
                global_shape: full.shape.clone(),
                local: Some((offsets_of(offset), rows(full, start, start + size))),
                chunks: Vec::new(),
            })
        }
    }
}

/// Reassembles the full tensor from every rank's piece (ShardedTensor or DTensor): each local
/// piece is placed at its dim-0 offset. The pieces must cover the tensor exactly once.
pub fn full_from_sharded_chunks(
    pieces: &[&DistTensor],
    path: &str,
) -> Result<Tensor, TransformError> {
    let bad = |reason: String| TransformError::BadTensor {
        path: path.to_owned(),
        reason,
    };
    let first = pieces
        .first()
        .ok_or_else(|| bad("no rank holds this tensor".to_owned()))?;
    let shape = first.global_shape.clone();
    if shape.is_empty() {
        return Err(bad(
            "a sharded tensor must have at least one dimension".to_owned()
        ));
    }
    let row_numel = row_numel(&shape);
    let itemsize = first.dtype.size_bytes();
    let numel =
        crate::shape::numel(&shape).ok_or_else(|| bad("global shape overflows".to_owned()))?;
    let mut out = Tensor::zeros(first.dtype, shape.clone());
    let mut covered = 0u64;
    let mut claimed = vec![false; shape[0] as usize];
    for piece in pieces {
        if piece.global_shape != shape || piece.dtype != first.dtype {
            return Err(bad(format!(
                "ranks disagree on the global tensor: {:?} {} vs {:?} {}",
                piece.global_shape, piece.dtype, shape, first.dtype
            )));
        }
        let Some((offsets, local)) = &piece.local else {
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
            continue;
        }
        let start = offsets[0];
        let end = start
            .checked_add(rows_here)
            .filter(|&e| e <= shape[0])
            .ok_or_else(|| bad(format!("local shard at row {start} runs past {shape:?}")))?;
        for row in start..end {
            if std::mem::replace(&mut claimed[row as usize], true) {
                return Err(bad(format!("row {row} is held by two ranks")));
            }
        }
        let byte_start = (start * row_numel) as usize * itemsize;
        out.data[byte_start..byte_start + local.data.len()].copy_from_slice(&local.data);
        covered += rows_here * row_numel;
    }
    if covered != numel {
        return Err(bad(format!(
            "the ranks' shards cover {covered} of {numel} elements"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn arange(shape: Vec<u64>) -> Tensor {
        let n: u64 = shape.iter().product();
        let data = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        Tensor::new(DType::Float32, shape, data).unwrap()
    }

    #[test]
    fn sharded_tensor_round_trip_with_empty_ranks() {
        // Spec 2.3: b (3x2) over 4 ranks -> rows 0,1,2 and nothing on rank 3.
        let b = arange(vec![3, 2]);
        let pieces: Vec<DistTensor> = (0..4)
            .map(|r| sharded_chunk_from_full(&b, r, 4, DistKind::ShardedTensor).unwrap())
            .collect();
        assert!(pieces[3].local.is_none());
        assert_eq!(pieces[0].chunks.len(), 3);
        assert_eq!(pieces[2].local.as_ref().unwrap().0, vec![2, 0]);
        let refs: Vec<&DistTensor> = pieces.iter().collect();
        assert_eq!(full_from_sharded_chunks(&refs, "b").unwrap(), b);
    }

    #[test]
    fn dtensor_empty_rank_sits_at_dim0() {
        let a = arange(vec![5]);
        let p = sharded_chunk_from_full(&a, 3, 4, DistKind::DTensor).unwrap();
        let (off, t) = p.local.unwrap();
        assert_eq!((off, t.shape), (vec![5], vec![0]));
    }
}
