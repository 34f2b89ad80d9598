//! `shardscope gather`: replay FSDP's unshard path (load shards, copy-in, all-gather, copy-out) on
//! real or synthetic data, verify it and trace it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use shardscope_core::DType;
use shardscope_core::checkpoint::{Checkpoint, Fsdp1Flags};
use shardscope_core::index::from_index;
use shardscope_core::index::{CheckpointIndex, CheckpointKind};
use shardscope_core::layout::{self, Api, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_runner::gather::ckpt::{IndexFull, IndexLocal, Indexed};
use shardscope_runner::gather::source::{
    RankPrefixedSafetensors, SafetensorsFile, SyntheticSource,
};
use shardscope_runner::gather::{
    self, GatherOptions, GatherOutcome, GatherPlan, GatheredParam, Observer, Source, output,
};
use shardscope_runner::trace::{Clock, Span, names};

use super::print_stdout;
use crate::input::Input;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Every rank a thread of this process (no GPU needed).
    Cpu,
    /// One process per GPU under torchrun or srun: candle tensors and NCCL (build with `--features cuda`).
    /// Rank 0 hands out the NCCL id on port MASTER_PORT+1 (or SHARDSCOPE_RDZV_PORT).
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReadAs {
    /// Decide from the checkpoint: FSDP1 LOCAL and FSDP2 per-rank files are read as saved, a
    /// safetensors file with `rank<r>/...` keys too; anything else is full parameters.
    Auto,
    /// Full parameters: a full checkpoint, or a sharded one (FSDP1 SHARDED, FSDP2, DCP) assembled per
    /// parameter; every rank cuts its shards with the layout.
    Full,
    /// Rank-local tensors as saved: FSDP1 LOCAL `<unit>._flat_param` shards or FSDP2 DTensor local
    /// chunks, right-padded with zeros to the layout's shard size.
    Local,
    /// Rank-local tensors under `rank<r>/<flat_param_fqn or fqn>` in one safetensors file (the layout
    /// fixtures' convention).
    RankPrefixed,
}

#[derive(Debug, Args)]
pub struct GatherArgs {
    /// The checkpoint: a file (safetensors, `.pt`), a DCP directory, a folder of per-rank or sharded
    /// safetensors files, or several per-rank files of one checkpoint (`rank*_model.pt`).
    #[arg(value_name = "CKPT", required_unless_present = "synthetic", num_args = 1..)]
    pub checkpoint: Vec<PathBuf>,
    /// Generate deterministic data for the model instead of reading a checkpoint (needs --model).
    #[arg(long, conflicts_with = "checkpoint", requires = "model")]
    pub synthetic: bool,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 0, requires = "synthetic")]
    pub seed: u64,
    /// Model description (JSON). Without it, a full checkpoint is one root unit in file order.
    #[arg(long, value_name = "MODEL.json")]
    pub model: Option<PathBuf>,
    /// How to read CKPT's tensors (`layout --from` is another thing: a checkpoint to derive the
    /// model description from).
    #[arg(long, value_enum, default_value = "auto")]
    pub read_as: ReadAs,
    /// Parameters are stored under `PREFIX.` (e.g. `model` in a DCP app state; found automatically
    /// when the model's first parameter is under `model.`).
    #[arg(long, value_name = "PREFIX")]
    pub select: Option<String>,
    /// Number of ranks (inferred from rank-local checkpoints; default 1 otherwise).
    #[arg(long, value_name = "N")]
    pub world_size: Option<u64>,
    /// FSDP implementation: fsdp1 (flat parameters) or fsdp2 (fully_shard).
    #[arg(long, default_value = "fsdp1", value_parser = super::read::parse_api)]
    pub api: Api,
    /// FSDP1 `use_orig_params=True` (alignment and world-size padding).
    #[arg(long)]
    pub use_orig_params: bool,
    /// FSDP1 sharding strategy: full_shard, shard_grad_op, no_shard, hybrid_shard.
    #[arg(long, default_value = "full_shard", value_parser = super::read::parse_strategy)]
    pub strategy: Strategy,
    /// Ranks per shard group (hybrid_shard / HSDP).
    #[arg(long, value_name = "S")]
    pub shard_group_size: Option<u64>,
    /// Mixed-precision compute dtype (sets FSDP1's alignment unit).
    #[arg(long, value_name = "DTYPE", value_parser = super::read::parse_dtype)]
    pub param_dtype: Option<DType>,
    /// Where the copies and the all-gather run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: Backend,
    /// Write a Chrome trace (Perfetto, chrome://tracing) of every rank's steps.
    #[arg(long, value_name = "OUT.json")]
    pub trace: Option<PathBuf>,
    /// Compare every gathered parameter on every rank with the checkpoint, bit for bit (exit 1 if any
    /// differs).
    #[arg(long)]
    pub verify: bool,
    /// Write rank 0's gathered parameters (and tied aliases) as one safetensors file.
    #[arg(short = 'o', long = "output", value_name = "DST")]
    pub output: Option<PathBuf>,
    /// Print the summary (and verify report) as JSON.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// The per-rank sets of a folder to read (`{r}` patterns); default: every set found.
    #[command(flatten)]
    pub files: super::read::RankFileArgs,
}

