//! The index as pretty-printed JSON, written one entry at a time.
//!
//! `serde_json::to_string_pretty(&serde_json::to_value(&index))` holds a JSON tree of every chunk
//! (a map with a `String` per key, about 1 KB a chunk) and then the whole text: a 1-million-chunk
//! DCP needs gigabytes for it. [`write_pretty`] writes the same bytes with only one entry's tree
//! alive at a time: the document without its entries is printed first, and the entries array
//! is written in its place, each entry printed on its own and indented to its depth (pretty
//! printing only depends on the depth, and JSON strings hold no raw newline).

use std::io::Write;

use serde_json::{Map, Value};

use crate::index::{CheckpointIndex, Chunk, ChunkEncoding, IndexEntry};

/// Stands for an array in a printed document (the entries, an entry's chunks); no index value
/// can print as it (a NUL is escaped in JSON strings).
const ARRAY_MARK: &str = "\u{0}shardscope-array\u{0}";

/// Writes `index` as `serde_json::to_string_pretty(&value)` does, where `value` is
/// `serde_json::to_value(index)` with `extra(entry)`'s fields added to each entry and `top`'s
/// fields added to the document (same key order: `serde_json` maps sort their keys).
pub fn write_pretty<W: Write>(
    mut out: W,
    index: &CheckpointIndex,
    mut extra: impl FnMut(&IndexEntry) -> Map<String, Value>,
    top: Map<String, Value>,
) -> Result<(), serde_json::Error> {
    let head = CheckpointIndex {
        format: index.format,
        kind: index.kind,
        has_optimizer_state: index.has_optimizer_state,
        entries: Vec::new(),
        files: index.files.clone(),
        dcp: index.dcp.clone(),
    };
    let mut doc = serde_json::to_value(&head)?;
    drop(head);
    if let Some(doc) = doc.as_object_mut() {
        doc.insert("entries".into(), Value::String(ARRAY_MARK.into()));
        doc.extend(top);
    }
    let text = serde_json::to_string_pretty(&doc)?;
    drop(doc);
    let mut chunk_text = Vec::new();
    splice(&mut out, &text, 0, &index.entries, |out, entry, depth| {
        let mut value = serde_json::to_value(entry_without_chunks(entry))?;
        if let Some(fields) = value.as_object_mut() {
            fields.insert("chunks".into(), Value::String(ARRAY_MARK.into()));
            fields.extend(extra(entry));
        }
        let entry_text = serde_json::to_string_pretty(&value)?;
        splice(
            out,
            &entry_text,
            depth,
            &entry.chunks,
            |out, chunk, depth| {
                // Straight to the output, indented as `write_indented` would (a million chunks).
                write_chunk(out, chunk, depth, &mut chunk_text).map_err(serde_json::Error::io)
            },
        )
    })
}

/// Writes `text` (printed at depth `depth`) with [`ARRAY_MARK`] replaced by the array of
/// `items`, each written by `item` at its depth, as `serde_json`'s pretty printer lays out an
/// array (`[]` when empty). Without the mark, `text` is written as it is.
fn splice<W: Write, T>(
    out: &mut W,
    text: &str,
    depth: usize,
    items: &[T],
    mut item: impl FnMut(&mut W, &T, usize) -> Result<(), serde_json::Error>,
) -> Result<(), serde_json::Error> {
    let io = serde_json::Error::io;
    let mark = serde_json::to_string(ARRAY_MARK)?;
    let Some((before, after)) = text.split_once(&mark) else {
        return write_indented(out, text, depth, false);
    };
    write_indented(out, before, depth, false)?;
    let inner = depth + indent_of_last_line(before) + 2;
    if items.is_empty() {
        out.write_all(b"[]").map_err(io)?;
    } else {
        out.write_all(b"[").map_err(io)?;
        for (i, x) in items.iter().enumerate() {
            out.write_all(if i == 0 { b"\n" } else { b",\n" })
                .map_err(io)?;
            write_spaces(out, inner)?;
            item(out, x, inner)?;
        }
        out.write_all(b"\n").map_err(io)?;
        write_spaces(out, inner - 2)?;
        out.write_all(b"]").map_err(io)?;
    }
    write_indented(out, after, depth, false)
}

