//! A DCP directory (its `.metadata`) into a [`CheckpointIndex`].

use std::collections::{BTreeMap, HashMap};

use crate::formats::dcp::{self, ItemMeta, PlannerStep};
use crate::formats::safetensors::{self as st, SafetensorsError};
use crate::formats::torch_zip;
use crate::index::read::torch::{assign_roles, clean_path, join_path};
use crate::index::values::contiguous_strides;
use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, DcpFacts, EntryKind, FastMap, FileInfo,
    Format, IndexEntry, IndexError, PathSeg,
};
use crate::source::Source;

fn dcp_rank(file: &str) -> Option<u32> {
    let base = file.rsplit('/').next().unwrap_or(file);
    base.strip_prefix("__")?.split('_').next()?.parse().ok()
}

/// `storage_data` looked up by (fqn, chunk offsets), as torch's `MetadataIndex` equality does.
/// torch writes the records of a tensor's chunks in the order of its chunk list, so the `i`-th
/// record of an fqn is tried first (no hashing of offsets); a per-fqn map is built only for a
/// tensor whose records are in another order.
struct StorageJoin<'m> {
    storage: &'m [(dcp::StorageIndex, dcp::StorageInfo)],
    by_fqn: FastMap<&'m str, Vec<usize>>,
    by_offsets: FastMap<&'m str, FastMap<Option<&'m [u64]>, usize>>,
}

impl<'m> StorageJoin<'m> {
    fn new(storage: &'m [(dcp::StorageIndex, dcp::StorageInfo)]) -> Self {
        let mut by_fqn: FastMap<&str, Vec<usize>> = FastMap::default();
        for (p, (idx, _)) in storage.iter().enumerate() {
            by_fqn.entry(&*idx.fqn).or_default().push(p);
        }
        StorageJoin {
            storage,
            by_fqn,
            by_offsets: FastMap::default(),
        }
    }

    /// The record of chunk `i` (at `offsets`; `None` for a bytes item) of `fqn`. torch's dict
    /// cannot hold two records of one (fqn, offsets); when a hand-made pickle does, the record at
    /// the chunk's own position is taken if it matches, otherwise the last one (as a dict would).
    fn find(
        &mut self,
        fqn: &str,
        i: usize,
        offsets: Option<&[u64]>,
    ) -> Option<&'m dcp::StorageInfo> {
        let storage = self.storage;
        let (&fqn_key, cands) = self.by_fqn.get_key_value(fqn)?;
        if let Some(&p) = cands.get(i)
            && storage[p].0.offset.as_deref() == offsets
        {
            return Some(&storage[p].1);
        }
        let map = self.by_offsets.entry(fqn_key).or_insert_with(|| {
            cands
                .iter()
                .map(|&q| (storage[q].0.offset.as_deref(), q))
                .collect()
        });
        map.get(&offsets).map(|&q| &storage[q].1)
    }
}

