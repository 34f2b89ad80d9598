//! `shardscope doctor` on checkpoints written by real torch the way users end up with them
//! (`tests/fixtures/doctor`, see its `gen_doctor.py`). `expected.json` holds what torch itself
//! said for each strict `load_state_dict` (or `torch.load(weights_only=True)`): doctor must find an
//! error exactly when torch failed (the documented exception: a tied alias missing next to its
//! partner, which `from_pretrained` ties again), name every key torch's message names, and say
//! more than torch does (the cause). The interop test runs doctor's fixes and loads the results in
//! torch.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn fixtures() -> PathBuf {
    shardscope_tests::fixtures_dir().join("doctor")
}

struct Run {
    code: i32,
    report: Value,
    stderr: String,
}

fn doctor(ckpt: &[&str], extra: &[&str]) -> Run {
    let dir = fixtures();
    let mut cmd = Command::new(crate::common::shardscope_bin());
    cmd.arg("doctor");
    for c in ckpt {
        cmd.arg(dir.join(c));
    }
    for e in extra {
        if std::path::Path::new(e)
            .extension()
            .is_some_and(|x| x == "pt" || x == "json")
        {
            cmd.arg(dir.join(e));
        } else {
            cmd.arg(e);
        }
    }
    cmd.arg("--json");
    let out = cmd.output().expect("run shardscope doctor");
    let code = out.status.code().expect("exit code");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = if code == 2 {
        Value::Null
    } else {
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("doctor {ckpt:?}: bad JSON ({e}):\n{stdout}"))
    };
    Run {
        code,
        report,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn against_reference(ckpt: &str) -> Run {
    doctor(&[ckpt], &["--reference", "reference.pt"])
}

fn findings(run: &Run) -> Vec<&Value> {
    run.report["findings"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default()
}

fn error_codes(run: &Run) -> BTreeSet<String> {
    findings(run)
        .into_iter()
        .filter(|f| f["severity"] == "error")
        .map(|f| f["code"].as_str().expect("code").to_owned())
        .collect()
}

fn keys_of(run: &Run, code: &str) -> BTreeSet<String> {
    findings(run)
        .into_iter()
        .filter(|f| f["code"] == code)
        .flat_map(|f| f["keys"].as_array().cloned().unwrap_or_default())
        .map(|k| k.as_str().expect("key").to_owned())
        .collect()
}

fn messages(run: &Run) -> String {
    findings(run)
        .into_iter()
        .map(|f| f["message"].as_str().unwrap_or("").to_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

fn torch_says(name: &str) -> String {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).expect("expected.json");
    let v: Value = serde_json::from_str(&text).expect("expected.json is JSON");
    v[name]
        .as_str()
        .unwrap_or_else(|| panic!("expected.json has no {name}"))
        .to_owned()
}

/// The keys torch's `load_state_dict` error names in `size mismatch for KEY:` and in its
/// `Unexpected key(s) in state_dict: "a", "b"` list.
fn torch_named_keys(msg: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut size = BTreeSet::new();
    let mut unexpected = BTreeSet::new();
    for line in msg.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("size mismatch for ")
            && let Some((key, _)) = rest.split_once(':')
        {
            size.insert(key.to_owned());
        }
        if let Some(rest) = line.strip_prefix("Unexpected key(s) in state_dict: ") {
            for k in rest.split(", ") {
                unexpected.insert(k.trim().trim_end_matches('.').trim_matches('"').to_owned());
            }
        }
    }
    (size, unexpected)
}

/// Doctor fails a checkpoint exactly when torch did, with these codes, naming every key torch
/// named, and its messages carry `cause` (which torch's does not).
fn check_case(name: &str, codes: &[&str], cause: &str) {
    let run = against_reference(name);
    let torch = torch_says(name);
    assert_ne!(
        torch, "ok",
        "{name}: torch loaded it; the fixture is not broken"
    );
    assert_eq!(run.code, 1, "{name}: {:#}\n{}", run.report, run.stderr);
    assert_eq!(run.report["loadable"], false);
    let want: BTreeSet<String> = codes.iter().map(|c| (*c).to_owned()).collect();
    assert_eq!(error_codes(&run), want, "{name}: {:#}", run.report);
    let (size, unexpected) = torch_named_keys(&torch);
    let named: BTreeSet<String> = findings(&run)
        .into_iter()
        .flat_map(|f| f["keys"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k.as_str().map(ToOwned::to_owned))
        .collect();
    let clean = |k: &str| k.replace("_fsdp_wrapped_module.", "");
    let named_clean: BTreeSet<String> = named.iter().map(|k| clean(k)).collect();
    for k in size.iter().chain(&unexpected) {
        assert!(
            named.contains(k) || named_clean.contains(&clean(k)),
            "{name}: torch names `{k}`, doctor does not: {:#}",
            run.report
        );
    }
    let text = messages(&run);
    assert!(text.contains(cause), "{name}: no `{cause}` in\n{text}");
    assert!(
        !torch.contains(cause),
        "{name}: torch already says `{cause}`"
    );
    for f in findings(&run) {
        assert!(
            !f["fix"].as_str().unwrap_or("").is_empty(),
            "{name}: empty fix"
        );
    }
}

#[test]
fn wrapper_prefixes_from_fsdp_compile_and_ddp() {
    check_case("fsdp_wrapped.pt", &["wrapper-prefix"], "FSDP1 wrapping");
    check_case("compiled.pt", &["wrapper-prefix"], "torch.compile");
    check_case("ddp.pt", &["wrapper-prefix"], "DistributedDataParallel");
    let run = against_reference("compiled.pt");
    let fix = findings(&run)[0]["fix"].as_str().unwrap().to_owned();
    assert!(
        fix.starts_with("shardscope convert ") && fix.contains("--select _orig_mod"),
        "{fix}"
    );
}

#[test]
fn local_state_dict_is_flat_params() {
    let run = doctor(&["local"], &["--model", "model.json"]);
    assert_eq!(run.code, 1, "{:#}", run.report);
    assert_eq!(error_codes(&run), BTreeSet::from(["flat-param".to_owned()]));
    assert_eq!(
        keys_of(&run, "flat-param"),
        BTreeSet::from(["_flat_param".to_owned(), "block._flat_param".to_owned()])
    );
    let fix = findings(&run)
        .into_iter()
        .find(|f| f["code"] == "flat-param")
        .unwrap()["fix"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        fix.contains("--model") && fix.contains("model.json"),
        "{fix}"
    );
    // In a process group, torch's strict load into Net fails naming the flat parameters as
    // unexpected (and every parameter as missing); doctor names them and says what they are.
    let torch = torch_says("local/rank0.pt");
    let (_, unexpected) = torch_named_keys(&torch);
    assert!(!unexpected.is_empty(), "{torch}");
    assert!(
        unexpected.is_subset(&keys_of(&run, "flat-param")),
        "{torch}"
    );
    assert!(messages(&run).contains("LOCAL_STATE_DICT") && !torch.contains("LOCAL_STATE_DICT"));
    // One rank's file alone: the other rank is missing too.
    let run = doctor(&["local/rank0.pt"], &[]);
    assert!(error_codes(&run).contains("flat-param"), "{:#}", run.report);
}

#[test]
fn one_ranks_shard_saved_as_full() {
    check_case("fsdp2_rank1_local.pt", &["local-shard"], "split 2 ways");
    let run = against_reference("fsdp2_rank1_local.pt");
    // The replicated buffer `scale` is whole on every rank: not a shard.
    assert!(!keys_of(&run, "local-shard").contains("scale"));
    assert_eq!(keys_of(&run, "local-shard").len(), 8);
}

#[test]
fn replicated_buffer_concatenated() {
    check_case(
        "replicated_concat.pt",
        &["replicated-concatenated"],
        "identical copies",
    );
    let run = against_reference("replicated_concat.pt");
    assert_eq!(
        keys_of(&run, "replicated-concatenated"),
        BTreeSet::from(["scale".to_owned()])
    );
}

#[test]
fn flat_views_outside_summon() {
    check_case(
        "flattened.pt",
        &["flattened-shape", "empty-tensor"],
        "FSDP flat view",
    );
}

#[test]
fn rank0_only_state_dict_seen_from_rank1() {
    let torch = torch_says("empty_rank1.pt");
    assert!(torch.contains("Missing key(s)"), "{torch}");
    let run = against_reference("empty_rank1.pt");
    assert_eq!(run.code, 1);
    assert_eq!(
        error_codes(&run),
        BTreeSet::from(["empty-tensor".to_owned()])
    );
    assert!(messages(&run).contains("rank0_only"));
}

#[test]
fn several_problems_at_once() {
    check_case(
        "several.pt",
        &["wrapper-prefix", "flattened-shape", "empty-tensor"],
        "FSDP1 wrapping",
    );
}

#[test]
fn another_model_configuration() {
    check_case(
        "other_config.pt",
        &["missing-key", "unexpected-key", "shape-mismatch"],
        "another configuration",
    );
    let run = against_reference("other_config.pt");
    assert_eq!(
        keys_of(&run, "missing-key"),
        BTreeSet::from(["norm.bias".to_owned(), "norm.weight".to_owned()])
    );
    // With a description (parameters only), the same extra keys could be buffers: warnings.
    let run = doctor(&["other_config.pt"], &["--model", "model.json"]);
    let unexpected: Vec<&Value> = findings(&run)
        .into_iter()
        .filter(|f| f["code"] == "unexpected-key")
        .collect();
    assert!(unexpected.iter().all(|f| f["severity"] == "warning"));
    assert!(!unexpected.is_empty());
}

#[test]
fn optimizer_of_another_model() {
    let torch = torch_says("optim_bad.pt");
    assert!(torch.contains("doesn't match the size"), "{torch}");
    let run = against_reference("optim_bad.pt");
    assert_eq!(run.code, 1, "{:#}", run.report);
    assert_eq!(
        error_codes(&run),
        BTreeSet::from(["optimizer-mismatch".to_owned()])
    );
    assert!(
        messages(&run).contains("10 parameter ids"),
        "{}",
        messages(&run)
    );
}

#[test]
fn pickle_naming_os_system() {
    let torch = torch_says("unsafe.pt");
    let run = against_reference("unsafe.pt");
    assert_eq!(run.code, 1);
    assert_eq!(
        error_codes(&run),
        BTreeSet::from(["unsafe-pickle".to_owned()])
    );
    // The global doctor names is the one torch's weights_only unpickler refused.
    assert!(torch.contains("posix.system"), "{torch}");
    assert!(messages(&run).contains("`posix.system`"));
    // torch's own records are not flagged: ShardedTensor (LOCAL) and DTensor files.
    for ckpt in ["local", "fsdp2_ranks", "optim_ok.pt"] {
        let run = doctor(&[ckpt], &[]);
        assert!(!error_codes(&run).contains("unsafe-pickle"), "{ckpt}");
    }
}

#[test]
fn damaged_and_missing_files() {
    let torch = torch_says("truncated.pt");
    assert!(torch.contains("central directory"), "{torch}");
    let run = against_reference("truncated.pt");
    assert_eq!(
        run.code, 1,
        "partly readable input is exit 1: {}",
        run.stderr
    );
    assert_eq!(error_codes(&run), BTreeSet::from(["coverage".to_owned()]));
    let run = against_reference("dcp_missing");
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(error_codes(&run), BTreeSet::from(["coverage".to_owned()]));
    assert!(messages(&run).contains("__1_0.distcp"));
    // One rank's DTensor file without the other.
    let run = doctor(&["fsdp2_ranks/rank0.pt"], &[]);
    assert_eq!(run.code, 1);
    assert!(error_codes(&run).contains("coverage"));
    assert!(
        keys_of(&run, "coverage").contains("rank 1"),
        "{:#}",
        run.report
    );
    // Nothing readable: a Git LFS pointer.
    let run = doctor(&["lfs_pointer.pt"], &[]);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("git lfs pull"), "{}", run.stderr);
}

/// FSDP2 + tensor-parallel per-rank files (`tp_ranks/`, see `gen_tp_ranks.py`: torch loads them
/// back) hold `_StridedShard` placements that shardscope does not place. doctor says the files are
/// intact and were not checked (a warning, `unsupported`), not that they are cut short or damaged.
#[test]
fn intact_files_in_an_unread_layout_are_not_called_damaged() {
    let run = doctor(&["tp_ranks"], &[]);
    assert_ne!(run.code, 2, "{}", run.stderr);
    assert!(
        error_codes(&run).is_empty(),
        "no error for intact files: {:#}",
        run.report
    );
    let keys = keys_of(&run, "unsupported");
    assert_eq!(keys.len(), 4, "{:#}", run.report);
    let text = messages(&run);
    assert!(
        text.contains("_StridedShard") || text.contains("StridedShard"),
        "{text}"
    );
    assert!(!text.contains("damaged"), "{text}");
}

#[test]
fn per_rank_files_for_another_world_size() {
    let run = doctor(&["fsdp2_ranks"], &["--world-size", "4"]);
    assert_eq!(run.code, 1);
    assert_eq!(error_codes(&run), BTreeSet::from(["world-size".to_owned()]));
    let run = doctor(&["fsdp2_ranks"], &["--world-size", "2"]);
    assert_eq!(run.code, 0, "{:#}", run.report);
    let run = doctor(&["local"], &["--world-size", "3", "--model", "model.json"]);
    let ws: Vec<&Value> = findings(&run)
        .into_iter()
        .filter(|f| f["code"] == "world-size")
        .collect();
    assert_eq!(ws.len(), 1, "{:#}", run.report);
    assert!(ws[0]["fix"].as_str().unwrap().contains("reshard"));
    // A DCP reshards on load: no world-size finding.
    let run = doctor(&["dcp"], &["--world-size", "3"]);
    assert_eq!(run.code, 0, "{:#}", run.report);
}

#[test]
fn healthy_controls_have_no_error() {
    for (ckpt, reference) in [
        ("clean.pt", "reference.pt"),
        ("dcp", "reference.pt"),
        ("fsdp2_ranks", "reference.pt"),
        ("optim_ok.pt", "reference.pt"),
        ("bf16.pt", "reference.pt"),
        ("tied_noalias.pt", "tied_reference.pt"),
    ] {
        let run = doctor(&[ckpt], &["--reference", reference]);
        assert_eq!(run.code, 0, "{ckpt}: {:#}\n{}", run.report, run.stderr);
        assert_eq!(run.report["loadable"], true);
        assert_eq!(run.report["version"], 1);
        assert!(error_codes(&run).is_empty());
        // Alone, too.
        let run = doctor(&[ckpt], &[]);
        assert_eq!(run.code, 0, "{ckpt} alone: {:#}", run.report);
    }
    for name in ["clean.pt", "bf16.pt", "optim_ok.pt"] {
        assert_eq!(torch_says(name), "ok", "{name}");
    }
    // torch's strict load wants the alias; doctor follows from_pretrained, which ties it again.
    assert!(torch_says("tied_noalias.pt").contains("head.weight"));
    // dtype differences are warnings (torch casts).
    let run = against_reference("bf16.pt");
    assert!(findings(&run).iter().all(|f| f["code"] == "dtype-mismatch"));
    assert_eq!(keys_of(&run, "dtype-mismatch").len(), 9);
    // A description lists parameters only: the buffer `scale` is a warning, not an error.
    let run = doctor(&["clean.pt"], &["--model", "model.json"]);
    assert_eq!(run.code, 0, "{:#}", run.report);
    assert_eq!(
        keys_of(&run, "unexpected-key"),
        BTreeSet::from(["scale".to_owned()])
    );
}

#[test]
fn text_output_and_exit_codes() {
    let dir = fixtures();
    let out = Command::new(crate::common::shardscope_bin())
        .args(["doctor"])
        .arg(dir.join("compiled.pt"))
        .arg("--reference")
        .arg(dir.join("reference.pt"))
        .output()
        .expect("run doctor");
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("error[wrapper-prefix]"), "{text}");
    assert!(text.contains("fix: shardscope convert"), "{text}");
    assert!(text.contains("not loadable: 1 error(s)"), "{text}");
}

#[test]
fn fixes_work_in_torch() {
    crate::common::run_interop_script("check_doctor.py");
}

#[test]
fn tied_alias_needs_its_partner_tied() {
    // Against TiedNet the missing `head.weight` is the alias of `embed.weight` (shared storage in
    // the reference): fine. Against Net, whose head is its own parameter, it is missing.
    let run = doctor(&["tied_noalias.pt"], &["--reference", "reference.pt"]);
    assert_eq!(run.code, 1, "{:#}", run.report);
    assert_eq!(
        error_codes(&run),
        BTreeSet::from(["missing-key".to_owned()])
    );
    assert_eq!(
        keys_of(&run, "missing-key"),
        BTreeSet::from(["head.weight".to_owned()])
    );
}

#[test]
fn optimizer_ids_edited() {
    // fsdp2_optim/bad_id: torch's per-rank optimizer files with id 7 renamed to 9 everywhere.
    let run = doctor(&["../fsdp2_optim/bad_id"], &[]);
    assert_eq!(run.code, 1, "{:#}", run.report);
    assert_eq!(
        error_codes(&run),
        BTreeSet::from(["optimizer-mismatch".to_owned()])
    );
    assert!(keys_of(&run, "optimizer-mismatch").contains("state.9"));
    // The unedited files of the same run have no finding.
    let run = doctor(&["../fsdp2_optim/ws3"], &[]);
    assert_eq!(run.code, 0, "{:#}", run.report);
}

#[test]
fn alone_without_a_target() {
    // Signatures visible without a model: wrapper names, flat parameters, all-empty state dicts.
    let run = doctor(&["several.pt"], &[]);
    assert!(
        error_codes(&run).contains("wrapper-prefix"),
        "{:#}",
        run.report
    );
    let run = doctor(&["empty_rank1.pt"], &[]);
    assert_eq!(
        error_codes(&run),
        BTreeSet::from(["empty-tensor".to_owned()])
    );
    // A DCP with optimizer state nested under app-state keys is diagnosed part by part.
    let run = doctor(&["../formats/dcp_torch_save"], &[]);
    assert_eq!(run.code, 0, "{:#}", run.report);
}

/// `shardscope doctor DIR --json` / `inspect DIR` on a folder outside the fixtures: exit code,
/// the report (doctor) and stderr.
fn run_on(cmd: &str, dir: &std::path::Path) -> (i32, String, String) {
    let mut c = Command::new(crate::common::shardscope_bin());
    c.arg(cmd).arg(dir);
    if cmd == "doctor" {
        c.arg("--json");
    }
    let out = c.output().expect("run shardscope");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The first finding of a doctor report is `unsafe-pickle`, naming `file` and `global`.
fn assert_unsafe_first(report: &str, file: &str, global: &str) {
    let report: Value = serde_json::from_str(report).expect("doctor JSON");
    assert_eq!(report["loadable"], false, "{report}");
    let first = &report["findings"][0];
    assert_eq!(first["code"], "unsafe-pickle", "{report}");
    let message = first["message"].as_str().expect("a message");
    assert!(message.contains(file), "{message}");
    assert!(message.contains(global), "{message}");
    assert!(message.contains("execute code"), "{message}");
}

/// A `.metadata` that is a pickle calling `posix.system("true")` and nothing else (by hand, as
/// `pickle.dumps` writes it for an object whose `__reduce__` returns `(os.system, ("true",))`):
/// not a DCP checkpoint at all, yet doctor says first why it is dangerous, and inspect says so
/// before its error.
#[test]
fn hostile_metadata_that_does_not_parse() {
    let dir = tempfile::tempdir().unwrap();
    let pickle: &[u8] = b"\x80\x02cposix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.";
    std::fs::write(dir.path().join(".metadata"), pickle).unwrap();
    std::fs::write(dir.path().join("__0_0.distcp"), b"").unwrap();
    let (code, stdout, stderr) = run_on("doctor", dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert_unsafe_first(&stdout, ".metadata", "`posix.system`");
    let (code, _, stderr) = run_on("inspect", dir.path());
    assert_eq!(code, 2, "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("error[unsafe-pickle]: .metadata") && first.contains("posix.system"),
        "{stderr}"
    );
    // A pickle cut short after the call still names it (torch would have run it by then).
    std::fs::write(dir.path().join(".metadata"), &pickle[..pickle.len() - 3]).unwrap();
    let (code, stdout, _) = run_on("doctor", dir.path());
    assert_eq!(code, 1);
    assert_unsafe_first(&stdout, ".metadata", "`posix.system`");
}

/// Checkpoints written by real torch that torch would run code from when loading: a DCP whose
/// bytes item is an object whose `__reduce__` calls `os.system` (`dcp.save` pickles it with
/// `torch.save`; `dcp.load` unpickles it with `weights_only=False`), a DCP whose `.metadata`
/// holds such an object, and a `torch_checkpointing`-style folder whose `metadata.pkl` does. The
/// generator never loads them. The healthy DCP fixtures name nothing outside torch's classes.
#[test]
fn hostile_pickles_torch_would_run() {
    for ckpt in ["dcp", "dcp_missing"] {
        let run = doctor(&[ckpt], &[]);
        assert!(!error_codes(&run).contains("unsafe-pickle"), "{ckpt}");
    }
    for fixture in [
        "formats/dcp_torch_save",
        "formats/dcp_safetensors",
        "app_state/dcp",
        "dtypes/dcp_zstd",
        "dtypes/dcp_rot13",
    ] {
        let (_, stdout, stderr) = run_on("doctor", &shardscope_tests::fixtures_dir().join(fixture));
        assert!(!stdout.contains("unsafe-pickle"), "{fixture}: {stdout}");
        assert!(!stderr.contains("unsafe-pickle"), "{fixture}: {stderr}");
    }
    let Some(python) = crate::common::python() else {
        eprintln!("skipped: no python with torch");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import os, sys, pickle, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
out = sys.argv[1]
class Evil:
    def __reduce__(self):
        return (os.system, ("true",))
dcp.save({"w": torch.arange(6.0).reshape(2, 3), "evil": Evil()}, checkpoint_id=f"{out}/bytes_item", no_dist=True)
dcp.save({"w": torch.arange(6.0)}, checkpoint_id=f"{out}/metadata", no_dist=True)
with open(f"{out}/metadata/.metadata", "rb") as f:
    meta = pickle.load(f)  # the file just written: torch's own classes only
meta.planner_data = {"w": Evil()}
with open(f"{out}/metadata/.metadata", "wb") as f:
    pickle.dump(meta, f)
os.makedirs(f"{out}/tc")
torch.save({"w": torch.zeros(2)}, f"{out}/tc/item_0.pt")
with open(f"{out}/tc/metadata.pkl", "wb") as f:
    pickle.dump({"items": ["item_0.pt"], "hook": Evil()}, f)
"#;
    let status = Command::new(python)
        .args(["-c", script])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    for (sub, file) in [
        ("bytes_item", "__0_0.distcp (item `evil`"),
        ("metadata", ".metadata"),
        ("tc", "metadata.pkl"),
    ] {
        let (code, stdout, stderr) = run_on("doctor", &dir.path().join(sub));
        assert_eq!(code, 1, "{sub}: {stdout}\n{stderr}");
        assert_unsafe_first(&stdout, file, "`posix.system`");
        let (code, _, stderr) = run_on("inspect", &dir.path().join(sub));
        assert_eq!(code, 2, "{sub}: {stderr}");
        assert!(
            stderr.contains("error[unsafe-pickle]") && stderr.contains(file),
            "{sub}: {stderr}"
        );
    }
}

/// Tensors saved as views of larger storages: a warning naming them, with the unused bytes torch
/// itself gives (`untyped_storage().nbytes() - numel() * element_size()`, recorded by
/// gen_bloated.py), and a fix; after the fix (`convert`) the file holds only its tensors' bytes and
/// doctor says nothing. A checkpoint without views gets no such finding.
#[test]
fn views_of_larger_storages_are_found_with_torchs_byte_count() {
    let expected: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("bloated.expected.json")).unwrap())
            .unwrap();
    let mut wasted = 0u64;
    let mut views = BTreeSet::new();
    let mut own = 0u64;
    for (k, t) in expected["tensors"].as_object().unwrap() {
        let lost = t["storage_bytes"].as_u64().unwrap() - t["own_bytes"].as_u64().unwrap();
        own += t["own_bytes"].as_u64().unwrap();
        if lost > 0 {
            views.insert(k.clone());
            wasted += lost;
        }
    }
    let run = doctor(&["bloated.pt"], &[]);
    assert_eq!(run.code, 0, "a warning only: {:#}", run.report);
    let f = findings(&run)
        .into_iter()
        .find(|f| f["code"] == "bloated-storage")
        .unwrap_or_else(|| panic!("{:#}", run.report));
    assert_eq!(f["severity"], "warning");
    assert_eq!(keys_of(&run, "bloated-storage"), views);
    let message = f["message"].as_str().unwrap();
    assert!(message.contains(&format!("{wasted} bytes")), "{message}");
    assert!(f["fix"].as_str().unwrap().contains("shardscope convert"));

    let tmp = std::env::temp_dir().join(format!("shardscope-bloated-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let compact = tmp.join("compact.pt");
    let out = Command::new(crate::common::shardscope_bin())
        .args([
            "convert",
            fixtures().join("bloated.pt").to_str().unwrap(),
            "-o",
            compact.to_str().unwrap(),
            "-q",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let size = std::fs::metadata(&compact).unwrap().len();
    assert!(
        size < own + (64 << 10),
        "{size} bytes for {own} bytes of tensors"
    );
    let run = doctor(&[compact.to_str().unwrap()], &[]);
    assert!(
        keys_of(&run, "bloated-storage").is_empty(),
        "{:#}",
        run.report
    );
    std::fs::remove_dir_all(&tmp).ok();

    let run = doctor(&["clean.pt"], &[]);
    assert!(
        keys_of(&run, "bloated-storage").is_empty(),
        "{:#}",
        run.report
    );
}
