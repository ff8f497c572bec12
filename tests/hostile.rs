//! Hostile and malformed input: condense answers with a clear error or
//! forwards the request for the upstream to judge; it never panics (a panic
//! anywhere in the process fails these tests), never hangs, and never
//! alters a request that was not under pressure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::Harness;
use condense::config::Config;
use serde_json::{Value, json};

static PANICS: AtomicUsize = AtomicUsize::new(0);
static HOOK: Once = Once::new();

/// Counts every panic in the process (condense catches them to fail open,
/// so they would otherwise go unnoticed).
fn count_panics() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
}

async fn harness() -> Harness {
    count_panics();
    Harness::with(|c: &mut Config| {
        c.models.push(common::profile("tiny-*", 4096));
    })
    .await
}

async fn post(h: &Harness, body: impl Into<reqwest::Body>) -> reqwest::Response {
    tokio::time::timeout(
        Duration::from_secs(60),
        h.client
            .post(h.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send(),
    )
    .await
    .expect("condense hung")
    .unwrap()
}

/// The request reached the upstream byte for byte, and condense neither
/// panicked nor counted a failure.
async fn forwarded_unchanged(h: &Harness, sent: &[u8]) {
    let got = h.mock.last();
    assert_eq!(got.body.len(), sent.len());
    assert!(got.body[..] == sent[..], "the request was altered");
    clean(h).await;
}

async fn clean(h: &Harness) {
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "condense panicked");
    assert_eq!(
        h.metric("condense_compaction_failures_total").await,
        Some(0.0)
    );
}

