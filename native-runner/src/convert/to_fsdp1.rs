//! FSDP1 per-rank LOCAL files for any layout (`shardscope reshard`), written from a checkpoint read
//! through the index: each rank's LOCAL_STATE_DICT model state dict (a `ShardedTensor` per flat
//! parameter, 1-D views with `use_orig_params`, the rest as they are; FULL state dicts for
//! NO_SHARD) and its raw `optim.state_dict()`.
//!
//! The structure of each file comes from core (`local_key_plan` for the model,
//! `local_optim_from_full` run on the optimizer's structure, tensors given by dtype and shape
//! only). Its bytes come from the logical tensors of the index (original parameters and
//! `optim.state.<fqn>.<name>`, whatever the source layout) by positioned reads of the element
//! runs each destination tensor is made of (`flat_range` segments of a flat parameter,
//! `local_state_runs` of an optimizer state), when the `torch.save` writer asks for them: one
//! destination tensor in memory at a time.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use shardscope_core::DType;
use shardscope_core::bridge::{self, RootDict};
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry, PathSeg, Role};
use shardscope_core::layout::key_plan::{FullKey, LocalKey, local_key_plan};
use shardscope_core::layout::{Fsdp1Model, ParamRef};
use shardscope_core::model::tree::{Dict, Key, Node, Tensor, fill_bytes};
use shardscope_core::transform::model_state::{
    TORCH_PADDING_FILL, local_flat_param_structure, unpadded_shard_numel,
};
use shardscope_core::transform::optim_state::{StateRun, local_optim_from_full, local_state_runs};
use shardscope_runner::fsdp1_local::{Fsdp1LocalError, lazy};

use super::Reader;
use crate::writeback::Paced;

/// The destination: its layout, and the file names (`{r}` for the rank).
pub struct Fsdp1Target<'a> {
    pub model: &'a Fsdp1Model<'a>,
    /// NO_SHARD: every rank saves (and loads) the FULL model state dict.
    pub full_files: bool,
    pub model_pattern: &'a str,
    /// Raw optimizer files are written when this is set and the checkpoint has optimizer state.
    pub optim_pattern: Option<&'a str>,
}

/// One file written: its name in the destination folder and its size.
pub struct OutputFile {
    pub name: String,
    pub bytes: u64,
}

/// Where the bytes of one destination tensor come from (FSDP1 and FSDP2 files alike).
pub(super) enum Fill {
    /// A whole logical tensor (buffers, unmanaged parameters, NO_SHARD files).
    Whole(String),
    /// Rows `start..start + rows` (dim 0) of a logical tensor (an FSDP2 `Shard(0)` piece).
    Rows { key: String, start: u64, rows: u64 },
    /// Rank `rank`'s unpadded shard of destination flat parameter `flat`.
    Shard { flat: usize, rank: u64 },
    /// Rank `rank`'s 1-D view of parameter `param` of flat parameter `flat` (`use_orig_params`).
    View {
        flat: usize,
        param: usize,
        rank: u64,
    },
    /// State `name` of optimizer id `id` on `rank`.
    State {
        id: usize,
        name: String,
        dtype: DType,
        rank: u64,
    },
    /// Bytes known already (0-d states).
    Bytes(Vec<u8>),
}

/// The checkpoint's entries by role: model entries (keys without the model prefix) in stored
/// order, and the optimizer's.
pub(super) struct Parts<'i> {
    pub(super) model: Vec<(String, &'i IndexEntry)>,
    pub(super) by_key: HashMap<&'i str, &'i IndexEntry>,
    /// `(fqn, state name)` -> entry.
    pub(super) states: HashMap<(&'i str, &'i str), &'i IndexEntry>,
    pub(super) state_order: Vec<&'i IndexEntry>,
    pub(super) groups: Vec<&'i IndexEntry>,
}

impl<'i> Parts<'i> {
    /// The entry of the logical tensor `key`.
    pub(super) fn entry(&self, key: &str) -> Result<&'i IndexEntry> {
        self.by_key
            .get(key)
            .copied()
            .with_context(|| format!("`{key}` is not in the checkpoint"))
    }
}

