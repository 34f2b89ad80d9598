//! A minimal streaming writer for *stored* (uncompressed) zip archives, laid out the way `torch.save`
//! lays them out: every member's data starts at a multiple of 64 bytes from the archive start (padding
//! goes into an extra field tagged `FB`, as torch's writer does), and the archive always ends with
//! ZIP64 end records. Sizes and CRC-32 are written in the local headers (no data descriptors), so the
//! archive is readable by any zip reader; members of 4 GiB or more, and members past 4 GiB, get ZIP64
//! extra fields.
//!
//! [`ZipWriter::add`] needs only `Write`: offsets are counted, never sought. A member too large to
//! hold in memory is streamed with [`ZipWriter::begin`], [`ZipWriter::write_part`] and
//! [`ZipWriter::end`]; its size is declared up front and `end` seeks back to write the CRC-32 into
//! its local header (the bytes are those `add` writes). Timestamps are fixed (1980-01-01 00:00), so
//! the bytes depend only on the names and data.

use std::io::{self, Seek, SeekFrom, Write};

use super::CountingWriter;

/// Alignment of member data, as `torch.save` uses (`torch.serialization` `storage_alignment`).
pub const DATA_ALIGNMENT: u64 = 64;

const LOCAL_HEADER_SIG: u32 = 0x0403_4b50;
const CENTRAL_HEADER_SIG: u32 = 0x0201_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const LOCAL_HEADER_BYTES: u64 = 30;
const ZIP64_EXTRA_TAG: u16 = 0x0001;
/// `b"FB"` read as little-endian u16: the tag torch's writer uses for its alignment padding.
const PADDING_EXTRA_TAG: u16 = 0x4246;
/// Bit 11: names are UTF-8.
const FLAG_UTF8: u16 = 0x0800;
const VERSION_PLAIN: u16 = 20;
const VERSION_ZIP64: u16 = 45;
/// MS-DOS date 1980-01-01 (day 1, month 1, year 0).
const DOS_DATE: u16 = 0x0021;
const U32_LIMIT: u64 = 0xFFFF_FFFF;

/// When to use ZIP64 extra fields for members.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Zip64 {
    /// Only for sizes and offsets that do not fit 32 bits (the end records are always ZIP64).
    #[default]
    WhenNeeded,
    /// For every member (exercises the ZIP64 paths of readers on small archives).
    Always,
}

