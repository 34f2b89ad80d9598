//! Per-rank files under any names: torch-written folders (tests/fixtures/trainer_folders,
//! tests/fixtures/fsdp2_optim, torch 2.15) copied under other names must read exactly as under
//! their own names, whose results other tests prove equal to torch's full state dicts. Here the
//! reference is torch's file itself (`expected/...`, saved by torch), compared with `diff`.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A new file name from (role, rank).
type Rename = fn(&str, &str) -> String;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn shardscope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .unwrap()
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

fn ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{stdout}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Copies the per-rank files of `src` into `dst`, renamed: `rename(file name) -> new name`.
fn copy_renamed(src: &Path, dst: &Path, rename: impl Fn(&str) -> String) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        std::fs::copy(src.join(&name), dst.join(rename(&name))).unwrap();
    }
}

fn assert_same(ours: &Path, torch: &Path, extra: &[&str], what: &str) {
    let mut args = vec!["diff".to_owned(), s(ours), s(torch), "-q".to_owned()];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let text = ok(&shardscope(&args), what);
    assert!(
        text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
        "{what}: {text}"
    );
}

/// verl's FSDP1 folder (`{model,optim,extra_state}_world_size_2_rank_{r}.pt`) as
/// `ckpt_{r}_{model,optim,extra}.pt` (the README's example) and as `{model,optim,extra}_{r}.pt`:
/// read through the layout it is torch's FULL_STATE_DICT and `FSDP.optim_state_dict`, found by
/// name alone and with `--model-files`/`--optim-files`.
#[test]
fn fsdp1_folder_under_other_names() {
    let t = fixtures().join("trainer_folders");
    let model = s(&t.join("verl_fsdp1_model.json"));
    let tmp = tempfile::tempdir().unwrap();
    let role = |name: &str| {
        name.split("_world_size")
            .next()
            .unwrap()
            .replace("extra_state", "extra")
    };
    let rank = |name: &str| {
        name.trim_end_matches(".pt")
            .rsplit('_')
            .next()
            .unwrap()
            .to_owned()
    };
    let readme = tmp.path().join("readme");
    copy_renamed(&t.join("verl_fsdp1"), &readme, |n| {
        format!("ckpt_{}_{}.pt", rank(n), role(n))
    });
    let numbered = tmp.path().join("numbered");
    copy_renamed(&t.join("verl_fsdp1"), &numbered, |n| {
        format!("{}-{}.pt", role(n), rank(n))
    });
    for folder in [&readme, &numbered] {
        for (side, torch) in [
            ("model", "verl_fsdp1_model.pt"),
            ("optim", "verl_fsdp1_optim.pt"),
        ] {
            assert_same(
                folder,
                &t.join("expected").join(torch),
                &["--select", side, "--model", &model],
                &format!("diff {} --select {side}", folder.display()),
            );
        }
    }
    // The two-file output with the sets named explicitly.
    let out = tmp.path().join("full.pt");
    ok(
        &shardscope(&[
            "convert",
            &s(&readme),
            "-o",
            &s(&out),
            "--model",
            &model,
            "--model-files",
            "ckpt_{r}_model.pt",
            "--optim-files",
            "ckpt_{r}_optim.pt",
            "-q",
        ]),
        "convert --model-files",
    );
    assert_same(&out, &t.join("expected/verl_fsdp1_model.pt"), &[], "model");
    assert_same(
        &tmp.path().join("full.optim.pt"),
        &t.join("expected/verl_fsdp1_optim.pt"),
        &[],
        "optimizer",
    );
}

/// FSDP2 per-rank files (`rank{r}_model.pt` + `rank{r}_optim.pt`) under names whose other numbers
/// are constant (`_of_2`, `_ws2`) or absent: `convert` gives torch's `get_model_state_dict` /
/// `get_optimizer_state_dict(full_state_dict=True)` (FQN-keyed, not integer ids).
#[test]
fn fsdp2_folder_under_other_names() {
    let f = fixtures().join("fsdp2_optim");
    let torch = f.join("expected/ws2_full.pt");
    let tmp = tempfile::tempdir().unwrap();
    let renames: [(&str, Rename); 3] = [
        ("num", |role, r| format!("{role}_{r}.pt")),
        ("of", |role, r| format!("{role}_rank{r}_of_2.pt")),
        ("ws", |role, r| format!("{role}{r}_ws2.pt")),
    ];
    for (tag, rename) in renames {
        let folder = tmp.path().join(tag);
        copy_renamed(&f.join("ws2"), &folder, |n| {
            let (r, role) = n.trim_start_matches("rank").split_once('_').unwrap();
            rename(role.trim_end_matches(".pt"), r)
        });
        let out = tmp.path().join(format!("{tag}.pt"));
        ok(
            &shardscope(&["convert", &s(&folder), "-o", &s(&out), "-q"]),
            &format!("convert {tag}"),
        );
        assert_same(&out, &torch, &[], tag);
        ok(
            &shardscope(&["verify", &s(&folder)]),
            &format!("verify {tag}"),
        );
    }
}

