//! Content manifests (`shardscope hash`): one digest per tensor of its *logical* value, so that a
//! DCP, its safetensors twin, per-rank FSDP files and torch's consolidated `.pt` of the same
//! tensors give the same digest per key, whatever the sharding or the serialization.
//!
//! # Framing (version 1, `docs/hash.md`)
//! - **Tensor**: `H("tensor\0" + DTYPE + "\0" + SHAPE + "\0" + DATA)` where `DTYPE` is torch's
//!   name without `torch.` (`float32`, `bfloat16`, `bool`), `SHAPE` the dims in decimal joined by
//!   `,` (empty for a 0-dim tensor), and `DATA` the elements in C (row-major) order, little-endian,
//!   as `tensor.contiguous().view(torch.uint8)` holds them. The header is unambiguous (neither
//!   part holds a NUL) and fixes the data's length.
//! - **Chunk** (optional per-chunk digests of a sharded tensor): the tensor framing of the
//!   sub-tensor `tensor[o0:o0+s0, o1:o1+s1, …]` (its sizes as `SHAPE`), so a chunk holding the whole
//!   tensor has the tensor's digest.
//! - **Non-tensor value** (ints, floats, strings, lists of `param_groups`): `H("value\0" + C(v))`
//!   over the value's JSON form (as `inspect` shows it), with the canonical encoding `C`: `N` null,
//!   `F`/`T` false/true, `I<decimal>;` an integer, `D<16 hex digits>;` a float as the big-endian
//!   bits of its IEEE-754 binary64 (`struct.pack(">d", x).hex()`), `S<len>:<utf-8 bytes>` a string
//!   (`len` its UTF-8 bytes in decimal), `L<n>:` then the items of a list, `M<n>:` then the pairs
//!   (key as a string, value) of a map sorted by the keys' UTF-8 bytes.
//! - **File**: `H(file bytes)`, no framing.
//!
//! `H` is XXH3-128 (seed 0; the digest is the 128-bit value as 32 lowercase hex digits, big-endian,
//! as `xxhash.xxh3_128_hexdigest` gives it) or SHA-256 (64 lowercase hex digits).
//!
//! Nothing here touches files or threads (the viewer builds for wasm32): the runner feeds the
//! bytes ([`Hasher::update`], in C order, in pieces of any size).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;

/// The name of the manifest `convert --manifest` writes inside a folder output (DCP, HF shards):
/// readers leave it out of the checkpoint.
pub const FOLDER_MANIFEST: &str = "shardscope.manifest.json";

/// The manifest version written and read.
pub const MANIFEST_VERSION: u32 = 1;

/// The digest algorithm of a manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// XXH3-128, seed 0 (fast; not for signing).
    #[default]
    Xxh3,
    /// SHA-256 (slower; a manifest to sign).
    Sha256,
}

impl Algorithm {
    /// The name the manifest records (`xxh3-128`, `sha256`).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Xxh3 => "xxh3-128",
            Algorithm::Sha256 => "sha256",
        }
    }

    /// Reads `xxh3-128` (or `xxh3`) and `sha256`.
    pub fn parse(s: &str) -> Option<Algorithm> {
        match s {
            "xxh3-128" | "xxh3" => Some(Algorithm::Xxh3),
            "sha256" => Some(Algorithm::Sha256),
            _ => None,
        }
    }

    /// Hex digits of one digest.
    pub fn hex_len(self) -> usize {
        match self {
            Algorithm::Xxh3 => 32,
            Algorithm::Sha256 => 64,
        }
    }
}

impl Serialize for Algorithm {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// An incremental digest of one of the [`Algorithm`]s.
pub struct Hasher(Inner);

enum Inner {
    Xxh3(Box<twox_hash::xxhash3_128::Hasher>),
    Sha256(Box<sha2::Sha256>),
}

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Inner::Xxh3(_) => "Hasher(xxh3-128)",
            Inner::Sha256(_) => "Hasher(sha256)",
        })
    }
}

impl Hasher {
    pub fn new(algorithm: Algorithm) -> Hasher {
        use sha2::Digest as _;
        Hasher(match algorithm {
            Algorithm::Xxh3 => Inner::Xxh3(Box::new(twox_hash::xxhash3_128::Hasher::new())),
            Algorithm::Sha256 => Inner::Sha256(Box::new(sha2::Sha256::new())),
        })
    }