/// The indentation of the last line of `text` (the line that holds the array's key).
fn indent_of_last_line(text: &str) -> usize {
    let line = text.rsplit('\n').next().unwrap_or(text);
    line.len() - line.trim_start_matches(' ').len()
}

fn write_spaces<W: Write>(out: &mut W, n: usize) -> Result<(), serde_json::Error> {
    const SPACES: [u8; 64] = [b' '; 64];
    let mut left = n;
    while left > 0 {
        let k = left.min(SPACES.len());
        out.write_all(&SPACES[..k]).map_err(serde_json::Error::io)?;
        left -= k;
    }
    Ok(())
}

/// Writes `text` with `depth` spaces after each newline (and before it, with `at_line_start`).
fn write_indented<W: Write>(
    out: &mut W,
    text: &str,
    depth: usize,
    at_line_start: bool,
) -> Result<(), serde_json::Error> {
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.write_all(b"\n").map_err(serde_json::Error::io)?;
        }
        if (i > 0 || at_line_start) && !line.is_empty() {
            write_spaces(out, depth)?;
        }
        out.write_all(line.as_bytes())
            .map_err(serde_json::Error::io)?;
    }
    Ok(())
}

/// The entry's serialized fields but its chunks (which [`write_pretty`] writes one at a time).
fn entry_without_chunks(e: &IndexEntry) -> IndexEntry {
    let IndexEntry {
        key,
        raw_key,
        path,
        kind,
        dtype,
        shape,
        chunks: _,
        fsdp,
        role,
        flat_param,
        value,
        position: _,
        object: _,
    } = e;
    IndexEntry {
        key: key.clone(),
        raw_key: raw_key.clone(),
        path: path.clone(),
        kind: *kind,
        dtype: *dtype,
        shape: shape.clone(),
        chunks: Vec::new(),
        fsdp: fsdp.clone(),
        role: role.clone(),
        flat_param: *flat_param,
        value: value.clone(),
        position: None,
        object: None,
    }
}

