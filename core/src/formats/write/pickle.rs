//! A pickle *writer* (protocol 2, the protocol `torch.save` uses) for nested Python values and torch
//! tensors.
//!
//! Build a [`PyValue`] tree and call [`to_pickle`] (no tensors) or [`to_pickle_with_storages`] (tensors
//! refer to entries of a storage table by index). A tensor is written exactly as `torch.save` writes it:
//! `torch._utils._rebuild_tensor_v2(persistent_id(("storage", torch.FloatStorage, "<key>", "cpu",
//! numel)), storage_offset, size, stride, False, OrderedDict())`; dtypes without a legacy typed storage
//! class (`uint16`, `uint32`, `uint64`, `float8_*`) use `_rebuild_tensor_v3` with an
//! `torch.storage.UntypedStorage` (numel in bytes) and the dtype as last argument, as torch 2.x does.
//! Storage keys are the decimal table indices (`"0"`, `"1"`, ...), matching the `data/<key>` members of
//! the archive. Several tensors may share one storage (views).
//!
//! Generic objects for non-`torch.save` pickles (DCP `.metadata`): [`PyValue::Global`] (`GLOBAL`),
//! [`PyValue::Call`] (`callable(*args)` with `REDUCE`) and [`PyValue::Object`] (`cls.__new__(cls)` with
//! `NEWOBJ`, then `BUILD` with a state, as dataclasses pickle).

use crate::dtype::DType;

/// A Python value to pickle.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float` (IEEE double).
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `tuple`.
    Tuple(Vec<PyValue>),
    /// A `list`.
    List(Vec<PyValue>),
    /// A plain `dict`, in insertion order.
    Dict(Vec<(PyValue, PyValue)>),
    /// A `collections.OrderedDict`, in insertion order (what `nn.Module.state_dict()` returns).
    OrderedDict(Vec<(PyValue, PyValue)>),
    /// A tensor viewing a storage of the storage table.
    Tensor(TensorPickle),
    /// A module-level name, e.g. `torch.float32` is `Global { module: "torch", name: "float32" }`.
    Global {
        /// Module path, e.g. `torch.distributed.checkpoint.metadata`.
        module: String,
        /// Attribute name inside the module.
        name: String,
    },
    /// `func(*args)`.
    Call {
        /// The callable (usually a [`PyValue::Global`]).
        func: Box<PyValue>,
        /// Positional arguments.
        args: Vec<PyValue>,
    },
    /// `obj = cls.__new__(cls); obj.__setstate__(state)` (or `obj.__dict__.update(state)`).
    Object {
        /// The class (usually a [`PyValue::Global`]).
        class: Box<PyValue>,
        /// The state passed to `BUILD`.
        state: Box<PyValue>,
    },
}

impl PyValue {
    /// A `str` value.
    pub fn str(s: impl Into<String>) -> Self {
        PyValue::Str(s.into())
    }

    /// A module-level global.
    pub fn global(module: impl Into<String>, name: impl Into<String>) -> Self {
        PyValue::Global {
            module: module.into(),
            name: name.into(),
        }
    }

    /// `func(*args)` where `func` is the global `module.name`.
    pub fn call(module: &str, name: &str, args: Vec<PyValue>) -> Self {
        PyValue::Call {
            func: Box::new(PyValue::global(module, name)),
            args,
        }
    }

    /// A dataclass-like object of class `module.name` whose `__dict__` becomes `fields` (in order).
    pub fn object(module: &str, name: &str, fields: Vec<(&str, PyValue)>) -> Self {
        PyValue::Object {
            class: Box::new(PyValue::global(module, name)),
            state: Box::new(PyValue::Dict(
                fields
                    .into_iter()
                    .map(|(k, v)| (PyValue::str(k), v))
                    .collect(),
            )),
        }
    }

    /// A tuple of non-negative integers (shapes, offsets, strides).
    pub fn int_tuple(values: &[u64]) -> Self {
        PyValue::Tuple(values.iter().map(|&v| PyValue::Int(v as i64)).collect())
    }
}

