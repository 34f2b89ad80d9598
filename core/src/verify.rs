//! Comparing two checkpoints ([`diff`]) and checking one against its own promises ([`verify`]),
//! both producing one [`Report`].
//!
//! The report serializes to the verification schema (version 1) that the viewer reads
//! (`docs/viewer.md`): `kind`, `version`, `left`, `right`, and `entries` (one per clean FQN, sorted)
//! with `fqn`, `status`, `dtype`, `shape`, `mismatched_elements`, `max_abs_diff`, `first_mismatch`,
//! `message`. It adds fields the schema allows readers to ignore: `command`, `summary` (counts per
//! status, burn-store style), `notes`, and per entry `max_rel_diff`, `first_values`, `left_key`,
//! `right_key` (raw names), `right_dtype`, `right_shape`.
//!
//! Comparison is streaming: one tensor is read from each side, compared and dropped. Values are
//! compared bitwise by default; with a [`Tolerance`], floating-point (and complex) values use
//! `torch.allclose` semantics, `|a - b| <= atol + rtol * |b|`, NaN equal to NaN only with
//! `equal_nan`. Integer and bool values are always compared exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::{Serialize, Serializer};

use crate::dtype::DType;
use crate::index::{CheckpointIndex, CheckpointKind, EntryKind, IndexEntry, PathSeg, Role};
use crate::layout::fsdp1::{FlatParamLayout, Fsdp1Layout};
use crate::source::Source;

mod manifest;
mod plan;
pub use manifest::compare_manifests;
pub use plan::DiffPlan;

/// The `kind` of every report.
pub const REPORT_KIND: &str = "shardscope.verify";
/// The schema version written.
pub const REPORT_VERSION: u32 = 1;

/// One entry's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Equal (diff) or consistent (verify).
    Match,
    /// Different dtype, shape or values (diff); a disagreement inside the checkpoint (verify).
    Mismatch,
    /// Only on the left (diff).
    Missing,
    /// Only on the right (diff); optimizer state for a parameter the model lacks (verify).
    Unexpected,
    /// Could not be read or does not hold together (a chunk outside its file, a gap, a bad item).
    Error,
}

/// One key's verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entry {
    /// The clean FQN (after `--select` stripping), which links the entry to a layout.
    pub fqn: String,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// Elements that differ.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatched_elements: Option<u64>,
    /// Largest `|a - b|` over differing elements with a finite difference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_abs_diff: Option<f64>,
    /// Largest `|a - b| / |b|` over differing elements with a finite ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rel_diff: Option<f64>,
    /// Index (one per dim) of the first differing element in row-major order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_mismatch: Option<Vec<u64>>,
    /// The left and right values at `first_mismatch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_values: Option<[String; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The left key as stored, when it differs from `fqn`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub left_key: Option<String>,
    /// The right key as stored, when it differs from `fqn`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub right_key: Option<String>,
    /// The right dtype, when it differs from `dtype`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub right_dtype: Option<DType>,
    /// The right shape, when it differs from `shape`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub right_shape: Option<Vec<u64>>,
}

impl Entry {
    /// An entry with only a name and a status.
    pub fn new(fqn: &str, status: Status) -> Entry {
        Entry {
            fqn: fqn.to_owned(),
            status,
            dtype: None,
            shape: None,
            mismatched_elements: None,
            max_abs_diff: None,
            max_rel_diff: None,
            first_mismatch: None,
            first_values: None,
            message: None,
            left_key: None,
            right_key: None,
            right_dtype: None,
            right_shape: None,
        }
    }

    fn with_message(mut self, message: impl Into<String>) -> Entry {
        self.message = Some(message.into());
        self
    }

    /// Adds `problem` to the entry, keeping the worse status.
    fn add_problem(&mut self, status: Status, problem: &str) {
        self.status = self.status.max(status);
        self.message = Some(match self.message.take() {
            Some(m) => format!("{m}; {problem}"),
            None => problem.to_owned(),
        });
    }
}

/// Entries per status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub matched: usize,
    pub mismatched: usize,
    pub missing: usize,
    pub unexpected: usize,
    pub errors: usize,
}

/// The result of [`diff`] or [`verify`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Always [`REPORT_KIND`].
    pub kind: &'static str,
    /// Always [`REPORT_VERSION`].
    pub version: u32,
    /// `diff` or `verify`.
    pub command: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub left: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub right: Option<String>,
    pub summary: Summary,
    /// What was not checked, or how keys were selected.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// One entry per FQN, serialized as a list sorted by FQN.
    #[serde(serialize_with = "entries_as_list")]
    pub entries: BTreeMap<String, Entry>,
}

fn entries_as_list<S: Serializer>(
    entries: &BTreeMap<String, Entry>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(entries.values())
}

impl Report {
    fn new(command: &'static str, left: Option<String>, right: Option<String>) -> Report {
        Report {
            kind: REPORT_KIND,
            version: REPORT_VERSION,
            command,
            left,
            right,
            summary: Summary::default(),
            notes: Vec::new(),
            entries: BTreeMap::new(),
        }
    }

    fn insert(&mut self, entry: Entry) {
        self.entries.insert(entry.fqn.clone(), entry);
    }

