//! `doctor`: why a checkpoint will not load into a model, and how to fix it.
//!
//! [`diagnose`] takes a [`CheckpointIndex`] (and the [`Source`] it was read from, for the few value
//! reads a diagnosis needs), optionally a [`Target`] (the model the checkpoint should load into,
//! from a reference checkpoint or a model description) and returns [`Finding`]s: a stable `code`,
//! a severity, the keys involved, a message in plain words and a fix (a `shardscope` command or a
//! line of Python). No file I/O happens here; the CLI opens the inputs and scans pickles for
//! globals ([`unsafe_globals`]).
//!
//! A nested checkpoint (`{"model": …, "optim": …}`, DCP app states) is diagnosed part by part: each
//! model part against the target, each optimizer part against the target's parameters.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::Serialize;

use crate::dtype::DType;
use crate::formats::pickle::Global;
use crate::index::{
    CheckpointIndex, CheckpointKind, ChunkEncoding, EntryKind, Format, FsdpInfo, IndexEntry,
    PathSeg, Problem, Role,
};
use crate::model::description::ModelDescription;
use crate::model::fqn::{CHECKPOINT_WRAPPED_MODULE, FLAT_PARAM, FSDP_WRAPPED_MODULE, is_under};
use crate::source::Source;

/// The version of the JSON report.
pub const REPORT_VERSION: u32 = 1;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    Warning,
}

/// One diagnosis.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Stable identifier (`wrapper-prefix`, `flat-param`, …).
    pub code: &'static str,
    pub severity: Severity,
    /// The checkpoint keys involved (as stored), or target keys for `missing-key`, or file names.
    pub keys: Vec<String>,
    pub message: String,
    /// A `shardscope` command or a line of Python.
    pub fix: String,
}

/// What `doctor` prints with `--json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub version: u32,
    pub loadable: bool,
    pub findings: Vec<Finding>,
}

impl Report {
    /// A report of these findings, sorted (errors first, then by code and keys).
    pub fn new(findings: Vec<Finding>) -> Report {
        let mut findings = merge_alike(findings);
        findings.sort_by(|a, b| {
            (a.severity, code_rank(a.code), &a.keys).cmp(&(b.severity, code_rank(b.code), &b.keys))
        });
        findings.dedup();
        Report {
            version: REPORT_VERSION,
            loadable: !findings.iter().any(|f| f.severity == Severity::Error),
            findings,
        }
    }

    /// 0 when loadable, 1 when some finding is an error.
    pub fn exit_code(&self) -> u8 {
        u8::from(!self.loadable)
    }
}

/// Findings of one code with the same fix (one per key: local shards, casts, empty views) become
/// one finding naming every key.
fn merge_alike(findings: Vec<Finding>) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::with_capacity(findings.len());
    let mut extra: Vec<Vec<String>> = Vec::new();
    for f in findings {
        if let Some(i) = out
            .iter()
            .position(|o| o.code == f.code && o.severity == f.severity && o.fix == f.fix)
        {
            extra[i].extend(f.keys.iter().cloned());
            out[i].keys.extend(f.keys);
        } else {
            out.push(f);
            extra.push(Vec::new());
        }
    }
    for (f, more) in out.iter_mut().zip(extra) {
        if !more.is_empty() {
            f.message = format!(
                "{} (and {} more key(s) alike: {})",
                f.message,
                more.len(),
                list(&more)
            );
        }
    }
    out
}

const CODES: [&str; 15] = [
    "coverage",
    "unsafe-pickle",
    "world-size",
    "wrapper-prefix",
    "flat-param",
    "local-shard",
    "flattened-shape",
    "empty-tensor",
    "replicated-concatenated",
    "missing-key",
    "unexpected-key",
    "shape-mismatch",
    "optimizer-mismatch",
    "dtype-mismatch",
    "unreadable",
];

fn code_rank(code: &str) -> usize {
    CODES.iter().position(|c| *c == code).unwrap_or(CODES.len())
}

/// One tensor the target model expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetTensor {
    pub shape: Vec<u64>,
    pub dtype: Option<DType>,
}

/// Where a target comes from: it decides how strict the key comparison is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// A reference checkpoint (`model.state_dict()`): parameters and buffers.
    Reference,
    /// A model description: parameters only (extra keys may be buffers).
    Description,
}

/// The model a checkpoint should load into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub kind: TargetKind,
    /// Every key the target's `load_state_dict` expects (tied aliases included).
    pub tensors: BTreeMap<String, TargetTensor>,
    /// Groups of keys that are one tensor (tied weights): any one of them present is enough.
    pub ties: Vec<BTreeSet<String>>,
    /// Number of distinct parameters (`model.parameters()`, tied weights once); for a reference an
    /// upper bound (buffers count too).
    pub params: usize,
    /// Parameters with `requires_grad` (description only): the fewest an optimizer may hold.
    pub trainable: Option<usize>,
    /// How to name the target in fix commands (`--model model.json`).
    pub label: String,
}

impl Target {
    /// The target a model description gives: its parameters, ties from `shared_with`.
    pub fn from_description(model: &ModelDescription, label: &str) -> Target {
        let mut tensors = BTreeMap::new();
        let mut ties: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut params = 0usize;
        let mut trainable = 0usize;
        for p in &model.params {
            tensors.insert(
                p.fqn.clone(),
                TargetTensor {
                    shape: p.shape.clone(),
                    dtype: Some(p.dtype),
                },
            );
            if let Some(partner) = &p.shared_with {
                let group = ties.entry(partner.clone()).or_default();
                group.insert(partner.clone());
                group.insert(p.fqn.clone());
            } else {
                params += 1;
                trainable += usize::from(p.requires_grad);
            }
        }
        Target {
            kind: TargetKind::Description,
            tensors,
            ties: ties.into_values().collect(),
            params,
            trainable: Some(trainable),
            label: label.to_owned(),
        }
    }

