//! [`DiffPlan`]: [`diff`](super::diff) one key at a time, for callers that cannot hand it a
//! synchronous source for the whole run (the browser viewer fetches each tensor's bytes between
//! keys). `diff` itself is this plan run key by key, so the entries and the report are the same.

use super::{
    CheckpointIndex, DiffOptions, Entry, Keyed, Report, Side, Source, Status, Tolerance,
    compare_entries, raw_name, select,
};

/// The keys two checkpoints are compared under, and how each is compared.
#[derive(Debug)]
pub struct DiffPlan<'a> {
    left: &'a CheckpointIndex,
    right: &'a CheckpointIndex,
    left_label: String,
    right_label: String,
    lkeys: Keyed<'a>,
    rkeys: Keyed<'a>,
    /// Every key of either side, sorted.
    fqns: Vec<String>,
    notes: Vec<String>,
    tolerance: Option<Tolerance>,
    cast: Option<crate::dtype::DType>,
}

impl<'a> DiffPlan<'a> {
    /// The plan of `diff(left, right, options)`: sides as `(index, label)`.
    pub fn new(
        left: (&'a CheckpointIndex, &str),
        right: (&'a CheckpointIndex, &str),
        options: &DiffOptions,
    ) -> Self {
        let (lkeys, rkeys, mut notes) = select(left, right, options.select.as_deref());
        if let Some(t) = options.tolerance {
            notes.push(format!(
                "floating-point values compared with rtol={} atol={} equal_nan={}",
                t.rtol, t.atol, t.equal_nan
            ));
        }
        let fqns: std::collections::BTreeSet<&String> = lkeys.keys().chain(rkeys.keys()).collect();
        let fqns = fqns.into_iter().cloned().collect();
        Self {
            left: left.0,
            right: right.0,
            left_label: left.1.to_owned(),
            right_label: right.1.to_owned(),
            lkeys,
            rkeys,
            fqns,
            notes,
            tolerance: options.tolerance,
            cast: options.cast,
        }
    }

    /// The keys compared, sorted: [`DiffPlan::entry`] takes an index into them.
    pub fn keys(&self) -> &[String] {
        &self.fqns
    }

    /// The entry of key `i` (`None` past the last key), reading values from the two sources.
    pub fn entry(&self, i: usize, left: &dyn Source, right: &dyn Source) -> Option<Entry> {
        let fqn = self.fqns.get(i)?;
        let left = Side {
            index: self.left,
            source: left,
            label: &self.left_label,
        };
        let right = Side {
            index: self.right,
            source: right,
            label: &self.right_label,
        };
        let (a, b) = (self.lkeys.get(fqn), self.rkeys.get(fqn));
        let mut entry = match (a, b) {
            (Some(a), Some(b)) => {
                compare_entries(fqn, left, a, right, b, self.tolerance, self.cast)
            }
            (Some(a), None) => {
                let mut e = Entry::new(fqn, Status::Missing)
                    .with_message(format!("only in {}", left.label));
                e.dtype = a.dtype;
                e.shape.clone_from(&a.shape);
                e
            }
            (None, Some(b)) => {
                let mut e = Entry::new(fqn, Status::Unexpected)
                    .with_message(format!("only in {}", right.label));
                e.dtype = b.dtype;
                e.shape.clone_from(&b.shape);
                e
            }
            (None, None) => return None,
        };
        if let Some(a) = a {
            entry.left_key = raw_name(a, fqn);
        }
        if let Some(b) = b {
            entry.right_key = raw_name(b, fqn);
        }
        Some(entry)
    }

    /// The report of the entries (one per key, as [`DiffPlan::entry`] made them).
    pub fn report(&self, entries: impl IntoIterator<Item = Entry>) -> Report {
        let mut report = Report::new(
            "diff",
            Some(self.left_label.clone()),
            Some(self.right_label.clone()),
        );
        report.notes.clone_from(&self.notes);
        for e in entries {
            report.insert(e);
        }
        report.finish();
        report
    }
}
