//! The streaming reader's values: what its stack and memo hold (DCP records made as their `BUILD`
//! completes, shapes inline, other objects generic), and the lookups of their fields.

use std::borrow::Cow;
use std::rc::Rc;

use super::table::{ChunkPlace, Names, TableChunk};
use super::window::{R, un};
use crate::dtype::DType;
use crate::formats::pickle::Global;
use crate::shape::Dims;

type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Containers nested deeper than this are not followed (torch's `.metadata` nests about 6 deep).
pub(super) const MAX_DEPTH: u8 = 32;

/// Which DCP class a global is (by module and name, exactly as torch writes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    Metadata,
    TensorMeta,
    BytesMeta,
    ChunkMeta,
    MetadataIndex,
    StorageInfo,
    Size,
    Other,
}

pub(super) fn class_of(g: &Global) -> Class {
    const META: &str = "torch.distributed.checkpoint.metadata";
    match (g.module.as_str(), g.name.as_str()) {
        (META, "Metadata") => Class::Metadata,
        (META, "TensorStorageMetadata") => Class::TensorMeta,
        (META, "BytesStorageMetadata") => Class::BytesMeta,
        (META, "ChunkStorageMetadata") => Class::ChunkMeta,
        (META, "MetadataIndex") => Class::MetadataIndex,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo") => Class::StorageInfo,
        ("torch", "Size") => Class::Size,
        _ => Class::Other,
    }
}

/// A generic object (`REDUCE`/`NEWOBJ` of a class this reader does not turn into a record).
#[derive(Debug, Clone)]
pub(super) struct Obj {
    pub(super) callable: V,
    pub(super) args: V,
    pub(super) state: Option<V>,
    /// The memo slots holding a copy of this object (slots fetched later only): a `BUILD` of the
    /// object updates those copies too, as long as none was fetched yet.
    pub(super) slots: Vec<usize>,
    /// This copy (in the memo) was fetched: the object must not change any more.
    pub(super) fetched: bool,
    /// Tells copies of one object apart from other objects.
    pub(super) id: u32,
    pub(super) depth: u8,
}

/// A `MetadataIndex` (the chunk offsets are `None` for bytes items).
#[derive(Debug, Clone)]
pub(super) struct IndexRec {
    pub(super) fqn: Rc<str>,
    pub(super) offsets: Option<Dims>,
}

/// A `_StorageInfo`.
#[derive(Debug, Clone)]
pub(super) struct InfoRec {
    pub(super) path: Rc<str>,
    pub(super) offset: u64,
    pub(super) length: u64,
    pub(super) transforms: Vec<String>,
}

/// A `TensorStorageMetadata`: its chunks, placed by `storage_data`'s records as they come.
#[derive(Debug, Clone)]
pub(super) struct TensorVal {
    pub(super) dtype: DType,
    pub(super) size: Vec<u64>,
    pub(super) chunks: Vec<TableChunk>,
    /// The records of this item seen so far.
    pub(super) records: usize,
}

/// A value on the stack or in the memo.
#[derive(Debug, Clone)]
pub(super) enum V {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    Str(Rc<str>),
    /// Into the machine's globals.
    Global(u32),
    /// A value nothing here reads (float, bytes, big int, persistent id).
    Opaque,
    /// A set: nothing here reads one either.
    Set,
    Tuple(u8, Rc<[V]>),
    /// A tuple of non-negative ints (`torch.Size`'s argument): no allocation up to two.
    Ints(Dims),
    /// A 1-tuple of [`V::Ints`] (`torch.Size`'s arguments).
    Args(Dims),
    /// An object of a global class made without arguments and not built yet (most objects are
    /// built right after: no allocation for them).
    New(u32),
    List(u8, Vec<V>),
    /// Keys and values in turn.
    Dict(u8, Vec<V>),
    Obj(Box<Obj>),
    /// `torch.Size(dims)`.
    Size(Dims),
    Chunk(Box<(Dims, Dims)>),
    Tensor(Box<TensorVal>),
    /// A `BytesStorageMetadata` item of `state_dict_metadata` given its record's place.
    Placed(ChunkPlace),
    Index(Box<IndexRec>),
    Info(Box<InfoRec>),
    /// The dict of `MetadataIndex` -> `_StorageInfo` pairs (`storage_data`): each pair placed a
    /// chunk of `state_dict_metadata` as it was added.
    Storage,
}

impl V {
    pub(super) fn depth(&self) -> u8 {
        match self {
            V::Tuple(d, _) | V::List(d, _) | V::Dict(d, _) => *d,
            V::Ints(_) => 1,
            V::Args(_) => 2,
            V::Obj(o) => o.depth,
            _ => 0,
        }
    }