    /// The target a reference checkpoint gives: its tensors (the model part when nested), ties
    /// from shared storage (same file, byte range, view).
    pub fn from_reference(index: &CheckpointIndex, label: &str) -> Target {
        let parts = split_parts(index);
        let model = parts
            .models
            .iter()
            .find(|p| p.name.as_deref() == Some("model"))
            .or_else(|| parts.models.first());
        let mut tensors = BTreeMap::new();
        let mut by_storage: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        if let Some(model) = model {
            for (key, e) in &model.entries {
                let Some(shape) = &e.shape else { continue };
                tensors.insert(
                    key.clone(),
                    TargetTensor {
                        shape: shape.clone(),
                        dtype: e.dtype,
                    },
                );
                if let [c] = e.chunks.as_slice()
                    && let ChunkEncoding::Raw {
                        storage_offset,
                        strides,
                    } = &c.encoding
                {
                    let id = format!(
                        "{}@{}+{}:{storage_offset}:{:?}:{strides:?}",
                        c.file, c.byte_offset, c.byte_length, c.sizes
                    );
                    by_storage.entry(id).or_default().insert(key.clone());
                }
            }
        }
        let ties: Vec<BTreeSet<String>> =
            by_storage.into_values().filter(|g| g.len() > 1).collect();
        let tied_extra: usize = ties.iter().map(|g| g.len() - 1).sum();
        Target {
            kind: TargetKind::Reference,
            params: tensors.len().saturating_sub(tied_extra),
            tensors,
            ties,
            trainable: None,
            label: label.to_owned(),
        }
    }

    fn tied_partner_present(&self, key: &str, present: &BTreeSet<String>) -> Option<String> {
        self.ties.iter().find(|g| g.contains(key)).and_then(|g| {
            g.iter()
                .find(|k| *k != key && present.contains(*k))
                .cloned()
        })
    }
}

/// Options of one diagnosis.
#[derive(Debug, Clone, Default)]
pub struct Options<'a> {
    /// The model the checkpoint should load into.
    pub target: Option<&'a Target>,
    /// The number of ranks that will load the checkpoint.
    pub world_size: Option<u64>,
    /// The checkpoint as the user names it in commands (paths joined by spaces).
    pub label: String,
    /// `--model` path for fix commands that need a description, when one was given.
    pub model_path: Option<String>,
    /// FSDP1 `use_orig_params=True` (passed on to fix commands).
    pub use_orig_params: bool,
    /// `fsdp1` or `fsdp2`: the chunking of suggested DCP conversions.
    pub api: Option<&'static str>,
}

/// Which globals of a pickle `torch.load(weights_only=True)` refuses and that are not torch's own
/// classes: what `weights_only=False` would import and could run.
pub fn unsafe_globals(globals: &[Global]) -> Vec<String> {
    // ShardedTensor pickles (FSDP1 LOCAL/SHARDED) look up a memory format with `getattr` on
    // torch's own `MEM_FORMAT_ENCODING` enum.
    let sharded_tensor = globals.iter().any(|g| {
        g.module == "torch.distributed._shard.sharded_tensor.metadata"
            && g.name == "MEM_FORMAT_ENCODING"
    });
    let getattr = |g: &Global| {
        sharded_tensor
            && matches!(g.module.as_str(), "builtins" | "__builtin__")
            && g.name == "getattr"
    };
    globals
        .iter()
        .filter(|g| !weights_only_allows(g) && !torch_own(g) && !getattr(g))
        .map(ToString::to_string)
        .collect()
}

/// torch's `_get_allowed_globals()` (torch 2.15, `torch/_weights_only_unpickler.py`), after its
/// Python 2 name mapping (`__builtin__` is `builtins`).
pub fn weights_only_allows(g: &Global) -> bool {
    const EXACT: [(&str, &str); 12] = [
        ("collections", "OrderedDict"),
        ("collections", "Counter"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("torch", "Tensor"),
        ("torch", "device"),
        ("_codecs", "encode"),
        ("builtins", "bytearray"),
        ("builtins", "set"),
        ("builtins", "complex"),
        ("torch._tensor", "_rebuild_from_type_v2"),
    ];
    const REBUILD: [&str; 11] = [
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_qtensor",
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_sparse_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy",
        "_rebuild_device_tensor_from_cpu_tensor",
    ];
    const QSCHEMES: [&str; 5] = [
        "per_tensor_affine",
        "per_tensor_symmetric",
        "per_channel_affine",
        "per_channel_symmetric",
        "per_channel_affine_float_qparams",
    ];
    const DTYPES: [&str; 24] = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex32",
        "complex64",
        "complex128",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
        "qint8",
        "quint8",
        "qint32",
        "quint4x2",
        "quint2x4",
        "uint16",
        "uint32",
        "uint64",
        "bits8",
        "bits16",
        "float4_e2m1fn_x2",
    ];
    let module = if g.module == "__builtin__" {
        "builtins"
    } else {
        g.module.as_str()
    };
    let name = g.name.as_str();
    if EXACT.contains(&(module, name)) {
        return true;
    }
    match module {
        "torch._utils" => REBUILD.contains(&name),
        "torch.storage" => matches!(name, "TypedStorage" | "UntypedStorage"),
        "torch" => {
            QSCHEMES.contains(&name)
                || DTYPES.contains(&name)
                || name.starts_with("float8_")
                || name.starts_with("bits")
                || sub_byte_int(name)
                || name.ends_with("Tensor")
                || name.ends_with("Storage")
        }
        "torch.cuda" | "torch.cuda.sparse" | "torch.sparse" => {
            name.ends_with("Tensor") || name.ends_with("Storage")
        }
        _ => false,
    }
}

/// `torch.uint1` … `torch.uint7`, `torch.int1` … `torch.int7`.
fn sub_byte_int(name: &str) -> bool {
    let digits = name
        .strip_prefix("uint")
        .or_else(|| name.strip_prefix("int"));
    matches!(digits, Some("1" | "2" | "3" | "4" | "5" | "6" | "7"))
}

