//! The conversion engine behind `shardscope convert`: any indexed checkpoint (DCP directory, full
//! safetensors or `torch.save` file) to safetensors (one file or HF shards), to a `torch.save` file
//! nested as `dcp_to_torch_save` nests it, or to a DCP directory sharded for N ranks.
//!
//! # Streaming
//! The reads of each output file are jobs run by [`exec`] (`--threads` readers, `--memory-limit`,
//! written in order: the same bytes for any thread count); tensors stored as contiguous dim-0 slabs
//! are read by byte range ([`Reader::slab_pieces`]: 16 MiB pieces for safetensors, DCP output
//! chunks in place). Multi-file outputs can be split over processes with [`part`].
//!
//! The checkpoint is indexed through [`Input`] (a memory-mapped local file set, or range reads of a
//! remote one; only metadata and each DCP
//! item's small zip directory are touched there); tensor bytes are read with `pread` straight into
//! the job's buffer ([`Reader::tensor_as`], [`Reader::range_as`]): a dim-0 slab chunk (the FSDP
//! case, and every single-chunk tensor) lands at its place with one read and no intermediate copy;
//! other boxes go through a reusable scratch buffer. Buffers are pooled under the memory limit, and
//! page-cache pages of the input never count against the process (as they would when copying out
//! of the mmap).
//!
//! Per-rank folders go the same way: their index is read through a view first (FSDP2:
//! `shardscope_core::view::fsdp2` names the optimizer ids; FSDP1 with `--model`:
//! `shardscope_core::view::fsdp1` turns flat pieces into original parameters), as
//! `shardscope_core::checkpoint::Checkpoint::open` decides.

pub mod exec;
pub mod part;
pub mod to_fsdp1;
pub mod to_fsdp2;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result, bail};
use shardscope_core::DType;
use shardscope_core::cast::{cast_in_place, cast_target};
use shardscope_core::formats::write::dcp::{
    BytesValue, DcpChunk, DcpEntry, DcpFileRecord, DcpFileWriter, DcpItemRef, DcpMetadataOptions,
    DcpPlan, DcpValue, EmptyRanks, PathKey, StoredItem, chunk_dim0, metadata_pickle,
};
use shardscope_core::formats::write::pickle::{PyValue, StorageSpec, TensorPickle};
use shardscope_core::formats::write::safetensors::{
    SafetensorsWriter, TensorSpec, index_json, plan_shards,
};
use shardscope_core::formats::write::torch_save::TorchSaveWriter;
use shardscope_core::index::{CheckpointIndex, ChunkEncoding, EntryKind, IndexEntry, PathSeg};
use shardscope_core::shape::{contiguous_strides, nbytes};

use crate::atomic;
use crate::input::Input;

/// Reads tensor values of an indexed checkpoint into caller buffers.
#[derive(Debug)]
pub struct Reader<'a> {
    source: &'a Input,
    index: &'a CheckpointIndex,
    files: BTreeMap<String, File>,
    scratch: Vec<u8>,
    /// The buffer of [`Reader::append_range_as`] for tensors that are not slabs.
    range_scratch: Vec<u8>,
}

impl<'a> Reader<'a> {
    pub fn new(source: &'a Input, index: &'a CheckpointIndex) -> Self {
        Self {
            source,
            index,
            files: BTreeMap::new(),
            scratch: Vec::new(),
            range_scratch: Vec::new(),
        }
    }

