//! Computed vs stored: what each rank of a checkpoint actually holds (its stored chunks: rank,
//! offsets and sizes in the global tensor) laid over what a computed layout says that rank should
//! hold, with every difference named.
//!
//! Both sides are reduced to the same thing: per parameter and per rank, a sorted set of half-open
//! ranges of the parameter's row-major flattened elements. A stored chunk (a box of the global
//! tensor) becomes one range per contiguous run of its rows; a predicted piece is
//!
//! - for entries read from FSDP1 flat parameters (LOCAL state dicts read through a layout): the
//!   rank's slice of each flat parameter (`_shard_param_infos`);
//! - for everything else (FSDP2 DTensors, FSDP1 SHARDED `ShardedTensor`s, DCP chunks written by
//!   either): the parameter chunked on dim 0 over the shard group (`torch.chunk`, which is how
//!   FSDP2 shards and how FSDP1 `SHARDED_STATE_DICT` re-chunks every original parameter), whichever
//!   API the layout is for.
//!
//! Global rank `g` holds the pieces of shard-group rank `g % shard_group_size` (hybrid sharding
//! replicates whole groups). A checkpoint that stores only the first shard group (DCP
//! de-duplicates replicas) is compared on that group only.

use std::collections::{BTreeMap, BTreeSet};

use crate::index::{CheckpointIndex, CheckpointKind, IndexEntry};
use crate::layout::fsdp1::PieceKind;
use crate::layout::{Api, Layout};
use crate::view::hints::LayoutHints;

/// A half-open range `[start, end)` of a parameter's flattened elements.
pub type ElementRange = (u64, u64);

/// Most ranges one stored chunk may expand to (a chunk cut on an inner dimension has one range per
/// row); beyond it the entry is not compared.
pub const MAX_RANGES_PER_CHUNK: u64 = 1 << 16;

/// One rank's side-by-side of one parameter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankOverlay {
    pub rank: u64,
    /// Elements both stored on this rank and predicted for it.
    pub matched: Vec<ElementRange>,
    /// Stored on this rank, not predicted for it.
    pub extra: Vec<ElementRange>,
    /// Predicted for this rank, stored by no chunk of it.
    pub missing: Vec<ElementRange>,
}

impl RankOverlay {
    /// True when what is stored is exactly what is predicted.
    pub fn matches(&self) -> bool {
        self.extra.is_empty() && self.missing.is_empty()
    }
}

/// One parameter: every rank that stores or should store part of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamOverlay {
    /// The layout's (clean) FQN.
    pub fqn: String,
    /// The checkpoint's key for it.
    pub key: String,
    pub numel: u64,
    /// Sorted by rank.
    pub ranks: Vec<RankOverlay>,
}

impl ParamOverlay {
    /// Ranges stored where they were not predicted, plus ranges predicted and not stored.
    pub fn difference_count(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| r.extra.len() + r.missing.len())
            .sum()
    }
}

/// How predicted pieces were derived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// Each rank's slice of the FSDP1 flat parameters.
    FlatShards,
    /// Every parameter chunked on dim 0 over the shard group.
    Dim0Chunks,
}

/// The whole comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlay {
    /// The compared parameters, in the layout's order.
    pub params: Vec<ParamOverlay>,
    /// Where the checkpoint's configuration (its hints) differs from the layout's, in words.
    pub config_differences: Vec<String>,
    pub prediction: Prediction,
    /// What was left out and why.
    pub notes: Vec<String>,
    /// False when the checkpoint stores no per-rank pieces to compare (full or plain state dicts).
    pub applicable: bool,
    /// Parameters of the layout the checkpoint has no tensor for (a difference: a layout of
    /// another model compares nothing, and must not read as a match).
    pub absent: usize,
}

impl Overlay {
    /// Extra and missing ranges over all parameters.
    pub fn piece_differences(&self) -> (usize, usize) {
        self.params
            .iter()
            .flat_map(|p| &p.ranks)
            .fold((0, 0), |(e, m), r| (e + r.extra.len(), m + r.missing.len()))
    }

    /// Every difference: extra ranges, missing ranges, layout parameters with no stored tensor
    /// and configuration differences.
    pub fn difference_count(&self) -> usize {
        let (e, m) = self.piece_differences();
        e + m + self.absent + self.config_differences.len()
    }

