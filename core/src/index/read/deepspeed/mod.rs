//! DeepSpeed ZeRO checkpoints (`DeepSpeedEngine.save_checkpoint`), read as DeepSpeed's own
//! `deepspeed/utils/zero_to_fp32.py` (`get_fp32_state_dict_from_zero_checkpoint`) reads them: the
//! model is the fp32 master weights held in the ranks' optimizer partitions, named by the model
//! states' `param_shapes`.
//!
//! The index's model entries are the state dict `zero_to_fp32` returns, in its order and with its
//! names: the buffers (from `module`, by `buffer_names`), the frozen parameters
//! (`frozen_param_fragments`: whole on rank 0 for ZeRO-1/2, a fragment per rank for ZeRO-3), the
//! trainable parameters (the fp32 flat groups through the partition math of [`plan`]), then the
//! tied names of `shared_params` (the same chunks as the name they are tied to, so a conversion
//! writes one copy). Each parameter's chunks are byte ranges of the flat partitions: a parameter
//! lying whole in one partition is one chunk per row run; a parameter split across ranks (ZeRO-3
//! always, ZeRO-1/2 at a partition boundary) has a chunk per piece. No tensor byte is read.
//!
//! The rest of rank 0's model states file (counters, `ds_config`, `ds_version`, the lr scheduler,
//! client state) is kept under `extra.`; `module`'s copy of the parameters in the training
//! precision is not read (the fp32 master weights are the model, as for `zero_to_fp32`).
//!
//! What `zero_to_fp32` refuses is refused, with the file and key named: missing ranks, a
//! `partition_count` that is not the number of optimizer files, partitions that the parameters do
//! not fill, stages mixed in one folder.

mod files;
mod optimizer;
mod padding;
pub mod partitions;
mod plan;
mod records;
#[cfg(test)]
pub(crate) mod tests;
mod universal;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use crate::dtype::DType;
use crate::index::read::items::FolderRead;
use crate::index::read::torch::{flatten, join_path};
use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, EntryKind, FileInfo, Format, IndexEntry, IndexError,
    PathSeg, RankGroup, ZeroPrecision, json_of,
};
use crate::source::Source;

use files::check_ranks;
pub use files::looks_like_deepspeed;
pub use padding::{NonZeroPadding, PaddingCheck, check_padding};
use plan::ParamPlan;
use records::{Flat, ModelStates, OptimStates, Reader, Stored, bad, open_archive};
pub use universal::{index_universal, looks_like_universal};

/// The prefix under which the training state beside the model is kept.
const EXTRA: &str = "extra";

/// A model entry being built, in `zero_to_fp32`'s order.
struct Tensor {
    dtype: DType,
    shape: Vec<u64>,
    chunks: Vec<Chunk>,
}

/// The state dict `zero_to_fp32` builds: names in insertion order (a name set again keeps its
/// place, as in a Python dict).
#[derive(Default)]
struct StateDict {
    order: Vec<String>,
    values: HashMap<String, Tensor>,
}

impl StateDict {
    fn insert(&mut self, name: &str, t: Tensor) {
        if self.values.insert(name.to_owned(), t).is_none() {
            self.order.push(name.to_owned());
        }
    }
}