    /// Adds a problem found outside [`verify`] (a DeepSpeed partition's padding) as an entry of
    /// `status` named `fqn`.
    pub fn add_problem(&mut self, fqn: &str, status: Status, message: String) {
        self.insert(Entry::new(fqn, status).with_message(message));
        self.finish();
    }

    fn finish(&mut self) {
        let mut s = Summary::default();
        for e in self.entries.values() {
            match e.status {
                Status::Match => s.matched += 1,
                Status::Mismatch => s.mismatched += 1,
                Status::Missing => s.missing += 1,
                Status::Unexpected => s.unexpected += 1,
                Status::Error => s.errors += 1,
            }
        }
        self.summary = s;
    }

    /// Entries that are not [`Status::Match`].
    pub fn problems(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values().filter(|e| e.status != Status::Match)
    }

    /// The CLI's exit code: 2 when something could not be read or does not hold together
    /// (an `error` entry), 1 when anything else is not a match, 0 otherwise.
    pub fn exit_code(&self) -> u8 {
        if self.summary.errors > 0 {
            2
        } else {
            u8::from(self.problems().next().is_some())
        }
    }

    /// The report as pretty JSON (schema version 1), with a final newline.
    pub fn to_json(&self) -> String {
        // A report holds only strings, numbers and lists: serializing cannot fail.
        serde_json::to_string_pretty(self)
            .map_or_else(|e| format!("{{\"error\": \"{e}\"}}"), |s| s + "\n")
    }
}

/// One checkpoint to compare or verify.
#[derive(Clone, Copy)]
pub struct Side<'a> {
    pub index: &'a CheckpointIndex,
    pub source: &'a dyn Source,
    /// What the report calls it (a path).
    pub label: &'a str,
}

impl std::fmt::Debug for Side<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side")
            .field("label", &self.label)
            .field("entries", &self.index.entries.len())
            .finish_non_exhaustive()
    }
}

/// `torch.allclose` tolerances.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub rtol: f64,
    pub atol: f64,
    pub equal_nan: bool,
}

/// How [`diff`] compares.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DiffOptions {
    /// `None`: bitwise equality.
    pub tolerance: Option<Tolerance>,
    /// Compare only keys under this prefix, with the prefix stripped. A side with no key under it
    /// is taken whole (so `model.` selects the model of a DCP directory to compare with a plain
    /// safetensors file).
    pub select: Option<String>,
    /// Floating tensors of both sides are cast to this before they are compared (as `convert
    /// --dtype` casts them): a bf16 export against its fp32 source.
    pub cast: Option<DType>,
}

/// Called before each entry: `(done, total, key)`.
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize, &str);

/// Entries keyed by the name they are compared under.
type Keyed<'a> = BTreeMap<String, &'a IndexEntry>;

/// The entries of `index` under `prefix` (stripped), or `None` when no key is under it.
fn under<'a>(index: &'a CheckpointIndex, prefix: &str) -> Option<Keyed<'a>> {
    let dotted = format!("{prefix}.");
    let picked: Keyed<'a> = index
        .entries
        .iter()
        .filter_map(|e| e.key.strip_prefix(&dotted).map(|k| (k.to_owned(), e)))
        .collect();
    (!picked.is_empty()).then_some(picked)
}

fn whole(index: &CheckpointIndex) -> Keyed<'_> {
    index.entries.iter().map(|e| (e.key.clone(), e)).collect()
}

/// The entries of each side keyed by the names they are compared under, with notes saying how
/// `prefix` was applied. On each side that has keys under `prefix`, the prefix is either an
/// app-state wrapper (stripped: the side is the keys under it) or part of the names (the side is
/// taken whole): of the four choices the one under which most names match is taken, stripping
/// where it makes no difference. A DCP app state `model.model.embed_tokens.weight` thus meets HF's
/// own `model.embed_tokens.weight`. A side with no key under `prefix` is taken whole.
fn select<'a>(
    left: (&'a CheckpointIndex, &str),
    right: (&'a CheckpointIndex, &str),
    prefix: Option<&str>,
) -> (Keyed<'a>, Keyed<'a>, Vec<String>) {
    let Some(prefix) = prefix
        .map(|p| p.trim_end_matches('.'))
        .filter(|p| !p.is_empty())
    else {
        return (whole(left.0), whole(right.0), Vec::new());
    };
    // Each side's choices: (keys, stripped), stripping first.
    let choices = |index: &'a CheckpointIndex| -> Vec<(Keyed<'a>, bool)> {
        let mut c = Vec::new();
        if let Some(picked) = under(index, prefix) {
            c.push((picked, true));
        }
        c.push((whole(index), false));
        c
    };
    let (lc, rc) = (choices(left.0), choices(right.0));
    // A name counts when it matches and came from under the prefix on at least one side (a whole
    // side's names outside it, `step` next to `model`, would otherwise favour taking both whole).
    let dotted = format!("{prefix}.");
    let selected = |e: &IndexEntry, stripped: bool| stripped || e.key.starts_with(&dotted);
    let mut best: Option<(usize, usize, usize)> = None;
    for (i, (l, ls)) in lc.iter().enumerate() {
        for (j, (r, rs)) in rc.iter().enumerate() {
            let matching = l
                .iter()
                .filter(|(k, a)| {
                    r.get(*k)
                        .is_some_and(|b| selected(a, *ls) || selected(b, *rs))
                })
                .count();
            if best.is_none_or(|(m, _, _)| matching > m) {
                best = Some((matching, i, j));
            }
        }
    }
    let (_, i, j) = best.unwrap_or((0, lc.len() - 1, rc.len() - 1));
    let mut notes = Vec::new();
    let mut say = |label: &str, has: bool, stripped: bool, other_stripped: bool| {
        if !has {
            notes.push(format!(
                "{label}: no key under `{prefix}.`: the whole checkpoint is compared"
            ));
        } else if !stripped {
            notes.push(format!(
                "{label}: `{prefix}.` is kept as part of its names (stripped, fewer names would match the other side): the whole checkpoint is compared"
            ));
        } else if !other_stripped {
            notes.push(format!(
                "{label}: the keys under `{prefix}.` are compared, `{prefix}.` stripped"
            ));
        }
    };
    let (l_stripped, r_stripped) = (lc[i].1, rc[j].1);
    say(left.1, lc.len() == 2, l_stripped, r_stripped);
    say(right.1, rc.len() == 2, r_stripped, l_stripped);
    let mut lc = lc;
    let mut rc = rc;
    (lc.swap_remove(i).0, rc.swap_remove(j).0, notes)
}

