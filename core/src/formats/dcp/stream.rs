//! The streaming `.metadata` reader: the fast path to a [`MetadataTable`] for the pickles torch
//! writes, read window by window from the source and never held whole.
//!
//! One cheap first pass over the opcodes notes which memo entries are ever fetched (`BINGET`):
//! per chunk torch memoizes about 16 values and fetches only field names, class globals and
//! shared strings, so only those are kept. The second pass runs the opcodes once, turning each
//! `ChunkStorageMetadata`, `TensorStorageMetadata`, `MetadataIndex` and `_StorageInfo` into a
//! compact record as its `BUILD` completes; each `storage_data` pair, as it is added, gives its
//! place (file, byte range) to the chunk it names (torch writes a tensor's records in the order
//! of its chunks). Nothing is imported or called.
//!
//! Anything this reader does not recognise (another class where a DCP one belongs, a shared
//! mutable value, a field of an unexpected type, an error of any kind) makes it give up
//! ([`Unrecognised`]): the caller then reads the file with the general pickle machine, which
//! accepts exactly what it accepted before and reports the same errors. This path therefore only
//! ever returns what the general path returns.

use std::collections::BTreeMap;
use std::rc::Rc;

use super::table::{
    ChunkPlace, MetadataTable, TableChunk, TableItem, TableItemKind, TransformLists,
};
use super::values::{
    Class, IndexRec, InfoRec, Keys, MAX_DEPTH, Obj, SharedNames, TensorVal, V, cached_fields,
    class_of, depth_of, dtype_of, fields, opt_u64, positions,
};
use super::window::{MemoNumbers, R, Ranked, Reader, Unrecognised, WINDOW, fetched_indexes, un};
use super::{PlannerStep, storage_path_is_safe};
use crate::formats::pickle::{Global, PickleLimits};
use crate::shape::Dims;
use crate::source::Source;

pub(super) mod fast;

type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

struct Machine<'s> {
    r: Reader<'s>,
    limits: PickleLimits,
    stack: Vec<V>,
    /// The memo indexes fetched later, each with its slot in `memo`.
    fetched: Ranked,
    numbers: MemoNumbers,
    memo: Vec<Option<V>>,
    globals: Vec<Global>,
    global_ids: FastMap<Global, u32>,
    classes: Vec<Class>,
    /// The stack position of `state_dict_metadata` while `storage_data` is read.
    sdm_pos: Option<usize>,
    /// Its items: key -> position of the value.
    items_by_name: FastMap<String, usize>,
    /// The fqn of the last record and its item.
    last_fqn: Option<(Rc<str>, Option<usize>)>,
    files: SharedNames,
    transforms: TransformLists,
    /// Objects made so far (their ids).
    objects: u32,
    /// The one empty tuple.
    empty: Rc<[V]>,
    chunk_keys: Keys<2>,
    index_keys: Keys<3>,
    info_keys: Keys<4>,
    /// The keys and values of the record [`Machine::fast_record`] reads (kept for its capacity).
    fast_pairs: Vec<V>,
}

