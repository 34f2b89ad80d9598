//! The streaming reader's shortcut for the records torch writes once per chunk.
//!
//! A `.metadata` of a large run is almost all `ChunkStorageMetadata`, `MetadataIndex` and
//! `_StorageInfo` objects, each pickled by torch in one shape: the class fetched from the memo,
//! `EMPTY_TUPLE NEWOBJ [MEMOIZE] EMPTY_DICT [MEMOIZE] MARK (key value)* SETITEMS BUILD`, its keys
//! fetched field names and its values small ints, `None`, strings, empty lists and `torch.Size`s.
//! Running those thirty-odd opcodes one by one through the stack costs most of the reading time;
//! here they are matched straight from the window's bytes and the record is made by the same
//! [`Machine::record_of`] the opcodes would reach.
//!
//! The shortcut changes nothing when it does not apply: it only reads the window, and commits
//! (moves the reader, numbers the memo puts, pushes the record) once the whole record matched.
//! Anything else (another opcode, a record that crosses the window's end, a memo put that is
//! fetched later, a pickle that writes the memo with `PUT`, a stack near its limit) leaves the
//! opcodes to the machine, which then does what it always did.

use std::rc::Rc;

use super::super::values::{Class, V};
use super::Machine;

#[cfg(test)]
thread_local! {
    /// Tests: the shortcut is off (the opcodes make every record).
    pub(in crate::formats::dcp) static OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Tests: records the shortcut made.
    pub(in crate::formats::dcp) static MADE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// At most this many fields in a record read by the shortcut (torch's have two to four).
const MAX_PAIRS: usize = 8;

/// At most this many dims in a `torch.Size` read by the shortcut.
const MAX_DIMS: usize = 8;

/// Stack room the opcodes of one record would use at most (the shortcut leaves records to them
/// near the limit, where they give up).
const STACK_ROOM: usize = 4 * MAX_PAIRS;

/// A cursor over the window, numbering `MEMOIZE`s as the machine would.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Memo puts read so far, and how many the limit allows.
    puts: usize,
    room: usize,
}

impl Cursor<'_> {
    #[inline]
    fn u8(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.bytes.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    #[inline]
    fn expect(&mut self, op: u8) -> Option<()> {
        (self.u8()? == op).then_some(())
    }
}

