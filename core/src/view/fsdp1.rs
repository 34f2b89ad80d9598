//! FSDP1 per-rank checkpoints read through the model's layout: every original parameter, and its
//! optimizer state, as a logical tensor whose pieces are taken from the ranks' files.
//!
//! A LOCAL state dict stores each FSDP unit as one `_flat_param` (a `ShardedTensor` over the
//! flattened, padded concatenation of the unit's parameters); a raw `optimizer.state_dict()` holds
//! int ids over flat parameters (`use_orig_params=False`) or over each rank's slice of the
//! original parameters (`use_orig_params=True`). With the layout ([`Fsdp1Layout`]) each such piece
//! is a contiguous range of an original parameter's flattened elements. A contiguous range of a
//! row-major tensor is the union of at most `2·ndim − 1` boxes ([`flat_range_boxes`]), so every
//! range piece becomes ordinary [`Chunk`]s (raw views into the same storage bytes, with the
//! parameter's contiguous strides) and everything downstream (`check`, `read_tensor`, `diff`,
//! `convert`, the viewer) reads original parameters without knowing where they came from.
//!
//! Keys follow torch's own full dicts: `FULL_STATE_DICT` names for the model, and
//! `FSDP.optim_state_dict` for the optimizer (`state.<fqn>.<name>`, `param_groups[i].params` as
//! FQNs). Padding segments and shard tails are not part of any parameter and are left out
//! (`verify --model` checks them).

use std::collections::{BTreeMap, HashMap};

use crate::index::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, EntryKind, IndexEntry, PathSeg, Role,
};
use crate::layout::key_plan::full_key_plan;
use crate::layout::{FlatParamLayout, Fsdp1Layout};
use crate::layout::{Fsdp1Model, ParamRef};
use crate::model::ModelDescription;
use crate::shape::{checked_contiguous_strides, flat_range_boxes};

/// Why a per-rank checkpoint cannot be read through a layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// The layout and the checkpoint disagree (sizes, dtypes, missing keys).
    #[error("`{key}`: {what}")]
    Mismatch { key: String, what: String },
    /// The description and the layout do not go together.
    #[error("the model description does not match its layout: {0}")]
    Layout(String),
}

fn mismatch(key: &str, what: impl Into<String>) -> ViewError {
    ViewError::Mismatch {
        key: key.to_owned(),
        what: what.into(),
    }
}

/// The chunks of a parameter of `shape` for the flat elements `[intra_start, intra_start + len)`
/// stored contiguously in `src` (a 1-D raw chunk) from its element `at`.
fn range_chunks(
    key: &str,
    shape: &[u64],
    intra_start: u64,
    len: u64,
    src: &Chunk,
    at: u64,
) -> Result<Vec<Chunk>, ViewError> {
    let ChunkEncoding::Raw {
        storage_offset,
        strides,
    } = &src.encoding
    else {
        return Err(mismatch(
            key,
            "the piece is not a raw storage view (only torch.save per-rank files are read through a layout)",
        ));
    };
    if strides.len() > 1 || (strides.first().is_some_and(|&s| s != 1) && src.sizes[0] > 1) {
        return Err(mismatch(
            key,
            format!("the flat piece is not contiguous (strides {strides:?})"),
        ));
    }
    let end = intra_start
        .checked_add(len)
        .ok_or_else(|| mismatch(key, "range overflows"))?;
    let boxes = flat_range_boxes(shape, intra_start, end).ok_or_else(|| {
        mismatch(
            key,
            format!("elements {intra_start}..{end} lie outside shape {shape:?}"),
        )
    })?;
    let pstrides = checked_contiguous_strides(shape)
        .ok_or_else(|| mismatch(key, "shape overflows 64 bits"))?;
    boxes
        .into_iter()
        .map(|(offsets, sizes, flat)| {
            let storage = storage_offset
                .checked_add(at)
                .and_then(|s| s.checked_add(flat - intra_start))
                .ok_or_else(|| mismatch(key, "storage offset overflows"))?;
            Ok(Chunk {
                offsets: offsets.into(),
                sizes: sizes.into(),
                file: src.file.clone(),
                byte_offset: src.byte_offset,
                byte_length: src.byte_length,
                rank: src.rank,
                encoding: ChunkEncoding::Raw {
                    storage_offset: storage,
                    strides: pstrides.clone(),
                },
            })
        })
        .collect()
}

