//! safetensors files, byte-identical to what the reference implementation (`safetensors` 0.8,
//! `safetensors.torch.save_file`) writes for the same tensors and metadata, plus HF-style sharding
//! (`model-00001-of-00003.safetensors` and `model.safetensors.index.json`).
//!
//! Layout: 8-byte little-endian header length `n`, `n` bytes of JSON, data. The JSON holds
//! `"__metadata__"` first (a string map, sorted by key; absent when no metadata is given), then one
//! entry per tensor, `{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}`, in data order. Data
//! order is the reference's: larger dtype rank first (`U64`, `I64`, `F64`, `C64`, `F32`, `U32`, `I32`,
//! `BF16`, `F16`, `U16`, `I16`, `F8_E4M3`, `F8_E5M2`, `I8`, `U8`, `BOOL`), then name. The header is
//! padded with spaces to a multiple of 8 bytes. The crate `safetensors` only serialises whole
//! in-memory maps or to a path, so this writer produces the format itself to stream.
//!
//! Streaming: [`SafetensorsWriter::new`] takes the tensor specs (name, dtype, shape) and writes the
//! header; [`SafetensorsWriter::data_order`] says in which order to pass the data to
//! [`SafetensorsWriter::write_tensor`].

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};

use serde::Serialize;

use super::{CountingWriter, TensorRef};
use crate::dtype::DType;

/// Name, dtype and shape of one tensor to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's key.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (empty for a scalar).
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// The spec of `tensor` under `name`.
    pub fn from_tensor(name: &str, tensor: &TensorRef<'_>) -> Self {
        Self {
            name: name.to_owned(),
            dtype: tensor.dtype,
            shape: tensor.shape.to_vec(),
        }
    }

    /// Bytes of the tensor's data, `None` on overflow.
    pub fn nbytes(&self) -> Option<u64> {
        crate::shape::nbytes(self.dtype, &self.shape)
    }
}

/// A safetensors file or shard set could not be written.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsWriteError {
    /// The dtype has no safetensors name (`complex32`, `complex128`).
    #[error("tensor `{name}`: dtype {dtype} cannot be stored in safetensors")]
    UnsupportedDType {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// Two tensors share a name, or a tensor is named `__metadata__`.
    #[error("tensor name `{name}` is used twice or reserved")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A tensor's byte size, or the running data offset, overflows 64 bits.
    #[error("tensor `{name}` with shape {shape:?} overflows 64-bit byte counts")]
    TooLarge {
        /// Tensor name.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// `write_tensor` was given tensors in another order than [`SafetensorsWriter::data_order`].
    #[error("expected data of tensor `{expected}` next, got `{got}`")]
    OutOfOrder {
        /// The tensor expected.
        expected: String,
        /// The tensor given.
        got: String,
    },
    /// `write_tensor` got a different number of bytes than the spec declares.
    #[error("tensor `{name}` must have {expected_bytes} bytes, got {actual_bytes}")]
    DataLength {
        /// Tensor name.
        name: String,
        /// Declared bytes.
        expected_bytes: u64,
        /// Bytes given.
        actual_bytes: u64,
    },
    /// `write_tensor` was called after all tensors were written.
    #[error("all tensors were already written, got `{name}`")]
    TooManyTensors {
        /// The extra tensor.
        name: String,
    },
    /// `finish` was called before every tensor was written.
    #[error("tensor `{name}` (and maybe more) was never written")]
    MissingTensor {
        /// The first missing tensor.
        name: String,
    },
    /// The sharding limit is zero.
    #[error("max shard size must be at least 1 byte")]
    ZeroShardSize,
    /// The underlying writer failed.
    #[error("writing safetensors data failed")]
    Io(#[from] io::Error),
}

/// The safetensors name of `dtype` (`None` for `complex32` and `complex128`, which safetensors
/// cannot name).
pub fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "BOOL",
        DType::UInt8 => "U8",
        DType::Int8 => "I8",
        DType::Float8E5M2 => "F8_E5M2",
        DType::Float8E4M3Fn => "F8_E4M3",
        DType::Float8E8M0Fnu => "F8_E8M0",
        DType::Float8E4M3Fnuz => "F8_E4M3FNUZ",
        DType::Float8E5M2Fnuz => "F8_E5M2FNUZ",
        DType::Int16 => "I16",
        DType::UInt16 => "U16",
        DType::Float16 => "F16",
        DType::BFloat16 => "BF16",
        DType::Int32 => "I32",
        DType::UInt32 => "U32",
        DType::Float32 => "F32",
        DType::Complex64 => "C64",
        DType::Float64 => "F64",
        DType::Int64 => "I64",
        DType::UInt64 => "U64",
        DType::Complex32 | DType::Complex128 => return None,
    })
}

