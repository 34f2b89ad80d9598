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
        // Non-tensor values are counted per top-level key (a trainer's checkpoint has hundreds);
        // anything else skipped is named.
        let mut values: BTreeMap<&str, usize> = BTreeMap::new();
        let mut other: Vec<String> = Vec::new();
        for (k, why) in &derived.skipped {
            match *why {
                "optimizer state" => {}
                "not a tensor" => *values.entry(k.split('.').next().unwrap_or(k)).or_default() += 1,
                _ => other.push(format!("{k} ({why})")),
            }
        }
        if !values.is_empty() {
            let total: usize = values.values().sum();
            let parts: Vec<String> = values.iter().map(|(t, n)| format!("{t}: {n}")).collect();
            notes.push(format!(
                "note: skipped {total} values that are not tensors ({})",
                parts.join(", ")
            ));
        }
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

/// A description derived from the checkpoint alone: the model part found ([`super::app_state_prefix`])
/// and the repeated blocks as units with the root ([`repeated_blocks`]).
#[derive(Debug, Clone)]
pub struct AutoDescribed {
    pub described: Described,
    /// The app-state key the model was taken from (`model`), removed from the FQNs.
    pub select: Option<&'static str>,
    /// The module lists whose blocks are units, with their block counts.
    pub blocks: Vec<(String, usize)>,
}

impl Checkpoint {
    /// The description a checkpoint implies with no choice from the user: the model part, its
    /// repeated blocks and the root as FSDP units, tied weights detected (see
    /// [`Checkpoint::describe`]).
    pub fn describe_auto(&self, source: &dyn Source) -> Result<AutoDescribed, CheckpointError> {
        let select = super::app_state_prefix(&self.index);
        let blocks = repeated_blocks(super::model_fqns(&self.index, select));
        let is_unit = |prefix: &str| is_block(&blocks, prefix);
        let described = self.describe(
            source,
            &DescribeOptions {
                select,
                exclude: None,
                is_unit: &is_unit,
                root_unit: true,
                detect_ties: true,
            },
        )?;
        Ok(AutoDescribed {
            described,
            select,
            blocks,
        })
    }
}

/// The module lists of a model (`model.layers`, `transformer.h`, `blocks`): dotted prefixes whose
/// children are numbered `0, 1, …` (at least two of them), outermost only (the experts inside a
/// layer are not listed), in the order they first appear among `fqns`, with their block counts.
/// These are what the transformer-block auto-wrap policies of HF, accelerate and torchtitan make
/// FSDP units (`<list>.<n>`, with the root).
pub fn repeated_blocks<'a>(fqns: impl IntoIterator<Item = &'a str>) -> Vec<(String, usize)> {
    let mut order: Vec<String> = Vec::new();
    let mut numbers: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for fqn in fqns {
        let segs: Vec<&str> = fqn.split('.').collect();
        // The parameter's own name is the last segment: only module segments count.
        for i in 1..segs.len().saturating_sub(1) {
            if let Ok(n) = segs[i].parse::<u64>()
                && segs[i].bytes().all(|b| b.is_ascii_digit())
            {
                let list = segs[..i].join(".");
                if !numbers.contains_key(&list) {
                    order.push(list.clone());
                }
                numbers.entry(list).or_default().insert(n);
            }
        }
    }
    let lists: Vec<(String, usize)> = order
        .into_iter()
        .filter_map(|l| {
            let n = numbers.get(&l)?;
            // Numbered from 0, consecutively: a module list, not a stray number in a name.
            (n.len() >= 2 && n.iter().copied().eq(0..n.len() as u64)).then_some((l, n.len()))
        })
        .collect();
    lists
        .iter()
        .filter(|(l, _)| {
            !lists.iter().any(|(outer, _)| {
                l.strip_prefix(outer.as_str())
                    .and_then(|r| r.strip_prefix('.'))
                    .is_some_and(|r| {
                        r.split('.')
                            .next()
                            .is_some_and(|s| s.parse::<u64>().is_ok())
                    })
            })
        })
        .cloned()
        .collect()
}

/// Whether `prefix` is one block of the module lists `lists` (`model.layers.3`).
pub fn is_block(lists: &[(String, usize)], prefix: &str) -> bool {
    lists.iter().any(|(l, _)| {
        prefix
            .strip_prefix(l.as_str())
            .and_then(|r| r.strip_prefix('.'))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_lists_are_found_outermost_first() {
        let fqns = [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.experts.0.w1.weight",
            "model.layers.0.mlp.experts.1.w1.weight",
            "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.mlp.experts.0.w1.weight",
            "model.layers.1.mlp.experts.1.w1.weight",
            "transformer.h.0.attn.weight",
            "transformer.h.1.attn.weight",
            "transformer.h.2.attn.weight",
            "lm_head.weight",
            "proj.3.weight",
        ];
        assert_eq!(
            repeated_blocks(fqns),
            vec![
                ("model.layers".to_owned(), 2),
                ("transformer.h".to_owned(), 3)
            ]
        );
        let lists = repeated_blocks(fqns);
        assert!(is_block(&lists, "model.layers.1"));
        assert!(!is_block(&lists, "model.layers"));
        assert!(!is_block(&lists, "model.layers.1.mlp"));
        assert!(!is_block(&lists, "proj.3"));
        // Parameters numbered directly (`weights.0`, a ParameterList) are no module list.
        assert!(repeated_blocks(["w.0", "w.1"]).is_empty());
    }
}
