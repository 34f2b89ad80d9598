//! A restricted pickle machine (protocols 2 to 5) that never imports or executes anything.
//!
//! Pass 1 ([`Machine`]) runs the opcodes and builds an arena of nodes: globals become names,
//! `REDUCE`/`NEWOBJ` on anything become generic object nodes, `BUILD`/`SETITEMS`/`APPENDS` on
//! objects are recorded on the node. Shared references (`BINGET`) point at the same node, so a
//! memo bomb costs nothing in pass 1. Pass 2 ([`to_value`]) walks the arena into an owned
//! [`PyValue`] tree with a node budget and a depth limit, turning the torch classes it knows
//! (`_rebuild_tensor_v2`, `_rebuild_from_type_v2`, typed storages, `torch.Size`, dtypes,
//! `OrderedDict`, `ShardedTensor`, `DTensor`) into typed records. Anything else stays an
//! [`PyObject`] with its class name, arguments and state, to be read (or ignored) by the caller.

use crate::dtype::DType;

/// Limits on what one pickle may make the machine do. Every one has an explicit error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PickleLimits {
    /// Most entries the memo may hold.
    pub max_memo: usize,
    /// Most values on the stack (all mark levels together).
    pub max_stack: usize,
    /// Most nested containers in the result tree (pass 2).
    pub max_depth: usize,
    /// Most nodes pass 2 may produce (shared references count every time they are used).
    pub max_nodes: usize,
    /// Most bytes of strings and byte strings pass 2 may produce.
    pub max_bytes: usize,
}

impl PickleLimits {
    /// Limits proportional to the pickle: pass 2 may expand a pickle of `n` bytes to at most
    /// `4n + 65536` nodes and `16n + 1 MiB` bytes of strings, which no real torch file comes near.
    pub fn for_len(n: usize) -> Self {
        PickleLimits {
            max_memo: n.saturating_add(16),
            max_stack: n.saturating_add(16),
            max_depth: 200,
            max_nodes: n.saturating_mul(4).saturating_add(65_536),
            max_bytes: n.saturating_mul(16).saturating_add(1 << 20),
        }
    }
}

/// What went wrong while reading a pickle. Offsets are byte positions in the pickle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickleError {
    /// The pickle ended in the middle of an opcode or before `STOP`.
    #[error("pickle truncated at byte {offset} (needed {needed} more bytes)")]
    Truncated { offset: usize, needed: u64 },
    /// An opcode this machine does not run (e.g. `EXT1`, `INST`, out-of-band buffers).
    #[error("unsupported pickle opcode 0x{opcode:02x} at byte {offset}")]
    UnsupportedOpcode { opcode: u8, offset: usize },
    /// `PROTO` names a protocol outside 2..=5.
    #[error("unsupported pickle protocol {protocol} (expected 2 to 5)")]
    UnsupportedProtocol { protocol: u8 },
    /// An opcode needed more values on the stack than there were.
    #[error("pickle stack underflow at byte {offset} (opcode 0x{opcode:02x})")]
    StackUnderflow { opcode: u8, offset: usize },
    /// A `MARK`-consuming opcode found no mark.
    #[error("pickle has no MARK for the opcode at byte {offset}")]
    NoMark { offset: usize },
    /// A memo lookup for an index never stored.
    #[error("pickle reads memo entry {index} at byte {offset}, which was never stored")]
    MissingMemo { index: u64, offset: usize },
    /// A value of the wrong type for an opcode (e.g. `SETITEMS` on a tuple).
    #[error("pickle opcode at byte {offset}: {what}")]
    WrongType { offset: usize, what: String },
    /// Text (`GLOBAL`, `INT`, unicode) that is not valid.
    #[error("pickle has invalid text at byte {offset}: {what}")]
    BadText { offset: usize, what: String },
    /// A limit of [`PickleLimits`] was reached.
    #[error(
        "pickle exceeds the limit on {what} ({limit}); the file is malformed or hostile (memo bomb?)"
    )]
    Limit { what: &'static str, limit: usize },
    /// The stack did not hold exactly one value at `STOP`.
    #[error("pickle ended with {len} values on the stack (expected 1)")]
    BadStop { len: usize },
    /// A known torch record had arguments of an unexpected shape.
    #[error("malformed {class} record in pickle: {what}")]
    BadRecord { class: String, what: String },
}

/// A Python global referenced by name (`module.name`); never imported.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Global {
    pub module: String,
    pub name: String,
}

impl Global {
    fn is(&self, module: &str, name: &str) -> bool {
        self.module == module && self.name == name
    }
}

impl std::fmt::Display for Global {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.module, self.name)
    }
}

/// A value read from a pickle, after pass 2.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i64),
    /// An integer that does not fit `i64`: little-endian two's complement bytes.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<PyValue>),
    List(Vec<PyValue>),
    /// `dict` and `OrderedDict`, in insertion order; keys may be any value (DCP uses objects).
    Dict(Vec<(PyValue, PyValue)>),
    Set(Vec<PyValue>),
    /// A global used as a value (a class, a function), never called.
    Global(Box<Global>),
    /// `torch.float32` and friends.
    DType(DType),
    /// `torch.Size`.
    Size(Vec<u64>),
    /// A storage persistent id `("storage", torch.FloatStorage, key, location, numel)`.
    Storage(Box<StorageRef>),
    /// `_rebuild_tensor_v2` (possibly wrapped as a `Parameter` or by `_rebuild_from_type_v2`).
    Tensor(Box<TensorRef>),
    /// A `ShardedTensor` (FSDP1 SHARDED/LOCAL state dicts).
    ShardedTensor(Box<ShardedTensorRecord>),
    /// A `DTensor` (FSDP2, FSDP1 with a device mesh).
    DTensor(Box<DTensorRecord>),
    /// Any other object: a class or callable applied to arguments, plus what was added to it.
    Object(Box<PyObject>),
}

/// A generic object: `callable(*args)` (`REDUCE`) or `cls.__new__(cls, *args)` (`NEWOBJ`).
#[derive(Debug, Clone, PartialEq)]
pub struct PyObject {
    /// What was called (usually a [`PyValue::Global`]).
    pub callable: PyValue,
    pub args: Vec<PyValue>,
    /// Keyword arguments of `NEWOBJ_EX`.
    pub kwargs: Vec<(PyValue, PyValue)>,
    /// The argument of `BUILD` (`__setstate__`), if any.
    pub state: Option<PyValue>,
    /// Items added with `APPEND`/`APPENDS` (list subclasses).
    pub list_items: Vec<PyValue>,
    /// Items added with `SETITEM`/`SETITEMS` (dict subclasses).
    pub dict_items: Vec<(PyValue, PyValue)>,
}

impl PyObject {
    /// The class or function name, when the callable is a global.
    pub fn class(&self) -> Option<&Global> {
        match &self.callable {
            PyValue::Global(g) => Some(g),
            _ => None,
        }
    }

    /// Looks up `name` in the object's state: a dict state, or the slot dict of a
    /// `(dict, slots)` tuple state.
    pub fn attr(&self, name: &str) -> Option<&PyValue> {
        match self.state.as_ref()? {
            PyValue::Dict(items) => dict_get(items, name),
            PyValue::Tuple(parts) => parts.iter().find_map(|p| match p {
                PyValue::Dict(items) => dict_get(items, name),
                _ => None,
            }),
            _ => None,
        }
    }
}

/// Finds the value of a string key in dict items.
pub fn dict_get<'a>(items: &'a [(PyValue, PyValue)], key: &str) -> Option<&'a PyValue> {
    items.iter().find_map(|(k, v)| match k {
        PyValue::Str(s) if s == key => Some(v),
        _ => None,
    })
}

impl PyValue {
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is one (`bool` counts, as in Python).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            PyValue::Int(i) => Some(*i),
            PyValue::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// Items of a tuple or list.
    pub fn as_seq(&self) -> Option<&[PyValue]> {
        match self {
            PyValue::Tuple(v) | PyValue::List(v) => Some(v),
            _ => None,
        }
    }

    /// A shape-like value: `torch.Size`, or a tuple/list of non-negative ints.
    pub fn as_dims(&self) -> Option<Vec<u64>> {
        match self {
            PyValue::Size(v) => Some(v.clone()),
            PyValue::Tuple(v) | PyValue::List(v) => v
                .iter()
                .map(|x| x.as_i64().and_then(|i| u64::try_from(i).ok()))
                .collect(),
            _ => None,
        }
    }

    /// Signed dims (strides may in principle be negative in other tools; torch's are not).
    pub fn as_signed_dims(&self) -> Option<Vec<i64>> {
        match self {
            PyValue::Size(v) => v.iter().map(|&x| i64::try_from(x).ok()).collect(),
            PyValue::Tuple(v) | PyValue::List(v) => v.iter().map(PyValue::as_i64).collect(),
            _ => None,
        }
    }

    /// A short description of the kind of value, for error messages.
    pub fn type_name(&self) -> String {
        match self {
            PyValue::None => "None".into(),
            PyValue::Bool(_) => "bool".into(),
            PyValue::Int(_) | PyValue::BigInt(_) => "int".into(),
            PyValue::Float(_) => "float".into(),
            PyValue::Str(_) => "str".into(),
            PyValue::Bytes(_) => "bytes".into(),
            PyValue::Tuple(_) => "tuple".into(),
            PyValue::List(_) => "list".into(),
            PyValue::Dict(_) => "dict".into(),
            PyValue::Set(_) => "set".into(),
            PyValue::Global(g) => format!("global {g}"),
            PyValue::DType(_) => "torch.dtype".into(),
            PyValue::Size(_) => "torch.Size".into(),
            PyValue::Storage(_) => "storage".into(),
            PyValue::Tensor(_) => "tensor".into(),
            PyValue::ShardedTensor(_) => "ShardedTensor".into(),
            PyValue::DTensor(_) => "DTensor".into(),
            PyValue::Object(o) => match o.class() {
                Some(g) => format!("object {g}"),
                None => "object".into(),
            },
        }
    }
}

