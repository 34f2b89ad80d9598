//! Trainer folders that hold several DCP checkpoints side by side, read as one checkpoint:
//! accelerate's `save_state` folder (`pytorch_model_fsdp_0/` holding `{"model": …}`,
//! `optimizer_0/` holding `{"optimizer": …}`, with `scheduler.bin` and the RNG states beside
//! them), the HF Trainer's `checkpoint-N/` (the same folders beside `scheduler.pt`,
//! `rng_state_{rank}.pth`, `trainer_state.json`).
//!
//! Also a DCP folder with `torch.save` files beside it (Lightning's `meta.pt`, Megatron-core's
//! `common.pt`, merged into the top level as their loaders merge them; anything else under
//! `extra.<item>`).
//!
//! Every DCP folder one level down is read; their keys keep their own names when the folders'
//! top-level keys differ (`model.…`, `optimizer.…`), else each folder is a subtree named by the
//! folder. The `torch.save` files at the top level are read as per-rank sets
//! ([`super::sets`]), each under `extra.<item>` (or `model.<item>`/`optim.<item>` for what they
//! hold), so that no part of the folder is left out silently.

use std::collections::{BTreeMap, BTreeSet};

use crate::index::names::file_ext;
use crate::index::read::dcp::index_dcp;
use crate::index::read::items::{FolderRead, index_value_sets, sort_rank_folder, unread_note};
use crate::index::read::sets::{index_torch_sets, prefixed, set_item};
use crate::index::{CheckpointIndex, Format, IndexError, PathSeg};
use crate::source::Source;

/// `torch.save` files beside a DCP that the trainer's loader merges into the checkpoint's top
/// level: Lightning's `meta.pt` (the user's state besides model and optimizer, `checkpoint.update`
/// in its consolidation), Megatron-core's `common.pt` (the common state `dist_checkpointing.load`
/// merges).
const MERGED_AT_TOP: &[&str] = &["meta.pt", "common.pt"];

/// The HF Trainer's state file beside accelerate's folders in `checkpoint-N/`.
const TRAINER_STATE: &str = "trainer_state.json";

/// Megatron-core's description of its checkpoint beside the DCP (read by
/// [`crate::checkpoint::megatron_backend`], kept by a DCP conversion): not an item.
const MEGATRON_METADATA: &str = "metadata.json";

/// The `.metadata` files of DCP folders one level below the top (`X/.metadata`, `X` not hidden),
/// in name order.
pub fn nested_dcp_metadata(names: &[String]) -> Vec<String> {
    let mut metas: Vec<String> = names
        .iter()
        .filter(|n| {
            n.strip_suffix("/.metadata")
                .is_some_and(|dir| !dir.is_empty() && !dir.contains('/') && !dir.starts_with('.'))
        })
        .cloned()
        .collect();
    metas.sort();
    metas
}

/// One DCP folder's part: its folder name and its index.
struct Part {
    folder: String,
    index: CheckpointIndex,
}

fn top_keys(index: &CheckpointIndex) -> BTreeSet<String> {
    index
        .entries
        .iter()
        .filter_map(|e| match e.path.first() {
            Some(PathSeg::Key(k)) => Some(k.clone()),
            _ => None,
        })
        .collect()
}

