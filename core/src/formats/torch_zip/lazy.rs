//! Opening a `torch.save` archive from a [`Source`] by range, without reading the whole file:
//! its tail (the end records), the central directory, the fixed 30 bytes of each member's local
//! header (torch pads the local header's extra field, so only it gives the data offset) and the
//! bytes of `data.pkl` and `byteorder`. The zip crate parses all of it, over a reader that holds
//! only the fetched byte ranges ([`Sparse`]): a read it needs and does not hold fails and is
//! recorded, the range is fetched and the parse runs again (a bounded number of times). The result
//! is the [`TorchArchive`] [`read_archive`] gives for the whole bytes. When the ranges do not
//! parse, the zip parser's error is final: the file is never read whole (a junk file of many GiB
//! behind a URL), and what is fetched is capped ([`MAX_DIRECTORY_BYTES`], [`MAX_FETCH_BYTES`]).
//! Sources whose whole reads are cheap (memory-mapped files) are read whole by [`read_archive`].

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::{self, Read, Seek, SeekFrom};

use super::{
    Layout, Members, TorchArchive, TorchZipError, archive_members, build_archive, looks_like_zip,
    pickle_member, stored, zip_error,
};
use crate::formats::pickle;
use crate::source::{Source, SourceError};

/// What went wrong opening a torch archive from a [`Source`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArchiveFileError {
    /// The source could not be read.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The bytes are not a readable torch archive.
    #[error(transparent)]
    Archive(#[from] TorchZipError),
}

/// Fetched first from the end of the file: the end records (EOCD, zip64 locator and record) and,
/// for archives of up to a few hundred members, the whole central directory.
const TAIL_BYTES: u64 = 16 << 10;
/// A local header's fixed part (signature to extra-field length): all the zip crate reads of it.
const LOCAL_HEADER_BYTES: u64 = 30;
/// Room for a local header's name and extra field (torch: its 64-byte alignment padding and a
/// zip64 field) when `data.pkl` and `byteorder` are fetched with their headers.
const HEADER_SLACK: u64 = 512;
/// Ranges this close together are fetched as one request (more than the remote source's
/// sequential-read gap, so separate requests never look like a forward walk to it).
const COALESCE_GAP: u64 = 128 << 10;
/// Fetch-and-retry rounds per step before giving up on the lazy path.
const MAX_ROUNDS: usize = 8;
/// The most bytes the first round fetches to fill a read the zip parser missed (the central
/// directory); each further round may fetch twice as much as the one before, up to
/// [`MAX_DIRECTORY_BYTES`] in all.
const MISS_FIRST_STEP: u64 = 16 << 20;
/// The most bytes fetched to read the end records and central directory (256 MiB, the directory
/// of some two and a half million members of a `torch.save` archive). A real directory is
/// fetched once; a junk end record makes the zip parser read on (it searches for the directory),
/// which stops here.
pub const MAX_DIRECTORY_BYTES: u64 = 256 << 20;
/// The most bytes one round fetches for a local header the parser missed.
const MISS_STEP: u64 = 64 << 20;
/// The most bytes one fetch of a torch archive's parts may ask for: the directory, the headers
/// and `data.pkl` (a pickle over 4 GiB is refused by the pickle reader anyway).
pub const MAX_FETCH_BYTES: u64 = 1 << 30;

/// Opens the torch archive `name` of `source`, reading only what [`read_archive`] looks at;
/// equal to `read_archive(&source.read_all(name)?)`, which it uses directly when the source says
/// whole reads are cheap (memory-mapped local files). Otherwise the file is never read whole
/// (a remote junk file of many GiB): when the ranges do not parse, that is the error
/// (see `lazy_failure`).
///
/// [`read_archive`]: super::read_archive
pub fn read_archive_from(
    source: &dyn Source,
    name: &str,
) -> Result<TorchArchive, ArchiveFileError> {
    if source.whole_reads_are_cheap() {
        let bytes = source.read_all(name)?;
        return Ok(super::read_archive(&bytes)?);
    }
    let (members, mut store) = match open_lazily_why(source, name, Limits::DEFAULT)? {
        Ok(opened) => opened,
        Err(why) => return Err(lazy_failure(source, name, why)),
    };
    match archive_from(source, name, &members, &mut store)? {
        Some(archive) => Ok(archive),
        None => Err(lazy_failure(source, name, None)),
    }
}

