//! A [`ModelDescription`] derived from a checkpoint instead of written by hand.
//!
//! FSDP flattens parameters in registration order (`named_parameters()`), so a description needs the
//! keys in that order. [`stored_key_order`] recovers the order the checkpoint stores them in: a
//! `torch.save` state dict keeps the module's `state_dict()` order (a Python dict), a DCP directory
//! keeps it in its `.metadata` (the planner walks the state dict in order). Safetensors files sort
//! their keys, so the order they give is alphabetical, not registration order.
//!
//! [`description_from_index`] then keeps the floating-point tensor entries (buffers cannot be told
//! from parameters in a checkpoint: exclude them by name), drops optimizer state, takes a subtree on
//! request (`model` of a DCP app state) and makes every module prefix the caller's predicate accepts
//! an FSDP unit.

use std::collections::BTreeSet;

use crate::formats::pickle::PyValue;
use crate::formats::{dcp, torch_zip};
use crate::index::{CheckpointIndex, EntryKind, Format, IndexError};
use crate::model::description::{DescriptionError, ModelDescription, ParamSpec};
use crate::model::fqn::clean_tensor_name;
use crate::source::Source;

/// Why a description cannot be derived from a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum FromIndexError {
    /// Reading the checkpoint's files failed.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// A `torch.save` file cannot be decoded.
    #[error("{file}: {message}")]
    TorchFile { file: String, message: String },
    /// The DCP `.metadata` cannot be decoded.
    #[error("{file}: {message}")]
    DcpMetadata { file: String, message: String },
    /// No tensor entry is left after the filters.
    #[error(
        "no floating-point tensor entries{} in the checkpoint{}",
        select.as_ref().map(|s| format!(" under `{s}.`")).unwrap_or_default(),
        if *flat { " (it holds FSDP1 LOCAL flat parameters, which do not record the original parameters' shapes)" } else { "" }
    )]
    Empty { select: Option<String>, flat: bool },
    /// The derived description is invalid (e.g. a unit that names a parameter).
    #[error(transparent)]
    Description(#[from] DescriptionError),
}

/// The checkpoint's keys in stored order, and whether that order is the module's registration order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyOrder {
    /// Clean keys (wrapper prefixes removed), nesting joined with `.` as in the index.
    pub keys: Vec<String>,
    /// False for safetensors, whose keys are sorted by name.
    pub registration_order: bool,
}

/// Every leaf key of a pickled state dict in dict order (the same traversal and clean-up as the
/// index: mappings are descended, lists/tuples of tensors or containers too).
fn walk(v: &PyValue, prefix: &mut Vec<String>, out: &mut Vec<String>) {
    let container = |x: &PyValue| {
        matches!(
            x,
            PyValue::Tensor(_)
                | PyValue::ShardedTensor(_)
                | PyValue::DTensor(_)
                | PyValue::Dict(_)
                | PyValue::List(_)
                | PyValue::Tuple(_)
        )
    };
    match v {
        PyValue::Dict(items) => {
            for (k, val) in items {
                let seg = match k {
                    PyValue::Str(s) => s.clone(),
                    PyValue::Int(i) => i.to_string(),
                    PyValue::Bool(b) => if *b { "True" } else { "False" }.to_owned(),
                    _ => continue,
                };
                prefix.push(seg);
                walk(val, prefix, out);
                prefix.pop();
            }
        }
        PyValue::List(items) | PyValue::Tuple(items) if items.iter().any(container) => {
            for (i, val) in items.iter().enumerate() {
                prefix.push(i.to_string());
                walk(val, prefix, out);
                prefix.pop();
            }
        }
        _ => out.push(clean_key(&prefix.join("."))),
    }
}

fn clean_key(raw: &str) -> String {
    clean_tensor_name(&format!("{raw}."))
        .trim_end_matches('.')
        .to_owned()
}

