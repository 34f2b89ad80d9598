//! The rules for a model part: wrapper prefixes, flat parameters, local shards, flattened or empty
//! tensors, replicated pieces concatenated, missing and unexpected keys, shapes and dtypes.

use std::collections::{BTreeMap, BTreeSet};

use crate::index::{CheckpointIndex, CheckpointKind, IndexEntry};
use crate::model::fqn::{CHECKPOINT_WRAPPED_MODULE, FLAT_PARAM, FSDP_WRAPPED_MODULE, is_under};
use crate::shape::numel;
use crate::source::Source;

use super::Options;
use super::parts::{ModelPart, raw_rel};
use super::report::{Finding, Severity};
use super::target::{TargetKind, TargetTensor};
use super::text::{ckpt_arg, fixed_name, list, quote, shape_text};

/// Removes `_orig_mod.` segments (torch.compile) anywhere and leading `module.` segments (DDP,
/// DataParallel).
pub(super) fn strip_compile_ddp(key: &str) -> String {
    let mut segs: Vec<&str> = key.split('.').filter(|s| *s != "_orig_mod").collect();
    while segs.len() > 1 && segs[0] == "module" {
        segs.remove(0);
    }
    segs.join(".")
}

#[allow(clippy::too_many_lines)]
pub(super) fn diagnose_model(
    index: &CheckpointIndex,
    source: &dyn Source,
    part: &ModelPart<'_>,
    options: &Options<'_>,
    out: &mut Vec<Finding>,
) {
    let part_name = part.name.as_deref();
    let ckpt = ckpt_arg(&options.label);
    let in_part = part_name.map_or_else(String::new, |p| format!(" (in `{p}`)"));
    // 1. Wrapper prefixes and key clean-up.
    let target = options.target;
    let mut wrapped: Vec<String> = Vec::new();
    let mut compile_ddp: Vec<String> = Vec::new();
    let mut flat: Vec<(String, &IndexEntry)> = Vec::new();
    let mut names: BTreeMap<String, (String, &IndexEntry)> = BTreeMap::new();
    let all_module = part.entries.keys().all(|k| k.starts_with("module."));
    for (key, e) in &part.entries {
        let raw = raw_rel(e, part_name);
        if raw.contains(&format!("{FSDP_WRAPPED_MODULE}."))
            || raw.contains(&format!("{CHECKPOINT_WRAPPED_MODULE}."))
        {
            wrapped.push(raw.clone());
        }
        if e.flat_param || key.ends_with(FLAT_PARAM) {
            flat.push((raw, e));
            continue;
        }
        let stripped = strip_compile_ddp(key);
        let name = match target {
            Some(t) if t.tensors.contains_key(key) => key.clone(),
            Some(_) => stripped,
            None if key.split('.').any(|s| s == "_orig_mod") || all_module => stripped,
            None => key.clone(),
        };
        if name != *key {
            compile_ddp.push(raw.clone());
        }
        names.entry(name).or_insert((raw, e));
    }
    if !wrapped.is_empty() || !compile_ddp.is_empty() {
        let mut keys: Vec<String> = wrapped.iter().chain(&compile_ddp).cloned().collect();
        keys.sort();
        keys.dedup();
        let mut which: Vec<&str> = Vec::new();
        if keys.iter().any(|k| k.contains(FSDP_WRAPPED_MODULE)) {
            which.push("`_fsdp_wrapped_module.` (FSDP1 wrapping)");
        }
        if keys.iter().any(|k| k.contains(CHECKPOINT_WRAPPED_MODULE)) {
            which.push("`_checkpoint_wrapped_module.` (activation checkpointing)");
        }
        if keys.iter().any(|k| k.split('.').any(|s| s == "_orig_mod")) {
            which.push("`_orig_mod.` (torch.compile)");
        }
        if keys
            .iter()
            .any(|k| k.starts_with("module.") || k.contains("._orig_mod.module."))
        {
            which.push("`module.` (DistributedDataParallel / DataParallel)");
        }
        let only_leading = |p: &str| {
            keys.iter().all(|k| {
                k.starts_with(p)
                    && !k[p.len()..].contains(FSDP_WRAPPED_MODULE)
                    && !k[p.len()..].contains(CHECKPOINT_WRAPPED_MODULE)
            })
        };
        let select = part_name.map_or_else(String::new, |p| format!("{p}."));
        let fix = if compile_ddp.is_empty() {
            // The index already removes FSDP/checkpoint wrapper names: converting writes clean keys.
            format!(
                "shardscope convert {ckpt}{} -o {}",
                part_name.map_or_else(String::new, |p| format!(" --select {p}")),
                fixed_name(&options.label)
            )
        } else if let Some(p) = [
            "_orig_mod.module.",
            "module._orig_mod.",
            "_orig_mod.",
            "module.",
        ]
        .into_iter()
        .find(|p| only_leading(p))
        {
            format!(
                "shardscope convert {ckpt} --select {select}{} -o {}",
                p.trim_end_matches('.'),
                fixed_name(&options.label)
            )
        } else {
            // Wrapper names in the middle of keys: removed wherever they stand.
            format!(
                "shardscope convert {ckpt}{} --strip-wrappers -o {}",
                part_name.map_or_else(String::new, |p| format!(" --select {p}")),
                fixed_name(&options.label)
            )
        };
        out.push(Finding {
            code: "wrapper-prefix",
            severity: Severity::Error,
            message: format!(
                "{} key(s){in_part} carry {} that the {} lacks, e.g. {}: they were saved from the wrapped module, so load_state_dict reports every one of them as unexpected and every parameter as missing",
                keys.len(),
                which.join(", "),
                if target.is_some() { "target model" } else { "unwrapped model" },
                list(&keys)
            ),
            keys,
            fix,
        });
    }
    // 2. Flat parameters.
    let mut explained: BTreeSet<String> = BTreeSet::new();
    if !flat.is_empty() {
        let keys: Vec<String> = flat.iter().map(|(k, _)| k.clone()).collect();
        let model = options
            .model_path
            .as_deref()
            .map_or_else(|| "MODEL.json".to_owned(), quote);
        let mut covered = 0usize;
        if let Some(t) = target {
            for (_, e) in &flat {
                let unit_key = e.key.strip_suffix(FLAT_PARAM).unwrap_or(&e.key);
                let unit = unit_key.trim_end_matches('.');
                let unit = part_name
                    .and_then(|p| unit.strip_prefix(p))
                    .map_or(unit, |u| u.trim_start_matches('.'));
                for k in t.tensors.keys() {
                    if is_under(k, unit) && !names.contains_key(k) && explained.insert(k.clone()) {
                        covered += 1;
                    }
                }
            }
        }
        let local = index.kind == CheckpointKind::Fsdp1Local;
        out.push(Finding {
            code: "flat-param",
            severity: Severity::Error,
            message: format!(
                "{} FSDP1 flat parameter(s){in_part} ({}){}: this is a LOCAL_STATE_DICT, one concatenated, padded 1-D shard per FSDP unit and rank; it loads only into the same FSDP1 wrapping at the same world size under StateDictType.LOCAL_STATE_DICT, never into the model's original parameters",
                keys.len(),
                list(&keys),
                if covered > 0 {
                    format!(" hold the target's {covered} original parameters")
                } else {
                    String::new()
                }
            ),
            keys,
            fix: if local {
                format!(
                    "shardscope convert {ckpt} --model {model}{} -o {}  # all ranks' files; --model from `shardscope layout`",
                    if options.use_orig_params {
                        " --use-orig-params"
                    } else {
                        ""
                    },
                    fixed_name(&options.label)
                )
            } else {
                "save with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT) (or SHARDED_STATE_DICT) instead of LOCAL_STATE_DICT".into()
            },
        });
    }
    // 3. Against the target, or alone.
    let Some(t) = target else {
        // Alone, a 0-element tensor may be real (an empty buffer); a part whose every tensor is
        // empty is the signature of another rank's view.
        let empty: Vec<(&String, &String)> = names
            .iter()
            .filter(|(_, (_, e))| e.numel() == Some(0))
            .map(|(name, (raw, _))| (name, raw))
            .collect();
        if empty.len() >= 2 && empty.len() == names.len() {
            for (name, raw) in empty {
                out.push(empty_finding(raw, name, None, &in_part));
            }
        }
        return;
    };
    let present: BTreeSet<String> = names.keys().cloned().collect();
    let mut missing = Vec::new();
    for (key, want) in &t.tensors {
        let Some((raw, e)) = names.get(key) else {
            if explained.contains(key) || t.tied_partner_present(key, &present).is_some() {
                continue;
            }
            missing.push(key.clone());
            continue;
        };
        compare(index, source, key, raw, e, want, &in_part, out);
    }
    if !missing.is_empty() {
        out.push(Finding {
            code: "missing-key",
            severity: Severity::Error,
            message: format!(
                "the target expects {} key(s){in_part} the checkpoint does not have (after removing wrapper prefixes): {}",
                missing.len(),
                list(&missing)
            ),
            fix: format!(
                "model.load_state_dict(sd, strict=False)  # only if the {} missing key(s) may keep their initial values; else find the checkpoint that has them",
                missing.len()
            ),
            keys: missing,
        });
    }
    let unexpected: Vec<String> = names
        .iter()
        .filter(|(k, _)| !t.tensors.contains_key(*k))
        .map(|(_, (raw, _))| raw.clone())
        .collect();
    if !unexpected.is_empty() {
        let description = t.kind == TargetKind::Description;
        out.push(Finding {
            code: "unexpected-key",
            severity: if description {
                Severity::Warning
            } else {
                Severity::Error
            },
            message: format!(
                "{} key(s){in_part} are not in the target{}: {}",
                unexpected.len(),
                if description {
                    " (a model description lists parameters only: these may be buffers)"
                } else {
                    ""
                },
                list(&unexpected)
            ),
            fix: format!(
                "for k in {:?}: sd.pop(k)",
                unexpected.iter().take(8).collect::<Vec<_>>()
            ),
            keys: unexpected,
        });
    }
}

