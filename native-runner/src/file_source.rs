//! A [`Source`] over files on disk, read with positioned reads (`pread`): reading a byte range
//! reads only that range, so indexing a checkpoint never reads tensor data it does not look at.
//!
//! Not memory-mapped: a mapped input that another process truncates while it is read kills the
//! process with `SIGBUS`, leaving no error and no chance to clean up. A positioned read of bytes
//! that are gone instead returns short, and [`FileSource`] says which file changed and how
//! ("… changed while it was read: it was N bytes, now M"). The size of every file is taken when
//! the source is opened; every read is checked against it. [`Source::read_ends`] (a DCP item's zip
//! headers and directory, around its tensor bytes) lends both ends out of an anonymous zero
//! mapping, so that the middle costs nothing, as it did when the files were mapped.
//!
//! Folders are walked following symbolic links to files and folders (a Hugging Face cache
//! snapshot is a folder of links into `../../blobs/`). The names the source serves are only the
//! entries found in the folder: a path that a checkpoint's metadata names (an HF index's
//! `weight_map`, DCP storage paths) is looked up among them and can never reach outside it.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use memmap2::MmapRaw;
use shardscope_core::formats::locate::Manifest;
use shardscope_core::source::{Source, SourceError, checked_range};

/// How many input files stay open at most (in the whole process), well below the usual limit of
/// 1024 descriptors.
const KEPT_OPEN: usize = 256;

/// How many input files are kept open now.
static OPEN_FILES: AtomicUsize = AtomicUsize::new(0);

/// One input file: where it is, its size when the source was opened, and (once read) its
/// descriptor.
struct Entry {
    path: PathBuf,
    size: u64,
    file: OnceLock<File>,
    /// Where [`Source::read_ends`] puts the ends it reads (`None`: no mapping could be made).
    ends: OnceLock<Option<Ends>>,
}

/// Files under a root folder, read by range. Names are relative paths with `/`.
pub struct FileSource {
    root: PathBuf,
    files: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("root", &self.root)
            .field("files", &self.files.len())
            .finish()
    }
}

/// The error for a file whose size is no longer the one it had when the source was opened.
fn changed(path: &Path, was: u64, now: Option<u64>) -> SourceError {
    let now = now.map_or_else(|| "gone".to_owned(), |n| format!("now {n} bytes"));
    SourceError::Io {
        name: path.display().to_string(),
        message: format!(
            "the file changed while it was read (it was {was} bytes, {now}); \
             was it being written or replaced?"
        ),
    }
}

fn io_error(path: &Path, what: &str, e: &std::io::Error) -> SourceError {
    SourceError::Io {
        name: path.display().to_string(),
        message: format!("{what}: {e}"),
    }
}

/// An entry for `path`: its size now (following links).
fn entry(path: &Path) -> anyhow::Result<Entry> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?;
    Ok(Entry {
        path: path.to_path_buf(),
        size: meta.len(),
        file: OnceLock::new(),
        ends: OnceLock::new(),
    })
}

/// An input file's descriptor: the one kept open, or one opened for a single read.
enum Opened<'a> {
    Kept(&'a File),
    Once(File),
}

