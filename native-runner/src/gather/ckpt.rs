//! Shard sources over any checkpoint core's index reads: safetensors (single or HF-sharded),
//! `torch.save` files (plain, FSDP1 FULL/SHARDED/LOCAL per rank, FSDP2 DTensor per rank) and DCP
//! directories. Values are read lazily through [`CheckpointIndex::read_chunk`] /
//! [`CheckpointIndex::read_tensor`], one tensor at a time, from a byte [`Source`] (memory-mapped files
//! in the CLI): nothing reads a whole checkpoint into memory.
//!
//! - [`IndexFull`]: full parameters ([`FullSource`]): a full checkpoint's tensors, or a sharded one's
//!   (FSDP1 SHARDED ShardedTensors, FSDP2 DTensors, DCP chunks) assembled per parameter from the
//!   chunk offsets torch recorded; every rank then cuts its padded shard with our layout.
//! - [`IndexLocal`]: rank-local tensors as torch saved them ([`RankSource`]): an FSDP1 LOCAL
//!   `<unit>._flat_param` ShardedTensor's local shard, or an FSDP2 DTensor's local chunk. The executor
//!   right-pads each to the padded shard size with zeros, as FSDP's load path does. For `--verify`,
//!   DTensor/ShardedTensor parameters are compared with the full value assembled from the chunk
//!   offsets torch recorded (independent of our layout).

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use shardscope_core::DType;
use shardscope_core::index::{CheckpointIndex, ChunkEncoding, EntryKind, IndexEntry};
use shardscope_core::model::{ModelDescription, fqn};
use shardscope_core::source::Source;

use super::source::{FullSource, RankSource, SourceError};

/// Bytes of assembled tensors [`IndexFull`] keeps for the ranks that read the same parameter.
const CACHE_BYTES: u64 = 256 << 20;

/// An indexed checkpoint and the bytes it is read from.
pub struct Indexed<S> {
    /// For messages (the paths given).
    pub(crate) name: String,
    pub(crate) source: S,
    pub(crate) index: CheckpointIndex,
    /// Prepended to a parameter FQN to find its entry (`model.` in a DCP app state, or `""`).
    pub(crate) prefix: String,
}

impl<S> std::fmt::Debug for Indexed<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Indexed")
            .field("name", &self.name)
            .field("entries", &self.index.entries.len())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl<S: Source> Indexed<S> {
    pub fn new(name: String, source: S, index: CheckpointIndex, prefix: String) -> Self {
        Self {
            name,
            source,
            index,
            prefix,
        }
    }

    fn key(&self, fqn: &str) -> String {
        format!("{}{fqn}", self.prefix)
    }

    fn entry(&self, fqn: &str) -> Option<&IndexEntry> {
        self.index
            .entry(&self.key(fqn))
            .filter(|e| e.kind == EntryKind::Tensor)
    }

    fn missing(&self, fqn: &str) -> SourceError {
        SourceError::Missing {
            source_name: self.name.clone(),
            key: self.key(fqn),
        }
    }

    fn index_err(&self, key: &str, e: &impl std::fmt::Display) -> SourceError {
        SourceError::Read {
            source_name: self.name.clone(),
            key: key.to_owned(),
            message: e.to_string(),
        }
    }

    /// The prefix under which the checkpoint stores `model`'s parameters: `""` when the first one is
    /// found as is, `select.` when given, `model.` when found there (a DCP app state).
    pub fn find_prefix(index: &CheckpointIndex, model: &ModelDescription) -> String {
        let Some(first) = model.params.iter().find(|p| p.shared_with.is_none()) else {
            return String::new();
        };
        if index.entry(&first.fqn).is_some() {
            return String::new();
        }
        if index.entry(&format!("model.{}", first.fqn)).is_some() {
            return "model.".to_owned();
        }
        String::new()
    }

    /// The ranks holding chunks of any entry (per-rank files, DCP writers).
    pub fn ranks(&self) -> BTreeSet<u32> {
        self.index
            .entries
            .iter()
            .flat_map(IndexEntry::ranks)
            .collect()
    }

    /// The single stored chunk covering the whole tensor with a contiguous raw view, if there is
    /// one (replicas of it on several ranks count once): then byte ranges are read in place.
    fn contiguous_whole(entry: &IndexEntry) -> Option<(&str, u64)> {
        let shape = entry.shape.as_ref()?;
        let first = entry.chunks.first()?;
        if entry
            .chunks
            .iter()
            .any(|c| c.offsets != first.offsets || c.sizes != first.sizes)
            || &first.sizes != shape
            || first.offsets.iter().any(|&o| o != 0)
        {
            return None;
        }
        let ChunkEncoding::Raw {
            storage_offset,
            strides,
        } = &first.encoding
        else {
            return None;
        };
        // Contiguous strides: the last dim 1, each dim the product of the later sizes (dims of
        // size 1 may have any stride).
        let mut expect = 1u64;
        for (&size, &stride) in shape.iter().zip(strides).rev() {
            if size != 1 && stride != expect {
                return None;
            }
            expect = expect.checked_mul(size)?;
        }
        let es = entry.dtype?.size_bytes() as u64;
        let rel = storage_offset.checked_mul(es)?;
        // The view must lie inside the chunk's storage bytes; otherwise the slow path reports it.
        if rel.checked_add(entry.nbytes()?)? > first.byte_length {
            return None;
        }
        let start = first.byte_offset.checked_add(rel)?;
        Some((first.file.as_ref(), start))
    }
}

