//! `torch.chunk` along one dimension, and DTensor's `Shard` local size and offset.
//!
//! `torch.chunk(len, n)` uses chunks of `ceil(len / n)` elements; only the trailing chunks are short
//! or empty, and fewer than `n` chunks may be non-empty. This is not numpy's `array_split`.

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

#[cfg(test)]
mod tests {
    use super::*;

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
