//! Model state-dict transforms against real torch (fixtures of `tests/fixtures/optim/gen_optim.py`):
//! FULL ⇄ LOCAL (flat-parameter shards) ⇄ SHARDED, resharding to another world size or wrapping.
#![allow(clippy::unwrap_used)]

use crate::transform_support;

use std::collections::HashMap;

use shardscope_core::layout::Fsdp1Model;
use shardscope_core::model::tree::{Dict, DistKind, DistTensor, Node, Tensor};
use shardscope_core::transform::model_state::TORCH_PADDING_FILL;
use shardscope_core::transform::reference::chunk::{
    full_from_sharded_chunks, sharded_chunk_from_full,
};
use shardscope_core::transform::reference::flat_shards::shard_of_local_entry;
use shardscope_core::transform::reference::model_state::{
    fsdp2_sharded_from_full, model_full_from_local, model_local_from_full, model_sharded_from_full,
};
use shardscope_core::transform::reference::reshard::{FullParamSource, reshard_flat_params};
use transform_support::{SCENARIOS, Scenario, assert_same, load};

fn sharded_scenarios() -> Vec<Scenario> {
    SCENARIOS
        .iter()
        .map(|n| load(n))
        .filter(|s| s.has(0, "model_local"))
        .collect()
}

#[test]
fn full_state_dict_from_local_shards_matches_torch() {
    for s in sharded_scenarios() {
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let locals: Vec<&Dict> = (0..s.world_size() as usize)
            .map(|r| s.dict(r, "model_local"))
            .collect();
        let got = model_full_from_local(&model, &locals).unwrap();
        assert_same(
            &Node::Dict(got),
            s.get(0, "model_full"),
            &format!("{}/model_full", s.name),
        );
    }
}

#[test]
fn local_state_dict_from_full_matches_torch() {
    for s in sharded_scenarios() {
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let full = s.dict(0, "model_full");
        for r in 0..s.world_size() {
            let got = model_local_from_full(&model, r, full, TORCH_PADDING_FILL).unwrap();
            assert_same(
                &Node::Dict(got),
                s.get(r as usize, "model_local"),
                &format!("{}/r{r}/model_local", s.name),
            );
        }
    }
}

#[test]
fn sharded_state_dict_matches_torch_both_ways() {
    for s in sharded_scenarios() {
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let full = s.dict(0, "model_full");
        let ws = s.world_size();
        for r in 0..ws {
            let got = model_sharded_from_full(&model, r, full, DistKind::ShardedTensor).unwrap();
            assert_same(
                &Node::Dict(got),
                s.get(r as usize, "model_sharded"),
                &format!("{}/r{r}/model_sharded", s.name),
            );
        }
        // Gather: every chunked entry reassembles to torch's full tensor.
        for (k, v) in s.dict(0, "model_sharded").iter() {
            if !matches!(v, Node::Dist(_)) {
                continue;
            }
            let pieces: Vec<&DistTensor> = (0..ws as usize)
                .map(|r| match s.dict(r, "model_sharded").get(k).unwrap() {
                    Node::Dist(d) => d,
                    _ => panic!(),
                })
                .collect();
            let got = full_from_sharded_chunks(&pieces, &k.to_string()).unwrap();
            assert_same(
                &Node::Tensor(got),
                full.get(k).unwrap(),
                &format!("{}/{k}", s.name),
            );
        }
    }
}

