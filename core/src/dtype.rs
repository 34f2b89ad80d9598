//! Tensor element types, named as PyTorch names them (`float32`, `bfloat16`, ...).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A PyTorch tensor dtype. Names follow `str(torch.dtype)` without the `torch.` prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    UInt8,
    Int8,
    Int16,
    UInt16,
    Int32,
    UInt32,
    Int64,
    UInt64,
    Float16,
    BFloat16,
    Float32,
    Float64,
    Complex32,
    Complex64,
    Complex128,
    Float8E4M3Fn,
    Float8E5M2,
    Float8E4M3Fnuz,
    Float8E5M2Fnuz,
    Float8E8M0Fnu,
}

/// A dtype name that PyTorch does not have (or that shardscope does not know).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown dtype `{name}` (expected a torch dtype name such as float32, bfloat16, float16, int64)"
)]
pub struct UnknownDType {
    pub name: String,
}

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 21] = [
        DType::Bool,
        DType::UInt8,
        DType::Int8,
        DType::Int16,
        DType::UInt16,
        DType::Int32,
        DType::UInt32,
        DType::Int64,
        DType::UInt64,
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
        DType::Complex32,
        DType::Complex64,
        DType::Complex128,
        DType::Float8E4M3Fn,
        DType::Float8E5M2,
        DType::Float8E4M3Fnuz,
        DType::Float8E5M2Fnuz,
        DType::Float8E8M0Fnu,
    ];

    /// Size of one element in bytes (`torch.dtype.itemsize`).
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Bool
            | DType::UInt8
            | DType::Int8
            | DType::Float8E4M3Fn
            | DType::Float8E5M2
            | DType::Float8E4M3Fnuz
            | DType::Float8E5M2Fnuz
            | DType::Float8E8M0Fnu => 1,
            DType::Int16 | DType::UInt16 | DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 | DType::Complex32 => 4,
            DType::Int64 | DType::UInt64 | DType::Float64 | DType::Complex64 => 8,
            DType::Complex128 => 16,
        }
    }

    /// `torch.dtype.is_floating_point` (complex types are not floating point in torch).
    pub const fn is_floating_point(self) -> bool {
        matches!(
            self,
            DType::Float16
                | DType::BFloat16
                | DType::Float32
                | DType::Float64
                | DType::Float8E4M3Fn
                | DType::Float8E5M2
                | DType::Float8E4M3Fnuz
                | DType::Float8E5M2Fnuz
                | DType::Float8E8M0Fnu
        )
    }

    /// `torch.dtype.is_complex`.
    pub const fn is_complex(self) -> bool {
        matches!(
            self,
            DType::Complex32 | DType::Complex64 | DType::Complex128
        )
    }

    /// One element (`size_bytes()` little-endian bytes) as `[real, imaginary]` f64 values, decoded
    /// exactly as torch converts it to float64 (`bool` and integers as their value; the imaginary
    /// part is 0 for real types). Float8 NaN and infinity follow each format's rules (see
    /// [`f64_from_float8`]).
    ///
    /// `bytes` must hold at least `size_bytes()` bytes.
    pub fn element_f64(self, b: &[u8]) -> [f64; 2] {
        let f16_at = |o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).to_f64();
        let f32_at = |o: usize| f64::from(f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]));
        let u64_at = |o: usize| {
            u64::from_le_bytes([
                b[o],
                b[o + 1],
                b[o + 2],
                b[o + 3],
                b[o + 4],
                b[o + 5],
                b[o + 6],
                b[o + 7],
            ])
        };
        let real = match self {
            DType::Bool => f64::from(u8::from(b[0] != 0)),
            DType::UInt8 => f64::from(b[0]),
            DType::Int8 => f64::from(b[0] as i8),
            DType::Int16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
            DType::UInt16 => f64::from(u16::from_le_bytes([b[0], b[1]])),
            DType::Int32 => f64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::UInt32 => f64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::Int64 => u64_at(0) as i64 as f64,
            DType::UInt64 => u64_at(0) as f64,
            DType::Float16 => f16_at(0),
            DType::BFloat16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::Float32 => f32_at(0),
            DType::Float64 => f64::from_bits(u64_at(0)),
            DType::Complex32 => return [f16_at(0), f16_at(2)],
            DType::Complex64 => return [f32_at(0), f32_at(4)],
            DType::Complex128 => return [f64::from_bits(u64_at(0)), f64::from_bits(u64_at(8))],
            DType::Float8E4M3Fn
            | DType::Float8E5M2
            | DType::Float8E4M3Fnuz
            | DType::Float8E5M2Fnuz
            | DType::Float8E8M0Fnu => f64_from_float8(self, b[0]),
        };
        [real, 0.0]
    }

    /// The canonical name, as `str(torch.float32)` minus `torch.`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::UInt8 => "uint8",
            DType::Int8 => "int8",
            DType::Int16 => "int16",
            DType::UInt16 => "uint16",
            DType::Int32 => "int32",
            DType::UInt32 => "uint32",
            DType::Int64 => "int64",
            DType::UInt64 => "uint64",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Complex32 => "complex32",
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
            DType::Float8E4M3Fn => "float8_e4m3fn",
            DType::Float8E5M2 => "float8_e5m2",
            DType::Float8E4M3Fnuz => "float8_e4m3fnuz",
            DType::Float8E5M2Fnuz => "float8_e5m2fnuz",
            DType::Float8E8M0Fnu => "float8_e8m0fnu",
        }
    }

    /// `str(torch.dtype)`, e.g. `torch.float32`, as it appears in PyTorch's error messages.
    pub fn torch_name(self) -> String {
        format!("torch.{}", self.name())
    }
}

