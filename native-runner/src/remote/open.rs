//! Opening a URL: which files the source holds. Object stores list the folder; over HTTP, which
//! cannot list, the checkpoint's own manifest (a DCP `.metadata`, an HF index) names the files
//! (core's [`Manifest`] reads the names; here they are fetched and their sizes asked for).

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use shardscope_core::formats::locate::{DCP_METADATA, HF_INDEX, LocateError, Manifest};

use super::connector::{Queries, request_url};
use super::fetch::PARALLEL_REQUESTS;
use super::retry::Failure;
use super::source::{RemoteFile, RemoteSource};
use super::store::build_store;
use super::url::{RemoteUrl, parse_url};

/// A DCP `.metadata` larger than this is refused (fetched whole on open; 100 000 chunks take
/// tens of MiB).
pub(super) const MAX_METADATA_BYTES: u64 = 1 << 30;
/// An HF `*.index.json` larger than this is refused (fetched whole on open; the largest models'
/// take a few MiB).
pub(super) const MAX_INDEX_BYTES: u64 = 256 << 20;

impl RemoteSource {
    /// An empty source over `url`'s store (`queries`: see [`Connector`](super::connector)).
    fn empty(url: RemoteUrl, queries: Queries, progress: bool) -> anyhow::Result<RemoteSource> {
        let store = build_store(&url, queries)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("shardscope-remote")
            .enable_all()
            .build()
            .context("cannot start the runtime for remote reads")?;
        Ok(RemoteSource {
            runtime,
            store,
            url,
            files: BTreeMap::new(),
            blocks: Mutex::new(HashMap::new()),
            fetched: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            progress: progress && std::io::stderr().is_terminal(),
        })
    }

