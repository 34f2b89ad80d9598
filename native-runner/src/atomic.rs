//! Atomic outputs: a destination appears complete or not at all, and never in place of a file
//! that appeared meanwhile.
//!
//! [`write_file`] writes into a temporary file in the destination's directory (same file system, so
//! the final rename is atomic), flushes and `fsync`s it, moves it to the destination and `fsync`s
//! the directory. [`write_dir`] does the same for a directory output such as a DCP checkpoint: the
//! closure fills a temporary directory next to the destination, every file in it is `fsync`ed, and the
//! directory is moved into place. On any error (or panic) the temporary file or directory is removed
//! and an existing destination is left untouched.
//!
//! The move never replaces anything: `renameat2(RENAME_NOREPLACE)` on Linux; where the file system
//! does not support it, a hard link to the destination (which fails if it exists) and removing
//! the temporary name; where neither is supported, a check that the destination is still free
//! before a plain rename (the only case in which a writer racing in between could be replaced).
//! Of two processes writing the same destination at once, exactly one wins; the other fails with
//! "… appeared while this run was writing it; not replaced" and removes its temporary output.
//! [`write_file_replacing`] (and [`write_file_shared`]) replace an existing file on purpose.
//!
//! A destination that is a symbolic link (to a file, to a folder, or dangling) is refused
//! ([`refuse_link`]): nothing is written through a link, and no link is replaced.
//!
//! Temporary names are `.{name}.shardscope-tmp-{pid}-{random}`, created exclusively (`O_EXCL`)
//! with another random part when the name is taken: a name planted in advance cannot make a
//! write fail. A process killed with SIGKILL cannot clean up: its hidden temporary output stays
//! next to the destination. The next write into the same folder, whatever its destination,
//! removes every such leftover whose process no longer runs (on Linux, where `/proc` tells;
//! elsewhere they are left alone), and says so on stderr.
//!
//! [`together`] keeps back every file [`write_file`] finishes inside it (written, not yet synced or
//! renamed) until all are written, then syncs and moves them into place: a set of outputs (a model file
//! and its `.optim.pt`) appears together or not at all, and the disk writes one back while the next is
//! written instead of the process waiting for each `fsync` in turn.
//!
//! I/O errors name the path; running out of space names the destination. The core writers
//! (`shardscope_core::formats::write`) take any `Write`; pass them the `BufWriter` given to the
//! closure.

use std::cell::RefCell;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::writeback::Paced;

/// A finished temporary file waiting for [`together`] to put it in place.
struct Staged {
    file: File,
    tmp: PathBuf,
    dest: PathBuf,
    replace: bool,
    guard: Cleanup,
}

thread_local! {
    /// The files [`together`] keeps back on this thread (`None` outside it).
    static STAGED: RefCell<Option<Vec<Staged>>> = const { RefCell::new(None) };
}

