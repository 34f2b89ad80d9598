//! Safetensors files (one, or shards with an HF index) into a [`CheckpointIndex`].

use std::collections::{BTreeMap, BTreeSet};

use crate::formats::safetensors::{self as st, SafetensorsError};
use crate::index::names::file_ext;
use crate::index::values::contiguous_strides;
use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, EntryKind, FileInfo, Format, IndexEntry,
    IndexError, PathSeg, rank_from_name,
};
use crate::model::fqn::clean_tensor_name;
use crate::source::Source;

#[allow(
    clippy::too_many_lines,
    reason = "reads the HF index, each file's header and DCP_SHARDING_INFO into entries in one pass"
)]
pub(crate) fn index_safetensors(
    source: &dyn Source,
    names: &[String],
) -> Result<CheckpointIndex, IndexError> {
    let mut files: Vec<String> = names
        .iter()
        .filter(|n| file_ext(n) == "safetensors")
        .cloned()
        .collect();
    if let Some(index_name) = names
        .iter()
        .find(|n| n.ends_with(".safetensors.index.json"))
    {
        let bytes = crate::formats::read_all_capped(
            source,
            index_name,
            crate::formats::MAX_HF_INDEX_BYTES,
            "a safetensors index file",
        )?;
        let index = st::read_index(&bytes).map_err(|source| IndexError::Safetensors {
            file: index_name.clone(),
            source,
        })?;
        let dir = index_name
            .rsplit_once('/')
            .map_or(String::new(), |(d, _)| format!("{d}/"));
        let referenced: BTreeSet<String> = index
            .weight_map
            .values()
            .map(|f| format!("{dir}{f}"))
            .collect();
        for f in &referenced {
            if !source.contains(f) {
                return Err(IndexError::Inconsistent {
                    file: index_name.clone(),
                    what: format!("weight_map names `{f}`, which is missing"),
                });
            }
        }
        files = referenced.into_iter().collect();
    }
    let mut by_key: BTreeMap<String, IndexEntry> = BTreeMap::new();
    let mut file_infos = BTreeMap::new();
    let mut sharding_info = false; // DCP_SHARDING_INFO seen (HF writer); pieces only if offsets say so
    for file in &files {
        let size = source.size(file)?;
        let header = read_st_header(source, file, 0, size)?;
        let (rank, _) = rank_from_name(file);
        for t in header.tensors {
            sharding_info |= t.saved_offsets.is_some();
            let offsets = t
                .saved_offsets
                .clone()
                .unwrap_or_else(|| vec![0; t.shape.len()]);
            let chunk = Chunk {
                offsets: offsets.into(),
                sizes: t.shape.clone().into(),
                file: file.clone().into(),
                byte_offset: t.offset,
                byte_length: t.len,
                rank,
                encoding: ChunkEncoding::Raw {
                    storage_offset: 0,
                    strides: contiguous_strides(&t.shape),
                },
            };
            let clean = clean_tensor_name(&t.name);
            let position = by_key.len() as u64;
            let e = by_key.entry(clean.clone()).or_insert_with(|| IndexEntry {
                position: Some(position),
                object: None,
                key: clean.clone(),
                raw_key: (clean != t.name).then(|| t.name.clone()),
                path: vec![PathSeg::Key(clean.clone())],
                kind: EntryKind::Tensor,
                dtype: Some(t.dtype),
                shape: Some(vec![0; t.shape.len()]),
                chunks: Vec::new(),
                fsdp: None,
                role: None,
                flat_param: false,
                value: None,
            });
            if e.dtype != Some(t.dtype) || e.shape.as_ref().map(Vec::len) != Some(t.shape.len()) {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!(
                        "{}: dtype or rank differs from another file's piece",
                        t.name
                    ),
                });
            }
            // Global size = max(offset + size) per dim, as HuggingFaceStorageReader does.
            if let Some(shape) = e.shape.as_mut() {
                for ((g, &o), &s) in shape.iter_mut().zip(&chunk.offsets).zip(&chunk.sizes) {
                    *g = (*g).max(o.saturating_add(s));
                }
            }
            e.chunks.push(chunk);
        }
        file_infos.insert(
            file.clone(),
            FileInfo {
                size,
                rank,
                unreferenced_bytes: 0,
            },
        );
    }
    Ok(CheckpointIndex {
        format: Format::Safetensors,
        kind: if sharding_info
            && by_key.values().any(|e| {
                e.chunks.len() > 1 || e.chunks.iter().any(|c| c.offsets.iter().any(|&o| o > 0))
            }) {
            CheckpointKind::HfDistributedSafetensors
        } else {
            CheckpointKind::HfSafetensors
        },
        has_optimizer_state: false,
        entries: by_key.into_values().collect(),
        files: file_infos,
        dcp: None,
    })
}

/// Reads the header of the safetensors blob `offset..offset + len` of `file` from its first bytes
/// alone (the 8-byte length, then the header): no tensor bytes are read.
fn read_st_header(
    source: &dyn Source,
    file: &str,
    offset: u64,
    len: u64,
) -> Result<st::SafetensorsHeader, IndexError> {
    let st_err = |source| IndexError::Safetensors {
        file: file.to_owned(),
        source,
    };
    let first = source.read_range(file, offset, 8.min(len))?;
    let end = st::header_end(&first).map_err(st_err)?;
    if end > len {
        return Err(st_err(SafetensorsError::Invalid {
            message: format!("the header claims {} bytes, the file holds {len}", end - 8),
        }));
    }
    let prefix = source.read_range(file, offset, end)?;
    st::read_header_prefix(&prefix, len).map_err(st_err)
}
