//! Remote reads under network faults, end to end: the `shardscope` binary reads a DCP checkpoint
//! from a fault-injecting HTTP server written here (std::net and threads, 127.0.0.1 port 0, `HEAD`
//! and `GET` with `Range`, an ETag honoured by `If-Match`). Each case says what must happen:
//! transient faults (a reset, a body cut short, a 500, once) are retried and resumed, and the
//! output is byte for byte the conversion of the same checkpoint read locally; persistent ones (a
//! reset every time, 503 every time, a stall, a wrong `Content-Range`, a redirect loop, a
//! `.metadata` of 6 GiB) exit 2 with a message naming the URL and leave nothing at the destination.
//! A redirect to another origin is followed, and `HF_TOKEN` reaches the Hugging Face endpoint's
//! origin only. A URL's query (presigned) is sent on every request of its file (retries, resumes)
//! and on no other file's or origin's.
//!
//! Faults strike `GET`s of data files (`*.distcp`, `*.pt`) whose body is at least
//! [`STRIKE_MIN`] bytes, so that opening (`.metadata`) works and the fault lands mid-conversion.
//! Retries wait `SHARDSCOPE_RETRY_BASE_MS=10` ms (doubling) so the failing cases stay fast; no
//! assertion depends on timing.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::shardscope_bin;

/// Bodies at least this long are struck by a fault.
const STRIKE_MIN: u64 = 1024;
const ETAG: &str = "\"shardscope-v1\"";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The first struck body: half of it, then a TCP reset.
    ResetOnce,
    /// Every struck response: its head, then a TCP reset before any body byte.
    ResetBeforeBody,
    /// Every struck body, the resumed ones too: half of it, then the connection closed (FIN).
    ShortAlways,
    /// The first struck body: half of it, then the connection closed (FIN).
    ShortOnce,
    /// Every struck response: its head, then nothing (the socket left open).
    Stall,
    /// The first struck request answers 500.
    Status500Once,
    /// Every struck request answers 503.
    Status503Always,
    /// Struck responses name a `Content-Range` one byte off.
    WrongRange,
    /// Every request is redirected to itself.
    RedirectLoop,
    /// Every request is redirected to the same path on 127.0.0.1 at this port.
    RedirectTo(u16),
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    /// The query, as sent (`None`: none).
    query: Option<String>,
    /// `Range: bytes=START-END` (END inclusive), when given.
    range: Option<(u64, Option<u64>)>,
    authorization: Option<String>,
}

/// A struck body: its path, where its range started and how many body bytes were sent.
#[derive(Debug, Clone, Copy)]
struct Strike {
    start: u64,
    end: u64,
    sent: u64,
}

struct State {
    root: PathBuf,
    fault: Fault,
    /// Answers carry an ETag (honoured by `If-Match`); without one, a client can only resume
    /// blindly (`object_store` alone then gives up at the first cut body).
    etag: bool,
    log: Mutex<Vec<Seen>>,
    strikes: Mutex<Vec<(String, Strike)>>,
    struck_once: AtomicBool,
    stop: AtomicBool,
}

/// The fault-injecting server; stops (ends stalled responses) when dropped.
struct FaultServer {
    port: u16,
    state: Arc<State>,
}

impl Drop for FaultServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

impl FaultServer {
    fn start(root: &Path, fault: Fault) -> FaultServer {
        Self::start_with(root, fault, true)
    }

    fn start_with(root: &Path, fault: Fault, etag: bool) -> FaultServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            root: root.to_path_buf(),
            fault,
            etag,
            log: Mutex::new(Vec::new()),
            strikes: Mutex::new(Vec::new()),
            struck_once: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let state = Arc::clone(&shared);
                std::thread::spawn(move || serve(&state, stream));
            }
        });
        FaultServer { port, state }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.port)
    }

    fn log(&self) -> Vec<Seen> {
        self.state.log.lock().unwrap().clone()
    }

    fn strikes(&self) -> Vec<(String, Strike)> {
        self.state.strikes.lock().unwrap().clone()
    }
}