/// Indexes the DeepSpeed checkpoint `names` hold ([`looks_like_deepspeed`]).
pub fn index_deepspeed(source: &dyn Source, names: &[String]) -> Result<FolderRead, IndexError> {
    let folder = files::locate(source, names)?;
    let save = files::save_files(&folder)?;
    let mut notes = folder_notes(&folder);
    let mut file_infos = BTreeMap::new();
    let (optim, optim_pattern) = read_optim(source, &folder, &save, &mut file_infos)?;
    let (stage, world_size) = (optim[0].stage, optim[0].partition_count);
    let (model, extra, model_pattern) =
        read_model(source, &folder, &save, world_size, &mut file_infos)?;
    let zero = &model[0];
    let mut sd = StateDict::default();
    buffers(zero, &mut sd, &mut notes);
    frozen(stage, &model, &mut sd)?;
    frozen_from_module(stage, zero, &mut sd, &mut notes);
    let plans = trainable(stage, zero, &optim, &mut sd)?;
    ties(zero, &mut sd);
    left_out(zero, &sd, &mut notes);
    let precision = zero.precision.unwrap_or(if save.bf16_names {
        ZeroPrecision::Bf16
    } else {
        ZeroPrecision::Fp32
    });
    let optimizer = optimizer::entries(zero, &optim, &plans, &mut notes)?;
    let has_optimizer_state = !optimizer.is_empty();
    let entries = all_entries(sd, optimizer.into_iter().chain(extra), &zero.file)?;
    let sets = read_sets(&save, &model_pattern, &optim_pattern);
    let index = CheckpointIndex {
        format: Format::TorchSave,
        kind: CheckpointKind::DeepSpeedZero { stage, precision },
        has_optimizer_state,
        entries,
        files: file_infos,
        dcp: None,
    };
    Ok((index, sets, notes))
}

/// Notes on how the folder was found: the tag read, the files beside it not read.
fn folder_notes(folder: &files::Folder) -> Vec<String> {
    const SHOWN: usize = 8;
    let mut notes = Vec::new();
    if let Some(chosen) = &folder.chosen {
        notes.push(format!("DeepSpeed checkpoint: read {chosen}"));
    }
    if !folder.not_read.is_empty() {
        let mut list: Vec<&str> = folder
            .not_read
            .iter()
            .take(SHOWN)
            .map(String::as_str)
            .collect();
        list.sort_unstable();
        let more = folder.not_read.len().saturating_sub(SHOWN);
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        notes.push(format!(
            "files beside the DeepSpeed checkpoint are not read: {}{tail}",
            list.join(", ")
        ));
    }
    notes
}

/// The optimizer files, checked to be ranks `0..partition_count` of one stage, with the pattern
/// that names them (`{r}` for the rank).
fn read_optim(
    source: &dyn Source,
    folder: &files::Folder,
    save: &files::SaveFiles,
    file_infos: &mut BTreeMap<String, FileInfo>,
) -> Result<(Vec<OptimStates>, String), IndexError> {
    let mut optim: Vec<OptimStates> = Vec::with_capacity(save.optim.len());
    for (rank, name) in &save.optim {
        let archive = open_archive(source, name)?;
        let reader = Reader {
            file: Arc::from(name.as_str()),
            rank: Some(*rank),
            archive: &archive,
        };
        optim.push(records::optim_states(&reader)?);
        file_infos.insert(name.clone(), file_info(source, name, Some(*rank))?);
    }
    let pattern = format!(
        "{}{}zero_pp_rank_{{r}}_mp_rank_00_optim_states.pt",
        folder.prefix,
        if save.bf16_names { "bf16_" } else { "" }
    );
    let first = &optim[0];
    check_ranks(
        &save.optim,
        first.partition_count,
        &pattern,
        &format!("`partition_count` of {} says", first.file),
    )?;
    let stage = first.stage;
    if let Some(o) = optim.iter().find(|o| o.stage != stage) {
        return Err(bad(
            &o.file,
            format!(
                "ZeRO stages mixed: this file is ZeRO-{}, {} is ZeRO-{stage}",
                o.stage, first.file
            ),
        ));
    }
    if (stage == 3) != save.zero3_model {
        let model = if save.zero3_model {
            "ZeRO-3's per-rank model files"
        } else {
            "a ZeRO-1/2 model file"
        };
        return Err(bad(
            &save.model[0].1,
            format!(
                "ZeRO stages mixed: {model} beside ZeRO-{stage} optimizer files ({})",
                first.file
            ),
        ));
    }
    Ok((optim, pattern))
}

