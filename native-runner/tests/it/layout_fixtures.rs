//! Our layout engine against real PyTorch: every case folder under `tests/fixtures/layout/` (written by
//! `gen_layout.py` with torch 2.15 on CPU) is checked field by field, every rank, and the per-rank
//! shard bytes torch held are rebuilt from the full parameters and our layout, bit for bit.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::SafeTensors;
use serde_json::Value;
use shardscope_core::DType;
use shardscope_core::layout::fsdp1::PieceKind;
use shardscope_core::layout::{self, Fsdp1Layout, Fsdp2Layout, Layout, LayoutConfig};
use shardscope_core::model::ModelDescription;

fn layout_fixtures_dir() -> PathBuf {
    shardscope_tests::fixtures_dir().join("layout")
}

/// Every case folder (one with a `case.json`), sorted; panics when there is none.
fn case_dirs() -> Vec<PathBuf> {
    let dir = layout_fixtures_dir();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").is_file())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "no layout fixture cases found in {}",
        dir.display()
    );
    dirs
}

struct Case {
    name: String,
    dir: PathBuf,
    settings: Value,
    model: ModelDescription,
    config: LayoutConfig,
}

fn read_json(path: &Path) -> Value {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: bad JSON: {e}", path.display()))
}

fn load_case(dir: &Path) -> Case {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let case = read_json(&dir.join("case.json"));
    let model_path = dir.join("model.json");
    let model_bytes = std::fs::read(&model_path).unwrap();
    let model = ModelDescription::from_json_bytes(&model_bytes, &model_path.display().to_string())
        .unwrap_or_else(|e| panic!("{name}: model.json rejected: {e}"));
    let config = LayoutConfig {
        api: case["api"].as_str().unwrap().parse().unwrap(),
        world_size: case["world_size"].as_u64().unwrap(),
        shard_group_size: case["shard_group_size"].as_u64(),
        use_orig_params: case["use_orig_params"].as_bool().unwrap(),
        strategy: case["strategy"].as_str().unwrap().parse().unwrap(),
        param_dtype: case["param_dtype"]
            .as_str()
            .map(|s| s.parse::<DType>().unwrap()),
    };
    Case {
        name,
        dir: dir.to_owned(),
        settings: case,
        model,
        config,
    }
}

/// Collects mismatches so one run reports all of them.
#[derive(Default)]
struct Diffs(String);

impl Diffs {
    fn eq(&mut self, what: &str, ours: &Value, torch: &Value) {
        if ours != torch {
            let _ = writeln!(self.0, "  {what}: ours {ours} != torch {torch}");
        }
    }

    fn check(&mut self, what: &str, ok: bool, detail: &str) {
        if !ok {
            let _ = writeln!(self.0, "  {what}: {detail}");
        }
    }

    fn finish(self, case: &str) {
        assert!(
            self.0.is_empty(),
            "case {case}: our layout differs from torch:\n{}",
            self.0
        );
    }
}

fn unit_label(prefix: &Value) -> String {
    match prefix.as_str() {
        Some("") => "(root)".to_owned(),
        Some(p) => p.to_owned(),
        None => prefix.to_string(),
    }
}

/// FSDP1 flat-parameter fields whose value is the same on every rank.
const FSDP1_FIELDS: [&str; 14] = [
    "unit_prefix",
    "flat_param_fqn",
    "dtype",
    "requires_grad",
    "aligned_numel",
    "fqns",
    "shapes",
    "numels",
    "shared_params",
    "numels_with_padding",
    "is_padding_mask",
    "unpadded_unsharded_numel",
    "padded_unsharded_numel",
    "sharded_numel",
];

