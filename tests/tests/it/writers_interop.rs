//! Files written by `shardscope_core::formats::write` load in real torch and equal what we wrote.
//!
//! Each test writes tensors made from a formula (see `tensor_bytes`) with our writers into a temp
//! directory, then runs `tests/interop/check_writers.py`, which loads them with torch's own loaders
//! (`torch.load(weights_only=True)`, `safetensors.torch.load_file`, `torch.distributed.checkpoint.load`,
//! `format_utils.dcp_to_torch_save`) and compares them bit for bit with the same formula computed by
//! torch. Python comes from `SHARDSCOPE_PYTHON`, else `~/torch-venv/bin/python`; without torch the
//! interop tests print "skipped: no torch" and pass (CI always has torch).
//!
//! The determinism tests need no Python: writing the same input twice gives identical bytes.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use shardscope_core::DType;
use shardscope_core::formats::write::dcp::{
    self, BytesValue, DcpChunk, DcpEntry, DcpFileWriter, DcpMetadataOptions, DcpPlan, DcpValue,
    EmptyRanks, PathKey,
};
use shardscope_core::formats::write::pickle::{PyValue, StorageSpec, TensorPickle};
use shardscope_core::formats::write::safetensors::{
    SafetensorsWriter, TensorSpec, index_json, plan_shards,
};
use shardscope_core::formats::write::torch_save::TorchSaveWriter;

/// (key, dtype, shape); tensor `k` of the list uses `k` in the formula.
const CASES: &[(&str, DType, &[u64])] = &[
    ("f32", DType::Float32, &[2, 3]),
    ("bf16", DType::BFloat16, &[4]),
    ("f16", DType::Float16, &[3, 2]),
    ("f64", DType::Float64, &[2]),
    ("i64", DType::Int64, &[4]),
    ("i32", DType::Int32, &[3]),
    ("i16", DType::Int16, &[2]),
    ("i8", DType::Int8, &[3, 100]),
    ("u8", DType::UInt8, &[3]),
    ("bool", DType::Bool, &[2, 2]),
    ("scalar", DType::Float32, &[]),
    ("empty", DType::Float32, &[0, 4]),
    ("u16", DType::UInt16, &[3]),
    ("u32", DType::UInt32, &[2]),
    ("u64", DType::UInt64, &[2]),
    ("c64", DType::Complex64, &[2]),
    ("f8e4m3", DType::Float8E4M3Fn, &[4]),
    ("f8e5m2", DType::Float8E5M2, &[4]),
    ("f8e4m3fnuz", DType::Float8E4M3Fnuz, &[3]),
    ("f8e5m2fnuz", DType::Float8E5M2Fnuz, &[3]),
    ("f8e8m0fnu", DType::Float8E8M0Fnu, &[2]),
];

