//! DeepSpeed universal checkpoints: what DeepSpeed's `deepspeed/checkpoint/ds_to_universal.py`
//! writes from a ZeRO checkpoint. One folder (`<tag>_universal/`, which `latest_universal` beside
//! it names) holds the model states files it copied and `zero/`:
//!
//! - `zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` (and `step.pt` from ZeRO-1/2): each
//!   parameter's whole tensor, as a dict `{"param": tensor, "cat_dim": 0}` (from ZeRO-1/2, in the
//!   parameter's shape) or the tensor itself (from ZeRO-3, flat);
//! - `zero/optimizer_state.pt`: the stage, `partition_count`, `param_groups` (ZeRO-3's also rank
//!   0's `optimizer_state_dict`, which holds the `step` it writes no file for).
//!
//! The model is the state dict `zero_to_fp32` gives for the checkpoint converted (its names, order
//! and ties, as [`super`] reads them from the model states): the buffers and frozen parameters from
//! the model states files, as there; each trainable parameter of `param_shapes` from its
//! `zero/<name>/fp32.pt`. The copies `ds_to_universal` also writes under `zero/` for the other
//! names of `module` (buffers cast to float32, tied names and frozen parameters in the training
//! precision) are not read, and a note names them. The optimizer is per parameter name, as for
//! ZeRO folders (`optimizer.state.<name>.{step,exp_avg,exp_avg_sq}`,
//! `optimizer.param_groups.<g>.<key>`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use crate::formats::pickle::{PyValue, dict_get};
use crate::index::read::items::FolderRead;
use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, EntryKind, FileInfo, Format, IndexEntry,
    IndexError, PathSeg, RankGroup, Role, json_of,
};
use crate::source::Source;

use super::files::{self, DsFile, check_ranks};
use super::optimizer::{self, OPTIMIZER};
use super::records::{self, BaseOptim, ModelStates, Reader, StateValue, Stored, bad, open_archive};
use super::{StateDict, Tensor};

/// The file beside the universal folders naming the last one written.
pub const LATEST_UNIVERSAL: &str = "latest_universal";

/// The common optimizer state, in the tag folder.
const COMMON: &str = "zero/optimizer_state.pt";

/// The per-parameter optimizer states, in torch's order for Adam.
const STATES: [&str; 3] = ["step", "exp_avg", "exp_avg_sq"];

/// The tag folders (`""`: the top level, or `"<tag>/"`) holding `zero/optimizer_state.pt`.
fn folders(names: &[String]) -> BTreeSet<&str> {
    names
        .iter()
        .filter_map(|n| n.strip_suffix(COMMON))
        .filter(|dir| {
            dir.is_empty()
                || dir
                    .strip_suffix('/')
                    .is_some_and(|d| !d.is_empty() && !d.contains('/'))
        })
        .collect()
}

/// True when `names` hold a universal checkpoint: at the top level, or one folder down with no
/// `latest` beside it (a run folder holding both reads the ZeRO save `latest` names).
pub fn looks_like_universal(names: &[String]) -> bool {
    let found = folders(names);
    found.contains("") || (!found.is_empty() && !names.iter().any(|n| n == files::LATEST))
}

/// The tag folder's prefix and how it was chosen.
fn locate(source: &dyn Source, names: &[String]) -> Result<(String, Option<String>), IndexError> {
    let found = folders(names);
    if found.contains("") {
        return Ok((String::new(), None));
    }
    if names.iter().any(|n| n == LATEST_UNIVERSAL) {
        let tag = files::read_latest(source, LATEST_UNIVERSAL)?;
        let prefix = format!("{tag}/");
        if !found.contains(prefix.as_str()) {
            let list: Vec<&str> = found.iter().copied().collect();
            return Err(bad(
                LATEST_UNIVERSAL,
                format!(
                    "names the tag `{tag}`, but no folder `{tag}/` holds `{COMMON}` (folders that do: {})",
                    list.join(", ")
                ),
            ));
        }
        return Ok((
            prefix,
            Some(format!("the tag `{tag}` that `{LATEST_UNIVERSAL}` names")),
        ));
    }
    match found.iter().copied().collect::<Vec<_>>().as_slice() {
        [one] => Ok((
            (*one).to_owned(),
            Some(format!("its one universal folder `{one}`")),
        )),
        several => Err(IndexError::SeveralCheckpoints {
            groups: several.iter().map(|d| (*d).to_owned()).collect(),
        }),
    }
}

