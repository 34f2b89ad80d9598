//! FSDP2 (`fully_shard`): every parameter becomes a DTensor sharded on dim 0 over the shard mesh
//! dimension (`Shard(0)`), replicated over the replicate dimension for HSDP.

use serde::Serialize;

use crate::dtype::DType;
use std::cmp::Ordering;
use std::collections::HashMap;

use crate::layout::{AssignedUnit, CrossUnitTies, LayoutConfig, LayoutError, assign_units};
use crate::model::{ModelDescription, ParamSpec};
use crate::shape;

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
    let assignment = assign_units(model, CrossUnitTies::Fsdp2)?;
    let position: HashMap<&str, usize> = model
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.fqn.as_str(), i))
        .collect();
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
        for p in group_order(unit, &position) {
            let Some((&dim0, rest)) = p.shape.split_first() else {
                return Err(LayoutError::ZeroDimShard {
                    unit: unit.prefix.to_owned(),
                    fqn: p.fqn.clone(),
                    param_name: p.fqn.rsplit('.').next().unwrap_or(&p.fqn).to_owned(),
                });
            };
            let mut padded = p.shape.clone();
            padded[0] = shape::chunk_size(dim0, n);
            let ranks = (0..n)
                .map(|rank| {
                    let (size, offset) = shape::shard_size_and_offset(dim0, n, rank);
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
            let padded_numel =
                crate::shape::numel(&padded).ok_or_else(|| LayoutError::Overflow {
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

/// The order of a unit's parameters in its `FSDPParamGroup`: torch collects the unit's modules in
/// DFS **post-order** (children in registration order, then the module itself) and takes each module's
/// own parameters, a tied tensor at the first of its names met in that walk. So a module's own
/// parameters come after those of its submodules (`block.weight` after `block.sub.bias`), unlike
/// FSDP1's flat parameter, which follows `named_parameters()` order.
fn group_order<'a>(unit: &AssignedUnit<'a>, position: &HashMap<&str, usize>) -> Vec<&'a ParamSpec> {
    // Every name of the unit with the index of its real parameter.
    let mut names: Vec<(&str, usize)> = unit
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.fqn.as_str(), i))
        .collect();
    for &(alias, real) in &unit.shared {
        if let Some(i) = unit.params.iter().position(|p| p.fqn == real) {
            names.push((alias, i));
        }
    }
    names.sort_by(|a, b| post_order_cmp(a.0, b.0, position));
    let mut taken = vec![false; unit.params.len()];
    let mut ordered = Vec::with_capacity(unit.params.len());
    for (_, i) in names {
        if !taken[i] {
            taken[i] = true;
            ordered.push(unit.params[i]);
        }
    }
    ordered
}

/// Compares two parameter names by the post-order position of their modules. `named_parameters()`
/// (the description order) is a pre-order walk, so the parameters of one subtree are contiguous in
/// it: two names compare by description order, except that a name in a submodule comes before a
/// name owned directly by one of that submodule's ancestors.
fn post_order_cmp(a: &str, b: &str, position: &HashMap<&str, usize>) -> Ordering {
    let module_a: Vec<&str> = a.split('.').collect();
    let module_b: Vec<&str> = b.split('.').collect();
    let module_a = &module_a[..module_a.len() - 1];
    let module_b = &module_b[..module_b.len() - 1];
    let common = module_a
        .iter()
        .zip(module_b)
        .take_while(|(x, y)| x == y)
        .count();
    let a_is_ancestor = common == module_a.len() && common < module_b.len();
    let b_is_ancestor = common == module_b.len() && common < module_a.len();
    if a_is_ancestor {
        Ordering::Greater
    } else if b_is_ancestor {
        Ordering::Less
    } else {
        position.get(a).cmp(&position.get(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Api;

    fn group_fqns(json: &str) -> Vec<Vec<String>> {
        let model = ModelDescription::from_json_bytes(json.as_bytes(), "model.json").unwrap();
        let config = LayoutConfig {
            api: Api::Fsdp2,
            world_size: 2,
            ..LayoutConfig::default()
        };
        compute(&model, &config)
            .unwrap()
            .units
            .iter()
            .map(|u| u.params.iter().map(|p| p.fqn.clone()).collect())
            .collect()
    }

    #[test]
    fn group_order_is_module_post_order() {
        // torch 2.15 (fixture fsdp2_nested_ws2): BlockB `block1` = weight, bias_module0 (own unit),
        // bias_module1 -> the group holds bias_module1.bias before block1.weight.
        let got = group_fqns(
            r#"{"params": [
                {"fqn": "block1.weight", "shape": [3, 7], "dtype": "float32"},
                {"fqn": "block1.bias_module0.bias", "shape": [7], "dtype": "float32"},
                {"fqn": "block1.bias_module1.bias", "shape": [7], "dtype": "float32"}],
              "units": ["block1.bias_module0", "block1"]}"#,
        );
        assert_eq!(
            got,
            [
                vec!["block1.bias_module1.bias", "block1.weight"],
                vec!["block1.bias_module0.bias"]
            ]
        );
    }

    #[test]
    fn a_tied_tensor_sits_where_post_order_first_meets_it() {
        // torch 2.15 (fixture fsdp2_mixed_ws2): the root's own parameters come last; the tied
        // tensor keeps its first name and the position of the first name met in post-order.
        let got = group_fqns(
            r#"{"params": [
                {"fqn": "scale", "shape": [2], "dtype": "float32"},
                {"fqn": "embed.weight", "shape": [7, 5], "dtype": "float32"},
                {"fqn": "head.weight", "shape": [7, 5], "dtype": "float32", "shared_with": "embed.weight"},
                {"fqn": "head.bias", "shape": [7], "dtype": "float32"}],
              "units": [""]}"#,
        );
        assert_eq!(got, [vec!["embed.weight", "head.bias", "scale"]]);
        // The alias is met first in post-order: the root owns `w`, child `sub` (registered before
        // child `a`) holds the alias. torch 2.15 gives the group [w, a.b] (checked with fully_shard
        // on this module tree); ignoring the alias would give [a.b, w].
        let got = group_fqns(
            r#"{"params": [
                {"fqn": "w", "shape": [4], "dtype": "float32"},
                {"fqn": "sub.w", "shape": [4], "dtype": "float32", "shared_with": "w"},
                {"fqn": "a.b", "shape": [3], "dtype": "float32"}],
              "units": [""]}"#,
        );
        assert_eq!(got, [vec!["w", "a.b"]]);
    }
}