/// A typed storage referenced by a tensor: the archive member `data/<key>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageRef {
    pub key: String,
    pub dtype: DType,
    /// Where it lived when saved (`cpu`, `cuda:0`).
    pub location: String,
    /// Number of elements of `dtype` in the storage.
    pub numel: u64,
}

/// A tensor as a view of a storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    pub storage: StorageRef,
    /// Offset of element 0 in the storage, in elements.
    pub storage_offset: u64,
    pub shape: Vec<u64>,
    pub stride: Vec<u64>,
    pub requires_grad: bool,
    /// The Python type it was rebuilt as, when not a plain tensor (`torch.nn.parameter.Parameter`).
    pub wrapper: Option<String>,
}

impl TensorRef {
    /// Number of elements of the view.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// True when the view is row-major contiguous (strides of size-1 dims do not matter).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1u64;
        for (&d, &s) in self.shape.iter().zip(&self.stride).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    /// The number of storage elements the view reaches: `offset + Σ (d-1)·stride + 1`, or 0 for an
    /// empty view. `None` on overflow.
    pub fn storage_extent(&self) -> Option<u64> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        let mut last = self.storage_offset;
        for (&d, &s) in self.shape.iter().zip(&self.stride) {
            last = last.checked_add((d - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }
}

/// One local shard of a `ShardedTensor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalShard {
    pub tensor: TensorRef,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub placement: Option<String>,
}

/// The global metadata of one shard of a `ShardedTensor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    /// `rank:0/cpu`.
    pub placement: Option<String>,
}

/// What a `ShardedTensor` pickle says (the process-group state is not needed and dropped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedTensorRecord {
    pub global_shape: Vec<u64>,
    pub dtype: DType,
    pub local_shards: Vec<LocalShard>,
    pub shards: Vec<ShardMeta>,
}

/// A DTensor placement on one mesh dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    Shard {
        dim: i64,
    },
    StridedShard {
        dim: i64,
        split_factor: i64,
    },
    Replicate,
    Partial {
        reduce_op: String,
    },
    /// A placement class this reader does not know.
    Other {
        class: String,
    },
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Shard { dim } => write!(f, "Shard(dim={dim})"),
            Placement::StridedShard { dim, split_factor } => {
                write!(f, "_StridedShard(dim={dim}, sf={split_factor})")
            }
            Placement::Replicate => f.write_str("Replicate()"),
            Placement::Partial { reduce_op } => write!(f, "Partial({reduce_op})"),
            Placement::Other { class } => write!(f, "{class}"),
        }
    }
}

/// What a `DTensor` pickle says (the device mesh's private classes are read only for its shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DTensorRecord {
    pub global_shape: Vec<u64>,
    pub dtype: DType,
    pub local: TensorRef,
    pub placements: Vec<Placement>,
    /// The mesh shape, when it could be read.
    pub mesh_shape: Option<Vec<u64>>,
    /// This rank's coordinate in the mesh, when recorded.
    pub mesh_coordinate: Option<Vec<u64>>,
}

/// Parses a pickle into a value tree with limits derived from its length.
pub fn parse(data: &[u8]) -> Result<PyValue, PickleError> {
    parse_with_limits(data, PickleLimits::for_len(data.len()))
}

/// Parses a pickle into a value tree with explicit limits.
pub fn parse_with_limits(data: &[u8], limits: PickleLimits) -> Result<PyValue, PickleError> {
    let (arena, root) = Machine::new(data, limits).run()?;
    let mut conv = Converter {
        arena: &arena,
        limits,
        nodes: 0,
        bytes: 0,
    };
    conv.value(root, 0)
}

/// The result of pass 1 only: the node arena and its root, read through [`Node`]-free views
/// ([`PyRef`]). Readers of large, regular pickles (DCP `.metadata` with 100 000 chunks) walk it
/// directly instead of building the owned [`PyValue`] tree.
#[derive(Debug)]
pub struct PickleArena {
    nodes: Arena,
    root: Val,
    limits: PickleLimits,
}

/// Runs pass 1 only.
pub fn parse_arena(data: &[u8]) -> Result<PickleArena, PickleError> {
    let limits = PickleLimits::for_len(data.len());
    let (nodes, root) = Machine::new(data, limits).run()?;
    Ok(PickleArena {
        nodes,
        root,
        limits,
    })
}

/// Every global the pickle names (`GLOBAL`, `STACK_GLOBAL`), once each, in first-seen order.
/// Pass 1 only: nothing is imported, called or built.
pub fn globals(data: &[u8]) -> Result<Vec<Global>, PickleError> {
    let arena = parse_arena(data)?;
    let mut out: Vec<Global> = Vec::new();
    for node in &arena.nodes.nodes {
        if let Node::Global(g) = node
            && !out.contains(g)
        {
            out.push((**g).clone());
        }
    }
    Ok(out)
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
            Node::Object(o) => self.arena.nodes.objects[*o].dict_items(),
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
                node: &self.arena.nodes.objects[*o],
            }),
            _ => None,
        }
    }

    /// A shape: `torch.Size((...))` or a tuple/list of non-negative ints.
    pub fn as_dims(&self) -> Option<Vec<u64>> {
        let nodes = &self.arena.nodes;
        let vals: &'a [Val] = match self.node()? {
            Node::Object(o) => {
                let o = &nodes.objects[*o];
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
                match self.at(self.arena.nodes.objects[*o].callable).global() {
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

// ---------------------------------------------------------------------------------------------
// Pass 1: the machine.

/// A pass-1 value in 8 bytes (the memo, the pools and the object records hold millions of them
/// in a large `.metadata`): the low 3 bits say what it is, the rest holds it. Integers outside
/// ±2^60 and floats are nodes ([`Node::Int`], [`Node::Float`]).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Val(u64);

/// What a [`Val`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    Ref(usize),
}

impl Val {
    const TAG_BITS: u32 = 3;
    const NONE: Val = Val(0);
    const FALSE: Val = Val(1);
    const TRUE: Val = Val(1 | 1 << Self::TAG_BITS);
    const INT: u64 = 2;
    const REF: u64 = 3;
    /// Never made from input: an empty memo slot, an object without `BUILD` state.
    const MISSING: Val = Val(7);
    /// Only on the machine's stack: `MARK`. Every opcode that takes a value checks for it, so it
    /// never reaches the memo, the pools or a record.
    const MARK: Val = Val(6);

    /// `i` inline, when it fits in 61 bits.
    fn small_int(i: i64) -> Option<Val> {
        let packed = i.wrapping_shl(Self::TAG_BITS);
        (packed >> Self::TAG_BITS == i).then_some(Val(packed as u64 | Self::INT))
    }

    /// A node index (nodes are bounded by the input's length, far below 2^61).
    fn reference(i: usize) -> Val {
        Val((i as u64) << Self::TAG_BITS | Self::REF)
    }

    fn get(self) -> V {
        match self.0 & 7 {
            1 => V::Bool(self.0 >> Self::TAG_BITS != 0),
            Self::INT => V::Int((self.0 as i64) >> Self::TAG_BITS),
            Self::REF => V::Ref((self.0 >> Self::TAG_BITS) as usize),
            _ => V::None,
        }
    }

    /// `None` for [`Val::MISSING`].
    fn present(self) -> Option<Val> {
        (self != Val::MISSING).then_some(self)
    }
}

impl std::fmt::Debug for Val {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.present() {
            Some(v) => v.get().fmt(f),
            None => f.write_str("Missing"),
        }
    }
}

/// A run of values in [`Arena::vals`] (tuples never change after they are built, so their items
/// live in one shared pool rather than one allocation each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: usize,
    len: usize,
}

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.start..self.start.saturating_add(self.len)
    }
}

/// A list's or set's items, or a dict's pairs: a run in the shared pool while the container is
/// filled in one go (as Python fills them: one `APPENDS`/`SETITEMS` per 1000 items), an owned
/// vector (an index into [`Arena::owned_vals`] or [`Arena::owned_pairs`]) once a later fill
/// cannot extend the run in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Items {
    Pooled(Span),
    Owned(usize),
}

/// Which kind of value a [`Node::Seq`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SeqKind {
    List,
    Set,
}

#[derive(Debug)]
enum Node {
    /// An integer outside ±2^60 (smaller ones are [`Val`]s).
    Int(i64),
    Float(f64),
    /// A run of [`Arena::text`].
    Str(Span),
    /// A run of [`Arena::blob`].
    Bytes(Span),
    /// A run of [`Arena::blob`] (little-endian two's complement).
    BigInt(Span),
    /// A run of [`Arena::vals`].
    Tuple(Span),
    /// A list or set; its items are in [`Arena::vals`] or [`Arena::owned_vals`].
    Seq(SeqKind, Items),
    /// A dict; its pairs are in [`Arena::pairs`] or [`Arena::owned_pairs`].
    Dict(Items),
    Global(Box<Global>),
    PersId(Val),
    /// An index into [`Arena::objects`].
    Object(usize),
}

/// Pass 1's output: the nodes, the pools their contents live in, and the object records. A
/// `.metadata` of 100 000 chunks holds about 1.9 million nodes, so no node takes an allocation
/// of its own unless it must (a container filled in several interleaved steps, a global).
#[derive(Debug, Default)]
struct Arena {
    nodes: Vec<Node>,
    vals: Vec<Val>,
    pairs: Vec<(Val, Val)>,
    text: String,
    blob: Vec<u8>,
    owned_vals: Vec<Vec<Val>>,
    owned_pairs: Vec<Vec<(Val, Val)>>,
    objects: Vec<ObjNode>,
}