/// A pattern with digits after `{r}` matches, and a pattern that matches nothing says which sets
/// the folder has.
#[test]
fn explicit_patterns_with_digits_after_the_rank() {
    let t = fixtures().join("trainer_folders");
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("f");
    copy_renamed(&t.join("verl_fsdp1"), &folder, |n| {
        let r = n
            .trim_end_matches(".pt")
            .rsplit('_')
            .next()
            .unwrap()
            .to_owned();
        let role = n.split("_world_size").next().unwrap().replace("_state", "");
        format!("{role}{r}_ws2.pt")
    });
    let model = s(&t.join("verl_fsdp1_model.json"));
    let out = tmp.path().join("full.pt");
    let convert = |pattern: &str| {
        shardscope(&[
            "convert",
            &s(&folder),
            "-o",
            &s(&out),
            "--model",
            &model,
            "--model-files",
            pattern,
            "--optim-files",
            "optim{r}_ws2.pt",
            "-q",
        ])
    };
    let o = convert("model{r}_ws3.pt");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("no file matches `model{r}_ws3.pt`") && stderr.contains("model{r}_ws2.pt"),
        "{stderr}"
    );
    assert!(!out.exists());
    // inspect, verify and diff read the named sets too.
    let patterns = [
        "--model-files",
        "model{r}_ws2.pt",
        "--optim-files",
        "optim{r}_ws2.pt",
    ];
    let with = |args: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(patterns);
        shardscope(&all)
    };
    let text = ok(&with(&["inspect", &s(&folder)]), "inspect --model-files");
    assert!(
        !text.contains("extra"),
        "only the named sets are read: {text}"
    );
    ok(
        &with(&["verify", &s(&folder), "--model", &model]),
        "verify --model-files",
    );
    for (side, torch) in [
        ("model", "verl_fsdp1_model.pt"),
        ("optim", "verl_fsdp1_optim.pt"),
    ] {
        let torch = s(&t.join("expected").join(torch));
        let text = ok(
            &with(&[
                "diff",
                &s(&folder),
                &torch,
                "--select",
                side,
                "--model",
                &model,
                "-q",
            ]),
            "diff --model-files",
        );
        assert!(
            text.contains(" 0 mismatch, 0 missing, 0 unexpected, 0 error"),
            "{side}: {text}"
        );
    }
    ok(&convert("model{r}_ws2.pt"), "convert model{r}_ws2.pt");
    assert_same(&out, &t.join("expected/verl_fsdp1_model.pt"), &[], "model");
    assert_same(
        &tmp.path().join("full.optim.pt"),
        &t.join("expected/verl_fsdp1_optim.pt"),
        &[],
        "optimizer",
    );
}

/// FSDP2 per-rank files next to a second set of model files: found by name the folder is
/// ambiguous (a clear error naming `--model-files`, nothing written); with the sets named,
/// `convert` needs no `--model` and gives torch's full state dicts.
#[test]
fn fsdp2_sets_named_without_a_model_description() {
    let f = fixtures().join("fsdp2_optim");
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("f");
    copy_renamed(&f.join("ws2"), &folder, |n| {
        let (r, role) = n.trim_start_matches("rank").split_once('_').unwrap();
        format!("{}{r}_ws2.pt", role.trim_end_matches(".pt"))
    });
    for r in 0..2 {
        std::fs::copy(
            folder.join(format!("model{r}_ws2.pt")),
            folder.join(format!("backup{r}_ws2.pt")),
        )
        .unwrap();
    }
    let out = tmp.path().join("full.pt");
    let o = shardscope(&["convert", &s(&folder), "-o", &s(&out), "-q"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--model-files"), "{stderr}");
    assert!(!out.exists());
    ok(
        &shardscope(&[
            "convert",
            &s(&folder),
            "-o",
            &s(&out),
            "--model-files",
            "model{r}_ws2.pt",
            "--optim-files",
            "optim{r}_ws2.pt",
            "-q",
        ]),
        "convert --model-files",
    );
    assert_same(
        &out,
        &f.join("expected/ws2_full.pt"),
        &[],
        "fsdp2 named sets",
    );
}
