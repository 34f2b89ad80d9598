//! torch_checkpointing folders (PyPI `torch-checkpointing`, torchtitan's coming format) read
//! through their `metadata.pkl`.
//!
//! A checkpoint is one file per top-level item and rank: `<item>_<rank>.pt` by default, or any
//! path an item's `LayoutInfo` gives (`{rank}` and sub-folders allowed), serialized by
//! `torch.save`, safetensors, JSON or raw bytes. When an item declares a resharder the library
//! writes `metadata.pkl`, a plain pickle of `DistributedMetadata.to_dict()`:
//!
//! ```text
//! {"metadata": {item: {"nested_path_to_metadata": {'["a.b", "c"]': [{"ranks": (0, 1),
//!                        "sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
//!                          "dtype": "torch.float32", "global_shape": [...], "stride": [...],
//!                          "mesh_spec": {"mesh_shape": (2,), "mesh_data": (0, 1), ...},
//!                          "placements": [{"type": "Shard", "dim": 0}]}}}]},
//!                     "rank_to_layout_info": {rank: {"file_path": ..., "serialization_format":
//!                        {"type": "SafetensorsSerialization"}} or None}}},
//!  "world_size": 2, "version": "2.0"}
//! ```
//!
//! It is read by the restricted pickle reader (built-in types only; nothing is executed). The
//! files of an item come from `rank_to_layout_info` (else the default naming); a safetensors item
//! holds each rank's local slice under its flattened key, placed here in the global tensor as
//! DTensor places it (the mesh coordinate of the rank in `mesh_data`, the placements, the global
//! shape). `torch.save` items carry their own geometry. Items without metadata (`lr_scheduler`,
//! `train_state`, `step`) are found by the default naming. Every item is a subtree, as a folder
//! of per-rank sets is ([`super::sets`]).
//!
//! The library loads an item into the state dict it is given, so its keys come back in the
//! trainer's model order; the files do not record that order (safetensors headers are sorted,
//! `metadata.pkl`'s key paths come from a set). A safetensors item's keys take the order of the
//! flattened optimizer item (`param_groups.<fqn>.<key>`, one per parameter in the model's order)
//! when there is one; keys it does not name follow, by name.
//!
//! JSON and raw items (the library writes `json.dumps` text or the item's `bytes` as they are, a
//! file per rank where the path holds `{rank}`) are never in `metadata.pkl` (only tensors are):
//! every other file of the folder that is not a `torch.save` archive is one, JSON when its name
//! ends in `.json`, read as [`super::items`] reads them (values, at most
//! [`super::items::MAX_VALUE_ITEM_BYTES`] each). Without `metadata.pkl` the folder is read by
//! [`super::items::index_rank_folder`].

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::formats::pickle::{self, Placement};
use crate::index::read::items::{index_value_item, is_torch_item_file, item_name};
use crate::index::read::safetensors::index_safetensors;
use crate::index::read::sets::{merge_sets, set_class, set_item};
use crate::index::read::torch::{dtensor_offsets, index_torch_files_ranked, json_of};
use crate::index::{
    CheckpointIndex, CheckpointKind, FsdpInfo, IndexEntry, IndexError, RankGroup, ReadSet,
    group_rank_files, is_torch_file,
};
use crate::source::Source;

/// The file torch_checkpointing writes its metadata to.
pub const METADATA_PKL: &str = "metadata.pkl";

/// Where one tensor of an item lies in the global tensor (from `metadata.pkl`).
#[derive(Debug, Clone)]
struct Geometry {
    global_shape: Vec<u64>,
    placements: Vec<Placement>,
    mesh_shape: Vec<u64>,
    /// The ranks of the mesh in row-major order.
    mesh_ranks: Vec<u64>,
}

/// One item of the checkpoint as `metadata.pkl` describes it.
#[derive(Debug, Default)]
struct ItemMeta {
    /// Per rank: the file and its serialization (`None`: the default, `<item>_<rank>.pt`).
    files: BTreeMap<u32, (String, String)>,
    tensors: BTreeMap<String, Geometry>,
}

