//! The engine of `shardscope hash` (and of `verify --manifest` and `diff` with a manifest): the
//! content manifest of an opened checkpoint ([`shardscope_core::manifest`] defines the digests).
//!
//! Tensors stored as contiguous dim-0 slabs (every FSDP shard, every single-chunk tensor) are hashed
//! in one read of their files ([`stream`]): each file is read once, in pieces of [`PIECE_BYTES`],
//! and each piece feeds the file's digest, its chunk's and its tensor's. Any other tensor is
//! assembled whole (as `convert` does) and its chunks' digests are taken from the assembled tensor
//! ([`hash_tensor`]). Results are kept by key, so the manifest does not depend on the thread count
//! or the order work finishes. Memory: per thread one piece buffer, or the tensor for tensors that
//! are not slabs, and the slots of the pieces copied ahead ([`assist`]), reused across segments.

mod assist;
mod stream;

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail};
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry};
use shardscope_core::manifest::{
    Algorithm, ChunkDigest, FileDigest, Hasher, Manifest, StoredAt, TensorDigest, ValueDigest,
    for_each_box_row, value_digest,
};

use crate::convert::{Reader, SlabPiece, tensor_meta};
use crate::input::Input;

/// Bytes read and hashed at a time: small enough that a piece is still in the core's cache when
/// its digests (the file's, the tensor's, and its chunk's) read it after the copy in, as `cat`
/// reads through a 128 KiB buffer (8 MiB pieces went to memory and back: 61% of `cat`'s
/// throughput).
pub const PIECE_BYTES: usize = 256 << 10;

/// How a manifest is computed.
#[derive(Debug, Clone, Copy)]
pub struct HashOptions {
    pub algorithm: Algorithm,
    /// Worker threads (at least 1).
    pub threads: usize,
    /// Digest every file's bytes too (in the same read as the tensors stored in them).
    pub files: bool,
}

/// The default thread count: the available cores, at most 8.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, 8)
}

/// A stored chunk's digest while a tensor is hashed.
#[derive(Debug, Clone)]
enum Chunk {
    NotYet,
    /// The chunk is the whole tensor: its digest is the tensor's.
    Whole,
    Digest(String),
}

impl Chunk {
    fn of(hasher: Option<Hasher>) -> Chunk {
        hasher.map_or(Chunk::Whole, |h| Chunk::Digest(h.finish()))
    }
}

enum Done {
    Tensor(String, TensorDigest),
    Value(String, ValueDigest),
    File(String, FileDigest),
    Failed(String, String),
}

impl Done {
    /// Puts the result in `manifest`; returns its name (for progress).
    fn record(self, manifest: &mut Manifest) -> String {
        match self {
            Done::Tensor(k, t) => {
                manifest.tensors.insert(k.clone(), t);
                k
            }
            Done::Value(k, v) => {
                manifest.values.insert(k.clone(), v);
                k
            }
            Done::File(k, f) => {
                manifest.files.insert(k.clone(), f);
                k
            }
            Done::Failed(k, why) => {
                manifest.errors.insert(k.clone(), why);
                k
            }
        }
    }
}

