//! Replicas that behave as one: three `condense` processes behind a
//! round-robin nginx, sharing a real Redis, in front of a provider that
//! counts tokens its own way (characters / 3.6), enforces a small window
//! with its real overflow errors, reports usage, and records every body it
//! receives.
//!
//! - A coding-agent session replayed turn by turn, its turns spread over the
//!   three replicas, reaches the provider byte for byte as it does through
//!   one replica (with a Redis of its own): compaction, masking, a
//!   checkpoint, an overflow whose window is learned, calibration moving
//!   the plan (a cold replica would send otherwise), a recall and an
//!   agent-requested compaction point included.
//! - A recall key one replica made is answered by another.
//! - Redis killed mid-session and started again costs the client nothing,
//!   is counted, and the replicas share their record again once it is back.
//!
//! They need redis-server and nginx (`.ci/run` installs both), so they are
//! `#[ignore]`d; `cargo test -- --ignored redis` runs them. Everything
//! listens on 127.0.0.1; every process is killed when the test ends.
//! `REPLICAS_CONDENSE_BIN=<path>` runs the replicas from another build (to
//! see the test fail on one that does not share what the plan reads).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response;
use common::{Redis, Running, json_response, metric_at, spawn_logged};
use condense::simulate::{CountRule, OverflowStyle, Simulator};
use serde_json::{Value, json};

const MODEL: &str = "forge-coder";
/// What condense is told the window is.
const CONFIGURED_WINDOW: u64 = 16_384;
/// What the provider enforces: condense learns it from the first overflow.
const REAL_WINDOW: u64 = 12_288;
/// A tool result at this cue makes the scripted model call
/// `condense_recall` with the first key it sees.
const RECALL_CUE: &str = "warning: output above was truncated by the terminal";
/// A tool result at this cue makes it call `compress_context`.
const COMPRESS_CUE: &str = "All 64 tests passed.";

// ---------------------------------------------------------------------------
// The session: a coding agent fixing a bug in a Rust repository.

/// A small deterministic generator (xorshift), so the session is the same
/// on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const IDENTS: &[&str] = &[
    "amount",
    "posting",
    "currency",
    "total",
    "balance",
    "account",
    "ledger",
    "entry",
    "commodity",
    "price",
    "report",
    "row",
    "width",
    "sum",
    "rate",
];

/// A Rust source file of about `lines` lines as `cat -n` shows it: the
/// indentation a sentencepiece tokenizer counts in full.
fn rust_file(rng: &mut Rng, module: &str, lines: usize) -> String {
    let mut out = Vec::new();
    out.push(format!("//! {module}: part of the ledger crate."));
    out.push("use std::collections::BTreeMap;".into());
    out.push("use crate::amount::{Amount, Currency};".into());
    out.push(String::new());
    let mut f = 0;
    while out.len() < lines {
        let a = rng.pick(IDENTS);
        let b = rng.pick(IDENTS);
        f += 1;
        out.push(format!("/// Folds every {a} of the {b} into one figure."));
        out.push(format!(
            "pub fn {a}_{b}_{f}(entries: &[Entry], by: Currency) -> BTreeMap<Currency, Amount> {{"
        ));
        out.push("    let mut totals: BTreeMap<Currency, Amount> = BTreeMap::new();".into());
        out.push("    for entry in entries {".into());
        out.push("        for posting in &entry.postings {".into());
        out.push(format!(
            "            if posting.{a}.currency() != by && !posting.is_virtual() {{"
        ));
        out.push("                continue;".into());
        out.push("            }".into());
        out.push(format!(
            "            let slot = totals.entry(posting.{b}.currency()).or_default();"
        ));
        out.push(format!(
            "            *slot = slot.checked_add(posting.{a}).unwrap_or(*slot);"
        ));
        out.push("        }".into());
        out.push("    }".into());
        out.push("    totals".into());
        out.push("}".into());
        out.push(String::new());
    }
    out.iter()
        .enumerate()
        .map(|(i, l)| format!("{:>6}\t{l}\n", i + 1))
        .collect()
}

/// A report table: columns padded with spaces.
fn report_table(rng: &mut Rng, rows: usize) -> String {
    let mut out = format!(
        "{:<44}{:>18}{:>18}{:>18}\n{}\n",
        "Account",
        "EUR",
        "USD",
        "Total",
        "-".repeat(98)
    );
    for r in 0..rows {
        let account = format!(
            "{}:{}:{}",
            rng.pick(&["Assets", "Expenses", "Income", "Liabilities"]),
            rng.pick(IDENTS),
            r
        );
        let (e, u) = (rng.below(900), rng.below(900));
        out.push_str(&format!(
            "{:<44}{:>15}.00{:>15}.00{:>15}.00\n",
            account,
            e,
            u,
            e + u
        ));
    }
    out
}

