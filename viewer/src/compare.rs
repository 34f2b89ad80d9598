//! A/B compare: two checkpoints opened through `Checkpoint::open` (as every front end opens
//! them) and compared by `shardscope_core::verify::diff`, the code behind `shardscope diff
//! --json`. The diff streams tensor by tensor (one tensor of each side in memory at a time); on
//! the desktop it runs on a worker thread that reports its progress and can be cancelled.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_core::source::{Source, SourceError};
use shardscope_core::verify::{self, DiffOptions, Side, Status, Tolerance};

use crate::checkpoint::{CheckpointError, Origin};
use crate::format::shape as fmt_shape;
use crate::job::Job;
pub use crate::job::{CompareError, Progress};

/// One side of a comparison: what the report calls it (a path) and where its files are.
#[derive(Debug, Clone)]
pub struct CompareInput {
    pub label: String,
    pub origin: Origin,
}

/// A checkpoint opened again from its files, and the source it reads them from.
pub type Reopened = (
    Box<dyn shardscope_core::source::Source + Send + Sync>,
    Checkpoint,
);

impl CompareInput {
    /// The checkpoint opened again from its files (`side` names it in errors: "A", "B").
    pub fn open(
        &self,
        side: &'static str,
        options: &ReadOptions,
    ) -> Result<Reopened, CompareError> {
        let source = self
            .origin
            .source()
            .map_err(|source| CompareError::Open { side, source })?;
        let checkpoint =
            Checkpoint::open(&*source, &self.label, options).map_err(|e| CompareError::Open {
                side,
                source: CheckpointError::Open {
                    message: e.to_string(),
                },
            })?;
        Ok((source, checkpoint))
    }

    /// A file or folder on disk, labelled with its path as `shardscope diff` labels it.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_path(path: &std::path::Path) -> Result<Self, CheckpointError> {
        Ok(Self {
            label: path.display().to_string(),
            origin: Origin::from_path(path)?,
        })
    }
}

/// The compare view's tolerance controls, as the user types them: off is `diff` without flags
/// (bitwise), on is `diff --rtol R --atol A [--equal-nan]` (`|a-b| <= atol + rtol*|b|`, as
/// `torch.allclose`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToleranceInput {
    pub on: bool,
    pub rtol: String,
    pub atol: String,
    pub equal_nan: bool,
}

impl Default for ToleranceInput {
    /// torch.allclose's defaults (`shardscope diff`'s for a missing `--rtol`/`--atol`), off.
    fn default() -> Self {
        Self {
            on: false,
            rtol: "1e-5".to_owned(),
            atol: "1e-8".to_owned(),
            equal_nan: false,
        }
    }
}

impl ToleranceInput {
    /// The tolerance the controls stand for (`None`: bitwise), or why they stand for none, with
    /// `diff`'s rule: finite and not negative.
    pub fn tolerance(&self) -> Result<Option<Tolerance>, String> {
        if !self.on {
            return Ok(None);
        }
        let parse = |what: &str, text: &str| {
            text.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| {
                    format!("{what} must be a finite number, not negative (got `{text}`)")
                })
        };
        Ok(Some(Tolerance {
            rtol: parse("rtol", &self.rtol)?,
            atol: parse("atol", &self.atol)?,
            equal_nan: self.equal_nan,
        }))
    }
}

/// The `shardscope diff` flags of a tolerance (empty for bitwise).
pub fn tolerance_flags(t: Option<Tolerance>) -> String {
    t.map_or_else(String::new, |t| {
        format!(
            "--rtol {} --atol {}{}",
            t.rtol,
            t.atol,
            if t.equal_nan { " --equal-nan" } else { "" }
        )
    })
}

/// What a tensor's row says, finer than the report's status: a `mismatch` is either different
/// values or a changed dtype, shape or kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RowStatus {
    /// Bitwise equal (or within the tolerance).
    Equal,
    /// Same dtype and shape, different values.
    Differs,
    /// Different dtype, shape, kind (tensor vs value) or rank-local pieces.
    Changed,
    /// Only in A (`missing` in the report).
    OnlyA,
    /// Only in B (`unexpected` in the report).
    OnlyB,
    /// Could not be read on one side.
    Error,
}

