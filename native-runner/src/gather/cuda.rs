//! The `cuda` backend: one process per GPU, launched like training (`torchrun` or `srun`).
//!
//! Each rank runs the [engine](super::engine) on a [`CandleDevice`] over its GPU, with [`Nccl`] as the
//! collective: this file is only the GPU's allocation, NCCL and the launch. Device spans are timed
//! with CUDA events on the rank's stream.
//!
//! NCCL's unique id goes from rank 0 to the others through [`rendezvous`] (port `MASTER_PORT + 1`, or
//! `SHARDSCOPE_RDZV_PORT`). At the end every rank's spans and verify results are all-gathered over
//! NCCL, so rank 0 writes one trace with every rank's lane; only rank 0 writes outputs.
//!
//! The binary links `libcuda` and `libnccl` dynamically (candle forces cudarc's dynamic linking): a
//! machine without them fails at start with the loader's message.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, Device, InplaceOp1, Layout, Storage, Tensor,
};
use serde::{Deserialize, Serialize};

use crate::gather::candle::{CandleDevice, Collective};
use crate::gather::engine::{self, Job, Timer};
use crate::gather::plan::GatherPlan;
use crate::gather::rendezvous::{self, LaunchEnv};
use crate::gather::source::Source;
use crate::gather::{
    GatherError, GatherOptions, GatherOutcome, Mismatch, NoObserver, Summary, VerifyReport,
};
use crate::trace::{Clock, Span, Trace, names};

const RENDEZVOUS_TIMEOUT: Duration = Duration::from_mins(5);

/// Rank 0's rendezvous server thread.
type Server = std::thread::JoinHandle<Result<(), GatherError>>;

fn dev_err(what: &str) -> impl FnOnce(candle_core::Error) -> GatherError + '_ {
    move |e| GatherError::Device(format!("{what}: {e}"))
}

fn drv_err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> GatherError + '_ {
    move |e| GatherError::Device(format!("{what}: {e:?}"))
}

/// The collective of the GPU backend: NCCL over the whole world (the shard group, or a group of one
/// rank, where the all-gather is a copy), CUDA events on the rank's stream.
pub(crate) struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    group_size: usize,
    /// The common origin, at `origin_us` on the host timeline.
    origin: CudaEvent,
    origin_us: f64,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("group_size", &self.group_size)
            .finish_non_exhaustive()
    }
}

impl Collective for Nccl {
    type Stamp = CudaEvent;
    const CLOCK: Clock = Clock::Device;

    fn all_gather(
        &mut self,
        input: &Tensor,
        in_len: usize,
        output: &mut Tensor,
    ) -> Result<bool, GatherError> {
        let out_len = in_len * self.group_size;
        if output.elem_count() < out_len {
            return Err(GatherError::Device(format!(
                "all-gather output of {} bytes, {out_len} needed",
                output.elem_count()
            )));
        }
        // Every rank of a unit has the same (padded) input length, so all skip an empty one.
        if in_len == 0 {
            return Ok(true);
        }
        // A group of one rank inside a larger world (NO_SHARD) cannot use the world's communicator:
        // its all-gather is a copy. A world of one rank all-gathers through NCCL like any other,
        // so a single-GPU run executes the same calls as a multi-GPU one.
        if self.group_size == 1 && self.comm.world_size() > 1 {
            output
                .inplace_op1(&CopyBytes {
                    stream: &self.stream,
                    src: input,
                    src_offset: 0,
                    dst_offset: 0,
                    len: in_len,
                })
                .map_err(dev_err("all-gather"))?;
            return Ok(true);
        }
        // Straight into the engine's output buffer (allocated before the span starts).
        output
            .inplace_op1(&NcclAllGather {
                comm: &self.comm,
                input,
                in_len,
                out_len,
            })
            .map_err(dev_err("ncclAllGather"))?;
        Ok(true)
    }

    /// A failing rank leaves the process; NCCL has no way to tell the others.
    fn fail(&mut self) {}

    /// One `cuMemcpyDtoDAsync` on the rank's stream.
    fn copy(
        &mut self,
        src: &Tensor,
        src_offset: usize,
        dst: &mut Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Option<Result<(), GatherError>> {
        Some(
            dst.inplace_op1(&CopyBytes {
                stream: &self.stream,
                src,
                src_offset,
                dst_offset,
                len,
            })
            .map_err(dev_err("copy")),
        )
    }

    fn stamp(&mut self) -> Result<CudaEvent, GatherError> {
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err("record CUDA event"))
    }

