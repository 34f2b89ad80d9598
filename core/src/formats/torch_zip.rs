//! `torch.save` zip archives (`.pt`, `.bin`, `.pth`, and every DCP `.distcp` item).
//!
//! An archive holds `<prefix>/data.pkl` (the pickled object), `<prefix>/byteorder` and one member
//! `<prefix>/data/<key>` per storage. Members are stored uncompressed; this reader locates each
//! storage's byte range from the central directory (local headers carry zero sizes) and never
//! reads tensor bytes: [`read_archive`] touches the directory, `data.pkl` and `byteorder` only.

use std::collections::BTreeMap;
use std::io::{Cursor, Read, Seek};

use crate::formats::pickle::{self, PickleError, PyValue, TensorRef};

mod lazy;
pub use lazy::{ArchiveFileError, pickle_globals_from, read_archive_from, read_item_archive};

/// What went wrong while reading a torch archive.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TorchZipError {
    /// The bytes do not start like a zip archive (legacy pre-1.6 `torch.save` files are not read).
    #[error("{}", not_zip_text(head))]
    NotZip { head: Vec<u8> },
    /// The zip structure itself is broken (truncated, bad central directory).
    #[error("broken zip archive: {message}")]
    Zip { message: String },
    /// No `data.pkl` member.
    #[error("the archive has no data.pkl member")]
    NoPickle,
    /// A member that must be read (data.pkl, a storage) is compressed.
    #[error(
        "member `{member}` is compressed ({method}); torch archives store members uncompressed"
    )]
    Compressed { member: String, method: String },
    /// A member's byte range lies outside the archive.
    #[error("member `{member}` claims bytes {start}..{end} but the archive has {len} bytes")]
    MemberOutOfBounds {
        member: String,
        start: u64,
        end: u64,
        len: u64,
    },
    /// The archive says its storages are big-endian or something unknown.
    #[error("unsupported byte order `{order}` (only little-endian archives are read)")]
    ByteOrder { order: String },
    /// `data.pkl` could not be read.
    #[error("data.pkl: {source}")]
    Pickle {
        #[source]
        source: PickleError,
    },
    /// A tensor refers to a storage with no `data/<key>` member.
    #[error("tensor refers to storage `{key}` but the archive has no member data/{key}")]
    MissingStorage { key: String },
    /// A storage member is shorter than its pickled element count says.
    #[error("storage `{key}` holds {len} bytes but {numel} elements of {dtype} need {needed}")]
    StorageTooShort {
        key: String,
        dtype: String,
        numel: u64,
        len: u64,
        needed: u64,
    },
    /// A tensor view reaches past the end of its storage.
    #[error(
        "tensor view (offset {storage_offset}, shape {shape:?}, stride {stride:?}) reaches element {extent} of storage `{key}`, which has {numel}"
    )]
    ViewOutOfBounds {
        key: String,
        storage_offset: u64,
        shape: Vec<u64>,
        stride: Vec<u64>,
        extent: u64,
        numel: u64,
    },
    /// A tensor's bytes cannot be allocated (a broadcast view of a huge shape over a small
    /// storage, or less memory than the tensor needs).
    #[error("tensor over storage `{key}` needs {bytes} bytes, which cannot be allocated")]
    TooLarge { key: String, bytes: u64 },
}

/// The pickled magic number a legacy (non-zip) `torch.save` file starts with (after the pickle's
/// protocol and, from protocol 4, frame opcodes): `LONG1` of `0x1950a86a20f9469cfc6c`.
const LEGACY_TORCH_MAGIC: &[u8] = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";

/// True when `head` (a file's first 32 bytes or more) starts as a legacy `torch.save` file does.
pub fn looks_like_legacy_torch_save(head: &[u8]) -> bool {
    head.first() == Some(&0x80)
        && head
            .windows(LEGACY_TORCH_MAGIC.len())
            .any(|w| w == LEGACY_TORCH_MAGIC)
}

fn not_zip_text(head: &[u8]) -> String {
    if head.is_empty() {
        return "empty (0 bytes), not a torch.save archive (a copy or save that did not finish?)"
            .to_owned();
    }
    if head.starts_with(b"version https://git-lfs") {
        return "a Git LFS pointer file, not the checkpoint itself (`git lfs pull` fetches the file)"
            .to_owned();
    }
    if looks_like_legacy_torch_save(head) {
        return "a legacy torch.save file (a bare pickle, from torch < 1.6 or `_use_new_zipfile_serialization=False`), which is not supported: re-save it with a current torch".to_owned();
    }
    if let [0x80, protocol, ..] = head {
        return format!(
            "a pickle (protocol {protocol}), not a torch.save archive; shardscope never runs \
             pickles (`pickle.load` it in Python if you trust it)"
        );
    }
    let shown = &head[..head.len().min(8)];
    let hex: Vec<String> = shown.iter().map(|b| format!("{b:02x}")).collect();
    let text: String = shown
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        })
        .collect();
    format!(
        "not a torch.save zip archive (first bytes: {} \"{text}\")",
        hex.join(" ")
    )
}

