//! Memory of one large request, end to end, on the three routes (chat
//! completions, Anthropic Messages, Responses): the peak of the heap above
//! what the process held before the request, counted exactly by a global
//! allocator that keeps the bytes allocated now and at most (`peak_alloc`).
//!
//! Issue 34's attacks, each under 128 MiB: a 12 MB user message that is
//! one word (no space: one piece to the tokenizer), and one assistant turn
//! of 80,000 tool calls followed by their 80,000 results, as the last
//! exchange but one and one exchange earlier still (summarized into a
//! checkpoint either way).
//! Each goes through the real proxy in process, in front of the mock
//! upstream, for a model with a 16k window, so that it is counted and
//! compacted, not only counted; the response must say which stages ran.
//!
//! Everything in this process allocates through the tracker, the client
//! and the mock too: the bodies are made before the baseline is taken, the
//! mock keeps what condense sends it (the compacted request, a few
//! kilobytes), and the requests run one at a time, so that a peak is one
//! request's. The tests in this file take turns for the same reason.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::Harness;
use peak_alloc::PeakAlloc;
use serde_json::{Value, json};
use tokio::sync::Mutex;

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

/// The bound of issue 34.
const LIMIT: usize = 128 << 20;

/// The window of the model the requests name (tokens).
const WINDOW: u64 = 16_384;

/// Longest one request may take (a debug build counts a 12 MB word in
/// tens of seconds).
const DEADLINE: Duration = Duration::from_secs(600);

/// One test at a time: the counters are the whole process's.
static TURN: Mutex<()> = Mutex::const_new(());

const ROUTES: [&str; 3] = ["/v1/chat/completions", "/v1/messages", "/v1/responses"];

async fn harness() -> Harness {
    Harness::with(|c| c.models.push(common::profile("memory-*", WINDOW))).await
}

