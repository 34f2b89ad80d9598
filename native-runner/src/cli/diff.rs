//! `shardscope diff`: compare two checkpoints of any formats, tensor by tensor.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use shardscope_core::verify::{self, DiffOptions, Side, Tolerance};

use super::print_stdout;
use super::report_text::{Progress, render};

/// torch.allclose's defaults, used for whichever of `--rtol`/`--atol` is not given.
const TORCH_RTOL: f64 = 1e-5;
const TORCH_ATOL: f64 = 1e-8;

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The reference checkpoint: a file, a DCP directory, or a folder of per-rank or safetensors files.
    #[arg(value_name = "A")]
    pub left: PathBuf,
    /// The checkpoint compared with it (any format).
    #[arg(value_name = "B")]
    pub right: PathBuf,
    /// Relative tolerance for floating-point values (`|a-b| <= atol + rtol*|b|`, as
    /// torch.allclose); without --rtol and --atol values must be bitwise equal.
    #[arg(long, value_name = "R")]
    pub rtol: Option<f64>,
    /// Absolute tolerance for floating-point values (see --rtol).
    #[arg(long, value_name = "T")]
    pub atol: Option<f64>,
    /// With a tolerance, count NaN equal to NaN.
    #[arg(long)]
    pub equal_nan: bool,
    /// Compare only keys under PREFIX (e.g. `model`), with the prefix stripped, on each side where
    /// it is an app-state wrapper: a side with no key under PREFIX, or whose names begin with
    /// PREFIX themselves (HF's `model.embed_tokens.weight` against a DCP app state's
    /// `model.model.embed_tokens.weight`), is compared whole. The report's notes say which.
    #[arg(long, value_name = "PREFIX")]
    pub select: Option<String>,
    /// Cast floating tensors of both sides to this dtype before comparing them (as `convert
    /// --dtype` casts): a bf16 export against its fp32 source, bitwise, is `--dtype bf16`.
    #[arg(long, value_name = "DTYPE", value_parser = super::convert::parse_cast_dtype)]
    pub dtype: Option<shardscope_core::DType>,
    /// Print the report as JSON (the schema the viewer's Verify panel reads).
    #[arg(long)]
    pub json: bool,
    /// No progress on stderr.
    #[arg(long, short)]
    pub quiet: bool,
    /// With --model: whichever side holds FSDP1 per-rank files is read as original parameters;
    /// --model-files/--optim-files apply to each side that is a folder.
    #[command(flatten)]
    pub read: super::read::ReadArgs,
}