    pub fn index(&self) -> &'a CheckpointIndex {
        self.index
    }

    pub fn source(&self) -> &'a Input {
        self.source
    }

    fn pread(&mut self, name: &str, offset: u64, out: &mut [u8]) -> Result<()> {
        let root = match self.source {
            Input::Local(local) => local.root(),
            Input::Remote(remote) => return Ok(remote.read_into(name, offset, out)?),
        };
        let path = root.join(name);
        if !self.files.contains_key(name) {
            let file =
                File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            self.files.insert(name.to_owned(), file);
        }
        let file = &self.files[name];
        file.read_exact_at(out, offset).with_context(|| {
            format!(
                "cannot read {} bytes at offset {offset} of {}",
                out.len(),
                path.display()
            )
        })
    }

    /// Reads the whole tensor of `entry` into `buf[..nbytes]` (growing `buf` when needed), cast to
    /// `to` (`Tensor.to(to)`, see [`shardscope_core::cast`]; its own dtype: no cast) in place in
    /// `buf`, and returns `nbytes`: no second buffer, peak memory the larger of the two sizes. The
    /// index must have passed [`CheckpointIndex::check`] for this entry (chunks tile the tensor),
    /// which [`open`] ensures.
    pub fn tensor_as(&mut self, entry: &IndexEntry, to: DType, buf: &mut Vec<u8>) -> Result<usize> {
        let (dtype, shape) = tensor_meta(entry)?;
        let total = self.tensor_raw_into(entry, buf)?;
        if to == dtype {
            return Ok(total);
        }
        let numel = usize::try_from(shape.iter().product::<u64>())
            .with_context(|| format!("{}: tensor size overflows", entry.key))?;
        let need = numel
            .checked_mul(to.size_bytes().max(dtype.size_bytes()))
            .with_context(|| format!("{}: tensor size overflows", entry.key))?;
        if buf.len() < need {
            buf.resize(need, 0);
        }
        cast_in_place(buf, numel, dtype, to).with_context(|| entry.key.clone())
    }

    fn tensor_raw_into(&mut self, entry: &IndexEntry, buf: &mut Vec<u8>) -> Result<usize> {
        let (dtype, shape) = tensor_meta(entry)?;
        let item = dtype.size_bytes();
        let total = nbytes(dtype, shape)
            .and_then(|n| usize::try_from(n).ok())
            .with_context(|| format!("{}: tensor size overflows", entry.key))?;
        // Never allocate more than the chunks could fill (the files holding them, or for
        // compressed items what zstd can expand them to).
        let available = self.index.max_decoded_bytes(entry);
        if total as u64 > available {
            bail!(
                "{}: the tensor ({total} bytes) is larger than the chunks holding it can decode to ({available} bytes)",
                entry.key
            );
        }
        // Allocated before the first chunk is copied, and after decoding it when it is compressed
        // (a compressed chunk's size is only proven by decoding it).
        let ensure = |buf: &mut Vec<u8>| {
            if buf.len() < total {
                buf.resize(total, 0);
            }
        };
        let strides = contiguous_strides(shape);
        let row_bytes = shape.iter().skip(1).product::<u64>() * item as u64;
        let mut done: BTreeSet<(&[u64], &[u64])> = BTreeSet::new();
        for chunk in &entry.chunks {
            if !done.insert((&chunk.offsets, &chunk.sizes)) {
                continue; // a replica on another rank
            }
            if chunk.numel() == Some(0) {
                continue;
            }
            if chunk.offsets.len() != shape.len() || chunk.sizes.len() != shape.len() {
                bail!("{}: a chunk's rank differs from the tensor's", entry.key);
            }
            // A compressed item has no byte range to read in place.
            let location = match chunk.encoding {
                ChunkEncoding::ZstdTorchSaveItem => None,
                _ => Some(self.index.locate_chunk(self.source, entry, chunk)?),
            };
            let range = location
                .as_ref()
                .and_then(|l| Some((l, l.contiguous_range(&chunk.sizes, item as u64)?)));
            let slab = shape.is_empty() || chunk.sizes[1..] == shape[1..];
            match range {
                Some((location, (start, len))) if slab => {
                    ensure(buf);
                    let dst = chunk.offsets.first().map_or(0, |&o| o * row_bytes) as usize;
                    let end = dst.checked_add(len as usize).filter(|&e| e <= total);
                    let Some(end) = end else {
                        bail!("{}: a chunk reaches past the tensor", entry.key);
                    };
                    self.pread(&location.file, start, &mut buf[dst..end])?;
                }
                Some((location, (start, len))) => {
                    ensure(buf);
                    let mut scratch = std::mem::take(&mut self.scratch);
                    scratch.resize(len as usize, 0);
                    self.pread(&location.file, start, &mut scratch)?;
                    copy_box(
                        &mut buf[..total],
                        &strides,
                        &chunk.offsets,
                        &chunk.sizes,
                        &scratch,
                        item,
                    )
                    .with_context(|| entry.key.clone())?;
                    self.scratch = scratch;
                }
                None => {
                    // A strided view (never written by DCP, possible in torch.save files) or a
                    // compressed item, decoded (memory bounded by the chunk) before the tensor's
                    // buffer is allocated: its size is only proven by decoding it.
                    let data = self.index.read_chunk(self.source, entry, chunk)?;
                    ensure(buf);
                    copy_box(
                        &mut buf[..total],
                        &strides,
                        &chunk.offsets,
                        &chunk.sizes,
                        &data.bytes,
                        item,
                    )
                    .with_context(|| entry.key.clone())?;
                }
            }
        }
        ensure(buf);
        Ok(total)
    }

    /// Where the (uncast) bytes of `entry` lie when every chunk is a dim-0 slab stored
    /// contiguously (one chunk holding the whole tensor, FSDP's dim-0 shards), and no cast applies:
    /// `(byte offset in the tensor, length, file, byte offset in the file)` per distinct chunk,
    /// covering the tensor exactly. Any byte range of it can then be read in place.
    pub fn slab_pieces(&self, entry: &IndexEntry, to: DType) -> Option<Vec<SlabPiece>> {
        let (dtype, shape) = tensor_meta(entry).ok()?;
        if to != dtype {
            return None;
        }
        let item = dtype.size_bytes() as u64;
        let row_bytes = shape
            .iter()
            .skip(1)
            .try_fold(item, |n, &d| n.checked_mul(d))?;
        let total = nbytes(dtype, shape)?;
        let mut seen: BTreeSet<(&[u64], &[u64])> = BTreeSet::new();
        let mut pieces = Vec::new();
        let mut covered = 0u64;
        for chunk in &entry.chunks {
            if !seen.insert((&chunk.offsets, &chunk.sizes)) || chunk.numel() == Some(0) {
                continue;
            }
            if chunk.encoding == ChunkEncoding::ZstdTorchSaveItem
                || chunk.offsets.len() != shape.len()
                || chunk.sizes.len() != shape.len()
                || (!shape.is_empty() && chunk.sizes[1..] != shape[1..])
            {
                return None;
            }
            let location = self.index.locate_chunk(self.source, entry, chunk).ok()?;
            let (file_start, len) = location.contiguous_range(&chunk.sizes, item)?;
            let tensor_start = chunk
                .offsets
                .first()
                .map_or(Some(0), |&o| o.checked_mul(row_bytes))?;
            covered = covered.checked_add(len)?;
            pieces.push(SlabPiece {
                tensor_start,
                len,
                file: location.file,
                file_start,
            });
        }
        // The index check proved the chunks tile the tensor; count once more before trusting it.
        (covered == total).then_some(pieces)
    }

    /// Reads the contiguous byte range `range` of the full tensor of `entry`, cast to `to` (its own
    /// dtype: no cast), into `buf[..len]` and returns `len`. A tensor stored as contiguous dim-0
    /// slabs is read in place ([`Self::slab_pieces`]); any other is assembled whole into `buf` and
    /// the range moved to its front (no second buffer).
    pub fn range_as(
        &mut self,
        entry: &IndexEntry,
        to: DType,
        range: std::ops::Range<u64>,
        buf: &mut Vec<u8>,
    ) -> Result<usize> {
        let len = range_len(entry, &range)?;
        if len == 0 {
            return Ok(0);
        }
        if let Some(pieces) = self.slab_pieces(entry, to) {
            if buf.len() < len {
                buf.resize(len, 0);
            }
            self.read_slab_range(entry, &pieces, &range, &mut buf[..len])?;
            return Ok(len);
        }
        let n = self.tensor_as(entry, to, buf)?;
        let start = usize::try_from(range.start).ok();
        let Some((start, end)) = start.and_then(|s| Some((s, s.checked_add(len)?))) else {
            bail!("{}: a byte range past the tensor", entry.key);
        };
        if end > n {
            bail!(
                "{}: the byte range {range:?} reaches past the tensor ({n} bytes)",
                entry.key
            );
        }
        buf.copy_within(start..end, 0);
        Ok(len)
    }
}

