//! The one bridge between file formats and [`crate::model::tree`] values.
//!
//! - Reading: a `torch.save` archive (its bytes, or a member of a [`Source`]) → [`Node`], with every
//!   tensor materialised from its storage ([`node_from_torch_save`], [`node_from_source`]).
//!   `ShardedTensor`s and `DTensor`s become [`Node::Dist`]; anything that is not plain data
//!   (arbitrary objects, sets, globals, big integers) is an error naming its path.
//! - Writing: [`Node`] → the writer's [`PyValue`] plus a storage table, ready for
//!   [`TorchSaveWriter`] ([`to_torch_save`], [`plan_torch_save`]). One contiguous storage per
//!   tensor. A `ShardedTensor` is pickled exactly as torch 2.15 pickles it
//!   (`torch._tensor._rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, ..., state)`),
//!   so FSDP1 LOCAL state dicts load into `FSDP` with `LOCAL_STATE_DICT`; such archives need
//!   `torch.load(weights_only=False)` inside a process group of the recorded world size (torch's
//!   own `ShardedTensor.__setstate__` requires that). Archives without distributed tensors load
//!   with `weights_only=True`.

use crate::dtype::DType;
use crate::formats::pickle::{DTensorRecord, Placement, PyValue as ReadValue, ShardedTensorRecord};
use crate::formats::torch_zip::{self, TorchArchive, TorchZipError};
use crate::formats::write::pickle::{PyValue, StorageSpec, TensorPickle};
use crate::formats::write::torch_save::{TorchSaveError, TorchSaveWriter};
use crate::model::tree::{ChunkMeta, Dict, DistKind, DistTensor, Key, Node, Tensor};
use crate::source::{Source, SourceError};

/// Why a value cannot cross the bridge.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The file could not be read from its source.
    #[error("{file}: {source}")]
    Source {
        file: String,
        #[source]
        source: SourceError,
    },
    /// The torch archive is malformed.
    #[error("{file}: {source}")]
    Archive {
        file: String,
        #[source]
        source: TorchZipError,
    },
    /// A value has no state-dict meaning (an object, a set, a global, ...).
    #[error("{file}: {path}: unsupported value of type {found} in a state dict")]
    Unsupported {
        file: String,
        path: String,
        found: String,
    },
    /// A dictionary key is neither a `str` nor an `int`.
    #[error("{file}: {path}: unsupported dictionary key of type {found}")]
    BadKey {
        file: String,
        path: String,
        found: String,
    },
    /// A distributed tensor's record is not one this bridge understands.
    #[error("{file}: {path}: {reason}")]
    BadDist {
        file: String,
        path: String,
        reason: String,
    },
    /// A tensor's bytes disagree with its dtype and shape (or a local shard with its metadata).
    #[error("{path}: {reason}")]
    BadTensor { path: String, reason: String },
    /// The archive could not be written.
    #[error("writing torch.save archive: {0}")]
    Write(#[from] TorchSaveError),
}

/// Reads a whole `torch.save` archive held in `bytes` (`file` names it in errors).
pub fn node_from_torch_save(bytes: &[u8], file: &str) -> Result<Node, BridgeError> {
    let archive = torch_zip::read_archive(bytes).map_err(|source| BridgeError::Archive {
        file: file.to_owned(),
        source,
    })?;
    let reader = Reader {
        bytes: Bytes::Whole(bytes),
        archive: &archive,
        file,
    };
    reader.value(&archive.root, "")
}

/// How [`node_from_archive`] gets the bytes of one tensor: called with the tensor's view, the byte
/// range of its storage member (relative to the archive start, checked against the storage table)
/// and its path in the tree (`/state/3/exp_avg`). `Ok(Some(bytes))` gives the tensor's contiguous
/// little-endian bytes; `Ok(None)` leaves it unread: the node then holds a *skeleton* tensor (dtype
/// and shape, empty `data`) that only its metadata may be used of.
pub type FetchTensor<'f> = dyn Fn(
        &crate::formats::pickle::TensorRef,
        torch_zip::MemberRange,
        &str,
    ) -> Result<Option<Vec<u8>>, BridgeError>
    + 'f;

/// Converts an opened archive (see [`torch_zip::read_archive`]) to a [`Node`], reading tensor bytes
/// only through `fetch`, so a caller decides which tensors to read and how (e.g. positioned reads of
/// a file that is not held in memory).
pub fn node_from_archive(
    archive: &TorchArchive,
    file: &str,
    fetch: &FetchTensor<'_>,
) -> Result<Node, BridgeError> {
    let reader = Reader {
        bytes: Bytes::Fetch(fetch),
        archive,
        file,
    };
    reader.value(&archive.root, "")
}

enum Bytes<'a> {
    Whole(&'a [u8]),
    Fetch(&'a FetchTensor<'a>),
}

/// Reads member `name` of `source` as a `torch.save` archive.
pub fn node_from_source(source: &dyn Source, name: &str) -> Result<Node, BridgeError> {
    let bytes = source
        .read_all(name)
        .map_err(|source| BridgeError::Source {
            file: name.to_owned(),
            source,
        })?;
    node_from_torch_save(&bytes, name)
}

