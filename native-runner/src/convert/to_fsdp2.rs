//! FSDP2 per-rank files for any world size (`shardscope reshard --to-api fsdp2`), written from a
//! checkpoint read through the index: each rank's `model.state_dict()` (a `DTensor` per parameter,
//! `Shard(0)` on a 1-D mesh or `(Replicate(), Shard(0))` on an HSDP mesh; buffers and ignored
//! parameters as they are) and its raw `optim.state_dict()` (integer ids in `param_groups` order,
//! `DTensor` states shaped like their parameter, 0-d states such as `step` as they are), as
//! `rank{r}_model.pt` and `rank{r}_optim.pt`, which `model.load_state_dict(torch.load(...,
//! weights_only=True))` and `optim.load_state_dict(...)` take on the same mesh.
//!
//! Each rank's piece of a tensor is a run of whole dim-0 rows (`torch.chunk` over the shard mesh
//! dimension, as FSDP2 shards), read with one positioned read when the writer asks for it: one
//! destination tensor in memory at a time.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{Context, Result, bail};
use shardscope_core::bridge::{DeviceMeshSpec, RootDict};
use shardscope_core::index::{EntryKind, IndexEntry, PathSeg, Role};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::tree::{Dict, DistKind, DistTensor, Key, Node, Tensor};
use shardscope_runner::fsdp1_local::{Fsdp1LocalError, lazy};

use super::Reader;
use super::to_fsdp1::{
    Fill, OutputFile, Parts, entry_node, fill_at, fill_error, param_groups, parts, plain_bytes,
    structure, value_node, write_file,
};

/// The destination: the mesh and the file names (`{r}` for the rank).
pub struct Fsdp2Target<'a> {
    pub desc: &'a ModelDescription,
    pub world_size: u64,
    /// Ranks per shard group (HSDP: the mesh is `(world_size / shard_group_size,
    /// shard_group_size)`); `None` for a 1-D mesh of the world.
    pub shard_group_size: Option<u64>,
    /// `mesh_dim_names` of the mesh the files will be loaded on (must match it).
    pub mesh_dim_names: Option<Vec<String>>,
    pub model_pattern: &'a str,
    /// Raw optimizer files are written when this is set and the checkpoint has optimizer state.
    pub optim_pattern: Option<&'a str>,
}

impl Fsdp2Target<'_> {
    /// The mesh shape, checked.
    pub fn mesh_shape(&self) -> Result<Vec<u64>> {
        Ok(match self.shard_group_size {
            None => vec![self.world_size],
            Some(s) => {
                if s == 0 || !self.world_size.is_multiple_of(s) {
                    bail!(
                        "--to-shard-group-size {s} does not divide --to-world-size {}",
                        self.world_size
                    );
                }
                vec![self.world_size / s, s]
            }
        })
    }
}

/// Rows of dim 0 that shard `index` of `shards` holds: `torch.chunk`'s split, as FSDP2 shards
/// (`ceil(dim0 / shards)` rows each; trailing shards may be short or empty, at offset `dim0`).
fn shard_rows(dim0: u64, index: u64, shards: u64) -> (u64, u64) {
    let chunk = dim0.div_ceil(shards.max(1));
    let start = index.saturating_mul(chunk).min(dim0);
    let end = start.saturating_add(chunk).min(dim0);
    (start, end - start)
}

/// The DTensor skeleton of rank `shard`'s piece of `e`, and its fill.
fn dtensor(e: &IndexEntry, shard: (u64, u64)) -> Result<(Node, Fill)> {
    let t = structure(e)?;
    let Some(&dim0) = t.shape.first() else {
        bail!(
            "`{}` is a 0-d parameter: FSDP2 shards parameters along dim 0",
            e.key
        );
    };
    let (start, rows) = shard_rows(dim0, shard.0, shard.1);
    let mut local_shape = t.shape.clone();
    local_shape[0] = rows;
    let mut offsets = vec![0; t.shape.len()];
    offsets[0] = start;
    let node = Node::Dist(DistTensor {
        kind: DistKind::DTensor,
        dtype: t.dtype,
        global_shape: t.shape,
        local: Some((
            offsets,
            Tensor {
                dtype: t.dtype,
                shape: local_shape,
                data: Vec::new(),
            },
        )),
        chunks: Vec::new(),
    });
    Ok((
        node,
        Fill::Rows {
            key: e.key.clone(),
            start,
            rows,
        },
    ))
}

/// The parameters FSDP2 shards: every described parameter that is not ignored.
fn sharded_params(desc: &ModelDescription) -> HashSet<&str> {
    desc.params
        .iter()
        .filter(|p| !desc.ignored.contains(&p.fqn))
        .map(|p| p.fqn.as_str())
        .collect()
}

