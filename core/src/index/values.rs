//! Value reads: chunks, whole tensors, bytes items.

use std::borrow::Cow;
use std::collections::BTreeSet;

use crate::dtype::DType;
use crate::formats::dcp::{self};
use crate::formats::pickle::{PyValue, StorageRef, TensorRef};
use crate::formats::torch_zip;
use crate::index::check::check_tiling;
use crate::index::{
    CheckpointIndex, Chunk, ChunkEncoding, EntryKind, ITEM_ARCHIVE_OVERHEAD, IndexEntry,
    IndexError, MAX_BYTES_ITEM, Problem, json_of,
};
use crate::source::Source;

/// Row-major strides of a contiguous tensor (as the index records them; a zero dimension is
/// kept, unlike [`crate::shape::contiguous_strides`]).
pub(crate) fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    strides
}

/// Contiguous little-endian values of a tensor or chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

impl CheckpointIndex {
    /// The chunk's values, contiguous little-endian, of shape `chunk.sizes`.
    pub fn read_chunk(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
        chunk: &Chunk,
    ) -> Result<TensorData, IndexError> {
        let dtype = entry.dtype.ok_or_else(|| IndexError::NotReadable {
            key: entry.key.clone(),
            what: "not a tensor".into(),
        })?;
        let bad = |what: String| IndexError::BadChunk {
            key: entry.key.clone(),
            file: chunk.file.to_string(),
            offset: chunk.byte_offset,
            end: chunk.byte_offset.saturating_add(chunk.byte_length),
            what,
        };
        let mut bytes = source.read_range(&chunk.file, chunk.byte_offset, chunk.byte_length)?;
        if chunk.encoding == ChunkEncoding::ZstdTorchSaveItem {
            // The archive holds the chunk's elements and a few KiB of zip and pickle.
            let limit = chunk
                .numel()
                .and_then(|n| n.checked_mul(dtype.size_bytes() as u64))
                .and_then(|n| n.checked_add(ITEM_ARCHIVE_OVERHEAD))
                .ok_or_else(|| bad("the chunk's size overflows".into()))?;
            bytes = Cow::Owned(
                dcp::decompress_zstd(&bytes, limit)
                    .map_err(|e| bad(format!("stream.zstd/1 item: {e}")))?,
            );
        }
        let data = match &chunk.encoding {
            ChunkEncoding::Raw {
                storage_offset,
                strides,
            } => {
                let item = dtype.size_bytes() as u64;
                let view = TensorRef {
                    storage: StorageRef {
                        key: entry.key.clone(),
                        dtype,
                        location: String::new(),
                        numel: chunk.byte_length / item,
                    },
                    storage_offset: *storage_offset,
                    shape: chunk.sizes.to_vec(),
                    stride: strides.clone(),
                    requires_grad: false,
                    wrapper: None,
                };
                if strides.len() != chunk.sizes.len() {
                    return Err(bad("strides and sizes differ in length".into()));
                }
                torch_zip::gather_view(&bytes, &view).map_err(|e| bad(e.to_string()))?
            }
            ChunkEncoding::TorchSaveItem | ChunkEncoding::ZstdTorchSaveItem => {
                let archive = torch_zip::read_archive(&bytes).map_err(|e| bad(e.to_string()))?;
                let PyValue::Tensor(t) = &archive.root else {
                    return Err(bad(format!(
                        "the item holds a {}, not a tensor",
                        archive.root.type_name()
                    )));
                };
                if t.storage.dtype != dtype || t.shape != chunk.sizes {
                    return Err(bad(format!(
                        "the item holds a {} tensor of shape {:?}, the metadata says {dtype} {:?}",
                        t.storage.dtype, t.shape, chunk.sizes
                    )));
                }
                let range = archive.storage_range(t).map_err(|e| bad(e.to_string()))?;
                let storage = &bytes[range.offset as usize..(range.offset + range.len) as usize];
                torch_zip::gather_view(storage, t).map_err(|e| bad(e.to_string()))?
            }
        };
        Ok(TensorData {
            dtype,
            shape: chunk.sizes.to_vec(),
            bytes: data,
        })
    }