/// Requests of one connection, one after another (HTTP/1.1 keep-alive).
fn serve(state: &State, stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut stream = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (Some(method), Some(target)) = (parts.next(), parts.next()) else {
            return;
        };
        let mut headers = HashMap::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
            }
        }
        let seen = Seen {
            method: method.to_owned(),
            path: target.split('?').next().unwrap_or("").to_owned(),
            query: target.split_once('?').map(|(_, q)| q.to_owned()),
            range: headers.get("range").and_then(|r| parse_range(r)),
            authorization: headers.get("authorization").cloned(),
        };
        state.log.lock().unwrap().push(seen.clone());
        if !respond(state, &mut stream, &seen, headers.get("if-match")) {
            return;
        }
    }
}

fn parse_range(value: &str) -> Option<(u64, Option<u64>)> {
    let spec = value.strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let end = if b.is_empty() {
        None
    } else {
        Some(b.parse().ok()?)
    };
    Some((a.parse().ok()?, end))
}

fn head_only(stream: &mut TcpStream, status: &str, extra: &str) -> bool {
    let text = format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n{extra}\r\n");
    stream.write_all(text.as_bytes()).is_ok()
}

/// Answers one request; false when the connection is done.
fn respond(state: &State, stream: &mut TcpStream, seen: &Seen, if_match: Option<&String>) -> bool {
    match state.fault {
        Fault::RedirectLoop => {
            return head_only(stream, "302 Found", &format!("Location: {}\r\n", seen.path));
        }
        Fault::RedirectTo(port) => {
            let to = format!("Location: http://127.0.0.1:{port}{}\r\n", seen.path);
            return head_only(stream, "302 Found", &to);
        }
        _ => {}
    }
    let rel = seen.path.trim_start_matches('/');
    let path = state.root.join(rel);
    if rel.split('/').any(|s| s == "..") || !path.is_file() {
        return head_only(stream, "404 Not Found", "");
    }
    if if_match.is_some_and(|m| m != ETAG) {
        return head_only(stream, "412 Precondition Failed", "");
    }
    let size = std::fs::metadata(&path).unwrap().len();
    let (start, end) = match seen.range {
        Some((a, b)) => (a, b.map_or(size, |b| b.saturating_add(1)).min(size)),
        None => (0, size),
    };
    if start >= end && size > 0 {
        return head_only(stream, "416 Range Not Satisfiable", "");
    }
    let len = end - start;
    let data_file = Path::new(rel)
        .extension()
        .is_some_and(|e| e == "distcp" || e == "pt");
    let struck = seen.method == "GET" && data_file && len >= STRIKE_MIN && {
        match state.fault {
            Fault::ResetOnce | Fault::ShortOnce | Fault::Status500Once => {
                !state.struck_once.swap(true, Ordering::SeqCst)
            }
            Fault::ResetBeforeBody
            | Fault::ShortAlways
            | Fault::Stall
            | Fault::Status503Always
            | Fault::WrongRange => true,
            _ => false,
        }
    };
    if struck {
        match state.fault {
            Fault::Status500Once => return head_only(stream, "500 Internal Server Error", ""),
            Fault::Status503Always => return head_only(stream, "503 Service Unavailable", ""),
            _ => {}
        }
    }
    let (status, range_header) = if seen.range.is_some() {
        let shown = if struck && state.fault == Fault::WrongRange {
            (start + 1, end)
        } else {
            (start, end - 1)
        };
        (
            "206 Partial Content",
            format!("Content-Range: bytes {}-{}/{size}\r\n", shown.0, shown.1),
        )
    } else {
        ("200 OK", String::new())
    };
    let etag = if state.etag {
        format!("ETag: {ETAG}\r\n")
    } else {
        String::new()
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {len}\r\nAccept-Ranges: bytes\r\n{etag}{range_header}\r\n"
    );
    if stream.write_all(head.as_bytes()).is_err() {
        return false;
    }
    if seen.method == "HEAD" {
        return true;
    }
    let send = match state.fault {
        _ if !struck => len,
        Fault::WrongRange => len,
        Fault::ResetBeforeBody | Fault::Stall => 0,
        _ => len / 2,
    };
    if !send_file(stream, &path, start, send) {
        return false;
    }
    if !struck || state.fault == Fault::WrongRange {
        return true;
    }
    state.strikes.lock().unwrap().push((
        seen.path.clone(),
        Strike {
            start,
            end,
            sent: send,
        },
    ));
    end_struck(state, stream);
    false
}

