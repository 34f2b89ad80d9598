//! What a diagnosis produces: [`Finding`]s, their [`Severity`], and the [`Report`] `doctor --json`
//! prints (findings of one code and fix merged, errors first, in a fixed order of codes).

use serde::Serialize;

use super::text::list;

/// The version of the JSON report.
pub const REPORT_VERSION: u32 = 1;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    Warning,
}

/// One diagnosis.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Stable identifier (`wrapper-prefix`, `flat-param`, …).
    pub code: &'static str,
    pub severity: Severity,
    /// The checkpoint keys involved (as stored), or target keys for `missing-key`, or file names.
    pub keys: Vec<String>,
    pub message: String,
    /// A `shardscope` command or a line of Python.
    pub fix: String,
}

/// What `doctor` prints with `--json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub version: u32,
    pub loadable: bool,
    pub findings: Vec<Finding>,
}

impl Report {
    /// A report of these findings, sorted (errors first, then by code and keys).
    pub fn new(findings: Vec<Finding>) -> Report {
        let mut findings = merge_alike(findings);
        findings.sort_by(|a, b| {
            (a.severity, code_rank(a.code), &a.keys).cmp(&(b.severity, code_rank(b.code), &b.keys))
        });
        findings.dedup();
        Report {
            version: REPORT_VERSION,
            loadable: !findings.iter().any(|f| f.severity == Severity::Error),
            findings,
        }
    }

    /// 0 when loadable, 1 when some finding is an error.
    pub fn exit_code(&self) -> u8 {
        u8::from(!self.loadable)
    }
}

/// Findings of one code with the same fix (one per key: local shards, casts, empty views) become
/// one finding naming every key.
fn merge_alike(findings: Vec<Finding>) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::with_capacity(findings.len());
    let mut extra: Vec<Vec<String>> = Vec::new();
    for f in findings {
        if let Some(i) = out
            .iter()
            .position(|o| o.code == f.code && o.severity == f.severity && o.fix == f.fix)
        {
            extra[i].extend(f.keys.iter().cloned());
            out[i].keys.extend(f.keys);
        } else {
            out.push(f);
            extra.push(Vec::new());
        }
    }
    for (f, more) in out.iter_mut().zip(extra) {
        if !more.is_empty() {
            f.message = format!(
                "{} (and {} more key(s) alike: {})",
                f.message,
                more.len(),
                list(&more)
            );
        }
    }
    out
}

const CODES: [&str; 17] = [
    "unsafe-pickle",
    "coverage",
    "world-size",
    "wrapper-prefix",
    "flat-param",
    "local-shard",
    "flattened-shape",
    "empty-tensor",
    "replicated-concatenated",
    "missing-key",
    "unexpected-key",
    "shape-mismatch",
    "optimizer-mismatch",
    "optimizer-moments-equal",
    "dtype-mismatch",
    "unreadable",
    "bloated-storage",
];

fn code_rank(code: &str) -> usize {
    CODES.iter().position(|c| *c == code).unwrap_or(CODES.len())
}
