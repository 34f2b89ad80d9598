//! A [`Source`] over browser `File`/`Blob` objects and HTTP(S) URLs, read lazily by byte range.
//!
//! The readers in `shardscope-core` are synchronous; browser reads are not (`Blob.slice(a, b)`
//! then `arrayBuffer()`, `fetch` with a `Range` header). [`LazySource`] bridges the two without a
//! second wasm instance: it answers `read_range` from the ranges fetched so far and records every
//! range it could not answer (a *miss*). [`LazySource::run`] runs a synchronous step (indexing,
//! reading the values the panels show), fetches what it missed — adjacent ranges coalesced — and
//! runs it again, until a run misses nothing. Indexing reads a handful of ranges (DCP `.metadata`,
//! safetensors headers, bytes items), so a checkpoint opens in a few rounds and holds in memory
//! only what its indexing touched, whatever the size of its data files. `torch.save` archives are
//! indexed the same way (the zip directory, `data.pkl`, the byte offsets of the storages).
//! A URL's query (a presigned URL's signature, an Azure SAS) is sent with every request for its
//! file and shown as `?…` in every message ([`crate::urls::shown`]).
//! Each round re-runs a metadata-only step, so the cost of a round is that of parsing the
//! metadata; the first round prefetches what every format reads first (see [`first_ranges`]).
//!
//! Where the browser can suspend wasm (JSPI, [`crate::jspi`]), a step reads picked files *during*
//! the step instead: a missed range is read then and there, a `.metadata` is streamed window by
//! window, and the ranges a step says it will read ([`Source::will_read`]) are read at once. Such
//! a step never misses a picked file's range, so it runs once.

use std::borrow::Cow;
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::BTreeMap;

use shardscope_core::source::{Source, SourceError};

use crate::jspi;
use crate::urls::shown;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;

/// The most bytes one range read may ask for.
pub const MAX_READ: u64 = 1 << 30;
/// The most bytes held for one checkpoint (everything its indexing read).
pub const MAX_CACHED: u64 = 1536 << 20;
/// The most fetch rounds for one step.
const MAX_ROUNDS: usize = 4096;
/// Misses closer than this are fetched as one range.
const COALESCE_GAP: u64 = 64 << 10;
/// What is prefetched at each end of a zip-like file (the zip directory, `data.pkl`).
const PREFETCH_ENDS: u64 = 64 << 10;
/// What is prefetched of each DCP data file (its first item's first bytes).
const DCP_HEAD: u64 = 4 << 10;
thread_local! {
    /// Ranges longer than this stay in JS once fetched ([`Held`]); 16 MiB unless
    /// [`set_held_in_js_over`] says otherwise.
    static HELD_IN_JS: std::cell::Cell<u64> = const { std::cell::Cell::new(16 << 20) };
}

/// Keeps fetched ranges longer than `bytes` in the JS arrays they were read into (the browser
/// test sets 0, so that its checkpoints are read that way too).
pub fn set_held_in_js_over(bytes: u64) {
    HELD_IN_JS.with(|h| h.set(bytes));
}
/// The most small ranges read at once.
const READS_AT_ONCE: usize = 512;
/// Whole-file prefetch for metadata files up to this size (read by rounds).
const PREFETCH_WHOLE: u64 = 64 << 20;

/// Where a file's bytes come from.
#[derive(Debug, Clone)]
pub enum Origin {
    /// A picked or dropped file.
    Blob(web_sys::Blob),
    /// A URL read with `Range` requests.
    Url(String),
}

#[derive(Debug)]
struct LazyFile {
    origin: Origin,
    size: u64,
    /// Fetched ranges: (offset, bytes).
    segments: Vec<(u64, Held)>,
    /// The file as registered for suspending reads (a picked file, once one is read).
    registered: OnceCell<Option<jspi::Registered>>,
}

/// Fetched bytes: small ranges in wasm memory; large ones (a million-chunk `.metadata` read whole)
/// left in the JS array the browser read them into and copied into wasm a window at a time as
/// they are parsed, so that wasm memory (which never shrinks) does not hold them, and the browser
/// frees them once they are released.
#[derive(Debug)]
enum Held {
    Wasm(Vec<u8>),
    Js(js_sys::Uint8Array),
}

impl Held {
    fn len(&self) -> u64 {
        match self {
            Held::Wasm(v) => v.len() as u64,
            Held::Js(a) => u64::from(a.length()),
        }
    }

    /// Copies `a..b` (within the held bytes) into `out` (as long).
    fn copy_into(&self, a: usize, b: usize, out: &mut [u8]) {
        match self {
            Held::Wasm(v) => out.copy_from_slice(&v[a..b]),
            // Both ends are within the array, whose length is a u32.
            Held::Js(arr) => arr.subarray(a as u32, b as u32).copy_to(out),
        }
    }
}

