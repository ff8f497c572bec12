//! A simulated upstream: an OpenAI-compatible chat API (and Anthropic's
//! Messages and OpenAI's Responses) that counts prompt tokens by its own
//! rule and enforces its context window with the provider's own overflow
//! errors, answering in process.
//!
//! Each API rejects what the real one rejects, in the wording the real one
//! chooses for it:
//! - Anthropic Messages: "prompt is too long: P tokens > W maximum" when
//!   the prompt alone is over the window; "input length and `max_tokens`
//!   exceed context limit: P + M > W, ..." when only the prompt plus
//!   `max_tokens` is.
//! - OpenAI chat completions: "This model's maximum context length is W
//!   tokens. However, you requested T tokens (P in the messages, M in the
//!   completion)" when the request sets `max_tokens` (or
//!   `max_completion_tokens`), "... your messages resulted in P tokens"
//!   when it does not; or, as some OpenAI-compatible servers, the code
//!   `context_length_exceeded` with no numbers.
//! - llama.cpp server: `exceed_context_size_error` (with `n_prompt_tokens`
//!   and `n_ctx`) only when the prompt alone fills the context; a prompt
//!   that leaves less room than `max_tokens` is accepted, its answer cut at
//!   the window.
//! - OpenAI Responses: `context_length_exceeded` with no numbers.
//!
//! No production upstream counts like o200k, so `condense replay --count`
//! sends every turn through the real proxy to one of these: calibration
//! learns from its usage, windows from its errors (or its `/models`
//! listing), and overflow recovery runs as it would against the real
//! provider. The test mock upstream answers with the same code, so a replay
//! and a proxy in front of that mock can be compared byte for byte.

use std::sync::Mutex;

use bytes::Bytes;
use http::{Method, StatusCode, header};
use serde_json::{Value, json};

use crate::cache::{Bounded, PreHashed, one};
use crate::chat::ChatRequest;
use crate::tokens::encoding::Encoding;
use crate::upstream::InProcess;
use crate::wire::anthropic::MessagesRequest;
use crate::wire::responses::ResponsesRequest;

/// How the simulated upstream counts a request's prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CountRule {
    /// Exactly as condense counts with o200k (calibration stays at 1.0).
    O200k,
    /// Characters of text (message contents, tool-call names and
    /// arguments, tool schemas) per token, plus 3 per message and 3 for
    /// the reply, as a sentencepiece-like tokenizer roughly does: runs of
    /// whitespace, which o200k folds into few tokens, count in full.
    Chars(f64),
    /// UTF-8 bytes of that text per token: CJK and emoji cost 3–4 times
    /// what ASCII does, as in byte-level tokenizers without merges for them.
    Bytes(f64),
    /// Characters per token that depend on the content mix: `tools` for
    /// what tools put in and out (tool results, call arguments, tool
    /// schemas: code, JSON, logs), `prose` for the rest (instructions,
    /// user and assistant text, reasoning), plus the same per-message and
    /// reply overheads as [`CountRule::Chars`]. With `tools` above
    /// `prose`, condense's learned ratio falls as a conversation fills with
    /// tool output and rises again when that output is masked, as against
    /// a real tokenizer whose strengths differ from o200k's by content.
    Mix { tools: f64, prose: f64 },
}

#[derive(Debug, thiserror::Error)]
#[error(
    "unknown counting rule {0:?}: use o200k, chars:N, bytes:N or mix:T,P (N characters/bytes per token, e.g. chars:3.6; T in tool output and arguments, P elsewhere, e.g. mix:4.5,3.0)"
)]
pub struct RuleError(String);

impl std::str::FromStr for CountRule {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<CountRule, RuleError> {
        let bad = || RuleError(s.to_string());
        let per = |n: &str| {
            n.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.5 && *v <= 20.0)
                .ok_or_else(bad)
        };
        match s.split_once(':') {
            None if s == "o200k" => Ok(CountRule::O200k),
            Some(("chars", n)) => Ok(CountRule::Chars(per(n)?)),
            Some(("bytes", n)) => Ok(CountRule::Bytes(per(n)?)),
            Some(("mix", n)) => {
                let (tools, prose) = n.split_once(',').ok_or_else(bad)?;
                Ok(CountRule::Mix {
                    tools: per(tools)?,
                    prose: per(prose)?,
                })
            }
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for CountRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CountRule::O200k => f.write_str("o200k"),
            CountRule::Chars(n) => write!(f, "chars:{n}"),
            CountRule::Bytes(n) => write!(f, "bytes:{n}"),
            CountRule::Mix { tools, prose } => write!(f, "mix:{tools},{prose}"),
        }
    }
}