impl Arena {
    // Spans are only made by the machine from what it pushed into the pools: always in bounds
    // (the empty answers are never taken).
    fn vals(&self, span: Span) -> &[Val] {
        self.vals.get(span.range()).unwrap_or(&[])
    }

    fn str(&self, span: Span) -> &str {
        self.text.get(span.range()).unwrap_or("")
    }

    fn blob(&self, span: Span) -> &[u8] {
        self.blob.get(span.range()).unwrap_or(&[])
    }

    fn seq(&self, items: Items) -> &[Val] {
        match items {
            Items::Pooled(span) => self.vals(span),
            Items::Owned(i) => self.owned_vals.get(i).map_or(&[], Vec::as_slice),
        }
    }

    fn dict(&self, items: Items) -> &[(Val, Val)] {
        match items {
            Items::Pooled(span) => self.pairs.get(span.range()).unwrap_or(&[]),
            Items::Owned(i) => self.owned_pairs.get(i).map_or(&[], Vec::as_slice),
        }
    }

    /// The string `v` names, if it is one.
    fn str_of(&self, v: Val) -> Option<&str> {
        match v.get() {
            V::Ref(i) => match self.nodes.get(i)? {
                Node::Str(span) => Some(self.str(*span)),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Adds `new` to a container's run in `pool` (or its owned vector in `owned`): in place when the
/// run is empty or ends the pool, else (once per container) by moving it to an owned vector.
fn extend_items<T: Copy>(
    items: &mut Items,
    pool: &mut Vec<T>,
    owned: &mut Vec<Vec<T>>,
    new: impl Iterator<Item = T>,
) {
    match items {
        Items::Pooled(span) if span.len == 0 => {
            let start = pool.len();
            pool.extend(new);
            *span = Span {
                start,
                len: pool.len() - start,
            };
        }
        Items::Pooled(span) if span.start + span.len == pool.len() => {
            pool.extend(new);
            span.len = pool.len() - span.start;
        }
        Items::Pooled(span) => {
            let mut v: Vec<T> = pool.get(span.range()).unwrap_or(&[]).to_vec();
            v.extend(new);
            owned.push(v);
            *items = Items::Owned(owned.len() - 1);
        }
        Items::Owned(i) => {
            if let Some(v) = owned.get_mut(*i) {
                v.extend(new);
            }
        }
    }
}

#[derive(Debug)]
struct ObjNode {
    callable: Val,
    args: Val,
    /// [`Val::MISSING`] until `BUILD`.
    state: Val,
    /// `NEWOBJ_EX` keyword arguments and `APPENDS`/`SETITEMS` on the object (an `OrderedDict`, a
    /// `defaultdict`): rare, so boxed.
    items: Option<Box<ObjItems>>,
}

#[derive(Debug, Default)]
struct ObjItems {
    kwargs: Option<Val>,
    list_items: Vec<Val>,
    dict_items: Vec<(Val, Val)>,
}

impl ObjNode {
    fn kwargs(&self) -> Option<Val> {
        self.items.as_ref().and_then(|i| i.kwargs)
    }

    fn list_items(&self) -> &[Val] {
        self.items.as_ref().map_or(&[], |i| &i.list_items)
    }

    fn dict_items(&self) -> &[(Val, Val)] {
        self.items.as_ref().map_or(&[], |i| &i.dict_items)
    }

    fn items_mut(&mut self) -> &mut ObjItems {
        self.items.get_or_insert_with(Box::default)
    }
}

/// What `op` found where it needed a value: a mark, or nothing.
#[cold]
fn stack_error(mark: bool, op: u8, at: usize) -> PickleError {
    if mark {
        PickleError::WrongType {
            offset: at,
            what: format!("opcode 0x{op:02x} found a MARK where a value was expected"),
        }
    } else {
        PickleError::StackUnderflow {
            opcode: op,
            offset: at,
        }
    }
}

/// `APPEND(S)`/`ADDITEMS`: adds values to the list, set (or object) `target` names.
fn add_items(
    arena: &mut Arena,
    target: Val,
    items: impl Iterator<Item = Val>,
    at: usize,
) -> Result<(), PickleError> {
    let i = Machine::container(target, at)?;
    match &mut arena.nodes[i] {
        Node::Seq(_, seq) => extend_items(seq, &mut arena.vals, &mut arena.owned_vals, items),
        Node::Object(o) => arena.objects[*o].items_mut().list_items.extend(items),
        _ => {
            return Err(PickleError::WrongType {
                offset: at,
                what: "APPEND(S)/ADDITEMS on a value that is not a list, set or object".into(),
            });
        }
    }
    Ok(())
}

/// `SETITEM(S)`: adds pairs to the dict (or object) `target` names.
fn add_pairs(
    arena: &mut Arena,
    target: Val,
    pairs: impl Iterator<Item = (Val, Val)>,
    at: usize,
) -> Result<(), PickleError> {
    let i = Machine::container(target, at)?;
    match &mut arena.nodes[i] {
        Node::Dict(d) => extend_items(d, &mut arena.pairs, &mut arena.owned_pairs, pairs),
        Node::Object(o) => arena.objects[*o].items_mut().dict_items.extend(pairs),
        _ => {
            return Err(PickleError::WrongType {
                offset: at,
                what: "SETITEM(S) on a value that is not a dict or object".into(),
            });
        }
    }
    Ok(())
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    limits: PickleLimits,
    arena: Arena,
    stack: Vec<Val>,
    /// Memo slots by index (torch and Python number them densely from 0).
    /// [`Val::MISSING`] where nothing was put.
    memo: Vec<Val>,
    memo_len: usize,
    /// The one `()` node: tuples never change, and `NEWOBJ` takes `()` for every object.
    empty_tuple: Option<Val>,
}

/// A capacity to reserve for a pool filled from a pickle of `len` bytes: about as many entries as
/// the densest real pickles give (`per` input bytes per entry), capped so that a huge input
/// reserves no more than 4 Mi entries up front (beyond that, the pool grows as it fills).
fn reserve(len: usize, per: usize) -> usize {
    (len / per).min(1 << 22)
}

impl<'a> Machine<'a> {
    fn new(data: &'a [u8], limits: PickleLimits) -> Self {
        Machine {
            data,
            pos: 0,
            limits,
            // Capacities from the input's length (a DCP `.metadata` gives a node per 7 bytes, a
            // tuple item per 15, a dict pair per 15, an object per 23, a memo entry per 7):
            // address space only until used, and no copies while a large pickle's arena grows.
            arena: Arena {
                nodes: Vec::with_capacity(reserve(data.len(), 6)),
                vals: Vec::with_capacity(reserve(data.len(), 12)),
                pairs: Vec::with_capacity(reserve(data.len(), 12)),
                text: String::with_capacity(reserve(data.len(), 4)),
                blob: Vec::new(),
                owned_vals: Vec::new(),
                owned_pairs: Vec::new(),
                objects: Vec::with_capacity(reserve(data.len(), 20)),
            },
            stack: Vec::new(),
            memo: Vec::with_capacity(reserve(data.len(), 6)),
            memo_len: 0,
            empty_tuple: None,
        }
    }

    #[inline]
    fn take(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let remaining = (self.data.len() - self.pos) as u64;
        if n > remaining {
            return Err(PickleError::Truncated {
                offset: self.pos,
                needed: n - remaining,
            });
        }
        let n = n as usize;
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// One byte: every opcode and most arguments (6.8 million of them in a large `.metadata`).
    #[inline]
    fn u8(&mut self) -> Result<u8, PickleError> {
        match self.data.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(self.truncated(1)),
        }
    }

    #[cold]
    fn truncated(&self, n: u64) -> PickleError {
        let remaining = (self.data.len() - self.pos) as u64;
        PickleError::Truncated {
            offset: self.pos,
            needed: n - remaining,
        }
    }

    /// A little-endian unsigned integer of `N` bytes.
    #[inline]
    fn uint<const N: usize>(&mut self) -> Result<u64, PickleError> {
        let Some(b) = self
            .data
            .get(self.pos..)
            .and_then(|rest| rest.first_chunk::<N>())
        else {
            return Err(self.truncated(N as u64));
        };
        self.pos += N;
        Ok(b.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    fn line(&mut self) -> Result<&'a str, PickleError> {
        let start = self.pos;
        let rest = &self.data[start..];
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            return Err(PickleError::Truncated {
                offset: start,
                needed: 1,
            });
        };
        self.pos += nl + 1;
        std::str::from_utf8(&rest[..nl]).map_err(|_| PickleError::BadText {
            offset: start,
            what: "not UTF-8".into(),
        })
    }

    #[inline]
    fn alloc(&mut self, node: Node) -> Result<Val, PickleError> {
        // Every node-creating opcode consumes at least one byte, so this bound never triggers on
        // valid input; it keeps the arena proportional to the input regardless.
        if self.arena.nodes.len() > self.data.len() + 16 {
            return Err(PickleError::Limit {
                what: "objects",
                limit: self.data.len() + 16,
            });
        }
        self.arena.nodes.push(node);
        Ok(Val::reference(self.arena.nodes.len() - 1))
    }

    #[inline]
    fn push(&mut self, v: Val) -> Result<(), PickleError> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(PickleError::Limit {
                what: "stack size",
                limit: self.limits.max_stack,
            });
        }
        self.stack.push(v);
        Ok(())
    }

    #[inline]
    fn pop(&mut self, op: u8, at: usize) -> Result<Val, PickleError> {
        match self.stack.pop() {
            Some(v) if v != Val::MARK => Ok(v),
            other => Err(stack_error(other.is_some(), op, at)),
        }
    }

    #[inline]
    fn top(&self, op: u8, at: usize) -> Result<Val, PickleError> {
        match self.stack.last() {
            Some(&v) if v != Val::MARK => Ok(v),
            other => Err(stack_error(other.is_some(), op, at)),
        }
    }

    /// The position of the topmost mark on the stack.
    fn mark(&self, at: usize) -> Result<usize, PickleError> {
        self.stack
            .iter()
            .rposition(|&s| s == Val::MARK)
            .ok_or(PickleError::NoMark { offset: at })
    }

    /// A tuple of the values above the topmost mark (`TUPLE`), or of the top `n` values
    /// (`TUPLE1..3`), popped straight into the shared pool.
    fn tuple(&mut self, n: Option<usize>, op: u8, at: usize) -> Result<Val, PickleError> {
        // `TUPLE1..3` over plain values (the usual case): straight from the stack's top.
        if let Some(n @ 1..=3) = n
            && let Some(first) = self.stack.len().checked_sub(n)
            && !self.stack[first..].contains(&Val::MARK)
        {
            let start = self.arena.vals.len();
            self.arena.vals.extend_from_slice(&self.stack[first..]);
            self.stack.truncate(first);
            return self.alloc(Node::Tuple(Span { start, len: n }));
        }
        let (first, drop_from) = match n {
            None => {
                let mark = self.mark(at)?;
                (mark + 1, mark)
            }
            Some(n) => {
                let first = self
                    .stack
                    .len()
                    .checked_sub(n)
                    .ok_or(PickleError::StackUnderflow {
                        opcode: op,
                        offset: at,
                    })?;
                (first, first)
            }
        };
        if first == self.stack.len()
            && let Some(empty) = self.empty_tuple
        {
            self.stack.truncate(drop_from);
            return Ok(empty);
        }
        if self.stack[first..].contains(&Val::MARK) {
            return Err(PickleError::WrongType {
                offset: at,
                what: format!("opcode 0x{op:02x} found a MARK where a value was expected"),
            });
        }
        let span = self.pool_from_stack(first, drop_from);
        let v = self.alloc(Node::Tuple(span))?;
        if span.len == 0 {
            self.empty_tuple = Some(v);
        }
        Ok(v)
    }

    fn pop_mark(&mut self, at: usize) -> Result<Vec<Val>, PickleError> {
        let mark = self.mark(at)?;
        // `mark` is the topmost mark: only values above it.
        let items = self.stack.drain(mark + 1..).collect();
        self.stack.truncate(mark);
        Ok(items)
    }

    #[inline]
    fn memo_put(&mut self, index: u64, v: Val) -> Result<(), PickleError> {
        // The usual case first: the next index in order.
        if index == self.memo.len() as u64 && self.memo.len() < self.limits.max_memo {
            self.memo.push(v);
            self.memo_len += 1;
            return Ok(());
        }
        // Indices are dense in real pickles; an index beyond the limit would need a memo larger
        // than the input justifies.
        let slot = usize::try_from(index)
            .ok()
            .filter(|&i| i < self.limits.max_memo)
            .ok_or(PickleError::Limit {
                what: "memo entries",
                limit: self.limits.max_memo,
            })?;
        if slot >= self.memo.len() {
            self.memo.resize(slot + 1, Val::MISSING);
        }
        if self.memo[slot] == Val::MISSING {
            self.memo_len += 1;
        }
        // `v` comes from the stack: never `MISSING`.
        self.memo[slot] = v;
        Ok(())
    }

    #[inline]
    fn memo_get(&mut self, index: u64, at: usize) -> Result<(), PickleError> {
        let v = usize::try_from(index)
            .ok()
            .and_then(|i| self.memo.get(i).copied()?.present())
            .ok_or(PickleError::MissingMemo { index, offset: at })?;
        self.push(v)
    }

    fn string(&mut self, n: u64) -> Result<Val, PickleError> {
        let at = self.pos;
        let b = self.take(n)?;
        let s = std::str::from_utf8(b).map_err(|_| PickleError::BadText {
            offset: at,
            what: "string is not UTF-8".into(),
        })?;
        self.text_node(s)
    }

    fn text_node(&mut self, s: &str) -> Result<Val, PickleError> {
        let start = self.arena.text.len();
        self.arena.text.push_str(s);
        self.alloc(Node::Str(Span {
            start,
            len: s.len(),
        }))
    }

    fn blob_span(&mut self, b: &[u8]) -> Span {
        let start = self.arena.blob.len();
        self.arena.blob.extend_from_slice(b);
        Span {
            start,
            len: b.len(),
        }
    }

    fn bytes(&mut self, n: u64) -> Result<Val, PickleError> {
        let b = self.take(n)?;
        let span = self.blob_span(b);
        self.alloc(Node::Bytes(span))
    }

    fn long(&mut self, bytes: &[u8]) -> Result<Val, PickleError> {
        if bytes.is_empty() {
            return self.int(0);
        }
        if bytes.len() <= 8 {
            let negative = bytes[bytes.len() - 1] & 0x80 != 0;
            let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
            buf[..bytes.len()].copy_from_slice(bytes);
            return self.int(i64::from_le_bytes(buf));
        }
        let span = self.blob_span(bytes);
        self.alloc(Node::BigInt(span))
    }

    /// The arena index of the container `target` names.
    fn container(target: Val, at: usize) -> Result<usize, PickleError> {
        match target.get() {
            V::Ref(i) => Ok(i),
            _ => Err(PickleError::WrongType {
                offset: at,
                what: "cannot add items to a scalar".into(),
            }),
        }
    }

    /// The topmost mark's position and the value below it (the container `APPENDS`/`SETITEMS`
    /// add to).
    fn mark_and_target(&self, op: u8, at: usize) -> Result<(usize, Val), PickleError> {
        let mark = self.mark(at)?;
        let target = match mark.checked_sub(1).map(|i| self.stack[i]) {
            Some(v) if v != Val::MARK => v,
            Some(_) => {
                return Err(PickleError::WrongType {
                    offset: at,
                    what: format!("opcode 0x{op:02x} found a MARK where a value was expected"),
                });
            }
            None => {
                return Err(PickleError::StackUnderflow {
                    opcode: op,
                    offset: at,
                });
            }
        };
        Ok((mark, target))
    }

    /// `APPENDS`/`ADDITEMS`: the values above the topmost mark go straight from the stack into the
    /// list, set or object below it.
    fn append_items(&mut self, op: u8, at: usize) -> Result<(), PickleError> {
        let (mark, target) = self.mark_and_target(op, at)?;
        add_items(
            &mut self.arena,
            target,
            self.stack[mark + 1..].iter().copied(),
            at,
        )?;
        self.stack.truncate(mark);
        Ok(())
    }

    /// `SETITEMS`: the pairs above the topmost mark go straight from the stack into the dict (or
    /// object) below it.
    fn set_items(&mut self, op: u8, at: usize) -> Result<(), PickleError> {
        let (mark, target) = self.mark_and_target(op, at)?;
        let items = &self.stack[mark + 1..];
        if !items.len().is_multiple_of(2) {
            return Err(PickleError::WrongType {
                offset: at,
                what: "SETITEMS with an odd number of values".into(),
            });
        }
        let pairs = items.chunks_exact(2).map(|c| (c[0], c[1]));
        add_pairs(&mut self.arena, target, pairs, at)?;
        self.stack.truncate(mark);
        Ok(())
    }

    fn add_dict_items(&mut self, target: Val, items: &[Val], at: usize) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(PickleError::WrongType {
                offset: at,
                what: "SETITEMS with an odd number of values".into(),
            });
        }
        add_pairs(
            &mut self.arena,
            target,
            items.chunks_exact(2).map(|c| (c[0], c[1])),
            at,
        )
    }

