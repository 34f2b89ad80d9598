//! FSDP2 per-rank folders with optimizer state: for every rank `r`, `model.state_dict()` (DTensor
//! values) and the raw `optim.state_dict()` (integer ids, DTensor `exp_avg`/`exp_avg_sq`, 0-dim
//! `step`), either as two `torch.save` files (`rank{r}_model.pt`, `rank{r}_optim.pt`) or as one
//! holding `{"model": ..., "optim": ...}` (`rank{r}.pt`). File names are grouped as
//! [`shardscope_runner::fsdp1_local`] groups them (the last number is the rank).
//!
//! [`full_state`] gives `{"model": M, "optim": O}` where `M` and `O` equal what torch's
//! `get_model_state_dict` / `get_optimizer_state_dict(model, optim,
//! options=StateDictOptions(full_state_dict=True))` return (FQN keys in `state`, FQNs in
//! `param_groups[i]["params"]`); `shardscope convert` writes it as `torch.save`, or passes it on to
//! the safetensors / DCP writers.
//!
//! Which parameter an optimizer id is ([`id_names`]): torch maps id `i` to the `i`-th parameter of
//! the optimizer's groups by object identity. Offline we assume the optimizer was built over
//! `model.parameters()` (one group, or consecutive slices of it), so the names are, in order:
//! - without `--model`: the model state dict's `DTensor` keys (FSDP2 makes every managed
//!   parameter a DTensor; plain tensors are taken to be buffers);
//! - with `--model MODEL.json`: its `params` (named_parameters order, tied aliases dropped), or,
//!   when the optimizer holds fewer, only those with `requires_grad`.
//!
//! When the count of parameters in the optimizer's groups matches none of these, the mapping
//! cannot be decided and the conversion stops with an error naming the files. Each gathered state
//! is also checked against its parameter's shape.
//!
//! Memory: all ranks' files are read whole, and the full state is held once (fine for the sizes
//! one converts on one machine; the DCP and index paths stream instead).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::bridge;
use shardscope_core::model::tree::{Dict, DistKind, Key, Node};
use shardscope_core::transform::fsdp2_optim::{
    IdNames, dtensor_param_names, full_model_from_fsdp2, full_optim_from_fsdp2,
    optimizer_param_count,
};
use shardscope_runner::fsdp1_local::{RankFiles, find_rank_files};

/// A folder of FSDP2 per-rank files with optimizer state.
#[derive(Debug, Clone)]
pub struct Fsdp2Ranks {
    files: RankFiles,
    /// One file per rank holding `{"model": ..., "optim": ...}`.
    combined: bool,
}

impl Fsdp2Ranks {
    pub fn world_size(&self) -> usize {
        self.files.world_size
    }
}

/// What a folder is, as far as this module is concerned.
#[derive(Debug)]
pub enum Detected {
    /// FSDP2 per-rank files with optimizer state.
    Fsdp2(Fsdp2Ranks),
    /// Not for this module (a DCP directory, safetensors, model-only or FSDP1 per-rank files).
    Other,
    /// Per-rank files that do not form a complete set (the reason, to show when nothing else can
    /// read the folder either).
    Incomplete(anyhow::Error),
}

fn read_node(path: &Path) -> Result<Node> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(bridge::node_from_torch_save(
        &bytes,
        &path.display().to_string(),
    )?)
}

fn has_dtensor(d: &Dict) -> bool {
    d.iter()
        .any(|(_, v)| matches!(v, Node::Dist(t) if t.kind == DistKind::DTensor))
}

fn is_optimizer(n: &Node) -> bool {
    n.as_dict()
        .is_some_and(|d| d.get_str("state").is_some() && d.get_str("param_groups").is_some())
}

/// The `{"model", "optim"}` parts of a combined per-rank file, when it is one.
fn combined_parts(n: &Node) -> Option<(&Dict, &Dict)> {
    let d = n.as_dict()?;
    let model = d.get_str("model")?.as_dict()?;
    let optim = d.get_str("optim")?;
    is_optimizer(optim).then_some((model, optim.as_dict()?))
}

