//! The records of DeepSpeed's files that `zero_to_fp32` reads, from their pickles (no tensor bytes
//! are read): the model states (`buffer_names`, `module`, `param_shapes`, `frozen_param_shapes`,
//! `frozen_param_fragments`, `shared_params`, `ds_config`) and each rank's optimizer
//! states (`optimizer_state_dict`: `zero_stage`, `partition_count`, the fp32 flat groups,
//! `param_alignment_paddings`). Every record is checked for the type `zero_to_fp32` uses; errors
//! name the file and the key.

use std::sync::Arc;

use crate::dtype::DType;
use crate::formats::pickle::{PyValue, TensorRef, dict_get};
use crate::formats::torch_zip::{self, MemberRange, TorchArchive};
use crate::index::{Chunk, ChunkEncoding, IndexError, ZeroPrecision};
use crate::source::Source;

/// A tensor as a `torch.save` file stores it: the view and its storage's byte range.
#[derive(Debug, Clone)]
pub(super) struct Stored {
    pub file: Arc<str>,
    pub rank: Option<u32>,
    pub range: MemberRange,
    pub tensor: TensorRef,
}

impl Stored {
    pub fn dtype(&self) -> DType {
        self.tensor.storage.dtype
    }

    /// The whole tensor as one chunk.
    pub fn chunk(&self) -> Chunk {
        Chunk {
            offsets: vec![0; self.tensor.shape.len()].into(),
            sizes: self.tensor.shape.clone().into(),
            file: self.file.clone(),
            byte_offset: self.range.offset,
            byte_length: self.range.len,
            rank: self.rank,
            encoding: ChunkEncoding::Raw {
                storage_offset: self.tensor.storage_offset,
                strides: self.tensor.stride.clone(),
            },
        }
    }

    /// The tensor as a flat run of elements (a 1-D contiguous tensor, as DeepSpeed's flat groups
    /// and ZeRO-3 fragments are); `what` names it in the error.
    pub fn flat(&self, what: &str) -> Result<Flat, IndexError> {
        let t = &self.tensor;
        let numel = t
            .numel()
            .ok_or_else(|| bad(&self.file, format!("{what}: size overflows")))?;
        let contiguous = t.shape.len() == 1 && (t.stride == [1] || numel <= 1);
        if !contiguous {
            return Err(bad(
                &self.file,
                format!(
                    "{what}: a tensor of shape {:?} and strides {:?}, where DeepSpeed writes a flat (1-D, contiguous) one",
                    t.shape, t.stride
                ),
            ));
        }
        Ok(Flat {
            file: self.file.clone(),
            rank: self.rank,
            range: self.range,
            storage_offset: t.storage_offset,
            numel,
            dtype: t.storage.dtype,
        })
    }
}

/// A 1-D contiguous tensor of a file: element `i` is storage element `storage_offset + i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Flat {
    pub file: Arc<str>,
    pub rank: Option<u32>,
    pub range: MemberRange,
    pub storage_offset: u64,
    pub numel: u64,
    pub dtype: DType,
}

pub(super) fn bad(file: &str, what: String) -> IndexError {
    IndexError::Inconsistent {
        file: file.to_owned(),
        what,
    }
}

/// Opens the `torch.save` archive `file` (its directory and pickle only).
pub(super) fn open_archive(source: &dyn Source, file: &str) -> Result<TorchArchive, IndexError> {
    torch_zip::read_archive_from(source, file).map_err(|e| match e {
        torch_zip::ArchiveFileError::Source(e) => IndexError::from(e),
        torch_zip::ArchiveFileError::Archive(source) => IndexError::TorchZip {
            file: file.to_owned(),
            source,
        },
    })
}

/// Reads typed values out of one file's pickle, naming the file and key in errors.
pub(super) struct Reader<'a> {
    pub file: Arc<str>,
    pub rank: Option<u32>,
    pub archive: &'a TorchArchive,
}

impl<'a> Reader<'a> {
    pub fn err(&self, key: &str, what: &str) -> IndexError {
        bad(&self.file, format!("`{key}`: {what}"))
    }

