//! FSDP layouts exactly as PyTorch computes them: FSDP1 flat parameters (alignment and world-size
//! padding, rank shards, `_shard_param_infos`) and FSDP2 per-parameter `Shard(0)` chunks, including
//! hybrid sharding (shard over groups of consecutive ranks, replicate across groups).

mod catalog;
pub mod fsdp1;
pub mod fsdp2;
pub mod key_plan;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::model::ModelDescription;

pub use catalog::{Fsdp1Model, ParamRef};
pub use fsdp1::{FlatParamLayout, Fsdp1Layout, RankShard, ShardParamInfo, SharedParam};
pub use fsdp2::{Fsdp2Layout, Fsdp2Param, Fsdp2RankShard, Fsdp2Unit};

/// Which FSDP implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `FullyShardedDataParallel` (flat parameters).
    #[default]
    Fsdp1,
    /// `fully_shard` (per-parameter DTensors).
    Fsdp2,
}

impl FromStr for Api {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "fsdp1" | "fsdp" => Ok(Api::Fsdp1),
            "fsdp2" | "fully_shard" => Ok(Api::Fsdp2),
            _ => Err(LayoutError::UnknownApi(s.to_owned())),
        }
    }
}

/// `torch.distributed.fsdp.ShardingStrategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    #[default]
    FullShard,
    ShardGradOp,
    NoShard,
    HybridShard,
    #[serde(rename = "_hybrid_shard_zero2")]
    HybridShardZero2,
}

impl Strategy {
    pub const fn name(self) -> &'static str {
        match self {
            Strategy::FullShard => "full_shard",
            Strategy::ShardGradOp => "shard_grad_op",
            Strategy::NoShard => "no_shard",
            Strategy::HybridShard => "hybrid_shard",
            Strategy::HybridShardZero2 => "_hybrid_shard_zero2",
        }
    }

    pub const fn is_hybrid(self) -> bool {
        matches!(self, Strategy::HybridShard | Strategy::HybridShardZero2)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let bare = lower.strip_prefix("shardingstrategy.").unwrap_or(&lower);
        match bare {
            "full_shard" => Ok(Strategy::FullShard),
            "shard_grad_op" => Ok(Strategy::ShardGradOp),
            "no_shard" => Ok(Strategy::NoShard),
            "hybrid_shard" => Ok(Strategy::HybridShard),
            "_hybrid_shard_zero2" | "hybrid_shard_zero2" => Ok(Strategy::HybridShardZero2),
            _ => Err(LayoutError::UnknownStrategy(s.to_owned())),
        }
    }
}

/// The FSDP configuration a layout is computed for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutConfig {
    pub api: Api,
    /// Number of ranks in the job.
    pub world_size: u64,
    /// Ranks per shard group (hybrid FSDP1 strategies and FSDP2 HSDP). `None` means the whole world.
    pub shard_group_size: Option<u64>,
    /// FSDP1 `use_orig_params` (alignment padding). Ignored by FSDP2.
    pub use_orig_params: bool,
    /// FSDP1 sharding strategy. For FSDP2 only `full_shard`/`shard_grad_op` (same layout) and
    /// `hybrid_shard` (HSDP) make sense.
    pub strategy: Strategy,
    /// Mixed-precision compute dtype (`MixedPrecision.param_dtype`); sets the alignment unit.
    pub param_dtype: Option<DType>,
}

impl Default for LayoutConfig {
    fn default() -> Self {
        Self {
            api: Api::Fsdp1,
            world_size: 1,
            shard_group_size: None,
            use_orig_params: false,
            strategy: Strategy::FullShard,
            param_dtype: None,
        }
    }
}

