//! URLs with a query (presigned S3/GCS URLs, Azure SAS) and checkpoints given as several URLs
//! (per-rank files, a DCP's `.metadata` and every `.distcp`), end to end against nginx.
//!
//! nginx refuses (403) every request under `/p/` whose query is not exactly the one signed for
//! that file (a `map` from the path to its query), so a query dropped, re-encoded or sent for
//! another file fails the commands; its access log shows that every request was answered.
//!
//! Expected values: the same command on the same local files (consistency), and torch's own
//! data: torch-written fixtures already proven against torch (`formats_read`, `diff_verify`):
//! the FSDP1 FULL_STATE_DICT file equals the HF safetensors of the same weights (`diff` exit 0,
//! 7 tensors matched), and every fixture `verify`s.
//!
//! Without nginx the tests print "skipped" and pass, unless `SHARDSCOPE_REQUIRE_REMOTE=1`.

#![allow(clippy::unwrap_used)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::remote::{Nginx, assert_ok, copy_dir, shardscope, text};
use shardscope_tests::fixtures_dir;

fn formats() -> PathBuf {
    fixtures_dir().join("formats")
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A presigned-style query for `file` (its signature is unique per file and never printed).
fn query_of(file: &str) -> String {
    let mut hex = String::new();
    for b in file.bytes() {
        write!(hex, "{b:02x}").unwrap();
    }
    let sig: String = hex.chars().rev().collect();
    format!(
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=SIG{sig}"
    )
}

fn signature_of(file: &str) -> String {
    let q = query_of(file);
    q[q.find("X-Amz-Signature=").unwrap() + "X-Amz-Signature=".len()..].to_owned()
}

/// A container-wide query (an Azure container SAS): every file under `/sas/` needs exactly it.
const SAS: &str = "sv=2024-11-04&sr=c&sp=r&se=2030-01-01T00%3A00%3A00Z&sig=SASsignatureSECRET%3D";

/// The files served under `/p/` (signed) and `/open/` (plain): (served path, local file).
fn served() -> Vec<(String, PathBuf)> {
    let f = formats();
    let mut out = Vec::new();
    for name in [
        "rank0_model.pt",
        "rank1_model.pt",
        "rank0_optim.pt",
        "rank1_optim.pt",
    ] {
        out.push((format!("fsdp2/{name}"), f.join("fsdp2").join(name)));
    }
    for name in [".metadata", "__0_0.distcp", "__1_0.distcp"] {
        out.push((format!("dcp/{name}"), f.join("dcp_torch_save").join(name)));
    }
    out.push((
        "fsdp1/rank0_full.pt".to_owned(),
        f.join("fsdp1_orig0/rank0_full.pt"),
    ));
    out
}

/// nginx serving `served()` twice: under `/p/`, where each file answers only to its own exact
/// query, and under `/open/`, without any.
fn start() -> Option<Nginx> {
    let mut map = String::from("map $uri $signed_query {\n  default \"no-such-file\";\n");
    for (path, _) in served() {
        writeln!(map, "  \"/p/{path}\" \"{}\";", query_of(&path)).unwrap();
    }
    map.push_str("}\n");
    let nginx = Nginx::start_with(
        &map,
        &format!(
            "location /p/ {{ if ($args != $signed_query) {{ return 403; }} }}\n\
             location /sas/ {{ if ($args != \"{SAS}\") {{ return 403; }} }}"
        ),
    )?;
    for (path, local) in served() {
        for top in ["p", "open", "sas"] {
            let to = nginx.www().join(top).join(&path);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&local, &to).unwrap();
        }
    }
    Some(nginx)
}

fn signed(nginx: &Nginx, path: &str) -> String {
    format!("{}?{}", nginx.url(&format!("p/{path}")), query_of(path))
}

fn run(args: &[&str]) -> Output {
    shardscope(args)
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out.stdout)))
}

/// Every request nginx saw since the last call was answered with the file (200/206).
fn assert_all_answered(nginx: &Nginx, what: &str) {
    let log = nginx.take_log();
    assert!(!log.is_empty(), "{what}: no request reached nginx");
    assert!(
        log.iter().all(|r| r.2 == 200 || r.2 == 206),
        "{what}: refused requests (a query dropped or changed?): {log:?}"
    );
}