fn empty_finding(raw: &str, key: &str, want: Option<&TargetTensor>, in_part: &str) -> Finding {
    Finding {
        code: "empty-tensor",
        severity: Severity::Error,
        keys: vec![raw.to_owned()],
        message: format!(
            "`{key}`{in_part} has 0 elements{}: a state dict taken on a rank that holds no data for it (a rank0_only / FULL_STATE_DICT save written by a rank other than 0, or a sharded parameter view of another rank)",
            want.map_or_else(String::new, |w| format!(
                " where the target expects {}",
                shape_text(&w.shape)
            ))
        ),
        fix: "save on rank 0 only: `if dist.get_rank() == 0: torch.save(sd, path)` (with rank0_only=True the other ranks' state dicts are empty)".into(),
    }
}

#[allow(clippy::too_many_arguments)]
#[allow(
    clippy::too_many_lines,
    reason = "one check per way a stored tensor can disagree with the model, in the order they are reported"
)]
fn compare(
    index: &CheckpointIndex,
    source: &dyn Source,
    key: &str,
    raw: &str,
    e: &IndexEntry,
    want: &TargetTensor,
    in_part: &str,
    out: &mut Vec<Finding>,
) {
    let Some(shape) = e.shape.clone().or_else(|| {
        // Rank-local pieces: judge by the first piece.
        e.chunks.first().map(|c| c.sizes.to_vec())
    }) else {
        return;
    };
    let (Some(have_n), Some(want_n)) = (numel(&shape), numel(&want.shape)) else {
        return;
    };
    let ws = shape_text(&want.shape);
    let hs = shape_text(&shape);
    if shape == want.shape {
        if let (Some(have), Some(target)) = (e.dtype, want.dtype)
            && have != target
        {
            out.push(Finding {
                code: "dtype-mismatch",
                severity: Severity::Warning,
                keys: vec![raw.to_owned()],
                message: format!(
                    "`{key}`{in_part} is {} but the target is {}: load_state_dict copies it with a cast{}",
                    have.torch_name(),
                    target.torch_name(),
                    if have.size_bytes() > target.size_bytes() {
                        " (precision is lost)"
                    } else {
                        ""
                    }
                ),
                fix: format!(
                    "sd[{key:?}] = sd[{key:?}].to({})  # optional: torch casts on load",
                    target.torch_name()
                ),
            });
        }
        return;
    }
    let finding = |code: &'static str, message: String, fix: String| Finding {
        code,
        severity: Severity::Error,
        keys: vec![raw.to_owned()],
        message,
        fix,
    };
    let torch_size = format!("torch.Size({})", shape_text(&want.shape));
    if have_n == 0 && want_n > 0 {
        out.push(empty_finding(raw, key, Some(want), in_part));
        return;
    }
    if shape.len() == 1 && want.shape.len() != 1 && have_n == want_n {
        out.push(finding(
            "flattened-shape",
            format!(
                "`{key}`{in_part} is 1-D {hs} with exactly the {want_n} elements of the target's {ws}: an FSDP flat view (e.g. named_parameters() of FSDP1 with use_orig_params=True, outside summon_full_params) saved instead of the parameter"
            ),
            format!("sd[{key:?}] = sd[{key:?}].view({ws})  # or save inside FSDP.summon_full_params(model)"),
        ));
        return;
    }
    if shape.len() == 1 && have_n < want_n && want.shape.len() != 1 {
        out.push(finding(
            "local-shard",
            format!(
                "`{key}`{in_part} is a 1-D piece {hs} of {have_n} of the target's {want_n} elements ({ws}): one rank's slice of an FSDP flat parameter, not the whole parameter"
            ),
            "take a full state dict: `with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT): sd = model.state_dict()`, or DCP (dcp.save) from every rank".into(),
        ));
        return;
    }
    let same_rest =
        shape.len() == want.shape.len() && !shape.is_empty() && shape[1..] == want.shape[1..];
    if same_rest
        && want.shape[0] > 0
        && shape[0] > want.shape[0]
        && shape[0].is_multiple_of(want.shape[0])
    {
        let n = shape[0] / want.shape[0];
        if pieces_identical(index, source, e, n) == Some(true) {
            out.push(finding(
                "replicated-concatenated",
                format!(
                    "`{key}`{in_part} is {hs}: {n} identical copies of the target's {ws} stacked on dim 0; a replicated tensor (a buffer every rank holds whole) was concatenated across {n} ranks as if it were sharded"
                ),
                format!("sd[{key:?}] = sd[{key:?}][:{}].clone()", want.shape[0]),
            ));
            return;
        }
    }
    if same_rest && shape[0] > 0 && shape[0] < want.shape[0] {
        let d = want.shape[0];
        // torch.chunk / Shard(0): every rank but the last holds ceil(d / n) rows.
        let ways: Vec<u64> = (2..=d.min(4096))
            .filter(|&n| d.div_ceil(n) == shape[0] || (d.is_multiple_of(n) && d / n == shape[0]))
            .collect();
        if let Some(&n) = ways.first() {
            out.push(finding(
                "local-shard",
                format!(
                    "`{key}`{in_part} is {hs}, the target's {ws} with dim 0 split {n} ways: one rank's shard (DTensor.to_local() or a ShardedTensor's local shard) saved as if it were the full tensor"
                ),
                "save a full state dict: `sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))` (torch.distributed.checkpoint.state_dict), on every rank, then torch.save on rank 0".into(),
            ));
            return;
        }
    }
    out.push(finding(
        "shape-mismatch",
        format!(
            "`{key}`{in_part} is {hs} but the target expects {ws} ({torch_size}): the checkpoint was saved from a model of another configuration (sizes differ, not a sharding artefact)"
        ),
        format!("check the model configuration (the dimension that differs decides which setting); or skip it: sd.pop({key:?}); model.load_state_dict(sd, strict=False)"),
    ));
}

/// Whether the `n` equal dim-0 pieces of the entry hold identical bytes; `None` when the values
/// cannot be read.
fn pieces_identical(
    index: &CheckpointIndex,
    source: &dyn Source,
    e: &IndexEntry,
    n: u64,
) -> Option<bool> {
    const LIMIT: u64 = 256 << 20;
    if e.nbytes()? > LIMIT || n < 2 {
        return None;
    }
    let data = index.read_tensor(source, e).ok()?;
    let len = u64::try_from(data.bytes.len()).ok()?;
    if len % n != 0 {
        return None;
    }
    let piece = usize::try_from(len / n).ok()?;
    if piece == 0 {
        return None;
    }
    let first = &data.bytes[..piece];
    Some(data.bytes.chunks(piece).all(|c| c == first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_and_ddp_prefixes_strip() {
        assert_eq!(
            strip_compile_ddp("_orig_mod.block.0.weight"),
            "block.0.weight"
        );
        assert_eq!(strip_compile_ddp("module._orig_mod.a"), "a");
        assert_eq!(strip_compile_ddp("block._orig_mod.w"), "block.w");
        assert_eq!(strip_compile_ddp("module"), "module");
    }
}
