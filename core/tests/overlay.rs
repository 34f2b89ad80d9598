//! `view::overlay::compare` on checkpoints torch wrote with a known configuration: at that
//! configuration every stored piece matches the computed layout; at another one the differences
//! are reported. The expected per-rank pieces come from torch's own reports (the generators'
//! `expected/` files), not from our layout code.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_core::layout::{self, Api, LayoutConfig, Strategy};
use shardscope_core::source::MemorySource;
use shardscope_core::view::overlay::{ElementRange, Overlay, compare};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files of `dir` whose names pass `keep`, in memory.
fn source(dir: &Path, keep: impl Fn(&str) -> bool) -> MemorySource {
    let mut src = MemorySource::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_file() && keep(&name) {
            src.insert(name, std::fs::read(&p).unwrap());
        }
    }
    src
}

/// Opens the checkpoint, derives its model as the viewer does, lays out `config`, compares.
fn overlay(src: &MemorySource, config: &LayoutConfig) -> Overlay {
    let ckpt = Checkpoint::open(src, "fixture", &ReadOptions::default()).unwrap();
    let auto = ckpt.describe_auto(src).unwrap();
    let model = auto.described.derived.model;
    let layout = layout::compute(&model, config).unwrap();
    compare(&ckpt.index, &ckpt.hints, &layout, auto.select)
}