/// Checks an entry against the model's dtype and shape.
fn check_entry(
    name: &str,
    key: &str,
    entry: &IndexEntry,
    dtype: DType,
    shape: &[u64],
) -> Result<(), SourceError> {
    let found = entry.dtype.ok_or_else(|| SourceError::Missing {
        source_name: name.to_owned(),
        key: key.to_owned(),
    })?;
    if found != dtype {
        return Err(SourceError::DTypeMismatch {
            source_name: name.to_owned(),
            key: key.to_owned(),
            expected: dtype,
            found,
        });
    }
    match &entry.shape {
        Some(s) if s != shape => Err(SourceError::ShapeMismatch {
            source_name: name.to_owned(),
            key: key.to_owned(),
            expected: shape.to_vec(),
            found: s.clone(),
        }),
        _ => Ok(()),
    }
}

/// Full parameters of an indexed checkpoint (full or sharded; sharded ones are assembled per
/// parameter from their chunks).
pub struct IndexFull<S> {
    ckpt: Arc<Indexed<S>>,
    /// Tied names the checkpoint does not store, and the name it stores their tensor under.
    aliases: std::collections::BTreeMap<String, String>,
    /// Recently assembled tensors (most recent last) and their total bytes.
    cache: Mutex<CacheState>,
}

type CacheState = (Vec<(String, Arc<Vec<u8>>)>, u64);

impl<S> std::fmt::Debug for IndexFull<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexFull")
            .field("ckpt", &self.ckpt)
            .finish_non_exhaustive()
    }
}

impl<S: Source + Send + Sync> IndexFull<S> {
    /// A source for `model`: every parameter the gather needs must be a tensor entry with a global
    /// shape, the model's dtype and shape. A tied name the checkpoint does not store is read from
    /// its primary.
    pub fn for_model(ckpt: Arc<Indexed<S>>, model: &ModelDescription) -> Result<Self, SourceError> {
        let mut aliases = std::collections::BTreeMap::new();
        for p in &model.params {
            let key = ckpt.key(&p.fqn);
            let Some(entry) = ckpt.entry(&p.fqn) else {
                if let Some(primary) = &p.shared_with {
                    aliases.insert(p.fqn.clone(), primary.clone());
                    continue;
                }
                if model.ignored.contains(&p.fqn) {
                    continue;
                }
                return Err(ckpt.missing(&p.fqn));
            };
            if entry.flat_param || entry.shape.is_none() {
                return Err(SourceError::Read {
                    source_name: ckpt.name.clone(),
                    key,
                    message: "rank-local pieces without a global shape: gather them as saved (--from local)".into(),
                });
            }
            check_entry(&ckpt.name, &key, entry, p.dtype, &p.shape)?;
        }
        Ok(Self {
            ckpt,
            aliases,
            cache: Mutex::new((Vec::new(), 0)),
        })
    }

    fn stored(&self, fqn: &str) -> String {
        self.aliases
            .get(fqn)
            .map_or_else(|| fqn.to_owned(), Clone::clone)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The whole tensor `fqn`, assembled (and kept a while for the other ranks).
    fn assembled(&self, fqn: &str) -> Result<Arc<Vec<u8>>, SourceError> {
        {
            let cache = self.lock_cache();
            if let Some((_, t)) = cache.0.iter().find(|(k, _)| k == fqn) {
                return Ok(Arc::clone(t));
            }
        }
        let entry = self.ckpt.entry(fqn).ok_or_else(|| self.ckpt.missing(fqn))?;
        let data = self
            .ckpt
            .index
            .read_tensor(&self.ckpt.source, entry)
            .map_err(|e| self.ckpt.index_err(&entry.key, &e))?;
        let t = Arc::new(data.bytes);
        let mut cache = self.lock_cache();
        let (list, total) = &mut *cache;
        list.push((fqn.to_owned(), Arc::clone(&t)));
        *total = total.saturating_add(t.len() as u64);
        while *total > CACHE_BYTES && list.len() > 1 {
            let (_, old) = list.remove(0);
            *total -= old.len() as u64;
        }
        Ok(t)
    }
}

fn out_of_range(name: &str, key: &str, offset: u64, len: u64, size: u64) -> SourceError {
    SourceError::OutOfRange {
        source_name: name.to_owned(),
        key: key.to_owned(),
        offset,
        len,
        size,
    }
}

impl<S: Source + Send + Sync> FullSource for IndexFull<S> {
    fn name(&self) -> String {
        self.ckpt.name.clone()
    }

