//! `shardscope convert` outputs appear atomically: 20 runs are killed with SIGKILL at pseudo-random
//! moments (a fixed-seed generator spreads them over the length of an uninterrupted run); after each,
//! the destination either does not exist or is byte-identical to the output of an uninterrupted run,
//! and the inputs' checksums are unchanged. The inputs (a 64 MiB safetensors file written with the
//! core writer, and the 2-rank DCP checkpoint the binary makes of it) need no torch; torch loading
//! what `convert` writes is `convert_interop.rs`'s job.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fs::File;
use std::hash::{DefaultHasher, Hasher};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use shardscope_core::DType;
use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};

const TENSORS: usize = 16;
const ROWS: u64 = 1024;
const COLS: u64 = 512; // 16 x 2 MiB of f32

fn write_input(path: &Path) {
    let specs: Vec<TensorSpec> = (0..TENSORS)
        .map(|i| TensorSpec {
            name: format!("layers.{i:02}.weight"),
            dtype: DType::Float32,
            shape: vec![ROWS, COLS],
        })
        .collect();
    let mut out = BufWriter::new(File::create(path).unwrap());
    let mut writer = SafetensorsWriter::new(&mut out, &specs, None).unwrap();
    let order: Vec<String> = writer.data_order().map(str::to_owned).collect();
    let mut data: Vec<u8> = (0..ROWS * COLS)
        .flat_map(|i| ((i as f32) * 0.5).to_le_bytes())
        .collect();
    for (k, name) in order.iter().enumerate() {
        data[..4].copy_from_slice(&(k as f32).to_le_bytes()); // tensors differ
        writer.write_tensor(name, &data).unwrap();
    }
    writer.finish().unwrap();
}

/// File path (relative to `root`) -> content hash, for a file or every file under a directory.
fn checksums(root: &Path) -> BTreeMap<String, u64> {
    fn walk(dir: &Path, rel: &str, out: &mut BTreeMap<String, u64>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let name = format!("{rel}{}", p.file_name().unwrap().to_string_lossy());
            if p.is_dir() {
                walk(&p, &format!("{name}/"), out);
            } else {
                out.insert(name, hash_file(&p));
            }
        }
    }
    let mut out = BTreeMap::new();
    if root.is_dir() {
        walk(root, "", &mut out);
    } else {
        out.insert(String::new(), hash_file(root));
    }
    out
}

fn hash_file(path: &Path) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(&std::fs::read(path).unwrap());
    h.finish()
}

fn convert(bin: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("convert").args(args).arg("--quiet");
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    cmd
}

/// xorshift64*: reproducible "random" kill moments without a dependency.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
#[allow(
    clippy::too_many_lines,
    reason = "one scenario: references, twenty killed runs, their checks"
)]
fn killed_conversions_leave_no_partial_output_and_inputs_unchanged() {
    let bin = crate::common::shardscope_bin();
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.safetensors");
    write_input(&full);
    let dcp = dir.path().join("dcp");
    let status = convert(
        &bin,
        &[
            full.to_str().unwrap(),
            "-o",
            dcp.to_str().unwrap(),
            "--world-size",
            "2",
        ],
    )
    .status()
    .unwrap();
    assert!(status.success());
    let inputs: Vec<(PathBuf, BTreeMap<String, u64>)> = [full.clone(), dcp.clone()]
        .into_iter()
        .map(|p| {
            let c = checksums(&p);
            (p, c)
        })
        .collect();

    // Output name and arguments (before `-o DST`) per kind of output.
    let kinds: Vec<(&str, Vec<String>)> = vec![
        ("out.safetensors", vec![dcp.display().to_string()]),
        ("out.pt", vec![dcp.display().to_string()]),
        (
            "out_dcp",
            vec![
                full.display().to_string(),
                "--world-size".into(),
                "3".into(),
            ],
        ),
        (
            "out_hf",
            vec![
                dcp.display().to_string(),
                "--max-shard-size".into(),
                "20MB".into(),
            ],
        ),
    ];
    // Reference outputs and how long an uninterrupted run takes: the fastest of three, so that a
    // run slowed by other work on the machine does not set kill moments later runs outlive.
    let reference = dir.path().join("reference");
    std::fs::create_dir(&reference).unwrap();
    let mut expected = Vec::new();
    let mut durations = Vec::new();
    for (name, args) in &kinds {
        let mut fastest = None;
        for attempt in 0..3 {
            let dest = reference.join(attempt.to_string()).join(name);
            std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
            let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
            all.extend(["-o", dest.to_str().unwrap()]);
            let t = Instant::now();
            assert!(convert(&bin, &all).status().unwrap().success(), "{name}");
            let took = t.elapsed();
            fastest = Some(fastest.map_or(took, |f: std::time::Duration| f.min(took)));
            let sums = checksums(&dest);
            if attempt == 0 {
                expected.push(sums);
            } else {
                assert_eq!(&sums, expected.last().unwrap(), "{name}: not deterministic");
            }
        }
        durations.push(fastest.unwrap());
    }

    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let mut killed_before_done = 0;
    for run in 0..20 {
        let k = run % kinds.len();
        let (name, args) = &kinds[k];
        // Same file name as the reference (a torch.save archive's root folder is the file stem).
        let run_dir = work.join(run.to_string());
        std::fs::create_dir(&run_dir).unwrap();
        let dest = run_dir.join(name);
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend(["-o", dest.to_str().unwrap()]);
        let delay = durations[k].mul_f64(rng.next_f64() * 0.9);
        let mut child = convert(&bin, &all).spawn().unwrap();
        std::thread::sleep(delay);
        let _ = child.kill(); // SIGKILL on Unix; fails only when the run already ended
        child.wait().unwrap();
        if dest.exists() {
            assert_eq!(
                checksums(&dest),
                expected[k],
                "run {run} ({name}, killed after {delay:?}): a partial output is at the destination"
            );
        } else {
            killed_before_done += 1;
        }
        for (path, sums) in &inputs {
            assert_eq!(
                &checksums(path),
                sums,
                "run {run}: input {} changed",
                path.display()
            );
        }
    }
    eprintln!("uninterrupted runs took {durations:?}; {killed_before_done} of 20 runs interrupted");
    // The moments must actually interrupt conversions, or the test proves nothing.
    assert!(
        killed_before_done >= 10,
        "only {killed_before_done} of 20 runs were interrupted"
    );
}
