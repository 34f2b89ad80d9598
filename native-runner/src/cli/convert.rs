//! `shardscope convert`: DCP or full checkpoints to safetensors, `torch.save` or DCP, streaming one
//! tensor at a time, written atomically. The engine is `crate::convert`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use shardscope_core::checkpoint::{
    Checkpoint, Fsdp1Flags, View, rank_local_optimizer_state, ranks_in,
};
use shardscope_core::index::{CheckpointIndex, CheckpointKind, PathSeg};
use shardscope_core::layout::Strategy;

use shardscope_runner::gather::output::human_bytes;

use super::print_stdout;
use crate::convert::{self, Progress, Reader, ShardApi};
use crate::input::Input;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// One `.safetensors` file, or HF shards with `--max-shard-size`.
    Safetensors,
    /// One `torch.save` file, nested as `dcp_to_torch_save` nests it.
    Torch,
    /// A DCP directory sharded for `--world-size` ranks.
    Dcp,
    /// A Hugging Face model directory (`config.json`, `model.safetensors` or shards with
    /// `model.safetensors.index.json`, `--hf-assets` files): the model part renamed and reshaped by
    /// the mapping `--config` and the stored names choose (see `--mapping`).
    Hf,
    /// torchtitan's names from a Hugging Face model (the way back of `--to hf`): a `.safetensors`
    /// file, or with `--world-size N` a DCP that torchtitan's `CheckpointManager` loads as a
    /// model-only checkpoint.
    Torchtitan,
}