/// Why a layout cannot be computed. Messages use PyTorch's wording where PyTorch rejects the same thing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// `--api` is neither `fsdp1` nor `fsdp2`.
    #[error("unknown FSDP API `{0}` (expected fsdp1 or fsdp2)")]
    UnknownApi(String),
    /// `--strategy` is not a `ShardingStrategy` name.
    #[error(
        "unknown sharding strategy `{0}` (expected full_shard, shard_grad_op, no_shard or hybrid_shard)"
    )]
    UnknownStrategy(String),
    /// World size 0.
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    /// Shard-group size 0, larger than the world, or not a divisor of it.
    #[error(
        "shard group size {shard_group_size} does not divide world size {world_size} (hybrid sharding replicates whole groups of consecutive ranks)"
    )]
    BadShardGroupSize {
        world_size: u64,
        shard_group_size: u64,
    },
    /// A shard-group size was given for a strategy that shards over the whole world.
    #[error(
        "--shard-group-size {shard_group_size} only applies to hybrid_shard (FSDP1) or HSDP (FSDP2); {strategy} shards over all {world_size} ranks"
    )]
    ShardGroupWithoutHybrid {
        strategy: Strategy,
        world_size: u64,
        shard_group_size: u64,
    },
    /// A hybrid strategy without an explicit group size.
    #[error(
        "{strategy} needs --shard-group-size (ranks per shard group, e.g. GPUs per node); without an explicit 2-D mesh torch silently degrades on CPU"
    )]
    HybridWithoutGroupSize { strategy: Strategy },
    /// FSDP2 has no NO_SHARD strategy.
    #[error(
        "FSDP2 (fully_shard) has no no_shard strategy; use --api fsdp1 or a 1-rank shard group"
    )]
    Fsdp2NoShard,
    /// The two names of one tied weight are in different units (or one is outside every unit), in a
    /// configuration where torch gives no usable layout (FSDP1 `use_orig_params=True`: the forward
    /// fails; FSDP2 with one name unmanaged: the names silently stop being tied).
    #[error(
        "parameter `{alias}` is tied to `{primary}` but they belong to different FSDP units (`{alias_unit}` and `{primary_unit}`); FSDP requires tied weights to live in the same unit"
    )]
    SharedAcrossUnits {
        alias: String,
        primary: String,
        alias_unit: String,
        primary_unit: String,
    },
    /// FSDP2: two units manage the two names of one tied weight; torch raises this at lazy init.
    #[error(
        "parameter `{alias}` (unit `{alias_unit}`) is tied to `{primary}` (unit `{primary_unit}`): Parameter '{fqn}' is shared with a parameter already managed by another FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP group."
    )]
    Fsdp2SharedAcrossUnits {
        /// The name torch reports: the one in the unit that comes later in pre-order.
        fqn: String,
        alias: String,
        primary: String,
        alias_unit: String,
        primary_unit: String,
    },
    /// torch: "Cannot flatten integer dtype tensors".
    #[error(
        "unit `{unit}`: parameter `{fqn}` has dtype {dtype}: Cannot flatten integer dtype tensors"
    )]
    IntegerFlatten {
        unit: String,
        fqn: String,
        dtype: DType,
    },
    /// torch: "Must flatten tensors with uniform dtype but got ... and ...".
    #[error("unit `{unit}`: parameter `{fqn}`: Must flatten tensors with uniform dtype but got {} and {}", .expected.torch_name(), .found.torch_name())]
    MixedDTypes {
        unit: String,
        fqn: String,
        expected: DType,
        found: DType,
    },
    /// torch: "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`".
    #[error(
        "unit `{unit}`: parameter `{fqn}` (requires_grad={found}) after parameters with requires_grad={expected}: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`\nhint: FSDP1 wraps such a unit only with use_orig_params=True (--use-orig-params), or wrap the frozen parameters in a unit of their own; FSDP2 (--api fsdp2) has no such rule"
    )]
    MixedRequiresGrad {
        unit: String,
        fqn: String,
        expected: bool,
        found: bool,
    },
    /// FSDP2 cannot shard a 0-dim parameter (torch: "fully_shard doesn't support scalar parameters").
    #[error(
        "unit `{unit}`: parameter `{fqn}` is 0-dim: fully_shard doesn't support scalar parameters. Change {param_name} to a 1D tensor with numel equal to 1."
    )]
    ZeroDimShard {
        unit: String,
        fqn: String,
        /// The name inside its module, as torch prints it.
        param_name: String,
    },
    /// A count overflowed 64 bits.
    #[error("unit `{unit}`: element count overflows 64 bits")]
    Overflow { unit: String },
    /// The layout does not belong to the description ([`Fsdp1Model::new`]).
    #[error("layout and model description disagree: {reason}")]
    DescriptionMismatch { reason: String },
}