    fn object(
        &mut self,
        callable: Val,
        args: Val,
        kwargs: Option<Val>,
    ) -> Result<Val, PickleError> {
        let v = self.alloc(Node::Object(self.arena.objects.len()))?;
        self.arena.objects.push(ObjNode {
            callable,
            args,
            state: Val::MISSING,
            items: kwargs.map(|kwargs| {
                Box::new(ObjItems {
                    kwargs: Some(kwargs),
                    ..ObjItems::default()
                })
            }),
        });
        Ok(v)
    }

    #[allow(
        clippy::too_many_lines,
        reason = "the pickle machine's opcode dispatch: one match arm per opcode, sharing the stack and memo"
    )]
    fn run(mut self) -> Result<(Arena, Val), PickleError> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                // PROTO
                0x80 => {
                    let protocol = self.u8()?;
                    if !(2..=5).contains(&protocol) {
                        return Err(PickleError::UnsupportedProtocol { protocol });
                    }
                }
                // FRAME: an 8-byte length; frames are only a buffering hint.
                0x95 => {
                    self.take(8)?;
                }
                // STOP
                b'.' => {
                    let v = self.pop(op, at)?;
                    if !self.stack.is_empty() {
                        return Err(PickleError::BadStop {
                            len: self.stack.len() + 1,
                        });
                    }
                    return Ok((self.arena, v));
                }
                b'(' => {
                    if self.stack.len() >= self.limits.max_stack {
                        return Err(PickleError::Limit {
                            what: "stack size",
                            limit: self.limits.max_stack,
                        });
                    }
                    self.stack.push(Val::MARK);
                }
                b'0' => {
                    self.pop(op, at)?;
                }
                b'1' => {
                    self.pop_mark(at)?;
                }
                b'2' => {
                    let v = self.top(op, at)?;
                    self.push(v)?;
                }
                b'N' => self.push(Val::NONE)?,
                0x88 => self.push(Val::TRUE)?,
                0x89 => self.push(Val::FALSE)?,
                // BININT, BININT1, BININT2
                b'J' => {
                    let b = self.take(4)?;
                    let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    let v = self.int(i64::from(v))?;
                    self.push(v)?;
                }
                b'K' => {
                    let v = self.u8()?;
                    let v = self.int(i64::from(v))?;
                    self.push(v)?;
                }
                b'M' => {
                    let v = self.uint::<2>()?;
                    let v = self.int(v as i64)?;
                    self.push(v)?;
                }
                // LONG1, LONG4
                0x8a => {
                    let n = u64::from(self.u8()?);
                    let b = self.take(n)?;
                    let v = self.long(b)?;
                    self.push(v)?;
                }
                0x8b => {
                    let n = self.uint::<4>()?;
                    let b = self.take(n)?;
                    let v = self.long(b)?;
                    self.push(v)?;
                }
                // INT, LONG (text, protocol 0 forms that protocol 2 pickles may still contain)
                b'I' | b'L' => {
                    let line = self.line()?;
                    let text = line.trim_end_matches('L');
                    let v = match text {
                        "00" => Val::FALSE,
                        "01" => Val::TRUE,
                        _ => {
                            let i = text.parse::<i64>().map_err(|_| PickleError::BadText {
                                offset: at,
                                what: format!("integer {text:?}"),
                            })?;
                            self.int(i)?
                        }
                    };
                    self.push(v)?;
                }
                // BINFLOAT (big endian)
                b'G' => {
                    let b = self.take(8)?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    let v = self.alloc(Node::Float(f64::from_be_bytes(a)))?;
                    self.push(v)?;
                }
                // FLOAT (text)
                b'F' => {
                    let line = self.line()?;
                    let v = line.parse::<f64>().map_err(|_| PickleError::BadText {
                        offset: at,
                        what: format!("float {line:?}"),
                    })?;
                    let v = self.alloc(Node::Float(v))?;
                    self.push(v)?;
                }
                // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                0x8c => {
                    let n = u64::from(self.u8()?);
                    let v = self.string(n)?;
                    self.push(v)?;
                }
                b'X' => {
                    let n = self.uint::<4>()?;
                    let v = self.string(n)?;
                    self.push(v)?;
                }
                0x8d => {
                    let n = self.uint::<8>()?;
                    let v = self.string(n)?;
                    self.push(v)?;
                }
                // SHORT_BINSTRING, BINSTRING (Python 2 str: kept as text when UTF-8, else bytes)
                b'U' | b'T' => {
                    let n = if op == b'U' {
                        u64::from(self.u8()?)
                    } else {
                        self.uint::<4>()?
                    };
                    let b = self.take(n)?;
                    let v = if let Ok(s) = std::str::from_utf8(b) {
                        self.text_node(s)?
                    } else {
                        let span = self.blob_span(b);
                        self.alloc(Node::Bytes(span))?
                    };
                    self.push(v)?;
                }
                // SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                b'C' => {
                    let n = u64::from(self.u8()?);
                    let v = self.bytes(n)?;
                    self.push(v)?;
                }
                b'B' => {
                    let n = self.uint::<4>()?;
                    let v = self.bytes(n)?;
                    self.push(v)?;
                }
                0x8e | 0x96 => {
                    let n = self.uint::<8>()?;
                    let v = self.bytes(n)?;
                    self.push(v)?;
                }
                // EMPTY_TUPLE, TUPLE1..3, TUPLE
                b')' => {
                    let v = self.tuple(Some(0), op, at)?;
                    self.push(v)?;
                }
                0x85..=0x87 => {
                    let v = self.tuple(Some(usize::from(op - 0x84)), op, at)?;
                    self.push(v)?;
                }
                b't' => {
                    let v = self.tuple(None, op, at)?;
                    self.push(v)?;
                }
                // EMPTY_LIST, LIST, APPEND, APPENDS
                b']' => {
                    let v = self.alloc(Node::Seq(SeqKind::List, Self::EMPTY))?;
                    self.push(v)?;
                }
                b'l' => {
                    let v = self.seq_from_mark(SeqKind::List, at)?;
                    self.push(v)?;
                }
                b'a' => {
                    let item = self.pop(op, at)?;
                    let target = self.top(op, at)?;
                    add_items(&mut self.arena, target, std::iter::once(item), at)?;
                }
                // APPENDS, ADDITEMS
                b'e' | 0x90 => self.append_items(op, at)?,
                // EMPTY_DICT, DICT, SETITEM, SETITEMS
                b'}' => {
                    let v = self.alloc(Node::Dict(Self::EMPTY))?;
                    self.push(v)?;
                }
                b'd' => {
                    let items = self.pop_mark(at)?;
                    if !items.len().is_multiple_of(2) {
                        return Err(PickleError::WrongType {
                            offset: at,
                            what: "DICT with an odd number of values".into(),
                        });
                    }
                    let v = self.alloc(Node::Dict(Self::EMPTY))?;
                    self.add_dict_items(v, &items, at)?;
                    self.push(v)?;
                }
                b's' => {
                    let value = self.pop(op, at)?;
                    let key = self.pop(op, at)?;
                    let target = self.top(op, at)?;
                    self.add_dict_items(target, &[key, value], at)?;
                }
                b'u' => self.set_items(op, at)?,
                // EMPTY_SET, ADDITEMS, FROZENSET
                0x8f => {
                    let v = self.alloc(Node::Seq(SeqKind::Set, Self::EMPTY))?;
                    self.push(v)?;
                }
                0x91 => {
                    let v = self.seq_from_mark(SeqKind::Set, at)?;
                    self.push(v)?;
                }
                // GLOBAL, STACK_GLOBAL
                b'c' => {
                    let module = self.line()?.to_owned();
                    let name = self.line()?.to_owned();
                    let v = self.alloc(Node::Global(Box::new(Global { module, name })))?;
                    self.push(v)?;
                }
                0x93 => {
                    let name = self.pop(op, at)?;
                    let module = self.pop(op, at)?;
                    let (Some(module), Some(name)) = (self.str_of(module), self.str_of(name))
                    else {
                        return Err(PickleError::WrongType {
                            offset: at,
                            what: "STACK_GLOBAL needs two strings".into(),
                        });
                    };
                    let v = self.alloc(Node::Global(Box::new(Global { module, name })))?;
                    self.push(v)?;
                }
                // REDUCE, NEWOBJ, NEWOBJ_EX
                b'R' | 0x81 => {
                    let args = self.pop(op, at)?;
                    let callable = self.pop(op, at)?;
                    let v = self.object(callable, args, None)?;
                    self.push(v)?;
                }
                0x92 => {
                    let kwargs = self.pop(op, at)?;
                    let args = self.pop(op, at)?;
                    let cls = self.pop(op, at)?;
                    let v = self.object(cls, args, Some(kwargs))?;
                    self.push(v)?;
                }
                // BUILD
                b'b' => {
                    let state = self.pop(op, at)?;
                    let target = self.top(op, at)?;
                    let i = Self::container(target, at)?;
                    match &self.arena.nodes[i] {
                        Node::Object(o) => self.arena.objects[*o].state = state,
                        _ => {
                            return Err(PickleError::WrongType {
                                offset: at,
                                what: "BUILD on a value that is not an object".into(),
                            });
                        }
                    }
                }
                // BINPERSID, PERSID
                b'Q' => {
                    let pid = self.pop(op, at)?;
                    let v = self.alloc(Node::PersId(pid))?;
                    self.push(v)?;
                }
                b'P' => {
                    let line = self.line()?;
                    let s = self.text_node(line)?;
                    let v = self.alloc(Node::PersId(s))?;
                    self.push(v)?;
                }
                // MEMOIZE, BINPUT, LONG_BINPUT, PUT
                0x94 => {
                    let v = self.top(op, at)?;
                    let index = self.memo_len as u64;
                    self.memo_put(index, v)?;
                }
                b'q' => {
                    let index = u64::from(self.u8()?);
                    let v = self.top(op, at)?;
                    self.memo_put(index, v)?;
                }
                b'r' => {
                    let index = self.uint::<4>()?;
                    let v = self.top(op, at)?;
                    self.memo_put(index, v)?;
                }
                b'p' => {
                    let line = self.line()?;
                    let index = line.parse::<u64>().map_err(|_| PickleError::BadText {
                        offset: at,
                        what: format!("memo index {line:?}"),
                    })?;
                    let v = self.top(op, at)?;
                    self.memo_put(index, v)?;
                }
                // BINGET, LONG_BINGET, GET
                b'h' => {
                    let index = u64::from(self.u8()?);
                    self.memo_get(index, at)?;
                }
                b'j' => {
                    let index = self.uint::<4>()?;
                    self.memo_get(index, at)?;
                }
                b'g' => {
                    let line = self.line()?;
                    let index = line.parse::<u64>().map_err(|_| PickleError::BadText {
                        offset: at,
                        what: format!("memo index {line:?}"),
                    })?;
                    self.memo_get(index, at)?;
                }
                _ => {
                    return Err(PickleError::UnsupportedOpcode {
                        opcode: op,
                        offset: at,
                    });
                }
            }
        }
    }

    fn str_of(&self, v: Val) -> Option<String> {
        self.arena.str_of(v).map(str::to_owned)
    }

    /// An integer value: inline when it fits, else a node.
    #[inline]
    fn int(&mut self, i: i64) -> Result<Val, PickleError> {
        match Val::small_int(i) {
            Some(v) => Ok(v),
            None => self.alloc(Node::Int(i)),
        }
    }

    const EMPTY: Items = Items::Pooled(Span { start: 0, len: 0 });

    /// `LIST`/`FROZENSET`: the values above the topmost mark, straight into the pool.
    fn seq_from_mark(&mut self, kind: SeqKind, at: usize) -> Result<Val, PickleError> {
        let mark = self.mark(at)?;
        let span = self.pool_from_stack(mark + 1, mark);
        self.alloc(Node::Seq(kind, Items::Pooled(span)))
    }

    /// Moves the stack values from `first` on into [`Arena::vals`] (the caller checked there is
    /// no mark among them) and drops the stack from `drop_from`: the new run.
    fn pool_from_stack(&mut self, first: usize, drop_from: usize) -> Span {
        let start = self.arena.vals.len();
        self.arena.vals.extend_from_slice(&self.stack[first..]);
        self.stack.truncate(drop_from);
        Span {
            start,
            len: self.arena.vals.len() - start,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pass 2: the owned tree, with known torch classes turned into records.

struct Converter<'a> {
    arena: &'a Arena,
    limits: PickleLimits,
    nodes: usize,
    bytes: usize,
}

fn bad(class: &str, what: impl Into<String>) -> PickleError {
    PickleError::BadRecord {
        class: class.to_owned(),
        what: what.into(),
    }
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

    fn values(&mut self, vals: &[Val], depth: usize) -> Result<Vec<PyValue>, PickleError> {
        vals.iter().map(|&v| self.value(v, depth)).collect()
    }

    fn pairs(
        &mut self,
        vals: &[(Val, Val)],
        depth: usize,
    ) -> Result<Vec<(PyValue, PyValue)>, PickleError> {
        vals.iter()
            .map(|&(k, v)| Ok((self.value(k, depth)?, self.value(v, depth)?)))
            .collect()
    }

    fn value(&mut self, val: Val, depth: usize) -> Result<PyValue, PickleError> {
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
                    self.charge(0, span.len)?;
                    PyValue::Str(self.arena.str(*span).to_owned())
                }
                Node::Bytes(span) => {
                    self.charge(0, span.len)?;
                    PyValue::Bytes(self.arena.blob(*span).to_vec())
                }
                Node::BigInt(span) => {
                    self.charge(0, span.len)?;
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
                    let node = &arena.objects[*o];
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

fn global_value(g: &Global) -> PyValue {
    if g.module == "torch"
        && let Ok(dtype) = g.name.parse::<DType>()
        && !g.name.contains("Storage")
    {
        return PyValue::DType(dtype);
    }
    PyValue::Global(Box::new(g.clone()))
}

/// The dtype of a typed storage class name (`FloatStorage` -> float32).
pub fn dtype_of_storage_class(name: &str) -> Option<DType> {
    Some(match name {
        "FloatStorage" => DType::Float32,
        "DoubleStorage" => DType::Float64,
        "HalfStorage" => DType::Float16,
        "BFloat16Storage" => DType::BFloat16,
        "LongStorage" => DType::Int64,
        "IntStorage" => DType::Int32,
        "ShortStorage" => DType::Int16,
        "CharStorage" => DType::Int8,
        "ByteStorage" | "UntypedStorage" => DType::UInt8,
        "BoolStorage" => DType::Bool,
        "ComplexFloatStorage" => DType::Complex64,
        "ComplexDoubleStorage" => DType::Complex128,
        "Float8_e4m3fnStorage" => DType::Float8E4M3Fn,
        "Float8_e5m2Storage" => DType::Float8E5M2,
        "UInt16Storage" => DType::UInt16,
        "UInt32Storage" => DType::UInt32,
        "UInt64Storage" => DType::UInt64,
        _ => return None,
    })
}

fn storage_from_pid(pid: &PyValue) -> Result<PyValue, PickleError> {
    const CLASS: &str = "persistent storage id";
    let items = pid.as_seq().ok_or_else(|| {
        bad(
            CLASS,
            format!("expected a tuple, found {}", pid.type_name()),
        )
    })?;
    if items.first().and_then(PyValue::as_str) != Some("storage") || items.len() < 5 {
        return Err(bad(
            CLASS,
            "expected (\"storage\", type, key, location, numel)",
        ));
    }
    let dtype = match &items[1] {
        PyValue::Global(g) if g.module == "torch" || g.module == "torch.storage" => {
            dtype_of_storage_class(&g.name)
                .ok_or_else(|| bad(CLASS, format!("unknown storage type {g}")))?
        }
        PyValue::DType(d) => *d,
        other => {
            return Err(bad(
                CLASS,
                format!("unknown storage type {}", other.type_name()),
            ));
        }
    };
    let key = items[2]
        .as_str()
        .ok_or_else(|| bad(CLASS, "storage key is not a string"))?
        .to_owned();
    let location = items[3].as_str().unwrap_or("").to_owned();
    let numel = items[4]
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| bad(CLASS, "storage size is not a non-negative int"))?;
    Ok(PyValue::Storage(Box::new(StorageRef {
        key,
        dtype,
        location,
        numel,
    })))
}

fn recognise(obj: PyObject) -> Result<PyValue, PickleError> {
    let Some(class) = obj.class().cloned() else {
        return Ok(PyValue::Object(Box::new(obj)));
    };
    // `state_dict()` returns an OrderedDict with a `_metadata` attribute (set by BUILD): the
    // attribute only holds module versions and is dropped.
    if class.is("collections", "OrderedDict") && obj.args.is_empty() {
        return Ok(PyValue::Dict(obj.dict_items));
    }
    if class.is("torch", "Size") {
        let dims = obj
            .args
            .first()
            .and_then(PyValue::as_dims)
            .ok_or_else(|| bad("torch.Size", "expected a tuple of non-negative ints"))?;
        return Ok(PyValue::Size(dims));
    }
    if class.module == "torch._utils" {
        match class.name.as_str() {
            "_rebuild_tensor_v2" | "_rebuild_tensor" | "_rebuild_tensor_v3" => {
                return Ok(PyValue::Tensor(Box::new(tensor_from_args(
                    &class.name,
                    &obj.args,
                )?)));
            }
            "_rebuild_parameter" | "_rebuild_parameter_with_state" => {
                let Some(PyValue::Tensor(t)) = obj.args.first() else {
                    return Err(bad(&class.name, "first argument is not a tensor"));
                };
                let mut t = t.clone();
                t.requires_grad = obj.args.get(1).and_then(PyValue::as_i64) == Some(1);
                t.wrapper = Some("torch.nn.parameter.Parameter".into());
                return Ok(PyValue::Tensor(t));
            }
            _ => {}
        }
    }
    if class.is("torch._tensor", "_rebuild_from_type_v2") {
        return rebuild_from_type(obj);
    }
    Ok(PyValue::Object(Box::new(obj)))
}

fn tensor_from_args(name: &str, args: &[PyValue]) -> Result<TensorRef, PickleError> {
    if args.len() < 4 {
        return Err(bad(
            name,
            format!("expected at least 4 arguments, found {}", args.len()),
        ));
    }
    let PyValue::Storage(storage) = &args[0] else {
        return Err(bad(
            name,
            format!("argument 0 is a {}, not a storage", args[0].type_name()),
        ));
    };
    let storage_offset = args[1]
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| bad(name, "storage offset is not a non-negative int"))?;
    let shape = args[2]
        .as_dims()
        .ok_or_else(|| bad(name, "size is not a tuple of non-negative ints"))?;
    let stride = args[3]
        .as_dims()
        .ok_or_else(|| bad(name, "stride is not a tuple of non-negative ints"))?;
    if shape.len() != stride.len() {
        return Err(bad(
            name,
            format!(
                "size has {} dims but stride has {}",
                shape.len(),
                stride.len()
            ),
        ));
    }
    let requires_grad = args.get(4).and_then(PyValue::as_i64) == Some(1);
    let mut storage = (**storage).clone();
    if name == "_rebuild_tensor_v3" {
        // `_rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype)`: torch
        // writes dtypes without a typed storage class (float8, uint16/32/64, ...) as an
        // `UntypedStorage` (sized in bytes) and names the dtype here.
        let dtype = match args.get(6) {
            Some(PyValue::DType(d)) => *d,
            Some(PyValue::Global(g)) => {
                return Err(bad(name, format!("unknown dtype {g}")));
            }
            Some(other) => {
                return Err(bad(
                    name,
                    format!("argument 6 is a {}, not a dtype", other.type_name()),
                ));
            }
            None => return Err(bad(name, "no dtype argument (expected 7 arguments)")),
        };
        if storage.dtype != DType::UInt8 && storage.dtype != dtype {
            return Err(bad(
                name,
                format!(
                    "a {} storage rebuilt as {dtype}: expected an UntypedStorage",
                    storage.dtype
                ),
            ));
        }
        if storage.dtype != dtype {
            // Bytes past the last whole element are ignored, as torch's `set_` does.
            storage.numel /= dtype.size_bytes() as u64;
            storage.dtype = dtype;
        }
    }
    Ok(TensorRef {
        storage,
        storage_offset,
        shape,
        stride,
        requires_grad,
        wrapper: None,
    })
}

/// `_rebuild_from_type_v2(func, new_type, args, state)`.
fn rebuild_from_type(obj: PyObject) -> Result<PyValue, PickleError> {
    const NAME: &str = "_rebuild_from_type_v2";
    let mut args = obj.args.into_iter();
    let (Some(func), Some(new_type), Some(inner_args)) = (args.next(), args.next(), args.next())
    else {
        return Err(bad(NAME, "expected (func, new_type, args, state)"));
    };
    let state = args.next().unwrap_or(PyValue::None);
    let type_name = match &new_type {
        PyValue::Global(g) => g.to_string(),
        other => other.type_name(),
    };
    let inner = inner_args.as_seq().unwrap_or(&[]).to_vec();
    match &func {
        PyValue::Global(g) if g.is("torch._utils", "_rebuild_wrapper_subclass") => {
            if type_name.ends_with(".ShardedTensor") {
                return Ok(PyValue::ShardedTensor(Box::new(sharded_tensor(
                    &inner, &state,
                )?)));
            }
            if type_name.ends_with(".DTensor") {
                return Ok(PyValue::DTensor(Box::new(dtensor(&inner, &state)?)));
            }
        }
        _ => {}
    }
    // A plain tensor (or Parameter) re-typed: the value is whatever `func(*args)` built.
    if let PyValue::Global(g) = &func
        && let Ok(PyValue::Tensor(mut t)) = recognise(PyObject {
            callable: PyValue::Global(g.clone()),
            args: inner.clone(),
            kwargs: Vec::new(),
            state: None,
            list_items: Vec::new(),
            dict_items: Vec::new(),
        })
    {
        if type_name != "torch._tensor.Tensor" && type_name != "torch.Tensor" {
            t.wrapper = Some(type_name);
        }
        return Ok(PyValue::Tensor(t));
    }
    Ok(PyValue::Object(Box::new(PyObject {
        callable: PyValue::Global(Box::new(Global {
            module: "torch._tensor".into(),
            name: NAME.into(),
        })),
        args: vec![func, new_type, PyValue::Tuple(inner), state],
        kwargs: Vec::new(),
        state: None,
        list_items: Vec::new(),
        dict_items: Vec::new(),
    })))
}

/// The wrapper-subclass arguments `(cls, dtype, size, stride, storage_offset, layout, device, rg)`.
fn wrapper_dtype_and_size(
    class: &str,
    inner: &[PyValue],
) -> Result<(DType, Vec<u64>), PickleError> {
    let dtype = match inner.get(1) {
        Some(PyValue::DType(d)) => *d,
        _ => return Err(bad(class, "no dtype in the wrapper arguments")),
    };
    let size = inner
        .get(2)
        .and_then(PyValue::as_dims)
        .ok_or_else(|| bad(class, "no size in the wrapper arguments"))?;
    Ok((dtype, size))
}

fn obj_attr<'a>(v: &'a PyValue, name: &str) -> Option<&'a PyValue> {
    match v {
        PyValue::Object(o) => o.attr(name),
        PyValue::Dict(items) => dict_get(items, name),
        _ => None,
    }
}

