//! The conversion executor: worker threads read tensors (positioned reads into owned buffers) while
//! the calling thread writes them, in order, into the output. Bytes in flight (buffers being read,
//! read and waiting, or kept for reuse) stay within a memory limit.
//!
//! Output never depends on the thread count: the writer consumes job `i` only after every job before
//! it, so the bytes written are those of a one-thread run. Workers take jobs in order and reserve
//! their buffer before reading; the earliest unwritten job therefore always holds its reservation or
//! is the next to get one, and the pipeline cannot deadlock as long as every job fits the limit
//! (checked up front, a clear error otherwise).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};

use anyhow::{Result, anyhow, bail};
use shardscope_core::DType;
use shardscope_core::index::IndexEntry;

use super::Reader;
use crate::input::Input;

/// The default headroom above the largest read: `--memory-limit` defaults to the largest tensor
/// buffer plus this. 40 MiB, so that the whole process (the index, the writer, the allocator's
/// own overhead: 10-25 MiB) stays within the largest tensor + 64 MiB.
pub const DEFAULT_HEADROOM_BYTES: u64 = 40 << 20;

/// The most worker threads the default (`--threads` not given) uses.
pub const DEFAULT_MAX_THREADS: usize = 8;

/// How the executor runs: reader threads and the memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecOptions {
    /// Reader threads, each beside the writing thread (at least one is spawned).
    pub threads: usize,
    /// Bytes of tensor buffers alive at once; `None`: the largest read plus
    /// [`DEFAULT_HEADROOM_BYTES`] (a remote input: twice the largest read plus the headroom).
    pub memory_limit_bytes: Option<u64>,
}

impl Default for ExecOptions {
    fn default() -> Self {
        Self {
            threads: 1,
            memory_limit_bytes: None,
        }
    }
}

impl ExecOptions {
    /// The default thread count: the available parallelism less one core for the writing thread
    /// (and the kernel's writeback), at least 1, at most [`DEFAULT_MAX_THREADS`]. On 2 cores that
    /// is 1: a second reader made `bench/convert_parallel.py` slower there (BENCHMARKS.md).
    pub fn default_threads() -> usize {
        std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .saturating_sub(1)
            .clamp(1, DEFAULT_MAX_THREADS)
    }
}

/// One read: the bytes of a tensor (cast to `to`), or a byte range of it.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    pub entry: &'a IndexEntry,
    pub to: DType,
    /// A byte range of the (cast) tensor; `None`: all of it.
    pub range: Option<Range<u64>>,
}

impl Job<'_> {
    /// The buffer the read needs (the whole tensor at the larger of its two dtypes, unless a range
    /// can be read in place).
    fn cost_bytes(&self, reader: &Reader<'_>) -> Result<u64> {
        if let Some(range) = &self.range
            && reader.slab_pieces(self.entry, self.to).is_some()
        {
            return Ok(range.end.saturating_sub(range.start));
        }
        reader.cost_bytes(self.entry, self.to)
    }

    fn run(&self, reader: &mut Reader<'_>, buf: &mut Vec<u8>) -> Result<usize> {
        match &self.range {
            None => {
                buf.clear();
                reader.tensor_as(self.entry, self.to, buf)
            }
            Some(range) => reader.range_as(self.entry, self.to, range.clone(), buf),
        }
    }
}

/// What the executor reports after a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// The limit it ran under.
    pub memory_limit_bytes: u64,
    /// The largest buffer one job needed.
    pub largest_read_bytes: u64,
}

