//! Tied weights: one tensor stored under several names (GPT-2's `lm_head.weight` and
//! `transformer.wte.weight`, Llama with `tie_word_embeddings`).
//!
//! A `torch.save` file says so itself: the names are views of one storage (same storage, offset,
//! strides and shape). DCP and safetensors keep no such link: each name is written separately, so
//! a tie is recognised by identical dtype, shape and bytes. A tensor whose elements are all equal
//! (a fresh LayerNorm's ones, a zero bias, a step counter) is never taken for a tie: equal bytes
//! there say nothing about a shared parameter. Optimizer state is never tied.
//!
//! Bytes are compared cheaply first (the first bytes of every chunk) and in full only when those
//! agree, so a checkpoint without ties costs one small read per candidate.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::dtype::DType;
use crate::index::{CheckpointIndex, ChunkEncoding, EntryKind, IndexEntry, IndexError};
use crate::source::Source;

/// Entries (indices into `CheckpointIndex::entries`) holding one tensor. `keep` is the one that
/// comes first in the caller's order (pass the checkpoint's stored order, which is registration
/// order in a torch state dict); `aliases` follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TieGroup {
    pub keep: usize,
    pub aliases: Vec<usize>,
    /// `true` when the storage is shared (`torch.save`), `false` when found by equal bytes.
    pub shared_storage: bool,
}

/// How many leading bytes of each chunk the cheap comparison reads.
const PROBE_BYTES: u64 = 256;

/// Tie groups among `candidates` (indices into `index.entries`, in the order that decides which
/// name is kept; non-tensors, optimizer state and rank-local entries are skipped), in that order.
pub fn find_ties(
    index: &CheckpointIndex,
    source: &dyn Source,
    candidates: &[usize],
) -> Result<Vec<TieGroup>, IndexError> {
    let rank = ranks_of(candidates);
    let mut groups: Vec<TieGroup> = Vec::new();
    for same_meta in same_meta_groups(index, candidates) {
        let (shared, mut rest) = shared_storage_groups(index, &same_meta);
        groups.extend(shared);
        rest.sort_by_key(|i| rank[i]);
        groups.extend(equal_bytes(index, source, &rest)?);
    }
    groups.sort_by_key(|g| rank[&g.keep]);
    Ok(groups)
}

/// Tie groups among `candidates` found from shared storage alone (`torch.save` files, per-rank
/// files included: every rank's piece of the two entries is one storage), in `candidates` order.
/// Reads nothing: equal bytes are not looked at.
pub fn find_storage_ties(index: &CheckpointIndex, candidates: &[usize]) -> Vec<TieGroup> {
    let rank = ranks_of(candidates);
    let mut groups: Vec<TieGroup> = same_meta_groups(index, candidates)
        .iter()
        .flat_map(|same_meta| shared_storage_groups(index, same_meta).0)
        .collect();
    groups.sort_by_key(|g| rank[&g.keep]);
    groups
}

fn ranks_of(candidates: &[usize]) -> BTreeMap<usize, usize> {
    candidates
        .iter()
        .enumerate()
        .map(|(r, &i)| (i, r))
        .collect()
}

/// Candidates of the same dtype and shape (nothing else can be a tie), groups of two or more, each
/// in `candidates` order.
fn same_meta_groups(index: &CheckpointIndex, candidates: &[usize]) -> Vec<Vec<usize>> {
    let mut by_meta: BTreeMap<(DType, &[u64]), Vec<usize>> = BTreeMap::new();
    for &i in candidates {
        let Some(e) = index.entries.get(i) else {
            continue;
        };
        if e.kind != EntryKind::Tensor || e.role.is_some() || e.flat_param {
            continue;
        }
        let (Some(dtype), Some(shape)) = (e.dtype, e.shape.as_deref()) else {
            continue;
        };
        if e.numel().is_none_or(|n| n < 2) {
            continue;
        }
        by_meta.entry((dtype, shape)).or_default().push(i);
    }
    by_meta.into_values().filter(|v| v.len() > 1).collect()
}

