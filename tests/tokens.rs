//! Token accounting through the proxy: calibration against the upstream's
//! usage, the per-message cache, windows learned from /v1/models, and the
//! headers a client sees.

#![allow(clippy::unwrap_used)]

mod common;

use common::Harness;
use condense::config::Config;
use serde_json::{Value, json};

/// A model with a small window, so modest requests are measured (not
/// waved through on the cheap path).
fn small_window(c: &mut Config) {
    c.models.push(common::profile("small-*", 4096));
}

fn conversation(model: &str, turns: usize, stream: bool) -> Value {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a careful coding agent."})];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Step {i}: look at src/module_{i}.rs and report what it does in detail.")}));
        messages.push(json!({"role": "assistant", "content": format!("Module {i} parses configuration files, validates {i} fields and returns a typed struct.")}));
    }
    json!({"model": model, "messages": messages, "stream": stream, "max_tokens": 500})
}

async fn send(h: &Harness, body: &Value, factor: f64) -> (reqwest::header::HeaderMap, String) {
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-token-factor", factor.to_string())
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    (headers, resp.text().await.unwrap())
}

fn header_u64(h: &reqwest::header::HeaderMap, name: &str) -> u64 {
    h[name].to_str().unwrap().parse().unwrap()
}

async fn calibrates_to(factor: f64, stream: bool) {
    let h = Harness::with(small_window).await;
    let model = if stream { "small-stream" } else { "small-json" };
    for turns in 20..25 {
        send(&h, &conversation(model, turns, stream), factor).await;
    }
    let (headers, _) = send(&h, &conversation(model, 25, stream), factor).await;
    // The estimate of what was sent (compacted or not) against what the
    // upstream counted for it.
    let estimate = header_u64(&headers, "x-condense-tokens-after") as f64;
    // What the mock reported for that last body.
    let req = condense::chat::ChatRequest::parse(&h.mock.last().body).unwrap();
    let truth =
        condense::tokens::count_request(&req, condense::tokens::Encoding::O200k) as f64 * factor;
    let err = (estimate - truth).abs() / truth;
    assert!(
        err < 0.03,
        "factor {factor}, stream {stream}: estimate {estimate} vs reported {truth}"
    );
    let gauge = h
        .metric(&format!("condense_calibration_ratio{{model=\"{model}\"}}"))
        .await
        .unwrap();
    assert!((gauge - factor).abs() < 0.03, "gauge {gauge}");
}

#[tokio::test]
async fn calibration_converges_on_json_responses() {
    calibrates_to(1.3, false).await;
    calibrates_to(0.8, false).await;
}

#[tokio::test]
async fn calibration_converges_on_streamed_responses() {
    calibrates_to(1.3, true).await;
    calibrates_to(0.8, true).await;
}

#[tokio::test]
async fn resending_history_tokenizes_only_the_new_message() {
    let h = Harness::with(small_window).await;
    let first = conversation("small-a", 20, false);
    send(&h, &first, 1.0).await;
    let misses = h.metric("condense_token_cache_misses_total").await.unwrap();
    let hits = h.metric("condense_token_cache_hits_total").await.unwrap();
    let mut second = first.clone();
    second["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "And now?"}));
    let (headers, _) = send(&h, &second, 1.0).await;
    assert_eq!(
        h.metric("condense_token_cache_misses_total").await.unwrap(),
        misses + 1.0
    );
    assert_eq!(
        h.metric("condense_token_cache_hits_total").await.unwrap(),
        hits + 41.0
    );
    assert_eq!(headers["x-condense-actions"], "none");
    assert_eq!(
        headers["x-condense-tokens-before"],
        headers["x-condense-tokens-after"]
    );
}

#[tokio::test]
async fn windows_are_learned_from_the_models_listing() {
    let h = Harness::start().await;
    let body = json!({"model": "vllm-small", "messages": [{"role": "user", "content": "hi"}]});
    send(&h, &body, 1.0).await;
    let listing_calls = h
        .mock
        .requests()
        .iter()
        .filter(|r| r.path == "/v1/models")
        .count();
    assert_eq!(listing_calls, 1);
    assert_eq!(
        h.metric("condense_context_window_tokens{model=\"vllm-small\"}")
            .await,
        Some(16384.0)
    );
    // Unknown to the listing and the profiles: the default window.
    let body = json!({"model": "mystery-model", "messages": [{"role": "user", "content": "hi"}]});
    send(&h, &body, 1.0).await;
    assert_eq!(
        h.metric("condense_context_window_tokens{model=\"mystery-model\"}")
            .await,
        Some(32768.0)
    );
    // The listing is not fetched again right away.
    send(&h, &body, 1.0).await;
    assert_eq!(
        h.mock
            .requests()
            .iter()
            .filter(|r| r.path == "/v1/models")
            .count(),
        1
    );
    // A profile model keeps its profile window (the listing names none).
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    send(&h, &body, 1.0).await;
    assert_eq!(
        h.metric("condense_context_window_tokens{model=\"gpt-4o\"}")
            .await,
        Some(128000.0)
    );
}

#[tokio::test]
async fn listing_can_be_turned_off() {
    let h = Harness::with(|c| c.upstream.learn_windows = false).await;
    let body = json!({"model": "vllm-small", "messages": [{"role": "user", "content": "hi"}]});
    send(&h, &body, 1.0).await;
    assert!(h.mock.requests().iter().all(|r| r.path != "/v1/models"));
    assert_eq!(
        h.metric("condense_context_window_tokens{model=\"vllm-small\"}")
            .await,
        Some(32768.0)
    );
}

#[tokio::test]
async fn every_chat_response_says_what_condense_measured() {
    let h = Harness::start().await;
    let (headers, _) = send(&h, &conversation("gpt-4o", 2, true), 1.0).await;
    assert!(header_u64(&headers, "x-condense-tokens-before") > 0);
    assert_eq!(headers["x-condense-actions"], "none");
    let text = h.metrics().await;
    assert!(text.contains("condense_pressure_ratio_count 1"), "{text}");
}
