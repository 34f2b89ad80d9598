//! The padding of a DeepSpeed ZeRO checkpoint's fp32 flat partitions: the elements of each rank's
//! flat group that no parameter's plan ([`super::plan`]) places — the alignment padding after a
//! parameter (ZeRO-1/2 `param_alignment_paddings`, written with `parameter_alignment`), the group
//! padding at the end of the last rank's moments (ZeRO-1/2 `group_paddings`: DeepSpeed cuts it
//! off the fp32 partition on save, not off the wrapped optimizer's moments), ZeRO-3's padding of
//! each parameter's last part. The optimizer keeps the moments' padding zero; anything else there
//! means the file was changed or damaged after the save (ZeRO-3 leaves its fp32 padding
//! uninitialized: only named in a note). `verify` and `doctor` read these runs (a few elements
//! each) and name the ones that are not zero.

use std::ops::Range;

use crate::index::IndexError;
use crate::source::Source;

use super::records::{Flat, StateValue, bad};
use super::{StateDict, files, optimizer, read_model, read_optim, trainable};

/// A padding run that holds a byte other than zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonZeroPadding {
    pub rank: u32,
    pub file: String,
    /// The flat group's key in the file (`optimizer_state_dict.fp32_flat_groups.0`).
    pub key: String,
    pub group: usize,
    /// An optimizer moment (`exp_avg`, `exp_avg_sq`) rather than the fp32 weights.
    pub moment: bool,
    /// The run's elements in the flat group.
    pub elements: Range<u64>,
    /// The run's bytes in the file.
    pub bytes: Range<u64>,
    /// The file offset of its first byte that is not zero.
    pub first_nonzero: u64,
}

impl NonZeroPadding {
    /// `<file>: `<key>` (rank R, group G): its padding, elements a..b at bytes c..d, is not zero
    /// (first at byte e)`.
    pub fn describe(&self) -> String {
        format!(
            "{}: `{}` (rank {}, group {}): its padding, elements {}..{} at bytes {}..{}, is not zero (first at byte {})",
            self.file,
            self.key,
            self.rank,
            self.group,
            self.elements.start,
            self.elements.end,
            self.bytes.start,
            self.bytes.end,
            self.first_nonzero
        )
    }
}

/// What [`check_padding`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PaddingCheck {
    /// Padding runs read, and their bytes.
    pub runs: u64,
    pub bytes: u64,
    pub nonzero: Vec<NonZeroPadding>,
}

/// The element runs `[0, len)` leaves uncovered by `covered` (`(start, len)` runs, any order).
pub(super) fn gaps(len: u64, mut covered: Vec<(u64, u64)>) -> Vec<Range<u64>> {
    covered.sort_unstable();
    let mut out = Vec::new();
    let mut cursor = 0u64;
    for (at, n) in covered {
        if at > cursor {
            out.push(cursor..at.min(len));
        }
        cursor = cursor.max(at.saturating_add(n));
    }
    if cursor < len {
        out.push(cursor..len);
    }
    out.retain(|r| r.start < r.end);
    out
}

/// Where a flat tensor lies: its key in its file, its rank and group, whether it is a moment.
struct Place<'a> {
    key: &'a str,
    rank: usize,
    group: usize,
    moment: bool,
}

/// Reads the run `run` of the flat tensor `f` at `place` and records it.
fn read_run(
    source: &dyn Source,
    f: &Flat,
    place: &Place<'_>,
    run: &Range<u64>,
    out: &mut PaddingCheck,
) -> Result<(), IndexError> {
    let Place {
        key,
        rank,
        group,
        moment,
    } = *place;
    let size = f.dtype.size_bytes() as u64;
    let bytes = f
        .storage_offset
        .checked_add(run.start)
        .and_then(|e| e.checked_mul(size))
        .and_then(|b| Some(b..b.checked_add((run.end - run.start).checked_mul(size)?)?))
        .filter(|b| b.end <= f.range.len)
        .ok_or_else(|| {
            bad(
                &f.file,
                format!(
                    "`{key}`: its padding (elements {}..{}) lies outside its storage",
                    run.start, run.end
                ),
            )
        })?;
    let at = f.range.offset + bytes.start;
    let data = source.read_range(&f.file, at, bytes.end - bytes.start)?;
    out.runs += 1;
    out.bytes += data.len() as u64;
    if let Some(i) = data.iter().position(|b| *b != 0) {
        out.nonzero.push(NonZeroPadding {
            rank: u32::try_from(rank).unwrap_or(u32::MAX),
            file: f.file.to_string(),
            key: key.to_owned(),
            group,
            moment,
            elements: run.clone(),
            bytes: at..at + data.len() as u64,
            first_nonzero: at + i as u64,
        });
    }
    Ok(())
}

