//! Text rendering of `diff`/`verify` reports, and their progress line.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::time::{Duration, Instant};

use shardscope_core::verify::{Report, Status};

/// A progress line on stderr, only when stderr is a terminal and `--quiet` is not given.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    what: &'static str,
    last: Option<Instant>,
}

impl Progress {
    pub fn new(quiet: bool, what: &'static str) -> Progress {
        Progress {
            enabled: !quiet && std::io::stderr().is_terminal(),
            what,
            last: None,
        }
    }

    pub fn update(&mut self, done: usize, total: usize, key: &str) {
        if !self.enabled {
            return;
        }
        let mut err = std::io::stderr().lock();
        if done >= total {
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            return;
        }
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.last = Some(Instant::now());
        let _ = write!(err, "\r\x1b[2K{} [{done}/{total}] {key}", self.what);
        let _ = err.flush();
    }
}

fn shape(s: Option<&Vec<u64>>) -> String {
    s.map_or_else(String::new, |s| format!("{s:?}"))
}

/// Problems (one line each) and a summary line.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    for e in report.problems() {
        let status = match e.status {
            Status::Match => "match",
            Status::Mismatch => "MISMATCH",
            Status::Missing => "MISSING",
            Status::Unexpected => "UNEXPECTED",
            Status::Error => "ERROR",
        };
        let _ = write!(out, "{status:<10} {}", e.fqn);
        if let Some(d) = e.dtype {
            let _ = write!(out, " {d}{}", shape(e.shape.as_ref()));
        }
        if let Some(m) = &e.message {
            let _ = write!(out, ": {m}");
        }
        if let Some(x) = e.max_abs_diff {
            let _ = write!(out, " (max |diff| {x:e}");
            if let Some(r) = e.max_rel_diff {
                let _ = write!(out, ", max rel {r:e}");
            }
            let _ = write!(out, ")");
        }
        let raws: Vec<String> = [("left", &e.left_key), ("right", &e.right_key)]
            .iter()
            .filter_map(|(side, k)| k.as_ref().map(|k| format!("{side} key `{k}`")))
            .collect();
        if !raws.is_empty() {
            let _ = write!(out, " [{}]", raws.join(", "));
        }
        out.push('\n');
    }
    for n in &report.notes {
        let _ = writeln!(out, "note: {n}");
    }
    let s = &report.summary;
    let _ = writeln!(
        out,
        "{} {}: {} match, {} mismatch, {} missing, {} unexpected, {} error",
        report.command,
        if report.exit_code() == 0 {
            "ok"
        } else {
            "FAILED"
        },
        s.matched,
        s.mismatched,
        s.missing,
        s.unexpected,
        s.errors
    );
    out
}
