//! The `coverage` and `world-size` rules: tensors not fully stored, ranks whose files are missing,
//! and per-rank files loaded by a different number of ranks.

use std::collections::{BTreeMap, BTreeSet};

use crate::index::{CheckpointIndex, CheckpointKind, Format, FsdpInfo, Problem};
use crate::shape::numel;

use super::Options;
use super::report::{Finding, Severity};
use super::text::{ckpt_arg, quote};

pub(super) fn coverage(index: &CheckpointIndex, problems: &[Problem], out: &mut Vec<Finding>) {
    let mut by_file: BTreeMap<Option<String>, Vec<&Problem>> = BTreeMap::new();
    for p in problems {
        by_file.entry(p.file.clone()).or_default().push(p);
    }
    for (file, ps) in by_file {
        let keys: Vec<String> = ps.iter().map(|p| p.key.clone()).collect();
        let first = ps.first().map_or_else(String::new, ToString::to_string);
        let where_ = file
            .as_deref()
            .map_or_else(String::new, |f| format!(" in {f}"));
        out.push(Finding {
            code: "coverage",
            severity: Severity::Error,
            message: format!(
                "{} tensor(s){where_} are not fully stored: {first}{}. torch would fail reading them or load garbage",
                keys.len(),
                if ps.len() > 1 { " (and more)" } else { "" }
            ),
            keys,
            fix: "copy the checkpoint again from where it was written (a rank's file or a .distcp is missing or cut short); `shardscope verify` lists every damaged chunk".into(),
        });
    }
    // Per-rank files: ranks named by the format that have no file.
    if index.format == Format::TorchSave {
        let have: BTreeSet<u32> = index.files.values().filter_map(|f| f.rank).collect();
        if let Some(expected) = written_world_size(index)
            && !have.is_empty()
        {
            let missing: Vec<String> = (0..expected)
                .filter(|r| u32::try_from(*r).is_ok_and(|r| !have.contains(&r)))
                .map(|r| format!("rank {r}"))
                .collect();
            if !missing.is_empty() {
                out.push(Finding {
                    code: "coverage",
                    severity: Severity::Error,
                    message: format!(
                        "the checkpoint was written by {expected} ranks but the files of {} are not there",
                        missing.join(", ")
                    ),
                    keys: missing,
                    fix: "give every rank's file (all of them, in one folder or as several CKPT arguments)".into(),
                });
            }
        }
    }
}

/// The world size the checkpoint says it was written with (ShardedTensor shard tables, DTensor
/// meshes), else the number of per-rank files.
fn written_world_size(index: &CheckpointIndex) -> Option<u64> {
    for e in &index.entries {
        match &e.fsdp {
            Some(FsdpInfo::ShardedTensor { shards }) if !shards.is_empty() => {
                return Some(shards.len() as u64);
            }
            Some(FsdpInfo::DTensor {
                mesh_shape: Some(mesh),
                ..
            }) => return numel(mesh),
            _ => {}
        }
    }
    let ranks: BTreeSet<u32> = index.files.values().filter_map(|f| f.rank).collect();
    (ranks.len() > 1).then(|| ranks.iter().max().map_or(0, |r| u64::from(*r) + 1))
}

pub(super) fn world_size(index: &CheckpointIndex, options: &Options<'_>, out: &mut Vec<Finding>) {
    let Some(want) = options.world_size else {
        return;
    };
    // DCP and full checkpoints load into any number of ranks.
    if index.format != Format::TorchSave
        || !matches!(
            index.kind,
            CheckpointKind::Fsdp1Local
                | CheckpointKind::Fsdp1Sharded
                | CheckpointKind::Fsdp2
                | CheckpointKind::RankLocal
        )
    {
        return;
    }
    let Some(have) = written_world_size(index) else {
        return;
    };
    if have == want {
        return;
    }
    let ckpt = ckpt_arg(&options.label);
    let fix = if index.kind == CheckpointKind::Fsdp1Local {
        let model = options
            .model_path
            .as_deref()
            .map_or_else(|| "MODEL.json".to_owned(), quote);
        format!(
            "shardscope reshard {ckpt} --model {model}{} --to-world-size {want} -o resharded",
            if options.use_orig_params {
                " --use-orig-params"
            } else {
                ""
            }
        )
    } else {
        format!(
            "shardscope convert {ckpt} --world-size {want}{} -o ckpt_dcp  # then dcp.load on {want} ranks",
            options
                .api
                .map_or_else(String::new, |a| format!(" --api {a}"))
        )
    };
    out.push(Finding {
        code: "world-size",
        severity: Severity::Error,
        keys: index.files.keys().cloned().collect(),
        message: format!(
            "per-rank files ({}) for {have} ranks, but {want} ranks will load them: each rank's file only fits the rank that wrote it, with the same number of ranks",
            index.kind.describe()
        ),
        fix,
    });
}
