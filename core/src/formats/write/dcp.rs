//! `torch.distributed.checkpoint` (DCP) directories that `torch.distributed.checkpoint.load` and
//! `format_utils.dcp_to_torch_save` accept, as `FileSystemWriter` (default `TORCH_SAVE` serialization,
//! one file per rank) writes them.
//!
//! # Layout written
//! - `__{rank}_0.distcp` for every rank `0..world_size` (empty when the rank holds nothing, as torch
//!   does): first the rank's bytes items (entry order), then its tensor chunks (entry order, chunk
//!   order). Each item is a complete `torch.save` archive ([`super::torch_save`]): a tensor chunk is
//!   `torch.save(chunk_tensor)`, a bytes item is `torch.save(value)`.
//! - `.metadata`: a pickle of `Metadata(state_dict_metadata, planner_data, storage_data, storage_meta,
//!   version="1.0.0")` with `TensorStorageMetadata(TensorProperties(dtype, ...), torch.Size(size),
//!   [ChunkStorageMetadata(offsets, sizes), ...])` per tensor, `BytesStorageMetadata()` per bytes item,
//!   `planner_data[fqn] = path` (the nested-dict path that `dcp_to_torch_save` rebuilds), and
//!   `storage_data[MetadataIndex(fqn, offsets, index)] = _StorageInfo(file, offset, length)`.
//!
//! # Use
//! 1. Describe the checkpoint as [`DcpEntry`]s (a tensor: dtype, global size, chunks with their ranks;
//!    or a bytes item on one rank) and build a [`DcpPlan`] (it checks that every tensor's chunks tile it
//!    exactly). [`chunk_dim0`] cuts a tensor into `torch.chunk` dim-0 chunks over N ranks (FSDP1
//!    `ShardedTensor`, FSDP2 `DTensor` `Shard(0)`).
//! 2. For each rank, open its file ([`DcpPlan::file_name`]) and stream chunks through a
//!    [`DcpFileWriter`]: it writes the bytes items itself, then takes each chunk's contiguous data in
//!    the order [`DcpFileWriter::next_chunk`] names; `finish` returns a [`DcpFileRecord`].
//! 3. Write [`metadata_pickle`] of the plan and all records as `.metadata` (last, as torch does).
//!
//! Only one chunk's data is held at a time.

use std::io::Write;
use std::ops::Range;

use super::pickle::{PickleWriteError, PyValue, to_pickle};
use super::torch_save::{TorchSaveError, tensor_to_vec, torch_save_to_vec};
use super::{CountingWriter, TensorRef};
use crate::dtype::DType;
use crate::shape::{chunk_range, shard_size_and_offset};
use crate::shape::{contiguous_strides, nbytes, numel};

const METADATA_MODULE: &str = "torch.distributed.checkpoint.metadata";
const FILESYSTEM_MODULE: &str = "torch.distributed.checkpoint.filesystem";
/// `Metadata.version` written by current releases.
pub const DCP_VERSION: &str = "1.0.0";

/// One component of an entry's path in the nested state dict (`planner_data`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathKey {
    /// A dict key.
    Key(String),
    /// A list index.
    Index(u64),
}

impl PathKey {
    /// The flattened key DCP derives from a path: components joined with `.`.
    pub fn join(path: &[PathKey]) -> String {
        path.iter()
            .map(|k| match k {
                PathKey::Key(s) => s.clone(),
                PathKey::Index(i) => i.to_string(),
            })
            .collect::<Vec<_>>()
            .join(".")
    }
}

/// One stored chunk of a tensor: the region `[offsets, offsets + sizes)` of the global tensor, written
/// by `rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpChunk {
    /// Start of the region in every dimension.
    pub offsets: Vec<u64>,
    /// Extent of the region in every dimension (zeros allowed).
    pub sizes: Vec<u64>,
    /// The rank whose file holds this chunk.
    pub rank: usize,
}

/// The value of a bytes item.
#[derive(Debug, Clone, PartialEq)]
pub enum BytesValue {
    /// A value to `torch.save` (ints, floats, strings, lists, tuples, dicts, ...).
    Value(PyValue),
    /// Bytes that already are a `torch.save` archive (e.g. copied from another DCP checkpoint).
    TorchSave(Vec<u8>),
}

