//! Which files of a source are a DeepSpeed checkpoint: the tag folder (`global_stepN/`, the source
//! itself or the folder its `latest` names) and its files by their names, as
//! `DeepSpeedEngine.save_checkpoint` writes them:
//!
//! - `mp_rank_XX_model_states.pt`: ZeRO-1/2 model states (one per model-parallel rank);
//! - `zero_pp_rank_R_mp_rank_XX_model_states.pt`: ZeRO-3 model states (one per data-parallel rank);
//! - `[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`: each data-parallel rank's optimizer
//!   partition (the `bf16_` prefix when bf16 is enabled).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::index::IndexError;
use crate::source::Source;

/// The file `latest` beside the tag folders: the tag of the last save.
pub(super) const LATEST: &str = "latest";

/// The most bytes a `latest` file may hold (a tag name).
const MAX_LATEST_BYTES: u64 = 4096;

/// A DeepSpeed checkpoint file, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum DsFile {
    /// `mp_rank_XX_model_states.pt` (ZeRO-1/2).
    Model { mp: u32 },
    /// `zero_pp_rank_R_mp_rank_XX_model_states.pt` (ZeRO-3).
    Zero3Model { dp: u32, mp: u32 },
    /// `[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`.
    Optim { bf16: bool, dp: u32, mp: u32 },
}

impl DsFile {
    fn mp(self) -> u32 {
        match self {
            DsFile::Model { mp } | DsFile::Zero3Model { mp, .. } | DsFile::Optim { mp, .. } => mp,
        }
    }
}

