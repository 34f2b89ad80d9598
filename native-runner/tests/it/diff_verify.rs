//! `shardscope diff` and `shardscope verify` run as processes on torch-written fixtures, on
//! checkpoints written here with `formats::write`, and on damaged copies.
#![allow(clippy::unwrap_used, clippy::float_cmp, clippy::many_single_char_names)]

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::shardscope_bin;
use serde_json::Value;
use shardscope_core::DType;
use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};
use shardscope_core::index;
use shardscope_tests::{fixtures_dir, memory_source};

fn formats() -> PathBuf {
    fixtures_dir().join("formats")
}

/// Runs shardscope; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(shardscope_bin()).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn run_json(args: &[&str]) -> (i32, Value) {
    let mut all: Vec<&str> = args.to_vec();
    all.push("--json");
    let (code, stdout, stderr) = run(&all);
    let v: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}\nstderr: {stderr}"));
    assert_eq!(v["kind"], "shardscope.verify");
    assert_eq!(v["version"], 1);
    (code, v)
}

fn entry<'a>(report: &'a Value, fqn: &str) -> &'a Value {
    report["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["fqn"] == fqn)
        .unwrap_or_else(|| panic!("no entry {fqn} in {report:#}"))
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn write_safetensors(path: &Path, tensors: &[(&str, DType, Vec<u64>, Vec<u8>)]) {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, s, _)| TensorSpec {
            name: (*n).to_owned(),
            dtype: *d,
            shape: s.clone(),
        })
        .collect();
    let mut w = SafetensorsWriter::new(Vec::new(), &specs, None).unwrap();
    let order: Vec<String> = w.data_order().map(str::to_owned).collect();
    for name in order {
        let data = &tensors.iter().find(|t| t.0 == name).unwrap().3;
        w.write_tensor(&name, data).unwrap();
    }
    std::fs::write(path, w.finish().unwrap()).unwrap();
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(f32::to_le_bytes).collect()
}

#[test]
fn the_same_torch_weights_in_three_formats_are_equal() {
    let f = formats();
    // dcp.save of {model, optim, extra} vs HuggingFaceStorageWriter of the same model's weights.
    let (code, r) = run_json(&[
        "diff",
        p(&f.join("dcp_torch_save")),
        p(&f.join("hf_sharded")),
        "--select",
        "model",
    ]);
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["summary"]["matched"], 7);
    assert_eq!(
        entry(&r, "block.lin.weight")["left_key"],
        "model.block.lin.weight"
    );
    // torch.save (FSDP1 FULL_STATE_DICT, rank 0) vs safetensors.
    let (code, r) = run_json(&[
        "diff",
        p(&f.join("fsdp1_orig0/rank0_full.pt")),
        p(&f.join("hf_sharded")),
    ]);
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["summary"]["matched"], 7);
    // Both DCP serializations, optimizer state and non-tensor items included.
    let (code, r) = run_json(&[
        "diff",
        p(&f.join("dcp_torch_save")),
        p(&f.join("dcp_safetensors")),
    ]);
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(entry(&r, "extra.meta.betas")["status"], "match");
    assert_eq!(entry(&r, "optim.state.0.step")["status"], "match");
}

#[test]
fn a_single_flipped_element_in_64_mib_is_found_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, cols) = (4096u64, 4096u64);
    let big = f32_bytes((0..rows * cols).map(|i| (i % 9973) as f32 * 0.5));
    let small = f32_bytes([1.0, 2.0, 3.0]);
    let a = dir.path().join("a.safetensors");
    write_safetensors(
        &a,
        &[
            ("layers.0.big", DType::Float32, vec![rows, cols], big),
            ("layers.1.small", DType::Float32, vec![3], small),
        ],
    );
    // Flip the lowest mantissa bit of element 12_345_679 of `layers.0.big`, found from the header.
    let mut bytes = std::fs::read(&a).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header["layers.0.big"]["data_offsets"][0].as_u64().unwrap() as usize;
    let element = 12_345_679usize;
    let at = 8 + header_len + start + 4 * element;
    let before = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    bytes[at] ^= 1;
    let after = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let b = dir.path().join("b.safetensors");
    std::fs::write(&b, &bytes).unwrap();

    let (code, r) = run_json(&["diff", p(&a), p(&b)]);
    assert_eq!(code, 1, "{r:#}");
    let e = entry(&r, "layers.0.big");
    assert_eq!(e["status"], "mismatch");
    assert_eq!(e["mismatched_elements"], 1);
    let expected_index = [element as u64 / cols, element as u64 % cols];
    assert_eq!(e["first_mismatch"], serde_json::json!(expected_index));
    assert_eq!(
        e["max_abs_diff"].as_f64().unwrap(),
        f64::from((after - before).abs())
    );
    assert_eq!(entry(&r, "layers.1.small")["status"], "match");
    assert_eq!(r["summary"]["matched"], 1);
    assert_eq!(r["summary"]["mismatched"], 1);
    // The text output names the tensor and the index too.
    let (code, text, _) = run(&["diff", "--quiet", p(&a), p(&b)]);
    assert_eq!(code, 1);
    assert!(
        text.contains("layers.0.big")
            && text.contains(&format!("[{}, {}]", expected_index[0], expected_index[1])),
        "{text}"
    );
}

