//! Opening a URL: which files the source holds. Object stores list the folder; over HTTP, which
//! cannot list, the checkpoint's own manifest (a DCP `.metadata`, an HF index) names the files
//! (core's [`Manifest`] reads the names; here they are fetched and their sizes asked for).

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use shardscope_core::formats::locate::{DCP_METADATA, HF_INDEX, LocateError, Manifest};

use super::fetch::PARALLEL_REQUESTS;
use super::retry::Failure;
use super::source::{RemoteFile, RemoteSource};
use super::store::build_store;
use super::url::parse_url;

/// A DCP `.metadata` larger than this is refused (fetched whole on open; 100 000 chunks take
/// tens of MiB).
pub(super) const MAX_METADATA_BYTES: u64 = 1 << 30;
/// An HF `*.index.json` larger than this is refused (fetched whole on open; the largest models'
/// take a few MiB).
pub(super) const MAX_INDEX_BYTES: u64 = 256 << 20;

impl RemoteSource {
    /// Opens a URL: a folder (`…/`: a DCP directory; listed on object stores, read through its
    /// `.metadata` over HTTP), a DCP `.metadata`, an HF `*.index.json`, or one file.
    pub fn open(input: &str, progress: bool) -> anyhow::Result<RemoteSource> {
        let mut url = parse_url(input)?;
        let store = build_store(&url)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("shardscope-remote")
            .enable_all()
            .build()
            .context("cannot start the runtime for remote reads")?;
        let mut source = RemoteSource {
            runtime,
            store,
            url: url.clone(),
            files: BTreeMap::new(),
            blocks: Mutex::new(HashMap::new()),
            fetched: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            progress: progress && std::io::stderr().is_terminal(),
        };
        let is_metadata = url.file.as_deref() == Some(DCP_METADATA);
        if url.file.is_none() || is_metadata {
            url.file = None;
            source.url = url;
            if source.url.scheme.can_list() && !is_metadata {
                source.list()?;
            } else {
                source.open_folder_over_http(!is_metadata)?;
            }
        } else if let Some(file) = url.file.take() {
            source.url = url;
            if Manifest::of_file(&file) == Some(Manifest::HfIndex) {
                source.open_manifest(&file, Manifest::HfIndex)?;
            } else {
                let size = match source.head(&file) {
                    Ok(size) => size,
                    // `…/ckpt` for `…/ckpt/`: say how a folder is named.
                    Err(e) if !file.contains('.') => {
                        bail!(
                            "{e}\nhint: this URL names a file; a folder (DCP directory, prefix) URL ends with `/`"
                        );
                    }
                    Err(e) => return Err(e.into()),
                };
                source.files.insert(
                    file,
                    RemoteFile {
                        size: OnceLock::from(size),
                        bytes: None,
                    },
                );
            }
        }
        Ok(source)
    }

    /// A manifest fetched whole (`.metadata`, an HF index), within its limit.
    fn get_manifest(&self, name: &str, manifest: Manifest) -> Result<Bytes, Failure> {
        match manifest {
            Manifest::Dcp => self.get_whole(name, MAX_METADATA_BYTES, "metadata files"),
            Manifest::HfIndex => self.get_whole(name, MAX_INDEX_BYTES, "index files"),
        }
    }

