//! Items that are one value each: torch_checkpointing's JSON items (`json.dumps` text) and raw
//! items (an item's `bytes` as they are), a file per rank, and the per-rank folders that hold them
//! beside `torch.save` sets.
//!
//! An item is a value (raw: a Python `bytes`, shown as its length, first bytes and a digest); one
//! value when every rank's file holds the same bytes (a JSON object's keys as entries), else a list
//! by rank (files without a rank last). Its files are read whole, at most
//! [`MAX_VALUE_ITEM_BYTES`] each.
//!
//! torch_checkpointing writes `metadata.pkl` only when an item declares a resharder; without it a
//! folder is `<item>_<rank>.<ext>` files alone (`model_0.pt`, `train_state_0.json`, `x_0.bin`).
//! At world size 1 every name ends in `_0` and no number varies between them: the shared `0` is
//! then the rank of each file (`one_process_groups`).
//! [`index_rank_folder`] reads such a folder, and any folder of per-rank `torch.save` sets, whole:
//! each per-rank set of files that are not `torch.save` files (by name: `.pt`, `.pth`, `.ckpt`,
//! `.tar`; else by their first bytes: a zip or a legacy `torch.save` pickle) is an item under
//! `extra` (JSON when its files end in `.json`), and every other file that is not a `torch.save`
//! file is named in a note as not read, never left out silently.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::formats::pickle;
use crate::index::names::file_ext;
use crate::index::read::sets::{index_set_parts, index_torch_sets, merge_sets, set_item};
use crate::index::read::torch::json_of;
use crate::index::{
    CheckpointIndex, CheckpointKind, EntryKind, IndexEntry, IndexError, PathSeg, RankGroup,
    ReadSet, group_rank_files, is_torch_file,
};
use crate::source::Source;

/// The most bytes of one JSON or raw item file that are read (its value is held whole).
pub const MAX_VALUE_ITEM_BYTES: u64 = 64 << 20;

/// A JSON item: one file's value, shown as values (read whole, at most
/// [`MAX_VALUE_ITEM_BYTES`]).
pub(crate) fn index_json_item(
    source: &dyn Source,
    file: &str,
) -> Result<CheckpointIndex, IndexError> {
    let bytes = read_value_file(source, file)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| IndexError::Inconsistent {
        file: file.to_owned(),
        what: format!("not JSON: {e}"),
    })?;
    let mut entries = Vec::new();
    flatten_json(&value, &mut Vec::new(), &mut entries);
    Ok(CheckpointIndex {
        format: crate::index::Format::TorchSave,
        kind: CheckpointKind::Plain,
        has_optimizer_state: false,
        entries,
        files: BTreeMap::new(),
        dcp: None,
    })
}

fn flatten_json(v: &Value, path: &mut Vec<PathSeg>, out: &mut Vec<IndexEntry>) {
    if let Value::Object(map) = v
        && !map.is_empty()
    {
        for (k, item) in map {
            path.push(PathSeg::Key(k.clone()));
            flatten_json(item, path, out);
            path.pop();
        }
        return;
    }
    let key = path
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".");
    let mut entry = value_entry(v.clone(), None);
    entry.position = Some(out.len() as u64);
    entry.key = key;
    entry.path.clone_from(path);
    out.push(entry);
}

/// Whether `name` is a `torch.save` file by its first bytes (a zip, or a legacy `torch.save`
/// pickle), or by its name when it cannot be anything else (`.pt`, `.pth`, `.ckpt`, `.tar`: read
/// as one, so that a damaged file is an error naming it, not a raw item).
pub(crate) fn is_torch_item_file(source: &dyn Source, name: &str) -> bool {
    matches!(file_ext(name), "pt" | "pth" | "ckpt" | "tar")
        || starts_as_torch_save(source, name).unwrap_or(false)
}