/// What an entry stores.
#[derive(Debug, Clone, PartialEq)]
pub enum DcpValue {
    /// A tensor stored as chunks.
    Tensor {
        /// Element type.
        dtype: DType,
        /// Global shape.
        size: Vec<u64>,
        /// The chunks; together they must cover the tensor exactly once.
        chunks: Vec<DcpChunk>,
    },
    /// A non-tensor value, stored once on `rank`.
    Bytes {
        /// The rank whose file holds it.
        rank: usize,
        /// The value.
        value: BytesValue,
    },
}

/// One flattened state-dict entry.
#[derive(Debug, Clone, PartialEq)]
pub struct DcpEntry {
    /// Flattened key (`model.layer.weight`, `optim.param_groups.0.lr`).
    pub fqn: String,
    /// Path in the nested state dict (`["optim", "param_groups", 0, "lr"]`); a top-level key is a
    /// one-element path.
    pub path: Vec<PathKey>,
    /// What is stored.
    pub value: DcpValue,
}

/// Which item of a rank's file comes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DcpItemRef {
    /// The bytes item of entry `entry`.
    Bytes {
        /// Index into [`DcpPlan::entries`].
        entry: usize,
    },
    /// Chunk `chunk` of tensor entry `entry`.
    Chunk {
        /// Index into [`DcpPlan::entries`].
        entry: usize,
        /// Index into that entry's chunks.
        chunk: usize,
    },
}

