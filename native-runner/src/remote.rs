//! A [`Source`] over objects behind a URL: `http(s)://`, `s3://`, `gs://`, `az://` (through the
//! `object_store` crate, with a small tokio runtime inside and a blocking API outside).
//!
//! What is read stays lazy: opening a DCP folder fetches its `.metadata` only (it names every data
//! file; HTTP cannot list, object stores list the prefix), sizes come from the listing or from
//! `HEAD` requests, and every other byte is fetched by range when a reader asks for it
//! ([`Source::read_ends`]: a `torch.save` item's two ends, not its tensor bytes). Large ranges are
//! split into parts fetched in parallel (bounded), each streamed into its place in the caller's
//! buffer; small reads that walk a file forward are served from one read-ahead block, so a reader
//! going through many small adjacent items makes few requests. Transient failures (5xx, resets, timeouts) are retried with backoff by
//! `object_store`'s `RetryConfig`; a body shorter than the range asked for is an error. Every error
//! names the object's URL.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, RetryConfig};
use shardscope_core::source::{Source, SourceError, checked_range};
use url::Url;

/// Reads at least this large are split into parts of this size, fetched in parallel.
pub const PART_BYTES: u64 = 8 << 20;
/// At most this many requests in flight for one read.
pub const PARALLEL_REQUESTS: usize = 8;
/// A small read that moves forward near where the last read of its file ended (the reader is
/// walking the file) fetches this much, and the reads that follow are served from it.
pub const READAHEAD_BYTES: u64 = 1 << 20;
/// How far from where the last read ended a forward read still counts as walking the file.
pub const SEQUENTIAL_GAP_BYTES: u64 = 64 << 10;
/// Reads at least this large show a progress line (stderr is a terminal, progress asked for).
const PROGRESS_MIN_BYTES: u64 = 32 << 20;
/// Files with a read-ahead block at most (one block per file; all dropped when a new file would
/// exceed this).
const MAX_BLOCKS: usize = 16;

/// Which kind of store a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    S3,
    Gcs,
    Azure,
}

impl Scheme {
    /// Object stores list a prefix; plain HTTP cannot.
    fn can_list(self) -> bool {
        !matches!(self, Scheme::Http)
    }
}

/// A parsed remote input: the store's root URL, the folder inside it (`/`-separated, no leading
/// or trailing `/`), and the file named, if any (`None` for a folder URL ending with `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    pub scheme: Scheme,
    /// `http://host:port/` or `s3://bucket` (what the store is built from).
    pub store_url: String,
    pub folder: String,
    pub file: Option<String>,
}

impl RemoteUrl {
    /// The URL of `name` inside the folder (for messages).
    pub fn url_of(&self, name: &str) -> String {
        let sep = if self.store_url.ends_with('/') {
            ""
        } else {
            "/"
        };
        if self.folder.is_empty() {
            format!("{}{sep}{name}", self.store_url)
        } else {
            format!("{}{sep}{}/{name}", self.store_url, self.folder)
        }
    }

    /// The folder's URL, with a trailing `/`.
    pub fn folder_url(&self) -> String {
        self.url_of("")
    }
}

/// True when an input argument is a URL this module reads (not a local path).
pub fn is_url(input: &str) -> bool {
    ["http://", "https://", "s3://", "gs://", "az://", "abfs://"]
        .iter()
        .any(|p| {
            input
                .get(..p.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(p))
        })
}

