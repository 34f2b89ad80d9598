//! Copying ahead for the thread that reads a segment.
//!
//! A segment's digests take its pieces in order, so one thread feeds them; but the copy of a piece
//! out of the page cache is most of the work, and it needs no order. A thread with no segment
//! ready to start (one file left, or the other files' next chunks waiting for this one) copies
//! pieces of a running segment into slots; the segment's thread feeds the digests from the slot
//! when it reaches that piece, and copies itself any piece nobody took. Pieces are claimed from
//! one counter, so each is copied once; the copier holds its slot while it reads, and the owner
//! takes a full slot only. While the piece it needs is still being copied, the owner copies the
//! next unclaimed one into a free slot (the digests take less time than the copy, so it would
//! otherwise wait at every piece); it waits only when every slot is full or every piece claimed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use shardscope_core::source::Source;

use super::PIECE_BYTES;
use crate::input::Input;

/// The pieces of bytes `start..end` of a file: those before `region`, then those after, each at
/// most [`PIECE_BYTES`] and none across `region`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pieces {
    pub start: u64,
    pub region: u64,
    pub end: u64,
}

impl Pieces {
    fn before(&self) -> usize {
        count(self.region.saturating_sub(self.start))
    }

    pub fn count(&self) -> usize {
        self.before()
            .saturating_add(count(self.end.saturating_sub(self.region.max(self.start))))
    }

    /// The file bytes of piece `i` (`i < count()`).
    pub fn range(&self, i: usize) -> (u64, u64) {
        let piece = PIECE_BYTES as u64;
        let g = self.before();
        let (from, to, j) = if i < g {
            (self.start, self.region, i)
        } else {
            (self.region.max(self.start), self.end, i - g)
        };
        let a = from
            .saturating_add((j as u64).saturating_mul(piece))
            .min(to);
        (a, to.min(a.saturating_add(piece)))
    }
}

fn count(bytes: u64) -> usize {
    usize::try_from(bytes.div_ceil(PIECE_BYTES as u64)).unwrap_or(usize::MAX)
}

struct Slot {
    /// The piece held, once copied (`usize::MAX`: free).
    piece: usize,
    /// Its bytes: `buf[..len]`.
    buf: Vec<u8>,
    len: usize,
    error: Option<String>,
}

/// Piece buffers of finished segments, for the slots of the next ones: a buffer is allocated and
/// cleared once per run, not once per segment.
pub(super) type Spare = Arc<Mutex<Vec<Vec<u8>>>>;

/// One running segment's pieces, shared by its thread and any copying ahead.
pub(super) struct Assist {
    pub pieces: Pieces,
    file: String,
    /// The next piece nobody has claimed.
    next: AtomicUsize,
    slots: Vec<Mutex<Slot>>,
    spare: Spare,
}

/// A piece the owner reads itself, or one copied for it (the slot is freed when dropped).
pub(super) enum Piece<'a> {
    Own,
    Copied(Taken<'a>),
}

pub(super) struct Taken<'a>(MutexGuard<'a, Slot>);

impl Taken<'_> {
    /// The piece's bytes, or why they could not be read.
    pub fn bytes(&self) -> Result<&[u8], &str> {
        match &self.0.error {
            Some(e) => Err(e),
            None => Ok(&self.0.buf[..self.0.len]),
        }
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.0.piece = usize::MAX;
        self.0.error = None;
    }
}

/// What a copier found.
pub(super) enum Help {
    Copied,
    /// Every slot is full: the owner is behind.
    Full,
    /// Every piece is claimed.
    Done,
}

