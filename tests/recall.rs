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
    /// Call the client's `run` too, before condense's tool.
    client_call: AtomicBool,
    /// Answer a request carrying a recall result with a 500.
    fail_follow_up: AtomicBool,
}

/// How the model writes an answer that calls condense's tool.
#[derive(Clone, Copy)]
struct Reply {
    /// A sentence first.
    lead: bool,
    /// A call of the client's `run` too, before condense's tool.
    client_call: bool,
}

impl Model {
    fn requests(&self) -> Vec<(String, Value)> {
        self.requests.lock().unwrap().clone()
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
        return common::json_response(json!({"object": "list", "data": []}));
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
    if answered && model.fail_follow_up.load(Ordering::SeqCst) {
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            common::json_response(json!({"error": {"message": "The server had an error while processing your request.", "type": "server_error"}})),
        )
            .into_response();
    }
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
    let reply = Reply {
        lead: model.text_first.load(Ordering::SeqCst),
        client_call: model.client_call.load(Ordering::SeqCst),
    };
    let stream = body["stream"] == true;
    let prompt = (bytes.len() / 4) as u64;
    match path.as_str() {
        "/v1/chat/completions" => chat(call, &id, reply, stream, prompt),
        "/v1/messages" => messages(call, &id, reply, stream, prompt),
        "/v1/responses" => responses(call, &id, reply, stream, prompt),
        _ => (axum::http::StatusCode::NOT_FOUND, "no such route").into_response(),
    }
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

/// The answer's text: a sentence before a call when `lead`, the final
/// answer without one.
fn text_of(call: &Option<String>, lead: bool) -> Option<&'static str> {
    match (call, lead) {
        (Some(_), false) => None,
        (Some(_), true) => Some(LEAD),
        (None, _) => Some(FINAL),
    }
}

const LEAD: &str = "Let me look that up.";
const FINAL: &str = "final answer";

/// A text in the pieces a model streams it in.
fn pieces(text: &str) -> Vec<String> {
    let mut out: Vec<String> = text.split_inclusive(' ').map(str::to_string).collect();
    if out.is_empty() {
        out.push(String::new());
    }
    out
}

/// The call of the client's `run` a model makes beside condense's.
const RUN_ARGS: &str = "{\"cmd\":\"ls\"}";

fn chat(call: Option<String>, id: &str, reply: Reply, stream: bool, prompt: u64) -> Response {
    let args = call.as_ref().map(|k| json!({"key": k}).to_string());
    let text = text_of(&call, reply.lead);
    let content = text.map_or(Value::Null, |t| json!(t));
    let usage =
        json!({"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5});
    let finish = if call.is_some() { "tool_calls" } else { "stop" };
    // The client's call goes first, condense's after it.
    let mut calls = Vec::new();
    if reply.client_call && call.is_some() {
        calls.push((format!("run_{id}"), "run".to_string(), RUN_ARGS.to_string()));
    }
    if let Some(args) = &args {
        calls.push((id.to_string(), RECALL.to_string(), args.clone()));
    }
    if !stream {
        let mut message = json!({"role": "assistant", "content": content, "refusal": null});
        if !calls.is_empty() {
            message["tool_calls"] = calls
                .iter()
                .map(|(id, name, args)| {
                    json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": args}})
                })
                .collect();
        }
        return common::json_response(
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
            "model": "agent-small", "choices": [{"index": 0, "message": message,
            "finish_reason": finish}], "usage": usage}),
        );
    }
    let chat_id = format!("chatcmpl-{id}");
    let chunk = |delta: Value, finish: Value| {
        (
            None,
            json!({"id": chat_id, "object": "chat.completion.chunk", "created": 1,
            "model": "agent-small", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    for piece in text.map(pieces).unwrap_or_default() {
        events.push(chunk(json!({"content": piece}), Value::Null));
    }
    for (i, (id, name, args)) in calls.iter().enumerate() {
        events.push(chunk(
            json!({"tool_calls": [{"index": i, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""}}]}),
            Value::Null,
        ));
        let (head, tail) = args.split_at(args.len() / 2);
        for part in [head, tail] {
            events.push(chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}),
                Value::Null,
            ));
        }
    }
    events.push(chunk(json!({}), json!(finish)));
    events.push((
        None,
        json!({"id": chat_id, "object": "chat.completion.chunk", "created": 1,
        "model": "agent-small", "choices": [], "usage": usage}),
    ));
    sse(events, true)
}