#[derive(Debug, Clone)]
struct Case {
    key: String,
    k: u64,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn cases(filter: impl Fn(DType) -> bool) -> Vec<Case> {
    CASES
        .iter()
        .enumerate()
        .filter(|(_, (_, dtype, _))| filter(*dtype))
        .map(|(k, (key, dtype, shape))| Case {
            key: (*key).to_owned(),
            k: k as u64,
            dtype: *dtype,
            shape: shape.to_vec(),
            data: tensor_bytes(k as u64, *dtype, shape),
        })
        .collect()
}

/// Element `i` of tensor `k`, as little-endian bytes of `dtype` (the checker computes the same values
/// with torch's own conversions).
fn tensor_bytes(k: u64, dtype: DType, shape: &[u64]) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let mut out = Vec::new();
    for i in 0..n {
        let base = k * 1000 + i;
        let f = (base as f64 * 0.25) as f32;
        match dtype {
            DType::Float32 => out.extend(f.to_le_bytes()),
            DType::Float64 => out.extend(f64::from(f).to_le_bytes()),
            DType::Float16 => out.extend(half::f16::from_f32(f).to_le_bytes()),
            DType::BFloat16 => out.extend(half::bf16::from_f32(f).to_le_bytes()),
            DType::Complex64 => {
                out.extend(f.to_le_bytes());
                out.extend((-f).to_le_bytes());
            }
            DType::Complex128 => {
                out.extend(f64::from(f).to_le_bytes());
                out.extend((-f64::from(f)).to_le_bytes());
            }
            DType::Bool => out.push(u8::from(base.is_multiple_of(3))),
            DType::UInt8
            | DType::Float8E4M3Fn
            | DType::Float8E5M2
            | DType::Float8E4M3Fnuz
            | DType::Float8E5M2Fnuz
            | DType::Float8E8M0Fnu => out.push(base as u8),
            DType::Complex32 => {
                out.extend(half::f16::from_f32(f).to_le_bytes());
                out.extend(half::f16::from_f32(-f).to_le_bytes());
            }
            DType::Int8 => out.extend((base as i8).to_le_bytes()),
            DType::Int16 => out.extend((base as i16).to_le_bytes()),
            DType::UInt16 => out.extend((base as u16).to_le_bytes()),
            DType::Int32 => out.extend((base as i32).to_le_bytes()),
            DType::UInt32 => out.extend((base as u32).to_le_bytes()),
            DType::Int64 => out.extend((base as i64).to_le_bytes()),
            DType::UInt64 => out.extend(base.to_le_bytes()),
        }
    }
    out
}

/// The values the checker expects under `extra` (its `EXTRA` constant).
fn extra_value() -> PyValue {
    let s = PyValue::str;
    PyValue::Dict(vec![
        (s("lr"), PyValue::Float(0.5)),
        (
            s("betas"),
            PyValue::Tuple(vec![PyValue::Float(0.9), PyValue::Float(0.999)]),
        ),
        (s("names"), PyValue::List(vec![s("a.weight"), s("b.bias")])),
        (s("step"), PyValue::Int(7)),
        (s("nothing"), PyValue::None),
        (s("flag"), PyValue::Bool(true)),
        (s("big"), PyValue::Int(1 << 40)),
        (s("negative"), PyValue::Int(-3)),
        (
            s("nested"),
            PyValue::Dict(vec![(
                s("x"),
                PyValue::List(vec![
                    PyValue::Int(1),
                    PyValue::Tuple(vec![PyValue::Int(2), s("three")]),
                ]),
            )]),
        ),
    ])
}

fn manifest(cases: &[Case], extra: serde_json::Value) -> serde_json::Value {
    let tensors: Vec<_> = cases
        .iter()
        .map(|c| {
            serde_json::json!({"key": c.key, "k": c.k, "dtype": c.dtype.name(), "shape": c.shape})
        })
        .collect();
    let mut m = serde_json::json!({ "tensors": tensors });
    if let serde_json::Value::Object(extra) = extra {
        m.as_object_mut().unwrap().extend(extra);
    }
    m
}

fn write_manifest(dir: &Path, manifest: &serde_json::Value) {
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(manifest).unwrap(),
    )
    .unwrap();
}

fn python() -> Option<PathBuf> {
    shardscope_tests::torch_python()
}

fn run_checker(python: &Path, format: &str, dir: &Path) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("interop/check_writers.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(format)
        .arg(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "torch rejected our {format} output:\n{stdout}\n{stderr}"
    );
    eprintln!("{}", stdout.trim());
}

// ---------------------------------------------------------------- torch.save

fn write_torch_save(out: impl Write, cases: &[Case]) {
    let storages: Vec<StorageSpec> = cases
        .iter()
        .map(|c| StorageSpec {
            dtype: c.dtype,
            numel: c.shape.iter().product(),
        })
        .collect();
    let model = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            (
                PyValue::str(c.key.as_str()),
                PyValue::Tensor(TensorPickle::contiguous(i, c.dtype, &c.shape)),
            )
        })
        .collect();
    // Elements [2, 4) of the first tensor's storage, shared.
    let view = TensorPickle {
        storage: 0,
        dtype: cases[0].dtype,
        storage_offset: 2,
        shape: vec![2],
        stride: vec![1],
    };
    let root = PyValue::OrderedDict(vec![
        (PyValue::str("model"), PyValue::OrderedDict(model)),
        (PyValue::str("extra"), extra_value()),
        (PyValue::str("view"), PyValue::Tensor(view)),
    ]);
    let mut writer = TorchSaveWriter::new(out, "model", &root, storages).unwrap();
    for c in cases {
        writer.write_storage(&c.data).unwrap();
    }
    writer.finish().unwrap();
}

