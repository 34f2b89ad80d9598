//! Writers for the checkpoint formats PyTorch loads: safetensors (single file or HF-sharded with an
//! index), `torch.save` zip archives, and `torch.distributed.checkpoint` (DCP) directories.
//!
//! # Design: streaming, one tensor at a time
//!
//! Every writer writes to any [`std::io::Write`] (no `Seek`, no file system: `core` does no I/O of its
//! own; the native runner hands in a temp file that it renames into place, see
//! `native-runner/src/atomic.rs`). Each format needs all tensor *metadata* before the first data byte
//! (the safetensors header, the pickle `data.pkl`, the DCP item table), but no tensor *data*: a writer is
//! created from the metadata, then the caller feeds the data of one tensor at a time in the order the
//! writer asks for, and calls `finish`. Peak memory is therefore the largest tensor the caller holds, plus
//! small metadata. Output bytes depend only on the input (no clocks, no random ids): writing twice gives
//! identical files.
//!
//! | module | entry points | output |
//! |---|---|---|
//! | [`pickle`] | [`pickle::PyValue`], [`pickle::to_pickle`] | pickle protocol 2 of a nested Python value, tensors as `torch._utils._rebuild_tensor_v2` + persistent storage ids |
//! | [`zip`] | [`zip::ZipWriter`] | stored (uncompressed) zip, 64-byte aligned members, ZIP64 end records, as `torch.save` writes |
//! | [`torch_save`] | [`torch_save::TorchSaveWriter`], [`torch_save::torch_save_to_vec`] | a `torch.save` archive that `torch.load(weights_only=True)` accepts |
//! | [`safetensors`] | [`safetensors::SafetensorsWriter`], [`safetensors::plan_shards`], [`safetensors::index_json`] | `.safetensors` files byte-identical to `safetensors.torch.save`, HF shard names and `model.safetensors.index.json` |
//! | [`dcp`] | [`dcp::DcpPlan`], [`dcp::DcpFileWriter`], [`dcp::metadata_pickle`], [`dcp::chunk_dim0`] | `__{rank}_0.distcp` files and `.metadata` that `torch.distributed.checkpoint.load` accepts |
//!
//! Tensor data is always little-endian and C-contiguous; a [`TensorRef`] borrows it.
//!
//! ```
//! use shardscope_core::DType;
//! use shardscope_core::formats::write::TensorRef;
//! use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};
//!
//! let data: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! let tensor = TensorRef::new(DType::Float32, &[3], &data).unwrap();
//! let specs = [TensorSpec::from_tensor("w", &tensor)];
//! let mut writer = SafetensorsWriter::new(Vec::new(), &specs, None).unwrap();
//! writer.write_tensor("w", tensor.data).unwrap();
//! let bytes = writer.finish().unwrap();
//! assert_eq!(&bytes[8..9], b"{");
//! ```

pub mod dcp;
pub mod pickle;
pub mod safetensors;
pub mod torch_save;
pub mod zip;

use std::io::{self, Write};

use crate::dtype::DType;
use crate::shape::{nbytes, numel};

/// A borrowed, C-contiguous, little-endian tensor: what every writer takes as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRef<'a> {
    /// Element type.
    pub dtype: DType,
    /// Shape; empty for a 0-dim (scalar) tensor.
    pub shape: &'a [u64],
    /// `numel * dtype.size_bytes()` bytes, little-endian, row-major.
    pub data: &'a [u8],
}

/// A [`TensorRef`] whose data length does not match its shape and dtype.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorRefError {
    /// The product of the shape (times the element size) does not fit in 64 bits.
    #[error("shape {shape:?} of {dtype} overflows 64-bit byte counts")]
    ShapeOverflow {
        /// The shape given.
        shape: Vec<u64>,
        /// The dtype given.
        dtype: DType,
    },
    /// The data is shorter or longer than `numel * itemsize`.
    #[error("shape {shape:?} of {dtype} needs {expected_bytes} bytes, got {actual_bytes}")]
    DataLength {
        /// The shape given.
        shape: Vec<u64>,
        /// The dtype given.
        dtype: DType,
        /// `numel * itemsize`.
        expected_bytes: u64,
        /// `data.len()`.
        actual_bytes: u64,
    },
}

