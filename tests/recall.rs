//! Reversible compaction through the proxy, in all three formats: a model
//! that calls `condense_recall` with a key it found in its prompt gets the
//! original back inside the same client request, and the client sees only
//! the final answer.
//!
//! The upstream is a scripted model declared here: when it is offered
//! `condense_recall`, its prompt holds a `recall key: K` and it has not had
//! a recall result yet, it calls the tool with the first key (optionally
//! after some text, or always); otherwise it answers "final answer".

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use condense::config::Config;
use condense::server::Server;
use futures_util::StreamExt;
use serde_json::{Value, json};

const RECALL: &str = "condense_recall";
const COMPRESS: &str = "compress_context";

#[derive(Default)]
struct Model {
    requests: Mutex<Vec<(String, Value)>>,
    /// The headers of each request, beside `requests`.
    headers: Mutex<Vec<http::HeaderMap>>,
    /// Write some text before the call (a stream lets it through first).
    text_first: AtomicBool,
    /// Call the tool on every request, results or not.
    always: AtomicBool,
    /// Ask for this key instead of the first one in the prompt.
    key: Mutex<Option<String>>,
    /// Call `compress_context` when offered (once per conversation).
    compress: AtomicBool,
    /// Answer 200 with the start of a JSON body, then nothing.
    stall: AtomicBool,
}

impl Model {
    fn requests(&self) -> Vec<(String, Value)> {
        self.requests.lock().unwrap().clone()
    }
}

struct Upstream {
    addr: SocketAddr,
    model: Arc<Model>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn upstream() -> Upstream {
    let model = Arc::new(Model::default());
    let app = Router::new().fallback(answer).with_state(model.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Upstream { addr, model, task }
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

async fn answer(State(model): State<Arc<Model>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let headers = req.headers().clone();
    let bytes = axum::body::to_bytes(req.into_body(), usize::MAX)
        .await
        .unwrap();
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        // The model listing condense may ask for.
        return json_body(json!({"object": "list", "data": []}));
    };
    model
        .requests
        .lock()
        .unwrap()
        .push((path.clone(), body.clone()));
    model.headers.lock().unwrap().push(headers);
    let text = String::from_utf8_lossy(&bytes);
    let offered = body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["name"] == RECALL || t["function"]["name"] == RECALL);
    // Results of an earlier call carry its id, "recall_<n>".
    let answered = text.contains("\"recall_");
    let key = model
        .key
        .lock()
        .unwrap()
        .clone()
        .or_else(|| first_key(&text));
    let call = match key {
        Some(k) if offered && (!answered || model.always.load(Ordering::SeqCst)) => Some(k),
        _ => None,
    };
    if model.stall.load(Ordering::SeqCst) {
        let start = futures_util::stream::once(async { Ok::<_, std::io::Error>("{\"id\":") });
        let body = Body::from_stream(start.chain(futures_util::stream::pending()));
        return ([("content-type", "application/json")], body).into_response();
    }
    let n = model.requests.lock().unwrap().len();
    let compress_offered = body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["name"] == COMPRESS || t["function"]["name"] == COMPRESS);
    if model.compress.load(Ordering::SeqCst)
        && compress_offered
        && !text.contains("\"tool_call_id\":\"compress_")
    {
        let id = format!("compress_{n}");
        return chat_call(COMPRESS, json!({"reason": "step one done"}), &id);
    }
    let id = format!("recall_{n}");
    let lead = model.text_first.load(Ordering::SeqCst);
    let stream = body["stream"] == true;
    let prompt = (bytes.len() / 4) as u64;
    match path.as_str() {
        "/v1/chat/completions" => chat(call, &id, lead, stream, prompt),
        "/v1/messages" => messages(call, &id, lead, stream, prompt),
        "/v1/responses" => responses(call, &id, lead, stream, prompt),
        _ => (axum::http::StatusCode::NOT_FOUND, "no such route").into_response(),
    }
}

fn json_body(v: Value) -> Response {
    ([("content-type", "application/json")], v.to_string()).into_response()
}

fn sse(events: Vec<(Option<&str>, Value)>, done: bool) -> Response {
    let mut out = String::new();
    for (name, data) in events {
        if let Some(name) = name {
            out.push_str(&format!("event: {name}\n"));
        }
        out.push_str(&format!("data: {data}\n\n"));
    }
    if done {
        out.push_str("data: [DONE]\n\n");
    }
    ([("content-type", "text/event-stream")], Body::from(out)).into_response()
}