/// Indexes a DCP directory given the name of its `.metadata` file in the source.
#[allow(
    clippy::too_many_lines,
    reason = "turns every `.metadata` item (tensors, bytes, zstd transforms, SAFETENSORS blobs) into entries in one pass"
)]
pub fn index_dcp(source: &dyn Source, metadata_name: &str) -> Result<CheckpointIndex, IndexError> {
    let bytes = crate::formats::read_all_capped(
        source,
        metadata_name,
        crate::formats::MAX_DCP_METADATA_BYTES,
        "a DCP .metadata file",
    )?;
    let meta = dcp::read_metadata(&bytes).map_err(|source| IndexError::Dcp {
        file: metadata_name.to_owned(),
        source,
    })?;
    let dir = metadata_name
        .rsplit_once('/')
        .map_or(String::new(), |(d, _)| format!("{d}/"));
    let mut join = StorageJoin::new(&meta.storage);
    // Per data file: its size, and (SAFETENSORS serialization) its blob header.
    let mut file_sizes: BTreeMap<String, u64> = BTreeMap::new();
    // Per `relative_path`: the file's name in the source, its size and rank (100 000 chunks name
    // a few hundred files).
    let mut data_files: FastMap<&str, (String, u64, Option<u32>)> = FastMap::default();
    let mut blobs: HashMap<(String, u64), HashMap<String, (u64, u64)>> = HashMap::new();
    let mut safetensors_serialization = false;
    let mut zip_files: FastMap<String, bool> = FastMap::default();
    let mut entries = Vec::with_capacity(meta.items.len());
    // The items are moved into the index (100 000 chunks' offsets and sizes are not copied).
    for (key_owned, item) in meta.items {
        let key = &key_owned;
        let path: Vec<PathSeg> = match meta.planner_data.get(key) {
            Some(steps) => steps
                .iter()
                .map(|s| match s {
                    PlannerStep::Key(k) => PathSeg::Key(k.clone()),
                    PlannerStep::Index(i) => PathSeg::Index(*i),
                })
                .collect(),
            None => vec![PathSeg::Key(key.clone())],
        };
        let clean_path_v = clean_path(&path);
        let mut chunks = Vec::new();
        let mut lookup =
            |i: usize, offsets: Option<&[u64]>| -> Result<&dcp::StorageInfo, IndexError> {
                join.find(key, i, offsets)
                    .ok_or_else(|| IndexError::Inconsistent {
                        file: metadata_name.to_owned(),
                        what: format!(
                            "{key}: no storage_data record for the chunk at offsets {offsets:?}"
                        ),
                    })
            };
        let (kind, dtype, shape) = match item {
            ItemMeta::Bytes => {
                let info = lookup(0, None)?;
                let encoding = match dcp::item_transform(&info.transforms) {
                    Ok(None) => ChunkEncoding::TorchSaveItem,
                    Ok(Some(dcp::ItemTransform::Zstd)) => ChunkEncoding::ZstdTorchSaveItem,
                    Err(what) => {
                        return Err(IndexError::Unsupported {
                            key: key.clone(),
                            file: format!("{dir}{}", info.relative_path),
                            what,
                        });
                    }
                };
                chunks.push(Chunk {
                    offsets: Vec::new(),
                    sizes: Vec::new(),
                    file: format!("{dir}{}", info.relative_path),
                    byte_offset: info.offset,
                    byte_length: info.length,
                    rank: dcp_rank(&info.relative_path),
                    encoding,
                });
                (EntryKind::Bytes, None, None)
            }
            ItemMeta::Tensor {
                dtype,
                size,
                chunks: metas,
            } => {
                chunks.reserve_exact(metas.len());
                for (i, c) in metas.into_iter().enumerate() {
                    let info = lookup(i, Some(&c.offsets))?;
                    let (file, file_size, rank) = if let Some(facts) =
                        data_files.get(&*info.relative_path)
                    {
                        facts.clone()
                    } else {
                        let file = format!("{dir}{}", info.relative_path);
                        let size = source.size(&file).map_err(|_| IndexError::Inconsistent {
                            file: metadata_name.to_owned(),
                            what: format!("{key}: data file `{file}` is missing"),
                        })?;
                        file_sizes.insert(file.clone(), size);
                        let facts = (file, size, dcp_rank(&info.relative_path));
                        data_files.insert(&*info.relative_path, facts.clone());
                        facts
                    };
                    let mut chunk = Chunk {
                        offsets: c.offsets,
                        sizes: c.sizes,
                        file,
                        byte_offset: info.offset,
                        byte_length: info.length,
                        rank,
                        encoding: ChunkEncoding::TorchSaveItem,
                    };
                    match dcp::item_transform(&info.transforms) {
                        Ok(None) => {}
                        Ok(Some(dcp::ItemTransform::Zstd)) => {
                            // A compressed torch.save archive (torch applies extensions to the
                            // TORCH_SAVE serialization): nothing to read while indexing.
                            chunk.encoding = ChunkEncoding::ZstdTorchSaveItem;
                            chunks.push(chunk);
                            continue;
                        }
                        Err(what) => {
                            return Err(IndexError::Unsupported {
                                key: key.clone(),
                                file: chunk.file,
                                what,
                            });
                        }
                    }
                    // The serialization is decided once per file, from its first tensor item:
                    // a torch.save archive (default) or a safetensors blob (SAFETENSORS). Only
                    // that item's first bytes are read, never tensor data.
                    let file = &chunk.file;
                    let zip_file = if let Some(z) = zip_files.get(file) {
                        *z
                    } else {
                        let is_zip = if info.offset >= file_size {
                            true // past the end: `check` reports it with the key
                        } else {
                            let head = source.read_range(
                                file,
                                info.offset,
                                4.min(file_size - info.offset),
                            )?;
                            torch_zip::looks_like_zip(&head)
                        };
                        zip_files.insert(file.clone(), is_zip);
                        is_zip
                    };
                    if !zip_file {
                        safetensors_serialization = true;
                        let blob_key = (file.clone(), info.offset);
                        if !blobs.contains_key(&blob_key) {
                            blobs.insert(
                                blob_key.clone(),
                                read_blob(source, file, info.offset, file_size)?,
                            );
                        }
                        let Some((off, len)) = blobs[&blob_key].get(key.as_str()) else {
                            return Err(IndexError::Inconsistent {
                                file: file.clone(),
                                what: format!(
                                    "{key}: the safetensors blob at byte {} has no tensor of this name",
                                    info.offset
                                ),
                            });
                        };
                        chunk.byte_offset = *off;
                        chunk.byte_length = *len;
                        chunk.encoding = ChunkEncoding::Raw {
                            storage_offset: 0,
                            strides: contiguous_strides(&chunk.sizes),
                        };
                    }
                    chunks.push(chunk);
                }
                (EntryKind::Tensor, Some(dtype), Some(size))
            }
        };
        // A tensor's data files were sized when first seen (`data_files`); a bytes item's were not.
        if matches!(kind, EntryKind::Bytes) {
            for c in &chunks {
                if !file_sizes.contains_key(&c.file) {
                    let size = source.size(&c.file).map_err(|_| IndexError::Inconsistent {
                        file: metadata_name.to_owned(),
                        what: format!("{key}: data file `{}` is missing", c.file),
                    })?;
                    file_sizes.insert(c.file.clone(), size);
                }
            }
        }
        let clean_key = join_path(&clean_path_v);
        let (key_out, raw_key) = if clean_path_v == path {
            (key.clone(), None)
        } else {
            (clean_key, Some(key.clone()))
        };
        entries.push(IndexEntry {
            position: Some(entries.len() as u64),
            object: None,
            flat_param: key_out.ends_with("_flat_param"),
            key: key_out,
            raw_key,
            path: clean_path_v,
            kind,
            dtype,
            shape,
            chunks,
            fsdp: None,
            role: None,
            value: None,
        });
    }
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    let has_optimizer_state = assign_roles(&mut entries);
    let mut files: BTreeMap<String, FileInfo> = file_sizes
        .into_iter()
        .map(|(f, size)| {
            let rank = dcp_rank(&f);
            (
                f,
                FileInfo {
                    size,
                    rank,
                    unreferenced_bytes: 0,
                },
            )
        })
        .collect();
    files.insert(
        metadata_name.to_owned(),
        FileInfo {
            size: bytes.len() as u64,
            rank: None,
            unreferenced_bytes: 0,
        },
    );
    // Data files no item refers to (ranks whose plan was empty write empty files) are listed too.
    for n in source.names() {
        if n.starts_with(&dir) && n.ends_with(".distcp") && !files.contains_key(&n) {
            let size = source.size(&n)?;
            files.insert(
                n.clone(),
                FileInfo {
                    size,
                    rank: dcp_rank(&n),
                    unreferenced_bytes: 0,
                },
            );
        }
    }
    // `storage_data` holds a record (three strings, a vector) per chunk: freed off this thread.
    drop(join);
    drop(data_files);
    drop_in_background((meta.storage, meta.planner_data));
    Ok(CheckpointIndex {
        format: Format::Dcp,
        kind: if safetensors_serialization {
            CheckpointKind::DcpSafetensors
        } else {
            CheckpointKind::DcpTorchSave
        },
        has_optimizer_state,
        entries,
        files,
        dcp: Some(DcpFacts {
            version: meta.version,
            checkpoint_id: meta.checkpoint_id,
            save_id: meta.save_id,
            metadata_globals: meta.globals,
        }),
    })
}

