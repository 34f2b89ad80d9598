//! Where checkpoint bytes come from: a small trait over "a set of named files".
//!
//! Readers in [`crate::formats`] take byte slices; multi-file checkpoints (DCP directories, folders
//! of per-rank files, sharded safetensors) are read through a [`Source`], so the same code runs on
//! local files (native runner, positioned reads), in tests and in the browser ([`MemorySource`]).

pub mod conformance;
#[cfg(test)]
pub(crate) mod recording;

use std::borrow::Cow;
use std::collections::BTreeMap;

/// What went wrong while reading from a [`Source`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The checkpoint has no file of this name.
    #[error("missing file `{name}`")]
    NotFound { name: String },
    /// A byte range reaches past the end of its file.
    #[error("byte range {offset}..{offset}+{len} lies outside `{name}` ({size} bytes)")]
    OutOfRange {
        name: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    /// The underlying storage failed (I/O error, permission).
    #[error("cannot read `{name}`: {message}")]
    Io { name: String, message: String },
}

/// A set of named files, read by byte range. Names are relative paths with `/` separators.
pub trait Source {
    /// Every file name, sorted.
    fn names(&self) -> Vec<String>;

    /// The size of a file in bytes.
    fn size(&self, name: &str) -> Result<u64, SourceError>;

    /// The bytes `offset..offset + len` of a file. Borrowed where the source can (memory).
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError>;

    /// Reads the bytes `offset..offset + out.len()` of a file into `out`, for readers that move
    /// one buffer through a large file (no buffer allocated, zeroed and freed per read). By
    /// default a copy of [`Source::read_range`]; a source that reads into memory it owns anyway
    /// (local files) reads straight into `out`.
    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let bytes = self.read_range(name, offset, out.len() as u64)?;
        if bytes.len() != out.len() {
            return Err(SourceError::Io {
                name: name.to_owned(),
                message: format!(
                    "asked for {} bytes at offset {offset}, got {}",
                    out.len(),
                    bytes.len()
                ),
            });
        }
        out.copy_from_slice(&bytes);
        Ok(())
    }

    /// The bytes `offset..offset + len` of a file, of which only the first `head_bytes` and the
    /// last `tail_bytes` must be read: a source for which reading is costly (the network) may
    /// leave the middle zero. For readers that need only both ends of a large range (a
    /// `torch.save` item's zip headers and central directory, not its tensor bytes); they fall
    /// back to [`Source::read_range`] when the ends alone do not parse. By default the whole range
    /// (memory and mmap sources: a page is touched only when a reader looks at it).
    fn read_ends(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        head_bytes: u64,
        tail_bytes: u64,
    ) -> Result<Cow<'_, [u8]>, SourceError> {
        let _ = (head_bytes, tail_bytes);
        self.read_range(name, offset, len)
    }

    /// Several ranges `(offset, len)` of one file, in the order asked. A source for which each
    /// request costs a round trip (the network) may fetch them concurrently; by default one
    /// [`Source::read_range`] after the other.
    fn read_ranges(
        &self,
        name: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Cow<'_, [u8]>>, SourceError> {
        ranges
            .iter()
            .map(|&(offset, len)| self.read_range(name, offset, len))
            .collect()
    }

    /// True when reading a whole file costs no more than the parts of it that are used (a
    /// memory-mapped file, whose pages are read when touched). Readers then parse whole files
    /// instead of fetching their parts range by range (which copies them). A source that copies
    /// what it reads (the runner's local files, read with positioned reads so that a file
    /// truncated under them is an error, not a `SIGBUS`) must say false: a whole read of a
    /// multi-GB file would hold all of it in memory.
    fn whole_reads_are_cheap(&self) -> bool {
        false
    }

    /// A hint that the ranges `(name, offset, len)` are read next. A source that fetches what a
    /// reader missed in rounds (the browser's) fetches all of them in one round instead of one a
    /// round; others ignore it. A range past a file's end, or of a file the source does not
    /// have, is only a hint: nothing fails.
    fn will_read(&self, reads: &[(&str, u64, u64)]) {
        let _ = reads;
    }

    /// True when [`Source::read_range`] lends bytes the source already holds (memory) instead
    /// of reading them into a new buffer: a reader moving through a large file then borrows
    /// each window rather than copying it with [`Source::read_range_into`].
    fn lends_ranges(&self) -> bool {
        false
    }

    /// True when a read is a local operation (memory, a local file), not a request over the
    /// network: checks that read many small pieces (every bytes item of a DCP) are affordable.
    fn reads_are_local(&self) -> bool {
        false
    }

    /// The whole file.
    fn read_all(&self, name: &str) -> Result<Cow<'_, [u8]>, SourceError> {
        let size = self.size(name)?;
        self.read_range(name, 0, size)
    }

    /// True when the source has a file of this name.
    fn contains(&self, name: &str) -> bool {
        self.size(name).is_ok()
    }
}

