//! Atomic outputs: a destination appears complete or not at all.
//!
//! [`write_file`] writes into a temporary file in the destination's directory (same file system, so
//! the final rename is atomic), flushes and `fsync`s it, renames it over the destination and `fsync`s
//! the directory. [`write_dir`] does the same for a directory output such as a DCP checkpoint: the
//! closure fills a temporary directory next to the destination, every file in it is `fsync`ed, and the
//! directory is renamed into place. On any error (or panic) the temporary file or directory is removed
//! and an existing destination is left untouched.
//!
//! A process killed with SIGKILL cannot clean up: its hidden temporary output
//! (`.{name}.shardscope-tmp-{pid}-{n}`) stays next to the destination. The next write into the same
//! folder, whatever its destination, removes every such leftover whose process no longer runs (on
//! Linux, where `/proc` tells; elsewhere they are left alone), and says so on stderr.
//!
//! [`together`] keeps back every file [`write_file`] finishes inside it (written, not yet synced or
//! renamed) until all are written, then syncs and moves them into place: a set of outputs (a model file
//! and its `.optim.pt`) appears together or not at all, and the disk writes one back while the next is
//! written instead of the process waiting for each `fsync` in turn.
//!
//! The core writers (`shardscope_core::formats::write`) take any `Write`; pass them the `BufWriter`
//! given to the closure.

use std::cell::RefCell;
use std::fs::{self, File, OpenOptions};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A finished temporary file waiting for [`together`] to put it in place.
struct Staged {
    file: File,
    tmp: PathBuf,
    dest: PathBuf,
    guard: Cleanup,
}

thread_local! {
    /// The files [`together`] keeps back on this thread (`None` outside it).
    static STAGED: RefCell<Option<Vec<Staged>>> = const { RefCell::new(None) };
}

/// Runs `write`, keeping back every file that [`write_file`] finishes on this thread meanwhile;
/// when `write` succeeds, syncs them all, then renames each into place, so that they appear
/// together. When `write` fails (or a sync does), none appears and their temporary files go.
/// Nested calls join the outer one.
pub fn together<T>(write: impl FnOnce() -> Result<T>) -> Result<T> {
    let outer = STAGED.with(|s| {
        let mut s = s.borrow_mut();
        let outer = s.is_some();
        if !outer {
            *s = Some(Vec::new());
        }
        outer
    });
    if outer {
        return write();
    }
    let result = write();
    let staged = STAGED.with(|s| s.borrow_mut().take()).unwrap_or_default();
    let value = result?;
    for s in &staged {
        s.file
            .sync_all()
            .with_context(|| format!("cannot sync {}", s.tmp.display()))?;
    }
    let mut dirs = Vec::new();
    for s in staged {
        drop(s.file);
        fs::rename(&s.tmp, &s.dest).with_context(|| {
            format!(
                "cannot move the finished output into place: {}",
                s.dest.display()
            )
        })?;
        s.guard.disarm();
        let dir = parent_dir(&s.dest);
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    for dir in dirs {
        sync_dir(&dir);
    }
    Ok(value)
}

/// Writes `dest` atomically: `write` fills a buffered temporary file next to it.
pub fn write_file<T>(
    dest: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<T>,
) -> Result<T> {
    write_file_inner(dest, true, write)
}

/// [`write_file`] into a folder that other processes, maybe on other machines, write at the same
/// time (`convert --part`): leftovers are not swept, since a process id says nothing about a
/// process of another machine.
pub fn write_file_shared<T>(
    dest: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<T>,
) -> Result<T> {
    write_file_inner(dest, false, write)
}

fn write_file_inner<T>(
    dest: &Path,
    sweep: bool,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<T>,
) -> Result<T> {
    let tmp = temp_path(dest, sweep)?;
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .with_context(|| format!("cannot create temporary file {}", tmp.display()))?;
    let guard = Cleanup::file(tmp.clone());
    let mut out = BufWriter::new(file);
    let value = write(&mut out)?;
    let file = out
        .into_inner()
        .map_err(std::io::IntoInnerError::into_error)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    // Inside `together` (and only for the sweeping, single-process writes): kept back.
    let staged = Staged {
        file,
        tmp,
        dest: dest.to_path_buf(),
        guard,
    };
    let staged = if sweep {
        STAGED.with(|s| match s.borrow_mut().as_mut() {
            Some(list) => {
                list.push(staged);
                None
            }
            None => Some(staged),
        })
    } else {
        Some(staged)
    };
    let Some(Staged {
        file, tmp, guard, ..
    }) = staged
    else {
        return Ok(value);
    };
    file.sync_all()
        .with_context(|| format!("cannot sync {}", tmp.display()))?;
    drop(file);
    fs::rename(&tmp, dest).with_context(|| {
        format!(
            "cannot move the finished output into place: {}",
            dest.display()
        )
    })?;
    guard.disarm();
    sync_dir(&parent_dir(dest));
    Ok(value)
}

/// Creates the directory `dest` atomically: `write` fills a temporary directory next to it (the path
/// it is given). `dest` must not exist, or be an empty directory.
pub fn write_dir<T>(dest: &Path, write: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    let replace_empty = match fs::read_dir(dest) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                bail!(
                    "output directory already exists and is not empty: {}",
                    dest.display()
                );
            }
            true
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) if dest.exists() => {
            return Err(e).with_context(|| {
                format!(
                    "output path exists and is not a readable directory: {}",
                    dest.display()
                )
            });
        }
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", dest.display())),
    };
    let tmp = temp_path(dest, true)?;
    fs::create_dir(&tmp)
        .with_context(|| format!("cannot create temporary directory {}", tmp.display()))?;
    let guard = Cleanup::dir(tmp.clone());
    let value = write(&tmp)?;
    sync_tree(&tmp)?;
    if replace_empty {
        fs::remove_dir(dest)
            .with_context(|| format!("cannot replace empty directory {}", dest.display()))?;
    }
    fs::rename(&tmp, dest).with_context(|| {
        format!(
            "cannot move the finished directory into place: {}",
            dest.display()
        )
    })?;
    guard.disarm();
    sync_dir(&parent_dir(dest));
    Ok(value)
}