/// A value without tensors (as the index keeps the non-tensor entries of a `torch.save` file)
/// as a [`Node`]; `file` and `path` name it in errors.
pub fn node_from_value(v: &ReadValue, file: &str, path: &str) -> Result<Node, BridgeError> {
    convert_value(v, path, file, &|v, path| {
        Err(BridgeError::Unsupported {
            file: file.to_owned(),
            path: display_path(path),
            found: v.type_name(),
        })
    })
}

/// `v` as a [`Node`], containers and Python scalars here, anything else (tensors) by `leaf`.
fn convert_value(
    v: &ReadValue,
    path: &str,
    file: &str,
    leaf: &dyn Fn(&ReadValue, &str) -> Result<Node, BridgeError>,
) -> Result<Node, BridgeError> {
    let items = |items: &[ReadValue]| -> Result<Vec<Node>, BridgeError> {
        items
            .iter()
            .enumerate()
            .map(|(i, x)| convert_value(x, &format!("{path}/{i}"), file, leaf))
            .collect()
    };
    Ok(match v {
        ReadValue::None => Node::None,
        ReadValue::Bool(b) => Node::Bool(*b),
        ReadValue::Int(i) => Node::Int(*i),
        ReadValue::Float(f) => Node::Float(*f),
        ReadValue::Str(s) => Node::Str(s.clone()),
        ReadValue::Bytes(b) => Node::Bytes(b.clone()),
        ReadValue::Tuple(xs) => Node::Tuple(items(xs)?),
        ReadValue::List(xs) => Node::List(items(xs)?),
        ReadValue::Size(dims) => Node::Tuple(
            dims.iter()
                .map(|&d| i64::try_from(d).map(Node::Int))
                .collect::<Result<_, _>>()
                .map_err(|_| BridgeError::Unsupported {
                    file: file.to_owned(),
                    path: display_path(path),
                    found: v.type_name(),
                })?,
        ),
        ReadValue::Dict(entries) => {
            let mut d = Dict::new();
            for (k, val) in entries {
                let key = match k {
                    ReadValue::Str(s) => Key::Str(s.clone()),
                    ReadValue::Int(i) => Key::Int(*i),
                    other => {
                        return Err(BridgeError::BadKey {
                            file: file.to_owned(),
                            path: display_path(path),
                            found: other.type_name(),
                        });
                    }
                };
                let sub = format!("{path}/{key}");
                d.insert(key, convert_value(val, &sub, file, leaf)?);
            }
            Node::Dict(d)
        }
        other => leaf(other, path)?,
    })
}

struct Reader<'a> {
    bytes: Bytes<'a>,
    archive: &'a TorchArchive,
    file: &'a str,
}

