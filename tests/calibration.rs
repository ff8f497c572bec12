//! Against a provider that counts tokens its own way: the replay does what
//! the proxy does, calibration learns from every response, windows come from
//! the listing, and an overflow the estimate did not see coming is
//! recovered by the provider's measure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use bytes::Bytes;
use common::Harness;
use condense::chat::{ChatRequest, Message};
use condense::config::Config;
use condense::offline::CompactOptions;
use condense::replay::{Provider, replay_received};
use condense::simulate::{CountRule, OverflowStyle, Simulator};
use serde_json::{Value, json};

fn example() -> Bytes {
    Bytes::from(std::fs::read("examples/agent-session.json").unwrap())
}

/// The requests an agent sends for a conversation, turn by turn: every
/// prefix that ends before an assistant message, then the whole (as
/// `condense replay` cuts them).
fn turns(body: &Bytes) -> Vec<Bytes> {
    let full = ChatRequest::parse(body).unwrap();
    let all: Vec<Message> = full.messages().to_vec();
    let mut ends: Vec<usize> = (1..all.len())
        .filter(|&i| all[i].role() == Some("assistant"))
        .collect();
    ends.push(all.len());
    ends.into_iter()
        .map(|end| {
            let mut req = full.clone();
            req.set_messages(all[..end].to_vec());
            req.to_bytes()
        })
        .collect()
}

/// Posts a chat body, reads the whole answer, and waits for what condense
/// does after it (counting for calibration).
async fn send(
    h: &Harness,
    body: Bytes,
) -> (reqwest::StatusCode, reqwest::header::HeaderMap, Value) {
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap_or(Value::Null);
    h.server.as_ref().unwrap().state().proxy.settled().await;
    (status, headers, v)
}

#[tokio::test]
async fn a_replay_forwards_what_the_proxy_forwards_turn_by_turn() {
    const WINDOW: u64 = 5000;
    let rule = CountRule::Chars(3.0);
    let body = example();

    let (report, replayed) = replay_received(
        &Config::default(),
        &body,
        &CompactOptions {
            model: None,
            window: Some(WINDOW),
        },
        &Provider {
            count: rule,
            window: None,
            overflow: OverflowStyle::OpenAi,
            lists_window: false,
        },
    )
    .await
    .unwrap();

    let h = Harness::with(|c: &mut Config| {
        c.models.push(common::profile("gpt-4o", WINDOW));
        c.summary.enabled = false;
    })
    .await;
    let sim = h
        .mock
        .set_provider(Simulator::new(rule, WINDOW, OverflowStyle::OpenAi));
    for turn in turns(&body) {
        let (status, _, _) = send(&h, turn).await;
        assert_eq!(status, 200);
    }
    let proxied = sim.received();

    assert_eq!(report.condense.turns_not_fit, 0);
    assert!(
        report.turns.iter().any(|t| t.actions != "none"),
        "the replay never compacted"
    );
    assert!(
        report.provider.calibration_ratio > 1.05,
        "{}",
        report.provider.calibration_ratio
    );
    assert_eq!(replayed.len(), proxied.len());
    for (i, (r, p)) in replayed.iter().zip(&proxied).enumerate() {
        assert!(r == p, "request {i} differs between replay and proxy");
    }
    h.shutdown().await;
}

/// A growing chat of prose, as a person's conversation with a model.
fn chat(turns: usize) -> Bytes {
    let topics = [
        "the history of the printing press and how movable type changed what people read",
        "why sourdough needs a starter, and how temperature changes the rise overnight",
        "the difference between a comet and an asteroid, with a few famous examples",
        "how a bill becomes a law, step by step, including what a veto does",
        "the rules of cricket for someone who has only ever watched baseball games",
        "what makes a good night's sleep and why screens before bed are a problem",
        "how compound interest works over thirty years of monthly savings deposits",
        "the plot of a famous novel about a whale and the captain who hunted it",
    ];
    let mut messages = vec![
        json!({"role": "system", "content": "You are a helpful assistant. Answer in plain prose."}),
    ];
    for t in 0..turns {
        let topic = topics[t % topics.len()];
        messages.push(json!({"role": "user", "content": format!("Tell me about {topic}. Please be thorough. ({t})")}));
        if t + 1 < turns {
            messages.push(json!({"role": "assistant", "content": format!("Here is an overview of {topic}. ").repeat(6 + t % 3)}));
        }
    }
    Bytes::from(json!({"model": "gpt-4o", "messages": messages}).to_string())
}

