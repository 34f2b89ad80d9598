//! Local files under faults: two conversions racing for one output, an input truncated while a
//! conversion or `hash` reads it, temporary names planted in advance, `-o` onto symbolic links, and a
//! Hugging Face cache snapshot (every file a link into `../../blobs/`).
//!
//! Races and truncation are made deterministic with the binary's test pause
//! (`SHARDSCOPE_TEST_PAUSE_BEFORE_DATA`, see `file_source.rs`): each process stops before its first
//! tensor data read, after it has checked its output path and created its temporary output; the
//! test changes what it wants, then lets it go on. No assertion depends on timing.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use shardscope_core::DType;
use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};

const PAUSE_ENV: &str = "SHARDSCOPE_TEST_PAUSE_BEFORE_DATA";

/// A float32 safetensors file of `tensors` tensors of `[rows, 256]`, each with distinct values.
fn write_input(path: &Path, tensors: usize, rows: u64) {
    let cols = 256u64;
    let specs: Vec<TensorSpec> = (0..tensors)
        .map(|i| TensorSpec {
            name: format!("layers.{i:02}.weight"),
            dtype: DType::Float32,
            shape: vec![rows, cols],
        })
        .collect();
    let mut out = BufWriter::new(File::create(path).unwrap());
    let mut writer = SafetensorsWriter::new(&mut out, &specs, None).unwrap();
    let order: Vec<String> = writer.data_order().map(str::to_owned).collect();
    for (k, name) in order.iter().enumerate() {
        let data: Vec<u8> = (0..rows * cols)
            .flat_map(|i| ((i as f32) * 0.25 + k as f32).to_le_bytes())
            .collect();
        writer.write_tensor(name, &data).unwrap();
    }
    writer.finish().unwrap();
}

fn convert(args: &[&Path], extra: &[&str], pause: Option<&Path>) -> Command {
    command("convert", args, extra, pause)
}

