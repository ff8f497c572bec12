//! Summarization through the proxy, against the mock upstream as the
//! summarizer: where the checkpoint goes, reuse, incremental updates, single
//! flight, and failures that fall back and back off.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use common::{Harness, Redis};
use condense::config::{Config, SummaryTrigger, TriggerKind};
use serde_json::Value;

fn small_window(c: &mut Config) {
    c.models.push(common::profile("agent-*", 8192));
}

/// Summarize once a request has more than `n` messages, with a summarizer
/// model that reads the whole span at once.
fn by_messages(n: f64) -> impl FnOnce(&mut Config) {
    move |c| {
        small_window(c);
        c.summary.model = Some("gpt-4o".to_string());
        c.summary.trigger = SummaryTrigger {
            kind: TriggerKind::Messages,
            value: n,
        };
    }
}

/// A coding-agent session of `turns` tool calls. With `think` words of
/// reasoning per assistant message, masking tool output cannot save it.
fn session(turns: usize, think: usize) -> Value {
    session_with(turns, think, 30)
}

/// A session whose tool results have `lines` lines.
fn session_with(turns: usize, think: usize, lines: usize) -> Value {
    common::coding_session("agent-small", turns, think, lines)
}

async fn send(h: &Harness, body: &Value) -> reqwest::Response {
    send_to(h, h.addr, body).await
}

/// [`send`], to the condense at `addr` (a replica), with the harness's
/// client.
async fn send_to(h: &Harness, addr: SocketAddr, body: &Value) -> reqwest::Response {
    h.client
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", "Bearer sk-client-key")
        .header("x-mock-token-factor", "1.0")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

fn actions(resp: &reqwest::Response) -> String {
    resp.headers()["x-condense-actions"]
        .to_str()
        .unwrap()
        .to_string()
}

fn text(m: &Value) -> String {
    m["content"].as_str().unwrap_or_default().to_string()
}

fn is_checkpoint(m: &Value) -> bool {
    m["role"] == "user" && text(m).starts_with("[condense: checkpoint")
}

/// Every tool result follows the assistant message that called it.
fn assert_valid(messages: &[Value]) {
    let mut open: HashSet<String> = HashSet::new();
    for m in messages {
        match m["role"].as_str().unwrap() {
            "assistant" => {
                open.clear();
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    open.insert(c["id"].as_str().unwrap().to_string());
                }
            }
            "tool" => assert!(
                open.contains(m["tool_call_id"].as_str().unwrap()),
                "orphan tool result {m}"
            ),
            _ => {}
        }
    }
}

/// A [`session`] of `turns` sent at an 8k window, whose answer says a
/// checkpoint replaced its oldest span.
async fn summarized_session(turns: usize, think: usize) -> (Harness, Value) {
    let h = Harness::with(small_window).await;
    let body = session(turns, think);
    let resp = send(&h, &body).await;
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("summarize"), "{}", actions(&resp));
    let _ = resp.text().await.unwrap();
    (h, body)
}

