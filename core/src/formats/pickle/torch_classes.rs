//! torch's classes turned into typed records: tensors as storage views, typed storages, `torch.Size`,
//! dtypes, `ShardedTensor`, `DTensor`.

use super::limits::PickleError;
use super::value::{
    DTensorRecord, Global, LocalShard, Placement, PyObject, PyValue, ShardMeta,
    ShardedTensorRecord, StorageRef, TensorRef, dict_get,
};
use crate::dtype::DType;

pub(super) fn global_value(g: &Global) -> PyValue {
    if g.module == "torch"
        && let Ok(dtype) = g.name.parse::<DType>()
        && !g.name.contains("Storage")
    {
        return PyValue::DType(dtype);
    }
    PyValue::Global(Box::new(g.clone()))
}

/// The dtype of a typed storage class name (`FloatStorage` -> float32).
pub fn dtype_of_storage_class(name: &str) -> Option<DType> {
    Some(match name {
        "FloatStorage" => DType::Float32,
        "DoubleStorage" => DType::Float64,
        "HalfStorage" => DType::Float16,
        "BFloat16Storage" => DType::BFloat16,
        "LongStorage" => DType::Int64,
        "IntStorage" => DType::Int32,
        "ShortStorage" => DType::Int16,
        "CharStorage" => DType::Int8,
        "ByteStorage" | "UntypedStorage" => DType::UInt8,
        "BoolStorage" => DType::Bool,
        "ComplexFloatStorage" => DType::Complex64,
        "ComplexDoubleStorage" => DType::Complex128,
        "Float8_e4m3fnStorage" => DType::Float8E4M3Fn,
        "Float8_e5m2Storage" => DType::Float8E5M2,
        "UInt16Storage" => DType::UInt16,
        "UInt32Storage" => DType::UInt32,
        "UInt64Storage" => DType::UInt64,
        _ => return None,
    })
}

pub(super) fn storage_from_pid(pid: &PyValue) -> Result<PyValue, PickleError> {
    const CLASS: &str = "persistent storage id";
    let items = pid.as_seq().ok_or_else(|| {
        bad(
            CLASS,
            format!("expected a tuple, found {}", pid.type_name()),
        )
    })?;
    if items.first().and_then(PyValue::as_str) != Some("storage") || items.len() < 5 {
        return Err(bad(
            CLASS,
            "expected (\"storage\", type, key, location, numel)",
        ));
    }
    let dtype = match &items[1] {
        PyValue::Global(g) if g.module == "torch" || g.module == "torch.storage" => {
            dtype_of_storage_class(&g.name)
                .ok_or_else(|| bad(CLASS, format!("unknown storage type {g}")))?
        }
        PyValue::DType(d) => *d,
        other => {
            return Err(bad(
                CLASS,
                format!("unknown storage type {}", other.type_name()),
            ));
        }
    };
    let key = items[2]
        .as_str()
        .ok_or_else(|| bad(CLASS, "storage key is not a string"))?
        .to_owned();
    let location = items[3].as_str().unwrap_or("").to_owned();
    let numel = items[4]
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| bad(CLASS, "storage size is not a non-negative int"))?;
    Ok(PyValue::Storage(Box::new(StorageRef {
        key,
        dtype,
        location,
        numel,
    })))
}

pub(super) fn recognise(obj: PyObject) -> Result<PyValue, PickleError> {
    let Some(class) = obj.class().cloned() else {
        return Ok(PyValue::Object(Box::new(obj)));
    };
    // `state_dict()` returns an OrderedDict with a `_metadata` attribute (set by BUILD): the
    // attribute only holds module versions and is dropped.
    if class.is("collections", "OrderedDict") && obj.args.is_empty() {
        return Ok(PyValue::Dict(obj.dict_items));
    }
    if class.is("torch", "Size") {
        let dims = obj
            .args
            .first()
            .and_then(PyValue::as_dims)
            .ok_or_else(|| bad("torch.Size", "expected a tuple of non-negative ints"))?;
        return Ok(PyValue::Size(dims));
    }
    if class.module == "torch._utils" {
        match class.name.as_str() {
            "_rebuild_tensor_v2" | "_rebuild_tensor" | "_rebuild_tensor_v3" => {
                return Ok(PyValue::Tensor(Box::new(tensor_from_args(
                    &class.name,
                    &obj.args,
                )?)));
            }
            "_rebuild_parameter" | "_rebuild_parameter_with_state" => {
                let Some(PyValue::Tensor(t)) = obj.args.first() else {
                    return Err(bad(&class.name, "first argument is not a tensor"));
                };
                let mut t = t.clone();
                t.requires_grad = obj.args.get(1).and_then(PyValue::as_i64) == Some(1);
                t.wrapper = Some("torch.nn.parameter.Parameter".into());
                return Ok(PyValue::Tensor(t));
            }
            _ => {}
        }
    }
    if class.is("torch._tensor", "_rebuild_from_type_v2") {
        return rebuild_from_type(obj);
    }
    Ok(PyValue::Object(Box::new(obj)))
}

