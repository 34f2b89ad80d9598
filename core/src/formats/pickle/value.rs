//! The owned value tree of pass 2: [`PyValue`], generic objects and torch's class records.

use crate::dtype::DType;

/// A Python global referenced by name (`module.name`); never imported.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Global {
    pub module: String,
    pub name: String,
}

impl Global {
    pub(super) fn is(&self, module: &str, name: &str) -> bool {
        self.module == module && self.name == name
    }
}

impl std::fmt::Display for Global {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.module, self.name)
    }
}

/// A value read from a pickle, after pass 2.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i64),
    /// An integer that does not fit `i64`: little-endian two's complement bytes.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<PyValue>),
    List(Vec<PyValue>),
    /// `dict` and `OrderedDict`, in insertion order; keys may be any value (DCP uses objects).
    Dict(Vec<(PyValue, PyValue)>),
    Set(Vec<PyValue>),
    /// A global used as a value (a class, a function), never called.
    Global(Box<Global>),
    /// `torch.float32` and friends.
    DType(DType),
    /// `torch.Size`.
    Size(Vec<u64>),
    /// A storage persistent id `("storage", torch.FloatStorage, key, location, numel)`.
    Storage(Box<StorageRef>),
    /// `_rebuild_tensor_v2` (possibly wrapped as a `Parameter` or by `_rebuild_from_type_v2`).
    Tensor(Box<TensorRef>),
    /// A `ShardedTensor` (FSDP1 SHARDED/LOCAL state dicts).
    ShardedTensor(Box<ShardedTensorRecord>),
    /// A `DTensor` (FSDP2, FSDP1 with a device mesh).
    DTensor(Box<DTensorRecord>),
    /// Any other object: a class or callable applied to arguments, plus what was added to it.
    Object(Box<PyObject>),
}

/// A generic object: `callable(*args)` (`REDUCE`) or `cls.__new__(cls, *args)` (`NEWOBJ`).
#[derive(Debug, Clone, PartialEq)]
pub struct PyObject {
    /// What was called (usually a [`PyValue::Global`]).
    pub callable: PyValue,
    pub args: Vec<PyValue>,
    /// Keyword arguments of `NEWOBJ_EX`.
    pub kwargs: Vec<(PyValue, PyValue)>,
    /// The argument of `BUILD` (`__setstate__`), if any.
    pub state: Option<PyValue>,
    /// Items added with `APPEND`/`APPENDS` (list subclasses).
    pub list_items: Vec<PyValue>,
    /// Items added with `SETITEM`/`SETITEMS` (dict subclasses).
    pub dict_items: Vec<(PyValue, PyValue)>,
}

impl PyObject {
    /// The class or function name, when the callable is a global.
    pub fn class(&self) -> Option<&Global> {
        match &self.callable {
            PyValue::Global(g) => Some(g),
            _ => None,
        }
    }

    /// Looks up `name` in the object's state: a dict state, or the slot dict of a
    /// `(dict, slots)` tuple state.
    pub fn attr(&self, name: &str) -> Option<&PyValue> {
        match self.state.as_ref()? {
            PyValue::Dict(items) => dict_get(items, name),
            PyValue::Tuple(parts) => parts.iter().find_map(|p| match p {
                PyValue::Dict(items) => dict_get(items, name),
                _ => None,
            }),
            _ => None,
        }
    }
}

/// Finds the value of a string key in dict items.
pub fn dict_get<'a>(items: &'a [(PyValue, PyValue)], key: &str) -> Option<&'a PyValue> {
    items.iter().find_map(|(k, v)| match k {
        PyValue::Str(s) if s == key => Some(v),
        _ => None,
    })
}

impl PyValue {
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is one (`bool` counts, as in Python).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            PyValue::Int(i) => Some(*i),
            PyValue::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// Items of a tuple or list.
    pub fn as_seq(&self) -> Option<&[PyValue]> {
        match self {
            PyValue::Tuple(v) | PyValue::List(v) => Some(v),
            _ => None,
        }
    }

    /// A shape-like value: `torch.Size`, or a tuple/list of non-negative ints.
    pub fn as_dims(&self) -> Option<Vec<u64>> {
        match self {
            PyValue::Size(v) => Some(v.clone()),
            PyValue::Tuple(v) | PyValue::List(v) => v
                .iter()
                .map(|x| x.as_i64().and_then(|i| u64::try_from(i).ok()))
                .collect(),
            _ => None,
        }
    }

