//! A DCP directory (its `.metadata`) into a [`CheckpointIndex`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::formats::dcp::{self, PlannerStep, TableItemKind};
use crate::formats::safetensors::{self as st, SafetensorsError};
use crate::formats::torch_zip;
use crate::index::read::torch::{assign_roles, clean_path, join_path};
use crate::index::values::contiguous_strides;
use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, DcpFacts, EntryKind, FastMap, FileInfo,
    Format, IndexEntry, IndexError, PathSeg,
};
use crate::shape::Dims;
use crate::source::Source;

fn dcp_rank(file: &str) -> Option<u32> {
    let base = file.rsplit('/').next().unwrap_or(file);
    base.strip_prefix("__")?.split('_').next()?.parse().ok()
}

/// The `.metadata` as a table, and its size: read by the streaming reader where it recognises the
/// pickle (every `.metadata` torch writes), else whole by the general pickle machine, which
/// reports what is wrong with a damaged or hostile file.
fn metadata_table(
    source: &dyn Source,
    metadata_name: &str,
) -> Result<(dcp::MetadataTable, u64), IndexError> {
    let size = source.size(metadata_name)?;
    if size <= crate::formats::MAX_DCP_METADATA_BYTES
        && let Ok(table) = dcp::read_table(source, metadata_name, size)
    {
        return Ok((table, size));
    }
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
    Ok((dcp::MetadataTable::from_metadata(meta), bytes.len() as u64))
}

/// Indexes a DCP directory given the name of its `.metadata` file in the source.
pub fn index_dcp(source: &dyn Source, metadata_name: &str) -> Result<CheckpointIndex, IndexError> {
    let (table, metadata_size) = metadata_table(source, metadata_name)?;
    index_table(source, metadata_name, table, metadata_size)
}

