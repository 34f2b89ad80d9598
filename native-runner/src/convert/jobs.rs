//! A conversion's reads as executor jobs: tensors cut into [`PIECE_BYTES`] pieces where they can be
//! read by byte range, and the memory limit checked for every job before anything is written.

use anyhow::Result;
use shardscope_core::DType;
use shardscope_core::index::IndexEntry;

use super::exec;
use super::reader::Reader;
use super::select::Selection;

/// Tensors that can be read in place by byte range are read in pieces of at most this many bytes,
/// so reads of one large tensor overlap its writing and memory stays far below the tensor's size.
pub const PIECE_BYTES: u64 = 16 << 20;

/// Appends the reads of `entry` (cast to `to`, `n` bytes): pieces of at most [`PIECE_BYTES`] when
/// it can be read in place by byte range, else the whole tensor in one.
pub(super) fn push_piece_jobs<'a>(
    reader: &Reader<'_>,
    entry: &'a IndexEntry,
    to: DType,
    n: u64,
    jobs: &mut Vec<exec::Job<'a>>,
) {
    if n > PIECE_BYTES && reader.slab_pieces(entry, to).is_some() {
        let mut start = 0;
        while start < n {
            let end = start.saturating_add(PIECE_BYTES).min(n);
            jobs.push(exec::Job {
                entry,
                to,
                range: Some(start..end),
            });
            start = end;
        }
    } else {
        jobs.push(exec::Job {
            entry,
            to,
            range: None,
        });
    }
}

/// Checks the memory limit for every job of the conversion at once (a too-small limit fails
/// before anything is written) and returns the options with the limit fixed.
pub(super) fn fix_limit(
    reader: &Reader<'_>,
    jobs: &[exec::Job<'_>],
    options: &exec::ExecOptions,
) -> Result<(exec::ExecOptions, u64)> {
    let stats = exec::memory_limit(reader, jobs, options)?;
    Ok((
        exec::ExecOptions {
            threads: options.threads,
            memory_limit_bytes: Some(stats.memory_limit_bytes),
        },
        stats.memory_limit_bytes,
    ))
}

pub(super) fn largest(sel: &Selection<'_>) -> u64 {
    sel.tensors
        .iter()
        .filter_map(|(_, e)| sel.out_nbytes(e))
        .max()
        .unwrap_or(0)
}
