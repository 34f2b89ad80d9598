//! The compare view's tolerance controls: at every tolerance the rows equal `shardscope diff
//! --json` with the same `--rtol`/`--atol`/`--equal-nan`. The pair is torch's
//! (`viewer/tests/fixtures/compare/gen_compare.py`): `a_dcp/` is `dcp.save` of a state dict and
//! `b.pt` that state dict edited by torch (a weight within `torch.allclose`'s default tolerance,
//! one 0.01 off, an int64 +1, a NaN kept, a bias resized, a key dropped and one added).
#![allow(clippy::unwrap_used)]
#![allow(
    clippy::float_cmp,
    reason = "the values parsed from the fields are compared exactly"
)]

use std::path::{Path, PathBuf};
use std::process::Command;

use egui_kittest::kittest::Queryable;
use serde_json::Value;
use shardscope_core::verify::Tolerance;
use shardscope_viewer::Viewer;
use shardscope_viewer::compare::{RowStatus, tolerance_flags};

use super::compare::{cli, harness};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compare")
}

/// `shardscope diff --json [flags] A B` (the CLI of this build; else the core's diff with the
/// same options, the code the CLI runs).
fn diff_json(a: &Path, b: &Path, tolerance: Option<Tolerance>) -> Value {
    let flags = tolerance_flags(tolerance);
    if let Some(bin) = cli() {
        let out = Command::new(bin)
            .args(["diff", "--json", "--quiet"])
            .args(flags.split_whitespace())
            .arg(a)
            .arg(b)
            .output()
            .unwrap();
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return serde_json::from_slice(&out.stdout).unwrap();
    }
    eprintln!("shardscope CLI not built: comparing with core's diff only");
    let open = |p: &Path| {
        let source = shardscope_viewer::checkpoint::Origin::from_path(p)
            .unwrap()
            .source()
            .unwrap();
        let label = p.display().to_string();
        let ck = shardscope_core::checkpoint::Checkpoint::open(
            &*source,
            &label,
            &shardscope_core::checkpoint::ReadOptions::default(),
        )
        .unwrap();
        (source, ck)
    };
    let ((sa, ca), (sb, cb)) = (open(a), open(b));
    let r = shardscope_core::verify::diff(
        shardscope_core::verify::Side {
            index: &ca.index,
            source: &*sa,
            label: &ca.label,
        },
        shardscope_core::verify::Side {
            index: &cb.index,
            source: &*sb,
            label: &cb.label,
        },
        &shardscope_core::verify::DiffOptions {
            tolerance,
            select: None,
            cast: None,
        },
        &mut |_, _, _| {},
    );
    serde_json::from_str(&r.to_json()).unwrap()
}

fn status_of(v: &Viewer, fqn: &str) -> RowStatus {
    v.comparison
        .as_ref()
        .unwrap()
        .rows
        .iter()
        .find(|r| r.entry.fqn == fqn)
        .unwrap()
        .status
}

fn assert_same_as_cli(v: &Viewer, a: &Path, b: &Path) {
    let c = v.comparison.as_ref().unwrap();
    let expected = diff_json(a, b, v.comparer.tolerance);
    let rows: Vec<Value> = c
        .rows
        .iter()
        .map(|r| serde_json::to_value(&r.entry).unwrap())
        .collect();
    assert_eq!(
        Value::Array(rows),
        expected["entries"],
        "rows at {:?}",
        v.comparer.tolerance
    );
    assert_eq!(serde_json::to_value(&c.report).unwrap(), expected);
}

#[test]
fn rows_at_each_tolerance_equal_diff_with_the_same_flags() {
    let (a_dcp, b_pt) = (fixtures().join("a_dcp"), fixtures().join("b.pt"));
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.compare_paths(&a_dcp, &b_pt);
    assert!(v.comparison.is_some(), "{:?}", v.messages);
    assert_same_as_cli(&v, &a_dcp, &b_pt);
    // Bitwise: the weight torch moved by one ulp differs; the NaN it kept is equal.
    assert_eq!(
        status_of(&v, "model.layers.0.attn.weight"),
        RowStatus::Differs
    );
    assert_eq!(status_of(&v, "model.layers.3.mlp.weight"), RowStatus::Equal);

    // The tolerance checkbox (torch.allclose's defaults) compares again at once.
    let mut h = harness(v);
    h.run();
    h.get_by_label("as shardscope diff (bitwise)");
    h.get_by_label("tolerance").click();
    h.run();
    let tol = h.state().comparer.tolerance.unwrap();
    assert_eq!((tol.rtol, tol.atol, tol.equal_nan), (1e-5, 1e-8, false));
    h.get_by_label("as shardscope diff --rtol 0.00001 --atol 0.00000001");
    assert_same_as_cli(h.state(), &a_dcp, &b_pt);
    assert_eq!(
        status_of(h.state(), "model.layers.0.attn.weight"),
        RowStatus::Equal
    );
    // NaN is not close to NaN (torch.allclose), unless equal_nan.
    assert_eq!(
        status_of(h.state(), "model.layers.3.mlp.weight"),
        RowStatus::Differs
    );
    assert_eq!(
        status_of(h.state(), "model.layers.1.mlp.weight"),
        RowStatus::Differs
    );

    // atol 0.1 (set in the field, as assistive technology types), then equal NaN (its checkbox).
    let atol = h.get_by_label("atol");
    atol.set_text_value_accesskit("0.1");
    h.run();
    assert_eq!(h.state().comparer.tolerance_input.atol, "0.1");
    assert_eq!(h.state().comparer.tolerance.unwrap().atol, 0.1);
    assert_same_as_cli(h.state(), &a_dcp, &b_pt);
    assert_eq!(
        status_of(h.state(), "model.layers.1.mlp.weight"),
        RowStatus::Equal
    );
    // Integers are compared exactly whatever the tolerance.
    assert_eq!(status_of(h.state(), "model.step"), RowStatus::Differs);
    h.get_by_label("equal NaN").click();
    h.run();
    assert!(h.state().comparer.tolerance.unwrap().equal_nan);
    assert_same_as_cli(h.state(), &a_dcp, &b_pt);
    assert_eq!(
        status_of(h.state(), "model.layers.3.mlp.weight"),
        RowStatus::Equal
    );

    // A value diff does not accept is refused, saying why, and compares nothing.
    let rtol = h.get_by_label("rtol");
    rtol.set_text_value_accesskit("-1");
    h.run();
    h.get_by_label_contains("rtol must be a finite number, not negative");
    assert_eq!(h.state().comparer.tolerance.unwrap().rtol, 1e-5);

    // Off again: bitwise, as at first.
    h.get_by_label("tolerance").click();
    h.run();
    assert_eq!(h.state().comparer.tolerance, None);
    assert_same_as_cli(h.state(), &a_dcp, &b_pt);
}
