//! Verification reports (`shardscope diff` / `verify --json`), in the schema documented in
//! `docs/viewer.md`:
//!
//! ```json
//! {"kind": "shardscope.verify", "version": 1, "left": "ckpt_a/", "right": "ckpt_b/",
//!  "entries": [{"fqn": "layer.weight", "status": "mismatch", "dtype": "float32", "shape": [4, 4],
//!               "mismatched_elements": 3, "max_abs_diff": 0.5, "first_mismatch": [1, 2],
//!               "message": "values differ"}]}
//! ```
//! `status` is one of `match`, `mismatch`, `missing` (only on the left), `unexpected` (only on
//! the right) and `error`. Unknown fields are ignored so later versions stay readable.

use serde::Deserialize;

/// Why a report cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    /// Not JSON of the report schema.
    #[error("{name}: not a verification report: {message}")]
    Schema { name: String, message: String },
    /// A `version` this viewer does not know.
    #[error(
        "{name}: verification report version {version} is newer than this viewer (it reads version 1)"
    )]
    Version { name: String, version: u64 },
}

/// One tensor's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Match,
    Mismatch,
    Missing,
    Unexpected,
    Error,
}

impl Status {
    pub const fn label(self) -> &'static str {
        match self {
            Status::Match => "match",
            Status::Mismatch => "mismatch",
            Status::Missing => "missing",
            Status::Unexpected => "unexpected",
            Status::Error => "error",
        }
    }

    pub const fn is_problem(self) -> bool {
        !matches!(self, Status::Match)
    }
}

/// One entry of a report.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Entry {
    pub fqn: String,
    pub status: Status,
    #[serde(default)]
    pub dtype: Option<String>,
    #[serde(default)]
    pub shape: Option<Vec<u64>>,
    #[serde(default)]
    pub mismatched_elements: Option<u64>,
    #[serde(default)]
    pub max_abs_diff: Option<f64>,
    #[serde(default)]
    pub first_mismatch: Option<Vec<u64>>,
    #[serde(default)]
    pub message: Option<String>,
}

/// A parsed report.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Report {
    #[serde(skip)]
    pub name: String,
    pub version: u64,
    #[serde(default)]
    pub left: Option<String>,
    #[serde(default)]
    pub right: Option<String>,
    pub entries: Vec<Entry>,
}

impl Report {
    /// Parses report JSON.
    pub fn from_json_bytes(bytes: &[u8], name: &str) -> Result<Self, ReportError> {
        let mut report: Report =
            serde_json::from_slice(bytes).map_err(|e| ReportError::Schema {
                name: name.to_owned(),
                message: e.to_string(),
            })?;
        if report.version != 1 {
            return Err(ReportError::Version {
                name: name.to_owned(),
                version: report.version,
            });
        }
        name.clone_into(&mut report.name);
        report.entries.sort_by(|a, b| a.fqn.cmp(&b.fqn));
        Ok(report)
    }

    /// Entries per status, in [`Status`] order.
    pub fn counts(&self) -> [(Status, usize); 5] {
        [
            Status::Match,
            Status::Mismatch,
            Status::Missing,
            Status::Unexpected,
            Status::Error,
        ]
        .map(|s| (s, self.entries.iter().filter(|e| e.status == s).count()))
    }

    /// `3 match, 1 mismatch, ...` (statuses with no entry left out).
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .counts()
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(s, n)| format!("{n} {}", s.label()))
            .collect();
        format!("{} tensors: {}", self.entries.len(), parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_and_counts() {
        let r = Report::from_json_bytes(
            br#"{"kind": "shardscope.verify", "version": 1, "entries": [
                {"fqn": "b", "status": "mismatch", "mismatched_elements": 3, "max_abs_diff": 0.5},
                {"fqn": "a", "status": "match", "future_field": 1}]}"#,
            "r.json",
        )
        .unwrap();
        assert_eq!(r.entries[0].fqn, "a");
        assert_eq!(r.summary(), "2 tensors: 1 match, 1 mismatch");
        assert!(matches!(
            Report::from_json_bytes(br#"{"version": 2, "entries": []}"#, "r.json"),
            Err(ReportError::Version { version: 2, .. })
        ));
        assert!(matches!(
            Report::from_json_bytes(
                br#"{"version": 1, "entries": [{"fqn": "a", "status": "odd"}]}"#,
                "r.json"
            ),
            Err(ReportError::Schema { .. })
        ));
    }
}
