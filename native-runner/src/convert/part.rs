//! `convert --part R/N`: one of N processes (maybe on N machines sharing a file system) writes a
//! disjoint part of a multi-file output, and the last part to finish writes the index.
//!
//! The plan (which files, which tensors in each, their names) is computed from the checkpoint and
//! the conversion options alone, never from N, so N parts write exactly the files a single run
//! writes. Part R writes the files `i` (in plan order) with `i % N == R`, each atomically (temporary
//! file, `fsync`, rename) into DST, then a marker `.shardscope-part-R-of-N.json` holding the plan's
//! fingerprint and what it wrote (names, sizes, DCP item records). A part that finds all N markers
//! with its fingerprint takes `.shardscope-finalize.lock` (created exclusively; a part that cannot
//! take it leaves the work to the one that did), checks every file's size against the markers,
//! writes the index (`model.safetensors.index.json`, DCP `.metadata`) atomically, and removes the
//! markers and the lock. Until then DST has no index, so no loader takes it for complete.
//! `--finalize` runs that last step alone (after a finalizing process died).
//!
//! A marker from another conversion (other input bytes, options or shardscope version: another
//! fingerprint) or for another part count is an error, as is any file in DST the plan does not
//! name, or an index already there.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::atomic;

/// Turns the records of every file (plan order) into the index files' bytes.
pub type FinishFn<'a> = dyn Fn(&[serde_json::Value]) -> Result<Vec<Vec<u8>>> + 'a;

/// Part `rank` of `count` (`--part R/N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub rank: usize,
    pub count: usize,
}

impl Part {
    /// Whether this part writes file `i` of the plan.
    pub fn owns(&self, i: usize) -> bool {
        i % self.count == self.rank
    }
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.rank, self.count)
    }
}

/// `--part`: `R/N`, or `auto` (from the launcher's environment, see [`part_from_env`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartArg {
    Given(Part),
    Auto,
}

/// Parses `R/N` (`0 <= R < N`) or `auto`.
pub fn parse_part(s: &str) -> Result<PartArg, String> {
    if s == "auto" {
        return Ok(PartArg::Auto);
    }
    let bad = || format!("`{s}` is not a part: R/N with 0 <= R < N (e.g. 0/4), or `auto`");
    let (r, n) = s.split_once('/').ok_or_else(bad)?;
    let rank: usize = r.trim().parse().map_err(|_| bad())?;
    let count: usize = n.trim().parse().map_err(|_| bad())?;
    if count == 0 || rank >= count {
        return Err(bad());
    }
    Ok(PartArg::Given(Part { rank, count }))
}

/// `--part auto`: `RANK`/`WORLD_SIZE` (torchrun, and any launcher that sets them), else
/// `SLURM_PROCID`/`SLURM_NTASKS` (srun). Only read when `--part auto` asks, so a stray variable
/// never splits a plain run.
pub fn part_from_env(var: impl Fn(&str) -> Option<String>) -> Result<Part> {
    for (r, n, launcher) in [
        ("RANK", "WORLD_SIZE", "torchrun"),
        ("SLURM_PROCID", "SLURM_NTASKS", "srun"),
    ] {
        match (var(r), var(n)) {
            (Some(rank), Some(count)) => {
                let parsed = match parse_part(&format!("{}/{}", rank.trim(), count.trim())) {
                    Ok(PartArg::Given(p)) => Some(p),
                    _ => None,
                };
                return parsed.with_context(|| {
                    format!("--part auto: {r}={rank} and {n}={count} ({launcher}) are not a part R/N with 0 <= R < N")
                });
            }
            (Some(_), None) | (None, Some(_)) => {
                bail!("--part auto: {r} and {n} ({launcher}) must both be set")
            }
            (None, None) => {}
        }
    }
    bail!(
        "--part auto: neither RANK/WORLD_SIZE (torchrun) nor SLURM_PROCID/SLURM_NTASKS (srun) is set\nhint: pass --part R/N"
    )
}