/// Splits the flat elements `[flat_start, flat_start + n)` of `fp` (stored in `src` from its
/// element 0) over the real parameters: `(param index, chunks)`; padding is skipped.
fn split_flat(
    fp: &FlatParamLayout,
    shapes: &[Vec<u64>],
    flat_start: u64,
    n: u64,
    src: &Chunk,
) -> Result<Vec<(usize, Vec<Chunk>)>, ViewError> {
    let flat_end = flat_start
        .checked_add(n)
        .ok_or_else(|| mismatch(&fp.flat_param_fqn, "range overflows"))?;
    let mut out = Vec::new();
    let mut seg_start = 0u64;
    let mut param = 0usize;
    for (&len, &pad) in fp.numels_with_padding.iter().zip(&fp.is_padding_mask) {
        let seg_end = seg_start + len;
        let lo = seg_start.max(flat_start);
        let hi = seg_end.min(flat_end);
        if !pad {
            if lo < hi {
                let chunks = range_chunks(
                    &fp.fqns[param],
                    &shapes[param],
                    lo - seg_start,
                    hi - lo,
                    src,
                    lo - flat_start,
                )?;
                out.push((param, chunks));
            }
            param += 1;
        }
        seg_start = seg_end;
    }
    Ok(out)
}

/// The key prefix (`"model."`, `"optim."` or `""`) and its path: `path` less its last `drop`
/// segments.
pub(crate) fn prefix_of(path: &[PathSeg], drop: usize) -> (String, Vec<PathSeg>) {
    let keep = &path[..path.len().saturating_sub(drop)];
    let mut key = String::new();
    for seg in keep {
        key.push_str(&seg.to_string());
        key.push('.');
    }
    (key, keep.to_vec())
}