/// A DCP checkpoint could not be planned or written.
#[derive(Debug, thiserror::Error)]
pub enum DcpWriteError {
    /// The world size is zero.
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    /// Two entries have the same flattened key.
    #[error("key `{fqn}` appears twice")]
    DuplicateKey {
        /// The key.
        fqn: String,
    },
    /// An entry has an empty path.
    #[error("key `{fqn}` has an empty planner path")]
    EmptyPath {
        /// The key.
        fqn: String,
    },
    /// An item is assigned to a rank outside `0..world_size`.
    #[error("key `{fqn}` is assigned to rank {rank}, but the world size is {world_size}")]
    RankOutOfRange {
        /// The key.
        fqn: String,
        /// The rank given.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// A tensor has no chunk at all.
    #[error("tensor `{fqn}` has no chunks")]
    NoChunks {
        /// The key.
        fqn: String,
    },
    /// A chunk's rank differs from the tensor's, or it reaches outside the tensor.
    #[error(
        "tensor `{fqn}` of size {size:?}: chunk at offsets {offsets:?} with sizes {sizes:?} does not fit"
    )]
    ChunkOutOfBounds {
        /// The key.
        fqn: String,
        /// Global size.
        size: Vec<u64>,
        /// Chunk offsets.
        offsets: Vec<u64>,
        /// Chunk sizes.
        sizes: Vec<u64>,
    },
    /// Two chunks of a tensor overlap.
    #[error("tensor `{fqn}`: chunks at offsets {first:?} and {second:?} overlap")]
    ChunksOverlap {
        /// The key.
        fqn: String,
        /// Offsets of one chunk.
        first: Vec<u64>,
        /// Offsets of the other.
        second: Vec<u64>,
    },
    /// The chunks of a tensor leave elements uncovered.
    #[error("tensor `{fqn}`: chunks cover {covered} of {numel} elements")]
    ChunksIncomplete {
        /// The key.
        fqn: String,
        /// Elements covered.
        covered: u64,
        /// Elements in the tensor.
        numel: u64,
    },
    /// A size computation overflowed 64 bits.
    #[error("tensor `{fqn}` of size {size:?} overflows 64-bit byte counts")]
    TooLarge {
        /// The key.
        fqn: String,
        /// Global size.
        size: Vec<u64>,
    },
    /// `write_chunk` got a different number of bytes than the chunk needs.
    #[error("chunk {chunk} of tensor `{fqn}` must have {expected_bytes} bytes, got {actual_bytes}")]
    ChunkLength {
        /// The key.
        fqn: String,
        /// Chunk index.
        chunk: usize,
        /// Bytes needed.
        expected_bytes: u64,
        /// Bytes given.
        actual_bytes: u64,
    },
    /// `write_chunk` was called although all of the rank's chunks were written.
    #[error("all chunks of rank {rank} were already written")]
    NoMoreChunks {
        /// The rank.
        rank: usize,
    },
    /// `finish` was called before all of the rank's chunks were written.
    #[error("rank {rank}: chunk {chunk} of tensor `{fqn}` (and maybe more) was never written")]
    MissingChunk {
        /// The rank.
        rank: usize,
        /// The key of the first missing chunk.
        fqn: String,
        /// Its chunk index.
        chunk: usize,
    },
    /// `metadata_pickle` did not get exactly one finished record per rank.
    #[error("metadata needs one finished file record for each of ranks 0..{world_size}; {problem}")]
    Records {
        /// The world size.
        world_size: usize,
        /// What is wrong.
        problem: String,
    },
    /// An item could not be serialised with `torch.save`.
    #[error("cannot torch.save item `{fqn}`")]
    TorchSave {
        /// The key.
        fqn: String,
        /// The cause.
        #[source]
        source: TorchSaveError,
    },
    /// The metadata could not be pickled.
    #[error("cannot pickle .metadata")]
    Pickle(#[from] PickleWriteError),
    /// The underlying writer failed.
    #[error("writing {file} failed")]
    Io {
        /// File name.
        file: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A checked DCP checkpoint description: entries plus the per-rank item order.
#[derive(Debug, Clone)]
pub struct DcpPlan {
    world_size: usize,
    entries: Vec<DcpEntry>,
    items: Vec<Vec<DcpItemRef>>,
}

impl DcpPlan {
    /// Checks `entries` (unique keys, ranks in range, chunks tiling each tensor exactly) and orders
    /// each rank's items: bytes items first, then tensor chunks, both in entry order.
    pub fn new(world_size: usize, entries: Vec<DcpEntry>) -> Result<Self, DcpWriteError> {
        if world_size == 0 {
            return Err(DcpWriteError::ZeroWorldSize);
        }
        let mut keys = std::collections::BTreeSet::new();
        let mut bytes_items = vec![Vec::new(); world_size];
        let mut chunk_items = vec![Vec::new(); world_size];
        for (entry_index, entry) in entries.iter().enumerate() {
            let fqn = &entry.fqn;
            if !keys.insert(fqn.as_str()) {
                return Err(DcpWriteError::DuplicateKey { fqn: fqn.clone() });
            }
            if entry.path.is_empty() {
                return Err(DcpWriteError::EmptyPath { fqn: fqn.clone() });
            }
            let check_rank = |rank: usize| {
                if rank < world_size {
                    Ok(rank)
                } else {
                    Err(DcpWriteError::RankOutOfRange {
                        fqn: fqn.clone(),
                        rank,
                        world_size,
                    })
                }
            };
            match &entry.value {
                DcpValue::Bytes { rank, .. } => {
                    bytes_items[check_rank(*rank)?].push(DcpItemRef::Bytes { entry: entry_index });
                }
                DcpValue::Tensor {
                    dtype,
                    size,
                    chunks,
                } => {
                    check_tiling(fqn, *dtype, size, chunks)?;
                    for (chunk_index, chunk) in chunks.iter().enumerate() {
                        chunk_items[check_rank(chunk.rank)?].push(DcpItemRef::Chunk {
                            entry: entry_index,
                            chunk: chunk_index,
                        });
                    }
                }
            }
        }
        let items = bytes_items
            .into_iter()
            .zip(chunk_items)
            .map(|(mut bytes, chunks)| {
                bytes.extend(chunks);
                bytes
            })
            .collect();
        Ok(Self {
            world_size,
            entries,
            items,
        })
    }

    /// The world size (number of `.distcp` files).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The entries, as given.
    pub fn entries(&self) -> &[DcpEntry] {
        &self.entries
    }

    /// The data file of `rank`: `__{rank}_0.distcp`.
    pub fn file_name(rank: usize) -> String {
        format!("__{rank}_0.distcp")
    }

    /// The items of `rank`'s file in write order (empty for a rank out of range).
    pub fn items(&self, rank: usize) -> &[DcpItemRef] {
        self.items.get(rank).map_or(&[], Vec::as_slice)
    }
}

/// Checks that `chunks` lie inside `size`, do not overlap and cover every element.
fn check_tiling(
    fqn: &str,
    dtype: DType,
    size: &[u64],
    chunks: &[DcpChunk],
) -> Result<(), DcpWriteError> {
    let too_large = || DcpWriteError::TooLarge {
        fqn: fqn.to_owned(),
        size: size.to_vec(),
    };
    let total = numel(size).ok_or_else(too_large)?;
    nbytes(dtype, size).ok_or_else(too_large)?;
    if chunks.is_empty() {
        return Err(DcpWriteError::NoChunks {
            fqn: fqn.to_owned(),
        });
    }
    let mut covered = 0u64;
    for chunk in chunks {
        let fits = chunk.offsets.len() == size.len()
            && chunk.sizes.len() == size.len()
            && chunk
                .offsets
                .iter()
                .zip(&chunk.sizes)
                .zip(size)
                .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|end| end <= d));
        if !fits {
            return Err(DcpWriteError::ChunkOutOfBounds {
                fqn: fqn.to_owned(),
                size: size.to_vec(),
                offsets: chunk.offsets.clone(),
                sizes: chunk.sizes.clone(),
            });
        }
        // Inside a tensor whose numel fits u64, so no overflow.
        covered += numel(&chunk.sizes).unwrap_or(0);
    }
    for (i, a) in chunks.iter().enumerate() {
        for b in &chunks[i + 1..] {
            let overlap = a
                .offsets
                .iter()
                .zip(&a.sizes)
                .zip(b.offsets.iter().zip(&b.sizes))
                .all(|((&ao, &asz), (&bo, &bsz))| ao.max(bo) < (ao + asz).min(bo + bsz));
            if overlap {
                return Err(DcpWriteError::ChunksOverlap {
                    fqn: fqn.to_owned(),
                    first: a.offsets.clone(),
                    second: b.offsets.clone(),
                });
            }
        }
    }
    if covered != total {
        return Err(DcpWriteError::ChunksIncomplete {
            fqn: fqn.to_owned(),
            covered,
            numel: total,
        });
    }
    Ok(())
}