/// Frees `value` on a short-lived thread of its own where threads can be started (a large index
/// frees hundreds of thousands of small allocations), else here (the closure, and `value` with it,
/// is dropped when the thread cannot start).
fn drop_in_background<T: Send + 'static>(value: T) {
    let _ = std::thread::Builder::new()
        .name("shardscope-free".into())
        .spawn(move || drop(value));
}

/// Reads the header of the safetensors blob at `offset` of `file`: name -> absolute byte range.
fn read_blob(
    source: &dyn Source,
    file: &str,
    offset: u64,
    size: u64,
) -> Result<HashMap<String, (u64, u64)>, IndexError> {
    let st_err = |source| IndexError::Safetensors {
        file: file.to_owned(),
        source,
    };
    let head = source.read_range(file, offset, 8.min(size.saturating_sub(offset)))?;
    let n = match <[u8; 8]>::try_from(head.as_ref()) {
        Ok(len) => u64::from_le_bytes(len),
        Err(_) => {
            return Err(st_err(SafetensorsError::Invalid {
                message: format!(
                    "item at byte {offset} is neither a torch.save archive nor a safetensors blob"
                ),
            }));
        }
    };
    let header_end = n
        .checked_add(8)
        .filter(|&e| e <= size.saturating_sub(offset))
        .ok_or_else(|| {
            st_err(SafetensorsError::Invalid {
                message: format!(
                    "safetensors header at byte {offset} claims {n} bytes, past the end of the file"
                ),
            })
        })?;
    let header = source.read_range(file, offset, header_end)?;
    let len = st::blob_len(&header).map_err(st_err)?;
    let end = offset.checked_add(len).filter(|&e| e <= size).ok_or_else(|| {
        st_err(SafetensorsError::Invalid {
            message: format!("safetensors blob at byte {offset} ({len} bytes) runs past the end of the file ({size})"),
        })
    })?;
    // The header alone: tensor bytes are never read (browsers read by range).
    let parsed = st::read_header_prefix(&header, end - offset).map_err(st_err)?;
    Ok(parsed
        .tensors
        .into_iter()
        .map(|t| (t.name, (offset + t.offset, t.len)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        fqn: &str,
        offsets: Option<Vec<u64>>,
        file: &str,
    ) -> (dcp::StorageIndex, dcp::StorageInfo) {
        (
            dcp::StorageIndex {
                fqn: fqn.into(),
                offset: offsets.map(Vec::into_boxed_slice),
                index: None,
            },
            dcp::StorageInfo {
                relative_path: file.into(),
                offset: 0,
                length: 0,
                transforms: Vec::new(),
            },
        )
    }

    #[test]
    fn storage_join_in_order_out_of_order_and_missing() {
        let storage = vec![
            record("a", Some(vec![0, 0]), "a0"),
            record("a", Some(vec![2, 0]), "a1"),
            record("b", None, "b"),
            // `c`'s records in the reverse order of its chunk list, and one repeated.
            record("c", Some(vec![4]), "c2-first"),
            record("c", Some(vec![2]), "c1"),
            record("c", Some(vec![0]), "c0"),
            record("c", Some(vec![4]), "c2-last"),
        ];
        let mut join = StorageJoin::new(&storage);
        let path = |j: &mut StorageJoin<'_>, f: &str, i: usize, o: Option<&[u64]>| {
            j.find(f, i, o).map(|info| info.relative_path.to_string())
        };
        assert_eq!(
            path(&mut join, "a", 0, Some(&[0, 0])).as_deref(),
            Some("a0")
        );
        assert_eq!(
            path(&mut join, "a", 1, Some(&[2, 0])).as_deref(),
            Some("a1")
        );
        assert_eq!(path(&mut join, "b", 0, None).as_deref(), Some("b"));
        assert_eq!(path(&mut join, "c", 0, Some(&[0])).as_deref(), Some("c0"));
        assert_eq!(path(&mut join, "c", 1, Some(&[2])).as_deref(), Some("c1"));
        // Not at its position: the last record of those offsets, as a dict keeps it.
        assert_eq!(
            path(&mut join, "c", 2, Some(&[4])).as_deref(),
            Some("c2-last")
        );
        assert_eq!(path(&mut join, "a", 0, Some(&[1, 0])), None);
        assert_eq!(path(&mut join, "a", 5, Some(&[9, 9])), None);
        assert_eq!(path(&mut join, "zzz", 0, None), None);
        assert_eq!(path(&mut join, "b", 0, Some(&[0])), None);
    }
}
