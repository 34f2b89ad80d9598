//! The safetensors writer: one file, or HF shards with `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};
use shardscope_core::formats::write::safetensors::{
    SafetensorsWriter, TensorSpec, index_json, plan_shards,
};
use shardscope_core::index::IndexEntry;

use crate::atomic;

use super::exec;
use super::jobs::{fix_limit, largest, push_piece_jobs};
use super::manifest::{ManifestSink, Tap, write_beside};
use super::multi::{source_identity, write_multi};
use super::part;
use super::reader::Reader;
use super::select::Selection;
use super::{Progress, WriteOptions, Written};

/// Writes the selection as safetensors: one file at `dest`, or, with `max_shard_bytes`, a directory
/// `dest` of `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`. Non-tensor
/// values go into every file's `__metadata__` as JSON text, next to `"format": "pt"`.
#[allow(
    clippy::too_many_lines,
    reason = "plans the safetensors shards and their reads in one pass over the index"
)]
pub fn to_safetensors(
    reader: &mut Reader<'_>,
    sel: &Selection<'_>,
    dest: &Path,
    max_shard_bytes: Option<u64>,
    extra_files: &[(String, Vec<u8>)],
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<Written> {
    if max_shard_bytes.is_none() && !extra_files.is_empty() {
        bail!("files beside the tensors need a directory output (HF shards)");
    }
    let specs: Vec<TensorSpec> = sel
        .tensors
        .iter()
        .map(|(name, e)| {
            let (dtype, shape) = sel.out_meta(e)?;
            Ok(TensorSpec {
                name: name.clone(),
                dtype,
                shape: shape.to_vec(),
            })
        })
        .collect::<Result<_>>()?;
    let mut metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    for (name, e) in &sel.values {
        let value = reader.index().read_bytes_value(reader.source(), e)?;
        if metadata
            .insert(name.clone(), serde_json::to_string(&value)?)
            .is_some()
        {
            bail!(
                "{}: the key `{name}` collides with the safetensors metadata key `format`",
                e.key
            );
        }
    }
    let by_name: BTreeMap<&str, &IndexEntry> =
        sel.tensors.iter().map(|(n, e)| (n.as_str(), *e)).collect();
    // The caller's reader: what it finds of where tensors lie serves the memory check too.
    let piece_reader: &Reader<'_> = reader;
    // Per file: tensor names in the writer's data order (dtype rank, then name), and the reads:
    // whole tensors, or pieces of at most `PIECE_BYTES` of those read in place by byte range.
    let jobs_of =
        |file_specs: &[TensorSpec]| -> Result<(Vec<String>, Vec<usize>, Vec<exec::Job<'_>>)> {
            let order: Vec<String> = SafetensorsWriter::new(std::io::sink(), file_specs, None)?
                .data_order()
                .map(str::to_owned)
                .collect();
            let mut jobs = Vec::new();
            let mut job_tensor = Vec::new();
            for (t, name) in order.iter().enumerate() {
                let entry = by_name[name.as_str()];
                let (to, _) = sel.out_meta(entry)?;
                let n = sel
                    .out_nbytes(entry)
                    .with_context(|| format!("{}: tensor size overflows", entry.key))?;
                let before = jobs.len();
                push_piece_jobs(piece_reader, entry, to, n, &mut jobs);
                job_tensor.resize(jobs.len(), t);
                debug_assert!(jobs.len() > before);
            }
            Ok((order, job_tensor, jobs))
        };
    let (_, _, all_jobs) = jobs_of(&specs)?;
    let (exec_opts, limit) = fix_limit(reader, &all_jobs, &opts.exec)?;
    let source = reader.source();
    // `--write-manifest`: every tensor by its name (the values in `__metadata__` are text there, which
    // `hash` does not read as values), every tensor file by its name.
    let sink = opts.manifest.map(ManifestSink::new);
    let mut slots = BTreeMap::new();
    if let Some(sink) = &sink {
        for spec in &specs {
            let slot = sink.tensor(vec![spec.name.clone()], spec.dtype, &spec.shape, &[])?;
            slots.insert(spec.name.clone(), slot);
        }
    }
    let write_one = |out: &mut dyn Write, file_specs: &[TensorSpec], file: &str| -> Result<()> {
        let (order, job_tensor, jobs) = jobs_of(file_specs)?;
        let mut tap = Tap::new(out, opts.manifest);
        let mut writer = SafetensorsWriter::new(&mut tap, file_specs, Some(&metadata))?;
        exec::run(piece_reader, &jobs, &exec_opts, |i, bytes| {
            let name = &order[job_tensor[i]];
            writer.write_tensor_part(name, bytes)?;
            if let Some(sink) = &sink {
                let at = jobs[i].range.as_ref().map_or(0, |r| r.start);
                sink.bytes(slots[name], at, bytes)?;
            }
            progress.advance(bytes.len() as u64);
            Ok(())
        })?;
        writer.finish()?;
        if let Some(sink) = &sink {
            sink.file(file, tap);
        }
        Ok(())
    };
    let mut outputs = vec![dest.display().to_string()];
    let mut complete = true;
    let manifest;
    match max_shard_bytes {
        None => {
            let file = dest
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            manifest = atomic::together(|| {
                atomic::write_file(dest, |out| write_one(out, &specs, &file))?;
                sink.as_ref()
                    .map(|sink| write_beside(sink, dest))
                    .transpose()
            })?;
        }
        Some(limit) => {
            let plan = plan_shards(&specs, Some(limit), "model")?;
            let names: Vec<String> = plan.files.iter().map(|f| f.file_name.clone()).collect();
            // The index (when sharded) and the files beside the tensors (`config.json`, tokenizer),
            // written last: the directory is complete once they are there.
            let final_names: Vec<&str> = plan
                .needs_index()
                .then_some("model.safetensors.index.json")
                .into_iter()
                .chain(extra_files.iter().map(|(n, _)| n.as_str()))
                .collect();
            let fingerprint = part::fingerprint(&format!(
                "safetensors shards\n{specs:?}\n{metadata:?}\n{plan:?}\n{}",
                source_identity(source)
            ));
            let multi = part::Plan {
                dest,
                files: &names,
                final_names: &final_names,
                fingerprint: &fingerprint,
            };
            let outcome = write_multi(
                &multi,
                opts,
                &mut |i, out| {
                    let file_specs: Vec<TensorSpec> = plan.files[i]
                        .tensors
                        .iter()
                        .map(|&t| specs[t].clone())
                        .collect();
                    write_one(out, &file_specs, &names[i])?;
                    Ok(serde_json::Value::Null)
                },
                &|_| {
                    let mut files = Vec::new();
                    if plan.needs_index() {
                        files.push(index_json(&plan, &specs).into_bytes());
                    }
                    files.extend(extra_files.iter().map(|(_, b)| b.clone()));
                    Ok(files)
                },
                sink.as_ref(),
            )?;
            manifest = outcome.manifest;
            complete = outcome.finalized;
            outputs.extend(
                outcome
                    .written
                    .iter()
                    .map(|n| dest.join(n).display().to_string()),
            );
        }
    }
    Ok(Written {
        outputs,
        tensors: sel.tensors.len(),
        values: sel.values.len(),
        tensor_bytes: sel.tensor_bytes(),
        largest_tensor_bytes: largest(sel),
        memory_limit_bytes: limit,
        complete,
        manifest,
        undigested: sink.map(|s| s.undigested()).unwrap_or_default(),
    })
}
