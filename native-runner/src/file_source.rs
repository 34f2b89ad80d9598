//! A [`Source`] over files on disk, memory-mapped: reading a byte range touches only its pages,
//! so indexing a checkpoint never reads tensor data it does not look at.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Context;
use memmap2::Mmap;
use shardscope_core::source::{Source, SourceError, checked_range};

enum Mapped {
    Empty,
    Map(Mmap),
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        match self {
            Mapped::Empty => &[],
            Mapped::Map(m) => m,
        }
    }
}

/// Files under a root folder, mapped read-only. Names are relative paths with `/`.
pub struct FileSource {
    root: PathBuf,
    files: BTreeMap<String, Mapped>,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("root", &self.root)
            .field("files", &self.files.len())
            .finish()
    }
}

fn map_file(path: &Path) -> anyhow::Result<Mapped> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot stat {}", path.display()))?
        .len();
    if len == 0 {
        return Ok(Mapped::Empty);
    }
    // SAFETY: the map is read-only and private to this process; shardscope never writes its
    // inputs. Another process truncating the file while we read it could fault, as with any
    // mmap-based reader (safetensors, candle); the inputs are checkpoints at rest.
    #[allow(unsafe_code)]
    let map =
        unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
    Ok(Mapped::Map(map))
}

impl FileSource {
    /// One file: its name in the source is its file name.
    pub fn file(path: &Path) -> anyhow::Result<Self> {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("{} has no UTF-8 file name", path.display()))?
            .to_owned();
        let root = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut files = BTreeMap::new();
        files.insert(name, map_file(path)?);
        Ok(FileSource { root, files })
    }

    /// Several files (e.g. `rank*_model.pt`): names are their file names.
    pub fn files(paths: &[PathBuf]) -> anyhow::Result<Self> {
        let mut files = BTreeMap::new();
        for p in paths {
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("{} has no UTF-8 file name", p.display()))?
                .to_owned();
            if files.insert(name.clone(), map_file(p)?).is_some() {
                anyhow::bail!("two inputs are named {name}");
            }
        }
        let root = paths
            .first()
            .and_then(|p| p.parent())
            .map(Path::to_path_buf)
            .unwrap_or_default();
        Ok(FileSource { root, files })
    }

    /// The folder the source's names are relative to.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every regular file in a folder and its sub-folders (two levels deep), hidden ones included
    /// (`.metadata`).
    pub fn dir(root: &Path) -> anyhow::Result<Self> {
        let mut files = BTreeMap::new();
        walk(root, "", 0, &mut files)?;
        Ok(FileSource {
            root: root.to_path_buf(),
            files,
        })
    }
}

fn walk(
    dir: &Path,
    prefix: &str,
    depth: usize,
    out: &mut BTreeMap<String, Mapped>,
) -> anyhow::Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let path = entry.path();
        let kind = entry
            .file_type()
            .with_context(|| format!("cannot stat {}", path.display()))?;
        let rel = format!("{prefix}{name}");
        if kind.is_dir() {
            if depth < 2 && !name.starts_with('.') {
                walk(&path, &format!("{rel}/"), depth + 1, out)?;
            }
        } else if kind.is_file()
            && !Path::new(&name)
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("tmp"))
        {
            out.insert(rel, map_file(&path)?);
        }
    }
    Ok(())
}

impl Source for FileSource {
    /// Memory-mapped: only the pages a parser touches are read.
    fn whole_reads_are_cheap(&self) -> bool {
        true
    }

    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.files
            .get(name)
            .map(|m| m.bytes().len() as u64)
            .ok_or_else(|| SourceError::NotFound {
                name: self.root.join(name).display().to_string(),
            })
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let bytes = self
            .files
            .get(name)
            .ok_or_else(|| SourceError::NotFound {
                name: self.root.join(name).display().to_string(),
            })?
            .bytes();
        let (start, end) = checked_range(name, offset, len, bytes.len() as u64)?;
        Ok(Cow::Borrowed(&bytes[start..end]))
    }
}

#[cfg(test)]
mod conformance {
    #![allow(clippy::unwrap_used)]
    use shardscope_core::source::conformance::{sample_files, violations};

    use super::FileSource;

    #[test]
    fn file_sources_keep_the_source_contract() {
        let files = sample_files();
        let tmp = tempfile::tempdir().unwrap();
        for (name, bytes) in &files {
            let path = tmp.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        }
        let dir = FileSource::dir(tmp.path()).unwrap();
        assert_eq!(violations(&dir, &files), Vec::<String>::new());
        // Named files (`inspect a.pt b.pt`): each under its own name.
        let top: std::collections::BTreeMap<String, Vec<u8>> = files
            .iter()
            .filter(|(n, _)| !n.contains('/'))
            .map(|(n, b)| (n.clone(), b.clone()))
            .collect();
        let paths: Vec<std::path::PathBuf> = top.keys().map(|n| tmp.path().join(n)).collect();
        let listed = FileSource::files(&paths).unwrap();
        assert_eq!(violations(&listed, &top), Vec::<String>::new());
    }
}
