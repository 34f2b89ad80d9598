//! Which per-rank file sets of a folder are read when the user names them (`--model-files`,
//! `--optim-files`: file-name patterns with `{r}` for the rank). Without patterns every set is read
//! ([`crate::index::index_source_sets`]); with them only the named sets, plus, when only the
//! optimizer's is named, the one set whose content is a model.

use std::collections::BTreeSet;

use crate::index::{self, RankGroup};
use crate::source::Source;

use super::CheckpointError;

/// The placeholder for the rank in a file-name pattern given by the user.
pub const RANK_PLACEHOLDER: &str = "{r}";

/// The rank of `name` in the per-rank set `pattern` (`{r}` stands for the rank, written as
/// `rank.to_string()` writes it; digits may follow `{r}`).
pub fn pattern_rank(pattern: &str, name: &str) -> Option<u32> {
    let (head, tail) = pattern.split_once(RANK_PLACEHOLDER)?;
    let digits = name.strip_prefix(head)?.strip_suffix(tail)?;
    let rank: u32 = digits.parse().ok()?;
    (rank.to_string() == digits).then_some(rank)
}

/// Names of the folder's top level that are not hidden (`.metadata`, editor files): the files a
/// per-rank set can be made of.
fn top_level(names: &[String]) -> Vec<&str> {
    names
        .iter()
        .map(String::as_str)
        .filter(|n| !n.contains('/') && !n.starts_with('.'))
        .collect()
}

/// The per-rank sets of `names` with ranks `0..N` (as `{r}` patterns, in name order).
fn complete_sets(names: &[String]) -> Vec<String> {
    let top: Vec<String> = top_level(names).into_iter().map(str::to_owned).collect();
    index::group_rank_files(&top)
        .into_iter()
        .filter(|g| {
            g.pattern.contains("{R}")
                && g.files
                    .iter()
                    .map(|(_, r)| *r)
                    .eq((0..g.files.len()).map(|r| u32::try_from(r).ok()))
        })
        .map(|g| g.pattern.replace("{R}", RANK_PLACEHOLDER))
        .collect()
}

/// The set `pattern` names among `names`, checked to be ranks `0..N`.
fn named_group(label: &str, names: &[String], pattern: &str) -> Result<RankGroup, CheckpointError> {
    let files_err = |reason: String| CheckpointError::Files {
        label: label.to_owned(),
        reason,
    };
    if !pattern.contains(RANK_PLACEHOLDER) {
        return Err(files_err(format!(
            "the file pattern `{pattern}` has no `{RANK_PLACEHOLDER}` (it stands for the rank number, e.g. `model_rank{RANK_PLACEHOLDER}.pt`)"
        )));
    }
    let mut files: Vec<(String, u32)> = top_level(names)
        .into_iter()
        .filter_map(|n| pattern_rank(pattern, n).map(|r| (n.to_owned(), r)))
        .collect();
    files.sort_by_key(|(_, r)| *r);
    if files.is_empty() {
        let sets = complete_sets(names);
        let found = if sets.is_empty() {
            "no per-rank file sets found".to_owned()
        } else {
            format!("per-rank file sets found: {}", sets.join(", "))
        };
        return Err(files_err(format!(
            "no file matches `{pattern}` (`{RANK_PLACEHOLDER}` is the rank number); {found}"
        )));
    }
    let ranks: BTreeSet<u32> = files.iter().map(|(_, r)| *r).collect();
    let last = files.last().map_or(0, |(_, r)| *r);
    if ranks.len() != files.len() || u64::from(last) + 1 != files.len() as u64 {
        let missing: Vec<String> = (0..=last)
            .filter(|r| !ranks.contains(r))
            .map(|r| pattern.replace(RANK_PLACEHOLDER, &r.to_string()))
            .collect();
        return Err(files_err(format!(
            "per-rank files `{pattern}` do not hold every rank 0..N; missing: {}",
            missing.join(", ")
        )));
    }
    Ok(RankGroup {
        pattern: pattern.replace(RANK_PLACEHOLDER, "{R}"),
        files: files.into_iter().map(|(n, r)| (n, Some(r))).collect(),
    })
}

/// The sets a user named: the model's (`model`) and the optimizer's (`optim`), in that order. With
/// only `optim` named, the model is the one other complete set whose rank-0 file holds a model
/// ([`index::set_class`]); none is fine (optimizer state alone), several are refused.
pub(super) fn named_sets(
    source: &dyn Source,
    label: &str,
    names: &[String],
    model: Option<&str>,
    optim: Option<&str>,
) -> Result<Vec<RankGroup>, CheckpointError> {
    let mut groups = Vec::new();
    if let Some(m) = model {
        groups.push(named_group(label, names, m)?);
    } else {
        let mut models = Vec::new();
        for pattern in complete_sets(names) {
            if Some(pattern.as_str()) == optim {
                continue;
            }
            let group = named_group(label, names, &pattern)?;
            // Only the rank-0 file: enough to tell what the set holds. Files that are not
            // torch archives (logs, configs) are not per-rank state.
            let Ok(first) = index::index_torch_files_ranked(source, &group.files[..1]) else {
                continue;
            };
            if index::set_class(&first, &group.pattern) == "model" {
                models.push((pattern, group));
            }
        }
        if models.len() > 1 {
            let sets: Vec<&str> = models.iter().map(|(p, _)| p.as_str()).collect();
            return Err(CheckpointError::Ambiguous {
                label: label.to_owned(),
                reason: format!(
                    "several model file sets ({}); choose one with --model-files",
                    sets.join(", ")
                ),
            });
        }
        groups.extend(models.into_iter().map(|(_, g)| g));
    }
    if let Some(o) = optim {
        let group = named_group(label, names, o)?;
        if let Some(model) = groups.first()
            && model.files.len() != group.files.len()
        {
            return Err(CheckpointError::Files {
                label: label.to_owned(),
                reason: format!(
                    "{} model files `{}` but {} optimizer files `{o}`",
                    model.files.len(),
                    model.pattern.replace("{R}", RANK_PLACEHOLDER),
                    group.files.len()
                ),
            });
        }
        groups.push(group);
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_ranks() {
        assert_eq!(
            pattern_rank("model_rank{r}.pt", "model_rank12.pt"),
            Some(12)
        );
        assert_eq!(pattern_rank("model_rank{r}.pt", "model_rank01.pt"), None);
        assert_eq!(pattern_rank("m{r}_ws3.pt", "m2_ws3.pt"), Some(2));
        assert_eq!(pattern_rank("model.pt", "model.pt"), None);
    }

    #[test]
    fn named_groups_need_every_rank() {
        let names: Vec<String> = ["a_0.pt", "a_2.pt", "b_0.pt", "b_1.pt", "sub/b_2.pt"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let g = named_group("ckpt", &names, "b_{r}.pt").expect("b is complete");
        assert_eq!(g.files.len(), 2);
        let e = named_group("ckpt", &names, "a_{r}.pt").expect_err("a misses rank 1");
        assert!(e.to_string().contains("missing: a_1.pt"), "{e}");
        let e = named_group("ckpt", &names, "c_{r}.pt").expect_err("no c");
        assert!(
            e.to_string().contains("per-rank file sets found: b_{r}.pt"),
            "{e}"
        );
        let e = named_group("ckpt", &names, "b.pt").expect_err("no placeholder");
        assert!(e.to_string().contains("has no `{r}`"), "{e}");
    }
}