/// The model states files (rank 0's; every rank's for ZeRO-3, checked to be `0..world_size`), the
/// training state of rank 0's under `extra.`, and the pattern of ZeRO-3's files.
fn read_model(
    source: &dyn Source,
    folder: &files::Folder,
    save: &files::SaveFiles,
    world_size: u64,
    file_infos: &mut BTreeMap<String, FileInfo>,
) -> Result<(Vec<ModelStates>, Vec<IndexEntry>, String), IndexError> {
    let pattern = format!(
        "{}zero_pp_rank_{{r}}_mp_rank_00_model_states.pt",
        folder.prefix
    );
    if save.zero3_model {
        check_ranks(
            &save.model,
            world_size,
            &pattern,
            "ZeRO-3 writes a model states file per rank:",
        )?;
    }
    let (model, extra) = model_states_files(source, &save.model, save.zero3_model, file_infos)?;
    Ok((model, extra, pattern))
}

/// Reads the model states `files` (rank, name; ranked files when `per_rank`, ZeRO-3's), and the
/// training state of the first under `extra.`.
fn model_states_files(
    source: &dyn Source,
    files: &[(u32, String)],
    per_rank: bool,
    file_infos: &mut BTreeMap<String, FileInfo>,
) -> Result<(Vec<ModelStates>, Vec<IndexEntry>), IndexError> {
    let mut model: Vec<ModelStates> = Vec::with_capacity(files.len());
    let mut extra = Vec::new();
    for (i, (rank, name)) in files.iter().enumerate() {
        let archive = open_archive(source, name)?;
        let rank = per_rank.then_some(*rank);
        let reader = Reader {
            file: Arc::from(name.as_str()),
            rank,
            archive: &archive,
        };
        model.push(records::model_states(&reader)?);
        if i == 0 {
            extra = extra_entries(&reader)?;
        }
        file_infos.insert(name.clone(), file_info(source, name, rank)?);
    }
    Ok((model, extra))
}

/// The state dict's entries, then `rest` (optimizer, training state), `position` keeping that
/// order, sorted by key; a key both in the model and in `rest` is an error naming `file`.
fn all_entries(
    sd: StateDict,
    rest: impl Iterator<Item = IndexEntry>,
    file: &str,
) -> Result<Vec<IndexEntry>, IndexError> {
    let mut entries = model_entries(sd);
    let before = entries.len() as u64;
    for (i, mut e) in rest.enumerate() {
        e.position = Some(before + i as u64);
        entries.push(e);
    }
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    if let Some(w) = entries.windows(2).find(|w| w[0].key == w[1].key) {
        return Err(bad(
            file,
            format!(
                "the key `{}` is both a model name and training state",
                w[0].key
            ),
        ));
    }
    Ok(entries)
}

/// The state dict's tensors as entries, `position` keeping its order.
fn model_entries(mut sd: StateDict) -> Vec<IndexEntry> {
    let mut entries = Vec::with_capacity(sd.order.len());
    for (position, name) in sd.order.iter().enumerate() {
        let Some(t) = sd.values.remove(name) else {
            continue;
        };
        entries.push(IndexEntry {
            dtype: Some(t.dtype),
            shape: Some(t.shape),
            chunks: t.chunks,
            position: Some(position as u64),
            ..entry(
                name.clone(),
                vec![PathSeg::Key(name.clone())],
                EntryKind::Tensor,
            )
        });
    }
    entries
}

/// The file sets read: the model's and the optimizer's.
fn read_sets(
    save: &files::SaveFiles,
    model_pattern: &str,
    optim_pattern: &str,
) -> Vec<crate::index::ReadSet> {
    vec![
        (
            RankGroup {
                pattern: if save.zero3_model {
                    model_pattern.replace("{r}", "{R}")
                } else {
                    save.model[0].1.clone()
                },
                files: save
                    .model
                    .iter()
                    .map(|(r, n)| (n.clone(), save.zero3_model.then_some(*r)))
                    .collect(),
            },
            "model",
        ),
        (
            RankGroup {
                pattern: optim_pattern.replace("{r}", "{R}"),
                files: save
                    .optim
                    .iter()
                    .map(|(r, n)| (n.clone(), Some(*r)))
                    .collect(),
            },
            "optim",
        ),
    ]
}