    /// The top-level dict.
    pub fn root(&self, what: &str) -> Result<&'a [(PyValue, PyValue)], IndexError> {
        match &self.archive.root {
            PyValue::Dict(items) => Ok(items),
            other => Err(bad(
                &self.file,
                format!("holds a {}, not {what}", other.type_name()),
            )),
        }
    }

    pub fn dict(&self, v: &'a PyValue, key: &str) -> Result<&'a [(PyValue, PyValue)], IndexError> {
        match v {
            PyValue::Dict(items) => Ok(items),
            other => Err(self.err(key, &format!("a {}, not a dict", other.type_name()))),
        }
    }

    pub fn seq(&self, v: &'a PyValue, key: &str) -> Result<&'a [PyValue], IndexError> {
        v.as_seq()
            .ok_or_else(|| self.err(key, &format!("a {}, not a list", v.type_name())))
    }

    pub fn str(&self, v: &'a PyValue, key: &str) -> Result<&'a str, IndexError> {
        v.as_str()
            .ok_or_else(|| self.err(key, &format!("a {}, not a str", v.type_name())))
    }

    pub fn count(&self, v: &PyValue, key: &str) -> Result<u64, IndexError> {
        v.as_i64()
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| self.err(key, &format!("a {}, not a non-negative int", v.type_name())))
    }

    pub fn dims(&self, v: &PyValue, key: &str) -> Result<Vec<u64>, IndexError> {
        let dims = v
            .as_dims()
            .ok_or_else(|| self.err(key, &format!("a {}, not a torch.Size", v.type_name())))?;
        if crate::shape::numel(&dims).is_none() {
            return Err(self.err(key, &format!("the shape {dims:?} overflows")));
        }
        Ok(dims)
    }

    pub fn tensor(&self, v: &PyValue, key: &str) -> Result<Stored, IndexError> {
        let PyValue::Tensor(t) = v else {
            return Err(self.err(key, &format!("a {}, not a tensor", v.type_name())));
        };
        let range = self
            .archive
            .storage_range(t)
            .map_err(|source| IndexError::TorchZip {
                file: self.file.to_string(),
                source,
            })?;
        Ok(Stored {
            file: self.file.clone(),
            rank: self.rank,
            range,
            tensor: (**t).clone(),
        })
    }

    /// A dict of `str` keys to values, as `(key, value)` pairs in order; `key` names the dict.
    pub fn named(
        &self,
        v: &'a PyValue,
        key: &str,
    ) -> Result<Vec<(&'a str, &'a PyValue)>, IndexError> {
        self.dict(v, key)?
            .iter()
            .map(|(k, x)| {
                k.as_str().map(|k| (k, x)).ok_or_else(|| {
                    self.err(key, &format!("a key of type {}, not str", k.type_name()))
                })
            })
            .collect()
    }

    /// `name -> torch.Size` records (`param_shapes[i]`, `frozen_param_shapes`).
    pub fn shapes(&self, v: &'a PyValue, key: &str) -> Result<Vec<(String, Vec<u64>)>, IndexError> {
        self.named(v, key)?
            .into_iter()
            .map(|(name, s)| Ok((name.to_owned(), self.dims(s, &format!("{key}.{name}"))?)))
            .collect()
    }
}

/// What `zero_to_fp32` reads of a model states file.
#[derive(Debug, Clone)]
pub(super) struct ModelStates {
    pub file: Arc<str>,
    pub buffer_names: Vec<String>,
    /// The tensors of `module`, in order (the buffers are taken from here).
    pub module: Vec<(String, Stored)>,
    pub param_shapes: Vec<Vec<(String, Vec<u64>)>>,
    pub frozen_param_shapes: Option<Vec<(String, Vec<u64>)>>,
    pub frozen_param_fragments: Option<Vec<(String, Stored)>>,
    /// `shared_params`: `(alias, name)` pairs in order.
    pub shared_params: Vec<(String, String)>,
    /// From `ds_config` (`bf16`/`bfloat16`, `fp16` enabled).
    pub precision: Option<ZeroPrecision>,
}

/// Keys of a model states file that are DeepSpeed's own records of the model (everything else —
/// counters, `ds_config`, `lr_scheduler`, client state — is training state).
pub(super) const MODEL_RECORD_KEYS: &[&str] = &[
    "module",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "optimizer",
];

fn enabled(config: &[(PyValue, PyValue)], key: &str) -> bool {
    matches!(dict_get(config, key), Some(PyValue::Dict(section))
        if matches!(dict_get(section, "enabled"), Some(PyValue::Bool(true))))
}

/// Reads the model states records of `r`'s file.
pub(super) fn model_states(r: &Reader<'_>) -> Result<ModelStates, IndexError> {
    let root = r.root("DeepSpeed's model states dict")?;
    let get = |key: &str| dict_get(root, key);
    let Some(names) = get("buffer_names") else {
        return Err(bad(
            &r.file,
            "no `buffer_names`: not a DeepSpeed model states file (zero_to_fp32 refuses it too)"
                .into(),
        ));
    };
    let buffer_names = r
        .seq(names, "buffer_names")?
        .iter()
        .map(|n| r.str(n, "buffer_names").map(str::to_owned))
        .collect::<Result<Vec<_>, _>>()?;
    let mut module = Vec::new();
    if let Some(m) = get("module").filter(|m| !matches!(m, PyValue::None)) {
        for (name, v) in r.named(m, "module")? {
            if matches!(v, PyValue::Tensor(_)) {
                module.push((name.to_owned(), r.tensor(v, &format!("module.{name}"))?));
            }
        }
    }
    let shapes = get("param_shapes")
        .ok_or_else(|| bad(&r.file, "no `param_shapes`: zero_to_fp32 needs them".into()))?;
    let param_shapes = match shapes {
        // Old DeepSpeed wrote one dict for all groups.
        PyValue::Dict(_) => vec![r.shapes(shapes, "param_shapes")?],
        _ => r
            .seq(shapes, "param_shapes")?
            .iter()
            .enumerate()
            .map(|(i, g)| r.shapes(g, &format!("param_shapes.{i}")))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let frozen_param_shapes = match get("frozen_param_shapes") {
        None | Some(PyValue::None) => None,
        Some(v) => Some(r.shapes(v, "frozen_param_shapes")?),
    };
    let frozen_param_fragments = match get("frozen_param_fragments") {
        None | Some(PyValue::None) => None,
        Some(v) => Some(
            r.named(v, "frozen_param_fragments")?
                .into_iter()
                .map(|(name, t)| {
                    Ok((
                        name.to_owned(),
                        r.tensor(t, &format!("frozen_param_fragments.{name}"))?,
                    ))
                })
                .collect::<Result<Vec<_>, IndexError>>()?,
        ),
    };
    let shared_params = match get("shared_params") {
        None | Some(PyValue::None) => Vec::new(),
        Some(v) => r
            .named(v, "shared_params")?
            .into_iter()
            .map(|(alias, name)| {
                Ok((
                    alias.to_owned(),
                    r.str(name, &format!("shared_params.{alias}"))?.to_owned(),
                ))
            })
            .collect::<Result<Vec<_>, IndexError>>()?,
    };
    let precision = match get("ds_config") {
        Some(PyValue::Dict(config)) => {
            Some(if enabled(config, "bf16") || enabled(config, "bfloat16") {
                ZeroPrecision::Bf16
            } else if enabled(config, "fp16") {
                ZeroPrecision::Fp16
            } else {
                ZeroPrecision::Fp32
            })
        }
        _ => None,
    };
    Ok(ModelStates {
        file: r.file.clone(),
        buffer_names,
        module,
        param_shapes,
        frozen_param_shapes,
        frozen_param_fragments,
        shared_params,
        precision,
    })
}

/// What `zero_to_fp32` reads of one rank's optimizer states file.
#[derive(Debug, Clone)]
pub(super) struct OptimStates {
    pub file: Arc<str>,
    pub stage: u8,
    /// `partition_count` (its largest value when it is a list, as `zero_to_fp32` takes it).
    pub partition_count: u64,
    /// The fp32 flat groups: `single_partition_of_fp32_groups` (ZeRO-1/2), `fp32_flat_groups`
    /// (ZeRO-3).
    pub groups: Vec<Flat>,
    /// `param_alignment_paddings` (ZeRO-1/2, newer DeepSpeed): per group, per parameter.
    pub alignment_paddings: Option<Vec<Vec<u64>>>,
    /// `group_paddings` (ZeRO-1/2): per group, the elements of the group's padding to
    /// `2 * world_size` that lay in this rank's partition. DeepSpeed cuts them off the fp32
    /// partition on save, not off the moments of the wrapped optimizer (saved as they are unless
    /// the checkpoint is elastic), which are then this much longer.
    pub group_paddings: Option<Vec<u64>>,
    /// The wrapped torch optimizer's `state_dict()` over the flat partitions, when the file holds
    /// one in that shape.
    pub base: Option<BaseOptim>,
}

/// A torch optimizer's `state_dict()` over DeepSpeed's flat partitions: one parameter (id `g`) per
/// group `g`.
#[derive(Debug, Clone)]
pub(super) struct BaseOptim {
    /// `state[g]`: name -> value, in order.
    pub state: Vec<(i64, Vec<(String, StateValue)>)>,
    /// `param_groups[g]`: key -> value, in order (`params` included, as stored).
    pub param_groups: Vec<Vec<(String, PyValue)>>,
}

/// One value of an optimizer state.
#[derive(Debug, Clone)]
pub(super) enum StateValue {
    /// A 1-D tensor laid out like the group's flat partition (`exp_avg`, `exp_avg_sq`).
    Flat(Flat),
    /// Any other tensor (a 0-d `step`): the same for every parameter of the group.
    Whole(Stored),
    /// A value that is not a tensor.
    Value(PyValue),
}

/// The wrapped optimizer's state dict at `key` of `osd` (`base_optimizer_state` for ZeRO-1/2,
/// `optimizer_state_dict` for ZeRO-3), when it is a torch state dict (`{"state", "param_groups"}`;
/// DeepSpeed's elastic layout, a list per group, is not read).
pub(super) fn base_optim(
    r: &Reader<'_>,
    osd: &[(PyValue, PyValue)],
    key: &str,
    at: &str,
) -> Result<Option<BaseOptim>, IndexError> {
    let Some(PyValue::Dict(items)) = dict_get(osd, key) else {
        return Ok(None);
    };
    let (Some(state), Some(groups)) = (dict_get(items, "state"), dict_get(items, "param_groups"))
    else {
        return Ok(None);
    };
    let mut out_state = Vec::new();
    for (id, values) in r.dict(state, &format!("{at}.state"))? {
        let id = id.as_i64().ok_or_else(|| {
            r.err(
                &format!("{at}.state"),
                &format!("a key of type {}, not an int", id.type_name()),
            )
        })?;
        let mut named = Vec::new();
        for (name, v) in r.named(values, &format!("{at}.state.{id}"))? {
            let k = format!("{at}.state.{id}.{name}");
            let value = match v {
                PyValue::Tensor(t) if t.shape.len() == 1 => {
                    StateValue::Flat(r.tensor(v, &k)?.flat(&k)?)
                }
                PyValue::Tensor(_) => StateValue::Whole(r.tensor(v, &k)?),
                other => StateValue::Value(other.clone()),
            };
            named.push((name.to_owned(), value));
        }
        out_state.push((id, named));
    }
    Ok(Some(BaseOptim {
        state: out_state,
        param_groups: param_groups(r, groups, &format!("{at}.param_groups"))?,
    }))
}

/// A torch optimizer's `param_groups` (`key` names it): each group's keys and values, in order.
pub(super) fn param_groups(
    r: &Reader<'_>,
    groups: &PyValue,
    key: &str,
) -> Result<Vec<Vec<(String, PyValue)>>, IndexError> {
    r.seq(groups, key)?
        .iter()
        .enumerate()
        .map(|(g, group)| {
            Ok(r.named(group, &format!("{key}.{g}"))?
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.clone()))
                .collect())
        })
        .collect()
}

