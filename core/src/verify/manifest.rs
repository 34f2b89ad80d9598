//! [`compare_manifests`]: two content manifests ([`crate::manifest`]) compared key by key, as
//! `verify --manifest` and `diff` with a manifest on a side report them.

use std::collections::BTreeSet;

use super::{Entry, Report, Status};
use crate::manifest::{ChunkDigest, Manifest, StoredAt, TensorDigest};

/// Compares `left` (the reference: a manifest written earlier) with `right` (usually the manifest
/// of the checkpoint at hand, whose chunks know where they are stored). A key only on the left is
/// `missing`, only on the right `unexpected`; a tensor whose dtype, shape or digest differs is a
/// `mismatch` whose message names the chunks that differ (file and byte range), or where the
/// tensor is stored when the two sides chunk it differently; a key that could not be read is a
/// `mismatch` too ("cannot be read: …"). Files whose size or digest differ are notes: the verdict
/// is the tensors'. Both manifests must use one algorithm (the caller checks).
pub fn compare_manifests(
    left: (&Manifest, &str),
    right: (&Manifest, &str),
    command: &'static str,
) -> Report {
    let (lm, rm) = (left.0, right.0);
    let mut report = Report::new(command, Some(left.1.to_owned()), Some(right.1.to_owned()));
    let keys: BTreeSet<&String> = lm
        .tensors
        .keys()
        .chain(lm.values.keys())
        .chain(rm.tensors.keys())
        .chain(rm.values.keys())
        .chain(lm.errors.keys())
        .chain(rm.errors.keys())
        .collect();
    for key in keys {
        let mut e = Entry::new(key, Status::Match);
        let in_left = lm.tensors.contains_key(key)
            || lm.values.contains_key(key)
            || lm.errors.contains_key(key);
        let in_right = rm.tensors.contains_key(key)
            || rm.values.contains_key(key)
            || rm.errors.contains_key(key);
        if let Some(t) = lm.tensors.get(key).or_else(|| rm.tensors.get(key)) {
            e.dtype = t.dtype.parse().ok();
            e.shape = Some(t.shape.clone());
        }
        if !in_right {
            e.add_problem(Status::Missing, &format!("not in {}", right.1));
        } else if !in_left {
            e.add_problem(Status::Unexpected, &format!("not in {}", left.1));
        } else if let Some(why) = lm.errors.get(key) {
            e.add_problem(
                Status::Mismatch,
                &format!("{}: cannot be read: {why}", left.1),
            );
        } else if let Some(why) = rm.errors.get(key) {
            e.add_problem(
                Status::Mismatch,
                &format!("{}: cannot be read: {why}", right.1),
            );
        } else {
            match (lm.tensors.get(key), rm.tensors.get(key)) {
                (Some(a), Some(b)) => compare_tensors(&mut e, a, b),
                (None, None) => {
                    if lm.values.get(key) != rm.values.get(key) {
                        e.add_problem(Status::Mismatch, "the values differ");
                    }
                }
                (a, _) => {
                    let what = |t: bool| if t { "a tensor" } else { "a non-tensor value" };
                    e.add_problem(
                        Status::Mismatch,
                        &format!(
                            "{} on the left, {} on the right",
                            what(a.is_some()),
                            what(a.is_none())
                        ),
                    );
                }
            }
        }
        report.insert(e);
    }
    compare_files(lm, rm, &mut report);
    report.finish();
    report
}

fn compare_tensors(e: &mut Entry, a: &TensorDigest, b: &TensorDigest) {
    if a.dtype != b.dtype {
        e.right_dtype = b.dtype.parse().ok();
        e.add_problem(
            Status::Mismatch,
            &format!("dtype {} vs {}", a.dtype, b.dtype),
        );
    }
    if a.shape != b.shape {
        e.right_shape = Some(b.shape.clone());
        e.add_problem(
            Status::Mismatch,
            &format!("shape {:?} vs {:?}", a.shape, b.shape),
        );
    }
    if e.status != Status::Match || a.digest == b.digest {
        return;
    }
    // Chunks of the same box on both sides: name those that differ.
    let same_box = |x: &ChunkDigest, y: &ChunkDigest| x.offsets == y.offsets && x.sizes == y.sizes;
    let differing: Vec<String> = b
        .chunks
        .iter()
        .filter_map(|cb| {
            let ca = a.chunks.iter().find(|ca| same_box(ca, cb))?;
            (ca.digest != cb.digest).then(|| chunk_text(cb, ca.stored.as_ref()))
        })
        .collect();
    let message = if differing.is_empty() {
        let stored: Vec<String> = b
            .chunks
            .iter()
            .chain(&a.chunks)
            .filter_map(|c| c.stored.as_ref().map(ToString::to_string))
            .collect();
        if stored.is_empty() {
            "the values differ".to_owned()
        } else {
            format!("the values differ (stored in {})", stored.join(", "))
        }
    } else {
        format!("the values differ in {}", differing.join(", "))
    };
    e.add_problem(Status::Mismatch, &message);
}