/// Either layout, as `shardscope layout --json` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Layout {
    Fsdp1(Fsdp1Layout),
    Fsdp2(Fsdp2Layout),
}

/// The validated process-group shape of a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Groups {
    pub world_size: u64,
    /// Ranks per shard group.
    pub shard_size: u64,
    /// The strategy after torch's own substitutions (1-rank shard groups force NO_SHARD).
    pub effective: Strategy,
}

impl LayoutConfig {
    pub(crate) fn groups(&self) -> Result<Groups, LayoutError> {
        if self.world_size == 0 {
            return Err(LayoutError::ZeroWorldSize);
        }
        if self.api == Api::Fsdp2 && self.strategy == Strategy::NoShard {
            return Err(LayoutError::Fsdp2NoShard);
        }
        let hybrid = self.strategy.is_hybrid()
            || (self.api == Api::Fsdp2
                && self.shard_group_size.is_some_and(|k| k != self.world_size));
        let shard_size = match (hybrid, self.shard_group_size) {
            (true, Some(k)) => {
                if k == 0 || k > self.world_size || !self.world_size.is_multiple_of(k) {
                    return Err(LayoutError::BadShardGroupSize {
                        world_size: self.world_size,
                        shard_group_size: k,
                    });
                }
                k
            }
            (true, None) => {
                return Err(LayoutError::HybridWithoutGroupSize {
                    strategy: self.strategy,
                });
            }
            (false, Some(k)) if k != self.world_size => {
                return Err(LayoutError::ShardGroupWithoutHybrid {
                    strategy: self.strategy,
                    world_size: self.world_size,
                    shard_group_size: k,
                });
            }
            (false, _) => self.world_size,
        };
        let effective = if self.api == Api::Fsdp1 && shard_size == 1 {
            Strategy::NoShard
        } else {
            self.strategy
        };
        Ok(Groups {
            world_size: self.world_size,
            shard_size,
            effective,
        })
    }
}

/// Computes the layout of `model` under `config`.
pub fn compute(model: &ModelDescription, config: &LayoutConfig) -> Result<Layout, LayoutError> {
    match config.api {
        Api::Fsdp1 => fsdp1::compute(model, config).map(Layout::Fsdp1),
        Api::Fsdp2 => fsdp2::compute(model, config).map(Layout::Fsdp2),
    }
}

/// What torch does when the names of one tied tensor fall in different units (or one name in a unit
/// and another outside every unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CrossUnitTies {
    /// FSDP1 with `use_orig_params=False`: torch silently unties the weight. Every unit flattens its
    /// own copy (the first of the tensor's names inside the unit is the real parameter); a name
    /// outside every unit keeps the original tensor and is unmanaged.
    Untie,
    /// FSDP1 with `use_orig_params=True`: torch builds the model but its forward fails; we refuse.
    Reject,
    /// FSDP2: torch's lazy initialisation raises when two units manage one tensor.
    Fsdp2,
}

/// Partition of a description's parameters into units, shared by both APIs.
#[derive(Debug)]
pub(crate) struct UnitAssignment<'a> {
    /// Units in FSDP pre-order (root first), each with its real (first-occurrence) parameters in
    /// registration order and its tied aliases.
    pub units: Vec<AssignedUnit<'a>>,
    /// Parameters no unit manages, in registration order.
    pub unmanaged: Vec<String>,
    /// Ignored parameters, in registration order.
    pub ignored: Vec<String>,
}

#[derive(Debug)]
pub(crate) struct AssignedUnit<'a> {
    pub prefix: &'a str,
    pub params: Vec<&'a crate::model::ParamSpec>,
    /// `(alias fqn, fqn of the unit's real parameter for that tensor)`.
    pub shared: Vec<(&'a str, &'a str)>,
}