    fn span_us(&self, start: &CudaEvent, end: &CudaEvent) -> Result<(f64, f64), GatherError> {
        let start_ms = self
            .origin
            .elapsed_ms(start)
            .map_err(drv_err("event time"))?;
        let dur_ms = start.elapsed_ms(end).map_err(drv_err("event time"))?;
        Ok((
            self.origin_us + f64::from(start_ms) * 1e3,
            f64::from(dur_ms) * 1e3,
        ))
    }
}

/// NCCL's all-gather of `in_len` bytes of `input` into the first `out_len` bytes of the tensor it
/// is applied to (candle hands an in-place op the tensor's storage mutably).
struct NcclAllGather<'a> {
    comm: &'a Comm,
    input: &'a Tensor,
    in_len: usize,
    out_len: usize,
}

impl InplaceOp1 for NcclAllGather<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-gather"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(candle_core::Error::Msg(
            "the NCCL all-gather needs GPU tensors".to_owned(),
        ))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        if !layout.is_contiguous() {
            return Err(candle_core::Error::Msg(
                "all-gather output is not contiguous".to_owned(),
            ));
        }
        let start = layout.start_offset();
        let out = storage.as_cuda_slice_mut::<u8>()?;
        let mut view = out.slice_mut(start..start + self.out_len);
        with_slice(self.input, |slice, offset, _len| {
            let send = slice.slice(offset..offset + self.in_len);
            self.comm
                .all_gather(&send, &mut view)
                .map_err(drv_err("ncclAllGather"))?;
            Ok(())
        })
        .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// `len` bytes of `src` from `src_offset` into the tensor it is applied to at `dst_offset`, as one
/// device-to-device memcpy (candle's `slice_set` runs a byte-per-thread kernel for `u8` tensors).
struct CopyBytes<'a> {
    stream: &'a Arc<CudaStream>,
    src: &'a Tensor,
    src_offset: usize,
    dst_offset: usize,
    len: usize,
}

impl InplaceOp1 for CopyBytes<'_> {
    fn name(&self) -> &'static str {
        "copy-bytes"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(candle_core::Error::Msg(
            "the device copy needs GPU tensors".to_owned(),
        ))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let msg = |what: &str| candle_core::Error::Msg(what.to_owned());
        if !layout.is_contiguous() {
            return Err(msg("copy destination is not contiguous"));
        }
        let out = storage.as_cuda_slice_mut::<u8>()?;
        let start = layout
            .start_offset()
            .checked_add(self.dst_offset)
            .ok_or_else(|| msg("copy destination offset overflows"))?;
        let mut view = start
            .checked_add(self.len)
            .and_then(|end| out.try_slice_mut(start..end))
            .ok_or_else(|| msg("copy destination out of range"))?;
        with_slice(self.src, |slice, offset, count| {
            let piece = offset
                .checked_add(self.src_offset)
                .filter(|_| self.src_offset.saturating_add(self.len) <= count)
                .and_then(|from| slice.try_slice(from..from + self.len))
                .ok_or_else(|| GatherError::Device("copy source out of range".to_owned()))?;
            self.stream
                .memcpy_dtod(&piece, &mut view)
                .map_err(drv_err("cuMemcpyDtoDAsync"))
        })
        .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// What every rank sends to rank 0 at the end.
#[derive(Serialize, Deserialize, Default)]
struct Report {
    spans: Vec<(String, bool, f64, f64, String, u64, String)>,
    checks: u64,
    bytes_compared: u64,
    mismatches: Vec<(String, u64, u64)>,
    unchecked: Vec<String>,
    error: Option<String>,
}

fn static_name(name: &str) -> &'static str {
    [
        names::READ,
        names::HOST_TO_DEVICE,
        names::COPY_IN,
        names::ALL_GATHER,
        names::COPY_OUT,
        names::DEVICE_TO_HOST,
        names::VERIFY,
        names::WRITE,
    ]
    .into_iter()
    .find(|n| *n == name)
    .unwrap_or("other")
}

fn nccl_id(env: &LaunchEnv) -> Result<(Id, Option<Server>), GatherError> {
    if env.rank == 0 {
        let id = Id::new().map_err(drv_err("ncclGetUniqueId"))?;
        let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
        let (port, world_size) = (env.rendezvous_port, env.world_size);
        let server = std::thread::spawn(move || {
            rendezvous::serve(port, world_size, &bytes, RENDEZVOUS_TIMEOUT)
                .map_err(|e| GatherError::Device(e.to_string()))
        });
        Ok((id, Some(server)))
    } else {
        let bytes = rendezvous::fetch(
            &env.master_addr,
            env.rendezvous_port,
            env.rank,
            RENDEZVOUS_TIMEOUT,
        )
        .map_err(|e| GatherError::Device(e.to_string()))?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(GatherError::Device(format!(
                "rendezvous: NCCL id of {} bytes, expected 128",
                bytes.len()
            )));
        }
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        Ok((Id::uninit(internal), None))
    }
}