/// `the chunk at [o] of [s] (FILE bytes a..b)`.
fn chunk_text(c: &ChunkDigest, other: Option<&StoredAt>) -> String {
    let place = c.stored.as_ref().or(other);
    match place {
        Some(p) => format!("the chunk at {:?} of {:?} ({p})", c.offsets, c.sizes),
        None => format!("the chunk at {:?} of {:?}", c.offsets, c.sizes),
    }
}

fn compare_files(l: &Manifest, r: &Manifest, report: &mut Report) {
    // Files are compared when both sides list them (a manifest of one checkpoint against the
    // files of another serialization would differ everywhere).
    if l.files.is_empty() || r.files.is_empty() {
        return;
    }
    let names: BTreeSet<&String> = l.files.keys().chain(r.files.keys()).collect();
    let shared = names
        .iter()
        .filter(|n| l.files.contains_key(**n) && r.files.contains_key(**n))
        .count();
    if shared == 0 {
        report
            .notes
            .push("no file names in common: files not compared".to_owned());
        return;
    }
    for name in names {
        match (l.files.get(name), r.files.get(name)) {
            (Some(a), Some(b)) if a.size != b.size => report.notes.push(format!(
                "file {name}: {} bytes, {} expected",
                b.size, a.size
            )),
            (Some(a), Some(b)) if a.digest != b.digest => {
                report.notes.push(format!("file {name}: its bytes differ"));
            }
            (Some(_), None) => report.notes.push(format!("file {name}: missing")),
            (None, Some(_)) => report
                .notes
                .push(format!("file {name}: not in the manifest")),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Algorithm, ValueDigest, digest};

    fn tensor(d: &str, chunks: &[(&str, u64)]) -> TensorDigest {
        TensorDigest {
            dtype: "float32".into(),
            shape: vec![4, 2],
            digest: digest(Algorithm::Xxh3, d.as_bytes()),
            chunks: chunks
                .iter()
                .map(|&(c, row)| ChunkDigest {
                    offsets: vec![row, 0],
                    sizes: vec![2, 2],
                    digest: digest(Algorithm::Xxh3, c.as_bytes()),
                    stored: Some(StoredAt {
                        file: format!("f{row}"),
                        start: row * 8,
                        end: row * 8 + 16,
                    }),
                })
                .collect(),
        }
    }

    #[test]
    fn names_differing_chunks_missing_and_extra_keys() {
        let mut a = Manifest::new(Algorithm::Xxh3);
        a.tensors
            .insert("w".into(), tensor("w", &[("c0", 0), ("c1", 2)]));
        a.tensors.insert("gone".into(), tensor("g", &[]));
        a.values.insert(
            "step".into(),
            ValueDigest {
                digest: digest(Algorithm::Xxh3, b"1"),
            },
        );
        let mut b = a.clone();
        b.tensors.remove("gone");
        b.tensors.insert("new".into(), tensor("n", &[]));
        b.tensors
            .insert("w".into(), tensor("w2", &[("c0", 0), ("c1x", 2)]));
        b.values.get_mut("step").unwrap().digest = digest(Algorithm::Xxh3, b"2");
        let report = compare_manifests((&a, "M"), (&b, "CKPT"), "verify");
        let status = |k: &str| report.entries[k].status;
        assert_eq!(status("gone"), Status::Missing);
        assert_eq!(status("new"), Status::Unexpected);
        assert_eq!(status("step"), Status::Mismatch);
        assert_eq!(status("w"), Status::Mismatch);
        let m = report.entries["w"].message.clone().unwrap();
        assert!(
            m.contains("the chunk at [2, 0] of [2, 2] (f2 bytes 16..32)"),
            "{m}"
        );
        assert!(!m.contains("f0"), "{m}");
        assert_eq!(report.exit_code(), 1);

        let same = compare_manifests((&a, "M"), (&a, "CKPT"), "verify");
        assert_eq!(same.exit_code(), 0);
        assert_eq!(same.summary.matched, 3);
    }

    #[test]
    fn unreadable_keys_and_shapes_are_mismatches() {
        let mut a = Manifest::new(Algorithm::Sha256);
        a.tensors.insert("w".into(), tensor("w", &[]));
        a.tensors.insert("v".into(), tensor("v", &[]));
        let mut b = a.clone();
        b.tensors.remove("w");
        b.errors.insert("w".into(), "f0: file too short".into());
        b.tensors.get_mut("v").unwrap().shape = vec![8];
        let report = compare_manifests((&a, "M"), (&b, "CKPT"), "verify");
        assert_eq!(report.entries["w"].status, Status::Mismatch);
        assert!(
            report.entries["w"]
                .message
                .as_ref()
                .unwrap()
                .contains("cannot be read: f0: file too short")
        );
        assert!(
            report.entries["v"]
                .message
                .as_ref()
                .unwrap()
                .contains("shape [4, 2] vs [8]")
        );
        assert_eq!(report.exit_code(), 1);
    }
}