/// Decimal digits as a `u32` (no sign, no empty string).
fn number(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// What DeepSpeed file the base name `base` is, if any.
pub(super) fn parse_name(base: &str) -> Option<DsFile> {
    if let Some(rest) = base.strip_suffix("_model_states.pt") {
        if let Some(mp) = rest.strip_prefix("mp_rank_") {
            return number(mp).map(|mp| DsFile::Model { mp });
        }
        let (dp, mp) = rest
            .strip_prefix("zero_pp_rank_")?
            .split_once("_mp_rank_")?;
        return Some(DsFile::Zero3Model {
            dp: number(dp)?,
            mp: number(mp)?,
        });
    }
    let rest = base.strip_suffix("_optim_states.pt")?;
    let (bf16, rest) = match rest.strip_prefix("bf16_") {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let (dp, mp) = rest
        .strip_prefix("zero_pp_rank_")?
        .split_once("_mp_rank_")?;
    Some(DsFile::Optim {
        bf16,
        dp: number(dp)?,
        mp: number(mp)?,
    })
}

/// The folder part of `name` (`""` at the top) and its base name.
fn split(name: &str) -> (&str, &str) {
    match name.rsplit_once('/') {
        Some((dir, base)) => (dir, base),
        None => ("", name),
    }
}

/// True when `names` hold a DeepSpeed checkpoint at their top level or one folder down (a tag
/// folder beside `latest`, as `save_checkpoint` writes them).
pub fn looks_like_deepspeed(names: &[String]) -> bool {
    names.iter().any(|n| {
        let (dir, base) = split(n);
        !dir.contains('/') && parse_name(base).is_some()
    })
}

/// The tag folder of a DeepSpeed checkpoint and its files.
#[derive(Debug, Clone)]
pub(super) struct Folder {
    /// `""` (the source is the tag folder) or `"<tag>/"`.
    pub prefix: String,
    /// The DeepSpeed files of the folder (full names), by kind.
    pub files: BTreeMap<DsFile, String>,
    /// Other files, not read (full names).
    pub not_read: Vec<String>,
    /// How the folder was chosen, when it is not the source itself.
    pub chosen: Option<String>,
}

impl Folder {
    /// The folder as messages name it.
    pub fn shown(&self) -> String {
        if self.prefix.is_empty() {
            "the folder".to_owned()
        } else {
            self.prefix.clone()
        }
    }
}

fn inconsistent(file: &str, what: String) -> IndexError {
    IndexError::Inconsistent {
        file: file.to_owned(),
        what,
    }
}

/// The tag the file `latest` (or `latest_universal`) names.
pub(super) fn read_latest(source: &dyn Source, latest: &str) -> Result<String, IndexError> {
    let size = source.size(latest)?;
    if size > MAX_LATEST_BYTES {
        return Err(inconsistent(
            latest,
            format!("{size} bytes: not the tag name DeepSpeed writes there"),
        ));
    }
    let bytes = source.read_range(latest, 0, size)?;
    let tag = std::str::from_utf8(&bytes)
        .map_err(|_| inconsistent(latest, "not UTF-8 text: not a DeepSpeed tag".into()))?
        .trim();
    if tag.is_empty() || tag.contains('/') || tag == "." || tag == ".." {
        return Err(inconsistent(
            latest,
            format!("`{tag}` is not a tag folder name"),
        ));
    }
    Ok(tag.to_owned())
}

/// Finds the tag folder of the DeepSpeed checkpoint `names` hold ([`looks_like_deepspeed`]): the
/// top level when it holds DeepSpeed files, else the folder `latest` names, else the one folder
/// holding them.
pub(super) fn locate(source: &dyn Source, names: &[String]) -> Result<Folder, IndexError> {
    let mut by_dir: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for n in names {
        let (dir, base) = split(n);
        if !dir.contains('/') && parse_name(base).is_some() {
            by_dir.entry(dir).or_default().push(n);
        }
    }
    let (dir, chosen) = if by_dir.contains_key("") {
        (String::new(), None)
    } else if names.iter().any(|n| n == LATEST) {
        let tag = read_latest(source, LATEST)?;
        if !by_dir.contains_key(tag.as_str()) {
            let found: Vec<&str> = by_dir.keys().copied().collect();
            return Err(inconsistent(
                LATEST,
                format!(
                    "names the tag `{tag}`, but no folder `{tag}/` holds DeepSpeed files (folders that do: {})",
                    found.join(", ")
                ),
            ));
        }
        let note = format!("the tag `{tag}` that `latest` names");
        (tag, Some(note))
    } else {
        let dirs: Vec<&str> = by_dir.keys().copied().collect();
        match dirs.as_slice() {
            [one] => (
                (*one).to_owned(),
                Some(format!("its one tag folder `{one}/`")),
            ),
            _ => {
                return Err(IndexError::SeveralCheckpoints {
                    groups: dirs.iter().map(|d| format!("{d}/")).collect(),
                });
            }
        }
    };
    let prefix = if dir.is_empty() {
        String::new()
    } else {
        format!("{dir}/")
    };
    let mut files = BTreeMap::new();
    let mut not_read = Vec::new();
    for n in names {
        let (d, base) = split(n);
        match parse_name(base) {
            Some(kind) if d == dir => {
                files.insert(kind, n.clone());
            }
            _ if n == LATEST && !dir.is_empty() => {}
            _ => not_read.push(n.clone()),
        }
    }
    Ok(Folder {
        prefix,
        files,
        not_read,
        chosen,
    })
}

/// The files of one DeepSpeed save, sorted by role.
#[derive(Debug, Clone)]
pub(super) struct SaveFiles {
    /// ZeRO-1/2: the one `mp_rank_00_model_states.pt`; ZeRO-3: one per rank, in rank order.
    pub model: Vec<(u32, String)>,
    /// Whether the model files are ZeRO-3's (per rank).
    pub zero3_model: bool,
    /// The optimizer files, in rank order (ranks as named; checked to be `0..N` by the caller).
    pub optim: Vec<(u32, String)>,
    /// Whether the optimizer files are named `bf16_…`.
    pub bf16_names: bool,
}

/// Sorts the folder's files into one save, refusing what `zero_to_fp32` cannot read as one:
/// model-parallel ranks other than 00, optimizer files of both precisions, ZeRO-1/2 and ZeRO-3
/// model files side by side, no optimizer files.
pub(super) fn save_files(folder: &Folder) -> Result<SaveFiles, IndexError> {
    let here = folder.shown();
    let mps: BTreeSet<u32> = folder.files.keys().map(|f| f.mp()).collect();
    if mps.iter().any(|&mp| mp != 0) {
        let first = folder
            .files
            .iter()
            .find(|(f, _)| f.mp() != 0)
            .map_or("", |(_, n)| n.as_str());
        return Err(inconsistent(
            first,
            format!(
                "model-parallel rank files (mp ranks {mps:?}): a tensor- or pipeline-parallel DeepSpeed checkpoint, which zero_to_fp32 does not consolidate and shardscope does not read"
            ),
        ));
    }
    let mut model12 = Vec::new();
    let mut model3 = Vec::new();
    let mut optim_plain = Vec::new();
    let mut optim_bf16 = Vec::new();
    for (kind, name) in &folder.files {
        match *kind {
            DsFile::Model { .. } => model12.push((0, name.clone())),
            DsFile::Zero3Model { dp, .. } => model3.push((dp, name.clone())),
            DsFile::Optim {
                bf16: false, dp, ..
            } => optim_plain.push((dp, name.clone())),
            DsFile::Optim { bf16: true, dp, .. } => optim_bf16.push((dp, name.clone())),
        }
    }
    if !optim_plain.is_empty() && !optim_bf16.is_empty() {
        return Err(inconsistent(
            &optim_bf16[0].1,
            format!(
                "{here} holds optimizer files of two saves: `bf16_zero_pp_rank_*` ({} files) and `zero_pp_rank_*` ({} files), written with and without bf16",
                optim_bf16.len(),
                optim_plain.len()
            ),
        ));
    }
    if !model12.is_empty() && !model3.is_empty() {
        return Err(inconsistent(
            &model12[0].1,
            format!(
                "ZeRO stages mixed in {here}: a ZeRO-1/2 model file (`mp_rank_00_model_states.pt`) beside {} ZeRO-3 model files (`zero_pp_rank_*_mp_rank_00_model_states.pt`)",
                model3.len()
            ),
        ));
    }
    let bf16_names = !optim_bf16.is_empty();
    let optim = if bf16_names { optim_bf16 } else { optim_plain };
    if optim.is_empty() {
        let model = model12.first().or(model3.first()).map_or("", |(_, n)| n);
        return Err(inconsistent(
            model,
            format!(
                "{here} holds no optimizer files (`*zero_pp_rank_R_mp_rank_00_optim_states.pt`): the fp32 weights of a ZeRO checkpoint are there (zero_to_fp32 needs them too)"
            ),
        ));
    }
    if model12.is_empty() && model3.is_empty() {
        return Err(inconsistent(
            &optim[0].1,
            format!(
                "{here} holds no model states file (`mp_rank_00_model_states.pt`, or `zero_pp_rank_R_mp_rank_00_model_states.pt` for ZeRO-3): the parameter names and shapes are there"
            ),
        ));
    }
    let zero3_model = !model3.is_empty();
    Ok(SaveFiles {
        model: if zero3_model { model3 } else { model12 },
        zero3_model,
        optim,
        bf16_names,
    })
}

/// Checks that `files` (rank, name; in rank order) hold exactly ranks `0..count`: the error names
/// the missing files (`pattern` with `{r}` for the rank) or the extra ones.
pub(super) fn check_ranks(
    files: &[(u32, String)],
    count: u64,
    pattern: &str,
    why: &str,
) -> Result<(), IndexError> {
    // The first few missing ranks only: a damaged `partition_count` may say billions.
    const SHOWN: usize = 16;
    let have: BTreeSet<u64> = files.iter().map(|(r, _)| u64::from(*r)).collect();
    let missing: Vec<String> = (0..count)
        .filter(|r| !have.contains(r))
        .take(SHOWN)
        .map(|r| pattern.replace("{r}", &r.to_string()))
        .collect();
    let extra: Vec<&str> = files
        .iter()
        .filter(|(r, _)| u64::from(*r) >= count)
        .map(|(_, n)| n.as_str())
        .collect();
    if missing.is_empty() && extra.is_empty() {
        return Ok(());
    }
    let file = files.first().map_or(pattern, |(_, n)| n.as_str());
    let mut what = format!("{why} {count} ranks");
    if !missing.is_empty() {
        let _ = write!(
            what,
            "; missing: {} (a rank's file was not written, or was removed)",
            missing.join(", ")
        );
    }
    if !extra.is_empty() {
        let _ = write!(
            what,
            "; files of further ranks are there: {}",
            extra.join(", ")
        );
    }
    Err(inconsistent(file, what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_parsed_as_deepspeed_writes_them() {
        assert_eq!(
            parse_name("mp_rank_00_model_states.pt"),
            Some(DsFile::Model { mp: 0 })
        );
        assert_eq!(
            parse_name("zero_pp_rank_12_mp_rank_00_model_states.pt"),
            Some(DsFile::Zero3Model { dp: 12, mp: 0 })
        );
        assert_eq!(
            parse_name("bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt"),
            Some(DsFile::Optim {
                bf16: true,
                dp: 1,
                mp: 3
            })
        );
        assert_eq!(
            parse_name("zero_pp_rank_x_mp_rank_00_optim_states.pt"),
            None
        );
        assert_eq!(parse_name("layer_01-model_states.pt"), None);
        assert_eq!(parse_name("model.pt"), None);
        assert!(looks_like_deepspeed(&[
            "latest".into(),
            "global_step2/mp_rank_00_model_states.pt".into()
        ]));
        assert!(!looks_like_deepspeed(&[
            "a/b/mp_rank_00_model_states.pt".into()
        ]));
    }

    #[test]
    fn ranks_are_checked() {
        let files = vec![(0, "a0".to_owned()), (2, "a2".to_owned())];
        let e = check_ranks(&files, 3, "a{r}", "x").expect_err("rank 1 missing");
        assert!(e.to_string().contains("missing: a1"), "{e}");
        let e = check_ranks(&files, 2, "a{r}", "x").expect_err("rank 2 extra");
        assert!(e.to_string().contains("further ranks are there: a2"), "{e}");
        assert!(check_ranks(&files[..1], 1, "a{r}", "x").is_ok());
        // A count of billions names the first missing ranks, at once.
        let e = check_ranks(&files, u64::MAX, "a{r}", "x").expect_err("most are missing");
        assert!(e.to_string().contains("missing: a1, a3, a4"), "{e}");
    }
}