/// What the summarizer was asked, call by call.
fn asks(h: &Harness) -> Vec<String> {
    h.mock
        .summary_calls()
        .iter()
        .map(|c| {
            c.json()["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// A conversation first seen at many times its window: the checkpoint
/// reads the span's oldest and newest messages in a bounded number of
/// calls (`summary/transcript.rs`), and says what it left out between.
#[tokio::test]
async fn a_span_of_hundreds_of_turns_is_read_in_a_bounded_number_of_calls() {
    let (h, _) = summarized_session(600, 40).await;
    let asks = asks(&h);
    // Eight calls' worth of transcript (`MAX_CALLS`): a call or two more
    // at most, not the 100-odd that reading all 1,200 messages takes.
    assert!((2..=10).contains(&asks.len()), "{} calls", asks.len());
    let sent = h.mock.chat_requests().pop().unwrap().json();
    let kept = sent["messages"].to_string();
    let first_kept = (0..600)
        .find(|t| kept.contains(&format!("idea{t}x0 ")))
        .unwrap();
    assert!(first_kept > 500, "{first_kept}");
    let read = |t: usize| {
        asks.iter()
            .filter(|a| a.contains(&format!(" idea{t}x0 ")))
            .count()
    };
    assert_eq!(read(0), 1, "the oldest turn is read");
    assert_eq!(read(first_kept - 1), 1, "the newest dropped turn is read");
    assert_eq!(read(first_kept / 2), 0, "the middle is left out");
    let notes: Vec<&String> = asks.iter().filter(|a| a.contains("left out")).collect();
    assert_eq!(notes.len(), 1);
    assert!(notes[0].contains("messages left out, too many to read"));
    assert_valid(sent["messages"].as_array().unwrap());
}

#[tokio::test]
async fn a_checkpoint_replaces_the_oldest_span_after_the_system_message() {
    let (h, body) = summarized_session(14, 120).await;

    // The span is larger than an 8k model reads at once: it is summarized
    // in chunks, each call updating the previous result, every message sent
    // once.
    let calls = h.mock.summary_calls();
    assert!(calls.len() >= 2, "{}", calls.len());
    let asks = asks(&h);
    for (i, (call, ask)) in calls.iter().zip(&asks).enumerate() {
        let v = call.json();
        assert_eq!(v["model"], "agent-small");
        // summary.max_tokens (1500), but at most 12% of the prompt budget
        // (8192 - 256 completion - 410 reserve = 7526).
        assert_eq!(v["max_tokens"], 903);
        assert!(ask.contains("## Critical identifiers"));
        assert_eq!(ask.contains("<checkpoint>"), i > 0, "{ask}");
        if i > 0 {
            assert!(ask.contains(&format!("checkpoint-{}", i - 1)));
        }
        // Same host as the upstream: the client's own key.
        assert_eq!(call.headers["authorization"], "Bearer sk-client-key");
    }
    let last = calls.len() - 1;
    for t in 0..8 {
        let word = format!(" idea{t}x0 ");
        assert_eq!(
            asks.iter().filter(|a| a.contains(&word)).count(),
            1,
            "turn {t}"
        );
    }

    let sent = h.mock.chat_requests().pop().unwrap().json();
    let msgs = sent["messages"].as_array().unwrap();
    assert_eq!(
        msgs[0], body["messages"][0],
        "system message first, verbatim"
    );
    // The task is the last user message: it stays verbatim, right before
    // the checkpoint that replaced the turns after it.
    assert_eq!(msgs[1], body["messages"][1]);
    assert!(is_checkpoint(&msgs[2]), "{}", msgs[2]);
    assert!(text(&msgs[2]).contains(&format!("checkpoint-{last}")));
    assert_eq!(msgs.iter().filter(|m| is_checkpoint(m)).count(), 1);
    assert_eq!(msgs.last(), body["messages"].as_array().unwrap().last());
    assert!(msgs.len() < body["messages"].as_array().unwrap().len());
    assert_valid(msgs);

    assert_eq!(
        h.metric("condense_summarizer_calls_total{outcome=\"ok\"}")
            .await,
        Some(calls.len() as f64)
    );
    assert_eq!(
        h.metric("condense_compactions_total{stage=\"summarize\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        h.metric("condense_summary_tokens_count").await,
        Some(calls.len() as f64)
    );
}

#[tokio::test]
async fn later_turns_reuse_the_checkpoint_and_a_longer_span_is_updated_incrementally() {
    let h = Harness::with(by_messages(20.0)).await;
    let first = session_with(12, 5, 8);
    assert!(actions(&send(&h, &first).await).contains("summarize"));
    assert_eq!(h.mock.summary_calls().len(), 1);
    let sent1 = h.mock.chat_requests().pop().unwrap().json();

    // The next turn: same span, stored checkpoint, no call, same prefix.
    let second = session_with(13, 5, 8);
    assert!(actions(&send(&h, &second).await).contains("summarize"));
    assert_eq!(h.mock.summary_calls().len(), 1, "reused, not re-summarized");
    let sent2 = h.mock.chat_requests().pop().unwrap().json();
    let (m1, m2) = (
        sent1["messages"].as_array().unwrap(),
        sent2["messages"].as_array().unwrap(),
    );
    assert_eq!(m2[..m1.len()], m1[..], "the compacted prefix is unchanged");
    assert_eq!(
        h.metric("condense_summarizer_calls_total{outcome=\"reused\"}")
            .await,
        Some(1.0)
    );

    // Much later: the span grows; the old checkpoint and only the new
    // messages go to the summarizer.
    let later = session_with(24, 5, 8);
    assert!(actions(&send(&h, &later).await).contains("summarize"));
    let calls = h.mock.summary_calls();
    assert_eq!(calls.len(), 2);
    let ask = calls[1].json()["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        ask.contains("<checkpoint>") && ask.contains("checkpoint-0"),
        "{ask}"
    );
    assert!(
        !ask.contains("cat src/m0.rs"),
        "old messages are not sent again"
    );
    assert!(ask.contains("cat src/m9.rs"), "{ask}");
    let sent3 = h.mock.chat_requests().pop().unwrap().json();
    let m3 = sent3["messages"].as_array().unwrap();
    assert!(m3.iter().any(|m| text(m).contains("checkpoint-1")));
    assert!(m3.len() <= 20, "{}", m3.len());
    assert_valid(m3);
}

#[tokio::test]
async fn concurrent_requests_for_the_same_prefix_share_one_call() {
    let h = Harness::with(by_messages(20.0)).await;
    h.mock.state.summary_delay_ms.store(300, Ordering::SeqCst);
    let body = session(12, 5);
    let sends = (0..5).map(|_| send(&h, &body));
    for resp in futures_util::future::join_all(sends).await {
        assert_eq!(resp.status(), 200);
        assert!(actions(&resp).contains("summarize"));
    }
    assert_eq!(h.mock.summary_calls().len(), 1);
    assert_eq!(
        h.metric("condense_summarizer_calls_total{outcome=\"ok\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        h.metric("condense_summarizer_calls_total{outcome=\"reused\"}")
            .await,
        Some(4.0)
    );
}

/// A failing summarizer: the request still succeeds, pruned; the
/// conversation then cools down instead of calling again every turn.
async fn falls_back(mode: &'static str, timeout: f64, outcome: &str) {
    let h = Harness::with(|c| {
        small_window(c);
        c.summary.timeout_seconds = timeout;
    })
    .await;
    h.mock.set_summary_mode(mode);
    let body = session(14, 120);
    let resp = send(&h, &body).await;
    assert_eq!(resp.status(), 200);
    let acts = actions(&resp);
    assert!(
        acts.contains("prune") && !acts.contains("summarize"),
        "{acts}"
    );
    let answer: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(answer["object"], "chat.completion");
    let sent = h.mock.chat_requests().pop().unwrap().json();
    assert!(
        !sent["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(is_checkpoint)
    );
    assert_valid(sent["messages"].as_array().unwrap());
    assert_eq!(h.mock.summary_calls().len(), 1);
    assert_eq!(
        h.metric(&format!(
            "condense_summarizer_calls_total{{outcome=\"{outcome}\"}}"
        ))
        .await,
        Some(1.0)
    );

    // Backed off: the next turn does not call the summarizer.
    let resp = send(&h, &session(15, 120)).await;
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("prune"), "{}", actions(&resp));
    assert_eq!(h.mock.summary_calls().len(), 1);
    assert_eq!(
        h.metric("condense_summary_fallbacks_total{reason=\"cooldown\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        h.metric("condense_summary_fallbacks_total{reason=\"failed\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn a_failing_summarizer_falls_back_to_prune_and_backs_off() {
    falls_back("error", 60.0, "error").await;
}

#[tokio::test]
async fn an_unusable_answer_counts_as_a_failure() {
    falls_back("unusable", 60.0, "error").await;
}

#[tokio::test]
async fn a_hanging_summarizer_times_out_and_falls_back() {
    falls_back("hang", 0.3, "timeout").await;
}

#[tokio::test]
async fn without_a_checkpoint_a_request_under_budget_goes_out_unchanged() {
    // The message-count trigger asks for a summary of a request that fits;
    // when the summarizer fails, nothing is dropped mechanically.
    let h = Harness::with(by_messages(20.0)).await;
    h.mock.set_summary_mode("error");
    let body = session(12, 5);
    let resp = send(&h, &body).await;
    assert_eq!(actions(&resp), "none");
    let _ = resp.text().await.unwrap();
    assert_eq!(h.mock.chat_requests().pop().unwrap().json(), body);
}

#[tokio::test]
async fn the_cooldown_ends_and_a_success_resets_it() {
    let h = Harness::with(|c| {
        by_messages(20.0)(c);
        c.summary.cooldown_seconds = 0.2;
    })
    .await;
    h.mock.set_summary_mode("error");
    assert!(!actions(&send(&h, &session(12, 5)).await).contains("summarize"));
    assert!(!actions(&send(&h, &session(12, 5)).await).contains("summarize"));
    assert_eq!(h.mock.summary_calls().len(), 1, "cooling down");
    h.mock.set_summary_mode("ok");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(actions(&send(&h, &session(12, 5)).await).contains("summarize"));
    assert_eq!(h.mock.summary_calls().len(), 2);
}

#[tokio::test]
async fn a_summarizer_on_another_host_never_gets_the_clients_key() {
    let other = common::MockUpstream::start().await;
    let url = other.base_url().replace("127.0.0.1", "localhost");
    let h = Harness::with(|c| {
        by_messages(20.0)(c);
        c.summary.base_url = Some(url);
        c.summary.model = Some("summarizer-mini".to_string());
        c.models.push(common::profile("summarizer-*", 128_000));
    })
    .await;
    let resp = send(&h, &session(12, 5)).await;
    assert!(actions(&resp).contains("summarize"));
    assert!(h.mock.summary_calls().is_empty());
    let calls = other.summary_calls();
    assert_eq!(calls.len(), 1);
    assert!(calls[0].headers.get("authorization").is_none());
    assert_eq!(calls[0].json()["model"], "summarizer-mini");
    // The upstream still got the client's key.
    assert_eq!(
        h.mock.chat_requests()[0].headers["authorization"],
        "Bearer sk-client-key"
    );
}

#[tokio::test]
async fn summary_disabled_means_mechanical_drops_and_no_calls() {
    let h = Harness::with(|c| {
        small_window(c);
        c.summary.enabled = false;
    })
    .await;
    let resp = send(&h, &session(14, 120)).await;
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("prune"), "{}", actions(&resp));
    assert!(h.mock.summary_calls().is_empty());
}

/// Two condense replicas in front of the harness's mock, sharing `redis`,
/// summarizing by message count.
async fn replicas_sharing(redis: &Redis) -> (Harness, condense::server::Server) {
    let url = redis.url();
    let setup = |c: &mut Config| {
        by_messages(20.0)(c);
        c.state.redis_url = Some(condense::config::Secret::new(&url));
    };
    let a = Harness::with(setup).await;
    let b = a.replica(setup).await;
    (a, b)
}

#[tokio::test]
#[ignore = "needs redis-server; run with `cargo test -- --ignored redis`"]
async fn replicas_sharing_a_redis_share_checkpoints() {
    let redis = Redis::start();
    let (a, b) = replicas_sharing(&redis).await;

    let body = session_with(12, 5, 8);
    assert!(actions(&send(&a, &body).await).contains("summarize"));
    assert_eq!(a.mock.summary_calls().len(), 1);
    let via_b = send_to(&a, b.local_addr(), &body).await;
    assert!(actions(&via_b).contains("summarize"));
    let _ = via_b.text().await.unwrap();
    assert_eq!(
        a.mock.summary_calls().len(),
        1,
        "replica b reused a's checkpoint"
    );
    let sent = a.mock.chat_requests();
    assert_eq!(
        sent[0].body, sent[1].body,
        "both replicas sent the same request"
    );
    b.shutdown().await.unwrap();
}

#[tokio::test]
#[ignore = "needs redis-server; run with `cargo test -- --ignored redis`"]
async fn a_redis_that_goes_away_is_a_miss_and_comes_back() {
    let mut redis = Redis::start();
    let port = redis.port;
    let h = Harness::with(|c| {
        by_messages(20.0)(c);
        c.state.redis_url = Some(condense::config::Secret::new(redis.url()));
        c.summary.cooldown_seconds = 0.01;
    })
    .await;
    let _ = redis.child.kill();
    let _ = redis.child.wait();

    // Redis gone: the checkpoint is written (not stored), the request works.
    let resp = send(&h, &session_with(12, 5, 8)).await;
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("summarize"));
    let _ = resp.text().await.unwrap();
    let errors = h.metric("condense_state_errors_total{op=\"get\"}").await;
    assert!(errors.unwrap_or(0.0) >= 1.0, "{}", h.metrics().await);

    // Redis back on the same port: checkpoints are stored and reused again.
    let back = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    redis.child = back;
    let mut reused = false;
    for _ in 0..50 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let calls = h.mock.summary_calls().len();
        let _ = send(&h, &session_with(12, 5, 8)).await.text().await;
        if h.mock.summary_calls().len() == calls {
            reused = true;
            break;
        }
    }
    assert!(reused, "checkpoints are reused once Redis is back");
}

#[tokio::test]
#[ignore = "needs redis-server; run with `cargo test -- --ignored redis`"]
async fn concurrent_requests_on_two_replicas_share_one_call_through_redis() {
    let redis = Redis::start();
    let (a, b) = replicas_sharing(&redis).await;
    a.mock.state.summary_delay_ms.store(400, Ordering::SeqCst);

    let body = session_with(12, 5, 8);
    let (ra, rb) = tokio::join!(send(&a, &body), send_to(&a, b.local_addr(), &body));
    assert!(actions(&ra).contains("summarize"));
    assert!(actions(&rb).contains("summarize"));
    let _ = (ra.text().await, rb.text().await);
    assert_eq!(
        a.mock.summary_calls().len(),
        1,
        "one replica wrote it, the other waited"
    );
    let sent = a.mock.chat_requests();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].body, sent[1].body);
    b.shutdown().await.unwrap();
}

/// Codex puts its AGENTS.md instructions and its `<environment_context>`
/// before the task, as user messages; a later user message follows. A
/// checkpoint goes after all of them: they stay verbatim and in place.
#[tokio::test]
async fn the_agents_instructions_environment_and_task_stay_before_the_checkpoint() {
    let h = Harness::with(by_messages(20.0)).await;
    let mut body = session(14, 120);
    let msgs = body["messages"].as_array_mut().unwrap();
    msgs.insert(
        1,
        serde_json::json!({"role": "user", "content": "# AGENTS.md instructions for /repo\n\nRun the tests before you finish."}),
    );
    msgs.insert(
        2,
        serde_json::json!({"role": "user", "content": "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"}),
    );
    msgs.push(serde_json::json!({"role": "user", "content": "Also update the changelog."}));
    let resp = send(&h, &body).await;
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("summarize"), "{}", actions(&resp));
    let _ = resp.text().await.unwrap();

    let sent = h.mock.chat_requests().pop().unwrap().json();
    let sent = sent["messages"].as_array().unwrap();
    let original = body["messages"].as_array().unwrap();
    // System, instructions, environment, task: verbatim, in place.
    assert_eq!(sent[..4], original[..4]);
    assert!(is_checkpoint(&sent[4]), "{}", sent[4]);
    assert_eq!(sent.last(), original.last());
    assert_valid(sent);
    // What the summarizer read starts after them.
    let ask = h.mock.summary_calls()[0].json()["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!ask.contains("environment_context"), "{ask}");
    assert!(!ask.contains("AGENTS.md"), "{ask}");
}

/// Claude Code sends its environment as `<system-reminder>` blocks in the
/// first user message, before the task. A Messages request that needs a
/// checkpoint gets one from Anthropic's API, in its format, with its own
/// key; it keeps that first message byte for byte; the checkpoint replaces
/// turns after it.
#[tokio::test]
async fn claude_codes_system_reminders_stay_first_and_whole_before_the_checkpoint() {
    let h = Harness::with(by_messages(20.0)).await;
    let (head, body) = claude_code_session();
    send_summarized_messages(&h, &body).await;

    let sent = h
        .mock
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/messages"))
        .unwrap();
    let text = String::from_utf8(sent.body.to_vec()).unwrap();
    // The blocks as the client wrote them, byte for byte.
    let first_blocks = head.to_string();
    assert!(
        text.contains(&first_blocks[1..first_blocks.len() - 1]),
        "{text}"
    );
    let sent = sent.json();
    let sent = sent["messages"].as_array().unwrap();
    // The first message is the client's, whole: the checkpoint does not
    // join it (its bytes, and the provider's cache of them, stay).
    assert_eq!(sent[0], body["messages"][0]);
    // The checkpoint follows the first kept turn, in the user message that
    // answers it, behind its tool results (roles still alternate).
    let checkpoints: Vec<usize> = (0..sent.len())
        .filter(|&i| {
            sent[i]["content"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|b| {
                    b["text"]
                        .as_str()
                        .is_some_and(|t| t.starts_with("[condense: checkpoint"))
                })
        })
        .collect();
    assert_eq!(checkpoints, [2], "{sent:?}");
    for (i, m) in sent.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        assert_eq!(m["role"], role, "roles alternate");
    }
    // The checkpoint was written by Anthropic's API, in its format, with
    // the key the client's request carries (its upstream's own API).
    let calls = h.mock.summary_calls();
    assert!(!calls.is_empty());
    for call in &calls {
        assert_eq!(call.path, "/v1/messages");
        assert_eq!(call.headers["x-api-key"], "sk-ant-client");
        assert_eq!(call.headers["anthropic-version"], "2023-06-01");
        assert!(call.headers.get("authorization").is_none());
        let v = call.json();
        assert_eq!(v["max_tokens"], 903, "{v}");
        assert!(v.get("stream").is_none() && v.get("max_completion_tokens").is_none());
    }
    // What the summarizer read starts after the head.
    let ask = calls[0].json()["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!ask.contains("system-reminder"), "{ask}");
    assert!(sent.len() < body["messages"].as_array().unwrap().len());
}

/// A Claude Code-like Messages session: the environment as
/// `<system-reminder>` blocks before the task in the first user message
/// (returned too), then 14 rounds of text and a tool call.
fn claude_code_session() -> (Value, Value) {
    let head = serde_json::json!([
        {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\nRun `pytest -q` before you finish.\n</system-reminder>"},
        {"type": "text", "text": "<system-reminder>\nWorking directory: /repo\nPlatform: linux\n</system-reminder>"},
        {"type": "text", "text": "Fix the failing test in parser.py"}
    ]);
    let mut messages = vec![serde_json::json!({"role": "user", "content": head})];
    for t in 0..14 {
        let thought: String = (0..120).map(|w| format!("idea{t}x{w} ")).collect();
        messages.push(serde_json::json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Step {t}. {thought}")},
            {"type": "tool_use", "id": format!("toolu_{t:02}"), "name": "Read", "input": {"file_path": format!("/repo/src/f{t}.py")}}
        ]}));
        let lines: String = (0..30)
            .map(|l| format!("{l:>4} value_{t}_{l} = parse(data[{l}:])\n"))
            .collect();
        messages.push(serde_json::json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{t:02}"), "content": lines}
        ]}));
    }
    let body = serde_json::json!({"model": "agent-small", "max_tokens": 256,
        "system": "You are Claude Code.", "messages": messages});
    (head, body)
}

