//! `shardscope._native`: the Rust side of `import shardscope`. The Python package
//! (`python/shardscope/__init__.py`) is the API; this module opens checkpoints with the CLI's own
//! reader (`shardscope_runner::api`), reads tensors from their chunks straight into a `bytearray`
//! it returns (no intermediate copy; the GIL released while reading), and runs the CLI itself
//! (`shardscope` on PATH and `python -m shardscope`).
//!
//! Every failure is a `ShardscopeError` with the CLI's text; a panic is caught and reported as
//! one too, never a crash of the interpreter.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::OnceLock;

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};
use shardscope_core::DType;
use shardscope_core::checkpoint::{Fsdp1Flags, View, ranks_in};
use shardscope_core::index::EntryKind;
use shardscope_runner::api::{self, Model, OpenArgs, Opened, error_text};

create_exception!(
    _native,
    ShardscopeError,
    PyException,
    "Every failure of shardscope: an unreadable or inconsistent checkpoint, a missing key, a bad argument. The message is the command line's."
);

/// `f` run with panics caught: an error is a `ShardscopeError` with the CLI's text.
fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ShardscopeError::new_err(error_text(&e))),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "unknown".to_owned());
            Err(ShardscopeError::new_err(format!(
                "internal error (a bug in shardscope; please report it with the input that caused it): {what}"
            )))
        }
    }
}

fn parse_dtype(name: &str) -> anyhow::Result<DType> {
    name.parse()
        .map_err(|e: shardscope_core::dtype::UnknownDType| anyhow::anyhow!("{e}"))
}

/// A checkpoint opened as the CLI opens it.
#[pyclass(module = "shardscope._native", name = "Checkpoint", frozen)]
struct PyCheckpoint {
    opened: Opened,
    /// The keys in stored order, found on first use.
    order: OnceLock<Vec<String>>,
}

impl PyCheckpoint {
    fn order(&self) -> &[String] {
        self.order.get_or_init(|| self.opened.stored_order())
    }
}

