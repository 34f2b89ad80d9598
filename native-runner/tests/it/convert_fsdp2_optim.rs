//! `shardscope convert` of FSDP2 per-rank files with optimizer state (tests/fixtures/fsdp2_optim,
//! written by torch 2.15): the full `{"model", "optim"}` state must equal, key for key (in order)
//! and bit for bit, what torch's `get_model_state_dict` / `get_optimizer_state_dict(...,
//! full_state_dict=True)` returned (`expected/ws{2,3}_full.pt`, saved by torch). Also: safetensors
//! with `--select`, `--model`, clear errors, and (with torch) the interop script
//! tests/interop/check_fsdp2_optim.py, which loads our DCP output into real FSDP2 models.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shardscope_core::bridge::node_from_torch_save;
use shardscope_core::model::tree::{Node, Tensor};

fn fixtures() -> PathBuf {
    shardscope_tests::fixtures_dir().join("fsdp2_optim")
}

fn convert(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(crate::common::shardscope_bin())
        .arg("convert")
        .args(args)
        .output()
        .unwrap()
}

fn read(path: &Path) -> Node {
    node_from_torch_save(&std::fs::read(path).unwrap(), &path.display().to_string()).unwrap()
}

fn expected(ws: usize) -> Node {
    read(&fixtures().join("expected").join(format!("ws{ws}_full.pt")))
}

