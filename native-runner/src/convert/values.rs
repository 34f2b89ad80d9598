//! Non-tensor entries as the Python values the pickling writers (`torch.save`, DCP bytes items)
//! write.

use anyhow::{Context, Result};
use shardscope_core::formats::write::pickle::PyValue;
use shardscope_core::index::{EntryKind, IndexEntry};

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

/// The Python value of a non-tensor entry: the exact object for DCP bytes items and for scalars of
/// `torch.save` files (tuples kept); the decoded JSON for values the index rewrote or that cannot be
/// pickled for `weights_only` loads.
pub(super) fn py_value_of(reader: &Reader<'_>, e: &IndexEntry) -> Result<PyValue> {
    if e.kind == EntryKind::Bytes {
        let read = reader.index().read_bytes_object(reader.source(), e)?;
        return PyValue::from_read_value(&read).with_context(|| e.key.clone());
    }
    if let Some(object) = &e.object
        && let Ok(v) = PyValue::from_read_value(object)
    {
        return Ok(v);
    }
    Ok(py_from_json(
        e.value.as_ref().unwrap_or(&serde_json::Value::Null),
    ))
}
