//! The reader on the checkpoints DeepSpeed 0.19.8 wrote itself (`tests/fixtures/deepspeed`, see its
//! `gen_deepspeed.py`), against `zero_to_fp32`'s own state dicts (`expected/<case>.*`, read with
//! the `safetensors` crate), and on damaged copies of them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use crate::dtype::DType;
use crate::index::{CheckpointKind, IndexError, ZeroPrecision, index_source_read};
use crate::source::{MemorySource, Source as _};

/// The cases `gen_deepspeed.py` wrote (its `cases.txt`).
fn cases() -> impl Iterator<Item = &'static str> {
    include_str!("../../../../../tests/fixtures/deepspeed/cases.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
}

pub(crate) fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspeed")
}

/// Every file under `dir`, named relative to it.
pub(crate) fn load(dir: &Path) -> MemorySource {
    fn walk(dir: &Path, prefix: &str, out: &mut MemorySource) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let name = format!("{prefix}{}", p.file_name().unwrap().to_str().unwrap());
            if p.is_dir() {
                walk(&p, &format!("{name}/"), out);
            } else {
                out.insert(name, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = MemorySource::new();
    walk(dir, "", &mut out);
    out
}

fn open(source: &MemorySource) -> Result<crate::index::FolderRead, IndexError> {
    index_source_read(source)
}

pub(crate) struct Expected {
    pub(crate) keys: Vec<String>,
    tensors: Vec<(String, crate::dtype::DType, Vec<u64>, Vec<u8>)>,
}

pub(crate) fn expected(case: &str) -> Expected {
    let dir = fixtures().join("expected");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("{case}.json"))).unwrap()).unwrap();
    let mut keys: Vec<String> = meta["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_owned())
        .collect();
    let mut tensors = tensors_of(&dir.join(format!("{case}.zero_to_fp32.safetensors")));
    // The frozen parameters zero_to_fp32 leaves out (ZeRO-1), as the live engine's module holds
    // them, where zero_to_fp32 puts frozen parameters: before the first trainable one.
    let live = tensors_of(&dir.join(format!("{case}.live.safetensors")));
    let trainable: Vec<String> = live
        .iter()
        .filter_map(|(n, ..)| n.strip_prefix("param.").map(str::to_owned))
        .collect();
    for (name, dtype, shape, bytes) in live {
        let Some(frozen) = name.strip_prefix("frozen.") else {
            continue;
        };
        if keys.iter().any(|k| k == frozen) {
            continue;
        }
        let first_trainable = keys.iter().position(|k| trainable.contains(k)).unwrap();
        keys.insert(first_trainable, frozen.to_owned());
        tensors.push((frozen.to_owned(), dtype, shape, bytes));
    }
    Expected { keys, tensors }
}

/// A safetensors file's tensors: name, dtype, shape, bytes.
fn tensors_of(path: &Path) -> Vec<(String, crate::dtype::DType, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => crate::dtype::DType::Float32,
                safetensors::Dtype::BF16 => crate::dtype::DType::BFloat16,
                safetensors::Dtype::I64 => crate::dtype::DType::Int64,
                other => panic!("{}: {name}: unexpected {other:?}", path.display()),
            };
            let shape = view.shape().iter().map(|&d| d as u64).collect();
            (name, dtype, shape, view.data().to_vec())
        })
        .collect()
}

