//! Fully qualified names (FQNs) of parameters and the prefixes FSDP adds to them.

/// The attribute under which FSDP1 stores the wrapped module.
pub const FSDP_WRAPPED_MODULE: &str = "_fsdp_wrapped_module";
/// The attribute under which activation-checkpoint wrappers store the wrapped module.
pub const CHECKPOINT_WRAPPED_MODULE: &str = "_checkpoint_wrapped_module";
/// The name under which FSDP1 registers a `FlatParameter`.
pub const FLAT_PARAM: &str = "_flat_param";

/// `clean_tensor_name` as FSDP1 applies it: remove every `_fsdp_wrapped_module.`, then every
/// `_checkpoint_wrapped_module.` (plain substring removal, not anchored at a prefix).
pub fn clean_tensor_name(raw: &str) -> String {
    raw.replace("_fsdp_wrapped_module.", "")
        .replace("_checkpoint_wrapped_module.", "")
}

/// Joins a module prefix and a relative name the way `named_parameters` does (`""` is the root).
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else if name.is_empty() {
        prefix.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

/// True when `fqn` lies inside the module `prefix` (`""` contains everything).
/// The match is on dot boundaries: `block2.1` contains `block2.1.weight` but not `block2.10.weight`.
pub fn is_under(fqn: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || fqn
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// The FQN relative to `prefix` (`fqn` must lie under it).
pub fn relative_to<'a>(fqn: &'a str, prefix: &str) -> &'a str {
    if prefix.is_empty() {
        fqn
    } else {
        fqn.get(prefix.len() + 1..).unwrap_or("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_removes_wrappers_anywhere() {
        assert_eq!(
            clean_tensor_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.q.weight"),
            "layers.0.attn.q.weight"
        );
        assert_eq!(
            clean_tensor_name("layers.0._checkpoint_wrapped_module.mlp.w"),
            "layers.0.mlp.w"
        );
        assert_eq!(clean_tensor_name("module.lin.weight"), "module.lin.weight");
    }

    #[test]
    fn prefixes_match_on_dot_boundaries() {
        assert!(is_under("block2.1.weight", "block2.1"));
        assert!(!is_under("block2.10.weight", "block2.1"));
        assert!(!is_under("block2.1", "block2.1"));
        assert!(is_under("anything", ""));
        assert_eq!(relative_to("block2.1.weight", "block2.1"), "weight");
        assert_eq!(relative_to("weight", ""), "weight");
    }
}
