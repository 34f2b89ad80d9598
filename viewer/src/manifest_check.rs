//! A checkpoint checked against a content manifest (`shardscope hash`; issue 37): opening a
//! manifest beside an opened checkpoint (either first) reads every tensor and value of the
//! checkpoint, hashes it as `shardscope hash` frames it (`core::manifest`: the dtype name, the
//! shape and the bytes in C order; chunks as their sub-tensors), and compares the two as `verify
//! --manifest` does (`core::verify::compare_manifests`). The result is a `verify` report in the
//! **Verify** tab: each tensor that differs (with the chunk and its byte range), is missing or is
//! extra. File digests are not recomputed (they say nothing a tensor's digest does not). On the
//! desktop the work runs on a worker thread, one tensor at a time ([`ManifestJob`]); the browser
//! asks for it ([`External`]) and runs the same [`add_entry`] over batches of keys between frames
//! (`web/src/manifest.rs`).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};

use shardscope_core::checkpoint::ReadOptions;
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry};
use shardscope_core::manifest::{
    Algorithm, ChunkDigest, Hasher, Manifest, TensorDigest, ValueDigest, for_each_box_row,
    value_digest,
};
use shardscope_core::source::Source;

use crate::compare::{CompareError, CompareInput, Progress};
use crate::job::Job;

/// A manifest opened in the viewer, by the name it was opened under.
#[derive(Debug, Clone)]
pub struct OpenedManifest {
    pub name: String,
    pub manifest: Manifest,
}

/// The digest of one tensor and of each of its distinct stored chunks.
fn tensor_digest(
    index: &CheckpointIndex,
    source: &dyn Source,
    e: &IndexEntry,
    algorithm: Algorithm,
) -> Result<TensorDigest, String> {
    let data = index
        .read_tensor(source, e)
        .map_err(|err| err.to_string())?;
    let (dtype, shape) = (data.dtype, data.shape.clone());
    let mut tensor = Hasher::tensor(algorithm, dtype, &shape);
    tensor.update(&data.bytes);
    let item = dtype.size_bytes() as u64;
    let mut seen: BTreeSet<(&[u64], &[u64])> = BTreeSet::new();
    let mut chunks = Vec::new();
    for c in &e.chunks {
        if !seen.insert((&c.offsets, &c.sizes)) || c.numel() == Some(0) {
            continue;
        }
        let mut chunk = Hasher::tensor(algorithm, dtype, &c.sizes);
        for_each_box_row(&shape, &c.offsets, &c.sizes, item, |r| {
            chunk.update(data.bytes.get(r).unwrap_or_default());
        })
        .ok_or_else(|| {
            format!(
                "{}: a chunk at {:?} is outside the tensor",
                e.key, c.offsets
            )
        })?;
        chunks.push(ChunkDigest {
            offsets: c.offsets.to_vec(),
            sizes: c.sizes.to_vec(),
            digest: chunk.finish(),
            stored: Some(index.stored_range(source, e, c).into()),
        });
    }
    chunks.sort_by(|a, b| a.offsets.cmp(&b.offsets));
    Ok(TensorDigest {
        dtype: dtype.name().to_owned(),
        shape,
        digest: tensor.finish(),
        chunks,
    })
}

/// An empty manifest of `index` with `algorithm`, holding the index's own problems as errors
/// (their keys are not read): [`add_entry`] fills it.
pub fn manifest_start(index: &CheckpointIndex, algorithm: Algorithm) -> Manifest {
    let mut out = Manifest::new(algorithm);
    for problem in index.check() {
        out.errors
            .entry(problem.key.clone())
            .or_insert_with(|| problem.what.clone());
    }
    out
}

/// Adds the digest of entry `e` (a tensor's, with its chunks', or a value's) to `out`, with
/// `out`'s algorithm, or why it has none to `out.errors`; a key already in error is skipped.
pub fn add_entry(index: &CheckpointIndex, source: &dyn Source, e: &IndexEntry, out: &mut Manifest) {
    if out.errors.contains_key(&e.key) {
        return;
    }
    let algorithm = out.algorithm;
    match e.kind {
        EntryKind::Tensor => match tensor_digest(index, source, e, algorithm) {
            Ok(t) => {
                out.tensors.insert(e.key.clone(), t);
            }
            Err(why) => {
                out.errors.insert(e.key.clone(), why);
            }
        },
        EntryKind::Bytes | EntryKind::Scalar => match index.read_bytes_value(source, e) {
            Ok(v) => {
                out.values.insert(
                    e.key.clone(),
                    ValueDigest {
                        digest: value_digest(algorithm, &v),
                    },
                );
            }
            Err(why) => {
                out.errors.insert(e.key.clone(), why.to_string());
            }
        },
    }
}

