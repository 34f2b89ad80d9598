//! Ranged GETs: a large range is split into parts fetched in parallel (bounded), each streamed
//! into its place in the caller's buffer and checked to be complete. A part cut short (reset,
//! early end, stall) is resumed from the byte where it stopped, within the retry budget
//! (`retry::Settings`); whole-file reads are capped before their body is read.

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetResult, ObjectStore};
use shardscope_core::source::SourceError;

use super::retry::{Failure, Fault, Settings};
use super::source::RemoteSource;

/// Reads at least this large are split into parts of this size, fetched in parallel.
pub(super) const PART_BYTES: u64 = 8 << 20;
/// At most this many requests in flight for one read.
pub(super) const PARALLEL_REQUESTS: usize = 8;
/// Reads at least this large show a progress line (stderr is a terminal, progress asked for).
const PROGRESS_MIN_BYTES: u64 = 32 << 20;

/// `range` cut into consecutive parts of at most `part` bytes (one part when it is smaller).
fn split_parts(range: Range<u64>, part: u64) -> Vec<Range<u64>> {
    let part = part.max(1);
    let mut out = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let end = start.saturating_add(part).min(range.end);
        out.push(start..end);
        start = end;
    }
    out
}

impl RemoteSource {
    /// Fetches `range` of `name` into `out` (its length is the range's): parts in parallel, each
    /// copied into place as it arrives (memory: `out` plus the parts in flight), every part checked
    /// to be complete.
    pub(super) fn fetch_into(
        &self,
        name: &str,
        range: Range<u64>,
        out: &mut [u8],
    ) -> Result<(), SourceError> {
        let want = range.end - range.start;
        if out.len() as u64 != want {
            return Err(SourceError::Io {
                name: self.url_of(name),
                message: format!("internal: a {}-byte buffer for {want} bytes", out.len()),
            });
        }
        let parts = split_parts(range.clone(), PART_BYTES);
        let bar = (self.progress && want >= PROGRESS_MIN_BYTES).then(|| {
            let bar = indicatif::ProgressBar::new(want);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg} {bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}",
            ) {
                bar.set_style(style);
            }
            bar.set_message(format!("fetching {}", self.url_of(name)));
            bar
        });
        let part_len = usize::try_from(PART_BYTES).unwrap_or(usize::MAX);
        // Each part streams straight into its own slice of `out` (no intermediate buffer).
        let jobs = parts.into_iter().zip(out.chunks_mut(part_len)).collect();
        let result = self.fetch_parts(name, jobs, bar.as_ref());
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        result
    }

    /// Fetches each `(range, dst)` into its `dst` (as long as its range), at most
    /// [`PARALLEL_REQUESTS`] in flight, each resumed where it stopped after a transient fault.
    pub(super) fn fetch_parts(
        &self,
        name: &str,
        jobs: Vec<(Range<u64>, &mut [u8])>,
        bar: Option<&indicatif::ProgressBar>,
    ) -> Result<(), SourceError> {
        let location = self.location(name);
        let settings = Settings::get();
        self.runtime.block_on(async {
            let tasks = jobs.into_iter().map(|(part, dst)| {
                let location = &location;
                async move {
                    let n = dst.len() as u64;
                    self.fetch_part(location, part, dst, bar, None, settings)
                        .await
                        .map_err(|f| self.failure(name, &f))?;
                    Ok::<u64, SourceError>(n)
                }
            });
            let mut pieces = futures::stream::iter(tasks).buffer_unordered(PARALLEL_REQUESTS);
            while let Some(got) = pieces.next().await {
                self.fetched.fetch_add(got?, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// Fetches `part` of `location` into `dst` (as long as the part), starting with the response
    /// `first` when given (its body is the part). A transient fault (reset, cut or stalled body,
    /// 5xx, no connection) is retried after a backoff, asking only for the bytes still missing
    /// (and, when the server gave an ETag, only if the object is still the same); at most
    /// `settings.tries` tries in all.
    pub(super) async fn fetch_part(
        &self,
        location: &ObjectPath,
        part: Range<u64>,
        dst: &mut [u8],
        bar: Option<&indicatif::ProgressBar>,
        mut first: Option<GetResult>,
        settings: Settings,
    ) -> Result<(), Failure> {
        let mut at = Progress {
            filled: 0,
            etag: None,
        };
        let started = std::time::Instant::now();
        let mut tries = 0u32;
        // Tries in a row that brought no new byte: a try that delivers part of the body starts
        // the count (and the backoff) again, so a transfer cut every time still gets there.
        let mut in_a_row = 0u32;
        loop {
            tries += 1;
            let before = at.filled;
            let fault = match self
                .fetch_rest(location, &part, dst, &mut at, first.take(), bar, settings)
                .await
            {
                Ok(()) => return Ok(()),
                Err(mut fault) => {
                    if let Fault::Cut { missing, range, .. } = &mut fault {
                        *missing = (dst.len() - at.filled) as u64;
                        *range = (part.start, part.end);
                    }
                    fault
                }
            };
            in_a_row = if at.filled > before { 0 } else { in_a_row + 1 };
            if !fault.is_transient() {
                return Err(Failure::new(fault, tries, tries));
            }
            if in_a_row >= settings.tries {
                return Err(Failure::new(fault, tries, in_a_row));
            }
            let wait = settings.backoff(in_a_row + 1);
            if started.elapsed() + wait > settings.deadline {
                return Err(Failure {
                    fault,
                    tries,
                    gave_up: super::retry::GaveUp::Deadline(settings.deadline),
                });
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// One try: the bytes of `part` from `at.filled` on, each wait for a byte limited to
    /// `--io-timeout`.
    #[allow(
        clippy::too_many_arguments,
        reason = "one try of `fetch_part`, its state passed in"
    )]
    async fn fetch_rest(
        &self,
        location: &ObjectPath,
        part: &Range<u64>,
        dst: &mut [u8],
        at: &mut Progress,
        first: Option<GetResult>,
        bar: Option<&indicatif::ProgressBar>,
        settings: Settings,
    ) -> Result<(), Fault> {
        let io = settings.io_timeout;
        let from = part.start + at.filled as u64;
        let span = (part.start, part.end);
        let got = if let Some(got) = first {
            got
        } else {
            let options = object_store::GetOptions {
                range: Some((from..part.end).into()),
                if_match: at.etag.clone(),
                ..Default::default()
            };
            let got = tokio::time::timeout(io, self.store.get_opts(location, options))
                .await
                .map_err(|_| Fault::Stalled(io))?
                .map_err(|e| Fault::of(self.url.scheme, e, span))?;
            self.requests.fetch_add(1, Ordering::Relaxed);
            got
        };
        if at.etag.is_none() {
            at.etag.clone_from(&got.meta.e_tag);
        }
        let mut body = got.into_stream();
        loop {
            let chunk = match tokio::time::timeout(io, body.next()).await {
                Err(_) => return Err(Fault::Stalled(io)),
                Ok(None) => break,
                Ok(Some(chunk)) => chunk.map_err(|e| Fault::of(self.url.scheme, e, span))?,
            };
            let end = at
                .filled
                .checked_add(chunk.len())
                .filter(|&e| e <= dst.len())
                .ok_or(Fault::LongBody { range: span })?;
            dst[at.filled..end].copy_from_slice(&chunk);
            at.filled = end;
            if let Some(bar) = bar {
                bar.inc(chunk.len() as u64);
            }
        }
        if at.filled == dst.len() {
            Ok(())
        } else {
            Err(Fault::Cut {
                reset: false,
                missing: 0,
                range: span,
            })
        }
    }

    /// Runs `op` (one request) until it succeeds, with a backoff between tries, each try limited
    /// to `--io-timeout`; transient faults only are retried.
    pub(super) async fn with_retries<T, F, Fut>(&self, mut op: F) -> Result<T, Failure>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, object_store::Error>>,
    {
        let settings = Settings::get();
        let mut tries = 0u32;
        loop {
            tries += 1;
            let fault = match tokio::time::timeout(settings.io_timeout, op()).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => Fault::of(self.url.scheme, e, (0, 0)),
                Err(_) => Fault::Stalled(settings.io_timeout),
            };
            if !fault.is_transient() || tries >= settings.tries {
                return Err(Failure::new(fault, tries, tries));
            }
            tokio::time::sleep(settings.backoff(tries + 1)).await;
        }
    }

    /// A whole file, fetched by one GET (resumed by range if cut), refused before its body is
    /// read when the server says it is larger than `limit` (`what`: which files, for the message).
    pub(super) fn get_whole(
        &self,
        name: &str,
        limit: u64,
        what: &'static str,
    ) -> Result<Bytes, Failure> {
        let location = self.location(name);
        let settings = Settings::get();
        self.runtime.block_on(async {
            let got = self
                .with_retries(|| self.store.get_opts(&location, GetOptions::default()))
                .await?;
            self.requests.fetch_add(1, Ordering::Relaxed);
            let size = got.meta.size;
            let one = |fault| Failure::new(fault, 1, 1);
            if size > limit {
                return Err(one(Fault::TooLarge { size, limit, what }));
            }
            let mut buf = zeroed(size).map_err(one)?;
            self.fetch_part(&location, 0..size, &mut buf, None, Some(got), settings)
                .await?;
            self.fetched.fetch_add(size, Ordering::Relaxed);
            Ok(Bytes::from(buf))
        })
    }

    /// `Failure` of a read of `name`, as the error that names its URL.
    pub(super) fn failure(&self, name: &str, failure: &Failure) -> SourceError {
        SourceError::Io {
            name: self.url_of(name),
            message: failure.describe(self.url.scheme),
        }
    }
}

/// How far one part has come: bytes in place, and the object's ETag (resumes ask for the same).
struct Progress {
    filled: usize,
    etag: Option<String>,
}

/// A zeroed buffer of `size` bytes, or a fault when it cannot be had (a size from the network:
/// never an abort).
pub(super) fn zeroed(size: u64) -> Result<Vec<u8>, Fault> {
    let n = usize::try_from(size).map_err(|_| Fault::NoMemory { size })?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(n)
        .map_err(|_| Fault::NoMemory { size })?;
    buf.resize(n, 0);
    Ok(buf)
}

/// [`zeroed`] whose pages stay untouched until written (for a buffer mostly left zero): the
/// allocation is tried fallibly first, then made zeroed by the allocator (`calloc`), which the OS
/// backs page by page. (Between the two another thread could take the memory; the probe still turns
/// a size no process could hold into an error rather than an abort.)
pub(super) fn lazy_zeroed(size: u64) -> Result<Vec<u8>, Fault> {
    let n = usize::try_from(size).map_err(|_| Fault::NoMemory { size })?;
    let mut probe: Vec<u8> = Vec::new();
    probe
        .try_reserve_exact(n)
        .map_err(|_| Fault::NoMemory { size })?;
    drop(probe);
    Ok(vec![0u8; n])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_reads_split_into_bounded_parts() {
        assert_eq!(split_parts(0..10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(split_parts(5..6, 4), vec![5..6]);
        assert!(split_parts(3..3, 4).is_empty());
        assert_eq!(split_parts(0..3, 0), vec![0..1, 1..2, 2..3]);
        let parts = split_parts(7..(3 * PART_BYTES + 7), PART_BYTES);
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts.iter().map(|r| r.end - r.start).sum::<u64>(),
            3 * PART_BYTES
        );
    }
}