/// torch's own distributed records (DTensor, DeviceMesh, placements, ShardedTensor and its
/// metadata, DCP metadata): torch registers them as safe when `torch.distributed` is imported, and
/// shardscope reads them as data.
fn torch_own(g: &Global) -> bool {
    g.module.starts_with("torch.distributed.")
        && !g.module.contains(".elastic")
        && !g.module.contains(".rpc")
        && !g.module.contains(".launcher")
        && g.name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_uppercase() || c == '_')
        && !g.name.starts_with("__")
}

// ---------------------------------------------------------------------------------------------
// Parts.

/// A model part of the checkpoint: keys relative to the part.
struct ModelPart<'a> {
    /// The top-level key of a nested checkpoint (`model`), or `None` for a flat one.
    name: Option<String>,
    /// Relative clean key -> entry (tensors only).
    entries: BTreeMap<String, &'a IndexEntry>,
}

/// An optimizer part: `state[param][name]` entries and the `param_groups` leaves.
struct OptimPart<'a> {
    prefix: Vec<PathSeg>,
    state_params: BTreeSet<PathSeg>,
    group_ids: Vec<i64>,
    group_names: Vec<String>,
    entries: Vec<&'a IndexEntry>,
}

struct Parts<'a> {
    models: Vec<ModelPart<'a>>,
    optims: Vec<OptimPart<'a>>,
}

fn join(path: &[PathSeg]) -> String {
    path.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

fn optim_prefix(e: &IndexEntry) -> Option<Vec<PathSeg>> {
    match &e.role {
        Some(Role::OptimizerState { .. }) => {
            let n = e.path.len().checked_sub(3)?;
            Some(e.path[..n].to_vec())
        }
        Some(Role::ParamGroup { .. }) => {
            let at = e
                .path
                .iter()
                .position(|s| *s == PathSeg::Key("param_groups".into()))?;
            Some(e.path[..at].to_vec())
        }
        None => None,
    }
}

fn split_parts(index: &CheckpointIndex) -> Parts<'_> {
    let mut optims: BTreeMap<Vec<PathSeg>, OptimPart<'_>> = BTreeMap::new();
    let mut model_entries: Vec<&IndexEntry> = Vec::new();
    for e in &index.entries {
        if let Some(prefix) = optim_prefix(e) {
            let part = optims.entry(prefix.clone()).or_insert_with(|| OptimPart {
                prefix,
                state_params: BTreeSet::new(),
                group_ids: Vec::new(),
                group_names: Vec::new(),
                entries: Vec::new(),
            });
            part.entries.push(e);
            match &e.role {
                Some(Role::OptimizerState { param, .. }) => {
                    part.state_params.insert(param.clone());
                }
                Some(Role::ParamGroup { .. })
                    if e.path.last() == Some(&PathSeg::Key("params".into())) =>
                {
                    if let Some(serde_json::Value::Array(items)) = &e.value {
                        for v in items {
                            if let Some(i) = v.as_i64() {
                                part.group_ids.push(i);
                            } else if let Some(s) = v.as_str() {
                                part.group_names.push(s.to_owned());
                            }
                        }
                    }
                }
                _ => {}
            }
        } else if e.kind == EntryKind::Tensor {
            model_entries.push(e);
        }
    }
    // Nested when every model tensor sits at least two levels deep: one part per top-level key.
    let nested = !model_entries.is_empty()
        && model_entries
            .iter()
            .all(|e| e.path.len() >= 2 && matches!(e.path[0], PathSeg::Key(_)));
    let mut models: BTreeMap<Option<String>, ModelPart<'_>> = BTreeMap::new();
    for e in model_entries {
        let (name, rel) = if nested {
            (Some(e.path[0].to_string()), join(&e.path[1..]))
        } else {
            (None, e.key.clone())
        };
        models
            .entry(name.clone())
            .or_insert_with(|| ModelPart {
                name,
                entries: BTreeMap::new(),
            })
            .entries
            .insert(rel, e);
    }
    Parts {
        models: models.into_values().collect(),
        optims: optims.into_values().collect(),
    }
}

/// The key as stored, relative to its part.
fn raw_rel(e: &IndexEntry, part: Option<&str>) -> String {
    let raw = e.raw_key.clone().unwrap_or_else(|| e.key.clone());
    match part {
        Some(p) => raw
            .strip_prefix(p)
            .and_then(|r| r.strip_prefix('.'))
            .map_or_else(|| raw.clone(), ToOwned::to_owned),
        None => raw,
    }
}

/// Removes `_orig_mod.` segments (torch.compile) anywhere and leading `module.` segments (DDP,
/// DataParallel).
fn strip_compile_ddp(key: &str) -> String {
    let mut segs: Vec<&str> = key.split('.').filter(|s| *s != "_orig_mod").collect();
    while segs.len() > 1 && segs[0] == "module" {
        segs.remove(0);
    }
    segs.join(".")
}

