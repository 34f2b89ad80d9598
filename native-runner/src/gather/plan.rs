//! The gather plan: for every FSDP unit, what each rank's all-gather input holds and how the gathered
//! buffer splits back into the original parameters. Computed from core's layout, without any data.
//!
//! Everything is in bytes, so a unit whose parameters have different dtypes (FSDP2 then all-gathers a
//! `uint8` view) needs no special case.
//!
//! - FSDP1 (spec §1.5): a unit's all-gather input on group rank `r` is its padded flat shard
//!   (`C` elements: the chunk `[r*C, (r+1)*C)` of the flat parameter, alignment/world-size padding
//!   segments holding 42, right-padded with zeros). The output is `C * n` elements, and parameter `i` is
//!   the segment `[S_i, S_i + numel_i)` of it.
//! - FSDP2 (spec §4.2): a unit's all-gather input is the concatenation of every parameter's padded
//!   sharded buffer (`chunks[0].size()`, the real chunk followed by zeros) in group order. The output
//!   viewed as `(n, input_numel)` is split along dim 1 by the input sizes; parameter `j` is the first
//!   `numel_j` elements of its `(n, padded_j)` slice.

use shardscope_core::DType;
use shardscope_core::layout::fsdp1::PieceKind;
use shardscope_core::layout::{Api, FlatParamLayout, Fsdp2Unit, Layout};

/// Why a plan cannot be built from a layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A byte count does not fit in 64 bits (or in memory addresses on this machine).
    #[error("unit `{unit}`: byte count overflows")]
    Overflow {
        /// The unit prefix.
        unit: String,
    },
}

/// The whole gather: units in FSDP order, root first.
#[derive(Debug, Clone)]
pub struct GatherPlan {
    pub api: Api,
    /// Ranks in the job.
    pub world_size: u64,
    /// Ranks in one all-gather group: the shard group (consecutive ranks), 1 for `no_shard`.
    pub group_size: u64,
    pub units: Vec<UnitPlan>,
    /// Tied aliases `(alias, primary)`: not gathered separately, the alias is the primary tensor.
    pub aliases: Vec<(String, String)>,
    /// Parameters no unit manages (plain tensors on every rank, nothing to gather).
    pub unmanaged: Vec<String>,
}

/// One all-gather: an FSDP1 flat parameter or an FSDP2 parameter group.
#[derive(Debug, Clone)]
pub struct UnitPlan {
    /// Unit module prefix (`""` is the root).
    pub name: String,
    /// Element type of the all-gather, `None` when the group mixes dtypes (gathered as `uint8`).
    pub dtype: Option<DType>,
    /// Bytes of every rank's all-gather input.
    pub input_bytes: u64,
    /// The padded shards that make up the input, in input order (FSDP1: one flat shard).
    pub shards: Vec<ShardPlan>,
    /// The original parameters the output splits into, in unit order.
    pub params: Vec<ParamPlan>,
}

/// One padded shard buffer a rank holds: FSDP1's flat shard or one FSDP2 `_sharded_param_data`.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    /// Name of the rank-local tensor: the flat parameter FQN (`block1._flat_param`) or the FSDP2
    /// parameter FQN.
    pub key: String,
    pub dtype: DType,
    /// Byte offset of this shard inside the all-gather input.
    pub input_offset: u64,
    /// Bytes of the padded shard (the same on every rank).
    pub padded_bytes: u64,
    /// Per group rank: the pieces that tile the padded shard, cut from the full parameters.
    pub fills: Vec<Vec<Fill>>,
    /// Per group rank: bytes of real data (the local tensor torch stores; the rest is the zero tail).
    pub local_bytes: Vec<u64>,
}

/// A run of bytes of a padded shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fill {
    pub kind: FillKind,
    /// Byte offset in the padded shard.
    pub dst_offset: u64,
    pub len: u64,
}

