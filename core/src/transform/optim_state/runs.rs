//! The element runs of a rank's raw optimizer state tensors: which elements of which full
//! parameter each piece holds, so a writer can read them without building the state in memory.

use crate::layout::{Fsdp1Model, ParamRef};

/// A run of elements of a rank's raw optimizer state tensor, as [`local_optim_from_full`] lays
/// it out: elements `[start, start + len)` of parameter `fqn`'s flattened full state, or zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateRun {
    Param { fqn: String, start: u64, len: u64 },
    Zeros(u64),
}

/// The runs of a positive-dimension state of optimizer parameter `param` on `rank`, in the raw
/// `optim.state_dict()` that [`local_optim_from_full`] builds (`_flatten_optim_state` and
/// `_shard_orig_param_state`): a flat parameter's state is its parameters' flattened states
/// concatenated (zeros for a parameter `has_state` says has none), cut to the rank's `torch.chunk`
/// piece and right-padded with zeros; an original parameter's is its slice in the rank's shard
/// (none when it has no elements there); an unmanaged parameter's is all of it.
pub fn local_state_runs(
    model: &Fsdp1Model<'_>,
    param: &ParamRef,
    rank: u64,
    has_state: impl Fn(&str) -> bool,
) -> Vec<StateRun> {
    let numel = |shape: &[u64]| shape.iter().product::<u64>();
    match param {
        ParamRef::Flat(f) => {
            let flat = model.flat(*f);
            let mut runs = Vec::with_capacity(flat.fqns.len() + 1);
            let mut total = 0u64;
            for (i, fqn) in flat.fqns.iter().enumerate() {
                let n = flat.numels[i];
                runs.push((total, n, has_state(fqn).then_some(fqn)));
                total += n;
            }
            let ws = flat.ranks.len() as u64;
            let (lo, hi, padded) = if flat.padded_unsharded_numel.is_none() || ws == 1 {
                (0, total, total)
            } else {
                let (lo, hi) = crate::shape::chunk_range(total, ws, rank);
                (lo, hi, crate::shape::chunk_size(total, ws))
            };
            let mut out = Vec::new();
            for (at, n, fqn) in runs {
                let (a, b) = (at.max(lo), (at + n).min(hi));
                if a >= b {
                    continue;
                }
                out.push(match fqn {
                    Some(fqn) => StateRun::Param {
                        fqn: fqn.clone(),
                        start: a - at,
                        len: b - a,
                    },
                    None => StateRun::Zeros(b - a),
                });
            }
            if padded > hi - lo {
                out.push(StateRun::Zeros(padded - (hi - lo)));
            }
            out
        }
        ParamRef::Orig { flat, index } => {
            let layout = model.flat(*flat);
            let fqn = layout.fqns[*index].clone();
            let info = layout
                .ranks
                .get(rank as usize)
                .and_then(|r| r.shard_param_infos.get(*index));
            match info.map(|i| (i.in_shard, i.intra_param_start_idx, i.intra_param_end_idx)) {
                Some((true, Some(_), Some(_))) if layout.padded_unsharded_numel.is_none() => {
                    let len = numel(&layout.shapes[*index]);
                    vec![StateRun::Param { fqn, start: 0, len }]
                }
                Some((true, Some(start), Some(end))) => vec![StateRun::Param {
                    fqn,
                    start,
                    len: end - start + 1,
                }],
                _ => Vec::new(),
            }
        }
        ParamRef::Plain(fqn) => {
            let len = model
                .description
                .params
                .iter()
                .find(|p| &p.fqn == fqn)
                .map_or(0, |p| numel(&p.shape));
            vec![StateRun::Param {
                fqn: fqn.clone(),
                start: 0,
                len,
            }]
        }
    }
}