impl Reader<'_> {
    /// Reads `range` of a tensor stored as `pieces` into `dst` (exactly `range`'s length).
    fn read_slab_range(
        &mut self,
        entry: &IndexEntry,
        pieces: &[SlabPiece],
        range: &std::ops::Range<u64>,
        dst: &mut [u8],
    ) -> Result<()> {
        let mut filled = 0u64;
        for piece in pieces {
            let start = range.start.max(piece.tensor_start);
            let end = range.end.min(piece.tensor_start.saturating_add(piece.len));
            if start >= end {
                continue;
            }
            let at = piece
                .file_start
                .checked_add(start - piece.tensor_start)
                .with_context(|| format!("{}: byte offset overflows", entry.key))?;
            let part = (start - range.start) as usize..(end - range.start) as usize;
            self.pread(&piece.file, at, &mut dst[part])?;
            filled += end - start;
        }
        if filled != dst.len() as u64 {
            bail!(
                "{}: the byte range {range:?} reaches past the tensor",
                entry.key
            );
        }
        Ok(())
    }

    /// As [`Self::range_as`], appending the bytes to `out`: a tensor stored as contiguous dim-0
    /// slabs is read straight into `out`, with no intermediate copy.
    pub fn append_range_as(
        &mut self,
        entry: &IndexEntry,
        to: DType,
        range: std::ops::Range<u64>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let len = range_len(entry, &range)?;
        if len == 0 {
            return Ok(());
        }
        let old = out.len();
        let new_len = old
            .checked_add(len)
            .with_context(|| format!("{}: output size overflows", entry.key))?;
        if let Some(pieces) = self.slab_pieces(entry, to) {
            out.resize(new_len, 0);
            return self.read_slab_range(entry, &pieces, &range, &mut out[old..]);
        }
        let mut tmp = std::mem::take(&mut self.range_scratch);
        let read = self.range_as(entry, to, range, &mut tmp);
        if let Ok(n) = &read {
            out.extend_from_slice(&tmp[..*n]);
        }
        self.range_scratch = tmp;
        read.map(|_| ())
    }
}

