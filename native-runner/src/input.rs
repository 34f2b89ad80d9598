//! One place that turns command-line inputs (paths or URLs) into a [`Source`]: every command that
//! reads a checkpoint opens it here, so every command takes `http(s)://`, `s3://`, `gs://` and
//! `az://` URLs as well as local paths.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use shardscope_core::formats::locate::Manifest;
use shardscope_core::source::{Source, SourceError};

use shardscope_runner::file_source::FileSource;
use shardscope_runner::remote::{self, RemoteSource};

/// A checkpoint's files: local files, or objects behind a URL.
#[derive(Debug)]
pub enum Input {
    Local(FileSource),
    Remote(Box<RemoteSource>),
}

/// The argument as a URL, when it is one (`s3://…`, `http://…`).
pub fn as_url(path: &Path) -> Option<&str> {
    path.to_str().filter(|s| remote::is_url(s))
}

/// Opens one checkpoint given as one file, a directory (DCP, per-rank files, sharded safetensors;
/// symbolic links in it are followed, as in a Hugging Face cache snapshot), a DCP `.metadata`
/// file (its folder), an HF `*.index.json` (it and the files it names, as for its URL), several
/// per-rank files, one URL, or several URLs of files (per-rank files, a DCP's `.metadata` and
/// its `.distcp` files; presigned URLs each with its own query). `progress`: long remote reads may
/// draw a progress line on stderr (only when it is a terminal).
pub fn open(paths: &[PathBuf], progress: bool) -> anyhow::Result<Input> {
    if let Some(url) = paths.iter().find_map(|p| as_url(p)) {
        if let [_] = paths {
            return Ok(Input::Remote(Box::new(RemoteSource::open(url, progress)?)));
        }
        let urls: Vec<&str> = paths.iter().filter_map(|p| as_url(p)).collect();
        if let Some(local) = paths.iter().find(|p| as_url(p).is_none()) {
            anyhow::bail!(
                "{} and {}: one checkpoint's files are all local or all URLs",
                remote::shown(url),
                local.display()
            );
        }
        return Ok(Input::Remote(Box::new(RemoteSource::open_files(
            &urls, progress,
        )?)));
    }
    let local = if let [path] = paths {
        if path.is_dir() {
            FileSource::dir(path)?
        } else if path.file_name().is_some_and(|n| n == ".metadata") {
            // `.metadata` given directly: the DCP directory around it.
            FileSource::dir(parent_of(path))?
        } else if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| Manifest::of_file(n) == Some(Manifest::HfIndex))
        {
            FileSource::hf_index(path)?
        } else {
            FileSource::file(path)?
        }
    } else {
        FileSource::files(paths)?
    };
    Ok(Input::Local(local))
}

/// The folder holding `path` (`.` for a bare file name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

impl Source for Input {
    fn whole_reads_are_cheap(&self) -> bool {
        match self {
            Input::Local(s) => s.whole_reads_are_cheap(),
            Input::Remote(s) => s.whole_reads_are_cheap(),
        }
    }

    fn reads_are_local(&self) -> bool {
        match self {
            Input::Local(s) => s.reads_are_local(),
            Input::Remote(s) => s.reads_are_local(),
        }
    }

    fn names(&self) -> Vec<String> {
        match self {
            Input::Local(s) => s.names(),
            Input::Remote(s) => s.names(),
        }
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        match self {
            Input::Local(s) => s.size(name),
            Input::Remote(s) => s.size(name),
        }
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        match self {
            Input::Local(s) => s.read_range(name, offset, len),
            Input::Remote(s) => s.read_range(name, offset, len),
        }
    }

    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        match self {
            Input::Local(s) => s.read_range_into(name, offset, out),
            Input::Remote(s) => s.read_range_into(name, offset, out),
        }
    }

    fn read_ends(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        head_bytes: u64,
        tail_bytes: u64,
    ) -> Result<Cow<'_, [u8]>, SourceError> {
        match self {
            Input::Local(s) => s.read_ends(name, offset, len, head_bytes, tail_bytes),
            Input::Remote(s) => s.read_ends(name, offset, len, head_bytes, tail_bytes),
        }
    }

    fn read_ranges(
        &self,
        name: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Cow<'_, [u8]>>, SourceError> {
        match self {
            Input::Local(s) => s.read_ranges(name, ranges),
            Input::Remote(s) => s.read_ranges(name, ranges),
        }
    }
}