/// What `zero/optimizer_state.pt` says.
struct Common {
    stage: u8,
    partition_count: u64,
    param_groups: Vec<Vec<(String, PyValue)>>,
    /// ZeRO-3's: rank 0's wrapped optimizer state (the `step` of each group).
    base: Option<BaseOptim>,
}

fn common(r: &Reader<'_>) -> Result<Common, IndexError> {
    let root = r.root("the common optimizer state ds_to_universal writes")?;
    let stage = dict_get(root, "zero_stage").ok_or_else(|| {
        bad(
            &r.file,
            "no `zero_stage`: not the common optimizer state ds_to_universal writes".into(),
        )
    })?;
    let stage = records::stage_of(stage)
        .filter(|s| (1..=3).contains(s))
        .ok_or_else(|| {
            r.err(
                "zero_stage",
                &format!("{} is not ZeRO stage 1, 2 or 3", json_of(stage)),
            )
        })?;
    let partition_count = records::partition_count(r, root, "partition_count")?;
    let groups =
        dict_get(root, "param_groups").ok_or_else(|| bad(&r.file, "no `param_groups`".into()))?;
    let param_groups = records::param_groups(r, groups, "param_groups")?;
    let base = if stage == 3 {
        records::base_optim(r, root, "optimizer_state_dict", "optimizer_state_dict")?
    } else {
        None
    };
    Ok(Common {
        stage,
        partition_count,
        param_groups,
        base,
    })
}

/// The model states files of the folder: ZeRO-1/2's one `mp_rank_00_model_states.pt`, or ZeRO-3's
/// per rank (checked to be `0..partition_count`), in rank order.
fn model_files(
    prefix: &str,
    names: &[String],
    common: &Common,
) -> Result<Vec<(u32, String)>, IndexError> {
    let mut zero12 = Vec::new();
    let mut zero3 = Vec::new();
    for n in names {
        let Some(base) = n.strip_prefix(prefix).filter(|b| !b.contains('/')) else {
            continue;
        };
        match files::parse_name(base) {
            Some(DsFile::Model { mp: 0 }) => zero12.push((0, n.clone())),
            Some(DsFile::Zero3Model { dp, mp: 0 }) => zero3.push((dp, n.clone())),
            _ => {}
        }
    }
    zero3.sort();
    let stage = common.stage;
    let file = format!("{prefix}{COMMON}");
    if stage <= 2 {
        if zero12.is_empty() || !zero3.is_empty() {
            return Err(bad(
                &file,
                format!(
                    "ZeRO-{stage}'s universal folder holds the copied `mp_rank_00_model_states.pt` (the parameter names and shapes) and no per-rank model files; found {} and {} per-rank model files",
                    if zero12.is_empty() { "none" } else { "one" },
                    zero3.len()
                ),
            ));
        }
        return Ok(zero12);
    }
    if zero3.is_empty() || !zero12.is_empty() {
        return Err(bad(
            &file,
            format!(
                "ZeRO-3's universal folder holds the copied `zero_pp_rank_R_mp_rank_00_model_states.pt` files; found {} of them{}",
                zero3.len(),
                if zero12.is_empty() {
                    ""
                } else {
                    " and a ZeRO-1/2 `mp_rank_00_model_states.pt`"
                }
            ),
        ));
    }
    check_ranks(
        &zero3,
        common.partition_count,
        &format!("{prefix}zero_pp_rank_{{r}}_mp_rank_00_model_states.pt"),
        &format!("`partition_count` of {file} says"),
    )?;
    Ok(zero3)
}

