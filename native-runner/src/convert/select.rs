//! Which entries a conversion takes ([`select`]: `--select` prefix, tensors and values, output
//! keys) and which tied aliases it drops ([`drop_tied`]).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, bail};
use shardscope_core::DType;
use shardscope_core::cast::cast_target;
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry};
use shardscope_core::shape::nbytes;

use crate::input::Input;

use super::reader::tensor_meta;

/// The entries a conversion takes: tensors and non-tensor values, with their output keys.
#[derive(Debug)]
pub struct Selection<'a> {
    pub tensors: Vec<(String, &'a IndexEntry)>,
    pub values: Vec<(String, &'a IndexEntry)>,
    /// `--dtype`: floating tensors (float16, bfloat16, float32, float64) are written as this.
    pub cast: Option<DType>,
}

impl Selection<'_> {
    /// The dtype and shape `e` is written with (after `--dtype`).
    pub fn out_meta<'e>(&self, e: &'e IndexEntry) -> Result<(DType, &'e [u64])> {
        let (dtype, shape) = tensor_meta(e)?;
        Ok((cast_target(dtype, self.cast), shape))
    }

    /// The bytes `e` takes in the output.
    pub fn out_nbytes(&self, e: &IndexEntry) -> Option<u64> {
        let (dtype, shape) = self.out_meta(e).ok()?;
        nbytes(dtype, shape)
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter_map(|(_, e)| self.out_nbytes(e))
            .fold(0, u64::saturating_add)
    }
}

/// Keeps the entries under `prefix` (flattened key `prefix.<rest>`, output key `<rest>`), or all.
pub fn select<'a>(index: &'a CheckpointIndex, prefix: Option<&str>) -> Result<Selection<'a>> {
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    for e in &index.entries {
        let key = match prefix {
            Some(p) => match e.key.strip_prefix(p).and_then(|r| r.strip_prefix('.')) {
                Some(rest) if !rest.is_empty() => rest.to_owned(),
                _ => continue,
            },
            None => e.key.clone(),
        };
        if e.kind == EntryKind::Tensor {
            tensor_meta(e)?;
            tensors.push((key, e));
        } else {
            values.push((key, e));
        }
    }
    if let Some(p) = prefix
        && tensors.is_empty()
        && values.is_empty()
    {
        let tops: BTreeSet<String> = index
            .entries
            .iter()
            .filter_map(|e| e.path.first().map(ToString::to_string))
            .collect();
        bail!(
            "--select {p}: no key starts with `{p}.`\nhint: top-level keys are: {}",
            tops.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    if let Some(p) = prefix {
        warn_own_prefix(index, p);
    }
    Ok(Selection {
        tensors,
        values,
        cast: None,
    })
}

/// `--select PREFIX` is a plain prefix: when `PREFIX` is not an app-state key but the start of the
/// model's own names (HF's `model.embed_tokens.weight` beside `lm_head.weight`), the model tensors
/// outside it are left out. The keys of those tensors (none when `PREFIX` is an app-state key, or
/// selects no model tensor): what [`own_prefix_warning`] names.
pub fn own_prefix_left_out<'a>(index: &'a CheckpointIndex, prefix: &str) -> Vec<&'a str> {
    if shardscope_core::checkpoint::app_state_prefix(index).is_some() {
        return Vec::new();
    }
    let under = |k: &str| k.strip_prefix(prefix).is_some_and(|r| r.starts_with('.'));
    let model_tensor = |e: &&IndexEntry| shardscope_core::checkpoint::is_model_tensor(e);
    let selects_model = index
        .entries
        .iter()
        .filter(model_tensor)
        .any(|e| under(&e.key));
    if !selects_model {
        return Vec::new();
    }
    index
        .entries
        .iter()
        .filter(model_tensor)
        .filter(|e| !under(&e.key))
        .map(|e| e.key.as_str())
        .collect()
}

/// The warning `convert`, `diff` and `inspect` print when `--select PREFIX` leaves out model
/// tensors `left_out` ([`own_prefix_left_out`]) of `label` (a `diff` side; `None`: the one input).
pub fn own_prefix_warning(prefix: &str, left_out: &[&str], label: Option<&str>) -> String {
    let shown: Vec<&str> = left_out.iter().take(4).copied().collect();
    format!(
        "warning: --select {prefix} is a plain prefix: `{prefix}.` starts {}, and {} model tensor(s) outside it are left out ({}{})\nhint: --model-only takes the model part with its own names",
        label.map_or_else(
            || "this model's own names".to_owned(),
            |l| format!("the model's own names in {l}")
        ),
        left_out.len(),
        shown.join(", "),
        if left_out.len() > shown.len() {
            ", …"
        } else {
            ""
        }
    )
}

fn warn_own_prefix(index: &CheckpointIndex, prefix: &str) {
    let left_out = own_prefix_left_out(index, prefix);
    if !left_out.is_empty() {
        eprintln!("{}", own_prefix_warning(prefix, &left_out, None));
    }
}

/// Removes the aliases of tied weights from the selection's tensors (see
/// [`shardscope_core::index::ties`]: shared storage in `torch.save`, equal bytes elsewhere) and
/// returns `(kept, dropped)` output names. The name kept is the one that comes first in the
/// checkpoint.
pub fn drop_tied(
    source: &Input,
    index: &CheckpointIndex,
    sel: &mut Selection<'_>,
) -> Result<Vec<(String, String)>> {
    let position: BTreeMap<*const IndexEntry, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (std::ptr::from_ref(e), i))
        .collect();
    let out_name: BTreeMap<usize, String> = sel
        .tensors
        .iter()
        .filter_map(|(name, e)| Some((*position.get(&std::ptr::from_ref(*e))?, name.clone())))
        .collect();
    // The name kept is the first in stored (registration) order.
    let order = shardscope_core::index::from_index::stored_key_order(source, index)
        .context("cannot read the checkpoint's key order")?;
    let by_key: BTreeMap<&str, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    let mut candidates: Vec<usize> = order
        .keys
        .iter()
        .filter_map(|k| by_key.get(k.as_str()).copied())
        .filter(|i| out_name.contains_key(i))
        .collect();
    let listed: BTreeSet<usize> = candidates.iter().copied().collect();
    candidates.extend(out_name.keys().filter(|i| !listed.contains(i)));
    let groups = shardscope_core::index::ties::find_ties(index, source, &candidates)
        .context("cannot look for tied weights")?;
    let mut dropped = Vec::new();
    let mut drop_set = BTreeSet::new();
    for g in &groups {
        for a in &g.aliases {
            dropped.push((out_name[&g.keep].clone(), out_name[a].clone()));
            drop_set.insert(out_name[a].clone());
        }
    }
    sel.tensors.retain(|(name, _)| !drop_set.contains(name));
    Ok(dropped)
}