/// The length of the byte range `range` of `entry`'s tensor, checked (`start <= end`, and it fits
/// in memory).
fn range_len(entry: &IndexEntry, range: &std::ops::Range<u64>) -> Result<usize> {
    range
        .end
        .checked_sub(range.start)
        .and_then(|n| usize::try_from(n).ok())
        .with_context(|| format!("{}: a bad byte range {range:?}", entry.key))
}

/// A contiguous piece of a tensor's bytes in one file (see [`Reader::slab_pieces`]).
#[derive(Debug, Clone)]
pub struct SlabPiece {
    pub tensor_start: u64,
    pub len: u64,
    pub file: String,
    pub file_start: u64,
}

/// Tensors that can be read in place by byte range are read in pieces of at most this many bytes,
/// so reads of one large tensor overlap its writing and memory stays far below the tensor's size.
pub const PIECE_BYTES: u64 = 16 << 20;

/// Appends the reads of `entry` (cast to `to`, `n` bytes): pieces of at most [`PIECE_BYTES`] when
/// it can be read in place by byte range, else the whole tensor in one.
fn push_piece_jobs<'a>(
    reader: &Reader<'_>,
    entry: &'a IndexEntry,
    to: DType,
    n: u64,
    jobs: &mut Vec<exec::Job<'a>>,
) {
    if n > PIECE_BYTES && reader.slab_pieces(entry, to).is_some() {
        let mut start = 0;
        while start < n {
            let end = start.saturating_add(PIECE_BYTES).min(n);
            jobs.push(exec::Job {
                entry,
                to,
                range: Some(start..end),
            });
            start = end;
        }
    } else {
        jobs.push(exec::Job {
            entry,
            to,
            range: None,
        });
    }
}

/// The buffer [`Reader::tensor_as`] needs for `entry` cast to `to`: its elements at the larger of
/// the two dtype sizes (the cast happens in place).
pub fn read_cost_bytes(entry: &IndexEntry, to: DType) -> Result<u64> {
    let (dtype, shape) = tensor_meta(entry)?;
    shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .and_then(|numel| numel.checked_mul(to.size_bytes().max(dtype.size_bytes()) as u64))
        .with_context(|| format!("{}: tensor size overflows", entry.key))
}

fn tensor_meta(entry: &IndexEntry) -> Result<(DType, &[u64])> {
    let dtype = entry
        .dtype
        .with_context(|| format!("{}: not a tensor", entry.key))?;
    let shape = entry.shape.as_deref().with_context(|| {
        format!(
            "{}: rank-local pieces with no global shape (FSDP1 LOCAL flat parameters or raw optimizer state)",
            entry.key
        )
    })?;
    Ok((dtype, shape))
}

