//! The gather against real torch 2.15: for every layout fixture case (`tests/fixtures/layout/<case>/`,
//! written by `gen_layout.py`), the gathered parameters equal torch's full state dict on every rank,
//! and the buffers every rank builds equal torch's own padded shards (FSDP1 flat shards, FSDP2
//! `_sharded_param_data`) and FSDP2 all-gather inputs (`fsdp::all_gather_copy_in`), bit for bit. The
//! gather is run twice: from the full parameters cut with our layout, and from torch's own shards.
//!
//! The same checks run on the `cuda` backend's candle device over candle's CPU device (feature
//! `candle`, which the test build enables), and its results must equal the `cpu` backend's bit for bit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use shardscope_core::layout::{self, LayoutConfig};
use shardscope_core::model::ModelDescription;
use shardscope_runner::gather::source::{
    RankPrefixedSafetensors, SafetensorsFile, SafetensorsFull,
};
use shardscope_runner::gather::{
    self, GatherError, GatherOptions, GatherOutcome, GatherPlan, Observer, ParamPlan, ShardPlan,
    Source, UnitPlan,
};

/// A backend's entry point (`cpu::run`, `candle::run_threads`).
type Backend =
    fn(&GatherPlan, &Source, GatherOptions, &dyn Observer) -> Result<GatherOutcome, GatherError>;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/layout")
}

#[derive(Default)]
struct Seen {
    shards: Mutex<BTreeMap<(u64, String), Vec<u8>>>,
    inputs: Mutex<BTreeMap<(u64, String), Vec<u8>>>,
    params: Mutex<BTreeMap<(u64, String), Vec<u8>>>,
}

impl Observer for Seen {
    fn wants_device_buffers(&self) -> bool {
        true
    }
    fn shard(&self, rank: u64, _unit: &UnitPlan, shard: &ShardPlan, bytes: &[u8]) {
        self.shards
            .lock()
            .unwrap()
            .insert((rank, shard.key.clone()), bytes.to_vec());
    }
    fn all_gather_input(&self, rank: u64, unit: &UnitPlan, bytes: &[u8]) {
        self.inputs
            .lock()
            .unwrap()
            .insert((rank, unit.name.clone()), bytes.to_vec());
    }
    fn param(&self, rank: u64, param: &ParamPlan, bytes: &[u8]) {
        self.params
            .lock()
            .unwrap()
            .insert((rank, param.fqn.clone()), bytes.to_vec());
    }
}

fn config(case: &Value) -> LayoutConfig {
    LayoutConfig {
        api: case["api"].as_str().unwrap().parse().unwrap(),
        world_size: case["world_size"].as_u64().unwrap(),
        shard_group_size: case["shard_group_size"].as_u64(),
        use_orig_params: case["use_orig_params"].as_bool().unwrap(),
        strategy: case["strategy"].as_str().unwrap().parse().unwrap(),
        param_dtype: case["param_dtype"].as_str().map(|d| d.parse().unwrap()),
    }
}

/// Runs one case on `backend`; returns the number of bit-for-bit comparisons made against torch's
/// buffers.
#[allow(
    clippy::too_many_lines,
    reason = "one fixture case checked through each shard source in turn against torch's buffers"
)]
fn check_case(dir: &Path, backend: Backend) -> usize {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let case: Value =
        serde_json::from_slice(&std::fs::read(dir.join("case.json")).unwrap()).unwrap();
    if case.get("expected_error").is_some() {
        return 0;
    }
    let model =
        ModelDescription::from_json_bytes(&std::fs::read(dir.join("model.json")).unwrap(), &name)
            .unwrap();
    let cfg = config(&case);
    let plan = GatherPlan::from_layout(&layout::compute(&model, &cfg).unwrap()).unwrap();
    let file = Arc::new(SafetensorsFile::read(&dir.join("values.safetensors")).unwrap());
    let torch = |key: &str| file.data(key).map(<[u8]>::to_vec);
    // torch's full state dict stores a tied tensor once, under its first name.
    let torch_full = |fqn: &str| {
        let spec = model.params.iter().find(|p| p.fqn == fqn).unwrap();
        torch(&format!("full/{fqn}"))
            .or_else(|| torch(&format!("full/{}", spec.shared_with.as_deref()?)))
            .unwrap()
    };
    let options = GatherOptions {
        verify: true,
        keep_params: true,
    };
    let managed: Vec<&ParamPlan> = plan.units.iter().flat_map(|u| &u.params).collect();
    let mut compared = 0;

    // 1. Shards cut from torch's full parameters with our layout.
    let full = SafetensorsFull::for_model(file.clone(), "full/", &model).unwrap();
    let seen = Seen::default();
    let outcome = backend(&plan, &Source::Full(Box::new(full)), options, &seen).unwrap();
    let v = outcome.verify.as_ref().unwrap();
    assert!(v.is_ok(), "{name}: {:?}", v.mismatches);
    let params = seen.params.lock().unwrap();
    for rank in 0..cfg.world_size {
        for p in &managed {
            let want = torch_full(&p.fqn);
            assert!(
                params[&(rank, p.fqn.clone())] == want,
                "{name}: rank {rank} {}",
                p.fqn
            );
            compared += 1;
        }
        for unit in &plan.units {
            if cfg.api == layout::Api::Fsdp1 {
                // The all-gather input is the flat shard torch holds.
                let key = &unit.shards[0].key;
                let want = torch(&format!("rank{rank}/{key}")).unwrap();
                assert!(
                    seen.inputs.lock().unwrap()[&(rank, unit.name.clone())] == want,
                    "{name}: rank {rank} {key}"
                );
                compared += 1;
            } else {
                for shard in &unit.shards {
                    let want = torch(&format!("rank{rank}/{}", shard.key)).unwrap();
                    assert!(
                        seen.shards.lock().unwrap()[&(rank, shard.key.clone())] == want,
                        "{name}: rank {rank} padded shard {}",
                        shard.key
                    );
                    compared += 1;
                }
                let key = if unit.name.is_empty() {
                    format!("rank{rank}/all_gather_input")
                } else {
                    format!("rank{rank}/{}/all_gather_input", unit.name)
                };
                if let Some(want) = torch(&key) {
                    assert!(
                        seen.inputs.lock().unwrap()[&(rank, unit.name.clone())] == want,
                        "{name}: {key}"
                    );
                    compared += 1;
                }
            }
        }
    }
    // Rank 0's consolidated output: every managed name (tied aliases too) with torch's values.
    let kept = outcome.params.as_ref().unwrap();
    for p in &managed {
        assert_eq!(kept[&p.fqn].bytes, torch_full(&p.fqn), "{name}: {}", p.fqn);
    }
    for (alias, primary) in &plan.aliases {
        assert_eq!(
            kept[alias].bytes, kept[primary].bytes,
            "{name}: alias {alias}"
        );
    }

    // 2. torch's own rank-local shards, all-gathered: the result is torch's full state dict.
    let seen = Seen::default();
    let outcome = backend(
        &plan,
        &Source::PerRank(Box::new(RankPrefixedSafetensors::new(file.clone()))),
        options,
        &seen,
    )
    .unwrap();
    assert!(
        outcome.verify.as_ref().unwrap().is_ok(),
        "{name}: per-rank verify"
    );
    let params = seen.params.lock().unwrap();
    for rank in 0..cfg.world_size {
        for p in &managed {
            let want = torch_full(&p.fqn);
            assert!(
                params[&(rank, p.fqn.clone())] == want,
                "{name}: from torch's shards, rank {rank} {}",
                p.fqn
            );
            compared += 1;
        }
    }
    compared
}

