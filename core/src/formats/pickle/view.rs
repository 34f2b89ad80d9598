//! Pass 1 only: the node arena read through borrowed views ([`PyRef`], [`ObjRef`]).

use super::arena::{Arena, Node, ObjNode, SeqKind, V, Val};
use super::convert::Converter;
use super::limits::{PickleError, PickleLimits};
use super::torch_classes::global_value;
use super::value::{Global, PyValue};
use crate::dtype::DType;

/// The result of pass 1 only: the node arena and its root, read through [`Node`]-free views
/// ([`PyRef`]). Readers of large, regular pickles (DCP `.metadata` with 100 000 chunks) walk it
/// directly instead of building the owned [`PyValue`] tree.
#[derive(Debug)]
pub struct PickleArena {
    pub(super) nodes: Arena,
    pub(super) root: Val,
    pub(super) limits: PickleLimits,
}

impl PickleArena {
    /// A view of the root value.
    pub fn root(&self) -> PyRef<'_> {
        PyRef {
            arena: self,
            val: self.root,
        }
    }
}

/// A borrowed view of one value in a [`PickleArena`]. Nothing is copied or executed.
#[derive(Debug, Clone, Copy)]
pub struct PyRef<'a> {
    arena: &'a PickleArena,
    val: Val,
}

/// A view of a generic object node.
#[derive(Debug, Clone, Copy)]
pub struct ObjRef<'a> {
    arena: &'a PickleArena,
    node: &'a ObjNode,
}

impl<'a> PyRef<'a> {
    fn node(&self) -> Option<&'a Node> {
        match self.val.get() {
            V::Ref(i) => self.arena.nodes.nodes.get(i),
            _ => None,
        }
    }

    fn at(&self, val: Val) -> PyRef<'a> {
        PyRef {
            arena: self.arena,
            val,
        }
    }

    /// True for Python `None`.
    pub fn is_none(&self) -> bool {
        self.val == Val::NONE
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&'a str> {
        match self.node()? {
            Node::Str(span) => Some(self.arena.nodes.str(*span)),
            _ => None,
        }
    }

    /// The integer (or bool), if this is one.
    pub fn as_i64(&self) -> Option<i64> {
        match self.val.get() {
            V::Int(i) => Some(i),
            V::Bool(b) => Some(i64::from(b)),
            V::Ref(_) => match self.node()? {
                Node::Int(i) => Some(*i),
                _ => None,
            },
            V::None => None,
        }
    }

    /// Items of a tuple or list.
    pub fn items(self) -> Option<impl ExactSizeIterator<Item = PyRef<'a>> + 'a> {
        let this = self;
        let vals: &'a [Val] = match self.node()? {
            Node::Tuple(span) => self.arena.nodes.vals(*span),
            Node::Seq(SeqKind::List, items) => self.arena.nodes.seq(*items),
            _ => return None,
        };
        Some(vals.iter().map(move |&x| this.at(x)))
    }

    /// Items of a dict (or of an `OrderedDict` object).
    pub fn dict_items(self) -> Option<impl ExactSizeIterator<Item = (PyRef<'a>, PyRef<'a>)> + 'a> {
        let this = self;
        let pairs: &'a [(Val, Val)] = match self.node()? {
            Node::Dict(d) => self.arena.nodes.dict(*d),
            Node::Object(o) => self.arena.nodes.objects[*o as usize].dict_items(),
            _ => return None,
        };
        Some(pairs.iter().map(move |&(k, v)| (this.at(k), this.at(v))))
    }

    /// The global, if this is one.
    pub fn global(&self) -> Option<&'a Global> {
        match self.node()? {
            Node::Global(g) => Some(g),
            _ => None,
        }
    }

    /// The dtype, if this is a `torch.<dtype>` global.
    pub fn dtype(&self) -> Option<DType> {
        match global_value(self.global()?) {
            PyValue::DType(d) => Some(d),
            _ => None,
        }
    }

    /// The object, if this is a `REDUCE`/`NEWOBJ` node.
    pub fn object(&self) -> Option<ObjRef<'a>> {
        match self.node()? {
            Node::Object(o) => Some(ObjRef {
                arena: self.arena,
                node: &self.arena.nodes.objects[*o as usize],
            }),
            _ => None,
        }
    }

    /// A shape: `torch.Size((...))` or a tuple/list of non-negative ints.
    pub fn as_dims(&self) -> Option<Vec<u64>> {
        let nodes = &self.arena.nodes;
        let vals: &'a [Val] = match self.node()? {
            Node::Object(o) => {
                let o = &nodes.objects[*o as usize];
                if !self.at(o.callable).global()?.is("torch", "Size") {
                    return None;
                }
                return self.at(o.args).items()?.next()?.as_dims();
            }
            Node::Tuple(span) => nodes.vals(*span),
            Node::Seq(SeqKind::List, items) => nodes.seq(*items),
            _ => return None,
        };
        // Hundreds of thousands of chunk records each hold two or three of these.
        let mut dims = Vec::with_capacity(vals.len());
        for &v in vals {
            let i = match v.get() {
                V::Int(i) => i,
                _ => self.at(v).as_i64()?,
            };
            dims.push(u64::try_from(i).ok()?);
        }
        Some(dims)
    }

    /// Converts this value (and everything under it) into an owned [`PyValue`], with the
    /// arena's limits.
    pub fn to_value(&self) -> Result<PyValue, PickleError> {
        let mut conv = Converter {
            arena: &self.arena.nodes,
            limits: self.arena.limits,
            nodes: 0,
            bytes: 0,
        };
        conv.value(self.val, 0)
    }

    /// A short description for error messages.
    pub fn type_name(&self) -> String {
        match self.node() {
            None => match self.val.get() {
                V::Bool(_) => "bool".into(),
                V::Int(_) => "int".into(),
                V::None | V::Ref(_) => "None".into(),
            },
            Some(Node::Int(_) | Node::BigInt(_)) => "int".into(),
            Some(Node::Float(_)) => "float".into(),
            Some(Node::Str(_)) => "str".into(),
            Some(Node::Bytes(_)) => "bytes".into(),
            Some(Node::Tuple(_)) => "tuple".into(),
            Some(Node::Seq(SeqKind::List, _)) => "list".into(),
            Some(Node::Dict(_)) => "dict".into(),
            Some(Node::Seq(SeqKind::Set, _)) => "set".into(),
            Some(Node::Global(g)) => format!("global {g}"),
            Some(Node::PersId(_)) => "persistent id".into(),
            Some(Node::Object(o)) => {
                match self
                    .at(self.arena.nodes.objects[*o as usize].callable)
                    .global()
                {
                    Some(g) => format!("object {g}"),
                    None => "object".into(),
                }
            }
        }
    }
}

