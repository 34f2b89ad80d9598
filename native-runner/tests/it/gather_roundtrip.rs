//! The gather executor against an independent model of FSDP's unshard path.
//!
//! Full parameters come from a formula; the expected padded shards and all-gather inputs are cut by the
//! simple slicing code below (written from FSDP_SPEC.md §1.3, §1.5 and §4.1–4.2, not from the layout
//! engine); the gathered parameters must equal the formula on every rank.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use shardscope_core::DType;
use shardscope_core::layout::{self, Api, LayoutConfig, Strategy};
use shardscope_core::model::{ModelDescription, ParamSpec};
use shardscope_runner::gather::source::{RankPrefixedSafetensors, SafetensorsFile};
use shardscope_runner::gather::{
    self, FullSource, GatherOptions, GatherPlan, Observer, ParamPlan, RankSource, Source,
    SourceError, UnitPlan,
};

/// (fqn, shape, dtype, shared_with)
type P = (&'static str, &'static [u64], DType, Option<&'static str>);

const F32: DType = DType::Float32;
const BF16: DType = DType::BFloat16;

/// Parameters in registration order; units `""`, `block1`, `block2`.
const MODEL: &[P] = &[
    ("scale", &[2], F32, None),
    ("embed.weight", &[7, 5], F32, None),
    ("block1.lin.weight", &[7, 5], F32, None),
    ("block1.lin.bias", &[7], F32, None),
    ("block2.lin.weight", &[3, 5], F32, None),
    ("block2.lin.bias", &[3], F32, None),
    ("head.weight", &[7, 5], F32, Some("embed.weight")),
    ("head.bias", &[3], F32, None),
];
const UNITS: &[&str] = &["", "block1", "block2"];

/// A bf16 model (FSDP1 alignment 8) and, for FSDP2, a unit mixing dtypes (gathered as bytes).
const MODEL_BF16: &[P] = &[
    ("a", &[5], BF16, None),
    ("b", &[3, 2], BF16, None),
    ("blk.w", &[9, 3], BF16, None),
    ("blk.v", &[1], BF16, None),
];
const MODEL_MIXED: &[P] = &[
    ("a", &[5], F32, None),
    ("blk.w", &[9, 3], BF16, None),
    ("blk.v", &[4, 2], F32, None),
];

fn description(model: &[P], units: &[&str]) -> ModelDescription {
    let params = model
        .iter()
        .map(|(fqn, shape, dtype, shared)| ParamSpec {
            fqn: (*fqn).to_owned(),
            shape: shape.to_vec(),
            dtype: *dtype,
            requires_grad: true,
            shared_with: shared.map(str::to_owned),
        })
        .collect();
    ModelDescription::new(
        params,
        units.iter().map(|u| (*u).to_owned()).collect(),
        vec![],
    )
    .unwrap()
}

fn numel(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

/// Element `i` of parameter number `k`: the low bytes of `1000 k + i + 1` (any bits do: every
/// comparison is bitwise).
fn formula(model: &[P], fqn: &str) -> Vec<u8> {
    let k = model.iter().position(|p| p.0 == fqn).expect("param");
    let (_, shape, dtype, shared) = model[k];
    if let Some(primary) = shared {
        return formula(model, primary);
    }
    let es = dtype.size_bytes();
    (0..numel(shape))
        .flat_map(|i| {
            let v = (1000 * k + i + 1) as u64;
            v.to_le_bytes()[..es].to_vec()
        })
        .collect()
}

struct Formula(&'static [P]);

impl FullSource for Formula {
    fn name(&self) -> String {
        "formula".to_owned()
    }
    fn contains(&self, fqn: &str) -> bool {
        self.0.iter().any(|p| p.0 == fqn)
    }
    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        let all = formula(self.0, fqn);
        let s = byte_offset as usize;
        dst.copy_from_slice(&all[s..s + dst.len()]);
        Ok(())
    }
}

/// The unit of a parameter: the longest unit prefix (dot boundary).
fn unit_of(fqn: &str, units: &[&str]) -> String {
    units
        .iter()
        .filter(|u| u.is_empty() || fqn.starts_with(&format!("{u}.")))
        .max_by_key(|u| u.len())
        .unwrap()
        .to_string()
}

/// Real (non-alias) parameters of each unit, in registration order.
fn unit_params(model: &[P], units: &[&str]) -> BTreeMap<String, Vec<P>> {
    let mut m: BTreeMap<String, Vec<P>> = BTreeMap::new();
    for p in model.iter().filter(|p| p.3.is_none()) {
        m.entry(unit_of(p.0, units)).or_default().push(*p);
    }
    m
}

fn forty_two(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Float32 => 42f32.to_le_bytes().to_vec(),
        // bf16(42.0) = upper half of f32(42.0)
        DType::BFloat16 => 42f32.to_le_bytes()[2..].to_vec(),
        _ => unreachable!(),
    }
}

/// FSDP1: rank r's padded flat shard of each unit (spec §1.3, §1.5).
fn fsdp1_shards(
    model: &[P],
    units: &[&str],
    n: usize,
    use_orig_params: bool,
) -> BTreeMap<(usize, String), Vec<u8>> {
    let mut out = BTreeMap::new();
    for (unit, params) in unit_params(model, units) {
        let dtype = params[0].2;
        let es = dtype.size_bytes();
        let align = 16 / es;
        let mut flat: Vec<u8> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let total = flat.len() / es;
            if use_orig_params && i > 0 && !total.is_multiple_of(align) {
                for _ in 0..align - total % align {
                    flat.extend(forty_two(dtype));
                }
            }
            flat.extend(formula(model, p.0));
        }
        if use_orig_params {
            let total = flat.len() / es;
            if !total.is_multiple_of(n) {
                for _ in 0..n - total % n {
                    flat.extend(forty_two(dtype));
                }
            }
        }
        let total = flat.len() / es;
        let c = total.div_ceil(n);
        for r in 0..n {
            let lo = (r * c).min(total) * es;
            let hi = ((r + 1) * c).min(total) * es;
            let mut shard = flat[lo..hi].to_vec();
            shard.resize(c * es, 0);
            out.insert((r, unit.clone()), shard);
        }
    }
    out
}