    /// One line for people: `stored chunks match the layout (...)` or `N differences: ...`.
    pub fn summary(&self) -> String {
        if !self.applicable {
            return "no per-rank pieces stored: nothing to compare with the layout".to_owned();
        }
        let n = self.difference_count();
        let ranks: BTreeSet<u64> = self
            .params
            .iter()
            .flat_map(|p| p.ranks.iter().map(|r| r.rank))
            .collect();
        if n == 0 {
            return format!(
                "stored chunks match the layout ({} parameters, {} ranks)",
                self.params.len(),
                ranks.len()
            );
        }
        if self.params.is_empty() && self.absent > 0 {
            return format!(
                "nothing compared: none of the layout's {} parameters is stored in the checkpoint \
                 (a layout of another model?)",
                self.absent
            );
        }
        let (extra, missing) = self.piece_differences();
        let params = self
            .params
            .iter()
            .filter(|p| p.difference_count() > 0)
            .count();
        let mut parts = Vec::new();
        parts.extend(self.config_differences.iter().cloned());
        if extra > 0 {
            parts.push(format!("{extra} stored pieces the layout does not predict"));
        }
        if missing > 0 {
            parts.push(format!("{missing} predicted pieces no chunk holds"));
        }
        if params > 0 {
            parts.push(format!("in {params} of {} parameters", self.params.len()));
        }
        if self.absent > 0 {
            parts.push(format!(
                "{} layout parameters not stored in the checkpoint",
                self.absent
            ));
        }
        format!(
            "{n} difference{}: {}",
            if n == 1 { "" } else { "s" },
            parts.join(", ")
        )
    }
}

/// Sorts and merges ranges (adjacent ones joined, empty ones dropped).
fn normalize(mut ranges: Vec<ElementRange>) -> Vec<ElementRange> {
    ranges.retain(|r| r.0 < r.1);
    ranges.sort_unstable();
    let mut out: Vec<ElementRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.0 <= last.1 => last.1 = last.1.max(r.1),
            _ => out.push(r),
        }
    }
    out
}

/// `a ∩ b` and `a − b` of two normalized range sets.
fn intersect_subtract(
    a: &[ElementRange],
    b: &[ElementRange],
) -> (Vec<ElementRange>, Vec<ElementRange>) {
    let mut inter = Vec::new();
    let mut rest = Vec::new();
    let mut j = 0;
    for &(mut s, e) in a {
        while j < b.len() && b[j].1 <= s {
            j += 1;
        }
        let mut k = j;
        while s < e {
            match b.get(k) {
                Some(&(bs, be)) if bs < e => {
                    if bs > s {
                        rest.push((s, bs));
                    }
                    let lo = s.max(bs);
                    let hi = e.min(be);
                    if lo < hi {
                        inter.push((lo, hi));
                    }
                    s = hi.max(s);
                    if be <= e {
                        k += 1;
                    } else {
                        break;
                    }
                }
                _ => {
                    rest.push((s, e));
                    s = e;
                }
            }
        }
    }
    (normalize(inter), normalize(rest))
}

