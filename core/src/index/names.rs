//! Per-rank file names: the rank in a name, names grouped into per-rank sets.

use std::collections::BTreeMap;

pub(crate) fn file_ext(name: &str) -> &str {
    name.rsplit('/')
        .next()
        .unwrap_or(name)
        .rsplit_once('.')
        .map_or("", |(_, e)| e)
}

/// A `torch.save` file by its extension (`.pt`, `.pth`, `.bin`, `.ckpt`, `.tar`).
pub fn is_torch_file(name: &str) -> bool {
    matches!(file_ext(name), "pt" | "pth" | "bin" | "ckpt" | "tar")
}

/// The rank in a per-rank file name (`rank3_model.pt`, `model_rank_3.pt`, `shard-00004-…`), and
/// the name with the rank replaced by `{R}` (files of one checkpoint share it).
pub fn rank_from_name(name: &str) -> (Option<u32>, String) {
    let base = name.rsplit('/').next().unwrap_or(name);
    // HF distributed pieces: shard-0000R-model-…, 1-based.
    if let Some(rest) = base.strip_prefix("shard-")
        && let Some((digits, tail)) = rest.split_once('-')
        && let Ok(r) = digits.parse::<u32>()
    {
        return (r.checked_sub(1), format!("shard-{{R}}-{tail}"));
    }
    let lower = base.to_ascii_lowercase();
    let pos = lower.find("rank").map(|p| p + 4);
    let bytes = base.as_bytes();
    let find_digits = |from: usize| -> Option<(usize, usize)> {
        let start = (from..bytes.len()).find(|&i| bytes[i].is_ascii_digit())?;
        let end = (start..bytes.len())
            .find(|&i| !bytes[i].is_ascii_digit())
            .unwrap_or(bytes.len());
        Some((start, end))
    };
    let span = match pos {
        Some(p) => {
            let skip = (p..bytes.len())
                .find(|&i| bytes[i] != b'_' && bytes[i] != b'-')
                .unwrap_or(p);
            if bytes.get(skip).is_some_and(u8::is_ascii_digit) {
                find_digits(skip)
            } else {
                None
            }
        }
        None => None,
    };
    match span {
        Some((s, e)) => {
            let r = base[s..e].parse::<u32>().ok();
            (r, format!("{}{{R}}{}", &base[..s], &base[e..]))
        }
        None => (None, base.to_owned()),
    }
}

/// One set of per-rank files: names that differ only in the rank number (see
/// [`group_rank_files`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGroup {
    /// The file name (without its folder) with the rank replaced by `{R}`; for a file that is not
    /// part of a per-rank set, its name.
    pub pattern: String,
    /// The files with their ranks (`None`: no rank in the name), in rank order.
    pub files: Vec<(String, Option<u32>)>,
}

/// Files with their ranks, as in [`RankGroup::files`].
pub type RankedFiles = Vec<(String, Option<u32>)>;

/// Names of one folder with the same text between their numbers, keyed by (folder, texts).
type NameClasses<'a> = BTreeMap<(String, Vec<String>), Vec<(&'a String, NameShape<'a>)>>;

/// A file name cut at its decimal numbers: the text between them and the numbers.
struct NameShape<'a> {
    dir: &'a str,
    texts: Vec<&'a str>,
    numbers: Vec<&'a str>,
}

fn name_shape(name: &str) -> NameShape<'_> {
    let (dir, base) = match name.rfind('/') {
        Some(i) => (&name[..=i], &name[i + 1..]),
        None => ("", name),
    };
    let bytes = base.as_bytes();
    let mut texts = Vec::new();
    let mut numbers = Vec::new();
    let mut text_start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            texts.push(&base[text_start..start]);
            numbers.push(&base[start..i]);
            text_start = i;
        } else {
            i += 1;
        }
    }
    texts.push(&base[text_start..]);
    NameShape {
        dir,
        texts,
        numbers,
    }
}

/// A number that can stand for `{R}`: written as `R.to_string()` writes it (`01` is not rank 1).
fn canonical_rank(digits: &str) -> Option<u32> {
    let r: u32 = digits.parse().ok()?;
    (r.to_string() == digits).then_some(r)
}

impl NameShape<'_> {
    /// The base name with number `at` replaced by `{R}`.
    fn pattern(&self, at: usize) -> String {
        let mut s = String::new();
        for (i, text) in self.texts.iter().enumerate() {
            s.push_str(text);
            if let Some(n) = self.numbers.get(i) {
                s.push_str(if i == at { "{R}" } else { n });
            }
        }
        s
    }
}

