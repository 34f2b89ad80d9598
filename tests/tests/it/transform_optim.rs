//! Optimizer-state transforms against real torch (fixtures of `tests/fixtures/optim/gen_optim.py`):
//! every expected value below was produced by torch 2.15's FSDP1 on CPU.
#![allow(clippy::unwrap_used)]

use crate::transform_support;

use shardscope_core::layout::{Fsdp1Model, ParamRef};
use shardscope_core::model::tree::{Dict, DistKind, Node};
use shardscope_core::transform::optim_state::local_optim_from_full;
use shardscope_core::transform::reference::optim_state::{
    full_from_sharded_tree, full_optim_from_local, rekey_fqns_to_ids, rekey_ids_to_fqns,
};
use shardscope_core::transform::reference::reshard::reshard_local_optim;
use transform_support::{SCENARIOS, Scenario, assert_same, load, sort_state_entries};

fn locals<'a>(s: &'a Scenario, name: &str) -> Vec<&'a Dict> {
    (0..s.world_size() as usize)
        .map(|r| s.dict(r, name))
        .collect()
}

fn all_optim_params(s: &Scenario) -> Vec<Vec<String>> {
    (0..s.world_size() as usize)
        .map(|r| s.optim_params(r))
        .collect()
}

#[test]
fn wrapped_parameter_order_matches_torch() {
    for name in SCENARIOS {
        let s = load(name);
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let ours: Vec<String> = model.wrapped_params().into_iter().map(|(n, _)| n).collect();
        assert_eq!(ours, s.strings("wrapped_named_parameters"), "{name}");
        for (n, p) in model.wrapped_params() {
            assert_eq!(model.param_ref(&n), Some(p), "{name}: {n}");
        }
    }
}

#[test]
fn layout_matches_torch_flat_parameters() {
    for name in SCENARIOS {
        let s = load(name);
        let desc = s.description("description");
        let layout = s.layout(&desc);
        for r in 0..s.world_size() as usize {
            let torch_flats = s.case["per_rank"][r]["flat_params"].as_array().unwrap();
            assert_eq!(torch_flats.len(), layout.flat_params.len(), "{name}");
            // torch lists FSDP modules in pre-order, as the layout does; `_fqns` are relative.
            for (tf, ours) in torch_flats.iter().zip(&layout.flat_params) {
                let rel: Vec<&str> = tf["fqns"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap())
                    .collect();
                assert_eq!(rel.len(), ours.fqns.len(), "{name}");
                for (a, b) in ours.fqns.iter().zip(&rel) {
                    assert!(a.ends_with(b), "{name}: {a} vs {b}");
                }
                let nwp: Vec<u64> = tf["numels_with_padding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap())
                    .collect();
                assert_eq!(ours.numels_with_padding, nwp, "{name} {rel:?}");
                assert_eq!(ours.sharded_numel, tf["sharded_numel"].as_u64().unwrap());
                let rank = &ours.ranks[r];
                assert_eq!(
                    rank.shard_numel_padded,
                    tf["shard_numel_padded"].as_u64().unwrap(),
                    "{name} {rel:?} rank {r}"
                );
                for (info, t) in rank
                    .shard_param_infos
                    .iter()
                    .zip(tf["shard_param_infos"].as_array().unwrap())
                {
                    let t: Vec<Option<u64>> = t.as_array().unwrap()[1..]
                        .iter()
                        .map(serde_json::Value::as_u64)
                        .collect();
                    assert_eq!(
                        vec![
                            info.offset_in_shard,
                            info.numel_in_shard,
                            info.intra_param_start_idx,
                            info.intra_param_end_idx
                        ],
                        t,
                        "{name} {rel:?} rank {r}"
                    );
                }
            }
        }
    }
}

/// `FSDP.optim_state_dict` FULL and SHARDED from the raw per-rank `optim.state_dict()`s.
#[test]
fn optim_state_dict_full_and_sharded_match_torch() {
    for name in SCENARIOS {
        let s = load(name);
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let raw = locals(&s, "optim_local");
        let params = all_optim_params(&s);
        for r in 0..s.world_size() as usize {
            let got = full_optim_from_local(&model, &raw, &params, r, None);
            if !s.has(r, "osd_full") {
                // torch raised: same message.
                let (_, msg) = s.error("osd_full");
                let err = got.expect_err(name).to_string();
                assert!(err.contains(&msg), "{name}: `{err}` vs torch `{msg}`");
                continue;
            }
            let got = got.unwrap();
            assert_same(
                &Node::Dict(got),
                s.get(r, "osd_full"),
                &format!("{name}/r{r}/osd_full"),
            );
            if s.has(r, "osd_sharded") {
                let got =
                    full_optim_from_local(&model, &raw, &params, r, Some(DistKind::ShardedTensor))
                        .unwrap();
                assert_same(
                    &Node::Dict(got),
                    s.get(r, "osd_sharded"),
                    &format!("{name}/r{r}/osd_sharded"),
                );
            }
        }
    }
}

/// `optim_state_dict_to_load` (= `shard_full_optim_state_dict`) and, through a gather of the
/// ShardedTensors, `flatten_sharded_optim_state_dict`.
#[test]
fn optim_state_dict_to_load_matches_torch() {
    for name in SCENARIOS {
        let s = load(name);
        if !s.has(0, "osd_full") {
            continue;
        }
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let full = s.dict(0, "osd_full");
        let sharded: Vec<&Node> = (0..s.world_size() as usize)
            .filter(|&r| s.has(r, "osd_sharded"))
            .map(|r| s.get(r, "osd_sharded"))
            .collect();
        for r in 0..s.world_size() as usize {
            let got = local_optim_from_full(&model, full, r as u64, &s.optim_params(r)).unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "to_load_full")),
                &format!("{name}/r{r}/to_load_full"),
            );
            if !sharded.is_empty() {
                let gathered = full_from_sharded_tree(&sharded).unwrap();
                let got = local_optim_from_full(
                    &model,
                    gathered.as_dict().unwrap(),
                    r as u64,
                    &s.optim_params(r),
                )
                .unwrap();
                assert_same(
                    &sort_state_entries(&Node::Dict(got)),
                    &sort_state_entries(s.get(r, "to_load_sharded")),
                    &format!("{name}/r{r}/to_load_sharded"),
                );
            }
        }
    }
}

