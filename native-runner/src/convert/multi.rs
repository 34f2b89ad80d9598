//! Multi-file outputs: written atomically (a temporary directory renamed into place) or, with
//! `--part`, one process's files and the index when every part is done.

use std::fs::File;
use std::io::{BufWriter, Write};

use anyhow::{Context, Result, bail};

use crate::atomic;
use crate::input::Input;
use crate::writeback::Paced;

use super::WriteOptions;
use super::manifest::{FOLDER_MANIFEST, ManifestSink};
use super::part;

/// The names, sizes and modification times of the source's files: part of a `--part` plan's
/// fingerprint, so parts of runs over different input bytes never mix.
pub(super) fn source_identity(source: &Input) -> String {
    use shardscope_core::source::Source;
    use std::fmt::Write as _;
    let mut text = String::new();
    for name in source.names() {
        let size = source.size(&name).ok();
        // Remote objects: names and sizes (their listings carry no modification time here).
        let modified = match source {
            Input::Local(local) => std::fs::metadata(local.root().join(&name))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos()),
            Input::Remote(_) => None,
        };
        let _ = writeln!(text, "{name:?} {size:?} {modified:?}");
    }
    text
}

/// What [`write_multi`] wrote.
pub(super) struct MultiOutcome {
    pub written: Vec<String>,
    pub finalized: bool,
    /// The path of the manifest written inside the folder.
    pub manifest: Option<String>,
}

/// Writes a multi-file output: all of it atomically (a temporary directory renamed into place),
/// or with `--part` this process's files and, when all parts are done, the index (see [`part`]).
/// With `manifest` (never with `--part`: a process sees only its files), the manifest the writers
/// filled is written last into the folder, [`FOLDER_MANIFEST`], before it is moved into place.
pub(super) fn write_multi(
    plan: &part::Plan<'_>,
    opts: &WriteOptions,
    write_one: &mut dyn FnMut(usize, &mut dyn Write) -> Result<serde_json::Value>,
    finish: &part::FinishFn<'_>,
    manifest: Option<&ManifestSink>,
) -> Result<MultiOutcome> {
    if manifest.is_some() && opts.part.is_some() {
        bail!("--write-manifest needs the whole output written by one process (not --part)");
    }
    let from = |o: part::Outcome| MultiOutcome {
        written: o.written,
        finalized: o.finalized,
        manifest: None,
    };
    if opts.finalize_only {
        let p = opts
            .part
            .context("--finalize needs --part R/N or --part auto (N: the number of parts)")?;
        let written = part::finalize(plan, p.count, true, finish)?
            .context("another process holds the finalize lock")?;
        return Ok(from(part::Outcome {
            written,
            finalized: true,
        }));
    }
    if let Some(p) = opts.part {
        return part::write_part(plan, p, write_one, finish).map(from);
    }
    atomic::write_dir(plan.dest, |tmp| {
        let mut records = Vec::with_capacity(plan.files.len());
        for (i, name) in plan.files.iter().enumerate() {
            let path = tmp.join(name);
            let f =
                File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
            let mut out = BufWriter::new(Paced::new(f));
            records.push(write_one(i, &mut out)?);
            out.flush()
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        for (name, bytes) in plan.final_names.iter().zip(finish(&records)?) {
            let path = tmp.join(name);
            std::fs::write(&path, bytes)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        if let Some(sink) = manifest {
            let path = tmp.join(FOLDER_MANIFEST);
            std::fs::write(&path, sink.manifest()?.to_json())
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    })?;
    Ok(MultiOutcome {
        written: plan
            .files
            .iter()
            .cloned()
            .chain(plan.final_names.iter().map(|s| (*s).to_owned()))
            .collect(),
        finalized: true,
        manifest: manifest.map(|_| plan.dest.join(FOLDER_MANIFEST).display().to_string()),
    })
}