/// The item a set of files names: its file name without the rank and extension, else its folder
/// (`dataloader/rank_{R}.bin` → `dataloader`).
pub(crate) fn item_name(group: &RankGroup) -> String {
    let item = set_item(&group.pattern);
    if !item.is_empty() {
        return item;
    }
    group
        .files
        .first()
        .and_then(|(f, _)| f.rsplit_once('/'))
        .map_or_else(String::new, |(dir, _)| dir.replace(['/', '.'], "_"))
}

/// One JSON or raw item file, read whole (at most [`MAX_VALUE_ITEM_BYTES`]).
fn read_value_file(source: &dyn Source, file: &str) -> Result<Vec<u8>, IndexError> {
    let size = source.size(file)?;
    if size > MAX_VALUE_ITEM_BYTES {
        return Err(IndexError::Inconsistent {
            file: file.to_owned(),
            what: format!(
                "a JSON or raw item of {size} bytes: items' values are read whole, at most {MAX_VALUE_ITEM_BYTES} bytes"
            ),
        });
    }
    let bytes = source.read_all(file)?;
    if bytes.len() as u64 != size {
        return Err(IndexError::Inconsistent {
            file: file.to_owned(),
            what: format!("read {} bytes of {size}", bytes.len()),
        });
    }
    Ok(bytes.into_owned())
}

/// A value entry at the item's root (`path` empty): `object` is the Python value, when it is not
/// `value` itself (JSON).
pub(crate) fn value_entry(value: Value, object: Option<pickle::PyValue>) -> IndexEntry {
    IndexEntry {
        position: Some(0),
        key: String::new(),
        raw_key: None,
        path: Vec::new(),
        kind: EntryKind::Scalar,
        dtype: None,
        shape: None,
        chunks: Vec::new(),
        fsdp: None,
        role: None,
        flat_param: false,
        value: Some(value),
        object: object.map(Box::new),
    }
}

/// A JSON or raw item (`files`: one per rank; see the module doc): one value when every rank's file holds the same
/// bytes (a JSON object's keys as entries), else one list by rank, as a `torch.save` list of
/// values is one entry.
pub(crate) fn index_value_item(
    source: &dyn Source,
    files: &[(String, Option<u32>)],
    json: bool,
) -> Result<CheckpointIndex, IndexError> {
    let mut infos = BTreeMap::new();
    let mut contents: Vec<(Option<u32>, Vec<u8>)> = Vec::with_capacity(files.len());
    for (file, rank) in files {
        let bytes = read_value_file(source, file)?;
        infos.insert(
            file.clone(),
            crate::index::FileInfo {
                size: bytes.len() as u64,
                rank: *rank,
                unreferenced_bytes: 0,
            },
        );
        if json {
            serde_json::from_slice::<Value>(&bytes).map_err(|e| IndexError::Inconsistent {
                file: file.clone(),
                what: format!("a JSON item that is not JSON: {e}"),
            })?;
        }
        contents.push((*rank, bytes));
    }
    // By rank (files without one in name order, after).
    contents.sort_by_key(|(rank, _)| (rank.is_none(), *rank));
    let same = contents.windows(2).all(|w| w[0].1 == w[1].1);
    let parse = |b: &[u8]| serde_json::from_slice::<Value>(b).unwrap_or(Value::Null);
    let mut entries = Vec::new();
    match (json, same) {
        (true, true) => {
            let value = contents.first().map_or(Value::Null, |(_, b)| parse(b));
            flatten_json(&value, &mut Vec::new(), &mut entries);
        }
        (true, false) => entries.push(value_entry(
            Value::Array(contents.iter().map(|(_, b)| parse(b)).collect()),
            None,
        )),
        (false, true) => {
            let value = pickle::PyValue::Bytes(contents.swap_remove(0).1);
            entries.push(value_entry(json_of(&value), Some(value)));
        }
        (false, false) => {
            let value = pickle::PyValue::List(
                contents
                    .into_iter()
                    .map(|(_, b)| pickle::PyValue::Bytes(b))
                    .collect(),
            );
            entries.push(value_entry(json_of(&value), Some(value)));
        }
    }
    Ok(CheckpointIndex {
        format: crate::index::Format::TorchSave,
        kind: CheckpointKind::Plain,
        has_optimizer_state: false,
        entries,
        files: infos,
        dcp: None,
    })
}