/// Load targets other than the saving model: `wrap_alt()` at the same world size, and the ws=4
/// full dict loaded at ws=2 (`..._halve_world_size`), plus the raw ws=4 → ws=2 reshard.
#[test]
fn other_wrapping_and_halved_world_size_match_torch() {
    for uop in ["uop0", "uop1"] {
        let s = load(&format!("nested_ws2_{uop}"));
        let src4 = load(&format!("nested_ws4_{uop}"));
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let alt_desc = s.description("alt_description");
        let alt_layout = s.layout(&alt_desc);
        let alt = Fsdp1Model::new(&alt_desc, &alt_layout).unwrap();
        let alt_ids: Vec<String> = alt.wrapped_params().into_iter().map(|(n, _)| n).collect();
        assert_eq!(alt_ids, s.strings("alt_wrapped_named_parameters"));
        let desc4 = src4.description("description");
        let layout4 = src4.layout(&desc4);
        let model4 = Fsdp1Model::new(&desc4, &layout4).unwrap();
        let raw4 = locals(&src4, "optim_local");
        let params4 = all_optim_params(&src4);
        // The ws=4 run of the other `use_orig_params` value (torch loaded its full dict too).
        let other = load(if uop == "uop0" {
            "nested_ws4_uop1"
        } else {
            "nested_ws4_uop0"
        });
        let other_layout = other.layout(&desc4);
        let other_model = Fsdp1Model::new(&desc4, &other_layout).unwrap();
        let other_raw = locals(&other, "optim_local");
        let other_params = all_optim_params(&other);
        for r in 0..2usize {
            let got =
                local_optim_from_full(&alt, s.dict(0, "osd_full"), r as u64, &alt_ids).unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "alt_to_load_full")),
                &format!("{uop}/r{r}/alt_to_load_full"),
            );
            let got = local_optim_from_full(
                &model,
                src4.dict(0, "osd_full"),
                r as u64,
                &s.optim_params(r),
            )
            .unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "halve_to_load_full")),
                &format!("{uop}/r{r}/halve_to_load_full"),
            );
            let got = reshard_local_optim(
                &model4,
                &raw4,
                &params4,
                &model,
                r as u64,
                &s.optim_params(r),
            )
            .unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "halve_to_load_full")),
                &format!("{uop}/r{r}/reshard 4->2"),
            );
            let got = reshard_local_optim(
                &other_model,
                &other_raw,
                &other_params,
                &model,
                r as u64,
                &s.optim_params(r),
            )
            .unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "cross_to_load_full")),
                &format!("{uop}/r{r}/reshard 4->2 across use_orig_params"),
            );
        }
    }
}

