//! Per-unit summary of a run: bytes, times and bandwidths.
//!
//! All-gather bandwidths follow nccl-tests (`all_gather_perf`): `S` is the total output size
//! (`input bytes × n`), `algbw = S / t` and `busbw = algbw × (n − 1) / n`, in GB/s (10^9 bytes).
//! `t` is the slowest rank's all-gather span (the collective is done when the last rank is).

use std::fmt::Write as _;

use serde::Serialize;

use crate::gather::GatherPlan;
use crate::trace::{Trace, names};

/// nccl-tests' algorithm bandwidth in GB/s: `bytes / seconds / 1e9` (0 for a zero time).
pub(crate) fn algbw_gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// nccl-tests' bus bandwidth of an all-gather over `n` ranks: `algbw × (n − 1) / n`.
pub(crate) fn all_gather_busbw_gbps(algbw_gbps: f64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        algbw_gbps * (n - 1) as f64 / n as f64
    }
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnitSummary {
    pub unit: String,
    pub dtype: String,
    /// Ranks in each all-gather.
    pub ranks: u64,
    /// Unsharded parameter bytes (what copy-out writes).
    pub param_bytes: u64,
    /// Every rank's all-gather input.
    pub input_bytes: u64,
    /// nccl-tests' `S`: the all-gather output.
    pub all_gather_bytes: u64,
    /// Slowest rank, seconds.
    pub all_gather_secs: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Slowest rank's copy-in (0 for FSDP1, whose flat shard is the all-gather input).
    pub copy_in_secs: f64,
    /// `input_bytes / copy_in_secs`.
    pub copy_in_gbps: f64,
    pub copy_out_secs: f64,
    /// `param_bytes / copy_out_secs`.
    pub copy_out_gbps: f64,
}

/// The whole table plus totals.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub backend: String,
    pub api: String,
    pub world_size: u64,
    pub group_size: u64,
    pub units: Vec<UnitSummary>,
    pub total: UnitSummary,
    /// Wall time of the whole run, seconds.
    pub wall_secs: f64,
    /// GPU runs: the device's own device-to-device copy bandwidth measured in the same run (the
    /// baseline for copy-in and copy-out), GB/s.
    pub device_copy_gbps: Option<f64>,
}

fn slowest(trace: &Trace, name: &str, unit: &str) -> f64 {
    trace
        .spans
        .iter()
        .filter(|s| s.name == name && s.unit == unit)
        .map(|s| s.dur_us)
        .fold(0.0, f64::max)
        / 1e6
}

