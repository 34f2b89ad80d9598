//! Name mappings between model families as data: one declarative JSON file per architecture
//! (`builtin/*.json`, or a user's file), read here into a [`MappingFile`], chosen for a
//! checkpoint by [`choose`], and turned by [`plan`] into the tensors of the other naming, each a
//! [`Recipe`] over the stored tensors: a rename, or reads (whole tensors or dim-0 rows) followed
//! by [`ops`] (RoPE permutation by heads, transpose, reshape, slice, concatenation).
//!
//! # The file
//! ```json
//! {"version": 1, "name": "torchtitan-llama3", "from": "torchtitan", "to": "hf",
//!  "match": {"architectures": ["LlamaForCausalLM"], "model_type": ["llama"],
//!            "keys": ["tok_embeddings.weight"], "target_keys": ["model.embed_tokens.weight"]},
//!  "defaults": {"head_dim": "hidden_size/num_attention_heads"},
//!  "tie": {"flag": "tie_word_embeddings", "default": false,
//!          "keep": "model.embed_tokens.weight", "drop": "lm_head.weight"},
//!  "rules": [
//!    {"from": "layers.{L}.attention.wq.weight", "to": "model.layers.{L}.self_attn.q_proj.weight",
//!     "ops": [{"op": "rope", "heads": "num_attention_heads"}],
//!     "shape": ["num_attention_heads*head_dim", "hidden_size"]},
//!    {"from": "layers.{L}.moe.experts.w1", "to": "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
//!     "split": {"dim": 0, "capture": "E", "count": "n_routed_experts"}},
//!    {"from": "freqs_cis", "drop": true},
//!    {"from": "layers.{L}.moe.expert_bias_E", "drop": true, "shape": ["num_local_experts"],
//!     "restore": {"zeros": "float32", "beside": "layers.{L}.moe.router.gate.weight"}}]}
//! ```
//! - Patterns capture a word (letters, digits, `_`) with `{L}` and any text with `{K*}`; the `to`
//!   side fills them in.
//! - `ops` apply in order to each output: `rope` (torchtitan's interleaved rows → HF's halves, by
//!   the config's head count), `unrope`, `transpose` (`dims`), `reshape` (`shape`, expressions;
//!   `-1` inferred).
//! - `split` makes several outputs of one stored tensor: `count` outputs indexed along `dim` (the
//!   dimension goes; experts one by one), or named `parts` (equal, or `sizes`) that keep it;
//!   `pre` ops apply before the split.
//! - `shape` is the `to` side's shape as expressions over the config (`+ - * /`, fields, integers;
//!   `defaults` for fields a config may omit): every tensor is checked against it, and a mismatch
//!   names the tensor and the fields.
//! - `drop` leaves a stored tensor out. With `restore`, the way back writes it again as zeros of
//!   `shape` in the dtype named by `zeros`, once for each output matching `beside` (a buffer the
//!   other side has no use for, which the model needs to load: torchtitan's MoE `expert_bias_E`).
//! - `tie`: with the config's `flag` true, `drop` is one tensor with `keep` and is not written;
//!   the way back writes it from `keep` when the input has only `keep`.
//!
//! The same file maps back ([`Direction::Backward`]): renames reversed, `rope` ↔ `unrope`,
//! `transpose` undone, a `count` split stacked and `parts` concatenated (rules with `reshape`
//! cannot be reversed, and say so).

pub mod expr;
pub mod ops;
mod restore;

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use serde::Deserialize;

use crate::dtype::DType;

pub use expr::{Captures, Config, Pattern};
pub use ops::Dense;
use restore::restore_dropped;
pub use restore::restored_as_zeros;

/// What is wrong with a mapping, a config, or a checkpoint against them.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MappingError {
    #[error("mapping file: {0}")]
    Spec(String),
    #[error("config: {0}")]
    Config(String),
    #[error("{0}")]
    Plan(String),
    #[error("{0}")]
    Apply(String),
}

/// The built-in mapping files: `(file name, text)`.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "torchtitan_llama3.json",
        include_str!("builtin/torchtitan_llama3.json"),
    ),
    (
        "torchtitan_qwen3.json",
        include_str!("builtin/torchtitan_qwen3.json"),
    ),
    (
        "torchtitan_deepseek_v3.json",
        include_str!("builtin/torchtitan_deepseek_v3.json"),
    ),
    (
        "torchtitan_gpt_oss.json",
        include_str!("builtin/torchtitan_gpt_oss.json"),
    ),
    (
        "megatron_gpt.json",
        include_str!("builtin/megatron_gpt.json"),
    ),
    ("hf.json", include_str!("builtin/hf.json")),
];

