//! [`RemoteSource`]: the files of one URL folder, read by range through the [`Source`] trait.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use shardscope_core::source::{Source, SourceError, checked_range};

use super::fetch::{PART_BYTES, lazy_zeroed, zeroed};
use super::readahead::Block;
use super::retry::Failure;
use super::url::RemoteUrl;

pub(super) struct RemoteFile {
    /// Known from a listing, or fetched by `HEAD` on first use.
    pub(super) size: OnceLock<u64>,
    /// Fetched whole when the source was opened (`.metadata`, an HF index): served borrowed.
    pub(super) bytes: Option<Bytes>,
    /// Where it is and how messages name it, when not `name` in the source's folder (a file
    /// given by its own URL among several: its path, its URL with a query shown as `?…`).
    pub(super) at: Option<(ObjectPath, String)>,
}

impl RemoteFile {
    /// A file of the source's folder, its size known or not yet.
    pub(super) fn new(size: Option<u64>) -> RemoteFile {
        RemoteFile {
            size: size.map_or_else(OnceLock::new, OnceLock::from),
            bytes: None,
            at: None,
        }
    }
}

/// Files under one URL folder, read by range over the network.
pub struct RemoteSource {
    pub(super) runtime: tokio::runtime::Runtime,
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) url: RemoteUrl,
    pub(super) files: BTreeMap<String, RemoteFile>,
    pub(super) blocks: Mutex<HashMap<String, Block>>,
    pub(super) fetched: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) progress: bool,
}

impl std::fmt::Debug for RemoteSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSource")
            .field("url", &self.url.folder_url())
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

impl RemoteSource {
    /// Bytes fetched so far (bodies only), and the number of GET requests.
    #[cfg(test)]
    pub(super) fn fetched(&self) -> (u64, u64) {
        (
            self.fetched.load(std::sync::atomic::Ordering::Relaxed),
            self.requests.load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    pub(super) fn location(&self, name: &str) -> ObjectPath {
        if let Some((location, _)) = self.files.get(name).and_then(|f| f.at.as_ref()) {
            return location.clone();
        }
        if self.url.folder.is_empty() {
            ObjectPath::from(name)
        } else {
            ObjectPath::from(format!("{}/{name}", self.url.folder))
        }
    }

    /// The URL of `name`, for messages (a query shown as `?…`).
    pub(super) fn url_of(&self, name: &str) -> String {
        match self.files.get(name).and_then(|f| f.at.as_ref()) {
            Some((_, shown)) => shown.clone(),
            None => self.url.url_of(name),
        }
    }

    /// The size of `name` by `HEAD` (retried like every request).
    pub(super) fn head(&self, name: &str) -> Result<u64, SourceError> {
        let location = self.location(name);
        let meta = self
            .runtime
            .block_on(self.with_retries(|| self.store.head(&location)))
            .map_err(|f| self.failure(name, &f))?;
        Ok(meta.size)
    }

    /// A zeroed buffer for `len` bytes of `name`: a size from the network, so a failed allocation
    /// is an error naming the URL, never an abort.
    pub(super) fn buffer(&self, name: &str, len: u64) -> Result<Vec<u8>, SourceError> {
        zeroed(len).map_err(|fault| self.failure(name, &Failure::new(fault, 1, 1)))
    }

    pub(super) fn file(&self, name: &str) -> Result<&RemoteFile, SourceError> {
        self.files.get(name).ok_or_else(|| SourceError::NotFound {
            name: self.url_of(name),
        })
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
        let size = self.head(name)?;
        Ok(*file.size.get_or_init(|| size))
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let size = self.size(name)?;
        let (start, end) = checked_range(name, offset, len, size)?;
        if let Some(bytes) = &self.file(name)?.bytes {
            return Ok(Cow::Borrowed(&bytes[start..end]));
        }
        let mut out = self.buffer(name, (end - start) as u64)?;
        self.read_into(name, offset, &mut out)?;
        Ok(Cow::Owned(out))
    }

    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        self.read_into(name, offset, out)
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
        let mut outs: Vec<Vec<u8>> = bounds
            .iter()
            .map(|(s, e)| self.buffer(name, (e - s) as u64))
            .collect::<Result<_, _>>()?;
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
        let mut out = lazy_zeroed((end - start) as u64)
            .map_err(|fault| self.failure(name, &Failure::new(fault, 1, 1)))?;
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
    use crate::remote::readahead::READAHEAD_BYTES;
    use crate::remote::url::parse_url;

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
        files.insert("big.bin".to_owned(), RemoteFile::new(None));
        files.insert("gone.bin".to_owned(), RemoteFile::new(Some(10)));
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
