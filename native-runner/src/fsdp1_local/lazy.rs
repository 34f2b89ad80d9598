//! Lazy per-rank `torch.save` inputs and tensor-at-a-time `torch.save` outputs.
//!
//! - [`LazyFile`]: a `torch.save` file whose pickle and storage table are read once (through the
//!   [`FileSource`], which reads the zip directory and `data.pkl` only); tensor bytes are read
//!   later with positioned reads of exactly the elements needed, so nothing stays resident after
//!   use.
//! - Skeletons: a [`Node`] whose tensors carry dtype and shape but no bytes (see
//!   [`bridge::node_from_archive`]); every tensor is named by its path in the tree (`/state/3/exp_avg`,
//!   the path format of the bridge). An output file is planned from a skeleton and each storage is
//!   produced on demand ([`write_torch_save`]).

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use shardscope_core::bridge::{self, BridgeError, RootDict};
use shardscope_core::formats::pickle::TensorRef;
use shardscope_core::formats::torch_zip::{self, MemberRange, TorchArchive};
use shardscope_core::model::tree::{Node, Tensor};

use super::Fsdp1LocalError;
use crate::file_source::FileSource;

type Result<T> = std::result::Result<T, Fsdp1LocalError>;

/// One input file: its archive structure in memory, its bytes on disk.
#[derive(Debug)]
pub struct LazyFile {
    /// The file.
    pub path: PathBuf,
    file: File,
    archive: TorchArchive,
    /// Tensor path -> view and storage member range, filled by [`LazyFile::skeleton`].
    tensors: HashMap<String, (TensorRef, MemberRange)>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Fsdp1LocalError + '_ {
    move |source| Fsdp1LocalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl LazyFile {
    /// Reads the archive structure of `path` and converts its pickle to a skeleton.
    pub fn open(path: &Path) -> Result<(Self, Node)> {
        let name = path.display().to_string();
        let archive = {
            let source = FileSource::file(path).map_err(|e| Fsdp1LocalError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(format!("{e:#}")),
            })?;
            let member = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            // By range: the zip directory, local headers and data.pkl, not the tensor bytes.
            torch_zip::read_archive_from(&source, member).map_err(|e| match e {
                torch_zip::ArchiveFileError::Source(source) => BridgeError::Source {
                    file: name.clone(),
                    source,
                },
                torch_zip::ArchiveFileError::Archive(source) => BridgeError::Archive {
                    file: name.clone(),
                    source,
                },
            })?
        };
        let file = File::open(path).map_err(io_err(path))?;
        let mut lazy = LazyFile {
            path: path.to_path_buf(),
            file,
            archive,
            tensors: HashMap::new(),
        };
        let seen = std::cell::RefCell::new(HashMap::new());
        let node = bridge::node_from_archive(&lazy.archive, &name, &|t, range, p| {
            seen.borrow_mut().insert(p.to_owned(), (t.clone(), range));
            Ok(None)
        })?;
        lazy.tensors = seen.into_inner();
        Ok((lazy, node))
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn entry(&self, path: &str) -> Result<&(TensorRef, MemberRange)> {
        self.tensors
            .get(path)
            .ok_or_else(|| Fsdp1LocalError::Content {
                file: self.path.clone(),
                reason: format!("no tensor at `{path}`"),
            })
    }

    fn read_at(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let n = usize::try_from(len).map_err(|_| Fsdp1LocalError::Content {
            file: self.path.clone(),
            reason: format!("{len} bytes at {offset} do not fit in memory"),
        })?;
        let mut buf = vec![0u8; n];
        self.read_into(offset, &mut buf)?;
        Ok(buf)
    }

    fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(io_err(&self.path))
    }

    /// The contiguous bytes of the tensor at `path`.
    pub fn read_tensor(&self, path: &str) -> Result<Vec<u8>> {
        let (t, range) = self.entry(path)?;
        let item = t.storage.dtype.size_bytes() as u64;
        let numel = t.numel().unwrap_or(0);
        if t.is_contiguous() {
            // The view was checked against its storage member when the archive was read.
            self.read_at(range.offset + t.storage_offset * item, numel * item)
        } else {
            let storage = self.read_at(range.offset, range.len)?;
            Ok(
                torch_zip::gather_view(&storage, t).map_err(|source| BridgeError::Archive {
                    file: self.name(),
                    source,
                })?,
            )
        }
    }