/// The raw device bytes of a contiguous `u8` tensor.
fn with_slice<T>(
    t: &Tensor,
    f: impl FnOnce(&CudaSlice<u8>, usize, usize) -> Result<T, GatherError>,
) -> Result<T, GatherError> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(GatherError::Device("tensor is not on the GPU".to_owned()));
    };
    if !layout.is_contiguous() {
        return Err(GatherError::Device(
            "source tensor is not contiguous".to_owned(),
        ));
    }
    let slice = cs.as_cuda_slice::<u8>().map_err(dev_err("u8 view"))?;
    f(slice, layout.start_offset(), t.elem_count())
}

/// Runs this process's rank of the gather (rank and world from the launcher's environment).
pub fn run_from_env(
    plan: &GatherPlan,
    source: &Source,
    options: GatherOptions,
) -> Result<GatherOutcome, GatherError> {
    let env = LaunchEnv::from_vars(|k| std::env::var(k).ok())
        .map_err(|e| GatherError::Device(e.to_string()))?;
    if env.world_size != plan.world_size {
        return Err(GatherError::Device(format!(
            "the launcher says WORLD_SIZE={}, the layout has {} ranks (--world-size)",
            env.world_size, plan.world_size
        )));
    }
    if plan.group_size != plan.world_size && plan.group_size != 1 {
        return Err(GatherError::Device(
            "the cuda backend all-gathers over the whole world; hybrid shard groups run on the cpu backend".to_owned(),
        ));
    }
    let device =
        CudaDevice::new_with_stream(env.local_rank as usize).map_err(dev_err("open GPU"))?;
    let stream = device.cuda_stream();
    let (id, server) = nccl_id(&env)?;
    let comm = Comm::from_rank(
        stream.clone(),
        env.rank as usize,
        env.world_size as usize,
        id,
    )
    .map_err(drv_err("ncclCommInitRank"))?;
    if let Some(server) = server {
        server
            .join()
            .map_err(|_| GatherError::Device("rendezvous thread panicked".to_owned()))??;
    }
    let rank = env.rank;
    let n = plan.group_size;

    // A common origin: the comm init is a barrier; one more tiny all-gather lines the clocks up.
    let warm = stream.alloc_zeros::<u8>(1).map_err(drv_err("alloc"))?;
    let mut warm_out = stream
        .alloc_zeros::<u8>(env.world_size as usize)
        .map_err(drv_err("alloc"))?;
    comm.all_gather(&warm, &mut warm_out)
        .map_err(drv_err("ncclAllGather"))?;
    stream.synchronize().map_err(drv_err("synchronize"))?;
    let origin_instant = Instant::now();
    let origin = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(drv_err("record CUDA event"))?;
    stream.synchronize().map_err(drv_err("synchronize"))?;
    let origin_us = origin_instant.elapsed().as_secs_f64() * 1e6;
    let mut dev = CandleDevice {
        device: Device::Cuda(device),
        collective: Nccl {
            comm,
            stream: stream.clone(),
            group_size: plan.group_size as usize,
            origin,
            origin_us,
        },
    };
    let job = Job {
        plan,
        source,
        options,
        observer: &NoObserver,
    };
    let result = engine::run_rank(&job, &mut dev, rank, Timer::new(origin_instant, rank));
    if let Some(e) = result.error {
        return Err(e);
    }
    let comm = dev.collective.comm;
    let verify = result.verify;
    let kept = result.params;
    let wall_secs = origin_instant.elapsed().as_secs_f64();

    // The device's own device-to-device copy bandwidth, same run: the baseline for copy-in/out.
    let d2d_gbps = device_copy_gbps(&stream, plan, n)?;

    // Every rank's spans and verify results to every rank (rank 0 writes them).
    let report = Report {
        spans: result
            .spans
            .iter()
            .map(|s| {
                (
                    s.name.to_owned(),
                    s.clock == Clock::Device,
                    s.start_us,
                    s.dur_us,
                    s.unit.clone(),
                    s.bytes,
                    s.dtype.clone(),
                )
            })
            .collect(),
        checks: verify.checks,
        bytes_compared: verify.bytes_compared,
        mismatches: verify
            .mismatches
            .iter()
            .map(|m| (m.fqn.clone(), m.first_byte, m.elements))
            .collect(),
        unchecked: verify.unchecked.clone(),
        error: None,
    };
    let reports = exchange_reports(&comm, &stream, &report, env.world_size)?;
    let mut trace = Trace {
        world_size: plan.world_size,
        spans: Vec::new(),
        metadata: vec![
            ("backend".to_owned(), "cuda".to_owned()),
            ("source".to_owned(), source.name()),
            ("launcher".to_owned(), env.launcher.to_owned()),
            (
                "device_to_device_copy_gbps".to_owned(),
                format!("{d2d_gbps:.2}"),
            ),
        ],
    };
    let mut all_verify = VerifyReport::default();
    for (r, rep) in reports.into_iter().enumerate() {
        for (name, device, start_us, dur_us, unit, bytes, dtype) in rep.spans {
            trace.spans.push(Span {
                rank: r as u64,
                name: static_name(&name),
                clock: if device { Clock::Device } else { Clock::Host },
                start_us,
                dur_us,
                unit,
                bytes,
                dtype,
            });
        }
        all_verify.checks += rep.checks;
        all_verify.bytes_compared += rep.bytes_compared;
        all_verify.mismatches.extend(rep.mismatches.into_iter().map(
            |(fqn, first_byte, elements)| Mismatch {
                rank: r as u64,
                fqn,
                first_byte,
                elements,
            },
        ));
        for u in rep.unchecked {
            if !all_verify.unchecked.contains(&u) {
                all_verify.unchecked.push(u);
            }
        }
    }
    trace.sort();
    let mut summary = Summary::from_trace(plan, &trace, "cuda", wall_secs);
    summary.device_copy_gbps = Some(d2d_gbps);
    Ok(GatherOutcome {
        trace,
        summary,
        verify: options.verify.then_some(all_verify),
        params: (rank == 0 && options.keep_params).then_some(kept),
        writes_outputs: rank == 0,
    })
}

