//! Passthrough overhead: the same load sent straight to a zero-delay mock
//! upstream and through condense in front of it, in one run.
//!
//! For a small chat request and a ~200 KB agent conversation it reports, at
//! a fixed request rate: latency p50/p99/p99.9 direct and proxied, the added
//! latency, and errors; then at saturation (closed loop, fixed concurrency)
//! the throughput direct and proxied and their ratio; and condense's resident
//! memory when idle and at its peak.
//!
//! Run: `cargo bench --bench passthrough`. Knobs (environment):
//! `BENCH_RATE` (requests/s, default 1000), `BENCH_SECONDS` (per fixed-rate
//! phase, default 30), `BENCH_SATURATION_SECONDS` (default 10),
//! `BENCH_CONCURRENCY` (default 16). condense runs as its own process (the
//! release binary), so its memory is measured alone; the mock upstream and
//! the load generator share this process. On a 2-core machine all three
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

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const RESPONSE: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101}}"#;

/// The zero-delay upstream: reads the body, answers a fixed completion.
async fn mock(req: Request) -> Response {
    let _ = axum::body::to_bytes(req.into_body(), usize::MAX).await;
    let mut r = RESPONSE.into_response();
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
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
    let mut child = Command::new(env!("CARGO_BIN_EXE_condense"))
        .env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env(
            "CONDENSE_UPSTREAM__BASE_URL",
            format!("http://{upstream}/v1"),
        )
        .env("CONDENSE_LOG__LEVEL", "warn,condense=info")
        .env("RUST_LOG", "warn,condense::server=warn,condense=info")
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

fn small_body() -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}
            ]
        })
        .to_string(),
    )
}

/// An agent conversation of about `bytes` bytes: tool calls and results.
fn agent_body(bytes: usize) -> Bytes {
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
    Bytes::from(serde_json::json!({"model": "gpt-4o", "messages": messages}).to_string())
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
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
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
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
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
    let direct_url = format!("http://{upstream}/v1/chat/completions");
    let proxy_url = format!("http://{proxy}/v1/chat/completions");

    println!(
        "condense passthrough benchmark: {rate} req/s for {secs} s per phase; saturation {concurrency} workers for {sat_secs} s"
    );
    println!("condense idle RSS: {idle_rss:.1} MiB\n");
    println!("| body | path | p50 ms | p99 ms | p99.9 ms | errors | max send lag ms |");
    println!("|---|---|---|---|---|---|---|");
    let bodies = [
        ("small (~200 B)", small_body()),
        ("agent (~200 KB)", agent_body(200 * 1024)),
    ];
    let mut added = Vec::new();
    for (name, body) in &bodies {
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
    for (name, body) in &bodies {
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
    let (rss, peak) = memory_mib(child.id());
    println!("\ncondense RSS after the run: {rss:.1} MiB; peak: {peak:.1} MiB");
    let _ = child.kill();
    let _ = child.wait();
}