/// A stable 64-bit FNV-1a hash of `text`, as 16 hex digits (the plan's fingerprint).
pub fn fingerprint(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

const MARKER_FORMAT: &str = "shardscope-part/1";
const MARKER_PREFIX: &str = ".shardscope-part-";
/// Taken exclusively by the process that writes the index.
pub const LOCK_NAME: &str = ".shardscope-finalize.lock";

fn marker_name(part: Part) -> String {
    format!("{MARKER_PREFIX}{}-of-{}.json", part.rank, part.count)
}

/// One file a part wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerFile {
    pub name: String,
    pub bytes: u64,
    /// Format-specific facts the index needs (DCP: where each item landed).
    #[serde(default)]
    pub record: serde_json::Value,
}

/// What `.shardscope-part-R-of-N.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub format: String,
    pub shardscope_version: String,
    pub fingerprint: String,
    pub part: usize,
    pub parts: usize,
    pub files: Vec<MarkerFile>,
}

/// A multi-file output: its files in plan order and the index files written last.
pub struct Plan<'a> {
    pub dest: &'a Path,
    pub files: &'a [String],
    /// Written last, from every file's record (may be empty: one HF file needs no index).
    pub final_names: &'a [&'a str],
    pub fingerprint: &'a str,
}

/// What this process did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Files this process wrote (names in DST), the index included when it finalized.
    pub written: Vec<String>,
    /// Whether this process wrote the index (the output is complete).
    pub finalized: bool,
}

/// Writes the files of `plan` that `part` owns and, when every part is done, the index.
/// `write_one(i, out)` writes file `i` and returns its record; `finish(records)` (records of every
/// file in plan order) returns the index files' bytes.
pub fn write_part(
    plan: &Plan<'_>,
    part: Part,
    write_one: &mut dyn FnMut(usize, &mut dyn Write) -> Result<serde_json::Value>,
    finish: &FinishFn<'_>,
) -> Result<Outcome> {
    prepare(plan, part)?;
    let mut files = Vec::new();
    let mut outcome = Outcome::default();
    for (i, name) in plan.files.iter().enumerate() {
        if !part.owns(i) {
            continue;
        }
        let path = plan.dest.join(name);
        let record = atomic::write_file_shared(&path, |out| write_one(i, out))?;
        let bytes = fs::metadata(&path)
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        files.push(MarkerFile {
            name: name.clone(),
            bytes,
            record,
        });
        outcome.written.push(name.clone());
    }
    let marker = Marker {
        format: MARKER_FORMAT.to_owned(),
        shardscope_version: env!("CARGO_PKG_VERSION").to_owned(),
        fingerprint: plan.fingerprint.to_owned(),
        part: part.rank,
        parts: part.count,
        files,
    };
    let text = serde_json::to_string_pretty(&marker)?;
    atomic::write_file_shared(&plan.dest.join(marker_name(part)), |out| {
        Ok(out.write_all(text.as_bytes())?)
    })?;
    if let Some(written) = finalize(plan, part.count, false, finish)? {
        outcome.written.extend(written);
        outcome.finalized = true;
    }
    Ok(outcome)
}

