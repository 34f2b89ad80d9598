//! A/B compare in the browser: the opened checkpoint (A) against another (B), picked files or
//! URLs, read lazily as A is ([`LazySource`]). The comparison is `shardscope diff`'s own
//! ([`DiffPlan`], the plan `verify::diff` runs), taken a batch of keys at a time (consecutive keys
//! up to [`BATCH_BYTES`] per side, or one larger key): the batch's byte ranges of both sides are
//! fetched (adjacent ones in one read), its keys are compared, and its bytes are dropped before
//! the next, so memory stays at a batch (or the largest tensor pair). Between batches the work
//! yields to the browser (a `setTimeout` slice every few milliseconds), so the page keeps drawing
//! its progress.

use std::sync::atomic::{AtomicBool, Ordering};

use shardscope_core::checkpoint::{Checkpoint, CheckpointError as OpenError, ReadOptions};
use shardscope_core::verify::{DiffOptions, DiffPlan, Tolerance};
use shardscope_viewer::checkpoint::CheckpointError;
use shardscope_viewer::compare::{CompareError, Comparison, Progress};

use crate::lazy::LazySource;

/// Files up to this size are fetched whole before comparing (small checkpoints in a few reads).
pub(crate) const PREFETCH_WHOLE: u64 = 64 << 20;
/// Work this long (milliseconds) before yielding to the browser.
pub(crate) const SLICE_MS: f64 = 30.0;
/// The most tensor bytes of one side compared in one batch.
pub const BATCH_BYTES: u64 = 32 << 20;
/// The most keys in one batch.
pub(crate) const BATCH_KEYS: usize = 512;

/// One side of a comparison: its name (a file name, a folder, a URL shown without its query)
/// and its files.
#[derive(Debug)]
pub struct Side {
    pub label: String,
    pub source: LazySource,
}

pub(crate) fn failed(side: &'static str, message: String) -> CompareError {
    CompareError::Open {
        side,
        source: CheckpointError::Open { message },
    }
}

/// Opens a side with `Checkpoint::open`, as every front end opens a checkpoint.
pub(crate) async fn open(
    side: &'static str,
    s: &mut Side,
    options: &ReadOptions,
) -> Result<Checkpoint, CompareError> {
    let label = s.label.clone();
    s.source
        .prefetch_first()
        .await
        .map_err(|e| failed(side, e))?;
    s.source
        .run(
            |src| {
                Checkpoint::open(src, &label, options).map_err(|e| match e {
                    OpenError::Index { source, .. } => format!("{label}: {source}"),
                    other => other.to_string(),
                })
            },
            |_| {},
        )
        .await
        .map_err(|e| failed(side, e))
}

/// Lets the browser draw a frame (a `setTimeout(0)` round trip).
pub(crate) async fn yield_to_browser() {
    let promise = js_sys::Promise::new(&mut |resolve, _| {
        if let Some(w) = web_sys::window() {
            let _ = w.set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, 0);
        }
    });
    let _ = wasm_bindgen_futures::JsFuture::from(promise).await;
}

/// Work on the page's one thread in slices of [`SLICE_MS`]: between batches, [`Self::step`] stops
/// when cancelled and, once a slice is spent, reports progress and lets the browser draw a frame.
pub(crate) struct Slices {
    started: f64,
}

impl Slices {
    pub(crate) fn new() -> Slices {
        Slices {
            started: js_sys::Date::now(),
        }
    }

    /// Before the batch starting at `done` of `total` (`what`: its first key).
    pub(crate) async fn step(
        &mut self,
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(Progress),
        done: usize,
        total: usize,
        what: &str,
    ) -> Result<(), CompareError> {
        if cancel.load(Ordering::Relaxed) {
            return Err(CompareError::Cancelled);
        }
        if js_sys::Date::now() - self.started > SLICE_MS {
            progress(Progress {
                done,
                total,
                what: what.to_owned(),
            });
            yield_to_browser().await;
            self.started = js_sys::Date::now();
        }
        Ok(())
    }

