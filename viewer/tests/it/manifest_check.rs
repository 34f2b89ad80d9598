//! A checkpoint checked against a content manifest in the viewer (issue 37): the manifest's
//! digests are computed by torch's side (`tests/fixtures/torch_manifest.py`: what torch loads from
//! `examples/fsdp2_dcp`, DCP's own flattening, docs/hash.md's framing, hashlib's SHA-256). Opened
//! with a copy of the DCP (either first), every key matches; with one byte of a tensor flipped in
//! the copy, that tensor alone is named, with the chunk and the file's byte range holding it.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_viewer::Tab;
use shardscope_viewer::app::Viewer;
use shardscope_viewer::checkpoint::FsSource;
use shardscope_viewer::report::Status;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Opens `first` then `second` (paths) in a synchronous viewer.
fn open(first: &Path, second: &Path) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    for p in [first, second] {
        v.loader.open_path(p.to_path_buf());
        while v.poll_loader() > 0 {}
    }
    v
}

#[test]
fn a_checkpoint_is_checked_against_a_manifest_of_torchs_digests() {
    let Some(python) = shardscope_tests::torch_python() else {
        eprintln!("skipped: no Python with torch (SHARDSCOPE_PYTHON)");
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_manifest.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg("-")
        .arg(work.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest = work.path().join("manifest.json");
    let ck = work.path().join("ck");
    copy_dir(&root().join("examples/fsdp2_dcp"), &ck);

    let v = open(&ck, &manifest);
    let report = v
        .report
        .as_ref()
        .unwrap_or_else(|| panic!("{:?}", v.messages));
    assert_eq!(v.tab, Tab::Verify);
    assert_eq!(report.entries.len(), 77, "{:?}", v.messages);
    let problems: Vec<_> = report
        .entries
        .iter()
        .filter(|e| e.status.is_problem())
        .collect();
    assert!(problems.is_empty(), "{problems:?}");

    // One byte of one tensor's stored bytes flipped (where the index places that chunk).
    let key = "model.embed.weight";
    let fs = FsSource::from_dir(&ck).unwrap();
    let opened = Checkpoint::open(&fs, "ck", &ReadOptions::default()).unwrap();
    let e = opened.index.entry(key).unwrap();
    let at = opened.index.locate_chunk(&fs, e, &e.chunks[0]).unwrap();
    let file = ck.join(&at.file);
    let mut bytes = std::fs::read(&file).unwrap();
    let i = usize::try_from(at.storage_byte_offset).unwrap() + 5;
    bytes[i] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    // The manifest opened first this time.
    let v = open(&manifest, &ck);
    let report = v
        .report
        .as_ref()
        .unwrap_or_else(|| panic!("{:?}", v.messages));
    let problems: Vec<_> = report
        .entries
        .iter()
        .filter(|e| e.status.is_problem())
        .collect();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].fqn, key);
    assert_eq!(problems[0].status, Status::Mismatch);
    let message = problems[0].message.as_deref().unwrap_or_default();
    assert!(
        message.contains(&format!("{} bytes", at.file)),
        "the message does not name the file and bytes: {message}"
    );
}

/// A manifest that does not read is an error naming it and saying why, and nothing is checked:
/// an unknown algorithm, another version, a manifest cut short (not JSON any more).
#[test]
fn a_bad_manifest_is_refused_with_the_reason() {
    let work = tempfile::tempdir().unwrap();
    let good = r#"{"version": 1, "algorithm": "sha256", "tensors": {}, "values": {}, "files": {}}"#;
    for (text, why) in [
        (good.replace("sha256", "md5"), "unknown algorithm `md5`"),
        (
            good.replace("\"version\": 1", "\"version\": 2"),
            "manifest version 2",
        ),
        (
            good[..good.len() - 20].to_owned(),
            "not a shardscope manifest: EOF",
        ),
    ] {
        let path = work.path().join("m.json");
        std::fs::write(&path, &text).unwrap();
        let v = open(&root().join("examples/fsdp2_dcp"), &path);
        assert!(v.report.is_none(), "{text}");
        let said = v.messages.join("\n");
        assert!(
            said.contains("m.json: a content manifest") && said.contains(why),
            "{text}: {said}"
        );
    }
}

/// A checkpoint view as the browser builds it from its lazily read files: no file origin to
/// read again (the front end holds the files).
fn view_without_origin(dir: &Path) -> shardscope_viewer::checkpoint::CheckpointView {
    let fs = FsSource::from_dir(dir).unwrap();
    let ckpt = Checkpoint::open(&fs, "fsdp2_dcp", &ReadOptions::default()).unwrap();
    let derived = shardscope_viewer::checkpoint::CheckpointView::derive_model(&ckpt, &fs);
    let view =
        shardscope_viewer::checkpoint::CheckpointView::from_checkpoint_derived(ckpt, derived, &fs)
            .unwrap();
    assert!(view.origin.is_none());
    view
}

/// Where the front end runs the check itself (the browser: `manifest_check::External`), a
/// checkpoint without a file origin and a manifest, either first, make one request naming both,
/// and the front end's finished check is shown as the desktop's is; elsewhere a note says the
/// check needs the checkpoint's files.
#[test]
fn the_front_end_is_asked_to_check_a_checkpoint_it_reads_itself() {
    let dir = root().join("examples/fsdp2_dcp");
    let manifest =
        br#"{"version": 1, "algorithm": "xxh3-128", "tensors": {}, "values": {}, "files": {}}"#;
    let open_checkpoint = |v: &mut Viewer| {
        v.open_document(Ok(shardscope_viewer::docs::Document::Checkpoint(Box::new(
            view_without_origin(&dir),
        ))));
    };
    let open_manifest = |v: &mut Viewer| {
        v.open_bytes("m.json", manifest.to_vec());
        while v.poll_loader() > 0 {}
    };
    for manifest_first in [false, true] {
        let mut v = Viewer::new();
        v.loader.synchronous = true;
        v.manifest_job.external.enabled = true;
        if manifest_first {
            open_manifest(&mut v);
            assert!(v.manifest_job.external.request.is_none());
            open_checkpoint(&mut v);
        } else {
            open_checkpoint(&mut v);
            open_manifest(&mut v);
        }
        let request = v
            .manifest_job
            .external
            .request
            .take()
            .unwrap_or_else(|| panic!("{:?}", v.messages));
        assert_eq!(request.checkpoint, "fsdp2_dcp");
        assert_eq!(request.manifest.name, "m.json");
        assert!(v.report.is_none());
        let report = shardscope_viewer::report::Report::from_json_bytes(
            br#"{"kind": "shardscope.verify", "version": 1, "entries": [{"fqn": "w", "status": "mismatch", "message": "the values differ"}]}"#,
            "fsdp2_dcp against m.json",
        )
        .unwrap();
        v.take_manifest_check(Ok(report));
        assert_eq!(v.tab, Tab::Verify);
        assert!(v.verify.only_problems);
        assert_eq!(v.report.as_ref().unwrap().entries[0].fqn, "w");
    }
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    open_checkpoint(&mut v);
    open_manifest(&mut v);
    assert!(v.manifest_job.external.request.is_none());
    assert!(v.report.is_none());
    assert!(
        v.messages
            .iter()
            .any(|m| m.contains("reads only a checkpoint's metadata here")),
        "{:?}",
        v.messages
    );
}