/// Reads what the universal folder `names` hold ([`looks_like_universal`]).
pub fn index_universal(source: &dyn Source, names: &[String]) -> Result<FolderRead, IndexError> {
    let (prefix, chosen) = locate(source, names)?;
    let mut file_infos = BTreeMap::new();
    let mut read: HashSet<String> = HashSet::new();
    let common_file = format!("{prefix}{COMMON}");
    let archive = open_archive(source, &common_file)?;
    let common = common(&Reader {
        file: Arc::from(common_file.as_str()),
        rank: None,
        archive: &archive,
    })?;
    add_file(source, &common_file, None, &mut file_infos, &mut read)?;
    let stage = common.stage;
    let files = model_files(&prefix, names, &common)?;
    let (model, extra) = super::model_states_files(source, &files, stage == 3, &mut file_infos)?;
    read.extend(files.iter().map(|(_, n)| n.clone()));
    let zero = &model[0];
    let mut notes = Vec::new();
    let mut sd = StateDict::default();
    super::buffers(zero, &mut sd, &mut notes);
    super::frozen(stage, &model, &mut sd)?;
    super::frozen_from_module(stage, zero, &mut sd, &mut notes);
    let params = trainable_names(zero)?;
    let have: HashSet<&str> = names.iter().map(String::as_str).collect();
    let mut param_files = ParamFiles {
        source,
        prefix: &prefix,
        have: &have,
        file_infos: &mut file_infos,
        read: &mut read,
    };
    let mut optim = Vec::new();
    for (g, name, shape) in &params {
        let fp32 = param_files
            .tensor(name, "fp32", shape)?
            .ok_or_else(|| {
                bad(
                    &format!("{prefix}zero/{name}/fp32.pt"),
                    format!(
                        "missing: ds_to_universal writes it for `{name}`, a trainable parameter of `param_shapes` in {}",
                        zero.file
                    ),
                )
            })?;
        sd.insert(name, fp32);
        param_state(&mut param_files, &common, *g, name, shape, &mut optim)?;
    }
    super::ties(zero, &mut sd);
    super::left_out(zero, &sd, &mut notes);
    let has_optimizer_state = !optim.is_empty();
    if has_optimizer_state {
        let base = BaseOptim {
            state: Vec::new(),
            param_groups: common.param_groups.clone(),
        };
        optimizer::param_groups(zero, &base, &mut optim);
    }
    let entries = super::all_entries(sd, optim.into_iter().chain(extra), &zero.file)?;
    let mut not_read: Vec<String> = names
        .iter()
        .filter(|n| !read.contains(n.as_str()) && n.as_str() != LATEST_UNIVERSAL)
        .cloned()
        .collect();
    not_read.sort();
    let folder = files::Folder {
        prefix: prefix.clone(),
        files: BTreeMap::new(),
        not_read,
        chosen,
    };
    let mut all_notes = super::folder_notes(&folder);
    all_notes.push(format!(
        "DeepSpeed universal checkpoint (ds_to_universal of a ZeRO-{stage} save): trainable parameters and their optimizer state from `zero/<name>/`; buffers, frozen parameters and tied names from the model states, as zero_to_fp32 gives them (ds_to_universal's copies of them under `zero/` are `module` cast to float32)"
    ));
    all_notes.extend(notes);
    let sets = vec![(
        RankGroup {
            pattern: if stage == 3 {
                format!("{prefix}zero_pp_rank_{{R}}_mp_rank_00_model_states.pt")
            } else {
                files[0].1.clone()
            },
            files: files
                .iter()
                .map(|(r, n)| (n.clone(), (stage == 3).then_some(*r)))
                .collect(),
        },
        "model",
    )];
    let index = CheckpointIndex {
        format: Format::TorchSave,
        kind: CheckpointKind::DeepSpeedUniversal { stage },
        has_optimizer_state,
        entries,
        files: file_infos,
        dcp: None,
    };
    Ok((index, sets, all_notes))
}

