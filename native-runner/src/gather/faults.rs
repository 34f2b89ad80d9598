//! The engine's per-rank loop run on the `cpu` backend through a device that corrupts or fails
//! on purpose: `verify` catches a bad copy-out, and a rank failing before or after an all-gather
//! stops every rank. (Kept apart from [`super::engine`], which the `cpu` backend itself uses.)

#![allow(clippy::unwrap_used)]

use shardscope_core::DType;
use shardscope_core::layout::{self, Api, LayoutConfig, Strategy};
use shardscope_core::model::{ModelDescription, ParamSpec};

use crate::gather::cpu::{CpuDevice, Exchange, group_of, run_threads};
use crate::gather::engine::{Device, Job};
use crate::gather::plan::GatherPlan;
use crate::gather::source::{Source, SyntheticSource};
use crate::gather::{GatherError, GatherOptions, GatherOutcome, NoObserver};
use crate::trace::Clock;

/// A device that flips the first byte of every device-to-device copy (`on`), fails every copy
/// after the first `fails_after`, or reports an error from all-gather number `gather_fails`
/// after taking part in it.
struct Corrupt<D> {
    inner: D,
    on: bool,
    fails_after: Option<usize>,
    copies: usize,
    gather_fails: Option<usize>,
    gathers: usize,
}

