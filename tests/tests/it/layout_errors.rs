//! One test per error a model description or a layout configuration can produce: each asserts the
//! variant and that the message names the offending parameter or unit and says what is wrong.
//! (The messages torch itself produces are checked against real torch in `layout_fixtures.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use shardscope_core::layout::{self, Api, LayoutConfig, LayoutError, Strategy};
use shardscope_core::model::{DescriptionError, ModelDescription};

fn parse(json: &str) -> Result<ModelDescription, DescriptionError> {
    ModelDescription::from_json_bytes(json.as_bytes(), "model.json")
}

fn model(json: &str) -> ModelDescription {
    parse(json).unwrap_or_else(|e| panic!("valid description rejected: {e}"))
}

fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "message {message:?} does not mention {needle:?}"
        );
    }
}

fn description_error(json: &str) -> (DescriptionError, String) {
    let err = parse(json).expect_err("description accepted");
    let msg = err.to_string();
    (err, msg)
}

// ------------------------------------------------------------------------------------------------
// DescriptionError
// ------------------------------------------------------------------------------------------------

#[test]
fn syntax_error_names_the_file() {
    let (err, msg) = description_error(r#"{"params": [{"fqn": "a", "shape": [2]}]}"#);
    assert!(matches!(err, DescriptionError::Syntax { .. }), "{err:?}");
    assert_mentions(&msg, &["model.json", "dtype"]);
    let (err, msg) = description_error(r#"{"params": [], "unitz": []}"#);
    assert!(matches!(err, DescriptionError::Syntax { .. }), "{err:?}");
    assert_mentions(&msg, &["model.json", "unitz"]);
}

#[test]
fn bad_fqn_is_named() {
    let (err, msg) =
        description_error(r#"{"params": [{"fqn": "block..w", "shape": [2], "dtype": "float32"}]}"#);
    assert!(
        matches!(err, DescriptionError::BadFqn { index: 0, .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["block..w", "empty dotted segment"]);
}

#[test]
fn duplicate_param_is_named_with_both_entries() {
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "a.w", "shape": [2], "dtype": "float32"},
                       {"fqn": "a.w", "shape": [2], "dtype": "float32"}]}"#,
    );
    assert!(
        matches!(
            err,
            DescriptionError::DuplicateParam {
                first: 0,
                second: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert_mentions(&msg, &["a.w", "listed twice", "shared_with"]);
}

#[test]
fn unknown_dtype_is_named() {
    let (err, msg) =
        description_error(r#"{"params": [{"fqn": "a.w", "shape": [2], "dtype": "float33"}]}"#);
    assert!(
        matches!(err, DescriptionError::UnknownDType { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["a.w", "float33", "unknown dtype"]);
}

#[test]
fn numel_overflow_is_named() {
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "huge", "shape": [4294967296, 4294967296], "dtype": "float32"}]}"#,
    );
    assert!(
        matches!(err, DescriptionError::NumelOverflow { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["huge", "64 bits"]);
}

#[test]
fn shared_with_a_later_or_unknown_parameter_is_refused() {
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "head.w", "shape": [2], "dtype": "float32", "shared_with": "embed.w"},
                       {"fqn": "embed.w", "shape": [2], "dtype": "float32"}]}"#,
    );
    assert!(
        matches!(err, DescriptionError::UnknownSharedTarget { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["head.w", "embed.w", "not an earlier parameter"]);
}

#[test]
fn tied_weights_must_agree_in_shape_dtype_and_requires_grad() {
    for (alias, what) in [
        (r#""shape": [3], "dtype": "float32""#, "shape"),
        (r#""shape": [2], "dtype": "bfloat16""#, "dtype"),
        (
            r#""shape": [2], "dtype": "float32", "requires_grad": false"#,
            "requires_grad",
        ),
    ] {
        let json = format!(
            r#"{{"params": [{{"fqn": "embed.w", "shape": [2], "dtype": "float32"}},
                           {{"fqn": "head.w", {alias}, "shared_with": "embed.w"}}]}}"#
        );
        let (err, msg) = description_error(&json);
        assert!(
            matches!(err, DescriptionError::SharedMismatch { what: w, .. } if w == what),
            "{err:?}"
        );
        assert_mentions(&msg, &["head.w", "embed.w", what, "differs"]);
    }
}

#[test]
fn duplicate_unit_is_named() {
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "a.w", "shape": [2], "dtype": "float32"}], "units": ["a", "a"]}"#,
    );
    assert!(
        matches!(err, DescriptionError::DuplicateUnit { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["`a`", "listed twice"]);
}

#[test]
fn bad_unit_is_named_with_the_reason() {
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "a.w", "shape": [2], "dtype": "float32"}], "units": ["a..b"]}"#,
    );
    assert!(matches!(err, DescriptionError::BadUnit { .. }), "{err:?}");
    assert_mentions(&msg, &["a..b", "not a module path"]);
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "a.w", "shape": [2], "dtype": "float32"}], "units": ["a.w"]}"#,
    );
    assert!(matches!(err, DescriptionError::BadUnit { .. }), "{err:?}");
    assert_mentions(&msg, &["a.w", "names a parameter"]);
}

