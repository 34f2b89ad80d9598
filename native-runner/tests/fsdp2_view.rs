//! FSDP2 per-rank folders convert through the index (`core::model::fsdp2_view` names the
//! optimizer ids): the streamed `torch.save` holds exactly the bytes of the in-memory transforms
//! (`full_model_from_fsdp2`, `full_optim_from_fsdp2`, proven against torch's full state dicts in
//! `tests/interop/check_fsdp2_optim.py`) serialised with `bridge::to_torch_save`, for torch-written
//! folders of model + optimizer files (2 ranks) and of combined `{"model", "optim"}` files (3 ranks).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use shardscope_core::model::bridge::{self, RootDict};
use shardscope_core::model::tree::{Dict, Key, Node};
use shardscope_core::transform::fsdp2_optim::{
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