/// The index of the DCP whose `.metadata` (`metadata_name`, of `metadata_size` bytes) reads as
/// `table`.
#[allow(
    clippy::too_many_lines,
    reason = "turns every `.metadata` item (tensors, bytes, zstd transforms, SAFETENSORS blobs) into entries in one pass"
)]
fn index_table(
    source: &dyn Source,
    metadata_name: &str,
    table: dcp::MetadataTable,
    metadata_size: u64,
) -> Result<CheckpointIndex, IndexError> {
    let dir = metadata_name
        .rsplit_once('/')
        .map_or(String::new(), |(d, _)| format!("{d}/"));
    // Per record file: its name in the source (shared by its chunks) and rank.
    let names: Vec<(Arc<str>, Option<u32>)> = table
        .files
        .iter()
        .map(|p| (Arc::from(format!("{dir}{p}")), dcp_rank(p)))
        .collect();
    // Per data file: its size, and (SAFETENSORS serialization) its blob header.
    let mut file_sizes: BTreeMap<String, u64> = BTreeMap::new();
    // Per record file: its size, once a tensor chunk in it was seen.
    let mut data_files: Vec<Option<u64>> = vec![None; names.len()];
    let mut blobs: HashMap<(u32, u64), HashMap<String, (u64, u64)>> = HashMap::new();
    let mut safetensors_serialization = false;
    let mut zip_files: FastMap<u32, bool> = FastMap::default();
    let mut entries = Vec::with_capacity(table.items.len());
    let missing = |key: &str, offsets: Option<&[u64]>| IndexError::Inconsistent {
        file: metadata_name.to_owned(),
        what: format!("{key}: no storage_data record for the chunk at offsets {offsets:?}"),
    };
    // Each data file's first bytes are read below (its first item's serialization): asked for
    // at once, for a source that fetches in rounds (the browser's), so that it does not take a
    // round a file.
    let mut first_item: Vec<Option<u64>> = vec![None; names.len()];
    for item in &table.items {
        if let TableItemKind::Tensor { chunks, .. } = &item.kind {
            for place in chunks.iter().filter_map(|c| c.place.as_ref()) {
                if let Some(first @ None) = first_item.get_mut(place.file as usize) {
                    *first = Some(place.offset);
                }
            }
        }
    }
    let heads: Vec<(&str, u64, u64)> = first_item
        .iter()
        .zip(&names)
        .filter_map(|(offset, (file, _))| offset.map(|o| (&**file, o, 4)))
        .collect();
    source.will_read(&heads);
    drop(heads);
    let stored_keys: Arc<[String]> = table.items.iter().map(|i| i.key.clone()).collect();
    // The items are moved into the index (a million chunks' offsets and sizes are not copied).
    for item in table.items {
        let key = &item.key;
        let path: Vec<PathSeg> = match table.planner_data.get(key) {
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
        let (kind, dtype, shape) = match item.kind {
            TableItemKind::Bytes { place } => {
                let place = place.ok_or_else(|| missing(key, None))?;
                let (file, rank) = &names[place.file as usize];
                let encoding =
                    match dcp::item_transform(&table.transforms[place.transforms as usize]) {
                        Ok(None) => ChunkEncoding::TorchSaveItem,
                        Ok(Some(dcp::ItemTransform::Zstd)) => ChunkEncoding::ZstdTorchSaveItem,
                        Err(what) => {
                            return Err(IndexError::Unsupported {
                                key: key.clone(),
                                file: file.to_string(),
                                what,
                            });
                        }
                    };
                chunks.push(Chunk {
                    offsets: Dims::new(),
                    sizes: Dims::new(),
                    file: Arc::clone(file),
                    byte_offset: place.offset,
                    byte_length: place.length,
                    rank: *rank,
                    encoding,
                });
                (EntryKind::Bytes, None, None)
            }
            TableItemKind::Tensor {
                dtype,
                size,
                chunks: metas,
            } => {
                chunks.reserve_exact(metas.len());
                for c in metas {
                    let place = c.place.ok_or_else(|| missing(key, Some(&c.offsets)))?;
                    let (file, rank) = &names[place.file as usize];
                    let file_size = if let Some(size) = data_files[place.file as usize] {
                        size
                    } else {
                        let size = source.size(file).map_err(|_| IndexError::Inconsistent {
                            file: metadata_name.to_owned(),
                            what: format!("{key}: data file `{file}` is missing"),
                        })?;
                        file_sizes.insert(file.to_string(), size);
                        data_files[place.file as usize] = Some(size);
                        size
                    };
                    let mut chunk = Chunk {
                        offsets: c.offsets,
                        sizes: c.sizes,
                        file: Arc::clone(file),
                        byte_offset: place.offset,
                        byte_length: place.length,
                        rank: *rank,
                        encoding: ChunkEncoding::TorchSaveItem,
                    };
                    match dcp::item_transform(&table.transforms[place.transforms as usize]) {
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
                                file: chunk.file.to_string(),
                                what,
                            });
                        }
                    }
                    // The serialization is decided once per file, from its first tensor item:
                    // a torch.save archive (default) or a safetensors blob (SAFETENSORS). Only
                    // that item's first bytes are read, never tensor data.
                    let zip_file = if let Some(z) = zip_files.get(&place.file) {
                        *z
                    } else {
                        let is_zip = if place.offset >= file_size {
                            true // past the end: `check` reports it with the key
                        } else {
                            let head = source.read_range(
                                file,
                                place.offset,
                                4.min(file_size - place.offset),
                            )?;
                            torch_zip::looks_like_zip(&head)
                        };
                        zip_files.insert(place.file, is_zip);
                        is_zip
                    };
                    if !zip_file {
                        safetensors_serialization = true;
                        let blob_key = (place.file, place.offset);
                        if let std::collections::hash_map::Entry::Vacant(slot) =
                            blobs.entry(blob_key)
                        {
                            slot.insert(read_blob(source, file, place.offset, file_size)?);
                        }
                        let Some((off, len)) = blobs[&blob_key].get(key.as_str()) else {
                            return Err(IndexError::Inconsistent {
                                file: file.to_string(),
                                what: format!(
                                    "{key}: the safetensors blob at byte {} has no tensor of this name",
                                    place.offset
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
                if !file_sizes.contains_key(&*c.file) {
                    let size = source.size(&c.file).map_err(|_| IndexError::Inconsistent {
                        file: metadata_name.to_owned(),
                        what: format!("{key}: data file `{}` is missing", c.file),
                    })?;
                    file_sizes.insert(c.file.to_string(), size);
                }
            }
        }
        let clean_key = join_path(&clean_path_v);
        let (key_out, raw_key) = if clean_path_v == path {
            (item.key, None)
        } else {
            (clean_key, Some(item.key))
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
            size: metadata_size,
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
    drop_in_background(table.planner_data);
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
            version: table.version,
            checkpoint_id: table.checkpoint_id,
            save_id: table.save_id,
            metadata_globals: table.globals,
            stored_keys,
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
    use crate::formats::dcp::test_pickle::{GenTensor, metadata};
    use crate::source::MemorySource;

    const RANKS: u64 = 64;

    fn tensors(
        n: usize,
        chunks: u64,
        drop_record_of: Option<usize>,
        reversed: bool,
    ) -> Vec<GenTensor> {
        (0..n)
            .map(|i| GenTensor {
                fqn: format!("model.layers{i}.weight"),
                rows: chunks * (2 + i as u64 % 3),
                cols: 3 + i as u64 % 4,
                chunks,
                reversed_records: reversed && i % 5 == 2,
                drop_last_record: drop_record_of == Some(i),
            })
            .collect()
    }

    /// The `.metadata` and its data files (each starting like a `torch.save` archive).
    fn checkpoint(meta: Vec<u8>) -> MemorySource {
        let mut s = MemorySource::new();
        s.insert(".metadata", meta);
        for r in 0..RANKS {
            let mut b = vec![0u8; 1 << 20];
            b[..4].copy_from_slice(b"PK\x03\x04");
            s.insert(format!("__{r}_0.distcp"), b);
        }
        s
    }

    /// The index from the streaming reader's table and from the general path's.
    fn both_ways(
        src: &MemorySource,
    ) -> (
        Result<CheckpointIndex, String>,
        Result<CheckpointIndex, String>,
    ) {
        let size = src.size(".metadata").unwrap();
        let bytes = src.read_all(".metadata").unwrap().into_owned();
        let fast = dcp::read_table(src, ".metadata", size).expect("the streaming reader reads it");
        let general = dcp::MetadataTable::from_metadata(dcp::read_metadata(&bytes).unwrap());
        (
            index_table(src, ".metadata", fast, size).map_err(|e| e.to_string()),
            index_table(src, ".metadata", general, size).map_err(|e| e.to_string()),
        )
    }

    #[test]
    fn a_metadata_of_many_chunks_gives_the_same_index_either_way() {
        let src = checkpoint(metadata(
            &tensors(12, 900, None, false),
            RANKS,
            Some("extra_state"),
        ));
        let (fast, general) = both_ways(&src);
        let fast = fast.unwrap();
        assert_eq!(Ok(&fast), general.as_ref());
        assert_eq!(Ok(&fast), index_dcp(&src, ".metadata").as_ref());
        assert_eq!(fast.entries.len(), 13);
        let chunks: usize = fast.entries.iter().map(|e| e.chunks.len()).sum();
        assert_eq!(chunks, 12 * 900 + 1);
        assert!(fast.check().is_empty(), "{:?}", fast.check());
        // One shared name per data file.
        let e = fast.entry("model.layers3.weight").unwrap();
        assert!(Arc::ptr_eq(
            &e.chunks[0].file,
            &fast.entry("model.layers4.weight").unwrap().chunks[0].file
        ));
    }

    #[test]
    fn records_out_of_order_and_missing_records_take_the_general_path() {
        // Records in another order than the chunks: the streaming reader gives up, the index is
        // the general path's (each chunk found by its offsets).
        let src = checkpoint(metadata(&tensors(12, 40, None, true), RANKS, None));
        let size = src.size(".metadata").unwrap();
        assert!(dcp::read_table(&src, ".metadata", size).is_err());
        let index = index_dcp(&src, ".metadata").unwrap();
        assert!(index.check().is_empty());
        assert_eq!(
            index.entries.iter().map(|e| e.chunks.len()).sum::<usize>(),
            12 * 40
        );
        // A chunk without a record: the general path's error.
        let src = checkpoint(metadata(&tensors(4, 50, Some(2), false), RANKS, None));
        let size = src.size(".metadata").unwrap();
        assert!(dcp::read_table(&src, ".metadata", size).is_err());
        let err = index_dcp(&src, ".metadata").unwrap_err().to_string();
        assert!(
            err.contains("model.layers2.weight: no storage_data record for the chunk at offsets Some([196, 0])"),
            "{err}"
        );
    }
}

#[cfg(test)]
mod hint_tests {
    use super::*;
    use crate::formats::dcp::test_pickle::{GenTensor, metadata};
    use crate::source::MemorySource;
    use crate::source::recording::Recording;

    #[test]
    fn every_data_file_head_is_hinted_in_one_call_before_it_is_read() {
        let ranks = 16;
        let tensors: Vec<GenTensor> = (0..5)
            .map(|i| GenTensor {
                fqn: format!("model.w{i}"),
                rows: 4 * ranks,
                cols: 3,
                chunks: ranks,
                reversed_records: false,
                drop_last_record: false,
            })
            .collect();
        let mut inner = MemorySource::new();
        inner.insert(".metadata", metadata(&tensors, ranks, None));
        for r in 0..ranks {
            let mut b = vec![0u8; 1 << 16];
            b[..4].copy_from_slice(b"PK\x03\x04");
            inner.insert(format!("__{r}_0.distcp"), b);
        }
        let src = Recording::new(inner);
        let index = index_dcp(&src, ".metadata").unwrap();
        let hinted = src.hinted.into_inner();
        assert_eq!(hinted.len(), 1, "one hint");
        // Each data file's head read is among the hinted ranges.
        let heads: Vec<(String, u64)> = src
            .reads
            .into_inner()
            .into_iter()
            .filter(|(n, _, _)| n.ends_with(".distcp"))
            .map(|(n, o, _)| (n, o))
            .collect();
        assert_eq!(heads.len(), ranks as usize);
        for (name, offset) in &heads {
            assert!(
                hinted[0].contains(&(name.clone(), *offset, 4)),
                "{name} at {offset} not hinted: {:?}",
                hinted[0]
            );
        }
        assert_eq!(hinted[0].len(), ranks as usize);
        assert_eq!(index.entries.len(), 5);
    }
}
