//! A fuzz harness on stable Rust, run by `cargo test` in CI for a bounded time: every reader of
//! `shardscope-core` on the repo's real fixture files, mutated by a seeded, deterministic
//! mutator (bit flips, bytes set to 0/0x7f/0x80/0xff, truncations, length fields bumped, chunks
//! duplicated or removed). No input may panic; errors of the readers that take one named file
//! must name it. The `fuzz/` crate (cargo-fuzz, nightly) explores further; this one keeps every
//! reader honest on every commit. See `fuzz/README.md`.
//!
//! Budget: [`ITERATIONS`] inputs per target and [`TIME_BUDGET`] for all targets together (each
//! target gets its share of what is left), whichever comes first. Seeds are fixed: a run tests
//! the same inputs every time, in the same order; a slow machine only stops earlier. A panic
//! writes its input under `target/tmp/fuzz-readers/` and the test fails naming that file, the
//! target and the seed (set `SHARDSCOPE_FUZZ_ITERATIONS` to run more inputs per target).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_core::formats::{dcp, pickle, torch_zip};
use shardscope_core::index::{self, CheckpointIndex, EntryKind};
use shardscope_core::{MemorySource, Source};
use shardscope_tests::{fixtures_dir, memory_source};

/// Inputs per target (unless `SHARDSCOPE_FUZZ_ITERATIONS` says otherwise).
const ITERATIONS: u64 = 2000;
/// All targets together stop after this long (debug builds on a loaded 2-core CI machine).
const TIME_BUDGET: Duration = Duration::from_mins(1);
/// Fixture files larger than this are left out (each iteration copies its input).
const MAX_FIXTURE_BYTES: u64 = 256 << 10;

/// splitmix64: small, fast, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }
}

/// A position in `0..len`, a third of the time in the last 256 bytes (zip end records and
/// central directories live at the end).
fn position(rng: &mut Rng, len: usize) -> usize {
    if len > 256 && rng.below(3) == 0 {
        len - 1 - rng.below(256)
    } else {
        rng.below(len)
    }
}

/// Applies one to four mutations to `data`.
fn mutate(rng: &mut Rng, data: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        if data.is_empty() {
            data.push(u8::try_from(rng.below(256)).unwrap());
            continue;
        }
        let at = position(rng, data.len());
        match rng.below(7) {
            0 => data[at] ^= 1 << rng.below(8),
            1 => data[at] = [0x00, 0x7f, 0x80, 0xff][rng.below(4)],
            2 => data.truncate(at),
            3 => bump_length(rng, data, at),
            4 => {
                let len = (1 + rng.below(64)).min(data.len() - at);
                let chunk = data[at..at + len].to_vec();
                let to = rng.below(data.len() + 1);
                data.splice(to..to, chunk);
            }
            5 => {
                let len = (1 + rng.below(64)).min(data.len() - at);
                data.drain(at..at + len);
            }
            _ => data[at] = u8::try_from(rng.below(256)).unwrap(),
        }
    }
}

/// Treats the 2, 4 or 8 bytes at `at` as a little-endian length and moves it: by a little, to a
/// power of two, or to the maximum of its width.
fn bump_length(rng: &mut Rng, data: &mut [u8], at: usize) {
    let width = [2usize, 4, 8][rng.below(3)];
    let Some(field) = data.get_mut(at..at + width) else {
        return;
    };
    let mut buf = [0u8; 8];
    buf[..width].copy_from_slice(field);
    let old = u64::from_le_bytes(buf);
    let max = if width == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * width)) - 1
    };
    let new = match rng.below(5) {
        0 => old.wrapping_add(1 + rng.below(16) as u64),
        1 => old.wrapping_sub(1 + rng.below(16) as u64),
        2 => 1u64 << rng.below(8 * width),
        3 => max,
        _ => max / 2 + 1,
    } & max;
    field.copy_from_slice(&new.to_le_bytes()[..width]);
}

/// One input of a target: a file (alone, or in the folder it belongs to) to mutate.
struct Input {
    /// The folder's files, `file` among them (for one-file targets, just `file`).
    folder: MemorySource,
    file: String,
    bytes: Vec<u8>,
}

/// What a target does with one mutated input; an error it returns must name the file when the
/// target is a one-file reader (`Some` in [`Target::names_file`]).
type Read = fn(&MemorySource, &str, &[u8]) -> Result<(), String>;

