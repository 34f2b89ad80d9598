//! File formats: bytes in, raw records out (readers), and raw records in, bytes out (writers).
//! Nothing here knows about FSDP semantics or the canonical index; [`crate::index`]
//! converts the readers' records in one place.
//!
//! - [`pickle`]: a restricted pickle machine (protocols 2 to 5) that never executes anything.
//! - [`torch_zip`]: `torch.save` zip archives, tensors as lazy views of storage members.
//! - [`safetensors`]: safetensors headers, the HF index file, DCP's sharding info.
//! - [`dcp`]: `torch.distributed.checkpoint` `.metadata`.
//! - [`write`]: the writers.

pub mod dcp;
pub mod locate;
pub mod pickle;
pub mod safetensors;
pub mod torch_zip;
pub mod write;

use std::borrow::Cow;

use crate::source::{Source, SourceError};

/// The largest DCP `.metadata` file read (1 GiB): a checkpoint of a million tensors of a few
/// chunks each writes a few hundred MiB; a larger one is junk or hostile, and reading it whole
/// could exhaust memory.
pub const MAX_DCP_METADATA_BYTES: u64 = 1 << 30;
/// The largest Hugging Face `*.safetensors.index.json` read (1 GiB): a weight map of a million
/// names is under 100 MiB.
pub const MAX_HF_INDEX_BYTES: u64 = 1 << 30;
/// The largest plain pickle (`metadata.pkl`) read whole (1 GiB), as for `.metadata`.
pub const MAX_PICKLE_FILE_BYTES: u64 = 1 << 30;

/// The whole file `name`, refused (before anything is read) when it is larger than `limit`;
/// `what` names the kind of file in the error ("a DCP .metadata file").
pub fn read_all_capped<'s>(
    source: &'s dyn Source,
    name: &str,
    limit: u64,
    what: &str,
) -> Result<Cow<'s, [u8]>, SourceError> {
    let size = source.size(name)?;
    if size > limit {
        return Err(SourceError::Io {
            name: name.to_owned(),
            message: format!(
                "it is {size} bytes, over the limit of {limit} bytes ({} MiB) for {what}; refusing to read it whole (junk or a hostile file?)",
                limit >> 20
            ),
        });
    }
    source.read_range(name, 0, size)
}