/// Where one item landed in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredItem {
    /// Which item.
    pub item: DcpItemRef,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte length.
    pub length: u64,
}

/// What [`DcpFileWriter::finish`] reports for one rank's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpFileRecord {
    /// The rank.
    pub rank: usize,
    /// Every item of the file, in file order.
    pub items: Vec<StoredItem>,
}

/// Streams one rank's `.distcp` file.
#[derive(Debug)]
pub struct DcpFileWriter<'p, W: Write> {
    plan: &'p DcpPlan,
    rank: usize,
    out: CountingWriter<W>,
    next: usize,
    stored: Vec<StoredItem>,
}

impl<'p, W: Write> DcpFileWriter<'p, W> {
    /// Starts `rank`'s file and writes its bytes items.
    pub fn new(plan: &'p DcpPlan, rank: usize, out: W) -> Result<Self, DcpWriteError> {
        if rank >= plan.world_size {
            return Err(DcpWriteError::RankOutOfRange {
                fqn: DcpPlan::file_name(rank),
                rank,
                world_size: plan.world_size,
            });
        }
        let mut writer = Self {
            plan,
            rank,
            out: CountingWriter::new(out),
            next: 0,
            stored: Vec::new(),
        };
        while let Some(&DcpItemRef::Bytes { entry }) = plan.items(rank).get(writer.next) {
            let e = &plan.entries[entry];
            let DcpValue::Bytes { value, .. } = &e.value else {
                unreachable!("bytes item refers to a bytes entry");
            };
            let archive = match value {
                BytesValue::TorchSave(bytes) => std::borrow::Cow::Borrowed(bytes.as_slice()),
                BytesValue::Value(v) => {
                    std::borrow::Cow::Owned(torch_save_to_vec(v, &[]).map_err(|source| {
                        DcpWriteError::TorchSave {
                            fqn: e.fqn.clone(),
                            source,
                        }
                    })?)
                }
            };
            writer.append(DcpItemRef::Bytes { entry }, &archive)?;
        }
        Ok(writer)
    }

    /// The chunk whose data [`Self::write_chunk`] expects next: `(entry, chunk)` indices into the
    /// plan, or `None` when the file is complete.
    pub fn next_chunk(&self) -> Option<(usize, usize)> {
        match self.plan.items(self.rank).get(self.next) {
            Some(&DcpItemRef::Chunk { entry, chunk }) => Some((entry, chunk)),
            _ => None,
        }
    }