fn chat(call: Option<String>, id: &str, lead: bool, stream: bool, prompt: u64) -> Response {
    let args = call.as_ref().map(|k| json!({"key": k}).to_string());
    let content = match (&call, lead) {
        (Some(_), false) => Value::Null,
        (Some(_), true) => json!("Let me look that up."),
        (None, _) => json!("final answer"),
    };
    let usage =
        json!({"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5});
    let finish = if call.is_some() { "tool_calls" } else { "stop" };
    if !stream {
        let mut message = json!({"role": "assistant", "content": content, "refusal": null});
        if let Some(args) = &args {
            message["tool_calls"] = json!([{"id": id, "type": "function",
                "function": {"name": RECALL, "arguments": args}}]);
        }
        return json_body(
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
            "model": "agent-small", "choices": [{"index": 0, "message": message,
            "finish_reason": finish}], "usage": usage}),
        );
    }
    let chunk = |delta: Value, finish: Value| {
        (
            None,
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "agent-small", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    if let Some(text) = content.as_str() {
        events.push(chunk(json!({"content": text}), Value::Null));
    }
    if let Some(args) = &args {
        events.push(chunk(
            json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                "function": {"name": RECALL, "arguments": ""}}]}),
            Value::Null,
        ));
        events.push(chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": args}}]}),
            Value::Null,
        ));
    }
    events.push(chunk(json!({}), json!(finish)));
    events.push((
        None,
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
        "model": "agent-small", "choices": [], "usage": usage}),
    ));
    sse(events, true)
}

/// A chat answer calling `name` with `args` (JSON only).
fn chat_call(name: &str, args: Value, id: &str) -> Response {
    json_body(
        json!({"id": "chatcmpl-2", "object": "chat.completion", "created": 1,
        "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": name, "arguments": args.to_string()}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}),
    )
}

fn messages(call: Option<String>, id: &str, lead: bool, stream: bool, prompt: u64) -> Response {
    let mut content = Vec::new();
    if lead || call.is_none() {
        let text = if call.is_some() {
            "Let me look that up."
        } else {
            "final answer"
        };
        content.push(json!({"type": "text", "text": text}));
    }
    if let Some(k) = &call {
        content.push(json!({"type": "tool_use", "id": id, "name": RECALL, "input": {"key": k}}));
    }
    let stop = if call.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    if !stream {
        return json_body(
            json!({"id": "msg_1", "type": "message", "role": "assistant",
            "model": "claude-x", "content": content, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": prompt, "output_tokens": 5}}),
        );
    }
    let mut events = vec![(
        Some("message_start"),
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
        "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null,
        "stop_sequence": null, "usage": {"input_tokens": prompt, "output_tokens": 1}}}),
    )];
    for (i, block) in content.iter().enumerate() {
        let (start, delta) = match block["type"].as_str().unwrap() {
            "text" => (
                json!({"type": "text", "text": ""}),
                json!({"type": "text_delta", "text": block["text"]}),
            ),
            _ => (
                json!({"type": "tool_use", "id": block["id"], "name": RECALL, "input": {}}),
                json!({"type": "input_json_delta", "partial_json": block["input"].to_string()}),
            ),
        };
        events.push((
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        ));
        events.push((
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": i, "delta": delta}),
        ));
        events.push((
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    events.push((
        Some("message_delta"),
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
        "usage": {"output_tokens": 5}}),
    ));
    events.push((Some("message_stop"), json!({"type": "message_stop"})));
    sse(events, false)
}

fn responses(call: Option<String>, id: &str, lead: bool, stream: bool, prompt: u64) -> Response {
    let mut output = Vec::new();
    if lead || call.is_none() {
        let text = if call.is_some() {
            "Let me look that up."
        } else {
            "final answer"
        };
        output.push(json!({"type": "message", "id": "msg_1", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}));
    }
    if let Some(k) = &call {
        output.push(
            json!({"type": "function_call", "id": "fc_1", "call_id": id, "name": RECALL,
            "arguments": json!({"key": k}).to_string(), "status": "completed"}),
        );
    }
    let response = json!({"id": "resp_1", "object": "response", "status": "completed",
        "model": "gpt-x", "output": output,
        "usage": {"input_tokens": prompt, "output_tokens": 5, "total_tokens": prompt + 5}});
    if !stream {
        return json_body(response);
    }
    let mut events = vec![(
        Some("response.created"),
        json!({"type": "response.created", "sequence_number": 0,
            "response": {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}}),
    )];
    for (i, item) in output.iter().enumerate() {
        events.push((
            Some("response.output_item.added"),
            json!({"type": "response.output_item.added", "output_index": i, "item": item}),
        ));
        events.push((
            Some("response.output_item.done"),
            json!({"type": "response.output_item.done", "output_index": i, "item": item}),
        ));
    }
    events.push((
        Some("response.completed"),
        json!({"type": "response.completed", "response": response}),
    ));
    sse(events, false)
}

