//! Folders of several per-rank sets as trainers write them, told apart by what each set is:
//! torch_checkpointing's `<item>_<rank>.pt` (written by the library itself,
//! `tests/fixtures/trainer_folders/gen_torch_checkpointing.py`: FSDP2 model, torchtitan's
//! flattened optimizer, `lr_scheduler`, `train_state`, `step`), and verl's extra state holding
//! floating-point tensors. References are torch's own full state dicts (`expected/tc_full_*.pt`),
//! compared in torch.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::python;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trainer_folders")
}

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(out: &Output, what: &str) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{stdout}\n{stderr}",
        out.status.code()
    );
    (stdout, stderr)
}

/// The keys `inspect --json` lists.
fn keys(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["inspect", s(dir), "--json"];
    args.extend_from_slice(extra);
    let (out, err) = ok(&shardscope(&args), &format!("inspect {}", dir.display()));
    assert!(!err.contains("several"), "{}: {err}", dir.display());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn torch_checkpointing_items_are_read_by_what_they_are() {
    for folder in ["tc_default", "tc_resharder"] {
        let dir = fixtures().join(folder);
        for extra in [
            &[][..],
            &[
                "--model-files",
                "model_{r}.pt",
                "--optim-files",
                "optimizer_{r}.pt",
            ][..],
        ] {
            let keys = keys(&dir, extra);
            let bad: Vec<&String> = keys
                .iter()
                .filter(|k| k.contains('{') || k.ends_with('.'))
                .collect();
            assert!(bad.is_empty(), "{folder} {extra:?}: {bad:?}");
            let mut wanted = vec![
                "model.tok_embeddings.weight",
                "model.output.weight",
                "optim.state.layers.1.feed_forward.w2.weight.exp_avg_sq",
                "optim.param_groups.norm.bias.lr",
            ];
            // Named sets: only those are read (the model's and the optimizer's).
            if extra.is_empty() {
                wanted.extend([
                    "extra.lr_scheduler.last_epoch",
                    "extra.train_state.ntokens_seen",
                    "extra.step",
                ]);
            }
            for want in wanted {
                assert!(
                    keys.iter().any(|k| k == want),
                    "{folder} {extra:?}: no {want}"
                );
            }
        }
    }
}

/// Runs `script` (argv: the files) in torch; it prints `OK` when every comparison holds.
fn torch_says_ok(script: &str, files: &[&Path]) {
    let Some(py) = python() else {
        eprintln!("skipped: no Python with torch");
        return;
    };
    let mut cmd = Command::new(py);
    cmd.arg("-c").arg(script);
    for f in files {
        cmd.arg(f);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l == "OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const SAME_AS_TORCH: &str = r#"
import sys, torch
got = torch.load(sys.argv[1], weights_only=True)
model = torch.load(sys.argv[2], weights_only=True)
optim = torch.load(sys.argv[3], weights_only=True)
def eq(a, b, at):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), at
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (at, list(a)[:5], list(b)[:5])
        for k in a:
            eq(a[k], b[k], f"{at}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            eq(x, y, f"{at}[{i}]")
    else:
        assert a == b, (at, a, b)
eq(model, got["model"], "model")
eq(optim, got["optim"], "optim")
print("OK")
"#;

/// A torch_checkpointing folder's items kept and converted as the library keeps them:
/// `convert --select extra -o .pt` loads in torch equal to the library's own per-rank loads
/// (`check`, run on the output and `expected`), bytes kept as bytes, and `diff` finds no mismatch;
/// the whole conversion equals torch's full state dicts (`{full_prefix}_full_model.pt`
/// and `{full_prefix}_full_optim.pt` beside `expected_items`); safetensors leaves the
/// bytes item `bytes_key` out, naming it, and writes no metadata key `is_bytes_key` matches,
/// while the JSON values stay in the metadata.
fn items_convert_like_the_library(
    dir: &Path,
    tmp: &Path,
    check: &str,
    expected_items: &Path,
    full_prefix: &str,
    bytes_key: &str,
    is_bytes_key: impl Fn(&str) -> bool,
) {
    let expected = expected_items.parent().unwrap();
    let pt = tmp.join("extra.pt");
    ok(
        &shardscope(&["convert", s(dir), "--select", "extra", "-o", s(&pt), "-q"]),
        "convert --select extra -o .pt",
    );
    torch_says_ok(check, &[&pt, expected_items]);
    let (out, _) = ok(
        &shardscope(&["diff", s(dir), s(&pt), "--select", "extra"]),
        "diff against the .pt",
    );
    assert!(out.contains("0 mismatch"), "{out}");
    // The model and optimizer still equal torch's full state dicts.
    let full = tmp.join("full.pt");
    ok(
        &shardscope(&["convert", s(dir), "-o", s(&full), "-q"]),
        "convert -o full.pt",
    );
    torch_says_ok(
        SAME_AS_TORCH,
        &[
            &full,
            &expected.join(format!("{full_prefix}_full_model.pt")),
            &expected.join(format!("{full_prefix}_full_optim.pt")),
        ],
    );

    // safetensors: the bytes are left out, named; the JSON values stay in the metadata.
    let st = tmp.join("extra.safetensors");
    let (_, err) = ok(
        &shardscope(&["convert", s(dir), "--select", "extra", "-o", s(&st)]),
        "convert --select extra -o .safetensors",
    );
    assert!(
        err.contains(&format!("{bytes_key} holds bytes")) && err.contains("not written"),
        "{err}"
    );
    let bytes = std::fs::read(&st).unwrap();
    let n = usize::try_from(u64::from_le_bytes(bytes[..8].try_into().unwrap())).unwrap();
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = header["__metadata__"].as_object().unwrap();
    assert!(!meta.keys().any(|k| is_bytes_key(k)), "{meta:?}");
    assert_eq!(meta["train_state.step"], "1");
}

/// torch_checkpointing with the model item as safetensors (`model/shard_{rank}.safetensors`:
/// each rank's local slice, the global geometry only in `metadata.pkl`): placed as DTensor places
/// them, equal to torch's full state dicts and to what the library's own load returns, key order
/// included (safetensors headers are sorted: the order comes from the flattened optimizer item).
#[test]
fn torch_checkpointing_safetensors_items_read_through_metadata_pkl() {
    let tmp = tempfile::tempdir().unwrap();
    let expected = fixtures().join("expected");
    let dir = fixtures().join("tc_safetensors");
    let keys = keys(&dir, &[]);
    for want in [
        "model.tok_embeddings.weight",
        "optim.state.output.weight.exp_avg",
        "extra.train_state.step",
    ] {
        assert!(keys.iter().any(|k| k == want), "no {want}: {keys:?}");
    }
    let out = tmp.path().join("tc.pt");
    ok(&shardscope(&["convert", s(&dir), "-o", s(&out)]), "convert");
    // Key order included: the files do not record it, the optimizer item's parameters do.
    torch_says_ok(
        SAME_AS_TORCH,
        &[
            &out,
            &expected.join("tc_full_model.pt"),
            &expected.join("tc_full_optim.pt"),
        ],
    );
    // The library's own load of the item into the model's state dict (generator): the same keys
    // in the same order, the same tensors; from the whole folder and with --model-only.
    let only = tmp.path().join("model.pt");
    ok(
        &shardscope(&["convert", s(&dir), "--model-only", "-o", s(&only), "-q"]),
        "convert --model-only",
    );
    torch_says_ok(
        r#"
import sys, torch
loaded = torch.load(sys.argv[1], weights_only=True)
for got in (torch.load(sys.argv[2], weights_only=True)["model"], torch.load(sys.argv[3], weights_only=True)):
    assert list(got) == list(loaded), (list(got)[:4], list(loaded)[:4])
    for k, v in loaded.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
print("OK")
"#,
        &[&expected.join("tc_safetensors_loaded.pt"), &out, &only],
    );
    // A slice that does not fit its global shape, or a missing item file: errors naming the file.
    let broken = tmp.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name();
        if name != "model" {
            std::fs::copy(dir.join(&name), broken.join(&name)).unwrap();
        }
    }
    std::fs::create_dir(broken.join("model")).unwrap();
    std::fs::copy(
        dir.join("model/shard_0.safetensors"),
        broken.join("model/shard_0.safetensors"),
    )
    .unwrap();
    let res = shardscope(&["inspect", s(&broken)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(err.contains("model/shard_1.safetensors"), "{err}");
    // A safetensors file metadata.pkl does not describe (another save's leftover): refused, named,
    // never left out silently.
    std::fs::copy(
        dir.join("model/shard_1.safetensors"),
        broken.join("model/shard_1.safetensors"),
    )
    .unwrap();
    ok(&shardscope(&["inspect", s(&broken)]), "repaired");
    std::fs::copy(
        dir.join("model/shard_1.safetensors"),
        broken.join("leftover_0.safetensors"),
    )
    .unwrap();
    for cmd in ["inspect", "verify"] {
        let res = shardscope(&[cmd, s(&broken)]);
        assert_eq!(res.status.code(), Some(2), "{cmd}: {res:?}");
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(
            err.contains("leftover_0.safetensors")
                && err.contains("metadata.pkl does not describe"),
            "{cmd}: {err}"
        );
    }
}

#[test]
fn torch_checkpointing_converts_to_torchs_full_state_dicts() {
    let tmp = tempfile::tempdir().unwrap();
    let expected = fixtures().join("expected");
    for folder in ["tc_default", "tc_resharder"] {
        let out = tmp.path().join(format!("{folder}.pt"));
        let (_, err) = ok(
            &shardscope(&["convert", s(&fixtures().join(folder)), "-o", s(&out)]),
            folder,
        );
        // The extra items are not part of a model+optimizer file: said, not silently dropped.
        assert!(err.contains("extra state"), "{folder}: {err}");
        torch_says_ok(
            SAME_AS_TORCH,
            &[
                &out,
                &expected.join("tc_full_model.pt"),
                &expected.join("tc_full_optim.pt"),
            ],
        );
    }
}

const EXTRA_WITH_FLOATS: &str = r#"
import sys, random, torch, numpy as np
src, dst = sys.argv[1], sys.argv[2]
for r in range(2):
    name = f"extra_state_world_size_2_rank_{r}.pt"
    extra = torch.load(f"{src}/{name}", weights_only=False)
    # What schedulers with tensor learning rates and RNG savers leave: float tensors, numpy state.
    extra["lr_scheduler"]["_last_lr"] = [torch.tensor(0.005)]
    extra["lr_scheduler"]["base_lrs"] = [torch.tensor(0.01)]
    extra["rng"]["numpy"] = np.random.get_state()
    extra["rng"]["random"] = random.getstate()
    torch.save(extra, f"{dst}/{name}")
print("OK")
"#;

#[test]
fn extra_state_holding_float_tensors_stays_extra() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("verl_fsdp2");
    let dst = tmp.path().join("verl");
    std::fs::create_dir(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let name = entry.unwrap().file_name();
        std::fs::copy(src.join(&name), dst.join(&name)).unwrap();
    }
    if python().is_none() {
        eprintln!("skipped: no Python with torch");
        return;
    }
    torch_says_ok(EXTRA_WITH_FLOATS, &[&src, &dst]);
    let keys = keys(&dst, &[]);
    assert!(
        keys.iter().any(|k| k == "extra.lr_scheduler._last_lr.0"),
        "{keys:?}"
    );
    assert!(keys.iter().all(|k| !k.contains('{')), "{keys:?}");
    // The model and optimizer read as from the untouched folder: torch's full state dicts.
    let full = fixtures().join("expected/verl_fsdp2_full.pt");
    let (text, _) = ok(
        &shardscope(&["diff", s(&dst), s(&full), "--select", "model", "-q"]),
        "diff",
    );
    assert!(
        text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
        "{text}"
    );
    let out = tmp.path().join("out.pt");
    ok(
        &shardscope(&["convert", s(&dst), "-o", s(&out)]),
        "convert verl",
    );
    let (text, _) = ok(&shardscope(&["diff", s(&out), s(&full), "-q"]), "diff out");
    assert!(
        text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
        "{text}"
    );
}

/// `doctor` reads every set: the model part is compared with the reference (the optimizer and
/// the training state are not model parts); without the model's files it cannot say "loadable".
#[test]
fn doctor_compares_the_model_set_and_never_passes_without_it() {
    let reference = fixtures().join("expected/tc_full_model.pt");
    let folder = fixtures().join("tc_default");
    let out = shardscope(&["doctor", s(&folder), "--reference", s(&reference), "--json"]);
    let (text, _) = ok(&out, "doctor tc_default");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["loadable"], true, "{v:#}");

    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&folder).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if !name.starts_with("model_") {
            std::fs::copy(folder.join(&name), tmp.path().join(&name)).unwrap();
        }
    }
    let out = shardscope(&[
        "doctor",
        s(tmp.path()),
        "--reference",
        s(&reference),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["loadable"], false, "{v:#}");
    let text = v.to_string();
    assert!(text.contains("no model part"), "{v:#}");
}

/// accelerate's `save_state` folder and the HF Trainer's `checkpoint-N` (written by accelerate's
/// own save functions, `gen_accelerate.py`): every DCP folder and the files beside them are read,
/// not the first DCP folder alone; the model converts byte for byte to what
/// `accelerate merge-weights` writes, and equals torch's full state dict.
#[test]
fn accelerate_folders_are_read_whole() {
    let f = fixtures();
    for (folder, extra, more) in [
        (
            "acc_save_state",
            "extra.scheduler.last_epoch",
            "extra.random_states.torch_manual_seed",
        ),
        (
            "checkpoint-2",
            "extra.rng_state.cpu",
            "extra.trainer_state.global_step",
        ),
    ] {
        let dir = f.join(folder);
        let keys = keys(&dir, &[]);
        for want in [
            "model.embed_tokens.weight",
            "model.lm_head.weight",
            "optimizer.state.layers.1.mlp.weight.exp_avg_sq",
            extra,
            more,
        ] {
            assert!(keys.iter().any(|k| k == want), "{folder}: no {want}");
        }
        let full = f.join("expected/acc_full_model.pt");
        let (text, _) = ok(
            &shardscope(&["diff", s(&dir), s(&full), "--select", "model", "-q"]),
            "diff",
        );
        assert!(
            text.contains("14 match, 0 mismatch, 0 missing, 0 unexpected, 0 error"),
            "{folder}: {text}"
        );
        let out = shardscope(&["doctor", s(&dir), "--reference", s(&full), "--json"]);
        let (text, _) = ok(&out, "doctor");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["loadable"], true, "{folder}: {v:#}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.safetensors");
    ok(
        &shardscope(&[
            "convert",
            s(&f.join("acc_save_state")),
            "-o",
            s(&out),
            "--select",
            "model",
        ]),
        "convert --select model",
    );
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(f.join("expected/acc_merged.safetensors")).unwrap(),
        "not the bytes accelerate merge-weights writes"
    );
}