/// The manifest of `index` (tensors and values; no file digests), with `expected`'s algorithm.
pub fn manifest_of(
    index: &CheckpointIndex,
    source: &dyn Source,
    expected: &Manifest,
    progress: &mut dyn FnMut(Progress),
    cancel: &AtomicBool,
) -> Result<Manifest, CompareError> {
    let mut out = manifest_start(index, expected.algorithm);
    let total = index.entries.len();
    for (done, e) in index.entries.iter().enumerate() {
        if cancel.load(Ordering::Relaxed) {
            return Err(CompareError::Cancelled);
        }
        if out.errors.contains_key(&e.key) {
            continue;
        }
        progress(Progress {
            done,
            total,
            what: e.key.clone(),
        });
        add_entry(index, source, e, &mut out);
    }
    Ok(out)
}

/// `actual` (the manifest of the checkpoint `label`) checked against `expected` as `verify
/// --manifest` does: the report as the viewer shows it, and as `verify --manifest --json` prints
/// it.
pub fn report_of(
    expected: &OpenedManifest,
    actual: &Manifest,
    label: &str,
) -> Result<(crate::report::Report, String), CompareError> {
    let report = shardscope_core::verify::compare_manifests(
        (&expected.manifest, &expected.name),
        (actual, label),
        "verify",
    );
    let json = report.to_json();
    let name = format!("{label} against {}", expected.name);
    let shown = crate::report::Report::from_json_bytes(json.as_bytes(), &name).map_err(|e| {
        CompareError::Open {
            side: "the report",
            source: crate::checkpoint::CheckpointError::Open {
                message: e.to_string(),
            },
        }
    })?;
    Ok((shown, json))
}

/// The checkpoint `input` checked against `expected`: the `verify` report, as the viewer shows
/// reports.
pub fn check(
    input: &CompareInput,
    options: &ReadOptions,
    expected: &OpenedManifest,
    progress: &mut dyn FnMut(Progress),
    cancel: &AtomicBool,
) -> Result<crate::report::Report, CompareError> {
    let (source, ckpt) = input.open("the checkpoint", options)?;
    let actual = manifest_of(&ckpt.index, &*source, &expected.manifest, progress, cancel)?;
    report_of(expected, &actual, &input.label).map(|(report, _)| report)
}

/// A check the front end runs itself (the browser, which has no threads, runs it as an async
/// task over its lazily read files): the viewer asks for it here instead of starting a job.
#[derive(Debug, Default)]
pub struct External {
    /// The front end runs the checks.
    pub enabled: bool,
    /// A check asked for (the front end takes it).
    pub request: Option<ExternalRequest>,
}

/// The opened checkpoint, by the name it was opened under, to check against `manifest`.
#[derive(Debug, Clone)]
pub struct ExternalRequest {
    pub checkpoint: String,
    pub manifest: OpenedManifest,
}

/// The check as a [`Job`].
#[derive(Debug, Default)]
pub struct ManifestJob {
    pub synchronous: bool,
    pub external: External,
    job: Job<crate::report::Report>,
}

impl ManifestJob {
    pub fn start(&mut self, input: CompareInput, options: ReadOptions, expected: OpenedManifest) {
        self.job.synchronous = self.synchronous;
        self.job.start(
            "manifest",
            Box::new(move |progress, cancel| check(&input, &options, &expected, progress, cancel)),
        );
    }

    pub fn running(&self) -> bool {
        self.job.running()
    }

    pub fn progress(&self) -> Progress {
        self.job.progress()
    }

    /// The finished report, once.
    pub fn poll(&mut self) -> Option<Result<crate::report::Report, CompareError>> {
        self.job.poll()
    }
}
