//! The streaming reader's input and first pass: the `.metadata` read window by window from the
//! source (never whole), and the memo indexes that the pickle ever fetches.

use std::borrow::Cow;

use crate::formats::pickle::PickleLimits;
use crate::source::Source;

/// The streaming reader gave up: the general path reads the file instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unrecognised;

pub(super) type R<T> = Result<T, Unrecognised>;

#[cfg(test)]
thread_local! {
    /// The line of this file where the reader last gave up (tests say why).
    pub(super) static GAVE_UP_AT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl Unrecognised {
    pub(super) fn at(line: u32) -> Self {
        #[cfg(test)]
        GAVE_UP_AT.with(|l| l.set(line));
        let _ = line;
        Unrecognised
    }
}

/// Gives up, noting where (for tests).
macro_rules! un {
    () => {
        $crate::formats::dcp::window::Unrecognised::at(line!())
    };
}
pub(super) use un;

/// Bytes read from the source at a time (a memory source lends the whole file instead).
pub(super) const WINDOW: u64 = 4 << 20;

/// The file, window by window.
pub(super) struct Reader<'s> {
    source: &'s dyn Source,
    name: &'s str,
    pub(super) size: u64,
    whole: bool,
    /// The source lends its bytes: windows are borrowed, not copied into `win`.
    lends: bool,
    window: u64,
    win: Cow<'s, [u8]>,
    /// The file offset of `win[0]`.
    win_start: u64,
    /// The position in `win`.
    pos: usize,
}

impl<'s> Reader<'s> {
    pub(super) fn new(source: &'s dyn Source, name: &'s str, size: u64, window: u64) -> R<Self> {
        let whole = source.whole_reads_are_cheap();
        let mut r = Reader {
            source,
            name,
            size,
            whole,
            lends: source.lends_ranges(),
            window: window.max(1),
            win: Cow::Borrowed(&[]),
            win_start: 0,
            pos: 0,
        };
        r.refill(0)?;
        Ok(r)
    }

    fn offset(&self) -> u64 {
        self.win_start + self.pos as u64
    }

    /// A window starting at the current position holding at least `need` bytes (fewer at the
    /// end of the file: then `take` fails).
    #[cold]
    fn refill(&mut self, need: u64) -> R<()> {
        let start = self.offset();
        let len = if self.whole {
            self.size - start
        } else {
            self.window.max(need).min(self.size - start)
        };
        if self.whole || self.lends {
            self.win = self
                .source
                .read_range(self.name, start, len)
                .map_err(|_| un!())?;
            if self.win.len() as u64 != len {
                return Err(un!());
            }
        } else {
            // One buffer moves through the file: a window is not allocated (and its pages
            // faulted in and zeroed) per refill.
            let len = usize::try_from(len).map_err(|_| un!())?;
            let mut buf = match std::mem::take(&mut self.win) {
                Cow::Owned(buf) => buf,
                Cow::Borrowed(_) => Vec::new(),
            };
            // The bytes of the old window not read yet move to the front; only what follows
            // them is read, so that the file is read once, front to back, without overlaps (a
            // browser streams it).
            let kept = buf.len().saturating_sub(self.pos).min(len);
            buf.copy_within(self.pos..self.pos + kept, 0);
            buf.resize(len, 0);
            self.source
                .read_range_into(self.name, start + kept as u64, &mut buf[kept..])
                .map_err(|_| un!())?;
            self.win = Cow::Owned(buf);
        }
        self.win_start = start;
        self.pos = 0;
        Ok(())
    }

    /// The bytes of the window from the current position on.
    #[inline]
    pub(super) fn rest(&self) -> &[u8] {
        &self.win[self.pos..]
    }

    /// Moves past `n` bytes of [`Reader::rest`].
    #[inline]
    pub(super) fn advance(&mut self, n: usize) {
        debug_assert!(n <= self.win.len() - self.pos);
        self.pos += n;
    }

