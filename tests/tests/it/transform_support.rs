//! Loads the torch-made fixtures of `tests/fixtures/optim` (written by `gen_optim.py`):
//! `tree.json` + `tensors.safetensors` into `Node` values, `case.json` into layouts.
#![allow(dead_code, clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::PathBuf;

use safetensors::SafeTensors;
use serde_json::Value;
use shardscope_core::DType;
use shardscope_core::layout::{self, Api, Fsdp1Layout, Layout, LayoutConfig, Strategy};
use shardscope_core::model::ModelDescription;
use shardscope_core::model::tree::{ChunkMeta, Dict, DistKind, DistTensor, Key, Node, Tensor};

pub struct Scenario {
    pub name: String,
    pub case: Value,
    /// One `Node::Dict` per rank: recorded object name -> value.
    pub ranks: Vec<Node>,
}

pub fn dir() -> PathBuf {
    shardscope_tests::fixtures_dir().join("optim")
}

pub fn load(name: &str) -> Scenario {
    let base = dir().join(name);
    let case: Value =
        serde_json::from_slice(&std::fs::read(base.join("case.json")).unwrap()).unwrap();
    let tree: Value =
        serde_json::from_slice(&std::fs::read(base.join("tree.json")).unwrap()).unwrap();
    let bytes = std::fs::read(base.join("tensors.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let Node::List(ranks) = decode(&tree, &st) else {
        panic!("{name}: tree.json is not a list of ranks")
    };
    Scenario {
        name: name.to_owned(),
        case,
        ranks,
    }
}

fn dtype_of(d: safetensors::Dtype) -> DType {
    use safetensors::Dtype as S;
    match d {
        S::F32 => DType::Float32,
        S::F64 => DType::Float64,
        S::F16 => DType::Float16,
        S::BF16 => DType::BFloat16,
        S::I64 => DType::Int64,
        S::I32 => DType::Int32,
        S::I16 => DType::Int16,
        S::I8 => DType::Int8,
        S::U8 => DType::UInt8,
        S::BOOL => DType::Bool,
        other => panic!("unexpected safetensors dtype {other:?}"),
    }
}

fn tensor(v: &Value, st: &SafeTensors) -> Tensor {
    let name = v.as_str().unwrap();
    let view = st.tensor(name).unwrap();
    Tensor::new(
        dtype_of(view.dtype()),
        view.shape().iter().map(|&d| d as u64).collect(),
        view.data().to_vec(),
    )
    .unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

pub fn decode(v: &Value, st: &SafeTensors) -> Node {
    match v {
        Value::Null => Node::None,
        Value::Bool(b) => Node::Bool(*b),
        Value::String(s) => Node::Str(s.clone()),
        Value::Object(o) => {
            let (tag, inner) = o.iter().next().unwrap();
            match tag.as_str() {
                "int" => Node::Int(inner.as_i64().unwrap()),
                "float" => Node::Float(inner.as_f64().unwrap()),
                "tensor" => Node::Tensor(tensor(inner, st)),
                "list" => Node::List(
                    inner
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| decode(x, st))
                        .collect(),
                ),
                "tuple" => Node::Tuple(
                    inner
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| decode(x, st))
                        .collect(),
                ),
                "dict" => Node::Dict(
                    inner
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|kv| {
                            let key = match &kv[0] {
                                Value::String(s) => Key::Str(s.clone()),
                                Value::Number(n) => Key::Int(n.as_i64().unwrap()),
                                other => panic!("bad key {other}"),
                            };
                            (key, decode(&kv[1], st))
                        })
                        .collect::<Dict>(),
                ),
                "sharded_tensor" => {
                    let dtype: DType = inner["dtype"].as_str().unwrap().parse().unwrap();
                    let locals = inner["local_shards"].as_array().unwrap();
                    assert!(locals.len() <= 1);
                    Node::Dist(DistTensor {
                        kind: DistKind::ShardedTensor,
                        dtype,
                        global_shape: u64s(&inner["size"]),
                        local: locals
                            .first()
                            .map(|l| (u64s(&l["offsets"]), tensor(&l["tensor"]["tensor"], st))),
                        chunks: inner["chunks"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|c| ChunkMeta {
                                offsets: u64s(&c["offsets"]),
                                sizes: u64s(&c["sizes"]),
                                placement: Some(c["placement"].as_str().unwrap().to_owned()),
                            })
                            .collect(),
                    })
                }
                "dtensor" => Node::Dist(DistTensor {
                    kind: DistKind::DTensor,
                    dtype: inner["dtype"].as_str().unwrap().parse().unwrap(),
                    global_shape: u64s(&inner["size"]),
                    local: Some((
                        u64s(&inner["local_offsets"]),
                        tensor(&inner["tensor"]["tensor"], st),
                    )),
                    chunks: Vec::new(),
                }),
                other => panic!("unknown tag {other}"),
            }
        }
        other => panic!("unexpected JSON value {other}"),
    }
}

impl Scenario {
    pub fn world_size(&self) -> u64 {
        self.case["world_size"].as_u64().unwrap()
    }

    pub fn use_orig_params(&self) -> bool {
        self.case["use_orig_params"].as_bool().unwrap()
    }

    pub fn strategy(&self) -> Strategy {
        self.case["strategy"].as_str().unwrap().parse().unwrap()
    }

    pub fn description(&self, key: &str) -> ModelDescription {
        ModelDescription::from_json_bytes(
            &serde_json::to_vec(&self.case[key]).unwrap(),
            &format!("{}/case.json:{key}", self.name),
        )
        .unwrap()
    }