/// The row-major flat ranges of the box `offsets`/`sizes` of a tensor of `shape`; `None` when the
/// box lies outside the shape or needs more than [`MAX_RANGES_PER_CHUNK`] ranges.
pub fn box_ranges(shape: &[u64], offsets: &[u64], sizes: &[u64]) -> Option<Vec<ElementRange>> {
    if offsets.len() != shape.len() || sizes.len() != shape.len() {
        return None;
    }
    for d in 0..shape.len() {
        if offsets[d].checked_add(sizes[d])? > shape[d] {
            return None;
        }
    }
    if sizes.contains(&0) {
        return Some(Vec::new());
    }
    // The innermost dims the box spans fully (plus the first partial one) form one contiguous run.
    let mut run_dim = shape.len(); // the run covers dims run_dim.. fully, dim run_dim-1 partly
    let mut run = 1u64;
    while run_dim > 0 {
        let d = run_dim - 1;
        run = run.checked_mul(sizes[d])?;
        run_dim -= 1;
        if sizes[d] != shape[d] {
            break;
        }
    }
    // Strides of the row-major shape.
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].checked_mul(shape[d + 1])?;
    }
    let outer: u64 = sizes[..run_dim]
        .iter()
        .try_fold(1u64, |a, &s| a.checked_mul(s))?;
    if outer > MAX_RANGES_PER_CHUNK {
        return None;
    }
    let base: u64 = (run_dim..shape.len())
        .map(|d| offsets[d] * strides[d])
        .sum();
    let mut out = Vec::with_capacity(usize::try_from(outer).ok()?);
    let mut idx = vec![0u64; run_dim];
    for _ in 0..outer {
        let start = base
            + (0..run_dim)
                .map(|d| (offsets[d] + idx[d]) * strides[d])
                .sum::<u64>();
        out.push((start, start + run));
        for d in (0..run_dim).rev() {
            idx[d] += 1;
            if idx[d] < sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Some(out)
}

/// True when the checkpoint kind stores per-rank pieces of the parameters.
fn stores_rank_pieces(kind: CheckpointKind) -> bool {
    matches!(
        kind,
        CheckpointKind::DcpTorchSave
            | CheckpointKind::DcpSafetensors
            | CheckpointKind::Fsdp1Sharded
            | CheckpointKind::Fsdp1Local
            | CheckpointKind::Fsdp1Unflattened
            | CheckpointKind::Fsdp2
    )
}

/// True when every stored chunk is the whole tensor (buffers, unmanaged parameters: replicated,
/// not sharded).
fn stored_whole(e: &IndexEntry, shape: &[u64]) -> bool {
    e.fsdp.is_none()
        && !e.chunks.is_empty()
        && e.chunks
            .iter()
            .all(|c| c.sizes == shape && c.offsets.iter().all(|&o| o == 0))
}

/// The predicted ranges per shard-group rank, per parameter FQN, and the shard-group size.
fn predicted(
    layout: &Layout,
    prediction: Prediction,
) -> (BTreeMap<String, Vec<Vec<ElementRange>>>, u64) {
    let mut out: BTreeMap<String, Vec<Vec<ElementRange>>> = BTreeMap::new();
    match (layout, prediction) {
        (Layout::Fsdp1(l), Prediction::FlatShards) => {
            let n = l.shard_group_size.max(1);
            for flat in &l.flat_params {
                for shard in &flat.ranks {
                    for piece in flat.rank_pieces(shard.rank) {
                        if let PieceKind::Param { param, intra_start } = piece.kind
                            && let Some(fqn) = flat.fqns.get(param)
                        {
                            let per = out.entry(fqn.clone()).or_insert_with(|| {
                                vec![Vec::new(); usize::try_from(n).unwrap_or(0)]
                            });
                            if let Some(r) =
                                per.get_mut(usize::try_from(shard.rank).unwrap_or(usize::MAX))
                            {
                                r.push((intra_start, intra_start + piece.numel));
                            }
                        }
                    }
                }
            }
            (out, n)
        }
        (Layout::Fsdp1(l), Prediction::Dim0Chunks) => {
            let n = l.shard_group_size.max(1);
            // no_shard keeps every parameter whole on every rank.
            let no_shard = l
                .flat_params
                .iter()
                .any(|f| f.padded_unsharded_numel.is_none());
            let shards = if no_shard { 1 } else { n };
            for flat in &l.flat_params {
                for (fqn, shape) in flat.fqns.iter().zip(&flat.shapes) {
                    out.insert(fqn.clone(), dim0_ranges(shape, shards, n));
                }
            }
            (out, n)
        }
        (Layout::Fsdp2(l), _) => {
            let n = l.shard_group_size.max(1);
            for unit in &l.units {
                for p in &unit.params {
                    let row: u64 = p.shape.iter().skip(1).product();
                    let mut per = vec![Vec::new(); usize::try_from(n).unwrap_or(0)];
                    for s in &p.ranks {
                        let local: u64 = s.local_shape.iter().product();
                        let start = s.global_offset.first().copied().unwrap_or(0) * row;
                        if let Some(r) = per.get_mut(usize::try_from(s.rank).unwrap_or(usize::MAX))
                        {
                            r.push((start, start + local));
                        }
                    }
                    out.insert(p.fqn.clone(), per);
                }
            }
            (out, n)
        }
    }
}

/// `torch.chunk(shards)` on dim 0 of `shape`, for `n` ranks (ranks past `shards` hold the whole
/// tensor when `shards` is 1, i.e. every rank holds everything).
fn dim0_ranges(shape: &[u64], shards: u64, n: u64) -> Vec<Vec<ElementRange>> {
    let numel: u64 = shape.iter().product();
    let Some((&dim0, rest)) = shape.split_first() else {
        return (0..n).map(|_| vec![(0, numel)]).collect();
    };
    let row: u64 = rest.iter().product();
    (0..n)
        .map(|rank| {
            if shards == 1 {
                return vec![(0, numel)];
            }
            let (size, offset) = crate::shape::shard_size_and_offset(dim0, shards, rank);
            vec![(offset * row, (offset + size) * row)]
        })
        .collect()
}

/// Lays the stored chunks of `index` over `layout`. `prefix` is the app-state key the model sits
/// under (`model` for `{model, optim}` DCP states), `None` when the keys are the FQNs.
#[allow(
    clippy::too_many_lines,
    reason = "one pass: configuration facts, then per parameter both sides and their differences"
)]
pub fn compare(
    index: &CheckpointIndex,
    hints: &LayoutHints,
    layout: &Layout,
    prefix: Option<&str>,
) -> Overlay {
    let (api, world_size, shard_group_size) = match layout {
        Layout::Fsdp1(l) => (Api::Fsdp1, l.world_size, l.shard_group_size),
        Layout::Fsdp2(l) => (Api::Fsdp2, l.world_size, l.shard_group_size),
    };
    let mut config_differences = Vec::new();
    if let Some(h) = &hints.world_size
        && h.value != world_size
    {
        config_differences.push(format!(
            "world size {} in the checkpoint ({}) vs {world_size} in the layout",
            h.value, h.why
        ));
    }
    if let Some(h) = &hints.api
        && h.value != api
    {
        config_differences.push(format!(
            "API {} in the checkpoint ({}) vs {} in the layout",
            api_name(h.value),
            h.why,
            api_name(api)
        ));
    }
    let checkpoint_group = hints.shard_group_size.as_ref().map_or_else(
        || hints.world_size.as_ref().map(|h| h.value),
        |h| Some(h.value),
    );
    if let Some(k) = checkpoint_group
        && k != shard_group_size
        && hints
            .world_size
            .as_ref()
            .is_none_or(|h| h.value == world_size)
    {
        config_differences.push(format!(
            "shard group of {k} ranks in the checkpoint vs {shard_group_size} in the layout"
        ));
    }
    let flat = matches!(
        index.kind,
        CheckpointKind::Fsdp1Local | CheckpointKind::Fsdp1Unflattened
    );
    let prediction = if flat && api == Api::Fsdp1 {
        Prediction::FlatShards
    } else {
        Prediction::Dim0Chunks
    };
    let mut overlay = Overlay {
        params: Vec::new(),
        config_differences,
        prediction,
        notes: Vec::new(),
        applicable: stores_rank_pieces(index.kind),
        absent: 0,
    };
    if !overlay.applicable {
        overlay.notes.push(format!(
            "{} stores no per-rank pieces",
            index.kind.describe()
        ));
        return overlay;
    }
    if flat && api == Api::Fsdp2 {
        overlay.notes.push(
            "the pieces were read from FSDP1 flat parameters; FSDP2 predicts dim-0 chunks"
                .to_owned(),
        );
    }
    let (predicted, n) = predicted(layout, prediction);
    // Ranks that store anything.
    let stored_ranks: BTreeSet<u64> = index
        .entries
        .iter()
        .flat_map(|e| e.chunks.iter().filter_map(|c| c.rank.map(u64::from)))
        .collect();
    let max_stored = stored_ranks.last().copied();
    // DCP de-duplicates replicas: when only the first shard group stored anything, compare it alone.
    let compared_world = if max_stored.is_some_and(|r| r < n) && world_size > n {
        overlay.notes.push(format!(
            "only ranks 0..{} stored pieces (replicas de-duplicated): the other {} shard groups are not compared",
            n - 1,
            world_size / n - 1
        ));
        n
    } else {
        world_size
    };
    let order: Vec<String> = match layout {
        Layout::Fsdp1(l) => l.flat_params.iter().flat_map(|f| f.fqns.clone()).collect(),
        Layout::Fsdp2(l) => l
            .units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.fqn.clone()))
            .collect(),
    };
    let (mut whole, mut absent, mut unknown_rank, mut too_fine) = (0usize, 0usize, 0usize, 0usize);
    for fqn in order {
        let Some(per_group_rank) = predicted.get(&fqn) else {
            continue;
        };
        let key = match prefix {
            Some(p) => format!("{p}.{fqn}"),
            None => fqn.clone(),
        };
        let Some(entry) = index.entry(&key).or_else(|| index.entry(&fqn)) else {
            absent += 1;
            continue;
        };
        let Some(shape) = entry.shape.clone() else {
            absent += 1;
            continue;
        };
        if stored_whole(entry, &shape) && prediction == Prediction::Dim0Chunks && n > 1 && !flat {
            // A DTensor/ShardedTensor parameter stored whole everywhere would be a difference; a
            // plain tensor stored whole is a buffer or unmanaged parameter (not sharded at all).
            whole += 1;
            continue;
        }
        let numel = entry.numel().unwrap_or(0);
        let mut stored: BTreeMap<u64, Vec<ElementRange>> = BTreeMap::new();
        let mut ok = true;
        for c in &entry.chunks {
            let Some(rank) = c.rank else {
                unknown_rank += 1;
                continue;
            };
            let Some(r) = box_ranges(&shape, &c.offsets, &c.sizes) else {
                ok = false;
                break;
            };
            stored.entry(u64::from(rank)).or_default().extend(r);
        }
        if !ok {
            too_fine += 1;
            continue;
        }
        let ranks: BTreeSet<u64> = stored.keys().copied().chain(0..compared_world).collect();
        let mut rows = Vec::with_capacity(ranks.len());
        for rank in ranks {
            let expected = if rank < world_size {
                normalize(
                    per_group_rank
                        .get(usize::try_from(rank % n).unwrap_or(usize::MAX))
                        .cloned()
                        .unwrap_or_default(),
                )
            } else {
                Vec::new()
            };
            let have = normalize(stored.remove(&rank).unwrap_or_default());
            let (matched, extra) = intersect_subtract(&have, &expected);
            let (_, missing) = intersect_subtract(&expected, &have);
            if matched.is_empty() && extra.is_empty() && missing.is_empty() {
                continue;
            }
            rows.push(RankOverlay {
                rank,
                matched,
                extra,
                missing,
            });
        }
        overlay.params.push(ParamOverlay {
            fqn,
            key,
            numel,
            ranks: rows,
        });
    }
    if whole > 0 {
        overlay.notes.push(format!(
            "{whole} tensors stored whole (not sharded: buffers or unmanaged parameters) are not compared"
        ));
    }
    if absent > 0 {
        overlay
            .notes
            .push(format!("{absent} layout parameters have no stored tensor"));
    }
    overlay.absent = absent;
    if unknown_rank > 0 {
        overlay.notes.push(format!(
            "{unknown_rank} chunks name no rank and are not compared"
        ));
    }
    if too_fine > 0 {
        overlay.notes.push(format!(
            "{too_fine} tensors have chunks cut into more than {MAX_RANGES_PER_CHUNK} runs and are not compared"
        ));
    }
    if matches!(index.kind, CheckpointKind::Fsdp1Unflattened) {
        overlay.notes.push(
            "FSDP1 flat parameters were placed by the layout the checkpoint was opened with"
                .to_owned(),
        );
    }
    overlay
}

