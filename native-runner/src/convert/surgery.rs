//! Key surgery for any input and output: `--strip-wrappers`, `--rename REGEX=REPL` (in order) and
//! `--drop REGEX`, applied to the index's keys before anything is written (and before a name
//! mapping reads them). Two keys becoming one is an error naming both.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use regex::Regex;
use shardscope_core::index::{CheckpointIndex, PathSeg};

/// The wrapper modules whose names stand in a state-dict key where the model's own names do not
/// have them (`torch.compile`, DDP/DataParallel, FSDP1, activation checkpointing).
pub const WRAPPERS: &[&str] = &[
    "_orig_mod",
    "module",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
];

/// What to do to the keys.
#[derive(Debug, Clone, Default)]
pub struct Surgery {
    pub strip_wrappers: bool,
    pub renames: Vec<(Regex, String)>,
    pub drops: Vec<Regex>,
}

impl Surgery {
    pub fn is_empty(&self) -> bool {
        !self.strip_wrappers && self.renames.is_empty() && self.drops.is_empty()
    }

    /// `--rename` and `--drop` as given on the command line.
    pub fn parse(strip_wrappers: bool, renames: &[String], drops: &[String]) -> Result<Self> {
        let mut out = Self {
            strip_wrappers,
            ..Self::default()
        };
        for r in renames {
            let Some((pattern, repl)) = r.split_once('=') else {
                bail!(
                    "--rename {r}: expected REGEX=REPLACEMENT (e.g. '^model\\.=' or 'layers\\.(\\d+)\\.attn=blocks.$1.attn')"
                );
            };
            let re = Regex::new(pattern).map_err(|e| {
                anyhow::anyhow!("--rename {r}: `{pattern}` is not a regular expression: {e}")
            })?;
            out.renames.push((re, repl.to_owned()));
        }
        for d in drops {
            out.drops.push(
                Regex::new(d)
                    .map_err(|e| anyhow::anyhow!("--drop {d}: not a regular expression: {e}"))?,
            );
        }
        Ok(out)
    }

    /// The new name of `key`, or `None` when it is dropped.
    pub fn rename(&self, key: &str) -> Option<String> {
        let mut name = if self.strip_wrappers {
            strip_wrappers(key)
        } else {
            key.to_owned()
        };
        for (re, repl) in &self.renames {
            name = re.replace_all(&name, repl.as_str()).into_owned();
        }
        (!self.drops.iter().any(|d| d.is_match(&name))).then_some(name)
    }

    /// [`Self::apply`], with a note of what it did on stderr (unless `quiet`).
    pub fn apply_noted(&self, index: &mut CheckpointIndex, quiet: bool) -> Result<()> {
        let (renamed, dropped) = self.apply(index)?;
        if !self.is_empty() && !quiet {
            eprintln!("note: key surgery: {renamed} key(s) renamed, {dropped} left out");
        }
        Ok(())
    }

    /// Applies the surgery to `index` and returns `(renamed, dropped)` counts.
    pub fn apply(&self, index: &mut CheckpointIndex) -> Result<(usize, usize)> {
        if self.is_empty() {
            return Ok((0, 0));
        }
        let mut renamed = 0;
        let mut dropped = 0;
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        let entries = std::mem::take(&mut index.entries);
        for mut e in entries {
            let Some(name) = self.rename(&e.key) else {
                dropped += 1;
                continue;
            };
            if let Some(other) = seen.insert(name.clone(), e.key.clone()) {
                bail!(
                    "`{other}` and `{}` both become `{name}`\nhint: make the --rename patterns tell them apart, or --drop one of them",
                    e.key
                );
            }
            if name != e.key {
                renamed += 1;
                e.path = renamed_path(&e.path, &name);
                e.raw_key = Some(e.raw_key.take().unwrap_or_else(|| e.key.clone()));
                e.key = name;
            }
            index.entries.push(e);
        }
        index.entries.sort_by(|a, b| a.key.cmp(&b.key));
        Ok((renamed, dropped))
    }
}

/// `key` without wrapper segments wherever they stand (`_orig_mod.layers.0.module.w` →
/// `layers.0.w`).
pub fn strip_wrappers(key: &str) -> String {
    key.split('.')
        .filter(|seg| !WRAPPERS.contains(seg))
        .collect::<Vec<_>>()
        .join(".")
}

/// The nesting of a renamed key: the old nesting when its leading segments still start the new
/// key (`{"model": {...}}` stays nested), else the new key at the top level.
fn renamed_path(path: &[PathSeg], name: &str) -> Vec<PathSeg> {
    for keep in (1..path.len()).rev() {
        let prefix: Vec<String> = path[..keep].iter().map(ToString::to_string).collect();
        let prefix = prefix.join(".");
        if let Some(rest) = name
            .strip_prefix(&prefix)
            .and_then(|r| r.strip_prefix('.'))
            .filter(|r| !r.is_empty())
            && path[..keep].iter().all(|s| matches!(s, PathSeg::Key(_)))
        {
            let mut out = path[..keep].to_vec();
            out.push(PathSeg::Key(rest.to_owned()));
            return out;
        }
    }
    vec![PathSeg::Key(name.to_owned())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrappers_go_wherever_they_stand() {
        assert_eq!(
            strip_wrappers("_orig_mod.layers.0._checkpoint_wrapped_module.module.w"),
            "layers.0.w"
        );
        assert_eq!(strip_wrappers("model.modules.w"), "model.modules.w");
    }

    #[test]
    fn renames_in_order_then_drops() {
        let s = Surgery::parse(
            true,
            &[
                "^model\\.=".to_owned(),
                "layers\\.(\\d+)=blocks.$1".to_owned(),
            ],
            &["rotary".to_owned()],
        )
        .unwrap();
        assert_eq!(
            s.rename("model.module.layers.3.w").as_deref(),
            Some("blocks.3.w")
        );
        assert_eq!(s.rename("model.rotary.inv_freq"), None);
        assert!(Surgery::parse(false, &["nope".to_owned()], &[]).is_err());
        assert!(Surgery::parse(false, &["(=x".to_owned()], &[]).is_err());
    }

    #[test]
    fn nesting_is_kept_where_it_still_fits() {
        let path = vec![
            PathSeg::Key("model".to_owned()),
            PathSeg::Key("module.w".to_owned()),
        ];
        assert_eq!(
            renamed_path(&path, "model.w"),
            vec![
                PathSeg::Key("model".to_owned()),
                PathSeg::Key("w".to_owned())
            ]
        );
        assert_eq!(renamed_path(&path, "w"), vec![PathSeg::Key("w".to_owned())]);
    }
}
