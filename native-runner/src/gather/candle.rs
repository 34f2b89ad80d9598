//! The candle device of the [engine](super::engine) (feature `candle`): buffers are `u8` candle
//! tensors, copies are candle copies (`Tensor::from_slice`, `slice_set`, `narrow`, `to_vec1`), the
//! all-gather is a [`Collective`].
//!
//! The `cuda` backend runs it on a GPU with NCCL as the collective. Without a GPU the same code runs
//! on candle's CPU device with an in-process exchange among rank threads ([`run_threads`]): that is
//! how the default tests check the `cuda` backend's copy-in and copy-out against the `cpu` backend.

use std::ops::Range;
use std::time::Instant;

use candle_core::{DType, Tensor};

use crate::gather::cpu::{Exchange, group_of, run_threads as run_rank_threads};
use crate::gather::engine::{Device, Job};
use crate::gather::plan::GatherPlan;
use crate::gather::source::Source;
use crate::gather::{GatherError, GatherOptions, GatherOutcome, Observer};
use crate::trace::Clock;

pub(crate) fn candle_err(what: &str) -> impl FnOnce(candle_core::Error) -> GatherError + '_ {
    move |e| GatherError::Device(format!("{what}: {e}"))
}

/// The all-gather and the timeline of a candle device.
pub(crate) trait Collective {
    /// A point on the device's timeline.
    type Stamp;
    /// The clock of spans between stamps.
    const CLOCK: Clock;
    /// See [`Device::all_gather`].
    fn all_gather(
        &mut self,
        input: &Tensor,
        in_len: usize,
        output: &mut Tensor,
    ) -> Result<bool, GatherError>;
    /// See [`Device::fail`].
    fn fail(&mut self);
    /// `len` bytes of `src` from `src_offset` into `dst` at `dst_offset`, where the device has a
    /// faster way than candle's `slice_set` (on CUDA a byte-per-thread kernel: about a fifth of the
    /// device's copy bandwidth on an H100); `None`: the caller uses `slice_set`.
    fn copy(
        &mut self,
        _src: &Tensor,
        _src_offset: usize,
        _dst: &mut Tensor,
        _dst_offset: usize,
        _len: usize,
    ) -> Option<Result<(), GatherError>> {
        None
    }
    /// See [`Device::stamp`].
    fn stamp(&mut self) -> Result<Self::Stamp, GatherError>;
    /// See [`Device::span_us`].
    fn span_us(&self, start: &Self::Stamp, end: &Self::Stamp) -> Result<(f64, f64), GatherError>;
}

/// A candle device and the collective among the ranks.
#[derive(Debug)]
pub(crate) struct CandleDevice<C> {
    pub(crate) device: candle_core::Device,
    pub(crate) collective: C,
}

impl<C: Collective> Device for CandleDevice<C> {
    type Buffer = Tensor;
    type Stamp = C::Stamp;
    const CLOCK: Clock = C::CLOCK;

    fn alloc(&mut self, len: usize) -> Result<Tensor, GatherError> {
        Tensor::zeros(len, DType::U8, &self.device).map_err(candle_err("alloc"))
    }

    fn len(buf: &Tensor) -> usize {
        buf.elem_count()
    }

    fn upload(&mut self, src: &[u8], dst: &mut Tensor, offset: usize) -> Result<(), GatherError> {
        let t = Tensor::from_slice(src, src.len(), &self.device)
            .map_err(candle_err("host-to-device"))?;
        if offset == 0 && src.len() == dst.elem_count() {
            *dst = t;
            return Ok(());
        }
        dst.slice_set(&t, 0, offset)
            .map_err(candle_err("host-to-device"))
    }

