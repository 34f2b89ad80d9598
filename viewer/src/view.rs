//! The view model: everything the panels draw, derived once from a model description and a layout
//! (and recomputed when a control changes). Panels never walk `core` layouts themselves; they read
//! these flat tables, which are cheap to cull and binary-search at 100 000 chunks.

use std::collections::HashMap;

use shardscope_core::DType;
use shardscope_core::layout::fsdp1::PieceKind;
use shardscope_core::layout::{Fsdp1Layout, Fsdp2Layout, Layout};
use shardscope_core::model::{ModelDescription, fqn};

/// How FSDP treats a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamStatus {
    /// Sharded by an FSDP unit.
    Sharded,
    /// A second name of a tied weight; takes no space of its own.
    Alias,
    /// Outside every FSDP unit: every rank keeps the whole tensor.
    Unmanaged,
    /// Listed in `ignored_params`.
    Ignored,
}

impl ParamStatus {
    pub const fn label(self) -> &'static str {
        match self {
            ParamStatus::Sharded => "sharded",
            ParamStatus::Alias => "tied alias",
            ParamStatus::Unmanaged => "unmanaged (replicated)",
            ParamStatus::Ignored => "ignored",
        }
    }
}

/// One parameter, as every panel shows it.
#[derive(Debug, Clone)]
pub struct ParamRow {
    /// Clean FQN (`block1.lin.weight`).
    pub fqn: String,
    /// The name `named_parameters()` of the wrapped model yields (FSDP1 inserts
    /// `_fsdp_wrapped_module.` after every unit; FSDP2 keeps the clean name).
    pub raw_name: String,
    /// Unit prefix (`""` is the root), `None` when unmanaged or ignored.
    pub unit: Option<String>,
    /// FSDP1: raw name of the flat parameter holding it.
    pub flat_param: Option<String>,
    /// FSDP1: `[start, end)` in the unsharded flat parameter (padding segments included).
    pub flat_range: Option<(u64, u64)>,
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub numel: u64,
    pub status: ParamStatus,
    /// For an alias, the primary FQN.
    pub shared_with: Option<String>,
    /// Shard-group ranks holding at least one element (all ranks for unmanaged parameters).
    pub ranks: Vec<u64>,
    /// Stable colour slot.
    pub color_slot: usize,
    /// Per-rank pieces of the flattened parameter, for the chunk map.
    pub chunks: Vec<ParamChunk>,
    /// FSDP2: rows every rank's padded local tensor has (`padded_sharded_shape[0]`).
    pub padded_rows: Option<u64>,
}

impl ParamRow {
    pub fn bytes(&self) -> u64 {
        self.numel * self.dtype.size_bytes() as u64
    }

    /// Elements per row when the tensor is viewed as 2-D `[dim0, rest]` (1 for 1-D, the whole
    /// tensor for 0-dim).
    pub fn row_len(&self) -> u64 {
        if self.shape.len() <= 1 {
            1
        } else {
            self.shape[1..].iter().product()
        }
    }
}

/// A rank's piece of one parameter: elements `[start, end)` of the flattened parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamChunk {
    pub rank: u64,
    pub start: u64,
    pub end: u64,
    /// FSDP2: padding elements appended to this rank's local tensor.
    pub padding_numel: u64,
}

/// What a run of a rank bar is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegKind {
    /// Elements `[intra_start, intra_start + numel)` of parameter `param` (index into
    /// [`LayoutView::params`]).
    Param { param: usize, intra_start: u64 },
    /// FSDP1 alignment / world-size padding segment inside the flat parameter.
    AlignPad,
    /// Padding at the end of a shard: FSDP1 `_shard_numel_padded` zeros, FSDP2 rows added to reach
    /// `padded_sharded_shape` (then `param` names the parameter the padding belongs to).
    TailPad { param: Option<usize> },
}

/// A run of a rank bar. Positions are in bytes so units of mixed dtypes (FSDP2) draw to scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub x_bytes: u64,
    pub len_bytes: u64,
    /// Offset in the rank's shard in elements (FSDP1: of the flat parameter; FSDP2: of the
    /// parameter's padded local tensor).
    pub offset_in_shard: u64,
    pub numel: u64,
    pub kind: SegKind,
}

/// One rank of one unit.
#[derive(Debug, Clone, Default)]
pub struct RankBar {
    pub rank: u64,
    pub segs: Vec<Seg>,
    pub real_bytes: u64,
    pub align_pad_bytes: u64,
    pub tail_pad_bytes: u64,
}