/// Groups file names into per-rank sets. Names that have the same text and differ in exactly one
/// number form a set whose ranks are that number (`model_{R}.pt`, `ckpt_{R}_model.pt`,
/// `model_rank{R}_of_3.pt`, `m{R}_ws3.pt`: numbers that are the same across the set are not the
/// rank). Where several numbers vary, the number that splits the names into sets of ranks
/// `0..N` each is the rank (`model_world_size_{2,3}_rank_{R}.pt`), the one after `rank` first.
/// A single varying number whose values leave small gaps still forms a set (ranks 0 and 2: rank 1
/// is missing, which the index reports as a gap rather than reading two unrelated files). Other
/// names keep the rule of [`rank_from_name`] (the number after `rank`). Groups come in name order.
pub fn group_rank_files(names: &[String]) -> Vec<RankGroup> {
    let mut classes: NameClasses<'_> = BTreeMap::new();
    for name in names {
        let shape = name_shape(name);
        let key = (
            shape.dir.to_owned(),
            shape.texts.iter().map(|t| (*t).to_owned()).collect(),
        );
        classes.entry(key).or_default().push((name, shape));
    }
    let mut groups: BTreeMap<(String, String), RankedFiles> = BTreeMap::new();
    let mut add = |dir: &str, pattern: String, name: &str, rank: Option<u32>| {
        groups
            .entry((dir.to_owned(), pattern))
            .or_default()
            .push((name.to_owned(), rank));
    };
    for ((dir, texts), members) in classes {
        let count = members[0].1.numbers.len();
        let varying: Vec<usize> = (0..count)
            .filter(|&i| {
                members
                    .iter()
                    .any(|(_, s)| s.numbers[i] != members[0].1.numbers[i])
            })
            .collect();
        // Candidates for the rank: the number after `rank` first, then from the last one.
        let mut candidates = varying.clone();
        candidates.reverse();
        candidates.sort_by_key(|&i| {
            !texts[i].to_ascii_lowercase().ends_with("rank")
                && !texts[i]
                    .to_ascii_lowercase()
                    .trim_end_matches(['_', '-'])
                    .ends_with("rank")
        });
        let split = |at: usize| -> Option<BTreeMap<Vec<&str>, Vec<u32>>> {
            let mut sets: BTreeMap<Vec<&str>, Vec<u32>> = BTreeMap::new();
            for (_, s) in &members {
                let rest: Vec<&str> = (0..count)
                    .filter(|&i| i != at)
                    .map(|i| s.numbers[i])
                    .collect();
                sets.entry(rest)
                    .or_default()
                    .push(canonical_rank(s.numbers[at])?);
            }
            Some(sets)
        };
        let full = candidates.iter().copied().find(|&at| {
            split(at).is_some_and(|sets| {
                sets.into_values().all(|mut ranks| {
                    ranks.sort_unstable();
                    ranks.iter().copied().eq(0..ranks.len() as u32)
                })
            })
        });
        let gapped = || match varying.as_slice() {
            [at] => split(*at).and_then(|sets| {
                let ranks = sets.into_values().next()?;
                let last = *ranks.iter().max()?;
                let mut distinct = ranks.clone();
                distinct.sort_unstable();
                distinct.dedup();
                (distinct.len() == ranks.len() && u64::from(last) < 4 * ranks.len() as u64)
                    .then_some(*at)
            }),
            _ => None,
        };
        match full.or_else(gapped) {
            Some(at) => {
                for (name, s) in &members {
                    add(&dir, s.pattern(at), name, canonical_rank(s.numbers[at]));
                }
            }
            None => {
                for (name, _) in &members {
                    let (rank, pattern) = rank_from_name(name);
                    add(&dir, pattern, name, rank);
                }
            }
        }
    }
    groups
        .into_iter()
        .map(|((_, pattern), mut files)| {
            files.sort_by_key(|(name, rank)| (*rank, name.clone()));
            RankGroup { pattern, files }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The groups of `names` as (pattern, [(name, rank)]).
    fn grouped(names: &[&str]) -> Vec<(String, RankedFiles)> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        group_rank_files(&names)
            .into_iter()
            .map(|g| (g.pattern, g.files))
            .collect()
    }

    fn set(pattern: &str, names: &[&str]) -> (String, RankedFiles) {
        let files = names
            .iter()
            .enumerate()
            .map(|(r, n)| ((*n).to_owned(), Some(r as u32)))
            .collect();
        (pattern.to_owned(), files)
    }

    #[test]
    fn rank_sets_are_the_number_that_varies() {
        // Any text around the rank, the rank anywhere (README: `ckpt_{r}_model.pt`).
        assert_eq!(
            grouped(&[
                "ckpt_1_model.pt",
                "ckpt_0_optim.pt",
                "ckpt_0_model.pt",
                "ckpt_1_optim.pt"
            ]),
            vec![
                set("ckpt_{R}_model.pt", &["ckpt_0_model.pt", "ckpt_1_model.pt"]),
                set("ckpt_{R}_optim.pt", &["ckpt_0_optim.pt", "ckpt_1_optim.pt"]),
            ]
        );
        assert_eq!(
            grouped(&["model_0.pt", "model_2.pt", "model_1.pt"]),
            vec![set(
                "model_{R}.pt",
                &["model_0.pt", "model_1.pt", "model_2.pt"]
            )]
        );
        assert_eq!(
            grouped(&["model-1.pt", "model-0.pt"]),
            vec![set("model-{R}.pt", &["model-0.pt", "model-1.pt"])]
        );
        // Numbers that are the same in every name are not the rank, wherever they are.
        assert_eq!(
            grouped(&["model_rank0_of_2.pt", "model_rank1_of_2.pt"]),
            vec![set(
                "model_rank{R}_of_2.pt",
                &["model_rank0_of_2.pt", "model_rank1_of_2.pt"]
            )]
        );
        assert_eq!(
            grouped(&["m0_ws3.pt", "m1_ws3.pt", "m2_ws3.pt"]),
            vec![set("m{R}_ws3.pt", &["m0_ws3.pt", "m1_ws3.pt", "m2_ws3.pt"])]
        );
        assert_eq!(
            grouped(&["model-r1-ws2.pt", "model-r0-ws2.pt"]),
            vec![set(
                "model-r{R}-ws2.pt",
                &["model-r0-ws2.pt", "model-r1-ws2.pt"]
            )]
        );
        // Two numbers vary: the one that gives complete sets is the rank.
        assert_eq!(
            grouped(&[
                "model_world_size_2_rank_0.pt",
                "model_world_size_2_rank_1.pt",
                "model_world_size_1_rank_0.pt",
            ]),
            vec![
                set(
                    "model_world_size_1_rank_{R}.pt",
                    &["model_world_size_1_rank_0.pt"]
                ),
                set(
                    "model_world_size_2_rank_{R}.pt",
                    &[
                        "model_world_size_2_rank_0.pt",
                        "model_world_size_2_rank_1.pt"
                    ]
                ),
            ]
        );
    }

    #[test]
    fn names_that_are_not_rank_sets() {
        // A gap stays one set (the index then reports what is missing), not two checkpoints.
        assert_eq!(
            grouped(&["model_0.pt", "model_2.pt"]),
            vec![(
                "model_{R}.pt".to_owned(),
                vec![
                    ("model_0.pt".into(), Some(0)),
                    ("model_2.pt".into(), Some(2))
                ]
            )]
        );
        // Zero-padded numbers are not `{R}` (HF shards); one file keeps the `rank` rule.
        assert_eq!(
            grouped(&[
                "pytorch_model-00001-of-00002.bin",
                "pytorch_model-00002-of-00002.bin"
            ]),
            vec![
                (
                    "pytorch_model-00001-of-00002.bin".to_owned(),
                    vec![("pytorch_model-00001-of-00002.bin".into(), None)]
                ),
                (
                    "pytorch_model-00002-of-00002.bin".to_owned(),
                    vec![("pytorch_model-00002-of-00002.bin".into(), None)]
                ),
            ]
        );
        assert_eq!(
            grouped(&["rank1_full.pt", "model.pt"]),
            vec![
                ("model.pt".to_owned(), vec![("model.pt".into(), None)]),
                (
                    "rank{R}_full.pt".to_owned(),
                    vec![("rank1_full.pt".into(), Some(1))]
                ),
            ]
        );
    }

    #[test]
    fn ranks_from_names() {
        assert_eq!(
            rank_from_name("rank1_full.pt"),
            (Some(1), "rank{R}_full.pt".into())
        );
        assert_eq!(
            rank_from_name("dir/model_rank_12.pt"),
            (Some(12), "model_rank_{R}.pt".into())
        );
        assert_eq!(
            rank_from_name("shard-00002-model-00001-of-00001.safetensors"),
            (Some(1), "shard-{R}-model-00001-of-00001.safetensors".into())
        );
        assert_eq!(rank_from_name("model.pt"), (None, "model.pt".into()));
    }
}
