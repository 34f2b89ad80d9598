//! Each rank's fp32 flat partitions of a DeepSpeed ZeRO checkpoint, with what lies where in them:
//! the pieces of the parameters, placed by the same partition math as the model ([`super::plan`]),
//! and the padding between (the runs no parameter covers, as [`super::padding`] reads them). The
//! viewer's shard map draws it: a bar per rank and flat group, a segment per piece or padding run.
//! Only the pickles are read (no tensor bytes).

use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::index::IndexError;
use crate::source::Source;

use super::padding::gaps;
use super::{StateDict, files, read_model, read_optim, trainable};

/// The flat partitions of a ZeRO checkpoint: every rank's fp32 flat groups and their contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitions {
    /// The ZeRO stage (1, 2 or 3).
    pub stage: u8,
    /// `partition_count`: the ranks.
    pub world_size: u64,
    /// The trainable parameters in `param_shapes` order ([`RunKind::Param`] indexes them).
    pub params: Vec<PartitionParam>,
    /// `shared_params`: `(alias, name)`, the alias holding no elements of its own.
    pub ties: Vec<(String, String)>,
    /// Rank by rank.
    pub ranks: Vec<RankPartitions>,
}

/// A trainable parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionParam {
    pub name: String,
    pub shape: Vec<u64>,
    /// Its group in `param_shapes`.
    pub group: usize,
}

/// One rank's optimizer states file and its flat groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPartitions {
    pub rank: u32,
    pub file: String,
    pub groups: Vec<FlatGroup>,
}

/// A flat group of one rank as saved: its key, length and runs (in order, tiling `0..numel`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatGroup {
    /// Its key in the file (`optimizer_state_dict.single_partition_of_fp32_groups.0`).
    pub key: String,
    pub numel: u64,
    pub dtype: DType,
    pub runs: Vec<FlatRun>,
}

/// A run of a flat group's elements `at..at + numel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatRun {
    pub at: u64,
    pub numel: u64,
    pub kind: RunKind,
}

/// What a run holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunKind {
    /// Elements `start..start + numel` of the flattened parameter `param` (an index into
    /// [`Partitions::params`]).
    Param { param: usize, start: u64 },
    /// Padding: ZeRO-1/2 alignment padding (`param_alignment_paddings`), ZeRO-3's padding of a
    /// parameter's last part; `after` is the parameter whose piece ends where it starts.
    Padding { after: Option<usize> },
}

/// Reads the flat partitions of the DeepSpeed ZeRO checkpoint `names` hold
/// ([`super::looks_like_deepspeed`]).
pub fn partitions(source: &dyn Source, names: &[String]) -> Result<Partitions, IndexError> {
    let folder = files::locate(source, names)?;
    let save = files::save_files(&folder)?;
    let mut file_infos = BTreeMap::new();
    let (optim, _) = read_optim(source, &folder, &save, &mut file_infos)?;
    let place = if folder.prefix.is_empty() {
        "the DeepSpeed folder"
    } else {
        folder.prefix.as_str()
    };
    let first = optim
        .first()
        .ok_or_else(|| super::records::bad(place, "no optimizer state files".to_owned()))?;
    let (stage, world_size) = (first.stage, first.partition_count);
    let (model, _, _) = read_model(source, &folder, &save, world_size, &mut file_infos)?;
    let zero = model
        .first()
        .ok_or_else(|| super::records::bad(place, "no model state files".to_owned()))?;
    let plans = trainable(stage, zero, &optim, &mut StateDict::default())?;
    let group_of: BTreeMap<&str, usize> = zero
        .param_shapes
        .iter()
        .enumerate()
        .flat_map(|(g, params)| params.iter().map(move |(n, _)| (n.as_str(), g)))
        .collect();
    let params = plans
        .iter()
        .map(|p| PartitionParam {
            name: p.name.clone(),
            shape: p.shape.clone(),
            group: group_of.get(p.name.as_str()).copied().unwrap_or(0),
        })
        .collect();
    let groups_key = if stage <= 2 {
        "optimizer_state_dict.single_partition_of_fp32_groups"
    } else {
        "optimizer_state_dict.fp32_flat_groups"
    };
    let mut ranks = Vec::with_capacity(optim.len());
    for (rank, o) in optim.iter().enumerate() {
        let mut groups = Vec::with_capacity(o.groups.len());
        for (slot, flat) in o.groups.iter().enumerate() {
            let mut runs: Vec<FlatRun> = plans
                .iter()
                .enumerate()
                .flat_map(|(i, p)| p.pieces.iter().map(move |piece| (i, piece)))
                .filter(|(_, piece)| piece.rank == rank && piece.slot == slot && piece.len > 0)
                .map(|(param, piece)| FlatRun {
                    at: piece.at,
                    numel: piece.len,
                    kind: RunKind::Param {
                        param,
                        start: piece.start,
                    },
                })
                .collect();
            let covered = runs.iter().map(|r| (r.at, r.numel)).collect();
            for gap in gaps(flat.numel, covered) {
                let after = runs.iter().find_map(|r| match r.kind {
                    RunKind::Param { param, .. }
                        if r.at.checked_add(r.numel) == Some(gap.start) =>
                    {
                        Some(param)
                    }
                    _ => None,
                });
                runs.push(FlatRun {
                    at: gap.start,
                    numel: gap.end - gap.start,
                    kind: RunKind::Padding { after },
                });
            }
            runs.sort_by_key(|r| r.at);
            groups.push(FlatGroup {
                key: format!("{groups_key}.{slot}"),
                numel: flat.numel,
                dtype: flat.dtype,
                runs,
            });
        }
        ranks.push(RankPartitions {
            rank: u32::try_from(rank).unwrap_or(u32::MAX),
            file: o.file.to_string(),
            groups,
        });
    }
    Ok(Partitions {
        stage,
        world_size,
        params,
        ties: zero.shared_params.clone(),
        ranks,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::index::read::deepspeed::tests::{fixtures, load};

    /// The runs of every group tile it exactly, in order; a damaged folder is the reader's error.
    #[test]
    fn runs_tile_every_flat_group() {
        for case in ["zero2_fp32_ws3", "zero3_bf16_ws3"] {
            let source = load(&fixtures().join(case));
            let p = partitions(&source, &source.names()).unwrap();
            assert_eq!(p.ranks.len() as u64, p.world_size, "{case}");
            for r in &p.ranks {
                for g in &r.groups {
                    let mut at = 0;
                    for run in &g.runs {
                        assert_eq!(run.at, at, "{case}: {}", g.key);
                        at += run.numel;
                    }
                    assert_eq!(at, g.numel, "{case}: {}", g.key);
                }
            }
        }
        let mut source = load(&fixtures().join("zero2_fp32"));
        source.remove("global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt");
        let e = partitions(&source, &source.names())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
            "{e}"
        );
    }
}