fn shape_text(s: &[u64]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn numel(s: &[u64]) -> Option<u64> {
    s.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

fn list(keys: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut text = keys
        .iter()
        .take(SHOWN)
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if keys.len() > SHOWN {
        let _ = write!(text, " and {} more", keys.len() - SHOWN);
    }
    text
}

fn quote(path: &str) -> String {
    if !path.is_empty()
        && path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:@%,".contains(c))
    {
        path.to_owned()
    } else {
        format!("'{}'", path.replace('\'', r"'\''"))
    }
}

fn ckpt_arg(label: &str) -> String {
    label.split(' ').map(quote).collect::<Vec<_>>().join(" ")
}

fn fixed_name(label: &str) -> String {
    let first = label.split(' ').next().unwrap_or(label);
    let base = first.trim_end_matches('/');
    let stem = base
        .rsplit_once('.')
        .filter(|(s, e)| !s.is_empty() && !e.contains('/'))
        .map_or(base, |(s, _)| s);
    format!("{stem}.fixed.pt")
}

// ---------------------------------------------------------------------------------------------
// Diagnosis.

/// Diagnoses one checkpoint. `problems` are the index's own [`CheckpointIndex::check`] results
/// (passed in so the caller can add what it found while opening files).
pub fn diagnose(
    index: &CheckpointIndex,
    source: &dyn Source,
    problems: &[Problem],
    options: &Options<'_>,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    coverage(index, problems, &mut findings);
    world_size(index, options, &mut findings);
    let parts = split_parts(index);
    let flat_model: BTreeSet<String> = parts
        .models
        .iter()
        .flat_map(|p| p.entries.keys().map(|k| strip_compile_ddp(k)))
        .collect();
    for part in &parts.models {
        diagnose_model(index, source, part, options, &mut findings);
    }
    if parts.models.is_empty()
        && parts.optims.is_empty()
        && index.entries.iter().all(|e| e.kind != EntryKind::Tensor)
    {
        findings.push(Finding {
            code: "empty-tensor",
            severity: Severity::Error,
            keys: index.files.keys().cloned().collect(),
            message: format!(
                "the checkpoint holds no tensors at all ({} key(s)){}: a state dict taken with rank0_only=True (FSDP1 FullStateDictConfig, or get_model_state_dict with full_state_dict and cpu_offload) is empty on every rank but 0, and this file was written by one of them",
                index.entries.len(),
                options.target.map_or_else(String::new, |t| format!(", where the target expects {} tensors", t.tensors.len()))
            ),
            fix: "save on rank 0 only: `if dist.get_rank() == 0: torch.save(sd, path)`, and use rank 0's file".into(),
        });
    }
    for part in &parts.optims {
        diagnose_optim(part, &flat_model, &parts, options, &mut findings);
    }
    findings
}

fn coverage(index: &CheckpointIndex, problems: &[Problem], out: &mut Vec<Finding>) {
    let mut by_file: BTreeMap<Option<String>, Vec<&Problem>> = BTreeMap::new();
    for p in problems {
        by_file.entry(p.file.clone()).or_default().push(p);
    }
    for (file, ps) in by_file {
        let keys: Vec<String> = ps.iter().map(|p| p.key.clone()).collect();
        let first = ps.first().map_or_else(String::new, ToString::to_string);
        let where_ = file
            .as_deref()
            .map_or_else(String::new, |f| format!(" in {f}"));
        out.push(Finding {
            code: "coverage",
            severity: Severity::Error,
            message: format!(
                "{} tensor(s){where_} are not fully stored: {first}{}. torch would fail reading them or load garbage",
                keys.len(),
                if ps.len() > 1 { " (and more)" } else { "" }
            ),
            keys,
            fix: "copy the checkpoint again from where it was written (a rank's file or a .distcp is missing or cut short); `shardscope verify` lists every damaged chunk".into(),
        });
    }
    // Per-rank files: ranks named by the format that have no file.
    if index.format == Format::TorchSave {
        let have: BTreeSet<u32> = index.files.values().filter_map(|f| f.rank).collect();
        if let Some(expected) = written_world_size(index)
            && !have.is_empty()
        {
            let missing: Vec<String> = (0..expected)
                .filter(|r| u32::try_from(*r).is_ok_and(|r| !have.contains(&r)))
                .map(|r| format!("rank {r}"))
                .collect();
            if !missing.is_empty() {
                out.push(Finding {
                    code: "coverage",
                    severity: Severity::Error,
                    message: format!(
                        "the checkpoint was written by {expected} ranks but the files of {} are not there",
                        missing.join(", ")
                    ),
                    keys: missing,
                    fix: "give every rank's file (all of them, in one folder or as several CKPT arguments)".into(),
                });
            }
        }
    }
}

/// The world size the checkpoint says it was written with (ShardedTensor shard tables, DTensor
/// meshes), else the number of per-rank files.
fn written_world_size(index: &CheckpointIndex) -> Option<u64> {
    for e in &index.entries {
        match &e.fsdp {
            Some(FsdpInfo::ShardedTensor { shards }) if !shards.is_empty() => {
                return Some(shards.len() as u64);
            }
            Some(FsdpInfo::DTensor {
                mesh_shape: Some(mesh),
                ..
            }) => return numel(mesh),
            _ => {}
        }
    }
    let ranks: BTreeSet<u32> = index.files.values().filter_map(|f| f.rank).collect();
    (ranks.len() > 1).then(|| ranks.iter().max().map_or(0, |r| u64::from(*r) + 1))
}

fn world_size(index: &CheckpointIndex, options: &Options<'_>, out: &mut Vec<Finding>) {
    let Some(want) = options.world_size else {
        return;
    };
    // DCP and full checkpoints load into any number of ranks.
    if index.format != Format::TorchSave
        || !matches!(
            index.kind,
            CheckpointKind::Fsdp1Local
                | CheckpointKind::Fsdp1Sharded
                | CheckpointKind::Fsdp2
                | CheckpointKind::RankLocal
        )
    {
        return;
    }
    let Some(have) = written_world_size(index) else {
        return;
    };
    if have == want {
        return;
    }
    let ckpt = ckpt_arg(&options.label);
    let fix = if index.kind == CheckpointKind::Fsdp1Local {
        let model = options
            .model_path
            .as_deref()
            .map_or_else(|| "MODEL.json".to_owned(), quote);
        format!(
            "shardscope reshard {ckpt} --model {model}{} --to-world-size {want} -o resharded",
            if options.use_orig_params {
                " --use-orig-params"
            } else {
                ""
            }
        )
    } else {
        format!(
            "shardscope convert {ckpt} --world-size {want}{} -o ckpt_dcp  # then dcp.load on {want} ranks",
            options
                .api
                .map_or_else(String::new, |a| format!(" --api {a}"))
        )
    };
    out.push(Finding {
        code: "world-size",
        severity: Severity::Error,
        keys: index.files.keys().cloned().collect(),
        message: format!(
            "per-rank files ({}) for {have} ranks, but {want} ranks will load them: each rank's file only fits the rank that wrote it, with the same number of ranks",
            index.kind.describe()
        ),
        fix,
    });
}

#[allow(clippy::too_many_lines)]
fn diagnose_model(
    index: &CheckpointIndex,
    source: &dyn Source,
    part: &ModelPart<'_>,
    options: &Options<'_>,
    out: &mut Vec<Finding>,
) {
    let part_name = part.name.as_deref();
    let ckpt = ckpt_arg(&options.label);
    let in_part = part_name.map_or_else(String::new, |p| format!(" (in `{p}`)"));
    // 1. Wrapper prefixes and key clean-up.
    let target = options.target;
    let mut wrapped: Vec<String> = Vec::new();
    let mut compile_ddp: Vec<String> = Vec::new();
    let mut flat: Vec<(String, &IndexEntry)> = Vec::new();
    let mut names: BTreeMap<String, (String, &IndexEntry)> = BTreeMap::new();
    let all_module = part.entries.keys().all(|k| k.starts_with("module."));
    for (key, e) in &part.entries {
        let raw = raw_rel(e, part_name);
        if raw.contains(&format!("{FSDP_WRAPPED_MODULE}."))
            || raw.contains(&format!("{CHECKPOINT_WRAPPED_MODULE}."))
        {
            wrapped.push(raw.clone());
        }
        if e.flat_param || key.ends_with(FLAT_PARAM) {
            flat.push((raw, e));
            continue;
        }
        let stripped = strip_compile_ddp(key);
        let name = match target {
            Some(t) if t.tensors.contains_key(key) => key.clone(),
            Some(_) => stripped,
            None if key.split('.').any(|s| s == "_orig_mod") || all_module => stripped,
            None => key.clone(),
        };
        if name != *key {
            compile_ddp.push(raw.clone());
        }
        names.entry(name).or_insert((raw, e));
    }
    if !wrapped.is_empty() || !compile_ddp.is_empty() {
        let mut keys: Vec<String> = wrapped.iter().chain(&compile_ddp).cloned().collect();
        keys.sort();
        keys.dedup();
        let mut which: Vec<&str> = Vec::new();
        if keys.iter().any(|k| k.contains(FSDP_WRAPPED_MODULE)) {
            which.push("`_fsdp_wrapped_module.` (FSDP1 wrapping)");
        }
        if keys.iter().any(|k| k.contains(CHECKPOINT_WRAPPED_MODULE)) {
            which.push("`_checkpoint_wrapped_module.` (activation checkpointing)");
        }
        if keys.iter().any(|k| k.split('.').any(|s| s == "_orig_mod")) {
            which.push("`_orig_mod.` (torch.compile)");
        }
        if keys
            .iter()
            .any(|k| k.starts_with("module.") || k.contains("._orig_mod.module."))
        {
            which.push("`module.` (DistributedDataParallel / DataParallel)");
        }
        let only_leading = |p: &str| {
            keys.iter().all(|k| {
                k.starts_with(p)
                    && !k[p.len()..].contains(FSDP_WRAPPED_MODULE)
                    && !k[p.len()..].contains(CHECKPOINT_WRAPPED_MODULE)
            })
        };
        let select = part_name.map_or_else(String::new, |p| format!("{p}."));
        let fix = if compile_ddp.is_empty() {
            // The index already removes FSDP/checkpoint wrapper names: converting writes clean keys.
            format!(
                "shardscope convert {ckpt}{} -o {}",
                part_name.map_or_else(String::new, |p| format!(" --select {p}")),
                fixed_name(&options.label)
            )
        } else if let Some(p) = [
            "_orig_mod.module.",
            "module._orig_mod.",
            "_orig_mod.",
            "module.",
        ]
        .into_iter()
        .find(|p| only_leading(p))
        {
            format!(
                "shardscope convert {ckpt} --select {select}{} -o {}",
                p.trim_end_matches('.'),
                fixed_name(&options.label)
            )
        } else {
            "sd = {k.replace(\"_fsdp_wrapped_module.\", \"\").replace(\"_checkpoint_wrapped_module.\", \"\").replace(\"_orig_mod.\", \"\").removeprefix(\"module.\"): v for k, v in sd.items()}".into()
        };
        out.push(Finding {
            code: "wrapper-prefix",
            severity: Severity::Error,
            message: format!(
                "{} key(s){in_part} carry {} that the {} lacks, e.g. {}: they were saved from the wrapped module, so load_state_dict reports every one of them as unexpected and every parameter as missing",
                keys.len(),
                which.join(", "),
                if target.is_some() { "target model" } else { "unwrapped model" },
                list(&keys)
            ),
            keys,
            fix,
        });
    }
    // 2. Flat parameters.
    let mut explained: BTreeSet<String> = BTreeSet::new();
    if !flat.is_empty() {
        let keys: Vec<String> = flat.iter().map(|(k, _)| k.clone()).collect();
        let model = options
            .model_path
            .as_deref()
            .map_or_else(|| "MODEL.json".to_owned(), quote);
        let mut covered = 0usize;
        if let Some(t) = target {
            for (_, e) in &flat {
                let unit_key = e.key.strip_suffix(FLAT_PARAM).unwrap_or(&e.key);
                let unit = unit_key.trim_end_matches('.');
                let unit = part_name
                    .and_then(|p| unit.strip_prefix(p))
                    .map_or(unit, |u| u.trim_start_matches('.'));
                for k in t.tensors.keys() {
                    if is_under(k, unit) && !names.contains_key(k) && explained.insert(k.clone()) {
                        covered += 1;
                    }
                }
            }
        }
        let local = index.kind == CheckpointKind::Fsdp1Local;
        out.push(Finding {
            code: "flat-param",
            severity: Severity::Error,
            message: format!(
                "{} FSDP1 flat parameter(s){in_part} ({}){}: this is a LOCAL_STATE_DICT, one concatenated, padded 1-D shard per FSDP unit and rank; it loads only into the same FSDP1 wrapping at the same world size under StateDictType.LOCAL_STATE_DICT, never into the model's original parameters",
                keys.len(),
                list(&keys),
                if covered > 0 {
                    format!(" hold the target's {covered} original parameters")
                } else {
                    String::new()
                }
            ),
            keys,
            fix: if local {
                format!(
                    "shardscope convert {ckpt} --model {model}{} -o {}  # all ranks' files; --model from `shardscope layout`",
                    if options.use_orig_params {
                        " --use-orig-params"
                    } else {
                        ""
                    },
                    fixed_name(&options.label)
                )
            } else {
                "save with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT) (or SHARDED_STATE_DICT) instead of LOCAL_STATE_DICT".into()
            },
        });
    }
    // 3. Against the target, or alone.
    let Some(t) = target else {
        // Alone, a 0-element tensor may be real (an empty buffer); a part whose every tensor is
        // empty is the signature of another rank's view.
        let empty: Vec<(&String, &String)> = names
            .iter()
            .filter(|(_, (_, e))| e.numel() == Some(0))
            .map(|(name, (raw, _))| (name, raw))
            .collect();
        if empty.len() >= 2 && empty.len() == names.len() {
            for (name, raw) in empty {
                out.push(empty_finding(raw, name, None, &in_part));
            }
        }
        return;
    };
    let present: BTreeSet<String> = names.keys().cloned().collect();
    let mut missing = Vec::new();
    for (key, want) in &t.tensors {
        let Some((raw, e)) = names.get(key) else {
            if explained.contains(key) || t.tied_partner_present(key, &present).is_some() {
                continue;
            }
            missing.push(key.clone());
            continue;
        };
        compare(index, source, key, raw, e, want, &in_part, out);
    }
    if !missing.is_empty() {
        out.push(Finding {
            code: "missing-key",
            severity: Severity::Error,
            message: format!(
                "the target expects {} key(s){in_part} the checkpoint does not have (after removing wrapper prefixes): {}",
                missing.len(),
                list(&missing)
            ),
            fix: format!(
                "model.load_state_dict(sd, strict=False)  # only if the {} missing key(s) may keep their initial values; else find the checkpoint that has them",
                missing.len()
            ),
            keys: missing,
        });
    }
    let unexpected: Vec<String> = names
        .iter()
        .filter(|(k, _)| !t.tensors.contains_key(*k))
        .map(|(_, (raw, _))| raw.clone())
        .collect();
    if !unexpected.is_empty() {
        let description = t.kind == TargetKind::Description;
        out.push(Finding {
            code: "unexpected-key",
            severity: if description {
                Severity::Warning
            } else {
                Severity::Error
            },
            message: format!(
                "{} key(s){in_part} are not in the target{}: {}",
                unexpected.len(),
                if description {
                    " (a model description lists parameters only: these may be buffers)"
                } else {
                    ""
                },
                list(&unexpected)
            ),
            fix: format!(
                "for k in {:?}: sd.pop(k)",
                unexpected.iter().take(8).collect::<Vec<_>>()
            ),
            keys: unexpected,
        });
    }
}

fn empty_finding(raw: &str, key: &str, want: Option<&TargetTensor>, in_part: &str) -> Finding {
    Finding {
        code: "empty-tensor",
        severity: Severity::Error,
        keys: vec![raw.to_owned()],
        message: format!(
            "`{key}`{in_part} has 0 elements{}: a state dict taken on a rank that holds no data for it (a rank0_only / FULL_STATE_DICT save written by a rank other than 0, or a sharded parameter view of another rank)",
            want.map_or_else(String::new, |w| format!(
                " where the target expects {}",
                shape_text(&w.shape)
            ))
        ),
        fix: "save on rank 0 only: `if dist.get_rank() == 0: torch.save(sd, path)` (with rank0_only=True the other ranks' state dicts are empty)".into(),
    }
}

#[allow(clippy::too_many_arguments)]
#[allow(
    clippy::too_many_lines,
    reason = "one check per way a stored tensor can disagree with the model, in the order they are reported"
)]
fn compare(
    index: &CheckpointIndex,
    source: &dyn Source,
    key: &str,
    raw: &str,
    e: &IndexEntry,
    want: &TargetTensor,
    in_part: &str,
    out: &mut Vec<Finding>,
) {
    let Some(shape) = e.shape.clone().or_else(|| {
        // Rank-local pieces: judge by the first piece.
        e.chunks.first().map(|c| c.sizes.clone())
    }) else {
        return;
    };
    let (Some(have_n), Some(want_n)) = (numel(&shape), numel(&want.shape)) else {
        return;
    };
    let ws = shape_text(&want.shape);
    let hs = shape_text(&shape);
    if shape == want.shape {
        if let (Some(have), Some(target)) = (e.dtype, want.dtype)
            && have != target
        {
            out.push(Finding {
                code: "dtype-mismatch",
                severity: Severity::Warning,
                keys: vec![raw.to_owned()],
                message: format!(
                    "`{key}`{in_part} is {} but the target is {}: load_state_dict copies it with a cast{}",
                    have.torch_name(),
                    target.torch_name(),
                    if have.size_bytes() > target.size_bytes() {
                        " (precision is lost)"
                    } else {
                        ""
                    }
                ),
                fix: format!(
                    "sd[{key:?}] = sd[{key:?}].to({})  # optional: torch casts on load",
                    target.torch_name()
                ),
            });
        }
        return;
    }
    let finding = |code: &'static str, message: String, fix: String| Finding {
        code,
        severity: Severity::Error,
        keys: vec![raw.to_owned()],
        message,
        fix,
    };
    let torch_size = format!("torch.Size({})", shape_text(&want.shape));
    if have_n == 0 && want_n > 0 {
        out.push(empty_finding(raw, key, Some(want), in_part));
        return;
    }
    if shape.len() == 1 && want.shape.len() != 1 && have_n == want_n {
        out.push(finding(
            "flattened-shape",
            format!(
                "`{key}`{in_part} is 1-D {hs} with exactly the {want_n} elements of the target's {ws}: an FSDP flat view (e.g. named_parameters() of FSDP1 with use_orig_params=True, outside summon_full_params) saved instead of the parameter"
            ),
            format!("sd[{key:?}] = sd[{key:?}].view({ws})  # or save inside FSDP.summon_full_params(model)"),
        ));
        return;
    }
    if shape.len() == 1 && have_n < want_n && want.shape.len() != 1 {
        out.push(finding(
            "local-shard",
            format!(
                "`{key}`{in_part} is a 1-D piece {hs} of {have_n} of the target's {want_n} elements ({ws}): one rank's slice of an FSDP flat parameter, not the whole parameter"
            ),
            "take a full state dict: `with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT): sd = model.state_dict()`, or DCP (dcp.save) from every rank".into(),
        ));
        return;
    }
    let same_rest =
        shape.len() == want.shape.len() && !shape.is_empty() && shape[1..] == want.shape[1..];
    if same_rest
        && want.shape[0] > 0
        && shape[0] > want.shape[0]
        && shape[0].is_multiple_of(want.shape[0])
    {
        let n = shape[0] / want.shape[0];
        if pieces_identical(index, source, e, n) == Some(true) {
            out.push(finding(
                "replicated-concatenated",
                format!(
                    "`{key}`{in_part} is {hs}: {n} identical copies of the target's {ws} stacked on dim 0; a replicated tensor (a buffer every rank holds whole) was concatenated across {n} ranks as if it were sharded"
                ),
                format!("sd[{key:?}] = sd[{key:?}][:{}].clone()", want.shape[0]),
            ));
            return;
        }
    }
    if same_rest && shape[0] > 0 && shape[0] < want.shape[0] {
        let d = want.shape[0];
        // torch.chunk / Shard(0): every rank but the last holds ceil(d / n) rows.
        let ways: Vec<u64> = (2..=d.min(4096))
            .filter(|&n| d.div_ceil(n) == shape[0] || (d.is_multiple_of(n) && d / n == shape[0]))
            .collect();
        if let Some(&n) = ways.first() {
            out.push(finding(
                "local-shard",
                format!(
                    "`{key}`{in_part} is {hs}, the target's {ws} with dim 0 split {n} ways: one rank's shard (DTensor.to_local() or a ShardedTensor's local shard) saved as if it were the full tensor"
                ),
                "save a full state dict: `sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))` (torch.distributed.checkpoint.state_dict), on every rank, then torch.save on rank 0".into(),
            ));
            return;
        }
    }
    out.push(finding(
        "shape-mismatch",
        format!(
            "`{key}`{in_part} is {hs} but the target expects {ws} ({torch_size}): the checkpoint was saved from a model of another configuration (sizes differ, not a sharding artefact)"
        ),
        format!("check the model configuration (the dimension that differs decides which setting); or skip it: sd.pop({key:?}); model.load_state_dict(sd, strict=False)"),
    ));
}