    /// The most bytes the chunks of `entry` can decode to: the sizes of the files holding them
    /// (a compressed chunk counts its byte length times zstd's largest expansion instead).
    pub fn max_decoded_bytes(&self, entry: &IndexEntry) -> u64 {
        let files: BTreeSet<&str> = entry
            .chunks
            .iter()
            .filter(|c| c.encoding != ChunkEncoding::ZstdTorchSaveItem)
            .map(|c| c.file.as_ref())
            .collect();
        let plain = files
            .iter()
            .map(|f| self.files.get(*f).map_or(0, |i| i.size))
            .fold(0, u64::saturating_add);
        entry
            .chunks
            .iter()
            .filter(|c| c.encoding == ChunkEncoding::ZstdTorchSaveItem)
            .map(Chunk::max_decoded_bytes)
            .fold(plain, u64::saturating_add)
    }

    /// The whole tensor, assembled from its chunks (replicas are read once).
    pub fn read_tensor(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
    ) -> Result<TensorData, IndexError> {
        let not = |what: &str| IndexError::NotReadable {
            key: entry.key.clone(),
            what: what.into(),
        };
        let dtype = entry.dtype.ok_or_else(|| not("not a tensor"))?;
        let shape = entry.shape.clone().ok_or_else(|| {
            not("rank-local pieces with no global shape: read each chunk instead")
        })?;
        let item = dtype.size_bytes();
        let nbytes = entry.nbytes().ok_or_else(|| not("size overflows"))?;
        // Never allocate more than the chunks' bytes could fill.
        let available = self.max_decoded_bytes(entry);
        if nbytes > available {
            return Err(not(
                "the tensor is larger than the files holding its chunks",
            ));
        }
        let problems: Vec<Problem> = {
            let mut p = Vec::new();
            check_tiling(entry, &shape, &mut p);
            p
        };
        if let Some(p) = problems.first() {
            return Err(not(&p.what));
        }
        let total = usize::try_from(nbytes).map_err(|_| not("too large"))?;
        let mut out = Vec::new();
        let strides = contiguous_strides(&shape);
        let mut done: BTreeSet<(Vec<u64>, Vec<u64>)> = BTreeSet::new();
        for c in &entry.chunks {
            if !done.insert((c.offsets.to_vec(), c.sizes.to_vec())) {
                continue;
            }
            let data = self.read_chunk(source, entry, c)?;
            // Allocated once a chunk has been read: a compressed chunk's size is only proven by
            // decoding it, so a lying `.metadata` fails before the whole tensor is allocated.
            if out.len() != total {
                out = Vec::new();
                out.try_reserve_exact(total)
                    .map_err(|_| not(&format!("its {total} bytes cannot be allocated")))?;
                out.resize(total, 0);
            }
            copy_box(&mut out, &strides, &c.offsets, &c.sizes, &data.bytes, item);
        }
        Ok(TensorData {
            dtype,
            shape,
            bytes: out,
        })
    }

    /// Where `chunk`'s elements lie in its file, `(file, start, end)`: their byte range when they
    /// are one contiguous run there, else (a compressed item, a strided view) the chunk's whole
    /// stored range. For messages naming where a value is.
    pub fn stored_range(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
        chunk: &Chunk,
    ) -> (String, u64, u64) {
        let item = entry.dtype.map_or(1, DType::size_bytes) as u64;
        let located = match chunk.encoding {
            ChunkEncoding::ZstdTorchSaveItem => None,
            _ => self.locate_chunk(source, entry, chunk).ok(),
        };
        located
            .and_then(|l| {
                let (start, len) = l.contiguous_range(&chunk.sizes, item)?;
                Some((l.file, start, start.saturating_add(len)))
            })
            .unwrap_or_else(|| {
                (
                    chunk.file.to_string(),
                    chunk.byte_offset,
                    chunk.byte_offset.saturating_add(chunk.byte_length),
                )
            })
    }

