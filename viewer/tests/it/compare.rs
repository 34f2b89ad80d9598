//! A/B compare: the viewer compares two torch-written checkpoints with `verify::diff` (the code of
//! `shardscope diff --json`) and shows one row per tensor. Expected verdicts come from torch:
//! `tests/fixtures/dtypes/float8_perturbed.safetensors` is `float8.safetensors` with one element
//! of `float8_e4m3fn` changed by `gen_dtypes.py` (which records where, before and after in
//! `expected.json`); `tests/fixtures/doctor/other_config.pt` is a `Net` variant whose strict
//! `load_state_dict` into `Net` fails with torch's own list of missing, unexpected and
//! size-mismatched keys (`expected.json`), and `bf16.pt` is `clean.pt` in bfloat16.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use serde_json::Value;
use shardscope_viewer::compare::{Comparison, RowStatus};
use shardscope_viewer::{Tab, Viewer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

pub(crate) fn harness(viewer: Viewer) -> Harness<'static, Viewer> {
    Harness::builder()
        .with_size(egui::Vec2::new(1500.0, 1000.0))
        .build_ui_state(|ui, v: &mut Viewer| v.ui(ui), viewer)
}

/// `A --compare B`, run to the end in the test's thread.
fn compare(a: &Path, b: &Path) -> Viewer {
    let mut v = Viewer::new();
    v.loader.synchronous = true;
    v.compare_paths(a, b);
    assert!(!v.comparer.running());
    assert!(v.comparison.is_some(), "no comparison: {:?}", v.messages);
    assert_eq!(v.tab, Tab::Compare);
    v
}

fn rows_with(c: &Comparison, s: RowStatus) -> BTreeSet<String> {
    c.rows
        .iter()
        .filter(|r| r.status == s)
        .map(|r| r.entry.fqn.clone())
        .collect()
}

/// The `shardscope` binary of the same build, when it was built (`cargo build --workspace`, as
/// CI does before the tests); the viewer package alone does not build it.
pub(crate) fn cli() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("shardscope");
    bin.is_file().then_some(bin)
}