impl Reader<'_> {
    fn unsupported(&self, path: &str, v: &ReadValue) -> BridgeError {
        BridgeError::Unsupported {
            file: self.file.to_owned(),
            path: display_path(path),
            found: v.type_name(),
        }
    }

    fn bad_dist(&self, path: &str, reason: impl Into<String>) -> BridgeError {
        BridgeError::BadDist {
            file: self.file.to_owned(),
            path: display_path(path),
            reason: reason.into(),
        }
    }

    fn tensor(
        &self,
        t: &crate::formats::pickle::TensorRef,
        path: &str,
    ) -> Result<Tensor, BridgeError> {
        let archive_err = |source| BridgeError::Archive {
            file: self.file.to_owned(),
            source,
        };
        let range = self.archive.storage_range(t).map_err(archive_err)?;
        let bytes = match &self.bytes {
            Bytes::Whole(b) => *b,
            Bytes::Fetch(fetch) => {
                return match fetch(t, range, path)? {
                    Some(data) => {
                        Tensor::new(t.storage.dtype, t.shape.clone(), data).map_err(|e| {
                            BridgeError::BadTensor {
                                path: format!("{}: {}", self.file, display_path(path)),
                                reason: e.to_string(),
                            }
                        })
                    }
                    None => Ok(Tensor {
                        dtype: t.storage.dtype,
                        shape: t.shape.clone(),
                        data: Vec::new(),
                    }),
                };
            }
        };
        // `storage_range` checked the member against the archive length.
        let start = usize::try_from(range.offset).unwrap_or(usize::MAX);
        let end = usize::try_from(range.offset.saturating_add(range.len)).unwrap_or(usize::MAX);
        let storage = bytes
            .get(start..end)
            .ok_or_else(|| BridgeError::BadTensor {
                path: format!("{}: {}", self.file, display_path(path)),
                reason: "storage outside the archive".to_owned(),
            })?;
        let data = torch_zip::gather_view(storage, t).map_err(archive_err)?;
        Tensor::new(t.storage.dtype, t.shape.clone(), data).map_err(|e| BridgeError::BadTensor {
            path: format!("{}: {}", self.file, display_path(path)),
            reason: e.to_string(),
        })
    }

    fn value(&self, v: &ReadValue, path: &str) -> Result<Node, BridgeError> {
        convert_value(v, path, self.file, &|v, path| match v {
            ReadValue::Tensor(t) => Ok(Node::Tensor(self.tensor(t, path)?)),
            ReadValue::ShardedTensor(st) => Ok(Node::Dist(self.sharded(st, path)?)),
            ReadValue::DTensor(dt) => Ok(Node::Dist(self.dtensor(dt, path)?)),
            other => Err(self.unsupported(path, other)),
        })
    }

    fn sharded(&self, st: &ShardedTensorRecord, path: &str) -> Result<DistTensor, BridgeError> {
        if st.local_shards.len() > 1 {
            return Err(self.bad_dist(
                path,
                format!(
                    "ShardedTensor has {} local shards on one rank; FSDP writes at most one",
                    st.local_shards.len()
                ),
            ));
        }
        let local = match st.local_shards.first() {
            Some(shard) => {
                let t = self.tensor(&shard.tensor, path)?;
                if t.shape != shard.sizes || t.dtype != st.dtype {
                    return Err(self.bad_dist(
                        path,
                        format!(
                            "local shard tensor ({}, {:?}) disagrees with its metadata ({}, {:?})",
                            t.dtype, t.shape, st.dtype, shard.sizes
                        ),
                    ));
                }
                Some((shard.offsets.clone(), t))
            }
            None => None,
        };
        Ok(DistTensor {
            kind: DistKind::ShardedTensor,
            dtype: st.dtype,
            global_shape: st.global_shape.clone(),
            local,
            chunks: st
                .shards
                .iter()
                .map(|m| ChunkMeta {
                    offsets: m.offsets.clone(),
                    sizes: m.sizes.clone(),
                    placement: m.placement.clone(),
                })
                .collect(),
        })
    }

    fn dtensor(&self, dt: &DTensorRecord, path: &str) -> Result<DistTensor, BridgeError> {
        let t = self.tensor(&dt.local, path)?;
        let dim0 = dt.global_shape.first().copied().unwrap_or(0);
        let mut offsets = vec![0u64; dt.global_shape.len()];
        // Shard(0) over at most one mesh dim, Replicate over the others: FSDP2 on a 1-D mesh,
        // HSDP `(Replicate, Shard(0))`, or plain replication.
        let shard_dims: Vec<usize> = dt
            .placements
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == Placement::Shard { dim: 0 })
            .map(|(i, _)| i)
            .collect();
        let supported = shard_dims.len() <= 1
            && dt
                .placements
                .iter()
                .all(|p| matches!(p, Placement::Replicate | Placement::Shard { dim: 0 }));
        if !supported {
            let names: Vec<String> = dt.placements.iter().map(ToString::to_string).collect();
            return Err(self.bad_dist(
                path,
                format!(
                    "DTensor placements [{}] are not supported (Shard(0) on at most one mesh dim, Replicate on the others)",
                    names.join(", ")
                ),
            ));
        }
        if let [dim] = shard_dims.as_slice() {
            let (Some(shape), Some(coord)) =
                (dt.mesh_shape.as_deref(), dt.mesh_coordinate.as_deref())
            else {
                return Err(self.bad_dist(
                    path,
                    "DTensor Shard(0) without a readable mesh shape and coordinate",
                ));
            };
            let (Some(&n), Some(&c)) = (shape.get(*dim), coord.get(*dim)) else {
                return Err(self.bad_dist(
                    path,
                    format!(
                        "DTensor mesh shape {shape:?} and coordinate {coord:?} do not cover its {} placements",
                        dt.placements.len()
                    ),
                ));
            };
            // torch.chunk: every chunk but the last has ceil(dim0 / n) rows.
            let chunk = dim0.div_ceil(n.max(1));
            if let Some(o) = offsets.first_mut() {
                *o = c.saturating_mul(chunk).min(dim0);
            }
        }
        Ok(DistTensor {
            kind: DistKind::DTensor,
            dtype: dt.dtype,
            global_shape: dt.global_shape.clone(),
            local: Some((offsets, t)),
            chunks: Vec::new(),
        })
    }
}

fn display_path(path: &str) -> String {
    if path.is_empty() {
        "<root>".to_owned()
    } else {
        path.to_owned()
    }
}

/// How [`plan_torch_save`] renders the root dictionary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootDict {
    /// A plain `dict` (`optim.state_dict()`, `FSDP.optim_state_dict`).
    Plain,
    /// A `collections.OrderedDict` (`nn.Module.state_dict()`).
    Ordered,
}

/// The device mesh of every `DTensor` of an FSDP2 per-rank file, as torch 2.15's
/// `init_device_mesh("cpu", shape, mesh_dim_names=names)` builds it on `rank`: a 1-D mesh of
/// the world (`Shard(0)`), or HSDP's `(replicas, shards)` (`(Replicate(), Shard(0))`). Its process
/// groups are named as that call names them in a fresh process group (1-D: the default group
/// `"0"`; 2-D: the replicate groups `"1"..="S"`, then the shard groups), which is what
/// `DeviceMesh.__setstate__` looks up when a file is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMeshSpec {
    shape: Vec<u64>,
    dim_names: Option<Vec<String>>,
    rank: u64,
    /// `_rank_map`: `arange(numel)` as int32, little-endian.
    rank_map: Vec<u8>,
}

