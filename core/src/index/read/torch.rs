//! `torch.save` files (one or per-rank sets) into a [`CheckpointIndex`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use crate::formats::pickle::{Placement, PyValue, TensorRef};
use crate::formats::torch_zip;
use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, EntryKind, FileInfo, Format, FsdpInfo,
    IndexEntry, IndexError, PathSeg, Role, ShardPlacement, group_rank_files,
};
use crate::model::fqn::clean_tensor_name;
use crate::source::Source;

pub(crate) struct Leaf<'a> {
    pub(crate) path: Vec<PathSeg>,
    pub(crate) value: &'a PyValue,
}

fn path_seg_of_key(k: &PyValue) -> Option<PathSeg> {
    match k {
        PyValue::Str(s) => Some(PathSeg::Key(s.clone())),
        PyValue::Int(i) => Some(PathSeg::IntKey(*i)),
        PyValue::Bool(b) => Some(PathSeg::Key(if *b { "True" } else { "False" }.into())),
        _ => None,
    }
}

fn is_tensorish(v: &PyValue) -> bool {
    matches!(
        v,
        PyValue::Tensor(_) | PyValue::ShardedTensor(_) | PyValue::DTensor(_)
    )
}

/// DCP's traversal: mappings are descended (an empty one is a value); a list/tuple is descended when it holds a
/// tensor or a container; everything else is a leaf.
pub(crate) fn flatten<'a>(v: &'a PyValue, path: &mut Vec<PathSeg>, out: &mut Vec<Leaf<'a>>) {
    match v {
        // An empty mapping is a value of its own (Lightning's `loops.fit_loop.state_dict = {}`):
        // descending it would leave nothing, and outputs would lose the key.
        PyValue::Dict(items)
            if (!items.is_empty() || path.is_empty())
                && items.iter().all(|(k, _)| path_seg_of_key(k).is_some()) =>
        {
            for (k, val) in items {
                if let Some(seg) = path_seg_of_key(k) {
                    path.push(seg);
                    flatten(val, path, out);
                    path.pop();
                }
            }
        }
        PyValue::List(items) | PyValue::Tuple(items)
            if items.iter().any(|i| {
                is_tensorish(i)
                    || matches!(i, PyValue::Dict(_) | PyValue::List(_) | PyValue::Tuple(_))
            }) =>
        {
            for (i, val) in items.iter().enumerate() {
                path.push(PathSeg::Index(i as i64));
                flatten(val, path, out);
                path.pop();
            }
        }
        _ => out.push(Leaf {
            path: path.clone(),
            value: v,
        }),
    }
}

pub(crate) fn join_path(path: &[PathSeg]) -> String {
    path.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

pub(crate) fn clean_path(path: &[PathSeg]) -> Vec<PathSeg> {
    path.iter()
        .map(|s| match s {
            PathSeg::Key(k) => PathSeg::Key(
                clean_tensor_name(&format!("{k}."))
                    .trim_end_matches('.')
                    .to_owned(),
            ),
            PathSeg::Index(i) => PathSeg::Index(*i),
            PathSeg::IntKey(i) => PathSeg::IntKey(*i),
        })
        .collect()
}

/// The bytes a protocol-2 pickle spells `_codecs.encode(text, "latin1")` (how Python 3 pickles
/// `bytes` below protocol 3, and so how `torch.save` stores them); `None` for any other object.
pub fn latin1_bytes(o: &crate::formats::pickle::PyObject) -> Option<Vec<u8>> {
    let g = o.class()?;
    if g.module != "_codecs" || g.name != "encode" {
        return None;
    }
    let [PyValue::Str(text), PyValue::Str(codec)] = o.args.as_slice() else {
        return None;
    };
    if codec != "latin1" && codec != "latin-1" {
        return None;
    }
    text.chars()
        .map(|c| u8::try_from(u32::from(c)).ok())
        .collect()
}

/// How a `bytes` value is shown (and compared, by `diff`): its length, its first bytes in hex and,
/// beyond those, a 64-bit FNV-1a digest of all of them, so that two values of the same length
/// and start still differ when their bytes do.
pub fn bytes_text(b: &[u8]) -> String {
    const SHOWN: usize = 32;
    let hex = b.iter().take(SHOWN).fold(String::new(), |mut h, x| {
        let _ = write!(h, "{x:02x}");
        h
    });
    if b.len() <= SHOWN {
        return format!("<{} bytes: {hex}>", b.len());
    }
    let digest = b.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("<{} bytes: {hex}…, fnv1a64 {digest:016x}>", b.len())
}

/// A Python value as JSON (for scalars and decoded bytes items).
pub fn json_of(v: &PyValue) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        PyValue::None => J::Null,
        PyValue::Bool(b) => J::Bool(*b),
        PyValue::Int(i) => J::from(*i),
        PyValue::BigInt(b) => J::String(format!("<int of {} bytes>", b.len())),
        PyValue::Float(f) => {
            serde_json::Number::from_f64(*f).map_or_else(|| J::String(f.to_string()), J::Number)
        }
        PyValue::Str(s) => J::String(s.clone()),
        PyValue::Bytes(b) => J::String(bytes_text(b)),
        PyValue::Object(o) if latin1_bytes(o).is_some() => {
            J::String(latin1_bytes(o).map(|b| bytes_text(&b)).unwrap_or_default())
        }
        PyValue::Tuple(items) | PyValue::List(items) | PyValue::Set(items) => {
            J::Array(items.iter().map(json_of).collect())
        }
        PyValue::Dict(items) => {
            if items.iter().all(|(k, _)| path_seg_of_key(k).is_some()) {
                J::Object(
                    items
                        .iter()
                        .filter_map(|(k, v)| {
                            path_seg_of_key(k).map(|s| (s.to_string(), json_of(v)))
                        })
                        .collect(),
                )
            } else {
                J::Array(
                    items
                        .iter()
                        .map(|(k, v)| J::Array(vec![json_of(k), json_of(v)]))
                        .collect(),
                )
            }
        }
        PyValue::Global(g) => J::String(g.to_string()),
        PyValue::DType(d) => J::String(d.torch_name()),
        PyValue::Size(s) => J::Array(s.iter().map(|&d| J::from(d)).collect()),
        other => J::String(format!("<{}>", other.type_name())),
    }
}

