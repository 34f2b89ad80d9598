//! The operations a mapping applies to a tensor's bytes (C order, any element size): reshape,
//! permutation of dimensions, a slice along one dimension, concatenation. Each checks its sizes
//! and returns an error instead of panicking on a mismatch.

use crate::shape::contiguous_strides;

use super::MappingError;

/// A tensor's bytes in C order with its shape and element size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dense {
    pub bytes: Vec<u8>,
    pub shape: Vec<u64>,
    pub elem: usize,
}

fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

fn err(what: String) -> MappingError {
    MappingError::Apply(what)
}

impl Dense {
    pub fn new(bytes: Vec<u8>, shape: Vec<u64>, elem: usize) -> Result<Self, MappingError> {
        let n = numel(&shape)
            .and_then(|n| n.checked_mul(elem as u64))
            .ok_or_else(|| err(format!("shape {shape:?} overflows")))?;
        if n != bytes.len() as u64 {
            return Err(err(format!(
                "{} bytes do not hold shape {shape:?} of {elem}-byte elements",
                bytes.len()
            )));
        }
        Ok(Self { bytes, shape, elem })
    }

    /// The same elements under another shape of the same number of elements.
    pub fn reshape(mut self, shape: &[u64]) -> Result<Self, MappingError> {
        if numel(shape) != numel(&self.shape) {
            return Err(err(format!(
                "cannot view shape {:?} as {shape:?}",
                self.shape
            )));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// `permute(perm)` made contiguous: output dimension `i` is input dimension `perm[i]`.
    pub fn permute(self, perm: &[usize]) -> Result<Self, MappingError> {
        let rank = self.shape.len();
        let mut seen = vec![false; rank];
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            return Err(err(format!(
                "{perm:?} is not a permutation of the {rank} dimensions of {:?}",
                self.shape
            )));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self);
        }
        let in_strides = contiguous_strides(&self.shape);
        let out_shape: Vec<u64> = perm.iter().map(|&p| self.shape[p]).collect();
        let strides: Vec<u64> = perm.iter().map(|&p| in_strides[p]).collect();
        let mut out = Vec::with_capacity(self.bytes.len());
        gather(&self.bytes, self.elem, &out_shape, &strides, 0, &mut out);
        Ok(Self {
            bytes: out,
            shape: out_shape,
            elem: self.elem,
        })
    }

    /// Elements `start..start + len` along `dim`.
    pub fn slice(self, dim: usize, start: u64, len: u64) -> Result<Self, MappingError> {
        let Some(&size) = self.shape.get(dim) else {
            return Err(err(format!("no dimension {dim} in shape {:?}", self.shape)));
        };
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(err(format!(
                "{start}..{} is outside dimension {dim} of shape {:?}",
                start.saturating_add(len),
                self.shape
            )));
        }
        let strides = contiguous_strides(&self.shape);
        let mut out_shape = self.shape.clone();
        out_shape[dim] = len;
        let base = start * strides[dim];
        let mut out = Vec::new();
        gather(&self.bytes, self.elem, &out_shape, &strides, base, &mut out);
        Ok(Self {
            bytes: out,
            shape: out_shape,
            elem: self.elem,
        })
    }

    /// The tensors joined along `dim` (all other dimensions equal).
    pub fn concat(parts: &[Self], dim: usize) -> Result<Self, MappingError> {
        let Some(first) = parts.first() else {
            return Err(err("nothing to concatenate".to_owned()));
        };
        let (elem, rank) = (first.elem, first.shape.len());
        let mut shape = first.shape.clone();
        if dim >= rank {
            return Err(err(format!("no dimension {dim} in shape {shape:?}")));
        }
        shape[dim] = 0;
        for p in parts {
            let same = p.elem == elem
                && p.shape.len() == rank
                && p.shape
                    .iter()
                    .zip(&first.shape)
                    .enumerate()
                    .all(|(i, (a, b))| i == dim || a == b);
            if !same {
                return Err(err(format!(
                    "cannot concatenate shapes {:?} and {:?} along dimension {dim}",
                    first.shape, p.shape
                )));
            }
            shape[dim] = shape[dim]
                .checked_add(p.shape[dim])
                .ok_or_else(|| err("concatenation overflows".to_owned()))?;
        }
        // Rows of the dimensions before `dim`: each part contributes its block to each.
        let outer = numel(&shape[..dim]).unwrap_or(0);
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.bytes.len()).sum());
        for o in 0..outer {
            for p in parts {
                let block = p.bytes.len() / outer.max(1) as usize;
                let at = o as usize * block;
                out.extend_from_slice(&p.bytes[at..at + block]);
            }
        }
        Ok(Self {
            bytes: out,
            shape,
            elem,
        })
    }
}

