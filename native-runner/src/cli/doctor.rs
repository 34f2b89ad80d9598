//! `shardscope doctor`: why a checkpoint will not load, and how to fix it. The diagnosis is
//! `shardscope_core::doctor`; this opens the inputs, salvages what a damaged checkpoint still holds
//! and scans pickles for globals (never importing or running them).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use shardscope_core::checkpoint::{Checkpoint, CheckpointError, Fsdp1Flags};
use shardscope_core::doctor::{self, Finding, Options, Report, Severity, Target};
use shardscope_core::formats::{dcp, torch_zip};
use shardscope_core::index::{self, CheckpointIndex, Format};
use shardscope_core::model::ModelDescription;
use shardscope_core::source::Source;

use super::print_stdout;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ApiArg {
    Fsdp1,
    Fsdp2,
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// A checkpoint file, a DCP directory, a folder of per-rank or safetensors files, or several
    /// per-rank files of one checkpoint.
    #[arg(value_name = "CKPT", required = true)]
    pub paths: Vec<PathBuf>,
    /// The model description (`shardscope layout` format) of the model the checkpoint should load
    /// into (parameters only: extra keys may be buffers and are warnings).
    #[arg(long, value_name = "MODEL.json", conflicts_with = "reference")]
    pub model: Option<PathBuf>,
    /// A checkpoint of the target model as it expects to be loaded (e.g. a fresh
    /// `model.state_dict()` saved with torch.save or safetensors): parameters and buffers.
    #[arg(long, value_name = "REF")]
    pub reference: Option<PathBuf>,
    /// The number of ranks that will load the checkpoint (per-rank files must match it).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub world_size: Option<u64>,
    /// The FSDP API that will load it (chooses the chunking of suggested `convert` commands).
    #[arg(long, value_enum)]
    pub api: Option<ApiArg>,
    /// FSDP1 `use_orig_params=True` (passed on to suggested commands).
    #[arg(long)]
    pub use_orig_params: bool,
    /// Print `{"version": 1, "loadable": …, "findings": [...]}`.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub files: super::read::RankFileArgs,
}

fn load_target(args: &DoctorArgs) -> anyhow::Result<Option<Target>> {
    if let Some(path) = &args.model {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read model description {}", path.display()))?;
        let label = path.display().to_string();
        let model = ModelDescription::from_json_bytes(&bytes, &label)?;
        return Ok(Some(Target::from_description(&model, &label)));
    }
    if let Some(path) = &args.reference {
        let (_, reference) = super::read::open(
            std::slice::from_ref(path),
            true,
            &shardscope_core::checkpoint::ReadOptions::default(),
        )
        .context("cannot read the reference")?;
        return Ok(Some(Target::from_reference(
            &reference.index,
            &reference.label,
        )));
    }
    Ok(None)
}

fn is_torch_name(name: &str) -> bool {
    let ext = name.rsplit_once('.').map_or("", |(_, e)| e);
    matches!(ext, "pt" | "pth" | "bin" | "ckpt" | "tar")
}

/// What could be read of a checkpoint that does not index as a whole.
struct Salvage {
    index: Option<CheckpointIndex>,
    findings: Vec<Finding>,
}

/// A DCP directory whose `.metadata` reads but whose data files do not all exist or read.
fn salvage_dcp(source: &dyn Source, err: &index::IndexError) -> Option<Salvage> {
    let names = source.names();
    let meta_name = names
        .iter()
        .find(|n| n.as_str() == ".metadata" || n.ends_with("/.metadata"))?;
    let bytes = shardscope_core::formats::read_all_capped(
        source,
        meta_name,
        shardscope_core::formats::MAX_DCP_METADATA_BYTES,
        "a DCP .metadata file",
    )
    .ok()?;
    let meta = dcp::read_metadata(&bytes).ok()?;
    let dir = meta_name
        .rsplit_once('/')
        .map_or(String::new(), |(d, _)| format!("{d}/"));
    let mut missing: std::collections::BTreeMap<String, Vec<String>> =
        std::collections::BTreeMap::new();
    for (idx, info) in &meta.storage {
        let file = format!("{dir}{}", info.relative_path);
        if !source.contains(&file) {
            let keys = missing.entry(file).or_default();
            if !keys.iter().any(|k| **k == *idx.fqn) {
                keys.push(idx.fqn.to_string());
            }
        }
    }
    let mut findings = Vec::new();
    for (file, keys) in missing {
        findings.push(Finding {
            code: "coverage",
            severity: Severity::Error,
            message: format!(
                "the DCP's .metadata places chunks of {} key(s) in {file}, which is missing (e.g. {}): dcp.load fails, and no rank's state is complete without it",
                keys.len(),
                keys.iter().take(4).map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
            ),
            keys,
            fix: format!("copy {file} next to .metadata from where the checkpoint was written (every rank writes its own .distcp)"),
        });
    }
    if findings.is_empty() {
        findings.push(doctor::unreadable_file(meta_name, &err.to_string()));
    }
    Some(Salvage {
        index: None,
        findings,
    })
}