fn placement_string(v: &PyValue) -> Option<String> {
    // `_remote_device` state: {_worker_name, _rank, _device: torch.device('cpu')}.
    let rank = obj_attr(v, "_rank").and_then(PyValue::as_i64)?;
    let device = match obj_attr(v, "_device") {
        Some(PyValue::Object(o)) => o
            .args
            .first()
            .and_then(PyValue::as_str)
            .unwrap_or("")
            .to_owned(),
        Some(PyValue::Str(s)) => s.clone(),
        _ => String::new(),
    };
    Some(format!("rank:{rank}/{device}"))
}

fn shard_meta(v: &PyValue) -> Result<ShardMeta, PickleError> {
    const CLASS: &str = "ShardMetadata";
    let offsets = obj_attr(v, "shard_offsets")
        .and_then(PyValue::as_dims)
        .ok_or_else(|| bad(CLASS, "no shard_offsets"))?;
    let sizes = obj_attr(v, "shard_sizes")
        .and_then(PyValue::as_dims)
        .ok_or_else(|| bad(CLASS, "no shard_sizes"))?;
    if offsets.len() != sizes.len() {
        return Err(bad(CLASS, "shard_offsets and shard_sizes differ in length"));
    }
    Ok(ShardMeta {
        offsets,
        sizes,
        placement: obj_attr(v, "placement").and_then(placement_string),
    })
}