/// The module path of a parameter (`""` for a root parameter).
fn module_of(fqn: &str) -> &str {
    fqn.rsplit_once('.').map_or("", |(m, _)| m)
}

/// Post-order walk for [`post_order`].
fn visit(module: &str, children: &BTreeMap<String, Vec<String>>, params: &[P], out: &mut Vec<P>) {
    for child in children.get(module).into_iter().flatten() {
        visit(child, children, params, out);
    }
    out.extend(params.iter().filter(|p| module_of(p.0) == module));
}

/// FSDP2's `FSDPParamGroup` order: the unit's modules in DFS post-order (children in registration
/// order, then the module itself), each module's own parameters in registration order.
fn post_order(params: &[P]) -> Vec<P> {
    // Children of every module, in order of first appearance.
    let mut children: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in params {
        let path = module_of(p.0);
        if path.is_empty() {
            continue;
        }
        let mut parent = String::new();
        for (i, _) in path.split('.').enumerate() {
            let child: String = path.split('.').take(i + 1).collect::<Vec<_>>().join(".");
            let list = children.entry(parent.clone()).or_default();
            if !list.contains(&child) {
                list.push(child.clone());
            }
            parent = child;
        }
    }
    let mut out = Vec::with_capacity(params.len());
    visit("", &children, params, &mut out);
    out
}

/// FSDP2: rank r's padded shard of every parameter, and its all-gather input per unit (spec §4.1–4.2).
#[allow(clippy::type_complexity)]
fn fsdp2_shards(
    model: &[P],
    units: &[&str],
    n: usize,
) -> (
    BTreeMap<(usize, String), Vec<u8>>,
    BTreeMap<(usize, String), Vec<u8>>,
) {
    let mut shards = BTreeMap::new();
    let mut inputs = BTreeMap::new();
    for (unit, params) in unit_params(model, units) {
        let params = post_order(&params);
        for r in 0..n {
            let mut input = Vec::new();
            for p in &params {
                let full = formula(model, p.0);
                let dim0 = p.1[0] as usize;
                let row = full.len() / dim0;
                let c0 = dim0.div_ceil(n);
                let lo = (r * c0).min(dim0) * row;
                let hi = ((r + 1) * c0).min(dim0) * row;
                let mut shard = full[lo..hi].to_vec();
                shard.resize(c0 * row, 0);
                input.extend_from_slice(&shard);
                shards.insert((r, p.0.to_owned()), shard);
            }
            inputs.insert((r, unit.clone()), input);
        }
    }
    (shards, inputs)
}