fn run_ok(src: &Path, out: &Path, extra: &[&str]) {
    let mut args = vec![src.as_os_str(), "-o".as_ref(), out.as_os_str()];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    let o = convert(&args);
    assert!(
        o.status.success(),
        "convert failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn per_rank_files_give_torch_full_state_dicts() {
    let tmp = tempfile::tempdir().unwrap();
    // ws2: separate model and optimizer files; ws3: one {"model", "optim"} file per rank, uneven
    // dim-0 chunks and empty shards.
    for ws in [2, 3] {
        let out = tmp.path().join(format!("ws{ws}.pt"));
        run_ok(&fixtures().join(format!("ws{ws}")), &out, &[]);
        let ours = read(&out);
        let torch = expected(ws);
        assert_eq!(ours, torch, "ws{ws}: differs from torch's full state dicts");
        // The same with the parameter names taken from the model description.
        let out = tmp.path().join(format!("ws{ws}_model.pt"));
        let desc = fixtures().join("model.json");
        run_ok(
            &fixtures().join(format!("ws{ws}")),
            &out,
            &["--model", desc.to_str().unwrap()],
        );
        assert_eq!(read(&out), torch, "ws{ws} with --model");
    }
}

#[test]
fn frozen_parameter_has_no_state_but_stays_in_its_group() {
    // Guards that the expected file is what the brief describes (torch's shapes, not ours).
    let torch = expected(3);
    let optim = torch
        .as_dict()
        .unwrap()
        .get_str("optim")
        .unwrap()
        .as_dict()
        .unwrap();
    let state = optim.get_str("state").unwrap().as_dict().unwrap();
    assert!(state.get_str("frozen.weight").is_none());
    let groups = optim.get_str("param_groups").unwrap().as_list().unwrap();
    assert_eq!(groups.len(), 2);
    let g0 = groups[0].as_dict().unwrap().get_str("params").unwrap();
    assert!(
        g0.as_list()
            .unwrap()
            .contains(&Node::Str("frozen.weight".into()))
    );
}

fn safetensors_tensors(path: &Path) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                v.shape().iter().map(|&d| d as u64).collect(),
                v.data().to_vec(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn flat_tensors(node: &Node, prefix: &str, out: &mut Vec<(String, Vec<u64>, Vec<u8>)>) {
    match node {
        Node::Tensor(Tensor { shape, data, .. }) => {
            out.push((prefix.to_owned(), shape.clone(), data.clone()));
        }
        Node::Dict(d) => {
            for (k, v) in d.iter() {
                let p = if prefix.is_empty() {
                    k.to_string()
                } else {
                    format!("{prefix}.{k}")
                };
                flat_tensors(v, &p, out);
            }
        }
        _ => {}
    }
}

#[test]
fn safetensors_with_select_hold_torch_values() {
    let tmp = tempfile::tempdir().unwrap();
    let torch = expected(3);
    for select in ["model", "optim"] {
        let out = tmp.path().join(format!("{select}.safetensors"));
        run_ok(&fixtures().join("ws3"), &out, &["--select", select]);
        let mut want = Vec::new();
        flat_tensors(
            torch.as_dict().unwrap().get_str(select).unwrap(),
            "",
            &mut want,
        );
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(safetensors_tensors(&out), want, "--select {select}");
    }
}

fn run_err(dir: &Path) -> String {
    let out = dir.join("out.pt");
    let o = convert(&[dir.as_os_str(), "-o".as_ref(), out.as_os_str()]);
    assert_eq!(o.status.code(), Some(2), "expected a bad-input exit");
    assert!(!out.exists());
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn folder_with(tmp: &Path, name: &str, files: &[PathBuf]) -> PathBuf {
    let dir = tmp.join(name);
    std::fs::create_dir(&dir).unwrap();
    for f in files {
        std::fs::copy(f, dir.join(f.file_name().unwrap())).unwrap();
    }
    dir
}

#[test]
fn broken_folders_give_errors_naming_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let ws2 = fixtures().join("ws2");
    let all: Vec<PathBuf> = [
        "rank0_model.pt",
        "rank1_model.pt",
        "rank0_optim.pt",
        "rank1_optim.pt",
    ]
    .iter()
    .map(|n| ws2.join(n))
    .collect();

    // A missing rank file.
    let dir = folder_with(tmp.path(), "missing", &all[..3]);
    let err = run_err(&dir);
    assert!(err.contains("rank{r}_optim.pt"), "{err}");
    let ws3 = fixtures().join("ws3");
    let dir = folder_with(
        tmp.path(),
        "missing3",
        &[ws3.join("rank0.pt"), ws3.join("rank2.pt")],
    );
    let err = run_err(&dir);
    assert!(err.contains("missing: rank1.pt"), "{err}");

    // State names that differ between ranks.
    let dir = folder_with(tmp.path(), "names", &all[..3]);
    std::fs::copy(
        fixtures().join("bad_names/rank1_optim.pt"),
        dir.join("rank1_optim.pt"),
    )
    .unwrap();
    let err = run_err(&dir);
    assert!(
        err.contains("rank1_optim.pt: state.1: optimizer state names")
            && err.contains("'exp_avg_sqr'"),
        "{err}"
    );

    // An optimizer id with no parameter name.
    let dir = folder_with(tmp.path(), "id", &all[..2]);
    for r in 0..2 {
        let name = format!("rank{r}_optim.pt");
        std::fs::copy(fixtures().join("bad_id").join(&name), dir.join(&name)).unwrap();
    }
    let err = run_err(&dir);
    assert!(
        err.contains("rank0_optim.pt: state.9: optimizer id 9 has no parameter name"),
        "{err}"
    );

    // More optimizer parameters than DTensor entries: the mapping cannot be decided.
    let dir = folder_with(tmp.path(), "count", &all);
    let desc = fixtures().join("model.json");
    let text = std::fs::read_to_string(&desc).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["params"].as_array_mut().unwrap().pop();
    let short = tmp.path().join("short.json");
    std::fs::write(&short, json.to_string()).unwrap();
    let out = dir.join("out.pt");
    let o = convert(&[
        dir.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--model".as_ref(),
        short.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err.contains("cannot tell which parameter each optimizer id is") && err.contains("hint:"),
        "{err}"
    );
}

#[test]
fn outputs_load_in_torch_and_dcp_loads_into_fsdp2() {
    crate::common::run_interop_script("check_fsdp2_optim.py");
}