impl std::ops::Deref for Opened<'_> {
    type Target = File;

    fn deref(&self) -> &File {
        match self {
            Opened::Kept(f) => f,
            Opened::Once(f) => f,
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if self.file.get().is_some() {
            OPEN_FILES.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Entry {
    /// The open file, opened on first use (a folder of thousands of files holds no descriptor
    /// for a file it never reads) and kept open while fewer than [`KEPT_OPEN`] are (a folder of
    /// thousands of per-rank files that are all read then opens each file again per read rather
    /// than running out of descriptors). Its size must still be the one listed.
    fn file(&self) -> Result<Opened<'_>, SourceError> {
        if let Some(f) = self.file.get() {
            return Ok(Opened::Kept(f));
        }
        let file = File::open(&self.path).map_err(|e| io_error(&self.path, "cannot open", &e))?;
        let now = file
            .metadata()
            .map_err(|e| io_error(&self.path, "cannot stat", &e))?
            .len();
        if now != self.size {
            return Err(changed(&self.path, self.size, Some(now)));
        }
        if OPEN_FILES.fetch_add(1, Ordering::Relaxed) >= KEPT_OPEN {
            OPEN_FILES.fetch_sub(1, Ordering::Relaxed);
            return Ok(Opened::Once(file));
        }
        if self.file.set(file).is_err() {
            // Another thread kept its descriptor first (either reads the same file): ours is
            // closed, and no longer counted.
            OPEN_FILES.fetch_sub(1, Ordering::Relaxed);
        }
        match self.file.get() {
            Some(f) => Ok(Opened::Kept(f)),
            None => Err(SourceError::Io {
                name: self.path.display().to_string(),
                message: "internal: an opened file was not kept".into(),
            }),
        }
    }

    /// Fills `out` from `offset` (checked against the listed size by the caller).
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let file = self.file()?;
        match file.read_exact_at(out, offset) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                let now = file.metadata().ok().map(|m| m.len());
                Err(changed(&self.path, self.size, now))
            }
            Err(e) => Err(io_error(
                &self.path,
                &format!("cannot read {} bytes at offset {offset}", out.len()),
                &e,
            )),
        }
    }
}

fn file_name_of(path: &Path) -> anyhow::Result<String> {
    Ok(path
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{} has no UTF-8 file name", path.display()))?
        .to_owned())
}

impl FileSource {
    /// One file: its name in the source is its file name.
    pub fn file(path: &Path) -> anyhow::Result<Self> {
        let name = file_name_of(path)?;
        let root = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut files = BTreeMap::new();
        files.insert(name, entry(path)?);
        Ok(FileSource { root, files })
    }