/// The ZeRO stage of a `zero_stage` record: an int, or DeepSpeed's `ZeroStageEnum(n)`.
pub(super) fn stage_of(v: &PyValue) -> Option<u8> {
    let n = match v {
        PyValue::Object(o) if o.class().is_some_and(|g| g.name == "ZeroStageEnum") => {
            o.args.first()?.as_i64()?
        }
        other => other.as_i64()?,
    };
    u8::try_from(n).ok()
}

/// `partition_count` of the dict `d` (`key` names it): an int, or per group (its largest value, as
/// `zero_to_fp32` takes it); never 0.
pub(super) fn partition_count(
    r: &Reader<'_>,
    d: &[(PyValue, PyValue)],
    key: &str,
) -> Result<u64, IndexError> {
    let count =
        dict_get(d, "partition_count").ok_or_else(|| bad(&r.file, format!("no `{key}`")))?;
    let partition_count = match count {
        PyValue::List(items) | PyValue::Tuple(items) => {
            let mut most = None;
            for c in items {
                let c = r.count(c, key)?;
                most = Some(most.map_or(c, |m: u64| m.max(c)));
            }
            most.ok_or_else(|| r.err(key, "an empty list"))?
        }
        other => r.count(other, key)?,
    };
    if partition_count == 0 {
        return Err(r.err(key, "0 partitions"));
    }
    Ok(partition_count)
}

