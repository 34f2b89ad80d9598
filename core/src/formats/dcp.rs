//! `torch.distributed.checkpoint` directories: the `.metadata` pickle and the items of the
//! `__{rank}_{k}.distcp` files (each a standalone `torch.save` archive, or, in the SAFETENSORS
//! serialization, one safetensors blob per file).

use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::formats::pickle::{self, PickleError, PyObject, PyValue, dict_get};

/// What went wrong while reading DCP metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DcpError {
    /// `.metadata` is not a readable pickle.
    #[error(".metadata: {source}")]
    Pickle {
        #[source]
        source: PickleError,
    },
    /// The pickle is not a `Metadata` object or a field has the wrong shape.
    #[error(".metadata: {what}")]
    Malformed { what: String },
}

fn malformed(what: impl Into<String>) -> DcpError {
    DcpError::Malformed { what: what.into() }
}

/// One step of a `planner_data` path: a dict key or a list index.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum PlannerStep {
    Key(String),
    Index(i64),
}

/// One saved chunk of a tensor (`ChunkStorageMetadata`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// `state_dict_metadata[key]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemMeta {
    /// `TensorStorageMetadata`.
    Tensor {
        dtype: DType,
        size: Vec<u64>,
        chunks: Vec<ChunkMeta>,
    },
    /// `BytesStorageMetadata`: a non-tensor value saved with `torch.save`.
    Bytes,
}

/// A key of `storage_data` (`MetadataIndex`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageIndex {
    pub fqn: String,
    /// Chunk offsets for tensors, `None` for bytes items.
    pub offset: Option<Vec<u64>>,
    /// Lookup hint: the position in `chunks`.
    pub index: Option<u64>,
}

/// Where an item lives (`_StorageInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageInfo {
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
    /// True when transform descriptors (compression extensions) were recorded.
    pub has_transforms: bool,
}

/// The `.metadata` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpMetadata {
    /// `state_dict_metadata`, in file order.
    pub items: Vec<(String, ItemMeta)>,
    /// `planner_data`: flattened key -> original path.
    pub planner_data: BTreeMap<String, Vec<PlannerStep>>,
    /// `storage_data`, in file order.
    pub storage: Vec<(StorageIndex, StorageInfo)>,
    pub version: Option<String>,
    /// `storage_meta.checkpoint_id` (the absolute path it was saved to).
    pub checkpoint_id: Option<String>,
    pub save_id: Option<String>,
}

fn class_name(o: &PyObject) -> &str {
    o.class().map_or("", |g| g.name.as_str())
}

fn as_object<'a>(v: &'a PyValue, expected: &str) -> Result<&'a PyObject, DcpError> {
    match v {
        PyValue::Object(o) if class_name(o) == expected => Ok(o),
        other => Err(malformed(format!(
            "expected {expected}, found {}",
            other.type_name()
        ))),
    }
}

fn u64_of(v: Option<&PyValue>, what: &str) -> Result<u64, DcpError> {
    v.and_then(PyValue::as_i64)
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| malformed(format!("{what} is not a non-negative int")))
}