/// Compares two checkpoints key by key ([`DiffPlan`] run over every key).
pub fn diff(
    left: Side<'_>,
    right: Side<'_>,
    options: &DiffOptions,
    progress: Progress<'_>,
) -> Report {
    let plan = DiffPlan::new(
        (left.index, left.label),
        (right.index, right.label),
        options,
    );
    let total = plan.keys().len();
    let mut entries = Vec::with_capacity(total);
    for (done, fqn) in plan.keys().iter().enumerate() {
        progress(done, total, fqn);
        entries.extend(plan.entry(done, left.source, right.source));
    }
    progress(total, total, "");
    plan.report(entries)
}

/// The stored key when it is not the FQN.
fn raw_name(e: &IndexEntry, fqn: &str) -> Option<String> {
    let raw = e.raw_key.as_deref().unwrap_or(&e.key);
    (raw != fqn).then(|| raw.to_owned())
}

fn compare_entries(
    fqn: &str,
    left: Side<'_>,
    a: &IndexEntry,
    right: Side<'_>,
    b: &IndexEntry,
    tolerance: Option<Tolerance>,
    cast: Option<DType>,
) -> Entry {
    let mut e = Entry::new(fqn, Status::Match);
    e.dtype = a.dtype;
    e.shape.clone_from(&a.shape);
    let a_tensor = a.kind == EntryKind::Tensor;
    let b_tensor = b.kind == EntryKind::Tensor;
    if !a_tensor || !b_tensor {
        if a_tensor != b_tensor {
            let what = |t: bool| if t { "a tensor" } else { "a non-tensor value" };
            e.add_problem(
                Status::Mismatch,
                &format!(
                    "{} on the left, {} on the right",
                    what(a_tensor),
                    what(b_tensor)
                ),
            );
            e.right_dtype = b.dtype;
            e.right_shape.clone_from(&b.shape);
            return e;
        }
        let va = left.index.read_bytes_value(left.source, a);
        let vb = right.index.read_bytes_value(right.source, b);
        match (va, vb) {
            (Ok(va), Ok(vb)) if va == vb => {}
            (Ok(va), Ok(vb)) => {
                e.first_values = Some([va.to_string(), vb.to_string()]);
                e.add_problem(Status::Mismatch, &format!("values differ: {va} vs {vb}"));
            }
            (Err(err), _) => e.add_problem(Status::Error, &format!("left: {err}")),
            (_, Err(err)) => e.add_problem(Status::Error, &format!("right: {err}")),
        }
        return e;
    }
    // With a cast, floating tensors are compared as that dtype.
    let as_cast = |d: Option<DType>| d.map(|d| crate::cast::cast_target(d, cast));
    if as_cast(a.dtype) != as_cast(b.dtype) {
        e.right_dtype = b.dtype;
        e.add_problem(
            Status::Mismatch,
            &format!("dtype {} vs {}", dtype_name(a.dtype), dtype_name(b.dtype)),
        );
    } else if a.dtype != b.dtype {
        e.right_dtype = b.dtype;
    }
    if a.shape != b.shape {
        e.right_shape.clone_from(&b.shape);
        e.add_problem(
            Status::Mismatch,
            &format!(
                "shape {} vs {}",
                shape_name(a.shape.as_deref()),
                shape_name(b.shape.as_deref())
            ),
        );
    }
    if e.status != Status::Match {
        return e;
    }
    let (Some(dtype), Some(bdtype)) = (a.dtype, b.dtype) else {
        e.add_problem(Status::Error, "tensor without a dtype");
        return e;
    };
    let target = crate::cast::cast_target(dtype, cast);
    if a.shape.is_some() {
        let ta = left
            .index
            .read_tensor(left.source, a)
            .and_then(|t| cast_read(t, &a.key, dtype, target));
        let tb = right
            .index
            .read_tensor(right.source, b)
            .and_then(|t| cast_read(t, &b.key, bdtype, target));
        match (ta, tb) {
            (Ok(ta), Ok(tb)) => {
                let d = compare_values(target, &ta.bytes, &tb.bytes, tolerance);
                apply_diff(&mut e, &d, &ta.shape, "");
            }
            (Err(err), _) => e.add_problem(Status::Error, &format!("left: {err}")),
            (_, Err(err)) => e.add_problem(Status::Error, &format!("right: {err}")),
        }
        return e;
    }
    if target != dtype || target != bdtype {
        e.add_problem(
            Status::Error,
            "rank-local pieces are compared as stored: --dtype does not apply to them",
        );
        return e;
    }
    compare_rank_local(&mut e, dtype, left, a, right, b, tolerance);
    e
}