/// Gives a part's tokens: `(raw, is_tools, count)`, remembered or counted.
type PartMemo<'a> = dyn FnMut(&[u8], bool, &dyn Fn() -> u64) -> u64 + 'a;

/// Tokens a message costs beyond its text under the text rules.
const PER_MESSAGE: u64 = 3;
/// Tokens priming the reply.
const PRIMING: u64 = 3;

impl CountRule {
    /// The prompt tokens of a chat request body; None when it is not one.
    pub fn count(&self, body: &Bytes) -> Option<u64> {
        self.count_with(body, &mut |_, _, f| f())
    }

    /// [`CountRule::count`], each message's (and tool list's) tokens got
    /// through `memo(raw, is_tools, count)`.
    fn count_with(&self, body: &Bytes, memo: &mut PartMemo<'_>) -> Option<u64> {
        let req = ChatRequest::parse(body).ok()?;
        Some(self.count_chat(&req, memo))
    }

    /// The prompt tokens of a conversation in chat form (an Anthropic
    /// Messages body is counted through the same view condense has of it:
    /// its texts, tool inputs and thinking).
    fn count_chat(&self, req: &ChatRequest, memo: &mut PartMemo<'_>) -> u64 {
        let enc = Encoding::for_model(&req.model().unwrap_or_default());
        let mut total = match self {
            CountRule::O200k => crate::tokens::count::REPLY_PRIMING,
            _ => PRIMING,
        };
        for m in req.messages() {
            total += memo(m.raw(), false, &|| self.part(m.raw(), false, enc));
        }
        for key in ["tools", "functions"] {
            if let Some(raw) = req.field(key) {
                total += memo(raw, true, &|| self.part(raw, true, enc));
            }
        }
        total
    }

    /// The tokens of one message, or of a tool list.
    fn part(&self, raw: &[u8], tools: bool, enc: Encoding) -> u64 {
        let per = match self {
            CountRule::O200k if tools => return crate::tokens::count::tools_tokens(enc, raw),
            CountRule::O200k => return crate::tokens::count::message_tokens(enc, raw),
            CountRule::Chars(n) | CountRule::Bytes(n) => *n,
            CountRule::Mix { tools: t, prose } => {
                let v: Value = serde_json::from_slice(raw).unwrap_or(Value::Null);
                let (of_tools, of_prose) = mix_units(&v, tools, self);
                let text = (of_tools as f64 / t + of_prose as f64 / prose).ceil() as u64;
                return if tools { text } else { text + PER_MESSAGE };
            }
        };
        let v: Value = serde_json::from_slice(raw).unwrap_or(Value::Null);
        let text = (text_units(&v, self) as f64 / per).ceil() as u64;
        if tools { text } else { text + PER_MESSAGE }
    }
}

/// Characters (or bytes) of every string in `v`, keys excluded.
fn text_units(v: &Value, rule: &CountRule) -> usize {
    match v {
        Value::String(s) => match rule {
            CountRule::Bytes(_) => s.len(),
            _ => s.chars().count(),
        },
        Value::Array(a) => a.iter().map(|x| text_units(x, rule)).sum(),
        Value::Object(o) => o.values().map(|x| text_units(x, rule)).sum(),
        Value::Number(n) => n.to_string().len(),
        _ => 0,
    }
}

/// Characters of a message (or of the tool list, `tools`) in tool
/// input and output, and in the rest: a tool result's every string, an
/// assistant message's `tool_calls`, the tool schemas; the rest is prose.
fn mix_units(v: &Value, tools: bool, rule: &CountRule) -> (usize, usize) {
    if tools || matches!(v["role"].as_str(), Some("tool" | "function")) {
        return (text_units(v, rule), 0);
    }
    let Value::Object(o) = v else {
        return (0, text_units(v, rule));
    };
    o.iter().fold((0, 0), |(t, p), (k, x)| match k.as_str() {
        "tool_calls" | "function_call" => (t + text_units(x, rule), p),
        _ => (t, p + text_units(x, rule)),
    })
}

