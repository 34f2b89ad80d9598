//! The `cpu` backend: N ranks as threads of one process, each running the [engine](super::engine)
//! on a [`CpuDevice`].
//!
//! Each rank owns its buffers (host memory). At the all-gather a rank publishes its input in its own
//! slot of an [`Exchange`], and after a barrier every rank copies every peer's slot of its shard group
//! into its own output buffer (a real exchange: each rank receives `(n−1) × input` bytes, as an
//! all-gather does). A second barrier keeps a slot alive until every peer has read it.
//!
//! A failing rank does not leave the others stuck at a barrier: every barrier also ORs a "failed"
//! flag, and all ranks stop together.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Instant;

use crate::gather::engine::{self, Device, Job, RankResult, Timer};
use crate::gather::plan::GatherPlan;
use crate::gather::source::Source;
use crate::gather::{GatherError, GatherOptions, GatherOutcome, Observer, Summary, VerifyReport};
use crate::trace::{Clock, Trace};

/// Most ranks the cpu backend runs (one thread each).
pub(crate) const MAX_RANKS: u64 = 4096;

/// A barrier that also returns whether any participant reported a failure in this round.
#[derive(Debug)]
pub(crate) struct FailBarrier {
    n: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    failed_now: bool,
    failed_last: bool,
}

impl FailBarrier {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            n,
            state: Mutex::new(BarrierState::default()),
            cv: Condvar::new(),
        }
    }

    /// Waits for all participants; true when any of them passed `failed = true` in this round.
    pub(crate) fn wait(&self, failed: bool) -> bool {
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.failed_now |= failed;
        st.arrived += 1;
        if st.arrived == self.n {
            st.arrived = 0;
            st.generation += 1;
            st.failed_last = st.failed_now;
            st.failed_now = false;
            self.cv.notify_all();
            return st.failed_last;
        }
        let generation = st.generation;
        while st.generation == generation {
            st = self
                .cv
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        st.failed_last
    }
}

/// The in-process all-gather among rank threads: one slot per rank and a [`FailBarrier`].
#[derive(Debug)]
pub(crate) struct Exchange<T> {
    barrier: FailBarrier,
    slots: Vec<RwLock<Option<T>>>,
}

impl<T> Exchange<T> {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            barrier: FailBarrier::new(n),
            slots: (0..n).map(|_| RwLock::new(None)).collect(),
        }
    }

    /// Rank `rank`'s turn in an all-gather, as a rank that failed: every rank stops.
    pub(crate) fn fail(&self) {
        self.barrier.wait(true);
    }

    /// Publishes `mine` as rank `rank`'s input, waits for every rank, hands `f` the inputs of ranks
    /// `group` in order, and waits again until every rank has read. `None`, without calling `f`,
    /// when some rank failed.
    pub(crate) fn all_gather<R>(
        &self,
        rank: usize,
        group: Range<usize>,
        mine: T,
        f: impl FnOnce(&[&T]) -> R,
    ) -> Option<R> {
        *self.slots[rank]
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(mine);
        let out = if self.barrier.wait(false) {
            None
        } else {
            let guards: Vec<_> = self.slots[group]
                .iter()
                .map(|s| s.read().unwrap_or_else(std::sync::PoisonError::into_inner))
                .collect();
            // Every rank published before the barrier.
            let peers: Vec<&T> = guards.iter().filter_map(|g| g.as_ref()).collect();
            let out = f(&peers);
            drop(peers);
            drop(guards);
            self.barrier.wait(false);
            Some(out)
        };
        *self.slots[rank]
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        out
    }
}

/// The `cpu` backend's device: host memory, and the exchange among rank threads as the all-gather.
/// A buffer is shared with the peers only while they read it during an all-gather.
#[derive(Debug)]
pub(crate) struct CpuDevice<'x> {
    pub(crate) exchange: &'x Exchange<Arc<Vec<u8>>>,
    pub(crate) rank: usize,
    /// The global ranks of this rank's shard group.
    pub(crate) group: Range<usize>,
    /// The common origin of the rank threads' timelines.
    pub(crate) origin: Instant,
}

