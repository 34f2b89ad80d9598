//! A DeepSpeed folder inside an HF Trainer checkpoint, opened through `Checkpoint::open` (the
//! reader's own tests are in `index::read::deepspeed::tests`, whose fixture helpers this uses).
#![allow(clippy::unwrap_used)]

use super::{Checkpoint, ReadOptions};
use crate::index::CheckpointKind;
use crate::index::read::deepspeed::tests::{expected, fixtures, load};
use crate::source::Source as _;

#[test]
fn a_trainer_folder_around_the_tag_is_read_as_deepspeed() {
    // HF Trainer's `checkpoint-N/`: `latest`, the tag folder, and the trainer's own files.
    let mut s = load(&fixtures().join("zero2_bf16"));
    let args = s
        .read_all("global_step2/mp_rank_00_model_states.pt")
        .unwrap()
        .to_vec();
    s.insert("training_args.bin", args);
    s.insert("trainer_state.json", b"{}".to_vec());
    let ck = Checkpoint::open(&s, "checkpoint-2", &ReadOptions::default()).unwrap();
    assert!(
        matches!(
            ck.index.kind,
            CheckpointKind::DeepSpeedZero { stage: 2, .. }
        ),
        "{:?}",
        ck.index.kind
    );
    assert!(
        ck.notes
            .iter()
            .any(|n| n.contains("not read") && n.contains("training_args.bin")),
        "{:?}",
        ck.notes
    );
    assert_eq!(
        ck.written_by.as_deref(),
        Some("Hugging Face Trainer checkpoint (DeepSpeed 0.19.8 engine state)")
    );
    // --model-only: the model as zero_to_fp32 gives it.
    let options = ReadOptions {
        model_only: true,
        ..Default::default()
    };
    let ck = Checkpoint::open(&s, "checkpoint-2", &options).unwrap();
    let mut keys: Vec<(u64, &str)> = ck
        .index
        .entries
        .iter()
        .map(|e| (e.position.unwrap(), e.key.as_str()))
        .collect();
    keys.sort_unstable();
    let keys: Vec<&str> = keys.into_iter().map(|(_, k)| k).collect();
    assert_eq!(keys, expected("zero2_bf16").keys);
}
