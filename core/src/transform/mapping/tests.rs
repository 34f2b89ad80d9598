use super::*;

const TOY: &str = r#"{
  "version": 1, "name": "toy", "from": "titan", "to": "hf",
  "match": {"architectures": ["ToyForCausalLM"], "keys": ["tok.weight"], "target_keys": ["model.embed.weight"]},
  "defaults": {"head_dim": "hidden_size/num_attention_heads"},
  "tie": {"flag": "tie_word_embeddings", "keep": "model.embed.weight", "drop": "lm_head.weight"},
  "rules": [
    {"from": "tok.weight", "to": "model.embed.weight", "shape": ["vocab_size", "hidden_size"]},
    {"from": "out.weight", "to": "lm_head.weight", "shape": ["vocab_size", "hidden_size"]},
    {"from": "layers.{L}.wq.weight", "to": "model.layers.{L}.q.weight",
     "ops": [{"op": "rope", "heads": "num_attention_heads"}],
     "shape": ["num_attention_heads*head_dim", "hidden_size"]},
    {"from": "layers.{L}.experts.w1", "to": "model.layers.{L}.experts.{E}.gate.weight",
     "split": {"dim": 0, "capture": "E", "count": "num_experts"},
     "ops": [{"op": "transpose", "dims": [0, 1]}],
     "shape": ["hidden_size", "moe_intermediate_size"]},
    {"from": "layers.{L}.fc1.weight", "to": "model.layers.{L}.{P}_proj.weight",
     "split": {"dim": 0, "capture": "P", "parts": ["gate", "up"]}},
    {"from": "freqs", "drop": true}
  ]
}"#;

fn config(tie: bool) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["ToyForCausalLM"], "hidden_size": 4, "num_attention_heads": 2,
        "vocab_size": 3, "num_experts": 2, "moe_intermediate_size": 3,
        "tie_word_embeddings": tie
    })
}

fn stored(name: &str, shape: &[u64]) -> Stored {
    Stored {
        name: name.to_owned(),
        dtype: DType::UInt8,
        shape: shape.to_vec(),
    }
}

fn toy_checkpoint() -> Vec<Stored> {
    vec![
        stored("tok.weight", &[3, 4]),
        stored("out.weight", &[3, 4]),
        stored("layers.0.wq.weight", &[4, 4]),
        stored("layers.0.experts.w1", &[2, 3, 4]),
        stored("layers.0.fc1.weight", &[6, 4]),
        stored("freqs", &[2]),
    ]
}

/// Bytes of a stored tensor: element i is `seed + i` (wrapping).
fn bytes_of(s: &Stored) -> Dense {
    let n: u64 = s.shape.iter().product();
    let seed = s.name.len() as u8;
    Dense::new(
        (0..n).map(|i| seed.wrapping_add(i as u8)).collect(),
        s.shape.clone(),
        1,
    )
    .unwrap()
}

fn run(plan: &Plan, inputs: &[Stored]) -> BTreeMap<String, Dense> {
    let by: BTreeMap<&str, &Stored> = inputs.iter().map(|s| (s.name.as_str(), s)).collect();
    plan.outputs
        .iter()
        .map(|o| {
            let t = evaluate(&o.recipe, 1, |r| {
                let t = bytes_of(by[r.source.as_str()]);
                Ok(match &r.rows {
                    None => t,
                    Some(rows) => t.slice(0, rows.start, rows.end - rows.start).unwrap(),
                })
            })
            .unwrap();
            assert_eq!(t.shape, o.shape, "{}", o.name);
            (o.name.clone(), t)
        })
        .collect()
}

#[test]
fn builtin_files_parse() {
    let files = builtin();
    assert_eq!(files.len(), BUILTIN.len());
    for f in &files {
        assert!(!f.rules.is_empty(), "{}", f.name);
    }
}

