//! The shard map of an opened checkpoint, with no model description: the viewer derives it from
//! the checkpoint alone (`Checkpoint::describe_auto`: the app-state `model` part, the repeated
//! blocks `model.layers.N` and the root as units), and the units are a field the user edits.
//! Expected: what torch's `transformer_auto_wrap_policy` built for the same model
//! (`tests/fixtures/app_state/auto_wrap_ws2.json`, written by torch 2.15).
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::PathBuf;

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use shardscope_core::layout::{Api, Layout, LayoutConfig, Strategy, compute};
use shardscope_viewer::app::{Viewer, set_units};

fn app_state() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/app_state")
}

fn open_app_state_dcp() -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    let dir = app_state().join("dcp");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for p in names {
        v.open_bytes(
            p.file_name().unwrap().to_str().unwrap(),
            std::fs::read(&p).unwrap(),
        );
    }
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    v
}

#[test]
fn opened_checkpoint_gets_torchs_auto_wrap_layout() {
    let mut v = open_app_state_dcp();
    let m = v
        .model
        .as_ref()
        .unwrap_or_else(|| panic!("{:?}", v.messages));
    assert!(m.derived.is_some(), "{}", m.name);
    assert_eq!(
        m.model.units,
        vec!["", "model.layers.0", "model.layers.1"],
        "{:?}",
        v.messages
    );
    assert!(
        v.messages
            .iter()
            .any(|s| s.contains("model.layers.N (2 blocks)")),
        "{:?}",
        v.messages
    );
    let config = LayoutConfig {
        api: Api::Fsdp1,
        world_size: 2,
        shard_group_size: None,
        use_orig_params: false,
        strategy: Strategy::FullShard,
        param_dtype: None,
    };
    let Layout::Fsdp1(ours) = compute(&m.model, &config).unwrap() else {
        panic!("not FSDP1");
    };
    let torch: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(app_state().join("auto_wrap_ws2.json")).unwrap(),
    )
    .unwrap();
    let torch_fp = torch["ranks"][0]["flat_params"].as_array().unwrap();
    assert_eq!(ours.flat_params.len(), torch_fp.len());
    for (o, t) in ours.flat_params.iter().zip(torch_fp) {
        assert_eq!(o.unit_prefix, t["unit_prefix"].as_str().unwrap());
        let fqns: Vec<&str> = t["fqns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .collect();
        assert_eq!(o.fqns, fqns, "{}", o.unit_prefix);
        assert_eq!(
            o.sharded_numel,
            t["sharded_numel"].as_u64().unwrap(),
            "{}",
            o.unit_prefix
        );
    }
    // The panels draw it: the layout view has the three units.
    v.controls.world_size = 2;
    v.recompute();
    let view = v
        .view
        .as_ref()
        .unwrap_or_else(|| panic!("{:?}", v.layout_error));
    let prefixes: Vec<&str> = view.units.iter().map(|u| u.prefix.as_str()).collect();
    assert_eq!(prefixes, vec!["", "model.layers.0", "model.layers.1"]);
}

#[test]
fn units_are_edited_live() {
    let v = open_app_state_dcp();
    // Through the field: the units follow the patterns typed.
    let mut h = Harness::builder()
        .with_size(egui::vec2(1200.0, 800.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), v);
    h.run();
    h.get_by_label("root module is a unit").click();
    h.run();
    let units = h.state().model.as_ref().unwrap().model.units.clone();
    assert_eq!(units, vec!["model.layers.0", "model.layers.1"]);
    let mut v = h.into_state();
    // Patterns: `N` is a block number, `*` any segment; the root alone when none match.
    let m = v.model.as_mut().unwrap();
    m.derived.as_mut().unwrap().patterns = "model.layers.N.self_attn, model.*".into();
    m.derived.as_mut().unwrap().root = true;
    set_units(m);
    assert_eq!(
        m.model.units,
        vec![
            "",
            "model.embed_tokens",
            "model.layers",
            "model.layers.0.self_attn",
            "model.layers.1.self_attn",
            "model.norm"
        ]
    );
    // A description opened by hand is kept: a later checkpoint does not replace it.
    let model = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny_model.json"),
    )
    .unwrap();
    v.open_bytes("tiny_model.json", model);
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    assert!(v.model.as_ref().unwrap().derived.is_none());
    let dir = app_state().join("dcp");
    for name in [".metadata", "__0_0.distcp"] {
        v.open_bytes(name, std::fs::read(dir.join(name)).unwrap());
    }
    assert_eq!(v.poll_loader(), 0, "{:?}", v.messages);
    assert_eq!(v.model.as_ref().unwrap().name, "tiny_model.json");
}

/// Training checkpoints as trainers write them open in the viewer as in the CLI (both through
/// `Checkpoint::open`): every part listed (keys as `shardscope inspect` lists them), and a layout
/// derived for the model part where the model has repeated blocks to find.
#[test]
fn trainer_folders_open_with_every_part_and_a_layout() {
    let f = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trainer_folders");
    for (folder, want, layout) in [
        (
            "acc_save_state",
            ["model.lm_head.weight", "extra.scheduler.last_epoch"],
            true,
        ),
        (
            "checkpoint-2",
            ["model.lm_head.weight", "extra.rng_state.cpu"],
            true,
        ),
        (
            "tc_safetensors",
            ["model.output.weight", "extra.train_state.step"],
            true,
        ),
        // JSON (`train_state_{rank}.json`) and raw (`dataloader/rank_{rank}.bin`) items.
        (
            "tc_raw",
            ["extra.train_state.step", "extra.dataloader"],
            true,
        ),
        ("lightning_sharded", ["model.head.weight", "step"], true),
        ("step-2", ["output.weight", "train_state.step"], true),
        // Megatron-core's torch_dist with its `common.pt`; torch_checkpointing without
        // `metadata.pkl` (JSON and raw per-rank items) and with its default naming; verl's sets.
        (
            "megatron_torch_dist",
            ["embedding.word_embeddings.weight", "iteration"],
            false,
        ),
        ("tc_items", ["extra.train_state.step", "extra.x"], false),
        (
            "tc_default",
            [
                "model.layers.0.attention.wq.weight",
                "extra.lr_scheduler._last_lr",
            ],
            false,
        ),
        (
            "verl_fsdp1",
            [
                "extra.lr_scheduler._last_lr",
                "extra.lr_scheduler._is_initial",
            ],
            false,
        ),
    ] {
        let mut v = Viewer::new();
        v.loader.synchronous = true;
        v.loader.open_path(f.join(folder));
        while v.poll_loader() > 0 {}
        let ckpt = v
            .checkpoint
            .as_ref()
            .unwrap_or_else(|| panic!("{folder}: {:?}", v.messages));
        for key in want {
            assert!(ckpt.by_key.contains_key(key), "{folder}: no {key}");
        }
        if !layout {
            continue;
        }
        let m = v
            .model
            .as_ref()
            .unwrap_or_else(|| panic!("{folder}: {:?}", v.messages));
        assert!(m.derived.is_some(), "{folder}");
        assert!(
            m.model.units.len() >= 2,
            "{folder}: units {:?}",
            m.model.units
        );
    }
}