    fn contains(&self, fqn: &str) -> bool {
        self.ckpt.entry(&self.stored(fqn)).is_some()
    }

    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        let stored = self.stored(fqn);
        let entry = self
            .ckpt
            .entry(&stored)
            .ok_or_else(|| self.ckpt.missing(&stored))?;
        let size = entry.nbytes().unwrap_or(0);
        let len = dst.len() as u64;
        if byte_offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(out_of_range(
                &self.ckpt.name,
                &entry.key,
                byte_offset,
                len,
                size,
            ));
        }
        if let Some((file, start)) = Indexed::<S>::contiguous_whole(entry) {
            let at = start
                .checked_add(byte_offset)
                .ok_or_else(|| out_of_range(&self.ckpt.name, &entry.key, byte_offset, len, size))?;
            let bytes = self
                .ckpt
                .source
                .read_range(file, at, len)
                .map_err(|e| self.ckpt.index_err(&entry.key, &e))?;
            dst.copy_from_slice(&bytes);
            return Ok(());
        }
        let t = self.assembled(&stored)?;
        // In range: checked against the entry's size, which is the assembled tensor's length.
        let start = usize::try_from(byte_offset).unwrap_or(usize::MAX);
        let src = t
            .get(start..start.saturating_add(dst.len()))
            .ok_or_else(|| out_of_range(&self.ckpt.name, &entry.key, byte_offset, len, size))?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Rank-local tensors of an indexed per-rank checkpoint (FSDP1 LOCAL flat-parameter shards, FSDP2
/// DTensor local chunks), as torch saved them.
pub struct IndexLocal<S> {
    ckpt: Arc<Indexed<S>>,
}

impl<S> std::fmt::Debug for IndexLocal<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexLocal")
            .field("ckpt", &self.ckpt)
            .finish()
    }
}

impl<S: Source + Send + Sync> IndexLocal<S> {
    pub fn new(ckpt: Arc<Indexed<S>>) -> Self {
        Self { ckpt }
    }
}

impl<S: Source + Send + Sync> RankSource for IndexLocal<S> {
    fn name(&self) -> String {
        self.ckpt.name.clone()
    }

    fn read_local(
        &self,
        rank: u64,
        key: &str,
        dtype: DType,
    ) -> Result<Option<Cow<'_, [u8]>>, SourceError> {
        let full_key = self.ckpt.key(key);
        let Some(entry) = self.ckpt.entry(key) else {
            return Err(self.ckpt.missing(key));
        };
        let found = entry.dtype.ok_or_else(|| self.ckpt.missing(key))?;
        if found != dtype {
            return Err(SourceError::DTypeMismatch {
                source_name: self.ckpt.name.clone(),
                key: full_key,
                expected: dtype,
                found,
            });
        }
        let mine: Vec<_> = entry
            .chunks
            .iter()
            .filter(|c| c.rank.map(u64::from) == Some(rank))
            .collect();
        let chunk = match mine.as_slice() {
            [] => return Ok(None),
            [one] => *one,
            _ => {
                return Err(SourceError::Read {
                    source_name: self.ckpt.name.clone(),
                    key: full_key,
                    message: format!(
                        "rank {rank} holds {} local pieces; FSDP keeps one per rank",
                        mine.len()
                    ),
                });
            }
        };
        let data = self
            .ckpt
            .index
            .read_chunk(&self.ckpt.source, entry, chunk)
            .map_err(|e| self.ckpt.index_err(&full_key, &e))?;
        Ok(Some(Cow::Owned(data.bytes)))
    }

    fn read_reference(&self, fqn_: &str, dst: &mut [u8]) -> Option<Result<(), SourceError>> {
        let entry = self.ckpt.entry(fqn_)?;
        if entry.flat_param || entry.shape.is_none() || fqn_.ends_with(fqn::FLAT_PARAM) {
            return None;
        }
        let data = match self.ckpt.index.read_tensor(&self.ckpt.source, entry) {
            Ok(d) => d,
            Err(e) => return Some(Err(self.ckpt.index_err(&entry.key, &e))),
        };
        if data.bytes.len() != dst.len() {
            return Some(Err(SourceError::Read {
                source_name: self.ckpt.name.clone(),
                key: entry.key.clone(),
                message: format!(
                    "the assembled tensor has {} bytes, the parameter {}",
                    data.bytes.len(),
                    dst.len()
                ),
            }));
        }
        dst.copy_from_slice(&data.bytes);
        Some(Ok(()))
    }
}
