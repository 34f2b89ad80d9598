//! Non-tensor entries as the Python values the pickling writers (`torch.save`, DCP bytes items)
//! write.

use anyhow::{Context, Result};
use shardscope_core::formats::pickle::PyValue as ReadValue;
use shardscope_core::formats::write::pickle::{FromReadValueError, PyValue};
use shardscope_core::index::{EntryKind, IndexEntry, latin1_bytes};

use super::reader::Reader;

/// A JSON value (a scalar of a `torch.save` file, decoded by the index) as a Python value.
fn py_from_json(v: &serde_json::Value) -> PyValue {
    use serde_json::Value as J;
    match v {
        J::Null => PyValue::None,
        J::Bool(b) => PyValue::Bool(*b),
        J::Number(n) => n.as_i64().map_or_else(
            || PyValue::Float(n.as_f64().unwrap_or(f64::NAN)),
            PyValue::Int,
        ),
        J::String(s) => PyValue::Str(s.clone()),
        J::Array(items) => PyValue::List(items.iter().map(py_from_json).collect()),
        J::Object(items) => PyValue::Dict(
            items
                .iter()
                .map(|(k, v)| (PyValue::Str(k.clone()), py_from_json(v)))
                .collect(),
        ),
    }
}

/// `bytes` as Python 3 pickles them at protocol 2 (`torch.save`'s): `_codecs.encode(text,
/// "latin1")`, which `torch.load(weights_only=True)` allows (also for empty bytes, where Python
/// itself writes `bytes()`, which it refuses).
fn py_bytes(b: &[u8]) -> PyValue {
    PyValue::call(
        "_codecs",
        "encode",
        vec![
            PyValue::Str(b.iter().map(|&x| char::from(x)).collect()),
            PyValue::Str("latin1".to_owned()),
        ],
    )
}

/// [`PyValue::from_read_value`], with `bytes` kept (a raw item, a bytes value of a `torch.save`
/// file: read as bytes or as the `_codecs.encode` call that stores them).
fn py_from_read(v: &ReadValue) -> Result<PyValue, FromReadValueError> {
    let list = |items: &[ReadValue]| {
        items
            .iter()
            .map(py_from_read)
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(match v {
        ReadValue::Bytes(b) => py_bytes(b),
        ReadValue::Object(o) if latin1_bytes(o).is_some() => {
            py_bytes(&latin1_bytes(o).unwrap_or_default())
        }
        ReadValue::Tuple(items) => PyValue::Tuple(list(items)?),
        ReadValue::List(items) => PyValue::List(list(items)?),
        ReadValue::Dict(items) => PyValue::Dict(
            items
                .iter()
                .map(|(k, v)| Ok((py_from_read(k)?, py_from_read(v)?)))
                .collect::<Result<Vec<_>, FromReadValueError>>()?,
        ),
        other => PyValue::from_read_value(other)?,
    })
}

/// The Python value of a non-tensor entry: the exact object for DCP bytes items and for scalars of
/// `torch.save` files (tuples kept); the decoded JSON for values the index rewrote or that cannot be
/// pickled for `weights_only` loads.
pub(super) fn py_value_of(reader: &Reader<'_>, e: &IndexEntry) -> Result<PyValue> {
    if e.kind == EntryKind::Bytes {
        let read = reader.index().read_bytes_object(reader.source(), e)?;
        return py_from_read(&read).with_context(|| e.key.clone());
    }
    if let Some(object) = &e.object
        && let Ok(v) = py_from_read(object)
    {
        return Ok(v);
    }
    Ok(py_from_json(
        e.value.as_ref().unwrap_or(&serde_json::Value::Null),
    ))
}