/// Reads the optimizer records of `r`'s file.
pub(super) fn optim_states(r: &Reader<'_>) -> Result<OptimStates, IndexError> {
    const OSD: &str = "optimizer_state_dict";
    let root = r.root("DeepSpeed's optimizer states dict")?;
    let osd = dict_get(root, OSD).ok_or_else(|| {
        bad(
            &r.file,
            format!("no `{OSD}`: not a DeepSpeed optimizer states file"),
        )
    })?;
    let osd = r.dict(osd, OSD)?;
    let get = |key: &str| dict_get(osd, key);
    let stage = get("zero_stage").ok_or_else(|| {
        bad(
            &r.file,
            format!("no `{OSD}.zero_stage`: not a ZeRO checkpoint (DeepSpeed's BF16_Optimizer writes such files; zero_to_fp32 refuses them too)"),
        )
    })?;
    let stage = stage_of(stage)
        .filter(|s| (1..=3).contains(s))
        .ok_or_else(|| {
            r.err(
                &format!("{OSD}.zero_stage"),
                &format!(
                    "{} is not ZeRO stage 1, 2 or 3",
                    crate::index::json_of(stage)
                ),
            )
        })?;
    let partition_count = partition_count(r, osd, &format!("{OSD}.partition_count"))?;
    let groups_key = if stage <= 2 {
        "single_partition_of_fp32_groups"
    } else {
        "fp32_flat_groups"
    };
    let full_key = format!("{OSD}.{groups_key}");
    let groups = get(groups_key).ok_or_else(|| {
        bad(
            &r.file,
            format!("no `{full_key}`: the fp32 partitions of a ZeRO-{stage} checkpoint are there"),
        )
    })?;
    let groups = r
        .seq(groups, &full_key)?
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let key = format!("{full_key}.{i}");
            r.tensor(g, &key)?.flat(&key)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let paddings_key = format!("{OSD}.param_alignment_paddings");
    let alignment_paddings = match get("param_alignment_paddings") {
        None | Some(PyValue::None) => None,
        Some(v) => Some(
            r.seq(v, &paddings_key)?
                .iter()
                .map(|g| {
                    r.seq(g, &paddings_key)?
                        .iter()
                        .map(|p| r.count(p, &paddings_key))
                        .collect::<Result<Vec<_>, _>>()
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let group_paddings_key = format!("{OSD}.group_paddings");
    let group_paddings = match get("group_paddings") {
        Some(v) if stage <= 2 && !matches!(v, PyValue::None) => Some(
            r.seq(v, &group_paddings_key)?
                .iter()
                .map(|p| r.count(p, &group_paddings_key))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        _ => None,
    };
    let base = base_optim(
        r,
        osd,
        if stage <= 2 {
            "base_optimizer_state"
        } else {
            "optimizer_state_dict"
        },
        if stage <= 2 {
            "optimizer_state_dict.base_optimizer_state"
        } else {
            "optimizer_state_dict.optimizer_state_dict"
        },
    )?;
    Ok(OptimStates {
        file: r.file.clone(),
        stage,
        partition_count,
        groups,
        alignment_paddings,
        group_paddings,
        base,
    })
}