/// One storage of the storage table: `numel` elements of `dtype` (written as `data/<index>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageSpec {
    /// Element type.
    pub dtype: DType,
    /// Number of elements.
    pub numel: u64,
}

/// A tensor as `torch.save` pickles it: a strided view into one storage of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPickle {
    /// Index into the storage table.
    pub storage: usize,
    /// Element type; must equal the storage's dtype.
    pub dtype: DType,
    /// Offset into the storage, in elements.
    pub storage_offset: u64,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides, in elements.
    pub stride: Vec<u64>,
}

impl TensorPickle {
    /// A contiguous tensor covering storage `storage` from element 0.
    pub fn contiguous(storage: usize, dtype: DType, shape: &[u64]) -> Self {
        Self {
            storage,
            dtype,
            storage_offset: 0,
            shape: shape.to_vec(),
            stride: crate::shape::contiguous_strides(shape),
        }
    }
}

/// Why a value cannot be pickled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickleWriteError {
    /// A global's module or name contains a newline or is empty (the `GLOBAL` opcode is line based).
    #[error("invalid global name `{module}.{name}`: must be non-empty and contain no newline")]
    BadGlobal {
        /// Module part.
        module: String,
        /// Name part.
        name: String,
    },
    /// A tensor refers to a storage index past the end of the storage table.
    #[error("tensor refers to storage {storage}, but only {storages} storages exist")]
    MissingStorage {
        /// The index used.
        storage: usize,
        /// Length of the storage table.
        storages: usize,
    },
    /// A tensor's dtype differs from its storage's dtype (torch cannot load such views).
    #[error("tensor of dtype {tensor} views storage {storage} of dtype {storage_dtype}")]
    DTypeMismatch {
        /// The storage index.
        storage: usize,
        /// The tensor's dtype.
        tensor: DType,
        /// The storage's dtype.
        storage_dtype: DType,
    },
    /// Shape and stride have different lengths.
    #[error("tensor shape {shape:?} and stride {stride:?} have different lengths")]
    StrideRank {
        /// The shape.
        shape: Vec<u64>,
        /// The stride.
        stride: Vec<u64>,
    },
    /// The view reaches past the end of its storage.
    #[error(
        "tensor view (offset {storage_offset}, shape {shape:?}, stride {stride:?}) reaches past storage {storage} of {numel} elements"
    )]
    ViewOutOfBounds {
        /// The storage index.
        storage: usize,
        /// Elements in the storage.
        numel: u64,
        /// The view's offset.
        storage_offset: u64,
        /// The view's shape.
        shape: Vec<u64>,
        /// The view's stride.
        stride: Vec<u64>,
    },
    /// An integer does not fit the pickle (never happens for values below 2^63).
    #[error("value {value} is too large to pickle as an int")]
    IntTooLarge {
        /// The value.
        value: u64,
    },
}

/// A reader-side value ([`crate::formats::pickle::PyValue`]) that has no writer-side form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot write back a {kind} read from a pickle (only None, bool, int, float, str, tuple, list, dict, torch.Size and torch dtypes are written)"
)]
pub struct FromReadValueError {
    /// The reader's type name of the value (`tensor`, `bytes`, `object`, ...).
    pub kind: String,
}

