//! The `torch.save` writer: the entries nested as `dcp_to_torch_save` nests them, tensors streamed
//! into their zip members, tied names sharing one storage.

use std::path::Path;

use anyhow::{Context, Result, bail};
use shardscope_core::formats::write::pickle::{PyValue, StorageSpec, TensorPickle};
use shardscope_core::formats::write::torch_save::TorchSaveWriter;
use shardscope_core::index::{ChunkEncoding, EntryKind, IndexEntry, PathSeg};

use crate::atomic;

use super::exec;
use super::jobs::{fix_limit, largest, push_piece_jobs};
use super::manifest::{ManifestSink, Tap, write_beside};
use super::reader::Reader;
use super::select::Selection;
use super::values::py_value_of;
use super::{Progress, WriteOptions, Written};

/// The nested state dict rebuilt from entry paths: containers by path segment, leaves by entry.
enum KeyTree {
    Map(Vec<(PathSeg, KeyTree)>),
    Leaf(usize),
}

fn insert(node: &mut KeyTree, path: &[PathSeg], leaf: usize, key: &str) -> Result<()> {
    let KeyTree::Map(children) = node else {
        bail!("{key}: its path goes through a value that is not a container");
    };
    let (first, rest) = path.split_first().context("empty path")?;
    let pos = children.iter().position(|(k, _)| k == first);
    if rest.is_empty() {
        if pos.is_some() {
            bail!("{key}: two entries have this path");
        }
        children.push((first.clone(), KeyTree::Leaf(leaf)));
        return Ok(());
    }
    let i = if let Some(i) = pos {
        i
    } else {
        children.push((first.clone(), KeyTree::Map(Vec::new())));
        children.len() - 1
    };
    insert(&mut children[i].1, rest, leaf, key)
}

/// The storage table of a `torch.save` output: `(spec, leaf)` in table order, and which table
/// entry holds the bytes of a given chunk list (tied names share one).
#[derive(Default)]
struct Storages {
    list: Vec<(StorageSpec, usize)>,
    by_chunks: std::collections::HashMap<String, usize>,
    /// `(leaf, storage)` of every tensor leaf.
    of_leaf: Vec<(usize, usize)>,
}

fn to_py(
    node: &KeyTree,
    leaves: &[(String, &IndexEntry)],
    reader: &Reader<'_>,
    sel: &Selection<'_>,
    storages: &mut Storages,
) -> Result<PyValue> {
    match node {
        KeyTree::Leaf(i) => {
            let e = leaves[*i].1;
            if e.kind == EntryKind::Tensor {
                let (dtype, shape) = sel.out_meta(e)?;
                let numel = shape.iter().product();
                // Names whose chunks are the same storage views (tied weights: one storage in a
                // `torch.save` source) share one storage, as torch saved them. DCP items are
                // separate objects even when their bytes coincide, so they never share.
                let raw_views = !e.chunks.is_empty()
                    && e.chunks
                        .iter()
                        .all(|c| matches!(c.encoding, ChunkEncoding::Raw { .. }));
                let signature =
                    raw_views.then(|| format!("{dtype:?} {:?} {:?}", e.shape, e.chunks));
                let same = signature
                    .as_ref()
                    .and_then(|sig| storages.by_chunks.get(sig).copied());
                let storage = if let Some(k) = same {
                    k
                } else {
                    storages.list.push((StorageSpec { dtype, numel }, *i));
                    let k = storages.list.len() - 1;
                    if let Some(sig) = signature {
                        storages.by_chunks.insert(sig, k);
                    }
                    k
                };
                storages.of_leaf.push((*i, storage));
                Ok(PyValue::Tensor(TensorPickle::contiguous(
                    storage, dtype, shape,
                )))
            } else {
                py_value_of(reader, e)
            }
        }
        KeyTree::Map(children) => {
            let is_list = children
                .first()
                .is_some_and(|(k, _)| matches!(k, PathSeg::Index(_)));
            if is_list {
                // `dcp_to_torch_save` grows lists to the largest index, filling gaps with None.
                let mut items: Vec<Option<&KeyTree>> = Vec::new();
                for (k, child) in children {
                    let PathSeg::Index(i) = k else {
                        bail!("a container mixes list indices and dict keys at `{k}`");
                    };
                    let i = usize::try_from(*i).context("negative list index")?;
                    if items.len() <= i {
                        items.resize(i + 1, None);
                    }
                    items[i] = Some(child);
                }
                Ok(PyValue::List(
                    items
                        .into_iter()
                        .map(|c| {
                            c.map_or(Ok(PyValue::None), |c| {
                                to_py(c, leaves, reader, sel, storages)
                            })
                        })
                        .collect::<Result<_>>()?,
                ))
            } else {
                Ok(PyValue::Dict(
                    children
                        .iter()
                        .map(|(k, child)| {
                            let key = match k {
                                PathSeg::Key(s) => PyValue::Str(s.clone()),
                                PathSeg::Index(i) | PathSeg::IntKey(i) => PyValue::Int(*i),
                            };
                            Ok((key, to_py(child, leaves, reader, sel, storages)?))
                        })
                        .collect::<Result<_>>()?,
                ))
            }
        }
    }
}