/// What a run of a padded shard holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillKind {
    /// Bytes `[src_offset, src_offset + len)` of the unit's parameter `param` (index into `params`).
    Param { param: usize, src_offset: u64 },
    /// An FSDP1 alignment or world-size padding segment: torch fills it with 42.
    Padding,
    /// The zero tail of a shard (`_shard_numel_padded`, or FSDP2's padding up to `chunks[0]`).
    Zeros,
}

/// One original parameter of a unit.
#[derive(Debug, Clone)]
pub struct ParamPlan {
    pub fqn: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: u64,
    /// Copy-out: runs of the gathered output that form the parameter, in parameter order.
    pub copy_out: Vec<Copy>,
    /// The same parameter assembled from the rank shards through the shard metadata
    /// (`_shard_param_infos` for FSDP1, DTensor offsets for FSDP2): an independent path used to verify
    /// per-rank checkpoints.
    pub from_shards: Vec<ShardRef>,
}

/// A byte copy `src[src_offset..src_offset+len] -> dst[dst_offset..dst_offset+len]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// Where a run of a parameter lies in one rank's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRef {
    /// Rank inside the shard group.
    pub group_rank: u64,
    /// Index into the unit's `shards`.
    pub shard: usize,
    pub copy: Copy,
}

impl UnitPlan {
    /// Bytes of the all-gather output (nccl-tests' `S` for all-gather).
    pub fn output_bytes(&self, group_size: u64) -> u64 {
        self.input_bytes.saturating_mul(group_size)
    }

    /// Bytes of the unsharded parameters (without any padding).
    pub fn param_bytes(&self) -> u64 {
        self.params.iter().map(|p| p.bytes).sum()
    }

    /// Display name: the prefix, or `(root)`.
    pub(crate) fn display_name(&self) -> &str {
        if self.name.is_empty() {
            "(root)"
        } else {
            &self.name
        }
    }

    /// The dtype as shown in traces and summaries.
    pub(crate) fn dtype_label(&self) -> String {
        self.dtype
            .map_or_else(|| "uint8 (mixed)".to_owned(), |d| d.name().to_owned())
    }
}

/// The bytes torch writes into FSDP1 padding segments: `42` in the flat parameter's dtype.
/// fp8 values are 42 rounded to nearest-even (40).
pub(crate) fn padding_value_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Float32 => 42.0f32.to_le_bytes().to_vec(),
        DType::Float64 => 42.0f64.to_le_bytes().to_vec(),
        DType::Float16 => 0x5140u16.to_le_bytes().to_vec(),
        DType::BFloat16 => 0x4228u16.to_le_bytes().to_vec(),
        DType::Float8E4M3Fn => vec![0x62],
        DType::Float8E5M2 => vec![0x51],
        // FSDP1 refuses to flatten non-floating dtypes; fill like an integer 42 for completeness.
        other => {
            let mut v = vec![0u8; other.size_bytes()];
            v[0] = 42;
            v
        }
    }
}

fn mul(a: u64, b: u64, unit: &str) -> Result<u64, PlanError> {
    a.checked_mul(b).ok_or_else(|| PlanError::Overflow {
        unit: unit.to_owned(),
    })
}

impl GatherPlan {
    /// Builds the plan of a layout.
    pub fn from_layout(layout: &Layout) -> Result<Self, PlanError> {
        match layout {
            Layout::Fsdp1(l) => {
                let sharded = l
                    .flat_params
                    .iter()
                    .any(|f| f.padded_unsharded_numel.is_some());
                let group_size = if sharded { l.shard_group_size } else { 1 };
                let units = l
                    .flat_params
                    .iter()
                    .map(|f| fsdp1_unit(f, group_size))
                    .collect::<Result<Vec<_>, _>>()?;
                let aliases = l
                    .flat_params
                    .iter()
                    .flat_map(|f| f.shared_params.iter())
                    .map(|s| (s.fqn.clone(), s.prim_fqn.clone()))
                    .collect();
                Ok(Self {
                    api: Api::Fsdp1,
                    world_size: l.world_size,
                    group_size,
                    units,
                    aliases,
                    unmanaged: l.unmanaged_params.clone(),
                })
            }
            Layout::Fsdp2(l) => {
                let units = l
                    .units
                    .iter()
                    .map(|u| fsdp2_unit(u, l.shard_group_size))
                    .collect::<Result<Vec<_>, _>>()?;
                let aliases = l
                    .units
                    .iter()
                    .flat_map(|u| u.shared_params.iter())
                    .map(|s| (s.fqn.clone(), s.prim_fqn.clone()))
                    .collect();
                Ok(Self {
                    api: Api::Fsdp2,
                    world_size: l.world_size,
                    group_size: l.shard_group_size,
                    units,
                    aliases,
                    unmanaged: l.unmanaged_params.clone(),
                })
            }
        }
    }

