//! Invariants of the layout engine on random models, unit sets and world sizes 1..64.
//!
//! The checks are independent of how the engine computes things: they only use the definitions
//! (a shard is a window of the padded flat parameter, every real element has exactly one owner, ...).
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use shardscope_core::DType;
use shardscope_core::layout::fsdp1::PieceKind;
use shardscope_core::layout::{self, Api, Layout, LayoutConfig, Strategy as Sharding};
use shardscope_core::model::{ModelDescription, ParamSpec};

#[derive(Debug, Clone)]
struct Case {
    params: Vec<ParamSpec>,
    units: Vec<String>,
    world_size: u64,
    use_orig_params: bool,
    param_dtype: Option<DType>,
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop_oneof![
        Just(DType::Float32),
        Just(DType::BFloat16),
        Just(DType::Float16),
        Just(DType::Float64)
    ]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        // (module index, submodule index, shape) per parameter
        prop::collection::vec(
            (0u8..4, 0u8..3, prop::collection::vec(1u64..24, 0..=3)),
            1..12,
        ),
        dtype_strategy(),
        prop::option::of(dtype_strategy()),
        1u64..=64,
        any::<bool>(),
        prop::collection::vec(any::<bool>(), 13),
    )
        .prop_map(
            |(raw, dtype, param_dtype, world_size, use_orig_params, unit_mask)| {
                let mut params = Vec::new();
                for (i, (m, s, shape)) in raw.into_iter().enumerate() {
                    let fqn = if m == 0 {
                        format!("p{i}")
                    } else {
                        format!("m{m}.s{s}.p{i}")
                    };
                    params.push(ParamSpec {
                        fqn,
                        shape,
                        dtype,
                        requires_grad: true,
                        shared_with: None,
                    });
                }
                // Candidate units: root, m1..m3, m{1..3}.s{0..2}
                let mut candidates = vec![String::new()];
                for m in 1..4 {
                    candidates.push(format!("m{m}"));
                    for s in 0..3 {
                        candidates.push(format!("m{m}.s{s}"));
                    }
                }
                let units = candidates
                    .into_iter()
                    .zip(unit_mask)
                    .filter(|(_, keep)| *keep)
                    .map(|(u, _)| u)
                    .collect();
                Case {
                    params,
                    units,
                    world_size,
                    use_orig_params,
                    param_dtype,
                }
            },
        )
}

fn model(case: &Case) -> ModelDescription {
    ModelDescription::new(case.params.clone(), case.units.clone(), Vec::new()).unwrap()
}