/// A float8 byte of `dtype` as f64, exactly (every float8 value is an f64). The formats:
///
/// | dtype | exponent bits (bias) | mantissa bits | infinity | NaN | negative zero |
/// |---|---|---|---|---|---|
/// | `float8_e4m3fn` | 4 (7) | 3 | none | `S.1111.111` | yes |
/// | `float8_e5m2` | 5 (15) | 2 | `S.11111.00` | `S.11111.xx`, xx ≠ 0 | yes |
/// | `float8_e4m3fnuz` | 4 (8) | 3 | none | `0x80` only | no |
/// | `float8_e5m2fnuz` | 5 (16) | 2 | none | `0x80` only | no |
/// | `float8_e8m0fnu` | 8 (127), unsigned | 0 | none | `0xFF` | no zero: `2^(e-127)` |
///
/// Exponent 0 is subnormal (`0.m · 2^(1-bias)`) in the first four. Any other dtype gives NaN.
pub fn f64_from_float8(dtype: DType, byte: u8) -> f64 {
    // (exponent bits, mantissa bits, bias)
    let (exp_bits, man_bits, bias) = match dtype {
        DType::Float8E4M3Fn => {
            if byte & 0x7f == 0x7f {
                return f64::NAN;
            }
            (4, 3, 7)
        }
        DType::Float8E5M2 => {
            if byte & 0x7c == 0x7c {
                return if byte.trailing_zeros() >= 2 {
                    if byte & 0x80 == 0 {
                        f64::INFINITY
                    } else {
                        f64::NEG_INFINITY
                    }
                } else {
                    f64::NAN
                };
            }
            (5, 2, 15)
        }
        DType::Float8E4M3Fnuz | DType::Float8E5M2Fnuz => {
            if byte == 0x80 {
                return f64::NAN;
            }
            if dtype == DType::Float8E4M3Fnuz {
                (4, 3, 8)
            } else {
                (5, 2, 16)
            }
        }
        DType::Float8E8M0Fnu => {
            if byte == 0xff {
                return f64::NAN;
            }
            return 2f64.powi(i32::from(byte) - 127);
        }
        _ => return f64::NAN,
    };
    let sign = if byte & 0x80 == 0 { 1.0 } else { -1.0 };
    let exp = i32::from((byte >> man_bits) & ((1u8 << exp_bits) - 1));
    let man = f64::from(byte & ((1u8 << man_bits) - 1));
    let scale = f64::from(1u8 << man_bits);
    if exp == 0 {
        sign * (man / scale) * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + man / scale) * 2f64.powi(exp - bias)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = UnknownDType;

    /// Accepts torch's names with or without the `torch.` prefix, and torch's aliases
    /// (`float`, `half`, `double`, `long`, `int`, `short`, `cfloat`, `cdouble`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bare = s.strip_prefix("torch.").unwrap_or(s);
        let dtype = match bare {
            "bool" => DType::Bool,
            "uint8" => DType::UInt8,
            "int8" => DType::Int8,
            "int16" | "short" => DType::Int16,
            "uint16" => DType::UInt16,
            "int32" | "int" => DType::Int32,
            "uint32" => DType::UInt32,
            "int64" | "long" => DType::Int64,
            "uint64" => DType::UInt64,
            "float16" | "half" => DType::Float16,
            "bfloat16" => DType::BFloat16,
            "float32" | "float" => DType::Float32,
            "float64" | "double" => DType::Float64,
            "complex32" | "chalf" => DType::Complex32,
            "complex64" | "cfloat" => DType::Complex64,
            "complex128" | "cdouble" => DType::Complex128,
            "float8_e4m3fn" => DType::Float8E4M3Fn,
            "float8_e5m2" => DType::Float8E5M2,
            "float8_e4m3fnuz" => DType::Float8E4M3Fnuz,
            "float8_e5m2fnuz" => DType::Float8E5M2Fnuz,
            "float8_e8m0fnu" => DType::Float8E8M0Fnu,
            _ => {
                return Err(UnknownDType { name: s.to_owned() });
            }
        };
        Ok(dtype)
    }
}

