//! Anthropic Messages through condense, in front of the mock's `/v1/messages`
//! (Anthropic's wire format, usage and overflow wording): forwarding,
//! compaction that keeps the API's rules, usage from JSON and streams,
//! overflow recovery, Anthropic-shaped errors, routing and credentials.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Harness, profile};
use serde_json::{Value, json};

/// A Claude Code-like session: the task, the environment as a system
/// message, then `turns` rounds of thinking, text and a tool call answered
/// by a long result; a breakpoint on the newest result.
fn session(turns: usize, stream: bool) -> Value {
    let mut messages = vec![
        json!({"role": "user", "content": [{"type": "text", "text": "Fix the failing test in parser.py"}]}),
        json!({"role": "system", "content": "<env>cwd: /repo</env>"}),
    ];
    for t in 0..turns {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": format!("Look at file {t}."), "signature": format!("EqQBCkgIARABGAIiQL{t}")},
            {"type": "text", "text": format!("Reading file {t}.")},
            {"type": "tool_use", "id": format!("toolu_{t:02}"), "name": "Read", "input": {"file_path": format!("/repo/src/f{t}.py")}}
        ]}));
        let mut result = json!({"type": "tool_result", "tool_use_id": format!("toolu_{t:02}"),
            "content": format!("def f_{t}():\n{}", "    value = compute(value) + 1\n".repeat(150))});
        if t + 1 == turns {
            result["cache_control"] = json!({"type": "ephemeral"});
        }
        messages.push(json!({"role": "user", "content": [result]}));
    }
    json!({"model": "claude-sonnet-4-5", "max_tokens": 2048, "stream": stream,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": messages})
}

async fn post(h: &Harness, body: &Value, extra: &[(&str, &str)]) -> reqwest::Response {
    let mut req = h
        .client
        .post(h.url("/v1/messages?beta=true"))
        .header("x-api-key", "sk-ant-client")
        .header("anthropic-version", "2023-06-01")
        .header("anthropic-beta", "interleaved-thinking-2025-05-14")
        .body(body.to_string());
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

/// The Messages API's rules on a forwarded body.
fn assert_valid(sent: &Value, original: &Value) {
    let messages: Vec<&Value> = sent["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .collect();
    assert_eq!(messages[0]["role"], "user");
    let blocks = |m: &Value, kind: &str, key: &str| -> Vec<Value> {
        m["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| b["type"] == kind)
            .map(|b| b[key].clone())
            .collect()
    };
    for w in messages.windows(2) {
        assert_ne!(w[0]["role"], w[1]["role"], "roles alternate");
        assert_eq!(
            blocks(w[0], "tool_use", "id"),
            blocks(w[1], "tool_result", "tool_use_id"),
            "every tool_use answered in the next message"
        );
    }
    // Thinking blocks are the client's, byte for byte.
    let all = |v: &Value| -> Vec<Value> {
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
            .collect()
    };
    let theirs = all(original);
    for b in all(sent) {
        if b["type"] == "thinking" || b["type"] == "redacted_thinking" {
            assert!(theirs.contains(&b), "{b}");
        }
    }
    for key in ["system", "thinking", "max_tokens", "model"] {
        assert_eq!(sent[key], original[key], "{key} untouched");
    }
    common::assert_client_tools_first(&sent["tools"], &original["tools"]);
}

#[tokio::test]
async fn a_short_request_goes_upstream_byte_for_byte_with_anthropic_headers() {
    // The OpenAI upstream is unreachable: Messages go to Anthropic's.
    let h = Harness::with(|c| c.upstream.base_url = "http://127.0.0.1:9/v1".to_string()).await;
    let body = session(2, false);
    let resp = post(&h, &body, &[]).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    assert!(resp.headers().contains_key("x-condense-tokens-before"));
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["content"][0]["text"], "Hello there!");
    let r = h.mock.last();
    assert_eq!(r.path, "/v1/messages");
    assert_eq!(r.query.as_deref(), Some("beta=true"));
    assert_eq!(r.body, body.to_string().as_bytes());
    assert_eq!(r.headers["x-api-key"], "sk-ant-client");
    assert!(!r.headers.contains_key("authorization"));
    assert_eq!(r.headers["anthropic-version"], "2023-06-01");
    assert_eq!(
        r.headers["anthropic-beta"],
        "interleaved-thinking-2025-05-14"
    );
    // Usage: uncached and cache-read input together are the prompt.
    let prompt = (body.to_string().len() / 4) as f64;
    assert_eq!(
        h.metric("condense_upstream_prompt_tokens_total{model=\"claude-sonnet-4-5\"}")
            .await,
        Some(prompt)
    );
    assert_eq!(
        h.metric("condense_requests_total{route=\"messages\",status_class=\"2xx\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn a_long_session_is_compacted_and_stays_a_valid_messages_request() {
    let h = Harness::with(|c| c.models = vec![profile("claude-*", 24_000)]).await;
    for stream in [false, true] {
        let body = session(30, stream);
        let resp = post(&h, &body, &[]).await;
        assert_eq!(resp.status(), 200);
        let actions = resp.headers()["x-condense-actions"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(actions.contains("mask"), "{actions}");
        let text = resp.text().await.unwrap();
        if stream {
            assert!(text.starts_with("event: message_start\n"), "{text}");
            assert!(text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"));
        }
        let sent: Value = serde_json::from_slice(&h.mock.last().body).unwrap();
        assert!(h.mock.last().body.len() < body.to_string().len() / 2);
        assert_valid(&sent, &body);
        // The environment stays where Claude Code put it, the newest result
        // whole with its breakpoint.
        assert_eq!(sent["messages"][1], body["messages"][1]);
        let last = sent["messages"].as_array().unwrap().last().unwrap();
        assert_eq!(last, body["messages"].as_array().unwrap().last().unwrap());
    }
    assert!(
        h.metric("condense_compactions_total{stage=\"mask\"}")
            .await
            .unwrap()
            >= 2.0
    );
}

#[tokio::test]
async fn an_overflow_in_anthropic_wording_is_recovered_once() {
    let h = Harness::with(|c| c.models = vec![profile("claude-*", 200_000)]).await;
    for stream in [false, true] {
        let body = session(30, stream);
        let resp = post(&h, &body, &[("x-mock-window", "12000")]).await;
        assert_eq!(resp.status(), 200, "stream {stream}");
        assert_ne!(resp.headers()["x-condense-actions"], "none");
        let sent: Value = serde_json::from_slice(&h.mock.last().body).unwrap();
        assert_valid(&sent, &body);
    }
    assert_eq!(
        h.metric(
            "condense_context_overflow_total{outcome=\"recovered\",provider_format=\"anthropic\"}"
        )
        .await,
        Some(1.0),
        "the second request knew the window"
    );
}

/// Anthropic's other overflow: the prompt fits the window, the prompt plus
/// `max_tokens` does not ("input length and `max_tokens` exceed context
/// limit: P + M > W"). The retry fits W - M by the provider's count and
/// asks for the client's `max_tokens`; the window learned is W, so the
/// next turn is compacted before it goes.
#[tokio::test]
async fn an_overflow_of_prompt_plus_max_tokens_is_recovered_keeping_max_tokens() {
    for stream in [false, true] {
        let h = Harness::with(|c| c.models = vec![profile("claude-*", 200_000)]).await;
        let body = session(30, stream);
        let max_tokens = body["max_tokens"].as_u64().unwrap();
        // The mock counts a token per 4 bytes: the prompt fits this window,
        // not with its max_tokens.
        let prompt = body.to_string().len() as u64 / 4;
        let window = prompt + max_tokens / 2;
        let error = condense::simulate::anthropic_overflow(prompt, max_tokens, window).unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with(&format!("input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {window},")),
            "{error}"
        );
        let limit = window.to_string();
        let resp = post(&h, &body, &[("x-mock-window", &limit)]).await;
        assert_eq!(resp.status(), 200, "stream {stream}");
        assert_ne!(resp.headers()["x-condense-actions"], "none");
        let text = resp.text().await.unwrap();
        if stream {
            assert!(text.starts_with("event: message_start\n"), "{text}");
            assert!(
                text.ends_with("data: {\"type\":\"message_stop\"}\n\n"),
                "{text}"
            );
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["content"][0]["text"], "Hello there!");
        }
        let sent = h.mock.requests();
        assert_eq!(sent.len(), 2, "the request and one retry");
        assert_eq!(sent[0].body, body.to_string().as_bytes());
        let retry = sent[1].json();
        let retry_prompt = sent[1].body.len() as u64 / 4;
        assert!(
            retry_prompt + max_tokens <= window,
            "stream {stream}: retry of {retry_prompt} tokens + {max_tokens} over {window}"
        );
        assert_eq!(retry["max_tokens"], body["max_tokens"]);
        assert_valid(&retry, &body);
        assert_eq!(
            h.metric(
                "condense_context_overflow_total{outcome=\"recovered\",provider_format=\"anthropic\"}"
            )
            .await,
            Some(1.0)
        );

        // The next turn, longer still, is compacted for W before it goes.
        let next = session(32, stream);
        let resp = post(&h, &next, &[("x-mock-window", &limit)]).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            h.mock
                .state
                .overflows
                .load(std::sync::atomic::Ordering::SeqCst),
            1
        );
        assert_eq!(h.mock.last().json()["max_tokens"], body["max_tokens"]);
        assert_eq!(
            h.metric("condense_context_window_tokens{model=\"claude-sonnet-4-5\"}")
                .await,
            Some(window as f64),
            "the window learned is W, not W - M"
        );
    }
}

/// A `max_tokens` that alone fills the window: no prompt fits beside it,
/// and the client's `max_tokens` is not condense's to lower. The client
/// gets Anthropic's error as it came, and nothing is compacted or
/// summarized for a retry that cannot be.
#[tokio::test]
async fn a_max_tokens_that_fills_the_window_is_not_retried() {
    let h = Harness::with(|c| c.models = vec![profile("claude-*", 200_000)]).await;
    let mut body = session(30, false);
    // The prompt fits the window (by about 1000 tokens); max_tokens is all
    // of it.
    let window = body.to_string().len() as u64 / 4 + 1000;
    body["max_tokens"] = json!(window);
    let resp = post(&h, &body, &[("x-mock-window", &window.to_string())]).await;
    assert_eq!(resp.status(), 400);
    let error: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("input length and `max_tokens` exceed context limit: "),
        "{message}"
    );
    assert_eq!(h.mock.requests().len(), 1, "no retry, no summarizer call");
    assert_eq!(
        h.metric(
            "condense_context_overflow_total{outcome=\"not_recoverable\",provider_format=\"anthropic\"}"
        )
        .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn condenses_own_errors_take_anthropics_shape() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let h = Harness::with(|c| {
        c.upstream.anthropic_base_url = format!("http://127.0.0.1:{port}/v1");
    })
    .await;
    let resp = post(&h, &session(1, false), &[]).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "api_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("upstream_unreachable")
    );

    // Gated: a wrong key is refused in Anthropic's shape too.
    let h = Harness::with(|c| {
        c.auth.client_keys = vec![condense::config::Secret::new("ck-1")];
    })
    .await;
    let resp = post(&h, &session(1, false), &[]).await;
    assert_eq!(resp.status(), 401);
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
}

#[tokio::test]
async fn other_anthropic_routes_are_forwarded_to_anthropic() {
    // Two distinct upstreams: the mock is Anthropic's; OpenAI's is dead.
    let h = Harness::with(|c| c.upstream.base_url = "http://127.0.0.1:9/v1".to_string()).await;
    let resp = h
        .client
        .post(h.url("/v1/messages/count_tokens"))
        .header("x-api-key", "sk-ant-client")
        .header("anthropic-version", "2023-06-01")
        .body(r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(h.mock.last().path, "/v1/messages/count_tokens");
    // Any request an Anthropic client sends, by its header.
    let resp = h
        .client
        .get(h.url("/v1/models"))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(h.mock.last().path, "/v1/models");
}

#[tokio::test]
async fn the_operators_anthropic_key_fills_in_or_replaces() {
    let h = Harness::with(|c| {
        c.upstream.anthropic_api_key = Some(condense::config::Secret::new("sk-ant-operator"));
        c.upstream.api_key = Some(condense::config::Secret::new("sk-openai-operator"));
    })
    .await;
    let resp = h
        .client
        .post(h.url("/v1/messages"))
        .body(session(1, false).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let r = h.mock.last();
    assert_eq!(r.headers["x-api-key"], "sk-ant-operator");
    assert!(
        !r.headers.contains_key("authorization"),
        "no OpenAI key to Anthropic"
    );
}

#[tokio::test]
async fn bodies_condense_does_not_understand_go_upstream_unchanged() {
    let h = Harness::with(|c| c.models = vec![profile("*", 4_000)]).await;
    for body in [
        json!({"model": "claude-x", "max_tokens": 10, "messages": [{"role": "tool", "content": "x".repeat(40_000)}]}).to_string(),
        // Two user messages in a row: the upstream judges it.
        json!({"model": "claude-x", "max_tokens": 10, "messages": [
            {"role": "user", "content": "x".repeat(40_000)}, {"role": "user", "content": "y"}]})
        .to_string(),
        "not json".to_string(),
    ] {
        let resp = h
            .client
            .post(h.url("/v1/messages"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-condense-actions"], "none");
        assert_eq!(h.mock.last().body, body.as_bytes());
    }
}

/// Every body the provider received in a replay of `body`, checked against
/// the Messages API's rules and against the client's thinking blocks.
async fn replay_and_check(
    body: &Value,
    window: u64,
    count: condense::simulate::CountRule,
) -> condense::replay::Report {
    use condense::replay::{Provider, replay_received};
    let (report, received) = replay_received(
        &condense::config::Config::default(),
        &bytes::Bytes::from(body.to_string()),
        &condense::offline::CompactOptions {
            model: None,
            window: Some(window),
        },
        &Provider {
            count,
            window: None,
            overflow: condense::simulate::OverflowStyle::OpenAi,
            lists_window: false,
        },
    )
    .await
    .unwrap();
    assert!(!received.is_empty());
    for (sent, _) in &received {
        let sent: Value = serde_json::from_slice(sent).unwrap();
        assert_valid(&sent, body);
    }
    report
}

/// Thinking blocks with signatures on every assistant message, and a moving
/// cache breakpoint on the last block, as Claude Code sends them.
fn with_thinking(mut body: Value) -> Value {
    let messages = body["messages"].as_array_mut().unwrap();
    for (i, m) in messages.iter_mut().enumerate() {
        if m["role"] != "assistant" {
            continue;
        }
        if let Some(text) = m["content"].as_str().map(str::to_string) {
            m["content"] = json!([{"type": "text", "text": text}]);
        }
        m["content"].as_array_mut().unwrap().insert(
            0,
            json!({"type": "thinking", "thinking": format!("Step {i}: what next?"), "signature": format!("sig-{i}")}),
        );
    }
    body
}

#[tokio::test]
async fn a_replayed_session_sends_only_valid_requests() {
    let report = replay_and_check(
        &session(60, false),
        16_000,
        condense::simulate::CountRule::Chars(3.6),
    )
    .await;
    assert_eq!(report.condense.turns_not_fit, 0);
    assert!(report.turns.iter().any(|t| t.actions != "none"));
}

#[tokio::test]
#[ignore = "needs ../shared/traces beside the repository; run with `cargo test -- --ignored shared_traces`"]
async fn the_shared_traces_as_messages_replay_like_chat_and_stay_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
    for name in [
        "oh_django-14351",
        "oh_requests-1921",
        "sweagent_pydicom-1458",
        "tau_airline_task2_trial1",
    ] {
        let read = |sub: &str| -> Value {
            serde_json::from_slice(
                &std::fs::read(dir.join(sub).join(format!("{name}.json"))).unwrap(),
            )
            .unwrap()
        };
        let messages = with_thinking(read("anthropic"));
        for window in [16_000, 32_000] {
            let m = replay_and_check(&messages, window, condense::simulate::CountRule::O200k).await;
            assert_eq!(m.condense.turns_not_fit, 0, "{name} at {window}");
        }
    }
}

/// Sends a recorded Messages conversation turn by turn (each prefix that
/// ends before an assistant message), streamed as Claude Code streams,
/// through condense configured with a 200k window, to the mock's Messages
/// API enforcing a smaller `window` with Anthropic's wordings (it counts a
/// token per 4 bytes). Old turns are dropped mechanically, as `condense
/// replay` drops them. Returns (the size of each request the upstream
/// rejected, prompt plus `max_tokens` as the mock counts them; responses
/// that were not 200 for the client; turns).
async fn messages_against_a_small_window(body: &Value, window: u64) -> (Vec<u64>, usize, usize) {
    let h = Harness::with(|c| {
        c.models = vec![profile("*", 200_000)];
        c.summary.enabled = false;
    })
    .await;
    let messages = body["messages"].as_array().unwrap();
    let (mut errors, mut turns, mut rejected) = (0, 0, Vec::new());
    for end in
        (1..=messages.len()).filter(|&e| e == messages.len() || messages[e]["role"] == "assistant")
    {
        let mut turn = body.clone();
        turn["messages"] = json!(messages[..end]);
        turn["stream"] = json!(true);
        let before = h.mock.requests().len();
        let resp = post(&h, &turn, &[("x-mock-window", &window.to_string())]).await;
        turns += 1;
        if resp.status() != 200 {
            errors += 1;
        }
        let _ = resp.bytes().await;
        // A rejected request is followed by condense's retry (summaries
        // are off, so nothing else goes upstream).
        let sent = h.mock.requests();
        for r in &sent[before..sent.len().saturating_sub(1)] {
            rejected.push(r.body.len() as u64 / 4 + r.json()["max_tokens"].as_u64().unwrap_or(0));
        }
        let sent = h.mock.last().json();
        assert_eq!(
            sent["max_tokens"], body["max_tokens"],
            "max_tokens untouched"
        );
    }
    let overflows = h
        .mock
        .state
        .overflows
        .load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(overflows, rejected.len(), "every rejection is an overflow");
    (rejected, errors, turns)
}

#[tokio::test]
#[ignore = "needs ../shared/traces beside the repository; run with `cargo test -- --ignored shared_traces`"]
async fn the_shared_traces_as_messages_against_a_smaller_real_window_fail_no_turn() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
    let mut paths: Vec<_> = std::fs::read_dir(dir.join("anthropic"))
        .expect("../shared/traces/anthropic")
        .map(|e| e.unwrap().path())
        .collect();
    paths.extend(
        ["cc_glm51_musdb_training", "cc_sonnet45_frontend_build"]
            .map(|n| dir.join(format!("native/conversations/{n}.json"))),
    );
    for p in paths {
        let body: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let window = 16_000;
        let (rejected, errors, turns) = messages_against_a_small_window(&body, window).await;
        eprintln!(
            "{}: {turns} turns, rejected upstream at {rejected:?} tokens, {errors} client errors",
            p.display()
        );
        assert_eq!(errors, 0, "{}", p.display());
        // The first rejection teaches condense the window. After it, a
        // request goes over only by the calibration's drift, which the plan
        // ratio lets reach PLAN_MARGIN before following it (see
        // `tokens::calibration`); over by more, condense planned against a
        // wrong window.
        let drift = (window as f64 * (1.0 + condense::tokens::calibration::PLAN_MARGIN)) as u64;
        assert!(
            rejected.iter().skip(1).all(|&size| size <= drift),
            "{}: {rejected:?}",
            p.display()
        );
        assert!(rejected.len() <= 2, "{}: {rejected:?}", p.display());
    }
}