struct Target {
    name: &'static str,
    inputs: Vec<Input>,
    read: Read,
    names_file: bool,
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// Up to `most` fixture files whose name ends with `suffix`, spread over the sorted list.
fn fixture_files(suffix: &str, most: usize) -> Vec<PathBuf> {
    let mut all = Vec::new();
    walk(&fixtures_dir(), &mut all);
    let picked: Vec<PathBuf> = all
        .into_iter()
        .filter(|p| {
            p.to_string_lossy().ends_with(suffix)
                && std::fs::metadata(p).unwrap().len() <= MAX_FIXTURE_BYTES
        })
        .collect();
    assert!(!picked.is_empty(), "no fixture ends with {suffix}");
    let step = picked.len().div_ceil(most);
    picked.into_iter().step_by(step).collect()
}

/// Single files, each alone in a source under `name`.
fn single_files(suffix: &str, most: usize, name: &str) -> Vec<Input> {
    fixture_files(suffix, most)
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            Input {
                folder: MemorySource::new().with(name, bytes.clone()),
                file: name.to_owned(),
                bytes,
            }
        })
        .collect()
}

/// Every file of each fixture folder, to be mutated in its folder.
fn folder_files(folders: &[&str]) -> Vec<Input> {
    let mut out = Vec::new();
    for folder in folders {
        let dir = fixtures_dir().join(folder);
        let source = memory_source(&dir);
        for file in source.names() {
            let bytes = source.read_all(&file).unwrap().into_owned();
            if bytes.len() as u64 <= MAX_FIXTURE_BYTES {
                out.push(Input {
                    folder: source.clone(),
                    file,
                    bytes,
                });
            }
        }
    }
    assert!(!out.is_empty(), "no files in {folders:?}");
    out
}

/// Indexes, checks and reads every value (as `shardscope inspect --values` would), and runs
/// doctor's scan of the pickles torch would run.
fn exercise_index(src: &dyn Source, idx: &CheckpointIndex) {
    if idx.check().is_empty() {
        for e in &idx.entries {
            match e.kind {
                EntryKind::Tensor if e.shape.is_some() => {
                    let _ = idx.read_tensor(src, e);
                }
                EntryKind::Tensor => {
                    for c in &e.chunks {
                        let _ = idx.read_chunk(src, e, c);
                    }
                }
                EntryKind::Bytes => {
                    let _ = idx.read_bytes_value(src, e);
                }
                EntryKind::Scalar => {}
            }
        }
    }
}

fn in_folder(folder: &MemorySource, file: &str, bytes: &[u8]) -> MemorySource {
    let mut src = folder.clone();
    src.insert(file, bytes.to_vec());
    src
}

fn read_pickle(_: &MemorySource, _: &str, bytes: &[u8]) -> Result<(), String> {
    let _ = pickle::globals_until_error(bytes);
    let _ = pickle::globals(bytes);
    pickle::parse(bytes).map(drop).map_err(|e| e.to_string())
}

fn read_dcp_metadata(_: &MemorySource, _: &str, bytes: &[u8]) -> Result<(), String> {
    dcp::read_metadata(bytes)
        .map(drop)
        .map_err(|e| e.to_string())
}

fn read_torch_zip(folder: &MemorySource, file: &str, bytes: &[u8]) -> Result<(), String> {
    let src = in_folder(folder, file, bytes);
    let _ = torch_zip::read_archive(bytes);
    let _ = torch_zip::pickle_globals(bytes);
    let _ = torch_zip::pickle_globals_from(&src, file);
    let _ = torch_zip::read_archive_from(&src, file);
    let idx = index::index_torch_files(&src, &[file.to_owned()]).map_err(|e| e.to_string())?;
    exercise_index(&src, &idx);
    Ok(())
}

fn read_safetensors(folder: &MemorySource, file: &str, bytes: &[u8]) -> Result<(), String> {
    let src = in_folder(folder, file, bytes);
    let idx = index::index_source(&src).map_err(|e| e.to_string())?;
    exercise_index(&src, &idx);
    Ok(())
}

fn read_folder(folder: &MemorySource, file: &str, bytes: &[u8]) -> Result<(), String> {
    let src = in_folder(folder, file, bytes);
    let _ = shardscope_core::doctor::unsafe_loader_pickles(&src);
    let idx = index::index_source(&src).map_err(|e| e.to_string())?;
    exercise_index(&src, &idx);
    Ok(())
}

fn open_checkpoint(folder: &MemorySource, file: &str, bytes: &[u8]) -> Result<(), String> {
    let src = in_folder(folder, file, bytes);
    let checkpoint =
        Checkpoint::open(&src, "ckpt", &ReadOptions::default()).map_err(|e| e.to_string())?;
    exercise_index(&src, &checkpoint.index);
    Ok(())
}