impl Machine<'_> {
    /// At a memo fetch of `index` (its argument already read): when the value fetched is the
    /// class of a per-chunk record and the bytes that follow are torch's pickle of one, pushes
    /// the record that the opcodes would have made and returns true. Otherwise returns false
    /// with nothing changed, and the fetch runs as usual.
    pub(super) fn fast_record(&mut self, index: u64) -> bool {
        #[cfg(test)]
        if OFF.with(std::cell::Cell::get) {
            return false;
        }
        let Some((first_put, room)) = self.numbers.next_memoize() else {
            return false;
        };
        if self.stack.len().saturating_add(STACK_ROOM) >= self.limits.max_stack {
            return false;
        }
        let class = match usize::try_from(index)
            .ok()
            .and_then(|i| self.fetched.slot(i))
            .and_then(|slot| self.memo[slot].as_ref())
        {
            Some(V::Global(g)) => self.classes[*g as usize],
            _ => return false,
        };
        if !matches!(
            class,
            Class::ChunkMeta | Class::MetadataIndex | Class::StorageInfo
        ) {
            return false;
        }
        let mut pairs = std::mem::take(&mut self.fast_pairs);
        pairs.clear();
        let mut c = Cursor {
            bytes: self.r.rest(),
            pos: 0,
            puts: 0,
            room,
        };
        let made = self.read_state(&mut c, first_put, &mut pairs).is_some();
        let (consumed, puts) = (c.pos, c.puts);
        let record = if made {
            // An error is the machine's to meet: it runs the opcodes and gives up there.
            self.record_of(class, &pairs).ok().flatten()
        } else {
            None
        };
        pairs.clear();
        self.fast_pairs = pairs;
        let Some(record) = record else {
            return false;
        };
        self.r.advance(consumed);
        self.numbers.memoized(puts);
        // Within the limit checked above.
        self.stack.push(record);
        #[cfg(test)]
        MADE.with(|m| m.set(m.get() + 1));
        true
    }

    /// Reads `EMPTY_TUPLE NEWOBJ [MEMOIZE] EMPTY_DICT [MEMOIZE] MARK (key value)* SETITEMS BUILD`
    /// into `pairs` (keys and values in turn).
    fn read_state(&self, c: &mut Cursor<'_>, first_put: usize, pairs: &mut Vec<V>) -> Option<()> {
        c.expect(b')')?;
        c.expect(0x81)?;
        self.memoize(c, first_put)?;
        c.expect(b'}')?;
        self.memoize(c, first_put)?;
        c.expect(b'(')?;
        loop {
            match c.peek()? {
                b'u' => break,
                _ if pairs.len() >= 2 * MAX_PAIRS => return None,
                _ => {
                    let key = self.value(c, first_put)?;
                    if !matches!(key, V::Str(_)) {
                        return None;
                    }
                    let value = self.value(c, first_put)?;
                    pairs.push(key);
                    pairs.push(value);
                }
            }
        }
        c.expect(b'u')?;
        c.expect(b'b')?;
        Some(())
    }

    /// An optional `MEMOIZE`: allowed when the index it writes is never fetched (the machine then
    /// keeps nothing for it either) and within the memo's limit.
    #[inline]
    fn memoize(&self, c: &mut Cursor<'_>, first_put: usize) -> Option<()> {
        if c.peek() == Some(0x94) {
            if c.puts >= c.room || self.fetched.slot(first_put + c.puts).is_some() {
                return None;
            }
            c.pos += 1;
            c.puts += 1;
        }
        Some(())
    }

    /// A key or value: an int, `None`, a string (inline or fetched), an empty list, or a
    /// `torch.Size`; each maybe memoized.
    fn value(&self, c: &mut Cursor<'_>, first_put: usize) -> Option<V> {
        let v = match c.u8()? {
            b'K' => V::Int(i64::from(c.u8()?)),
            b'M' => {
                let b = c.take(2)?;
                V::Int(i64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            b'J' => {
                let b = c.take(4)?;
                V::Int(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            }
            b'N' => V::None,
            b']' => V::List(1, Vec::new()),
            0x8c => {
                let n = usize::from(c.u8()?);
                let s = std::str::from_utf8(c.take(n)?).ok()?;
                V::Str(Rc::from(s))
            }
            op @ (b'h' | b'j') => {
                let index = if op == b'h' {
                    u64::from(c.u8()?)
                } else {
                    let b = c.take(4)?;
                    u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                };
                let slot = self.fetched.slot(usize::try_from(index).ok()?)?;
                match self.memo[slot].as_ref()? {
                    V::Str(s) => V::Str(Rc::clone(s)),
                    V::Global(g) if self.classes[*g as usize] == Class::Size => {
                        self.size(c, first_put)?
                    }
                    _ => return None,
                }
            }
            _ => return None,
        };
        self.memoize(c, first_put)?;
        Some(v)
    }

    /// The rest of `torch.Size(dims)` after its class: the dims as a tuple of non-negative ints
    /// (`EMPTY_TUPLE`, `TUPLE1..3` or `MARK ... TUPLE`), `TUPLE1`, `REDUCE`, each maybe
    /// memoized (the last `MEMOIZE` is the caller's).
    fn size(&self, c: &mut Cursor<'_>, first_put: usize) -> Option<V> {
        let mut dims = [0u64; MAX_DIMS];
        let mut n = 0;
        let marked = c.peek() == Some(b'(');
        if marked {
            c.pos += 1;
        }
        loop {
            let d = match c.peek()? {
                b'K' => {
                    c.pos += 1;
                    u64::from(c.u8()?)
                }
                b'M' => {
                    c.pos += 1;
                    let b = c.take(2)?;
                    u64::from(u16::from_le_bytes([b[0], b[1]]))
                }
                b'J' => {
                    c.pos += 1;
                    let b = c.take(4)?;
                    u64::try_from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok()?
                }
                _ => break,
            };
            *dims.get_mut(n)? = d;
            n += 1;
        }
        let closes = match (marked, c.u8()?) {
            (true, b't') => n > 0,
            (false, b')') => n == 0,
            (false, op @ 0x85..=0x87) => n == usize::from(op - 0x84),
            _ => false,
        };
        if !closes {
            return None;
        }
        self.memoize(c, first_put)?;
        c.expect(0x85)?;
        self.memoize(c, first_put)?;
        c.expect(b'R')?;
        Some(V::Size(crate::shape::Dims::from(&dims[..n])))
    }
}
