//! Where the parts of an optimizer state dict are (`state`, `param_groups`, a group's `params`),
//! which states are positive-dimension tensors, and element slices of a state tensor.

use crate::model::tree::{Dict, Node, Tensor};
use crate::transform::{TransformError, sub};

pub(crate) fn dict_at<'n>(node: &'n Node, path: &str) -> Result<&'n Dict, TransformError> {
    node.as_dict().ok_or_else(|| TransformError::WrongKind {
        path: path.to_owned(),
        expected: "dict",
        found: node.kind_name(),
    })
}

pub(crate) fn state_of<'n>(osd: &'n Dict, path: &str) -> Result<&'n Dict, TransformError> {
    match osd.get_str("state") {
        Some(s) => dict_at(s, &sub(path, "state")),
        None => Err(TransformError::NoStateKey),
    }
}

pub(crate) fn groups_of<'n>(
    osd: &'n Dict,
    path: &str,
) -> Result<Option<&'n [Node]>, TransformError> {
    match osd.get_str("param_groups") {
        None => Ok(None),
        Some(g) => g
            .as_list()
            .map(Some)
            .ok_or_else(|| TransformError::WrongKind {
                path: sub(path, "param_groups"),
                expected: "list",
                found: g.kind_name(),
            }),
    }
}

pub(crate) fn is_pos_tensor(n: &Node) -> bool {
    matches!(n, Node::Tensor(t) if t.dim() > 0) || matches!(n, Node::Dist(_))
}

pub(crate) fn is_zero_dim(n: &Node) -> bool {
    matches!(n, Node::Tensor(t) if t.dim() == 0)
}

/// Elements `[start, start + numel)` of `t` with `shape`; a structure-only tensor (no bytes, see
/// [`local_optim_from_full`]) gives one too.
pub(crate) fn slice_elems(t: &Tensor, start: u64, numel: u64, shape: Vec<u64>) -> Tensor {
    let s = t.dtype.size_bytes();
    let data = if is_structure_only(t) {
        Vec::new()
    } else {
        t.data[start as usize * s..(start + numel) as usize * s].to_vec()
    };
    Tensor {
        dtype: t.dtype,
        shape,
        data,
    }
}

/// A tensor given by dtype and shape only (positive size, no bytes).
pub(crate) fn is_structure_only(t: &Tensor) -> bool {
    t.data.is_empty() && t.numel() > 0
}

/// The `params` list of one param group (`path` names the group in errors).
pub(crate) fn group_params<'d>(group: &'d Dict, path: &str) -> Result<&'d [Node], TransformError> {
    group
        .get_str("params")
        .and_then(Node::as_list)
        .ok_or_else(|| TransformError::MissingKey {
            path: path.to_owned(),
            key: "params".to_owned(),
        })
}