impl PyValue {
    /// The writer-side form of a value the pickle *reader* produced (a DCP bytes item, a scalar of a
    /// `torch.save` file), so that a value read from one checkpoint can be written into another with
    /// its Python type kept: tuples stay tuples, `torch.Size` stays `torch.Size`, dtypes stay
    /// `torch.<dtype>` globals. The reader keeps `dict` and `OrderedDict` alike, so both come back as a
    /// plain `dict`. Tensors, raw bytes, big ints, sets and generic objects are refused: they need a
    /// storage table or globals that `torch.load(weights_only=True)` rejects.
    pub fn from_read_value(
        value: &crate::formats::pickle::PyValue,
    ) -> Result<Self, FromReadValueError> {
        use crate::formats::pickle::PyValue as R;
        let list = |items: &[R]| {
            items
                .iter()
                .map(Self::from_read_value)
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(match value {
            R::None => PyValue::None,
            R::Bool(b) => PyValue::Bool(*b),
            R::Int(i) => PyValue::Int(*i),
            R::Float(f) => PyValue::Float(*f),
            R::Str(s) => PyValue::Str(s.clone()),
            R::Tuple(items) => PyValue::Tuple(list(items)?),
            R::List(items) => PyValue::List(list(items)?),
            R::Dict(items) => PyValue::Dict(
                items
                    .iter()
                    .map(|(k, v)| Ok((Self::from_read_value(k)?, Self::from_read_value(v)?)))
                    .collect::<Result<Vec<_>, FromReadValueError>>()?,
            ),
            R::DType(d) => PyValue::global("torch", d.name()),
            R::Size(dims) => PyValue::call("torch", "Size", vec![PyValue::int_tuple(dims)]),
            other => {
                return Err(FromReadValueError {
                    kind: other.type_name(),
                });
            }
        })
    }
}

// Protocol-2 opcodes used here (pickletools names).
const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const GLOBAL: u8 = b'c';
const REDUCE: u8 = b'R';
const NEWOBJ: u8 = 0x81;
const BUILD: u8 = b'b';
const BINPERSID: u8 = b'Q';

/// Python's pickler batches `APPENDS`/`SETITEMS` by this many items; we do the same.
const BATCH: usize = 1000;

/// Pickles `value` (protocol 2). Fails on a [`PyValue::Tensor`], which needs a storage table.
pub fn to_pickle(value: &PyValue) -> Result<Vec<u8>, PickleWriteError> {
    to_pickle_with_storages(value, &[])
}

/// Pickles `value` (protocol 2); tensors refer to `storages` by index, and each view is checked to lie
/// inside its storage.
pub fn to_pickle_with_storages(
    value: &PyValue,
    storages: &[StorageSpec],
) -> Result<Vec<u8>, PickleWriteError> {
    let mut out = vec![PROTO, 2];
    let mut pickler = Pickler {
        out: &mut out,
        storages,
    };
    pickler.value(value)?;
    out.push(STOP);
    Ok(out)
}

/// The name of the legacy typed storage class torch 2.x pickles for `dtype`, or `None` when torch
/// writes an `UntypedStorage` with `_rebuild_tensor_v3` instead.
pub fn typed_storage_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "BoolStorage",
        DType::UInt8 => "ByteStorage",
        DType::Int8 => "CharStorage",
        DType::Int16 => "ShortStorage",
        DType::Int32 => "IntStorage",
        DType::Int64 => "LongStorage",
        DType::Float16 => "HalfStorage",
        DType::BFloat16 => "BFloat16Storage",
        DType::Float32 => "FloatStorage",
        DType::Float64 => "DoubleStorage",
        DType::Complex64 => "ComplexFloatStorage",
        DType::Complex128 => "ComplexDoubleStorage",
        DType::Complex32
        | DType::UInt16
        | DType::UInt32
        | DType::UInt64
        | DType::Float8E4M3Fn
        | DType::Float8E5M2
        | DType::Float8E4M3Fnuz
        | DType::Float8E5M2Fnuz
        | DType::Float8E8M0Fnu => {
            return None;
        }
    })
}

struct Pickler<'a> {
    out: &'a mut Vec<u8>,
    storages: &'a [StorageSpec],
}

