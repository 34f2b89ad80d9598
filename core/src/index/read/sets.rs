//! A folder of several per-rank `torch.save` sets, as training runs write them: one checkpoint with
//! a subtree per set, as a DCP app state nests them.
//!
//! Each set is classified by what it is ([`set_class`]): `optim` (optimizer state, nested
//! `state`/`param_groups` or flattened `state.<fqn>.<name>`/`param_groups.<fqn>.<key>`), `extra`
//! (scheduler, RNG, data loader, trainer state, counters: by the set's name or its top-level keys),
//! `model` (floating-point tensors). One set of a class is the subtree `model`/`optim`/`extra`;
//! several sets of one class are `class.item`, the item being the set's file name without its rank
//! (`extra.lr_scheduler`, `extra.train_state`, `extra.step` for torch_checkpointing's
//! `lr_scheduler_{R}.pt`, `train_state_{R}.pt`, `step_{R}.pt`). No key ever holds the `{R}` of a
//! pattern.

use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::index::read::torch::index_torch_files_ranked;
use crate::index::{
    CheckpointIndex, CheckpointKind, EntryKind, Format, IndexEntry, IndexError, PathSeg, RankGroup,
};
use crate::source::Source;

/// Indexes `torch.save` files grouped into per-rank sets ([`crate::index::group_rank_files`], or
/// the sets a caller names): one set is read as one checkpoint; several become subtrees named by
/// what they hold (see the module doc).
pub fn index_torch_groups(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<CheckpointIndex, IndexError> {
    index_torch_sets(source, groups).map(|(index, _)| index)
}

/// Words in a set's file name that say it holds training state besides the model and optimizer.
const EXTRA_NAME_WORDS: &[&str] = &[
    "extra",
    "rng",
    "random",
    "scheduler",
    "schedulers",
    "sched",
    "dataloader",
    "dataloaders",
    "sampler",
    "step",
    "steps",
    "epoch",
    "meta",
    "metadata",
    "common",
    "scaler",
    "callbacks",
];

/// Word pairs in a set's file name that say the same (`train_state_{R}.pt`).
const EXTRA_NAME_PAIRS: &[(&str, &str)] = &[
    ("train", "state"),
    ("trainer", "state"),
    ("data", "loader"),
    ("lr", "scheduler"),
];

/// Top-level keys of a saved object that are training state, not parameters: a file whose keys
/// are all among them is extra state (`{"lr_scheduler": …, "rng": {…}}`).
pub const EXTRA_KEYS: &[&str] = &[
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "schedulers",
    "rng",
    "rng_state",
    "rng_states",
    "random",
    "python",
    "numpy",
    "torch",
    "cuda",
    "cpu",
    "dataloader",
    "data_loader",
    "sampler",
    "train_state",
    "trainer_state",
    "step",
    "global_step",
    "epoch",
    "iteration",
    "loops",
    "callbacks",
    "hparams",
    "hyper_parameters",
    "args",
    "config",
    "scaler",
    "grad_scaler",
    "ntokens_seen",
];

/// The lower-case words of a set's file name (without the extension and the rank).
fn name_words(pattern: &str) -> Vec<String> {
    let base = pattern.rsplit('/').next().unwrap_or(pattern);
    let stem = base.rsplit_once('.').map_or(base, |(s, _)| s);
    stem.replace("{R}", " ")
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect()
}

/// Whether the set's file name says it holds extra training state.
fn named_extra(pattern: &str) -> bool {
    let words = name_words(pattern);
    words.iter().any(|w| EXTRA_NAME_WORDS.contains(&w.as_str()))
        || words
            .windows(2)
            .any(|p| EXTRA_NAME_PAIRS.contains(&(p[0].as_str(), p[1].as_str())))
}

/// Whether every top-level key of the set is a training-state key ([`EXTRA_KEYS`]); a set that
/// is one scalar (`step_{R}.pt` holding `7`) is too.
fn keys_extra(index: &CheckpointIndex) -> bool {
    index.entries.iter().all(|e| match e.path.first() {
        None => e.kind != EntryKind::Tensor,
        Some(PathSeg::Key(k)) => EXTRA_KEYS.contains(&k.as_str()),
        Some(PathSeg::Index(_) | PathSeg::IntKey(_)) => false,
    })
}

/// Whether the set is a flattened optimizer state dict (`get_optimizer_state_dict(...,
/// flatten_optimizer_state_dict=True)`, torchtitan's): every key is `state.<fqn>.<name>` or
/// `param_groups.<fqn>.<key>`, and there is at least one of each kind.
pub(crate) fn is_flat_optimizer(index: &CheckpointIndex) -> bool {
    let first = |e: &crate::index::IndexEntry| match e.path.first() {
        Some(PathSeg::Key(k)) => Some(k.clone()),
        _ => None,
    };
    let keys: Vec<String> = index.entries.iter().filter_map(first).collect();
    keys.len() == index.entries.len()
        && keys.iter().any(|k| k.starts_with("state."))
        && keys.iter().any(|k| k.starts_with("param_groups."))
        && keys
            .iter()
            .all(|k| k.starts_with("state.") || k.starts_with("param_groups."))
}

/// What one per-rank set of `torch.save` files (named by `pattern`, `{R}` for the rank) holds:
/// `optim` when its content is optimizer state (nested or flattened), else `extra` when its name
/// or its top-level keys say it is training state (scheduler, RNG, data loader, counters), else
/// `model` when it holds floating-point tensors, else `extra`.
pub fn set_class(index: &CheckpointIndex, pattern: &str) -> &'static str {
    if index.has_optimizer_state
        || index.entries.iter().any(|e| e.role.is_some())
        || is_flat_optimizer(index)
    {
        "optim"
    } else if named_extra(pattern) || keys_extra(index) {
        "extra"
    } else if index
        .entries
        .iter()
        .any(|e| e.kind == EntryKind::Tensor && e.dtype.is_some_and(DType::is_floating_point))
    {
        "model"
    } else {
        "extra"
    }
}