/// A mapping file, parsed.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingFile {
    pub version: u32,
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The naming of the stored side (`torchtitan`, `megatron`, `hf`).
    pub from: String,
    /// The naming written (`hf`).
    pub to: String,
    #[serde(rename = "match", default)]
    pub matches: Match,
    #[serde(default)]
    pub defaults: BTreeMap<String, String>,
    #[serde(default)]
    pub tie: Option<Tie>,
    pub rules: Vec<RuleSpec>,
    /// Where it came from (a built-in's file name, or the path given), for messages.
    #[serde(skip)]
    pub origin: String,
}

/// When a mapping applies.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// The config's `architectures` (one in common), `*` for any.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// The config's `model_type` (one of these).
    #[serde(default)]
    pub model_type: Vec<String>,
    /// Patterns each matching some stored name (`from` side).
    #[serde(default)]
    pub keys: Vec<String>,
    /// Patterns of which at least one matches some stored name (`from` side; none: no condition).
    #[serde(default)]
    pub any_keys: Vec<String>,
    /// Patterns each matching some name of the `to` side (read by the way back; none: the file
    /// is not read backward).
    #[serde(default)]
    pub target_keys: Vec<String>,
}

/// Tied tensors (`to` side names).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tie {
    pub flag: String,
    #[serde(default)]
    pub default: bool,
    pub keep: String,
    pub drop: String,
}

/// One rule of a mapping file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    pub from: String,
    #[serde(default)]
    pub to: Option<String>,
    #[serde(default)]
    pub drop: bool,
    #[serde(default)]
    pub ops: Vec<OpSpec>,
    #[serde(default)]
    pub split: Option<SplitSpec>,
    /// Further splits of each piece of `split`, in order (Megatron's stacked layers, then q/k/v);
    /// such a rule is read forward only.
    #[serde(default)]
    pub splits: Vec<SplitSpec>,
    #[serde(default)]
    pub shape: Option<Vec<String>>,
    /// With `drop`: what the way back writes in its place.
    #[serde(default)]
    pub restore: Option<RestoreSpec>,
}

/// A dropped tensor written back as zeros (`drop` + `restore`), once for each output of the way
/// back whose name matches `beside` (the captures fill `from`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreSpec {
    /// The dtype of the zeros (`float32`, ...).
    pub zeros: String,
    pub beside: String,
}

/// Several outputs of one stored tensor.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitSpec {
    pub dim: usize,
    pub capture: String,
    /// Outputs `0..count` along `dim` (the dimension is removed).
    #[serde(default)]
    pub count: Option<String>,
    /// Named parts along `dim` (the dimension is kept), equal unless `sizes` are given.
    #[serde(default)]
    pub parts: Vec<String>,
    #[serde(default)]
    pub sizes: Vec<String>,
    /// Ops applied to the stored tensor before it is split.
    #[serde(default)]
    pub pre: Vec<OpSpec>,
}

/// An operation as a file writes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum OpSpec {
    Rope { heads: String },
    Unrope { heads: String },
    Transpose { dims: [usize; 2] },
    Reshape { shape: Vec<String> },
}

/// An operation with its numbers resolved from the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Rope {
        heads: u64,
        inverse: bool,
    },
    /// Swaps two dimensions (made contiguous).
    Transpose(usize, usize),
    /// A shape (one `None`: inferred from the element count).
    Reshape(Vec<Option<u64>>),
    Slice {
        dim: usize,
        start: u64,
        len: u64,
    },
    /// Removes dimension `dim` (of size 1).
    Squeeze(usize),
    /// Inserts a dimension of size 1 at `dim`.
    Unsqueeze(usize),
}

impl Op {
    /// The shape after the op, or why it does not apply.
    pub fn shape_after(&self, shape: &[u64]) -> Result<Vec<u64>, MappingError> {
        let bad = |what: String| MappingError::Apply(what);
        Ok(match self {
            Op::Rope { heads, .. } => {
                let rows = shape.first().copied().unwrap_or(0);
                if shape.len() < 2 || *heads == 0 || rows % (heads * 2) != 0 {
                    return Err(bad(format!(
                        "shape {shape:?} is not {heads} heads of an even head size"
                    )));
                }
                shape.to_vec()
            }
            Op::Transpose(a, b) => {
                if *a >= shape.len() || *b >= shape.len() {
                    return Err(bad(format!(
                        "cannot transpose dimensions {a} and {b} of {shape:?}"
                    )));
                }
                let mut s = shape.to_vec();
                s.swap(*a, *b);
                s
            }
            Op::Reshape(dims) => resolve_reshape(dims, shape)?,
            Op::Slice { dim, start, len } => {
                let size = shape.get(*dim).copied().unwrap_or(0);
                if *dim >= shape.len() || start.saturating_add(*len) > size {
                    return Err(bad(format!(
                        "{start}..{} is outside dimension {dim} of {shape:?}",
                        start.saturating_add(*len)
                    )));
                }
                let mut s = shape.to_vec();
                s[*dim] = *len;
                s
            }
            Op::Squeeze(dim) => {
                if shape.get(*dim) != Some(&1) {
                    return Err(bad(format!("dimension {dim} of {shape:?} is not 1")));
                }
                let mut s = shape.to_vec();
                s.remove(*dim);
                s
            }
            Op::Unsqueeze(dim) => {
                if *dim > shape.len() {
                    return Err(bad(format!("no dimension {dim} to insert in {shape:?}")));
                }
                let mut s = shape.to_vec();
                s.insert(*dim, 1);
                s
            }
        })
    }