fn raw_chunk(
    file: &str,
    rank: Option<u32>,
    archive: &torch_zip::TorchArchive,
    t: &TensorRef,
    offsets: Vec<u64>,
) -> Result<Chunk, IndexError> {
    let range = archive
        .storage_range(t)
        .map_err(|source| IndexError::TorchZip {
            file: file.to_owned(),
            source,
        })?;
    Ok(Chunk {
        offsets: offsets.into(),
        sizes: t.shape.clone().into(),
        file: file.to_owned().into(),
        byte_offset: range.offset,
        byte_length: range.len,
        rank,
        encoding: ChunkEncoding::Raw {
            storage_offset: t.storage_offset,
            strides: t.stride.clone(),
        },
    })
}

/// §4.4: the local shape and global offset of mesh coordinate `coord` under `placements`.
pub(crate) fn dtensor_offsets(
    global: &[u64],
    placements: &[Placement],
    mesh: &[u64],
    coord: &[u64],
) -> Option<Vec<u64>> {
    let mut local: Vec<u64> = global.to_vec();
    let mut offsets = vec![0u64; global.len()];
    for (i, p) in placements.iter().enumerate() {
        match p {
            Placement::Replicate | Placement::Partial { .. } => {}
            Placement::Shard { dim } => {
                let tensor_dim = usize::try_from(if *dim < 0 {
                    *dim + global.len() as i64
                } else {
                    *dim
                })
                .ok()?;
                let mesh_size = *mesh.get(i)?;
                let coordinate = *coord.get(i)?;
                let current = *local.get(tensor_dim)?;
                if mesh_size == 0 {
                    return None;
                }
                let (size, offset) = if current % mesh_size == 0 {
                    (current / mesh_size, coordinate * (current / mesh_size))
                } else {
                    let full_chunk = current.div_ceil(mesh_size);
                    let start = full_chunk * coordinate;
                    if start >= current {
                        (0, current)
                    } else {
                        (current.min(start + full_chunk) - start, start)
                    }
                };
                local[tensor_dim] = size;
                offsets[tensor_dim] += offset;
            }
            Placement::StridedShard { .. } | Placement::Other { .. } => return None,
        }
    }
    Some(offsets)
}

struct Partial {
    entry: IndexEntry,
    /// Per rank: the local shape of a plain tensor (to tell replicated from rank-local).
    plain_shapes: Vec<Vec<u64>>,
}

