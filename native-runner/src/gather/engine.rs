//! The per-rank gather loop, written once for every backend.
//!
//! Per unit a rank loads its padded shards on the host (`read`), puts them on its device
//! (`host-to-device`, skipped when the device's memory is the host's), copies them into its
//! all-gather input exactly as FSDP lays it out (`copy-in`, FSDP2; FSDP1's flat shard is the input),
//! all-gathers (`all-gather`), copies the output out into the original parameters (`copy-out`),
//! brings them to the host (`device-to-host`, again only for a device with its own memory) and, with
//! `--verify`, compares them with the checkpoint (`verify`).
//!
//! What differs between backends is a [`Device`]: allocation, copies and the collective. The `cpu`
//! backend's device is host memory with an in-process exchange among rank threads; the `cuda`
//! backend's is candle tensors on a GPU with NCCL.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::gather::plan::{
    FillKind, GatherPlan, ParamPlan, ShardPlan, UnitPlan, padding_value_bytes,
};
use crate::gather::source::Source;
use crate::gather::{GatherError, GatherOptions, GatheredParam, Observer, VerifyReport, compare};
use crate::trace::{Clock, Span, names};

/// One rank's device, as the engine uses it. Buffers are byte buffers; offsets and lengths are bytes.
pub(crate) trait Device {
    /// A buffer of device memory.
    type Buffer;
    /// A point on the device's timeline (host time, or a CUDA event).
    type Stamp;
    /// The clock of the spans measured between two stamps.
    const CLOCK: Clock;

    /// A buffer of at least `len` bytes (contents unspecified).
    fn alloc(&mut self, len: usize) -> Result<Self::Buffer, GatherError>;
    /// The buffer's length in bytes.
    fn len(buf: &Self::Buffer) -> usize;
    /// The buffer's bytes when the device's memory is the host's: the engine then reads shards
    /// straight into it and checks parameters straight from it (no upload, no download).
    fn host(_buf: &Self::Buffer) -> Option<&[u8]> {
        None
    }
    /// [`Device::host`], writable.
    fn host_mut(_buf: &mut Self::Buffer) -> Option<&mut [u8]> {
        None
    }
    /// Copies host bytes into `dst` at `offset` (host to device).
    fn upload(
        &mut self,
        src: &[u8],
        dst: &mut Self::Buffer,
        offset: usize,
    ) -> Result<(), GatherError>;
    /// Copies `len` bytes of `src` at `src_offset` into `dst` at `dst_offset` (on the device).
    fn copy(
        &mut self,
        src: &Self::Buffer,
        src_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), GatherError>;
    /// The all-gather of one unit, a collective of the shard group: the first `in_len` bytes of every
    /// group rank's `input`, in group-rank order, into the start of `output` (at least `n × in_len`
    /// bytes; the device may replace it by another buffer of at least that size). `Ok(false)`, with
    /// nothing gathered, when another rank called [`Device::fail`] instead: every rank then stops.
    fn all_gather(
        &mut self,
        input: &Self::Buffer,
        in_len: usize,
        output: &mut Self::Buffer,
    ) -> Result<bool, GatherError>;
    /// Takes this rank's turn in the next collective without data: it failed and stops.
    fn fail(&mut self);
    /// Copies `len` bytes of `src` at `offset` to the host (device to host).
    fn download(
        &mut self,
        src: &Self::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, GatherError>;
    /// Marks the current point of the device's work.
    fn stamp(&mut self) -> Result<Self::Stamp, GatherError>;
    /// Waits for the device's queued work.
    fn synchronize(&mut self) -> Result<(), GatherError>;
    /// Start (since the common origin) and duration in µs of the work between two stamps, once
    /// synchronized.
    fn span_us(&self, start: &Self::Stamp, end: &Self::Stamp) -> Result<(f64, f64), GatherError>;
}

/// What every rank runs.
#[derive(Clone, Copy)]
pub(crate) struct Job<'a> {
    pub(crate) plan: &'a GatherPlan,
    pub(crate) source: &'a Source,
    pub(crate) options: GatherOptions,
    pub(crate) observer: &'a dyn Observer,
}

/// What one rank hands back.
#[derive(Default)]
pub(crate) struct RankResult {
    pub(crate) spans: Vec<Span>,
    pub(crate) verify: VerifyReport,
    pub(crate) params: BTreeMap<String, GatheredParam>,
    pub(crate) error: Option<GatherError>,
}