#[test]
fn unknown_ignored_parameter_is_named() {
    let (err, msg) = description_error(
        r#"{"params": [{"fqn": "a.w", "shape": [2], "dtype": "float32"}], "ignored": ["a.v"]}"#,
    );
    assert!(
        matches!(err, DescriptionError::UnknownIgnored { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["a.v", "not a parameter"]);
}

// ------------------------------------------------------------------------------------------------
// LayoutError
// ------------------------------------------------------------------------------------------------

const SIMPLE: &str = r#"{"params": [{"fqn": "blk.w", "shape": [6, 2], "dtype": "float32"},
                                    {"fqn": "blk.b", "shape": [6], "dtype": "float32"}],
                        "units": ["blk"]}"#;

fn config(
    api: Api,
    world_size: u64,
    strategy: Strategy,
    shard_group_size: Option<u64>,
) -> LayoutConfig {
    LayoutConfig {
        api,
        world_size,
        shard_group_size,
        use_orig_params: false,
        strategy,
        param_dtype: None,
    }
}

fn layout_error(json: &str, config: &LayoutConfig) -> (LayoutError, String) {
    let err = layout::compute(&model(json), config).expect_err("layout computed");
    let msg = err.to_string();
    (err, msg)
}

#[test]
fn unknown_api_and_strategy_names_are_echoed() {
    let err = "fsdp3".parse::<Api>().unwrap_err();
    assert!(matches!(err, LayoutError::UnknownApi(_)), "{err:?}");
    assert_mentions(&err.to_string(), &["fsdp3", "fsdp1 or fsdp2"]);
    let err = "full_shrad".parse::<Strategy>().unwrap_err();
    assert!(matches!(err, LayoutError::UnknownStrategy(_)), "{err:?}");
    assert_mentions(&err.to_string(), &["full_shrad", "full_shard"]);
}

#[test]
fn zero_world_size_is_refused() {
    let (err, msg) = layout_error(SIMPLE, &config(Api::Fsdp1, 0, Strategy::FullShard, None));
    assert_eq!(err, LayoutError::ZeroWorldSize);
    assert_mentions(&msg, &["world size", "at least 1"]);
}

#[test]
fn shard_group_must_divide_the_world() {
    for (api, strategy) in [
        (Api::Fsdp1, Strategy::HybridShard),
        (Api::Fsdp2, Strategy::HybridShard),
    ] {
        let (err, msg) = layout_error(SIMPLE, &config(api, 4, strategy, Some(3)));
        assert!(
            matches!(err, LayoutError::BadShardGroupSize { .. }),
            "{err:?}"
        );
        assert_mentions(&msg, &["shard group size 3", "world size 4"]);
    }
    let (err, _) = layout_error(
        SIMPLE,
        &config(Api::Fsdp1, 4, Strategy::HybridShard, Some(0)),
    );
    assert!(
        matches!(err, LayoutError::BadShardGroupSize { .. }),
        "{err:?}"
    );
}

