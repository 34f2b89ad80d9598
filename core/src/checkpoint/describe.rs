//! The model description a checkpoint implies (`shardscope layout --from`, and any front end that
//! shows a layout for an opened checkpoint): its floating-point parameters in stored (registration)
//! order, tied weights marked `shared_with`, FSDP units chosen by the caller, with notes saying what
//! was left out and what to check.

use std::collections::{BTreeMap, BTreeSet};

use crate::index::from_index::{self, Derived, FromIndexError, FromIndexOptions};
use crate::index::{CheckpointIndex, ties};
use crate::source::Source;

use super::{Checkpoint, CheckpointError};

/// How to derive a description.
#[allow(missing_debug_implementations)] // holds closures
pub struct DescribeOptions<'a> {
    /// Only keys under `SELECT.` (prefix removed), e.g. `model` of a DCP app state.
    pub select: Option<&'a str>,
    /// Leave out keys (after `select`) this accepts: buffers, for example.
    pub exclude: Option<&'a dyn Fn(&str) -> bool>,
    /// A module prefix this accepts (in full) becomes an FSDP unit.
    pub is_unit: &'a dyn Fn(&str) -> bool,
    /// Add the root module (`""`) as a unit.
    pub root_unit: bool,
    /// Look for tied weights (shared storage in `torch.save`; equal dtype, shape and bytes
    /// elsewhere): an alias takes no space of its own, as torch lists it.
    pub detect_ties: bool,
}

/// A derived description and what a user should read about it.
#[derive(Debug, Clone)]
pub struct Described {
    pub derived: Derived,
    /// `warning: …`/`note: …` lines, in the order to show them.
    pub notes: Vec<String>,
}

fn derive_err(label: &str, what: &'static str, source: FromIndexError) -> CheckpointError {
    CheckpointError::Describe {
        label: label.to_owned(),
        what,
        source: Box::new(source),
    }
}

/// Tied weights among the floating-point entries (under `select.` when given): alias key -> the
/// key it shares its tensor with.
fn tied_keys(
    index: &CheckpointIndex,
    source: &dyn Source,
    order: &from_index::KeyOrder,
    select: Option<&str>,
) -> Result<BTreeMap<String, String>, crate::index::IndexError> {
    let by_key: BTreeMap<&str, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    let candidates: Vec<usize> = order
        .keys
        .iter()
        .filter_map(|k| by_key.get(k.as_str()).map(|&i| (i, &index.entries[i])))
        .filter(|(_, e)| e.dtype.is_some_and(crate::dtype::DType::is_floating_point))
        .filter(|(_, e)| {
            select.is_none_or(|s| e.key.strip_prefix(s).is_some_and(|r| r.starts_with('.')))
        })
        .map(|(i, _)| i)
        .collect();
    let groups = ties::find_ties(index, source, &candidates)?;
    Ok(groups
        .iter()
        .flat_map(|g| {
            g.aliases.iter().map(|&a| {
                (
                    index.entries[a].key.clone(),
                    index.entries[g.keep].key.clone(),
                )
            })
        })
        .collect())
}

impl Checkpoint {
    /// The model description the checkpoint implies, from its entries as stored (`source` is the
    /// one it was opened from: the stored key order and tie probes read a few bytes of it).
    pub fn describe(
        &self,
        source: &dyn Source,
        options: &DescribeOptions<'_>,
    ) -> Result<Described, CheckpointError> {
        let label = &self.label;
        let index = &self.index;
        let mut notes = Vec::new();
        let order = from_index::stored_key_order(source, index)
            .map_err(|e| derive_err(label, "cannot read its key order", e))?;
        if !order.registration_order {
            notes.push(format!(
                "warning: {label}: safetensors stores keys sorted by name, not in registration order; FSDP1 flat parameters and FSDP2 groups follow registration order\nhint: derive the description from a `.pt` or DCP checkpoint, or write it with --model"
            ));
        }
        let tied = if options.detect_ties {
            tied_keys(index, source, &order, options.select).map_err(|e| {
                CheckpointError::Files {
                    label: label.clone(),
                    reason: format!("cannot look for tied weights: {e}"),
                }
            })?
        } else {
            BTreeMap::new()
        };
        let derived = from_index::description_from_index(
            index,
            &order,
            &FromIndexOptions {
                select: options.select,
                exclude: options.exclude,
                is_unit: options.is_unit,
                root_unit: options.root_unit,
                tied: Some(&tied),
            },
        )
        .map_err(|e| derive_err(label, "cannot derive a model description", e))?;
        let optim = derived
            .skipped
            .iter()
            .filter(|(_, why)| *why == "optimizer state")
            .count();
        let other: Vec<String> = derived
            .skipped
            .iter()
            .filter(|(_, why)| *why != "optimizer state")
            .map(|(k, why)| format!("{k} ({why})"))
            .collect();
        if optim > 0 {
            notes.push(format!("note: skipped {optim} optimizer-state entries"));
        }
        if !other.is_empty() {
            notes.push(format!("note: skipped {}", other.join(", ")));
        }
        if options.select.is_none() {
            let tops: BTreeSet<&str> = derived
                .model
                .params
                .iter()
                .filter_map(|p| p.fqn.split_once('.').map(|(t, _)| t))
                .collect();
            if tops.contains("model") && tops.len() > 1 {
                notes.push(format!(
                    "note: the parameters come from several subtrees ({})\nhint: --select model takes the model's state only",
                    tops.into_iter().collect::<Vec<_>>().join(", ")
                ));
            }
        }
        for p in &derived.model.params {
            if let Some(partner) = &p.shared_with {
                notes.push(format!(
                    "note: `{}` is tied to `{partner}` (same tensor): marked shared_with, it takes no space of its own (--no-tie-detection to turn this off)",
                    p.fqn
                ));
            }
        }
        if derived.model.units.is_empty() {
            notes.push(
                "note: --units matched no module prefix and --root-unit is not given: no FSDP unit manages any parameter"
                    .to_owned(),
            );
        }
        Ok(Described { derived, notes })
    }
}