/// The keys of the checkpoint indexed as `index` in the order its files store them.
///
/// `torch.save` files: the dict order the index recorded (`IndexEntry::position`: per-rank files of
/// one checkpoint share it; a folder of several sets of per-rank files gives each set's order, the
/// sets one after the other), else the first file's dict order.
/// DCP: the order of `.metadata`'s state-dict metadata (kept by the index, else read from the
/// file). Safetensors: the index order (sorted).
pub fn stored_key_order(
    source: &dyn Source,
    index: &CheckpointIndex,
) -> Result<KeyOrder, FromIndexError> {
    match index.format {
        Format::Dcp => {
            // The index keeps `.metadata`'s key order: a million-chunk `.metadata` is not parsed
            // a second time (by the general pickle machine, whole) for it.
            if let Some(facts) = &index.dcp {
                return Ok(KeyOrder {
                    keys: facts.stored_keys.iter().map(|k| clean_key(k)).collect(),
                    registration_order: true,
                });
            }
            let names = source.names();
            let meta = names
                .iter()
                .find(|n| n.as_str() == ".metadata")
                .or_else(|| names.iter().find(|n| n.ends_with("/.metadata")))
                .cloned()
                .unwrap_or_else(|| ".metadata".to_owned());
            let bytes = crate::formats::read_all_capped(
                source,
                &meta,
                crate::formats::MAX_DCP_METADATA_BYTES,
                "a DCP .metadata file",
            )
            .map_err(IndexError::from)?;
            let parsed = dcp::read_metadata(&bytes).map_err(|e| FromIndexError::DcpMetadata {
                file: meta.clone(),
                message: e.to_string(),
            })?;
            Ok(KeyOrder {
                keys: parsed.items.iter().map(|(k, _)| clean_key(k)).collect(),
                registration_order: true,
            })
        }
        Format::TorchSave => {
            // The index records every key's place in its file's dict (several files: the first
            // rank's order, sets of per-rank files one after the other, each under its subtree
            // name): that order keys the entries of a folder as the index names them, which the
            // first file's own keys (`zz.weight`, not `model.zz.weight`) do not.
            if !index.entries.is_empty() && index.entries.iter().all(|e| e.position.is_some()) {
                let mut entries: Vec<&crate::index::IndexEntry> = index.entries.iter().collect();
                entries.sort_by_key(|e| e.position);
                return Ok(KeyOrder {
                    keys: entries.into_iter().map(|e| e.key.clone()).collect(),
                    registration_order: true,
                });
            }
            let Some(first) = index.files.keys().next() else {
                return Ok(KeyOrder {
                    keys: Vec::new(),
                    registration_order: true,
                });
            };
            let archive = torch_zip::read_archive_from(source, first).map_err(|e| match e {
                torch_zip::ArchiveFileError::Source(e) => FromIndexError::from(IndexError::from(e)),
                torch_zip::ArchiveFileError::Archive(e) => FromIndexError::TorchFile {
                    file: first.clone(),
                    message: e.to_string(),
                },
            })?;
            let mut keys = Vec::new();
            walk(&archive.root, &mut Vec::new(), &mut keys);
            Ok(KeyOrder {
                keys,
                registration_order: true,
            })
        }
        Format::Safetensors => Ok(KeyOrder {
            keys: index.entries.iter().map(|e| e.key.clone()).collect(),
            registration_order: false,
        }),
    }
}

/// What to take from the checkpoint.
#[allow(missing_debug_implementations)] // holds closures
pub struct FromIndexOptions<'a> {
    /// Take only keys under `SELECT.` (with the prefix removed), e.g. `model` in a DCP app state.
    pub select: Option<&'a str>,
    /// Leave out keys (after `select`'s prefix is removed) this accepts: buffers, for example.
    pub exclude: Option<&'a dyn Fn(&str) -> bool>,
    /// A module prefix this accepts (in full) becomes an FSDP unit.
    pub is_unit: &'a dyn Fn(&str) -> bool,
    /// Add the root module (`""`) as a unit.
    pub root_unit: bool,
    /// Tied weights: index key of an alias -> index key of the name it shares its tensor with
    /// (see [`crate::index::ties`]). An alias becomes a parameter with `shared_with`, which takes
    /// no space in a flat parameter, as `named_parameters(remove_duplicate=False)` lists it.
    pub tied: Option<&'a std::collections::BTreeMap<String, String>>,
}