#[derive(Default)]
struct Seen {
    shards: Mutex<BTreeMap<(usize, String), Vec<u8>>>,
    inputs: Mutex<BTreeMap<(usize, String), Vec<u8>>>,
    params: Mutex<BTreeMap<(usize, String), Vec<u8>>>,
}

impl Observer for Seen {
    fn shard(&self, rank: u64, _unit: &UnitPlan, shard: &gather::ShardPlan, bytes: &[u8]) {
        self.shards
            .lock()
            .unwrap()
            .insert((rank as usize, shard.key.clone()), bytes.to_vec());
    }
    fn all_gather_input(&self, rank: u64, unit: &UnitPlan, bytes: &[u8]) {
        self.inputs
            .lock()
            .unwrap()
            .insert((rank as usize, unit.name.clone()), bytes.to_vec());
    }
    fn param(&self, rank: u64, param: &ParamPlan, bytes: &[u8]) {
        self.params
            .lock()
            .unwrap()
            .insert((rank as usize, param.fqn.clone()), bytes.to_vec());
    }
}

fn config(api: Api, world_size: u64, use_orig_params: bool) -> LayoutConfig {
    LayoutConfig {
        api,
        world_size,
        shard_group_size: None,
        use_orig_params,
        strategy: Strategy::FullShard,
        param_dtype: None,
    }
}

fn run(model: &'static [P], units: &[&str], cfg: &LayoutConfig) -> (Seen, gather::GatherOutcome) {
    let desc = description(model, units);
    let plan = GatherPlan::from_layout(&layout::compute(&desc, cfg).unwrap()).unwrap();
    let seen = Seen::default();
    let source = Source::Full(Box::new(Formula(model)));
    let outcome = gather::cpu::run(
        &plan,
        &source,
        GatherOptions {
            verify: true,
            keep_params: true,
        },
        &seen,
    )
    .unwrap();
    (seen, outcome)
}

fn check_params(model: &'static [P], seen: &Seen, outcome: &gather::GatherOutcome, ranks: usize) {
    let params = seen.params.lock().unwrap();
    for p in model.iter().filter(|p| p.3.is_none()) {
        for r in 0..ranks {
            assert_eq!(
                params[&(r, p.0.to_owned())],
                formula(model, p.0),
                "rank {r} {}",
                p.0
            );
        }
    }
    // Rank 0's output has every name, tied aliases included.
    let kept = outcome.params.as_ref().unwrap();
    for p in model {
        assert_eq!(kept[p.0].bytes, formula(model, p.0), "{}", p.0);
        assert_eq!(kept[p.0].shape, p.1);
    }
    let v = outcome.verify.as_ref().unwrap();
    assert!(v.is_ok(), "{:?}", v.mismatches);
    assert!(v.checks >= (ranks * model.iter().filter(|p| p.3.is_none()).count()) as u64);
}

#[test]
fn fsdp1_copy_in_buffers_and_gathered_params_match_independent_slicing() {
    for (model, units) in [(MODEL, UNITS), (MODEL_BF16, &["", "blk"][..])] {
        for use_orig_params in [false, true] {
            for n in 1..=5usize {
                let (seen, outcome) =
                    run(model, units, &config(Api::Fsdp1, n as u64, use_orig_params));
                let want = fsdp1_shards(model, units, n, use_orig_params);
                let inputs = seen.inputs.lock().unwrap();
                assert_eq!(inputs.len(), want.len());
                for (key, bytes) in &want {
                    assert_eq!(&inputs[key], bytes, "n={n} uop={use_orig_params} {key:?}");
                }
                check_params(model, &seen, &outcome, n);
            }
        }
    }
}

#[test]
fn fsdp2_padded_shards_inputs_and_gathered_params_match_independent_slicing() {
    for (model, units) in [
        (MODEL, UNITS),
        (MODEL_BF16, &["", "blk"][..]),
        (MODEL_MIXED, &["", "blk"][..]),
    ] {
        for n in 1..=5usize {
            let (seen, outcome) = run(model, units, &config(Api::Fsdp2, n as u64, false));
            let (want_shards, want_inputs) = fsdp2_shards(model, units, n);
            assert_eq!(*seen.shards.lock().unwrap(), want_shards, "n={n}");
            assert_eq!(*seen.inputs.lock().unwrap(), want_inputs, "n={n}");
            check_params(model, &seen, &outcome, n);
        }
    }
}