/// Indexes `torch.save` files as one checkpoint, their ranks read from their names
/// ([`group_rank_files`]).
pub fn index_torch_files(
    source: &dyn Source,
    files: &[String],
) -> Result<CheckpointIndex, IndexError> {
    let ranks: HashMap<String, Option<u32>> = group_rank_files(files)
        .into_iter()
        .flat_map(|g| g.files)
        .collect();
    let ranked: Vec<(String, Option<u32>)> = files
        .iter()
        .map(|f| (f.clone(), ranks.get(f).copied().flatten()))
        .collect();
    index_torch_files_ranked(source, &ranked)
}

/// Indexes `torch.save` files as one checkpoint, each with its rank.
#[allow(
    clippy::too_many_lines,
    reason = "indexes every torch.save entry kind (tensors, ShardedTensor, DTensor, rank-local pieces, values) from one pass"
)]
pub fn index_torch_files_ranked(
    source: &dyn Source,
    files: &[(String, Option<u32>)],
) -> Result<CheckpointIndex, IndexError> {
    let mut merged: BTreeMap<String, Partial> = BTreeMap::new();
    let mut file_infos = BTreeMap::new();
    let mut saw_sharded = false;
    let mut saw_dtensor = false;
    let mut saw_flat = false;
    let many = files.len() > 1;
    for (file, rank) in files {
        let rank = rank.or(if many { None } else { Some(0) });
        // By range: the zip directory, local headers and data.pkl, not the tensor bytes.
        let archive = torch_zip::read_archive_from(source, file).map_err(|e| match e {
            torch_zip::ArchiveFileError::Source(e) => IndexError::from(e),
            torch_zip::ArchiveFileError::Archive(source) => IndexError::TorchZip {
                file: file.clone(),
                source,
            },
        })?;
        let mut leaves = Vec::new();
        flatten(&archive.root, &mut Vec::new(), &mut leaves);
        for leaf in leaves {
            let raw_key = join_path(&leaf.path);
            let path = clean_path(&leaf.path);
            let key = join_path(&path);
            let flat_param = key.ends_with("_flat_param");
            let mut chunks = Vec::new();
            let mut plain_shape = None;
            let mut object = None;
            let (kind, dtype, shape, fsdp, value) = match leaf.value {
                PyValue::Tensor(t) => {
                    chunks.push(raw_chunk(file, rank, &archive, t, vec![0; t.shape.len()])?);
                    plain_shape = Some(t.shape.clone());
                    (
                        EntryKind::Tensor,
                        Some(t.storage.dtype),
                        Some(t.shape.clone()),
                        None,
                        None,
                    )
                }
                PyValue::ShardedTensor(s) => {
                    saw_sharded = true;
                    saw_flat |= flat_param;
                    for ls in &s.local_shards {
                        chunks.push(raw_chunk(
                            file,
                            rank,
                            &archive,
                            &ls.tensor,
                            ls.offsets.clone(),
                        )?);
                    }
                    let info = FsdpInfo::ShardedTensor {
                        shards: s
                            .shards
                            .iter()
                            .map(|m| ShardPlacement {
                                offsets: m.offsets.clone(),
                                sizes: m.sizes.clone(),
                                placement: m.placement.clone(),
                            })
                            .collect(),
                    };
                    (
                        EntryKind::Tensor,
                        Some(s.dtype),
                        Some(s.global_shape.clone()),
                        Some(info),
                        None,
                    )
                }
                PyValue::DTensor(d) => {
                    saw_dtensor = true;
                    // Without a readable mesh, a 1-D mesh over the given rank files.
                    let mesh = d
                        .mesh_shape
                        .clone()
                        .unwrap_or_else(|| vec![files.len() as u64; d.placements.len()]);
                    let coord = d
                        .mesh_coordinate
                        .clone()
                        .or_else(|| rank.map(|r| vec![u64::from(r)]))
                        .unwrap_or_default();
                    let offsets = dtensor_offsets(&d.global_shape, &d.placements, &mesh, &coord).ok_or_else(|| {
                        IndexError::Unsupported {
                            key: key.clone(),
                            file: file.clone(),
                            what: format!(
                                "cannot place the DTensor's local piece (placements {:?}, mesh {mesh:?}, coordinate {coord:?}): per-rank DTensor files are read for Shard(0) and Replicate placements (FSDP2, HSDP); tensor-parallel and _StridedShard placements are read from DCP checkpoints (dcp.save)",
                                d.placements
                            ),
                        }
                    })?;
                    chunks.push(raw_chunk(file, rank, &archive, &d.local, offsets)?);
                    let info = FsdpInfo::DTensor {
                        placements: d.placements.iter().map(ToString::to_string).collect(),
                        mesh_shape: d.mesh_shape.clone(),
                    };
                    (
                        EntryKind::Tensor,
                        Some(d.dtype),
                        Some(d.global_shape.clone()),
                        Some(info),
                        None,
                    )
                }
                other => {
                    object = Some(Box::new(other.clone()));
                    (EntryKind::Scalar, None, None, None, Some(json_of(other)))
                }
            };
            let position = merged.len() as u64;
            let p = merged.entry(key.clone()).or_insert_with(|| Partial {
                entry: IndexEntry {
                    position: Some(position),
                    key: key.clone(),
                    raw_key: (raw_key != key).then(|| raw_key.clone()),
                    path,
                    kind,
                    dtype,
                    shape: shape.clone(),
                    chunks: Vec::new(),
                    fsdp,
                    role: None,
                    flat_param,
                    value: value.clone(),
                    object,
                },
                plain_shapes: Vec::new(),
            });
            if p.entry.kind != kind || p.entry.dtype != dtype {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!(
                        "{key}: kind or dtype differs from the same key in another rank's file"
                    ),
                });
            }
            if kind == EntryKind::Scalar && p.entry.value != value {
                p.entry.value = Some(serde_json::Value::String("<differs across ranks>".into()));
            }
            if let Some(s) = plain_shape {
                p.plain_shapes.push(s);
            } else if p.entry.shape != shape {
                return Err(IndexError::Inconsistent {
                    file: file.clone(),
                    what: format!(
                        "{key}: global shape {shape:?} differs from another rank's {:?}",
                        p.entry.shape
                    ),
                });
            }
            p.entry.chunks.extend(chunks);
        }
        let unreferenced = unreferenced_bytes(&archive);
        file_infos.insert(
            file.clone(),
            FileInfo {
                size: source.size(file)?,
                rank,
                unreferenced_bytes: unreferenced,
            },
        );
    }
    let mut rank_local = false;
    let mut entries: Vec<IndexEntry> = merged
        .into_values()
        .map(|mut p| {
            if !p.plain_shapes.is_empty() && p.plain_shapes.iter().any(|s| *s != p.plain_shapes[0])
            {
                // Plain tensors whose shapes differ across ranks: rank-local pieces, no global shape.
                p.entry.shape = None;
                rank_local = true;
            }
            p.entry
        })
        .collect();
    let has_optimizer_state = assign_roles(&mut entries);
    // Raw `optim.state_dict()` files (state keyed by int ids) from several ranks of an FSDP job hold
    // each rank's own piece, even when the pieces happen to have equal shapes (padded flat shards).
    if many {
        for e in &mut entries {
            if e.kind == EntryKind::Tensor
                && e.fsdp.is_none()
                && matches!(
                    e.role,
                    Some(Role::OptimizerState {
                        param: PathSeg::Index(_),
                        ..
                    })
                )
            {
                e.shape = None;
                rank_local = true;
            }
        }
    }
    let all_plain_replicated = entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
        .all(|e| e.fsdp.is_none() && e.shape.is_some());
    let kind = if saw_flat {
        CheckpointKind::Fsdp1Local
    } else if saw_sharded {
        CheckpointKind::Fsdp1Sharded
    } else if saw_dtensor {
        CheckpointKind::Fsdp2
    } else if rank_local {
        CheckpointKind::RankLocal
    } else if many && all_plain_replicated {
        CheckpointKind::Fsdp1Full
    } else {
        CheckpointKind::Plain
    };
    Ok(CheckpointIndex {
        format: Format::TorchSave,
        kind,
        has_optimizer_state,
        entries,
        files: file_infos,
        dcp: None,
    })
}