/// The per-rank checkpoint `index` (FSDP1 LOCAL model files and/or raw optimizer files, as
/// [`crate::index::index_source`] reads a folder) with every flat parameter replaced by
/// the original parameters it holds and raw optimizer state keyed by FQN, as torch's
/// `FULL_STATE_DICT` and `FSDP.optim_state_dict` key them. `layout` is the layout the files were
/// written with. Entries that are neither are kept as they are.
#[allow(
    clippy::too_many_lines,
    reason = "one pass over model and optimizer entries that share the flat-parameter ranges it builds"
)]
pub fn original_params(
    index: &CheckpointIndex,
    description: &ModelDescription,
    layout: &Fsdp1Layout,
) -> Result<CheckpointIndex, ViewError> {
    let model =
        Fsdp1Model::new(description, layout).map_err(|e| ViewError::Layout(e.to_string()))?;
    let shapes_of = |fp: &FlatParamLayout| fp.shapes.clone();
    let by_key: HashMap<&str, usize> = index
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    let mut removed = vec![false; index.entries.len()];
    let mut added: Vec<IndexEntry> = Vec::new();

    // Model: flat parameters -> original parameters.
    let mut model_prefix: Option<String> = None;
    for fp in &layout.flat_params {
        let shapes = shapes_of(fp);
        let Some((flat_i, flat)) = ["", "model."].iter().find_map(|p| {
            let i = *by_key.get(format!("{p}{}", fp.flat_param_fqn).as_str())?;
            Some((i, &index.entries[i]))
        }) else {
            continue;
        };
        let (prefix, prefix_path) = prefix_of(&flat.path, 1);
        model_prefix.get_or_insert_with(|| prefix.clone());
        if flat.kind != EntryKind::Tensor || flat.dtype != Some(fp.dtype) {
            return Err(mismatch(
                &flat.key,
                format!(
                    "holds {:?} {}, the layout gives a {} flat parameter",
                    flat.kind,
                    flat.dtype.map_or("-", |d| d.name()),
                    fp.dtype.name()
                ),
            ));
        }
        if flat.shape.as_deref() != Some(&[fp.unpadded_unsharded_numel][..]) {
            return Err(mismatch(
                &flat.key,
                format!(
                    "holds {} elements, the layout for this model gives {} (padding included)\nhint: check --use-orig-params, --world-size, --strategy and --param-dtype against how the model was wrapped",
                    flat.shape
                        .as_deref()
                        .map_or_else(|| "rank-local".to_owned(), |s| format!("{s:?}")),
                    fp.unpadded_unsharded_numel
                ),
            ));
        }
        removed[flat_i] = true;
        let mut pieces: Vec<Vec<Chunk>> = vec![Vec::new(); fp.fqns.len()];
        for c in &flat.chunks {
            let (Some(&o), Some(&n)) = (c.offsets.first(), c.sizes.first()) else {
                return Err(mismatch(&flat.key, "a flat parameter piece is not 1-D"));
            };
            for (p, chunks) in split_flat(fp, &shapes, o, n, c)? {
                pieces[p].extend(chunks);
            }
        }
        let flat_position = flat.position;
        let mut put =
            |fqn: &str, shape: &[u64], chunks: Vec<Chunk>, k: u64| -> Result<(), ViewError> {
                let key = format!("{prefix}{fqn}");
                if let Some(&i) = by_key.get(key.as_str()) {
                    // use_orig_params LOCAL dicts also hold each rank's flattened (1-D) view of the
                    // parameter: the same bytes. Equal sizes on every rank make it look like a
                    // replicated tensor; only a tensor of another shape under the name is a conflict.
                    let other = &index.entries[i];
                    let view = other.kind == EntryKind::Tensor
                        && other.chunks.iter().all(|c| c.sizes.len() == 1);
                    if !view {
                        return Err(mismatch(
                            &key,
                            "stored both in a flat parameter and as a tensor of its own",
                        ));
                    }
                    removed[i] = true;
                }
                let mut path = prefix_path.clone();
                path.push(PathSeg::Key(fqn.to_owned()));
                added.push(IndexEntry {
                    key,
                    raw_key: None,
                    path,
                    kind: EntryKind::Tensor,
                    dtype: Some(fp.dtype),
                    shape: Some(shape.to_vec()),
                    chunks,
                    fsdp: None,
                    role: None,
                    flat_param: false,
                    value: None,
                    position: flat_position.map(|p| scaled(p) + k),
                    object: None,
                });
                Ok(())
            };
        let by_fqn: HashMap<&str, usize> = fp
            .fqns
            .iter()
            .enumerate()
            .map(|(i, f)| (f.as_str(), i))
            .collect();
        for (i, chunks) in pieces.iter().enumerate() {
            put(&fp.fqns[i], &shapes[i], chunks.clone(), i as u64)?;
        }
        for shared in &fp.shared_params {
            let Some(&i) = by_fqn.get(shared.prim_fqn.as_str()) else {
                continue;
            };
            put(
                &shared.fqn,
                &shapes[i],
                pieces[i].clone(),
                (fp.fqns.len() + i) as u64,
            )?;
        }
    }

    // Optimizer: int ids -> FQNs.
    let ids = model.wrapped_params();
    let plain_shapes: HashMap<&str, &[u64]> = description
        .params
        .iter()
        .map(|p| (p.fqn.as_str(), p.shape.as_slice()))
        .collect();
    let group_rank = |r: Option<u32>| u64::from(r.unwrap_or(0)) % layout.shard_group_size.max(1);
    // (prefix key, prefix path) -> new entries by key, to merge the pieces of scalar states.
    let mut optim: BTreeMap<String, IndexEntry> = BTreeMap::new();
    // key -> (the optimizer id, FQN and state name it came from), for torch's key order.
    let mut order_of: HashMap<String, (i64, String, String)> = HashMap::new();
    for (i, e) in index.entries.iter().enumerate() {
        let Some(Role::OptimizerState {
            param: PathSeg::Index(id),
            state,
        }) = &e.role
        else {
            continue;
        };
        let Some((_, pref)) = usize::try_from(*id).ok().and_then(|id| ids.get(id)) else {
            return Err(mismatch(
                &e.key,
                format!(
                    "optimizer id {id} does not exist: the FSDP-wrapped model has {} parameters\nhint: the optimizer must be built over model.parameters() of the wrapped model, and --use-orig-params must match how it was wrapped",
                    ids.len()
                ),
            ));
        };
        removed[i] = true;
        let (prefix, prefix_path) = prefix_of(&e.path, 3);
        let dtype = e.dtype;
        // The FQNs this id stands for, and each one's place among them (once per entry: an id
        // of a flat parameter stands for every parameter of its unit).
        let fqns = id_fqns(&model, pref);
        let fqn_rank: HashMap<&str, u64> = fqns
            .iter()
            .enumerate()
            .map(|(k, f)| (f.as_str(), k as u64))
            .collect();
        let mut emit = |fqn: &str, shape: Option<Vec<u64>>, chunks: Vec<Chunk>| {
            let k = fqn_rank.get(fqn).copied().unwrap_or(0);
            let key = format!("{prefix}state.{fqn}.{state}");
            order_of
                .entry(key.clone())
                .or_insert_with(|| (*id, fqn.to_owned(), state.clone()));
            let entry = optim.entry(key.clone()).or_insert_with(|| {
                let mut path = prefix_path.clone();
                path.extend([
                    PathSeg::Key("state".to_owned()),
                    PathSeg::Key(fqn.to_owned()),
                    PathSeg::Key(state.clone()),
                ]);
                IndexEntry {
                    key,
                    raw_key: None,
                    path,
                    kind: e.kind,
                    dtype,
                    shape,
                    chunks: Vec::new(),
                    fsdp: None,
                    role: Some(Role::OptimizerState {
                        param: PathSeg::Key(fqn.to_owned()),
                        state: state.clone(),
                    }),
                    flat_param: false,
                    value: e.value.clone(),
                    position: e.position.map(|p| scaled(p) + k),
                    object: e.object.clone(),
                }
            });
            entry.chunks.extend(chunks);
        };
        if e.kind != EntryKind::Tensor {
            // Non-tensor state (an int `step`): the same value for every FQN the id stands for.
            for fqn in &fqns {
                emit(fqn, None, Vec::new());
            }
            continue;
        }
        for c in &e.chunks {
            if c.sizes.is_empty() {
                // A 0-d state (`step`): one value shared by every FQN of the id.
                for fqn in &fqns {
                    emit(fqn, Some(Vec::new()), vec![c.clone()]);
                }
                continue;
            }
            let (Some(&n), true) = (
                c.sizes.first(),
                c.sizes.len() == 1 || matches!(pref, ParamRef::Plain(_)),
            ) else {
                return Err(mismatch(
                    &e.key,
                    format!("a state piece of shape {:?} is not 1-D", c.sizes),
                ));
            };
            match pref {
                ParamRef::Flat(f) => {
                    let fp = model.flat(*f);
                    let rank = group_rank(c.rank);
                    let (start, end) = fp.rank_window(rank);
                    if n != end - start {
                        return Err(mismatch(
                            &e.key,
                            format!(
                                "rank {} holds {n} elements of `{}`, the layout gives its shard {}",
                                c.rank.unwrap_or(0),
                                fp.flat_param_fqn,
                                end - start
                            ),
                        ));
                    }
                    for (p, chunks) in split_flat(fp, &fp.shapes, start, n, c)? {
                        emit(&fp.fqns[p], Some(fp.shapes[p].clone()), chunks);
                    }
                }
                ParamRef::Orig { flat, index: p } => {
                    let fp = model.flat(*flat);
                    let rank = group_rank(c.rank);
                    let info = fp
                        .ranks
                        .get(rank as usize)
                        .and_then(|r| r.shard_param_infos.get(*p))
                        .copied();
                    let fqn = &fp.fqns[*p];
                    let shape = fp.shapes[*p].clone();
                    match info {
                        Some(info) if info.in_shard => {
                            let start = info.intra_param_start_idx.unwrap_or(0);
                            if info.numel_in_shard != Some(n) {
                                return Err(mismatch(
                                    &e.key,
                                    format!(
                                        "rank {} holds {n} elements of `{fqn}`, the layout gives {}",
                                        c.rank.unwrap_or(0),
                                        info.numel_in_shard.unwrap_or(0)
                                    ),
                                ));
                            }
                            let chunks = range_chunks(&e.key, &shape, start, n, c, 0)?;
                            emit(fqn, Some(shape), chunks);
                        }
                        _ if n == 0 => emit(fqn, Some(shape), Vec::new()),
                        _ => {
                            return Err(mismatch(
                                &e.key,
                                format!(
                                    "rank {} holds {n} elements of `{fqn}`, which the layout puts on other ranks",
                                    c.rank.unwrap_or(0)
                                ),
                            ));
                        }
                    }
                }
                ParamRef::Plain(fqn) => {
                    let shape = plain_shapes.get(fqn.as_str()).copied().unwrap_or(&[]);
                    if c.sizes != shape || c.offsets.iter().any(|&o| o != 0) {
                        return Err(mismatch(
                            &e.key,
                            format!(
                                "`{fqn}` is not sharded by FSDP, but rank {} holds a piece of shape {:?} (the description says {shape:?})",
                                c.rank.unwrap_or(0),
                                c.sizes
                            ),
                        ));
                    }
                    emit(fqn, Some(shape.to_vec()), vec![c.clone()]);
                }
            }
        }
    }
    // `param_groups[i].params`: ids -> FQNs, as `FSDP.optim_state_dict` lists them.
    let mut entries: Vec<IndexEntry> = Vec::with_capacity(index.entries.len() + added.len());
    for (i, e) in index.entries.iter().enumerate() {
        if removed[i] {
            continue;
        }
        let mut e = e.clone();
        e.position = e.position.map(scaled);
        if matches!(e.role, Some(Role::ParamGroup { .. }))
            && e.path.last() == Some(&PathSeg::Key("params".to_owned()))
            && let Some(serde_json::Value::Array(list)) = &e.value
            && list.iter().all(serde_json::Value::is_u64)
        {
            let mut names = Vec::new();
            for v in list {
                let pref = v
                    .as_u64()
                    .and_then(|id| ids.get(usize::try_from(id).ok()?))
                    .ok_or_else(|| {
                        mismatch(
                            &e.key,
                            format!(
                                "`{v}` is not an optimizer id of the wrapped model ({} parameters)",
                                ids.len()
                            ),
                        )
                    })?;
                names.extend(
                    id_fqns(&model, &pref.1)
                        .into_iter()
                        .map(serde_json::Value::String),
                );
            }
            e.value = Some(serde_json::Value::Array(names));
            e.object = None;
        }
        entries.push(e);
    }
    entries.extend(added);
    if let Some(prefix) = &model_prefix {
        torch_model_order(&model, index, prefix, &mut entries);
    }
    torch_optim_order(&model, layout, &mut optim, &order_of);
    entries.extend(optim.into_values());
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    for w in entries.windows(2) {
        if w[0].key == w[1].key {
            return Err(mismatch(&w[0].key, "two entries map to this key"));
        }
    }
    let kind = if entries.iter().any(|e| e.flat_param) {
        index.kind
    } else {
        CheckpointKind::Fsdp1Unflattened
    };
    Ok(CheckpointIndex {
        format: index.format,
        kind,
        has_optimizer_state: index.has_optimizer_state,
        entries,
        files: index.files.clone(),
        dcp: index.dcp.clone(),
    })
}