    /// Writes the next chunk: its region of the global tensor as a contiguous little-endian tensor of
    /// shape `sizes`.
    pub fn write_chunk(&mut self, data: &[u8]) -> Result<(), DcpWriteError> {
        let (entry, chunk) = self
            .next_chunk()
            .ok_or(DcpWriteError::NoMoreChunks { rank: self.rank })?;
        let e = &self.plan.entries[entry];
        let DcpValue::Tensor { dtype, chunks, .. } = &e.value else {
            unreachable!("chunk item refers to a tensor entry");
        };
        let sizes = &chunks[chunk].sizes;
        let tensor =
            TensorRef::new(*dtype, sizes, data).map_err(|_| DcpWriteError::ChunkLength {
                fqn: e.fqn.clone(),
                chunk,
                expected_bytes: nbytes(*dtype, sizes).unwrap_or(u64::MAX),
                actual_bytes: data.len() as u64,
            })?;
        let archive = tensor_to_vec(&tensor).map_err(|source| DcpWriteError::TorchSave {
            fqn: e.fqn.clone(),
            source,
        })?;
        self.append(DcpItemRef::Chunk { entry, chunk }, &archive)
    }

    fn append(&mut self, item: DcpItemRef, archive: &[u8]) -> Result<(), DcpWriteError> {
        let offset = self.out.position();
        self.out
            .write_all(archive)
            .map_err(|source| DcpWriteError::Io {
                file: DcpPlan::file_name(self.rank),
                source,
            })?;
        self.stored.push(StoredItem {
            item,
            offset,
            length: archive.len() as u64,
        });
        self.next += 1;
        Ok(())
    }

    /// Checks that every chunk was written, flushes, and returns the writer and the file's record.
    pub fn finish(mut self) -> Result<(W, DcpFileRecord), DcpWriteError> {
        if let Some((entry, chunk)) = self.next_chunk() {
            return Err(DcpWriteError::MissingChunk {
                rank: self.rank,
                fqn: self.plan.entries[entry].fqn.clone(),
                chunk,
            });
        }
        self.out.flush().map_err(|source| DcpWriteError::Io {
            file: DcpPlan::file_name(self.rank),
            source,
        })?;
        Ok((
            self.out.into_inner(),
            DcpFileRecord {
                rank: self.rank,
                items: self.stored,
            },
        ))
    }
}

/// Optional `StorageMeta` fields. Both default to `None`, which keeps the output deterministic (torch
/// writes the save path and a random uuid4; loaders do not read them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DcpMetadataOptions {
    /// `StorageMeta.checkpoint_id` (torch: the directory path).
    pub checkpoint_id: Option<String>,
    /// `StorageMeta.save_id` (torch: a uuid4 string).
    pub save_id: Option<String>,
}