#[test]
fn torch_save_loads_with_weights_only() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let cases = cases(|_| true);
    let mut with_c128 = cases.clone();
    with_c128.push(Case {
        key: "c128".to_owned(),
        k: 40,
        dtype: DType::Complex128,
        shape: vec![3],
        data: tensor_bytes(40, DType::Complex128, &[3]),
    });
    let dir = tempfile::tempdir().unwrap();
    let file = BufWriter::new(File::create(dir.path().join("model.pt")).unwrap());
    write_torch_save(file, &with_c128);
    write_manifest(dir.path(), &manifest(&with_c128, serde_json::json!({})));
    run_checker(&python, "torch_save", dir.path());
}

// ---------------------------------------------------------------- safetensors

fn safetensors_cases() -> Vec<Case> {
    // The Python safetensors library (0.8) has no name for float8_e8m0fnu (`F8_E8M0`) yet.
    cases(|d| !matches!(d, DType::Complex128 | DType::Float8E8M0Fnu))
}

fn write_safetensors(out: impl Write, cases: &[Case], metadata: Option<&BTreeMap<String, String>>) {
    let specs: Vec<TensorSpec> = cases
        .iter()
        .map(|c| TensorSpec {
            name: c.key.clone(),
            dtype: c.dtype,
            shape: c.shape.clone(),
        })
        .collect();
    let by_name: BTreeMap<&str, &Case> = cases.iter().map(|c| (c.key.as_str(), c)).collect();
    let mut writer = SafetensorsWriter::new(out, &specs, metadata).unwrap();
    let order: Vec<String> = writer.data_order().map(str::to_owned).collect();
    for name in order {
        writer
            .write_tensor(&name, &by_name[name.as_str()].data)
            .unwrap();
    }
    writer.finish().unwrap();
}

#[test]
fn safetensors_loads_and_matches_reference_bytes() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let cases = safetensors_cases();
    let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    let dir = tempfile::tempdir().unwrap();
    let file = BufWriter::new(File::create(dir.path().join("model.safetensors")).unwrap());
    write_safetensors(file, &cases, Some(&metadata));
    write_manifest(
        dir.path(),
        &manifest(&cases, serde_json::json!({"metadata": metadata})),
    );
    run_checker(&python, "safetensors", dir.path());
}

#[test]
fn sharded_safetensors_follow_hf_layout() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let cases = safetensors_cases();
    let max_shard_size = 40u64;
    let specs: Vec<TensorSpec> = cases
        .iter()
        .map(|c| TensorSpec {
            name: c.key.clone(),
            dtype: c.dtype,
            shape: c.shape.clone(),
        })
        .collect();
    let plan = plan_shards(&specs, Some(max_shard_size), "model").unwrap();
    assert!(plan.files.len() >= 3, "{plan:?}");
    let dir = tempfile::tempdir().unwrap();
    for file in &plan.files {
        let shard: Vec<Case> = file.tensors.iter().map(|&i| cases[i].clone()).collect();
        let out = BufWriter::new(File::create(dir.path().join(&file.file_name)).unwrap());
        write_safetensors(out, &shard, None);
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index_json(&plan, &specs),
    )
    .unwrap();
    write_manifest(
        dir.path(),
        &manifest(
            &cases,
            serde_json::json!({"max_shard_size": max_shard_size}),
        ),
    );
    run_checker(&python, "safetensors_sharded", dir.path());
}

// ---------------------------------------------------------------- DCP

const WORLD_SIZE: usize = 5;