/// Copies a contiguous box of `sizes` (`src`) into `out` (row-major with `strides`) at `offsets`.
fn copy_box(
    out: &mut [u8],
    strides: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    src: &[u8],
    item: usize,
) -> Result<()> {
    let numel: u64 = sizes.iter().product();
    if numel == 0 {
        return Ok(());
    }
    if src.len() as u64 != numel * item as u64 {
        bail!(
            "chunk data has {} bytes, its sizes need {}",
            src.len(),
            numel * item as u64
        );
    }
    let Some((&last, outer)) = sizes.split_last() else {
        out.get_mut(..item)
            .context("chunk outside the tensor")?
            .copy_from_slice(&src[..item]);
        return Ok(());
    };
    let row = last as usize * item;
    let rows = (numel / last) as usize;
    let mut index = vec![0u64; outer.len()];
    for r in 0..rows {
        let mut pos = offsets[outer.len()];
        for d in 0..outer.len() {
            pos += (offsets[d] + index[d]) * strides[d];
        }
        let dst = pos as usize * item;
        out.get_mut(dst..dst + row)
            .context("chunk outside the tensor")?
            .copy_from_slice(&src[r * row..(r + 1) * row]);
        for d in (0..outer.len()).rev() {
            index[d] += 1;
            if index[d] < sizes[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(())
}

/// Fails unless the chunks of `index` (read from `src`) tile every tensor.
pub fn ensure_consistent(src: &Path, index: &CheckpointIndex) -> Result<()> {
    let problems = index.check();
    if let Some(first) = problems.first() {
        bail!(
            "{}: the checkpoint is inconsistent ({} problems; first: {first})\nhint: `shardscope inspect {}` lists them",
            src.display(),
            problems.len(),
            src.display()
        );
    }
    Ok(())
}

/// The entries a conversion takes: tensors and non-tensor values, with their output keys.
#[derive(Debug)]
pub struct Selection<'a> {
    pub tensors: Vec<(String, &'a IndexEntry)>,
    pub values: Vec<(String, &'a IndexEntry)>,
    /// `--dtype`: floating tensors (float16, bfloat16, float32, float64) are written as this.
    pub cast: Option<DType>,
}

impl Selection<'_> {
    /// The dtype and shape `e` is written with (after `--dtype`).
    pub fn out_meta<'e>(&self, e: &'e IndexEntry) -> Result<(DType, &'e [u64])> {
        let (dtype, shape) = tensor_meta(e)?;
        Ok((cast_target(dtype, self.cast), shape))
    }

    /// The bytes `e` takes in the output.
    pub fn out_nbytes(&self, e: &IndexEntry) -> Option<u64> {
        let (dtype, shape) = self.out_meta(e).ok()?;
        nbytes(dtype, shape)
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter_map(|(_, e)| self.out_nbytes(e))
            .fold(0, u64::saturating_add)
    }
}

/// Keeps the entries under `prefix` (flattened key `prefix.<rest>`, output key `<rest>`), or all.
pub fn select<'a>(index: &'a CheckpointIndex, prefix: Option<&str>) -> Result<Selection<'a>> {
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    for e in &index.entries {
        let key = match prefix {
            Some(p) => match e.key.strip_prefix(p).and_then(|r| r.strip_prefix('.')) {
                Some(rest) if !rest.is_empty() => rest.to_owned(),
                _ => continue,
            },
            None => e.key.clone(),
        };
        if e.kind == EntryKind::Tensor {
            tensor_meta(e)?;
            tensors.push((key, e));
        } else {
            values.push((key, e));
        }
    }
    if let Some(p) = prefix
        && tensors.is_empty()
        && values.is_empty()
    {
        let tops: BTreeSet<String> = index
            .entries
            .iter()
            .filter_map(|e| e.path.first().map(ToString::to_string))
            .collect();
        bail!(
            "--select {p}: no key starts with `{p}.`\nhint: top-level keys are: {}",
            tops.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    Ok(Selection {
        tensors,
        values,
        cast: None,
    })
}

/// Removes the aliases of tied weights from the selection's tensors (see
/// [`shardscope_core::index::ties`]: shared storage in `torch.save`, equal bytes elsewhere) and
/// returns `(kept, dropped)` output names. The name kept is the one that comes first in the
/// checkpoint.
pub fn drop_tied(
    source: &Input,
    index: &CheckpointIndex,
    sel: &mut Selection<'_>,
) -> Result<Vec<(String, String)>> {
    let position: BTreeMap<*const IndexEntry, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (std::ptr::from_ref(e), i))
        .collect();
    let out_name: BTreeMap<usize, String> = sel
        .tensors
        .iter()
        .filter_map(|(name, e)| Some((*position.get(&std::ptr::from_ref(*e))?, name.clone())))
        .collect();
    // The name kept is the first in stored (registration) order.
    let order = shardscope_core::index::from_index::stored_key_order(source, index)
        .context("cannot read the checkpoint's key order")?;
    let by_key: BTreeMap<&str, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    let mut candidates: Vec<usize> = order
        .keys
        .iter()
        .filter_map(|k| by_key.get(k.as_str()).copied())
        .filter(|i| out_name.contains_key(i))
        .collect();
    let listed: BTreeSet<usize> = candidates.iter().copied().collect();
    candidates.extend(out_name.keys().filter(|i| !listed.contains(i)));
    let groups = shardscope_core::index::ties::find_ties(index, source, &candidates)
        .context("cannot look for tied weights")?;
    let mut dropped = Vec::new();
    let mut drop_set = BTreeSet::new();
    for g in &groups {
        for a in &g.aliases {
            dropped.push((out_name[&g.keep].clone(), out_name[a].clone()));
            drop_set.insert(out_name[a].clone());
        }
    }
    sel.tensors.retain(|(name, _)| !drop_set.contains(name));
    Ok(dropped)
}

/// Something that hears how many tensor bytes were written.
pub trait Progress {
    fn advance(&self, bytes: u64);
}

/// What a conversion wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Written {
    /// The output paths (a file, or a directory and its files); with `--part`, what this process
    /// wrote.
    pub outputs: Vec<String>,
    pub tensors: usize,
    pub values: usize,
    pub tensor_bytes: u64,
    /// The largest tensor, which bounds the memory the conversion needs.
    pub largest_tensor_bytes: u64,
    /// The limit on tensor buffers alive at once that the executor ran under.
    pub memory_limit_bytes: u64,
    /// `--part`: whether this process wrote the index (the output is complete). Always true
    /// without `--part`.
    pub complete: bool,
}

