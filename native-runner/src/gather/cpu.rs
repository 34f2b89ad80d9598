//! The `cpu` backend: N ranks as threads of one process.
//!
//! Each rank owns its buffers. Per unit, a rank loads its padded shards, copies them into its
//! all-gather input (FSDP2; for FSDP1 the flat shard is the input), publishes the input in its own
//! slot, and after a barrier every rank copies every peer's slot of its shard group into its own
//! output buffer (a real exchange: each rank receives `(n−1) × input` bytes, as an all-gather does).
//! A second barrier keeps a slot alive until every peer has read it. Each rank then copies the
//! output out into the original parameters and, with `--verify`, compares them with the checkpoint.
//!
//! A failing rank does not leave the others stuck at a barrier: every barrier also ORs a "failed"
//! flag, and all ranks stop together.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, RwLock};
use std::time::Instant;

use crate::gather::plan::{
    FillKind, GatherPlan, ParamPlan, ShardPlan, UnitPlan, padding_value_bytes,
};
use crate::gather::source::Source;
use crate::gather::{
    GatherError, GatherOptions, GatherOutcome, GatheredParam, Observer, Summary, VerifyReport,
    compare,
};
use crate::trace::{Clock, Span, Trace, names};

/// Most ranks the cpu backend runs (one thread each).
pub const MAX_RANKS: u64 = 4096;

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

fn usize_of(bytes: u64, unit: &UnitPlan) -> Result<usize, GatherError> {
    usize::try_from(bytes).map_err(|_| GatherError::TooLarge {
        unit: unit.display_name().to_owned(),
        bytes,
    })
}

fn range(offset: u64, len: u64) -> std::ops::Range<usize> {
    // Offsets come from a plan whose buffers were allocated with `usize_of`, so they fit.
    offset as usize..(offset + len) as usize
}

/// Fills one padded shard of global rank `rank` into `dst` (`dst.len() == shard.padded_bytes`).
/// Returns the bytes read from the source.
pub(crate) fn load_shard(
    source: &Source,
    unit: &UnitPlan,
    shard: &ShardPlan,
    rank: u64,
    group_rank: u64,
    dst: &mut [u8],
) -> Result<u64, GatherError> {
    let source_err = |source| GatherError::Source {
        rank,
        unit: unit.display_name().to_owned(),
        source: Box::new(source),
    };
    match source {
        Source::Full(full) => {
            let mut read = 0u64;
            let pad = padding_value_bytes(shard.dtype);
            for fill in &shard.fills[group_rank as usize] {
                let out = &mut dst[range(fill.dst_offset, fill.len)];
                match fill.kind {
                    FillKind::Param { param, src_offset } => {
                        full.read_full(&unit.params[param].fqn, src_offset, out)
                            .map_err(source_err)?;
                        read += fill.len;
                    }
                    FillKind::Padding => {
                        for chunk in out.chunks_exact_mut(pad.len()) {
                            chunk.copy_from_slice(&pad);
                        }
                    }
                    FillKind::Zeros => out.fill(0),
                }
            }
            Ok(read)
        }
        Source::PerRank(ranks) => {
            let local = ranks
                .read_local(rank, &shard.key, shard.dtype)
                .map_err(source_err)?;
            let expected = shard.local_bytes[group_rank as usize];
            let Some(bytes) = local else {
                if expected == 0 {
                    dst.fill(0);
                    return Ok(0);
                }
                return Err(source_err(crate::gather::SourceError::Missing {
                    source_name: ranks.name(),
                    key: format!("rank {rank}: {}", shard.key),
                }));
            };
            let found = bytes.len() as u64;
            if found != expected && found != shard.padded_bytes {
                return Err(GatherError::ShardSize {
                    rank,
                    key: shard.key.clone(),
                    source_name: ranks.name(),
                    found_bytes: found,
                    local_bytes: expected,
                    padded_bytes: shard.padded_bytes,
                });
            }
            dst[..bytes.len()].copy_from_slice(&bytes);
            dst[bytes.len()..].fill(0);
            Ok(found)
        }
    }
}

