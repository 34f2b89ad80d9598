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