#[test]
fn shard_group_size_without_hybrid_is_refused() {
    let (err, msg) = layout_error(SIMPLE, &config(Api::Fsdp1, 4, Strategy::FullShard, Some(2)));
    assert!(
        matches!(err, LayoutError::ShardGroupWithoutHybrid { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["--shard-group-size 2", "full_shard", "4 ranks"]);
}

#[test]
fn hybrid_without_group_size_is_refused() {
    let (err, msg) = layout_error(SIMPLE, &config(Api::Fsdp1, 4, Strategy::HybridShard, None));
    assert!(
        matches!(err, LayoutError::HybridWithoutGroupSize { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["hybrid_shard", "--shard-group-size"]);
}

#[test]
fn fsdp2_has_no_no_shard() {
    let (err, msg) = layout_error(SIMPLE, &config(Api::Fsdp2, 2, Strategy::NoShard, None));
    assert_eq!(err, LayoutError::Fsdp2NoShard);
    assert_mentions(&msg, &["FSDP2", "no_shard"]);
}

const TIED_ACROSS: &str = r#"{"params": [
    {"fqn": "embed.weight", "shape": [7, 5], "dtype": "float32"},
    {"fqn": "head.weight", "shape": [7, 5], "dtype": "float32", "shared_with": "embed.weight"},
    {"fqn": "head.bias", "shape": [7], "dtype": "float32"}],
  "units": ["head", ""]}"#;

#[test]
fn tied_weight_across_units_with_use_orig_params_is_refused() {
    let mut c = config(Api::Fsdp1, 2, Strategy::FullShard, None);
    c.use_orig_params = true;
    let (err, msg) = layout_error(TIED_ACROSS, &c);
    assert!(
        matches!(err, LayoutError::SharedAcrossUnits { .. }),
        "{err:?}"
    );
    assert_mentions(
        &msg,
        &["head.weight", "embed.weight", "`head`", "same unit"],
    );
    // One name outside every unit: refused as well (torch would silently untie it).
    let json = r#"{"params": [
        {"fqn": "embed.weight", "shape": [7, 5], "dtype": "float32"},
        {"fqn": "head.weight", "shape": [7, 5], "dtype": "float32", "shared_with": "embed.weight"}],
      "units": ["embed"]}"#;
    let (err, msg) = layout_error(json, &c);
    assert!(
        matches!(err, LayoutError::SharedAcrossUnits { .. }),
        "{err:?}"
    );
    assert_mentions(&msg, &["head.weight", "(none)", "`embed`"]);
}

#[test]
fn tied_weight_across_units_without_use_orig_params_gives_each_unit_a_copy() {
    // torch 2.15 (fixture fsdp1_tied_across_ws2_flat): both units flatten the tensor.
    let l = layout::compute(
        &model(TIED_ACROSS),
        &config(Api::Fsdp1, 2, Strategy::FullShard, None),
    )
    .unwrap();
    let layout::Layout::Fsdp1(l) = l else {
        panic!("not fsdp1")
    };
    let fqns: Vec<Vec<String>> = l.flat_params.iter().map(|f| f.fqns.clone()).collect();
    assert_eq!(
        fqns,
        [
            vec!["embed.weight".to_owned()],
            vec!["head.weight".to_owned(), "head.bias".to_owned()]
        ]
    );
    assert!(l.flat_params.iter().all(|f| f.shared_params.is_empty()));
}

#[test]
fn fsdp2_tied_weight_across_units_gives_torchs_error() {
    let (err, msg) = layout_error(
        TIED_ACROSS,
        &config(Api::Fsdp2, 2, Strategy::FullShard, None),
    );
    assert!(
        matches!(err, LayoutError::Fsdp2SharedAcrossUnits { .. }),
        "{err:?}"
    );
    assert_mentions(
        &msg,
        &[
            "Parameter 'head.weight' is shared",
            "embed.weight",
            "fully_shard([module_a, module_b])",
        ],
    );
}

