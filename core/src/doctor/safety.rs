//! `unsafe-pickle` findings for the pickles torch's loaders unpickle with no restriction: a DCP
//! `.metadata` (`FileSystemReader.read_metadata` calls `pickle.load`), a DCP bytes item inside a
//! `.distcp` file (`DefaultLoadPlanner.load_bytes` calls `torch.load(weights_only=False)`) and a
//! `torch_checkpointing` `metadata.pkl` (a plain `pickle.load`). Each file's globals are scanned
//! on their own (pass 1 of the pickle machine, as far as the pickle goes: nothing is imported or
//! run), so the finding is there even when the rest of the checkpoint cannot be read.

use crate::formats::pickle::{self, Global};
use crate::formats::{self, dcp, torch_zip};
use crate::index::{CheckpointIndex, ChunkEncoding, EntryKind, Format};
use crate::source::Source;

use super::pickle_globals::{torch_own, weights_only_allows};
use super::report::{Finding, Severity};
use super::text::list;

/// What `.metadata` legitimately names: torch's DCP metadata classes
/// (`torch.distributed.checkpoint.metadata`: `Metadata`, `TensorStorageMetadata`,
/// `BytesStorageMetadata`, `ChunkStorageMetadata`, `TensorProperties`, `MetadataIndex`,
/// `StorageMeta`, `_MEM_FORMAT_ENCODING`; `torch.distributed.checkpoint.filesystem._StorageInfo`),
/// `torch.Size`, dtypes, `torch.serialization._get_layout`, `collections.OrderedDict` (all in
/// torch's `weights_only` allowlist or torch's own distributed records) and the `pathlib` path
/// `StorageMeta.checkpoint_id` holds.
pub fn metadata_allows(g: &Global) -> bool {
    weights_only_allows(g)
        || torch_own(g)
        || (g.module == "pathlib"
            && matches!(
                g.name.as_str(),
                "Path" | "PosixPath" | "WindowsPath" | "PurePosixPath" | "PureWindowsPath"
            ))
}

/// The `unsafe-pickle` findings of every pickle in `source` that torch unpickles with no
/// restriction, file by file (for a checkpoint that may not index). Files that cannot be read
/// are left to the other findings.
pub fn unsafe_loader_pickles(source: &dyn Source) -> Vec<Finding> {
    scan(source, None)
}

/// [`unsafe_loader_pickles`] of a checkpoint that indexed: a DCP's `.metadata` globals come from
/// the index (the metadata is not read again), its bytes items are read where the index places
/// them when `read_items` (a request each on a remote source: `inspect` reads them only from
/// local files, `doctor` always).
pub fn unsafe_loader_pickles_indexed(
    source: &dyn Source,
    index: &CheckpointIndex,
    read_items: bool,
) -> Vec<Finding> {
    scan(source, Some((index, read_items)))
}

