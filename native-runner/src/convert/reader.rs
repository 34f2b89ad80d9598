//! [`Reader`]: tensor values of an indexed checkpoint read into caller buffers: positioned reads
//! (`pread`) straight into the destination for dim-0 slabs, a scratch buffer and a box copy for
//! other chunks, byte ranges of slab-stored tensors, and casts in place.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use anyhow::{Context, Result, bail};
use shardscope_core::DType;
use shardscope_core::cast::cast_in_place;
use shardscope_core::index::{CheckpointIndex, ChunkEncoding, IndexEntry};
use shardscope_core::shape::{contiguous_strides, nbytes, numel};

use crate::input::Input;

/// Reads tensor values of an indexed checkpoint into caller buffers.
#[derive(Debug)]
pub struct Reader<'a> {
    source: &'a Input,
    index: &'a CheckpointIndex,
    scratch: Vec<u8>,
    /// The buffer of [`Reader::append_range_as`] for tensors that are not slabs.
    range_scratch: Vec<u8>,
    /// [`Reader::slab_pieces`] by tensor key and dtype: locating a chunk parses its item's zip
    /// ends, which for a remote source means a buffer as long as the item (every piece job of a
    /// tensor asks again).
    slabs: RefCell<SlabMemo>,
    /// Output tensors made from others by a name mapping (`convert --to hf`), by key: read by
    /// evaluating their recipe over the stored tensors.
    derived: Option<&'a super::mapped::Derivations>,
}

/// [`Reader::slab_pieces`] by tensor key and dtype.
type SlabMemo = HashMap<(String, DType), Option<Vec<SlabPiece>>>;

impl<'a> Reader<'a> {
    pub fn new(source: &'a Input, index: &'a CheckpointIndex) -> Self {
        Self {
            source,
            index,
            scratch: Vec::new(),
            range_scratch: Vec::new(),
            slabs: RefCell::new(HashMap::new()),
            derived: None,
        }
    }

    /// A reader of an index whose entries include tensors `derived` from stored ones.
    pub fn with_derived(
        source: &'a Input,
        index: &'a CheckpointIndex,
        derived: &'a super::mapped::Derivations,
    ) -> Self {
        Self {
            derived: Some(derived),
            ..Self::new(source, index)
        }
    }

