//! The canonical checkpoint index: one type for every format.
//!
//! [`index_source`] turns a [`Source`] (a DCP directory, a folder of per-rank `torch.save` files,
//! sharded safetensors, or one file) into a [`CheckpointIndex`]: every entry's key path, kind,
//! dtype, global shape and chunks (offsets, sizes, file, byte range, writing rank), plus what the
//! format says about FSDP. Tensor bytes are never read while indexing; [`CheckpointIndex::read_chunk`]
//! and [`CheckpointIndex::read_tensor`] read values on demand. Format quirks end here.

mod check;
pub mod from_index;
pub mod json;
mod names;
pub(crate) mod read;
mod stats;
pub mod ties;
mod types;
mod values;

use std::collections::HashMap;

use crate::source::Source;

use names::file_ext;
pub use names::{RankGroup, RankedFiles, group_rank_files, is_torch_file, rank_from_name};
pub use read::dcp::index_dcp;
pub use read::deepspeed::partitions as deepspeed_partitions;
pub use read::deepspeed::{
    NonZeroPadding, PaddingCheck, check_padding as check_deepspeed_padding, index_deepspeed,
    index_universal, looks_like_deepspeed, looks_like_universal,
};
pub use read::items::{FolderRead, index_rank_folder};
use read::safetensors::index_safetensors;
pub use read::sets::{EXTRA_KEYS, index_torch_groups, index_torch_sets, set_class, set_item};
pub use read::torch::{index_torch_files, index_torch_files_ranked, json_of, latin1_bytes};
pub use stats::ValueStats;
pub use types::{
    CheckpointIndex, CheckpointKind, Chunk, ChunkEncoding, DcpFacts, EntryKind, FileInfo, Format,
    FsdpInfo, ITEM_ARCHIVE_OVERHEAD, IndexEntry, IndexError, MAX_BYTES_ITEM, PathSeg, Problem,
    Role, ShardPlacement, ZeroPrecision,
};
pub use values::{ChunkLocation, TensorData};

/// A hash map for the per-chunk work of indexing (100 000 chunks and more): foldhash, seeded per
/// process, instead of SipHash.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Indexes whatever checkpoint the source holds.
pub fn index_source(source: &dyn Source) -> Result<CheckpointIndex, IndexError> {
    index_source_sets(source).map(|(index, _)| index)
}

/// A per-rank set of files read into an index, with the class of what it holds ([`set_class`]).
pub type ReadSet = (RankGroup, &'static str);

/// [`index_source`], also giving the per-rank sets of `torch.save` files it read (none for a DCP
/// directory or safetensors files).
pub fn index_source_sets(
    source: &dyn Source,
) -> Result<(CheckpointIndex, Vec<ReadSet>), IndexError> {
    index_source_read(source).map(|(index, sets, _)| (index, sets))
}

/// [`index_source_sets`], also giving notes for a user on how a folder of per-rank sets was read
/// (per-rank files read as values, files not read: [`index_rank_folder`]).
pub fn index_source_read(source: &dyn Source) -> Result<FolderRead, IndexError> {
    let names = source.names();
    if names.iter().any(|n| n == ".metadata") {
        // torch.save files beside it (Lightning's meta.pt, Megatron's common.pt) are read too.
        // So are the per-rank JSON and raw items beside it, and other files are named as not
        // read.
        if names
            .iter()
            .any(|n| !n.contains('/') && !n.starts_with('.') && file_ext(n) != "distcp")
        {
            return read::folders::index_dcp_folders(source, &[".metadata".to_owned()]);
        }
        return Ok((index_dcp(source, ".metadata")?, Vec::new(), Vec::new()));
    }
    // DCP folders one level down (a trainer's folder: accelerate's `save_state`, `checkpoint-N`).
    let nested = read::folders::nested_dcp_metadata(&names);
    if !nested.is_empty() {
        return read::folders::index_dcp_folders(source, &nested);
    }
    if let Some(meta) = names.iter().find(|n| n.ends_with("/.metadata")) {
        return Ok((index_dcp(source, meta)?, Vec::new(), Vec::new()));
    }
    // torch_checkpointing: its metadata.pkl says what every item is and where it lies.
    if names
        .iter()
        .any(|n| n == read::torch_checkpointing::METADATA_PKL)
        && let Some((index, sets)) = read::torch_checkpointing::index_torch_checkpointing(source)?
    {
        return Ok((index, sets, Vec::new()));
    }
    // DeepSpeed universal (`ds_to_universal`): its folder, or the one holding it.
    if looks_like_universal(&names) {
        return index_universal(source, &names);
    }
    // DeepSpeed ZeRO: a tag folder, or the folder holding it and `latest`.
    if looks_like_deepspeed(&names) {
        return index_deepspeed(source, &names);
    }
    let safetensors: Vec<&String> = names
        .iter()
        .filter(|n| file_ext(n) == "safetensors")
        .collect();
    let torch: Vec<&String> = names.iter().filter(|n| is_torch_file(n)).collect();
    if !safetensors.is_empty() && torch.is_empty() {
        return Ok((index_safetensors(source, &names)?, Vec::new(), Vec::new()));
    }
    if !torch.is_empty() && safetensors.is_empty() {
        // Per-rank sets, with the JSON and raw items beside them.
        return index_rank_folder(source, &names);
    }
    if names.is_empty() {
        return Err(IndexError::NotACheckpoint {
            reason: "the source is empty".into(),
        });
    }
    Err(IndexError::NotACheckpoint {
        reason: if safetensors.is_empty() {
            format!(
                "no .metadata, .safetensors or torch.save (.pt/.pth/.bin) files among {} files",
                names.len()
            )
        } else {
            "the folder mixes safetensors and torch.save files".into()
        },
    })
}
