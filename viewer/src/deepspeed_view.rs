//! The shard map of a DeepSpeed ZeRO checkpoint as it was saved: the view model ([`LayoutView`])
//! of its ranks' fp32 flat partitions (`core`'s [`Partitions`], DeepSpeed's partition math). A
//! unit per flat group (ZeRO-1/2: a parameter group; ZeRO-3: a sub-group), a bar per rank, a
//! segment per parameter piece, and the padding between as padding: ZeRO-1/2 alignment padding
//! (`param_alignment_paddings`) as alignment padding, ZeRO-3's padding of each parameter's last
//! part as the tail padding of that parameter. The FSDP layout controls do not change it.

use std::collections::HashMap;

use shardscope_core::index::deepspeed_partitions::{Partitions, RunKind};

use crate::view::{
    LayoutView, ParamChunk, ParamRow, ParamStatus, RankBar, Seg, SegKind, UnitView, totals,
};

/// [`LayoutView::api_label`] of a DeepSpeed checkpoint's partitions.
pub const DEEPSPEED_LABEL: &str = "DeepSpeed";

/// The unit name of flat group `g`.
fn group_name(g: usize) -> String {
    format!("fp32 group {g}")
}

/// A row per trainable parameter, placed by [`group_unit`]; the index of each name.
fn param_rows(p: &Partitions) -> (Vec<ParamRow>, HashMap<String, usize>) {
    let mut params: Vec<ParamRow> = Vec::with_capacity(p.params.len() + p.ties.len());
    let mut by_fqn = HashMap::with_capacity(p.params.len() + p.ties.len());
    for (slot, q) in p.params.iter().enumerate() {
        by_fqn.insert(q.name.clone(), params.len());
        params.push(ParamRow {
            fqn: q.name.clone(),
            raw_name: q.name.clone(),
            unit: None,
            flat_param: None,
            flat_range: None,
            shape: q.shape.clone(),
            dtype: shardscope_core::DType::Float32,
            numel: q.shape.iter().product(),
            status: ParamStatus::Sharded,
            shared_with: None,
            ranks: Vec::new(),
            color_slot: slot,
            chunks: Vec::new(),
            padded_rows: None,
        });
    }
    (params, by_fqn)
}

/// The unit of flat group `g`: a bar per rank, its runs as segments; records each piece in the
/// parameter's row.
fn group_unit(p: &Partitions, g: usize, params: &mut [ParamRow]) -> UnitView {
    let first = p.ranks.iter().find_map(|r| r.groups.get(g));
    let dtype = first.map_or(shardscope_core::DType::Float32, |f| f.dtype);
    let key = first.map(|f| f.key.clone());
    let itemsize = dtype.size_bytes() as u64;
    let name = group_name(g);
    let mut unit_params = Vec::new();
    let mut ranks = Vec::with_capacity(p.ranks.len());
    let (mut real, mut padding) = (0u64, 0u64);
    let mut lens = Vec::with_capacity(p.ranks.len());
    for r in &p.ranks {
        let mut bar = RankBar {
            rank: u64::from(r.rank),
            ..RankBar::default()
        };
        let flat = r.groups.get(g);
        lens.push(flat.map_or(0, |f| f.numel));
        for run in flat.map_or(&[][..], |f| f.runs.as_slice()) {
            let bytes = run.numel.saturating_mul(itemsize);
            let kind = match run.kind {
                RunKind::Param { param, start } => {
                    let Some(row) = params.get_mut(param) else {
                        continue;
                    };
                    row.unit = Some(name.clone());
                    row.flat_param.clone_from(&key);
                    row.dtype = dtype;
                    if row.ranks.last() != Some(&bar.rank) {
                        row.ranks.push(bar.rank);
                    }
                    row.chunks.push(ParamChunk {
                        rank: bar.rank,
                        start,
                        end: start.saturating_add(run.numel),
                        padding_numel: 0,
                    });
                    if !unit_params.contains(&param) {
                        unit_params.push(param);
                    }
                    bar.real_bytes += bytes;
                    real += run.numel;
                    SegKind::Param {
                        param,
                        intra_start: start,
                    }
                }
                RunKind::Padding { after } if p.stage == 3 => {
                    bar.tail_pad_bytes += bytes;
                    padding += run.numel;
                    SegKind::TailPad { param: after }
                }
                RunKind::Padding { .. } => {
                    bar.align_pad_bytes += bytes;
                    padding += run.numel;
                    SegKind::AlignPad
                }
            };
            bar.segs.push(Seg {
                x_bytes: run.at.saturating_mul(itemsize),
                len_bytes: bytes,
                offset_in_shard: run.at,
                numel: run.numel,
                kind,
            });
        }
        ranks.push(bar);
    }
    let longest = lens.iter().copied().max().unwrap_or(0);
    let summary = format!(
        "{} params, {real} elements + {padding} padding, partitions of {} elements ({dtype})",
        unit_params.len(),
        lens.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" / "),
    );
    UnitView {
        prefix: name,
        flat_param: key,
        bar_bytes: longest.saturating_mul(itemsize),
        ranks,
        params: unit_params,
        summary,
    }
}

impl LayoutView {
    /// The view of a DeepSpeed ZeRO checkpoint's flat partitions, as saved.
    pub fn from_deepspeed(p: &Partitions) -> Self {
        let groups = p.ranks.iter().map(|r| r.groups.len()).max().unwrap_or(0);
        let (mut params, mut by_fqn) = param_rows(p);
        let units: Vec<UnitView> = (0..groups).map(|g| group_unit(p, g, &mut params)).collect();
        // Tied names: no elements of their own, drawn where the name they are tied to is.
        for (alias, name) in &p.ties {
            let Some(&primary) = by_fqn.get(name) else {
                continue;
            };
            if by_fqn.contains_key(alias) {
                continue;
            }
            let mut row = params[primary].clone();
            row.fqn.clone_from(alias);
            row.raw_name.clone_from(alias);
            row.status = ParamStatus::Alias;
            row.shared_with = Some(name.clone());
            by_fqn.insert(alias.clone(), params.len());
            params.push(row);
        }
        let rank_totals = totals(&units, p.world_size, 0);
        let mut notes = vec![format!(
            "DeepSpeed ZeRO-{}: the fp32 partitions as saved (controls do not apply)",
            p.stage
        )];
        if p.stage <= 2 {
            notes.push("a last rank's shorter bar: saved without the group padding".to_owned());
        }
        LayoutView {
            generation: 0,
            api_label: DEEPSPEED_LABEL,
            world_size: p.world_size,
            shard_group_size: p.world_size,
            strategy_label: format!("ZeRO-{}", p.stage),
            units,
            params,
            by_fqn,
            rank_totals,
            notes,
        }
    }

    /// Whether this is the view of a DeepSpeed checkpoint's partitions.
    pub fn is_deepspeed(&self) -> bool {
        self.api_label == DEEPSPEED_LABEL
    }
}