    /// Several files (e.g. `rank*_model.pt`): names are their file names.
    pub fn files(paths: &[PathBuf]) -> anyhow::Result<Self> {
        let mut files = BTreeMap::new();
        for p in paths {
            let name = file_name_of(p)?;
            if files.insert(name.clone(), entry(p)?).is_some() {
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

    /// An HF index (`model.safetensors.index.json`) given by its path: the index and the files its
    /// `weight_map` names, in the index's folder — what the same index behind a URL opens. A name
    /// that would leave the folder, or a file that is not there, is an error naming the index.
    pub fn hf_index(path: &Path) -> anyhow::Result<Self> {
        let name = file_name_of(path)?;
        let root = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let index = entry(path)?;
        let bytes = index.read_all_bytes()?;
        let named = Manifest::HfIndex
            .files(&bytes)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let mut files = BTreeMap::new();
        files.insert(name, index);
        for file in named {
            let p = root.join(&file);
            let e = entry(&p).with_context(|| {
                format!("{} names {file}, which cannot be opened", path.display())
            })?;
            if !std::fs::metadata(&p).is_ok_and(|m| m.is_file()) {
                anyhow::bail!("{} names {file}, which is not a file", path.display());
            }
            files.insert(file, e);
        }
        Ok(FileSource { root, files })
    }

    /// The folder the source's names are relative to.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The path of the file `name` and its size when the source was opened (`None`: not one of
    /// its files).
    pub fn path_of(&self, name: &str) -> Option<(&Path, u64)> {
        self.files.get(name).map(|e| (e.path.as_path(), e.size))
    }

    /// Every regular file in a folder and its sub-folders (three levels deep: a DeepSpeed
    /// universal checkpoint's run folder holds `<tag>/zero/<name>/fp32.pt`), hidden ones included
    /// (`.metadata`); symbolic links are followed (to files and to folders).
    pub fn dir(root: &Path) -> anyhow::Result<Self> {
        let mut files = BTreeMap::new();
        walk(root, "", 0, &mut files)?;
        Ok(FileSource {
            root: root.to_path_buf(),
            files,
        })
    }

    fn get(&self, name: &str) -> Result<&Entry, SourceError> {
        self.files.get(name).ok_or_else(|| SourceError::NotFound {
            name: self.root.join(name).display().to_string(),
        })
    }

    /// Fills `out` with the bytes of `name` from `offset`, with no intermediate buffer (tensor
    /// data read straight into the caller's). Errors name the file; a file that became shorter
    /// than when the source was opened is reported as changed.
    pub fn read_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        pause_for_tests();
        let e = self.get(name)?;
        checked_range(name, offset, out.len() as u64, e.size)?;
        e.read_at(offset, out)
    }
}

/// An anonymous, zero-filled mapping as long as a file, into which [`Source::read_ends`] reads
/// the ends asked for and which it lends out as the whole range: a large item's middle (tensor
/// bytes) is then neither read nor allocated nor zeroed (its pages are never touched), as with
/// the memory-mapped reads before, and the mapping is not the file's, so a file truncated under
/// it cannot fault.
///
/// Invariant (kept under `state`'s lock): bytes are written only once, only outside every range
/// lent out so far, and a range is lent only after the writes to it are done. A lent slice is
/// therefore never written while it is borrowed; an end that would have to be written inside a
/// lent range (overlapping items, which no writer makes) is served by a copy instead.
struct Ends {
    map: MmapRaw,
    state: std::sync::Mutex<EndsState>,
}

#[derive(Default)]
struct EndsState {
    /// Byte ranges read into the map (`start..end`); never written again.
    filled: Vec<(u64, u64)>,
    /// Byte ranges lent out as borrowed slices.
    lent: Vec<(u64, u64)>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl EndsState {
    /// The parts of `want` not read yet.
    fn gaps(&self, want: (u64, u64)) -> Vec<(u64, u64)> {
        let mut gaps = vec![want];
        for &f in &self.filled {
            gaps = gaps
                .into_iter()
                .flat_map(|g| {
                    if overlaps(g, f) {
                        [(g.0, f.0.max(g.0)), (f.1.min(g.1), g.1)]
                            .into_iter()
                            .filter(|p| p.0 < p.1)
                            .collect()
                    } else {
                        vec![g]
                    }
                })
                .collect();
        }
        gaps
    }
}

impl Ends {
    fn new(size: u64) -> Option<Ends> {
        let len = usize::try_from(size).ok().filter(|&n| n > 0)?;
        // Not counted against the commit limit: only the pages written are ever backed.
        let map = memmap2::MmapOptions::new()
            .len(len)
            .no_reserve_swap()
            .map_anon()
            .ok()?;
        Some(Ends {
            map: MmapRaw::from(map),
            state: std::sync::Mutex::default(),
        })
    }

    /// `start..end` of the file with `head..` and `..tail` read (both checked to lie inside it),
    /// or `None` when that would write inside a lent range.
    fn lend(
        &self,
        entry: &Entry,
        (start, end): (u64, u64),
        head: (u64, u64),
        tail: (u64, u64),
    ) -> Result<Option<&[u8]>, SourceError> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let gaps: Vec<(u64, u64)> = [head, tail]
            .into_iter()
            .flat_map(|w| state.gaps(w))
            .collect();
        if gaps
            .iter()
            .any(|&g| state.lent.iter().any(|&l| overlaps(g, l)))
        {
            return Ok(None);
        }
        for g in gaps {
            // In range: `end <= entry.size == map.len()`, checked by the caller.
            let (at, n) = (g.0 as usize, (g.1 - g.0) as usize);
            // SAFETY: `at + n <= map.len()`; the bytes lie outside every lent range (checked
            // above) and outside every filled one (`gaps`), so no slice handed out covers them
            // and no other thread writes them (the lock is held).
            #[allow(unsafe_code)]
            let dst = unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), n) };
            entry.read_at(g.0, dst)?;
            state.filled.push(g);
        }
        if !state.lent.contains(&(start, end)) {
            state.lent.push((start, end));
        }
        // SAFETY: in range (as above); from now on nothing writes inside `start..end` (it is
        // lent), and the writes into it happened before, under the lock this thread holds; the
        // map lives as long as `self`, which the slice borrows.
        #[allow(unsafe_code)]
        let bytes = unsafe {
            std::slice::from_raw_parts(
                self.map.as_ptr().add(start as usize),
                (end - start) as usize,
            )
        };
        Ok(Some(bytes))
    }
}

