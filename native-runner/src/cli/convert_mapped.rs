//! `shardscope convert --to hf` and `--to torchtitan`: the model part of a checkpoint in another
//! naming, through a mapping file (`shardscope_core::transform::mapping`, chosen from the config and
//! the stored names) laid over the index (`crate::convert::mapped`), streamed by the same engine
//! as every conversion.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use shardscope_core::checkpoint::Checkpoint;
use shardscope_core::index::{EntryKind, IndexEntry};
use shardscope_core::transform::mapping::{self, Direction, MappingFile, Plan, Stored};

use shardscope_runner::gather::output::human_bytes;

use super::convert::{Bar, ConvertArgs, Target, target_of, write_options};
use super::print_stdout;
use crate::convert::{self, Reader, mapped};
use crate::input::Input;

/// The default shard size of `--to hf`, as `save_pretrained`'s `max_shard_size="5GB"`.
pub const DEFAULT_HF_SHARD_BYTES: u64 = 5_000_000_000;

/// The most bytes of one `--hf-assets` file copied (a tokenizer is a few MiB).
const MAX_ASSET_BYTES: u64 = 1 << 30;

/// Whether a file of a Hugging Face model folder is a tokenizer or generation file.
fn is_asset(name: &str) -> bool {
    let ext = Path::new(name)
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    name.starts_with("tokenizer")
        || name.starts_with("vocab.")
        || name.starts_with("chat_template")
        || matches!(ext.as_deref(), Some("model" | "tiktoken"))
        || matches!(
            name,
            "special_tokens_map.json"
                | "generation_config.json"
                | "merges.txt"
                | "added_tokens.json"
                | "preprocessor_config.json"
        )
}

/// The tokenizer and generation files of `dir`, by name.
fn assets(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    let listing =
        std::fs::read_dir(dir).with_context(|| format!("--hf-assets {}", dir.display()))?;
    for item in listing {
        let item = item.with_context(|| format!("--hf-assets {}", dir.display()))?;
        let name = item.file_name().to_string_lossy().into_owned();
        let meta = item.metadata()?;
        if !meta.is_file() || !is_asset(&name) {
            continue;
        }
        if meta.len() > MAX_ASSET_BYTES {
            bail!(
                "--hf-assets: {} is {} (more than a tokenizer file holds)",
                item.path().display(),
                human_bytes(meta.len())
            );
        }
        let bytes = std::fs::read(item.path())
            .with_context(|| format!("cannot read {}", item.path().display()))?;
        out.push((name, bytes));
    }
    out.sort();
    if out.is_empty() {
        bail!(
            "--hf-assets {}: no tokenizer or generation files there (tokenizer*, special_tokens_map.json, generation_config.json, vocab.*, merges.txt, *.model)",
            dir.display()
        );
    }
    Ok(out)
}

/// The config as given, with `torch_dtype` (and transformers 5's `dtype`, when present) set to
/// `--dtype`.
fn read_config(args: &ConvertArgs) -> Result<serde_json::Value> {
    let path = args
        .config
        .as_deref()
        .context("--config CONFIG.json is needed")?;
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut config: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{}: not a JSON config", path.display()))?;
    let Some(obj) = config.as_object_mut() else {
        bail!("{}: a config is a JSON object", path.display());
    };
    if let Some(dtype) = args.dtype {
        obj.insert("torch_dtype".to_owned(), dtype.name().into());
        if obj.contains_key("dtype") {
            obj.insert("dtype".to_owned(), dtype.name().into());
        }
    }
    Ok(config)
}

fn mapping_files(args: &ConvertArgs) -> Result<Vec<MappingFile>> {
    match &args.mapping {
        None => Ok(mapping::builtin()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Ok(vec![parse_mapping(&text, &path.display().to_string())?])
        }
    }
}