/// A tensor read as `from`, cast to `to` (as `convert --dtype` casts).
fn cast_read(
    mut t: crate::index::TensorData,
    key: &str,
    from: DType,
    to: DType,
) -> Result<crate::index::TensorData, crate::index::IndexError> {
    if from == to {
        return Ok(t);
    }
    let numel = t.bytes.len() / from.size_bytes().max(1);
    let need = numel.saturating_mul(from.size_bytes().max(to.size_bytes()));
    t.bytes.resize(need, 0);
    let n = crate::cast::cast_in_place(&mut t.bytes, numel, from, to).map_err(|e| {
        crate::index::IndexError::NotReadable {
            key: key.to_owned(),
            what: e.to_string(),
        }
    })?;
    t.bytes.truncate(n);
    Ok(t)
}

/// Rank-local pieces (no global shape): the same pieces on the same ranks, with equal values.
fn compare_rank_local(
    e: &mut Entry,
    dtype: DType,
    left: Side<'_>,
    a: &IndexEntry,
    right: Side<'_>,
    b: &IndexEntry,
    tolerance: Option<Tolerance>,
) {
    type PieceKey = (Option<u32>, Vec<u64>, Vec<u64>);
    let pieces = |x: &IndexEntry| -> BTreeMap<PieceKey, usize> {
        x.chunks
            .iter()
            .enumerate()
            .map(|(i, c)| ((c.rank, c.offsets.to_vec(), c.sizes.to_vec()), i))
            .collect()
    };
    let pa = pieces(a);
    let pb = pieces(b);
    if pa.keys().ne(pb.keys()) {
        let describe = |p: &BTreeMap<PieceKey, usize>| {
            p.keys()
                .map(|(r, _, s)| format!("r{}:{s:?}", r.map_or("?".into(), |r| r.to_string())))
                .collect::<Vec<_>>()
                .join(" ")
        };
        e.add_problem(
            Status::Mismatch,
            &format!(
                "rank-local pieces differ: {} vs {}",
                describe(&pa),
                describe(&pb)
            ),
        );
        return;
    }
    let mut total = 0u64;
    for ((rank, _, sizes), &ia) in &pa {
        let ib = pb[&(*rank, a.chunks[ia].offsets.to_vec(), sizes.clone())];
        let da = left.index.read_chunk(left.source, a, &a.chunks[ia]);
        let db = right.index.read_chunk(right.source, b, &b.chunks[ib]);
        match (da, db) {
            (Ok(da), Ok(db)) => {
                let d = compare_values(dtype, &da.bytes, &db.bytes, tolerance);
                total += d.mismatched;
                if d.mismatched > 0 && e.first_mismatch.is_none() {
                    let rank = rank.map_or("?".into(), |r| r.to_string());
                    apply_diff(e, &d, sizes, &format!(" in rank {rank}'s piece"));
                }
            }
            (Err(err), _) => e.add_problem(Status::Error, &format!("left: {err}")),
            (_, Err(err)) => e.add_problem(Status::Error, &format!("right: {err}")),
        }
    }
    if total > 0 {
        e.mismatched_elements = Some(total);
    }
}

fn dtype_name(d: Option<DType>) -> &'static str {
    d.map_or("none", DType::name)
}

fn shape_name(s: Option<&[u64]>) -> String {
    s.map_or_else(|| "rank-local".into(), |s| format!("{s:?}"))
}

/// What differs between two buffers of one dtype.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValueDiff {
    pub mismatched: u64,
    /// Row-major element index of the first difference.
    pub first: Option<u64>,
    pub first_values: Option<[String; 2]>,
    pub max_abs: Option<f64>,
    pub max_rel: Option<f64>,
}

fn apply_diff(e: &mut Entry, d: &ValueDiff, shape: &[u64], where_: &str) {
    if d.mismatched == 0 {
        return;
    }
    e.mismatched_elements = Some(d.mismatched);
    e.max_abs_diff = d.max_abs;
    e.max_rel_diff = d.max_rel;
    e.first_values.clone_from(&d.first_values);
    let index = d.first.map(|i| unravel(i, shape));
    let mut msg = format!("{} element(s) differ{where_}", d.mismatched);
    if let (Some(index), Some([l, r])) = (&index, &d.first_values) {
        let _ = write!(msg, ", first at {index:?}: {l} vs {r}");
    }
    e.first_mismatch = index;
    e.add_problem(Status::Mismatch, &msg);
}