/// A zip archive could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ZipWriteError {
    /// The underlying writer failed.
    #[error("writing zip member `{name}` failed")]
    Io {
        /// The member being written (or `<central directory>`).
        name: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A member name is longer than 65535 bytes.
    #[error("zip member name is {len} bytes long (the format allows 65535): `{name}`")]
    NameTooLong {
        /// The name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// Two members have the same name.
    #[error("zip member `{name}` written twice")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A member was added or begun while a streamed member was still open, or a part was written
    /// or a member ended with none open.
    #[error("zip member `{name}`: {what}")]
    Streaming {
        /// The member concerned (the open one, if any).
        name: String,
        /// What was wrong.
        what: &'static str,
    },
    /// A streamed member got more or fewer bytes than [`ZipWriter::begin`] declared.
    #[error("zip member `{name}` was declared as {declared} bytes, got {written}")]
    MemberSize {
        /// The member.
        name: String,
        /// Bytes declared.
        declared: u64,
        /// Bytes written (so far, when too many).
        written: u64,
    },
}

/// The member being streamed.
#[derive(Debug)]
struct Open {
    name: String,
    size: u64,
    written: u64,
    crc: crc32fast::Hasher,
    local_header_offset: u64,
}

/// Offset of the CRC-32 field in a local header.
const LOCAL_CRC_OFFSET: u64 = 14;

#[derive(Debug)]
struct Entry {
    name: String,
    crc32: u32,
    size: u64,
    local_header_offset: u64,
}

/// Streams a stored zip archive into `W`. Call [`ZipWriter::add`] per member, then
/// [`ZipWriter::finish`].
#[derive(Debug)]
pub struct ZipWriter<W: Write> {
    out: CountingWriter<W>,
    entries: Vec<Entry>,
    zip64: Zip64,
    open: Option<Open>,
}

impl<W: Write> ZipWriter<W> {
    /// An archive written into `out` from its first byte (offsets are relative to that byte).
    pub fn new(out: W) -> Self {
        Self::with_zip64(out, Zip64::WhenNeeded)
    }

    /// Like [`ZipWriter::new`], choosing when member headers use ZIP64 fields.
    pub fn with_zip64(out: W, zip64: Zip64) -> Self {
        Self {
            out: CountingWriter::new(out),
            entries: Vec::new(),
            zip64,
            open: None,
        }
    }

    /// Appends the member `name` holding `data`, its data aligned to [`DATA_ALIGNMENT`].
    pub fn add(&mut self, name: &str, data: &[u8]) -> Result<(), ZipWriteError> {
        let crc32 = crc32fast::hash(data);
        self.header(name, data.len() as u64, crc32)?;
        self.out
            .write_all(data)
            .map_err(|source| ZipWriteError::Io {
                name: name.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// Starts the member `name` of `size` bytes, to be written with [`ZipWriter::write_part`] and
    /// closed with [`ZipWriter::end`] (which needs `W: Seek`).
    pub fn begin(&mut self, name: &str, size: u64) -> Result<(), ZipWriteError> {
        let offset = self.out.position();
        self.header(name, size, 0)?;
        self.open = Some(Open {
            name: name.to_owned(),
            size,
            written: 0,
            crc: crc32fast::Hasher::new(),
            local_header_offset: offset,
        });
        Ok(())
    }

    /// Writes the next bytes of the member [`ZipWriter::begin`] started.
    pub fn write_part(&mut self, data: &[u8]) -> Result<(), ZipWriteError> {
        let Some(open) = self.open.as_mut() else {
            return Err(ZipWriteError::Streaming {
                name: String::new(),
                what: "a part was written with no member begun",
            });
        };
        let written = open.written.saturating_add(data.len() as u64);
        if written > open.size {
            return Err(ZipWriteError::MemberSize {
                name: open.name.clone(),
                declared: open.size,
                written,
            });
        }
        open.crc.update(data);
        open.written = written;
        self.out
            .write_all(data)
            .map_err(|source| ZipWriteError::Io {
                name: open.name.clone(),
                source,
            })
    }

    /// Bytes written so far.
    pub fn position(&self) -> u64 {
        self.out.position()
    }

    /// Writes the local header of `name` (`size` bytes, CRC `crc32`) and records the member.
    fn header(&mut self, name: &str, size: u64, crc32: u32) -> Result<(), ZipWriteError> {
        if let Some(open) = &self.open {
            return Err(ZipWriteError::Streaming {
                name: open.name.clone(),
                what: "still open when another member was added",
            });
        }
        if name.len() > usize::from(u16::MAX) {
            return Err(ZipWriteError::NameTooLong {
                name: name.to_owned(),
                len: name.len(),
            });
        }
        if self.entries.iter().any(|e| e.name == name) {
            return Err(ZipWriteError::DuplicateName {
                name: name.to_owned(),
            });
        }
        let offset = self.out.position();
        let zip64 = self.zip64 == Zip64::Always || size >= U32_LIMIT;

        let mut extra = Vec::new();
        if zip64 {
            put_u16(&mut extra, ZIP64_EXTRA_TAG);
            put_u16(&mut extra, 16);
            put_u64(&mut extra, size);
            put_u64(&mut extra, size);
        }
        // Padding field: 4 header bytes + `pad` filler bytes, so that the data lands aligned.
        let before_padding =
            offset + LOCAL_HEADER_BYTES + name.len() as u64 + extra.len() as u64 + 4;
        let pad = (DATA_ALIGNMENT - before_padding % DATA_ALIGNMENT) % DATA_ALIGNMENT;
        put_u16(&mut extra, PADDING_EXTRA_TAG);
        put_u16(&mut extra, pad as u16);
        extra.resize(extra.len() + pad as usize, b'Z');

        let mut header = Vec::with_capacity(LOCAL_HEADER_BYTES as usize + name.len() + extra.len());
        put_u32(&mut header, LOCAL_HEADER_SIG);
        put_u16(
            &mut header,
            if zip64 { VERSION_ZIP64 } else { VERSION_PLAIN },
        );
        put_u16(&mut header, FLAG_UTF8);
        put_u16(&mut header, 0); // stored
        put_u16(&mut header, 0); // time
        put_u16(&mut header, DOS_DATE);
        put_u32(&mut header, crc32);
        let size32 = if zip64 { U32_LIMIT as u32 } else { size as u32 };
        put_u32(&mut header, size32);
        put_u32(&mut header, size32);
        put_u16(&mut header, name.len() as u16);
        put_u16(&mut header, extra.len() as u16);
        header.extend_from_slice(name.as_bytes());
        header.extend_from_slice(&extra);

        let io_err = |source| ZipWriteError::Io {
            name: name.to_owned(),
            source,
        };
        self.out.write_all(&header).map_err(io_err)?;
        debug_assert_eq!(self.out.position() % DATA_ALIGNMENT, 0);
        self.entries.push(Entry {
            name: name.to_owned(),
            crc32,
            size,
            local_header_offset: offset,
        });
        Ok(())
    }

    /// Writes the central directory and the (ZIP64) end records; returns the inner writer.
    pub fn finish(mut self) -> Result<W, ZipWriteError> {
        if let Some(open) = &self.open {
            return Err(ZipWriteError::Streaming {
                name: open.name.clone(),
                what: "still open when the archive was finished",
            });
        }
        let cd_offset = self.out.position();
        let mut cd = Vec::new();
        for entry in &self.entries {
            let size_big = self.zip64 == Zip64::Always || entry.size >= U32_LIMIT;
            let offset_big = self.zip64 == Zip64::Always || entry.local_header_offset >= U32_LIMIT;
            let mut extra = Vec::new();
            if size_big || offset_big {
                let mut fields = Vec::new();
                if size_big {
                    put_u64(&mut fields, entry.size);
                    put_u64(&mut fields, entry.size);
                }
                if offset_big {
                    put_u64(&mut fields, entry.local_header_offset);
                }
                put_u16(&mut extra, ZIP64_EXTRA_TAG);
                put_u16(&mut extra, fields.len() as u16);
                extra.extend_from_slice(&fields);
            }
            let version = if extra.is_empty() {
                VERSION_PLAIN
            } else {
                VERSION_ZIP64
            };
            put_u32(&mut cd, CENTRAL_HEADER_SIG);
            put_u16(&mut cd, VERSION_ZIP64); // made by
            put_u16(&mut cd, version); // needed
            put_u16(&mut cd, FLAG_UTF8);
            put_u16(&mut cd, 0); // stored
            put_u16(&mut cd, 0); // time
            put_u16(&mut cd, DOS_DATE);
            put_u32(&mut cd, entry.crc32);
            let size32 = if size_big {
                U32_LIMIT as u32
            } else {
                entry.size as u32
            };
            put_u32(&mut cd, size32);
            put_u32(&mut cd, size32);
            put_u16(&mut cd, entry.name.len() as u16);
            put_u16(&mut cd, extra.len() as u16);
            put_u16(&mut cd, 0); // comment
            put_u16(&mut cd, 0); // disk
            put_u16(&mut cd, 0); // internal attributes
            put_u32(&mut cd, 0); // external attributes
            let offset32 = if offset_big {
                U32_LIMIT as u32
            } else {
                entry.local_header_offset as u32
            };
            put_u32(&mut cd, offset32);
            cd.extend_from_slice(entry.name.as_bytes());
            cd.extend_from_slice(&extra);
        }
        let cd_size = cd.len() as u64;
        let zip64_eocd_offset = cd_offset + cd_size;
        let count = self.entries.len() as u64;

        let mut end = Vec::new();
        put_u32(&mut end, ZIP64_EOCD_SIG);
        put_u64(&mut end, 44); // size of the rest of this record
        put_u16(&mut end, VERSION_ZIP64);
        put_u16(&mut end, VERSION_ZIP64);
        put_u32(&mut end, 0); // this disk
        put_u32(&mut end, 0); // disk with the central directory
        put_u64(&mut end, count);
        put_u64(&mut end, count);
        put_u64(&mut end, cd_size);
        put_u64(&mut end, cd_offset);
        put_u32(&mut end, ZIP64_LOCATOR_SIG);
        put_u32(&mut end, 0);
        put_u64(&mut end, zip64_eocd_offset);
        put_u32(&mut end, 1); // total disks
        put_u32(&mut end, EOCD_SIG);
        put_u16(&mut end, 0);
        put_u16(&mut end, 0);
        let count16 = u16::try_from(count).unwrap_or(u16::MAX);
        put_u16(&mut end, count16);
        put_u16(&mut end, count16);
        put_u32(&mut end, u32::try_from(cd_size).unwrap_or(u32::MAX));
        put_u32(&mut end, u32::try_from(cd_offset).unwrap_or(u32::MAX));
        put_u16(&mut end, 0); // comment length

        let io_err = |source| ZipWriteError::Io {
            name: "<central directory>".to_owned(),
            source,
        };
        self.out.write_all(&cd).map_err(io_err)?;
        self.out.write_all(&end).map_err(io_err)?;
        self.out.flush().map_err(io_err)?;
        Ok(self.out.into_inner())
    }
}

impl<W: Write + Seek> ZipWriter<W> {
    /// Ends the member [`ZipWriter::begin`] started, once all its declared bytes are written:
    /// writes its CRC-32 into its local header (seeking back and forth) and returns the CRC.
    pub fn end(&mut self) -> Result<u32, ZipWriteError> {
        let Some(open) = self.open.take() else {
            return Err(ZipWriteError::Streaming {
                name: String::new(),
                what: "ended with no member begun",
            });
        };
        if open.written != open.size {
            let err = ZipWriteError::MemberSize {
                name: open.name.clone(),
                declared: open.size,
                written: open.written,
            };
            self.open = Some(open);
            return Err(err);
        }
        let crc32 = open.crc.finalize();
        let io_err = |source| ZipWriteError::Io {
            name: open.name.clone(),
            source,
        };
        // Relative seeks: the archive may start anywhere in `W`.
        let back = self
            .out
            .position()
            .checked_sub(open.local_header_offset + LOCAL_CRC_OFFSET)
            .and_then(|n| i64::try_from(n).ok())
            .ok_or_else(|| io_err(io::Error::other("member offset out of range")))?;
        let inner = self.out.inner_mut();
        inner.seek(SeekFrom::Current(-back)).map_err(io_err)?;
        inner.write_all(&crc32.to_le_bytes()).map_err(io_err)?;
        inner.seek(SeekFrom::Current(back - 4)).map_err(io_err)?;
        if let Some(entry) = self.entries.last_mut() {
            entry.crc32 = crc32;
        }
        Ok(crc32)
    }
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn members_are_aligned_and_end_records_are_present() {
        let mut zip = ZipWriter::new(Vec::new());
        zip.add("archive/data.pkl", b"abc").unwrap();
        zip.add("archive/data/0", &[7u8; 10]).unwrap();
        let bytes = zip.finish().unwrap();
        assert_eq!(u32_at(&bytes, 0), LOCAL_HEADER_SIG);
        // The second local header starts right after the first member's 3 data bytes at 64.
        assert_eq!(u32_at(&bytes, 67), LOCAL_HEADER_SIG);
        assert_eq!(&bytes[128..138], &[7u8; 10]);
        // EOCD is the last 22 bytes, preceded by the 20-byte locator and the 56-byte ZIP64 record.
        let n = bytes.len();
        assert_eq!(u32_at(&bytes, n - 22), EOCD_SIG);
        assert_eq!(u32_at(&bytes, n - 42), ZIP64_LOCATOR_SIG);
        assert_eq!(u32_at(&bytes, n - 98), ZIP64_EOCD_SIG);
        // CRC-32 of "abc" (a standard check value).
        assert_eq!(u32_at(&bytes, 14), 0x3524_41c2);
    }

    #[test]
    fn streamed_members_match_added_ones() {
        for zip64 in [Zip64::WhenNeeded, Zip64::Always] {
            let data: Vec<u8> = (0..300u32).map(|i| (i * 13) as u8).collect();
            let mut added = ZipWriter::with_zip64(Vec::new(), zip64);
            added.add("a/data.pkl", b"xyz").unwrap();
            added.add("a/data/0", &data).unwrap();
            added.add("a/version", b"3\n").unwrap();
            let added = added.finish().unwrap();
            let mut streamed = ZipWriter::with_zip64(io::Cursor::new(Vec::new()), zip64);
            streamed.add("a/data.pkl", b"xyz").unwrap();
            streamed.begin("a/data/0", 300).unwrap();
            for part in data.chunks(7) {
                streamed.write_part(part).unwrap();
            }
            // CRC-32 of the data, as zlib computes it.
            assert_eq!(streamed.end().unwrap(), crc32fast::hash(&data));
            streamed.add("a/version", b"3\n").unwrap();
            assert_eq!(streamed.finish().unwrap().into_inner(), added);
        }
    }

    #[test]
    fn streamed_members_are_checked() {
        let mut zip = ZipWriter::new(io::Cursor::new(Vec::new()));
        assert!(matches!(
            zip.write_part(b"x"),
            Err(ZipWriteError::Streaming { .. })
        ));
        assert!(matches!(zip.end(), Err(ZipWriteError::Streaming { .. })));
        zip.begin("m", 4).unwrap();
        zip.write_part(b"abc").unwrap();
        assert!(matches!(
            zip.add("n", b""),
            Err(ZipWriteError::Streaming { .. })
        ));
        assert!(matches!(
            zip.end(),
            Err(ZipWriteError::MemberSize {
                declared: 4,
                written: 3,
                ..
            })
        ));
        assert!(matches!(
            zip.write_part(b"de"),
            Err(ZipWriteError::MemberSize {
                declared: 4,
                written: 5,
                ..
            })
        ));
        zip.write_part(b"d").unwrap();
        zip.end().unwrap();
        let mut open = ZipWriter::new(io::Cursor::new(Vec::new()));
        open.begin("m", 1).unwrap();
        assert!(matches!(
            open.finish(),
            Err(ZipWriteError::Streaming { .. })
        ));
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut zip = ZipWriter::new(Vec::new());
        zip.add("a", b"").unwrap();
        assert!(matches!(
            zip.add("a", b""),
            Err(ZipWriteError::DuplicateName { .. })
        ));
    }
}