/// Fails unless the output a tie leaves out equals the one kept (read both, compare the bytes).
fn check_tie(
    source: &Input,
    index: &shardscope_core::index::CheckpointIndex,
    plan: &Plan,
    label: &str,
) -> Result<Option<(String, String)>> {
    let Some(tied) = &plan.tied else {
        return Ok(None);
    };
    let (kept_index, kept_derived) = mapped::mapped_index(
        index,
        &Plan {
            outputs: plan
                .outputs
                .iter()
                .filter(|o| o.name == tied.kept)
                .cloned()
                .collect(),
            ..Plan::default()
        },
    )?;
    let (drop_index, drop_derived) = mapped::mapped_index(
        index,
        &Plan {
            outputs: vec![tied.dropped.clone()],
            ..Plan::default()
        },
    )?;
    let read = |idx: &shardscope_core::index::CheckpointIndex,
                d: &mapped::Derivations|
     -> Result<Vec<u8>> {
        let entry = idx.entries.first().context("a tied tensor")?;
        let mut reader = Reader::with_derived(source, idx, d);
        let mut buf = Vec::new();
        let (dtype, _) = convert::tensor_meta(entry)?;
        let n = reader.tensor_as(entry, dtype, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    };
    let a = read(&kept_index, &kept_derived)?;
    let b = read(&drop_index, &drop_derived)?;
    let same_meta = kept_index.entries[0].dtype == drop_index.entries[0].dtype
        && kept_index.entries[0].shape == drop_index.entries[0].shape;
    if !same_meta || a != b {
        bail!(
            "{label}: the config ties `{}` and `{}` (tie_word_embeddings), but the checkpoint holds two different tensors for them\nhint: set \"tie_word_embeddings\": false in the config (both are written), or check that the config is this model's",
            tied.kept,
            tied.dropped.name
        );
    }
    Ok(Some((tied.kept.clone(), tied.dropped.name.clone())))
}

/// A plan and how many stored tensors it read.
pub struct MappedPlan {
    pub plan: Plan,
    pub stored: usize,
}

/// The model part of a checkpoint in another naming: the mapping chosen, its plan, the index it
/// lays over the stored one with the recipes of derived tensors, the tie it checked, and the
/// non-tensor values it leaves out.
pub struct Mapped {
    pub file: MappingFile,
    pub direction: Direction,
    pub plan: MappedPlan,
    pub index: shardscope_core::index::CheckpointIndex,
    pub derived: mapped::Derivations,
    /// `(kept, dropped)`: the config ties them and the checkpoint holds equal tensors.
    pub tied: Option<(String, String)>,
    pub values: Vec<String>,
    /// Tensors the mapping leaves out that are not zero although the other model has no place for
    /// them (gpt_oss's `expert_bias_E`: the HF model routes without it).
    pub lost: Vec<String>,
}

impl Mapped {
    /// The warning about [`Self::lost`], if any.
    pub fn lost_warning(&self) -> Option<String> {
        (!self.lost.is_empty()).then(|| {
            format!(
                "{} left out by the mapping `{}` and not zero: {}; the {} model has no place for them, so it does not compute what the checkpoint's model did (expected zero: e.g. a MoE load-balancing bias that was never updated)",
                if self.lost.len() == 1 { "a tensor is" } else { "tensors are" },
                self.file.name,
                self.lost.join(", "),
                self.file.to
            )
        })
    }
}

/// The tensors of `names` whose values are not all zero (read one at a time).
fn not_zero(
    source: &Input,
    index: &shardscope_core::index::CheckpointIndex,
    names: &[&String],
) -> Result<Vec<String>> {
    let mut reader = Reader::new(source, index);
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for name in names {
        let Some(entry) = index.entry(name) else {
            continue;
        };
        let (dtype, _) = convert::tensor_meta(entry)?;
        let n = reader.tensor_as(entry, dtype, &mut buf)?;
        // A floating -0.0 is zero too: its sign bit (the top bit of its last byte) is ignored.
        let size = dtype.size_bytes().max(1);
        let zero = if dtype.is_floating_point() {
            buf[..n].chunks_exact(size).all(|e| {
                e.split_last().is_some_and(|(last, rest)| {
                    last.trailing_zeros() >= 7 && rest.iter().all(|&b| b == 0)
                })
            })
        } else {
            buf[..n].iter().all(|&b| b == 0)
        };
        if !zero {
            out.push((*name).clone());
        }
    }
    Ok(out)
}

/// Maps the tensors of `index` (the model part of a checkpoint, read from `source`) to the
/// `target` naming (`hf`, `torchtitan`) through the mapping of `files` that `config` and the
/// stored names choose: what `convert --to` writes and `Checkpoint.state_dict(to=...)` reads.
pub fn map_model(
    source: &Input,
    index: &shardscope_core::index::CheckpointIndex,
    label: &str,
    target: &str,
    config: &serde_json::Value,
    files: &[MappingFile],
) -> Result<Mapped> {
    let mut tensors: Vec<&IndexEntry> = index
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Tensor)
        .collect();
    tensors.sort_by(|a, b| {
        (a.position.is_none(), a.position, &a.key).cmp(&(b.position.is_none(), b.position, &b.key))
    });
    let stored: Vec<Stored> = tensors
        .iter()
        .map(|e| {
            let (dtype, shape) = convert::tensor_meta(e)?;
            Ok(Stored {
                name: e.key.clone(),
                dtype,
                shape: shape.to_vec(),
            })
        })
        .collect::<Result<_>>()?;
    let values: Vec<String> = index
        .entries
        .iter()
        .filter(|e| e.kind != EntryKind::Tensor)
        .map(|e| e.key.clone())
        .collect();
    let names: Vec<&str> = stored.iter().map(|s| s.name.as_str()).collect();
    let (file, direction) =
        mapping::choose(files, target, config, &names).map_err(|e| anyhow!("{label}: {e}"))?;
    let plan =
        mapping::plan(file, direction, config, &stored).map_err(|e| anyhow!("{label}: {e}"))?;
    let tied = check_tie(source, index, &plan, label)?;
    let restored: Vec<&String> = plan
        .dropped
        .iter()
        .filter(|d| direction == Direction::Forward && mapping::restored_as_zeros(file, d))
        .collect();
    let lost = not_zero(source, index, &restored)?;
    let (mapped_index, derived) = mapped::mapped_index(index, &plan)?;
    Ok(Mapped {
        file: file.clone(),
        direction,
        plan: MappedPlan {
            plan,
            stored: stored.len(),
        },
        index: mapped_index,
        derived,
        tied,
        values,
        lost,
    })
}