fn sharded_tensor(inner: &[PyValue], state: &PyValue) -> Result<ShardedTensorRecord, PickleError> {
    const CLASS: &str = "ShardedTensor";
    let (dtype, size) = wrapper_dtype_and_size(CLASS, inner)?;
    // state = (local_shards, metadata, pg_state, sharding_spec, init_rrefs)
    let parts = state
        .as_seq()
        .ok_or_else(|| bad(CLASS, "state is not a tuple"))?;
    let local = parts
        .first()
        .and_then(PyValue::as_seq)
        .ok_or_else(|| bad(CLASS, "no local shard list"))?;
    let mut local_shards = Vec::with_capacity(local.len());
    for shard in local {
        let Some(PyValue::Tensor(t)) = obj_attr(shard, "tensor") else {
            return Err(bad(CLASS, "a local shard has no tensor"));
        };
        let meta = shard_meta(
            obj_attr(shard, "metadata")
                .ok_or_else(|| bad(CLASS, "a local shard has no metadata"))?,
        )?;
        local_shards.push(LocalShard {
            tensor: (**t).clone(),
            offsets: meta.offsets,
            sizes: meta.sizes,
            placement: meta.placement,
        });
    }
    let metadata = parts.get(1).ok_or_else(|| bad(CLASS, "no metadata"))?;
    let global_shape = match obj_attr(metadata, "size").and_then(PyValue::as_dims) {
        Some(s) => s,
        None => size,
    };
    let shards = obj_attr(metadata, "shards_metadata")
        .and_then(PyValue::as_seq)
        .ok_or_else(|| bad(CLASS, "no shards_metadata"))?
        .iter()
        .map(shard_meta)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ShardedTensorRecord {
        global_shape,
        dtype,
        local_shards,
        shards,
    })
}