    /// Applies the op to a tensor's bytes.
    pub fn apply(&self, t: Dense) -> Result<Dense, MappingError> {
        match self {
            Op::Rope { heads, inverse } => ops::rope(t, *heads, *inverse),
            Op::Transpose(a, b) => {
                let mut perm: Vec<usize> = (0..t.shape.len()).collect();
                if *a >= perm.len() || *b >= perm.len() {
                    return Err(MappingError::Apply(format!(
                        "cannot transpose dimensions {a} and {b} of {:?}",
                        t.shape
                    )));
                }
                perm.swap(*a, *b);
                t.permute(&perm)
            }
            Op::Slice { dim, start, len } => t.slice(*dim, *start, *len),
            Op::Reshape(_) | Op::Squeeze(_) | Op::Unsqueeze(_) => {
                let shape = self.shape_after(&t.shape)?;
                t.reshape(&shape)
            }
        }
    }
}

fn resolve_reshape(dims: &[Option<u64>], shape: &[u64]) -> Result<Vec<u64>, MappingError> {
    let total: u64 = shape.iter().product();
    let known: u64 = dims.iter().flatten().product();
    let inferred = dims.iter().filter(|d| d.is_none()).count();
    let out: Vec<u64> = match inferred {
        0 => dims.iter().flatten().copied().collect(),
        1 if known != 0 && total.is_multiple_of(known) => {
            dims.iter().map(|d| d.unwrap_or(total / known)).collect()
        }
        _ => {
            return Err(MappingError::Apply(format!(
                "cannot reshape {shape:?} to {dims:?}"
            )));
        }
    };
    if out.iter().product::<u64>() != total {
        return Err(MappingError::Apply(format!(
            "cannot reshape {shape:?} to {out:?}"
        )));
    }
    Ok(out)
}

/// Which way a file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the file's `from` naming to its `to` naming.
    Forward,
    /// From `to` back to `from`.
    Backward,
}

/// One read of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub source: String,
    /// Rows of dim 0 only (an expert of a grouped tensor); `None`: the whole tensor.
    pub rows: Option<Range<u64>>,
    /// Applied to what was read.
    pub ops: Vec<Op>,
}

/// How an output tensor is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recipe {
    /// The stored tensor as it is, under another name.
    Copy { source: String },
    /// Zeros of this shape (a dropped buffer written back: `restore`).
    Zeros { shape: Vec<u64> },
    /// Reads, each with its ops; several are joined along `concat_dim`; then `ops`.
    Derived {
        reads: Vec<Read>,
        concat_dim: usize,
        ops: Vec<Op>,
    },
}

impl Recipe {
    /// The stored tensors the output reads.
    pub fn sources(&self) -> Vec<&str> {
        match self {
            Recipe::Copy { source } => vec![source.as_str()],
            Recipe::Derived { reads, .. } => reads.iter().map(|r| r.source.as_str()).collect(),
            Recipe::Zeros { .. } => Vec::new(),
        }
    }
}

/// One output tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub recipe: Recipe,
}

/// What a mapping makes of a checkpoint's tensors.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub outputs: Vec<Planned>,
    /// Stored tensors a rule drops.
    pub dropped: Vec<String>,
    /// A tie: the output not written, which must equal the one kept (the caller checks the bytes).
    pub tied: Option<Tied>,
}

/// Two outputs that a tied config holds once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tied {
    /// The name written.
    pub kept: String,
    /// The output not written (with its recipe, to compare).
    pub dropped: Planned,
}