/// Appends the elements of the strided view (`shape`, element `strides`, element offset `base`)
/// of `src` to `out`, in C order; the innermost contiguous run is copied at once.
fn gather(src: &[u8], elem: usize, shape: &[u64], strides: &[u64], base: u64, out: &mut Vec<u8>) {
    if shape.contains(&0) {
        return;
    }
    // Merge the innermost dimensions that are contiguous in the source.
    let mut inner = 1u64;
    let mut rank = shape.len();
    while rank > 0 && strides[rank - 1] == inner {
        inner *= shape[rank - 1];
        rank -= 1;
    }
    let run = inner as usize * elem;
    let mut index = vec![0u64; rank];
    loop {
        let offset = base + index.iter().zip(strides).map(|(i, s)| i * s).sum::<u64>();
        let at = offset as usize * elem;
        out.extend_from_slice(&src[at..at + run]);
        let mut d = rank;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// The RoPE permutation torchtitan → Hugging Face of a `[heads·head_dim, ...]` projection: within
/// each head, rows in interleaved pairs `(0, 1), (2, 3), …` become the two halves `(0, 2, …), (1,
/// 3, …)`: `w.view(heads, head_dim/2, 2, rest).transpose(1, 2).reshape(heads·head_dim, rest)`.
/// `inverse` undoes it (`view(heads, 2, head_dim/2, rest)`, the same transpose).
pub fn rope(t: Dense, heads: u64, inverse: bool) -> Result<Dense, MappingError> {
    let Some((&rows, rest)) = t.shape.split_first() else {
        return Err(err(
            "a RoPE permutation needs a matrix, not a scalar".to_owned()
        ));
    };
    if heads == 0 || rows % (heads * 2) != 0 {
        return Err(err(format!(
            "{rows} rows are not {heads} heads of an even head size"
        )));
    }
    let half = rows / heads / 2;
    let cols = numel(rest).unwrap_or(0);
    let shape = t.shape.clone();
    let view = if inverse {
        [heads, 2, half, cols]
    } else {
        [heads, half, 2, cols]
    };
    t.reshape(&view)?.permute(&[0, 2, 1, 3])?.reshape(&shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[u64]) -> Dense {
        let n = numel(shape).unwrap() as usize;
        Dense::new((0..n as u8).collect(), shape.to_vec(), 1).unwrap()
    }

    #[test]
    fn permute_and_slice_and_concat() {
        let x = t(&[2, 3]);
        let y = x.clone().permute(&[1, 0]).unwrap();
        assert_eq!(y.shape, vec![3, 2]);
        assert_eq!(y.bytes, vec![0, 3, 1, 4, 2, 5]);
        let s = x.clone().slice(1, 1, 2).unwrap();
        assert_eq!(s.bytes, vec![1, 2, 4, 5]);
        let c = Dense::concat(&[x.clone().slice(1, 0, 1).unwrap(), s], 1).unwrap();
        assert_eq!(c, x);
        assert!(x.clone().slice(1, 2, 2).is_err());
        assert!(x.clone().permute(&[0, 0]).is_err());
        assert!(x.reshape(&[4]).is_err());
    }

    #[test]
    fn rope_matches_torch_formula_and_inverts() {
        // 2 heads of head_dim 4, 1 column: rows [h0: 0 1 2 3, h1: 4 5 6 7] -> [0 2 1 3, 4 6 5 7].
        let x = t(&[8, 1]);
        let y = rope(x.clone(), 2, false).unwrap();
        assert_eq!(y.bytes, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(rope(y, 2, true).unwrap(), x);
        assert!(rope(t(&[6, 1]), 2, false).is_err());
    }
}