fn placement(v: &PyValue) -> Placement {
    let PyValue::Object(o) = v else {
        return Placement::Other {
            class: v.type_name(),
        };
    };
    let class = o.class().map(|g| g.name.clone()).unwrap_or_default();
    let dim = o.attr("dim").and_then(PyValue::as_i64).unwrap_or(0);
    match class.as_str() {
        "Shard" => Placement::Shard { dim },
        "_StridedShard" => Placement::StridedShard {
            dim,
            split_factor: o
                .attr("split_factor")
                .and_then(PyValue::as_i64)
                .unwrap_or(1),
        },
        "Replicate" => Placement::Replicate,
        "Partial" | "_Partial" => Placement::Partial {
            reduce_op: o
                .attr("reduce_op")
                .and_then(PyValue::as_str)
                .unwrap_or("sum")
                .to_owned(),
        },
        _ => Placement::Other {
            class: o.class().map(ToString::to_string).unwrap_or(class),
        },
    }
}

fn mesh_shape(mesh: &PyValue) -> Option<Vec<u64>> {
    // torch >= 2.9: `_layout` (a _MeshLayout whose `axes` is a _FlatLayout with `shape`).
    if let Some(layout) = obj_attr(mesh, "_layout") {
        if let Some(axes) = obj_attr(layout, "axes") {
            if let Some(shape) = obj_attr(axes, "shape").and_then(PyValue::as_dims) {
                return Some(shape);
            }
            // A tuple of per-dimension flat layouts: concatenate their shapes.
            if let Some(parts) = axes.as_seq() {
                let mut shape = Vec::new();
                for p in parts {
                    shape.extend(obj_attr(p, "shape").and_then(PyValue::as_dims)?);
                }
                return Some(shape);
            }
        }
        if let Some(shape) = obj_attr(layout, "shape").and_then(PyValue::as_dims) {
            return Some(shape);
        }
    }
    // Older releases: the `mesh` tensor itself.
    match obj_attr(mesh, "mesh") {
        Some(PyValue::Tensor(t)) => Some(t.shape.clone()),
        _ => None,
    }
}

fn dtensor(inner: &[PyValue], state: &PyValue) -> Result<DTensorRecord, PickleError> {
    const CLASS: &str = "DTensor";
    let (dtype, size) = wrapper_dtype_and_size(CLASS, inner)?;
    let Some(PyValue::Tensor(local)) = obj_attr_state(state, "_local_tensor") else {
        return Err(bad(CLASS, "no _local_tensor"));
    };
    let spec = obj_attr_state(state, "_spec").ok_or_else(|| bad(CLASS, "no _spec"))?;
    let placements = obj_attr(spec, "placements")
        .and_then(PyValue::as_seq)
        .ok_or_else(|| bad(CLASS, "no placements in the spec"))?
        .iter()
        .map(placement)
        .collect();
    let mesh = obj_attr(spec, "mesh");
    let global_shape = match obj_attr(spec, "tensor_meta") {
        Some(PyValue::Object(tm)) => tm.args.first().and_then(PyValue::as_dims).unwrap_or(size),
        _ => size,
    };
    Ok(DTensorRecord {
        global_shape,
        dtype,
        local: (**local).clone(),
        placements,
        mesh_shape: mesh.and_then(mesh_shape),
        mesh_coordinate: mesh
            .and_then(|m| obj_attr(m, "_coordinate_on_dim"))
            .and_then(PyValue::as_dims),
    })
}