/// The derived description and what was left out.
#[derive(Debug, Clone)]
pub struct Derived {
    pub model: ModelDescription,
    /// Keys that were not taken, with the reason (`optimizer state`, `not floating point`, ...).
    pub skipped: Vec<(String, &'static str)>,
}

/// Builds a description from the checkpoint's entries in `order`: every floating-point tensor with a
/// global shape that is not optimizer state and not excluded, in that order; the units are the
/// module prefixes (dotted prefixes of those FQNs) that `options.is_unit` accepts, in the order they
/// first appear, after the root when `options.root_unit`.
pub fn description_from_index(
    index: &CheckpointIndex,
    order: &KeyOrder,
    options: &FromIndexOptions<'_>,
) -> Result<Derived, FromIndexError> {
    let mut params = Vec::new();
    let mut skipped = Vec::new();
    let mut seen = BTreeSet::new();
    let mut saw_flat = false;
    // Keys the order does not list (never expected) come after, in index order.
    let listed: BTreeSet<&str> = order.keys.iter().map(String::as_str).collect();
    let tail = index
        .entries
        .iter()
        .map(|e| &e.key)
        .filter(|k| !listed.contains(k.as_str()));
    for key in order.keys.iter().chain(tail) {
        if !seen.insert(key.as_str()) {
            continue;
        }
        let Some(entry) = index.entry(key) else {
            continue;
        };
        let fqn = match options.select {
            Some(sel) => match key.strip_prefix(sel).and_then(|r| r.strip_prefix('.')) {
                Some(rest) => rest,
                None => continue,
            },
            None => key.as_str(),
        };
        let reason = if entry.role.is_some() {
            Some("optimizer state")
        } else if entry.kind != EntryKind::Tensor {
            Some("not a tensor")
        } else if entry.flat_param {
            saw_flat = true;
            Some("FSDP1 flat parameter")
        } else if !entry
            .dtype
            .is_some_and(crate::dtype::DType::is_floating_point)
        {
            Some("not floating point")
        } else if entry.shape.is_none() {
            Some("rank-local pieces without a global shape")
        } else if options.exclude.is_some_and(|ex| ex(fqn)) {
            Some("excluded")
        } else {
            None
        };
        if let Some(reason) = reason {
            skipped.push((key.clone(), reason));
            continue;
        }
        let (Some(dtype), Some(shape)) = (entry.dtype, entry.shape.clone()) else {
            continue;
        };
        // Only a partner already taken (an earlier parameter) can be shared with.
        let shared_with = options
            .tied
            .and_then(|t| t.get(key))
            .map(|partner| match options.select {
                Some(sel) => partner
                    .strip_prefix(sel)
                    .and_then(|r| r.strip_prefix('.'))
                    .unwrap_or(partner),
                None => partner.as_str(),
            })
            .filter(|partner| params.iter().any(|p: &ParamSpec| p.fqn == *partner))
            .map(str::to_owned);
        params.push(ParamSpec {
            fqn: fqn.to_owned(),
            shape,
            dtype,
            requires_grad: true,
            shared_with,
        });
    }
    if params.is_empty() {
        return Err(FromIndexError::Empty {
            select: options.select.map(str::to_owned),
            flat: saw_flat,
        });
    }
    let units = module_units(&params, options.is_unit, options.root_unit);
    let model = ModelDescription::new(params, units, Vec::new())?;
    Ok(Derived { model, skipped })
}

/// The FSDP units of `params`: every module prefix (dotted prefix of a parameter FQN) `is_unit`
/// accepts, in the order the parameters first reach it, after the root (`""`) when `root_unit`.
pub fn module_units(
    params: &[crate::model::ParamSpec],
    is_unit: &dyn Fn(&str) -> bool,
    root_unit: bool,
) -> Vec<String> {
    let mut units = Vec::new();
    if root_unit {
        units.push(String::new());
    }
    let mut seen_units = BTreeSet::new();
    for p in params {
        let mut end = 0;
        while let Some(dot) = p.fqn[end..].find('.') {
            let prefix = &p.fqn[..end + dot];
            if seen_units.insert(prefix.to_owned()) && is_unit(prefix) {
                units.push(prefix.to_owned());
            }
            end += dot + 1;
        }
    }
    units
}

/// How [`uniform_dtype_units`] grouped the parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitChoice {
    /// Every parameter has one dtype: the description is kept (one flat parameter may hold all).
    Uniform,
    /// Several dtypes: one unit per module that holds parameters (and the root), so that each
    /// unit's parameters share a dtype, as FSDP1 requires of a flat parameter.
    PerModule { units: usize, dtypes: Vec<String> },
}