    #[inline]
    pub(super) fn u8(&mut self) -> R<u8> {
        if let Some(&b) = self.win.get(self.pos) {
            self.pos += 1;
            return Ok(b);
        }
        self.refill(1)?;
        let b = *self.win.get(self.pos).ok_or_else(|| un!())?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    pub(super) fn take(&mut self, n: u64) -> R<&[u8]> {
        if n > self.size - self.offset() {
            return Err(un!());
        }
        // `n` fits in what is left of the file, which fits in memory's address space when read.
        let n = usize::try_from(n).map_err(|_| un!())?;
        if self.win.len() - self.pos < n {
            self.refill(n as u64)?;
        }
        let s = &self.win[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    pub(super) fn uint<const N: usize>(&mut self) -> R<u64> {
        if let Some(b) = self
            .win
            .get(self.pos..)
            .and_then(|rest| rest.first_chunk::<N>())
        {
            self.pos += N;
            return Ok(b
                .iter()
                .rev()
                .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)));
        }
        let b = self.take(N as u64)?;
        Ok(b.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    pub(super) fn line(&mut self) -> R<String> {
        let mut out = Vec::new();
        loop {
            let b = self.u8()?;
            if b == b'\n' {
                break;
            }
            if out.len() >= 1 << 16 {
                return Err(un!());
            }
            out.push(b);
        }
        String::from_utf8(out).map_err(|_| un!())
    }
}

/// A set of memo indexes, as bits.
#[derive(Default)]
pub(super) struct Bits(Vec<u64>);

impl Bits {
    fn set(&mut self, i: usize) -> bool {
        let (w, b) = (i / 64, i % 64);
        if w >= self.0.len() {
            self.0.resize(w + 1, 0);
        }
        let was = self.0[w] & (1 << b) != 0;
        self.0[w] |= 1 << b;
        was
    }

    /// Numbers the set bits densely from 0, in order.
    pub(super) fn ranked(self) -> Ranked {
        let mut before = Vec::with_capacity(self.0.len());
        let mut n = 0u32;
        for w in &self.0 {
            before.push(n);
            n += w.count_ones();
        }
        Ranked {
            bits: self.0,
            before,
            len: n as usize,
        }
    }
}

/// Set bits numbered densely: the fetched memo indexes as slots of a small memo.
pub(super) struct Ranked {
    bits: Vec<u64>,
    /// Set bits in the words before each word.
    before: Vec<u32>,
    len: usize,
}

impl Ranked {
    /// How many bits are set.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The dense number of bit `i`, when it is set.
    #[inline]
    pub(super) fn slot(&self, i: usize) -> Option<usize> {
        let (w, b) = (i / 64, i % 64);
        let word = *self.bits.get(w)?;
        if word & (1 << b) == 0 {
            return None;
        }
        let below = word & ((1u64 << b) - 1);
        Some(self.before[w] as usize + below.count_ones() as usize)
    }
}

/// The memo indexes a pickle writes to, numbered as the machine numbers them (`MEMOIZE` takes the
/// count of distinct indexes written so far).
pub(super) struct MemoNumbers {
    filled: Bits,
    count: usize,
    max: usize,
    /// The pickle writes only with `MEMOIZE` (protocol 4 and 5, as torch writes `.metadata`): each
    /// put takes the next index, and no set of written indexes is needed.
    only_memoize: bool,
}

impl MemoNumbers {
    pub(super) fn new(limits: &PickleLimits, only_memoize: bool) -> Self {
        MemoNumbers {
            filled: Bits::default(),
            count: 0,
            max: limits.max_memo,
            only_memoize,
        }
    }

    /// The index the next `MEMOIZE` writes, and how many it may write after it, when the pickle
    /// writes only with `MEMOIZE`.
    #[inline]
    pub(super) fn next_memoize(&self) -> Option<(usize, usize)> {
        self.only_memoize
            .then(|| (self.count, self.max.saturating_sub(self.count)))
    }

    /// Takes the next `n` `MEMOIZE` indexes (within the room [`MemoNumbers::next_memoize`] gave).
    #[inline]
    pub(super) fn memoized(&mut self, n: usize) {
        debug_assert!(self.only_memoize && self.count + n <= self.max);
        self.count += n;
    }

    /// The index a put writes (`None` for `MEMOIZE`), or an error where the machine would fail.
    #[inline]
    pub(super) fn put(&mut self, index: Option<u64>) -> R<usize> {
        if self.only_memoize {
            if index.is_some() {
                // The first pass saw no `PUT`: the passes disagree, which they never should.
                return Err(un!());
            }
            let i = self.count;
            if i >= self.max {
                return Err(un!());
            }
            self.count += 1;
            return Ok(i);
        }
        let i = match index {
            None => self.count as u64,
            Some(i) => i,
        };
        let i = usize::try_from(i)
            .ok()
            .filter(|&i| i < self.max)
            .ok_or_else(|| un!())?;
        if !self.filled.set(i) {
            self.count += 1;
        }
        Ok(i)
    }
}

/// What an opcode does to the memo, for the first pass.
enum MemoOp {
    Put(Option<u64>),
    Get(u64),
    None,
}

/// Skips one opcode's argument and says what it does to the memo; `None` at `STOP`.
fn skip_op(r: &mut Reader<'_>, op: u8) -> R<Option<MemoOp>> {
    let n: u64 = match op {
        b'.' => return Ok(None),
        0x80 | b'K' => 1,
        b'q' => return Ok(Some(MemoOp::Put(Some(u64::from(r.u8()?))))),
        b'h' => return Ok(Some(MemoOp::Get(u64::from(r.u8()?)))),
        b'M' => 2,
        b'J' => 4,
        0x95 | b'G' => 8,
        0x94 => return Ok(Some(MemoOp::Put(None))),
        b'r' => return Ok(Some(MemoOp::Put(Some(r.uint::<4>()?)))),
        b'j' => return Ok(Some(MemoOp::Get(r.uint::<4>()?))),
        b'p' | b'g' => {
            let line = r.line()?;
            let i = line.parse::<u64>().map_err(|_| un!())?;
            return Ok(Some(if op == b'p' {
                MemoOp::Put(Some(i))
            } else {
                MemoOp::Get(i)
            }));
        }
        0x8a | 0x8c | b'U' | b'C' => u64::from(r.u8()?),
        0x8b | b'X' | b'T' | b'B' => r.uint::<4>()?,
        0x8d | 0x8e | 0x96 => r.uint::<8>()?,
        b'I' | b'L' | b'F' | b'P' => {
            r.line()?;
            0
        }
        b'c' => {
            r.line()?;
            r.line()?;
            0
        }
        b'('
        | b'0'
        | b'1'
        | b'2'
        | b'N'
        | 0x88
        | 0x89
        | b')'
        | 0x85..=0x87
        | b't'
        | b']'
        | b'l'
        | b'a'
        | b'e'
        | 0x90
        | b'}'
        | b'd'
        | b's'
        | b'u'
        | 0x8f
        | 0x91
        | 0x93
        | b'R'
        | 0x81
        | 0x92
        | b'b'
        | b'Q' => 0,
        _ => return Err(un!()),
    };
    r.take(n)?;
    Ok(Some(MemoOp::None))
}

/// The first pass: the memo indexes that are ever fetched, and whether the pickle writes to the
/// memo only with `MEMOIZE` (no `PUT` names an index). Puts are checked by the second pass.
pub(super) fn fetched_indexes(r: &mut Reader<'_>, limits: &PickleLimits) -> R<(Bits, bool)> {
    let mut only_memoize = true;
    let mut fetched = Bits::default();
    let fetch = |fetched: &mut Bits, i: usize| -> R<()> {
        if i >= limits.max_memo {
            return Err(un!());
        }
        fetched.set(i);
        Ok(())
    };
    loop {
        // The opcodes of a large `.metadata` (about 50 a chunk) with their whole argument inside
        // the window, without a bounds check each: the hot loop of this pass.
        let win: &[u8] = &r.win;
        let mut pos = r.pos;
        while pos + 9 <= win.len() {
            match win[pos] {
                0x94 => pos += 1,
                b'h' => {
                    fetch(&mut fetched, usize::from(win[pos + 1]))?;
                    pos += 2;
                }
                b'j' => {
                    let b = [win[pos + 1], win[pos + 2], win[pos + 3], win[pos + 4]];
                    fetch(&mut fetched, u32::from_le_bytes(b) as usize)?;
                    pos += 5;
                }
                0x8c => {
                    let end = pos + 2 + usize::from(win[pos + 1]);
                    if end > win.len() {
                        break;
                    }
                    pos = end;
                }
                b'K' => pos += 2,
                b'M' => pos += 3,
                b'J' => pos += 5,
                b'('
                | b')'
                | b'}'
                | b']'
                | b'u'
                | b'b'
                | b'e'
                | b'a'
                | b'R'
                | b'N'
                | b't'
                | b's'
                | b'0'
                | b'1'
                | b'2'
                | b'd'
                | b'l'
                | b'Q'
                | 0x81
                | 0x85..=0x89
                | 0x8f..=0x93 => {
                    pos += 1;
                }
                _ => break,
            }
        }
        r.pos = pos;
        let op = r.u8()?;
        match skip_op(r, op)? {
            None => return Ok((fetched, only_memoize)),
            Some(MemoOp::Put(i)) => {
                only_memoize &= i.is_none();
            }
            Some(MemoOp::Get(i)) => {
                fetch(&mut fetched, usize::try_from(i).map_err(|_| un!())?)?;
            }
            Some(MemoOp::None) => {}
        }
    }
}