fn file_info(source: &dyn Source, name: &str, rank: Option<u32>) -> Result<FileInfo, IndexError> {
    Ok(FileInfo {
        size: source.size(name)?,
        rank,
        unreferenced_bytes: 0,
    })
}

/// `{k: v.float() if floating else v for k, v in module.items() if k in buffer_names}`: the
/// buffers in `module`'s order. A floating buffer that is not float32 is kept as stored (an index
/// reads bytes, it does not cast them), with a note.
fn buffers(zero: &ModelStates, sd: &mut StateDict, notes: &mut Vec<String>) {
    let names: HashSet<&str> = zero.buffer_names.iter().map(String::as_str).collect();
    let mut cast = Vec::new();
    for (name, t) in &zero.module {
        if !names.contains(name.as_str()) {
            continue;
        }
        if t.dtype().is_floating_point() && t.dtype() != DType::Float32 {
            cast.push(format!("{name} ({})", t.dtype()));
        }
        sd.insert(name, whole(t));
    }
    if !cast.is_empty() {
        notes.push(format!(
            "buffers kept in their stored dtype, where zero_to_fp32 gives them as float32 (`.float()`): {}\nhint: `convert --dtype fp32` casts them (and every other floating tensor)",
            cast.join(", ")
        ));
    }
}

fn whole(t: &Stored) -> Tensor {
    Tensor {
        dtype: t.dtype(),
        shape: t.tensor.shape.clone(),
        chunks: vec![t.chunk()],
    }
}

/// The frozen parameters (`frozen_param_shapes` order): ZeRO-1/2 `frozen_param_fragments[name]`
/// of rank 0 as it is; ZeRO-3 the ranks' fragments concatenated, the first `numel` elements.
fn frozen(stage: u8, model: &[ModelStates], sd: &mut StateDict) -> Result<(), IndexError> {
    let zero = &model[0];
    let Some(shapes) = zero.frozen_param_shapes.as_ref().filter(|s| !s.is_empty()) else {
        return Ok(());
    };
    // Each rank's fragments by name.
    let by_name: Vec<HashMap<&str, &Stored>> = model
        .iter()
        .map(|m| {
            m.frozen_param_fragments
                .iter()
                .flatten()
                .map(|(n, t)| (n.as_str(), t))
                .collect()
        })
        .collect();
    // Rank `rank`'s fragment of `name`.
    let fragment = |rank: usize, name: &str| -> Result<Stored, IndexError> {
        let m = &model[rank];
        by_name[rank]
            .get(name)
            .map(|t| (*t).clone())
            .ok_or_else(|| {
                bad(
                    &m.file,
                    format!("`frozen_param_fragments` has no `{name}`, which `frozen_param_shapes` lists"),
                )
            })
    };
    for (name, shape) in shapes {
        if stage <= 2 {
            sd.insert(name, whole(&fragment(0, name)?));
            continue;
        }
        let mut flats = Vec::with_capacity(model.len());
        for (rank, m) in model.iter().enumerate() {
            let key = format!("frozen_param_fragments.{name}");
            let f = fragment(rank, name)?.flat(&key)?;
            if f.dtype != flats.first().map_or(f.dtype, |g: &Flat| g.dtype) {
                return Err(bad(
                    &m.file,
                    format!("`{key}` is {}, rank 0's is {}", f.dtype, flats[0].dtype),
                ));
            }
            flats.push(f);
        }
        let lens: Vec<u64> = flats.iter().map(|f| f.numel).collect();
        let plan = plan::zero3_frozen(name, shape, &lens).map_err(|e| bad(&zero.file, e))?;
        let chunks = plan::chunks(&plan, |r, _| flats.get(r)).map_err(|e| bad(&zero.file, e))?;
        sd.insert(
            name,
            Tensor {
                dtype: flats[0].dtype,
                shape: shape.clone(),
                chunks,
            },
        );
    }
    Ok(())
}