    /// The recipe of `entry` when it is made from other tensors.
    fn derived_of(&self, entry: &IndexEntry) -> Option<&'a super::mapped::Derived> {
        self.derived.and_then(|d| d.get(&entry.key))
    }

    /// The buffer bytes a read of `entry` as `to` needs: [`read_cost_bytes`], or for a derived
    /// tensor what its recipe holds at once.
    pub fn cost_bytes(&self, entry: &IndexEntry, to: DType) -> Result<u64> {
        match self.derived_of(entry) {
            Some(d) => Ok(read_cost_bytes(entry, to)?.saturating_add(d.working_bytes)),
            None => read_cost_bytes(entry, to),
        }
    }

    /// A new reader of the same checkpoint that starts with what this one found of where
    /// tensors lie (for another thread).
    pub fn fork(&self) -> Reader<'a> {
        let mut reader = Reader::new(self.source, self.index);
        reader.derived = self.derived;
        reader.slabs.borrow_mut().clone_from(&self.slabs.borrow());
        reader
    }

    pub fn index(&self) -> &'a CheckpointIndex {
        self.index
    }

    pub fn source(&self) -> &'a Input {
        self.source
    }

    fn pread(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<()> {
        match self.source {
            Input::Local(local) => Ok(local.read_into(name, offset, out)?),
            Input::Remote(remote) => Ok(remote.read_into(name, offset, out)?),
        }
    }

    /// Reads the whole tensor of `entry` into `buf[..nbytes]` (growing `buf` when needed), cast to
    /// `to` (`Tensor.to(to)`, see [`shardscope_core::cast`]; its own dtype: no cast) in place in
    /// `buf`, and returns `nbytes`: no second buffer, peak memory the larger of the two sizes. The
    /// index must have passed [`CheckpointIndex::check`] for this entry (chunks tile the tensor),
    /// which [`open`] ensures.
    pub fn tensor_as(&mut self, entry: &IndexEntry, to: DType, buf: &mut Vec<u8>) -> Result<usize> {
        let (dtype, shape) = tensor_meta(entry)?;
        let total = self.tensor_raw_into(entry, Dest::Grow(buf))?;
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

    /// [`Self::tensor_as`] into `out`, which the caller allocated (at least
    /// [`read_cost_bytes`] long: the cast happens in place): the tensor's bytes are read straight
    /// into it. Returns the length of the (cast) tensor at its start.
    pub fn tensor_as_into(
        &mut self,
        entry: &IndexEntry,
        to: DType,
        out: &mut [u8],
    ) -> Result<usize> {
        let (dtype, shape) = tensor_meta(entry)?;
        let total = self.tensor_raw_into(entry, Dest::Fixed(out))?;
        if to == dtype {
            return Ok(total);
        }
        let numel = usize::try_from(shape.iter().product::<u64>())
            .with_context(|| format!("{}: tensor size overflows", entry.key))?;
        cast_in_place(out, numel, dtype, to).with_context(|| entry.key.clone())
    }

    /// Rows `rows` of dim 0 of the tensor of `entry`, cast to `to`, into `out` (at least the
    /// rows' elements at the larger of the two dtype sizes). A tensor stored as dim-0 slabs is
    /// read in place, only the rows' bytes; any other is assembled whole first (a scratch buffer
    /// as large as the tensor). Returns the length of the (cast) rows at the start of `out`.
    pub fn rows_as_into(
        &mut self,
        entry: &IndexEntry,
        to: DType,
        rows: std::ops::Range<u64>,
        out: &mut [u8],
    ) -> Result<usize> {
        let (dtype, shape) = tensor_meta(entry)?;
        let range = row_byte_range(entry, dtype, shape, &rows)?;
        let len = range_len(entry, &range)?;
        let dst = out.get_mut(..len).with_context(|| {
            format!("{}: the output buffer is smaller than the rows", entry.key)
        })?;
        if let Some(pieces) = self.slab_pieces(entry, dtype) {
            self.read_slab_range(entry, &pieces, &range, dst)?;
        } else {
            let mut whole = std::mem::take(&mut self.range_scratch);
            let read = self.tensor_raw_into(entry, Dest::Grow(&mut whole));
            if read.is_ok() {
                dst.copy_from_slice(&whole[range.start as usize..range.end as usize]);
            }
            whole.clear();
            self.range_scratch = whole;
            read?;
        }
        if to == dtype {
            return Ok(len);
        }
        let numel = len / dtype.size_bytes();
        cast_in_place(out, numel, dtype, to).with_context(|| entry.key.clone())
    }

    fn tensor_raw_into(&mut self, entry: &IndexEntry, mut dest: Dest<'_>) -> Result<usize> {
        if let Some(derived) = self.derived_of(entry) {
            return self.derived_into(entry, derived, dest);
        }
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
                    let buf = dest.get(&entry.key, total)?;
                    let dst = chunk.offsets.first().map_or(0, |&o| o * row_bytes) as usize;
                    let end = dst.checked_add(len as usize).filter(|&e| e <= total);
                    let Some(end) = end else {
                        bail!("{}: a chunk reaches past the tensor", entry.key);
                    };
                    self.pread(&location.file, start, &mut buf[dst..end])?;
                }
                Some((location, (start, len))) => {
                    let buf = dest.get(&entry.key, total)?;
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
                    let buf = dest.get(&entry.key, total)?;
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
        dest.get(&entry.key, total)?;
        Ok(total)
    }

    /// Where the (uncast) bytes of `entry` lie when every chunk is a dim-0 slab stored
    /// contiguously (one chunk holding the whole tensor, FSDP's dim-0 shards), and no cast applies:
    /// `(byte offset in the tensor, length, file, byte offset in the file)` per distinct chunk,
    /// covering the tensor exactly. Any byte range of it can then be read in place.
    pub fn slab_pieces(&self, entry: &IndexEntry, to: DType) -> Option<Vec<SlabPiece>> {
        if self.derived_of(entry).is_some() {
            return None;
        }
        let key = (entry.key.clone(), to);
        if let Some(known) = self.slabs.borrow().get(&key) {
            return known.clone();
        }
        let pieces = self.locate_slab_pieces(entry, to);
        self.slabs.borrow_mut().insert(key, pieces.clone());
        pieces
    }

    /// [`Self::slab_pieces`], not remembered.
    fn locate_slab_pieces(&self, entry: &IndexEntry, to: DType) -> Option<Vec<SlabPiece>> {
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
            pieces.push(SlabPiece {
                tensor_start,
                len,
                file: location.file,
                file_start,
            });
        }
        // The index check proved the chunks tile the tensor; check once more before trusting it:
        // the pieces, in tensor order, follow each other from 0 to the tensor's end with no gap
        // or overlap (a range read from them writes every byte it returns, so buffers are not
        // zeroed first).
        let mut spans: Vec<(u64, u64)> = pieces.iter().map(|p| (p.tensor_start, p.len)).collect();
        spans.sort_unstable();
        let mut end = 0u64;
        for (start, len) in spans {
            if start != end {
                return None;
            }
            end = start.checked_add(len)?;
        }
        (end == total).then_some(pieces)
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
            // Bytes already in `buf` are overwritten, not zeroed first: `read_slab_range` fails
            // unless it fills all `len`.
            if buf.len() < len {
                buf.resize(len, 0);
            }
            self.read_slab_range(entry, &pieces, &range, &mut buf[..len])?;
            return Ok(len);
        }
        buf.clear();
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

/// Where [`Reader::tensor_raw_into`] writes: a buffer it may grow, or one the caller allocated.
impl Reader<'_> {
    /// Evaluates a derived tensor's recipe: its reads (whole stored tensors, or dim-0 rows of
    /// one: an expert of a grouped tensor) in the stored dtype, then the recipe's operations.
    fn derived_into(
        &mut self,
        entry: &IndexEntry,
        derived: &super::mapped::Derived,
        mut dest: Dest<'_>,
    ) -> Result<usize> {
        use shardscope_core::transform::mapping::{Dense, MappingError, evaluate};
        let (dtype, shape) = tensor_meta(entry)?;
        let elem = dtype.size_bytes();
        let mut failure: Option<anyhow::Error> = None;
        let result = evaluate(&derived.recipe, elem, |read| {
            let stored = derived.sources.get(&read.source).ok_or_else(|| {
                MappingError::Apply(format!("{}: no stored tensor `{}`", entry.key, read.source))
            })?;
            let (sdtype, sshape) =
                tensor_meta(stored).map_err(|e| MappingError::Apply(e.to_string()))?;
            if sdtype != dtype {
                return Err(MappingError::Apply(format!(
                    "{}: `{}` is {sdtype}, not {dtype}",
                    entry.key, read.source
                )));
            }
            let got = match &read.rows {
                None => {
                    let mut buf = Vec::new();
                    self.tensor_as(stored, dtype, &mut buf).map(|n| {
                        buf.truncate(n);
                        (buf, sshape.to_vec())
                    })
                }
                Some(rows) => {
                    let row: u64 = sshape.iter().skip(1).product();
                    let n = (rows.end.saturating_sub(rows.start))
                        .saturating_mul(row)
                        .saturating_mul(elem as u64);
                    let mut buf = vec![0u8; n as usize];
                    self.rows_as_into(stored, dtype, rows.clone(), &mut buf)
                        .map(|n| {
                            buf.truncate(n);
                            let mut s = sshape.to_vec();
                            if let Some(d0) = s.first_mut() {
                                *d0 = rows.end.saturating_sub(rows.start);
                            }
                            (buf, s)
                        })
                }
            };
            match got {
                Ok((bytes, s)) => Dense::new(bytes, s, elem),
                Err(e) => {
                    let text = format!("{e:#}");
                    failure = Some(e);
                    Err(MappingError::Apply(text))
                }
            }
        });
        let t = match (result, failure) {
            (Ok(t), _) => t,
            (Err(_), Some(e)) => return Err(e),
            (Err(e), None) => bail!("{}: {e}", entry.key),
        };
        if t.shape != shape {
            bail!(
                "{}: the mapping made shape {:?}, not {shape:?}",
                entry.key,
                t.shape
            );
        }
        let buf = dest.get(&entry.key, t.bytes.len())?;
        buf.copy_from_slice(&t.bytes);
        Ok(t.bytes.len())
    }
}