impl Device for CpuDevice<'_> {
    type Buffer = Arc<Vec<u8>>;
    type Stamp = f64;
    const CLOCK: Clock = Clock::Host;

    fn alloc(&mut self, len: usize) -> Result<Self::Buffer, GatherError> {
        Ok(Arc::new(vec![0; len]))
    }

    fn len(buf: &Self::Buffer) -> usize {
        buf.len()
    }

    fn host(buf: &Self::Buffer) -> Option<&[u8]> {
        Some(buf)
    }

    fn host_mut(buf: &mut Self::Buffer) -> Option<&mut [u8]> {
        // Unshared outside an all-gather, so this does not copy.
        Some(Arc::make_mut(buf).as_mut_slice())
    }

    fn upload(
        &mut self,
        src: &[u8],
        dst: &mut Self::Buffer,
        offset: usize,
    ) -> Result<(), GatherError> {
        Arc::make_mut(dst).as_mut_slice()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy(
        &mut self,
        src: &Self::Buffer,
        src_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), GatherError> {
        Arc::make_mut(dst).as_mut_slice()[dst_offset..dst_offset + len]
            .copy_from_slice(&src[src_offset..src_offset + len]);
        Ok(())
    }

    fn all_gather(
        &mut self,
        input: &Self::Buffer,
        in_len: usize,
        output: &mut Self::Buffer,
    ) -> Result<bool, GatherError> {
        let out = Arc::make_mut(output).as_mut_slice();
        let done =
            self.exchange
                .all_gather(self.rank, self.group.clone(), Arc::clone(input), |peers| {
                    for (i, peer) in peers.iter().enumerate() {
                        out[i * in_len..(i + 1) * in_len].copy_from_slice(&peer[..in_len]);
                    }
                    peers.len()
                });
        match done {
            None => Ok(false),
            Some(n) if n == self.group.len() => Ok(true),
            Some(n) => Err(GatherError::Device(format!(
                "all-gather: {n} of {} ranks published an input",
                self.group.len()
            ))),
        }
    }

    fn fail(&mut self) {
        self.exchange.fail();
    }

    fn download(
        &mut self,
        src: &Self::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, GatherError> {
        Ok(src[offset..offset + len].to_vec())
    }

    fn stamp(&mut self) -> Result<f64, GatherError> {
        Ok(self.origin.elapsed().as_secs_f64() * 1e6)
    }

    fn synchronize(&mut self) -> Result<(), GatherError> {
        Ok(())
    }

    fn span_us(&self, start: &f64, end: &f64) -> Result<(f64, f64), GatherError> {
        Ok((*start, end - start))
    }
}

/// Runs the gather with `plan.world_size` threads.
pub fn run(
    plan: &GatherPlan,
    source: &Source,
    options: GatherOptions,
    observer: &dyn Observer,
) -> Result<GatherOutcome, GatherError> {
    let exchange = Exchange::new(thread_count(plan)?);
    let job = Job {
        plan,
        source,
        options,
        observer,
    };
    run_threads(&job, "cpu", |rank, origin| CpuDevice {
        exchange: &exchange,
        rank: rank as usize,
        group: group_of(plan, rank),
        origin,
    })
}

/// The number of rank threads `plan` needs, within [`MAX_RANKS`].
pub(crate) fn thread_count(plan: &GatherPlan) -> Result<usize, GatherError> {
    if plan.world_size > MAX_RANKS {
        return Err(GatherError::TooManyRanks {
            world_size: plan.world_size,
            limit: MAX_RANKS,
        });
    }
    Ok(plan.world_size as usize)
}

/// The global ranks of `rank`'s shard group.
pub(crate) fn group_of(plan: &GatherPlan, rank: u64) -> Range<usize> {
    let base = (rank - rank % plan.group_size) as usize;
    base..base + plan.group_size as usize
}

/// Runs every rank of `job` as a thread, on the device `device(rank, origin)` makes, and merges
/// their results (`backend` names the run in the trace and the summary).
pub(crate) fn run_threads<D: Device>(
    job: &Job<'_>,
    backend: &str,
    device: impl Fn(u64, Instant) -> D + Sync,
) -> Result<GatherOutcome, GatherError> {
    let plan = job.plan;
    thread_count(plan)?;
    let origin = Instant::now();
    let results: Vec<Result<RankResult, GatherError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..plan.world_size)
            .map(|rank| {
                let device = &device;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(scope, move || {
                        let mut dev = device(rank, origin);
                        engine::run_rank(job, &mut dev, rank, Timer::new(origin, rank))
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h
                    .join()
                    .map_err(|_| GatherError::Panicked { rank: rank as u64 }),
                Err(e) => Err(GatherError::Device(format!(
                    "cannot start rank thread {rank}: {e}"
                ))),
            })
            .collect()
    });
    let wall_secs = origin.elapsed().as_secs_f64();

    let mut trace = Trace {
        world_size: plan.world_size,
        spans: Vec::new(),
        metadata: vec![
            ("backend".to_owned(), backend.to_owned()),
            ("source".to_owned(), job.source.name()),
        ],
    };
    let mut verify = VerifyReport::default();
    let mut params = None;
    let mut first_error = None;
    for (rank, result) in results.into_iter().enumerate() {
        let mut result = match result {
            Ok(r) => r,
            Err(e) => {
                first_error.get_or_insert(e);
                continue;
            }
        };
        if let Some(e) = result.error.take() {
            first_error.get_or_insert(e);
        }
        trace.spans.append(&mut result.spans);
        verify.merge(result.verify);
        if rank == 0 && job.options.keep_params {
            params = Some(result.params);
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    trace.sort();
    let summary = Summary::from_trace(plan, &trace, backend, wall_secs);
    Ok(GatherOutcome {
        trace,
        summary,
        verify: job.options.verify.then_some(verify),
        params,
        writes_outputs: true,
    })
}
