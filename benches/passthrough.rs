//! Load benchmark: the same load sent straight to a zero-delay mock upstream
//! and through condense in front of it, in one run.
//!
//! Bodies: a small chat request and a ~300 KB agent conversation that needs
//! compaction (its model has a 32k window), each as a JSON and as a streamed
//! request. For each, at a fixed request rate: latency p50/p99/p99.9 direct
//! and proxied, the added latency, and errors; then at saturation (closed
//! loop, fixed concurrency) the throughput direct and proxied and their
//! ratio. Then many slow streams held open at once (one chunk every 5 s):
//! how many completed, and condense's memory meanwhile. condense's resident
//! memory is reported idle, during the slow streams, and at its peak.
//!
//! First, one connection and one request at a time (the latency a single
//! agent sees): each body straight to the upstream and through condense,
//! taking turns request by request, with condense's CPU time per request.
//! Beside condense, the same phase can measure a baseline build of it
//! (`BENCH_BASELINE=<path to a condense binary>`) and the bare relay
//! (`BENCH_BARE_RELAY=target/release/examples/bare_relay`, after `cargo
//! build --release --example bare_relay`): the least a relay on the same
//! stack (tokio, axum, reqwest) costs, so the floor under condense's own
//! figures. More relays with the bare relay's contract (listen address as
//! the first argument, upstream from `UPSTREAM`, prints `listen=<address>`)
//! join the phase by name: `BENCH_RELAYS=name=path,...`, e.g.
//! `BENCH_RELAYS=hyper=target/release/examples/hyper_relay` (after `cargo
//! build --release --example hyper_relay`), hyper with no axum and no
//! reqwest, the floor under the bare relay's. `BENCH_SERIAL_REQUESTS`
//! (default 3000) sets the requests per body and target.
//!
//! Run: `cargo bench --bench passthrough`. Knobs (environment):
//! `BENCH_RATE` (small requests/s, default 1000), `BENCH_AGENT_RATE` (agent
//! requests/s, default 50), `BENCH_SECONDS` (per fixed-rate phase, default
//! 30), `BENCH_SATURATION_SECONDS` (default 10), `BENCH_CONCURRENCY`
//! (default 16), `BENCH_SLOW_STREAMS` (default 1000), `BENCH_SLOW_SECONDS`
//! (default 60; 0 skips the phase), `BENCH_ACCESS_LOG=1` (condense and
//! the baseline write their access lines, as by default; off otherwise).
//! condense runs as its own process (the release binary), so its memory is
//! measured alone; the mock upstream and the load generator share this
//! process. On a 2-core machine all three
//! compete for the CPU: compare the two columns, not absolute numbers.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const RESPONSE: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101}}"#;

const CHUNK: &str = "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"},\"finish_reason\":null}]}\n\n";
const USAGE: &str = "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":1,\"total_tokens\":101}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

/// The zero-delay upstream: reads the body, answers a fixed completion (a
/// stream when asked for one; a slow stream, one chunk every 5 s for
/// `x-slow-seconds`, when that header is set).
async fn mock(req: Request) -> Response {
    let slow: Option<u64> = req
        .headers()
        .get("x-slow-seconds")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body = axum::body::to_bytes(req.into_body(), usize::MAX)
        .await
        .unwrap_or_default();
    let stream = memchr::memmem::find(&body, b"\"stream\":true").is_some();
    if !stream {
        let mut r = RESPONSE.into_response();
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        return r;
    }
    let events: Vec<&'static str> = match slow {
        None => vec![CHUNK, CHUNK, CHUNK, USAGE, DONE],
        Some(s) => {
            let mut e = vec![CHUNK; (s / 5).max(1) as usize];
            e.extend([USAGE, DONE]);
            e
        }
    };
    let pause = Duration::from_secs(if slow.is_some() { 5 } else { 0 });
    let s =
        futures_util::stream::iter(events.into_iter().enumerate()).then(move |(i, e)| async move {
            if i > 0 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            Ok::<_, std::io::Error>(Bytes::from_static(e.as_bytes()))
        });
    let mut r = Response::new(axum::body::Body::from_stream(s));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