/// Reads a mapping file given by the user.
pub fn parse_mapping(text: &str, origin: &str) -> Result<MappingFile> {
    mapping::parse(text, origin).map_err(|e| anyhow!("{e}"))
}

#[allow(
    clippy::too_many_lines,
    reason = "reads the config, plans, checks the tie, writes and reports in one place"
)]
pub fn run(
    args: &ConvertArgs,
    checkpoint: &Checkpoint,
    source: &Input,
    started: Instant,
) -> Result<ExitCode> {
    let target = target_of(args)?;
    let target_name = if target == Target::Hf {
        "hf"
    } else {
        "torchtitan"
    };
    let quiet = args.quiet || args.json;
    let label = &checkpoint.label;
    let index = &checkpoint.index;
    convert::ensure_consistent(Path::new(&super::read::shown(&args.src)), index)?;
    if target == Target::Torchtitan
        && args.world_size.is_none()
        && args.output.extension().is_none_or(|e| e != "safetensors")
    {
        bail!(
            "--to torchtitan writes a .safetensors file, or with --world-size N a DCP directory; {} is neither\nhint: -o model.safetensors, or add --world-size N",
            args.output.display()
        );
    }
    if args.hf_assets.is_some() && target != Target::Hf {
        bail!("--hf-assets applies to --to hf");
    }
    let mut config = read_config(args)?;
    let files = mapping_files(args)?;
    let mapped = map_model(source, index, label, target_name, &config, &files)?;
    let lost_warning = mapped.lost_warning();
    let Mapped {
        file,
        direction,
        plan,
        index: mapped_index,
        derived,
        tied,
        values,
        lost,
    } = mapped;
    if let Some(w) = &lost_warning {
        eprintln!("warning: {w}");
    }
    if !quiet {
        eprintln!(
            "note: mapping `{}` ({}){}: {} stored tensors -> {} tensors{}",
            file.name,
            file.origin,
            if direction == Direction::Backward {
                format!(", read backward ({} -> {})", file.to, file.from)
            } else {
                String::new()
            },
            plan.stored,
            plan.plan.outputs.len(),
            if plan.plan.dropped.is_empty() {
                String::new()
            } else {
                format!(
                    "; left out by the mapping: {}",
                    plan.plan.dropped.join(", ")
                )
            }
        );
        if !values.is_empty() {
            eprintln!(
                "note: {} non-tensor value(s) of the model part are not written: {}",
                values.len(),
                values.join(", ")
            );
        }
    }
    // A config without a dtype gets the one the weights are written in (as `save_pretrained`
    // records it), when they have one.
    let float_dtypes: std::collections::BTreeSet<_> = plan
        .plan
        .outputs
        .iter()
        .map(|o| shardscope_core::cast::cast_target(o.dtype, args.dtype))
        .filter(|d| d.is_floating_point())
        .collect();
    if let (Some(obj), [dtype]) = (
        config.as_object_mut(),
        float_dtypes.into_iter().collect::<Vec<_>>().as_slice(),
    ) && !obj.contains_key("torch_dtype")
        && !obj.contains_key("dtype")
    {
        obj.insert("torch_dtype".to_owned(), dtype.name().into());
    }
    if let Some((kept, dropped)) = &tied
        && !quiet
    {
        eprintln!(
            "note: `{dropped}` equals `{kept}` (the config ties them): written once, as `{kept}`"
        );
    }
    let mut sel = convert::select(&mapped_index, None)?;
    sel.cast = args.dtype;
    // Names kept as they are (the HF mapping): a weight tied by shared storage or equal bytes is
    // written once, as `save_pretrained` writes it.
    let mut tied = tied.into_iter().collect::<Vec<_>>();
    if target == Target::Hf && derived.is_empty() && !args.keep_tied {
        let untied = convert::drop_tied(source, &mapped_index, &mut sel)?;
        if !quiet {
            for (kept, dropped) in &untied {
                eprintln!(
                    "note: `{dropped}` is tied to `{kept}` (one tensor): written once, as `{kept}` (--keep-tied writes both)"
                );
            }
        }
        tied.extend(untied);
    }
    let dir_output = target == Target::Hf || args.world_size.is_some();
    let opts = write_options(args, dir_output)?;
    let bar = Bar::for_bytes(sel.tensor_bytes(), args.quiet);
    let mut reader = Reader::with_derived(source, &mapped_index, &derived);
    let written = match (target, args.world_size) {
        (Target::Hf, _) => {
            let mut extra = vec![(
                "config.json".to_owned(),
                format!("{}\n", serde_json::to_string_pretty(&config)?).into_bytes(),
            )];
            if let Some(dir) = &args.hf_assets {
                extra.extend(assets(dir)?);
            }
            convert::to_safetensors(
                &mut reader,
                &sel,
                &args.output,
                Some(args.max_shard_size.unwrap_or(DEFAULT_HF_SHARD_BYTES)),
                &extra,
                &opts,
                &bar,
            )
        }
        (_, Some(world_size)) => convert::to_dcp(
            &mut reader,
            &sel,
            &args.output,
            world_size,
            args.api,
            None,
            &[],
            &opts,
            &bar,
        ),
        (_, None) => {
            convert::to_safetensors(&mut reader, &sel, &args.output, None, &[], &opts, &bar)
        }
    };
    if let Some(bar) = &bar.0 {
        bar.finish_and_clear();
    }
    let written = written?;
    super::convert::manifest_note(&written, quiet);
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let summary = serde_json::json!({
            "source": super::read::shown(&args.src),
            "source_kind": index.kind,
            "to": target_name,
            "mapping": {"name": file.name, "file": file.origin, "direction": format!("{direction:?}").to_ascii_lowercase()},
            "outputs": written.outputs,
            "tensors": written.tensors,
            "tensor_bytes": written.tensor_bytes,
            "largest_tensor_bytes": written.largest_tensor_bytes,
            "dtype": args.dtype.map(shardscope_core::DType::name),
            "dropped_by_mapping": plan.plan.dropped,
            "dropped_not_zero": lost,
            "tied_dropped": tied.iter().map(|(kept, dropped)| serde_json::json!({"kept": kept, "dropped": dropped})).collect::<Vec<_>>(),
            "values_not_written": values,
            "seconds": seconds,
            "threads": opts.exec.threads,
            "memory_limit_bytes": written.memory_limit_bytes,
            "complete": written.complete,
            "manifest": written.manifest,
            "manifest_files_left_out": written.undigested,
        });
        print_stdout(&format!("{}\n", serde_json::to_string_pretty(&summary)?))?;
    } else if !args.quiet {
        eprintln!(
            "wrote {} ({} tensors, {}, mapping `{}`) in {seconds:.2} s",
            args.output.display(),
            written.tensors,
            human_bytes(written.tensor_bytes),
            file.name
        );
    }
    Ok(ExitCode::SUCCESS)
}
