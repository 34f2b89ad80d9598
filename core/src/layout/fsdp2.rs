//! FSDP2 (`fully_shard`): every parameter becomes a DTensor sharded on dim 0 over the shard mesh
//! dimension (`Shard(0)`), replicated over the replicate dimension for HSDP.

use serde::Serialize;

use crate::dtype::DType;
use crate::layout::{LayoutConfig, LayoutError, assign_units, chunk};
use crate::model::ModelDescription;

/// The FSDP2 layout of a whole model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp2Layout {
    /// Always `"fsdp2"`.
    pub api: &'static str,
    pub world_size: u64,
    pub shard_group_size: u64,
    /// `[world_size / shard_group_size, shard_group_size]` for HSDP, `[world_size]` otherwise.
    pub mesh_shape: Vec<u64>,
    /// `fully_shard` units in pre-order, root first.
    pub units: Vec<Fsdp2Unit>,
    pub unmanaged_params: Vec<String>,
    pub ignored_params: Vec<String>,
    pub units_without_params: Vec<String>,
}

/// One `fully_shard` call: one `FSDPParamGroup`, the unit of all-gather.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp2Unit {
    pub unit_prefix: String,
    pub params: Vec<Fsdp2Param>,
    /// Tied aliases `(fqn, prim_fqn)`: one DTensor, two names.
    pub shared_params: Vec<crate::layout::SharedParam>,
    /// Elements each rank contributes to the unit's all-gather (sum of padded shard numels).
    pub all_gather_input_numel: u64,
}

/// One DTensor parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp2Param {
    pub fqn: String,
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub requires_grad: bool,
    /// `["Shard(0)"]`, or `["Replicate()", "Shard(0)"]` for HSDP.
    pub placements: Vec<String>,
    /// `chunks[0].size()`: the size every rank's padded all-gather input has.
    pub padded_sharded_shape: Vec<u64>,
    /// One entry per rank of the shard group.
    pub ranks: Vec<Fsdp2RankShard>,
}

/// One rank's local tensor of a DTensor parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp2RankShard {
    pub rank: u64,
    pub local_shape: Vec<u64>,
    pub global_offset: Vec<u64>,
}

impl Fsdp2Param {
    pub fn padded_sharded_numel(&self) -> u64 {
        self.padded_sharded_shape.iter().product()
    }
}

/// Computes the FSDP2 layout.
pub fn compute(
    model: &ModelDescription,
    config: &LayoutConfig,
) -> Result<Fsdp2Layout, LayoutError> {
    let groups = config.groups()?;
    let assignment = assign_units(model)?;
    let hsdp = groups.shard_size != groups.world_size;
    let placements: Vec<String> = if hsdp {
        vec!["Replicate()".to_owned(), "Shard(0)".to_owned()]
    } else {
        vec!["Shard(0)".to_owned()]
    };
    let n = groups.shard_size;
    let mut units = Vec::new();
    let mut units_without_params = Vec::new();
    for unit in &assignment.units {
        if unit.params.is_empty() {
            units_without_params.push(unit.prefix.to_owned());
            continue;
        }
        let mut params = Vec::with_capacity(unit.params.len());
        let mut all_gather_input_numel = 0u64;
        for p in &unit.params {
            let Some((&dim0, rest)) = p.shape.split_first() else {
                return Err(LayoutError::ZeroDimShard {
                    unit: unit.prefix.to_owned(),
                    fqn: p.fqn.clone(),
                });
            };
            let mut padded = p.shape.clone();
            padded[0] = chunk::chunk_size(dim0, n);
            let ranks = (0..n)
                .map(|rank| {
                    let (size, offset) = chunk::shard_size_and_offset(dim0, n, rank);
                    let mut local_shape = Vec::with_capacity(p.shape.len());
                    local_shape.push(size);
                    local_shape.extend_from_slice(rest);
                    let mut global_offset = vec![0; p.shape.len()];
                    global_offset[0] = offset;
                    Fsdp2RankShard {
                        rank,
                        local_shape,
                        global_offset,
                    }
                })
                .collect();
            let padded_numel = padded
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| LayoutError::Overflow {
                    unit: unit.prefix.to_owned(),
                })?;
            all_gather_input_numel = all_gather_input_numel
                .checked_add(padded_numel)
                .ok_or_else(|| LayoutError::Overflow {
                    unit: unit.prefix.to_owned(),
                })?;
            params.push(Fsdp2Param {
                fqn: p.fqn.clone(),
                shape: p.shape.clone(),
                dtype: p.dtype,
                requires_grad: p.requires_grad,
                placements: placements.clone(),
                padded_sharded_shape: padded,
                ranks,
            });
        }
        units.push(Fsdp2Unit {
            unit_prefix: unit.prefix.to_owned(),
            params,
            shared_params: unit
                .shared
                .iter()
                .map(|&(alias, prim)| crate::layout::SharedParam {
                    fqn: alias.to_owned(),
                    prim_fqn: prim.to_owned(),
                })
                .collect(),
            all_gather_input_numel,
        });
    }
    Ok(Fsdp2Layout {
        api: "fsdp2",
        world_size: groups.world_size,
        shard_group_size: n,
        mesh_shape: if hsdp {
            vec![groups.world_size / n, n]
        } else {
            vec![groups.world_size]
        },
        units,
        unmanaged_params: assignment.unmanaged,
        ignored_params: assignment.ignored,
        units_without_params,
    })
}