fn read_model(path: &Path) -> anyhow::Result<ModelDescription> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read model description {}", path.display()))?;
    Ok(ModelDescription::from_json_bytes(
        &bytes,
        &path.display().to_string(),
    )?)
}

/// Largest `r` with keys `rank<r>/...`, plus one.
fn ranks_in<'a>(keys: impl Iterator<Item = &'a str>) -> Option<u64> {
    keys.filter_map(|k| {
        k.strip_prefix("rank")?
            .split_once('/')?
            .0
            .parse::<u64>()
            .ok()
    })
    .max()
    .map(|r| r + 1)
}

struct Prepared {
    model: ModelDescription,
    source: Source,
    world_size: u64,
    notes: Vec<String>,
}

/// A description from the checkpoint's own entries (stored order, one root unit).
fn derive_model(
    source: &Input,
    index: &CheckpointIndex,
    select: Option<&str>,
    name: &str,
    notes: &mut Vec<String>,
) -> anyhow::Result<ModelDescription> {
    let order = from_index::stored_key_order(source, index)
        .with_context(|| format!("cannot read {name}"))?;
    let no_units = |_: &str| false;
    let derived = from_index::description_from_index(
        index,
        &order,
        &from_index::FromIndexOptions {
            select,
            exclude: None,
            is_unit: &no_units,
            root_unit: true,
            tied: None,
        },
    )
    .with_context(|| {
        format!("{name}: no --model, and none can be derived from the checkpoint\nhint: pass --model MODEL.json (`shardscope layout --from CKPT --units REGEX --emit-model MODEL.json` writes one)")
    })?;
    let (model, choice) = from_index::uniform_dtype_units(&derived.model).map_err(|why| {
        anyhow::anyhow!("{name}: {why}\nhint: pass --model MODEL.json with units of one dtype each")
    })?;
    let units = match choice {
        from_index::UnitChoice::Uniform => "one root unit".to_owned(),
        from_index::UnitChoice::PerModule { units, dtypes } => format!(
            "{units} units, one per module that holds parameters (they have dtypes {}: an FSDP1 flat parameter holds one dtype)",
            dtypes.join(", ")
        ),
    };
    notes.push(format!(
        "no --model: {units} with the {} floating-point tensors of {name} in {} (torch flattens in registration order; buffers are included: pass --model to leave them out)",
        model.params.len(),
        if order.registration_order {
            "stored order"
        } else {
            "sorted key order"
        }
    ));
    Ok(model)
}

