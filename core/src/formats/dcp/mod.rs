//! `torch.distributed.checkpoint` directories: the `.metadata` pickle and the items of the
//! `__{rank}_{k}.distcp` files (each a standalone `torch.save` archive, or, in the SAFETENSORS
//! serialization, one safetensors blob per file).
//!
//! A `.metadata` is read two ways. [`read_metadata`] runs the general pickle machine over the whole
//! file into a [`DcpMetadata`] (every field, every record; errors name what is wrong).
//! [`read_table`] streams it from a [`crate::source::Source`] straight into the compact
//! [`MetadataTable`] the index is built from (a million chunks in about 80 bytes each, the file
//! never held whole) and gives up ([`Unrecognised`]) on anything but the shapes torch writes; the
//! index then falls back to [`read_metadata`] and [`MetadataTable::from_metadata`], so both paths
//! give the same table for every file the streaming one reads.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::dtype::DType;
use crate::formats::pickle::{self, AttrCache, ObjRef, PickleError, PyRef};

mod stream;
#[cfg(test)]
mod stream_tests;
mod table;
#[cfg(test)]
pub(crate) mod test_pickle;
mod values;
mod window;

pub use stream::read_table;
pub use table::{ChunkPlace, MetadataTable, TableChunk, TableItem, TableItemKind};
pub use window::Unrecognised;

/// What went wrong while reading DCP metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DcpError {
    /// `.metadata` is not a readable pickle.
    #[error(".metadata: {source}")]
    Pickle {
        #[source]
        source: PickleError,
    },
    /// The pickle is not a `Metadata` object or a field has the wrong shape.
    #[error(".metadata: {what}")]
    Malformed { what: String },
}

fn malformed(what: impl Into<String>) -> DcpError {
    DcpError::Malformed { what: what.into() }
}

/// One step of a `planner_data` path: a dict key or a list index.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum PlannerStep {
    Key(String),
    Index(i64),
}

/// One saved chunk of a tensor (`ChunkStorageMetadata`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// `state_dict_metadata[key]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemMeta {
    /// `TensorStorageMetadata`.
    Tensor {
        dtype: DType,
        size: Vec<u64>,
        chunks: Vec<ChunkMeta>,
    },
    /// `BytesStorageMetadata`: a non-tensor value saved with `torch.save`.
    Bytes,
}

/// A key of `storage_data` (`MetadataIndex`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageIndex {
    /// Shared by the records of one item (a `.metadata` holds a record per chunk).
    pub fqn: Arc<str>,
    /// Chunk offsets for tensors, `None` for bytes items.
    pub offset: Option<Box<[u64]>>,
    /// Lookup hint: the position in `chunks`.
    pub index: Option<u64>,
}

/// Where an item lives (`_StorageInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageInfo {
    /// Shared by the records of one data file.
    pub relative_path: Arc<str>,
    pub offset: u64,
    pub length: u64,
    /// `transform_descriptors`: the stream transform extensions the item's bytes went through
    /// when saved, in the order they were applied (`["stream.zstd/1"]`); empty when none.
    pub transforms: Vec<String>,
}

/// The `.metadata` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpMetadata {
    /// `state_dict_metadata`, in file order.
    pub items: Vec<(String, ItemMeta)>,
    /// `planner_data`: flattened key -> original path.
    pub planner_data: BTreeMap<String, Vec<PlannerStep>>,
    /// `storage_data`, in file order.
    pub storage: Vec<(StorageIndex, StorageInfo)>,
    pub version: Option<String>,
    /// `storage_meta.checkpoint_id` (the absolute path it was saved to).
    pub checkpoint_id: Option<String>,
    pub save_id: Option<String>,
    /// Every global the pickle names (what `pickle.load` in torch's reader would import).
    pub globals: Vec<pickle::Global>,
}

