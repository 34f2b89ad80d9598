//! The index as pretty-printed JSON, written one entry at a time.
//!
//! `serde_json::to_string_pretty(&serde_json::to_value(&index))` holds a JSON tree of every chunk
//! (a map with a `String` per key, about 1 KB a chunk) and then the whole text: a 1-million-chunk
//! DCP needs gigabytes for it. [`write_pretty`] writes the same bytes with only one entry's tree
//! alive at a time: the document without its entries is printed first, and the entries array
//! is written in its place, each entry printed on its own and indented to its depth (pretty
//! printing only depends on the depth, and JSON strings hold no raw newline).

use std::io::Write;

use serde::ser::{Serialize, SerializeMap, Serializer};
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
                let mut ser = serde_json::Serializer::with_formatter(
                    &mut *out,
                    DeepFormatter {
                        base: depth,
                        level: 0,
                        has_value: false,
                    },
                );
                SortedChunk(chunk).serialize(&mut ser)
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

/// `serde_json`'s pretty printer (two spaces a level) for a value printed at column `base`:
/// every line after the first starts with `base` more spaces, as [`write_indented`] lays it out.
struct DeepFormatter {
    base: usize,
    level: usize,
    has_value: bool,
}

impl DeepFormatter {
    /// `[` or `{`: one level deeper, nothing in it yet.
    fn open<W: ?Sized + Write>(&mut self, out: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        out.write_all(bracket)
    }

    /// `]` or `}`: on a line of its own when the container held anything.
    fn close<W: ?Sized + Write>(&mut self, out: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            out.write_all(b"\n")?;
            self.indent(out)?;
        }
        out.write_all(bracket)
    }

    /// The line break (and comma) before an array value or an object key.
    fn next_line<W: ?Sized + Write>(&self, out: &mut W, first: bool) -> std::io::Result<()> {
        out.write_all(if first { b"\n" } else { b",\n" })?;
        self.indent(out)
    }

    fn indent<W: ?Sized + Write>(&self, out: &mut W) -> std::io::Result<()> {
        const SPACES: [u8; 64] = [b' '; 64];
        let mut left = self.base + 2 * self.level;
        while left > 0 {
            let k = left.min(SPACES.len());
            out.write_all(&SPACES[..k])?;
            left -= k;
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for DeepFormatter {
    fn begin_array<W: ?Sized + Write>(&mut self, out: &mut W) -> std::io::Result<()> {
        self.open(out, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, out: &mut W) -> std::io::Result<()> {
        self.close(out, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        out: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.next_line(out, first)
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _out: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, out: &mut W) -> std::io::Result<()> {
        self.open(out, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, out: &mut W) -> std::io::Result<()> {
        self.close(out, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        out: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.next_line(out, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, out: &mut W) -> std::io::Result<()> {
        out.write_all(b": ")
    }

    fn end_object_value<W: ?Sized + Write>(&mut self, _out: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
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

/// A [`Chunk`] serialized as `serde_json::to_value(chunk)` prints it: keys in sorted order (a
/// JSON tree per chunk is what made `inspect --json` of a large DCP slow).
struct SortedChunk<'a>(&'a Chunk);

impl Serialize for SortedChunk<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Chunk {
            offsets,
            sizes,
            file,
            byte_offset,
            byte_length,
            rank,
            encoding,
        } = self.0;
        let (tag, raw) = match encoding {
            ChunkEncoding::Raw {
                storage_offset,
                strides,
            } => ("raw", Some((storage_offset, strides))),
            ChunkEncoding::TorchSaveItem => ("torch_save_item", None),
            ChunkEncoding::ZstdTorchSaveItem => ("zstd_torch_save_item", None),
        };
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("byte_length", byte_length)?;
        map.serialize_entry("byte_offset", byte_offset)?;
        map.serialize_entry("encoding", tag)?;
        map.serialize_entry("file", &**file)?;
        map.serialize_entry("offsets", offsets)?;
        map.serialize_entry("rank", rank)?;
        map.serialize_entry("sizes", sizes)?;
        if let Some((storage_offset, strides)) = raw {
            map.serialize_entry("storage_offset", storage_offset)?;
            map.serialize_entry("strides", strides)?;
        }
        map.end()
    }
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