/// With a summarizer of its own configured (`summary.base_url`), a
/// Messages request's checkpoint comes from it, in chat completions, and
/// the client's Anthropic key never goes there.
#[tokio::test]
async fn a_configured_summarizer_writes_messages_checkpoints_without_the_clients_key() {
    let h = Harness::with(|c| {
        by_messages(20.0)(c);
        c.summary.base_url = Some(c.upstream.base_url.clone());
    })
    .await;
    let (_, body) = claude_code_session();
    send_summarized_messages(&h, &body).await;
    let calls = h.mock.summary_calls();
    assert!(!calls.is_empty());
    for call in &calls {
        assert_eq!(call.path, "/v1/chat/completions");
        assert!(call.headers.get("x-api-key").is_none());
        assert!(call.headers.get("authorization").is_none());
    }
}

/// Sends a Messages request as Claude Code does and checks it was
/// summarized.
async fn send_summarized_messages(h: &Harness, body: &Value) {
    let resp = h
        .client
        .post(h.url("/v1/messages"))
        .header("x-api-key", "sk-ant-client")
        .header("anthropic-version", "2023-06-01")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("summarize"), "{}", actions(&resp));
    let _ = resp.text().await.unwrap();
}

/// A Codex-like Responses session: AGENTS.md instructions and the
/// environment as user messages before the task, then 14 rounds of text
/// and a tool call with a large output.
fn codex_session() -> Value {
    let mut input = vec![
        serde_json::json!({"type": "message", "role": "user", "content": [{"type": "input_text",
            "text": "# AGENTS.md instructions for /repo\n\nRun the tests before you finish."}]}),
        serde_json::json!({"type": "message", "role": "user", "content": [{"type": "input_text",
            "text": "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"}]}),
        serde_json::json!({"type": "message", "role": "user", "content": [{"type": "input_text",
            "text": "Fix the failing test in parser.py"}]}),
    ];
    for t in 0..14 {
        let thought: String = (0..120).map(|w| format!("idea{t}x{w} ")).collect();
        input.push(
            serde_json::json!({"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": format!("Step {t}. {thought}")}]}),
        );
        input.push(
            serde_json::json!({"type": "function_call", "call_id": format!("call_{t}"),
            "name": "shell", "arguments": format!("{{\"cmd\":\"cat src/f{t}.py\"}}")}),
        );
        let lines: String = (0..30)
            .map(|l| format!("{l:>4} value_{t}_{l} = parse(data[{l}:])\n"))
            .collect();
        input.push(
            serde_json::json!({"type": "function_call_output", "call_id": format!("call_{t}"),
            "output": lines}),
        );
    }
    serde_json::json!({"model": "agent-small", "instructions": "You are Codex.", "input": input,
        "store": false, "stream": false,
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]})
}

