//! The crate's top-level modules form layers: a module may import (`crate::x` paths, `use crate::{..}`
//! groups included) only from its own layer or a lower one. Every top-level module is listed here
//! with its layer; a module missing from the list fails the test, so a new one gets a layer on day one.
//! Cycles inside a layer are `../shared/tools/structure.py`'s to show.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every top-level module of `core/src` and its layer (lower layers know nothing of higher ones).
const LAYERS: &[(&str, u8)] = &[
    // Basic types.
    ("dtype", 0),
    ("shape", 0),
    ("source", 0),
    ("cast", 0),
    ("model", 0),
    // Bytes in, raw records out (and back).
    ("formats", 1),
    // The canonical index and the torch.save ⇄ value tree bridge.
    ("index", 2),
    ("bridge", 2),
    // Content manifests: one digest per tensor's logical value (`shardscope hash`).
    ("manifest", 2),
    // FSDP layouts.
    ("layout", 3),
    // Indexes re-keyed through a layout, layout hints.
    ("view", 4),
    // Consumers: how a checkpoint is read (files, views), transforms, checks.
    ("checkpoint", 5),
    ("transform", 5),
    ("verify", 5),
    ("doctor", 5),
];

fn layer(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|&(_, l)| l)
}

/// The source without `//` comments (doc comments included: an intra-doc link is no import).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|line| line.find("//").map_or(line, |i| &line[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment of every top-level item of a `{...}` group starting at `s` (after the `{`).
fn group_heads(s: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut at_item_start = true;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_item_start = true,
            c if c.is_whitespace() => {}
            _ if at_item_start && depth == 0 => {
                heads.push(ident(&s[i..]).to_owned());
                at_item_start = false;
            }
            _ => at_item_start = false,
        }
    }
    heads
}

/// The top-level modules a source text names through `crate::` paths.
fn imported_modules(text: &str) -> Vec<String> {
    let text = strip_comments(text);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("crate::") {
        // `$crate::` and identifiers ending in `crate` are not the crate root.
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        match rest.strip_prefix('{') {
            Some(group) => out.extend(group_heads(group)),
            None => out.push(ident(rest).to_owned()),
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).expect("core/src is readable");
    for entry in entries {
        let path = entry.expect("core/src is readable").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn imports_point_down_the_layers() {
    let src = src();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut violations = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_str()
            .unwrap();
        let module = first.strip_suffix(".rs").unwrap_or(first);
        if module == "lib" {
            continue;
        }
        let Some(own) = layer(module) else {
            violations.push(format!("{}: module `{module}` has no layer", rel.display()));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for target in imported_modules(&text) {
            match layer(&target) {
                None => violations.push(format!(
                    "{}: `crate::{target}` is not a listed module (import it by its module path)",
                    rel.display()
                )),
                Some(l) if l > own => violations.push(format!(
                    "{}: `{module}` (layer {own}) imports `crate::{target}` (layer {l})",
                    rel.display()
                )),
                Some(_) => {}
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn every_top_level_module_has_a_layer() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("mod "))?
                .strip_suffix(';')
        })
        .collect();
    let listed: BTreeMap<&str, u8> = LAYERS.iter().copied().collect();
    assert_eq!(listed.len(), LAYERS.len(), "a module is listed twice");
    let mut declared_sorted = declared.clone();
    declared_sorted.sort_unstable();
    assert_eq!(declared_sorted, listed.keys().copied().collect::<Vec<_>>());
}

#[test]
fn the_scanner_sees_paths_and_groups() {
    let text = "use crate::a::b;\nuse crate::{c::d, e::{f, g}, h};\n// crate::commented\n\
                fn x() { crate::i::j(); $crate::k::l(); }\n/// [`crate::doc`]\n";
    assert_eq!(imported_modules(text), ["a", "c", "e", "h", "i"]);
}