impl<D: Device> Device for Corrupt<D> {
    type Buffer = D::Buffer;
    type Stamp = D::Stamp;
    const CLOCK: Clock = D::CLOCK;
    fn alloc(&mut self, len: usize) -> Result<D::Buffer, GatherError> {
        self.inner.alloc(len)
    }
    fn len(buf: &D::Buffer) -> usize {
        D::len(buf)
    }
    fn host(buf: &D::Buffer) -> Option<&[u8]> {
        D::host(buf)
    }
    fn host_mut(buf: &mut D::Buffer) -> Option<&mut [u8]> {
        D::host_mut(buf)
    }
    fn upload(
        &mut self,
        src: &[u8],
        dst: &mut D::Buffer,
        offset: usize,
    ) -> Result<(), GatherError> {
        self.inner.upload(src, dst, offset)
    }
    fn copy(
        &mut self,
        src: &D::Buffer,
        src_offset: usize,
        dst: &mut D::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), GatherError> {
        self.copies += 1;
        if self.fails_after.is_some_and(|n| self.copies > n) {
            return Err(GatherError::Device("injected copy failure".to_owned()));
        }
        self.inner.copy(src, src_offset, dst, dst_offset, len)?;
        if self.on && len > 0 {
            D::host_mut(dst).unwrap()[dst_offset] ^= 0x40;
        }
        Ok(())
    }
    fn all_gather(
        &mut self,
        input: &D::Buffer,
        in_len: usize,
        output: &mut D::Buffer,
    ) -> Result<bool, GatherError> {
        let done = self.inner.all_gather(input, in_len, output)?;
        self.gathers += 1;
        if self.gather_fails == Some(self.gathers - 1) {
            return Err(GatherError::Device(
                "injected all-gather failure".to_owned(),
            ));
        }
        Ok(done)
    }
    fn fail(&mut self) {
        self.inner.fail();
    }
    fn download(
        &mut self,
        src: &D::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, GatherError> {
        self.inner.download(src, offset, len)
    }
    fn stamp(&mut self) -> Result<D::Stamp, GatherError> {
        self.inner.stamp()
    }
    fn synchronize(&mut self) -> Result<(), GatherError> {
        self.inner.synchronize()
    }
    fn span_us(&self, start: &D::Stamp, end: &D::Stamp) -> Result<(f64, f64), GatherError> {
        self.inner.span_us(start, end)
    }
}

const PARAMS: &[(&str, &[u64])] = &[
    ("a", &[5]),
    ("blk.w", &[9, 3]),
    ("blk.b", &[9]),
    ("head.w", &[2, 7]),
];

fn plan(api: Api) -> (ModelDescription, GatherPlan) {
    let desc = ModelDescription::new(
        PARAMS
            .iter()
            .map(|(fqn, shape)| ParamSpec {
                fqn: (*fqn).to_owned(),
                shape: shape.to_vec(),
                dtype: DType::Float32,
                requires_grad: true,
                shared_with: None,
            })
            .collect(),
        vec![String::new(), "blk".to_owned()],
        vec![],
    )
    .unwrap();
    let cfg = LayoutConfig {
        api,
        world_size: 2,
        shard_group_size: None,
        use_orig_params: true,
        strategy: Strategy::FullShard,
        param_dtype: None,
    };
    let plan = GatherPlan::from_layout(&layout::compute(&desc, &cfg).unwrap()).unwrap();
    (desc, plan)
}

#[derive(Debug, Clone, Copy)]
enum Failure {
    CopiesAfter(usize),
    AllGather(usize),
}

fn run(api: Api, corrupt_rank: Option<u64>) -> GatherOutcome {
    try_run(api, corrupt_rank, None).unwrap()
}

fn try_run(
    api: Api,
    corrupt_rank: Option<u64>,
    failing_rank: Option<(u64, Failure)>,
) -> Result<GatherOutcome, GatherError> {
    let (desc, plan) = plan(api);
    let source = Source::Full(Box::new(SyntheticSource::new(&desc, 3)));
    let job = Job {
        plan: &plan,
        source: &source,
        options: GatherOptions {
            verify: true,
            keep_params: true,
        },
        observer: &NoObserver,
    };
    let exchange = Exchange::new(2);
    run_threads(&job, "cpu", |rank, origin| Corrupt {
        inner: CpuDevice {
            exchange: &exchange,
            rank: rank as usize,
            group: group_of(&plan, rank),
            origin,
        },
        on: corrupt_rank == Some(rank),
        fails_after: match failing_rank {
            Some((r, Failure::CopiesAfter(n))) if r == rank => Some(n),
            _ => None,
        },
        copies: 0,
        gather_fails: match failing_rank {
            Some((r, Failure::AllGather(n))) if r == rank => Some(n),
            _ => None,
        },
        gathers: 0,
    })
}

#[test]
fn verify_catches_a_device_that_corrupts_its_copy_out() {
    // FSDP1: the copy-in is the load itself, so device copies are only the copy-out's.
    let clean = run(Api::Fsdp1, None);
    let v = clean.verify.unwrap();
    assert!(v.is_ok(), "{v:?}");
    assert_eq!(v.checks, 2 * PARAMS.len() as u64);

    let bad = run(Api::Fsdp1, Some(1));
    let v = bad.verify.unwrap();
    let mut found: Vec<(u64, &str, u64, u64)> = v
        .mismatches
        .iter()
        .map(|m| (m.rank, m.fqn.as_str(), m.first_byte, m.elements))
        .collect();
    found.sort_unstable();
    let mut want: Vec<(u64, &str, u64, u64)> =
        PARAMS.iter().map(|(fqn, _)| (1, *fqn, 0, 1)).collect();
    want.sort_unstable();
    assert_eq!(found, want);
    // Rank 0 kept its own (clean) parameters, equal to the clean run's.
    assert_eq!(bad.params, clean.params);
}

#[test]
fn a_rank_failing_before_or_after_the_all_gather_stops_every_rank() {
    // FSDP2: rank 1 fails in its first copy-in, before the first all-gather.
    let err = try_run(Api::Fsdp2, None, Some((1, Failure::CopiesAfter(0)))).unwrap_err();
    assert_eq!(err.to_string(), "injected copy failure");
    // FSDP1 (device copies are only the copy-out's): rank 1 fails in the first unit's copy-out;
    // the others learn it at the next all-gather.
    let err = try_run(Api::Fsdp1, None, Some((1, Failure::CopiesAfter(0)))).unwrap_err();
    assert_eq!(err.to_string(), "injected copy failure");
    // An error from the all-gather itself, once the others are past it: the first one, and the
    // last one, after which there is no collective left to wait in. Neither hangs.
    let units = plan(Api::Fsdp1).1.units.len();
    assert!(units >= 2);
    for (api, n) in [
        (Api::Fsdp1, 0),
        (Api::Fsdp1, units - 1),
        (Api::Fsdp2, units - 1),
    ] {
        let err = try_run(api, None, Some((1, Failure::AllGather(n)))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "injected all-gather failure",
            "{api:?} {n}"
        );
    }
}

#[test]
fn a_corrupted_fsdp2_copy_in_reaches_every_rank() {
    // FSDP2: rank 1's copy-in flips a byte of its all-gather input, which every rank receives.
    let bad = run(Api::Fsdp2, Some(1));
    let v = bad.verify.unwrap();
    assert!(v.mismatches.iter().any(|m| m.rank == 0), "{v:?}");
    assert!(v.mismatches.iter().any(|m| m.rank == 1), "{v:?}");
}
