//! Subcommands. Data goes to stdout; errors, hints and progress go to stderr.

pub mod convert;
pub mod diff;
pub mod gather;
pub mod inspect;
pub mod layout;
pub mod report_text;
pub mod reshard;
pub mod verify;

use std::io::Write;

/// Prints an error with its whole `source()` chain to stderr.
pub fn report_error(err: &anyhow::Error) {
    let mut stderr = std::io::stderr().lock();
    let _ = write!(stderr, "error: {err}");
    for cause in err.chain().skip(1) {
        let _ = write!(stderr, ": {cause}");
    }
    let _ = writeln!(stderr);
}

/// Writes `text` to stdout, treating a closed pipe (`| head`) as success.
pub fn print_stdout(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Formats a byte count for people (`1.5 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