/// The kind of server behind the simulated chat completions endpoint, and so
/// the wording of its overflow error (Messages and Responses requests are
/// answered in their own API's wordings whatever this is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverflowStyle {
    /// OpenAI's, naming the window, the prompt's size and (when the request
    /// sets one) its `max_tokens`.
    OpenAi,
    /// llama.cpp server's `exceed_context_size_error` with `n_prompt_tokens`
    /// and `n_ctx`, for a prompt that alone fills the context.
    LlamaCpp,
    /// `context_length_exceeded` without numbers (as the Responses API).
    Bare,
}

impl std::str::FromStr for OverflowStyle {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<OverflowStyle, RuleError> {
        match s {
            "openai" => Ok(OverflowStyle::OpenAi),
            "llamacpp" => Ok(OverflowStyle::LlamaCpp),
            "bare" => Ok(OverflowStyle::Bare),
            _ => Err(RuleError(s.to_string())),
        }
    }
}

/// The simulated provider.
#[derive(Debug)]
pub struct Simulator {
    pub rule: CountRule,
    /// The window it enforces: prompt plus `max_tokens` (or
    /// `max_completion_tokens`) must fit, or for llama.cpp the prompt
    /// alone (see [`Simulator::accepts`]).
    pub window: u64,
    pub overflow: OverflowStyle,
    /// Whether `/models` lists the window (as vLLM's `max_model_len`);
    /// otherwise the listing names no window, as OpenAI's does.
    pub lists_window: bool,
    /// The chat bodies it received, in order, with whether it accepted each.
    received: Mutex<Vec<(Bytes, bool)>>,
    /// Counts of messages and tool lists seen before (a replay re-sends its
    /// history every turn).
    memo: Bounded<u64, u64, PreHashed>,
}

/// Message counts the simulator remembers.
const MEMO_ENTRIES: usize = 100_000;

/// The model name the simulated listing carries.
const LISTED_MODEL: &str = "gpt-4o";

impl Simulator {
    pub fn new(rule: CountRule, window: u64, overflow: OverflowStyle) -> Simulator {
        Simulator {
            rule,
            window,
            overflow,
            lists_window: false,
            received: Mutex::new(Vec::new()),
            memo: Bounded::hashed(MEMO_ENTRIES, MEMO_ENTRIES as u64, one),
        }
    }

    /// The prompt tokens of a chat request body by this provider's rule;
    /// None when it is not one.
    pub fn count(&self, body: &Bytes) -> Option<u64> {
        self.rule
            .count_with(body, &mut |raw, tools, count| self.memo(raw, tools, count))
    }

    /// The prompt tokens of a conversation (another API's request, as the
    /// pipeline sees it) by this provider's rule.
    pub fn count_view(&self, view: &ChatRequest) -> u64 {
        self.rule
            .count_chat(view, &mut |raw, tools, count| self.memo(raw, tools, count))
    }

    /// A message's (or the tools') count, remembered.
    fn memo(&self, raw: &[u8], tools: bool, count: &dyn Fn() -> u64) -> u64 {
        let key = xxhash_rust::xxh3::xxh3_64(raw) ^ u64::from(tools);
        self.memo.get_or_insert_with(key, count)
    }