fn as_object<'a>(v: PyRef<'a>, expected: &str) -> Result<ObjRef<'a>, DcpError> {
    match v.object() {
        Some(o) if o.class().is_some_and(|g| g.name == expected) => Ok(o),
        _ => Err(malformed(format!(
            "expected {expected}, found {}",
            v.type_name()
        ))),
    }
}

fn is_class(v: PyRef<'_>, name: &str) -> bool {
    v.object()
        .and_then(|o| o.class())
        .is_some_and(|g| g.name == name)
}

fn u64_of(v: Option<PyRef<'_>>, what: &str) -> Result<u64, DcpError> {
    v.and_then(|v| v.as_i64())
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| malformed(format!("{what} is not a non-negative int")))
}

fn string_of(v: PyRef<'_>) -> Option<String> {
    if let Some(s) = v.as_str() {
        return Some(s.to_owned());
    }
    // `pathlib.PosixPath('/a/b')` pickles as REDUCE(PosixPath, ('/a/b',)) or with its parts.
    let o = v.object()?;
    if !o.class()?.name.ends_with("Path") {
        return None;
    }
    let parts: Vec<&str> = o.arg_items()?.filter_map(|p| p.as_str()).collect();
    Some(join_path_parts(&parts))
}

/// The path a `pathlib` path's parts make.
fn join_path_parts(parts: &[&str]) -> String {
    parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i == 0 {
                (*p).to_owned()
            } else {
                p.trim_start_matches('/').to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("/")
        .replace("//", "/")
}

/// A `_StorageInfo.relative_path` that stays inside the checkpoint folder.
fn storage_path_is_safe(path: &str) -> bool {
    !(path.contains("..") || path.starts_with('/') || path.is_empty())
}

/// Parses the bytes of a `.metadata` file. The pickle is read as a node arena and DCP's classes
/// are taken from it directly (no intermediate value tree: `.metadata` files of large jobs hold
/// hundreds of thousands of objects).
pub fn read_metadata(bytes: &[u8]) -> Result<DcpMetadata, DcpError> {
    let arena = pickle::parse_arena(bytes).map_err(|source| DcpError::Pickle { source })?;
    let root = arena.root();
    let meta = as_object(root, "Metadata").map_err(|_| {
        malformed(format!(
            "the pickle holds a {}, not a DCP Metadata object",
            root.type_name()
        ))
    })?;
    // Both `state_dict_metadata` and `storage_data` hold a record per chunk. Where a thread can
    // be started, it reads the first part of `storage_data` while this one reads
    // `state_dict_metadata` and then the rest (a storage record costs about twice a chunk
    // record); errors are reported in file order regardless.
    // A `storage_data` that is not a dict is reported after the fields before it.
    let storage_field = storage_data(meta);
    let records = storage_field.as_ref().ok().copied().flatten();
    let storage_len = records.and_then(PyRef::dict_items).map_or(0, |r| r.len());
    let split = storage_len / 4 * 3;
    let (items, storage) = std::thread::scope(|s| {
        let first = std::thread::Builder::new()
            .name("dcp-storage-data".into())
            .spawn_scoped(s, || storage_records(records, 0..split));
        let items = state_dict_items(meta);
        let (first, rest) = match first {
            Ok(handle) => {
                let rest = storage_records(records, split..storage_len);
                let first = handle
                    .join()
                    .unwrap_or_else(|_| Err(malformed("reading storage_data failed")));
                (first, rest)
            }
            Err(_) => (Ok(Vec::new()), storage_records(records, 0..storage_len)),
        };
        let storage = first.and_then(|mut first| {
            first.extend(rest?);
            Ok(first)
        });
        (items, storage)
    });
    let items = items?;
    let mut planner_data = BTreeMap::new();
    if let Some(pd) = meta.attr("planner_data").and_then(PyRef::dict_items) {
        for (k, v) in pd {
            let (Some(key), Some(path)) = (k.as_str(), v.items()) else {
                return Err(malformed("planner_data is not a dict of str -> tuple"));
            };
            let steps = path
                .map(|s| {
                    if let Some(k) = s.as_str() {
                        Ok(PlannerStep::Key(k.to_owned()))
                    } else if let (Some(i), None) = (s.as_i64(), s.object()) {
                        Ok(PlannerStep::Index(i))
                    } else {
                        Err(malformed(format!(
                            "planner_data[{key:?}] has a {} step",
                            s.type_name()
                        )))
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            planner_data.insert(key.to_owned(), steps);
        }
    }
    storage_field?;
    let storage = storage?;
    let version = meta
        .attr("version")
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    let (checkpoint_id, save_id) = match meta.attr("storage_meta").and_then(|v| v.object()) {
        Some(sm) => (
            sm.attr("checkpoint_id").and_then(string_of),
            sm.attr("save_id")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
        ),
        None => (None, None),
    };
    Ok(DcpMetadata {
        items,
        planner_data,
        storage,
        version,
        checkpoint_id,
        save_id,
        globals: arena.globals(),
    })
}

/// `Metadata.state_dict_metadata`, in file order.
fn state_dict_items(meta: ObjRef<'_>) -> Result<Vec<(String, ItemMeta)>, DcpError> {
    let sdm = meta
        .attr("state_dict_metadata")
        .ok_or_else(|| malformed("Metadata has no state_dict_metadata"))?;
    let sdm = sdm
        .dict_items()
        .ok_or_else(|| malformed("state_dict_metadata is not a dict"))?;
    let mut items = Vec::with_capacity(sdm.len());
    let mut chunk_keys = AttrCache::new();
    for (k, v) in sdm {
        let key = k
            .as_str()
            .ok_or_else(|| malformed("a state_dict_metadata key is not a string"))?
            .to_owned();
        let item = if is_class(v, "BytesStorageMetadata") {
            ItemMeta::Bytes
        } else if let Ok(o) = as_object(v, "TensorStorageMetadata") {
            tensor_meta(&key, o, &mut chunk_keys)?
        } else {
            return Err(malformed(format!(
                "state_dict_metadata[{key:?}] is a {}, not tensor or bytes metadata",
                v.type_name()
            )));
        };
        items.push((key, item));
    }
    Ok(items)
}

/// `Metadata.storage_data` as a dict (`None` when it is absent or `None`).
fn storage_data(meta: ObjRef<'_>) -> Result<Option<PyRef<'_>>, DcpError> {
    match meta.attr("storage_data") {
        Some(sd) if sd.dict_items().is_some() => Ok(Some(sd)),
        Some(sd) if sd.is_none() => Ok(None),
        Some(sd) => Err(malformed(format!("storage_data is a {}", sd.type_name()))),
        None => Ok(None),
    }
}

/// The records `range` of `storage_data`, in file order.
fn storage_records(
    records: Option<PyRef<'_>>,
    range: std::ops::Range<usize>,
) -> Result<Vec<(StorageIndex, StorageInfo)>, DcpError> {
    let Some(records) = records.and_then(PyRef::dict_items) else {
        return Ok(Vec::new());
    };
    let mut storage = Vec::with_capacity(range.len());
    let (mut index_keys, mut info_keys) = (AttrCache::new(), AttrCache::new());
    let mut names = Interner::default();
    for (k, v) in records.skip(range.start).take(range.len()) {
        storage.push((
            storage_index(k, &mut index_keys, &mut names)?,
            storage_info(v, &mut info_keys, &mut names)?,
        ));
    }
    Ok(storage)
}

/// One shared `Arc<str>` per distinct text: the records of a tensor's chunks name the same fqn,
/// and those of a rank the same file (a million records, a few thousand names).
#[derive(Default)]
struct Interner<'a> {
    names: HashMap<&'a str, Arc<str>, foldhash::fast::RandomState>,
}

impl<'a> Interner<'a> {
    fn get(&mut self, text: &'a str) -> Arc<str> {
        Arc::clone(self.names.entry(text).or_insert_with(|| Arc::from(text)))
    }
}

/// `what` names the field in the error; it is built only when the field is not a `torch.Size`
/// (a `.metadata` of a large job holds hundreds of thousands of chunk records).
fn dims(v: Option<PyRef<'_>>, what: impl FnOnce() -> String) -> Result<Vec<u64>, DcpError> {
    v.and_then(|v| v.as_dims())
        .ok_or_else(|| malformed(format!("{} is not a torch.Size", what())))
}

fn tensor_meta(
    key: &str,
    o: ObjRef<'_>,
    chunk_keys: &mut AttrCache<2>,
) -> Result<ItemMeta, DcpError> {
    let props = o
        .attr("properties")
        .ok_or_else(|| malformed(format!("{key}: no properties")))?;
    // TensorProperties pickles its state as a tuple whose first element is the dtype; older
    // releases used a dict state.
    let dtype_ref = props.object().and_then(|p| {
        let state = p.state()?;
        match state.items() {
            Some(mut it) => it.next(),
            None => p.attr("dtype"),
        }
    });
    let Some(dtype) = dtype_ref.and_then(|d| d.dtype()) else {
        return Err(match dtype_ref.and_then(|d| d.global()) {
            Some(g) if g.module == "torch" => malformed(format!(
                "{key}: dtype torch.{} is not one shardscope reads",
                g.name
            )),
            _ => malformed(format!("{key}: properties hold no torch dtype")),
        });
    };
    let size = dims(o.attr("size"), || format!("{key}: size"))?;
    let chunk_list = o
        .attr("chunks")
        .and_then(PyRef::items)
        .ok_or_else(|| malformed(format!("{key}: no chunk list")))?;
    let mut chunks = Vec::with_capacity(chunk_list.len());
    for c in chunk_list {
        let c = as_object(c, "ChunkStorageMetadata")?;
        let [offsets, sizes] = c.attrs_cached(chunk_keys, ["offsets", "sizes"]);
        let offsets = dims(offsets, || format!("{key}: chunk offsets"))?;
        let sizes = dims(sizes, || format!("{key}: chunk sizes"))?;
        if offsets.len() != size.len() || sizes.len() != size.len() {
            return Err(malformed(format!(
                "{key}: chunk offsets {offsets:?} / sizes {sizes:?} do not match the {}-dim size",
                size.len()
            )));
        }
        chunks.push(ChunkMeta { offsets, sizes });
    }
    Ok(ItemMeta::Tensor {
        dtype,
        size,
        chunks,
    })
}

fn storage_index<'a>(
    v: PyRef<'a>,
    keys: &mut AttrCache<3>,
    names: &mut Interner<'a>,
) -> Result<StorageIndex, DcpError> {
    let o = as_object(v, "MetadataIndex")?;
    let [fqn, offset, index] = o.attrs_cached(keys, ["fqn", "offset", "index"]);
    let fqn = names.get(
        fqn.and_then(|f| f.as_str())
            .ok_or_else(|| malformed("MetadataIndex without fqn"))?,
    );
    let offset = match offset {
        None => None,
        Some(x) if x.is_none() => None,
        Some(x) => Some(
            x.as_dims()
                .ok_or_else(|| {
                    malformed(format!("MetadataIndex({fqn}).offset is not a torch.Size"))
                })?
                .into_boxed_slice(),
        ),
    };
    let index = match index {
        None => None,
        Some(x) if x.is_none() => None,
        Some(x) => Some(u64_of(Some(x), "MetadataIndex.index")?),
    };
    Ok(StorageIndex { fqn, offset, index })
}

fn storage_info<'a>(
    v: PyRef<'a>,
    keys: &mut AttrCache<4>,
    names: &mut Interner<'a>,
) -> Result<StorageInfo, DcpError> {
    let o = as_object(v, "_StorageInfo")?;
    let [relative_path, offset, length, transforms] = o.attrs_cached(
        keys,
        ["relative_path", "offset", "length", "transform_descriptors"],
    );
    let relative_path = names.get(
        relative_path
            .and_then(|p| p.as_str())
            .ok_or_else(|| malformed("_StorageInfo without relative_path"))?,
    );
    if !storage_path_is_safe(&relative_path) {
        return Err(malformed(format!(
            "_StorageInfo.relative_path {relative_path:?} leaves the checkpoint folder"
        )));
    }
    let transforms = match transforms {
        None => Vec::new(),
        Some(t) if t.is_none() => Vec::new(),
        Some(t) => t
            .items()
            .and_then(|it| {
                it.map(|d| d.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                malformed(format!(
                    "_StorageInfo({relative_path}).transform_descriptors is a {}, not a list of str",
                    t.type_name()
                ))
            })?,
    };
    Ok(StorageInfo {
        offset: u64_of(offset, "_StorageInfo.offset")?,
        length: u64_of(length, "_StorageInfo.length")?,
        transforms,
        relative_path,
    })
}

/// A stream transform of DCP items that shardscope can undo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemTransform {
    /// `stream.zstd/1` (`torch.distributed.checkpoint._extension.ZStandard`): the item's bytes are
    /// one zstd frame.
    Zstd,
}

/// Reads `transform_descriptors` as torch's `ExtensionRegistry.from_descriptor_list` does
/// (`name[@domain]/version`, version major `1`). An empty list means the bytes are stored as they
/// are. Any extension other than `stream.zstd/1`, or several stacked ones, is refused with an error
/// naming it.
pub fn item_transform(descriptors: &[String]) -> Result<Option<ItemTransform>, String> {
    match descriptors {
        [] => Ok(None),
        [one] => {
            let (name, version) = one.split_once('/').unwrap_or((one.as_str(), ""));
            if name == "stream.zstd" && version.split('.').next() == Some("1") {
                Ok(Some(ItemTransform::Zstd))
            } else if name == "stream.zstd" {
                Err(format!(
                    "the item uses the transform extension `{one}`: version {version:?} of stream.zstd is unknown (only version 1 is supported)"
                ))
            } else {
                Err(format!(
                    "the item uses the transform extension `{one}`, which shardscope cannot read (only `stream.zstd/1` is supported)"
                ))
            }
        }
        several => Err(format!(
            "the item uses the stacked transform extensions {several:?}; shardscope reads only a single `stream.zstd/1`"
        )),
    }
}

/// The largest output one byte of zstd input can produce: a block decodes to at most 128 KiB and
/// the smallest block (an RLE block) takes 4 bytes (3-byte header + the repeated byte).
pub const ZSTD_MAX_EXPANSION: u64 = 128 * 1024 / 4;

/// The zstd window shardscope accepts whatever the item size: that of zstd's levels up to 19
/// (`windowLog` 23). A frame with a larger window is accepted only when the item may be that large.
pub const ZSTD_DEFAULT_MAX_WINDOW: u64 = 8 << 20;

/// Why a zstd item could not be decompressed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZstdError {
    /// The bytes are not a valid zstd frame (bad magic, corrupt block, truncated stream).
    #[error("corrupt zstd stream: {message}")]
    Corrupt { message: String },
    /// The frame decompresses to more bytes than the metadata justifies.
    #[error("the zstd stream decompresses to more than the {limit} bytes the metadata justifies")]
    TooLarge { limit: u64 },
}

/// Decompresses the single zstd frame in `compressed` (bytes after the frame are ignored, as
/// torch's `ZstdDecompressor().stream_reader` does). At most `limit` bytes are produced: a frame
/// that declares, or decodes to, more is refused before more than `limit` bytes (or the frame's
/// window, at most `max(limit, ZSTD_DEFAULT_MAX_WINDOW)`) are held in memory.
pub fn decompress_zstd(compressed: &[u8], limit: u64) -> Result<Vec<u8>, ZstdError> {
    use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};
    let corrupt = |e: &dyn std::fmt::Display| ZstdError::Corrupt {
        message: e.to_string(),
    };
    let too_large = ZstdError::TooLarge { limit };
    let mut source = compressed;
    let mut decoder = FrameDecoder::new();
    decoder.set_max_window_size(limit.max(ZSTD_DEFAULT_MAX_WINDOW));
    decoder.init(&mut source).map_err(|e| corrupt(&e))?;
    // The frame content size, when the frame declares one (0 otherwise).
    if decoder.content_size() > limit {
        return Err(too_large);
    }
    let mut out = Vec::new();
    loop {
        // One block (at most 128 KiB) at a time; the decoder keeps at most its window besides.
        let finished = decoder
            .decode_blocks(&mut source, BlockDecodingStrategy::UptoBlocks(1))
            .map_err(|e| corrupt(&e))?;
        if let Some(bytes) = decoder.collect() {
            if (out.len() as u64).saturating_add(bytes.len() as u64) > limit {
                return Err(too_large);
            }
            out.extend_from_slice(&bytes);
        }
        if finished && decoder.is_finished() {
            break;
        }
    }
    if let Some(bytes) = decoder.collect() {
        if (out.len() as u64).saturating_add(bytes.len() as u64) > limit {
            return Err(too_large);
        }
        out.extend_from_slice(&bytes);
    }
    if let (Some(stored), Some(computed)) = (
        decoder.get_checksum_from_data(),
        decoder.get_calculated_checksum(),
    ) && stored != computed
    {
        return Err(ZstdError::Corrupt {
            message: format!(
                "content checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            ),
        });
    }
    let declared = decoder.content_size();
    if declared != 0 && declared != out.len() as u64 {
        return Err(ZstdError::Corrupt {
            message: format!(
                "the frame declares {declared} bytes but decodes to {}",
                out.len()
            ),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// `zstandard.ZstdCompressor().compress(b"hello hello hello hello")` (content size and no
    /// checksum, python-zstandard 0.25).
    const HELLO: &[u8] = &[
        0x28, 0xb5, 0x2f, 0xfd, 0x20, 0x17, 0x65, 0x00, 0x00, 0x30, 0x68, 0x65, 0x6c, 0x6c, 0x6f,
        0x20, 0x01, 0x00, 0x99, 0x4b, 0x11,
    ];

    #[test]
    fn transform_descriptors() {
        assert_eq!(item_transform(&[]), Ok(None));
        assert_eq!(
            item_transform(&["stream.zstd/1".into()]),
            Ok(Some(ItemTransform::Zstd))
        );
        let err = item_transform(&["stream.rot13/1".into()]).unwrap_err();
        assert!(err.contains("`stream.rot13/1`"), "{err}");
        assert!(item_transform(&["stream.zstd/2".into()]).is_err());
        assert!(item_transform(&["stream.zstd/1".into(), "stream.zstd/1".into()]).is_err());
    }

    #[test]
    fn zstd_limits_and_corruption() {
        assert!(matches!(
            decompress_zstd(b"not zstd at all", 100),
            Err(ZstdError::Corrupt { .. })
        ));
        assert!(matches!(
            decompress_zstd(&[], 100),
            Err(ZstdError::Corrupt { .. })
        ));
    }

    #[test]
    fn zstd_round_trip_of_a_known_frame() {
        assert_eq!(
            decompress_zstd(HELLO, 1000).as_deref(),
            Ok(&b"hello hello hello hello"[..])
        );
        // The declared content size (23) is over the limit: refused before decoding.
        assert_eq!(
            decompress_zstd(HELLO, 5),
            Err(ZstdError::TooLarge { limit: 5 })
        );
        // A truncated frame.
        assert!(matches!(
            decompress_zstd(&HELLO[..HELLO.len() - 3], 1000),
            Err(ZstdError::Corrupt { .. })
        ));
    }

    #[test]
    fn zstd_bomb_is_refused_within_its_limit() {
        // 16 MiB of zeros in a frame of a few KiB (streamed: no declared content size).
        let zeros = std::io::repeat(0).take(16 << 20);
        let bomb =
            ruzstd::encoding::compress_to_vec(zeros, ruzstd::encoding::CompressionLevel::Fastest);
        assert!(bomb.len() < 64 << 10, "{} bytes", bomb.len());
        assert_eq!(
            decompress_zstd(&bomb, 1 << 20),
            Err(ZstdError::TooLarge { limit: 1 << 20 })
        );
        assert_eq!(
            decompress_zstd(&bomb, 16 << 20).map(|v| v.len()),
            Ok(16 << 20)
        );
    }

    /// Robustness of the `.metadata` reader on untrusted bytes: every torch-written `.metadata` in
    /// the repository parses; every truncation of one is an error; no byte flip panics.
    pub(super) mod robustness {
        use super::super::*;
        use std::path::PathBuf;

        /// Every `.metadata` under `tests/fixtures` and `examples`, sorted by path.
        pub(in crate::formats::dcp) fn fixtures() -> Vec<(PathBuf, Vec<u8>)> {
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let mut out = Vec::new();
            let mut stack = vec![root.join("tests/fixtures"), root.join("examples")];
            while let Some(dir) = stack.pop() {
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for e in entries.flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if p.file_name().is_some_and(|n| n == ".metadata") {
                        let bytes = std::fs::read(&p).unwrap();
                        out.push((p, bytes));
                    }
                }
            }
            out.sort();
            assert!(
                out.len() >= 5,
                "expected the torch-written DCP fixtures, found {}",
                out.len()
            );
            out
        }

        #[test]
        fn fixtures_parse() {
            for (path, bytes) in fixtures() {
                let meta =
                    read_metadata(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(!meta.items.is_empty(), "{}", path.display());
                assert!(!meta.storage.is_empty(), "{}", path.display());
                for (_, item) in &meta.items {
                    if let ItemMeta::Tensor { size, chunks, .. } = item {
                        for c in chunks {
                            assert_eq!(c.offsets.len(), size.len());
                        }
                    }
                }
            }
        }

        #[test]
        fn every_truncation_is_an_error() {
            for (path, bytes) in fixtures() {
                // Every prefix of the small files; a stride through the large ones (debug builds).
                let step = (bytes.len() / 1024).max(1);
                for n in (0..bytes.len()).step_by(step) {
                    assert!(
                        read_metadata(&bytes[..n]).is_err(),
                        "{}: the first {n} of {} bytes parsed",
                        path.display(),
                        bytes.len()
                    );
                }
            }
        }

        #[test]
        fn byte_flips_never_panic() {
            // Deterministic xorshift: single-byte replacements at every position of the small
            // fixtures (a stride through large ones), then bursts of random bytes.
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut errors = 0usize;
            let mut parsed = 0usize;
            for (_, bytes) in fixtures() {
                let step = (bytes.len() / 512).max(1);
                for i in (0..bytes.len()).step_by(step) {
                    for v in [0x00, bytes[i] ^ 0x80, bytes[i].wrapping_add(1)] {
                        let mut b = bytes.clone();
                        b[i] = v;
                        match read_metadata(&b) {
                            Ok(_) => parsed += 1,
                            Err(e) => {
                                assert!(!e.to_string().is_empty());
                                errors += 1;
                            }
                        }
                    }
                }
                for _ in 0..100 {
                    let mut b = bytes.clone();
                    for _ in 0..=(next() % 8) {
                        let at = (next() % b.len() as u64) as usize;
                        b[at] = next() as u8;
                    }
                    let _ = read_metadata(&b);
                }
            }
            // Both outcomes occur: a flip inside a string or an int still parses, a flipped
            // opcode does not. (A reader that refused everything would also "not panic".)
            assert!(errors > 0 && parsed > 0, "{errors} errors, {parsed} parsed");
        }
    }
}