/// Best of 5 device-to-device copies of the largest all-gather output, timed with CUDA events.
fn device_copy_gbps(
    stream: &Arc<CudaStream>,
    plan: &GatherPlan,
    n: u64,
) -> Result<f64, GatherError> {
    let len = plan
        .units
        .iter()
        .map(|u| u.output_bytes(n))
        .max()
        .unwrap_or(0)
        .max(1 << 20) as usize;
    let src = stream.alloc_zeros::<u8>(len).map_err(drv_err("alloc"))?;
    let mut dst = stream.alloc_zeros::<u8>(len).map_err(drv_err("alloc"))?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let a = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err("event"))?;
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(drv_err("memcpy_dtod"))?;
        let b = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err("event"))?;
        let ms = f64::from(a.elapsed_ms(&b).map_err(drv_err("event time"))?);
        best = best.min(ms);
    }
    // A copy reads and writes `len` bytes; like copy-in/copy-out bandwidths, count the bytes copied.
    Ok(len as f64 / (best / 1e3) / 1e9)
}

fn exchange_reports(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    report: &Report,
    world_size: u64,
) -> Result<Vec<Report>, GatherError> {
    let bytes = serde_json::to_vec(report).map_err(|e| GatherError::Device(e.to_string()))?;
    let ws = world_size as usize;
    let len_dev = stream
        .clone_htod(&(bytes.len() as u64).to_le_bytes())
        .map_err(drv_err("upload"))?;
    let mut lens_dev = stream.alloc_zeros::<u8>(8 * ws).map_err(drv_err("alloc"))?;
    comm.all_gather(&len_dev, &mut lens_dev)
        .map_err(drv_err("ncclAllGather"))?;
    let lens_host = stream.clone_dtoh(&lens_dev).map_err(drv_err("download"))?;
    let lens: Vec<usize> = lens_host
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize)
        .collect();
    let max = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut padded = bytes;
    padded.resize(max, b' ');
    let mine = stream.clone_htod(&padded).map_err(drv_err("upload"))?;
    let mut all = stream
        .alloc_zeros::<u8>(max * ws)
        .map_err(drv_err("alloc"))?;
    comm.all_gather(&mine, &mut all)
        .map_err(drv_err("ncclAllGather"))?;
    let host = stream.clone_dtoh(&all).map_err(drv_err("download"))?;
    host.chunks_exact(max)
        .zip(lens)
        .map(|(c, len)| {
            serde_json::from_slice(&c[..len])
                .map_err(|e| GatherError::Device(format!("rank report: {e}")))
        })
        .collect()
}