fn bad(what: impl Into<String>) -> IndexError {
    IndexError::Inconsistent {
        file: METADATA_PKL.to_owned(),
        what: what.into(),
    }
}

fn u64s(v: &Value, what: &str) -> Result<Vec<u64>, IndexError> {
    v.as_array()
        .ok_or_else(|| bad(format!("{what} is not a list")))?
        .iter()
        .map(|x| {
            x.as_u64()
                .ok_or_else(|| bad(format!("{what} holds a non-integer")))
        })
        .collect()
}

fn placement(v: &Value) -> Result<Placement, IndexError> {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or_default();
    let dim = || {
        v.get("dim")
            .and_then(Value::as_i64)
            .ok_or_else(|| bad(format!("placement {v} has no dim")))
    };
    Ok(match kind {
        "Shard" => Placement::Shard { dim: dim()? },
        "StridedShard" | "_StridedShard" => Placement::StridedShard {
            dim: dim()?,
            split_factor: v.get("split_factor").and_then(Value::as_i64).unwrap_or(1),
        },
        "Replicate" => Placement::Replicate,
        other => Placement::Other {
            class: other.to_owned(),
        },
    })
}

/// The nested key path `'["a.b", "c"]'` as the flattened key `a.b.c`.
fn path_key(path: &str) -> Result<String, IndexError> {
    let parts: Vec<Value> =
        serde_json::from_str(path).map_err(|e| bad(format!("key path {path}: {e}")))?;
    let parts: Vec<String> = parts
        .iter()
        .map(|p| match p {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect();
    Ok(parts.join("."))
}

fn geometry(record: &Value, key: &str) -> Result<Option<Geometry>, IndexError> {
    let Some(sharding) = record.get("sharding_metadata") else {
        return Ok(None);
    };
    if sharding.get("type").and_then(Value::as_str) != Some("DTensorShardingMetadata") {
        return Ok(None);
    }
    let data = sharding
        .get("data")
        .ok_or_else(|| bad(format!("{key}: sharding metadata without data")))?;
    let mesh = data
        .get("mesh_spec")
        .ok_or_else(|| bad(format!("{key}: no mesh_spec")))?;
    let placements = data
        .get("placements")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(format!("{key}: no placements")))?
        .iter()
        .map(placement)
        .collect::<Result<Vec<_>, _>>()?;
    let geometry = Geometry {
        global_shape: u64s(
            data.get("global_shape").unwrap_or(&Value::Null),
            "global_shape",
        )?,
        placements,
        mesh_shape: u64s(mesh.get("mesh_shape").unwrap_or(&Value::Null), "mesh_shape")?,
        mesh_ranks: u64s(mesh.get("mesh_data").unwrap_or(&Value::Null), "mesh_data")?,
    };
    let cells = geometry
        .mesh_shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d));
    if cells != Some(geometry.mesh_ranks.len() as u64)
        || geometry.placements.len() != geometry.mesh_shape.len()
    {
        return Err(bad(format!(
            "{key}: mesh {:?} with {} ranks and {} placements do not agree",
            geometry.mesh_shape,
            geometry.mesh_ranks.len(),
            geometry.placements.len()
        )));
    }
    Ok(Some(geometry))
}

