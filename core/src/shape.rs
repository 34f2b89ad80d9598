//! Array arithmetic on shapes, as torch computes it: element counts and byte sizes, contiguous
//! strides, the boxes that make up a flat range of a row-major tensor, `torch.chunk` along one
//! dimension and DTensor's `Shard` local size and offset.
//!
//! `torch.chunk(len, n)` uses chunks of `ceil(len / n)` elements; only the trailing chunks are short
//! or empty, and fewer than `n` chunks may be non-empty. This is not numpy's `array_split`.

use crate::dtype::DType;

mod dims;
pub use dims::Dims;

/// Size of every non-last chunk: `ceil(len / n)`. `n` must be at least 1.
pub const fn chunk_size(len: u64, n: u64) -> u64 {
    len.div_ceil(n)
}

/// The half-open element range `[start, end)` of chunk `k` of `torch.chunk(len, n)`; empty (with
/// `start == end == len`-clamped) for chunks past the data.
pub fn chunk_range(len: u64, n: u64, k: u64) -> (u64, u64) {
    let size = chunk_size(len, n);
    let start = size.saturating_mul(k).min(len);
    let end = size.saturating_mul(k.saturating_add(1)).min(len);
    (start, end)
}

/// DTensor `Shard(dim)` on one mesh dimension of size `n`, coordinate `k`, for a tensor dimension of
/// current size `len`: `(local_size, global_offset)`. An empty shard reports offset `len`, as
/// `Shard.local_shard_size_and_offset` does.
pub fn shard_size_and_offset(len: u64, n: u64, k: u64) -> (u64, u64) {
    if len.is_multiple_of(n) {
        let size = len / n;
        return (size, size * k);
    }
    let full = chunk_size(len, n);
    let start = full.saturating_mul(k);
    if start >= len {
        (0, len)
    } else {
        (full.min(len - start), start)
    }
}

/// Number of elements of `shape` (1 for `[]`), `None` on overflow.
pub fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// Bytes of a contiguous tensor of `shape` and `dtype`, `None` on overflow.
pub fn nbytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    numel(shape)?.checked_mul(dtype.size_bytes() as u64)
}

/// C-contiguous strides as torch computes them: `stride[i] = stride[i + 1] * max(shape[i + 1], 1)`.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    strides
}

/// Row-major strides of `shape` (as [`contiguous_strides`]), or `None` on overflow.
pub fn checked_contiguous_strides(shape: &[u64]) -> Option<Vec<u64>> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc = acc.checked_mul(shape[d].max(1))?;
    }
    Some(strides)
}

/// One box of a flat range: `(offsets, sizes, flat index of its first element)`.
pub type FlatBox = (Vec<u64>, Vec<u64>, u64);

/// The boxes whose union is the flat range `[start, end)` of a row-major tensor of `shape`, in
/// flat order (at most `2·ndim − 1` of them). `None` when the range lies outside the tensor or
/// sizes overflow.
pub fn flat_range_boxes(shape: &[u64], start: u64, end: u64) -> Option<Vec<FlatBox>> {
    let numel = numel(shape)?;
    if start > end || end > numel {
        return None;
    }
    let mut out = Vec::new();
    let mut prefix = Vec::with_capacity(shape.len());
    boxes_rec(shape, start, end, &mut prefix, 0, &mut out);
    Some(out)
}