enum Dest<'b> {
    Grow(&'b mut Vec<u8>),
    Fixed(&'b mut [u8]),
}

impl Dest<'_> {
    /// The first `total` bytes of the destination (a growable buffer is grown to them).
    fn get(&mut self, key: &str, total: usize) -> Result<&mut [u8]> {
        match self {
            Dest::Grow(buf) => {
                if buf.len() < total {
                    buf.resize(total, 0);
                }
                Ok(&mut buf[..total])
            }
            Dest::Fixed(buf) => buf.get_mut(..total).with_context(|| {
                format!("{key}: the output buffer is smaller than the tensor ({total} bytes)")
            }),
        }
    }
}

/// The bytes of rows `rows` (dim 0) of a contiguous tensor of `dtype` and `shape`, checked to lie
/// inside it.
fn row_byte_range(
    entry: &IndexEntry,
    dtype: DType,
    shape: &[u64],
    rows: &std::ops::Range<u64>,
) -> Result<std::ops::Range<u64>> {
    let Some((&dim0, rest)) = shape.split_first() else {
        bail!("{}: a 0-dim tensor has no rows", entry.key);
    };
    if rows.start > rows.end || rows.end > dim0 {
        bail!(
            "{}: rows {}..{} are not inside its {dim0} rows",
            entry.key,
            rows.start,
            rows.end
        );
    }
    let row_bytes = rest
        .iter()
        .try_fold(dtype.size_bytes() as u64, |n, &d| n.checked_mul(d))
        .with_context(|| format!("{}: tensor size overflows", entry.key))?;
    // Both ends are at most the tensor's size, which `tensor_meta`'s callers proved fits.
    let start = rows
        .start
        .checked_mul(row_bytes)
        .with_context(|| format!("{}: tensor size overflows", entry.key))?;
    let end = rows
        .end
        .checked_mul(row_bytes)
        .with_context(|| format!("{}: tensor size overflows", entry.key))?;
    Ok(start..end)
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

/// The buffer [`Reader::tensor_as`] needs for `entry` cast to `to`: its elements at the larger of
/// the two dtype sizes (the cast happens in place).
pub fn read_cost_bytes(entry: &IndexEntry, to: DType) -> Result<u64> {
    let (dtype, shape) = tensor_meta(entry)?;
    numel(shape)
        .and_then(|numel| numel.checked_mul(to.size_bytes().max(dtype.size_bytes()) as u64))
        .with_context(|| format!("{}: tensor size overflows", entry.key))
}

pub fn tensor_meta(entry: &IndexEntry) -> Result<(DType, &[u64])> {
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