/// Marks the per-rank 1-D parameter views that `use_orig_params=True` LOCAL state dicts hold next
/// to each flat parameter as rank-local (no global shape). The indexer cannot tell them from
/// replicated tensors when every rank's view has the same length; the layout can.
pub fn mark_param_views(index: &mut CheckpointIndex, layout: &Fsdp1Layout) {
    for fp in &layout.flat_params {
        for prefix in ["", "model."] {
            if index
                .entry(&format!("{prefix}{}", fp.flat_param_fqn))
                .is_none()
            {
                continue;
            }
            for fqn in &fp.fqns {
                let key = format!("{prefix}{fqn}");
                if let Ok(i) = index.entries.binary_search_by(|e| e.key.as_str().cmp(&key)) {
                    let e = &mut index.entries[i];
                    if e.kind == EntryKind::Tensor && e.chunks.iter().all(|c| c.sizes.len() == 1) {
                        e.shape = None;
                    }
                }
            }
        }
    }
}

/// Reorders the model entries (by permuting the positions they hold) into the key order of
/// torch's `FULL_STATE_DICT`, which [`full_key_plan`] derives from the keys of rank 0's LOCAL
/// state dict (the model entries of `index`, under `prefix`, in their stored order).
fn torch_model_order(
    model: &Fsdp1Model<'_>,
    index: &CheckpointIndex,
    prefix: &str,
    entries: &mut [IndexEntry],
) {
    let mut local: Vec<(u64, &str)> = index
        .entries
        .iter()
        .filter_map(|e| Some((e.position?, e.key.strip_prefix(prefix)?)))
        .collect();
    local.sort_unstable();
    let names: Vec<String> = local.iter().map(|(_, k)| (*k).to_owned()).collect();
    let at: HashMap<&str, usize> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    let order: Vec<usize> = full_key_plan(model, &names)
        .iter()
        .filter_map(|(name, _)| at.get(format!("{prefix}{name}").as_str()).copied())
        .collect();
    let mut positions: Vec<u64> = order.iter().filter_map(|&i| entries[i].position).collect();
    if positions.len() != order.len() {
        return;
    }
    positions.sort_unstable();
    for (i, position) in order.into_iter().zip(positions) {
        entries[i].position = Some(position);
    }
}