impl RowStatus {
    pub const ALL: [RowStatus; 6] = [
        RowStatus::Equal,
        RowStatus::Differs,
        RowStatus::Changed,
        RowStatus::OnlyA,
        RowStatus::OnlyB,
        RowStatus::Error,
    ];

    pub const fn label(self) -> &'static str {
        match self {
            RowStatus::Equal => "equal",
            RowStatus::Differs => "differs",
            RowStatus::Changed => "dtype/shape changed",
            RowStatus::OnlyA => "only in A",
            RowStatus::OnlyB => "only in B",
            RowStatus::Error => "error",
        }
    }

    /// The row status of a report entry.
    pub fn of(e: &verify::Entry) -> Self {
        match e.status {
            Status::Match => RowStatus::Equal,
            Status::Missing => RowStatus::OnlyA,
            Status::Unexpected => RowStatus::OnlyB,
            Status::Error => RowStatus::Error,
            // Values were compared (tensor elements, or two decoded values): they differ.
            // Otherwise the comparison stopped at the dtype, shape, kind or pieces.
            Status::Mismatch
                if e.right_dtype.is_none()
                    && e.right_shape.is_none()
                    && (e.mismatched_elements.is_some() || e.first_values.is_some()) =>
            {
                RowStatus::Differs
            }
            Status::Mismatch => RowStatus::Changed,
        }
    }
}

/// One tensor (or value) of the comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct CompareRow {
    /// The report's entry, exactly as `shardscope diff --json` writes it.
    pub entry: verify::Entry,
    pub status: RowStatus,
    /// The module (dotted prefix, `""` at the top) and the name within it.
    pub module: String,
    pub name: String,
}

impl CompareRow {
    /// `float32` or `float32 -> bfloat16`.
    pub fn dtype_text(&self) -> String {
        let a = self.entry.dtype.map_or("", |d| d.name());
        match self.entry.right_dtype {
            Some(b) => format!("{a} -> {}", b.name()),
            None => a.to_owned(),
        }
    }

    /// `[4, 4]` or `[8, 4] -> [10, 4]`.
    pub fn shape_text(&self) -> String {
        let s = |s: Option<&Vec<u64>>| s.map_or_else(|| "rank-local".to_owned(), |s| fmt_shape(s));
        match &self.entry.right_shape {
            Some(b) => format!("{} -> {}", s(self.entry.shape.as_ref()), s(Some(b))),
            None if self.entry.shape.is_none() && self.entry.dtype.is_none() => String::new(),
            None => s(self.entry.shape.as_ref()),
        }
    }
}

/// The result of a comparison.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub left: String,
    pub right: String,
    /// `diff`'s report (serializes to exactly `shardscope diff --json`).
    pub report: verify::Report,
    /// One row per entry, sorted by FQN.
    pub rows: Vec<CompareRow>,
    /// Rows per status, in [`RowStatus::ALL`] order.
    pub counts: [usize; 6],
    /// How each checkpoint was read (`Checkpoint::notes`), and the report's notes.
    pub notes: Vec<String>,
}

impl Comparison {
    /// Rows from `diff`'s report.
    pub fn from_report(report: verify::Report, notes: Vec<String>) -> Self {
        let rows: Vec<CompareRow> = report
            .entries
            .values()
            .map(|e| {
                let (module, name) = e
                    .fqn
                    .rsplit_once('.')
                    .map_or((String::new(), e.fqn.clone()), |(m, n)| {
                        (m.to_owned(), n.to_owned())
                    });
                CompareRow {
                    status: RowStatus::of(e),
                    entry: e.clone(),
                    module,
                    name,
                }
            })
            .collect();
        let mut counts = [0; 6];
        for r in &rows {
            counts[r.status as usize] += 1;
        }
        let mut all_notes = notes;
        all_notes.extend(report.notes.iter().cloned());
        Self {
            left: report.left.clone().unwrap_or_default(),
            right: report.right.clone().unwrap_or_default(),
            report,
            rows,
            counts,
            notes: all_notes,
        }
    }