/// Per-rank FSDP2 files and a DCP, each file by its own presigned URL: the same `inspect --json`
/// and `verify --json` as the local files; every request carried its file's exact query.
#[test]
fn presigned_files_read_as_the_local_files() {
    let Some(nginx) = start() else { return };
    let f = formats();
    let cases: Vec<(Vec<&str>, Vec<PathBuf>)> = vec![
        (
            vec!["fsdp2/rank0_model.pt", "fsdp2/rank1_model.pt"],
            vec![
                f.join("fsdp2/rank0_model.pt"),
                f.join("fsdp2/rank1_model.pt"),
            ],
        ),
        (
            vec!["fsdp2/rank0_optim.pt", "fsdp2/rank1_optim.pt"],
            vec![
                f.join("fsdp2/rank0_optim.pt"),
                f.join("fsdp2/rank1_optim.pt"),
            ],
        ),
        (
            vec!["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"],
            vec![f.join("dcp_torch_save")],
        ),
        (
            vec!["fsdp1/rank0_full.pt"],
            vec![f.join("fsdp1_orig0/rank0_full.pt")],
        ),
    ];
    for (files, local) in cases {
        let urls: Vec<String> = files.iter().map(|n| signed(&nginx, n)).collect();
        for command in ["inspect", "verify"] {
            let mut args = vec![command, "--json"];
            args.extend(urls.iter().map(String::as_str));
            let remote = run(&args);
            assert_ok(&remote, &format!("{command} {files:?}"));
            assert_all_answered(&nginx, &format!("{command} {files:?}"));
            let mut local_args = vec![command, "--json"];
            local_args.extend(local.iter().map(|x| p(x)));
            let expected = run(&local_args);
            assert_ok(&expected, &format!("{command} local {local:?}"));
            let (mut got, mut want) = (json(&remote), json(&expected));
            // Labels name the inputs: URLs (queries as `?…`) on one side, paths on the other.
            if command == "verify" {
                let shown: Vec<String> = files
                    .iter()
                    .map(|n| format!("{}?…", nginx.url(&format!("p/{n}"))))
                    .collect();
                assert_eq!(got["left"], shown.join(" "), "{got:#}");
            }
            for v in [&mut got, &mut want] {
                if let Some(o) = v.as_object_mut() {
                    o.remove("left");
                }
            }
            assert_eq!(got, want, "{command} {files:?}");
            if command == "verify" {
                // torch's fixtures verify (checksums, shapes): `diff_verify` proves it locally.
                assert!(got["summary"]["matched"].as_u64().unwrap() > 0, "{got:#}");
            }
        }
    }
}

/// Against torch's data: the FSDP1 FULL_STATE_DICT file behind a presigned URL equals the HF
/// safetensors torch wrote of the same weights (`diff` and a `convert` of the URL).
#[test]
fn presigned_file_equals_torch_weights() {
    let Some(nginx) = start() else { return };
    let url = signed(&nginx, "fsdp1/rank0_full.pt");
    let hf = formats().join("hf_sharded");
    let out = run(&["diff", &url, p(&hf), "--json"]);
    assert_ok(&out, "diff URL hf_sharded");
    assert_eq!(json(&out)["summary"]["matched"], 7, "{}", text(&out.stdout));
    assert_all_answered(&nginx, "diff");

    let dir = tempfile::tempdir().unwrap();
    let converted = dir.path().join("out.safetensors");
    let out = run(&["convert", &url, "-o", p(&converted)]);
    assert_ok(&out, "convert URL");
    assert_all_answered(&nginx, "convert");
    let out = run(&["diff", p(&converted), p(&hf), "--json"]);
    assert_ok(&out, "diff converted hf_sharded");
    assert_eq!(json(&out)["summary"]["matched"], 7, "{}", text(&out.stdout));
}

/// A query dropped or changed is refused by the server: the commands fail (exit 2), naming the
/// URL; so the tests above pass only because every request carried its query.
#[test]
fn a_missing_or_wrong_query_is_refused() {
    let Some(nginx) = start() else { return };
    let bare = nginx.url("p/fsdp1/rank0_full.pt");
    let wrong = format!(
        "{bare}?{}",
        query_of("fsdp2/rank0_model.pt") // another file's signature
    );
    for url in [&bare, &wrong] {
        let out = run(&["inspect", url]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains(&bare) && err.contains("access denied"),
            "{err}"
        );
    }
    // The query of one file is not sent with another's.
    let out = run(&[
        "inspect",
        &signed(&nginx, "fsdp2/rank0_model.pt"),
        &nginx.url("p/fsdp2/rank1_model.pt"),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&nginx.url("p/fsdp2/rank1_model.pt")),
        "{}",
        text(&out.stderr)
    );
}

