//! `bloated-storage`: tensors saved as views of larger storages. `torch.save` writes every storage
//! whole, so a state dict of slices (`weight[:n]`, a column, one expert of a stacked tensor) is as
//! big as what the slices were cut from. Found from the index alone (no value is read): the
//! storages of `torch.save` files with the views the checkpoint keeps of them.

use std::collections::{BTreeMap, BTreeSet};

use super::report::{Finding, Severity};
use crate::index::{CheckpointIndex, ChunkEncoding, EntryKind};

/// Unused bytes below this, in a whole checkpoint, are not worth a finding.
const MIN_WASTED_BYTES: u64 = 64 << 10;

/// A storage: its file, byte offset and byte length.
type StorageKey<'a> = (&'a str, u64, u64);

/// A view of a storage: first element, strides, sizes.
type View = (u64, Vec<u64>, Vec<u64>);

/// Adds a `bloated-storage` warning when the storages written hold many more bytes than the
/// tensors that use them.
pub fn bloated_storages(index: &CheckpointIndex, label: &str, findings: &mut Vec<Finding>) {
    let mut storages: BTreeMap<StorageKey<'_>, (BTreeSet<View>, u64, BTreeSet<&str>)> =
        BTreeMap::new();
    for e in &index.entries {
        let (EntryKind::Tensor, Some(dtype)) = (e.kind, e.dtype) else {
            continue;
        };
        let item = dtype.size_bytes() as u64;
        for c in &e.chunks {
            let ChunkEncoding::Raw {
                storage_offset,
                strides,
            } = &c.encoding
            else {
                continue;
            };
            let slot = storages
                .entry((&c.file, c.byte_offset, c.byte_length))
                .or_insert_with(|| (BTreeSet::new(), item, BTreeSet::new()));
            slot.0
                .insert((*storage_offset, strides.clone(), c.sizes.to_vec()));
            slot.2.insert(e.key.as_str());
        }
    }
    let mut wasted = 0u64;
    let mut written = 0u64;
    let mut keys: Vec<(u64, &str)> = Vec::new();
    for ((_, _, bytes), (views, item, names)) in &storages {
        // Distinct views (ties share one), each its own elements; never more than the storage.
        let used = views
            .iter()
            .map(|(_, _, sizes)| {
                sizes
                    .iter()
                    .try_fold(*item, |a, &d| a.checked_mul(d))
                    .unwrap_or(u64::MAX)
            })
            .fold(0u64, u64::saturating_add)
            .min(*bytes);
        written = written.saturating_add(*bytes);
        let lost = bytes - used;
        if lost > 0 {
            wasted = wasted.saturating_add(lost);
            keys.extend(names.iter().map(|n| (lost, *n)));
        }
    }
    if wasted < MIN_WASTED_BYTES {
        return;
    }
    keys.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let keys: Vec<String> = keys.into_iter().map(|(_, k)| k.to_owned()).collect();
    let shown: Vec<&str> = keys.iter().take(3).map(String::as_str).collect();
    #[allow(clippy::cast_precision_loss, reason = "a share shown in whole percent")]
    let share = wasted as f64 * 100.0 / written.max(1) as f64;
    findings.push(Finding {
        code: "bloated-storage",
        severity: Severity::Warning,
        message: format!(
            "{} tensor(s) ({}{}) are views of larger storages, which torch.save wrote whole: {wasted} bytes ({}) of the {written} storage bytes ({share:.0}%) hold no tensor of the checkpoint; it loads, but is bigger than its tensors",
            keys.len(),
            shown.join(", "),
            if keys.len() > shown.len() { ", …" } else { "" },
            human(wasted)
        ),
        fix: format!(
            "shardscope convert {label} -o compact.safetensors (or -o compact.pt): each tensor is written as its own bytes; in torch, save `{{k: v.clone() for k, v in sd.items()}}`"
        ),
        keys,
    });
}

fn human(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss, reason = "a size shown to one decimal")]
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}