fn config(case: &Case, api: Api) -> LayoutConfig {
    LayoutConfig {
        api,
        world_size: case.world_size,
        shard_group_size: None,
        use_orig_params: case.use_orig_params,
        strategy: Sharding::FullShard,
        param_dtype: case.param_dtype,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fsdp1_shards_tile_the_padded_flat_parameter(case in case_strategy()) {
        let model = model(&case);
        let Layout::Fsdp1(l) = layout::compute(&model, &config(&case, Api::Fsdp1)).unwrap() else {
            panic!("expected an FSDP1 layout");
        };
        let ws = case.world_size;
        let mut managed = 0usize;
        for flat in &l.flat_params {
            managed += flat.fqns.len();
            let total: u64 = flat.numels_with_padding.iter().sum();
            prop_assert_eq!(total, flat.unpadded_unsharded_numel);
            prop_assert_eq!(flat.ranks.len() as u64, ws);
            if ws == 1 {
                prop_assert_eq!(l.strategy, Sharding::NoShard);
                prop_assert_eq!(flat.sharded_numel, total);
            } else {
                // torch.chunk: C = ceil(T / ws), padded to C * ws.
                prop_assert_eq!(flat.sharded_numel, total.div_ceil(ws));
                prop_assert_eq!(flat.padded_unsharded_numel, Some(flat.sharded_numel * ws));
                let tails: u64 = flat.ranks.iter().map(|r| r.shard_numel_padded).sum();
                prop_assert_eq!(tails, flat.sharded_numel * ws - total);
            }

            // Padding rules.
            let real_segments = flat.is_padding_mask.iter().filter(|p| !**p).count();
            prop_assert_eq!(real_segments, flat.fqns.len());
            if case.use_orig_params {
                let align = 16 / case.param_dtype.unwrap_or(flat.dtype).size_bytes() as u64;
                prop_assert_eq!(flat.aligned_numel, align.max(1));
                prop_assert_eq!(total % ws, 0, "world-size padding makes the flat length divisible");
                let mut start = 0u64;
                for (i, (&n, &pad)) in flat.numels_with_padding.iter().zip(&flat.is_padding_mask).enumerate() {
                    if pad {
                        prop_assert!(n > 0);
                        prop_assert!(n < flat.aligned_numel.max(ws), "padding segment {} too long", i);
                    } else {
                        prop_assert_eq!(start % flat.aligned_numel, 0, "real segment {} unaligned", i);
                    }
                    start += n;
                }
            } else {
                prop_assert!(flat.is_padding_mask.iter().all(|p| !p));
                prop_assert_eq!(flat.aligned_numel, 0);
            }

            // Every rank's pieces tile its shard, and agree with its shard_param_infos.
            let mut owned: Vec<Vec<(u64, u64)>> = vec![Vec::new(); flat.fqns.len()];
            for rank in &flat.ranks {
                let pieces = flat.rank_pieces(rank.rank);
                let mut cursor = 0u64;
                for piece in &pieces {
                    prop_assert_eq!(piece.offset_in_shard, cursor);
                    prop_assert!(piece.numel > 0);
                    cursor += piece.numel;
                    if let PieceKind::Param { param, intra_start } = piece.kind {
                        let info = rank.shard_param_infos[param];
                        prop_assert!(info.in_shard);
                        prop_assert_eq!(info.offset_in_shard, Some(piece.offset_in_shard));
                        prop_assert_eq!(info.numel_in_shard, Some(piece.numel));
                        prop_assert_eq!(info.intra_param_start_idx, Some(intra_start));
                        prop_assert_eq!(info.intra_param_end_idx, Some(intra_start + piece.numel - 1));
                        owned[param].push((intra_start, intra_start + piece.numel));
                    }
                }
                prop_assert_eq!(cursor, flat.sharded_numel);
                let in_shard = rank.shard_param_infos.iter().filter(|i| i.in_shard).count();
                let param_pieces = pieces.iter().filter(|p| matches!(p.kind, PieceKind::Param { .. })).count();
                prop_assert_eq!(in_shard, param_pieces);
            }

            // Every real element is owned by exactly one rank (all ranks for NO_SHARD).
            for (param, ranges) in owned.iter_mut().enumerate() {
                ranges.sort_unstable();
                let numel = flat.numels[param];
                if ws == 1 {
                    prop_assert_eq!(ranges.as_slice(), &[(0, numel)][..]);
                    continue;
                }
                let mut cursor = 0;
                for &(lo, hi) in ranges.iter() {
                    prop_assert_eq!(lo, cursor, "gap or overlap in {}", &flat.fqns[param]);
                    cursor = hi;
                }
                prop_assert_eq!(cursor, numel);
            }
        }
        prop_assert_eq!(managed + l.unmanaged_params.len(), case.params.len());
    }

    #[test]
    fn fsdp2_local_shards_tile_every_parameter(case in case_strategy()) {
        let model = model(&case);
        let result = layout::compute(&model, &config(&case, Api::Fsdp2));
        let has_scalar_in_unit = case.params.iter().any(|p| p.shape.is_empty() && model.unit_of(&p.fqn).is_some());
        if has_scalar_in_unit {
            prop_assert!(result.is_err(), "0-dim parameters cannot be chunked on dim 0");
            return Ok(());
        }
        let Layout::Fsdp2(l) = result.unwrap() else { panic!("expected an FSDP2 layout") };
        let ws = case.world_size;
        for unit in &l.units {
            let mut input = 0;
            for p in &unit.params {
                prop_assert_eq!(p.ranks.len() as u64, ws);
                prop_assert_eq!(p.padded_sharded_shape[0], p.shape[0].div_ceil(ws));
                prop_assert_eq!(&p.padded_sharded_shape[1..], &p.shape[1..]);
                input += p.padded_sharded_numel();
                let mut rows = 0;
                for r in &p.ranks {
                    prop_assert_eq!(&r.local_shape[1..], &p.shape[1..]);
                    prop_assert!(r.global_offset[1..].iter().all(|&o| o == 0));
                    prop_assert!(r.local_shape[0] <= p.padded_sharded_shape[0]);
                    if r.local_shape[0] == 0 {
                        prop_assert_eq!(r.global_offset[0], p.shape[0]);
                    } else {
                        prop_assert_eq!(r.global_offset[0], rows, "rows are contiguous in rank order");
                    }
                    rows += r.local_shape[0];
                }
                prop_assert_eq!(rows, p.shape[0]);
            }
            prop_assert_eq!(unit.all_gather_input_numel, input);
        }
    }

    #[test]
    fn hybrid_groups_shard_like_a_world_of_the_group_size(case in case_strategy(), groups in 1u64..=4) {
        let model = model(&case);
        let k = case.world_size;
        let hybrid = LayoutConfig {
            world_size: k * groups,
            shard_group_size: Some(k),
            strategy: Sharding::HybridShard,
            ..config(&case, Api::Fsdp1)
        };
        let plain = layout::compute(&model, &config(&case, Api::Fsdp1)).unwrap();
        let Layout::Fsdp1(h) = layout::compute(&model, &hybrid).unwrap() else { panic!() };
        let Layout::Fsdp1(p) = plain else { panic!() };
        prop_assert_eq!(h.world_size, k * groups);
        prop_assert_eq!(h.flat_params, p.flat_params);
    }
}
