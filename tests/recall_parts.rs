//! Reading part of an original through the proxy, in all three formats: a
//! model that calls `condense_recall` with a line range or a search gets
//! those lines, numbered; a result larger than the room says which lines
//! it shows and the arguments that read on, and following them gives the
//! rest.
//!
//! The original is a 1200-line log (about 40 KB, more than the 8k window
//! the model has) whose one needed line, 837, sits in its middle: where
//! cutting the middle out of it lost that line, a search finds it.
//!
//! The upstream is a scripted model declared here: offered
//! `condense_recall` with a `recall key: K` in its prompt, it calls the tool
//! with the next arguments of its script (K filled in), or with the
//! arguments the last result's note names, and answers "final answer" once
//! the script is done. What it received as each result is checked.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use condense::config::Config;
use condense::server::Server;
use serde_json::{Value, json};

const RECALL: &str = "condense_recall";
const LINES: usize = 1200;
const NEEDED: usize = 837;

/// The original the model recalls: line `l` of it.
fn log_line(l: usize) -> String {
    if l == NEEDED {
        return format!("{l:>5} ERROR: disk quota exceeded on /var/data");
    }
    let sum = (l as u64).wrapping_mul(2_654_435_761) % (1 << 32);
    format!("{l:>5} entry {l}: block checksum {sum:08x} ok")
}

fn big_log() -> String {
    (1..=LINES).map(|l| log_line(l) + "\n").collect()
}

/// One step of the model's script.
#[derive(Clone)]
enum Step {
    /// Call with these arguments (the key filled in).
    Ask(Value),
    /// Call with the arguments the last result's note names (if it names
    /// any).
    Follow,
}

#[derive(Default)]
struct Model {
    script: Mutex<Vec<Step>>,
    requests: Mutex<Vec<(String, Value)>>,
}

impl Model {
    fn script(&self, steps: Vec<Step>) {
        *self.script.lock().unwrap() = steps;
    }

    /// The last request's condense results, in order.
    fn results(&self) -> Vec<String> {
        let (path, body) = self.requests.lock().unwrap().last().cloned().unwrap();
        results(&path, &body)
    }

    /// The arguments of the next call, if the script has one.
    fn next_call(&self, prompt: &str, results: &[String]) -> Option<Value> {
        let key = first_key(prompt)?;
        let script = self.script.lock().unwrap();
        match script.get(results.len())?.clone() {
            Step::Ask(mut args) => {
                args["key"] = json!(key);
                Some(args)
            }
            Step::Follow => note_args(results.last()?),
        }
    }
}

/// The arguments a result's first line says to read on with.
fn note_args(result: &str) -> Option<Value> {
    let first = result.lines().next()?;
    let at = first.find(" with {")? + " with ".len();
    serde_json::from_str(first[at..].strip_suffix(']')?).ok()
}

/// The first recall key in `text`.
fn first_key(text: &str) -> Option<String> {
    let at = text.find("recall key: ")? + "recall key: ".len();
    let key: String = text[at..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
        .collect();
    Some(key)
}

/// The results of condense's calls a request carries, in order (their ids
/// are the model's, `recall_<n>`).
fn results(path: &str, body: &Value) -> Vec<String> {
    let ours = |id: &Value| id.as_str().is_some_and(|i| i.starts_with("recall_"));
    let list = |key: &str| body[key].as_array().cloned().unwrap_or_default();
    match path {
        "/v1/chat/completions" => list("messages")
            .iter()
            .filter(|m| m["role"] == "tool" && ours(&m["tool_call_id"]))
            .map(|m| m["content"].as_str().unwrap().to_string())
            .collect(),
        "/v1/messages" => list("messages")
            .iter()
            .filter_map(|m| m["content"].as_array().cloned())
            .flatten()
            .filter(|b| b["type"] == "tool_result" && ours(&b["tool_use_id"]))
            .map(|b| b["content"].as_str().unwrap().to_string())
            .collect(),
        _ => list("input")
            .iter()
            .filter(|i| i["type"] == "function_call_output" && ours(&i["call_id"]))
            .map(|i| i["output"].as_str().unwrap().to_string())
            .collect(),
    }
}

struct Upstream {
    addr: SocketAddr,
    model: Arc<Model>,
    _served: common::Served,
}

async fn upstream() -> Upstream {
    let model = Arc::new(Model::default());
    let served = common::serve(Router::new().fallback(answer).with_state(model.clone())).await;
    Upstream {
        addr: served.addr,
        model,
        _served: served,
    }
}

async fn answer(State(model): State<Arc<Model>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let bytes = axum::body::to_bytes(req.into_body(), usize::MAX)
        .await
        .unwrap();
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        // The model listing condense may ask for.
        return common::json_response(json!({"object": "list", "data": []}));
    };
    model
        .requests
        .lock()
        .unwrap()
        .push((path.clone(), body.clone()));
    let offered = body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["name"] == RECALL || t["function"]["name"] == RECALL);
    let done = results(&path, &body);
    let call = offered
        .then(|| model.next_call(&String::from_utf8_lossy(&bytes), &done))
        .flatten();
    let id = format!("recall_{}", done.len());
    let stream = body["stream"] == true;
    match path.as_str() {
        "/v1/chat/completions" => chat(call, &id),
        "/v1/messages" => messages(call, &id, stream),
        _ => responses(call, &id),
    }
}

