//! Docs that cannot rot: every relative link of README.md, ARCHITECTURE.md, BENCHMARKS*.md and
//! docs/ points at a file that exists (and at a heading that exists, for `#anchor` links into a
//! Markdown file); every page of docs/ is in the book's table of contents (docs/SUMMARY.md); the
//! README fits on a few screens; and every command block marked `<!-- docs-test: run -->` runs,
//! line by line, against a copy of the bundled examples with this build's `shardscope`, exiting 0.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Markdown files of the documentation.
fn pages() -> Vec<PathBuf> {
    let root = repo();
    let mut out = vec![
        root.join("README.md"),
        root.join("ARCHITECTURE.md"),
        root.join("BENCHMARKS.md"),
        root.join("bench/HISTORY.md"),
    ];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The text outside fenced code blocks and inline code.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut inline = false;
        for c in line.chars() {
            if c == '`' {
                inline = !inline;
            } else if !inline {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// `(target)` of every `[text](target)` link.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].trim().to_owned());
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") || link.is_empty() {
                continue;
            }
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", page.display()));
                continue;
            }
            if !anchor.is_empty() && target.extension().is_some_and(|x| x == "md") {
                let there = std::fs::read_to_string(&target).unwrap();
                if !anchors(&there).contains(anchor) {
                    broken.push(format!("{}: {link} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_docs_page_is_in_the_book_and_the_readme_is_short() {
    let docs = repo().join("docs");
    let summary = std::fs::read_to_string(docs.join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<PathBuf> = links(&summary)
        .into_iter()
        .filter(|l| !l.is_empty())
        .map(|l| docs.join(l))
        .collect();
    let missing: Vec<String> = pages()
        .into_iter()
        .filter(|p| p.starts_with(&docs) && p.file_name().is_some_and(|n| n != "SUMMARY.md"))
        .filter(|p| !listed.contains(p))
        .map(|p| p.display().to_string())
        .collect();
    assert!(missing.is_empty(), "not in docs/SUMMARY.md: {missing:?}");
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines (at most 250: reference goes to docs/)"
    );
}

/// The lines of the blocks marked `<!-- docs-test: run -->` in `text` (continuations joined,
/// comments dropped).
fn runnable(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "<!-- docs-test: run -->" {
            continue;
        }
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "a docs-test marker is followed by a code block"
        );
        let mut pending = String::new();
        for l in lines.by_ref() {
            if l.starts_with("```") {
                break;
            }
            let code = l.split(" #").next().unwrap_or_default().trim_end();
            if code.trim_start().starts_with('#') || code.trim().is_empty() {
                continue;
            }
            if let Some(head) = code.strip_suffix('\\') {
                pending.push_str(head);
                continue;
            }
            pending.push_str(code);
            out.push(std::mem::take(&mut pending));
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn marked_command_blocks_run_against_the_bundled_examples() {
    let work = tempfile::tempdir().unwrap();
    copy_dir(&repo().join("examples"), &work.path().join("examples"));
    let bin = work.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(crate::common::shardscope_bin(), bin.join("shardscope")).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for line in runnable(&text) {
            assert!(
                line.starts_with("shardscope "),
                "{}: a docs-test block runs shardscope commands only: {line}",
                page.display()
            );
            let out = Command::new("bash")
                .args(["-c", &line])
                .current_dir(work.path())
                .env("PATH", &path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: `{line}` failed ({}):\n{}{}",
                page.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            ran += 1;
        }
    }
    assert!(ran >= 30, "only {ran} documented commands ran");
}

/// What a newcomer's first `inspect` prints has no placeholder: no `?` where a rank or a path is
/// not known, no "1 files", and the path a DCP's `.metadata` records is said to be where it was
/// written (not where it is).
#[test]
fn inspect_summaries_have_no_placeholders() {
    let work = tempfile::tempdir().unwrap();
    let st = work.path().join("model.safetensors");
    let dcp = work.path().join("dcp2");
    let example = repo().join("examples/fsdp2_dcp");
    let run = |args: &[&str]| {
        let out = Command::new(crate::common::shardscope_bin())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let ex = example.to_str().unwrap();
    run(&[
        "convert",
        ex,
        "-o",
        st.to_str().unwrap(),
        "--select",
        "model",
        "-q",
    ]);
    run(&[
        "convert",
        ex,
        "-o",
        dcp.to_str().unwrap(),
        "--world-size",
        "2",
        "-q",
    ]);
    for input in [ex, st.to_str().unwrap(), dcp.to_str().unwrap()] {
        let text = run(&["inspect", input]);
        let summary: String = text
            .lines()
            .skip_while(|l| !l.starts_with("looks like:"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(!summary.contains('?'), "{input}:\n{summary}");
        assert!(!summary.contains(" 1 files"), "{input}:\n{summary}");
        assert!(!summary.contains("saved to"), "{input}:\n{summary}");
    }
    let text = run(&["inspect", st.to_str().unwrap()]);
    assert!(
        text.contains("in 1 file\n") && !text.contains("bytes per rank"),
        "{text}"
    );
}

/// BENCHMARKS.md's chart is drawn from its table (`bench/chart.py`): a figure changed in the table
/// and not in the chart fails here.
#[test]
fn the_benchmarks_chart_is_the_tables() {
    let out = Command::new("python3")
        .arg(repo().join("bench/chart.py"))
        .arg("--check")
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
