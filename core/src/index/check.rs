//! [`CheckpointIndex::check`]: the checkpoint against its own promises.

use crate::formats::pickle::{StorageRef, TensorRef};
use crate::index::types::GAP_NOTE;
use crate::index::{CheckpointIndex, Chunk, ChunkEncoding, FastMap, IndexEntry, Problem};

impl CheckpointIndex {
    /// Checks the index against itself and the file sizes: chunks of each tensor tile it exactly
    /// (no gap, no overlap except identical replicas on different ranks, inside bounds), byte
    /// ranges lie inside their files, and byte lengths fit dtype and sizes.
    pub fn check(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        // One hashed lookup per chunk (a large DCP has 100 000 chunks over a few hundred files).
        let sizes: FastMap<&str, u64> = self
            .files
            .iter()
            .map(|(name, f)| (name.as_str(), f.size))
            .collect();
        // The chunks of one file share its name: looked up once per name, then by address.
        let mut by_address: FastMap<usize, Option<u64>> = FastMap::default();
        for e in &self.entries {
            for c in &e.chunks {
                let end = c.byte_offset.checked_add(c.byte_length);
                let size = *by_address
                    .entry(c.file.as_ptr() as usize)
                    .or_insert_with(|| sizes.get(c.file.as_ref()).copied());
                match (end, size) {
                    (Some(end), Some(size)) if end <= size => {}
                    _ => problems.push(Problem {
                        key: e.key.clone(),
                        file: Some(c.file.to_string()),
                        byte_range: Some((
                            c.byte_offset,
                            c.byte_offset.saturating_add(c.byte_length),
                        )),
                        what: format!(
                            "byte range lies outside the file ({} bytes)",
                            size.unwrap_or(0)
                        ),
                    }),
                }
                if let (Some(dtype), Some(numel)) = (e.dtype, c.numel()) {
                    let item = dtype.size_bytes() as u64;
                    let needed = match &c.encoding {
                        ChunkEncoding::Raw {
                            storage_offset,
                            strides,
                        } => {
                            let view = TensorRef {
                                storage: StorageRef {
                                    key: String::new(),
                                    dtype,
                                    location: String::new(),
                                    numel: 0,
                                },
                                storage_offset: *storage_offset,
                                shape: c.sizes.to_vec(),
                                stride: strides.clone(),
                                requires_grad: false,
                                wrapper: None,
                            };
                            if strides.len() == c.sizes.len() {
                                view.storage_extent().and_then(|x| x.checked_mul(item))
                            } else {
                                None
                            }
                        }
                        ChunkEncoding::TorchSaveItem | ChunkEncoding::ZstdTorchSaveItem => {
                            numel.checked_mul(item)
                        }
                    };
                    if needed.is_none_or(|n| n > c.max_decoded_bytes()) {
                        problems.push(Problem {
                            key: e.key.clone(),
                            file: Some(c.file.to_string()),
                            byte_range: Some((
                                c.byte_offset,
                                c.byte_offset.saturating_add(c.byte_length),
                            )),
                            what: format!(
                                "{} bytes cannot hold a {:?} chunk of {dtype}",
                                c.byte_length, c.sizes
                            ),
                        });
                    }
                }
            }
            if let Some(shape) = &e.shape {
                check_tiling(e, shape, &mut problems);
            }
        }
        problems
    }
}

/// A chunk's `(offsets, sizes)`.
type ChunkBox<'a> = (&'a [u64], &'a [u64]);

#[allow(
    clippy::too_many_lines,
    reason = "the tiling check's steps (bounds, distinct boxes, replicas, overlap sweep, coverage) share the sorted boxes"
)]
pub(crate) fn check_tiling(e: &IndexEntry, shape: &[u64], problems: &mut Vec<Problem>) {
    let problem = |c: Option<&Chunk>, what: String| Problem {
        key: e.key.clone(),
        file: c.map(|c| c.file.to_string()),
        byte_range: c.map(|c| (c.byte_offset, c.byte_offset.saturating_add(c.byte_length))),
        what,
    };
    let Some(total) = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)) else {
        problems.push(problem(None, format!("shape {shape:?} overflows")));
        return;
    };
    // Distinct boxes; identical boxes on different ranks are replicas.
    let mut boxes: Vec<&Chunk> = Vec::with_capacity(e.chunks.len());
    // The ranks each box was seen on: almost always one, so no set is allocated for it.
    let mut seen: FastMap<ChunkBox<'_>, (Option<u32>, Vec<Option<u32>>)> =
        FastMap::with_capacity_and_hasher(e.chunks.len(), foldhash::fast::RandomState::default());
    for c in &e.chunks {
        if c.offsets.len() != shape.len() || c.sizes.len() != shape.len() {
            problems.push(problem(
                Some(c),
                format!(
                    "chunk offsets {:?} / sizes {:?} do not match shape {shape:?}",
                    c.offsets, c.sizes
                ),
            ));
            return;
        }
        let out_of_bounds = c
            .offsets
            .iter()
            .zip(&c.sizes)
            .zip(shape)
            .any(|((&o, &s), &d)| o.checked_add(s).is_none_or(|end| end > d));
        if out_of_bounds {
            problems.push(problem(
                Some(c),
                format!(
                    "chunk at {:?} of size {:?} lies outside shape {shape:?}",
                    c.offsets, c.sizes
                ),
            ));
            return;
        }
        match seen.entry((&c.offsets, &c.sizes)) {
            std::collections::hash_map::Entry::Vacant(v) => {
                boxes.push(c);
                v.insert((c.rank, Vec::new()));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (first, more) = o.get_mut();
                if *first == c.rank || more.contains(&c.rank) || c.rank.is_none() {
                    problems.push(problem(
                        Some(c),
                        format!("chunk at {:?} is stored twice", c.offsets),
                    ));
                } else {
                    more.push(c.rank);
                }
            }
        }
    }
    let mut volume = 0u64;
    for c in &boxes {
        volume = volume.saturating_add(c.numel().unwrap_or(u64::MAX));
    }
    // Overlap: sweep on dim 0 (a compare budget keeps hostile inputs linear-ish).
    let nonempty: Vec<&Chunk> = {
        let mut v: Vec<&Chunk> = boxes
            .iter()
            .copied()
            .filter(|c| c.numel() != Some(0))
            .collect();
        v.sort_by(|a, b| a.offsets.cmp(&b.offsets));
        v
    };
    let mut budget: u64 = 50_000_000;
    'outer: for (i, a) in nonempty.iter().enumerate() {
        for b in &nonempty[i + 1..] {
            if !a.offsets.is_empty() && b.offsets[0] >= a.offsets[0] + a.sizes[0] {
                break;
            }
            budget = budget.saturating_sub(1);
            if budget == 0 {
                break 'outer;
            }
            let overlap = a
                .offsets
                .iter()
                .zip(&a.sizes)
                .zip(b.offsets.iter().zip(&b.sizes))
                .all(|((&ao, &asz), (&bo, &bsz))| ao.max(bo) < (ao + asz).min(bo + bsz));
            if overlap {
                problems.push(problem(
                    Some(b),
                    format!(
                        "chunk at {:?} (size {:?}) overlaps the chunk at {:?} (size {:?}) in {}",
                        b.offsets, b.sizes, a.offsets, a.sizes, a.file
                    ),
                ));
                return;
            }
        }
    }
    if volume != total {
        problems.push(problem(
            None,
            format!("chunks cover {volume} of {total} elements {GAP_NOTE}"),
        ));
    }
}