pub(crate) fn usize_of(bytes: u64, unit: &UnitPlan) -> Result<usize, GatherError> {
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
    pub(crate) spans: Vec<Span>,
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

    /// Records a host span from `start` (µs since the origin) to now.
    fn host_since(&mut self, name: &'static str, start: f64, unit: &UnitPlan, bytes: u64) {
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

/// A device span waiting for the device to finish.
struct Pending<S> {
    name: &'static str,
    start: S,
    end: S,
    bytes: u64,
}

/// A rank's buffers, reused from unit to unit (every byte used is rewritten before it is read, so
/// they are never cleared; reuse avoids paying page faults or allocations on every unit).
struct Scratch<B> {
    /// Host staging of the shards, for a device with its own memory.
    host: Vec<Vec<u8>>,
    shards: Vec<Option<B>>,
    input: Option<B>,
    output: Option<B>,
    params: Vec<Option<B>>,
}

impl<B> Default for Scratch<B> {
    fn default() -> Self {
        Self {
            host: Vec::new(),
            shards: Vec::new(),
            input: None,
            output: None,
            params: Vec::new(),
        }
    }
}

/// `slot`'s buffer, (re)allocated when missing or shorter than `len`.
fn ensure<'b, D: Device>(
    dev: &mut D,
    slot: &'b mut Option<D::Buffer>,
    len: usize,
) -> Result<&'b mut D::Buffer, GatherError> {
    if slot.as_ref().is_none_or(|b| D::len(b) < len) {
        *slot = None;
        *slot = Some(dev.alloc(len)?);
    }
    slot.as_mut()
        .ok_or_else(|| GatherError::Device("buffer allocation".to_owned()))
}

/// Grows `v` to at least `n` entries.
fn at_least<T>(v: &mut Vec<T>, n: usize, f: impl FnMut() -> T) {
    if v.len() < n {
        v.resize_with(n, f);
    }
}

/// The rank's state through the units.
#[allow(clippy::struct_field_names)] // `rank`, `group_rank`: FSDP's words
struct Rank<'j, 'a, D: Device> {
    job: &'j Job<'a>,
    dev: &'j mut D,
    rank: u64,
    group_rank: u64,
    group_base: u64,
    timer: Timer,
    pending: Vec<Pending<D::Stamp>>,
    scratch: Scratch<D::Buffer>,
    result: RankResult,
    /// This unit's all-gather was entered (so an error must not take another turn for it).
    collective_taken: bool,
}

/// Runs rank `rank` of `job` on `dev`: every unit, in order. Errors end up in the result; a failing
/// rank makes every rank stop at the next collective.
pub(crate) fn run_rank<D: Device>(
    job: &Job<'_>,
    dev: &mut D,
    rank: u64,
    timer: Timer,
) -> RankResult {
    let group_rank = rank % job.plan.group_size;
    let mut r = Rank {
        job,
        dev,
        rank,
        group_rank,
        group_base: rank - group_rank,
        timer,
        pending: Vec::new(),
        scratch: Scratch::default(),
        result: RankResult::default(),
        collective_taken: false,
    };
    let mut error: Option<GatherError> = None;
    for (unit_index, unit) in job.plan.units.iter().enumerate() {
        if error.is_some() {
            // Tell the others at the collective they wait in.
            r.dev.fail();
            break;
        }
        // 1. read + copy-in, 2. all-gather.
        r.collective_taken = false;
        match r.copy_in(unit).and_then(|()| r.all_gather(unit)) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                error = Some(e);
                if r.collective_taken {
                    // The others are past this all-gather: they learn it at the next one.
                    continue;
                }
                r.dev.fail();
                break;
            }
        }
        // 3. copy-out, verify, keep.
        if let Err(e) = r.copy_out_and_check(unit) {
            error = Some(e);
        }
        job.observer.unit_done(rank, unit_index);
    }
    r.result.spans = r.timer.spans;
    r.result.error = error;
    r.result
}

impl<D: Device> Rank<'_, '_, D> {
    /// Records a device span that started at `start` and ends now.
    fn span(&mut self, name: &'static str, start: D::Stamp, bytes: u64) -> Result<(), GatherError> {
        let end = self.dev.stamp()?;
        self.pending.push(Pending {
            name,
            start,
            end,
            bytes,
        });
        Ok(())
    }

