//! The one argument group of every command that reads a checkpoint, and the one way they open it:
//! arguments become [`ReadOptions`] here, and [`open`] hands the source to
//! `shardscope_core::checkpoint::Checkpoint::open`, which makes every reading decision (which
//! files, which view). Commands print its notes and read its index.

use std::path::{Path, PathBuf};

use clap::Args;
use shardscope_core::DType;
use shardscope_core::checkpoint::{Checkpoint, Fsdp1Flags, ReadOptions};
use shardscope_core::layout::{self, Strategy};

use crate::input::Input;

/// `--model-files`/`--optim-files`: the per-rank sets of a folder to read.
#[derive(Debug, Clone, Default, Args)]
pub struct RankFileArgs {
    /// Per-rank files: file-name pattern of the model files, `{r}` for the rank
    /// (`ckpt_{r}_model.pt`); only the named sets are read (default: every set found by name).
    #[arg(long, value_name = "PATTERN")]
    pub model_files: Option<String>,
    /// Per-rank files: file-name pattern of the optimizer files, `{r}` for the rank.
    #[arg(long, value_name = "PATTERN")]
    pub optim_files: Option<String>,
    /// The model alone, from a training checkpoint: the part that is the model (a DCP app
    /// state's `model`, accelerate's `pytorch_model_fsdp_0/`, torchtitan's top-level model keys
    /// beside `optimizer`/`lr_scheduler`/`train_state`/`dataloader`, Lightning's `state_dict`),
    /// with the model's own names; optimizer and training state are left out (said on stderr).
    #[arg(long)]
    pub model_only: bool,
    /// Per-rank files named by one `{r}` pattern (a URL or a path): the number of ranks, the
    /// pattern read as the files of ranks 0 to N-1 (`'https://h/ckpt/model_rank{r}.pt' --ranks 4`).
    #[arg(long, value_name = "N")]
    pub ranks: Option<u64>,
}

/// The most ranks `--ranks` expands (one input per rank).
const MAX_RANKS: u64 = 1 << 16;

/// `paths` with each `{r}` pattern (a URL or a path holding `{r}`) read as `ranks` inputs, the
/// files of ranks 0 to `ranks`-1 (`--ranks`); the others as given.
pub fn expand_ranks(paths: &[PathBuf], ranks: Option<u64>) -> anyhow::Result<Vec<PathBuf>> {
    let [side] = expand_sides([paths], ranks)?;
    Ok(side)
}

/// [`expand_ranks`] for the inputs of several checkpoints (`diff`'s two sides): `--ranks` needs a
/// pattern in one of them at least.
pub fn expand_sides<const N: usize>(
    sides: [&[PathBuf]; N],
    ranks: Option<u64>,
) -> anyhow::Result<[Vec<PathBuf>; N]> {
    let has_pattern = |p: &PathBuf| p.to_string_lossy().contains("{r}");
    let all = || sides.iter().flat_map(|s| s.iter());
    let Some(ranks) = ranks else {
        if let Some(p) =
            all().find(|p| has_pattern(p) && (crate::input::as_url(p).is_some() || !p.exists()))
        {
            anyhow::bail!(
                "{}: `{{r}}` stands for the rank: give the number of ranks with --ranks N",
                shown(p)
            );
        }
        return Ok(sides.map(<[PathBuf]>::to_vec));
    };
    if !(1..=MAX_RANKS).contains(&ranks) {
        anyhow::bail!("--ranks {ranks}: give 1 to {MAX_RANKS} ranks");
    }
    if !all().any(has_pattern) {
        anyhow::bail!(
            "--ranks {ranks}: no input holds a `{{r}}` pattern (`model_rank{{r}}.pt`, \
             `https://h/ckpt/model_rank{{r}}.pt`)"
        );
    }
    let mut out = sides.map(|_| Vec::new());
    for (paths, out) in sides.iter().zip(out.iter_mut()) {
        for p in *paths {
            match p.to_str() {
                Some(text) if has_pattern(p) => out
                    .extend((0..ranks).map(|r| PathBuf::from(text.replace("{r}", &r.to_string())))),
                None if has_pattern(p) => {
                    anyhow::bail!("{}: a `{{r}}` pattern must be valid UTF-8", p.display())
                }
                _ => out.push(p.clone()),
            }
        }
    }
    Ok(out)
}

