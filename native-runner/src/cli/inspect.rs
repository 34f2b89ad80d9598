//! `shardscope inspect`: what a checkpoint holds, where every chunk lives, and whether the
//! chunks tile their tensors.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use regex::Regex;
use shardscope_core::index::{self, CheckpointIndex, EntryKind, IndexEntry, Problem, ValueStats};
use shardscope_core::source::Source;

use shardscope_runner::gather::output::human_bytes;

use super::print_stdout;

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A checkpoint file, a DCP directory, a folder of per-rank files or of safetensors, or several
    /// per-rank files of one checkpoint (`rank*_model.pt`).
    #[arg(value_name = "PATH", required = true)]
    pub paths: Vec<PathBuf>,
    /// Print the canonical index as JSON.
    #[arg(long)]
    pub json: bool,
    /// Only keys matching this regular expression.
    #[arg(long, value_name = "REGEX")]
    pub filter: Option<String>,
    /// Only keys under PREFIX (`PREFIX.` starts them), shown with `PREFIX.` removed, as
    /// `convert --select PREFIX` writes them: a plain prefix, which says when it leaves out model
    /// tensors (PREFIX starting the model's own names, HF's `model.` beside `lm_head.weight`).
    #[arg(long, value_name = "PREFIX")]
    pub select: Option<String>,
    /// Read the values: per-tensor min, max, mean, NaN and inf counts; decoded non-tensor values.
    #[arg(long)]
    pub values: bool,
    #[command(flatten)]
    pub read: super::read::ReadArgs,
}

fn ranks_text(entry: &IndexEntry) -> String {
    let ranks: Vec<u32> = entry.ranks().into_iter().collect();
    if ranks.is_empty() {
        return "-".into();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(match j - i {
            0 => ranks[i].to_string(),
            1 => format!("{},{}", ranks[i], ranks[j]),
            _ => format!("{}-{}", ranks[i], ranks[j]),
        });
        i = j + 1;
    }
    parts.join(",")
}

