//! `shardscope reshard`: per-rank checkpoints (model state dicts + raw optimizer state dicts) from
//! one world size to another: FSDP1 LOCAL files ([`crate::convert::to_fsdp1`]) or FSDP2 DTensor
//! files on a 1-D or HSDP mesh ([`crate::convert::to_fsdp2`]), from FSDP1 or FSDP2 per-rank
//! folders or any checkpoint of full tensors.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use shardscope_core::layout::Fsdp1Model;
use shardscope_core::layout::{self, Strategy};
use shardscope_core::layout::{Api, Layout, LayoutConfig};
use shardscope_runner::fsdp1_local::{self, LayoutFlags};

use crate::convert::to_fsdp1::{Fsdp1Target, OutputFile, to_fsdp1_local};
use crate::convert::to_fsdp2::{Fsdp2Target, to_fsdp2_ranks};
use shardscope_core::checkpoint::{Checkpoint, ReadOptions};

use super::print_stdout;

#[derive(Debug, Args)]
pub struct ReshardCliArgs {
    /// Folder of per-rank files (e.g. model_rank0.pt, optim_rank0.pt, ...), written with
    /// torch.save from FSDP1 LOCAL_STATE_DICT model state dicts and optim.state_dict(), or FSDP2
    /// per-rank files (`rank{r}_model.pt` + `rank{r}_optim.pt`, DTensors, 1-D or HSDP mesh); or
    /// any checkpoint of full tensors (a `torch.save` or safetensors file of the FULL state dict,
    /// or `{"model": ..., "optim": FSDP.optim_state_dict(...)}`; a DCP directory). FSDP1 output
    /// is written as the input's file names (full tensors: `model_rank{r}.pt` +
    /// `optim_rank{r}.pt`), FSDP2 output as `rank{r}_model.pt` + `rank{r}_optim.pt`.
    pub src: PathBuf,
    /// Output folder (must not exist or be empty); it appears complete or not at all.
    #[arg(short = 'o', long = "output", value_name = "DST")]
    pub dst: PathBuf,
    /// Model description (JSON, the format of `shardscope layout --model`; `shardscope layout
    /// --from CKPT` derives one). Required: per-rank FSDP files follow the model's layout. (A DCP
    /// for another world size needs none: `shardscope convert CKPT -o OUT --world-size N`.)
    #[arg(long, value_name = "MODEL.json")]
    pub model: Option<PathBuf>,
    /// Number of ranks of the output.
    #[arg(long, value_name = "B")]
    pub to_world_size: usize,
    /// FSDP API of the output: `fsdp1` (LOCAL_STATE_DICT files) or `fsdp2` (DTensor files, as
    /// `model.state_dict()` / `optim.state_dict()` of `fully_shard` give them). Default: fsdp2 for
    /// a folder of FSDP2 files, fsdp1 otherwise.
    #[arg(long, value_enum, value_name = "API")]
    pub to_api: Option<ToApi>,
    /// FSDP2 output: the `mesh_dim_names` of the mesh the files will be loaded on, comma-separated
    /// (`dp`, or `replicate,shard` for HSDP); they must match it. Default: none for a 1-D mesh,
    /// `replicate,shard` for HSDP.
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub to_mesh_dim_names: Option<Vec<String>>,
    /// The checkpoint was written with FSDP1 `use_orig_params=True`.
    #[arg(long)]
    pub use_orig_params: bool,
    /// The output is for `use_orig_params=<BOOL>` (default: same as the input).
    #[arg(long, value_name = "BOOL")]
    pub to_use_orig_params: Option<bool>,
    /// FSDP1 sharding strategy of the input (and, unless --to-strategy, of the output):
    /// full_shard, shard_grad_op, no_shard, hybrid_shard, _hybrid_shard_zero2.
    #[arg(long, default_value = "full_shard", value_parser = super::read::parse_strategy)]
    pub strategy: Strategy,
    /// Hybrid strategies: ranks per shard group of the input. Ranks r and r+S hold the same shard
    /// (the mesh `init_device_mesh("cpu", (world_size // S, S))`); the first group is read.
    #[arg(long, value_name = "S")]
    pub shard_group_size: Option<u64>,
    /// FSDP1 mixed precision of the input: `MixedPrecision(param_dtype=DTYPE)` (with
    /// `use_orig_params`, the flat parameter's alignment is counted in elements of this dtype).
    #[arg(long, value_name = "DTYPE", value_parser = super::read::parse_dtype)]
    pub param_dtype: Option<shardscope_core::DType>,
    /// FSDP1 output: the `param_dtype` the output will be loaded with (default: --param-dtype).
    #[arg(long, value_name = "DTYPE", value_parser = super::read::parse_dtype)]
    pub to_param_dtype: Option<shardscope_core::DType>,
    /// Strategy of the output (default: --strategy).
    #[arg(long, value_parser = super::read::parse_strategy)]
    pub to_strategy: Option<Strategy>,
    /// Hybrid output: ranks per shard group of the output (default: --shard-group-size); every
    /// replica's ranks get their files. FSDP2: an HSDP mesh `(B / S, S)`, placements
    /// `(Replicate(), Shard(0))`.
    #[arg(long, value_name = "S")]
    pub to_shard_group_size: Option<u64>,
    /// File-name pattern of the model files, `{r}` for the rank (default: detected).
    #[arg(long, value_name = "PATTERN")]
    pub model_files: Option<String>,
    /// File-name pattern of the optimizer files, `{r}` for the rank (default: detected).
    #[arg(long, value_name = "PATTERN")]
    pub optim_files: Option<String>,
    /// Print a JSON summary instead of text.
    #[arg(long)]
    pub json: bool,
    /// No progress indicator on stderr.
    #[arg(long, short)]
    pub quiet: bool,
}

