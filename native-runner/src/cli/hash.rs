//! `shardscope hash`: a content manifest of a checkpoint (one digest per tensor of its logical
//! value, whatever the format and sharding; `docs/hash.md`), and the manifest side of `verify
//! --manifest` and `diff`. The engine is `crate::hash`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use shardscope_core::manifest::{Algorithm, Manifest};

use super::print_stdout;
use super::report_text::Progress;
use crate::hash::{HashOptions, manifest_of};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AlgorithmArg {
    /// XXH3-128: fast, for catching corruption.
    Xxh3,
    /// SHA-256: slower, for a manifest to sign.
    Sha256,
}

impl From<AlgorithmArg> for Algorithm {
    fn from(a: AlgorithmArg) -> Algorithm {
        match a {
            AlgorithmArg::Xxh3 => Algorithm::Xxh3,
            AlgorithmArg::Sha256 => Algorithm::Sha256,
        }
    }
}

#[derive(Debug, Args)]
pub struct HashArgs {
    /// A checkpoint file, a DCP directory, a folder of per-rank or safetensors files, several
    /// per-rank files of one checkpoint, or a URL.
    #[arg(value_name = "CKPT", required = true)]
    pub paths: Vec<PathBuf>,
    /// Write the manifest to this file (atomically; replaced if it exists) and print a summary.
    /// Without it the manifest goes to stdout with --json, else `DIGEST  KEY` lines.
    #[arg(short = 'o', long = "output", value_name = "DST")]
    pub output: Option<PathBuf>,
    /// The digest: xxh3 (XXH3-128, the default) or sha256.
    #[arg(long, value_enum, default_value = "xxh3")]
    pub algorithm: AlgorithmArg,
    /// Print JSON: the manifest itself, or with -o a summary.
    #[arg(long)]
    pub json: bool,
    /// Leave the `files` part out (one digest less per byte; the bytes outside tensors are not read).
    #[arg(long)]
    pub no_files: bool,
    /// Threads reading and hashing (the manifest is the same for any count). Default: the
    /// available cores, at most 8.
    #[arg(long, value_name = "N", value_parser = crate::convert::exec::parse_threads)]
    pub threads: Option<usize>,
    /// No progress on stderr.
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub read: super::read::ReadArgs,
}

/// Runs `hash`: exit 0 with the manifest, 2 when something cannot be read (the keys named; no
/// manifest is written).
pub fn run(args: &HashArgs) -> Result<ExitCode> {
    let options = args.read.options()?;
    let paths = super::read::expand_ranks(&args.paths, args.read.files.ranks)?;
    let hash = HashOptions {
        algorithm: args.algorithm.into(),
        threads: args.threads.unwrap_or_else(crate::hash::default_threads),
        files: !args.no_files,
    };
    let manifest = manifest_of_paths(&paths, &options, hash, args.quiet || args.json)?;
    if !manifest.errors.is_empty() {
        let list: Vec<String> = manifest
            .errors
            .iter()
            .map(|(k, why)| format!("  {k}: {why}"))
            .collect();
        bail!(
            "{}: {} key(s) cannot be read, no manifest written:\n{}",
            super::read::label_of(&paths),
            list.len(),
            list.join("\n")
        );
    }
    let text = manifest.to_json();
    match &args.output {
        Some(out) => {
            crate::atomic::write_file_replacing(out, |w| {
                use std::io::Write as _;
                w.write_all(text.as_bytes())?;
                Ok(())
            })
            .with_context(|| format!("cannot write {}", out.display()))?;
            if args.json {
                let summary = serde_json::json!({
                    "output": out.display().to_string(),
                    "algorithm": manifest.algorithm.name(),
                    "tensors": manifest.tensors.len(),
                    "values": manifest.values.len(),
                    "files": manifest.files.len(),
                });
                print_stdout(&format!("{summary:#}\n"))?;
            } else if !args.quiet {
                eprintln!(
                    "{}: {} tensors, {} values, {} files ({})",
                    out.display(),
                    manifest.tensors.len(),
                    manifest.values.len(),
                    manifest.files.len(),
                    manifest.algorithm.name()
                );
            }
        }
        None if args.json => print_stdout(&text)?,
        None => {
            use std::fmt::Write as _;
            let mut lines = String::new();
            for (k, t) in &manifest.tensors {
                let _ = writeln!(lines, "{}  {k}", t.digest);
            }
            for (k, v) in &manifest.values {
                let _ = writeln!(lines, "{}  {k}", v.digest);
            }
            print_stdout(&lines)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Opens the checkpoint at `paths` as [`shardscope_core::checkpoint::Checkpoint::open`] decides
/// and computes its manifest (keys that cannot be read in its `errors`).
pub fn manifest_of_paths(
    paths: &[PathBuf],
    options: &shardscope_core::checkpoint::ReadOptions,
    hash: HashOptions,
    quiet: bool,
) -> Result<Manifest> {
    let (source, checkpoint) = super::read::open(paths, false, options)?;
    super::read::ensure_unambiguous(&checkpoint)?;
    super::read::show_notes(&checkpoint, quiet);
    let mut progress = Progress::new(quiet, "hash");
    Ok(manifest_of(
        &source,
        &checkpoint.index,
        hash,
        &mut |done, total, key| progress.update(done, total, key),
    ))
}

/// The manifest at `path` when it is one (a local `.json` file holding `version`, `algorithm` and
/// `tensors`), checked; `None` for anything else (a checkpoint).
pub fn read_manifest_if(path: &Path) -> Result<Option<Manifest>> {
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    if !is_json || crate::input::as_url(path).is_some() || !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if !Manifest::looks_like(&text) {
        return Ok(None);
    }
    Manifest::from_json(&text)
        .map(Some)
        .with_context(|| path.display().to_string())
}

/// Reads the manifest at `path` (it must be one).
pub fn read_manifest(path: &Path) -> Result<Manifest> {
    let text = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Manifest::from_json(&text).with_context(|| path.display().to_string())
}