/// Splits a URL into store, folder and file. A trailing `/` names a folder.
pub fn parse_url(input: &str) -> anyhow::Result<RemoteUrl> {
    let url = Url::parse(input).with_context(|| format!("{input} is not a valid URL"))?;
    let scheme = match url.scheme() {
        "http" | "https" => Scheme::Http,
        "s3" => Scheme::S3,
        "gs" => Scheme::Gcs,
        "az" | "abfs" => Scheme::Azure,
        other => bail!("{input}: unsupported URL scheme `{other}` (use http, https, s3, gs or az)"),
    };
    if url.query().is_some() || url.fragment().is_some() {
        bail!("{input}: URLs with a query or a fragment are not supported");
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .with_context(|| format!("{input}: the URL names no host or bucket"))?;
    let store_url = match scheme {
        Scheme::Http => {
            let port = url.port().map_or(String::new(), |p| format!(":{p}"));
            format!("{}://{host}{port}/", url.scheme())
        }
        _ => format!("{}://{host}", url.scheme()),
    };
    // Percent-decoded segments; empty ones (`a//b`) are dropped.
    let path = url.path();
    let is_folder = path.is_empty() || path.ends_with('/');
    let mut segments = Vec::new();
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        let decoded = percent_decode(seg)
            .with_context(|| format!("{input}: bad percent-encoding in `{seg}`"))?;
        if decoded == "." || decoded == ".." || decoded.contains('/') {
            bail!("{input}: the path segment `{seg}` is not allowed");
        }
        segments.push(decoded);
    }
    let file = if is_folder { None } else { segments.pop() };
    Ok(RemoteUrl {
        scheme,
        store_url,
        folder: segments.join("/"),
        file,
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// What went wrong, in words a user can act on (`scheme`: which credentials to check).
pub fn describe_error(scheme: Scheme, err: &object_store::Error) -> String {
    match err {
        object_store::Error::NotFound { .. } => "not found (HTTP 404)".into(),
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. }
            if scheme == Scheme::Http =>
        {
            format!(
                "access denied ({}): the server refuses this URL (HTTP(S) URLs are read without credentials)",
                error_chain(err)
            )
        }
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            format!(
                "access denied ({}): check credentials ({})",
                error_chain(err),
                credential_hint(scheme)
            )
        }
        other => {
            let chain = error_chain(other);
            let lower = chain.to_ascii_lowercase();
            if lower.contains("nosuchbucket") {
                format!("not found: the bucket does not exist ({chain})")
            } else if scheme != Scheme::Http && is_credential_error(&lower) {
                format!(
                    "no credentials ({chain}): check credentials ({})",
                    credential_hint(scheme)
                )
            } else if lower.contains("body error") || lower.contains("before message length") {
                format!(
                    "short body: the connection closed before the whole range arrived ({chain})"
                )
            } else if lower.contains("connection refused") || lower.contains("connect error") {
                format!("cannot connect to the server ({chain})")
            } else if lower.contains("timed out") || lower.contains("timeout") {
                format!("timed out ({chain})")
            } else {
                chain
            }
        }
    }
}

/// Where credentials for `scheme` come from.
fn credential_hint(scheme: Scheme) -> &'static str {
    match scheme {
        Scheme::S3 => {
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN for s3://, or \
             AWS_SKIP_SIGNATURE=true for a public bucket"
        }
        Scheme::Gcs => "GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS for gs://",
        Scheme::Azure => "AZURE_STORAGE_ACCOUNT_NAME/AZURE_STORAGE_ACCOUNT_KEY for az://",
        Scheme::Http => "HTTP(S) URLs are read without credentials",
    }
}

/// An error (lowercased chain) from fetching credentials rather than the object: with none in
/// the environment, object stores ask the cloud's instance metadata endpoint, which off the cloud
/// refuses or does not answer.
fn is_credential_error(lower: &str) -> bool {
    [
        "169.254.169.254",
        "/latest/api/token",
        "/latest/meta-data",
        "metadata.google.internal",
        "/metadata/identity/oauth2",
        "credential",
    ]
    .iter()
    .any(|m| lower.contains(m))
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = e.source();
    }
    text
}

/// The bytes to fetch for a read of `offset..offset + len` of a `size`-byte file: the range itself,
/// or a read-ahead block when the read is small and starts where the previous one ended.
pub fn fetch_range(offset: u64, len: u64, size: u64, sequential: bool) -> Range<u64> {
    let end = offset.saturating_add(len).min(size);
    if sequential && len < READAHEAD_BYTES {
        offset..offset.saturating_add(READAHEAD_BYTES).min(size).max(end)
    } else {
        offset..end
    }
}

/// `range` cut into consecutive parts of at most `part` bytes (one part when it is smaller).
pub fn split_parts(range: Range<u64>, part: u64) -> Vec<Range<u64>> {
    let part = part.max(1);
    let mut out = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let end = start.saturating_add(part).min(range.end);
        out.push(start..end);
        start = end;
    }
    out
}

struct RemoteFile {
    /// Known from a listing, or fetched by `HEAD` on first use.
    size: OnceLock<u64>,
    /// Fetched whole when the source was opened (`.metadata`, an HF index): served borrowed.
    bytes: Option<Bytes>,
}

/// What was read of one file: where the last read started and ended, and the read-ahead block
/// (empty when the last fetch was exact).
#[derive(Debug, Clone, Default)]
struct Block {
    last_start: u64,
    last_end: u64,
    start: u64,
    data: Bytes,
}

impl Block {
    /// A read at `offset` continues a walk through the file: it moves forward from the last read
    /// and starts within [`SEQUENTIAL_GAP_BYTES`] of where the last read ended. The first
    /// read of a file and a re-read from the same start (a header read twice) never do.
    fn is_sequential(&self, offset: u64) -> bool {
        offset > self.last_start
            && offset <= self.last_end.saturating_add(SEQUENTIAL_GAP_BYTES)
            && offset.saturating_add(SEQUENTIAL_GAP_BYTES) >= self.last_end
    }
}