/// The memory limit for `jobs` under `options`, or a clear error when a job cannot fit it
/// (`reader` keeps what it finds of where tensors lie, for the reads).
pub fn memory_limit(
    reader: &Reader<'_>,
    jobs: &[Job<'_>],
    options: &ExecOptions,
) -> Result<ExecStats> {
    let source = reader.source();
    let mut largest: Option<(u64, &str)> = None;
    for job in jobs {
        let cost = job.cost_bytes(reader)?;
        if largest.is_none_or(|(c, _)| cost > c) {
            largest = Some((cost, &job.entry.key));
        }
    }
    let largest_bytes = largest.map_or(0, |(c, _)| c);
    let limit = match options.memory_limit_bytes {
        Some(limit) => limit,
        // A remote input: room for two of the largest reads, so that a reader fetches the next
        // tensor while the writer writes the current one (the network and the disk overlap).
        None if matches!(source, Input::Remote(_)) => largest_bytes
            .saturating_mul(2)
            .saturating_add(DEFAULT_HEADROOM_BYTES),
        None => largest_bytes.saturating_add(DEFAULT_HEADROOM_BYTES),
    };
    if let Some((cost, key)) = largest
        && cost > limit
    {
        bail!(
            "--memory-limit {limit} bytes is below the largest read, `{key}` ({cost} bytes)\nhint: raise --memory-limit to at least {cost} (the default is the largest read plus 40 MiB)"
        );
    }
    Ok(ExecStats {
        memory_limit_bytes: limit,
        largest_read_bytes: largest_bytes,
    })
}

#[derive(Debug, Default)]
struct State {
    /// The next job to hand out.
    next: usize,
    /// Capacity of every buffer alive (reserved, being read, read, pooled).
    held_bytes: u64,
    /// Finished reads by job index.
    done: BTreeMap<usize, Result<(Vec<u8>, usize)>>,
    /// Buffers written and kept for reuse.
    pool: Vec<Vec<u8>>,
    /// Set when the writer stops (finished, failed): workers return.
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A worker that panicked while holding the lock cannot leave the counters half-updated in
        // a way that matters here: the writer sees its job never finishing only through `stop`.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait<'g>(&self, guard: MutexGuard<'g, State>) -> MutexGuard<'g, State> {
        self.changed
            .wait(guard)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Stops the workers however the writer leaves (done, error, panic).
struct StopOnDrop<'s>(&'s Shared);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().stop = true;
        self.0.changed.notify_all();
    }
}

/// Reads `jobs` (with `options.threads` readers, within the memory limit) and passes each one's
/// bytes to `write`, in job order.
pub fn run(
    template: &Reader<'_>,
    jobs: &[Job<'_>],
    options: &ExecOptions,
    mut write: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<ExecStats> {
    // One reader locates the tensors for the costs; the workers start from what it found.
    let cost_reader = template.fork();
    let stats = memory_limit(&cost_reader, jobs, options)?;
    if jobs.is_empty() {
        return Ok(stats);
    }
    // Even one reader runs beside the writer: it reads the next piece while this thread writes
    // the last one. Reading in the writing thread was slower on every output measured (2 cores,
    // page-cache reads; BENCHMARKS.md, "convert in parallel").
    let threads = options.threads.clamp(1, jobs.len());
    let costs: Vec<u64> = jobs
        .iter()
        .map(|j| j.cost_bytes(&cost_reader))
        .collect::<Result<_>>()?;
    let limit = stats.memory_limit_bytes;
    let shared = Shared {
        state: Mutex::new(State::default()),
        changed: Condvar::new(),
    };
    std::thread::scope(|scope| -> Result<()> {
        let _stop = StopOnDrop(&shared);
        let (costs, shared) = (&costs, &shared);
        for _ in 0..threads {
            let reader = cost_reader.fork();
            scope.spawn(move || worker(reader, jobs, costs, limit, shared));
        }
        for i in 0..jobs.len() {
            let mut state = shared.lock();
            let finished = loop {
                if let Some(result) = state.done.remove(&i) {
                    break result;
                }
                state = shared.wait(state);
            };
            drop(state);
            let (buf, n) = finished?;
            let written = write(i, &buf[..n]);
            let mut state = shared.lock();
            state.pool.push(buf);
            drop(state);
            shared.changed.notify_all();
            written?;
        }
        Ok(())
    })?;
    Ok(stats)
}

fn worker(mut reader: Reader<'_>, jobs: &[Job<'_>], costs: &[u64], limit: u64, shared: &Shared) {
    loop {
        let mut state = shared.lock();
        let (i, mut buf) = loop {
            if state.stop || state.next >= jobs.len() {
                return;
            }
            let cost = costs[state.next];
            if let Some(buf) = reserve(&mut state, cost, limit) {
                let i = state.next;
                state.next += 1;
                break (i, buf);
            }
            state = shared.wait(state);
        };
        drop(state);
        let before = buf.capacity() as u64;
        // A panic in a read becomes that job's error, so the writer never waits for it forever.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            jobs[i].run(&mut reader, &mut buf)
        }))
        .unwrap_or_else(|_| {
            Err(anyhow!(
                "{}: reading the tensor panicked",
                jobs[i].entry.key
            ))
        });
        let mut state = shared.lock();
        // Account for what the read really allocated (a reused buffer may have grown).
        let after = buf.capacity() as u64;
        state.held_bytes = state
            .held_bytes
            .saturating_add(after.saturating_sub(before))
            .saturating_sub(before.saturating_sub(after));
        let result = match result {
            Ok(n) => Ok((buf, n)),
            Err(e) => {
                state.held_bytes = state.held_bytes.saturating_sub(after);
                Err(e)
            }
        };
        state.done.insert(i, result);
        drop(state);
        shared.changed.notify_all();
    }
}

