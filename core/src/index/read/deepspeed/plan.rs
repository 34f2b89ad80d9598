//! ZeRO's partition math, exactly as `deepspeed/utils/zero_to_fp32.py` (0.19) computes it: where
//! each element of each parameter lies in the ranks' fp32 flat groups. Pure arithmetic on element
//! counts: no file is touched, and the same plan places any state laid out like the flat groups
//! (the fp32 weights, and the optimizer's `exp_avg`/`exp_avg_sq` of each partition).
//!
//! - ZeRO-1/2 (`_zero2_merge_trainable_params`): group `g` of every rank is concatenated in rank
//!   order; the group's parameters follow each other in `param_shapes[g]` order, each followed by
//!   its `param_alignment_paddings[g][i]` when the file has them. At the end the consumed count and
//!   the group's length must agree once both are rounded up to `2 * world_size`.
//! - ZeRO-3 (`_zero3_merge_trainable_params`, `GatheredTensor`): every parameter is split into
//!   `ceil(numel / world_size)` elements per rank (the last rank's part padded); rank `r` holds
//!   part `r` at the same offset of its own flat space (its groups one after the other). The
//!   parameters' parts must fill every rank's groups exactly.
//! - ZeRO-3 frozen parameters (`_zero3_merge_frozen_params`): the ranks' fragments concatenated,
//!   the first `numel` elements.

use crate::index::{Chunk, ChunkEncoding};
use crate::shape;

use super::records::Flat;

/// A run of a parameter's elements (in its row-major order) that lies in one flat tensor:
/// elements `start..start + len` of the parameter are elements `at..at + len` of the flat tensor
/// `slot` of rank `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub rank: usize,
    pub slot: usize,
    pub at: u64,
    pub start: u64,
    pub len: u64,
}

/// One parameter and where its elements lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ParamPlan {
    pub name: String,
    pub shape: Vec<u64>,
    pub pieces: Vec<Piece>,
}

fn numel_of(name: &str, shape: &[u64]) -> Result<u64, String> {
    shape::numel(shape).ok_or_else(|| format!("`{name}`: the shape {shape:?} overflows"))
}

/// `align_to * ceil(x / align_to)`.
fn align_up(x: u64, align_to: u64) -> Option<u64> {
    x.div_ceil(align_to).checked_mul(align_to)
}

/// The pieces of the run `[start, end)` of a flat space made of consecutive tensors of lengths
/// `lens` (the tensors `slot0..` of `rank`), the run being the parameter's elements from `first`.
fn split_run(lens: &[u64], rank: usize, start: u64, end: u64, first: u64, out: &mut Vec<Piece>) {
    let mut base = 0u64;
    for (slot, &len) in lens.iter().enumerate() {
        let (lo, hi) = (start.max(base), end.min(base.saturating_add(len)));
        if lo < hi {
            out.push(Piece {
                rank,
                slot,
                at: lo - base,
                start: first + (lo - start),
                len: hi - lo,
            });
        }
        base = base.saturating_add(len);
    }
}

