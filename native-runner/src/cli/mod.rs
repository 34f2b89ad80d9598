//! Subcommands. Data goes to stdout; errors, hints and progress go to stderr.

pub mod convert;
pub mod convert_mapped;
pub mod diff;
pub mod doctor;
pub mod gather;
pub mod hash;
pub mod inspect;
pub mod layout;
pub mod mappings;
pub mod read;
pub mod report_text;
pub mod reshard;
pub mod verify;

use std::io::Write;

/// Writes `text` to stdout, treating a closed pipe (`| head`) as success.
pub fn print_stdout(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(e.into()),
    }
}