const USAGE: (u64, u64) = (100, 5);

fn chat(call: Option<Value>, id: &str) -> Response {
    let mut message = json!({"role": "assistant", "content": "final answer", "refusal": null});
    if let Some(args) = &call {
        message["content"] = Value::Null;
        message["tool_calls"] = json!([{"id": id, "type": "function",
            "function": {"name": RECALL, "arguments": args.to_string()}}]);
    }
    let finish = if call.is_some() { "tool_calls" } else { "stop" };
    common::json_response(
        json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
        "model": "agent-small", "choices": [{"index": 0, "message": message,
        "finish_reason": finish}], "usage": {"prompt_tokens": USAGE.0,
        "completion_tokens": USAGE.1, "total_tokens": USAGE.0 + USAGE.1}}),
    )
}

fn messages(call: Option<Value>, id: &str, stream: bool) -> Response {
    let (block, stop) = match &call {
        Some(args) => (
            json!({"type": "tool_use", "id": id, "name": RECALL, "input": args}),
            "tool_use",
        ),
        None => (json!({"type": "text", "text": "final answer"}), "end_turn"),
    };
    let usage = json!({"input_tokens": USAGE.0, "output_tokens": USAGE.1});
    if !stream {
        return common::json_response(
            json!({"id": "msg_1", "type": "message", "role": "assistant",
            "model": "claude-x", "content": [block], "stop_reason": stop,
            "stop_sequence": null, "usage": usage}),
        );
    }
    let (start, delta) = match &call {
        Some(args) => (
            json!({"type": "tool_use", "id": id, "name": RECALL, "input": {}}),
            json!({"type": "input_json_delta", "partial_json": args.to_string()}),
        ),
        None => (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": "final answer"}),
        ),
    };
    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
            "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": USAGE.0, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": start}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
            "usage": {"output_tokens": USAGE.1}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let sse: String = events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect();
    ([("content-type", "text/event-stream")], Body::from(sse)).into_response()
}

fn responses(call: Option<Value>, id: &str) -> Response {
    let item = match &call {
        Some(args) => json!({"type": "function_call", "id": "fc_1", "call_id": id,
            "name": RECALL, "arguments": args.to_string(), "status": "completed"}),
        None => json!({"type": "message", "id": "msg_1", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": "final answer",
            "annotations": []}]}),
    };
    common::json_response(
        json!({"id": "resp_1", "object": "response", "status": "completed",
        "model": "gpt-x", "output": [item], "usage": {"input_tokens": USAGE.0,
        "output_tokens": USAGE.1, "total_tokens": USAGE.0 + USAGE.1}}),
    )
}

/// Recalls condense answers in one client request in the chat test.
const MAX_RECALLS: u32 = 4;

async fn condense(up: &Upstream, max_recalls: u32) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = format!("http://{}/v1", up.addr);
    config.upstream.anthropic_base_url = format!("http://{}/v1", up.addr);
    config.models.push(common::profile("agent-*", 8192));
    config.compaction.max_recalls = max_recalls;
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

/// The agent read the log first (the call condense masks), then a few
/// small results that stay.
fn small(t: usize) -> String {
    format!("ls dir{t}: file{t}.txt\n")
}

