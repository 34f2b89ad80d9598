//! `shardscope convert` with several reader threads and split into parts gives the bytes of a plain
//! run: every output kind (one safetensors file, HF shards, `torch.save`, DCP from a multi-chunk DCP
//! and from a one-chunk `torch.save` input, with and without `--dtype`) at 1 and 4 threads and
//! under a memory limit barely above the largest tensor; `--part R/N` runs in any order and for
//! several N equal one run, file for file; a stray `RANK` does not split a plain run; parts of
//! another plan, a missing part and a too-small limit fail with clear errors and leave no index.
//! torchrun launching the parts is `convert_interop.rs`'s `check_parallel.py`.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::shardscope_bin;

fn example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/fsdp2_dcp")
}

fn convert(src: &Path, dest: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(shardscope_bin());
    cmd.arg("convert").arg(src).arg("-o").arg(dest).args(args);
    cmd.arg("--quiet");
    for var in ["RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn ok(src: &Path, dest: &Path, args: &[&str]) {
    let out = convert(src, dest, args, &[]);
    assert!(
        out.status.success(),
        "convert {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn fails(src: &Path, dest: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = convert(src, dest, args, env);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "convert {args:?}: {stderr}");
    stderr
}

/// Every file (hidden ones too) of a file or directory, by relative name.
fn tree(path: &Path) -> BTreeMap<String, Vec<u8>> {
    if path.is_file() {
        return BTreeMap::from([(String::new(), std::fs::read(path).unwrap())]);
    }
    std::fs::read_dir(path)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn any_thread_count_and_memory_limit_give_the_same_bytes() {
    let work = tempfile::tempdir().unwrap();
    let dcp = example();
    // A one-chunk input: byte ranges of a DCP output are read in place.
    let pt = work.path().join("full.pt");
    ok(&dcp, &pt, &[]);
    let cases: &[(&str, &Path, &str, &[&str])] = &[
        ("one file", &dcp, "m.safetensors", &["--select", "model"]),
        (
            "shards",
            &dcp,
            "shards",
            &["--select", "model", "--max-shard-size", "20KB"],
        ),
        (
            "shards bf16",
            &dcp,
            "shards16",
            &["--max-shard-size", "9KB", "--dtype", "bf16"],
        ),
        ("torch.save", &dcp, "t.pt", &[]),
        ("dcp from dcp", &dcp, "d3", &["--world-size", "3"]),
        (
            "dcp from pt",
            &pt,
            "p3",
            &["--world-size", "3", "--api", "fsdp1"],
        ),
        (
            "dcp fp16",
            &pt,
            "p16",
            &["--world-size", "2", "--dtype", "fp16"],
        ),
    ];
    for (what, src, name, args) in cases {
        let mut outputs = Vec::new();
        // The example's largest tensor is 2 KiB: 2100 bytes lets one read be in flight at a time,
        // 5000 two.
        for run in [
            &["--threads", "1"][..],
            &["--threads", "4"],
            &["--threads", "4", "--memory-limit", "2100"],
            &["--threads", "3", "--memory-limit", "5000"],
        ] {
            // The same file name each time: a torch.save archive is named after it.
            let dir = work.path().join(format!("{what}-{}", outputs.len()));
            std::fs::create_dir(&dir).unwrap();
            let dest = dir.join(name);
            let all: Vec<&str> = args.iter().chain(run).copied().collect();
            ok(src, &dest, &all);
            outputs.push(tree(&dest));
        }
        assert!(!outputs[0].is_empty(), "{what}");
        for (i, o) in outputs.iter().enumerate().skip(1) {
            assert!(o == &outputs[0], "{what}: run {i} differs from --threads 1");
        }
    }
    // A limit below the largest tensor: a clear error, nothing written.
    let dest = work.path().join("small");
    let err = fails(
        &dcp,
        &dest,
        &["--world-size", "2", "--memory-limit", "1000"],
        &[],
    );
    // Each rank's half of the 2 KiB embedding is read in place.
    assert!(
        err.contains("below the largest read") && err.contains("(1024 bytes)"),
        "{err}"
    );
    assert!(!dest.exists());
}

#[test]
fn parts_in_any_order_equal_one_run() {
    let work = tempfile::tempdir().unwrap();
    let src = example();
    let kinds: &[(&str, &[&str])] = &[
        ("shards", &["--select", "model", "--max-shard-size", "3KB"]),
        ("dcp", &["--world-size", "3", "--nest", "model"]),
    ];
    for (kind, args) in kinds {
        let single = work.path().join(format!("{kind}-single"));
        ok(&src, &single, args);
        let want = tree(&single);
        assert!(want.len() >= 3, "{kind}: {:?}", want.keys());
        for (count, order) in [
            (3, vec![2, 0, 1]),
            (2, vec![0, 1]),
            (5, vec![4, 1, 3, 0, 2]),
        ] {
            let dest = work.path().join(format!("{kind}-{count}"));
            for (k, rank) in order.iter().enumerate() {
                let part = format!("{rank}/{count}");
                let all: Vec<&str> = args.iter().copied().chain(["--part", &part]).collect();
                ok(&src, &dest, &all);
                let index = if *kind == "dcp" {
                    ".metadata"
                } else {
                    "model.safetensors.index.json"
                };
                // No index (nothing that looks complete) before the last part.
                assert_eq!(
                    dest.join(index).exists(),
                    k + 1 == order.len(),
                    "{kind} {part}"
                );
            }
            assert!(
                tree(&dest) == want,
                "{kind}: {count} parts differ from one run"
            );
        }
        // `--part auto` reads torchrun's variables.
        let dest = work.path().join(format!("{kind}-auto"));
        for rank in ["1", "0"] {
            let all: Vec<&str> = args.iter().copied().chain(["--part", "auto"]).collect();
            let out = convert(&src, &dest, &all, &[("RANK", rank), ("WORLD_SIZE", "2")]);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(tree(&dest) == want, "{kind}: --part auto");
        // A stray RANK/WORLD_SIZE never splits a plain run.
        let dest = work.path().join(format!("{kind}-stray"));
        let out = convert(&src, &dest, args, &[("RANK", "1"), ("WORLD_SIZE", "2")]);
        assert!(out.status.success());
        assert!(tree(&dest) == want, "{kind}: a plain run under RANK=1");
    }
}

#[test]
fn stale_missing_and_misplaced_parts_fail_clearly() {
    let work = tempfile::tempdir().unwrap();
    let src = example();
    let dest = work.path().join("out");
    ok(&src, &dest, &["--max-shard-size", "9KB", "--part", "0/2"]);
    // Another plan (another shard size) into the same folder.
    let err = fails(
        &src,
        &dest,
        &["--max-shard-size", "12KB", "--part", "1/2"],
        &[],
    );
    assert!(
        err.contains("another conversion") || err.contains("which this conversion does not write"),
        "{err}"
    );
    // Another split.
    let err = fails(
        &src,
        &dest,
        &["--max-shard-size", "9KB", "--part", "1/3"],
        &[],
    );
    assert!(err.contains("split 2 ways"), "{err}");
    // --finalize names the missing part.
    let err = fails(
        &src,
        &dest,
        &["--max-shard-size", "9KB", "--part", "0/2", "--finalize"],
        &[],
    );
    assert!(err.contains("parts [1] of 2"), "{err}");
    assert!(!dest.join("model.safetensors.index.json").exists());
    ok(&src, &dest, &["--max-shard-size", "9KB", "--part", "1/2"]);
    assert!(dest.join("model.safetensors.index.json").exists());
    assert!(
        !tree(&dest).keys().any(|k| k.starts_with('.')),
        "markers left: {:?}",
        tree(&dest).keys()
    );

    let err = fails(
        &src,
        &work.path().join("one.safetensors"),
        &["--part", "0/2"],
        &[],
    );
    assert!(err.contains("--part splits a multi-file output"), "{err}");
    let err = fails(
        &src,
        &work.path().join("x"),
        &["--world-size", "2", "--part", "auto"],
        &[],
    );
    assert!(err.contains("neither RANK/WORLD_SIZE"), "{err}");
    let err = fails(
        &src,
        &work.path().join("x"),
        &["--world-size", "2", "--part", "auto"],
        &[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")],
    );
    assert!(err.contains("SLURM_PROCID=4"), "{err}");
    let out = convert(
        &src,
        &work.path().join("x"),
        &["--world-size", "2", "--part", "2/2"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a part"));
}

/// A 40 MiB tensor is read in 16 MiB pieces (in place, from one chunk and from dim-0 shards), so a
/// 20 MiB memory limit suffices; the output equals the core writer's file for the same tensors,
/// built here in memory, at 1 and 4 threads, and through a DCP for 2 and for 3 ranks.
#[test]
fn large_tensors_stream_in_pieces_under_a_small_limit() {
    use shardscope_core::DType;
    use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};
    let work = tempfile::tempdir().unwrap();
    let (rows, cols) = (1024u64, 10240u64); // 40 MiB of float32
    let specs = vec![
        TensorSpec {
            name: "big".to_owned(),
            dtype: DType::Float32,
            shape: vec![rows, cols],
        },
        TensorSpec {
            name: "small".to_owned(),
            dtype: DType::Int64,
            shape: vec![3],
        },
    ];
    let big: Vec<u8> = (0..rows * cols)
        .flat_map(|i| ((i % 100_003) as f32).to_le_bytes())
        .collect();
    let small: Vec<u8> = [7i64, -1, 42]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let file = |metadata: Option<&BTreeMap<String, String>>| {
        let mut w = SafetensorsWriter::new(Vec::new(), &specs, metadata).unwrap();
        for name in w.data_order().map(str::to_owned).collect::<Vec<_>>() {
            w.write_tensor(&name, if name == "big" { &big } else { &small })
                .unwrap();
        }
        w.finish().unwrap()
    };
    let input = work.path().join("in.safetensors");
    std::fs::write(&input, file(None)).unwrap();
    let want = file(Some(&BTreeMap::from([(
        "format".to_owned(),
        "pt".to_owned(),
    )])));
    let limit = ["--memory-limit", "20MiB"];
    let dcp2 = work.path().join("dcp2");
    ok(&input, &dcp2, &["--world-size", "2", limit[0], limit[1]]);
    let dcp3 = work.path().join("dcp3");
    // 13.3 MiB chunks read from the two 20 MiB shards of dcp2 in place.
    ok(&dcp2, &dcp3, &["--world-size", "3", limit[0], limit[1]]);
    for (i, src) in [&input, &dcp2, &dcp3].into_iter().enumerate() {
        for threads in ["1", "4"] {
            let dir = work.path().join(format!("out-{i}-{threads}"));
            std::fs::create_dir(&dir).unwrap();
            let dest = dir.join("out.safetensors");
            ok(src, &dest, &["--threads", threads, limit[0], limit[1]]);
            assert!(
                std::fs::read(&dest).unwrap() == want,
                "source {i}, {threads} threads"
            );
        }
    }
    // A cast needs the whole tensor at once: the same limit is too small, and says so.
    let err = fails(
        &dcp2,
        &work.path().join("bf16.safetensors"),
        &["--dtype", "bf16", limit[0], limit[1]],
        &[],
    );
    assert!(
        err.contains("below the largest read") && err.contains("`big`"),
        "{err}"
    );
}