fn parent_dir(dest: &Path) -> PathBuf {
    match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `.{name}.shardscope-tmp-{pid}-{n}` in the destination's directory (hidden, unique per process).
fn temp_path(dest: &Path, sweep: bool) -> Result<PathBuf> {
    let name = dest
        .file_name()
        .with_context(|| format!("output path has no file name: {}", dest.display()))?;
    let dir = parent_dir(dest);
    if !dir.is_dir() {
        bail!(
            "cannot write {}: the folder {} does not exist (create it first)",
            dest.display(),
            dir.display()
        );
    }
    if sweep {
        remove_stale_temps(dest);
    }
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    Ok(parent_dir(dest).join(format!(
        ".{}.shardscope-tmp-{}-{n}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Whether `entry` is a temporary name `.{name}.shardscope-tmp-{pid}-{n}` for the output `name`.
pub fn is_temp_of(entry: &str, name: &str) -> bool {
    temp_owner(entry).is_some()
        && entry
            .strip_prefix('.')
            .and_then(|e| e.rsplit_once(".shardscope-tmp-"))
            .is_some_and(|(n, _)| n == name)
}

/// The pid in a temporary name `.{name}.shardscope-tmp-{pid}-{n}` (any non-empty `name`).
fn temp_owner(entry: &str) -> Option<u32> {
    let (name, rest) = entry.strip_prefix('.')?.rsplit_once(".shardscope-tmp-")?;
    if name.is_empty() {
        return None;
    }
    let (pid, n) = rest.split_once('-')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the temporary outputs that processes which no longer run (killed runs) left in `dest`'s
/// folder, for any destination. Best effort: only where `/proc` shows which processes run;
/// anything unclear is kept.
fn remove_stale_temps(dest: &Path) {
    let proc_root = Path::new("/proc");
    if !proc_root.join("self").exists() {
        return;
    }
    let dir = parent_dir(dest);
    let Ok(entries) = fs::read_dir(&dir) else {
        return;
    };
    for entry in entries.flatten() {
        let entry_name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = temp_owner(&entry_name) else {
            continue;
        };
        if pid == std::process::id() || proc_root.join(pid.to_string()).exists() {
            continue;
        }
        let path = entry.path();
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            Ok(_) => fs::remove_file(&path),
            Err(e) => Err(e),
        };
        if removed.is_ok() {
            eprintln!(
                "removed the leftover of an interrupted run (process {pid}): {}",
                path.display()
            );
        }
    }
}

/// `fsync` every regular file below `dir`, then the directories themselves.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .with_context(|| format!("cannot stat {}", path.display()))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("cannot sync {}", path.display()))?;
        }
    }
    sync_dir(dir);
    Ok(())
}

/// Best effort: some file systems do not allow opening or syncing a directory.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Removes the temporary output unless disarmed (also on panic).
struct Cleanup {
    path: Option<PathBuf>,
    is_dir: bool,
}

impl Cleanup {
    fn file(path: PathBuf) -> Self {
        Self {
            path: Some(path),
            is_dir: false,
        }
    }

    fn dir(path: PathBuf) -> Self {
        Self {
            path: Some(path),
            is_dir: true,
        }
    }

    fn disarm(mut self) {
        self.path = None;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = if self.is_dir {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardscope_core::DType;
    use shardscope_core::formats::write::pickle::{PyValue, StorageSpec, TensorPickle};
    use shardscope_core::formats::write::torch_save::TorchSaveWriter;
    use std::io::Write;

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn together_puts_every_file_in_place_at_the_end_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            dir.path().join("model.safetensors"),
            dir.path().join("model.optim.pt"),
        );
        together(|| {
            write_file(&a, |out| Ok(out.write_all(b"model")?))?;
            // Kept back: not at its destination yet, only a hidden temporary file.
            assert!(!a.exists());
            assert_eq!(names_in(dir.path()).len(), 1);
            // A nested call joins the outer one.
            together(|| write_file(&b, |out| Ok(out.write_all(b"optim")?)))?;
            assert!(!b.exists());
            Ok(())
        })
        .unwrap();
        assert_eq!(fs::read(&a).unwrap(), b"model");
        assert_eq!(fs::read(&b).unwrap(), b"optim");
        assert_eq!(
            names_in(dir.path()),
            ["model.optim.pt", "model.safetensors"]
        );

        // The second file fails: neither appears, and no temporary file is left.
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            dir.path().join("m.safetensors"),
            dir.path().join("m.optim.pt"),
        );
        let err = together(|| {
            write_file(&a, |out| Ok(out.write_all(b"model")?))?;
            write_file(&b, |out| -> Result<()> {
                out.write_all(b"half")?;
                bail!("disk full")
            })
        })
        .unwrap_err();
        assert!(err.to_string().contains("disk full"));
        assert!(
            names_in(dir.path()).is_empty(),
            "{:?}",
            names_in(dir.path())
        );
        // Outside `together`, files go in place at once again.
        write_file(&a, |out| Ok(out.write_all(b"x")?)).unwrap();
        assert!(a.exists());
    }

    /// A `Write` that accepts `left` bytes, then fails: a disk filling up mid-write.
    struct FailAfter<'a, W: Write> {
        inner: &'a mut W,
        left: usize,
    }

    impl<W: Write> Write for FailAfter<'_, W> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.left == 0 {
                return Err(std::io::Error::other("disk full (simulated)"));
            }
            let n = buf.len().min(self.left);
            self.left -= n;
            self.inner.write(&buf[..n])
        }

        fn flush(&mut self) -> std::io::Result<()> {
            self.inner.flush()
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Streams a 1 MiB tensor through the torch.save writer into `out`.
    fn save_big_tensor(out: impl Write) -> Result<()> {
        let numel = 256 * 1024;
        let root = PyValue::Tensor(TensorPickle::contiguous(0, DType::Float32, &[numel]));
        let spec = StorageSpec {
            dtype: DType::Float32,
            numel,
        };
        let mut w = TorchSaveWriter::new(out, "archive", &root, vec![spec])?;
        w.write_storage(&vec![0u8; numel as usize * 4])?;
        w.finish()?;
        Ok(())
    }

    #[test]
    fn complete_file_appears_and_no_temp_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.pt");
        write_file(&dest, |w| save_big_tensor(w)).unwrap();
        assert!(fs::metadata(&dest).unwrap().len() > 1024 * 1024);
        assert_eq!(names(dir.path()), ["out.pt"]);
    }

    #[test]
    fn a_missing_folder_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("not-there");
        for err in [
            write_file(&missing.join("out.pt"), |_| Ok(())).unwrap_err(),
            write_dir(&missing.join("shards"), |_| Ok(())).unwrap_err(),
        ] {
            let msg = format!("{err:#}");
            assert!(
                msg.contains("does not exist") && msg.contains(&missing.display().to_string()),
                "{msg}"
            );
        }
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn failing_write_leaves_no_partial_file_and_keeps_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.pt");
        let err = write_file(&dest, |w| {
            save_big_tensor(FailAfter {
                inner: w,
                left: 100_000,
            })
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("disk full"), "{err:#}");
        assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));

        fs::write(&dest, b"previous").unwrap();
        let _ = write_file(&dest, |w| {
            save_big_tensor(FailAfter {
                inner: w,
                left: 100_000,
            })
        })
        .unwrap_err();
        assert_eq!(fs::read(&dest).unwrap(), b"previous");
        assert_eq!(names(dir.path()), ["out.pt"]);

        // A panic inside the closure also cleans up.
        let result = std::panic::catch_unwind(|| {
            write_file(&dir.path().join("p.pt"), |w| -> Result<()> {
                w.write_all(b"abc")?;
                panic!("boom");
            })
        });
        assert!(result.is_err());
        assert_eq!(names(dir.path()), ["out.pt"]);
    }

    #[test]
    fn leftovers_of_dead_processes_are_removed_and_live_ones_kept() {
        assert_eq!(temp_owner(".out.pt.shardscope-tmp-123-0"), Some(123));
        assert_eq!(temp_owner(".d1.safetensors.shardscope-tmp-77-12"), Some(77));
        assert_eq!(temp_owner(".out.pt.shardscope-tmp-123-"), None);
        assert_eq!(temp_owner(".out.pt.shardscope-tmp-x-1"), None);
        assert_eq!(temp_owner("..shardscope-tmp-123-0"), None);
        assert_eq!(temp_owner("out.pt.shardscope-tmp-123-0"), None);
        assert_eq!(temp_owner("out.pt"), None);
        if !Path::new("/proc/self").exists() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // A process that has exited: its pid is not in /proc any more (until reused, when the
        // leftover is simply kept).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let live = std::process::id();
        let dead_file = format!(".out.pt.shardscope-tmp-{dead}-0");
        let dead_dir = format!(".ckpt.shardscope-tmp-{dead}-3");
        // Another destination's leftover in the same folder goes too (a killed conversion to
        // another name); a file that only looks similar stays.
        let other_dest = format!(".other.shardscope-tmp-{dead}-0");
        let unrelated = format!("other.shardscope-tmp-{dead}-0");
        fs::write(dir.path().join(&other_dest), b"x").unwrap();
        fs::write(dir.path().join(&dead_file), b"partial").unwrap();
        fs::create_dir(dir.path().join(&dead_dir)).unwrap();
        fs::write(dir.path().join(&dead_dir).join("__0_0.distcp"), b"x").unwrap();
        fs::write(dir.path().join(&unrelated), b"x").unwrap();
        let live_file = format!(".out.pt.shardscope-tmp-{live}-99");
        fs::write(dir.path().join(&live_file), b"in use").unwrap();

        write_file(&dir.path().join("out.pt"), |w| Ok(w.write_all(b"new")?)).unwrap();
        write_dir(&dir.path().join("ckpt"), |tmp| {
            Ok(fs::write(tmp.join("f"), b"x")?)
        })
        .unwrap();
        let mut expected = vec![live_file, unrelated, "ckpt".to_owned(), "out.pt".to_owned()];
        expected.sort();
        assert_eq!(names(dir.path()), expected);
    }

    #[test]
    fn directory_output_appears_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("ckpt");
        let err = write_dir(&dest, |tmp| -> Result<()> {
            fs::write(tmp.join("__0_0.distcp"), b"data")?;
            bail!("rank 1 failed")
        })
        .unwrap_err();
        assert!(err.to_string().contains("rank 1 failed"));
        assert!(names(dir.path()).is_empty());

        write_dir(&dest, |tmp| {
            fs::write(tmp.join("__0_0.distcp"), b"data")?;
            fs::write(tmp.join(".metadata"), b"meta")?;
            Ok(())
        })
        .unwrap();
        assert_eq!(names(&dest), [".metadata", "__0_0.distcp"]);
        assert_eq!(names(dir.path()), ["ckpt"]);

        // A non-empty destination is refused and kept; an empty one is replaced.
        let err = write_dir(&dest, |_| Ok(())).unwrap_err();
        assert!(err.to_string().contains("not empty"), "{err}");
        assert_eq!(names(&dest), [".metadata", "__0_0.distcp"]);
        let empty = dir.path().join("empty");
        fs::create_dir(&empty).unwrap();
        write_dir(&empty, |tmp| Ok(fs::write(tmp.join("f"), b"x")?)).unwrap();
        assert_eq!(names(&empty), ["f"]);
    }
}