impl LazyFile {
    /// The file as registered for suspending reads (a picked file).
    fn registered(&self) -> Option<&jspi::Registered> {
        let Origin::Blob(blob) = &self.origin else {
            return None;
        };
        self.registered
            .get_or_init(|| jspi::Registered::new(blob))
            .as_ref()
    }
}

/// The segments each file held at one time ([`LazySource::mark`]).
#[derive(Debug, Clone, Default)]
pub struct Mark(BTreeMap<String, usize>);

/// What a step asked for and did not get.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Miss {
    Range {
        name: String,
        offset: u64,
        len: u64,
    },
    /// A file not known yet, looked up under the base URL (DCP data files named by `.metadata`).
    File(String),
}

/// Files read lazily; see the module documentation.
#[derive(Default)]
pub struct LazySource {
    files: BTreeMap<String, LazyFile>,
    /// Names not added explicitly are looked up under this URL (ends with `/`).
    base_url: Option<String>,
    misses: RefCell<Vec<Miss>>,
    cached: u64,
    /// Reads (requests) done so far between rounds.
    requests: u64,
    /// A step is running with suspending reads ([`jspi::run`]).
    suspending: Cell<bool>,
    /// Suspending reads done so far: (reads, bytes).
    streamed: Cell<(u64, u64)>,
    /// Ranges read at once during the running step because it said it would read them
    /// ([`Source::will_read`]): (file, offset) -> bytes. Dropped when the step returns.
    step_reads: RefCell<BTreeMap<(String, u64), Vec<u8>>>,
    /// Told the reads and bytes read so far during steps, at most every [`PROGRESS_EVERY_MS`]
    /// (the page runs while a step waits for a read, so a status line can follow it).
    on_step_reads: Option<OnStepReads>,
    /// When `on_step_reads` was last told (`Date.now()`).
    told: Cell<f64>,
}

/// See [`LazySource::on_step_reads`].
pub type OnStepReads = Box<dyn Fn(u64, u64) + Send>;

/// How often [`LazySource::on_step_reads`] is told, at most: each time the page draws a frame
/// (software rendering can take 0.1 s), which the waiting step then waits for too.
const PROGRESS_EVERY_MS: f64 = 500.0;

impl std::fmt::Debug for LazySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazySource")
            .field("files", &self.files.len())
            .field("cached", &self.cached)
            .field("requests", &self.requests)
            .field("streamed", &self.streamed.get())
            .finish_non_exhaustive()
    }
}

impl LazySource {
    pub fn new() -> Self {
        Self::default()
    }

    /// The same files (and base URL) with nothing fetched: a second reader of the checkpoint (a
    /// manifest check) that leaves this one as it is.
    #[must_use]
    pub fn reopen(&self) -> Self {
        let mut out = Self::new();
        out.base_url.clone_from(&self.base_url);
        for (name, f) in &self.files {
            out.add(name.clone(), f.origin.clone(), f.size);
        }
        out
    }

    /// Looks names that were not added up under `base` (a folder URL ending with `/`).
    pub fn set_base_url(&mut self, base: String) {
        self.base_url = Some(base);
    }

    /// Adds a file of known size.
    pub fn add(&mut self, name: String, origin: Origin, size: u64) {
        self.files.insert(
            name,
            LazyFile {
                origin,
                size,
                segments: Vec::new(),
                registered: OnceCell::new(),
            },
        );
    }

    /// Adds a picked file (its size is the Blob's).
    pub fn add_blob(&mut self, name: String, blob: web_sys::Blob) -> Result<(), String> {
        let size = blob.size();
        if !(0.0..=9_007_199_254_740_992.0).contains(&size) {
            return Err(format!(
                "{name}: the browser reports an invalid size ({size})"
            ));
        }
        // Exact: the size is a whole number below 2^53.
        self.add(name, Origin::Blob(blob), size as u64);
        Ok(())
    }

    /// Adds a file under the base URL, asking the server for its size.
    pub async fn add_url_file(&mut self, name: &str) -> Result<(), String> {
        let url = self.url_of(name)?;
        self.add_url(name.to_owned(), url).await
    }

    /// Adds the file at `url` (its query, if any, is sent with every request for it) as `name`,
    /// asking the server for its size.
    pub async fn add_url(&mut self, name: String, url: String) -> Result<(), String> {
        let size = head_size(&url).await?;
        self.requests += 1;
        self.add(name, Origin::Url(url), size);
        Ok(())
    }

    fn url_of(&self, name: &str) -> Result<String, String> {
        let base = self
            .base_url
            .as_deref()
            .ok_or_else(|| format!("no file `{name}` was opened"))?;
        let safe = !name.is_empty()
            && !name.starts_with('/')
            && !name.contains("://")
            && name
                .split('/')
                .all(|seg| !seg.is_empty() && seg != "." && seg != "..");
        if !safe {
            return Err(format!("`{name}` is not a file name under {base}"));
        }
        Ok(format!("{base}{name}"))
    }

