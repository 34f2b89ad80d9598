//! Resharding FSDP1 LOCAL checkpoints between layouts: another world size, another wrapping, or
//! another `use_orig_params` value. Model state goes one destination flat parameter at a time
//! (peak memory: the parameters of one flat parameter); optimizer state goes through the full
//! (FQN-keyed) dict exactly as `optim_state_dict` followed by `optim_state_dict_to_load` would.
//!
//! [`full_key_plan`] and [`local_key_plan`] give the key order (and where each entry comes from) of
//! the FULL and LOCAL model state dicts from names alone, so a streaming writer can lay out a file
//! before reading any tensor (the native runner's per-rank `reshard`/`convert`).

use std::collections::HashMap;

use crate::model::tree::{Dict, Tensor};
use crate::transform::model_state::{flat_shard_from_full_params, full_param_from_flat_shards};
use crate::transform::optim_state::{full_optim_from_local, local_optim_from_full};
use crate::transform::{Fsdp1Model, TransformError};

/// A source of full parameters: FSDP-managed ones are rebuilt from the source flat shards
/// (`src_shards[flat index][rank]`), the others come from `plain` (e.g. the unmanaged entries of
/// the source LOCAL state dict).
#[derive(Debug)]
pub struct FullParamSource<'a, 's> {
    pub model: &'a Fsdp1Model<'a>,
    pub shards: &'s [Vec<&'s Tensor>],
    pub plain: &'s HashMap<String, Tensor>,
}

impl FullParamSource<'_, '_> {
    /// The full tensor of one parameter (clean FQN).
    pub fn full_param(&self, fqn: &str) -> Result<Tensor, TransformError> {
        match self.model.managed_position(fqn) {
            Some((f, i)) => {
                let shards = self
                    .shards
                    .get(f)
                    .ok_or_else(|| TransformError::MissingKey {
                        path: "source flat parameters".to_owned(),
                        key: self.model.flat(f).flat_param_fqn.clone(),
                    })?;
                full_param_from_flat_shards(self.model.flat(f), i, shards)
            }
            None => self
                .plain
                .get(fqn)
                .cloned()
                .ok_or_else(|| TransformError::MissingKey {
                    path: "source state dict".to_owned(),
                    key: fqn.to_owned(),
                }),
        }
    }
}

/// Rank `dst_rank`'s flat shards of every flat parameter of `dst`, built from `src`:
/// `(flat_param_fqn, shard)` in `dst` order. Padding segments get `fill`; `padded` selects the
/// stored length (with the zero right padding) or the LOCAL-state-dict length.
pub fn reshard_flat_params(
    src: &FullParamSource<'_, '_>,
    dst: &Fsdp1Model<'_>,
    dst_rank: u64,
    fill: f64,
    padded: bool,
) -> Result<Vec<(String, Tensor)>, TransformError> {
    let mut out = Vec::with_capacity(dst.layout.flat_params.len());
    for flat in &dst.layout.flat_params {
        let mut params: HashMap<&str, Tensor> = HashMap::with_capacity(flat.fqns.len());
        for name in &flat.fqns {
            params.insert(name.as_str(), src.full_param(name)?);
        }
        let shard = flat_shard_from_full_params(flat, dst_rank, |n| params.get(n), fill, padded)?;
        out.push((flat.flat_param_fqn.clone(), shard));
    }
    Ok(out)
}

/// Raw per-rank optimizer state (`optim.state_dict()`) of layout `src` converted to rank
/// `dst_rank` of layout `dst`: the offline `optim_state_dict` (FULL) + `optim_state_dict_to_load`.
pub fn reshard_local_optim(
    src: &Fsdp1Model<'_>,
    src_locals: &[&Dict],
    src_optim_params: &[Vec<String>],
    dst: &Fsdp1Model<'_>,
    dst_rank: u64,
    dst_optim_params: &[String],
) -> Result<Dict, TransformError> {
    let full = full_optim_from_local(src, src_locals, src_optim_params, 0, None)?;
    local_optim_from_full(dst, &full, dst_rank, dst_optim_params)
}

// ------------------------------------------------------------------------------------------------
// Key plans: the key order of the FULL and LOCAL model state dicts, computed from names only, so
// a streaming caller can lay out an output file before reading any tensor. They follow
// [`crate::transform::model_state::model_full_from_local`] and
// [`crate::transform::model_state::model_local_from_full`] exactly.

use std::collections::HashSet;

