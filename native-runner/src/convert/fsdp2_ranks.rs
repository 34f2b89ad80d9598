//! Which folders are FSDP2 per-rank checkpoints with optimizer state: for every rank `r`,
//! `model.state_dict()` (DTensor values) and the raw `optim.state_dict()` (integer ids, DTensor
//! `exp_avg`/`exp_avg_sq`, 0-dim `step`), either as two `torch.save` files (`rank{r}_model.pt`,
//! `rank{r}_optim.pt`) or as one holding `{"model": ..., "optim": ...}` (`rank{r}.pt`). File names
//! are grouped as [`shardscope_runner::fsdp1_local`] groups them (the last number is the rank).
//!
//! Such a folder converts through the index like any checkpoint: the DTensor pieces are chunks of
//! their global tensors, and `shardscope_core::view::fsdp2` names the optimizer ids (its
//! module doc says how), giving what torch's `get_model_state_dict` /
//! `get_optimizer_state_dict(full_state_dict=True)` return.

use std::collections::BTreeMap;
use std::path::Path;

use shardscope_core::model::tree::{Dict, DistKind, Node};
use shardscope_runner::fsdp1_local::find_rank_files;

/// A folder of FSDP2 per-rank files with optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fsdp2Ranks {
    pub world_size: usize,
    /// One file per rank holding `{"model": ..., "optim": ...}`.
    pub combined: bool,
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
    /// Several per-rank sets could be the model's (or the optimizer's): reading the folder would
    /// mix them; `--model-files`/`--optim-files` choose.
    Ambiguous(anyhow::Error),
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
/// `model_files`/`optim_files` name the model and optimizer file sets (`--model-files`/
/// `--optim-files`; default: found by name and content).
pub fn detect_with(src: &Path, model_files: Option<&str>, optim_files: Option<&str>) -> Detected {
    if !src.is_dir() || src.join(".metadata").exists() {
        return Detected::Other;
    }
    let files = match find_rank_files(src, model_files, optim_files) {
        Ok(f) => f,
        Err(e @ shardscope_runner::fsdp1_local::Fsdp1LocalError::Ambiguous { .. }) => {
            return Detected::Ambiguous(e.into());
        }
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
    let node = match shardscope_runner::fsdp1_local::read_skeleton(&files.model_file(0)) {
        Ok(node) => node,
        // Shown only when nothing else reads the folder (e.g. DTensor placements other than
        // FSDP2's: the generic error alone would not say why).
        Err(e) => return Detected::Incomplete(anyhow::Error::from(e)),
    };
    if let Some((model, _)) = combined_parts(&node) {
        if has_dtensor(model) {
            return Detected::Fsdp2(Fsdp2Ranks {
                world_size: files.world_size,
                combined: true,
            });
        }
        return Detected::Other;
    }
    match node.as_dict() {
        Some(model) if files.optim_pattern.is_some() && has_dtensor(model) => {
            Detected::Fsdp2(Fsdp2Ranks {
                world_size: files.world_size,
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
