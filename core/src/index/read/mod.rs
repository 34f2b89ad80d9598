//! One reader per format, each turning raw records into a [`CheckpointIndex`].

pub mod dcp;
pub mod deepspeed;
pub mod folders;
pub mod items;
pub mod safetensors;
pub mod sets;
pub mod torch;
pub mod torch_checkpointing;
