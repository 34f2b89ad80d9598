//! Where the ranks' shards come from.
//!
//! Two kinds of source, behind two small traits:
//! - [`FullSource`]: full (unsharded) parameters; every rank cuts its padded shard from them with the
//!   plan's layout (a full checkpoint, or generated data for `--synthetic`).
//! - [`RankSource`]: the rank-local tensors torch saved (an FSDP1 flat shard, an FSDP2 local chunk).
//!
//! Readers for torch formats (per-rank `.pt`, DCP, safetensors) implement these in [`super::ckpt`].

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardscope_core::DType;
use shardscope_core::model::{ModelDescription, ParamSpec};

/// Why a source cannot provide what the gather needs.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The file cannot be read.
    #[error("cannot read {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file.
    #[error("{}: not a valid safetensors file: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    /// The file uses a safetensors dtype that torch has no equivalent for.
    #[error(
        "{source_name}: tensor `{key}` has dtype {dtype}, which has no torch equivalent shardscope supports"
    )]
    UnsupportedDType {
        source_name: String,
        key: String,
        dtype: String,
    },
    /// A tensor the layout needs is not in the source.
    #[error("{source_name}: no tensor `{key}`")]
    Missing { source_name: String, key: String },
    /// A tensor has another dtype than the model description says.
    #[error("{source_name}: tensor `{key}` has dtype {found}, the model says {expected}")]
    DTypeMismatch {
        source_name: String,
        key: String,
        expected: DType,
        found: DType,
    },
    /// A full tensor has another shape than the model description says.
    #[error("{source_name}: tensor `{key}` has shape {found:?}, the model says {expected:?}")]
    ShapeMismatch {
        source_name: String,
        key: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    /// A rank-local tensor is longer than the padded shard the layout gives that rank.
    #[error(
        "{source_name}: rank {rank} tensor `{key}` has {found_bytes} bytes, more than the {padded_bytes} bytes of its padded shard under this layout (wrong --world-size or --api?)"
    )]
    ShardTooLarge {
        source_name: String,
        rank: u64,
        key: String,
        found_bytes: u64,
        padded_bytes: u64,
    },
    /// The checkpoint index could not read a tensor's values (a damaged chunk, a missing file).
    #[error("{source_name}: tensor `{key}`: {message}")]
    Read {
        source_name: String,
        key: String,
        message: String,
    },
    /// A byte range past the end of a tensor was requested (a plan/source mismatch).
    #[error(
        "{source_name}: bytes [{offset}, {offset}+{len}) are outside tensor `{key}` ({size} bytes)"
    )]
    OutOfRange {
        source_name: String,
        key: String,
        offset: u64,
        len: u64,
        size: u64,
    },
}

/// Full (unsharded) parameters, addressed by clean FQN.
pub trait FullSource: Send + Sync {
    /// A name for messages (the file path, `synthetic`).
    fn name(&self) -> String;
    /// True when the source has parameter `fqn`.
    fn contains(&self, fqn: &str) -> bool;
    /// Fills `dst` with bytes `[byte_offset, byte_offset + dst.len())` of parameter `fqn`.
    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError>;
}

/// Rank-local tensors as torch saved them.
pub trait RankSource: Send + Sync {
    /// A name for messages.
    fn name(&self) -> String;
    /// The local tensor `key` of global rank `rank`: an FSDP1 flat shard (`block1._flat_param`, with
    /// or without its zero tail) or an FSDP2 local chunk (FQN, padded or not). `None` when the rank
    /// holds no such tensor (an empty shard).
    fn read_local(
        &self,
        rank: u64,
        key: &str,
        dtype: DType,
    ) -> Result<Option<Cow<'_, [u8]>>, SourceError>;

    /// The checkpoint's own full value of parameter `fqn` for `--verify`, written into `dst` (its
    /// size), when the checkpoint records it independently of the layout (DTensor or ShardedTensor
    /// chunk offsets). `None`: verify against the local tensors reassembled through the layout.
    fn read_reference(&self, _fqn: &str, _dst: &mut [u8]) -> Option<Result<(), SourceError>> {
        None
    }
}

/// A shard source of either kind.
pub enum Source {
    /// Shards are cut from full parameters.
    Full(Box<dyn FullSource>),
    /// Shards are read as saved.
    PerRank(Box<dyn RankSource>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Full(s) => write!(f, "Source::Full({})", s.name()),
            Source::PerRank(s) => write!(f, "Source::PerRank({})", s.name()),
        }
    }
}