#[derive(Debug, Clone, Args)]
pub struct ConvertArgs {
    /// The checkpoint to read: a DCP directory, a safetensors or `torch.save` file, or a folder of
    /// per-rank files. FSDP2 per-rank files with optimizer state (`rank{r}_model.pt` +
    /// `rank{r}_optim.pt`, or `rank{r}.pt` holding `{"model", "optim"}`) become `{"model": full
    /// state dict, "optim": full FQN-keyed optimizer state dict}` as torch's
    /// `get_model_state_dict`/`get_optimizer_state_dict(full_state_dict=True)` return them;
    /// optimizer id i is taken to be the i-th DTensor entry of the model state dict (the optimizer
    /// was built over `model.parameters()`), or see --model.
    #[arg(value_name = "SRC")]
    pub src: PathBuf,
    /// Where to write (a file; a directory for DCP, sharded safetensors and `--to hf`). Must not
    /// exist, or (directories) be empty.
    #[arg(short, long, value_name = "DST")]
    pub output: PathBuf,
    /// Output format; by default from DST's extension (`.safetensors`, `.pt`/`.pth`/`.bin`), or DCP
    /// when `--world-size` is given.
    #[arg(long, value_enum)]
    pub to: Option<Target>,
    /// Keep only keys under this prefix and strip it (`--select model` gives HF-ready FQNs).
    #[arg(long, value_name = "PREFIX")]
    pub select: Option<String>,
    /// safetensors: split into HF shards of at most this many bytes (`5GB`, `500MB`, `2GiB`, `1000`)
    /// in the directory DST, with `model.safetensors.index.json`.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_shard_size: Option<u64>,
    /// DCP: the number of ranks to shard for.
    #[arg(long, value_name = "N")]
    pub world_size: Option<usize>,
    /// DCP: chunk as FSDP1 `ShardedTensor` or FSDP2 `DTensor` (zero-size chunks on trailing ranks).
    #[arg(long, value_enum, default_value = "fsdp2")]
    pub api: ShardApi,
    /// DCP: nest every key under this one (`--nest model` for `dcp.load({"model": ...})`).
    #[arg(long, value_name = "KEY")]
    pub nest: Option<String>,
    /// A folder of per-rank FSDP1 LOCAL files: the model description that gives their layout.
    /// FSDP2 per-rank files: names the optimizer ids, id i being the i-th of its `params`
    /// (named_parameters order), or of those with `requires_grad` when the optimizer holds fewer.
    #[arg(long, value_name = "MODEL.json")]
    pub model: Option<PathBuf>,
    /// Per-rank FSDP1 files: they were saved with `use_orig_params=True`.
    #[arg(long, requires = "model")]
    pub use_orig_params: bool,
    /// Per-rank FSDP1 files: their sharding strategy (full_shard, shard_grad_op, no_shard,
    /// hybrid_shard, _hybrid_shard_zero2).
    #[arg(long, requires = "model", value_parser = super::read::parse_strategy)]
    pub strategy: Option<shardscope_core::layout::Strategy>,
    /// Per-rank FSDP1 files with a hybrid strategy: ranks per shard group (the first group is read).
    #[arg(long, value_name = "S", requires = "model")]
    pub shard_group_size: Option<u64>,
    /// Per-rank FSDP1 files saved under `MixedPrecision(param_dtype=DTYPE)` (with
    /// `use_orig_params`, the flat parameter's alignment is counted in elements of this dtype).
    #[arg(long, value_name = "DTYPE", requires = "model", value_parser = super::read::parse_dtype)]
    pub param_dtype: Option<shardscope_core::DType>,
    /// Per-rank files: file-name pattern of the model files, `{r}` for the rank (default:
    /// detected by content), when the folder holds several sets or names them unusually.
    #[arg(long, value_name = "PATTERN")]
    pub model_files: Option<String>,
    /// Per-rank files: file-name pattern of the optimizer files, `{r}` for the rank.
    #[arg(long, value_name = "PATTERN")]
    pub optim_files: Option<String>,
    /// The model alone, from a training checkpoint (optimizer and training state left out,
    /// the model's own names kept): see `shardscope inspect --help`.
    #[arg(long)]
    pub model_only: bool,
    /// Per-rank files named by one `{r}` pattern (a URL or a path): the number of ranks, the
    /// pattern read as the files of ranks 0 to N-1 (`'https://h/ckpt/model_rank{r}.pt' --ranks 4`).
    #[arg(long, value_name = "N")]
    pub ranks: Option<u64>,
    /// Per-rank FSDP1 files: where the full optimizer state dict goes (default `<DST stem>.optim.pt`).
    #[arg(long, value_name = "PATH", requires = "model")]
    pub optim_output: Option<PathBuf>,
    /// Cast floating tensors (float16, bfloat16, float32, float64) to this dtype while streaming, as
    /// torch's `Tensor.to(dtype)` does (round to nearest even; NaN and inf kept). Integers, bools,
    /// complex and float8 tensors are written unchanged. `bf16`, `fp16`, `fp32`, `fp64` or torch's
    /// names (`bfloat16`, `float16`, `half`, `float32`, ...).
    #[arg(long, value_name = "DTYPE", value_parser = parse_cast_dtype)]
    pub dtype: Option<shardscope_core::DType>,
    /// safetensors output: keep every name of a tied weight (by default one copy is written, under
    /// the name that comes first in the checkpoint, as `save_pretrained` does).
    #[arg(long)]
    pub keep_tied: bool,
    /// Reader threads: tensors are read in parallel while the output is written in order (the
    /// output is the same for any count). Default: the available cores less one (for the writer),
    /// at least 1, at most 8.
    #[arg(long, value_name = "N", value_parser = crate::convert::exec::parse_threads)]
    pub threads: Option<usize>,
    /// At most this many bytes of tensor buffers alive at once (`2GiB`, `500MB`, bytes); must hold
    /// the largest tensor. Default: the largest tensor plus 40 MiB (the process then stays within the
    /// largest tensor + 64 MiB); from a URL, twice the largest tensor plus 40 MiB (the next tensor
    /// is fetched while the current one is written).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub memory_limit: Option<u64>,
    /// Write part R of N of a multi-file output (HF shards with --max-shard-size, DCP rank files):
    /// files i with i % N == R, then the last part to finish writes the index. `auto` takes R/N from
    /// RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun).
    #[arg(long, value_name = "R/N|auto", value_parser = crate::convert::part::parse_part)]
    pub part: Option<crate::convert::part::PartArg>,
    /// With --part: write only the index of an output whose N parts have all finished (after the
    /// process that should have written it died).
    #[arg(long, requires = "part")]
    pub finalize: bool,
    /// `--to hf`/`--to torchtitan`: the model's Hugging Face `config.json`. Its `architectures`
    /// and `model_type` (with the stored names) choose the mapping, its sizes check every shape
    /// and give the head counts of the RoPE permutation; it is written to DST (`torch_dtype` set to
    /// `--dtype`).
    #[arg(long, value_name = "CONFIG.json")]
    pub config: Option<PathBuf>,
    /// `--to hf`/`--to torchtitan`: the mapping file to use instead of the built-in ones
    /// (`shardscope mappings` lists them and prints one to start from; docs/mappings.md describes the format).
    #[arg(long, value_name = "FILE")]
    pub mapping: Option<PathBuf>,
    /// `--to hf`: a folder whose tokenizer and generation files (`tokenizer*`, `special_tokens_map.json`,
    /// `generation_config.json`, `vocab.*`, `merges.txt`, `*.model`, `chat_template*`) are copied to DST.
    #[arg(long, value_name = "DIR")]
    pub hf_assets: Option<PathBuf>,
    /// Rename keys: every match of REGEX in a key is replaced by REPLACEMENT (`$1` for groups);
    /// repeatable, applied in order, before anything else. Two keys becoming one is an error.
    #[arg(long, value_name = "REGEX=REPLACEMENT")]
    pub rename: Vec<String>,
    /// Leave out the keys REGEX matches (after --rename); repeatable.
    #[arg(long, value_name = "REGEX")]
    pub drop: Vec<String>,
    /// Remove wrapper modules' names wherever they stand in a key: `_orig_mod.` (torch.compile),
    /// `module.` (DDP), `_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`.
    #[arg(long)]
    pub strip_wrappers: bool,
    /// Also write the output's content manifest (the format of `shardscope hash`), computed from
    /// the bytes as they are written: `DST.manifest.json` beside a file output,
    /// `DST/shardscope.manifest.json` inside a folder output (DCP, HF shards, `--to hf`).
    /// `verify DST --manifest M` then proves the output intact. Not with `--part`.
    #[arg(long)]
    pub write_manifest: bool,
    /// The manifest's digest: xxh3 (XXH3-128, the default) or sha256.
    #[arg(
        long,
        value_enum,
        value_name = "ALGORITHM",
        requires = "write_manifest",
        default_value = "xxh3"
    )]
    pub manifest_algorithm: super::hash::AlgorithmArg,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

