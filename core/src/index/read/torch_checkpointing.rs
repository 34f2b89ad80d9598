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

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::formats::pickle::{self, Placement};
use crate::index::read::safetensors::index_safetensors;
use crate::index::read::sets::{merge_sets, set_class, set_item};
use crate::index::read::torch::{dtensor_offsets, index_torch_files_ranked, json_of};
use crate::index::{
    CheckpointIndex, CheckpointKind, EntryKind, FsdpInfo, IndexEntry, IndexError, PathSeg,
    RankGroup, ReadSet, group_rank_files, is_torch_file,
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

/// A JSON item: one file's value, shown as values.
pub(crate) fn index_json_item(
    source: &dyn Source,
    file: &str,
) -> Result<CheckpointIndex, IndexError> {
    let bytes = source.read_all(file)?;
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
    out.push(IndexEntry {
        position: Some(out.len() as u64),
        key,
        raw_key: None,
        path: path.clone(),
        kind: EntryKind::Scalar,
        dtype: None,
        shape: None,
        chunks: Vec::new(),
        fsdp: None,
        role: None,
        flat_param: false,
        value: Some(v.clone()),
        object: None,
    });
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
        let formats: BTreeSet<&str> = files.iter().map(|(_, _, f)| f.as_str()).collect();
        let index = match formats.into_iter().collect::<Vec<_>>().as_slice() {
            ["SafetensorsSerialization"] => index_safetensors_item(source, item, &ranked, m)?,
            ["TorchSerialization"] => index_torch_files_ranked(
                source,
                &ranked
                    .iter()
                    .map(|(f, r)| (f.clone(), Some(*r)))
                    .collect::<Vec<_>>(),
            )?,
            ["JsonSerialization"] => index_json_item(source, &ranked[0].0)?,
            other => {
                return Err(bad(format!(
                    "item `{item}`: serialization {other:?} is not read (torch.save, safetensors and JSON items are)"
                )));
            }
        };
        let pattern = format!("{item}_{{R}}");
        let class = set_class(&index, &pattern);
        sets.push((
            RankGroup {
                pattern,
                files: ranked.iter().map(|(f, r)| (f.clone(), Some(*r))).collect(),
            },
            class,
        ));
        parts.push((class, item.clone(), index));
    }
    // Items without metadata: per-rank torch.save sets by the default naming.
    let rest: Vec<String> = names
        .iter()
        .filter(|n| !n.contains('/') && is_torch_file(n) && !claimed.contains(*n))
        .cloned()
        .collect();
    for group in group_rank_files(&rest) {
        let index = index_torch_files_ranked(source, &group.files)?;
        let class = set_class(&index, &group.pattern);
        parts.push((class, set_item(&group.pattern), index));
        sets.push((group, class));
    }
    Ok(Some((merge_sets(parts), sets)))
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

    #[test]
    fn key_paths_join_with_dots() {
        assert_eq!(
            path_key(r#"["layers.0.w", "exp_avg"]"#).unwrap(),
            "layers.0.w.exp_avg"
        );
        assert!(path_key("not json").is_err());
    }
}