#[allow(
    clippy::too_many_lines,
    reason = "resolves every gather flag (source kind, model, layout, prefix) into one Prepared, in dependency order"
)]
fn prepare(args: &GatherArgs) -> anyhow::Result<Prepared> {
    let model = args.model.as_deref().map(read_model).transpose()?;
    let mut notes = Vec::new();
    if args.synthetic {
        let Some(model) = model else {
            bail!("--synthetic needs --model MODEL.json");
        };
        let source = Source::Full(Box::new(SyntheticSource::new(&model, args.seed)));
        return Ok(Prepared {
            model,
            source,
            world_size: args.world_size.unwrap_or(1),
            notes,
        });
    }
    let paths = &super::read::expand_ranks(&args.checkpoint, args.files.ranks)?;
    if paths.is_empty() {
        bail!("give a checkpoint, or --synthetic with --model");
    }
    let name = paths
        .iter()
        .map(|p| super::read::shown(p))
        .collect::<Vec<_>>()
        .join(", ");
    let single_safetensors = match paths.as_slice() {
        [p] => p.is_file() && p.extension().is_some_and(|e| e == "safetensors"),
        _ => false,
    };
    // Its own progress bar: no second one for remote reads. The pieces as stored: gather replays
    // FSDP's unshard on them, so no view is applied.
    let options = super::read::read_options(None, Fsdp1Flags::default(), &args.files)?;
    let files = crate::input::open(paths, false)?;
    let checkpoint = Checkpoint::open_stored(&files, &name, &options).with_context(|| {
        if single_safetensors {
            format!("{name}: not a valid safetensors file")
        } else {
            format!("cannot read {name}")
        }
    })?;
    notes.extend(checkpoint.notes);
    let index = checkpoint.index;
    let rank_count = if single_safetensors {
        ranks_in(index.entries.iter().map(|e| e.key.as_str()))
    } else {
        None
    };
    let local_kind = matches!(
        index.kind,
        CheckpointKind::Fsdp1Local | CheckpointKind::Fsdp2
    );
    let from = match args.read_as {
        ReadAs::Auto if rank_count.is_some() => ReadAs::RankPrefixed,
        ReadAs::Auto if local_kind => ReadAs::Local,
        ReadAs::Auto => ReadAs::Full,
        other => other,
    };
    if from == ReadAs::RankPrefixed {
        let ([path], true) = (paths.as_slice(), single_safetensors) else {
            bail!("{name}: --from rank-prefixed reads one safetensors file");
        };
        let Some(model) = model else {
            bail!(
                "{}: rank-local shards do not say which parameters they hold\nhint: pass --model MODEL.json",
                path.display()
            );
        };
        let world_size = args.world_size.unwrap_or(rank_count.unwrap_or(0));
        if world_size == 0 {
            bail!("{}: no `rank<r>/...` tensors found", path.display());
        }
        drop(files);
        let file = Arc::new(SafetensorsFile::read(path)?);
        return Ok(Prepared {
            model,
            source: Source::PerRank(Box::new(RankPrefixedSafetensors::new(file))),
            world_size,
            notes,
        });
    }
    // Which subtree holds the model (a DCP app state keeps it under `model`).
    let select = args.select.clone().or_else(|| {
        (model.is_none()
            && index.has_optimizer_state
            && index.entries.iter().any(|e| e.key.starts_with("model.")))
        .then(|| "model".to_owned())
    });
    let model = match model {
        Some(m) => m,
        None => derive_model(&files, &index, select.as_deref(), &name, &mut notes)?,
    };
    let prefix = match &select {
        Some(s) => format!("{s}."),
        None => Indexed::<Input>::find_prefix(&index, &model),
    };
    if !prefix.is_empty() {
        notes.push(format!(
            "parameters are read from `{prefix}<fqn>` in {name}"
        ));
    }
    let kind = index.kind;
    let ckpt = Arc::new(Indexed::new(name.clone(), files, index, prefix));
    if from == ReadAs::Local {
        match kind {
            CheckpointKind::Fsdp1Local if args.api != Api::Fsdp1 => {
                bail!("{name}: FSDP1 LOCAL flat-parameter shards gather only under --api fsdp1")
            }
            CheckpointKind::Fsdp2 if args.api != Api::Fsdp2 => bail!(
                "{name}: FSDP2 DTensor local shards follow FSDP2's layout\nhint: pass --api fsdp2 (or --read-as full to cut the assembled parameters with another layout)"
            ),
            CheckpointKind::Fsdp1Local | CheckpointKind::Fsdp2 => {}
            other => bail!(
                "{name}: {} holds no rank-local shards to read as saved\nhint: use --read-as full",
                other.describe()
            ),
        }
        let found = ckpt.ranks().last().map_or(0, |r| u64::from(*r) + 1);
        let world_size = args.world_size.unwrap_or(found);
        if world_size != found {
            bail!(
                "{name}: the files hold the shards of {found} ranks, --world-size says {world_size}"
            );
        }
        Ok(Prepared {
            model,
            source: Source::PerRank(Box::new(IndexLocal::new(ckpt))),
            world_size,
            notes,
        })
    } else {
        if kind == CheckpointKind::Fsdp1Local {
            bail!(
                "{name}: FSDP1 LOCAL flat-parameter shards hold no full parameters to cut\nhint: use --from local (or --from auto)"
            );
        }
        let full = IndexFull::for_model(ckpt, &model)?;
        Ok(Prepared {
            model,
            source: Source::Full(Box::new(full)),
            world_size: args.world_size.unwrap_or(1),
            notes,
        })
    }
}