/// `5GB` (10^9), `5GiB` (2^30), `500MB`, `100KiB`, or plain bytes, as HF's `max_shard_size`.
fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 5GB, 500MB, 2GiB, 1000)"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        other => {
            return Err(format!(
                "unknown size unit `{other}` (B, KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("`{s}` is not a positive size that fits 64 bits"))
}

/// `--dtype`: the short names HF users type, or torch's names; floating dtypes only.
pub(crate) fn parse_cast_dtype(s: &str) -> Result<shardscope_core::DType, String> {
    use shardscope_core::DType;
    let accepted = "casts go to bf16, fp16, fp32 or fp64 (or torch's names: bfloat16, float16, half, float32, float, float64, double)";
    let dtype = match s.to_ascii_lowercase().as_str() {
        "bf16" => DType::BFloat16,
        "fp16" | "f16" => DType::Float16,
        "fp32" | "f32" => DType::Float32,
        "fp64" | "f64" => DType::Float64,
        other => other
            .parse::<DType>()
            .map_err(|_| format!("`{s}` is not a dtype a cast goes to: {accepted}"))?,
    };
    if shardscope_core::cast::is_castable(dtype) {
        Ok(dtype)
    } else {
        Err(format!("`{s}` is not a dtype a cast goes to: {accepted}"))
    }
}

pub(super) fn target_of(args: &ConvertArgs) -> Result<Target> {
    if let Some(t) = args.to {
        return Ok(t);
    }
    if args.world_size.is_some() {
        return Ok(Target::Dcp);
    }
    let ext = args
        .output
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    match ext.as_deref() {
        Some("safetensors") => Ok(Target::Safetensors),
        Some("pt" | "pth" | "bin") => Ok(Target::Torch),
        _ if args.max_shard_size.is_some() => Ok(Target::Safetensors),
        _ => bail!(
            "cannot tell the output format from {}\nhint: pass --to safetensors|torch|dcp",
            args.output.display()
        ),
    }
}

pub(super) struct Bar(pub(super) Option<indicatif::ProgressBar>);

impl Bar {
    /// A progress bar over `total` tensor bytes on a terminal (none when `quiet`, off a terminal,
    /// or with nothing to write).
    pub(super) fn for_bytes(total: u64, quiet: bool) -> Self {
        let show = !quiet && std::io::stderr().is_terminal() && total > 0;
        Bar(show.then(|| {
            let bar = indicatif::ProgressBar::new(total);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
            ) {
                bar.set_style(style);
            }
            bar
        }))
    }
}

