//! Computed vs stored in the shard map: every difference of [`Overlay`] (elements a rank stores
//! that the layout does not give it, elements the layout gives a rank that it does not store)
//! placed where those elements are drawn, on the rank bars of the layout. A difference is drawn
//! on the bar of the rank it concerns when that bar holds the elements (a missing piece), else
//! on the bar that does hold them in the layout (a piece stored by the wrong rank), naming the
//! rank; elements the layout draws nowhere are counted, not drawn.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use shardscope_core::view::overlay::{ElementRange, Overlay};

use crate::view::{LayoutView, SegKind};

/// The most marks kept (a chunk cut on an inner dimension is one range per row).
pub const MAX_MARKS: usize = 100_000;

/// What a mark says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MarkKind {
    /// Rank `rank` stores these elements; the layout does not give them to it.
    Extra { rank: u64 },
    /// The layout gives these elements to rank `rank`; no chunk of it stores them.
    Missing { rank: u64 },
}

/// One difference at its place in the map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// Index into [`LayoutView::units`], and of the rank bar in the unit.
    pub unit: usize,
    pub rank_index: usize,
    /// Where on the bar, in bytes (as [`crate::view::Seg`]).
    pub x_bytes: u64,
    pub len_bytes: u64,
    pub kind: MarkKind,
    /// The parameter and its flattened elements `[start, end)`.
    pub fqn: String,
    pub elements: ElementRange,
}

impl Mark {
    /// For people: `rank 3 stores model.w elements 8..16, not in the layout for it`.
    pub fn describe(&self) -> String {
        let (a, b) = self.elements;
        match self.kind {
            MarkKind::Extra { rank } => format!(
                "rank {rank} stores {} elements {a}..{b}: the layout gives them to another rank",
                self.fqn
            ),
            MarkKind::Missing { rank } => format!(
                "rank {rank} stores no chunk with {} elements {a}..{b}: the layout gives them to it",
                self.fqn
            ),
        }
    }
}

/// Every difference placed on the map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapMarks {
    /// The marks of each `(unit, rank bar)`.
    pub rows: BTreeMap<(usize, usize), Vec<Mark>>,
    /// Marks in all.
    pub count: usize,
    /// Differences not drawn: elements the map draws nowhere, or past [`MAX_MARKS`].
    pub unplaced: usize,
    /// Extra and missing ranges over all ranks (drawn or not).
    pub extra: usize,
    pub missing: usize,
}

impl MapMarks {
    /// The marks on one rank bar.
    pub fn row(&self, unit: usize, rank_index: usize) -> &[Mark] {
        self.rows
            .get(&(unit, rank_index))
            .map_or(&[], Vec::as_slice)
    }

    /// Every mark, bar by bar.
    pub fn marks(&self) -> impl Iterator<Item = &Mark> {
        self.rows.values().flatten()
    }

    /// `2 extra, 3 missing pieces marked` (and how many were not drawn).
    pub fn summary(&self) -> String {
        let mut s = format!(
            "computed vs stored: {} extra, {} missing pieces marked",
            self.extra, self.missing
        );
        if self.unplaced > 0 {
            let _ = write!(s, " ({} not drawn)", self.unplaced);
        }
        s
    }
}

/// One parameter slice drawn on a bar.
struct Slice {
    unit: usize,
    rank_index: usize,
    bar_rank: u64,
    elements: ElementRange,
    x_bytes: u64,
    bytes_per_element: u64,
}

/// Places the differences of `overlay` on the bars of `view`.
pub fn place(view: &LayoutView, overlay: &Overlay) -> MapMarks {
    // Where each parameter's elements are drawn.
    let mut slices: BTreeMap<usize, Vec<Slice>> = BTreeMap::new();
    for (u, unit) in view.units.iter().enumerate() {
        for (ri, bar) in unit.ranks.iter().enumerate() {
            for seg in &bar.segs {
                if let SegKind::Param { param, intra_start } = seg.kind
                    && seg.numel > 0
                {
                    slices.entry(param).or_default().push(Slice {
                        unit: u,
                        rank_index: ri,
                        bar_rank: bar.rank,
                        elements: (intra_start, intra_start.saturating_add(seg.numel)),
                        x_bytes: seg.x_bytes,
                        bytes_per_element: seg.len_bytes / seg.numel,
                    });
                }
            }
        }
    }
    // A parameter's slices are disjoint runs of its elements (each drawn once per shard group),
    // collected in rank order, which is element order for FSDP1 and FSDP2 shards alike: the ones a
    // range meets are then found by binary search (else by a scan).
    let group = view.shard_group_size.max(1);
    let mut out = MapMarks::default();
    for p in &overlay.params {
        let drawn = view
            .by_fqn
            .get(&p.fqn)
            .and_then(|i| slices.get(i))
            .map_or(&[][..], Vec::as_slice);
        let in_order = drawn.windows(2).all(|w| w[0].elements.1 <= w[1].elements.0);
        for r in &p.ranks {
            out.extra += r.extra.len();
            out.missing += r.missing.len();
            let kinds = r
                .extra
                .iter()
                .map(|e| (MarkKind::Extra { rank: r.rank }, *e))
                .chain(
                    r.missing
                        .iter()
                        .map(|e| (MarkKind::Missing { rank: r.rank }, *e)),
                );
            // The bar of this rank (its shard-group rank), when the layout has the rank.
            let own = (r.rank < view.world_size).then_some(r.rank % group);
            for (kind, range) in kinds {
                // Parts on the rank's own bar first, the rest where the layout draws them.
                let meets = if in_order {
                    let first = drawn.partition_point(|s| s.elements.1 <= range.0);
                    let last = drawn.partition_point(|s| s.elements.0 < range.1);
                    drawn.get(first..last).unwrap_or(&[])
                } else {
                    drawn
                };
                let mut left = vec![range];
                for pass_own in [true, false] {
                    for s in meets {
                        if pass_own != (Some(s.bar_rank) == own) {
                            continue;
                        }
                        let mut rest = Vec::new();
                        for &(a, b) in &left {
                            let (x, y) = (s.elements.0.max(a), s.elements.1.min(b));
                            if x >= y {
                                rest.push((a, b));
                                continue;
                            }
                            if out.count < MAX_MARKS {
                                out.count += 1;
                                out.rows
                                    .entry((s.unit, s.rank_index))
                                    .or_default()
                                    .push(Mark {
                                        unit: s.unit,
                                        rank_index: s.rank_index,
                                        x_bytes: s.x_bytes
                                            + (x - s.elements.0) * s.bytes_per_element,
                                        len_bytes: (y - x) * s.bytes_per_element,
                                        kind,
                                        fqn: p.fqn.clone(),
                                        elements: (x, y),
                                    });
                            } else {
                                out.unplaced += 1;
                            }
                            if a < x {
                                rest.push((a, x));
                            }
                            if y < b {
                                rest.push((y, b));
                            }
                        }
                        left = rest;
                    }
                }
                out.unplaced += left.len();
            }
        }
    }
    out
}