pub(super) fn parts<'i>(index: &'i CheckpointIndex, model_prefix: &str) -> Parts<'i> {
    let mut sorted: Vec<&IndexEntry> = index.entries.iter().collect();
    sorted.sort_by_key(|e| e.position.unwrap_or(u64::MAX));
    let mut p = Parts {
        model: Vec::new(),
        by_key: HashMap::new(),
        states: HashMap::new(),
        state_order: Vec::new(),
        groups: Vec::new(),
    };
    for e in sorted {
        p.by_key.insert(e.key.as_str(), e);
        match &e.role {
            Some(Role::OptimizerState {
                param: PathSeg::Key(fqn),
                state,
            }) => {
                p.states.insert((fqn.as_str(), state.as_str()), e);
                p.state_order.push(e);
            }
            Some(Role::OptimizerState { .. }) => {}
            Some(Role::ParamGroup { .. }) => p.groups.push(e),
            None => {
                if let Some(name) = e.key.strip_prefix(model_prefix) {
                    p.model.push((name.to_owned(), e));
                }
            }
        }
    }
    p
}

/// A non-tensor entry as a value of the output.
pub(super) fn value_node(e: &IndexEntry) -> Result<Node> {
    if let Some(object) = &e.object {
        return bridge::node_from_value(object, "checkpoint", &e.key)
            .with_context(|| format!("`{}`", e.key));
    }
    match &e.value {
        Some(v) => json_node(v).with_context(|| format!("`{}`: a value of no Python type", e.key)),
        None => Ok(Node::None),
    }
}

fn json_node(v: &serde_json::Value) -> Result<Node> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => Node::None,
        Value::Bool(b) => Node::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Node::Int(i),
            None => Node::Float(n.as_f64().context("a number out of range")?),
        },
        Value::String(s) => Node::Str(s.clone()),
        Value::Array(items) => Node::List(items.iter().map(json_node).collect::<Result<_>>()?),
        Value::Object(_) => bail!("a dict value"),
    })
}

/// A tensor of `e`'s dtype and shape without bytes.
pub(super) fn structure(e: &IndexEntry) -> Result<Tensor> {
    let (Some(dtype), Some(shape)) = (e.dtype, &e.shape) else {
        bail!("`{}` has no global shape", e.key);
    };
    Ok(Tensor {
        dtype,
        shape: shape.clone(),
        data: Vec::new(),
    })
}

pub(super) fn entry_node(
    e: &IndexEntry,
    path: String,
    fills: &mut HashMap<String, Fill>,
) -> Result<Node> {
    if e.kind == EntryKind::Tensor {
        fills.insert(path, Fill::Whole(e.key.clone()));
        Ok(Node::Tensor(structure(e)?))
    } else {
        value_node(e)
    }
}

/// Rank `rank`'s LOCAL model state dict, as `model_local_from_full` lays it out.
fn model_skeleton(
    dst: &Fsdp1Model<'_>,
    parts: &Parts<'_>,
    rank: u64,
    full_files: bool,
    fills: &mut HashMap<String, Fill>,
) -> Result<Dict> {
    let mut out = Dict::new();
    if full_files {
        for (name, e) in &parts.model {
            let node = entry_node(e, format!("/{name}"), fills)?;
            out.insert(Key::Str(name.clone()), node);
        }
        return Ok(out);
    }
    let by_name: HashMap<&str, &IndexEntry> =
        parts.model.iter().map(|(n, e)| (n.as_str(), *e)).collect();
    let full: Vec<(String, FullKey)> = parts
        .model
        .iter()
        .map(|(n, _)| (n.clone(), FullKey::Plain))
        .collect();
    for (name, key) in local_key_plan(dst, &full) {
        let path = format!("/{name}");
        let node = match key {
            LocalKey::Flat(i) => {
                fills.insert(path, Fill::Shard { flat: i, rank });
                Node::Dist(local_flat_param_structure(dst.flat(i), rank, Vec::new()))
            }
            LocalKey::View { flat, param } => {
                let f = dst.flat(flat);
                let info = &f.ranks[rank as usize].shard_param_infos[param];
                let n = match info.numel_in_shard {
                    Some(n) if info.in_shard => n,
                    _ => 0,
                };
                fills.insert(path, Fill::View { flat, param, rank });
                Node::Tensor(Tensor {
                    dtype: f.dtype,
                    shape: vec![n],
                    data: Vec::new(),
                })
            }
            LocalKey::Plain => {
                let e = by_name
                    .get(name.as_str())
                    .with_context(|| format!("`{name}` is not in the checkpoint"))?;
                entry_node(e, path, fills)?
            }
        };
        out.insert(Key::Str(name), node);
    }
    Ok(out)
}