/// Copies the region `[offsets, offsets + sizes)` of a contiguous tensor into a contiguous buffer.
fn region(full: &[u8], shape: &[u64], offsets: &[u64], sizes: &[u64], item: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let n: u64 = sizes.iter().product();
    if shape.is_empty() {
        return full.to_vec();
    }
    for flat in 0..n {
        // Index inside the region, then inside the full tensor (row-major).
        let mut rem = flat;
        let mut src = 0u64;
        let mut stride = 1u64;
        for d in (0..shape.len()).rev() {
            let idx = rem % sizes[d];
            rem /= sizes[d];
            src += (offsets[d] + idx) * stride;
            stride *= shape[d];
        }
        let at = src as usize * item;
        out.extend_from_slice(&full[at..at + item]);
    }
    out
}

/// The DCP entries: every case under `model.<key>` cut on dim 0 over 5 ranks (`f32` column-wise,
/// `f16` as DTensor with zero-size chunks on empty ranks except rank 4, which stays empty), plus
/// bytes items for an optimizer param group and a step counter on different ranks.
fn dcp_entries(cases: &[Case]) -> Vec<DcpEntry> {
    let mut entries = Vec::new();
    for c in cases {
        let chunks: Vec<DcpChunk> = match c.key.as_str() {
            "f32" => (0..3)
                .map(|col| DcpChunk {
                    offsets: vec![0, col],
                    sizes: vec![2, 1],
                    rank: col as usize + 1,
                })
                .collect(),
            "f16" => dcp::chunk_dim0(c.dtype, &c.shape, WORLD_SIZE, EmptyRanks::ZeroSize)
                .unwrap()
                .into_iter()
                .filter(|ch| ch.rank != 4)
                .map(|ch| ch.chunk)
                .collect(),
            _ => dcp::chunk_dim0(c.dtype, &c.shape, WORLD_SIZE, EmptyRanks::Omit)
                .unwrap()
                .into_iter()
                .map(|ch| ch.chunk)
                .collect(),
        };
        entries.push(DcpEntry {
            fqn: format!("model.{}", c.key),
            path: vec![
                PathKey::Key("model".to_owned()),
                PathKey::Key(c.key.clone()),
            ],
            value: DcpValue::Tensor {
                dtype: c.dtype,
                size: c.shape.clone(),
                chunks,
            },
        });
    }
    let group = |name: &str, rank: usize, value: PyValue| {
        let path = vec![
            PathKey::Key("optim".to_owned()),
            PathKey::Key("param_groups".to_owned()),
            PathKey::Index(0),
            PathKey::Key(name.to_owned()),
        ];
        DcpEntry {
            fqn: PathKey::join(&path),
            path,
            value: DcpValue::Bytes {
                rank,
                value: BytesValue::Value(value),
            },
        }
    };
    entries.push(group("lr", 1, PyValue::Float(0.5)));
    entries.push(group(
        "betas",
        2,
        PyValue::Tuple(vec![PyValue::Float(0.9), PyValue::Float(0.999)]),
    ));
    entries.push(group(
        "params",
        3,
        PyValue::List(vec![PyValue::str("a.weight"), PyValue::str("b.bias")]),
    ));
    entries.push(DcpEntry {
        fqn: "step".to_owned(),
        path: vec![PathKey::Key("step".to_owned())],
        value: DcpValue::Bytes {
            rank: 0,
            value: BytesValue::Value(PyValue::Int(7)),
        },
    });
    entries
}

/// Writes the checkpoint with one output per rank from `open`, returns the `.metadata` bytes.
fn write_dcp<W: Write>(cases: &[Case], mut open: impl FnMut(usize) -> W) -> Vec<u8> {
    let plan = DcpPlan::new(WORLD_SIZE, dcp_entries(cases)).unwrap();
    let mut records = Vec::new();
    for rank in 0..WORLD_SIZE {
        let mut writer = DcpFileWriter::new(&plan, rank, open(rank)).unwrap();
        while let Some((entry, chunk)) = writer.next_chunk() {
            let case = &cases[entry];
            let DcpValue::Tensor { chunks, .. } = &plan.entries()[entry].value else {
                panic!("chunk of a bytes entry");
            };
            let ch = &chunks[chunk];
            let data = region(
                &case.data,
                &case.shape,
                &ch.offsets,
                &ch.sizes,
                case.dtype.size_bytes(),
            );
            writer.write_chunk(&data).unwrap();
        }
        let (mut out, record) = writer.finish().unwrap();
        out.flush().unwrap();
        records.push(record);
    }
    dcp::metadata_pickle(&plan, &records, &DcpMetadataOptions::default()).unwrap()
}