impl Progress for Bar {
    fn advance(&self, bytes: u64) {
        if let Some(bar) = &self.0 {
            bar.inc(bytes);
        }
    }
}

pub fn run(args: &ConvertArgs) -> Result<ExitCode> {
    if args.part.is_some() && args.model.is_some() {
        bail!(
            "--part applies to DCP directories and full checkpoints; {} holds per-rank FSDP files\nhint: convert them to a full file first, then split that conversion with --part",
            super::read::shown(&args.src)
        );
    }
    check_output(args)?;
    let started = Instant::now();
    let mapped = mapped_output(args)?;
    let surgery =
        crate::convert::surgery::Surgery::parse(args.strip_wrappers, &args.rename, &args.drop)?;
    let options = super::read::read_options(
        args.model.as_deref(),
        Fsdp1Flags {
            world_size: None,
            use_orig_params: args.use_orig_params,
            strategy: args.strategy.unwrap_or(Strategy::FullShard),
            shard_group_size: args.shard_group_size,
            param_dtype: args.param_dtype,
        },
        &super::read::RankFileArgs {
            model_files: args.model_files.clone(),
            optim_files: args.optim_files.clone(),
            // A model in another naming is made of the model part alone.
            model_only: args.model_only || mapped,
            ranks: args.ranks,
        },
    )?;
    let (source, mut checkpoint) = super::read::open(
        &super::read::expand_ranks(std::slice::from_ref(&args.src), args.ranks)?,
        false,
        &options,
    )?;
    super::read::ensure_unambiguous(&checkpoint)?;
    let quiet = args.quiet || args.json;
    super::read::show_notes(&checkpoint, quiet);
    surgery.apply_noted(&mut checkpoint.index, quiet)?;
    if mapped {
        return super::convert_mapped::run(args, &checkpoint, &source, started);
    }
    let label = checkpoint.label.clone();
    let per_rank_fsdp2 = checkpoint.index.kind == CheckpointKind::Fsdp2;
    if args.part.is_some() && per_rank_fsdp2 {
        bail!(
            "--part applies to DCP directories and full checkpoints; {label} holds per-rank FSDP files\nhint: convert them to a full file first, then split that conversion with --part"
        );
    }
    let index = match &checkpoint.view {
        View::Fsdp2 { .. } => fsdp2_output(args, &checkpoint)?,
        View::Fsdp1(_) if !other_output(args)? => {
            return convert_fsdp1_two_files(args, &checkpoint, &source, started);
        }
        _ if rank_local_optimizer_state(&checkpoint.index)
            && args.select.as_deref() != Some("model") =>
        {
            // DTensor model files next to raw FSDP1 optimizer files (FSDP1 SHARDED_STATE_DICT
            // with a device mesh, as verl writes them) without --model.
            bail!(
                "{label}: the model files hold DTensors but the optimizer files hold rank-local state (FSDP1 flat parameters, as FSDP1 SHARDED_STATE_DICT with a device mesh saves them): which parameters each optimizer id holds depends on how FSDP1 wrapped the model\nhint: pass --model MODEL.json (the `shardscope layout` description; `shardscope layout --from` derives one) and --use-orig-params if it was wrapped so; or convert the model alone with --select model"
            );
        }
        _ => checkpoint.index,
    };
    if args.optim_output.is_some() {
        bail!(
            "--optim-output applies when the model and optimizer go to two files (FSDP1 per-rank files with --model, no --select, --dtype or DCP output)"
        );
    }
    convert::ensure_consistent(Path::new(&super::read::shown(&args.src)), &index)?;
    if matches!(
        index.kind,
        CheckpointKind::Fsdp1Local | CheckpointKind::RankLocal
    ) {
        bail!(
            "{label} holds {}: its tensors have no global shape without the model's layout\nhint: pass --model (FSDP1 LOCAL conversion)",
            index.kind.describe()
        );
    }
    let mut index = index;
    // DeepSpeed to safetensors: the model as zero_to_fp32 gives it (a .pt also holds the optimizer).
    if index.kind.is_deepspeed()
        && target_of(args)? == Target::Safetensors
        && args.select.is_none()
        && index.has_optimizer_state
    {
        index.entries.retain(|e| e.role.is_none());
        index.has_optimizer_state = false;
        if !quiet {
            eprintln!(
                "note: {label}: safetensors holds the model, as zero_to_fp32 gives it; the optimizer state goes to a .pt output"
            );
        }
    }
    let output = Output::of(args)?;
    let (written, untied) = write_index(args, &output, &source, &index)?;
    report(
        args,
        &index,
        &written,
        &untied,
        started.elapsed().as_secs_f64(),
    )
}