#[test]
fn forward_renames_permutes_splits_and_drops() {
    let file = parse(TOY, "toy.json").unwrap();
    let plan = plan(&file, Direction::Forward, &config(false), &toy_checkpoint()).unwrap();
    let names: Vec<&str> = plan.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model.embed.weight",
            "lm_head.weight",
            "model.layers.0.q.weight",
            "model.layers.0.experts.0.gate.weight",
            "model.layers.0.experts.1.gate.weight",
            "model.layers.0.gate_proj.weight",
            "model.layers.0.up_proj.weight"
        ]
    );
    assert_eq!(plan.dropped, ["freqs"]);
    assert!(plan.tied.is_none());
    let out = run(&plan, &toy_checkpoint());
    // wq: 2 heads of 2 rows; within a head the rows (0, 1) stay: head_dim 2 -> one pair.
    let wq = bytes_of(&stored("layers.0.wq.weight", &[4, 4]));
    assert_eq!(
        out["model.layers.0.q.weight"],
        ops::rope(wq, 2, false).unwrap()
    );
    // Expert 1: rows 3..6 of the grouped [2, 3, 4] tensor, transposed to [4, 3].
    let w1 = bytes_of(&stored("layers.0.experts.w1", &[2, 3, 4]));
    let e1 = w1
        .slice(0, 1, 1)
        .unwrap()
        .reshape(&[3, 4])
        .unwrap()
        .permute(&[1, 0])
        .unwrap();
    assert_eq!(out["model.layers.0.experts.1.gate.weight"], e1);
    assert_eq!(out["model.layers.0.up_proj.weight"].shape, vec![3, 4]);
}

#[test]
fn backward_inverts_forward() {
    let file = parse(TOY, "toy.json").unwrap();
    let fwd = plan(&file, Direction::Forward, &config(false), &toy_checkpoint()).unwrap();
    let hf = run(&fwd, &toy_checkpoint());
    let hf_stored: Vec<Stored> = fwd
        .outputs
        .iter()
        .map(|o| Stored {
            name: o.name.clone(),
            dtype: o.dtype,
            shape: o.shape.clone(),
        })
        .collect();
    let back = plan(&file, Direction::Backward, &config(false), &hf_stored).unwrap();
    let by: BTreeMap<&str, &Dense> = hf.iter().map(|(k, v)| (k.as_str(), v)).collect();
    for o in &back.outputs {
        let t = evaluate(&o.recipe, 1, |r| Ok(by[r.source.as_str()].clone()))
            .unwrap_or_else(|e| panic!("{}: {e} ({:?})", o.name, o.recipe));
        let original = toy_checkpoint()
            .into_iter()
            .find(|s| s.name == o.name)
            .unwrap();
        assert_eq!(t, bytes_of(&original), "{}", o.name);
    }
    let mut names: Vec<&str> = back.outputs.iter().map(|o| o.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "layers.0.experts.w1",
            "layers.0.fc1.weight",
            "layers.0.wq.weight",
            "out.weight",
            "tok.weight"
        ]
    );
}

#[test]
fn ties_drop_forward_and_come_back() {
    let file = parse(TOY, "toy.json").unwrap();
    let fwd = plan(&file, Direction::Forward, &config(true), &toy_checkpoint()).unwrap();
    let tied = fwd.tied.unwrap();
    assert_eq!(
        (tied.kept.as_str(), tied.dropped.name.as_str()),
        ("model.embed.weight", "lm_head.weight")
    );
    assert!(fwd.outputs.iter().all(|o| o.name != "lm_head.weight"));
    let hf = vec![stored("model.embed.weight", &[3, 4])];
    let back = plan(&file, Direction::Backward, &config(true), &hf).unwrap();
    let names: Vec<&str> = back.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["tok.weight", "out.weight"]);
    assert_eq!(
        back.outputs[1].recipe,
        Recipe::Copy {
            source: "model.embed.weight".to_owned()
        }
    );
}

#[test]
fn shape_mismatches_name_the_tensor_and_the_fields() {
    let file = parse(TOY, "toy.json").unwrap();
    let mut cfg = config(false);
    cfg["num_attention_heads"] = serde_json::json!(1);
    let mut ckpt = toy_checkpoint();
    ckpt[2].shape = vec![8, 4];
    let e = plan(&file, Direction::Forward, &cfg, &ckpt)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers.0.q.weight: shape [8, 4]")
            && e.contains("num_attention_heads*head_dim = 4"),
        "{e}"
    );
    let mut cfg = config(false);
    cfg["num_experts"] = serde_json::json!(3);
    let e = plan(&file, Direction::Forward, &cfg, &toy_checkpoint())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.0.experts.w1") && e.contains("`num_experts` = 3"),
        "{e}"
    );
}

#[test]
fn unmatched_names_are_an_error_naming_them() {
    let file = parse(TOY, "toy.json").unwrap();
    let mut ckpt = toy_checkpoint();
    ckpt.push(stored("layers.0.mystery", &[1]));
    let e = plan(&file, Direction::Forward, &config(false), &ckpt)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.0.mystery") && e.contains("--mapping"),
        "{e}"
    );
}