    /// Bytes held (everything fetched so far).
    pub fn cached_bytes(&self) -> u64 {
        self.cached
    }

    /// Reads done so far: requests between rounds and reads during steps.
    pub fn reads(&self) -> u64 {
        self.requests.saturating_add(self.streamed.get().0)
    }

    /// Calls `f(reads, bytes)` as steps read (reads during steps and their bytes so far), at most
    /// twice a second.
    pub fn on_step_reads(&mut self, f: OnStepReads) {
        self.on_step_reads = Some(f);
    }

    /// Bytes read during steps (not held: read into the step's own buffers).
    pub fn streamed_bytes(&self) -> u64 {
        self.streamed.get().1
    }

    /// Total size of the files.
    pub fn total_size(&self) -> u64 {
        self.files
            .values()
            .fold(0u64, |a, f| a.saturating_add(f.size))
    }

    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// Fetches ranges (file, offset, length) now, e.g. the values a view will read. Ranges of
    /// unknown files are skipped; ranges outside their file are left to the reader to report.
    pub async fn prefetch(&mut self, ranges: Vec<(String, u64, u64)>) -> Result<(), String> {
        let misses: Vec<Miss> = ranges
            .into_iter()
            .filter(|(name, offset, len)| {
                self.files.get(name).is_some_and(|f| {
                    offset.checked_add(*len).is_some_and(|end| end <= f.size)
                        && find(&f.segments, *offset, *len).is_none()
                })
            })
            .map(|(name, offset, len)| Miss::Range { name, offset, len })
            .collect();
        self.fetch(misses).await
    }

    /// Fetches whole every file of at most `limit` bytes while all of them together stay under
    /// `limit` (a small checkpoint compared in a few reads instead of one per tensor).
    pub async fn prefetch_small(&mut self, limit: u64) -> Result<(), String> {
        let mut budget = limit;
        let mut ranges = Vec::new();
        for (name, f) in &self.files {
            if f.size <= budget {
                budget -= f.size;
                ranges.push((name.clone(), 0, f.size));
            }
        }
        self.prefetch(ranges).await
    }

    /// Prefetches what the readers read first: metadata files whole, both ends of other files.
    pub async fn prefetch_first(&mut self) -> Result<(), String> {
        let ranges = self
            .files
            .iter()
            .flat_map(|(name, f)| first_ranges(name, f.size))
            .collect();
        self.prefetch(ranges).await
    }

    /// Before a step run with suspending reads ([`jspi::available`]): starts reading what the
    /// readers read first of each picked file ([`first_ranges`]; not metadata files, which the
    /// step streams) without waiting, so that the data files' heads are read while the
    /// `.metadata` is parsed; fetches it now for files behind URLs.
    pub async fn begin_first_reads(&mut self) -> Result<(), String> {
        let mut now = Vec::new();
        for (name, f) in &self.files {
            if let Some(registered) = f.registered() {
                if !is_metadata_file(name) {
                    for (_, offset, len) in first_ranges(name, f.size) {
                        jspi::read_ahead(registered, offset, len);
                    }
                }
            } else {
                now.extend(first_ranges(name, f.size));
            }
        }
        self.prefetch(now).await
    }

    /// Runs `step` until it reads only fetched ranges (see the module documentation). A step that
    /// missed a range is run again even when it succeeded (readers may skip unreadable values).
    pub async fn run<T, E: std::fmt::Display>(
        &mut self,
        mut step: impl FnMut(&Self) -> Result<T, E>,
        mut progress: impl FnMut(&Self),
    ) -> Result<T, String> {
        for _ in 0..MAX_ROUNDS {
            self.misses.borrow_mut().clear();
            let result = if jspi::available() {
                // Picked files are read during the step.
                self.suspending.set(true);
                let this = &*self;
                let result = jspi::run(|| step(this)).await;
                self.suspending.set(false);
                self.step_reads.borrow_mut().clear();
                result?
            } else {
                step(self)
            };
            let misses = std::mem::take(&mut *self.misses.borrow_mut());
            if misses.is_empty() {
                return result.map_err(|e| e.to_string());
            }
            self.fetch(misses).await?;
            progress(self);
        }
        Err(format!(
            "reading the checkpoint's metadata took more than {MAX_ROUNDS} rounds of reads"
        ))
    }

    /// Runs `step` once: its result when it read only fetched ranges, else `None` once what it
    /// missed is fetched (for a step that consumes what it is given, which cannot run again).
    pub async fn run_once<T>(
        &mut self,
        step: impl FnOnce(&Self) -> T,
    ) -> Result<Option<T>, String> {
        self.misses.borrow_mut().clear();
        let result = step(self);
        let misses = std::mem::take(&mut *self.misses.borrow_mut());
        if misses.is_empty() {
            return Ok(Some(result));
        }
        self.fetch(misses).await?;
        Ok(None)
    }