/// `cargo test` output: aligned result lines, one failure with its diff.
fn test_output(rng: &mut Rng, tests: usize, failing: bool) -> String {
    let mut out = String::from(
        "   Compiling ledger v0.4.2 (/work/ledger)\n    Finished `test` profile [unoptimized + debuginfo] target(s) in 4.21s\n     Running tests/report.rs (target/debug/deps/report-5f3c2a9b1e7d4c60)\n\n",
    );
    out.push_str(&format!("running {tests} tests\n"));
    for t in 0..tests {
        let name = format!("report::{}_{}_{t}", rng.pick(IDENTS), rng.pick(IDENTS));
        let ok = !(failing && t == tests / 2);
        out.push_str(&format!(
            "test {name:<58} ... {}\n",
            if ok { "ok" } else { "FAILED" }
        ));
    }
    if failing {
        out.push_str("\nfailures:\n\n---- report::multi_posting_totals stdout ----\n\nthread 'report::multi_posting_totals' panicked at tests/report.rs:88:5:\nassertion `left == right` failed\n  left: \"Assets:Bank        120.00 EUR\"\n right: \"Assets:Bank        240.00 EUR\"\n\nfailures:\n    report::multi_posting_totals\n\ntest result: FAILED. ");
        out.push_str(&format!(
            "{} passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n",
            tests - 1
        ));
        out.push_str("error: test failed, to rerun pass `--test report`\n");
    } else {
        out.push_str(&format!(
            "\ntest result: ok. {tests} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n"
        ));
    }
    out
}

/// `tree`: names under their directories, indented.
fn listing(rng: &mut Rng, dir: &str, entries: usize) -> String {
    let mut out = format!("{dir}/\n");
    for e in 0..entries {
        let depth = 1 + e % 3;
        out.push_str(&format!(
            "{}{}_{}.rs\n",
            "│   ".repeat(depth - 1) + "├── ",
            rng.pick(IDENTS),
            rng.pick(IDENTS)
        ));
    }
    out
}

/// `grep -rn`: matches with their lines.
fn grep_output(rng: &mut Rng, pattern: &str, hits: usize) -> String {
    (0..hits)
        .map(|h| {
            format!(
                "src/{}.rs:{}:        let {} = {pattern}(&entry.postings[{h}], by);\n",
                rng.pick(IDENTS),
                10 + rng.below(400),
                rng.pick(IDENTS)
            )
        })
        .collect()
}

fn tools() -> Value {
    let tool = |name: &str, desc: &str, params: Value| json!({"type": "function", "function": {"name": name, "description": desc, "parameters": {"type": "object", "properties": params, "required": params.as_object().unwrap().keys().collect::<Vec<_>>()}}});
    json!([
        tool(
            "read_file",
            "Read a file of the repository, with line numbers.",
            json!({"path": {"type": "string"}})
        ),
        tool(
            "run",
            "Run a shell command in the repository and return its output.",
            json!({"command": {"type": "string"}})
        ),
        tool(
            "grep",
            "Search the repository for a pattern.",
            json!({"pattern": {"type": "string"}, "path": {"type": "string"}})
        ),
        tool(
            "write_file",
            "Replace a file's contents.",
            json!({"path": {"type": "string"}, "content": {"type": "string"}})
        ),
        tool(
            "list_dir",
            "List a directory with sizes and dates.",
            json!({"path": {"type": "string"}})
        ),
    ])
}