#[allow(
    clippy::too_many_lines,
    reason = "unit assignment, FSDP pre-order and tied-alias resolution depend on one another's intermediate maps"
)]
pub(crate) fn assign_units(
    model: &ModelDescription,
    ties: CrossUnitTies,
) -> Result<UnitAssignment<'_>, LayoutError> {
    use std::collections::HashMap;

    let mut unit_index: HashMap<&str, usize> = HashMap::new();
    let mut order_key: Vec<(usize, usize)> = Vec::new();
    for (i, unit) in model.units.iter().enumerate() {
        unit_index.insert(unit.as_str(), i);
        // Pre-order position: the first parameter anywhere in the unit's subtree; an ancestor sorts
        // before its descendants when they share that parameter.
        let first = model
            .params
            .iter()
            .position(|p| crate::model::fqn::is_under(&p.fqn, unit))
            .unwrap_or(usize::MAX);
        let depth = if unit.is_empty() {
            0
        } else {
            unit.split('.').count()
        };
        order_key.push((first, depth));
    }
    let mut per_unit: Vec<AssignedUnit<'_>> = model
        .units
        .iter()
        .map(|u| AssignedUnit {
            prefix: u.as_str(),
            params: Vec::new(),
            shared: Vec::new(),
        })
        .collect();
    let mut unit_of_param: HashMap<&str, Option<&str>> = HashMap::new();
    // (unit, first name of the tensor in the description) -> the tensor's real name in that unit.
    let mut real_name: HashMap<(&str, &str), &str> = HashMap::new();
    let mut unmanaged = Vec::new();
    let mut ignored = Vec::new();
    for p in &model.params {
        if model.ignored.contains(&p.fqn) {
            ignored.push(p.fqn.clone());
            continue;
        }
        let unit = model.unit_of(&p.fqn);
        unit_of_param.insert(p.fqn.as_str(), unit);
        let Some(u) = unit else {
            unmanaged.push(p.fqn.clone());
            continue;
        };
        let Some(primary) = p.shared_with.as_deref() else {
            real_name.insert((u, p.fqn.as_str()), p.fqn.as_str());
            per_unit[unit_index[u]].params.push(p);
            continue;
        };
        if let Some(&real) = real_name.get(&(u, primary)) {
            // An earlier name of this tensor lives in the same unit: a shared parameter.
            per_unit[unit_index[u]].shared.push((p.fqn.as_str(), real));
            continue;
        }
        let primary_unit = unit_of_param.get(primary).copied().flatten();
        match (ties, primary_unit) {
            (CrossUnitTies::Untie, _) => {
                real_name.insert((u, primary), p.fqn.as_str());
                per_unit[unit_index[u]].params.push(p);
            }
            (CrossUnitTies::Fsdp2, Some(other)) => {
                // torch names the parameter of the unit that comes later in pre-order.
                let alias_later = order_key[unit_index[u]] > order_key[unit_index[other]];
                return Err(LayoutError::Fsdp2SharedAcrossUnits {
                    fqn: if alias_later {
                        p.fqn.clone()
                    } else {
                        primary.to_owned()
                    },
                    alias: p.fqn.clone(),
                    primary: primary.to_owned(),
                    alias_unit: u.to_owned(),
                    primary_unit: other.to_owned(),
                });
            }
            (CrossUnitTies::Reject | CrossUnitTies::Fsdp2, _) => {
                return Err(LayoutError::SharedAcrossUnits {
                    alias: p.fqn.clone(),
                    primary: primary.to_owned(),
                    alias_unit: u.to_owned(),
                    primary_unit: primary_unit.map_or_else(|| "(none)".to_owned(), str::to_owned),
                });
            }
        }
    }
    // A name outside every unit whose tensor a unit manages (the alias case above covers a unit
    // name after an unmanaged one; this covers an unmanaged name after a managed one).
    if ties != CrossUnitTies::Untie {
        for p in &model.params {
            let (Some(primary), Some(None)) =
                (p.shared_with.as_deref(), unit_of_param.get(p.fqn.as_str()))
            else {
                continue;
            };
            if let Some(Some(primary_unit)) = unit_of_param.get(primary) {
                return Err(LayoutError::SharedAcrossUnits {
                    alias: p.fqn.clone(),
                    primary: primary.to_owned(),
                    alias_unit: "(none)".to_owned(),
                    primary_unit: (*primary_unit).to_owned(),
                });
            }
        }
    }
    let mut order: Vec<usize> = (0..per_unit.len()).collect();
    order.sort_by_key(|&i| order_key[i]);
    let mut slots: Vec<Option<AssignedUnit<'_>>> = per_unit.into_iter().map(Some).collect();
    let units = order.into_iter().filter_map(|i| slots[i].take()).collect();
    Ok(UnitAssignment {
        units,
        unmanaged,
        ignored,
    })
}