#[test]
fn dcp_loads_with_torch_distributed_checkpoint() {
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let cases = cases(|_| true);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    let metadata = write_dcp(&cases, |rank| {
        BufWriter::new(File::create(dir.join(DcpPlan::file_name(rank))).unwrap())
    });
    std::fs::write(dir.join(".metadata"), metadata).unwrap();
    // Rank 4 holds nothing and still gets an empty file, as torch writes it.
    assert_eq!(
        std::fs::metadata(dir.join("__4_0.distcp")).unwrap().len(),
        0
    );
    write_manifest(
        &dir,
        &manifest(&cases, serde_json::json!({"world_size": WORLD_SIZE})),
    );
    run_checker(&python, "dcp", &dir);
}

// ---------------------------------------------------------------- determinism

#[test]
fn writing_twice_gives_identical_bytes() {
    let all = cases(|_| true);
    let mut a = Vec::new();
    let mut b = Vec::new();
    write_torch_save(&mut a, &all);
    write_torch_save(&mut b, &all);
    assert_eq!(a, b);

    let st = safetensors_cases();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    write_safetensors(&mut a, &st, None);
    write_safetensors(&mut b, &st, None);
    assert_eq!(a, b);

    let mut files_a = vec![Vec::new(); WORLD_SIZE];
    let mut files_b = vec![Vec::new(); WORLD_SIZE];
    let meta_a = write_dcp(&all, |_| Vec::new());
    let meta_b = write_dcp(&all, |_| Vec::new());
    assert_eq!(meta_a, meta_b);
    // Capture the per-rank bytes through shared buffers.
    for files in [&mut files_a, &mut files_b] {
        let cells: Vec<std::rc::Rc<std::cell::RefCell<Vec<u8>>>> =
            (0..WORLD_SIZE).map(|_| std::rc::Rc::default()).collect();
        write_dcp(&all, |rank| SharedBuf(cells[rank].clone()));
        for (rank, cell) in cells.iter().enumerate() {
            files[rank] = cell.borrow().clone();
        }
    }
    assert_eq!(files_a, files_b);
    assert!(files_a[..4].iter().all(|f| !f.is_empty()));
}

#[derive(Debug)]
struct SharedBuf(std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------- ZIP64 records

#[test]
fn zip64_headers_read_back_in_python_and_torch() {
    use shardscope_core::formats::write::zip::{Zip64, ZipWriter};
    let Some(python) = python() else {
        eprintln!("skipped: no torch");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z64.zip");
    let mut zip =
        ZipWriter::with_zip64(BufWriter::new(File::create(&path).unwrap()), Zip64::Always);
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    zip.add("arc/data/0", &payload).unwrap();
    zip.add("arc/empty", b"").unwrap();
    zip.add("arc/version", b"3\n").unwrap(); // torch's reader requires it
    zip.finish().unwrap().flush().unwrap();
    // zipfile checks CRC-32 on read; torch's own reader (miniz) parses the ZIP64 records.
    let script = r"
import sys, zipfile, torch
p = sys.argv[1]
want = bytes((i * 7 % 251) for i in range(1000))
z = zipfile.ZipFile(p)
assert z.testzip() is None
assert z.read('arc/data/0') == want and z.read('arc/empty') == b''
r = torch._C.PyTorchFileReader(p)
assert bytes(r.get_record('data/0')) == want
assert r.get_record_offset('data/0') % 64 == 0
print('ok: zip64')
";
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
