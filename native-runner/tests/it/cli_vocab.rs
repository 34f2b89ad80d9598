//! The CLI surface: shell completions that the shells accept, and gather's reading mode under its
//! own name (`--from` belongs to `layout`).

use std::io::Write;
use std::process::{Command, Stdio};

fn shardscope(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_shardscope"))
        .args(args)
        .output()
        .expect("run shardscope")
}

#[test]
fn completions_are_valid_scripts_naming_every_command() {
    for shell in ["bash", "zsh", "fish"] {
        let out = shardscope(&["completions", shell]);
        assert!(
            out.status.success(),
            "{shell}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).expect("utf-8");
        for command in ["convert", "reshard", "inspect", "completions"] {
            assert!(text.contains(command), "{shell} completions lack {command}");
        }
        // fish spells long flags `-l dtype`, bash and zsh `--dtype`.
        for flag in ["dtype", "keep-tied", "read-as"] {
            let found = text.contains(&format!("--{flag}")) || text.contains(&format!("-l {flag}"));
            assert!(found, "{shell} completions lack --{flag}");
        }
    }
    // bash parses its script without running it.
    let script = shardscope(&["completions", "bash"]).stdout;
    let mut bash = Command::new("bash")
        .arg("-n")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash");
    bash.stdin
        .take()
        .expect("stdin")
        .write_all(&script)
        .expect("write");
    let checked = bash.wait_with_output().expect("bash -n");
    assert!(
        checked.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let out = shardscope(&["completions", "tcsh-but-not-really"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn gather_reads_with_read_as_and_from_is_layouts() {
    let out = shardscope(&["gather", "x.pt", "--from", "full"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--from"));
    let out = shardscope(&["gather", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--read-as"), "{help}");
}
