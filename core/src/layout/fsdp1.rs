//! FSDP1 flat parameters: which parameters each unit flattens, in which order, with which padding,
//! and which slice of the padded flat parameter every rank holds (`_shard_param_infos`).

use serde::Serialize;

use crate::dtype::DType;
use crate::layout::{CrossUnitTies, LayoutConfig, LayoutError, Strategy, assign_units};
use crate::model::{ModelDescription, ParamSpec, fqn};
use crate::shape;

/// FSDP's address alignment in bytes (`_FSDP_ALIGNMENT`... the flat parameter aligns every original
/// parameter to 16 bytes of the compute dtype when `use_orig_params=True`).
pub const ALIGNMENT_BYTES: u64 = 16;

/// The FSDP1 layout of a whole model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp1Layout {
    /// Always `"fsdp1"`.
    pub api: &'static str,
    pub world_size: u64,
    pub shard_group_size: u64,
    pub use_orig_params: bool,
    /// The strategy in effect (torch forces `no_shard` for 1-rank shard groups).
    pub strategy: Strategy,
    /// Flat parameters in FSDP pre-order, root first.
    pub flat_params: Vec<FlatParamLayout>,
    /// Parameters no FSDP unit manages (FQNs, registration order).
    pub unmanaged_params: Vec<String>,
    /// Parameters FSDP was told to ignore.
    pub ignored_params: Vec<String>,
    /// Units that manage no parameter (torch creates no flat parameter for them).
    pub units_without_params: Vec<String>,
    /// Things torch does silently that the user should know (e.g. forced `no_shard`).
    pub notes: Vec<String>,
}

/// One FSDP1 `FlatParameter` and every rank's shard of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlatParamLayout {
    pub unit_prefix: String,
    /// `<unit>._flat_param` (`_flat_param` for the root), the key of LOCAL state dicts.
    pub flat_param_fqn: String,
    pub dtype: DType,
    /// `requires_grad` of the flat parameter (the OR over its parameters).
    pub requires_grad: bool,
    /// Alignment unit in elements (`16 / itemsize(compute dtype)`), 0 without alignment.
    pub aligned_numel: u64,
    /// Full clean FQNs of the real parameters, in flat order.
    pub fqns: Vec<String>,
    pub shapes: Vec<Vec<u64>>,
    pub numels: Vec<u64>,
    /// Tied aliases: they take no space and are not in `fqns`.
    pub shared_params: Vec<SharedParam>,
    /// Segment sizes in flat order, padding segments included.
    pub numels_with_padding: Vec<u64>,
    pub is_padding_mask: Vec<bool>,
    /// `_unpadded_unsharded_size`: the flat parameter as built, padding segments included.
    pub unpadded_unsharded_numel: u64,
    /// `_padded_unsharded_size`: `sharded_numel * shard_group_size`; `None` for `no_shard`, where
    /// torch never sets it.
    pub padded_unsharded_numel: Option<u64>,
    /// `_sharded_size`: every rank's shard length including its right padding.
    pub sharded_numel: u64,
    /// One entry per rank of the shard group.
    pub ranks: Vec<RankShard>,
}

/// A tied alias inside a flat parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SharedParam {
    pub fqn: String,
    pub prim_fqn: String,
}

/// One rank's shard of a flat parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankShard {
    pub rank: u64,
    /// `_shard_numel_padded`: zeros appended to this rank's chunk.
    pub shard_numel_padded: u64,
    /// One entry per real parameter, in flat order.
    pub shard_param_infos: Vec<ShardParamInfo>,
}

/// `_ShardParamInfo`: where (part of) one parameter sits in a rank's shard. Indices are inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ShardParamInfo {
    pub in_shard: bool,
    pub offset_in_shard: Option<u64>,
    pub numel_in_shard: Option<u64>,
    pub intra_param_start_idx: Option<u64>,
    pub intra_param_end_idx: Option<u64>,
}