    /// Lists every object under the folder (two sub-folder levels, hidden folders and `*.tmp`
    /// skipped, as a local folder is read).
    fn list(&mut self) -> anyhow::Result<()> {
        let prefix =
            (!self.url.folder.is_empty()).then(|| ObjectPath::from(self.url.folder.as_str()));
        let folder_url = self.url.folder_url();
        let metas: Vec<object_store::ObjectMeta> = self
            .runtime
            .block_on(self.with_retries(|| self.store.list(prefix.as_ref()).try_collect()))
            .map_err(|f| {
                anyhow::anyhow!("cannot list {folder_url}: {}", f.describe(self.url.scheme))
            })?;
        let skip = prefix.as_ref().map_or(0, |p| p.parts().count());
        for meta in metas {
            let parts: Vec<String> = meta
                .location
                .parts()
                .skip(skip)
                .map(|p| p.as_ref().to_owned())
                .collect();
            let Some((file, dirs)) = parts.split_last() else {
                continue;
            };
            if dirs.len() > 2
                || dirs.iter().any(|d| d.starts_with('.'))
                || std::path::Path::new(file)
                    .extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("tmp"))
            {
                continue;
            }
            self.files.insert(
                parts.join("/"),
                RemoteFile {
                    size: OnceLock::from(meta.size),
                    bytes: None,
                },
            );
        }
        if self.files.is_empty() {
            bail!("{folder_url}: not found (no objects under this prefix)");
        }
        Ok(())
    }

    /// HTTP cannot list: a folder is read through the manifest that names its files, the DCP
    /// `.metadata`, or else (`try_hf`) an HF `model.safetensors.index.json`.
    fn open_folder_over_http(&mut self, try_hf: bool) -> anyhow::Result<()> {
        let meta_url = self.url.url_of(DCP_METADATA);
        let bytes = match self.get_manifest(DCP_METADATA, Manifest::Dcp) {
            Ok(b) => b,
            Err(f) if f.is_not_found() && try_hf => {
                if let Ok(b) = self.get_manifest(HF_INDEX, Manifest::HfIndex) {
                    return self.add_manifest(HF_INDEX, Manifest::HfIndex, b);
                }
                bail!(
                    "{meta_url}: not found (HTTP 404)\nhint: a folder URL must hold a DCP `.metadata` or a \
                     `model.safetensors.index.json`; name a single file by its own URL"
                );
            }
            Err(f) => bail!("{meta_url}: {}", f.describe(self.url.scheme)),
        };
        self.add_manifest(DCP_METADATA, Manifest::Dcp, bytes)
    }

    /// Sizes of every file named by `named_by` (a `.metadata`, an index), by `HEAD` requests in
    /// parallel: a missing file is reported here, with its URL.
    fn head_all(&self, named_by: &str) -> anyhow::Result<()> {
        let names: Vec<&String> = self
            .files
            .iter()
            .filter(|(_, f)| f.size.get().is_none())
            .map(|(n, _)| n)
            .collect();
        let sizes: Vec<Result<u64, (String, Failure)>> = self.runtime.block_on(
            futures::stream::iter(names.iter().map(|n| {
                let location = self.location(n);
                let name = (*n).clone();
                async move {
                    self.with_retries(|| self.store.head(&location))
                        .await
                        .map(|m| m.size)
                        .map_err(|f| (name, f))
                }
            }))
            .buffered(PARALLEL_REQUESTS)
            .collect(),
        );
        for (name, size) in names.iter().zip(sizes) {
            match size {
                Ok(size) => {
                    if let Some(f) = self.files.get(*name) {
                        let _ = f.size.set(size);
                    }
                }
                Err((name, f)) => bail!(
                    "{}: {} (named by {named_by})",
                    self.url.url_of(&name),
                    f.describe(self.url.scheme)
                ),
            }
        }
        Ok(())
    }

    /// A manifest named by its own URL (an HF `*.index.json`).
    fn open_manifest(&mut self, name: &str, manifest: Manifest) -> anyhow::Result<()> {
        let bytes = self.get_manifest(name, manifest).map_err(|f| {
            anyhow::anyhow!("{}: {}", self.url.url_of(name), f.describe(self.url.scheme))
        })?;
        self.add_manifest(name, manifest, bytes)
    }

    /// The files `bytes` (the manifest `name`) names, with their sizes (`HEAD`), and the manifest
    /// itself, served from the bytes already fetched.
    fn add_manifest(&mut self, name: &str, manifest: Manifest, bytes: Bytes) -> anyhow::Result<()> {
        let manifest_url = self.url.url_of(name);
        let files = manifest.files(&bytes).map_err(|e| match e {
            LocateError::Dcp(e) => {
                anyhow::Error::new(e).context(format!("cannot read {manifest_url}"))
            }
            LocateError::Index(e) => {
                anyhow::Error::new(e).context(format!("cannot read {manifest_url}"))
            }
            outside @ LocateError::OutsideFolder { .. } => {
                anyhow::anyhow!("{manifest_url} {outside}")
            }
        })?;
        for file in files {
            self.files.entry(file).or_insert(RemoteFile {
                size: OnceLock::new(),
                bytes: None,
            });
        }
        self.head_all(&manifest_url)?;
        self.insert_fetched(name, bytes);
        Ok(())
    }

    fn insert_fetched(&mut self, name: &str, bytes: Bytes) {
        self.files.insert(
            name.to_owned(),
            RemoteFile {
                size: OnceLock::from(bytes.len() as u64),
                bytes: Some(bytes),
            },
        );
    }
}