    /// Signed dims (strides may in principle be negative in other tools; torch's are not).
    pub fn as_signed_dims(&self) -> Option<Vec<i64>> {
        match self {
            PyValue::Size(v) => v.iter().map(|&x| i64::try_from(x).ok()).collect(),
            PyValue::Tuple(v) | PyValue::List(v) => v.iter().map(PyValue::as_i64).collect(),
            _ => None,
        }
    }

    /// A short description of the kind of value, for error messages.
    pub fn type_name(&self) -> String {
        match self {
            PyValue::None => "None".into(),
            PyValue::Bool(_) => "bool".into(),
            PyValue::Int(_) | PyValue::BigInt(_) => "int".into(),
            PyValue::Float(_) => "float".into(),
            PyValue::Str(_) => "str".into(),
            PyValue::Bytes(_) => "bytes".into(),
            PyValue::Tuple(_) => "tuple".into(),
            PyValue::List(_) => "list".into(),
            PyValue::Dict(_) => "dict".into(),
            PyValue::Set(_) => "set".into(),
            PyValue::Global(g) => format!("global {g}"),
            PyValue::DType(_) => "torch.dtype".into(),
            PyValue::Size(_) => "torch.Size".into(),
            PyValue::Storage(_) => "storage".into(),
            PyValue::Tensor(_) => "tensor".into(),
            PyValue::ShardedTensor(_) => "ShardedTensor".into(),
            PyValue::DTensor(_) => "DTensor".into(),
            PyValue::Object(o) => match o.class() {
                Some(g) => format!("object {g}"),
                None => "object".into(),
            },
        }
    }
}

/// A typed storage referenced by a tensor: the archive member `data/<key>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageRef {
    pub key: String,
    pub dtype: DType,
    /// Where it lived when saved (`cpu`, `cuda:0`).
    pub location: String,
    /// Number of elements of `dtype` in the storage.
    pub numel: u64,
}

/// A tensor as a view of a storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    pub storage: StorageRef,
    /// Offset of element 0 in the storage, in elements.
    pub storage_offset: u64,
    pub shape: Vec<u64>,
    pub stride: Vec<u64>,
    pub requires_grad: bool,
    /// The Python type it was rebuilt as, when not a plain tensor (`torch.nn.parameter.Parameter`).
    pub wrapper: Option<String>,
}

impl TensorRef {
    /// Number of elements of the view.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// True when the view is row-major contiguous (strides of size-1 dims do not matter).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1u64;
        for (&d, &s) in self.shape.iter().zip(&self.stride).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    /// The number of storage elements the view reaches: `offset + Σ (d-1)·stride + 1`, or 0 for an
    /// empty view. `None` on overflow.
    pub fn storage_extent(&self) -> Option<u64> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        let mut last = self.storage_offset;
        for (&d, &s) in self.shape.iter().zip(&self.stride) {
            last = last.checked_add((d - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }
}

/// One local shard of a `ShardedTensor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalShard {
    pub tensor: TensorRef,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub placement: Option<String>,
}

/// The global metadata of one shard of a `ShardedTensor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    /// `rank:0/cpu`.
    pub placement: Option<String>,
}

/// What a `ShardedTensor` pickle says (the process-group state is not needed and dropped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedTensorRecord {
    pub global_shape: Vec<u64>,
    pub dtype: DType,
    pub local_shards: Vec<LocalShard>,
    pub shards: Vec<ShardMeta>,
}

/// A DTensor placement on one mesh dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    Shard {
        dim: i64,
    },
    StridedShard {
        dim: i64,
        split_factor: i64,
    },
    Replicate,
    Partial {
        reduce_op: String,
    },
    /// A placement class this reader does not know.
    Other {
        class: String,
    },
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Shard { dim } => write!(f, "Shard(dim={dim})"),
            Placement::StridedShard { dim, split_factor } => {
                write!(f, "_StridedShard(dim={dim}, sf={split_factor})")
            }
            Placement::Replicate => f.write_str("Replicate()"),
            Placement::Partial { reduce_op } => write!(f, "Partial({reduce_op})"),
            Placement::Other { class } => write!(f, "{class}"),
        }
    }
}

/// What a `DTensor` pickle says (the device mesh's private classes are read only for its shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DTensorRecord {
    pub global_shape: Vec<u64>,
    pub dtype: DType,
    pub local: TensorRef,
    pub placements: Vec<Placement>,
    /// The mesh shape, when it could be read.
    pub mesh_shape: Option<Vec<u64>>,
    /// This rank's coordinate in the mesh, when recorded.
    pub mesh_coordinate: Option<Vec<u64>>,
}
