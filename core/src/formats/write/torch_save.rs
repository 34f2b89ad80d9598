//! `torch.save` archives that `torch.load(weights_only=True)` loads.
//!
//! Members, in the order torch 2.15 writes them (all under one root folder, `archive/` by default;
//! torch uses the file stem): `data.pkl` (pickle protocol 2 of the object, see
//! [`super::pickle`]), `.format_version` (`1`), `.storage_alignment` (`64`), `byteorder` (`little`),
//! `data/0`, `data/1`, ... (raw little-endian storage bytes, one per storage table entry), `version`
//! (`3\n`), `.data/serialization_id` (40 decimal digits; torch draws it at random, we derive it from the
//! content so that output stays deterministic).
//!
//! Streaming: [`TorchSaveWriter::new`] writes everything up to the storages from the object tree and
//! the storage table (dtype and element count per storage, no data); then the caller passes each
//! storage's bytes in table order with [`TorchSaveWriter::write_storage`], and calls
//! [`TorchSaveWriter::finish`]. A storage too large to hold whole can be passed in parts
//! ([`TorchSaveWriter::write_storage_part`], for a seekable output): the archive's bytes are the
//! same.
//!
//! Only globals that the `weights_only` unpickler allows are accepted in the object tree:
//! `collections.OrderedDict` (via [`PyValue::OrderedDict`]), `torch.Size`, and `torch.<dtype>`.

use std::io::{Seek, Write};

use super::pickle::{self, PickleWriteError, PyValue, StorageSpec, TensorPickle};
use super::zip::{ZipWriteError, ZipWriter};
use crate::dtype::DType;

/// A `torch.save` archive could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TorchSaveError {
    /// The object tree could not be pickled (bad tensor view, storage index, ...).
    #[error("cannot pickle the object for `{archive}/data.pkl`")]
    Pickle {
        /// Archive root folder.
        archive: String,
        /// What was wrong.
        #[source]
        source: PickleWriteError,
    },
    /// The object tree uses a global that `torch.load(weights_only=True)` would refuse.
    #[error(
        "`{module}.{name}` is not allowed by torch.load(weights_only=True); only OrderedDict, torch.Size, torch dtypes and bytes are written"
    )]
    GlobalNotAllowed {
        /// Module part.
        module: String,
        /// Name part.
        name: String,
    },
    /// The archive root is empty or contains `/` or a newline.
    #[error("invalid archive root folder `{archive}`")]
    BadArchiveName {
        /// The name given.
        archive: String,
    },
    /// A storage's byte count overflows 64 bits.
    #[error("storage {storage} of {numel} {dtype} elements overflows 64-bit byte counts")]
    StorageTooLarge {
        /// Storage index.
        storage: usize,
        /// Element count.
        numel: u64,
        /// Element type.
        dtype: DType,
    },
    /// `write_storage` got a different number of bytes than the storage table declares.
    #[error("storage {storage} must have {expected_bytes} bytes, got {actual_bytes}")]
    StorageLength {
        /// Storage index.
        storage: usize,
        /// Declared bytes.
        expected_bytes: u64,
        /// Bytes given.
        actual_bytes: u64,
    },
    /// `write_storage` was called after all storages were written.
    #[error("all {storages} storages were already written")]
    TooManyStorages {
        /// Length of the storage table.
        storages: usize,
    },
    /// A whole storage was passed while another was partly written in parts.
    #[error("storage {storage} is partly written ({written} of {expected_bytes} bytes)")]
    PartialStorage {
        /// Storage index.
        storage: usize,
        /// Bytes written so far.
        written: u64,
        /// Declared bytes.
        expected_bytes: u64,
    },
    /// `finish` was called before every storage was written.
    #[error("only {written} of {storages} storages were written")]
    MissingStorages {
        /// Storages written.
        written: usize,
        /// Length of the storage table.
        storages: usize,
    },
    /// The zip container could not be written.
    #[error(transparent)]
    Zip(#[from] ZipWriteError),
}

/// Streams one `torch.save` archive into `W`.
#[derive(Debug)]
pub struct TorchSaveWriter<W: Write> {
    zip: ZipWriter<W>,
    archive: String,
    storages: Vec<StorageSpec>,
    written: usize,
    /// Bytes of storage `written` passed so far by `write_storage_part` (`None`: not begun).
    part: Option<u64>,
    /// FNV-1a over data.pkl and every storage's CRC input, for the serialization id.
    digest: u64,
}

