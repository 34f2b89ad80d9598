//! A canonical in-memory value for nested state dicts (`model.state_dict()`, `optim.state_dict()`,
//! `FSDP.optim_state_dict(...)`): what readers produce and transforms consume.
//!
//! Dictionaries keep insertion order, because PyTorch's key order carries meaning (optimizer ids
//! follow it, `param_groups` lists follow it) and round trips must reproduce it.

use std::collections::HashMap;

use crate::dtype::DType;

/// A dictionary key: PyTorch state dicts use strings (FQNs, state names) and integers (optimizer
/// parameter ids).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Int(i64),
    Str(String),
}

impl Key {
    pub fn str(s: &str) -> Self {
        Key::Str(s.to_owned())
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Key::Str(s) => Some(s),
            Key::Int(_) => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Key::Int(i) => Some(*i),
            Key::Str(_) => None,
        }
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::Int(i) => write!(f, "{i}"),
            Key::Str(s) => f.write_str(s),
        }
    }
}

/// A dense tensor: dtype, shape and the little-endian bytes of its contiguous elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// The bytes do not match the dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tensor of dtype {dtype} and shape {shape:?} needs {expected_bytes:?} bytes, got {actual_bytes}"
)]
pub struct TensorSizeError {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub expected_bytes: Option<u64>,
    pub actual_bytes: u64,
}

impl Tensor {
    /// A tensor over `data`, checked against `dtype` and `shape`.
    pub fn new(dtype: DType, shape: Vec<u64>, data: Vec<u8>) -> Result<Self, TensorSizeError> {
        let expected =
            crate::shape::numel(&shape).and_then(|n| n.checked_mul(dtype.size_bytes() as u64));
        if expected != Some(data.len() as u64) {
            return Err(TensorSizeError {
                dtype,
                shape,
                expected_bytes: expected,
                actual_bytes: data.len() as u64,
            });
        }
        Ok(Self { dtype, shape, data })
    }

    /// A tensor of zeros (all-zero bytes are `0` in every dtype).
    pub fn zeros(dtype: DType, shape: Vec<u64>) -> Self {
        let numel: u64 = shape.iter().product();
        Self {
            dtype,
            data: vec![0; numel as usize * dtype.size_bytes()],
            shape,
        }
    }

    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Number of dimensions (0 for a scalar).
    pub fn dim(&self) -> usize {
        self.shape.len()
    }

    /// The same bytes with another shape of equal numel.
    pub fn reshaped(mut self, shape: Vec<u64>) -> Option<Self> {
        if shape.iter().product::<u64>() != self.numel() {
            return None;
        }
        self.shape = shape;
        Some(self)
    }

    /// Value of a 0-dim or one-element tensor as `f64` (every real dtype, float8 included;
    /// `None` for complex).
    pub fn scalar_f64(&self) -> Option<f64> {
        if self.numel() != 1 || self.dtype.is_complex() || self.data.len() < self.dtype.size_bytes()
        {
            return None;
        }
        Some(self.dtype.element_f64(&self.data)[0])
    }
}

/// The little-endian bytes of `value` in `dtype` (floating dtypes only; used for padding fills).
pub fn fill_bytes(dtype: DType, value: f64) -> Option<Vec<u8>> {
    Some(match dtype {
        DType::Float32 => (value as f32).to_le_bytes().to_vec(),
        DType::Float64 => value.to_le_bytes().to_vec(),
        DType::BFloat16 => {
            // Round to nearest even, as torch does for exactly representable fills like 42.
            let bits = (value as f32).to_bits();
            let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
            (rounded as u16).to_le_bytes().to_vec()
        }
        DType::Float16 => f16_bits(value as f32).to_le_bytes().to_vec(),
        _ => return None,
    })
}

fn f16_bits(v: f32) -> u16 {
    // Exact for the small integers FSDP uses as fill values; general rounding is not needed here.
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let frac = ((bits >> 13) & 0x3ff) as u16;
    if v == 0.0 || exp <= 0 {
        sign
    } else if exp >= 31 {
        sign | 0x7c00
    } else {
        sign | ((exp as u16) << 10) | frac
    }
}

/// How a distributed tensor was pickled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DistKind {
    /// `torch.distributed._shard.sharded_tensor.ShardedTensor` (FSDP1 `_use_dtensor=False`).
    ShardedTensor,
    /// `torch.distributed.tensor.DTensor` with a `Shard(0)` placement.
    DTensor,
}

/// One chunk of a distributed tensor as its global metadata lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    /// ShardedTensor placement string (`rank:1/cpu`), absent for DTensor.
    pub placement: Option<String>,
}

/// One rank's view of a dim-0 sharded tensor (a ShardedTensor or a DTensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistTensor {
    pub kind: DistKind,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    /// The local piece and its global offsets. ShardedTensor ranks without data have none; DTensor
    /// ranks always have one (possibly with dim 0 of size 0, at offset `dim0`).
    pub local: Option<(Vec<u64>, Tensor)>,
    /// ShardedTensor: every non-empty chunk of every rank. DTensor: empty.
    pub chunks: Vec<ChunkMeta>,
}

