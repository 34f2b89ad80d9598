//! What can go wrong on the wire, as types: [`Fault`] is read from `object_store`'s typed errors
//! (its error variants, the HTTP status our connector attaches, `reqwest`/`std::io` error kinds
//! found through `source()`), never from message text. Transient faults are retried with backoff
//! within a budget of [`Settings::tries`]; a body cut short resumes from the byte where it
//! stopped (see `fetch`). [`Failure`] is the last fault with the number of tries, in words.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use object_store::client::{HttpError, HttpErrorKind};

use super::connector::HttpStatus;
use super::error::{describe_error, error_chain, hide_queries, is_credential_error};
use super::url::Scheme;

/// `--io-timeout` in milliseconds (default 30 s): how long a request may wait for its next byte.
static IO_TIMEOUT_MS: AtomicU64 = AtomicU64::new(30_000);

/// Sets how long a remote read may wait for a byte (`--io-timeout`): per request and per chunk
/// of body, never for a whole transfer.
pub fn set_io_timeout(timeout: Duration) {
    let ms = u64::try_from(timeout.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    IO_TIMEOUT_MS.store(ms, Ordering::Relaxed);
}

/// Tries of one request in a row that bring no new byte (the first and the retries); a try that
/// delivers bytes of the body starts the count again.
const TRIES: u32 = 5;
/// No request is retried once this long has passed since its first try
/// (`SHARDSCOPE_RETRY_DEADLINE_MS` overrides it).
const DEADLINE_MS: u64 = 30 * 60 * 1000;
/// The first backoff, doubled after each failed try (`SHARDSCOPE_RETRY_BASE_MS` overrides it).
const BACKOFF_BASE_MS: u64 = 200;
/// No backoff is longer than this.
const BACKOFF_MAX_MS: u64 = 5_000;

/// The retry policy of this process.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) io_timeout: Duration,
    pub(super) tries: u32,
    /// Past this since the first try, a failed try is the last.
    pub(super) deadline: Duration,
    backoff_base_ms: u64,
}