fn targets() -> Vec<Target> {
    let dcp_folders = [
        "formats/dcp_torch_save",
        "formats/dcp_safetensors",
        "app_state/dcp",
        "dtypes/dcp_zstd",
        "dtypes/dcp_rot13",
    ];
    let rank_folders = [
        "formats/fsdp2",
        "doctor/fsdp2_ranks",
        "doctor/local",
        "doctor/tp_ranks",
    ];
    let mut metadata = single_files(".metadata", 16, ".metadata");
    vec![
        Target {
            name: "pickle",
            inputs: std::mem::take(&mut metadata),
            read: read_pickle,
            names_file: false,
        },
        Target {
            name: "dcp_metadata",
            inputs: single_files(".metadata", 16, ".metadata"),
            read: read_dcp_metadata,
            names_file: false,
        },
        Target {
            name: "torch_zip",
            inputs: single_files(".pt", 16, "f.pt"),
            read: read_torch_zip,
            names_file: true,
        },
        Target {
            name: "safetensors",
            inputs: single_files(".safetensors", 8, "m.safetensors"),
            read: read_safetensors,
            names_file: true,
        },
        Target {
            name: "dcp_folder",
            inputs: folder_files(&dcp_folders),
            read: read_folder,
            names_file: false,
        },
        Target {
            name: "hf_index",
            inputs: folder_files(&["formats/hf_sharded"]),
            read: read_folder,
            names_file: false,
        },
        Target {
            name: "torch_rank_sets",
            inputs: folder_files(&rank_folders),
            read: read_folder,
            names_file: false,
        },
        Target {
            name: "checkpoint_open",
            inputs: folder_files(&[
                "formats/dcp_torch_save",
                "formats/hf_sharded",
                "formats/fsdp2",
            ]),
            read: open_checkpoint,
            names_file: false,
        },
    ]
}

/// A fixed seed per target (FNV-1a of its name).
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn save_crash(target: &str, seed: u64, file: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-readers");
    std::fs::create_dir_all(&dir).unwrap();
    let base = file.replace('/', "_");
    let path = dir.join(format!("{target}-{seed:016x}-{base}"));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn every_reader_survives_mutated_fixtures() {
    let iterations = std::env::var("SHARDSCOPE_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ITERATIONS);
    let start = Instant::now();
    let targets = targets();
    let mut failures: Vec<String> = Vec::new();
    let mut summary: Vec<String> = Vec::new();
    for (t, target) in targets.iter().enumerate() {
        // This target's share of the time left.
        let left = TIME_BUDGET.saturating_sub(start.elapsed());
        let share = left / u32::try_from(targets.len() - t).unwrap();
        let began = Instant::now();
        let (mut ran, mut errors) = (0u64, 0u64);
        for i in 0..iterations {
            if began.elapsed() > share {
                break;
            }
            let seed = seed_of(target.name) ^ i.wrapping_mul(0x2545_f491_4f6c_dd1d);
            let mut rng = Rng(seed);
            let input = &target.inputs[rng.below(target.inputs.len())];
            let mut bytes = input.bytes.clone();
            mutate(&mut rng, &mut bytes);
            let result = catch_unwind(AssertUnwindSafe(|| {
                (target.read)(&input.folder, &input.file, &bytes)
            }));
            ran += 1;
            match result {
                Ok(Ok(())) => {}
                Ok(Err(message)) => {
                    errors += 1;
                    if target.names_file && !message.contains(&input.file) {
                        let path = save_crash(target.name, seed, &input.file, &bytes);
                        failures.push(format!(
                            "{}: seed {seed:#018x}: the error does not name `{}`: {message} (input: {})",
                            target.name,
                            input.file,
                            path.display()
                        ));
                    }
                }
                Err(_) => {
                    let path = save_crash(target.name, seed, &input.file, &bytes);
                    failures.push(format!(
                        "{}: seed {seed:#018x}: panicked on a mutated `{}`; input written to {}",
                        target.name,
                        input.file,
                        path.display()
                    ));
                }
            }
        }
        summary.push(format!(
            "{}: {ran} inputs ({errors} errors) in {:.1} s",
            target.name,
            began.elapsed().as_secs_f64()
        ));
        assert!(ran > 0, "{}: no input ran", target.name);
    }
    eprintln!("fuzz_readers:\n  {}", summary.join("\n  "));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The mutator is deterministic and does mutate.
#[test]
fn mutator_is_deterministic() {
    let base: Vec<u8> = (0..=255).collect();
    let run = |seed| {
        let mut rng = Rng(seed);
        let mut b = base.clone();
        mutate(&mut rng, &mut b);
        b
    };
    assert_eq!(run(7), run(7));
    let changed = (0..64).filter(|&s| run(s) != base).count();
    assert!(changed > 60, "{changed}");
}