#[test]
fn hybrid_groups_gather_within_their_group() {
    // HSDP: 6 ranks, shard groups of 3; every group gathers the same parameters.
    let mut cfg = config(Api::Fsdp2, 6, false);
    cfg.shard_group_size = Some(3);
    let (seen, outcome) = run(MODEL, UNITS, &cfg);
    let (_, want_inputs) = fsdp2_shards(MODEL, UNITS, 3);
    let inputs = seen.inputs.lock().unwrap();
    for ((r, unit), bytes) in inputs.iter() {
        assert_eq!(
            bytes,
            &want_inputs[&(r % 3, unit.clone())],
            "rank {r} {unit}"
        );
    }
    check_params(MODEL, &seen, &outcome, 6);
    // FSDP1 hybrid_shard with use_orig_params: 4 ranks in groups of 2.
    let mut cfg = config(Api::Fsdp1, 4, true);
    cfg.strategy = Strategy::HybridShard;
    cfg.shard_group_size = Some(2);
    let (seen, outcome) = run(MODEL, UNITS, &cfg);
    let want = fsdp1_shards(MODEL, UNITS, 2, true);
    for ((r, unit), bytes) in seen.inputs.lock().unwrap().iter() {
        assert_eq!(bytes, &want[&(r % 2, unit.clone())], "rank {r} {unit}");
    }
    check_params(MODEL, &seen, &outcome, 4);
}