// pyo3 extracts a Python list as an owned Vec.
#[allow(clippy::needless_pass_by_value)]
#[pymethods]
impl PyCheckpoint {
    /// The keys, in the order the checkpoint stores them.
    fn keys(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| guarded(|| Ok(self.order().to_vec())))
    }

    fn __contains__(&self, key: &str) -> bool {
        self.opened.checkpoint().index.entry(key).is_some()
    }

    fn __len__(&self) -> usize {
        self.opened.checkpoint().index.entries.len()
    }

    /// The path or URL it was opened from.
    #[getter]
    fn label(&self) -> String {
        self.opened.checkpoint().label.clone()
    }

    /// What it looks like (`dcp`, `fsdp2`, `fsdp1_local`, `plain`, ...).
    #[getter]
    fn kind(&self) -> PyResult<String> {
        guarded(|| {
            let v = serde_json::to_value(self.opened.checkpoint().index.kind)?;
            Ok(v.as_str().unwrap_or_default().to_owned())
        })
    }

    /// Its file format (`dcp`, `safetensors`, `torch_save`).
    #[getter]
    fn format(&self) -> PyResult<String> {
        guarded(|| {
            let v = serde_json::to_value(self.opened.checkpoint().index.format)?;
            Ok(v.as_str().unwrap_or_default().to_owned())
        })
    }

    /// The number of ranks that wrote it: what it states (a DTensor's mesh, DCP's planner), else
    /// the highest rank of its files plus one (1 for a single file).
    #[getter]
    fn world_size(&self) -> u64 {
        let c = self.opened.checkpoint();
        c.hints
            .world_size
            .as_ref()
            .map_or_else(|| ranks_in(&c.index), |h| h.value)
    }

    /// How it was read: `stored`, `fsdp1` (per-rank pieces through the model's layout) or
    /// `fsdp2` (raw optimizer ids named by FQN).
    #[getter]
    fn view(&self) -> &'static str {
        match self.opened.checkpoint().view {
            View::Stored => "stored",
            View::Fsdp1(_) => "fsdp1",
            View::Fsdp2 { .. } => "fsdp2",
        }
    }

    /// What wrote it, when its files say (`Megatron-core dist_checkpointing (torch_dist; …)`,
    /// `accelerate save_state`, …), else `None`.
    #[getter]
    fn written_by(&self) -> Option<String> {
        self.opened.checkpoint().written_by.clone()
    }

    /// What a user should know about how it was read (the CLI prints these as `note: …`).
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.opened.checkpoint().notes.clone()
    }

    /// `key`'s dtype, shape, chunk count and ranks (a dict).
    fn info<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyDict>> {
        let entry = guarded(|| self.opened.entry(key))?;
        let d = PyDict::new(py);
        let kind = match entry.kind {
            EntryKind::Tensor => "tensor",
            EntryKind::Bytes => "bytes",
            EntryKind::Scalar => "scalar",
        };
        d.set_item("kind", kind)?;
        d.set_item("dtype", entry.dtype.map(DType::name))?;
        d.set_item(
            "shape",
            entry
                .shape
                .clone()
                .map(|s| pyo3::types::PyTuple::new(py, s))
                .transpose()?,
        )?;
        d.set_item("chunks", entry.chunks.len())?;
        d.set_item("ranks", entry.ranks().into_iter().collect::<Vec<u32>>())?;
        d.set_item("nbytes", entry.nbytes())?;
        Ok(d)
    }

    /// Reads `key` (cast to `dtype`, rows `rows` of dim 0) into a new `bytearray`; returns it
    /// with the result's dtype name and shape. The GIL is released while reading.
    #[pyo3(signature = (key, dtype=None, rows=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        dtype: Option<&str>,
        rows: Option<(u64, u64)>,
    ) -> PyResult<(Bound<'py, PyByteArray>, &'static str, Vec<u64>)> {
        let to = dtype.map(parse_dtype).transpose();
        let to = guarded(|| to)?;
        let plan = py.detach(|| guarded(|| self.opened.plan(key, to, rows)))?;
        let len = guarded(|| {
            usize::try_from(plan.buffer)
                .map_err(|_| anyhow::anyhow!("{key}: too large for this machine"))
        })?;
        let array = PyByteArray::new_with(py, len, |buf: &mut [u8]| {
            py.detach(|| guarded(|| self.opened.read_into(key, to, rows, buf)))
                .map(|_| ())
        })?;
        if plan.buffer != plan.nbytes {
            // A narrowing cast happened in place: the result is the front of the buffer.
            array.resize(plan.nbytes as usize)?;
        }
        Ok((array, plan.dtype.name(), plan.shape))
    }

    /// What reading `key` (cast to `dtype`, rows `rows`) gives: `(buffer bytes to allocate, result
    /// bytes, result dtype, result shape)`.
    #[pyo3(signature = (key, dtype=None, rows=None))]
    fn plan(
        &self,
        py: Python<'_>,
        key: &str,
        dtype: Option<&str>,
        rows: Option<(u64, u64)>,
    ) -> PyResult<(u64, u64, &'static str, Vec<u64>)> {
        let to = guarded(|| dtype.map(parse_dtype).transpose())?;
        let plan = py.detach(|| guarded(|| self.opened.plan(key, to, rows)))?;
        Ok((plan.buffer, plan.nbytes, plan.dtype.name(), plan.shape))
    }

    /// Reads `key` (as [`Self::plan`] says) into `out`, a writable C-contiguous buffer of at
    /// least the planned bytes that the caller allocated (a `numpy.empty` array: no zero-fill,
    /// no copy afterwards). The GIL is released while reading. Returns the result's bytes.
    #[pyo3(signature = (key, out, dtype=None, rows=None))]
    fn read_into(
        &self,
        py: Python<'_>,
        key: &str,
        out: &Bound<'_, PyAny>,
        dtype: Option<&str>,
        rows: Option<(u64, u64)>,
    ) -> PyResult<usize> {
        let to = guarded(|| dtype.map(parse_dtype).transpose())?;
        let plan = py.detach(|| guarded(|| self.opened.plan(key, to, rows)))?;
        let buffer = PyBuffer::<u8>::get(out)?;
        if buffer.readonly() || !buffer.is_c_contiguous() {
            return Err(ShardscopeError::new_err(
                "read_into: the output must be a writable, C-contiguous buffer",
            ));
        }
        let len = buffer.len_bytes();
        if (len as u64) < plan.buffer {
            return Err(ShardscopeError::new_err(format!(
                "read_into: the output holds {len} bytes, reading {key} needs {}",
                plan.buffer
            )));
        }
        let address = buffer.buf_ptr() as usize;
        let n = py.detach(|| {
            // SAFETY: `buffer` (a PyBuffer, alive until the end of this function) holds the
            // export of `out`'s memory: the exporter (numpy, bytearray) can neither free nor
            // resize it while the export exists. It is writable and C-contiguous (checked above),
            // so `address..address + len` is one valid, writable allocation. The caller
            // allocated it for this call and holds no other view it writes through.
            #[allow(unsafe_code)]
            let dst = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) };
            guarded(|| self.opened.read_into(key, to, rows, dst))
        })?;
        drop(buffer);
        Ok(n)
    }

    /// Where `key` (rows `rows`) lies as one contiguous range of one local file, as stored:
    /// `(path, byte offset, byte length)`, or `None` when it must be read (see
    /// `Opened::locate`).
    #[pyo3(signature = (key, rows=None))]
    fn locate(
        &self,
        py: Python<'_>,
        key: &str,
        rows: Option<(u64, u64)>,
    ) -> PyResult<Option<(String, u64, u64)>> {
        py.detach(|| {
            guarded(|| {
                Ok(self
                    .opened
                    .locate(key, rows)?
                    .map(|(p, at, n)| (p.display().to_string(), at, n)))
            })
        })
    }

    /// A non-tensor entry's value, as JSON text.
    fn value_json(&self, py: Python<'_>, key: &str) -> PyResult<String> {
        py.detach(|| guarded(|| Ok(self.opened.value(key)?.to_string())))
    }

    /// `verify --manifest --json` of this checkpoint as opened, against the manifest at
    /// `manifest`: the report as JSON text.
    #[pyo3(signature = (manifest, threads=None))]
    fn verify_manifest(
        &self,
        py: Python<'_>,
        manifest: &str,
        threads: Option<usize>,
    ) -> PyResult<String> {
        py.detach(|| {
            guarded(|| {
                Ok(self
                    .opened
                    .verify_manifest(std::path::Path::new(manifest), threads)?
                    .to_json())
            })
        })
    }

    /// Tie groups among `keys` by shared storage: `(kept, [aliases])`.
    fn storage_ties(&self, py: Python<'_>, keys: Vec<String>) -> Vec<(String, Vec<String>)> {
        py.detach(|| self.opened.storage_ties(&keys))
    }

    /// The aliases `shardscope convert` drops among `keys`: `(kept, dropped)` pairs.
    fn tied_aliases(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<(String, String)>> {
        py.detach(|| guarded(|| self.opened.tied_aliases(&keys)))
    }

    /// The model part in another naming (`to`: "hf" or "torchtitan"), through the mapping the
    /// config (JSON text) and the stored names choose, or the given mapping file's text.
    #[pyo3(signature = (to, config_json, mapping_text=None, mapping_name=None))]
    fn mapped(
        &self,
        py: Python<'_>,
        to: &str,
        config_json: &str,
        mapping_text: Option<String>,
        mapping_name: Option<String>,
    ) -> PyResult<PyCheckpoint> {
        py.detach(|| {
            guarded(|| {
                let mapping = mapping_text
                    .as_deref()
                    .map(|t| (t, mapping_name.as_deref().unwrap_or("the mapping file")));
                Ok(PyCheckpoint {
                    opened: self.opened.mapped(to, config_json, mapping)?,
                    order: OnceLock::new(),
                })
            })
        })
    }

    fn __repr__(&self) -> String {
        let c = self.opened.checkpoint();
        format!(
            "<shardscope checkpoint {:?}: {}, {} keys>",
            c.label,
            c.index.kind.describe(),
            c.index.entries.len()
        )
    }
}

