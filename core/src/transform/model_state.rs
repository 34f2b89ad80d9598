//! FSDP1 flat parameters as a LOCAL state dict stores them, by structure: the padding fill PyTorch
//! writes, each rank's stored length, and the ShardedTensor entry of a rank's `_flat_param`.

use crate::layout::FlatParamLayout;
use crate::model::tree::{ChunkMeta, DistKind, DistTensor, Tensor};

/// The value PyTorch 2.15 writes into padding segments of flat parameters.
pub const TORCH_PADDING_FILL: f64 = 42.0;

/// Number of elements rank `rank` stores without its right padding (the LOCAL state dict length).
pub fn unpadded_shard_numel(flat: &FlatParamLayout, rank: u64) -> u64 {
    let pad = flat
        .ranks
        .get(rank as usize)
        .map_or(0, |r| r.shard_numel_padded);
    flat.sharded_numel - pad
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