impl Summary {
    /// Builds the table from the plan and the spans of a run.
    pub(crate) fn from_trace(
        plan: &GatherPlan,
        trace: &Trace,
        backend: &str,
        wall_secs: f64,
    ) -> Self {
        let n = plan.group_size;
        let mut units = Vec::with_capacity(plan.units.len());
        for unit in &plan.units {
            let name = unit.display_name();
            let all_gather_bytes = unit.output_bytes(n);
            let all_gather_secs = slowest(trace, names::ALL_GATHER, name);
            let algbw = algbw_gbps(all_gather_bytes, all_gather_secs);
            let copy_in_secs = slowest(trace, names::COPY_IN, name);
            let copy_out_secs = slowest(trace, names::COPY_OUT, name);
            units.push(UnitSummary {
                unit: name.to_owned(),
                dtype: unit.dtype_label(),
                ranks: n,
                param_bytes: unit.param_bytes(),
                input_bytes: unit.input_bytes,
                all_gather_bytes,
                all_gather_secs,
                algbw_gbps: algbw,
                busbw_gbps: all_gather_busbw_gbps(algbw, n),
                copy_in_secs,
                copy_in_gbps: algbw_gbps(unit.input_bytes, copy_in_secs),
                copy_out_secs,
                copy_out_gbps: algbw_gbps(unit.param_bytes(), copy_out_secs),
            });
        }
        let sum = |f: fn(&UnitSummary) -> u64| units.iter().map(f).sum::<u64>();
        let sumf = |f: fn(&UnitSummary) -> f64| units.iter().map(f).sum::<f64>();
        let all_gather_bytes = sum(|u| u.all_gather_bytes);
        let all_gather_secs = sumf(|u| u.all_gather_secs);
        let algbw = algbw_gbps(all_gather_bytes, all_gather_secs);
        let input_bytes = sum(|u| u.input_bytes);
        let param_bytes = sum(|u| u.param_bytes);
        let copy_in_secs = sumf(|u| u.copy_in_secs);
        let copy_out_secs = sumf(|u| u.copy_out_secs);
        let total = UnitSummary {
            unit: "total".to_owned(),
            dtype: String::new(),
            ranks: n,
            param_bytes,
            input_bytes,
            all_gather_bytes,
            all_gather_secs,
            algbw_gbps: algbw,
            busbw_gbps: all_gather_busbw_gbps(algbw, n),
            copy_in_secs,
            copy_in_gbps: algbw_gbps(input_bytes, copy_in_secs),
            copy_out_secs,
            copy_out_gbps: algbw_gbps(param_bytes, copy_out_secs),
        };
        Summary {
            backend: backend.to_owned(),
            api: match plan.api {
                shardscope_core::layout::Api::Fsdp1 => "fsdp1".to_owned(),
                shardscope_core::layout::Api::Fsdp2 => "fsdp2".to_owned(),
            },
            world_size: plan.world_size,
            group_size: n,
            units,
            total,
            wall_secs,
            device_copy_gbps: None,
        }
    }

    /// The table for people.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "gather: backend {}, {}, {} ranks, all-gather over {} ranks, wall {:.3} s",
            self.backend, self.api, self.world_size, self.group_size, self.wall_secs
        );
        let _ = writeln!(
            out,
            "{:<24} {:<14} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "unit",
            "dtype",
            "params",
            "all-gather",
            "time ms",
            "algbw GB/s",
            "busbw GB/s",
            "in GB/s",
            "out GB/s"
        );
        for u in self.units.iter().chain(std::iter::once(&self.total)) {
            let _ = writeln!(
                out,
                "{:<24} {:<14} {:>12} {:>12} {:>10.3} {:>10.2} {:>10.2} {:>10} {:>10.2}",
                u.unit,
                u.dtype,
                crate::gather::output::human_bytes(u.param_bytes),
                crate::gather::output::human_bytes(u.all_gather_bytes),
                u.all_gather_secs * 1e3,
                u.algbw_gbps,
                u.busbw_gbps,
                if u.copy_in_secs > 0.0 {
                    format!("{:.2}", u.copy_in_gbps)
                } else {
                    "-".to_owned()
                },
                u.copy_out_gbps
            );
        }
        if let Some(d2d) = self.device_copy_gbps {
            let pct = |x: f64| if d2d > 0.0 { 100.0 * x / d2d } else { 0.0 };
            let _ = writeln!(
                out,
                "device-to-device copy (same run): {d2d:.1} GB/s; copy-in {:.0}% and copy-out {:.0}% of it",
                pct(self.total.copy_in_gbps),
                pct(self.total.copy_out_gbps)
            );
        }
        let _ = writeln!(
            out,
            "algbw = all-gather output bytes / time; busbw = algbw x (n-1)/n (nccl-tests); time = slowest rank"
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_formulas_follow_nccl_tests() {
        // 8 ranks gathering 1 GB total in 0.1 s: algbw 10 GB/s, busbw 10 * 7/8.
        let algbw = algbw_gbps(1_000_000_000, 0.1);
        assert!((algbw - 10.0).abs() < 1e-9);
        assert!((all_gather_busbw_gbps(algbw, 8) - 8.75).abs() < 1e-9);
        // One rank moves nothing over the bus.
        assert!(all_gather_busbw_gbps(algbw, 1).abs() < 1e-12);
        assert!(algbw_gbps(5, 0.0).abs() < 1e-12);
    }
}
