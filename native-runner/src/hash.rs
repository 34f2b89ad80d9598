//! The engine of `shardscope hash` (and of `verify --manifest` and `diff` with a manifest): the
//! content manifest of an opened checkpoint ([`shardscope_core::manifest`] defines the digests).
//!
//! Tensors are read through the conversion [`Reader`] in their logical C order: a tensor stored as
//! contiguous dim-0 slabs (every FSDP shard, every single-chunk tensor) is streamed in pieces of
//! [`PIECE_BYTES`] straight from its stored byte ranges, each piece fed to the tensor's digest and
//! to its chunk's; any other is assembled whole (as `convert` does) and its chunks' digests are
//! taken from the assembled tensor. Threads take tensors, values and files in turn; results are
//! kept by key, so the manifest does not depend on the thread count or the order work finishes.
//! Memory: per thread one piece buffer, or the tensor for tensors that are not slabs.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use anyhow::{Context, Result, bail};
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry};
use shardscope_core::manifest::{
    Algorithm, ChunkDigest, FileDigest, Hasher, Manifest, StoredAt, TensorDigest, ValueDigest,
    for_each_box_row, value_digest,
};
use shardscope_core::shape::nbytes;
use shardscope_core::source::Source;

use crate::convert::{Reader, tensor_meta};
use crate::input::Input;

/// Bytes read and hashed at a time: small enough that a piece is still in the core's cache when
/// its digests (the tensor's, and its chunk's) read it after the copy in, as `cat` reads through
/// a 128 KiB buffer (8 MiB pieces went to memory and back: 61% of `cat`'s throughput).
pub const PIECE_BYTES: usize = 256 << 10;

/// How a manifest is computed.
#[derive(Debug, Clone, Copy)]
pub struct HashOptions {
    pub algorithm: Algorithm,
    /// Worker threads (at least 1).
    pub threads: usize,
    /// Digest every file's bytes too (a second read of every byte).
    pub files: bool,
}

/// The default thread count: the available cores, at most 8.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, 8)
}

enum Job<'a> {
    Entry(&'a IndexEntry),
    File(&'a str, u64),
}

impl Job<'_> {
    fn name(&self) -> &str {
        match self {
            Job::Entry(e) => &e.key,
            Job::File(name, _) => name,
        }
    }
}

enum Done {
    Tensor(String, TensorDigest),
    Value(String, ValueDigest),
    File(String, FileDigest),
    Failed(String, String),
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
    let mut jobs: Vec<(u64, Job<'_>)> = Vec::new();
    for e in &index.entries {
        if manifest.errors.contains_key(&e.key) {
            continue;
        }
        let cost = match (e.dtype, e.shape.as_deref()) {
            (Some(d), Some(s)) => nbytes(d, s).unwrap_or(u64::MAX),
            _ => 0,
        };
        jobs.push((cost, Job::Entry(e)));
    }
    if options.files {
        for (name, info) in &index.files {
            jobs.push((info.size, Job::File(name, info.size)));
        }
    }
    // The largest first: the threads finish together. (The manifest does not depend on it.)
    jobs.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.name().cmp(b.1.name())));
    let total = jobs.len();
    let next = AtomicUsize::new(0);
    let (tx, rx) = mpsc::channel::<Done>();
    let threads = options.threads.clamp(1, total.max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let tx = tx.clone();
            let (jobs, next) = (&jobs, &next);
            scope.spawn(move || {
                let mut reader = Reader::new(source, index);
                let mut buf = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((_, job)) = jobs.get(i) else { break };
                    let done = run_job(&mut reader, job, options.algorithm, &mut buf);
                    if tx.send(done).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut done = 0;
        progress(0, total, "");
        for result in rx {
            done += 1;
            let name = match result {
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
            };
            progress(done, total, &name);
        }
    });
    progress(total, total, "");
    manifest
}