    pub fn layout_for(&self, desc: &ModelDescription, world_size: u64, uop: bool) -> Fsdp1Layout {
        let config = LayoutConfig {
            api: Api::Fsdp1,
            world_size,
            shard_group_size: None,
            use_orig_params: uop,
            strategy: self.strategy(),
            param_dtype: None,
        };
        match layout::compute(desc, &config).unwrap() {
            Layout::Fsdp1(l) => l,
            Layout::Fsdp2(_) => unreachable!(),
        }
    }

    pub fn layout(&self, desc: &ModelDescription) -> Fsdp1Layout {
        self.layout_for(desc, self.world_size(), self.use_orig_params())
    }

    /// Recorded object `name` on `rank`.
    pub fn get(&self, rank: usize, name: &str) -> &Node {
        self.ranks[rank]
            .as_dict()
            .unwrap()
            .get_str(name)
            .unwrap_or_else(|| panic!("{}: rank {rank} has no `{name}`", self.name))
    }

    pub fn has(&self, rank: usize, name: &str) -> bool {
        self.ranks[rank].as_dict().unwrap().get_str(name).is_some()
    }

    pub fn dict(&self, rank: usize, name: &str) -> &Dict {
        self.get(rank, name).as_dict().unwrap()
    }

    /// Rank `rank`'s optimizer parameters (wrapped names) in id order.
    pub fn optim_params(&self, rank: usize) -> Vec<String> {
        self.case["per_rank"][rank]["optim_param_names"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| {
                g.as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_str().unwrap().to_owned())
            })
            .collect()
    }

    pub fn strings(&self, key: &str) -> Vec<String> {
        self.case[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_owned())
            .collect()
    }

    /// torch's message for error case `name` (every rank raises the same one).
    pub fn error(&self, name: &str) -> (String, String) {
        let e = &self.case["per_rank"][0]["errors"][name];
        (
            e["type"].as_str().unwrap().to_owned(),
            e["message"].as_str().unwrap().to_owned(),
        )
    }
}

/// Exact equality: same kinds, same key order, tensors bit for bit.
pub fn assert_same(actual: &Node, expected: &Node, path: &str) {
    match (actual, expected) {
        (Node::Dict(a), Node::Dict(e)) => {
            let ak: Vec<&Key> = a.keys().collect();
            let ek: Vec<&Key> = e.keys().collect();
            assert_eq!(ak, ek, "{path}: keys differ");
            for (k, v) in e.iter() {
                assert_same(a.get(k).unwrap(), v, &format!("{path}/{k}"));
            }
        }
        (Node::List(a), Node::List(e)) | (Node::Tuple(a), Node::Tuple(e)) => {
            assert_eq!(a.len(), e.len(), "{path}: lengths differ");
            for (i, (x, y)) in a.iter().zip(e).enumerate() {
                assert_same(x, y, &format!("{path}/{i}"));
            }
        }
        (Node::Tensor(a), Node::Tensor(e)) => {
            assert_eq!(
                (a.dtype, &a.shape),
                (e.dtype, &e.shape),
                "{path}: dtype/shape"
            );
            assert!(a.data == e.data, "{path}: tensor bytes differ");
        }
        (Node::Dist(a), Node::Dist(e)) => {
            assert_eq!(a.kind, e.kind, "{path}: kind");
            assert_eq!(
                (a.dtype, &a.global_shape),
                (e.dtype, &e.global_shape),
                "{path}"
            );
            assert_eq!(a.chunks, e.chunks, "{path}: chunk metadata");
            match (&a.local, &e.local) {
                (None, None) => {}
                (Some((ao, at)), Some((eo, et))) => {
                    assert_eq!(ao, eo, "{path}: local offsets");
                    assert_same(&Node::Tensor(at.clone()), &Node::Tensor(et.clone()), path);
                }
                _ => panic!("{path}: local shard presence differs"),
            }
        }
        (a, e) => assert_eq!(a, e, "{path}"),
    }
}

/// Sorts the state names inside every `state/<key>` entry (PyTorch's order there comes from a
/// Python set and changes from process to process).
pub fn sort_state_entries(osd: &Node) -> Node {
    let Node::Dict(d) = osd else {
        return osd.clone();
    };
    let mut out = Dict::new();
    for (k, v) in d.iter() {
        if k.as_str() == Some("state") {
            let mut state = Dict::new();
            for (pk, pv) in v.as_dict().unwrap().iter() {
                match pv {
                    Node::Dict(entry) => {
                        let mut items: Vec<(Key, Node)> = entry.clone().into_entries();
                        items.sort_by(|a, b| a.0.cmp(&b.0));
                        state.insert(pk.clone(), Node::Dict(items.into_iter().collect()));
                    }
                    other => state.insert(pk.clone(), other.clone()),
                }
            }
            out.insert(k.clone(), Node::Dict(state));
        } else {
            out.insert(k.clone(), v.clone());
        }
    }
    Node::Dict(out)
}

/// Every FSDP1 scenario (`fsdp2_ws4` is tested on its own).
pub const SCENARIOS: [&str; 15] = [
    "nested_ws2_uop0",
    "nested_ws2_uop1",
    "nested_ws4_uop0",
    "nested_ws4_uop1",
    "noshard_ws2_uop0",
    "noshard_ws2_uop1",
    "groups_ws2_uop0",
    "groups_ws2_uop1",
    "tied_ws2_uop0",
    "tied_ws2_uop1",
    "frozen_ws2_uop0",
    "frozen_ws2_uop1",
    "frozenmix_ws2_uop1",
    "unused_ws2_uop0",
    "unused_ws2_uop1",
];