    /// How many segments each file holds now, to [`LazySource::release`] what is fetched after.
    pub fn mark(&self) -> Mark {
        Mark(
            self.files
                .iter()
                .map(|(n, f)| (n.clone(), f.segments.len()))
                .collect(),
        )
    }

    /// Drops what was fetched since `mark` (a compared tensor's bytes), so that reading every
    /// tensor holds one at a time.
    pub fn release(&mut self, mark: &Mark) {
        for (name, f) in &mut self.files {
            let keep = mark.0.get(name).copied().unwrap_or(0);
            for (_, bytes) in f.segments.drain(keep.min(f.segments.len())..) {
                self.cached = self.cached.saturating_sub(bytes.len());
            }
        }
    }

    /// Drops every fetched range of at least `min_len` bytes (metadata files read whole, once
    /// the checkpoint is indexed), so that what is built next reuses their memory; a later read
    /// of them fetches them again.
    pub fn release_large(&mut self, min_len: u64) {
        for f in self.files.values_mut() {
            f.segments.retain(|(_, bytes)| {
                let keep = bytes.len() < min_len;
                if !keep {
                    self.cached = self.cached.saturating_sub(bytes.len());
                }
                keep
            });
        }
    }

    /// [`LazySource::run`] over two sources at once (A and B of a comparison): `step` is run
    /// until it reads only fetched ranges of both.
    pub async fn run_pair<T>(
        a: &mut Self,
        b: &mut Self,
        mut step: impl FnMut(&Self, &Self) -> T,
    ) -> Result<T, (&'static str, String)> {
        for _ in 0..MAX_ROUNDS {
            a.misses.borrow_mut().clear();
            b.misses.borrow_mut().clear();
            let result = step(a, b);
            let a_misses = std::mem::take(&mut *a.misses.borrow_mut());
            let b_misses = std::mem::take(&mut *b.misses.borrow_mut());
            if a_misses.is_empty() && b_misses.is_empty() {
                return Ok(result);
            }
            a.fetch(a_misses).await.map_err(|e| ("A", e))?;
            b.fetch(b_misses).await.map_err(|e| ("B", e))?;
        }
        Err((
            "A",
            format!(
                "reading one entry of the comparison took more than {MAX_ROUNDS} rounds of reads"
            ),
        ))
    }

    /// Fetches missed ranges (coalesced per file) and looks up missed files.
    async fn fetch(&mut self, mut misses: Vec<Miss>) -> Result<(), String> {
        misses.sort();
        misses.dedup();
        let mut ranges: Vec<(String, u64, u64)> = Vec::new();
        for miss in misses {
            match miss {
                Miss::File(name) => {
                    if !self.files.contains_key(&name) {
                        self.add_url_file(&name).await?;
                    }
                }
                Miss::Range { name, offset, len } => {
                    let end = offset.saturating_add(len);
                    if let Some(last) = ranges.last_mut()
                        && last.0 == name
                        && offset <= last.1.saturating_add(last.2).saturating_add(COALESCE_GAP)
                        && end.max(last.1 + last.2) - last.1 <= MAX_READ
                    {
                        last.2 = end.max(last.1 + last.2) - last.1;
                    } else {
                        ranges.push((name, offset, len));
                    }
                }
            }
        }
        // Every range is checked before any is read.
        let mut cached = self.cached;
        let mut reads: Vec<(String, Origin, u64, u64)> = Vec::with_capacity(ranges.len());
        for (name, offset, len) in ranges {
            if len > MAX_READ {
                return Err(format!(
                    "{name}: indexing needs {len} bytes at offset {offset} at once, more than the \
                     browser viewer reads in one piece ({} MiB); inspect it with the \
                     `shardscope` command line",
                    MAX_READ >> 20
                ));
            }
            let Some(next) = cached.checked_add(len).filter(|&c| c <= MAX_CACHED) else {
                return Err(format!(
                    "{name}: opening this checkpoint would hold more than {} MiB of metadata in \
                     the browser",
                    MAX_CACHED >> 20
                ));
            };
            cached = next;
            let file = self
                .files
                .get(&name)
                .ok_or_else(|| format!("no file `{name}` was opened"))?;
            reads.push((name, file.origin.clone(), offset, len));
        }
        // Large ranges are read one at a time and stay in JS ([`Held`]); small ones (a DCP's
        // data file heads: one per rank) many at once, so that a round costs about one read's
        // latency, not one per file.
        let over = HELD_IN_JS.with(std::cell::Cell::get);
        let (large, small): (Vec<_>, Vec<_>) = reads.into_iter().partition(|r| r.3 > over);
        for batch in small.chunks(READS_AT_ONCE) {
            let promises = js_sys::Array::new();
            for (name, origin, offset, len) in batch {
                let (name, origin, offset, len) = (name.clone(), origin.clone(), *offset, *len);
                promises.push(&wasm_bindgen_futures::future_to_promise(async move {
                    read_array(&name, &origin, offset, len)
                        .await
                        .map(wasm_bindgen::JsValue::from)
                        .map_err(|e| wasm_bindgen::JsValue::from_str(&e))
                }));
            }
            let arrays = JsFuture::from(js_sys::Promise::all(&promises))
                .await
                .map_err(|e| e.as_string().unwrap_or_else(|| js_text(&e)))?;
            let arrays = js_sys::Array::from(&arrays);
            for ((name, _, offset, _), array) in batch.iter().zip(arrays.iter()) {
                let bytes = js_sys::Uint8Array::new(&array).to_vec();
                self.hold(name, *offset, Held::Wasm(bytes));
            }
        }
        for (name, origin, offset, len) in large {
            let array = read_array(&name, &origin, offset, len).await?;
            self.hold(&name, offset, Held::Js(array));
        }
        Ok(())
    }