/// Runs `diff`: exit 0 when equal, 1 when they differ, 2 when something cannot be read.
pub fn run(args: &DiffArgs) -> anyhow::Result<ExitCode> {
    let tolerance = match (args.rtol, args.atol) {
        (None, None) => None,
        (rtol, atol) => {
            let rtol = rtol.unwrap_or(TORCH_RTOL);
            let atol = atol.unwrap_or(TORCH_ATOL);
            anyhow::ensure!(
                rtol >= 0.0 && atol >= 0.0 && rtol.is_finite() && atol.is_finite(),
                "--rtol and --atol must be finite and not negative (got rtol={rtol}, atol={atol})"
            );
            Some(Tolerance {
                rtol,
                atol,
                equal_nan: args.equal_nan,
            })
        }
    };
    let options = args.read.options()?;
    let left_manifest = super::hash::read_manifest_if(&args.left)?;
    let right_manifest = super::hash::read_manifest_if(&args.right)?;
    if left_manifest.is_some() || right_manifest.is_some() {
        anyhow::ensure!(
            tolerance.is_none() && args.select.is_none(),
            "a manifest compares digests: --rtol, --atol and --select do not apply"
        );
        return diff_manifests(args, left_manifest, right_manifest, &options);
    }
    let side_options = |side: &PathBuf| {
        let mut o = options.clone();
        if !side.is_dir() {
            o.model_files = None;
            o.optim_files = None;
        }
        o
    };
    // Its own progress line: no second one for remote reads.
    let [left_paths, right_paths] = super::read::expand_sides(
        [
            std::slice::from_ref(&args.left),
            std::slice::from_ref(&args.right),
        ],
        args.read.files.ranks,
    )?;
    let (left_source, left) = super::read::open(&left_paths, false, &side_options(&args.left))?;
    let (right_source, right) = super::read::open(&right_paths, false, &side_options(&args.right))?;
    super::read::show_notes(&left, args.quiet || args.json);
    super::read::show_notes(&right, args.quiet || args.json);
    let (left_label, right_label) = (left.label.clone(), right.label.clone());
    let (left_index, right_index) = (left.index, right.index);
    let options = DiffOptions {
        tolerance,
        select: args.select.clone(),
        cast: args.dtype,
    };
    let mut progress = Progress::new(args.quiet, "diff");
    let report = verify::diff(
        Side {
            index: &left_index,
            source: &left_source,
            label: &left_label,
        },
        Side {
            index: &right_index,
            source: &right_source,
            label: &right_label,
        },
        &options,
        &mut |done, total, key| progress.update(done, total, key),
    );
    // `--select` is a plain prefix: a side it was stripped from leaves out the model tensors
    // outside it, unless the other side has them under the same names (then they are compared).
    if let Some(prefix) = args.select.as_deref() {
        let mut warnings: Vec<String> = Vec::new();
        for (index, label) in [(&left_index, &left_label), (&right_index, &right_label)] {
            let left_out: Vec<&str> = crate::convert::own_prefix_left_out(index, prefix)
                .into_iter()
                .filter(|k| !report.entries.contains_key(*k))
                .collect();
            if !left_out.is_empty() {
                warnings.push(crate::convert::own_prefix_warning(
                    prefix,
                    &left_out,
                    Some(label),
                ));
            }
        }
        // A checkpoint compared with itself: one warning.
        warnings.dedup();
        for w in &warnings {
            eprintln!("{w}");
        }
    }
    if args.json {
        print_stdout(&report.to_json())?;
    } else {
        print_stdout(&render(&report))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}

/// `diff` with a manifest on one side or both: the other side's manifest is computed with the
/// manifest's algorithm, then the two are compared key by key.
fn diff_manifests(
    args: &DiffArgs,
    left: Option<shardscope_core::manifest::Manifest>,
    right: Option<shardscope_core::manifest::Manifest>,
    options: &shardscope_core::checkpoint::ReadOptions,
) -> anyhow::Result<ExitCode> {
    let algorithm = left
        .as_ref()
        .or(right.as_ref())
        .map(|m| m.algorithm)
        .unwrap_or_default();
    let with_files = left
        .as_ref()
        .or(right.as_ref())
        .is_some_and(|m| !m.files.is_empty());
    let side = |m: Option<shardscope_core::manifest::Manifest>, path: &PathBuf| {
        if let Some(m) = m {
            return Ok(m);
        }
        let mut o = options.clone();
        if !path.is_dir() {
            o.model_files = None;
            o.optim_files = None;
        }
        let paths = super::read::expand_ranks(std::slice::from_ref(path), args.read.files.ranks)?;
        let hash = crate::hash::HashOptions {
            algorithm,
            threads: crate::hash::default_threads(),
            files: with_files,
        };
        super::hash::manifest_of_paths(&paths, &o, hash, args.quiet || args.json)
    };
    let left = side(left, &args.left)?;
    let right = side(right, &args.right)?;
    anyhow::ensure!(
        left.algorithm == right.algorithm,
        "{} is a {} manifest, {} a {} one: digests of different algorithms cannot be compared",
        args.left.display(),
        left.algorithm.name(),
        args.right.display(),
        right.algorithm.name()
    );
    let report = verify::compare_manifests(
        (&left, &super::read::shown(&args.left)),
        (&right, &super::read::shown(&args.right)),
        "diff",
    );
    if args.json {
        print_stdout(&report.to_json())?;
    } else {
        print_stdout(&render(&report))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}