/// One FSDP unit: one bar per shard-group rank.
#[derive(Debug, Clone)]
pub struct UnitView {
    /// Unit prefix (`""` is the root).
    pub prefix: String,
    /// FSDP1: raw name of the flat parameter.
    pub flat_param: Option<String>,
    /// Bar length in bytes (every rank's shard has the same padded size).
    pub bar_bytes: u64,
    pub ranks: Vec<RankBar>,
    /// Parameters of the unit (indices into [`LayoutView::params`]).
    pub params: Vec<usize>,
    /// A one-line summary (segments, sizes).
    pub summary: String,
}

impl UnitView {
    pub fn display_name(&self) -> &str {
        if self.prefix.is_empty() {
            "(root)"
        } else {
            &self.prefix
        }
    }

    /// `max / mean - 1` of the real bytes per rank (0 when perfectly balanced).
    pub fn imbalance(&self) -> f64 {
        imbalance(self.ranks.iter().map(|r| r.real_bytes))
    }
}

/// Per-rank totals over all units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankTotal {
    pub rank: u64,
    pub real_bytes: u64,
    pub align_pad_bytes: u64,
    pub tail_pad_bytes: u64,
    /// Bytes of unmanaged parameters every rank keeps whole.
    pub replicated_bytes: u64,
}

impl RankTotal {
    pub fn padding_bytes(&self) -> u64 {
        self.align_pad_bytes + self.tail_pad_bytes
    }
    pub fn total_bytes(&self) -> u64 {
        self.real_bytes + self.padding_bytes() + self.replicated_bytes
    }
}

/// `max / mean - 1` over the values (0 for no values or all zero).
pub fn imbalance(values: impl Iterator<Item = u64>) -> f64 {
    let (mut n, mut sum, mut max) = (0u64, 0u128, 0u64);
    for v in values {
        n += 1;
        sum += u128::from(v);
        max = max.max(v);
    }
    if n == 0 || sum == 0 {
        return 0.0;
    }
    let mean = sum as f64 / n as f64;
    max as f64 / mean - 1.0
}

/// Everything the panels draw for one layout.
#[derive(Debug, Clone)]
pub struct LayoutView {
    /// Changes whenever the view is rebuilt (panels key their caches on it).
    pub generation: u64,
    /// `"FSDP1"` or `"FSDP2"`.
    pub api_label: &'static str,
    pub world_size: u64,
    pub shard_group_size: u64,
    pub strategy_label: String,
    pub units: Vec<UnitView>,
    pub params: Vec<ParamRow>,
    pub by_fqn: HashMap<String, usize>,
    pub rank_totals: Vec<RankTotal>,
    pub notes: Vec<String>,
}

impl LayoutView {
    /// Number of shard groups (replicas of the same layout).
    pub fn replica_groups(&self) -> u64 {
        self.world_size / self.shard_group_size.max(1)
    }

    pub fn param(&self, fqn: &str) -> Option<&ParamRow> {
        self.by_fqn.get(fqn).map(|&i| &self.params[i])
    }

    /// Total (rank, parameter) chunks drawn: the size of the picture.
    pub fn chunk_count(&self) -> usize {
        self.units
            .iter()
            .flat_map(|u| &u.ranks)
            .map(|r| r.segs.len())
            .sum()
    }

    /// Padding bytes over every rank of the shard group: (alignment, shard tail).
    pub fn padding_totals(&self) -> (u64, u64) {
        self.rank_totals.iter().fold((0, 0), |(a, t), r| {
            (a + r.align_pad_bytes, t + r.tail_pad_bytes)
        })
    }

    /// `max / mean - 1` of real bytes per rank over the whole model.
    pub fn imbalance(&self) -> f64 {
        imbalance(self.rank_totals.iter().map(|r| r.real_bytes))
    }

    /// Builds the view of `layout`, computed from `model`.
    pub fn new(model: &ModelDescription, layout: &Layout) -> Self {
        match layout {
            Layout::Fsdp1(l) => from_fsdp1(model, l),
            Layout::Fsdp2(l) => from_fsdp2(model, l),
        }
    }
}

