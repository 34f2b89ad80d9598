//! `shardscope verify`: check one checkpoint against its own promises.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
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
    /// Check the checkpoint against a content manifest (`shardscope hash -o MANIFEST.json`):
    /// exit 0 when every tensor and value matches, 1 naming each that differs (with the file and
    /// byte range of the differing chunk), is missing or is extra.
    #[arg(long, value_name = "MANIFEST.json")]
    pub manifest: Option<PathBuf>,
    /// With --manifest: threads reading and hashing (default: the available cores, at most 8).
    #[arg(long, value_name = "N", value_parser = crate::convert::exec::parse_threads)]
    pub threads: Option<usize>,
    /// With --model: FSDP1 flat parameters are checked against the layout (sizes, rank pieces,
    /// zero padding segments), and the per-rank files must read as every original parameter.
    #[command(flatten)]
    pub read: super::read::ReadArgs,
}

/// Runs `verify`: exit 0 when consistent, 1 when parts disagree, 2 when something cannot be read
/// or does not hold together.
pub fn run(args: &VerifyArgs) -> anyhow::Result<ExitCode> {
    let options = args.read.options()?;
    if let Some(manifest) = &args.manifest {
        return against_manifest(args, manifest, &options);
    }
    // Its own progress line: no second one for remote reads. The stored pieces are checked first
    // (against the layout with --model), then read through the view.
    let paths = super::read::expand_ranks(&args.paths, args.read.files.ranks)?;
    let (source, mut checkpoint) = super::read::open_stored(&paths, false, &options)?;
    let label = checkpoint.label.clone();
    let layout = checkpoint.fsdp1_layout(&options)?;
    if let Some(layout) = &layout {
        shardscope_core::view::fsdp1::mark_param_views(&mut checkpoint.index, layout);
    }
    let mut progress = Progress::new(args.quiet, "verify");
    let mut report = verify::verify(
        Side {
            index: &checkpoint.index,
            source: &source,
            label: &label,
        },
        VerifyOptions {
            read_values: !args.shallow,
            fsdp1_layout: layout.as_ref(),
        },
        &mut |done, total, key| progress.update(done, total, key),
    );
    if !args.shallow
        && matches!(
            checkpoint.index.kind,
            shardscope_core::index::CheckpointKind::DeepSpeedZero { .. }
        )
    {
        deepspeed_padding(&source, &mut report);
    }
    if report.exit_code() == 0 {
        // The files fit the layout: the original parameters must come out of them too (an error
        // names what does not fit).
        checkpoint.apply_view(&options)?;
        super::read::show_notes(&checkpoint, args.quiet || args.json);
    }
    if args.json {
        print_stdout(&report.to_json())?;
    } else {
        print_stdout(&render(&report))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}

/// A DeepSpeed ZeRO folder: the padding of every rank's flat partitions. The optimizer's moments
/// there must be zero (no gradient reaches the padding): each run that is not is a mismatch
/// naming the rank, file, key, group and bytes. The fp32 weights' padding is named in a note only:
/// DeepSpeed itself leaves it uninitialized (its own ZeRO-3 bf16 save on 3 ranks, a fixture here,
/// holds values like -1.1e13 there).
fn deepspeed_padding(source: &dyn shardscope_core::source::Source, report: &mut verify::Report) {
    use shardscope_core::index;
    let names = source.names();
    match index::check_deepspeed_padding(source, &names) {
        Ok(check) => {
            for p in &check.nonzero {
                let what = p.describe();
                if p.moment {
                    report.add_problem(
                        &format!("padding of {} (rank {})", p.key, p.rank),
                        verify::Status::Mismatch,
                        format!("{what}: no gradient reaches the padding, so DeepSpeed's optimizer keeps it zero; the file was changed after the save"),
                    );
                } else {
                    report.notes.push(format!(
                        "{what}: DeepSpeed does not zero the fp32 weights' padding (ZeRO-3 leaves it uninitialized), and no parameter reads it"
                    ));
                }
            }
            report.notes.push(format!(
                "DeepSpeed padding: {} run(s) ({} bytes) of the ranks' fp32 partitions and moments read, {} not zero",
                check.runs,
                check.bytes,
                check.nonzero.len()
            ));
        }
        Err(e) => report.add_problem(
            "padding",
            verify::Status::Error,
            format!("the DeepSpeed partitions' padding cannot be read: {e}"),
        ),
    }
}

/// `verify --manifest`: the checkpoint's manifest, computed with the manifest's algorithm,
/// compared with it.
fn against_manifest(
    args: &VerifyArgs,
    manifest_path: &std::path::Path,
    options: &shardscope_core::checkpoint::ReadOptions,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !args.shallow,
        "--shallow and --manifest: a manifest is checked by reading every value"
    );
    let expected = super::hash::read_manifest(manifest_path)?;
    let paths = super::read::expand_ranks(&args.paths, args.read.files.ranks)?;
    let hash = crate::hash::HashOptions {
        algorithm: expected.algorithm,
        threads: args.threads.unwrap_or_else(crate::hash::default_threads),
        files: !expected.files.is_empty(),
    };
    let actual = super::hash::manifest_of_paths(&paths, options, hash, args.quiet || args.json)?;
    let report = verify::compare_manifests(
        (&expected, &manifest_path.display().to_string()),
        (&actual, &super::read::label_of(&paths)),
        "verify",
    );
    if args.json {
        print_stdout(&report.to_json())?;
    } else {
        print_stdout(&render(&report))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}