#[test]
fn missing_unexpected_dtype_and_shape_differences() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.safetensors");
    let b = dir.path().join("b.safetensors");
    write_safetensors(
        &a,
        &[
            (
                "same",
                DType::Int64,
                vec![2],
                [7i64, -3].iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            (
                "reshaped",
                DType::Float32,
                vec![2, 3],
                f32_bytes((0..6).map(|i| i as f32)),
            ),
            ("recast", DType::Float32, vec![2], f32_bytes([1.0, 2.0])),
            ("only_left", DType::Float32, vec![1], f32_bytes([0.0])),
        ],
    );
    write_safetensors(
        &b,
        &[
            (
                "same",
                DType::Int64,
                vec![2],
                [7i64, -3].iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            (
                "reshaped",
                DType::Float32,
                vec![3, 2],
                f32_bytes((0..6).map(|i| i as f32)),
            ),
            (
                "recast",
                DType::Float16,
                vec![2],
                vec![0x00, 0x3c, 0x00, 0x40],
            ),
            ("only_right", DType::Float32, vec![1], f32_bytes([0.0])),
        ],
    );
    let (code, r) = run_json(&["diff", p(&a), p(&b)]);
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(entry(&r, "same")["status"], "match");
    let e = entry(&r, "reshaped");
    assert_eq!(e["status"], "mismatch");
    assert_eq!(e["shape"], serde_json::json!([2, 3]));
    assert_eq!(e["right_shape"], serde_json::json!([3, 2]));
    let e = entry(&r, "recast");
    assert_eq!(e["status"], "mismatch");
    assert_eq!(e["dtype"], "float32");
    assert_eq!(e["right_dtype"], "float16");
    assert_eq!(entry(&r, "only_left")["status"], "missing");
    assert_eq!(entry(&r, "only_right")["status"], "unexpected");
    let s = &r["summary"];
    assert_eq!(
        (
            s["matched"].as_u64(),
            s["mismatched"].as_u64(),
            s["missing"].as_u64(),
            s["unexpected"].as_u64()
        ),
        (Some(1), Some(2), Some(1), Some(1))
    );
}

#[test]
fn tolerances_follow_torch_allclose() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.safetensors");
    let b = dir.path().join("b.safetensors");
    write_safetensors(
        &a,
        &[(
            "w",
            DType::Float32,
            vec![3],
            f32_bytes([1.0, 100.0, f32::NAN]),
        )],
    );
    write_safetensors(
        &b,
        &[(
            "w",
            DType::Float32,
            vec![3],
            f32_bytes([1.0, 100.01, f32::NAN]),
        )],
    );
    // Bitwise: element 1 differs (the NaNs have the same bits).
    let (code, r) = run_json(&["diff", p(&a), p(&b)]);
    assert_eq!(code, 1);
    assert_eq!(entry(&r, "w")["first_mismatch"], serde_json::json!([1]));
    // |100 - 100.01| = 0.01 <= 0 + 1e-3 * 100.01, but NaN != NaN without --equal-nan.
    let (code, r) = run_json(&["diff", p(&a), p(&b), "--rtol", "1e-3", "--atol", "0"]);
    assert_eq!(code, 1);
    assert_eq!(entry(&r, "w")["first_mismatch"], serde_json::json!([2]));
    let (code, _) = run_json(&[
        "diff",
        p(&a),
        p(&b),
        "--rtol",
        "1e-3",
        "--atol",
        "0",
        "--equal-nan",
    ]);
    assert_eq!(code, 0);
    // 0.01 > 1e-5 + 1e-5 * 100.01.
    let (code, r) = run_json(&["diff", p(&a), p(&b), "--rtol", "1e-5", "--equal-nan"]);
    assert_eq!(code, 1);
    let d = entry(&r, "w")["max_abs_diff"].as_f64().unwrap();
    assert!((d - f64::from(100.01f32 - 100.0)).abs() < 1e-12, "{d}");
}