fn tensor_from_args(name: &str, args: &[PyValue]) -> Result<TensorRef, PickleError> {
    if args.len() < 4 {
        return Err(bad(
            name,
            format!("expected at least 4 arguments, found {}", args.len()),
        ));
    }
    let PyValue::Storage(storage) = &args[0] else {
        return Err(bad(
            name,
            format!("argument 0 is a {}, not a storage", args[0].type_name()),
        ));
    };
    let storage_offset = args[1]
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| bad(name, "storage offset is not a non-negative int"))?;
    let shape = args[2]
        .as_dims()
        .ok_or_else(|| bad(name, "size is not a tuple of non-negative ints"))?;
    let stride = args[3]
        .as_dims()
        .ok_or_else(|| bad(name, "stride is not a tuple of non-negative ints"))?;
    if shape.len() != stride.len() {
        return Err(bad(
            name,
            format!(
                "size has {} dims but stride has {}",
                shape.len(),
                stride.len()
            ),
        ));
    }
    let requires_grad = args.get(4).and_then(PyValue::as_i64) == Some(1);
    let mut storage = (**storage).clone();
    if name == "_rebuild_tensor_v3" {
        // `_rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype)`: torch
        // writes dtypes without a typed storage class (float8, uint16/32/64, ...) as an
        // `UntypedStorage` (sized in bytes) and names the dtype here.
        let dtype = match args.get(6) {
            Some(PyValue::DType(d)) => *d,
            Some(PyValue::Global(g)) => {
                return Err(bad(name, format!("unknown dtype {g}")));
            }
            Some(other) => {
                return Err(bad(
                    name,
                    format!("argument 6 is a {}, not a dtype", other.type_name()),
                ));
            }
            None => return Err(bad(name, "no dtype argument (expected 7 arguments)")),
        };
        if storage.dtype != DType::UInt8 && storage.dtype != dtype {
            return Err(bad(
                name,
                format!(
                    "a {} storage rebuilt as {dtype}: expected an UntypedStorage",
                    storage.dtype
                ),
            ));
        }
        if storage.dtype != dtype {
            // Bytes past the last whole element are ignored, as torch's `set_` does.
            storage.numel /= dtype.size_bytes() as u64;
            storage.dtype = dtype;
        }
    }
    Ok(TensorRef {
        storage,
        storage_offset,
        shape,
        stride,
        requires_grad,
        wrapper: None,
    })
}

/// `_rebuild_from_type_v2(func, new_type, args, state)`.
fn rebuild_from_type(obj: PyObject) -> Result<PyValue, PickleError> {
    const NAME: &str = "_rebuild_from_type_v2";
    let mut args = obj.args.into_iter();
    let (Some(func), Some(new_type), Some(inner_args)) = (args.next(), args.next(), args.next())
    else {
        return Err(bad(NAME, "expected (func, new_type, args, state)"));
    };
    let state = args.next().unwrap_or(PyValue::None);
    let type_name = match &new_type {
        PyValue::Global(g) => g.to_string(),
        other => other.type_name(),
    };
    let inner = inner_args.as_seq().unwrap_or(&[]).to_vec();
    match &func {
        PyValue::Global(g) if g.is("torch._utils", "_rebuild_wrapper_subclass") => {
            if type_name.ends_with(".ShardedTensor") {
                return Ok(PyValue::ShardedTensor(Box::new(sharded_tensor(
                    &inner, &state,
                )?)));
            }
            if type_name.ends_with(".DTensor") {
                return Ok(PyValue::DTensor(Box::new(dtensor(&inner, &state)?)));
            }
        }
        _ => {}
    }
    // A plain tensor (or Parameter) re-typed: the value is whatever `func(*args)` built.
    if let PyValue::Global(g) = &func
        && let Ok(PyValue::Tensor(mut t)) = recognise(PyObject {
            callable: PyValue::Global(g.clone()),
            args: inner.clone(),
            kwargs: Vec::new(),
            state: None,
            list_items: Vec::new(),
            dict_items: Vec::new(),
        })
    {
        if type_name != "torch._tensor.Tensor" && type_name != "torch.Tensor" {
            t.wrapper = Some(type_name);
        }
        return Ok(PyValue::Tensor(t));
    }
    Ok(PyValue::Object(Box::new(PyObject {
        callable: PyValue::Global(Box::new(Global {
            module: "torch._tensor".into(),
            name: NAME.into(),
        })),
        args: vec![func, new_type, PyValue::Tuple(inner), state],
        kwargs: Vec::new(),
        state: None,
        list_items: Vec::new(),
        dict_items: Vec::new(),
    })))
}

