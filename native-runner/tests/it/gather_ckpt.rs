//! `shardscope gather CKPT` on the torch-written checkpoints of `tests/fixtures/formats`: every
//! input kind (full `.pt`, HF-sharded safetensors, FSDP1 SHARDED / LOCAL per-rank files under both
//! `use_orig_params`, FSDP2 DTensor per-rank files, both DCP serializations) is gathered under a
//! layout, verified, written with `-o`, and the written parameters must equal torch's full state
//! dict values bit for bit. Those values are `expected/*.safetensors`, written by torch
//! (`gen_formats.py`); the model description is `derived/model.json`, written by torch
//! (`derived/gen_derived.py`: `Net().named_parameters()`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Command, Output};

fn formats() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/formats")
}

fn shardscope(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run shardscope")
}

fn p(rel: &str) -> String {
    formats().join(rel).to_str().unwrap().to_owned()
}

/// Torch's full values: `expected/<file>.safetensors` keys `<prefix><fqn>`.
fn torch_values(
    file: &str,
    prefix: &str,
) -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(formats().join("expected").join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let model: serde_json::Value =
        serde_json::from_slice(&std::fs::read(formats().join("derived/model.json")).unwrap())
            .unwrap();
    model["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|param| {
            let fqn = param["fqn"].as_str().unwrap();
            let t = st
                .tensor(&format!("{prefix}{fqn}"))
                .unwrap_or_else(|e| panic!("{file}: {prefix}{fqn}: {e}"));
            (
                fqn.to_owned(),
                t.dtype(),
                t.shape().to_vec(),
                t.data().to_vec(),
            )
        })
        .collect()
}