fn start_mock() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, Router::new().fallback(mock))
                .await
                .unwrap();
        });
    });
    rx.recv().unwrap()
}

fn start_condense(upstream: SocketAddr) -> (Child, SocketAddr) {
    start_condense_from(env!("CARGO_BIN_EXE_condense"), upstream)
}

/// condense's log filter: access lines off, unless `BENCH_ACCESS_LOG=1`.
fn rust_log() -> &'static str {
    if std::env::var("BENCH_ACCESS_LOG").is_ok_and(|v| v == "1") {
        "warn,condense=info"
    } else {
        "warn,condense::server=warn,condense=info"
    }
}

/// condense built from `binary` (this build's, or a baseline's).
fn start_condense_from(binary: &str, upstream: SocketAddr) -> (Child, SocketAddr) {
    let mut child = Command::new(binary)
        // Away from config/condense.toml, which another build's binary
        // may not read (a key it does not know): it runs on its built-in
        // defaults, which that file only documents.
        .current_dir(std::env::temp_dir())
        .env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env(
            "CONDENSE_UPSTREAM__BASE_URL",
            format!("http://{upstream}/v1"),
        )
        .env(
            "CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL",
            format!("http://{upstream}/v1"),
        )
        .env("CONDENSE_LOG__LEVEL", "warn,condense=info")
        // The agent conversation's model is unknown: this window applies.
        .env("CONDENSE_DEFAULT_CONTEXT_WINDOW", "32768")
        .env("CONDENSE_UPSTREAM__LEARN_WINDOWS", "false")
        .env("RUST_LOG", rust_log())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("cannot start condense");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listen=").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("condense did not start");
    (child, addr.parse().unwrap())
}

/// Resident and peak resident memory of a process, in MiB.
fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The small request as an Anthropic Messages body, and as a stateless
/// Responses one (the mock answers them in chat's shape: what is measured
/// is condense's work on the request).
fn small_messages_body() -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": 64,
            "system": "You are a helpful assistant.",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
        .to_string(),
    )
}

fn small_responses_body() -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "gpt-4o",
            "instructions": "You are a helpful assistant.",
            "input": [{"role": "user", "content": "What is the capital of France?"}],
            "store": false,
        })
        .to_string(),
    )
}

fn small_body(stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}
            ],
            "stream": stream,
        })
        .to_string(),
    )
}

/// An agent conversation of about `bytes` bytes: tool calls and results,
/// for a model condense gives a 32k window, so it is compacted; with
/// `tools`, it declares its tool as agents do, so condense also keeps the
/// originals and offers `condense_recall`.
fn agent_body(bytes: usize, stream: bool, tools: bool) -> Bytes {
    agent_body_for("bench-agent", bytes, stream, tools)
}