/// Files under one URL folder, read by range over the network.
pub struct RemoteSource {
    runtime: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
    url: RemoteUrl,
    files: BTreeMap<String, RemoteFile>,
    blocks: Mutex<HashMap<String, Block>>,
    fetched: AtomicU64,
    requests: AtomicU64,
    progress: bool,
}

impl std::fmt::Debug for RemoteSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSource")
            .field("url", &self.url.folder_url())
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: 4,
        retry_timeout: Duration::from_mins(2),
    }
}

fn build_store(url: &RemoteUrl) -> anyhow::Result<Arc<dyn ObjectStore>> {
    let what = || format!("cannot set up access to {}", url.folder_url());
    Ok(match url.scheme {
        Scheme::Http => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .with_client_options(
                    object_store::ClientOptions::new()
                        .with_allow_http(true)
                        .with_timeout(Duration::from_mins(1)),
                )
                .build()
                .with_context(what)?,
        ),
        Scheme::S3 => Arc::new(
            object_store::aws::AmazonS3Builder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .build()
                .with_context(what)?,
        ),
        Scheme::Gcs => Arc::new(
            object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .build()
                .with_context(what)?,
        ),
        Scheme::Azure => Arc::new(
            object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .build()
                .with_context(what)?,
        ),
    })
}