/// Whether the `n` equal dim-0 pieces of the entry hold identical bytes; `None` when the values
/// cannot be read.
fn pieces_identical(
    index: &CheckpointIndex,
    source: &dyn Source,
    e: &IndexEntry,
    n: u64,
) -> Option<bool> {
    const LIMIT: u64 = 256 << 20;
    if e.nbytes()? > LIMIT || n < 2 {
        return None;
    }
    let data = index.read_tensor(source, e).ok()?;
    let len = u64::try_from(data.bytes.len()).ok()?;
    if len % n != 0 {
        return None;
    }
    let piece = usize::try_from(len / n).ok()?;
    if piece == 0 {
        return None;
    }
    let first = &data.bytes[..piece];
    Some(data.bytes.chunks(piece).all(|c| c == first))
}

#[allow(
    clippy::too_many_lines,
    reason = "both optimizer key forms (FQN-keyed and id-keyed) are diagnosed side by side against the same parameter list"
)]
fn diagnose_optim(
    part: &OptimPart<'_>,
    model_keys: &BTreeSet<String>,
    parts: &Parts<'_>,
    options: &Options<'_>,
    out: &mut Vec<Finding>,
) {
    let prefix = join(&part.prefix);
    let where_ = if prefix.is_empty() {
        "the optimizer state".to_owned()
    } else {
        format!("the optimizer state `{prefix}`")
    };
    let target_params: Option<BTreeSet<String>> = options
        .target
        .map(|t| t.tensors.keys().cloned().collect())
        .or_else(|| (!model_keys.is_empty()).then(|| model_keys.clone()));
    let has_flat = parts
        .models
        .iter()
        .any(|m| m.entries.values().any(|e| e.flat_param));
    let mut bad: Vec<String> = Vec::new();
    let mut reasons: Vec<String> = Vec::new();
    // FQN-keyed state (FSDP.optim_state_dict, get_optimizer_state_dict).
    let names: BTreeSet<String> = part
        .state_params
        .iter()
        .filter_map(|p| match p {
            PathSeg::Key(k) if k.parse::<i64>().is_err() => Some(k.clone()),
            PathSeg::Key(_) | PathSeg::Index(_) => None,
        })
        .chain(part.group_names.iter().cloned())
        .collect();
    if let Some(params) = &target_params
        && !names.is_empty()
    {
        let unknown: Vec<String> = names
            .iter()
            .filter(|n| {
                !params.contains(*n)
                    && !params
                        .contains(&strip_compile_ddp(&crate::model::fqn::clean_tensor_name(n)))
            })
            .cloned()
            .collect();
        if !unknown.is_empty() {
            reasons.push(format!(
                "it names {} parameter(s) the {} does not have: {}",
                unknown.len(),
                if options.target.is_some() {
                    "target"
                } else {
                    "model part"
                },
                list(&unknown)
            ));
            bad.extend(unknown);
        }
    }
    // Id-keyed state (optim.state_dict()).
    let ids: BTreeSet<i64> = part
        .state_params
        .iter()
        .filter_map(|p| match p {
            PathSeg::Index(i) => Some(*i),
            PathSeg::Key(k) => k.parse().ok(),
        })
        .collect();
    let at = |what: String| {
        if prefix.is_empty() {
            what
        } else {
            format!("{prefix}.{what}")
        }
    };
    let group_ids: BTreeSet<i64> = part.group_ids.iter().copied().collect();
    let stray: Vec<i64> = ids.difference(&group_ids).copied().collect();
    if !stray.is_empty() && !group_ids.is_empty() {
        reasons.push(format!(
            "state holds parameter ids {stray:?} that no param_group lists"
        ));
        bad.extend(stray.iter().map(|i| at(format!("state.{i}"))));
    }
    // torch numbers the parameters of all param_groups 0..n-1 in order.
    let listed = i64::try_from(part.group_ids.len()).unwrap_or(i64::MAX);
    let gaps: Vec<i64> = group_ids
        .iter()
        .copied()
        .filter(|&i| i < 0 || i >= listed)
        .collect();
    if !gaps.is_empty() || group_ids.len() != part.group_ids.len() {
        reasons.push(format!(
            "its param_groups list ids {:?}, not 0..{}: optimizer.state_dict() numbers parameters consecutively, so these ids were edited or merged from another optimizer",
            part.group_ids,
            part.group_ids.len()
        ));
        bad.extend(gaps.iter().map(|i| at(format!("state.{i}"))));
        bad.push(at("param_groups".into()));
    }
    // Without listed ids (DCP keeps param_groups as bytes items): the state's ids.
    let count = if group_ids.is_empty() {
        ids.last()
            .and_then(|&m| usize::try_from(m).ok())
            .map_or(0, |m| m.saturating_add(1))
    } else {
        group_ids.len()
    };
    if let Some(t) = options.target
        && !has_flat
        && count > 0
    {
        let too_few = !group_ids.is_empty() && t.trainable.is_some_and(|min| count < min);
        let too_many = count > t.params;
        if too_many || too_few {
            reasons.push(format!(
                "its param_groups list {count} parameter ids but the target has {} parameter(s){}; optimizer.load_state_dict pairs ids with model.parameters() by position, so it belongs to another model",
                t.params,
                t.trainable
                    .map_or_else(String::new, |m| format!(" ({m} trainable)"))
            ));
            bad.push(at("param_groups".into()));
        }
    }
    if reasons.is_empty() {
        return;
    }
    bad.sort();
    bad.dedup();
    out.push(Finding {
        code: "optimizer-mismatch",
        severity: Severity::Error,
        message: format!("{where_} does not match the model's parameters: {}", reasons.join("; ")),
        keys: bad,
        fix: "rebuild the optimizer over the model the checkpoint was trained with, or start the optimizer fresh: load only the model part (model.load_state_dict(ckpt[\"model\"]))".into(),
    });
}