/// ZeRO-1's frozen parameters: DeepSpeed 0.19.8 records no `frozen_param_shapes` (nor
/// fragments) for ZeRO-1, so `zero_to_fp32` leaves them out; they are in `module`, whole, in the
/// training precision (the parameter itself: no fp32 copy of a frozen parameter exists). Taken
/// from there, in `module`'s order, where `zero_to_fp32` puts frozen parameters (after the
/// buffers), with a note: the names of `module` that are no buffer, no parameter of
/// `param_shapes` and no tied alias.
fn frozen_from_module(stage: u8, zero: &ModelStates, sd: &mut StateDict, notes: &mut Vec<String>) {
    if stage > 2
        || zero
            .frozen_param_shapes
            .as_ref()
            .is_some_and(|f| !f.is_empty())
    {
        return;
    }
    let buffers: HashSet<&str> = zero.buffer_names.iter().map(String::as_str).collect();
    let trainable: HashSet<&str> = zero
        .param_shapes
        .iter()
        .flatten()
        .map(|(n, _)| n.as_str())
        .collect();
    let aliases: HashSet<&str> = zero.shared_params.iter().map(|(a, _)| a.as_str()).collect();
    let mut added = Vec::new();
    for (name, t) in &zero.module {
        let n = name.as_str();
        if buffers.contains(n) || trainable.contains(n) || aliases.contains(n) {
            continue;
        }
        if sd.values.contains_key(n) {
            continue;
        }
        sd.insert(name, whole(t));
        added.push(format!("{name} ({})", t.dtype()));
    }
    if !added.is_empty() {
        notes.push(format!(
            "included, where zero_to_fp32 leaves them out: {} (frozen parameters of a ZeRO-{stage} save, which records no `frozen_param_shapes`: taken from `module`, whole, in the training precision, which is the parameter itself)",
            added.join(", ")
        ));
    }
}

/// The trainable parameters from the fp32 flat groups, through [`plan`].
fn trainable(
    stage: u8,
    zero: &ModelStates,
    optim: &[OptimStates],
    sd: &mut StateDict,
) -> Result<Vec<ParamPlan>, IndexError> {
    let first = &optim[0];
    for o in optim {
        if o.groups.len() != first.groups.len() {
            return Err(bad(
                &o.file,
                format!(
                    "{} fp32 partitions, {} has {}",
                    o.groups.len(),
                    first.file,
                    first.groups.len()
                ),
            ));
        }
        for (g, (a, b)) in o.groups.iter().zip(&first.groups).enumerate() {
            if a.dtype != b.dtype {
                return Err(bad(
                    &o.file,
                    format!(
                        "fp32 partition {g} is {}, {}'s is {}",
                        a.dtype, first.file, b.dtype
                    ),
                ));
            }
        }
    }
    let lens: Vec<Vec<u64>> = optim
        .iter()
        .map(|o| o.groups.iter().map(|g| g.numel).collect())
        .collect();
    let plans: Vec<ParamPlan> = if stage <= 2 {
        plan::zero12(
            &zero.param_shapes,
            &lens,
            first.alignment_paddings.as_deref(),
        )
    } else {
        let mut merged: Vec<(String, Vec<u64>)> = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for (name, shape) in zero.param_shapes.iter().flatten() {
            if !seen.insert(name.as_str()) {
                return Err(bad(
                    &zero.file,
                    format!("`param_shapes` lists `{name}` in two groups"),
                ));
            }
            merged.push((name.clone(), shape.clone()));
        }
        plan::zero3(&merged, &lens)
    }
    .map_err(|e| {
        bad(
            &first.file,
            format!(
                "the fp32 partitions do not fit `param_shapes` of {}: {e}",
                zero.file
            ),
        )
    })?;
    for p in &plans {
        let chunks = plan::chunks(p, |r, g| optim.get(r).and_then(|o| o.groups.get(g)))
            .map_err(|e| bad(&first.file, e))?;
        let dtype = p
            .pieces
            .first()
            .and_then(|piece| first.groups.get(piece.slot))
            .or(first.groups.first())
            .map_or(DType::Float32, |g| g.dtype);
        sd.insert(
            &p.name,
            Tensor {
                dtype,
                shape: p.shape.clone(),
                chunks,
            },
        );
    }
    Ok(plans)
}