#[test]
fn integer_first_parameter_is_refused_with_torchs_words() {
    let json = r#"{"params": [{"fqn": "blk.steps", "shape": [4], "dtype": "int64", "requires_grad": false},
                              {"fqn": "blk.w", "shape": [3], "dtype": "float32"}], "units": ["blk"]}"#;
    let (err, msg) = layout_error(json, &config(Api::Fsdp1, 2, Strategy::FullShard, None));
    assert!(matches!(err, LayoutError::IntegerFlatten { .. }), "{err:?}");
    assert_mentions(
        &msg,
        &[
            "`blk`",
            "blk.steps",
            "int64",
            "Cannot flatten integer dtype tensors",
        ],
    );
}

#[test]
fn mixed_dtypes_are_refused_with_torchs_words() {
    let json = r#"{"params": [{"fqn": "blk.a", "shape": [3], "dtype": "float32"},
                              {"fqn": "blk.b", "shape": [4], "dtype": "bfloat16"}], "units": ["blk"]}"#;
    let (err, msg) = layout_error(json, &config(Api::Fsdp1, 2, Strategy::FullShard, None));
    assert!(matches!(err, LayoutError::MixedDTypes { .. }), "{err:?}");
    assert_mentions(
        &msg,
        &[
            "`blk`",
            "blk.b",
            "Must flatten tensors with uniform dtype but got torch.float32 and torch.bfloat16",
        ],
    );
}

#[test]
fn mixed_requires_grad_is_refused_only_without_use_orig_params() {
    let json = r#"{"params": [{"fqn": "blk.a", "shape": [3], "dtype": "float32"},
                              {"fqn": "blk.b", "shape": [5], "dtype": "float32", "requires_grad": false}],
                   "units": ["blk"]}"#;
    let mut c = config(Api::Fsdp1, 2, Strategy::FullShard, None);
    let (err, msg) = layout_error(json, &c);
    assert!(
        matches!(err, LayoutError::MixedRequiresGrad { .. }),
        "{err:?}"
    );
    assert_mentions(
        &msg,
        &[
            "`blk`",
            "blk.b",
            "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`",
        ],
    );
    c.use_orig_params = true;
    assert!(layout::compute(&model(json), &c).is_ok());
}

#[test]
fn fsdp2_scalar_parameter_is_refused_with_torchs_words() {
    let json = r#"{"params": [{"fqn": "blk.w", "shape": [5], "dtype": "float32"},
                              {"fqn": "blk.s", "shape": [], "dtype": "float32"}], "units": ["blk"]}"#;
    let (err, msg) = layout_error(json, &config(Api::Fsdp2, 2, Strategy::FullShard, None));
    assert!(matches!(err, LayoutError::ZeroDimShard { .. }), "{err:?}");
    assert_mentions(
        &msg,
        &[
            "blk.s",
            "fully_shard doesn't support scalar parameters. Change s to a 1D tensor with numel equal to 1.",
        ],
    );
}

#[test]
fn element_count_overflow_names_the_unit() {
    let json = r#"{"params": [{"fqn": "blk.a", "shape": [9223372036854775808], "dtype": "float32"},
                              {"fqn": "blk.b", "shape": [9223372036854775808], "dtype": "float32"}],
                   "units": ["blk"]}"#;
    let (err, msg) = layout_error(json, &config(Api::Fsdp1, 2, Strategy::FullShard, None));
    assert!(matches!(err, LayoutError::Overflow { .. }), "{err:?}");
    assert_mentions(&msg, &["`blk`", "overflows"]);
    // FSDP2 on one rank: each padded shard is the whole parameter, and their sum overflows.
    let (err, _) = layout_error(json, &config(Api::Fsdp2, 1, Strategy::FullShard, None));
    assert!(matches!(err, LayoutError::Overflow { .. }), "{err:?}");
}
