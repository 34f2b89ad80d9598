//! Fixture conversions stay byte-identical: reruns every `shardscope convert` recorded in
//! `tests/fixtures/conversion_hashes.json` and compares the sha256 of each output file.
//!
//! A regression guard across refactors, not a correctness oracle: the table was recorded from the
//! commit it names (field `recorded_from_commit`), and correctness is what the torch interop tests
//! check. A failure means the bytes changed; if that is intended (a format change), re-record with
//! `tests/fixtures/record_conversion_hashes.py` in the commit that makes the change and say why.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use sha2::{Digest, Sha256};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Relative name → sha256 hex of every file under `dir`.
fn hash_tree(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let name = p
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                let digest = Sha256::digest(std::fs::read(&p).unwrap());
                let mut hex = String::with_capacity(64);
                for b in digest {
                    write!(hex, "{b:02x}").unwrap();
                }
                out.insert(name, hex);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

#[test]
fn recorded_conversions_are_byte_identical() {
    let root = repo_root();
    let table_path = root.join("tests/fixtures/conversion_hashes.json");
    let table: Value = serde_json::from_slice(&std::fs::read(&table_path).unwrap()).unwrap();
    let commit = table["recorded_from_commit"].as_str().unwrap();
    let conversions = table["conversions"].as_array().unwrap();
    assert!(
        conversions.len() >= 20,
        "{} holds only {} conversions",
        table_path.display(),
        conversions.len()
    );
    let mut failures = Vec::new();
    for conv in conversions {
        let fixture = conv["fixture"].as_str().unwrap();
        let out = tempfile::tempdir().unwrap();
        let out_str = out.path().to_str().unwrap();
        let args: Vec<String> = conv["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().replace("{out}", out_str))
            .collect();
        let shown = format!(
            "shardscope {}",
            conv["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(" ")
        );
        let run = Command::new(crate::common::shardscope_bin())
            .args(&args)
            .current_dir(&root)
            .output()
            .unwrap();
        if !run.status.success() {
            failures.push(format!(
                "{fixture}: `{shown}` failed ({}):\n{}",
                run.status,
                String::from_utf8_lossy(&run.stderr)
            ));
            continue;
        }
        let expected: BTreeMap<String, String> = conv["outputs"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
            .collect();
        let got = hash_tree(out.path());
        if got != expected {
            let mut diff = String::new();
            for (name, want) in &expected {
                match got.get(name) {
                    None => writeln!(diff, "    {name}: missing (recorded {want})").unwrap(),
                    Some(h) if h != want => {
                        writeln!(diff, "    {name}: sha256 {h}, recorded {want}").unwrap();
                    }
                    Some(_) => {}
                }
            }
            for name in got.keys().filter(|n| !expected.contains_key(*n)) {
                writeln!(diff, "    {name}: not in the recorded outputs").unwrap();
            }
            failures.push(format!("{fixture}: `{shown}` wrote other bytes:\n{diff}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} recorded conversions changed (table recorded from commit {commit}: a regression \
         guard, not a correctness oracle; if the change is intended, re-record with \
         tests/fixtures/record_conversion_hashes.py and say why):\n\n{}",
        failures.len(),
        conversions.len(),
        failures.join("\n")
    );
}