impl<W: Write> TorchSaveWriter<W> {
    /// Validates `root` against `storages`, writes `data.pkl` and the header records. `archive` is the
    /// root folder inside the zip (`"archive"` is what `torch.save` into a buffer uses).
    pub fn new(
        out: W,
        archive: &str,
        root: &PyValue,
        storages: Vec<StorageSpec>,
    ) -> Result<Self, TorchSaveError> {
        Self::with_globals(out, archive, root, storages, false)
    }

    /// As [`TorchSaveWriter::new`], but with `any_global` the object tree may name any global and
    /// build objects (e.g. FSDP1 `ShardedTensor`s of LOCAL state dicts). Such archives load with
    /// `torch.load(..., weights_only=False)` only (or with the classes allow-listed).
    pub fn with_globals(
        out: W,
        archive: &str,
        root: &PyValue,
        storages: Vec<StorageSpec>,
        any_global: bool,
    ) -> Result<Self, TorchSaveError> {
        if archive.is_empty() || archive.contains('/') || archive.contains('\n') {
            return Err(TorchSaveError::BadArchiveName {
                archive: archive.to_owned(),
            });
        }
        if !any_global {
            check_globals(root)?;
        }
        for (storage, spec) in storages.iter().enumerate() {
            if spec
                .numel
                .checked_mul(spec.dtype.size_bytes() as u64)
                .is_none()
            {
                return Err(TorchSaveError::StorageTooLarge {
                    storage,
                    numel: spec.numel,
                    dtype: spec.dtype,
                });
            }
        }
        let data_pkl = pickle::to_pickle_with_storages(root, &storages).map_err(|source| {
            TorchSaveError::Pickle {
                archive: archive.to_owned(),
                source,
            }
        })?;
        let mut zip = ZipWriter::new(out);
        zip.add(&format!("{archive}/data.pkl"), &data_pkl)?;
        zip.add(&format!("{archive}/.format_version"), b"1")?;
        zip.add(&format!("{archive}/.storage_alignment"), b"64")?;
        zip.add(&format!("{archive}/byteorder"), b"little")?;
        Ok(Self {
            zip,
            archive: archive.to_owned(),
            storages,
            written: 0,
            part: None,
            digest: fnv1a(FNV_OFFSET, &data_pkl),
        })
    }

    /// The storage `write_storage` expects next (index and spec), `None` when all are written.
    pub fn next_storage(&self) -> Option<(usize, StorageSpec)> {
        self.storages
            .get(self.written)
            .map(|spec| (self.written, *spec))
    }

    /// Writes the bytes of the next storage (table order): `numel * itemsize` little-endian bytes.
    pub fn write_storage(&mut self, data: &[u8]) -> Result<(), TorchSaveError> {
        let (storage, spec) = self.next_storage().ok_or(TorchSaveError::TooManyStorages {
            storages: self.storages.len(),
        })?;
        // Checked in `new`.
        let expected_bytes = spec.numel.saturating_mul(spec.dtype.size_bytes() as u64);
        if let Some(written) = self.part {
            return Err(TorchSaveError::PartialStorage {
                storage,
                written,
                expected_bytes,
            });
        }
        if expected_bytes != data.len() as u64 {
            return Err(TorchSaveError::StorageLength {
                storage,
                expected_bytes,
                actual_bytes: data.len() as u64,
            });
        }
        self.zip
            .add(&format!("{}/data/{storage}", self.archive), data)?;
        self.digest = fnv1a(self.digest, &crc32fast::hash(data).to_le_bytes());
        self.written += 1;
        Ok(())
    }

    /// Writes the trailing records and the zip directory; returns the inner writer.
    pub fn finish(mut self) -> Result<W, TorchSaveError> {
        if let (Some(written), Some((storage, spec))) = (self.part, self.next_storage()) {
            return Err(TorchSaveError::PartialStorage {
                storage,
                written,
                expected_bytes: spec.numel.saturating_mul(spec.dtype.size_bytes() as u64),
            });
        }
        if self.written != self.storages.len() {
            return Err(TorchSaveError::MissingStorages {
                written: self.written,
                storages: self.storages.len(),
            });
        }
        self.zip.add(&format!("{}/version", self.archive), b"3\n")?;
        let id = serialization_id(self.digest);
        self.zip.add(
            &format!("{}/.data/serialization_id", self.archive),
            id.as_bytes(),
        )?;
        Ok(self.zip.finish()?)
    }
}