fn fsdp2(world_size: u64, shard_group_size: Option<u64>) -> LayoutConfig {
    LayoutConfig {
        api: Api::Fsdp2,
        world_size,
        shard_group_size,
        strategy: if shard_group_size.is_some_and(|k| k != world_size) {
            Strategy::HybridShard
        } else {
            Strategy::FullShard
        },
        ..LayoutConfig::default()
    }
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn u64s(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Stored ranges per (fqn, rank) that the overlay found.
fn stored(o: &Overlay) -> BTreeMap<(String, u64), Vec<ElementRange>> {
    let mut out = BTreeMap::new();
    for p in &o.params {
        for r in &p.ranks {
            let mut all: Vec<ElementRange> = r.matched.iter().chain(&r.extra).copied().collect();
            all.sort_unstable();
            if !all.is_empty() {
                out.insert((p.fqn.clone(), r.rank), all);
            }
        }
    }
    out
}

fn assert_matches(o: &Overlay) {
    assert!(o.applicable);
    assert!(!o.params.is_empty());
    assert_eq!(o.difference_count(), 0, "{}: {o:#?}", o.summary());
    assert!(
        o.summary().starts_with("stored chunks match the layout"),
        "{}",
        o.summary()
    );
}

fn assert_differs(o: &Overlay, config_differences: usize) {
    let (extra, missing) = o.piece_differences();
    assert!(extra > 0 && missing > 0, "{}", o.summary());
    assert_eq!(
        o.config_differences.len(),
        config_differences,
        "{:?}",
        o.config_differences
    );
    assert!(o.summary().contains(" differences: "), "{}", o.summary());
}

#[test]
fn fsdp2_per_rank_files_match_at_their_world_size() {
    let f = root().join("tests/fixtures/formats");
    let src = source(&f.join("fsdp2"), |n| n.ends_with("_model.pt"));
    let o = overlay(&src, &fsdp2(2, None));
    assert_matches(&o);
    // torch's own report of every rank's DTensor local shape (gen_formats.py `describe`): with
    // Shard(0), rank r's rows follow those of ranks < r.
    let mut want: BTreeMap<(String, u64), Vec<ElementRange>> = BTreeMap::new();
    let mut next_row: BTreeMap<String, u64> = BTreeMap::new();
    for rank in 0..2u64 {
        let e = json(&f.join(format!("expected/fsdp2__rank{rank}_model.json")));
        for (key, v) in e["entries"].as_object().unwrap() {
            if v["kind"] != "dtensor" {
                continue;
            }
            let global = u64s(&v["global_shape"]);
            let local = u64s(&v["local_shape"]);
            let row: u64 = global[1..].iter().product();
            let start = next_row.entry(key.clone()).or_insert(0);
            if local[0] > 0 {
                want.insert(
                    (key.clone(), rank),
                    vec![(*start * row, (*start + local[0]) * row)],
                );
            }
            *start += local[0];
        }
    }
    assert_eq!(stored(&o), want);
    // Viewed at another world size, every parameter's pieces move.
    let o = overlay(&src, &fsdp2(3, None));
    assert_differs(&o, 1);
    assert!(o.config_differences[0].starts_with("world size 2 in the checkpoint"));
    // And as FSDP1 the API differs (the pieces do not: FSDP1 SHARDED chunks dim 0 the same way).
    let o = overlay(
        &src,
        &LayoutConfig {
            world_size: 2,
            ..LayoutConfig::default()
        },
    );
    assert_eq!(o.piece_differences(), (0, 0));
    assert_eq!(o.config_differences.len(), 1);
    assert!(o.config_differences[0].starts_with("API FSDP2 in the checkpoint"));
}

#[test]
fn dcp_chunks_match_torch_metadata() {
    let f = root().join("tests/fixtures/formats");
    let src = source(&f.join("dcp_torch_save"), |_| true);
    let o = overlay(&src, &fsdp2(2, None));
    assert_matches(&o);
    // torch's dump of `.metadata` (gen_formats.py): each chunk's offsets/sizes and the file that
    // holds it (`__{rank}_0.distcp`).
    let meta = json(&f.join("expected/dcp_torch_save_metadata.json"));
    let mut rank_of: BTreeMap<(String, Vec<u64>), u64> = BTreeMap::new();
    for s in meta["storage"].as_array().unwrap() {
        if !s["offset"].is_array() {
            continue; // bytes items
        }
        let file = s["relative_path"].as_str().unwrap();
        let rank: u64 = file[2..file.find("_0.").unwrap()].parse().unwrap();
        rank_of.insert(
            (s["fqn"].as_str().unwrap().to_owned(), u64s(&s["offset"])),
            rank,
        );
    }
    let mut want: BTreeMap<(String, u64), Vec<ElementRange>> = BTreeMap::new();
    let compared: Vec<String> = o.params.iter().map(|p| p.fqn.clone()).collect();
    for fqn in &compared {
        let item = &meta["items"][format!("model.{fqn}")];
        let size = u64s(&item["size"]);
        let row: u64 = size[1..].iter().product();
        for c in item["chunks"].as_array().unwrap() {
            let (off, sizes) = (u64s(&c["offsets"]), u64s(&c["sizes"]));
            assert!(off[1..].iter().all(|&o| o == 0), "dim-0 chunks only");
            let rank = rank_of[&(format!("model.{fqn}"), off.clone())];
            want.entry((fqn.clone(), rank))
                .or_default()
                .push((off[0] * row, (off[0] + sizes[0]) * row));
        }
    }
    assert_eq!(stored(&o), want);
    assert_differs(&overlay(&src, &fsdp2(4, None)), 1);
}

#[test]
fn the_fsdp2_dcp_example_matches_at_two_ranks_only() {
    let src = source(&root().join("examples/fsdp2_dcp"), |_| true);
    assert_matches(&overlay(&src, &fsdp2(2, None)));
    assert_differs(&overlay(&src, &fsdp2(4, None)), 1);
}

#[test]
fn hsdp_files_match_their_2x2_mesh() {
    // gen_fsdp2_hsdp.py: 4 ranks, mesh (replicate 2, shard 2), every rank saves its state dict.
    let src = source(&root().join("tests/fixtures/fsdp2_hsdp/ws4_2x2"), |n| {
        n.ends_with("_model.pt")
    });
    let o = overlay(&src, &fsdp2(4, Some(2)));
    assert_matches(&o);
    // Ranks r and r + 2 are replicas: the same pieces.
    let s = stored(&o);
    for ((fqn, rank), ranges) in &s {
        if *rank < 2 {
            assert_eq!(
                s.get(&(fqn.clone(), rank + 2)),
                Some(ranges),
                "{fqn} rank {rank}"
            );
        }
    }
    // Sharded over all 4 ranks instead of groups of 2: pieces differ, and so does the group.
    let o = overlay(&src, &fsdp2(4, None));
    assert_differs(&o, 1);
    assert!(o.config_differences[0].starts_with("shard group of 2 ranks"));
}

#[test]
fn fsdp1_sharded_tensors_match_the_torch_shard_table() {
    let f = root().join("tests/fixtures/formats");
    let src = source(&f.join("fsdp1_orig0"), |n| n.ends_with("_sharded.pt"));
    let fsdp1 = |world_size| LayoutConfig {
        world_size,
        ..LayoutConfig::default()
    };
    let o = overlay(&src, &fsdp1(2));
    assert_matches(&o);
    // torch's ShardedTensor shard table (gen_formats.py `describe`): offsets, sizes, `rank:R/cpu`.
    let e = json(&f.join("expected/fsdp1_orig0__rank0_sharded.json"));
    let mut want: BTreeMap<(String, u64), Vec<ElementRange>> = BTreeMap::new();
    for (key, v) in e["entries"].as_object().unwrap() {
        if v["kind"] != "sharded_tensor" {
            continue;
        }
        let global = u64s(&v["global_shape"]);
        let row: u64 = global[1..].iter().product();
        for s in v["shards"].as_array().unwrap() {
            let off = u64s(&s["offsets"]);
            let sizes = u64s(&s["sizes"]);
            let place = s["placement"].as_str().unwrap();
            let rank: u64 = place["rank:".len()..place.find('/').unwrap()]
                .parse()
                .unwrap();
            want.insert(
                (key.clone(), rank),
                vec![(off[0] * row, (off[0] + sizes[0]) * row)],
            );
        }
    }
    assert_eq!(stored(&o), want);
    assert_differs(&overlay(&src, &fsdp1(4)), 1);
}