/// How a conversion runs: the executor's threads and memory, and which part of a multi-process
/// conversion this process writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteOptions {
    pub exec: exec::ExecOptions,
    /// `--part R/N`: write the files `i % N == R` of a multi-file output (see [`part`]).
    pub part: Option<part::Part>,
    /// `--finalize`: write no data, only the index of a multi-part output whose parts are done.
    pub finalize_only: bool,
}

/// The names, sizes and modification times of the source's files: part of a `--part` plan's
/// fingerprint, so parts of runs over different input bytes never mix.
fn source_identity(source: &Input) -> String {
    use shardscope_core::source::Source;
    use std::fmt::Write as _;
    let mut text = String::new();
    for name in source.names() {
        let size = source.size(&name).ok();
        // Remote objects: names and sizes (their listings carry no modification time here).
        let modified = match source {
            Input::Local(local) => std::fs::metadata(local.root().join(&name))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos()),
            Input::Remote(_) => None,
        };
        let _ = writeln!(text, "{name:?} {size:?} {modified:?}");
    }
    text
}

/// Checks the memory limit for every job of the conversion at once (a too-small limit fails
/// before anything is written) and returns the options with the limit fixed.
fn fix_limit(
    reader: &Reader<'_>,
    jobs: &[exec::Job<'_>],
    options: &exec::ExecOptions,
) -> Result<(exec::ExecOptions, u64)> {
    let stats = exec::memory_limit(reader.source(), reader.index(), jobs, options)?;
    Ok((
        exec::ExecOptions {
            threads: options.threads,
            memory_limit_bytes: Some(stats.memory_limit_bytes),
        },
        stats.memory_limit_bytes,
    ))
}

/// Writes a multi-file output: all of it atomically (a temporary directory renamed into place),
/// or with `--part` this process's files and, when all parts are done, the index (see [`part`]).
fn write_multi(
    plan: &part::Plan<'_>,
    opts: &WriteOptions,
    write_one: &mut dyn FnMut(usize, &mut dyn Write) -> Result<serde_json::Value>,
    finish: &part::FinishFn<'_>,
) -> Result<part::Outcome> {
    if opts.finalize_only {
        let p = opts
            .part
            .context("--finalize needs --part R/N or --part auto (N: the number of parts)")?;
        let written = part::finalize(plan, p.count, true, finish)?
            .context("another process holds the finalize lock")?;
        return Ok(part::Outcome {
            written,
            finalized: true,
        });
    }
    if let Some(p) = opts.part {
        return part::write_part(plan, p, write_one, finish);
    }
    atomic::write_dir(plan.dest, |tmp| {
        let mut records = Vec::with_capacity(plan.files.len());
        for (i, name) in plan.files.iter().enumerate() {
            let path = tmp.join(name);
            let f =
                File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
            let mut out = BufWriter::new(f);
            records.push(write_one(i, &mut out)?);
            out.flush()
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        for (name, bytes) in plan.final_names.iter().zip(finish(&records)?) {
            let path = tmp.join(name);
            std::fs::write(&path, bytes)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    })?;
    Ok(part::Outcome {
        written: plan
            .files
            .iter()
            .cloned()
            .chain(plan.final_names.iter().map(|s| (*s).to_owned()))
            .collect(),
        finalized: true,
    })
}

fn largest(sel: &Selection<'_>) -> u64 {
    sel.tensors
        .iter()
        .filter_map(|(_, e)| sel.out_nbytes(e))
        .max()
        .unwrap_or(0)
}

// ----- safetensors ------------------------------------------------------------------------------

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
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<Written> {
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
    let piece_reader = Reader::new(reader.source(), reader.index());
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
                push_piece_jobs(&piece_reader, entry, to, n, &mut jobs);
                job_tensor.resize(jobs.len(), t);
                debug_assert!(jobs.len() > before);
            }
            Ok((order, job_tensor, jobs))
        };
    let (_, _, all_jobs) = jobs_of(&specs)?;
    let (exec_opts, limit) = fix_limit(reader, &all_jobs, &opts.exec)?;
    let source = reader.source();
    let index = reader.index();
    let write_one = |out: &mut dyn Write, file_specs: &[TensorSpec]| -> Result<()> {
        let (order, job_tensor, jobs) = jobs_of(file_specs)?;
        let mut writer = SafetensorsWriter::new(out, file_specs, Some(&metadata))?;
        exec::run(source, index, &jobs, &exec_opts, |i, bytes| {
            writer.write_tensor_part(&order[job_tensor[i]], bytes)?;
            progress.advance(bytes.len() as u64);
            Ok(())
        })?;
        writer.finish()?;
        Ok(())
    };
    let mut outputs = vec![dest.display().to_string()];
    let mut complete = true;
    match max_shard_bytes {
        None => atomic::write_file(dest, |out| write_one(out, &specs))?,
        Some(limit) => {
            let plan = plan_shards(&specs, Some(limit), "model")?;
            let names: Vec<String> = plan.files.iter().map(|f| f.file_name.clone()).collect();
            let final_names: &[&str] = if plan.needs_index() {
                &["model.safetensors.index.json"]
            } else {
                &[]
            };
            let fingerprint = part::fingerprint(&format!(
                "safetensors shards\n{specs:?}\n{metadata:?}\n{plan:?}\n{}",
                source_identity(source)
            ));
            let multi = part::Plan {
                dest,
                files: &names,
                final_names,
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
                    write_one(out, &file_specs)?;
                    Ok(serde_json::Value::Null)
                },
                &|_| {
                    Ok(if plan.needs_index() {
                        vec![index_json(&plan, &specs).into_bytes()]
                    } else {
                        Vec::new()
                    })
                },
            )?;
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
    })
}