/// The byte range of one storage member, relative to the start of the archive bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberRange {
    pub offset: u64,
    pub len: u64,
}

/// An opened archive: the pickled object and where each storage lives. No tensor bytes are read.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchArchive {
    /// The folder all members live in (`archive`, or the file stem).
    pub prefix: String,
    /// The pickled object (a state dict, an optimizer state dict, a tensor, a Python value).
    pub root: PyValue,
    /// Storage key -> byte range of `data/<key>`.
    pub storages: BTreeMap<String, MemberRange>,
    /// The pickle protocol of `data.pkl`.
    pub pickle_protocol: u8,
}

/// True when the bytes start with a zip local-file header.
pub fn looks_like_zip(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06")
}

/// Opens a torch archive held in `bytes` (a whole file, or one DCP item).
pub fn read_archive(bytes: &[u8]) -> Result<TorchArchive, TorchZipError> {
    let members = zip_members(bytes, |_| true)?;
    let layout = Layout::of(&members)?;
    let order = layout.byteorder.map(|r| slice(bytes, r));
    build_archive(&members, &layout, slice(bytes, layout.pkl), order)
}

/// Where [`build_archive`] finds what it reads: the member prefix, `data.pkl` and `byteorder`
/// (both checked to be stored uncompressed).
struct Layout {
    prefix: String,
    pkl: MemberRange,
    byteorder: Option<MemberRange>,
}

fn stored(name: &str, method: zip::CompressionMethod) -> Result<(), TorchZipError> {
    if method == zip::CompressionMethod::Stored {
        Ok(())
    } else {
        Err(TorchZipError::Compressed {
            member: name.to_owned(),
            method: format!("{method:?}"),
        })
    }
}

impl Layout {
    fn of(members: &Members) -> Result<Layout, TorchZipError> {
        let (pkl_name, pkl) = pickle_member(members).ok_or(TorchZipError::NoPickle)?;
        let prefix = pkl_name
            .strip_suffix("data.pkl")
            .unwrap_or("")
            .trim_end_matches('/')
            .to_owned();
        stored(&pkl_name, pkl.1)?;
        let byteorder = match members.get(&member_name(&prefix, "byteorder")) {
            Some((range, method)) => {
                stored("byteorder", *method)?;
                Some(*range)
            }
            None => None,
        };
        Ok(Layout {
            prefix,
            pkl: pkl.0,
            byteorder,
        })
    }
}

fn member_name(prefix: &str, suffix: &str) -> String {
    if prefix.is_empty() {
        suffix.to_owned()
    } else {
        format!("{prefix}/{suffix}")
    }
}

/// The archive from its directory and the bytes of `data.pkl` and `byteorder` (however they were
/// read: sliced from the whole file, or fetched by range).
fn build_archive(
    members: &Members,
    layout: &Layout,
    pkl_bytes: &[u8],
    byteorder: Option<&[u8]>,
) -> Result<TorchArchive, TorchZipError> {
    if let Some(order) = byteorder
        && order != b"little"
    {
        return Err(TorchZipError::ByteOrder {
            order: String::from_utf8_lossy(order).into_owned(),
        });
    }
    let pickle_protocol = match pkl_bytes {
        [0x80, p, ..] => *p,
        _ => 0,
    };
    let root = pickle::parse(pkl_bytes).map_err(|source| TorchZipError::Pickle { source })?;
    let data_prefix = member_name(&layout.prefix, "data/");
    let mut storages = BTreeMap::new();
    for (name, (range, method)) in members {
        if let Some(key) = name.strip_prefix(&data_prefix)
            && !key.is_empty()
            && !key.contains('/')
        {
            stored(name, *method)?;
            storages.insert(key.to_owned(), *range);
        }
    }
    let archive = TorchArchive {
        prefix: layout.prefix.clone(),
        root,
        storages,
        pickle_protocol,
    };
    archive.check_views()?;
    Ok(archive)
}

type Members = BTreeMap<String, (MemberRange, zip::CompressionMethod)>;