impl Serialize for DType {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for DType {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_prefix_is_accepted() {
        for dtype in DType::ALL {
            assert_eq!(dtype.name().parse::<DType>(), Ok(dtype));
            assert_eq!(dtype.torch_name().parse::<DType>(), Ok(dtype));
        }
        assert_eq!("torch.half".parse::<DType>(), Ok(DType::Float16));
        assert!("float31".parse::<DType>().is_err());
    }

    #[test]
    fn item_sizes_match_torch() {
        // torch.<dtype>.itemsize
        assert_eq!(DType::Float32.size_bytes(), 4);
        assert_eq!(DType::BFloat16.size_bytes(), 2);
        assert_eq!(DType::Float64.size_bytes(), 8);
        assert_eq!(DType::Complex128.size_bytes(), 16);
        assert_eq!(DType::Float8E5M2.size_bytes(), 1);
        assert_eq!(DType::Complex32.size_bytes(), 4);
        assert_eq!(DType::Float8E8M0Fnu.size_bytes(), 1);
        assert_eq!("chalf".parse::<DType>(), Ok(DType::Complex32));
    }

    #[test]
    #[allow(clippy::float_cmp)] // every float8 value is exact in f64
    fn float8_special_values() {
        let f = |d, b| f64_from_float8(d, b);
        // e4m3fn: max 448, smallest subnormal 2^-9, no infinity.
        assert_eq!(f(DType::Float8E4M3Fn, 0x7e), 448.0);
        assert_eq!(f(DType::Float8E4M3Fn, 0x01), 2f64.powi(-9));
        assert!(f(DType::Float8E4M3Fn, 0xff).is_nan());
        assert_eq!(f(DType::Float8E4M3Fn, 0x78), 256.0);
        // e5m2: max 57344, infinities.
        assert_eq!(f(DType::Float8E5M2, 0x7b), 57344.0);
        assert_eq!(f(DType::Float8E5M2, 0xfc), f64::NEG_INFINITY);
        assert!(f(DType::Float8E5M2, 0x7d).is_nan());
        assert_eq!(f(DType::Float8E5M2, 0x01), 2f64.powi(-16));
        // fnuz: 0x80 is the only NaN; 0x7f is the max.
        assert!(f(DType::Float8E4M3Fnuz, 0x80).is_nan());
        assert_eq!(f(DType::Float8E4M3Fnuz, 0x7f), 240.0);
        assert_eq!(f(DType::Float8E4M3Fnuz, 0xff), -240.0);
        assert_eq!(f(DType::Float8E5M2Fnuz, 0x7f), 57344.0);
        assert_eq!(f(DType::Float8E5M2Fnuz, 0x01), 2f64.powi(-17));
        // e8m0: powers of two, 0xff NaN.
        assert_eq!(f(DType::Float8E8M0Fnu, 127), 1.0);
        assert_eq!(f(DType::Float8E8M0Fnu, 0), 2f64.powi(-127));
        assert!(f(DType::Float8E8M0Fnu, 0xff).is_nan());
        assert_eq!(
            DType::Complex32.element_f64(&[0x00, 0x3c, 0x00, 0xc0]),
            [1.0, -2.0]
        );
    }
}