impl<W: Write + Seek> TorchSaveWriter<W> {
    /// Writes `data` as the next bytes of the next storage (table order); the storage is complete,
    /// and the next one begins, once its declared `numel * itemsize` bytes are passed. Parts of any
    /// size (empty ones too) give the archive [`Self::write_storage`] writes: the member's CRC-32
    /// is computed as the parts pass and written into its header at the end (hence `Seek`).
    pub fn write_storage_part(&mut self, data: &[u8]) -> Result<(), TorchSaveError> {
        let (storage, spec) = self.next_storage().ok_or(TorchSaveError::TooManyStorages {
            storages: self.storages.len(),
        })?;
        let expected_bytes = spec.numel.saturating_mul(spec.dtype.size_bytes() as u64);
        let before = match self.part {
            Some(n) => n,
            // Whole in one part: nothing to seek.
            None if data.len() as u64 == expected_bytes => return self.write_storage(data),
            None => {
                self.zip
                    .begin(&format!("{}/data/{storage}", self.archive), expected_bytes)?;
                0
            }
        };
        let written = before.saturating_add(data.len() as u64);
        if written > expected_bytes {
            return Err(TorchSaveError::StorageLength {
                storage,
                expected_bytes,
                actual_bytes: written,
            });
        }
        self.zip.write_part(data)?;
        if written < expected_bytes {
            self.part = Some(written);
            return Ok(());
        }
        let crc = self.zip.end()?;
        self.digest = fnv1a(self.digest, &crc.to_le_bytes());
        self.part = None;
        self.written += 1;
        Ok(())
    }
}

/// A whole `torch.save` archive in memory (root folder `archive`): `storages[i]` is the dtype, element
/// count and bytes of storage `i`. Meant for small objects (DCP items, tests).
pub fn torch_save_to_vec(
    root: &PyValue,
    storages: &[(StorageSpec, &[u8])],
) -> Result<Vec<u8>, TorchSaveError> {
    let specs = storages.iter().map(|(spec, _)| *spec).collect();
    let mut writer = TorchSaveWriter::new(Vec::new(), "archive", root, specs)?;
    for (_, data) in storages {
        writer.write_storage(data)?;
    }
    writer.finish()
}

/// The archive `torch.save(tensor)` writes for one contiguous tensor (what a DCP tensor item holds).
pub fn tensor_to_vec(tensor: &super::TensorRef<'_>) -> Result<Vec<u8>, TorchSaveError> {
    let root = PyValue::Tensor(TensorPickle::contiguous(0, tensor.dtype, tensor.shape));
    let spec = StorageSpec {
        dtype: tensor.dtype,
        numel: tensor.numel(),
    };
    torch_save_to_vec(&root, &[(spec, tensor.data)])
}

