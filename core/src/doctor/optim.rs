//! The `optimizer-mismatch` rule: an optimizer part whose parameters are not the model's.

use std::collections::BTreeSet;

use crate::index::PathSeg;

use super::Options;
use super::model::strip_compile_ddp;
use super::parts::{OptimPart, Parts, join};
use super::report::{Finding, Severity};
use super::text::list;

#[allow(
    clippy::too_many_lines,
    reason = "both optimizer key forms (FQN-keyed and id-keyed) are diagnosed side by side against the same parameter list"
)]
pub(super) fn diagnose_optim(
    part: &OptimPart<'_>,
    model_keys: &BTreeSet<String>,
    parts: &Parts<'_>,
    options: &Options<'_>,
    out: &mut Vec<Finding>,
) {
    let prefix = join(&part.prefix);
    let where_ = if prefix.is_empty() {
        "the optimizer state".to_owned()
    } else {
        format!("the optimizer state `{prefix}`")
    };
    let target_params: Option<BTreeSet<String>> = options
        .target
        .map(|t| t.tensors.keys().cloned().collect())
        .or_else(|| (!model_keys.is_empty()).then(|| model_keys.clone()));
    let has_flat = parts
        .models
        .iter()
        .any(|m| m.entries.values().any(|e| e.flat_param));
    let mut bad: Vec<String> = Vec::new();
    let mut reasons: Vec<String> = Vec::new();
    // FQN-keyed state (FSDP.optim_state_dict, get_optimizer_state_dict).
    let names: BTreeSet<String> = part
        .state_params
        .iter()
        .filter_map(|p| match p {
            PathSeg::Key(k) if k.parse::<i64>().is_err() => Some(k.clone()),
            PathSeg::Key(_) | PathSeg::Index(_) | PathSeg::IntKey(_) => None,
        })
        .chain(part.group_names.iter().cloned())
        .collect();
    if let Some(params) = &target_params
        && !names.is_empty()
    {
        let unknown: Vec<String> = names
            .iter()
            .filter(|n| {
                !params.contains(*n)
                    && !params
                        .contains(&strip_compile_ddp(&crate::model::fqn::clean_tensor_name(n)))
            })
            .cloned()
            .collect();
        if !unknown.is_empty() {
            reasons.push(format!(
                "it names {} parameter(s) the {} does not have: {}",
                unknown.len(),
                if options.target.is_some() {
                    "target"
                } else {
                    "model part"
                },
                list(&unknown)
            ));
            bad.extend(unknown);
        }
    }
    // FQN-keyed state names every parameter it holds state for: a trainable parameter of the
    // target without any is refused by torch's set_optimizer_state_dict (strict).
    let state_names: BTreeSet<String> = part
        .state_params
        .iter()
        .filter_map(|p| match p {
            PathSeg::Key(k) if k.parse::<i64>().is_err() => {
                Some(strip_compile_ddp(&crate::model::fqn::clean_tensor_name(k)))
            }
            PathSeg::Key(_) | PathSeg::Index(_) | PathSeg::IntKey(_) => None,
        })
        .collect();
    if let Some(trainable) = options.target.and_then(|t| t.trainable_names.as_ref())
        && !state_names.is_empty()
    {
        let without: Vec<String> = trainable
            .iter()
            .filter(|n| !state_names.contains(*n))
            .cloned()
            .collect();
        if let Some(first) = without.first() {
            reasons.push(format!(
                "{} trainable parameter(s) of the target have no optimizer state: {} (a run that froze them, resumed with them trainable); torch's set_optimizer_state_dict refuses: \"Missing optimizer state for parameter '{first}' in checkpoint\"",
                without.len(),
                list(&without)
            ));
            bad.extend(without);
        }
    }
    // Id-keyed state (optim.state_dict()).
    let ids: BTreeSet<i64> = part
        .state_params
        .iter()
        .filter_map(|p| match p {
            PathSeg::Index(i) | PathSeg::IntKey(i) => Some(*i),
            PathSeg::Key(k) => k.parse().ok(),
        })
        .collect();
    let at = |what: String| {
        if prefix.is_empty() {
            what
        } else {
            format!("{prefix}.{what}")
        }
    };
    let group_ids: BTreeSet<i64> = part.group_ids.iter().copied().collect();
    let stray: Vec<i64> = ids.difference(&group_ids).copied().collect();
    if !stray.is_empty() && !group_ids.is_empty() {
        reasons.push(format!(
            "state holds parameter ids {stray:?} that no param_group lists"
        ));
        bad.extend(stray.iter().map(|i| at(format!("state.{i}"))));
    }
    // torch numbers the parameters of all param_groups 0..n-1 in order.
    let listed = i64::try_from(part.group_ids.len()).unwrap_or(i64::MAX);
    let gaps: Vec<i64> = group_ids
        .iter()
        .copied()
        .filter(|&i| i < 0 || i >= listed)
        .collect();
    if !gaps.is_empty() || group_ids.len() != part.group_ids.len() {
        reasons.push(format!(
            "its param_groups list ids {:?}, not 0..{}: optimizer.state_dict() numbers parameters consecutively, so these ids were edited or merged from another optimizer",
            part.group_ids,
            part.group_ids.len()
        ));
        bad.extend(gaps.iter().map(|i| at(format!("state.{i}"))));
        bad.push(at("param_groups".into()));
    }
    // Without listed ids (DCP keeps param_groups as bytes items): the state's ids.
    let count = if group_ids.is_empty() {
        ids.last()
            .and_then(|&m| usize::try_from(m).ok())
            .map_or(0, |m| m.saturating_add(1))
    } else {
        group_ids.len()
    };
    if let Some(t) = options.target
        && !has_flat
        && count > 0
    {
        let too_few = !group_ids.is_empty() && t.trainable.is_some_and(|min| count < min);
        let too_many = count > t.params;
        if too_many || too_few {
            reasons.push(format!(
                "its param_groups list {count} parameter ids but the target has {} parameter(s){}; optimizer.load_state_dict pairs ids with model.parameters() by position, so it belongs to another model",
                t.params,
                t.trainable
                    .map_or_else(String::new, |m| format!(" ({m} trainable)"))
            ));
            bad.push(at("param_groups".into()));
        }
    }
    if reasons.is_empty() {
        return;
    }
    bad.sort();
    bad.dedup();
    out.push(Finding {
        code: "optimizer-mismatch",
        severity: Severity::Error,
        message: format!("{where_} does not match the model's parameters: {}", reasons.join("; ")),
        keys: bad,
        fix: "rebuild the optimizer over the model the checkpoint was trained with, or start the optimizer fresh: load only the model part (model.load_state_dict(ckpt[\"model\"]))".into(),
    });
}