pub(crate) fn zip_error(e: &zip::result::ZipError) -> TorchZipError {
    TorchZipError::Zip {
        message: e.to_string(),
    }
}

/// The zip directory of `bytes`: every member `keep` accepts, with its data's byte range (checked
/// to lie inside `bytes`) and compression method. Only the central directory is read.
fn zip_members(bytes: &[u8], keep: impl Fn(&str) -> bool) -> Result<Members, TorchZipError> {
    if !looks_like_zip(bytes) {
        return Err(TorchZipError::NotZip {
            head: bytes.iter().take(32).copied().collect(),
        });
    }
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| zip_error(&e))?;
    archive_members(&mut archive, bytes.len() as u64, keep)
}

/// The members of an opened zip archive of `total` bytes (see [`zip_members`]); each member's
/// local header (its fixed 30 bytes) is read for the data offset.
fn archive_members<R: Read + Seek>(
    archive: &mut zip::ZipArchive<R>,
    total: u64,
    keep: impl Fn(&str) -> bool,
) -> Result<Members, TorchZipError> {
    let mut members: Members = BTreeMap::new();
    for i in 0..archive.len() {
        let file = archive.by_index_raw(i).map_err(|e| zip_error(&e))?;
        let name = file.name().map_err(|e| zip_error(&e))?.into_owned();
        if !keep(&name) {
            continue;
        }
        let start = file.data_start().ok_or_else(|| TorchZipError::Zip {
            message: format!("member `{name}` has no data offset"),
        })?;
        let len = file.compressed_size();
        let end = start.saturating_add(len);
        if end > total {
            return Err(TorchZipError::MemberOutOfBounds {
                member: name,
                start,
                end,
                len: total,
            });
        }
        members.insert(
            name,
            (MemberRange { offset: start, len }, file.compression()),
        );
    }
    Ok(members)
}

/// The pickle member: `<prefix>/data.pkl` where prefix has no further `/`, or `data.pkl`.
fn pickle_member(members: &Members) -> Option<(String, (MemberRange, zip::CompressionMethod))> {
    members
        .iter()
        .find(|(n, _)| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .or_else(|| members.iter().find(|(n, _)| n.as_str() == "data.pkl"))
        .map(|(n, r)| (n.clone(), *r))
}

/// The globals `data.pkl` of the archive in `bytes` names ([`pickle::globals`]): what
/// `torch.load(weights_only=False)` would import and may call. Nothing is imported or run here.
pub fn pickle_globals(bytes: &[u8]) -> Result<Vec<pickle::Global>, TorchZipError> {
    let members = zip_members(bytes, |name| name.ends_with("data.pkl"))?;
    let (name, (range, method)) = pickle_member(&members).ok_or(TorchZipError::NoPickle)?;
    stored(&name, method)?;
    pickle::globals(slice(bytes, range)).map_err(|source| TorchZipError::Pickle { source })
}

fn slice(bytes: &[u8], r: MemberRange) -> &[u8] {
    // Ranges were checked against `bytes.len()` when members were listed.
    &bytes[r.offset as usize..(r.offset + r.len) as usize]
}

impl TorchArchive {
    /// Every tensor view in the pickle (plain, Parameter, ShardedTensor local shards, DTensor
    /// locals), in pickle order.
    pub fn tensors(&self) -> Vec<&TensorRef> {
        let mut out = Vec::new();
        collect_tensors(&self.root, &mut out);
        out
    }

    /// Checks every tensor: its storage member exists, is long enough for the pickled element
    /// count, and the view stays inside the storage.
    pub fn check_views(&self) -> Result<(), TorchZipError> {
        for t in self.tensors() {
            self.check_view(t)?;
        }
        Ok(())
    }

    fn check_view(&self, t: &TensorRef) -> Result<MemberRange, TorchZipError> {
        let s = &t.storage;
        let range = *self
            .storages
            .get(&s.key)
            .ok_or_else(|| TorchZipError::MissingStorage { key: s.key.clone() })?;
        let needed = s.numel.checked_mul(s.dtype.size_bytes() as u64);
        if needed.is_none_or(|n| n > range.len) {
            return Err(TorchZipError::StorageTooShort {
                key: s.key.clone(),
                dtype: s.dtype.to_string(),
                numel: s.numel,
                len: range.len,
                needed: needed.unwrap_or(u64::MAX),
            });
        }
        let extent = t.storage_extent();
        if extent.is_none_or(|e| e > s.numel) {
            return Err(TorchZipError::ViewOutOfBounds {
                key: s.key.clone(),
                storage_offset: t.storage_offset,
                shape: t.shape.clone(),
                stride: t.stride.clone(),
                extent: extent.unwrap_or(u64::MAX),
                numel: s.numel,
            });
        }
        Ok(range)
    }

    /// The bytes range of a tensor's storage member.
    pub fn storage_range(&self, t: &TensorRef) -> Result<MemberRange, TorchZipError> {
        self.check_view(t)
    }
}

fn collect_tensors<'a>(v: &'a PyValue, out: &mut Vec<&'a TensorRef>) {
    match v {
        PyValue::Tensor(t) => out.push(t),
        PyValue::ShardedTensor(st) => out.extend(st.local_shards.iter().map(|s| &s.tensor)),
        PyValue::DTensor(d) => out.push(&d.local),
        PyValue::Tuple(items) | PyValue::List(items) | PyValue::Set(items) => {
            for i in items {
                collect_tensors(i, out);
            }
        }
        PyValue::Dict(items) => {
            for (k, i) in items {
                collect_tensors(k, out);
                collect_tensors(i, out);
            }
        }
        PyValue::Object(o) => {
            for a in &o.args {
                collect_tensors(a, out);
            }
            if let Some(s) = &o.state {
                collect_tensors(s, out);
            }
            for i in &o.list_items {
                collect_tensors(i, out);
            }
            for (k, i) in &o.dict_items {
                collect_tensors(k, out);
                collect_tensors(i, out);
            }
        }
        _ => {}
    }
}