    /// Keeps fetched bytes as a segment of `name`.
    fn hold(&mut self, name: &str, offset: u64, bytes: Held) {
        self.requests += 1;
        self.cached = self.cached.saturating_add(bytes.len());
        if let Some(file) = self.files.get_mut(name) {
            file.segments.push((offset, bytes));
        }
    }
}

/// Whether `start..start + held` holds `offset..offset + len`.
fn covers(start: u64, held: usize, offset: u64, len: u64) -> bool {
    start <= offset
        && offset
            .checked_add(len)
            .is_some_and(|end| start.checked_add(held as u64).is_some_and(|e| end <= e))
}

/// The fetched segment holding `offset..offset + len`, with where the range lies in it.
fn find(segments: &[(u64, Held)], offset: u64, len: u64) -> Option<(&Held, usize, usize)> {
    let end = offset.checked_add(len)?;
    segments.iter().find_map(|(start, bytes)| {
        let seg_end = start.checked_add(bytes.len())?;
        if *start <= offset && end <= seg_end {
            let a = usize::try_from(offset - start).ok()?;
            let b = usize::try_from(end - start).ok()?;
            Some((bytes, a, b))
        } else {
            None
        }
    })
}

/// A file read whole or from start to end: a DCP `.metadata`, a JSON index.
fn is_metadata_file(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    base == ".metadata"
        || base
            .rsplit_once('.')
            .is_some_and(|(_, e)| e.eq_ignore_ascii_case("json"))
}

/// What is read first of a file: metadata (`.metadata`, JSON indexes) whole, the first bytes of
/// DCP data files, and both ends of other files (safetensors headers, zip directories and
/// `data.pkl`).
pub fn first_ranges(name: &str, size: u64) -> Vec<(String, u64, u64)> {
    let base = name.rsplit('/').next().unwrap_or(name);
    let ext = base
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    if is_metadata_file(name) {
        return if size <= PREFETCH_WHOLE {
            vec![(name.to_owned(), 0, size)]
        } else {
            Vec::new()
        };
    }
    if ext == "distcp" {
        // Torch places each data file's first item at byte 0; indexing reads its first bytes
        // (the item's serialization), so they come in the first round, not a second.
        return vec![(name.to_owned(), 0, size.min(DCP_HEAD))];
    }
    if size <= 2 * PREFETCH_ENDS {
        return vec![(name.to_owned(), 0, size)];
    }
    vec![
        (name.to_owned(), 0, PREFETCH_ENDS),
        (name.to_owned(), size - PREFETCH_ENDS, PREFETCH_ENDS),
    ]
}