/// Creates DST when needed and checks that it holds nothing but this plan's files, markers of this
/// plan and part count, and temporaries.
fn prepare(plan: &Plan<'_>, part: Part) -> Result<()> {
    let dest = plan.dest;
    if dest.is_file() {
        bail!(
            "{} is a file; --part writes a directory\nhint: shardscope never overwrites; remove it or choose another path",
            dest.display()
        );
    }
    fs::create_dir_all(dest).with_context(|| format!("cannot create {}", dest.display()))?;
    let mut names = Vec::new();
    for entry in fs::read_dir(dest).with_context(|| format!("cannot list {}", dest.display()))? {
        let entry = entry.with_context(|| format!("cannot list {}", dest.display()))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    // Markers first: "another conversion" says more than "a file this plan does not name".
    names.sort_by_key(|n| !n.starts_with(MARKER_PREFIX));
    for name in names {
        if plan.final_names.contains(&name.as_str()) {
            bail!(
                "{} already holds {name}: the output is complete (or another conversion's)\nhint: shardscope never overwrites; remove it or choose another path",
                dest.display()
            );
        }
        if plan.files.contains(&name) || plan.files.iter().any(|f| atomic::is_temp_of(&name, f)) {
            continue;
        }
        if name.starts_with(MARKER_PREFIX) {
            let marker = read_marker(&dest.join(&name))?;
            check_marker(plan, &marker, part.count, &dest.join(&name))?;
            continue;
        }
        if name == LOCK_NAME {
            bail!(
                "{} is being finalized ({LOCK_NAME} exists): all parts already ran\nhint: if no process is finalizing it, run the same command with --finalize after removing {}",
                dest.display(),
                dest.join(LOCK_NAME).display()
            );
        }
        // Another part writing its marker right now.
        if (0..part.count).any(|rank| {
            atomic::is_temp_of(
                &name,
                &marker_name(Part {
                    rank,
                    count: part.count,
                }),
            )
        }) {
            continue;
        }
        bail!(
            "{} holds {name}, which this conversion does not write\nhint: every part of one conversion needs the same input and options, and an empty or new DST",
            dest.display()
        );
    }
    Ok(())
}

fn read_marker(path: &Path) -> Result<Marker> {
    let text =
        fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let marker: Marker = serde_json::from_str(&text)
        .with_context(|| format!("not a shardscope part marker: {}", path.display()))?;
    if marker.format != MARKER_FORMAT {
        bail!(
            "unknown part marker format `{}`: {}",
            marker.format,
            path.display()
        );
    }
    Ok(marker)
}

fn check_marker(plan: &Plan<'_>, marker: &Marker, count: usize, path: &Path) -> Result<()> {
    let version = env!("CARGO_PKG_VERSION");
    if marker.shardscope_version != version {
        bail!(
            "a part written by shardscope {}, this is {version}: {}\nhint: run every part with the same shardscope",
            marker.shardscope_version,
            path.display()
        );
    }
    if marker.fingerprint != plan.fingerprint {
        bail!(
            "a part of another conversion (other input, options or shardscope version {}; plan {} here, {} there): {}\nhint: remove DST and run every part again with the same input and options",
            marker.shardscope_version,
            plan.fingerprint,
            marker.fingerprint,
            path.display()
        );
    }
    if marker.parts != count || marker.part >= count {
        bail!(
            "a part {}/{} of a run split {} ways, this one is split {count} ways: {}\nhint: remove DST and run every part again with the same N",
            marker.part,
            marker.parts,
            marker.parts,
            path.display()
        );
    }
    Ok(())
}

/// Writes the index when all `count` parts are done. `explicit` (`--finalize`): a missing part or
/// a held lock is an error; otherwise they mean "not this process's job" (`Ok(None)`). Returns the
/// names written.
pub fn finalize(
    plan: &Plan<'_>,
    count: usize,
    explicit: bool,
    finish: &FinishFn<'_>,
) -> Result<Option<Vec<String>>> {
    let dest = plan.dest;
    let mut markers = BTreeMap::new();
    let mut missing = Vec::new();
    for rank in 0..count {
        let path = dest.join(marker_name(Part { rank, count }));
        if !path.exists() {
            missing.push(rank);
            continue;
        }
        let marker = read_marker(&path)?;
        check_marker(plan, &marker, count, &path)?;
        if marker.part != rank {
            bail!(
                "the marker says part {}, its name part {rank}: {}",
                marker.part,
                path.display()
            );
        }
        markers.insert(rank, marker);
    }
    if !missing.is_empty() {
        if explicit {
            bail!(
                "{}: parts {missing:?} of {count} have not finished (no .shardscope-part-R-of-{count}.json)\nhint: run the missing parts with the same command and --part R/{count}",
                dest.display()
            );
        }
        return Ok(None);
    }
    let lock = dest.join(LOCK_NAME);
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&lock)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && !explicit => return Ok(None),
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "cannot take the finalize lock {} (another process finalizing, or one died doing it: then remove it and run --finalize again)",
                    lock.display()
                )
            });
        }
    }
    let result = finish_locked(plan, count, &markers, finish);
    let _ = fs::remove_file(&lock);
    atomic::sync_dir(dest);
    result.map(Some)
}