/// Storage bytes that no tensor view of the archive reaches.
fn unreferenced_bytes(archive: &torch_zip::TorchArchive) -> u64 {
    let mut used: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for t in archive.tensors() {
        let Some(extent) = t.storage_extent() else {
            continue;
        };
        if extent > t.storage_offset {
            used.entry(t.storage.key.as_str())
                .or_default()
                .push((t.storage_offset, extent));
        }
    }
    let mut total = 0u64;
    let mut item_of: HashMap<&str, u64> = HashMap::new();
    for t in archive.tensors() {
        item_of.insert(t.storage.key.as_str(), t.storage.dtype.size_bytes() as u64);
    }
    for (key, range) in &archive.storages {
        let item = item_of.get(key.as_str()).copied().unwrap_or(1);
        let mut spans = used.remove(key.as_str()).unwrap_or_default();
        spans.sort_unstable();
        let mut covered = 0u64;
        let mut cur: Option<(u64, u64)> = None;
        for (a, b) in spans {
            match cur {
                Some((ca, cb)) if a <= cb => cur = Some((ca, cb.max(b))),
                Some((ca, cb)) => {
                    covered += cb - ca;
                    cur = Some((a, b));
                }
                None => cur = Some((a, b)),
            }
        }
        if let Some((ca, cb)) = cur {
            covered += cb - ca;
        }
        total += range.len.saturating_sub(covered.saturating_mul(item));
    }
    total
}