/// Copies a strided view out of its storage bytes into contiguous little-endian bytes.
/// `storage` is the storage member's bytes; the view must have been checked
/// ([`TorchArchive::check_views`]) against it.
pub fn gather_view(storage: &[u8], t: &TensorRef) -> Result<Vec<u8>, TorchZipError> {
    let item = t.storage.dtype.size_bytes();
    let too_short = || TorchZipError::ViewOutOfBounds {
        key: t.storage.key.clone(),
        storage_offset: t.storage_offset,
        shape: t.shape.clone(),
        stride: t.stride.clone(),
        extent: t.storage_extent().unwrap_or(u64::MAX),
        numel: (storage.len() / item.max(1)) as u64,
    };
    let extent = t.storage_extent().ok_or_else(too_short)?;
    if extent
        .checked_mul(item as u64)
        .is_none_or(|b| b > storage.len() as u64)
    {
        return Err(too_short());
    }
    let numel = usize::try_from(t.numel().ok_or_else(too_short)?).map_err(|_| too_short())?;
    // A stride-0 view may have far more elements than its storage: allocate what it needs, or
    // say that it cannot be (never abort).
    let too_large = || TorchZipError::TooLarge {
        key: t.storage.key.clone(),
        bytes: (numel as u64).saturating_mul(item as u64),
    };
    let mut out = Vec::new();
    out.try_reserve_exact(numel.checked_mul(item).ok_or_else(too_large)?)
        .map_err(|_| too_large())?;
    if numel == 0 {
        return Ok(out);
    }
    if t.is_contiguous() {
        let start = t.storage_offset as usize * item;
        out.extend_from_slice(&storage[start..start + numel * item]);
        return Ok(out);
    }
    let ndim = t.shape.len();
    let mut index = vec![0u64; ndim];
    for _ in 0..numel {
        let pos = t.storage_offset + index.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<u64>();
        let start = pos as usize * item;
        out.extend_from_slice(&storage[start..start + item]);
        for d in (0..ndim).rev() {
            index[d] += 1;
            if index[d] < t.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod not_zip_tests {
    use super::not_zip_text;

    #[test]
    fn a_file_that_is_not_a_zip_is_named_for_what_it_is() {
        let lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:ab";
        assert!(
            not_zip_text(lfs).contains("Git LFS pointer")
                && not_zip_text(lfs).contains("git lfs pull")
        );
        // torch.save(..., _use_new_zipfile_serialization=False) starts with a pickle protocol byte.
        // torch.save(..., _use_new_zipfile_serialization=False): the pickled magic number first.
        let legacy = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.";
        assert!(not_zip_text(legacy).contains("legacy torch.save file"));
        // Any other pickle (a raw item holding `pickle.dumps` bytes) is named as one.
        let plain = not_zip_text(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}");
        assert!(
            plain.starts_with("a pickle (protocol 4), not a torch.save archive"),
            "{plain}"
        );
        assert_eq!(
            not_zip_text(b"<html>\n\x00"),
            "not a torch.save zip archive (first bytes: 3c 68 74 6d 6c 3e 0a 00 \"<html>..\")"
        );
        assert!(not_zip_text(b"").contains("empty (0 bytes)"));
    }
}