impl Source for LazySource {
    /// Records every hinted range not fetched yet (and every file not known yet) as a miss, so
    /// that the next round fetches them all.
    fn will_read(&self, reads: &[(&str, u64, u64)]) {
        if self.suspending.get() {
            self.read_at_once(reads);
        }
        let mut misses = self.misses.borrow_mut();
        for &(name, offset, len) in reads {
            match self.files.get(name) {
                // During a step with suspending reads, a picked file's ranges are read now, all
                // at once (below).
                Some(file) if self.suspending.get() && file.registered().is_some() => {}
                None => {
                    if self.url_of(name).is_ok() {
                        misses.push(Miss::File(name.to_owned()));
                    }
                }
                Some(file) => {
                    let len = len.min(file.size.saturating_sub(offset));
                    if len > 0 && find(&file.segments, offset, len).is_none() {
                        misses.push(Miss::Range {
                            name: name.to_owned(),
                            offset,
                            len,
                        });
                    }
                }
            }
        }
    }

    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        if let Some(f) = self.files.get(name) {
            return Ok(f.size);
        }
        if self.url_of(name).is_ok() {
            self.misses.borrow_mut().push(Miss::File(name.to_owned()));
        }
        Err(SourceError::NotFound {
            name: name.to_owned(),
        })
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        if let Some(bytes) = self.step_read(name, offset, len) {
            return Ok(Cow::Owned(bytes));
        }
        if let Some(file) = self.to_read_suspending(name, offset, len) {
            let mut out = vec![0; usize::try_from(len).unwrap_or(usize::MAX)];
            return self
                .read_suspending(name, file, offset, &mut out)
                .map(|()| Cow::Owned(out));
        }
        if len == 0 {
            return self
                .fetched(name, offset, 0)
                .map(|_| Cow::Borrowed(&[][..]));
        }
        Ok(match self.fetched(name, offset, len)? {
            (Held::Wasm(v), a, b) => Cow::Borrowed(&v[a..b]),
            (held, a, b) => {
                let mut out = vec![0; b - a];
                held.copy_into(a, b, &mut out);
                Cow::Owned(out)
            }
        })
    }

    /// Copies the range out of the fetched bytes (a `.metadata` window from the JS array that
    /// holds the file).
    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        if out.is_empty() {
            return self.fetched(name, offset, 0).map(|_| ());
        }
        if self.suspending.get()
            && self
                .with_step_read(name, offset, out.len() as u64, |b| out.copy_from_slice(b))
                .is_some()
        {
            return Ok(());
        }
        if let Some(file) = self.to_read_suspending(name, offset, out.len() as u64) {
            return self.read_suspending(name, file, offset, out);
        }
        let (held, a, b) = self.fetched(name, offset, out.len() as u64)?;
        held.copy_into(a, b, out);
        Ok(())
    }
}

impl LazySource {
    /// The file to read `offset..offset + len` of during the running step: a picked file, the
    /// range within it and not fetched; `None` when the range is read as before (fetched, or a
    /// miss).
    fn to_read_suspending(&self, name: &str, offset: u64, len: u64) -> Option<&LazyFile> {
        if !self.suspending.get() || len == 0 || len > MAX_READ {
            return None;
        }
        let file = self.files.get(name)?;
        let within = offset.checked_add(len).is_some_and(|end| end <= file.size);
        (matches!(file.origin, Origin::Blob(_))
            && within
            && find(&file.segments, offset, len).is_none())
        .then_some(file)
    }

    /// During a step with suspending reads: reads the ranges the step says it will read (of
    /// picked files, not fetched yet) all at once, suspending it once, and keeps them until it
    /// returns. Holds at most [`MAX_READ`] bytes that way; what is left out (or fails: the read
    /// that follows reports it) is read when asked for.
    fn read_at_once(&self, reads: &[(&str, u64, u64)]) {
        let mut wanted: Vec<(&str, &jspi::Registered, u64, Vec<u8>)> = Vec::new();
        let mut total = 0u64;
        for &(name, offset, len) in reads {
            let Some(file) = self.files.get(name) else {
                continue;
            };
            let len = len.min(file.size.saturating_sub(offset));
            let Some(registered) = file.registered() else {
                continue;
            };
            if len == 0
                || total.saturating_add(len) > MAX_READ
                || find(&file.segments, offset, len).is_some()
                || self.with_step_read(name, offset, len, |_| ()).is_some()
            {
                continue;
            }
            total += len;
            wanted.push((name, registered, offset, vec![0; len as usize]));
        }
        if wanted.is_empty() {
            return;
        }
        let mut batch: Vec<(&jspi::Registered, u64, &mut [u8])> = wanted
            .iter_mut()
            .map(|(_, r, offset, buf)| (*r, *offset, buf.as_mut_slice()))
            .collect();
        if jspi::read_many(&mut batch).is_err() {
            return;
        }
        self.count_step_reads(wanted.len() as u64, total);
        let mut kept = self.step_reads.borrow_mut();
        for (name, _, offset, buf) in wanted {
            kept.insert((name.to_owned(), offset), buf);
        }
    }

    /// Counts reads done during a step, telling [`LazySource::on_step_reads`] at most every
    /// [`PROGRESS_EVERY_MS`].
    fn count_step_reads(&self, reads: u64, bytes: u64) {
        let (r, b) = self.streamed.get();
        let (r, b) = (r.saturating_add(reads), b.saturating_add(bytes));
        self.streamed.set((r, b));
        if let Some(f) = &self.on_step_reads {
            let now = js_sys::Date::now();
            if now - self.told.get() >= PROGRESS_EVERY_MS {
                self.told.set(now);
                f(r, b);
            }
        }
    }

    /// The bytes `offset..offset + len` of `name`, when read at once for the running step.
    fn step_read(&self, name: &str, offset: u64, len: u64) -> Option<Vec<u8>> {
        if !self.suspending.get() || len == 0 {
            return None;
        }
        self.with_step_read(name, offset, len, <[u8]>::to_vec)
    }

