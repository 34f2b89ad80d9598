//! Every fixture format written by real torch 2.15 (`tests/fixtures/formats/gen_formats.py`) is read
//! and compared with what torch itself wrote down at save time (`expected/*.safetensors`, written
//! by torch from the live objects, and `expected/*.json`): values bit for bit, shapes, shard
//! offsets, placements, non-tensor values, and DCP chunk tables from `FileSystemReader.read_metadata`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use shardscope_core::MemorySource;
use shardscope_core::index::{
    self, CheckpointIndex, CheckpointKind, ChunkEncoding, EntryKind, FsdpInfo, IndexEntry, Role,
};
use shardscope_tests::{fixtures_dir, memory_source};

fn formats() -> PathBuf {
    fixtures_dir().join("formats")
}

/// `expected/<name>.safetensors`: tensor name -> (dtype name, shape, bytes).
fn expected_tensors(name: &str) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(
        formats()
            .join("expected")
            .join(format!("{name}.safetensors")),
    )
    .unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().iter().map(|&d| d as u64).collect(),
                    v.data().to_vec(),
                ),
            )
        })
        .collect()
}

fn expected_json(name: &str) -> Value {
    let text =
        std::fs::read_to_string(formats().join("expected").join(format!("{name}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn st_dtype(d: shardscope_core::DType) -> &'static str {
    use shardscope_core::DType as D;
    match d {
        D::Float32 => "F32",
        D::Float64 => "F64",
        D::Float16 => "F16",
        D::BFloat16 => "BF16",
        D::Int64 => "I64",
        D::Int32 => "I32",
        D::Int8 => "I8",
        D::UInt8 => "U8",
        D::Bool => "BOOL",
        other => panic!("unexpected dtype {other}"),
    }
}

fn slash_path(e: &IndexEntry) -> String {
    e.path
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("/")
}

fn one_file(rel: &str) -> (MemorySource, CheckpointIndex) {
    let path = formats().join(rel);
    let name = path.file_name().unwrap().to_str().unwrap().to_owned();
    let src = MemorySource::new().with(name.clone(), std::fs::read(&path).unwrap());
    let idx = index::index_torch_files(&src, &[name]).unwrap();
    (src, idx)
}

/// Checks one per-rank `torch.save` file against what torch recorded for it.
#[allow(
    clippy::too_many_lines,
    reason = "compares every field torch recorded for a file (keys, dtypes, shapes, storages, views)"
)]
fn check_torch_file(rel: &str) -> CheckpointIndex {
    let (src, idx) = one_file(rel);
    let exp_name = rel.replace('/', "__").trim_end_matches(".pt").to_owned();
    let tensors = expected_tensors(&exp_name);
    let facts = expected_json(&exp_name);
    let by_path: BTreeMap<String, &IndexEntry> =
        idx.entries.iter().map(|e| (slash_path(e), e)).collect();
    let entries = facts["entries"].as_object().unwrap();
    assert_eq!(
        by_path.keys().cloned().collect::<Vec<_>>(),
        entries.keys().cloned().collect::<Vec<_>>(),
        "{rel}: key sets differ"
    );
    let mut compared = 0;
    for (path, fact) in entries {
        let e = by_path[path];
        match fact["kind"].as_str().unwrap() {
            "tensor" => {
                assert_eq!(e.kind, EntryKind::Tensor, "{rel} {path}");
                assert_eq!(e.dtype.unwrap().name(), fact["dtype"], "{rel} {path}");
                let shape: Vec<u64> = serde_json::from_value(fact["shape"].clone()).unwrap();
                assert_eq!(e.shape.as_ref(), Some(&shape), "{rel} {path}");
                assert_eq!(e.chunks.len(), 1);
                let ChunkEncoding::Raw {
                    storage_offset,
                    strides,
                } = &e.chunks[0].encoding
                else {
                    panic!("{rel} {path}: not a raw chunk");
                };
                assert_eq!(
                    *storage_offset,
                    fact["storage_offset"].as_u64().unwrap(),
                    "{rel} {path}"
                );
                let stride: Vec<u64> = serde_json::from_value(fact["stride"].clone()).unwrap();
                assert_eq!(strides, &stride, "{rel} {path}");
                let data = idx.read_chunk(&src, e, &e.chunks[0]).unwrap();
                let (dt, eshape, bytes) = &tensors[path];
                assert_eq!(st_dtype(data.dtype), dt);
                assert_eq!(&data.shape, eshape);
                assert_eq!(&data.bytes, bytes, "{rel} {path}: values differ");
                compared += 1;
            }
            "sharded_tensor" => {
                let global: Vec<u64> =
                    serde_json::from_value(fact["global_shape"].clone()).unwrap();
                assert_eq!(e.shape.as_ref(), Some(&global), "{rel} {path}");
                let Some(FsdpInfo::ShardedTensor { shards }) = &e.fsdp else {
                    panic!("{rel} {path}: no ShardedTensor info")
                };
                let exp_shards = fact["shards"].as_array().unwrap();
                assert_eq!(shards.len(), exp_shards.len());
                for (s, x) in shards.iter().zip(exp_shards) {
                    assert_eq!(serde_json::to_value(&s.offsets).unwrap(), x["offsets"]);
                    assert_eq!(serde_json::to_value(&s.sizes).unwrap(), x["sizes"]);
                    assert_eq!(s.placement.as_deref(), x["placement"].as_str());
                }
                let local = fact["local"].as_array().unwrap();
                assert_eq!(e.chunks.len(), local.len(), "{rel} {path}");
                for (i, (c, l)) in e.chunks.iter().zip(local).enumerate() {
                    assert_eq!(serde_json::to_value(&c.offsets).unwrap(), l["offsets"]);
                    let data = idx.read_chunk(&src, e, c).unwrap();
                    assert_eq!(
                        &data.bytes,
                        &tensors[&format!("{path}#{i}")].2,
                        "{rel} {path}#{i}"
                    );
                    compared += 1;
                }
            }
            "dtensor" => {
                let global: Vec<u64> =
                    serde_json::from_value(fact["global_shape"].clone()).unwrap();
                assert_eq!(e.shape.as_ref(), Some(&global), "{rel} {path}");
                let Some(FsdpInfo::DTensor {
                    placements,
                    mesh_shape,
                }) = &e.fsdp
                else {
                    panic!("{rel} {path}: no DTensor info")
                };
                assert_eq!(
                    serde_json::to_value(placements).unwrap(),
                    fact["placements"],
                    "{rel} {path}"
                );
                assert_eq!(
                    serde_json::to_value(mesh_shape.as_ref().unwrap()).unwrap(),
                    fact["mesh_shape"]
                );
                let c = &e.chunks[0];
                assert_eq!(serde_json::to_value(&c.sizes).unwrap(), fact["local_shape"]);
                let data = idx.read_chunk(&src, e, c).unwrap();
                assert_eq!(&data.bytes, &tensors[path].2, "{rel} {path}: values differ");
                compared += 1;
            }
            "value" => {
                assert_eq!(e.kind, EntryKind::Scalar, "{rel} {path}");
                assert_eq!(e.value.as_ref().unwrap(), &fact["value"], "{rel} {path}");
            }
            other => panic!("unknown kind {other}"),
        }
    }
    assert_eq!(
        compared,
        tensors.len(),
        "{rel}: not every expected tensor was compared"
    );
    idx
}

#[test]
fn plain_torch_save_with_views_offsets_and_dtypes() {
    let idx = check_torch_file("plain/state_dict.pt");
    assert_eq!(idx.kind, CheckpointKind::Plain);
    // The views share `base`'s storage: same byte range, different offsets/strides.
    let base = idx.entry("base").unwrap();
    let t = idx.entry("transposed").unwrap();
    assert_eq!(base.chunks[0].byte_offset, t.chunks[0].byte_offset);
    assert!(idx.check().is_empty());
}

#[test]
fn fsdp1_per_rank_files_match_torch() {
    for orig in [0, 1] {
        for rank in [0, 1] {
            for kind in [
                "full",
                "sharded",
                "local",
                "optim_raw",
                "optim_full",
                "optim_sharded",
            ] {
                check_torch_file(&format!("fsdp1_orig{orig}/rank{rank}_{kind}.pt"));
            }
        }
    }
}

#[test]
fn fsdp2_per_rank_files_match_torch() {
    for rank in [0, 1] {
        for kind in ["model", "optim"] {
            check_torch_file(&format!("fsdp2/rank{rank}_{kind}.pt"));
        }
    }
}

fn group(dir: &str, kind: &str) -> (MemorySource, CheckpointIndex) {
    let mut src = MemorySource::new();
    let mut names = Vec::new();
    for r in [0, 1] {
        let name = format!("rank{r}_{kind}.pt");
        src.insert(
            name.clone(),
            std::fs::read(formats().join(dir).join(&name)).unwrap(),
        );
        names.push(name);
    }
    let idx = index::index_source(&src).unwrap();
    (src, idx)
}

/// Assembling the chunks of both ranks gives torch's full state dict, bit for bit.
#[test]
fn sharded_groups_assemble_to_torch_full_values() {
    for orig in [0, 1] {
        let dir = format!("fsdp1_orig{orig}");
        let full = expected_tensors(&format!("fsdp1_orig{orig}__rank0_full"));
        let (src, idx) = group(&dir, "sharded");
        assert_eq!(idx.kind, CheckpointKind::Fsdp1Sharded);
        assert!(idx.check().is_empty(), "{:?}", idx.check());
        for e in &idx.entries {
            let data = idx.read_tensor(&src, e).unwrap();
            assert_eq!(data.bytes, full[&e.key].2, "{dir} {}", e.key);
        }
        let (_, idx) = group(&dir, "full");
        assert_eq!(idx.kind, CheckpointKind::Fsdp1Full);
        assert!(idx.check().is_empty());
        let (_, idx) = group(&dir, "local");
        assert_eq!(idx.kind, CheckpointKind::Fsdp1Local);
        assert!(idx.entries.iter().any(|e| e.flat_param));
        assert!(idx.check().is_empty(), "{:?}", idx.check());
        let (_, idx) = group(&dir, "optim_raw");
        assert_eq!(idx.kind, CheckpointKind::RankLocal);
        assert!(idx.has_optimizer_state);
        assert!(idx.entries.iter().any(|e| matches!(
            &e.role,
            Some(Role::OptimizerState { param: index::PathSeg::Index(0), state }) if state == "exp_avg"
        )));
        // Sharded optimizer state keyed by FQN assembles to the full optimizer state.
        let full_optim = expected_tensors(&format!("fsdp1_orig{orig}__rank0_optim_full"));
        let (src, idx) = group(&dir, "optim_sharded");
        assert!(idx.check().is_empty(), "{:?}", idx.check());
        for e in idx.entries.iter().filter(|e| e.kind == EntryKind::Tensor) {
            let data = idx.read_tensor(&src, e).unwrap();
            assert_eq!(data.bytes, full_optim[&slash_path(e)].2, "{dir} {}", e.key);
        }
    }
    let (src, idx) = group("fsdp2", "model");
    assert_eq!(idx.kind, CheckpointKind::Fsdp2);
    assert!(idx.check().is_empty(), "{:?}", idx.check());
    let hf = expected_tensors("hf_sharded");
    for e in &idx.entries {
        assert_eq!(
            idx.read_tensor(&src, e).unwrap().bytes,
            hf[&e.key].2,
            "fsdp2 {}",
            e.key
        );
    }
}

fn check_dcp(dir: &str, kind: CheckpointKind) {
    let src = memory_source(&formats().join(dir));
    let idx = index::index_source(&src).unwrap();
    assert_eq!(idx.format, index::Format::Dcp);
    assert_eq!(idx.kind, kind);
    assert!(idx.check().is_empty(), "{:?}", idx.check());
    let full = expected_tensors("dcp");
    let facts = expected_json("dcp");
    let meta = expected_json(&format!("{dir}_metadata"));
    let items = meta["items"].as_object().unwrap();
    assert_eq!(idx.entries.len(), items.len());
    // torch's storage_data, keyed by (fqn, offsets).
    let storage: BTreeMap<(String, String), &Value> = meta["storage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                (
                    s["fqn"].as_str().unwrap().to_owned(),
                    s["offset"].to_string(),
                ),
                s,
            )
        })
        .collect();
    for e in &idx.entries {
        let item = &items[&e.key];
        // Nesting from planner_data, exactly.
        assert_eq!(
            serde_json::to_value(&e.path).unwrap(),
            meta["planner_data"][&e.key],
            "{}",
            e.key
        );
        let p = slash_path(e);
        match e.kind {
            EntryKind::Tensor => {
                assert_eq!(e.dtype.unwrap().name(), item["dtype"]);
                assert_eq!(
                    serde_json::to_value(e.shape.as_ref().unwrap()).unwrap(),
                    item["size"]
                );
                let chunks: Vec<Value> = e
                    .chunks
                    .iter()
                    .map(|c| serde_json::json!({"offsets": c.offsets, "sizes": c.sizes}))
                    .collect();
                assert_eq!(Value::Array(chunks), item["chunks"], "{}", e.key);
                for c in &e.chunks {
                    let s = storage[&(e.key.clone(), serde_json::to_string(&c.offsets).unwrap())];
                    assert_eq!(&*c.file, s["relative_path"].as_str().unwrap());
                    if kind == CheckpointKind::DcpTorchSave {
                        assert_eq!(c.byte_offset, s["byte_offset"].as_u64().unwrap());
                        assert_eq!(c.byte_length, s["byte_length"].as_u64().unwrap());
                    } else {
                        assert_eq!(c.byte_length, s["byte_length"].as_u64().unwrap());
                    }
                    let rank: u32 = c.file[2..3].parse().unwrap();
                    assert_eq!(c.rank, Some(rank));
                }
                let data = idx.read_tensor(&src, e).unwrap();
                let (dt, shape, bytes) = &full[&p];
                assert_eq!(st_dtype(data.dtype), dt);
                assert_eq!(&data.shape, shape);
                assert_eq!(&data.bytes, bytes, "{dir} {}: values differ", e.key);
            }
            EntryKind::Bytes => {
                assert_eq!(item["kind"], "bytes");
                let v = idx.read_bytes_value(&src, e).unwrap();
                assert_eq!(v, facts["entries"][&p]["value"], "{dir} {}", e.key);
            }
            EntryKind::Scalar => panic!("DCP has no scalars"),
        }
    }
}