impl Machine<'_> {
    fn next_id(&mut self) -> u32 {
        self.objects = self.objects.wrapping_add(1);
        self.objects
    }

    fn push(&mut self, v: V) -> R<()> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(un!());
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self) -> R<V> {
        match self.stack.pop() {
            Some(V::Mark) | None => Err(un!()),
            Some(v) => Ok(v),
        }
    }

    fn top(&mut self) -> R<&mut V> {
        match self.stack.last_mut() {
            Some(V::Mark) | None => Err(un!()),
            Some(v) => Ok(v),
        }
    }

    fn mark(&self) -> R<usize> {
        self.stack
            .iter()
            .rposition(|v| matches!(v, V::Mark))
            .ok_or_else(|| un!())
    }

    fn global(&mut self, g: Global) -> R<V> {
        if let Some(&id) = self.global_ids.get(&g) {
            return Ok(V::Global(id));
        }
        let id = u32::try_from(self.globals.len()).map_err(|_| un!())?;
        self.classes.push(class_of(&g));
        self.global_ids.insert(g.clone(), id);
        self.globals.push(g);
        Ok(V::Global(id))
    }

    fn class(&self, v: &V) -> Class {
        match v {
            V::Global(id) => self.classes[*id as usize],
            _ => Class::Other,
        }
    }

    fn text(&mut self, n: u64) -> R<V> {
        let b = self.r.take(n)?;
        let s = std::str::from_utf8(b).map_err(|_| un!())?;
        Ok(V::Str(Rc::from(s)))
    }

    fn tuple(&mut self, first: usize, drop_from: usize) -> R<V> {
        if self.stack[first..].iter().any(|v| matches!(v, V::Mark)) {
            return Err(un!());
        }
        let all_ints = first < self.stack.len()
            && self.stack[first..]
                .iter()
                .all(|v| matches!(v, V::Int(i) if *i >= 0));
        if all_ints {
            let dims: Dims = self.stack[first..]
                .iter()
                .map(|v| match v {
                    V::Int(i) => *i as u64,
                    _ => 0,
                })
                .collect();
            self.stack.truncate(drop_from);
            return Ok(V::Ints(dims));
        }
        let items: Rc<[V]> = self.stack.drain(first..).collect();
        self.stack.truncate(drop_from);
        Ok(V::Tuple(depth_of(items.iter())?, items))
    }

    /// `REDUCE`/`NEWOBJ`/`NEWOBJ_EX`: `torch.Size(dims)` becomes a shape; anything else an object.
    fn object(&mut self, callable: V, args: V) -> R<V> {
        if self.class(&callable) == Class::Size {
            if let V::Args(d) = args {
                return Ok(V::Size(d));
            }
            if let Some(d) = args.items().and_then(|a| a.first().and_then(V::dims)) {
                return Ok(V::Size(d));
            }
        }
        if let (V::Global(g), V::Tuple(_, t)) = (&callable, &args)
            && t.is_empty()
        {
            return Ok(V::New(*g));
        }
        let depth = depth_of([&callable, &args].into_iter())?;
        Ok(V::Obj(Box::new(Obj {
            callable,
            args,
            state: None,
            slots: Vec::new(),
            fetched: false,
            id: self.next_id(),
            depth,
        })))
    }

    /// The object on top of the stack as an [`Obj`] (a [`V::New`] one is allocated now).
    fn materialize(&mut self) -> R<()> {
        if let V::New(g) = *self.top()? {
            let obj = Obj {
                callable: V::Global(g),
                args: V::Tuple(1, Rc::clone(&self.empty)),
                state: None,
                slots: Vec::new(),
                fetched: false,
                id: self.next_id(),
                depth: 2,
            };
            *self.top()? = V::Obj(Box::new(obj));
        }
        Ok(())
    }

    /// `BUILD`: a DCP record is made from its state here; other objects keep the state.
    fn build(&mut self) -> R<()> {
        let state = self.pop()?;
        if let V::New(g) = *self.top()? {
            let class = self.classes[g as usize];
            if let Some(record) = self.record(class, &state)? {
                *self.top()? = record;
                return Ok(());
            }
            self.materialize()?;
        }
        let (class, slots, id) = match self.top()? {
            V::Obj(obj) => (obj.callable.clone(), std::mem::take(&mut obj.slots), obj.id),
            _ => return Err(un!()),
        };
        let class = self.class(&class);
        let record = self.record(class, &state)?;
        let V::Obj(obj) = self.top()? else {
            return Err(un!());
        };
        let depth = obj.depth.max(state.depth() + 1);
        if depth > MAX_DEPTH {
            return Err(un!());
        }
        // A memoized object built after: its copies in the memo are built too, as long as none
        // was fetched yet.
        for slot in &slots {
            match self.memo[*slot].as_mut() {
                Some(V::Obj(copy)) if copy.id == id && !copy.fetched => {
                    if let Some(r) = &record {
                        self.memo[*slot] = Some(r.clone());
                    } else {
                        copy.state = Some(state.clone());
                        copy.depth = depth;
                    }
                }
                _ => return Err(un!()),
            }
        }
        let V::Obj(obj) = self.top()? else {
            return Err(un!());
        };
        if let Some(r) = record {
            *self.top()? = r;
        } else {
            obj.depth = depth;
            obj.state = Some(state);
            obj.slots = slots;
        }
        Ok(())
    }

    /// The DCP record an object of `class` with this `BUILD` state makes (`None` for other
    /// classes).
    fn record(&mut self, class: Class, state: &V) -> R<Option<V>> {
        match state {
            V::Dict(_, pairs) => self.record_of(class, pairs),
            _ if matches!(
                class,
                Class::ChunkMeta | Class::TensorMeta | Class::MetadataIndex | Class::StorageInfo
            ) =>
            {
                Err(un!())
            }
            _ => Ok(None),
        }
    }

    /// [`Machine::record`] of a dict state given as its keys and values in turn.
    fn record_of(&mut self, class: Class, pairs: &[V]) -> R<Option<V>> {
        Ok(match class {
            Class::ChunkMeta => {
                let [offsets, sizes] =
                    cached_fields(pairs, &mut self.chunk_keys, ["offsets", "sizes"])?;
                let (Some(offsets), Some(sizes)) =
                    (offsets.and_then(V::dims), sizes.and_then(V::dims))
                else {
                    return Err(un!());
                };
                Some(V::Chunk(Box::new((offsets, sizes))))
            }
            Class::TensorMeta => Some(self.tensor_meta(pairs)?),
            Class::MetadataIndex => {
                let [fqn, offset, index] =
                    cached_fields(pairs, &mut self.index_keys, ["fqn", "offset", "index"])?;
                let fqn = fqn.and_then(V::as_str).ok_or_else(|| un!())?.clone();
                let offsets = match offset {
                    None | Some(V::None) => None,
                    Some(v) => Some(v.dims().ok_or_else(|| un!())?),
                };
                opt_u64(index)?;
                Some(V::Index(Box::new(IndexRec { fqn, offsets })))
            }
            Class::StorageInfo => {
                let [path, offset, length, transforms] = cached_fields(
                    pairs,
                    &mut self.info_keys,
                    ["relative_path", "offset", "length", "transform_descriptors"],
                )?;
                let path = path.and_then(V::as_str).ok_or_else(|| un!())?.clone();
                // A name already in the table was checked when first seen.
                if !self.files.knows(&path) && !storage_path_is_safe(&path) {
                    return Err(un!());
                }
                let transforms = match transforms {
                    None | Some(V::None) => Vec::new(),
                    Some(t) => t
                        .items()
                        .ok_or_else(|| un!())?
                        .iter()
                        .map(|d| d.as_str().map(ToString::to_string))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| un!())?,
                };
                let (Some(offset), Some(length)) = (opt_u64(offset)?, opt_u64(length)?) else {
                    return Err(un!());
                };
                Some(V::Info(Box::new(InfoRec {
                    path,
                    offset,
                    length,
                    transforms,
                })))
            }
            _ => None,
        })
    }

    /// A `TensorStorageMetadata` from its state.
    fn tensor_meta(&self, pairs: &[V]) -> R<V> {
        let [props, size, chunks] = fields(pairs, ["properties", "size", "chunks"])?;
        let Some(V::Obj(props)) = props else {
            return Err(un!());
        };
        // TensorProperties pickles its state as a tuple whose first element is the dtype; older
        // releases used a dict state.
        let dtype_ref = match &props.state {
            Some(V::Tuple(_, t)) => t.first(),
            Some(V::List(_, l)) => l.first(),
            Some(V::Dict(_, d)) => fields(d, ["dtype"])?[0],
            _ => None,
        };
        let dtype = match dtype_ref {
            Some(V::Global(id)) => dtype_of(&self.globals[*id as usize]).ok_or_else(|| un!())?,
            _ => return Err(un!()),
        };
        let size = size.and_then(V::dims).ok_or_else(|| un!())?.into_vec();
        let list = chunks.and_then(V::items).ok_or_else(|| un!())?;
        let mut out = Vec::with_capacity(list.len());
        for c in list.iter() {
            let V::Chunk(c) = c else {
                return Err(un!());
            };
            if c.0.len() != size.len() || c.1.len() != size.len() {
                return Err(un!());
            }
            out.push(TableChunk {
                offsets: c.0.clone(),
                sizes: c.1.clone(),
                place: None,
            });
        }
        Ok(V::Tensor(Box::new(TensorVal {
            dtype,
            size,
            chunks: out,
            records: 0,
        })))
    }

    /// `SETITEM(S)`: the values from `first` on, as pairs, into the dict below them (below the
    /// mark at `first - 1` when `marked`).
    fn set_items(&mut self, first: usize, marked: bool) -> R<()> {
        let pairs: Vec<V> = self.stack.split_off(first);
        if marked {
            self.stack.pop();
        }
        if !pairs.len().is_multiple_of(2) || pairs.iter().any(|v| matches!(v, V::Mark)) {
            return Err(un!());
        }
        let target = self.top()?;
        if let V::Dict(_, items) = target
            && items.is_empty()
            && matches!(pairs.first(), Some(V::Index(_)))
        {
            *target = V::Storage;
            self.find_items()?;
        }
        let target = self.stack.last_mut().ok_or_else(|| un!())?;
        match target {
            V::Dict(d, items) => {
                let mut depth = *d;
                for kv in pairs.chunks_exact(2) {
                    if matches!(kv[0], V::Index(_) | V::Storage) {
                        return Err(un!());
                    }
                    depth = depth.max(kv[0].depth().max(kv[1].depth()) + 1);
                }
                if depth > MAX_DEPTH {
                    return Err(un!());
                }
                *d = depth;
                if items.is_empty() {
                    *items = pairs;
                } else {
                    items.extend(pairs);
                }
                Ok(())
            }
            V::Storage => {
                let mut pairs = pairs.into_iter();
                while let (Some(k), Some(v)) = (pairs.next(), pairs.next()) {
                    let (V::Index(k), V::Info(v)) = (k, v) else {
                        return Err(un!());
                    };
                    let place = ChunkPlace {
                        file: self.files.id(&v.path),
                        transforms: if v.transforms.is_empty() {
                            0
                        } else {
                            self.transforms.id(&v.transforms)
                        },
                        offset: v.offset,
                        length: v.length,
                    };
                    self.place(&k, place)?;
                }
                Ok(())
            }
            _ => Err(un!()),
        }
    }

    /// When `storage_data` starts: finds `state_dict_metadata` (its pair waits on the stack for
    /// the `SETITEMS` of `Metadata`'s state, as torch pickles it) and its items by name.
    fn find_items(&mut self) -> R<()> {
        if self.sdm_pos.is_some() {
            // A second dict of records: not torch's shape.
            return Err(un!());
        }
        let n = self.stack.len().saturating_sub(1);
        let pos = (1..n)
            .rev()
            .find(|&j| {
                matches!(&self.stack[j - 1], V::Str(k) if &**k == "state_dict_metadata")
                    && matches!(self.stack[j], V::Dict(..))
            })
            .ok_or_else(|| un!())?;
        let V::Dict(_, items) = &self.stack[pos] else {
            return Err(un!());
        };
        for (p, kv) in items.chunks_exact(2).enumerate() {
            let key = kv[0].as_str().ok_or_else(|| un!())?;
            if self
                .items_by_name
                .insert(key.to_string(), 2 * p + 1)
                .is_some()
            {
                // A key twice: the general path decides what it means.
                return Err(un!());
            }
        }
        self.sdm_pos = Some(pos);
        Ok(())
    }

    /// A `storage_data` record: its place goes to the chunk of its item at its position among
    /// the item's records, which must be the chunk at its offsets (the general path handles
    /// records in another order). Records of no item, and records past an item's chunks, place
    /// nothing (torch's lookup never reaches them).
    fn place(&mut self, k: &IndexRec, place: ChunkPlace) -> R<()> {
        let item = match &self.last_fqn {
            Some((fqn, item)) if Rc::ptr_eq(fqn, &k.fqn) => *item,
            _ => {
                let item = self.items_by_name.get(&*k.fqn).copied();
                self.last_fqn = Some((Rc::clone(&k.fqn), item));
                item
            }
        };
        let Some(item) = item else {
            return Ok(());
        };
        let sdm = self.sdm_pos.ok_or_else(|| un!())?;
        let Some(V::Dict(_, items)) = self.stack.get_mut(sdm) else {
            return Err(un!());
        };
        let value = items.get_mut(item).ok_or_else(|| un!())?;
        let classes = &self.classes;
        let class_of_value = |v: &V| match v {
            V::New(g) => classes[*g as usize],
            V::Obj(o) => match o.callable {
                V::Global(g) => classes[g as usize],
                _ => Class::Other,
            },
            _ => Class::Other,
        };
        let is_bytes = class_of_value(value) == Class::BytesMeta;
        match value {
            V::Tensor(t) => {
                let i = t.records;
                t.records += 1;
                if let Some(c) = t.chunks.get_mut(i) {
                    if k.offsets.as_deref() != Some(&*c.offsets) {
                        return Err(un!());
                    }
                    c.place = Some(place);
                }
            }
            V::Placed(_) => {}
            V::New(_) | V::Obj(_) if is_bytes => {
                if k.offsets.is_some() {
                    return Err(un!());
                }
                *value = V::Placed(place);
            }
            _ => return Err(un!()),
        }
        Ok(())
    }

    /// `APPEND(S)`/`ADDITEMS`: the values from `first` on into the list (or set) below them (below
    /// the mark at `first - 1` when `marked`).
    fn append_items(&mut self, first: usize, marked: bool) -> R<()> {
        let items: Vec<V> = self.stack.drain(first..).collect();
        if marked {
            self.stack.pop();
        }
        if items.iter().any(|v| matches!(v, V::Mark | V::Storage)) {
            return Err(un!());
        }
        match self.top()? {
            V::List(d, l) => {
                *d = (*d).max(depth_of(items.iter())?);
                l.extend(items);
            }
            V::Set => {}
            _ => return Err(un!()),
        }
        Ok(())
    }

    fn memo_put(&mut self, index: Option<u64>) -> R<()> {
        self.top()?;
        let i = self.numbers.put(index)?;
        let Some(i) = self.fetched.slot(i) else {
            return Ok(());
        };
        self.materialize()?;
        let v = self.top()?;
        let kept = match v {
            V::None
            | V::Bool(_)
            | V::Int(_)
            | V::Str(_)
            | V::Global(_)
            | V::Opaque
            | V::Tuple(..)
            | V::Ints(_)
            | V::Args(_)
            | V::Size(_)
            | V::Chunk(_)
            | V::Index(_)
            | V::Info(_) => v.clone(),
            V::Obj(o) => {
                o.slots.push(i);
                v.clone()
            }
            _ => return Err(un!()),
        };
        self.memo[i] = Some(kept);
        Ok(())
    }

    fn memo_get(&mut self, index: u64) -> R<()> {
        let i = usize::try_from(index)
            .ok()
            .and_then(|i| self.fetched.slot(i))
            .ok_or_else(|| un!())?;
        let v = self.memo[i].as_mut().ok_or_else(|| un!())?;
        if let V::Obj(o) = v {
            o.fetched = true;
        }
        let mut v = v.clone();
        if let V::Obj(o) = &mut v {
            // The fetched value is the object as it is now; it is not built again.
            o.slots.clear();
        }
        self.push(v)
    }

    #[allow(
        clippy::too_many_lines,
        reason = "the opcode dispatch: one match arm per opcode, sharing the stack and memo"
    )]
    fn run(&mut self) -> R<V> {
        loop {
            let op = self.r.u8()?;
            match op {
                0x80 => {
                    let p = self.r.u8()?;
                    if !(2..=5).contains(&p) {
                        return Err(un!());
                    }
                }
                0x95 => {
                    self.r.take(8)?;
                }
                b'.' => {
                    let v = self.pop()?;
                    if !self.stack.is_empty() {
                        return Err(un!());
                    }
                    return Ok(v);
                }
                b'(' => self.push(V::Mark)?,
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    let m = self.mark()?;
                    self.stack.truncate(m);
                }
                b'2' => {
                    let v = self.top()?.clone();
                    if !matches!(
                        v,
                        V::None
                            | V::Bool(_)
                            | V::Int(_)
                            | V::Str(_)
                            | V::Global(_)
                            | V::Tuple(..)
                            | V::Ints(_)
                            | V::Args(_)
                    ) {
                        return Err(un!());
                    }
                    self.push(v)?;
                }
                b'N' => self.push(V::None)?,
                0x88 => self.push(V::Bool(true))?,
                0x89 => self.push(V::Bool(false))?,
                b'J' => {
                    let b = self.r.take(4)?;
                    let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    self.push(V::Int(i64::from(v)))?;
                }
                b'K' => {
                    let v = self.r.u8()?;
                    self.push(V::Int(i64::from(v)))?;
                }
                b'M' => {
                    let v = self.r.uint::<2>()?;
                    self.push(V::Int(v as i64))?;
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        u64::from(self.r.u8()?)
                    } else {
                        self.r.uint::<4>()?
                    };
                    let b = self.r.take(n)?;
                    let v = if b.is_empty() {
                        V::Int(0)
                    } else if b.len() <= 8 {
                        let negative = b[b.len() - 1] & 0x80 != 0;
                        let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
                        buf[..b.len()].copy_from_slice(b);
                        V::Int(i64::from_le_bytes(buf))
                    } else {
                        V::Opaque
                    };
                    self.push(v)?;
                }
                b'I' | b'L' => {
                    let line = self.r.line()?;
                    let text = line.trim_end_matches('L');
                    let v = match text {
                        "00" => V::Bool(false),
                        "01" => V::Bool(true),
                        _ => V::Int(text.parse::<i64>().map_err(|_| un!())?),
                    };
                    self.push(v)?;
                }
                b'G' => {
                    self.r.take(8)?;
                    self.push(V::Opaque)?;
                }
                b'F' => {
                    let line = self.r.line()?;
                    line.parse::<f64>().map_err(|_| un!())?;
                    self.push(V::Opaque)?;
                }
                0x8c => {
                    let n = u64::from(self.r.u8()?);
                    let v = self.text(n)?;
                    self.push(v)?;
                }
                b'X' => {
                    let n = self.r.uint::<4>()?;
                    let v = self.text(n)?;
                    self.push(v)?;
                }
                0x8d => {
                    let n = self.r.uint::<8>()?;
                    let v = self.text(n)?;
                    self.push(v)?;
                }
                b'U' | b'T' => {
                    let n = if op == b'U' {
                        u64::from(self.r.u8()?)
                    } else {
                        self.r.uint::<4>()?
                    };
                    let b = self.r.take(n)?;
                    let v = match std::str::from_utf8(b) {
                        Ok(s) => V::Str(Rc::from(s)),
                        Err(_) => V::Opaque,
                    };
                    self.push(v)?;
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'C' => u64::from(self.r.u8()?),
                        b'B' => self.r.uint::<4>()?,
                        _ => self.r.uint::<8>()?,
                    };
                    self.r.take(n)?;
                    self.push(V::Opaque)?;
                }
                b')' => {
                    let v = V::Tuple(1, Rc::clone(&self.empty));
                    self.push(v)?;
                }
                0x85 if matches!(self.stack.last(), Some(V::Ints(_))) => {
                    if let Some(V::Ints(d)) = self.stack.pop() {
                        self.push(V::Args(d))?;
                    }
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let first = self.stack.len().checked_sub(n).ok_or_else(|| un!())?;
                    let v = self.tuple(first, first)?;
                    self.push(v)?;
                }
                b't' => {
                    let m = self.mark()?;
                    let v = self.tuple(m + 1, m)?;
                    self.push(v)?;
                }
                b']' => self.push(V::List(1, Vec::new()))?,
                b'l' => {
                    let m = self.mark()?;
                    let items: Vec<V> = self.stack.drain(m + 1..).collect();
                    self.stack.truncate(m);
                    if items.iter().any(|v| matches!(v, V::Storage)) {
                        return Err(un!());
                    }
                    let d = depth_of(items.iter())?;
                    self.push(V::List(d, items))?;
                }
                b'a' => {
                    let first = self.stack.len().checked_sub(1).ok_or_else(|| un!())?;
                    self.append_items(first, false)?;
                }
                b'e' | 0x90 => {
                    let m = self.mark()?;
                    if m == 0 {
                        return Err(un!());
                    }
                    self.append_items(m + 1, true)?;
                }
                b'}' => self.push(V::Dict(1, Vec::new()))?,
                b'd' => {
                    let m = self.mark()?;
                    self.stack.insert(m + 1, V::Dict(1, Vec::new()));
                    self.set_items(m + 2, false)?;
                    let v = self.pop()?;
                    self.stack.truncate(m);
                    self.push(v)?;
                }
                b's' => {
                    let first = self.stack.len().checked_sub(2).ok_or_else(|| un!())?;
                    self.set_items(first, false)?;
                }
                b'u' => {
                    let m = self.mark()?;
                    if m == 0 {
                        return Err(un!());
                    }
                    self.set_items(m + 1, true)?;
                }
                0x8f => self.push(V::Set)?,
                0x91 => {
                    let m = self.mark()?;
                    self.stack.truncate(m);
                    self.push(V::Set)?;
                }
                b'c' => {
                    let module = self.r.line()?;
                    let name = self.r.line()?;
                    let v = self.global(Global { module, name })?;
                    self.push(v)?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Some(module), Some(name)) = (module.as_str(), name.as_str()) else {
                        return Err(un!());
                    };
                    let g = Global {
                        module: module.to_string(),
                        name: name.to_string(),
                    };
                    let v = self.global(g)?;
                    self.push(v)?;
                }
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let v = self.object(callable, args)?;
                    self.push(v)?;
                }
                0x92 => {
                    self.pop()?;
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let v = self.object(callable, args)?;
                    self.push(v)?;
                }
                b'b' => self.build()?,
                b'Q' => {
                    self.pop()?;
                    self.push(V::Opaque)?;
                }
                b'P' => {
                    self.r.line()?;
                    self.push(V::Opaque)?;
                }
                0x94 => self.memo_put(None)?,
                b'q' => {
                    let i = u64::from(self.r.u8()?);
                    self.memo_put(Some(i))?;
                }
                b'r' => {
                    let i = self.r.uint::<4>()?;
                    self.memo_put(Some(i))?;
                }
                b'p' => {
                    let line = self.r.line()?;
                    let i = line.parse::<u64>().map_err(|_| un!())?;
                    self.memo_put(Some(i))?;
                }
                b'h' => {
                    let i = u64::from(self.r.u8()?);
                    if !self.fast_record(i) {
                        self.memo_get(i)?;
                    }
                }
                b'j' => {
                    let i = self.r.uint::<4>()?;
                    if !self.fast_record(i) {
                        self.memo_get(i)?;
                    }
                }
                b'g' => {
                    let line = self.r.line()?;
                    let i = line.parse::<u64>().map_err(|_| un!())?;
                    self.memo_get(i)?;
                }
                _ => return Err(un!()),
            }
        }
    }

    /// The table from the root `Metadata` object.
    #[allow(
        clippy::too_many_lines,
        reason = "reads every field of `Metadata` as the general path does, in one place"
    )]
    fn table(self, root: V) -> R<MetadataTable> {
        let V::Obj(meta) = root else {
            return Err(un!());
        };
        if self.class(&meta.callable) != Class::Metadata {
            return Err(un!());
        }
        let Some(V::Dict(_, mut state)) = meta.state else {
            return Err(un!());
        };
        // The items are moved out (a million chunks are not copied).
        let [sdm_at, storage_at] = positions(&state, ["state_dict_metadata", "storage_data"])?;
        let sdm = match sdm_at {
            Some(p) => std::mem::replace(&mut state[p], V::None),
            None => return Err(un!()),
        };
        // The records placed chunks: they must be `storage_data`'s.
        let placed = match storage_at.map(|p| &state[p]) {
            None | Some(V::None) => false,
            Some(V::Dict(_, pairs)) if pairs.is_empty() => false,
            Some(V::Storage) => true,
            Some(_) => return Err(un!()),
        };
        if placed != self.sdm_pos.is_some() {
            return Err(un!());
        }
        let [planner, version, storage_meta] =
            fields(&state, ["planner_data", "version", "storage_meta"])?;
        let V::Dict(_, sdm) = sdm else {
            return Err(un!());
        };
        let mut items = Vec::with_capacity(sdm.len() / 2);
        let mut sdm = sdm.into_iter();
        while let (Some(k), Some(v)) = (sdm.next(), sdm.next()) {
            let key = k.as_str().ok_or_else(|| un!())?.to_string();
            // Every chunk must have its record (the general path reports one that has none).
            let kind = match v {
                V::Placed(place) => TableItemKind::Bytes { place: Some(place) },
                V::Tensor(t) if t.chunks.iter().all(|c| c.place.is_some()) => {
                    let TensorVal {
                        dtype,
                        size,
                        chunks,
                        ..
                    } = *t;
                    TableItemKind::Tensor {
                        dtype,
                        size,
                        chunks,
                    }
                }
                _ => return Err(un!()),
            };
            items.push(TableItem { key, kind });
        }
        let mut planner_data = BTreeMap::new();
        match planner {
            Some(V::Dict(_, pairs)) => {
                for kv in pairs.chunks_exact(2) {
                    let (Some(key), Some(path)) = (kv[0].as_str(), kv[1].items()) else {
                        return Err(un!());
                    };
                    let steps = path
                        .iter()
                        .map(|s| match s {
                            V::Str(k) => Ok(PlannerStep::Key(k.to_string())),
                            V::Int(_) | V::Bool(_) => {
                                Ok(PlannerStep::Index(s.as_i64().ok_or_else(|| un!())?))
                            }
                            _ => Err(un!()),
                        })
                        .collect::<R<Vec<_>>>()?;
                    planner_data.insert(key.to_string(), steps);
                }
            }
            Some(
                V::Storage | V::Chunk(_) | V::Tensor(_) | V::Index(_) | V::Info(_) | V::Placed(_),
            ) => {
                return Err(un!());
            }
            _ => {}
        }
        let version = version.and_then(V::as_str).map(ToString::to_string);
        let (checkpoint_id, save_id) = match storage_meta {
            Some(V::Obj(sm)) => match &sm.state {
                Some(V::Dict(_, pairs)) => {
                    let [id, save] = fields(pairs, ["checkpoint_id", "save_id"])?;
                    (
                        id.map(|v| self.string_of(v)).transpose()?.flatten(),
                        save.and_then(V::as_str).map(ToString::to_string),
                    )
                }
                None => (None, None),
                Some(_) => return Err(un!()),
            },
            Some(
                V::Storage | V::Chunk(_) | V::Tensor(_) | V::Index(_) | V::Info(_) | V::Placed(_),
            ) => {
                return Err(un!());
            }
            _ => (None, None),
        };
        Ok(MetadataTable {
            items,
            planner_data,
            files: self.files.names.names,
            transforms: self.transforms.lists,
            version,
            checkpoint_id,
            save_id,
            globals: self.globals,
        })
    }

    /// A str, or `pathlib.PosixPath('/a/b')` (`REDUCE(PosixPath, ('/a/b',))` or with its parts).
    fn string_of(&self, v: &V) -> R<Option<String>> {
        match v {
            V::Str(s) => Ok(Some(s.to_string())),
            V::Obj(o) => {
                let V::Global(id) = &o.callable else {
                    return Ok(None);
                };
                if !self.globals[*id as usize].name.ends_with("Path") {
                    return Ok(None);
                }
                let Some(args) = o.args.items() else {
                    return Ok(None);
                };
                let parts: Vec<&str> = args
                    .iter()
                    .filter_map(|p| p.as_str().map(|s| &**s))
                    .collect();
                Ok(Some(super::join_path_parts(&parts)))
            }
            V::New(g) => Ok(self.globals[*g as usize]
                .name
                .ends_with("Path")
                .then(|| super::join_path_parts(&[]))),
            V::Storage
            | V::Chunk(_)
            | V::Tensor(_)
            | V::Index(_)
            | V::Info(_)
            | V::Size(_)
            | V::Placed(_) => Err(un!()),
            _ => Ok(None),
        }
    }
}