/// Whether the output is a model in another naming (`--to hf`, `--to torchtitan`), with the flags
/// that go with it checked.
fn mapped_output(args: &ConvertArgs) -> Result<bool> {
    let target = target_of(args)?;
    let mapped = matches!(target, Target::Hf | Target::Torchtitan);
    if mapped && args.config.is_none() {
        bail!(
            "--to {} needs --config CONFIG.json: the model's Hugging Face config (its architectures choose the mapping; its sizes give the head counts and check every shape)",
            if target == Target::Hf {
                "hf"
            } else {
                "torchtitan"
            }
        );
    }
    if !mapped && (args.config.is_some() || args.mapping.is_some() || args.hf_assets.is_some()) {
        bail!("--config, --mapping and --hf-assets apply to --to hf and --to torchtitan");
    }
    Ok(mapped)
}

/// True when the output is not the FSDP1 model file + `.optim.pt` pair: `--select`, `--dtype` or
/// DCP output take the index path for one output.
fn other_output(args: &ConvertArgs) -> Result<bool> {
    Ok(args.select.is_some()
        || args.dtype.is_some()
        || args.world_size.is_some()
        || target_of(args)? == Target::Dcp)
}

/// What a conversion of FSDP2 per-rank files writes: torch's full state is the model and the
/// optimizer; other per-rank sets (extra state: lr scheduler, RNG) are written only when
/// selected.
fn fsdp2_output(args: &ConvertArgs, checkpoint: &Checkpoint) -> Result<CheckpointIndex> {
    let label = &checkpoint.label;
    if args.use_orig_params || args.optim_output.is_some() {
        bail!(
            "--use-orig-params and --optim-output apply to FSDP1 per-rank files; {label} holds FSDP2 (DTensor) files, converted to one output holding `model` and `optim`\nhint: use --select model or --select optim to keep one of them"
        );
    }
    let mut index = checkpoint.index.clone();
    let quiet = args.quiet || args.json;
    let has_optim = index.has_optimizer_state;
    // The optimizer is found by what it holds, whatever its item is called.
    let mut optims = shardscope_core::checkpoint::optimizer_roots(&index);
    if optims.is_empty() {
        optims.insert("optim".to_owned());
    }
    let optim_names = optims
        .iter()
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if has_optim && !quiet {
        eprintln!(
            "note: FSDP2 per-rank files of {} ranks ({}): written as torch's full state dicts",
            ranks_in(&index),
            if checkpoint.sets.len() == 1 {
                format!("one file per rank holding `model` and the optimizer {optim_names}")
            } else {
                "model and optimizer files".to_owned()
            }
        );
    }
    if has_optim && args.select.is_none() {
        let before = index.entries.len();
        index.entries.retain(|e| {
            matches!(e.path.first(), Some(PathSeg::Key(k)) if k == "model" || optims.contains(k))
        });
        if index.entries.len() < before && !quiet {
            eprintln!(
                "note: {} entries outside `model` and the optimizer {optim_names} (extra state) are not written; --select NAME writes one subtree",
                before - index.entries.len()
            );
        }
    }
    Ok(index)
}