/// Gathers, verifies and writes; the output must hold exactly torch's values.
fn gather_equals_torch(ckpt: &[String], flags: &[&str], expected: &str, prefix: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.safetensors");
    let mut args: Vec<String> = vec!["gather".into()];
    args.extend(ckpt.iter().cloned());
    args.extend(["--model".into(), p("derived/model.json")]);
    args.extend(flags.iter().map(|s| (*s).to_owned()));
    args.extend([
        "--verify".into(),
        "-q".into(),
        "-o".into(),
        out_path.to_str().unwrap().to_owned(),
    ]);
    let out = shardscope(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{args:?}\n{stdout}\n{stderr}");
    assert!(stdout.contains("verify: OK"), "{args:?}\n{stdout}");
    let written = std::fs::read(&out_path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&written).unwrap();
    let want = torch_values(expected, prefix);
    assert_eq!(st.len(), want.len(), "{args:?}: {:?}", st.names());
    for (fqn, dtype, shape, data) in want {
        let got = st
            .tensor(&fqn)
            .unwrap_or_else(|e| panic!("{args:?}: {fqn}: {e}"));
        assert_eq!(got.dtype(), dtype, "{args:?}: {fqn}");
        assert_eq!(got.shape(), shape.as_slice(), "{args:?}: {fqn}");
        assert!(
            got.data() == data.as_slice(),
            "{args:?}: {fqn}: values differ from torch's"
        );
    }
}

fn v(list: &[&str]) -> Vec<String> {
    list.iter().map(|r| p(r)).collect()
}

#[test]
fn full_checkpoints_cut_with_our_layout_equal_torch() {
    for orig in ["fsdp1_orig0", "fsdp1_orig1"] {
        let ckpt = v(&[&format!("{orig}/rank0_full.pt")]);
        let expected = format!("{orig}__rank0_full.safetensors");
        for flags in [
            &["--world-size", "2"][..],
            &["--world-size", "3", "--use-orig-params"],
            &["--world-size", "4", "--api", "fsdp2"],
        ] {
            gather_equals_torch(&ckpt, flags, &expected, "");
        }
    }
    // HF-sharded safetensors (two files and an index), written by torch's HuggingFaceStorageWriter.
    gather_equals_torch(
        &v(&["hf_sharded"]),
        &["--world-size", "2"],
        "hf_sharded.safetensors",
        "",
    );
}

#[test]
fn fsdp1_local_flat_shards_equal_torch() {
    gather_equals_torch(
        &v(&["fsdp1_orig0/rank0_local.pt", "fsdp1_orig0/rank1_local.pt"]),
        &[],
        "fsdp1_orig0__rank0_full.safetensors",
        "",
    );
    gather_equals_torch(
        &v(&["fsdp1_orig1/rank0_local.pt", "fsdp1_orig1/rank1_local.pt"]),
        &["--use-orig-params"],
        "fsdp1_orig1__rank0_full.safetensors",
        "",
    );
}

#[test]
fn fsdp2_dtensor_local_shards_equal_torch() {
    // As saved (local chunks padded to the shard size), and assembled then cut with FSDP1's layout.
    let ckpt = v(&["fsdp2/rank0_model.pt", "fsdp2/rank1_model.pt"]);
    gather_equals_torch(&ckpt, &["--api", "fsdp2"], "dcp.safetensors", "model/");
    gather_equals_torch(
        &ckpt,
        &["--read-as", "full", "--world-size", "3"],
        "dcp.safetensors",
        "model/",
    );
}

#[test]
fn sharded_and_dcp_checkpoints_assembled_then_cut_equal_torch() {
    for orig in ["fsdp1_orig0", "fsdp1_orig1"] {
        gather_equals_torch(
            &v(&[
                &format!("{orig}/rank0_sharded.pt"),
                &format!("{orig}/rank1_sharded.pt"),
            ]),
            &["--world-size", "3", "--use-orig-params"],
            &format!("{orig}__rank0_full.safetensors"),
            "",
        );
    }
    for dir in ["dcp_torch_save", "dcp_safetensors"] {
        gather_equals_torch(
            &v(&[dir]),
            &["--world-size", "2", "--api", "fsdp2"],
            "dcp.safetensors",
            "model/",
        );
        gather_equals_torch(
            &v(&[dir]),
            &["--world-size", "2", "--select", "model"],
            "dcp.safetensors",
            "model/",
        );
    }
}

fn fails_with(args: &[String], needles: &[&str]) {
    let out = shardscope(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` not in {err}");
    }
}

#[test]
fn wrong_layout_flags_for_saved_shards_are_clear_errors() {
    let model = p("derived/model.json");
    let mut local = vec!["gather".to_owned()];
    local.extend(v(&[
        "fsdp1_orig0/rank0_local.pt",
        "fsdp1_orig0/rank1_local.pt",
    ]));
    local.extend(["--model".into(), model.clone()]);
    // Saved under use_orig_params=False, read as if True: the shard sizes disagree.
    let mut a = local.clone();
    a.push("--use-orig-params".into());
    fails_with(&a, &["_flat_param", "bytes"]);
    // Two ranks' files, three ranks claimed.
    let mut a = local.clone();
    a.extend(["--world-size".into(), "3".into()]);
    fails_with(&a, &["2 ranks", "--world-size says 3"]);
    // Flat shards cannot be cut as full parameters.
    let mut a = local;
    a.extend(["--read-as".into(), "full".into()]);
    fails_with(&a, &["LOCAL", "hint:"]);
    // FSDP2 local shards under FSDP1's layout.
    let mut a = vec!["gather".to_owned()];
    a.extend(v(&["fsdp2/rank0_model.pt", "fsdp2/rank1_model.pt"]));
    a.extend(["--model".into(), model]);
    fails_with(&a, &["--api fsdp2"]);
}

#[test]
fn a_flipped_bit_in_a_saved_local_shard_lands_in_exactly_that_output_byte() {
    // A copy of the FSDP2 files with one bit of rank 1's `embed.weight` chunk (rows 4..7) flipped:
    // the gathered parameter differs from torch's in exactly that byte (the shard is placed where
    // the layout says, nothing else is read from elsewhere).
    let dir = tempfile::tempdir().unwrap();
    let r0 = dir.path().join("rank0_model.pt");
    let r1 = dir.path().join("rank1_model.pt");
    std::fs::copy(formats().join("fsdp2/rank0_model.pt"), &r0).unwrap();
    let mut bytes = std::fs::read(formats().join("fsdp2/rank1_model.pt")).unwrap();
    // embed.weight's rank-1 chunk: find torch's bytes for rows 4..7 and flip one bit.
    let want = torch_values("dcp.safetensors", "model/");
    let embed = &want.iter().find(|w| w.0 == "embed.weight").unwrap().3;
    let rows = &embed[4 * 5 * 4..];
    let at = bytes
        .windows(rows.len())
        .position(|w| w == rows)
        .expect("rank 1's embed rows are stored verbatim");
    bytes[at] ^= 1;
    std::fs::write(&r1, &bytes).unwrap();
    let out_path = dir.path().join("out.safetensors");
    let args: Vec<String> = vec![
        "gather".into(),
        r0.to_str().unwrap().into(),
        r1.to_str().unwrap().into(),
        "--model".into(),
        p("derived/model.json"),
        "--api".into(),
        "fsdp2".into(),
        "-q".into(),
        "-o".into(),
        out_path.to_str().unwrap().into(),
    ];
    let out = shardscope(&args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read(&out_path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&written).unwrap();
    let got = st.tensor("embed.weight").unwrap();
    let diff: Vec<usize> = got
        .data()
        .iter()
        .zip(embed)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(diff, vec![4 * 5 * 4], "exactly the flipped byte differs");
}