/// The same conversation for `model`: for gpt-4o (a 128k window) 200 KB
/// stays below the trigger and is only measured and forwarded.
fn agent_body_for(model: &str, bytes: usize, stream: bool, tools: bool) -> Bytes {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent. Use the tools."}),
        serde_json::json!({"role": "user", "content": "Fix the failing test in src/parser.rs"}),
    ];
    let mut i = 0;
    while serde_json::to_vec(&messages).unwrap().len() < bytes {
        let id = format!("call_{i}");
        messages.push(serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "run", "arguments": format!("{{\"cmd\":\"cat src/file_{i}.rs\"}}")}}]}));
        let output: String = (0..40)
            .map(|l| format!("{l:>4} | let value_{i}_{l} = compute({l}, \"text\");\n"))
            .collect();
        messages.push(serde_json::json!({"role": "tool", "tool_call_id": id, "content": output}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Looked at file {i}; moving on.")}));
        i += 1;
    }
    let mut body = serde_json::json!({"model": model, "messages": messages, "stream": stream});
    if tools {
        body["tools"] = serde_json::json!([{"type": "function", "function": {"name": "run",
            "description": "Runs a shell command", "parameters": {"type": "object",
            "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]);
    }
    Bytes::from(body.to_string())
}

/// Reads a whole response; a stream must end with `[DONE]`.
async fn complete(r: reqwest::Response) -> bool {
    let sse = r
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    match r.bytes().await {
        Ok(b) => !sse || b.ends_with(DONE.as_bytes()),
        Err(_) => false,
    }
}

/// Holds `n` slow streams open through condense at once; returns how many
/// completed and condense's highest RSS meanwhile.
async fn slow_streams(url: &str, n: usize, secs: u64, pid: u32) -> (usize, f64) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (client, url) = (client.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            match client
                .post(&url)
                .header("x-slow-seconds", secs.to_string())
                .body(small_body(true))
                .send()
                .await
            {
                Ok(r) => r.status().is_success() && complete(r).await,
                Err(_) => false,
            }
        }));
    }
    let sampler = tokio::spawn(async move {
        let mut peak: f64 = 0.0;
        for _ in 0..(secs + 10) {
            peak = peak.max(memory_mib(pid).0);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        peak
    });
    let mut done = 0;
    for t in tasks {
        done += usize::from(t.await.unwrap_or(false));
    }
    let peak = sampler.await.unwrap_or(f64::NAN);
    (done, peak)
}

/// CPU time condense has used so far (all its threads, user and system),
/// from `/proc/<pid>/task/*/schedstat` in nanoseconds.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// A relay measured in the one-connection phase: condense, the bare relay
/// (`examples/bare_relay.rs`) that shows what the stack alone costs, or
/// one named in `BENCH_RELAYS`.
struct Relay {
    name: String,
    addr: SocketAddr,
    pid: u32,
}

/// One relay's figures in the one-connection phase.
struct Serial {
    p50: f64,
    cpu_us: f64,
    errors: usize,
}

/// One connection to each target, one request at a time, the targets
/// taking turns request by request (so all see the same machine), each in
/// each place of the turn equally often: the
/// p50 straight to the upstream, and for each relay its p50 and its CPU
/// time per request.
async fn serial(
    upstream: SocketAddr,
    relays: &[Relay],
    path: &str,
    body: &Bytes,
    n: usize,
) -> (f64, Vec<Serial>) {
    let one = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .unwrap()
    };
    let mut targets = vec![(one(), format!("http://{upstream}{path}"))];
    for r in relays {
        targets.push((one(), format!("http://{}{path}", r.addr)));
    }
    let send = |client: &reqwest::Client, url: &str| {
        let req = client
            .post(url)
            .header("content-type", "application/json")
            .body(body.clone());
        async move {
            let t = Instant::now();
            let ok = match req.send().await {
                Ok(r) => r.status().is_success() && complete(r).await,
                Err(_) => false,
            };
            (t.elapsed(), ok)
        }
    };
    // Warm every connection.
    for _ in 0..50 {
        for (client, url) in &targets {
            send(client, url).await;
        }
    }
    let mut times = vec![Vec::with_capacity(n); targets.len()];
    let mut errors = vec![0; targets.len()];
    // Each relay is idle while the others run: its CPU time over the loop
    // is what its own requests cost, work done after the client has its
    // answer (the access log, the metrics) included.
    let before: Vec<u64> = relays.iter().map(|r| cpu_ns(r.pid)).collect();
    // The order turns each round, so that each target goes in each place
    // equally often: the one right after the direct request was measured
    // about 10 µs faster than the one after it, the same binary in both
    // places (the upstream's thread had not gone back to sleep).
    let k = targets.len();
    for round in 0..n {
        for step in 0..k {
            let i = (round + step) % k;
            let (client, url) = &targets[i];
            let (t, ok) = send(client, url).await;
            times[i].push(t);
            errors[i] += usize::from(!ok);
        }
    }
    let cpu: Vec<u64> = relays
        .iter()
        .zip(&before)
        .map(|(r, b)| cpu_ns(r.pid).saturating_sub(*b))
        .collect();
    for t in &mut times {
        t.sort();
    }
    let direct = pct(&times[0], 0.5);
    let out = (0..relays.len())
        .map(|i| Serial {
            p50: pct(&times[i + 1], 0.5),
            cpu_us: cpu[i] as f64 / n as f64 / 1000.0,
            errors: errors[0] + errors[i + 1],
        })
        .collect();
    (direct, out)
}

/// The bare relay, when `BENCH_BARE_RELAY` names its binary (build it with
/// `cargo build --release --example bare_relay`).
fn start_bare(upstream: SocketAddr) -> Option<(Child, SocketAddr)> {
    start_relay_from(&std::env::var("BENCH_BARE_RELAY").ok()?, upstream)
}

/// A relay binary with the bare relay's contract: the listen address as its
/// argument, the upstream from `UPSTREAM`, `listen=<address>` printed.
fn start_relay_from(path: &str, upstream: SocketAddr) -> Option<(Child, SocketAddr)> {
    let mut child = Command::new(path)
        .arg("127.0.0.1:0")
        .env("UPSTREAM", format!("http://{upstream}"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("cannot start a relay");
    let stdout = child.stdout.take().unwrap();
    let line = BufReader::new(stdout).lines().next();
    match line
        .and_then(Result::ok)
        .and_then(|l| l.strip_prefix("listen=")?.parse().ok())
    {
        Some(addr) => Some((child, addr)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            None
        }
    }
}

struct Phase {
    latencies: Vec<Duration>,
    errors: usize,
    lag: Duration,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// Open loop: one request every 1/rate seconds whatever the responses do.
async fn fixed_rate(
    client: &reqwest::Client,
    url: &str,
    body: &Bytes,
    rate: f64,
    secs: f64,
) -> Phase {
    let n = (rate * secs) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    let mut lag = Duration::ZERO;
    for i in 0..n {
        let at = start + interval * i as u32;
        tokio::time::sleep_until(at.into()).await;
        lag = lag.max(at.elapsed());
        let (client, url, body) = (client.clone(), url.to_string(), body.clone());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let ok = match client
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
            {
                Ok(r) => r.status().is_success() && complete(r).await,
                Err(_) => false,
            };
            (t.elapsed(), ok)
        }));
    }
    let mut latencies = Vec::with_capacity(n);
    let mut errors = 0;
    for t in tasks {
        let (d, ok) = t.await.unwrap();
        if ok {
            latencies.push(d);
        } else {
            errors += 1;
        }
    }
    latencies.sort();
    Phase {
        latencies,
        errors,
        lag,
    }
}

/// Closed loop: `concurrency` workers sending back to back for `secs`.
async fn saturation(
    client: &reqwest::Client,
    url: &str,
    body: &Bytes,
    concurrency: usize,
    secs: f64,
) -> (f64, usize) {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.to_string(), body.clone());
        workers.push(tokio::spawn(async move {
            let (mut done, mut errors) = (0usize, 0usize);
            while Instant::now() < deadline {
                let ok = match client.post(&url).body(body.clone()).send().await {
                    Ok(r) => r.status().is_success() && complete(r).await,
                    Err(_) => false,
                };
                if ok {
                    done += 1;
                } else {
                    errors += 1;
                }
            }
            (done, errors)
        }));
    }
    let (mut done, mut errors) = (0, 0);
    for w in workers {
        let (d, e) = w.await.unwrap();
        done += d;
        errors += e;
    }
    (done as f64 / start.elapsed().as_secs_f64(), errors)
}

