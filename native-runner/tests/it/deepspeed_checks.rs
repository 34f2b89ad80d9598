//! `verify` and `doctor` on DeepSpeed ZeRO folders written by DeepSpeed 0.19.8
//! (`tests/fixtures/deepspeed/gen_deepspeed.py`): the padding of the ranks' flat partitions.
//!
//! Where the padding lies follows from DeepSpeed's ZeRO-3 partition rule (each parameter split
//! into `ceil(numel / world_size)` elements per rank, the last part padded): in `zero3_fp32`
//! (2 ranks), `up.bias` (7 elements) is 4 + 3, so element 3 of rank 1's group 1 (the biases and
//! norms: `up.bias` first) is padding, in the fp32 partition and in each moment laid out like it.
//! DeepSpeed's optimizer keeps the moments' padding zero (no gradient reaches it); it does not zero
//! the fp32 weights' padding (its own `zero3_bf16_ws3` holds uninitialized values there).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use crate::deepspeed::{copy_case, deepspeed, ok, run, s};

const RANK1: &str = "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt";

/// The file offset of rank 1's flat group 1 of `key` (`up.bias` or its `exp_avg`): the storage
/// that rank 1's piece of it lies in, its piece starting at element 0 (`up.bias` comes first in
/// the group).
fn rank1_group1_storage(dir: &Path, key: &str) -> u64 {
    let json = ok(&run(&["inspect", s(dir), "--json"]), key);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let entry = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["key"] == key)
        .unwrap();
    let chunk = entry["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["rank"] == 1)
        .unwrap();
    assert_eq!(chunk["file"], RANK1);
    assert_eq!(chunk["storage_offset"], 0);
    assert_eq!(chunk["sizes"][0], 3);
    chunk["byte_offset"].as_u64().unwrap()
}

/// Sets the high byte of float32 element `element` of the storage at `storage` in `file`.
fn poke(file: &Path, storage: u64, element: u64) -> u64 {
    let mut bytes = std::fs::read(file).unwrap();
    let at = usize::try_from(storage + element * 4 + 3).unwrap();
    assert_eq!(bytes[at], 0, "padding DeepSpeed wrote as zero");
    bytes[at] = 0x3f;
    std::fs::write(file, bytes).unwrap();
    at as u64
}

#[test]
fn deepspeed_padding_that_is_not_zero_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    // Unchanged: every run read, none named (verify exit 0, no doctor finding).
    let clean = deepspeed().join("zero3_fp32");
    let out = run(&["verify", "-q", s(&clean)]);
    let text = ok(&out, "verify");
    assert!(
        text.contains(
            "3 run(s) (12 bytes) of the ranks' fp32 partitions and moments read, 0 not zero"
        ),
        "{text}"
    );
    let doctor = ok(&run(&["doctor", s(&clean)]), "doctor");
    assert!(!doctor.contains("deepspeed-padding"), "{doctor}");
    // A moment's padding changed: verify fails naming the rank, file, key, group and bytes;
    // doctor warns.
    let dir = copy_case("zero3_fp32", &tmp.path().join("m"));
    let storage = rank1_group1_storage(&dir, "optimizer.state.up.bias.exp_avg");
    let at = poke(&dir.join(RANK1), storage, 3);
    let out = run(&["verify", "-q", s(&dir)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let want = format!(
        "{RANK1}: `optimizer_state_dict.optimizer_state_dict.state.1.exp_avg` (rank 1, group 1): its padding, elements 3..4 at bytes {}..{}, is not zero (first at byte {at})",
        storage + 12,
        storage + 16
    );
    assert!(text.contains(&want), "want {want} in\n{text}");
    let doctor = ok(&run(&["doctor", s(&dir), "--json"]), "doctor");
    let report: serde_json::Value = serde_json::from_str(&doctor).unwrap();
    let finding = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["code"] == "deepspeed-padding")
        .unwrap_or_else(|| panic!("{doctor}"));
    assert_eq!(finding["severity"], "warning");
    assert!(
        finding["message"]
            .as_str()
            .unwrap()
            .contains(&want[RANK1.len() + 2..]),
        "{finding}"
    );
    // The fp32 weights' padding changed: named in a note, verify still passes (DeepSpeed itself
    // leaves it uninitialized).
    let dir = copy_case("zero3_fp32", &tmp.path().join("w"));
    let storage = rank1_group1_storage(&dir, "up.bias");
    poke(&dir.join(RANK1), storage, 3);
    let out = run(&["verify", "-q", s(&dir)]);
    let text = ok(&out, "verify");
    assert!(
        text.contains("`optimizer_state_dict.fp32_flat_groups.1` (rank 1, group 1): its padding, elements 3..4")
            && text.contains("1 not zero"),
        "{text}"
    );
    // DeepSpeed's own save with uninitialized fp32 padding passes.
    let text = ok(
        &run(&["verify", "-q", s(&deepspeed().join("zero3_bf16_ws3"))]),
        "verify",
    );
    assert!(
        text.contains("fp32_flat_groups.1` (rank 2, group 1)"),
        "{text}"
    );
}