impl DeviceMeshSpec {
    /// A 1-D (`[world]`) or 2-D (`[replicas, shards]`) mesh seen from global rank `rank`.
    pub fn new(
        shape: &[u64],
        dim_names: Option<Vec<String>>,
        rank: u64,
    ) -> Result<Self, BridgeError> {
        let bad = |reason: String| BridgeError::BadTensor {
            path: "<device mesh>".to_owned(),
            reason,
        };
        if shape.is_empty() || shape.len() > 2 || shape.contains(&0) {
            return Err(bad(format!(
                "a mesh of shape {shape:?}: only 1-D (FSDP2) and 2-D (HSDP) meshes of positive sizes are written"
            )));
        }
        let numel = crate::shape::numel(shape)
            .filter(|&n| i32::try_from(n).is_ok())
            .ok_or_else(|| bad(format!("a mesh of shape {shape:?} has too many ranks")))?;
        if rank >= numel {
            return Err(bad(format!(
                "rank {rank} is not in a mesh of {numel} ranks"
            )));
        }
        if let Some(names) = &dim_names
            && names.len() != shape.len()
        {
            return Err(bad(format!(
                "{} mesh dimension names for a {}-D mesh",
                names.len(),
                shape.len()
            )));
        }
        let rank_map = (0..numel as u32).flat_map(u32::to_le_bytes).collect();
        Ok(Self {
            shape: shape.to_vec(),
            dim_names,
            rank,
            rank_map,
        })
    }

    /// This rank's coordinate on the mesh (row-major).
    pub fn coordinate(&self) -> Vec<u64> {
        let mut rest = self.rank;
        let mut coord = vec![0; self.shape.len()];
        for (c, &d) in coord.iter_mut().zip(&self.shape).rev() {
            *c = rest % d;
            rest /= d;
        }
        coord
    }

    /// This rank's index along the sharded (last) mesh dimension, and that dimension's size.
    pub fn shard(&self) -> (u64, u64) {
        let coord = self.coordinate();
        let last = self.shape.len() - 1;
        (coord[last], self.shape[last])
    }

    /// The process-group name of each mesh dimension, as `init_device_mesh` names them on a CPU
    /// machine: a dimension spanning the world is the default group `"0"`; every other
    /// dimension makes one group per slice of the mesh (numbered on from 1 across dimensions, in
    /// row-major slice order), and this rank's is the one holding it.
    fn group_names(&self) -> Vec<String> {
        let world: u64 = self.shape.iter().product();
        let coord = self.coordinate();
        let mut next = 1u64;
        let mut names = Vec::with_capacity(self.shape.len());
        for (dim, &size) in self.shape.iter().enumerate() {
            if size == world {
                names.push("0".to_owned());
                continue;
            }
            // The slice holding this rank: its coordinates on the other dimensions, row-major.
            let mut slice = 0u64;
            for (d, (&n, &c)) in self.shape.iter().zip(&coord).enumerate() {
                if d != dim {
                    slice = slice * n + c;
                }
            }
            names.push((next + slice).to_string());
            next += world / size;
        }
        names
    }
}

/// A [`Node`] as the writer sees it: the object tree and the storages in table order.
#[derive(Debug)]
pub struct TorchSavePlan<'n> {
    pub root: PyValue,
    pub storages: Vec<(StorageSpec, &'n [u8])>,
    /// Per storage: true when it holds a tensor of the tree (in depth-first order), false when
    /// the writer made it (a `DeviceMesh`'s rank map; its bytes are in `storages`).
    pub from_tree: Vec<bool>,
    /// True when the tree holds objects `weights_only=True` refuses (ShardedTensors).
    pub needs_globals: bool,
}

/// Plans a `torch.save` of `node`. `world_size` is the process-group size recorded in every
/// `ShardedTensor` (the number of ranks of the checkpoint) and `rank` this file's rank.
pub fn plan_torch_save(
    node: &Node,
    root_dict: RootDict,
    rank: u64,
    world_size: u64,
) -> Result<TorchSavePlan<'_>, BridgeError> {
    plan_torch_save_in_group(node, root_dict, (rank, world_size), (rank, world_size))
}

/// As [`plan_torch_save`] for a file written by a rank whose ShardedTensors live in a sub-group
/// (HYBRID_SHARD: the shard group): `group` is `(rank in the group, group size)`, recorded as the
/// local rank and world size and used for the local shard's placement; `global` is
/// `(global rank, world size)`.
pub fn plan_torch_save_in_group(
    node: &Node,
    root_dict: RootDict,
    group: (u64, u64),
    global: (u64, u64),
) -> Result<TorchSavePlan<'_>, BridgeError> {
    plan(node, root_dict, group, global, None)
}

/// As [`plan_torch_save`] for an FSDP2 per-rank file: every [`DistKind::DTensor`] of `node` is
/// written as torch 2.15 pickles a `DTensor` on `mesh` (its local piece is the node's local
/// tensor); such archives load with `torch.load(weights_only=True)` once
/// `torch.distributed.tensor` is imported.
pub fn plan_torch_save_on_mesh<'n>(
    node: &'n Node,
    root_dict: RootDict,
    mesh: &'n DeviceMeshSpec,
) -> Result<TorchSavePlan<'n>, BridgeError> {
    let n = mesh.rank_map.len() as u64 / 4;
    plan(node, root_dict, (mesh.rank, n), (mesh.rank, n), Some(mesh))
}

