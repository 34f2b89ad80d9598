//! The model description: the input of `shardscope layout`.
//!
//! ```json
//! {"params": [{"fqn": "embed.weight", "shape": [7, 5], "dtype": "float32"},
//!             {"fqn": "head.weight", "shape": [7, 5], "dtype": "float32", "shared_with": "embed.weight"}],
//!  "units": ["", "block1"], "ignored": []}
//! ```
//! `params` lists clean FQNs in `model.named_parameters(remove_duplicate=False)` order.

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::model::fqn;

/// One parameter of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Clean FQN (`block1.lin.weight`).
    pub fqn: String,
    /// Original shape; `[]` for a 0-dim parameter.
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub requires_grad: bool,
    /// For a tied weight: the FQN of the earlier parameter it aliases (resolved to the first one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_with: Option<String>,
}

impl ParamSpec {
    /// Number of elements (1 for a 0-dim parameter). Validated not to overflow at parse time.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A validated model description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelDescription {
    pub params: Vec<ParamSpec>,
    /// Module prefixes of the FSDP units, as given (`""` is the root).
    pub units: Vec<String>,
    /// FQNs of parameters FSDP ignores.
    pub ignored: BTreeSet<String>,
}

/// What is wrong with a model description. Each message names the offending entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptionError {
    /// The bytes are not JSON of the expected shape (unknown field, wrong type, missing `params`).
    #[error("{source_name}: not a valid model description: {message}")]
    Syntax {
        source_name: String,
        message: String,
    },
    /// A parameter FQN is empty or has an empty dotted segment (`a..b`, `.a`).
    #[error("parameter #{index} `{fqn}`: invalid FQN (empty name or empty dotted segment)")]
    BadFqn { index: usize, fqn: String },
    /// The same FQN is listed twice.
    #[error(
        "parameter `{fqn}` is listed twice (entries #{first} and #{second}); list a tied weight once per name and mark later names with `shared_with`"
    )]
    DuplicateParam {
        fqn: String,
        first: usize,
        second: usize,
    },
    /// `dtype` is not a torch dtype name.
    #[error(
        "parameter `{fqn}`: unknown dtype `{dtype}` (expected a torch dtype name such as float32 or bfloat16)"
    )]
    UnknownDType { fqn: String, dtype: String },
    /// The product of the shape overflows 64 bits.
    #[error("parameter `{fqn}`: shape {shape:?} has more elements than fit in 64 bits")]
    NumelOverflow { fqn: String, shape: Vec<u64> },
    /// `shared_with` names no earlier parameter.
    #[error(
        "parameter `{fqn}`: `shared_with` names `{target}`, which is not an earlier parameter of the description"
    )]
    UnknownSharedTarget { fqn: String, target: String },
    /// A tied weight disagrees with the parameter it aliases.
    #[error(
        "parameter `{fqn}` is tied to `{target}` but its {what} differs ({alias_value} vs {target_value}); tied weights are one tensor"
    )]
    SharedMismatch {
        fqn: String,
        target: String,
        what: &'static str,
        alias_value: String,
        target_value: String,
    },
    /// The same unit prefix is listed twice.
    #[error("unit `{unit}` is listed twice in `units`")]
    DuplicateUnit { unit: String },
    /// A unit prefix is not a module path (empty segment, or it names a parameter).
    #[error("unit `{unit}`: {reason}")]
    BadUnit { unit: String, reason: String },
    /// `ignored` names an unknown parameter.
    #[error("ignored parameter `{fqn}` is not a parameter of the description")]
    UnknownIgnored { fqn: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescription {
    params: Vec<RawParam>,
    #[serde(default)]
    units: Vec<String>,
    #[serde(default)]
    ignored: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParam {
    fqn: String,
    shape: Vec<u64>,
    dtype: String,
    #[serde(default = "default_true")]
    requires_grad: bool,
    #[serde(default)]
    shared_with: Option<String>,
}

fn default_true() -> bool {
    true
}

fn valid_dotted(name: &str) -> bool {
    !name.is_empty() && name.split('.').all(|segment| !segment.is_empty())
}

impl ModelDescription {
    /// Parses and validates a description from JSON bytes. `source_name` (a file name) is used in
    /// error messages.
    pub fn from_json_bytes(bytes: &[u8], source_name: &str) -> Result<Self, DescriptionError> {
        let raw: RawDescription =
            serde_json::from_slice(bytes).map_err(|err| DescriptionError::Syntax {
                source_name: source_name.to_owned(),
                message: err.to_string(),
            })?;
        let mut params = Vec::with_capacity(raw.params.len());
        for (index, p) in raw.params.into_iter().enumerate() {
            let dtype = p
                .dtype
                .parse::<DType>()
                .map_err(|_| DescriptionError::UnknownDType {
                    fqn: p.fqn.clone(),
                    dtype: p.dtype.clone(),
                })?;
            if !valid_dotted(&p.fqn) {
                return Err(DescriptionError::BadFqn { index, fqn: p.fqn });
            }
            params.push(ParamSpec {
                fqn: p.fqn,
                shape: p.shape,
                dtype,
                requires_grad: p.requires_grad,
                shared_with: p.shared_with,
            });
        }
        Self::new(params, raw.units, raw.ignored)
    }

    /// Validates parameters, units and ignored FQNs given as values.
    #[allow(
        clippy::too_many_lines,
        reason = "validates every field of a model description (names, shapes, aliases, units, ignored) with a message each"
    )]
    pub fn new(
        mut params: Vec<ParamSpec>,
        units: Vec<String>,
        ignored: Vec<String>,
    ) -> Result<Self, DescriptionError> {
        let mut index_of: HashMap<String, usize> = HashMap::with_capacity(params.len());
        for i in 0..params.len() {
            let p = &params[i];
            if !valid_dotted(&p.fqn) {
                return Err(DescriptionError::BadFqn {
                    index: i,
                    fqn: p.fqn.clone(),
                });
            }
            if let Some(&first) = index_of.get(&p.fqn) {
                return Err(DescriptionError::DuplicateParam {
                    fqn: p.fqn.clone(),
                    first,
                    second: i,
                });
            }
            if crate::shape::numel(&p.shape).is_none() {
                return Err(DescriptionError::NumelOverflow {
                    fqn: p.fqn.clone(),
                    shape: p.shape.clone(),
                });
            }
            if let Some(target) = p.shared_with.clone() {
                let Some(&target_index) = index_of.get(&target) else {
                    return Err(DescriptionError::UnknownSharedTarget {
                        fqn: p.fqn.clone(),
                        target,
                    });
                };
                // Resolve chains: an alias of an alias aliases the first parameter.
                let primary_index = match &params[target_index].shared_with {
                    Some(first) => index_of[first],
                    None => target_index,
                };
                let primary = &params[primary_index];
                let checks: [(&'static str, String, String); 3] = [
                    (
                        "shape",
                        format!("{:?}", p.shape),
                        format!("{:?}", primary.shape),
                    ),
                    ("dtype", p.dtype.to_string(), primary.dtype.to_string()),
                    (
                        "requires_grad",
                        p.requires_grad.to_string(),
                        primary.requires_grad.to_string(),
                    ),
                ];
                for (what, alias_value, target_value) in checks {
                    if alias_value != target_value {
                        return Err(DescriptionError::SharedMismatch {
                            fqn: p.fqn.clone(),
                            target: primary.fqn.clone(),
                            what,
                            alias_value,
                            target_value,
                        });
                    }
                }
                params[i].shared_with = Some(params[primary_index].fqn.clone());
            }
            index_of.insert(params[i].fqn.clone(), i);
        }

        let mut seen_units = BTreeSet::new();
        for unit in &units {
            if !seen_units.insert(unit.as_str()) {
                return Err(DescriptionError::DuplicateUnit { unit: unit.clone() });
            }
            if !unit.is_empty() && !valid_dotted(unit) {
                return Err(DescriptionError::BadUnit {
                    unit: unit.clone(),
                    reason: "not a module path (empty dotted segment)".to_owned(),
                });
            }
            if index_of.contains_key(unit) {
                return Err(DescriptionError::BadUnit {
                    unit: unit.clone(),
                    reason: "names a parameter, not a module; FSDP units are modules".to_owned(),
                });
            }
        }

        let mut ignored_set = BTreeSet::new();
        for name in ignored {
            if !index_of.contains_key(&name) {
                return Err(DescriptionError::UnknownIgnored { fqn: name });
            }
            ignored_set.insert(name);
        }
        // Ignoring a tensor ignores every name it has.
        let primaries_ignored: BTreeSet<String> = params
            .iter()
            .filter(|p| ignored_set.contains(&p.fqn))
            .map(|p| p.shared_with.clone().unwrap_or_else(|| p.fqn.clone()))
            .collect();
        for p in &params {
            let primary = p.shared_with.as_deref().unwrap_or(&p.fqn);
            if primaries_ignored.contains(primary) {
                ignored_set.insert(p.fqn.clone());
            }
        }

        Ok(Self {
            params,
            units,
            ignored: ignored_set,
        })
    }

    /// The unit a parameter belongs to: the longest unit prefix containing it, if any.
    pub fn unit_of(&self, param_fqn: &str) -> Option<&str> {
        self.units
            .iter()
            .filter(|u| fqn::is_under(param_fqn, u))
            .max_by_key(|u| if u.is_empty() { 0 } else { u.len() + 1 })
            .map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelDescription, DescriptionError> {
        ModelDescription::from_json_bytes(json.as_bytes(), "model.json")
    }

    #[test]
    fn parses_the_documented_example() {
        let d = parse(
            r#"{"params": [
                {"fqn": "scale", "shape": [2], "dtype": "float32"},
                {"fqn": "embed.weight", "shape": [7, 5], "dtype": "float32"},
                {"fqn": "head.weight", "shape": [7, 5], "dtype": "torch.float32", "shared_with": "embed.weight"},
                {"fqn": "frozen.weight", "shape": [3], "dtype": "float32", "requires_grad": false}],
              "units": ["", "block1", "block2"]}"#,
        )
        .unwrap();
        assert_eq!(d.params.len(), 4);
        assert_eq!(d.params[2].shared_with.as_deref(), Some("embed.weight"));
        assert!(!d.params[3].requires_grad);
        assert_eq!(d.unit_of("block1.x"), Some("block1"));
        assert_eq!(d.unit_of("block10.x"), Some(""));
    }

    #[test]
    fn alias_chains_resolve_to_the_first_parameter() {
        let d = parse(
            r#"{"params": [
                {"fqn": "a", "shape": [3], "dtype": "float32"},
                {"fqn": "b", "shape": [3], "dtype": "float32", "shared_with": "a"},
                {"fqn": "c", "shape": [3], "dtype": "float32", "shared_with": "b"}]}"#,
        )
        .unwrap();
        assert_eq!(d.params[2].shared_with.as_deref(), Some("a"));
    }
}