/// `param_shapes`' names in order with their group and shape; a name in two groups is an error.
fn trainable_names(zero: &ModelStates) -> Result<Vec<(usize, String, Vec<u64>)>, IndexError> {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut out = Vec::new();
    for (g, shapes) in zero.param_shapes.iter().enumerate() {
        for (name, shape) in shapes {
            if !seen.insert(name.as_str()) {
                return Err(bad(
                    &zero.file,
                    format!("`param_shapes` lists `{name}` in two groups"),
                ));
            }
            out.push((g, name.clone(), shape.clone()));
        }
    }
    Ok(out)
}

fn add_file(
    source: &dyn Source,
    name: &str,
    rank: Option<u32>,
    file_infos: &mut BTreeMap<String, FileInfo>,
    read: &mut HashSet<String>,
) -> Result<(), IndexError> {
    file_infos.insert(
        name.to_owned(),
        FileInfo {
            size: source.size(name)?,
            rank,
            unreferenced_bytes: 0,
        },
    );
    read.insert(name.to_owned());
    Ok(())
}

/// What a per-parameter file holds.
enum Held {
    Tensor(Stored),
    Value(PyValue),
}

/// Reads the per-parameter files of `zero/`, recording each file read.
struct ParamFiles<'a> {
    source: &'a dyn Source,
    prefix: &'a str,
    have: &'a HashSet<&'a str>,
    file_infos: &'a mut BTreeMap<String, FileInfo>,
    read: &'a mut HashSet<String>,
}

impl ParamFiles<'_> {
    /// `zero/<name>/<state>.pt`'s value (`param` of a dict), `None` when there is no such file.
    fn held(&mut self, name: &str, state: &str) -> Result<Option<(Arc<str>, Held)>, IndexError> {
        let file = format!("{}zero/{name}/{state}.pt", self.prefix);
        if !self.have.contains(file.as_str()) {
            return Ok(None);
        }
        let archive = open_archive(self.source, &file)?;
        let r = Reader {
            file: Arc::from(file.as_str()),
            rank: None,
            archive: &archive,
        };
        let (value, key) = match &archive.root {
            PyValue::Dict(items) => (
                dict_get(items, "param").ok_or_else(|| {
                    bad(
                        &file,
                        "a dict without `param`, where ds_to_universal writes the tensor".into(),
                    )
                })?,
                "param",
            ),
            other => (other, "the value"),
        };
        let held = match value {
            PyValue::Tensor(_) => Held::Tensor(r.tensor(value, key)?),
            other => Held::Value(other.clone()),
        };
        add_file(self.source, &file, None, self.file_infos, self.read)?;
        Ok(Some((r.file, held)))
    }

    /// `zero/<name>/<state>.pt` as the parameter's tensor of shape `shape`.
    fn tensor(
        &mut self,
        name: &str,
        state: &str,
        shape: &[u64],
    ) -> Result<Option<Tensor>, IndexError> {
        let Some((file, held)) = self.held(name, state)? else {
            return Ok(None);
        };
        let Held::Tensor(t) = held else {
            return Err(bad(&file, "not a tensor".into()));
        };
        shaped(&t, name, shape).map(Some)
    }
}

/// The stored tensor `t` (contiguous, of the same number of elements) seen in the shape
/// `param_shapes` gives `name` (ZeRO-3's files hold it flat).
fn shaped(t: &Stored, name: &str, shape: &[u64]) -> Result<Tensor, IndexError> {
    let v = &t.tensor;
    let want = crate::shape::numel(shape);
    let have = v.numel();
    if want.is_none() || have != want {
        return Err(bad(
            &t.file,
            format!(
                "a tensor of shape {:?}, where `param_shapes` gives `{name}` the shape {shape:?}",
                v.shape
            ),
        ));
    }
    if !v.is_contiguous() {
        return Err(bad(
            &t.file,
            format!(
                "a tensor of shape {:?} and strides {:?}, where ds_to_universal writes a contiguous one",
                v.shape, v.stride
            ),
        ));
    }
    let strides = crate::shape::checked_contiguous_strides(shape)
        .ok_or_else(|| bad(&t.file, format!("the shape {shape:?} overflows")))?;
    Ok(Tensor {
        dtype: t.dtype(),
        shape: shape.to_vec(),
        chunks: vec![Chunk {
            offsets: vec![0; shape.len()].into(),
            sizes: shape.to_vec().into(),
            file: t.file.clone(),
            byte_offset: t.range.offset,
            byte_length: t.range.len,
            rank: None,
            encoding: ChunkEncoding::Raw {
                storage_offset: v.storage_offset,
                strides,
            },
        }],
    })
}

