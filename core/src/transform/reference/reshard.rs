//! Resharding FSDP1 LOCAL checkpoints between layouts: another world size, another wrapping, or
//! another `use_orig_params` value. Model state goes one destination flat parameter at a time
//! (peak memory: the parameters of one flat parameter); optimizer state goes through the full
//! (FQN-keyed) dict exactly as `optim_state_dict` followed by `optim_state_dict_to_load` would.
//!
//! The key order of the FULL and LOCAL model state dicts, from names alone, is
//! [`crate::layout::key_plan`]'s.

use std::collections::HashMap;

use crate::layout::Fsdp1Model;
use crate::model::tree::{Dict, Tensor};
use crate::transform::TransformError;
use crate::transform::optim_state::local_optim_from_full;
use crate::transform::reference::flat_shards::{
    flat_shard_from_full_params, full_param_from_flat_shards,
};
use crate::transform::reference::optim_state::full_optim_from_local;

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