#[tokio::test]
async fn small_requests_calibrate_and_the_headers_come_within_five_percent() {
    let h = Harness::start().await;
    h.mock.set_provider(Simulator::new(
        CountRule::Chars(3.6),
        128_000,
        OverflowStyle::OpenAi,
    ));
    let series = "condense_calibration_ratio{model=\"gpt-4o\"}";
    assert_eq!(h.metric(series).await, None);
    // Far below the trigger: the cheap path, nothing tokenized on the way.
    let (status, headers, _) = send(&h, chat(1)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-condense-actions"], "none");
    assert!(
        h.metric(series).await.is_some(),
        "the ratio is shown from the first usage on"
    );
    for turns in 2..=6 {
        send(&h, chat(turns)).await;
    }
    let ratio = h.metric(series).await.unwrap();
    assert!(ratio > 1.0, "{ratio}");
    let (_, headers, v) = send(&h, chat(7)).await;
    let estimate: f64 = headers["x-condense-tokens-before"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let counted = v["usage"]["prompt_tokens"].as_f64().unwrap();
    let off = (estimate - counted).abs() / counted;
    assert!(
        off <= 0.05,
        "estimate {estimate}, provider {counted}: {off:.3} off"
    );
    h.shutdown().await;
}

#[tokio::test]
async fn a_single_model_servers_listed_window_applies_to_any_model_name() {
    let h = Harness::start().await;
    let mut sim = Simulator::new(CountRule::Chars(3.6), 4096, OverflowStyle::LlamaCpp);
    sim.lists_window = true;
    let sim = h.mock.set_provider(sim);
    // A model no profile knows (default window 32768): the llama.cpp
    // server's listing names another, and its `meta.n_ctx` is what counts.
    let mut body: Value = serde_json::from_slice(&example()).unwrap();
    body["model"] = json!("local");
    let (status, headers, _) = send(&h, Bytes::from(body.to_string())).await;
    assert_eq!(status, 200);
    assert_ne!(headers["x-condense-actions"], "none");
    assert!(
        sim.received().iter().all(|(_, ok)| *ok),
        "the provider had to reject a request"
    );
    h.shutdown().await;
}

/// A conversation whose last tool result is a wide table padded with
/// spaces: o200k folds runs of spaces into a few tokens, a provider that
/// counts characters does not.
fn whitespace_heavy() -> Bytes {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Find why the report job is slow."}),
    ];
    for t in 0..6 {
        let id = format!("call_{t}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("cat src/report_{t}.py")}).to_string()}}]}));
        let code: String = (0..20)
            .map(|i| {
                format!("def step_{t}_{i}(rows):\n    return [r for r in rows if r.total > {i}]\n")
            })
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": code}));
    }
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_last", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"psql -c 'select * from jobs'\"}"}}]}));
    let table: String = (0..400)
        .map(|i| format!("{i:>6}{}running{}\n", " ".repeat(60), " ".repeat(30)))
        .collect();
    messages.push(json!({"role": "tool", "tool_call_id": "call_last", "content": table}));
    Bytes::from(json!({"model": "gpt-4o", "max_tokens": 1000, "messages": messages}).to_string())
}

#[tokio::test]
async fn an_overflow_hidden_in_one_whitespace_heavy_result_is_recovered() {
    const WINDOW: u64 = 12_000;
    let h = Harness::with(|c: &mut Config| {
        c.models.push(common::profile("gpt-4o", WINDOW));
        c.summary.enabled = false;
    })
    .await;
    let sim = h.mock.set_provider(Simulator::new(
        CountRule::Chars(3.6),
        WINDOW,
        OverflowStyle::OpenAi,
    ));
    let body = whitespace_heavy();
    let (status, headers, _) = send(&h, body.clone()).await;
    let received = sim.received();
    assert_eq!(
        received.iter().map(|(_, ok)| *ok).collect::<Vec<_>>(),
        [false, true],
        "rejected as estimated, then recovered"
    );
    assert_eq!(status, 200);
    assert_ne!(headers["x-condense-actions"], "none");
    assert_eq!(
        h.metric(
            "condense_context_overflow_total{outcome=\"recovered\",provider_format=\"openai\"}"
        )
        .await,
        Some(1.0)
    );
    h.shutdown().await;
}

/// A local server whose window condense is not told (an unknown model:
/// 32768 assumed) and must learn: from llama.cpp's error, which names it,
/// and from an error with no numbers at all, which only bounds it.
#[tokio::test]
async fn a_small_window_condense_was_not_told_costs_one_rejection_and_no_failed_turn() {
    for (overflow, window) in [(OverflowStyle::LlamaCpp, 4096), (OverflowStyle::Bare, 3000)] {
        let (report, received) = replay_received(
            &Config::default(),
            &example(),
            &CompactOptions {
                model: Some("local-model".to_string()),
                window: None,
            },
            &Provider {
                count: CountRule::Chars(3.3),
                window: Some(window),
                overflow,
                lists_window: false,
            },
        )
        .await
        .unwrap();
        assert_eq!(report.condense.turns_not_fit, 0, "{overflow:?}");
        let rejected = received.iter().filter(|(_, ok)| !ok).count();
        assert_eq!(rejected, 1, "{overflow:?}: every later turn fits");
    }
}
