//! The model as FSDP1's optimizer code sees it: which tensor each optimizer id is, which FQNs it
//! stands for, and the wrapped model's `named_parameters()` order (spec section 1.6 B).

use std::collections::{HashMap, HashSet};

use crate::layout::{FlatParamLayout, Fsdp1Layout, LayoutError};
use crate::model::{ModelDescription, fqn};

/// One entry of the wrapped model's `named_parameters()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParamRef {
    /// A FlatParameter (`use_orig_params=False`): index into `layout.flat_params`.
    Flat(usize),
    /// An original parameter managed by FSDP (`use_orig_params=True`).
    Orig { flat: usize, index: usize },
    /// A parameter no FSDP unit manages (or an ignored one): its clean FQN.
    Plain(String),
}

/// A description and its FSDP1 layout, indexed for the views and the transforms.
#[derive(Debug)]
pub struct Fsdp1Model<'a> {
    pub description: &'a ModelDescription,
    pub layout: &'a Fsdp1Layout,
    managed: HashMap<String, (usize, usize)>,
    flat_by_fqn: HashMap<String, usize>,
    requires_grad: HashMap<String, bool>,
    units: HashSet<String>,
}

impl<'a> Fsdp1Model<'a> {
    pub fn new(
        description: &'a ModelDescription,
        layout: &'a Fsdp1Layout,
    ) -> Result<Self, LayoutError> {
        let mut managed = HashMap::new();
        let mut flat_by_fqn = HashMap::new();
        for (f, flat) in layout.flat_params.iter().enumerate() {
            flat_by_fqn.insert(flat.flat_param_fqn.clone(), f);
            for (i, name) in flat.fqns.iter().enumerate() {
                managed.insert(name.clone(), (f, i));
            }
        }
        let requires_grad: HashMap<String, bool> = description
            .params
            .iter()
            .map(|p| (p.fqn.clone(), p.requires_grad))
            .collect();
        for name in managed.keys() {
            if !requires_grad.contains_key(name) {
                return Err(LayoutError::DescriptionMismatch {
                    reason: format!("flat parameters hold `{name}`, which the description lacks"),
                });
            }
        }
        Ok(Self {
            description,
            layout,
            managed,
            flat_by_fqn,
            requires_grad,
            units: description.units.iter().cloned().collect(),
        })
    }

    pub fn use_orig_params(&self) -> bool {
        self.layout.use_orig_params
    }

    /// Ranks that share one copy of the model (the FSDP process group).
    pub fn shard_group_size(&self) -> u64 {
        self.layout.shard_group_size
    }

    pub fn flat(&self, index: usize) -> &FlatParamLayout {
        &self.layout.flat_params[index]
    }

    /// `(flat index, index in its fqns)` of a managed clean FQN.
    pub fn managed_position(&self, clean_fqn: &str) -> Option<(usize, usize)> {
        self.managed.get(clean_fqn).copied()
    }

    pub fn requires_grad(&self, clean_fqn: &str) -> bool {
        self.requires_grad.get(clean_fqn).copied().unwrap_or(true)
    }

    /// The name `named_parameters()` gives a clean FQN in the wrapped model: `_fsdp_wrapped_module.`
    /// after every FSDP unit on its path.
    pub fn raw_name(&self, clean: &str) -> String {
        let mut out = String::with_capacity(clean.len() + 32);
        if self.units.contains("") {
            out.push_str(fqn::FSDP_WRAPPED_MODULE);
            out.push('.');
        }
        let segments: Vec<&str> = clean.split('.').collect();
        let mut path = String::new();
        for (i, segment) in segments.iter().enumerate() {
            out.push_str(segment);
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(segment);
            if i + 1 < segments.len() {
                out.push('.');
                if self.units.contains(&path) {
                    out.push_str(fqn::FSDP_WRAPPED_MODULE);
                    out.push('.');
                }
            }
        }
        out
    }

    /// The wrapped model's parameters in `named_parameters()` order (tied aliases deduplicated):
    /// a module's own parameters before its children's; with `use_orig_params=False` a unit's
    /// `_flat_param` replaces its originals and so comes before everything else in its subtree.
    pub fn wrapped_params(&self) -> Vec<(String, ParamRef)> {
        let mut out = Vec::new();
        let mut emitted: HashSet<usize> = HashSet::new();
        // Units with a flat parameter, outermost first for each parameter.
        let mut flat_units: Vec<(usize, &str)> = self
            .layout
            .flat_params
            .iter()
            .enumerate()
            .map(|(i, f)| (i, f.unit_prefix.as_str()))
            .collect();
        flat_units.sort_by_key(|(_, prefix)| {
            if prefix.is_empty() {
                0
            } else {
                prefix.split('.').count()
            }
        });
        for p in &self.description.params {
            if p.shared_with.is_some() {
                continue;
            }
            let ignored = self.description.ignored.contains(&p.fqn);
            if !self.use_orig_params() && !ignored {
                for &(f, prefix) in &flat_units {
                    if fqn::is_under(&p.fqn, prefix) && emitted.insert(f) {
                        let name = self.raw_name(&self.flat(f).flat_param_fqn);
                        out.push((name, ParamRef::Flat(f)));
                    }
                }
            }
            match (self.managed_position(&p.fqn), ignored) {
                (Some((flat, index)), false) => {
                    if self.use_orig_params() {
                        out.push((self.raw_name(&p.fqn), ParamRef::Orig { flat, index }));
                    }
                }
                _ => out.push((self.raw_name(&p.fqn), ParamRef::Plain(p.fqn.clone()))),
            }
        }
        out
    }

    /// Resolves a wrapped (raw) or clean parameter name to what it is.
    pub fn param_ref(&self, name: &str) -> Option<ParamRef> {
        let clean = fqn::clean_tensor_name(name);
        if let Some(&f) = self.flat_by_fqn.get(&clean) {
            return (!self.use_orig_params()).then_some(ParamRef::Flat(f));
        }
        if clean == fqn::FLAT_PARAM || clean.ends_with("._flat_param") {
            return None;
        }
        match self.managed_position(&clean) {
            Some((flat, index)) if !self.description.ignored.contains(&clean) => {
                Some(ParamRef::Orig { flat, index })
            }
            _ => self
                .requires_grad
                .contains_key(&clean)
                .then_some(ParamRef::Plain(clean)),
        }
    }

    /// `_get_param_to_fqns`: the clean FQNs a parameter stands for.
    pub fn fqns_of(&self, param: &ParamRef) -> Vec<String> {
        match param {
            ParamRef::Flat(f) => self.flat(*f).fqns.clone(),
            ParamRef::Orig { flat, index } => vec![self.flat(*flat).fqns[*index].clone()],
            ParamRef::Plain(name) => vec![name.clone()],
        }
    }

    /// True for FlatParameters and FSDP-managed original parameters.
    pub fn is_managed(param: &ParamRef) -> bool {
        !matches!(param, ParamRef::Plain(_))
    }
}