/// `torch.save` files: index the readable ones; each unreadable one is a finding. `None` when
/// nothing at all looks like a checkpoint.
fn salvage_torch(source: &dyn Source) -> Option<Salvage> {
    let files: Vec<String> = source
        .names()
        .into_iter()
        .filter(|n| is_torch_name(n))
        .collect();
    let mut readable = Vec::new();
    let mut findings = Vec::new();
    let mut zip_like = false;
    for f in &files {
        match index::index_torch_files(source, std::slice::from_ref(f)) {
            Ok(_) => readable.push(f.clone()),
            Err(e @ index::IndexError::Unsupported { .. }) => {
                zip_like = true;
                findings.push(doctor::unsupported_file(f, &e.to_string()));
            }
            Err(e) => {
                let head = source.read_range(f, 0, 4.min(source.size(f).ok()?)).ok()?;
                zip_like |= torch_zip::looks_like_zip(&head);
                let what = if torch_zip::looks_like_zip(&head) {
                    format!("a torch.save archive cut short or damaged ({e})")
                } else if head.starts_with(b"vers") {
                    "a Git LFS pointer, not the file (run `git lfs pull`)".to_owned()
                } else {
                    format!("not a torch.save archive ({e})")
                };
                findings.push(doctor::unreadable_file(f, &what));
            }
        }
    }
    if readable.is_empty() && !zip_like {
        return None;
    }
    let index = if readable.is_empty() {
        None
    } else {
        match index::index_torch_files(source, &readable) {
            Ok(idx) => Some(idx),
            Err(e) => {
                findings.push(doctor::unreadable_file(
                    &readable.join(", "),
                    &e.to_string(),
                ));
                None
            }
        }
    };
    Some(Salvage { index, findings })
}

fn pickle_findings(index: &CheckpointIndex, source: &dyn Source) -> Vec<Finding> {
    let mut out = Vec::new();
    if index.format != Format::TorchSave {
        return out;
    }
    let deepspeed = index.kind.is_deepspeed();
    for file in index.files.keys() {
        // By range: the zip directory and data.pkl, not the tensor bytes (remote files).
        if let Ok(globals) = torch_zip::pickle_globals_from(source, file) {
            out.extend(doctor::torch_save_pickle_finding(file, &globals, deepspeed));
        }
    }
    out
}

/// The checkpoint's index (`None` when only parts of it read) and the findings of what could
/// not be read; an error when nothing in it reads as a checkpoint.
fn open_or_salvage(
    source: &dyn Source,
    label: &str,
    options: &shardscope_core::checkpoint::ReadOptions,
    json: bool,
) -> anyhow::Result<(Option<CheckpointIndex>, Vec<Finding>)> {
    Ok(match Checkpoint::open(source, label, options) {
        Ok(checkpoint) => {
            super::read::show_notes(&checkpoint, json);
            (Some(checkpoint.index), Vec::new())
        }
        // Per-rank sets with a missing rank (or model and optimizer sets of different sizes):
        // what is there is diagnosed, the gaps are coverage findings.
        Err(CheckpointError::Files { .. })
            if options.model_files.is_none() && options.optim_files.is_none() =>
        {
            match index::index_source(source) {
                Ok(idx) => (Some(idx), Vec::new()),
                Err(e) => return Err(anyhow::Error::new(e).context(format!("cannot read {label}"))),
            }
        }
        // A DeepSpeed save is diagnosed as a whole (its files are not loose torch.save files),
        // after what each of its pickles names.
        Err(CheckpointError::Index { source: err, .. })
            if index::looks_like_deepspeed(&source.names()) =>
        {
            let mut findings: Vec<Finding> = source
                .names()
                .iter()
                .filter(|n| {
                    std::path::Path::new(n.as_str())
                        .extension()
                        .is_some_and(|e| e.eq_ignore_ascii_case("pt"))
                })
                .filter_map(|n| {
                    let globals = torch_zip::pickle_globals_from(source, n).ok()?;
                    doctor::torch_save_pickle_finding(n, &globals, true)
                })
                .collect();
            findings.push(doctor::deepspeed_folder(label, &err.to_string()));
            (None, findings)
        }
        Err(CheckpointError::Index { source: err, .. }) => {
            let err = *err;
            let salvage = if source
                .names()
                .iter()
                .any(|n| n == ".metadata" || n.ends_with("/.metadata"))
            {
                salvage_dcp(source, &err)
            } else if matches!(err, index::IndexError::SeveralCheckpoints { .. }) {
                None
            } else {
                salvage_torch(source)
            };
            let Some(s) = salvage else {
                let lfs = source.names().iter().any(|n| {
                    source
                        .read_range(n, 0, 24.min(source.size(n).unwrap_or(0)))
                        .is_ok_and(|h| h.starts_with(b"version https://git-lfs"))
                });
                let hint = if lfs {
                    " (a Git LFS pointer is there in place of the file: run `git lfs pull`)"
                } else {
                    ""
                };
                return Err(anyhow::Error::new(err).context(format!(
                    "cannot read {label}: nothing in it reads as a checkpoint{hint}"
                )));
            };
            (s.index, s.findings)
        }
        Err(e) => return Err(e.into()),
    })
}

