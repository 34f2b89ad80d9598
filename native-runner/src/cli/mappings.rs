//! `shardscope mappings`: the built-in name mappings of `convert --to hf` / `--to torchtitan`, and
//! the text of one, to start a mapping file of one's own from.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::Args;
use shardscope_core::transform::mapping::{self, BUILTIN};

use super::print_stdout;

#[derive(Debug, Clone, Args)]
pub struct MappingsArgs {
    /// Print this built-in mapping's file (by name, e.g. `torchtitan-llama3`), to copy and edit
    /// for `convert --mapping FILE`.
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
    /// The list as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &MappingsArgs) -> Result<ExitCode> {
    let files = mapping::builtin();
    if let Some(name) = &args.name {
        let Some(i) = files.iter().position(|f| &f.name == name) else {
            bail!(
                "no built-in mapping `{name}`\nhint: the built-in ones are {}",
                files
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        print_stdout(BUILTIN[i].1)?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.json {
        let list: Vec<serde_json::Value> = files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "name": f.name, "from": f.from, "to": f.to,
                    "architectures": f.matches.architectures, "model_type": f.matches.model_type,
                    "keys": f.matches.keys, "backward": !f.matches.target_keys.is_empty(),
                    "rules": f.rules.len(), "description": f.description,
                })
            })
            .collect();
        print_stdout(&format!("{}\n", serde_json::to_string_pretty(&list)?))?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut text = String::new();
    for f in &files {
        let _ = write!(
            text,
            "{:<24} {} -> {}{}  {}\n    {}\n",
            f.name,
            f.from,
            f.to,
            if f.matches.target_keys.is_empty() {
                ""
            } else {
                " (and back)"
            },
            f.matches.architectures.join(", "),
            f.description
        );
    }
    text.push_str(
        "\n`shardscope mappings NAME` prints a file; `convert --mapping FILE` uses your own.\n",
    );
    print_stdout(&text)?;
    Ok(ExitCode::SUCCESS)
}