fn plan<'n>(
    node: &'n Node,
    root_dict: RootDict,
    group: (u64, u64),
    global: (u64, u64),
    mesh: Option<&'n DeviceMeshSpec>,
) -> Result<TorchSavePlan<'n>, BridgeError> {
    let mut w = Writer {
        storages: Vec::new(),
        from_tree: Vec::new(),
        needs_globals: false,
        rank: group.0,
        world_size: group.1,
        global_rank: global.0,
        global_world_size: global.1,
        mesh,
        rank_map: None,
    };
    let root = match (node, root_dict) {
        (Node::Dict(d), RootDict::Ordered) => PyValue::OrderedDict(w.entries(d, "")?),
        _ => w.value(node, "")?,
    };
    Ok(TorchSavePlan {
        root,
        storages: w.storages,
        from_tree: w.from_tree,
        needs_globals: w.needs_globals,
    })
}

/// `torch.save(node)` into a vector (archive folder `archive`, as torch uses for buffers).
pub fn to_torch_save(
    node: &Node,
    root_dict: RootDict,
    rank: u64,
    world_size: u64,
) -> Result<Vec<u8>, BridgeError> {
    let plan = plan_torch_save(node, root_dict, rank, world_size)?;
    let specs = plan.storages.iter().map(|(s, _)| *s).collect();
    let mut writer = TorchSaveWriter::with_globals(
        Vec::new(),
        "archive",
        &plan.root,
        specs,
        plan.needs_globals,
    )?;
    for (_, data) in &plan.storages {
        writer.write_storage(data)?;
    }
    Ok(writer.finish()?)
}

struct Writer<'n> {
    storages: Vec<(StorageSpec, &'n [u8])>,
    from_tree: Vec<bool>,
    needs_globals: bool,
    mesh: Option<&'n DeviceMeshSpec>,
    /// The storage of the mesh's `_rank_map`, once written (torch shares one per mesh).
    rank_map: Option<usize>,
    rank: u64,
    world_size: u64,
    global_rank: u64,
    global_world_size: u64,
}