/// Shared storage (torch.save): identical chunk placement in the same files. Returns the groups
/// and the members that share with none.
fn shared_storage_groups(
    index: &CheckpointIndex,
    same_meta: &[usize],
) -> (Vec<TieGroup>, Vec<usize>) {
    let mut groups = Vec::new();
    let mut rest: Vec<usize> = Vec::new();
    let mut by_place: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for &i in same_meta {
        match storage_identity(&index.entries[i]) {
            Some(id) => by_place.entry(id).or_default().push(i),
            None => rest.push(i),
        }
    }
    for members in by_place.into_values() {
        if members.len() > 1 {
            groups.push(TieGroup {
                keep: members[0],
                aliases: members[1..].to_vec(),
                shared_storage: true,
            });
        } else {
            rest.extend(members);
        }
    }
    (groups, rest)
}

/// Where a raw (`torch.save`/safetensors) entry's chunks lie; `None` for DCP items.
fn storage_identity(e: &IndexEntry) -> Option<String> {
    let mut id = String::new();
    for c in &e.chunks {
        let ChunkEncoding::Raw {
            storage_offset,
            strides,
        } = &c.encoding
        else {
            return None;
        };
        let _ = write!(
            id,
            "{}:{}:{}:{storage_offset}:{strides:?}:{:?}:{:?};",
            c.file, c.byte_offset, c.byte_length, c.offsets, c.sizes
        );
    }
    Some(id)
}

/// Groups of `members` (same dtype and shape, checkpoint order) whose bytes are equal.
fn equal_bytes(
    index: &CheckpointIndex,
    source: &dyn Source,
    members: &[usize],
) -> Result<Vec<TieGroup>, IndexError> {
    if members.len() < 2 {
        return Ok(Vec::new());
    }
    let mut by_probe: BTreeMap<Vec<u8>, Vec<usize>> = BTreeMap::new();
    for &i in members {
        by_probe
            .entry(probe(index, source, &index.entries[i])?)
            .or_default()
            .push(i);
    }
    let mut groups = Vec::new();
    for same_probe in by_probe.into_values().filter(|v| v.len() > 1) {
        // Full comparison, one tensor in memory at a time besides the group's first.
        let mut left = same_probe;
        while left.len() > 1 {
            let first = left[0];
            let bytes = index.read_tensor(source, &index.entries[first])?.bytes;
            let item = index.entries[first].dtype.map_or(1, DType::size_bytes);
            let mut tied = Vec::new();
            let mut other = Vec::new();
            if constant(&bytes, item) {
                other.extend(&left[1..]);
            } else {
                for &j in &left[1..] {
                    if index.read_tensor(source, &index.entries[j])?.bytes == bytes {
                        tied.push(j);
                    } else {
                        other.push(j);
                    }
                }
            }
            if !tied.is_empty() {
                groups.push(TieGroup {
                    keep: first,
                    aliases: tied,
                    shared_storage: false,
                });
            }
            left = other;
        }
    }
    Ok(groups)
}

/// Every element equal to the first (compared as bytes).
fn constant(bytes: &[u8], item: usize) -> bool {
    let item = item.max(1);
    bytes.len() <= item || bytes.chunks_exact(item).all(|c| c == &bytes[..item])
}

/// The first bytes of every chunk, with the chunk's place: equal for equal tensors stored alike.
fn probe(
    index: &CheckpointIndex,
    source: &dyn Source,
    e: &IndexEntry,
) -> Result<Vec<u8>, IndexError> {
    let mut out = Vec::new();
    let item = e.dtype.map_or(1, DType::size_bytes) as u64;
    for c in &e.chunks {
        if c.numel() == Some(0) {
            continue;
        }
        out.extend(format!("{:?}{:?}|", c.offsets, c.sizes).bytes());
        let location = match c.encoding {
            // A compressed item's elements have no place in the file: decode it.
            ChunkEncoding::ZstdTorchSaveItem => None,
            _ => Some(index.locate_chunk(source, e, c)?),
        };
        let range = location
            .as_ref()
            .and_then(|l| Some((l, l.contiguous_range(&c.sizes, item)?)));
        if let Some((location, (start, len))) = range {
            out.extend_from_slice(&source.read_range(
                &location.file,
                start,
                len.min(PROBE_BYTES),
            )?);
        } else {
            let data = index.read_chunk(source, e, c)?.bytes;
            out.extend_from_slice(&data[..data.len().min(PROBE_BYTES as usize)]);
        }
    }
    Ok(out)
}