/// Looks at `src`: a folder of FSDP2 per-rank model files whose optimizer state sits next to them
/// (or inside them) is ours.
pub fn detect(src: &Path) -> Detected {
    if !src.is_dir() || src.join(".metadata").exists() {
        return Detected::Other;
    }
    let files = match find_rank_files(src, None, None) {
        Ok(f) => f,
        Err(e) => {
            let e = anyhow::Error::from(e);
            return Detected::Incomplete(match missing_ranks(src) {
                Some(gaps) => e.context(gaps),
                None => e,
            });
        }
    };
    // Only the structure: reading rank 0's tensors here would hold a whole rank file in memory
    // before any conversion starts.
    let Ok(node) = shardscope_runner::fsdp1_local::read_skeleton(&files.model_file(0)) else {
        return Detected::Other;
    };
    if let Some((model, _)) = combined_parts(&node) {
        if has_dtensor(model) {
            return Detected::Fsdp2(Fsdp2Ranks {
                files,
                combined: true,
            });
        }
        return Detected::Other;
    }
    match node.as_dict() {
        Some(model) if files.optim_pattern.is_some() && has_dtensor(model) => {
            Detected::Fsdp2(Fsdp2Ranks {
                files,
                combined: false,
            })
        }
        _ => Detected::Other,
    }
}

/// Per-rank file groups of `dir` with gaps (`rank{r}.pt` with ranks 0 and 2): "missing rank1.pt".
/// Names are grouped by their last decimal number, as `find_rank_files` groups them.
fn missing_ranks(dir: &Path) -> Option<String> {
    let mut groups: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(end) = name.rfind(|c: char| c.is_ascii_digit()).map(|i| i + 1) else {
            continue;
        };
        let start = name[..end]
            .rfind(|c: char| !c.is_ascii_digit())
            .map_or(0, |i| i + 1);
        if let Ok(rank) = name[start..end].parse::<u64>() {
            groups
                .entry((name[..start].to_owned(), name[end..].to_owned()))
                .or_default()
                .push(rank);
        }
    }
    let mut missing = Vec::new();
    for ((head, tail), mut ranks) in groups {
        ranks.sort_unstable();
        let last = *ranks.last()?;
        // Only small gaps of a rank-numbered set (not `model-00001-of-00002` style numbering).
        if ranks.len() < 2 || last > 4 * ranks.len() as u64 {
            continue;
        }
        missing.extend(
            (0..=last)
                .filter(|r| ranks.binary_search(r).is_err())
                .map(|r| format!("{head}{r}{tail}")),
        );
    }
    (!missing.is_empty()).then(|| {
        format!(
            "{}: per-rank files are missing: {}",
            dir.display(),
            missing.join(", ")
        )
    })
}

struct Loaded {
    models: Vec<Dict>,
    optims: Vec<Dict>,
    model_files: Vec<String>,
    optim_files: Vec<String>,
}

fn into_dict(n: Node, path: &Path, what: &str) -> Result<Dict> {
    match n {
        Node::Dict(d) => Ok(d),
        other => bail!(
            "{}: expected {what}, found {}",
            path.display(),
            other.kind_name()
        ),
    }
}

fn load(ranks: &Fsdp2Ranks) -> Result<Loaded> {
    let mut loaded = Loaded {
        models: Vec::new(),
        optims: Vec::new(),
        model_files: Vec::new(),
        optim_files: Vec::new(),
    };
    for r in 0..ranks.world_size() {
        let model_path = ranks.files.model_file(r);
        let label = model_path.display().to_string();
        if ranks.combined {
            let node = read_node(&model_path)?;
            let Node::Dict(mut d) = node else {
                bail!("{label}: expected a dict with `model` and `optim`");
            };
            if combined_parts(&Node::Dict(d.clone())).is_none() {
                bail!(
                    "{label}: expected a dict with `model` (a state dict) and `optim` (an optimizer state dict with `state` and `param_groups`), like rank 0's file"
                );
            }
            let model = d.remove(&Key::str("model")).unwrap_or(Node::None);
            let optim = d.remove(&Key::str("optim")).unwrap_or(Node::None);
            loaded
                .models
                .push(into_dict(model, &model_path, "a model state dict")?);
            loaded
                .optims
                .push(into_dict(optim, &model_path, "an optimizer state dict")?);
            loaded.model_files.push(format!("{label} [model]"));
            loaded.optim_files.push(format!("{label} [optim]"));
        } else {
            let optim_path: PathBuf = ranks.files.optim_file(r).unwrap_or_default();
            loaded.models.push(into_dict(
                read_node(&model_path)?,
                &model_path,
                "a model state dict",
            )?);
            let optim = read_node(&optim_path)?;
            if !is_optimizer(&optim) {
                bail!(
                    "{}: not an optimizer state dict (no `state` and `param_groups` keys)",
                    optim_path.display()
                );
            }
            loaded
                .optims
                .push(into_dict(optim, &optim_path, "an optimizer state dict")?);
            loaded.model_files.push(label);
            loaded.optim_files.push(optim_path.display().to_string());
        }
    }
    Ok(loaded)
}