/// The wrapper-subclass arguments `(cls, dtype, size, stride, storage_offset, layout, device, rg)`.
fn wrapper_dtype_and_size(
    class: &str,
    inner: &[PyValue],
) -> Result<(DType, Vec<u64>), PickleError> {
    let dtype = match inner.get(1) {
        Some(PyValue::DType(d)) => *d,
        _ => return Err(bad(class, "no dtype in the wrapper arguments")),
    };
    let size = inner
        .get(2)
        .and_then(PyValue::as_dims)
        .ok_or_else(|| bad(class, "no size in the wrapper arguments"))?;
    Ok((dtype, size))
}

fn obj_attr<'a>(v: &'a PyValue, name: &str) -> Option<&'a PyValue> {
    match v {
        PyValue::Object(o) => o.attr(name),
        PyValue::Dict(items) => dict_get(items, name),
        _ => None,
    }
}

fn placement_string(v: &PyValue) -> Option<String> {
    // `_remote_device` state: {_worker_name, _rank, _device: torch.device('cpu')}.
    let rank = obj_attr(v, "_rank").and_then(PyValue::as_i64)?;
    let device = match obj_attr(v, "_device") {
        Some(PyValue::Object(o)) => o
            .args
            .first()
            .and_then(PyValue::as_str)
            .unwrap_or("")
            .to_owned(),
        Some(PyValue::Str(s)) => s.clone(),
        _ => String::new(),
    };
    Some(format!("rank:{rank}/{device}"))
}

fn shard_meta(v: &PyValue) -> Result<ShardMeta, PickleError> {
    const CLASS: &str = "ShardMetadata";
    let offsets = obj_attr(v, "shard_offsets")
        .and_then(PyValue::as_dims)
        .ok_or_else(|| bad(CLASS, "no shard_offsets"))?;
    let sizes = obj_attr(v, "shard_sizes")
        .and_then(PyValue::as_dims)
        .ok_or_else(|| bad(CLASS, "no shard_sizes"))?;
    if offsets.len() != sizes.len() {
        return Err(bad(CLASS, "shard_offsets and shard_sizes differ in length"));
    }
    Ok(ShardMeta {
        offsets,
        sizes,
        placement: obj_attr(v, "placement").and_then(placement_string),
    })
}

fn sharded_tensor(inner: &[PyValue], state: &PyValue) -> Result<ShardedTensorRecord, PickleError> {
    const CLASS: &str = "ShardedTensor";
    let (dtype, size) = wrapper_dtype_and_size(CLASS, inner)?;
    // state = (local_shards, metadata, pg_state, sharding_spec, init_rrefs)
    let parts = state
        .as_seq()
        .ok_or_else(|| bad(CLASS, "state is not a tuple"))?;
    let local = parts
        .first()
        .and_then(PyValue::as_seq)
        .ok_or_else(|| bad(CLASS, "no local shard list"))?;
    let mut local_shards = Vec::with_capacity(local.len());
    for shard in local {
        let Some(PyValue::Tensor(t)) = obj_attr(shard, "tensor") else {
            return Err(bad(CLASS, "a local shard has no tensor"));
        };
        let meta = shard_meta(
            obj_attr(shard, "metadata")
                .ok_or_else(|| bad(CLASS, "a local shard has no metadata"))?,
        )?;
        local_shards.push(LocalShard {
            tensor: (**t).clone(),
            offsets: meta.offsets,
            sizes: meta.sizes,
            placement: meta.placement,
        });
    }
    let metadata = parts.get(1).ok_or_else(|| bad(CLASS, "no metadata"))?;
    let global_shape = match obj_attr(metadata, "size").and_then(PyValue::as_dims) {
        Some(s) => s,
        None => size,
    };
    let shards = obj_attr(metadata, "shards_metadata")
        .and_then(PyValue::as_seq)
        .ok_or_else(|| bad(CLASS, "no shards_metadata"))?
        .iter()
        .map(shard_meta)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ShardedTensorRecord {
        global_shape,
        dtype,
        local_shards,
        shards,
    })
}