/// Reads `metadata.pkl` (restricted pickle, built-in types only); `None` when it is a pickle of
/// something else (no `metadata` dict of items).
fn read_metadata(bytes: &[u8]) -> Result<Option<BTreeMap<String, ItemMeta>>, IndexError> {
    let value = pickle::parse(bytes).map_err(|e| bad(format!("not a readable pickle: {e}")))?;
    let json = json_of(&value);
    let Some(items) = json.get("metadata").and_then(Value::as_object) else {
        return Ok(None);
    };
    let mut out = BTreeMap::new();
    for (item, meta) in items {
        let mut m = ItemMeta::default();
        if let Some(layouts) = meta.get("rank_to_layout_info").and_then(Value::as_object) {
            for (rank, info) in layouts {
                let rank: u32 = rank
                    .parse()
                    .map_err(|_| bad(format!("{item}: rank `{rank}` is not a number")))?;
                if let Some(path) = info.get("file_path").and_then(Value::as_str) {
                    let format = info
                        .pointer("/serialization_format/type")
                        .and_then(Value::as_str)
                        .unwrap_or("TorchSerialization");
                    m.files.insert(rank, (path.to_owned(), format.to_owned()));
                }
            }
        }
        if let Some(paths) = meta
            .get("nested_path_to_metadata")
            .and_then(Value::as_object)
        {
            for (path, records) in paths {
                let key = path_key(path)?;
                if let Some(g) = records
                    .as_array()
                    .and_then(|r| r.first())
                    .map(|r| geometry(r, &key))
                    .transpose()?
                    .flatten()
                {
                    m.tensors.insert(key, g);
                }
            }
        }
        out.insert(item.clone(), m);
    }
    Ok(Some(out))
}

/// The mesh coordinate of `rank` (its position in the row-major `mesh_ranks`).
fn coordinate(g: &Geometry, rank: u32) -> Option<Vec<u64>> {
    let mut at = g.mesh_ranks.iter().position(|&r| r == u64::from(rank))? as u64;
    let mut coord = vec![0u64; g.mesh_shape.len()];
    for (c, &d) in coord.iter_mut().zip(&g.mesh_shape).rev() {
        if d == 0 {
            return None;
        }
        *c = at % d;
        at /= d;
    }
    Some(coord)
}

/// A safetensors item: each rank's file holds its local slices; placed by `meta`.
fn index_safetensors_item(
    source: &dyn Source,
    item: &str,
    files: &[(String, u32)],
    meta: &ItemMeta,
) -> Result<CheckpointIndex, IndexError> {
    let mut by_key: BTreeMap<String, IndexEntry> = BTreeMap::new();
    let mut infos = BTreeMap::new();
    for (file, rank) in files {
        let local = index_safetensors(source, std::slice::from_ref(file))?;
        for (name, mut info) in local.files {
            info.rank = Some(*rank);
            infos.insert(name, info);
        }
        for e in local.entries {
            let g = meta.tensors.get(&e.key).ok_or_else(|| IndexError::Inconsistent {
                file: file.clone(),
                what: format!(
                    "{}: not described in {METADATA_PKL} (item `{item}`): its global shape is unknown",
                    e.key
                ),
            })?;
            let coord = coordinate(g, *rank).ok_or_else(|| IndexError::Inconsistent {
                file: file.clone(),
                what: format!(
                    "{}: rank {rank} is not in the mesh {:?}",
                    e.key, g.mesh_ranks
                ),
            })?;
            let offsets = dtensor_offsets(&g.global_shape, &g.placements, &g.mesh_shape, &coord)
                .ok_or_else(|| IndexError::Unsupported {
                    key: e.key.clone(),
                    file: file.clone(),
                    what: format!(
                        "cannot place the local slice (placements {:?}, mesh {:?}, coordinate {coord:?})",
                        g.placements, g.mesh_shape
                    ),
                })?;
            let position = by_key.len() as u64;
            let entry = by_key.entry(e.key.clone()).or_insert_with(|| IndexEntry {
                position: Some(position),
                shape: Some(g.global_shape.clone()),
                chunks: Vec::new(),
                fsdp: Some(FsdpInfo::DTensor {
                    placements: g.placements.iter().map(ToString::to_string).collect(),
                    mesh_shape: Some(g.mesh_shape.clone()),
                }),
                ..e.clone()
            });
            if entry.dtype != e.dtype {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!("{}: dtype differs from another rank's slice", e.key),
                });
            }
            for mut c in e.chunks {
                let fits = c.sizes.len() == g.global_shape.len()
                    && c.sizes
                        .iter()
                        .zip(&offsets)
                        .zip(&g.global_shape)
                        .all(|((&s, &o), &d)| o.checked_add(s).is_some_and(|end| end <= d));
                if !fits {
                    return Err(IndexError::Inconsistent {
                        file: file.clone(),
                        what: format!(
                            "{}: local slice {:?} at {offsets:?} does not fit the global shape {:?}",
                            e.key, c.sizes, g.global_shape
                        ),
                    });
                }
                c.offsets = offsets.clone().into();
                c.rank = Some(*rank);
                entry.chunks.push(c);
            }
        }
    }
    Ok(CheckpointIndex {
        format: crate::index::Format::Safetensors,
        kind: CheckpointKind::Fsdp2,
        has_optimizer_state: false,
        entries: by_key.into_values().collect(),
        files: infos,
        dcp: None,
    })
}