impl ShardParamInfo {
    const NOT_IN_SHARD: ShardParamInfo = ShardParamInfo {
        in_shard: false,
        offset_in_shard: None,
        numel_in_shard: None,
        intra_param_start_idx: None,
        intra_param_end_idx: None,
    };
}

impl FlatParamLayout {
    /// Start offset of every segment in the unsharded flat parameter (`_get_flat_param_offsets`).
    pub fn segment_starts(&self) -> Vec<u64> {
        let mut starts = Vec::with_capacity(self.numels_with_padding.len());
        let mut total = 0u64;
        for &n in &self.numels_with_padding {
            starts.push(total);
            total += n;
        }
        starts
    }

    /// Number of padding elements (alignment and world-size segments) in the unsharded flat parameter.
    pub fn padding_segment_numel(&self) -> u64 {
        self.numels_with_padding
            .iter()
            .zip(&self.is_padding_mask)
            .filter(|(_, pad)| **pad)
            .map(|(n, _)| *n)
            .sum()
    }

    /// Half-open range `[start, end)` of rank `rank`'s window in the padded unsharded flat parameter.
    /// For `no_shard` every rank's window is the whole flat parameter.
    pub fn rank_window(&self, rank: u64) -> (u64, u64) {
        if self.padded_unsharded_numel.is_none() {
            (0, self.unpadded_unsharded_numel)
        } else {
            let start = self.sharded_numel * rank;
            (start, start + self.sharded_numel)
        }
    }
}

fn compute_dtype_align(dtype: DType) -> u64 {
    (ALIGNMENT_BYTES / dtype.size_bytes() as u64).max(1)
}

/// Computes the FSDP1 layout.
pub fn compute(
    model: &ModelDescription,
    config: &LayoutConfig,
) -> Result<Fsdp1Layout, LayoutError> {
    let groups = config.groups()?;
    let ties = if config.use_orig_params {
        CrossUnitTies::Reject
    } else {
        CrossUnitTies::Untie
    };
    let assignment = assign_units(model, ties)?;
    let mut notes = Vec::new();
    if groups.effective != config.strategy {
        notes.push(format!(
            "{} with a shard group of 1 rank: torch uses no_shard instead",
            config.strategy
        ));
    }
    let no_shard = groups.effective == Strategy::NoShard;
    // The handle's process group: the shard group for sharded strategies, the whole world for NO_SHARD.
    let group_size = if no_shard && !config.strategy.is_hybrid() {
        groups.world_size
    } else {
        groups.shard_size
    };
    let mut flat_params = Vec::new();
    let mut units_without_params = Vec::new();
    for unit in &assignment.units {
        if unit.params.is_empty() {
            units_without_params.push(unit.prefix.to_owned());
            continue;
        }
        let flat = flat_param(
            unit.prefix,
            &unit.params,
            &unit.shared,
            config,
            group_size,
            no_shard,
        )?;
        flat_params.push(flat);
    }
    Ok(Fsdp1Layout {
        api: "fsdp1",
        world_size: groups.world_size,
        shard_group_size: groups.shard_size,
        use_orig_params: config.use_orig_params,
        strategy: groups.effective,
        flat_params,
        unmanaged_params: assignment.unmanaged,
        ignored_params: assignment.ignored,
        units_without_params,
        notes,
    })
}

fn validate(
    unit: &str,
    params: &[&ParamSpec],
    use_orig_params: bool,
) -> Result<(DType, bool), LayoutError> {
    let first = params[0];
    if !first.dtype.is_floating_point() {
        return Err(LayoutError::IntegerFlatten {
            unit: unit.to_owned(),
            fqn: first.fqn.clone(),
            dtype: first.dtype,
        });
    }
    let mut requires_grad = first.requires_grad;
    for p in &params[1..] {
        if p.dtype != first.dtype {
            return Err(LayoutError::MixedDTypes {
                unit: unit.to_owned(),
                fqn: p.fqn.clone(),
                expected: first.dtype,
                found: p.dtype,
            });
        }
        if !use_orig_params && p.requires_grad != first.requires_grad {
            return Err(LayoutError::MixedRequiresGrad {
                unit: unit.to_owned(),
                fqn: p.fqn.clone(),
                expected: first.requires_grad,
                found: p.requires_grad,
            });
        }
        requires_grad |= p.requires_grad;
    }
    Ok((first.dtype, requires_grad))
}

