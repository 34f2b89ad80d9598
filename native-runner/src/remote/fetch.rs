//! Ranged GETs: a large range is split into parts fetched in parallel (bounded), each streamed
//! into its place in the caller's buffer and checked to be complete (a short body is an error).

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use shardscope_core::source::SourceError;

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
                name: self.url.url_of(name),
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
            bar.set_message(format!("fetching {}", self.url.url_of(name)));
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
    /// [`PARALLEL_REQUESTS`] in flight, every one checked to be complete.
    pub(super) fn fetch_parts(
        &self,
        name: &str,
        jobs: Vec<(Range<u64>, &mut [u8])>,
        bar: Option<&indicatif::ProgressBar>,
    ) -> Result<(), SourceError> {
        let location = self.location(name);
        let short = |part: &Range<u64>, got: usize| SourceError::Io {
            name: self.url.url_of(name),
            message: format!(
                "short body: asked for bytes {}..{} ({} bytes), got {got} bytes",
                part.start,
                part.end,
                part.end - part.start
            ),
        };
        self.runtime.block_on(async {
            let tasks = jobs.into_iter().map(|(part, dst)| {
                let location = location.clone();
                let store = Arc::clone(&self.store);
                async move {
                    let options = object_store::GetOptions {
                        range: Some(part.clone().into()),
                        ..Default::default()
                    };
                    let got = store
                        .get_opts(&location, options)
                        .await
                        .map_err(|e| self.io_error(name, &e))?;
                    let mut body = got.into_stream();
                    let mut filled = 0usize;
                    while let Some(chunk) = body.next().await {
                        let chunk = chunk.map_err(|e| self.io_error(name, &e))?;
                        let end = filled
                            .checked_add(chunk.len())
                            .filter(|&e| e <= dst.len())
                            .ok_or_else(|| short(&part, filled.saturating_add(chunk.len())))?;
                        dst[filled..end].copy_from_slice(&chunk);
                        filled = end;
                        if let Some(bar) = bar {
                            bar.inc(chunk.len() as u64);
                        }
                    }
                    if filled != dst.len() {
                        return Err(short(&part, filled));
                    }
                    Ok(filled as u64)
                }
            });
            let mut pieces = futures::stream::iter(tasks).buffer_unordered(PARALLEL_REQUESTS);
            while let Some(got) = pieces.next().await {
                let got = got?;
                self.requests.fetch_add(1, Ordering::Relaxed);
                self.fetched.fetch_add(got, Ordering::Relaxed);
            }
            Ok(())
        })
    }
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