/// Refuses output flags that do not fit the output kind, and an output that exists.
fn check_output(args: &ConvertArgs) -> Result<()> {
    crate::atomic::refuse_link(&args.output)?;
    let target = target_of(args)?;
    if args.world_size.is_some() && !matches!(target, Target::Dcp | Target::Torchtitan) {
        bail!("--world-size applies to DCP output (and --to torchtitan) only");
    }
    if args.nest.is_some() && target != Target::Dcp {
        bail!("--nest applies to DCP output only");
    }
    if args.max_shard_size.is_some() && target == Target::Hf {
        // HF shards: checked below with the directory outputs.
    } else if args.max_shard_size.is_some() && target != Target::Safetensors {
        bail!("--max-shard-size applies to safetensors output (and --to hf) only");
    }
    let dir_output = matches!(target, Target::Dcp | Target::Hf)
        || args.max_shard_size.is_some()
        || (target == Target::Torchtitan && args.world_size.is_some());
    if args.output.is_file() || (args.output.exists() && !dir_output) {
        bail!(
            "{} already exists\nhint: shardscope never overwrites; remove it or choose another path",
            args.output.display()
        );
    }
    let manifest = convert::manifest::manifest_path(&args.output, dir_output);
    if args.write_manifest && !dir_output && std::fs::symlink_metadata(&manifest).is_ok() {
        bail!(
            "{} already exists\nhint: shardscope never overwrites; remove it or choose another path",
            manifest.display()
        );
    }
    Ok(())
}

/// One output of a conversion: where, in which format, which subtree.
#[derive(Debug, Clone)]
struct Output {
    path: PathBuf,
    target: Target,
    select: Option<String>,
    max_shard_size: Option<u64>,
}

impl Output {
    /// The output `args` names.
    fn of(args: &ConvertArgs) -> Result<Self> {
        Ok(Self {
            path: args.output.clone(),
            target: target_of(args)?,
            select: args.select.clone(),
            max_shard_size: args.max_shard_size,
        })
    }
}

/// The most bytes of a file copied beside a DCP output (Megatron-core's `common.pt`: iteration,
/// args and the tensors it does not shard).
const MAX_COMPANION_BYTES: u64 = 1 << 30;

/// Tied names of a safetensors output: `(kept, dropped)`.
type Untied = Vec<(String, String)>;

/// Whether a value read from a checkpoint is or holds Python `bytes`.
fn holds_bytes(v: &shardscope_core::formats::pickle::PyValue) -> bool {
    use shardscope_core::formats::pickle::PyValue as V;
    match v {
        V::Bytes(_) => true,
        V::Object(o) => shardscope_core::index::latin1_bytes(o).is_some(),
        V::Tuple(items) | V::List(items) | V::Set(items) => items.iter().any(holds_bytes),
        V::Dict(items) => items.iter().any(|(k, v)| holds_bytes(k) || holds_bytes(v)),
        _ => false,
    }
}