/// `doctor --reference` compares the model part of DeepSpeed saves (ZeRO folders and universal
/// ones) with the model they should load into (`expected/tinylm*.reference.pt`, saved by torch from
/// the generator's `TinyLM`, `gen_reference.py`): nothing to say with the right model, every
/// parameter of another shape named with the wrong one (a vocabulary of 12: the embedding and the
/// head tied to it).
#[test]
fn doctor_reference_compares_the_deepspeed_model() {
    let reference = |name: &str| {
        deepspeed()
            .join("expected")
            .join(format!("{name}.reference.pt"))
    };
    let model_codes = ["missing-key", "unexpected-key", "shape-mismatch"];
    for case in [
        "zero1_fp32",
        "zero1_bf16",
        "zero2_fp32",
        "zero3_bf16_ws3",
        "universal_zero2_bf16",
        "universal_zero3_fp32",
    ] {
        let dir = deepspeed().join(case);
        let out = run(&[
            "doctor",
            s(&dir),
            "--reference",
            s(&reference("tinylm")),
            "--json",
        ]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let findings = report["findings"].as_array().unwrap();
        assert!(
            findings
                .iter()
                .all(|f| !model_codes.contains(&f["code"].as_str().unwrap())),
            "{case}: {report}"
        );
        assert_eq!(report["loadable"], true, "{case}: {report}");
        assert_eq!(out.status.code(), Some(0), "{case}: {report}");
        let out = run(&[
            "doctor",
            s(&dir),
            "--reference",
            s(&reference("tinylm_vocab12")),
            "--json",
        ]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut shapes: Vec<String> = report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| model_codes.contains(&f["code"].as_str().unwrap()))
            .map(|f| {
                format!(
                    "{} {}",
                    f["code"].as_str().unwrap(),
                    f["keys"][0].as_str().unwrap()
                )
            })
            .collect();
        shapes.sort();
        assert_eq!(
            shapes,
            ["shape-mismatch embed.weight", "shape-mismatch head.weight"],
            "{case}: {report}"
        );
        assert_eq!(report["loadable"], false, "{case}");
        assert_ne!(out.status.code(), Some(0), "{case}");
    }
}

/// ZeRO-1's frozen parameter (DeepSpeed 0.19.8 records no `frozen_param_shapes` for it, and
/// zero_to_fp32 leaves it out) is in the output, and the commands say so.
#[test]
fn zero1_frozen_parameter_is_in_the_output_and_said() {
    let tmp = tempfile::tempdir().unwrap();
    for case in ["zero1_fp32", "zero1_bf16"] {
        let out = tmp.path().join(format!("{case}.safetensors"));
        let run_out = run(&["convert", s(&deepspeed().join(case)), "-o", s(&out)]);
        ok(&run_out, case);
        let stderr = String::from_utf8_lossy(&run_out.stderr);
        assert!(
            stderr.contains("included, where zero_to_fp32 leaves them out: frozen.weight"),
            "{case}: {stderr}"
        );
        let got = crate::deepspeed::safetensors_of(&out);
        let want = crate::deepspeed::expected(case);
        assert_eq!(
            got.get("frozen.weight"),
            want.tensors.get("frozen.weight"),
            "{case}"
        );
        let inspect = run(&["inspect", s(&deepspeed().join(case))]);
        assert!(
            String::from_utf8_lossy(&inspect.stderr).contains("zero_to_fp32 leaves them out"),
            "{case}"
        );
    }
}
