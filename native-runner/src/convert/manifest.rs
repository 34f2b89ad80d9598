//! `convert --write-manifest`: the content manifest of an output (`shardscope_core::manifest`, the format
//! `shardscope hash` writes), computed from the bytes as the writers write them, never from a
//! second read of the output.
//!
//! A writer declares each tensor it writes ([`ManifestSink::tensor`]: the output key or keys, the
//! output dtype and shape, the dim-0 chunks it stores), then passes every piece of its bytes in
//! the order it writes them ([`ManifestSink::bytes`]: a tensor's pieces arrive in C order, each at
//! the byte offset it holds in the tensor; a piece out of order is refused, so a digest is never
//! taken of bytes in another order than the tensor's). Each file written goes through a [`Tap`],
//! which digests its bytes as they pass; a file the writer seeks back into (a `.pt` storage
//! written in parts, whose zip checksum is patched in at its end) has no digest, since its bytes
//! did not pass in order. Non-tensor values are digested from their JSON form, as `hash` reads
//! them.

use std::collections::BTreeMap;
use std::io::{self, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use shardscope_core::DType;
use shardscope_core::manifest::{
    Algorithm, ChunkDigest, FileDigest, Hasher, Manifest, TensorDigest, ValueDigest, value_digest,
};

pub use shardscope_core::manifest::FOLDER_MANIFEST;

/// Where the manifest of the output `dest` goes: `DST.manifest.json` beside a file output,
/// `DST/shardscope.manifest.json` inside a folder output.
pub fn manifest_path(dest: &Path, folder: bool) -> PathBuf {
    if folder {
        return dest.join(FOLDER_MANIFEST);
    }
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".manifest.json");
    dest.with_file_name(name)
}

/// One stored chunk of a tensor being digested: its box, its bytes in the tensor, its hasher.
struct Chunk {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    bytes: Range<u64>,
    hasher: Option<Hasher>,
    digest: Option<String>,
}

/// A tensor being digested.
struct Slot {
    keys: Vec<String>,
    dtype: DType,
    shape: Vec<u64>,
    nbytes: u64,
    /// The tensor byte offset the next piece must start at.
    next: u64,
    whole: Option<Hasher>,
    digest: Option<String>,
    chunks: Vec<Chunk>,
}

impl Slot {
    fn feed(&mut self, at: u64, bytes: &[u8]) -> Result<()> {
        let key = &self.keys[0];
        if at != self.next {
            bail!(
                "{key}: bytes {at}.. written before bytes {}.. (the manifest digests a tensor in C order)",
                self.next
            );
        }
        // An empty piece (a rank's empty chunk) adds nothing.
        if bytes.is_empty() && self.whole.is_none() {
            return Ok(());
        }
        let end = at
            .checked_add(bytes.len() as u64)
            .filter(|&e| e <= self.nbytes)
            .with_context(|| format!("{key}: more bytes written than the tensor holds"))?;
        let whole = self
            .whole
            .as_mut()
            .with_context(|| format!("{key}: written after it was complete"))?;
        whole.update(bytes);
        for chunk in &mut self.chunks {
            let (a, b) = (chunk.bytes.start.max(at), chunk.bytes.end.min(end));
            if a < b
                && let Some(h) = chunk.hasher.as_mut()
            {
                h.update(&bytes[(a - at) as usize..(b - at) as usize]);
            }
            if chunk.bytes.end <= end
                && let Some(h) = chunk.hasher.take()
            {
                chunk.digest = Some(h.finish());
            }
        }
        self.next = end;
        if end == self.nbytes
            && let Some(h) = self.whole.take()
        {
            self.digest = Some(h.finish());
        }
        Ok(())
    }
}

#[derive(Default)]
struct State {
    slots: Vec<Slot>,
    values: BTreeMap<String, ValueDigest>,
    files: BTreeMap<String, FileDigest>,
    /// Files whose bytes did not pass in order (no digest), by name.
    undigested: Vec<String>,
}

/// The manifest of one output, filled while it is written (any thread; the executor's writing
/// thread in practice).
pub struct ManifestSink {
    algorithm: Algorithm,
    state: Mutex<State>,
}