fn shape_text(entry: &IndexEntry) -> String {
    match (&entry.shape, entry.kind) {
        (Some(s), _) => format!(
            "[{}]",
            s.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        (None, EntryKind::Tensor) => {
            // Rank-local pieces: show each rank's local shape.
            let mut per: Vec<String> = entry
                .chunks
                .iter()
                .map(|c| {
                    format!(
                        "r{}:{:?}",
                        c.rank.map_or("?".into(), |r| r.to_string()),
                        c.sizes
                    )
                })
                .collect();
            per.dedup();
            format!("local {}", per.join(" "))
        }
        (None, _) => "-".into(),
    }
}

fn fmt_num(v: Option<f64>) -> String {
    // Fixed point, unless that would hide the value (float8_e8m0fnu spans 2^-127..2^127).
    v.map_or("-".into(), |x| {
        if x != 0.0 && !(1e-4..1e12).contains(&x.abs()) {
            format!("{x:.6e}")
        } else {
            format!("{x:.6}")
        }
    })
}

/// Prints (to stderr) an `unsafe-pickle` error for each pickle of `source` that torch's loaders
/// would unpickle with no restriction and that names globals they do not need; true when any.
fn show_unsafe_pickles(
    source: &dyn shardscope_core::source::Source,
    index: Option<&shardscope_core::index::CheckpointIndex>,
) -> bool {
    let findings = match index {
        // The bytes items of a remote DCP are not fetched (a request each); doctor reads them.
        Some(index) => shardscope_core::doctor::unsafe_loader_pickles_indexed(
            source,
            index,
            source.reads_are_local(),
        ),
        None => shardscope_core::doctor::unsafe_loader_pickles(source),
    };
    for f in &findings {
        eprintln!("error[{}]: {}", f.code, f.message);
    }
    !findings.is_empty()
}

/// Runs `inspect`; exit 0 when the checkpoint is consistent, 2 when a problem was found (or a
/// pickle torch would unpickle names code to run).
pub fn run(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let filter = args
        .filter
        .as_deref()
        .map(Regex::new)
        .transpose()
        .context("bad --filter regular expression")?;
    let paths = super::read::expand_ranks(&args.paths, args.read.files.ranks)?;
    let where_ = paths
        .iter()
        .map(|p| super::read::shown(p))
        .collect::<Vec<_>>()
        .join(" ");
    let (source, checkpoint) = match super::read::open(&paths, true, &args.read.options()?) {
        Ok(opened) => opened,
        Err(e) => {
            // A hostile pickle is rarely a valid checkpoint: why it is dangerous comes first.
            if let Ok(source) = crate::input::open(&paths, false) {
                show_unsafe_pickles(&source, None);
            }
            return Err(e);
        }
    };
    super::read::show_notes(&checkpoint, false);
    let unsafe_pickles = show_unsafe_pickles(&source, Some(&checkpoint.index));
    let written_by = checkpoint.written_by.clone();
    let mut idx = checkpoint.index;
    let problems = idx.check();
    narrow(&mut idx, args.select.as_deref(), filter.as_ref())?;
    let mut stats: BTreeMap<String, ValueStats> = BTreeMap::new();
    if args.values {
        idx.decode_bytes_values(&source)
            .with_context(|| format!("cannot decode values in {where_}"))?;
        if problems.is_empty() {
            for e in &idx.entries {
                if e.kind == EntryKind::Tensor {
                    let s = tensor_stats(&idx, &source, e)?;
                    if let Some(s) = s {
                        stats.insert(e.key.clone(), s);
                    }
                }
            }
        }
    }
    let summary = Summary::of(&idx, written_by);
    if args.json {
        // One entry's JSON tree at a time (a DCP of a million chunks would need gigabytes).
        let top = serde_json::Map::from_iter([
            ("summary".to_owned(), serde_json::to_value(&summary)?),
            ("problems".to_owned(), serde_json::to_value(&problems)?),
        ]);
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        let written = index::json::write_pretty(
            &mut out,
            &idx,
            |e| {
                stats
                    .get(&e.key)
                    .and_then(|s| serde_json::to_value(s).ok())
                    .map(|s| serde_json::Map::from_iter([("stats".to_owned(), s)]))
                    .unwrap_or_default()
            },
            top,
        )
        .map_err(std::io::Error::from)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
        match written {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            written => written?,
        }
    } else {
        print_stdout(&render(&idx, &stats, &summary, args.values))?;
    }
    if problems.is_empty() {
        return Ok(if unsafe_pickles {
            ExitCode::from(2)
        } else {
            ExitCode::SUCCESS
        });
    }
    let mut err = String::new();
    for p in &problems {
        let _ = writeln!(err, "error: {p}");
    }
    match single_rank_file(&idx) {
        Some((file, rank)) if problems.iter().all(Problem::is_gap) => {
            let _ = writeln!(
                err,
                "hint: every chunk in {file} belongs to rank {rank}: if it is one rank's file of a sharded checkpoint, the gaps are where the other ranks' shards go; inspect the folder with every rank's file to see whole tensors"
            );
        }
        _ => {
            let _ = writeln!(
                err,
                "hint: the checkpoint's chunks do not describe its tensors consistently; it is damaged or incomplete"
            );
        }
    }
    eprint!("{err}");
    Ok(ExitCode::from(2))
}

/// `--select` then `--filter`.
fn narrow(
    idx: &mut CheckpointIndex,
    select: Option<&str>,
    filter: Option<&Regex>,
) -> anyhow::Result<()> {
    if let Some(prefix) = select {
        select_prefix(idx, prefix)?;
    }
    if let Some(re) = filter {
        idx.entries.retain(|e| re.is_match(&e.key));
    }
    Ok(())
}

/// `--select PREFIX`: keeps the entries `convert --select PREFIX` takes (keys starting with
/// `PREFIX.`), with `PREFIX.` removed from their keys (and from their paths where it is whole path
/// segments), and warns as `convert` does when model tensors are left out.
fn select_prefix(idx: &mut CheckpointIndex, prefix: &str) -> anyhow::Result<()> {
    let left_out = crate::convert::own_prefix_left_out(idx, prefix);
    if !left_out.is_empty() {
        eprintln!(
            "{}",
            crate::convert::own_prefix_warning(prefix, &left_out, None)
        );
    }
    let under = |k: &str| {
        k.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('.'))
            .is_some_and(|r| !r.is_empty())
    };
    if !idx.entries.iter().any(|e| under(&e.key)) {
        let tops: std::collections::BTreeSet<String> = idx
            .entries
            .iter()
            .filter_map(|e| e.path.first().map(ToString::to_string))
            .collect();
        anyhow::bail!(
            "--select {prefix}: no key starts with `{prefix}.`\nhint: top-level keys are: {}",
            tops.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    let entries = std::mem::take(&mut idx.entries);
    for mut e in entries {
        if !under(&e.key) {
            continue;
        }
        // `PREFIX.` (ASCII `.`: a character boundary).
        e.key.replace_range(..=prefix.len(), "");
        // The path loses the segments that spell `PREFIX`, or `PREFIX.` from a first segment that
        // holds dots itself (a safetensors name is one segment).
        let mut spelled = String::new();
        let mut whole = None;
        for (n, seg) in e.path.iter().enumerate() {
            if !spelled.is_empty() {
                spelled.push('.');
            }
            spelled.push_str(&seg.to_string());
            if spelled == prefix {
                whole = Some(n);
            }
            if spelled.len() >= prefix.len() {
                break;
            }
        }
        if let Some(n) = whole {
            e.path.drain(..=n);
        } else if let Some(index::PathSeg::Key(first)) = e.path.first_mut()
            && let Some(r) = first.strip_prefix(prefix).and_then(|r| r.strip_prefix('.'))
        {
            *first = r.to_owned();
        }
        idx.entries.push(e);
    }
    Ok(())
}

/// The file and rank when the checkpoint is one file holding one rank's shards (a per-rank file
/// of a sharded checkpoint, inspected alone).
fn single_rank_file(idx: &CheckpointIndex) -> Option<(&str, u32)> {
    let mut files = idx.files.keys();
    let file = files.next()?;
    if files.next().is_some() {
        return None;
    }
    let mut ranks = idx
        .entries
        .iter()
        .flat_map(|e| e.chunks.iter().map(|c| c.rank));
    let rank = ranks.next()??;
    ranks
        .all(|r| r == Some(rank))
        .then_some((file.as_str(), rank))
}

fn tensor_stats(
    idx: &CheckpointIndex,
    source: &dyn Source,
    e: &IndexEntry,
) -> anyhow::Result<Option<ValueStats>> {
    if e.shape.is_some() {
        let data = idx
            .read_tensor(source, e)
            .with_context(|| format!("cannot read the values of {}", e.key))?;
        return Ok(data.stats());
    }
    // Rank-local pieces: statistics over all pieces together.
    let mut all = Vec::new();
    let mut dtype = None;
    for c in &e.chunks {
        let d = idx
            .read_chunk(source, e, c)
            .with_context(|| format!("cannot read the values of {} in {}", e.key, c.file))?;
        dtype = Some(d.dtype);
        all.extend(d.bytes);
    }
    Ok(dtype.and_then(|dtype| {
        index::TensorData {
            dtype,
            shape: vec![],
            bytes: all,
        }
        .stats()
    }))
}

#[derive(Debug, serde::Serialize)]
struct RankBytes {
    /// `None` when the file does not say which rank wrote it.
    rank: Option<u32>,
    bytes: u64,
}

#[derive(Debug, serde::Serialize)]
struct Summary {
    looks_like: String,
    /// What wrote it, when its files say (a trainer's layout).
    #[serde(skip_serializing_if = "Option::is_none")]
    written_by: Option<String>,
    entries: usize,
    tensors: usize,
    total_bytes: u64,
    bytes_per_rank: Vec<RankBytes>,
    /// max / mean of bytes per rank (1.0 = perfectly balanced).
    imbalance: Option<f64>,
    unreferenced_storage_bytes: u64,
    files: usize,
}

impl Summary {
    fn of(idx: &CheckpointIndex, written_by: Option<String>) -> Summary {
        let mut per_rank: BTreeMap<Option<u32>, u64> = BTreeMap::new();
        let mut total = 0u64;
        let mut tensors = 0;
        for e in &idx.entries {
            if e.kind == EntryKind::Tensor {
                tensors += 1;
            }
            let item = e.dtype.map_or(0, |d| d.size_bytes() as u64);
            for c in &e.chunks {
                let bytes = if e.kind == EntryKind::Tensor {
                    c.numel().unwrap_or(0).saturating_mul(item)
                } else {
                    c.byte_length
                };
                total = total.saturating_add(bytes);
                *per_rank.entry(c.rank).or_default() += bytes;
            }
        }
        let imbalance = (per_rank.len() > 1).then(|| {
            let max = per_rank.values().copied().max().unwrap_or(0) as f64;
            let mean = per_rank.values().sum::<u64>() as f64 / per_rank.len() as f64;
            if mean > 0.0 { max / mean } else { 1.0 }
        });
        let ranks = idx
            .files
            .values()
            .filter_map(|f| f.rank)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        let mut looks_like = idx.kind.describe().to_owned();
        if ranks > 1 {
            let _ = write!(looks_like, ", {ranks} ranks");
        }
        if idx.has_optimizer_state {
            looks_like.push_str(", with optimizer state");
        }
        Summary {
            looks_like,
            written_by,
            entries: idx.entries.len(),
            tensors,
            total_bytes: total,
            bytes_per_rank: per_rank
                .into_iter()
                .map(|(rank, bytes)| RankBytes { rank, bytes })
                .collect(),
            imbalance,
            unreferenced_storage_bytes: idx.files.values().map(|f| f.unreferenced_bytes).sum(),
            files: idx.files.len(),
        }
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "the text report's sections in the order they are printed"
)]
fn render(
    idx: &CheckpointIndex,
    stats: &BTreeMap<String, ValueStats>,
    summary: &Summary,
    values: bool,
) -> String {
    let mut rows: Vec<Vec<String>> = Vec::with_capacity(idx.entries.len() + 1);
    let mut header = vec![
        "KEY", "KIND", "DTYPE", "SHAPE", "NUMEL", "BYTES", "CHUNKS", "RANKS",
    ];
    if values {
        header.extend(["MIN", "MAX", "MEAN", "NAN", "INF", "VALUE"]);
    }
    rows.push(header.iter().map(|s| (*s).to_owned()).collect());
    for e in &idx.entries {
        let kind = match e.kind {
            EntryKind::Tensor => "tensor",
            EntryKind::Bytes => "bytes",
            EntryKind::Scalar => "scalar",
        };
        let mut row = vec![
            e.key.clone(),
            kind.to_owned(),
            e.dtype.map_or("-".into(), |d| d.to_string()),
            shape_text(e),
            e.numel().map_or("-".into(), |n| n.to_string()),
            e.nbytes().map_or("-".into(), human_bytes),
            e.chunks.len().to_string(),
            ranks_text(e),
        ];
        if values {
            let s = stats.get(&e.key);
            row.extend([
                fmt_num(s.and_then(|s| s.min)),
                fmt_num(s.and_then(|s| s.max)),
                fmt_num(s.and_then(|s| s.mean)),
                s.map_or("-".into(), |s| s.nan.to_string()),
                s.map_or("-".into(), |s| s.inf.to_string()),
                e.value.as_ref().map_or("-".into(), ToString::to_string),
            ]);
        }
        rows.push(row);
    }
    let ncols = rows[0].len();
    let widths: Vec<usize> = (0..ncols)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, cell)| format!("{cell:<w$}", w = widths[c]))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "looks like: {}", summary.looks_like);
    if let Some(by) = &summary.written_by {
        let _ = writeln!(out, "written by: {by}");
    }
    let _ = writeln!(
        out,
        "entries: {} ({} tensors), {} in {} file{}",
        summary.entries,
        summary.tensors,
        human_bytes(summary.total_bytes),
        summary.files,
        if summary.files == 1 { "" } else { "s" }
    );
    // Bytes per rank only when the files say which rank wrote them (a lone file written by no
    // rank in particular has no "rank ?" line).
    if summary.bytes_per_rank.iter().any(|r| r.rank.is_some()) {
        let name = |r: &RankBytes| r.rank.map_or("?".into(), |r| r.to_string());
        let per: Vec<String> = if summary.bytes_per_rank.len() <= 8 {
            summary
                .bytes_per_rank
                .iter()
                .map(|r| format!("rank {}: {}", name(r), human_bytes(r.bytes)))
                .collect()
        } else {
            let min = summary.bytes_per_rank.iter().min_by_key(|r| r.bytes);
            let max = summary.bytes_per_rank.iter().max_by_key(|r| r.bytes);
            let total: u64 = summary.bytes_per_rank.iter().map(|r| r.bytes).sum();
            let mut v = vec![format!(
                "{} ranks, mean {}",
                summary.bytes_per_rank.len(),
                human_bytes(total / summary.bytes_per_rank.len() as u64)
            )];
            if let (Some(min), Some(max)) = (min, max) {
                v.push(format!(
                    "min {} (rank {})",
                    human_bytes(min.bytes),
                    name(min)
                ));
                v.push(format!(
                    "max {} (rank {})",
                    human_bytes(max.bytes),
                    name(max)
                ));
            }
            v
        };
        let _ = write!(out, "bytes per rank: {}", per.join(", "));
        if let Some(i) = summary.imbalance {
            let _ = write!(out, " (imbalance max/mean {i:.3})");
        }
        let _ = writeln!(out);
    }
    if summary.unreferenced_storage_bytes > 0 {
        let _ = writeln!(
            out,
            "padding: {} of storage no tensor view refers to (FSDP padding kept by torch.save)",
            human_bytes(summary.unreferenced_storage_bytes)
        );
    } else if matches!(
        idx.kind,
        shardscope_core::index::CheckpointKind::DeepSpeedZero { .. }
    ) {
        // ZeRO's alignment and partition padding lies inside each rank's flat groups, which the
        // storage count does not see.
        let _ = writeln!(
            out,
            "padding: not counted for DeepSpeed flat partitions (their alignment padding is inside each rank's flat groups)"
        );
    } else {
        let _ = writeln!(out, "padding: none found in storages");
    }
    if let Some(d) = &idx.dcp {
        // `.metadata` records where the checkpoint was first written, not where it is now.
        let _ = writeln!(
            out,
            "dcp: version {}{}",
            d.version.as_deref().unwrap_or("not recorded"),
            d.checkpoint_id
                .as_deref()
                .map(|id| format!(" (written to {id}, as its .metadata records)"))
                .unwrap_or_default()
        );
        let compressed = idx
            .entries
            .iter()
            .flat_map(|e| &e.chunks)
            .filter(|c| c.encoding == index::ChunkEncoding::ZstdTorchSaveItem)
            .count();
        if compressed > 0 {
            let _ = writeln!(
                out,
                "compression: {compressed} items zstd-compressed (stream.zstd/1)"
            );
        }
    }
    out
}