#[test]
fn choose_by_config_and_names() {
    let files = vec![parse(TOY, "toy.json").unwrap()];
    let cfg = config(false);
    let (f, d) = choose(&files, "hf", &cfg, &["tok.weight"]).unwrap();
    assert_eq!((f.name.as_str(), d), ("toy", Direction::Forward));
    let (_, d) = choose(&files, "titan", &cfg, &["model.embed.weight"]).unwrap();
    assert_eq!(d, Direction::Backward);
    let e = choose(&files, "hf", &cfg, &["other.weight"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no mapping to `hf`") && e.contains("toy"), "{e}");
}

#[test]
fn bad_files_are_refused_with_the_rule() {
    for (text, want) in [
        (
            r#"{"version": 2, "name": "x", "from": "a", "to": "b", "rules": []}"#,
            "version 2",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a.{L}", "to": "b"}]}"#,
            "`to` captures",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a"}]}"#,
            "needs `to` or `drop`",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a", "to": "b", "opz": []}]}"#,
            "unknown field",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a", "to": "b", "ops": [{"op": "spin"}]}]}"#,
            "unknown variant",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a", "to": "b", "shape": ["1"], "restore": {"zeros": "float32", "beside": "b"}}]}"#,
            "`restore` goes with `drop`",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a", "drop": true, "restore": {"zeros": "float32", "beside": "b"}}]}"#,
            "needs the tensor's `shape`",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "a", "drop": true, "shape": ["1"], "restore": {"zeros": "floaty", "beside": "b"}}]}"#,
            "not a dtype",
        ),
        (
            r#"{"version": 1, "name": "x", "from": "a", "to": "b", "rules": [{"from": "l.{L}.bias", "drop": true, "shape": ["1"], "restore": {"zeros": "float32", "beside": "other"}}]}"#,
            "do not fill",
        ),
    ] {
        let e = parse(text, "f.json").unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("f.json"), "{e}");
    }
}

/// A dropped buffer with `restore` comes back on the way back as zeros, one per layer that the
/// `beside` name has, and never on the way forward.
#[test]
fn restore_writes_zeros_back_beside_each_match() {
    let text = r#"{"version": 1, "name": "r", "from": "titan", "to": "hf",
      "match": {"keys": ["layers.{L}.gate.weight"], "target_keys": ["model.layers.{L}.router.weight"]},
      "rules": [
        {"from": "layers.{L}.gate.weight", "to": "model.layers.{L}.router.weight", "shape": ["num_experts", "hidden_size"]},
        {"from": "layers.{L}.expert_bias", "drop": true, "shape": ["num_experts"],
         "restore": {"zeros": "float32", "beside": "layers.{L}.gate.weight"}}]}"#;
    let file = parse(text, "r.json").unwrap();
    let cfg = serde_json::json!({"num_experts": 3, "hidden_size": 2});
    let titan = vec![
        stored("layers.0.gate.weight", &[3, 2]),
        stored("layers.0.expert_bias", &[3]),
        stored("layers.1.gate.weight", &[3, 2]),
        stored("layers.1.expert_bias", &[3]),
    ];
    let forward = plan(&file, Direction::Forward, &cfg, &titan).unwrap();
    assert_eq!(
        forward.dropped,
        ["layers.0.expert_bias", "layers.1.expert_bias"]
    );
    assert!(forward.outputs.iter().all(|o| !o.name.contains("bias")));
    let hf = vec![
        stored("model.layers.0.router.weight", &[3, 2]),
        stored("model.layers.1.router.weight", &[3, 2]),
    ];
    let back = plan(&file, Direction::Backward, &cfg, &hf).unwrap();
    let names: Vec<&str> = back.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "layers.0.gate.weight",
            "layers.1.gate.weight",
            "layers.0.expert_bias",
            "layers.1.expert_bias"
        ]
    );
    let bias = &back.outputs[2];
    assert_eq!(
        (bias.dtype, bias.shape.as_slice()),
        (DType::Float32, &[3u64][..])
    );
    let t = evaluate(&bias.recipe, 4, |_| unreachable!("zeros read nothing")).unwrap();
    assert_eq!((t.bytes, t.shape), (vec![0u8; 12], vec![3]));
}
