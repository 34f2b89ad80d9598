//! Pass 1: the machine that runs the opcodes into the node arena.

use super::arena::{
    Arena, Items, Node, ObjItems, ObjNode, SeqKind, Span, V, Val, extend_items, index_u32,
};
use super::limits::{PickleError, PickleLimits};
use super::value::Global;

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
        Node::Object(o) => arena.objects[*o as usize]
            .items_mut()
            .list_items
            .extend(items),
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
        Node::Object(o) => arena.objects[*o as usize]
            .items_mut()
            .dict_items
            .extend(pairs),
        _ => {
            return Err(PickleError::WrongType {
                offset: at,
                what: "SETITEM(S) on a value that is not a dict or object".into(),
            });
        }
    }
    Ok(())
}

pub(super) struct Machine<'a> {
    pub(super) data: &'a [u8],
    pub(super) pos: usize,
    pub(super) limits: PickleLimits,
    pub(super) arena: Arena,
    pub(super) stack: Vec<Val>,
    /// Memo slots by index (torch and Python number them densely from 0).
    /// [`Val::MISSING`] where nothing was put.
    pub(super) memo: Vec<Val>,
    pub(super) memo_len: usize,
    /// The one `()` node: tuples never change, and `NEWOBJ` takes `()` for every object.
    pub(super) empty_tuple: Option<Val>,
}

/// A capacity to reserve for a pool filled from a pickle of `len` bytes: about as many entries as
/// the densest real pickles give (`per` input bytes per entry), capped so that a huge input
/// reserves no more than 4 Mi entries up front (beyond that, the pool grows as it fills).
fn reserve(len: usize, per: usize) -> usize {
    (len / per).min(1 << 22)
}

impl<'a> Machine<'a> {
    pub(super) fn new(data: &'a [u8], limits: PickleLimits) -> Self {
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
    pub(super) fn u8(&mut self) -> Result<u8, PickleError> {
        match self.data.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(self.truncated(1)),
        }
    }

    #[cold]
    pub(super) fn truncated(&self, n: u64) -> PickleError {
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
    pub(super) fn push(&mut self, v: Val) -> Result<(), PickleError> {
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
    pub(super) fn mark(&self, at: usize) -> Result<usize, PickleError> {
        self.stack
            .iter()
            .rposition(|&s| s == Val::MARK)
            .ok_or(PickleError::NoMark { offset: at })
    }

    /// A tuple of the values above the topmost mark (`TUPLE`), or of the top `n` values
    /// (`TUPLE1..3`), popped straight into the shared pool.
    pub(super) fn tuple(
        &mut self,
        n: Option<usize>,
        op: u8,
        at: usize,
    ) -> Result<Val, PickleError> {
        // `TUPLE1..3` over plain values (the usual case): straight from the stack's top.
        if let Some(n @ 1..=3) = n
            && let Some(first) = self.stack.len().checked_sub(n)
            && !self.stack[first..].contains(&Val::MARK)
        {
            let start = self.arena.vals.len();
            self.arena.vals.extend_from_slice(&self.stack[first..]);
            self.stack.truncate(first);
            return self.alloc(Node::Tuple(Span::new(start, n)));
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
        if span.len() == 0 {
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

    pub(super) fn string(&mut self, n: u64) -> Result<Val, PickleError> {
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
        self.alloc(Node::Str(Span::new(start, s.len())))
    }

    fn blob_span(&mut self, b: &[u8]) -> Span {
        let start = self.arena.blob.len();
        self.arena.blob.extend_from_slice(b);
        Span::new(start, b.len())
    }

    pub(super) fn bytes(&mut self, n: u64) -> Result<Val, PickleError> {
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
    pub(super) fn container(target: Val, at: usize) -> Result<usize, PickleError> {
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

    pub(super) fn object(
        &mut self,
        callable: Val,
        args: Val,
        kwargs: Option<Val>,
    ) -> Result<Val, PickleError> {
        let v = self.alloc(Node::Object(index_u32(self.arena.objects.len())))?;
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

    /// Runs the pickle to `STOP`: the arena and the root value.
    pub(super) fn run(mut self) -> Result<(Arena, Val), PickleError> {
        let root = self.run_ops()?;
        Ok((self.arena, root))
    }

    /// Runs the pickle as far as it goes: every global named before `STOP` or the first error
    /// (in first-seen order, once each), and that error. For safety scans: an unpickler that
    /// runs code has imported (and may have called) what comes before a later error.
    pub(super) fn globals_until_error(mut self) -> (Vec<Global>, Option<PickleError>) {
        let err = self.run_ops().err();
        let mut out: Vec<Global> = Vec::new();
        for node in &self.arena.nodes {
            if let Node::Global(g) = node
                && !out.contains(g)
            {
                out.push((**g).clone());
            }
        }
        (out, err)
    }

    #[allow(
        clippy::too_many_lines,
        reason = "the pickle machine's opcode dispatch: one match arm per opcode, sharing the stack and memo"
    )]
    fn run_ops(&mut self) -> Result<Val, PickleError> {
        // Spans of the pools are 32-bit (see [`Span::new`]).
        if u32::try_from(self.data.len()).is_err() {
            return Err(PickleError::Limit {
                what: "bytes of one pickle",
                limit: u32::MAX as usize,
            });
        }
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
                    return Ok(v);
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
                        Node::Object(o) => self.arena.objects[*o as usize].state = state,
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

    pub(super) fn str_of(&self, v: Val) -> Option<String> {
        self.arena.str_of(v).map(str::to_owned)
    }

    /// An integer value: inline when it fits, else a node.
    #[inline]
    pub(super) fn int(&mut self, i: i64) -> Result<Val, PickleError> {
        match Val::small_int(i) {
            Some(v) => Ok(v),
            None => self.alloc(Node::Int(i)),
        }
    }

    const EMPTY: Items = Items::Pooled(Span::EMPTY);

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
        Span::new(start, self.arena.vals.len() - start)
    }
}
