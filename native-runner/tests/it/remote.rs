//! Remote inputs, end to end: the `shardscope` binary reads checkpoints served by a real nginx
//! (HTTP `Range`), by a fault-injecting HTTP server (`tests/remote/faulty_http.py`: bodies cut
//! short, a server that stops mid-transfer) and by moto (an S3 server, signed requests). Every
//! server listens on 127.0.0.1 only and is stopped when its guard drops.
//!
//! Expected values: the same binary on the same checkpoint read locally (local reads are proven
//! against torch elsewhere), byte for byte. Bytes on the wire come from nginx's access log
//! (`$body_bytes_sent`).
//!
//! Without nginx (or, for S3, without moto in `SHARDSCOPE_PYTHON`) the tests print a loud
//! "skipped" line and pass, unless `SHARDSCOPE_REQUIRE_REMOTE=1` (CI sets it; `.ci/run` installs
//! nginx and moto), where a missing server fails them.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::shardscope_bin;
use shardscope_tests::fixtures_dir;

pub(crate) fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn required() -> bool {
    std::env::var_os("SHARDSCOPE_REQUIRE_REMOTE").is_some_and(|v| v == "1")
}

fn skip(what: &str) {
    assert!(
        !required(),
        "SHARDSCOPE_REQUIRE_REMOTE=1 but {what} is missing"
    );
    eprintln!("\n*** skipped: {what} is missing (install it to run the remote tests) ***\n");
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("cannot find a free port")
        .port()
}

fn wait_for_port(port: u16, child: &mut Child, what: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        if let Ok(Some(_)) = child.try_wait() {
            return false; // exited: the port was taken, or a bad config
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} did not listen on 127.0.0.1:{port} within 30 s");
}

/// A child process killed (and reaped) when dropped.
struct Server {
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

// ----- nginx -----------------------------------------------------------------------------------

fn nginx_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SHARDSCOPE_NGINX") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|d| d.join("nginx"))
        .find(|p| p.is_file())
}

/// nginx serving `www/` of a temporary prefix; `bytes.log` holds one line per request:
/// `METHOD URI STATUS BODY_BYTES_SENT`.
pub(crate) struct Nginx {
    _server: Server,
    prefix: tempfile::TempDir,
    port: u16,
    scheme: &'static str,
}

impl Nginx {
    fn start() -> Option<Nginx> {
        Self::start_with("", "")
    }

    /// nginx with `http_extra` in its `http` block and `server_extra` in its `server` block
    /// (`remote_urls`: a `map` and a `location` that refuse requests without their query).
    pub(crate) fn start_with(http_extra: &str, server_extra: &str) -> Option<Nginx> {
        Self::start_full(http_extra, server_extra, None)
    }

    /// nginx over TLS with `tls` = (certificate chain, key), both PEM.
    pub(crate) fn start_tls(tls: (&Path, &Path)) -> Option<Nginx> {
        Self::start_full("", "", Some(tls))
    }

    fn start_full(
        http_extra: &str,
        server_extra: &str,
        tls: Option<(&Path, &Path)>,
    ) -> Option<Nginx> {
        let Some(bin) = nginx_binary() else {
            skip("nginx");
            return None;
        };
        let prefix = tempfile::tempdir().unwrap();
        for d in ["www", "logs", "tmp"] {
            std::fs::create_dir_all(prefix.path().join(d)).unwrap();
        }
        // nginx started as root serves as `nobody`: the served tree must be world-readable.
        {
            use std::os::unix::fs::PermissionsExt as _;
            for d in [prefix.path().to_path_buf(), prefix.path().join("www")] {
                std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        for _attempt in 0..5 {
            let port = free_port();
            let p = prefix.path().display();
            let listen = match tls {
                None => format!("listen 127.0.0.1:{port};"),
                Some((cert, key)) => format!(
                    "listen 127.0.0.1:{port} ssl; ssl_certificate {}; ssl_certificate_key {};",
                    cert.display(),
                    key.display()
                ),
            };
            let conf = format!(
                "daemon off;\nworker_processes 1;\npid {p}/nginx.pid;\nerror_log {p}/logs/error.log;\n\
                 events {{ worker_connections 256; }}\n\
                 http {{\n  log_format bytes '$request_method $uri $status $body_bytes_sent';\n\
                 access_log {p}/logs/bytes.log bytes;\n  client_body_temp_path {p}/tmp;\n  proxy_temp_path {p}/tmp;\n\
                 fastcgi_temp_path {p}/tmp;\n  uwsgi_temp_path {p}/tmp;\n  scgi_temp_path {p}/tmp;\n\
                 {http_extra}\n\
                 server {{ {listen} root {p}/www; {server_extra} }}\n}}\n"
            );
            let conf_path = prefix.path().join("nginx.conf");
            std::fs::write(&conf_path, conf).unwrap();
            let mut child = Command::new(&bin)
                .arg("-c")
                .arg(&conf_path)
                .arg("-p")
                .arg(prefix.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            if wait_for_port(port, &mut child, "nginx") {
                return Some(Nginx {
                    _server: Server { child },
                    prefix,
                    port,
                    scheme: if tls.is_some() { "https" } else { "http" },
                });
            }
            let _ = child.wait();
        }
        panic!("nginx did not start in 5 attempts");
    }

    pub(crate) fn www(&self) -> PathBuf {
        self.prefix.path().join("www")
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}://127.0.0.1:{}/{path}", self.scheme, self.port)
    }

    /// (method, uri, status, body bytes) per request since the last call; the log is emptied.
    pub(crate) fn take_log(&self) -> Vec<(String, String, u16, u64)> {
        let path = self.prefix.path().join("logs/bytes.log");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        std::fs::write(&path, "").unwrap();
        text.lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                assert_eq!(f.len(), 4, "bad access log line {l:?}");
                (
                    f[0].to_owned(),
                    f[1].to_owned(),
                    f[2].parse().unwrap(),
                    f[3].parse().unwrap(),
                )
            })
            .collect()
    }
}

