//! FSDP2 per-rank folders with optimizer state: for every rank `r`, `model.state_dict()` (DTensor
//! values) and the raw `optim.state_dict()` (integer ids, DTensor `exp_avg`/`exp_avg_sq`, 0-dim
//! `step`), either as two `torch.save` files (`rank{r}_model.pt`, `rank{r}_optim.pt`) or as one
//! holding `{"model": ..., "optim": ...}` (`rank{r}.pt`). File names are grouped as
//! [`shardscope_runner::fsdp1_local`] groups them (the last number is the rank).
//!
//! [`FullState`] plans `{"model": M, "optim": O}` where `M` and `O` equal what torch's
//! `get_model_state_dict` / `get_optimizer_state_dict(model, optim,
//! options=StateDictOptions(full_state_dict=True))` return (FQN keys in `state`, FQNs in
//! `param_groups[i]["params"]`); `shardscope convert` writes it as `torch.save` ([`FullState::write`]),
//! or passes that file on to the safetensors / DCP writers.
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
//! Memory: the output streams, a tensor at a time. Every rank file's zip directory and pickle are
//! read once into a *skeleton* (tensors with dtype and shape but no bytes,
//! [`shardscope_runner::fsdp1_local::lazy::LazyFile`]); only plain tensors (0-dim `step`, buffers,
//! which must be equal on every rank) are read whole. The structure and every check come from the
//! same code as the in-memory transform ([`full_model_from_fsdp2_with`],
//! [`full_optim_from_fsdp2_with`]) with each DTensor made into a tensor without bytes; when the
//! `torch.save` writer asks for its storage, the full tensor is assembled from the ranks' local
//! pieces with positioned reads at their dim-0 offsets. Peak memory is about the largest full
//! tensor plus the plain tensors of every rank.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::bridge::RootDict;
use shardscope_core::model::tree::{Dict, DistKind, Key, Node, Tensor};
use shardscope_core::transform::fsdp2_optim::{
    DTensorValue, IdNames, dtensor_param_names, full_model_from_fsdp2_with,
    full_optim_from_fsdp2_with, optimizer_param_count,
};
use shardscope_runner::fsdp1_local::lazy::{self, LazyFile};
use shardscope_runner::fsdp1_local::{Fsdp1LocalError, RankFiles, find_rank_files};

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

/// Every rank's files opened lazily, and their skeletons.
struct Loaded {
    files: Vec<LazyFile>,
    models: Vec<Dict>,
    optims: Vec<Dict>,
    /// Per rank: the index in `files` and the path prefix of the model / optimizer state dict.
    model_src: Vec<(usize, &'static str)>,
    optim_src: Vec<(usize, &'static str)>,
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

/// `node` (a skeleton of `file`, found at `path`) with every plain tensor read; DTensors keep no
/// bytes.
fn read_plain_tensors(file: &LazyFile, node: Node, path: &str) -> Result<Node> {
    Ok(match node {
        Node::Tensor(t) => Node::Tensor(Tensor {
            data: file.read_tensor(path)?,
            ..t
        }),
        Node::Dict(d) => Node::Dict(
            d.into_entries()
                .into_iter()
                .map(|(k, v)| {
                    let sub = format!("{path}/{k}");
                    Ok((k, read_plain_tensors(file, v, &sub)?))
                })
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .collect(),
        ),
        Node::List(items) => Node::List(read_plain_items(file, items, path)?),
        Node::Tuple(items) => Node::Tuple(read_plain_items(file, items, path)?),
        other => other,
    })
}

fn read_plain_items(file: &LazyFile, items: Vec<Node>, path: &str) -> Result<Vec<Node>> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, x)| read_plain_tensors(file, x, &format!("{path}/{i}")))
        .collect()
}

fn open(path: &Path) -> Result<(LazyFile, Node)> {
    let (file, node) = LazyFile::open(path)?;
    let node = read_plain_tensors(&file, node, "")?;
    Ok((file, node))
}