impl ManifestSink {
    pub fn new(algorithm: Algorithm) -> Self {
        Self {
            algorithm,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves digests that are checked at `finish` anyway.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Declares a tensor written under `keys` (several: tied names of one storage) as `dtype`
    /// and `shape`, stored in `chunks` (`(offsets, sizes)`, dim-0 slabs in C order; empty: one
    /// chunk, the whole tensor). Returns the slot its bytes are passed to.
    pub fn tensor(
        &self,
        keys: Vec<String>,
        dtype: DType,
        shape: &[u64],
        chunks: &[(Vec<u64>, Vec<u64>)],
    ) -> Result<usize> {
        let key = keys.first().context("a tensor without a key")?.clone();
        let item = dtype.size_bytes() as u64;
        let nbytes = shape
            .iter()
            .try_fold(item, |n, &d| n.checked_mul(d))
            .with_context(|| format!("{key}: tensor size overflows"))?;
        let row_bytes = shape.iter().skip(1).product::<u64>().saturating_mul(item);
        let mut kept = Vec::new();
        for (offsets, sizes) in chunks {
            // The same empty chunk may be declared more than once; an empty chunk has no digest
            // in `hash`'s manifests either.
            if sizes.contains(&0) {
                continue;
            }
            let slab = offsets.len() == shape.len()
                && sizes.len() == shape.len()
                && offsets.iter().skip(1).all(|&o| o == 0)
                && sizes.iter().zip(shape).skip(1).all(|(s, d)| s == d);
            let (start, end) = match (offsets.first(), sizes.first()) {
                (Some(&o), Some(&s)) if slab => (
                    o.saturating_mul(row_bytes),
                    o.saturating_add(s).saturating_mul(row_bytes),
                ),
                // 0-dim: one chunk, the element.
                (None, None) if slab => (0, nbytes),
                _ => bail!("{key}: a chunk at {offsets:?} of {sizes:?} is not a dim-0 slab"),
            };
            if end > nbytes {
                bail!("{key}: a chunk at {offsets:?} of {sizes:?} is outside {shape:?}");
            }
            kept.push(Chunk {
                offsets: offsets.clone(),
                sizes: sizes.clone(),
                bytes: start..end,
                hasher: Some(Hasher::tensor(self.algorithm, dtype, sizes)),
                digest: None,
            });
        }
        let whole = Hasher::tensor(self.algorithm, dtype, shape);
        let mut slot = Slot {
            keys,
            dtype,
            shape: shape.to_vec(),
            nbytes,
            next: 0,
            whole: Some(whole),
            digest: None,
            chunks: kept,
        };
        if nbytes == 0 {
            slot.feed(0, &[])?;
        }
        let mut state = self.state();
        state.slots.push(slot);
        Ok(state.slots.len() - 1)
    }

    /// Passes the next bytes of the tensor `slot`, `at` bytes into it.
    pub fn bytes(&self, slot: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let mut state = self.state();
        let slot = state
            .slots
            .get_mut(slot)
            .context("bytes passed for a tensor never declared")?;
        slot.feed(at, bytes)
    }

    /// Records the non-tensor value `key` by its JSON form.
    pub fn value(&self, key: &str, value: &serde_json::Value) {
        let digest = value_digest(self.algorithm, value);
        self.state()
            .values
            .insert(key.to_owned(), ValueDigest { digest });
    }

    /// Records the file `name` whose bytes passed through `tap`.
    pub fn file<W>(&self, name: &str, tap: Tap<W>) {
        let mut state = self.state();
        match tap.finish() {
            Some(file) => {
                state.files.insert(name.to_owned(), file);
            }
            None => state.undigested.push(name.to_owned()),
        }
    }

    /// Records the file `name` written as `bytes` whole.
    pub fn file_bytes(&self, name: &str, bytes: &[u8]) {
        let mut h = Hasher::new(self.algorithm);
        h.update(bytes);
        self.state().files.insert(
            name.to_owned(),
            FileDigest {
                size: bytes.len() as u64,
                digest: h.finish(),
            },
        );
    }

    /// Files written with no digest (their bytes did not pass in order).
    pub fn undigested(&self) -> Vec<String> {
        self.state().undigested.clone()
    }

    /// The manifest, once every declared tensor has had all its bytes.
    pub fn manifest(&self) -> Result<Manifest> {
        let state = self.state();
        let mut manifest = Manifest::new(self.algorithm);
        for slot in &state.slots {
            let key = &slot.keys[0];
            let digest = slot.digest.clone().with_context(|| {
                format!(
                    "{key}: {} of its {} bytes were written",
                    slot.next, slot.nbytes
                )
            })?;
            let chunks = if slot.chunks.len() > 1 {
                slot.chunks
                    .iter()
                    .map(|c| {
                        Ok(ChunkDigest {
                            offsets: c.offsets.clone(),
                            sizes: c.sizes.clone(),
                            digest: c
                                .digest
                                .clone()
                                .with_context(|| format!("{key}: a chunk was not all written"))?,
                            stored: None,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?
            } else {
                Vec::new()
            };
            for k in &slot.keys {
                let t = TensorDigest {
                    dtype: slot.dtype.name().to_owned(),
                    shape: slot.shape.clone(),
                    digest: digest.clone(),
                    chunks: chunks.clone(),
                };
                if manifest.tensors.insert(k.clone(), t).is_some() {
                    bail!("{k}: two tensors of the output have this key");
                }
            }
        }
        for (k, v) in &state.values {
            if manifest.tensors.contains_key(k)
                || manifest.values.insert(k.clone(), v.clone()).is_some()
            {
                bail!("{k}: two entries of the output have this key");
            }
        }
        manifest.files = state.files.clone();
        Ok(manifest)
    }
}

/// Writes the manifest of `sink` beside the file output `dest` (`DST.manifest.json`),
/// atomically; call it inside [`crate::atomic::together`] with the output, so that both appear
/// together. Returns its path.
pub(super) fn write_beside(sink: &ManifestSink, dest: &Path) -> Result<String> {
    let text = sink.manifest()?.to_json();
    let path = manifest_path(dest, false);
    crate::atomic::write_file(&path, |w| {
        w.write_all(text.as_bytes())?;
        Ok(())
    })?;
    Ok(path.display().to_string())
}

/// A `Write` that digests the bytes passing through it, in order; seeking back (a zip member's
/// checksum patched in) gives up the digest.
pub struct Tap<W> {
    inner: W,
    hasher: Option<Hasher>,
    size: u64,
}

impl<W> Tap<W> {
    /// Digests with `algorithm` when given (`None`: passes bytes through).
    pub fn new(inner: W, algorithm: Option<Algorithm>) -> Self {
        Self {
            inner,
            hasher: algorithm.map(Hasher::new),
            size: 0,
        }
    }

    /// The file's size and digest, `None` when its bytes did not pass in order.
    fn finish(self) -> Option<FileDigest> {
        self.hasher.map(|h| FileDigest {
            size: self.size,
            digest: h.finish(),
        })
    }
}

impl<W: Write> Write for Tap<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        if let Some(h) = self.hasher.as_mut() {
            h.update(&buf[..n]);
        }
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<W: Write + Seek> Seek for Tap<W> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let at = self.inner.seek(to)?;
        if at != self.size {
            // Bytes are about to be written out of order: the stream's digest is not the file's.
            self.hasher = None;
        }
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_in_order_give_hash_digests_and_out_of_order_is_refused() {
        let sink = ManifestSink::new(Algorithm::Sha256);
        // A [4, 2] uint8 tensor in two dim-0 chunks, passed in three pieces.
        let data: Vec<u8> = (0..8).collect();
        let chunks = [(vec![0, 0], vec![3, 2]), (vec![3, 0], vec![1, 2])];
        let slot = sink
            .tensor(vec!["t".into()], DType::UInt8, &[4, 2], &chunks)
            .unwrap();
        sink.bytes(slot, 0, &data[..4]).unwrap();
        assert!(sink.bytes(slot, 5, &data[5..]).is_err());
        assert!(sink.manifest().is_err(), "incomplete");
        sink.bytes(slot, 4, &data[4..7]).unwrap();
        sink.bytes(slot, 7, &data[7..]).unwrap();
        assert!(sink.bytes(slot, 8, &[0]).is_err());
        let m = sink.manifest().unwrap();
        let t = &m.tensors["t"];
        let want = |shape: &[u64], bytes: &[u8]| {
            let mut h = Hasher::tensor(Algorithm::Sha256, DType::UInt8, shape);
            h.update(bytes);
            h.finish()
        };
        assert_eq!(t.digest, want(&[4, 2], &data));
        assert_eq!(t.chunks[0].digest, want(&[3, 2], &data[..6]));
        assert_eq!(t.chunks[1].digest, want(&[1, 2], &data[6..]));
    }

    #[test]
    fn a_tap_digests_what_passes_and_gives_up_on_a_seek_back() {
        let mut tap = Tap::new(io::Cursor::new(Vec::new()), Some(Algorithm::Xxh3));
        tap.write_all(b"abc").unwrap();
        let sink = ManifestSink::new(Algorithm::Xxh3);
        sink.file("f", tap);
        assert_eq!(
            sink.manifest().unwrap().files["f"].digest,
            shardscope_core::manifest::digest(Algorithm::Xxh3, b"abc")
        );
        let mut tap = Tap::new(io::Cursor::new(Vec::new()), Some(Algorithm::Xxh3));
        tap.write_all(b"abc").unwrap();
        tap.seek(SeekFrom::Start(3)).unwrap();
        tap.seek(SeekFrom::Start(0)).unwrap();
        tap.write_all(b"x").unwrap();
        sink.file("g", tap);
        assert_eq!(sink.undigested(), ["g"]);
    }
}
