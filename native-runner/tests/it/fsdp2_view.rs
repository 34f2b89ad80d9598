//! FSDP2 per-rank folders convert through the index (`core::view::fsdp2` names the
//! optimizer ids): the streamed `torch.save` holds exactly the bytes of the in-memory transforms
//! (`full_model_from_fsdp2`, `full_optim_from_fsdp2`, proven against torch's full state dicts in
//! `tests/interop/check_fsdp2_optim.py`) serialised with `bridge::to_torch_save`, for torch-written
//! folders of model + optimizer files (2 ranks) and of combined `{"model", "optim"}` files (3 ranks).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use shardscope_core::bridge::{self, RootDict};
use shardscope_core::model::tree::{Dict, Key, Node};
use shardscope_core::transform::reference::fsdp2_optim::{
    IdNames, dtensor_param_names, full_model_from_fsdp2, full_optim_from_fsdp2,
};

fn whole(path: &Path) -> Dict {
    let bytes = std::fs::read(path).unwrap();
    match bridge::node_from_torch_save(&bytes, &path.display().to_string()).unwrap() {
        Node::Dict(d) => d,
        other => panic!("{}: {}", path.display(), other.kind_name()),
    }
}

/// Every file read whole, the in-memory transforms, one `torch.save` of the result.
fn in_memory(dir: &Path, ws: usize, combined: bool) -> Vec<u8> {
    let (mut models, mut optims, mut labels) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..ws {
        if combined {
            let path = dir.join(format!("rank{r}.pt"));
            let mut d = whole(&path);
            let Some(Node::Dict(m)) = d.remove(&Key::str("model")) else {
                panic!("no model")
            };
            let Some(Node::Dict(o)) = d.remove(&Key::str("optim")) else {
                panic!("no optim")
            };
            models.push(m);
            optims.push(o);
            labels.push(path.display().to_string());
        } else {
            let path = dir.join(format!("rank{r}_model.pt"));
            models.push(whole(&path));
            optims.push(whole(&dir.join(format!("rank{r}_optim.pt"))));
            labels.push(path.display().to_string());
        }
    }
    let model_refs: Vec<&Dict> = models.iter().collect();
    let full_model = full_model_from_fsdp2(&model_refs, &labels).unwrap();
    let names = dtensor_param_names(&models[0]);
    let shapes: BTreeMap<String, Vec<u64>> = full_model
        .iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.as_tensor()?.shape.clone())))
        .collect();
    let optim_refs: Vec<&Dict> = optims.iter().collect();
    let ids = IdNames {
        names: &names,
        origin: "test",
        shapes: &shapes,
    };
    let full_optim = full_optim_from_fsdp2(&optim_refs, &labels, &ids).unwrap();
    let mut root = Dict::new();
    root.insert(Key::str("model"), Node::Dict(full_model));
    root.insert(Key::str("optim"), Node::Dict(full_optim));
    bridge::to_torch_save(&Node::Dict(root), RootDict::Plain, 0, 1).unwrap()
}

#[test]
fn streamed_output_equals_the_in_memory_transform() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/fsdp2_optim");
    for (ws, n, combined) in [("ws2", 2, false), ("ws3", 3, true)] {
        let tmp = tempfile::tempdir().unwrap();
        // `archive.pt`: torch names the records after the file's stem, as bridge does "archive".
        let out = tmp.path().join("archive.pt");
        let o = Command::new(env!("CARGO_BIN_EXE_shardscope"))
            .args(["convert", fixtures.join(ws).to_str().unwrap(), "-o"])
            .arg(&out)
            .arg("--quiet")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{ws}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            std::fs::read(&out).unwrap() == in_memory(&fixtures.join(ws), n, combined),
            "{ws}: the streamed torch.save differs from the in-memory one"
        );
    }
}

/// `diff` and `verify` of an FSDP2 per-rank folder see the optimizer state keyed by FQN, as
/// torch's full state dicts hold it (`expected/*_full.pt`, written by torch from the same run): no
/// difference, with or without `--model`. Before, `diff` reported the integer ids missing and the
/// FQNs unexpected, and `--model` sent the folder through the FSDP1 layout.
#[test]
fn diff_of_a_folder_with_torch_full_state_dicts_names_the_optimizer_ids() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let model = root.join("fsdp2_optim/model.json");
    for (folder, full) in [
        ("fsdp2_optim/ws2", "fsdp2_optim/expected/ws2_full.pt"),
        ("fsdp2_optim/ws3", "fsdp2_optim/expected/ws3_full.pt"),
        ("fsdp2_hsdp/ws4_2x2", "fsdp2_hsdp/expected/ws4_2x2_full.pt"),
    ] {
        for with_model in [false, true] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_shardscope"));
            cmd.args(["diff", "--json"])
                .arg(root.join(folder))
                .arg(root.join(full));
            if with_model {
                cmd.arg("--model").arg(&model);
            }
            let o = cmd.output().unwrap();
            let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
                panic!(
                    "{folder} (--model: {with_model}): {e}: {}",
                    String::from_utf8_lossy(&o.stderr)
                )
            });
            assert!(
                o.status.success(),
                "{folder} (--model: {with_model}): {report}"
            );
            let text = report.to_string();
            assert!(
                text.contains("optim.state.block.lin.weight.exp_avg"),
                "{folder}: {text}"
            );
        }
    }
}
