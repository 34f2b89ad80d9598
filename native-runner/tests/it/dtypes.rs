//! Every dtype torch saves (float8 variants, uint16/32/64, complex32/64/128, bool) and DCP items
//! compressed with `stream.zstd/1`, on fixtures written by real torch
//! (`tests/fixtures/dtypes/gen_dtypes.py`): values and statistics against what torch computed
//! (`expected.json`), `convert` outputs loaded back by torch (`tests/interop/check_dtypes.py`),
//! `diff` comparing float8 as float8, and damaged or unsupported compressed items.
#![allow(clippy::unwrap_used, clippy::float_cmp)]

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{run_interop_script, shardscope_bin};
use serde_json::Value;
use sha2::{Digest, Sha256};
use shardscope_core::index::{self, ChunkEncoding};
use shardscope_tests::{fixtures_dir, memory_source};

fn dtypes_dir() -> PathBuf {
    fixtures_dir().join("dtypes")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(dtypes_dir().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Runs shardscope; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(shardscope_bin()).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The fixtures and the `expected.json` section describing each.
const FIXTURES: [(&str, &str); 3] = [
    ("all_dtypes.pt", "all_dtypes.pt"),
    ("float8.safetensors", "float8.safetensors"),
    ("dcp_zstd", "dcp_zstd"),
];

fn close(got: f64, want: f64) -> bool {
    got == want || (got - want).abs() <= 1e-12 * want.abs().max(1.0)
}

#[test]
fn every_float8_byte_decodes_as_torch_decodes_it() {
    let expected = expected();
    let table = expected["float8_decoding"].as_object().unwrap();
    assert_eq!(table.len(), 5);
    for (name, values) in table {
        let dtype: shardscope_core::DType = name.parse().unwrap();
        let values = values.as_array().unwrap();
        assert_eq!(values.len(), 256);
        for (byte, want) in values.iter().enumerate() {
            let want: f64 = want.as_str().unwrap().parse().unwrap();
            let got = dtype.element_f64(&[byte as u8])[0];
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{name} byte {byte:#04x}: {got} vs torch {want}"
            );
        }
    }
}

#[test]
fn inspect_values_equal_torch_statistics() {
    let expected = expected();
    for (fixture, section) in FIXTURES {
        let path = dtypes_dir().join(fixture);
        let (code, stdout, stderr) =
            run(&["inspect", path.to_str().unwrap(), "--values", "--json"]);
        assert_eq!(code, 0, "{fixture}: {stderr}");
        let report: Value = serde_json::from_str(&stdout).unwrap();
        let want = expected[section].as_object().unwrap();
        let entries = report["entries"].as_array().unwrap();
        let tensors: Vec<&Value> = entries.iter().filter(|e| e["kind"] == "tensor").collect();
        assert_eq!(tensors.len(), want.len(), "{fixture}: tensor count");
        for (key, w) in want {
            let e = tensors
                .iter()
                .find(|e| e["key"] == key.as_str())
                .unwrap_or_else(|| panic!("{fixture}: no entry {key}"));
            assert_eq!(e["dtype"], w["dtype"], "{fixture}: {key} dtype");
            assert_eq!(e["shape"], w["shape"], "{fixture}: {key} shape");
            let s = &e["stats"];
            for field in ["count", "nan", "inf"] {
                assert_eq!(s[field], w[field], "{fixture}: {key} {field}");
            }
            for field in ["min", "max"] {
                assert_eq!(
                    s[field].as_f64(),
                    w[field].as_f64(),
                    "{fixture}: {key} {field}"
                );
            }
            match (s["mean"].as_f64(), w["mean"].as_f64()) {
                (Some(g), Some(t)) => assert!(close(g, t), "{fixture}: {key} mean {g} vs {t}"),
                (g, t) => assert_eq!(g, t, "{fixture}: {key} mean"),
            }
        }
    }
}

#[test]
fn compressed_items_and_every_dtype_read_to_torch_bytes() {
    let expected = expected();
    for (fixture, section) in FIXTURES {
        let path = dtypes_dir().join(fixture);
        let source = if path.is_dir() {
            memory_source(&path)
        } else {
            let mut s = shardscope_core::MemorySource::new();
            s.insert(fixture.to_owned(), std::fs::read(&path).unwrap());
            s
        };
        let idx = index::index_source(&source).unwrap();
        assert!(idx.check().is_empty(), "{fixture}: {:?}", idx.check());
        for (key, w) in expected[section].as_object().unwrap() {
            let e = idx
                .entry(key)
                .unwrap_or_else(|| panic!("{fixture}: no {key}"));
            assert_eq!(e.dtype.unwrap().name(), w["dtype"], "{fixture}: {key}");
            if fixture == "dcp_zstd" {
                assert!(
                    e.chunks
                        .iter()
                        .all(|c| c.encoding == ChunkEncoding::ZstdTorchSaveItem),
                    "{key}: not read as a compressed item"
                );
            }
            let data = idx.read_tensor(&source, e).unwrap();
            let hash = format!("{:x}", Sha256::digest(&data.bytes));
            assert_eq!(
                hash,
                w["sha256"].as_str().unwrap(),
                "{fixture}: {key} bytes"
            );
        }
    }
    // The compressible 64x64 zeros take far fewer bytes in the file than in memory.
    let source = memory_source(&dtypes_dir().join("dcp_zstd"));
    let idx = index::index_source(&source).unwrap();
    let zeros = idx.entry("model.zeros").unwrap();
    assert!(zeros.chunks[0].byte_length * 10 < zeros.nbytes().unwrap());
    // The bytes item (`step`) is compressed too and decodes to torch's value.
    let step = idx.entry("step").unwrap();
    assert_eq!(step.chunks[0].encoding, ChunkEncoding::ZstdTorchSaveItem);
    assert_eq!(idx.read_bytes_value(&source, step).unwrap(), 7);
}

#[test]
fn converted_zstd_dcp_and_all_dtypes_load_in_torch_as_torch_reads_them() {
    run_interop_script("check_dtypes.py");
}

#[test]
fn float8_diff_compares_float8_values() {
    let dir = dtypes_dir();
    let pt = dir.join("float8.pt");
    let st = dir.join("float8.safetensors");
    let perturbed = dir.join("float8_perturbed.safetensors");
    let (code, stdout, stderr) = run(&["diff", pt.to_str().unwrap(), st.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("4 match, 0 mismatch"), "{stdout}");

    let (code, stdout, stderr) = run(&[
        "diff",
        pt.to_str().unwrap(),
        perturbed.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let want = &expected()["float8_perturbed"];
    let key = want["key"].as_str().unwrap();
    let entries = report["entries"].as_array().unwrap();
    for e in entries {
        let status = if e["fqn"] == key { "mismatch" } else { "match" };
        assert_eq!(e["status"], status, "{e}");
    }
    let e = entries.iter().find(|e| e["fqn"] == key).unwrap();
    assert_eq!(e["dtype"], "float8_e4m3fn");
    assert_eq!(e["mismatched_elements"], 1);
    let at = want["index"].as_u64().unwrap();
    assert_eq!(e["first_mismatch"], serde_json::json!([at / 16, at % 16]));
    // The values as torch decodes them (as uint8 they would be the raw bytes).
    let values: Vec<f64> = e["first_values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        values,
        [
            want["before"].as_f64().unwrap(),
            want["after"].as_f64().unwrap()
        ]
    );
    let before = want["before"].as_f64().unwrap();
    let after = want["after"].as_f64().unwrap();
    assert_eq!(e["max_abs_diff"].as_f64().unwrap(), (before - after).abs());
}

#[test]
fn diff_of_zstd_dcp_against_torch_safetensors_is_equal() {
    let dir = dtypes_dir();
    let dcp = dir.join("dcp_zstd");
    let st = dir.join("dcp_zstd_model.safetensors");
    let (code, stdout, stderr) = run(&[
        "diff",
        dcp.to_str().unwrap(),
        st.to_str().unwrap(),
        "--select",
        "model",
    ]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("8 match, 0 mismatch, 0 missing"),
        "{stdout}"
    );
}

/// Copies a fixture folder into a fresh temporary folder.
fn copy_dir(from: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(from).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, tmp.path().join(f.file_name().unwrap())).unwrap();
    }
    tmp
}

#[test]
fn corrupt_zstd_item_exits_2_naming_key_and_file() {
    let tmp = copy_dir(&dtypes_dir().join("dcp_zstd"));
    let source = memory_source(tmp.path());
    let idx = index::index_source(&source).unwrap();
    let chunk = &idx.entry("model.w_f32").unwrap().chunks[0];
    // Keep the frame header (magic + descriptor), garble the blocks.
    let data_file = tmp.path().join(&*chunk.file);
    let mut bytes = std::fs::read(&data_file).unwrap();
    let start = (chunk.byte_offset + 6) as usize;
    let end = (chunk.byte_offset + chunk.byte_length) as usize;
    for (i, b) in bytes[start..end].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(151) ^ 0x5a;
    }
    std::fs::write(&data_file, bytes).unwrap();
    let dir = tmp.path().to_str().unwrap();

    // Metadata alone is still readable.
    let (code, _, stderr) = run(&["inspect", dir]);
    assert_eq!(code, 0, "{stderr}");
    let (code, _, stderr) = run(&["inspect", dir, "--values"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("model.w_f32"), "{stderr}");
    assert!(stderr.contains("zstd"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("out.safetensors");
    let (code, _, stderr) = run(&[
        "convert",
        dir,
        "-o",
        dst.to_str().unwrap(),
        "--select",
        "model",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("model.w_f32") && stderr.contains("zstd"),
        "{stderr}"
    );
    assert!(!dst.exists(), "a failed convert left {}", dst.display());
}

#[test]
fn zstd_bomb_in_an_item_exits_2_within_its_limit() {
    let tmp = copy_dir(&dtypes_dir().join("dcp_zstd"));
    let source = memory_source(tmp.path());
    let idx = index::index_source(&source).unwrap();
    // `model.zeros` is a 64x64 float32 (16 KiB): its archive may decompress to 16 KiB + 64 KiB.
    let chunk = &idx.entry("model.zeros").unwrap().chunks[0];
    let zeros = std::io::Read::take(std::io::repeat(0), 8 << 20);
    let bomb =
        ruzstd::encoding::compress_to_vec(zeros, ruzstd::encoding::CompressionLevel::Fastest);
    assert!(
        bomb.len() as u64 <= chunk.byte_length,
        "{} bytes",
        bomb.len()
    );
    let data_file = tmp.path().join(&*chunk.file);
    let mut bytes = std::fs::read(&data_file).unwrap();
    let start = chunk.byte_offset as usize;
    bytes[start..start + bomb.len()].copy_from_slice(&bomb);
    std::fs::write(&data_file, bytes).unwrap();

    let (code, _, stderr) = run(&["inspect", tmp.path().to_str().unwrap(), "--values"]);
    assert_eq!(code, 2, "{stderr}");
    let limit = 64 * 64 * 4 + index::ITEM_ARCHIVE_OVERHEAD;
    assert!(
        stderr.contains("model.zeros")
            && stderr.contains(&format!(
                "decompresses to more than the {limit} bytes the metadata justifies"
            )),
        "{stderr}"
    );
}

#[test]
fn unknown_transform_extension_exits_2_naming_it() {
    let dir = dtypes_dir().join("dcp_rot13");
    for args in [
        vec!["inspect", dir.to_str().unwrap()],
        vec!["convert", dir.to_str().unwrap(), "-o", "/nonexistent/x.pt"],
    ] {
        let (code, _, stderr) = run(&args);
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains("`stream.rot13/1`"), "{stderr}");
        assert!(stderr.contains("__0_0.distcp"), "{stderr}");
        assert!(stderr.contains("stream.zstd/1"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn safetensors_output_names_a_dtype_it_cannot_hold() {
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("all.safetensors");
    let src = dtypes_dir().join("all_dtypes.pt");
    let (code, _, stderr) = run(&[
        "convert",
        src.to_str().unwrap(),
        "-o",
        dst.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("tensor `complex128`: dtype complex128 cannot be stored in safetensors")
            || stderr
                .contains("tensor `complex32`: dtype complex32 cannot be stored in safetensors"),
        "{stderr}"
    );
    assert!(!dst.exists());
}
