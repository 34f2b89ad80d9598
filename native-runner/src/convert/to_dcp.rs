//! The DCP writer: every tensor cut into dim-0 chunks for N ranks as FSDP1 or FSDP2 shards it,
//! non-tensor values as bytes items on rank 0; `--part` records of the rank files.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail};
use shardscope_core::formats::write::dcp::{
    BytesValue, DcpChunk, DcpEntry, DcpFileRecord, DcpFileWriter, DcpItemRef, DcpMetadataOptions,
    DcpPlan, DcpValue, EmptyRanks, PathKey, StoredItem, chunk_dim0, metadata_pickle,
};
use shardscope_core::index::{EntryKind, IndexEntry};

use super::exec;
use super::jobs::{fix_limit, largest};
use super::manifest::{ManifestSink, Tap};
use super::multi::{source_identity, write_multi};
use super::part;
use super::reader::Reader;
use super::select::Selection;
use super::values::py_value_of;
use super::{Progress, WriteOptions, Written};

/// How tensors are cut into per-rank chunks when writing DCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShardApi {
    /// FSDP1 `ShardedTensor`: `torch.chunk` dim-0 pieces; ranks past the data hold nothing.
    Fsdp1,
    /// FSDP2 `DTensor` `Shard(0)`: the same pieces; ranks past the data hold zero-size chunks.
    Fsdp2,
}