    /// Elements `first..` of the tensor at `path` (flattened in row-major order) into `out`, which
    /// holds a whole number of elements.
    pub fn read_elems_into(&self, path: &str, first: u64, out: &mut [u8]) -> Result<()> {
        let (t, range) = self.entry(path)?;
        let item = t.storage.dtype.size_bytes() as u64;
        let numel = t.numel().unwrap_or(0);
        let n = out.len() as u64 / item.max(1);
        if !(out.len() as u64).is_multiple_of(item.max(1))
            || first.checked_add(n).is_none_or(|end| end > numel)
        {
            return Err(Fsdp1LocalError::Content {
                file: self.path.clone(),
                reason: format!(
                    "`{path}`: elements {first}..{} of a tensor of shape {:?}",
                    first.saturating_add(n),
                    t.shape
                ),
            });
        }
        if t.is_contiguous() {
            let start = t.storage_offset + first;
            self.read_into(range.offset + start * item, out)
        } else {
            let all = self.read_tensor(path)?;
            let a = (first * item) as usize;
            out.copy_from_slice(&all[a..a + out.len()]);
            Ok(())
        }
    }

    /// The dtype of the tensor at `path`, when there is one.
    pub fn dtype_at(&self, path: &str) -> Option<shardscope_core::DType> {
        self.tensors.get(path).map(|(t, _)| t.storage.dtype)
    }

    /// `node` (a skeleton of this file, or a part of it found at `path`) with every tensor read.
    pub fn materialize(&self, node: &Node, path: &str) -> Result<Node> {
        Ok(match node {
            Node::Tensor(t) => Node::Tensor(Tensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: self.read_tensor(path)?,
            }),
            Node::Dist(d) => {
                let mut d = d.clone();
                if let Some((_, t)) = &mut d.local {
                    t.data = self.read_tensor(path)?;
                }
                Node::Dist(d)
            }
            Node::Dict(d) => Node::Dict(
                d.iter()
                    .map(|(k, v)| Ok((k.clone(), self.materialize(v, &format!("{path}/{k}"))?)))
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .collect(),
            ),
            Node::List(items) => Node::List(self.materialize_items(items, path)?),
            Node::Tuple(items) => Node::Tuple(self.materialize_items(items, path)?),
            other => other.clone(),
        })
    }

    fn materialize_items(&self, items: &[Node], path: &str) -> Result<Vec<Node>> {
        items
            .iter()
            .enumerate()
            .map(|(i, x)| self.materialize(x, &format!("{path}/{i}")))
            .collect()
    }
}