/// Writes `chunk` as `serde_json::to_string_pretty(&serde_json::to_value(chunk))` prints it at
/// column `base` (keys in sorted order, two spaces a level), with `text` as its buffer: a
/// million chunks are written without a JSON tree, or a serializer call, per value.
fn write_chunk<W: Write>(
    out: &mut W,
    chunk: &Chunk,
    base: usize,
    text: &mut Vec<u8>,
) -> std::io::Result<()> {
    fn pad(text: &mut Vec<u8>, n: usize) {
        text.resize(text.len() + n, b' ');
    }
    fn key(text: &mut Vec<u8>, base: usize, name: &str, first: bool) {
        text.extend_from_slice(if first { b"\n" } else { b",\n" });
        pad(text, base + 2);
        text.push(b'"');
        text.extend_from_slice(name.as_bytes());
        text.extend_from_slice(b"\": ");
    }
    fn int(text: &mut Vec<u8>, v: u64) {
        text.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }
    fn ints(text: &mut Vec<u8>, base: usize, values: &[u64]) {
        if values.is_empty() {
            text.extend_from_slice(b"[]");
            return;
        }
        text.push(b'[');
        for (i, &v) in values.iter().enumerate() {
            text.extend_from_slice(if i == 0 { b"\n" } else { b",\n" });
            pad(text, base + 4);
            int(text, v);
        }
        text.push(b'\n');
        pad(text, base + 2);
        text.push(b']');
    }
    let Chunk {
        offsets,
        sizes,
        file,
        byte_offset,
        byte_length,
        rank,
        encoding,
    } = chunk;
    let (tag, raw) = match encoding {
        ChunkEncoding::Raw {
            storage_offset,
            strides,
        } => ("raw", Some((storage_offset, strides))),
        ChunkEncoding::TorchSaveItem => ("torch_save_item", None),
        ChunkEncoding::ZstdTorchSaveItem => ("zstd_torch_save_item", None),
    };
    text.clear();
    text.push(b'{');
    key(text, base, "byte_length", true);
    int(text, *byte_length);
    key(text, base, "byte_offset", false);
    int(text, *byte_offset);
    key(text, base, "encoding", false);
    text.push(b'"');
    text.extend_from_slice(tag.as_bytes());
    text.push(b'"');
    key(text, base, "file", false);
    serde_json::to_writer(&mut *text, &**file).map_err(std::io::Error::from)?;
    key(text, base, "offsets", false);
    ints(text, base, offsets);
    key(text, base, "rank", false);
    match rank {
        Some(r) => int(text, u64::from(*r)),
        None => text.extend_from_slice(b"null"),
    }
    key(text, base, "sizes", false);
    ints(text, base, sizes);
    if let Some((storage_offset, strides)) = raw {
        key(text, base, "storage_offset", false);
        int(text, *storage_offset);
        key(text, base, "strides", false);
        ints(text, base, strides);
    }
    text.push(b'\n');
    pad(text, base);
    text.push(b'}');
    out.write_all(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Chunk, ChunkEncoding, EntryKind, FileInfo, Format, PathSeg};

    fn index(entries: usize) -> CheckpointIndex {
        let raw_entry = |i: usize| IndexEntry {
            key: format!("k{i}"),
            raw_key: None,
            path: vec![PathSeg::Key(format!("k{i}")), PathSeg::Index(3)],
            kind: EntryKind::Tensor,
            dtype: Some(crate::dtype::DType::Float32),
            shape: Some(vec![4, 2]),
            chunks: vec![Chunk {
                offsets: vec![0, 0].into(),
                sizes: vec![4, 2].into(),
                file: "a \"b\"\n.pt".into(),
                byte_offset: 8,
                byte_length: 32,
                rank: Some(1),
                encoding: ChunkEncoding::Raw {
                    storage_offset: 0,
                    strides: vec![2, 1],
                },
            }],
            fsdp: None,
            role: None,
            flat_param: false,
            value: Some(serde_json::json!({"x": [1.5, null, "y\nz"]})),
            position: None,
            object: None,
        };
        let entry = |i: usize| {
            let mut e = raw_entry(i);
            // Entry 1: two chunks, one of each kind of encoding; entry 2: none.
            if i == 1 {
                let mut c = e.chunks[0].clone();
                c.encoding = ChunkEncoding::ZstdTorchSaveItem;
                c.rank = None;
                e.chunks.push(c);
                // A bytes item's chunk (no offsets, no sizes) and large numbers.
                e.chunks.push(Chunk {
                    offsets: Vec::new().into(),
                    sizes: Vec::new().into(),
                    file: "__1023_0.distcp".into(),
                    byte_offset: u64::MAX,
                    byte_length: 1 << 40,
                    rank: Some(u32::MAX),
                    encoding: ChunkEncoding::TorchSaveItem,
                });
            }
            if i == 2 {
                e.chunks.clear();
            }
            e
        };
        CheckpointIndex {
            format: Format::TorchSave,
            kind: crate::index::CheckpointKind::Plain,
            has_optimizer_state: false,
            entries: (0..entries).map(entry).collect(),
            files: [(
                "a.pt".to_owned(),
                FileInfo {
                    size: 100,
                    rank: None,
                    unreferenced_bytes: 0,
                },
            )]
            .into(),
            dcp: None,
        }
    }

    /// What `inspect --json` printed before: the whole document as one JSON tree.
    fn whole(idx: &CheckpointIndex, top: &Map<String, Value>) -> String {
        let mut value = serde_json::to_value(idx).unwrap();
        for e in value["entries"].as_array_mut().unwrap() {
            if e["key"] == "k1" {
                e["stats"] = serde_json::json!({"count": 8, "mean": 0.25});
            }
        }
        for (k, v) in top {
            value[k] = v.clone();
        }
        serde_json::to_string_pretty(&value).unwrap()
    }

    #[test]
    fn same_bytes_as_one_tree() {
        let top: Map<String, Value> = [
            ("summary".to_owned(), serde_json::json!({"entries": 2})),
            ("problems".to_owned(), serde_json::json!([])),
        ]
        .into_iter()
        .collect();
        for n in [0, 1, 3] {
            let idx = index(n);
            let mut out = Vec::new();
            write_pretty(
                &mut out,
                &idx,
                |e| {
                    let mut m = Map::new();
                    if e.key == "k1" {
                        m.insert(
                            "stats".into(),
                            serde_json::json!({"count": 8, "mean": 0.25}),
                        );
                    }
                    m
                },
                top.clone(),
            )
            .unwrap();
            assert_eq!(
                String::from_utf8(out).unwrap(),
                whole(&idx, &top),
                "{n} entries"
            );
        }
    }
}
