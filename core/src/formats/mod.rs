//! Raw readers: bytes in, format records out. Nothing here knows about FSDP semantics or the
//! canonical index; [`crate::model::index`] converts these records in one place.
//!
//! - [`pickle`]: a restricted pickle machine (protocols 2 to 5) that never executes anything.
//! - [`torch_zip`]: `torch.save` zip archives, tensors as lazy views of storage members.
//! - [`safetensors`]: safetensors headers, the HF index file, DCP's sharding info.
//! - [`dcp`]: `torch.distributed.checkpoint` `.metadata`.

pub mod dcp;
pub mod pickle;
pub mod safetensors;
pub mod torch_zip;
