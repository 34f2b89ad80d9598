//! The node arena of pass 1: tagged 8-byte values, nodes, shared pools.

use super::value::Global;

/// A pass-1 value in 8 bytes (the memo, the pools and the object records hold millions of them
/// in a large `.metadata`): the low 3 bits say what it is, the rest holds it. Integers outside
/// ±2^60 and floats are nodes ([`Node::Int`], [`Node::Float`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Val(u64);

/// What a [`Val`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum V {
    None,
    Bool(bool),
    Int(i64),
    Ref(usize),
}

impl Val {
    pub(super) const TAG_BITS: u32 = 3;
    pub(super) const NONE: Val = Val(0);
    pub(super) const FALSE: Val = Val(1);
    pub(super) const TRUE: Val = Val(1 | 1 << Self::TAG_BITS);
    pub(super) const INT: u64 = 2;
    pub(super) const REF: u64 = 3;
    /// Never made from input: an empty memo slot, an object without `BUILD` state.
    pub(super) const MISSING: Val = Val(7);
    /// Only on the machine's stack: `MARK`. Every opcode that takes a value checks for it, so it
    /// never reaches the memo, the pools or a record.
    pub(super) const MARK: Val = Val(6);

    /// `i` inline, when it fits in 61 bits.
    pub(super) fn small_int(i: i64) -> Option<Val> {
        let packed = i.wrapping_shl(Self::TAG_BITS);
        (packed >> Self::TAG_BITS == i).then_some(Val(packed as u64 | Self::INT))
    }

    /// A node index (nodes are bounded by the input's length, far below 2^61).
    pub(super) fn reference(i: usize) -> Val {
        Val((i as u64) << Self::TAG_BITS | Self::REF)
    }

    pub(super) fn get(self) -> V {
        match self.0 & 7 {
            1 => V::Bool(self.0 >> Self::TAG_BITS != 0),
            Self::INT => V::Int((self.0 as i64) >> Self::TAG_BITS),
            Self::REF => V::Ref((self.0 >> Self::TAG_BITS) as usize),
            _ => V::None,
        }
    }

    /// `None` for [`Val::MISSING`].
    pub(super) fn present(self) -> Option<Val> {
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
pub(super) struct Span {
    start: u32,
    len: u32,
}

/// An index into one of the arena's tables as 32 bits: tables never hold more entries than the
/// pickle has bytes, which is less than 4 GiB (see [`Span::new`]).
pub(super) fn index_u32(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

// Pass 1 holds a node per 7 bytes of a `.metadata`: keep a node at 16 bytes.
const _: () = assert!(std::mem::size_of::<Node>() == 16);

impl Span {
    /// The run `start..start + len` of a pool. Pools never hold more entries than the pickle has
    /// bytes (every entry comes from at least one byte of input), and the machine refuses pickles
    /// of 4 GiB and more ([`Machine::run`](super::machine::Machine::run)), so both fit in 32 bits:
    /// a node is 16 bytes (a 1-million-chunk `.metadata` holds 19 million of them).
    pub(super) const EMPTY: Span = Span { start: 0, len: 0 };

    pub(super) fn new(start: usize, len: usize) -> Span {
        Span {
            start: index_u32(start),
            len: index_u32(len),
        }
    }

    pub(super) fn len(self) -> usize {
        self.len as usize
    }

    pub(super) fn range(self) -> std::ops::Range<usize> {
        let start = self.start as usize;
        start..start.saturating_add(self.len as usize)
    }
}

/// A list's or set's items, or a dict's pairs: a run in the shared pool while the container is
/// filled in one go (as Python fills them: one `APPENDS`/`SETITEMS` per 1000 items), an owned
/// vector (an index into [`Arena::owned_vals`] or [`Arena::owned_pairs`]) once a later fill
/// cannot extend the run in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Items {
    Pooled(Span),
    Owned(u32),
}

/// Which kind of value a [`Node::Seq`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SeqKind {
    List,
    Set,
}

#[derive(Debug)]
pub(super) enum Node {
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
    Object(u32),
}

/// Pass 1's output: the nodes, the pools their contents live in, and the object records. A
/// `.metadata` of 100 000 chunks holds about 1.9 million nodes, so no node takes an allocation
/// of its own unless it must (a container filled in several interleaved steps, a global).
#[derive(Debug, Default)]
pub(super) struct Arena {
    pub(super) nodes: Vec<Node>,
    pub(super) vals: Vec<Val>,
    pub(super) pairs: Vec<(Val, Val)>,
    pub(super) text: String,
    pub(super) blob: Vec<u8>,
    pub(super) owned_vals: Vec<Vec<Val>>,
    pub(super) owned_pairs: Vec<Vec<(Val, Val)>>,
    pub(super) objects: Vec<ObjNode>,
}

impl Arena {
    // Spans are only made by the machine from what it pushed into the pools: always in bounds
    // (the empty answers are never taken).
    pub(super) fn vals(&self, span: Span) -> &[Val] {
        self.vals.get(span.range()).unwrap_or(&[])
    }

