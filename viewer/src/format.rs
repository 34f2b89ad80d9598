//! Human-readable numbers.

use std::fmt::Write as _;
/// `1234567` -> `1 234 567` (thin grouping that reads the same in every locale).
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// Bytes with a binary unit: `48 B`, `1.5 KiB`, `3.00 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if v >= 100.0 {
        format!("{v:.0} {}", UNITS[unit])
    } else if v >= 10.0 {
        format!("{v:.1} {}", UNITS[unit])
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// Bytes per second with a decimal unit (`12.3 GB/s`), as bandwidth is quoted.
pub fn bandwidth(bytes_per_sec: f64) -> String {
    const UNITS: [&str; 5] = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    let mut v = bytes_per_sec;
    let mut unit = 0;
    while v >= 1000.0 && unit < UNITS.len() - 1 {
        v /= 1000.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// Ranks as compact ranges: `0-3, 5, 7-8`.
pub fn ranks(ranks: &[u64]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1] == end + 1 {
            i += 1;
            end = ranks[i];
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        if end == start {
            out.push_str(&start.to_string());
        } else {
            let _ = write!(out, "{start}-{end}");
        }
        i += 1;
    }
    if out.is_empty() {
        "none".to_owned()
    } else {
        out
    }
}

/// A shape as torch prints it: `[7, 5]`, `[]` for a scalar.
pub fn shape(shape: &[u64]) -> String {
    let inner: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", inner.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(count(1_234_567), "1 234 567");
        assert_eq!(count(12), "12");
        assert_eq!(bytes(48), "48 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(ranks(&[0, 1, 2, 3, 5, 7, 8]), "0-3, 5, 7-8");
        assert_eq!(ranks(&[]), "none");
        assert_eq!(bandwidth(12.3e9), "12.30 GB/s");
        assert_eq!(shape(&[7, 5]), "[7, 5]");
    }
}
