//! The viewer reads per-rank checkpoints as the CLI does (both through `Checkpoint::open`): each
//! torch-written per-rank fixture opened in the viewer (FSDP2, HSDP, verl's FSDP2 folder with extra
//! state, verl's FSDP1 folder with its model description opened first) holds exactly the tensors of
//! torch's own full state dicts (`expected/*.pt`, saved by the generators with
//! `get_model_state_dict`/`get_optimizer_state_dict(full_state_dict=True)` or FULL_STATE_DICT and
//! `FSDP.optim_state_dict`), with their dtypes and shapes. `native-runner/tests/it/front_ends.rs`
//! checks `inspect` against the same files.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use shardscope_core::MemorySource;
use shardscope_core::index::{CheckpointIndex, EntryKind, index_source};
use shardscope_viewer::Viewer;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// `key -> (dtype, shape)` of the tensors under `model.`/`optim.` (extra state is not in torch's
/// full state dicts).
type Tensors = BTreeMap<String, (String, Vec<u64>)>;

fn tensors(index: &CheckpointIndex, prefix: &str) -> Tensors {
    index
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
        .map(|e| {
            (
                format!("{prefix}{}", e.key),
                (
                    e.dtype.map(|d| d.name().to_owned()).unwrap_or_default(),
                    e.shape.clone().unwrap_or_default(),
                ),
            )
        })
        .filter(|(k, _)| k.starts_with("model.") || k.starts_with("optim."))
        .collect()
}

/// torch's full state dict file, read as a plain `torch.save` file.
fn torch_full(path: &Path, prefix: &str) -> Tensors {
    let mut mem = MemorySource::new();
    mem.insert(
        path.file_name().unwrap().to_str().unwrap().to_owned(),
        std::fs::read(path).unwrap(),
    );
    tensors(&index_source(&mem).unwrap(), prefix)
}

/// The folder's files opened in the viewer as one checkpoint (after `model`, a description).
fn viewer_open(dir: &Path, model: Option<&Path>) -> Tensors {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    if let Some(m) = model {
        v.open_bytes(
            m.file_name().unwrap().to_str().unwrap(),
            std::fs::read(m).unwrap(),
        );
        assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
        assert!(v.model.is_some(), "{:?}", v.messages);
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    for p in names {
        v.open_bytes(
            p.file_name().unwrap().to_str().unwrap(),
            std::fs::read(&p).unwrap(),
        );
    }
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    let ckpt = v
        .checkpoint
        .as_ref()
        .unwrap_or_else(|| panic!("nothing opened: {:?}", v.messages));
    tensors(&ckpt.index, "")
}

#[test]
fn per_rank_folders_read_as_torch_full_state_dicts() {
    let f = fixtures();
    let cases: [(&str, PathBuf, Tensors); 3] = [
        (
            "FSDP2",
            f.join("fsdp2_optim/ws2"),
            torch_full(&f.join("fsdp2_optim/expected/ws2_full.pt"), ""),
        ),
        (
            "HSDP",
            f.join("fsdp2_hsdp/ws4_2x2"),
            torch_full(&f.join("fsdp2_hsdp/expected/ws4_2x2_full.pt"), ""),
        ),
        (
            "verl FSDP2",
            f.join("trainer_folders/verl_fsdp2"),
            torch_full(&f.join("trainer_folders/expected/verl_fsdp2_full.pt"), ""),
        ),
    ];
    for (what, dir, expected) in cases {
        assert!(!expected.is_empty(), "{what}");
        assert_eq!(
            viewer_open(&dir, None),
            expected,
            "{what}: {}",
            dir.display()
        );
    }
}

#[test]
fn fsdp1_folder_reads_through_the_opened_description() {
    let f = fixtures().join("trainer_folders");
    let mut expected = torch_full(&f.join("expected/verl_fsdp1_model.pt"), "model.");
    expected.extend(torch_full(
        &f.join("expected/verl_fsdp1_optim.pt"),
        "optim.",
    ));
    let got = viewer_open(
        &f.join("verl_fsdp1"),
        Some(&f.join("verl_fsdp1_model.json")),
    );
    assert_eq!(got, expected);
    // Without the description the flat optimizer pieces have no global shape: not the same.
    assert_ne!(viewer_open(&f.join("verl_fsdp1"), None), expected);
}