#[test]
fn bad_input_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a checkpoint at all").unwrap();
    let good = formats().join("hf_sharded");
    let (code, _, err) = run(&["diff", p(&junk), p(&good)]);
    assert_eq!(code, 2);
    assert!(err.contains("junk.safetensors"), "{err}");
    let (code, _, err) = run(&["diff", p(&good), p(&dir.path().join("nope"))]);
    assert_eq!(code, 2);
    assert!(err.contains("nope"), "{err}");
    let (code, _, _) = run(&["diff", p(&good), p(&good), "--rtol", "-1"]);
    assert_eq!(code, 2);
    let (code, _, err) = run(&["verify", p(&junk)]);
    assert_eq!(code, 2);
    assert!(err.contains("junk.safetensors"), "{err}");
}

#[test]
fn verify_passes_every_torch_fixture() {
    let f = formats();
    let cases: Vec<Vec<PathBuf>> = vec![
        vec![f.join("dcp_torch_save")],
        vec![f.join("dcp_safetensors")],
        vec![f.join("hf_sharded")],
        vec![f.join("hf_distributed")],
        vec![f.join("plain/state_dict.pt")],
        vec![
            f.join("fsdp1_orig0/rank0_local.pt"),
            f.join("fsdp1_orig0/rank1_local.pt"),
        ],
        vec![
            f.join("fsdp1_orig0/rank0_optim_raw.pt"),
            f.join("fsdp1_orig0/rank1_optim_raw.pt"),
        ],
        vec![
            f.join("fsdp1_orig1/rank0_sharded.pt"),
            f.join("fsdp1_orig1/rank1_sharded.pt"),
        ],
        vec![
            f.join("fsdp1_orig1/rank0_full.pt"),
            f.join("fsdp1_orig1/rank1_full.pt"),
        ],
        vec![
            f.join("fsdp2/rank0_model.pt"),
            f.join("fsdp2/rank1_model.pt"),
        ],
        vec![
            f.join("fsdp2/rank0_optim.pt"),
            f.join("fsdp2/rank1_optim.pt"),
        ],
    ];
    for paths in cases {
        let mut args = vec!["verify"];
        args.extend(paths.iter().map(|x| p(x)));
        let (code, r) = run_json(&args);
        assert_eq!(code, 0, "{paths:?}: {r:#}");
        assert!(r["summary"]["matched"].as_u64().unwrap() > 0);
    }
}

/// A copy of the torch-written DCP directory with a damaged `.metadata`.
fn dcp_with(dir: &Path, metadata: &str) -> PathBuf {
    let out = dir.join(metadata.trim_end_matches(".metadata"));
    std::fs::create_dir(&out).unwrap();
    for name in ["__0_0.distcp", "__1_0.distcp"] {
        std::fs::copy(formats().join("dcp_torch_save").join(name), out.join(name)).unwrap();
    }
    std::fs::copy(
        fixtures_dir().join("malformed").join(metadata),
        out.join(".metadata"),
    )
    .unwrap();
    out
}

#[test]
fn verify_names_the_damage_in_malformed_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    for (metadata, needle) in [
        ("dcp_gap.metadata", "gap"),
        ("dcp_overlap.metadata", "overlaps"),
        ("dcp_out_of_file.metadata", "outside the file"),
        ("dcp_out_of_bounds.metadata", "outside shape"),
    ] {
        let ckpt = dcp_with(dir.path(), metadata);
        let (code, r) = run_json(&["verify", p(&ckpt)]);
        assert_eq!(code, 2, "{metadata}: {r:#}");
        let problems: Vec<&Value> = r["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["status"] == "error")
            .collect();
        assert!(
            problems
                .iter()
                .any(|e| e["message"].as_str().unwrap().contains(needle)),
            "{metadata}: {r:#}"
        );
    }
    for name in [
        "memo_bomb.pt",
        "missing_storage.pt",
        "overflow.safetensors",
        "view_past_storage.pt",
    ] {
        let (code, _, err) = run(&["verify", p(&fixtures_dir().join("malformed").join(name))]);
        assert_eq!(code, 2, "{name}");
        assert!(err.contains(name), "{name}: {err}");
    }
}

