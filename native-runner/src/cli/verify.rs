//! `shardscope verify`: check one checkpoint against its own promises.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use shardscope_core::DType;
use shardscope_core::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::index;
use shardscope_core::verify::{self, Side, VerifyOptions};

use super::print_stdout;
use super::report_text::{Progress, render};

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// A checkpoint file, a DCP directory, a folder of per-rank or safetensors files, or several
    /// per-rank files of one checkpoint.
    #[arg(value_name = "CKPT", required = true)]
    pub paths: Vec<PathBuf>,
    /// Print the report as JSON (the schema the viewer's Verify panel reads).
    #[arg(long)]
    pub json: bool,
    /// Check the index only (tiling, byte ranges, replicas, optimizer keys) without decoding
    /// every chunk and item.
    #[arg(long)]
    pub shallow: bool,
    /// No progress on stderr.
    #[arg(long, short)]
    pub quiet: bool,
    /// Model description (as for `shardscope layout`): check an FSDP1 LOCAL_STATE_DICT's flat
    /// parameters (sizes, rank pieces, zero padding segments) against the FSDP1 layout.
    #[arg(long, value_name = "MODEL.json", requires = "world_size")]
    pub model: Option<PathBuf>,
    /// Number of ranks the checkpoint was written with (with --model).
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

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
        .map_err(|e: shardscope_core::dtype::UnknownDType| e.to_string())
}

fn fsdp1_layout(args: &VerifyArgs) -> anyhow::Result<Option<Fsdp1Layout>> {
    let (Some(path), Some(world_size)) = (&args.model, args.world_size) else {
        return Ok(None);
    };
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read model description {}", path.display()))?;
    let model = ModelDescription::from_json_bytes(&bytes, &path.display().to_string())?;
    let config = LayoutConfig {
        api: Api::Fsdp1,
        world_size,
        shard_group_size: args.shard_group_size,
        use_orig_params: args.use_orig_params,
        strategy: args.strategy,
        param_dtype: args.param_dtype,
    };
    match layout::compute(&model, &config)? {
        Layout::Fsdp1(l) => Ok(Some(l)),
        Layout::Fsdp2(_) => anyhow::bail!("expected an FSDP1 layout"),
    }
}

/// Runs `verify`: exit 0 when consistent, 1 when parts disagree, 2 when something cannot be read
/// or does not hold together.
pub fn run(args: &VerifyArgs) -> anyhow::Result<ExitCode> {
    let label = args
        .paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    let layout = fsdp1_layout(args)?;
    // Its own progress line: no second one for remote reads.
    let source = crate::input::open(&args.paths, false)?;
    let idx = index::index_source(&source).with_context(|| format!("cannot read {label}"))?;
    let mut progress = Progress::new(args.quiet, "verify");
    let report = verify::verify(
        Side {
            index: &idx,
            source: &source,
            label: &label,
        },
        VerifyOptions {
            read_values: !args.shallow,
            fsdp1_layout: layout.as_ref(),
        },
        &mut |done, total, key| progress.update(done, total, key),
    );
    if args.json {
        print_stdout(&report.to_json())?;
    } else {
        print_stdout(&render(&report))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}