/// The manifest of the checkpoint `index` read from `source`. Keys that cannot be read are in
/// `errors` (with why, naming the file and byte range); the rest is complete. `progress` hears
/// `(done, total, name)`.
pub fn manifest_of(
    source: &Input,
    index: &CheckpointIndex,
    options: HashOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Manifest {
    let mut manifest = Manifest::new(options.algorithm);
    // Chunks that do not tile their tensor cannot be read as one value.
    for problem in index.check() {
        let place = match (&problem.file, problem.byte_range) {
            (Some(f), Some((a, b))) => format!(" ({f} bytes {a}..{b})"),
            (Some(f), None) => format!(" ({f})"),
            _ => String::new(),
        };
        manifest
            .errors
            .entry(problem.key.clone())
            .or_insert_with(|| format!("{}{place}", problem.what));
    }
    let entries: Vec<&IndexEntry> = index
        .entries
        .iter()
        .filter(|e| !manifest.errors.contains_key(&e.key))
        .collect();
    stream::run(source, index, &entries, options, &mut manifest, progress);
    manifest
}

/// The digest of an entry that is not streamed with its files: a tensor assembled whole, or a value.
fn run_entry(
    reader: &mut Reader<'_>,
    e: &IndexEntry,
    algorithm: Algorithm,
    buf: &mut Vec<u8>,
) -> Done {
    match e.kind {
        EntryKind::Tensor => match hash_tensor(reader, e, algorithm, buf) {
            Ok(t) => Done::Tensor(e.key.clone(), t),
            Err(err) => Done::Failed(e.key.clone(), with_places(e, &err)),
        },
        EntryKind::Bytes | EntryKind::Scalar => {
            match reader.index().read_bytes_value(reader.source(), e) {
                Ok(v) => Done::Value(
                    e.key.clone(),
                    ValueDigest {
                        digest: value_digest(algorithm, &v),
                    },
                ),
                Err(err) => Done::Failed(e.key.clone(), with_places(e, &anyhow::anyhow!(err))),
            }
        }
    }
}

/// The bytes of one row (all dims but the first) of a tensor of `shape`.
fn row_bytes(entry: &IndexEntry, item: u64, shape: &[u64]) -> Result<u64> {
    shape
        .iter()
        .skip(1)
        .try_fold(item, |n, &d| n.checked_mul(d))
        .with_context(|| format!("{}: tensor size overflows", entry.key))
}

/// The chunk `(offsets, sizes)` a dim-0 slab piece of a tensor of `shape` is.
fn slab_chunk(shape: &[u64], row_bytes: u64, piece: &SlabPiece) -> (Vec<u64>, Vec<u64>) {
    match shape.split_first() {
        Some((_, rest)) if row_bytes > 0 => {
            let mut o = vec![0; shape.len()];
            let mut s = rest.to_vec();
            o[0] = piece.tensor_start / row_bytes;
            s.insert(0, piece.len / row_bytes);
            (o, s)
        }
        _ => (vec![], shape.to_vec()),
    }
}

/// The chunk digest of `piece` when it is one of several: a chunk that is the whole tensor has
/// the tensor's framing, hence its digest (the bytes are hashed once).
fn chunk_hasher(
    algorithm: Algorithm,
    entry: &IndexEntry,
    pieces: usize,
    row_bytes: u64,
    piece: &SlabPiece,
) -> Option<Hasher> {
    let (dtype, shape) = tensor_meta(entry).ok()?;
    let (_, sizes) = slab_chunk(shape, row_bytes, piece);
    (pieces != 1 || sizes.as_slice() != shape).then(|| Hasher::tensor(algorithm, dtype, &sizes))
}

/// The digest of a tensor stored as `pieces` (sorted by `tensor_start`): `digest`, and per piece
/// its chunk's (every one hashed).
fn slab_digest(
    entry: &IndexEntry,
    row_bytes: u64,
    pieces: &[SlabPiece],
    digest: String,
    chunk_digests: Vec<Chunk>,
) -> Result<TensorDigest> {
    let (dtype, shape) = tensor_meta(entry)?;
    let chunks = pieces
        .iter()
        .zip(chunk_digests)
        .map(|(piece, d)| {
            let (offsets, sizes) = slab_chunk(shape, row_bytes, piece);
            Ok(ChunkDigest {
                offsets,
                sizes,
                digest: match d {
                    Chunk::Digest(d) => d,
                    Chunk::Whole => digest.clone(),
                    Chunk::NotYet => bail!("{}: a chunk was not hashed", entry.key),
                },
                stored: Some(StoredAt {
                    file: piece.file.clone(),
                    start: piece.file_start,
                    end: piece.file_start.saturating_add(piece.len),
                }),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TensorDigest {
        dtype: dtype.name().to_owned(),
        shape: shape.to_vec(),
        digest,
        chunks,
    })
}

/// `err`, with where the entry's chunks are stored.
fn with_places(e: &IndexEntry, err: &anyhow::Error) -> String {
    let mut places: Vec<String> = e
        .chunks
        .iter()
        .map(|c| {
            StoredAt {
                file: c.file.to_string(),
                start: c.byte_offset,
                end: c.byte_offset.saturating_add(c.byte_length),
            }
            .to_string()
        })
        .collect();
    places.dedup();
    if places.is_empty() {
        format!("{err:#}")
    } else {
        format!("{err:#} (stored in {})", places.join(", "))
    }
}

/// The digest of one tensor, with its chunks' when it has several.
pub fn hash_tensor(
    reader: &mut Reader<'_>,
    entry: &IndexEntry,
    algorithm: Algorithm,
    buf: &mut Vec<u8>,
) -> Result<TensorDigest> {
    let (dtype, shape) = tensor_meta(entry)?;
    let item = dtype.size_bytes() as u64;
    let mut tensor = Hasher::tensor(algorithm, dtype, shape);
    if let Some(mut pieces) = reader.slab_pieces(entry, dtype) {
        pieces.sort_by_key(|p| p.tensor_start);
        let rows = row_bytes(entry, item, shape)?;
        let chunks = vec![Chunk::NotYet; pieces.len()];
        return resume_slabs(
            reader, entry, algorithm, rows, &pieces, 0, tensor, chunks, buf,
        );
    }
    let mut seen: BTreeSet<(&[u64], &[u64])> = BTreeSet::new();
    let distinct: Vec<_> = entry
        .chunks
        .iter()
        .filter(|c| seen.insert((&c.offsets, &c.sizes)) && c.numel() != Some(0))
        .collect();
    let mut chunks: Vec<ChunkDigest> = Vec::new();
    let n = reader.tensor_as(entry, dtype, buf)?;
    let data = &buf[..n];
    tensor.update(data);
    for c in &distinct {
        let mut chunk = Hasher::tensor(algorithm, dtype, &c.sizes);
        for_each_box_row(shape, &c.offsets, &c.sizes, item, |r| {
            chunk.update(&data[r]);
        })
        .with_context(|| {
            format!(
                "{}: a chunk at {:?} is outside the tensor",
                entry.key, c.offsets
            )
        })?;
        chunks.push(ChunkDigest {
            offsets: c.offsets.to_vec(),
            sizes: c.sizes.to_vec(),
            digest: chunk.finish(),
            stored: Some(
                reader
                    .index()
                    .stored_range(reader.source(), entry, c)
                    .into(),
            ),
        });
    }
    chunks.sort_by(|a, b| a.offsets.cmp(&b.offsets));
    if distinct.len() != chunks.len() && !chunks.is_empty() {
        bail!(
            "{}: {} chunks found, {} hashed",
            entry.key,
            distinct.len(),
            chunks.len()
        );
    }
    Ok(TensorDigest {
        dtype: dtype.name().to_owned(),
        shape: shape.to_vec(),
        digest: tensor.finish(),
        chunks,
    })
}

/// Feeds the pieces `pieces[from..]` of a slab tensor (sorted by `tensor_start`) to `tensor`,
/// reading them, with the digest of each chunk not yet known; returns the tensor's digest.
#[allow(clippy::too_many_arguments)] // the state a one-read pass leaves, taken over
fn resume_slabs(
    reader: &mut Reader<'_>,
    entry: &IndexEntry,
    algorithm: Algorithm,
    rows: u64,
    pieces: &[SlabPiece],
    from: usize,
    mut tensor: Hasher,
    mut chunks: Vec<Chunk>,
    buf: &mut Vec<u8>,
) -> Result<TensorDigest> {
    let (dtype, _) = tensor_meta(entry)?;
    for (k, piece) in pieces.iter().enumerate().skip(from) {
        let known = !matches!(chunks.get(k), Some(Chunk::NotYet) | None);
        let mut chunk = if known {
            None
        } else {
            chunk_hasher(algorithm, entry, pieces.len(), rows, piece)
        };
        let end = piece
            .tensor_start
            .checked_add(piece.len)
            .with_context(|| format!("{}: byte offset overflows", entry.key))?;
        let mut at = piece.tensor_start;
        while at < end {
            let stop = end.min(at.saturating_add(PIECE_BYTES as u64));
            let n = reader.range_as(entry, dtype, at..stop, buf)?;
            tensor.update(&buf[..n]);
            if let Some(chunk) = &mut chunk {
                chunk.update(&buf[..n]);
            }
            at = stop;
        }
        if !known && let Some(slot) = chunks.get_mut(k) {
            *slot = Chunk::of(chunk);
        }
    }
    slab_digest(entry, rows, pieces, tensor.finish(), chunks)
}
