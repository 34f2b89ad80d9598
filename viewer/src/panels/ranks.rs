//! Per-rank totals over the whole model: real bytes, padding, replicated (unmanaged) bytes, and the
//! imbalance between ranks.

use egui::{Pos2, Rect, Sense, Ui, Vec2};
use egui_extras::{Column, TableBuilder};

use crate::format::bytes as fmt_bytes;
use crate::theme::{Hatch, Theme, hatch};
use crate::view::LayoutView;

/// The headline of the panel (also used by tests).
pub fn summary(view: &LayoutView) -> String {
    let (align, tail) = view.padding_totals();
    format!(
        "{} ranks per shard group · imbalance {:.1}% · padding {} alignment + {} shard tail",
        view.shard_group_size,
        view.imbalance() * 100.0,
        fmt_bytes(align),
        fmt_bytes(tail)
    )
}

/// Draws the table.
pub fn ui(ui: &mut Ui, view: &LayoutView, theme: Theme) {
    ui.label(summary(view));
    if view.replica_groups() > 1 {
        ui.weak(format!(
            "Hybrid sharding: the {} shard groups hold identical shards; rank r of every group matches rank r below.",
            view.replica_groups()
        ));
    }
    let max_total = view
        .rank_totals
        .iter()
        .map(crate::view::RankTotal::total_bytes)
        .max()
        .unwrap_or(1)
        .max(1);
    TableBuilder::new(ui)
        .id_salt("ranks_table")
        .striped(true)
        .column(Column::exact(60.0))
        .column(Column::initial(90.0))
        .column(Column::initial(90.0))
        .column(Column::initial(90.0))
        .column(Column::initial(90.0))
        .column(Column::remainder().at_least(120.0))
        .header(20.0, |mut h| {
            for title in [
                "rank",
                "params",
                "align pad",
                "tail pad",
                "replicated",
                "share of the largest rank",
            ] {
                h.col(|ui| {
                    ui.strong(title);
                });
            }
        })
        .body(|body| {
            body.rows(18.0, view.rank_totals.len(), |mut row| {
                let t = view.rank_totals[row.index()];
                row.col(|ui| {
                    ui.label(t.rank.to_string());
                });
                row.col(|ui| {
                    ui.label(fmt_bytes(t.real_bytes));
                });
                row.col(|ui| {
                    ui.label(fmt_bytes(t.align_pad_bytes));
                });
                row.col(|ui| {
                    ui.label(fmt_bytes(t.tail_pad_bytes));
                });
                row.col(|ui| {
                    ui.label(fmt_bytes(t.replicated_bytes));
                });
                row.col(|ui| {
                    let w = ui.available_width();
                    let (rect, _) = ui.allocate_exact_size(Vec2::new(w, 12.0), Sense::hover());
                    let scale = w / max_total as f32;
                    let mut x = rect.left();
                    let mut part = |bytes: u64, draw: &dyn Fn(Rect)| {
                        let wpx = bytes as f32 * scale;
                        if wpx > 0.0 {
                            draw(Rect::from_min_size(
                                Pos2::new(x, rect.top()),
                                Vec2::new(wpx, rect.height()),
                            ));
                        }
                        x += wpx;
                    };
                    let p = ui.painter();
                    part(t.real_bytes, &|r| {
                        p.rect_filled(r, 0.0, theme.param_color(0));
                    });
                    part(t.replicated_bytes, &|r| {
                        p.rect_filled(r, 0.0, theme.dense_fill());
                    });
                    part(t.align_pad_bytes, &|r| {
                        hatch(
                            p,
                            r,
                            theme.align_pad_fill(),
                            theme.align_pad_line(),
                            Hatch::Forward,
                            5.0,
                        );
                    });
                    part(t.tail_pad_bytes, &|r| {
                        hatch(
                            p,
                            r,
                            theme.tail_pad_fill(),
                            theme.tail_pad_line(),
                            Hatch::Backward,
                            5.0,
                        );
                    });
                });
            });
        });
}