/// After the half of a struck body: a reset, a close, or a stall until the server stops.
fn end_struck(state: &State, stream: &mut TcpStream) {
    let _ = stream.flush();
    match state.fault {
        Fault::ResetOnce | Fault::ResetBeforeBody => {
            // Give the client a moment to take the half sent, then reset (RST, not FIN).
            std::thread::sleep(Duration::from_millis(100));
            let socket = socket2::Socket::from(stream.try_clone().unwrap());
            let _ = socket.set_linger(Some(Duration::ZERO));
            drop(socket);
        }
        Fault::ShortOnce | Fault::ShortAlways => {
            let _ = stream.shutdown(Shutdown::Both);
        }
        Fault::Stall => {
            while !state.stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        _ => {}
    }
}

/// `len` bytes of `path` from `start` to the client (large files in pieces).
fn send_file(stream: &mut TcpStream, path: &Path, start: u64, len: u64) -> bool {
    let mut file = std::fs::File::open(path).unwrap();
    file.seek(SeekFrom::Start(start)).unwrap();
    let mut left = len;
    let mut buf = vec![0u8; 64 << 10];
    while left > 0 {
        let n = usize::try_from(left.min(buf.len() as u64)).unwrap();
        if file.read_exact(&mut buf[..n]).is_err() || stream.write_all(&buf[..n]).is_err() {
            return false;
        }
        left -= n as u64;
    }
    true
}

// ----- the cases -------------------------------------------------------------------------------

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A served root holding the example DCP checkpoint under `ck/`.
fn served_checkpoint() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let ck = root.path().join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    for entry in std::fs::read_dir(examples_dir().join("fsdp2_dcp")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), ck.join(entry.file_name())).unwrap();
    }
    root
}

fn shardscope(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(shardscope_bin());
    cmd.args(args)
        .env("SHARDSCOPE_RETRY_BASE_MS", "10")
        .env_remove("HF_TOKEN")
        .env_remove("HF_ENDPOINT");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The conversion of the example checkpoint read locally (the oracle of every remote one).
fn local_conversion() -> Vec<u8> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("local.safetensors");
    let src = examples_dir().join("fsdp2_dcp");
    let done = shardscope(
        &[
            "convert",
            src.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "-q",
        ],
        &[],
    );
    assert!(done.status.success(), "{}", text(&done.stderr));
    std::fs::read(out).unwrap()
}

/// `convert URL -o DIR/out.safetensors` (plus `extra` arguments).
fn convert(url: &str, dst_dir: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Output {
    let dst = dst_dir.join("out.safetensors");
    let mut args = vec!["convert", url, "-o", dst.to_str().unwrap(), "-q"];
    args.extend_from_slice(extra);
    shardscope(&args, envs)
}

/// A conversion that must succeed and equal the local one.
fn assert_converts(server: &FaultServer, what: &str, envs: &[(&str, &str)]) {
    let tmp = tempfile::tempdir().unwrap();
    let out = convert(&server.url("ck/"), tmp.path(), &[], envs);
    assert!(out.status.success(), "{what}: {}", text(&out.stderr));
    let got = std::fs::read(tmp.path().join("out.safetensors")).unwrap();
    assert!(
        got == local_conversion(),
        "{what}: differs from the local conversion"
    );
}

/// A conversion that must fail: exit 2 (not a signal), the message names a URL of the server and
/// says `says`, nothing at the destination (no output, no temporary). Returns the message.
fn assert_fails(server: &FaultServer, path: &str, extra: &[&str], says: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = convert(&server.url(path), tmp.path(), extra, &[]);
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "not exit 2: {:?} {err}",
        out.status
    );
    assert!(
        err.contains(&format!("http://127.0.0.1:{}/", server.port)),
        "the message names the URL: {err}"
    );
    for s in says {
        assert!(err.contains(s), "the message says `{s}`: {err}");
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "left at the destination: {left:?}");
    err
}