/// `model` with units FSDP accepts when its parameters have several dtypes (FSDP1 refuses to
/// flatten "tensors with uniform dtype" otherwise): every module prefix that holds parameters
/// directly becomes a unit, after the root. Fails, naming the module, when one module's own
/// parameters have different dtypes (no wrapping can separate them).
pub fn uniform_dtype_units(
    model: &ModelDescription,
) -> Result<(ModelDescription, UnitChoice), String> {
    let dtypes: BTreeSet<&str> = model.params.iter().map(|p| p.dtype.name()).collect();
    if dtypes.len() <= 1 {
        return Ok((model.clone(), UnitChoice::Uniform));
    }
    let parent = |fqn: &str| fqn.rsplit_once('.').map_or("", |(m, _)| m).to_owned();
    let mut units = vec![String::new()];
    let mut dtype_of: std::collections::BTreeMap<String, &str> = std::collections::BTreeMap::new();
    for p in model.params.iter().filter(|p| p.shared_with.is_none()) {
        let module = parent(&p.fqn);
        match dtype_of.get(&module) {
            Some(&d) if d != p.dtype.name() => {
                return Err(format!(
                    "module `{}` holds parameters of two dtypes ({d} and {}, e.g. `{}`): no FSDP1 wrapping puts them in flat parameters of one dtype",
                    if module.is_empty() { "<root>" } else { &module },
                    p.dtype.name(),
                    p.fqn
                ));
            }
            Some(_) => {}
            None => {
                dtype_of.insert(module.clone(), p.dtype.name());
                if !module.is_empty() {
                    units.push(module);
                }
            }
        }
    }
    // Units that hold parameters (the root is a unit even when it holds none of its own).
    let count = dtype_of.len();
    let described = ModelDescription::new(
        model.params.clone(),
        units,
        model.ignored.iter().cloned().collect(),
    )
    .map_err(|e| e.to_string())?;
    Ok((
        described,
        UnitChoice::PerModule {
            units: count,
            dtypes: dtypes.into_iter().map(str::to_owned).collect(),
        },
    ))
}

#[cfg(test)]
mod unit_choice_tests {
    use super::*;
    use crate::dtype::DType;

    fn param(fqn: &str, dtype: DType) -> ParamSpec {
        ParamSpec {
            fqn: fqn.to_owned(),
            shape: vec![2],
            dtype,
            requires_grad: true,
            shared_with: None,
        }
    }

    #[test]
    fn mixed_dtypes_get_one_unit_per_module() {
        let model = ModelDescription::new(
            vec![
                param("emb.weight", DType::BFloat16),
                param("norm.weight", DType::Float32),
                param("layers.0.w", DType::BFloat16),
                param("layers.0.b", DType::BFloat16),
            ],
            vec![String::new()],
            Vec::new(),
        )
        .unwrap();
        let (m, choice) = uniform_dtype_units(&model).unwrap();
        assert_eq!(m.units, vec!["", "emb", "norm", "layers.0"]);
        assert_eq!(
            choice,
            UnitChoice::PerModule {
                units: 3,
                dtypes: vec!["bfloat16".into(), "float32".into()]
            }
        );
        let uniform = ModelDescription::new(
            vec![param("a.w", DType::Float32), param("b.w", DType::Float32)],
            vec![String::new()],
            Vec::new(),
        )
        .unwrap();
        assert_eq!(
            uniform_dtype_units(&uniform).unwrap().1,
            UnitChoice::Uniform
        );
        let clash = ModelDescription::new(
            vec![param("a.w", DType::Float32), param("a.s", DType::Float16)],
            vec![String::new()],
            Vec::new(),
        )
        .unwrap();
        let err = uniform_dtype_units(&clash).unwrap_err();
        assert!(
            err.contains("module `a`") && err.contains("float32"),
            "{err}"
        );
    }
}

#[cfg(test)]
mod key_order_tests {
    use super::*;
    use crate::source::MemorySource;
    use std::path::{Path, PathBuf};

    fn metadata_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                metadata_dirs(&p, out);
            } else if p.file_name().is_some_and(|n| n == ".metadata") {
                out.push(dir.to_path_buf());
            }
        }
    }

    /// Every DCP fixture torch wrote: the key order the index keeps is the order read from
    /// `.metadata` itself by the general pickle machine.
    #[test]
    fn the_kept_dcp_key_order_is_the_order_of_the_file() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let mut dirs = Vec::new();
        metadata_dirs(&root, &mut dirs);
        assert!(dirs.len() >= 10, "{dirs:?}");
        let mut checked = 0;
        for dir in dirs {
            let mut src = MemorySource::new();
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                if e.path().is_file() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    src.insert(name, std::fs::read(e.path()).unwrap());
                }
            }
            let Ok(index) = crate::index::read::dcp::index_dcp(&src, ".metadata") else {
                continue; // damaged on purpose (doctor fixtures)
            };
            let kept = stored_key_order(&src, &index).unwrap();
            let mut without = index.clone();
            without.dcp = None;
            let read = stored_key_order(&src, &without).unwrap();
            assert_eq!(kept.keys, read.keys, "{}", dir.display());
            assert!(!kept.keys.is_empty(), "{}", dir.display());
            checked += 1;
        }
        assert!(checked >= 10, "{checked}");
    }
}
