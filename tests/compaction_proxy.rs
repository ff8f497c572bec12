//! Compaction through the proxy: what a client and the upstream see.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Harness, Redis};
use condense::config::Config;
use condense::server::Server;
use condense::simulate::{CountRule, OverflowStyle, Simulator};
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

/// The APIs a conversation can come in.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Responses,
    Messages,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }
}

/// A coding session of `turns` tool calls, each result `lines` lines of
/// code, as `api` carries it: the requests its agent sends, turn by turn
/// (each ends awaiting the model's next turn).
fn session_requests(api: Api, turns: usize, lines: usize) -> Vec<Value> {
    let system = "You are a coding agent.";
    let task = "Fix the failing test in src/parser.rs";
    let result = |t: usize| -> String {
        let body: String = (0..lines)
            .map(|l| format!("{l:>4} let v{t}_{l} = parse(&input[{l}..]);\n"))
            .collect();
        format!("{body}error[E0308]: mismatched types in src/m{t}.rs\n")
    };
    let cmd = |t: usize| format!("cat src/m{t}.rs");
    let mut items: Vec<Value> = match api {
        Api::Chat => vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": task}),
        ],
        Api::Responses => vec![
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": task}]}),
        ],
        Api::Messages => vec![json!({"role": "user", "content": task})],
    };
    let request = |items: &[Value]| match api {
        Api::Chat => json!({"model": "agent-small", "max_tokens": 256, "messages": items}),
        Api::Responses => json!({"model": "agent-small", "max_output_tokens": 256,
            "store": false, "instructions": system, "input": items}),
        Api::Messages => json!({"model": "agent-small", "max_tokens": 256,
            "system": system, "messages": items}),
    };
    let mut out = vec![request(&items)];
    for t in 0..turns {
        let id = format!("call_{t}");
        let step = format!("Reading file {t}.");
        match api {
            Api::Chat => {
                items.push(json!({"role": "assistant", "content": step, "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": json!({"cmd": cmd(t)}).to_string()}}]}));
                items.push(json!({"role": "tool", "tool_call_id": id, "content": result(t)}));
            }
            Api::Responses => {
                items.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": step}]}));
                items.push(json!({"type": "function_call", "call_id": id, "name": "run", "arguments": json!({"cmd": cmd(t)}).to_string()}));
                items.push(
                    json!({"type": "function_call_output", "call_id": id, "output": result(t)}),
                );
            }
            Api::Messages => {
                items.push(json!({"role": "assistant", "content": [{"type": "text", "text": step}, {"type": "tool_use", "id": id, "name": "run", "input": {"cmd": cmd(t)}}]}));
                items.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": result(t)}]}));
            }
        }
        out.push(request(&items));
    }
    out
}

/// The ids of the tool results a forwarded `body` holds masked.
fn masked_results(api: Api, body: &Value) -> Vec<String> {
    let masked = |text: &Value| text.as_str().is_some_and(|t| t.starts_with("[condense:"));
    let mut out = Vec::new();
    match api {
        Api::Chat => {
            for m in body["messages"].as_array().unwrap() {
                if m["role"] == "tool" && masked(&m["content"]) {
                    out.push(m["tool_call_id"].as_str().unwrap().to_string());
                }
            }
        }
        Api::Responses => {
            for item in body["input"].as_array().unwrap() {
                if item["type"] == "function_call_output" && masked(&item["output"]) {
                    out.push(item["call_id"].as_str().unwrap().to_string());
                }
            }
        }
        Api::Messages => {
            for m in body["messages"].as_array().unwrap() {
                for block in m["content"].as_array().into_iter().flatten() {
                    let text = match &block["content"] {
                        Value::Array(parts) => parts[0]["text"].clone(),
                        v => v.clone(),
                    };
                    if block["type"] == "tool_result" && masked(&text) {
                        out.push(block["tool_use_id"].as_str().unwrap().to_string());
                    }
                }
            }
        }
    }
    out
}