/// An insertion-ordered dictionary with O(1) lookups (state dicts of large models have many
/// thousands of keys).
#[derive(Debug, Clone, Default)]
pub struct Dict {
    entries: Vec<(Key, Node)>,
    index: HashMap<Key, usize>,
}

impl PartialEq for Dict {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}

impl Dict {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, key: &Key) -> Option<&Node> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn get_mut(&mut self, key: &Key) -> Option<&mut Node> {
        self.index.get(key).map(|&i| &mut self.entries[i].1)
    }

    pub fn get_str(&self, key: &str) -> Option<&Node> {
        self.get(&Key::Str(key.to_owned()))
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.index.contains_key(key)
    }

    /// Inserts at the end, or replaces the value in place (keeping the position) when the key
    /// exists, as a Python dict does.
    pub fn insert(&mut self, key: Key, value: Node) {
        if let Some(&i) = self.index.get(&key) {
            self.entries[i].1 = value;
        } else {
            self.index.insert(key.clone(), self.entries.len());
            self.entries.push((key, value));
        }
    }

    /// Removes a key (O(n): later positions shift, as in a Python dict's iteration order).
    pub fn remove(&mut self, key: &Key) -> Option<Node> {
        let i = self.index.remove(key)?;
        let (_, value) = self.entries.remove(i);
        for slot in self.index.values_mut() {
            if *slot > i {
                *slot -= 1;
            }
        }
        Some(value)
    }

    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.entries.iter().map(|(k, _)| k)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Key, &Node)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    pub fn into_entries(self) -> Vec<(Key, Node)> {
        self.entries
    }
}

impl FromIterator<(Key, Node)> for Dict {
    fn from_iter<I: IntoIterator<Item = (Key, Node)>>(iter: I) -> Self {
        let mut d = Dict::new();
        for (k, v) in iter {
            d.insert(k, v);
        }
        d
    }
}

/// A value inside a state dict.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tensor(Tensor),
    Dist(DistTensor),
    List(Vec<Node>),
    Tuple(Vec<Node>),
    Dict(Dict),
}

impl Node {
    pub fn as_dict(&self) -> Option<&Dict> {
        match self {
            Node::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Node::Tensor(t) => Some(t),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Node]> {
        match self {
            Node::List(v) | Node::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// A short name of the value's kind, for error messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Node::None => "None",
            Node::Bool(_) => "bool",
            Node::Int(_) => "int",
            Node::Float(_) => "float",
            Node::Str(_) => "str",
            Node::Bytes(_) => "bytes",
            Node::Tensor(_) => "Tensor",
            Node::Dist(DistTensor {
                kind: DistKind::ShardedTensor,
                ..
            }) => "ShardedTensor",
            Node::Dist(_) => "DTensor",
            Node::List(_) => "list",
            Node::Tuple(_) => "tuple",
            Node::Dict(_) => "dict",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dict_keeps_insertion_order_and_replaces_in_place() {
        let mut d = Dict::new();
        d.insert(Key::Int(3), Node::Int(1));
        d.insert(Key::str("a"), Node::Int(2));
        d.insert(Key::Int(3), Node::Int(5));
        let keys: Vec<_> = d.keys().cloned().collect();
        assert_eq!(keys, [Key::Int(3), Key::str("a")]);
        assert_eq!(d.get(&Key::Int(3)), Some(&Node::Int(5)));
        d.insert(Key::str("b"), Node::Int(6));
        assert_eq!(d.remove(&Key::Int(3)), Some(Node::Int(5)));
        assert_eq!(d.len(), 2);
        assert_eq!(d.get_str("b"), Some(&Node::Int(6)));
        assert_eq!(d.get_str("a"), Some(&Node::Int(2)));
    }

    #[test]
    fn tensor_sizes_are_checked() {
        assert!(Tensor::new(DType::Float32, vec![2, 3], vec![0; 24]).is_ok());
        assert!(Tensor::new(DType::Float32, vec![2, 3], vec![0; 23]).is_err());
        assert!(Tensor::new(DType::Float32, vec![u64::MAX, 3], vec![]).is_err());
    }

    #[test]
    fn fills_are_exact() {
        assert_eq!(
            fill_bytes(DType::Float32, 42.0).unwrap(),
            42f32.to_le_bytes()
        );
        // bf16(42) = 0x4228, f16(42) = 0x5140.
        assert_eq!(fill_bytes(DType::BFloat16, 42.0).unwrap(), [0x28, 0x42]);
        assert_eq!(fill_bytes(DType::Float16, 42.0).unwrap(), [0x40, 0x51]);
        let t = Tensor::new(DType::Float16, vec![], vec![0x40, 0x51]).unwrap();
        assert_eq!(t.scalar_f64(), Some(42.0));
    }
}