/// Compares our FSDP1 layout (as `layout --json` prints it) with every rank's view in expected.json.
fn compare_fsdp1(case: &str, ours: &Value, expected: &Value, diffs: &mut Diffs) {
    let group = ours["shard_group_size"].as_u64().unwrap();
    let strategy = ours["strategy"].as_str().unwrap();
    let ours_flat = ours["flat_params"].as_array().unwrap();
    for torch_rank in expected["ranks"].as_array().unwrap() {
        let rank = torch_rank["rank"].as_u64().unwrap();
        // Hybrid groups are blocks of consecutive ranks; NO_SHARD's handle group is the whole world.
        let shard_rank = if strategy == "no_shard" {
            rank
        } else {
            rank % group
        };
        diffs.eq(
            &format!("rank {rank}: shard-group rank"),
            &Value::from(shard_rank),
            &torch_rank["shard_rank"],
        );
        diffs.eq(
            &format!("rank {rank}: units_without_params"),
            &ours["units_without_params"],
            &torch_rank["units_without_params"],
        );
        let torch_flat = torch_rank["flat_params"].as_array().unwrap();
        let ours_units: Vec<&Value> = ours_flat.iter().map(|f| &f["unit_prefix"]).collect();
        let torch_units: Vec<&Value> = torch_flat.iter().map(|f| &f["unit_prefix"]).collect();
        if ours_units != torch_units {
            diffs.check(
                &format!("rank {rank}: flat parameters (units, in order)"),
                false,
                &format!("ours {ours_units:?} != torch {torch_units:?}"),
            );
            continue;
        }
        for (o, t) in ours_flat.iter().zip(torch_flat) {
            let unit = unit_label(&t["unit_prefix"]);
            for field in FSDP1_FIELDS {
                diffs.eq(
                    &format!("unit {unit}, rank {rank}, {field}"),
                    &o[field],
                    &t[field],
                );
            }
            let ranks = o["ranks"].as_array().unwrap();
            diffs.eq(
                &format!("unit {unit}, rank {rank}, handle world size"),
                &Value::from(ranks.len()),
                &t["handle_world_size"],
            );
            let Some(o_rank) = ranks.get(shard_rank as usize) else {
                diffs.check(
                    &format!("unit {unit}, rank {rank}"),
                    false,
                    "we have no such rank",
                );
                continue;
            };
            diffs.eq(
                &format!("unit {unit}, rank {rank}, shard_numel_padded"),
                &o_rank["shard_numel_padded"],
                &t["shard_numel_padded"],
            );
            let o_infos = o_rank["shard_param_infos"].as_array().unwrap();
            let t_infos = t["shard_param_infos"].as_array().unwrap();
            diffs.eq(
                &format!("unit {unit}, rank {rank}, number of shard_param_infos"),
                &Value::from(o_infos.len()),
                &Value::from(t_infos.len()),
            );
            for (i, (oi, ti)) in o_infos.iter().zip(t_infos).enumerate() {
                let fqn = t["fqns"][i].as_str().unwrap_or("?");
                for field in [
                    "in_shard",
                    "offset_in_shard",
                    "numel_in_shard",
                    "intra_param_start_idx",
                    "intra_param_end_idx",
                ] {
                    diffs.eq(
                        &format!(
                            "unit {unit}, rank {rank}, shard_param_infos[{i}] ({fqn}).{field}"
                        ),
                        &oi[field],
                        &ti[field],
                    );
                }
            }
        }
    }
    let _ = case;
}

