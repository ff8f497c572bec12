//! OpenAI Responses through condense, in front of a simulated provider that
//! speaks it (usage, streams ending in `response.completed`, the overflow
//! error without numbers): stateless `input` lists compacted with their
//! pairing and reasoning kept, stateful requests and string input forwarded
//! unchanged, overflow recovered, other Responses routes passed through.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Harness, profile};
use condense::simulate::{CountRule, OverflowStyle, Simulator};
use serde_json::{Value, json};

/// A Codex-like session: a task, then `turns` rounds of reasoning, a
/// message, a shell call and its long output.
fn session(turns: usize, stream: bool) -> Value {
    let mut input = vec![json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Fix the failing test in parser.py"}]})];
    for t in 0..turns {
        input.push(
            json!({"type": "reasoning", "id": format!("rs_{t}"), "summary": [],
            "encrypted_content": format!("gAAAAB{t}{}", "x".repeat(200))}),
        );
        input.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": format!("Running step {t}."), "annotations": []}]}));
        input.push(json!({"type": "function_call", "call_id": format!("call_{t:02}"), "name": "shell",
            "arguments": json!({"command": ["bash", "-lc", format!("cat src/f{t}.py")]}).to_string()}));
        input.push(
            json!({"type": "function_call_output", "call_id": format!("call_{t:02}"),
            "output": format!("def f_{t}():\n{}", "    value = compute(value) + 1\n".repeat(150))}),
        );
    }
    json!({"model": "gpt-5-codex", "instructions": "You are Codex.", "store": false, "stream": stream,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
        "input": input})
}

async fn harness(window: u64, provider_window: u64) -> Harness {
    let h = Harness::with(|c| {
        c.models = vec![profile("gpt-5-codex", window)];
        c.compaction.recall = std::env::var("NORECALL").is_err();
    })
    .await;
    h.mock.set_provider(Simulator::new(
        CountRule::Chars(3.6),
        provider_window,
        OverflowStyle::Bare,
    ));
    h
}

async fn post(h: &Harness, body: &Value) -> reqwest::Response {
    h.client
        .post(h.url("/v1/responses"))
        .bearer_auth("sk-client")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

/// Pairing by call_id and reasoning byte for byte, on a forwarded body.
fn assert_valid(sent: &Value, original: &Value) {
    let theirs = original["input"].as_array().unwrap();
    let mut calls = Vec::new();
    for item in sent["input"].as_array().unwrap() {
        match item["type"].as_str() {
            Some("function_call") => calls.push(item["call_id"].clone()),
            Some("function_call_output") => {
                assert!(calls.contains(&item["call_id"]), "{item}")
            }
            Some("reasoning") => assert!(theirs.contains(item), "{item}"),
            _ => {}
        }
    }
    for key in [
        "instructions",
        "store",
        "include",
        "prompt_cache_key",
        "model",
    ] {
        assert_eq!(sent[key], original[key], "{key} untouched");
    }
    common::assert_client_tools_first(&sent["tools"], &original["tools"]);
}

#[tokio::test]
async fn a_long_stateless_session_is_compacted_and_stays_valid() {
    let h = harness(24_000, 24_000).await;
    for stream in [false, true] {
        let body = session(30, stream);
        let resp = post(&h, &body).await;
        assert_eq!(resp.status(), 200);
        let actions = resp.headers()["x-condense-actions"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(actions.contains("mask"), "{actions}");
        let text = resp.text().await.unwrap();
        if stream {
            assert!(text.contains("event: response.completed"), "{text}");
        }
        let last = h.mock.last();
        assert_eq!(last.path, "/v1/responses");
        assert!(last.body.len() < body.to_string().len() / 2);
        let sent: Value = serde_json::from_slice(&last.body).unwrap();
        assert_valid(&sent, &body);
        // The newest output is the client's.
        assert_eq!(
            sent["input"].as_array().unwrap().last(),
            body["input"].as_array().unwrap().last()
        );
    }
    assert_eq!(
        h.metric("condense_requests_total{route=\"responses\",status_class=\"2xx\"}")
            .await,
        Some(2.0)
    );
    // Usage from the JSON answer and the completed event calibrated it.
    assert!(
        h.metric("condense_upstream_prompt_tokens_total{model=\"gpt-5-codex\"}")
            .await
            .unwrap()
            > 0.0
    );
}

#[tokio::test]
async fn server_side_history_and_string_input_go_upstream_unchanged() {
    let h = harness(4_000, 4_000).await;
    let mut stateful = session(30, false);
    stateful["previous_response_id"] = json!("resp_123");
    let plain = json!({"model": "gpt-5-codex", "input": "x".repeat(50_000)});
    for body in [stateful, plain] {
        let resp = post(&h, &body).await;
        assert_eq!(resp.headers()["x-condense-actions"], "none");
        assert_eq!(h.mock.last().body, body.to_string().as_bytes());
    }
    assert_eq!(
        h.metric("condense_stateful_requests_total{reason=\"previous_response_id\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn an_overflow_without_numbers_is_recovered_once() {
    // condense believes in 200k; the provider holds 16k and says only
    // "context_length_exceeded".
    let h = harness(200_000, 16_000).await;
    for stream in [false, true] {
        let body = session(30, stream);
        let resp = post(&h, &body).await;
        assert_eq!(resp.status(), 200, "stream {stream}");
        let sent: Value = serde_json::from_slice(&h.mock.last().body).unwrap();
        assert_valid(&sent, &body);
    }
    // Each rejected once at most, and recovered by its one retry.
    let m = |outcome: &str| {
        format!(
            "condense_context_overflow_total{{outcome=\"{outcome}\",provider_format=\"openai\"}}"
        )
    };
    let recovered = h.metric(&m("recovered")).await.unwrap();
    assert!((1.0..=2.0).contains(&recovered), "{recovered}");
    assert_eq!(h.metric(&m("failed")).await, Some(0.0));
    assert_eq!(h.metric(&m("not_recoverable")).await, Some(0.0));
}

#[tokio::test]
async fn other_responses_routes_are_forwarded() {
    let h = Harness::start().await;
    for path in ["/v1/responses/compact", "/v1/responses/resp_1/input_items"] {
        let resp = h
            .client
            .post(h.url(path))
            .body(r#"{"model":"m","input":[]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        assert_eq!(h.mock.last().path, path);
        assert!(!resp.headers().contains_key("x-condense-actions"), "{path}");
    }
}

/// Every body the provider received in a replay of `body`, checked.
async fn replay_and_check(body: &Value, window: u64) -> condense::replay::Report {
    use condense::replay::{Provider, replay_received};
    let (report, received) = replay_received(
        &condense::config::Config::default(),
        &bytes::Bytes::from(body.to_string()),
        &condense::offline::CompactOptions {
            model: None,
            window: Some(window),
        },
        &Provider {
            count: CountRule::Chars(3.6),
            window: None,
            overflow: OverflowStyle::Bare,
            lists_window: false,
        },
    )
    .await
    .unwrap();
    assert!(!received.is_empty());
    for (sent, _) in &received {
        assert_valid(&serde_json::from_slice(sent).unwrap(), body);
    }
    report
}

#[tokio::test]
async fn a_replayed_session_sends_only_valid_requests() {
    let report = replay_and_check(&session(60, false), 16_000).await;
    assert_eq!(report.condense.turns_not_fit, 0);
    assert!(report.turns.iter().any(|t| t.actions != "none"));
}

#[tokio::test]
#[ignore = "needs ../shared/traces beside the repository; run with `cargo test -- --ignored shared_traces`"]
async fn the_shared_traces_as_responses_replay_and_stay_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/responses");
    for e in std::fs::read_dir(&dir).expect("../shared/traces/responses") {
        let mut body: Value =
            serde_json::from_slice(&std::fs::read(e.unwrap().path()).unwrap()).unwrap();
        // Encrypted reasoning before every assistant message, as reasoning
        // models send it.
        let input = body["input"].as_array().unwrap().clone();
        let mut with_reasoning = Vec::new();
        for (i, item) in input.into_iter().enumerate() {
            if item["role"] == "assistant" {
                with_reasoning.push(json!({"type": "reasoning", "id": format!("rs_{i}"),
                    "summary": [], "encrypted_content": format!("gAAAA{i}")}));
            }
            with_reasoning.push(item);
        }
        body["input"] = json!(with_reasoning);
        for window in [16_000, 32_000] {
            let r = replay_and_check(&body, window).await;
            assert_eq!(r.condense.turns_not_fit, 0);
        }
    }
}