use crate::model::fqn;
use crate::transform::model_state::{depth, managed_aliases, module_order};

/// Where an entry of the FULL model state dict comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FullKey {
    /// Real parameter `param` of flat parameter `flat` (tied aliases point at their primary).
    Managed { flat: usize, param: usize },
    /// Copied from the first rank's LOCAL state dict under the same key (buffers, parameters FSDP
    /// does not manage).
    Plain,
}

/// The keys of `model_full_from_local(model, locals)`, in order, from the keys of `locals[0]`.
pub fn full_key_plan(
    model: &Fsdp1Model<'_>,
    first_local_keys: &[String],
) -> Vec<(String, FullKey)> {
    let aliases = managed_aliases(model);
    let mut values: HashMap<String, FullKey> = HashMap::new();
    for (f, flat) in model.layout.flat_params.iter().enumerate() {
        for (i, name) in flat.fqns.iter().enumerate() {
            values.insert(name.clone(), FullKey::Managed { flat: f, param: i });
        }
    }
    for (alias, primary) in &aliases {
        if let Some(v) = values.get(primary).cloned() {
            values.insert(alias.clone(), v);
        }
    }
    let flat_keys: HashSet<&str> = model
        .layout
        .flat_params
        .iter()
        .map(|f| f.flat_param_fqn.as_str())
        .collect();
    let param_names: HashSet<&str> = model
        .description
        .params
        .iter()
        .map(|p| p.fqn.as_str())
        .collect();
    let mut buffers: Vec<String> = Vec::new();
    for name in first_local_keys {
        if flat_keys.contains(name.as_str()) {
            continue;
        }
        if param_names.contains(name.as_str()) {
            values.entry(name.clone()).or_insert(FullKey::Plain);
        } else {
            values.insert(name.clone(), FullKey::Plain);
            buffers.push(name.clone());
        }
    }
    let mut out = Vec::new();
    for name in module_order(model, &aliases, &buffers) {
        if let Some(v) = values.remove(&name) {
            out.push((name, v));
        }
    }
    out
}

/// Where an entry of a LOCAL model state dict comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalKey {
    /// The `_flat_param` ShardedTensor of flat parameter `.0`.
    Flat(usize),
    /// `use_orig_params=True`: the 1-D view of real parameter `param` of `flat` in the rank's shard.
    View { flat: usize, param: usize },
    /// Copied from the FULL state dict entry of the same key.
    Plain,
}

/// The keys of `model_local_from_full(model, rank, full)`, in order, from the plan of `full`
/// ([`full_key_plan`]). The order does not depend on the rank.
pub fn local_key_plan(
    model: &Fsdp1Model<'_>,
    full: &[(String, FullKey)],
) -> Vec<(String, LocalKey)> {
    let aliases = managed_aliases(model);
    let flats = &model.layout.flat_params;
    let mut entries: Vec<(String, LocalKey)> = Vec::new();
    if model.use_orig_params() {
        for (name, _) in full {
            let primary = aliases.get(name).unwrap_or(name);
            match model.managed_position(primary) {
                Some((flat, param)) => entries.push((name.clone(), LocalKey::View { flat, param })),
                None => entries.push((name.clone(), LocalKey::Plain)),
            }
        }
        let mut order: Vec<usize> = (0..flats.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(depth(&flats[i].unit_prefix)));
        for i in order {
            let prefix = &flats[i].unit_prefix;
            let last = entries
                .iter()
                .rposition(|(k, _)| prefix.is_empty() || fqn::is_under(k, prefix));
            let at = last.map_or(entries.len(), |p| p + 1);
            entries.insert(at, (flats[i].flat_param_fqn.clone(), LocalKey::Flat(i)));
        }
    } else {
        let mut emitted: HashSet<usize> = HashSet::new();
        let mut outer_first: Vec<usize> = (0..flats.len()).collect();
        outer_first.sort_by_key(|&i| depth(&flats[i].unit_prefix));
        for (name, _) in full {
            for &i in &outer_first {
                let prefix = &flats[i].unit_prefix;
                if (prefix.is_empty() || fqn::is_under(name, prefix)) && emitted.insert(i) {
                    entries.push((flats[i].flat_param_fqn.clone(), LocalKey::Flat(i)));
                }
            }
            if model.managed_position(name).is_none() && !aliases.contains_key(name) {
                entries.push((name.clone(), LocalKey::Plain));
            }
        }
    }
    entries
}