    /// Total bytes of all unsharded parameters.
    pub fn param_bytes(&self) -> u64 {
        self.units.iter().map(UnitPlan::param_bytes).sum()
    }
}

fn fsdp1_unit(flat: &FlatParamLayout, group_size: u64) -> Result<UnitPlan, PlanError> {
    let unit = flat.unit_prefix.as_str();
    let es = flat.dtype.size_bytes() as u64;
    let shard_bytes = mul(flat.sharded_numel, es, unit)?;
    let starts = flat.segment_starts();
    // Byte offset of every real parameter in the unpadded flat parameter.
    let param_starts: Vec<u64> = starts
        .iter()
        .zip(&flat.is_padding_mask)
        .filter(|(_, pad)| !**pad)
        .map(|(s, _)| *s)
        .collect();
    let mut params = Vec::with_capacity(flat.fqns.len());
    for (i, fqn) in flat.fqns.iter().enumerate() {
        let bytes = mul(flat.numels[i], es, unit)?;
        let src_offset = mul(param_starts[i], es, unit)?;
        let mut from_shards = Vec::new();
        for (r, rank) in flat.ranks.iter().enumerate().take(group_size as usize) {
            let info = rank.shard_param_infos[i];
            if let (true, Some(offset), Some(numel), Some(intra)) = (
                info.in_shard,
                info.offset_in_shard,
                info.numel_in_shard,
                info.intra_param_start_idx,
            ) {
                from_shards.push(ShardRef {
                    group_rank: r as u64,
                    shard: 0,
                    copy: Copy {
                        src_offset: offset * es,
                        dst_offset: intra * es,
                        len: numel * es,
                    },
                });
            }
        }
        params.push(ParamPlan {
            fqn: fqn.clone(),
            dtype: flat.dtype,
            shape: flat.shapes[i].clone(),
            bytes,
            copy_out: if bytes == 0 {
                Vec::new()
            } else {
                vec![Copy {
                    src_offset,
                    dst_offset: 0,
                    len: bytes,
                }]
            },
            from_shards,
        });
    }
    let mut fills = Vec::with_capacity(group_size as usize);
    let mut local_bytes = Vec::with_capacity(group_size as usize);
    for r in 0..group_size {
        let pieces = flat.rank_pieces(r);
        let mut rank_fills = Vec::with_capacity(pieces.len());
        let mut real = 0u64;
        for p in pieces {
            let len = p.numel * es;
            let kind = match p.kind {
                PieceKind::Param { param, intra_start } => FillKind::Param {
                    param,
                    src_offset: intra_start * es,
                },
                PieceKind::SegmentPadding => FillKind::Padding,
                PieceKind::ShardTail => FillKind::Zeros,
            };
            if !matches!(kind, FillKind::Zeros) {
                real += len;
            }
            rank_fills.push(Fill {
                kind,
                dst_offset: p.offset_in_shard * es,
                len,
            });
        }
        fills.push(rank_fills);
        local_bytes.push(real);
    }
    Ok(UnitPlan {
        name: unit.to_owned(),
        dtype: Some(flat.dtype),
        input_bytes: shard_bytes,
        shards: vec![ShardPlan {
            key: flat.flat_param_fqn.clone(),
            dtype: flat.dtype,
            input_offset: 0,
            padded_bytes: shard_bytes,
            fills,
            local_bytes,
        }],
        params,
    })
}