/// A chat answer calling `name` with `args` (JSON only).
fn chat_call(name: &str, args: Value, id: &str) -> Response {
    common::json_response(
        json!({"id": "chatcmpl-2", "object": "chat.completion", "created": 1,
        "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": name, "arguments": args.to_string()}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}),
    )
}

fn messages(call: Option<String>, id: &str, reply: Reply, stream: bool, prompt: u64) -> Response {
    let mut content = Vec::new();
    if let Some(text) = text_of(&call, reply.lead) {
        content.push(json!({"type": "text", "text": text}));
    }
    if reply.client_call && call.is_some() {
        content.push(
            json!({"type": "tool_use", "id": format!("run_{id}"), "name": "run",
            "input": {"cmd": "ls"}}),
        );
    }
    if let Some(k) = &call {
        content.push(json!({"type": "tool_use", "id": id, "name": RECALL, "input": {"key": k}}));
    }
    let stop = if call.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    let message_id = format!("msg_{id}");
    if !stream {
        return common::json_response(
            json!({"id": message_id, "type": "message", "role": "assistant",
            "model": "claude-x", "content": content, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": prompt, "output_tokens": 5}}),
        );
    }
    let mut events = vec![
        (
            Some("message_start"),
            json!({"type": "message_start", "message": {"id": message_id, "type": "message",
            "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": prompt, "output_tokens": 1}}}),
        ),
        (Some("ping"), json!({"type": "ping"})),
    ];
    for (i, block) in content.iter().enumerate() {
        let (start, deltas) = match block["type"].as_str().unwrap() {
            "text" => (
                json!({"type": "text", "text": ""}),
                pieces(block["text"].as_str().unwrap())
                    .into_iter()
                    .map(|p| json!({"type": "text_delta", "text": p}))
                    .collect::<Vec<_>>(),
            ),
            _ => {
                let input = block["input"].to_string();
                let (head, tail) = input.split_at(input.len() / 2);
                (
                    json!({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
                    vec![
                        json!({"type": "input_json_delta", "partial_json": head}),
                        json!({"type": "input_json_delta", "partial_json": tail}),
                    ],
                )
            }
        };
        events.push((
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        ));
        for delta in deltas {
            events.push((
                Some("content_block_delta"),
                json!({"type": "content_block_delta", "index": i, "delta": delta}),
            ));
        }
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

fn responses(call: Option<String>, id: &str, reply: Reply, stream: bool, prompt: u64) -> Response {
    let mut output = Vec::new();
    if let Some(text) = text_of(&call, reply.lead) {
        output.push(json!({"type": "message", "id": format!("msg_{id}"), "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}));
    }
    if reply.client_call && call.is_some() {
        output.push(
            json!({"type": "function_call", "id": format!("fc_run_{id}"), "call_id": format!("run_{id}"),
            "name": "run", "arguments": RUN_ARGS, "status": "completed"}),
        );
    }
    if let Some(k) = &call {
        output.push(
            json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": id, "name": RECALL,
            "arguments": json!({"key": k}).to_string(), "status": "completed"}),
        );
    }
    let response_id = format!("resp_{id}");
    let response = json!({"id": response_id, "object": "response", "status": "completed",
        "model": "gpt-x", "output": output,
        "usage": {"input_tokens": prompt, "output_tokens": 5, "total_tokens": prompt + 5}});
    if !stream {
        return common::json_response(response);
    }
    let started = json!({"id": response_id, "object": "response", "status": "in_progress",
        "model": "gpt-x", "output": []});
    let mut events = vec![
        json!({"type": "response.created", "response": started}),
        json!({"type": "response.in_progress", "response": started}),
    ];
    for (i, item) in output.iter().enumerate() {
        let mut empty = item.clone();
        empty["status"] = json!("in_progress");
        match item["type"].as_str().unwrap() {
            "message" => {
                empty["content"] = json!([]);
                let text = item["content"][0]["text"].as_str().unwrap();
                let item_id = &item["id"];
                let part = |t: &str| json!({"type": "output_text", "text": t, "annotations": []});
                events.push(
                    json!({"type": "response.output_item.added", "output_index": i, "item": empty}),
                );
                events.push(
                    json!({"type": "response.content_part.added", "output_index": i,
                    "item_id": item_id, "content_index": 0, "part": part("")}),
                );
                for p in pieces(text) {
                    events.push(
                        json!({"type": "response.output_text.delta", "output_index": i,
                        "item_id": item_id, "content_index": 0, "delta": p}),
                    );
                }
                events.push(
                    json!({"type": "response.output_text.done", "output_index": i,
                    "item_id": item_id, "content_index": 0, "text": text}),
                );
                events.push(
                    json!({"type": "response.content_part.done", "output_index": i,
                    "item_id": item_id, "content_index": 0, "part": part(text)}),
                );
            }
            _ => {
                empty["arguments"] = json!("");
                let args = item["arguments"].as_str().unwrap();
                events.push(
                    json!({"type": "response.output_item.added", "output_index": i, "item": empty}),
                );
                events.push(
                    json!({"type": "response.function_call_arguments.delta", "output_index": i,
                    "item_id": item["id"], "delta": args}),
                );
                events.push(
                    json!({"type": "response.function_call_arguments.done", "output_index": i,
                    "item_id": item["id"], "arguments": args}),
                );
            }
        }
        events.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
    }
    events.push(json!({"type": "response.completed", "response": response}));
    let named = events
        .into_iter()
        .enumerate()
        .map(|(n, mut e)| {
            e["sequence_number"] = json!(n);
            (None, e)
        })
        .collect();
    sse(named, false)
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

/// The events of an SSE body: (event name, data) pairs.
fn events(sse: &str) -> Vec<Value> {
    sse.split("\n\n")
        .filter_map(|e| {
            let data: Vec<&str> = e.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            (!data.is_empty() && data != ["[DONE]"])
                .then(|| serde_json::from_str(&data.join("\n")).unwrap())
        })
        .collect()
}

/// A streamed Messages answer put together as Anthropic's SDK does, after
/// checking it is one well-formed message: one start, one stop, each block
/// started, given deltas and stopped in order, indices from 0 on.
fn messages_stream(sse: &str) -> Value {
    let events = events(sse);
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "message_start").count(),
        1,
        "{sse}"
    );
    assert_eq!(kinds.first(), Some(&"message_start"), "{sse}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{sse}");
    assert_eq!(
        kinds.iter().filter(|k| **k == "message_stop").count(),
        1,
        "{sse}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "message_delta").count(),
        1,
        "{sse}"
    );
    let mut message = events[0]["message"].clone();
    let mut open: Option<u64> = None;
    let mut json_parts = String::new();
    for e in &events[1..] {
        match e["type"].as_str().unwrap() {
            "content_block_start" => {
                let i = e["index"].as_u64().unwrap();
                assert_eq!(open, None, "a block started inside another: {sse}");
                assert_eq!(
                    i as usize,
                    message["content"].as_array().unwrap().len(),
                    "{sse}"
                );
                message["content"]
                    .as_array_mut()
                    .unwrap()
                    .push(e["content_block"].clone());
                open = Some(i);
                json_parts.clear();
            }
            "content_block_delta" => {
                let i = e["index"].as_u64().unwrap();
                assert_eq!(open, Some(i), "{sse}");
                let block = &mut message["content"][i as usize];
                match e["delta"]["type"].as_str().unwrap() {
                    "text_delta" => {
                        let t = block["text"].as_str().unwrap().to_string();
                        block["text"] = json!(t + e["delta"]["text"].as_str().unwrap());
                    }
                    "input_json_delta" => {
                        json_parts.push_str(e["delta"]["partial_json"].as_str().unwrap())
                    }
                    other => panic!("{other}"),
                }
            }
            "content_block_stop" => {
                let i = e["index"].as_u64().unwrap();
                assert_eq!(open, Some(i), "{sse}");
                if !json_parts.is_empty() {
                    message["content"][i as usize]["input"] =
                        serde_json::from_str(&json_parts).unwrap();
                }
                open = None;
            }
            "message_delta" => {
                for (k, v) in e["delta"].as_object().unwrap() {
                    message[k] = v.clone();
                }
                // The SDK takes the numbers the end gives.
                for (k, v) in e["usage"].as_object().unwrap() {
                    message["usage"][k] = v.clone();
                }
            }
            "ping" | "message_stop" => {}
            other => panic!("unexpected event {other}: {sse}"),
        }
    }
    message
}

/// A streamed Responses answer, checked to be one response: one created,
/// one completed (last), sequence numbers from 0 without a gap, output
/// indices from 0 on, each item added before its events; returns the
/// completed response and the text the deltas gave each output index.
fn responses_stream(sse: &str) -> (Value, Vec<String>) {
    let events = events(sse);
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "response.created").count(),
        1,
        "{sse}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "response.completed").count(),
        1,
        "{sse}"
    );
    assert_eq!(kinds.last(), Some(&"response.completed"), "{sse}");
    for (n, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(n), "{sse}");
    }
    let id = &events[0]["response"]["id"];
    let mut texts: Vec<String> = Vec::new();
    for e in &events {
        let Some(i) = e["output_index"].as_u64() else {
            continue;
        };
        if e["type"] == "response.output_item.added" {
            assert_eq!(i as usize, texts.len(), "{sse}");
            texts.push(String::new());
        }
        assert!((i as usize) < texts.len(), "{sse}");
        if e["type"] == "response.output_text.delta" {
            texts[i as usize].push_str(e["delta"].as_str().unwrap());
        }
    }
    let completed = events.last().unwrap()["response"].clone();
    assert_eq!(&completed["id"], id, "{sse}");
    assert_eq!(
        completed["output"].as_array().unwrap().len(),
        texts.len(),
        "{sse}"
    );
    (completed, texts)
}

#[tokio::test]
async fn a_chat_recall_is_answered_inside_the_request_json_and_streamed() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    for stream in [false, true] {
        let before = up.model.requests().len();
        let (status, body) =
            common::post(&server, "/v1/chat/completions", &chat_session(stream)).await;
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
        common::settled_metric(&server, "condense_recalls_total{outcome=\"answered\"}").await,
        2.0
    );
    assert!(
        common::settled_metric(&server, "condense_recalled_bytes_total").await
            >= 2.0 * first_output().len() as f64
    );
    server.shutdown().await.unwrap();
}

/// The prompt tokens the mock counted for the requests it got.
fn prompts(seen: &[(String, Value)]) -> u64 {
    seen.iter()
        .map(|(_, b)| (b.to_string().len() / 4) as u64)
        .sum()
}

#[tokio::test]
async fn a_recall_after_text_goes_on_in_the_same_answer_in_every_format() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    up.model.text_first.store(true, Ordering::SeqCst);
    let both = format!("{LEAD}\n\n{FINAL}");
    for stream in [true, false] {
        // Chat completions.
        let before = up.model.requests().len();
        let (status, body) =
            common::post(&server, "/v1/chat/completions", &chat_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        let seen = up.model.requests()[before..].to_vec();
        assert_eq!(seen.len(), 2, "the recall took one more round");
        // The round after it carries the sentence with the call, then the
        // original.
        let m = seen[1].1["messages"].as_array().unwrap().clone();
        let n = m.len();
        assert_eq!(m[n - 2]["content"], LEAD);
        assert_eq!(m[n - 2]["tool_calls"][0]["function"]["name"], RECALL);
        assert_eq!(m[n - 1]["content"], first_output());
        assert!(!body.contains(RECALL), "{body}");
        let sum = prompts(&seen);
        if stream {
            let (text, calls, chunks) = chat_stream_text(&body);
            assert_eq!(text, both);
            assert!(!calls, "{body}");
            assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]), "{body}");
            let finishes: Vec<&Value> = chunks
                .iter()
                .map(|c| &c["choices"][0]["finish_reason"])
                .filter(|f| !f.is_null())
                .collect();
            assert_eq!(finishes, [&json!("stop")], "{body}");
            assert_eq!(body.matches("[DONE]").count(), 1, "{body}");
            assert!(body.trim_end().ends_with("data: [DONE]"));
            let usage = chunks
                .iter()
                .filter(|c| c["usage"].is_object())
                .collect::<Vec<_>>();
            assert_eq!(usage.len(), 1, "{body}");
            let got = usage[0]["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(got.abs_diff(sum) < 50, "{got} vs {sum}");
            assert_eq!(usage[0]["usage"]["completion_tokens"], 10);
        } else {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["choices"][0]["message"]["content"], json!(both));
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            let got = v["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(got.abs_diff(sum) < 50, "{got} vs {sum}");
        }

        // Messages: the next round's blocks go on from the text's index.
        let before = up.model.requests().len();
        let (status, body) = common::post(&server, "/v1/messages", &messages_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        let seen = up.model.requests()[before..].to_vec();
        assert_eq!(seen.len(), 2);
        let m = seen[1].1["messages"].as_array().unwrap().clone();
        let n = m.len();
        assert_eq!(
            m[n - 2]["content"][0],
            json!({"type": "text", "text": LEAD})
        );
        assert_eq!(m[n - 2]["content"][1]["name"], RECALL);
        assert_eq!(m[n - 1]["content"][0]["content"], first_output());
        assert!(!body.contains(RECALL), "{body}");
        let message = match stream {
            true => messages_stream(&body),
            false => serde_json::from_str(&body).unwrap(),
        };
        assert_eq!(
            message["content"],
            json!([{"type": "text", "text": LEAD}, {"type": "text", "text": FINAL}]),
            "{body}"
        );
        assert_eq!(message["stop_reason"], "end_turn");
        let got = message["usage"]["input_tokens"].as_u64().unwrap();
        let sum = prompts(&seen);
        assert!(got.abs_diff(sum) < 50, "{got} vs {sum}");
        assert_eq!(message["usage"]["output_tokens"], 10);

        // Responses: one response, its items numbered on.
        let before = up.model.requests().len();
        let (status, body) =
            common::post(&server, "/v1/responses", &responses_session(stream)).await;
        assert_eq!(status, 200, "{body}");
        let seen = up.model.requests()[before..].to_vec();
        assert_eq!(seen.len(), 2);
        let input = seen[1].1["input"].as_array().unwrap().clone();
        let n = input.len();
        assert_eq!(input[n - 3]["type"], "message");
        assert_eq!(input[n - 3]["content"][0]["text"], LEAD);
        assert_eq!(input[n - 2]["name"], RECALL);
        assert_eq!(input[n - 1]["output"], first_output());
        assert!(!body.contains(RECALL), "{body}");
        let response = match stream {
            true => {
                let (response, texts) = responses_stream(&body);
                assert_eq!(texts, [LEAD, FINAL]);
                response
            }
            false => serde_json::from_str(&body).unwrap(),
        };
        let output = response["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "{body}");
        assert_eq!(output[0]["content"][0]["text"], LEAD);
        assert_eq!(output[1]["content"][0]["text"], FINAL);
        let got = response["usage"]["input_tokens"].as_u64().unwrap();
        let sum = prompts(&seen);
        assert!(got.abs_diff(sum) < 50, "{got} vs {sum}");
    }
    assert_eq!(
        common::settled_metric(&server, "condense_recalls_total{outcome=\"answered\"}").await,
        6.0
    );
    assert_eq!(
        common::settled_metric(&server, "condense_recalls_total{outcome=\"stripped\"}").await,
        0.0
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_that_cannot_go_on_ends_as_it_came_and_calibration_reads_the_first_round() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    up.model.text_first.store(true, Ordering::SeqCst);
    let label = "condense_upstream_prompt_tokens_total{model=\"agent-small\"}";
    // It goes on: the usage learned is the first round's alone, the
    // request condense measured.
    let (_, body) = common::post(&server, "/v1/messages", &messages_session(true)).await;
    let seen = up.model.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        messages_stream(&body)["content"].as_array().unwrap().len(),
        2
    );
    let first = prompts(&seen[..1]) as f64;
    assert_eq!(common::settled_metric(&server, label).await, first);

    // The follow-up fails: the client gets the first round as it came,
    // without condense's call, ended as the upstream ended it.
    up.model.fail_follow_up.store(true, Ordering::SeqCst);
    for path in ["/v1/chat/completions", "/v1/messages", "/v1/responses"] {
        let session = match path {
            "/v1/chat/completions" => chat_session(true),
            "/v1/messages" => messages_session(true),
            _ => responses_session(true),
        };
        let (status, body) = common::post(&server, path, &session).await;
        assert_eq!(status, 200, "{body}");
        assert!(!body.contains(RECALL), "{body}");
        match path {
            "/v1/chat/completions" => {
                let (text, _, chunks) = chat_stream_text(&body);
                assert_eq!(text, LEAD);
                assert!(
                    chunks
                        .iter()
                        .any(|c| c["choices"][0]["finish_reason"] == "stop")
                );
                assert!(body.trim_end().ends_with("data: [DONE]"));
            }
            "/v1/messages" => {
                let message = messages_stream(&body);
                assert_eq!(message["content"], json!([{"type": "text", "text": LEAD}]));
                assert_eq!(message["stop_reason"], "end_turn");
            }
            _ => {
                let (response, texts) = responses_stream(&body);
                assert_eq!(texts, [LEAD]);
                assert_eq!(response["output"].as_array().unwrap().len(), 1);
            }
        }
    }
    assert_eq!(
        common::settled_metric(&server, "condense_recalls_total{outcome=\"failed\"}").await,
        3.0
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_recall_beside_a_call_the_client_got_goes_on_and_the_client_runs_its_call() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    up.model.text_first.store(true, Ordering::SeqCst);
    up.model.client_call.store(true, Ordering::SeqCst);
    // The model writes a sentence, calls the client's `run`, then
    // condense's tool: the sentence and the `run` call went out, so the
    // answer goes on after them, and the client is still told to run it.
    let (status, body) = common::post(&server, "/v1/chat/completions", &chat_session(true)).await;
    assert_eq!(status, 200, "{body}");
    let seen = up.model.requests();
    assert_eq!(seen.len(), 2);
    let m = seen[1].1["messages"].as_array().unwrap().clone();
    let n = m.len();
    let calls = m[n - 3]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "both calls stay in the turn");
    assert_eq!(calls[0]["function"]["name"], "run");
    assert!(
        m[n - 2]["content"]
            .as_str()
            .unwrap()
            .contains("went to the client"),
        "{:?}",
        m[n - 2]
    );
    assert_eq!(m[n - 1]["content"], first_output());
    let (text, _, chunks) = chat_stream_text(&body);
    assert_eq!(text, format!("{LEAD}\n\n{FINAL}"));
    let names: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
        })
        .map(|tc| &tc["function"]["name"])
        .filter(|n| !n.is_null())
        .collect();
    assert_eq!(names, [&json!("run")], "{body}");
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("tool_calls")], "{body}");

    let (status, body) = common::post(&server, "/v1/messages", &messages_session(true)).await;
    assert_eq!(status, 200, "{body}");
    let message = messages_stream(&body);
    let kinds: Vec<&Value> = message["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| &b["type"])
        .collect();
    assert_eq!(
        kinds,
        [&json!("text"), &json!("tool_use"), &json!("text")],
        "{body}"
    );
    assert_eq!(message["content"][1]["name"], "run");
    assert_eq!(message["content"][1]["input"], json!({"cmd": "ls"}));
    assert_eq!(message["stop_reason"], "tool_use");

    let (status, body) = common::post(&server, "/v1/responses", &responses_session(true)).await;
    assert_eq!(status, 200, "{body}");
    let (response, texts) = responses_stream(&body);
    assert_eq!(texts, [LEAD, "", FINAL]);
    let output = response["output"].as_array().unwrap();
    assert_eq!(output[1]["name"], "run");
    assert_eq!(output[1]["arguments"], RUN_ARGS);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_limit_holds_and_unknown_keys_are_told() {
    let up = upstream().await;
    let server = condense(&up, |c| c.compaction.max_recalls = 2).await;
    // A model that writes and calls every time: the answer goes on twice,
    // then the third call is taken out and the answer ends there.
    up.model.text_first.store(true, Ordering::SeqCst);
    up.model.always.store(true, Ordering::SeqCst);
    let (status, body) = common::post(&server, "/v1/chat/completions", &chat_session(true)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(up.model.requests().len(), 3);
    let (text, calls, chunks) = chat_stream_text(&body);
    assert_eq!(text, [LEAD; 3].join("\n\n"));
    assert!(!calls, "{body}");
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str())
        .unwrap();
    assert_eq!(finish, "stop");
    assert_eq!(
        common::settled_metric(&server, "condense_recalls_total{outcome=\"limit_reached\"}").await,
        1.0
    );
    up.model.text_first.store(false, Ordering::SeqCst);
    up.model.always.store(false, Ordering::SeqCst);

    // A model that keeps calling gets max_recalls answers, then the client
    // gets the answer without the call.
    up.model.text_first.store(false, Ordering::SeqCst);
    up.model.always.store(true, Ordering::SeqCst);
    for stream in [false, true] {
        let before = up.model.requests().len();
        let (status, body) =
            common::post(&server, "/v1/chat/completions", &chat_session(stream)).await;
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
        common::settled_metric(&server, "condense_recalls_total{outcome=\"limit_reached\"}").await,
        3.0
    );

    // A key condense never gave gets a result saying so.
    up.model.always.store(false, Ordering::SeqCst);
    *up.model.key.lock().unwrap() = Some("not-a-real-key".into());
    let before = up.model.requests().len();
    let (status, _) = common::post(&server, "/v1/chat/completions", &chat_session(false)).await;
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
        common::settled_metric(&server, "condense_recalls_total{outcome=\"unknown_key\"}").await,
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
        let (status, body) = common::post(&server, "/v1/messages", &messages_session(stream)).await;
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
        let message = match stream {
            true => messages_stream(&body),
            false => serde_json::from_str(&body).unwrap(),
        };
        assert_eq!(message["content"], json!([{"type": "text", "text": FINAL}]));
        if !stream {
            let v = message;
            let sent: u64 = seen
                .iter()
                .map(|(_, b)| (b.to_string().len() / 4) as u64)
                .sum();
            let got = v["usage"]["input_tokens"].as_u64().unwrap();
            assert!(got.abs_diff(sent) < 50, "{got} vs {sent}");
        }

        let before = up.model.requests().len();
        let (status, body) =
            common::post(&server, "/v1/responses", &responses_session(stream)).await;
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
        let response = match stream {
            true => responses_stream(&body).0,
            false => serde_json::from_str(&body).unwrap(),
        };
        assert_eq!(response["output"][0]["content"][0]["text"], FINAL);
    }

    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn recall_off_offers_nothing_and_requests_without_tools_get_no_keys() {
    let up = upstream().await;
    let server = condense(&up, |c| c.compaction.recall = false).await;
    let (status, _) = common::post(&server, "/v1/chat/completions", &chat_session(false)).await;
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
    common::post(&server, "/v1/chat/completions", &no_tools).await;
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
    common::post(&a, "/v1/chat/completions", &chat_session(false)).await;
    let compacted = up.model.requests()[0].1.clone();
    let key = first_key(&compacted.to_string()).unwrap();
    // Replica b gets the compacted conversation (keys, no originals) and
    // answers the model's call from the store.
    *up.model.key.lock().unwrap() = Some(key);
    let mut body = compacted.clone();
    body["tools"].as_array_mut().unwrap().truncate(1);
    // Stored in the background by a (a spawned write nothing waits for):
    // wait until it is in Redis.
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let mut stored = false;
    for _ in 0..500 {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("condense:recall:*")
            .query_async(&mut con)
            .await
            .unwrap();
        if !keys.is_empty() {
            stored = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(stored, "replica a stored no original within 5 s");
    let before = up.model.requests().len();
    let (status, _) = common::post(&b, "/v1/chat/completions", &body).await;
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
    let (status, body) = common::post(&server, "/v1/chat/completions", &session).await;
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
        common::settled_metric(
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
        common::settled_metric(
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