/// ZeRO-1/2: the plan of every trainable parameter. `shapes[g]`: group `g`'s parameters in order;
/// `lens[r][g]`: the length of rank `r`'s partition of group `g`; `paddings[g][i]`: the alignment
/// padding after parameter `i` of group `g`.
pub(super) fn zero12(
    shapes: &[Vec<(String, Vec<u64>)>],
    lens: &[Vec<u64>],
    paddings: Option<&[Vec<u64>]>,
) -> Result<Vec<ParamPlan>, String> {
    let world_size = lens.len() as u64;
    let groups = lens.first().map_or(0, Vec::len);
    if let Some((r, l)) = lens.iter().enumerate().find(|(_, l)| l.len() != groups) {
        return Err(format!(
            "rank {r} holds {} fp32 partitions, rank 0 holds {groups}",
            l.len()
        ));
    }
    if shapes.len() != groups {
        return Err(format!(
            "`param_shapes` lists {} parameter groups, the optimizer files hold {groups} fp32 partitions per rank",
            shapes.len()
        ));
    }
    if let Some(p) = paddings
        && p.len() != groups
    {
        return Err(format!(
            "`param_alignment_paddings` lists {} groups, the optimizer files hold {groups}",
            p.len()
        ));
    }
    let mut plans = Vec::new();
    for (g, params) in shapes.iter().enumerate() {
        let rank_lens: Vec<u64> = lens.iter().map(|l| l[g]).collect();
        let avail = rank_lens
            .iter()
            .try_fold(0u64, |a, &l| a.checked_add(l))
            .ok_or("the partitions' lengths overflow")?;
        let group_paddings = match paddings {
            Some(p) if p[g].len() != params.len() => {
                return Err(format!(
                    "Expected {} parameter alignment paddings for group {g}, but found {}",
                    params.len(),
                    p[g].len()
                ));
            }
            Some(p) => Some(&p[g]),
            None => None,
        };
        let mut offset = 0u64;
        for (i, (name, shape)) in params.iter().enumerate() {
            let numel = numel_of(name, shape)?;
            let end = offset
                .checked_add(numel)
                .filter(|&e| e <= avail)
                .ok_or_else(|| {
                    format!(
                        "`{name}` ({numel} elements from {offset}) lies past the end of fp32 group {g}, which the ranks' partitions make {avail} elements long"
                    )
                })?;
            let mut pieces = Vec::new();
            let mut base = 0u64;
            for (rank, &len) in rank_lens.iter().enumerate() {
                let (lo, hi) = (offset.max(base), end.min(base + len));
                if lo < hi {
                    pieces.push(Piece {
                        rank,
                        slot: g,
                        at: lo - base,
                        start: lo - offset,
                        len: hi - lo,
                    });
                }
                base += len;
            }
            plans.push(ParamPlan {
                name: name.clone(),
                shape: shape.clone(),
                pieces,
            });
            offset = end;
            if let Some(p) = group_paddings {
                offset = offset
                    .checked_add(p[i])
                    .ok_or("the alignment paddings overflow")?;
            }
        }
        let align_to = 2 * world_size;
        let (consumed, avail) = (align_up(offset, align_to), align_up(avail, align_to));
        if consumed.is_none() || consumed != avail {
            return Err(format!(
                "fp32 group {g}: consumed {} numels out of {} - something is wrong (zero_to_fp32's check, both rounded up to 2 * world_size = {align_to})",
                consumed.unwrap_or(u64::MAX),
                avail.unwrap_or(u64::MAX)
            ));
        }
    }
    Ok(plans)
}

/// ZeRO-3: the plan of every trainable parameter. `shapes`: the parameters in order (the groups'
/// `param_shapes` merged); `lens[r][g]`: the length of rank `r`'s flat group `g`.
pub(super) fn zero3(
    shapes: &[(String, Vec<u64>)],
    lens: &[Vec<u64>],
) -> Result<Vec<ParamPlan>, String> {
    let world_size = lens.len() as u64;
    let Some(first) = lens.first() else {
        return Err("no ranks".into());
    };
    if let Some((r, l)) = lens.iter().enumerate().find(|(_, l)| *l != first) {
        return Err(format!(
            "rank {r}'s fp32 flat groups hold {l:?} elements, rank 0's {first:?} (every rank holds an equal part of each parameter)"
        ));
    }
    let per_rank = first
        .iter()
        .try_fold(0u64, |a, &l| a.checked_add(l))
        .ok_or("the flat groups' lengths overflow")?;
    let mut offset = 0u64;
    let mut plans = Vec::new();
    for (name, shape) in shapes {
        let numel = numel_of(name, shape)?;
        let part = numel.div_ceil(world_size);
        let end = offset
            .checked_add(part)
            .filter(|&e| e <= per_rank)
            .ok_or_else(|| {
                format!(
                    "`{name}` ({part} elements per rank from {offset}) lies past the end of the ranks' flat groups ({per_rank} elements each)"
                )
            })?;
        let mut pieces = Vec::new();
        for rank in 0..lens.len() {
            let (lo, hi) = shape::chunk_range(numel, world_size, rank as u64);
            split_run(first, rank, offset, offset + (hi - lo), lo, &mut pieces);
        }
        plans.push(ParamPlan {
            name: name.clone(),
            shape: shape.clone(),
            pieces,
        });
        offset = end;
    }
    let consumed = offset.checked_mul(world_size);
    let avail = per_rank.checked_mul(world_size);
    if consumed.is_none() || consumed != avail {
        return Err(format!(
            "consumed {} numels out of {} - something is wrong (zero_to_fp32's check)",
            consumed.unwrap_or(u64::MAX),
            avail.unwrap_or(u64::MAX)
        ));
    }
    Ok(plans)
}

/// ZeRO-3 frozen parameter: the ranks' fragments (lengths `lens`, in rank order) concatenated, the
/// first `numel` elements; its pieces name the fragment of each rank as slot 0.
pub(super) fn zero3_frozen(name: &str, shape: &[u64], lens: &[u64]) -> Result<ParamPlan, String> {
    let numel = numel_of(name, shape)?;
    let mut pieces = Vec::new();
    let mut base = 0u64;
    for (rank, &len) in lens.iter().enumerate() {
        split_run(
            &[len],
            rank,
            0,
            len.min(numel.saturating_sub(base)),
            base,
            &mut pieces,
        );
        base = base.saturating_add(len);
    }
    if base < numel {
        return Err(format!(
            "`{name}` has {numel} elements, its fragments on the {} ranks {base}",
            lens.len()
        ));
    }
    Ok(ParamPlan {
        name: name.to_owned(),
        shape: shape.to_vec(),
        pieces,
    })
}