/// Checks a range against a file size and returns it as `usize` bounds.
pub fn checked_range(
    name: &str,
    offset: u64,
    len: u64,
    size: u64,
) -> Result<(usize, usize), SourceError> {
    let out = || SourceError::OutOfRange {
        name: name.to_owned(),
        offset,
        len,
        size,
    };
    let end = offset.checked_add(len).ok_or_else(out)?;
    if end > size {
        return Err(out());
    }
    let start = usize::try_from(offset).map_err(|_| out())?;
    let end = usize::try_from(end).map_err(|_| out())?;
    Ok((start, end))
}

/// Files held in memory (tests, the browser).
#[derive(Debug, Clone, Default)]
pub struct MemorySource {
    files: BTreeMap<String, Vec<u8>>,
}

impl MemorySource {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a file.
    pub fn insert(&mut self, name: impl Into<String>, bytes: Vec<u8>) {
        self.files.insert(name.into(), bytes);
    }

    /// Builder form of [`MemorySource::insert`].
    #[must_use]
    pub fn with(mut self, name: impl Into<String>, bytes: Vec<u8>) -> Self {
        self.insert(name, bytes);
        self
    }

    /// Removes a file, returning its bytes.
    pub fn remove(&mut self, name: &str) -> Option<Vec<u8>> {
        self.files.remove(name)
    }

    /// Mutable access to a file's bytes (tests corrupt files this way).
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Vec<u8>> {
        self.files.get_mut(name)
    }
}

impl Source for MemorySource {
    fn reads_are_local(&self) -> bool {
        true
    }

    fn lends_ranges(&self) -> bool {
        true
    }

    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.files
            .get(name)
            .map(|b| b.len() as u64)
            .ok_or_else(|| SourceError::NotFound {
                name: name.to_owned(),
            })
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let bytes = self.files.get(name).ok_or_else(|| SourceError::NotFound {
            name: name.to_owned(),
        })?;
        let (start, end) = checked_range(name, offset, len, bytes.len() as u64)?;
        Ok(Cow::Borrowed(&bytes[start..end]))
    }
}

impl<S: Source + ?Sized> Source for &S {
    fn names(&self) -> Vec<String> {
        (**self).names()
    }
    fn size(&self, name: &str) -> Result<u64, SourceError> {
        (**self).size(name)
    }
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        (**self).read_range(name, offset, len)
    }
    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        (**self).read_range_into(name, offset, out)
    }
    fn read_ends(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        head_bytes: u64,
        tail_bytes: u64,
    ) -> Result<Cow<'_, [u8]>, SourceError> {
        (**self).read_ends(name, offset, len, head_bytes, tail_bytes)
    }
    fn read_ranges(
        &self,
        name: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<Cow<'_, [u8]>>, SourceError> {
        (**self).read_ranges(name, ranges)
    }
    fn whole_reads_are_cheap(&self) -> bool {
        (**self).whole_reads_are_cheap()
    }
    fn lends_ranges(&self) -> bool {
        (**self).lends_ranges()
    }
    fn will_read(&self, reads: &[(&str, u64, u64)]) {
        (**self).will_read(reads);
    }
    fn reads_are_local(&self) -> bool {
        (**self).reads_are_local()
    }
}

/// `text` with the query of every URL in it replaced by `?…`: presigned URLs (S3/GCS, Azure SAS)
/// carry their secret there, and no message, status or log may show it. A query already hidden
/// stays as it is. Every front end (the runner's remote errors, the browser's page) calls this one.
pub fn hide_url_queries(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, url_on) = rest.split_at(at);
        out.push_str(head);
        let end = url_on
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | ')' | '`'))
            .unwrap_or(url_on.len());
        let (url, tail) = url_on.split_at(end);
        match url.find('?') {
            // Already hidden (`?…`, maybe followed by punctuation): kept as it is.
            Some(q) if url[q + 1..].starts_with('…') => out.push_str(url),
            Some(q) => {
                out.push_str(&url[..q]);
                out.push_str("?…");
            }
            None => out.push_str(url),
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        let s = MemorySource::new().with("a", vec![1, 2, 3]);
        assert_eq!(&*s.read_range("a", 1, 2).unwrap(), &[2, 3]);
        assert!(matches!(
            s.read_range("a", 2, 2),
            Err(SourceError::OutOfRange { .. })
        ));
        assert!(matches!(
            s.read_range("a", u64::MAX, 2),
            Err(SourceError::OutOfRange { .. })
        ));
        assert!(matches!(s.size("b"), Err(SourceError::NotFound { .. })));
        // By default both ends are the whole range, read through `read_range`.
        assert_eq!(&*s.read_ends("a", 0, 3, 1, 1).unwrap(), &[1, 2, 3]);
        assert!(matches!(
            s.read_ends("a", 2, 2, 1, 1),
            Err(SourceError::OutOfRange { .. })
        ));
        assert_eq!(s.names(), vec!["a".to_owned()]);
    }
}
