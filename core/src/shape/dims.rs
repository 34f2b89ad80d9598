//! [`Dims`]: a short list of `u64` (a chunk's offsets or sizes) that holds up to two values inline.
//! An index of a million chunks holds two of these per chunk; a `Vec<u64>` each would be two heap
//! allocations per chunk and twice the bytes.

use std::fmt;
use std::ops::Deref;

/// Values held without a heap allocation.
const INLINE: usize = 2;

/// A list of `u64` that reads as a slice (`&dims[..]`, `dims.len()`, `dims.iter()`); 24 bytes,
/// with up to two values held inline. Serializes as a sequence, like `Vec<u64>`.
#[derive(Clone)]
pub struct Dims(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, dims: [u64; INLINE] },
    Heap(Box<[u64]>),
}

impl Dims {
    /// No values.
    pub const fn new() -> Self {
        Dims(Repr::Inline {
            len: 0,
            dims: [0; INLINE],
        })
    }

    /// The values.
    pub fn as_slice(&self) -> &[u64] {
        match &self.0 {
            // `len <= INLINE` by construction.
            Repr::Inline { len, dims } => &dims[..usize::from(*len)],
            Repr::Heap(b) => b,
        }
    }

    /// The values as a slice that may be changed in place (the length stays).
    pub fn as_mut_slice(&mut self) -> &mut [u64] {
        match &mut self.0 {
            Repr::Inline { len, dims } => &mut dims[..usize::from(*len)],
            Repr::Heap(b) => b,
        }
    }

    /// The values as a `Vec`.
    pub fn into_vec(self) -> Vec<u64> {
        match self.0 {
            Repr::Inline { .. } => self.as_slice().to_vec(),
            Repr::Heap(b) => b.into_vec(),
        }
    }
}

impl Default for Dims {
    fn default() -> Self {
        Dims::new()
    }
}

impl Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [u64] {
        self.as_mut_slice()
    }
}

impl AsRef<[u64]> for Dims {
    fn as_ref(&self) -> &[u64] {
        self.as_slice()
    }
}

impl std::borrow::Borrow<[u64]> for Dims {
    fn borrow(&self) -> &[u64] {
        self.as_slice()
    }
}

impl From<&[u64]> for Dims {
    fn from(v: &[u64]) -> Self {
        if v.len() <= INLINE {
            let mut dims = [0; INLINE];
            dims[..v.len()].copy_from_slice(v);
            // `v.len() <= INLINE`, which fits a `u8`.
            Dims(Repr::Inline {
                len: v.len() as u8,
                dims,
            })
        } else {
            Dims(Repr::Heap(v.into()))
        }
    }
}

impl<const N: usize> From<[u64; N]> for Dims {
    fn from(v: [u64; N]) -> Self {
        Dims::from(&v[..])
    }
}

impl From<Vec<u64>> for Dims {
    fn from(v: Vec<u64>) -> Self {
        if v.len() <= INLINE {
            Dims::from(&v[..])
        } else {
            Dims(Repr::Heap(v.into_boxed_slice()))
        }
    }
}

impl From<&Vec<u64>> for Dims {
    fn from(v: &Vec<u64>) -> Self {
        Dims::from(&v[..])
    }
}

impl From<Dims> for Vec<u64> {
    fn from(d: Dims) -> Self {
        d.into_vec()
    }
}

impl FromIterator<u64> for Dims {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Self {
        let mut iter = iter.into_iter();
        let mut dims = [0; INLINE];
        let mut len = 0;
        while len < INLINE {
            match iter.next() {
                Some(v) => {
                    dims[len] = v;
                    len += 1;
                }
                None => {
                    return Dims(Repr::Inline {
                        len: len as u8,
                        dims,
                    });
                }
            }
        }
        match iter.next() {
            None => Dims(Repr::Inline {
                len: len as u8,
                dims,
            }),
            Some(next) => {
                let mut v = dims.to_vec();
                v.push(next);
                v.extend(iter);
                Dims(Repr::Heap(v.into_boxed_slice()))
            }
        }
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a u64;
    type IntoIter = std::slice::Iter<'a, u64>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl PartialEq for Dims {
    fn eq(&self, other: &Dims) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Dims {}

impl PartialEq<[u64]> for Dims {
    fn eq(&self, other: &[u64]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<&[u64]> for Dims {
    fn eq(&self, other: &&[u64]) -> bool {
        self.as_slice() == *other
    }
}

impl PartialEq<Vec<u64>> for Dims {
    fn eq(&self, other: &Vec<u64>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<const N: usize> PartialEq<[u64; N]> for Dims {
    fn eq(&self, other: &[u64; N]) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<Dims> for Vec<u64> {
    fn eq(&self, other: &Dims) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialOrd for Dims {
    fn partial_cmp(&self, other: &Dims) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Dims {
    fn cmp(&self, other: &Dims) -> std::cmp::Ordering {
        self.as_slice().cmp(other.as_slice())
    }
}

impl std::hash::Hash for Dims {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl serde::Serialize for Dims {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::Dims;

    #[test]
    fn inline_and_heap_read_alike() {
        assert_eq!(std::mem::size_of::<Dims>(), 24);
        for n in 0..6u64 {
            let v: Vec<u64> = (1..=n).collect();
            let a = Dims::from(v.clone());
            let b: Dims = v.iter().copied().collect();
            let c = Dims::from(&v[..]);
            assert_eq!(a, v);
            assert_eq!(b, v);
            assert_eq!(c, v);
            assert_eq!(a.len(), v.len());
            assert_eq!(format!("{a:?}"), format!("{v:?}"));
            assert_eq!(
                serde_json::to_string(&a).unwrap(),
                serde_json::to_string(&v).unwrap()
            );
            assert_eq!(a.clone().into_vec(), v);
        }
        let (a, b) = (Dims::from([1, 2]), Dims::from([1, 3]));
        assert!(a < b);
        assert_eq!(Dims::new().len(), 0);
    }
}
