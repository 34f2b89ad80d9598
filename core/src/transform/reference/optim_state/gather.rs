//! Every ShardedTensor/DTensor of a state tree replaced by the full tensor gathered from every
//! rank's tree (the offline `_gather_state_dict`).

use crate::model::tree::{Dict, Node};
use crate::transform::reference::chunk::full_from_sharded_chunks;
use crate::transform::{TransformError, sub};

/// Replaces every ShardedTensor/DTensor in rank 0's tree by the full tensor gathered from all
/// ranks' trees at the same path (the offline `_gather_state_dict`).
pub fn full_from_sharded_tree(per_rank: &[&Node]) -> Result<Node, TransformError> {
    gather_node(per_rank, "")
}

fn gather_node(nodes: &[&Node], path: &str) -> Result<Node, TransformError> {
    let first = nodes[0];
    match first {
        Node::Dist(_) => {
            let mut pieces = Vec::with_capacity(nodes.len());
            for (r, n) in nodes.iter().enumerate() {
                match n {
                    Node::Dist(d) => pieces.push(d),
                    other => {
                        return Err(TransformError::WrongKind {
                            path: format!("rank{r}{path}"),
                            expected: "ShardedTensor or DTensor",
                            found: other.kind_name(),
                        });
                    }
                }
            }
            Ok(Node::Tensor(full_from_sharded_chunks(&pieces, path)?))
        }
        Node::Dict(d) => {
            let mut out = Dict::new();
            for (k, _) in d.iter() {
                let p = sub(path, k);
                let children: Vec<&Node> = nodes
                    .iter()
                    .enumerate()
                    .map(|(r, n)| {
                        n.as_dict().and_then(|d| d.get(k)).ok_or_else(|| {
                            TransformError::MissingKey {
                                path: format!("rank{r}{path}"),
                                key: k.to_string(),
                            }
                        })
                    })
                    .collect::<Result<_, _>>()?;
                out.insert(k.clone(), gather_node(&children, &p)?);
            }
            Ok(Node::Dict(out))
        }
        Node::List(items) | Node::Tuple(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let children: Vec<&Node> = nodes
                    .iter()
                    .map(|n| n.as_list().and_then(|l| l.get(i)).unwrap_or(item))
                    .collect();
                out.push(gather_node(&children, &sub(path, i))?);
            }
            Ok(if matches!(first, Node::Tuple(_)) {
                Node::Tuple(out)
            } else {
                Node::List(out)
            })
        }
        other => Ok(other.clone()),
    }
}