fn int(v: u64) -> PyValue {
    PyValue::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

fn int_list(values: &[u64]) -> PyValue {
    PyValue::List(values.iter().map(|&v| int(v)).collect())
}

fn dtype_global(dtype: DType) -> PyValue {
    PyValue::global("torch", dtype.to_string())
}

fn cpu_device() -> PyValue {
    PyValue::call("torch", "device", vec![PyValue::str("cpu")])
}

/// `torch.distributed.remote_device._remote_device` for `rank:<r>/cpu`.
fn remote_device(rank: u64) -> PyValue {
    PyValue::object(
        "torch.distributed.remote_device",
        "_remote_device",
        vec![
            ("_worker_name", PyValue::None),
            ("_rank", int(rank)),
            ("_device", cpu_device()),
        ],
    )
}

fn placement_rank(placement: Option<&str>, fallback: u64) -> u64 {
    // `rank:3/cpu`
    placement
        .and_then(|p| p.strip_prefix("rank:"))
        .and_then(|p| p.split('/').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or(fallback)
}

/// `ShardMetadata` is a slotted dataclass: `BUILD` gets `(None, {slots})`.
fn shard_metadata(offsets: &[u64], sizes: &[u64], rank: u64) -> PyValue {
    PyValue::Object {
        class: Box::new(PyValue::global(
            "torch.distributed._shard.metadata",
            "ShardMetadata",
        )),
        state: Box::new(PyValue::Tuple(vec![
            PyValue::None,
            PyValue::Dict(vec![
                (PyValue::str("shard_offsets"), int_list(offsets)),
                (PyValue::str("shard_sizes"), int_list(sizes)),
                (PyValue::str("placement"), remote_device(rank)),
            ]),
        ])),
    }
}

impl<'n> Writer<'n> {
    fn tensor(&mut self, t: &'n Tensor) -> PyValue {
        let index = self.storages.len();
        self.storages.push((
            StorageSpec {
                dtype: t.dtype,
                numel: t.numel(),
            },
            &t.data,
        ));
        self.from_tree.push(true);
        PyValue::Tensor(TensorPickle::contiguous(index, t.dtype, &t.shape))
    }

    fn entries(&mut self, d: &'n Dict, path: &str) -> Result<Vec<(PyValue, PyValue)>, BridgeError> {
        d.iter()
            .map(|(k, v)| {
                let key = match k {
                    Key::Int(i) => PyValue::Int(*i),
                    Key::Str(s) => PyValue::str(s.clone()),
                };
                Ok((key, self.value(v, &format!("{path}/{k}"))?))
            })
            .collect()
    }

    fn value(&mut self, node: &'n Node, path: &str) -> Result<PyValue, BridgeError> {
        Ok(match node {
            Node::None => PyValue::None,
            Node::Bool(b) => PyValue::Bool(*b),
            Node::Int(i) => PyValue::Int(*i),
            Node::Float(f) => PyValue::Float(*f),
            Node::Str(s) => PyValue::str(s.clone()),
            Node::Bytes(_) => {
                return Err(BridgeError::Unsupported {
                    file: "<output>".to_owned(),
                    path: display_path(path),
                    found: "bytes".to_owned(),
                });
            }
            Node::Tensor(t) => self.tensor(t),
            Node::List(items) => PyValue::List(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| self.value(x, &format!("{path}/{i}")))
                    .collect::<Result<_, _>>()?,
            ),
            Node::Tuple(items) => PyValue::Tuple(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| self.value(x, &format!("{path}/{i}")))
                    .collect::<Result<_, _>>()?,
            ),
            Node::Dict(d) => PyValue::Dict(self.entries(d, path)?),
            Node::Dist(dist) => match dist.kind {
                DistKind::ShardedTensor => self.sharded_tensor(dist, path)?,
                DistKind::DTensor => match self.mesh {
                    Some(mesh) => self.dtensor(dist, mesh, path)?,
                    None => {
                        return Err(BridgeError::Unsupported {
                            file: "<output>".to_owned(),
                            path: display_path(path),
                            found: "DTensor (a DTensor is written only with its device mesh)"
                                .to_owned(),
                        });
                    }
                },
            },
        })
    }

    /// The pickle torch 2.15 writes for a `DTensor` on `mesh`: `Shard(0)` on the last mesh
    /// dimension, `Replicate()` on the others.
    #[allow(
        clippy::too_many_lines,
        reason = "pickles a DTensor with its spec, mesh and placements exactly as torch lays them out"
    )]
    fn dtensor(
        &mut self,
        d: &'n DistTensor,
        mesh: &'n DeviceMeshSpec,
        path: &str,
    ) -> Result<PyValue, BridgeError> {
        const SPEC: &str = "torch.distributed.tensor._dtensor_spec";
        const PLACEMENT: &str = "torch.distributed.tensor.placement_types";
        let Some((_, local)) = &d.local else {
            return Err(BridgeError::BadTensor {
                path: display_path(path),
                reason: "a DTensor without its local tensor".to_owned(),
            });
        };
        if local.dtype != d.dtype
            || local.shape.len() != d.global_shape.len()
            || local.shape.is_empty()
            || local.shape[1..] != d.global_shape[1..]
            || local.shape[0] > d.global_shape[0]
        {
            return Err(BridgeError::BadTensor {
                path: display_path(path),
                reason: format!(
                    "local tensor {} {:?} is not a dim-0 shard of the DTensor's {} {:?}",
                    local.dtype, local.shape, d.dtype, d.global_shape
                ),
            });
        }
        self.needs_globals = true;
        let local_tensor = self.tensor(local);
        let rank_map = if let Some(index) = self.rank_map {
            index
        } else {
            let index = self.storages.len();
            self.storages.push((
                StorageSpec {
                    dtype: DType::Int32,
                    numel: mesh.rank_map.len() as u64 / 4,
                },
                &mesh.rank_map,
            ));
            self.from_tree.push(false);
            self.rank_map = Some(index);
            index
        };
        let dims = mesh.shape.len();
        // A size-1 axis coalesces to the 0-dimensional layout `((), ())`.
        let flat = |shape: u64, stride: u64| {
            let (shape, stride): (&[u64], &[u64]) = if shape == 1 {
                (&[], &[])
            } else {
                (&[shape], &[stride])
            };
            PyValue::object(
                "torch.distributed._mesh_layout",
                "_FlatLayout",
                vec![
                    ("shape", PyValue::int_tuple(shape)),
                    ("stride", PyValue::int_tuple(stride)),
                ],
            )
        };
        let strides = crate::shape::contiguous_strides(&mesh.shape);
        let layout = PyValue::object(
            "torch.distributed._mesh_layout",
            "_MeshLayout",
            vec![(
                "axes",
                PyValue::Tuple(
                    mesh.shape
                        .iter()
                        .zip(&strides)
                        .map(|(&n, &s)| flat(n, s))
                        .collect(),
                ),
            )],
        );
        let numel = mesh.rank_map.len() as u64 / 4;
        let all_ranks: Vec<u64> = (0..numel).collect();
        let device_mesh = PyValue::object(
            "torch.distributed.device_mesh",
            "DeviceMesh",
            vec![
                ("_device_type", PyValue::str("cpu")),
                ("_layout", layout),
                (
                    "_rank_map",
                    PyValue::Tensor(TensorPickle::contiguous(rank_map, DType::Int32, &[numel])),
                ),
                (
                    "_mesh_dim_names",
                    match &mesh.dim_names {
                        Some(names) => {
                            PyValue::Tuple(names.iter().map(|n| PyValue::str(n.clone())).collect())
                        }
                        None => PyValue::None,
                    },
                ),
                ("_root_mesh", PyValue::None),
                ("_preserve_rank_order", PyValue::Bool(false)),
                ("_flatten_rank_map", PyValue::int_tuple(&all_ranks)),
                ("_thread_id", PyValue::None),
                ("_flatten_mapping", PyValue::Dict(Vec::new())),
                (
                    "_dim_group_names",
                    PyValue::List(mesh.group_names().into_iter().map(PyValue::str).collect()),
                ),
                ("_rank", int(mesh.rank)),
                ("_coordinate_on_dim", PyValue::int_tuple(&mesh.coordinate())),
                ("_hash", PyValue::None),
            ],
        );
        let placements = (0..dims)
            .map(|i| {
                if i + 1 == dims {
                    PyValue::object(PLACEMENT, "Shard", vec![("dim", PyValue::Int(0))])
                } else {
                    PyValue::object(PLACEMENT, "Replicate", Vec::new())
                }
            })
            .collect();
        let global_strides = crate::shape::contiguous_strides(&d.global_shape);
        let size = PyValue::call("torch", "Size", vec![PyValue::int_tuple(&d.global_shape)]);
        let tensor_meta = PyValue::call(
            SPEC,
            "TensorMeta",
            vec![
                size,
                PyValue::int_tuple(&global_strides),
                dtype_global(d.dtype),
            ],
        );
        let shard_order = PyValue::Tuple(vec![PyValue::call(
            SPEC,
            "ShardOrderEntry",
            vec![PyValue::Int(0), PyValue::int_tuple(&[dims as u64 - 1])],
        )]);
        let spec = PyValue::object(
            SPEC,
            "DTensorSpec",
            vec![
                ("mesh", device_mesh),
                ("placements", PyValue::Tuple(placements)),
                ("tensor_meta", tensor_meta),
                ("shard_order", shard_order),
                ("use_strided_shard_as_shard_order", PyValue::Bool(false)),
                ("_hash", PyValue::None),
            ],
        );
        Ok(wrapper_subclass(
            PyValue::global("torch.distributed.tensor", "DTensor"),
            d,
            PyValue::Dict(vec![
                (PyValue::str("_local_tensor"), local_tensor),
                (PyValue::str("_spec"), spec),
            ]),
        ))
    }

    /// The pickle torch 2.15 writes for an FSDP1 `ShardedTensor` on this rank.
    #[allow(
        clippy::too_many_lines,
        reason = "pickles a ShardedTensor with its metadata and shards exactly as torch lays them out"
    )]
    fn sharded_tensor(&mut self, d: &'n DistTensor, path: &str) -> Result<PyValue, BridgeError> {
        const ST: &str = "torch.distributed._shard.sharded_tensor.api";
        const META: &str = "torch.distributed._shard.sharded_tensor.metadata";
        self.needs_globals = true;
        let class = PyValue::global(ST, "ShardedTensor");
        let mut local_shards = Vec::new();
        if let Some((offsets, t)) = &d.local {
            if t.dtype != d.dtype || t.shape.len() != d.global_shape.len() {
                return Err(BridgeError::BadTensor {
                    path: display_path(path),
                    reason: "local shard disagrees with the ShardedTensor's dtype or rank"
                        .to_owned(),
                });
            }
            let tensor = self.tensor(t);
            local_shards.push(PyValue::Object {
                class: Box::new(PyValue::global(
                    "torch.distributed._shard.sharded_tensor.shard",
                    "Shard",
                )),
                state: Box::new(PyValue::Tuple(vec![
                    PyValue::None,
                    PyValue::Dict(vec![
                        (PyValue::str("tensor"), tensor),
                        (
                            PyValue::str("metadata"),
                            shard_metadata(offsets, &t.shape, self.rank),
                        ),
                    ]),
                ])),
            });
        }
        let shards_metadata: Vec<PyValue> = d
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                shard_metadata(
                    &c.offsets,
                    &c.sizes,
                    placement_rank(c.placement.as_deref(), i as u64),
                )
            })
            .collect();
        let placements: Vec<PyValue> = d
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| remote_device(placement_rank(c.placement.as_deref(), i as u64)))
            .collect();
        let size = PyValue::call("torch", "Size", vec![PyValue::int_tuple(&d.global_shape)]);
        let properties = PyValue::Object {
            class: Box::new(PyValue::global(META, "TensorProperties")),
            state: Box::new(PyValue::Tuple(vec![
                dtype_global(d.dtype),
                PyValue::call(
                    "torch.serialization",
                    "_get_layout",
                    vec![PyValue::str("torch.strided")],
                ),
                PyValue::Bool(false),
                PyValue::call(META, "MEM_FORMAT_ENCODING", vec![PyValue::Int(0)]),
                PyValue::Bool(false),
            ])),
        };
        let metadata = PyValue::object(
            META,
            "ShardedTensorMetadata",
            vec![
                ("shards_metadata", PyValue::List(shards_metadata)),
                ("size", size),
                ("tensor_properties", properties),
            ],
        );
        let pg_state = PyValue::Object {
            class: Box::new(PyValue::call(
                "__builtin__",
                "getattr",
                vec![class.clone(), PyValue::str("ProcessGroupState")],
            )),
            state: Box::new(PyValue::Dict(vec![
                (PyValue::str("local_rank"), int(self.rank)),
                (PyValue::str("global_rank"), int(self.global_rank)),
                (PyValue::str("local_world_size"), int(self.world_size)),
                (
                    PyValue::str("global_world_size"),
                    int(self.global_world_size),
                ),
            ])),
        };
        let spec = PyValue::object(
            "torch.distributed._shard.sharding_spec.chunk_sharding_spec",
            "ChunkShardingSpec",
            vec![
                ("dim", PyValue::Int(0)),
                ("placements", PyValue::List(placements)),
            ],
        );
        let state = PyValue::Tuple(vec![
            PyValue::List(local_shards),
            metadata,
            pg_state,
            spec,
            PyValue::Bool(false),
        ]);
        Ok(wrapper_subclass(class, d, state))
    }
}