/// A per-rank folder's files sorted by what they are ([`sort_rank_folder`]).
#[derive(Debug, Default)]
pub(crate) struct RankFolder {
    /// Sets of `torch.save` archives (a file without a rank is a set of one).
    pub(crate) torch: Vec<RankGroup>,
    /// Per-rank sets of files that are not `torch.save` archives, each with whether it is JSON.
    pub(crate) values: Vec<(RankGroup, bool)>,
    /// Files that are neither: not `torch.save` archives and not per rank (`README.txt`).
    pub(crate) unread: Vec<String>,
}

/// Whether `name` starts as a `torch.save` file does: a zip, or a legacy `torch.save` pickle
/// (read as one, so that the reader's error names it rather than it being taken for bytes).
fn starts_as_torch_save(source: &dyn Source, name: &str) -> Result<bool, IndexError> {
    let head = source.read_range(name, 0, source.size(name)?.min(32))?;
    Ok(head.starts_with(b"PK\x03\x04")
        || crate::formats::torch_zip::looks_like_legacy_torch_save(&head))
}

/// `<item>_0.<ext>`: the name of an item's file at rank 0 in torch_checkpointing's default layout
/// (`model_0.pt`, `train_state_0.json`); the pattern with `{R}` for the `0`.
fn rank0_pattern(name: &str) -> Option<String> {
    let base = name.rsplit('/').next().unwrap_or(name);
    let (stem, ext) = base
        .rsplit_once('.')
        .map_or((base, None), |(s, e)| (s, Some(e)));
    let item = stem.strip_suffix("_0")?;
    if item.is_empty() || item.ends_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    Some(match ext {
        Some(ext) => format!("{item}_{{R}}.{ext}"),
        None => format!("{item}_{{R}}"),
    })
}

/// The groups of a one-process run's folder (torch_checkpointing at world size 1: `model_0.pt`,
/// `train_state_0.json`, `x_0.bin`), where no number varies between names and so no group is a
/// per-rank set: when every group is one file at rank 0 (`<item>_0.<ext>`, or a per-rank
/// pattern's rank 0) and one of them is not a `torch.save` file (a JSON or raw item, which only
/// the per-rank reading takes for an item), the shared `0` is each file's rank. Other folders keep
/// their groups.
fn one_process_groups(
    source: &dyn Source,
    groups: Vec<RankGroup>,
) -> Result<Vec<RankGroup>, IndexError> {
    let lone_rank0 = |g: &RankGroup| match g.files.as_slice() {
        [(f, rank)] => {
            if g.pattern.contains("{R}") {
                *rank == Some(0)
            } else {
                rank.is_none() && rank0_pattern(f).is_some()
            }
        }
        _ => false,
    };
    if groups.len() < 2 || !groups.iter().all(lone_rank0) {
        return Ok(groups);
    }
    let mut has_item = false;
    for g in groups.iter().filter(|g| !g.pattern.contains("{R}")) {
        let (f, _) = &g.files[0];
        if !matches!(file_ext(f), "pt" | "pth" | "ckpt" | "tar")
            && !starts_as_torch_save(source, f)?
        {
            has_item = true;
            break;
        }
    }
    if !has_item {
        return Ok(groups);
    }
    Ok(groups
        .into_iter()
        .map(|g| {
            if g.pattern.contains("{R}") {
                return g;
            }
            let (f, _) = g.files.into_iter().next().unwrap_or_default();
            RankGroup {
                pattern: rank0_pattern(&f).unwrap_or_default(),
                files: vec![(f, Some(0))],
            }
        })
        .collect())
}