/// Dicts without `param_groups`, and custom per-parameter entries (`value1=2.74`, `value2=None`).
#[test]
fn without_param_groups_and_custom_entries_match_torch() {
    for uop in ["uop0", "uop1"] {
        let s = load(&format!("nested_ws2_{uop}"));
        let desc = s.description("description");
        let layout = s.layout(&desc);
        let model = Fsdp1Model::new(&desc, &layout).unwrap();
        let params = all_optim_params(&s);
        let nopg: Vec<Dict> = locals(&s, "optim_local")
            .into_iter()
            .map(|d| {
                let mut d = d.clone();
                d.remove(&shardscope_core::model::tree::Key::str("param_groups"));
                d
            })
            .collect();
        let nopg_refs: Vec<&Dict> = nopg.iter().collect();
        let custom = locals(&s, "custom_optim_local");
        for r in 0..2usize {
            let got = full_optim_from_local(&model, &nopg_refs, &params, r, None).unwrap();
            assert_same(
                &Node::Dict(got),
                s.get(r, "nopg_osd_full"),
                &format!("{uop}/nopg_osd"),
            );
            let mut full = s.dict(0, "osd_full").clone();
            full.remove(&shardscope_core::model::tree::Key::str("param_groups"));
            let got = local_optim_from_full(&model, &full, r as u64, &s.optim_params(r)).unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "nopg_to_load_full")),
                &format!("{uop}/r{r}/nopg_to_load"),
            );
            let got = full_optim_from_local(&model, &custom, &params, r, None).unwrap();
            assert_same(
                &Node::Dict(got),
                s.get(r, "custom_osd_full"),
                &format!("{uop}/custom_osd"),
            );
            let got = local_optim_from_full(
                &model,
                s.dict(0, "custom_osd_full"),
                r as u64,
                &s.optim_params(r),
            )
            .unwrap();
            assert_same(
                &sort_state_entries(&Node::Dict(got)),
                &sort_state_entries(s.get(r, "custom_to_load_full")),
                &format!("{uop}/r{r}/custom_to_load"),
            );
        }
    }
}

/// `rekey_optim_state_dict` both ways against the non-wrapped model, and the name-keyed
/// reference dict sharded for the wrapped model.
#[test]
fn rekey_matches_torch() {
    let s = load("nested_ws2_uop0");
    let names = s.strings("ref_named_parameters");
    let got = rekey_ids_to_fqns(s.dict(0, "ref_optim"), &names).unwrap();
    assert_same(
        &Node::Dict(got),
        s.get(0, "rekey_to_names"),
        "rekey_to_names",
    );
    let got = rekey_fqns_to_ids(s.dict(0, "osd_full"), &names).unwrap();
    assert_same(&Node::Dict(got), s.get(0, "rekey_to_ids"), "rekey_to_ids");
    // Already in the requested key type: unchanged.
    let same = rekey_ids_to_fqns(s.dict(0, "rekey_to_names"), &names).unwrap();
    assert_same(&Node::Dict(same), s.get(0, "rekey_to_names"), "idempotent");

    let desc = s.description("description");
    let layout = s.layout(&desc);
    let model = Fsdp1Model::new(&desc, &layout).unwrap();
    for r in 0..2usize {
        let got = local_optim_from_full(
            &model,
            s.dict(0, "rekey_to_names"),
            r as u64,
            &s.optim_params(r),
        )
        .unwrap();
        assert_same(
            &sort_state_entries(&Node::Dict(got)),
            &sort_state_entries(s.get(r, "ref_to_load")),
            &format!("r{r}/ref_to_load"),
        );
    }
}

fn mutated(full: &Dict, f: impl FnOnce(&mut Dict)) -> Dict {
    let mut full = full.clone();
    let Some(Node::Dict(state)) = full.get_mut(&shardscope_core::model::tree::Key::str("state"))
    else {
        panic!("no state")
    };
    f(state);
    full
}

fn entry<'a>(state: &'a mut Dict, fqn: &str) -> &'a mut Dict {
    match state.get_mut(&shardscope_core::model::tree::Key::str(fqn)) {
        Some(Node::Dict(d)) => d,
        _ => panic!("no state for {fqn}"),
    }
}