fn run_job(
    reader: &mut Reader<'_>,
    job: &Job<'_>,
    algorithm: Algorithm,
    buf: &mut Vec<u8>,
) -> Done {
    match job {
        Job::File(name, size) => match hash_file(reader.source(), name, *size, algorithm, buf) {
            Ok(f) => Done::File((*name).to_owned(), f),
            Err(e) => Done::Failed(format!("file {name}"), format!("{e:#}")),
        },
        Job::Entry(e) => match e.kind {
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
        },
    }
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

fn hash_file(
    source: &Input,
    name: &str,
    size: u64,
    algorithm: Algorithm,
    buf: &mut Vec<u8>,
) -> Result<FileDigest> {
    let mut h = Hasher::new(algorithm);
    let mut at = 0u64;
    while at < size {
        let n = usize::try_from((size - at).min(PIECE_BYTES as u64))?;
        if buf.len() < n {
            buf.resize(n, 0);
        }
        source
            .read_range_into(name, at, &mut buf[..n])
            .with_context(|| format!("{name}: bytes {at}..{}", at + n as u64))?;
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(FileDigest {
        size,
        digest: h.finish(),
    })
}

/// The digest of one tensor, with its chunks' when it has several.
#[allow(clippy::too_many_lines)] // one pass per storage case, kept together
pub fn hash_tensor(
    reader: &mut Reader<'_>,
    entry: &IndexEntry,
    algorithm: Algorithm,
    buf: &mut Vec<u8>,
) -> Result<TensorDigest> {
    let (dtype, shape) = tensor_meta(entry)?;
    let item = dtype.size_bytes() as u64;
    let mut tensor = Hasher::tensor(algorithm, dtype, shape);
    let mut seen: BTreeSet<(&[u64], &[u64])> = BTreeSet::new();
    let distinct: Vec<_> = entry
        .chunks
        .iter()
        .filter(|c| seen.insert((&c.offsets, &c.sizes)) && c.numel() != Some(0))
        .collect();
    let mut chunks: Vec<ChunkDigest> = Vec::new();
    if let Some(mut pieces) = reader.slab_pieces(entry, dtype) {
        pieces.sort_by_key(|p| p.tensor_start);
        let row_bytes = shape
            .iter()
            .skip(1)
            .try_fold(item, |n, &d| n.checked_mul(d))
            .with_context(|| format!("{}: tensor size overflows", entry.key))?;
        for piece in &pieces {
            let (offsets, sizes) = match shape.split_first() {
                Some((_, rest)) if row_bytes > 0 => {
                    let mut o = vec![0; shape.len()];
                    let mut s = rest.to_vec();
                    o[0] = piece.tensor_start / row_bytes;
                    s.insert(0, piece.len / row_bytes);
                    (o, s)
                }
                _ => (vec![], shape.to_vec()),
            };
            // A chunk that is the whole tensor has the tensor's framing, hence its digest: the
            // bytes are hashed once.
            let whole = pieces.len() == 1 && sizes.as_slice() == shape;
            let mut chunk = (!whole).then(|| Hasher::tensor(algorithm, dtype, &sizes));
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
            chunks.push(ChunkDigest {
                offsets,
                sizes,
                // The whole tensor's chunk: filled in with the tensor's digest below.
                digest: chunk.map(Hasher::finish).unwrap_or_default(),
                stored: Some(StoredAt {
                    file: piece.file.clone(),
                    start: piece.file_start,
                    end: piece.file_start.saturating_add(piece.len),
                }),
            });
        }
    } else {
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
    }
    if distinct.len() != chunks.len() && !chunks.is_empty() {
        bail!(
            "{}: {} chunks found, {} hashed",
            entry.key,
            distinct.len(),
            chunks.len()
        );
    }
    let digest = tensor.finish();
    for c in &mut chunks {
        if c.digest.is_empty() {
            c.digest.clone_from(&digest);
        }
    }
    Ok(TensorDigest {
        dtype: dtype.name().to_owned(),
        shape: shape.to_vec(),
        digest,
        chunks,
    })
}
