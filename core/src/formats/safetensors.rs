//! safetensors files (through the `safetensors` crate), the HF index file
//! `model.safetensors.index.json`, and DCP's `DCP_SHARDING_INFO` metadata.

use std::collections::BTreeMap;

use safetensors::Dtype;

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

/// The most bytes a header may claim (the `safetensors` crate's limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Bytes `8 + n` that hold the header of the blob starting with `first8` (its 8-byte length
/// prefix): what [`read_header_prefix`] needs.
pub fn header_end(first8: &[u8]) -> Result<u64, SafetensorsError> {
    let invalid = |m: &str| SafetensorsError::Invalid {
        message: m.to_owned(),
    };
    let n = first8
        .get(..8)
        .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .ok_or_else(|| invalid("shorter than the 8-byte header length"))?;
    if n > MAX_HEADER_LEN {
        return Err(invalid("header longer than 100 MB"));
    }
    Ok(8 + n)
}

/// Reads the header of the safetensors bytes (which must be exactly one blob: header and data).
pub fn read_header(bytes: &[u8]) -> Result<SafetensorsHeader, SafetensorsError> {
    let end = usize::try_from(header_end(bytes)?).unwrap_or(usize::MAX);
    let prefix = bytes.get(..end).ok_or_else(|| SafetensorsError::Invalid {
        message: "header runs past the end of the data".to_owned(),
    })?;
    read_header_prefix(prefix, bytes.len() as u64)
}

/// One tensor as the header describes it (offsets as `u64`: files over 4 GiB on 32-bit targets).
#[derive(serde::Deserialize)]
struct RawTensor {
    dtype: Dtype,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Reads a safetensors header from the blob's first [`header_end`] bytes alone, for a blob of
/// `total_len` bytes (header and data): no tensor bytes are needed. Checked as the `safetensors`
/// crate checks a whole file: tensors tile the data exactly, each as long as its dtype and shape
/// say, and the data ends where the blob does.
#[allow(
    clippy::too_many_lines,
    reason = "the header's checks (length, JSON, offsets, dtypes, contiguity) run in the order the format defines them"
)]
pub fn read_header_prefix(
    prefix: &[u8],
    total_len: u64,
) -> Result<SafetensorsHeader, SafetensorsError> {
    let invalid = |m: String| SafetensorsError::Invalid { message: m };
    let end = header_end(prefix)?;
    let header = usize::try_from(end)
        .ok()
        .and_then(|e| prefix.get(8..e))
        .ok_or_else(|| invalid("header runs past the end of the data".to_owned()))?;
    let data_start = end;
    let fields: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| invalid(format!("header: {e}")))?;
    let mut metadata: BTreeMap<String, String> = BTreeMap::new();
    let mut raw = Vec::with_capacity(fields.len());
    for (name, value) in fields {
        if name == "__metadata__" {
            metadata =
                serde_json::from_value(value).map_err(|e| invalid(format!("__metadata__: {e}")))?;
        } else {
            let t: RawTensor = serde_json::from_value(value)
                .map_err(|e| invalid(format!("tensor `{name}`: {e}")))?;
            raw.push((name, t));
        }
    }
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
    raw.sort_by(|(an, a), (bn, b)| (a.data_offsets, an).cmp(&(b.data_offsets, bn)));
    let mut tensors = Vec::with_capacity(raw.len());
    let mut next = 0u64;
    for (name, info) in raw {
        let dtype = dtype_from_safetensors(info.dtype).ok_or_else(|| {
            SafetensorsError::UnsupportedDtype {
                name: name.clone(),
                dtype: format!("{:?}", info.dtype),
            }
        })?;
        let (b, e) = info.data_offsets;
        if b != next || e < b {
            return Err(invalid(format!(
                "tensor `{name}`: data offsets [{b}, {e}] do not follow the previous tensor (ending at {next})"
            )));
        }
        next = e;
        let bytes = info
            .shape
            .iter()
            .try_fold(dtype.size_bytes() as u64, |a, &d| a.checked_mul(d));
        if bytes != Some(e - b) {
            return Err(invalid(format!(
                "tensor `{name}`: {} bytes of data for a {dtype:?} tensor of shape {:?}",
                e - b,
                info.shape
            )));
        }
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
        let offset = data_start
            .checked_add(b)
            .ok_or_else(|| invalid(format!("tensor `{name}`: data offsets overflow")))?;
        tensors.push(SafetensorsTensor {
            name,
            dtype,
            shape: info.shape,
            offset,
            len: e - b,
            saved_offsets,
        });
    }
    if data_start.checked_add(next) != Some(total_len) {
        return Err(invalid(format!(
            "incomplete metadata: the header describes {} bytes, the data holds {}",
            data_start.saturating_add(next),
            total_len
        )));
    }
    Ok(SafetensorsHeader {
        tensors,
        metadata,
        total_len,
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