    /// A hasher that has taken the tensor header of `dtype` and `shape`: feed it the elements in
    /// C order.
    pub fn tensor(algorithm: Algorithm, dtype: DType, shape: &[u64]) -> Hasher {
        let mut h = Hasher::new(algorithm);
        h.update(&tensor_header(dtype, shape));
        h
    }

    pub fn update(&mut self, bytes: &[u8]) {
        use sha2::Digest as _;
        match &mut self.0 {
            Inner::Xxh3(h) => h.write(bytes),
            Inner::Sha256(h) => h.update(bytes),
        }
    }

    /// The digest as lowercase hex.
    pub fn finish(self) -> String {
        use sha2::Digest as _;
        match self.0 {
            Inner::Xxh3(h) => format!("{:032x}", h.finish_128()),
            Inner::Sha256(h) => {
                let mut out = String::with_capacity(64);
                for b in h.finalize() {
                    let _ = write!(out, "{b:02x}");
                }
                out
            }
        }
    }
}

/// The digest of `bytes`.
pub fn digest(algorithm: Algorithm, bytes: &[u8]) -> String {
    let mut h = Hasher::new(algorithm);
    h.update(bytes);
    h.finish()
}

/// `tensor\0DTYPE\0SHAPE\0`: what precedes a tensor's bytes.
pub fn tensor_header(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let mut s = String::from("tensor\0");
    s.push_str(dtype.name());
    s.push('\0');
    for (i, d) in shape.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{d}");
    }
    s.push('\0');
    s.into_bytes()
}

/// The canonical encoding of a non-tensor value's JSON form (see the module docs).
pub fn canonical_value(v: &serde_json::Value) -> Vec<u8> {
    let mut out = Vec::new();
    encode(v, &mut out);
    out
}

fn encode_str(s: &str, out: &mut Vec<u8>) {
    out.push(b'S');
    out.extend_from_slice(s.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(s.as_bytes());
}

fn encode(v: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value as J;
    match v {
        J::Null => out.push(b'N'),
        J::Bool(false) => out.push(b'F'),
        J::Bool(true) => out.push(b'T'),
        J::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.extend_from_slice(format!("I{i};").as_bytes());
            } else if let Some(u) = n.as_u64() {
                out.extend_from_slice(format!("I{u};").as_bytes());
            } else {
                // Not an integer: serde_json holds it as an f64.
                let f = n.as_f64().unwrap_or(f64::NAN);
                out.extend_from_slice(format!("D{:016x};", f.to_bits()).as_bytes());
            }
        }
        J::String(s) => encode_str(s, out),
        J::Array(items) => {
            out.extend_from_slice(format!("L{}:", items.len()).as_bytes());
            for item in items {
                encode(item, out);
            }
        }
        J::Object(map) => {
            let mut pairs: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            pairs.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.extend_from_slice(format!("M{}:", pairs.len()).as_bytes());
            for (k, v) in pairs {
                encode_str(k, out);
                encode(v, out);
            }
        }
    }
}

/// The digest of a non-tensor value: `H("value\0" + canonical_value(v))`.
pub fn value_digest(algorithm: Algorithm, v: &serde_json::Value) -> String {
    let mut h = Hasher::new(algorithm);
    h.update(b"value\0");
    h.update(&canonical_value(v));
    h.finish()
}