/// The `GET`s asking for bytes of `path` after a strike there: the retry, asking for the rest.
fn resumed_after(server: &FaultServer) -> (Strike, Vec<(u64, Option<u64>)>) {
    let strikes = server.strikes();
    assert_eq!(strikes.len(), 1, "struck once: {strikes:?}");
    let (path, strike) = strikes[0].clone();
    let log = server.log();
    let ranges: Vec<(u64, Option<u64>)> = log
        .iter()
        .filter(|s| s.method == "GET" && s.path == path)
        .filter_map(|s| s.range)
        .collect();
    (strike, ranges)
}

/// With an ETag (the resume asks `If-Match`) and without one (as Python's `http.server`).
#[test]
fn a_reset_mid_body_is_resumed() {
    for etag in [false, true] {
        let root = served_checkpoint();
        let server = FaultServer::start_with(root.path(), Fault::ResetOnce, etag);
        assert_converts(&server, &format!("reset once (ETag: {etag})"), &[]);
        assert_resumed(&server);
    }
}

fn assert_resumed(server: &FaultServer) {
    let (strike, ranges) = resumed_after(server);
    // Asked again for the rest: from where the client's bytes stopped (at most what was sent).
    // Asked again for the rest of the struck range: from at most where the sent half ended
    // (what the client had taken before the reset).
    let asks = ranges
        .iter()
        .filter(|&&(a, b)| {
            b == Some(strike.end - 1) && a >= strike.start && a <= strike.start + strike.sent
        })
        .count();
    assert!(
        asks >= 2,
        "no retry of the struck range {strike:?}: {ranges:?}"
    );
}

#[test]
fn a_short_body_is_resumed_from_where_it_stopped() {
    let root = served_checkpoint();
    let server = FaultServer::start_with(root.path(), Fault::ShortOnce, false);
    assert_converts(&server, "short body once", &[]);
    let (strike, ranges) = resumed_after(&server);
    assert!(
        ranges
            .iter()
            .any(|&(a, b)| a == strike.start + strike.sent && b == Some(strike.end - 1)),
        "no GET from byte {} (struck {strike:?}): {ranges:?}",
        strike.start + strike.sent
    );
}

#[test]
fn a_500_once_is_retried() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::Status500Once);
    assert_converts(&server, "500 once", &[]);
}

/// A reset before any body byte, every time: no try brings anything, so the fifth is the last.
#[test]
fn a_reset_every_time_fails_naming_the_url() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::ResetBeforeBody);
    let err = assert_fails(&server, "ck/", &[], &["/ck/__", "gave up after 5 tries"]);
    assert!(!err.contains("timed out"), "{err}");
}

/// Every body cut midway, the resumed ones too: each try brings new bytes, so the count of tries
/// starts again and the transfer gets there, in more than the 5 tries a request without progress
/// gets; the output equals the local conversion.
#[test]
fn a_transfer_cut_every_time_but_progressing_completes() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::ShortAlways);
    assert_converts(&server, "cut midway every time", &[]);
    let strikes = server.strikes();
    let mut per_range: HashMap<(String, u64), usize> = HashMap::new();
    for (path, s) in &strikes {
        *per_range.entry((path.clone(), s.end)).or_default() += 1;
    }
    let most = per_range.values().copied().max().unwrap_or(0);
    assert!(
        most > 5,
        "a range was cut {most} times; the test needs one cut more than 5 times: {strikes:?}"
    );
}