/// Row-major index of element `i` in `shape`.
fn unravel(mut i: u64, shape: &[u64]) -> Vec<u64> {
    let mut out = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            out[d] = i % n;
            i /= n;
        }
    }
    out
}

/// One element as one or two (complex) f64 components.
fn components(dtype: DType, b: &[u8]) -> [f64; 2] {
    dtype.element_f64(b)
}

fn value_text(dtype: DType, c: [f64; 2]) -> String {
    match dtype {
        DType::Complex32 | DType::Complex64 | DType::Complex128 => {
            format!("{}{:+}j", c[0], c[1])
        }
        DType::Bool => (c[0] != 0.0).to_string(),
        _ => format!("{}", c[0]),
    }
}

/// Compares two buffers of `dtype` elements (same length); bitwise unless a tolerance is given
/// and the dtype is floating point or complex.
pub fn compare_values(dtype: DType, a: &[u8], b: &[u8], tolerance: Option<Tolerance>) -> ValueDiff {
    let item = dtype.size_bytes();
    let mut d = ValueDiff::default();
    if a.len() != b.len() {
        d.mismatched = (a.len().max(b.len()) / item) as u64;
        return d;
    }
    let inexact = dtype.is_floating_point() || dtype.is_complex();
    let tolerance = tolerance.filter(|_| inexact);
    let note = |d: &mut ValueDiff, i: usize, ea: &[u8], eb: &[u8]| {
        let ca = components(dtype, ea);
        let cb = components(dtype, eb);
        if let Some(t) = tolerance
            && close(ca, cb, t)
        {
            return;
        }
        d.mismatched += 1;
        if d.first.is_none() {
            d.first = Some(i as u64);
            d.first_values = Some([value_text(dtype, ca), value_text(dtype, cb)]);
        }
        let abs = (ca[0] - cb[0]).hypot(ca[1] - cb[1]);
        if abs.is_finite() {
            d.max_abs = Some(d.max_abs.map_or(abs, |m| m.max(abs)));
            let rel = abs / cb[0].hypot(cb[1]);
            if rel.is_finite() {
                d.max_rel = Some(d.max_rel.map_or(rel, |m| m.max(rel)));
            }
        }
    };
    if tolerance.is_some() {
        for (i, (ea, eb)) in a.chunks_exact(item).zip(b.chunks_exact(item)).enumerate() {
            note(&mut d, i, ea, eb);
        }
        return d;
    }
    // Bitwise: skip equal blocks with a memcmp, look at elements only inside differing blocks.
    let block = item * 1024;
    for (k, (ba, bb)) in a.chunks(block).zip(b.chunks(block)).enumerate() {
        if ba == bb {
            continue;
        }
        for (j, (ea, eb)) in ba.chunks_exact(item).zip(bb.chunks_exact(item)).enumerate() {
            if ea != eb {
                note(&mut d, k * 1024 + j, ea, eb);
            }
        }
    }
    d
}

/// `torch.isclose` for one (possibly complex) element.
fn close(a: [f64; 2], b: [f64; 2], t: Tolerance) -> bool {
    let a_nan = a[0].is_nan() || a[1].is_nan();
    let b_nan = b[0].is_nan() || b[1].is_nan();
    if a_nan || b_nan {
        return t.equal_nan && a_nan && b_nan;
    }
    // Equal values (infinities of one sign included) are close; `==` is the point here.
    #[allow(clippy::float_cmp)]
    if a == b {
        return true;
    }
    let diff = (a[0] - b[0]).hypot(a[1] - b[1]);
    diff.is_finite() && diff <= t.atol + t.rtol * b[0].hypot(b[1])
}

/// How [`verify`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyOptions<'a> {
    /// Read every chunk and non-tensor item (catches undecodable items); otherwise only the
    /// index is checked, plus the values of replicated chunks.
    pub read_values: bool,
    /// The FSDP1 layout an FSDP1 LOCAL_STATE_DICT checkpoint was written under: its flat
    /// parameters must have the layout's sizes, rank pieces and zero padding segments.
    pub fsdp1_layout: Option<&'a Fsdp1Layout>,
}

impl Default for VerifyOptions<'_> {
    fn default() -> Self {
        VerifyOptions {
            read_values: true,
            fsdp1_layout: None,
        }
    }
}