#[test]
fn every_fixture_reads_as_zero_to_fp32_gives_it() {
    for case in cases() {
        let root = load(&fixtures().join(case));
        // The run folder (with `latest`) and the tag folder itself.
        let tag = load(&fixtures().join(case).join("global_step2"));
        for source in [&root, &tag] {
            let (index, sets, notes) = open(source).unwrap_or_else(|e| panic!("{case}: {e}"));
            let stage: u8 = case[4..5].parse().unwrap();
            let precision = if case.contains("bf16") {
                ZeroPrecision::Bf16
            } else {
                ZeroPrecision::Fp32
            };
            assert_eq!(
                index.kind,
                CheckpointKind::DeepSpeedZero { stage, precision },
                "{case}"
            );
            assert!(index.check().is_empty(), "{case}: {:?}", index.check());
            assert_eq!(sets.len(), 2, "{case}");
            let want = expected(case);
            // zero_to_fp32's names in its order.
            let mut model: Vec<&crate::index::IndexEntry> = index
                .entries
                .iter()
                .filter(|e| !e.key.starts_with("extra.") && e.role.is_none())
                .collect();
            model.sort_by_key(|e| e.position);
            let keys: Vec<&str> = model.iter().map(|e| e.key.as_str()).collect();
            assert_eq!(keys, want.keys, "{case}: {notes:?}");
            for (name, dtype, shape, bytes) in &want.tensors {
                let e = index.entry(name).unwrap();
                let got = index.read_tensor(source, e).unwrap();
                assert_eq!((got.dtype, &got.shape), (*dtype, shape), "{case}: {name}");
                assert!(got.bytes == *bytes, "{case}: {name}: values differ");
            }
            // The tie shares the chunks of the name it is tied to.
            assert_eq!(
                index.entry("head.weight").unwrap().chunks,
                index.entry("embed.weight").unwrap().chunks,
                "{case}"
            );
            assert!(index.entry("extra.ds_version").is_some(), "{case}");
            assert!(index.entry("extra.note").is_some(), "{case}");
        }
    }
}

#[test]
fn zero1_frozen_parameter_is_taken_from_module_with_a_note() {
    for (case, dtype) in [
        ("zero1_bf16", DType::BFloat16),
        ("zero1_fp32", DType::Float32),
    ] {
        let (index, _, notes) = open(&load(&fixtures().join(case))).unwrap();
        assert!(
            notes
                .iter()
                .any(|n| n.contains("zero_to_fp32 leaves them out") && n.contains("frozen.weight")),
            "{notes:?}"
        );
        let e = index.entry("frozen.weight").unwrap();
        assert_eq!(
            (e.dtype, e.shape.as_deref()),
            (Some(dtype), Some(&[6, 7][..])),
            "{case}"
        );
        // After the buffers, before the trainable parameters (zero_to_fp32's place for frozen
        // parameters of ZeRO-2).
        let pos = |k: &str| index.entry(k).unwrap().position.unwrap();
        assert!(pos("positions") < pos("frozen.weight"), "{case}");
        assert!(pos("frozen.weight") < pos("embed.weight"), "{case}");
        assert!(
            index
                .entry("optimizer.state.frozen.weight.exp_avg")
                .is_none(),
            "{case}"
        );
    }
}

/// The error text of reading `source`.
fn error(source: &MemorySource) -> String {
    match open(source) {
        Ok(_) => panic!("read a damaged checkpoint"),
        Err(e) => e.to_string(),
    }
}

const OPTIM1: &str = "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt";