pub(crate) fn shardscope(args: &[&str]) -> Output {
    Command::new(shardscope_bin())
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("cannot run shardscope")
}

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(crate) fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
}

fn dir_is_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).unwrap().next().is_none()
}

/// `inspect URL/` of a DCP reads the `.metadata` and a few bytes of each data file (at most
/// 64 KiB besides the metadata), and prints exactly what a local `inspect` prints.
#[test]
fn inspect_of_a_dcp_url_is_lazy_and_equals_local() {
    let Some(nginx) = Nginx::start() else { return };
    let local = examples_dir().join("fsdp2_dcp");
    copy_dir(&local, &nginx.www().join("ck"));
    let metadata_bytes = std::fs::metadata(local.join(".metadata")).unwrap().len();
    let data_bytes: u64 = ["__0_0.distcp", "__1_0.distcp"]
        .iter()
        .map(|f| std::fs::metadata(local.join(f)).unwrap().len())
        .sum();

    for json in [false, true] {
        let url = nginx.url("ck/");
        let mut args = vec!["inspect", url.as_str()];
        let local_str = local.to_str().unwrap();
        let mut local_args = vec!["inspect", local_str];
        if json {
            args.push("--json");
            local_args.push("--json");
        }
        let remote = shardscope(&args);
        assert_ok(&remote, "inspect URL");
        let log = nginx.take_log();
        let expected = shardscope(&local_args);
        assert_ok(&expected, "inspect local");
        assert_eq!(text(&remote.stdout), text(&expected.stdout));

        let sent: u64 = log.iter().map(|r| r.3).sum();
        assert!(
            log.iter()
                .any(|r| r.0 == "GET" && r.1 == "/ck/.metadata" && r.3 == metadata_bytes),
            "{log:?}"
        );
        assert!(
            sent <= metadata_bytes + 64 * 1024,
            "inspect transferred {sent} bytes (metadata {metadata_bytes}): {log:?}"
        );
        assert!(sent < metadata_bytes + data_bytes / 4, "{log:?}");
    }
    // `.metadata` named directly: the same checkpoint.
    let out = shardscope(&["inspect", &nginx.url("ck/.metadata")]);
    assert_ok(&out, "inspect URL/.metadata");
    assert!(text(&out.stdout).contains("DCP"), "{}", text(&out.stdout));
}