/// The item a set's pattern names: its file name without the extension and the rank (with the
/// separator and a `rank` word before it): `lr_scheduler_{R}.pt` → `lr_scheduler`,
/// `extra_state_world_size_2_rank_{R}.pt` → `extra_state_world_size_2`, `{R}_model.pt` → `model`.
/// Dots become `_` (one path segment); empty when nothing is left.
pub fn set_item(pattern: &str) -> String {
    let base = pattern.rsplit('/').next().unwrap_or(pattern);
    let stem = base.rsplit_once('.').map_or(base, |(s, _)| s);
    let (head, tail) = stem.split_once("{R}").unwrap_or((stem, ""));
    let trim = |s: &str| {
        s.trim_matches(|c: char| c == '_' || c == '-' || c == '.')
            .to_owned()
    };
    let mut head = trim(head);
    for word in ["rank", "Rank", "RANK"] {
        if let Some(h) = head.strip_suffix(word) {
            head = trim(h);
        }
    }
    let tail = trim(tail);
    let item = match (head.is_empty(), tail.is_empty()) {
        (false, false) => format!("{head}_{tail}"),
        (false, true) => head,
        (true, _) => tail,
    };
    item.replace('.', "_")
}

/// [`index_torch_groups`], also giving each set's class ([`set_class`]) in `groups` order.
pub fn index_torch_sets(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<(CheckpointIndex, Vec<&'static str>), IndexError> {
    match groups {
        [] => Err(IndexError::NotACheckpoint {
            reason: "no torch.save files".into(),
        }),
        [one] => {
            let index = index_torch_files_ranked(source, &one.files)?;
            let class = set_class(&index, &one.pattern);
            Ok((index, vec![class]))
        }
        _ => index_file_sets(source, groups),
    }
}

/// The subtree name of each set `(class, item)`: its class alone when the class has one set, else
/// `class.item` (the set's position when the item is empty or two items read the same).
fn subtree_names(parts: &[(&'static str, String)]) -> Vec<String> {
    let count = |class: &str| parts.iter().filter(|(c, _)| *c == class).count();
    let mut names: Vec<String> = parts
        .iter()
        .enumerate()
        .map(|(i, (class, item))| {
            if count(class) == 1 {
                (*class).to_owned()
            } else if item.is_empty() {
                format!("{class}.set{i}")
            } else {
                format!("{class}.{item}")
            }
        })
        .collect();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for n in &names {
        *seen.entry(n.clone()).or_default() += 1;
    }
    for (i, n) in names.iter_mut().enumerate() {
        if seen.get(n.as_str()).copied().unwrap_or(0) > 1 {
            *n = format!("{n}_{i}");
        }
    }
    names
}

/// Each set of `torch.save` files read: its class ([`set_class`]), its item ([`set_item`]) and its
/// index, in `groups` order (what [`merge_sets`] takes).
pub(crate) fn index_set_parts(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<Vec<(&'static str, String, CheckpointIndex)>, IndexError> {
    let mut parts = Vec::with_capacity(groups.len());
    for RankGroup { pattern, files } in groups {
        let index = index_torch_files_ranked(source, files)?;
        parts.push((set_class(&index, pattern), set_item(pattern), index));
    }
    Ok(parts)
}

fn index_file_sets(
    source: &dyn Source,
    groups: &[RankGroup],
) -> Result<(CheckpointIndex, Vec<&'static str>), IndexError> {
    let parts = index_set_parts(source, groups)?;
    let classes: Vec<&'static str> = parts.iter().map(|(c, _, _)| *c).collect();
    Ok((merge_sets(parts), classes))
}

/// `e` under the subtree `name` (dotted): its key, raw key and path. A set that is one value
/// (`step_{R}.pt` holding an int) is the subtree itself.
pub(crate) fn prefixed(mut e: IndexEntry, name: &str) -> IndexEntry {
    fn join(name: &str, k: &str) -> String {
        if k.is_empty() {
            name.to_owned()
        } else {
            format!("{name}.{k}")
        }
    }
    e.key = join(name, &e.key);
    e.raw_key = e.raw_key.as_deref().map(|k| join(name, k));
    let prefix: Vec<PathSeg> = name
        .split('.')
        .map(|s| PathSeg::Key(s.to_owned()))
        .collect();
    e.path.splice(0..0, prefix);
    e
}

/// One checkpoint from the indexes of several sets, each `(class, item, index)`: a subtree per
/// set, named by its class alone when the class has one set, else `class.item`.
pub(crate) fn merge_sets(parts: Vec<(&'static str, String, CheckpointIndex)>) -> CheckpointIndex {
    let names = subtree_names(
        &parts
            .iter()
            .map(|(c, item, _)| (*c, item.clone()))
            .collect::<Vec<_>>(),
    );
    let kind = parts
        .iter()
        .find(|(c, _, _)| *c == "model")
        .or(parts.first())
        .map_or(CheckpointKind::Plain, |(_, _, i)| i.kind);
    let mut merged = CheckpointIndex {
        format: parts
            .first()
            .map_or(Format::TorchSave, |(_, _, i)| i.format),
        kind,
        has_optimizer_state: parts.iter().any(|(_, _, i)| i.has_optimizer_state),
        entries: Vec::new(),
        files: BTreeMap::new(),
        dcp: None,
    };
    for ((_, _, index), name) in parts.into_iter().zip(names) {
        let base = merged.entries.len() as u64;
        for mut e in index.entries {
            e.position = e.position.map(|p| p + base);
            merged.entries.push(prefixed(e, &name));
        }
        merged.files.extend(index.files);
    }
    merged.entries.sort_by(|a, b| a.key.cmp(&b.key));
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_drop_the_rank() {
        assert_eq!(set_item("lr_scheduler_{R}.pt"), "lr_scheduler");
        assert_eq!(
            set_item("extra_state_world_size_2_rank_{R}.pt"),
            "extra_state_world_size_2"
        );
        assert_eq!(set_item("{R}_model.pt"), "model");
        assert_eq!(set_item("rank{R}_optim.pt"), "optim");
        assert_eq!(set_item("model.v2_{R}.bin"), "model_v2");
        assert_eq!(set_item("{R}.pt"), "");
        for p in ["a_{R}.pt", "rank{R}.pt", "x-{R}-y.pth"] {
            assert!(!set_item(p).contains('{'), "{p}");
        }
    }

    #[test]
    fn names_say_extra() {
        for p in [
            "extra_state_world_size_2_rank_{R}.pt",
            "lr_scheduler_{R}.pt",
            "train_state_{R}.pt",
            "step_{R}.pt",
            "rng_state_{R}.pth",
            "dataloader_{R}.pt",
        ] {
            assert!(named_extra(p), "{p}");
        }
        for p in [
            "model_world_size_2_rank_{R}.pt",
            "optimizer_{R}.pt",
            "rank{R}_model.pt",
            "model_{R}.pt",
            "pytorch_model_fsdp_rank{R}.bin",
        ] {
            assert!(!named_extra(p), "{p}");
        }
    }

    #[test]
    fn same_items_stay_apart() {
        let parts = vec![
            ("extra", set_item("a_{R}.pt")),
            ("extra", set_item("a-{R}.pt")),
            ("model", set_item("m_{R}.pt")),
        ];
        let names = subtree_names(&parts);
        assert_eq!(names, vec!["extra.a_0", "extra.a_1", "model"]);
    }
}