/// The parameters of a flattened optimizer item (`param_groups.<fqn>.<key>`, else
/// `state.<fqn>.<name>`) in its stored order: the model's parameter order.
fn flattened_param_order(index: &CheckpointIndex) -> Vec<String> {
    let mut stored: Vec<&IndexEntry> = index.entries.iter().collect();
    stored.sort_by_key(|e| (e.position.is_none(), e.position));
    for group in ["param_groups.", "state."] {
        let mut seen = BTreeSet::new();
        let order: Vec<String> = stored
            .iter()
            .filter_map(|e| e.key.strip_prefix(group)?.rsplit_once('.'))
            .map(|(fqn, _)| fqn.to_owned())
            .filter(|fqn| seen.insert(fqn.clone()))
            .collect();
        if !order.is_empty() {
            return order;
        }
    }
    Vec::new()
}

/// Gives the entries of a safetensors item the positions of `order` (keys it lacks follow, by
/// name).
fn order_like(index: &mut CheckpointIndex, order: &[String]) {
    let at: BTreeMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), i))
        .collect();
    let mut ranked: Vec<(Option<usize>, String, usize)> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (at.get(e.key.as_str()).copied(), e.key.clone(), i))
        .collect();
    ranked.sort_by(|a, b| (a.0.is_none(), a.0, &a.1).cmp(&(b.0.is_none(), b.0, &b.1)));
    for (position, (_, _, i)) in ranked.into_iter().enumerate() {
        index.entries[i].position = Some(position as u64);
    }
}