/// Position of the dtype in the reference implementation's `Dtype` enum (its derived `Ord`), which
/// decides data order (highest first). Only relative order matters.
fn dtype_rank(dtype: DType) -> u8 {
    match dtype {
        DType::Bool => 0,
        DType::UInt8 => 4,
        DType::Int8 => 5,
        DType::Float8E5M2 => 6,
        DType::Float8E4M3Fn => 7,
        DType::Float8E8M0Fnu => 8,
        DType::Float8E4M3Fnuz => 9,
        DType::Float8E5M2Fnuz => 10,
        DType::Int16 => 11,
        DType::UInt16 => 12,
        DType::Float16 => 13,
        DType::BFloat16 => 14,
        DType::Int32 => 15,
        DType::UInt32 => 16,
        DType::Float32 => 17,
        DType::Complex64 => 18,
        DType::Float64 => 19,
        DType::Int64 => 20,
        DType::UInt64 => 21,
        // Never written (no safetensors name).
        DType::Complex32 | DType::Complex128 => 22,
    }
}

#[derive(Debug)]
struct Planned {
    name: String,
    nbytes: u64,
}

/// Streams one safetensors file into `W`.
#[derive(Debug)]
pub struct SafetensorsWriter<W: Write> {
    out: CountingWriter<W>,
    order: Vec<Planned>,
    next: usize,
    /// Bytes of tensor `next` already passed to [`SafetensorsWriter::write_tensor_part`].
    partial_bytes: u64,
}

impl<W: Write> SafetensorsWriter<W> {
    /// Checks the specs, orders them as the reference does and writes the header.
    pub fn new(
        out: W,
        tensors: &[TensorSpec],
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<Self, SafetensorsWriteError> {
        let mut seen = BTreeSet::new();
        let mut sorted: Vec<&TensorSpec> = Vec::with_capacity(tensors.len());
        for spec in tensors {
            if dtype_name(spec.dtype).is_none() {
                return Err(SafetensorsWriteError::UnsupportedDType {
                    name: spec.name.clone(),
                    dtype: spec.dtype,
                });
            }
            if spec.name == "__metadata__" || !seen.insert(spec.name.as_str()) {
                return Err(SafetensorsWriteError::DuplicateName {
                    name: spec.name.clone(),
                });
            }
            sorted.push(spec);
        }
        sorted.sort_by(|a, b| {
            dtype_rank(b.dtype)
                .cmp(&dtype_rank(a.dtype))
                .then_with(|| a.name.cmp(&b.name))
        });

        let mut header = String::from("{");
        if let Some(metadata) = metadata {
            header.push_str("\"__metadata__\":");
            header.push_str(&json(metadata));
        }
        let mut offset = 0u64;
        let mut order = Vec::with_capacity(sorted.len());
        for spec in sorted {
            let too_large = || SafetensorsWriteError::TooLarge {
                name: spec.name.clone(),
                shape: spec.shape.clone(),
            };
            let nbytes = spec.nbytes().ok_or_else(too_large)?;
            let end = offset.checked_add(nbytes).ok_or_else(too_large)?;
            if header.len() > 1 {
                header.push(',');
            }
            header.push_str(&json(&spec.name));
            header.push_str(":{\"dtype\":\"");
            // Checked above.
            header.push_str(dtype_name(spec.dtype).unwrap_or("?"));
            header.push_str("\",\"shape\":");
            header.push_str(&json(&spec.shape));
            header.push_str(",\"data_offsets\":[");
            header.push_str(&offset.to_string());
            header.push(',');
            header.push_str(&end.to_string());
            header.push_str("]}");
            order.push(Planned {
                name: spec.name.clone(),
                nbytes,
            });
            offset = end;
        }
        header.push('}');
        let padded = header.len().div_ceil(8) * 8;
        let mut header = header.into_bytes();
        header.resize(padded, b' ');

        let mut out = CountingWriter::new(out);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        Ok(Self {
            out,
            order,
            next: 0,
            partial_bytes: 0,
        })
    }

    /// Tensor names in the order their data must be passed to [`SafetensorsWriter::write_tensor`].
    pub fn data_order(&self) -> impl Iterator<Item = &str> {
        self.order.iter().map(|p| p.name.as_str())
    }

    /// Appends the next `data.len()` bytes of tensor `name`, which must be the next one in
    /// [`Self::data_order`]: a tensor can be passed in pieces (in order), and is done when its
    /// bytes are all there. An empty piece of a tensor of 0 bytes completes it.
    pub fn write_tensor_part(
        &mut self,
        name: &str,
        data: &[u8],
    ) -> Result<(), SafetensorsWriteError> {
        let planned =
            self.order
                .get(self.next)
                .ok_or_else(|| SafetensorsWriteError::TooManyTensors {
                    name: name.to_owned(),
                })?;
        if planned.name != name {
            return Err(SafetensorsWriteError::OutOfOrder {
                expected: planned.name.clone(),
                got: name.to_owned(),
            });
        }
        let total = self
            .partial_bytes
            .checked_add(data.len() as u64)
            .filter(|&t| t <= planned.nbytes)
            .ok_or_else(|| SafetensorsWriteError::DataLength {
                name: name.to_owned(),
                expected_bytes: planned.nbytes,
                actual_bytes: self.partial_bytes.saturating_add(data.len() as u64),
            })?;
        self.out.write_all(data)?;
        if total == planned.nbytes {
            self.next += 1;
            self.partial_bytes = 0;
        } else {
            self.partial_bytes = total;
        }
        Ok(())
    }

    /// Appends the data of tensor `name`, which must be the next one in [`Self::data_order`].
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), SafetensorsWriteError> {
        if self.partial_bytes > 0 {
            let expected = self.order.get(self.next).map_or(0, |p| p.nbytes);
            return Err(SafetensorsWriteError::DataLength {
                name: name.to_owned(),
                expected_bytes: expected,
                actual_bytes: self.partial_bytes,
            });
        }
        let planned =
            self.order
                .get(self.next)
                .ok_or_else(|| SafetensorsWriteError::TooManyTensors {
                    name: name.to_owned(),
                })?;
        if planned.name != name {
            return Err(SafetensorsWriteError::OutOfOrder {
                expected: planned.name.clone(),
                got: name.to_owned(),
            });
        }
        if planned.nbytes != data.len() as u64 {
            return Err(SafetensorsWriteError::DataLength {
                name: name.to_owned(),
                expected_bytes: planned.nbytes,
                actual_bytes: data.len() as u64,
            });
        }
        self.out.write_all(data)?;
        self.next += 1;
        Ok(())
    }