    /// `f` of the bytes `offset..offset + len` of `name` read at once for the running step (the
    /// range read last that starts at or before `offset`).
    fn with_step_read<T>(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Option<T> {
        let kept = self.step_reads.borrow();
        let ((held_name, start), bytes) = kept.range(..=(name.to_owned(), offset)).next_back()?;
        if held_name != name || !covers(*start, bytes.len(), offset, len) {
            return None;
        }
        let a = usize::try_from(offset - start).ok()?;
        Some(f(&bytes[a..a + usize::try_from(len).ok()?]))
    }

    /// Reads a range of `file` during the running step (see [`jspi`]).
    fn read_suspending(
        &self,
        name: &str,
        file: &LazyFile,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), SourceError> {
        let io = |message: String| SourceError::Io {
            name: shown(name),
            message,
        };
        let registered = file
            .registered()
            .ok_or_else(|| io("the browser did not take the file for reading".into()))?;
        jspi::read_into(registered, offset, out, is_metadata_file(name)).map_err(|e| {
            io(format!(
                "reading bytes {offset}..{}: {e}",
                offset + out.len() as u64
            ))
        })?;
        self.count_step_reads(1, out.len() as u64);
        Ok(())
    }

    /// The fetched segment holding `offset..offset + len` of `name` (len > 0) and where the range
    /// lies in it; a range not fetched yet is recorded as a miss. For `len == 0`, only checks the
    /// file and the offset (and answers an empty segment of nothing).
    fn fetched(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<(&Held, usize, usize), SourceError> {
        static EMPTY: Held = Held::Wasm(Vec::new());
        let Some(file) = self.files.get(name) else {
            return self.size(name).map(|_| (&EMPTY, 0, 0));
        };
        if offset.checked_add(len).is_none_or(|e| e > file.size) {
            return Err(SourceError::OutOfRange {
                name: name.to_owned(),
                offset,
                len,
                size: file.size,
            });
        }
        if len == 0 {
            return Ok((&EMPTY, 0, 0));
        }
        if let Some(found) = find(&file.segments, offset, len) {
            return Ok(found);
        }
        self.misses.borrow_mut().push(Miss::Range {
            name: name.to_owned(),
            offset,
            len,
        });
        Err(SourceError::Io {
            name: name.to_owned(),
            message: format!("bytes {offset}..{} not fetched yet", offset + len),
        })
    }
}

/// Converts a JS error to text.
fn js_text(e: &wasm_bindgen::JsValue) -> String {
    if let Some(err) = e.dyn_ref::<js_sys::Error>() {
        return format!("{}: {}", err.name(), err.message());
    }
    e.as_string().unwrap_or_else(|| format!("{e:?}"))
}

/// Reads `offset..offset + len` (at most 4 GiB) of a file with one request, as a JS array of
/// exactly `len` bytes.
async fn read_array(
    name: &str,
    origin: &Origin,
    offset: u64,
    len: u64,
) -> Result<js_sys::Uint8Array, String> {
    let end = offset + len;
    let fail = |what: String| format!("cannot read `{name}` (bytes {offset}..{end}): {what}");
    let buffer = match origin {
        Origin::Blob(blob) => {
            // Exact: offsets of browser files are below 2^53.
            let slice = blob
                .slice_with_f64_and_f64(offset as f64, end as f64)
                .map_err(|e| fail(js_text(&e)))?;
            JsFuture::from(slice.array_buffer())
                .await
                .map_err(|e| fail(js_text(&e)))?
        }
        Origin::Url(url) => {
            let headers = web_sys::Headers::new().map_err(|e| fail(js_text(&e)))?;
            headers
                .set("Range", &format!("bytes={offset}-{}", end - 1))
                .map_err(|e| fail(js_text(&e)))?;
            let resp = fetch(url, "GET", Some(&headers))
                .await
                .map_err(|e| fail(format!("{}: {e}", shown(url))))?;
            let status = resp.status();
            // A 200 is the whole file: accepted only when that is what was asked for.
            let whole = status == 200
                && offset == 0
                && resp
                    .headers()
                    .get("Content-Length")
                    .ok()
                    .flatten()
                    .is_some_and(|l| l.trim() == len.to_string());
            if status != 206 && !whole {
                return Err(fail(format!(
                    "{}: {}",
                    shown(url),
                    status_text(status, true)
                )));
            }
            JsFuture::from(resp.array_buffer().map_err(|e| fail(js_text(&e)))?)
                .await
                .map_err(|e| fail(js_text(&e)))?
        }
    };
    let array = js_sys::Uint8Array::new(&buffer);
    if u64::from(array.length()) < len {
        return Err(fail(format!(
            "got {} bytes, expected {len} (the file is shorter than it was)",
            array.length()
        )));
    }
    let take = u32::try_from(len).map_err(|_| fail("range too large".to_owned()))?;
    Ok(array.subarray(0, take))
}

fn status_text(status: u16, range: bool) -> String {
    match status {
        200 if range => "the server ignores Range requests (answered 200 to a range)".to_owned(),
        401 | 403 => format!("HTTP {status}: access denied; check credentials or the URL"),
        404 => "HTTP 404: not found".to_owned(),
        416 => "HTTP 416: the range lies outside the file".to_owned(),
        s => format!("HTTP {s}"),
    }
}

async fn fetch(
    url: &str,
    method: &str,
    headers: Option<&web_sys::Headers>,
) -> Result<web_sys::Response, String> {
    let init = web_sys::RequestInit::new();
    init.set_method(method);
    if let Some(h) = headers {
        init.set_headers(h);
    }
    let global = js_sys::global();
    let promise = if let Some(w) = global.dyn_ref::<web_sys::Window>() {
        w.fetch_with_str_and_init(url, &init)
    } else {
        return Err("no window to fetch from".to_owned());
    };
    let resp = JsFuture::from(promise).await.map_err(|e| js_text(&e))?;
    resp.dyn_into::<web_sys::Response>()
        .map_err(|_| "fetch returned no response".to_owned())
}

/// The size of the file at `url` (`HEAD`, `Content-Length`). A URL with a query that is refused
/// a `HEAD` (a presigned S3 or GCS URL is signed for `GET` only) is asked for one byte instead
/// (`Content-Range`).
async fn head_size(url: &str) -> Result<u64, String> {
    let shown = shown(url);
    let resp = fetch(url, "HEAD", None)
        .await
        .map_err(|e| format!("cannot reach {shown}: {e}"))?;
    if !resp.ok() {
        let status = resp.status();
        if url.contains('?') && matches!(status, 403 | 405) {
            return range_size(url).await;
        }
        return Err(format!("{shown}: {}", status_text(status, false)));
    }
    let len = resp
        .headers()
        .get("Content-Length")
        .map_err(|e| format!("{shown}: {}", js_text(&e)))?
        .ok_or_else(|| format!("{shown}: the server sent no Content-Length"))?;
    len.trim()
        .parse::<u64>()
        .map_err(|_| format!("{shown}: bad Content-Length `{len}`"))
}

/// The size of the file at `url` from a one-byte `GET` range (`Content-Range: bytes 0-0/SIZE`).
async fn range_size(url: &str) -> Result<u64, String> {
    let shown = shown(url);
    let headers = web_sys::Headers::new().map_err(|e| js_text(&e))?;
    headers.set("Range", "bytes=0-0").map_err(|e| js_text(&e))?;
    let resp = fetch(url, "GET", Some(&headers))
        .await
        .map_err(|e| format!("cannot reach {shown}: {e}"))?;
    let status = resp.status();
    if status != 206 {
        return Err(format!("{shown}: {}", status_text(status, true)));
    }
    let range = resp
        .headers()
        .get("Content-Range")
        .map_err(|e| format!("{shown}: {}", js_text(&e)))?
        .ok_or_else(|| {
            format!(
                "{shown}: refused a HEAD request and sent no Content-Range with a range (a server \
                 on another origin must expose it: `Access-Control-Expose-Headers: Content-Range`)"
            )
        })?;
    range
        .rsplit_once('/')
        .and_then(|(_, total)| total.trim().parse::<u64>().ok())
        .ok_or_else(|| format!("{shown}: bad Content-Range `{range}`"))
}

/// Reads a whole small file at `url` (a JSON index), at most `limit` bytes.
pub async fn get_small(url: &str, limit: u64) -> Result<Vec<u8>, String> {
    let shown = shown(url);
    let size = head_size(url).await?;
    if size > limit {
        return Err(format!("{shown}: {size} bytes, more than {limit} expected"));
    }
    let resp = fetch(url, "GET", None)
        .await
        .map_err(|e| format!("cannot reach {shown}: {e}"))?;
    if !resp.ok() {
        return Err(format!("{shown}: {}", status_text(resp.status(), false)));
    }
    let buf = JsFuture::from(resp.array_buffer().map_err(|e| js_text(&e))?)
        .await
        .map_err(|e| format!("{shown}: {}", js_text(&e)))?;
    Ok(js_sys::Uint8Array::new(&buf).to_vec())
}

/// Reads a whole picked file (JSON documents, zips), refusing files over `limit` bytes.
pub async fn read_whole(name: &str, blob: &web_sys::Blob, limit: u64) -> Result<Vec<u8>, String> {
    let size = blob.size();
    if size > limit as f64 {
        return Err(format!(
            "{name}: {} MiB; files of this kind are read whole, and the browser viewer reads at \
             most {} MiB of them",
            (size / 1_048_576.0).round(),
            limit >> 20
        ));
    }
    let buf = JsFuture::from(blob.array_buffer())
        .await
        .map_err(|e| format!("cannot read `{name}`: {}", js_text(&e)))?;
    Ok(js_sys::Uint8Array::new(&buf).to_vec())
}
