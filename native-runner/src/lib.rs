//! The shardscope runner library: the sources a checkpoint is read from (memory-mapped files,
//! remote objects), the gather/flatten executor behind `shardscope gather` and the Chrome-trace
//! writer. The `shardscope` binary is a thin CLI over it.

pub mod errors;
pub mod file_source;
pub mod fsdp1_local;
pub mod gather;
pub mod remote;
pub mod trace;
