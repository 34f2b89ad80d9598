//! What a checkpoint says about the FSDP configuration that wrote it: the number of ranks, the API
//! and the HSDP shard group, each with the evidence, so that a viewer or a command can start from the
//! checkpoint's own configuration instead of defaults. Only what the checkpoint states is returned:
//! `use_orig_params` is not recorded by any format, and a DCP directory does not say whether DTensors
//! or ShardedTensors wrote it.

use crate::index::{CheckpointIndex, FsdpInfo};
use crate::layout::Api;

/// A value and where it comes from, in words (`"2 rank files (__0_0.distcp … __1_0.distcp)"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hint<T> {
    pub value: T,
    pub why: String,
}

/// The configuration facts a checkpoint states.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutHints {
    pub world_size: Option<Hint<u64>>,
    pub api: Option<Hint<Api>>,
    /// Ranks per shard group of an HSDP mesh `(replicate, shard)`; `None` when the checkpoint shards
    /// over the whole world or does not say.
    pub shard_group_size: Option<Hint<u64>>,
}

/// Reads the hints from the index (no tensor bytes).
pub fn layout_hints(index: &CheckpointIndex) -> LayoutHints {
    let mut hints = LayoutHints::default();
    // A DTensor's mesh is the most direct statement of the world (and of HSDP).
    let mesh = index.entries.iter().find_map(|e| match &e.fsdp {
        Some(FsdpInfo::DTensor {
            placements,
            mesh_shape: Some(shape),
        }) => Some((placements.clone(), shape.clone(), e.key.clone())),
        _ => None,
    });
    if let Some((placements, shape, key)) = &mesh {
        let world = crate::shape::numel(shape);
        if let Some(world) = world.filter(|&w| w > 0) {
            hints.world_size = Some(Hint {
                value: world,
                why: format!("DTensor mesh {shape:?} of `{key}`"),
            });
        }
        let replicated_then_sharded = placements.len() == 2
            && placements[0].starts_with("Replicate")
            && placements[1].starts_with("Shard");
        if let ([_, group], true) = (shape.as_slice(), replicated_then_sharded) {
            hints.shard_group_size = Some(Hint {
                value: *group,
                why: format!("HSDP mesh {shape:?} ({placements:?}) of `{key}`"),
            });
        }
    }
    if hints.world_size.is_none() {
        // The highest rank named (a set of a million chunks' ranks costs more than their max).
        let last = index
            .files
            .values()
            .filter_map(|f| f.rank)
            .chain(
                index
                    .entries
                    .iter()
                    .flat_map(|e| e.chunks.iter().filter_map(|c| c.rank)),
            )
            .max();
        let rank_files = index.files.values().filter(|f| f.rank.is_some()).count();
        if let Some(last) = last
            && rank_files > 1
        {
            hints.world_size = Some(Hint {
                value: u64::from(last) + 1,
                why: format!("{rank_files} per-rank files (ranks 0..{last})"),
            });
        }
    }
    let dtensor = index
        .entries
        .iter()
        .find(|e| matches!(e.fsdp, Some(FsdpInfo::DTensor { .. })));
    let fsdp1 = index
        .entries
        .iter()
        .find(|e| e.flat_param || matches!(e.fsdp, Some(FsdpInfo::ShardedTensor { .. })));
    hints.api = match (dtensor, fsdp1) {
        (Some(e), None) => Some(Hint {
            value: Api::Fsdp2,
            why: format!(
                "`{}` is a DTensor (FSDP1 writes DTensors only for SHARDED_STATE_DICT with a device mesh)",
                e.key
            ),
        }),
        (None, Some(e)) => Some(Hint {
            value: Api::Fsdp1,
            why: if e.flat_param {
                format!("`{}` is an FSDP1 flat parameter", e.key)
            } else {
                format!("`{}` is a ShardedTensor", e.key)
            },
        }),
        (None, None) => row_chunks(index).map(|key| Hint {
            value: Api::Fsdp2,
            why: format!(
                "`{key}` and every other sharded tensor are stored as row chunks, one per rank: \
                 FSDP2's sharding (FSDP1 shards flat parameters; its SHARDED_STATE_DICT stores \
                 the same row chunks)"
            ),
        }),
        // Both kinds (FSDP1 SHARDED_STATE_DICT with a device mesh holds DTensors too).
        _ => None,
    };
    hints
}

/// The first tensor (not optimizer state) of a DCP stored in several chunks, when every tensor stored in several
/// chunks is split along dim 0 only, each chunk holding whole rows (what FSDP2's `Shard(0)`
/// writes; a DCP does not record DTensors). `None` for other kinds and other splits.
fn row_chunks(index: &CheckpointIndex) -> Option<&str> {
    use crate::index::CheckpointKind as K;
    if !matches!(
        index.kind,
        K::DcpTorchSave | K::DcpSafetensors | K::HfDistributedSafetensors
    ) {
        return None;
    }
    let mut first = None;
    for e in index.entries.iter().filter(|e| e.chunks.len() > 1) {
        let shape = e.shape.as_deref()?;
        let rows_only = e.chunks.iter().all(|c| {
            c.offsets.len() == shape.len()
                && c.sizes.len() == shape.len()
                && c.offsets.iter().skip(1).all(|&o| o == 0)
                && c.sizes.iter().skip(1).eq(shape.iter().skip(1))
        });
        if !rows_only {
            return None;
        }
        if first.is_none() && e.role.is_none() {
            first = Some(e.key.as_str());
        }
    }
    first
}