/// The same server with a deadline already past after the first cut: the read gives up and
/// says it was the deadline, not the count.
#[test]
fn a_progressing_transfer_stops_at_the_deadline_and_says_so() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::ShortAlways);
    let tmp = tempfile::tempdir().unwrap();
    let out = convert(
        &server.url("ck/"),
        tmp.path(),
        &[],
        &[("SHARDSCOPE_RETRY_DEADLINE_MS", "1")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("gave up: still incomplete") && err.contains("SHARDSCOPE_RETRY_DEADLINE_MS"),
        "{err}"
    );
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none());
}

#[test]
fn a_503_every_time_says_503() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::Status503Always);
    let err = assert_fails(
        &server,
        "ck/",
        &[],
        &["/ck/__", "HTTP 503", "gave up after 5 tries"],
    );
    assert!(!err.contains("timed out"), "{err}");
}

#[test]
fn a_stalled_body_times_out_per_io_timeout() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::Stall);
    assert_fails(
        &server,
        "ck/",
        &["--io-timeout", "1"],
        &["/ck/__", "no data for 1 s (--io-timeout)"],
    );
}

#[test]
fn a_wrong_content_range_is_an_error() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::WrongRange);
    assert_fails(&server, "ck/", &[], &["/ck/__"]);
}

#[test]
fn a_redirect_loop_is_an_error() {
    let root = served_checkpoint();
    let server = FaultServer::start(root.path(), Fault::RedirectLoop);
    assert_fails(&server, "ck/", &[], &["/ck/.metadata", "redirect"]);
}