/// Checks one checkpoint against itself: chunks tile each tensor and lie inside their files
/// ([`CheckpointIndex::check`]); every chunk and item decodes (with `read_values`); replicas of a
/// chunk on different ranks hold the same values, and a 0-dim state (`step`) held by several
/// ranks for one (flat) parameter holds one value; optimizer state keyed by FQN names parameters
/// the checkpoint's model holds (when it holds a model).
pub fn verify(side: Side<'_>, options: VerifyOptions<'_>, progress: Progress<'_>) -> Report {
    let index = side.index;
    let mut report = Report::new("verify", Some(side.label.to_owned()), None);
    for e in &index.entries {
        let mut entry = Entry::new(&e.key, Status::Match);
        entry.dtype = e.dtype;
        entry.shape.clone_from(&e.shape);
        entry.left_key = raw_name(e, &e.key);
        report.insert(entry);
    }
    let mut broken: BTreeSet<String> = BTreeSet::new();
    for p in index.check() {
        broken.insert(p.key.clone());
        let text = p.to_string();
        let text = text
            .strip_prefix(&format!("{}: ", p.key))
            .unwrap_or(&text)
            .to_owned();
        match report.entries.get_mut(&p.key) {
            Some(e) => e.add_problem(Status::Error, &text),
            None => report.insert(Entry::new(&p.key, Status::Error).with_message(text)),
        }
    }
    let total = index.entries.len();
    for (done, e) in index.entries.iter().enumerate() {
        progress(done, total, &e.key);
        if broken.contains(&e.key) {
            continue;
        }
        let mut problems: Vec<(Status, String)> = Vec::new();
        match e.kind {
            EntryKind::Tensor => check_chunks(side, e, options, &mut problems),
            EntryKind::Bytes if options.read_values => {
                if let Err(err) = index.read_bytes_value(side.source, e) {
                    problems.push((Status::Error, err.to_string()));
                }
            }
            EntryKind::Bytes | EntryKind::Scalar => {}
        }
        if let Some(entry) = report.entries.get_mut(&e.key) {
            for (status, text) in problems {
                entry.add_problem(status, &text);
            }
        }
    }
    progress(total, total, "");
    check_optimizer_keys(index, &mut report);
    if let Some(layout) = options.fsdp1_layout {
        if index.kind == CheckpointKind::Fsdp1Local {
            check_fsdp1_local(side, layout, &broken, options.read_values, &mut report);
        } else {
            report.notes.push(format!(
                "the checkpoint is {}, not an FSDP1 LOCAL_STATE_DICT: it was not checked against the layout",
                index.kind.describe()
            ));
        }
    }
    report.finish();
    report
}