    fn copy(
        &mut self,
        src: &Tensor,
        src_offset: usize,
        dst: &mut Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), GatherError> {
        if len == 0 {
            return Ok(());
        }
        if let Some(done) = self.collective.copy(src, src_offset, dst, dst_offset, len) {
            return done;
        }
        let piece = src.narrow(0, src_offset, len).map_err(candle_err("copy"))?;
        dst.slice_set(&piece, 0, dst_offset)
            .map_err(candle_err("copy"))
    }

    fn all_gather(
        &mut self,
        input: &Tensor,
        in_len: usize,
        output: &mut Tensor,
    ) -> Result<bool, GatherError> {
        self.collective.all_gather(input, in_len, output)
    }

    fn fail(&mut self) {
        self.collective.fail();
    }

    fn download(
        &mut self,
        src: &Tensor,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, GatherError> {
        src.narrow(0, offset, len)
            .and_then(|t| t.to_vec1::<u8>())
            .map_err(candle_err("device-to-host"))
    }

    fn stamp(&mut self) -> Result<C::Stamp, GatherError> {
        self.collective.stamp()
    }

    fn synchronize(&mut self) -> Result<(), GatherError> {
        self.device.synchronize().map_err(candle_err("synchronize"))
    }

    fn span_us(&self, start: &C::Stamp, end: &C::Stamp) -> Result<(f64, f64), GatherError> {
        self.collective.span_us(start, end)
    }
}

/// The all-gather among rank threads of one process, over candle tensors (host clock).
#[derive(Debug)]
pub(crate) struct ThreadExchange<'x> {
    exchange: &'x Exchange<Tensor>,
    rank: usize,
    group: Range<usize>,
    origin: Instant,
}

impl Collective for ThreadExchange<'_> {
    type Stamp = f64;
    const CLOCK: Clock = Clock::Host;

    fn all_gather(
        &mut self,
        input: &Tensor,
        in_len: usize,
        output: &mut Tensor,
    ) -> Result<bool, GatherError> {
        let mine = input
            .narrow(0, 0, in_len)
            .map_err(candle_err("all-gather"))?;
        let n = self.group.len();
        let out: &Tensor = output;
        // Like NCCL: every peer's input straight into this rank's output buffer, in group order.
        let done = self
            .exchange
            .all_gather(self.rank, self.group.clone(), mine, |peers| {
                if peers.len() != n {
                    return Err(GatherError::Device(format!(
                        "all-gather: {} of {n} ranks published an input",
                        peers.len()
                    )));
                }
                if in_len == 0 {
                    return Ok(());
                }
                for (i, peer) in peers.iter().enumerate() {
                    out.slice_set(peer, 0, i * in_len)
                        .map_err(candle_err("all-gather"))?;
                }
                Ok(())
            });
        match done {
            None => Ok(false),
            Some(done) => done.map(|()| true),
        }
    }

    fn fail(&mut self) {
        self.exchange.fail();
    }

    fn stamp(&mut self) -> Result<f64, GatherError> {
        Ok(self.origin.elapsed().as_secs_f64() * 1e6)
    }

    fn span_us(&self, start: &f64, end: &f64) -> Result<(f64, f64), GatherError> {
        Ok((*start, end - start))
    }
}

/// Runs the gather on candle's CPU device, every rank a thread, the all-gather an in-process
/// exchange: the `cuda` backend's engine and copy code without a GPU or NCCL. The trace and summary
/// name the backend `candle-cpu`.
pub fn run_threads(
    plan: &GatherPlan,
    source: &Source,
    options: GatherOptions,
    observer: &dyn Observer,
) -> Result<GatherOutcome, GatherError> {
    let exchange = Exchange::new(crate::gather::cpu::thread_count(plan)?);
    let job = Job {
        plan,
        source,
        options,
        observer,
    };
    run_rank_threads(&job, "candle-cpu", |rank, origin| CandleDevice {
        device: candle_core::Device::Cpu,
        collective: ThreadExchange {
            exchange: &exchange,
            rank: rank as usize,
            group: group_of(plan, rank),
            origin,
        },
    })
}