/// DTensor state is `(None, {slots})` or a plain dict.
fn obj_attr_state<'a>(state: &'a PyValue, name: &str) -> Option<&'a PyValue> {
    match state {
        PyValue::Dict(items) => dict_get(items, name),
        PyValue::Tuple(parts) => parts.iter().find_map(|p| match p {
            PyValue::Dict(items) => dict_get(items, name),
            _ => None,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_and_containers() {
        // pickle.dumps({'a': [1, 2.5, None, True], 'b': (b'x', 'y')}, protocol=2)
        let data = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01G@\x04\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bq\x03c_codecs\nencode\nq\x04X\x01\x00\x00\x00xq\x05X\x06\x00\x00\x00latin1q\x06\x86q\x07Rq\x08X\x01\x00\x00\x00yq\x09\x86q\x0au.";
        let v = parse(data).unwrap();
        let PyValue::Dict(items) = v else { panic!() };
        assert_eq!(
            items[0].1,
            PyValue::List(vec![
                PyValue::Int(1),
                PyValue::Float(2.5),
                PyValue::None,
                PyValue::Bool(true)
            ])
        );
        // `_codecs.encode` is never run: it stays an object node.
        let PyValue::Tuple(t) = &items[1].1 else {
            panic!()
        };
        assert!(matches!(&t[0], PyValue::Object(o) if o.class().unwrap().name == "encode"));
    }

    #[test]
    fn attrs_in_any_field_order() {
        // `pickle.dumps((a, b, c), protocol=4)` of three `m.P` objects whose `__dict__`s are
        // {x: 1, y: 2, z: 3}, {z: 30, y: 20, x: 10} and {w: 0, x: 100, q: 5, z: 300}.
        let data = b"\x80\x04\x95\\\x00\x00\x00\x00\x00\x00\x00\x8c\x01m\x94\x8c\x01P\x94\x93\x94)\x81\x94}\x94(\x8c\x01x\x94K\x01\x8c\x01y\x94K\x02\x8c\x01z\x94K\x03ubh\x02)\x81\x94}\x94(h\x07K\x1eh\x06K\x14h\x05K\nubh\x02)\x81\x94}\x94(\x8c\x01w\x94K\x00h\x05Kd\x8c\x01q\x94K\x05h\x07M,\x01ub\x87\x94.";
        let arena = parse_arena(data).unwrap();
        let objs: Vec<ObjRef<'_>> = arena
            .root()
            .items()
            .unwrap()
            .map(|o| o.object().unwrap())
            .collect();
        let ints = |found: &[Option<PyRef<'_>>]| -> Vec<Option<i64>> {
            found.iter().map(|f| f.and_then(|v| v.as_i64())).collect()
        };
        let names = ["x", "y", "z"];
        assert_eq!(ints(&objs[0].attrs(names)), [Some(1), Some(2), Some(3)]);
        assert_eq!(ints(&objs[1].attrs(names)), [Some(10), Some(20), Some(30)]);
        assert_eq!(ints(&objs[2].attrs(names)), [Some(100), None, Some(300)]);
        assert_eq!(ints(&objs[1].attrs(["z", "x"])), [Some(30), Some(10)]);
        assert_eq!(
            ints(&objs[2].attrs(["q", "w", "v"])),
            [Some(5), Some(0), None]
        );
        // One cache over all three records (their keys are memo references to the first
        // record's strings, or new strings), and a name the cache learnt in another position.
        let mut cache = AttrCache::new();
        let got: Vec<_> = objs
            .iter()
            .map(|o| ints(&o.attrs_cached(&mut cache, ["x", "y", "z"])))
            .collect();
        assert_eq!(
            got,
            [
                [Some(1), Some(2), Some(3)],
                [Some(10), Some(20), Some(30)],
                [Some(100), None, Some(300)]
            ]
        );
        for o in &objs {
            for name in ["w", "x", "y", "z", "q"] {
                assert_eq!(
                    o.attrs([name])[0].and_then(|v| v.as_i64()),
                    o.attr(name).and_then(|v| v.as_i64())
                );
            }
        }
    }

    #[test]
    fn containers_filled_in_interleaved_steps() {
        // Lists and dicts filled in several steps, with other containers filled in between (a
        // second `APPENDS` batch after a tuple was built), sets, frozensets, `DICT`, `LIST`, `()`.
        // Python's `pickle.loads` gives ([1, 3, 5], {10: 11, 12: 13}, {20: 21, 22: 23},
        // [7, (8, 9)], {30, 31}, frozenset({32}), {40: 41}, [42], (), [2, 4]).
        let data = b"\x80\x04(]\x94(K\x01e]\x94(K\x02e0(K\x03K\x05eh\x01(K\x04e0}\x94(K\nK\x0bu}\x94(K\x14K\x15u0(K\x0cK\ruh\x03K\x16K\x17s]\x94(K\x07e(K\x08K\t\x86e\x8f\x94(K\x1eK\x1f\x90(K \x91(K(K)d(K*l)h\x01t.";
        let int = PyValue::Int;
        let ints = |v: &[i64]| v.iter().map(|&i| int(i)).collect::<Vec<_>>();
        let pairs = |v: &[(i64, i64)]| v.iter().map(|&(k, x)| (int(k), int(x))).collect();
        let want = PyValue::Tuple(vec![
            PyValue::List(ints(&[1, 3, 5])),
            PyValue::Dict(pairs(&[(10, 11), (12, 13)])),
            PyValue::Dict(pairs(&[(20, 21), (22, 23)])),
            PyValue::List(vec![int(7), PyValue::Tuple(ints(&[8, 9]))]),
            PyValue::Set(ints(&[30, 31])),
            PyValue::Set(ints(&[32])),
            PyValue::Dict(pairs(&[(40, 41)])),
            PyValue::List(ints(&[42])),
            PyValue::Tuple(Vec::new()),
            PyValue::List(ints(&[2, 4])),
        ]);
        assert_eq!(parse(data).unwrap(), want);
        // The arena views see the same.
        let arena = parse_arena(data).unwrap();
        let items: Vec<PyRef<'_>> = arena.root().items().unwrap().collect();
        let l1: Vec<i64> = items[0]
            .items()
            .unwrap()
            .filter_map(|x| x.as_i64())
            .collect();
        assert_eq!(l1, [1, 3, 5]);
        let d2: Vec<(i64, i64)> = items[2]
            .dict_items()
            .unwrap()
            .filter_map(|(k, v)| Some((k.as_i64()?, v.as_i64()?)))
            .collect();
        assert_eq!(d2, [(20, 21), (22, 23)]);
        assert_eq!(items[3].type_name(), "list");
        assert_eq!(items[4].type_name(), "set");
        assert_eq!(items[8].items().unwrap().len(), 0);
    }

    #[test]
    fn integers_at_the_edges_of_the_inline_range() {
        // pickle.dumps((2**60-1, 2**60, -2**60, -2**60-1, 2**63-1, -2**63, 1.5, True, False,
        //               None, 0, -1, 255, 65535, 2**31-1, -2**31), protocol=2)
        let data = b"\x80\x02(\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x0f\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x10\x8a\x08\x00\x00\x00\x00\x00\x00\x00\xf0\x8a\x08\xff\xff\xff\xff\xff\xff\xff\xef\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80G?\xf8\x00\x00\x00\x00\x00\x00\x88\x89NK\x00J\xff\xff\xff\xffK\xffM\xff\xffJ\xff\xff\xff\x7fJ\x00\x00\x00\x80tq\x00.";
        let ints: [i64; 6] = [
            (1 << 60) - 1,
            1 << 60,
            -(1 << 60),
            -(1 << 60) - 1,
            i64::MAX,
            i64::MIN,
        ];
        let mut want: Vec<PyValue> = ints.iter().map(|&i| PyValue::Int(i)).collect();
        want.extend([
            PyValue::Float(1.5),
            PyValue::Bool(true),
            PyValue::Bool(false),
            PyValue::None,
        ]);
        let small: [i64; 6] = [0, -1, 255, 65535, (1 << 31) - 1, -(1 << 31)];
        want.extend(small.iter().map(|&i| PyValue::Int(i)));
        assert_eq!(parse(data).unwrap(), PyValue::Tuple(want));
        let arena = parse_arena(data).unwrap();
        let items: Vec<PyRef<'_>> = arena.root().items().unwrap().collect();
        for (i, want) in ints.iter().enumerate() {
            assert_eq!(items[i].as_i64(), Some(*want), "item {i}");
            assert_eq!(items[i].type_name(), "int");
        }
        assert_eq!(items[6].as_i64(), None);
        assert_eq!(items[6].type_name(), "float");
        assert_eq!(items[7].as_i64(), Some(1));
        assert!(items[9].is_none() && !items[10].is_none());
        assert_eq!(items[11].as_i64(), Some(-1));
    }

    #[test]
    fn memo_bomb_hits_the_node_limit() {
        // l0 = []; l_{i+1} = [l_i, l_i]: 2^40 nodes when expanded.
        let mut p = vec![0x80, 2, b']', b'q', 0, b'0'];
        for i in 0..40u8 {
            p.extend([b'h', i, b'h', i, 0x86, b'q', i + 1, b'0']);
        }
        p.extend([b'h', 40, b'.']);
        let err = parse(&p).unwrap_err();
        assert!(matches!(err, PickleError::Limit { .. }), "{err}");
    }

    #[test]
    fn self_reference_hits_the_depth_limit() {
        // l = []; l.append(l)
        let p = [0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'];
        let err = parse(&p).unwrap_err();
        assert!(
            matches!(
                err,
                PickleError::Limit {
                    what: "nesting depth",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn huge_length_is_truncation_not_allocation() {
        let p = [
            0x80, 4, 0x8d, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
        ];
        assert!(matches!(
            parse(&p).unwrap_err(),
            PickleError::Truncated { .. }
        ));
    }

    #[test]
    fn protocol_six_is_refused() {
        assert!(matches!(
            parse(&[0x80, 6, b'N', b'.']).unwrap_err(),
            PickleError::UnsupportedProtocol { protocol: 6 }
        ));
    }

    #[test]
    fn long1_sign_extends() {
        let p = [0x80, 2, 0x8a, 2, 0x00, 0xff, b'.'];
        assert_eq!(parse(&p).unwrap(), PyValue::Int(-256));
    }
}
