//! `shardscope`: look inside, convert and verify sharded PyTorch checkpoints without torch.

use std::process::ExitCode;

/// mimalloc rather than the C library's allocator: indexing a large `.metadata` makes millions of small
/// allocations (BENCHMARKS.md, "inspect: DCP checkpoint with 100 000 chunks").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    shardscope_runner::main_with(std::env::args_os())
}