/// Writes `args.output` from the prepared checkpoint, with a progress bar on a terminal.
fn write_index(
    args: &ConvertArgs,
    output: &Output,
    source: &Input,
    index: &CheckpointIndex,
) -> Result<(convert::Written, Untied)> {
    let target = output.target;
    let dir_output = target == Target::Dcp || output.max_shard_size.is_some();
    let opts = write_options(args, dir_output)?;
    let mut sel = convert::select(index, output.select.as_deref())?;
    sel.cast = args.dtype;
    // safetensors metadata is text: a `bytes` value (a raw item) would be its description only.
    if target == Target::Safetensors {
        let (bytes, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut sel.values)
            .into_iter()
            .partition(|(_, e)| e.object.as_deref().is_some_and(holds_bytes));
        sel.values = kept;
        if !bytes.is_empty() && !args.quiet && !args.json {
            let names: Vec<&str> = bytes.iter().map(|(_, e)| e.key.as_str()).collect();
            eprintln!(
                "note: {} holds bytes (a raw item): not written, as safetensors metadata holds text; a .pt output keeps it",
                names.join(", ")
            );
        }
    }
    // safetensors cannot share storage: one copy of a tied weight, as `save_pretrained` writes.
    let untied = if target == Target::Safetensors && !args.keep_tied {
        convert::drop_tied(source, index, &mut sel)?
    } else {
        Vec::new()
    };
    if !args.quiet && !args.json {
        for (kept, dropped) in &untied {
            eprintln!(
                "note: `{dropped}` is tied to `{kept}` (one tensor): written once, as `{kept}` (--keep-tied writes both)"
            );
        }
    }
    let bar = Bar::for_bytes(sel.tensor_bytes(), args.quiet);
    let mut reader = Reader::new(source, index);
    let written = match target {
        Target::Safetensors => convert::to_safetensors(
            &mut reader,
            &sel,
            &output.path,
            output.max_shard_size,
            &[],
            &opts,
            &bar,
        ),
        Target::Torch => convert::to_torch_save(
            &mut reader,
            &sel,
            output.select.as_deref(),
            &output.path,
            &opts,
            &bar,
        ),
        Target::Hf | Target::Torchtitan => {
            bail!("--to hf and --to torchtitan are written by cli::convert_mapped")
        }
        Target::Dcp => {
            let world_size = args.world_size.context("DCP output needs --world-size N")?;
            // A Megatron-core checkpoint, whole: `dist_checkpointing.load` needs its
            // `metadata.json` and `common.pt` beside the DCP files.
            let companions = if output.select.is_none() && !args.model_only && args.nest.is_none() {
                shardscope_core::checkpoint::megatron_companions(source, MAX_COMPANION_BYTES)
                    .context("cannot read Megatron-core's metadata.json and common.pt")?
            } else {
                Vec::new()
            };
            if !companions.is_empty() && !args.quiet && !args.json {
                eprintln!(
                    "note: a Megatron-core checkpoint: its metadata.json and common.pt are written beside the DCP files, as dist_checkpointing.load needs them"
                );
            }
            convert::to_dcp(
                &mut reader,
                &sel,
                &output.path,
                world_size,
                args.api,
                args.nest.as_deref(),
                &companions,
                &opts,
                &bar,
            )
        }
    };
    if let Some(bar) = &bar.0 {
        bar.finish_and_clear();
    }
    Ok((written?, untied))
}

