//! `shardscope hash`, `verify --manifest` and `diff` with a manifest side. The digests themselves
//! are checked against torch in `tests/interop/check_hash.py`; here: corruption is found and named
//! where it was made (the place found from torch's own values, not from our output), missing and
//! extra keys, exit codes, determinism, untrusted manifests.

#![allow(clippy::unwrap_used, clippy::too_many_lines)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shardscope_tests::fixtures_dir;

fn run(args: &[&str]) -> Output {
    Command::new(crate::common::shardscope_bin())
        .args(args)
        .output()
        .expect("run shardscope")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The report's entries that are not a match, by key.
fn problems(report: &serde_json::Value) -> Vec<(String, String, String)> {
    report["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["status"] != "match")
        .map(|e| {
            (
                e["fqn"].as_str().unwrap().to_owned(),
                e["status"].as_str().unwrap().to_owned(),
                e["message"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// `FILE bytes A..B` in `message`: the ranges named for `file`.
fn ranges_named(message: &str, file: &str) -> Vec<(u64, u64)> {
    let pat = format!("{file} bytes ");
    message
        .match_indices(&pat)
        .filter_map(|(i, _)| {
            let rest = &message[i + pat.len()..];
            let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
            let (a, b) = rest[..end].split_once("..")?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect()
}

#[test]
fn digests_match_torch_in_every_serialization() {
    crate::common::run_interop_script("check_hash.py");
}

#[test]
fn flipped_bytes_and_truncation_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixtures_dir().join("formats/dcp_torch_save"), &ckpt);
    let manifest = tmp.path().join("m.json");
    let out = run(&["hash", s(&ckpt), "-o", s(&manifest), "--quiet"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["verify", s(&ckpt), "--manifest", s(&manifest), "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(problems(&json(&out)).is_empty());

    // Where torch stored one tensor: its values (torch's, from the expected file) found once in
    // the DCP's files.
    let expected = std::fs::read(fixtures_dir().join("formats/expected/dcp.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&expected).unwrap();
    let files: Vec<(String, Vec<u8>)> = ["__0_0.distcp", "__1_0.distcp"]
        .iter()
        .map(|f| ((*f).to_owned(), std::fs::read(ckpt.join(f)).unwrap()))
        .collect();
    let mut target = None;
    let mut names: Vec<String> = st.names().into_iter().map(ToOwned::to_owned).collect();
    names.sort();
    for name in names {
        let data = st.tensor(&name).unwrap().data().to_vec();
        if data.len() < 32 {
            continue;
        }
        let hits: Vec<(usize, usize)> = files
            .iter()
            .enumerate()
            .flat_map(|(f, (_, bytes))| {
                bytes
                    .windows(data.len())
                    .enumerate()
                    .filter(|(_, w)| *w == &data[..])
                    .map(move |(at, _)| (f, at))
            })
            .collect();
        if let [(f, at)] = hits[..] {
            target = Some((name.replace('/', "."), f, at + data.len() / 2));
            break;
        }
    }
    let (key, f, at) = target.expect("a tensor stored once");
    let file = files[f].0.clone();
    let mut bytes = files[f].1.clone();
    bytes[at] ^= 0x40;
    std::fs::write(ckpt.join(&file), &bytes).unwrap();

    let out = run(&["verify", s(&ckpt), "--manifest", s(&manifest), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let found = problems(&json(&out));
    assert_eq!(found.len(), 1, "{found:?}");
    let (k, status, message) = &found[0];
    assert_eq!((k.as_str(), status.as_str()), (key.as_str(), "mismatch"));
    let ranges = ranges_named(message, &file);
    assert!(
        ranges
            .iter()
            .any(|&(a, b)| a <= at as u64 && (at as u64) < b),
        "{message}: byte {at} of {file} not named"
    );
    let notes = json(&out)["notes"].to_string();
    assert!(
        notes.contains(&format!("file {file}: its bytes differ")),
        "{notes}"
    );
    // The same through `diff`, with the manifest on either side.
    for (a, b) in [(&manifest, &ckpt), (&ckpt, &manifest)] {
        let out = run(&["diff", s(a), s(b), "--json", "--quiet"]);
        assert_eq!(out.status.code(), Some(1));
        let found = problems(&json(&out));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, key);
    }
    // Text output names it too.
    let out = run(&["verify", s(&ckpt), "--manifest", s(&manifest)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&key));

    // Put it back, then cut the other file short: what it held cannot be read, and is named.
    std::fs::write(ckpt.join(&file), &files[f].1).unwrap();
    let other = &files[1 - f];
    let cut = other.1.len() - 200;
    std::fs::write(ckpt.join(&other.0), &other.1[..cut]).unwrap();
    let out = run(&["verify", s(&ckpt), "--manifest", s(&manifest), "--json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = json(&out);
    let found = problems(&report);
    assert!(!found.is_empty());
    for (k, status, message) in &found {
        assert_eq!(status, "mismatch", "{k}: {message}");
        assert!(message.contains(&other.0), "{k}: {message}");
    }
    assert!(
        report["notes"].to_string().contains(&format!(
            "file {}: {cut} bytes, {} expected",
            other.0,
            other.1.len()
        )),
        "{}",
        report["notes"]
    );
}

/// A safetensors file of `tensors` (name, f32 values), written with the safetensors crate.
fn write_st(path: &Path, tensors: &[(&str, Vec<f32>)]) {
    let data: Vec<(String, Vec<u8>, usize)> = tensors
        .iter()
        .map(|(n, v)| {
            (
                (*n).to_owned(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                v.len(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, b, len)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![*len], b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn missing_and_extra_keys_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a.safetensors");
    let b = tmp.path().join("b.safetensors");
    write_st(&a, &[("kept", vec![1.0, 2.0]), ("gone", vec![3.0])]);
    write_st(&b, &[("kept", vec![1.0, 2.0]), ("new", vec![3.0])]);
    let m = tmp.path().join("a.manifest.json");
    assert!(run(&["hash", s(&a), "-o", s(&m), "-q"]).status.success());
    let out = run(&["verify", s(&b), "--manifest", s(&m), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let mut found = problems(&json(&out));
    found.sort();
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(
        (found[0].0.as_str(), found[0].1.as_str()),
        ("gone", "missing")
    );
    assert_eq!(
        (found[1].0.as_str(), found[1].1.as_str()),
        ("new", "unexpected")
    );
    // Two manifests compared (two machines): the same verdicts, files named differently noted.
    let mb = tmp.path().join("b.manifest.json");
    assert!(run(&["hash", s(&b), "-o", s(&mb), "-q"]).status.success());
    let out = run(&["diff", s(&m), s(&mb), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(problems(&json(&out)).len(), 2);
    // A manifest of another algorithm cannot be compared.
    let sha = tmp.path().join("sha.json");
    assert!(
        run(&["hash", s(&a), "-o", s(&sha), "--algorithm", "sha256", "-q"])
            .status
            .success()
    );
    let out = run(&["diff", s(&m), s(&sha)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("different algorithms"));
    // And a manifest matches its own checkpoint with either algorithm.
    assert_eq!(
        run(&["verify", s(&a), "--manifest", s(&sha)]).status.code(),
        Some(0)
    );
    assert_eq!(
        run(&["verify", s(&a), "--manifest", s(&m)]).status.code(),
        Some(0)
    );
}

#[test]
fn manifests_do_not_depend_on_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = fixtures_dir().join("formats/dcp_torch_save");
    let mut outs: Vec<Vec<u8>> = Vec::new();
    for threads in ["1", "2", "5"] {
        let out: PathBuf = tmp.path().join(format!("m{threads}.json"));
        let r = run(&["hash", s(&ckpt), "-o", s(&out), "--threads", threads, "-q"]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        outs.push(std::fs::read(&out).unwrap());
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], outs[2]);
    // Written again over itself: replaced, same bytes, no temporary left.
    let again = tmp.path().join("m1.json");
    assert!(
        run(&["hash", s(&ckpt), "-o", s(&again), "-q"])
            .status
            .success()
    );
    assert_eq!(std::fs::read(&again).unwrap(), outs[0]);
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 3);
}

#[test]
fn bad_manifests_are_refused_with_the_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a.safetensors");
    write_st(&a, &[("w", vec![1.0])]);
    let cases = [
        ("{not json", "not a shardscope manifest"),
        (
            r#"{"version": 1, "algorithm": "xxh3-128", "tensors": {"w": {"dtype": "float32", "shape": [1], "digest": "zz"}}}"#,
            "w: `zz` is not a xxh3-128 digest",
        ),
        (
            r#"{"version": 1, "algorithm": "xxh3-128", "tensors": {"w": {"dtype": "float32", "shape": [1], "digest": "00000000000000000000000000000000", "chunks": [{"offsets": [1], "sizes": [1], "digest": "00000000000000000000000000000000"}]}}}"#,
            "w: a chunk at [1] of [1] is not inside",
        ),
        (
            r#"{"version": 9, "algorithm": "xxh3-128", "tensors": {}}"#,
            "manifest version 9",
        ),
    ];
    for (i, (text, what)) in cases.iter().enumerate() {
        let m = tmp.path().join(format!("bad{i}.json"));
        std::fs::write(&m, text).unwrap();
        let out = run(&["verify", s(&a), "--manifest", s(&m)]);
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(what) && err.contains(s(&m)), "{text}: {err}");
    }
}

#[test]
fn unreadable_tensors_fail_the_hash_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixtures_dir().join("formats/dcp_torch_save"), &ckpt);
    let f = ckpt.join("__0_0.distcp");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let m = tmp.path().join("m.json");
    let out = run(&["hash", s(&ckpt), "-o", s(&m), "-q"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot be read, no manifest written") && err.contains("__0_0.distcp"),
        "{err}"
    );
    assert!(!m.exists());
}

#[test]
fn convert_manifests_match_torch() {
    crate::common::run_interop_script("check_convert_manifest.py");
}

#[test]
fn convert_manifest_of_a_large_pt_is_thread_independent_and_never_overwrites() {
    use shardscope_core::manifest::{Algorithm, Hasher};
    let tmp = tempfile::tempdir().unwrap();
    // A tensor over the 16 MiB the writer streams in pieces: the `.pt` member's checksum is
    // patched in after its bytes, so the manifest has no file digest of it (and says so).
    let big: Vec<f32> = (0..(17 << 18)).map(|i| (i % 1000) as f32 * 0.5).collect();
    let src = tmp.path().join("big.safetensors");
    write_st(&src, &[("w", big.clone()), ("b", vec![1.0, -2.0])]);
    let mut manifests = Vec::new();
    for threads in ["1", "3"] {
        let dst = tmp.path().join(format!("out{threads}.pt"));
        let out = run(&[
            "convert",
            s(&src),
            "-o",
            s(&dst),
            "--write-manifest",
            "--manifest-algorithm",
            "sha256",
            "--threads",
            threads,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("holds no file digest of"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let m = tmp.path().join(format!("out{threads}.pt.manifest.json"));
        let ok = run(&["verify", s(&dst), "--manifest", s(&m)]);
        assert_eq!(ok.status.code(), Some(0));
        manifests.push(std::fs::read(&m).unwrap());
    }
    assert_eq!(manifests[0], manifests[1]);
    let m: serde_json::Value = serde_json::from_slice(&manifests[0]).unwrap();
    // The digest of the values written into the source, framed as docs/hash.md says.
    let mut h = Hasher::tensor(
        Algorithm::Sha256,
        shardscope_core::DType::Float32,
        &[big.len() as u64],
    );
    for x in &big {
        h.update(&x.to_le_bytes());
    }
    assert_eq!(m["tensors"]["w"]["digest"], h.finish());
    assert_eq!(m["files"], serde_json::json!({}));

    // A manifest already there: refused before anything is written.
    let dst = tmp.path().join("again.pt");
    std::fs::write(tmp.path().join("again.pt.manifest.json"), b"{}").unwrap();
    let out = run(&["convert", s(&src), "-o", s(&dst), "--write-manifest"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("again.pt.manifest.json already exists"));
    assert!(!dst.exists());
    // With --part a process sees only its files: refused.
    let out = run(&[
        "convert",
        s(&src),
        "-o",
        s(&tmp.path().join("d")),
        "--world-size",
        "2",
        "--part",
        "0/2",
        "--write-manifest",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--write-manifest needs the whole output")
    );
}

#[test]
fn a_convert_manifest_finds_a_flipped_byte_in_the_dcp_it_describes() {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("dcp");
    let src = fixtures_dir().join("formats/dcp_torch_save");
    let out = run(&[
        "convert",
        s(&src),
        "-o",
        s(&dst),
        "--world-size",
        "2",
        "--write-manifest",
        "-q",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = dst.join("shardscope.manifest.json");
    assert_eq!(
        run(&["verify", s(&dst), "--manifest", s(&m)]).status.code(),
        Some(0)
    );
    // The largest tensor torch wrote (the expected file) found once in the rank files: flip a byte.
    let expected = std::fs::read(fixtures_dir().join("formats/expected/dcp.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&expected).unwrap();
    let (name, view) = st
        .tensors()
        .into_iter()
        .max_by_key(|(n, v)| (v.data().len(), n.clone()))
        .unwrap();
    // Its last row lies in the last rank's chunk.
    let row = view.data().len() / view.shape()[0];
    let half = &view.data()[view.data().len() - row..];
    let mut flipped = None;
    for f in ["__0_0.distcp", "__1_0.distcp"] {
        let mut bytes = std::fs::read(dst.join(f)).unwrap();
        if let Some(at) = bytes.windows(half.len()).position(|w| w == half) {
            bytes[at + 3] ^= 0x10;
            std::fs::write(dst.join(f), &bytes).unwrap();
            flipped = Some(f);
            break;
        }
    }
    let file = flipped.expect("the tensor's bytes in a rank file");
    let out = run(&["verify", s(&dst), "--manifest", s(&m), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let found = problems(&json(&out));
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, name.replace('/', "."));
    assert!(found[0].2.contains(file), "{}", found[0].2);
}