/// Reads the padding of every rank's fp32 flat groups and of the moments laid out like them of the DeepSpeed ZeRO checkpoint `names`
/// hold ([`super::looks_like_deepspeed`]).
pub fn check_padding(source: &dyn Source, names: &[String]) -> Result<PaddingCheck, IndexError> {
    let folder = files::locate(source, names)?;
    let save = files::save_files(&folder)?;
    let mut file_infos = std::collections::BTreeMap::new();
    let (optim, _) = read_optim(source, &folder, &save, &mut file_infos)?;
    let (stage, world_size) = (optim[0].stage, optim[0].partition_count);
    let (model, _, _) = read_model(source, &folder, &save, world_size, &mut file_infos)?;
    let plans = trainable(stage, &model[0], &optim, &mut StateDict::default())?;
    let (groups_key, base_key) = if stage <= 2 {
        (
            "optimizer_state_dict.single_partition_of_fp32_groups",
            "optimizer_state_dict.base_optimizer_state",
        )
    } else {
        (
            "optimizer_state_dict.fp32_flat_groups",
            "optimizer_state_dict.optimizer_state_dict",
        )
    };
    let ids: Vec<Option<i64>> = (0..optim[0].groups.len())
        .map(|g| {
            optim[0]
                .base
                .as_ref()
                .and_then(|b| optimizer::group_id(b, g))
        })
        .collect();
    let mut out = PaddingCheck::default();
    for (rank, o) in optim.iter().enumerate() {
        for (group, flat) in o.groups.iter().enumerate() {
            let covered: Vec<(u64, u64)> = plans
                .iter()
                .flat_map(|p| &p.pieces)
                .filter(|piece| piece.rank == rank && piece.slot == group)
                .map(|piece| (piece.at, piece.len))
                .collect();
            // ZeRO-1/2: a moment of the last ranks is longer than the fp32 partition by the
            // group padding DeepSpeed cut off the partition alone on save (`group_paddings`).
            let cut = o
                .group_paddings
                .as_ref()
                .and_then(|p| p.get(group))
                .copied()
                .unwrap_or(0);
            // The fp32 partition, then each moment laid out like it.
            let mut tensors = vec![(format!("{groups_key}.{group}"), flat, false)];
            let id = ids.get(group).copied().flatten();
            let state = o
                .base
                .as_ref()
                .zip(id)
                .and_then(|(b, id)| Some((id, optimizer::state_of(b, id)?)));
            if let Some((id, state)) = state {
                for (name, value) in state {
                    if let StateValue::Flat(f) = value
                        && (f.numel == flat.numel || Some(f.numel) == flat.numel.checked_add(cut))
                    {
                        tensors.push((format!("{base_key}.state.{id}.{name}"), f, true));
                    }
                }
            }
            for (key, f, moment) in &tensors {
                let place = Place {
                    key,
                    rank,
                    group,
                    moment: *moment,
                };
                for run in &gaps(f.numel, covered.clone()) {
                    read_run(source, f, &place, run, &mut out)?;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_are_what_no_run_covers() {
        assert_eq!(gaps(10, vec![(0, 4), (6, 3)]), vec![4..6, 9..10]);
        assert_eq!(gaps(10, vec![(2, 8)]), vec![0..2]);
        assert_eq!(gaps(4, vec![(0, 4)]), Vec::<Range<u64>>::new());
        assert_eq!(gaps(5, vec![]), vec![0..5]);
        // Overlapping and out-of-order runs.
        assert_eq!(gaps(12, vec![(5, 2), (0, 3), (1, 3)]), vec![4..5, 7..12]);
    }
}
