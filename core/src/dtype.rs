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
    Complex64,
    Complex128,
    Float8E4M3Fn,
    Float8E5M2,
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
    pub const ALL: [DType; 17] = [
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
        DType::Complex64,
        DType::Complex128,
        DType::Float8E4M3Fn,
        DType::Float8E5M2,
    ];

    /// Size of one element in bytes (`torch.dtype.itemsize`).
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::UInt8 | DType::Int8 | DType::Float8E4M3Fn | DType::Float8E5M2 => 1,
            DType::Int16 | DType::UInt16 | DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 => 4,
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
        )
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
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
            DType::Float8E4M3Fn => "float8_e4m3fn",
            DType::Float8E5M2 => "float8_e5m2",
        }
    }

    /// `str(torch.dtype)`, e.g. `torch.float32`, as it appears in PyTorch's error messages.
    pub fn torch_name(self) -> String {
        format!("torch.{}", self.name())
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
            "complex64" | "cfloat" => DType::Complex64,
            "complex128" | "cdouble" => DType::Complex128,
            "float8_e4m3fn" => DType::Float8E4M3Fn,
            "float8_e5m2" => DType::Float8E5M2,
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
    }
}