    /// Where the chunk's elements lie in its file, without reading them: for readers that copy
    /// chunk data straight into an output buffer (`shardscope convert`). For a DCP item the item's
    /// zip directory and pickle are parsed (a few hundred bytes); the storage is not touched. The
    /// view is checked to lie inside the storage.
    pub fn locate_chunk(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
        chunk: &Chunk,
    ) -> Result<ChunkLocation, IndexError> {
        let dtype = entry.dtype.ok_or_else(|| IndexError::NotReadable {
            key: entry.key.clone(),
            what: "not a tensor".into(),
        })?;
        let bad = |what: String| IndexError::BadChunk {
            key: entry.key.clone(),
            file: chunk.file.to_string(),
            offset: chunk.byte_offset,
            end: chunk.byte_offset.saturating_add(chunk.byte_length),
            what,
        };
        let item = dtype.size_bytes() as u64;
        let location = match &chunk.encoding {
            ChunkEncoding::Raw {
                storage_offset,
                strides,
            } => ChunkLocation {
                file: chunk.file.to_string(),
                storage_byte_offset: chunk.byte_offset,
                storage_bytes: chunk.byte_length,
                storage_offset: *storage_offset,
                strides: strides.clone(),
            },
            ChunkEncoding::ZstdTorchSaveItem => {
                return Err(bad(
                    "a stream.zstd/1 (compressed) item: its elements have no location in the file; \
                     read it with read_chunk"
                        .into(),
                ));
            }
            ChunkEncoding::TorchSaveItem => {
                // The item's zip headers, `data.pkl` and central directory sit at its two ends:
                // only those are read (no buffer of the item's size); the whole item when they
                // do not parse alone, or where whole reads are cheap (memory, mmap).
                // (torch writes `data.pkl` first; its central directory is < 1 KiB per member.)
                const HEAD_BYTES: u64 = 64 << 10;
                const TAIL_BYTES: u64 = 16 << 10;
                let from_ends = if source.whole_reads_are_cheap() {
                    None
                } else {
                    torch_zip::read_item_archive(
                        source,
                        &chunk.file,
                        chunk.byte_offset,
                        chunk.byte_length,
                        HEAD_BYTES,
                        TAIL_BYTES,
                    )?
                };
                let archive = if let Some(archive) = from_ends {
                    archive
                } else {
                    let bytes =
                        source.read_range(&chunk.file, chunk.byte_offset, chunk.byte_length)?;
                    torch_zip::read_archive(&bytes).map_err(|e| bad(e.to_string()))?
                };
                let PyValue::Tensor(t) = &archive.root else {
                    return Err(bad(format!(
                        "the item holds a {}, not a tensor",
                        archive.root.type_name()
                    )));
                };
                if t.storage.dtype != dtype || t.shape != chunk.sizes {
                    return Err(bad(format!(
                        "the item holds a {} tensor of shape {:?}, the metadata says {dtype} {:?}",
                        t.storage.dtype, t.shape, chunk.sizes
                    )));
                }
                let range = archive.storage_range(t).map_err(|e| bad(e.to_string()))?;
                ChunkLocation {
                    file: chunk.file.to_string(),
                    storage_byte_offset: chunk.byte_offset.saturating_add(range.offset),
                    storage_bytes: range.len,
                    storage_offset: t.storage_offset,
                    strides: t.stride.clone(),
                }
            }
        };
        if location.strides.len() != chunk.sizes.len() {
            return Err(bad("strides and sizes differ in length".into()));
        }
        // The view's last element must lie inside the storage bytes.
        let extent = if chunk.sizes.contains(&0) {
            Some(0)
        } else {
            chunk
                .sizes
                .iter()
                .zip(&location.strides)
                .try_fold(location.storage_offset, |acc, (&d, &s)| {
                    acc.checked_add((d - 1).checked_mul(s)?)
                })
                .and_then(|last| last.checked_add(1))
        };
        match extent.and_then(|e| e.checked_mul(item)) {
            Some(end) if end <= location.storage_bytes => Ok(location),
            _ => Err(bad(format!(
                "the view (offset {}, strides {:?}, sizes {:?}) reaches past the {} storage bytes",
                location.storage_offset, location.strides, chunk.sizes, location.storage_bytes
            ))),
        }
    }