    /// Waits for the device and turns the pending spans into trace spans.
    fn flush(&mut self, unit: &UnitPlan) -> Result<(), GatherError> {
        self.dev.synchronize()?;
        for p in std::mem::take(&mut self.pending) {
            let (start, dur) = self.dev.span_us(&p.start, &p.end)?;
            self.timer.push(
                p.name,
                D::CLOCK,
                start,
                dur,
                unit.display_name(),
                p.bytes,
                unit.dtype_label(),
            );
        }
        Ok(())
    }

    fn copy_in(&mut self, unit: &UnitPlan) -> Result<(), GatherError> {
        let Rank {
            job,
            dev,
            rank,
            group_rank,
            timer,
            scratch,
            ..
        } = self;
        let (rank, group_rank) = (*rank, *group_rank);
        let flat = job.plan.api == shardscope_core::layout::Api::Fsdp1;
        let input = ensure(
            &mut **dev,
            &mut scratch.input,
            usize_of(unit.input_bytes, unit)?,
        )?;
        at_least(&mut scratch.shards, unit.shards.len(), || None);
        at_least(&mut scratch.host, unit.shards.len(), Vec::new);
        // read: every padded shard this rank holds for the unit, straight into device memory when it
        // is the host's. FSDP1's flat shard is the all-gather input itself, so it is loaded in place.
        let start = timer.now_us();
        let mut read_bytes = 0u64;
        for (i, shard) in unit.shards.iter().enumerate() {
            let len = usize_of(shard.padded_bytes, unit)?;
            let in_place = if flat {
                D::host_mut(input).map(|m| &mut m[shard.input_offset as usize..][..len])
            } else {
                let buf = ensure(&mut **dev, &mut scratch.shards[i], len)?;
                D::host_mut(buf).map(|m| &mut m[..len])
            };
            let mem = if let Some(mem) = in_place {
                mem
            } else {
                let h = &mut scratch.host[i];
                h.resize(len, 0);
                &mut h[..]
            };
            read_bytes += load_shard(job.source, unit, shard, rank, group_rank, mem)?;
            job.observer.shard(rank, unit, shard, mem);
        }
        timer.host_since(names::READ, start, unit, read_bytes);
        // host-to-device, for a device with its own memory.
        if D::host(input).is_none() {
            let start = dev.stamp()?;
            for (i, shard) in unit.shards.iter().enumerate() {
                let src = &scratch.host[i][..shard.padded_bytes as usize];
                if flat {
                    dev.upload(src, input, shard.input_offset as usize)?;
                } else if let Some(buf) = scratch.shards[i].as_mut() {
                    dev.upload(src, buf, 0)?;
                }
            }
            let end = dev.stamp()?;
            self.pending.push(Pending {
                name: names::HOST_TO_DEVICE,
                start,
                end,
                bytes: unit.input_bytes,
            });
        }
        // copy-in (FSDP2's `all_gather_copy_in`): the padded shards of the group, in order, into
        // one input buffer.
        if !flat {
            let Rank { dev, scratch, .. } = self;
            let input = scratch
                .input
                .as_mut()
                .ok_or_else(|| GatherError::Device("all-gather input".to_owned()))?;
            let start = dev.stamp()?;
            for (shard, slot) in unit.shards.iter().zip(&scratch.shards) {
                let src = slot
                    .as_ref()
                    .ok_or_else(|| GatherError::Device("shard buffer".to_owned()))?;
                dev.copy(
                    src,
                    0,
                    input,
                    shard.input_offset as usize,
                    shard.padded_bytes as usize,
                )?;
            }
            self.span(names::COPY_IN, start, unit.input_bytes)?;
        }
        Ok(())
    }

    fn all_gather(&mut self, unit: &UnitPlan) -> Result<bool, GatherError> {
        let n = self.job.plan.group_size;
        let in_len = usize_of(unit.input_bytes, unit)?;
        let out_len = usize_of(unit.output_bytes(n), unit)?;
        let Rank {
            job,
            dev,
            rank,
            scratch,
            ..
        } = self;
        let rank = *rank;
        let output = ensure(&mut **dev, &mut scratch.output, out_len)?;
        let input = scratch
            .input
            .as_ref()
            .ok_or_else(|| GatherError::Device("all-gather input".to_owned()))?;
        observe(job, &mut **dev, input, in_len, |b| {
            job.observer.all_gather_input(rank, unit, b);
        })?;
        let start = dev.stamp()?;
        self.collective_taken = true;
        if !dev.all_gather(input, in_len, output)? {
            return Ok(false);
        }
        self.span(names::ALL_GATHER, start, unit.output_bytes(n))?;
        let Rank {
            job, dev, scratch, ..
        } = self;
        if let Some(output) = scratch.output.as_ref() {
            observe(job, &mut **dev, output, out_len, |b| {
                job.observer.all_gather_output(rank, unit, b);
            })?;
        }
        Ok(true)
    }

