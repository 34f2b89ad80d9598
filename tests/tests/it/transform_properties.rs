//! Invariants of the transforms over many layouts (world sizes, wrappings, `use_orig_params`):
//! shards rebuilt from full parameters give the parameters back; resharding A -> B -> A is the
//! identity; dim-0 chunks gather to the full tensor; full -> local -> full optimizer states are
//! identity on the values.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use shardscope_core::DType;
use shardscope_core::layout::Fsdp1Model;
use shardscope_core::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, Strategy as Sharding};
use shardscope_core::model::tree::{Dict, DistKind, DistTensor, Key, Node, Tensor};
use shardscope_core::model::{ModelDescription, ParamSpec};
use shardscope_core::transform::optim_state::local_optim_from_full;
use shardscope_core::transform::reference::chunk::{
    full_from_sharded_chunks, sharded_chunk_from_full,
};
use shardscope_core::transform::reference::flat_shards::{
    flat_shard_from_full_params, full_params_from_flat_shards,
};
use shardscope_core::transform::reference::optim_state::full_optim_from_local;

fn description(shapes: &[Vec<u64>], units: &[&str]) -> ModelDescription {
    // Parameters m<i>.p under modules m0..; units are module prefixes.
    let params = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec {
            fqn: format!("m{}.p{i}", i % 3),
            shape: s.clone(),
            dtype: DType::Float32,
            requires_grad: true,
            shared_with: None,
        })
        .collect();
    ModelDescription::new(
        params,
        units.iter().map(|u| (*u).to_owned()).collect(),
        vec![],
    )
    .unwrap()
}

fn layout(desc: &ModelDescription, ws: u64, uop: bool, strategy: Sharding) -> Fsdp1Layout {
    let config = LayoutConfig {
        api: Api::Fsdp1,
        world_size: ws,
        shard_group_size: None,
        use_orig_params: uop,
        strategy,
        param_dtype: None,
    };
    match layout::compute(desc, &config).unwrap() {
        Layout::Fsdp1(l) => l,
        Layout::Fsdp2(_) => unreachable!(),
    }
}

fn values(desc: &ModelDescription, seed: u32) -> Vec<(String, Tensor)> {
    desc.params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let data = (0..p.numel())
                .flat_map(|j| (seed as f32 + i as f32 * 100.0 + j as f32).to_le_bytes())
                .collect();
            (
                p.fqn.clone(),
                Tensor::new(DType::Float32, p.shape.clone(), data).unwrap(),
            )
        })
        .collect()
}

fn shape_strategy() -> impl proptest::strategy::Strategy<Value = Vec<u64>> {
    prop_oneof![
        (1u64..12).prop_map(|n| vec![n]),
        (1u64..5, 1u64..5).prop_map(|(a, b)| vec![a, b]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn flat_shards_round_trip(
        shapes in proptest::collection::vec(shape_strategy(), 1..6),
        ws in 1u64..6,
        uop in any::<bool>(),
        root in any::<bool>(),
    ) {
        let units: &[&str] = if root { &["", "m1"] } else { &["m0", "m2"] };
        let desc = description(&shapes, units);
        let lay = layout(&desc, ws, uop, Sharding::FullShard);
        let full = values(&desc, 7);
        for flat in &lay.flat_params {
            let lookup = |n: &str| full.iter().find(|(f, _)| f == n).map(|(_, t)| t);
            for padded in [true, false] {
                let shards: Vec<Tensor> = (0..flat.ranks.len() as u64)
                    .map(|r| flat_shard_from_full_params(flat, r, lookup, 42.0, padded).unwrap())
                    .collect();
                let refs: Vec<&Tensor> = shards.iter().collect();
                for (name, t) in full_params_from_flat_shards(flat, &refs).unwrap() {
                    prop_assert_eq!(Some(&t), lookup(&name));
                }
            }
        }
    }

    #[test]
    fn chunks_gather_to_the_full_tensor(shape in shape_strategy(), ws in 1u64..7, dt in any::<bool>()) {
        let t = values(&description(std::slice::from_ref(&shape), &[]), 3).remove(0).1;
        let kind = if dt { DistKind::DTensor } else { DistKind::ShardedTensor };
        let pieces: Vec<DistTensor> =
            (0..ws).map(|r| sharded_chunk_from_full(&t, r, ws, kind).unwrap()).collect();
        let refs: Vec<&DistTensor> = pieces.iter().collect();
        prop_assert_eq!(full_from_sharded_chunks(&refs, "t").unwrap(), t);
    }

    /// A full Adam-like state -> every rank's local state -> full again is the identity on the
    /// values, for any world size and either `use_orig_params`.
    #[test]
    fn optimizer_full_local_full_is_identity(
        shapes in proptest::collection::vec(shape_strategy(), 1..6),
        ws in 1u64..5,
        uop in any::<bool>(),
    ) {
        let desc = description(&shapes, &["m0", "m1"]);
        let lay = layout(&desc, ws, uop, Sharding::FullShard);
        let model = Fsdp1Model::new(&desc, &lay).unwrap();
        let names: Vec<String> = model.wrapped_params().into_iter().map(|(n, _)| n).collect();
        let mut state = Dict::new();
        let step = Tensor::new(DType::Float32, vec![], 2f32.to_le_bytes().to_vec()).unwrap();
        let mut fqns = Vec::new();
        for (p, exp) in desc.params.iter().zip(values(&desc, 11)) {
            let mut d = Dict::new();
            d.insert(Key::str("step"), Node::Tensor(step.clone()));
            d.insert(Key::str("exp_avg"), Node::Tensor(exp.1));
            state.insert(Key::Str(p.fqn.clone()), Node::Dict(d));
            fqns.push(Node::Str(p.fqn.clone()));
        }
        let mut full = Dict::new();
        full.insert(Key::str("state"), Node::Dict(state.clone()));
        let locals: Vec<Dict> = (0..ws)
            .map(|r| {
                let mut local = local_optim_from_full(&model, &full, r, &names).unwrap();
                // Adam has no state for parameters a rank does not hold (use_orig_params=True).
                if let Some(Node::Dict(st)) = local.get_mut(&Key::str("state")) {
                    let keep: Vec<(Key, Node)> = st
                        .iter()
                        .filter(|(_, v)| !v.as_dict().unwrap().is_empty())
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    *st = keep.into_iter().collect();
                }
                local
            })
            .collect();
        let refs: Vec<&Dict> = locals.iter().collect();
        let params: Vec<Vec<String>> = (0..ws).map(|_| names.clone()).collect();
        let back = full_optim_from_local(&model, &refs, &params, 0, None).unwrap();
        let back_state = back.get_str("state").unwrap().as_dict().unwrap();
        for (k, v) in state.iter() {
            let got = back_state.get(k).unwrap().as_dict().unwrap();
            for (name, value) in v.as_dict().unwrap().iter() {
                prop_assert_eq!(got.get(name), Some(value), "{} {}", k, name);
            }
        }
        prop_assert_eq!(back_state.len(), state.len());
        let _ = fqns;
    }
}