/// Findings for files that cannot be read (a truncated file, a missing `.distcp`): `coverage`.
pub fn unreadable_file(file: &str, what: &str) -> Finding {
    Finding {
        code: "coverage",
        severity: Severity::Error,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} cannot be read: {what}; the tensors it holds are lost for this checkpoint"
        ),
        fix: format!(
            "copy {file} again from where the checkpoint was written (it is cut short or damaged); `ls -l` it against the original"
        ),
    }
}

/// A finding for a file that reads but holds a layout shardscope does not read (`what`): the file
/// is not damaged, and copying it again would not help. A warning: nothing is known to be wrong,
/// but nothing in it was checked.
pub fn unsupported_file(file: &str, what: &str) -> Finding {
    Finding {
        code: "unsupported",
        severity: Severity::Warning,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} is an intact archive in a layout shardscope does not read, so it could not be checked: {what}"
        ),
        fix: "save the checkpoint with torch.distributed.checkpoint (dcp.save), which shardscope reads for every placement, or convert it with torch (get_model_state_dict / get_optimizer_state_dict with full_state_dict=True)".to_owned(),
    }
}

/// A finding for a pickle that names globals outside torch's `weights_only=True` allowlist.
pub fn unsafe_pickle(file: &str, globals: &[String]) -> Finding {
    Finding {
        code: "unsafe-pickle",
        severity: Severity::Error,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} names {} global(s) outside torch's weights_only allowlist: {}. torch.load (weights_only=True, the default) refuses it; torch.load(weights_only=False) would import and may call them (run code). shardscope never executes them",
            globals.len(),
            list(globals)
        ),
        fix: format!(
            "shardscope convert {} -o {}.safetensors  # keeps the tensors, drops the code, without running it",
            quote(file),
            file.rsplit_once('.').map_or(file, |(s, _)| s)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(module: &str, name: &str) -> Global {
        Global {
            module: module.into(),
            name: name.into(),
        }
    }

    #[test]
    fn allowlist_follows_torch() {
        for (m, n) in [
            ("collections", "OrderedDict"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch", "FloatStorage"),
            ("torch", "bfloat16"),
            ("torch", "float8_e4m3fn"),
            ("torch", "uint3"),
            ("torch", "int7"),
            ("__builtin__", "set"),
            ("torch.nn.parameter", "Parameter"),
        ] {
            assert!(weights_only_allows(&g(m, n)), "{m}.{n}");
        }
        for (m, n) in [
            ("posix", "system"),
            ("os", "system"),
            ("builtins", "eval"),
            ("torch", "load"),
            ("torch", "int8x"),
            ("__main__", "Net"),
            ("numpy.core.multiarray", "_reconstruct"),
        ] {
            assert!(!weights_only_allows(&g(m, n)), "{m}.{n}");
        }
        assert_eq!(
            unsafe_globals(&[
                g("posix", "system"),
                g("torch.distributed.tensor", "DTensor"),
                g("torch._utils", "_rebuild_tensor_v2"),
            ]),
            vec!["posix.system".to_owned()]
        );
    }

    #[test]
    fn compile_and_ddp_prefixes_strip() {
        assert_eq!(
            strip_compile_ddp("_orig_mod.block.0.weight"),
            "block.0.weight"
        );
        assert_eq!(strip_compile_ddp("module._orig_mod.a"), "a");
        assert_eq!(strip_compile_ddp("block._orig_mod.w"), "block.w");
        assert_eq!(strip_compile_ddp("module"), "module");
        assert_eq!(fixed_name("out/ckpt.pt"), "out/ckpt.fixed.pt");
        assert_eq!(fixed_name("ranks/"), "ranks.fixed.pt");
        assert_eq!(quote("a b"), "'a b'");
    }
}
