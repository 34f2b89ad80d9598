//! [`MetadataTable`]: a `.metadata` in the compact form the index is built from. Each chunk of
//! `state_dict_metadata` carries the place its `storage_data` record gives it (file, byte range,
//! transforms); names of files and transform lists are held once. Built either by the streaming
//! reader ([`super::stream`]) or from a [`DcpMetadata`] (the general path); both join chunks to
//! records with [`join`], the rule of torch's `MetadataIndex` lookup.

use std::collections::BTreeMap;

use super::{DcpMetadata, ItemMeta, PlannerStep};
use crate::dtype::DType;
use crate::formats::pickle::Global;
use crate::shape::Dims;

type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Where a chunk's bytes are (`_StorageInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlace {
    /// Into [`MetadataTable::files`].
    pub file: u32,
    /// Into [`MetadataTable::transforms`].
    pub transforms: u32,
    pub offset: u64,
    pub length: u64,
}

/// One chunk of a tensor item (`ChunkStorageMetadata`) and its record's place, `None` when
/// `storage_data` has no record for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableChunk {
    pub offsets: Dims,
    pub sizes: Dims,
    pub place: Option<ChunkPlace>,
}

/// `state_dict_metadata[key]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableItemKind {
    Tensor {
        dtype: DType,
        size: Vec<u64>,
        chunks: Vec<TableChunk>,
    },
    /// A bytes item and its record's place.
    Bytes { place: Option<ChunkPlace> },
}

/// One item of `state_dict_metadata`, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableItem {
    pub key: String,
    pub kind: TableItemKind,
}

/// A `.metadata` with every chunk joined to its `storage_data` record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataTable {
    pub items: Vec<TableItem>,
    /// `planner_data`: flattened key -> original path.
    pub planner_data: BTreeMap<String, Vec<PlannerStep>>,
    /// The `relative_path`s records name, once each.
    pub files: Vec<String>,
    /// The `transform_descriptors` lists records hold, once each; `[0]` is the empty list.
    pub transforms: Vec<Vec<String>>,
    pub version: Option<String>,
    pub checkpoint_id: Option<String>,
    pub save_id: Option<String>,
    /// Every global the pickle names, once each, in first-seen order.
    pub globals: Vec<Global>,
}

/// One `storage_data` record in compact form: the fqn (an id of the caller's), the chunk
/// offsets (`None` for bytes items) and the place.
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) fqn: u32,
    pub(super) offsets: Option<Dims>,
    pub(super) place: ChunkPlace,
}

/// An item before the join: its chunks' geometry.
#[derive(Debug)]
pub(super) enum RawItem {
    Tensor {
        dtype: DType,
        size: Vec<u64>,
        chunks: Vec<(Dims, Dims)>,
    },
    Bytes,
}

/// Names to ids, once each, in first-seen order.
#[derive(Default)]
pub(super) struct Names {
    pub(super) ids: FastMap<String, u32>,
    pub(super) names: Vec<String>,
}

impl Names {
    pub(super) fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        // At most one name per record: fits in `u32` for any file under 4 GiB.
        let id = self.names.len() as u32;
        self.ids.insert(name.to_owned(), id);
        self.names.push(name.to_owned());
        id
    }
}

/// Transform lists to ids; the empty list is `0`.
pub(super) struct TransformLists {
    ids: FastMap<Vec<String>, u32>,
    pub(super) lists: Vec<Vec<String>>,
}

impl Default for TransformLists {
    fn default() -> Self {
        let mut ids = FastMap::default();
        ids.insert(Vec::new(), 0);
        TransformLists {
            ids,
            lists: vec![Vec::new()],
        }
    }
}

impl TransformLists {
    pub(super) fn id(&mut self, list: &[String]) -> u32 {
        if let Some(&id) = self.ids.get(list) {
            return id;
        }
        let id = self.lists.len() as u32;
        self.ids.insert(list.to_vec(), id);
        self.lists.push(list.to_vec());
        id
    }
}

