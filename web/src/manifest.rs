//! A checkpoint checked against a content manifest in the browser (`shardscope hash`; issue 37):
//! the viewer asks for the check ([`shardscope_viewer::manifest_check::External`]) when a manifest
//! and a checkpoint are both open, and this module runs it as an async task over the checkpoint's
//! files read lazily ([`LazySource`]: picked files by `Blob.slice`, URLs by `Range` requests),
//! with the desktop's own hashing ([`add_entry`]: `shardscope hash`'s framing) and `verify
//! --manifest`'s comparison ([`report_of`]).
//!
//! The browser has no threads: the keys are taken a batch at a time (consecutive keys up to
//! [`BATCH_BYTES`] of tensors, or one larger tensor), the batch's chunks are read at once
//! (one suspension with JSPI, one round of reads without), hashed, and dropped before the next,
//! so memory stays at a batch (or twice the largest tensor, which is assembled whole as on the
//! desktop: at most [`MAX_TENSOR_BYTES`]); between
//! batches the task yields to the page every few milliseconds, so that it keeps drawing, and the
//! page's status line shows `checking against M: done/total: key`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use shardscope_core::checkpoint::ReadOptions;
use shardscope_core::index::EntryKind;
use shardscope_core::manifest::Manifest;
use shardscope_core::source::Source;
use shardscope_viewer::compare::{CompareError, Progress};
use shardscope_viewer::manifest_check::{
    ExternalRequest, OpenedManifest, add_entry, manifest_start, report_of,
};
use shardscope_viewer::report::Report;

use crate::compare::{BATCH_KEYS, PREFETCH_WHOLE, Side, Slices, failed};
use crate::lazy::LazySource;
use crate::urls;

/// The most tensor bytes hashed in one batch: hashing is the slow part (SHA-256 in wasm: about
/// 100 MB/s), and the page draws no frame during a batch.
pub const BATCH_BYTES: u64 = 8 << 20;

/// The largest tensor checked in the browser: it is assembled whole in wasm memory (32-bit, at
/// most 4 GiB), as the desktop assembles it.
pub const MAX_TENSOR_BYTES: u64 = 1 << 30;

/// The page's side of the checks: the one running, the one asked for meanwhile, the results for
/// the viewer's next frame.
#[derive(Debug, Default)]
pub struct Checks {
    running: bool,
    /// Asked for while one ran (that one is cancelled; this runs next).
    queued: Option<ExternalRequest>,
    cancel: Arc<AtomicBool>,
    /// What the running check is doing, for the page's status line.
    progress: Option<String>,
    /// The last finished check's summary (`checked against M: N tensors: ...`), shown after it.
    summary: Option<String>,
    /// Finished checks, for the viewer's next frame.
    done: Vec<Result<Report, CompareError>>,
    /// `verify --manifest --json` of the last finished check (queries hidden), for tests.
    report_json: String,
}

impl Checks {
    /// For the page's status line: what the running check is doing (`...` follows), else the
    /// last one's summary.
    pub fn status(&self) -> Option<(&str, bool)> {
        match (&self.progress, &self.summary) {
            (Some(p), _) => Some((p, true)),
            (None, Some(s)) => Some((s, false)),
            (None, None) => None,
        }
    }

    /// `verify --manifest --json` of the last finished check (empty before the first).
    pub fn report_json(&self) -> &str {
        &self.report_json
    }

    /// Hands the finished checks to the viewer (the Verify tab shows the report).
    pub fn take_results(&mut self, viewer: &mut shardscope_viewer::Viewer) {
        for result in std::mem::take(&mut self.done) {
            viewer.take_manifest_check(result);
        }
    }
}

/// What the page's shared state gives a check.
pub trait Host: 'static {
    fn checks(&mut self) -> &mut Checks;
    /// A reader of the checkpoint opened last from files or URLs (a fresh [`LazySource`] over
    /// the same files) and its name; `None` when there is none, or while a comparison holds it.
    fn opened_copy(&self) -> Option<Side>;
    /// An open or a comparison runs: the checkpoint to check may not be available yet.
    fn busy(&self) -> bool;
    fn read_options(&self) -> ReadOptions;
}