/// Writes the selection as a DCP directory `dest` for `world_size` ranks: every tensor cut into
/// dim-0 chunks as FSDP shards it, non-tensor values as bytes items on rank 0. `nest` puts every
/// key under one more level (`--nest model` gives the `{"model": ...}` that `dcp.load` of an
/// `{"model": model.state_dict()}` expects). `companions` are files written beside them as given
/// (Megatron-core's `metadata.json` and `common.pt`), before `.metadata`.
#[expect(
    clippy::too_many_arguments,
    reason = "the DCP options are the CLI's flags, passed through one by one"
)]
#[allow(
    clippy::too_many_lines,
    reason = "plans the DCP items, chunk byte ranges and per-rank reads in one pass over the index"
)]
pub fn to_dcp(
    reader: &mut Reader<'_>,
    sel: &Selection<'_>,
    dest: &Path,
    world_size: usize,
    api: ShardApi,
    nest: Option<&str>,
    companions: &[(String, Vec<u8>)],
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<Written> {
    let empty = match api {
        ShardApi::Fsdp1 => EmptyRanks::Omit,
        ShardApi::Fsdp2 => EmptyRanks::ZeroSize,
    };
    let mut entries = Vec::new();
    // Per tensor entry: the byte range of each chunk in the full tensor, in chunk order.
    let mut ranges: Vec<Vec<std::ops::Range<u64>>> = Vec::new();
    let mut sources: Vec<&IndexEntry> = Vec::new();
    // `--write-manifest`: each tensor by its key with its chunks, each value by its JSON form; the
    // slot of each entry (values have none).
    let sink = opts.manifest.map(ManifestSink::new);
    let mut slots: Vec<usize> = Vec::new();
    for (name, e) in sel.tensors.iter().chain(&sel.values) {
        let mut path: Vec<PathKey> = nest
            .map(|n| PathKey::Key(n.to_owned()))
            .into_iter()
            .collect();
        path.push(PathKey::Key(name.clone()));
        let fqn = PathKey::join(&path);
        let value = if e.kind == EntryKind::Tensor {
            let (dtype, shape) = sel.out_meta(e)?;
            let mut pieces =
                chunk_dim0(dtype, shape, world_size, empty).with_context(|| e.key.clone())?;
            // Trailing empty DTensor shards all sit at offset `dim0`; torch's coordinator keeps
            // one item per `MetadataIndex(fqn, offsets)` (spec 5.3), so one zero-size chunk.
            let mut seen = BTreeSet::new();
            pieces.retain(|p| seen.insert(p.chunk.offsets.clone()));
            ranges.push(pieces.iter().map(|p| p.bytes.clone()).collect());
            if let Some(sink) = &sink {
                let boxes: Vec<(Vec<u64>, Vec<u64>)> = pieces
                    .iter()
                    .map(|p| (p.chunk.offsets.clone(), p.chunk.sizes.clone()))
                    .collect();
                slots.push(sink.tensor(vec![fqn.clone()], dtype, shape, &boxes)?);
            }
            DcpValue::Tensor {
                dtype,
                size: shape.to_vec(),
                chunks: pieces
                    .into_iter()
                    .map(|p| p.chunk)
                    .collect::<Vec<DcpChunk>>(),
            }
        } else {
            ranges.push(Vec::new());
            if let Some(sink) = &sink {
                sink.value(&fqn, &reader.index().read_bytes_value(reader.source(), e)?);
                slots.push(usize::MAX);
            }
            DcpValue::Bytes {
                rank: 0,
                value: BytesValue::Value(py_value_of(reader, e)?),
            }
        };
        sources.push(e);
        entries.push(DcpEntry { fqn, path, value });
    }
    let plan = DcpPlan::new(world_size, entries)?;
    // Per rank file: its chunk items, in write order, as executor jobs.
    let rank_jobs: Vec<Vec<exec::Job<'_>>> = (0..world_size)
        .map(|rank| {
            plan.items(rank)
                .iter()
                .filter_map(|item| match *item {
                    DcpItemRef::Chunk { entry, chunk } => Some((entry, chunk)),
                    DcpItemRef::Bytes { .. } => None,
                })
                .map(|(entry, chunk)| {
                    let (to, _) = sel.out_meta(sources[entry])?;
                    Ok(exec::Job {
                        entry: sources[entry],
                        to,
                        range: Some(ranges[entry][chunk].clone()),
                    })
                })
                .collect::<Result<_>>()
        })
        .collect::<Result<_>>()?;
    // The entry of each job, per rank file (for the manifest).
    let rank_entries: Vec<Vec<usize>> = (0..world_size)
        .map(|rank| {
            plan.items(rank)
                .iter()
                .filter_map(|item| match *item {
                    DcpItemRef::Chunk { entry, .. } => Some(entry),
                    DcpItemRef::Bytes { .. } => None,
                })
                .collect()
        })
        .collect();
    let all_jobs: Vec<exec::Job<'_>> = rank_jobs.iter().flatten().cloned().collect();
    let (exec_opts, limit) = fix_limit(reader, &all_jobs, &opts.exec)?;
    let names: Vec<String> = (0..world_size).map(DcpPlan::file_name).collect();
    let fingerprint = part::fingerprint(&format!(
        "dcp\n{plan:?}\n{ranges:?}\n{}",
        source_identity(reader.source())
    ));
    // `.metadata` last: a DCP directory is complete once it is there.
    let final_names: Vec<&str> = companions
        .iter()
        .map(|(n, _)| n.as_str())
        .chain([".metadata"])
        .collect();
    let multi = part::Plan {
        dest,
        files: &names,
        final_names: &final_names,
        fingerprint: &fingerprint,
    };
    let template: &Reader<'_> = reader;
    let outcome = write_multi(
        &multi,
        opts,
        &mut |rank, out| {
            let mut tap = Tap::new(out, opts.manifest);
            let mut writer = DcpFileWriter::new(&plan, rank, &mut tap)?;
            let jobs = &rank_jobs[rank];
            exec::run(template, jobs, &exec_opts, |i, bytes| {
                writer.write_chunk(bytes)?;
                if let Some(sink) = &sink {
                    let at = jobs[i].range.as_ref().map_or(0, |r| r.start);
                    sink.bytes(slots[rank_entries[rank][i]], at, bytes)?;
                }
                progress.advance(bytes.len() as u64);
                Ok(())
            })?;
            let (_, record) = writer.finish()?;
            if let Some(sink) = &sink {
                sink.file(&names[rank], tap);
            }
            Ok(record_to_json(&record))
        },
        &|records| {
            let records = records
                .iter()
                .map(record_from_json)
                .collect::<Result<Vec<_>>>()?;
            let mut files: Vec<Vec<u8>> = companions.iter().map(|(_, b)| b.clone()).collect();
            let metadata = metadata_pickle(&plan, &records, &DcpMetadataOptions::default())?;
            if let Some(sink) = &sink {
                sink.file_bytes(".metadata", &metadata);
            }
            files.push(metadata);
            Ok(files)
        },
        sink.as_ref(),
    )?;
    let mut outputs = vec![dest.display().to_string()];
    outputs.extend(
        outcome
            .written
            .iter()
            .map(|n| dest.join(n).display().to_string()),
    );
    Ok(Written {
        outputs,
        tensors: sel.tensors.len(),
        values: sel.values.len(),
        tensor_bytes: sel.tensor_bytes(),
        largest_tensor_bytes: largest(sel),
        memory_limit_bytes: limit,
        complete: outcome.finalized,
        manifest: outcome.manifest,
        undigested: sink.map(|s| s.undigested()).unwrap_or_default(),
    })
}

/// A rank file's record as JSON for its part marker: `[[kind, entry, chunk, offset, length]]`,
/// kind `0` a bytes item (chunk 0), `1` a tensor chunk.
fn record_to_json(record: &DcpFileRecord) -> serde_json::Value {
    let items: Vec<[u64; 5]> = record
        .items
        .iter()
        .map(|s| {
            let (kind, entry, chunk) = match s.item {
                DcpItemRef::Bytes { entry } => (0, entry, 0),
                DcpItemRef::Chunk { entry, chunk } => (1, entry, chunk),
            };
            [kind, entry as u64, chunk as u64, s.offset, s.length]
        })
        .collect();
    serde_json::json!({ "rank": record.rank, "items": items })
}

fn record_from_json(value: &serde_json::Value) -> Result<DcpFileRecord> {
    #[derive(serde::Deserialize)]
    struct Json {
        rank: usize,
        items: Vec<[u64; 5]>,
    }
    let json: Json =
        serde_json::from_value(value.clone()).context("a part marker's DCP record is malformed")?;
    let index = |v: u64| usize::try_from(v).context("a part marker's DCP record is malformed");
    let items = json
        .items
        .iter()
        .map(|&[kind, entry, chunk, offset, length]| {
            let item = match kind {
                0 => DcpItemRef::Bytes {
                    entry: index(entry)?,
                },
                1 => DcpItemRef::Chunk {
                    entry: index(entry)?,
                    chunk: index(chunk)?,
                },
                _ => bail!("a part marker's DCP record has an unknown item kind {kind}"),
            };
            Ok(StoredItem {
                item,
                offset,
                length,
            })
        })
        .collect::<Result<_>>()?;
    Ok(DcpFileRecord {
        rank: json.rank,
        items,
    })
}