/// The rows equal `shardscope diff A B --json`: the same report, entry by entry (run as a
/// process when the CLI is built; otherwise at least the core's diff of the same pair, opened
/// from memory with the same labels).
fn assert_same_as_cli(c: &Comparison, a: &Path, b: &Path) {
    let shown: Vec<Value> = c
        .rows
        .iter()
        .map(|r| serde_json::to_value(&r.entry).unwrap())
        .collect();
    let expected: Value = if let Some(bin) = cli() {
        {
            let out = Command::new(bin)
                .args(["diff", "--json", "--quiet"])
                .arg(a)
                .arg(b)
                .output()
                .unwrap();
            assert!(
                matches!(out.status.code(), Some(0 | 1)),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_slice(&out.stdout).unwrap()
        }
    } else {
        {
            eprintln!("shardscope CLI not built: comparing with core's diff only");
            let open = |p: &Path| {
                let mut mem = shardscope_core::MemorySource::new();
                mem.insert(
                    p.file_name().unwrap().to_str().unwrap().to_owned(),
                    std::fs::read(p).unwrap(),
                );
                let label = p.display().to_string();
                let ck = shardscope_core::checkpoint::Checkpoint::open(
                    &mem,
                    &label,
                    &shardscope_core::checkpoint::ReadOptions::default(),
                )
                .unwrap();
                (mem, ck)
            };
            let ((ma, ca), (mb, cb)) = (open(a), open(b));
            let r = shardscope_core::verify::diff(
                shardscope_core::verify::Side {
                    index: &ca.index,
                    source: &ma,
                    label: &ca.label,
                },
                shardscope_core::verify::Side {
                    index: &cb.index,
                    source: &mb,
                    label: &cb.label,
                },
                &shardscope_core::verify::DiffOptions::default(),
                &mut |_, _, _| {},
            );
            serde_json::from_str(&r.to_json()).unwrap()
        }
    };
    assert_eq!(Value::Array(shown), expected["entries"]);
    assert_eq!(
        serde_json::to_value(&c.report).unwrap(),
        expected,
        "the whole report"
    );
}

#[test]
fn a_float8_element_perturbed_by_torch_is_the_one_difference() {
    let dir = fixtures().join("dtypes");
    let expected: Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let fact = &expected["float8_perturbed"];
    let key = fact["key"].as_str().unwrap();
    let (before, after) = (
        fact["before"].as_f64().unwrap(),
        fact["after"].as_f64().unwrap(),
    );
    let tensors: BTreeSet<String> = expected["float8.safetensors"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let (path_a, path_b) = (
        dir.join("float8.safetensors"),
        dir.join("float8_perturbed.safetensors"),
    );
    let viewer = compare(&path_a, &path_b);
    let c = viewer.comparison.as_ref().unwrap();
    assert_eq!(
        rows_with(c, RowStatus::Differs),
        BTreeSet::from([key.to_owned()])
    );
    let mut equal = tensors.clone();
    equal.remove(key);
    assert_eq!(rows_with(c, RowStatus::Equal), equal);
    let row = c.rows.iter().find(|r| r.entry.fqn == key).unwrap();
    assert_eq!(row.entry.mismatched_elements, Some(1));
    assert_eq!(row.entry.max_abs_diff, Some((after - before).abs()));
    assert_eq!(
        row.entry.max_rel_diff,
        Some((after - before).abs() / after.abs())
    );
    let at = fact["index"].as_u64().unwrap();
    let shape = row.entry.shape.clone().unwrap();
    let flat = row
        .entry
        .first_mismatch
        .as_ref()
        .unwrap()
        .iter()
        .zip(&shape)
        .fold(0, |acc, (i, n)| acc * n + i);
    assert_eq!(flat, at, "torch's flat index");
    assert_same_as_cli(c, &path_a, &path_b);

    // What is drawn: the summary, the differing row, and the filter.
    let total = tensors.len();
    let mut h = harness(viewer);
    h.run();
    h.get_by_label(&format!("{total} tensors: {} equal, 1 differs", total - 1));
    h.get_by_label("differs");
    h.get_by_label("differs (1)");
    h.get_by_label("only differences").click();
    h.run();
    assert!(h.query_by_label(&format!("  {key}")).is_some());
    assert!(
        h.query_by_label("equal").is_none(),
        "equal rows are filtered out"
    );
    h.get_by_label("all").click();
    h.run();
    "e5m2".clone_into(&mut h.state_mut().compare_view.filter.name);
    h.run();
    assert!(h.query_by_label(&format!("  {key}")).is_none());
    assert!(h.query_by_label("  float8_e5m2").is_some());
    h.state_mut().compare_view.filter.name.clear();
    h.run();
    h.get_by_label(&format!("  {key}")).click();
    h.run();
    assert_eq!(h.state().selection.fqn.as_deref(), Some(key));
}

/// torch's strict-load error names `Missing key(s)`, `Unexpected key(s)` and `size mismatch for
/// KEY` lists; returns them.
fn torch_load_error(message: &str) -> [BTreeSet<String>; 3] {
    let quoted = |line: &str| -> BTreeSet<String> {
        line.split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    let mut out = [BTreeSet::new(), BTreeSet::new(), BTreeSet::new()];
    for line in message.lines().map(str::trim) {
        if line.starts_with("Missing key(s)") {
            out[0] = quoted(line);
        } else if line.starts_with("Unexpected key(s)") {
            out[1] = quoted(line);
        } else if let Some(rest) = line.strip_prefix("size mismatch for ") {
            out[2].insert(rest.split(':').next().unwrap().to_owned());
        }
    }
    out
}

#[test]
fn a_model_variant_shows_torchs_missing_unexpected_and_resized_keys() {
    let dir = fixtures().join("doctor");
    let expected: Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    // `Net().load_state_dict(other_config)`: missing = only in A (clean), unexpected = only in B.
    let [missing, unexpected, resized] =
        torch_load_error(expected["other_config.pt"].as_str().unwrap());
    assert!(!missing.is_empty() && !unexpected.is_empty() && !resized.is_empty());
    let (path_a, path_b) = (dir.join("clean.pt"), dir.join("other_config.pt"));
    let viewer = compare(&path_a, &path_b);
    let c = viewer.comparison.as_ref().unwrap();
    assert_eq!(rows_with(c, RowStatus::OnlyA), missing);
    assert_eq!(rows_with(c, RowStatus::OnlyB), unexpected);
    assert_eq!(rows_with(c, RowStatus::Changed), resized);
    let embed = c
        .rows
        .iter()
        .find(|r| r.entry.fqn == "embed.weight")
        .unwrap();
    assert_eq!(embed.shape_text(), "[8, 4] -> [10, 4]");
    assert_same_as_cli(c, &path_a, &path_b);

    // Grouped by module: headers with their counts; a collapsed module hides its rows.
    let mut h = harness(viewer);
    h.run();
    h.get_by_label("block.4");
    h.get_by_label("2 only in B");
    h.get_by_label("norm");
    h.get_by_label("2 only in A");
    assert!(h.query_all_by_label("  weight").count() > 1);
    h.get_by_label("collapse all").click();
    h.run();
    assert_eq!(h.query_all_by_label("  weight").count(), 0);
    h.get_by_label("norm").click();
    h.run();
    assert_eq!(h.query_all_by_label("  weight").count(), 1, "norm's rows");
}

#[test]
fn a_bfloat16_copy_changes_every_dtype() {
    let dir = fixtures().join("doctor");
    let (path_a, path_b) = (dir.join("clean.pt"), dir.join("bf16.pt"));
    let viewer = compare(&path_a, &path_b);
    let c = viewer.comparison.as_ref().unwrap();
    assert!(!c.rows.is_empty());
    for r in &c.rows {
        assert_eq!(r.status, RowStatus::Changed, "{}", r.entry.fqn);
        assert_eq!(r.dtype_text(), "float32 -> bfloat16");
    }
    assert_same_as_cli(c, &path_a, &path_b);
}

#[test]
fn compare_with_picks_b_for_the_opened_checkpoint_and_runs_off_the_ui_thread() {
    let dir = fixtures().join("doctor");
    let mut v = Viewer::new();
    v.open_path(dir.join("clean.pt"));
    let mut h = harness(v);
    // The loader and the comparison run on worker threads; frames keep coming meanwhile.
    let deadline = std::time::Instant::now() + std::time::Duration::from_mins(1);
    while h.state().checkpoint.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            h.state().messages
        );
        h.step();
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    h.get_by_label("Compare with...");
    h.state_mut()
        .compare_with_path(&dir.join("other_config.pt"));
    let mut frames = 0;
    while h.state().comparison.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            h.state().messages
        );
        h.step();
        frames += 1;
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(frames >= 1);
    h.run();
    let c = h.state().comparison.clone().unwrap();
    assert_eq!(c.left, dir.join("clean.pt").display().to_string());
    // The same verdicts as `A --compare B`.
    let direct = compare(&dir.join("clean.pt"), &dir.join("other_config.pt"));
    assert_eq!(c.rows, direct.comparison.unwrap().rows);
    h.get_by_label(&c.summary());
}

/// The desktop binary under Xvfb (`web/tests/desktop_screenshot.sh`, run from the repository root,
/// so the paths it shows are relative) with `args`; the screenshot is copied to the file `env`
/// names when it is set (`docs/img/...`). Skipped where Xvfb is missing. One at a time: the
/// script picks a free display number, which two at once could both pick.
pub(crate) fn screenshot(args: &[&str], env: &str) {
    static XVFB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = XVFB
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if Command::new("Xvfb").arg("-help").output().is_err() {
        eprintln!("Xvfb missing: no screenshot");
        return;
    }
    let out = std::env::temp_dir().join(format!("shardscope-{env}-{}.png", std::process::id()));
    let run = Command::new("bash")
        .arg(root.join("web/tests/desktop_screenshot.sh"))
        .arg(&out)
        .arg(env!("CARGO_BIN_EXE_shardscope-viewer"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "desktop_screenshot.sh {args:?}: {}\n{}{}",
        run.status,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    eprint!("{}", String::from_utf8_lossy(&run.stdout));
    assert!(std::fs::metadata(&out).unwrap().len() > 10_000);
    if let Ok(dest) = std::env::var(env) {
        std::fs::copy(&out, dest).unwrap();
    }
    let _ = std::fs::remove_file(&out);
}

/// The compare view (`A --compare B`) of torch's pair (`viewer/tests/fixtures/compare`: a DCP
/// and an edited `torch.save` copy): `docs/img/compare.png` with `SHARDSCOPE_DOCS_SCREENSHOT`.
#[test]
fn screenshot_of_the_compare_view() {
    let dir = "viewer/tests/fixtures/compare";
    screenshot(
        &[&format!("{dir}/a_dcp"), "--compare", &format!("{dir}/b.pt")],
        "SHARDSCOPE_DOCS_SCREENSHOT",
    );
}

/// The Values heatmap (`--tab values`) of `viewer/tests/fixtures/compare/a.pt` (a NaN in layer 3,
/// layer 4 fifty times larger): `docs/img/values.png` with `SHARDSCOPE_DOCS_VALUES_SCREENSHOT`.
#[test]
fn screenshot_of_the_values_heatmap() {
    screenshot(
        &["--tab", "values", "viewer/tests/fixtures/compare/a.pt"],
        "SHARDSCOPE_DOCS_VALUES_SCREENSHOT",
    );
}

/// Values: statistics equal torch's own for every dtype it saves (`gen_dtypes.py` wrote count,
/// min, max, mean, NaN and infinity counts of each tensor of `all_dtypes.pt`).
#[test]
fn values_match_torchs_statistics() {
    let dir = fixtures().join("dtypes");
    let expected: Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let mut viewer = Viewer::new();
    viewer.loader.synchronous = true;
    viewer.open_path(dir.join("all_dtypes.pt"));
    assert_eq!(viewer.poll_loader(), 0);
    viewer.compute_values();
    let map = viewer
        .values
        .as_ref()
        .unwrap_or_else(|| panic!("{:?}", viewer.messages));
    let torch = expected["all_dtypes.pt"].as_object().unwrap();
    assert_eq!(
        map.tensors.keys().collect::<BTreeSet<_>>(),
        torch.keys().collect::<BTreeSet<_>>()
    );
    for (key, t) in torch {
        let s = map.tensors[key].stats.as_ref().unwrap();
        assert_eq!(s.count, t["count"].as_u64().unwrap(), "{key}");
        assert_eq!(s.nan, t["nan"].as_u64().unwrap(), "{key}");
        assert_eq!(s.inf, t["inf"].as_u64().unwrap(), "{key}");
        let close = |a: Option<f64>, b: &Value| {
            let b = b.as_f64().unwrap();
            (a.unwrap() - b).abs() <= 1e-9 * b.abs().max(1.0)
        };
        assert!(close(s.min, &t["min"]), "{key} min");
        assert!(close(s.max, &t["max"]), "{key} max");
        assert!(close(s.mean, &t["mean"]), "{key} mean");
    }
    let mut h = harness(viewer);
    h.run();
    assert_eq!(h.state().tab, Tab::Values);
    h.get_by_label_contains("with NaN or infinity");
}

/// A safetensors file of `model.layers.{0..4}` blocks with a NaN in one layer's weight.
fn layers_with_a_nan(nan_layer: usize) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for layer in 0..4 {
        for (name, numel) in [
            ("attn.weight", 6usize),
            ("mlp.weight", 4),
            ("norm.weight", 2),
        ] {
            let start = data.len();
            for i in 0..numel {
                #[allow(clippy::cast_precision_loss)]
                let mut v = (layer * 10 + i) as f32 * 0.01;
                if layer == nan_layer && name == "mlp.weight" && i == 1 {
                    v = f32::NAN;
                }
                data.extend_from_slice(&v.to_le_bytes());
            }
            header.insert(
                format!("model.layers.{layer}.{name}"),
                serde_json::json!({"dtype": "F32", "shape": [numel], "data_offsets": [start, data.len()]}),
            );
        }
    }
    let header = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

#[test]
fn values_heatmap_lays_layers_out_and_a_nan_stands_out() {
    let mut viewer = Viewer::new();
    viewer.loader.synchronous = true;
    viewer.open_bytes("layers.safetensors", layers_with_a_nan(2));
    assert_eq!(viewer.poll_loader(), 0);
    viewer.compute_values();
    let map = viewer.values.clone().unwrap();
    let g = &map.grids[0];
    assert_eq!(g.list, "model.layers");
    assert_eq!(g.layers, [0, 1, 2, 3]);
    assert_eq!(g.columns, ["attn.weight", "mlp.weight", "norm.weight"]);
    let bad: Vec<&str> = g
        .cells
        .iter()
        .flatten()
        .flatten()
        .filter(|c| c.non_finite() > 0)
        .map(|c| c.fqn.as_str())
        .collect();
    assert_eq!(bad, ["model.layers.2.mlp.weight"]);
    let mut h = harness(viewer);
    h.run();
    h.get_by_label("NaN/inf in:");
    h.get_by_label_contains("1 with NaN or infinity");
    // Every cell is a button named by its tensor; clicking selects it.
    h.get_by_label("model.layers.3.attn.weight").click();
    h.run();
    assert_eq!(
        h.state().selection.fqn.as_deref(),
        Some("model.layers.3.attn.weight")
    );
}