/// Reads `name` (a `.metadata` of `size` bytes) from `source` into a table, or gives up.
pub fn read_table(
    source: &dyn Source,
    name: &str,
    size: u64,
) -> Result<MetadataTable, Unrecognised> {
    read_table_by(source, name, size, WINDOW)
}

/// [`read_table`], reading `window` bytes at a time.
pub(super) fn read_table_by(
    source: &dyn Source,
    name: &str,
    size: u64,
    window: u64,
) -> Result<MetadataTable, Unrecognised> {
    // Spans of the general machine are 32-bit; the caller checked the size cap.
    if u32::try_from(size).is_err() {
        return Err(un!());
    }
    let limits = PickleLimits::for_len(size as usize);
    let mut first = Reader::new(source, name, size, window)?;
    let (fetched, only_memoize) = fetched_indexes(&mut first, &limits)?;
    let fetched = fetched.ranked();
    drop(first);
    let mut m = Machine {
        r: Reader::new(source, name, size, window)?,
        limits,
        stack: Vec::new(),
        memo: vec![None; fetched.len()],
        fetched,
        numbers: MemoNumbers::new(&limits, only_memoize),
        globals: Vec::new(),
        global_ids: FastMap::default(),
        classes: Vec::new(),
        sdm_pos: None,
        items_by_name: FastMap::default(),
        last_fqn: None,
        files: SharedNames::default(),
        transforms: TransformLists::default(),
        objects: 0,
        empty: Rc::from([]),
        chunk_keys: Keys::default(),
        index_keys: Keys::default(),
        info_keys: Keys::default(),
        fast_pairs: Vec::new(),
    };
    // Bytes after `STOP` are ignored, as by the general path.
    let root = m.run()?;
    m.table(root)
}
