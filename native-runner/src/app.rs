//! The `shardscope` command: its arguments and subcommands, run by [`main_with`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::cli;

/// Understand, convert and verify sharded PyTorch (FSDP, DCP) checkpoints, without Python or torch.
#[derive(Debug, Parser)]
#[command(name = "shardscope", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Remote inputs: a request that receives no byte for this long fails (and is retried, then
    /// resumed where it stopped); per wait, not for a whole transfer.
    #[arg(long, global = true, value_name = "SECS", default_value_t = 30.0, value_parser = parse_io_timeout)]
    io_timeout: f64,
}

/// `--io-timeout`: seconds, more than 0.
fn parse_io_timeout(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a timeout in seconds (more than 0, at most 86400)"
        )),
    }
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
    /// Convert a DCP, full or per-rank checkpoint to safetensors, torch.save or DCP for N ranks,
    /// or its model to a Hugging Face model (`--to hf --config CONFIG.json`) and back.
    Convert(cli::convert::ConvertArgs),
    /// List the built-in name mappings of `convert --to hf`, or print one (to write your own).
    Mappings(cli::mappings::MappingsArgs),
    /// Print a shell completion script: `shardscope completions bash > ~/.local/share/bash-completion/completions/shardscope`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Say why a checkpoint will not load into a model, and how to fix it (exit 0 loadable, 1 not,
    /// 2 unreadable).
    Doctor(cli::doctor::DoctorArgs),
    /// Write a content manifest: one digest per tensor of its logical value, the same whatever
    /// the format or sharding (DCP, safetensors, per-rank files, `.pt`); `verify --manifest`
    /// and `diff` check a checkpoint against it.
    Hash(cli::hash::HashArgs),
}

/// Runs the `shardscope` command with `args` (the program name first, as `std::env::args_os`
/// gives them): the binary's `main` and the Python package's `shardscope` entry point.
pub fn main_with<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` print and succeed; usage errors exit 2, as clap does.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    shardscope_runner::remote::set_io_timeout(std::time::Duration::from_secs_f64(cli.io_timeout));
    let result = match cli.command {
        Command::Layout(args) => cli::layout::run(&args),
        Command::Inspect(args) => cli::inspect::run(&args),
        Command::Gather(args) => cli::gather::run(&args),
        Command::Reshard(args) => cli::reshard::run(&args),
        Command::Diff(args) => cli::diff::run(&args),
        Command::Verify(args) => cli::verify::run(&args),
        Command::Convert(args) => cli::convert::run(&args),
        Command::Mappings(args) => cli::mappings::run(&args),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut cmd, "shardscope", &mut out);
            cli::print_stdout(&String::from_utf8_lossy(&out)).map(|()| ExitCode::SUCCESS)
        }
        Command::Doctor(args) => cli::doctor::run(&args),
        Command::Hash(args) => cli::hash::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            shardscope_runner::errors::report_error(&err);
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use clap::CommandFactory;

    use super::Cli;

    /// One vocabulary: a flag that several commands take is spelled with the same value name (and
    /// so the same meaning) everywhere; `--json` and `--quiet` are plain switches.
    #[test]
    fn shared_flags_mean_the_same_in_every_command() {
        let cmd = Cli::command();
        let mut seen: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
        for sub in cmd.get_subcommands() {
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                let value = if arg.get_action().takes_values() {
                    arg.get_value_names().map_or_else(
                        || "VALUE".to_owned(),
                        |v| {
                            v.iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(" ")
                        },
                    )
                } else {
                    "switch".to_owned()
                };
                seen.entry(long.to_owned())
                    .or_default()
                    .entry(value)
                    .or_default()
                    .push(sub.get_name().to_owned());
            }
        }
        let mixed: Vec<String> = seen
            .iter()
            .filter(|(_, values)| values.len() > 1)
            .map(|(long, values)| format!("--{long}: {values:?}"))
            .collect();
        assert!(
            mixed.is_empty(),
            "flags spelled differently across commands:\n{}",
            mixed.join("\n")
        );
        for switch in ["json", "quiet"] {
            if let Some(values) = seen.get(switch) {
                assert!(values.contains_key("switch"), "--{switch}: {values:?}");
            }
        }
        // `--from` is `layout`'s (a checkpoint to derive the model from) and nobody else's.
        assert_eq!(
            seen["from"].values().flatten().collect::<Vec<_>>(),
            ["layout"]
        );
    }
}
