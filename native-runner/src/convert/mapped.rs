//! An index in another naming (`convert --to hf`, `--to torchtitan`): the plan of a
//! [`shardscope_core::transform::mapping`] file laid over the stored index. A renamed tensor is the
//! stored entry under its new key (its chunks, so every fast path of the engine holds); a tensor
//! made by operations is an entry with no chunks whose [`Derived`] recipe the [`super::Reader`]
//! evaluates (reading only an expert's rows of a grouped tensor).

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry, PathSeg};
use shardscope_core::transform::mapping::{Plan, Recipe};

/// A tensor made from stored ones.
#[derive(Debug, Clone)]
pub struct Derived {
    pub recipe: Recipe,
    /// The stored entries it reads, by their stored key.
    pub sources: BTreeMap<String, IndexEntry>,
    /// Bytes held besides the output while it is made (what it reads, and one intermediate copy).
    pub working_bytes: u64,
}

/// Derived tensors by output key.
pub type Derivations = BTreeMap<String, Derived>;

/// A plain output entry: a tensor under `key`, with the stored entry's chunks or none.
fn renamed(stored: &IndexEntry, key: &str) -> IndexEntry {
    IndexEntry {
        key: key.to_owned(),
        raw_key: None,
        path: vec![PathSeg::Key(key.to_owned())],
        ..stored.clone()
    }
}

/// The entry of a derived output (no chunks; the reader evaluates its recipe), its recipe recorded
/// in `derived`.
fn derived_entry(
    derived: &mut Derivations,
    out: &shardscope_core::transform::mapping::Planned,
    sources: BTreeMap<String, IndexEntry>,
    read_bytes: u64,
    template: &IndexEntry,
) -> IndexEntry {
    let out_bytes = shardscope_core::shape::nbytes(out.dtype, &out.shape).unwrap_or(u64::MAX);
    derived.insert(
        out.name.clone(),
        Derived {
            recipe: out.recipe.clone(),
            working_bytes: read_bytes.saturating_add(out_bytes),
            sources,
        },
    );
    IndexEntry {
        chunks: Vec::new(),
        fsdp: None,
        dtype: Some(out.dtype),
        shape: Some(out.shape.clone()),
        ..renamed(template, &out.name)
    }
}

/// The index `plan` describes over `index` (whose tensors are keyed by the names the plan read),
/// and the recipes of its derived tensors.
pub fn mapped_index(
    index: &CheckpointIndex,
    plan: &Plan,
) -> Result<(CheckpointIndex, Derivations)> {
    let by_name: BTreeMap<&str, &IndexEntry> = index
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
        .map(|e| (e.key.as_str(), e))
        .collect();
    let stored = |name: &str| -> Result<&IndexEntry> {
        by_name.get(name).copied().with_context(|| {
            format!("the mapping reads `{name}`, which the checkpoint does not hold")
        })
    };
    let mut entries = Vec::with_capacity(plan.outputs.len());
    let mut derived = Derivations::new();
    for (position, out) in plan.outputs.iter().enumerate() {
        let mut entry = match &out.recipe {
            Recipe::Copy { source } => renamed(stored(source)?, &out.name),
            Recipe::Derived { .. } => {
                let mut sources = BTreeMap::new();
                let mut read_bytes = 0u64;
                for name in out.recipe.sources() {
                    let e = stored(name)?;
                    read_bytes = read_bytes.saturating_add(
                        super::reader::read_cost_bytes(e, out.dtype).unwrap_or(u64::MAX),
                    );
                    sources.insert(name.to_owned(), e.clone());
                }
                let first = sources
                    .values()
                    .next()
                    .cloned()
                    .with_context(|| format!("{}: a recipe with no read", out.name))?;
                derived_entry(&mut derived, out, sources, read_bytes, &first)
            }
            Recipe::Zeros { .. } => {
                // Made from nothing: any stored tensor entry lends its fields (not its chunks).
                let template = index
                    .entries
                    .iter()
                    .find(|e| e.kind == EntryKind::Tensor)
                    .with_context(|| format!("{}: no stored tensor", out.name))?;
                derived_entry(&mut derived, out, BTreeMap::new(), 0, template)
            }
        };
        entry.position = Some(position as u64);
        entries.push(entry);
    }
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    if let Some(w) = entries.windows(2).find(|w| w[0].key == w[1].key) {
        bail!("two tensors map to `{}`", w[0].key);
    }
    Ok((
        CheckpointIndex {
            entries,
            has_optimizer_state: false,
            format: index.format,
            kind: index.kind,
            files: index.files.clone(),
            dcp: index.dcp.clone(),
        },
        derived,
    ))
}
