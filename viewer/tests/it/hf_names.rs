//! The FQN map shows the Hugging Face name beside each stored name when a `config.json` is opened
//! with a checkpoint: the names `shardscope convert --to hf` writes. Expected: the names torchtitan's
//! own `StateDictAdapter.to_hf` gave for the same checkpoint (`expected/keys.json` of
//! `tests/fixtures/hf_mapping`, written by `gen_torchtitan_hf.py` with torchtitan 0.3.0).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use egui::accesskit::Role;
use egui_kittest::Harness;
use egui_kittest::kittest::{NodeT, Queryable};
use shardscope_viewer::{Tab, Viewer};

fn fixture(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf_mapping")
        .join(model)
}

/// Opens the files of `dir` (one checkpoint) and then `config.json`, as a user picks them.
fn open(dir: &Path, config: &Path) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for p in names {
        let name = format!(
            "{}/{}",
            dir.file_name().unwrap().to_str().unwrap(),
            p.file_name().unwrap().to_str().unwrap()
        );
        v.open_bytes(name, std::fs::read(&p).unwrap());
    }
    v.loader.end_batch();
    v.open_bytes("config.json", std::fs::read(config).unwrap());
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    v
}

/// torchtitan's own HF names of the fixture (`to_hf`), as its generator recorded them.
fn torchtitan_hf_names(model: &str) -> BTreeSet<String> {
    let keys: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(model).join("expected/keys.json")).unwrap())
            .unwrap();
    keys["hf"].as_object().unwrap().keys().cloned().collect()
}

fn shown_names(v: &Viewer) -> BTreeSet<String> {
    let names = v.hf_names.as_ref().expect("HF names");
    assert!(names.error.is_none(), "{:?}", names.error);
    names.names.values().flatten().cloned().collect()
}

#[test]
fn fqn_map_shows_torchtitans_own_hf_names() {
    for (model, step) in [
        ("llama3", "step-2"),
        ("llama3", "step-1"),
        ("deepseek_v3", "step-2"),
    ] {
        let dir = fixture(model);
        let v = open(&dir.join(step), &dir.join("config.json"));
        assert!(v.view.is_some(), "{model} {step}: {:?}", v.messages);
        assert_eq!(
            v.hf_names.as_ref().unwrap().mapping.as_deref(),
            Some(format!("torchtitan-{model}").as_str()),
            "{model} {step}: {:?}",
            v.messages
        );
        assert_eq!(
            shown_names(&v),
            torchtitan_hf_names(model),
            "{model} {step}"
        );
    }
}

#[test]
fn the_hf_name_column_is_shown_and_searched() {
    let dir = fixture("deepseek_v3");
    let mut v = open(&dir.join("step-2"), &dir.join("config.json"));
    assert_eq!(v.tab, Tab::FqnMap);
    v.tab = Tab::FqnMap;
    let mut h = Harness::builder()
        .with_size(egui::Vec2::new(1600.0, 900.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), v);
    h.run();
    h.get_by_label("HF name");
    h.get_by_label_contains("what `shardscope convert --to hf --config config.json` writes");
    h.get_by_label("model.embed_tokens.weight");
    // A grouped expert tensor is many HF tensors: the first, and how many more.
    let n: usize = torchtitan_hf_names("deepseek_v3")
        .iter()
        .filter(|k| {
            k.starts_with("model.layers.1.mlp.experts.") && k.ends_with(".gate_proj.weight")
        })
        .count();
    assert!(n > 1);
    h.get_by_label(&format!(
        "model.layers.1.mlp.experts.0.gate_proj.weight (+{} more)",
        n - 1
    ));
    // Searching an HF name finds the stored tensor it comes from.
    h.get_by_role_and_label(Role::TextInput, "Search").focus();
    h.run();
    h.get_by_role_and_label(Role::TextInput, "Search")
        .type_text("kv_a_proj_with_mqa");
    h.run();
    let total = h.state().view.as_ref().unwrap().params.len();
    let counts: Vec<String> = h
        .query_all_by_label_contains("parameters")
        .filter_map(|n| n.accesskit_node().label().or_else(|| n.value()))
        .filter(|l| l.ends_with(&format!("of {total} parameters")))
        .collect();
    assert_eq!(
        counts,
        vec![format!("2 of {total} parameters")],
        "one per layer"
    );
    // The stored tensor's row (its name shows in more than one column of an FSDP2 layout).
    assert!(
        h.query_all_by_label("layers.0.attention.wkv_a.weight")
            .next()
            .is_some()
    );
}

#[test]
fn a_config_that_does_not_fit_says_why() {
    let dir = fixture("llama3");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["hidden_size"] = serde_json::json!(config["hidden_size"].as_u64().unwrap() * 2);
    let tmp = std::env::temp_dir().join(format!("shardscope-hf-names-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join("config.json");
    std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    let v = open(&dir.join("step-2"), &path);
    std::fs::remove_dir_all(&tmp).ok();
    let names = v.hf_names.as_ref().unwrap();
    let e = names.error.as_deref().unwrap_or_default();
    assert!(e.contains("hidden_size"), "{e}");
    assert!(
        v.messages
            .iter()
            .any(|m| m.contains("HF names") && m.contains("hidden_size")),
        "{:?}",
        v.messages
    );
}
