//! The [`Source`] contract, as one check that every implementation's tests run over the files it
//! was made from (memory, memory-mapped files, the desktop viewer's files, HTTP and object stores,
//! the browser's): names sorted and complete, sizes, every kind of range read (empty, one byte, the
//! middle, the end, several at once, both ends of a range), and errors — never a panic — for
//! unknown names and ranges past the end. As object_store runs one integration suite for every
//! store.

use std::collections::BTreeMap;

use super::{Source, SourceError};

/// Every way `source` breaks the contract for `files` (name → bytes, all of which it must serve);
/// empty when it keeps it.
pub fn violations(source: &dyn Source, files: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    let mut out = Vec::new();
    let names = source.names();
    if !names.windows(2).all(|w| w[0] < w[1]) {
        out.push(format!("names are not sorted and distinct: {names:?}"));
    }
    for (name, bytes) in files {
        if !names.contains(name) {
            out.push(format!("`{name}` is not among the names {names:?}"));
        }
        check_file(source, name, bytes, &mut out);
    }
    let unknown = "no/such/file.bin";
    if source.contains(unknown) {
        out.push(format!("contains(`{unknown}`)"));
    }
    if !matches!(source.size(unknown), Err(SourceError::NotFound { .. })) {
        out.push(format!("size(`{unknown}`) is not NotFound"));
    }
    if source.read_range(unknown, 0, 1).is_ok() {
        out.push(format!("read_range(`{unknown}`) succeeded"));
    }
    if source.read_range_into(unknown, 0, &mut [0]).is_ok() {
        out.push(format!("read_range_into(`{unknown}`) succeeded"));
    }
    out
}

fn check_file(source: &dyn Source, name: &str, bytes: &[u8], out: &mut Vec<String>) {
    let len = bytes.len() as u64;
    match source.size(name) {
        Ok(size) if size == len => {}
        other => out.push(format!("size(`{name}`) = {other:?}, expected {len}")),
    }
    if !source.contains(name) {
        out.push(format!("!contains(`{name}`)"));
    }
    match source.read_all(name) {
        Ok(all) if all.as_ref() == bytes => {}
        Ok(all) => out.push(format!(
            "read_all(`{name}`): {} bytes differ from the file's {len}",
            all.len()
        )),
        Err(e) => out.push(format!("read_all(`{name}`): {e}")),
    }
    let third = len / 3;
    let ranges = [
        (0, 0),
        (0, len.min(1)),
        (len.saturating_sub(1), len.min(1)),
        (third, third),
        (len, 0),
        (0, len),
    ];
    for &(offset, n) in &ranges {
        let want = &bytes[offset as usize..(offset + n) as usize];
        match source.read_range(name, offset, n) {
            Ok(got) if got.as_ref() == want => {}
            Ok(got) => out.push(format!(
                "read_range(`{name}`, {offset}, {n}): {} bytes, not the file's",
                got.len()
            )),
            Err(e) => out.push(format!("read_range(`{name}`, {offset}, {n}): {e}")),
        }
        // The same range into a buffer that held other bytes.
        let mut buf = vec![0xa5; n as usize];
        match source.read_range_into(name, offset, &mut buf) {
            Ok(()) if buf == want => {}
            Ok(()) => out.push(format!(
                "read_range_into(`{name}`, {offset}, {n}): not the file's bytes"
            )),
            Err(e) => out.push(format!("read_range_into(`{name}`, {offset}, {n}): {e}")),
        }
    }
    match source.read_ranges(name, &ranges) {
        Ok(parts) if parts.len() == ranges.len() => {
            for (part, &(offset, n)) in parts.iter().zip(&ranges) {
                if part.as_ref() != &bytes[offset as usize..(offset + n) as usize] {
                    out.push(format!(
                        "read_ranges(`{name}`): the range {offset}+{n} is not the file's"
                    ));
                }
            }
        }
        Ok(parts) => out.push(format!(
            "read_ranges(`{name}`): {} parts for {} ranges",
            parts.len(),
            ranges.len()
        )),
        Err(e) => out.push(format!("read_ranges(`{name}`): {e}")),
    }
    // Both ends of the whole file: the ends are the file's, the middle the file's or zero.
    let (head, tail) = (third.min(64), third.min(64));
    match source.read_ends(name, 0, len, head, tail) {
        Ok(got) if got.len() as u64 == len => {
            let ok = got.iter().zip(bytes).enumerate().all(|(i, (g, b))| {
                let i = i as u64;
                g == b || (i >= head && i < len - tail && *g == 0)
            });
            if !ok {
                out.push(format!(
                    "read_ends(`{name}`, 0, {len}, {head}, {tail}): bytes differ"
                ));
            }
        }
        Ok(got) => out.push(format!(
            "read_ends(`{name}`): {} bytes for {len}",
            got.len()
        )),
        Err(e) => out.push(format!("read_ends(`{name}`): {e}")),
    }
    check_past_end(source, name, len, out);
}

/// Reads past the end of a file of `len` bytes: errors, never bytes.
fn check_past_end(source: &dyn Source, name: &str, len: u64, out: &mut Vec<String>) {
    for (offset, n) in [
        (len, 1),
        (len.saturating_add(1), 0),
        (u64::MAX, 2),
        (0, len + 1),
    ] {
        if source.read_range(name, offset, n).is_ok() {
            out.push(format!(
                "read_range(`{name}`, {offset}, {n}) past the end succeeded"
            ));
        }
        if n <= len + 1
            && source
                .read_range_into(name, offset, &mut vec![0; n as usize])
                .is_ok()
        {
            out.push(format!(
                "read_range_into(`{name}`, {offset}, {n}) past the end succeeded"
            ));
        }
    }
}

/// Files of the sizes that catch off-by-one errors (empty, one byte, odd, larger than a page),
/// with bytes that differ by position, nested in a folder too.
pub fn sample_files() -> BTreeMap<String, Vec<u8>> {
    let bytes = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    };
    [
        ("a.bin", bytes(0, 1)),
        ("b.bin", bytes(1, 2)),
        ("c.pt", bytes(4099, 3)),
        ("sub/d.distcp", bytes(70_001, 4)),
    ]
    .into_iter()
    .map(|(n, b)| (n.to_owned(), b))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::MemorySource;

    #[test]
    fn memory_source_keeps_the_contract() {
        let files = sample_files();
        let mut source = MemorySource::new();
        for (n, b) in &files {
            source.insert(n.clone(), b.clone());
        }
        assert_eq!(violations(&source, &files), Vec::<String>::new());
    }

    #[test]
    fn a_broken_source_is_caught() {
        /// Serves one byte too few at the end of every range.
        #[derive(Debug)]
        struct Short(MemorySource);
        impl Source for Short {
            fn names(&self) -> Vec<String> {
                self.0.names()
            }
            fn size(&self, name: &str) -> Result<u64, SourceError> {
                self.0.size(name)
            }
            fn read_range(
                &self,
                name: &str,
                offset: u64,
                len: u64,
            ) -> Result<std::borrow::Cow<'_, [u8]>, SourceError> {
                self.0.read_range(name, offset, len.saturating_sub(1))
            }
        }
        let files = sample_files();
        let mut source = MemorySource::new();
        for (n, b) in &files {
            source.insert(n.clone(), b.clone());
        }
        assert!(!violations(&Short(source), &files).is_empty());
    }
}