fn cases() -> Vec<PathBuf> {
    let dir = fixtures_dir();
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").exists())
        .collect();
    cases.sort();
    assert!(!cases.is_empty(), "no cases in {}", dir.display());
    cases
}

#[test]
fn gathered_params_and_copy_in_buffers_equal_torch_for_every_fixture_case() {
    let dir = fixtures_dir();
    if !dir.exists() {
        println!("skipped: no layout fixtures at {} yet", dir.display());
        return;
    }
    let cases = cases();
    let mut gathered = 0;
    for case in &cases {
        let n = check_case(case, gather::cpu::run);
        if n > 0 {
            gathered += 1;
        }
    }
    assert!(gathered >= 1, "no case gathered");
    println!("{gathered} fixture cases gathered and compared with torch");
}

/// The `cuda` backend's engine and candle copy code (host-to-device, copy-in, copy-out,
/// device-to-host as candle tensor copies), on candle's CPU device with the all-gather done by an
/// in-process exchange: the torch checks above, then the whole outcome against the `cpu` backend's.
#[cfg(feature = "candle")]
#[test]
fn candle_device_gathers_every_fixture_case_like_torch_and_the_cpu_backend() {
    let mut gathered = 0;
    for case in &cases() {
        if check_case(case, gather::candle::run_threads) == 0 {
            continue;
        }
        gathered += 1;
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let spec: Value =
            serde_json::from_slice(&std::fs::read(case.join("case.json")).unwrap()).unwrap();
        let model = ModelDescription::from_json_bytes(
            &std::fs::read(case.join("model.json")).unwrap(),
            &name,
        )
        .unwrap();
        let plan =
            GatherPlan::from_layout(&layout::compute(&model, &config(&spec)).unwrap()).unwrap();
        let file = Arc::new(SafetensorsFile::read(&case.join("values.safetensors")).unwrap());
        let options = GatherOptions {
            verify: true,
            keep_params: true,
        };
        let source = Source::PerRank(Box::new(RankPrefixedSafetensors::new(file.clone())));
        let cpu = gather::cpu::run(&plan, &source, options, &gather::NoObserver).unwrap();
        let candle =
            gather::candle::run_threads(&plan, &source, options, &gather::NoObserver).unwrap();
        assert_eq!(candle.params, cpu.params, "{name}: gathered parameters");
        assert_eq!(candle.verify, cpu.verify, "{name}: verify report");
        // The candle run really went through its device: uploads and downloads on every rank.
        for rank in 0..plan.world_size {
            for step in ["host-to-device", "copy-out", "device-to-host"] {
                assert!(
                    candle
                        .trace
                        .spans
                        .iter()
                        .any(|s| s.rank == rank && s.name == step),
                    "{name}: rank {rank} has no {step} span"
                );
                let on_cpu = cpu.trace.spans.iter().any(|s| s.name == step);
                assert_eq!(on_cpu, step == "copy-out", "{name}: cpu backend {step}");
            }
        }
    }
    assert!(gathered >= 1, "no case gathered");
}