fn chat_session() -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are an ops agent."}),
        json!({"role": "user", "content": "Why did the nightly backup fail?"}),
    ];
    let mut turn = |t: usize, cmd: String, out: String| {
        let id = format!("call_{t}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": "run",
            "arguments": json!({"cmd": cmd}).to_string()}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
    };
    turn(0, "cat backup.log".into(), big_log());
    for t in 1..4 {
        turn(t, format!("ls dir{t}"), small(t));
    }
    json!({"model": "agent-small", "messages": messages, "max_tokens": 256,
        "tools": [{"type": "function", "function": {"name": "run",
        "description": "Runs a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]})
}

fn messages_session(stream: bool) -> Value {
    let mut messages = vec![json!({"role": "user", "content": "Why did the nightly backup fail?"})];
    let mut turn = |t: usize, cmd: String, out: String| {
        let id = format!("toolu_{t}");
        messages.push(json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": id, "name": "run", "input": {"cmd": cmd}}]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": out}]}));
    };
    turn(0, "cat backup.log".into(), big_log());
    for t in 1..4 {
        turn(t, format!("ls dir{t}"), small(t));
    }
    json!({"model": "agent-small", "system": "You are an ops agent.", "messages": messages,
        "max_tokens": 256, "stream": stream,
        "tools": [{"name": "run", "description": "Runs a command",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]})
}

fn responses_session() -> Value {
    let mut input = vec![json!({"role": "user", "content": "Why did the nightly backup fail?"})];
    let mut turn = |t: usize, cmd: String, out: String| {
        let id = format!("call_{t}");
        input.push(
            json!({"type": "function_call", "call_id": id, "name": "run",
            "arguments": json!({"cmd": cmd}).to_string()}),
        );
        input.push(json!({"type": "function_call_output", "call_id": id, "output": out}));
    };
    turn(0, "cat backup.log".into(), big_log());
    for t in 1..4 {
        turn(t, format!("ls dir{t}"), small(t));
    }
    json!({"model": "agent-small", "instructions": "You are an ops agent.", "input": input,
        "max_output_tokens": 256, "store": false,
        "tools": [{"type": "function", "name": "run", "description": "Runs a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]})
}

/// Lines `from..=to` of the log as a range shows them.
fn numbered(from: usize, to: usize) -> String {
    (from..=to)
        .map(|l| format!("{l}: {}\n", log_line(l)))
        .collect()
}

/// The key the model found in its first prompt.
fn key_of(up: &Upstream) -> String {
    let first = up.model.requests.lock().unwrap()[0].1.to_string();
    first_key(&first).expect("a recall key in the compacted prompt")
}

#[tokio::test]
async fn a_chat_recall_too_large_shows_a_prefix_and_reading_on_gives_the_rest() {
    let up = upstream().await;
    let server = condense(&up, MAX_RECALLS).await;
    // The key alone, then what each note says, as often as condense
    // answers in one request; then the next request goes on from where
    // the last note pointed (the room is the prompt's again).
    let mut results = Vec::new();
    let mut ask = json!({});
    for _ in 0..5 {
        let mut script = vec![Step::Ask(ask.clone())];
        script.extend((1..MAX_RECALLS).map(|_| Step::Follow));
        up.model.script(script);
        let (status, body) = common::post(&server, "/v1/chat/completions", &chat_session()).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "final answer");
        results.extend(up.model.results());
        match note_args(results.last().unwrap()) {
            Some(args) => ask = args,
            None => break,
        }
    }
    let key = key_of(&up);
    assert!(
        results.len() > MAX_RECALLS as usize,
        "{} results",
        results.len()
    );

    // The first: a whole prefix of the log, verbatim, after a note naming
    // the lines shown and the exact arguments for the rest.
    let (note, prefix) = results[0].split_once('\n').unwrap();
    let shown = prefix.lines().count();
    assert!(shown > 10 && shown < LINES, "{shown} lines");
    assert_eq!(
        note,
        format!(
            "[condense: cut to fit: lines 1-{shown} of {LINES} shown. For the rest call condense_recall with {{\"key\":\"{key}\",\"start_line\":{}}}]",
            shown + 1
        )
    );
    assert!(big_log().starts_with(prefix));

    // Each later one: the lines its note promised, numbered, to the last.
    let mut next = shown + 1;
    for (i, result) in results.iter().enumerate().skip(1) {
        let (note, lines) = result.split_once('\n').unwrap();
        let last = next + lines.lines().count() - 1;
        assert_eq!(lines, numbered(next, last), "result {i}");
        if last < LINES {
            assert_eq!(
                note,
                format!(
                    "[condense: cut to fit: lines {next}-{last} of {LINES} shown. For the rest call condense_recall with {{\"key\":\"{key}\",\"start_line\":{}}}]",
                    last + 1
                )
            );
        } else {
            assert_eq!(i, results.len() - 1);
            assert!(note.starts_with(&format!("[condense: lines {next}-{LINES} of {LINES}")));
        }
        next = last + 1;
    }
    assert_eq!(next, LINES + 1, "every line came back once");
    // Each call answered, its result's bytes counted.
    let answered =
        common::settled_metric(&server, "condense_recalls_total{outcome=\"answered\"}").await;
    assert_eq!(answered, results.len() as f64);
    let bytes: usize = results.iter().map(String::len).sum();
    assert_eq!(
        common::settled_metric(&server, "condense_recalled_bytes_total").await,
        bytes as f64
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_messages_recall_reads_a_range_and_finds_the_needed_line() {
    let up = upstream().await;
    let server = condense(&up, 3).await;
    for stream in [false, true] {
        up.model.requests.lock().unwrap().clear();
        // Numbers may come as strings.
        up.model.script(vec![
            Step::Ask(json!({"start_line": "600", "end_line": 603})),
            Step::Ask(json!({"search": "Disk Quota"})),
        ]);
        let (status, body) = common::post(&server, "/v1/messages", &messages_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("final answer"), "{body}");
        assert!(!body.contains(RECALL), "{body}");
        let results = up.model.results();
        assert_eq!(results.len(), 2);
        assert_eq!(
            results[0],
            format!(
                "[condense: lines 600-603 of {LINES}]\n{}",
                numbered(600, 603)
            )
        );
        assert_eq!(
            results[1],
            format!(
                "[condense: in lines 1-{LINES} of {LINES}, 1 line holds \"Disk Quota\" (ignoring case); `N:` marks such a line, `N-` the lines around it]\n\
                 835- {}\n836- {}\n837: {}\n838- {}\n839- {}\n",
                log_line(835),
                log_line(836),
                log_line(NEEDED),
                log_line(838),
                log_line(839)
            )
        );
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_responses_search_says_where_its_next_matches_are_and_bad_ranges_are_named() {
    let up = upstream().await;
    let server = condense(&up, 16).await;
    up.model.script(vec![
        // Every line but the needed one holds "entry".
        Step::Ask(json!({"search": "entry", "start_line": 1000})),
        // As often as condense answers (16, the most it may be set to).
    ]);
    up.model
        .script
        .lock()
        .unwrap()
        .extend((1..16).map(|_| Step::Follow));
    let (status, body) = common::post(&server, "/v1/responses", &responses_session()).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("final answer"), "{body}");
    let key = key_of(&up);
    let results = up.model.results();
    let (note, _) = results[0].split_once('\n').unwrap();
    let more = format!(
        "[condense: in lines 1000-{LINES} of {LINES}, 201 lines hold \"entry\" (ignoring case), the first 20 shown"
    );
    assert!(note.starts_with(&more), "{note}");
    assert!(note.ends_with(&format!(
        ". For the rest call condense_recall with {{\"key\":\"{key}\",\"start_line\":1020,\"search\":\"entry\"}}]"
    )));
    // Matches 1000..=1019 marked, with two lines after the last.
    let body: Vec<&str> = results[0].lines().skip(1).collect();
    assert_eq!(body.len(), 22);
    assert_eq!(body[0], format!("1000: {}", log_line(1000)));
    assert_eq!(body[19], format!("1019: {}", log_line(1019)));
    assert_eq!(body[21], format!("1021- {}", log_line(1021)));
    // The note's advice reads on from the first match not shown.
    assert!(results[1].contains(&format!("\n1020: {}\n", log_line(1020))));
    assert!(!results[1].contains("\n1019: "));
    // Read on to the end, every match came once, in order.
    let found: Vec<usize> = results
        .iter()
        .flat_map(|r| r.lines().skip(1))
        .filter_map(|l| l.split_once(": ")?.0.parse().ok())
        .collect();
    assert_eq!(found, (1000..=LINES).collect::<Vec<_>>());
    assert!(!results.last().unwrap().contains(" with {"));

    // Arguments that cannot be answered get a result saying why.
    up.model.requests.lock().unwrap().clear();
    up.model.script(vec![
        Step::Ask(json!({"start_line": 5000})),
        Step::Ask(json!({"start_line": 20, "end_line": 10})),
        Step::Ask(json!({"start_line": "ten"})),
        Step::Ask(json!({"search": "x".repeat(5000)})),
    ]);
    let (status, _) = common::post(&server, "/v1/responses", &responses_session()).await;
    assert_eq!(status, 200);
    assert_eq!(
        up.model.results(),
        vec![
            format!("[condense: start_line 5000 is past the end: the original has {LINES} lines]"),
            "[condense: end_line 10 is before start_line 20]".to_string(),
            format!("[condense: start_line must be a whole number from 1 to {LINES}, got \"ten\"]"),
            "[condense: search is longer than 200 characters: pass a short part of one line]"
                .to_string(),
        ]
    );
    server.shutdown().await.unwrap();
}