/// No output of any command, failing or not, shows a signature: every stdout and stderr is
/// searched for each file's signature value.
#[test]
fn no_output_shows_a_signature() {
    let Some(nginx) = start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m0 = signed(&nginx, "fsdp2/rank0_model.pt");
    let m1 = signed(&nginx, "fsdp2/rank1_model.pt");
    let meta = signed(&nginx, "dcp/.metadata");
    let d0 = signed(&nginx, "dcp/__0_0.distcp");
    let d1 = signed(&nginx, "dcp/__1_0.distcp");
    let full = signed(&nginx, "fsdp1/rank0_full.pt");
    let out_st = dir.path().join("o.safetensors");
    let q = query_of("fsdp1/rank0_full.pt");
    let missing = format!("{}?{q}", nginx.url("open/fsdp1/nope.pt"));
    let folder = format!("{}?{q}", nginx.url("p/fsdp1/"));
    let wrong = format!("{}?{q}", nginx.url("p/fsdp2/rank0_model.pt"));
    let local_rank1 = formats().join("fsdp2/rank1_model.pt");
    let runs: Vec<Vec<&str>> = vec![
        vec!["inspect", &m0, &m1],
        vec!["inspect", "--json", &m0, &m1],
        vec!["verify", &meta, &d0, &d1],
        vec!["verify", "--json", &meta, &d0, &d1],
        vec!["doctor", &m0, &m1],
        vec!["doctor", "--json", &meta, &d0, &d1],
        vec!["diff", &full, &full],
        vec!["diff", "--json", &full, &full],
        vec!["convert", &full, "-o", p(&out_st)],
        // Failures: not found, a folder with a query, a refused query, a DCP missing a file, a
        // manifest alone, a signed URL beside a local file.
        vec!["inspect", &missing],
        vec!["inspect", "--json", &missing],
        vec!["inspect", &folder],
        vec!["inspect", &wrong],
        vec!["verify", &meta, &d0],
        vec!["inspect", &meta],
        vec!["inspect", &m0, p(&local_rank1)],
    ];
    let signatures: Vec<String> = served().iter().map(|(n, _)| signature_of(n)).collect();
    let mut failures = 0;
    for args in &runs {
        let out = run(args);
        failures += usize::from(!out.status.success());
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        for sig in &signatures {
            assert!(
                !all.contains(sig.as_str()),
                "{args:?} shows a signature:\n{all}"
            );
        }
        assert!(!all.contains("X-Amz-Credential"), "{args:?}:\n{all}");
        if !out.status.success() {
            assert!(
                all.contains("?…"),
                "{args:?}: the URL is named, its query hidden:\n{all}"
            );
        }
    }
    assert_eq!(failures, 7, "the failing cases fail, the others pass");
}

/// Errors that name what to do: a folder URL with a query, a DCP missing a data file's URL, a
/// `.metadata` by a presigned URL alone, URLs on two servers, two files of one name.
#[test]
fn several_urls_errors_say_what_to_do() {
    let Some(nginx) = start() else { return };
    let q = query_of("x");
    let err = |args: &[&str]| {
        let out = run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stdout)
        );
        text(&out.stderr)
    };
    let e = err(&["inspect", &format!("{}?{q}", nginx.url("p/dcp/"))]);
    assert!(e.contains("names one file, not a folder"), "{e}");
    let e = err(&[
        "inspect",
        &signed(&nginx, "dcp/.metadata"),
        &signed(&nginx, "dcp/__0_0.distcp"),
    ]);
    assert!(
        e.contains("names 1 file(s) not among the URLs given (__1_0.distcp)"),
        "{e}"
    );
    let e = err(&["inspect", &signed(&nginx, "dcp/.metadata")]);
    assert!(e.contains("not among the URLs given"), "{e}");
    let other = nginx
        .url("open/fsdp2/rank1_model.pt")
        .replace("127.0.0.1", "localhost");
    let e = err(&["inspect", &nginx.url("open/fsdp2/rank0_model.pt"), &other]);
    assert!(e.contains("must be on one server"), "{e}");
    let e = err(&[
        "inspect",
        &nginx.url("open/fsdp2/rank0_model.pt"),
        &signed(&nginx, "fsdp2/rank0_model.pt"),
    ]);
    assert!(
        e.contains("two URLs name a file called rank0_model.pt"),
        "{e}"
    );
}