/// Joins each chunk to its `storage_data` record as torch's `MetadataIndex` lookup does, by
/// (fqn, chunk offsets): the `i`-th record of an fqn is tried for chunk `i` first (torch writes a
/// tensor's records in the order of its chunk list); otherwise the last record of those offsets
/// (as a dict keeps it). `fqn_id` gives an item key's id in `records`, `None` when no record
/// names it.
pub(super) fn join(
    items: Vec<(String, RawItem)>,
    records: &[Record],
    fqn_id: impl Fn(&str) -> Option<u32>,
) -> Vec<TableItem> {
    let mut by_fqn: FastMap<u32, Vec<u32>> = FastMap::default();
    for (p, r) in records.iter().enumerate() {
        // One record per pickle opcode at least: fewer than `u32::MAX`.
        by_fqn.entry(r.fqn).or_default().push(p as u32);
    }
    let mut by_offsets: FastMap<u32, FastMap<Option<&[u64]>, u32>> = FastMap::default();
    let mut find = |fqn: Option<u32>, i: usize, offsets: Option<&[u64]>| -> Option<ChunkPlace> {
        let fqn = fqn?;
        let cands = by_fqn.get(&fqn)?;
        if let Some(&p) = cands.get(i)
            && records[p as usize].offsets.as_deref() == offsets
        {
            return Some(records[p as usize].place);
        }
        let map = by_offsets.entry(fqn).or_insert_with(|| {
            cands
                .iter()
                .map(|&q| (records[q as usize].offsets.as_deref(), q))
                .collect()
        });
        map.get(&offsets).map(|&q| records[q as usize].place)
    };
    items
        .into_iter()
        .map(|(key, item)| {
            let id = fqn_id(&key);
            let kind = match item {
                RawItem::Bytes => TableItemKind::Bytes {
                    place: find(id, 0, None),
                },
                RawItem::Tensor {
                    dtype,
                    size,
                    chunks,
                } => TableItemKind::Tensor {
                    dtype,
                    size,
                    chunks: chunks
                        .into_iter()
                        .enumerate()
                        .map(|(i, (offsets, sizes))| TableChunk {
                            place: find(id, i, Some(&offsets)),
                            offsets,
                            sizes,
                        })
                        .collect(),
                },
            };
            TableItem { key, kind }
        })
        .collect()
}

impl MetadataTable {
    /// The table of a `.metadata` read by the general path.
    pub fn from_metadata(meta: DcpMetadata) -> MetadataTable {
        let mut fqns = Names::default();
        let mut files = Names::default();
        let mut transforms = TransformLists::default();
        let records: Vec<Record> = meta
            .storage
            .iter()
            .map(|(index, info)| Record {
                fqn: fqns.id(&index.fqn),
                offsets: index.offset.as_deref().map(Dims::from),
                place: ChunkPlace {
                    file: files.id(&info.relative_path),
                    transforms: transforms.id(&info.transforms),
                    offset: info.offset,
                    length: info.length,
                },
            })
            .collect();
        let items = meta
            .items
            .into_iter()
            .map(|(key, item)| {
                let raw = match item {
                    ItemMeta::Bytes => RawItem::Bytes,
                    ItemMeta::Tensor {
                        dtype,
                        size,
                        chunks,
                    } => RawItem::Tensor {
                        dtype,
                        size,
                        chunks: chunks
                            .into_iter()
                            .map(|c| (Dims::from(c.offsets), Dims::from(c.sizes)))
                            .collect(),
                    },
                };
                (key, raw)
            })
            .collect();
        let items = join(items, &records, |k| fqns.ids.get(k).copied());
        MetadataTable {
            items,
            planner_data: meta.planner_data,
            files: files.names,
            transforms: transforms.lists,
            version: meta.version,
            checkpoint_id: meta.checkpoint_id,
            save_id: meta.save_id,
            globals: meta.globals,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(fqn: u32, offsets: Option<&[u64]>, file: u32) -> Record {
        Record {
            fqn,
            offsets: offsets.map(Dims::from),
            place: ChunkPlace {
                file,
                transforms: 0,
                offset: 0,
                length: 0,
            },
        }
    }

    fn tensor(chunks: &[&[u64]]) -> RawItem {
        RawItem::Tensor {
            dtype: DType::Float32,
            size: vec![8],
            chunks: chunks
                .iter()
                .map(|o| (Dims::from(*o), Dims::from(&[1u64][..])))
                .collect(),
        }
    }

    fn files(item: &TableItem) -> Vec<Option<u32>> {
        match &item.kind {
            TableItemKind::Tensor { chunks, .. } => {
                chunks.iter().map(|c| c.place.map(|p| p.file)).collect()
            }
            TableItemKind::Bytes { place } => vec![place.map(|p| p.file)],
        }
    }

    #[test]
    fn join_in_order_out_of_order_and_missing() {
        let records = vec![
            record(0, Some(&[0, 0]), 10),
            record(0, Some(&[2, 0]), 11),
            record(1, None, 20),
            // `c`'s records in the reverse order of its chunk list, and one repeated.
            record(2, Some(&[4]), 32),
            record(2, Some(&[2]), 31),
            record(2, Some(&[0]), 30),
            record(2, Some(&[4]), 33),
        ];
        let items = vec![
            ("a".to_owned(), tensor(&[&[0, 0], &[2, 0], &[1, 0]])),
            ("b".to_owned(), RawItem::Bytes),
            ("c".to_owned(), tensor(&[&[0], &[2], &[4]])),
            ("zzz".to_owned(), RawItem::Bytes),
        ];
        let ids = |k: &str| {
            ["a", "b", "c"]
                .iter()
                .position(|n| *n == k)
                .map(|p| p as u32)
        };
        let table = join(items, &records, ids);
        assert_eq!(files(&table[0]), [Some(10), Some(11), None]);
        assert_eq!(files(&table[1]), [Some(20)]);
        // In position where it matches; otherwise the last record of those offsets, as a dict
        // keeps it.
        assert_eq!(files(&table[2]), [Some(30), Some(31), Some(33)]);
        assert_eq!(files(&table[3]), [None]);
    }
}