fn lock(slot: &Mutex<Slot>) -> Option<MutexGuard<'_, Slot>> {
    match slot.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl Assist {
    pub fn new(pieces: Pieces, file: &str, slots: usize, spare: &Spare) -> Assist {
        Assist {
            pieces,
            file: file.to_owned(),
            next: AtomicUsize::new(0),
            slots: (0..slots.max(1))
                .map(|_| {
                    Mutex::new(Slot {
                        piece: usize::MAX,
                        buf: Vec::new(),
                        len: 0,
                        error: None,
                    })
                })
                .collect(),
            spare: Arc::clone(spare),
        }
    }

    /// No piece is claimed from now on (copiers stop).
    pub fn close(&self) {
        self.next.fetch_max(self.pieces.count(), Ordering::AcqRel);
    }

    /// Pieces not claimed yet.
    pub fn unclaimed(&self) -> usize {
        self.pieces
            .count()
            .saturating_sub(self.next.load(Ordering::Acquire))
    }

    /// For the owner, who has fed pieces `..i`: piece `i`, claimed now by the owner, or taken
    /// from the copier who claimed it. While it is being copied, the owner copies the next
    /// unclaimed piece into a free slot itself (it would only wait otherwise: the digests are
    /// faster than the copy, so the owner catches up with its copier and would wait at every
    /// piece).
    pub fn take(&self, i: usize, source: &Input) -> Piece<'_> {
        let mut spins = 0u32;
        loop {
            match self
                .next
                .compare_exchange(i, i + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Piece::Own,
                Err(claimed) if claimed < i => {
                    // Cannot happen: the owner claims or takes every piece before `i` first.
                    return Piece::Own;
                }
                Err(_) => {}
            }
            for slot in &self.slots {
                if let Some(g) = lock(slot)
                    && g.piece == i
                {
                    return Piece::Copied(Taken(g));
                }
            }
            if let Help::Copied = self.help(source) {
                spins = 0;
                continue;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// For a thread with nothing else to do: copies the next unclaimed piece into a free slot.
    pub fn help(&self, source: &Input) -> Help {
        let total = self.pieces.count();
        if self.next.load(Ordering::Acquire) >= total {
            return Help::Done;
        }
        for slot in &self.slots {
            let Some(mut held) = lock(slot) else { continue };
            if held.piece != usize::MAX {
                continue;
            }
            let claimed = self.next.fetch_add(1, Ordering::AcqRel);
            if claimed >= total {
                return Help::Done;
            }
            let (from, to) = self.pieces.range(claimed);
            let len = usize::try_from(to - from).unwrap_or(PIECE_BYTES);
            if held.buf.len() < len {
                let spare = self
                    .spare
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .pop();
                held.buf = spare.unwrap_or_default();
                if held.buf.len() < len {
                    held.buf.resize(len, 0);
                }
            }
            held.len = len;
            let file = &self.file;
            held.error = source
                .read_range_into(file, from, &mut held.buf[..len])
                .err()
                .map(|e| format!("{file}: bytes {from}..{to}: {e}"));
            held.piece = claimed;
            return Help::Copied;
        }
        Help::Full
    }
}

impl Drop for Assist {
    fn drop(&mut self) {
        let mut spare = self
            .spare
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for slot in self.slots.drain(..) {
            let buf = slot
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .buf;
            if !buf.is_empty() {
                spare.push(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{PIECE_BYTES, Pieces};

    #[test]
    fn pieces_tile_the_bytes_and_never_cross_the_region() {
        let p = PIECE_BYTES as u64;
        for (start, region, end) in [
            (0, 0, 0),
            (0, 0, 3 * p),
            (5, 5 + p + 1, 5 + p + 1 + 2 * p + 7),
            (0, 10, 10),
            (7, 3 * p, 3 * p + 1),
        ] {
            let pieces = Pieces { start, region, end };
            let mut at = start;
            for i in 0..pieces.count() {
                let (a, b) = pieces.range(i);
                assert_eq!(a, at, "{pieces:?} piece {i}");
                assert!(b > a && b - a <= p);
                assert!(!(a < region && b > region), "{pieces:?} piece {i} crosses");
                at = b;
            }
            assert_eq!(at, end, "{pieces:?}");
        }
    }
}