/// Compares our FSDP2 layout with every rank's view in expected.json.
fn compare_fsdp2(ours: &Value, expected: &Value, diffs: &mut Diffs) {
    let group = ours["shard_group_size"].as_u64().unwrap();
    let mesh_shape: Vec<u64> = ours["mesh_shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let ours_units = ours["units"].as_array().unwrap();
    for torch_rank in expected["ranks"].as_array().unwrap() {
        let rank = torch_rank["rank"].as_u64().unwrap();
        let shard_rank = rank % group;
        let coordinate: Vec<u64> = if mesh_shape.len() == 2 {
            vec![rank / group, shard_rank]
        } else {
            vec![rank]
        };
        diffs.eq(
            &format!("rank {rank}: mesh coordinate"),
            &Value::from(coordinate),
            &torch_rank["mesh_coordinate"],
        );
        diffs.eq(
            &format!("rank {rank}: shard-group rank"),
            &Value::from(shard_rank),
            &torch_rank["shard_rank"],
        );
        diffs.eq(
            &format!("rank {rank}: units_without_params"),
            &ours["units_without_params"],
            &torch_rank["units_without_params"],
        );
        let torch_units = torch_rank["units"].as_array().unwrap();
        let o_names: Vec<&Value> = ours_units.iter().map(|u| &u["unit_prefix"]).collect();
        let t_names: Vec<&Value> = torch_units.iter().map(|u| &u["unit_prefix"]).collect();
        if o_names != t_names {
            diffs.check(
                &format!("rank {rank}: units (in order)"),
                false,
                &format!("ours {o_names:?} != torch {t_names:?}"),
            );
            continue;
        }
        for (o, t) in ours_units.iter().zip(torch_units) {
            let unit = unit_label(&t["unit_prefix"]);
            diffs.eq(
                &format!("unit {unit}, rank {rank}, all_gather_input_numel"),
                &o["all_gather_input_numel"],
                &t["all_gather_input_numel"],
            );
            let o_params = o["params"].as_array().unwrap();
            let t_params = t["params"].as_array().unwrap();
            let o_fqns: Vec<&Value> = o_params.iter().map(|p| &p["fqn"]).collect();
            let t_fqns: Vec<&Value> = t_params.iter().map(|p| &p["fqn"]).collect();
            if o_fqns != t_fqns {
                diffs.check(
                    &format!("unit {unit}, rank {rank}, parameters (group order)"),
                    false,
                    &format!("ours {o_fqns:?} != torch {t_fqns:?}"),
                );
                continue;
            }
            for (op, tp) in o_params.iter().zip(t_params) {
                let fqn = tp["fqn"].as_str().unwrap();
                for field in [
                    "shape",
                    "dtype",
                    "requires_grad",
                    "placements",
                    "padded_sharded_shape",
                ] {
                    diffs.eq(
                        &format!("unit {unit}, rank {rank}, {fqn}.{field}"),
                        &op[field],
                        &tp[field],
                    );
                }
                let o_rank = &op["ranks"][shard_rank as usize];
                for field in ["local_shape", "global_offset"] {
                    diffs.eq(
                        &format!("unit {unit}, rank {rank}, {fqn}.{field}"),
                        &o_rank[field],
                        &tp[field],
                    );
                }
                let o_shared: Vec<Value> = o["shared_params"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|s| s["prim_fqn"] == tp["fqn"])
                    .map(|s| s["fqn"].clone())
                    .collect();
                diffs.eq(
                    &format!("unit {unit}, rank {rank}, {fqn} tied aliases"),
                    &Value::from(o_shared),
                    &tp["shared_fqns"],
                );
            }
        }
    }
}

fn compare(case: &Case, ours: &Value, diffs: &mut Diffs) {
    let expected = read_json(&case.dir.join("expected.json"));
    diffs.eq("api", &ours["api"], &expected["api"]);
    diffs.eq("world_size", &ours["world_size"], &expected["world_size"]);
    match expected["api"].as_str() {
        Some("fsdp1") => compare_fsdp1(&case.name, ours, &expected, diffs),
        Some("fsdp2") => compare_fsdp2(ours, &expected, diffs),
        other => panic!("{}: unknown api {other:?}", case.name),
    }
}

#[test]
fn layout_equals_torch_for_every_fixture_case() {
    let mut checked = 0;
    for dir in case_dirs() {
        let case = load_case(&dir);
        if case.settings.get("expected_error").is_some() {
            continue;
        }
        let layout = layout::compute(&case.model, &case.config)
            .unwrap_or_else(|e| panic!("case {}: torch accepted it but we refuse: {e}", case.name));
        let ours = serde_json::to_value(&layout).unwrap();
        let mut diffs = Diffs::default();
        compare(&case, &ours, &mut diffs);
        diffs.finish(&case.name);
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} layout cases checked");
}

#[test]
fn torch_rejections_are_our_rejections() {
    let mut checked = 0;
    for dir in case_dirs() {
        let case = load_case(&dir);
        let Some(err) = case.settings.get("expected_error") else {
            continue;
        };
        let torch_message = err["message"].as_str().unwrap();
        match layout::compute(&case.model, &case.config) {
            Ok(_) => panic!(
                "case {}: torch raises {torch_message:?} but we accept it",
                case.name
            ),
            Err(e) => {
                let ours = e.to_string();
                assert!(
                    ours.contains(torch_message),
                    "case {}: our error does not contain torch's message\n  ours:  {ours}\n  torch: {torch_message}",
                    case.name
                );
            }
        }
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} error cases checked");
}

fn cli_args(case: &Case) -> Vec<String> {
    let c = &case.config;
    let mut args = vec![
        "layout".to_owned(),
        "--json".to_owned(),
        "--model".to_owned(),
        case.dir.join("model.json").display().to_string(),
        "--world-size".to_owned(),
        c.world_size.to_string(),
        "--api".to_owned(),
        case.settings["api"].as_str().unwrap().to_owned(),
        "--strategy".to_owned(),
        c.strategy.name().to_owned(),
    ];
    if c.use_orig_params {
        args.push("--use-orig-params".to_owned());
    }
    if let Some(k) = c.shard_group_size {
        args.extend(["--shard-group-size".to_owned(), k.to_string()]);
    }
    if let Some(d) = c.param_dtype {
        args.extend(["--param-dtype".to_owned(), d.to_string()]);
    }
    args
}

#[test]
fn the_cli_prints_torchs_layout() {
    let bin = crate::common::shardscope_bin();
    for name in [
        "fsdp1_nested_ws4_hybrid_shard_2x2_orig",
        "fsdp1_mixed_ws3_orig_mp_bf16",
        "fsdp2_nested_ws4_hsdp_2x2",
        "fsdp2_mixed_ws3",
    ] {
        let case = load_case(&layout_fixtures_dir().join(name));
        let out = Command::new(&bin).args(cli_args(&case)).output().unwrap();
        assert!(
            out.status.success(),
            "{name}: shardscope layout failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ours: Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut diffs = Diffs::default();
        compare(&case, &ours, &mut diffs);
        diffs.finish(name);
    }
}

#[test]
fn the_cli_exits_2_with_torchs_message_on_a_rejected_model() {
    let bin = crate::common::shardscope_bin();
    let case = load_case(&layout_fixtures_dir().join("fsdp1_err_mixed_dtype"));
    let out = Command::new(&bin).args(cli_args(&case)).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let torch = case.settings["expected_error"]["message"].as_str().unwrap();
    assert!(stderr.contains(torch), "stderr {stderr:?} lacks {torch:?}");
    assert!(out.stdout.is_empty(), "data on stdout despite the error");
}

// ---------------------------------------------------------------------------------------------
// Values: rebuild every rank's local shard from the full parameters and our layout.
// ---------------------------------------------------------------------------------------------

/// The bytes of one element of padding value 42.0 (torch's `_FLAT_PARAM_PADDING_VALUE`).
fn forty_two(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Float32 => 42f32.to_le_bytes().to_vec(),
        DType::Float64 => 42f64.to_le_bytes().to_vec(),
        // bfloat16 is the upper half of the float32 bit pattern (exact for 42).
        DType::BFloat16 => ((42f32.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        // float16 42.0 = sign 0, exponent 5 + 15 = 20, mantissa 0.3125 * 1024 = 0x140.
        DType::Float16 => ((20u16 << 10) | 0x140).to_le_bytes().to_vec(),
        other => panic!("no padding value for {other}"),
    }
}

fn tensor_bytes<'a>(st: &'a SafeTensors<'a>, key: &str, case: &str) -> &'a [u8] {
    st.tensor(key)
        .unwrap_or_else(|e| panic!("{case}: values.safetensors has no `{key}`: {e}"))
        .data()
}

/// The name a tensor's values are stored under in `full/...`: its first name.
fn primary_name<'a>(model: &'a ModelDescription, fqn: &'a str) -> &'a str {
    model
        .params
        .iter()
        .find(|p| p.fqn == fqn)
        .and_then(|p| p.shared_with.as_deref())
        .unwrap_or(fqn)
}

fn check_fsdp1_values(case: &Case, ours: &Fsdp1Layout, st: &SafeTensors<'_>, expected: &Value) {
    for torch_rank in expected["ranks"].as_array().unwrap() {
        let rank = torch_rank["rank"].as_u64().unwrap();
        let shard_rank = torch_rank["shard_rank"].as_u64().unwrap();
        for flat in &ours.flat_params {
            let elem = flat.dtype.size_bytes();
            let mut rebuilt = Vec::new();
            for piece in flat.rank_pieces(shard_rank) {
                let n = piece.numel as usize;
                match piece.kind {
                    PieceKind::Param { param, intra_start } => {
                        let key = format!("full/{}", primary_name(&case.model, &flat.fqns[param]));
                        let full = tensor_bytes(st, &key, &case.name);
                        let start = intra_start as usize * elem;
                        rebuilt.extend_from_slice(&full[start..start + n * elem]);
                    }
                    PieceKind::SegmentPadding => {
                        assert!(
                            case.config.use_orig_params,
                            "padding segments without use_orig_params"
                        );
                        for _ in 0..n {
                            rebuilt.extend(forty_two(flat.dtype));
                        }
                    }
                    PieceKind::ShardTail => rebuilt.resize(rebuilt.len() + n * elem, 0),
                }
            }
            let key = format!("rank{rank}/{}", flat.flat_param_fqn);
            let torch = tensor_bytes(st, &key, &case.name);
            assert!(
                rebuilt == torch,
                "case {}, unit {}, rank {rank}: the shard rebuilt from our layout differs from torch's `{key}` \
                 ({} vs {} bytes)",
                case.name,
                unit_label(&Value::from(flat.unit_prefix.as_str())),
                rebuilt.len(),
                torch.len()
            );
        }
    }
}

fn check_fsdp2_values(case: &Case, ours: &Fsdp2Layout, st: &SafeTensors<'_>, expected: &Value) {
    for torch_rank in expected["ranks"].as_array().unwrap() {
        let rank = torch_rank["rank"].as_u64().unwrap();
        let shard_rank = torch_rank["shard_rank"].as_u64().unwrap() as usize;
        for unit in &ours.units {
            let mut all_gather_input = Vec::new();
            for p in &unit.params {
                let elem = p.dtype.size_bytes();
                let row: u64 = p.shape[1..].iter().product();
                let local = &p.ranks[shard_rank];
                let full = tensor_bytes(st, &format!("full/{}", p.fqn), &case.name);
                let start = (local.global_offset[0] * row) as usize * elem;
                let len = (local.local_shape[0] * row) as usize * elem;
                let mut buffer = full[start..start + len].to_vec();
                buffer.resize(p.padded_sharded_numel() as usize * elem, 0);
                let key = format!("rank{rank}/{}", p.fqn);
                assert!(
                    buffer == tensor_bytes(st, &key, &case.name),
                    "case {}, unit {}, rank {rank}: padded shard of {} differs from torch's `{key}`",
                    case.name,
                    unit_label(&Value::from(unit.unit_prefix.as_str())),
                    p.fqn
                );
                all_gather_input.extend(buffer);
            }
            let key = if unit.unit_prefix.is_empty() {
                format!("rank{rank}/all_gather_input")
            } else {
                format!("rank{rank}/{}/all_gather_input", unit.unit_prefix)
            };
            assert!(
                all_gather_input == tensor_bytes(st, &key, &case.name),
                "case {}, unit {}, rank {rank}: all-gather input differs from torch's `{key}`",
                case.name,
                unit_label(&Value::from(unit.unit_prefix.as_str())),
            );
        }
    }
}

#[test]
fn torchs_local_shards_rebuild_from_full_values_and_our_layout() {
    let mut checked = 0;
    for dir in case_dirs() {
        let case = load_case(&dir);
        if case.settings.get("expected_error").is_some() {
            continue;
        }
        let bytes = std::fs::read(dir.join("values.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let expected = read_json(&dir.join("expected.json"));
        match layout::compute(&case.model, &case.config).unwrap() {
            Layout::Fsdp1(l) => check_fsdp1_values(&case, &l, &st, &expected),
            Layout::Fsdp2(l) => check_fsdp2_values(&case, &l, &st, &expected),
        }
        checked += 1;
    }
    assert!(
        checked >= 20,
        "only {checked} cases had their values checked"
    );
}

#[test]
fn every_fixture_records_the_torch_version() {
    for dir in case_dirs() {
        let case = load_case(&dir);
        let version = case.settings["torch_version"].as_str().unwrap_or("");
        assert!(
            version.starts_with("2.15"),
            "{}: torch_version {version:?}",
            case.name
        );
    }
}