#[test]
fn a_missing_rank_is_named() {
    let mut s = load(&fixtures().join("zero2_fp32"));
    s.remove(OPTIM1);
    let e = error(&s);
    assert!(
        e.contains("missing: global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "{e}"
    );
    let mut s = load(&fixtures().join("zero3_fp32"));
    s.remove("global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt");
    let e = error(&s);
    assert!(
        e.contains("missing: global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt"),
        "{e}"
    );
    let mut s = load(&fixtures().join("zero3_fp32"));
    s.remove("global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt");
    let e = error(&s);
    assert!(e.contains("missing: global_step2/zero_pp_rank_0"), "{e}");
}

#[test]
fn mixed_stages_and_precisions_are_refused() {
    // ZeRO-2 optimizer files with ZeRO-3's model files.
    let z2 = load(&fixtures().join("zero2_fp32/global_step2"));
    let z3 = load(&fixtures().join("zero3_fp32/global_step2"));
    let mut s = MemorySource::new();
    for n in z2.names().into_iter().filter(|n| n.contains("optim")) {
        s.insert(n.clone(), z2.read_all(&n).unwrap().to_vec());
    }
    for n in z3.names().into_iter().filter(|n| n.contains("model")) {
        s.insert(n.clone(), z3.read_all(&n).unwrap().to_vec());
    }
    let e = error(&s);
    assert!(e.contains("ZeRO stages mixed"), "{e}");
    // One rank's optimizer file of another stage.
    let mut s = load(&fixtures().join("zero2_fp32/global_step2"));
    let z1 = load(&fixtures().join("zero1_fp32/global_step2"));
    let name = "zero_pp_rank_1_mp_rank_00_optim_states.pt";
    s.insert(name.to_owned(), z1.read_all(name).unwrap().to_vec());
    let e = error(&s);
    assert!(e.contains("ZeRO stages mixed: this file is ZeRO-1"), "{e}");
    // Both model layouts in one folder.
    let mut s = load(&fixtures().join("zero2_fp32/global_step2"));
    for n in z3.names().into_iter().filter(|n| n.contains("model")) {
        s.insert(n.clone(), z3.read_all(&n).unwrap().to_vec());
    }
    let e = error(&s);
    assert!(e.contains("ZeRO stages mixed in the folder"), "{e}");
    // bf16 and fp32 optimizer files side by side.
    let mut s = load(&fixtures().join("zero2_fp32/global_step2"));
    let b = load(&fixtures().join("zero2_bf16/global_step2"));
    for n in b.names().into_iter().filter(|n| n.starts_with("bf16_")) {
        s.insert(n.clone(), b.read_all(&n).unwrap().to_vec());
    }
    let e = error(&s);
    assert!(e.contains("optimizer files of two saves"), "{e}");
}

#[test]
fn latest_and_tag_folders() {
    let mut s = load(&fixtures().join("zero2_fp32"));
    s.insert("latest", b"global_step9\n".to_vec());
    let e = error(&s);
    assert!(e.contains("names the tag `global_step9`"), "{e}");
    // Two tags, no `latest`: the user names one.
    let mut s = load(&fixtures().join("zero2_fp32"));
    s.remove("latest");
    let copy: Vec<String> = s.names();
    for n in copy {
        let bytes = s.read_all(&n).unwrap().to_vec();
        s.insert(n.replace("global_step2", "global_step1"), bytes);
    }
    let e = error(&s);
    assert!(e.contains("global_step1/, global_step2/"), "{e}");
    // One tag, no `latest`: read, with a note.
    let mut s = load(&fixtures().join("zero2_fp32"));
    s.remove("latest");
    let (_, _, notes) = open(&s).unwrap();
    assert!(
        notes.iter().any(|n| n.contains("`global_step2/`")),
        "{notes:?}"
    );
    // Files beside it are named as not read.
    let mut s = load(&fixtures().join("zero2_fp32"));
    s.insert("trainer_state.json", b"{}".to_vec());
    let (_, _, notes) = open(&s).unwrap();
    assert!(
        notes.iter().any(|n| n.contains("trainer_state.json")),
        "{notes:?}"
    );
}

#[test]
fn truncated_and_damaged_files_are_errors_naming_the_file() {
    let base = load(&fixtures().join("zero3_bf16/global_step2"));
    for name in base.names() {
        let len = base.size(&name).unwrap() as usize;
        for cut in [0, 1, len / 3, len / 2, len - 1] {
            let mut s = load(&fixtures().join("zero3_bf16/global_step2"));
            s.get_mut(&name).unwrap().truncate(cut);
            let e = error(&s);
            assert!(e.contains(&name), "{name} cut at {cut}: {e}");
        }
    }
    // Byte flips anywhere in any file never panic (an error, or a read that still checks out).
    for case in ["zero3_bf16", "zero2_fp32"] {
        let dir = fixtures().join(case).join("global_step2");
        let base = load(&dir);
        for name in base.names() {
            let len = base.size(&name).unwrap() as usize;
            for at in (0..len).step_by(11) {
                let mut s = load(&dir);
                s.get_mut(&name).unwrap()[at] ^= 0x5a;
                if let Ok((index, _, _)) = open(&s) {
                    for e in &index.entries {
                        let _ = index.read_tensor(&s, e);
                    }
                }
            }
        }
    }
}

/// `expected/<case>.live.safetensors`: what the live engine gave for every trainable parameter
/// (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state(p, "exp_avg"/"exp_avg_sq")`).
fn live(case: &str) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    let bytes =
        std::fs::read(fixtures().join(format!("expected/{case}.live.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        // The frozen parameters (the module's own, in the training precision) are checked with
        // the model (`expected`).
        .filter(|(name, _)| !name.starts_with("frozen."))
        .map(|(name, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{case}: {name}");
            (
                name,
                v.shape().iter().map(|&d| d as u64).collect(),
                v.data().to_vec(),
            )
        })
        .collect()
}

#[test]
fn optimizer_state_per_parameter_is_the_live_engines() {
    for case in cases() {
        let source = load(&fixtures().join(case));
        let (index, _, notes) = open(&source).unwrap();
        assert!(index.has_optimizer_state, "{case}: {notes:?}");
        let want = live(case);
        assert!(want.len() >= 21, "{case}: {}", want.len());
        for (name, shape, bytes) in want {
            let (what, param) = name.split_once('.').unwrap();
            let key = match what {
                "param" => param.to_owned(),
                state => format!("optimizer.state.{param}.{state}"),
            };
            let e = index
                .entry(&key)
                .unwrap_or_else(|| panic!("{case}: no {key}"));
            let got = index.read_tensor(&source, e).unwrap();
            assert_eq!(got.dtype, crate::dtype::DType::Float32, "{case}: {key}");
            assert_eq!(got.shape, shape, "{case}: {key}");
            assert!(got.bytes == bytes, "{case}: {key}: values differ");
        }
        // torch's shape: a step per parameter, param_groups naming the parameters.
        let step = index.entry("optimizer.state.up.bias.step").unwrap();
        let step = index.read_tensor(&source, step).unwrap();
        assert_eq!(step.bytes, 2.0f32.to_le_bytes(), "{case}");
        let params = index.entry("optimizer.param_groups.1.params").unwrap();
        assert_eq!(
            params.value,
            Some(serde_json::json!([
                "up.bias",
                "down.bias",
                "norm.weight",
                "norm.bias"
            ])),
            "{case}"
        );
        assert_eq!(
            index
                .entry("optimizer.param_groups.0.weight_decay")
                .unwrap()
                .value,
            Some(serde_json::json!(0.1)),
            "{case}"
        );
        // Frozen parameters and tied names have no optimizer state.
        assert!(
            index
                .entry("optimizer.state.frozen.weight.exp_avg")
                .is_none()
        );
        assert!(index.entry("optimizer.state.head.weight.exp_avg").is_none());
    }
}

#[test]
fn kinds_serialize_as_their_names() {
    // The names the derived (snake_case) serialization gave before DeepSpeed's kind had fields,
    // and DeepSpeed's: `inspect --json` and the Python module read them as strings.
    use CheckpointKind as K;
    let names = [
        (K::DcpTorchSave, "dcp_torch_save"),
        (K::DcpSafetensors, "dcp_safetensors"),
        (K::HfSafetensors, "hf_safetensors"),
        (K::HfDistributedSafetensors, "hf_distributed_safetensors"),
        (K::Fsdp1Full, "fsdp1_full"),
        (K::Fsdp1Sharded, "fsdp1_sharded"),
        (K::Fsdp1Local, "fsdp1_local"),
        (K::Fsdp2, "fsdp2"),
        (K::Fsdp1Unflattened, "fsdp1_unflattened"),
        (K::RankLocal, "rank_local"),
        (K::Plain, "plain"),
        (
            K::DeepSpeedZero {
                stage: 3,
                precision: ZeroPrecision::Bf16,
            },
            "deepspeed_zero3",
        ),
    ];
    for (kind, name) in names {
        assert_eq!(serde_json::to_value(kind).unwrap(), name);
    }
}