fn flat_param(
    prefix: &str,
    params: &[&ParamSpec],
    shared: &[(&str, &str)],
    config: &LayoutConfig,
    group_size: u64,
    no_shard: bool,
) -> Result<FlatParamLayout, LayoutError> {
    let overflow = || LayoutError::Overflow {
        unit: prefix.to_owned(),
    };
    let (dtype, requires_grad) = validate(prefix, params, config.use_orig_params)?;
    let aligned_numel = if config.use_orig_params {
        compute_dtype_align(config.param_dtype.unwrap_or(dtype))
    } else {
        0
    };

    let mut numels_with_padding = Vec::with_capacity(params.len() * 2 + 1);
    let mut is_padding_mask = Vec::with_capacity(params.len() * 2 + 1);
    let mut total = 0u64;
    for p in params {
        if aligned_numel > 0 {
            let pad = aligned_numel - total % aligned_numel;
            if pad > 0 && pad < aligned_numel {
                numels_with_padding.push(pad);
                is_padding_mask.push(true);
                total = total.checked_add(pad).ok_or_else(overflow)?;
            }
        }
        numels_with_padding.push(p.numel());
        is_padding_mask.push(false);
        total = total.checked_add(p.numel()).ok_or_else(overflow)?;
    }
    if aligned_numel > 0 {
        let pad = group_size - total % group_size;
        if pad > 0 && pad < group_size {
            numels_with_padding.push(pad);
            is_padding_mask.push(true);
            total = total.checked_add(pad).ok_or_else(overflow)?;
        }
    }

    let mut segments = Vec::with_capacity(params.len());
    let mut start = 0u64;
    for (&n, &pad) in numels_with_padding.iter().zip(&is_padding_mask) {
        if !pad {
            segments.push((start, n));
        }
        start += n;
    }

    let (sharded_numel, padded_unsharded_numel, ranks) = if no_shard {
        let infos: Vec<ShardParamInfo> = segments
            .iter()
            .map(|&(s, n)| window_info(s, n, 0, total.saturating_sub(1), total))
            .collect();
        let ranks = (0..group_size)
            .map(|rank| RankShard {
                rank,
                shard_numel_padded: 0,
                shard_param_infos: infos.clone(),
            })
            .collect();
        (total, None, ranks)
    } else {
        let c = shape::chunk_size(total, group_size);
        let padded = c.checked_mul(group_size).ok_or_else(overflow)?;
        let ranks = (0..group_size)
            .map(|rank| {
                let (lo, hi) = shape::chunk_range(total, group_size, rank);
                let window_start = c * rank;
                let window_end = window_start + c; // exclusive
                RankShard {
                    rank,
                    shard_numel_padded: c - (hi - lo),
                    shard_param_infos: segments
                        .iter()
                        .map(|&(s, n)| {
                            window_info(s, n, window_start, window_end.saturating_sub(1), c)
                        })
                        .collect(),
                }
            })
            .collect();
        (c, Some(padded), ranks)
    };

    Ok(FlatParamLayout {
        unit_prefix: prefix.to_owned(),
        flat_param_fqn: fqn::join(prefix, fqn::FLAT_PARAM),
        dtype,
        requires_grad,
        aligned_numel,
        fqns: params.iter().map(|p| p.fqn.clone()).collect(),
        shapes: params.iter().map(|p| p.shape.clone()).collect(),
        numels: params.iter().map(|p| p.numel()).collect(),
        shared_params: shared
            .iter()
            .map(|&(alias, prim)| SharedParam {
                fqn: alias.to_owned(),
                prim_fqn: prim.to_owned(),
            })
            .collect(),
        numels_with_padding,
        is_padding_mask,
        unpadded_unsharded_numel: total,
        padded_unsharded_numel,
        sharded_numel,
        ranks,
    })
}