/// The FSDP API of `reshard`'s output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToApi {
    Fsdp1,
    Fsdp2,
}

#[allow(
    clippy::too_many_lines,
    reason = "the reshard command's steps in order: read, check, plan, write, report"
)]
pub fn run(args: &ReshardCliArgs) -> anyhow::Result<ExitCode> {
    if args.to_world_size == 0 {
        anyhow::bail!("--to-world-size must be at least 1");
    }
    let to_strategy = args.to_strategy.unwrap_or(args.strategy);
    let dst_flags = LayoutFlags {
        use_orig_params: args.to_use_orig_params.unwrap_or(args.use_orig_params),
        strategy: to_strategy,
        shard_group_size: if to_strategy.is_hybrid() {
            args.to_shard_group_size.or(args.shard_group_size)
        } else {
            args.to_shard_group_size
        },
    };
    let Some(model) = args.model.as_deref() else {
        anyhow::bail!(
            "reshard writes per-rank FSDP files, whose layout follows the model: it needs --model MODEL.json (`shardscope layout --from {src}` derives one)\nhint: to change the world size of a DCP checkpoint, no description is needed: shardscope convert {src} -o {dst} --world-size {n}",
            src = super::read::shown(&args.src),
            dst = args.dst.display(),
            n = args.to_world_size
        );
    };
    let desc = fsdp1_local::read_description(model)?;
    let full_source = is_full_checkpoint(&args.src);
    let (source, index, files, model_prefix, fsdp2_source) = if full_source {
        let (source, index, files, prefix) = open_full(args, &desc)?;
        (source, index, files, prefix, false)
    } else {
        open_per_rank(args, &desc)?
    };
    let to_api = args.to_api.unwrap_or(if fsdp2_source {
        ToApi::Fsdp2
    } else {
        ToApi::Fsdp1
    });
    if to_api == ToApi::Fsdp2 {
        return write_fsdp2(
            args,
            &desc,
            &source,
            &index,
            &files,
            &model_prefix,
            full_source,
        );
    }
    if args.to_mesh_dim_names.is_some() {
        anyhow::bail!("--to-mesh-dim-names applies to FSDP2 output (--to-api fsdp2)");
    }
    let config = LayoutConfig {
        api: Api::Fsdp1,
        world_size: args.to_world_size as u64,
        shard_group_size: dst_flags.shard_group_size,
        use_orig_params: dst_flags.use_orig_params,
        strategy: dst_flags.strategy,
        param_dtype: args.to_param_dtype.or(args.param_dtype),
    };
    let Layout::Fsdp1(dst_layout) = layout::compute(&desc, &config)? else {
        anyhow::bail!("expected an FSDP1 layout");
    };
    let dst = Fsdp1Model::new(&desc, &dst_layout)
        .map_err(|e| anyhow::anyhow!("destination layout: {e}"))?;
    let target = Fsdp1Target {
        model: &dst,
        full_files: to_strategy == Strategy::NoShard,
        model_pattern: &files.model_pattern,
        optim_pattern: files.optim_pattern.as_deref(),
    };
    // A spinner with the elapsed time on a terminal.
    let spinner =
        (!args.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr())).then(|| {
            let bar = indicatif::ProgressBar::new_spinner();
            if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            {
                bar.set_style(style);
            }
            bar.set_message(format!(
                "resharding {} to {} ranks",
                super::read::shown(&args.src),
                args.to_world_size
            ));
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            bar
        });
    let mut reader = crate::convert::Reader::new(&source, &index);
    let result = crate::atomic::write_dir(&args.dst, |tmp| {
        to_fsdp1_local(&mut reader, &model_prefix, &target, tmp)
    });
    if let Some(bar) = spinner {
        bar.finish_and_clear();
    }
    let outputs = result?;
    let from = if full_source {
        "full tensors".to_owned()
    } else {
        format!(
            "{} ranks, {}{}",
            files.world_size,
            files.model_pattern,
            files
                .optim_pattern
                .as_ref()
                .map_or(String::new(), |o| format!(" + {o}"))
        )
    };
    let text = format!(
        "resharded {} ({from}) to {} ranks: {} files in {}\n",
        super::read::shown(&args.src),
        args.to_world_size,
        outputs.len(),
        args.dst.display()
    );
    let extra = serde_json::json!({
        "model_files": files.model_pattern,
        "optim_files": files.optim_pattern,
    });
    print_summary(args, &files, full_source, &outputs, extra, &text)
}