/// Reorders the optimizer state entries (by permuting the positions they hold, so they keep
/// their place among the other entries) into the order of `FSDP.optim_state_dict`:
///
/// - `use_orig_params=False`: optimizer ids in order, a flat parameter's FQNs in flat order; in a
///   sharded flat parameter's state, positive-dimension tensors, then 0-d tensors, then other
///   values, each sorted by name;
/// - `use_orig_params=True`: parameters FSDP does not manage first, sorted by FQN, then the managed
///   ones unit by unit (units in the order of their first FQN, FQNs sorted); in a sharded
///   parameter's state, other values, then 0-d tensors, then tensors, each sorted by name.
///
/// Unsharded state (no padding, one rank per shard group, unmanaged parameters) keeps the order
/// of the rank's own dict.
/// (managed by a unit with `use_orig_params`, unit's first FQN, optimizer id, place in the flat
/// parameter, FQN, state class, state name, position)
type SortKey<'a> = (u8, &'a str, u64, u64, &'a str, u8, &'a str, u64);

fn torch_optim_order(
    model: &Fsdp1Model<'_>,
    layout: &Fsdp1Layout,
    optim: &mut BTreeMap<String, IndexEntry>,
    order_of: &HashMap<String, (i64, String, String)>,
) {
    let ids = model.wrapped_params();
    let unsharded =
        |f: usize| model.flat(f).padded_unsharded_numel.is_none() || layout.shard_group_size <= 1;
    // Per managed flat parameter (use_orig_params): the smallest FQN that has state.
    let mut first_fqn: HashMap<usize, &str> = HashMap::new();
    for (id, fqn, _) in order_of.values() {
        if let Some((_, ParamRef::Orig { flat, .. })) =
            usize::try_from(*id).ok().and_then(|i| ids.get(i))
        {
            let slot = first_fqn.entry(*flat).or_insert(fqn.as_str());
            if fqn.as_str() < *slot {
                *slot = fqn.as_str();
            }
        }
    }
    let mut keyed: Vec<(SortKey<'_>, &String)> = Vec::with_capacity(optim.len());
    for (key, e) in optim.iter() {
        let Some((id, fqn, state)) = order_of.get(key) else {
            continue;
        };
        let pref = usize::try_from(*id)
            .ok()
            .and_then(|i| ids.get(i))
            .map(|p| &p.1);
        // 0: positive-dimension tensor, 1: 0-d tensor, 2: other value.
        let class = match (&e.kind, e.shape.as_deref()) {
            (EntryKind::Tensor, Some([])) => 1,
            (EntryKind::Tensor, _) => 0,
            _ => 2,
        };
        let position = e.position.unwrap_or(u64::MAX);
        let id_u = u64::try_from(*id).unwrap_or(u64::MAX);
        let sort: SortKey<'_> = match pref {
            Some(ParamRef::Flat(f)) => {
                let k = model
                    .flat(*f)
                    .fqns
                    .iter()
                    .position(|x| x == fqn)
                    .unwrap_or(0) as u64;
                if unsharded(*f) {
                    (0, "", id_u, k, "", 0, "", position)
                } else {
                    (0, "", id_u, k, "", class, state, 0)
                }
            }
            Some(ParamRef::Orig { flat, .. }) => {
                let group = first_fqn.get(flat).copied().unwrap_or("");
                if unsharded(*flat) {
                    (1, group, 0, 0, fqn, 0, "", position)
                } else {
                    (1, group, 0, 0, fqn, 2 - class, state, 0)
                }
            }
            Some(ParamRef::Plain(_)) | None if layout.use_orig_params => {
                (0, fqn, 0, 0, "", 0, "", position)
            }
            Some(ParamRef::Plain(_)) | None => (0, "", id_u, 0, "", 0, "", position),
        };
        keyed.push((sort, key));
    }
    let mut positions: Vec<u64> = keyed
        .iter()
        .filter_map(|(_, k)| optim.get(*k).and_then(|e| e.position))
        .collect();
    if positions.len() != keyed.len() {
        return;
    }
    positions.sort_unstable();
    keyed.sort();
    let order: Vec<(String, u64)> = keyed
        .into_iter()
        .zip(positions)
        .map(|((_, k), p)| (k.clone(), p))
        .collect();
    for (key, position) in order {
        if let Some(e) = optim.get_mut(&key) {
            e.position = Some(position);
        }
    }
}

/// An entry position with room for the parameters a flat parameter or an optimizer id expands to.
fn scaled(position: u64) -> u64 {
    position.saturating_mul(1 << 20)
}

/// The FQNs an optimizer id stands for: a flat parameter's real parameters in flat order, or the
/// one parameter.
fn id_fqns(model: &Fsdp1Model<'_>, pref: &ParamRef) -> Vec<String> {
    match pref {
        ParamRef::Flat(f) => model.flat(*f).fqns.clone(),
        ParamRef::Orig { flat, index } => vec![model.flat(*flat).fqns[*index].clone()],
        ParamRef::Plain(fqn) => vec![fqn.clone()],
    }
}