#[tokio::test]
async fn bodies_that_are_not_chat_json_are_forwarded_for_the_upstream_to_judge() {
    let h = harness().await;
    let mut deep = String::from(r#"{"model":"gpt-4o","messages":[],"x":"#);
    deep.push_str(&"[".repeat(100_000));
    deep.push_str(&"]".repeat(100_000));
    deep.push('}');
    let cases: Vec<Vec<u8>> = vec![
        b"not json at all".to_vec(),
        b"".to_vec(),
        b"{\"model\":\"gpt-4o\",\"messages\":[".to_vec(),
        vec![0xff, 0xfe, b'{', 0x80, b'}'],
        b"{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"
            .to_vec(),
        b"[1,2,3]".to_vec(),
        b"null".to_vec(),
        deep.into_bytes(),
    ];
    for body in cases {
        let resp = post(&h, body.clone()).await;
        assert!(resp.status().is_success(), "{}", resp.status());
        let _ = resp.bytes().await;
        forwarded_unchanged(&h, &body).await;
    }
}

#[tokio::test]
async fn wrong_types_in_every_field_are_forwarded_unchanged() {
    let h = harness().await;
    let good = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let mutations: Vec<(&str, Value)> = vec![
        ("/model", json!(42)),
        ("/model", json!(null)),
        ("/messages", json!("hello")),
        ("/messages", json!({"role": "user"})),
        ("/messages/0", json!("user: hi")),
        ("/messages/0/role", json!(7)),
        ("/messages/0/content", json!(3.5)),
        ("/messages/0/content", json!({"text": "hi"})),
        ("/messages/0/content", json!([1, 2, {"type": 9}])),
        ("/stream", json!("yes")),
        ("/stream_options", json!("include")),
        ("/max_tokens", json!("many")),
        ("/max_tokens", json!(-5)),
        ("/max_completion_tokens", json!(1e300)),
        ("/tools", json!("all of them")),
        ("/tools", json!([{"type": "function", "function": 5}])),
    ];
    for (path, value) in mutations {
        let mut body = good.clone();
        match body.pointer_mut(path) {
            Some(slot) => *slot = value,
            None => {
                body.as_object_mut()
                    .unwrap()
                    .insert(path.trim_start_matches('/').to_string(), value);
            }
        }
        let raw = body.to_string();
        let resp = post(&h, raw.clone()).await;
        assert!(resp.status().as_u16() < 500, "{path}: {}", resp.status());
        let _ = resp.bytes().await;
        forwarded_unchanged(&h, raw.as_bytes()).await;
    }
}

/// A conversation under pressure (a 4k window) with odd but legal, and odd
/// and illegal, messages: compacted without a panic into a valid request.
#[tokio::test]
async fn odd_messages_under_pressure_are_compacted_safely() {
    let h = harness().await;
    let big = "line of output with /src/path.rs:12 error\n".repeat(200);
    let mut messages = vec![
        json!({"role": "system", "content": [{"type": "text", "text": "You are an agent."}]}),
        json!({"role": "developer", "content": "Be careful."}),
        json!({"role": "user", "content": [
            {"type": "text", "text": "Look at this."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}),
        json!({"role": "tool", "tool_call_id": "orphan", "content": big}),
        json!({"role": "wizard", "content": big}),
        json!({"role": "assistant", "content": null, "refusal": "no"}),
    ];
    for t in 0..12 {
        // Every turn reuses the same call id.
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "dup", "type": "function", "function": {"name": "run", "arguments": format!("{{\"cmd\":\"{}\"}}", "x".repeat(800))}},
            {"id": "dup", "type": "function", "function": {"name": "run", "arguments": "not json {"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": "dup", "content": [{"type": "text", "text": big}]}));
        messages
            .push(json!({"role": "tool", "tool_call_id": "dup", "content": format!("{t}: {big}")}));
        messages.push(json!({"role": "function", "name": "old_style", "content": big}));
    }
    messages.push(json!({"role": "user", "content": "Now fix it."}));
    let body = json!({"model": "tiny-agent", "messages": messages, "max_tokens": 256});
    let resp = post(&h, body.to_string()).await;
    assert_eq!(resp.status(), 200);
    let actions = resp.headers()["x-condense-actions"]
        .to_str()
        .unwrap()
        .to_string();
    assert_ne!(actions, "none");
    let _ = resp.bytes().await;
    let sent = h.mock.last().json();
    let out = sent["messages"].as_array().unwrap();
    assert_eq!(out[0], messages[0]);
    assert_eq!(out[1], messages[1]);
    assert_eq!(out.last(), messages.last());
    assert!(h.mock.last().body.len() < body.to_string().len());
    clean(&h).await;
}

#[tokio::test]
async fn a_hundred_thousand_messages_neither_panic_nor_hang() {
    let h = harness().await;
    let mut messages = vec![json!({"role": "system", "content": "s"})];
    for i in 0..50_000 {
        messages.push(json!({"role": "user", "content": format!("question {i}")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {i}")}));
    }
    messages.push(json!({"role": "user", "content": "last"}));
    let body = json!({"model": "gpt-4o", "messages": messages}).to_string();
    let resp = post(&h, body.clone()).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await;
    let sent = h.mock.last().json();
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "s"})
    );
    assert_eq!(
        sent["messages"].as_array().unwrap().last().unwrap(),
        &json!({"role": "user", "content": "last"})
    );
    clean(&h).await;
}

#[tokio::test]
async fn a_huge_string_is_measured_and_forwarded() {
    let h = harness().await;
    let huge = "word ".repeat(800_000);
    let body =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": huge}]}).to_string();
    let resp = post(&h, body.clone()).await;
    assert_eq!(resp.status(), 200);
    // The last user message is never cut: forwarded as it came (it does
    // not fit; the upstream will say so).
    let _ = resp.bytes().await;
    forwarded_unchanged(&h, body.as_bytes()).await;
}

/// condense echoes `x-request-id`; a client cannot use it to split the
/// response or add headers to it. (A bare LF between two headers is two
/// headers to any HTTP/1.1 parser: that is the client's own header, not an
/// injection, and it goes upstream like any other.)
#[tokio::test]
async fn header_tricks_cannot_split_the_response() {
    let h = harness().await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for trick in [
        "x-request-id: abc\ninjected: 1\r\n",
        "x-request-id: abc\r\n injected: 1\r\n",
        "x-request-id: a\0b\r\n",
        "x-request-id: a\rinjected: 1\r\n",
        "x-request-id: abc%0d%0ainjected:%201\r\n",
    ] {
        let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{trick}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut resp = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut resp)).await;
        let text = String::from_utf8_lossy(&resp);
        assert!(text.starts_with("HTTP/1.1 "), "{trick:?}: {text}");
        assert!(!text.starts_with("HTTP/1.1 5"), "{trick:?}: {text}");
        let head = text.split("\r\n\r\n").next().unwrap();
        for line in head.lines().skip(1) {
            assert!(
                !line.to_ascii_lowercase().starts_with("injected"),
                "{trick:?}: {head}"
            );
            assert!(line.contains(':'), "{trick:?}: {head}");
        }
    }
    clean(&h).await;
}