    /// Opens a URL: a folder (`…/`: a DCP directory; listed on object stores, read through its
    /// `.metadata` over HTTP), a DCP `.metadata`, an HF `*.index.json`, or one file. A URL with a
    /// query (presigned) is one file: [`RemoteSource::open_files`].
    pub fn open(input: &str, progress: bool) -> anyhow::Result<RemoteSource> {
        let mut url = parse_url(input)?;
        if url.query.is_some() {
            return Self::open_files(&[input], progress);
        }
        let mut source = Self::empty(url.clone(), Queries::default(), progress)?;
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
                source.files.insert(file, RemoteFile::new(Some(size)));
            }
        }
        Ok(source)
    }

    /// Opens files each named by its own URL (per-rank `.pt` files, a DCP's `.metadata` and every
    /// `.distcp`, presigned URLs each with its own query) as one checkpoint: each is the file its
    /// URL names, named by its file name. They must be on one server (one bucket); a `.metadata`
    /// or `*.index.json` among them is read as the list of the files that must be there too.
    pub fn open_files(inputs: &[&str], progress: bool) -> anyhow::Result<RemoteSource> {
        let urls = inputs
            .iter()
            .map(|i| parse_url(i))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let Some(first) = urls.first() else {
            bail!("no URL given");
        };
        let mut files: BTreeMap<String, RemoteFile> = BTreeMap::new();
        let mut queries = HashMap::new();
        for url in &urls {
            if (url.scheme, &url.store_url) != (first.scheme, &first.store_url) {
                bail!(
                    "{} and {}: the URLs of one checkpoint must be on one server (scheme, host \
                     and port) or in one bucket",
                    first.shown(),
                    url.shown()
                );
            }
            let Some(name) = url.file.clone() else {
                bail!(
                    "{}: names a folder; among several URLs each names one file\nhint: a folder \
                     URL (ending with `/`) is given alone",
                    url.shown()
                );
            };
            let location = if url.folder.is_empty() {
                ObjectPath::from(name.as_str())
            } else {
                ObjectPath::from(format!("{}/{name}", url.folder))
            };
            if let Some(query) = &url.query {
                let key = request_url(&url.store_url, &location)
                    .with_context(|| format!("{}: cannot build its request URL", url.shown()))?;
                queries.insert(key, query.clone());
            }
            let mut file = RemoteFile::new(None);
            file.at = Some((location, url.shown()));
            if let Some(other) = files.insert(name.clone(), file) {
                let other = other.at.map(|(_, shown)| shown).unwrap_or_default();
                bail!(
                    "two URLs name a file called {name} ({other}, {}): files are told apart by name",
                    url.shown()
                );
            }
        }
        let mut root = first.clone();
        root.file = None;
        root.query = None;
        let mut source = Self::empty(root, Arc::new(queries), progress)?;
        source.files = files;
        source.head_all(None)?;
        // A manifest among them names the files that must be there (all of a DCP's, all of an
        // HF index's shards); it is fetched whole now and served from memory.
        let manifests: Vec<(String, Manifest)> = source
            .files
            .keys()
            .filter_map(|n| Manifest::of_file(n).map(|m| (n.clone(), m)))
            .collect();
        for (name, manifest) in manifests {
            let url = source.url_of(&name);
            let bytes = source
                .get_manifest(&name, manifest)
                .map_err(|f| anyhow::anyhow!("{url}: {}", f.describe(source.url.scheme)))?;
            let named = manifest_files(manifest, &url, &bytes)?;
            let missing: Vec<&String> = named
                .iter()
                .filter(|n| !source.files.contains_key(n.as_str()))
                .collect();
            if let Some(first_missing) = missing.first() {
                bail!(
                    "{url} names {} file(s) not among the URLs given ({first_missing}{})\nhint: \
                     give the URL of every file of the checkpoint, each with its own query",
                    missing.len(),
                    if missing.len() > 1 { ", …" } else { "" }
                );
            }
            if let Some(file) = source.files.get_mut(&name) {
                let _ = file.size.set(bytes.len() as u64);
                file.bytes = Some(bytes);
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
            self.files
                .insert(parts.join("/"), RemoteFile::new(Some(meta.size)));
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

    /// Sizes of every file not sized yet (named by `named_by`, a `.metadata` or an index; or
    /// given by URL), by `HEAD` requests in parallel: a missing file is reported here, with its URL.
    fn head_all(&self, named_by: Option<&str>) -> anyhow::Result<()> {
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
                    "{}: {}{}",
                    self.url_of(&name),
                    f.describe(self.url.scheme),
                    named_by.map_or(String::new(), |m| format!(" (named by {m})"))
                ),
            }
        }
        Ok(())
    }

    /// A manifest named by its own URL (an HF `*.index.json`).
    fn open_manifest(&mut self, name: &str, manifest: Manifest) -> anyhow::Result<()> {
        let bytes = self.get_manifest(name, manifest).map_err(|f| {
            anyhow::anyhow!("{}: {}", self.url_of(name), f.describe(self.url.scheme))
        })?;
        self.add_manifest(name, manifest, bytes)
    }

    /// The files `bytes` (the manifest `name`) names, with their sizes (`HEAD`), and the manifest
    /// itself, served from the bytes already fetched.
    fn add_manifest(&mut self, name: &str, manifest: Manifest, bytes: Bytes) -> anyhow::Result<()> {
        let manifest_url = self.url.url_of(name);
        for file in manifest_files(manifest, &manifest_url, &bytes)? {
            self.files.entry(file).or_insert(RemoteFile::new(None));
        }
        self.head_all(Some(&manifest_url))?;
        self.insert_fetched(name, bytes);
        Ok(())
    }

    fn insert_fetched(&mut self, name: &str, bytes: Bytes) {
        self.files.insert(
            name.to_owned(),
            RemoteFile {
                size: OnceLock::from(bytes.len() as u64),
                bytes: Some(bytes),
                at: None,
            },
        );
    }
}

/// The files a manifest (`url`: its URL, for messages) names.
fn manifest_files(manifest: Manifest, url: &str, bytes: &[u8]) -> anyhow::Result<Vec<String>> {
    manifest.files(bytes).map_err(|e| match e {
        LocateError::Dcp(e) => anyhow::Error::new(e).context(format!("cannot read {url}")),
        LocateError::Index(e) => anyhow::Error::new(e).context(format!("cannot read {url}")),
        outside @ LocateError::OutsideFolder { .. } => anyhow::anyhow!("{url} {outside}"),
    })
}
