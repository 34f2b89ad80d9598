//! HTTPS inputs: the TLS stack (rustls on `ring`, see native-runner/Cargo.toml) against a real
//! nginx serving TLS with a certificate from a throwaway authority
//! (`tests/remote/make_tls_cert.py`). The authority is trusted through `SSL_CERT_FILE`, as a user
//! behind a company proxy does; without it, the same URL is refused with the reason, quickly.
//!
//! Expected values: the conversion of the local copy (local reads are proven against torch
//! elsewhere), byte for byte.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::{python, shardscope_bin};
use crate::remote::{Nginx, assert_ok, copy_dir, examples_dir, text};

/// A certificate authority, and nginx serving TLS with a certificate it signed for 127.0.0.1.
fn start(certs: &Path) -> Option<Nginx> {
    let Some(py) = python() else {
        assert!(
            std::env::var_os("SHARDSCOPE_REQUIRE_REMOTE").is_none_or(|v| v != "1"),
            "SHARDSCOPE_REQUIRE_REMOTE=1 but no SHARDSCOPE_PYTHON to make the test certificate"
        );
        eprintln!("\n*** skipped: no Python with `cryptography` to make a test certificate ***\n");
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/remote/make_tls_cert.py");
    let out = Command::new(py).arg(script).arg(certs).output().unwrap();
    assert!(
        out.status.success(),
        "make_tls_cert.py: {}",
        text(&out.stderr)
    );
    Nginx::start_tls((&certs.join("server.pem"), &certs.join("server.key")))
}

fn run(args: &[&str], trust: Option<&Path>) -> Output {
    let mut cmd = Command::new(shardscope_bin());
    cmd.args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("SSL_CERT_DIR");
    match trust {
        Some(ca) => cmd.env("SSL_CERT_FILE", ca),
        None => cmd.env_remove("SSL_CERT_FILE"),
    };
    cmd.output().expect("cannot run shardscope")
}

#[test]
fn an_https_url_converts_as_the_local_copy() {
    let certs = tempfile::tempdir().unwrap();
    let Some(nginx) = start(certs.path()) else {
        return;
    };
    let dcp = examples_dir().join("fsdp2_dcp");
    copy_dir(&dcp, &nginx.www().join("ck"));
    let url = nginx.url("ck/");
    assert!(url.starts_with("https://"), "{url}");
    let out = tempfile::tempdir().unwrap();
    let (remote, local) = (
        out.path().join("r.safetensors"),
        out.path().join("l.safetensors"),
    );
    let ca = certs.path().join("ca.pem");
    assert_ok(
        &run(
            &["convert", &url, "-o", remote.to_str().unwrap(), "-q"],
            Some(&ca),
        ),
        "convert over https",
    );
    assert_ok(
        &run(
            &[
                "convert",
                dcp.to_str().unwrap(),
                "-o",
                local.to_str().unwrap(),
                "-q",
            ],
            None,
        ),
        "convert local",
    );
    assert!(
        std::fs::read(&remote).unwrap() == std::fs::read(&local).unwrap(),
        "the conversion over https differs from the local one"
    );
}

/// A server whose certificate nobody trusts is refused with the reason, without retries that run
/// for minutes, without a panic and without an output file.
#[test]
fn an_untrusted_certificate_is_refused_with_the_reason() {
    let certs = tempfile::tempdir().unwrap();
    let Some(nginx) = start(certs.path()) else {
        return;
    };
    copy_dir(&examples_dir().join("fsdp2_dcp"), &nginx.www().join("ck"));
    // Trust another authority only (a fresh one), so the machine's own store does not matter.
    let other = tempfile::tempdir().unwrap();
    let py = python().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/remote/make_tls_cert.py");
    assert!(
        Command::new(py)
            .arg(script)
            .arg(other.path())
            .status()
            .unwrap()
            .success()
    );
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("x.safetensors");
    let started = Instant::now();
    let got = run(
        &["convert", &nginx.url("ck/"), "-o", dst.to_str().unwrap()],
        Some(&other.path().join("ca.pem")),
    );
    let stderr = text(&got.stderr);
    assert!(
        !got.status.success(),
        "an untrusted server was read:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.to_lowercase().contains("certificate"),
        "the error does not say the certificate is the problem:\n{stderr}"
    );
    assert!(
        stderr.contains("127.0.0.1"),
        "the error does not name the server:\n{stderr}"
    );
    assert!(
        stderr.contains("SSL_CERT_FILE"),
        "the error does not say how to trust it:\n{stderr}"
    );
    assert!(!dst.exists(), "an output was left behind");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "a certificate error was retried for {:?}",
        started.elapsed()
    );
}