/// `optimizer.state.<name>.<state>` of the parameter `name` of group `g`: the moments from its
/// files, `step` from `step.pt` or (ZeRO-3) the group's in the common file. No moments: no state
/// (torch leaves a parameter without state out).
fn param_state(
    files: &mut ParamFiles<'_>,
    common: &Common,
    g: usize,
    name: &str,
    shape: &[u64],
    out: &mut Vec<IndexEntry>,
) -> Result<(), IndexError> {
    let mut entries = Vec::new();
    for state in STATES {
        let path = vec![
            PathSeg::Key(OPTIMIZER.to_owned()),
            PathSeg::Key("state".to_owned()),
            PathSeg::Key(name.to_owned()),
            PathSeg::Key(state.to_owned()),
        ];
        let role = Role::OptimizerState {
            param: PathSeg::Key(name.to_owned()),
            state: state.to_owned(),
        };
        let entry = if state == "step" {
            let held = match files.held(name, state)? {
                Some((_, held)) => Some(held),
                None => group_step(common, g),
            };
            match held {
                Some(Held::Tensor(t)) => optimizer::tensor_entry(
                    path,
                    role,
                    t.dtype(),
                    t.tensor.shape.clone(),
                    vec![t.chunk()],
                ),
                Some(Held::Value(v)) => IndexEntry {
                    value: Some(json_of(&v)),
                    object: Some(Box::new(v)),
                    role: Some(role),
                    ..super::entry(
                        crate::index::read::torch::join_path(&path),
                        path,
                        EntryKind::Scalar,
                    )
                },
                None => continue,
            }
        } else {
            let Some(t) = files.tensor(name, state, shape)? else {
                continue;
            };
            optimizer::tensor_entry(path, role, t.dtype, t.shape, t.chunks)
        };
        entries.push((state, entry));
    }
    if entries.iter().any(|(s, _)| *s != "step") {
        out.extend(entries.into_iter().map(|(_, e)| e));
    }
    Ok(())
}

/// The `step` of group `g` in ZeRO-3's common file (`optimizer_state_dict.state[id]`, `id` the
/// group's one parameter).
fn group_step(common: &Common, g: usize) -> Option<Held> {
    let base = common.base.as_ref()?;
    let id = optimizer::group_id(base, g)?;
    let (_, value) = optimizer::state_of(base, id)?
        .iter()
        .find(|(n, _)| n == "step")?;
    Some(match value {
        StateValue::Whole(t) => Held::Tensor(t.clone()),
        StateValue::Value(v) => Held::Value(v.clone()),
        // A 1-D step is not torch's: left out.
        StateValue::Flat(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn universal_folders_are_found_where_ds_to_universal_writes_them() {
        assert!(looks_like_universal(&names(&[
            "mp_rank_00_model_states.pt",
            "zero/optimizer_state.pt"
        ])));
        assert!(looks_like_universal(&names(&[
            "latest_universal",
            "global_step2_universal/zero/optimizer_state.pt"
        ])));
        // Beside `latest`, the ZeRO save it names is read.
        assert!(!looks_like_universal(&names(&[
            "latest",
            "global_step2/mp_rank_00_model_states.pt",
            "global_step2_universal/zero/optimizer_state.pt"
        ])));
        // Deeper, or a name that only ends like it: not one.
        assert!(!looks_like_universal(&names(&[
            "a/b/zero/optimizer_state.pt"
        ])));
        assert!(!looks_like_universal(&names(&["xzero/optimizer_state.pt"])));
    }
}