fn command(sub: &str, args: &[&Path], extra: &[&str], pause: Option<&Path>) -> Command {
    let mut cmd = Command::new(crate::common::shardscope_bin());
    cmd.arg(sub).args(args).args(extra).arg("--quiet");
    cmd.env_remove(PAUSE_ENV);
    if let Some(p) = pause {
        std::fs::create_dir_all(p).unwrap();
        cmd.env(PAUSE_ENV, p);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn run(args: &[&Path], extra: &[&str]) -> Output {
    convert(args, extra, None).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Waits until the process paused by `PAUSE_ENV` in `folder` says so (or has exited: then the
/// test fails with what it printed).
fn wait_paused(child: &mut Child, folder: &Path) {
    let deadline = Instant::now() + Duration::from_mins(5);
    while !folder.join("paused").exists() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("exited ({status}) before pausing: {err}");
        }
        assert!(Instant::now() < deadline, "never paused");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn resume(folder: &Path) {
    std::fs::write(folder.join("resume"), b"").unwrap();
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn temporaries_in(dir: &Path) -> Vec<String> {
    names_in(dir)
        .into_iter()
        .filter(|n| n.contains(".shardscope-tmp-"))
        .collect()
}

/// Two conversions to one `-o`, one with `--dtype bf16`: exactly one writes it, the other exits 2
/// naming it, and the file is the winner's output. Paused after both created their temporary
/// outputs (so both passed the "already exists" check), then again started together.
#[test]
fn racing_writers_one_wins_and_the_other_exits_2_naming_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_input(&input, 8, 256);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // What each writes alone.
    let refs = [
        dir.path().join("ref32.safetensors"),
        dir.path().join("ref16.safetensors"),
    ];
    assert!(
        run(&[&input, Path::new("-o"), &refs[0]], &[])
            .status
            .success()
    );
    assert!(
        run(&[&input, Path::new("-o"), &refs[1]], &["--dtype", "bf16"])
            .status
            .success()
    );
    let refs = refs.map(|p| std::fs::read(p).unwrap());
    assert_ne!(refs[0], refs[1]);
    let dtypes: [&[&str]; 2] = [&[], &["--dtype", "bf16"]];
    for round in 0..6 {
        let dest = out.join(format!("model{round}.safetensors"));
        let paused = round < 3;
        let pauses = [0, 1].map(|i| dir.path().join(format!("pause{round}-{i}")));
        let mut children: Vec<Child> = (0..2)
            .map(|i| {
                convert(
                    &[&input, Path::new("-o"), &dest],
                    dtypes[i],
                    paused.then_some(pauses[i].as_path()),
                )
                .spawn()
                .unwrap()
            })
            .collect();
        if paused {
            for (child, pause) in children.iter_mut().zip(&pauses) {
                wait_paused(child, pause);
            }
            for pause in &pauses {
                resume(pause);
            }
        }
        let outputs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let codes: Vec<Option<i32>> = outputs.iter().map(|o| o.status.code()).collect();
        let winner = match codes.as_slice() {
            [Some(0), Some(2)] => 0,
            [Some(2), Some(0)] => 1,
            _ => panic!(
                "round {round}: exit codes {codes:?}: {} / {}",
                stderr(&outputs[0]),
                stderr(&outputs[1])
            ),
        };
        let err = stderr(&outputs[1 - winner]);
        assert!(err.contains(&dest.display().to_string()), "{err}");
        if paused {
            assert!(
                err.contains("appeared while this run was writing it; not replaced"),
                "{err}"
            );
        }
        assert!(
            std::fs::read(&dest).unwrap() == refs[winner],
            "round {round}: the file is not the winner's output"
        );
        assert_eq!(temporaries_in(&out), Vec::<String>::new(), "round {round}");
    }
}

/// `in.safetensors` (`tensors` tensors of `[rows, 256]`) in `dir`, and the DCP `convert` writes of
/// it for 2 ranks (`dcp/`).
fn input_and_dcp(dir: &Path, tensors: usize, rows: u64) -> (PathBuf, PathBuf) {
    let input = dir.join("in.safetensors");
    write_input(&input, tensors, rows);
    let dcp = dir.join("dcp");
    assert!(
        run(&[&input, Path::new("-o"), &dcp], &["--world-size", "2"])
            .status
            .success()
    );
    (input, dcp)
}

/// Runs `cmd` (paused before its first data read in `pause`), cuts `victim` to half its size while
/// it is paused, lets it go on, and checks that it exits 2 (never a signal) naming `victim` as
/// changed, with both sizes. Returns its stderr.
fn cut_short_while_read(mut cmd: Command, pause: &Path, victim: &Path, case: &str) -> String {
    let size = std::fs::metadata(victim).unwrap().len();
    let mut child = cmd.spawn().unwrap();
    wait_paused(&mut child, pause);
    File::options()
        .write(true)
        .open(victim)
        .unwrap()
        .set_len(size / 2)
        .unwrap();
    resume(pause);
    let output = child.wait_with_output().unwrap();
    let err = stderr(&output);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{case}: {:?}: {err}",
        output.status
    );
    assert!(
        err.contains(&victim.display().to_string())
            && err.contains("changed while it was read")
            && err.contains(&format!("it was {size} bytes, now {} bytes", size / 2)),
        "{case}: {err}"
    );
    err
}

/// An input truncated while a conversion reads it: exit 2 (never a signal) with an error naming
/// the file and both sizes, and nothing left at the destination, temporaries included. For one
/// safetensors file and for a DCP folder.
#[test]
fn an_input_truncated_during_a_conversion_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (input, dcp) = input_and_dcp(dir.path(), 8, 1024);
    let shard = dcp.join("__0_0.distcp");
    assert!(shard.is_file(), "{:?}", names_in(&dcp));
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    for (i, (src, victim)) in [(&input, &input), (&dcp, &shard)].into_iter().enumerate() {
        let dest = out.join(format!("x{i}.safetensors"));
        let pause = dir.path().join(format!("pause{i}"));
        let cmd = convert(&[src, Path::new("-o"), &dest], &[], Some(&pause));
        cut_short_while_read(cmd, &pause, victim, &src.display().to_string());
        assert!(!dest.exists());
        assert_eq!(names_in(&out), Vec::<String>::new());
    }
}

/// An input truncated while `hash` reads it: exit 2 (never a signal) with an error naming the file
/// and both sizes, and no manifest written. The pieces past the new end fail wherever they are
/// read: by the thread feeding a segment's digests, or copied ahead into a slot by another thread
/// (a file holding one large tensor, 2 and 4 threads). One safetensors file and a DCP folder (whose
/// first data read is made while it is opened), with and without file digests.
#[test]
fn an_input_truncated_during_a_hash_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    // 2 tensors of 8 MiB: 32 pieces of 256 KiB each.
    let (input, dcp) = input_and_dcp(dir.path(), 2, 8192);
    let shard = dcp.join("__1_0.distcp");
    let mut n = 0;
    for (src, victim) in [(&input, &input), (&dcp, &shard)] {
        let whole = std::fs::read(victim).unwrap();
        for threads in ["1", "2", "4"] {
            for files in [None, Some("--no-files")] {
                n += 1;
                std::fs::write(victim, &whole).unwrap();
                let manifest = dir.path().join(format!("m{n}.json"));
                let pause = dir.path().join(format!("hash-pause{n}"));
                let mut extra = vec!["--threads", threads];
                extra.extend(files);
                let cmd = command(
                    "hash",
                    &[src, Path::new("-o"), &manifest],
                    &extra,
                    Some(&pause),
                );
                let case = format!("{} --threads {threads} {files:?}", src.display());
                let err = cut_short_while_read(cmd, &pause, victim, &case);
                assert!(
                    src != &input || err.contains("no manifest written"),
                    "{case}: {err}"
                );
                assert!(!manifest.exists(), "{case}");
            }
        }
    }
}

/// Temporary names are not predictable: leftovers planted for the process ids that come next (as
/// files and folders, in the earlier `-{pid}-{counter}` form and with random parts) do not make a
/// conversion fail. Leftovers of processes that no longer run are still swept; ours are kept.
#[test]
fn planted_temporary_names_do_not_make_a_conversion_fail() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_input(&input, 2, 64);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let me = std::process::id();
    for round in 0..3 {
        let name = format!("m{round}.safetensors");
        for pid in me + 1..me + 300 {
            for suffix in ["0", "1", "aZ09"] {
                std::fs::write(
                    out.join(format!(".{name}.shardscope-tmp-{pid}-{suffix}")),
                    b"x",
                )
                .unwrap();
            }
            std::fs::create_dir_all(out.join(format!(".{name}.shardscope-tmp-{pid}-2"))).unwrap();
        }
        let live = format!(".{name}.shardscope-tmp-{me}-Live123");
        std::fs::write(out.join(&live), b"ours").unwrap();
        let dest = out.join(&name);
        let output = run(&[&input, Path::new("-o"), &dest], &[]);
        assert!(output.status.success(), "{}", stderr(&output));
        assert!(dest.is_file());
        // What is left: the outputs, and the leftovers of processes still running (ours, and any
        // planted pid that happens to run now).
        let left = temporaries_in(&out);
        assert!(left.contains(&live), "{left:?}");
        assert!(
            left.len() < 4 * 299 + 1,
            "nothing was swept: {}",
            left.len()
        );
    }
}