    /// `12 tensors: 9 equal, 1 differs, 1 only in A, 1 only in B` (statuses with no row left
    /// out).
    pub fn summary(&self) -> String {
        let parts: Vec<String> = RowStatus::ALL
            .iter()
            .zip(self.counts)
            .filter(|(_, n)| *n > 0)
            .map(|(s, n)| format!("{n} {}", s.label()))
            .collect();
        format!("{} tensors: {}", self.rows.len(), parts.join(", "))
    }
}

/// Which rows are shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    /// Statuses shown.
    pub statuses: BTreeSet<RowStatus>,
    /// Substring of the FQN (empty: all).
    pub name: String,
}

impl Default for Filter {
    fn default() -> Self {
        Self {
            statuses: RowStatus::ALL.into_iter().collect(),
            name: String::new(),
        }
    }
}

impl Filter {
    pub fn accepts(&self, row: &CompareRow) -> bool {
        self.statuses.contains(&row.status)
            && (self.name.is_empty() || row.entry.fqn.contains(self.name.as_str()))
    }
}

/// A line of the grouped list: a module header, or a tensor row (index into
/// [`Comparison::rows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    Module {
        module: String,
        /// Rows of the module that pass the filter, per status ([`RowStatus::ALL`] order).
        counts: [usize; 6],
        collapsed: bool,
    },
    Row(usize),
}

/// The rows passing `filter`, grouped by module (in FQN order), each group under its header;
/// rows of `collapsed` modules are left out.
pub fn lines(c: &Comparison, filter: &Filter, collapsed: &BTreeSet<String>) -> Vec<Line> {
    let mut groups: std::collections::BTreeMap<&str, Vec<usize>> =
        std::collections::BTreeMap::new();
    for (i, r) in c.rows.iter().enumerate() {
        if filter.accepts(r) {
            groups.entry(r.module.as_str()).or_default().push(i);
        }
    }
    let mut out = Vec::new();
    for (module, rows) in groups {
        let mut counts = [0; 6];
        for &i in &rows {
            counts[c.rows[i].status as usize] += 1;
        }
        let is_collapsed = collapsed.contains(module);
        out.push(Line::Module {
            module: module.to_owned(),
            counts,
            collapsed: is_collapsed,
        });
        if !is_collapsed {
            out.extend(rows.into_iter().map(Line::Row));
        }
    }
    out
}

/// A source whose reads fail once `cancel` is set, so that a running `diff` finishes quickly
/// (every later tensor an error) and its report can be dropped.
struct Cancellable<'a> {
    inner: &'a dyn Source,
    cancel: &'a AtomicBool,
}

impl Cancellable<'_> {
    fn check(&self, name: &str) -> Result<(), SourceError> {
        if self.cancel.load(Ordering::Relaxed) {
            return Err(SourceError::Io {
                name: name.to_owned(),
                message: "cancelled".to_owned(),
            });
        }
        Ok(())
    }
}

impl Source for Cancellable<'_> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.inner.size(name)
    }
    fn read_range(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<std::borrow::Cow<'_, [u8]>, SourceError> {
        self.check(name)?;
        self.inner.read_range(name, offset, len)
    }
    fn read_ends(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        head_bytes: u64,
        tail_bytes: u64,
    ) -> Result<std::borrow::Cow<'_, [u8]>, SourceError> {
        self.check(name)?;
        self.inner
            .read_ends(name, offset, len, head_bytes, tail_bytes)
    }
    fn read_ranges(
        &self,
        name: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<std::borrow::Cow<'_, [u8]>>, SourceError> {
        self.check(name)?;
        self.inner.read_ranges(name, ranges)
    }
    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        self.check(name)?;
        self.inner.read_range_into(name, offset, out)
    }
    fn whole_reads_are_cheap(&self) -> bool {
        self.inner.whole_reads_are_cheap()
    }
    fn lends_ranges(&self) -> bool {
        self.inner.lends_ranges()
    }
    fn reads_are_local(&self) -> bool {
        self.inner.reads_are_local()
    }
}

