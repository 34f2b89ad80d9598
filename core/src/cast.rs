//! Casting floating-point tensors between float16, bfloat16, float32 and float64 as torch's
//! `Tensor.to(dtype)` does on CPU, in place on little-endian bytes.
//!
//! Rounding is to nearest, ties to even. torch converts from float64 to float16 and bfloat16 through
//! float32 (`c10::Half(float)`, `c10::BFloat16(float)` take a float), so a float64 value is rounded
//! twice; so is it here. Infinities and the sign of zero are kept, subnormals are rounded like any
//! other value, and a NaN stays a quiet NaN with its sign. torch has no fixed NaN pattern: a float32
//! NaN cast to bfloat16 becomes 0xFFFF on its AVX2 path, 0x7FC0 on its scalar path (float64
//! sources) and keeps its sign with AVX512-BF16; only NaN-ness is the same everywhere.

use crate::dtype::DType;

/// Why a cast was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CastError {
    /// The source or target dtype is not one of float16, bfloat16, float32, float64.
    #[error("cannot cast {from} to {to}: casts are between float16, bfloat16, float32 and float64")]
    Unsupported { from: DType, to: DType },
    /// The buffer is too short for `numel` elements of the larger of the two dtypes.
    #[error("a buffer of {len} bytes cannot hold {numel} elements of {from} cast to {to} in place")]
    BufferTooShort {
        from: DType,
        to: DType,
        numel: usize,
        len: usize,
    },
}

/// Whether `dtype` is one of the dtypes [`cast_in_place`] converts.
pub const fn is_castable(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64
    )
}

/// The dtype a tensor of `dtype` has after `--dtype to`: `to` for castable floating dtypes, the
/// dtype itself otherwise (integers, bools, complex and float8 are left alone).
pub fn cast_target(dtype: DType, to: Option<DType>) -> DType {
    match to {
        Some(to) if is_castable(dtype) => to,
        _ => dtype,
    }
}

fn load(bytes: &[u8], i: usize, from: DType) -> f64 {
    match from {
        DType::Float16 => f64::from(
            half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
        ),
        DType::BFloat16 => f64::from(
            half::bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
        ),
        DType::Float32 => f64::from(f32::from_le_bytes(
            bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"),
        )),
        _ => f64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes")),
    }
}

/// float32 -> bfloat16, round to nearest even; a NaN stays a quiet NaN with its sign.
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + lsb);
    (rounded >> 16) as u16
}

fn store(bytes: &mut [u8], i: usize, to: DType, x: f64, from: DType) {
    // torch reaches the 16-bit types from float64 through float32: round there first.
    let as_f32 = x as f32;
    match to {
        DType::Float16 => {
            bytes[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(as_f32).to_le_bytes());
        }
        DType::BFloat16 => {
            bytes[2 * i..2 * i + 2].copy_from_slice(&bf16_bits(as_f32).to_le_bytes());
        }
        DType::Float32 => bytes[4 * i..4 * i + 4].copy_from_slice(&as_f32.to_le_bytes()),
        _ => {
            // Widening is exact; float64 -> float64 copies the value (NaN payload included).
            let v = if from == DType::Float64 {
                x
            } else {
                f64::from(as_f32)
            };
            bytes[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Casts `numel` little-endian elements of `from` at the start of `bytes` to `to`, in place, and
/// returns the number of bytes the cast elements take. `bytes` must hold `numel` elements of the
/// larger of the two dtypes. Narrowing walks forward and widening backward, so no element is
/// overwritten before it is read.
pub fn cast_in_place(
    bytes: &mut [u8],
    numel: usize,
    from: DType,
    to: DType,
) -> Result<usize, CastError> {
    if !is_castable(from) || !is_castable(to) {
        return Err(CastError::Unsupported { from, to });
    }
    let (a, b) = (from.size_bytes(), to.size_bytes());
    let need = numel.checked_mul(a.max(b));
    if need.is_none_or(|n| n > bytes.len()) {
        return Err(CastError::BufferTooShort {
            from,
            to,
            numel,
            len: bytes.len(),
        });
    }
    if from != to {
        if b <= a {
            for i in 0..numel {
                let x = load(bytes, i, from);
                store(bytes, i, to, x, from);
            }
        } else {
            for i in (0..numel).rev() {
                let x = load(bytes, i, from);
                store(bytes, i, to, x, from);
            }
        }
    }
    Ok(numel * b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cast_f32(values: &[f32], to: DType) -> Vec<u8> {
        let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let n = cast_in_place(&mut bytes, values.len(), DType::Float32, to).unwrap();
        bytes.truncate(n);
        bytes
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to 1 + 2^-6.
        let out = cast_f32(
            &[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)],
            DType::BFloat16,
        );
        assert_eq!(out, [0x80, 0x3f, 0x82, 0x3f]);
        // Overflow past bfloat16's max rounds to infinity, as IEEE rounding does.
        let out = cast_f32(&[f32::MAX, f32::NEG_INFINITY], DType::BFloat16);
        assert_eq!(out, [0x80, 0x7f, 0x80, 0xff]);
    }

    #[test]
    fn widening_then_narrowing_round_trips() {
        let values = [0.0f32, -0.0, 1.5, -3.25, 65504.0, 6.1e-5];
        let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.resize(values.len() * 8, 0);
        let n = cast_in_place(&mut bytes, values.len(), DType::Float32, DType::Float64).unwrap();
        assert_eq!(n, 48);
        let back = cast_in_place(&mut bytes, values.len(), DType::Float64, DType::Float32).unwrap();
        let got: Vec<f32> = bytes[..back]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            values.map(f32::to_bits)
        );
    }

    #[test]
    fn refuses_other_dtypes_and_short_buffers() {
        let mut bytes = vec![0u8; 8];
        assert!(matches!(
            cast_in_place(&mut bytes, 2, DType::Int32, DType::Float16),
            Err(CastError::Unsupported { .. })
        ));
        assert!(matches!(
            cast_in_place(&mut bytes, 2, DType::Float32, DType::Float64),
            Err(CastError::BufferTooShort { .. })
        ));
        assert!(matches!(
            cast_in_place(&mut bytes, usize::MAX, DType::Float32, DType::Float16),
            Err(CastError::BufferTooShort { .. })
        ));
    }
}