/// Calls `row` with the byte range, in a C-order tensor of `shape` (elements of `item` bytes), of
/// each row (last-dim run) of the box at `offsets` of `sizes`, in C order: hashing them in turn
/// hashes the sub-tensor. `None` when the box is not inside the tensor or a size overflows.
pub fn for_each_box_row(
    shape: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    item: u64,
    mut row: impl FnMut(std::ops::Range<usize>),
) -> Option<()> {
    if offsets.len() != shape.len() || sizes.len() != shape.len() {
        return None;
    }
    for ((&o, &s), &d) in offsets.iter().zip(sizes).zip(shape) {
        if o.checked_add(s)? > d {
            return None;
        }
    }
    // Strides in elements; the whole tensor's byte size must fit a usize.
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].checked_mul(shape[i + 1])?;
    }
    let total = shape
        .iter()
        .try_fold(item, |n, &d| n.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())?;
    if sizes.contains(&0) {
        return Some(());
    }
    let Some((&last, outer)) = sizes.split_last() else {
        // 0-dim: one element.
        row(0..usize::try_from(item).ok()?.min(total));
        return Some(());
    };
    let row_bytes = last.checked_mul(item)?;
    let mut index = vec![0u64; outer.len()];
    loop {
        let mut pos = offsets[outer.len()];
        for d in 0..outer.len() {
            pos = pos.checked_add((offsets[d] + index[d]).checked_mul(strides[d])?)?;
        }
        let start = usize::try_from(pos.checked_mul(item)?).ok()?;
        let end = start.checked_add(usize::try_from(row_bytes).ok()?)?;
        if end > total {
            return None;
        }
        row(start..end);
        let mut d = outer.len();
        loop {
            if d == 0 {
                return Some(());
            }
            d -= 1;
            index[d] += 1;
            if index[d] < sizes[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// Where a chunk's bytes lie in this checkpoint (for messages; never serialized).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAt {
    pub file: String,
    pub start: u64,
    pub end: u64,
}

/// From `(file, start, end)` (`CheckpointIndex::stored_range`).
impl From<(String, u64, u64)> for StoredAt {
    fn from((file, start, end): (String, u64, u64)) -> StoredAt {
        StoredAt { file, start, end }
    }
}

impl std::fmt::Display for StoredAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes {}..{}", self.file, self.start, self.end)
    }
}

/// The digest of one stored chunk of a tensor: the framing of its sub-tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkDigest {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub digest: String,
    /// Where it lies in the checkpoint hashed (not in the manifest file).
    #[serde(skip)]
    pub stored: Option<StoredAt>,
}

/// One tensor of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDigest {
    /// torch's name without `torch.`.
    pub dtype: String,
    pub shape: Vec<u64>,
    pub digest: String,
    /// Per stored chunk, in C order of their offsets, when the tensor is stored in more than one;
    /// `verify --manifest` then names the chunk that differs.
    #[serde(default, skip_serializing_if = "one_or_none")]
    pub chunks: Vec<ChunkDigest>,
}

fn one_or_none(chunks: &[ChunkDigest]) -> bool {
    chunks.len() <= 1
}

/// One non-tensor value of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValueDigest {
    pub digest: String,
}

/// One file of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub size: u64,
    pub digest: String,
}

/// A content manifest: `{"version": 1, "algorithm", "tensors", "values", "files"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Manifest {
    pub version: u32,
    pub algorithm: Algorithm,
    pub tensors: BTreeMap<String, TensorDigest>,
    /// Non-tensor values by key.
    pub values: BTreeMap<String, ValueDigest>,
    pub files: BTreeMap<String, FileDigest>,
    /// Keys that could not be read, with why (a manifest being compared; never written: a
    /// manifest with errors is not written).
    #[serde(skip)]
    pub errors: BTreeMap<String, String>,
}

/// Why a manifest file cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ManifestError(pub String);

#[derive(Deserialize)]
struct RawManifest {
    version: u32,
    algorithm: String,
    tensors: BTreeMap<String, TensorDigest>,
    #[serde(default)]
    values: BTreeMap<String, ValueDigest>,
    #[serde(default)]
    files: BTreeMap<String, FileDigest>,
}

impl Manifest {
    pub fn new(algorithm: Algorithm) -> Manifest {
        Manifest {
            version: MANIFEST_VERSION,
            algorithm,
            tensors: BTreeMap::new(),
            values: BTreeMap::new(),
            files: BTreeMap::new(),
            errors: BTreeMap::new(),
        }
    }

    /// The manifest as pretty JSON with a final newline: the same bytes for the same content.
    pub fn to_json(&self) -> String {
        // Strings, integers and maps only: serializing cannot fail.
        serde_json::to_string_pretty(self)
            .map_or_else(|e| format!("{{\"error\": \"{e}\"}}"), |s| s + "\n")
    }

    /// Whether `text` looks like a manifest (a JSON object with `version`, `algorithm` and
    /// `tensors`), without checking it.
    pub fn looks_like(text: &[u8]) -> bool {
        #[derive(Deserialize)]
        struct Probe {
            #[allow(dead_code)]
            version: serde_json::Value,
            #[allow(dead_code)]
            algorithm: serde_json::Value,
            #[allow(dead_code)]
            tensors: serde_json::Value,
        }
        serde_json::from_slice::<Probe>(text).is_ok()
    }