    pub(super) fn as_str(&self) -> Option<&Rc<str>> {
        match self {
            V::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An int as the general path reads one (bools count).
    pub(super) fn as_i64(&self) -> Option<i64> {
        match self {
            V::Int(i) => Some(*i),
            V::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// The items of a tuple or list.
    pub(super) fn items(&self) -> Option<Cow<'_, [V]>> {
        match self {
            V::Tuple(_, t) => Some(Cow::Borrowed(t)),
            V::List(_, l) => Some(Cow::Borrowed(l)),
            V::Ints(d) => Some(Cow::Owned(d.iter().map(|&i| V::Int(i as i64)).collect())),
            V::Args(d) => Some(Cow::Owned(vec![V::Ints(d.clone())])),
            _ => None,
        }
    }

    /// A shape: `torch.Size` or a tuple/list of non-negative ints.
    pub(super) fn dims(&self) -> Option<Dims> {
        match self {
            V::Size(d) | V::Ints(d) => Some(d.clone()),
            _ => self
                .items()?
                .iter()
                .map(|v| v.as_i64().and_then(|i| u64::try_from(i).ok()))
                .collect::<Option<Dims>>(),
        }
    }
}

pub(super) fn depth_of<'a>(items: impl Iterator<Item = &'a V>) -> R<u8> {
    let d = items.map(V::depth).max().unwrap_or(0) + 1;
    if d > MAX_DEPTH {
        return Err(un!());
    }
    Ok(d)
}

/// Looks up `names` in a dict state (keys and values in turn): the value of each, `None` when
/// absent; gives up on a name that occurs twice (the general path takes the first).
pub(super) fn fields<'a, const N: usize>(
    pairs: &'a [V],
    names: [&str; N],
) -> R<[Option<&'a V>; N]> {
    Ok(positions(pairs, names)?.map(|p| p.map(|p| &pairs[p])))
}

/// [`fields`] as the positions of the values in `pairs`.
pub(super) fn positions<const N: usize>(pairs: &[V], names: [&str; N]) -> R<[Option<usize>; N]> {
    let mut found = [None; N];
    for (p, kv) in pairs.chunks_exact(2).enumerate() {
        let Some(k) = kv[0].as_str() else { continue };
        if let Some(i) = names.iter().position(|n| **n == **k) {
            if found[i].is_some() {
                return Err(un!());
            }
            found[i] = Some(2 * p + 1);
        }
    }
    Ok(found)
}

/// The key strings [`cached_fields`] matched, by name: a pickle stores each field name once
/// and fetches it for every record, so most keys are the very string matched before.
pub(super) struct Keys<const N: usize>([Option<Rc<str>>; N]);

impl<const N: usize> Default for Keys<N> {
    fn default() -> Self {
        Keys(std::array::from_fn(|_| None))
    }
}

/// [`fields`], matching keys first by identity with those matched before.
pub(super) fn cached_fields<'a, const N: usize>(
    pairs: &'a [V],
    keys: &mut Keys<N>,
    names: [&str; N],
) -> R<[Option<&'a V>; N]> {
    let mut found: [Option<&V>; N] = [None; N];
    for kv in pairs.chunks_exact(2) {
        let V::Str(k) = &kv[0] else { continue };
        let i = match keys
            .0
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| Rc::ptr_eq(c, k)))
        {
            Some(i) => i,
            None => match names.iter().position(|n| **n == **k) {
                Some(i) => {
                    keys.0[i] = Some(Rc::clone(k));
                    i
                }
                None => continue,
            },
        };
        if found[i].is_some() {
            return Err(un!());
        }
        found[i] = Some(&kv[1]);
    }
    Ok(found)
}

/// `None`, absent, or a non-negative int.
pub(super) fn opt_u64(v: Option<&V>) -> R<Option<u64>> {
    match v {
        None | Some(V::None) => Ok(None),
        Some(v) => v
            .as_i64()
            .and_then(|i| u64::try_from(i).ok())
            .map(Some)
            .ok_or_else(|| un!()),
    }
}

/// [`Names`] of shared strings: a string the pickle stores once and fetches for every record
/// (an fqn, a file name) is looked up by its address, not hashed each time.
#[derive(Default)]
pub(super) struct SharedNames {
    pub(super) names: Names,
    pub(super) by_address: FastMap<usize, u32>,
    /// Keeps every string looked up by address alive, so that no address is reused.
    pub(super) keep: Vec<Rc<str>>,
}

impl SharedNames {
    /// True when this string, or its text, was looked up before.
    pub(super) fn knows(&self, s: &Rc<str>) -> bool {
        self.by_address
            .contains_key(&(Rc::as_ptr(s).cast::<u8>() as usize))
            || self.names.ids.contains_key(&**s)
    }

    pub(super) fn id(&mut self, s: &Rc<str>) -> u32 {
        let address = Rc::as_ptr(s).cast::<u8>() as usize;
        if let Some(&id) = self.by_address.get(&address) {
            return id;
        }
        if let Some(&id) = self.names.ids.get(&**s) {
            // Another string of a known text (a pickle that does not share it): looked up by text
            // each time, and not kept.
            return id;
        }
        let id = self.names.id(s);
        self.by_address.insert(address, id);
        self.keep.push(Rc::clone(s));
        id
    }
}

/// A torch dtype global, as the general path reads one.
pub(super) fn dtype_of(g: &Global) -> Option<DType> {
    if g.module == "torch" && !g.name.contains("Storage") {
        g.name.parse::<DType>().ok()
    } else {
        None
    }
}