/// The paths of every tensor of `node` in the order `torch.save` stores them (the storage table
/// order of [`bridge::plan_torch_save`]: depth first, dict order, a ShardedTensor's local shard).
pub(super) fn tensor_paths(node: &Node, path: &str, out: &mut Vec<String>) {
    match node {
        Node::Tensor(_) => out.push(path.to_owned()),
        Node::Dist(d) if d.local.is_some() => out.push(path.to_owned()),
        Node::Dict(d) => {
            for (k, v) in d.iter() {
                tensor_paths(v, &format!("{path}/{k}"), out);
            }
        }
        Node::List(items) | Node::Tuple(items) => {
            for (i, x) in items.iter().enumerate() {
                tensor_paths(x, &format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// `node` with every tensor's bytes dropped (dtype and shape kept), and its tensors by path.
#[allow(clippy::implicit_hasher)]
pub fn split_tensors(node: Node, path: &str, out: &mut HashMap<String, Vec<u8>>) -> Node {
    match node {
        Node::Tensor(mut t) => {
            out.insert(path.to_owned(), std::mem::take(&mut t.data));
            Node::Tensor(t)
        }
        Node::Dist(mut d) => {
            if let Some((_, t)) = &mut d.local {
                out.insert(path.to_owned(), std::mem::take(&mut t.data));
            }
            Node::Dist(d)
        }
        Node::Dict(d) => Node::Dict(
            d.into_entries()
                .into_iter()
                .map(|(k, v)| {
                    let p = format!("{path}/{k}");
                    (k, split_tensors(v, &p, out))
                })
                .collect(),
        ),
        Node::List(items) => Node::List(split_items(items, path, out)),
        Node::Tuple(items) => Node::Tuple(split_items(items, path, out)),
        other => other,
    }
}

fn split_items(items: Vec<Node>, path: &str, out: &mut HashMap<String, Vec<u8>>) -> Vec<Node> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, x)| split_tensors(x, &format!("{path}/{i}"), out))
        .collect()
}

/// `torch.save(skeleton)` into `out`, storage by storage: `fill(path, buf)` gives the bytes of the
/// tensor at `path` when the writer needs them, in `buf` (an empty buffer, recycled from an earlier
/// storage: reuse it). Returns `out`.
/// `group` and `global` are the `(rank, size)` recorded in ShardedTensors (see
/// [`bridge::plan_torch_save_in_group`]).
pub fn write_torch_save<W: Write>(
    out: W,
    skeleton: &Node,
    root: RootDict,
    group: (u64, u64),
    global: (u64, u64),
    pool: &BufferPool,
    fill: impl FnMut(&str, Vec<u8>) -> Result<Vec<u8>> + Send,
) -> Result<W> {
    let plan = bridge::plan_torch_save_in_group(skeleton, root, group, global)?;
    write_plan(out, skeleton, &plan, pool, fill)
}

/// As [`write_torch_save`] for an FSDP2 per-rank file: DTensors on `mesh` (see
/// [`bridge::plan_torch_save_on_mesh`]).
pub fn write_torch_save_on_mesh<W: Write>(
    out: W,
    skeleton: &Node,
    root: RootDict,
    mesh: &bridge::DeviceMeshSpec,
    pool: &BufferPool,
    fill: impl FnMut(&str, Vec<u8>) -> Result<Vec<u8>> + Send,
) -> Result<W> {
    let plan = bridge::plan_torch_save_on_mesh(skeleton, root, mesh)?;
    write_plan(out, skeleton, &plan, pool, fill)
}

/// Tensor buffers kept between the files of one output (reused, never freed on another thread
/// than the one using them next), and the bytes they may take together.
#[derive(Debug, Default)]
pub struct BufferPool {
    buffers: std::sync::Mutex<Vec<Vec<u8>>>,
    limit: u64,
}

impl BufferPool {
    /// A pool whose buffers take at most `limit` bytes (or one storage, when that is larger):
    /// while one storage is written, the next ones are read if they fit, so reads and writes
    /// overlap.
    pub fn with_limit(limit: u64) -> Self {
        Self {
            buffers: std::sync::Mutex::default(),
            limit,
        }
    }

    fn take(&self) -> Vec<Vec<u8>> {
        std::mem::take(
            &mut *self
                .buffers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn put(&self, buffers: Vec<Vec<u8>>) {
        self.buffers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(buffers);
    }
}

/// Writes `plan`: a reader thread produces each tree storage with `fill` (in order) while this
/// thread writes the previous ones; the buffers alive at once stay within the pool's limit (or
/// the largest storage, when that is larger). The output is the same as writing one storage after the other.
#[allow(
    clippy::too_many_lines,
    reason = "the writer loop and its reader thread share the buffer pool and the memory budget"
)]
fn write_plan<W: Write>(
    out: W,
    skeleton: &Node,
    plan: &bridge::TorchSavePlan<'_>,
    pool: &BufferPool,
    fill: impl FnMut(&str, Vec<u8>) -> Result<Vec<u8>> + Send,
) -> Result<W> {
    use std::sync::mpsc;

    let mut paths = Vec::new();
    tensor_paths(skeleton, "", &mut paths);
    let from_tree = plan.from_tree.iter().filter(|&&t| t).count();
    if paths.len() != from_tree || plan.from_tree.len() != plan.storages.len() {
        return Err(Fsdp1LocalError::Content {
            file: PathBuf::from("<output>"),
            reason: format!("{} tensors but {from_tree} storages planned", paths.len()),
        });
    }
    let bytes_of = |spec: &shardscope_core::formats::write::pickle::StorageSpec| {
        spec.numel.saturating_mul(spec.dtype.size_bytes() as u64)
    };
    let sizes: Vec<u64> = plan
        .storages
        .iter()
        .zip(&plan.from_tree)
        .filter(|(_, t)| **t)
        .map(|((spec, _), _)| bytes_of(spec))
        .collect();
    let budget = sizes.iter().copied().max().unwrap_or(0).max(pool.limit);
    let specs = plan.storages.iter().map(|(s, _)| *s).collect();
    let mut writer = shardscope_core::formats::write::torch_save::TorchSaveWriter::with_globals(
        out,
        "archive",
        &plan.root,
        specs,
        plan.needs_globals,
    )
    .map_err(BridgeError::from)?;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<Result<Vec<u8>>>();
        // Written buffers go back to the reader thread, which reuses them: no allocation per
        // storage, and no buffer freed on another thread than the one that allocated it.
        let (back, returned) = mpsc::channel::<Vec<u8>>();
        let (paths, sizes) = (&paths, &sizes);
        let reader = scope.spawn(move || {
            let mut fill = fill;
            // Buffers written and returned; the capacity of every buffer alive (these and the
            // ones filled and not yet written) stays within `budget`.
            let cap = |b: &Vec<u8>| b.capacity() as u64;
            let mut held = pool.take();
            let mut alive: u64 = held.iter().map(cap).sum();
            let mut pool = std::mem::take(&mut held);
            for (path, &size) in paths.iter().zip(sizes) {
                let buf = loop {
                    pool.extend(returned.try_iter());
                    let fit = (0..pool.len())
                        .filter(|&i| cap(&pool[i]) >= size)
                        .min_by_key(|&i| cap(&pool[i]));
                    if let Some(i) = fit {
                        break pool.swap_remove(i);
                    }
                    for b in pool.drain(..) {
                        alive = alive.saturating_sub(cap(&b));
                    }
                    if alive == 0 || alive.saturating_add(size) <= budget {
                        let b = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
                        alive = alive.saturating_add(cap(&b));
                        break b;
                    }
                    // Wait for the writer to hand a buffer back.
                    match returned.recv() {
                        Ok(b) => pool.push(b),
                        Err(_) => return pool,
                    }
                };
                let before = cap(&buf);
                let data = fill(path, buf);
                if let Ok(d) = &data {
                    alive = alive.saturating_sub(before).saturating_add(cap(d));
                }
                let failed = data.is_err();
                if tx.send(data).is_err() || failed {
                    return pool;
                }
            }
            pool
        });
        // Buffers written after the reader finished.
        let mut late = Vec::new();
        let result = (|| {
            for ((_, bytes), &tree) in plan.storages.iter().zip(&plan.from_tree) {
                if tree {
                    let mut data = rx.recv().map_err(|_| Fsdp1LocalError::Content {
                        file: PathBuf::from("<output>"),
                        reason: "the reader of the tensors stopped".to_owned(),
                    })??;
                    writer.write_storage(&data).map_err(BridgeError::from)?;
                    data.clear();
                    if let Err(mpsc::SendError(data)) = back.send(data) {
                        late.push(data);
                    }
                } else {
                    writer.write_storage(bytes).map_err(BridgeError::from)?;
                }
            }
            Ok(writer.finish().map_err(BridgeError::from)?)
        })();
        // The reader stops at its next send or wait; its buffers (and the written ones) serve the
        // next file.
        drop(back);
        drop(rx);
        if let Ok(mut kept) = reader.join() {
            kept.append(&mut late);
            pool.put(kept);
        }
        result
    })
}
