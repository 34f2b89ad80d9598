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

/// DeepSpeed's record of one rank's flat group (`expected/<case>.partitions.json`, written by the
/// generator from the live engine's own bookkeeping): the saved length, the padding runs, the
/// group padding its moments keep (cut off the saved fp32 partition only), and where `name`'s
/// piece lies.
struct GroupRecord {
    numel: u64,
    padding: Vec<(u64, u64)>,
    group_padding: u64,
}

fn group_record(case: &str, rank: usize, group: usize) -> GroupRecord {
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            deepspeed()
                .join("expected")
                .join(format!("{case}.partitions.json")),
        )
        .unwrap(),
    )
    .unwrap();
    let g = &v["ranks"][rank]["groups"][group];
    GroupRecord {
        numel: g["numel"].as_u64().unwrap(),
        padding: g["padding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_u64().unwrap()))
            .collect(),
        group_padding: g["group_padding"].as_u64().unwrap(),
    }
}

/// The element of `name`'s piece on `rank` where it starts in its flat group, per DeepSpeed.
fn piece_at(case: &str, rank: usize, name: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            deepspeed()
                .join("expected")
                .join(format!("{case}.partitions.json")),
        )
        .unwrap(),
    )
    .unwrap();
    v["ranks"][rank]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["params"].as_array().unwrap())
        .find(|p| p["name"] == name)
        .unwrap()["at"]
        .as_u64()
        .unwrap()
}

/// The padding runs of a moment laid out like a rank's fp32 partition: the partition's runs and
/// the group padding after its end, one run where they touch.
fn moment_runs(r: &GroupRecord) -> Vec<(u64, u64)> {
    let mut runs = r.padding.clone();
    if r.group_padding > 0 {
        match runs.last_mut() {
            Some((at, n)) if *at + *n == r.numel => *n += r.group_padding,
            _ => runs.push((r.numel, r.group_padding)),
        }
    }
    runs
}

/// The file offset of the fp32 flat group (or moment) that `key`'s piece on `rank` lies in: the
/// piece's chunk names its storage offset, and DeepSpeed's record says where the piece starts.
fn flat_storage(dir: &Path, case: &str, key: &str, param: &str, rank: usize) -> (String, u64) {
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
        .filter(|c| c["rank"] == rank)
        .min_by_key(|c| c["storage_offset"].as_u64().unwrap())
        .unwrap();
    let elements = chunk["storage_offset"].as_u64().unwrap() - piece_at(case, rank, param);
    (
        chunk["file"].as_str().unwrap().to_owned(),
        chunk["byte_offset"].as_u64().unwrap() + elements * 4,
    )
}

/// ZeRO-1/2 saves with `parameter_alignment` (`zero1_bf16_padded`, `zero2_fp32_padded`): DeepSpeed
/// pads each parameter but a group's last to 16 bytes of the training precision, inside the saved
/// partitions, and the last rank's moments keep the group padding its fp32 partition lost on save.
/// verify reads exactly the runs DeepSpeed's bookkeeping gives (none is zero in its files);
/// a non-zero byte in a moment's alignment padding, or in the group padding of the last rank's
/// moment, is named (file, key, rank, group, elements, bytes) by verify (exit 1) and doctor.
#[test]
fn zero12_alignment_and_group_padding_are_read_and_a_change_named() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, prefix) in [("zero1_bf16_padded", "bf16_"), ("zero2_fp32_padded", "")] {
        // The runs DeepSpeed's record gives: each fp32 partition's, and each of the two moments'
        // (exp_avg, exp_avg_sq) of every rank and group; float32, 4 bytes an element.
        let (mut runs, mut elements) = (0, 0);
        for rank in 0..2 {
            for group in 0..2 {
                let r = group_record(case, rank, group);
                runs += r.padding.len();
                elements += r.padding.iter().map(|p| p.1).sum::<u64>();
                let m = moment_runs(&r);
                runs += 2 * m.len();
                elements += 2 * m.iter().map(|p| p.1).sum::<u64>();
            }
        }
        assert!(runs > 0, "{case}");
        let clean = deepspeed().join(case);
        let text = ok(&run(&["verify", "-q", s(&clean)]), case);
        let want = format!(
            "{runs} run(s) ({} bytes) of the ranks' fp32 partitions and moments read, 0 not zero",
            elements * 4
        );
        assert!(text.contains(&want), "{case}: want {want} in\n{text}");
        let doctor = ok(&run(&["doctor", s(&clean)]), case);
        assert!(!doctor.contains("deepspeed-padding"), "{case}: {doctor}");

        // Rank 0: the alignment padding after embed.weight (group 0's first run) in exp_avg.
        // Rank 1: the group padding after the end of its saved partition, in exp_avg_sq.
        let r0 = group_record(case, 0, 0);
        let r1 = group_record(case, 1, 0);
        assert!(
            r1.group_padding > 0,
            "{case}: rank 1 holds no group padding"
        );
        let pokes = [
            (0, "embed.weight", "exp_avg", r0.padding[0]),
            (
                1,
                "down.weight",
                "exp_avg_sq",
                *moment_runs(&r1).last().unwrap(),
            ),
        ];
        for (rank, param, moment, (at, n)) in pokes {
            let dir = copy_case(case, &tmp.path().join(format!("{rank}")));
            let key = format!("optimizer.state.{param}.{moment}");
            let (file, storage) = flat_storage(&dir, case, &key, param, rank);
            assert_eq!(
                file,
                format!("global_step2/{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            );
            let poked = poke(&dir.join(&file), storage, at + n - 1);
            let out = run(&["verify", "-q", s(&dir)]);
            let text = String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(1), "{case}: {text}");
            let want = format!(
                "{file}: `optimizer_state_dict.base_optimizer_state.state.0.{moment}` (rank {rank}, group 0): its padding, elements {at}..{} at bytes {}..{}, is not zero (first at byte {poked})",
                at + n,
                storage + at * 4,
                storage + (at + n) * 4
            );
            assert!(text.contains(&want), "{case}: want {want} in\n{text}");
            let doctor = ok(&run(&["doctor", s(&dir), "--json"]), "doctor");
            let report: serde_json::Value = serde_json::from_str(&doctor).unwrap();
            let finding = report["findings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["code"] == "deepspeed-padding")
                .unwrap_or_else(|| panic!("{case}: {doctor}"));
            assert_eq!(finding["severity"], "warning");
            assert!(
                finding["message"]
                    .as_str()
                    .unwrap()
                    .contains(&want[file.len() + 2..]),
                "{case}: {finding}"
            );
        }
    }
}
