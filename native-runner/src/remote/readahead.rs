//! Small reads that walk a file forward are served from one read-ahead block per file, so a
//! reader going through many small adjacent items makes few requests.

use std::ops::Range;

use bytes::Bytes;
use shardscope_core::source::{Source, SourceError, checked_range};

use super::source::RemoteSource;

/// A small read that moves forward near where the last read of its file ended (the reader is
/// walking the file) fetches this much, and the reads that follow are served from it.
pub(super) const READAHEAD_BYTES: u64 = 1 << 20;
/// How far from where the last read ended a forward read still counts as walking the file.
const SEQUENTIAL_GAP_BYTES: u64 = 64 << 10;
/// Files with a read-ahead block at most (one block per file; all dropped when a new file would
/// exceed this).
const MAX_BLOCKS: usize = 16;

/// The bytes to fetch for a read of `offset..offset + len` of a `size`-byte file: the range itself,
/// or a read-ahead block when the read is small and starts where the previous one ended.
fn fetch_range(offset: u64, len: u64, size: u64, sequential: bool) -> Range<u64> {
    let end = offset.saturating_add(len).min(size);
    if sequential && len < READAHEAD_BYTES {
        offset..offset.saturating_add(READAHEAD_BYTES).min(size).max(end)
    } else {
        offset..end
    }
}

/// What was read of one file: where the last read started and ended, and the read-ahead block
/// (empty when the last fetch was exact).
#[derive(Debug, Clone, Default)]
pub(super) struct Block {
    last_start: u64,
    last_end: u64,
    start: u64,
    data: Bytes,
}

impl Block {
    /// A read at `offset` continues a walk through the file: it moves forward from the last read
    /// and starts within [`SEQUENTIAL_GAP_BYTES`] of where the last read ended. The first
    /// read of a file and a re-read from the same start (a header read twice) never do.
    fn is_sequential(&self, offset: u64) -> bool {
        offset > self.last_start
            && offset <= self.last_end.saturating_add(SEQUENTIAL_GAP_BYTES)
            && offset.saturating_add(SEQUENTIAL_GAP_BYTES) >= self.last_end
    }
}

impl RemoteSource {
    /// Reads `offset..offset + out.len()` of `name` into `out`: small reads through the
    /// read-ahead block, large ones straight into `out` ([`Source::read_range`] reads here too).
    pub fn read_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let len = out.len() as u64;
        let size = self.size(name)?;
        let (start, end) = checked_range(name, offset, len, size)?;
        let file = self.file(name)?;
        if let Some(bytes) = &file.bytes {
            out.copy_from_slice(&bytes[start..end]);
            return Ok(());
        }
        if len == 0 {
            return Ok(());
        }
        let end_offset = offset + len; // checked above
        let poisoned = || SourceError::Io {
            name: self.url_of(name),
            message: "a reader thread panicked".into(),
        };
        // Served from the read-ahead block: whole, or its front part (then the rest is fetched).
        let (done, sequential) = {
            let mut blocks = self.blocks.lock().map_err(|_| poisoned())?;
            if let Some(b) = blocks.get_mut(name) {
                let b_end = b.start.saturating_add(b.data.len() as u64);
                if offset >= b.start && offset < b_end {
                    let from = usize::try_from(offset - b.start).unwrap_or(usize::MAX);
                    let to = usize::try_from(end_offset.min(b_end) - b.start).unwrap_or(usize::MAX);
                    let n = to.saturating_sub(from);
                    if let (Some(src), Some(dst)) = (b.data.get(from..to), out.get_mut(..n)) {
                        dst.copy_from_slice(src);
                        b.last_start = offset;
                        b.last_end = end_offset;
                        if end_offset <= b_end {
                            return Ok(());
                        }
                        // The rest exactly: the block stays for reads that come back to it.
                        (n, false)
                    } else {
                        (0, b.is_sequential(offset))
                    }
                } else {
                    (0, b.is_sequential(offset))
                }
            } else {
                (0, false)
            }
        };
        let rest_offset = offset + done as u64; // done <= len
        let rest = out.get_mut(done..).ok_or_else(poisoned)?;
        let range = fetch_range(rest_offset, rest.len() as u64, size, sequential);
        let block = if range.end > end_offset {
            let too_big = || SourceError::Io {
                name: self.url_of(name),
                message: "the read-ahead block does not fit in memory".into(),
            };
            let block_len = usize::try_from(range.end - range.start).map_err(|_| too_big())?;
            let mut block = vec![0u8; block_len];
            self.fetch_into(name, range.clone(), &mut block)?;
            rest.copy_from_slice(block.get(..rest.len()).ok_or_else(too_big)?);
            Some(Bytes::from(block))
        } else {
            self.fetch_into(name, range.clone(), rest)?;
            None
        };
        let mut blocks = self.blocks.lock().map_err(|_| poisoned())?;
        if blocks.len() >= MAX_BLOCKS && !blocks.contains_key(name) {
            blocks.clear();
        }
        let b = blocks.entry(name.to_owned()).or_default();
        b.last_start = offset;
        b.last_end = end_offset;
        // An exact fetch keeps the block: a reader may still come back to it (zip ends, then data).
        if let Some(block) = block {
            b.start = range.start;
            b.data = block;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_walking_forward_are_sequential() {
        let mut b = Block::default();
        assert!(!b.is_sequential(0), "the first read of a file");
        b.last_start = 100;
        b.last_end = 200;
        assert!(!b.is_sequential(100), "a re-read from the same start");
        assert!(!b.is_sequential(50), "backwards");
        assert!(b.is_sequential(150) && b.is_sequential(200));
        assert!(b.is_sequential(200 + SEQUENTIAL_GAP_BYTES));
        assert!(!b.is_sequential(201 + SEQUENTIAL_GAP_BYTES), "a jump");
        b.last_end = 10 * SEQUENTIAL_GAP_BYTES;
        assert!(
            !b.is_sequential(150),
            "far behind where the last read ended"
        );
        b.last_end = u64::MAX;
        assert!(b.is_sequential(u64::MAX));
    }

    #[test]
    fn small_sequential_reads_fetch_a_readahead_block() {
        // Not sequential: exactly what was asked.
        assert_eq!(fetch_range(100, 4, 1 << 30, false), 100..104);
        // Sequential and small: one block serves the reads that follow.
        assert_eq!(
            fetch_range(100, 4, 1 << 30, true),
            100..100 + READAHEAD_BYTES
        );
        // Clipped at the end of the file.
        assert_eq!(fetch_range(100, 4, 1000, true), 100..1000);
        // Large reads are never extended.
        assert_eq!(
            fetch_range(0, READAHEAD_BYTES, 1 << 30, true),
            0..READAHEAD_BYTES
        );
        // No overflow near u64::MAX.
        assert_eq!(
            fetch_range(u64::MAX - 1, 1, u64::MAX, true),
            u64::MAX - 1..u64::MAX
        );
    }
}