/// `convert URL/` writes the same bytes as `convert LOCAL` (safetensors, torch.save, DCP), for a
/// DCP folder, a single safetensors file and an HF folder by its index URL.
#[test]
fn convert_of_a_url_equals_convert_of_the_local_copy() {
    let Some(nginx) = Nginx::start() else { return };
    let dcp = examples_dir().join("fsdp2_dcp");
    copy_dir(&dcp, &nginx.www().join("ck"));
    let hf = fixtures_dir().join("formats/hf_sharded");
    copy_dir(&hf, &nginx.www().join("hf"));
    let plain = fixtures_dir().join("formats/plain/state_dict.pt");
    std::fs::copy(&plain, nginx.www().join("state_dict.pt")).unwrap();
    let out = tempfile::tempdir().unwrap();

    // A single safetensors file to serve: the local conversion of the DCP.
    let st = out.path().join("model.safetensors");
    assert_ok(
        &shardscope(&["convert", dcp.to_str().unwrap(), "-o", st.to_str().unwrap()]),
        "convert local",
    );
    std::fs::copy(&st, nginx.www().join("model.safetensors")).unwrap();

    let cases: Vec<(String, PathBuf, &str)> = vec![
        (nginx.url("ck/"), dcp.clone(), "x.safetensors"),
        (nginx.url("ck/"), dcp.clone(), "x.pt"),
        (nginx.url("ck/"), dcp.clone(), "x.dcp"),
        (nginx.url("model.safetensors"), st.clone(), "x.pt"),
        (
            nginx.url("hf/model.safetensors.index.json"),
            hf.clone(),
            "x.pt",
        ),
        (nginx.url("state_dict.pt"), plain.clone(), "x.safetensors"),
    ];
    for (i, (url, local, name)) in cases.iter().enumerate() {
        let r = out.path().join(format!("remote{i}"));
        let l = out.path().join(format!("local{i}"));
        std::fs::create_dir_all(&r).unwrap();
        std::fs::create_dir_all(&l).unwrap();
        let extra: &[&str] = if *name == "x.dcp" {
            &["--to", "dcp", "--world-size", "3"]
        } else {
            &[]
        };
        let rout = r.join(name);
        let lout = l.join(name);
        let mut args = vec!["convert", url.as_str(), "-o", rout.to_str().unwrap(), "-q"];
        args.extend_from_slice(extra);
        assert_ok(&shardscope(&args), &format!("convert {url} -> {name}"));
        let mut args = vec![
            "convert",
            local.to_str().unwrap(),
            "-o",
            lout.to_str().unwrap(),
            "-q",
        ];
        args.extend_from_slice(extra);
        assert_ok(
            &shardscope(&args),
            &format!("convert {} -> {name}", local.display()),
        );
        assert_same_tree(&rout, &lout);
    }
    let log = nginx.take_log();
    assert!(log.iter().all(|r| r.2 == 200 || r.2 == 206), "{log:?}");
}

fn assert_same_tree(a: &Path, b: &Path) {
    if a.is_dir() {
        let names = |d: &Path| {
            let mut v: Vec<_> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(a), names(b), "{} vs {}", a.display(), b.display());
        for n in names(a) {
            assert_same_tree(&a.join(&n), &b.join(&n));
        }
    } else {
        let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
        assert!(!x.is_empty(), "{} is empty", a.display());
        assert!(x == y, "{} differs from {}", a.display(), b.display());
    }
}

/// A DCP of 8 x 2 MiB tensors (written by the binary from a safetensors file): `convert URL/`
/// transfers each tensor's bytes once (its `torch.save` item's zip ends, not the whole item, to
/// find them; nothing read twice): at most 10% over the data files' size.
#[test]
fn convert_of_a_url_reads_each_tensor_once() {
    use shardscope_core::DType;
    use shardscope_core::formats::write::safetensors::{SafetensorsWriter, TensorSpec};

    let Some(nginx) = Nginx::start() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (rows, cols) = (1024u64, 512u64); // 2 MiB of float32
    let specs: Vec<TensorSpec> = (0..8)
        .map(|i| TensorSpec {
            name: format!("layers.{i}.weight"),
            dtype: DType::Float32,
            shape: vec![rows, cols],
        })
        .collect();
    let st = tmp.path().join("in.safetensors");
    {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&st).unwrap());
        let mut writer = SafetensorsWriter::new(&mut file, &specs, None).unwrap();
        let order: Vec<String> = writer.data_order().map(str::to_owned).collect();
        for (k, name) in order.iter().enumerate() {
            let data: Vec<u8> = (0..rows * cols)
                .flat_map(|i| ((i * 7 + k as u64 * 1_000_003) as f32).to_le_bytes())
                .collect();
            writer.write_tensor(name, &data).unwrap();
        }
        writer.finish().unwrap();
    }
    let dcp = nginx.www().join("big");
    assert_ok(
        &shardscope(&[
            "convert",
            st.to_str().unwrap(),
            "-o",
            dcp.to_str().unwrap(),
            "--to",
            "dcp",
            "--world-size",
            "2",
            "-q",
        ]),
        "convert to DCP",
    );
    let data_bytes: u64 = std::fs::read_dir(&dcp)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != ".metadata")
        .map(|e| e.metadata().unwrap().len())
        .sum();
    let metadata_bytes = std::fs::metadata(dcp.join(".metadata")).unwrap().len();
    assert!(data_bytes > 16 << 20, "{data_bytes}");

    let (r, l) = (tmp.path().join("r"), tmp.path().join("l"));
    std::fs::create_dir_all(&r).unwrap();
    std::fs::create_dir_all(&l).unwrap();
    nginx.take_log();
    let url = nginx.url("big/");
    let rout = r.join("x.safetensors");
    assert_ok(
        &shardscope(&["convert", &url, "-o", rout.to_str().unwrap(), "-q"]),
        "convert URL",
    );
    let log = nginx.take_log();
    let lout = l.join("x.safetensors");
    assert_ok(
        &shardscope(&[
            "convert",
            dcp.to_str().unwrap(),
            "-o",
            lout.to_str().unwrap(),
            "-q",
        ]),
        "convert local",
    );
    assert_same_tree(&rout, &lout);
    let sent: u64 = log.iter().map(|r| r.3).sum();
    assert!(
        sent <= metadata_bytes + data_bytes + data_bytes / 10,
        "convert transferred {sent} bytes for {data_bytes} bytes of data files: {log:?}"
    );
}