/// The chunks of a planned parameter over the flat tensors `flat(rank, slot)`: each piece is cut
/// into the boxes of its run of the parameter ([`shape::flat_range_boxes`]), each a strided view
/// of the flat tensor's storage.
pub(super) fn chunks<'a>(
    plan: &ParamPlan,
    flat: impl Fn(usize, usize) -> Option<&'a Flat>,
) -> Result<Vec<Chunk>, String> {
    let strides = shape::checked_contiguous_strides(&plan.shape)
        .ok_or_else(|| format!("`{}`: the shape {:?} overflows", plan.name, plan.shape))?;
    let mut out = Vec::new();
    for p in &plan.pieces {
        let f = flat(p.rank, p.slot).ok_or_else(|| {
            format!(
                "`{}`: rank {} has no flat tensor {}",
                plan.name, p.rank, p.slot
            )
        })?;
        let inside = p.at.checked_add(p.len).is_some_and(|e| e <= f.numel);
        if !inside {
            return Err(format!(
                "`{}`: elements {}..{} of a flat tensor of {} elements (rank {})",
                plan.name,
                p.at,
                p.at.saturating_add(p.len),
                f.numel,
                p.rank
            ));
        }
        let end = p.start + p.len;
        let boxes = shape::flat_range_boxes(&plan.shape, p.start, end).ok_or_else(|| {
            format!(
                "`{}`: elements {}..{end} lie outside its shape {:?}",
                plan.name, p.start, plan.shape
            )
        })?;
        for (offsets, sizes, first) in boxes {
            out.push(Chunk {
                offsets: offsets.into(),
                sizes: sizes.into(),
                file: f.file.clone(),
                byte_offset: f.range.offset,
                byte_length: f.range.len,
                rank: f.rank,
                encoding: ChunkEncoding::Raw {
                    // In range: `at + len <= numel` of a view checked against its storage.
                    storage_offset: f.storage_offset + p.at + (first - p.start),
                    strides: strides.clone(),
                },
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(list: &[(&str, &[u64])]) -> Vec<(String, Vec<u64>)> {
        list.iter()
            .map(|(n, s)| ((*n).to_owned(), s.to_vec()))
            .collect()
    }

    #[test]
    fn zero2_concatenates_the_ranks_partitions() {
        // 66 + 42 + 42 = 150 elements, rank 0 holds 76 (the group padded to 152), rank 1 74
        // (its padding removed on save): `b` straddles the ranks.
        let s = vec![shapes(&[("a", &[11, 6]), ("b", &[7, 6]), ("c", &[6, 7])])];
        let plans = zero12(&s, &[vec![76], vec![74]], None).unwrap();
        assert_eq!(
            plans[1].pieces,
            vec![
                Piece {
                    rank: 0,
                    slot: 0,
                    at: 66,
                    start: 0,
                    len: 10
                },
                Piece {
                    rank: 1,
                    slot: 0,
                    at: 0,
                    start: 10,
                    len: 32
                },
            ]
        );
        assert_eq!(
            plans[2].pieces,
            vec![Piece {
                rank: 1,
                slot: 0,
                at: 32,
                start: 0,
                len: 42
            }]
        );
        // zero_to_fp32's check: 150 and 152 agree rounded up to 4; 150 and 160 do not.
        let e = zero12(&s, &[vec![80], vec![80]], None).unwrap_err();
        assert!(e.contains("consumed 152 numels out of 160"), "{e}");
        // Alignment paddings move the next parameter.
        let plans = zero12(&s, &[vec![76], vec![76]], Some(&[vec![2, 0, 0]])).unwrap();
        assert_eq!(
            plans[1].pieces[0],
            Piece {
                rank: 0,
                slot: 0,
                at: 68,
                start: 0,
                len: 8
            }
        );
        let e = zero12(&s, &[vec![76], vec![76]], Some(&[vec![2]])).unwrap_err();
        assert!(e.contains("Expected 3 parameter alignment paddings"), "{e}");
        let e = zero12(&s, &[vec![40], vec![40]], None).unwrap_err();
        assert!(e.contains("past the end"), "{e}");
    }

    #[test]
    fn zero3_splits_every_parameter_across_ranks() {
        // ws 2: 7 -> 4 + 3 (1 padding), 66 -> 33 + 33; groups [4] and [33] per rank.
        let s = shapes(&[("bias", &[7]), ("w", &[11, 6])]);
        let plans = zero3(&s, &[vec![4, 33], vec![4, 33]]).unwrap();
        assert_eq!(
            plans[0].pieces,
            vec![
                Piece {
                    rank: 0,
                    slot: 0,
                    at: 0,
                    start: 0,
                    len: 4
                },
                Piece {
                    rank: 1,
                    slot: 0,
                    at: 0,
                    start: 4,
                    len: 3
                },
            ]
        );
        assert_eq!(
            plans[1].pieces,
            vec![
                Piece {
                    rank: 0,
                    slot: 1,
                    at: 0,
                    start: 0,
                    len: 33
                },
                Piece {
                    rank: 1,
                    slot: 1,
                    at: 0,
                    start: 33,
                    len: 33
                },
            ]
        );
        // One group holding both: a part that spans two groups is split at the boundary.
        let plans = zero3(&s, &[vec![6, 31], vec![6, 31]]).unwrap();
        assert_eq!(
            plans[1].pieces,
            vec![
                Piece {
                    rank: 0,
                    slot: 0,
                    at: 4,
                    start: 0,
                    len: 2
                },
                Piece {
                    rank: 0,
                    slot: 1,
                    at: 0,
                    start: 2,
                    len: 31
                },
                Piece {
                    rank: 1,
                    slot: 0,
                    at: 4,
                    start: 33,
                    len: 2
                },
                Piece {
                    rank: 1,
                    slot: 1,
                    at: 0,
                    start: 35,
                    len: 31
                },
            ]
        );
        let e = zero3(&s, &[vec![4, 34], vec![4, 34]]).unwrap_err();
        assert!(e.contains("consumed 74 numels out of 76"), "{e}");
        let e = zero3(&s, &[vec![4, 33], vec![4, 32]]).unwrap_err();
        assert!(e.contains("rank 1's fp32 flat groups"), "{e}");
        // A parameter smaller than the world: trailing ranks hold padding only.
        let plans = zero3(&shapes(&[("s", &[])]), &[vec![1], vec![1], vec![1]]).unwrap();
        assert_eq!(
            plans[0].pieces,
            vec![Piece {
                rank: 0,
                slot: 0,
                at: 0,
                start: 0,
                len: 1
            }]
        );
    }

    #[test]
    fn zero3_frozen_takes_the_first_numel_of_the_fragments() {
        let p = zero3_frozen("f", &[6, 7], &[21, 21]).unwrap();
        assert_eq!(p.pieces.len(), 2);
        assert_eq!(
            p.pieces[1],
            Piece {
                rank: 1,
                slot: 0,
                at: 0,
                start: 21,
                len: 21
            }
        );
        let p = zero3_frozen("f", &[7], &[4, 4]).unwrap();
        assert_eq!(
            p.pieces[1],
            Piece {
                rank: 1,
                slot: 0,
                at: 0,
                start: 4,
                len: 3
            }
        );
        assert!(zero3_frozen("f", &[9], &[4, 4]).is_err());
    }

    #[test]
    fn pieces_become_boxes_of_the_flat_storage() {
        let flat = Flat {
            file: "f".into(),
            rank: Some(0),
            range: crate::formats::torch_zip::MemberRange {
                offset: 64,
                len: 4 * 100,
            },
            storage_offset: 3,
            numel: 90,
            dtype: crate::dtype::DType::Float32,
        };
        let plan = ParamPlan {
            name: "w".into(),
            shape: vec![7, 6],
            pieces: vec![Piece {
                rank: 0,
                slot: 0,
                at: 66,
                start: 0,
                len: 10,
            }],
        };
        let c = chunks(&plan, |_, _| Some(&flat)).unwrap();
        // Row 0 whole, then row 1's first four elements.
        assert_eq!(c.len(), 2);
        assert_eq!(
            (c[0].offsets.to_vec(), c[0].sizes.to_vec()),
            (vec![0, 0], vec![1, 6])
        );
        assert_eq!(
            (c[1].offsets.to_vec(), c[1].sizes.to_vec()),
            (vec![1, 0], vec![1, 4])
        );
        let so = |c: &Chunk| match &c.encoding {
            ChunkEncoding::Raw { storage_offset, .. } => *storage_offset,
            _ => unreachable!(),
        };
        assert_eq!((so(&c[0]), so(&c[1])), (69, 75));
        let plan = ParamPlan {
            pieces: vec![Piece {
                rank: 0,
                slot: 0,
                at: 85,
                start: 0,
                len: 10,
            }],
            ..plan
        };
        assert!(chunks(&plan, |_, _| Some(&flat)).is_err());
    }
}