/// `--model MODEL.json` and the FSDP1 layout flags, with the rank-file patterns: how `inspect`,
/// `verify` and `diff` read a checkpoint.
#[derive(Debug, Clone, Args)]
pub struct ReadArgs {
    /// Model description (as for `shardscope layout`): read FSDP1 per-rank files (LOCAL model
    /// state dicts, raw optimizer state dicts) as the original parameters and FQN-keyed optimizer
    /// state, as torch's FULL_STATE_DICT and FSDP.optim_state_dict name them; names the raw
    /// optimizer ids of FSDP2 per-rank files.
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
    #[command(flatten)]
    pub files: RankFileArgs,
}

/// `--api`'s values (`fsdp1`, `fsdp2`).
pub(crate) fn parse_api(s: &str) -> Result<layout::Api, String> {
    s.parse().map_err(|e: layout::LayoutError| e.to_string())
}

/// `--strategy`'s values, as torch names them.
pub(crate) fn parse_strategy(s: &str) -> Result<Strategy, String> {
    s.parse().map_err(|e: layout::LayoutError| e.to_string())
}

/// A dtype as torch names it (`bfloat16`, `bf16`, `torch.float32`).
pub(crate) fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
        .map_err(|e: shardscope_core::dtype::UnknownDType| e.to_string())
}

impl ReadArgs {
    /// The FSDP1 layout flags.
    pub fn fsdp1(&self) -> Fsdp1Flags {
        Fsdp1Flags {
            world_size: self.world_size,
            use_orig_params: self.use_orig_params,
            strategy: self.strategy,
            shard_group_size: self.shard_group_size,
            param_dtype: self.param_dtype,
        }
    }

    pub fn options(&self) -> anyhow::Result<ReadOptions> {
        read_options(self.model.as_deref(), self.fsdp1(), &self.files)
    }
}

/// The options of a command's reading flags (`model`: the description's path).
pub fn read_options(
    model: Option<&Path>,
    fsdp1: Fsdp1Flags,
    files: &RankFileArgs,
) -> anyhow::Result<ReadOptions> {
    let description = match model {
        Some(path) => Some((
            shardscope_runner::fsdp1_local::read_description(path)?,
            path.display().to_string(),
        )),
        None => None,
    };
    Ok(ReadOptions {
        description,
        fsdp1,
        model_files: files.model_files.clone(),
        optim_files: files.optim_files.clone(),
        model_only: files.model_only,
    })
}

/// An input as messages show it: a path, or a URL with its query (which may carry a signature)
/// as `?…`.
pub fn shown(path: &Path) -> String {
    match crate::input::as_url(path) {
        Some(url) => shardscope_runner::remote::shown(url),
        None => path.display().to_string(),
    }
}

/// The label of a checkpoint given as `paths` (its paths, space-separated; a URL's query, which
/// may carry a signature, as `?…`).
pub fn label_of(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| shown(p)).collect::<Vec<_>>().join(" ")
}

/// Opens the checkpoint at `paths` (files, a folder or one URL: [`crate::input::open`]) and reads
/// it as [`Checkpoint::open`] decides. `progress`: long remote reads may show a progress line.
pub fn open(
    paths: &[PathBuf],
    progress: bool,
    options: &ReadOptions,
) -> anyhow::Result<(Input, Checkpoint)> {
    let source = crate::input::open(paths, progress)?;
    let checkpoint = Checkpoint::open(&source, &label_of(paths), options)?;
    Ok((source, checkpoint))
}

/// [`open`] without the view: the files found and indexed as stored.
pub fn open_stored(
    paths: &[PathBuf],
    progress: bool,
    options: &ReadOptions,
) -> anyhow::Result<(Input, Checkpoint)> {
    let source = crate::input::open(paths, progress)?;
    let checkpoint = Checkpoint::open_stored(&source, &label_of(paths), options)?;
    Ok((source, checkpoint))
}

/// Prints the checkpoint's notes on stderr (`note: …`), unless `quiet`.
pub fn show_notes(checkpoint: &Checkpoint, quiet: bool) {
    if quiet {
        return;
    }
    for note in &checkpoint.notes {
        eprintln!("note: {note}");
    }
}

/// Fails with the checkpoint's ambiguity, for commands that must not mix per-rank sets.
pub fn ensure_unambiguous(checkpoint: &Checkpoint) -> anyhow::Result<()> {
    if let Some(why) = &checkpoint.ambiguous {
        anyhow::bail!(
            "{}: {why}\nhint: --model-files and --optim-files take `{{r}}` patterns of the sets to read",
            checkpoint.label
        );
    }
    Ok(())
}