/// The full (FQN-keyed) optimizer state dict with tensors given by dtype and shape only (0-d
/// states with their bytes, as `local_optim_from_full` compares them).
fn optim_structure(reader: &mut Reader<'_>, parts: &Parts<'_>) -> Result<Dict> {
    let mut state = Dict::new();
    let mut buf = Vec::new();
    for e in &parts.state_order {
        let Some(Role::OptimizerState {
            param: PathSeg::Key(fqn),
            state: name,
        }) = &e.role
        else {
            continue;
        };
        let node = if e.kind != EntryKind::Tensor {
            value_node(e)?
        } else if e.shape.as_deref() == Some(&[]) {
            let dtype = e.dtype.context("a tensor without dtype")?;
            let n = reader.tensor_as(e, dtype, &mut buf)?;
            Node::Tensor(Tensor::new(dtype, Vec::new(), buf[..n].to_vec())?)
        } else {
            Node::Tensor(structure(e)?)
        };
        let key = Key::Str(fqn.clone());
        if state.get(&key).is_none() {
            state.insert(key.clone(), Node::Dict(Dict::new()));
        }
        if let Some(Node::Dict(d)) = state.get_mut(&key) {
            d.insert(Key::Str(name.clone()), node);
        }
    }
    let groups = param_groups(parts, value_node)?
        .into_iter()
        .map(|g| Node::Dict(g.into_iter().map(|(k, v)| (Key::Str(k), v)).collect()))
        .collect();
    let mut full = Dict::new();
    full.insert(Key::str("state"), Node::Dict(state));
    full.insert(Key::str("param_groups"), Node::List(groups));
    Ok(full)
}

/// The optimizer's parameter groups: per group, its keys with `value` of their entries, in stored
/// order.
pub(super) fn param_groups<'i, T>(
    parts: &Parts<'i>,
    mut value: impl FnMut(&'i IndexEntry) -> Result<T>,
) -> Result<Vec<Vec<(String, T)>>> {
    let mut groups: Vec<Vec<(String, T)>> = Vec::new();
    for e in &parts.groups {
        let Some(Role::ParamGroup { group }) = &e.role else {
            continue;
        };
        let (Ok(g), Some(PathSeg::Key(k))) = (usize::try_from(*group), e.path.last()) else {
            bail!("`{}`: not a key of a parameter group", e.key);
        };
        if g >= groups.len() {
            if g > parts.groups.len() {
                bail!("`{}`: parameter group {g} out of range", e.key);
            }
            groups.resize_with(g + 1, Vec::new);
        }
        groups[g].push((k.clone(), value(e)?));
    }
    Ok(groups)
}

/// Every tensor of `local` (a raw optimizer state dict) by its writer path: bytes it has, or the
/// state it is.
fn optim_fills(local: &Dict, rank: u64, fills: &mut HashMap<String, Fill>) {
    let Some(Node::Dict(state)) = local.get_str("state") else {
        return;
    };
    for (id, v) in state.iter() {
        let (Key::Int(id), Node::Dict(d)) = (id, v) else {
            continue;
        };
        for (name, node) in d.iter() {
            let Node::Tensor(t) = node else { continue };
            let path = format!("/state/{id}/{name}");
            if t.data.is_empty() && t.numel() > 0 {
                fills.insert(
                    path,
                    Fill::State {
                        id: usize::try_from(*id).unwrap_or(usize::MAX),
                        name: name.to_string(),
                        dtype: t.dtype,
                        rank,
                    },
                );
            } else {
                fills.insert(path, Fill::Bytes(t.data.clone()));
            }
        }
    }
}

struct Filler<'r, 'i> {
    reader: &'r mut Reader<'i>,
    parts: &'r Parts<'i>,
    dst: &'r Fsdp1Model<'r>,
    model_prefix: &'r str,
    dst_params: &'r [ParamRef],
}

impl Filler<'_, '_> {
    /// Elements `[start, start + len)` of the logical tensor `key`, as `dtype`, appended to `out`.
    fn append(
        &mut self,
        key: &str,
        dtype: DType,
        start: u64,
        len: u64,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let e = self.parts.entry(key)?;
        let item = dtype.size_bytes() as u64;
        let range = start
            .checked_mul(item)
            .and_then(|a| Some(a..start.checked_add(len)?.checked_mul(item)?))
            .with_context(|| format!("`{key}`: element range overflows"))?;
        self.reader.append_range_as(e, dtype, range, out)
    }