fn load(ranks: &Fsdp2Ranks) -> Result<Loaded> {
    let mut loaded = Loaded {
        files: Vec::new(),
        models: Vec::new(),
        optims: Vec::new(),
        model_src: Vec::new(),
        optim_src: Vec::new(),
        model_files: Vec::new(),
        optim_files: Vec::new(),
    };
    for r in 0..ranks.world_size() {
        let model_path = ranks.files.model_file(r);
        let label = model_path.display().to_string();
        if ranks.combined {
            let (file, node) = open(&model_path)?;
            if combined_parts(&node).is_none() {
                bail!(
                    "{label}: expected a dict with `model` (a state dict) and `optim` (an optimizer state dict with `state` and `param_groups`), like rank 0's file"
                );
            }
            let Node::Dict(mut d) = node else {
                bail!("{label}: expected a dict with `model` and `optim`");
            };
            let model = d.remove(&Key::str("model")).unwrap_or(Node::None);
            let optim = d.remove(&Key::str("optim")).unwrap_or(Node::None);
            loaded
                .models
                .push(into_dict(model, &model_path, "a model state dict")?);
            loaded
                .optims
                .push(into_dict(optim, &model_path, "an optimizer state dict")?);
            loaded.model_src.push((loaded.files.len(), "/model"));
            loaded.optim_src.push((loaded.files.len(), "/optim"));
            loaded.files.push(file);
            loaded.model_files.push(format!("{label} [model]"));
            loaded.optim_files.push(format!("{label} [optim]"));
        } else {
            let optim_path: PathBuf = ranks.files.optim_file(r).unwrap_or_default();
            let (file, model) = open(&model_path)?;
            loaded
                .models
                .push(into_dict(model, &model_path, "a model state dict")?);
            loaded.model_src.push((loaded.files.len(), ""));
            loaded.files.push(file);
            let (file, optim) = open(&optim_path)?;
            if !is_optimizer(&optim) {
                bail!(
                    "{}: not an optimizer state dict (no `state` and `param_groups` keys)",
                    optim_path.display()
                );
            }
            loaded
                .optims
                .push(into_dict(optim, &optim_path, "an optimizer state dict")?);
            loaded.optim_src.push((loaded.files.len(), ""));
            loaded.files.push(file);
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

/// One rank's local piece of a full tensor: `numel` elements of the tensor at `path` of
/// `files[file]`, from element `first` of the full tensor on.
#[derive(Debug)]
struct Piece {
    file: usize,
    path: String,
    first: u64,
    numel: u64,
}

/// A full tensor of the output made from the ranks' DTensor pieces.
#[derive(Debug)]
struct Gathered {
    item: u64,
    numel: u64,
    pieces: Vec<Piece>,
}

/// `/a/b/c` for the keys `a`, `b`, `c` (the path format of the bridge and of skeletons).
fn key_path(prefix: &str, keys: &[Key]) -> String {
    let mut out = prefix.to_owned();
    for k in keys {
        out.push('/');
        out.push_str(&k.to_string());
    }
    out
}

/// Records where the full tensor of `v` comes from (under `out_prefix` in the output, the ranks'
/// `src` files and prefixes) and gives its skeleton (no bytes).
fn plan_gather(
    v: &DTensorValue<'_>,
    out_prefix: &str,
    src: &[(usize, &'static str)],
    gathers: &mut HashMap<String, Gathered>,
) -> Tensor {
    let first = v.pieces[0];
    let pieces = v
        .placement
        .iter()
        .zip(src)
        .filter(|((_, numel), _)| *numel > 0)
        .map(|(&(first, numel), &(file, prefix))| Piece {
            file,
            path: key_path(prefix, v.source),
            first,
            numel,
        })
        .collect();
    gathers.insert(
        key_path(out_prefix, v.target),
        Gathered {
            item: first.dtype.size_bytes() as u64,
            numel: v.placement.iter().map(|p| p.1).sum(),
            pieces,
        },
    );
    Tensor {
        dtype: first.dtype,
        shape: first.global_shape.clone(),
        data: Vec::new(),
    }
}

/// The full `{"model", "optim"}` state of a per-rank folder, planned: its structure (checked as
/// the in-memory transform checks it) with the plain tensors' bytes, and where every full
/// tensor's bytes lie in the ranks' files.
#[derive(Debug)]
pub struct FullState {
    files: Vec<LazyFile>,
    /// The output without any tensor bytes.
    skeleton: Node,
    /// Bytes of the plain tensors (rank 0's), by output path.
    plain: HashMap<String, Vec<u8>>,
    /// Full tensors gathered from DTensor pieces, by output path.
    gathers: HashMap<String, Gathered>,
}

// The error types are the libraries' (`Fsdp2OptimError`, `Fsdp1LocalError`), returned once per run.
#[allow(clippy::result_large_err)]
impl FullState {
    /// Reads every rank's structure and plans `{"model": full model state dict, "optim": full
    /// optimizer state dict}` as torch's DSD returns them with `full_state_dict=True`.
    pub fn open(ranks: &Fsdp2Ranks, desc: Option<(&ModelDescription, &Path)>) -> Result<Self> {
        let loaded = load(ranks)?;
        let mut gathers = HashMap::new();
        let models: Vec<&Dict> = loaded.models.iter().collect();
        let full_model = full_model_from_fsdp2_with(&models, &loaded.model_files, &mut |v| {
            Ok(plan_gather(v, "/model", &loaded.model_src, &mut gathers))
        })?;
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
        let full_optim = full_optim_from_fsdp2_with(
            &optims,
            &loaded.optim_files,
            &IdNames {
                names: &names,
                origin: &origin,
                shapes: &shapes,
            },
            &mut |v| Ok(plan_gather(v, "/optim", &loaded.optim_src, &mut gathers)),
        )?;
        let mut root = Dict::new();
        root.insert(Key::str("model"), Node::Dict(full_model));
        root.insert(Key::str("optim"), Node::Dict(full_optim));
        let mut plain = HashMap::new();
        let skeleton = lazy::split_tensors(Node::Dict(root), "", &mut plain);
        plain.retain(|path, _| !gathers.contains_key(path));
        Ok(FullState {
            files: loaded.files,
            skeleton,
            plain,
            gathers,
        })
    }

    /// The bytes of the full tensor at output path `path`, read from the ranks' pieces.
    fn gather(&self, path: &str) -> Result<Vec<u8>, Fsdp1LocalError> {
        let content = |reason: String| Fsdp1LocalError::Content {
            file: PathBuf::from("<output>"),
            reason,
        };
        let g = self
            .gathers
            .get(path)
            .ok_or_else(|| content(format!("no tensor planned at `{path}`")))?;
        let len = g
            .numel
            .checked_mul(g.item)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                content(format!(
                    "`{path}`: {} elements do not fit in memory",
                    g.numel
                ))
            })?;
        let mut buf = vec![0u8; len];
        for p in &g.pieces {
            // The placement was checked: the pieces tile the tensor, so these are in bounds.
            let start = (p.first * g.item) as usize;
            let end = ((p.first + p.numel) * g.item) as usize;
            self.files[p.file].read_elems_into(&p.path, 0, &mut buf[start..end])?;
        }
        Ok(buf)
    }

    /// `torch.save` of the full state into `out` (loadable with `weights_only=True`), one
    /// storage at a time. Returns `out`.
    pub fn write<W: Write>(&self, out: W) -> Result<W> {
        Ok(lazy::write_torch_save(
            out,
            &self.skeleton,
            RootDict::Plain,
            (0, 1),
            (0, 1),
            |path| match self.plain.get(path) {
                Some(data) => Ok(data.clone()),
                None => self.gather(path),
            },
        )?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use shardscope_core::model::bridge;
    use shardscope_core::transform::fsdp2_optim::{full_model_from_fsdp2, full_optim_from_fsdp2};

    fn whole(path: &Path) -> Node {
        let bytes = std::fs::read(path).unwrap();
        bridge::node_from_torch_save(&bytes, &path.display().to_string()).unwrap()
    }

    /// The earlier implementation: every file read whole, the in-memory transforms, one
    /// `torch.save` of the result.
    fn in_memory(ranks: &Fsdp2Ranks) -> Vec<u8> {
        let (mut models, mut optims, mut labels) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..ranks.world_size() {
            let model_path = ranks.files.model_file(r);
            labels.push(model_path.display().to_string());
            if ranks.combined {
                let Node::Dict(mut d) = whole(&model_path) else {
                    panic!("not a dict")
                };
                models.push(
                    into_dict(d.remove(&Key::str("model")).unwrap(), &model_path, "").unwrap(),
                );
                optims.push(
                    into_dict(d.remove(&Key::str("optim")).unwrap(), &model_path, "").unwrap(),
                );
            } else {
                models.push(into_dict(whole(&model_path), &model_path, "").unwrap());
                let optim_path = ranks.files.optim_file(r).unwrap();
                optims.push(into_dict(whole(&optim_path), &optim_path, "").unwrap());
            }
        }
        let model_refs: Vec<&Dict> = models.iter().collect();
        let full_model = full_model_from_fsdp2(&model_refs, &labels).unwrap();
        let names = dtensor_param_names(&models[0]);
        let shapes: BTreeMap<String, Vec<u64>> = full_model
            .iter()
            .filter_map(|(k, v)| Some((k.to_string(), v.as_tensor()?.shape.clone())))
            .collect();
        let optim_refs: Vec<&Dict> = optims.iter().collect();
        let ids = IdNames {
            names: &names,
            origin: "test",
            shapes: &shapes,
        };
        let full_optim = full_optim_from_fsdp2(&optim_refs, &labels, &ids).unwrap();
        let mut root = Dict::new();
        root.insert(Key::str("model"), Node::Dict(full_model));
        root.insert(Key::str("optim"), Node::Dict(full_optim));
        bridge::to_torch_save(&Node::Dict(root), RootDict::Plain, 0, 1).unwrap()
    }

    #[test]
    fn streaming_output_equals_the_in_memory_transform() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/fsdp2_optim");
        // ws2: model and optimizer files per rank; ws3: one combined file per rank.
        for ws in ["ws2", "ws3"] {
            let Detected::Fsdp2(ranks) = detect(&fixtures.join(ws)) else {
                panic!("{ws}: not detected as FSDP2 per-rank files");
            };
            let streamed = FullState::open(&ranks, None)
                .unwrap()
                .write(Vec::new())
                .unwrap();
            assert!(
                streamed == in_memory(&ranks),
                "{ws}: the streamed torch.save differs from the in-memory one"
            );
        }
    }
}
