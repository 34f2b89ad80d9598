//! The model a checkpoint should load into: from a model description or a reference checkpoint.

use std::collections::{BTreeMap, BTreeSet};

use crate::dtype::DType;
use crate::index::{CheckpointIndex, ChunkEncoding};

use super::parts::split_parts;
use crate::model::description::ModelDescription;

/// One tensor the target model expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetTensor {
    pub shape: Vec<u64>,
    pub dtype: Option<DType>,
}

/// Where a target comes from: it decides how strict the key comparison is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// A reference checkpoint (`model.state_dict()`): parameters and buffers.
    Reference,
    /// A model description: parameters only (extra keys may be buffers).
    Description,
}

/// The model a checkpoint should load into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub kind: TargetKind,
    /// Every key the target's `load_state_dict` expects (tied aliases included).
    pub tensors: BTreeMap<String, TargetTensor>,
    /// Groups of keys that are one tensor (tied weights): any one of them present is enough.
    pub ties: Vec<BTreeSet<String>>,
    /// Number of distinct parameters (`model.parameters()`, tied weights once); for a reference an
    /// upper bound (buffers count too).
    pub params: usize,
    /// Parameters with `requires_grad` (description only): the fewest an optimizer may hold.
    pub trainable: Option<usize>,
    /// Their FQNs (description only; tied aliases left out): each needs optimizer state in an
    /// FQN-keyed optimizer state dict, or torch's `set_optimizer_state_dict` refuses.
    pub trainable_names: Option<BTreeSet<String>>,
    /// How to name the target in fix commands (`--model model.json`).
    pub label: String,
}

impl Target {
    /// The target a model description gives: its parameters, ties from `shared_with`.
    pub fn from_description(model: &ModelDescription, label: &str) -> Target {
        let mut tensors = BTreeMap::new();
        let mut ties: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut params = 0usize;
        let mut trainable = 0usize;
        let mut trainable_names = BTreeSet::new();
        for p in &model.params {
            tensors.insert(
                p.fqn.clone(),
                TargetTensor {
                    shape: p.shape.clone(),
                    dtype: Some(p.dtype),
                },
            );
            if let Some(partner) = &p.shared_with {
                let group = ties.entry(partner.clone()).or_default();
                group.insert(partner.clone());
                group.insert(p.fqn.clone());
            } else {
                params += 1;
                trainable += usize::from(p.requires_grad);
                if p.requires_grad {
                    trainable_names.insert(p.fqn.clone());
                }
            }
        }
        Target {
            kind: TargetKind::Description,
            tensors,
            ties: ties.into_values().collect(),
            params,
            trainable: Some(trainable),
            trainable_names: Some(trainable_names),
            label: label.to_owned(),
        }
    }

    /// The target a reference checkpoint gives: its tensors (the model part when nested), ties
    /// from shared storage (same file, byte range, view).
    pub fn from_reference(index: &CheckpointIndex, label: &str) -> Target {
        let parts = split_parts(index);
        let model = parts
            .models
            .iter()
            .find(|p| p.name.as_deref() == Some("model"))
            .or_else(|| parts.models.first());
        let mut tensors = BTreeMap::new();
        let mut by_storage: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        if let Some(model) = model {
            for (key, e) in &model.entries {
                let Some(shape) = &e.shape else { continue };
                tensors.insert(
                    key.clone(),
                    TargetTensor {
                        shape: shape.clone(),
                        dtype: e.dtype,
                    },
                );
                if let [c] = e.chunks.as_slice()
                    && let ChunkEncoding::Raw {
                        storage_offset,
                        strides,
                    } = &c.encoding
                {
                    let id = format!(
                        "{}@{}+{}:{storage_offset}:{:?}:{strides:?}",
                        c.file, c.byte_offset, c.byte_length, c.sizes
                    );
                    by_storage.entry(id).or_default().insert(key.clone());
                }
            }
        }
        let ties: Vec<BTreeSet<String>> =
            by_storage.into_values().filter(|g| g.len() > 1).collect();
        let tied_extra: usize = ties.iter().map(|g| g.len() - 1).sum();
        Target {
            kind: TargetKind::Reference,
            params: tensors.len().saturating_sub(tied_extra),
            tensors,
            ties,
            trainable: None,
            trainable_names: None,
            label: label.to_owned(),
        }
    }

    pub(super) fn tied_partner_present(
        &self,
        key: &str,
        present: &BTreeSet<String>,
    ) -> Option<String> {
        self.ties.iter().find(|g| g.contains(key)).and_then(|g| {
            g.iter()
                .find(|k| *k != key && present.contains(*k))
                .cloned()
        })
    }
}
