//! Pass 2: the arena walked into an owned [`PyValue`] tree, with a node budget and a depth limit.

use super::arena::{Arena, Node, ObjNode, SeqKind, V, Val};
use super::limits::{PickleError, PickleLimits};
use super::torch_classes::{global_value, recognise, storage_from_pid};
use super::value::{PyObject, PyValue};

pub(super) struct Converter<'a> {
    pub(super) arena: &'a Arena,
    pub(super) limits: PickleLimits,
    pub(super) nodes: usize,
    pub(super) bytes: usize,
}

impl Converter<'_> {
    fn charge(&mut self, nodes: usize, bytes: usize) -> Result<(), PickleError> {
        self.nodes = self.nodes.saturating_add(nodes);
        self.bytes = self.bytes.saturating_add(bytes);
        if self.nodes > self.limits.max_nodes {
            return Err(PickleError::Limit {
                what: "values after expanding shared references",
                limit: self.limits.max_nodes,
            });
        }
        if self.bytes > self.limits.max_bytes {
            return Err(PickleError::Limit {
                what: "bytes of strings after expanding shared references",
                limit: self.limits.max_bytes,
            });
        }
        Ok(())
    }

    pub(super) fn values(
        &mut self,
        vals: &[Val],
        depth: usize,
    ) -> Result<Vec<PyValue>, PickleError> {
        vals.iter().map(|&v| self.value(v, depth)).collect()
    }

    pub(super) fn pairs(
        &mut self,
        vals: &[(Val, Val)],
        depth: usize,
    ) -> Result<Vec<(PyValue, PyValue)>, PickleError> {
        vals.iter()
            .map(|&(k, v)| Ok((self.value(k, depth)?, self.value(v, depth)?)))
            .collect()
    }

    pub(super) fn value(&mut self, val: Val, depth: usize) -> Result<PyValue, PickleError> {
        self.charge(1, 0)?;
        if depth > self.limits.max_depth {
            return Err(PickleError::Limit {
                what: "nesting depth",
                limit: self.limits.max_depth,
            });
        }
        let next = depth + 1;
        Ok(match val.get() {
            V::None => PyValue::None,
            V::Bool(b) => PyValue::Bool(b),
            V::Int(i) => PyValue::Int(i),
            V::Ref(i) => match &self.arena.nodes[i] {
                Node::Int(i) => PyValue::Int(*i),
                Node::Float(f) => PyValue::Float(*f),
                Node::Str(span) => {
                    self.charge(0, span.len())?;
                    PyValue::Str(self.arena.str(*span).to_owned())
                }
                Node::Bytes(span) => {
                    self.charge(0, span.len())?;
                    PyValue::Bytes(self.arena.blob(*span).to_vec())
                }
                Node::BigInt(span) => {
                    self.charge(0, span.len())?;
                    PyValue::BigInt(self.arena.blob(*span).to_vec())
                }
                Node::Tuple(span) => {
                    let arena = self.arena;
                    PyValue::Tuple(self.values(arena.vals(*span), next)?)
                }
                Node::Seq(kind, items) => {
                    let arena = self.arena;
                    let items = self.values(arena.seq(*items), next)?;
                    match kind {
                        SeqKind::List => PyValue::List(items),
                        SeqKind::Set => PyValue::Set(items),
                    }
                }
                Node::Dict(items) => {
                    let arena = self.arena;
                    PyValue::Dict(self.pairs(arena.dict(*items), next)?)
                }
                Node::Global(g) => {
                    self.charge(0, g.module.len() + g.name.len())?;
                    global_value(g)
                }
                Node::PersId(pid) => {
                    let pid = self.value(*pid, next)?;
                    storage_from_pid(&pid)?
                }
                Node::Object(o) => {
                    let arena = self.arena;
                    let node = &arena.objects[*o as usize];
                    let ObjNode {
                        callable,
                        args,
                        state,
                        items: _,
                    } = node;
                    let kwargs = node.kwargs();
                    let callable = self.value(*callable, next)?;
                    let args = match self.value(*args, next)? {
                        PyValue::Tuple(a) => a,
                        other => vec![other],
                    };
                    let kwargs = match kwargs {
                        Some(k) => match self.value(k, next)? {
                            PyValue::Dict(items) => items,
                            _ => Vec::new(),
                        },
                        None => Vec::new(),
                    };
                    let state = match state.present() {
                        Some(s) => Some(self.value(s, next)?),
                        None => None,
                    };
                    let obj = PyObject {
                        callable,
                        args,
                        kwargs,
                        state,
                        list_items: self.values(node.list_items(), next)?,
                        dict_items: self.pairs(node.dict_items(), next)?,
                    };
                    recognise(obj)?
                }
            },
        })
    }
}