/// The tied names of `shared_params`: `state_dict[alias] = state_dict[name]` when `name` is there
/// (the same chunks: one copy is written).
fn ties(zero: &ModelStates, sd: &mut StateDict) {
    for (alias, name) in &zero.shared_params {
        if let Some(t) = sd.values.get(name) {
            let copy = Tensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
                chunks: t.chunks.clone(),
            };
            sd.insert(alias, copy);
        }
    }
}

/// Notes the parameters of `module` that `zero_to_fp32` leaves out (DeepSpeed recorded no fp32
/// copy of them: frozen parameters under ZeRO-1 are not in `frozen_param_shapes`).
fn left_out(zero: &ModelStates, sd: &StateDict, notes: &mut Vec<String>) {
    let buffers: HashSet<&str> = zero.buffer_names.iter().map(String::as_str).collect();
    let missing: Vec<&str> = zero
        .module
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !sd.values.contains_key(*n) && !buffers.contains(n))
        .collect();
    if !missing.is_empty() {
        notes.push(format!(
            "left out as zero_to_fp32 leaves them out (in `module` only, in the training precision; DeepSpeed recorded no fp32 copy, e.g. frozen parameters under ZeRO-1): {}",
            missing.join(", ")
        ));
    }
}

/// The training state of rank 0's model states file (everything but DeepSpeed's records of the
/// model) under `extra.`, read as `torch.save` values are.
fn extra_entries(r: &Reader<'_>) -> Result<Vec<IndexEntry>, IndexError> {
    let mut leaves = Vec::new();
    flatten(&r.archive.root, &mut Vec::new(), &mut leaves);
    let mut out = Vec::new();
    for leaf in leaves {
        let Some(PathSeg::Key(top)) = leaf.path.first() else {
            continue;
        };
        if records::MODEL_RECORD_KEYS.contains(&top.as_str()) {
            continue;
        }
        let mut path = vec![PathSeg::Key(EXTRA.to_owned())];
        path.extend(leaf.path.iter().cloned());
        let key = join_path(&path);
        let entry = match leaf.value {
            crate::formats::pickle::PyValue::Tensor(_) => {
                let t = r.tensor(leaf.value, &join_path(&leaf.path))?;
                IndexEntry {
                    dtype: Some(t.dtype()),
                    shape: Some(t.tensor.shape.clone()),
                    chunks: vec![t.chunk()],
                    ..entry(key, path, EntryKind::Tensor)
                }
            }
            other => IndexEntry {
                value: Some(json_of(other)),
                object: Some(Box::new(other.clone())),
                ..entry(key, path, EntryKind::Scalar)
            },
        };
        out.push(entry);
    }
    Ok(out)
}

pub(super) fn entry(key: String, path: Vec<PathSeg>, kind: EntryKind) -> IndexEntry {
    IndexEntry {
        key,
        raw_key: None,
        path,
        kind,
        dtype: None,
        shape: None,
        chunks: Vec::new(),
        fsdp: None,
        role: None,
        flat_param: false,
        value: None,
        position: None,
        object: None,
    }
}
