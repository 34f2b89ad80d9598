//! Layout of a 70B-parameter-scale model (Llama-2-70B shapes: 80 layers x 9 tensors + embeddings,
//! 723 parameters, 69e9 elements) at world size 1024, FSDP1 (`use_orig_params` on and off) and FSDP2.
//!
//! Run: `cargo bench -p shardscope-core --bench layout`. Reports the median of several runs of each step
//! next to the time to parse the description JSON, measured in the same run (the baseline).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use shardscope_core::layout::{self, Api, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;

const RUNS: usize = 9;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn time<T>(mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut samples = Vec::with_capacity(RUNS);
    let mut last = None;
    for _ in 0..RUNS {
        let start = Instant::now();
        let out = std::hint::black_box(f());
        samples.push(start.elapsed());
        last = Some(out);
    }
    (median(samples), last.unwrap())
}

fn main() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/llama2_70b.json");
    let bytes = std::fs::read(path).unwrap();
    let (parse, model) =
        time(|| ModelDescription::from_json_bytes(&bytes, "llama2_70b.json").unwrap());
    let elements: u64 = model
        .params
        .iter()
        .map(shardscope_core::model::ParamSpec::numel)
        .sum();
    println!(
        "model: {} parameters, {} elements, {} units; world size 1024",
        model.params.len(),
        elements,
        model.units.len()
    );
    println!("{:<44} {:>12} {:>14}", "step", "median", "x baseline");
    let base = parse.as_secs_f64();
    let report = |name: &str, d: Duration| {
        println!(
            "{name:<44} {:>9.3} ms {:>13.2}x",
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() / base
        );
    };
    report("baseline: parse description JSON", parse);
    for (name, api, use_orig_params) in [
        ("fsdp1 layout (use_orig_params=false)", Api::Fsdp1, false),
        ("fsdp1 layout (use_orig_params=true)", Api::Fsdp1, true),
        ("fsdp2 layout", Api::Fsdp2, false),
    ] {
        let config = LayoutConfig {
            api,
            world_size: 1024,
            shard_group_size: None,
            use_orig_params,
            strategy: Strategy::FullShard,
            param_dtype: None,
        };
        let (d, layout) = time(|| layout::compute(&model, &config).unwrap());
        report(name, d);
        let (d, json) = time(|| serde_json::to_vec(&layout).unwrap());
        report(
            &format!("  + serialize --json ({} MB)", json.len() / 1_000_000),
            d,
        );
    }
}