/// The checkpoint's value of a parameter, for `--verify`: the full tensor of a full source, or the
/// parameter assembled from the rank-local tensors of group `group_base..` through the shard
/// metadata. `None` when the source has no reference for it.
pub(crate) fn reference(
    source: &Source,
    unit: &UnitPlan,
    param: &ParamPlan,
    rank: u64,
    group_base: u64,
) -> Result<Option<Vec<u8>>, GatherError> {
    let source_err = |source| GatherError::Source {
        rank,
        unit: unit.display_name().to_owned(),
        source: Box::new(source),
    };
    let mut want = vec![0u8; usize_of(param.bytes, unit)?];
    match source {
        Source::Full(full) => {
            if !full.contains(&param.fqn) {
                return Ok(None);
            }
            full.read_full(&param.fqn, 0, &mut want)
                .map_err(source_err)?;
        }
        Source::PerRank(ranks) => {
            if let Some(done) = ranks.read_reference(&param.fqn, &mut want) {
                done.map_err(source_err)?;
                return Ok(Some(want));
            }
            for r in &param.from_shards {
                let shard = &unit.shards[r.shard];
                let local = ranks
                    .read_local(group_base + r.group_rank, &shard.key, shard.dtype)
                    .map_err(source_err)?;
                let Some(bytes) = local else {
                    return Ok(None);
                };
                let Some(src) = bytes.get(range(r.copy.src_offset, r.copy.len)) else {
                    return Ok(None);
                };
                want[range(r.copy.dst_offset, r.copy.len)].copy_from_slice(src);
            }
        }
    }
    Ok(Some(want))
}

/// The per-rank timing helper: spans relative to a common origin.
pub(crate) struct Timer {
    origin: Instant,
    rank: u64,
    pub spans: Vec<Span>,
}

impl Timer {
    pub(crate) fn new(origin: Instant, rank: u64) -> Self {
        Self {
            origin,
            rank,
            spans: Vec::new(),
        }
    }

    pub(crate) fn now_us(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * 1e6
    }

    /// Runs `f` and records it as a host span.
    pub(crate) fn time<T>(
        &mut self,
        name: &'static str,
        unit: &UnitPlan,
        bytes: u64,
        f: impl FnOnce() -> T,
    ) -> T {
        let start = self.now_us();
        let out = f();
        let end = self.now_us();
        self.push(
            name,
            Clock::Host,
            start,
            end - start,
            unit.display_name(),
            bytes,
            unit.dtype_label(),
        );
        out
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &mut self,
        name: &'static str,
        clock: Clock,
        start_us: f64,
        dur_us: f64,
        unit: &str,
        bytes: u64,
        dtype: String,
    ) {
        self.spans.push(Span {
            rank: self.rank,
            name,
            clock,
            start_us,
            dur_us,
            unit: unit.to_owned(),
            bytes,
            dtype,
        });
    }
}

/// What one rank thread hands back.
#[derive(Default)]
struct RankResult {
    spans: Vec<Span>,
    verify: VerifyReport,
    params: BTreeMap<String, GatheredParam>,
    error: Option<GatherError>,
}

struct Shared<'a> {
    plan: &'a GatherPlan,
    source: &'a Source,
    options: GatherOptions,
    observer: &'a dyn Observer,
    barrier: FailBarrier,
    /// Every rank's published all-gather input.
    slots: Vec<RwLock<Vec<u8>>>,
    origin: Instant,
}