/// Prints what was written: with `--json` the fields every output reports, then `extra`'s (an
/// object), then the files; `text` otherwise.
fn print_summary(
    args: &ReshardCliArgs,
    files: &fsdp1_local::RankFiles,
    full_source: bool,
    outputs: &[OutputFile],
    extra: serde_json::Value,
    text: &str,
) -> anyhow::Result<ExitCode> {
    if args.json {
        let mut summary = serde_json::json!({
            "source": super::read::shown(&args.src),
            "output": args.dst.display().to_string(),
            "from_world_size": (!full_source).then_some(files.world_size),
            "to_world_size": args.to_world_size,
        });
        if let (Some(summary), serde_json::Value::Object(extra)) = (summary.as_object_mut(), extra)
        {
            summary.extend(extra);
        }
        summary["files"] = outputs
            .iter()
            .map(|f| serde_json::json!({"name": f.name, "bytes": f.bytes}))
            .collect();
        print_stdout(&format!("{}\n", serde_json::to_string_pretty(&summary)?))?;
    } else {
        print_stdout(text)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes FSDP2 per-rank files for `--to-world-size` ranks.
fn write_fsdp2(
    args: &ReshardCliArgs,
    desc: &shardscope_core::model::ModelDescription,
    source: &crate::input::Input,
    index: &shardscope_core::index::CheckpointIndex,
    files: &fsdp1_local::RankFiles,
    model_prefix: &str,
    full_source: bool,
) -> anyhow::Result<ExitCode> {
    for (flag, given) in [
        ("--to-strategy", args.to_strategy.is_some()),
        ("--to-use-orig-params", args.to_use_orig_params.is_some()),
        ("--to-param-dtype", args.to_param_dtype.is_some()),
    ] {
        if given {
            anyhow::bail!(
                "{flag} describes FSDP1 output; FSDP2 output (--to-api fsdp2) takes --to-shard-group-size for HSDP"
            );
        }
    }
    let hsdp = args.to_shard_group_size;
    let names = args
        .to_mesh_dim_names
        .clone()
        .or_else(|| hsdp.map(|_| vec!["replicate".to_owned(), "shard".to_owned()]));
    let dims = if hsdp.is_some() { 2 } else { 1 };
    if let Some(names) = &names
        && names.len() != dims
    {
        anyhow::bail!(
            "--to-mesh-dim-names gives {} mesh dimension name(s) for a {dims}-D mesh ({})",
            names.len(),
            if dims == 2 {
                "HSDP: replicate, shard"
            } else {
                "FSDP2 without --to-shard-group-size"
            }
        );
    }
    let target = Fsdp2Target {
        desc,
        world_size: args.to_world_size as u64,
        shard_group_size: hsdp,
        mesh_dim_names: names,
        model_pattern: "rank{r}_model.pt",
        optim_pattern: files.optim_pattern.is_some().then_some("rank{r}_optim.pt"),
    };
    let mesh = target.mesh_shape()?;
    let mut reader = crate::convert::Reader::new(source, index);
    let outputs = crate::atomic::write_dir(&args.dst, |tmp| {
        to_fsdp2_ranks(&mut reader, model_prefix, &target, tmp)
    })?;
    let mesh_text = match mesh.as_slice() {
        [r, s] => format!("an HSDP mesh of {r} replicas x {s} shards"),
        _ => format!("a 1-D mesh of {} ranks", args.to_world_size),
    };
    let text = format!(
        "resharded {} to FSDP2 on {mesh_text}: {} files in {}\n",
        super::read::shown(&args.src),
        outputs.len(),
        args.dst.display()
    );
    let extra = serde_json::json!({
        "to_api": "fsdp2",
        "mesh": mesh,
        "mesh_dim_names": target.mesh_dim_names,
    });
    print_summary(args, files, full_source, &outputs, extra, &text)
}

/// Flags that describe an FSDP1 per-rank input, refused for other inputs (`what` says which).
fn refuse_fsdp1_input_flags(args: &ReshardCliArgs, what: &str) -> anyhow::Result<()> {
    for (flag, given) in [
        ("--model-files", args.model_files.is_some()),
        ("--optim-files", args.optim_files.is_some()),
        ("--use-orig-params", args.use_orig_params),
        ("--shard-group-size", args.shard_group_size.is_some()),
        ("--param-dtype", args.param_dtype.is_some()),
    ] {
        if given {
            anyhow::bail!(
                "{flag} describes a folder of FSDP1 per-rank files; {} is {what}",
                super::read::shown(&args.src)
            );
        }
    }
    Ok(())
}

/// A folder of per-rank files read as [`shardscope_core::checkpoint::Checkpoint`] reads it: FSDP2
/// files as `model` and FQN-keyed `optim` subtrees (extra state is not resharded: a note says
/// so), FSDP1 files through the source layout. Also says whether it holds FSDP2 files.
fn open_per_rank(
    args: &ReshardCliArgs,
    desc: &shardscope_core::model::ModelDescription,
) -> anyhow::Result<(
    crate::input::Input,
    shardscope_core::index::CheckpointIndex,
    fsdp1_local::RankFiles,
    String,
    bool,
)> {
    use shardscope_core::checkpoint::{Fsdp1Flags, View, ranks_in};
    use shardscope_core::index::{PathSeg, Role};
    let options = ReadOptions {
        description: Some((
            desc.clone(),
            args.model
                .as_deref()
                .map_or_else(String::new, |p| p.display().to_string()),
        )),
        fsdp1: Fsdp1Flags {
            world_size: None,
            use_orig_params: args.use_orig_params,
            strategy: args.strategy,
            shard_group_size: args.shard_group_size,
            param_dtype: args.param_dtype,
        },
        model_files: args.model_files.clone(),
        optim_files: args.optim_files.clone(),
        model_only: false,
    };
    let source = crate::input::open(std::slice::from_ref(&args.src), false)?;
    let label = super::read::shown(&args.src);
    let mut checkpoint = Checkpoint::open_stored(&source, &label, &options)?;
    super::read::ensure_unambiguous(&checkpoint)?;
    let world_size = ranks_in(&checkpoint.index) as usize;
    checkpoint.apply_view(&options)?;
    let quiet = args.quiet || args.json;
    super::read::show_notes(&checkpoint, quiet);
    let pattern = |class: &str| {
        checkpoint
            .sets
            .iter()
            .find(|s| s.class == class)
            .map(|s| s.pattern.clone())
    };
    let fsdp2 = matches!(checkpoint.view, View::Fsdp2 { .. });
    let mut index = checkpoint.index;
    if fsdp2 {
        for (flag, given) in [
            ("--use-orig-params", args.use_orig_params),
            ("--shard-group-size", args.shard_group_size.is_some()),
        ] {
            if given {
                anyhow::bail!(
                    "{flag} describes a folder of FSDP1 per-rank files; {label} is a folder of FSDP2 (DTensor) per-rank files"
                );
            }
        }
        if index.has_optimizer_state {
            let before = index.entries.len();
            index.entries.retain(
                |e| matches!(e.path.first(), Some(PathSeg::Key(k)) if k == "model" || k == "optim"),
            );
            if index.entries.len() < before && !quiet {
                eprintln!(
                    "note: {} entries outside `model` and `optim` (extra state) are not resharded",
                    before - index.entries.len()
                );
            }
        }
    }
    crate::convert::ensure_consistent(&args.src, &index)?;
    let states = index
        .entries
        .iter()
        .any(|e| matches!(e.role, Some(Role::OptimizerState { .. })));
    let prefix = if index
        .entries
        .iter()
        .any(|e| matches!(e.path.first(), Some(PathSeg::Key(k)) if k == "optim"))
    {
        "model."
    } else {
        ""
    };
    let names = if fsdp2 {
        fsdp1_local::RankFiles {
            dir: args.src.clone(),
            model_pattern: "model_rank{r}.pt".to_owned(),
            optim_pattern: states.then(|| "optim_rank{r}.pt".to_owned()),
            world_size,
        }
    } else {
        fsdp1_local::RankFiles {
            dir: args.src.clone(),
            model_pattern: pattern("model").unwrap_or_else(|| "model_rank{r}.pt".to_owned()),
            optim_pattern: pattern("optim"),
            world_size,
        }
    };
    Ok((source, index, names, prefix.to_owned(), fsdp2))
}

/// A source that is not a folder of per-rank files: a file, or a DCP directory.
fn is_full_checkpoint(src: &Path) -> bool {
    src.is_file() || src.join(".metadata").is_file()
}

type Opened = (
    crate::input::Input,
    shardscope_core::index::CheckpointIndex,
    fsdp1_local::RankFiles,
    String,
);

/// A checkpoint of full tensors: its model under `model.` or at the top (whichever holds the
/// description's parameters), its optimizer state when it has `FSDP.optim_state_dict`'s form.
fn open_full(
    args: &ReshardCliArgs,
    desc: &shardscope_core::model::ModelDescription,
) -> anyhow::Result<Opened> {
    use shardscope_core::index::Role;
    refuse_fsdp1_input_flags(args, "a checkpoint of full tensors")?;
    let (source, checkpoint) = super::read::open(
        std::slice::from_ref(&args.src),
        false,
        &ReadOptions::default(),
    )?;
    let mut index = checkpoint.index;
    // A DCP directory keeps non-tensor values (the optimizer's `param_groups`) as bytes items: the
    // per-rank files pickle them as values.
    index.decode_bytes_values(&source).with_context(|| {
        format!(
            "{}: cannot read its non-tensor values",
            super::read::shown(&args.src)
        )
    })?;
    crate::convert::ensure_consistent(&args.src, &index)?;
    if shardscope_core::checkpoint::needs_layout(&index) {
        anyhow::bail!(
            "{} holds rank-local pieces (flat parameters or raw optimizer state) but is not a folder of per-rank files\nhint: give the folder that holds every rank's files",
            super::read::shown(&args.src)
        );
    }
    let first = desc
        .params
        .first()
        .context("the model description has no parameters")?;
    let prefix = ["", "model."]
        .into_iter()
        .find(|p| index.entry(&format!("{p}{}", first.fqn)).is_some())
        .with_context(|| {
            format!(
                "{}: no `{}` (nor `model.{}`): it does not hold the model the description describes",
                super::read::shown(&args.src),
                first.fqn,
                first.fqn
            )
        })?;
    let states = index.entries.iter().any(|e| {
        matches!(
            &e.role,
            Some(Role::OptimizerState {
                param: shardscope_core::index::PathSeg::Key(_),
                ..
            })
        )
    });
    let groups = index
        .entries
        .iter()
        .any(|e| matches!(e.role, Some(Role::ParamGroup { .. })));
    if states && !groups {
        anyhow::bail!(
            "{}: the optimizer state has no `param_groups` list (as `FSDP.optim_state_dict` returns it), so the optimizer ids of the new ranks cannot be given\nhint: save the optimizer state with FSDP.optim_state_dict, or reshard the model alone",
            super::read::shown(&args.src)
        );
    }
    let names = fsdp1_local::RankFiles {
        dir: args.src.clone(),
        model_pattern: "model_rank{r}.pt".to_owned(),
        optim_pattern: states.then(|| "optim_rank{r}.pt".to_owned()),
        world_size: 1,
    };
    Ok((source, index, names, prefix.to_owned()))
}