/// The raw FSDP1 name of `clean` under `units`: `_fsdp_wrapped_module.` after every unit prefix
/// that contains it (outermost first), as `named_parameters()` of the wrapped root prints it.
pub fn fsdp1_raw_name(clean: &str, units: &[String]) -> String {
    let mut containing: Vec<&str> = units
        .iter()
        .map(String::as_str)
        .filter(|u| fqn::is_under(clean, u))
        .collect();
    containing.sort_by_key(|u| if u.is_empty() { 0 } else { u.len() + 1 });
    let mut out = String::new();
    let mut done = 0usize; // bytes of `clean` already emitted
    for unit in containing {
        let cut = if unit.is_empty() { 0 } else { unit.len() + 1 };
        out.push_str(&clean[done..cut]);
        out.push_str(fqn::FSDP_WRAPPED_MODULE);
        out.push('.');
        done = cut;
    }
    out.push_str(&clean[done..]);
    out
}

/// The raw FSDP1 name of the flat parameter of `unit`.
pub fn fsdp1_flat_param_raw_name(unit: &str, units: &[String]) -> String {
    // The flat parameter sits inside the unit's wrapped module: name it as a pseudo-parameter of
    // the unit, then the unit's own wrapper is the innermost one inserted.
    let pseudo = fqn::join(unit, fqn::FLAT_PARAM);
    fsdp1_raw_name(&pseudo, units)
}

struct Builder {
    params: Vec<ParamRow>,
    by_fqn: HashMap<String, usize>,
}

impl Builder {
    fn new(model: &ModelDescription, api: shardscope_core::layout::Api, world_size: u64) -> Self {
        let mut params = Vec::with_capacity(model.params.len());
        let mut by_fqn = HashMap::with_capacity(model.params.len());
        for (slot, p) in model.params.iter().enumerate() {
            let raw_name = match api {
                shardscope_core::layout::Api::Fsdp1 => fsdp1_raw_name(&p.fqn, &model.units),
                shardscope_core::layout::Api::Fsdp2 => p.fqn.clone(),
            };
            let status = if model.ignored.contains(&p.fqn) {
                ParamStatus::Ignored
            } else if p.shared_with.is_some() {
                ParamStatus::Alias
            } else {
                ParamStatus::Unmanaged
            };
            by_fqn.insert(p.fqn.clone(), params.len());
            params.push(ParamRow {
                fqn: p.fqn.clone(),
                raw_name,
                unit: None,
                flat_param: None,
                flat_range: None,
                shape: p.shape.clone(),
                dtype: p.dtype,
                numel: p.numel(),
                status,
                shared_with: p.shared_with.clone(),
                ranks: (0..world_size).collect(),
                color_slot: slot,
                chunks: Vec::new(),
                padded_rows: None,
            });
        }
        Self { params, by_fqn }
    }

    /// Marks a managed parameter, or returns its index if known.
    fn managed(&mut self, fqn: &str, unit: &str) -> Option<usize> {
        let &i = self.by_fqn.get(fqn)?;
        let row = &mut self.params[i];
        row.unit = Some(unit.to_owned());
        if row.status == ParamStatus::Unmanaged {
            row.status = ParamStatus::Sharded;
        }
        row.ranks.clear();
        Some(i)
    }

    /// Gives tied aliases the placement of their primary.
    fn resolve_aliases(&mut self) {
        for i in 0..self.params.len() {
            if self.params[i].status != ParamStatus::Alias {
                continue;
            }
            let Some(primary) = self.params[i]
                .shared_with
                .as_ref()
                .and_then(|p| self.by_fqn.get(p))
                .copied()
            else {
                continue;
            };
            let p = self.params[primary].clone();
            let row = &mut self.params[i];
            row.unit.clone_from(&p.unit);
            row.flat_param.clone_from(&p.flat_param);
            row.flat_range = p.flat_range;
            row.ranks.clone_from(&p.ranks);
            row.chunks.clone_from(&p.chunks);
            row.padded_rows = p.padded_rows;
            row.color_slot = p.color_slot;
        }
    }
}

fn replicated_bytes(params: &[ParamRow]) -> u64 {
    params
        .iter()
        .filter(|p| p.status == ParamStatus::Unmanaged)
        .map(ParamRow::bytes)
        .sum()
}

pub(crate) fn totals(units: &[UnitView], shard_group_size: u64, replicated: u64) -> Vec<RankTotal> {
    let mut totals: Vec<RankTotal> = (0..shard_group_size)
        .map(|rank| RankTotal {
            rank,
            replicated_bytes: replicated,
            ..RankTotal::default()
        })
        .collect();
    for unit in units {
        for bar in &unit.ranks {
            if let Some(t) = totals.get_mut(bar.rank as usize) {
                t.real_bytes += bar.real_bytes;
                t.align_pad_bytes += bar.align_pad_bytes;
                t.tail_pad_bytes += bar.tail_pad_bytes;
            }
        }
    }
    totals
}