/// `_get_shard_metadata` for one real segment `[seg_start, seg_start + numel - 1]` against the
/// inclusive window `[window_start, window_end]` of a shard of `shard_numel` elements.
fn window_info(
    seg_start: u64,
    numel: u64,
    window_start: u64,
    window_end: u64,
    shard_numel: u64,
) -> ShardParamInfo {
    if numel == 0 || shard_numel == 0 {
        return ShardParamInfo::NOT_IN_SHARD;
    }
    let seg_end = seg_start + numel - 1;
    let in_shard = window_start <= seg_end && window_end >= seg_start;
    if !in_shard {
        return ShardParamInfo::NOT_IN_SHARD;
    }
    let (intra_start, offset) = if window_start <= seg_start {
        (0, seg_start - window_start)
    } else {
        (window_start - seg_start, 0)
    };
    let intra_end = seg_end.min(window_end) - seg_start;
    ShardParamInfo {
        in_shard: true,
        offset_in_shard: Some(offset),
        numel_in_shard: Some(intra_end - intra_start + 1),
        intra_param_start_idx: Some(intra_start),
        intra_param_end_idx: Some(intra_end),
    }
}

/// What occupies a run of elements in a rank's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PieceKind {
    /// Elements `[intra_start, intra_start + len)` of real parameter `param` (index into `fqns`).
    Param { param: usize, intra_start: u64 },
    /// An alignment or world-size padding segment of the flat parameter (torch fills it with 42.0).
    SegmentPadding,
    /// Zeros appended to the rank's chunk (`_shard_numel_padded`).
    ShardTail,
}

/// A run of elements in a rank's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Piece {
    #[serde(flatten)]
    pub kind: PieceKind,
    pub offset_in_shard: u64,
    pub numel: u64,
}

impl FlatParamLayout {
    /// Everything rank `rank` holds, in shard order: parameter slices, padding segments and the
    /// zero tail. The pieces tile `[0, sharded_numel)` exactly.
    pub fn rank_pieces(&self, rank: u64) -> Vec<Piece> {
        let (window_start, window_end) = self.rank_window(rank);
        let mut pieces = Vec::new();
        let mut seg_start = 0u64;
        let mut param = 0usize;
        for (&n, &pad) in self.numels_with_padding.iter().zip(&self.is_padding_mask) {
            let seg_end = seg_start + n;
            let lo = seg_start.max(window_start);
            let hi = seg_end.min(window_end);
            if lo < hi {
                let kind = if pad {
                    PieceKind::SegmentPadding
                } else {
                    PieceKind::Param {
                        param,
                        intra_start: lo - seg_start,
                    }
                };
                pieces.push(Piece {
                    kind,
                    offset_in_shard: lo - window_start,
                    numel: hi - lo,
                });
            }
            if !pad {
                param += 1;
            }
            seg_start = seg_end;
        }
        let covered = seg_start.clamp(window_start, window_end) - window_start;
        let width = window_end - window_start;
        if covered < width {
            pieces.push(Piece {
                kind: PieceKind::ShardTail,
                offset_in_shard: covered,
                numel: width - covered,
            });
        }
        pieces
    }

    /// Real (non-padding) elements rank `rank` holds.
    pub fn rank_real_numel(&self, rank: u64) -> u64 {
        self.ranks.get(rank as usize).map_or(0, |r| {
            r.shard_param_infos
                .iter()
                .filter_map(|i| i.numel_in_shard)
                .sum()
        })
    }
}