#[test]
fn dtensor_chunks_have_torch_offsets() {
    // Spec 2.3 / 4.4 [verified]: `a` (5) over 4 ranks; empty rank at offset 5 with shape [0].
    let data: Vec<u8> = (0..5u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let a = Tensor::new(shardscope_core::DType::Float32, vec![5], data).unwrap();
    let offsets: Vec<(Vec<u64>, Vec<u64>)> = (0..4)
        .map(|r| {
            let d = sharded_chunk_from_full(&a, r, 4, DistKind::DTensor).unwrap();
            let (o, t) = d.local.unwrap();
            (o, t.shape)
        })
        .collect();
    assert_eq!(
        offsets,
        [
            (vec![0], vec![2]),
            (vec![2], vec![2]),
            (vec![4], vec![1]),
            (vec![5], vec![0])
        ]
    );
}

fn flat_shards(
    model: &Fsdp1Model<'_>,
    s: &Scenario,
    name: &str,
) -> (Vec<Vec<Tensor>>, HashMap<String, Tensor>) {
    let ws = s.world_size() as usize;
    let shards = model
        .layout
        .flat_params
        .iter()
        .map(|flat| {
            (0..ws)
                .map(|r| {
                    shard_of_local_entry(
                        flat,
                        s.dict(r, name).get_str(&flat.flat_param_fqn).unwrap(),
                    )
                    .unwrap()
                })
                .collect()
        })
        .collect();
    let plain = s
        .dict(0, name)
        .iter()
        .filter_map(|(k, v)| match v {
            Node::Tensor(t) => Some((k.to_string(), t.clone())),
            _ => None,
        })
        .collect();
    (shards, plain)
}

/// LOCAL (flat-parameter) checkpoints resharded offline: ws=4 → ws=2 and `wrap()` → `wrap_alt()`.
/// torch's reference: the target model loaded with the source FULL state dict, then LOCAL.
#[test]
fn local_reshard_matches_torch() {
    for uop in ["uop0", "uop1"] {
        let s2 = load(&format!("nested_ws2_{uop}"));
        let s4 = load(&format!("nested_ws4_{uop}"));
        let desc = s2.description("description");
        let layout2 = s2.layout(&desc);
        let model2 = Fsdp1Model::new(&desc, &layout2).unwrap();
        let layout4 = s4.layout(&desc);
        let model4 = Fsdp1Model::new(&desc, &layout4).unwrap();
        let alt_desc = s2.description("alt_description");
        let alt_layout = s2.layout(&alt_desc);
        let alt = Fsdp1Model::new(&alt_desc, &alt_layout).unwrap();
        let other = load(if uop == "uop0" {
            "nested_ws4_uop1"
        } else {
            "nested_ws4_uop0"
        });
        let other_layout = other.layout(&desc);
        let other_model = Fsdp1Model::new(&desc, &other_layout).unwrap();

        for (src_s, src_model, dst, expected) in [
            (&s4, &model4, &model2, "halve_model_local"),
            (&s2, &model2, &alt, "alt_model_local"),
            (&other, &other_model, &model2, "cross_model_local"),
        ] {
            let (shards, plain) = flat_shards(src_model, src_s, "model_local");
            let refs: Vec<Vec<&Tensor>> = shards.iter().map(|v| v.iter().collect()).collect();
            let source = FullParamSource {
                model: src_model,
                shards: &refs,
                plain: &plain,
            };
            for r in 0..2u64 {
                let got = reshard_flat_params(&source, dst, r, TORCH_PADDING_FILL, false).unwrap();
                let want = s2.dict(r as usize, expected);
                for (key, shard) in got {
                    let Some(Node::Dist(d)) = want.get_str(&key) else {
                        panic!("{uop}/{expected}: torch has no {key}")
                    };
                    let torch_local = d
                        .local
                        .as_ref()
                        .map_or_else(|| Tensor::zeros(d.dtype, vec![0]), |(_, t)| t.clone());
                    assert_same(
                        &Node::Tensor(shard),
                        &Node::Tensor(torch_local),
                        &format!("{uop}/{expected}/r{r}/{key}"),
                    );
                }
            }
        }
    }
}

/// FSDP2 (`fully_shard`, 1-D mesh of 4): DTensor state dicts, empty trailing ranks included.
#[test]
fn fsdp2_dtensor_state_dict_matches_torch_both_ways() {
    let s = load("fsdp2_ws4");
    let desc = s.description("description");
    let full = s.dict(0, "model_full");
    let per_rank: Vec<&Node> = (0..4).map(|r| s.get(r, "model_dtensor")).collect();
    for r in 0..4u64 {
        let got = fsdp2_sharded_from_full(&desc, r, 4, full).unwrap();
        assert_same(
            &Node::Dict(got),
            per_rank[r as usize],
            &format!("fsdp2/r{r}"),
        );
    }
    let gathered =
        shardscope_core::transform::reference::optim_state::full_from_sharded_tree(&per_rank)
            .unwrap();
    assert_same(&gathered, s.get(0, "model_full"), "fsdp2 gather");
    // Some parameter really has an empty trailing rank (bias: 5 rows over 4 ranks).
    let Node::Dist(d) = s.dict(3, "model_dtensor").get_str("bias").unwrap() else {
        panic!()
    };
    assert_eq!(d.local.as_ref().unwrap().1.shape, vec![0]);
}