impl<'a> ObjRef<'a> {
    fn at(&self, val: Val) -> PyRef<'a> {
        PyRef {
            arena: self.arena,
            val,
        }
    }

    /// The class or function called, when a global.
    pub fn class(&self) -> Option<&'a Global> {
        self.at(self.node.callable).global()
    }

    /// The `i`-th argument of the call.
    pub fn arg(&self, i: usize) -> Option<PyRef<'a>> {
        let args = self.at(self.node.args);
        args.items()?.nth(i)
    }

    /// The call's arguments, when they are a tuple.
    pub fn arg_items(self) -> Option<impl ExactSizeIterator<Item = PyRef<'a>> + 'a> {
        self.at(self.node.args).items()
    }

    /// The `BUILD` state.
    pub fn state(&self) -> Option<PyRef<'a>> {
        self.node.state.present().map(|s| self.at(s))
    }

    /// Several attributes in one pass over the state: `attrs(["a", "b"])` is
    /// `[attr("a"), attr("b")]` (the hot records of a large `.metadata` are read this way).
    pub fn attrs<const N: usize>(&self, names: [&str; N]) -> [Option<PyRef<'a>>; N] {
        self.attrs_cached(&mut AttrCache::new(), names)
    }

    /// [`attrs`](Self::attrs) over many records of one class: `cache` remembers which string
    /// nodes are the names (a pickle stores each interned key string once and refers to it from
    /// every record), so most keys are matched without comparing text.
    pub fn attrs_cached<const N: usize>(
        &self,
        cache: &mut AttrCache<N>,
        names: [&str; N],
    ) -> [Option<PyRef<'a>>; N] {
        let mut found = [None; N];
        let Some(state) = self.state() else {
            return found;
        };
        let mut scan = |d: PyRef<'a>| {
            let Some(pairs) = d.dict_items() else {
                return false;
            };
            // A dataclass pickles its fields in declaration order, which callers usually ask
            // for: try the name after the last one found before comparing with every name.
            let mut next = 0;
            for (k, v) in pairs {
                if next < N && found[next].is_none() && k.val == cache.keys[next] {
                    found[next] = Some(v);
                    next += 1;
                    continue;
                }
                let Some(text) = k.as_str() else { continue };
                for (i, name) in names.iter().enumerate() {
                    if found[i].is_none() && text == *name {
                        found[i] = Some(v);
                        cache.keys[i] = k.val;
                        next = i + 1;
                    }
                }
            }
            true
        };
        if !scan(state)
            && let Some(parts) = state.items()
        {
            for part in parts {
                scan(part);
            }
        }
        found
    }

    /// `name` in a dict state or the slot dict of a `(dict, slots)` state.
    pub fn attr(&self, name: &str) -> Option<PyRef<'a>> {
        let state = self.state()?;
        let find = |d: PyRef<'a>| {
            d.dict_items()?
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v)
        };
        if let Some(v) = find(state) {
            return Some(v);
        }
        state.items()?.find_map(find)
    }
}

/// Which string nodes are the names of [`ObjRef::attrs_cached`] (a node's text never changes).
#[derive(Debug, Clone, Copy)]
pub struct AttrCache<const N: usize> {
    keys: [Val; N],
}

impl<const N: usize> AttrCache<N> {
    /// Knows no node yet.
    pub fn new() -> Self {
        AttrCache {
            keys: [Val::MISSING; N],
        }
    }
}

impl<const N: usize> Default for AttrCache<N> {
    fn default() -> Self {
        Self::new()
    }
}
