//! The format ⇄ tree bridge (`shardscope_core::bridge`): every `rank*.pt` that torch wrote
//! in `tests/fixtures/optim` reads as the same tree as the committed `tree.json` +
//! `tensors.safetensors` form of the same objects, and trees written back with `torch.save`'s
//! format are loaded by real torch (`weights_only=True`) and re-saved by torch into files that read
//! as the original trees.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use crate::transform_support;

use std::path::PathBuf;
use std::process::Command;

use shardscope_core::bridge::{self, RootDict};
use shardscope_core::model::tree::{Dict, Node};
use transform_support::{assert_same, load};

const PT_SCENARIOS: [&str; 3] = ["nested_ws2_uop0", "nested_ws2_uop1", "tied_ws2_uop0"];

fn read_pt(name: &str, rank: usize) -> Dict {
    let path = transform_support::dir()
        .join(name)
        .join(format!("rank{rank}.pt"));
    let bytes = std::fs::read(&path).unwrap();
    match bridge::node_from_torch_save(&bytes, &path.display().to_string()).unwrap() {
        Node::Dict(d) => d,
        other => panic!("{}: root is {}", path.display(), other.kind_name()),
    }
}

#[test]
fn torch_files_read_as_the_committed_trees() {
    let mut compared = 0;
    for name in PT_SCENARIOS {
        let sc = load(name);
        for rank in 0..sc.ranks.len() {
            let from_pt = read_pt(name, rank);
            assert!(!from_pt.is_empty());
            for (key, value) in from_pt.iter() {
                let key = key.as_str().unwrap();
                assert_same(
                    value,
                    sc.get(rank, key),
                    &format!("{name}/rank{rank}/{key}"),
                );
                compared += 1;
            }
        }
    }
    // optim_local, model_full, model_sharded, model_local, osd_full, osd_sharded per rank.
    assert_eq!(compared, 3 * 2 * 6);
}

#[test]
fn errors_name_the_file() {
    let err = bridge::node_from_torch_save(b"not a zip", "x/rank0.pt").unwrap_err();
    assert!(err.to_string().starts_with("x/rank0.pt: "), "{err}");
}

fn python() -> Option<PathBuf> {
    shardscope_tests::torch_python()
}

/// Writes plain (non-distributed) trees with our writer; torch loads each with
/// `weights_only=True`, checks the root type, and saves it again with `torch.save`; the re-saved
/// file must read as the original tree.
#[test]
fn written_trees_round_trip_through_torch() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cases = Vec::new();
    for name in PT_SCENARIOS {
        let original = read_pt(name, 1);
        for (key, root) in [
            ("optim_local", RootDict::Plain),
            ("osd_full", RootDict::Plain),
            ("model_full", RootDict::Ordered),
        ] {
            let node = original.get_str(key).unwrap().clone();
            let file = dir.path().join(format!("{name}_{key}.pt"));
            std::fs::write(&file, bridge::to_torch_save(&node, root, 1, 2).unwrap()).unwrap();
            let kind = if root == RootDict::Ordered {
                "OrderedDict"
            } else {
                "dict"
            };
            cases.push((file, kind, node));
        }
    }
    let script = r"
import sys, torch, collections
for path, kind in zip(sys.argv[1::2], sys.argv[2::2]):
    obj = torch.load(path, weights_only=True)
    want = collections.OrderedDict if kind == 'OrderedDict' else dict
    assert type(obj) is want, (path, type(obj))
    torch.save(obj, path + '.resaved')
";
    let mut cmd = Command::new(&python);
    cmd.args(["-c", script]);
    for (file, kind, _) in &cases {
        cmd.arg(file).arg(kind);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "torch could not load our files:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (file, _, node) in &cases {
        let resaved = PathBuf::from(format!("{}.resaved", file.display()));
        let bytes = std::fs::read(&resaved).unwrap();
        let back = bridge::node_from_torch_save(&bytes, &resaved.display().to_string()).unwrap();
        assert_same(&back, node, &file.display().to_string());
    }
}