/// Why a file read by range is not a torch archive: not a zip at all (its first bytes, as the
/// whole-file reader checks first), or what the zip parser said of its end records, central
/// directory or member headers (`why`). No whole-file read.
fn lazy_failure(source: &dyn Source, name: &str, why: Option<TorchZipError>) -> ArchiveFileError {
    let size = match source.size(name) {
        Ok(s) => s,
        Err(e) => return e.into(),
    };
    let head = match source.read_range(name, 0, size.min(32)) {
        Ok(h) => h.into_owned(),
        Err(e) => return e.into(),
    };
    if !looks_like_zip(&head) {
        return TorchZipError::NotZip { head }.into();
    }
    why.unwrap_or_else(|| TorchZipError::Zip {
        message: format!(
            "the end records, central directory or member headers of this {size}-byte file do not parse (read by range: its last {TAIL_BYTES} bytes, the directory and each member's header; a remote file is never read whole): damaged, cut short, or not a torch.save archive"
        ),
    })
    .into()
}

/// How much [`read_lazily`] fetches at first and how far apart ranges may be to share a request
/// (tests make both tiny, to take every path on small fixtures).
#[derive(Debug, Clone, Copy)]
struct Limits {
    tail: u64,
    coalesce_gap: u64,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        tail: TAIL_BYTES,
        coalesce_gap: COALESCE_GAP,
    };
}

/// `Ok(None)`: not parsed from ranges (tests compare with the whole-file reader).
#[cfg(test)]
fn read_lazily(
    source: &dyn Source,
    name: &str,
    limits: Limits,
) -> Result<Option<TorchArchive>, ArchiveFileError> {
    let Some((members, mut store)) = open_lazily(source, name, limits)? else {
        return Ok(None);
    };
    archive_from(source, name, &members, &mut store)
}

/// The archive of an opened directory: `data.pkl` and `byteorder` fetched and parsed. `Ok(None)`:
/// they are not held after the fetch.
fn archive_from(
    source: &dyn Source,
    name: &str,
    members: &Members,
    store: &mut Store,
) -> Result<Option<TorchArchive>, ArchiveFileError> {
    // From here on the directory is the whole file's: its errors are final.
    let layout = Layout::of(members)?;
    let ranges = [Some(layout.pkl), layout.byteorder]
        .into_iter()
        .flatten()
        .map(|r| (r.offset, r.offset.saturating_add(r.len)))
        .collect();
    store.fetch(source, name, ranges)?;
    held_archive(members, &layout, store)
        .transpose()
        .map_err(Into::into)
}

/// The archive from `data.pkl` and `byteorder` as `store` holds them; `None` when it does not.
fn held_archive(
    members: &Members,
    layout: &Layout,
    store: &Store,
) -> Option<Result<TorchArchive, TorchZipError>> {
    let pkl = store.get(layout.pkl.offset, layout.pkl.len)?;
    let order = match layout.byteorder {
        Some(r) => Some(store.get(r.offset, r.len)?),
        None => None,
    };
    Some(build_archive(members, layout, pkl, order))
}

/// The torch archive stored as the `len` bytes at `offset` of `name` (a DCP `.distcp` item),
/// parsed from its first `head` and last `tail` bytes only: torch writes `data.pkl` and the small members first
/// and the central directory last, so the ends hold everything but the tensor's bytes. Equal to
/// `read_archive` of the item's whole bytes; `Ok(None)` when the ends alone do not parse (the
/// caller then reads the item whole). Nothing of the item's middle is read or allocated.
///
/// [`read_archive`]: super::read_archive
pub fn read_item_archive(
    source: &dyn Source,
    name: &str,
    offset: u64,
    len: u64,
    head: u64,
    tail: u64,
) -> Result<Option<TorchArchive>, SourceError> {
    let head_end = head.min(len);
    let tail_start = len.saturating_sub(tail).max(head_end);
    let mut ranges = vec![(0, head_end)];
    if tail_start < len {
        ranges.push((tail_start, len));
    }
    let mut store = Store::new(len, 0);
    for &(start, end) in ranges.iter().filter(|r| r.0 < r.1) {
        // One read per end (not `read_ranges`): a remote source serves repeated reads of the
        // same ends from its read-ahead blocks; the browser's fetches both misses in one round.
        let bytes = source.read_range(name, offset.saturating_add(start), end - start)?;
        if bytes.len() as u64 != end - start {
            return Ok(None);
        }
        store.insert(start, bytes.into_owned());
    }
    if !store.get(0, 4).is_some_and(looks_like_zip) {
        return Ok(None);
    }
    let store = RefCell::new(store);
    let Ok(mut archive) = zip::ZipArchive::new(Sparse::new(&store)) else {
        return Ok(None);
    };
    let Ok(members) = archive_members(&mut archive, len, |_| true) else {
        return Ok(None);
    };
    drop(archive);
    let store = store.into_inner();
    if store.miss.is_some() {
        return Ok(None);
    }
    let Ok(layout) = Layout::of(&members) else {
        return Ok(None);
    };
    Ok(held_archive(&members, &layout, &store).and_then(Result::ok))
}

