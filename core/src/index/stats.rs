//! Summary statistics of tensor values.

use serde::Serialize;

use crate::index::TensorData;

/// Summary statistics of a tensor's values (`--values`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValueStats {
    pub count: u64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub mean: Option<f64>,
    pub nan: u64,
    pub inf: u64,
}

impl TensorData {
    /// Values as f64, one per element (`None` for complex types: see [`TensorData::components`]).
    pub fn to_f64(&self) -> Option<Vec<f64>> {
        if self.dtype.is_complex() {
            return None;
        }
        Some(self.components().collect())
    }

    /// Every real component as f64: one per element, two (real, imaginary) per complex element,
    /// the order of `torch.view_as_real(t).double().flatten()`. Float8 values are decoded exactly
    /// (see [`crate::dtype::f64_from_float8`]).
    pub fn components(&self) -> impl Iterator<Item = f64> + '_ {
        let complex = self.dtype.is_complex();
        self.bytes
            .chunks_exact(self.dtype.size_bytes())
            .flat_map(move |c| {
                let [re, im] = self.dtype.element_f64(c);
                std::iter::once(re).chain(complex.then_some(im))
            })
    }

    /// min / max / mean over finite values, and the number of NaN and infinite values. Complex
    /// tensors count their real and imaginary parts as separate values (`count` stays the number
    /// of elements), as statistics of `torch.view_as_real(t)` do.
    pub fn stats(&self) -> Option<ValueStats> {
        let values = self.components();
        let mut s = ValueStats {
            count: (self.bytes.len() / self.dtype.size_bytes()) as u64,
            min: None,
            max: None,
            mean: None,
            nan: 0,
            inf: 0,
        };
        let mut sum = 0.0;
        let mut finite = 0u64;
        for v in values {
            if v.is_nan() {
                s.nan += 1;
            } else if v.is_infinite() {
                s.inf += 1;
            } else {
                s.min = Some(s.min.map_or(v, |m: f64| m.min(v)));
                s.max = Some(s.max.map_or(v, |m: f64| m.max(v)));
                sum += v;
                finite += 1;
            }
        }
        if finite > 0 {
            s.mean = Some(sum / finite as f64);
        }
        Some(s)
    }
}