    /// The bytes of `fill`, in `out` (empty; its capacity is reused).
    fn bytes(&mut self, fill: &Fill, mut out: Vec<u8>) -> Result<Vec<u8>> {
        out.clear();
        match fill {
            Fill::Whole(_) | Fill::Rows { .. } | Fill::Bytes(_) => {
                plain_bytes(self.reader, self.parts, fill, out)
            }
            Fill::Shard { flat, rank } => {
                let fp = self.dst.flat(*flat);
                let item = fp.dtype.size_bytes();
                let n = unpadded_shard_numel(fp, *rank);
                let (lo, _) = fp.rank_window(*rank);
                let hi = lo + n;
                let pad = fill_bytes(fp.dtype, TORCH_PADDING_FILL)
                    .with_context(|| format!("no padding value for {}", fp.dtype))?;
                out.reserve(n as usize * item);
                let mut seg = 0u64;
                let mut param = 0usize;
                for (&len, &is_pad) in fp.numels_with_padding.iter().zip(&fp.is_padding_mask) {
                    let (a, b) = (seg.max(lo), (seg + len).min(hi));
                    if a < b {
                        if is_pad {
                            for _ in a..b {
                                out.extend_from_slice(&pad);
                            }
                        } else {
                            let key = format!("{}{}", self.model_prefix, fp.fqns[param]);
                            self.append(&key, fp.dtype, a - seg, b - a, &mut out)?;
                        }
                    }
                    if !is_pad {
                        param += 1;
                    }
                    seg += len;
                }
                Ok(out)
            }
            Fill::View { flat, param, rank } => {
                let fp = self.dst.flat(*flat);
                let info = fp.ranks[*rank as usize].shard_param_infos[*param];
                if let (true, Some(start), Some(n)) = (
                    info.in_shard,
                    info.intra_param_start_idx,
                    info.numel_in_shard,
                ) {
                    let key = format!("{}{}", self.model_prefix, fp.fqns[*param]);
                    self.append(&key, fp.dtype, start, n, &mut out)?;
                }
                Ok(out)
            }
            Fill::State {
                id,
                name,
                dtype,
                rank,
            } => {
                let param = self
                    .dst_params
                    .get(*id)
                    .with_context(|| format!("optimizer id {id} is not a parameter"))?
                    .clone();
                let has = |fqn: &str| self.parts.states.contains_key(&(fqn, name.as_str()));
                let runs = local_state_runs(self.dst, &param, *rank, has);
                let dtype = *dtype;
                let item = dtype.size_bytes();
                for run in runs {
                    match run {
                        StateRun::Param { fqn, start, len } => {
                            let key = self
                                .parts
                                .states
                                .get(&(fqn.as_str(), name.as_str()))
                                .with_context(|| {
                                    format!("`{fqn}` has no optimizer state `{name}`")
                                })?
                                .key
                                .clone();
                            self.append(&key, dtype, start, len, &mut out)?;
                        }
                        StateRun::Zeros(len) => out.resize(out.len() + len as usize * item, 0),
                    }
                }
                Ok(out)
            }
        }
    }
}