impl<'a> TensorRef<'a> {
    /// Checks that `data` holds exactly `numel(shape) * dtype.size_bytes()` bytes.
    pub fn new(dtype: DType, shape: &'a [u64], data: &'a [u8]) -> Result<Self, TensorRefError> {
        let expected_bytes = nbytes(dtype, shape).ok_or_else(|| TensorRefError::ShapeOverflow {
            shape: shape.to_vec(),
            dtype,
        })?;
        if expected_bytes != data.len() as u64 {
            return Err(TensorRefError::DataLength {
                shape: shape.to_vec(),
                dtype,
                expected_bytes,
                actual_bytes: data.len() as u64,
            });
        }
        Ok(Self { dtype, shape, data })
    }

    /// Number of elements (1 for a 0-dim tensor).
    pub fn numel(&self) -> u64 {
        // `new` checked that this does not overflow; a struct built by hand saturates.
        numel(self.shape).unwrap_or(u64::MAX)
    }
}

/// A `Write` adapter that counts the bytes written through it (writers need offsets, not `Seek`).
#[derive(Debug)]
pub(crate) struct CountingWriter<W> {
    inner: W,
    position: u64,
}

impl<W: Write> CountingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        Self { inner, position: 0 }
    }

    /// Bytes written so far.
    pub(crate) fn position(&self) -> u64 {
        self.position
    }

    pub(crate) fn into_inner(self) -> W {
        self.inner
    }

    /// The inner writer, for seeking back (it must be left where it was, `position` bytes in).
    pub(crate) fn inner_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

/// Largest single `write` passed on: 128 KiB, what `cat` uses. Large `write` system calls cost
/// Linux a lot of system time against the dirty-page limit: converting a 2.1 GiB checkpoint took
/// 3.4-7.5 s in 128 MiB writes and 1.6-1.9 s in 8 MiB ones (bench/convert_dcp.py); converting a
/// 3 GiB FSDP2 folder to one `.pt` took 22-38 s in 8 MiB writes (9-11 s of system time), 14 s in
/// 1 MiB ones and 6.4-14 s in 128 or 256 KiB ones (2-3.6 s of system time), alternating on the same
/// busy machine (BENCHMARKS.md). `dd` shows the same: 3 GiB with `conv=fsync` took 7-9 s in 128 KiB
/// blocks and 16-35 s in 1 or 8 MiB blocks.
const MAX_WRITE: usize = 128 << 10;

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let buf = &buf[..buf.len().min(MAX_WRITE)];
        let n = self.inner.write(buf)?;
        self.position += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_ref_checks_length() {
        assert!(TensorRef::new(DType::Float32, &[2, 3], &[0; 24]).is_ok());
        assert!(TensorRef::new(DType::Float32, &[], &[0; 4]).is_ok());
        assert!(TensorRef::new(DType::Float32, &[0, 5], &[]).is_ok());
        assert!(matches!(
            TensorRef::new(DType::BFloat16, &[3], &[0; 4]),
            Err(TensorRefError::DataLength {
                expected_bytes: 6,
                actual_bytes: 4,
                ..
            })
        ));
        assert!(matches!(
            TensorRef::new(DType::Float64, &[u64::MAX, 2], &[]),
            Err(TensorRefError::ShapeOverflow { .. })
        ));
    }

    /// Records the size of every `write` it is given.
    struct Sizes(Vec<u8>, Vec<usize>);

    impl Write for Sizes {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.1.push(buf.len());
            self.0.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn large_writes_go_out_in_bounded_pieces_unchanged() {
        let data: Vec<u8> = (0..3 * MAX_WRITE + 5).map(|i| (i % 251) as u8).collect();
        let mut w = CountingWriter::new(Sizes(Vec::new(), Vec::new()));
        w.write_all(b"head").unwrap();
        w.write_all(&data).unwrap();
        assert_eq!(w.position(), data.len() as u64 + 4);
        let Sizes(bytes, sizes) = w.into_inner();
        assert_eq!(&bytes[..4], b"head");
        assert!(bytes[4..] == data[..]);
        assert_eq!(sizes, [4, MAX_WRITE, MAX_WRITE, MAX_WRITE, 5]);
    }
}
