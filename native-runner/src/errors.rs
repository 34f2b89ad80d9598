//! How errors read: the message and its `source()` chain, each cause once (`error: …` on stderr
//! for the binary, and inside messages that wrap another error).

use std::io::Write;

/// Prints an error with its whole `source()` chain to stderr.
pub fn report_error(err: &anyhow::Error) {
    let _ = writeln!(std::io::stderr().lock(), "error: {}", error_text(err));
}

/// The error and its `source()` chain joined with `: `; a cause whose text the message already
/// shows (errors that print their source in their own message) is not repeated.
pub fn error_text(err: &anyhow::Error) -> String {
    let mut text = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read model.pt: {source}")]
    struct ShowsSource {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn causes_are_chained_once() {
        let io = || std::io::Error::other("disk on fire");
        let err = anyhow::Error::new(ShowsSource { source: io() }).context("reshard");
        assert_eq!(
            error_text(&err),
            "reshard: cannot read model.pt: disk on fire"
        );
        let err = anyhow::Error::new(io()).context("cannot open x.pt");
        assert_eq!(error_text(&err), "cannot open x.pt: disk on fire");
    }
}