/// A buffer of at least `cost` bytes' capacity for the next job, if the limit allows: a pooled
/// buffer is reused (grown when needed); pooled buffers are dropped to make room.
fn reserve(state: &mut State, cost: u64, limit: u64) -> Option<Vec<u8>> {
    // Largest pooled buffer first: the most likely to fit without growing.
    state.pool.sort_by_key(Vec::capacity);
    let mut buf = state.pool.pop().unwrap_or_default();
    loop {
        let have = buf.capacity() as u64;
        let need = cost.saturating_sub(have);
        if state.held_bytes.saturating_add(need) <= limit {
            let Ok(extra) = usize::try_from(cost) else {
                state.pool.push(buf);
                return None;
            };
            // The length is kept: a job that overwrites every byte it returns (a slab range) then
            // reuses the initialised bytes instead of zeroing the buffer again (a memset of every
            // piece was 9% of a ZeRO-3 conversion's CPU); the others start from an empty buffer
            // (`Job::run`).
            buf.reserve_exact(extra.saturating_sub(buf.len()));
            state.held_bytes = state
                .held_bytes
                .saturating_add((buf.capacity() as u64).saturating_sub(have));
            return Some(buf);
        }
        if let Some(other) = state.pool.first() {
            // Drop the smallest pooled buffer to make room.
            let cap = other.capacity() as u64;
            state.pool.remove(0);
            state.held_bytes = state.held_bytes.saturating_sub(cap);
        } else if have > 0 {
            // Too small and no room to grow: free it and start from nothing.
            state.held_bytes = state.held_bytes.saturating_sub(have);
            buf = Vec::new();
        } else {
            return None;
        }
    }
}

/// `--threads N`: at least one.
pub fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}` is not a thread count (1 or more)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_stay_within_the_limit_and_reuse_buffers() {
        let mut state = State::default();
        let a = reserve(&mut state, 100, 250).unwrap();
        assert!(a.capacity() >= 100);
        let b = reserve(&mut state, 100, 250).unwrap();
        assert!(
            reserve(&mut state, 100, 250).is_none(),
            "a third would pass 250"
        );
        assert!(state.held_bytes <= 250);
        // A returned buffer is reused without growing the total.
        state.pool.push(a);
        let held = state.held_bytes;
        let c = reserve(&mut state, 80, 250).unwrap();
        assert_eq!(state.held_bytes, held);
        // A larger job drops pooled buffers to make room.
        state.pool.push(c);
        state.pool.push(b);
        let d = reserve(&mut state, 240, 250).unwrap();
        assert!(d.capacity() >= 240);
        assert!(state.held_bytes <= 250, "{}", state.held_bytes);
    }

    #[test]
    fn thread_counts_parse() {
        assert_eq!(parse_threads("4"), Ok(4));
        assert!(parse_threads("0").is_err());
        assert!(parse_threads("x").is_err());
        assert!(ExecOptions::default_threads() >= 1);
    }
}