/// Writes the selection as one `torch.save` file, nested by the entries' paths as
/// `dcp_to_torch_save` nests them (`{"model": {...}, "optim": {"state": ..., "param_groups": [...]}}`),
/// loadable with `torch.load(weights_only=True)`. With `--select`, paths lose the selected prefix.
pub fn to_torch_save(
    reader: &mut Reader<'_>,
    sel: &Selection<'_>,
    prefix: Option<&str>,
    dest: &Path,
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<Written> {
    // In stored order (registration order for state dicts, `.metadata` order for DCP), as torch
    // nests them; entries without one (made by a view) after, by key.
    let mut leaves: Vec<(String, &IndexEntry)> =
        sel.tensors.iter().chain(&sel.values).cloned().collect();
    leaves.sort_by(|(a, ea), (b, eb)| {
        (ea.position.is_none(), ea.position, a).cmp(&(eb.position.is_none(), eb.position, b))
    });
    let strip = prefix.map_or(0, |p| p.matches('.').count() + 1);
    let mut root = KeyTree::Map(Vec::new());
    // Each leaf's key in the output (its path joined), for the manifest.
    let mut keys: Vec<String> = Vec::with_capacity(leaves.len());
    for (i, (_, e)) in leaves.iter().enumerate() {
        let path: Vec<PathSeg> = if e.path.is_empty() {
            vec![PathSeg::Key(e.key.clone())]
        } else {
            e.path.clone()
        };
        // `--select a.b` removes as many leading segments as the prefix joins, when they match.
        let path =
            if strip > 0 && path.len() > strip && join(&path[..strip]) == prefix.unwrap_or("") {
                path[strip..].to_vec()
            } else if strip > 0 {
                vec![PathSeg::Key(leaves[i].0.clone())]
            } else {
                path
            };
        keys.push(join(&path));
        insert(&mut root, &path, i, &e.key)?;
    }
    // A file whose whole content is one value (`torch.save(3)`, `torch.save(tensor)`): the
    // value itself, not a dict holding it.
    if strip == 0 && leaves.len() == 1 && leaves[0].1.path.is_empty() && leaves[0].1.key.is_empty()
    {
        root = KeyTree::Leaf(0);
        keys[0] = String::new();
    }
    let mut storages = Storages::default();
    let value = to_py(&root, &leaves, reader, sel, &mut storages)?;
    let archive = dest
        .file_stem()
        .and_then(|s| s.to_str())
        .filter(|s| !s.is_empty() && !s.contains('\n'))
        .unwrap_or("archive")
        .to_owned();
    // Large tensors stored in place are read and written in pieces (the storage's CRC-32 is
    // patched into its header when it ends): memory stays far below the tensor, and each piece is
    // still in the CPU cache when it is checksummed and written.
    let mut jobs: Vec<exec::Job<'_>> = Vec::with_capacity(storages.list.len());
    // The storage of each job.
    let mut job_storage: Vec<usize> = Vec::with_capacity(storages.list.len());
    for (k, (spec, leaf)) in storages.list.iter().enumerate() {
        let n = spec
            .numel
            .checked_mul(spec.dtype.size_bytes() as u64)
            .with_context(|| format!("{}: tensor size overflows", leaves[*leaf].1.key))?;
        push_piece_jobs(reader, leaves[*leaf].1, spec.dtype, n, &mut jobs);
        job_storage.resize(jobs.len(), k);
    }
    let (exec_opts, limit) = fix_limit(reader, &jobs, &opts.exec)?;
    // `--write-manifest`: one digest per storage, under the keys of every leaf viewing it.
    let sink = opts.manifest.map(ManifestSink::new);
    let storage_slot = match &sink {
        Some(sink) => declare(sink, &storages, &leaves, &keys, reader, sel)?,
        None => Vec::new(),
    };
    let file_name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let manifest = atomic::together(|| {
        atomic::write_file(dest, |out| {
            let mut tap = Tap::new(out, opts.manifest);
            let table = storages.list.iter().map(|(s, _)| *s).collect();
            let mut writer = TorchSaveWriter::new(&mut tap, &archive, &value, table)?;
            exec::run(reader, &jobs, &exec_opts, |i, bytes| {
                writer.write_storage_part(bytes)?;
                if let Some(sink) = &sink {
                    let at = jobs[i].range.as_ref().map_or(0, |r| r.start);
                    sink.bytes(storage_slot[job_storage[i]], at, bytes)?;
                }
                progress.advance(bytes.len() as u64);
                Ok(())
            })?;
            writer.finish()?;
            if let Some(sink) = &sink {
                sink.file(&file_name, tap);
            }
            Ok(())
        })?;
        sink.as_ref()
            .map(|sink| write_beside(sink, dest))
            .transpose()
    })?;
    Ok(Written {
        outputs: vec![dest.display().to_string()],
        tensors: sel.tensors.len(),
        values: sel.values.len(),
        tensor_bytes: sel.tensor_bytes(),
        largest_tensor_bytes: largest(sel),
        memory_limit_bytes: limit,
        complete: true,
        manifest,
        undigested: sink.map(|s| s.undigested()).unwrap_or_default(),
    })
}

/// Declares to `sink` each storage (under the keys of every leaf viewing it) and each value;
/// returns each storage's slot.
fn declare(
    sink: &ManifestSink,
    storages: &Storages,
    leaves: &[(String, &IndexEntry)],
    keys: &[String],
    reader: &Reader<'_>,
    sel: &Selection<'_>,
) -> Result<Vec<usize>> {
    let mut slots = Vec::with_capacity(storages.list.len());
    for (k, (spec, leaf)) in storages.list.iter().enumerate() {
        let names = storages
            .of_leaf
            .iter()
            .filter(|(_, s)| *s == k)
            .map(|(l, _)| keys[*l].clone())
            .collect();
        let (_, shape) = sel.out_meta(leaves[*leaf].1)?;
        slots.push(sink.tensor(names, spec.dtype, shape, &[])?);
    }
    for (i, (_, e)) in leaves.iter().enumerate() {
        if e.kind != EntryKind::Tensor {
            sink.value(
                &keys[i],
                &reader.index().read_bytes_value(reader.source(), e)?,
            );
        }
    }
    Ok(slots)
}

fn join(path: &[PathSeg]) -> String {
    path.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}