/// Runs `write`, keeping back every file that [`write_file`] finishes on this thread meanwhile;
/// when `write` succeeds, syncs them all, then moves each into place, so that they appear
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
            .with_context(|| {
                format!(
                    "cannot write {} (syncing {})",
                    s.dest.display(),
                    s.tmp.display()
                )
            })
            .map_err(|e| name_full_disk(e, &s.dest))?;
    }
    let mut dirs = Vec::new();
    for s in staged {
        drop(s.file);
        move_into_place(&s.tmp, &s.dest, s.replace)?;
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

/// Writes `dest` atomically: `write` fills a buffered temporary file next to it. Fails, leaving
/// nothing, when `dest` exists when the file is ready (it may have appeared meanwhile: another
/// process writing the same path), or is a symbolic link.
pub fn write_file<T>(
    dest: &Path,
    write: impl FnOnce(&mut BufWriter<Paced>) -> Result<T>,
) -> Result<T> {
    write_file_inner(dest, true, false, write)
}

/// [`write_file`] that replaces an existing `dest` (outputs that are rewritten on purpose). A
/// symbolic link is still refused.
pub fn write_file_replacing<T>(
    dest: &Path,
    write: impl FnOnce(&mut BufWriter<Paced>) -> Result<T>,
) -> Result<T> {
    write_file_inner(dest, true, true, write)
}

/// [`write_file_replacing`] into a folder that other processes, maybe on other machines, write at
/// the same time (`convert --part`, which decides itself which files may exist): leftovers are not
/// swept, since a process id says nothing about a process of another machine.
pub fn write_file_shared<T>(
    dest: &Path,
    write: impl FnOnce(&mut BufWriter<Paced>) -> Result<T>,
) -> Result<T> {
    write_file_inner(dest, false, true, write)
}

fn write_file_inner<T>(
    dest: &Path,
    sweep: bool,
    replace: bool,
    write: impl FnOnce(&mut BufWriter<Paced>) -> Result<T>,
) -> Result<T> {
    refuse_link(dest)?;
    let (tmp, file) = create_temp(dest, sweep, |p| {
        OpenOptions::new().write(true).create_new(true).open(p)
    })?;
    let guard = Cleanup::file(tmp.clone());
    // Its bytes go to disk while the rest is written (`writeback`), not all at the `fsync`.
    let mut out = BufWriter::new(Paced::new(file));
    let value = write(&mut out).map_err(|e| name_full_disk(e, dest))?;
    let file = out
        .into_inner()
        .map(Paced::into_file)
        .map_err(std::io::IntoInnerError::into_error)
        .with_context(|| {
            format!(
                "cannot write {} (its temporary file {})",
                dest.display(),
                tmp.display()
            )
        })
        .map_err(|e| name_full_disk(e, dest))?;
    // Inside `together` (and only for the sweeping, single-process writes): kept back.
    let staged = Staged {
        file,
        tmp,
        dest: dest.to_path_buf(),
        replace,
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
        .with_context(|| {
            format!(
                "cannot write {} (syncing {})",
                dest.display(),
                tmp.display()
            )
        })
        .map_err(|e| name_full_disk(e, dest))?;
    drop(file);
    move_into_place(&tmp, dest, replace)?;
    guard.disarm();
    sync_dir(&parent_dir(dest));
    Ok(value)
}

/// Creates the directory `dest` atomically: `write` fills a temporary directory next to it (the path
/// it is given). `dest` must not exist, or be an empty directory; a directory that appears
/// meanwhile is never replaced.
pub fn write_dir<T>(dest: &Path, write: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    refuse_link(dest)?;
    let replace_empty = match fs::read_dir(dest) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                bail!(
                    "output directory already exists and is not empty: {}\nhint: shardscope never overwrites; remove it or choose another path",
                    dest.display()
                );
            }
            true
        }
        Err(e) if e.kind() == ErrorKind::NotFound => false,
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
    let (tmp, ()) = create_temp(dest, true, |p| fs::create_dir(p))?;
    let guard = Cleanup::dir(tmp.clone());
    let value = write(&tmp).map_err(|e| name_full_disk(e, dest))?;
    sync_tree(&tmp).map_err(|e| name_full_disk(e, dest))?;
    if replace_empty {
        match fs::remove_dir(dest) {
            Ok(()) => {}
            // Gone already, or filled meanwhile: the move below refuses what is there.
            Err(e)
                if e.kind() == ErrorKind::NotFound || e.kind() == ErrorKind::DirectoryNotEmpty => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot replace empty directory {}", dest.display()));
            }
        }
    }
    move_into_place(&tmp, dest, false)?;
    guard.disarm();
    sync_dir(&parent_dir(dest));
    Ok(value)
}

/// Refuses a destination that is a symbolic link (to a file, to a folder, or dangling): writing
/// through it would put the output somewhere the command line does not say, and replacing it
/// would lose the link.
pub fn refuse_link(dest: &Path) -> Result<()> {
    match fs::symlink_metadata(dest) {
        Ok(meta) if meta.file_type().is_symlink() => {
            let target = fs::read_link(dest)
                .map(|t| format!(" (to {})", t.display()))
                .unwrap_or_default();
            bail!(
                "{} is a symbolic link{target}; shardscope neither writes through a link nor replaces it\nhint: give the path it points to, or remove the link",
                dest.display()
            )
        }
        _ => Ok(()),
    }
}