/// Runs the gather with `plan.world_size` threads.
pub fn run(
    plan: &GatherPlan,
    source: &Source,
    options: GatherOptions,
    observer: &dyn Observer,
) -> Result<GatherOutcome, GatherError> {
    if plan.world_size > MAX_RANKS {
        return Err(GatherError::TooManyRanks {
            world_size: plan.world_size,
            limit: MAX_RANKS,
        });
    }
    let n = plan.world_size as usize;
    let shared = Shared {
        plan,
        source,
        options,
        observer,
        barrier: FailBarrier::new(n),
        slots: (0..n).map(|_| RwLock::new(Vec::new())).collect(),
        origin: Instant::now(),
    };
    let results: Vec<Result<RankResult, GatherError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..plan.world_size)
            .map(|rank| {
                let shared = &shared;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(scope, move || rank_main(shared, rank))
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
    let wall_secs = shared.origin.elapsed().as_secs_f64();

    let mut trace = Trace {
        world_size: plan.world_size,
        spans: Vec::new(),
        metadata: vec![
            ("backend".to_owned(), "cpu".to_owned()),
            ("source".to_owned(), source.name()),
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
        if rank == 0 && options.keep_params {
            params = Some(result.params);
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    trace.sort();
    let summary = Summary::from_trace(plan, &trace, "cpu", wall_secs);
    Ok(GatherOutcome {
        trace,
        summary,
        verify: options.verify.then_some(verify),
        params,
        writes_outputs: true,
    })
}

/// A rank's buffers, reused from unit to unit (every byte of them is rewritten before it is read,
/// so they are never cleared; reuse avoids paying page faults on every unit).
#[derive(Default)]
struct Scratch {
    shards: Vec<Vec<u8>>,
    output: Vec<u8>,
    params: Vec<Vec<u8>>,
}

/// The first `len` bytes of `buf`, growing it when needed.
fn take(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

fn rank_main(shared: &Shared<'_>, rank: u64) -> RankResult {
    let plan = shared.plan;
    let n = plan.group_size;
    let group_rank = rank % n;
    let group_base = rank - group_rank;
    let mut timer = Timer::new(shared.origin, rank);
    let mut result = RankResult::default();
    let mut error: Option<GatherError> = None;
    let mut scratch = Scratch::default();

    for (unit_index, unit) in plan.units.iter().enumerate() {
        // 1. read + copy-in, straight into this rank's published slot.
        if error.is_none()
            && let Err(e) =
                load_and_copy_in(shared, unit, rank, group_rank, &mut scratch, &mut timer)
        {
            error = Some(e);
        }
        if shared.barrier.wait(error.is_some()) {
            break;
        }
        // 2. all-gather: receive every peer's input into this rank's own output.
        let out_len = match usize_of(unit.output_bytes(n), unit) {
            Ok(len) => len,
            Err(e) => {
                error = Some(e);
                0
            }
        };
        let output = take(&mut scratch.output, out_len);
        if error.is_none() {
            timer.time(names::ALL_GATHER, unit, unit.output_bytes(n), || {
                let in_len = unit.input_bytes as usize;
                for peer in 0..n {
                    let slot = shared.slots[(group_base + peer) as usize]
                        .read()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let at = peer as usize * in_len;
                    output[at..at + in_len].copy_from_slice(&slot[..in_len]);
                }
            });
        }
        if shared.barrier.wait(error.is_some()) {
            break;
        }
        shared.observer.all_gather_output(rank, unit, output);
        // 3. copy-out, verify, keep.
        if let Err(e) = copy_out_and_check(
            shared,
            unit,
            rank,
            group_base,
            &scratch.output[..out_len],
            &mut scratch.params,
            &mut timer,
            &mut result,
        ) {
            error = Some(e);
        }
        shared.observer.unit_done(rank, unit_index);
    }
    result.spans = timer.spans;
    result.error = error;
    result
}

fn load_and_copy_in(
    shared: &Shared<'_>,
    unit: &UnitPlan,
    rank: u64,
    group_rank: u64,
    scratch: &mut Scratch,
    timer: &mut Timer,
) -> Result<(), GatherError> {
    let flat = is_flat(shared.plan);
    let input_len = usize_of(unit.input_bytes, unit)?;
    let mut slot = shared.slots[rank as usize]
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let input = take(&mut slot, input_len);
    // read: every padded shard this rank holds for the unit. FSDP1's flat shard is the all-gather
    // input itself, so it is loaded in place.
    let start = timer.now_us();
    let mut read_bytes = 0u64;
    if flat {
        for shard in &unit.shards {
            let dst = &mut input[range(shard.input_offset, shard.padded_bytes)];
            read_bytes += load_shard(shared.source, unit, shard, rank, group_rank, dst)?;
            shared.observer.shard(rank, unit, shard, dst);
        }
    } else {
        if scratch.shards.len() < unit.shards.len() {
            scratch.shards.resize_with(unit.shards.len(), Vec::new);
        }
        for (shard, buf) in unit.shards.iter().zip(scratch.shards.iter_mut()) {
            let dst = take(buf, usize_of(shard.padded_bytes, unit)?);
            read_bytes += load_shard(shared.source, unit, shard, rank, group_rank, dst)?;
            shared.observer.shard(rank, unit, shard, dst);
        }
    }
    let end = timer.now_us();
    timer.push(
        names::READ,
        Clock::Host,
        start,
        end - start,
        unit.display_name(),
        read_bytes,
        unit.dtype_label(),
    );
    // copy-in (FSDP2's `all_gather_copy_in`): the padded shards of the group, in order, into one
    // input buffer.
    if !flat {
        timer.time(names::COPY_IN, unit, unit.input_bytes, || {
            for (shard, buf) in unit.shards.iter().zip(&scratch.shards) {
                input[range(shard.input_offset, shard.padded_bytes)]
                    .copy_from_slice(&buf[..shard.padded_bytes as usize]);
            }
        });
    }
    shared.observer.all_gather_input(rank, unit, input);
    Ok(())
}

fn is_flat(plan: &GatherPlan) -> bool {
    plan.api == shardscope_core::layout::Api::Fsdp1
}

#[allow(clippy::too_many_arguments)] // one rank's whole per-unit state
fn copy_out_and_check(
    shared: &Shared<'_>,
    unit: &UnitPlan,
    rank: u64,
    group_base: u64,
    output: &[u8],
    scratch: &mut Vec<Vec<u8>>,
    timer: &mut Timer,
    result: &mut RankResult,
) -> Result<(), GatherError> {
    if scratch.len() < unit.params.len() {
        scratch.resize_with(unit.params.len(), Vec::new);
    }
    let mut params: Vec<&mut [u8]> = Vec::with_capacity(unit.params.len());
    for (p, buf) in unit.params.iter().zip(scratch.iter_mut()) {
        params.push(take(buf, usize_of(p.bytes, unit)?));
    }
    timer.time(names::COPY_OUT, unit, unit.param_bytes(), || {
        for (p, buf) in unit.params.iter().zip(params.iter_mut()) {
            for c in &p.copy_out {
                buf[range(c.dst_offset, c.len)]
                    .copy_from_slice(&output[range(c.src_offset, c.len)]);
            }
        }
    });
    for (p, buf) in unit.params.iter().zip(&params) {
        shared.observer.param(rank, p, buf);
    }
    if shared.options.verify {
        let start = timer.now_us();
        let mut compared = 0u64;
        for (p, buf) in unit.params.iter().zip(&params) {
            match reference(shared.source, unit, p, rank, group_base)? {
                Some(want) => {
                    result.verify.checks += 1;
                    compared += p.bytes;
                    if let Some(m) = compare(rank, &p.fqn, p.dtype.size_bytes(), buf, &want) {
                        result.verify.mismatches.push(m);
                    }
                }
                None => result.verify.unchecked.push(p.fqn.clone()),
            }
        }
        // Tied aliases stored under their own name must equal the primary.
        if let Source::Full(full) = shared.source {
            for (alias, primary) in &shared.plan.aliases {
                let Some(i) = unit.params.iter().position(|p| &p.fqn == primary) else {
                    continue;
                };
                if !full.contains(alias) {
                    continue;
                }
                let mut want = vec![0u8; params[i].len()];
                full.read_full(alias, 0, &mut want)
                    .map_err(|source| GatherError::Source {
                        rank,
                        unit: unit.display_name().to_owned(),
                        source: Box::new(source),
                    })?;
                result.verify.checks += 1;
                compared += unit.params[i].bytes;
                if let Some(m) = compare(
                    rank,
                    alias,
                    unit.params[i].dtype.size_bytes(),
                    params[i],
                    &want,
                ) {
                    result.verify.mismatches.push(m);
                }
            }
        }
        result.verify.bytes_compared += compared;
        let end = timer.now_us();
        timer.push(
            names::VERIFY,
            Clock::Host,
            start,
            end - start,
            unit.display_name(),
            compared,
            unit.dtype_label(),
        );
    }
    if shared.options.keep_params && rank == 0 {
        for (p, buf) in unit.params.iter().zip(params) {
            for (alias, primary) in &shared.plan.aliases {
                if primary == &p.fqn {
                    result
                        .params
                        .insert(alias.clone(), gathered(p, buf.to_vec()));
                }
            }
            result
                .params
                .insert(p.fqn.clone(), gathered(p, buf.to_vec()));
        }
    }
    Ok(())
}

fn gathered(p: &ParamPlan, bytes: Vec<u8>) -> GatheredParam {
    GatheredParam {
        dtype: p.dtype,
        shape: p.shape.clone(),
        bytes,
    }
}