impl Settings {
    pub(super) fn get() -> Settings {
        let backoff_base_ms = std::env::var("SHARDSCOPE_RETRY_BASE_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(BACKOFF_BASE_MS);
        let deadline_ms = std::env::var("SHARDSCOPE_RETRY_DEADLINE_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(DEADLINE_MS);
        Settings {
            io_timeout: Duration::from_millis(IO_TIMEOUT_MS.load(Ordering::Relaxed)),
            tries: TRIES,
            deadline: Duration::from_millis(deadline_ms),
            backoff_base_ms,
        }
    }

    /// The wait before try `next` (2, 3, ...): the base, doubled each time, capped.
    pub(super) fn backoff(&self, next: u32) -> Duration {
        let doublings = next.saturating_sub(2).min(20);
        let ms = self
            .backoff_base_ms
            .saturating_mul(1u64 << doublings)
            .min(BACKOFF_MAX_MS.max(self.backoff_base_ms));
        Duration::from_millis(ms)
    }
}

/// One failed try, by kind.
#[derive(Debug)]
pub(super) enum Fault {
    /// The server answered with this error status (5xx, 429, 416, ...).
    Status(u16),
    /// No byte arrived for this long (`--io-timeout`).
    Stalled(Duration),
    /// The connection was reset, or closed before the whole body arrived: `missing` bytes of
    /// `range` had not come (0: before the body started).
    Cut {
        reset: bool,
        missing: u64,
        range: (u64, u64),
    },
    /// No connection could be made (refused, DNS, unreachable).
    Connect(String),
    /// The TLS handshake failed (an untrusted or invalid certificate, no common protocol): another
    /// try would fail the same way, so it is not retried.
    Tls(String),
    /// The redirects never ended (a loop, or more than the client follows).
    Redirects,
    /// The object is larger than a whole-file read allows.
    TooLarge {
        size: u64,
        limit: u64,
        what: &'static str,
    },
    /// A buffer for a size the server gave could not be allocated.
    NoMemory { size: u64 },
    /// The server sent more than the range asked for.
    LongBody { range: (u64, u64) },
    /// Anything else the store said (not found, access denied, a bad `Content-Range`): not retried.
    Store(object_store::Error),
}

impl Fault {
    /// Worth another try: server errors, throttling, stalls, cut or failed connections.
    pub(super) fn is_transient(&self) -> bool {
        match self {
            Fault::Status(code) => *code >= 500 || *code == 429 || *code == 408,
            Fault::Stalled(_) | Fault::Cut { .. } | Fault::Connect(_) => true,
            _ => false,
        }
    }

    /// The fault behind an `object_store` error, from its variant and its typed sources.
    pub(super) fn of(scheme: Scheme, err: object_store::Error, range: (u64, u64)) -> Fault {
        if !matches!(err, object_store::Error::Generic { .. }) || is_credential_error(scheme, &err)
        {
            return Fault::Store(err);
        }
        let mut connect = false;
        let mut tls = None;
        let mut cut = None;
        let mut timeout = false;
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        while let Some(e) = next {
            if let Some(status) = e.downcast_ref::<HttpStatus>() {
                return Fault::Status(status.0);
            }
            if let Some(r) = e.downcast_ref::<reqwest::Error>() {
                if r.is_redirect() {
                    return Fault::Redirects;
                }
                connect |= r.is_connect();
                timeout |= r.is_timeout();
            }
            if let Some(t) = tls_error(e) {
                tls = Some(t.to_string());
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                use std::io::ErrorKind as K;
                match io.kind() {
                    K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => {
                        cut = Some(true);
                    }
                    K::UnexpectedEof => cut = cut.or(Some(false)),
                    K::ConnectionRefused
                    | K::NotConnected
                    | K::AddrNotAvailable
                    | K::HostUnreachable
                    | K::NetworkUnreachable => connect = true,
                    K::TimedOut => timeout = true,
                    _ => {}
                }
            }
            if let Some(h) = e.downcast_ref::<HttpError>() {
                match h.kind() {
                    HttpErrorKind::Connect => connect = true,
                    HttpErrorKind::Request | HttpErrorKind::Interrupted => {
                        cut = cut.or(Some(false));
                    }
                    HttpErrorKind::Timeout => timeout = true,
                    _ => {}
                }
            }
            next = e.source();
        }
        if let Some(why) = tls {
            Fault::Tls(why)
        } else if connect {
            Fault::Connect(hide_queries(&error_chain(&err)))
        } else if let Some(reset) = cut {
            Fault::Cut {
                reset,
                missing: 0,
                range,
            }
        } else if timeout {
            Fault::Stalled(Settings::get().io_timeout)
        } else {
            Fault::Store(err)
        }
    }

    /// In words (`scheme`: which credentials to name for access errors).
    pub(super) fn describe(&self, scheme: Scheme) -> String {
        match self {
            Fault::Status(code) => format!("HTTP {code}{}", status_reason(*code)),
            Fault::Stalled(t) => format!("no data for {} (--io-timeout)", seconds(*t)),
            Fault::Cut {
                reset,
                missing,
                range,
            } => {
                let how = if *reset {
                    "the connection was reset"
                } else {
                    "the connection closed"
                };
                if *missing == 0 {
                    format!(
                        "{how} before the body of bytes {}..{} arrived",
                        range.0, range.1
                    )
                } else {
                    format!(
                        "short body: {how} with {missing} bytes of the range {}..{} still to come",
                        range.0, range.1
                    )
                }
            }
            Fault::Connect(chain) => format!("cannot connect to the server ({chain})"),
            Fault::Tls(why) => format!(
                "the TLS handshake with the server failed: {why}\n\
                 hint: a server whose certificate comes from a private authority is trusted by \
                 setting SSL_CERT_FILE (or SSL_CERT_DIR) to that authority's PEM certificate"
            ),
            Fault::Redirects => "too many redirects (a redirect loop?)".into(),
            Fault::TooLarge { size, limit, what } => format!(
                "is {}; {what} over {} are refused (limit)",
                human(*size),
                human(*limit)
            ),
            Fault::NoMemory { size } => {
                format!("cannot allocate {} for it (out of memory)", human(*size))
            }
            Fault::LongBody { range } => format!(
                "the server sent more than bytes {}..{} asked for",
                range.0, range.1
            ),
            Fault::Store(e) => describe_error(scheme, e),
        }
    }
}

/// rustls's error in `e`, or in the `io::Error`s nested in it: hyper wraps it in two, and an
/// `io::Error`'s `source()` skips what it wraps, so the chain walk alone never meets it.
fn tls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut at = e;
    for _ in 0..8 {
        if let Some(t) = at.downcast_ref::<rustls::Error>() {
            return Some(t);
        }
        at = at.downcast_ref::<std::io::Error>()?.get_ref()?;
    }
    None
}

/// The last fault of a request, how many tries it had, and why it was not tried again.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) fault: Fault,
    pub(super) tries: u32,
    pub(super) gave_up: GaveUp,
}

/// Why a request that failed with a transient fault was not tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GaveUp {
    /// This many tries in a row brought no new byte (the budget).
    NoProgress(u32),
    /// The deadline since the first try had passed.
    Deadline(Duration),
}

impl Failure {
    pub(super) fn is_not_found(&self) -> bool {
        matches!(
            self.fault,
            Fault::Store(object_store::Error::NotFound { .. })
        )
    }

    /// A failure after `tries` tries, the last `in_a_row` of which brought no new byte.
    pub(super) fn new(fault: Fault, tries: u32, in_a_row: u32) -> Self {
        Failure {
            fault,
            tries,
            gave_up: GaveUp::NoProgress(in_a_row),
        }
    }