/// Moves the finished temporary `tmp` to `dest`; unless `replace`, never over something there.
fn move_into_place(tmp: &Path, dest: &Path, replace: bool) -> Result<()> {
    let moved = if replace {
        fs::rename(tmp, dest)
    } else {
        rename_noreplace(tmp, dest)
    };
    match moved {
        Ok(()) => Ok(()),
        Err(e)
            if e.kind() == ErrorKind::AlreadyExists || e.kind() == ErrorKind::DirectoryNotEmpty =>
        {
            bail!(
                "{} appeared while this run was writing it; not replaced (this run's output is discarded)\nhint: another process may be writing the same path",
                dest.display()
            )
        }
        Err(e) => Err(e).with_context(|| {
            format!(
                "cannot move the finished output into place: {} (from {})",
                dest.display(),
                tmp.display()
            )
        }),
    }
}

/// `rename(from, to)` that fails with `AlreadyExists` when `to` exists, atomically where the
/// system allows (see the module documentation).
fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        use rustix::io::Errno;
        match renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE) {
            Ok(()) => return Ok(()),
            // Not supported by this kernel or file system: the fallbacks below.
            Err(e) if e == Errno::INVAL || e == Errno::NOSYS || e == Errno::OPNOTSUPP => {}
            Err(e) => return Err(e.into()),
        }
    }
    if fs::symlink_metadata(from).is_ok_and(|m| m.is_file()) {
        match fs::hard_link(from, to) {
            Ok(()) => return fs::remove_file(from),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => return Err(e),
            Err(_) => {} // no hard links here (FAT, some network file systems)
        }
    }
    if fs::symlink_metadata(to).is_ok() {
        return Err(ErrorKind::AlreadyExists.into());
    }
    fs::rename(from, to)
}

/// Adds the destination to an error caused by a full disk (or quota), which the system reports
/// without a path.
fn name_full_disk(err: anyhow::Error, dest: &Path) -> anyhow::Error {
    let full = err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|e| {
            e.kind() == ErrorKind::StorageFull || e.kind() == ErrorKind::QuotaExceeded
        })
    });
    if full {
        let dir = parent_dir(dest);
        err.context(format!(
            "cannot write {}: no space left in {}",
            dest.display(),
            dir.display()
        ))
    } else {
        err
    }
}