fn boxes_rec(
    shape: &[u64],
    start: u64,
    end: u64,
    prefix: &mut Vec<u64>,
    flat_base: u64,
    out: &mut Vec<FlatBox>,
) {
    if start >= end {
        return;
    }
    let Some((&dim0, rest)) = shape.split_first() else {
        // A 0-d tensor: its one element.
        out.push((prefix.clone(), Vec::new(), flat_base));
        return;
    };
    let inner: u64 = rest.iter().product();
    if inner == 0 || dim0 == 0 {
        return;
    }
    let (row0, col0) = (start / inner, start % inner);
    let (row1, col1) = (end / inner, end % inner);
    let push_rows = |prefix: &mut Vec<u64>, from: u64, to: u64, out: &mut Vec<FlatBox>| {
        if from < to {
            let mut offsets = prefix.clone();
            offsets.push(from);
            offsets.extend(std::iter::repeat_n(0, rest.len()));
            let mut sizes = vec![1; prefix.len()];
            sizes.push(to - from);
            sizes.extend_from_slice(rest);
            out.push((offsets, sizes, flat_base + from * inner));
        }
    };
    if row0 == row1 {
        prefix.push(row0);
        boxes_rec(rest, col0, col1, prefix, flat_base + row0 * inner, out);
        prefix.pop();
        return;
    }
    let mut first_full = row0;
    if col0 != 0 {
        prefix.push(row0);
        boxes_rec(rest, col0, inner, prefix, flat_base + row0 * inner, out);
        prefix.pop();
        first_full += 1;
    }
    push_rows(prefix, first_full, row1, out);
    if col1 != 0 {
        prefix.push(row1);
        boxes_rec(rest, 0, col1, prefix, flat_base + row1 * inner, out);
        prefix.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_match_torch() {
        // torch.zeros(2, 3, 4).stride() == (12, 4, 1); torch.zeros(0, 3).stride() == (3, 1);
        // torch.zeros(3, 0, 2).stride() == (2, 2, 1).
        assert_eq!(contiguous_strides(&[2, 3, 4]), [12, 4, 1]);
        assert_eq!(contiguous_strides(&[0, 3]), [3, 1]);
        assert_eq!(contiguous_strides(&[3, 0, 2]), [2, 2, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<u64>::new());
    }

    fn covered(shape: &[u64], start: u64, end: u64) -> Vec<u64> {
        let strides = checked_contiguous_strides(shape).unwrap();
        let mut flat = Vec::new();
        for (offsets, sizes, first) in flat_range_boxes(shape, start, end).unwrap() {
            assert_eq!(offsets.len(), shape.len());
            let first_of_box: u64 = offsets.iter().zip(&strides).map(|(o, s)| o * s).sum();
            assert_eq!(first_of_box, first);
            let n: u64 = sizes.iter().product();
            let mut idx = vec![0u64; sizes.len()];
            for _ in 0..n {
                flat.push(
                    idx.iter()
                        .zip(&offsets)
                        .zip(&strides)
                        .map(|((i, o), s)| (i + o) * s)
                        .sum(),
                );
                for d in (0..idx.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < sizes[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
        }
        flat
    }

    #[test]
    fn boxes_tile_every_range_in_order() {
        for shape in [
            vec![],
            vec![7],
            vec![3, 4],
            vec![2, 3, 4],
            vec![3, 1, 5],
            vec![2, 2, 2, 3],
        ] {
            let numel: u64 = shape.iter().product();
            for start in 0..=numel {
                for end in start..=numel {
                    let got = covered(&shape, start, end);
                    let want: Vec<u64> = (start..end).collect();
                    assert_eq!(got, want, "shape {shape:?} range {start}..{end}");
                    let boxes = flat_range_boxes(&shape, start, end).unwrap();
                    assert!(boxes.len() <= (2 * shape.len()).max(1), "{shape:?}");
                }
            }
        }
    }

    #[test]
    fn ranges_outside_are_refused() {
        assert!(flat_range_boxes(&[2, 3], 0, 7).is_none());
        assert!(flat_range_boxes(&[2, 3], 4, 3).is_none());
        assert!(flat_range_boxes(&[u64::MAX, 3], 0, 1).is_none());
        assert_eq!(flat_range_boxes(&[0, 3], 0, 0).unwrap(), Vec::new());
    }

    #[test]
    fn chunk_matches_torch_examples() {
        // torch.chunk(torch.arange(5), 4) -> sizes [2, 2, 1] and an empty fourth.
        let sizes: Vec<u64> = (0..4)
            .map(|k| {
                let (s, e) = chunk_range(5, 4, k);
                e - s
            })
            .collect();
        assert_eq!(sizes, [2, 2, 1, 0]);
        // torch.chunk(torch.arange(6), 4) -> [2, 2, 2] and an empty fourth (not 2,2,1,1).
        let sizes: Vec<u64> = (0..4)
            .map(|k| {
                let (s, e) = chunk_range(6, 4, k);
                e - s
            })
            .collect();
        assert_eq!(sizes, [2, 2, 2, 0]);
    }

    #[test]
    fn dtensor_offsets_of_empty_shards_are_the_dim_size() {
        // Spec section 4.4: a (5) over 4 -> (2,0) (2,2) (1,4) (0,5).
        let got: Vec<_> = (0..4).map(|k| shard_size_and_offset(5, 4, k)).collect();
        assert_eq!(got, [(2, 0), (2, 2), (1, 4), (0, 5)]);
        let got: Vec<_> = (0..4).map(|k| shard_size_and_offset(3, 4, k)).collect();
        assert_eq!(got, [(1, 0), (1, 1), (1, 2), (0, 3)]);
    }
}