    /// The chat bodies received so far, with whether each was accepted.
    pub fn received(&self) -> Vec<(Bytes, bool)> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Answers one request.
    pub fn respond(&self, method: &Method, path: &str, body: &Bytes) -> http::Response<Bytes> {
        if method == Method::GET && path.ends_with("/models") {
            let mut model = json!({"id": LISTED_MODEL, "object": "model", "owned_by": "simulated"});
            if self.lists_window {
                // Where each server kind says it.
                match self.overflow {
                    OverflowStyle::LlamaCpp => model["meta"] = json!({"n_ctx": self.window}),
                    _ => model["max_model_len"] = json!(self.window),
                }
            }
            return json_response(StatusCode::OK, &json!({"object": "list", "data": [model]}));
        }
        if method == Method::POST && path.ends_with("/messages") {
            return self.messages(body);
        }
        if method == Method::POST && path.ends_with("/responses") {
            return self.responses(body);
        }
        if method != Method::POST || !path.ends_with("/chat/completions") {
            return json_response(
                StatusCode::NOT_FOUND,
                &error_body("no such route on the simulated upstream", None),
            );
        }
        let Some(prompt) = self.count(body) else {
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_body("not a chat completions request", None),
            );
        };
        let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let asked = req["max_completion_tokens"]
            .as_u64()
            .or(req["max_tokens"].as_u64());
        let fits = self.accepts(path, prompt, asked.unwrap_or(0));
        if let Ok(mut r) = self.received.lock() {
            r.push((body.clone(), fits));
        }
        if !fits {
            return json_response(StatusCode::BAD_REQUEST, &self.overflow_body(prompt, asked));
        }
        let usage =
            json!({"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1});
        let model = req["model"].as_str().unwrap_or("unknown");
        if req["stream"] == json!(true) {
            return stream_response(
                model,
                &usage,
                req["stream_options"]["include_usage"] == json!(true),
            );
        }
        json_response(
            StatusCode::OK,
            &json!({
                "id": "chatcmpl-sim", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": usage,
            }),
        )
    }

    /// Answers an Anthropic Messages request, with Anthropic's usage,
    /// stream and overflow wording.
    fn messages(&self, body: &Bytes) -> http::Response<Bytes> {
        let Some(prompt) = MessagesRequest::parse(body)
            .ok()
            .map(|r| self.count_view(&r.view().0))
        else {
            return json_response(
                StatusCode::BAD_REQUEST,
                &anthropic_error("invalid_request_error", "not a Messages request"),
            );
        };
        let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let completion = req["max_tokens"].as_u64().unwrap_or(0);
        let rejected = anthropic_overflow(prompt, completion, self.window);
        if let Ok(mut r) = self.received.lock() {
            r.push((body.clone(), rejected.is_none()));
        }
        if let Some(error) = rejected {
            return json_response(StatusCode::BAD_REQUEST, &error);
        }
        let usage = json!({"input_tokens": prompt, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 1});
        let model = req["model"].as_str().unwrap_or("unknown");
        let message = json!({"id": "msg_sim", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "stop_sequence": null, "usage": usage});
        if req["stream"] != json!(true) {
            return json_response(StatusCode::OK, &message);
        }
        let text = anthropic_stream(&message);
        let mut r = http::Response::new(Bytes::from(text));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream"),
        );
        r
    }

    /// Answers a Responses request: `usage.input_tokens`, a stream ending in
    /// `response.completed`, and the Responses overflow error, which names
    /// no numbers.
    fn responses(&self, body: &Bytes) -> http::Response<Bytes> {
        let Some(prompt) = ResponsesRequest::parse(body)
            .ok()
            .map(|r| self.count_view(&r.view().0))
        else {
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_body("not a stateless Responses request", None),
            );
        };
        let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let completion = req["max_output_tokens"].as_u64().unwrap_or(0);
        let fits = self.accepts("/v1/responses", prompt, completion);
        if let Ok(mut r) = self.received.lock() {
            r.push((body.clone(), fits));
        }
        if !fits {
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_body(
                    "Your input exceeds the context window of this model. Please adjust your input and try again.",
                    Some("context_length_exceeded"),
                ),
            );
        }
        let response = json!({"id": "resp_sim", "object": "response", "status": "completed",
            "model": req["model"], "output": [{"type": "message", "id": "msg_sim", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + 1}});
        if req["stream"] != json!(true) {
            return json_response(StatusCode::OK, &response);
        }
        let mut created = response.clone();
        created["status"] = json!("in_progress");
        created["output"] = json!([]);
        created["usage"] = Value::Null;
        let events = [
            json!({"type": "response.created", "response": created, "sequence_number": 0}),
            json!({"type": "response.output_text.delta", "item_id": "msg_sim", "output_index": 0,
                "content_index": 0, "delta": "ok", "sequence_number": 1}),
            json!({"type": "response.completed", "response": response, "sequence_number": 2}),
        ];
        let text: String = events
            .iter()
            .map(|e| {
                format!(
                    "event: {}\ndata: {e}\n\n",
                    e["type"].as_str().unwrap_or_default()
                )
            })
            .collect();
        let mut r = http::Response::new(Bytes::from(text));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream"),
        );
        r
    }

    /// Whether the provider takes a request on `path` with a prompt of
    /// `prompt` of its tokens that asks for up to `completion` more.
    pub fn accepts(&self, path: &str, prompt: u64, completion: u64) -> bool {
        // llama.cpp refuses only a chat prompt that leaves no cell to
        // decode into; `max_tokens` beyond the context ends the answer
        // early.
        if self.overflow == OverflowStyle::LlamaCpp && path.ends_with("/chat/completions") {
            return prompt < self.window;
        }
        prompt.saturating_add(completion) <= self.window
    }

    /// The chat completions overflow error for a prompt of `prompt` tokens
    /// and the `max_tokens` the request asked for, if any.
    fn overflow_body(&self, prompt: u64, asked: Option<u64>) -> Value {
        let window = self.window;
        match self.overflow {
            // OpenAI names the completion whenever the request set one,
            // even when the messages alone are over the window.
            OverflowStyle::OpenAi => error_body(
                &match asked {
                    Some(m) => format!(
                        "This model's maximum context length is {window} tokens. However, you requested {} tokens ({prompt} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
                        prompt.saturating_add(m)
                    ),
                    None => format!(
                        "This model's maximum context length is {window} tokens. However, your messages resulted in {prompt} tokens. Please reduce the length of the messages."
                    ),
                },
                Some("context_length_exceeded"),
            ),
            OverflowStyle::Bare => error_body(
                "Your input exceeds the context window of this model. Please adjust your input and try again.",
                Some("context_length_exceeded"),
            ),
            OverflowStyle::LlamaCpp => json!({"error": {
                "code": 400,
                "message": format!("request ({prompt} tokens) exceeds the available context size ({window} tokens), try increasing it"),
                "type": "exceed_context_size_error",
                "n_prompt_tokens": prompt,
                "n_ctx": window,
            }}),
        }
    }
}