/// Runs `doctor`: exit 0 when nothing stops a strict load, 1 when something does, 2 when the
/// input holds nothing readable as a checkpoint.
pub fn run(args: &DoctorArgs) -> anyhow::Result<ExitCode> {
    let paths = super::read::expand_ranks(&args.paths, args.files.ranks)?;
    let label = super::read::label_of(&paths);
    let target = load_target(args)?;
    let options = super::read::read_options(None, Fsdp1Flags::default(), &args.files)?;
    let source = crate::input::open(&paths, true)?;
    // Pickles torch would unpickle with no restriction: from the index when the checkpoint read,
    // file by file when it did not (a hostile `.metadata` is rarely a valid one): reported
    // either way.
    let opened = open_or_salvage(&source, &label, &options, args.json);
    let unsafe_pickles = match &opened {
        Ok((Some(idx), _)) => doctor::unsafe_loader_pickles_indexed(&source, idx, true),
        _ => doctor::unsafe_loader_pickles(&source),
    };
    let (idx, mut findings) = match opened {
        Ok(opened) => opened,
        Err(e) if !unsafe_pickles.is_empty() => (
            None,
            vec![doctor::unreadable_file(&label, &e.root_cause().to_string())],
        ),
        Err(e) => return Err(e),
    };
    findings.extend(unsafe_pickles);
    let options = Options {
        target: target.as_ref(),
        world_size: args.world_size,
        label: label.clone(),
        model_path: args.model.as_ref().map(|p| p.display().to_string()),
        use_orig_params: args.use_orig_params,
        api: args.api.map(|a| match a {
            ApiArg::Fsdp1 => "fsdp1",
            ApiArg::Fsdp2 => "fsdp2",
        }),
    };
    if let Some(idx) = &idx {
        let problems = idx.check();
        findings.extend(pickle_findings(idx, &source));
        findings.extend(doctor::diagnose(idx, &source, &problems, &options));
        findings.extend(deepspeed_padding(idx, &source, &label));
    }
    let report = Report::new(findings);
    if args.json {
        print_stdout(&(serde_json::to_string_pretty(&report)? + "\n"))?;
    } else {
        print_stdout(&render(&label, idx.as_ref(), target.as_ref(), &report))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}

/// A DeepSpeed ZeRO folder: each run of its flat partitions' padding that is not zero.
fn deepspeed_padding(idx: &CheckpointIndex, source: &dyn Source, label: &str) -> Vec<Finding> {
    if !matches!(
        idx.kind,
        shardscope_core::index::CheckpointKind::DeepSpeedZero { .. }
    ) {
        return Vec::new();
    }
    let names = source.names();
    match index::check_deepspeed_padding(source, &names) {
        // The moments' padding only: DeepSpeed leaves the fp32 weights' padding uninitialized.
        Ok(check) => check
            .nonzero
            .iter()
            .filter(|p| p.moment)
            .map(doctor::deepspeed_padding)
            .collect(),
        Err(e) => vec![doctor::deepspeed_folder(label, &e.to_string())],
    }
}

fn render(
    label: &str,
    idx: Option<&CheckpointIndex>,
    target: Option<&Target>,
    report: &Report,
) -> String {
    let mut out = String::new();
    let what = idx.map_or_else(
        || "partly readable".to_owned(),
        |i| format!("{}, {} keys", i.kind.describe(), i.entries.len()),
    );
    let _ = writeln!(out, "{label}: {what}");
    if let Some(t) = target {
        let _ = writeln!(out, "target: {} ({} keys)", t.label, t.tensors.len());
    }
    for f in &report.findings {
        let sev = match f.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        let _ = writeln!(out, "\n{sev}[{}]: {}", f.code, f.message);
        if !f.keys.is_empty() {
            let shown: Vec<&str> = f.keys.iter().take(8).map(String::as_str).collect();
            let more = f.keys.len().saturating_sub(shown.len());
            let _ = write!(out, "  keys: {}", shown.join(", "));
            if more > 0 {
                let _ = write!(out, " (and {more} more)");
            }
            out.push('\n');
        }
        let _ = writeln!(out, "  fix: {}", f.fix);
    }
    let errors = report
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .count();
    let warnings = report.findings.len() - errors;
    let _ = writeln!(
        out,
        "\n{}: {errors} error(s), {warnings} warning(s)",
        if report.loadable {
            "loadable"
        } else {
            "not loadable"
        }
    );
    out
}
