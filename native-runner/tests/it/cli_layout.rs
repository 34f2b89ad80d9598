//! `shardscope layout` as a user runs it. Expected values are the torch-verified worked examples of
//! the spec (FSDP_SPEC.md §1.6 A and §4.1, checked against torch 2.15).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::{Value, json};

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .expect("run shardscope")
}

fn write_model(name: &str, json: &Value) -> PathBuf {
    // Under cargo's scratch folder for integration tests (target/tmp), not the system's /tmp:
    // the files outlive the test process, which cannot remove them at exit.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("shardscope-cli-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Tests run in parallel: every call gets its own file.
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("{n}-{name}"));
    std::fs::write(&path, serde_json::to_vec(json).unwrap()).unwrap();
    path
}

/// Spec §1.6 A: `a` (numel 5) then `b` (3x2) in one root unit, ws=4.
fn tiny() -> PathBuf {
    write_model(
        "tiny.json",
        &json!({"params": [
            {"fqn": "a", "shape": [5], "dtype": "float32"},
            {"fqn": "b", "shape": [3, 2], "dtype": "float32"}],
          "units": [""]}),
    )
}

fn run_json(args: &[&str]) -> Value {
    let out = shardscope(args);
    assert!(
        out.status.success(),
        "shardscope {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn infos(v: &Value, rank: usize) -> Vec<Value> {
    v["flat_params"][0]["ranks"][rank]["shard_param_infos"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            if i["in_shard"].as_bool().unwrap() {
                json!([
                    true,
                    i["offset_in_shard"],
                    i["numel_in_shard"],
                    i["intra_param_start_idx"],
                    i["intra_param_end_idx"]
                ])
            } else {
                json!([false])
            }
        })
        .collect()
}

#[test]
fn fsdp1_worked_example_without_orig_params() {
    let model = tiny();
    let v = run_json(&[
        "layout",
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "4",
        "--json",
    ]);
    let flat = &v["flat_params"][0];
    assert_eq!(flat["flat_param_fqn"], "_flat_param");
    assert_eq!(flat["numels_with_padding"], json!([5, 6]));
    assert_eq!(flat["unpadded_unsharded_numel"], 11);
    assert_eq!(flat["sharded_numel"], 3);
    assert_eq!(infos(&v, 0), [json!([true, 0, 3, 0, 2]), json!([false])]);
    assert_eq!(
        infos(&v, 1),
        [json!([true, 0, 2, 3, 4]), json!([true, 2, 1, 0, 0])]
    );
    assert_eq!(infos(&v, 2), [json!([false]), json!([true, 0, 3, 1, 3])]);
    assert_eq!(infos(&v, 3), [json!([false]), json!([true, 0, 2, 4, 5])]);
    let padded: Vec<u64> = (0..4)
        .map(|r| flat["ranks"][r]["shard_numel_padded"].as_u64().unwrap())
        .collect();
    assert_eq!(padded, [0, 0, 0, 1]);
}

#[test]
fn fsdp1_worked_example_with_orig_params() {
    let model = tiny();
    let v = run_json(&[
        "layout",
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "4",
        "--use-orig-params",
        "--json",
    ]);
    let flat = &v["flat_params"][0];
    assert_eq!(flat["numels_with_padding"], json!([5, 3, 6, 2]));
    assert_eq!(flat["is_padding_mask"], json!([false, true, false, true]));
    assert_eq!(flat["aligned_numel"], 4);
    assert_eq!(flat["sharded_numel"], 4);
    assert_eq!(infos(&v, 0), [json!([true, 0, 4, 0, 3]), json!([false])]);
    assert_eq!(infos(&v, 1), [json!([true, 0, 1, 4, 4]), json!([false])]);
    assert_eq!(infos(&v, 2), [json!([false]), json!([true, 0, 4, 0, 3])]);
    assert_eq!(infos(&v, 3), [json!([false]), json!([true, 0, 2, 4, 5])]);
}