/// Rank `shard`'s `model.state_dict()`.
fn model_skeleton(
    parts: &Parts<'_>,
    sharded: &HashSet<&str>,
    shard: (u64, u64),
    fills: &mut HashMap<String, Fill>,
) -> Result<Dict> {
    let mut out = Dict::new();
    for (name, e) in &parts.model {
        let path = format!("/{name}");
        let node = if sharded.contains(name.as_str()) {
            if e.kind != EntryKind::Tensor {
                bail!("parameter `{name}` is not a tensor in the checkpoint");
            }
            let (node, fill) = dtensor(e, shard)?;
            fills.insert(path, fill);
            node
        } else {
            entry_node(e, path, fills)?
        };
        out.insert(Key::Str(name.clone()), node);
    }
    Ok(out)
}

/// The optimizer's structure: its parameter groups (with FQNs) and, per FQN, its states.
struct Optim<'i> {
    /// Per group: its entries (key, entry) in stored order, `params` as FQNs.
    groups: Vec<Vec<(String, &'i IndexEntry)>>,
    /// FQN -> optimizer id (its place in `params` of the groups, in order).
    ids: Vec<String>,
    /// FQN -> its states (name, entry) in stored order.
    states: HashMap<&'i str, Vec<(&'i str, &'i IndexEntry)>>,
}

fn optim<'i>(parts: &Parts<'i>) -> Result<Optim<'i>> {
    let groups = param_groups(parts, Ok)?;
    let mut ids = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        let (_, params) = group
            .iter()
            .find(|(k, _)| k == "params")
            .with_context(|| format!("parameter group {g} has no `params`"))?;
        let Node::List(fqns) = value_node(params)? else {
            bail!("`{}` is not a list of parameter names", params.key);
        };
        for fqn in fqns {
            let Node::Str(fqn) = fqn else {
                bail!(
                    "`{}` holds {} where a parameter name is expected (an FQN-keyed optimizer state dict, as FSDP.optim_state_dict or get_optimizer_state_dict(full_state_dict=True) give it)",
                    params.key,
                    fqn.kind_name()
                );
            };
            ids.push(fqn);
        }
    }
    let mut states: HashMap<&str, Vec<(&str, &IndexEntry)>> = HashMap::new();
    for e in &parts.state_order {
        if let Some(Role::OptimizerState {
            param: PathSeg::Key(fqn),
            state,
        }) = &e.role
        {
            states
                .entry(fqn.as_str())
                .or_default()
                .push((state.as_str(), *e));
        }
    }
    let known: HashSet<&str> = ids.iter().map(String::as_str).collect();
    if let Some(fqn) = states.keys().find(|f| !known.contains(**f)) {
        bail!("the optimizer has state for `{fqn}`, which no parameter group lists");
    }
    Ok(Optim {
        groups,
        ids,
        states,
    })
}

/// Rank `shard`'s raw `optim.state_dict()`.
fn optim_skeleton(
    reader: &mut Reader<'_>,
    parts: &Parts<'_>,
    o: &Optim<'_>,
    shard: (u64, u64),
    fills: &mut HashMap<String, Fill>,
) -> Result<Dict> {
    let mut state = Dict::new();
    let mut buf = Vec::new();
    for (id, fqn) in o.ids.iter().enumerate() {
        let Some(states) = o.states.get(fqn.as_str()) else {
            continue;
        };
        let param = parts
            .model
            .iter()
            .find(|(n, _)| n == fqn)
            .map(|(_, e)| *e)
            .with_context(|| format!("the optimizer holds `{fqn}`, which the model does not"))?;
        let mut d = Dict::new();
        for (name, e) in states {
            let path = format!("/state/{id}/{name}");
            let node = if e.kind != EntryKind::Tensor {
                value_node(e)?
            } else if e.shape.as_deref() == Some(&[]) {
                let dtype = e.dtype.context("a tensor without dtype")?;
                let n = reader.tensor_as(e, dtype, &mut buf)?;
                fills.insert(path, Fill::Bytes(buf[..n].to_vec()));
                Node::Tensor(Tensor {
                    dtype,
                    shape: Vec::new(),
                    data: Vec::new(),
                })
            } else {
                if e.shape != param.shape {
                    bail!(
                        "optimizer state `{}` has shape {:?}, its parameter `{fqn}` {:?}: only states shaped like their parameter are sharded as FSDP2 shards them",
                        e.key,
                        e.shape.as_deref().unwrap_or_default(),
                        param.shape.as_deref().unwrap_or_default()
                    );
                }
                let (node, fill) = dtensor(e, shard)?;
                fills.insert(path, fill);
                node
            };
            d.insert(Key::str(name), node);
        }
        state.insert(Key::Int(id as i64), Node::Dict(d));
    }
    let mut groups = Vec::new();
    let mut next = 0i64;
    for group in &o.groups {
        let mut g = Dict::new();
        for (k, e) in group {
            let node = if k == "params" {
                let Node::List(fqns) = value_node(e)? else {
                    bail!("`{}` is not a list", e.key);
                };
                let ids = (next..next + fqns.len() as i64).map(Node::Int).collect();
                next += fqns.len() as i64;
                Node::List(ids)
            } else {
                value_node(e)?
            };
            g.insert(Key::Str(k.clone()), node);
        }
        groups.push(Node::Dict(g));
    }
    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(state));
    out.insert(Key::str("param_groups"), Node::List(groups));
    Ok(out)
}