/// Rank-local shards in a `rank<r>/<key>` safetensors file.
fn rank_file(
    shards: &BTreeMap<(usize, String), Vec<u8>>,
    dtype_of: impl Fn(&str) -> DType,
) -> Arc<SafetensorsFile> {
    struct V(safetensors::Dtype, Vec<usize>, Vec<u8>);
    impl safetensors::View for &V {
        fn dtype(&self) -> safetensors::Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }
    let views: Vec<(String, V)> = shards
        .iter()
        .map(|((r, key), bytes)| {
            let dtype = dtype_of(key);
            let st = match dtype {
                DType::Float32 => safetensors::Dtype::F32,
                DType::BFloat16 => safetensors::Dtype::BF16,
                _ => unreachable!(),
            };
            (
                format!("rank{r}/{key}"),
                V(st, vec![bytes.len() / dtype.size_bytes()], bytes.clone()),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views.iter().map(|(k, v)| (k.as_str(), v)), None).unwrap();
    Arc::new(SafetensorsFile::from_bytes("ranks.safetensors".into(), bytes).unwrap())
}

fn run_per_rank(
    model: &'static [P],
    cfg: &LayoutConfig,
    source: Box<dyn RankSource>,
) -> gather::GatherOutcome {
    let desc = description(model, UNITS);
    let plan = GatherPlan::from_layout(&layout::compute(&desc, cfg).unwrap()).unwrap();
    gather::cpu::run(
        &plan,
        &Source::PerRank(source),
        GatherOptions {
            verify: true,
            keep_params: true,
        },
        &gather::NoObserver,
    )
    .unwrap()
}

#[test]
fn rank_local_shards_gather_and_verify_through_the_shard_metadata() {
    let n = 3;
    // FSDP1 flat shards under their flat-parameter names.
    let shards: BTreeMap<(usize, String), Vec<u8>> = fsdp1_shards(MODEL, UNITS, n, true)
        .into_iter()
        .map(|((r, unit), b)| {
            let key = if unit.is_empty() {
                "_flat_param".to_owned()
            } else {
                format!("{unit}._flat_param")
            };
            ((r, key), b)
        })
        .collect();
    let cfg = config(Api::Fsdp1, n as u64, true);
    let outcome = run_per_rank(
        MODEL,
        &cfg,
        Box::new(RankPrefixedSafetensors::new(rank_file(&shards, |_| F32))),
    );
    assert!(outcome.verify.as_ref().unwrap().is_ok());
    for p in MODEL {
        assert_eq!(
            outcome.params.as_ref().unwrap()[p.0].bytes,
            formula(MODEL, p.0),
            "{}",
            p.0
        );
    }

    // The same shards read under another layout (no alignment padding) are rejected for their size.
    let cfg_wrong = config(Api::Fsdp1, n as u64, false);
    let desc = description(MODEL, UNITS);
    let plan = GatherPlan::from_layout(&layout::compute(&desc, &cfg_wrong).unwrap()).unwrap();
    let err = gather::cpu::run(
        &plan,
        &Source::PerRank(Box::new(RankPrefixedSafetensors::new(rank_file(
            &shards,
            |_| F32,
        )))),
        GatherOptions::default(),
        &gather::NoObserver,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("bytes; this layout expects"),
        "{err}"
    );

    // FSDP2 local chunks stored unpadded (as the DTensor local tensor) are accepted.
    let (padded, _) = fsdp2_shards(MODEL, UNITS, n);
    let unpadded: BTreeMap<(usize, String), Vec<u8>> = padded
        .into_iter()
        .filter_map(|((r, fqn), mut b)| {
            let p = MODEL.iter().find(|p| p.0 == fqn).unwrap();
            let dim0 = p.1[0] as usize;
            let row = b.len() / dim0.div_ceil(n);
            let local_rows = dim0
                .saturating_sub(r * dim0.div_ceil(n))
                .min(dim0.div_ceil(n));
            b.truncate(local_rows * row);
            (!b.is_empty()).then_some(((r, fqn), b))
        })
        .collect();
    let outcome = run_per_rank(
        MODEL,
        &config(Api::Fsdp2, n as u64, false),
        Box::new(RankPrefixedSafetensors::new(rank_file(&unpadded, |_| F32))),
    );
    assert!(outcome.verify.as_ref().unwrap().is_ok());
    for p in MODEL {
        assert_eq!(
            outcome.params.as_ref().unwrap()[p.0].bytes,
            formula(MODEL, p.0),
            "{}",
            p.0
        );
    }
}

/// A full source whose tied alias disagrees with its primary: `--verify` must report it.
struct BadAlias;
impl FullSource for BadAlias {
    fn name(&self) -> String {
        "bad alias".to_owned()
    }
    fn contains(&self, fqn: &str) -> bool {
        MODEL.iter().any(|p| p.0 == fqn)
    }
    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        Formula(MODEL).read_full(fqn, byte_offset, dst)?;
        if fqn == "head.weight" && byte_offset == 0 {
            dst[4] ^= 1;
        }
        Ok(())
    }
}

#[test]
fn verify_reports_a_differing_parameter_with_rank_and_position() {
    let desc = description(MODEL, UNITS);
    let plan =
        GatherPlan::from_layout(&layout::compute(&desc, &config(Api::Fsdp1, 2, false)).unwrap())
            .unwrap();
    let outcome = gather::cpu::run(
        &plan,
        &Source::Full(Box::new(BadAlias)),
        GatherOptions {
            verify: true,
            keep_params: false,
        },
        &gather::NoObserver,
    )
    .unwrap();
    let v = outcome.verify.unwrap();
    assert_eq!(v.mismatches.len(), 2, "{v:?}");
    for (r, m) in v.mismatches.iter().enumerate() {
        assert_eq!(
            (m.rank, m.fqn.as_str(), m.first_byte, m.elements),
            (r as u64, "head.weight", 4, 1)
        );
    }
}

#[test]
#[allow(clippy::many_single_char_names)]
fn synthetic_data_is_deterministic_and_follows_aliases() {
    use shardscope_runner::gather::source::SyntheticSource;
    let desc = description(MODEL, UNITS);
    let a = SyntheticSource::new(&desc, 7);
    let b = SyntheticSource::new(&desc, 7);
    let c = SyntheticSource::new(&desc, 8);
    let mut x = vec![0u8; 140];
    let mut y = vec![0u8; 140];
    let mut z = vec![0u8; 140];
    a.read_full("embed.weight", 0, &mut x).unwrap();
    b.read_full("head.weight", 0, &mut y).unwrap();
    c.read_full("embed.weight", 0, &mut z).unwrap();
    assert_eq!(x, y);
    assert_ne!(x, z);
    // Finite float32 values in [-2, -1] or [1, 2].
    for v in x
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
    {
        assert!((1.0..2.0).contains(&v.abs()), "{v}");
    }
    // A range read equals the same bytes of a whole read.
    let mut part = vec![0u8; 12];
    a.read_full("embed.weight", 20, &mut part).unwrap();
    assert_eq!(part, x[20..32]);
    assert!(a.read_full("embed.weight", 136, &mut part).is_err());
}