/// Marks optimizer entries: any path `P + ["state", param, name]` where some entry lies under
/// `P + ["param_groups"]`. Returns whether any was found.
pub(crate) fn assign_roles(entries: &mut [IndexEntry]) -> bool {
    let mut optim_prefixes: BTreeSet<Vec<PathSeg>> = BTreeSet::new();
    for e in entries.iter() {
        for (i, seg) in e.path.iter().enumerate() {
            if *seg == PathSeg::Key("param_groups".into()) {
                optim_prefixes.insert(e.path[..i].to_vec());
            }
        }
    }
    let mut found = false;
    for e in entries.iter_mut() {
        for prefix in &optim_prefixes {
            if !e.path.starts_with(prefix) {
                continue;
            }
            let rest = &e.path[prefix.len()..];
            match rest {
                [PathSeg::Key(s), param, PathSeg::Key(name)] if s == "state" => {
                    // A parameter id, whether the state is a dict keyed by it or a list.
                    let param = param.as_int().map_or_else(|| param.clone(), PathSeg::Index);
                    e.role = Some(Role::OptimizerState {
                        param,
                        state: name.clone(),
                    });
                    found = true;
                }
                [PathSeg::Key(s), PathSeg::Index(g), ..] if s == "param_groups" => {
                    e.role = Some(Role::ParamGroup { group: *g });
                    found = true;
                }
                _ => {}
            }
        }
    }
    found | assign_flat_roles(entries)
}

/// Roles in a flattened optimizer state dict (`flatten_optimizer_state_dict=True`, torchtitan's):
/// under one parent, keys `param_groups.<fqn>.<key>` name the parameters, and `state.<fqn>.<name>`
/// is optimizer state `name` of parameter `fqn` (its param segment is the FQN). The per-parameter
/// group keys have no group number: they keep no role.
fn assign_flat_roles(entries: &mut [IndexEntry]) -> bool {
    let split = |e: &IndexEntry| -> Option<(Vec<PathSeg>, String)> {
        let (PathSeg::Key(last), parent) = e.path.split_last()? else {
            return None;
        };
        Some((parent.to_vec(), last.clone()))
    };
    let mut params: BTreeMap<Vec<PathSeg>, BTreeSet<String>> = BTreeMap::new();
    for e in entries.iter() {
        if let Some((parent, last)) = split(e)
            && let Some((fqn, _)) = last
                .strip_prefix("param_groups.")
                .and_then(|r| r.rsplit_once('.'))
        {
            params.entry(parent).or_default().insert(fqn.to_owned());
        }
    }
    let mut found = false;
    for e in entries.iter_mut() {
        if e.role.is_some() {
            continue;
        }
        let Some((parent, last)) = split(e) else {
            continue;
        };
        let Some((fqn, name)) = last.strip_prefix("state.").and_then(|r| r.rsplit_once('.')) else {
            continue;
        };
        if params.get(&parent).is_some_and(|p| p.contains(fqn)) {
            e.role = Some(Role::OptimizerState {
                param: PathSeg::Key(fqn.to_owned()),
                state: name.to_owned(),
            });
            found = true;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtensor_offsets_follow_chunk_rules() {
        // `a` (5), ws=4: offsets 0, 2, 4, 5 (empty shard's offset is the dim size).
        let p = [Placement::Shard { dim: 0 }];
        let got: Vec<u64> = (0..4)
            .map(|k| dtensor_offsets(&[5], &p, &[4], &[k]).unwrap()[0])
            .collect();
        assert_eq!(got, vec![0, 2, 4, 5]);
        // HSDP (Replicate, Shard(0)) on a (2, 2) mesh.
        let p = [Placement::Replicate, Placement::Shard { dim: 0 }];
        assert_eq!(
            dtensor_offsets(&[5], &p, &[2, 2], &[1, 1]).unwrap(),
            vec![3]
        );
    }
}
