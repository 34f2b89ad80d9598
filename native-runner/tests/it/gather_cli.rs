//! `shardscope gather` as a user runs it: exit codes, the Chrome trace, the summary JSON and `-o`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::{Value, json};

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run shardscope")
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn model(dir: &tempfile::TempDir) -> PathBuf {
    let path = dir.path().join("model.json");
    let m = json!({"params": [
        {"fqn": "scale", "shape": [2], "dtype": "float32"},
        {"fqn": "embed.weight", "shape": [7, 5], "dtype": "float32"},
        {"fqn": "block1.lin.weight", "shape": [7, 5], "dtype": "float32"},
        {"fqn": "block1.lin.bias", "shape": [7], "dtype": "float32"},
        {"fqn": "head.weight", "shape": [7, 5], "dtype": "float32", "shared_with": "embed.weight"},
        {"fqn": "head.bias", "shape": [3], "dtype": "float32"}],
      "units": ["", "block1"]});
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    path
}

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn trace_is_chrome_json_with_one_lane_per_rank_and_every_step() {
    let dir = tempdir();
    let model = model(&dir);
    let trace = dir.path().join("trace.json");
    for api in ["fsdp1", "fsdp2"] {
        let out = shardscope(&[
            "gather",
            "--synthetic",
            "--model",
            s(&model),
            "--world-size",
            "3",
            "--api",
            api,
            "--verify",
            "--trace",
            s(&trace),
            "--json",
            "-q",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
        let t: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let events = t["traceEvents"].as_array().unwrap();
        // One named process lane per rank.
        let lanes: BTreeMap<u64, String> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
            .map(|e| {
                (
                    e["pid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(lanes, (0..3).map(|r| (r, format!("rank {r}"))).collect());
        let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        for e in &spans {
            assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
            assert!(
                e["args"]["bytes"].is_u64() && e["args"]["dtype"] == "float32",
                "{e}"
            );
            assert!(e["args"]["unit"].is_string());
            assert!(e["pid"].as_u64().unwrap() < 3);
        }
        let names: BTreeSet<&str> = spans.iter().map(|e| e["name"].as_str().unwrap()).collect();
        let mut want: BTreeSet<&str> = ["read", "all-gather", "copy-out", "verify"].into();
        if api == "fsdp2" {
            // FSDP1's flat shard is the all-gather input; FSDP2 copies its shards in.
            want.insert("copy-in");
        }
        assert_eq!(names, want, "{api}");
        // Every rank has every step of every unit (2 units).
        for rank in 0..3 {
            for name in &want {
                let n = spans
                    .iter()
                    .filter(|e| e["pid"] == rank && e["name"] == *name)
                    .count();
                assert_eq!(n, 2, "{api} rank {rank} {name}");
            }
        }
        // all-gather bytes = nccl-tests' S = input bytes x ranks, as in the summary.
        for u in summary["summary"]["units"].as_array().unwrap() {
            let unit = u["unit"].as_str().unwrap();
            let s_bytes = u["all_gather_bytes"].as_u64().unwrap();
            assert_eq!(s_bytes, u["input_bytes"].as_u64().unwrap() * 3);
            for e in spans
                .iter()
                .filter(|e| e["name"] == "all-gather" && e["args"]["unit"] == unit)
            {
                assert_eq!(e["args"]["bytes"].as_u64().unwrap(), s_bytes);
            }
            let algbw = u["algbw_gbps"].as_f64().unwrap();
            let busbw = u["busbw_gbps"].as_f64().unwrap();
            assert!((busbw - algbw * 2.0 / 3.0).abs() <= 1e-9 * algbw.max(1.0));
        }
        assert_eq!(summary["verify"]["mismatches"], json!([]));
    }
}

/// Writes a full safetensors checkpoint with Python-free code: the runner's own `-o` output of a
/// synthetic run, then reads it back as a checkpoint.
#[test]
fn output_round_trips_and_a_corrupted_checkpoint_exits_1() {
    let dir = tempdir();
    let model = model(&dir);
    let full = dir.path().join("full.safetensors");
    let out = shardscope(&[
        "gather",
        "--synthetic",
        "--model",
        s(&model),
        "--world-size",
        "4",
        "--use-orig-params",
        "-o",
        s(&full),
        "-q",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Gathering that checkpoint under another layout verifies and reproduces it byte for byte.
    let again = dir.path().join("again.safetensors");
    let out = shardscope(&[
        "gather",
        s(&full),
        "--model",
        s(&model),
        "--world-size",
        "3",
        "--api",
        "fsdp2",
        "--verify",
        "-o",
        s(&again),
        "-q",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("verify: OK"));
    assert_eq!(
        std::fs::read(&full).unwrap(),
        std::fs::read(&again).unwrap()
    );

    // Make the tied alias differ from its primary: --verify finds it and exits 1.
    let st = safetensors::SafeTensors::deserialize(&std::fs::read(&full).unwrap())
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(k, v)| {
            let mut data = v.data().to_vec();
            if k == "head.weight" {
                data[0] ^= 0x10;
            }
            (k, (v.dtype(), v.shape().to_vec(), data))
        })
        .collect::<BTreeMap<_, _>>();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .iter()
        .map(|(k, (d, shape, data))| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(*d, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, safetensors::serialize(views, None).unwrap()).unwrap();
    let out = shardscope(&[
        "gather",
        s(&bad),
        "--model",
        s(&model),
        "--world-size",
        "2",
        "--verify",
        "-q",
    ]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("rank 0: head.weight: 1 elements differ, first at byte 0"),
        "{text}"
    );
}

#[test]
fn bad_input_exits_2_with_a_message_naming_the_problem() {
    let dir = tempdir();
    let model = model(&dir);
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not safetensors").unwrap();
    let out = shardscope(&[
        "gather",
        s(&junk),
        "--model",
        s(&model),
        "--world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("junk.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );

    // Missing parameter in a full checkpoint.
    let small = dir.path().join("small.safetensors");
    let data = vec![0u8; 8];
    let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
    std::fs::write(
        &small,
        safetensors::serialize([("scale", v)], None).unwrap(),
    )
    .unwrap();
    let out = shardscope(&["gather", s(&small), "--model", s(&model)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tensor `embed.weight`"));

    // The cuda backend names the feature to build with when it is not compiled in.
    if !cfg!(feature = "cuda") {
        let out = shardscope(&[
            "gather",
            "--synthetic",
            "--model",
            s(&model),
            "--backend",
            "cuda",
        ]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--features cuda"));
    }
}

/// Without --model, a checkpoint whose parameters have two dtypes (a bf16 model with float32
/// norms) gets one unit per module instead of torch's "Must flatten tensors with uniform dtype",
/// says so, and gathers back to the same bytes.
#[test]
fn mixed_dtypes_without_model_get_one_unit_per_module() {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = tempdir();
    let ckpt = dir.path().join("mixed.safetensors");
    let bf16: Vec<u8> = (0..48u8).collect();
    let f32s: Vec<u8> = (0..24u8).map(|b| b.wrapping_mul(7)).collect();
    let tensors = vec![
        (
            "emb.weight",
            TensorView::new(Dtype::BF16, vec![4, 6], &bf16).unwrap(),
        ),
        (
            "norm.weight",
            TensorView::new(Dtype::F32, vec![6], &f32s).unwrap(),
        ),
        (
            "layers.0.w",
            TensorView::new(Dtype::BF16, vec![6, 4], &bf16).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &ckpt).unwrap();
    let out_path = dir.path().join("out.safetensors");
    let out = shardscope(&[
        "gather",
        s(&ckpt),
        "--world-size",
        "2",
        "--api",
        "fsdp1",
        "--verify",
        "-o",
        s(&out_path),
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("3 units, one per module") && text.contains("bfloat16, float32"),
        "{text}"
    );
    assert!(text.contains("verify: OK"), "{text}");
    let read = |p: &std::path::Path| {
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut v: Vec<(String, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(k, t)| (k, t.data().to_vec()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(read(&ckpt), read(&out_path));
}