/// Several plain URLs (no query) are one checkpoint too, as the local files are; the shell's
/// brace expansion spells per-rank URLs.
#[test]
fn several_plain_urls_are_one_checkpoint() {
    let Some(nginx) = start() else { return };
    let f = formats();
    let urls: Vec<String> = ["rank0_model.pt", "rank1_model.pt"]
        .iter()
        .map(|n| nginx.url(&format!("open/fsdp2/{n}")))
        .collect();
    let remote = run(&["inspect", &urls[0], &urls[1]]);
    assert_ok(&remote, "inspect URLs");
    assert_all_answered(&nginx, "inspect URLs");
    let local = run(&[
        "inspect",
        p(&f.join("fsdp2/rank0_model.pt")),
        p(&f.join("fsdp2/rank1_model.pt")),
    ]);
    assert_ok(&local, "inspect local");
    assert_eq!(text(&remote.stdout), text(&local.stdout));
    // A copy of the tree served: DCP by its files' URLs equals the folder URL.
    let www = nginx.www();
    copy_dir(&f.join("dcp_torch_save"), &www.join("open/dcp_copy"));
    let folder = run(&["inspect", "--json", &nginx.url("open/dcp_copy/")]);
    assert_ok(&folder, "inspect folder URL");
    let files = run(&[
        "inspect",
        "--json",
        &nginx.url("open/dcp_copy/.metadata"),
        &nginx.url("open/dcp_copy/__0_0.distcp"),
        &nginx.url("open/dcp_copy/__1_0.distcp"),
    ]);
    assert_ok(&files, "inspect DCP file URLs");
    assert_eq!(text(&folder.stdout), text(&files.stdout));
}

/// `--ranks N` reads a `{r}` pattern as the files of ranks 0 to N-1, a URL's query kept for each
/// (a container SAS): the same checkpoint as the local files, and torch's full weights once
/// converted (FSDP2 per-rank model files assemble to the HF safetensors torch wrote).
#[test]
fn a_rank_pattern_with_ranks_reads_every_rank() {
    let Some(nginx) = start() else { return };
    let f = formats();
    let pattern = format!("{}?{SAS}", nginx.url("sas/fsdp2/rank{r}_model.pt"));
    let remote = run(&["inspect", "--json", &pattern, "--ranks", "2"]);
    assert_ok(&remote, "inspect pattern --ranks 2");
    assert_all_answered(&nginx, "inspect pattern");
    let local = run(&[
        "inspect",
        "--json",
        p(&f.join("fsdp2/rank0_model.pt")),
        p(&f.join("fsdp2/rank1_model.pt")),
    ]);
    assert_ok(&local, "inspect local");
    assert_eq!(json(&remote), json(&local));

    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("full.safetensors");
    let out = run(&["convert", &pattern, "--ranks", "2", "-o", p(&out_path)]);
    assert_ok(&out, "convert pattern --ranks 2");
    assert_all_answered(&nginx, "convert pattern");
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!all.contains("SASsignatureSECRET"), "{all}");
    let out = run(&["diff", "--json", p(&out_path), p(&f.join("hf_sharded"))]);
    assert_ok(&out, "diff converted hf_sharded");
    assert_eq!(json(&out)["summary"]["matched"], 7, "{}", text(&out.stdout));

    // The same pattern for local files (and both sides of a diff); errors that say what to do.
    let local_pattern = f.join("fsdp2/rank{r}_model.pt");
    let out = run(&[
        "diff",
        "--json",
        &pattern,
        p(&local_pattern),
        "--ranks",
        "2",
    ]);
    assert_ok(&out, "diff pattern pattern");
    assert_eq!(json(&out)["summary"]["matched"], 7, "{}", text(&out.stdout));
    let out = run(&[
        "diff",
        "--json",
        &pattern,
        p(&f.join("hf_sharded")),
        "--ranks",
        "2",
    ]);
    assert_ok(&out, "diff pattern hf_sharded");
    assert_eq!(json(&out)["summary"]["matched"], 7, "{}", text(&out.stdout));
    let out = run(&["verify", "--json", p(&local_pattern), "--ranks", "2"]);
    assert_ok(&out, "verify local pattern");
    assert_eq!(json(&out)["summary"]["matched"], 7, "{}", text(&out.stdout));
    let err = |args: &[&str]| {
        let out = run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stdout)
        );
        let e = text(&out.stderr);
        assert!(!e.contains("SASsignatureSECRET"), "{e}");
        e
    };
    let e = err(&["inspect", &pattern]);
    assert!(e.contains("give the number of ranks with --ranks N"), "{e}");
    let e = err(&[
        "inspect",
        &nginx.url("open/fsdp2/rank0_model.pt"),
        "--ranks",
        "2",
    ]);
    assert!(e.contains("no input holds a `{r}` pattern"), "{e}");
    let e = err(&["inspect", &pattern, "--ranks", "0"]);
    assert!(e.contains("--ranks 0: give 1 to"), "{e}");
    // Three ranks where two were saved: the missing one is named.
    let e = err(&["inspect", &pattern, "--ranks", "3"]);
    assert!(
        e.contains(&format!("{}?…", nginx.url("sas/fsdp2/rank2_model.pt")))
            && e.contains("not found"),
        "{e}"
    );
}