/// `diff` and `verify` read URLs; a difference is still found over HTTP.
#[test]
fn diff_and_verify_take_urls() {
    let Some(nginx) = Nginx::start() else { return };
    let dcp = examples_dir().join("fsdp2_dcp");
    copy_dir(&dcp, &nginx.www().join("ck"));
    let url = nginx.url("ck/");
    let out = shardscope(&["verify", &url, "-q"]);
    assert_ok(&out, "verify URL");
    assert!(
        text(&out.stdout).contains("verify ok"),
        "{}",
        text(&out.stdout)
    );
    let out = shardscope(&["diff", &url, dcp.to_str().unwrap(), "-q"]);
    assert_ok(&out, "diff URL LOCAL");
    assert!(
        text(&out.stdout).contains("diff ok"),
        "{}",
        text(&out.stdout)
    );

    // A different checkpoint: diff exits 1 over HTTP too.
    let tmp = tempfile::tempdir().unwrap();
    let st = tmp.path().join("m.safetensors");
    assert_ok(
        &shardscope(&[
            "convert",
            dcp.to_str().unwrap(),
            "-o",
            st.to_str().unwrap(),
            "-q",
        ]),
        "convert",
    );
    let mut bytes = std::fs::read(&st).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(nginx.www().join("changed.safetensors"), &bytes).unwrap();
    let out = shardscope(&[
        "diff",
        &nginx.url("changed.safetensors"),
        st.to_str().unwrap(),
        "-q",
    ]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let out = shardscope(&["doctor", &url]);
    assert_ok(&out, "doctor URL");
}

/// A missing folder or file: exit 2, and the message names the URL and says "not found"; a
/// conversion from it leaves nothing behind.
#[test]
fn missing_urls_are_named_in_the_error() {
    let Some(nginx) = Nginx::start() else { return };
    for (path, named) in [
        ("nope/", "nope/.metadata"),
        ("nope.safetensors", "nope.safetensors"),
    ] {
        let url = nginx.url(path);
        let out = shardscope(&["inspect", &url]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains(&nginx.url(named)) && err.contains("not found"),
            "{err}"
        );
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("out.safetensors");
        let out = shardscope(&["convert", &url, "-o", dst.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("not found"),
            "{}",
            text(&out.stderr)
        );
        assert!(dir_is_empty(tmp.path()));
    }
    // A folder named without its trailing `/`: a hint says how.
    copy_dir(&examples_dir().join("fsdp2_dcp"), &nginx.www().join("ck2"));
    let out = shardscope(&["inspect", &nginx.url("ck2")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains(&nginx.url("ck2")) && err.contains("ends with `/`"),
        "{err}"
    );
    // A data file named by `.metadata` but absent on the server.
    copy_dir(&examples_dir().join("fsdp2_dcp"), &nginx.www().join("ck"));
    std::fs::remove_file(nginx.www().join("ck/__1_0.distcp")).unwrap();
    let out = shardscope(&["inspect", &nginx.url("ck/")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains(&nginx.url("ck/__1_0.distcp")) && err.contains("not found"),
        "{err}"
    );
}

// ----- faults ----------------------------------------------------------------------------------

/// `tests/remote/faulty_http.py ROOT MODE [N]`, on the port it prints.
/// `dst` holds the bytes the same conversion of the bundled example gives from the local files
/// (converted into `scratch`).
fn assert_equals_local(dst: &Path, scratch: &Path) {
    let local = scratch.join("local.safetensors");
    let src = examples_dir().join("fsdp2_dcp");
    assert_ok(
        &shardscope(&[
            "convert",
            src.to_str().unwrap(),
            "-o",
            local.to_str().unwrap(),
            "-q",
        ]),
        "convert local",
    );
    assert!(std::fs::read(dst).unwrap() == std::fs::read(&local).unwrap());
}

fn faulty_server(root: &Path, mode: &[&str]) -> (Server, u16) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/remote/faulty_http.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(root)
        .args(mode)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("cannot run python3");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .trim()
        .strip_prefix("ready ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("faulty_http.py said {line:?}"));
    let mut server = Server { child };
    assert!(wait_for_port(port, &mut server.child, "faulty_http.py"));
    (server, port)
}

/// Transient 503s are retried (the output equals the local one); a body cut short on every try
/// (resumed, cut again, until the 5 tries are spent), and a server that stops after indexing:
/// `convert` fails with a message naming the URL, and leaves nothing at the destination (no
/// output, no temporary file). One-off faults, stalls and the rest: `remote_faults`.
#[test]
fn faults_mid_convert_fail_cleanly() {
    let root = tempfile::tempdir().unwrap();
    copy_dir(&examples_dir().join("fsdp2_dcp"), &root.path().join("ck"));
    // First the server itself, serving honestly: the conversion works.
    {
        let (_server, port) = faulty_server(root.path(), &["ok"]);
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("out.safetensors");
        let url = format!("http://127.0.0.1:{port}/ck/");
        assert_ok(
            &shardscope(&["convert", &url, "-o", dst.to_str().unwrap(), "-q"]),
            "convert from the honest server",
        );
    }
    // Every other GET answers 503: retried with backoff, the output equals the local one.
    {
        let (_server, port) = faulty_server(root.path(), &["flaky"]);
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("out.safetensors");
        let url = format!("http://127.0.0.1:{port}/ck/");
        assert_ok(
            &shardscope(&["convert", &url, "-o", dst.to_str().unwrap(), "-q"]),
            "convert from a server failing every other request",
        );
        assert_equals_local(&dst, tmp.path());
    }
    // Every body cut short (half of it, then the connection closed), the resumed ones too: each
    // try brings new bytes, so the count of tries starts again and the conversion gets there
    // (issue 37: retries count progress); the output equals the local one.
    {
        let (_server, port) = faulty_server(root.path(), &["short"]);
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("out.safetensors");
        let url = format!("http://127.0.0.1:{port}/ck/");
        // Short waits between tries (10 ms, doubling): many tries, none slow.
        let out = Command::new(shardscope_bin())
            .args(["convert", &url, "-o", dst.to_str().unwrap(), "-q"])
            .env_remove("RUST_BACKTRACE")
            .env("SHARDSCOPE_RETRY_BASE_MS", "10")
            .output()
            .expect("cannot run shardscope");
        assert_ok(&out, "convert from a server cutting every body short");
        assert_equals_local(&dst, tmp.path());
    }
    // Indexing reads `.metadata` (1 GET) and 4 bytes of each data file (2 GETs): the fault
    // strikes when tensor data is read.
    {
        let (mode, says) = (&["die", "3"][..], "cannot connect");
        let (_server, port) = faulty_server(root.path(), mode);
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("out.safetensors");
        let url = format!("http://127.0.0.1:{port}/ck/");
        let started = Instant::now();
        let out = shardscope(&["convert", &url, "-o", dst.to_str().unwrap(), "-q"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{mode:?}: {err}");
        assert!(
            err.contains(&format!("http://127.0.0.1:{port}/ck/__")),
            "{mode:?}: the message names the data file's URL: {err}"
        );
        assert!(err.contains(says), "{mode:?}: {err}");
        assert!(
            dir_is_empty(tmp.path()),
            "{mode:?}: something was left at the destination"
        );
        assert!(
            started.elapsed() < Duration::from_mins(2),
            "{mode:?}: retries took too long"
        );
    }
}

// ----- S3 (moto) -------------------------------------------------------------------------------

struct Moto {
    _server: Server,
    port: u16,
    python: PathBuf,
}

fn s3_env(cmd: &mut Command, port: u16) -> &mut Command {
    cmd.env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_PROFILE")
        .env_remove("RUST_BACKTRACE")
}

impl Moto {
    fn start() -> Option<Moto> {
        let Some(python) = shardscope_tests::torch_python() else {
            skip("the test venv (SHARDSCOPE_PYTHON)");
            return None;
        };
        let has_moto = Command::new(&python)
            .args(["-c", "import moto.server, boto3"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !has_moto {
            skip(
                "moto[server] in SHARDSCOPE_PYTHON (pip install -r tests/fixtures/requirements.txt)",
            );
            return None;
        }
        for _attempt in 0..5 {
            let port = free_port();
            let mut child = Command::new(&python)
                .args([
                    "-m",
                    "moto.server",
                    "-H",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("cannot start moto");
            if wait_for_port(port, &mut child, "moto") {
                return Some(Moto {
                    _server: Server { child },
                    port,
                    python,
                });
            }
            let _ = child.wait();
        }
        panic!("moto did not start in 5 attempts");
    }

    fn upload(&self, bucket: &str, prefix: &str, folder: &Path) {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/remote/s3_upload.py");
        let mut cmd = Command::new(&self.python);
        cmd.arg(&script)
            .arg(format!("http://127.0.0.1:{}", self.port))
            .args([bucket, prefix])
            .arg(folder);
        let out = s3_env(&mut cmd, self.port).output().unwrap();
        assert_ok(&out, "s3_upload.py");
    }

    fn shardscope(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(shardscope_bin());
        cmd.args(args);
        s3_env(&mut cmd, self.port).output().unwrap()
    }
}

/// `inspect` and `convert` of `s3://bucket/prefix/` (a listed prefix) and of one object equal
/// the local runs; a missing object or prefix is "not found" with its URL.
#[test]
fn s3_prefixes_and_objects_read_like_local_files() {
    let Some(moto) = Moto::start() else { return };
    let dcp = examples_dir().join("fsdp2_dcp");
    moto.upload("ckpts", "run1/step10", &dcp);
    let plain_dir = fixtures_dir().join("formats/plain");
    moto.upload("ckpts", "plain", &plain_dir);

    let out = moto.shardscope(&["inspect", "s3://ckpts/run1/step10/"]);
    assert_ok(&out, "inspect s3://");
    let local = shardscope(&["inspect", dcp.to_str().unwrap()]);
    assert_eq!(text(&out.stdout), text(&local.stdout));

    let tmp = tempfile::tempdir().unwrap();
    for (url, local, name) in [
        ("s3://ckpts/run1/step10/", dcp.clone(), "a.safetensors"),
        (
            "s3://ckpts/plain/state_dict.pt",
            plain_dir.join("state_dict.pt"),
            "b.safetensors",
        ),
    ] {
        std::fs::create_dir_all(tmp.path().join("r")).unwrap();
        std::fs::create_dir_all(tmp.path().join("l")).unwrap();
        let r = tmp.path().join("r").join(name);
        let l = tmp.path().join("l").join(name);
        assert_ok(
            &moto.shardscope(&["convert", url, "-o", r.to_str().unwrap(), "-q"]),
            &format!("convert {url}"),
        );
        assert_ok(
            &shardscope(&[
                "convert",
                local.to_str().unwrap(),
                "-o",
                l.to_str().unwrap(),
                "-q",
            ]),
            "convert local",
        );
        assert_same_tree(&r, &l);
    }

    for (url, named) in [
        (
            "s3://ckpts/run1/missing.safetensors",
            "s3://ckpts/run1/missing.safetensors",
        ),
        ("s3://ckpts/nothing-here/", "s3://ckpts/nothing-here/"),
    ] {
        let out = moto.shardscope(&["inspect", url]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(named) && err.contains("not found"), "{err}");
    }
}

// ----- torch.save files by range ---------------------------------------------------------------

/// Writes `path` with real torch: 4 x 8 MiB float32 tensors, a bfloat16 and a float16 tensor, a
/// small bias and a non-tensor value (~33 MiB in all, a few KiB of metadata). Returns the sizes of
/// `data.pkl` and of the zip tail from the central directory on (as Python's zipfile sees them),
/// or None without torch.
fn write_big_torch_save(path: &Path) -> Option<(u64, u64)> {
    write_torch_save(path, 4, 1024, 2048)
}

/// [`write_big_torch_save`] with `layers` float32 tensors of `rows x cols`.
fn write_torch_save(path: &Path, layers: u32, rows: u32, cols: u32) -> Option<(u64, u64)> {
    let Some(python) = shardscope_tests::torch_python() else {
        skip("the test venv (SHARDSCOPE_PYTHON)");
        return None;
    };
    let script = r#"
import os, sys, zipfile, torch
torch.manual_seed(0)
n, rows, cols = (int(a) for a in sys.argv[2:5])
sd = {f"layers.{i}.weight": torch.randn(rows, cols) for i in range(n)}
sd["emb.weight"] = torch.randn(256, 64).to(torch.bfloat16)
sd["head.weight"] = torch.randn(64, 32).to(torch.float16)
sd["head.bias"] = torch.randn(32)
sd["step"] = 7
torch.save(sd, sys.argv[1])
with zipfile.ZipFile(sys.argv[1]) as z:
    pkl = [i for i in z.infolist() if i.filename.endswith("/data.pkl")][0]
    print(pkl.file_size, os.path.getsize(sys.argv[1]) - z.start_dir)
"#;
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(path)
        .args([layers, rows, cols].map(|v| v.to_string()))
        .output()
        .unwrap();
    assert_ok(&out, "torch.save");
    let line = text(&out.stdout);
    let mut f = line.split_whitespace().map(|s| s.parse::<u64>().unwrap());
    Some((f.next().unwrap(), f.next().unwrap()))
}

/// `inspect URL` of a 33 MiB `torch.save` file fetches its end records, central directory, local
/// headers and data.pkl only (at most 256 KiB more than data.pkl and the directory), and prints
/// what a local `inspect` prints; `inspect --values` and `convert` to safetensors equal the local
/// runs byte for byte.
#[test]
fn inspect_of_a_torch_save_url_reads_only_its_metadata() {
    let Some(nginx) = Nginx::start() else { return };
    let local = nginx.www().join("model.pt");
    let Some((pkl_bytes, tail_bytes)) = write_big_torch_save(&local) else {
        return;
    };
    let size = std::fs::metadata(&local).unwrap().len();
    assert!(size >= 32 << 20, "{size}");
    let url = nginx.url("model.pt");
    let local_str = local.to_str().unwrap();
    nginx.take_log();
    for extra in [&[][..], &["--json"][..]] {
        let mut args = vec!["inspect", url.as_str()];
        args.extend_from_slice(extra);
        let remote = shardscope(&args);
        assert_ok(&remote, "inspect URL");
        let log = nginx.take_log();
        let mut args = vec!["inspect", local_str];
        args.extend_from_slice(extra);
        let expected = shardscope(&args);
        assert_ok(&expected, "inspect local");
        assert_eq!(text(&remote.stdout), text(&expected.stdout));
        assert!(text(&remote.stdout).contains("layers.3.weight"));
        let sent: u64 = log.iter().map(|r| r.3).sum();
        eprintln!(
            "inspect {extra:?}: {sent} bytes in {} requests (data.pkl {pkl_bytes}, directory and end records {tail_bytes}, file {size}): {log:?}",
            log.len()
        );
        assert!(
            sent <= pkl_bytes + tail_bytes + (256 << 10),
            "inspect transferred {sent} bytes of {size} (data.pkl {pkl_bytes}, tail {tail_bytes}): {log:?}"
        );
        assert!(log.iter().all(|r| r.2 == 200 || r.2 == 206), "{log:?}");
    }

    // `doctor` opens the archive twice (index, then the pickle's globals): twice the metadata.
    let remote = shardscope(&["doctor", &url]);
    let log = nginx.take_log();
    let expected = shardscope(&["doctor", local_str]);
    assert_eq!(remote.status.code(), expected.status.code());
    assert_eq!(
        text(&remote.stdout).replace(&url, "X"),
        text(&expected.stdout).replace(local_str, "X")
    );
    let sent: u64 = log.iter().map(|r| r.3).sum();
    eprintln!("doctor: {sent} bytes in {} requests", log.len());
    assert!(
        sent <= 2 * (pkl_bytes + tail_bytes + (256 << 10)),
        "doctor transferred {sent} bytes of {size}: {log:?}"
    );

    // Values: every tensor byte is read, each once (not the whole file twice).
    let remote = shardscope(&["inspect", &url, "--values"]);
    assert_ok(&remote, "inspect --values URL");
    let log = nginx.take_log();
    let expected = shardscope(&["inspect", local_str, "--values"]);
    assert_ok(&expected, "inspect --values local");
    assert_eq!(text(&remote.stdout), text(&expected.stdout));
    let sent: u64 = log.iter().map(|r| r.3).sum();
    assert!(sent <= size + size / 10, "{sent} bytes for {size}: {log:?}");

    let tmp = tempfile::tempdir().unwrap();
    let (r, l) = (tmp.path().join("r"), tmp.path().join("l"));
    std::fs::create_dir_all(&r).unwrap();
    std::fs::create_dir_all(&l).unwrap();
    let (rout, lout) = (r.join("x.safetensors"), l.join("x.safetensors"));
    assert_ok(
        &shardscope(&["convert", &url, "-o", rout.to_str().unwrap(), "-q"]),
        "convert URL",
    );
    let log = nginx.take_log();
    assert_ok(
        &shardscope(&["convert", local_str, "-o", lout.to_str().unwrap(), "-q"]),
        "convert local",
    );
    assert_same_tree(&rout, &lout);
    let sent: u64 = log.iter().map(|r| r.3).sum();
    assert!(sent <= size + size / 10, "{sent} bytes for {size}: {log:?}");
}

/// A folder of per-rank `torch.save` files by `s3://` prefix reads like the local folder; each
/// file is read by range (its metadata), not whole.
#[test]
fn s3_folder_of_rank_files_reads_like_the_local_folder() {
    let Some(moto) = Moto::start() else { return };
    let ranks = fixtures_dir().join("fsdp2_optim/ws3");
    moto.upload("ckpts", "ranks", &ranks);
    for extra in [&[][..], &["--json"][..], &["--values"][..]] {
        let mut args = vec!["inspect", "s3://ckpts/ranks/"];
        args.extend_from_slice(extra);
        let out = moto.shardscope(&args);
        assert_ok(&out, "inspect s3:// folder of rank files");
        let mut args = vec!["inspect", ranks.to_str().unwrap()];
        args.extend_from_slice(extra);
        let local = shardscope(&args);
        assert_ok(&local, "inspect local rank files");
        assert_eq!(text(&out.stdout), text(&local.stdout), "{extra:?}");
        assert!(text(&out.stdout).contains("model.embed.weight"));
    }
}

/// `s3://` without credentials (none in the environment, the instance metadata endpoint
/// unreachable): exit 2 soon, naming the URL and saying to check credentials. A bucket that does
/// not exist: exit 2, "the bucket does not exist", with the URL.
#[test]
fn s3_without_credentials_or_bucket_fails_clearly_and_soon() {
    let Some(moto) = Moto::start() else { return };
    moto.upload("ckpts", "plain", &fixtures_dir().join("formats/plain"));
    let url = "s3://ckpts/plain/state_dict.pt";
    let mut cmd = Command::new(shardscope_bin());
    cmd.args(["inspect", url]);
    s3_env(&mut cmd, moto.port)
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_SKIP_SIGNATURE")
        .env_remove("AWS_WEB_IDENTITY_TOKEN_FILE")
        .env_remove("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        .env_remove("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        // Nothing listens there: off the cloud, the metadata endpoint does not answer either.
        .env(
            "AWS_METADATA_ENDPOINT",
            format!("http://127.0.0.1:{}", free_port()),
        );
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(url) && err.contains("check credentials") && err.contains("AWS_ACCESS_KEY_ID"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_mins(1),
        "took {:?}",
        started.elapsed()
    );
    // With credentials the same URL reads.
    assert_ok(
        &moto.shardscope(&["inspect", url]),
        "inspect with credentials",
    );

    for url in ["s3://no-such-bucket/x/", "s3://no-such-bucket/x.pt"] {
        let out = moto.shardscope(&["inspect", url]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(url) && err.contains("not found"), "{err}");
    }
    let out = moto.shardscope(&["inspect", "s3://no-such-bucket/x/"]);
    assert!(
        text(&out.stderr).contains("bucket does not exist"),
        "{}",
        text(&out.stderr)
    );
}

/// 120 storages of 256 KiB each (too far apart to share a request): `inspect URL` still fetches
/// only the metadata and one local header per storage (fetched concurrently), and equals the
/// local run.
#[test]
fn inspect_of_a_torch_save_url_with_many_storages() {
    let Some(nginx) = Nginx::start() else { return };
    let local = nginx.www().join("many.pt");
    let Some((pkl_bytes, tail_bytes)) = write_torch_save(&local, 120, 64, 1024) else {
        return;
    };
    let size = std::fs::metadata(&local).unwrap().len();
    let url = nginx.url("many.pt");
    nginx.take_log();
    let remote = shardscope(&["inspect", &url]);
    assert_ok(&remote, "inspect URL");
    let log = nginx.take_log();
    let expected = shardscope(&["inspect", local.to_str().unwrap()]);
    assert_eq!(text(&remote.stdout), text(&expected.stdout));
    assert!(text(&remote.stdout).contains("layers.119.weight"));
    let sent: u64 = log.iter().map(|r| r.3).sum();
    eprintln!(
        "inspect: {sent} bytes in {} requests (data.pkl {pkl_bytes}, directory {tail_bytes}, file {size})",
        log.len()
    );
    assert!(
        sent <= pkl_bytes + tail_bytes + (256 << 10),
        "{sent} bytes of {size}: {log:?}"
    );
    assert!(log.len() <= 120 + 8, "{} requests", log.len());
}

/// The `Source` contract (`shardscope_core::source::conformance`, which memory, mmap and the
/// viewer's files pass too) holds for objects behind a real HTTP server: every sample file (empty,
/// one byte, odd sizes, larger than a read-ahead block) by its URL.
#[test]
fn http_objects_keep_the_source_contract() {
    use shardscope_core::source::conformance::{sample_files, violations};
    let Some(nginx) = Nginx::start() else { return };
    let www = nginx.www().join("conformance");
    for (name, bytes) in sample_files() {
        let path = www.join(&name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let url = nginx.url(&format!("conformance/{name}"));
        let source = shardscope_runner::remote::RemoteSource::open(&url, false)
            .unwrap_or_else(|e| panic!("{url}: {e:#}"));
        let base = name.rsplit('/').next().unwrap().to_owned();
        let files = std::collections::BTreeMap::from([(base, bytes)]);
        assert_eq!(violations(&source, &files), Vec::<String>::new(), "{url}");
    }
}