#[test]
fn dcp_default_serialization_matches_torch() {
    check_dcp("dcp_torch_save", CheckpointKind::DcpTorchSave);
}

#[test]
fn dcp_safetensors_serialization_matches_torch() {
    check_dcp("dcp_safetensors", CheckpointKind::DcpSafetensors);
}

#[test]
fn hf_safetensors_folders_match_torch() {
    let full = expected_tensors("hf_sharded");
    for (dir, kind, pieces) in [
        ("hf_sharded", CheckpointKind::HfSafetensors, false),
        (
            "hf_distributed",
            CheckpointKind::HfDistributedSafetensors,
            true,
        ),
    ] {
        let src = memory_source(&formats().join(dir));
        let idx = index::index_source(&src).unwrap();
        assert_eq!(idx.kind, kind, "{dir}");
        assert!(idx.check().is_empty(), "{dir}: {:?}", idx.check());
        assert_eq!(idx.entries.len(), full.len());
        for e in &idx.entries {
            let data = idx.read_tensor(&src, e).unwrap();
            assert_eq!(data.bytes, full[&e.key].2, "{dir} {}", e.key);
        }
        assert_eq!(idx.entry("embed.weight").unwrap().chunks.len() > 1, pieces);
    }
    // The index file names a file that is missing: a clear error.
    let mut src = memory_source(&formats().join("hf_sharded"));
    src.remove("model-00002-of-00002.safetensors");
    let err = index::index_source(&src).unwrap_err().to_string();
    assert!(
        err.contains("model-00002-of-00002.safetensors") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn value_statistics_match_an_independent_count() {
    let (src, idx) = one_file("plain/state_dict.pt");
    let s = idx
        .read_tensor(&src, idx.entry("special").unwrap())
        .unwrap()
        .stats()
        .unwrap();
    // [nan, inf, -inf, -0.0]
    assert_eq!((s.count, s.nan, s.inf), (4, 1, 2));
    assert_eq!(s.min, Some(0.0));
    let i = idx
        .read_tensor(&src, idx.entry("i64").unwrap())
        .unwrap()
        .stats()
        .unwrap();
    // torch.arange(-3, 3)
    assert_eq!((i.min, i.max, i.mean), (Some(-3.0), Some(2.0), Some(-0.5)));
}

fn run_cli(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(crate::common::shardscope_bin())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn cli_inspect_json_has_the_canonical_fields() {
    let dir = formats().join("dcp_torch_save");
    let (code, out, err) = run_cli(&[
        "inspect",
        p(&dir),
        "--json",
        "--values",
        "--filter",
        "^(model\\.embed|extra\\.meta\\.betas)",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["format"], "dcp");
    let entries = v["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    let betas = &entries[0];
    assert_eq!(betas["key"], "extra.meta.betas");
    assert_eq!(betas["kind"], "bytes");
    assert_eq!(betas["value"], serde_json::json!([0.9, 0.999]));
    let e = &entries[1];
    assert_eq!(e["key"], "model.embed.weight");
    assert_eq!(e["path"], serde_json::json!(["model", "embed.weight"]));
    assert_eq!(e["kind"], "tensor");
    assert_eq!(e["dtype"], "float32");
    assert_eq!(e["shape"], serde_json::json!([7, 5]));
    let c0 = &e["chunks"][0];
    for field in [
        "offsets",
        "sizes",
        "file",
        "byte_offset",
        "byte_length",
        "rank",
    ] {
        assert!(c0.get(field).is_some(), "missing {field}");
    }
    assert_eq!(c0["sizes"], serde_json::json!([4, 5]));
    assert!(e["stats"]["min"].is_number());
    // Deterministic: the same input gives the same bytes.
    let (_, again, _) = run_cli(&[
        "inspect",
        p(&dir),
        "--json",
        "--values",
        "--filter",
        "^(model\\.embed|extra\\.meta\\.betas)",
    ]);
    assert_eq!(out, again);
}

#[test]
fn cli_inspect_human_summary() {
    let files = [
        formats().join("fsdp1_orig1/rank0_local.pt"),
        formats().join("fsdp1_orig1/rank1_local.pt"),
    ];
    let (code, out, err) = run_cli(&["inspect", p(&files[0]), p(&files[1])]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("FSDP1 LOCAL_STATE_DICT"), "{out}");
    assert!(out.contains("bytes per rank: rank 0:"), "{out}");
    assert!(out.contains("block._flat_param"), "{out}");
    // A folder with several sets of per-rank files is one checkpoint, a subtree per set (told
    // apart by their file names without the rank when two sets are of one kind; never a `{R}`).
    let (code, out, err) = run_cli(&["inspect", p(&formats().join("fsdp1_orig0"))]);
    assert_eq!(code, 0, "{err}");
    for subtree in [
        "model.full.",
        "model.sharded.",
        "model.local.",
        "optim.optim_raw.state.",
        "optim.optim_full.param_groups.",
    ] {
        assert!(out.contains(subtree), "{subtree} missing:\n{out}");
    }
    assert!(!out.contains('{'), "{out}");
}

#[test]
fn cli_inspect_of_one_rank_file_says_the_gaps_are_other_ranks_shards() {
    // One rank's file of a sharded checkpoint (FSDP2 DTensors, FSDP1 ShardedTensors), alone: its
    // tensors have gaps where the other ranks' shards go. Exit 2 (the tensors are incomplete), with
    // a hint that says so rather than calling the file damaged.
    for (file, rank) in [
        ("fsdp2/rank1_model.pt", 1),
        ("fsdp1_orig1/rank0_sharded.pt", 0),
    ] {
        let (code, _, err) = run_cli(&["inspect", p(&formats().join(file))]);
        assert_eq!(code, 2, "{file}: {err}");
        assert!(err.contains("(a gap:"), "{file}: {err}");
        assert!(
            err.contains(&format!("belongs to rank {rank}:"))
                && err.contains("other ranks' shards"),
            "{file}: {err}"
        );
        assert!(!err.contains("damaged"), "{file}: {err}");
    }
    // Both ranks' files together: whole tensors, no problem.
    let (code, _, err) = run_cli(&[
        "inspect",
        p(&formats().join("fsdp2/rank0_model.pt")),
        p(&formats().join("fsdp2/rank1_model.pt")),
    ]);
    assert_eq!(code, 0, "{err}");
}