/// Opens both sides with `Checkpoint::open` and compares them with `verify::diff`, as
/// `shardscope diff A B --json` does (no `--select`; bitwise, or with `tolerance` as `diff --rtol
/// --atol [--equal-nan]`). `progress` is called as it goes; setting `cancel` stops it early with
/// [`CompareError::Cancelled`].
pub fn compare(
    a: &CompareInput,
    b: &CompareInput,
    options: &ReadOptions,
    tolerance: Option<Tolerance>,
    progress: &mut dyn FnMut(Progress),
    cancel: &AtomicBool,
) -> Result<Comparison, CompareError> {
    let open = |side: &'static str, input: &CompareInput| input.open(side, options);
    progress(Progress {
        what: format!("opening A: {}", a.label),
        ..Progress::default()
    });
    let (a_source, a_ckpt) = open("A", a)?;
    progress(Progress {
        what: format!("opening B: {}", b.label),
        ..Progress::default()
    });
    let (b_source, b_ckpt) = open("B", b)?;
    let a_read = Cancellable {
        inner: &*a_source,
        cancel,
    };
    let b_read = Cancellable {
        inner: &*b_source,
        cancel,
    };
    let report = verify::diff(
        Side {
            index: &a_ckpt.index,
            source: &a_read,
            label: &a_ckpt.label,
        },
        Side {
            index: &b_ckpt.index,
            source: &b_read,
            label: &b_ckpt.label,
        },
        &DiffOptions {
            tolerance,
            select: None,
            cast: None,
        },
        &mut |done, total, key| {
            progress(Progress {
                done,
                total,
                what: key.to_owned(),
            });
        },
    );
    if cancel.load(Ordering::Relaxed) {
        return Err(CompareError::Cancelled);
    }
    Ok(Comparison::from_report(
        report,
        side_notes(&a_ckpt.notes, &b_ckpt.notes),
    ))
}

/// How each side was read, for [`Comparison::notes`]: A's notes then B's, each marked.
pub fn side_notes(a: &[String], b: &[String]) -> Vec<String> {
    a.iter()
        .map(|n| format!("A: {n}"))
        .chain(b.iter().map(|n| format!("B: {n}")))
        .collect()
}

/// A comparison the front end runs itself (the browser, where reads are asynchronous): the
/// viewer asks for it, shows its progress and takes its result ([`crate::Viewer::take_comparison`]).
#[derive(Debug, Default)]
pub struct External {
    /// The front end runs comparisons: a new tolerance is a request, not a job.
    pub enabled: bool,
    /// A comparison asked for, with this tolerance (the front end takes it).
    pub request: Option<Option<Tolerance>>,
    /// The running comparison's progress (`None`: none runs).
    pub progress: Option<Progress>,
    /// Set when the user cancels: the front end stops at the next key.
    pub cancel: Arc<AtomicBool>,
}

/// Runs comparisons without blocking the UI ([`Job`]), and reruns the last one when the
/// tolerance changes.
#[derive(Debug, Default)]
pub struct Comparer {
    /// Run in the calling thread (tests).
    pub synchronous: bool,
    /// The comparison last started: its sides.
    pub inputs: Option<(String, String)>,
    /// The tolerance controls, kept across comparisons.
    pub tolerance_input: ToleranceInput,
    /// The tolerance of the comparison last started (`None`: bitwise).
    pub tolerance: Option<Tolerance>,
    /// Comparisons run by the front end (the browser).
    pub external: External,
    last: Option<(CompareInput, CompareInput, ReadOptions)>,
    job: Job<Comparison>,
}