    /// Reads and checks a manifest (untrusted): version 1, a known algorithm, digests of its
    /// length in lowercase hex, known dtypes, chunks inside their tensor.
    pub fn from_json(text: &[u8]) -> Result<Manifest, ManifestError> {
        let raw: RawManifest = serde_json::from_slice(text)
            .map_err(|e| ManifestError(format!("not a shardscope manifest: {e}")))?;
        if raw.version != MANIFEST_VERSION {
            return Err(ManifestError(format!(
                "manifest version {} (this shardscope reads version {MANIFEST_VERSION})",
                raw.version
            )));
        }
        let algorithm = Algorithm::parse(&raw.algorithm).ok_or_else(|| {
            ManifestError(format!(
                "unknown algorithm `{}` (xxh3-128, sha256)",
                raw.algorithm
            ))
        })?;
        let check = |what: &str, d: &str| -> Result<(), ManifestError> {
            let ok = d.len() == algorithm.hex_len()
                && d.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            if ok {
                Ok(())
            } else {
                Err(ManifestError(format!(
                    "{what}: `{}` is not a {} digest ({} lowercase hex digits)",
                    d.chars().take(80).collect::<String>(),
                    algorithm.name(),
                    algorithm.hex_len()
                )))
            }
        };
        for (key, t) in &raw.tensors {
            check(key, &t.digest)?;
            t.dtype
                .parse::<DType>()
                .map_err(|e| ManifestError(format!("{key}: {e}")))?;
            for c in &t.chunks {
                check(key, &c.digest)?;
                let inside = c.offsets.len() == t.shape.len()
                    && c.sizes.len() == t.shape.len()
                    && c.offsets
                        .iter()
                        .zip(&c.sizes)
                        .zip(&t.shape)
                        .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|e| e <= d));
                if !inside {
                    return Err(ManifestError(format!(
                        "{key}: a chunk at {:?} of {:?} is not inside the shape {:?}",
                        c.offsets, c.sizes, t.shape
                    )));
                }
            }
        }
        for (key, v) in &raw.values {
            check(key, &v.digest)?;
        }
        for (name, f) in &raw.files {
            check(name, &f.digest)?;
        }
        Ok(Manifest {
            version: raw.version,
            algorithm,
            tensors: raw.tensors,
            values: raw.values,
            files: raw.files,
            errors: BTreeMap::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digests() {
        // Reference values: `xxhsum -H2` / `sha256sum` of the empty input and of "abc".
        assert_eq!(
            digest(Algorithm::Xxh3, b""),
            "99aa06d3014798d86001c324468d497f"
        );
        assert_eq!(
            digest(Algorithm::Sha256, b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn incremental_equals_oneshot() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for alg in [Algorithm::Xxh3, Algorithm::Sha256] {
            let mut h = Hasher::new(alg);
            for piece in data.chunks(777) {
                h.update(piece);
            }
            assert_eq!(h.finish(), digest(alg, &data));
        }
    }

    #[test]
    fn tensor_header_frames_dtype_and_shape() {
        assert_eq!(
            tensor_header(DType::Float32, &[3, 5]),
            b"tensor\0float32\x003,5\0"
        );
        assert_eq!(tensor_header(DType::BFloat16, &[]), b"tensor\0bfloat16\0\0");
        // A 1-D tensor of 12 elements and a [1, 2] tensor differ in the header.
        assert_ne!(
            tensor_header(DType::Int8, &[12]),
            tensor_header(DType::Int8, &[1, 2])
        );
    }

    #[test]
    fn canonical_values() {
        let v: serde_json::Value = serde_json::json!({
            "lr": 0.001, "betas": [0.9, 0.999], "step": 3, "name": "é", "b": true, "n": null,
            "neg": -2, "big": 18_446_744_073_709_551_615u64, "one": 1.0
        });
        let c = String::from_utf8(canonical_value(&v)).unwrap();
        assert_eq!(
            c,
            format!(
                "M9:S1:bTS5:betasL2:D{:016x};D{:016x};S3:bigI18446744073709551615;S2:lrD{:016x};S1:nNS4:nameS2:éS3:negI-2;S3:oneD{:016x};S4:stepI3;",
                0.9f64.to_bits(),
                0.999f64.to_bits(),
                0.001f64.to_bits(),
                1.0f64.to_bits()
            )
        );
        // An int and a float of one value differ; key order does not matter.
        assert_ne!(
            canonical_value(&serde_json::json!(1)),
            canonical_value(&serde_json::json!(1.0))
        );
        assert_eq!(
            canonical_value(&serde_json::json!({"a": 1, "b": 2})),
            canonical_value(&serde_json::json!({"b": 2, "a": 1}))
        );
        // A list of two strings and one string holding both differ.
        assert_ne!(
            canonical_value(&serde_json::json!(["a", "b"])),
            canonical_value(&serde_json::json!(["ab"]))
        );
    }

    #[test]
    fn box_rows_cover_the_sub_tensor_in_c_order() {
        // A 3x4 tensor of 1-byte elements 0..12; the box rows 1..3, cols 1..3.
        let t: Vec<u8> = (0..12).collect();
        let mut got = Vec::new();
        for_each_box_row(&[3, 4], &[1, 1], &[2, 2], 1, |r| {
            got.extend_from_slice(&t[r]);
        })
        .unwrap();
        assert_eq!(got, [5, 6, 9, 10]);
        // The whole tensor is one pass over it.
        let mut all = Vec::new();
        for_each_box_row(&[3, 4], &[0, 0], &[3, 4], 1, |r| {
            all.extend_from_slice(&t[r]);
        })
        .unwrap();
        assert_eq!(all, t);
        // Outside, or ranks that differ: refused.
        assert!(for_each_box_row(&[3, 4], &[2, 0], &[2, 4], 1, |_| ()).is_none());
        assert!(for_each_box_row(&[3, 4], &[0], &[3], 1, |_| ()).is_none());
        assert!(for_each_box_row(&[u64::MAX, 4], &[0, 0], &[1, 1], 8, |_| ()).is_none());
        // 0-dim: one element.
        let mut n = 0;
        for_each_box_row(&[], &[], &[], 4, |r| n += r.len()).unwrap();
        assert_eq!(n, 4);
    }

    #[test]
    fn manifest_round_trips_and_rejects_bad_input() {
        let mut m = Manifest::new(Algorithm::Xxh3);
        m.tensors.insert(
            "w".into(),
            TensorDigest {
                dtype: "float32".into(),
                shape: vec![4, 2],
                digest: digest(Algorithm::Xxh3, b"x"),
                chunks: vec![
                    ChunkDigest {
                        offsets: vec![0, 0],
                        sizes: vec![2, 2],
                        digest: digest(Algorithm::Xxh3, b"a"),
                        stored: None,
                    },
                    ChunkDigest {
                        offsets: vec![2, 0],
                        sizes: vec![2, 2],
                        digest: digest(Algorithm::Xxh3, b"b"),
                        stored: None,
                    },
                ],
            },
        );
        m.values.insert(
            "step".into(),
            ValueDigest {
                digest: value_digest(Algorithm::Xxh3, &serde_json::json!(3)),
            },
        );
        let text = m.to_json();
        assert!(Manifest::looks_like(text.as_bytes()));
        let back = Manifest::from_json(text.as_bytes()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.to_json(), text);

        let bad = |s: &str| Manifest::from_json(s.as_bytes()).unwrap_err().to_string();
        assert!(bad("[]").contains("not a shardscope manifest"));
        assert!(
            bad(r#"{"version": 2, "algorithm": "sha256", "tensors": {}}"#).contains("version 2")
        );
        assert!(bad(r#"{"version": 1, "algorithm": "md5", "tensors": {}}"#).contains("md5"));
        let w = |dtype: &str, digest: &str, chunk: &str| {
            format!(
                r#"{{"version": 1, "algorithm": "xxh3-128", "tensors": {{"w": {{"dtype": "{dtype}", "shape": [2], "digest": "{digest}"{chunk}}}}}}}"#
            )
        };
        let good = "0".repeat(32);
        assert!(Manifest::from_json(w("float32", &good, "").as_bytes()).is_ok());
        assert!(bad(&w("float32", "00", "")).contains("w: `00` is not a xxh3-128 digest"));
        assert!(bad(&w("float32", &"A".repeat(32), "")).contains("not a xxh3-128 digest"));
        assert!(bad(&w("floaty", &good, "")).contains("w:"));
        let chunk = format!(
            r#", "chunks": [{{"offsets": [18446744073709551615], "sizes": [2], "digest": "{good}"}}]"#
        );
        assert!(bad(&w("float32", &good, &chunk)).contains("not inside the shape"));
        assert!(bad(r#"{"version": 1, "algorithm": "sha256", "tensors": {"w": {"dtype": "float32", "shape": [-1], "digest": ""}}}"#).contains("not a shardscope manifest"));
    }
}