    /// The `torch.save` archive of a bytes item, decompressed when it is a `stream.zstd/1` item
    /// (to at most [`MAX_BYTES_ITEM`] bytes).
    fn bytes_item<'s>(
        source: &'s dyn Source,
        entry: &IndexEntry,
        c: &Chunk,
    ) -> Result<Cow<'s, [u8]>, IndexError> {
        let bytes = source.read_range(&c.file, c.byte_offset, c.byte_length)?;
        if c.encoding != ChunkEncoding::ZstdTorchSaveItem {
            return Ok(bytes);
        }
        let limit = c.max_decoded_bytes().min(MAX_BYTES_ITEM);
        dcp::decompress_zstd(&bytes, limit)
            .map(Cow::Owned)
            .map_err(|e| IndexError::BadChunk {
                key: entry.key.clone(),
                file: c.file.to_string(),
                offset: c.byte_offset,
                end: c.byte_offset.saturating_add(c.byte_length),
                what: format!("stream.zstd/1 item: {e}"),
            })
    }

    /// Decodes a bytes item (DCP) into the Python value the reader rebuilt (tuples stay tuples):
    /// what a converter writes back with `formats::write::pickle::PyValue::from_read_value`.
    pub fn read_bytes_object(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
    ) -> Result<PyValue, IndexError> {
        let c = entry
            .chunks
            .first()
            .filter(|_| entry.kind == EntryKind::Bytes)
            .ok_or_else(|| IndexError::NotReadable {
                key: entry.key.clone(),
                what: "not a bytes item".into(),
            })?;
        let bytes = Self::bytes_item(source, entry, c)?;
        let archive = torch_zip::read_archive(&bytes).map_err(|e| IndexError::BadChunk {
            key: entry.key.clone(),
            file: c.file.to_string(),
            offset: c.byte_offset,
            end: c.byte_offset.saturating_add(c.byte_length),
            what: e.to_string(),
        })?;
        Ok(archive.root)
    }

    /// Decodes a bytes item (DCP) into JSON.
    pub fn read_bytes_value(
        &self,
        source: &dyn Source,
        entry: &IndexEntry,
    ) -> Result<serde_json::Value, IndexError> {
        if entry.kind == EntryKind::Scalar {
            return Ok(entry.value.clone().unwrap_or(serde_json::Value::Null));
        }
        Ok(json_of(&self.read_bytes_object(source, entry)?))
    }

    /// Fills `value` of every bytes entry by decoding it, and `object` (the Python value, tuples
    /// kept) for writers that re-pickle it.
    pub fn decode_bytes_values(&mut self, source: &dyn Source) -> Result<(), IndexError> {
        let mut values = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if e.kind == EntryKind::Bytes {
                values.push((i, self.read_bytes_object(source, e)?));
            }
        }
        for (i, v) in values {
            self.entries[i].value = Some(json_of(&v));
            self.entries[i].object = Some(Box::new(v));
        }
        Ok(())
    }
}

/// Where a chunk's elements lie in its file (see [`CheckpointIndex::locate_chunk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLocation {
    pub file: String,
    /// Absolute byte offset of the storage holding the chunk.
    pub storage_byte_offset: u64,
    /// Bytes of that storage.
    pub storage_bytes: u64,
    /// The chunk's first element in the storage, in elements.
    pub storage_offset: u64,
    /// The chunk's strides in the storage, in elements.
    pub strides: Vec<u64>,
}

impl ChunkLocation {
    /// The absolute byte range of the chunk's data when its view is row-major contiguous
    /// (`sizes` are the chunk's sizes, `item` the element size); `None` for a strided view.
    pub fn contiguous_range(&self, sizes: &[u64], item: u64) -> Option<(u64, u64)> {
        let numel = sizes.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        let mut expected = 1u64;
        for (&d, &s) in sizes.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected && numel != 0 {
                return None;
            }
            expected = expected.saturating_mul(d);
        }
        let start = self
            .storage_byte_offset
            .checked_add(self.storage_offset.checked_mul(item)?)?;
        Some((start, numel.checked_mul(item)?))
    }
}

/// Copies a contiguous box of `sizes` into `out` (contiguous with `strides`) at `offsets`.
fn copy_box(
    out: &mut [u8],
    strides: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    src: &[u8],
    item: usize,
) {
    let numel: u64 = sizes.iter().product();
    if numel == 0 {
        return;
    }
    if sizes.is_empty() {
        out[..item].copy_from_slice(&src[..item]);
        return;
    }
    let ndim = sizes.len();
    let row = sizes[ndim - 1] as usize * item;
    let rows = (numel / sizes[ndim - 1]) as usize;
    let mut index = vec![0u64; ndim - 1];
    for r in 0..rows {
        let mut pos = offsets[ndim - 1];
        for d in 0..ndim - 1 {
            pos += (offsets[d] + index[d]) * strides[d];
        }
        let dst = pos as usize * item;
        out[dst..dst + row].copy_from_slice(&src[r * row..(r + 1) * row]);
        for d in (0..ndim - 1).rev() {
            index[d] += 1;
            if index[d] < sizes[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_box_places_rows() {
        let mut out = vec![0u8; 6];
        copy_box(&mut out, &[3, 1], &[0, 1], &[2, 2], &[1, 2, 3, 4], 1);
        assert_eq!(out, vec![0, 1, 2, 0, 3, 4]);
    }
}
