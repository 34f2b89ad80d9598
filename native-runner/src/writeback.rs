//! Output files whose bytes the kernel starts writing to disk while the rest is still being
//! produced, instead of all of them at the final `fsync`.
//!
//! Every output is made durable before it is moved into place (`atomic`). Written plainly, its
//! bytes sit in the page cache until that `fsync`, which then waits for all of them: on a
//! conversion that reads from the network (or decompresses, or casts) the disk idles while the
//! input is read and the network idles while the disk writes. [`Paced`] asks the kernel, every
//! [`STEP_BYTES`] written, to start writing back what was written since the last request
//! (`posix_fadvise(POSIX_FADV_DONTNEED)` on the dirty range, which on Linux starts an
//! asynchronous writeback of it and waits for nothing); the final `fsync` then finds most of
//! the file on disk already. Nothing about the bytes or the order of writes changes.
//! `bench/writeback.py` measures the write pattern alone ("writeback started every 32 MiB"); on
//! the 1 GiB DCP of `bench/remote_convert.py`, a local `convert` took 0.64 s instead of 0.95 s and
//! a remote one 2.47 s instead of 2.76 s (BENCHMARKS.md, "Outputs written back while written").

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};

/// Written bytes that accumulate before their writeback is started.
pub const STEP_BYTES: u64 = 32 << 20;

/// A [`File`] written front to back (seeks allowed) that starts the writeback of its written
/// bytes every `step` bytes.
#[derive(Debug)]
pub struct Paced {
    file: File,
    step: u64,
    /// The write position.
    pos: u64,
    /// Where the range not yet handed to writeback starts.
    started: u64,
    /// Writeback requests made.
    #[cfg(test)]
    requests: u64,
}

impl Paced {
    pub fn new(file: File) -> Self {
        Self::with_step(file, STEP_BYTES)
    }

    pub fn with_step(file: File, step: u64) -> Self {
        Paced {
            file,
            step: step.max(1),
            pos: 0,
            started: 0,
            #[cfg(test)]
            requests: 0,
        }
    }

    /// The file, every byte written to it (nothing is buffered here).
    pub fn into_file(self) -> File {
        self.file
    }

    /// How many writeback requests were made.
    #[cfg(test)]
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Starts the writeback of `started..pos` once it holds `step` bytes.
    fn maybe_start(&mut self) {
        if self.pos.saturating_sub(self.started) >= self.step {
            self.start(self.started, self.pos - self.started);
            self.started = self.pos;
        }
    }

    /// A hint only: a file system that does not take it (or another OS) loses nothing but the
    /// overlap, so its error is not the write's.
    fn start(&mut self, offset: u64, len: u64) {
        #[cfg(test)]
        {
            self.requests += 1;
        }
        #[cfg(target_os = "linux")]
        if let Some(len) = std::num::NonZeroU64::new(len) {
            let _ =
                rustix::fs::fadvise(&self.file, offset, Some(len), rustix::fs::Advice::DontNeed);
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (offset, len);
    }
}

impl Write for Paced {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.pos = self.pos.saturating_add(n as u64);
        self.maybe_start();
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Seek for Paced {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        // Bytes rewritten behind the range already handed over (a header patched at the end of a
        // zip member) are left to the final `fsync`: a few bytes, not worth a request.
        self.pos = self.file.seek(to)?;
        Ok(self.pos)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::Read;

    #[test]
    fn bytes_and_seeks_are_the_files_and_writeback_is_asked_for_every_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        let mut w = Paced::with_step(File::create(&path).unwrap(), 1000);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for part in data.chunks(250) {
            w.write_all(part).unwrap();
        }
        // 10 000 bytes in steps of 1000: a request each time 1000 more bytes were written.
        assert_eq!(w.requests(), 10, "requests after 10 000 bytes");
        // Patch a header behind what was handed over, then go back to the end (a zip writer does).
        w.seek(SeekFrom::Start(10)).unwrap();
        w.write_all(&[7, 7, 7]).unwrap();
        w.seek(SeekFrom::End(0)).unwrap();
        w.write_all(&[1, 2]).unwrap();
        assert_eq!(
            w.requests(),
            10,
            "a patch and 2 more bytes ask for no writeback"
        );
        w.write_all(&[3; 998]).unwrap();
        assert_eq!(w.requests(), 11, "1000 bytes past the last request");
        drop(w.into_file());
        let mut want = data.clone();
        want[10..13].copy_from_slice(&[7, 7, 7]);
        want.extend_from_slice(&[1, 2]);
        want.extend_from_slice(&[3; 998]);
        let mut got = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut got).unwrap();
        assert_eq!(got, want);
    }
}
