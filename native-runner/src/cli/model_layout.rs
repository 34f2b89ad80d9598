//! `--model MODEL.json` and the FSDP1 layout flags, shared by the commands that read checkpoints
//! (`inspect`, `diff`, `verify`): with them an FSDP1 per-rank folder (LOCAL model files and/or raw
//! optimizer files) is read as the original parameters and FQN-keyed optimizer state
//! (`shardscope_core::view::fsdp1`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use shardscope_core::DType;
use shardscope_core::index::{CheckpointIndex, CheckpointKind, Role};
use shardscope_core::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_core::view::fsdp1;

#[derive(Debug, Clone, Args)]
pub struct ModelLayoutArgs {
    /// Model description (as for `shardscope layout`): read FSDP1 per-rank files (LOCAL model
    /// state dicts, raw optimizer state dicts) as the original parameters and FQN-keyed optimizer
    /// state, as torch's FULL_STATE_DICT and FSDP.optim_state_dict name them.
    #[arg(long, value_name = "MODEL.json")]
    pub model: Option<PathBuf>,
    /// Number of ranks the checkpoint was written with (with --model; default: the number of
    /// rank files).
    #[arg(long, value_name = "N", requires = "model")]
    pub world_size: Option<u64>,
    /// FSDP1 `use_orig_params=True` (with --model).
    #[arg(long, requires = "model")]
    pub use_orig_params: bool,
    /// FSDP1 sharding strategy (with --model): full_shard, shard_grad_op, hybrid_shard, ...
    #[arg(long, default_value = "full_shard", value_parser = parse_strategy)]
    pub strategy: Strategy,
    /// Ranks per shard group for hybrid_shard (with --model).
    #[arg(long, value_name = "S", requires = "model")]
    pub shard_group_size: Option<u64>,
    /// Mixed-precision compute dtype (with --model; sets the alignment unit).
    #[arg(long, value_name = "DTYPE", value_parser = parse_dtype, requires = "model")]
    pub param_dtype: Option<DType>,
}

fn parse_strategy(s: &str) -> Result<Strategy, String> {
    s.parse().map_err(|e: layout::LayoutError| e.to_string())
}

pub(crate) fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
        .map_err(|e: shardscope_core::dtype::UnknownDType| e.to_string())
}

/// The number of ranks whose files `index` holds (highest rank + 1), or 1.
pub fn ranks_in(index: &CheckpointIndex) -> u64 {
    index
        .files
        .values()
        .filter_map(|f| f.rank)
        .max()
        .map_or(1, |r| u64::from(r) + 1)
}

/// True when `index` has pieces that only a layout can place (flat parameters, raw optimizer ids).
pub fn needs_layout(index: &CheckpointIndex) -> bool {
    matches!(
        index.kind,
        CheckpointKind::Fsdp1Local | CheckpointKind::RankLocal
    ) || index.entries.iter().any(|e| {
        e.flat_param
            || matches!(
                &e.role,
                Some(Role::OptimizerState {
                    param: shardscope_core::index::PathSeg::Index(_),
                    ..
                })
            )
    })
}

/// True when the optimizer state holds rank-local pieces with no global shape under integer ids
/// (FSDP1 flat parameters next to DTensor model files: FSDP1 SHARDED_STATE_DICT with a device
/// mesh, as verl saves FSDP1): only the FSDP1 layout places them.
pub fn rank_local_optimizer_state(index: &CheckpointIndex) -> bool {
    use shardscope_core::index::{EntryKind, PathSeg};
    index.entries.iter().any(|e| {
        e.kind == EntryKind::Tensor
            && e.shape.is_none()
            && e.chunks.iter().any(|c| !c.sizes.is_empty())
            && matches!(
                &e.role,
                Some(Role::OptimizerState {
                    param: PathSeg::Index(_),
                    ..
                })
            )
    })
}

impl ModelLayoutArgs {
    /// The description and the FSDP1 layout for `world_size` ranks, or `None` without `--model`.
    pub fn layout(
        &self,
        world_size: u64,
    ) -> anyhow::Result<Option<(ModelDescription, Fsdp1Layout)>> {
        let Some(path) = &self.model else {
            return Ok(None);
        };
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read model description {}", path.display()))?;
        let model = ModelDescription::from_json_bytes(&bytes, &path.display().to_string())?;
        let config = LayoutConfig {
            api: Api::Fsdp1,
            world_size: self.world_size.unwrap_or(world_size),
            shard_group_size: self.shard_group_size,
            use_orig_params: self.use_orig_params,
            strategy: self.strategy,
            param_dtype: self.param_dtype,
        };
        match layout::compute(&model, &config)? {
            Layout::Fsdp1(l) => Ok(Some((model, l))),
            Layout::Fsdp2(_) => bail!("expected an FSDP1 layout"),
        }
    }

    /// `index` read through the layout when `--model` is given and it holds FSDP1 per-rank pieces;
    /// otherwise `index` itself. `label` names the checkpoint in errors.
    ///
    /// FSDP2 per-rank files need no layout: their raw optimizer state (integer ids) is keyed by
    /// FQN as `convert` keys it (`view::fsdp2`, the description helping when given), so that
    /// `inspect`, `verify` and `diff` show what torch's full optimizer state dict holds. When the
    /// ids cannot be named without `--model`, the index is kept as it is, with a note.
    pub fn apply(&self, index: CheckpointIndex, label: &str) -> anyhow::Result<CheckpointIndex> {
        if index.kind == CheckpointKind::Fsdp2 && !rank_local_optimizer_state(&index) {
            let desc = match &self.model {
                Some(path) => Some(shardscope_runner::fsdp1_local::read_description(path)?),
                None => None,
            };
            return match shardscope_core::view::fsdp2::fqn_keyed_optimizer(&index, desc.as_ref()) {
                Ok((view, _)) => Ok(view),
                Err(e) if desc.is_none() => {
                    eprintln!(
                        "note: {label}: the optimizer state stays keyed by integer ids ({e})\nhint: --model MODEL.json names them"
                    );
                    Ok(index)
                }
                Err(e) => Err(anyhow::Error::new(e)
                    .context(format!("{label}: cannot name the optimizer's parameters"))),
            };
        }
        if self.model.is_none() || !needs_layout(&index) {
            return Ok(index);
        }
        let Some((description, layout)) = self.layout(ranks_in(&index))? else {
            return Ok(index);
        };
        let view = fsdp1::original_params(&index, &description, &layout).with_context(|| {
            format!(
                "{label}: cannot read it through the FSDP1 layout of {} ({} ranks{})",
                self.model
                    .as_deref()
                    .unwrap_or_else(|| std::path::Path::new(""))
                    .display(),
                layout.world_size,
                if layout.use_orig_params {
                    ", use_orig_params"
                } else {
                    ""
                }
            )
        })?;
        let problems = view.check();
        if let Some(first) = problems.first() {
            bail!(
                "{label}: read through the FSDP1 layout of {}, its pieces do not cover the parameters ({} problems; first: {first})\nhint: check --use-orig-params, --world-size, --strategy and --param-dtype against how the model was wrapped",
                self.model
                    .as_deref()
                    .unwrap_or_else(|| std::path::Path::new(""))
                    .display(),
                problems.len()
            );
        }
        Ok(view)
    }
}
