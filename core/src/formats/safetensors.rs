//! safetensors files (through the `safetensors` crate), the HF index file
//! `model.safetensors.index.json`, and DCP's `DCP_SHARDING_INFO` metadata.

use std::collections::BTreeMap;

use safetensors::{Dtype, SafeTensors};

use crate::dtype::DType;

/// What went wrong while reading safetensors data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SafetensorsError {
    /// The `safetensors` crate refused the header (bad length, bad JSON, bad offsets).
    #[error("invalid safetensors data: {message}")]
    Invalid { message: String },
    /// A dtype shardscope has no torch equivalent for.
    #[error("tensor `{name}` has dtype {dtype} which torch cannot hold")]
    UnsupportedDtype { name: String, dtype: String },
    /// `DCP_SHARDING_INFO` is not the JSON torch writes.
    #[error("bad DCP_SHARDING_INFO for `{name}`: {message}")]
    ShardingInfo { name: String, message: String },
    /// `model.safetensors.index.json` is not what HF writes.
    #[error("bad safetensors index: {message}")]
    Index { message: String },
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the safetensors bytes given to [`read_header`].
    pub offset: u64,
    pub len: u64,
    /// `DCP_SHARDING_INFO[name].saved_offsets` when present: where this piece sits in the global tensor.
    pub saved_offsets: Option<Vec<u64>>,
}

/// The header of a safetensors file (no tensor bytes are read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// Tensors sorted by data offset.
    pub tensors: Vec<SafetensorsTensor>,
    /// `__metadata__` (string to string).
    pub metadata: BTreeMap<String, String>,
    /// Total bytes of header and data: the safetensors blob is `0..total_len`.
    pub total_len: u64,
}

/// Maps a safetensors dtype to a torch dtype.
pub fn dtype_from_safetensors(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BOOL => DType::Bool,
        Dtype::U8 => DType::UInt8,
        Dtype::I8 => DType::Int8,
        Dtype::F8_E5M2 => DType::Float8E5M2,
        Dtype::F8_E4M3 => DType::Float8E4M3Fn,
        Dtype::F8_E8M0 => DType::Float8E8M0Fnu,
        Dtype::F8_E4M3FNUZ => DType::Float8E4M3Fnuz,
        Dtype::F8_E5M2FNUZ => DType::Float8E5M2Fnuz,
        Dtype::I16 => DType::Int16,
        Dtype::U16 => DType::UInt16,
        Dtype::F16 => DType::Float16,
        Dtype::BF16 => DType::BFloat16,
        Dtype::I32 => DType::Int32,
        Dtype::U32 => DType::UInt32,
        Dtype::F32 => DType::Float32,
        Dtype::C64 => DType::Complex64,
        Dtype::F64 => DType::Float64,
        Dtype::I64 => DType::Int64,
        Dtype::U64 => DType::UInt64,
        _ => return None,
    })
}

/// The total length (8 + header + data) of the safetensors blob starting at `bytes[0]`, read from
/// its header alone. Used to find a blob embedded in a longer file (DCP's SAFETENSORS format).
pub fn blob_len(bytes: &[u8]) -> Result<u64, SafetensorsError> {
    let invalid = |m: &str| SafetensorsError::Invalid {
        message: m.to_owned(),
    };
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .ok_or_else(|| invalid("shorter than the 8-byte header length"))?;
    if n > 100_000_000 {
        return Err(invalid("header longer than 100 MB"));
    }
    let end = 8 + n as usize;
    let header = bytes
        .get(8..end)
        .ok_or_else(|| invalid("header runs past the end of the data"))?;
    let value: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| SafetensorsError::Invalid {
            message: e.to_string(),
        })?;
    let mut data_end = 0u64;
    if let Some(obj) = value.as_object() {
        for (k, v) in obj {
            if k == "__metadata__" {
                continue;
            }
            if let Some(e) = v
                .get("data_offsets")
                .and_then(|o| o.get(1))
                .and_then(serde_json::Value::as_u64)
            {
                data_end = data_end.max(e);
            }
        }
    }
    (end as u64)
        .checked_add(data_end)
        .ok_or_else(|| invalid("data offsets overflow"))
}

/// Reads the header of the safetensors bytes (which must be exactly one blob: header and data).
pub fn read_header(bytes: &[u8]) -> Result<SafetensorsHeader, SafetensorsError> {
    let (n, meta) = SafeTensors::read_metadata(bytes).map_err(|e| SafetensorsError::Invalid {
        message: format!("{e:?}"),
    })?;
    let data_start = 8 + n as u64;
    let metadata: BTreeMap<String, String> = meta
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let sharding = match metadata.get("DCP_SHARDING_INFO") {
        Some(json) => Some(
            serde_json::from_str::<serde_json::Value>(json).map_err(|e| {
                SafetensorsError::ShardingInfo {
                    name: "*".into(),
                    message: e.to_string(),
                }
            })?,
        ),
        None => None,
    };
    let mut tensors = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = dtype_from_safetensors(info.dtype).ok_or_else(|| {
            SafetensorsError::UnsupportedDtype {
                name: name.clone(),
                dtype: format!("{:?}", info.dtype),
            }
        })?;
        let saved_offsets = match sharding.as_ref().and_then(|s| s.get(&name)) {
            Some(entry) => {
                let offs = entry
                    .get("saved_offsets")
                    .and_then(serde_json::Value::as_array)
                    .and_then(|a| {
                        a.iter()
                            .map(serde_json::Value::as_u64)
                            .collect::<Option<Vec<u64>>>()
                    })
                    .ok_or_else(|| SafetensorsError::ShardingInfo {
                        name: name.clone(),
                        message: "saved_offsets is not a list of non-negative ints".into(),
                    })?;
                if offs.len() != info.shape.len() {
                    return Err(SafetensorsError::ShardingInfo {
                        name: name.clone(),
                        message: format!(
                            "{} offsets for a {}-dim tensor",
                            offs.len(),
                            info.shape.len()
                        ),
                    });
                }
                Some(offs)
            }
            None => None,
        };
        let (b, e) = info.data_offsets;
        tensors.push(SafetensorsTensor {
            name,
            dtype,
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            offset: data_start + b as u64,
            len: (e - b) as u64,
            saved_offsets,
        });
    }
    tensors.sort_by(|a, b| (a.offset, &a.name).cmp(&(b.offset, &b.name)));
    Ok(SafetensorsHeader {
        tensors,
        metadata,
        total_len: bytes.len() as u64,
    })
}

/// `model.safetensors.index.json`: `{"metadata": {...}, "weight_map": {tensor: file}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsIndex {
    pub weight_map: BTreeMap<String, String>,
    /// `metadata.total_size`, when given.
    pub total_size: Option<u64>,
}

/// Parses an HF safetensors index file.
pub fn read_index(bytes: &[u8]) -> Result<SafetensorsIndex, SafetensorsError> {
    let err = |m: String| SafetensorsError::Index { message: m };
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| err("no weight_map object".into()))?;
    let mut weight_map = BTreeMap::new();
    for (k, f) in map {
        let f = f
            .as_str()
            .ok_or_else(|| err(format!("weight_map[{k:?}] is not a file name")))?;
        if f.contains("..") || f.starts_with('/') {
            return Err(err(format!(
                "weight_map[{k:?}] = {f:?} leaves the checkpoint folder"
            )));
        }
        weight_map.insert(k.clone(), f.to_owned());
    }
    let total_size = v
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .and_then(serde_json::Value::as_u64);
    Ok(SafetensorsIndex {
        weight_map,
        total_size,
    })
}