/// Sorts `names` (hidden files left out) into `torch.save` sets, per-rank value items and files
/// not read. A set is `torch.save` when a file's name says so (`.pt`, `.pth`, `.ckpt`, `.tar`; a
/// file without a rank named `.bin` too, as before) or one of its files starts as one (a zip, a
/// legacy `torch.save` pickle; for a file without a rank, only a `.pkl`: accelerate's
/// `random_states.pkl`), so that a damaged archive is read, and named in the error, rather than
/// taken for an item.
pub(crate) fn sort_rank_folder(
    source: &dyn Source,
    names: &[String],
) -> Result<RankFolder, IndexError> {
    // Hidden files, and a manifest `convert --manifest` put inside the folder (the content
    // manifest of the rest, not a part of the checkpoint).
    let hidden = |n: &str| {
        n.split('/').any(|c| c.starts_with('.'))
            || n.rsplit('/').next() == Some(crate::manifest::FOLDER_MANIFEST)
    };
    let visible: Vec<String> = names.iter().filter(|n| !hidden(n)).cloned().collect();
    let mut folder = RankFolder::default();
    for group in one_process_groups(source, group_rank_files(&visible))? {
        let per_rank = group.pattern.contains("{R}");
        let by_name = group.files.iter().any(|(f, _)| {
            matches!(file_ext(f), "pt" | "pth" | "ckpt" | "tar") || (!per_rank && is_torch_file(f))
        });
        let mut torch = by_name;
        let ext = file_ext(&group.pattern);
        if !torch && (per_rank || ext == "pkl") && ext != "safetensors" {
            for (f, _) in &group.files {
                if starts_as_torch_save(source, f)? {
                    torch = true;
                    break;
                }
            }
        }
        if torch {
            folder.torch.push(group);
        } else if per_rank && file_ext(&group.pattern) != "safetensors" {
            let json = group.files.iter().all(|(f, _)| file_ext(f) == "json");
            folder.values.push((group, json));
        } else {
            folder
                .unread
                .extend(group.files.into_iter().map(|(f, _)| f));
        }
    }
    Ok(folder)
}

/// At most this many file names in a note.
const NAMES_SHOWN: usize = 10;