fn repaint(ctx: &Mutex<Option<egui::Context>>) {
    if let Ok(slot) = ctx.lock()
        && let Some(ctx) = slot.as_ref()
    {
        ctx.request_repaint();
    }
}

/// Runs the check the viewer asked for, after the running one (which is cancelled) if any.
pub fn request<H: Host>(
    shared: &Arc<Mutex<H>>,
    ctx: &Arc<Mutex<Option<egui::Context>>>,
    request: ExternalRequest,
) {
    let Ok(mut s) = shared.lock() else { return };
    let checks = s.checks();
    if checks.running {
        checks.queued = Some(request);
        checks.cancel.store(true, Ordering::Relaxed);
        return;
    }
    checks.running = true;
    checks.summary = None;
    checks.progress = Some(format!("checking against {}", request.manifest.name));
    drop(s);
    wasm_bindgen_futures::spawn_local(run_loop(shared.clone(), ctx.clone(), request));
}

/// Runs checks until none is queued.
async fn run_loop<H: Host>(
    shared: Arc<Mutex<H>>,
    ctx: Arc<Mutex<Option<egui::Context>>>,
    mut request: ExternalRequest,
) {
    loop {
        let result = check_once(&shared, &request).await;
        let Ok(mut s) = shared.lock() else { return };
        let checks = s.checks();
        let result = result.map(|(report, json)| {
            checks.report_json = urls::hide_queries(&json);
            checks.summary = Some(format!(
                "checked against {}: {}",
                request.manifest.name,
                report.summary()
            ));
            report
        });
        checks.done.push(result);
        if let Some(next) = checks.queued.take() {
            request = next;
        } else {
            checks.running = false;
            checks.progress = None;
            drop(s);
            repaint(&ctx);
            return;
        }
        drop(s);
        repaint(&ctx);
    }
}

/// Waits `ms` milliseconds.
async fn sleep(ms: i32) {
    let promise = js_sys::Promise::new(&mut |resolve, _| {
        if let Some(w) = web_sys::window() {
            let _ = w.set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, ms);
        }
    });
    let _ = wasm_bindgen_futures::JsFuture::from(promise).await;
}

/// One check: waits for the checkpoint the viewer named (while it opens, or while a comparison
/// holds it), then checks a fresh reader of its files.
async fn check_once<H: Host>(
    shared: &Mutex<H>,
    request: &ExternalRequest,
) -> Result<(Report, String), CompareError> {
    let (cancel, options) = {
        let Ok(mut s) = shared.lock() else {
            return Err(CompareError::Cancelled);
        };
        let options = s.read_options();
        let checks = s.checks();
        checks.cancel.store(false, Ordering::Relaxed);
        (checks.cancel.clone(), options)
    };
    let mut side = loop {
        let (side, busy) = match shared.lock() {
            Ok(s) => (s.opened_copy(), s.busy()),
            Err(_) => (None, false),
        };
        match side {
            Some(side) if side.label == request.checkpoint => break side,
            _ if busy && !cancel.load(Ordering::Relaxed) => sleep(100).await,
            _ if cancel.load(Ordering::Relaxed) => return Err(CompareError::Cancelled),
            _ => {
                return Err(failed(
                    "the checkpoint",
                    format!(
                        "{}: the browser checks a checkpoint it reads by byte range (opened \
                         from files, a folder or URLs); this one was opened whole (a .zip): \
                         open its files, or run `shardscope verify CHECKPOINT --manifest {}`",
                        request.checkpoint, request.manifest.name
                    ),
                ));
            }
        }
    };
    let mut progress = |p: Progress| {
        if let Ok(mut s) = shared.lock() {
            s.checks().progress = Some(if p.total == 0 {
                format!("checking against {}: {}", request.manifest.name, p.what)
            } else {
                format!(
                    "checking against {}: {}/{}: {}",
                    request.manifest.name, p.done, p.total, p.what
                )
            });
        }
    };
    check(
        &mut side,
        &request.manifest,
        &options,
        &mut progress,
        &cancel,
    )
    .await
}