/// `--model-only` picks the model part by what the parts are and keeps the model's own names:
/// torchtitan's top-level model keys beside `optimizer`/`lr_scheduler`/`train_state`/`dataloader`
/// (`gen_torchtitan.py`), accelerate's `model`, torch_checkpointing's `model` item, a DCP app
/// state's `model` around HF's Llama names (`model.embed_tokens.weight` stays). Each equals the
/// library's or torch's own full model.
#[test]
fn model_only_takes_the_model_part_with_its_own_names() {
    let f = fixtures();
    let tmp = tempfile::tempdir().unwrap();
    for (i, (folder, reference)) in [
        ("step-2", "expected/titan_full_model.pt"),
        ("acc_save_state", "expected/acc_merged.safetensors"),
        ("checkpoint-2", "expected/acc_full_model.pt"),
        ("tc_resharder", "expected/tc_full_model.pt"),
        ("../app_state/dcp", "../app_state/merged.safetensors"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path().join(format!("m{i}.safetensors"));
        let (_, err) = ok(
            &shardscope(&["convert", s(&f.join(folder)), "--model-only", "-o", s(&out)]),
            folder,
        );
        assert!(err.contains("--model-only"), "{folder}: {err}");
        let reference = f.join(reference);
        let (text, _) = ok(&shardscope(&["diff", s(&out), s(&reference), "-q"]), folder);
        assert!(
            text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
            "{folder}: {text}"
        );
        // The same through diff's own reading.
        let (text, _) = ok(
            &shardscope(&[
                "diff",
                s(&f.join(folder)),
                s(&reference),
                "--model-only",
                "-q",
            ]),
            folder,
        );
        assert!(
            text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
            "{folder}: {text}"
        );
    }
    // accelerate's model: the bytes `accelerate merge-weights` writes.
    assert_eq!(
        std::fs::read(tmp.path().join("m1.safetensors")).unwrap(),
        std::fs::read(f.join("expected/acc_merged.safetensors")).unwrap()
    );
    // Optimizer state alone has no model part: an error, not an empty file.
    let out = tmp.path().join("none.safetensors");
    let res = shardscope(&[
        "convert",
        s(&f.join("acc_save_state/optimizer_0")),
        "--model-only",
        "-o",
        s(&out),
    ]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    assert!(
        String::from_utf8_lossy(&res.stderr).contains("no model part"),
        "{res:?}"
    );
    assert!(!out.exists());
}

const SAME_CHECKPOINT: &str = r#"
import sys, torch
got = torch.load(sys.argv[1], weights_only=True)
want = torch.load(sys.argv[2], weights_only=True)
def eq(a, b, at):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), at
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (at, list(a), list(b))
        for k in a:
            eq(a[k], b[k], f"{at}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            eq(x, y, f"{at}[{i}]")
    else:
        assert a == b, (at, a, b)
eq(want, got, "checkpoint")
print("OK")
"#;

/// Lightning's sharded folder (a DCP beside `meta.pt`, written by Lightning's own
/// `_save_checkpoint`, `gen_lightning.py`): `meta.pt`'s state joins the top level, so a `.pt`
/// conversion equals Lightning's own consolidation (`consolidate_checkpoint`), keys in order.
#[test]
fn lightning_sharded_folder_keeps_its_meta() {
    let f = fixtures();
    let dir = f.join("lightning_sharded");
    let keys = keys(&dir, &[]);
    for want in [
        "model.head.weight",
        "optimizer.state.head.weight.exp_avg",
        "step",
        "note",
    ] {
        assert!(keys.iter().any(|k| k == want), "no {want}: {keys:?}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("consolidated.pt");
    ok(
        &shardscope(&["convert", s(&dir), "-o", s(&out)]),
        "convert lightning",
    );
    torch_says_ok(
        SAME_CHECKPOINT,
        &[&out, &f.join("expected/lightning_consolidated.pt")],
    );
}

/// torch's FSDP1 `use_orig_params=True` + `offload_to_cpu=True` full optimizer state dict has
/// `exp_avg == exp_avg_sq` bit for bit (`gen_offload_bug.py` asserts it in torch): `doctor` says
/// so; the same state taken without offload (what training holds) is fine.
#[test]
fn doctor_flags_adam_moments_that_are_copies() {
    let dir = fixtures().join("fsdp1_offload");
    let out = shardscope(&["doctor", s(&dir.join("optimizer.bin")), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let codes: Vec<&str> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, vec!["optimizer-moments-equal"], "{v:#}");
    let out = shardscope(&["doctor", s(&dir.join("optimizer_ref.bin")), "--json"]);
    let (text, _) = ok(&out, "doctor optimizer_ref.bin");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["loadable"], true, "{v:#}");
}

/// A run that froze `0.bias`, resumed with it trainable (`gen_frozen_resume.py`): torch's
/// `set_optimizer_state_dict` refuses ("Missing optimizer state for parameter '0.bias'",
/// `torch_error.txt`); `doctor --model` says it is not loadable and names the parameter. With the
/// model as trained (`0.bias` frozen) it is loadable.
#[test]
fn doctor_names_trainable_parameters_without_optimizer_state() {
    let dir = fixtures().join("frozen_resume");
    let torch = std::fs::read_to_string(dir.join("torch_error.txt")).unwrap();
    assert!(torch.contains("'0.bias'"), "{torch}");
    let ckpt = dir.join("ckpt.pt");
    let out = shardscope(&[
        "doctor",
        s(&ckpt),
        "--model",
        s(&dir.join("model_trainable.json")),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let f = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["code"] == "optimizer-mismatch")
        .unwrap_or_else(|| panic!("{v:#}"));
    assert!(
        f["message"].as_str().unwrap().contains("'0.bias'") && f["keys"][0] == "0.bias",
        "{f:#}"
    );
    let out = shardscope(&[
        "doctor",
        s(&ckpt),
        "--model",
        s(&dir.join("model_frozen.json")),
        "--json",
    ]);
    let (text, _) = ok(&out, "doctor frozen");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["loadable"], true, "{v:#}");
}

/// `--select` stays a plain prefix, and says so when the prefix starts the model's own names (HF's
/// `model.embed_tokens.weight` beside `lm_head.weight`): the tensors left out are named. An
/// app-state `model` (the same Llama in a DCP app state) is no such case.
#[test]
fn select_says_when_it_cuts_the_models_own_names() {
    let app = fixtures().join("../app_state");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.safetensors");
    let (_, err) = ok(
        &shardscope(&[
            "convert",
            s(&app.join("merged.safetensors")),
            "--select",
            "model",
            "-o",
            s(&out),
        ]),
        "convert merged --select model",
    );
    assert!(
        err.contains("plain prefix")
            && err.contains("lm_head.weight")
            && err.contains("--model-only"),
        "{err}"
    );
    let out = tmp.path().join("b.safetensors");
    let (_, err) = ok(
        &shardscope(&[
            "convert",
            s(&app.join("dcp")),
            "--select",
            "model",
            "-o",
            s(&out),
        ]),
        "convert dcp --select model",
    );
    assert!(!err.contains("plain prefix"), "{err}");
}

/// `diff --select` and `inspect --select` warn as `convert --select` does (the same function):
/// `inspect` lists the keys with the prefix removed and names what it left out; `diff` names the
/// side whose model tensors were not compared, and says nothing when the other side's names let
/// it compare them (HF's own names against the DCP app state of the same Llama).
#[test]
fn select_warns_in_diff_and_inspect_too() {
    let app = fixtures().join("../app_state");
    let merged = app.join("merged.safetensors");
    let dcp = app.join("dcp");
    let plain = |err: &str| err.matches("is a plain prefix").count();
    // inspect: HF's own `model.`.
    let (out, err) = ok(
        &shardscope(&["inspect", s(&merged), "--select", "model", "--json"]),
        "inspect merged --select model",
    );
    assert_eq!(plain(&err), 1, "{err}");
    assert!(
        err.contains("lm_head.weight") && err.contains("--model-only"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    assert!(listed.contains(&"embed_tokens.weight"), "{listed:?}");
    assert!(!listed.iter().any(|k| k.contains("lm_head")), "{listed:?}");
    // inspect: a DCP app state's `model` is no such case; its keys lose the wrapper only.
    let (out, err) = ok(
        &shardscope(&["inspect", s(&dcp), "--select", "model", "--json"]),
        "inspect dcp --select model",
    );
    assert_eq!(plain(&err), 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    assert!(
        listed.contains(&"lm_head.weight") && listed.contains(&"model.embed_tokens.weight"),
        "{listed:?}"
    );
    // inspect: a prefix nothing starts with is an error naming the top-level keys.
    let res = shardscope(&["inspect", s(&dcp), "--select", "nothing"]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(err.contains("no key starts with `nothing.`"), "{err}");
    // diff: HF against itself, `model.` stripped on both sides: lm_head.weight compared nowhere.
    let (out, err) = ok(
        &shardscope(&["diff", s(&merged), s(&merged), "--select", "model"]),
        "diff merged merged --select model",
    );
    assert_eq!(plain(&err), 1, "{err}");
    assert!(
        err.contains(&format!("own names in {}", merged.display()))
            && err.contains("lm_head.weight"),
        "{err}"
    );
    assert!(!out.contains("lm_head"), "{out}");
    // diff: HF against the DCP app state: HF's names kept whole, lm_head.weight compared.
    let (out, err) = ok(
        &shardscope(&["diff", s(&merged), s(&dcp), "--select", "model"]),
        "diff merged dcp --select model",
    );
    assert_eq!(plain(&err), 0, "{err}");
    assert!(out.contains("0 missing"), "{out}");
}

/// Megatron-core's `torch_dist` checkpoint, written by `dist_checkpointing.save` itself
/// (`gen_megatron.py`: row- and column-parallel weights, bf16, `common.pt`, `metadata.json`):
/// `inspect` names it and lists `common.pt`'s state; `.pt` and safetensors conversions hold
/// torch's tensors; a DCP for another world size carries `metadata.json` and `common.pt`, and
/// Megatron's own `dist_checkpointing.load` reads it back on 2 ranks equal to what it saved.
#[test]
fn megatron_torch_dist_is_named_converted_and_loads_back_in_megatron() {
    let dir = fixtures().join("megatron_torch_dist");
    let (out, _) = ok(&shardscope(&["inspect", s(&dir)]), "inspect megatron");
    assert!(
        out.contains("written by: Megatron-core dist_checkpointing (torch_dist"),
        "{out}"
    );
    let listed = keys(&dir, &[]);
    for k in [
        "iteration",
        "checkpoint_version",
        "args.lr",
        "decoder.final_layernorm.weight",
    ] {
        assert!(listed.iter().any(|l| l == k), "{k} not in {listed:?}");
    }
    let tmp = tempfile::tempdir().unwrap();
    // Every sharded tensor whole, equal to what the ranks were given (torch wrote the file).
    let st = tmp.path().join("full.safetensors");
    ok(
        &shardscope(&["convert", s(&dir), "-o", s(&st), "--quiet"]),
        "convert megatron to safetensors",
    );
    let pt = tmp.path().join("full.pt");
    ok(
        &shardscope(&["convert", s(&dir), "-o", s(&pt), "--quiet"]),
        "convert megatron to .pt",
    );
    let expected = fixtures().join("expected/megatron_full.safetensors");
    let common = fixtures().join("expected/megatron_common.json");
    torch_says_ok(
        r#"
import json, sys, torch
from safetensors.torch import load_file
st, pt, want, common = load_file(sys.argv[1]), torch.load(sys.argv[2], weights_only=True), load_file(sys.argv[3]), json.load(open(sys.argv[4]))
for k, v in want.items():
    for got in (st[k], pt[k]):
        assert got.dtype == v.dtype and torch.equal(got, v), k
assert pt["iteration"] == common["iteration"] and pt["checkpoint_version"] == common["checkpoint_version"]
assert pt["args"] == common["args"], pt["args"]
assert torch.equal(pt["decoder.final_layernorm.weight"], torch.linspace(0.5, 1.5, 8))
print("OK")
"#,
        &[&st, &pt, &expected, &common],
    );
    // Resharded for 4 ranks: Megatron loads it on 2.
    let dcp4 = tmp.path().join("dcp4");
    let (_, err) = ok(
        &shardscope(&["convert", s(&dir), "-o", s(&dcp4), "--world-size", "4"]),
        "convert megatron to DCP for 4 ranks",
    );
    assert!(err.contains("metadata.json and common.pt"), "{err}");
    for name in ["metadata.json", "common.pt"] {
        assert_eq!(
            std::fs::read(dcp4.join(name)).unwrap(),
            std::fs::read(dir.join(name)).unwrap(),
            "{name} is carried as stored"
        );
    }
    let Some(py) = python() else {
        return;
    };
    let run = Command::new(&py)
        .arg(fixtures().join("gen_megatron.py"))
        .args(["--load", s(&dcp4), "2"])
        .output()
        .unwrap();
    // Results first: gloo ranks may abort at teardown after the result line was printed.
    let text = String::from_utf8_lossy(&run.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{'));
    let Some(line) = line else {
        panic!(
            "Megatron's load printed no result ({:?}):\n{}",
            run.status.code(),
            String::from_utf8_lossy(&run.stderr)
        );
    };
    let loaded = tmp.path().join("loaded.json");
    std::fs::write(&loaded, line).unwrap();
    torch_says_ok(
        r#"
import json, sys, torch
from safetensors.torch import load_file
got, want, common = json.load(open(sys.argv[1])), load_file(sys.argv[2]), json.load(open(sys.argv[3]))
for k, v in want.items():
    assert torch.equal(torch.tensor(got["sharded"][k]), v.float()), k
assert got["common"]["iteration"] == common["iteration"] and got["common"]["args"] == common["args"]
print("OK")
"#,
        &[&loaded, &expected, &common],
    );
}

/// Copies `src` (files and folders) to `dst`.
fn copy_tree(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
}

/// torch_checkpointing's JSON and raw items (`tc_raw`, written by the library: `train_state` as
/// `train_state_{rank}.json`, `dataloader` as `dataloader/rank_{rank}.bin`, bytes that differ by
/// rank): listed as values; a `.pt` holds them as the library's own load returns them on each rank
/// (bytes, a list by rank); safetensors leaves the bytes out and says so.
#[test]
fn torch_checkpointing_json_and_raw_items_are_values() {
    let dir = fixtures().join("tc_raw");
    let expected = fixtures().join("expected");
    let tmp = tempfile::tempdir().unwrap();
    let (out, _) = ok(&shardscope(&["inspect", s(&dir), "--json"]), "inspect");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let entry = |key: &str| {
        v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("no {key}"))
    };
    let sizes: Vec<u64> = (0..2)
        .map(|r| {
            std::fs::metadata(dir.join(format!("dataloader/rank_{r}.bin")))
                .unwrap()
                .len()
        })
        .collect();
    let loader = entry("extra.dataloader");
    assert_eq!(loader["kind"], "scalar", "{loader:#}");
    for (r, size) in sizes.iter().enumerate() {
        let text = loader["value"][r].as_str().unwrap();
        assert!(text.starts_with(&format!("<{size} bytes: 8004")), "{text}");
    }
    assert_eq!(entry("extra.train_state.ntokens_seen")["value"], 20);
    // Every item file is accounted for (JSON and raw items included; all but metadata.pkl).
    assert_eq!(v["summary"]["files"], 12, "{:#}", v["summary"]);
    assert!(
        v["files"]["dataloader/rank_1.bin"].is_object(),
        "{:#}",
        v["files"]
    );

    items_convert_like_the_library(
        &dir,
        tmp.path(),
        r#"
import sys, torch
got = torch.load(sys.argv[1], weights_only=True)
want = torch.load(sys.argv[2], weights_only=True)
assert all(type(b) is bytes for b in got["dataloader"]), got["dataloader"]
assert got["dataloader"] == want["dataloader"], (got["dataloader"], want["dataloader"])
assert all(got["train_state"] == t for t in want["train_state"]), (got["train_state"], want)
print("OK")
"#,
        &expected.join("tc_raw_items.pt"),
        "tc",
        "extra.dataloader",
        |k| k.contains("dataloader"),
    );
}

/// tc_raw's items changed or damaged: `diff` sees a byte changed past the part of a raw item it
/// shows; a JSON item that is not JSON and a raw item over the cap are errors naming the file.
#[test]
fn torch_checkpointing_value_items_changed_or_damaged() {
    let dir = fixtures().join("tc_raw");
    let tmp = tempfile::tempdir().unwrap();
    let changed = tmp.path().join("changed");
    copy_tree(&dir, &changed);
    let file = changed.join("dataloader/rank_1.bin");
    let mut b = std::fs::read(&file).unwrap();
    let last = b.len() - 3;
    b[last] ^= 1;
    std::fs::write(&file, b).unwrap();
    let res = shardscope(&["diff", s(&dir), s(&changed)]);
    assert_eq!(res.status.code(), Some(1), "{res:?}");
    assert!(
        String::from_utf8_lossy(&res.stdout).contains("extra.dataloader"),
        "{res:?}"
    );

    // A JSON item that is not JSON, and a raw item over the cap: errors naming the file.
    let bad = tmp.path().join("bad");
    copy_tree(&dir, &bad);
    std::fs::write(bad.join("train_state_1.json"), b"{\"step\": ").unwrap();
    let res = shardscope(&["inspect", s(&bad)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("train_state_1.json") && err.contains("not JSON"),
        "{err}"
    );
    let big = tmp.path().join("big");
    copy_tree(&dir, &big);
    // Sparse: no bytes written.
    std::fs::File::options()
        .write(true)
        .open(big.join("dataloader/rank_0.bin"))
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    let res = shardscope(&["inspect", s(&big)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("dataloader/rank_0.bin") && err.contains("at most 67108864 bytes"),
        "{err}"
    );
}

/// `inspect --json` of a folder of torch_checkpointing items without `metadata.pkl`: its note says
/// the per-rank files `sets` name were read as values under `extra` and no file is left unread.
fn inspect_items_folder(dir: &Path, sets: &[&str]) -> serde_json::Value {
    let (out, err) = ok(&shardscope(&["inspect", s(dir), "--json"]), "inspect");
    assert!(err.contains("read as values under `extra`"), "{err}");
    for set in sets {
        assert!(err.contains(set), "{set}: {err}");
    }
    assert!(!err.contains("not read ("), "{err}");
    serde_json::from_str(&out).unwrap()
}

/// torch_checkpointing with no resharder writes no `metadata.pkl`: `tc_items` (written by the
/// library) is `<item>_<rank>.<ext>` files alone, with `train_state` as a JSON item, `x` as a raw
/// item that differs by rank (`x_{rank}.bin`, not a torch.save archive) and `vocab` as a raw item
/// the same on every rank (`vocab_{rank}.txt`). They are read as the metadata.pkl path reads them
/// (values under `extra`, noted); a `.pt` holds them as the library's own load returns them on each
/// rank; safetensors leaves the bytes out, named.
#[test]
fn torch_checkpointing_items_without_metadata_pkl_are_values() {
    let dir = fixtures().join("tc_items");
    let expected = fixtures().join("expected");
    let tmp = tempfile::tempdir().unwrap();
    let v = inspect_items_folder(
        &dir,
        &[
            "train_state_{r}.json (JSON)",
            "x_{r}.bin (raw bytes)",
            "vocab_{r}.txt (raw bytes)",
        ],
    );
    let entry = |key: &str| {
        v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("no {key}"))
    };
    for r in 0..2 {
        let size = std::fs::metadata(dir.join(format!("x_{r}.bin")))
            .unwrap()
            .len();
        let text = entry("extra.x")["value"][r].as_str().unwrap().to_owned();
        assert!(text.starts_with(&format!("<{size} bytes: 8002")), "{text}");
    }
    let vocab = entry("extra.vocab")["value"].as_str().unwrap().to_owned();
    assert!(vocab.starts_with("<110 bytes: 746f6b30"), "{vocab}");
    assert_eq!(entry("extra.train_state.ntokens_seen")["value"], 20);
    assert_eq!(entry("extra.step")["value"], 1);
    // Every file is accounted for.
    assert_eq!(v["summary"]["files"], 14, "{:#}", v["summary"]);
    assert!(v["files"]["x_1.bin"].is_object(), "{:#}", v["files"]);

    // The model and optimizer are the same run as tc_default.
    items_convert_like_the_library(
        &dir,
        tmp.path(),
        r#"
import sys, torch
got = torch.load(sys.argv[1], weights_only=True)
want = torch.load(sys.argv[2], weights_only=True)
assert all(type(b) is bytes for b in got["x"]), got["x"]
assert got["x"] == want["x"], (got["x"], want["x"])
assert type(got["vocab"]) is bytes and all(got["vocab"] == b for b in want["vocab"]), got["vocab"]
assert all(got["train_state"] == t for t in want["train_state"]), (got["train_state"], want)
print("OK")
"#,
        &expected.join("tc_items_items.pt"),
        "tc",
        "extra.x",
        |k| k.starts_with('x') || k.starts_with("vocab"),
    );
}

/// torch_checkpointing in a one-process run (`tc_items_ws1`, written by the library at world size
/// 1, no resharder): `model_0.pt`, `train_state_0.json`, `x_0.bin`, ... with no number that varies
/// between names. The shared `_0` is the rank: the JSON and raw items are values under `extra` (not
/// files left unread, and `x_0.bin`, a pickle, is not taken for a `torch.save` file); the model and
/// optimizer equal torch's state dicts, and the items what the library's own load returns.
#[test]
fn torch_checkpointing_items_of_a_one_process_run() {
    let dir = fixtures().join("tc_items_ws1");
    let expected = fixtures().join("expected");
    let tmp = tempfile::tempdir().unwrap();
    let v = inspect_items_folder(
        &dir,
        &["train_state_{r}.json (JSON)", "x_{r}.bin (raw bytes)"],
    );
    assert_eq!(v["summary"]["files"], 7, "{:#}", v["summary"]);
    let keys: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    for want in [
        "extra.x",
        "extra.vocab",
        "extra.train_state.ntokens_seen",
        "model.output.weight",
    ] {
        assert!(keys.contains(&want), "no {want}: {keys:?}");
    }
    items_convert_like_the_library(
        &dir,
        tmp.path(),
        r#"
import sys, torch
got = torch.load(sys.argv[1], weights_only=True)
want = torch.load(sys.argv[2], weights_only=True)
assert type(got["x"]) is bytes and [got["x"]] == want["x"], (got["x"], want["x"])
assert type(got["vocab"]) is bytes and [got["vocab"]] == want["vocab"], got["vocab"]
assert [got["train_state"]] == want["train_state"], (got["train_state"], want)
print("OK")
"#,
        &expected.join("tc_ws1_items.pt"),
        "tc_ws1",
        "extra.x",
        |k| k.starts_with('x') || k.starts_with("vocab"),
    );
}

/// Files beside per-rank sets that are neither `torch.save` archives nor per-rank items are named
/// in a note, never read in part silently; damaged items and archives are errors naming the file;
/// a folder of raw files alone (no `torch.save` set) is not taken for a checkpoint.
#[test]
fn per_rank_folder_files_are_read_named_or_refused() {
    let dir = fixtures().join("tc_items");
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other");
    copy_tree(&dir, &other);
    std::fs::write(other.join("README.txt"), b"notes\n").unwrap();
    std::fs::write(other.join("config.json"), b"{}").unwrap();
    std::fs::write(other.join(".hidden"), b"x").unwrap();
    // A torch.save file in a subfolder: the top level is the checkpoint, read the same way.
    std::fs::create_dir_all(other.join("ref")).unwrap();
    std::fs::copy(dir.join("step_0.pt"), other.join("ref/step.pt")).unwrap();
    let (out, err) = ok(&shardscope(&["inspect", s(&other), "--json"]), "inspect");
    assert!(
        err.contains("torch.save files in subfolders are not read (ref/step.pt)"),
        "{err}"
    );
    assert!(err.contains("x_{r}.bin (raw bytes)"), "{err}");
    let note = err
        .lines()
        .find(|l| l.contains("not read (neither"))
        .unwrap_or_else(|| panic!("no note on the files not read: {err}"));
    assert!(
        note.contains("README.txt") && note.contains("config.json") && !note.contains(".hidden"),
        "{note}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["summary"]["files"], 14, "{:#}", v["summary"]);

    // A JSON item that is not JSON, and a raw item over the cap: errors naming the file.
    let bad = tmp.path().join("bad");
    copy_tree(&dir, &bad);
    std::fs::write(bad.join("train_state_1.json"), b"{\"step\": ").unwrap();
    let res = shardscope(&["inspect", s(&bad)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("train_state_1.json") && err.contains("not JSON"),
        "{err}"
    );
    let big = tmp.path().join("big");
    copy_tree(&dir, &big);
    std::fs::File::options()
        .write(true)
        .open(big.join("x_0.bin"))
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    let res = shardscope(&["inspect", s(&big)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("x_0.bin") && err.contains("at most 67108864 bytes"),
        "{err}"
    );

    // A per-rank `.bin` set one of whose files is a torch.save archive is a torch.save set: the
    // damaged file is an error naming it, not an item.
    let damaged = tmp.path().join("damaged");
    copy_tree(&dir, &damaged);
    std::fs::copy(dir.join("step_0.pt"), damaged.join("counter_0.bin")).unwrap();
    std::fs::write(damaged.join("counter_1.bin"), b"not an archive").unwrap();
    let res = shardscope(&["inspect", s(&damaged)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("counter_1.bin") && err.contains("not a torch.save zip archive"),
        "{err}"
    );

    // Raw files alone: no torch.save set, so not read as a checkpoint of items (`x_0.bin` holds
    // `pickle.dumps` bytes: the torch.save reader names it a pickle, not a legacy torch.save).
    let raw = tmp.path().join("raw");
    std::fs::create_dir_all(&raw).unwrap();
    for r in 0..2 {
        std::fs::copy(
            dir.join(format!("x_{r}.bin")),
            raw.join(format!("x_{r}.bin")),
        )
        .unwrap();
    }
    let res = shardscope(&["inspect", s(&raw)]);
    assert_eq!(res.status.code(), Some(2), "{res:?}");
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("x_0.bin")
            && err.contains("a pickle (protocol 2), not a torch.save archive")
            && !err.contains("legacy"),
        "{err}"
    );
}

/// Beside a DCP (Lightning's sharded folder) the same sort: per-rank raw and JSON items are read as
/// values under `extra`, other files are named as not read; the DCP and `meta.pt` read as before.
#[test]
fn dcp_folder_items_beside_are_read_or_named() {
    let dir = fixtures().join("lightning_sharded");
    let tmp = tempfile::tempdir().unwrap();
    let before = keys(&dir, &[]);
    let with = tmp.path().join("with");
    copy_tree(&dir, &with);
    let tc = fixtures().join("tc_items");
    for r in 0..2 {
        for f in [format!("x_{r}.bin"), format!("train_state_{r}.json")] {
            std::fs::copy(tc.join(&f), with.join(&f)).unwrap();
        }
    }
    std::fs::write(with.join("README.md"), b"notes\n").unwrap();
    let (out, err) = ok(&shardscope(&["inspect", s(&with), "--json"]), "inspect");
    assert!(
        err.contains("not read (") && err.contains("README.md"),
        "{err}"
    );
    assert!(
        err.contains("x_{r}.bin (raw bytes)") && err.contains("train_state_{r}.json (JSON)"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let got: Vec<String> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap().to_owned())
        .collect();
    for k in &before {
        assert!(got.contains(k), "{k} lost");
    }
    let added: Vec<&String> = got.iter().filter(|k| !before.contains(k)).collect();
    assert_eq!(
        added,
        vec![
            "extra.train_state.ntokens_seen",
            "extra.train_state.step",
            "extra.x"
        ],
        "{got:?}"
    );
}