fn api_name(api: Api) -> &'static str {
    match api {
        Api::Fsdp1 => "FSDP1",
        Api::Fsdp2 => "FSDP2",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::dtype::DType;
    use crate::index::{Chunk, ChunkEncoding, EntryKind, Format, FsdpInfo, PathSeg};
    use crate::layout::{LayoutConfig, compute};
    use crate::model::{ModelDescription, ParamSpec};
    use crate::view::hints::Hint;

    #[test]
    fn boxes_become_row_major_runs() {
        // Rows 2..4 of a [4, 3]: one run.
        assert_eq!(box_ranges(&[4, 3], &[2, 0], &[2, 3]), Some(vec![(6, 12)]));
        // Columns 1..3 of rows 0..2: one run per row.
        assert_eq!(
            box_ranges(&[2, 3], &[0, 1], &[2, 2]),
            Some(vec![(1, 3), (4, 6)])
        );
        // 3-D: a box of [2, 2, 2] at [0, 1, 0] in [2, 3, 2]: full last dim, partial dim 1.
        assert_eq!(
            box_ranges(&[2, 3, 2], &[0, 1, 0], &[2, 2, 2]),
            Some(vec![(2, 6), (8, 12)])
        );
        assert_eq!(box_ranges(&[4], &[3], &[2]), None);
        assert_eq!(box_ranges(&[4], &[1], &[0]), Some(vec![]));
        assert_eq!(box_ranges(&[], &[], &[]), Some(vec![(0, 1)]));
    }

    #[test]
    fn range_sets_split_into_matched_and_rest() {
        let (i, r) = intersect_subtract(&[(0, 10), (20, 30)], &[(5, 25)]);
        assert_eq!(i, vec![(5, 10), (20, 25)]);
        assert_eq!(r, vec![(0, 5), (25, 30)]);
        let (i, r) = intersect_subtract(&[(0, 4)], &[(0, 4)]);
        assert_eq!((i, r), (vec![(0, 4)], vec![]));
        let (i, r) = intersect_subtract(&[(0, 4)], &[]);
        assert_eq!((i, r), (vec![], vec![(0, 4)]));
        let (i, r) = intersect_subtract(&[(2, 8)], &[(0, 3), (4, 5), (7, 9)]);
        assert_eq!(i, vec![(2, 3), (4, 5), (7, 8)]);
        assert_eq!(r, vec![(3, 4), (5, 7)]);
        assert_eq!(
            normalize(vec![(4, 6), (0, 2), (2, 4), (7, 7)]),
            vec![(0, 6)]
        );
    }

    fn chunk(rank: u32, offsets: Vec<u64>, sizes: Vec<u64>) -> Chunk {
        Chunk {
            offsets: offsets.into(),
            sizes: sizes.into(),
            file: format!("rank{rank}.pt").into(),
            byte_offset: 0,
            byte_length: 0,
            rank: Some(rank),
            encoding: ChunkEncoding::TorchSaveItem,
        }
    }

    fn entry(key: &str, shape: Vec<u64>, chunks: Vec<Chunk>) -> IndexEntry {
        IndexEntry {
            key: key.to_owned(),
            raw_key: None,
            path: vec![PathSeg::Key(key.to_owned())],
            kind: EntryKind::Tensor,
            dtype: Some(DType::Float32),
            shape: Some(shape),
            chunks,
            fsdp: Some(FsdpInfo::DTensor {
                placements: vec!["Shard(dim=0)".to_owned()],
                mesh_shape: Some(vec![2]),
            }),
            role: None,
            flat_param: false,
            value: None,
            position: None,
            object: None,
        }
    }

    fn index(entries: Vec<IndexEntry>) -> CheckpointIndex {
        CheckpointIndex {
            format: Format::TorchSave,
            kind: CheckpointKind::Fsdp2,
            has_optimizer_state: false,
            entries,
            files: BTreeMap::new(),
            dcp: None,
        }
    }

    fn model() -> ModelDescription {
        let p = |fqn: &str, shape: Vec<u64>| ParamSpec {
            fqn: fqn.to_owned(),
            shape,
            dtype: DType::Float32,
            requires_grad: true,
            shared_with: None,
        };
        ModelDescription::new(
            vec![p("a", vec![5, 2]), p("b", vec![3])],
            vec![String::new()],
            Vec::new(),
        )
        .unwrap()
    }

    fn fsdp2(world_size: u64) -> Layout {
        compute(
            &model(),
            &LayoutConfig {
                api: Api::Fsdp2,
                world_size,
                ..LayoutConfig::default()
            },
        )
        .unwrap()
    }

    fn hints(world_size: u64) -> LayoutHints {
        LayoutHints {
            world_size: Some(Hint {
                value: world_size,
                why: "test".to_owned(),
            }),
            api: Some(Hint {
                value: Api::Fsdp2,
                why: "test".to_owned(),
            }),
            shard_group_size: None,
        }
    }

    /// What FSDP2 writes on 2 ranks: `a` rows 0..3 / 3..5, `b` 0..2 / 2..3.
    fn written_on_two() -> CheckpointIndex {
        index(vec![
            entry(
                "a",
                vec![5, 2],
                vec![
                    chunk(0, vec![0, 0], vec![3, 2]),
                    chunk(1, vec![3, 0], vec![2, 2]),
                ],
            ),
            entry(
                "b",
                vec![3],
                vec![chunk(0, vec![0], vec![2]), chunk(1, vec![2], vec![1])],
            ),
        ])
    }

    #[test]
    fn the_writing_configuration_matches() {
        let o = compare(&written_on_two(), &hints(2), &fsdp2(2), None);
        assert!(o.applicable);
        assert_eq!(o.difference_count(), 0, "{o:?}");
        assert_eq!(
            o.summary(),
            "stored chunks match the layout (2 parameters, 2 ranks)"
        );
        assert_eq!(o.params[0].ranks[1].matched, vec![(6, 10)]);
    }

    #[test]
    fn another_world_size_names_every_difference() {
        let o = compare(&written_on_two(), &hints(2), &fsdp2(3), None);
        // a over 3 ranks: rows 0..2, 2..4, 4..5 (elements 0..4, 4..8, 8..10).
        let a = &o.params[0];
        assert_eq!(a.fqn, "a");
        let r0 = &a.ranks[0];
        assert_eq!(
            (r0.matched.clone(), r0.extra.clone()),
            (vec![(0, 4)], vec![(4, 6)])
        );
        let r1 = &a.ranks[1];
        assert_eq!(r1.matched, vec![(6, 8)]);
        assert_eq!(r1.extra, vec![(8, 10)]);
        assert_eq!(r1.missing, vec![(4, 6)]);
        let r2 = &a.ranks[2];
        assert_eq!(
            (r2.matched.clone(), r2.missing.clone()),
            (vec![], vec![(8, 10)])
        );
        assert_eq!(o.config_differences.len(), 1);
        assert!(o.config_differences[0].starts_with("world size 2 in the checkpoint"));
        assert!(o.summary().contains("differences"), "{}", o.summary());
    }

    #[test]
    fn a_lost_chunk_and_a_stray_chunk_are_differences() {
        let mut ix = written_on_two();
        ix.entries[1].chunks.pop(); // b's rank-1 piece lost
        ix.entries[0].chunks.push(chunk(2, vec![0, 0], vec![1, 2])); // a rank outside the world
        let o = compare(&ix, &hints(2), &fsdp2(2), None);
        assert_eq!(o.piece_differences(), (1, 1));
        assert_eq!(o.params[1].ranks[1].missing, vec![(2, 3)]);
        let stray = o.params[0].ranks.iter().find(|r| r.rank == 2).unwrap();
        assert_eq!(stray.extra, vec![(0, 2)]);
        assert_eq!(
            o.summary(),
            "2 differences: 1 stored pieces the layout does not predict, 1 predicted pieces no chunk holds, in 2 of 2 parameters"
        );
    }

    #[test]
    fn plain_state_dicts_are_not_compared() {
        let mut ix = written_on_two();
        ix.kind = CheckpointKind::Plain;
        let o = compare(&ix, &LayoutHints::default(), &fsdp2(2), None);
        assert!(!o.applicable);
        assert!(o.summary().starts_with("no per-rank pieces"));
    }

    #[test]
    fn flat_shards_predict_fsdp1_local_pieces() {
        // FSDP1, 2 ranks, one flat parameter [a (10), b (3)] = 13 elements, shards of 7:
        // rank 0 holds a[0..7], rank 1 a[7..10] and b[0..3] (+ 1 padding).
        let layout = compute(
            &model(),
            &LayoutConfig {
                world_size: 2,
                ..LayoutConfig::default()
            },
        )
        .unwrap();
        let mut ix = index(vec![
            entry(
                "a",
                vec![5, 2],
                vec![
                    chunk(0, vec![0, 0], vec![3, 2]),
                    chunk(0, vec![3, 0], vec![1, 1]),
                    chunk(1, vec![3, 1], vec![1, 1]),
                    chunk(1, vec![4, 0], vec![1, 2]),
                ],
            ),
            entry("b", vec![3], vec![chunk(1, vec![0], vec![3])]),
        ]);
        ix.kind = CheckpointKind::Fsdp1Unflattened;
        let mut h = hints(2);
        h.api = None;
        let o = compare(&ix, &h, &layout, None);
        assert_eq!(o.prediction, Prediction::FlatShards);
        assert_eq!(o.difference_count(), 0, "{o:?}");
        assert_eq!(o.params[0].ranks[1].matched, vec![(7, 10)]);
    }
}