#[test]
fn bf16_compute_dtype_widens_alignment() {
    // Spec §1.3 [verified]: numels (3, 7) fp32 -> (3,1,7,1); with param_dtype=bfloat16 -> (3,5,7,1).
    let model = write_model(
        "align.json",
        &json!({"params": [
            {"fqn": "x", "shape": [3], "dtype": "float32"},
            {"fqn": "y", "shape": [7], "dtype": "float32"}],
          "units": [""]}),
    );
    let path = model.to_str().unwrap();
    let v = run_json(&[
        "layout",
        "--model",
        path,
        "--world-size",
        "2",
        "--use-orig-params",
        "--json",
    ]);
    assert_eq!(
        v["flat_params"][0]["numels_with_padding"],
        json!([3, 1, 7, 1])
    );
    let v = run_json(&[
        "layout",
        "--model",
        path,
        "--world-size",
        "2",
        "--use-orig-params",
        "--param-dtype",
        "bfloat16",
        "--json",
    ]);
    assert_eq!(
        v["flat_params"][0]["numels_with_padding"],
        json!([3, 5, 7, 1])
    );
}

#[test]
fn fsdp2_worked_example() {
    let model = tiny();
    let v = run_json(&[
        "layout",
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "4",
        "--api",
        "fsdp2",
        "--json",
    ]);
    assert_eq!(v["api"], "fsdp2");
    let params = &v["units"][0]["params"];
    let a: Vec<Value> = (0..4)
        .map(|r| params[0]["ranks"][r]["local_shape"].clone())
        .collect();
    assert_eq!(a, [json!([2]), json!([2]), json!([1]), json!([0])]);
    assert_eq!(params[0]["padded_sharded_shape"], json!([2]));
    assert_eq!(params[0]["ranks"][3]["global_offset"], json!([5]));
    let b: Vec<Value> = (0..4)
        .map(|r| params[1]["ranks"][r]["local_shape"].clone())
        .collect();
    assert_eq!(
        b,
        [json!([1, 2]), json!([1, 2]), json!([1, 2]), json!([0, 2])]
    );
    assert_eq!(params[1]["placements"], json!(["Shard(0)"]));
}

#[test]
fn hsdp_places_replicate_then_shard() {
    // Spec §4.1 [verified]: mesh (2, 2): ranks 0/2 hold a[0:3], ranks 1/3 hold a[3:5].
    let model = tiny();
    let v = run_json(&[
        "layout",
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "4",
        "--api",
        "fsdp2",
        "--shard-group-size",
        "2",
        "--json",
    ]);
    assert_eq!(v["mesh_shape"], json!([2, 2]));
    let a = &v["units"][0]["params"][0];
    assert_eq!(a["placements"], json!(["Replicate()", "Shard(0)"]));
    assert_eq!(a["ranks"][0]["local_shape"], json!([3]));
    assert_eq!(a["ranks"][1]["global_offset"], json!([3]));
}

#[test]
fn human_output_shows_slices_padding_and_totals() {
    let model = tiny();
    let out = shardscope(&[
        "layout",
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "4",
        "--use-orig-params",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("rank    1: a[4..5] pad(3)"), "{text}");
    assert!(text.contains("rank    3: b[4..6] pad(2)"), "{text}");
    assert!(text.contains("padding: 5 of 16 elements held"), "{text}");
}

#[test]
fn bad_input_exits_2_and_names_the_problem() {
    let model = write_model(
        "mixed.json",
        &json!({"params": [
            {"fqn": "u.x", "shape": [3], "dtype": "float32"},
            {"fqn": "u.y", "shape": [3], "dtype": "bfloat16"}],
          "units": ["u"]}),
    );
    let out = shardscope(&[
        "layout",
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("u.y")
            && err.contains(
                "Must flatten tensors with uniform dtype but got torch.float32 and torch.bfloat16"
            ),
        "{err}"
    );

    let out = shardscope(&[
        "layout",
        "--model",
        "/nonexistent/model.json",
        "--world-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model.json"));
}