/// The `.metadata` pickle for `plan`, given the finished records of every rank.
#[allow(
    clippy::too_many_lines,
    reason = "builds the whole `Metadata` pickle (state_dict_metadata, storage_data, planner_data) in torch's field order"
)]
pub fn metadata_pickle(
    plan: &DcpPlan,
    records: &[DcpFileRecord],
    options: &DcpMetadataOptions,
) -> Result<Vec<u8>, DcpWriteError> {
    let records_error = |problem: String| DcpWriteError::Records {
        world_size: plan.world_size,
        problem,
    };
    let mut by_rank: Vec<Option<&DcpFileRecord>> = vec![None; plan.world_size];
    for record in records {
        let slot = by_rank
            .get_mut(record.rank)
            .ok_or_else(|| records_error(format!("got a record for rank {}", record.rank)))?;
        if slot.replace(record).is_some() {
            return Err(records_error(format!("rank {} appears twice", record.rank)));
        }
        let expected: Vec<DcpItemRef> = plan.items(record.rank).to_vec();
        let got: Vec<DcpItemRef> = record.items.iter().map(|s| s.item).collect();
        if expected != got {
            return Err(records_error(format!(
                "rank {}'s record does not match the plan",
                record.rank
            )));
        }
    }
    if let Some(rank) = by_rank.iter().position(Option::is_none) {
        return Err(records_error(format!("rank {rank} is missing")));
    }

    let size_value = |dims: &[u64]| PyValue::call("torch", "Size", vec![PyValue::int_tuple(dims)]);
    let mut state_dict_metadata = Vec::with_capacity(plan.entries.len());
    let mut planner_data = Vec::with_capacity(plan.entries.len());
    // Chunk order in the metadata: by rank, then plan order (torch concatenates rank plans).
    let mut chunk_order: Vec<Vec<usize>> = Vec::with_capacity(plan.entries.len());
    for entry in &plan.entries {
        let fqn = PyValue::str(entry.fqn.as_str());
        let path = entry
            .path
            .iter()
            .map(|k| match k {
                PathKey::Key(s) => PyValue::str(s.as_str()),
                PathKey::Index(i) => PyValue::Int(*i as i64),
            })
            .collect();
        planner_data.push((fqn.clone(), PyValue::Tuple(path)));
        match &entry.value {
            DcpValue::Bytes { .. } => {
                chunk_order.push(Vec::new());
                state_dict_metadata.push((
                    fqn,
                    PyValue::object(METADATA_MODULE, "BytesStorageMetadata", vec![]),
                ));
            }
            DcpValue::Tensor {
                dtype,
                size,
                chunks,
            } => {
                let mut order: Vec<usize> = (0..chunks.len()).collect();
                order.sort_by_key(|&c| chunks[c].rank);
                let chunk_values = order
                    .iter()
                    .map(|&c| {
                        PyValue::object(
                            METADATA_MODULE,
                            "ChunkStorageMetadata",
                            vec![
                                ("offsets", size_value(&chunks[c].offsets)),
                                ("sizes", size_value(&chunks[c].sizes)),
                            ],
                        )
                    })
                    .collect();
                chunk_order.push(order);
                let properties = PyValue::Object {
                    class: Box::new(PyValue::global(METADATA_MODULE, "TensorProperties")),
                    state: Box::new(PyValue::Tuple(vec![
                        PyValue::global("torch", dtype.name()),
                        PyValue::call(
                            "torch.serialization",
                            "_get_layout",
                            vec![PyValue::str("torch.strided")],
                        ),
                        PyValue::Bool(false),
                        PyValue::call(
                            METADATA_MODULE,
                            "_MEM_FORMAT_ENCODING",
                            vec![PyValue::Int(0)],
                        ),
                        PyValue::Bool(false),
                        PyValue::int_tuple(&contiguous_strides(size)),
                    ])),
                };
                state_dict_metadata.push((
                    fqn,
                    PyValue::object(
                        METADATA_MODULE,
                        "TensorStorageMetadata",
                        vec![
                            ("properties", properties),
                            ("size", size_value(size)),
                            ("chunks", PyValue::List(chunk_values)),
                        ],
                    ),
                ));
            }
        }
    }

    let mut storage_data = Vec::new();
    for record in by_rank.into_iter().flatten() {
        for stored in &record.items {
            let (entry, index) = match stored.item {
                DcpItemRef::Bytes { entry } => (entry, None),
                DcpItemRef::Chunk { entry, chunk } => (entry, Some(chunk)),
            };
            let e = &plan.entries[entry];
            let mut fields = vec![("fqn", PyValue::str(e.fqn.as_str()))];
            if let (Some(chunk), DcpValue::Tensor { chunks, .. }) = (index, &e.value) {
                let position = chunk_order[entry]
                    .iter()
                    .position(|&c| c == chunk)
                    .unwrap_or(chunk);
                fields.push(("index", PyValue::Int(position as i64)));
                fields.push(("offset", size_value(&chunks[chunk].offsets)));
            } else {
                fields.push(("index", PyValue::None));
            }
            let key = PyValue::object(METADATA_MODULE, "MetadataIndex", fields);
            let info = PyValue::object(
                FILESYSTEM_MODULE,
                "_StorageInfo",
                vec![
                    (
                        "relative_path",
                        PyValue::str(DcpPlan::file_name(record.rank)),
                    ),
                    ("offset", PyValue::Int(stored.offset as i64)),
                    ("length", PyValue::Int(stored.length as i64)),
                ],
            );
            storage_data.push((key, info));
        }
    }

    let optional_str = |s: &Option<String>| s.as_ref().map_or(PyValue::None, PyValue::str);
    let storage_meta = PyValue::object(
        METADATA_MODULE,
        "StorageMeta",
        vec![
            ("checkpoint_id", optional_str(&options.checkpoint_id)),
            ("save_id", optional_str(&options.save_id)),
            ("load_id", PyValue::None),
            ("modules", PyValue::List(Vec::new())),
        ],
    );
    let metadata = PyValue::object(
        METADATA_MODULE,
        "Metadata",
        vec![
            ("state_dict_metadata", PyValue::Dict(state_dict_metadata)),
            ("planner_data", PyValue::Dict(planner_data)),
            ("storage_data", PyValue::Dict(storage_data)),
            ("storage_meta", storage_meta),
            ("version", PyValue::str(DCP_VERSION)),
        ],
    );
    Ok(to_pickle(&metadata)?)
}