    pub(super) fn str(&self, span: Span) -> &str {
        self.text.get(span.range()).unwrap_or("")
    }

    pub(super) fn blob(&self, span: Span) -> &[u8] {
        self.blob.get(span.range()).unwrap_or(&[])
    }

    pub(super) fn seq(&self, items: Items) -> &[Val] {
        match items {
            Items::Pooled(span) => self.vals(span),
            Items::Owned(i) => self.owned_vals.get(i as usize).map_or(&[], Vec::as_slice),
        }
    }

    pub(super) fn dict(&self, items: Items) -> &[(Val, Val)] {
        match items {
            Items::Pooled(span) => self.pairs.get(span.range()).unwrap_or(&[]),
            Items::Owned(i) => self.owned_pairs.get(i as usize).map_or(&[], Vec::as_slice),
        }
    }

    /// The string `v` names, if it is one.
    pub(super) fn str_of(&self, v: Val) -> Option<&str> {
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
pub(super) fn extend_items<T: Copy>(
    items: &mut Items,
    pool: &mut Vec<T>,
    owned: &mut Vec<Vec<T>>,
    new: impl Iterator<Item = T>,
) {
    match items {
        Items::Pooled(span) if span.len() == 0 => {
            let start = pool.len();
            pool.extend(new);
            *span = Span::new(start, pool.len() - start);
        }
        Items::Pooled(span) if span.range().end == pool.len() => {
            let start = span.range().start;
            pool.extend(new);
            *span = Span::new(start, pool.len() - start);
        }
        Items::Pooled(span) => {
            let mut v: Vec<T> = pool.get(span.range()).unwrap_or(&[]).to_vec();
            v.extend(new);
            owned.push(v);
            *items = Items::Owned(index_u32(owned.len() - 1));
        }
        Items::Owned(i) => {
            if let Some(v) = owned.get_mut(*i as usize) {
                v.extend(new);
            }
        }
    }
}

#[derive(Debug)]
pub(super) struct ObjNode {
    pub(super) callable: Val,
    pub(super) args: Val,
    /// [`Val::MISSING`] until `BUILD`.
    pub(super) state: Val,
    /// `NEWOBJ_EX` keyword arguments and `APPENDS`/`SETITEMS` on the object (an `OrderedDict`, a
    /// `defaultdict`): rare, so boxed.
    pub(super) items: Option<Box<ObjItems>>,
}

#[derive(Debug, Default)]
pub(super) struct ObjItems {
    pub(super) kwargs: Option<Val>,
    pub(super) list_items: Vec<Val>,
    pub(super) dict_items: Vec<(Val, Val)>,
}

impl ObjNode {
    pub(super) fn kwargs(&self) -> Option<Val> {
        self.items.as_ref().and_then(|i| i.kwargs)
    }

    pub(super) fn list_items(&self) -> &[Val] {
        self.items.as_ref().map_or(&[], |i| &i.list_items)
    }

    pub(super) fn dict_items(&self) -> &[(Val, Val)] {
        self.items.as_ref().map_or(&[], |i| &i.dict_items)
    }

    pub(super) fn items_mut(&mut self) -> &mut ObjItems {
        self.items.get_or_insert_with(Box::default)
    }
}
