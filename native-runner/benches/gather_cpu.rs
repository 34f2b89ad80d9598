//! CPU backend throughput against a plain memcpy of the same bytes, in the same run.
//!
//! `cargo bench -p shardscope-runner --bench gather_cpu [-- --world-size N --units U --unit-mib M --runs R]`
//!
//! The gather path of one rank per unit copies `input` bytes in (FSDP2 only: FSDP1's flat shard is
//! the all-gather input), receives `n × input` bytes in the all-gather and copies `params` bytes out.
//! The baseline runs `n` threads that each memcpy exactly those byte counts between preallocated
//! buffers, unit by unit, with a barrier between units. Both sides are measured the same way: per unit
//! the slowest rank's copy time (gather: copy-in + all-gather + copy-out spans), summed over units;
//! medians over the runs. The whole run's wall time (which also includes loading the shards and the
//! barriers) is shown too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Barrier;
use std::time::Instant;

use shardscope_core::DType;
use shardscope_core::layout::{self, Api, LayoutConfig, Strategy};
use shardscope_core::model::{ModelDescription, ParamSpec};
use shardscope_runner::gather::{
    self, FullSource, GatherOptions, GatherPlan, NoObserver, Source, SourceError,
};

/// Full parameters held in memory: reading is a memcpy.
struct InMemory(std::collections::BTreeMap<String, Vec<u8>>);

impl FullSource for InMemory {
    fn name(&self) -> String {
        "memory".to_owned()
    }
    fn contains(&self, fqn: &str) -> bool {
        self.0.contains_key(fqn)
    }
    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        let s = byte_offset as usize;
        dst.copy_from_slice(&self.0[fqn][s..s + dst.len()]);
        Ok(())
    }
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("number"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `n` threads, each copying `per_unit[u]` byte counts unit by unit between its own buffers
/// (touched beforehand), with a barrier between units. Measured like the gather path: for every
/// unit the slowest thread's copy time, summed over units.
fn memcpy_baseline(n: usize, per_unit: &[Vec<usize>]) -> f64 {
    let largest = per_unit.iter().flatten().copied().max().unwrap_or(0);
    let barrier = Barrier::new(n);
    let per_thread: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                s.spawn(|| {
                    let src = vec![1u8; largest];
                    let mut dst = vec![0u8; largest];
                    dst.copy_from_slice(&src);
                    let mut times = Vec::with_capacity(per_unit.len());
                    for copies in per_unit {
                        barrier.wait();
                        let start = Instant::now();
                        for &len in copies {
                            dst[..len].copy_from_slice(&src[..len]);
                        }
                        times.push(start.elapsed().as_secs_f64());
                    }
                    std::hint::black_box(&dst);
                    times
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (0..per_unit.len())
        .map(|u| per_thread.iter().map(|t| t[u]).fold(0.0, f64::max))
        .sum()
}

fn main() {
    let world_size = arg("--world-size", 4);
    let units = arg("--units", 8);
    let unit_mib = arg("--unit-mib", 32);
    let runs = arg("--runs", 5) as usize;
    // Each unit: a [rows, 1024] float32 weight and a [rows] bias, rows chosen for unit_mib.
    let rows = unit_mib * 1024 * 1024 / 4 / 1024 - 1;
    let mut params = Vec::new();
    let mut unit_names = Vec::new();
    for u in 0..units {
        unit_names.push(format!("layers.{u}"));
        params.push(ParamSpec {
            fqn: format!("layers.{u}.weight"),
            shape: vec![rows, 1024],
            dtype: DType::Float32,
            requires_grad: true,
            shared_with: None,
        });
        params.push(ParamSpec {
            fqn: format!("layers.{u}.bias"),
            shape: vec![rows + 3],
            dtype: DType::Float32,
            requires_grad: true,
            shared_with: None,
        });
    }
    let model = ModelDescription::new(params, unit_names, vec![]).unwrap();
    let data = model
        .params
        .iter()
        .map(|p| {
            let len = p.numel() as usize * 4;
            (
                p.fqn.clone(),
                (0..len).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>(),
            )
        })
        .collect();
    let source = Source::Full(Box::new(InMemory(data)));
    println!(
        "gather (cpu backend): {units} units x {unit_mib} MiB float32, world size {world_size}, {} cores, median of {runs}",
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    );
    println!(
        "| api | bytes moved (all ranks) | memcpy baseline | gather path | gather path / memcpy | gather GB/s | memcpy GB/s | whole run (incl. load) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for api in [Api::Fsdp1, Api::Fsdp2] {
        let cfg = LayoutConfig {
            api,
            world_size,
            shard_group_size: None,
            use_orig_params: true,
            strategy: Strategy::FullShard,
            param_dtype: None,
        };
        let plan = GatherPlan::from_layout(&layout::compute(&model, &cfg).unwrap()).unwrap();
        let n = plan.group_size;
        let per_unit: Vec<Vec<usize>> = plan
            .units
            .iter()
            .map(|u| {
                let mut v = Vec::new();
                if api == Api::Fsdp2 {
                    v.push(u.input_bytes as usize);
                }
                v.push(u.output_bytes(n) as usize);
                v.push(u.param_bytes() as usize);
                v
            })
            .collect();
        let moved_per_rank: usize = per_unit.iter().flatten().sum();
        let moved = moved_per_rank as f64 * world_size as f64;
        let mut base = Vec::new();
        let mut path = Vec::new();
        let mut wall = Vec::new();
        for _ in 0..runs {
            base.push(memcpy_baseline(world_size as usize, &per_unit));
            let outcome =
                gather::cpu::run(&plan, &source, GatherOptions::default(), &NoObserver).unwrap();
            let s = &outcome.summary.total;
            path.push(s.copy_in_secs + s.all_gather_secs + s.copy_out_secs);
            wall.push(outcome.summary.wall_secs);
        }
        let (b, p, w) = (median(base), median(path), median(wall));
        println!(
            "| {} | {:.2} GB | {:.1} ms | {:.1} ms | {:.2}x | {:.2} | {:.2} | {:.1} ms |",
            if api == Api::Fsdp1 { "fsdp1" } else { "fsdp2" },
            moved / 1e9,
            b * 1e3,
            p * 1e3,
            p / b,
            moved / p / 1e9,
            moved / b / 1e9,
            w * 1e3
        );
    }
}