// ----- torch.save -------------------------------------------------------------------------------

/// A node of the nested state dict rebuilt from entry paths.
enum Node {
    Map(Vec<(PathSeg, Node)>),
    Leaf(usize),
}

fn insert(node: &mut Node, path: &[PathSeg], leaf: usize, key: &str) -> Result<()> {
    let Node::Map(children) = node else {
        bail!("{key}: its path goes through a value that is not a container");
    };
    let (first, rest) = path.split_first().context("empty path")?;
    let pos = children.iter().position(|(k, _)| k == first);
    if rest.is_empty() {
        if pos.is_some() {
            bail!("{key}: two entries have this path");
        }
        children.push((first.clone(), Node::Leaf(leaf)));
        return Ok(());
    }
    let i = if let Some(i) = pos {
        i
    } else {
        children.push((first.clone(), Node::Map(Vec::new())));
        children.len() - 1
    };
    insert(&mut children[i].1, rest, leaf, key)
}

/// A JSON value (a scalar of a `torch.save` file, decoded by the index) as a Python value.
fn py_from_json(v: &serde_json::Value) -> PyValue {
    use serde_json::Value as J;
    match v {
        J::Null => PyValue::None,
        J::Bool(b) => PyValue::Bool(*b),
        J::Number(n) => n.as_i64().map_or_else(
            || PyValue::Float(n.as_f64().unwrap_or(f64::NAN)),
            PyValue::Int,
        ),
        J::String(s) => PyValue::Str(s.clone()),
        J::Array(items) => PyValue::List(items.iter().map(py_from_json).collect()),
        J::Object(items) => PyValue::Dict(
            items
                .iter()
                .map(|(k, v)| (PyValue::Str(k.clone()), py_from_json(v)))
                .collect(),
        ),
    }
}