/// HF Hub and presigned URLs redirect to another host: followed; `HF_TOKEN` goes to the
/// Hugging Face endpoint's origin (here the first server) and never to the second.
#[test]
fn a_cross_origin_redirect_is_followed_without_credentials() {
    let root = served_checkpoint();
    let files = FaultServer::start(root.path(), Fault::None);
    let front = FaultServer::start(root.path(), Fault::RedirectTo(files.port));
    let endpoint = format!("http://127.0.0.1:{}", front.port);
    let envs = [
        ("HF_TOKEN", "hf_secret"),
        ("HF_ENDPOINT", endpoint.as_str()),
    ];
    assert_converts(&front, "through a cross-origin redirect", &envs);
    let front_log = front.log();
    assert!(!front_log.is_empty());
    assert!(
        front_log
            .iter()
            .all(|s| s.authorization.as_deref() == Some("Bearer hf_secret")),
        "the token reaches the HF endpoint: {front_log:?}"
    );
    let files_log = files.log();
    assert!(
        files_log
            .iter()
            .any(|s| s.method == "GET" && s.path.ends_with(".distcp"))
    );
    assert!(
        files_log.iter().all(|s| s.authorization.is_none()),
        "credentials sent to another origin: {files_log:?}"
    );
    // Without HF_ENDPOINT naming it, the first server gets no token either.
    let tmp = tempfile::tempdir().unwrap();
    let out = convert(
        &front.url("ck/"),
        tmp.path(),
        &[],
        &[("HF_TOKEN", "hf_secret")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let after: Vec<Seen> = front.log().into_iter().skip(front_log.len()).collect();
    assert!(
        !after.is_empty() && after.iter().all(|s| s.authorization.is_none()),
        "a token sent to a host that is not the HF endpoint: {after:?}"
    );
}

/// The example DCP by one presigned-style URL per file (`verify` reads every tensor's bytes):
/// each file's query.
fn signed_dcp(server: &FaultServer) -> Vec<(String, String)> {
    [".metadata", "__0_0.distcp", "__1_0.distcp"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let query = format!("X-Amz-Date=20260101T000000Z&X-Amz-Signature=sig%2B{i}");
            (format!("/ck/{name}"), query)
        })
        .map(|(path, query)| (format!("{}{}?{query}", server.url(""), &path[1..]), query))
        .collect()
}

/// `verify` of the example DCP given by presigned-style URLs, one per file.
fn verify_signed(server: &FaultServer) -> Output {
    let urls = signed_dcp(server);
    let mut args = vec!["verify"];
    args.extend(urls.iter().map(|(u, _)| u.as_str()));
    shardscope(&args, &[])
}

/// Every request the server saw carried its own file's query, exactly.
fn assert_every_request_signed(server: &FaultServer, what: &str) {
    let want: HashMap<String, String> = signed_dcp(server)
        .into_iter()
        .map(|(url, q)| {
            (
                url.split('?')
                    .next()
                    .unwrap()
                    .trim_start_matches(&server.url(""))
                    .to_owned(),
                q,
            )
        })
        .map(|(path, q)| (format!("/{path}"), q))
        .collect();
    let log = server.log();
    assert!(
        log.iter()
            .any(|s| s.method == "GET" && s.path.ends_with(".distcp")),
        "{what}: {log:?}"
    );
    for seen in &log {
        assert_eq!(
            seen.query.as_ref(),
            want.get(&seen.path),
            "{what}: {} {} was sent with another query",
            seen.method,
            seen.path
        );
    }
}

/// A URL's query is sent on every request of its file, exactly: the first, the retry after a 500,
/// the resume after a reset (the range asked for again from where it stopped); never another
/// file's.
#[test]
fn queries_are_kept_on_retries_and_resumes() {
    for fault in [Fault::ResetOnce, Fault::Status500Once, Fault::None] {
        let root = served_checkpoint();
        let server = FaultServer::start(root.path(), fault);
        let out = verify_signed(&server);
        assert!(out.status.success(), "{fault:?}: {}", text(&out.stderr));
        assert_every_request_signed(&server, &format!("{fault:?}"));
        if fault == Fault::ResetOnce {
            let (strike, ranges) = resumed_after(&server);
            assert!(
                ranges.contains(&(strike.start + strike.sent, Some(strike.end - 1))),
                "resumed from where it stopped: {strike:?} {ranges:?}"
            );
        }
    }
}

/// A redirect to another origin is followed as the server says: the query given is not sent
/// there (a presigned URL's own redirect carries its own query).
#[test]
fn a_query_never_goes_to_another_origin() {
    let root = served_checkpoint();
    let files = FaultServer::start(root.path(), Fault::None);
    let front = FaultServer::start(root.path(), Fault::RedirectTo(files.port));
    let out = verify_signed(&front);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_every_request_signed(&front, "front");
    let files_log = files.log();
    assert!(
        files_log.iter().any(|s| s.path.ends_with(".distcp")),
        "{files_log:?}"
    );
    assert!(
        files_log.iter().all(|s| s.query.is_none()),
        "a query went to another origin: {files_log:?}"
    );
}

/// A sparse file of `size` bytes (no disk used).
fn sparse(path: &Path, size: u64) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::File::create(path).unwrap().set_len(size).unwrap();
}

/// A `.metadata` of 6 GiB is refused before its body is read, with the limit in the message; a
/// 6 GiB junk `.pt` under a 4 GiB address-space limit fails cleanly: never an abort or a signal.
#[test]
fn oversized_files_are_refused_not_aborted() {
    let root = tempfile::tempdir().unwrap();
    sparse(&root.path().join("big/.metadata"), 6 << 30);
    sparse(&root.path().join("junk/model.pt"), 6 << 30);
    let server = FaultServer::start(root.path(), Fault::None);
    let err = assert_fails(
        &server,
        "big/",
        &[],
        &[
            "/big/.metadata",
            "is 6.0 GiB; metadata files over 1.0 GiB are refused (limit)",
        ],
    );
    assert!(!err.contains("memory allocation"), "{err}");
    // Under `ulimit -v` (4 GiB): any buffer sized by the 6 GiB would fail to allocate.
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("out.safetensors");
    let script = format!(
        "ulimit -v 4194304 && exec \"$0\" convert {} -o {} -q",
        server.url("junk/model.pt"),
        dst.display()
    );
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(shardscope_bin())
        .env("SHARDSCOPE_RETRY_BASE_MS", "10")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{:?} {err}", out.status);
    assert!(err.contains(&server.url("junk/model.pt")), "{err}");
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none());
}