#[allow(
    clippy::too_many_lines,
    reason = "builds every FSDP1 row kind (parameters, padding, flat parameters) in one pass over the layout"
)]
fn from_fsdp1(model: &ModelDescription, layout: &Fsdp1Layout) -> LayoutView {
    let mut b = Builder::new(
        model,
        shardscope_core::layout::Api::Fsdp1,
        layout.world_size,
    );
    let mut units = Vec::with_capacity(layout.flat_params.len());
    for flat in &layout.flat_params {
        let itemsize = flat.dtype.size_bytes() as u64;
        // With use_orig_params the flat parameter is not registered, but its name is still the key
        // of LOCAL state dicts, so show it either way.
        let flat_raw = fsdp1_flat_param_raw_name(&flat.unit_prefix, &model.units);
        let starts = flat.segment_starts();
        let mut param_ids = Vec::with_capacity(flat.fqns.len());
        let mut real_index = 0usize;
        for (seg, &pad) in flat.is_padding_mask.iter().enumerate() {
            if pad {
                continue;
            }
            let name = &flat.fqns[real_index];
            if let Some(i) = b.managed(name, &flat.unit_prefix) {
                let row = &mut b.params[i];
                row.flat_param = Some(flat_raw.clone());
                row.flat_range = Some((starts[seg], starts[seg] + flat.numels_with_padding[seg]));
                param_ids.push(i);
            }
            real_index += 1;
        }
        let mut ranks = Vec::with_capacity(flat.ranks.len());
        for shard in &flat.ranks {
            let mut bar = RankBar {
                rank: shard.rank,
                ..RankBar::default()
            };
            for piece in flat.rank_pieces(shard.rank) {
                let kind = match piece.kind {
                    PieceKind::Param { param, intra_start } => {
                        let Some(&id) = param_ids.get(param) else {
                            continue;
                        };
                        bar.real_bytes += piece.numel * itemsize;
                        let row = &mut b.params[id];
                        if row.ranks.last() != Some(&shard.rank) {
                            row.ranks.push(shard.rank);
                        }
                        row.chunks.push(ParamChunk {
                            rank: shard.rank,
                            start: intra_start,
                            end: intra_start + piece.numel,
                            padding_numel: 0,
                        });
                        SegKind::Param {
                            param: id,
                            intra_start,
                        }
                    }
                    PieceKind::SegmentPadding => {
                        bar.align_pad_bytes += piece.numel * itemsize;
                        SegKind::AlignPad
                    }
                    PieceKind::ShardTail => {
                        bar.tail_pad_bytes += piece.numel * itemsize;
                        SegKind::TailPad { param: None }
                    }
                };
                bar.segs.push(Seg {
                    x_bytes: piece.offset_in_shard * itemsize,
                    len_bytes: piece.numel * itemsize,
                    offset_in_shard: piece.offset_in_shard,
                    numel: piece.numel,
                    kind,
                });
            }
            ranks.push(bar);
        }
        let pads = flat.padding_segment_numel();
        let summary = format!(
            "{} params, {} elements + {} padding = {}, shard {} x {} ranks ({})",
            flat.fqns.len(),
            flat.numels.iter().sum::<u64>(),
            pads,
            flat.unpadded_unsharded_numel,
            flat.sharded_numel,
            flat.ranks.len(),
            flat.dtype
        );
        units.push(UnitView {
            prefix: flat.unit_prefix.clone(),
            flat_param: Some(flat_raw),
            bar_bytes: flat.sharded_numel * itemsize,
            ranks,
            params: param_ids,
            summary,
        });
    }
    b.resolve_aliases();
    let rank_totals = totals(&units, layout.shard_group_size, replicated_bytes(&b.params));
    LayoutView {
        generation: 0,
        api_label: "FSDP1",
        world_size: layout.world_size,
        shard_group_size: layout.shard_group_size,
        strategy_label: layout.strategy.name().to_owned(),
        units,
        params: b.params,
        by_fqn: b.by_fqn,
        rank_totals,
        notes: layout.notes.clone(),
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "builds every FSDP2 row kind (parameters, padding, local shards) in one pass over the layout"
)]
fn from_fsdp2(model: &ModelDescription, layout: &Fsdp2Layout) -> LayoutView {
    let mut b = Builder::new(
        model,
        shardscope_core::layout::Api::Fsdp2,
        layout.world_size,
    );
    let n = layout.shard_group_size;
    let mut units = Vec::with_capacity(layout.units.len());
    for unit in &layout.units {
        let mut ranks: Vec<RankBar> = (0..n)
            .map(|rank| RankBar {
                rank,
                ..RankBar::default()
            })
            .collect();
        let mut param_ids = Vec::with_capacity(unit.params.len());
        let mut x = 0u64;
        for p in &unit.params {
            let Some(id) = b.managed(&p.fqn, &unit.unit_prefix) else {
                continue;
            };
            param_ids.push(id);
            let itemsize = p.dtype.size_bytes() as u64;
            let row_len: u64 = p.shape.iter().skip(1).product();
            let padded_numel = p.padded_sharded_numel();
            b.params[id].padded_rows = p.padded_sharded_shape.first().copied();
            for shard in &p.ranks {
                let local: u64 = shard.local_shape.iter().product();
                let start = shard.global_offset.first().copied().unwrap_or(0) * row_len;
                let bar = &mut ranks[shard.rank as usize];
                let pad = padded_numel.saturating_sub(local);
                let row = &mut b.params[id];
                row.chunks.push(ParamChunk {
                    rank: shard.rank,
                    start,
                    end: start + local,
                    padding_numel: pad,
                });
                if local > 0 {
                    row.ranks.push(shard.rank);
                    bar.segs.push(Seg {
                        x_bytes: x,
                        len_bytes: local * itemsize,
                        offset_in_shard: 0,
                        numel: local,
                        kind: SegKind::Param {
                            param: id,
                            intra_start: start,
                        },
                    });
                    bar.real_bytes += local * itemsize;
                }
                if pad > 0 {
                    bar.segs.push(Seg {
                        x_bytes: x + local * itemsize,
                        len_bytes: pad * itemsize,
                        offset_in_shard: local,
                        numel: pad,
                        kind: SegKind::TailPad { param: Some(id) },
                    });
                    bar.tail_pad_bytes += pad * itemsize;
                }
            }
            x += padded_numel * itemsize;
        }
        let summary = format!(
            "{} params, all-gather input {} elements per rank, mesh {:?}",
            unit.params.len(),
            unit.all_gather_input_numel,
            layout.mesh_shape
        );
        units.push(UnitView {
            prefix: unit.unit_prefix.clone(),
            flat_param: None,
            bar_bytes: x,
            ranks,
            params: param_ids,
            summary,
        });
    }
    b.resolve_aliases();
    let rank_totals = totals(&units, n, replicated_bytes(&b.params));
    let strategy_label = if layout.mesh_shape.len() == 2 {
        format!(
            "HSDP mesh {}x{}",
            layout.mesh_shape[0], layout.mesh_shape[1]
        )
    } else {
        "Shard(0)".to_owned()
    };
    LayoutView {
        generation: 0,
        api_label: "FSDP2",
        world_size: layout.world_size,
        shard_group_size: n,
        strategy_label,
        units,
        params: b.params,
        by_fqn: b.by_fqn,
        rank_totals,
        notes: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn raw_names_insert_the_wrapper_after_every_unit() {
        let units = vec![
            String::new(),
            "block1".to_owned(),
            "block1.inner".to_owned(),
        ];
        assert_eq!(
            fsdp1_raw_name("block1.inner.w", &units),
            "_fsdp_wrapped_module.block1._fsdp_wrapped_module.inner._fsdp_wrapped_module.w"
        );
        assert_eq!(
            fsdp1_raw_name("scale", &units),
            "_fsdp_wrapped_module.scale"
        );
        assert_eq!(
            fsdp1_flat_param_raw_name("block1", &units),
            "_fsdp_wrapped_module.block1._fsdp_wrapped_module._flat_param"
        );
        // Not wrapped at all: the clean name.
        assert_eq!(fsdp1_raw_name("x.y", &["z".to_owned()]), "x.y");
    }

    #[test]
    fn imbalance_is_max_over_mean() {
        assert!((imbalance([4u64, 4, 4, 0].into_iter()) - (4.0 / 3.0 - 1.0)).abs() < 1e-12);
        assert!(imbalance(std::iter::empty()).abs() < f64::EPSILON);
    }
}