impl Pickler<'_> {
    fn value(&mut self, value: &PyValue) -> Result<(), PickleWriteError> {
        match value {
            PyValue::None => self.out.push(NONE),
            PyValue::Bool(b) => self.out.push(if *b { NEWTRUE } else { NEWFALSE }),
            PyValue::Int(i) => self.int(*i),
            PyValue::Float(f) => {
                self.out.push(BINFLOAT);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            PyValue::Str(s) => self.string(s),
            PyValue::Tuple(items) => self.tuple(items)?,
            PyValue::List(items) => {
                self.out.push(EMPTY_LIST);
                for batch in items.chunks(BATCH) {
                    self.out.push(MARK);
                    for item in batch {
                        self.value(item)?;
                    }
                    self.out.push(APPENDS);
                }
            }
            PyValue::Dict(items) => {
                self.out.push(EMPTY_DICT);
                self.setitems(items)?;
            }
            PyValue::OrderedDict(items) => {
                self.global("collections", "OrderedDict")?;
                self.out.extend_from_slice(&[EMPTY_TUPLE, REDUCE]);
                self.setitems(items)?;
            }
            PyValue::Tensor(tensor) => self.tensor(tensor)?,
            PyValue::Global { module, name } => self.global(module, name)?,
            PyValue::Call { func, args } => {
                self.value(func)?;
                self.tuple(args)?;
                self.out.push(REDUCE);
            }
            PyValue::Object { class, state } => {
                self.value(class)?;
                self.out.extend_from_slice(&[EMPTY_TUPLE, NEWOBJ]);
                self.value(state)?;
                self.out.push(BUILD);
            }
        }
        Ok(())
    }

    fn int(&mut self, i: i64) {
        if let Ok(small) = u8::try_from(i) {
            self.out.extend_from_slice(&[BININT1, small]);
        } else if let Ok(medium) = u16::try_from(i) {
            self.out.push(BININT2);
            self.out.extend_from_slice(&medium.to_le_bytes());
        } else if let Ok(word) = i32::try_from(i) {
            self.out.push(BININT);
            self.out.extend_from_slice(&word.to_le_bytes());
        } else {
            // LONG1: minimal little-endian two's complement.
            let bytes = i.to_le_bytes();
            let mut len = 8;
            while len > 1 {
                let top = bytes[len - 1];
                let next_sign = bytes[len - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    len -= 1;
                } else {
                    break;
                }
            }
            self.out.extend_from_slice(&[LONG1, len as u8]);
            self.out.extend_from_slice(&bytes[..len]);
        }
    }

    fn uint(&mut self, value: u64) -> Result<(), PickleWriteError> {
        let i = i64::try_from(value).map_err(|_| PickleWriteError::IntTooLarge { value })?;
        self.int(i);
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push(BINUNICODE);
        // A str longer than 4 GiB cannot occur in our metadata; saturating keeps this panic-free.
        let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
        self.out.extend_from_slice(&len.to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn tuple(&mut self, items: &[PyValue]) -> Result<(), PickleWriteError> {
        match items {
            [] => self.out.push(EMPTY_TUPLE),
            [a] => {
                self.value(a)?;
                self.out.push(TUPLE1);
            }
            [a, b] => {
                self.value(a)?;
                self.value(b)?;
                self.out.push(TUPLE2);
            }
            [a, b, c] => {
                self.value(a)?;
                self.value(b)?;
                self.value(c)?;
                self.out.push(TUPLE3);
            }
            _ => {
                self.out.push(MARK);
                for item in items {
                    self.value(item)?;
                }
                self.out.push(TUPLE);
            }
        }
        Ok(())
    }

    fn uint_tuple(&mut self, values: &[u64]) -> Result<(), PickleWriteError> {
        let items = values
            .iter()
            .map(|&v| {
                i64::try_from(v)
                    .map(PyValue::Int)
                    .map_err(|_| PickleWriteError::IntTooLarge { value: v })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.tuple(&items)
    }

    fn setitems(&mut self, items: &[(PyValue, PyValue)]) -> Result<(), PickleWriteError> {
        for batch in items.chunks(BATCH) {
            self.out.push(MARK);
            for (k, v) in batch {
                self.value(k)?;
                self.value(v)?;
            }
            self.out.push(SETITEMS);
        }
        Ok(())
    }

    fn global(&mut self, module: &str, name: &str) -> Result<(), PickleWriteError> {
        if module.is_empty() || name.is_empty() || module.contains('\n') || name.contains('\n') {
            return Err(PickleWriteError::BadGlobal {
                module: module.to_owned(),
                name: name.to_owned(),
            });
        }
        self.out.push(GLOBAL);
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        Ok(())
    }

    fn tensor(&mut self, tensor: &TensorPickle) -> Result<(), PickleWriteError> {
        let spec = check_view(tensor, self.storages)?;
        let typed = typed_storage_name(spec.dtype);
        let rebuild = if typed.is_some() {
            "_rebuild_tensor_v2"
        } else {
            "_rebuild_tensor_v3"
        };
        self.global("torch._utils", rebuild)?;
        self.out.push(MARK);
        // persistent id: ("storage", storage_type, key, location, numel)
        self.out.push(MARK);
        self.string("storage");
        let storage_numel = if let Some(class) = typed {
            self.global("torch", class)?;
            spec.numel
        } else {
            self.global("torch.storage", "UntypedStorage")?;
            spec.numel.saturating_mul(spec.dtype.size_bytes() as u64)
        };
        self.string(&tensor.storage.to_string());
        self.string("cpu");
        self.uint(storage_numel)?;
        self.out.extend_from_slice(&[TUPLE, BINPERSID]);
        self.uint(tensor.storage_offset)?;
        self.uint_tuple(&tensor.shape)?;
        self.uint_tuple(&tensor.stride)?;
        self.out.push(NEWFALSE); // requires_grad
        self.global("collections", "OrderedDict")?; // backward hooks
        self.out.extend_from_slice(&[EMPTY_TUPLE, REDUCE]);
        if typed.is_none() {
            self.global("torch", spec.dtype.name())?;
        }
        self.out.extend_from_slice(&[TUPLE, REDUCE]);
        Ok(())
    }
}

/// Checks that `tensor` is a view torch can rebuild from `storages`; returns its storage.
fn check_view(
    tensor: &TensorPickle,
    storages: &[StorageSpec],
) -> Result<StorageSpec, PickleWriteError> {
    let spec = *storages
        .get(tensor.storage)
        .ok_or(PickleWriteError::MissingStorage {
            storage: tensor.storage,
            storages: storages.len(),
        })?;
    if spec.dtype != tensor.dtype {
        return Err(PickleWriteError::DTypeMismatch {
            storage: tensor.storage,
            tensor: tensor.dtype,
            storage_dtype: spec.dtype,
        });
    }
    if tensor.shape.len() != tensor.stride.len() {
        return Err(PickleWriteError::StrideRank {
            shape: tensor.shape.clone(),
            stride: tensor.stride.clone(),
        });
    }
    let out_of_bounds = || PickleWriteError::ViewOutOfBounds {
        storage: tensor.storage,
        numel: spec.numel,
        storage_offset: tensor.storage_offset,
        shape: tensor.shape.clone(),
        stride: tensor.stride.clone(),
    };
    if tensor.shape.contains(&0) {
        // An empty view touches no element; torch only requires the offset to be within bounds.
        return if tensor.storage_offset <= spec.numel {
            Ok(spec)
        } else {
            Err(out_of_bounds())
        };
    }
    // Last element touched: offset + sum((size - 1) * stride); it must be < numel.
    let last = tensor
        .shape
        .iter()
        .zip(&tensor.stride)
        .try_fold(tensor.storage_offset, |acc, (&size, &stride)| {
            (size - 1)
                .checked_mul(stride)
                .and_then(|span| acc.checked_add(span))
        })
        .ok_or_else(out_of_bounds)?;
    if last < spec.numel {
        Ok(spec)
    } else {
        Err(out_of_bounds())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes Python 3.11 writes for `pickle.dumps(v, protocol=2).hex()` of scalars (which Python does
    /// not memoize, so the bytes must match exactly); each expected string was printed by Python.
    #[test]
    fn matches_python_pickle_for_scalars() {
        let cases: [(PyValue, &str); 17] = [
            (PyValue::Int(1), "80024b012e"),
            (PyValue::Int(300), "80024d2c012e"),
            (PyValue::Int(70000), "80024a701101002e"),
            (PyValue::Int(-1), "80024affffffff2e"),
            (PyValue::Int(1 << 40), "80028a060000000000012e"),
            (PyValue::Int(-(1 << 40)), "80028a060000000000ff2e"),
            (PyValue::Int(i64::MAX), "80028a08ffffffffffffff7f2e"),
            (PyValue::Int(i64::MIN), "80028a0800000000000000802e"),
            (PyValue::Int(255), "80024bff2e"),
            (PyValue::Int(256), "80024d00012e"),
            (PyValue::Int(65536), "80024a000001002e"),
            (PyValue::Int(-2_147_483_648), "80024a000000802e"),
            (PyValue::Float(0.1), "8002473fb999999999999a2e"),
            (PyValue::Bool(true), "8002882e"),
            (PyValue::None, "80024e2e"),
            (PyValue::Tuple(vec![]), "8002292e"),
            // Python memoizes the tuple (`q\x00` after `t`); we write no memo, the rest is identical.
            (
                PyValue::int_tuple(&[1, 2, 3, 4]),
                "8002284b014b024b034b04742e",
            ),
        ];
        for (value, expected) in cases {
            assert_eq!(hex(&to_pickle(&value).unwrap()), expected, "{value:?}");
        }
    }

    fn hex(bytes: &[u8]) -> String {
        use std::fmt::Write as _;
        bytes.iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    #[test]
    fn rejects_views_outside_their_storage() {
        let storages = [StorageSpec {
            dtype: DType::Float32,
            numel: 6,
        }];
        let ok = TensorPickle {
            storage: 0,
            dtype: DType::Float32,
            storage_offset: 2,
            shape: vec![2, 2],
            stride: vec![2, 1],
        };
        assert!(to_pickle_with_storages(&PyValue::Tensor(ok.clone()), &storages).is_ok());
        let too_far = TensorPickle {
            storage_offset: 3,
            ..ok.clone()
        };
        assert!(matches!(
            to_pickle_with_storages(&PyValue::Tensor(too_far), &storages),
            Err(PickleWriteError::ViewOutOfBounds { .. })
        ));
        let wrong_dtype = TensorPickle {
            dtype: DType::Int32,
            ..ok.clone()
        };
        assert!(matches!(
            to_pickle_with_storages(&PyValue::Tensor(wrong_dtype), &storages),
            Err(PickleWriteError::DTypeMismatch { .. })
        ));
        assert!(matches!(
            to_pickle(&PyValue::Tensor(ok)),
            Err(PickleWriteError::MissingStorage { .. })
        ));
        assert!(matches!(
            to_pickle(&PyValue::global("torch", "a\nb")),
            Err(PickleWriteError::BadGlobal { .. })
        ));
    }

    /// A value read by the pickle reader comes back unchanged through `from_read_value`, writing and
    /// reading again (tuples stay tuples, torch.Size and dtypes keep their types); tensors are refused.
    #[test]
    fn read_values_round_trip_through_the_writer() {
        use crate::formats::pickle::{self as reader, PyValue as R};
        let value = R::Dict(vec![
            (R::Str("lr".into()), R::Float(0.01)),
            (
                R::Str("betas".into()),
                R::Tuple(vec![R::Float(0.8), R::Float(0.95)]),
            ),
            (
                R::Str("params".into()),
                R::List(vec![R::Int(0), R::Int(-3)]),
            ),
            (
                R::Str("flags".into()),
                R::Tuple(vec![R::Bool(true), R::None]),
            ),
            (R::Str("size".into()), R::Size(vec![2, 3])),
            (R::Str("dtype".into()), R::DType(DType::BFloat16)),
        ]);
        let written = PyValue::from_read_value(&value).unwrap();
        let again = reader::parse(&to_pickle(&written).unwrap()).unwrap();
        assert_eq!(again, value);
        assert!(PyValue::from_read_value(&R::Bytes(vec![1])).is_err());
    }
}