/// A complete Anthropic message (one text block) as the events of its
/// stream, in Anthropic's order: `message_start` (the prompt's usage), a
/// `ping`, the text block, `message_delta` (the stop reason and the output
/// tokens), `message_stop`.
pub fn anthropic_stream(message: &Value) -> String {
    let mut start = message.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["usage"]["output_tokens"] = json!(1);
    let text = message["content"][0]["text"].as_str().unwrap_or_default();
    let events = [
        json!({"type": "message_start", "message": start}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "ping"}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": message["stop_reason"], "stop_sequence": null},
            "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
        json!({"type": "message_stop"}),
    ];
    events
        .iter()
        .map(|e| {
            format!(
                "event: {}\ndata: {e}\n\n",
                e["type"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

/// Anthropic's answer to a Messages request whose prompt is `prompt`
/// tokens and whose `max_tokens` is `max_tokens`, against a window of
/// `window`: None when it fits, else the error body, in the wording
/// Anthropic chooses: the prompt alone over the window is "too long"; a
/// prompt that fits but leaves less than `max_tokens` names both parts.
pub fn anthropic_overflow(prompt: u64, max_tokens: u64, window: u64) -> Option<Value> {
    let message = if prompt > window {
        format!("prompt is too long: {prompt} tokens > {window} maximum")
    } else if prompt.saturating_add(max_tokens) > window {
        format!(
            "input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {window}, decrease input length or `max_tokens` and try again"
        )
    } else {
        return None;
    };
    Some(anthropic_error("invalid_request_error", &message))
}

fn anthropic_error(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

fn error_body(message: &str, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}})
}

fn json_response(status: StatusCode, v: &Value) -> http::Response<Bytes> {
    let mut r = http::Response::new(Bytes::from(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// An OpenAI-style stream: one content chunk, the finishing chunk, the
/// usage chunk when asked for, `[DONE]`.
fn stream_response(model: &str, usage: &Value, include_usage: bool) -> http::Response<Bytes> {
    let null_usage = |mut v: Value| {
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    };
    let chunk = |delta: Value, finish: Value| {
        null_usage(
            json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    };
    let mut events = vec![
        chunk(json!({"role": "assistant", "content": "ok"}), Value::Null),
        chunk(json!({}), json!("stop")),
    ];
    if include_usage {
        events.push(json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [], "usage": usage}));
    }
    let mut body = String::new();
    for e in events {
        body.push_str(&format!("data: {e}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    let mut r = http::Response::new(Bytes::from(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// `condense replay` (and a test or bench) puts the simulator in place of
/// the network.
impl InProcess for Simulator {
    fn respond(&self, method: &Method, path: &str, body: &Bytes) -> http::Response<Bytes> {
        Simulator::respond(self, method, path, body)
    }
}

#[cfg(test)]
mod tests;