/// The globals `data.pkl` of the archive `name` names ([`pickle_globals`]), reading its zip
/// directory and `data.pkl` by range (the whole file only where whole reads are cheap).
///
/// [`pickle_globals`]: super::pickle_globals
pub fn pickle_globals_from(
    source: &dyn Source,
    name: &str,
) -> Result<Vec<pickle::Global>, ArchiveFileError> {
    if source.whole_reads_are_cheap() {
        let bytes = source.read_all(name)?;
        return Ok(super::pickle_globals(&bytes)?);
    }
    let (members, mut store) = match open_lazily_why(source, name, Limits::DEFAULT)? {
        Ok(opened) => opened,
        Err(why) => return Err(lazy_failure(source, name, why)),
    };
    {
        let (member, (range, method)) = pickle_member(&members).ok_or(TorchZipError::NoPickle)?;
        stored(&member, method)?;
        store.fetch(
            source,
            name,
            vec![(range.offset, range.offset.saturating_add(range.len))],
        )?;
        if let Some(pkl) = store.get(range.offset, range.len) {
            return pickle::globals(pkl)
                .map_err(|source| ArchiveFileError::Archive(TorchZipError::Pickle { source }));
        }
    }
    Err(lazy_failure(source, name, None))
}

/// The zip directory of `name` (as [`archive_members`] lists it for the whole file) and the
/// bytes fetched to read it (its end records, directory, every member's local header, and
/// `data.pkl` and `byteorder` where their headers' slack covers them). `Ok(None)`: the ranges do
/// not parse alone.
#[cfg(test)]
fn open_lazily(
    source: &dyn Source,
    name: &str,
    limits: Limits,
) -> Result<Option<(Members, Store)>, SourceError> {
    Ok(open_lazily_why(source, name, limits)?.ok())
}