/// Reads a torch_checkpointing folder through its `metadata.pkl` (see the module doc); `None`
/// when `metadata.pkl` is not torch_checkpointing's.
pub fn index_torch_checkpointing(
    source: &dyn Source,
) -> Result<Option<(CheckpointIndex, Vec<ReadSet>)>, IndexError> {
    let Some(meta) = read_metadata(&source.read_all(METADATA_PKL)?)? else {
        return Ok(None);
    };
    let names: BTreeSet<String> = source.names().into_iter().collect();
    let mut claimed: BTreeSet<String> = BTreeSet::new();
    let mut parts = Vec::new();
    let mut sets = Vec::new();
    // The parts stored as safetensors (key order not recorded).
    let mut unordered = Vec::new();
    for (item, m) in &meta {
        // Files: the layout info, else the default naming, for every rank that has either.
        let mut files: Vec<(String, u32, String)> = m
            .files
            .iter()
            .map(|(r, (f, fmt))| (f.clone(), *r, fmt.clone()))
            .collect();
        if files.is_empty() {
            let group = group_rank_files(
                &names
                    .iter()
                    .filter(|n| !n.contains('/') && is_torch_file(n))
                    .cloned()
                    .collect::<Vec<_>>(),
            )
            .into_iter()
            .find(|g| set_item(&g.pattern) == *item && g.pattern.starts_with(item.as_str()));
            if let Some(g) = group {
                files = g
                    .files
                    .iter()
                    .filter_map(|(f, r)| Some((f.clone(), (*r)?, "TorchSerialization".to_owned())))
                    .collect();
            }
        }
        if files.is_empty() {
            return Err(bad(format!(
                "item `{item}`: none of its files are in the folder"
            )));
        }
        for (f, _, _) in &files {
            if !names.contains(f) {
                return Err(bad(format!("item `{item}`: its file {f} is missing")));
            }
            claimed.insert(f.clone());
        }
        let ranked: Vec<(String, u32)> = files.iter().map(|(f, r, _)| (f.clone(), *r)).collect();
        let with_ranks: Vec<(String, Option<u32>)> =
            ranked.iter().map(|(f, r)| (f.clone(), Some(*r))).collect();
        let formats: BTreeSet<&str> = files.iter().map(|(_, _, f)| f.as_str()).collect();
        let index = match formats.iter().copied().collect::<Vec<_>>().as_slice() {
            ["SafetensorsSerialization"] => index_safetensors_item(source, item, &ranked, m)?,
            ["TorchSerialization"] => index_torch_files_ranked(source, &with_ranks)?,
            [format @ ("JsonSerialization" | "RawSerialization")] => {
                index_value_item(source, &with_ranks, *format == "JsonSerialization")?
            }
            other => {
                return Err(bad(format!(
                    "item `{item}`: serialization {other:?} is not read (torch.save, safetensors, JSON and raw items are, one serialization per item)"
                )));
            }
        };
        if formats.len() == 1 && formats.contains("SafetensorsSerialization") {
            unordered.push(parts.len());
        }
        let pattern = format!("{item}_{{R}}");
        let class = set_class(&index, &pattern);
        sets.push((
            RankGroup {
                pattern,
                files: with_ranks,
            },
            class,
        ));
        parts.push((class, item.clone(), index));
    }
    index_other_items(source, &names, &claimed, &mut parts, &mut sets)?;
    let order = parts
        .iter()
        .filter(|(class, _, _)| *class == "optim")
        .map(|(_, _, index)| flattened_param_order(index))
        .find(|o| !o.is_empty())
        .unwrap_or_default();
    if !order.is_empty() {
        for at in unordered {
            order_like(&mut parts[at].2, &order);
        }
    }
    Ok(Some((merge_sets(parts), sets)))
}