/// Checks the checkpoint `side` against `expected` as `shardscope verify CHECKPOINT --manifest
/// M` does: every tensor and value read and hashed with `expected`'s algorithm, reporting
/// progress; `cancel` stops it at the next batch with [`CompareError::Cancelled`]. The report as
/// the viewer shows it, and as `verify --manifest --json` prints it.
pub async fn check(
    side: &mut Side,
    expected: &OpenedManifest,
    options: &ReadOptions,
    progress: &mut dyn FnMut(Progress),
    cancel: &AtomicBool,
) -> Result<(Report, String), CompareError> {
    progress(Progress {
        what: format!("opening {}", side.label),
        ..Progress::default()
    });
    let ckpt = crate::compare::open("the checkpoint", side, options).await?;
    side.source
        .prefetch_small(PREFETCH_WHOLE)
        .await
        .map_err(|e| failed("the checkpoint", e))?;
    let index = &ckpt.index;
    let algorithm = expected.manifest.algorithm;
    let mut out = manifest_start(index, algorithm);
    let entries = &index.entries;
    let total = entries.len();
    let mut slices = Slices::new();
    let mut start = 0;
    while start < total {
        slices
            .step(cancel, progress, start, total, &entries[start].key)
            .await?;
        let (mut end, mut bytes) = (start, 0u64);
        while end < total && end - start < BATCH_KEYS {
            let n = entries[end].nbytes().unwrap_or(0);
            if end > start && bytes.saturating_add(n) > BATCH_BYTES {
                break;
            }
            (bytes, end) = (bytes.saturating_add(n), end + 1);
        }
        let batch = &entries[start..end];
        for e in batch {
            if let Some(n) = e.nbytes().filter(|&n| n > MAX_TENSOR_BYTES) {
                out.errors.entry(e.key.clone()).or_insert_with(|| {
                    format!(
                        "{n} bytes: the browser viewer checks tensors of at most {} MiB (each \
                         is assembled whole in its memory); run `shardscope verify CHECKPOINT \
                         --manifest {}`",
                        MAX_TENSOR_BYTES >> 20,
                        expected.name
                    )
                });
            }
        }
        // The chunks of a batch of small tensors, asked for at once (one suspension, or one round
        // of reads). Not those of one larger tensor: read at once, they would be held beside
        // their copies (three times the tensor); read as asked for, each chunk is read into its
        // own buffer (twice the tensor, with the tensor assembled).
        let reads: Vec<(&str, u64, u64)> = batch
            .iter()
            .filter(|_| bytes <= BATCH_BYTES)
            .filter(|e| e.kind == EntryKind::Tensor && !out.errors.contains_key(&e.key))
            .flat_map(|e| {
                e.chunks
                    .iter()
                    .map(|c| (&*c.file, c.byte_offset, c.byte_length))
            })
            .collect();
        let mark = side.source.mark();
        let part = side
            .source
            .run(
                |s: &LazySource| {
                    s.will_read(&reads);
                    let mut part = Manifest::new(algorithm);
                    for e in batch.iter().filter(|e| !out.errors.contains_key(&e.key)) {
                        add_entry(index, s, e, &mut part);
                    }
                    Ok::<_, String>(part)
                },
                |_| {},
            )
            .await
            .map_err(|e| {
                let key = batch.first().map_or("", |e| e.key.as_str());
                failed("the checkpoint", format!("reading `{key}`: {e}"))
            })?;
        side.source.release(&mark);
        out.tensors.extend(part.tensors);
        out.values.extend(part.values);
        out.errors.extend(part.errors);
        start = end;
    }
    Slices::finish(cancel, progress, total)?;
    report_of(expected, &out, &side.label)
}