async fn condense(up: &Upstream, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = format!("http://{}/v1", up.addr);
    config.upstream.anthropic_base_url = format!("http://{}/v1", up.addr);
    config.models.push(common::profile("agent-*", 8192));
    tweak(&mut config);
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

/// The original of the first tool result the session below holds.
fn first_output() -> String {
    output(0)
}

fn output(t: usize) -> String {
    let body: String = (0..60)
        .map(|l| format!("{l:>4} let v{t}_{l} = parse(&input[{l}..]);\n"))
        .collect();
    format!("{body}error[E0308]: mismatched types in src/m{t}.rs\n")
}

/// A chat session long enough for an 8k window, with tools.
fn chat_session(stream: bool) -> Value {
    // The shared coding session: its tool outputs are `output(t)`.
    let mut session = common::coding_session("agent-small", 12, 0, 60);
    session["stream"] = json!(stream);
    session["stream_options"] = json!({"include_usage": true});
    session["tools"] = json!([{"type": "function", "function": {"name": "run",
        "description": "Runs a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]);
    session
}

fn messages_session(stream: bool) -> Value {
    let mut messages =
        vec![json!({"role": "user", "content": "Fix the failing test in src/parser.rs"})];
    for t in 0..12 {
        let id = format!("toolu_{t}");
        messages.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Reading file {t}.")},
            {"type": "tool_use", "id": id, "name": "run", "input": {"cmd": format!("cat src/m{t}.rs")}}]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": output(t)}]}));
    }
    json!({"model": "agent-small", "system": "You are a coding agent.", "messages": messages,
        "max_tokens": 256, "stream": stream,
        "tools": [{"name": "run", "description": "Runs a command",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]})
}

fn responses_session(stream: bool) -> Value {
    let mut input =
        vec![json!({"role": "user", "content": "Fix the failing test in src/parser.rs"})];
    for t in 0..12 {
        let id = format!("call_{t}");
        input.push(
            json!({"type": "function_call", "call_id": id, "name": "run",
            "arguments": json!({"cmd": format!("cat src/m{t}.rs")}).to_string()}),
        );
        input.push(json!({"type": "function_call_output", "call_id": id, "output": output(t)}));
    }
    json!({"model": "agent-small", "instructions": "You are a coding agent.", "input": input,
        "max_output_tokens": 256, "stream": stream, "store": false,
        "tools": [{"type": "function", "name": "run", "description": "Runs a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]})
}

async fn send(server: &Server, path: &str, body: &Value) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("http://{}{path}", server.local_addr()))
        .header("authorization", "Bearer sk-test")
        .header("x-api-key", "sk-test")
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn metric(server: &Server, series: &str) -> f64 {
    // Once the work after an answer (its usage read) is done.
    server.state().proxy.settled().await;
    common::metric_at(server.local_addr(), series).await
}

/// The text a streamed chat answer carries, and whether any chunk had a
/// tool call.
fn chat_stream_text(sse: &str) -> (String, bool, Vec<Value>) {
    let mut text = String::new();
    let mut calls = false;
    let mut chunks = Vec::new();
    for line in sse.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        calls |= v["choices"][0]["delta"].get("tool_calls").is_some();
        chunks.push(v);
    }
    (text, calls, chunks)
}

#[tokio::test]
async fn a_chat_recall_is_answered_inside_the_request_json_and_streamed() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    for stream in [false, true] {
        let before = up.model.requests().len();
        let (status, body) = send(&server, "/v1/chat/completions", &chat_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        let seen = &up.model.requests()[before..];
        assert_eq!(seen.len(), 2, "the recall took one more round");
        // The round after it goes with the first one's headers (the
        // client's key among them); only the body's length differs.
        let sent: Vec<_> = up.model.headers.lock().unwrap()[before..]
            .iter()
            .map(|h| {
                let mut h = h.clone();
                h.remove("content-length");
                h
            })
            .collect();
        assert_eq!(sent[0], sent[1]);
        assert_eq!(sent[1]["authorization"], "Bearer sk-test");
        assert_eq!(sent[1]["accept-encoding"], "identity");
        // The first request was compacted and offered the tool.
        let first = &seen[0].1;
        let tools = first["tools"].as_array().unwrap();
        assert_eq!(tools[0]["function"]["name"], "run");
        assert_eq!(tools[1]["function"]["name"], RECALL);
        let first_text = first.to_string();
        let key = first_key(&first_text).expect("a recall key in the compacted prompt");
        // The second holds the original verbatim, answering the call.
        let second = seen[1].1["messages"].as_array().unwrap().clone();
        let n = second.len();
        assert_eq!(second[n - 2]["tool_calls"][0]["function"]["name"], RECALL);
        assert_eq!(
            second[n - 2]["tool_calls"][0]["function"]["arguments"],
            json!({"key": key}).to_string()
        );
        assert_eq!(second[n - 1]["role"], "tool");
        assert_eq!(second[n - 1]["content"], first_output());
        // The client sees the final answer only, with both rounds' usage.
        assert!(!body.contains(RECALL), "{body}");
        if stream {
            let (text, calls, chunks) = chat_stream_text(&body);
            assert_eq!(text, "final answer");
            assert!(!calls);
            let usage = chunks.iter().find(|c| c["usage"].is_object()).unwrap();
            let expected: u64 = seen
                .iter()
                .map(|(_, b)| (b.to_string().len() / 4) as u64)
                .sum();
            // The mock counts the body it received (bytes / 4); the JSON
            // it re-serializes here is near enough: within a few tokens.
            let got = usage["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(got.abs_diff(expected) < 50, "{got} vs {expected}");
            assert!(body.trim_end().ends_with("data: [DONE]"));
        } else {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["choices"][0]["message"]["content"], "final answer");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(
                prompt > (seen[1].1.to_string().len() / 4) as u64,
                "usage covers both rounds: {prompt}"
            );
        }
    }
    assert_eq!(
        metric(&server, "condense_recalls_total{outcome=\"answered\"}").await,
        2.0
    );
    assert!(
        metric(&server, "condense_recalled_bytes_total").await >= 2.0 * first_output().len() as f64
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_recall_after_streamed_text_is_taken_out_and_a_limit_holds() {
    let up = upstream().await;
    let server = condense(&up, |c| c.compaction.max_recalls = 2).await;
    // Text went out first: the call is taken out of the stream.
    up.model.text_first.store(true, Ordering::SeqCst);
    let (status, body) = send(&server, "/v1/chat/completions", &chat_session(true)).await;
    assert_eq!(status, 200);
    let (text, calls, chunks) = chat_stream_text(&body);
    assert_eq!(text, "Let me look that up.");
    assert!(!calls, "{body}");
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str())
        .unwrap();
    assert_eq!(finish, "stop");
    assert_eq!(up.model.requests().len(), 1);
    assert_eq!(
        metric(&server, "condense_recalls_total{outcome=\"stripped\"}").await,
        1.0
    );

    // A model that keeps calling gets max_recalls answers, then the client
    // gets the answer without the call.
    up.model.text_first.store(false, Ordering::SeqCst);
    up.model.always.store(true, Ordering::SeqCst);
    for stream in [false, true] {
        let before = up.model.requests().len();
        let (status, body) = send(&server, "/v1/chat/completions", &chat_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(up.model.requests().len() - before, 3);
        assert!(!body.contains(RECALL), "{body}");
        if !stream {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            assert!(v["choices"][0]["message"].get("tool_calls").is_none());
        }
    }
    assert_eq!(
        metric(&server, "condense_recalls_total{outcome=\"limit_reached\"}").await,
        2.0
    );

    // A key condense never gave gets a result saying so.
    up.model.always.store(false, Ordering::SeqCst);
    *up.model.key.lock().unwrap() = Some("not-a-real-key".into());
    let before = up.model.requests().len();
    let (status, _) = send(&server, "/v1/chat/completions", &chat_session(false)).await;
    assert_eq!(status, 200);
    let second = &up.model.requests()[before + 1].1;
    let last = second["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        last["content"]
            .as_str()
            .unwrap()
            .contains("nothing is stored under recall key \"not-a-real-key\""),
        "{last}"
    );
    assert_eq!(
        metric(&server, "condense_recalls_total{outcome=\"unknown_key\"}").await,
        1.0
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn messages_and_responses_recalls_keep_their_apis_rules() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    for stream in [false, true] {
        let before = up.model.requests().len();
        let (status, body) = send(&server, "/v1/messages", &messages_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        let seen = &up.model.requests()[before..];
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].1["tools"][1]["name"], RECALL);
        let m = seen[1].1["messages"].as_array().unwrap().clone();
        let n = m.len();
        assert_eq!(m[n - 2]["role"], "assistant");
        assert_eq!(m[n - 2]["content"][0]["type"], "tool_use");
        assert_eq!(m[n - 1]["role"], "user");
        assert_eq!(m[n - 1]["content"][0]["type"], "tool_result");
        assert_eq!(m[n - 1]["content"][0]["content"], first_output());
        // Roles still alternate.
        for w in m.windows(2) {
            assert_ne!(w[0]["role"], w[1]["role"]);
        }
        assert!(!body.contains(RECALL), "{body}");
        assert!(body.contains("final answer"));
        if !stream {
            let v: Value = serde_json::from_str(&body).unwrap();
            let sent: u64 = seen
                .iter()
                .map(|(_, b)| (b.to_string().len() / 4) as u64)
                .sum();
            let got = v["usage"]["input_tokens"].as_u64().unwrap();
            assert!(got.abs_diff(sent) < 50, "{got} vs {sent}");
        }

        let before = up.model.requests().len();
        let (status, body) = send(&server, "/v1/responses", &responses_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        let seen = &up.model.requests()[before..];
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].1["tools"][1]["name"], RECALL);
        let input = seen[1].1["input"].as_array().unwrap().clone();
        let n = input.len();
        assert_eq!(input[n - 2]["type"], "function_call");
        assert_eq!(input[n - 2]["name"], RECALL);
        assert!(input[n - 2].get("id").is_none());
        assert_eq!(input[n - 1]["type"], "function_call_output");
        assert_eq!(input[n - 1]["call_id"], input[n - 2]["call_id"]);
        assert_eq!(input[n - 1]["output"], first_output());
        assert!(!body.contains(RECALL), "{body}");
        assert!(body.contains("final answer"));
    }

    // A Claude answer that writes text before the call: the stream goes
    // out, the call is taken out and the stop reason says the turn ended.
    up.model.text_first.store(true, Ordering::SeqCst);
    let (_, body) = send(&server, "/v1/messages", &messages_session(true)).await;
    assert!(body.contains("Let me look that up."));
    assert!(!body.contains(RECALL), "{body}");
    assert!(body.contains("\"stop_reason\":\"end_turn\""), "{body}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn recall_off_offers_nothing_and_requests_without_tools_get_no_keys() {
    let up = upstream().await;
    let server = condense(&up, |c| c.compaction.recall = false).await;
    let (status, _) = send(&server, "/v1/chat/completions", &chat_session(false)).await;
    assert_eq!(status, 200);
    let seen = up.model.requests();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].1.to_string().contains("[condense:"));
    assert!(!seen[0].1.to_string().contains("recall key"));
    assert_eq!(seen[0].1["tools"].as_array().unwrap().len(), 1);
    server.shutdown().await.unwrap();

    let server = condense(&up, |_| {}).await;
    let mut no_tools = chat_session(false);
    no_tools.as_object_mut().unwrap().remove("tools");
    send(&server, "/v1/chat/completions", &no_tools).await;
    let last = up.model.requests().pop().unwrap().1.to_string();
    assert!(last.contains("[condense:") && !last.contains("recall key"));
    server.shutdown().await.unwrap();
}

#[tokio::test]
#[ignore = "needs redis-server; run with cargo test -- --ignored redis"]
async fn redis_replicas_answer_each_others_recall_keys() {
    let redis = common::Redis::start();
    let up = upstream().await;
    let url = redis.url();
    let shared = |c: &mut Config| c.state.redis_url = Some(condense::config::Secret::new(&url));
    let a = condense(&up, shared).await;
    let b = condense(&up, shared).await;
    // Replica a compacts the session and stores the originals.
    up.model.key.lock().unwrap().replace("none-at-all".into());
    send(&a, "/v1/chat/completions", &chat_session(false)).await;
    let compacted = up.model.requests()[0].1.clone();
    let key = first_key(&compacted.to_string()).unwrap();
    // Replica b gets the compacted conversation (keys, no originals) and
    // answers the model's call from the store.
    *up.model.key.lock().unwrap() = Some(key);
    let mut body = compacted.clone();
    body["tools"].as_array_mut().unwrap().truncate(1);
    // Stored in the background by a: wait for it.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let before = up.model.requests().len();
    let (status, _) = send(&b, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let second = &up.model.requests()[before + 1].1;
    let last = second["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["content"], first_output());
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test]
async fn compress_context_is_answered_and_the_next_request_is_compacted_up_to_that_point() {
    let up = upstream().await;
    let server = condense(&up, |c| c.compaction.agent_tool = true).await;
    up.model.compress.store(true, Ordering::SeqCst);
    // A session far below the trigger of a large window.
    let mut session = chat_session(false);
    session["model"] = json!("gpt-4o");
    let (status, body) = send(&server, "/v1/chat/completions", &session).await;
    assert_eq!(status, 200, "{body}");
    let seen = up.model.requests();
    assert_eq!(seen.len(), 2);
    let tools: Vec<&Value> = seen[0].1["tools"].as_array().unwrap().iter().collect();
    assert_eq!(
        tools.len(),
        2,
        "run, then compress_context (no recall keys yet)"
    );
    assert_eq!(tools[1]["function"]["name"], COMPRESS);
    assert_eq!(
        tools[1]["function"]["parameters"]["required"],
        json!(["reason"])
    );
    // The request went out as the client sent it: nothing was due yet.
    assert!(!seen[0].1.to_string().contains("[condense:"));
    let answer = seen[1].1["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        answer["content"].as_str().unwrap().contains("noted"),
        "{answer}"
    );
    assert!(!body.contains(COMPRESS), "{body}");
    assert_eq!(
        metric(
            &server,
            "condense_agent_compactions_total{outcome=\"requested\"}"
        )
        .await,
        1.0
    );

    // The conversation goes on: what came before the point is compacted,
    // though the request is far below the trigger, and stays so.
    let mut next = session.clone();
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": "Now the second step.", "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"ls\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_x", "content": output(20)}));
    let mut sent = Vec::new();
    for _ in 0..2 {
        let before = up.model.requests().len();
        let resp = reqwest::Client::new()
            .post(format!(
                "http://{}/v1/chat/completions",
                server.local_addr()
            ))
            .header("authorization", "Bearer sk-test")
            .header("x-api-key", "sk-test")
            .header("content-type", "application/json")
            .body(next.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let actions = resp.headers()["x-condense-actions"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(actions.contains("mask"), "{actions}");
        resp.text().await.unwrap();
        sent.push(up.model.requests()[before].1["messages"].clone());
    }
    let first = sent[0].as_array().unwrap();
    assert!(
        first[3]["content"]
            .as_str()
            .unwrap()
            .starts_with("[condense: recall key: ")
    );
    // The new turn after the point is untouched.
    assert_eq!(first[first.len() - 1]["content"], output(20));
    assert_eq!(sent[0], sent[1], "the same request compacts the same way");
    assert_eq!(
        metric(
            &server,
            "condense_agent_compactions_total{outcome=\"applied\"}"
        )
        .await,
        2.0
    );
    // Another client's identical conversation has no point recorded.
    let resp = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/chat/completions",
            server.local_addr()
        ))
        .header("authorization", "Bearer sk-other")
        .header("content-type", "application/json")
        .body(next.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_json_answer_that_stalls_is_relayed_under_the_idle_timeout() {
    let up = upstream().await;
    let server = condense(&up, |c| c.upstream.idle_timeout_seconds = 1.0).await;
    up.model.stall.store(true, Ordering::SeqCst);
    // Offered the tool, condense reads the answer for its calls; a stalled
    // one still reaches the client (cut off by the relay), never hangs.
    let reply = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        let resp = reqwest::Client::new()
            .post(format!(
                "http://{}/v1/chat/completions",
                server.local_addr()
            ))
            .header("content-type", "application/json")
            .body(chat_session(false).to_string())
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.bytes().await.is_err())
    })
    .await;
    // The status the upstream gave, then the body cut off as any stalled
    // body is.
    assert_eq!(reply.ok(), Some((200, true)), "the client request hung");
    let tools = up.model.requests()[0].1["tools"].as_array().unwrap().len();
    assert_eq!(tools, 2, "the stalled request was offered the tool");
    server.shutdown().await.unwrap();
}