/// Says what [`write_index`] wrote: a JSON summary on stdout, or a line on stderr.
fn report(
    args: &ConvertArgs,
    index: &CheckpointIndex,
    written: &convert::Written,
    untied: &Untied,
    seconds: f64,
) -> Result<ExitCode> {
    let target = target_of(args)?;
    let dir_output = target == Target::Dcp || args.max_shard_size.is_some();
    let opts = write_options(args, dir_output)?;
    manifest_note(written, args.quiet || args.json);
    if args.json {
        let summary = serde_json::json!({
            "source": super::read::shown(&args.src),
            "source_kind": index.kind,
            "to": format!("{target:?}").to_ascii_lowercase(),
            "outputs": written.outputs,
            "tensors": written.tensors,
            "values": written.values,
            "tensor_bytes": written.tensor_bytes,
            "largest_tensor_bytes": written.largest_tensor_bytes,
            "dtype": args.dtype.map(shardscope_core::DType::name),
            "tied_dropped": untied
                .iter()
                .map(|(kept, dropped)| serde_json::json!({"kept": kept, "dropped": dropped}))
                .collect::<Vec<_>>(),
            "seconds": seconds,
            "threads": opts.exec.threads,
            "memory_limit_bytes": written.memory_limit_bytes,
            "part": opts.part.map(|p| p.to_string()),
            "complete": written.complete,
            "manifest": written.manifest,
            "manifest_files_left_out": written.undigested,
        });
        print_stdout(&format!("{}\n", serde_json::to_string_pretty(&summary)?))?;
    } else if !args.quiet {
        match opts.part {
            Some(part) if opts.finalize_only => eprintln!(
                "wrote the index of {} ({part_count} parts) in {seconds:.2} s",
                args.output.display(),
                part_count = part.count
            ),
            Some(part) => eprintln!(
                "wrote part {part} of {} ({} files) in {seconds:.2} s; {}",
                args.output.display(),
                written.outputs.len().saturating_sub(1),
                if written.complete {
                    "all parts are done: wrote the index"
                } else {
                    "the last part to finish writes the index"
                }
            ),
            None => eprintln!(
                "wrote {} ({} tensors, {}, {} other values) in {seconds:.2} s",
                args.output.display(),
                written.tensors,
                human_bytes(written.tensor_bytes),
                written.values
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Says where `--write-manifest` wrote the manifest, and which files it holds no digest of.
pub(super) fn manifest_note(written: &convert::Written, quiet: bool) {
    if quiet {
        return;
    }
    if let Some(path) = &written.manifest {
        eprintln!("wrote the content manifest {path}");
    }
    if !written.undigested.is_empty() {
        eprintln!(
            "note: the manifest holds no file digest of {}: its storages were written in parts and their checksums patched in afterwards (`shardscope hash` of the output adds it)",
            written.undigested.join(", ")
        );
    }
}

/// `--threads`, `--memory-limit`, `--part`, `--finalize`: checked against the output kind.
pub(super) fn write_options(args: &ConvertArgs, dir_output: bool) -> Result<convert::WriteOptions> {
    use crate::convert::exec::ExecOptions;
    use crate::convert::part::{PartArg, part_from_env};
    let part = match args.part {
        None => None,
        Some(_) if !dir_output => bail!(
            "--part splits a multi-file output: HF shards (--max-shard-size) or DCP (--world-size)\nhint: one safetensors or torch.save file is written by one process"
        ),
        Some(PartArg::Given(p)) => Some(p),
        Some(PartArg::Auto) => Some(part_from_env(|k| std::env::var(k).ok())?),
    };
    if args.write_manifest && part.is_some() {
        bail!(
            "--write-manifest needs the whole output written by one process; with --part each process sees only its files\nhint: run `shardscope hash DST -o MANIFEST.json` once every part is done"
        );
    }
    Ok(convert::WriteOptions {
        exec: ExecOptions {
            threads: args.threads.unwrap_or_else(ExecOptions::default_threads),
            memory_limit_bytes: args.memory_limit,
        },
        part,
        finalize_only: args.finalize,
        manifest: args.write_manifest.then(|| args.manifest_algorithm.into()),
    })
}

/// FSDP1 per-rank model and optimizer files read through the layout (`core::view::fsdp1`):
/// the full model state dict at `args.output` (`torch.save` or safetensors) and
/// `FSDP.optim_state_dict` at `--optim-output` (default `<DST stem>.optim.pt` next to it), put in
/// place together. A folder with only one of the two sets converts to the one output.
fn convert_fsdp1_two_files(
    args: &ConvertArgs,
    checkpoint: &Checkpoint,
    source: &Input,
    started: Instant,
) -> Result<ExitCode> {
    let index = &checkpoint.index;
    convert::ensure_consistent(Path::new(&super::read::shown(&args.src)), index)?;
    let has = |class: &str| checkpoint.sets.iter().any(|s| s.class == class);
    let model = Output::of(args)?;
    if !(has("model") && has("optim")) {
        if args.optim_output.is_some() {
            bail!(
                "--optim-output applies when the model and optimizer go to two files; {} holds one of them",
                checkpoint.label
            );
        }
        let (written, untied) = write_index(args, &model, source, index)?;
        return report(
            args,
            index,
            &written,
            &untied,
            started.elapsed().as_secs_f64(),
        );
    }
    let optim_path = args.optim_output.clone().unwrap_or_else(|| {
        let stem = args
            .output
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        args.output.with_file_name(format!("{stem}.optim.pt"))
    });
    if optim_path.exists() || optim_path == args.output {
        bail!(
            "{} already exists\nhint: shardscope never overwrites; remove it or choose another --optim-output",
            optim_path.display()
        );
    }
    // The folder indexes as `model` and `optim` subtrees (and any extra state, not written).
    let model = Output {
        select: Some("model".to_owned()),
        ..model
    };
    let optim = Output {
        path: optim_path,
        target: Target::Torch,
        select: Some("optim".to_owned()),
        max_shard_size: None,
    };
    let written = [
        model.path.display().to_string(),
        optim.path.display().to_string(),
    ];
    // Both or neither: the two files are put in place together once both are written (and the
    // model file is written back to disk while the optimizer file is written).
    crate::atomic::together(|| {
        write_index(args, &model, source, index)?;
        write_index(args, &optim, source, index)?;
        Ok(())
    })?;
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        print_stdout(&format!(
            "{}\n",
            serde_json::json!({ "written": written, "seconds": seconds })
        ))?;
    } else if !args.quiet {
        eprintln!("wrote {} in {seconds:.2} s", written.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