fn scan(source: &dyn Source, index: Option<(&CheckpointIndex, bool)>) -> Vec<Finding> {
    let dcp_index = index.filter(|(i, _)| i.format == Format::Dcp && i.dcp.is_some());
    let mut out = Vec::new();
    for name in source.names() {
        let base = name.rsplit('/').next().unwrap_or(&name);
        match base {
            ".metadata" => match dcp_index {
                Some((index, read_items)) => {
                    scan_indexed_dcp(source, &name, index, read_items, &mut out);
                }
                None => scan_dcp(source, &name, &mut out),
            },
            "metadata.pkl" => {
                let Ok(bytes) = formats::read_all_capped(
                    source,
                    &name,
                    formats::MAX_PICKLE_FILE_BYTES,
                    "a metadata.pkl file",
                ) else {
                    continue;
                };
                let (globals, _) = pickle::globals_until_error(&bytes);
                let bad = outside(&globals, |g| weights_only_allows(g) || torch_own(g));
                if !bad.is_empty() {
                    out.push(finding(
                        &name,
                        &bad,
                        "a torch_checkpointing loader unpickles metadata.pkl with pickle.load",
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

/// `.distcp` files larger than this are not read whole to look for embedded pickles (the scan for a
/// `.metadata` that does not parse): a whole read of a local file copies it into memory.
const MAX_SCANNED_DATA_FILE: u64 = 1 << 30;

const METADATA_LOADER: &str = "torch.distributed.checkpoint's FileSystemReader unpickles .metadata with pickle.load (no restriction) before it loads anything";
const ITEM_LOADER: &str = "torch.distributed.checkpoint's DefaultLoadPlanner loads a bytes item with torch.load(weights_only=False)";

/// A DCP that indexed: the globals its `.metadata` named, and each bytes entry's item (a
/// `torch.save` archive, zstd-compressed where the item was).
fn scan_indexed_dcp(
    source: &dyn Source,
    meta_name: &str,
    index: &CheckpointIndex,
    read_items: bool,
    out: &mut Vec<Finding>,
) {
    if let Some(facts) = &index.dcp {
        let bad = outside(&facts.metadata_globals, metadata_allows);
        if !bad.is_empty() {
            out.push(finding(meta_name, &bad, METADATA_LOADER));
        }
    }
    if !read_items {
        return;
    }
    let mut seen = std::collections::BTreeSet::new();
    for e in index.entries.iter().filter(|e| e.kind == EntryKind::Bytes) {
        for c in &e.chunks {
            if c.byte_length > formats::MAX_PICKLE_FILE_BYTES
                || !seen.insert((c.file.as_ref(), c.byte_offset))
            {
                continue;
            }
            let Ok(raw) = source.read_range(&c.file, c.byte_offset, c.byte_length) else {
                continue;
            };
            let item = match c.encoding {
                ChunkEncoding::TorchSaveItem => raw,
                ChunkEncoding::ZstdTorchSaveItem => {
                    match dcp::decompress_zstd(&raw, c.max_decoded_bytes()) {
                        Ok(b) => b.into(),
                        Err(_) => continue,
                    }
                }
                ChunkEncoding::Raw { .. } => continue,
            };
            if let Ok(globals) = torch_zip::pickle_globals(&item) {
                let bad = outside(&globals, |g| weights_only_allows(g) || torch_own(g));
                if !bad.is_empty() {
                    let at = format!("{} (item `{}` at byte {})", c.file, e.key, c.byte_offset);
                    out.push(finding(&at, &bad, ITEM_LOADER));
                }
            }
        }
    }
}

fn outside(globals: &[Global], allows: impl Fn(&Global) -> bool) -> Vec<String> {
    globals
        .iter()
        .filter(|g| !allows(g))
        .map(ToString::to_string)
        .collect()
}

/// `.metadata` itself, then the bytes items its records place in `.distcp` files (or, when it is
/// damaged or hostile and whole reads are cheap, every `data.pkl` found in the `.distcp` files).
fn scan_dcp(source: &dyn Source, meta_name: &str, out: &mut Vec<Finding>) {
    let Ok(bytes) = formats::read_all_capped(
        source,
        meta_name,
        formats::MAX_DCP_METADATA_BYTES,
        "a DCP .metadata file",
    ) else {
        return;
    };
    let (globals, error) = pickle::globals_until_error(&bytes);
    let damaged = error.is_some();
    let bad = outside(&globals, metadata_allows);
    if !bad.is_empty() {
        out.push(finding(meta_name, &bad, METADATA_LOADER));
    }
    let dir = meta_name
        .rsplit_once('/')
        .map_or(String::new(), |(d, _)| format!("{d}/"));
    let item_loader = ITEM_LOADER;
    // Bytes items are `BytesStorageMetadata` records: without that class there are none, and
    // the metadata is not parsed again.
    let has_bytes_items = globals.iter().any(|g| {
        g.module == "torch.distributed.checkpoint.metadata" && g.name == "BytesStorageMetadata"
    });
    let parsed = if has_bytes_items {
        dcp::read_metadata(&bytes).ok()
    } else {
        None
    };
    if let Some(meta) = parsed {
        let bytes_items: std::collections::BTreeSet<&str> = meta
            .items
            .iter()
            .filter(|(_, m)| matches!(m, dcp::ItemMeta::Bytes))
            .map(|(k, _)| k.as_str())
            .collect();
        for (idx, info) in &meta.storage {
            if !bytes_items.contains(&*idx.fqn)
                || !info.transforms.is_empty()
                || info.length > formats::MAX_PICKLE_FILE_BYTES
            {
                continue;
            }
            let file = format!("{dir}{}", info.relative_path);
            let Ok(item) = source.read_range(&file, info.offset, info.length) else {
                continue;
            };
            if let Ok(globals) = torch_zip::pickle_globals(&item) {
                let bad = outside(&globals, |g| weights_only_allows(g) || torch_own(g));
                if !bad.is_empty() {
                    let at = format!("{file} (item `{}` at byte {})", idx.fqn, info.offset);
                    out.push(finding(&at, &bad, item_loader));
                }
            }
        }
    } else if (has_bytes_items || damaged || !bad.is_empty()) && source.reads_are_local() {
        for file in source.names() {
            if !(file.starts_with(&dir) && file.ends_with(".distcp")) {
                continue;
            }
            // A whole read copies the file: data files past the limit are left unscanned.
            if source.size(&file).is_ok_and(|n| n > MAX_SCANNED_DATA_FILE) {
                continue;
            }
            let Ok(data) = source.read_all(&file) else {
                continue;
            };
            let mut bad: Vec<String> = Vec::new();
            for pkl in embedded_pickles(&data) {
                let (globals, _) = pickle::globals_until_error(pkl);
                for g in outside(&globals, |g| weights_only_allows(g) || torch_own(g)) {
                    if !bad.contains(&g) {
                        bad.push(g);
                    }
                }
            }
            if !bad.is_empty() {
                out.push(finding(&file, &bad, item_loader));
            }
        }
    }
}

/// The stored `data.pkl` members of the zip archives found in `data` by their local headers
/// (the items of a `.distcp` file whose `.metadata` does not say where they are).
fn embedded_pickles(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    const SIG: &[u8; 4] = b"PK\x03\x04";
    let u16_at = |at: usize| {
        data.get(at..at + 2)
            .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
    };
    let u32_at = |at: usize| {
        data.get(at..at + 4)
            .and_then(|b| usize::try_from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok())
    };
    data.windows(4)
        .enumerate()
        .filter(|(_, w)| w == SIG)
        .filter_map(move |(at, _)| {
            if u16_at(at + 8)? != 0 {
                return None; // compressed: torch stores its members
            }
            let len = u32_at(at + 18)?;
            let name_len = u16_at(at + 26)?;
            let extra_len = u16_at(at + 28)?;
            let name = data.get(at + 30..at + 30 + name_len)?;
            if !name.ends_with(b"data.pkl") {
                return None;
            }
            let start = at
                .checked_add(30)?
                .checked_add(name_len)?
                .checked_add(extra_len)?;
            data.get(start..start.checked_add(len)?)
        })
}

/// An `unsafe-pickle` finding for a pickle a torch loader would unpickle with no restriction.
fn finding(file: &str, globals: &[String], loader: &str) -> Finding {
    Finding {
        code: "unsafe-pickle",
        severity: Severity::Error,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} names {} global(s) outside what its loader needs: {}. {loader}, which would import and may call them: loading this checkpoint with torch would execute code from the file. shardscope never imports or executes them",
            globals.len(),
            list(globals)
        ),
        fix: "do not load it with torch; get the checkpoint again from a source you trust (`python -m pickletools FILE` lists what the pickle would call, without running it)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(module: &str, name: &str) -> Global {
        Global {
            module: module.into(),
            name: name.into(),
        }
    }

    #[test]
    fn metadata_allowlist_is_torch_dcp_only() {
        for (m, n) in [
            ("torch.distributed.checkpoint.metadata", "Metadata"),
            (
                "torch.distributed.checkpoint.metadata",
                "_MEM_FORMAT_ENCODING",
            ),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"),
            ("torch", "Size"),
            ("torch", "float8_e8m0fnu"),
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
        ] {
            assert!(metadata_allows(&g(m, n)), "{m}.{n}");
        }
        for (m, n) in [
            ("os", "system"),
            ("posix", "system"),
            ("builtins", "exec"),
            ("pathlib", "os"),
            ("torch.distributed.elastic.agent", "Agent"),
            ("subprocess", "Popen"),
        ] {
            assert!(!metadata_allows(&g(m, n)), "{m}.{n}");
        }
    }

    #[test]
    fn embedded_pickles_are_found_by_local_header() {
        let mut data = b"junk".to_vec();
        let pkl = b"\x80\x02cos\nsystem\nq\x00.";
        data.extend_from_slice(b"PK\x03\x04");
        data.extend_from_slice(&[0; 4]); // version, flags
        data.extend_from_slice(&[0, 0]); // stored
        data.extend_from_slice(&[0; 8]); // time, date, crc
        data.extend_from_slice(&(pkl.len() as u32).to_le_bytes());
        data.extend_from_slice(&(pkl.len() as u32).to_le_bytes());
        data.extend_from_slice(&(10u16).to_le_bytes());
        data.extend_from_slice(&(2u16).to_le_bytes());
        data.extend_from_slice(b"a/data.pkl");
        data.extend_from_slice(&[0, 0]);
        data.extend_from_slice(pkl);
        data.extend_from_slice(b"PK\x03\x04\x00"); // cut short: ignored
        let found: Vec<&[u8]> = embedded_pickles(&data).collect();
        assert_eq!(found, vec![&pkl[..]]);
    }
}