fn listed(names: &[String]) -> String {
    let mut text = names
        .iter()
        .take(NAMES_SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > NAMES_SHOWN {
        text = format!("{text} and {} more", names.len() - NAMES_SHOWN);
    }
    text
}

/// The note naming files not read ([`RankFolder::unread`]), if any.
pub(crate) fn unread_note(unread: &[String]) -> Option<String> {
    (!unread.is_empty()).then(|| {
        format!(
            "not read (neither torch.save archives nor per-rank item files): {}",
            listed(unread)
        )
    })
}

/// A folder's per-rank value items ([`RankFolder::values`]), each `("extra", item, index)` as
/// [`merge_sets`] takes it, with its set, and the note naming them (none without items).
pub(crate) type ValueSets = (
    Vec<(&'static str, String, CheckpointIndex)>,
    Vec<ReadSet>,
    Option<String>,
);

/// Reads a folder's per-rank value items (see [`ValueSets`]).
pub(crate) fn index_value_sets(
    source: &dyn Source,
    values: Vec<(RankGroup, bool)>,
) -> Result<ValueSets, IndexError> {
    let mut parts = Vec::with_capacity(values.len());
    let mut sets = Vec::with_capacity(values.len());
    let mut read_as = Vec::with_capacity(values.len());
    for (group, json) in values {
        let index = index_value_item(source, &group.files, json)?;
        read_as.push(format!(
            "{} ({})",
            group.pattern.replace("{R}", "{r}"),
            if json { "JSON" } else { "raw bytes" }
        ));
        parts.push(("extra", item_name(&group), index));
        sets.push((group, "extra"));
    }
    let note = (!read_as.is_empty()).then(|| {
        format!(
            "per-rank files that are not torch.save archives read as values under `extra`, as torch_checkpointing's JSON and raw items: {}",
            listed(&read_as)
        )
    });
    Ok((parts, sets, note))
}

/// What [`index_rank_folder`] read: the index, the sets read with their classes, and notes for a
/// user (the sets read as values, the files not read).
pub type FolderRead = (CheckpointIndex, Vec<ReadSet>, Vec<String>);

/// Reads a folder of per-rank `torch.save` sets (`names`: its files) with the per-rank JSON and raw
/// items beside them (see the module doc): the sets as [`crate::index::index_torch_sets`] reads
/// them, each item a subtree of `extra` ([`merge_sets`]), and a note naming the files not read.
/// A folder with no `torch.save` set is read as `torch.save` files, so that a file named as one
/// but not one is an error naming it.
pub fn index_rank_folder(source: &dyn Source, names: &[String]) -> Result<FolderRead, IndexError> {
    let folder = sort_rank_folder(source, names)?;
    if folder.torch.is_empty() {
        let torch: Vec<String> = names.iter().filter(|n| is_torch_file(n)).cloned().collect();
        let groups = group_rank_files(&torch);
        let (index, classes) = index_torch_sets(source, &groups)?;
        return Ok((index, groups.into_iter().zip(classes).collect(), Vec::new()));
    }
    let mut notes: Vec<String> = unread_note(&folder.unread).into_iter().collect();
    if folder.values.is_empty() {
        let (index, classes) = index_torch_sets(source, &folder.torch)?;
        return Ok((
            index,
            folder.torch.into_iter().zip(classes).collect(),
            notes,
        ));
    }
    let mut parts = index_set_parts(source, &folder.torch)?;
    let mut sets: Vec<ReadSet> = folder
        .torch
        .into_iter()
        .zip(parts.iter().map(|(class, _, _)| *class))
        .collect();
    let (value_parts, value_sets, note) = index_value_sets(source, folder.values)?;
    parts.extend(value_parts);
    sets.extend(value_sets);
    notes.extend(note);
    Ok((merge_sets(parts), sets, notes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::MemorySource;

    #[test]
    fn value_items_are_named_by_file_or_folder() {
        let group = |pattern: &str, file: &str| RankGroup {
            pattern: pattern.to_owned(),
            files: vec![(file.to_owned(), Some(0))],
        };
        assert_eq!(
            item_name(&group("train_state_{R}.json", "train_state_0.json")),
            "train_state"
        );
        assert_eq!(
            item_name(&group("rank_{R}.bin", "dataloader/rank_0.bin")),
            "dataloader"
        );
    }

    #[test]
    fn a_one_process_folder_reads_its_shared_0_as_the_rank() {
        let zip = b"PK\x03\x04rest".to_vec();
        let raw = b"\x80\x02}q\x00.".to_vec();
        let sorted = |files: &[(&str, &[u8])]| {
            let mut source = MemorySource::new();
            for (name, bytes) in files {
                source.insert(*name, bytes.to_vec());
            }
            let f = sort_rank_folder(&source, &source.names()).unwrap();
            let names = |g: &[&RankGroup]| -> Vec<(String, Vec<Option<u32>>)> {
                g.iter()
                    .map(|g| (g.pattern.clone(), g.files.iter().map(|f| f.1).collect()))
                    .collect()
            };
            let values: Vec<&RankGroup> = f.values.iter().map(|(g, _)| g).collect();
            (
                names(&f.torch.iter().collect::<Vec<_>>()),
                names(&values),
                f.unread,
            )
        };
        // torch_checkpointing at world size 1: `_0` is the rank of every file.
        let (torch, values, unread) = sorted(&[
            ("model_0.pt", &zip),
            ("optimizer_0.pt", &zip),
            ("train_state_0.json", b"{}"),
            ("x_0.bin", &raw),
            ("vocab_0.txt", b"tok"),
        ]);
        let r0 = || vec![Some(0)];
        assert_eq!(
            torch,
            vec![
                ("model_{R}.pt".to_owned(), r0()),
                ("optimizer_{R}.pt".to_owned(), r0())
            ]
        );
        assert_eq!(
            values,
            vec![
                ("train_state_{R}.json".to_owned(), r0()),
                ("vocab_{R}.txt".to_owned(), r0()),
                ("x_{R}.bin".to_owned(), r0())
            ]
        );
        assert!(unread.is_empty(), "{unread:?}");
        // Only torch.save files: the groups stay as they were (files without a rank).
        let (torch, values, _) = sorted(&[("model_0.pt", &zip), ("optimizer_0.bin", &zip)]);
        assert_eq!(
            torch,
            vec![
                ("model_0.pt".to_owned(), vec![None]),
                ("optimizer_0.bin".to_owned(), vec![None])
            ]
        );
        assert!(values.is_empty());
        // A file that is not `<item>_0.<ext>` (accelerate's `scheduler.bin`, a `_10`): as before.
        for other in ["scheduler.bin", "x_10.bin"] {
            let (_, values, unread) =
                sorted(&[("model_0.pt", &zip), ("notes_0.txt", b"n"), (other, &zip)]);
            assert!(values.is_empty(), "{other}: {values:?}");
            assert_eq!(unread, vec!["notes_0.txt".to_owned()], "{other}");
        }
    }

    #[test]
    fn folders_sort_into_torch_sets_items_and_files_not_read() {
        let zip = b"PK\x03\x04rest".to_vec();
        // The head torch 2.15 writes with `_use_new_zipfile_serialization=False`.
        let legacy =
            b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19\x2e\x80\x02".to_vec();
        let raw = b"\x80\x02}q\x00.".to_vec();
        let source = MemorySource::new()
            .with("model_0.pt", b"damaged".to_vec())
            .with("model_1.pt", zip.clone())
            .with("train_state_0.json", b"{}".to_vec())
            .with("train_state_1.json", b"{}".to_vec())
            .with("x_0.bin", raw.clone())
            .with("x_1.bin", b"ab".to_vec())
            .with("y_0.bin", b"damaged".to_vec())
            .with("y_1.bin", zip.clone())
            .with("old_0.bin", legacy.clone())
            .with("old_1.bin", legacy)
            .with("acc_0.pkl", zip)
            .with("acc_1.pkl", b"damaged".to_vec())
            .with("scheduler.bin", raw)
            .with("README.txt", b"hi".to_vec())
            .with("config.json", b"{}".to_vec())
            .with(".hidden", b"x".to_vec())
            .with("sub/.metadata_like", b"x".to_vec());
        let folder = sort_rank_folder(&source, &source.names()).unwrap();
        let patterns = |groups: Vec<&RankGroup>| -> Vec<String> {
            groups.into_iter().map(|g| g.pattern.clone()).collect()
        };
        // Damaged archives stay torch.save sets (their reader names them); `scheduler.bin`
        // without a rank is read as torch.save, as before.
        assert_eq!(
            patterns(folder.torch.iter().collect()),
            vec![
                "acc_{R}.pkl",
                "model_{R}.pt",
                "old_{R}.bin",
                "scheduler.bin",
                "y_{R}.bin"
            ]
        );
        assert_eq!(
            folder
                .values
                .iter()
                .map(|(g, json)| (g.pattern.as_str(), *json))
                .collect::<Vec<_>>(),
            vec![("train_state_{R}.json", true), ("x_{R}.bin", false)]
        );
        assert_eq!(folder.unread, vec!["README.txt", "config.json"]);
    }

    #[test]
    fn notes_name_at_most_ten_files() {
        let names: Vec<String> = (0..12).map(|i| format!("f{i}")).collect();
        assert_eq!(listed(&names[..2]), "f0, f1");
        assert!(
            listed(&names).ends_with("f9 and 2 more"),
            "{}",
            listed(&names)
        );
    }
}