    /// After the last batch: the cancel check and the final progress.
    pub(crate) fn finish(
        cancel: &AtomicBool,
        progress: &mut dyn FnMut(Progress),
        total: usize,
    ) -> Result<(), CompareError> {
        if cancel.load(Ordering::Relaxed) {
            return Err(CompareError::Cancelled);
        }
        progress(Progress {
            done: total,
            total,
            what: String::new(),
        });
        Ok(())
    }
}

/// The entry of `key` in a checkpoint.
fn entry<'c>(ckpt: &'c Checkpoint, key: &str) -> Option<&'c shardscope_core::index::IndexEntry> {
    let i = ckpt
        .index
        .entries
        .binary_search_by(|e| e.key.as_str().cmp(key))
        .ok()?;
    ckpt.index.entries.get(i)
}

/// The bytes `key` reads in a checkpoint (0 for a value or a key it lacks).
fn nbytes(ckpt: &Checkpoint, key: &str) -> u64 {
    entry(ckpt, key)
        .and_then(shardscope_core::index::IndexEntry::nbytes)
        .unwrap_or(0)
}

/// Compares `a` with `b` as `shardscope diff A B --json` does (no `--select`; `tolerance` as
/// `--rtol --atol [--equal-nan]`), reporting progress; `cancel` stops it at the next key with
/// [`CompareError::Cancelled`].
pub async fn compare(
    a: &mut Side,
    b: &mut Side,
    options: &ReadOptions,
    tolerance: Option<Tolerance>,
    progress: &mut dyn FnMut(Progress),
    cancel: &AtomicBool,
) -> Result<Comparison, CompareError> {
    progress(Progress {
        what: format!("opening A: {}", a.label),
        ..Progress::default()
    });
    let a_ckpt = open("A", a, options).await?;
    progress(Progress {
        what: format!("opening B: {}", b.label),
        ..Progress::default()
    });
    let b_ckpt = open("B", b, options).await?;
    a.source
        .prefetch_small(PREFETCH_WHOLE)
        .await
        .map_err(|e| failed("A", e))?;
    b.source
        .prefetch_small(PREFETCH_WHOLE)
        .await
        .map_err(|e| failed("B", e))?;
    let plan = DiffPlan::new(
        (&a_ckpt.index, &a_ckpt.label),
        (&b_ckpt.index, &b_ckpt.label),
        &DiffOptions {
            tolerance,
            select: None,
            cast: None,
        },
    );
    let keys = plan.keys();
    let total = keys.len();
    let mut entries = Vec::with_capacity(total);
    let mut slices = Slices::new();
    let mut start = 0;
    while start < total {
        slices
            .step(cancel, progress, start, total, &keys[start])
            .await?;
        let (mut end, mut a_bytes, mut b_bytes) = (start, 0u64, 0u64);
        while end < total && end - start < BATCH_KEYS {
            let key = &keys[end];
            let (da, db) = (nbytes(&a_ckpt, key), nbytes(&b_ckpt, key));
            let (na, nb) = (a_bytes.saturating_add(da), b_bytes.saturating_add(db));
            if end > start && (na > BATCH_BYTES || nb > BATCH_BYTES) {
                break;
            }
            (a_bytes, b_bytes, end) = (na, nb, end + 1);
        }
        let (a_mark, b_mark) = (a.source.mark(), b.source.mark());
        let batch = LazySource::run_pair(&mut a.source, &mut b.source, |sa, sb| {
            (start..end)
                .filter_map(|i| plan.entry(i, sa, sb))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|(side, e)| failed(side, format!("reading `{}`: {e}", keys[start])))?;
        a.source.release(&a_mark);
        b.source.release(&b_mark);
        entries.extend(batch);
        start = end;
    }
    Slices::finish(cancel, progress, total)?;
    Ok(Comparison::from_report(
        plan.report(entries),
        shardscope_viewer::compare::side_notes(&a_ckpt.notes, &b_ckpt.notes),
    ))
}