/// The items `metadata.pkl` does not describe: per-rank `torch.save` sets by the default naming
/// (or in a folder of their own), and the JSON and raw items; every file not `claimed`.
fn index_other_items(
    source: &dyn Source,
    names: &BTreeSet<String>,
    claimed: &BTreeSet<String>,
    parts: &mut Vec<(&'static str, String, CheckpointIndex)>,
    sets: &mut Vec<ReadSet>,
) -> Result<(), IndexError> {
    let hidden = |n: &str| n.split('/').any(|c| c.starts_with('.'));
    let rest: Vec<&String> = names
        .iter()
        .filter(|n| *n != METADATA_PKL && !claimed.contains(*n) && !hidden(n))
        .collect();
    // A safetensors item holds only each rank's local slices: without `metadata.pkl`'s geometry
    // they cannot be placed, and leaving them out would read the checkpoint in part, silently.
    let (safetensors, rest): (Vec<&String>, Vec<&String>) = rest
        .into_iter()
        .partition(|n| crate::index::names::file_ext(n) == "safetensors");
    if !safetensors.is_empty() {
        let listed: Vec<&str> = safetensors.iter().map(|n| n.as_str()).collect();
        return Err(bad(format!(
            "{} safetensors file(s) that metadata.pkl does not describe: {}; a torch_checkpointing safetensors item holds only each rank's local slices, placed by metadata.pkl's geometry, so these cannot be read (written by another save? move them out of the folder)",
            listed.len(),
            listed.join(", ")
        )));
    }
    let (torch, values): (Vec<String>, Vec<String>) = rest
        .into_iter()
        .cloned()
        .partition(|n| is_torch_item_file(source, n));
    for group in group_rank_files(&torch) {
        let index = index_torch_files_ranked(source, &group.files)?;
        let class = set_class(&index, &group.pattern);
        parts.push((class, item_name(&group), index));
        sets.push((group, class));
    }
    for group in group_rank_files(&values) {
        let json = group
            .files
            .iter()
            .all(|(f, _)| crate::index::names::file_ext(f) == "json");
        let index = index_value_item(source, &group.files, json)?;
        let class = set_class(&index, &group.pattern);
        parts.push((class, item_name(&group), index));
        sets.push((group, class));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_coordinates_are_row_major() {
        let g = Geometry {
            global_shape: vec![4],
            placements: vec![Placement::Replicate, Placement::Shard { dim: 0 }],
            mesh_shape: vec![2, 2],
            mesh_ranks: vec![0, 1, 2, 3],
        };
        assert_eq!(coordinate(&g, 2), Some(vec![1, 0]));
        assert_eq!(coordinate(&g, 3), Some(vec![1, 1]));
        assert_eq!(coordinate(&g, 4), None);
    }

    fn scalar(key: &str, position: u64) -> IndexEntry {
        let mut e = crate::index::read::items::value_entry(Value::Null, None);
        e.key = key.to_owned();
        e.position = Some(position);
        e
    }

    fn index_of(entries: Vec<IndexEntry>) -> CheckpointIndex {
        CheckpointIndex {
            format: crate::index::Format::TorchSave,
            kind: CheckpointKind::Plain,
            has_optimizer_state: false,
            entries,
            files: BTreeMap::new(),
            dcp: None,
        }
    }

    #[test]
    fn flattened_optimizer_gives_the_parameter_order() {
        // Stored order: by position, not by key.
        let optim = index_of(vec![
            scalar("state.b.w.exp_avg", 2),
            scalar("param_groups.b.w.lr", 4),
            scalar("state.a.exp_avg", 0),
            scalar("param_groups.a.lr", 3),
            scalar("param_groups.a.eps", 5),
        ]);
        // `param_groups` names every parameter (state only those that have some): it decides.
        assert_eq!(flattened_param_order(&optim), vec!["a", "b.w"]);
        let state_only = index_of(vec![scalar("state.z.step", 0), scalar("state.y.step", 1)]);
        assert_eq!(flattened_param_order(&state_only), vec!["z", "y"]);
        assert!(flattened_param_order(&index_of(vec![scalar("w", 0)])).is_empty());
        // Keys the order lacks follow, by name.
        let mut model = index_of(vec![
            scalar("a", 0),
            scalar("b.w", 1),
            scalar("buf2", 2),
            scalar("buf1", 3),
        ]);
        order_like(&mut model, &["b.w".to_owned(), "a".to_owned()]);
        let at: Vec<(&str, Option<u64>)> = model
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.position))
            .collect();
        assert_eq!(
            at,
            vec![
                ("a", Some(1)),
                ("b.w", Some(0)),
                ("buf2", Some(3)),
                ("buf1", Some(2))
            ]
        );
    }

    #[test]
    fn bytes_are_shown_with_a_digest_past_their_start() {
        use crate::index::read::torch::bytes_text;
        assert_eq!(bytes_text(b"\x00\xff"), "<2 bytes: 00ff>");
        let a = bytes_text(&[7u8; 40]);
        let mut other = [7u8; 40];
        other[39] = 8;
        assert!(a.starts_with("<40 bytes: 0707"), "{a}");
        assert_ne!(a, bytes_text(&other));
    }

    #[test]
    fn key_paths_join_with_dots() {
        assert_eq!(
            path_key(r#"["layers.0.w", "exp_avg"]"#).unwrap(),
            "layers.0.w.exp_avg"
        );
        assert!(path_key("not json").is_err());
    }
}
