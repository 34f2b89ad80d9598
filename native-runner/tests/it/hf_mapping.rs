//! `convert --to hf` / `--to torchtitan` and key surgery from the command line.
//!
//! Values against torchtitan's own adapter and transformers' `from_pretrained` are checked by
//! `tests/interop/check_hf_mapping.py` (the interop test at the end); the tests before it need no
//! torch: names, shapes, the atomic output directory, and every refusal naming what is wrong.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel)
}

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn work(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardscope-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `(key, shape)` of every tensor `inspect --json` lists.
fn tensors(path: &Path) -> Vec<(String, Vec<u64>)> {
    let out = shardscope(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    report["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "tensor")
        .map(|e| {
            (
                e["key"].as_str().unwrap().to_owned(),
                e["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .collect(),
            )
        })
        .collect()
}

const EXAMPLE: &str = "examples/fsdp2_dcp";

#[test]
fn surgery_renames_in_order_drops_and_refuses_collisions() {
    let dir = work("surgery");
    let src = repo(EXAMPLE);
    let before = tensors(&src);
    let out_path = dir.join("out.safetensors");
    let out = shardscope(&[
        "convert",
        src.to_str().unwrap(),
        "-o",
        out_path.to_str().unwrap(),
        "--select",
        "model",
        "--rename",
        r"^model\.layers\.(\d+)\.attn\.=model.blocks.$1.attention.",
        "--drop",
        r"norm\.bias$",
        "-q",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    // The names the flags describe, worked out here from the stored names with plain string edits.
    let want: BTreeSet<(String, Vec<u64>)> = before
        .iter()
        .filter_map(|(k, s)| {
            let k = k.strip_prefix("model.")?;
            if k.ends_with("norm.bias") {
                return None;
            }
            let k = match k.strip_prefix("layers.") {
                Some(rest) => {
                    let (n, tail) = rest.split_once('.').unwrap();
                    match tail.strip_prefix("attn.") {
                        Some(t) => format!("blocks.{n}.attention.{t}"),
                        None => format!("layers.{n}.{tail}"),
                    }
                }
                None => k.to_owned(),
            };
            Some((k, s.clone()))
        })
        .collect();
    let got: BTreeSet<(String, Vec<u64>)> = tensors(&out_path).into_iter().collect();
    assert_eq!(got, want);
    // Two keys becoming one: an error naming both, nothing written.
    let clash = dir.join("clash.safetensors");
    let out = shardscope(&[
        "convert",
        src.to_str().unwrap(),
        "-o",
        clash.to_str().unwrap(),
        "--select",
        "model",
        "--rename",
        r"\.(weight|bias)$=.p",
    ]);
    let t = text(&out);
    assert!(!out.status.success() && t.contains("both become"), "{t}");
    assert!(!clash.exists());
    let out = shardscope(&[
        "convert",
        src.to_str().unwrap(),
        "-o",
        clash.to_str().unwrap(),
        "--rename",
        "no-equals-sign",
    ]);
    assert!(text(&out).contains("REGEX=REPLACEMENT"), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// torch.compile's and DDP's wrapper names (torch-written: tests/fixtures/doctor/gen_doctor.py) go,
/// into `.pt` and safetensors outputs alike, and the result is what the clean checkpoint holds.
#[test]
fn strip_wrappers_gives_the_clean_names() {
    let dir = work("strip");
    let clean: BTreeSet<(String, Vec<u64>)> = tensors(&repo("tests/fixtures/doctor/clean.pt"))
        .into_iter()
        .collect();
    for (fixture, ext) in [("compiled.pt", "pt"), ("ddp.pt", "safetensors")] {
        let out_path = dir.join(format!("{fixture}.{ext}"));
        let out = shardscope(&[
            "convert",
            repo(&format!("tests/fixtures/doctor/{fixture}"))
                .to_str()
                .unwrap(),
            "-o",
            out_path.to_str().unwrap(),
            "--strip-wrappers",
            "-q",
        ]);
        assert!(out.status.success(), "{}", text(&out));
        let got: BTreeSet<(String, Vec<u64>)> = tensors(&out_path).into_iter().collect();
        assert_eq!(got, clean, "{fixture}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The example's model part under a user's mapping file: renames, a transpose, an equal split, a
/// drop, each checked by name and shape.
#[test]
fn a_mapping_file_of_ones_own_needs_no_rebuild() {
    let dir = work("own");
    let mapping = dir.join("tiny.json");
    std::fs::write(
        &mapping,
        r#"{"version": 1, "name": "tiny", "from": "tiny", "to": "hf",
            "match": {"architectures": ["TinyForCausalLM"], "keys": ["embed.weight"],
                      "target_keys": ["model.embed_tokens.weight"]},
            "rules": [
              {"from": "embed.weight", "to": "model.embed_tokens.weight", "shape": ["vocab_size", "hidden_size"]},
              {"from": "head.weight", "to": "lm_head.weight", "shape": ["vocab_size", "hidden_size"]},
              {"from": "layers.{L}.attn.weight", "to": "model.layers.{L}.attn_t.weight",
               "ops": [{"op": "transpose", "dims": [0, 1]}]},
              {"from": "layers.{L}.mlp.weight", "to": "model.layers.{L}.mlp.{P}.weight",
               "split": {"dim": 0, "capture": "P", "parts": ["gate", "up"]}},
              {"from": "layers.{L}.{K*}", "to": "model.layers.{L}.{K*}"},
              {"from": "norm.{K*}", "drop": true}
            ]}"#,
    )
    .unwrap();
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["TinyForCausalLM"], "vocab_size": 32, "hidden_size": 16}"#,
    )
    .unwrap();
    let out_dir = dir.join("hf");
    let out = shardscope(&[
        "convert",
        repo(EXAMPLE).to_str().unwrap(),
        "-o",
        out_dir.to_str().unwrap(),
        "--to",
        "hf",
        "--config",
        config.to_str().unwrap(),
        "--mapping",
        mapping.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["mapping"]["name"], "tiny");
    assert_eq!(summary["dropped_by_mapping"].as_array().unwrap().len(), 2);
    let names: BTreeSet<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["config.json".to_owned(), "model.safetensors".to_owned()])
    );
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["torch_dtype"], "bfloat16");
    let got: BTreeSet<(String, Vec<u64>)> = tensors(&out_dir.join("model.safetensors"))
        .into_iter()
        .collect();
    let want: BTreeSet<(String, Vec<u64>)> = [
        ("model.embed_tokens.weight", vec![32, 16]),
        ("lm_head.weight", vec![32, 16]),
        ("model.layers.0.attn_t.weight", vec![16, 16]),
        ("model.layers.1.attn_t.weight", vec![16, 16]),
        ("model.layers.0.mlp.gate.weight", vec![8, 16]),
        ("model.layers.0.mlp.up.weight", vec![8, 16]),
        ("model.layers.1.mlp.gate.weight", vec![8, 16]),
        ("model.layers.1.mlp.up.weight", vec![8, 16]),
        ("model.layers.0.attn.bias", vec![16]),
        ("model.layers.0.mlp.bias", vec![16]),
        ("model.layers.0.norm.bias", vec![16]),
        ("model.layers.0.norm.weight", vec![16]),
        ("model.layers.1.attn.bias", vec![16]),
        ("model.layers.1.mlp.bias", vec![16]),
        ("model.layers.1.norm.bias", vec![16]),
        ("model.layers.1.norm.weight", vec![16]),
    ]
    .into_iter()
    .map(|(k, s)| (k.to_owned(), s))
    .collect();
    assert_eq!(got, want);
    // An existing output directory that is not empty is refused; nothing is half-written.
    let again = shardscope(&[
        "convert",
        repo(EXAMPLE).to_str().unwrap(),
        "-o",
        out_dir.to_str().unwrap(),
        "--to",
        "hf",
        "--config",
        config.to_str().unwrap(),
        "--mapping",
        mapping.to_str().unwrap(),
    ]);
    assert!(!again.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn refusals_name_what_is_wrong() {
    let dir = work("refuse");
    let src = repo(EXAMPLE);
    let src = src.to_str().unwrap();
    let out_dir = dir.join("hf");
    let o = out_dir.to_str().unwrap();
    // No config.
    let t = text(&shardscope(&["convert", src, "-o", o, "--to", "hf"]));
    assert!(t.contains("needs --config"), "{t}");
    // A config no built-in mapping fits: says what it tried and how to add one.
    let config = dir.join("config.json");
    std::fs::write(&config, r#"{"architectures": ["TinyForCausalLM"]}"#).unwrap();
    let c = config.to_str().unwrap();
    let t = text(&shardscope(&[
        "convert", src, "-o", o, "--to", "hf", "--config", c,
    ]));
    assert!(
        t.contains("no mapping to `hf` fits")
            && t.contains("torchtitan-llama3")
            && t.contains("--mapping"),
        "{t}"
    );
    // A mapping file that is not one: the file and the field.
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"version": 1, "name": "x", "from": "a", "to": "hf", "rulez": []}"#,
    )
    .unwrap();
    let t = text(&shardscope(&[
        "convert",
        src,
        "-o",
        o,
        "--to",
        "hf",
        "--config",
        c,
        "--mapping",
        bad.to_str().unwrap(),
    ]));
    assert!(t.contains("bad.json") && t.contains("rulez"), "{t}");
    // A config that is not JSON.
    std::fs::write(&config, "{not json").unwrap();
    let t = text(&shardscope(&[
        "convert", src, "-o", o, "--to", "hf", "--config", c,
    ]));
    assert!(t.contains("not a JSON config"), "{t}");
    // --to torchtitan needs a .safetensors file or --world-size.
    std::fs::write(&config, r#"{"architectures": ["LlamaForCausalLM"]}"#).unwrap();
    let t = text(&shardscope(&[
        "convert",
        src,
        "-o",
        dir.join("x.pt").to_str().unwrap(),
        "--to",
        "torchtitan",
        "--config",
        c,
    ]));
    assert!(t.contains("--world-size N"), "{t}");
    assert!(!out_dir.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mappings_lists_and_prints_the_builtin_files() {
    let out = shardscope(&["mappings", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: BTreeSet<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    for want in [
        "torchtitan-llama3",
        "torchtitan-qwen3",
        "torchtitan-deepseek_v3",
        "torchtitan-gpt_oss",
        "megatron-gpt",
        "hf",
    ] {
        assert!(names.contains(want), "{names:?}");
    }
    let out = shardscope(&["mappings", "torchtitan-gpt_oss"]);
    let file: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(file["to"], "hf");
    let t = text(&shardscope(&["mappings", "nope"]));
    assert!(t.contains("torchtitan-llama3"), "{t}");
}

/// Every torchtitan fixture to HF and back, against torchtitan's own adapter, transformers'
/// `from_pretrained` logits and torchtitan's `from_hf` (tests/interop/check_hf_mapping.py).
#[test]
fn torchtitan_models_to_hf_and_back_match_torchtitan_and_transformers() {
    crate::common::run_interop_script("check_hf_mapping.py");
}

/// Every torchtitan fixture's HF model converted back with `--to torchtitan --world-size 2`, then
/// loaded by torchtitan 0.3.0's own `CheckpointManager` as a fine-tuning run loads converted weights
/// (`initial_load_path`, model only) into its FSDP2 model on 2 gloo ranks: every tensor equal to
/// torchtitan's `from_hf` (tests/interop/check_titan_load.py).
#[test]
fn torchtitan_checkpoint_manager_loads_the_way_back() {
    crate::common::run_interop_script("check_titan_load.py");
}

/// Megatron-core's own GPTModel (tests/fixtures/megatron_gpt/gen_megatron_gpt.py) as
/// `model.state_dict()` names it and as `dist_checkpointing` saved it with tensor parallelism 2
/// (layers stacked), to the HF model: bit for bit against the weights the generator proved by
/// Megatron's logits, and `from_pretrained` logits (tests/interop/check_megatron_hf.py).
#[test]
fn megatron_gpt_to_hf_matches_megatron() {
    crate::common::run_interop_script("check_megatron_hf.py");
}

/// Dead ends a newcomer met (issue 38), each answered with the way out.
#[test]
fn dead_ends_point_the_way_out() {
    let dir = work("dead-ends");
    let src = repo(EXAMPLE);
    let src = src.to_str().unwrap();
    // reshard without a description: convert --world-size is the way to another world size.
    let t = text(&shardscope(&[
        "reshard",
        src,
        "-o",
        dir.join("r3").to_str().unwrap(),
        "--to-world-size",
        "3",
    ]));
    assert!(
        t.contains("needs --model")
            && t.contains(&format!("shardscope convert {src} -o"))
            && t.contains("--world-size 3"),
        "{t}"
    );
    // A dtype that is no cast target: the accepted ones, and only those.
    let t = text(&shardscope(&[
        "convert",
        src,
        "-o",
        dir.join("x.safetensors").to_str().unwrap(),
        "--dtype",
        "float8",
    ]));
    assert!(
        t.contains("bf16, fp16, fp32 or fp64") && !t.contains("int64"),
        "{t}"
    );
    let t = text(&shardscope(&[
        "convert",
        src,
        "-o",
        dir.join("x.safetensors").to_str().unwrap(),
        "--dtype",
        "int64",
    ]));
    assert!(t.contains("bf16, fp16, fp32 or fp64"), "{t}");
    // An existing output folder: the same hint as a file.
    let full = dir.join("full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("keep"), b"x").unwrap();
    let t = text(&shardscope(&[
        "convert",
        src,
        "-o",
        full.to_str().unwrap(),
        "--world-size",
        "2",
    ]));
    assert!(t.contains("never overwrites"), "{t}");
    assert_eq!(std::fs::read(full.join("keep")).unwrap(), b"x");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sets every byte of tensor `key` of a safetensors file to `value` (the file's own header gives
/// its byte range).
fn overwrite_tensor(path: &Path, key: &str, value: u8) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offsets = header[key]["data_offsets"].as_array().unwrap();
    let (a, b) = (
        8 + n + offsets[0].as_u64().unwrap() as usize,
        8 + n + offsets[1].as_u64().unwrap() as usize,
    );
    bytes[a..b].fill(value);
    std::fs::write(path, bytes).unwrap();
}

/// gpt_oss's MoE load-balancing bias (`expert_bias_E`) has no place in transformers' model: left
/// out silently while it is zero (as torchtitan leaves it when never updated), with a warning naming
/// it when it is not (the HF model would route tokens differently), and as zeros on the way back.
#[test]
fn a_dropped_bias_that_is_not_zero_is_named() {
    let fixture = repo("tests/fixtures/hf_mapping/gpt_oss");
    let config = fixture.join("config.json");
    let dir = work("lost");
    let titan = dir.join("titan.safetensors");
    let out = shardscope(&[
        "convert",
        fixture.join("step-2").to_str().unwrap(),
        "-o",
        titan.to_str().unwrap(),
        "-q",
    ]);
    assert!(out.status.success(), "{}", text(&out));

    let to_hf = |titan: &Path, hf: &Path| {
        shardscope(&[
            "convert",
            titan.to_str().unwrap(),
            "-o",
            hf.to_str().unwrap(),
            "--to",
            "hf",
            "--config",
            config.to_str().unwrap(),
            "--json",
        ])
    };
    let hf = dir.join("hf-zero");
    let out = to_hf(&titan, &hf);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!text(&out).contains("warning"), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["dropped_not_zero"], serde_json::json!([]));

    overwrite_tensor(&titan, "layers.1.moe.expert_bias_E", 0x3f);
    let hf = dir.join("hf-lost");
    let out = to_hf(&titan, &hf);
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("warning:")
            && t.contains("layers.1.moe.expert_bias_E")
            && !t.contains("layers.0.moe.expert_bias_E,"),
        "{t}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        summary["dropped_not_zero"],
        serde_json::json!(["layers.1.moe.expert_bias_E"])
    );

    // The way back writes the bias again, as zeros (what a freshly built torchtitan model holds).
    let back = dir.join("back.safetensors");
    let out = shardscope(&[
        "convert",
        hf.to_str().unwrap(),
        "-o",
        back.to_str().unwrap(),
        "--to",
        "torchtitan",
        "--config",
        config.to_str().unwrap(),
        "-q",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let keys: BTreeSet<String> = tensors(&back).into_iter().map(|(k, _)| k).collect();
    assert!(
        keys.contains("layers.0.moe.expert_bias_E") && keys.contains("layers.1.moe.expert_bias_E"),
        "{keys:?}"
    );
    let bytes = std::fs::read(&back).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let o = header["layers.1.moe.expert_bias_E"]["data_offsets"]
        .as_array()
        .unwrap();
    assert!(
        bytes[8 + n + o[0].as_u64().unwrap() as usize..8 + n + o[1].as_u64().unwrap() as usize]
            .iter()
            .all(|&b| b == 0)
    );
    std::fs::remove_dir_all(&dir).ok();
}