fn main() {
    let rate = env_f64("BENCH_RATE", 1000.0);
    let agent_rate = env_f64("BENCH_AGENT_RATE", 50.0);
    let slow_n = env_f64("BENCH_SLOW_STREAMS", 1000.0) as usize;
    let slow_secs = env_f64("BENCH_SLOW_SECONDS", 60.0) as u64;
    let secs = env_f64("BENCH_SECONDS", 30.0);
    let sat_secs = env_f64("BENCH_SATURATION_SECONDS", 10.0);
    let concurrency = env_f64("BENCH_CONCURRENCY", 16.0) as usize;

    let upstream = start_mock();
    let (mut child, proxy) = start_condense(upstream);
    std::thread::sleep(Duration::from_millis(300));
    let (idle_rss, _) = memory_mib(child.id());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap();
    let direct = |path: &str| format!("http://{upstream}{path}");
    let proxied = |path: &str| format!("http://{proxy}{path}");
    const CHAT: &str = "/v1/chat/completions";
    let proxy_url = proxied(CHAT);

    println!(
        "condense load benchmark: {rate} small / {agent_rate} agent req/s for {secs} s per phase; saturation {concurrency} workers for {sat_secs} s"
    );
    println!("condense idle RSS: {idle_rss:.1} MiB\n");
    let bodies = [
        ("small JSON", CHAT, small_body(false), rate),
        ("small stream", CHAT, small_body(true), rate),
        (
            "small Messages JSON",
            "/v1/messages",
            small_messages_body(),
            rate,
        ),
        (
            "small Responses JSON",
            "/v1/responses",
            small_responses_body(),
            rate,
        ),
        (
            "agent 200 KB JSON, below the trigger",
            CHAT,
            agent_body_for("gpt-4o", 200 * 1024, false, false),
            agent_rate,
        ),
        (
            "agent 300 KB JSON, compacted",
            CHAT,
            agent_body(300 * 1024, false, false),
            agent_rate,
        ),
        (
            "agent 300 KB stream, compacted",
            CHAT,
            agent_body(300 * 1024, true, false),
            agent_rate,
        ),
        (
            "agent 300 KB JSON with tools, compacted, recall offered",
            CHAT,
            agent_body(300 * 1024, false, true),
            agent_rate,
        ),
    ];
    // The agent conversation really is compacted.
    let actions = rt.block_on(async {
        let r = client
            .post(&proxy_url)
            .body(agent_body(300 * 1024, false, false))
            .send()
            .await
            .unwrap();
        r.headers()
            .get("x-condense-actions")
            .map(|v| v.to_str().unwrap_or("").to_string())
            .unwrap_or_default()
    });
    println!("agent conversation through condense: x-condense-actions: {actions}\n");
    let serial_n = env_f64("BENCH_SERIAL_REQUESTS", 3000.0) as usize;
    let bare = start_bare(upstream);
    let mut relays = vec![Relay {
        name: "condense".into(),
        addr: proxy,
        pid: child.id(),
    }];
    // A baseline condense (another build) measured beside this one.
    let baseline = std::env::var("BENCH_BASELINE")
        .ok()
        .map(|path| start_condense_from(&path, upstream));
    if let Some((b, addr)) = &baseline {
        relays.push(Relay {
            name: "condense baseline".into(),
            addr: *addr,
            pid: b.id(),
        });
    }
    if let Some((b, addr)) = &bare {
        relays.push(Relay {
            name: "bare relay".into(),
            addr: *addr,
            pid: b.id(),
        });
    }
    // More relays with the bare relay's contract: `BENCH_RELAYS=name=path,...`.
    let mut more = Vec::new();
    for spec in std::env::var("BENCH_RELAYS")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let (name, path) = spec.split_once('=').expect("BENCH_RELAYS is name=path,...");
        let (b, addr) = start_relay_from(path, upstream).expect("a relay did not start");
        relays.push(Relay {
            name: name.into(),
            addr,
            pid: b.id(),
        });
        more.push(b);
    }
    println!(
        "One connection, one request at a time, direct and through each relay taking turns ({serial_n} each):\n"
    );
    println!(
        "| body | relay | direct p50 ms | relayed p50 ms | added p50 ms | relay CPU µs/request | errors |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, path, body, _) in &bodies {
        let (direct_p50, per) = rt.block_on(serial(upstream, &relays, path, body, serial_n));
        for (r, s) in relays.iter().zip(per) {
            println!(
                "| {name} | {} | {direct_p50:.3} | {:.3} | {:.3} | {:.0} | {} |",
                r.name,
                s.p50,
                s.p50 - direct_p50,
                s.cpu_us,
                s.errors
            );
        }
    }
    for mut b in bare.into_iter().chain(baseline).map(|(b, _)| b).chain(more) {
        let _ = b.kill();
        let _ = b.wait();
    }
    println!("\nAt a fixed rate, many connections:\n");
    println!("| body | path | p50 ms | p99 ms | p99.9 ms | errors | max send lag ms |");
    println!("|---|---|---|---|---|---|---|");
    let mut added = Vec::new();
    for (name, path, body, rate) in &bodies {
        let rate = *rate;
        let (direct_url, proxy_url) = (direct(path), proxied(path));
        // Warm both paths (connections, allocator) before measuring.
        rt.block_on(fixed_rate(&client, &direct_url, body, rate, 1.0));
        rt.block_on(fixed_rate(&client, &proxy_url, body, rate, 1.0));
        let d = rt.block_on(fixed_rate(&client, &direct_url, body, rate, secs));
        let p = rt.block_on(fixed_rate(&client, &proxy_url, body, rate, secs));
        for (label, ph) in [("direct", &d), ("proxied", &p)] {
            println!(
                "| {name} ({} B) | {label} | {:.3} | {:.3} | {:.3} | {} | {:.2} |",
                body.len(),
                pct(&ph.latencies, 0.5),
                pct(&ph.latencies, 0.99),
                pct(&ph.latencies, 0.999),
                ph.errors,
                ph.lag.as_secs_f64() * 1000.0
            );
        }
        added.push((
            *name,
            pct(&p.latencies, 0.5) - pct(&d.latencies, 0.5),
            pct(&p.latencies, 0.99) - pct(&d.latencies, 0.99),
            pct(&p.latencies, 0.999) - pct(&d.latencies, 0.999),
        ));
    }
    println!("\n| body | added p50 ms | added p99 ms | added p99.9 ms |");
    println!("|---|---|---|---|");
    for (name, a50, a99, a999) in &added {
        println!("| {name} | {a50:.3} | {a99:.3} | {a999:.3} |");
    }
    println!("\n| body | direct req/s | proxied req/s | ratio | errors (direct/proxied) |");
    println!("|---|---|---|---|---|");
    for (name, path, body, _) in &bodies {
        let (direct_url, proxy_url) = (direct(path), proxied(path));
        let (d, de) = rt.block_on(saturation(
            &client,
            &direct_url,
            body,
            concurrency,
            sat_secs,
        ));
        let (p, pe) = rt.block_on(saturation(&client, &proxy_url, body, concurrency, sat_secs));
        println!("| {name} | {d:.0} | {p:.0} | {:.2} | {de}/{pe} |", p / d);
    }
    if slow_secs > 0 && slow_n > 0 {
        let (done, during) = rt.block_on(slow_streams(&proxy_url, slow_n, slow_secs, child.id()));
        println!(
            "\nslow streams: {slow_n} held open through condense for {slow_secs} s: {done} completed with [DONE], {} dropped; condense RSS during: up to {during:.1} MiB",
            slow_n - done
        );
    }
    let (rss, peak) = memory_mib(child.id());
    println!("\ncondense RSS after the run: {rss:.1} MiB; peak: {peak:.1} MiB");
    let _ = child.kill();
    let _ = child.wait();
}