pub(super) fn placement(v: &PyValue) -> Placement {
    let PyValue::Object(o) = v else {
        return Placement::Other {
            class: v.type_name(),
        };
    };
    let class = o.class().map(|g| g.name.clone()).unwrap_or_default();
    let dim = o.attr("dim").and_then(PyValue::as_i64).unwrap_or(0);
    match class.as_str() {
        "Shard" => Placement::Shard { dim },
        "_StridedShard" => Placement::StridedShard {
            dim,
            split_factor: o
                .attr("split_factor")
                .and_then(PyValue::as_i64)
                .unwrap_or(1),
        },
        "Replicate" => Placement::Replicate,
        "Partial" | "_Partial" => Placement::Partial {
            reduce_op: o
                .attr("reduce_op")
                .and_then(PyValue::as_str)
                .unwrap_or("sum")
                .to_owned(),
        },
        _ => Placement::Other {
            class: o.class().map(ToString::to_string).unwrap_or(class),
        },
    }
}

pub(super) fn mesh_shape(mesh: &PyValue) -> Option<Vec<u64>> {
    // torch >= 2.9: `_layout` (a _MeshLayout whose `axes` is a _FlatLayout with `shape`).
    if let Some(layout) = obj_attr(mesh, "_layout") {
        if let Some(axes) = obj_attr(layout, "axes") {
            if let Some(shape) = obj_attr(axes, "shape").and_then(PyValue::as_dims) {
                return Some(shape);
            }
            // A tuple of per-dimension flat layouts: concatenate their shapes.
            if let Some(parts) = axes.as_seq() {
                let mut shape = Vec::new();
                for p in parts {
                    shape.extend(obj_attr(p, "shape").and_then(PyValue::as_dims)?);
                }
                return Some(shape);
            }
        }
        if let Some(shape) = obj_attr(layout, "shape").and_then(PyValue::as_dims) {
            return Some(shape);
        }
    }
    // Older releases: the `mesh` tensor itself.
    match obj_attr(mesh, "mesh") {
        Some(PyValue::Tensor(t)) => Some(t.shape.clone()),
        _ => None,
    }
}

fn dtensor(inner: &[PyValue], state: &PyValue) -> Result<DTensorRecord, PickleError> {
    const CLASS: &str = "DTensor";
    let (dtype, size) = wrapper_dtype_and_size(CLASS, inner)?;
    let Some(PyValue::Tensor(local)) = obj_attr_state(state, "_local_tensor") else {
        return Err(bad(CLASS, "no _local_tensor"));
    };
    let spec = obj_attr_state(state, "_spec").ok_or_else(|| bad(CLASS, "no _spec"))?;
    let placements = obj_attr(spec, "placements")
        .and_then(PyValue::as_seq)
        .ok_or_else(|| bad(CLASS, "no placements in the spec"))?
        .iter()
        .map(placement)
        .collect();
    let mesh = obj_attr(spec, "mesh");
    let global_shape = match obj_attr(spec, "tensor_meta") {
        Some(PyValue::Object(tm)) => tm.args.first().and_then(PyValue::as_dims).unwrap_or(size),
        _ => size,
    };
    Ok(DTensorRecord {
        global_shape,
        dtype,
        local: (**local).clone(),
        placements,
        mesh_shape: mesh.and_then(mesh_shape),
        mesh_coordinate: mesh
            .and_then(|m| obj_attr(m, "_coordinate_on_dim"))
            .and_then(PyValue::as_dims),
    })
}

/// DTensor state is `(None, {slots})` or a plain dict.
fn obj_attr_state<'a>(state: &'a PyValue, name: &str) -> Option<&'a PyValue> {
    match state {
        PyValue::Dict(items) => dict_get(items, name),
        PyValue::Tuple(parts) => parts.iter().find_map(|p| match p {
            PyValue::Dict(items) => dict_get(items, name),
            _ => None,
        }),
        _ => None,
    }
}

fn bad(class: &str, what: impl Into<String>) -> PickleError {
    PickleError::BadRecord {
        class: class.to_owned(),
        what: what.into(),
    }
}