/// The whole session (every message), as the agent's last request holds it.
fn session() -> Value {
    let mut rng = Rng(0x5eed_cafe_f00d_1234);
    let mut system = String::from(
        "You are Forge, a coding agent working in the Rust repository at /work/ledger. Use the tools to read, search and edit files and to run commands. Keep changes minimal, explain what you are about to do before each tool call, and run the tests before you finish.\n\n# AGENTS.md\n\n- Format with `cargo fmt` and keep clippy clean.\n- Amounts are fixed-point with two decimals; never use floats for money.\n- Every bug fix comes with a regression test in tests/.\n\n## Commands\n\n",
    );
    for (what, command) in [
        ("build", "cargo build"),
        ("all tests", "cargo test"),
        ("one test file", "cargo test --test report"),
        ("the report", "cargo run -q -- report --file FILE"),
        ("lint", "cargo clippy --all-targets -- -D warnings"),
        ("format", "cargo fmt --all"),
    ] {
        system.push_str(&format!("| {what:<28} | {command:<56} |\n"));
    }
    system.push_str("\n## Layout\n\n");
    for (file, what) in [
        ("src/amount.rs", "fixed-point amounts and currencies"),
        ("src/posting.rs", "one posting of a transaction"),
        ("src/ledger.rs", "transactions, accounts, balances"),
        ("src/parse.rs", "the ledger file format"),
        ("src/report.rs", "the report command and its table"),
        ("tests/report.rs", "the report's expected output"),
    ] {
        system.push_str(&format!("        {file:<32}{what}\n"));
    }
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "`ledger report` prints wrong totals when a transaction has more than one posting in the same currency, and `cargo test` fails in tests/report.rs. Find the cause, fix it, and add a regression test."}),
    ];
    // (what the agent says, tool, arguments, result)
    let mut steps: Vec<(String, &str, Value, String)> = Vec::new();
    let files = [
        "src/report.rs",
        "src/posting.rs",
        "src/amount.rs",
        "src/ledger.rs",
        "src/parse.rs",
    ];
    // The first result is large: a replica that has calibrated on the
    // first answer shortens it, a cold one would send it whole.
    steps.push((
        "Let me run the whole test suite with its output to see what fails and how.".into(),
        "run",
        json!({"command": "cargo test -- --nocapture 2>&1"}),
        (0..14).map(|_| test_output(&mut rng, 60, true)).collect(),
    ));
    steps.push((
        "I'll look at the layout of the repository next.".into(),
        "list_dir",
        json!({"path": "/work/ledger/src"}),
        listing(&mut rng, "src", 30),
    ));
    // Three phases, as an agent's session goes: reading code (which both
    // tokenizers count alike), then running the report and the tests
    // (padded output that a provider counting characters counts at half
    // again), then fixing and checking. The provider's tokens per
    // condense token follow the mix, so calibration moves during it.
    for turn in 0..40 {
        let file = files[turn % files.len()];
        let kind = match turn {
            0..=13 => ["read", "grep", "read", "write", "grep"][turn % 5],
            14..=29 => ["tests", "report", "read", "tests"][turn % 4],
            _ => ["grep", "read", "tests", "write"][turn % 4],
        };
        let ident = rng.pick(IDENTS);
        let mut say = match kind {
            "read" if turn % 3 == 0 => format!(
                "Hmm, wait: the fold skips virtual postings but not postings of another currency. Let me double-check how `by` is passed in `{file}`."
            ),
            "read" => format!(
                "The assertion compares a row built from `{file}`; I'll read it to see how postings are folded into the totals."
            ),
            "grep" => format!(
                "I'll search for every caller of the `{ident}` helper before changing its signature."
            ),
            "write" => format!(
                "Actually, I was wrong about the cause: the amounts are summed twice when two postings share a currency, in `{file}`. I'll rewrite the fold so each posting is counted once."
            ),
            "report" => format!(
                "The report renders the table from the folded totals; I'll run it on the sample ledger to compare with the expected output. The `{ident}` column looks doubled in the test."
            ),
            _ => "Let me run the whole test suite again to see where we stand.".to_string(),
        };
        if turn % 3 == 0 {
            say.push_str(&format!(
                " So far: the failing test is report::multi_posting_totals, the fold lives in {file}, and the expected total for Assets:Bank is 240.00 EUR."
            ));
        }
        let size = rng.below(1000);
        let step = match kind {
            "write" => (
                say,
                "write_file",
                json!({"path": file, "content": rust_file(&mut rng, file, 60 + size % 40)}),
                format!("wrote {file}"),
            ),
            "read" => (
                say,
                "read_file",
                json!({"path": file}),
                rust_file(&mut rng, file, 50 + size % 90),
            ),
            "grep" => {
                let pattern = format!("fold_{ident}");
                (
                    say,
                    "grep",
                    json!({"pattern": pattern, "path": "src"}),
                    grep_output(&mut rng, &pattern, 12 + size % 30),
                )
            }
            "report" => (
                say,
                "run",
                json!({"command": "cargo run -q -- report --file tests/data/multi.ledger"}),
                report_table(&mut rng, 30 + size % 50),
            ),
            _ => (
                say,
                "run",
                json!({"command": "cargo test 2>&1 | tail -100"}),
                test_output(&mut rng, 40 + size % 30, turn < 30),
            ),
        };
        steps.push(step);
    }
    // The cues of the scripted model: a recall late in the session, a
    // compaction point after the tests pass.
    steps[33].3.push_str(&format!("\n{RECALL_CUE}\n"));
    steps[36].3 = format!("{}\n{COMPRESS_CUE}\n", test_output(&mut rng, 64, false));
    for (i, (say, tool, args, result)) in steps.into_iter().enumerate() {
        if i == 20 {
            messages.push(json!({"role": "user", "content": "Also: the Total column should be right-aligned to 14 characters, like the others."}));
        }
        let id = format!("call_{i:03}");
        messages.push(json!({"role": "assistant", "content": say, "tool_calls": [{"id": id, "type": "function", "function": {"name": tool, "arguments": args.to_string()}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
    }
    messages.push(json!({"role": "assistant", "content": "The fold now counts each posting once; the regression test passes along with the rest of the suite."}));
    json!({"model": MODEL, "messages": messages, "tools": tools(), "max_tokens": 1024})
}

/// The requests the agent sends, turn by turn: every prefix of the session
/// that ends before an assistant message. Every fourth is streamed.
fn turns(session: &Value) -> Vec<Value> {
    let messages = session["messages"].as_array().unwrap();
    (1..messages.len())
        .filter(|&end| messages[end]["role"] == "assistant")
        .enumerate()
        .map(|(i, end)| {
            let mut body = session.clone();
            body["messages"] = json!(messages[..end]);
            if i % 4 == 3 {
                body["stream"] = json!(true);
            }
            body
        })
        .collect()
}

// ---------------------------------------------------------------------------
// The provider: condense's simulated one, with a scripted model and a
// summarizer on top, recording every body.

struct Provider {
    sim: Simulator,
    /// (path, body) of every request, in order.
    bodies: Mutex<Vec<(String, Bytes)>>,
}

impl Provider {
    fn bodies(&self) -> Vec<(String, Bytes)> {
        self.bodies.lock().unwrap().clone()
    }

    fn seen(&self) -> usize {
        self.bodies.lock().unwrap().len()
    }
}

async fn provider(State(p): State<Arc<Provider>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let path = parts.uri.path().to_string();
    p.bodies.lock().unwrap().push((path.clone(), body.clone()));
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if common::is_summary_call(&body) {
        // The same request gets the same checkpoint.
        let n = xxhash_rust::xxh3::xxh3_64(&body) % 10_000;
        let text = format!(
            "## Task intent\nFix wrong totals for multi-posting transactions in `ledger report`; add a regression test.\n## Files and artifacts\nsrc/report.rs, src/posting.rs, tests/report.rs\n## Decisions\nCount each posting once in the fold.\n## Errors and blockers\nreport::multi_posting_totals: left 120.00 EUR, right 240.00 EUR\n## Current state\nfold rewritten; tests being run\n## Next steps\nrun the suite; right-align the Total column\n## Critical identifiers\ncheckpoint-{n}\n"
        );
        return json_response(json!({
            "id": "chatcmpl-sum", "object": "chat.completion", "created": 0, "model": "summarizer",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 80, "total_tokens": 1080},
        }));
    }
    if path.ends_with("/chat/completions")
        && let Some(call) = scripted(&v)
    {
        let prompt = p.sim.count(&body).unwrap_or(0);
        let asked = v["max_tokens"].as_u64().unwrap_or(0);
        if p.sim.accepts(&path, prompt, asked) {
            return json_response(json!({
                "id": "chatcmpl-tool", "object": "chat.completion", "created": 0, "model": v["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Let me get that back first.",
                    "tool_calls": [call]}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12},
            }));
        }
    }
    let answer = p.sim.respond(&parts.method, &path, &body);
    let (head, bytes) = answer.into_parts();
    let mut r = Response::new(Body::from(bytes));
    *r.status_mut() = head.status;
    *r.headers_mut() = head.headers;
    r
}

/// The tool call the scripted model makes for a request, if any: a recall
/// of the first key the request holds after [`RECALL_CUE`], a compaction
/// point after [`COMPRESS_CUE`]; never on the request that carries the
/// answer to one.
fn scripted(v: &Value) -> Option<Value> {
    let messages = v["messages"].as_array()?;
    let last = messages.last()?;
    if last["tool_call_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_scripted"))
    {
        return None;
    }
    let text = last["content"].as_str().unwrap_or("");
    let offered = |name: &str| {
        v["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["function"]["name"] == name))
    };
    let call = |name: &str, args: Value| json!({"id": format!("call_scripted_{name}"), "type": "function", "function": {"name": name, "arguments": args.to_string()}});
    if text.contains(RECALL_CUE) && offered("condense_recall") {
        let body = v.to_string();
        let key = condense::compaction::keys::keys_in(&body).next()?;
        return Some(call("condense_recall", json!({"key": key})));
    }
    if text.contains(COMPRESS_CUE) && offered("compress_context") {
        return Some(call(
            "compress_context",
            json!({"reason": "the bug is fixed; the investigation is done"}),
        ));
    }
    None
}

async fn start_provider() -> (common::Served, Arc<Provider>) {
    let p = Arc::new(Provider {
        sim: Simulator::new(CountRule::Chars(3.6), REAL_WINDOW, OverflowStyle::OpenAi),
        bodies: Mutex::new(Vec::new()),
    });
    let app = Router::new().fallback(provider).with_state(p.clone());
    (common::serve(app).await, p)
}

// ---------------------------------------------------------------------------
// Processes: condense replicas, nginx, and a scratch directory.

/// A directory for one test's files, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "condense-replicas-{name}-{}-{}",
            std::process::id(),
            condense::ids::fresh_uuid()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One condense process.
struct Replica {
    addr: SocketAddr,
    _process: Running,
}

fn binary() -> PathBuf {
    std::env::var_os("REPLICAS_CONDENSE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_condense")))
}

