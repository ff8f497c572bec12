//! Overflow recovery through the proxy: an upstream whose real window is
//! much smaller than condense believes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::Ordering;

use common::{Harness, Redis};
use serde_json::{Value, json};

/// A coding-agent conversation of about 16k tokens for gpt-4o (a 128k
/// window in condense's table).
fn session(turns: usize) -> Value {
    common::coding_session("gpt-4o", turns, 0, 60)
}

async fn send(h: &Harness, body: &Value, extra: &[(&str, &str)]) -> reqwest::Response {
    let mut req = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-token-factor", "1.0");
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    req.body(body.to_string()).send().await.unwrap()
}

#[tokio::test]
async fn an_overflow_is_recovered_and_later_requests_are_compacted_first() {
    let h = Harness::start().await;
    let window = [("x-mock-window", "8192")];
    let first = [
        ("x-mock-window", "8192"),
        ("authorization", "Bearer sk-client"),
        ("openai-organization", "org-1"),
    ];
    let resp = send(&h, &session(14), &first).await;
    assert_eq!(resp.status(), 200);
    // The retry goes with the rejected request's headers (the client's
    // key among them); only the body's length differs.
    let sent: Vec<_> = h
        .mock
        .chat_requests()
        .iter()
        .map(|r| {
            let mut h = r.headers.clone();
            h.remove("content-length");
            h
        })
        .collect();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0], sent[1]);
    assert_eq!(sent[1]["authorization"], "Bearer sk-client");
    assert_eq!(sent[1]["openai-organization"], "org-1");
    assert_eq!(sent[1]["accept-encoding"], "identity");
    let actions = resp.headers()["x-condense-actions"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(actions.contains("mask"), "{actions}");
    let answer: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], "Hello there!");
    assert_eq!(h.mock.state.overflows.load(Ordering::SeqCst), 1);
    assert_eq!(
        h.mock.chat_requests().len(),
        2,
        "one rejected request, one retry"
    );
    assert_eq!(
        h.metric(
            "condense_context_overflow_total{outcome=\"recovered\",provider_format=\"openai\"}"
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        h.metric("condense_context_window_tokens{model=\"gpt-4o\"}")
            .await,
        Some(8192.0)
    );

    // The next turn, streamed: compacted before sending, never rejected.
    let mut body = session(15);
    body["stream"] = json!(true);
    let resp = send(&h, &body, &window).await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(
        text.contains("Hello") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    assert_eq!(h.mock.state.overflows.load(Ordering::SeqCst), 1);
    assert_eq!(h.mock.chat_requests().len(), 3);
}

/// A retry's placeholders are the bytes the next turn sends, recall keys
/// and all: the retry offers none of condense's tools, but written without
/// keys its masked results were rewritten on the next turn, and the
/// provider's cached prefix broke a second time in a row.
#[tokio::test]
async fn a_retry_writes_the_placeholders_the_next_turn_sends() {
    let h = Harness::start().await;
    let window = [("x-mock-window", "8192")];
    let with_tools = |turns| {
        let mut body = session(turns);
        body["tools"] = json!([{"type": "function", "function": {
            "name": "run",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        }}]);
        body
    };
    assert_eq!(send(&h, &with_tools(14), &window).await.status(), 200);
    assert_eq!(send(&h, &with_tools(15), &window).await.status(), 200);
    let sent: Vec<Value> = h
        .mock
        .chat_requests()
        .iter()
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    assert_eq!(
        sent.len(),
        3,
        "a rejected request, its retry, the next turn"
    );
    let (retry, next) = (&sent[1], &sent[2]);
    let tools = retry["tools"].to_string();
    assert!(!tools.contains("condense_recall"), "{tools}");
    // The results both mask, by call.
    let masked = |body: &Value| -> Vec<(String, Value)> {
        body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool" && m.to_string().contains("[condense:"))
            .map(|m| (m["tool_call_id"].to_string(), m.clone()))
            .collect()
    };
    let later = masked(next);
    let mut both = 0;
    for (id, m) in masked(retry) {
        assert!(m.to_string().contains("recall key: "), "{m}");
        if let Some((_, again)) = later.iter().find(|(i, _)| *i == id) {
            assert_eq!(&m, again, "the next turn rewrote {id}");
            both += 1;
        }
    }
    assert!(both >= 5, "{both} results masked by both");
}

#[tokio::test]
async fn a_streamed_request_is_recovered_before_its_first_byte() {
    let h = Harness::start().await;
    let mut body = session(14);
    body["stream"] = json!(true);
    let resp = send(&h, &body, &[("x-mock-window", "8192")]).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let text = resp.text().await.unwrap();
    assert!(
        text.starts_with("data: {") && text.contains("Hello"),
        "{text}"
    );
    assert!(!text.contains("\"usage\""), "usage chunk stripped as usual");
    assert_eq!(h.mock.state.overflows.load(Ordering::SeqCst), 1);
    assert_eq!(h.mock.chat_requests().len(), 2);
}

#[tokio::test]
async fn a_second_overflow_returns_the_upstreams_error_byte_for_byte() {
    let h = Harness::start().await;
    let resp = send(&h, &session(14), &[("x-mock-always-overflow", "1")]).await;
    assert_eq!(resp.status(), 400);
    let got = resp.bytes().await.unwrap();
    let sent = h.mock.chat_requests();
    assert_eq!(sent.len(), 2, "exactly one retry");
    assert!(
        sent[1].body.len() < sent[0].body.len(),
        "the retry was compacted"
    );
    // The client sees the retry's error, exactly as the upstream wrote it.
    let second: Value = serde_json::from_slice(&got).unwrap();
    let msg = second["error"]["message"].as_str().unwrap();
    let retry_tokens: u64 = msg
        .split("resulted in ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_tokens < 8192, "{msg}");
    assert_eq!(second["error"]["code"], "context_length_exceeded");
    assert_eq!(
        h.metric("condense_context_overflow_total{outcome=\"failed\",provider_format=\"openai\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn an_overflow_that_cannot_be_made_to_fit_is_returned_unchanged() {
    let h = Harness::start().await;
    // Not even the system prompt and the task fit in 20 tokens.
    let resp = send(&h, &session(14), &[("x-mock-window", "20")]).await;
    assert_eq!(resp.status(), 400);
    let body: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 20 tokens")
    );
    assert_eq!(h.mock.chat_requests().len(), 1, "no retry");
    assert_eq!(
        h.metric("condense_context_overflow_total{outcome=\"not_recoverable\",provider_format=\"openai\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn a_throttle_passes_through_with_retry_after_and_nothing_compacted() {
    let h = Harness::start().await;
    let throttle = json!({"error": {"message": "Rate limit reached for gpt-4o in organization org-1 on tokens per min (TPM): Limit 30000, Used 26000, Requested 8000. Please try again in 8s.", "type": "tokens", "param": null, "code": "rate_limit_exceeded"}}).to_string();
    let body = session(14);
    let resp = send(
        &h,
        &body,
        &[("x-mock-status", "429"), ("x-mock-body", &throttle)],
    )
    .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "7");
    assert_eq!(resp.text().await.unwrap(), throttle);
    let sent = h.mock.chat_requests();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].json(), body, "forwarded as the client sent it");
    let metrics = h.metrics().await;
    let counted: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("condense_context_overflow_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(counted.is_empty(), "{counted:?}");
}

#[tokio::test]
async fn a_request_too_large_for_the_tpm_limit_is_recovered() {
    let h = Harness::start().await;
    let too_large = json!({"error": {"message": "Request too large for gpt-4o in organization org-1 on tokens per min (TPM): Limit 6000, Requested 15000. The input or output tokens must be reduced in order to run successfully.", "type": "tokens", "param": null, "code": "rate_limit_exceeded"}}).to_string();
    // The mock answers every request with the 429; the retry gets it too,
    // but it went out compacted to the limit.
    let resp = send(
        &h,
        &session(14),
        &[("x-mock-status", "429"), ("x-mock-body", &too_large)],
    )
    .await;
    assert_eq!(resp.status(), 429);
    let sent = h.mock.chat_requests();
    assert_eq!(sent.len(), 2);
    assert!(sent[1].body.len() * 2 < sent[0].body.len());
    assert_eq!(
        h.metric(
            "condense_context_overflow_total{outcome=\"failed\",provider_format=\"openai_tpm\"}"
        )
        .await,
        Some(1.0)
    );
}

/// The next turn of the session, sent to replica `b` against the same
/// 8192-token window; it must come back 200.
async fn next_turn_on(a: &Harness, b: &condense::server::Server) {
    let resp = a
        .client
        .post(format!("http://{}/v1/chat/completions", b.local_addr()))
        .header("x-mock-token-factor", "1.0")
        .header("x-mock-window", "8192")
        .body(session(15).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.text().await.unwrap();
}

#[tokio::test]
#[ignore = "needs redis-server; run with `cargo test -- --ignored redis`"]
async fn a_window_learned_by_one_replica_reaches_the_others_through_redis() {
    let redis = Redis::start();
    let url = redis.url();
    let setup = |c: &mut condense::config::Config| {
        c.state.redis_url = Some(condense::config::Secret::new(&url));
    };
    let a = Harness::with(setup).await;
    let b = a.replica(setup).await;

    let window = [("x-mock-window", "8192")];
    assert_eq!(send(&a, &session(14), &window).await.status(), 200);
    assert_eq!(a.mock.state.overflows.load(Ordering::SeqCst), 1);
    next_turn_on(&a, &b).await;
    assert_eq!(
        a.mock.state.overflows.load(Ordering::SeqCst),
        1,
        "replica b compacted against the window a learned"
    );
    b.shutdown().await.unwrap();
}

#[tokio::test]
#[ignore = "needs redis-server; run with `cargo test -- --ignored redis`"]
async fn a_window_learned_through_redis_expires_there_too() {
    let redis = Redis::start();
    let url = redis.url();
    let setup = |c: &mut condense::config::Config| {
        c.state.redis_url = Some(condense::config::Secret::new(&url));
        c.tokens.learned_window_ttl_seconds = 1;
    };
    let a = Harness::with(setup).await;
    let window = [("x-mock-window", "8192")];
    assert_eq!(send(&a, &session(14), &window).await.status(), 200);
    assert_eq!(a.mock.state.overflows.load(Ordering::SeqCst), 1);
    // Past the time to live, a replica started now finds nothing in Redis:
    // it sends the conversation whole and is rejected once more.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let b = a.replica(setup).await;
    next_turn_on(&a, &b).await;
    assert_eq!(a.mock.state.overflows.load(Ordering::SeqCst), 2);
    b.shutdown().await.unwrap();
}

/// Sends a recorded conversation turn by turn (each prefix that ends before
/// an assistant message) through condense, configured with a 128k window,
/// to a mock upstream that enforces a smaller `window`. Returns (requests the upstream
/// rejected, responses that were not 200 for the client, turns).
async fn replay_against_a_small_window(
    path: &std::path::Path,
    window: &str,
) -> (usize, usize, usize) {
    let h = Harness::with(|c| {
        c.models = vec![common::profile("*", 131_072)];
    })
    .await;
    let full: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let messages = full["messages"].as_array().unwrap();
    let mut errors = 0;
    let mut turns = 0;
    for end in
        (1..=messages.len()).filter(|&e| e == messages.len() || messages[e]["role"] == "assistant")
    {
        let mut body = full.clone();
        body["messages"] = json!(messages[..end]);
        body["max_tokens"] = json!(1024);
        let resp = send(&h, &body, &[("x-mock-window", window)]).await;
        turns += 1;
        if resp.status() != 200 {
            errors += 1;
        }
        let _ = resp.bytes().await;
    }
    (h.mock.state.overflows.load(Ordering::SeqCst), errors, turns)
}

#[tokio::test]
async fn a_whole_conversation_against_a_smaller_real_window_is_rejected_once() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/agent-session.json");
    let (rejected, errors, turns) = replay_against_a_small_window(&path, "6144").await;
    assert_eq!(errors, 0, "no client errors over {turns} turns");
    assert_eq!(rejected, 1);
}

#[tokio::test]
#[ignore = "needs ../shared/traces beside the repository; run with `cargo test -- --ignored shared_traces`"]
async fn the_shared_traces_against_a_smaller_real_window_are_rejected_at_most_once() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/conversations");
    for e in std::fs::read_dir(&dir).expect("../shared/traces/conversations") {
        let p = e.unwrap().path();
        let (rejected, errors, turns) = replay_against_a_small_window(&p, "16384").await;
        eprintln!(
            "{}: {turns} turns, {rejected} rejected upstream, {errors} client errors",
            p.display()
        );
        assert_eq!(errors, 0, "{}", p.display());
        assert!(rejected <= 1, "{}: {rejected}", p.display());
    }
}

/// Tenant `key`'s request through condense (gated by client keys), with
/// the mock steered by `extra`.
async fn send_as(
    h: &Harness,
    key: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> reqwest::Response {
    let auth = format!("Bearer {key}");
    let mut headers = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    send(h, body, &headers).await
}

/// The body of the last chat request the upstream saw.
fn last_sent(h: &Harness) -> bytes::Bytes {
    h.mock.chat_requests().pop().unwrap().body
}

const WINDOW_GAUGE: &str = "condense_context_window_tokens{model=\"gpt-4o\"}";

#[tokio::test]
async fn an_error_echoing_one_tenants_input_does_not_shrink_anothers_window() {
    let h = Harness::with(|c| {
        c.auth.client_keys = vec![
            condense::config::Secret::new("tenant-a"),
            condense::config::Secret::new("tenant-b"),
        ];
        c.upstream.api_key = Some(condense::config::Secret::new("sk-shared-upstream"));
    })
    .await;
    // Tenant A's conversation fits gpt-4o's 128k window: it goes as sent.
    let a = session(14);
    let resp = send_as(&h, "tenant-a", &a, &[]).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    assert_eq!(last_sent(&h), a.to_string());
    assert_eq!(h.metric(WINDOW_GAUGE).await, Some(128_000.0));

    // Tenant B puts an overflow's wording in a field the upstream echoes
    // in its 400, in OpenAI's words and in vLLM's.
    for (style, quote) in [
        ("openai", "maximum context length is 50 tokens"),
        (
            "vllm",
            "This model's maximum context length is 50 tokens. However, your messages resulted in 60 tokens.",
        ),
    ] {
        let mut b = common::chat_body(false);
        b["reasoning_effort"] = json!(quote);
        let echo = [
            ("x-mock-echo-field", "reasoning_effort"),
            ("x-mock-echo-style", style),
        ];
        let resp = send_as(&h, "tenant-b", &b, &echo).await;
        assert_eq!(resp.status(), 400, "{style}");
        let error = resp.text().await.unwrap();
        assert!(
            error.contains(quote),
            "{style}: the upstream's error as it wrote it: {error}"
        );
    }
    let sent = h.mock.chat_requests();
    assert_eq!(sent.len(), 3, "no retry of tenant B's requests");
    let metrics = h.metrics().await;
    let counted: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("condense_context_overflow_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(counted.is_empty(), "{counted:?}");

    // Tenant A's next turn still goes as sent, against the same window.
    let a = session(15);
    let resp = send_as(&h, "tenant-a", &a, &[]).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    let _ = resp.bytes().await;
    assert_eq!(last_sent(&h), a.to_string());
    assert_eq!(h.metric(WINDOW_GAUGE).await, Some(128_000.0));
}

#[tokio::test]
async fn an_overflow_does_not_lower_the_window_below_a_prompt_the_upstream_accepted() {
    let h = Harness::start().await;
    // A prompt of some 16k tokens is accepted (the mock reports condense's
    // own count of it).
    let accepted = session(14);
    let resp = send(&h, &accepted, &[]).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    let req =
        condense::chat::ChatRequest::parse(&bytes::Bytes::from(accepted.to_string())).unwrap();
    let floor = condense::tokens::count_request(&req, condense::tokens::Encoding::O200k);
    assert!(floor > 8192, "{floor}");

    // Then the upstream says the window is 8192: the request it rejected
    // is retried at 8192 ...
    let resp = send(&h, &session(15), &[("x-mock-window", "8192")]).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    assert_eq!(h.mock.state.overflows.load(Ordering::SeqCst), 1);
    assert_eq!(h.mock.chat_requests().len(), 3, "one retry");
    // ... but the window learned for the model stays at the prompt it
    // accepted.
    let resp = send(&h, &session(15), &[]).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    assert_eq!(h.metric(WINDOW_GAUGE).await, Some(floor as f64));
}

#[tokio::test]
async fn a_learned_window_expires() {
    // (The exact lifetimes are unit-tested on a clock condense is handed;
    // this one shows the setting reaches the proxy.)
    let h = Harness::with(|c| c.tokens.learned_window_ttl_seconds = 2).await;
    let tokens = h.server.as_ref().unwrap().state().proxy.tokens.clone();
    let upstream = h.mock.base_url();
    let resp = send(&h, &session(14), &[("x-mock-window", "8192")]).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    let info = tokens.model_info(&upstream, "gpt-4o");
    assert_eq!(
        (info.window, info.source),
        (8192, condense::tokens::WindowSource::Overflow)
    );
    // Once it is over, the model's window from its profile again: the
    // next turn goes as sent.
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    assert_eq!(tokens.model_info(&upstream, "gpt-4o").window, 128_000);
    let next = session(15);
    let resp = send(&h, &next, &[]).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    assert_eq!(last_sent(&h), next.to_string());
    assert_eq!(h.metric(WINDOW_GAUGE).await, Some(128_000.0));
}
