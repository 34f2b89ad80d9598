//! Key plans: the key order of FSDP1's FULL and LOCAL model state dicts (and where each entry comes
//! from), computed from names and the layout only, so a caller can lay out a file before reading
//! any tensor (the native runner's per-rank `reshard`/`convert`, the FSDP1 view). The transforms'
//! `model_full_from_local` and `model_local_from_full` produce exactly these orders.

use std::collections::{HashMap, HashSet};

use crate::layout::Fsdp1Model;
use crate::model::fqn;

/// Tied aliases inside flat parameters: alias FQN -> primary FQN.
pub fn managed_aliases(model: &Fsdp1Model<'_>) -> HashMap<String, String> {
    model
        .layout
        .flat_params
        .iter()
        .flat_map(|f| f.shared_params.iter())
        .map(|s| (s.fqn.clone(), s.prim_fqn.clone()))
        .collect()
}

/// Number of dotted segments of a module prefix (`""` is 0).
pub fn depth(prefix: &str) -> usize {
    if prefix.is_empty() {
        0
    } else {
        prefix.split('.').count()
    }
}

fn parent(name: &str) -> &str {
    name.rfind('.').map_or("", |i| &name[..i])
}

/// `nn.Module.state_dict` order from parameter and buffer names (`aliases` from
/// [`managed_aliases`]): the key order of `model_full_from_local`.
#[allow(clippy::implicit_hasher)]
pub fn module_order(
    model: &Fsdp1Model<'_>,
    aliases: &HashMap<String, String>,
    buffers: &[String],
) -> Vec<String> {
    let mut children: HashMap<String, Vec<String>> = HashMap::new();
    let mut known: HashSet<String> = HashSet::from([String::new()]);
    let mut own_params: HashMap<String, (Vec<String>, Vec<String>)> = HashMap::new();
    let mut own_buffers: HashMap<String, Vec<String>> = HashMap::new();
    let mut add_module = |module: &str, known: &mut HashSet<String>| {
        let mut path = String::new();
        for segment in module.split('.').filter(|s| !s.is_empty()) {
            let child = fqn::join(&path, segment);
            if known.insert(child.clone()) {
                children
                    .entry(path.clone())
                    .or_default()
                    .push(child.clone());
            }
            path = child;
        }
    };
    for p in &model.description.params {
        add_module(parent(&p.fqn), &mut known);
        let slot = own_params.entry(parent(&p.fqn).to_owned()).or_default();
        if aliases.contains_key(&p.fqn) {
            slot.1.push(p.fqn.clone());
        } else {
            slot.0.push(p.fqn.clone());
        }
    }
    for b in buffers {
        add_module(parent(b), &mut known);
        own_buffers
            .entry(parent(b).to_owned())
            .or_default()
            .push(b.clone());
    }
    let mut out = Vec::new();
    let mut stack = vec![String::new()];
    while let Some(module) = stack.pop() {
        if let Some((params, tied)) = own_params.get(&module) {
            out.extend(params.iter().cloned());
            out.extend(tied.iter().cloned());
        }
        if let Some(b) = own_buffers.get(&module) {
            out.extend(b.iter().cloned());
        }
        if let Some(c) = children.get(&module) {
            stack.extend(c.iter().rev().cloned());
        }
    }
    out
}

/// Where an entry of the FULL model state dict comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FullKey {
    /// Real parameter `param` of flat parameter `flat` (tied aliases point at their primary).
    Managed { flat: usize, param: usize },
    /// Copied from the first rank's LOCAL state dict under the same key (buffers, parameters FSDP
    /// does not manage).
    Plain,
}

/// The keys of `model_full_from_local(model, locals)`, in order, from the keys of `locals[0]`.
pub fn full_key_plan(
    model: &Fsdp1Model<'_>,
    first_local_keys: &[String],
) -> Vec<(String, FullKey)> {
    let aliases = managed_aliases(model);
    let mut values: HashMap<String, FullKey> = HashMap::new();
    for (f, flat) in model.layout.flat_params.iter().enumerate() {
        for (i, name) in flat.fqns.iter().enumerate() {
            values.insert(name.clone(), FullKey::Managed { flat: f, param: i });
        }
    }
    for (alias, primary) in &aliases {
        if let Some(v) = values.get(primary).cloned() {
            values.insert(alias.clone(), v);
        }
    }
    let flat_keys: HashSet<&str> = model
        .layout
        .flat_params
        .iter()
        .map(|f| f.flat_param_fqn.as_str())
        .collect();
    let param_names: HashSet<&str> = model
        .description
        .params
        .iter()
        .map(|p| p.fqn.as_str())
        .collect();
    let mut buffers: Vec<String> = Vec::new();
    for name in first_local_keys {
        if flat_keys.contains(name.as_str()) {
            continue;
        }
        if param_names.contains(name.as_str()) {
            values.entry(name.clone()).or_insert(FullKey::Plain);
        } else {
            values.insert(name.clone(), FullKey::Plain);
            buffers.push(name.clone());
        }
    }
    let mut out = Vec::new();
    for name in module_order(model, &aliases, &buffers) {
        if let Some(v) = values.remove(&name) {
            out.push((name, v));
        }
    }
    out
}

/// Where an entry of a LOCAL model state dict comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalKey {
    /// The `_flat_param` ShardedTensor of flat parameter `.0`.
    Flat(usize),
    /// `use_orig_params=True`: the 1-D view of real parameter `param` of `flat` in the rank's shard.
    View { flat: usize, param: usize },
    /// Copied from the FULL state dict entry of the same key.
    Plain,
}

/// The keys of `model_local_from_full(model, rank, full)`, in order, from the plan of `full`
/// ([`full_key_plan`]). The order does not depend on the rank.
pub fn local_key_plan(
    model: &Fsdp1Model<'_>,
    full: &[(String, FullKey)],
) -> Vec<(String, LocalKey)> {
    let aliases = managed_aliases(model);
    let flats = &model.layout.flat_params;
    let mut entries: Vec<(String, LocalKey)> = Vec::new();
    if model.use_orig_params() {
        for (name, _) in full {
            let primary = aliases.get(name).unwrap_or(name);
            match model.managed_position(primary) {
                Some((flat, param)) => entries.push((name.clone(), LocalKey::View { flat, param })),
                None => entries.push((name.clone(), LocalKey::Plain)),
            }
        }
        let mut order: Vec<usize> = (0..flats.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(depth(&flats[i].unit_prefix)));
        for i in order {
            let prefix = &flats[i].unit_prefix;
            let last = entries
                .iter()
                .rposition(|(k, _)| prefix.is_empty() || fqn::is_under(k, prefix));
            let at = last.map_or(entries.len(), |p| p + 1);
            entries.insert(at, (flats[i].flat_param_fqn.clone(), LocalKey::Flat(i)));
        }
    } else {
        let mut emitted: HashSet<usize> = HashSet::new();
        let mut outer_first: Vec<usize> = (0..flats.len()).collect();
        outer_first.sort_by_key(|&i| depth(&flats[i].unit_prefix));
        for (name, _) in full {
            for &i in &outer_first {
                let prefix = &flats[i].unit_prefix;
                if (prefix.is_empty() || fqn::is_under(name, prefix)) && emitted.insert(i) {
                    entries.push((flats[i].flat_param_fqn.clone(), LocalKey::Flat(i)));
                }
            }
            if model.managed_position(name).is_none() && !aliases.contains_key(name) {
                entries.push((name.clone(), LocalKey::Plain));
            }
        }
    }
    entries
}