/// FSDP1 LOCAL_STATE_DICT against its layout (FSDP_SPEC §2.4): `<unit>._flat_param` is a 1-D
/// tensor of `_unpadded_unsharded_size` elements (padding segments included) whose rank `r` piece
/// starts at `C*r` and holds `C - _shard_numel_padded` elements (`C` = `_sharded_size`). With
/// `use_orig_params=True` the dict also holds every parameter's 1-D per-rank view: each must be
/// as long as the layout's `numel_in_shard` and equal the flat parameter's elements at the
/// layout's `offset_in_shard`, which places the padding segments where the layout says. Padding
/// values are not checked: torch fills them with 42 or 0 depending on the release, and weight
/// decay changes them.
#[allow(
    clippy::too_many_lines,
    reason = "every flat parameter and its use_orig_params views checked against the layout, with a report line each"
)]
fn check_fsdp1_local(
    side: Side<'_>,
    layout: &Fsdp1Layout,
    broken: &BTreeSet<String>,
    read_values: bool,
    report: &mut Report,
) {
    let index = side.index;
    // A folder of model and optimizer files keeps the model under `model.`.
    let prefix = if layout
        .flat_params
        .iter()
        .any(|f| index.entry(&f.flat_param_fqn).is_some())
    {
        ""
    } else {
        "model."
    };
    let expected: BTreeSet<String> = layout
        .flat_params
        .iter()
        .map(|f| format!("{prefix}{}", f.flat_param_fqn))
        .collect();
    for e in index.entries.iter().filter(|e| e.flat_param) {
        if !expected.contains(&e.key)
            && let Some(entry) = report.entries.get_mut(&e.key)
        {
            entry.add_problem(
                Status::Unexpected,
                "a flat parameter the layout does not have (different wrapping?)",
            );
        }
    }
    for fp in &layout.flat_params {
        let flat_key = format!("{prefix}{}", fp.flat_param_fqn);
        let Some(e) = index.entry(&flat_key) else {
            let mut entry = Entry::new(&flat_key, Status::Missing).with_message(
                "the layout has this flat parameter, the checkpoint does not (different wrapping?)",
            );
            entry.dtype = Some(fp.dtype);
            entry.shape = Some(vec![fp.unpadded_unsharded_numel]);
            report.insert(entry);
            continue;
        };
        let mut problems = Vec::new();
        let want_shape = vec![fp.unpadded_unsharded_numel];
        if e.shape.as_ref() != Some(&want_shape) {
            problems.push(format!(
                "holds {} elements, the layout's flat parameter {} (padding segments included)",
                shape_name(e.shape.as_deref()),
                fp.unpadded_unsharded_numel
            ));
        }
        if e.dtype != Some(fp.dtype) {
            problems.push(format!(
                "dtype {}, the layout says {}",
                dtype_name(e.dtype),
                fp.dtype
            ));
        }
        let c = fp.sharded_numel;
        let want: BTreeSet<(u64, u64)> = fp
            .ranks
            .iter()
            .filter_map(|r| {
                let len = c.saturating_sub(r.shard_numel_padded);
                (len > 0).then(|| (c.saturating_mul(r.rank), len))
            })
            .collect();
        let got: BTreeSet<(u64, u64)> = e
            .chunks
            .iter()
            .filter(|ch| ch.numel() != Some(0))
            .map(|ch| {
                (
                    ch.offsets.first().copied().unwrap_or(0),
                    ch.sizes.first().copied().unwrap_or(0),
                )
            })
            .collect();
        if want != got {
            let show = |s: &BTreeSet<(u64, u64)>| {
                s.iter()
                    .map(|(o, n)| format!("[{o}..{})", o.saturating_add(*n)))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            problems.push(format!(
                "rank pieces {}, the layout says {} (shard size {c})",
                show(&got),
                show(&want)
            ));
        }
        let flat = if problems.is_empty() && read_values && !broken.contains(&e.key) {
            match index.read_tensor(side.source, e) {
                Ok(data) => Some(data.bytes),
                Err(err) => {
                    problems.push(err.to_string());
                    None
                }
            }
        } else {
            None
        };
        if problems.is_empty() {
            check_param_views(side, fp, prefix, flat.as_deref(), report);
        }
        if let Some(entry) = report.entries.get_mut(&e.key) {
            for p in problems {
                entry.add_problem(Status::Mismatch, &p);
            }
        }
    }
}

/// Reads the chunks of one tensor entry: every one with `read_values`, otherwise the replicated
/// ones; replicas (same box, several ranks) must hold equal bytes.
fn check_chunks(
    side: Side<'_>,
    e: &IndexEntry,
    options: VerifyOptions<'_>,
    problems: &mut Vec<(Status, String)>,
) {
    // Identical boxes: replicas of one piece. For rank-local entries (no global shape) only 0-dim
    // pieces are replicas (a flat parameter's `step`); equal-sized 1-D pieces are different shards.
    let mut groups: BTreeMap<(Vec<u64>, Vec<u64>), Vec<usize>> = BTreeMap::new();
    for (i, c) in e.chunks.iter().enumerate() {
        let replica = e.shape.is_some() || c.sizes.is_empty();
        let key = if replica {
            (c.offsets.to_vec(), c.sizes.to_vec())
        } else {
            (vec![u64::MAX, i as u64], c.sizes.to_vec())
        };
        groups.entry(key).or_default().push(i);
    }
    for members in groups.values() {
        if members.len() < 2 && !options.read_values {
            continue;
        }
        let mut first: Option<(usize, Vec<u8>)> = None;
        for &i in members {
            let c = &e.chunks[i];
            let data = match side.index.read_chunk(side.source, e, c) {
                Ok(d) => d,
                Err(err) => {
                    problems.push((Status::Error, err.to_string()));
                    continue;
                }
            };
            let Some(dtype) = e.dtype else { continue };
            match &first {
                None => first = Some((i, data.bytes)),
                Some((j, bytes)) => {
                    let d = compare_values(dtype, bytes, &data.bytes, None);
                    if d.mismatched > 0 {
                        let rank = |k: usize| {
                            e.chunks[k]
                                .rank
                                .map_or_else(|| format!("chunk {k}"), |r| format!("rank {r}"))
                        };
                        let at = d.first.map(|x| unravel(x, &c.sizes)).unwrap_or_default();
                        let values = d
                            .first_values
                            .map_or(String::new(), |[l, r]| format!(": {l} vs {r}"));
                        problems.push((
                            Status::Mismatch,
                            format!(
                                "replicas of the piece at {:?} disagree: {} and {} differ in {} element(s), first at {at:?}{values}",
                                c.offsets,
                                rank(*j),
                                rank(i),
                                d.mismatched
                            ),
                        ));
                    }
                }
            }
        }
    }
}

/// The per-rank 1-D parameter views of a `use_orig_params=True` LOCAL state dict against the
/// layout's `_ShardParamInfo`s (and against the flat parameter's bytes when read).
fn check_param_views(
    side: Side<'_>,
    fp: &FlatParamLayout,
    prefix: &str,
    flat: Option<&[u8]>,
    report: &mut Report,
) {
    let index = side.index;
    let item = fp.dtype.size_bytes();
    let c = fp.sharded_numel;
    let group = fp.ranks.len().max(1) as u64;
    for (i, fqn) in fp.fqns.iter().enumerate() {
        let Some(e) = index
            .entry(&format!("{prefix}{fqn}"))
            .filter(|e| e.shape.is_none() && e.kind == EntryKind::Tensor)
        else {
            continue;
        };
        let mut problems = Vec::new();
        for ch in &e.chunks {
            let Some(rank) = ch.rank else { continue };
            let Some(info) = fp
                .ranks
                .get((u64::from(rank) % group) as usize)
                .and_then(|r| r.shard_param_infos.get(i))
            else {
                continue;
            };
            let want = if info.in_shard {
                info.numel_in_shard.unwrap_or(0)
            } else {
                0
            };
            let got = ch.numel().unwrap_or(u64::MAX);
            if ch.sizes.len() != 1 || got != want {
                problems.push(format!(
                    "rank {rank} holds {:?} elements, the layout puts {want} of it in that rank's shard",
                    ch.sizes
                ));
                continue;
            }
            let (Some(flat), Some(offset)) = (flat, info.offset_in_shard) else {
                continue;
            };
            let begin = c
                .saturating_mul(u64::from(rank) % group)
                .saturating_add(offset);
            let end = begin.saturating_add(want);
            let expected = flat.get(begin as usize * item..end as usize * item);
            match index.read_chunk(side.source, e, ch) {
                Ok(data) if Some(data.bytes.as_slice()) == expected => {}
                Ok(_) => problems.push(format!(
                    "rank {rank}'s view differs from the flat parameter's elements [{begin}..{end}), where the layout puts it"
                )),
                Err(err) => problems.push(err.to_string()),
            }
        }
        if let Some(entry) = report.entries.get_mut(fqn) {
            for p in problems {
                entry.add_problem(Status::Mismatch, &p);
            }
        }
    }
}

/// Optimizer state keyed by FQN must name parameters the model holds. Skipped (with a note) when
/// the checkpoint holds no model tensors or keys its optimizer state by integer ids.
fn check_optimizer_keys(index: &CheckpointIndex, report: &mut Report) {
    let model_keys: Vec<&str> = index
        .entries
        .iter()
        .filter(|e| e.role.is_none() && e.kind == EntryKind::Tensor)
        .map(|e| e.key.as_str())
        .collect();
    let mut by_id = false;
    let mut by_fqn: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for e in &index.entries {
        if let Some(Role::OptimizerState { param, .. }) = &e.role {
            match param {
                PathSeg::Key(p) if !p.is_empty() && !p.bytes().all(|c| c.is_ascii_digit()) => {
                    by_fqn.entry(p.as_str()).or_default().push(&e.key);
                }
                _ => by_id = true,
            }
        }
    }
    if by_fqn.is_empty() {
        if by_id {
            report.notes.push(
                "optimizer state is keyed by parameter ids, not FQNs: its keys were not matched against the model".into(),
            );
        }
        return;
    }
    if model_keys.is_empty() {
        report.notes.push(
            "the checkpoint holds no model tensors: optimizer FQNs were not matched against model keys".into(),
        );
        return;
    }
    for (param, keys) in by_fqn {
        let dotted = format!(".{param}");
        let known = model_keys
            .iter()
            .any(|k| *k == param || k.ends_with(&dotted));
        if known {
            continue;
        }
        for key in keys {
            if let Some(entry) = report.entries.get_mut(key) {
                entry.add_problem(
                    Status::Unexpected,
                    &format!(
                        "optimizer state for parameter `{param}`, which the model does not hold"
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::float_cmp, clippy::many_single_char_names)]
    use super::*;

    #[test]
    fn bitwise_finds_every_difference_and_the_first_index() {
        let a: Vec<u8> = (0..3000u32)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let mut b = a.clone();
        b[4 * 2500..4 * 2501].copy_from_slice(&7.5f32.to_le_bytes());
        b[4 * 2999..].copy_from_slice(&(-1.0f32).to_le_bytes());
        let d = compare_values(DType::Float32, &a, &b, None);
        assert_eq!(d.mismatched, 2);
        assert_eq!(d.first, Some(2500));
        assert_eq!(d.first_values, Some(["2500".into(), "7.5".into()]));
        assert_eq!(d.max_abs, Some(3000.0));
        assert_eq!(unravel(2500, &[30, 100]), vec![25, 0]);
        assert_eq!(unravel(0, &[]), Vec::<u64>::new());
    }

    #[test]
    fn tolerance_follows_allclose() {
        let enc = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let t = Tolerance {
            rtol: 1e-3,
            atol: 0.0,
            equal_nan: false,
        };
        // |a - b| <= atol + rtol * |b|: asymmetric in b, as in torch.
        let a = enc(&[1.0, f32::NAN, f32::INFINITY]);
        let b = enc(&[1.000_9, f32::NAN, f32::INFINITY]);
        assert_eq!(
            compare_values(DType::Float32, &a, &b, Some(t)).mismatched,
            1
        );
        let t_nan = Tolerance {
            equal_nan: true,
            ..t
        };
        assert_eq!(
            compare_values(DType::Float32, &a, &b, Some(t_nan)).mismatched,
            0
        );
        // Bitwise: 1.0 vs 1.0009 differ, identical NaN bits agree.
        assert_eq!(compare_values(DType::Float32, &a, &b, None).mismatched, 1);
        // Integers ignore the tolerance.
        let i = 5i64.to_le_bytes();
        let j = 6i64.to_le_bytes();
        let loose = Tolerance {
            rtol: 1.0,
            atol: 1.0,
            equal_nan: false,
        };
        assert_eq!(
            compare_values(DType::Int64, &i, &j, Some(loose)).mismatched,
            1
        );
    }

    #[test]
    fn fp8_decoding() {
        // torch.tensor([1.0, -2.0, 448.0, 0.001953125]).to(torch.float8_e4m3fn) bytes: 0x38 0xc0 0x7e 0x01
        let f8e4m3fn = |b: u8| components(DType::Float8E4M3Fn, &[b])[0];
        assert_eq!(f8e4m3fn(0x38), 1.0);
        assert_eq!(f8e4m3fn(0xc0), -2.0);
        assert_eq!(f8e4m3fn(0x7e), 448.0);
        assert_eq!(f8e4m3fn(0x01), 0.001_953_125);
        assert!(f8e4m3fn(0x7f).is_nan());
        // e5m2 1.5 = 0x3e
        assert_eq!(components(DType::Float8E5M2, &[0x3e])[0], 1.5);
    }
}