/// A name read from a checkpoint's own files (`.metadata`, an HF index) must stay inside the
/// folder.
fn check_member_name(name: &str, from: &str) -> anyhow::Result<()> {
    if name.is_empty()
        || name.starts_with('/')
        || name.contains('\\')
        || name
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        bail!("{from} names the file {name:?}, which is not inside its folder");
    }
    Ok(())
}

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
        let is_metadata = url.file.as_deref() == Some(".metadata");
        if url.file.is_none() || is_metadata {
            url.file = None;
            source.url = url;
            if source.url.scheme.can_list() && !is_metadata {
                source.list()?;
            } else {
                source.open_dcp_over_http(!is_metadata)?;
            }
        } else if let Some(file) = url.file.take() {
            source.url = url;
            if file.ends_with(".index.json") {
                source.open_hf_index(&file)?;
            } else {
                let size = match source.head(&file) {
                    Ok(size) => size,
                    // `…/ckpt` for `…/ckpt/`: say how a folder is named.
                    Err(e) if !file.contains('.') => {
                        bail!(
                            "{e}\nhint: this URL names a file; a folder (DCP directory, prefix) URL ends with `/`"
                        );
                    }
                    Err(e) => return Err(e),
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

    /// Bytes fetched so far (bodies only), and the number of GET requests.
    #[cfg(test)]
    pub fn fetched(&self) -> (u64, u64) {
        (
            self.fetched.load(Ordering::Relaxed),
            self.requests.load(Ordering::Relaxed),
        )
    }

    fn location(&self, name: &str) -> ObjectPath {
        if self.url.folder.is_empty() {
            ObjectPath::from(name)
        } else {
            ObjectPath::from(format!("{}/{name}", self.url.folder))
        }
    }

    fn io_error(&self, name: &str, err: &object_store::Error) -> SourceError {
        SourceError::Io {
            name: self.url.url_of(name),
            message: describe_error(self.url.scheme, err),
        }
    }

    fn head(&self, name: &str) -> anyhow::Result<u64> {
        let location = self.location(name);
        let meta = self
            .runtime
            .block_on(self.store.head(&location))
            .map_err(|e| self.io_error(name, &e))?;
        Ok(meta.size)
    }

    fn get_whole(&self, name: &str) -> Result<Bytes, object_store::Error> {
        let location = self.location(name);
        let bytes = self.runtime.block_on(async {
            let got = self.store.get(&location).await?;
            got.bytes().await
        })?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.fetched
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Lists every object under the folder (two sub-folder levels, hidden folders and `*.tmp`
    /// skipped, as a local folder is read).
    fn list(&mut self) -> anyhow::Result<()> {
        let prefix =
            (!self.url.folder.is_empty()).then(|| ObjectPath::from(self.url.folder.as_str()));
        let folder_url = self.url.folder_url();
        let metas: Vec<object_store::ObjectMeta> = self
            .runtime
            .block_on(self.store.list(prefix.as_ref()).try_collect())
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot list {folder_url}: {}",
                    describe_error(self.url.scheme, &e)
                )
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

    /// HTTP cannot list: the `.metadata` names every data file of a DCP directory. A folder URL
    /// without `.metadata` may be an HF folder (`model.safetensors.index.json`).
    fn open_dcp_over_http(&mut self, try_hf: bool) -> anyhow::Result<()> {
        let meta_url = self.url.url_of(".metadata");
        let bytes = match self.get_whole(".metadata") {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) if try_hf => {
                let index = "model.safetensors.index.json";
                if let Ok(b) = self.get_whole(index) {
                    return self.add_hf_index(index, b);
                }
                bail!(
                    "{meta_url}: not found (HTTP 404)\nhint: a folder URL must hold a DCP `.metadata` or a \
                     `model.safetensors.index.json`; name a single file by its own URL"
                );
            }
            Err(e) => bail!("{meta_url}: {}", describe_error(self.url.scheme, &e)),
        };
        let meta = shardscope_core::formats::dcp::read_metadata(&bytes)
            .with_context(|| format!("cannot read {meta_url}"))?;
        for (_, info) in &meta.storage {
            check_member_name(&info.relative_path, &meta_url)?;
            self.files
                .entry(info.relative_path.to_string())
                .or_insert(RemoteFile {
                    size: OnceLock::new(),
                    bytes: None,
                });
        }
        self.head_all(&meta_url)?;
        self.insert_fetched(".metadata", bytes);
        Ok(())
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
        let sizes: Vec<Result<u64, (String, object_store::Error)>> = self.runtime.block_on(
            futures::stream::iter(names.iter().map(|n| {
                let location = self.location(n);
                let store = Arc::clone(&self.store);
                let name = (*n).clone();
                async move {
                    store
                        .head(&location)
                        .await
                        .map(|m| m.size)
                        .map_err(|e| (name, e))
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
                Err((name, e)) => bail!(
                    "{}: {} (named by {named_by})",
                    self.url.url_of(&name),
                    describe_error(self.url.scheme, &e)
                ),
            }
        }
        Ok(())
    }

    fn open_hf_index(&mut self, name: &str) -> anyhow::Result<()> {
        let bytes = self.get_whole(name).map_err(|e| {
            anyhow::anyhow!(
                "{}: {}",
                self.url.url_of(name),
                describe_error(self.url.scheme, &e)
            )
        })?;
        self.add_hf_index(name, bytes)
    }

    fn add_hf_index(&mut self, name: &str, bytes: Bytes) -> anyhow::Result<()> {
        let index_url = self.url.url_of(name);
        let index = shardscope_core::formats::safetensors::read_index(&bytes)
            .with_context(|| format!("cannot read {index_url}"))?;
        for file in index.weight_map.values() {
            check_member_name(file, &index_url)?;
            self.files.entry(file.clone()).or_insert(RemoteFile {
                size: OnceLock::new(),
                bytes: None,
            });
        }
        self.head_all(&index_url)?;
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

    fn file(&self, name: &str) -> Result<&RemoteFile, SourceError> {
        self.files.get(name).ok_or_else(|| SourceError::NotFound {
            name: self.url.url_of(name),
        })
    }

    /// Fetches `range` of `name` into `out` (its length is the range's): parts in parallel, each
    /// copied into place as it arrives (memory: `out` plus the parts in flight), every part checked
    /// to be complete.
    fn fetch_into(&self, name: &str, range: Range<u64>, out: &mut [u8]) -> Result<(), SourceError> {
        let want = range.end - range.start;
        if out.len() as u64 != want {
            return Err(SourceError::Io {
                name: self.url.url_of(name),
                message: format!("internal: a {}-byte buffer for {want} bytes", out.len()),
            });
        }
        let parts = split_parts(range.clone(), PART_BYTES);
        let bar = (self.progress && want >= PROGRESS_MIN_BYTES).then(|| {
            let bar = indicatif::ProgressBar::new(want);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg} {bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}",
            ) {
                bar.set_style(style);
            }
            bar.set_message(format!("fetching {}", self.url.url_of(name)));
            bar
        });
        let part_len = usize::try_from(PART_BYTES).unwrap_or(usize::MAX);
        // Each part streams straight into its own slice of `out` (no intermediate buffer).
        let jobs = parts.into_iter().zip(out.chunks_mut(part_len)).collect();
        let result = self.fetch_parts(name, jobs, bar.as_ref());
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        result
    }

    /// Fetches each `(range, dst)` into its `dst` (as long as its range), at most
    /// [`PARALLEL_REQUESTS`] in flight, every one checked to be complete.
    fn fetch_parts(
        &self,
        name: &str,
        jobs: Vec<(Range<u64>, &mut [u8])>,
        bar: Option<&indicatif::ProgressBar>,
    ) -> Result<(), SourceError> {
        let location = self.location(name);
        let short = |part: &Range<u64>, got: usize| SourceError::Io {
            name: self.url.url_of(name),
            message: format!(
                "short body: asked for bytes {}..{} ({} bytes), got {got} bytes",
                part.start,
                part.end,
                part.end - part.start
            ),
        };
        self.runtime.block_on(async {
            let tasks = jobs.into_iter().map(|(part, dst)| {
                let location = location.clone();
                let store = Arc::clone(&self.store);
                async move {
                    let options = object_store::GetOptions {
                        range: Some(part.clone().into()),
                        ..Default::default()
                    };
                    let got = store
                        .get_opts(&location, options)
                        .await
                        .map_err(|e| self.io_error(name, &e))?;
                    let mut body = got.into_stream();
                    let mut filled = 0usize;
                    while let Some(chunk) = body.next().await {
                        let chunk = chunk.map_err(|e| self.io_error(name, &e))?;
                        let end = filled
                            .checked_add(chunk.len())
                            .filter(|&e| e <= dst.len())
                            .ok_or_else(|| short(&part, filled.saturating_add(chunk.len())))?;
                        dst[filled..end].copy_from_slice(&chunk);
                        filled = end;
                        if let Some(bar) = bar {
                            bar.inc(chunk.len() as u64);
                        }
                    }
                    if filled != dst.len() {
                        return Err(short(&part, filled));
                    }
                    Ok(filled as u64)
                }
            });
            let mut pieces = futures::stream::iter(tasks).buffer_unordered(PARALLEL_REQUESTS);
            while let Some(got) = pieces.next().await {
                let got = got?;
                self.requests.fetch_add(1, Ordering::Relaxed);
                self.fetched.fetch_add(got, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// Reads `offset..offset + out.len()` of `name` into `out`: small reads through the
    /// read-ahead block, large ones straight into `out` ([`Source::read_range`] reads here too).
    pub fn read_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let len = out.len() as u64;
        let size = self.size(name)?;
        let (start, end) = checked_range(name, offset, len, size)?;
        let file = self.file(name)?;
        if let Some(bytes) = &file.bytes {
            out.copy_from_slice(&bytes[start..end]);
            return Ok(());
        }
        if len == 0 {
            return Ok(());
        }
        let end_offset = offset + len; // checked above
        let poisoned = || SourceError::Io {
            name: self.url.url_of(name),
            message: "a reader thread panicked".into(),
        };
        // Served from the read-ahead block: whole, or its front part (then the rest is fetched).
        let (done, sequential) = {
            let mut blocks = self.blocks.lock().map_err(|_| poisoned())?;
            if let Some(b) = blocks.get_mut(name) {
                let b_end = b.start.saturating_add(b.data.len() as u64);
                if offset >= b.start && offset < b_end {
                    let from = usize::try_from(offset - b.start).unwrap_or(usize::MAX);
                    let to = usize::try_from(end_offset.min(b_end) - b.start).unwrap_or(usize::MAX);
                    let n = to.saturating_sub(from);
                    if let (Some(src), Some(dst)) = (b.data.get(from..to), out.get_mut(..n)) {
                        dst.copy_from_slice(src);
                        b.last_start = offset;
                        b.last_end = end_offset;
                        if end_offset <= b_end {
                            return Ok(());
                        }
                        // The rest exactly: the block stays for reads that come back to it.
                        (n, false)
                    } else {
                        (0, b.is_sequential(offset))
                    }
                } else {
                    (0, b.is_sequential(offset))
                }
            } else {
                (0, false)
            }
        };
        let rest_offset = offset + done as u64; // done <= len
        let rest = out.get_mut(done..).ok_or_else(poisoned)?;
        let range = fetch_range(rest_offset, rest.len() as u64, size, sequential);
        let block = if range.end > end_offset {
            let too_big = || SourceError::Io {
                name: self.url.url_of(name),
                message: "the read-ahead block does not fit in memory".into(),
            };
            let block_len = usize::try_from(range.end - range.start).map_err(|_| too_big())?;
            let mut block = vec![0u8; block_len];
            self.fetch_into(name, range.clone(), &mut block)?;
            rest.copy_from_slice(block.get(..rest.len()).ok_or_else(too_big)?);
            Some(Bytes::from(block))
        } else {
            self.fetch_into(name, range.clone(), rest)?;
            None
        };
        let mut blocks = self.blocks.lock().map_err(|_| poisoned())?;
        if blocks.len() >= MAX_BLOCKS && !blocks.contains_key(name) {
            blocks.clear();
        }
        let b = blocks.entry(name.to_owned()).or_default();
        b.last_start = offset;
        b.last_end = end_offset;
        // An exact fetch keeps the block: a reader may still come back to it (zip ends, then data).
        if let Some(block) = block {
            b.start = range.start;
            b.data = block;
        }
        Ok(())
    }
}

impl Source for RemoteSource {
    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        let file = self.file(name)?;
        if let Some(size) = file.size.get() {
            return Ok(*size);
        }
        let location = self.location(name);
        let meta = self
            .runtime
            .block_on(self.store.head(&location))
            .map_err(|e| self.io_error(name, &e))?;
        Ok(*file.size.get_or_init(|| meta.size))
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let size = self.size(name)?;
        let (start, end) = checked_range(name, offset, len, size)?;
        if let Some(bytes) = &self.file(name)?.bytes {
            return Ok(Cow::Borrowed(&bytes[start..end]));
        }
        let mut out = vec![0u8; end - start];
        self.read_into(name, offset, &mut out)?;
        Ok(Cow::Owned(out))
    }

    /// Several ranges of one file at once: each fetched exactly (no read-ahead block), up to
    /// [`PARALLEL_REQUESTS`] in flight, so a reader that needs many small pieces spread over a
    /// file (a `torch.save` file's local headers) waits for about one round trip per
    /// [`PARALLEL_REQUESTS`] pieces.
    fn read_ranges(
        &self,
        name: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Cow<'_, [u8]>>, SourceError> {
        let size = self.size(name)?;
        let mut bounds = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            bounds.push(checked_range(name, offset, len, size)?);
        }
        if let Some(bytes) = &self.file(name)?.bytes {
            return Ok(bounds
                .into_iter()
                .map(|(s, e)| Cow::Borrowed(&bytes[s..e]))
                .collect());
        }
        // One range, or large ones: their own (parallel-part) reads.
        if ranges.len() < 2 || ranges.iter().any(|r| r.1 >= PART_BYTES) {
            return ranges
                .iter()
                .map(|&(offset, len)| self.read_range(name, offset, len))
                .collect();
        }
        let mut outs: Vec<Vec<u8>> = bounds.iter().map(|(s, e)| vec![0u8; e - s]).collect();
        let jobs = ranges
            .iter()
            .zip(outs.iter_mut())
            .filter(|((_, len), _)| *len > 0)
            .map(|(&(offset, len), out)| (offset..offset + len, out.as_mut_slice()))
            .collect();
        self.fetch_parts(name, jobs, None)?;
        Ok(outs.into_iter().map(Cow::Owned).collect())
    }

    /// Both ends only, the middle left zero: a zeroed allocation whose untouched pages the OS
    /// never backs, so a 128 MiB `torch.save` item costs its 128 KiB of ends, not 128 MiB.
    fn read_ends(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        head_bytes: u64,
        tail_bytes: u64,
    ) -> Result<Cow<'_, [u8]>, SourceError> {
        let size = self.size(name)?;
        let (start, end) = checked_range(name, offset, len, size)?;
        let ends = head_bytes.saturating_add(tail_bytes);
        if self.file(name)?.bytes.is_some() || len <= ends {
            return self.read_range(name, offset, len);
        }
        let mut out = vec![0u8; end - start];
        let head = usize::try_from(head_bytes)
            .unwrap_or(usize::MAX)
            .min(out.len());
        let tail = usize::try_from(tail_bytes)
            .unwrap_or(usize::MAX)
            .min(out.len());
        let tail_at = out.len() - tail;
        self.read_into(name, offset, &mut out[..head])?;
        self.read_into(name, offset + tail_at as u64, &mut out[tail_at..])?;
        Ok(Cow::Owned(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_store_folder_and_file() {
        let u = parse_url("http://127.0.0.1:8080/ckpt/step_10/").unwrap();
        assert_eq!(u.scheme, Scheme::Http);
        assert_eq!(u.store_url, "http://127.0.0.1:8080/");
        assert_eq!(u.folder, "ckpt/step_10");
        assert_eq!(u.file, None);
        assert_eq!(
            u.url_of(".metadata"),
            "http://127.0.0.1:8080/ckpt/step_10/.metadata"
        );

        let u = parse_url("s3://bucket/a/model.safetensors").unwrap();
        assert_eq!(
            (u.scheme, u.store_url.as_str()),
            (Scheme::S3, "s3://bucket")
        );
        assert_eq!(u.folder, "a");
        assert_eq!(u.file.as_deref(), Some("model.safetensors"));
        assert_eq!(u.url_of("x"), "s3://bucket/a/x");

        let u = parse_url("gs://b/").unwrap();
        assert_eq!(
            (u.scheme, u.folder.as_str(), u.file.as_deref()),
            (Scheme::Gcs, "", None)
        );
        assert_eq!(u.url_of(".metadata"), "gs://b/.metadata");
        assert_eq!(parse_url("az://c/x/").unwrap().scheme, Scheme::Azure);
        assert_eq!(
            parse_url("https://h/a%20b/f.pt").unwrap().folder,
            "a b",
            "segments are percent-decoded"
        );
    }

    #[test]
    fn bad_urls_are_refused_with_the_url() {
        for bad in [
            "ftp://h/x",
            "s3:///x",
            "http://h/a/%zz",
            "http://h/x?a=1",
            "http://h/a/%2fb/x",
        ] {
            let err = parse_url(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{bad}: {err}");
        }
        assert!(is_url("S3://b/x") && is_url("https://h/") && is_url("az://c/"));
        assert!(!is_url("./s3:/x") && !is_url("ckpt/") && !is_url("http:/x"));
    }

    #[test]
    fn member_names_stay_inside_the_folder() {
        for bad in ["../x", "/etc/passwd", "a//b", "a/./b", "", "a\\b"] {
            assert!(check_member_name(bad, "u").is_err(), "{bad}");
        }
        check_member_name("__0_0.distcp", "u").unwrap();
        check_member_name("sub/__1_0.distcp", "u").unwrap();
    }

    #[test]
    fn reads_walking_forward_are_sequential() {
        let mut b = Block::default();
        assert!(!b.is_sequential(0), "the first read of a file");
        b.last_start = 100;
        b.last_end = 200;
        assert!(!b.is_sequential(100), "a re-read from the same start");
        assert!(!b.is_sequential(50), "backwards");
        assert!(b.is_sequential(150) && b.is_sequential(200));
        assert!(b.is_sequential(200 + SEQUENTIAL_GAP_BYTES));
        assert!(!b.is_sequential(201 + SEQUENTIAL_GAP_BYTES), "a jump");
        b.last_end = 10 * SEQUENTIAL_GAP_BYTES;
        assert!(
            !b.is_sequential(150),
            "far behind where the last read ended"
        );
        b.last_end = u64::MAX;
        assert!(b.is_sequential(u64::MAX));
    }

    #[test]
    fn small_sequential_reads_fetch_a_readahead_block() {
        // Not sequential: exactly what was asked.
        assert_eq!(fetch_range(100, 4, 1 << 30, false), 100..104);
        // Sequential and small: one block serves the reads that follow.
        assert_eq!(
            fetch_range(100, 4, 1 << 30, true),
            100..100 + READAHEAD_BYTES
        );
        // Clipped at the end of the file.
        assert_eq!(fetch_range(100, 4, 1000, true), 100..1000);
        // Large reads are never extended.
        assert_eq!(
            fetch_range(0, READAHEAD_BYTES, 1 << 30, true),
            0..READAHEAD_BYTES
        );
        // No overflow near u64::MAX.
        assert_eq!(
            fetch_range(u64::MAX - 1, 1, u64::MAX, true),
            u64::MAX - 1..u64::MAX
        );
    }

    #[test]
    fn large_reads_split_into_bounded_parts() {
        assert_eq!(split_parts(0..10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(split_parts(5..6, 4), vec![5..6]);
        assert!(split_parts(3..3, 4).is_empty());
        assert_eq!(split_parts(0..3, 0), vec![0..1, 1..2, 2..3]);
        let parts = split_parts(7..(3 * PART_BYTES + 7), PART_BYTES);
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts.iter().map(|r| r.end - r.start).sum::<u64>(),
            3 * PART_BYTES
        );
    }

    #[test]
    fn errors_say_what_to_do() {
        let nf = object_store::Error::NotFound {
            path: "x".into(),
            source: "404".into(),
        };
        assert_eq!(describe_error(Scheme::S3, &nf), "not found (HTTP 404)");
        let denied = object_store::Error::PermissionDenied {
            path: "x".into(),
            source: "403 Forbidden".into(),
        };
        let text = describe_error(Scheme::S3, &denied);
        assert!(
            text.contains("check credentials") && text.contains("AWS_ACCESS_KEY_ID"),
            "{text}"
        );
        let unauth = object_store::Error::Unauthenticated {
            path: "x".into(),
            source: "401".into(),
        };
        assert!(describe_error(Scheme::S3, &unauth).contains("check credentials"));
        let http = describe_error(Scheme::Http, &unauth);
        assert!(
            http.contains("access denied") && !http.contains("AWS_"),
            "{http}"
        );
        let other = object_store::Error::Generic {
            store: "HTTP",
            source: "connection reset".into(),
        };
        assert!(describe_error(Scheme::S3, &other).contains("connection reset"));
        // No credentials anywhere: the instance metadata endpoint refused.
        let imds = object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT http://169.254.169.254/latest/api/token in 2ms - \
                     Server returned non-2xx status code: 403 Forbidden"
                .into(),
        };
        let text = describe_error(Scheme::S3, &imds);
        assert!(
            text.starts_with("no credentials") && text.contains("AWS_ACCESS_KEY_ID"),
            "{text}"
        );
        let bucket = object_store::Error::Generic {
            store: "S3",
            source: "404 Not Found: <Error><Code>NoSuchBucket</Code></Error>".into(),
        };
        let text = describe_error(Scheme::S3, &bucket);
        assert!(text.contains("bucket does not exist"), "{text}");
        let cut = object_store::Error::Generic {
            store: "HTTP",
            source:
                "error reading a body from connection: end of file before message length reached"
                    .into(),
        };
        assert!(
            describe_error(Scheme::S3, &cut).starts_with("short body"),
            "{}",
            describe_error(Scheme::S3, &cut)
        );
        let refused = object_store::Error::Generic {
            store: "HTTP",
            source: "tcp connect error: Connection refused (os error 111)".into(),
        };
        assert!(describe_error(Scheme::S3, &refused).starts_with("cannot connect"));
    }

    /// The source over an in-memory object store: names, sizes, ranges, read-ahead and errors.
    #[test]
    fn reads_ranges_through_an_object_store() {
        let store = Arc::new(object_store::memory::InMemory::new());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let data: Vec<u8> = (0..(2 * PART_BYTES + 3)).map(|i| (i % 251) as u8).collect();
        runtime
            .block_on(store.put(&ObjectPath::from("ck/big.bin"), data.clone().into()))
            .unwrap();
        let url = parse_url("s3://bucket/ck/").unwrap();
        let mut files = BTreeMap::new();
        files.insert(
            "big.bin".to_owned(),
            RemoteFile {
                size: OnceLock::new(),
                bytes: None,
            },
        );
        files.insert(
            "gone.bin".to_owned(),
            RemoteFile {
                size: OnceLock::from(10),
                bytes: None,
            },
        );
        let source = RemoteSource {
            runtime,
            store,
            url,
            files,
            blocks: Mutex::new(HashMap::new()),
            fetched: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            progress: false,
        };
        assert_eq!(source.size("big.bin").unwrap(), data.len() as u64);
        // A large read: three parts, joined in order.
        let all = source.read_all("big.bin").unwrap();
        assert_eq!(&*all, &data[..]);
        assert_eq!(source.fetched(), (data.len() as u64, 3));
        // Small sequential reads: the second starts a read-ahead block, the next ones are served
        // from it without a request. A re-read from the same start fetches exactly.
        let before = source.fetched();
        assert_eq!(
            &*source.read_range("big.bin", 10, 4).unwrap(),
            &data[10..14]
        );
        assert_eq!(
            &*source.read_range("big.bin", 10, 8).unwrap(),
            &data[10..18]
        );
        assert_eq!(source.fetched().0 - before.0, 12, "no read-ahead yet");
        assert_eq!(
            &*source.read_range("big.bin", 14, 4).unwrap(),
            &data[14..18]
        );
        let (_, requests) = source.fetched();
        for i in 0..100u64 {
            let at = 18 + i * 8;
            let got = source.read_range("big.bin", at, 8).unwrap();
            assert_eq!(&*got, &data[at as usize..at as usize + 8]);
        }
        assert_eq!(
            source.fetched().1,
            requests,
            "served from the read-ahead block"
        );
        // Both ends only: the middle stays zero and is never fetched.
        let before = source.fetched().0;
        let ends = source.read_ends("big.bin", 5, PART_BYTES, 100, 50).unwrap();
        assert_eq!(ends.len() as u64, PART_BYTES);
        assert_eq!(&ends[..100], &data[5..105]);
        let tail_at = usize::try_from(PART_BYTES).unwrap() - 50;
        assert_eq!(&ends[tail_at..], &data[5 + tail_at..5 + tail_at + 50]);
        assert!(ends[100..tail_at].iter().all(|&b| b == 0));
        assert!(source.fetched().0 - before <= 2 * READAHEAD_BYTES);
        // Many small ranges at once: one exact request each, in the order asked.
        let before = source.fetched();
        let ranges: Vec<(u64, u64)> = (0..20u64).map(|i| (i * 100_003 % 20_000_000, 30)).collect();
        let got = source.read_ranges("big.bin", &ranges).unwrap();
        for (&(o, l), g) in ranges.iter().zip(&got) {
            assert_eq!(&**g, &data[o as usize..(o + l) as usize]);
        }
        let after = source.fetched();
        assert_eq!((after.0 - before.0, after.1 - before.1), (20 * 30, 20));
        assert!(matches!(
            source.read_ranges("big.bin", &[(0, 1), (data.len() as u64, 1)]),
            Err(SourceError::OutOfRange { .. })
        ));
        // Out of range, unknown names, missing objects: errors naming the URL.
        assert!(matches!(
            source.read_range("big.bin", data.len() as u64, 1),
            Err(SourceError::OutOfRange { .. })
        ));
        let err = source.read_range("nope", 0, 1).unwrap_err().to_string();
        assert!(err.contains("s3://bucket/ck/nope"), "{err}");
        let err = source.read_range("gone.bin", 0, 4).unwrap_err().to_string();
        assert!(
            err.contains("s3://bucket/ck/gone.bin") && err.contains("not found"),
            "{err}"
        );
    }
}