/// [`open_lazily`], with why the ranges do not parse (`None` where the parser gave no error
/// but needed more rounds of fetches than allowed).
fn open_lazily_why(
    source: &dyn Source,
    name: &str,
    limits: Limits,
) -> Result<Result<(Members, Store), Option<TorchZipError>>, SourceError> {
    let size = source.size(name)?;
    let store = RefCell::new(Store::new(size, limits.coalesce_gap));
    store
        .borrow_mut()
        .fetch(source, name, vec![(size.saturating_sub(limits.tail), size)])?;

    // The end records and the central directory. The directory runs up to the end records: a
    // miss fetches everything from it to the bytes already held, in one request.
    let mut archive = None;
    let mut directory_bytes = 0u64;
    for round in 0..MAX_ROUNDS {
        let result = zip::ZipArchive::new(Sparse::new(&store));
        let miss = store.borrow_mut().miss.take();
        match (result, miss) {
            (Ok(a), None) => {
                archive = Some(a);
                break;
            }
            (_, Some((offset, len))) => {
                let end = store
                    .borrow()
                    .next_held(offset)
                    .unwrap_or(size)
                    .min(offset.saturating_add(len.max(MISS_FIRST_STEP << round)));
                directory_bytes = directory_bytes.saturating_add(end.saturating_sub(offset));
                if directory_bytes > MAX_DIRECTORY_BYTES {
                    return Ok(Err(Some(TorchZipError::Zip {
                        message: format!(
                            "its zip directory is not where its end record says (read up to byte {offset} of {size}), and reading on would fetch more than the limit of {MAX_DIRECTORY_BYTES} bytes (256 MiB) for a torch.save archive's directory: damaged or not a torch.save archive"
                        ),
                    })));
                }
                store
                    .borrow_mut()
                    .fetch(source, name, vec![(offset, end)])?;
            }
            (Err(e), None) => return Ok(Err(Some(zip_error(&e)))),
        }
    }
    let Some(mut archive) = archive else {
        return Ok(Err(None));
    };

    // Each member's local header; `data.pkl` and `byteorder` with their bytes.
    let mut wanted = Vec::with_capacity(archive.len());
    for i in 0..archive.len() {
        let entry = match archive.by_index_data(i) {
            Ok(entry) => entry,
            Err(e) => return Ok(Err(Some(zip_error(&e)))),
        };
        let start = entry.header_start();
        let mut len = LOCAL_HEADER_BYTES;
        if let Ok(n) = entry.name()
            && (n.ends_with("data.pkl") || n.ends_with("byteorder"))
        {
            len = len
                .saturating_add(n.len() as u64)
                .saturating_add(HEADER_SLACK)
                .saturating_add(entry.compressed_size());
        }
        wanted.push((start, start.saturating_add(len)));
    }
    store.borrow_mut().fetch(source, name, wanted)?;
    let mut members = None;
    for _ in 0..MAX_ROUNDS {
        let result = archive_members(&mut archive, size, |_| true);
        let miss = store.borrow_mut().miss.take();
        match (result, miss) {
            (Ok(m), None) => {
                members = Some(m);
                break;
            }
            (_, Some((offset, len))) => {
                let end = offset.saturating_add(len.clamp(LOCAL_HEADER_BYTES, MISS_STEP));
                store
                    .borrow_mut()
                    .fetch(source, name, vec![(offset, end)])?;
            }
            (Err(e), None) => return Ok(Err(Some(e))),
        }
    }
    let Some(members) = members else {
        return Ok(Err(None));
    };
    drop(archive);
    let store = store.into_inner();
    // The whole-file reader looks at the first bytes before anything else.
    if !store.get(0, 4).is_some_and(looks_like_zip) {
        return Ok(Err(None));
    }
    Ok(Ok((members, store)))
}

/// The byte ranges of one file fetched so far (merged where they touch), and the first read
/// that asked for bytes not held.
struct Store {
    size: u64,
    coalesce_gap: u64,
    segments: BTreeMap<u64, Vec<u8>>,
    miss: Option<(u64, u64)>,
}

impl Store {
    fn new(size: u64, coalesce_gap: u64) -> Self {
        Store {
            size,
            coalesce_gap,
            segments: BTreeMap::new(),
            miss: None,
        }
    }

    /// The segment holding byte `offset`: its start and bytes.
    fn segment_at(&self, offset: u64) -> Option<(u64, &[u8])> {
        let (&start, bytes) = self.segments.range(..=offset).next_back()?;
        let end = start.checked_add(bytes.len() as u64)?;
        (offset < end).then_some((start, bytes.as_slice()))
    }

    /// Bytes `offset..offset + len`, when held.
    fn get(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let (start, bytes) = self.segment_at(offset)?;
        let from = usize::try_from(offset - start).ok()?;
        let to = from.checked_add(usize::try_from(len).ok()?)?;
        bytes.get(from..to)
    }

    /// Where the next held segment after `offset` starts.
    fn next_held(&self, offset: u64) -> Option<u64> {
        let after = offset.checked_add(1)?;
        self.segments.range(after..).next().map(|(&s, _)| s)
    }

    fn held(&self, offset: u64) -> bool {
        self.segment_at(offset).is_some()
    }