fn string_of(v: &PyValue) -> Option<String> {
    match v {
        PyValue::Str(s) => Some(s.clone()),
        // `pathlib.PosixPath('/a/b')` pickles as REDUCE(PosixPath, ('/', 'a', 'b')) or with parts.
        PyValue::Object(o) if class_name(o).ends_with("Path") => {
            let parts: Vec<&str> = o.args.iter().filter_map(PyValue::as_str).collect();
            Some(
                parts
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        if i == 0 {
                            (*p).to_owned()
                        } else {
                            p.trim_start_matches('/').to_owned()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("/")
                    .replace("//", "/"),
            )
        }
        _ => None,
    }
}

/// Parses the bytes of a `.metadata` file.
pub fn read_metadata(bytes: &[u8]) -> Result<DcpMetadata, DcpError> {
    let root = pickle::parse(bytes).map_err(|source| DcpError::Pickle { source })?;
    let meta = as_object(&root, "Metadata").map_err(|_| {
        malformed(format!(
            "the pickle holds a {}, not a DCP Metadata object",
            root.type_name()
        ))
    })?;
    let sdm = meta
        .attr("state_dict_metadata")
        .ok_or_else(|| malformed("Metadata has no state_dict_metadata"))?;
    let PyValue::Dict(sdm) = sdm else {
        return Err(malformed("state_dict_metadata is not a dict"));
    };
    let mut items = Vec::with_capacity(sdm.len());
    for (k, v) in sdm {
        let key = k
            .as_str()
            .ok_or_else(|| malformed("a state_dict_metadata key is not a string"))?
            .to_owned();
        let item = match v {
            PyValue::Object(o) if class_name(o) == "BytesStorageMetadata" => ItemMeta::Bytes,
            PyValue::Object(o) if class_name(o) == "TensorStorageMetadata" => tensor_meta(&key, o)?,
            other => {
                return Err(malformed(format!(
                    "state_dict_metadata[{key:?}] is a {}, not tensor or bytes metadata",
                    other.type_name()
                )));
            }
        };
        items.push((key, item));
    }
    let mut planner_data = BTreeMap::new();
    if let Some(PyValue::Dict(pd)) = meta.attr("planner_data") {
        for (k, v) in pd {
            let (Some(key), Some(path)) = (k.as_str(), v.as_seq()) else {
                return Err(malformed("planner_data is not a dict of str -> tuple"));
            };
            let steps = path
                .iter()
                .map(|s| match s {
                    PyValue::Str(s) => Ok(PlannerStep::Key(s.clone())),
                    PyValue::Int(i) => Ok(PlannerStep::Index(*i)),
                    other => Err(malformed(format!(
                        "planner_data[{key:?}] has a {} step",
                        other.type_name()
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            planner_data.insert(key.to_owned(), steps);
        }
    }
    let mut storage = Vec::new();
    match meta.attr("storage_data") {
        Some(PyValue::Dict(sd)) => {
            storage.reserve(sd.len());
            for (k, v) in sd {
                storage.push((storage_index(k)?, storage_info(v)?));
            }
        }
        Some(PyValue::None) | None => {}
        Some(other) => {
            return Err(malformed(format!(
                "storage_data is a {}",
                other.type_name()
            )));
        }
    }
    let version = meta
        .attr("version")
        .and_then(PyValue::as_str)
        .map(str::to_owned);
    let (checkpoint_id, save_id) = match meta.attr("storage_meta") {
        Some(PyValue::Object(sm)) => (
            sm.attr("checkpoint_id").and_then(string_of),
            sm.attr("save_id")
                .and_then(PyValue::as_str)
                .map(str::to_owned),
        ),
        _ => (None, None),
    };
    Ok(DcpMetadata {
        items,
        planner_data,
        storage,
        version,
        checkpoint_id,
        save_id,
    })
}

fn dims(v: Option<&PyValue>, what: &str) -> Result<Vec<u64>, DcpError> {
    v.and_then(PyValue::as_dims)
        .ok_or_else(|| malformed(format!("{what} is not a torch.Size")))
}

fn tensor_meta(key: &str, o: &PyObject) -> Result<ItemMeta, DcpError> {
    let props = o
        .attr("properties")
        .ok_or_else(|| malformed(format!("{key}: no properties")))?;
    // TensorProperties pickles its state as a tuple whose first element is the dtype; older
    // releases used a dict state.
    let dtype = match props {
        PyValue::Object(p) => match &p.state {
            Some(PyValue::Tuple(t)) => t.first().cloned(),
            Some(PyValue::Dict(d)) => dict_get(d, "dtype").cloned(),
            _ => None,
        },
        _ => None,
    };
    let Some(PyValue::DType(dtype)) = dtype else {
        return Err(malformed(format!("{key}: properties hold no torch dtype")));
    };
    let size = dims(o.attr("size"), &format!("{key}: size"))?;
    let chunk_list = o
        .attr("chunks")
        .and_then(PyValue::as_seq)
        .ok_or_else(|| malformed(format!("{key}: no chunk list")))?;
    let mut chunks = Vec::with_capacity(chunk_list.len());
    for c in chunk_list {
        let c = as_object(c, "ChunkStorageMetadata")?;
        let offsets = dims(c.attr("offsets"), &format!("{key}: chunk offsets"))?;
        let sizes = dims(c.attr("sizes"), &format!("{key}: chunk sizes"))?;
        if offsets.len() != size.len() || sizes.len() != size.len() {
            return Err(malformed(format!(
                "{key}: chunk offsets {offsets:?} / sizes {sizes:?} do not match the {}-dim size",
                size.len()
            )));
        }
        chunks.push(ChunkMeta { offsets, sizes });
    }
    Ok(ItemMeta::Tensor {
        dtype,
        size,
        chunks,
    })
}

fn storage_index(v: &PyValue) -> Result<StorageIndex, DcpError> {
    let o = as_object(v, "MetadataIndex")?;
    let fqn = o
        .attr("fqn")
        .and_then(PyValue::as_str)
        .ok_or_else(|| malformed("MetadataIndex without fqn"))?
        .to_owned();
    let offset = match o.attr("offset") {
        None | Some(PyValue::None) => None,
        Some(x) => Some(x.as_dims().ok_or_else(|| {
            malformed(format!("MetadataIndex({fqn}).offset is not a torch.Size"))
        })?),
    };
    let index = match o.attr("index") {
        None | Some(PyValue::None) => None,
        Some(x) => Some(u64_of(Some(x), "MetadataIndex.index")?),
    };
    Ok(StorageIndex { fqn, offset, index })
}

fn storage_info(v: &PyValue) -> Result<StorageInfo, DcpError> {
    let o = as_object(v, "_StorageInfo")?;
    let relative_path = o
        .attr("relative_path")
        .and_then(PyValue::as_str)
        .ok_or_else(|| malformed("_StorageInfo without relative_path"))?
        .to_owned();
    if relative_path.contains("..") || relative_path.starts_with('/') || relative_path.is_empty() {
        return Err(malformed(format!(
            "_StorageInfo.relative_path {relative_path:?} leaves the checkpoint folder"
        )));
    }
    Ok(StorageInfo {
        offset: u64_of(o.attr("offset"), "_StorageInfo.offset")?,
        length: u64_of(o.attr("length"), "_StorageInfo.length")?,
        has_transforms: !matches!(o.attr("transform_descriptors"), None | Some(PyValue::None)),
        relative_path,
    })
}
