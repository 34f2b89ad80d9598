//! `shardscope reshard --to-api fsdp2`: FSDP2 per-rank files (DTensors on a 1-D or HSDP mesh) for
//! any world size, from FSDP2 per-rank folders (tests/fixtures/fsdp2_optim, fsdp2_hsdp: written by
//! torch 2.15) or full checkpoints.
//!
//! Without torch: what we write reads back (through our own FSDP2 reader and `convert`) as
//! exactly torch's full state dicts of the source (`expected/*.pt`, saved by torch), the output is
//! the same bytes on every run, and wrong flags are clear errors that leave nothing behind. With
//! torch: tests/interop/check_reshard_fsdp2.py loads the files into real FSDP2 models at B ranks
//! and trains them against torch's own path.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shardscope_core::bridge::node_from_torch_save;
use shardscope_core::model::tree::Node;

fn fixtures() -> PathBuf {
    shardscope_tests::fixtures_dir()
}

fn model_json() -> PathBuf {
    fixtures().join("fsdp2_optim").join("model.json")
}

fn run(cmd: &str, args: &[&std::ffi::OsStr]) -> Output {
    Command::new(crate::common::shardscope_bin())
        .arg(cmd)
        .args(args)
        .output()
        .unwrap()
}

fn reshard(src: &Path, out: &Path, extra: &[&str]) -> Output {
    let model = model_json();
    let mut args = vec![
        src.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--model".as_ref(),
        model.as_os_str(),
    ];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    run("reshard", &args)
}

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn read(path: &Path) -> Node {
    node_from_torch_save(&std::fs::read(path).unwrap(), &path.display().to_string()).unwrap()
}

/// Our per-rank files, converted back to a full `{"model", "optim"}` file, must be torch's full
/// state dicts of the source.
fn round_trips(src: &Path, expected: &Path, extra: &[&str], files: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ranks");
    ok(&reshard(src, &out, extra), "reshard");
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), files, "{names:?}");
    let full = tmp.path().join("full.pt");
    let o = run(
        "convert",
        &[
            out.as_os_str(),
            "-o".as_ref(),
            full.as_os_str(),
            "--model".as_ref(),
            model_json().as_os_str(),
        ],
    );
    ok(&o, "convert of our FSDP2 files");
    assert_eq!(
        read(&full),
        read(expected),
        "{} {extra:?}: our per-rank files do not hold torch's full state",
        src.display()
    );
    // The same bytes on a second run.
    let again = tmp.path().join("again");
    ok(&reshard(src, &again, extra), "reshard");
    for name in &names {
        assert_eq!(
            std::fs::read(out.join(name)).unwrap(),
            std::fs::read(again.join(name)).unwrap(),
            "{name} differs between two runs"
        );
    }
}

#[test]
fn fsdp2_files_for_other_world_sizes_and_meshes_hold_torch_state() {
    let ws2 = fixtures().join("fsdp2_optim").join("ws2");
    let ws2_full = fixtures()
        .join("fsdp2_optim")
        .join("expected")
        .join("ws2_full.pt");
    let hsdp = fixtures().join("fsdp2_hsdp").join("ws4_2x2");
    let hsdp_full = fixtures()
        .join("fsdp2_hsdp")
        .join("expected")
        .join("ws4_2x2_full.pt");
    // 1-D meshes with uneven and empty shards (dim 0 of 1, 2 and 5 rows over 3 and 7 ranks).
    round_trips(&ws2, &ws2_full, &["--to-world-size", "3"], 6);
    round_trips(&ws2, &ws2_full, &["--to-world-size", "7"], 14);
    // HSDP: every replica's ranks get files.
    round_trips(
        &ws2,
        &ws2_full,
        &["--to-world-size", "6", "--to-shard-group-size", "3"],
        12,
    );
    // From an HSDP folder, and from a full {"model", "optim"} file.
    round_trips(&hsdp, &hsdp_full, &["--to-world-size", "2"], 4);
    round_trips(
        &ws2_full,
        &ws2_full,
        &["--to-world-size", "3", "--to-api", "fsdp2"],
        6,
    );
}

#[test]
fn wrong_flags_are_clear_errors_and_leave_nothing() {
    let ws2 = fixtures().join("fsdp2_optim").join("ws2");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cases: &[(&[&str], &str)] = &[
        (
            &["--to-world-size", "3", "--to-shard-group-size", "2"],
            "does not divide",
        ),
        (
            &[
                "--to-world-size",
                "4",
                "--to-shard-group-size",
                "2",
                "--to-mesh-dim-names",
                "dp",
            ],
            "1 mesh dimension name",
        ),
        (
            &["--to-world-size", "2", "--use-orig-params"],
            "FSDP2 (DTensor)",
        ),
        (
            &[
                "--to-world-size",
                "2",
                "--to-api",
                "fsdp1",
                "--to-mesh-dim-names",
                "dp",
            ],
            "applies to FSDP2 output",
        ),
        (
            &["--to-world-size", "2", "--to-strategy", "no_shard"],
            "describes FSDP1 output",
        ),
    ];
    for (extra, want) in cases {
        let o = reshard(&ws2, &out, extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!out.exists(), "{extra:?} left {}", out.display());
    }
}

#[test]
fn fsdp2_output_loads_into_fsdp2_models_at_new_world_sizes() {
    crate::common::run_interop_script("check_reshard_fsdp2.py");
}