/// Drives a progress bar from rank 0's unit completions.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Observer for Progress {
    fn unit_done(&self, rank: u64, _unit_index: usize) {
        if rank == 0
            && let Some(bar) = &self.bar
        {
            bar.inc(1);
        }
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "runs the chosen backend and then prints, writes the trace and the output in the order the user reads them"
)]
pub fn run(args: &GatherArgs) -> anyhow::Result<ExitCode> {
    let prepared = prepare(args)?;
    let config = LayoutConfig {
        api: args.api,
        world_size: prepared.world_size,
        shard_group_size: args.shard_group_size,
        use_orig_params: args.use_orig_params,
        strategy: args.strategy,
        param_dtype: args.param_dtype,
    };
    let layout = layout::compute(&prepared.model, &config)?;
    let plan = GatherPlan::from_layout(&layout)?;
    for note in &prepared.notes {
        eprintln!("note: {note}");
    }
    let options = GatherOptions {
        verify: args.verify,
        keep_params: args.output.is_some(),
    };
    let mut outcome = match args.backend {
        Backend::Cpu => {
            let show = !args.quiet && std::io::stderr().is_terminal() && !plan.units.is_empty();
            let progress = Progress {
                bar: show.then(|| {
                    let bar = indicatif::ProgressBar::new(plan.units.len() as u64);
                    if let Ok(style) = indicatif::ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} units {elapsed}",
                    ) {
                        bar.set_style(style);
                    }
                    bar
                }),
            };
            let outcome = gather::cpu::run(&plan, &prepared.source, options, &progress);
            if let Some(bar) = &progress.bar {
                bar.finish_and_clear();
            }
            outcome?
        }
        Backend::Cuda => {
            if let Some(note) = nccl_stdout_note(args.json, |k| std::env::var_os(k).is_some()) {
                eprintln!("{note}");
            }
            run_cuda(&plan, &prepared.source, options)?
        }
    };

    if !outcome.writes_outputs {
        // cuda ranks other than 0: rank 0 prints and writes for everyone.
        let failed = outcome.verify.as_ref().is_some_and(|v| !v.is_ok());
        return Ok(if failed {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    if let Some(out) = &args.output
        && let Some(mut params) = outcome.params.take()
    {
        add_unmanaged(&prepared, &plan, &mut params)?;
        write_output(out, &params, &mut outcome)?;
    }
    if let Some(trace_path) = &args.trace {
        outcome
            .trace
            .metadata
            .push(("api".to_owned(), outcome.summary.api.clone()));
        outcome
            .trace
            .metadata
            .push(("world_size".to_owned(), plan.world_size.to_string()));
        outcome
            .trace
            .write_chrome_json(trace_path)
            .with_context(|| "writing the trace")?;
        eprintln!(
            "trace: {} (open in https://ui.perfetto.dev or chrome://tracing)",
            trace_path.display()
        );
    }

    let verify_failed = outcome.verify.as_ref().is_some_and(|v| !v.is_ok());
    if args.json {
        let value = serde_json::json!({"summary": outcome.summary, "verify": outcome.verify});
        let mut text = serde_json::to_string_pretty(&value)?;
        text.push('\n');
        print_stdout(&text)?;
    } else {
        let mut text = outcome.summary.render();
        if let Some(v) = &outcome.verify {
            if v.is_ok() {
                let _ = writeln!(
                    text,
                    "verify: OK, {} parameter checks on {} ranks, {} compared bit for bit",
                    v.checks,
                    plan.world_size,
                    output::human_bytes(v.bytes_compared)
                );
            } else {
                let _ = writeln!(text, "verify: {} MISMATCHES", v.mismatches.len());
                for m in v.mismatches.iter().take(20) {
                    let _ = writeln!(
                        text,
                        "  rank {}: {}: {} elements differ, first at byte {}",
                        m.rank, m.fqn, m.elements, m.first_byte
                    );
                }
            }
            if !v.unchecked.is_empty() {
                let _ = writeln!(text, "verify: no reference for {}", v.unchecked.join(", "));
            }
        }
        print_stdout(&text)?;
    }
    Ok(if verify_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn add_unmanaged(
    prepared: &Prepared,
    plan: &GatherPlan,
    params: &mut BTreeMap<String, GatheredParam>,
) -> anyhow::Result<()> {
    if plan.unmanaged.is_empty() {
        return Ok(());
    }
    let Source::Full(full) = &prepared.source else {
        eprintln!(
            "note: {} parameters no FSDP unit manages are not in the output (rank-local source): {}",
            plan.unmanaged.len(),
            plan.unmanaged.join(", ")
        );
        return Ok(());
    };
    for fqn in &plan.unmanaged {
        let Some(spec) = prepared.model.params.iter().find(|p| &p.fqn == fqn) else {
            continue;
        };
        let primary = spec.shared_with.as_deref().unwrap_or(fqn);
        if let Some(p) = params.get(primary) {
            let p = p.clone();
            params.insert(fqn.clone(), p);
            continue;
        }
        let len = usize::try_from(spec.numel().saturating_mul(spec.dtype.size_bytes() as u64))
            .context("parameter too large for this machine")?;
        let mut bytes = vec![0u8; len];
        full.read_full(primary, 0, &mut bytes)?;
        params.insert(
            fqn.clone(),
            GatheredParam {
                dtype: spec.dtype,
                shape: spec.shape.clone(),
                bytes,
            },
        );
    }
    Ok(())
}

fn write_output(
    path: &Path,
    params: &BTreeMap<String, GatheredParam>,
    outcome: &mut GatherOutcome,
) -> anyhow::Result<()> {
    let origin = std::time::Instant::now();
    let bytes = output::safetensors_bytes(params, path)?;
    crate::atomic::write_file_replacing(path, |w| {
        std::io::Write::write_all(w, &bytes)
            .with_context(|| format!("cannot write {}", path.display()))
    })?;
    let dur = origin.elapsed().as_secs_f64() * 1e6;
    let start = outcome.summary.wall_secs * 1e6;
    outcome.trace.spans.push(Span {
        rank: 0,
        name: names::WRITE,
        clock: Clock::Host,
        start_us: start,
        dur_us: dur,
        unit: path.display().to_string(),
        bytes: bytes.len() as u64,
        dtype: "safetensors".to_owned(),
    });
    eprintln!(
        "wrote {} ({})",
        path.display(),
        output::human_bytes(bytes.len() as u64)
    );
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_cuda(
    plan: &GatherPlan,
    source: &Source,
    options: GatherOptions,
) -> anyhow::Result<GatherOutcome> {
    gather::cuda::run_from_env(plan, source, options).map_err(|e| {
        let message = e.to_string();
        match device_hint(&message) {
            Some(hint) => anyhow::anyhow!("{message}\nhint: {hint}"),
            None => e.into(),
        }
    })
}

/// With `NCCL_DEBUG` set, NCCL logs to stdout (its version line, at least) unless
/// `NCCL_DEBUG_FILE` says where: inside `--json` output, that breaks the JSON.
fn nccl_stdout_note(json: bool, is_set: impl Fn(&str) -> bool) -> Option<&'static str> {
    (json && is_set("NCCL_DEBUG") && !is_set("NCCL_DEBUG_FILE")).then_some(
        "note: NCCL_DEBUG is set, so NCCL writes its log to stdout, into the --json output\nhint: set NCCL_DEBUG_FILE=/dev/stderr (or a file) to keep stdout JSON only",
    )
}

/// What to do about a GPU error that the user, not the checkpoint, can fix.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn device_hint(message: &str) -> Option<&'static str> {
    // The driver compiles candle's PTX kernels at run time, and refuses PTX from a newer nvcc.
    message.contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION").then_some(
        "this shardscope's GPU kernels were built by a newer CUDA toolkit than this driver runs; rebuild it with the toolkit of the driver's CUDA version (`nvidia-smi` shows it), e.g. `CUDA_TOOLKIT_VERSION=13.0.2 native-runner/scripts/build-cuda.sh`",
    )
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _plan: &GatherPlan,
    _source: &Source,
    _options: GatherOptions,
) -> anyhow::Result<GatherOutcome> {
    bail!(
        "this shardscope was built without the `cuda` feature\nhint: build it with `cargo build --release -p shardscope-runner --features cuda` (needs the CUDA toolkit; see native-runner/scripts/build-cuda.sh), then launch one process per GPU with torchrun or srun"
    )
}

#[cfg(test)]
mod tests {
    use super::{device_hint, nccl_stdout_note};

    #[test]
    fn nccl_debug_on_stdout_is_noted_for_json_only() {
        let set = |names: &'static [&'static str]| move |k: &str| names.contains(&k);
        assert!(nccl_stdout_note(true, set(&["NCCL_DEBUG"])).is_some());
        assert!(nccl_stdout_note(true, set(&["NCCL_DEBUG", "NCCL_DEBUG_FILE"])).is_none());
        assert!(nccl_stdout_note(false, set(&["NCCL_DEBUG"])).is_none());
        assert!(nccl_stdout_note(true, set(&[])).is_none());
    }

    #[test]
    fn ptx_from_a_newer_toolkit_gets_a_rebuild_hint() {
        // The error candle gave on an H100 with driver 580 (CUDA 13.0) for kernels built by nvcc 13.2.
        let seen = r#"copy: DriverError(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "the provided PTX was compiled with an unsupported toolchain.")"#;
        assert!(device_hint(seen).is_some_and(|h| h.contains("CUDA_TOOLKIT_VERSION")));
        assert_eq!(
            device_hint("ncclAllGather: NcclError(ncclSystemError)"),
            None
        );
    }
}