/// How torch pickles a tensor subclass built by `_rebuild_wrapper_subclass` (a `ShardedTensor`,
/// a `DTensor`): the wrapper's global dtype, shape and contiguous strides on the CPU, and the
/// subclass's `state`.
fn wrapper_subclass(class: PyValue, d: &DistTensor, state: PyValue) -> PyValue {
    let strides = crate::shape::contiguous_strides(&d.global_shape);
    let args = PyValue::Tuple(vec![
        class.clone(),
        dtype_global(d.dtype),
        PyValue::int_tuple(&d.global_shape),
        PyValue::int_tuple(&strides),
        PyValue::Int(0),
        PyValue::call(
            "torch.serialization",
            "_get_layout",
            vec![PyValue::str("torch.strided")],
        ),
        cpu_device(),
        PyValue::Bool(false),
    ]);
    PyValue::call(
        "torch._tensor",
        "_rebuild_from_type_v2",
        vec![
            PyValue::global("torch._utils", "_rebuild_wrapper_subclass"),
            class,
            args,
            state,
        ],
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn mesh_coordinates_and_group_names_follow_init_device_mesh() {
        // torch 2.15, init_device_mesh("cpu", (2, 2)) on 4 gloo ranks
        // (tests/fixtures/fsdp2_hsdp/ws4_2x2/rank{r}_model.pt): `_dim_group_names` per rank.
        let torch = [["1", "3"], ["2", "3"], ["1", "4"], ["2", "4"]];
        for (rank, names) in torch.iter().enumerate() {
            let mesh = DeviceMeshSpec::new(&[2, 2], None, rank as u64).unwrap();
            assert_eq!(mesh.group_names(), names.to_vec(), "rank {rank}");
            assert_eq!(mesh.coordinate(), [rank as u64 / 2, rank as u64 % 2]);
        }
        // A 1-D mesh of the world is the default group.
        let mesh = DeviceMeshSpec::new(&[3], None, 2).unwrap();
        assert_eq!(mesh.group_names(), ["0"]);
        assert_eq!(mesh.shard(), (2, 3));
        // (3, 1): the replicate dimension spans the world; the shard groups are singletons.
        let mesh = DeviceMeshSpec::new(&[3, 1], None, 2).unwrap();
        assert_eq!(mesh.group_names(), ["0", "3"]);
        assert_eq!(mesh.shard(), (0, 1));
        for bad in [&[][..], &[0], &[2, 0], &[2, 2, 2]] {
            assert!(DeviceMeshSpec::new(bad, None, 0).is_err(), "{bad:?}");
        }
        assert!(DeviceMeshSpec::new(&[2, 2], None, 4).is_err());
        assert!(DeviceMeshSpec::new(&[2, 2], Some(vec!["dp".into()]), 0).is_err());
    }

    #[test]
    fn dtensors_written_on_a_mesh_read_back_as_the_same_shards() {
        let mut tree = Dict::new();
        for rank in 0..3u64 {
            let mesh = DeviceMeshSpec::new(&[3], Some(vec!["dp".into()]), rank).unwrap();
            // A (5, 2) tensor over 3 ranks: rows 0..2, 2..4, 4..5.
            let (start, rows) = [(0, 2), (2, 2), (4, 1)][rank as usize];
            let data: Vec<u8> = (0..rows * 2)
                .flat_map(|i| ((start * 2 + i) as f32).to_le_bytes())
                .collect();
            let local = Tensor::new(DType::Float32, vec![rows, 2], data).unwrap();
            tree.insert(
                Key::str("w"),
                Node::Dist(DistTensor {
                    kind: DistKind::DTensor,
                    dtype: DType::Float32,
                    global_shape: vec![5, 2],
                    local: Some((vec![start, 0], local)),
                    chunks: Vec::new(),
                }),
            );
            tree.insert(
                Key::str("buf"),
                Node::Tensor(
                    Tensor::new(DType::Int64, vec![1], 7i64.to_le_bytes().to_vec()).unwrap(),
                ),
            );
            let node = Node::Dict(tree.clone());
            let plan = plan_torch_save_on_mesh(&node, RootDict::Ordered, &mesh).unwrap();
            // The local shard, the mesh's rank map (made by the writer), the buffer.
            assert_eq!(plan.from_tree, [true, false, true]);
            let specs = plan.storages.iter().map(|(s, _)| *s).collect();
            let mut w =
                TorchSaveWriter::with_globals(Vec::new(), "archive", &plan.root, specs, true)
                    .unwrap();
            for (_, data) in &plan.storages {
                w.write_storage(data).unwrap();
            }
            let bytes = w.finish().unwrap();
            let back = node_from_torch_save(&bytes, "rank").unwrap();
            assert_eq!(back, node, "rank {rank}");
        }
    }
}
