//! `shardscope layout`: the per-rank layout of a model under an FSDP configuration.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use shardscope_core::DType;
use shardscope_core::checkpoint::DescribeOptions;
use shardscope_core::layout::{
    self, Api, FlatParamLayout, Fsdp1Layout, Fsdp2Layout, Layout, LayoutConfig, Strategy,
    fsdp1::PieceKind,
};
use shardscope_core::model::ModelDescription;

use shardscope_runner::gather::output::human_bytes;

use super::print_stdout;

#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// Model description (JSON: params in registration order, FSDP unit prefixes).
    #[arg(
        long,
        value_name = "MODEL.json",
        required_unless_present = "from",
        conflicts_with = "from"
    )]
    pub model: Option<PathBuf>,
    /// Derive the description from a checkpoint (`.pt`, DCP directory, per-rank files, safetensors):
    /// its floating-point tensor entries in stored order. FSDP units: --units, or by default the
    /// repeated blocks (`model.layers.N`, `transformer.h.N`, `blocks.N`) and the root, as the
    /// transformer-block auto-wrap policies wrap them; the model part of an app state is found.
    #[arg(long = "from", value_name = "CKPT", num_args = 1..)]
    pub from: Vec<PathBuf>,
    /// With --from: a regex; every module prefix (dotted prefix of a parameter FQN) it matches in
    /// full becomes an FSDP unit, e.g. `layers\.\d+` (default: the repeated blocks and the root).
    #[arg(long, value_name = "REGEX", requires = "from")]
    pub units: Option<String>,
    /// With --from: also make the root module (`""`) a unit.
    #[arg(long, requires = "from")]
    pub root_unit: bool,
    /// With --from: leave out entries whose FQN this regex matches in full (buffers, e.g. `.*\.rope\..*`).
    #[arg(long, value_name = "REGEX", requires = "from")]
    pub exclude: Option<String>,
    /// With --from: take only the entries under `PREFIX.` (e.g. `model` in a DCP app state), prefix removed.
    #[arg(long, value_name = "PREFIX", requires = "from")]
    pub select: Option<String>,
    /// With --from: write the derived model description (JSON, the --model format) to this file.
    #[arg(long, value_name = "OUT.json", requires = "from")]
    pub emit_model: Option<PathBuf>,
    /// With --from: do not look for tied weights. By default a parameter that shares its storage
    /// with an earlier one (`torch.save`), or has its dtype, shape and bytes (DCP, safetensors), is
    /// marked `shared_with` it and takes no space in the flat parameter, as torch does.
    #[arg(long, requires = "from")]
    pub no_tie_detection: bool,
    /// Number of ranks.
    #[arg(long, value_name = "N")]
    pub world_size: u64,
    /// FSDP implementation: fsdp1 (flat parameters) or fsdp2 (fully_shard, DTensor).
    #[arg(long, default_value = "fsdp1", value_parser = super::read::parse_api)]
    pub api: Api,
    /// FSDP1 `use_orig_params=True` (adds alignment and world-size padding).
    #[arg(long)]
    pub use_orig_params: bool,
    /// FSDP1 sharding strategy: full_shard, shard_grad_op, no_shard, hybrid_shard.
    #[arg(long, default_value = "full_shard", value_parser = super::read::parse_strategy)]
    pub strategy: Strategy,
    /// Ranks per shard group for hybrid_shard / FSDP2 HSDP (groups of consecutive ranks).
    #[arg(long, value_name = "S")]
    pub shard_group_size: Option<u64>,
    /// Mixed-precision compute dtype (MixedPrecision.param_dtype); sets the alignment unit.
    #[arg(long, value_name = "DTYPE", value_parser = super::read::parse_dtype)]
    pub param_dtype: Option<DType>,
    /// Only show these ranks (inside the shard group) in the human output, e.g. `--rank 0 --rank 3`.
    #[arg(long = "rank", value_name = "R")]
    pub ranks: Vec<u64>,
    /// Print the layout as JSON.
    #[arg(long)]
    pub json: bool,
}

fn full_match(pattern: &str, what: &str) -> anyhow::Result<regex::Regex> {
    regex::Regex::new(&format!("^(?:{pattern})$"))
        .with_context(|| format!("{what}: invalid regular expression `{pattern}`"))
}

