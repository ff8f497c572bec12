//! The README's first screen, run as written against the built binary, so
//! that what a newcomer types first cannot drift from what condense does.
//!
//! Every shell command in a fenced `sh` block above the README's first `---`
//! is run: `cargo run --release` and `./target/release/condense ...` stand
//! for this build's binary, `cargo test` is this very suite, and `export`
//! sets a variable for the commands after it. A command of another shape
//! fails the test until this file learns to run it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const BIN: &str = env!("CARGO_BIN_EXE_condense");

/// The shell commands of the README's first screen, continuation lines
/// joined and trailing comments cut.
fn first_screen_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let screen = readme
        .split("\n---\n")
        .next()
        .expect("the README has a first screen");
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in screen.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let line = match line.find(" #") {
            Some(i) => &line[..i],
            None => line,
        };
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        commands.push(std::mem::take(&mut pending));
    }
    commands
}

/// A command for the binary with a clean environment as far as condense is
/// concerned, run where the README's relative paths point.
fn shell(command: &str, env: &[(String, String)]) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c").arg(command).current_dir(ROOT);
    for (k, _) in std::env::vars() {
        if k.starts_with("CONDENSE_") || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().map(|(k, v)| (k, v)));
    c
}

/// `cargo run --release`: the proxy starts with the built-in configuration,
/// answers `/healthz`, and stops cleanly on SIGTERM. It listens on a free
/// port here instead of 8080 (the one override), so that the test runs
/// wherever 8080 is taken.
fn starts_the_proxy(env: &[(String, String)]) {
    let mut child = shell(&format!("exec '{BIN}'"), env)
        .env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let line = line.unwrap_or_default();
            if line.contains("condense listening") {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the proxy never said it listens");
    assert!(
        line.contains("upstream=https://api.openai.com/v1"),
        "the default upstream: {line}"
    );
    let addr = line
        .split("listen=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap()
        .to_string();
    let mut stream = std::net::TcpStream::connect(&addr).unwrap();
    use std::io::{Read, Write};
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(child.wait().unwrap().success());
}

/// A demo command: it succeeds, and when it is `replay` or `compact` its
/// output shows a compaction (so the offline demo shows one).
fn runs_and_shows_compaction(original: &str, command: &str, env: &[(String, String)]) {
    let out = shell(command, env).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{original}\n{stdout}\n{stderr}");
    if command.contains(" replay ") {
        // A turn row whose last column (the actions) is not `none`.
        let compacted = stdout
            .lines()
            .filter(|l| l.contains(" | "))
            .filter_map(|l| l.rsplit(" | ").next())
            .any(|actions| !["none", "actions"].contains(&actions.trim()));
        assert!(compacted, "{original}: no turn was compacted\n{stdout}");
    }
    if command.contains(" compact ") {
        let report: serde_json::Value = serde_json::from_str(&stderr)
            .unwrap_or_else(|e| panic!("{original}: the report on stderr: {e}\n{stderr}"));
        let actions = report["actions"].as_array().unwrap();
        assert!(!actions.is_empty(), "{original}: nothing compacted");
        assert!(report["tokens_after"].as_u64() < report["tokens_before"].as_u64());
    }
}

#[test]
fn every_command_on_the_readmes_first_screen_runs_as_written() {
    let commands = first_screen_commands();
    let binary = format!("'{BIN}'");
    let mut env: Vec<(String, String)> = Vec::new();
    let (mut served, mut tested, mut demos) = (false, false, 0);
    for command in &commands {
        if command == "cargo run --release" {
            starts_the_proxy(&env);
            served = true;
        } else if command == "cargo test" {
            // This suite.
            tested = true;
        } else if let Some(rest) = command.strip_prefix("export ") {
            let (k, v) = rest.split_once('=').expect("export NAME=VALUE");
            env.push((k.to_string(), v.trim_matches('"').to_string()));
        } else if let Some(args) = command
            .strip_prefix("cargo run --release -- ")
            .or_else(|| command.strip_prefix("./target/release/condense "))
        {
            runs_and_shows_compaction(command, &format!("{binary} {args}"), &env);
            demos += 1;
        } else {
            panic!("the README's first screen has a command this test cannot run: {command}");
        }
    }
    assert!(served && tested, "the two commands a newcomer runs first");
    assert!(demos >= 2, "the offline demo: replay and compact");
}