/// Opens a checkpoint as the CLI does; see `shardscope.open`.
#[pyfunction]
#[pyo3(signature = (paths, *, model_path=None, model_json=None, model_name=None, model_files=None, optim_files=None, model_only=false, world_size=None, use_orig_params=false, strategy=None, shard_group_size=None, param_dtype=None, ranks=None))]
#[allow(clippy::too_many_arguments)]
fn open(
    py: Python<'_>,
    paths: Vec<String>,
    model_path: Option<String>,
    model_json: Option<String>,
    model_name: Option<String>,
    model_files: Option<String>,
    optim_files: Option<String>,
    model_only: bool,
    world_size: Option<u64>,
    use_orig_params: bool,
    strategy: Option<String>,
    shard_group_size: Option<u64>,
    param_dtype: Option<String>,
    ranks: Option<u64>,
) -> PyResult<PyCheckpoint> {
    py.detach(|| {
        guarded(|| {
            let model = match (model_path, model_json) {
                (Some(path), _) => Some(Model::Path(PathBuf::from(path))),
                (None, Some(text)) => Some(Model::Json {
                    text,
                    name: model_name.unwrap_or_else(|| "the model description".to_owned()),
                }),
                (None, None) => None,
            };
            let mut fsdp1 = Fsdp1Flags {
                world_size,
                use_orig_params,
                shard_group_size,
                ..Fsdp1Flags::default()
            };
            if let Some(s) = strategy {
                fsdp1.strategy = s
                    .parse()
                    .map_err(|e: shardscope_core::layout::LayoutError| anyhow::anyhow!("{e}"))?;
            }
            if let Some(d) = param_dtype {
                fsdp1.param_dtype = Some(parse_dtype(&d)?);
            }
            let args = OpenArgs {
                model,
                fsdp1,
                model_files,
                optim_files,
                model_only,
                ranks,
            };
            let paths: Vec<PathBuf> = paths.into_iter().map(PathBuf::from).collect();
            if paths.is_empty() {
                anyhow::bail!("no checkpoint given");
            }
            Ok(PyCheckpoint {
                opened: Opened::open(&paths, &args)?,
                order: OnceLock::new(),
            })
        })
    })
}

/// Runs the `shardscope` command with `argv` (program name first) and returns its exit status.
/// The GIL is released while it runs.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>) -> u8 {
    let code = py.detach(|| shardscope_runner::main_with(argv));
    (0..=u8::MAX)
        .find(|&n| ExitCode::from(n) == code)
        .unwrap_or(1)
}

/// Checks a model description (JSON text) as `--model` does; returns the units `layout --from`
/// would choose for its parameters (the root and the blocks of repeated module lists).
#[pyfunction]
fn auto_units(description_json: &str) -> PyResult<Vec<String>> {
    guarded(|| {
        let d = api::parse_description(description_json, "the description")?;
        Ok(api::auto_units(&d))
    })
}

/// Checks a model description (JSON text) as `--model` does.
#[pyfunction]
fn check_description(description_json: &str, name: &str) -> PyResult<()> {
    guarded(|| api::parse_description(description_json, name).map(|_| ()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ShardscopeError", m.py().get_type::<ShardscopeError>())?;
    m.add_class::<PyCheckpoint>()?;
    m.add_function(wrap_pyfunction!(open, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(auto_units, m)?)?;
    m.add_function(wrap_pyfunction!(check_description, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