    pub(super) fn describe(&self, scheme: Scheme) -> String {
        let text = self.fault.describe(scheme);
        match self.gave_up {
            GaveUp::Deadline(d) => format!(
                "{text} (gave up: still incomplete {} after the first of {} tries; SHARDSCOPE_RETRY_DEADLINE_MS)",
                seconds(d),
                self.tries
            ),
            GaveUp::NoProgress(in_a_row) if in_a_row < self.tries => format!(
                "{text} (gave up after {in_a_row} tries in a row that brought no new byte; {} tries in all)",
                self.tries
            ),
            GaveUp::NoProgress(_) if self.tries > 1 => {
                format!("{text} (gave up after {} tries)", self.tries)
            }
            GaveUp::NoProgress(_) => text,
        }
    }
}

fn status_reason(code: u16) -> &'static str {
    match code {
        408 => " Request Timeout",
        416 => " Range Not Satisfiable",
        429 => " Too Many Requests",
        500 => " Internal Server Error",
        502 => " Bad Gateway",
        503 => " Service Unavailable",
        504 => " Gateway Timeout",
        _ => "",
    }
}

fn seconds(t: Duration) -> String {
    if t.subsec_millis() == 0 {
        format!("{} s", t.as_secs())
    } else {
        format!("{:.1} s", t.as_secs_f64())
    }
}

/// `6.0 GiB`, `512 MiB`, `100 bytes`.
pub(super) fn human(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss, reason = "a size shown to one decimal")]
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_come_from_types() {
        let status = object_store::Error::Generic {
            store: "HTTP",
            source: Box::new(HttpError::new(HttpErrorKind::Unknown, HttpStatus(503))),
        };
        let fault = Fault::of(Scheme::Http, status, (0, 10));
        assert!(matches!(fault, Fault::Status(503)) && fault.is_transient());
        let failure = Failure::new(fault, 5, 5);
        assert_eq!(
            failure.describe(Scheme::Http),
            "HTTP 503 Service Unavailable (gave up after 5 tries)"
        );
        // Tries that brought bytes do not count against the budget, and the message says so.
        let cut = |missing| Fault::Cut {
            reset: false,
            missing,
            range: (0, 100),
        };
        let t = Failure::new(cut(10), 9, 5).describe(Scheme::Http);
        assert!(
            t.contains("5 tries in a row that brought no new byte; 9 tries in all"),
            "{t}"
        );
        let late = Failure {
            fault: cut(10),
            tries: 3,
            gave_up: GaveUp::Deadline(Duration::from_secs(2)),
        };
        let t = late.describe(Scheme::Http);
        assert!(
            t.contains("still incomplete 2 s after the first of 3 tries"),
            "{t}"
        );
        // A reset, found through the sources whatever the message says ("timeout" in it).
        let reset = object_store::Error::Generic {
            store: "HTTP",
            source: Box::new(HttpError::new(
                HttpErrorKind::Unknown,
                std::io::Error::new(std::io::ErrorKind::ConnectionReset, "retry_timeout: 120s"),
            )),
        };
        let fault = Fault::of(Scheme::Http, reset, (0, 10));
        assert!(
            matches!(fault, Fault::Cut { reset: true, .. }) && fault.is_transient(),
            "{fault:?}"
        );
        let refused = object_store::Error::Generic {
            store: "HTTP",
            source: Box::new(HttpError::new(
                HttpErrorKind::Connect,
                std::io::Error::other("x"),
            )),
        };
        assert!(matches!(
            Fault::of(Scheme::Http, refused, (0, 1)),
            Fault::Connect(_)
        ));
        // A message that says "timed out" with no timeout behind it is not one.
        let text = object_store::Error::Generic {
            store: "HTTP",
            source: "operation timed out".into(),
        };
        let fault = Fault::of(Scheme::Http, text, (0, 1));
        assert!(matches!(fault, Fault::Store(_)) && !fault.is_transient());
        let nf = object_store::Error::NotFound {
            path: "x".into(),
            source: "404".into(),
        };
        assert!(Failure::new(Fault::of(Scheme::Http, nf, (0, 1)), 1, 1).is_not_found());
        let big = Fault::TooLarge {
            size: 6 << 30,
            limit: 1 << 30,
            what: "metadata files",
        };
        assert_eq!(
            big.describe(Scheme::Http),
            "is 6.0 GiB; metadata files over 1.0 GiB are refused (limit)"
        );
        assert_eq!(
            Fault::Stalled(Duration::from_secs(30)).describe(Scheme::Http),
            "no data for 30 s (--io-timeout)"
        );
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let s = Settings {
            io_timeout: Duration::from_secs(1),
            tries: 5,
            deadline: Duration::from_millis(DEADLINE_MS),
            backoff_base_ms: 100,
        };
        assert_eq!(s.backoff(2), Duration::from_millis(100));
        assert_eq!(s.backoff(3), Duration::from_millis(200));
        assert_eq!(s.backoff(60), Duration::from_millis(BACKOFF_MAX_MS));
    }
}