/// `len` lowercase letters in no pattern: a word that merges on and on.
fn word(len: usize) -> String {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// A conversation whose first user message is `text`, answered, then a
/// short last user message (which stages never shorten): in the shape of
/// each route.
fn long_message(route: &str, text: &str) -> Value {
    let answer = "I read it.";
    let next = "Now summarize it in one line.";
    match route {
        "/v1/messages" => json!({"model": "memory-claude", "max_tokens": 256, "messages": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": next}]}),
        "/v1/responses" => json!({"model": "memory-gpt", "input": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": next}]}),
        _ => json!({"model": "memory-gpt", "max_tokens": 256, "messages": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": next}]}),
    }
}

/// A task, one assistant turn of `calls` tool calls, all their results,
/// the answer to them and a next task, then `later` more exchanges (an
/// answer and a next task each): in the shape of each route. With one
/// exchange after it, the plan's first drop pass takes the huge turn;
/// without, the pass after the frontier moved into the recent turns does
/// (`plan.rs`). Either way a checkpoint replaces the whole turn (the
/// summarizer reads a bounded part of it, `summary/transcript.rs`).
fn tool_calls(route: &str, calls: usize, later: usize) -> Value {
    let task = "Stat every file, one call each.";
    let more = (0..later).flat_map(|i| {
        [
            json!({"role": "assistant", "content": format!("Done with step {i}.")}),
            json!({"role": "user", "content": format!("Now step {}.", i + 1)}),
        ]
    });
    let args = |i: usize| json!({"cmd": format!("stat src/file_{i}.rs")});
    let out = |i: usize| format!("src/file_{i}.rs: {} bytes, modified today", 1000 + i % 977);
    let (answer, next) = ("All files are there.", "Which is the largest?");
    match route {
        "/v1/messages" => {
            let uses: Vec<Value> = (0..calls)
                .map(|i| json!({"type": "tool_use", "id": format!("toolu_{i}"), "name": "run", "input": args(i)}))
                .collect();
            let results: Vec<Value> = (0..calls)
                .map(|i| json!({"type": "tool_result", "tool_use_id": format!("toolu_{i}"), "content": out(i)}))
                .collect();
            let mut messages = vec![
                json!({"role": "user", "content": task}),
                json!({"role": "assistant", "content": uses}),
                json!({"role": "user", "content": results}),
                json!({"role": "assistant", "content": answer}),
                json!({"role": "user", "content": next}),
            ];
            messages.extend(more);
            json!({"model": "memory-claude", "max_tokens": 256, "messages": messages})
        }
        "/v1/responses" => {
            let mut input = vec![json!({"role": "user", "content": task})];
            input.extend((0..calls).map(|i| json!({"type": "function_call", "call_id": format!("call_{i}"), "name": "run", "arguments": args(i).to_string()})));
            input.extend((0..calls).map(|i| json!({"type": "function_call_output", "call_id": format!("call_{i}"), "output": out(i)})));
            input.push(json!({"role": "assistant", "content": answer}));
            input.push(json!({"role": "user", "content": next}));
            input.extend(more);
            json!({"model": "memory-gpt", "input": input})
        }
        _ => {
            let made: Vec<Value> = (0..calls)
                .map(|i| json!({"id": format!("call_{i}"), "type": "function", "function": {"name": "run", "arguments": args(i).to_string()}}))
                .collect();
            let mut messages = vec![
                json!({"role": "user", "content": task}),
                json!({"role": "assistant", "content": null, "tool_calls": made}),
            ];
            messages.extend((0..calls).map(
                |i| json!({"role": "tool", "tool_call_id": format!("call_{i}"), "content": out(i)}),
            ));
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": next}));
            messages.extend(more);
            json!({"model": "memory-gpt", "max_tokens": 256, "messages": messages})
        }
    }
}

/// What one request cost.
struct Cost {
    route: &'static str,
    body: usize,
    /// Peak heap above the baseline, in bytes.
    peak: usize,
    actions: String,
}

/// Sends `body` to `route` and returns the peak heap above what the
/// process held just before, once condense's work after the answer
/// (counting what it sent, for calibration) is done too.
async fn send(h: &Harness, route: &'static str, body: Vec<u8>) -> Cost {
    let size = body.len();
    let base = HEAP.current_usage();
    HEAP.reset_peak_usage();
    let mut req = h
        .client
        .post(h.url(route))
        .header("content-type", "application/json");
    if route == "/v1/messages" {
        req = req.header("anthropic-version", "2023-06-01");
    }
    let resp = tokio::time::timeout(DEADLINE, req.body(body).send())
        .await
        .unwrap_or_else(|_| panic!("{route}: no answer within {DEADLINE:?}"))
        .unwrap();
    let status = resp.status();
    let actions = resp
        .headers()
        .get("x-condense-actions")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "{route}: {text}");
    h.server.as_ref().unwrap().state().proxy.settled().await;
    Cost {
        route,
        body: size,
        peak: HEAP.peak_usage().saturating_sub(base),
        actions,
    }
}

/// Asserts every cost is within [`LIMIT`] and that compaction ran.
fn check(what: &str, costs: &[Cost]) {
    let table: String = costs
        .iter()
        .map(|c| {
            format!(
                "\n  {:<22} {:>5.1} MB body, peak +{:>6.1} MiB, actions {}",
                c.route,
                c.body as f64 / 1e6,
                c.peak as f64 / (1 << 20) as f64,
                c.actions
            )
        })
        .collect();
    eprintln!("{what}:{table}");
    for c in costs {
        assert!(c.peak < LIMIT, "{what}, {}: over 128 MiB:{table}", c.route);
        assert!(
            !c.actions.is_empty() && c.actions != "none",
            "{what}, {}: not compacted:{table}",
            c.route
        );
    }
}

/// A small request on every route first: what the first request builds
/// once for good (the tokenizer's tables, connection pools) is not a large
/// request's cost.
async fn warm_up(h: &Harness) {
    for route in ROUTES {
        let body = long_message(route, "hello").to_string().into_bytes();
        send(h, route, body).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_12_mb_word_stays_under_128_mib_on_every_route() {
    let _turn = TURN.lock().await;
    let h = harness().await;
    warm_up(&h).await;
    let text = word(12_000_000);
    let mut costs = Vec::new();
    for route in ROUTES {
        let body = serde_json::to_vec(&long_message(route, &text)).unwrap();
        costs.push(send(&h, route, body).await);
    }
    check("a 12 MB one-word message", &costs);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_of_80k_tool_calls_stays_under_128_mib_on_every_route() {
    summarized_80k_calls(0, "80,000 tool calls in one turn").await;
}

/// The same turn one exchange later: it is dropped in the first pass, and
/// a checkpoint replaces all 160,000 of its calls and results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_80k_tool_calls_stays_under_128_mib_on_every_route() {
    summarized_80k_calls(1, "80,000 tool calls, one exchange later").await;
}

/// [`tool_calls`] of 80,000 calls with `later` exchanges after them, on
/// every route: each within [`LIMIT`], the huge turn summarized.
async fn summarized_80k_calls(later: usize, what: &str) {
    let _turn = TURN.lock().await;
    let h = harness().await;
    warm_up(&h).await;
    let mut costs = Vec::new();
    for route in ROUTES {
        let body = serde_json::to_vec(&tool_calls(route, 80_000, later)).unwrap();
        costs.push(send(&h, route, body).await);
    }
    check(what, &costs);
    for c in &costs {
        assert!(
            c.actions.contains("summarize"),
            "{}: the huge turn was not summarized ({})",
            c.route,
            c.actions
        );
    }
    h.shutdown().await;
}