/// The environment variable of `pause_for_tests`.
const PAUSE_ENV: &str = "SHARDSCOPE_TEST_PAUSE_BEFORE_DATA";

/// For tests that change an input under a running process, deterministically: when
/// `SHARDSCOPE_TEST_PAUSE_BEFORE_DATA` names a folder, the first [`FileSource::read_into`] (the
/// first tensor data read, after the checkpoint was indexed) creates `paused` in it and waits until
/// `resume` exists there (at most ten minutes); every other reader thread waits with it. Unset
/// (always, outside tests): one check of a cached value.
fn pause_for_tests() {
    static FOLDER: OnceLock<Option<PathBuf>> = OnceLock::new();
    static ONCE: std::sync::Once = std::sync::Once::new();
    let Some(folder) = FOLDER.get_or_init(|| std::env::var_os(PAUSE_ENV).map(PathBuf::from)) else {
        return;
    };
    ONCE.call_once(|| {
        let _ = std::fs::write(folder.join("paused"), std::process::id().to_string());
        let deadline = std::time::Instant::now() + std::time::Duration::from_mins(10);
        while !folder.join("resume").exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    });
}

impl Entry {
    fn read_all_bytes(&self) -> Result<Vec<u8>, SourceError> {
        let mut buf = alloc(&self.path, self.size)?;
        self.read_at(0, &mut buf)?;
        Ok(buf)
    }
}

/// A zeroed buffer of `len` bytes, or an error naming the file when memory cannot hold it.
fn alloc(path: &Path, len: u64) -> Result<Vec<u8>, SourceError> {
    let too_big = || SourceError::Io {
        name: path.display().to_string(),
        message: format!("cannot hold {len} bytes of it in memory"),
    };
    let n = usize::try_from(len).map_err(|_| too_big())?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(n).map_err(|_| too_big())?;
    buf.resize(n, 0);
    Ok(buf)
}

/// What a directory entry is, links followed: `None` for anything else (sockets, dangling
/// links, links this process cannot follow), which the walk skips.
fn kind_of(entry: &std::fs::DirEntry, path: &Path) -> anyhow::Result<Option<bool>> {
    let kind = entry
        .file_type()
        .with_context(|| format!("cannot stat {}", path.display()))?;
    if kind.is_symlink() {
        return Ok(std::fs::metadata(path)
            .ok()
            .and_then(|m| (m.is_dir() || m.is_file()).then_some(m.is_dir())));
    }
    Ok((kind.is_dir() || kind.is_file()).then_some(kind.is_dir()))
}

fn walk(
    dir: &Path,
    prefix: &str,
    depth: usize,
    out: &mut BTreeMap<String, Entry>,
) -> anyhow::Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for dir_entry in entries {
        let dir_entry = dir_entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let Some(name) = dir_entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let path = dir_entry.path();
        let rel = format!("{prefix}{name}");
        match kind_of(&dir_entry, &path)? {
            Some(true) if depth < 3 && !name.starts_with('.') => {
                walk(&path, &format!("{rel}/"), depth + 1, out)?;
            }
            Some(false)
                if !Path::new(&name)
                    .extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("tmp")) =>
            {
                out.insert(rel, entry(&path)?);
            }
            _ => {}
        }
    }
    Ok(())
}

impl Source for FileSource {
    /// No: a whole read copies the whole file into memory, so readers fetch the parts they use.
    fn whole_reads_are_cheap(&self) -> bool {
        false
    }