fn parent_dir(dest: &Path) -> PathBuf {
    match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Creates (with `create`, which must fail with `AlreadyExists` when the name is taken) a hidden
/// temporary `.{name}.shardscope-tmp-{pid}-{random}` in the destination's directory, trying
/// other random parts while names are taken.
fn create_temp<R>(
    dest: &Path,
    sweep: bool,
    create: impl FnMut(&Path) -> std::io::Result<R>,
) -> Result<(PathBuf, R)> {
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
    let prefix = format!(
        ".{}.shardscope-tmp-{}-",
        name.to_string_lossy(),
        std::process::id()
    );
    let made = tempfile::Builder::new()
        .prefix(&prefix)
        .rand_bytes(TEMP_RANDOM_CHARS)
        .disable_cleanup(true)
        .make_in(&dir, create)
        .and_then(|t| t.keep().map_err(|e| e.error))
        .with_context(|| {
            format!(
                "cannot create a temporary output next to {} (in {})",
                dest.display(),
                dir.display()
            )
        })
        .map_err(|e| name_full_disk(e, dest))?;
    Ok((made.1, made.0))
}

/// Random characters (`[A-Za-z0-9]`) in a temporary name.
const TEMP_RANDOM_CHARS: usize = 12;

/// Whether `entry` is a temporary name `.{name}.shardscope-tmp-{pid}-{random}` for the output
/// `name`.
pub fn is_temp_of(entry: &str, name: &str) -> bool {
    temp_owner(entry).is_some()
        && entry
            .strip_prefix('.')
            .and_then(|e| e.rsplit_once(".shardscope-tmp-"))
            .is_some_and(|(n, _)| n == name)
}

/// The pid in a temporary name `.{name}.shardscope-tmp-{pid}-{random}` (any non-empty `name`;
/// `random` is letters and digits, as earlier versions' counters are).
fn temp_owner(entry: &str) -> Option<u32> {
    let (name, rest) = entry.strip_prefix('.')?.rsplit_once(".shardscope-tmp-")?;
    if name.is_empty() {
        return None;
    }
    let (pid, n) = rest.split_once('-')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_alphanumeric()) {
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

    #[test]
    fn a_destination_that_appears_meanwhile_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.safetensors");
        let err = write_file(&dest, |w| {
            fs::write(&dest, b"the other writer's")?;
            Ok(w.write_all(b"mine")?)
        })
        .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains(&dest.display().to_string())
                && msg.contains("appeared while this run was writing it; not replaced"),
            "{msg}"
        );
        assert_eq!(fs::read(&dest).unwrap(), b"the other writer's");
        assert_eq!(names(dir.path()), ["out.safetensors"]);
        // Inside `together` too.
        let err = together(|| {
            write_file(&dest, |w| Ok(w.write_all(b"mine")?))?;
            Ok(())
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("appeared"), "{err:#}");
        assert_eq!(names(dir.path()), ["out.safetensors"]);
        // Replacing on purpose.
        write_file_replacing(&dest, |w| Ok(w.write_all(b"new")?)).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"new");

        let ckpt = dir.path().join("ckpt");
        let err = write_dir(&ckpt, |tmp| {
            fs::create_dir(&ckpt)?;
            fs::write(ckpt.join("theirs"), b"x")?;
            Ok(fs::write(tmp.join("mine"), b"y")?)
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("appeared"), "{err:#}");
        assert_eq!(names(&ckpt), ["theirs"]);
        assert_eq!(names(dir.path()), ["ckpt", "out.safetensors"]);
    }

    #[test]
    fn rename_noreplace_moves_files_and_folders_but_never_over_anything() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        fs::write(&a, b"a").unwrap();
        rename_noreplace(&a, &b).unwrap();
        assert_eq!(names(dir.path()), ["b"]);
        fs::write(&a, b"a").unwrap();
        let err = rename_noreplace(&a, &b).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&b).unwrap(), b"a");
        let (d, e) = (dir.path().join("d"), dir.path().join("e"));
        fs::create_dir(&d).unwrap();
        fs::create_dir(&e).unwrap();
        assert_eq!(
            rename_noreplace(&d, &e).unwrap_err().kind(),
            ErrorKind::AlreadyExists
        );
        fs::remove_dir(&e).unwrap();
        rename_noreplace(&d, &e).unwrap();
        assert_eq!(names(dir.path()), ["a", "b", "e"]);
    }

    #[test]
    fn a_full_disk_names_the_destination_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.pt");
        let enospc = || std::io::Error::from_raw_os_error(28);
        let err = write_file(&dest, |w| -> Result<()> {
            save_big_tensor(FailAfter { inner: w, left: 0 }).map_err(|_| enospc())?;
            Ok(())
        })
        .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains(&dest.display().to_string()) && msg.contains("no space left"),
            "{msg}"
        );
        let err = write_dir(&dir.path().join("ckpt"), |_| -> Result<()> {
            Err(enospc().into())
        })
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("ckpt: no space left"),
            "{err:#}"
        );
        // Other errors are left as they are.
        let err = write_file(&dest, |_| -> Result<()> { bail!("bad input") }).unwrap_err();
        assert_eq!(format!("{err:#}"), "bad input");
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn links_are_refused_and_temporary_names_are_random() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("missing", &link).unwrap();
        for err in [
            write_file(&link, |_| Ok(())).unwrap_err(),
            write_file_replacing(&link, |_| Ok(())).unwrap_err(),
            write_dir(&link, |_| Ok(())).unwrap_err(),
        ] {
            assert!(
                format!("{err:#}").contains("is a symbolic link (to missing)"),
                "{err:#}"
            );
        }
        assert_eq!(names(dir.path()), ["link"]);
        let dest = dir.path().join("out.pt");
        let (a, _) = create_temp(&dest, false, |p| fs::File::create_new(p)).unwrap();
        let (b, _) = create_temp(&dest, false, |p| fs::File::create_new(p)).unwrap();
        let a = a.file_name().unwrap().to_str().unwrap().to_owned();
        let b = b.file_name().unwrap().to_str().unwrap().to_owned();
        assert_ne!(a, b);
        for n in [&a, &b] {
            assert_eq!(temp_owner(n), Some(std::process::id()), "{n}");
            assert!(is_temp_of(n, "out.pt"), "{n}");
            let random = n.rsplit_once('-').unwrap().1;
            assert_eq!(random.len(), TEMP_RANDOM_CHARS, "{n}");
        }
        assert_eq!(temp_owner(".out.pt.shardscope-tmp-123-aZ09"), Some(123));
        assert_eq!(temp_owner(".out.pt.shardscope-tmp-123-a.b"), None);
    }
}
