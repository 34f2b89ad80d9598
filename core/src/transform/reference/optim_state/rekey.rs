//! `FSDP.rekey_optim_state_dict`: optimizer ids to FQNs and back.

use std::collections::HashMap;

use crate::model::tree::{Dict, Key, Node};
use crate::transform::optim_state::parts::{dict_at, group_params, groups_of, state_of};
use crate::transform::{TransformError, pyrepr};

fn check_uniform_keys(state: &Dict) -> Result<Option<bool>, TransformError> {
    let ints = state.keys().filter(|k| matches!(k, Key::Int(_))).count();
    let strs = state.len() - ints;
    if ints > 0 && strs > 0 {
        let keys: Vec<String> = state
            .keys()
            .map(|k| match k {
                Key::Int(i) => i.to_string(),
                Key::Str(s) => pyrepr::string(s),
            })
            .collect();
        return Err(TransformError::InvalidParameterKeys {
            keys: format!("dict_keys([{}])", keys.join(", ")),
        });
    }
    Ok(if state.is_empty() {
        None
    } else {
        Some(ints > 0)
    })
}

/// `FSDP.rekey_optim_state_dict(osd, PARAM_NAME, model, optim=...)` for a model whose optimizer
/// holds `names` (one FQN per id, id order). Name-keyed input is returned unchanged.
pub fn rekey_ids_to_fqns(osd: &Dict, names: &[String]) -> Result<Dict, TransformError> {
    let state = state_of(osd, "")?;
    if check_uniform_keys(state)? == Some(false) {
        return Ok(osd.clone());
    }
    let name_of = |id: i64, path: &str| -> Result<String, TransformError> {
        usize::try_from(id)
            .ok()
            .and_then(|i| names.get(i))
            .cloned()
            .ok_or_else(|| TransformError::UnknownParam {
                path: path.to_owned(),
                what: "optimizer id",
                name: id.to_string(),
            })
    };
    let mut new_state = Dict::new();
    for (k, v) in state.iter() {
        let id = k.as_int().unwrap_or_default();
        new_state.insert(Key::Str(name_of(id, "state")?), v.clone());
    }
    let groups = rekey_groups(osd, |n, path| match n {
        Node::Int(id) => Ok(Node::Str(name_of(*id, path)?)),
        other => Err(TransformError::WrongKind {
            path: path.to_owned(),
            expected: "int",
            found: other.kind_name(),
        }),
    })?;
    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(new_state));
    out.insert(Key::str("param_groups"), Node::List(groups));
    Ok(out)
}

/// `FSDP.rekey_optim_state_dict(osd, PARAM_ID, model, optim=...)`: the inverse of
/// [`rekey_ids_to_fqns`]. Id-keyed input is returned unchanged.
pub fn rekey_fqns_to_ids(osd: &Dict, names: &[String]) -> Result<Dict, TransformError> {
    let state = state_of(osd, "")?;
    if check_uniform_keys(state)? == Some(true) {
        return Ok(osd.clone());
    }
    let ids: HashMap<&str, i64> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i as i64))
        .collect();
    let id_of = |name: &str, path: &str| -> Result<i64, TransformError> {
        ids.get(name)
            .copied()
            .ok_or_else(|| TransformError::UnknownParam {
                path: path.to_owned(),
                what: "parameter",
                name: name.to_owned(),
            })
    };
    let mut new_state = Dict::new();
    for (k, v) in state.iter() {
        new_state.insert(Key::Int(id_of(&k.to_string(), "state")?), v.clone());
    }
    let groups = rekey_groups(osd, |n, path| match n {
        Node::Str(s) => Ok(Node::Int(id_of(s, path)?)),
        other => Err(TransformError::WrongKind {
            path: path.to_owned(),
            expected: "str",
            found: other.kind_name(),
        }),
    })?;
    let mut out = Dict::new();
    out.insert(Key::str("state"), Node::Dict(new_state));
    out.insert(Key::str("param_groups"), Node::List(groups));
    Ok(out)
}

fn rekey_groups(
    osd: &Dict,
    map: impl Fn(&Node, &str) -> Result<Node, TransformError>,
) -> Result<Vec<Node>, TransformError> {
    let groups = groups_of(osd, "")?.ok_or_else(|| TransformError::MissingKey {
        path: String::new(),
        key: "param_groups".to_owned(),
    })?;
    let mut out = Vec::with_capacity(groups.len());
    for (g, group) in groups.iter().enumerate() {
        let path = format!("param_groups/{g}/params");
        let group = dict_at(group, &path)?;
        let params = group_params(group, &path)?;
        let mut mapped: Vec<Node> = params
            .iter()
            .map(|p| map(p, &path))
            .collect::<Result<_, _>>()?;
        mapped.sort_by(|a, b| match (a, b) {
            (Node::Int(x), Node::Int(y)) => x.cmp(y),
            (Node::Str(x), Node::Str(y)) => x.cmp(y),
            _ => std::cmp::Ordering::Equal,
        });
        let mut new_group = group.clone();
        new_group.insert(Key::str("params"), Node::List(mapped));
        out.push(Node::Dict(new_group));
    }
    Ok(out)
}