/// Writes `target`'s per-rank files into `out_dir` (which the caller makes appear atomically)
/// from the index (parameters and buffers under `model_prefix`, FQN-keyed optimizer state).
pub fn to_fsdp2_ranks(
    reader: &mut Reader<'_>,
    model_prefix: &str,
    target: &Fsdp2Target<'_>,
    out_dir: &Path,
) -> Result<Vec<OutputFile>> {
    let index = reader.index();
    let parts = parts(index, model_prefix);
    if parts.model.is_empty() {
        bail!("the checkpoint has no model state to write per-rank files from");
    }
    let sharded = sharded_params(target.desc);
    for p in &target.desc.params {
        if sharded.contains(p.fqn.as_str()) && !parts.model.iter().any(|(n, _)| *n == p.fqn) {
            bail!(
                "`{}{}` is not in the checkpoint (the model description lists it)",
                model_prefix,
                p.fqn
            );
        }
    }
    let shape = target.mesh_shape()?;
    let optim = match target.optim_pattern {
        Some(pattern) if !parts.state_order.is_empty() => Some((pattern, optim(&parts)?)),
        _ => None,
    };
    let mut written = Vec::new();
    let pool = super::to_fsdp1::buffer_pool(index);
    for rank in 0..target.world_size {
        let mesh = DeviceMeshSpec::new(&shape, target.mesh_dim_names.clone(), rank)?;
        let shard = mesh.shard();
        let mut fills = HashMap::new();
        let skeleton = Node::Dict(model_skeleton(&parts, &sharded, shard, &mut fills)?);
        let name = target.model_pattern.replace("{r}", &rank.to_string());
        written.push(write_file(out_dir, name, |out| {
            lazy::write_torch_save_on_mesh(
                out,
                &skeleton,
                RootDict::Ordered,
                &mesh,
                &pool,
                |path, buf| fill(reader, &parts, &fills, path, buf),
            )
        })?);
        if let Some((pattern, o)) = &optim {
            let mut fills = HashMap::new();
            let skeleton = Node::Dict(optim_skeleton(reader, &parts, o, shard, &mut fills)?);
            let name = pattern.replace("{r}", &rank.to_string());
            written.push(write_file(out_dir, name, |out| {
                lazy::write_torch_save_on_mesh(
                    out,
                    &skeleton,
                    RootDict::Plain,
                    &mesh,
                    &pool,
                    |path, buf| fill(reader, &parts, &fills, path, buf),
                )
            })?);
        }
    }
    Ok(written)
}

/// The bytes of the tensor at writer path `path`, in `buf`.
fn fill(
    reader: &mut Reader<'_>,
    parts: &Parts<'_>,
    fills: &HashMap<String, Fill>,
    path: &str,
    buf: Vec<u8>,
) -> std::result::Result<Vec<u8>, Fsdp1LocalError> {
    plain_bytes(reader, parts, fill_at(fills, path)?, buf).map_err(|e| {
        fill_error(format!(
            "{path}: {}",
            shardscope_runner::errors::error_text(&e)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::shard_rows;

    #[test]
    fn rows_follow_torch_chunk() {
        // torch.chunk(torch.arange(5), 2) -> 3 + 2; over 3 -> 2 + 2 + 1; 1 row over 2 -> 1 + 0.
        assert_eq!(shard_rows(5, 0, 2), (0, 3));
        assert_eq!(shard_rows(5, 1, 2), (3, 2));
        assert_eq!(
            (0..3).map(|i| shard_rows(5, i, 3)).collect::<Vec<_>>(),
            [(0, 2), (2, 2), (4, 1)]
        );
        assert_eq!(shard_rows(1, 1, 2), (1, 0));
        // torch.chunk(arange(4), 3) -> 2 + 2 (+ an empty third shard at offset 4).
        assert_eq!(shard_rows(4, 2, 3), (4, 0));
        assert_eq!(shard_rows(0, 0, 4), (0, 0));
    }
}