#[test]
fn verify_catches_replicas_that_disagree() {
    // FSDP1 FULL_STATE_DICT: rank 0 and rank 1 hold the same full tensors. Change one element of
    // rank 1's `block.lin.weight` ([3, 5] float32; element [1, 2] is number 7).
    let dir = tempfile::tempdir().unwrap();
    let src = formats().join("fsdp1_orig1");
    let files = ["rank0_full.pt", "rank1_full.pt"];
    for f in files {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mem = memory_source(dir.path());
    let idx = index::index_source(&mem).unwrap();
    let e = idx.entry("block.lin.weight").unwrap();
    let c = e.chunks.iter().find(|c| c.rank == Some(1)).unwrap();
    let path = dir.path().join(&*c.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = c.byte_offset as usize + 4 * 7;
    let old = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    bytes[at..at + 4].copy_from_slice(&(old + 1.0).to_le_bytes());
    std::fs::write(&path, bytes).unwrap();

    let (code, r) = run_json(&[
        "verify",
        p(&dir.path().join(files[0])),
        p(&dir.path().join(files[1])),
    ]);
    assert_eq!(code, 1, "{r:#}");
    let e = entry(&r, "block.lin.weight");
    assert_eq!(e["status"], "mismatch");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("rank 0 and rank 1") && msg.contains("[1, 2]"),
        "{msg}"
    );
    assert_eq!(r["summary"]["mismatched"], 1);
}

fn local_pair(dir: &str) -> [PathBuf; 2] {
    let d = formats().join(dir);
    [d.join("rank0_local.pt"), d.join("rank1_local.pt")]
}

#[test]
fn verify_checks_fsdp1_local_flat_params_against_the_layout() {
    // net_model.json comes from torch's named_parameters (tests/fixtures/verify/gen_model.py); the
    // checkpoints are torch's LOCAL_STATE_DICTs of that model at world size 2.
    let model = fixtures_dir().join("verify/net_model.json");
    let [a, b] = local_pair("fsdp1_orig0");
    let base = [
        "verify",
        p(&a),
        p(&b),
        "--model",
        p(&model),
        "--world-size",
        "2",
    ];
    let (code, r) = run_json(&base);
    assert_eq!(code, 0, "{r:#}");
    let [a1, b1] = local_pair("fsdp1_orig1");
    let orig = [
        "verify",
        p(&a1),
        p(&b1),
        "--model",
        p(&model),
        "--world-size",
        "2",
    ];
    let (code, r) = run_json(&[&orig[..], &["--use-orig-params"]].concat());
    assert_eq!(code, 0, "{r:#}");

    // torch wrote 46 = 35 + 1 + 6 + 2 + 2 elements (alignment padding); without
    // use_orig_params the layout has 43 = 35 + 6 + 2.
    let (code, r) = run_json(&orig);
    assert_eq!(code, 1, "{r:#}");
    let msg = entry(&r, "_flat_param")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(msg.contains("43") && msg.contains("[46]"), "{msg}");
    // World size 4: shards of ceil(43 / 4) = 11 elements, the file has 22 + 21.
    let (code, r) = run_json(&[
        "verify",
        p(&a),
        p(&b),
        "--model",
        p(&model),
        "--world-size",
        "4",
    ]);
    assert_eq!(code, 1, "{r:#}");
    let msg = entry(&r, "block._flat_param")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        msg.contains("[0..11) [11..21)") && msg.contains("shard size 6"),
        "{msg}"
    );

    // Swap two 3-element parameters of `block` in the description: flat sizes stay the same, but
    // the per-rank views of `block.scale` (rank 0: 3 elements, rank 1: none) no longer fit.
    let mut desc: Value = serde_json::from_slice(&std::fs::read(&model).unwrap()).unwrap();
    let params = desc["params"].as_array_mut().unwrap();
    let i = params
        .iter()
        .position(|x| x["fqn"] == "block.scale")
        .unwrap();
    let j = params
        .iter()
        .position(|x| x["fqn"] == "block.lin.bias")
        .unwrap();
    params.swap(i, j);
    let dir = tempfile::tempdir().unwrap();
    let swapped = dir.path().join("swapped.json");
    std::fs::write(&swapped, serde_json::to_vec(&desc).unwrap()).unwrap();
    let (code, r) = run_json(&[
        "verify",
        p(&a1),
        p(&b1),
        "--model",
        p(&swapped),
        "--world-size",
        "2",
        "--use-orig-params",
    ]);
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(entry(&r, "block.scale")["status"], "mismatch");
    assert_eq!(entry(&r, "block.lin.bias")["status"], "mismatch");
}