/// The bytes of `fill` when it needs no destination layout (`Whole`, `Rows`, `Bytes`), in `out`
/// (empty; its capacity is reused).
pub(super) fn plain_bytes(
    reader: &mut Reader<'_>,
    parts: &Parts<'_>,
    fill: &Fill,
    mut out: Vec<u8>,
) -> Result<Vec<u8>> {
    out.clear();
    match fill {
        Fill::Bytes(b) => {
            out.extend_from_slice(b);
            Ok(out)
        }
        Fill::Whole(key) => {
            let e = parts.entry(key)?;
            let dtype = e.dtype.context("a tensor without dtype")?;
            let n = reader.tensor_as(e, dtype, &mut out)?;
            out.truncate(n);
            Ok(out)
        }
        Fill::Rows { key, start, rows } => {
            let e = parts.entry(key)?;
            let t = structure(e)?;
            let row_bytes = t.shape[1..]
                .iter()
                .try_fold(t.dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
                .with_context(|| format!("`{key}`: tensor size overflows"))?;
            let range = start
                .checked_mul(row_bytes)
                .and_then(|a| Some(a..a.checked_add(rows.checked_mul(row_bytes)?)?))
                .with_context(|| format!("`{key}`: tensor size overflows"))?;
            reader.append_range_as(e, t.dtype, range, &mut out)?;
            Ok(out)
        }
        Fill::Shard { .. } | Fill::View { .. } | Fill::State { .. } => {
            bail!("a tensor of the FSDP1 destination layout, filled without it")
        }
    }
}

/// Writes `target`'s per-rank files into `out_dir` (which the caller makes appear atomically)
/// from `index` (original parameters under `model_prefix`, FQN-keyed optimizer state).
pub fn to_fsdp1_local(
    reader: &mut Reader<'_>,
    model_prefix: &str,
    target: &Fsdp1Target<'_>,
    out_dir: &Path,
) -> Result<Vec<OutputFile>> {
    let index = reader.index();
    let parts = parts(index, model_prefix);
    if parts.model.is_empty() {
        bail!("the checkpoint has no model state to write per-rank files from");
    }
    let dst = target.model;
    let wrapped = dst.wrapped_params();
    let dst_names: Vec<String> = wrapped.iter().map(|(n, _)| n.clone()).collect();
    let dst_params: Vec<ParamRef> = wrapped.into_iter().map(|(_, p)| p).collect();
    let optim = match target.optim_pattern {
        Some(pattern) if !parts.state_order.is_empty() => {
            Some((pattern, optim_structure(reader, &parts)?))
        }
        _ => None,
    };
    let ws = dst.layout.world_size;
    let group = dst.shard_group_size();
    let mut filler = Filler {
        reader,
        parts: &parts,
        dst,
        model_prefix,
        dst_params: &dst_params,
    };
    let mut written = Vec::new();
    let pool = buffer_pool(index);
    for global in 0..ws {
        let rank = global % group;
        let pg = ((rank, group), (global, ws));
        let mut fills = HashMap::new();
        let skeleton = model_skeleton(dst, &parts, rank, target.full_files, &mut fills)?;
        let name = target.model_pattern.replace("{r}", &global.to_string());
        written.push(write_file(out_dir, name, |out| {
            lazy::write_torch_save(
                out,
                &Node::Dict(skeleton),
                RootDict::Ordered,
                pg.0,
                pg.1,
                &pool,
                |path, buf| fill(&mut filler, &fills, path, buf),
            )
        })?);
        if let Some((pattern, full)) = &optim {
            let local = local_optim_from_full(dst, full, rank, &dst_names)
                .with_context(|| format!("destination rank {rank} optimizer state"))?;
            let mut fills = HashMap::new();
            optim_fills(&local, rank, &mut fills);
            let name = pattern.replace("{r}", &global.to_string());
            written.push(write_file(out_dir, name, |out| {
                lazy::write_torch_save(
                    out,
                    &Node::Dict(local),
                    RootDict::Plain,
                    pg.0,
                    pg.1,
                    &pool,
                    |path, buf| fill(&mut filler, &fills, path, buf),
                )
            })?);
        }
    }
    Ok(written)
}

/// The buffers of a per-rank writer: the largest tensor of the checkpoint plus the executor's
/// headroom, so that the process stays within the largest tensor + 64 MiB.
pub(super) fn buffer_pool(index: &CheckpointIndex) -> lazy::BufferPool {
    let largest = index
        .entries
        .iter()
        .filter_map(|e| {
            let numel = e
                .shape
                .as_ref()?
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))?;
            numel.checked_mul(e.dtype?.size_bytes() as u64)
        })
        .max()
        .unwrap_or(0);
    lazy::BufferPool::with_limit(largest.saturating_add(super::exec::DEFAULT_HEADROOM_BYTES))
}

/// An error producing the bytes of an output tensor.
pub(super) fn fill_error(reason: String) -> Fsdp1LocalError {
    Fsdp1LocalError::Content {
        file: PathBuf::from("<output>"),
        reason,
    }
}

fn fill(
    filler: &mut Filler<'_, '_>,
    fills: &HashMap<String, Fill>,
    path: &str,
    buf: Vec<u8>,
) -> std::result::Result<Vec<u8>, Fsdp1LocalError> {
    filler.bytes(fill_at(fills, path)?, buf).map_err(|e| {
        fill_error(format!(
            "{path}: {}",
            shardscope_runner::errors::error_text(&e)
        ))
    })
}

/// How the tensor at writer path `path` is filled.
pub(super) fn fill_at<'f>(
    fills: &'f HashMap<String, Fill>,
    path: &str,
) -> std::result::Result<&'f Fill, Fsdp1LocalError> {
    fills
        .get(path)
        .ok_or_else(|| fill_error(format!("no source for the tensor at {path}")))
}

pub(super) fn write_file(
    dir: &Path,
    name: String,
    write: impl FnOnce(BufWriter<Paced>) -> std::result::Result<BufWriter<Paced>, Fsdp1LocalError>,
) -> Result<OutputFile> {
    let path = dir.join(&name);
    let file = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
    let out = write(BufWriter::new(Paced::new(file)))
        .with_context(|| format!("writing {}", path.display()))?;
    let file = out
        .into_inner()
        .map(Paced::into_file)
        .map_err(std::io::IntoInnerError::into_error)
        .with_context(|| format!("writing {}", path.display()))?;
    let bytes = file
        .metadata()
        .with_context(|| format!("{}", path.display()))?
        .len();
    Ok(OutputFile { name, bytes })
}