/// A session replayed through condense to a provider that counts tokens
/// its own way: about 1.3 of condense's tokens for each of its own until
/// turn `switch`, about a third of one after it, so that the ratio
/// condense has learned falls far once the conversation is compacted.
/// Turn `t` goes to `replicas[serve(t)]` (condense instances in front of
/// `h`'s upstream); a replica that takes the conversation over has first
/// learned the provider's count from a short request of its own. Returns,
/// turn by turn, the results the forwarded request held masked.
async fn masked_turn_by_turn(
    api: Api,
    switch: usize,
    h: &Harness,
    replicas: &[&Server],
    serve: impl Fn(usize) -> usize,
) -> Vec<Vec<String>> {
    let post = |replica: &Server, body: &Value| {
        h.client
            .post(format!("http://{}{}", replica.local_addr(), api.path()))
            .header("x-api-key", "sk-test")
            .header("anthropic-version", "2023-06-01")
            .body(body.to_string())
            .send()
    };
    let mut seen = Vec::new();
    let warm_up = &session_requests(api, 3, 40)[3];
    for (t, body) in session_requests(api, 26, 40).iter().enumerate() {
        let replica = replicas[serve(t)];
        let per_token = if t < switch { 2.4 } else { 9.0 };
        h.mock.set_provider(Simulator::new(
            CountRule::Chars(per_token),
            1 << 20,
            OverflowStyle::OpenAi,
        ));
        if t > 0 && serve(t) != serve(t - 1) {
            post(replica, warm_up).await.unwrap().bytes().await.unwrap();
            replica.state().proxy.settled().await;
        }
        let resp = post(replica, body).await.unwrap();
        assert_eq!(resp.status(), 200, "turn {t}");
        resp.bytes().await.unwrap();
        replica.state().proxy.settled().await;
        let sent = h
            .mock
            .requests()
            .into_iter()
            .rev()
            .find(|r| r.path == api.path())
            .unwrap()
            .json();
        seen.push(masked_results(api, &sent));
    }
    seen
}

/// Nothing masked on one turn is unmasked on a later one.
fn assert_masked_stay_masked(api: Api, seen: &[Vec<String>]) {
    let first = seen.iter().position(|m| !m.is_empty());
    assert!(
        first.is_some_and(|f| f < 12),
        "{api:?}: compacted before the ratio falls: {seen:?}"
    );
    for (t, pair) in seen.windows(2).enumerate() {
        let gone: Vec<&String> = pair[0].iter().filter(|id| !pair[1].contains(id)).collect();
        assert!(
            gone.is_empty(),
            "{api:?}: turn {}: {gone:?} were masked on the turn before and are not now",
            t + 1
        );
    }
}

async fn results_masked_once_stay_masked_when_the_ratio_falls(api: Api) {
    let h = Harness::with(small_window).await;
    let one = h.server.as_ref().unwrap();
    let seen = masked_turn_by_turn(api, 12, &h, &[one], |_| 0).await;
    assert_masked_stay_masked(api, &seen);
}

#[tokio::test]
async fn chat_results_masked_once_stay_masked_when_the_ratio_falls() {
    results_masked_once_stay_masked_when_the_ratio_falls(Api::Chat).await;
}

#[tokio::test]
async fn responses_results_masked_once_stay_masked_when_the_ratio_falls() {
    results_masked_once_stay_masked_when_the_ratio_falls(Api::Responses).await;
}

#[tokio::test]
async fn messages_results_masked_once_stay_masked_when_the_ratio_falls() {
    results_masked_once_stay_masked_when_the_ratio_falls(Api::Messages).await;
}

#[tokio::test]
#[ignore = "needs redis-server; run with `cargo test -- --ignored redis`"]
async fn a_replica_keeps_masked_what_another_masked_through_redis() {
    // Replica b takes the conversation over after the ratio fell, with a
    // calibration of its own: the budgets a planned against reach it
    // through Redis, and b masks what a masked.
    let redis = Redis::start();
    let url = redis.url();
    let setup = |c: &mut Config| {
        small_window(c);
        c.state.redis_url = Some(condense::config::Secret::new(&url));
    };
    for api in [Api::Chat, Api::Responses] {
        let h = Harness::with(setup).await;
        let b = h.replica(setup).await;
        let a = h.server.as_ref().unwrap();
        let seen = masked_turn_by_turn(api, 12, &h, &[a, &b], |t| usize::from(t >= 14)).await;
        assert_masked_stay_masked(api, &seen);
        b.shutdown().await.unwrap();
    }
}