fn finish_locked(
    plan: &Plan<'_>,
    count: usize,
    markers: &BTreeMap<usize, Marker>,
    finish: &FinishFn<'_>,
) -> Result<Vec<String>> {
    let dest = plan.dest;
    let mut records = Vec::with_capacity(plan.files.len());
    for (i, name) in plan.files.iter().enumerate() {
        let owner = i % count;
        let marker = &markers[&owner];
        let Some(file) = marker.files.iter().find(|f| &f.name == name) else {
            bail!(
                "part {owner}/{count} did not record {name}: {}",
                dest.display()
            );
        };
        let path = dest.join(name);
        let on_disk = fs::metadata(&path)
            .with_context(|| {
                format!(
                    "part {owner}/{count} wrote it, but it is missing: {}",
                    path.display()
                )
            })?
            .len();
        if on_disk != file.bytes {
            bail!(
                "{} has {on_disk} bytes, part {owner}/{count} wrote {}: changed since",
                path.display(),
                file.bytes
            );
        }
        records.push(file.record.clone());
    }
    let contents = finish(&records)?;
    let mut written = Vec::new();
    for (name, bytes) in plan.final_names.iter().zip(contents) {
        atomic::write_file_shared(&dest.join(name), |out| Ok(out.write_all(&bytes)?))?;
        written.push((*name).to_owned());
    }
    for rank in 0..count {
        let path = dest.join(marker_name(Part { rank, count }));
        fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
    }
    // Leftovers of parts that died mid-file (their file was written again since).
    if let Ok(entries) = fs::read_dir(dest) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let leftover = plan.files.iter().any(|f| atomic::is_temp_of(&name, f))
                || (0..count)
                    .any(|rank| atomic::is_temp_of(&name, &marker_name(Part { rank, count })));
            if leftover && fs::remove_file(entry.path()).is_ok() {
                eprintln!(
                    "removed the leftover of an interrupted part: {}",
                    entry.path().display()
                );
            }
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_parse_and_partition_disjointly() {
        assert_eq!(
            parse_part("1/3"),
            Ok(PartArg::Given(Part { rank: 1, count: 3 }))
        );
        assert_eq!(parse_part("auto"), Ok(PartArg::Auto));
        for bad in ["3/3", "0/0", "-1/2", "1", "a/b", "1/2/3", ""] {
            assert!(parse_part(bad).is_err(), "{bad}");
        }
        // Every file has exactly one owner, for any N, and a part's files do not depend on the
        // number of files.
        for count in 1..=7 {
            for files in 0..20 {
                for i in 0..files {
                    let owners = (0..count)
                        .filter(|&rank| Part { rank, count }.owns(i))
                        .count();
                    assert_eq!(owners, 1, "file {i} of {files}, N={count}");
                }
            }
        }
    }

    #[test]
    fn auto_reads_torchrun_then_srun_and_nothing_else() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert_eq!(
            part_from_env(env(&[("RANK", "2"), ("WORLD_SIZE", "3")])).unwrap(),
            Part { rank: 2, count: 3 }
        );
        assert_eq!(
            part_from_env(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")])).unwrap(),
            Part { rank: 0, count: 4 }
        );
        // torchrun inside an srun allocation: torchrun's global rank wins.
        assert_eq!(
            part_from_env(env(&[
                ("RANK", "5"),
                ("WORLD_SIZE", "8"),
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "2")
            ]))
            .unwrap(),
            Part { rank: 5, count: 8 }
        );
        let err = part_from_env(env(&[])).unwrap_err().to_string();
        assert!(err.contains("neither RANK/WORLD_SIZE"), "{err}");
        let err = part_from_env(env(&[("RANK", "1")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("must both be set"), "{err}");
        let err = format!(
            "{:#}",
            part_from_env(env(&[("RANK", "3"), ("WORLD_SIZE", "3")])).unwrap_err()
        );
        assert!(err.contains("RANK=3"), "{err}");
    }

    #[test]
    fn fingerprints_are_stable() {
        // FNV-1a 64 reference values.
        assert_eq!(fingerprint(""), "cbf29ce484222325");
        assert_eq!(fingerprint("a"), "af63dc4c8601ec8c");
        assert_ne!(fingerprint("plan 1"), fingerprint("plan 2"));
    }

    fn plan_files() -> Vec<String> {
        (0..5).map(|i| format!("f{i}")).collect()
    }

    fn run_part(dest: &Path, files: &[String], fp: &str, part: Part) -> Result<Outcome> {
        let plan = Plan {
            dest,
            files,
            final_names: &["index"],
            fingerprint: fp,
        };
        write_part(
            &plan,
            part,
            &mut |i, out| {
                out.write_all(format!("data {i}").as_bytes())?;
                Ok(serde_json::json!(i))
            },
            &|records| Ok(vec![serde_json::to_vec(records)?]),
        )
    }

    #[test]
    fn the_last_part_writes_the_index_and_stale_parts_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out");
        let files = plan_files();
        // Part 0 writing its marker at this moment: not a stranger (and a leftover once done).
        fs::create_dir_all(&dest).unwrap();
        let other_marker = marker_name(Part { rank: 0, count: 2 });
        fs::write(
            dest.join(format!(".{other_marker}.shardscope-tmp-7-0")),
            b"{",
        )
        .unwrap();
        let a = run_part(&dest, &files, "fp", Part { rank: 1, count: 2 }).unwrap();
        assert_eq!(a.written, ["f1", "f3"]);
        assert!(!a.finalized);
        assert!(!dest.join("index").exists());
        // A part of another conversion is refused, and leaves nothing.
        let err = format!(
            "{:#}",
            run_part(&dest, &files, "other", Part { rank: 0, count: 2 }).unwrap_err()
        );
        assert!(err.contains("another conversion"), "{err}");
        assert!(!dest.join("f0").exists());
        // And a part written by another shardscope version.
        let marker_path = dest.join(marker_name(Part { rank: 1, count: 2 }));
        let original = fs::read_to_string(&marker_path).unwrap();
        let mut marker: Marker = serde_json::from_str(&original).unwrap();
        marker.shardscope_version = "0.0.0-other".to_owned();
        fs::write(&marker_path, serde_json::to_string(&marker).unwrap()).unwrap();
        let err = format!(
            "{:#}",
            run_part(&dest, &files, "fp", Part { rank: 0, count: 2 }).unwrap_err()
        );
        assert!(err.contains("written by shardscope 0.0.0-other"), "{err}");
        fs::write(&marker_path, original).unwrap();
        // So is a part of another split.
        let err = format!(
            "{:#}",
            run_part(&dest, &files, "fp", Part { rank: 0, count: 3 }).unwrap_err()
        );
        assert!(err.contains("split 2 ways"), "{err}");
        let b = run_part(&dest, &files, "fp", Part { rank: 0, count: 2 }).unwrap();
        assert_eq!(b.written, ["f0", "f2", "f4", "index"]);
        assert!(b.finalized);
        let mut names: Vec<String> = fs::read_dir(&dest)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["f0", "f1", "f2", "f3", "f4", "index"]);
        assert_eq!(fs::read(dest.join("index")).unwrap(), b"[0,1,2,3,4]");
        // A complete output is never written into again.
        let err = format!(
            "{:#}",
            run_part(&dest, &files, "fp", Part { rank: 0, count: 2 }).unwrap_err()
        );
        assert!(err.contains("already holds index"), "{err}");
    }

    #[test]
    fn explicit_finalize_names_missing_parts_and_checks_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out");
        let files = plan_files();
        run_part(&dest, &files, "fp", Part { rank: 0, count: 3 }).unwrap();
        run_part(&dest, &files, "fp", Part { rank: 2, count: 3 }).unwrap();
        let plan = Plan {
            dest: &dest,
            files: &files,
            final_names: &["index"],
            fingerprint: "fp",
        };
        let finish = |r: &[serde_json::Value]| Ok(vec![serde_json::to_vec(r)?]);
        let err = format!("{:#}", finalize(&plan, 3, true, &finish).unwrap_err());
        assert!(err.contains("parts [1] of 3"), "{err}");
        run_part(&dest, &files, "fp", Part { rank: 1, count: 3 }).unwrap();
        assert!(dest.join("index").exists());

        // A file changed after its part recorded it: refused, no index.
        let dest = dir.path().join("out2");
        run_part(&dest, &files, "fp", Part { rank: 0, count: 2 }).unwrap();
        fs::write(dest.join("f0"), b"truncated").unwrap();
        let err = format!(
            "{:#}",
            run_part(&dest, &files, "fp", Part { rank: 1, count: 2 }).unwrap_err()
        );
        assert!(err.contains("changed since"), "{err}");
        assert!(!dest.join("index").exists());
        assert!(!dest.join(LOCK_NAME).exists());
    }
}
