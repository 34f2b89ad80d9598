//! `shardscope`: look inside, convert and verify sharded PyTorch checkpoints without torch.

mod atomic;
mod cli;
mod convert;
mod file_source;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Understand, convert and verify sharded PyTorch (FSDP, DCP) checkpoints, without Python or torch.
#[derive(Debug, Parser)]
#[command(name = "shardscope", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show which elements of which parameter every rank holds under an FSDP configuration.
    Layout(cli::layout::LayoutArgs),
    /// List what a checkpoint holds (keys, dtypes, shapes, chunks, ranks) and check its chunks.
    Inspect(cli::inspect::InspectArgs),
    /// Replay FSDP's unshard path (copy-in, all-gather, copy-out) on every rank; verify and trace it.
    Gather(cli::gather::GatherArgs),
    /// Reshard FSDP1 per-rank LOCAL checkpoints (model + optimizer files) to another world size.
    Reshard(cli::reshard::ReshardCliArgs),
    /// Compare two checkpoints of any formats tensor by tensor (exit 0 equal, 1 differ, 2 bad input).
    Diff(cli::diff::DiffArgs),
    /// Check one checkpoint against itself: tiling, byte ranges, replicas, steps, optimizer keys.
    Verify(cli::verify::VerifyArgs),
    /// Convert a DCP, full or per-rank checkpoint to safetensors, torch.save or DCP for N ranks.
    Convert(cli::convert::ConvertArgs),
    /// Say why a checkpoint will not load into a model, and how to fix it (exit 0 loadable, 1 not,
    /// 2 unreadable).
    Doctor(cli::doctor::DoctorArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Layout(args) => cli::layout::run(&args),
        Command::Inspect(args) => cli::inspect::run(&args),
        Command::Gather(args) => cli::gather::run(&args),
        Command::Reshard(args) => cli::reshard::run(&args),
        Command::Diff(args) => cli::diff::run(&args),
        Command::Verify(args) => cli::verify::run(&args),
        Command::Convert(args) => cli::convert::run(&args),
        Command::Doctor(args) => cli::doctor::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            cli::report_error(&err);
            ExitCode::from(2)
        }
    }
}