/// The Python value of a non-tensor entry: the exact object for DCP bytes items and for scalars of
/// `torch.save` files (tuples kept); the decoded JSON for values the index rewrote or that cannot be
/// pickled for `weights_only` loads.
fn py_value_of(reader: &Reader<'_>, e: &IndexEntry) -> Result<PyValue> {
    if e.kind == EntryKind::Bytes {
        let read = reader.index().read_bytes_object(reader.source(), e)?;
        return PyValue::from_read_value(&read).with_context(|| e.key.clone());
    }
    if let Some(object) = &e.object
        && let Ok(v) = PyValue::from_read_value(object)
    {
        return Ok(v);
    }
    Ok(py_from_json(
        e.value.as_ref().unwrap_or(&serde_json::Value::Null),
    ))
}

/// The storage table of a `torch.save` output: `(spec, leaf)` in table order, and which table
/// entry holds the bytes of a given chunk list (tied names share one).
#[derive(Default)]
struct Storages {
    list: Vec<(StorageSpec, usize)>,
    by_chunks: std::collections::HashMap<String, usize>,
}

fn to_py(
    node: &Node,
    leaves: &[(String, &IndexEntry)],
    reader: &Reader<'_>,
    sel: &Selection<'_>,
    storages: &mut Storages,
) -> Result<PyValue> {
    match node {
        Node::Leaf(i) => {
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
                Ok(PyValue::Tensor(TensorPickle::contiguous(
                    storage, dtype, shape,
                )))
            } else {
                py_value_of(reader, e)
            }
        }
        Node::Map(children) => {
            let is_list = children
                .first()
                .is_some_and(|(k, _)| matches!(k, PathSeg::Index(_)));
            if is_list {
                // `dcp_to_torch_save` grows lists to the largest index, filling gaps with None.
                let mut items: Vec<Option<&Node>> = Vec::new();
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
                                PathSeg::Index(i) => PyValue::Int(*i),
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
    let mut root = Node::Map(Vec::new());
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
        insert(&mut root, &path, i, &e.key)?;
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
    for (spec, leaf) in &storages.list {
        let n = spec
            .numel
            .checked_mul(spec.dtype.size_bytes() as u64)
            .with_context(|| format!("{}: tensor size overflows", leaves[*leaf].1.key))?;
        push_piece_jobs(reader, leaves[*leaf].1, spec.dtype, n, &mut jobs);
    }
    let (exec_opts, limit) = fix_limit(reader, &jobs, &opts.exec)?;
    atomic::write_file(dest, |out| {
        let table = storages.list.iter().map(|(s, _)| *s).collect();
        let mut writer = TorchSaveWriter::new(out, &archive, &value, table)?;
        exec::run(
            reader.source(),
            reader.index(),
            &jobs,
            &exec_opts,
            |_, bytes| {
                writer.write_storage_part(bytes)?;
                progress.advance(bytes.len() as u64);
                Ok(())
            },
        )?;
        writer.finish()?;
        Ok(())
    })?;
    Ok(Written {
        outputs: vec![dest.display().to_string()],
        tensors: sel.tensors.len(),
        values: sel.values.len(),
        tensor_bytes: sel.tensor_bytes(),
        largest_tensor_bytes: largest(sel),
        memory_limit_bytes: limit,
        complete: true,
    })
}

fn join(path: &[PathSeg]) -> String {
    path.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

// ----- DCP --------------------------------------------------------------------------------------

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
/// `{"model": model.state_dict()}` expects).
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
    let all_jobs: Vec<exec::Job<'_>> = rank_jobs.iter().flatten().cloned().collect();
    let (exec_opts, limit) = fix_limit(reader, &all_jobs, &opts.exec)?;
    let names: Vec<String> = (0..world_size).map(DcpPlan::file_name).collect();
    let fingerprint = part::fingerprint(&format!(
        "dcp\n{plan:?}\n{ranges:?}\n{}",
        source_identity(reader.source())
    ));
    let multi = part::Plan {
        dest,
        files: &names,
        final_names: &[".metadata"],
        fingerprint: &fingerprint,
    };
    let source = reader.source();
    let index = reader.index();
    let outcome = write_multi(
        &multi,
        opts,
        &mut |rank, out| {
            let mut writer = DcpFileWriter::new(&plan, rank, out)?;
            exec::run(source, index, &rank_jobs[rank], &exec_opts, |_, bytes| {
                writer.write_chunk(bytes)?;
                progress.advance(bytes.len() as u64);
                Ok(())
            })?;
            let (_, record) = writer.finish()?;
            Ok(record_to_json(&record))
        },
        &|records| {
            let records = records
                .iter()
                .map(record_from_json)
                .collect::<Result<Vec<_>>>()?;
            Ok(vec![metadata_pickle(
                &plan,
                &records,
                &DcpMetadataOptions::default(),
            )?])
        },
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
