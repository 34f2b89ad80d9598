//! The shardscope runner library: the sources a checkpoint is read from (memory-mapped files,
//! remote objects), the gather/flatten executor behind `shardscope gather` and the Chrome-trace
//! writer; the `shardscope` command itself ([`main_with`], run by the binary and by the Python
//! package's entry point), and [`api`], what the Python module reads checkpoints with.

// The command's modules name this crate by its name, as the binary's did.
extern crate self as shardscope_runner;

pub mod api;
mod app;
mod atomic;
mod cli;
mod convert;
mod hash;
mod input;
mod writeback;

pub use app::main_with;

pub mod errors;
pub mod file_source;
pub mod fsdp1_local;
pub mod gather;
pub mod remote;
pub mod trace;