impl Comparer {
    /// Starts comparing `a` with `b` with the current tolerance (a running comparison is
    /// cancelled).
    pub fn start(&mut self, a: CompareInput, b: CompareInput, options: ReadOptions) {
        self.inputs = Some((a.label.clone(), b.label.clone()));
        self.last = Some((a.clone(), b.clone(), options.clone()));
        self.job.synchronous = self.synchronous;
        let tolerance = self.tolerance;
        self.job.start(
            "compare",
            Box::new(move |progress, cancel| {
                compare(&a, &b, &options, tolerance, progress, cancel)
            }),
        );
    }

    /// Compares the last two checkpoints again with `tolerance` (`None`: bitwise), as
    /// `diff --rtol --atol` would; in the browser, asks the front end to.
    pub fn set_tolerance(&mut self, tolerance: Option<Tolerance>) {
        self.tolerance = tolerance;
        if self.external.enabled {
            self.external.request = Some(tolerance);
        } else if let Some((a, b, options)) = self.last.clone() {
            self.start(a, b, options);
        }
    }

    /// Asks a running comparison to stop.
    pub fn cancel(&mut self) {
        self.job.cancel();
        self.external.cancel.store(true, Ordering::Relaxed);
    }

    /// True while a comparison runs.
    pub fn running(&self) -> bool {
        self.job.running() || self.external.progress.is_some()
    }

    /// The progress of the running comparison.
    pub fn progress(&self) -> Progress {
        self.external
            .progress
            .clone()
            .unwrap_or_else(|| self.job.progress())
    }

    /// The finished comparison, once (call every frame).
    pub fn poll(&mut self) -> Option<Result<Comparison, CompareError>> {
        self.job.poll()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(fqn: &str, status: Status) -> verify::Entry {
        verify::Entry::new(fqn, status)
    }

    #[test]
    fn rows_are_grouped_by_module_and_filtered() {
        let mut differs = entry("block.0.weight", Status::Mismatch);
        differs.mismatched_elements = Some(3);
        let mut resized = entry("block.0.bias", Status::Mismatch);
        resized.right_shape = Some(vec![4]);
        let rows = [
            differs,
            resized,
            entry("block.1.weight", Status::Match),
            entry("scale", Status::Missing),
            entry("extra", Status::Unexpected),
        ];
        let statuses: Vec<RowStatus> = rows.iter().map(RowStatus::of).collect();
        assert_eq!(
            statuses,
            [
                RowStatus::Differs,
                RowStatus::Changed,
                RowStatus::Equal,
                RowStatus::OnlyA,
                RowStatus::OnlyB
            ]
        );
        let report = verify::Report {
            kind: verify::REPORT_KIND,
            version: verify::REPORT_VERSION,
            command: "diff",
            left: Some("a".into()),
            right: Some("b".into()),
            summary: verify::Summary::default(),
            notes: Vec::new(),
            entries: rows.into_iter().map(|e| (e.fqn.clone(), e)).collect(),
        };
        let c = Comparison::from_report(report, Vec::new());
        assert_eq!(
            c.summary(),
            "5 tensors: 1 equal, 1 differs, 1 dtype/shape changed, 1 only in A, 1 only in B"
        );
        let modules = |lines: &[Line]| -> Vec<String> {
            lines
                .iter()
                .filter_map(|l| match l {
                    Line::Module { module, .. } => Some(module.clone()),
                    Line::Row(_) => None,
                })
                .collect()
        };
        let all = lines(&c, &Filter::default(), &BTreeSet::new());
        assert_eq!(modules(&all), ["", "block.0", "block.1"]);
        assert_eq!(all.len(), 3 + 5);
        let mut filter = Filter::default();
        filter.statuses.remove(&RowStatus::Equal);
        "block".clone_into(&mut filter.name);
        let some = lines(&c, &filter, &BTreeSet::from(["block.0".to_owned()]));
        assert_eq!(
            some,
            [Line::Module {
                module: "block.0".into(),
                counts: [0, 1, 1, 0, 0, 0],
                collapsed: true
            }]
        );
    }
}
