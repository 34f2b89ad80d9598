//! The names a model's parameters take in Hugging Face's naming, for the FQN map: the mapping
//! `shardscope convert --to hf` uses (`shardscope_core::transform::mapping`), chosen by a Hugging
//! Face `config.json` opened beside the checkpoint and by the parameters' names.

use std::collections::BTreeMap;

use shardscope_core::transform::mapping::{self, Recipe, Stored};

use crate::view::LayoutView;

/// A Hugging Face config opened in the viewer.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub name: String,
    pub config: serde_json::Value,
}

/// The Hugging Face names of a layout's parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HfNames {
    /// The config's file name.
    pub config: String,
    /// The mapping chosen (`torchtitan-llama3`), when one applies.
    pub mapping: Option<String>,
    /// Per parameter FQN: the names it becomes (several for a grouped expert tensor split one by
    /// one; none for a tensor the mapping leaves out).
    pub names: BTreeMap<String, Vec<String>>,
    /// Why no names are shown (no mapping for this config and these names, a shape that does not
    /// fit the config).
    pub error: Option<String>,
}

impl HfNames {
    /// What the FQN map shows for `fqn`: the name, the first of several with their count, or
    /// that the mapping leaves it out.
    pub fn label(&self, fqn: &str) -> String {
        match self.names.get(fqn).map(Vec::as_slice) {
            None => String::new(),
            Some([]) => "(left out by the mapping)".to_owned(),
            Some([one]) => one.clone(),
            Some([first, rest @ ..]) => format!("{first} (+{} more)", rest.len()),
        }
    }

    /// Whether one of `fqn`'s names contains `needle_lower` (lower case).
    pub fn matches(&self, fqn: &str, needle_lower: &str) -> bool {
        self.names
            .get(fqn)
            .is_some_and(|n| n.iter().any(|n| n.to_lowercase().contains(needle_lower)))
    }
}

/// The Hugging Face names of `view`'s parameters under `config`. `prefix` is the app-state prefix
/// the checkpoint stores the model under (`model.`), left out of the names the mapping reads.
pub fn compute(config: &HfConfig, view: &LayoutView, prefix: Option<&str>) -> HfNames {
    let mut out = HfNames {
        config: config.name.clone(),
        ..HfNames::default()
    };
    let strip = |fqn: &str| -> String {
        prefix
            .and_then(|p| fqn.strip_prefix(p))
            .unwrap_or(fqn)
            .to_owned()
    };
    // Tied aliases are one stored tensor (the mapping's `tie` handles the other name).
    let stored: Vec<Stored> = view
        .params
        .iter()
        .filter(|p| p.shared_with.is_none())
        .map(|p| Stored {
            name: strip(&p.fqn),
            dtype: p.dtype,
            shape: p.shape.clone(),
        })
        .collect();
    let fqn_of: BTreeMap<String, &str> = view
        .params
        .iter()
        .map(|p| (strip(&p.fqn), p.fqn.as_str()))
        .collect();
    let names: Vec<&str> = stored.iter().map(|s| s.name.as_str()).collect();
    let files = mapping::builtin();
    let (file, direction) = match mapping::choose(&files, "hf", &config.config, &names) {
        Ok(chosen) => chosen,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    out.mapping = Some(file.name.clone());
    let plan = match mapping::plan(file, direction, &config.config, &stored) {
        Ok(plan) => plan,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    for o in &plan.outputs {
        let sources = match &o.recipe {
            Recipe::Zeros { .. } => continue,
            r => r.sources(),
        };
        for s in sources {
            if let Some(fqn) = fqn_of.get(s) {
                out.names
                    .entry((*fqn).to_owned())
                    .or_default()
                    .push(o.name.clone());
            }
        }
    }
    for d in &plan.dropped {
        if let Some(fqn) = fqn_of.get(d.as_str()) {
            out.names.entry((*fqn).to_owned()).or_default();
        }
    }
    out
}

/// The Hugging Face names of `view`'s parameters, the checkpoint (`index`) opened: its app-state
/// prefix (`model.`) is left out of the names the mapping reads, unless the names fit the mapping
/// only with it.
pub fn of_layout(
    config: &HfConfig,
    view: &LayoutView,
    index: Option<&shardscope_core::index::CheckpointIndex>,
) -> HfNames {
    let prefix = index
        .and_then(shardscope_core::checkpoint::app_state_prefix)
        .map(|p| format!("{p}."));
    let names = compute(config, view, prefix.as_deref());
    if names.error.is_some() && prefix.is_some() {
        // The layout may already hold the names without the app-state prefix.
        let plain = compute(config, view, None);
        if plain.error.is_none() {
            return plain;
        }
    }
    names
}

/// Whether a JSON document is a Hugging Face model config (what `config.json` of a model folder
/// holds): an object with `architectures` or `model_type`, and no model description's `params`.
pub fn is_hf_config(value: &serde_json::Value) -> bool {
    value.as_object().is_some_and(|o| {
        (o.contains_key("architectures") || o.contains_key("model_type"))
            && !o.contains_key("params")
    })
}