    /// Checks that every tensor was written and flushes; returns the inner writer.
    pub fn finish(mut self) -> Result<W, SafetensorsWriteError> {
        if let Some(missing) = self.order.get(self.next) {
            return Err(SafetensorsWriteError::MissingTensor {
                name: missing.name.clone(),
            });
        }
        self.out.flush()?;
        Ok(self.out.into_inner())
    }
}

fn json<T: Serialize + ?Sized>(value: &T) -> String {
    // Strings, string maps and integer lists always serialise.
    serde_json::to_string(value).unwrap_or_default()
}

/// One output file of a sharded save.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardFile {
    /// File name, e.g. `model-00001-of-00003.safetensors`.
    pub file_name: String,
    /// Indices into the tensor list given to [`plan_shards`], in input order.
    pub tensors: Vec<usize>,
}

/// How tensors are split into files (see [`plan_shards`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// The files, in the order of their numbers.
    pub files: Vec<ShardFile>,
    /// Sum of all tensors' data bytes (the index's `metadata.total_size`).
    pub total_size: u64,
}

impl ShardPlan {
    /// Whether the files need a `{stem}.safetensors.index.json` (more than one file, as HF does).
    pub fn needs_index(&self) -> bool {
        self.files.len() > 1
    }
}

/// Splits tensors into files of at most `max_shard_size_bytes` data bytes with Hugging Face's rule
/// (`huggingface_hub.split_torch_state_dict_into_shards`): tensors are taken in input order; a tensor
/// larger than the limit gets a file of its own (added when it is met); a tensor that would push the
/// current file over the limit closes it first. `None` puts everything in one file. Files are named
/// `{stem}-00001-of-0000N.safetensors`, or `{stem}.safetensors` when there is only one.
pub fn plan_shards(
    tensors: &[TensorSpec],
    max_shard_size_bytes: Option<u64>,
    stem: &str,
) -> Result<ShardPlan, SafetensorsWriteError> {
    if max_shard_size_bytes == Some(0) {
        return Err(SafetensorsWriteError::ZeroShardSize);
    }
    let limit = max_shard_size_bytes.unwrap_or(u64::MAX);
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut current_size = 0u64;
    let mut total_size = 0u64;
    for (i, spec) in tensors.iter().enumerate() {
        let too_large = || SafetensorsWriteError::TooLarge {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
        };
        let size = spec.nbytes().ok_or_else(too_large)?;
        total_size = total_size.checked_add(size).ok_or_else(too_large)?;
        if size > limit {
            groups.push(vec![i]);
            continue;
        }
        if current_size.saturating_add(size) > limit {
            groups.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push(i);
        current_size += size;
    }
    if !current.is_empty() || groups.is_empty() {
        groups.push(current);
    }
    let n = groups.len();
    let files = groups
        .into_iter()
        .enumerate()
        .map(|(k, tensors)| ShardFile {
            file_name: if n == 1 {
                format!("{stem}.safetensors")
            } else {
                format!("{stem}-{:05}-of-{n:05}.safetensors", k + 1)
            },
            tensors,
        })
        .collect();
    Ok(ShardPlan { files, total_size })
}

#[derive(Serialize)]
struct IndexJson<'a> {
    metadata: IndexMetadata,
    weight_map: BTreeMap<&'a str, &'a str>,
}