/// `-o` naming a symbolic link (dangling, to a file, to a folder) is refused, for a file and a
/// folder output; the link, what it points to and the folder are left as they were.
#[test]
fn output_onto_a_symbolic_link_is_refused() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_input(&input, 2, 64);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let target_file = dir.path().join("target.safetensors");
    std::fs::write(&target_file, b"keep me").unwrap();
    let target_dir = dir.path().join("target_dir");
    std::fs::create_dir(&target_dir).unwrap();
    let cases = [
        ("dangling", dir.path().join("missing.safetensors")),
        ("to_file", target_file.clone()),
        ("to_dir", target_dir.clone()),
    ];
    let mut links = Vec::new();
    for (name, target) in &cases {
        // A file output (named by its extension) and a folder output (a DCP).
        for (link, extra) in [
            (format!("{name}.safetensors"), &[][..]),
            (
                format!("{name}_dcp"),
                &["--to", "dcp", "--world-size", "2"][..],
            ),
        ] {
            let link = out.join(link);
            symlink(target, &link).unwrap();
            let output = run(&[&input, Path::new("-o"), &link], extra);
            let err = stderr(&output);
            assert_eq!(output.status.code(), Some(2), "{}: {err}", link.display());
            assert!(
                err.contains(&link.display().to_string()) && err.contains("is a symbolic link"),
                "{}: {err}",
                link.display()
            );
            assert_eq!(&std::fs::read_link(&link).unwrap(), target);
            links.push(link.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    assert_eq!(std::fs::read(&target_file).unwrap(), b"keep me");
    assert_eq!(names_in(&target_dir), Vec::<String>::new());
    assert!(!dir.path().join("missing.safetensors").exists());
    links.sort();
    assert_eq!(names_in(&out), links);
}

/// A Hugging Face cache snapshot of the sharded fixture (`snapshots/REV/*` are links into
/// `../../blobs/`) opens by folder and by its `model.safetensors.index.json`, giving the plain
/// folder's values (the converted files are byte-identical); an index naming a file outside its
/// folder is still refused, by folder and by index path.
#[test]
fn a_hugging_face_cache_snapshot_opens_by_folder_and_by_index() {
    use std::os::unix::fs::symlink;
    let plain = shardscope_tests::fixtures_dir().join("formats/hf_sharded");
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("hub/models--tiny--sharded");
    let (blobs, snap) = (repo.join("blobs"), repo.join("snapshots/0123abcd"));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), b"0123abcd").unwrap();
    for (i, name) in names_in(&plain).iter().enumerate() {
        let blob = format!("{i:040x}");
        std::fs::copy(plain.join(name), blobs.join(&blob)).unwrap();
        symlink(format!("../../blobs/{blob}"), snap.join(name)).unwrap();
    }
    let index = "model.safetensors.index.json";
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let reference = out.join("plain.safetensors");
    let output = run(&[&plain, Path::new("-o"), &reference], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let reference = std::fs::read(&reference).unwrap();
    for (i, src) in [snap.clone(), snap.join(index), plain.join(index)]
        .iter()
        .enumerate()
    {
        let dest = out.join(format!("{i}.safetensors"));
        let output = run(&[src, Path::new("-o"), &dest], &[]);
        assert!(
            output.status.success(),
            "{}: {}",
            src.display(),
            stderr(&output)
        );
        assert!(
            std::fs::read(&dest).unwrap() == reference,
            "{}",
            src.display()
        );
    }
    // Names inside metadata stay inside the folder, links or not.
    let escape = dir.path().join("escape");
    std::fs::create_dir(&escape).unwrap();
    let text = std::fs::read_to_string(plain.join(index)).unwrap().replace(
        "\"model-00002-of-00002.safetensors\"",
        "\"../outside.safetensors\"",
    );
    std::fs::write(escape.join(index), text).unwrap();
    std::fs::copy(
        plain.join("model-00001-of-00002.safetensors"),
        escape.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        plain.join("model-00002-of-00002.safetensors"),
        dir.path().join("outside.safetensors"),
    )
    .unwrap();
    for (i, src) in [escape.clone(), escape.join(index)].iter().enumerate() {
        let dest = out.join(format!("escape{i}.safetensors"));
        let output = run(&[src, Path::new("-o"), &dest], &[]);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{}: {err}", src.display());
        assert!(err.contains("outside.safetensors"), "{err}");
        assert!(!dest.exists());
    }
}