/// The FQN of every optimizer id (id order) and a phrase saying where they come from.
fn id_names(
    model0: &Dict,
    model_file: &str,
    optim0: &Dict,
    optim_file: &str,
    full_model: &Dict,
    desc: Option<(&ModelDescription, &Path)>,
) -> Result<(Vec<String>, String)> {
    let count = optimizer_param_count(optim0);
    let hint = "hint: the optimizer must have been built over model.parameters() (one group, or consecutive slices of it); pass --model MODEL.json (params in named_parameters() order, with requires_grad) when it holds only the trainable ones";
    let Some((desc, desc_path)) = desc else {
        let names = dtensor_param_names(model0);
        if names.len() != count {
            bail!(
                "{optim_file}: the optimizer's param groups hold {count} parameters but {model_file} has {} DTensor parameters: cannot tell which parameter each optimizer id is\n{hint}",
                names.len()
            );
        }
        return Ok((
            names,
            format!("the DTensor parameters of {model_file}, in order"),
        ));
    };
    let all: Vec<&shardscope_core::model::description::ParamSpec> = desc
        .params
        .iter()
        .filter(|p| p.shared_with.is_none())
        .collect();
    for p in &all {
        if !full_model.contains(&Key::str(&p.fqn)) {
            bail!(
                "{}: parameter `{}` is not a key of the model state dict {model_file}",
                desc_path.display(),
                p.fqn
            );
        }
    }
    let trainable: Vec<&_> = all.iter().copied().filter(|p| p.requires_grad).collect();
    let (chosen, which) = if all.len() == count {
        (all, "the parameters")
    } else if trainable.len() == count {
        (trainable, "the parameters with requires_grad")
    } else {
        bail!(
            "{optim_file}: the optimizer's param groups hold {count} parameters but {} lists {} parameters ({} with requires_grad): cannot tell which parameter each optimizer id is\n{hint}",
            desc_path.display(),
            all.len(),
            trainable.len()
        );
    };
    Ok((
        chosen.iter().map(|p| p.fqn.clone()).collect(),
        format!("{which} of {}, in order", desc_path.display()),
    ))
}

/// Reads every rank and builds `{"model": full model state dict, "optim": full optimizer state
/// dict}` as torch's DSD returns them with `full_state_dict=True`.
pub fn full_state(ranks: &Fsdp2Ranks, desc: Option<(&ModelDescription, &Path)>) -> Result<Node> {
    let loaded = load(ranks)?;
    let models: Vec<&Dict> = loaded.models.iter().collect();
    let full_model = full_model_from_fsdp2(&models, &loaded.model_files)?;
    let (names, origin) = id_names(
        &loaded.models[0],
        &loaded.model_files[0],
        &loaded.optims[0],
        &loaded.optim_files[0],
        &full_model,
        desc,
    )?;
    let shapes: BTreeMap<String, Vec<u64>> = full_model
        .iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.as_tensor()?.shape.clone())))
        .collect();
    let optims: Vec<&Dict> = loaded.optims.iter().collect();
    let full_optim = full_optim_from_fsdp2(
        &optims,
        &loaded.optim_files,
        &IdNames {
            names: &names,
            origin: &origin,
            shapes: &shapes,
        },
    )?;
    let mut root = Dict::new();
    root.insert(Key::str("model"), Node::Dict(full_model));
    root.insert(Key::str("optim"), Node::Dict(full_optim));
    Ok(Node::Dict(root))
}

/// `torch.save` bytes of [`full_state`]'s result (loadable with `weights_only=True`).
pub fn torch_save_bytes(state: &Node) -> Result<Vec<u8>> {
    Ok(bridge::to_torch_save(state, bridge::RootDict::Plain, 0, 1)?)
}