#[derive(Serialize)]
struct IndexMetadata {
    total_size: u64,
}

/// The `{stem}.safetensors.index.json` text for `plan`, formatted as `transformers` writes it
/// (`json.dumps(index, indent=2, sort_keys=True) + "\n"`; names are not ASCII-escaped).
pub fn index_json(plan: &ShardPlan, tensors: &[TensorSpec]) -> String {
    let weight_map = plan
        .files
        .iter()
        .flat_map(|file| {
            file.tensors.iter().filter_map(|&i| {
                tensors
                    .get(i)
                    .map(|t| (t.name.as_str(), file.file_name.as_str()))
            })
        })
        .collect();
    let index = IndexJson {
        metadata: IndexMetadata {
            total_size: plan.total_size,
        },
        weight_map,
    };
    let mut text = serde_json::to_string_pretty(&index).unwrap_or_default();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: DType, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn header_matches_reference_layout() {
        // Expected header printed by `safetensors.torch.save({"b": torch.zeros(3), "a":
        // torch.zeros(2, dtype=torch.bfloat16)}, metadata={"format": "pt"})` (safetensors 0.8.0).
        let specs = [
            spec("b", DType::Float32, &[3]),
            spec("a", DType::BFloat16, &[2]),
        ];
        let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        let mut w = SafetensorsWriter::new(Vec::new(), &specs, Some(&meta)).unwrap();
        assert_eq!(w.data_order().collect::<Vec<_>>(), ["b", "a"]);
        assert!(matches!(
            w.write_tensor("a", &[0; 4]),
            Err(SafetensorsWriteError::OutOfOrder { .. })
        ));
        w.write_tensor("b", &[0; 12]).unwrap();
        assert!(matches!(
            w.write_tensor("a", &[0; 3]),
            Err(SafetensorsWriteError::DataLength { .. })
        ));
        w.write_tensor("a", &[0; 4]).unwrap();
        let bytes = w.finish().unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(
            std::str::from_utf8(&bytes[8..8 + n]).unwrap(),
            r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"a":{"dtype":"BF16","shape":[2],"data_offsets":[12,16]}}  "#
        );
        assert_eq!(bytes.len(), 8 + n + 16);
    }

    #[test]
    fn tensors_written_in_pieces_equal_whole_writes() {
        let specs = [
            spec("b", DType::Float32, &[3]),
            spec("e", DType::Float32, &[0]),
            spec("a", DType::UInt8, &[5]),
        ];
        let data_b: Vec<u8> = (0..12).collect();
        let mut whole = SafetensorsWriter::new(Vec::new(), &specs, None).unwrap();
        whole.write_tensor("b", &data_b).unwrap();
        whole.write_tensor("e", &[]).unwrap();
        whole.write_tensor("a", b"hello").unwrap();
        let whole = whole.finish().unwrap();

        let mut parts = SafetensorsWriter::new(Vec::new(), &specs, None).unwrap();
        parts.write_tensor_part("b", &data_b[..5]).unwrap();
        // A whole write in the middle of a tensor, a piece past its end, another name: refused.
        assert!(matches!(
            parts.write_tensor("b", &data_b),
            Err(SafetensorsWriteError::DataLength { .. })
        ));
        assert!(matches!(
            parts.write_tensor_part("b", &data_b[..8]),
            Err(SafetensorsWriteError::DataLength { .. })
        ));
        assert!(matches!(
            parts.write_tensor_part("a", b"x"),
            Err(SafetensorsWriteError::OutOfOrder { .. })
        ));
        parts.write_tensor_part("b", &data_b[5..]).unwrap();
        parts.write_tensor_part("e", &[]).unwrap();
        parts.write_tensor_part("a", b"hel").unwrap();
        // Unfinished: refused.
        let mut early = SafetensorsWriter::new(Vec::new(), &specs, None).unwrap();
        early.write_tensor_part("b", &data_b[..1]).unwrap();
        assert!(matches!(
            early.finish(),
            Err(SafetensorsWriteError::MissingTensor { .. })
        ));
        parts.write_tensor_part("a", b"lo").unwrap();
        assert_eq!(parts.finish().unwrap(), whole);
    }

    #[test]
    fn every_float8_dtype_reads_back_under_its_name() {
        // `F8_E8M0` has no Python safetensors name yet (0.8.0): the Rust crate's reader is the
        // reference here; the other float8 names are checked against torch in writers_interop.
        let f8 = [
            DType::Float8E4M3Fn,
            DType::Float8E5M2,
            DType::Float8E4M3Fnuz,
            DType::Float8E5M2Fnuz,
            DType::Float8E8M0Fnu,
        ];
        let specs: Vec<TensorSpec> = f8.iter().map(|&d| spec(d.name(), d, &[2])).collect();
        let mut w = SafetensorsWriter::new(Vec::new(), &specs, None).unwrap();
        let order: Vec<String> = w.data_order().map(str::to_owned).collect();
        for name in &order {
            w.write_tensor(name, &[0x7f, 0x80]).unwrap();
        }
        let bytes = w.finish().unwrap();
        let header = crate::formats::safetensors::read_header(&bytes).unwrap();
        for d in f8 {
            let t = header.tensors.iter().find(|t| t.name == d.name()).unwrap();
            assert_eq!(t.dtype, d);
            assert_eq!(t.len, 2);
        }
    }

    #[test]
    fn bad_specs_are_refused() {
        assert!(matches!(
            SafetensorsWriter::new(Vec::new(), &[spec("c", DType::Complex32, &[1])], None),
            Err(SafetensorsWriteError::UnsupportedDType { .. })
        ));
        assert!(matches!(
            SafetensorsWriter::new(Vec::new(), &[spec("c", DType::Complex128, &[1])], None),
            Err(SafetensorsWriteError::UnsupportedDType { .. })
        ));
        let dup = [
            spec("x", DType::Float32, &[1]),
            spec("x", DType::Int8, &[1]),
        ];
        assert!(matches!(
            SafetensorsWriter::new(Vec::new(), &dup, None),
            Err(SafetensorsWriteError::DuplicateName { .. })
        ));
        let w = SafetensorsWriter::new(Vec::new(), &dup[..1], None).unwrap();
        assert!(matches!(
            w.finish(),
            Err(SafetensorsWriteError::MissingTensor { .. })
        ));
    }

    #[test]
    fn shards_follow_the_hugging_face_rule() {
        // Sizes 40, 40, 100 (over the limit), 30, 10, 8 bytes with a 80-byte limit: [a, b] fills 80,
        // c goes alone (added when met), then [d, e] = 40, [f] joins (48).
        let specs = [
            spec("a", DType::Float32, &[10]),
            spec("b", DType::Float32, &[10]),
            spec("c", DType::Float32, &[25]),
            spec("d", DType::Int16, &[15]),
            spec("e", DType::Int8, &[10]),
            spec("f", DType::Float64, &[1]),
        ];
        let plan = plan_shards(&specs, Some(80), "model").unwrap();
        let groups: Vec<_> = plan.files.iter().map(|f| f.tensors.clone()).collect();
        assert_eq!(groups, [vec![2], vec![0, 1], vec![3, 4, 5]]);
        assert_eq!(plan.total_size, 40 + 40 + 100 + 30 + 10 + 8);
        assert_eq!(plan.files[0].file_name, "model-00001-of-00003.safetensors");
        let index = index_json(&plan, &specs);
        assert!(index.starts_with("{\n  \"metadata\": {\n    \"total_size\": 228\n  },\n"));
        assert!(index.contains("\"c\": \"model-00001-of-00003.safetensors\""));
        assert!(index.ends_with("}\n"));

        let single = plan_shards(&specs, None, "model").unwrap();
        assert_eq!(single.files.len(), 1);
        assert!(!single.needs_index());
        assert_eq!(single.files[0].file_name, "model.safetensors");
        assert!(
            plan_shards(&[], None, "model").unwrap().files[0]
                .tensors
                .is_empty()
        );
    }
}
