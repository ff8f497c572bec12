//! Compaction through the proxy: what a client and the upstream see.

#![allow(clippy::unwrap_used)]

mod common;

use common::Harness;
use condense::config::Config;
use serde_json::{Value, json};

fn small_window(c: &mut Config) {
    c.models.push(common::profile("agent-*", 8192));
}

fn long_session() -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in src/parser.rs"}),
    ];
    for t in 0..12 {
        let id = format!("call_{t}");
        messages.push(json!({"role": "assistant", "content": format!("Reading file {t}."), "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": format!("{{\"cmd\":\"cat src/m{t}.rs\"}}")}}]}));
        let body: String = (0..60)
            .map(|l| format!("{l:>4} let v{t}_{l} = parse(&input[{l}..]);\n"))
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("{body}error[E0308]: mismatched types in src/m{t}.rs\n")}));
    }
    json!({"model": "agent-small", "messages": messages, "max_tokens": 256, "x_vendor_field": {"kept": true}})
}

#[tokio::test]
async fn a_request_under_pressure_is_compacted_before_forwarding() {
    let h = Harness::with(small_window).await;
    let body = long_session();
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let before: u64 = resp.headers()["x-condense-tokens-before"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let after: u64 = resp.headers()["x-condense-tokens-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let actions = resp.headers()["x-condense-actions"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(after < before, "{before} -> {after}");
    assert!(actions.contains("mask"), "{actions}");

    let sent = h.mock.last();
    assert!(sent.body.len() < body.to_string().len());
    let sent = sent.json();
    assert_eq!(sent["x_vendor_field"]["kept"], true);
    assert_eq!(sent["messages"][0], body["messages"][0]);
    assert_eq!(
        sent["messages"].as_array().unwrap().last(),
        body["messages"].as_array().unwrap().last()
    );
    assert!(
        sent["messages"][3]["content"]
            .as_str()
            .unwrap()
            .starts_with("[condense:")
    );

    let saved = h
        .metric("condense_tokens_saved_total{stage=\"mask\"}")
        .await
        .unwrap();
    assert!(saved > 0.0);
    assert_eq!(
        h.metric("condense_compactions_total{stage=\"mask\"}").await,
        Some(1.0)
    );
    let received = h
        .metric("condense_prompt_tokens_received_total")
        .await
        .unwrap();
    let forwarded = h
        .metric("condense_prompt_tokens_forwarded_total")
        .await
        .unwrap();
    assert_eq!((received as u64, forwarded as u64), (before, after));
}

#[tokio::test]
async fn the_opt_out_header_forwards_the_request_untouched() {
    let h = Harness::with(small_window).await;
    let raw = long_session().to_string();
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-condense", "off")
        .body(raw.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    assert_eq!(std::str::from_utf8(&h.mock.last().body).unwrap(), raw);
    assert_eq!(
        h.metric("condense_compactions_total{stage=\"mask\"}").await,
        Some(0.0)
    );
}

#[tokio::test]
async fn a_streamed_request_is_compacted_and_streams_back() {
    let h = Harness::with(small_window).await;
    let mut body = long_session();
    body["stream"] = json!(true);
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert!(
        resp.headers()["x-condense-actions"]
            .to_str()
            .unwrap()
            .contains("mask")
    );
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert!(!text.contains("usage"));
    let sent = h.mock.last().json();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert!(
        sent["messages"][3]["content"]
            .as_str()
            .unwrap()
            .starts_with("[condense:")
    );
}