impl Source {
    pub(crate) fn name(&self) -> String {
        match self {
            Source::Full(s) => s.name(),
            Source::PerRank(s) => s.name(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Synthetic data

/// Deterministic generated parameters for a model description (`--synthetic`).
///
/// Element `i` of parameter `p` is derived from `splitmix64(seed ^ hash(fqn) + i)`; floating-point
/// values are kept finite (exponent forced into `[1, 2)`), so the output loads anywhere.
#[derive(Debug, Clone)]
pub struct SyntheticSource {
    seed: u64,
    /// FQN -> (dtype, numel, name whose data it is: the primary of a tied alias).
    params: BTreeMap<String, (DType, u64, String)>,
}

impl SyntheticSource {
    pub fn new(model: &ModelDescription, seed: u64) -> Self {
        let params = model
            .params
            .iter()
            .map(|p: &ParamSpec| {
                let data_name = p.shared_with.clone().unwrap_or_else(|| p.fqn.clone());
                (p.fqn.clone(), (p.dtype, p.numel(), data_name))
            })
            .collect();
        Self { seed, params }
    }

    fn param_seed(&self, fqn: &str) -> u64 {
        // FNV-1a over the name: stable across runs and platforms.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in fqn.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^ self.seed
    }
}

/// `splitmix64`: a fast, well-mixed 64-bit hash of a counter.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The generated bytes of one element of `dtype` from a 64-bit hash.
fn synthetic_element(dtype: DType, h: u64, out: &mut [u8]) {
    match dtype {
        DType::Float32 => {
            let bits = (h as u32 & 0x807f_ffff) | 0x3f80_0000;
            out.copy_from_slice(&bits.to_le_bytes());
        }
        DType::Float64 | DType::Complex128 => {
            for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
                let hh = if i == 0 { h } else { splitmix64(h) };
                let bits = (hh & 0x800f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000;
                chunk.copy_from_slice(&bits.to_le_bytes());
            }
        }
        DType::Complex64 => {
            let lo = (h as u32 & 0x807f_ffff) | 0x3f80_0000;
            let hi = ((h >> 32) as u32 & 0x807f_ffff) | 0x3f80_0000;
            out[..4].copy_from_slice(&lo.to_le_bytes());
            out[4..].copy_from_slice(&hi.to_le_bytes());
        }
        DType::Float16 => {
            let bits = (h as u16 & 0x83ff) | 0x3c00;
            out.copy_from_slice(&bits.to_le_bytes());
        }
        DType::BFloat16 => {
            let bits = (h as u16 & 0x807f) | 0x3f80;
            out.copy_from_slice(&bits.to_le_bytes());
        }
        DType::Float8E4M3Fn => out[0] = (h as u8 & 0x87) | 0x38,
        DType::Float8E5M2 => out[0] = (h as u8 & 0x83) | 0x3c,
        DType::Bool => out[0] = (h & 1) as u8,
        _ => {
            let bytes = h.to_le_bytes();
            out.copy_from_slice(&bytes[..out.len()]);
        }
    }
}

impl FullSource for SyntheticSource {
    fn name(&self) -> String {
        format!("synthetic (seed {})", self.seed)
    }

    fn contains(&self, fqn: &str) -> bool {
        self.params.contains_key(fqn)
    }

    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        let Some((dtype, numel, data_name)) = self.params.get(fqn) else {
            return Err(SourceError::Missing {
                source_name: self.name(),
                key: fqn.to_owned(),
            });
        };
        let (dtype, numel) = (*dtype, *numel);
        let es = dtype.size_bytes() as u64;
        let size = numel.saturating_mul(es);
        let len = dst.len() as u64;
        if !byte_offset.is_multiple_of(es)
            || !len.is_multiple_of(es)
            || byte_offset.saturating_add(len) > size
        {
            return Err(SourceError::OutOfRange {
                source_name: self.name(),
                key: fqn.to_owned(),
                offset: byte_offset,
                len,
                size,
            });
        }
        let base = self.param_seed(data_name);
        let first = byte_offset / es;
        for (i, out) in dst.chunks_exact_mut(es as usize).enumerate() {
            synthetic_element(dtype, splitmix64(base.wrapping_add(first + i as u64)), out);
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// safetensors

/// Maps a safetensors dtype to torch's.
pub(crate) fn dtype_from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match dtype {
        S::BOOL => DType::Bool,
        S::U8 => DType::UInt8,
        S::I8 => DType::Int8,
        S::I16 => DType::Int16,
        S::U16 => DType::UInt16,
        S::I32 => DType::Int32,
        S::U32 => DType::UInt32,
        S::I64 => DType::Int64,
        S::U64 => DType::UInt64,
        S::F16 => DType::Float16,
        S::BF16 => DType::BFloat16,
        S::F32 => DType::Float32,
        S::F64 => DType::Float64,
        S::C64 => DType::Complex64,
        S::F8_E4M3 => DType::Float8E4M3Fn,
        S::F8_E5M2 => DType::Float8E5M2,
        S::F8_E8M0 => DType::Float8E8M0Fnu,
        S::F8_E4M3FNUZ => DType::Float8E4M3Fnuz,
        S::F8_E5M2FNUZ => DType::Float8E5M2Fnuz,
        _ => return None,
    })
}

/// Maps torch's dtype to safetensors'. `complex32` and `complex128` have no safetensors dtype.
pub(crate) fn dtype_to_safetensors(dtype: DType) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Some(match dtype {
        DType::Bool => S::BOOL,
        DType::UInt8 => S::U8,
        DType::Int8 => S::I8,
        DType::Int16 => S::I16,
        DType::UInt16 => S::U16,
        DType::Int32 => S::I32,
        DType::UInt32 => S::U32,
        DType::Int64 => S::I64,
        DType::UInt64 => S::U64,
        DType::Float16 => S::F16,
        DType::BFloat16 => S::BF16,
        DType::Float32 => S::F32,
        DType::Float64 => S::F64,
        DType::Complex64 => S::C64,
        DType::Float8E4M3Fn => S::F8_E4M3,
        DType::Float8E5M2 => S::F8_E5M2,
        DType::Float8E8M0Fnu => S::F8_E8M0,
        DType::Float8E4M3Fnuz => S::F8_E4M3FNUZ,
        DType::Float8E5M2Fnuz => S::F8_E5M2FNUZ,
        DType::Complex32 | DType::Complex128 => return None,
    })
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone)]
pub(crate) struct TensorRecord {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    /// Byte range in the file.
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// A safetensors file read into memory and indexed (header validated by the `safetensors` crate).
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: Vec<u8>,
    /// Tensors by name, in file (offset) order of their data.
    pub(crate) tensors: BTreeMap<String, TensorRecord>,
    /// Names in data order (safetensors' own order: dtype alignment, then name).
    pub(crate) order: Vec<String>,
}

impl SafetensorsFile {
    pub fn read(path: &Path) -> Result<Self, SourceError> {
        let bytes = std::fs::read(path).map_err(|source| SourceError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(path.to_owned(), bytes)
    }

    pub fn from_bytes(path: PathBuf, bytes: Vec<u8>) -> Result<Self, SourceError> {
        let (header_len, metadata) =
            safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
                SourceError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                }
            })?;
        let data_start = header_len + 8;
        let mut tensors = BTreeMap::new();
        let mut order: Vec<(usize, String)> = Vec::new();
        for (name, info) in metadata.tensors() {
            let dtype = dtype_from_safetensors(info.dtype).ok_or_else(|| {
                SourceError::UnsupportedDType {
                    source_name: path.display().to_string(),
                    key: name.clone(),
                    dtype: format!("{:?}", info.dtype),
                }
            })?;
            // `read_metadata` validated that the offsets tile the data section and match the shape.
            let (s, e) = info.data_offsets;
            order.push((s, name.clone()));
            tensors.insert(
                name,
                TensorRecord {
                    dtype,
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                    start: data_start + s,
                    end: data_start + e,
                },
            );
        }
        order.sort();
        Ok(Self {
            path,
            bytes,
            tensors,
            order: order.into_iter().map(|(_, n)| n).collect(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bytes of tensor `name`.
    pub fn data(&self, name: &str) -> Option<&[u8]> {
        self.tensors.get(name).map(|t| &self.bytes[t.start..t.end])
    }

    /// A model description with one root unit and the tensors in file order (`--model` not given).
    pub fn describe(
        &self,
        prefix: &str,
    ) -> Result<ModelDescription, shardscope_core::model::DescriptionError> {
        let params = self
            .order
            .iter()
            .filter_map(|name| {
                let fqn = name.strip_prefix(prefix)?;
                let t = &self.tensors[name];
                Some(ParamSpec {
                    fqn: fqn.to_owned(),
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                    requires_grad: true,
                    shared_with: None,
                })
            })
            .collect();
        ModelDescription::new(params, vec![String::new()], Vec::new())
    }
}

/// Full parameters from a safetensors file: key `<prefix><fqn>` (prefix `""` for a plain full
/// checkpoint, `full/` for the layout fixtures).
#[derive(Debug, Clone)]
pub struct SafetensorsFull {
    file: Arc<SafetensorsFile>,
    prefix: String,
    /// Tied names the file does not store, and the name it stores their tensor under.
    aliases: BTreeMap<String, String>,
}

impl SafetensorsFull {
    pub fn new(file: Arc<SafetensorsFile>, prefix: &str) -> Self {
        Self {
            file,
            prefix: prefix.to_owned(),
            aliases: BTreeMap::new(),
        }
    }

    /// A source for `model`: checks that every parameter the gather needs is present with the right
    /// dtype and shape. A tied name the file does not store (torch saves a tied tensor once, under its
    /// first name) is read from its primary.
    pub fn for_model(
        file: Arc<SafetensorsFile>,
        prefix: &str,
        model: &ModelDescription,
    ) -> Result<Self, SourceError> {
        let mut source = Self::new(file, prefix);
        source.check(model)?;
        for p in &model.params {
            if let Some(primary) = &p.shared_with
                && !source
                    .file
                    .tensors
                    .contains_key(&format!("{prefix}{}", p.fqn))
            {
                source.aliases.insert(p.fqn.clone(), primary.clone());
            }
        }
        Ok(source)
    }

    fn key(&self, fqn: &str) -> String {
        let stored = self.aliases.get(fqn).map_or(fqn, String::as_str);
        format!("{}{stored}", self.prefix)
    }

    /// Checks that every parameter of `model` the gather needs is present with the right dtype and
    /// shape (tied aliases may be absent: they are the primary's tensor).
    pub fn check(&self, model: &ModelDescription) -> Result<(), SourceError> {
        for p in &model.params {
            let key = format!("{}{}", self.prefix, p.fqn);
            let Some(t) = self.file.tensors.get(&key) else {
                if p.shared_with.is_some() || model.ignored.contains(&p.fqn) {
                    continue;
                }
                return Err(SourceError::Missing {
                    source_name: self.name(),
                    key,
                });
            };
            if t.dtype != p.dtype {
                return Err(SourceError::DTypeMismatch {
                    source_name: self.name(),
                    key,
                    expected: p.dtype,
                    found: t.dtype,
                });
            }
            if t.shape != p.shape {
                return Err(SourceError::ShapeMismatch {
                    source_name: self.name(),
                    key,
                    expected: p.shape.clone(),
                    found: t.shape.clone(),
                });
            }
        }
        Ok(())
    }
}

impl FullSource for SafetensorsFull {
    fn name(&self) -> String {
        self.file.path.display().to_string()
    }

    fn contains(&self, fqn: &str) -> bool {
        self.file.tensors.contains_key(&self.key(fqn))
    }

    fn read_full(&self, fqn: &str, byte_offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        let key = self.key(fqn);
        let Some(data) = self.file.data(&key) else {
            return Err(SourceError::Missing {
                source_name: self.name(),
                key,
            });
        };
        let len = dst.len() as u64;
        let range = usize::try_from(byte_offset)
            .ok()
            .and_then(|s| Some(s..s.checked_add(dst.len())?))
            .and_then(|r| data.get(r));
        let Some(src) = range else {
            return Err(SourceError::OutOfRange {
                source_name: self.name(),
                key,
                offset: byte_offset,
                len,
                size: data.len() as u64,
            });
        };
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Rank-local tensors from one safetensors file with keys `rank<r>/<key>` (the convention of the
/// layout fixtures, which store torch's own padded shards that way).
#[derive(Debug, Clone)]
pub struct RankPrefixedSafetensors {
    file: Arc<SafetensorsFile>,
}

impl RankPrefixedSafetensors {
    pub fn new(file: Arc<SafetensorsFile>) -> Self {
        Self { file }
    }
}

impl RankSource for RankPrefixedSafetensors {
    fn name(&self) -> String {
        self.file.path.display().to_string()
    }

    fn read_local(
        &self,
        rank: u64,
        key: &str,
        dtype: DType,
    ) -> Result<Option<Cow<'_, [u8]>>, SourceError> {
        let name = format!("rank{rank}/{key}");
        let Some(t) = self.file.tensors.get(&name) else {
            return Ok(None);
        };
        if t.dtype != dtype {
            return Err(SourceError::DTypeMismatch {
                source_name: self.name(),
                key: name,
                expected: dtype,
                found: t.dtype,
            });
        }
        Ok(self.file.data(&name).map(Cow::Borrowed))
    }
}