/// `--from`: the description derived from a checkpoint's entries in stored order.
#[allow(
    clippy::too_many_lines,
    reason = "the --from steps in order: read, order keys, derive, warn with hints, emit, compare with --model"
)]
fn model_from_checkpoint(args: &LayoutArgs) -> anyhow::Result<ModelDescription> {
    let where_ = args
        .from
        .iter()
        .map(|p| super::read::shown(p))
        .collect::<Vec<_>>()
        .join(", ");
    let units = args
        .units
        .as_deref()
        .map(|u| full_match(u, "--units"))
        .transpose()?;
    let exclude = args
        .exclude
        .as_deref()
        .map(|e| full_match(e, "--exclude"))
        .transpose()?;
    // The pieces as stored: the description comes from the model's entries in stored order.
    let (source, checkpoint) = super::read::open_stored(
        &args.from,
        true,
        &shardscope_core::checkpoint::ReadOptions::default(),
    )?;
    super::read::show_notes(&checkpoint, false);
    // The model part of an app state, found unless --select says.
    let select = match &args.select {
        Some(s) => Some(s.clone()),
        None => shardscope_core::checkpoint::app_state_prefix(&checkpoint.index).map(|p| {
            eprintln!(
                "note: the model is under `{p}` in {where_} (an app-state key): its entries are taken, `{p}.` removed (--select PREFIX to choose)"
            );
            p.to_owned()
        }),
    };
    let blocks = if units.is_none() {
        let blocks = shardscope_core::checkpoint::repeated_blocks(
            shardscope_core::checkpoint::model_fqns(&checkpoint.index, select.as_deref()),
        );
        let lists: Vec<String> = blocks
            .iter()
            .map(|(l, n)| format!("`{l}.N` ({n} blocks)"))
            .collect();
        eprintln!(
            "note: units: {}the root, as transformer-block auto-wrap policies (HF, accelerate, torchtitan) wrap them\nhint: --units REGEX [--root-unit] chooses others (e.g. --units '{}' --root-unit)",
            if lists.is_empty() {
                "no repeated blocks found; ".to_owned()
            } else {
                format!("{} and ", lists.join(", "))
            },
            blocks.first().map_or_else(
                || r"layers\.\d+".to_owned(),
                |(l, _)| format!(r"{}\.\d+", l.replace('.', r"\."))
            )
        );
        Some(blocks)
    } else {
        None
    };
    let is_unit = |prefix: &str| match (&units, &blocks) {
        (Some(u), _) => u.is_match(prefix),
        (None, Some(b)) => shardscope_core::checkpoint::is_block(b, prefix),
        (None, None) => false,
    };
    let is_excluded = |fqn: &str| exclude.as_ref().is_some_and(|r| r.is_match(fqn));
    let described = checkpoint.describe(
        &source,
        &DescribeOptions {
            select: select.as_deref(),
            exclude: Some(&is_excluded),
            is_unit: &is_unit,
            root_unit: args.root_unit || units.is_none(),
            detect_ties: !args.no_tie_detection,
        },
    )?;
    for note in &described.notes {
        eprintln!("{note}");
    }
    let derived = described.derived;
    eprintln!(
        "note: {} parameters from {where_}; units: {}",
        derived.model.params.len(),
        derived
            .model
            .units
            .iter()
            .map(|u| unit_name(u))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(out) = &args.emit_model {
        let mut text = serde_json::to_string_pretty(&derived.model)?;
        text.push('\n');
        crate::atomic::write_file_replacing(out, |w| {
            std::io::Write::write_all(w, text.as_bytes())
                .with_context(|| format!("cannot write {}", out.display()))
        })?;
        eprintln!("wrote {}", out.display());
    }
    Ok(derived.model)
}

pub fn run(args: &LayoutArgs) -> anyhow::Result<ExitCode> {
    let model = if let Some(path) = &args.model {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read model description {}", path.display()))?;
        ModelDescription::from_json_bytes(&bytes, &path.display().to_string())?
    } else {
        model_from_checkpoint(args)?
    };
    let config = LayoutConfig {
        api: args.api,
        world_size: args.world_size,
        shard_group_size: args.shard_group_size,
        use_orig_params: args.use_orig_params,
        strategy: args.strategy,
        param_dtype: args.param_dtype,
    };
    let layout = layout::compute(&model, &config)?;
    let text = if args.json {
        let mut s = serde_json::to_string_pretty(&layout)?;
        s.push('\n');
        s
    } else {
        match &layout {
            Layout::Fsdp1(l) => render_fsdp1(l, &args.ranks),
            Layout::Fsdp2(l) => render_fsdp2(l, &args.ranks),
        }
    };
    print_stdout(&text)?;
    Ok(ExitCode::SUCCESS)
}

fn shown(ranks: &[u64], rank: u64) -> bool {
    ranks.is_empty() || ranks.contains(&rank)
}

fn shape_str(shape: &[u64]) -> String {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

fn unit_name(prefix: &str) -> &str {
    if prefix.is_empty() { "(root)" } else { prefix }
}

struct RankTotals {
    elements: Vec<u64>,
    real: Vec<u64>,
    bytes: Vec<u64>,
}

impl RankTotals {
    fn new(n: u64) -> Self {
        let n = n as usize;
        Self {
            elements: vec![0; n],
            real: vec![0; n],
            bytes: vec![0; n],
        }
    }

    fn render(&self, out: &mut String, ranks: &[u64]) {
        let _ = writeln!(
            out,
            "\nper-rank totals (one shard group; other groups hold replicas):"
        );
        let _ = writeln!(
            out,
            "  {:>6}  {:>14}  {:>14}  {:>14}  {:>12}",
            "rank", "elements", "real", "padding", "bytes"
        );
        for (r, ((&e, &real), &b)) in self
            .elements
            .iter()
            .zip(&self.real)
            .zip(&self.bytes)
            .enumerate()
        {
            if !shown(ranks, r as u64) {
                continue;
            }
            let _ = writeln!(
                out,
                "  {r:>6}  {e:>14}  {real:>14}  {:>14}  {:>12}",
                e - real,
                human_bytes(b)
            );
        }
        let total_real: u64 = self.real.iter().sum();
        let max_real = self.real.iter().copied().max().unwrap_or(0);
        let min_real = self.real.iter().copied().min().unwrap_or(0);
        let total_elems: u64 = self.elements.iter().sum();
        let mean = total_real as f64 / self.real.len().max(1) as f64;
        let imbalance = if mean > 0.0 {
            max_real as f64 / mean
        } else {
            1.0
        };
        let _ = writeln!(
            out,
            "  real elements per rank: min {min_real}, max {max_real}, imbalance (max/mean) {imbalance:.3}"
        );
        let _ = writeln!(
            out,
            "  padding: {} of {} elements held ({:.2}%)",
            total_elems - total_real,
            total_elems,
            if total_elems > 0 {
                100.0 * (total_elems - total_real) as f64 / total_elems as f64
            } else {
                0.0
            }
        );
    }
}

fn render_fsdp1(l: &Fsdp1Layout, ranks: &[u64]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "FSDP1 layout: world size {}, shard group {}, strategy {}, use_orig_params={}",
        l.world_size, l.shard_group_size, l.strategy, l.use_orig_params
    );
    for note in &l.notes {
        let _ = writeln!(out, "note: {note}");
    }
    let n_ranks = l
        .flat_params
        .first()
        .map_or(l.shard_group_size, |f| f.ranks.len() as u64);
    let mut totals = RankTotals::new(n_ranks);
    for flat in &l.flat_params {
        render_flat_param(&mut out, flat, ranks);
        for r in 0..n_ranks {
            let real = flat.rank_real_numel(r);
            totals.elements[r as usize] += flat.sharded_numel;
            totals.real[r as usize] += real;
            totals.bytes[r as usize] += flat.sharded_numel * flat.dtype.size_bytes() as u64;
        }
    }
    totals.render(&mut out, ranks);
    render_lists(
        &mut out,
        &l.unmanaged_params,
        &l.ignored_params,
        &l.units_without_params,
    );
    out
}

fn render_flat_param(out: &mut String, flat: &FlatParamLayout, ranks: &[u64]) {
    let pad = flat.padding_segment_numel();
    let _ = writeln!(
        out,
        "\nunit {}  {}  {}  {} params, {} elements ({} padding), {} per rank{}",
        unit_name(&flat.unit_prefix),
        flat.flat_param_fqn,
        flat.dtype,
        flat.fqns.len(),
        flat.unpadded_unsharded_numel,
        pad,
        flat.sharded_numel,
        if flat.requires_grad { "" } else { ", frozen" }
    );
    let mut segs = Vec::new();
    let mut param = 0;
    for (&n, &is_pad) in flat.numels_with_padding.iter().zip(&flat.is_padding_mask) {
        if is_pad {
            segs.push(format!("pad {n}"));
        } else {
            segs.push(format!(
                "{} {}",
                flat.fqns[param],
                shape_str(&flat.shapes[param])
            ));
            param += 1;
        }
    }
    let _ = writeln!(out, "  flat: {}", segs.join(" | "));
    for shared in &flat.shared_params {
        let _ = writeln!(
            out,
            "  tied: {} -> {} (no space of its own)",
            shared.fqn, shared.prim_fqn
        );
    }
    for rank in &flat.ranks {
        if !shown(ranks, rank.rank) {
            continue;
        }
        let pieces: Vec<String> = flat
            .rank_pieces(rank.rank)
            .iter()
            .map(|p| match p.kind {
                PieceKind::Param { param, intra_start } => format!(
                    "{}[{}..{}]",
                    flat.fqns[param],
                    intra_start,
                    intra_start + p.numel
                ),
                PieceKind::SegmentPadding => format!("pad({})", p.numel),
                PieceKind::ShardTail => format!("tail({})", p.numel),
            })
            .collect();
        let _ = writeln!(
            out,
            "  rank {:>4}: {}",
            rank.rank,
            if pieces.is_empty() {
                "(empty)".to_owned()
            } else {
                pieces.join(" ")
            }
        );
    }
}

fn render_fsdp2(l: &Fsdp2Layout, ranks: &[u64]) -> String {
    let mut out = String::new();
    let mesh: Vec<String> = l.mesh_shape.iter().map(u64::to_string).collect();
    let _ = writeln!(
        out,
        "FSDP2 layout: world size {}, mesh ({}), shard group {}",
        l.world_size,
        mesh.join(", "),
        l.shard_group_size
    );
    let mut totals = RankTotals::new(l.shard_group_size);
    for unit in &l.units {
        let _ = writeln!(
            out,
            "\nunit {}  {} params, all-gather input {} elements per rank",
            unit_name(&unit.unit_prefix),
            unit.params.len(),
            unit.all_gather_input_numel
        );
        for shared in &unit.shared_params {
            let _ = writeln!(out, "  tied: {} -> {}", shared.fqn, shared.prim_fqn);
        }
        for p in &unit.params {
            let _ = writeln!(
                out,
                "  {} {} {} {}  padded shard {}",
                p.fqn,
                shape_str(&p.shape),
                p.dtype,
                p.placements.join(","),
                shape_str(&p.padded_sharded_shape)
            );
            let padded = p.padded_sharded_numel();
            for r in &p.ranks {
                let local: u64 = r.local_shape.iter().product();
                totals.elements[r.rank as usize] += padded;
                totals.real[r.rank as usize] += local;
                totals.bytes[r.rank as usize] += padded * p.dtype.size_bytes() as u64;
                if !shown(ranks, r.rank) {
                    continue;
                }
                let rows = if r.local_shape.first() == Some(&0) {
                    "(empty)".to_owned()
                } else {
                    format!(
                        "rows {}..{}",
                        r.global_offset[0],
                        r.global_offset[0] + r.local_shape[0]
                    )
                };
                let _ = writeln!(
                    out,
                    "    rank {:>4}: local {} {}{}",
                    r.rank,
                    shape_str(&r.local_shape),
                    rows,
                    if local < padded {
                        format!(", tail({})", padded - local)
                    } else {
                        String::new()
                    }
                );
            }
        }
    }
    totals.render(&mut out, ranks);
    render_lists(
        &mut out,
        &l.unmanaged_params,
        &l.ignored_params,
        &l.units_without_params,
    );
    out
}

fn render_lists(
    out: &mut String,
    unmanaged: &[String],
    ignored: &[String],
    empty_units: &[String],
) {
    if !unmanaged.is_empty() {
        let _ = writeln!(
            out,
            "\nunmanaged (replicated, not sharded): {}",
            unmanaged.join(", ")
        );
    }
    if !ignored.is_empty() {
        let _ = writeln!(out, "ignored: {}", ignored.join(", "));
    }
    if !empty_units.is_empty() {
        let names: Vec<&str> = empty_units.iter().map(|u| unit_name(u)).collect();
        let _ = writeln!(out, "units without parameters: {}", names.join(", "));
    }
}