    /// Fetches the bytes of `ranges` (`start..end`, clamped to the file) not held yet: ranges
    /// at most `coalesce_gap` apart in one request, each request from its first byte not held
    /// to its last (bytes held in between are fetched again rather than split the request), all
    /// requests in one [`Source::read_ranges`].
    fn fetch(
        &mut self,
        source: &dyn Source,
        name: &str,
        mut ranges: Vec<(u64, u64)>,
    ) -> Result<(), SourceError> {
        for r in &mut ranges {
            r.1 = r.1.min(self.size);
        }
        ranges.retain(|r| r.0 < r.1);
        // What the directory asks for (before close ranges are merged into one request).
        let wanted = ranges
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.1 - r.0));
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (start, end) in ranges {
            match merged.last_mut() {
                Some(last) if start <= last.1.saturating_add(self.coalesce_gap) => {
                    last.1 = last.1.max(end);
                }
                _ => merged.push((start, end)),
            }
        }
        let mut requests = Vec::with_capacity(merged.len());
        for (mut start, mut end) in merged {
            while start < end && self.held(start) {
                start = self.segment_end(start);
            }
            while start < end && self.held(end - 1) {
                end = self.segment_start(end - 1);
            }
            if start < end {
                requests.push((start, end - start));
            }
        }
        if wanted > MAX_FETCH_BYTES {
            let total = wanted;
            return Err(SourceError::Io {
                name: name.to_owned(),
                message: format!(
                    "reading its zip directory, member headers and data.pkl would fetch {total} bytes, over the limit of {MAX_FETCH_BYTES} bytes (1 GiB) for them; damaged or hostile (its directory claims members larger than any torch.save pickle)"
                ),
            });
        }
        // All at once: a remote source fetches them concurrently.
        let fetched = source.read_ranges(name, &requests)?;
        for (&(start, _), bytes) in requests.iter().zip(fetched) {
            self.insert(start, bytes.into_owned());
        }
        Ok(())
    }

    fn segment_end(&self, offset: u64) -> u64 {
        self.segment_at(offset)
            .map_or(offset, |(s, b)| s.saturating_add(b.len() as u64))
    }

    fn segment_start(&self, offset: u64) -> u64 {
        self.segment_at(offset).map_or(offset, |(s, _)| s)
    }

    /// Adds bytes at `start` (they replace the held bytes they cover), merged with the segments
    /// they overlap or touch into one.
    fn insert(&mut self, start: u64, bytes: Vec<u8>) {
        let end = start.saturating_add(bytes.len() as u64);
        let mut touching: Vec<u64> = Vec::new();
        if let Some((&s, b)) = self.segments.range(..start).next_back()
            && s.saturating_add(b.len() as u64) >= start
        {
            touching.push(s);
        }
        touching.extend(self.segments.range(start..=end).map(|(&s, _)| s));
        if touching.is_empty() {
            self.segments.insert(start, bytes);
            return;
        }
        let lo = touching.first().map_or(start, |&s| s.min(start));
        let hi = touching
            .iter()
            .filter_map(|s| {
                self.segments
                    .get(s)
                    .map(|b| s.saturating_add(b.len() as u64))
            })
            .fold(end, u64::max);
        let Ok(total) = usize::try_from(hi - lo) else {
            return; // cannot be held in memory: later reads miss, and the lazy path gives up
        };
        let mut out = vec![0u8; total];
        let mut place = |at: u64, b: &[u8]| {
            if let Some(dst) = usize::try_from(at - lo)
                .ok()
                .and_then(|from| out.get_mut(from..from.checked_add(b.len())?))
            {
                dst.copy_from_slice(b);
            }
        };
        for s in touching {
            if let Some(b) = self.segments.remove(&s) {
                place(s, &b);
            }
        }
        place(start, &bytes);
        self.segments.insert(lo, out);
    }
}

/// A `Read + Seek` over a [`Store`]: the file's size, its held bytes, and an error (recorded as
/// the store's miss) for a read of bytes not held.
struct Sparse<'a> {
    store: &'a RefCell<Store>,
    pos: u64,
}

impl<'a> Sparse<'a> {
    fn new(store: &'a RefCell<Store>) -> Self {
        Sparse { store, pos: 0 }
    }
}

impl Read for Sparse<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut store = self.store.borrow_mut();
        if buf.is_empty() || self.pos >= store.size {
            return Ok(0);
        }
        if let Some((start, bytes)) = store.segment_at(self.pos) {
            let from = usize::try_from(self.pos - start).map_err(io::Error::other)?;
            let src = bytes.get(from..).unwrap_or_default();
            let n = src.len().min(buf.len());
            buf[..n].copy_from_slice(&src[..n]);
            self.pos = self.pos.saturating_add(n as u64);
            return Ok(n);
        }
        if store.miss.is_none() {
            store.miss = Some((self.pos, buf.len() as u64));
        }
        Err(io::Error::other(format!(
            "bytes at {} not fetched yet",
            self.pos
        )))
    }
}

impl Seek for Sparse<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let size = self.store.borrow().size;
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => size.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let pos = pos
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before the start"))?;
        self.pos = pos;
        Ok(pos)
    }
}

#[cfg(test)]
mod tests;