#[allow(
    clippy::too_many_lines,
    reason = "both passes over a unit (shard offsets, then copy-in and copy-out pieces) share the per-parameter layout"
)]
fn fsdp2_unit(unit_layout: &Fsdp2Unit, group_size: u64) -> Result<UnitPlan, PlanError> {
    let unit = unit_layout.unit_prefix.as_str();
    let first_dtype = unit_layout.params.first().map(|p| p.dtype);
    let mixed = unit_layout
        .params
        .iter()
        .any(|p| Some(p.dtype) != first_dtype);
    let mut shards = Vec::with_capacity(unit_layout.params.len());
    let mut params = Vec::with_capacity(unit_layout.params.len());
    let mut input_offset = 0u64;
    // First pass: shard offsets in the input.
    for (j, p) in unit_layout.params.iter().enumerate() {
        let es = p.dtype.size_bytes() as u64;
        let row_numel: u64 = p.shape.iter().skip(1).product();
        let row_bytes = mul(row_numel, es, unit)?;
        let padded_bytes = mul(p.padded_sharded_numel(), es, unit)?;
        let numel: u64 = p.shape.iter().product();
        let bytes = mul(numel, es, unit)?;
        let mut fills = Vec::with_capacity(group_size as usize);
        let mut local_bytes = Vec::with_capacity(group_size as usize);
        let mut from_shards = Vec::new();
        for r in 0..group_size {
            let rank = &p.ranks[r as usize];
            let local = mul(rank.local_shape[0], row_bytes, unit)?;
            let src = mul(rank.global_offset[0], row_bytes, unit)?;
            let mut rank_fills = Vec::with_capacity(2);
            if local > 0 {
                rank_fills.push(Fill {
                    kind: FillKind::Param {
                        param: j,
                        src_offset: src,
                    },
                    dst_offset: 0,
                    len: local,
                });
                from_shards.push(ShardRef {
                    group_rank: r,
                    shard: j,
                    copy: Copy {
                        src_offset: 0,
                        dst_offset: src,
                        len: local,
                    },
                });
            }
            if local < padded_bytes {
                rank_fills.push(Fill {
                    kind: FillKind::Zeros,
                    dst_offset: local,
                    len: padded_bytes - local,
                });
            }
            fills.push(rank_fills);
            local_bytes.push(local);
        }
        // Copy-out: rank r's slot holds rows [r*padded_dim0, (r+1)*padded_dim0) of the padded
        // unsharded parameter; keep the part below the real size.
        let mut copy_out = Vec::with_capacity(group_size as usize);
        for r in 0..group_size {
            let dst = mul(r, padded_bytes, unit)?;
            if dst >= bytes {
                break;
            }
            copy_out.push(Copy {
                // Offset inside the rank's slot; the slot base is added once the input size is known.
                src_offset: input_offset,
                dst_offset: dst,
                len: padded_bytes.min(bytes - dst),
            });
        }
        shards.push(ShardPlan {
            key: p.fqn.clone(),
            dtype: p.dtype,
            input_offset,
            padded_bytes,
            fills,
            local_bytes,
        });
        params.push(ParamPlan {
            fqn: p.fqn.clone(),
            dtype: p.dtype,
            shape: p.shape.clone(),
            bytes,
            copy_out,
            from_shards,
        });
        input_offset =
            input_offset
                .checked_add(padded_bytes)
                .ok_or_else(|| PlanError::Overflow {
                    unit: unit.to_owned(),
                })?;
    }
    let input_bytes = input_offset;
    // The output is (n, input_bytes): rank r's slot starts at r * input_bytes.
    for p in &mut params {
        for (r, c) in p.copy_out.iter_mut().enumerate() {
            c.src_offset = mul(r as u64, input_bytes, unit)?
                .checked_add(c.src_offset)
                .ok_or_else(|| PlanError::Overflow {
                    unit: unit.to_owned(),
                })?;
        }
    }
    mul(input_bytes, group_size, unit)?;
    Ok(UnitPlan {
        name: unit.to_owned(),
        dtype: if mixed { None } else { first_dtype },
        input_bytes,
        shards,
        params,
    })
}