/// A Responses request that needs a checkpoint gets one from the
/// upstream's Responses API, in its format (stateless), with the client's
/// own key: an upstream that speaks Responses may speak nothing else. The
/// instructions, environment and task stay first and whole.
#[tokio::test]
async fn a_responses_checkpoint_is_written_by_the_responses_api_with_the_clients_key() {
    let h = Harness::with(by_messages(20.0)).await;
    let body = codex_session();
    let resp = h
        .client
        .post(h.url("/v1/responses"))
        .header("authorization", "Bearer sk-client-key")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(actions(&resp).contains("summarize"), "{}", actions(&resp));
    let _ = resp.text().await.unwrap();
    let calls = h.mock.summary_calls();
    assert!(!calls.is_empty());
    for call in &calls {
        assert_eq!(call.path, "/v1/responses");
        assert_eq!(call.headers["authorization"], "Bearer sk-client-key");
        let v = call.json();
        assert_eq!(v["store"], false, "{v}");
        assert!(v["max_output_tokens"].as_u64().is_some(), "{v}");
        assert!(v.get("messages").is_none() && v.get("stream").is_none());
    }
    let ask = calls[0].json()["input"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!ask.contains("environment_context"), "{ask}");
    let sent = h
        .mock
        .requests()
        .into_iter()
        .rfind(|r| r.path == "/v1/responses" && !common::is_summary_call(&r.body))
        .unwrap()
        .json();
    let sent = sent["input"].as_array().unwrap();
    let original = body["input"].as_array().unwrap();
    assert_eq!(sent[..3], original[..3]);
    assert!(
        sent[3].to_string().contains("; checkpoint. The"),
        "{}",
        sent[3]
    );
    assert!(sent.len() < original.len());
    assert_eq!(sent.last(), original.last());
}