fn check_globals(value: &PyValue) -> Result<(), TorchSaveError> {
    match value {
        PyValue::None
        | PyValue::Bool(_)
        | PyValue::Int(_)
        | PyValue::Float(_)
        | PyValue::Str(_)
        | PyValue::Tensor(_) => Ok(()),
        PyValue::Tuple(items) | PyValue::List(items) => items.iter().try_for_each(check_globals),
        PyValue::Dict(items) | PyValue::OrderedDict(items) => items
            .iter()
            .try_for_each(|(k, v)| check_globals(k).and_then(|()| check_globals(v))),
        PyValue::Global { module, name } => {
            // `_codecs.encode`: how protocol 2 stores `bytes`, which weights_only allows.
            let allowed = (module == "torch" && (name == "Size" || name.parse::<DType>().is_ok()))
                || (module == "_codecs" && name == "encode");
            if allowed {
                Ok(())
            } else {
                Err(TorchSaveError::GlobalNotAllowed {
                    module: module.clone(),
                    name: name.clone(),
                })
            }
        }
        PyValue::Call { func, args } => {
            check_globals(func)?;
            args.iter().try_for_each(check_globals)
        }
        PyValue::Object { class, .. } => match class.as_ref() {
            PyValue::Global { module, name } => Err(TorchSaveError::GlobalNotAllowed {
                module: module.clone(),
                name: name.clone(),
            }),
            _ => Err(TorchSaveError::GlobalNotAllowed {
                module: "<object>".to_owned(),
                name: "<class>".to_owned(),
            }),
        },
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// 40 decimal digits, like torch's ids, derived from the content digest.
fn serialization_id(digest: u64) -> String {
    let second = fnv1a(digest, b"shardscope");
    format!("{digest:020}{second:020}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storages_in_parts_give_the_same_archive() {
        let specs = vec![
            StorageSpec {
                dtype: DType::Float32,
                numel: 1000,
            },
            StorageSpec {
                dtype: DType::Int8,
                numel: 0,
            },
            StorageSpec {
                dtype: DType::BFloat16,
                numel: 777,
            },
        ];
        let root = PyValue::List(vec![
            PyValue::Tensor(TensorPickle::contiguous(0, DType::Float32, &[10, 100])),
            PyValue::Tensor(TensorPickle::contiguous(1, DType::Int8, &[0])),
            PyValue::Tensor(TensorPickle::contiguous(2, DType::BFloat16, &[777])),
        ]);
        let data: Vec<Vec<u8>> = [4000usize, 0, 1554]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 % 251) as u8).collect())
            .collect();
        let mut whole = TorchSaveWriter::new(Vec::new(), "m", &root, specs.clone()).unwrap();
        for d in &data {
            whole.write_storage(d).unwrap();
        }
        let whole = whole.finish().unwrap();
        // Parts of uneven sizes, empty ones included, into a writer that already holds bytes
        // (the archive's offsets are relative to its first byte; the seeks must be too).
        let prefix = b"not part of the archive";
        let mut out = std::io::Cursor::new(prefix.to_vec());
        out.set_position(prefix.len() as u64);
        let mut parts = TorchSaveWriter::new(&mut out, "m", &root, specs.clone()).unwrap();
        for d in &data {
            let mut rest = d.as_slice();
            for n in [0usize, 1, 999, 0, 64, 5000].iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (now, later) = rest.split_at((*n).min(rest.len()));
                parts.write_storage_part(now).unwrap();
                rest = later;
            }
            if d.is_empty() {
                parts.write_storage_part(&[]).unwrap();
            }
        }
        parts.finish().unwrap();
        let out = out.into_inner();
        assert_eq!(&out[..prefix.len()], prefix);
        assert_eq!(&out[prefix.len()..], whole.as_slice());

        // Too many bytes, a whole storage or the end while one is partly written: refused.
        let mut w =
            TorchSaveWriter::new(std::io::Cursor::new(Vec::new()), "m", &root, specs).unwrap();
        w.write_storage_part(&data[0][..10]).unwrap();
        assert!(matches!(
            w.write_storage_part(&data[0]),
            Err(TorchSaveError::StorageLength {
                actual_bytes: 4010,
                ..
            })
        ));
        assert!(matches!(
            w.write_storage(&data[0]),
            Err(TorchSaveError::PartialStorage { written: 10, .. })
        ));
        assert!(matches!(
            w.finish(),
            Err(TorchSaveError::PartialStorage {
                storage: 0,
                written: 10,
                expected_bytes: 4000
            })
        ));
    }

    #[test]
    fn storages_are_checked_and_counted() {
        let spec = StorageSpec {
            dtype: DType::Int64,
            numel: 2,
        };
        let root = PyValue::Tensor(TensorPickle::contiguous(0, DType::Int64, &[2]));
        let mut w = TorchSaveWriter::new(Vec::new(), "archive", &root, vec![spec]).unwrap();
        assert!(matches!(
            w.write_storage(&[0; 8]),
            Err(TorchSaveError::StorageLength {
                expected_bytes: 16,
                ..
            })
        ));
        w.write_storage(&[0; 16]).unwrap();
        assert!(matches!(
            w.write_storage(&[0; 16]),
            Err(TorchSaveError::TooManyStorages { .. })
        ));
        w.finish().unwrap();

        let w = TorchSaveWriter::new(Vec::new(), "archive", &root, vec![spec]).unwrap();
        assert!(matches!(
            w.finish(),
            Err(TorchSaveError::MissingStorages { written: 0, .. })
        ));
    }

    #[test]
    fn globals_outside_the_weights_only_allowlist_are_refused() {
        let evil = PyValue::call("os", "system", vec![PyValue::str("true")]);
        assert!(matches!(
            TorchSaveWriter::new(Vec::new(), "archive", &evil, vec![]),
            Err(TorchSaveError::GlobalNotAllowed { .. })
        ));
        let size = PyValue::call("torch", "Size", vec![PyValue::int_tuple(&[2, 3])]);
        assert!(TorchSaveWriter::new(Vec::new(), "archive", &size, vec![]).is_ok());
        assert!(matches!(
            TorchSaveWriter::new(Vec::new(), "a/b", &PyValue::None, vec![]),
            Err(TorchSaveError::BadArchiveName { .. })
        ));
    }

    #[test]
    fn serialization_id_has_forty_digits() {
        assert_eq!(serialization_id(0).len(), 40);
        assert_eq!(serialization_id(u64::MAX).len(), 40);
    }
}