/// What to do with ranks that get no rows in [`chunk_dim0`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmptyRanks {
    /// No chunk (FSDP1 `ShardedTensor`: ranks without data have no local shard).
    Omit,
    /// A zero-size chunk at offset `dim0` (FSDP2 `DTensor` with `Shard(0)`).
    ZeroSize,
}

/// One rank's dim-0 chunk of a tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dim0Chunk {
    /// The rank.
    pub rank: usize,
    /// The chunk as DCP records it.
    pub chunk: DcpChunk,
    /// Its bytes in the full tensor's contiguous data (dim-0 chunks are contiguous).
    pub bytes: Range<u64>,
}

/// Cuts a tensor of `shape` into `torch.chunk(tensor, world_size, dim=0)` pieces, one per rank: rank
/// `r` gets rows `[r * ceil(d0 / n), min((r + 1) * ceil(d0 / n), d0))`. Ranks past the data get no
/// chunk or a zero-size one (see [`EmptyRanks`]). A 0-dim tensor, and one with no elements, is a single
/// chunk on rank 0.
pub fn chunk_dim0(
    dtype: DType,
    shape: &[u64],
    world_size: usize,
    empty: EmptyRanks,
) -> Result<Vec<Dim0Chunk>, DcpWriteError> {
    if world_size == 0 {
        return Err(DcpWriteError::ZeroWorldSize);
    }
    let too_large = || DcpWriteError::TooLarge {
        fqn: String::new(),
        size: shape.to_vec(),
    };
    let total_bytes = nbytes(dtype, shape).ok_or_else(too_large)?;
    let Some((&rows, rest)) = shape.split_first() else {
        return Ok(vec![Dim0Chunk {
            rank: 0,
            chunk: DcpChunk {
                offsets: Vec::new(),
                sizes: Vec::new(),
                rank: 0,
            },
            bytes: 0..total_bytes,
        }]);
    };
    if total_bytes == 0 && rows == 0 {
        return Ok(vec![Dim0Chunk {
            rank: 0,
            chunk: DcpChunk {
                offsets: vec![0; shape.len()],
                sizes: shape.to_vec(),
                rank: 0,
            },
            bytes: 0..0,
        }]);
    }
    // Checked via total_bytes.
    let row_bytes = nbytes(dtype, rest).ok_or_else(too_large)?;
    let n = world_size as u64;
    let mut out = Vec::new();
    for rank in 0..world_size {
        let (start, end) = chunk_range(rows, n, rank as u64);
        let (offset, len) = if start < end {
            (start, end - start)
        } else {
            match empty {
                EmptyRanks::Omit => continue,
                EmptyRanks::ZeroSize => {
                    let (len, offset) = shard_size_and_offset(rows, n, rank as u64);
                    (offset, len)
                }
            }
        };
        let mut offsets = vec![0; shape.len()];
        offsets[0] = offset;
        let mut sizes = shape.to_vec();
        sizes[0] = len;
        out.push(Dim0Chunk {
            rank,
            chunk: DcpChunk {
                offsets,
                sizes,
                rank,
            },
            bytes: offset * row_bytes..(offset + len) * row_bytes,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor_entry(fqn: &str, size: &[u64], chunks: Vec<DcpChunk>) -> DcpEntry {
        DcpEntry {
            fqn: fqn.to_owned(),
            path: vec![PathKey::Key(fqn.to_owned())],
            value: DcpValue::Tensor {
                dtype: DType::Float32,
                size: size.to_vec(),
                chunks,
            },
        }
    }

    fn chunk(offsets: &[u64], sizes: &[u64], rank: usize) -> DcpChunk {
        DcpChunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            rank,
        }
    }

    #[test]
    fn dim0_chunks_follow_torch_chunk() {
        // torch.chunk(torch.zeros(5, 2), 4) -> rows [0,2) [2,4) [4,5); rank 3 has none.
        let chunks = chunk_dim0(DType::Float32, &[5, 2], 4, EmptyRanks::Omit).unwrap();
        let got: Vec<_> = chunks
            .iter()
            .map(|c| {
                (
                    c.rank,
                    c.chunk.offsets[0],
                    c.chunk.sizes[0],
                    c.bytes.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [(0, 0, 2, 0..16), (1, 2, 2, 16..32), (2, 4, 1, 32..40)]
        );
        // DTensor: the empty rank 3 holds a [0, 2] chunk at offset 5.
        let chunks = chunk_dim0(DType::Float32, &[5, 2], 4, EmptyRanks::ZeroSize).unwrap();
        assert_eq!(chunks[3].chunk, chunk(&[5, 0], &[0, 2], 3));
        // torch.chunk(torch.zeros(6), 4) -> 2, 2, 2 and nothing for rank 3.
        assert_eq!(
            chunk_dim0(DType::Int8, &[6], 4, EmptyRanks::Omit)
                .unwrap()
                .len(),
            3
        );
        let scalar = chunk_dim0(DType::Float32, &[], 3, EmptyRanks::Omit).unwrap();
        assert_eq!(scalar.len(), 1);
        assert_eq!(scalar[0].bytes, 0..4);
    }

    #[test]
    fn plans_check_tiling() {
        let ok = DcpPlan::new(
            2,
            vec![tensor_entry(
                "w",
                &[4, 2],
                vec![chunk(&[0, 0], &[2, 2], 0), chunk(&[2, 0], &[2, 2], 1)],
            )],
        );
        assert!(ok.is_ok());
        let overlap = DcpPlan::new(
            2,
            vec![tensor_entry(
                "w",
                &[4, 2],
                vec![chunk(&[0, 0], &[3, 2], 0), chunk(&[2, 0], &[2, 2], 1)],
            )],
        );
        assert!(matches!(overlap, Err(DcpWriteError::ChunksOverlap { .. })));
        let gap = DcpPlan::new(
            2,
            vec![tensor_entry("w", &[4, 2], vec![chunk(&[0, 0], &[3, 2], 0)])],
        );
        assert!(matches!(
            gap,
            Err(DcpWriteError::ChunksIncomplete { covered: 6, .. })
        ));
        let outside = DcpPlan::new(
            2,
            vec![tensor_entry("w", &[4, 2], vec![chunk(&[2, 0], &[3, 2], 0)])],
        );
        assert!(matches!(
            outside,
            Err(DcpWriteError::ChunkOutOfBounds { .. })
        ));
        let bad_rank = DcpPlan::new(1, vec![tensor_entry("w", &[1], vec![chunk(&[0], &[1], 1)])]);
        assert!(matches!(
            bad_rank,
            Err(DcpWriteError::RankOutOfRange { .. })
        ));
    }

    #[test]
    fn file_writer_enforces_order_and_completeness() {
        let plan = DcpPlan::new(
            1,
            vec![
                tensor_entry("w", &[2], vec![chunk(&[0], &[2], 0)]),
                DcpEntry {
                    fqn: "step".to_owned(),
                    path: vec![PathKey::Key("step".to_owned())],
                    value: DcpValue::Bytes {
                        rank: 0,
                        value: BytesValue::Value(PyValue::Int(3)),
                    },
                },
            ],
        )
        .unwrap();
        // Bytes first even though the entry comes second.
        assert_eq!(
            plan.items(0),
            [
                DcpItemRef::Bytes { entry: 1 },
                DcpItemRef::Chunk { entry: 0, chunk: 0 }
            ]
        );
        let mut w = DcpFileWriter::new(&plan, 0, Vec::new()).unwrap();
        assert!(matches!(
            w.write_chunk(&[0; 4]),
            Err(DcpWriteError::ChunkLength { .. })
        ));
        w.write_chunk(&[0; 8]).unwrap();
        assert!(matches!(
            w.write_chunk(&[0; 8]),
            Err(DcpWriteError::NoMoreChunks { .. })
        ));
        let (_, record) = w.finish().unwrap();
        assert!(
            metadata_pickle(
                &plan,
                std::slice::from_ref(&record),
                &DcpMetadataOptions::default()
            )
            .is_ok()
        );
        assert!(matches!(
            metadata_pickle(&plan, &[], &DcpMetadataOptions::default()),
            Err(DcpWriteError::Records { .. })
        ));
        let unfinished = DcpFileWriter::new(&plan, 0, Vec::new()).unwrap();
        assert!(matches!(
            unfinished.finish(),
            Err(DcpWriteError::MissingChunk { .. })
        ));
    }
}
