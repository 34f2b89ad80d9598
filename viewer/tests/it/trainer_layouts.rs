//! The layout an opened training checkpoint gets (issue 38): its API, world size and model part
//! come from what the checkpoint shows, never from the bundled example the viewer starts with.
//! The browser opens the example first and the desktop viewer does without files: both are
//! replayed here (`Viewer::open_example`, then the checkpoint).
//!
//! Expected values: the fixtures' generators ran torch's FSDP2 (`fully_shard`) on 2 gloo ranks
//! (accelerate's `save_state` and the HF Trainer's folder around it, Lightning, torchtitan's
//! `CheckpointManager`, torch_checkpointing, per-rank files, verl); what torch stored is each
//! rank's `torch.chunk` of every parameter, so FSDP2's layout at 2 ranks must match every stored
//! chunk (the overlay), and a layout that does not (another API, world size or model) must say so.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};

use shardscope_core::layout::Api;
use shardscope_viewer::app::{EXAMPLE_MODEL_NAME, Viewer};

fn trainer_folders() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trainer_folders")
}

/// The viewer as it starts (the bundled example), then `path` opened.
fn open_after_example(path: &Path) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.open_example();
    while v.poll_loader() > 0 {}
    let m = v.model.as_ref().unwrap();
    assert!(m.example && m.name == EXAMPLE_MODEL_NAME, "{}", m.name);
    v.loader.open_path(path.to_path_buf());
    while v.poll_loader() > 0 {}
    assert!(
        v.checkpoint.is_some(),
        "{}: {:?}",
        path.display(),
        v.messages
    );
    v
}

#[test]
fn fsdp2_trainer_folders_open_as_fsdp2_with_their_own_layout_matching_every_chunk() {
    for folder in [
        "acc_save_state",
        "checkpoint-2",
        "lightning_sharded",
        "step-2",
        "one_file_per_rank",
        "tc_safetensors",
        "tc_raw",
        "tc_default",
        "tc_items",
        "verl_fsdp2",
    ] {
        let mut v = open_after_example(&trainer_folders().join(folder));
        assert_eq!(
            v.controls.api,
            Api::Fsdp2,
            "{folder}: {:?}",
            v.controls.origins
        );
        assert_eq!(
            v.controls.world_size, 2,
            "{folder}: {:?}",
            v.controls.origins
        );
        for origin in [&v.controls.origins.api, &v.controls.origins.world_size] {
            assert!(
                origin
                    .as_deref()
                    .is_some_and(|o| o.starts_with("from the checkpoint")),
                "{folder}: {:?}",
                v.controls.origins
            );
        }
        let m = v
            .model
            .as_ref()
            .unwrap_or_else(|| panic!("{folder}: {:?}", v.messages));
        assert!(m.derived.is_some() && !m.example, "{folder}: {}", m.name);
        v.recompute();
        let overlay = v.overlay.as_ref().unwrap();
        assert!(
            overlay.applicable && !overlay.params.is_empty() && overlay.difference_count() == 0,
            "{folder}: {} {:?}",
            overlay.summary(),
            overlay.notes
        );
        assert!(
            overlay
                .summary()
                .starts_with("stored chunks match the layout"),
            "{folder}"
        );
        // Another API is a difference the overlay names, not a match.
        v.controls.api = Api::Fsdp1;
        v.recompute();
        let overlay = v.overlay.as_ref().unwrap();
        assert!(
            overlay.summary().contains("API FSDP2 in the checkpoint"),
            "{folder}: {}",
            overlay.summary()
        );
    }
}

/// A checkpoint whose layout cannot be derived (an optimizer alone: no model part) shows no
/// layout, and says so; the example's is not kept in its place.
#[test]
fn a_checkpoint_without_a_derivable_layout_shows_none_and_says_why() {
    let v = open_after_example(&trainer_folders().join("acc_save_state/optimizer_0"));
    assert!(
        v.model.is_none(),
        "the layout of {:?} was kept",
        v.model.as_ref().map(|m| &m.name)
    );
    assert!(v.view.is_none() && v.overlay.is_none());
    let said = v.messages.join("\n");
    assert!(said.contains("no layout for"), "{said}");
    assert!(said.contains("cannot derive a model description"), "{said}");
}

/// A model description the user opened is kept over a checkpoint's derived layout, and the
/// overlay of a layout of another model says it compared nothing instead of "match".
#[test]
fn a_users_description_is_kept_and_another_models_layout_is_no_match() {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny_model.json");
    v.loader.open_path(example);
    while v.poll_loader() > 0 {}
    v.loader.open_path(trainer_folders().join("step-2"));
    while v.poll_loader() > 0 {}
    let m = v.model.as_ref().unwrap();
    assert!(m.derived.is_none() && !m.example, "{}", m.name);
    v.recompute();
    let summary = v.overlay.as_ref().unwrap().summary();
    assert!(summary.starts_with("nothing compared"), "{summary}");
}

/// The Verify tab marks a report's key "(not in the layout)" only when it is not: a key under the
/// app-state wrapper (`model.embed.weight` in the bundled `examples/fsdp2_dcp`, written by torch's
/// `dcp.save({"model": ..., "optim": ...})`) is the derived layout's parameter `embed.weight`.
#[test]
fn report_keys_under_the_app_state_wrapper_are_in_the_layout() {
    use shardscope_viewer::panels::verify::in_layout;
    let dcp = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/fsdp2_dcp");
    let mut v = open_after_example(&dcp);
    v.recompute();
    let c = v.checkpoint.as_ref().unwrap();
    let wrapper = shardscope_core::checkpoint::app_state_prefix(&c.index);
    assert_eq!(wrapper, Some("model"));
    let view = v.view.as_ref().expect("a derived layout");
    let params: Vec<String> = c
        .index
        .entries
        .iter()
        .filter_map(|e| e.key.strip_prefix("model."))
        .map(str::to_owned)
        .collect();
    assert!(!params.is_empty());
    for p in &params {
        assert!(
            view.by_fqn.contains_key(p.as_str()),
            "{p} not in the derived layout"
        );
        let key = format!("model.{p}");
        assert!(in_layout(Some(view), wrapper, &key), "{key}");
    }
    assert!(!in_layout(Some(view), wrapper, "model.no_such.weight"));
    assert!(!in_layout(
        Some(view),
        wrapper,
        "optim.state.embed.weight.exp_avg"
    ));
    assert!(!in_layout(None, wrapper, &format!("model.{}", params[0])));
}
