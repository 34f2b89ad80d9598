//! Per-tensor value statistics of one checkpoint (min / max / mean over finite values, NaN and
//! infinity counts: `TensorData::stats`, what `shardscope inspect --values` prints), laid out as a
//! grid over the layers of a module list (`model.layers.<n>`: one row per layer, one column per
//! parameter name within the block), so a NaN or an exploding layer stands out. Tensors are read
//! one at a time; on the desktop the work runs on a worker thread.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use shardscope_core::checkpoint::ReadOptions;
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry, TensorData, ValueStats};
use shardscope_core::source::Source;

use crate::compare::{CompareError, CompareInput, Progress};
use crate::job::Job;

/// One cell: a tensor and its statistics (`None` when it has no numeric values or cannot be read).
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    pub fqn: String,
    pub stats: Result<ValueStats, String>,
}

impl Cell {
    /// `max(|min|, |max|)` over finite values.
    pub fn max_abs(&self) -> Option<f64> {
        let s = self.stats.as_ref().ok()?;
        Some(s.min?.abs().max(s.max?.abs()))
    }

    /// NaN and infinite values.
    pub fn non_finite(&self) -> u64 {
        self.stats.as_ref().map_or(0, |s| s.nan + s.inf)
    }
}

/// The statistics of a module list's blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerGrid {
    /// The module list (`model.layers`).
    pub list: String,
    /// Layer numbers, ascending.
    pub layers: Vec<u64>,
    /// Parameter names within a block (`self_attn.q_proj.weight`), sorted.
    pub columns: Vec<String>,
    /// `cells[row][column]`; `None` where a block lacks that parameter.
    pub cells: Vec<Vec<Option<Cell>>>,
}

/// Statistics of every tensor, and the grids of the module lists among them.
#[derive(Debug, Clone, PartialEq)]
pub struct ValueMap {
    pub label: String,
    /// Every tensor's statistics, by key.
    pub tensors: BTreeMap<String, Cell>,
    /// One grid per module list, the list with the most tensors first.
    pub grids: Vec<LayerGrid>,
}

/// `(list, layer, name within the block)` of a key with a numeric segment: the last numeric
/// segment splits it (`model.layers.3.mlp.weight` → `model.layers`, 3, `mlp.weight`).
pub fn layer_of(key: &str) -> Option<(String, u64, String)> {
    let segs: Vec<&str> = key.split('.').collect();
    let at = (1..segs.len().saturating_sub(1))
        .rev()
        .find(|&i| !segs[i].is_empty() && segs[i].bytes().all(|b| b.is_ascii_digit()))?;
    let n = segs[at].parse().ok()?;
    Some((segs[..at].join("."), n, segs[at + 1..].join(".")))
}

/// The statistics of one tensor, as `inspect --values` computes them (rank-local pieces: over
/// all pieces together).
pub fn tensor_stats(
    index: &CheckpointIndex,
    source: &dyn Source,
    e: &IndexEntry,
) -> Result<ValueStats, String> {
    let no_values = || format!("{}: no numeric values", e.key);
    if e.shape.is_some() {
        let data = index
            .read_tensor(source, e)
            .map_err(|err| err.to_string())?;
        return data.stats().ok_or_else(no_values);
    }
    let mut bytes = Vec::new();
    let mut dtype = None;
    for c in &e.chunks {
        let d = index
            .read_chunk(source, e, c)
            .map_err(|err| err.to_string())?;
        dtype = Some(d.dtype);
        bytes.extend(d.bytes);
    }
    let dtype = dtype.ok_or_else(no_values)?;
    TensorData {
        dtype,
        shape: vec![],
        bytes,
    }
    .stats()
    .ok_or_else(no_values)
}

/// Groups cells into the grids of their module lists.
pub fn grids(tensors: &BTreeMap<String, Cell>) -> Vec<LayerGrid> {
    type Blocks = BTreeMap<u64, BTreeMap<String, Cell>>;
    let mut lists: BTreeMap<String, Blocks> = BTreeMap::new();
    for (key, cell) in tensors {
        if let Some((list, n, name)) = layer_of(key) {
            lists
                .entry(list)
                .or_default()
                .entry(n)
                .or_default()
                .insert(name, cell.clone());
        }
    }
    let mut out: Vec<LayerGrid> = lists
        .into_iter()
        .filter(|(_, blocks)| blocks.len() > 1)
        .map(|(list, blocks)| {
            let mut columns: Vec<String> =
                blocks.values().flat_map(|b| b.keys().cloned()).collect();
            columns.sort();
            columns.dedup();
            let layers: Vec<u64> = blocks.keys().copied().collect();
            let cells = blocks
                .values()
                .map(|b| columns.iter().map(|c| b.get(c).cloned()).collect())
                .collect();
            LayerGrid {
                list,
                layers,
                columns,
                cells,
            }
        })
        .collect();
    out.sort_by_key(|g| std::cmp::Reverse(g.cells.iter().flatten().flatten().count()));
    out
}

/// Opens `input` with `Checkpoint::open` and computes every tensor's statistics, one tensor at a
/// time.
pub fn value_map(
    input: &CompareInput,
    options: &ReadOptions,
    progress: &mut dyn FnMut(Progress),
    cancel: &AtomicBool,
) -> Result<ValueMap, CompareError> {
    let (source, ckpt) = input.open("A", options)?;
    let entries: Vec<&IndexEntry> = ckpt
        .index
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
        .collect();
    let mut tensors = BTreeMap::new();
    for (done, e) in entries.iter().enumerate() {
        if cancel.load(Ordering::Relaxed) {
            return Err(CompareError::Cancelled);
        }
        progress(Progress {
            done,
            total: entries.len(),
            what: e.key.clone(),
        });
        let stats = tensor_stats(&ckpt.index, &*source, e);
        tensors.insert(
            e.key.clone(),
            Cell {
                fqn: e.key.clone(),
                stats,
            },
        );
    }
    let grids = grids(&tensors);
    Ok(ValueMap {
        label: input.label.clone(),
        tensors,
        grids,
    })
}

/// Runs [`value_map`] off the UI thread ([`Job`]).
#[derive(Debug, Default)]
pub struct ValueJob {
    pub synchronous: bool,
    job: Job<ValueMap>,
}

impl ValueJob {
    pub fn start(&mut self, input: CompareInput, options: ReadOptions) {
        self.job.synchronous = self.synchronous;
        self.job.start(
            "values",
            Box::new(move |progress, cancel| value_map(&input, &options, progress, cancel)),
        );
    }

    pub fn cancel(&mut self) {
        self.job.cancel();
    }

    pub fn running(&self) -> bool {
        self.job.running()
    }

    pub fn progress(&self) -> Progress {
        self.job.progress()
    }

    /// The finished statistics, once.
    pub fn poll(&mut self) -> Option<Result<ValueMap, CompareError>> {
        self.job.poll()
    }
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn layers_split_at_the_last_block_number() {
        assert_eq!(
            layer_of("model.layers.3.mlp.weight"),
            Some(("model.layers".to_owned(), 3, "mlp.weight".to_owned()))
        );
        assert_eq!(
            layer_of("blocks.0.experts.7.w1"),
            Some(("blocks.0.experts".to_owned(), 7, "w1".to_owned()))
        );
        // A number first or last names no block within a list.
        assert_eq!(layer_of("0.weight"), None);
        assert_eq!(layer_of("state.12"), None);
        assert_eq!(layer_of("embed.weight"), None);
    }
}