    /// Yes: a positioned read of a local file.
    fn reads_are_local(&self) -> bool {
        true
    }

    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.get(name).map(|e| e.size)
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let e = self.get(name)?;
        checked_range(name, offset, len, e.size)?;
        let mut buf = alloc(&e.path, len)?;
        e.read_at(offset, &mut buf)?;
        Ok(Cow::Owned(buf))
    }

    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        self.read_into(name, offset, out)
    }

    /// Reads only both ends, into the file's `Ends` mapping (lent out, no copy); the middle is
    /// zero and never touched, so a large item's tensor bytes cost neither a read nor memory.
    fn read_ends(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        head_bytes: u64,
        tail_bytes: u64,
    ) -> Result<Cow<'_, [u8]>, SourceError> {
        if head_bytes.saturating_add(tail_bytes) >= len {
            return self.read_range(name, offset, len);
        }
        let e = self.get(name)?;
        let (start, end) = checked_range(name, offset, len, e.size)?;
        let (start, end) = (start as u64, end as u64);
        let head = (start, start + head_bytes);
        let tail = (end - tail_bytes, end);
        if let Some(ends) = e.ends.get_or_init(|| Ends::new(e.size))
            && let Some(bytes) = ends.lend(e, (start, end), head, tail)?
        {
            return Ok(Cow::Borrowed(bytes));
        }
        // No mapping, or overlapping items: a zeroed copy with both ends read.
        let mut buf = alloc(&e.path, len)?;
        let n = buf.len();
        e.read_at(head.0, &mut buf[..head_bytes as usize])?;
        e.read_at(tail.0, &mut buf[n - tail_bytes as usize..])?;
        Ok(Cow::Owned(buf))
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

    fn write(dir: &std::path::Path, name: &str, len: usize) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(
            &path,
            (0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
        )
        .unwrap();
        path
    }

    /// A file truncated after the source was opened: before its first read (caught when it is
    /// opened), and between two reads (caught by the short read). Never a signal; the error names
    /// the file and both sizes.
    #[test]
    fn a_file_truncated_under_the_source_is_an_error_naming_it() {
        use shardscope_core::source::Source;
        let tmp = tempfile::tempdir().unwrap();
        let a = write(tmp.path(), "a.distcp", 1 << 20);
        let b = write(tmp.path(), "b.distcp", 1 << 20);
        let source = FileSource::dir(tmp.path()).unwrap();
        // `a`: truncated before anything read it.
        std::fs::File::options()
            .write(true)
            .open(&a)
            .unwrap()
            .set_len(1000)
            .unwrap();
        let err = source
            .read_range("a.distcp", 0, 10)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&a.display().to_string())
                && err.contains("changed while it was read")
                && err.contains("it was 1048576 bytes, now 1000 bytes"),
            "{err}"
        );
        // `b`: read, then truncated; a range that still exists reads, one past the new end fails.
        assert_eq!(
            source.read_range("b.distcp", 0, 4).unwrap().as_ref(),
            &[0, 1, 2, 3]
        );
        std::fs::File::options()
            .write(true)
            .open(&b)
            .unwrap()
            .set_len(4096)
            .unwrap();
        // A range that still exists reads through the descriptor kept open; when the descriptor
        // was not kept (at most so many stay open per process, shared with the other tests that
        // run at the same time), the file is opened again and its new size is the error.
        match source.read_range("b.distcp", 4092, 4) {
            Ok(bytes) => assert_eq!(bytes.len(), 4),
            Err(e) => assert!(e.to_string().contains("now 4096 bytes"), "{e}"),
        }
        let mut out = vec![0u8; 8192];
        let err = source
            .read_into("b.distcp", 0, &mut out)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&b.display().to_string()) && err.contains("now 4096 bytes"),
            "{err}"
        );
        let err = source.read_all("b.distcp").unwrap_err().to_string();
        assert!(err.contains("changed while it was read"), "{err}");
        // Removed: the open descriptor still reads the old bytes (as `cp` would); a file removed
        // before it was opened is named.
        let c = write(tmp.path(), "c.distcp", 100);
        let source = FileSource::dir(tmp.path()).unwrap();
        std::fs::remove_file(&c).unwrap();
        let err = source.read_range("c.distcp", 0, 1).unwrap_err().to_string();
        assert!(err.contains(&c.display().to_string()), "{err}");
    }

    /// Links to files and to folders are followed (a Hugging Face cache snapshot), dangling ones
    /// skipped; names stay the folder's own, so nothing outside it can be named.
    #[test]
    fn symbolic_links_in_a_folder_are_followed() {
        use shardscope_core::source::Source;
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap();
        let blobs = tmp.path().join("blobs");
        let snap = tmp.path().join("snapshots/rev");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::create_dir_all(&snap).unwrap();
        write(&blobs, "1234", 10);
        std::fs::create_dir(blobs.join("sub")).unwrap();
        write(&blobs.join("sub"), "x.bin", 3);
        symlink("../../blobs/1234", snap.join("model.safetensors")).unwrap();
        symlink("../../blobs/sub", snap.join("sub")).unwrap();
        symlink("../../blobs/missing", snap.join("dangling")).unwrap();
        let source = FileSource::dir(&snap).unwrap();
        assert_eq!(source.names(), ["model.safetensors", "sub/x.bin"]);
        assert_eq!(source.size("model.safetensors").unwrap(), 10);
        assert_eq!(source.read_all("sub/x.bin").unwrap().as_ref(), &[0, 1, 2]);
        assert!(source.read_range("../../blobs/1234", 0, 1).is_err());
    }

    /// Both ends of large ranges, lent from the mapping (repeatedly, overlapping, and from a file
    /// truncated since): the ends are always the file's bytes, never a fault.
    #[test]
    fn read_ends_reads_both_ends_only_and_handles_overlaps() {
        use shardscope_core::source::Source;
        let tmp = tempfile::tempdir().unwrap();
        let len = 1usize << 20;
        let path = write(tmp.path(), "a.distcp", len);
        let bytes = std::fs::read(&path).unwrap();
        let source = FileSource::dir(tmp.path()).unwrap();
        let check = |offset: usize, n: usize, head: usize, tail: usize| {
            let got = source
                .read_ends(
                    "a.distcp",
                    offset as u64,
                    n as u64,
                    head as u64,
                    tail as u64,
                )
                .unwrap();
            assert_eq!(got.len(), n);
            assert_eq!(got[..head], bytes[offset..offset + head]);
            assert_eq!(got[n - tail..], bytes[offset + n - tail..offset + n]);
            matches!(got, std::borrow::Cow::Borrowed(_))
        };
        assert!(check(0, len, 100, 100));
        assert!(check(0, len, 100, 100));
        // Its head lies partly in the lent range above, not yet read: a copy.
        assert!(!check(50, 500_000, 100, 100));
        // Its ends already read: lent again; an end inside a lent range never read: a copy.
        assert!(check(0, len, 50, 20));
        assert!(!check(0, 1000, 10, 10));
        // A file truncated since it was listed.
        let b = write(tmp.path(), "b.distcp", len);
        let source = FileSource::dir(tmp.path()).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&b)
            .unwrap()
            .set_len(1000)
            .unwrap();
        let err = source
            .read_ends("b.distcp", 0, len as u64, 10, 10)
            .unwrap_err();
        assert!(
            err.to_string().contains("changed while it was read"),
            "{err}"
        );
    }

    /// More files than are kept open: every one still reads (opened per read beyond the limit),
    /// and a truncated one is still named.
    #[test]
    fn more_files_than_are_kept_open_all_read() {
        use shardscope_core::source::Source;
        let tmp = tempfile::tempdir().unwrap();
        let n = super::KEPT_OPEN + 50;
        for i in 0..n {
            write(tmp.path(), &format!("rank{i}.pt"), 64);
        }
        let source = FileSource::dir(tmp.path()).unwrap();
        for round in 0..2 {
            for i in 0..n {
                let got = source.read_range(&format!("rank{i}.pt"), 1, 3).unwrap();
                assert_eq!(got.as_ref(), &[1, 2, 3], "round {round}, file {i}");
            }
        }
        let last = tmp.path().join(format!("rank{}.pt", n - 1));
        std::fs::File::options()
            .write(true)
            .open(&last)
            .unwrap()
            .set_len(2)
            .unwrap();
        let err = source
            .read_range(&format!("rank{}.pt", n - 1), 1, 3)
            .unwrap_err();
        assert!(
            err.to_string().contains("changed while it was read"),
            "{err}"
        );
    }
}