/// Starts condense with a config file in `dir` for `upstream`, sharing
/// `redis` when given.
fn replica(dir: &Path, name: &str, upstream: SocketAddr, redis: Option<&str>) -> Replica {
    let mut config = format!(
        "default_context_window = {CONFIGURED_WINDOW}\n\n[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nbase_url = \"http://{upstream}/v1\"\n\n[compaction]\nagent_tool = true\n\n[[models]]\nmatch = \"forge-*\"\ncontext_window = {CONFIGURED_WINDOW}\n"
    );
    if let Some(url) = redis {
        config.push_str(&format!("\n[state]\nredis_url = \"{url}\"\n"));
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).unwrap();
    let mut cmd = Command::new(binary());
    for (k, _) in std::env::vars() {
        if k.starts_with("CONDENSE_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    cmd.arg("--config").arg(&path);
    let (process, addr, _, _) = spawn_logged(&mut cmd, Duration::from_secs(30));
    Replica {
        addr: addr.parse().unwrap(),
        _process: process,
    }
}

/// A free port on 127.0.0.1 (free when asked).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// nginx balancing round robin over `replicas`, saying in `x-replica`
/// which one answered, never retrying a request on another; stopped with
/// its workers when dropped.
struct Nginx {
    addr: SocketAddr,
    master: Child,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // A killed master leaves its workers serving: asked to stop (TERM),
        // it stops them and waits for them first.
        let _ = Command::new("kill")
            .args(["-TERM", &self.master.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !matches!(self.master.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.master.kill();
        let _ = self.master.wait();
    }
}

fn nginx(dir: &Path, replicas: &[&Replica]) -> Nginx {
    let root = dir.join("nginx");
    for sub in ["", "body", "proxy", "fastcgi", "uwsgi", "scgi"] {
        let d = root.join(sub);
        std::fs::create_dir_all(&d).unwrap();
        // The workers may run as another user than the master.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let port = free_port();
    let servers: String = replicas
        .iter()
        .map(|r| format!("    server {} max_fails=0;\n", r.addr))
        .collect();
    let r = root.display();
    let conf = format!(
        r#"worker_processes 1;
pid {r}/nginx.pid;
error_log {r}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {r}/body;
  proxy_temp_path {r}/proxy;
  fastcgi_temp_path {r}/fastcgi;
  uwsgi_temp_path {r}/uwsgi;
  scgi_temp_path {r}/scgi;
  client_max_body_size 0;
  client_body_buffer_size 16m;
  upstream condense {{
{servers}  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://condense;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 120s;
      proxy_next_upstream off;
      add_header x-replica $upstream_addr always;
    }}
  }}
}}
"#
    );
    let conf_path = root.join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    // Debian installs it in /usr/sbin, which a user's PATH may not hold.
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("nginx").is_file()));
    let program = if on_path { "nginx" } else { "/usr/sbin/nginx" };
    let child = Command::new(program)
        .arg("-p")
        .arg(&root)
        .arg("-c")
        .arg(&conf_path)
        .arg("-e")
        .arg(root.join("error.log"))
        .args(["-g", "daemon off;"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("nginx is needed for this test: {e}"));
    let nginx = Nginx {
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        master: child,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(nginx.addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "nginx did not start: {}",
            std::fs::read_to_string(root.join("error.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    nginx
}

// ---------------------------------------------------------------------------
// The client.

/// One turn's answer: its status, the replica that served it (through
/// nginx), its body.
struct Answered {
    status: u16,
    replica: Option<String>,
    body: String,
}

async fn send(client: &reqwest::Client, to: SocketAddr, body: &Value) -> Answered {
    let resp = client
        .post(format!("http://{to}/v1/chat/completions"))
        .header("authorization", "Bearer sk-agent")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let replica = resp
        .headers()
        .get("x-replica")
        .map(|v| v.to_str().unwrap().to_string());
    // Read to the end, as an agent does before its next turn.
    let body = resp.text().await.unwrap();
    Answered {
        status,
        replica,
        body,
    }
}

/// The upstream bodies of a run, each with the turn that sent it.
struct Run {
    bodies: Vec<(usize, String, Bytes)>,
    replicas: Vec<Option<String>>,
}

/// Sends every turn to `to`, reading each answer to its end before the
/// next; after each, `each(turn)`. What the provider received meanwhile
/// (but the model listings) is the run's.
async fn replay(
    to: SocketAddr,
    turns: &[Value],
    provider: &Provider,
    mut each: impl FnMut(usize),
) -> Run {
    let client = reqwest::Client::new();
    let mut bodies = Vec::new();
    let mut replicas = Vec::new();
    for (t, body) in turns.iter().enumerate() {
        let before = provider.seen();
        let a = send(&client, to, body).await;
        assert_eq!(a.status, 200, "turn {t}: {}", a.body);
        replicas.push(a.replica);
        // Each replica lists the provider's models once, on its own.
        for (path, b) in &provider.bodies()[before..] {
            if !path.ends_with("/models") {
                bodies.push((t, path.clone(), b.clone()));
            }
        }
        each(t);
    }
    Run { bodies, replicas }
}

/// The stored plan records in `redis` (`condense:plan:*`), as text.
fn plan_records(redis: &Redis) -> Vec<String> {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("condense:plan:*")
        .query(&mut con)
        .unwrap();
    keys.iter()
        .map(|k| redis::cmd("GET").arg(k).query::<String>(&mut con).unwrap())
        .collect()
}

/// The message whose content holds `needle`, in a request body.
fn message_holding<'a>(body: &'a Value, needle: &str) -> Option<&'a Value> {
    body["messages"]
        .as_array()?
        .iter()
        .find(|m| m["content"].as_str().is_some_and(|c| c.contains(needle)))
}

fn differs_at(a: &[u8], b: &[u8]) -> String {
    let at = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    let show = |s: &[u8]| {
        String::from_utf8_lossy(&s[at.saturating_sub(80)..(at + 120).min(s.len())]).to_string()
    };
    format!(
        "at byte {at}:\n  one: …{}…\n  three: …{}…",
        show(a),
        show(b)
    )
}

// ---------------------------------------------------------------------------
// The tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server and nginx; run with `cargo test -- --ignored redis`"]
async fn redis_replicas_behind_nginx_send_upstream_what_one_replica_sends() {
    let scratch = Scratch::new("same");
    let (served, provider) = start_provider().await;
    let session = session();
    let turns = turns(&session);

    // One replica, with a Redis of its own; what the plan reads is
    // followed in its record after every turn.
    let redis_one = Redis::start();
    let one = replica(&scratch.0, "one", served.addr, Some(&redis_one.url()));
    let mut plans = Vec::new();
    let single = replay(one.addr, &turns, &provider, |_| {
        let plan = plan_records(&redis_one)
            .first()
            .and_then(|r| condense::tokens::shared::Shared::decode(r))
            .and_then(|s| s.calibration.plan);
        plans.push(plan);
    })
    .await;

    // Three fresh replicas behind nginx, sharing another fresh Redis.
    let redis = Redis::start();
    let three: Vec<Replica> = (0..3)
        .map(|i| {
            replica(
                &scratch.0,
                &format!("r{i}"),
                served.addr,
                Some(&redis.url()),
            )
        })
        .collect();
    let balancer = nginx(&scratch.0, &three.iter().collect::<Vec<_>>());
    let multi = replay(balancer.addr, &turns, &provider, |_| {}).await;

    // The turns went round the three.
    let served_by: std::collections::BTreeSet<&str> = multi
        .replicas
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    assert_eq!(served_by.len(), 3, "{:?}", multi.replicas);
    for w in multi.replicas.windows(2) {
        assert_ne!(w[0], w[1], "consecutive turns on one replica");
    }

    // Byte for byte what one replica sent, request after request.
    let mismatched: Vec<usize> = single
        .bodies
        .iter()
        .zip(&multi.bodies)
        .filter(|(a, b)| a.2 != b.2 || a.0 != b.0)
        .map(|(a, _)| a.0)
        .collect();
    if let Some((a, b)) = single
        .bodies
        .iter()
        .zip(&multi.bodies)
        .find(|(a, b)| a.2 != b.2 || a.0 != b.0)
    {
        panic!(
            "{} of {} upstream requests differ (turns {:?}); the first, turn {} {} ({} bytes vs {}), {}",
            mismatched.len(),
            single.bodies.len(),
            mismatched,
            a.0,
            a.1,
            a.2.len(),
            b.2.len(),
            differs_at(&a.2, &b.2)
        );
    }
    assert_eq!(
        single.bodies.len(),
        multi.bodies.len(),
        "as many upstream requests"
    );

    // What the session went through, on both: compaction and masking, a
    // checkpoint, an overflow whose window was learned, the scripted
    // recall and compaction point.
    let text = |b: &Bytes| String::from_utf8_lossy(b).to_string();
    let all: Vec<String> = single.bodies.iter().map(|b| text(&b.2)).collect();
    assert!(
        all.iter().any(|b| b.contains("earlier tool output elided")),
        "no masking"
    );
    assert!(
        all.iter().any(|b| b.contains("<conversation>")),
        "no summarizer call"
    );
    assert!(
        all.iter().any(|b| b.contains("checkpoint. The ")),
        "no checkpoint"
    );
    let rejected = provider.sim.received().iter().filter(|(_, ok)| !ok).count();
    assert!(rejected >= 2, "an overflow in each run: {rejected}");
    assert!(
        all.iter()
            .any(|b| b.contains("call_scripted_condense_recall")),
        "no recall round"
    );
    assert!(
        all.iter()
            .any(|b| b.contains("call_scripted_compress_context")),
        "no compaction point"
    );

    // Calibration moved the plan during the session, beyond its first
    // observation...
    let changes = plans
        .windows(2)
        .filter(|w| w[0].is_some() && w[0] != w[1])
        .count();
    assert!(changes >= 1, "the plan ratio never moved: {plans:?}");
    // ... and a replica that had not learned it would have sent the turn
    // of the first compaction otherwise.
    let first_compacted = single
        .bodies
        .iter()
        .find(|(t, path, b)| {
            path.ends_with("/chat/completions")
                && !common::is_summary_call(b)
                && serde_json::from_slice::<Value>(b).unwrap()["messages"] != turns[*t]["messages"]
        })
        .map(|(t, _, _)| *t)
        .expect("nothing was compacted");
    assert_eq!(
        first_compacted, 1,
        "compaction began at its first large result"
    );
    let cold_dir = Scratch::new("cold");
    let cold = replica(&cold_dir.0, "cold", served.addr, None);
    let before = provider.seen();
    let client = reqwest::Client::new();
    let a = send(&client, cold.addr, &turns[first_compacted]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let cold_body = provider.bodies()[before..]
        .iter()
        .find(|(path, _)| !path.ends_with("/models"))
        .unwrap()
        .1
        .clone();
    let calibrated = &single
        .bodies
        .iter()
        .find(|(t, _, _)| *t == first_compacted)
        .unwrap()
        .2;
    assert!(
        cold_body != calibrated,
        "turn {first_compacted}: a cold replica sent what the calibrated one did"
    );
    drop(cold);

    // A recall key one replica made is answered by another: the first key
    // of a tool result sent upstream, and the replica that sent it.
    let (turn, key, call_id) = multi
        .bodies
        .iter()
        .find_map(|(t, _, b)| {
            let v: Value = serde_json::from_slice(b).ok()?;
            v["messages"].as_array()?.iter().find_map(|m| {
                let content = m["content"].as_str()?;
                let key = condense::compaction::keys::keys_in(content).next()?;
                (m["role"] == "tool").then(|| {
                    (
                        *t,
                        key.to_string(),
                        m["tool_call_id"].as_str().unwrap().to_string(),
                    )
                })
            })
        })
        .expect("no recall key went upstream");
    let maker = multi.replicas[turn].clone().unwrap();
    let other = three.iter().find(|r| r.addr.to_string() != maker).unwrap();
    let original = session["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["tool_call_id"] == call_id.as_str())
        .unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    let answered = "condense_recalls_total{outcome=\"answered\"}";
    let answered_before = metric_at(other.addr, answered).await;
    let before = provider.seen();
    let ask = json!({"model": MODEL, "max_tokens": 1024, "tools": tools(), "messages": [
        session["messages"][0],
        {"role": "user", "content": format!("The log said `recall key: {key}`; show me that output again.\n{RECALL_CUE}")},
    ]});
    let a = send(&client, other.addr, &ask).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let follow_up = provider.bodies()[before..]
        .iter()
        .map(|(_, b)| serde_json::from_slice::<Value>(b).unwrap())
        .find(|v| message_holding(v, &original[..original.len().min(400)]).is_some())
        .unwrap_or_else(|| {
            panic!(
                "replica {} did not answer key {key} made by {maker}",
                other.addr
            )
        });
    let result = message_holding(&follow_up, &original[..400]).unwrap();
    assert_eq!(result["role"], "tool");
    assert!(
        result["content"]
            .as_str()
            .unwrap()
            .contains(&original[original.len() - 300..])
    );
    assert_eq!(metric_at(other.addr, answered).await, answered_before + 1.0);

    drop(balancer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server and nginx; run with `cargo test -- --ignored redis`"]
async fn redis_replicas_behind_nginx_carry_on_through_a_redis_outage() {
    let scratch = Scratch::new("outage");
    let (served, provider) = start_provider().await;
    let turns = turns(&session());
    let mut redis = Redis::start();
    let url = redis.url();
    let three: Vec<Replica> = (0..3)
        .map(|i| replica(&scratch.0, &format!("r{i}"), served.addr, Some(&url)))
        .collect();
    let balancer = nginx(&scratch.0, &three.iter().collect::<Vec<_>>());
    let client = reqwest::Client::new();
    let errors = || async {
        let mut sum = 0.0;
        for r in &three {
            for op in ["get", "put", "mget", "swap"] {
                sum += metric_at(
                    r.addr,
                    &format!("condense_state_errors_total{{op=\"{op}\"}}"),
                )
                .await;
            }
        }
        sum
    };
    let (down_at, up_at) = (8, 16);
    let mut t = 0;
    // The session's turns, then again from the start (what matters here
    // is that each is answered, not what it holds).
    let next = |t: &mut usize| {
        let body = turns[*t % turns.len()].clone();
        *t += 1;
        body
    };
    while t < down_at {
        let a = send(&client, balancer.addr, &next(&mut t)).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert_eq!(errors().await, 0.0);
    assert_eq!(plan_records(&redis).len(), 1);

    // Redis goes away: every turn still answered, the failures counted.
    redis.stop();
    while t < up_at {
        let a = send(&client, balancer.addr, &next(&mut t)).await;
        assert_eq!(a.status, 200, "turn {t} without Redis: {}", a.body);
    }
    let failed = errors().await;
    assert!(failed > 0.0, "no Redis failure counted");

    // Back (empty, as a restarted Redis without persistence is): the
    // replicas find it on their own and share one record again, every
    // turn changing it whichever replica serves it.
    redis.start_again();
    let deadline = Instant::now() + Duration::from_secs(30);
    while plan_records(&redis).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the replicas never wrote to Redis again"
        );
        let a = send(&client, balancer.addr, &next(&mut t)).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let settled = errors().await;
    let mut record = plan_records(&redis);
    let mut replicas = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let a = send(&client, balancer.addr, &next(&mut t)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        replicas.insert(a.replica.unwrap());
        let now = plan_records(&redis);
        assert_eq!(now.len(), 1);
        assert_ne!(now, record, "turn {t} left the shared record as it was");
        record = now;
    }
    assert_eq!(replicas.len(), 3);
    assert_eq!(errors().await, settled, "Redis failures after it came back");
    assert!(provider.seen() > 0);
}