    fn copy_out_and_check(&mut self, unit: &UnitPlan) -> Result<(), GatherError> {
        let Rank {
            job,
            dev,
            rank,
            group_base,
            scratch,
            ..
        } = self;
        let (rank, group_base, job) = (*rank, *group_base, *job);
        let output = scratch
            .output
            .as_ref()
            .ok_or_else(|| GatherError::Device("all-gather output".to_owned()))?;
        at_least(&mut scratch.params, unit.params.len(), || None);
        for (p, slot) in unit.params.iter().zip(scratch.params.iter_mut()) {
            ensure(&mut **dev, slot, usize_of(p.bytes, unit)?)?;
        }
        // copy-out (FSDP's `split_with_sizes_copy` / `copy_` into the original parameters).
        let start = dev.stamp()?;
        for (p, slot) in unit.params.iter().zip(scratch.params.iter_mut()) {
            let Some(buf) = slot.as_mut() else { continue };
            for c in &p.copy_out {
                dev.copy(
                    output,
                    c.src_offset as usize,
                    buf,
                    c.dst_offset as usize,
                    c.len as usize,
                )?;
            }
        }
        let end = dev.stamp()?;
        self.pending.push(Pending {
            name: names::COPY_OUT,
            start,
            end,
            bytes: unit.param_bytes(),
        });
        // device-to-host, for a device with its own memory.
        let Rank { dev, scratch, .. } = self;
        let mut downloaded: Vec<Vec<u8>> = Vec::new();
        let on_host = scratch
            .output
            .as_ref()
            .is_some_and(|b| D::host(b).is_some());
        if !on_host {
            let start = dev.stamp()?;
            for (p, slot) in unit.params.iter().zip(&scratch.params) {
                let Some(buf) = slot.as_ref() else { continue };
                downloaded.push(dev.download(buf, 0, p.bytes as usize)?);
            }
            self.span(names::DEVICE_TO_HOST, start, unit.param_bytes())?;
        }
        self.flush(unit)?;
        let params: Vec<&[u8]> = if on_host {
            unit.params
                .iter()
                .zip(&self.scratch.params)
                .filter_map(|(p, b)| Some(&D::host(b.as_ref()?)?[..p.bytes as usize]))
                .collect()
        } else {
            downloaded.iter().map(Vec::as_slice).collect()
        };
        if params.len() != unit.params.len() {
            return Err(GatherError::Device("parameter buffers".to_owned()));
        }
        check(
            job,
            &mut self.timer,
            &mut self.result,
            unit,
            rank,
            group_base,
            &params,
        )
    }
}

/// Hands a device buffer to an observer: in place when it is host memory, downloaded when the
/// observer asks for device buffers, not at all otherwise.
fn observe<D: Device>(
    job: &Job<'_>,
    dev: &mut D,
    buf: &D::Buffer,
    len: usize,
    f: impl FnOnce(&[u8]),
) -> Result<(), GatherError> {
    if let Some(host) = D::host(buf) {
        f(&host[..len]);
    } else if job.observer.wants_device_buffers() {
        f(&dev.download(buf, 0, len)?);
    }
    Ok(())
}

/// Observes, verifies and keeps the gathered parameters of a unit (host bytes).
fn check(
    job: &Job<'_>,
    timer: &mut Timer,
    result: &mut RankResult,
    unit: &UnitPlan,
    rank: u64,
    group_base: u64,
    params: &[&[u8]],
) -> Result<(), GatherError> {
    for (p, buf) in unit.params.iter().zip(params) {
        job.observer.param(rank, p, buf);
    }
    if job.options.verify {
        let start = timer.now_us();
        let mut compared = 0u64;
        for (p, buf) in unit.params.iter().zip(params) {
            match reference(job.source, unit, p, rank, group_base)? {
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
        if let Source::Full(full) = job.source {
            for (alias, primary) in &job.plan.aliases {
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
        timer.host_since(names::VERIFY, start, unit, compared);
    }
    if job.options.keep_params && rank == 0 {
        for (p, buf) in unit.params.iter().zip(params) {
            for (alias, primary) in &job.plan.aliases {
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