/// Reads the files beside the DCP folders into `merged`: `torch.save` files (scheduler, RNG state,
/// a full model file), per-rank JSON and raw items; gives the sets read and the notes (the items
/// read as values, the files not read).
fn merge_beside(
    source: &dyn Source,
    merged: &mut CheckpointIndex,
) -> Result<(Vec<crate::index::ReadSet>, Vec<String>), IndexError> {
    let beside: Vec<String> = source
        .names()
        .into_iter()
        .filter(|n| {
            !n.contains('/')
                && !merged.files.contains_key(n)
                && file_ext(n) != "distcp"
                && n != TRAINER_STATE
                && n != MEGATRON_METADATA
        })
        .collect();
    let folder = sort_rank_folder(source, &beside)?;
    let mut notes: Vec<String> = unread_note(&folder.unread).into_iter().collect();
    let mut sets = Vec::new();
    for group in folder.torch {
        let (index, classes) = index_torch_sets(source, std::slice::from_ref(&group))?;
        let class = classes.first().copied().unwrap_or("extra");
        let item = set_item(&group.pattern);
        let name = if item.is_empty() {
            class.to_owned()
        } else {
            format!("{class}.{item}")
        };
        // The trainer's own state file beside its DCP is merged into the top level, as the
        // trainer's loader merges it, unless a key would clash.
        let at_top = MERGED_AT_TOP.contains(&group.pattern.as_str()) && {
            let have: BTreeSet<&str> = merged.entries.iter().map(|e| e.key.as_str()).collect();
            index
                .entries
                .iter()
                .all(|e| !e.key.is_empty() && !have.contains(e.key.as_str()))
        };
        let base = merged.entries.len() as u64;
        for mut e in index.entries {
            e.position = e.position.map(|p| p + base);
            merged
                .entries
                .push(if at_top { e } else { prefixed(e, &name) });
        }
        merged.files.extend(index.files);
        sets.push((group, class));
    }
    let (values, value_sets, note) = index_value_sets(source, folder.values)?;
    for (class, item, index) in values {
        let name = format!("{class}.{item}");
        let base = merged.entries.len() as u64;
        for mut e in index.entries {
            e.position = e.position.map(|p| p + base);
            merged.entries.push(prefixed(e, &name));
        }
        merged.files.extend(index.files);
    }
    sets.extend(value_sets);
    notes.extend(note);
    Ok((sets, notes))
}

/// Reads the DCP folders `metas` (`X/.metadata`) and the top-level `torch.save` files of `source`
/// as one checkpoint (see the module doc), with the per-rank sets read and their classes, and
/// notes for a user: the per-rank files beside the DCP that are not `torch.save` archives are
/// read as values ([`super::items`]), the other files beside it are named as not read.
pub fn index_dcp_folders(source: &dyn Source, metas: &[String]) -> Result<FolderRead, IndexError> {
    let mut parts = Vec::with_capacity(metas.len());
    for meta in metas {
        let folder = meta
            .strip_suffix(".metadata")
            .unwrap_or(meta)
            .trim_end_matches('/')
            .to_owned();
        parts.push(Part {
            folder,
            index: index_dcp(source, meta)?,
        });
    }
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let disjoint = parts.iter().all(|p| {
        let keys = top_keys(&p.index);
        let clash = keys.iter().any(|k| seen.contains(k));
        seen.extend(keys);
        !clash
    });
    let mut merged = CheckpointIndex {
        format: Format::Dcp,
        kind: parts
            .first()
            .map_or(crate::index::CheckpointKind::Plain, |p| p.index.kind),
        has_optimizer_state: parts.iter().any(|p| p.index.has_optimizer_state),
        entries: Vec::new(),
        files: BTreeMap::new(),
        dcp: parts.first().and_then(|p| p.index.dcp.clone()),
    };
    for part in parts {
        let base = merged.entries.len() as u64;
        let name = part.folder.replace('.', "_");
        for mut e in part.index.entries {
            e.position = e.position.map(|p| p + base);
            merged
                .entries
                .push(if disjoint { e } else { prefixed(e, &name) });
        }
        merged.files.extend(part.index.files);
    }
    let (sets, notes) = merge_beside(source, &mut merged)?;
    // The HF Trainer's own state (global step, epoch, log history), as values.
    if source.contains(TRAINER_STATE) {
        let index = crate::index::read::items::index_json_item(source, TRAINER_STATE)?;
        for e in index.entries {
            merged.entries.push(prefixed(e, "extra.trainer_state"));
        }
    }
    merged.entries.sort_by(|a, b| a.key.cmp(&b.key));
    if let Some(pair) = merged.entries.windows(2).find(|w| w[0].key == w[1].key) {
        return Err(IndexError::NotACheckpoint {
            reason: format!(
                "the folder's parts ({}) both hold the key `{}`",
                metas.join(", "),
                pair[0].key
            ),
        });
    }
    Ok((merged, sets, notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dcp_folders_one_level_down() {
        let names: Vec<String> = [
            ".hidden/.metadata",
            "optimizer_0/.metadata",
            "pytorch_model_fsdp_0/.metadata",
            "a/b/.metadata",
            "scheduler.bin",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        assert_eq!(
            nested_dcp_metadata(&names),
            vec!["optimizer_0/.metadata", "pytorch_model_fsdp_0/.metadata"]
        );
    }
}
