//! `diff --select PREFIX` applies the prefix on each side where it is an app-state wrapper. A
//! trainer's DCP app state (`model.model.embed_tokens.weight`, written by torch 2.15:
//! tests/fixtures/app_state/gen_app_state.py) against the same model as HF names it in its merged
//! safetensors (`model.embed_tokens.weight`, written by `safetensors.torch.save_file` from the same
//! tensors) must match every tensor; torch wrote both, so equality is the truth.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/app_state")
        .join(name)
        .to_str()
        .unwrap()
        .to_owned()
}

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .unwrap()
}

fn report(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The statuses of a diff report: `(status, count)` sorted.
fn statuses(report: &serde_json::Value) -> Vec<(String, usize)> {
    let mut counts = std::collections::BTreeMap::new();
    for e in report["entries"].as_array().unwrap() {
        *counts
            .entry(e["status"].as_str().unwrap().to_owned())
            .or_insert(0) += 1;
    }
    counts.into_iter().collect()
}

#[test]
fn app_state_against_hf_names_matches_every_tensor() {
    let (dcp, merged) = (fixture("dcp"), fixture("merged.safetensors"));
    for (a, b) in [(&dcp, &merged), (&merged, &dcp)] {
        let out = shardscope(&["diff", a, b, "--select", "model", "--json"]);
        let r = report(&out);
        assert_eq!(out.status.code(), Some(0), "{r:#}");
        // Every one of the model's 14 tensors (the keys torch saved in merged.safetensors).
        let st = statuses(&r);
        assert_eq!(r["entries"].as_array().unwrap().len(), 14, "{st:?}");
        assert_eq!(st.len(), 1, "{st:?}");
        assert_eq!(st[0].0, "match", "{st:?}");
        assert!(
            r["entries"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["fqn"] == "lm_head.weight")
        );
        // The notes say on which side the prefix was kept as part of the names.
        let notes = r["notes"].to_string();
        assert!(
            notes.contains("merged.safetensors: `model.` is kept"),
            "{notes}"
        );
    }
}

#[test]
fn prefix_is_stripped_on_both_sides_when_both_wrap() {
    // The app state against itself: `model.` wraps both sides; `step` is outside and not compared.
    let dcp = fixture("dcp");
    let out = shardscope(&["diff", &dcp, &dcp, "--select", "model", "--json"]);
    let r = report(&out);
    assert_eq!(out.status.code(), Some(0), "{r:#}");
    let keys: Vec<&str> = r["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["fqn"].as_str().unwrap())
        .collect();
    assert!(keys.contains(&"model.embed_tokens.weight"), "{keys:?}");
    assert!(!keys.iter().any(|k| k.starts_with("step")), "{keys:?}");
}
