//! The `optimizer-moments-equal` rule: Adam's two moments (`exp_avg`, `exp_avg_sq`) equal bit for
//! bit for every parameter. Real training never gives that (`exp_avg_sq` holds squared gradients);
//! torch does, for FSDP1 with `use_orig_params=True` when the full optimizer state dict is taken
//! with `offload_to_cpu=True` (accelerate's FULL `optimizer.bin` is written that way): the
//! second moment is a copy of the first, and a run resumed from it trains wrong.

use std::collections::BTreeMap;

use crate::index::{CheckpointIndex, IndexEntry, PathSeg, Role};
use crate::source::Source;

use super::parts::Parts;
use super::report::{Finding, Severity};

/// Moments larger than this (per parameter, first chunk) are not compared: the rule reads little
/// (a model's norms and biases are enough), and stops at the first parameter whose moments differ.
const MAX_COMPARED_BYTES: u64 = 1 << 20;

/// Whether `a` and `b` hold the same bytes in their first chunks (same place, same size), and
/// whether those bytes are all zero; `None` when they cannot be compared cheaply.
fn same_first_chunk(
    index: &CheckpointIndex,
    source: &dyn Source,
    a: &IndexEntry,
    b: &IndexEntry,
) -> Option<(bool, bool)> {
    let (ca, cb) = (a.chunks.first()?, b.chunks.first()?);
    if a.dtype != b.dtype
        || ca.offsets != cb.offsets
        || ca.sizes != cb.sizes
        || ca.byte_length > MAX_COMPARED_BYTES
        || cb.byte_length > MAX_COMPARED_BYTES
    {
        return None;
    }
    let da = index.read_chunk(source, a, ca).ok()?;
    let db = index.read_chunk(source, b, cb).ok()?;
    Some((da.bytes == db.bytes, da.bytes.iter().all(|&x| x == 0)))
}

pub(super) fn diagnose_moments(
    index: &CheckpointIndex,
    source: &dyn Source,
    parts: &Parts<'_>,
    out: &mut Vec<Finding>,
) {
    for part in &parts.optims {
        let mut moments: BTreeMap<&PathSeg, (Option<&IndexEntry>, Option<&IndexEntry>)> =
            BTreeMap::new();
        for e in &part.entries {
            if let Some(Role::OptimizerState { param, state }) = &e.role {
                let slot = moments.entry(param).or_default();
                match state.as_str() {
                    "exp_avg" => slot.0 = Some(e),
                    "exp_avg_sq" => slot.1 = Some(e),
                    _ => {}
                }
            }
        }
        let pairs: Vec<(&IndexEntry, &IndexEntry)> = moments
            .values()
            .filter_map(|(a, b)| Some(((*a)?, (*b)?)))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let mut compared = 0usize;
        let mut nonzero = false;
        let mut keys = Vec::new();
        for (a, b) in &pairs {
            match same_first_chunk(index, source, a, b) {
                // One parameter whose moments differ: the state is what training writes.
                Some((false, _)) => return,
                Some((true, zero)) => {
                    compared += 1;
                    nonzero |= !zero;
                    keys.push(b.key.clone());
                }
                None => {}
            }
        }
        if compared == 0 || !nonzero {
            continue;
        }
        out.push(Finding {
            code: "optimizer-moments-equal",
            severity: Severity::Error,
            message: format!(
                "exp_avg equals exp_avg_sq bit for bit for every parameter compared ({compared} of {}): Adam's second moment is a copy of the first, which training never writes; torch writes it so for FSDP1 with use_orig_params=True when the full optimizer state dict is taken with offload_to_cpu=True (accelerate's FULL optimizer.bin), and a run resumed from it steps wrong",
                pairs.len()
            ),
            keys,
            fix: "save the optimizer state again with FullOptimStateDictConfig(offload_to_cpu=False) (or SHARDED_STATE_DICT), or resume with a fresh optimizer".into(),
        });
    }
}