/// A stored tensor: name, dtype, shape.
#[derive(Debug, Clone)]
pub struct Stored {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

/// Parses a mapping file's text; `origin` names it in messages.
pub fn parse(text: &str, origin: &str) -> Result<MappingFile, MappingError> {
    let mut file: MappingFile =
        serde_json::from_str(text).map_err(|e| MappingError::Spec(format!("{origin}: {e}")))?;
    origin.clone_into(&mut file.origin);
    if file.version != 1 {
        return Err(MappingError::Spec(format!(
            "{origin}: version {} (this shardscope reads version 1)",
            file.version
        )));
    }
    for (i, r) in file.rules.iter().enumerate() {
        let at =
            |what: String| MappingError::Spec(format!("{origin}: rule {i} (`{}`): {what}", r.from));
        let from = Pattern::parse(&r.from).map_err(|e| at(e.to_string()))?;
        match (&r.to, r.drop) {
            (Some(_), true) => return Err(at("`to` and `drop` together".to_owned())),
            (None, false) => return Err(at("needs `to` or `drop`".to_owned())),
            _ => {}
        }
        if let Some(restore) = &r.restore {
            if !r.drop {
                return Err(at("`restore` goes with `drop`".to_owned()));
            }
            if r.shape.is_none() {
                return Err(at("`restore` needs the tensor's `shape`".to_owned()));
            }
            if restore.zeros.parse::<DType>().is_err() {
                return Err(at(format!("`restore`: `{}` is not a dtype", restore.zeros)));
            }
            let beside = Pattern::parse(&restore.beside).map_err(|e| at(e.to_string()))?;
            let from_caps: BTreeSet<&str> = from.captures().collect();
            let beside_caps: BTreeSet<&str> = beside.captures().collect();
            if !from_caps.is_subset(&beside_caps) {
                return Err(at(format!(
                    "`restore.beside` captures {beside_caps:?}, which do not fill {from_caps:?}"
                )));
            }
        }
        if let Some(to) = &r.to {
            let to = Pattern::parse(to).map_err(|e| at(e.to_string()))?;
            let from_caps: BTreeSet<&str> = from.captures().collect();
            let to_caps: BTreeSet<&str> = to.captures().collect();
            let split_caps = r.split.iter().chain(&r.splits).map(|s| s.capture.as_str());
            let want: BTreeSet<&str> = from_caps.iter().copied().chain(split_caps).collect();
            if want != to_caps {
                return Err(at(format!(
                    "`to` captures {to_caps:?} but `from` (and the split) capture {want:?}"
                )));
            }
        }
        if let Some(s) = &r.split
            && s.count.is_some() != s.parts.is_empty()
        {
            return Err(at(
                "a split has `count` or `parts`, one of the two".to_owned()
            ));
        }
        if let Some(s) = &r.split
            && !s.sizes.is_empty()
            && s.sizes.len() != s.parts.len()
        {
            return Err(at("`sizes` has one size per part".to_owned()));
        }
    }
    Ok(file)
}

/// The built-in mappings, parsed.
pub fn builtin() -> Vec<MappingFile> {
    BUILTIN
        .iter()
        .map(|(name, text)| {
            #[allow(clippy::expect_used, reason = "built-in files are tested to parse")]
            parse(text, name).expect("built-in mapping parses")
        })
        .collect()
}

fn config_names(config: &serde_json::Value, field: &str) -> Vec<String> {
    match config.get(field) {
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// Whether `file` fits a config and stored names read in `direction`.
pub fn fits(
    file: &MappingFile,
    config: &serde_json::Value,
    names: &[&str],
    direction: Direction,
) -> bool {
    let archs = config_names(config, "architectures");
    let types = config_names(config, "model_type");
    let m = &file.matches;
    let arch_ok = m
        .architectures
        .iter()
        .any(|a| a == "*" || archs.contains(a))
        || m.model_type.iter().any(|t| types.contains(t));
    let keys = match direction {
        Direction::Forward => &m.keys,
        // A file without `target_keys` is not read backward (its rules may not invert).
        Direction::Backward if m.target_keys.is_empty() => return false,
        Direction::Backward => &m.target_keys,
    };
    let present =
        |k: &String| Pattern::parse(k).is_ok_and(|p| names.iter().any(|n| p.matches(n).is_some()));
    let keys_ok = keys.iter().all(present);
    let any_ok =
        direction == Direction::Backward || m.any_keys.is_empty() || m.any_keys.iter().any(present);
    arch_ok && keys_ok && any_ok
}

/// The first of `files` whose `to` (forward) or `from` (backward) is `target` and that fits.
pub fn choose<'f>(
    files: &'f [MappingFile],
    target: &str,
    config: &serde_json::Value,
    names: &[&str],
) -> Result<(&'f MappingFile, Direction), MappingError> {
    for f in files {
        if f.to == target && fits(f, config, names, Direction::Forward) {
            return Ok((f, Direction::Forward));
        }
        if f.from == target && f.to != f.from && fits(f, config, names, Direction::Backward) {
            return Ok((f, Direction::Backward));
        }
    }
    let archs = config_names(config, "architectures");
    let types = config_names(config, "model_type");
    let shown: Vec<&str> = names.iter().take(3).copied().collect();
    Err(MappingError::Plan(format!(
        "no mapping to `{target}` fits this checkpoint (config architectures {archs:?}, model_type {types:?}; stored names such as {shown:?}); tried: {}\nhint: write a mapping file for it (see docs/mappings.md) and pass --mapping FILE",
        files
            .iter()
            .map(|f| format!("{} ({} -> {})", f.name, f.from, f.to))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// A rule with its patterns parsed, read in one direction.
struct Rule<'s> {
    spec: &'s RuleSpec,
    /// The side read.
    read: Pattern,
    /// The side written (`None`: dropped).
    write: Option<Pattern>,
}

fn resolve_ops(specs: &[OpSpec], config: &Config, inverse: bool) -> Result<Vec<Op>, MappingError> {
    let mut out = Vec::new();
    for s in specs {
        out.push(match s {
            OpSpec::Rope { heads } => Op::Rope {
                heads: config.eval(heads)?,
                inverse,
            },
            OpSpec::Unrope { heads } => Op::Rope {
                heads: config.eval(heads)?,
                inverse: !inverse,
            },
            OpSpec::Transpose { dims } => Op::Transpose(dims[0], dims[1]),
            OpSpec::Reshape { shape } => {
                if inverse {
                    return Err(MappingError::Plan(
                        "a rule with `reshape` cannot be read backward".to_owned(),
                    ));
                }
                Op::Reshape(
                    shape
                        .iter()
                        .map(|d| {
                            if d.trim() == "-1" {
                                Ok(None)
                            } else {
                                config.eval(d).map(Some)
                            }
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
        });
    }
    if inverse {
        out.reverse();
    }
    Ok(out)
}

/// The shape after `ops`, checking that each applies.
fn shape_through(ops: &[Op], mut shape: Vec<u64>) -> Result<Vec<u64>, MappingError> {
    for op in ops {
        shape = op.shape_after(&shape)?;
    }
    Ok(shape)
}

fn eval_shape(exprs: &[String], config: &Config) -> Result<Vec<u64>, MappingError> {
    exprs.iter().map(|e| config.eval(e)).collect()
}

fn check_shape(
    name: &str,
    shape: &[u64],
    spec: Option<&Vec<String>>,
    config: &Config,
) -> Result<(), MappingError> {
    let Some(exprs) = spec else {
        return Ok(());
    };
    let want = eval_shape(exprs, config).map_err(|e| MappingError::Plan(format!("{name}: {e}")))?;
    if want != shape {
        let fields: Vec<String> = exprs
            .iter()
            .zip(&want)
            .map(|(e, v)| format!("{e} = {v}"))
            .collect();
        return Err(MappingError::Plan(format!(
            "{name}: shape {shape:?}, but the config gives [{}]\nhint: is the config the one of this checkpoint's model?",
            fields.join(", ")
        )));
    }
    Ok(())
}

/// Maps `stored` (names, dtypes, shapes, in stored order) through `file` read in `direction`.
/// Every stored tensor must be matched by a rule; outputs are checked against the rules' shapes.
#[allow(
    clippy::too_many_lines,
    reason = "one pass over the rules in either direction"
)]
pub fn plan(
    file: &MappingFile,
    direction: Direction,
    config_json: &serde_json::Value,
    stored: &[Stored],
) -> Result<Plan, MappingError> {
    let config = Config::new(config_json, &file.defaults)?;
    let backward = direction == Direction::Backward;
    let mut rules = Vec::new();
    for spec in &file.rules {
        let (read, write) = match (backward, &spec.to) {
            (false, to) => (
                Pattern::parse(&spec.from)?,
                to.as_deref().map(Pattern::parse).transpose()?,
            ),
            (true, Some(_)) if !spec.splits.is_empty() => {
                return Err(MappingError::Plan(format!(
                    "mapping `{}`: the rule for `{}` splits more than once and cannot be read backward",
                    file.name, spec.from
                )));
            }
            (true, Some(to)) => (Pattern::parse(to)?, Some(Pattern::parse(&spec.from)?)),
            (true, None) => continue,
        };
        rules.push(Rule { spec, read, write });
    }
    let by_name: BTreeMap<&str, &Stored> = stored.iter().map(|s| (s.name.as_str(), s)).collect();
    let tie_on = match &file.tie {
        Some(t) => config.flag(&t.flag, t.default)?,
        None => false,
    };
    let mut plan = Plan::default();
    let mut unmatched = Vec::new();
    // Backward: stored names grouped by rule and the captures outside the split.
    let mut groups: BTreeMap<(usize, String), (usize, Captures)> = BTreeMap::new();
    let mut group_order: Vec<(usize, String)> = Vec::new();
    for s in stored {
        let Some((ri, caps)) = rules.iter().enumerate().find_map(|(i, r)| {
            let caps = r.read.matches(&s.name)?;
            split_accepts(r.spec, backward, &caps).then_some((i, caps))
        }) else {
            unmatched.push(s.name.clone());
            continue;
        };
        let rule = &rules[ri];
        let Some(write) = &rule.write else {
            plan.dropped.push(s.name.clone());
            continue;
        };
        if backward {
            check_shape(&s.name, &s.shape, rule.spec.shape.as_ref(), &config)?;
            let mut outer = caps.clone();
            if let Some(split) = &rule.spec.split {
                outer.remove(&split.capture);
            }
            let target = write.fill(&outer)?;
            let key = (ri, target);
            if !groups.contains_key(&key) {
                group_order.push(key.clone());
            }
            groups.entry(key).or_insert((ri, outer));
        } else {
            plan.outputs
                .extend(forward_outputs(rule.spec, write, &caps, s, &config)?);
        }
    }
    if backward {
        for key in &group_order {
            let (ri, outer) = &groups[key];
            let rule = &rules[*ri];
            let write = rule
                .write
                .as_ref()
                .ok_or_else(|| MappingError::Plan("dropped rule".to_owned()))?;
            plan.outputs.push(backward_output(
                rule.spec, &rule.read, write, outer, &by_name, &config,
            )?);
        }
    }
    if backward {
        restore_dropped(file, &config, &mut plan)?;
    }
    if !unmatched.is_empty() {
        let shown: Vec<&str> = unmatched.iter().take(5).map(String::as_str).collect();
        return Err(MappingError::Plan(format!(
            "{} stored tensor(s) match no rule of the mapping `{}` ({}): {}{}\nhint: a mapping file with rules for them (--mapping FILE), or --drop REGEX to leave them out",
            unmatched.len(),
            file.name,
            file.origin,
            shown.join(", "),
            if unmatched.len() > shown.len() {
                ", …"
            } else {
                ""
            }
        )));
    }
    // Ties: forward, the tied name is not written; backward, it is made from the kept one.
    if let Some(t) = &file.tie
        && tie_on
    {
        if backward {
            let (keep_src, drop_src) = (&t.keep, &t.drop);
            if by_name.contains_key(keep_src.as_str()) && !by_name.contains_key(drop_src.as_str()) {
                // The output that `keep` became is written again under the name `drop` maps to.
                let tie_rules = rules.iter().find_map(|r| {
                    let caps = r.read.matches(drop_src)?;
                    Some(r.write.as_ref()?.fill(&caps))
                });
                let kept = rules.iter().find_map(|r| {
                    let caps = r.read.matches(keep_src)?;
                    Some(r.write.as_ref()?.fill(&caps))
                });
                if let (Some(Ok(drop_out)), Some(Ok(keep_out))) = (tie_rules, kept)
                    && let Some(k) = plan.outputs.iter().find(|o| o.name == keep_out).cloned()
                {
                    plan.outputs.push(Planned {
                        name: drop_out,
                        ..k
                    });
                }
            }
        } else if let Some(pos) = plan.outputs.iter().position(|o| o.name == t.drop)
            && plan.outputs.iter().any(|o| o.name == t.keep)
        {
            let dropped = plan.outputs.remove(pos);
            plan.tied = Some(Tied {
                kept: t.keep.clone(),
                dropped,
            });
        }
    }
    let mut seen = BTreeSet::new();
    for o in &plan.outputs {
        if !seen.insert(o.name.as_str()) {
            return Err(MappingError::Plan(format!(
                "two stored tensors map to `{}` (mapping `{}`)",
                o.name, file.name
            )));
        }
    }
    Ok(plan)
}

/// Read backward, a split's capture must name one of its parts (or be a number): `{P}_proj` of a
/// `gate`/`up` split is not `down_proj`.
fn split_accepts(spec: &RuleSpec, backward: bool, caps: &Captures) -> bool {
    let Some(split) = spec.split.as_ref().filter(|_| backward) else {
        return true;
    };
    let Some(value) = caps.get(&split.capture) else {
        return false;
    };
    if split.count.is_some() {
        value.bytes().all(|b| b.is_ascii_digit())
    } else {
        split.parts.iter().any(|p| p == value)
    }
}

/// A piece of a stored tensor cut by a rule's splits: its read (an expert's dim-0 rows where it
/// can be), the ops that cut it, its captures and its shape.
struct Piece {
    caps: Captures,
    rows: Option<Range<u64>>,
    ops: Vec<Op>,
    shape: Vec<u64>,
}

/// The outputs of one stored tensor read forward.
#[allow(
    clippy::too_many_lines,
    reason = "a plain rename, counted and named splits in one place"
)]
fn forward_outputs(
    spec: &RuleSpec,
    write: &Pattern,
    caps: &Captures,
    s: &Stored,
    config: &Config,
) -> Result<Vec<Planned>, MappingError> {
    let at = |e: MappingError| MappingError::Plan(format!("{}: {e}", s.name));
    let post = resolve_ops(&spec.ops, config, false).map_err(at)?;
    let Some(split) = &spec.split else {
        let name = write.fill(caps)?;
        let shape = shape_through(&post, s.shape.clone()).map_err(at)?;
        check_shape(&name, &shape, spec.shape.as_ref(), config)?;
        let recipe = if post.is_empty() {
            Recipe::Copy {
                source: s.name.clone(),
            }
        } else {
            Recipe::Derived {
                reads: vec![Read {
                    source: s.name.clone(),
                    rows: None,
                    ops: Vec::new(),
                }],
                concat_dim: 0,
                ops: post,
            }
        };
        return Ok(vec![Planned {
            name,
            dtype: s.dtype,
            shape,
            recipe,
        }]);
    };
    // Splits in sequence, each cutting every piece of the one before.
    let mut pieces = vec![Piece {
        caps: caps.clone(),
        rows: None,
        ops: Vec::new(),
        shape: s.shape.clone(),
    }];
    for split in std::iter::once(split).chain(&spec.splits) {
        let pre = resolve_ops(&split.pre, config, false).map_err(at)?;
        let mut next = Vec::new();
        for piece in pieces {
            let base = shape_through(&pre, piece.shape.clone()).map_err(at)?;
            for (value, start, len, squeeze) in split_pieces(split, &base, &s.name, config)? {
                let dim = split.dim;
                let mut caps = piece.caps.clone();
                caps.insert(split.capture.clone(), value);
                let mut shape = base.clone();
                shape[dim] = len;
                if squeeze {
                    shape.remove(dim);
                }
                // The first cut along dim 0 of the stored tensor: read only its rows.
                let (rows, mut ops) =
                    if dim == 0 && pre.is_empty() && piece.rows.is_none() && piece.ops.is_empty() {
                        (Some(start..start + len), Vec::new())
                    } else {
                        let mut ops = piece.ops.clone();
                        ops.extend(pre.iter().cloned());
                        ops.push(Op::Slice { dim, start, len });
                        (piece.rows.clone(), ops)
                    };
                if squeeze {
                    ops.push(Op::Squeeze(dim));
                }
                next.push(Piece {
                    caps,
                    rows,
                    ops,
                    shape,
                });
            }
        }
        pieces = next;
    }
    let mut out = Vec::new();
    for piece in pieces {
        let name = write.fill(&piece.caps)?;
        let shape = shape_through(&post, piece.shape).map_err(at)?;
        check_shape(&name, &shape, spec.shape.as_ref(), config)?;
        out.push(Planned {
            name,
            dtype: s.dtype,
            shape,
            recipe: Recipe::Derived {
                reads: vec![Read {
                    source: s.name.clone(),
                    rows: piece.rows,
                    ops: piece.ops,
                }],
                concat_dim: 0,
                ops: post.clone(),
            },
        });
    }
    Ok(out)
}

/// The pieces one split cuts a tensor of shape `base` into: `(capture value, start, len, the
/// dimension removed)`.
fn split_pieces(
    split: &SplitSpec,
    base: &[u64],
    source: &str,
    config: &Config,
) -> Result<Vec<(String, u64, u64, bool)>, MappingError> {
    let at = |e: MappingError| MappingError::Plan(format!("{source}: {e}"));
    let dim = split.dim;
    let Some(&size) = base.get(dim) else {
        return Err(at(MappingError::Apply(format!(
            "no dimension {dim} to split in {base:?}"
        ))));
    };
    if let Some(count) = &split.count {
        let n = config.eval(count).map_err(at)?;
        if n != size {
            return Err(MappingError::Plan(format!(
                "{source}: dimension {dim} is {size}, but the config gives `{count}` = {n}\nhint: is the config the one of this checkpoint's model?"
            )));
        }
        return Ok((0..n).map(|i| (i.to_string(), i, 1, true)).collect());
    }
    let sizes: Vec<u64> = if split.sizes.is_empty() {
        let n = split.parts.len() as u64;
        if n == 0 || !size.is_multiple_of(n) {
            return Err(MappingError::Plan(format!(
                "{source}: dimension {dim} ({size}) does not split into {n} equal parts"
            )));
        }
        vec![size / n; split.parts.len()]
    } else {
        eval_shape(&split.sizes, config).map_err(at)?
    };
    if sizes.iter().sum::<u64>() != size {
        return Err(MappingError::Plan(format!(
            "{source}: dimension {dim} is {size}, but the parts' sizes {:?} add up to {}",
            split.sizes,
            sizes.iter().sum::<u64>()
        )));
    }
    let mut start = 0;
    Ok(split
        .parts
        .iter()
        .zip(sizes)
        .map(|(p, len)| {
            let piece = (p.clone(), start, len, false);
            start += len;
            piece
        })
        .collect())
}

/// The output of one group of stored tensors read backward (all parts or experts of one name).
fn backward_output(
    spec: &RuleSpec,
    read: &Pattern,
    write: &Pattern,
    outer: &Captures,
    by_name: &BTreeMap<&str, &Stored>,
    config: &Config,
) -> Result<Planned, MappingError> {
    let name = write.fill(outer)?;
    let at = |e: MappingError| MappingError::Plan(format!("{name}: {e}"));
    // Inverse of the per-output ops.
    let inv_post = resolve_ops(&spec.ops, config, true).map_err(at)?;
    let Some(split) = &spec.split else {
        let source = read.fill(outer)?;
        let s = by_name[source.as_str()];
        let ops = inv_post;
        let shape = shape_through(&ops, s.shape.clone()).map_err(at)?;
        let recipe = if ops.is_empty() {
            Recipe::Copy { source }
        } else {
            Recipe::Derived {
                reads: vec![Read {
                    source,
                    rows: None,
                    ops: Vec::new(),
                }],
                concat_dim: 0,
                ops,
            }
        };
        return Ok(Planned {
            name,
            dtype: s.dtype,
            shape,
            recipe,
        });
    };
    let values: Vec<String> = match &split.count {
        Some(count) => (0..config.eval(count).map_err(at)?)
            .map(|i| i.to_string())
            .collect(),
        None => split.parts.clone(),
    };
    let mut reads = Vec::new();
    let mut part_shape: Option<Vec<u64>> = None;
    let mut dtype = None;
    let mut total = 0u64;
    for v in &values {
        let mut caps = outer.clone();
        caps.insert(split.capture.clone(), v.clone());
        let source = read.fill(&caps)?;
        let Some(s) = by_name.get(source.as_str()) else {
            return Err(MappingError::Plan(format!(
                "{name}: `{source}` is missing (the config gives {} parts)",
                values.len()
            )));
        };
        if dtype.is_some_and(|d| d != s.dtype) {
            return Err(MappingError::Plan(format!(
                "{name}: `{source}` is {} but the other parts are not",
                s.dtype
            )));
        }
        dtype = Some(s.dtype);
        let mut ops = inv_post.clone();
        if split.count.is_some() {
            ops.push(Op::Unsqueeze(split.dim));
        }
        let shape = shape_through(&ops, s.shape.clone()).map_err(at)?;
        let Some(&d) = shape.get(split.dim) else {
            return Err(at(MappingError::Apply(format!(
                "no dimension {} in {shape:?}",
                split.dim
            ))));
        };
        total += d;
        let mut rest = shape.clone();
        rest[split.dim] = 0;
        if part_shape.as_ref().is_some_and(|p| *p != rest) {
            return Err(MappingError::Plan(format!(
                "{name}: `{source}` has shape {:?}, unlike the other parts",
                s.shape
            )));
        }
        part_shape = Some(rest);
        reads.push(Read {
            source,
            rows: None,
            ops,
        });
    }
    let mut shape = part_shape.ok_or_else(|| at(MappingError::Plan("no parts".to_owned())))?;
    shape[split.dim] = total;
    let ops = resolve_ops(&split.pre, config, true).map_err(at)?;
    let shape = shape_through(&ops, shape).map_err(at)?;
    Ok(Planned {
        name,
        dtype: dtype.unwrap_or(DType::Float32),
        shape,
        recipe: Recipe::Derived {
            reads,
            concat_dim: split.dim,
            ops,
        },
    })
}

/// The most bytes of zeros a `restore` makes (a buffer, sized by the config).
const MAX_ZEROS_BYTES: u64 = 1 << 32;

/// Makes an output's bytes from its reads: `read(i)` returns read `i` of the recipe as stored
/// (whole, or its rows), in the output's dtype.
pub fn evaluate(
    recipe: &Recipe,
    elem: usize,
    mut read: impl FnMut(&Read) -> Result<Dense, MappingError>,
) -> Result<Dense, MappingError> {
    match recipe {
        Recipe::Copy { source } => read(&Read {
            source: source.clone(),
            rows: None,
            ops: Vec::new(),
        }),
        Recipe::Derived {
            reads,
            concat_dim,
            ops,
        } => {
            let mut parts = Vec::with_capacity(reads.len());
            for r in reads {
                let mut t = read(r)?;
                if t.elem != elem {
                    return Err(MappingError::Apply(format!(
                        "{}: elements of {} bytes, expected {elem}",
                        r.source, t.elem
                    )));
                }
                for op in &r.ops {
                    t = op.apply(t)?;
                }
                parts.push(t);
            }
            let mut t = if parts.len() == 1 {
                parts
                    .pop()
                    .ok_or_else(|| MappingError::Apply("no read".to_owned()))?
            } else {
                Dense::concat(&parts, *concat_dim)?
            };
            for op in ops {
                t = op.apply(t)?;
            }
            Ok(t)
        }
        Recipe::Zeros { shape } => {
            let n = shape
                .iter()
                .try_fold(elem as u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n <= MAX_ZEROS_BYTES)
                .ok_or_else(|| {
                    MappingError::Apply(format!(
                        "zeros of shape {shape:?} would be more than {MAX_ZEROS_BYTES} bytes"
                    ))
                })?;
            let n = usize::try_from(n)
                .map_err(|_| MappingError::Apply(format!("zeros of shape {shape:?}")))?;
            Dense::new(vec![0; n], shape.clone(), elem)
        }
    }
}

#[cfg(test)]
mod tests;