/// The validation of `_flatten_optim_state` and `_check_missing_keys_on_rank`, with torch's text.
#[test]
#[allow(
    clippy::too_many_lines,
    reason = "one case per torch error message, each next to its expected text"
)]
fn error_cases_carry_torch_messages() {
    use shardscope_core::DType;
    use shardscope_core::model::tree::{Key, Tensor};

    let s = load("nested_ws2_uop0");
    let desc = s.description("description");
    let layout = s.layout(&desc);
    let model = Fsdp1Model::new(&desc, &layout).unwrap();
    let full = s.dict(0, "osd_full");
    let ids = s.optim_params(0);
    let run = |d: &Dict| {
        local_optim_from_full(&model, d, 0, &ids)
            .unwrap_err()
            .to_string()
    };
    let check = |case: &str, ours: String, exact: bool| {
        let (_, torch) = s.error(case);
        if exact {
            assert_eq!(ours, torch, "{case}");
        } else {
            // torch embeds a tensor repr or Python set order here; compare the stable prefix.
            let cut = torch
                .find(" but got")
                .or_else(|| torch.find(", values"))
                .unwrap();
            assert!(
                ours.starts_with(&torch[..cut]),
                "{case}: `{ours}` vs `{torch}`"
            );
            let names = &torch[torch.rfind('[').unwrap()..];
            assert!(
                ours.ends_with(names) || ours.contains(names),
                "{case}: `{ours}` vs `{torch}`"
            );
        }
    };
    check(
        "differing_state_names",
        run(&mutated(full, |st| {
            entry(st, "block1.bias_module1.bias").remove(&Key::str("exp_avg_sq"));
        })),
        true,
    );
    let step7 =
        Node::Tensor(Tensor::new(DType::Float32, vec![], 7f32.to_le_bytes().to_vec()).unwrap());
    check(
        "differing_step",
        run(&mutated(full, |st| {
            entry(st, "block2.2.bias_module0.bias").insert(Key::str("step"), step7);
        })),
        true,
    );
    check(
        "differing_non_tensor",
        run(&mutated(full, |st| {
            for (i, k) in [
                "block2.2.weight",
                "block2.2.bias_module0.bias",
                "block2.2.bias_module1.bias",
            ]
            .iter()
            .enumerate()
            {
                entry(st, k).insert(Key::str("custom"), Node::Int(i as i64));
            }
        })),
        true,
    );
    check(
        "differing_types",
        run(&mutated(full, |st| {
            entry(st, "block1.weight").insert(Key::str("exp_avg"), Node::Float(1.5));
        })),
        false,
    );
    check(
        "shape_mismatch",
        run(&mutated(full, |st| {
            entry(st, "block1.weight").insert(
                Key::str("exp_avg"),
                Node::Tensor(Tensor::zeros(DType::Float32, vec![7, 3])),
            );
        })),
        true,
    );
    // torch prints a Python set of dtypes, in no fixed order.
    check(
        "differing_dtypes",
        run(&mutated(full, |st| {
            entry(st, "block1.weight").insert(
                Key::str("exp_avg"),
                Node::Tensor(Tensor::zeros(DType::Float64, vec![3, 7])),
            );
        })),
        false,
    );
    let mut no_state = full.clone();
    no_state.remove(&Key::str("state"));
    check("missing_state_key", run(&no_state), true);

    // Rank 1's optimizer lacks block2.2's flat parameter: drop it from rank 1's raw dict.
    let mut raw: Vec<Dict> = locals(&s, "optim_local").into_iter().cloned().collect();
    let mut params = all_optim_params(&s);
    let last = params[1].len() - 1;
    params[1].truncate(last);
    if let Some(Node::Dict(st)) = raw[1].get_mut(&Key::str("state")) {
        st.remove(&Key::Int(last as i64));
    }
    raw[1].remove(&Key::str("param_groups"));
    let refs: Vec<&Dict> = raw.iter().collect();
    let err = full_optim_from_local(&model, &refs, &params, 0, None).unwrap_err();
    check("rank_missing_rank0_keys", err.to_string(), true);

    let mut mixed = Dict::new();
    let mut st = Dict::new();
    st.insert(Key::Int(0), Node::Dict(Dict::new()));
    st.insert(Key::str("a"), Node::Dict(Dict::new()));
    mixed.insert(Key::str("state"), Node::Dict(st));
    mixed.insert(Key::str("param_groups"), Node::List(vec![]));
    let err = rekey_ids_to_fqns(&mixed, &[]).unwrap_err();
    check("rekey_mixed_keys", err.to_string(), true);
    let _ = ParamRef::Plain(String::new());
}
