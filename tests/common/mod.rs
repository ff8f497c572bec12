//! Test harness: an in-process mock OpenAI upstream and a condense server in
//! front of it, both on 127.0.0.1 port 0.
//!
//! The mock is steered per request by `x-mock-*` headers, which condense
//! forwards like any other header:
//! - `x-mock-status: N` answers with status N and `x-mock-body` (or a default
//!   OpenAI error body), plus `Retry-After: 7` on a 429.
//! - `x-mock-sleep-ms: N` waits N ms before sending response headers.
//! - `x-mock-chunk-delay-ms: N` waits N ms between streamed chunks.
//! - `x-mock-stall: 1` stops sending (without closing) after the first chunk.
//!   Chat completions answer like OpenAI: JSON, or SSE when `stream` is true,
//!   with a usage chunk only when `stream_options.include_usage` is true and
//!   `"usage":null` on the other chunks then.
//!   `prompt_tokens` is condense's own uncached count of the body received
//!   times `x-mock-token-factor` (a provider whose tokenizer counts
//!   differently), or the body's length / 4 when no factor is given.
//!   A chat request whose first message holds `<conversation>` is a
//!   summarizer call: it is answered per `MockState::summary_mode` ("ok": a
//!   checkpoint with every section, naming the call's number as
//!   `checkpoint-N`; "error": a 500; "hang": never; "unusable": an answer
//!   without the sections; "echo_key": a 401 quoting the Authorization it
//!   got), after `summary_delay_ms`. A Messages request whose first
//!   message holds `<conversation>` is one too, answered in Messages' shape,
//!   and so is a Responses request whose first input item does, answered
//!   in Responses' shape.
//! - `x-mock-window: N` rejects a chat request whose prompt tokens plus
//!   `max_tokens` exceed N with OpenAI's `context_length_exceeded` error
//!   (counted in `MockState::overflows`); `x-mock-always-overflow: 1`
//!   rejects every chat request that way, naming a limit of 8192.
//! - `x-mock-echo-field: NAME` rejects a chat request with a 400 that
//!   quotes the request's field NAME, as upstreams do for a value they do
//!   not accept: OpenAI's "Invalid value: '…'. Supported values are: …"
//!   (`code: invalid_value`), or with `x-mock-echo-style: vllm` vLLM's
//!   validation error (`BadRequestError`, the input in a pydantic message).
//!   `/v1/models` lists `gpt-4o` (no window, like OpenAI) and `vllm-small`
//!   with `max_model_len` 16384 (like vLLM). Any other path echoes the
//!   request back as JSON.
//! - `/v1/messages` answers like Anthropic (JSON, or its SSE events), with
//!   `input_tokens` plus `cache_read_input_tokens` the body's length / 4;
//!   `x-mock-window: N` rejects it as Anthropic does: "prompt is too long:
//!   P tokens > N maximum" when the prompt alone is over N, "input length
//!   and `max_tokens` exceed context limit: P + M > N, ..." when only the
//!   prompt plus `max_tokens` is (counted in `MockState::overflows`).
//! - With a provider set (`MockUpstream::set_provider`), chat requests that
//!   are not summarizer calls and `/v1/models` are answered by that
//!   `condense::simulate::Simulator` (its counting rule, window and overflow
//!   wording), exactly as `condense replay` answers them in process.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use condense::config::Config;
use condense::server::Server;
use serde_json::{Value, json};

#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Recorded {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

#[derive(Default)]
pub struct MockState {
    pub requests: Mutex<Vec<Recorded>>,
    /// Set once a streamed response has sent its last chunk.
    pub stream_finished: AtomicBool,
    /// Streams whose body was dropped before the end (client went away).
    pub streams_dropped: AtomicUsize,
    /// How summarizer calls are answered (see the module docs); "ok" when
    /// unset.
    pub summary_mode: Mutex<Option<&'static str>>,
    pub summary_delay_ms: std::sync::atomic::AtomicU64,
    /// Chat requests rejected for their length.
    pub overflows: AtomicUsize,
    /// Answers chat requests and the listing when set.
    pub provider: Mutex<Option<Arc<condense::simulate::Simulator>>>,
}

pub struct MockUpstream {
    pub addr: SocketAddr,
    pub state: Arc<MockState>,
    task: tokio::task::JoinHandle<()>,
}

impl MockUpstream {
    pub async fn start() -> MockUpstream {
        let state = Arc::new(MockState::default());
        let app = Router::new().fallback(handle).with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        MockUpstream { addr, state, task }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    pub fn last(&self) -> Recorded {
        self.requests().pop().expect("the mock saw no request")
    }

    /// Summarizer calls seen, in order.
    pub fn summary_calls(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| is_summary_call(&r.body))
            .collect()
    }

    /// Chat requests that were not summarizer calls, in order.
    pub fn chat_requests(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path.ends_with("/chat/completions") && !is_summary_call(&r.body))
            .collect()
    }

    /// Has chat requests and `/v1/models` answered by `sim`.
    pub fn set_provider(
        &self,
        sim: condense::simulate::Simulator,
    ) -> Arc<condense::simulate::Simulator> {
        let sim = Arc::new(sim);
        *self.state.provider.lock().unwrap() = Some(sim.clone());
        sim
    }

    pub fn set_summary_mode(&self, mode: &'static str) {
        *self.state.summary_mode.lock().unwrap() = Some(mode);
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn header_u64(h: &HeaderMap, name: &str) -> Option<u64> {
    h.get(name)?.to_str().ok()?.parse().ok()
}

async fn handle(State(state): State<Arc<MockState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let rec = Recorded {
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts.headers.clone(),
        body: body.clone(),
    };
    state.requests.lock().unwrap().push(rec.clone());
    let h = &parts.headers;
    if let Some(ms) = header_u64(h, "x-mock-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = header_u64(h, "x-mock-status") {
        let body = h
            .get("x-mock-body")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_else(|| {
                json!({"error": {"message": "mock failure", "type": "server_error", "param": null, "code": null}}).to_string()
            });
        let mut resp = (StatusCode::from_u16(status as u16).unwrap(), body).into_response();
        resp.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        if status == 429 {
            resp.headers_mut()
                .insert("retry-after", "7".parse().unwrap());
        }
        return resp;
    }
    let provider = state.provider.lock().unwrap().clone();
    if let Some(sim) = provider
        && (parts.uri.path() == "/v1/models"
            || (parts.uri.path() == "/v1/messages" && !is_summary_call(&body))
            || (parts.uri.path() == "/v1/responses" && !is_summary_call(&body))
            || (parts.uri.path() == "/v1/chat/completions" && !is_summary_call(&body)))
    {
        return sim
            .respond(&parts.method, parts.uri.path(), &body)
            .map(Body::from)
            .into_response();
    }
    if parts.uri.path() == "/v1/messages" && parts.method == "POST" {
        if is_summary_call(&body) {
            return summary(state, h, Speaks::Messages).await;
        }
        return messages(state, h, &body);
    }
    if parts.uri.path() == "/v1/responses" && parts.method == "POST" && is_summary_call(&body) {
        return summary(state, h, Speaks::Responses).await;
    }
    if parts.uri.path() == "/v1/chat/completions" && parts.method == "POST" {
        if is_summary_call(&body) {
            return summary(state, h, Speaks::Chat).await;
        }
        return chat(state, h, &body);
    }
    if parts.uri.path() == "/v1/models" {
        return json_response(json!({"object": "list", "data": [
            {"id": "gpt-4o", "object": "model", "created": 1, "owned_by": "mock"},
            {"id": "vllm-small", "object": "model", "created": 1, "owned_by": "vllm", "max_model_len": 16384}
        ]}))
        .into_response();
    }
    let echo = json!({
        "method": rec.method,
        "path": rec.path,
        "query": rec.query,
        "body": String::from_utf8_lossy(&rec.body),
    });
    let mut resp = json_response(echo).into_response();
    resp.headers_mut()
        .insert("x-mock-echo", "yes".parse().unwrap());
    resp
}

pub fn is_summary_call(body: &[u8]) -> bool {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    v["messages"][0]["content"]
        .as_str()
        .or_else(|| v["input"][0]["content"].as_str())
        .is_some_and(|c| c.contains("<conversation>"))
}

/// The API a summarizer call speaks, by its path.
#[derive(Clone, Copy, PartialEq)]
enum Speaks {
    Chat,
    Messages,
    Responses,
}

/// A summarizer's answer, in the shape of the API it was asked in.
async fn summary(state: Arc<MockState>, h: &HeaderMap, speaks: Speaks) -> Response {
    let n = state
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|r| is_summary_call(&r.body))
        .count()
        - 1;
    let delay = state.summary_delay_ms.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mode = state.summary_mode.lock().unwrap().unwrap_or("ok");
    let content = match mode {
        "error" => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "summarizer down").into_response();
        }
        "hang" => std::future::pending::<String>().await,
        "echo_key" => {
            let key = h
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none");
            let body = json!({"error": {"message": format!("Incorrect API key provided: {key}"), "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
            return (StatusCode::UNAUTHORIZED, body.to_string()).into_response();
        }
        "unusable" => "Sure! The agent worked on some files.".to_string(),
        _ => format!(
            "## Task intent\nFix the failing test.\n## Files and artifacts\nsrc/parser.rs\n## Decisions\nnone\n## Errors and blockers\nerror[E0308]\n## Current state\nreading files\n## Next steps\nfix it\n## Critical identifiers\ncheckpoint-{n}\n"
        ),
    };
    if speaks == Speaks::Responses {
        return json_response(json!({
            "id": "resp_sum", "object": "response", "status": "completed", "model": "m",
            "output": [{"type": "message", "id": "msg_sum", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}]}],
            "usage": {"input_tokens": 1000, "output_tokens": 60, "total_tokens": 1060},
        }))
        .into_response();
    }
    if speaks == Speaks::Messages {
        return json_response(json!({
            "id": "msg_sum", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": content}], "stop_reason": "end_turn",
            "stop_sequence": null, "usage": {"input_tokens": 1000, "output_tokens": 60},
        }))
        .into_response();
    }
    json_response(json!({
        "id": "chatcmpl-sum", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 60, "total_tokens": 1060},
    }))
    .into_response()
}

fn chat(state: Arc<MockState>, h: &HeaderMap, body: &Bytes) -> Response {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let factor: Option<f64> = h
        .get("x-mock-token-factor")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let prompt_tokens = match (factor, condense::chat::ChatRequest::parse(body)) {
        (Some(f), Ok(req)) => {
            let model = req.model().unwrap_or_default();
            let enc = condense::tokens::Encoding::for_model(&model);
            (condense::tokens::count_request(&req, enc) as f64 * f).round() as u64
        }
        _ => body.len() as u64 / 4,
    };
    if let Some(field) = h.get("x-mock-echo-field") {
        return echo_invalid(&req, field.to_str().unwrap(), h.get("x-mock-echo-style"));
    }
    let max_tokens = req["max_tokens"].as_u64().unwrap_or(0);
    let window = header_u64(h, "x-mock-window")
        .filter(|w| prompt_tokens + max_tokens > *w)
        .or_else(|| h.contains_key("x-mock-always-overflow").then_some(8192));
    if let Some(window) = window {
        state.overflows.fetch_add(1, Ordering::SeqCst);
        let body = json!({"error": {
            "message": format!("This model's maximum context length is {window} tokens. However, your messages resulted in {prompt_tokens} tokens. Please reduce the length of the messages."),
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}});
        let mut r = (StatusCode::BAD_REQUEST, body.to_string()).into_response();
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        return r;
    }
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3});
    let model = req["model"].as_str().unwrap_or("unknown").to_string();
    if req["stream"] != json!(true) {
        let resp = json!({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there!"}, "finish_reason": "stop"}],
            "usage": usage,
        });
        let mut r = json_response(resp).into_response();
        r.headers_mut()
            .insert("x-request-id", "req_mock_upstream".parse().unwrap());
        return r;
    }
    let include_usage = req["stream_options"]["include_usage"] == json!(true);
    let delay = Duration::from_millis(header_u64(h, "x-mock-chunk-delay-ms").unwrap_or(0));
    let stall = h.contains_key("x-mock-stall");
    let mut events = Vec::new();
    for (i, word) in ["Hello", " there", "!"].iter().enumerate() {
        let mut chunk = json!({
            "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": if i == 0 { json!({"role": "assistant", "content": word}) } else { json!({"content": word}) }, "finish_reason": null}],
        });
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        events.push(format!("data: {chunk}\n\n"));
    }
    let mut last = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
    if include_usage {
        last["usage"] = Value::Null;
    }
    events.push(format!("data: {last}\n\n"));
    if include_usage {
        let u = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage});
        events.push(format!("data: {u}\n\n"));
    }
    events.push("data: [DONE]\n\n".to_string());
    state.stream_finished.store(false, Ordering::SeqCst);
    let guard = DropCounter {
        state: state.clone(),
        finished: false,
    };
    let stream = futures_util::stream::unfold(
        (events.into_iter().enumerate(), guard),
        move |(mut it, mut guard)| async move {
            let (i, ev) = it.next()?;
            if i > 0 {
                if stall {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(delay).await;
            }
            if it.len() == 0 {
                guard.finished = true;
                guard.state.stream_finished.store(true, Ordering::SeqCst);
            }
            Some((Ok::<_, std::io::Error>(Bytes::from(ev)), (it, guard)))
        },
    );
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

/// A 400 quoting the request's `field`, in OpenAI's words or (`style`
/// "vllm") vLLM's.
fn echo_invalid(req: &Value, field: &str, style: Option<&axum::http::HeaderValue>) -> Response {
    let value = req[field].as_str().unwrap_or_default();
    let body = if style.is_some_and(|s| s == "vllm") {
        json!({"object": "error",
            "message": format!("[{{'type': 'literal_error', 'loc': ('body', '{field}'), 'msg': \"Input should be 'low', 'medium' or 'high'\", 'input': '{value}', 'ctx': {{'expected': \"'low', 'medium' or 'high'\"}}}}]"),
            "type": "BadRequestError", "param": null, "code": 400})
    } else {
        json!({"error": {
            "message": format!("Invalid value: '{value}'. Supported values are: 'low', 'medium', and 'high'."),
            "type": "invalid_request_error", "param": field, "code": "invalid_value"}})
    };
    let mut r = (StatusCode::BAD_REQUEST, body.to_string()).into_response();
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

/// Anthropic's Messages API: usage with the prompt split into uncached and
/// cache-read parts, `x-mock-window` enforced with Anthropic's wordings, and
/// a stream in Anthropic's events.
fn messages(state: Arc<MockState>, h: &HeaderMap, body: &Bytes) -> Response {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let prompt_tokens = body.len() as u64 / 4;
    let max_tokens = req["max_tokens"].as_u64().unwrap_or(0);
    if let Some(mut body) = header_u64(h, "x-mock-window")
        .and_then(|w| condense::simulate::anthropic_overflow(prompt_tokens, max_tokens, w))
    {
        state.overflows.fetch_add(1, Ordering::SeqCst);
        body["request_id"] = json!("req_mock");
        let mut r = (StatusCode::BAD_REQUEST, body.to_string()).into_response();
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        return r;
    }
    // A tenth of the prompt "read from the cache".
    let cached = prompt_tokens / 10;
    let usage = json!({"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0, "output_tokens": 3});
    let model = req["model"].as_str().unwrap_or("unknown").to_string();
    let message = json!({"id": "msg_mock", "type": "message", "role": "assistant",
        "model": model, "content": [{"type": "text", "text": "Hello there!"}],
        "stop_reason": "end_turn", "stop_sequence": null, "usage": usage});
    if req["stream"] != json!(true) {
        return json_response(message).into_response();
    }
    let text = condense::simulate::anthropic_stream(&message);
    let mut r = Response::new(Body::from(text));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

struct DropCounter {
    state: Arc<MockState>,
    finished: bool,
}

impl Drop for DropCounter {
    fn drop(&mut self) {
        if !self.finished {
            self.state.streams_dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// condense on 127.0.0.1 port 0 in front of `mock`, with the default
/// config adjusted by `tweak`.
async fn start_server(mock: &MockUpstream, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = mock.base_url();
    config.upstream.anthropic_base_url = mock.base_url();
    tweak(&mut config);
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

/// condense in front of a mock upstream.
pub struct Harness {
    pub mock: MockUpstream,
    pub server: Option<Server>,
    pub addr: SocketAddr,
    pub client: reqwest::Client,
}

impl Harness {
    pub async fn start() -> Harness {
        Harness::with(|_| {}).await
    }

    /// Starts with the default config, adjusted by `tweak`.
    pub async fn with(tweak: impl FnOnce(&mut Config)) -> Harness {
        let mock = MockUpstream::start().await;
        let server = start_server(&mock, tweak).await;
        let addr = server.local_addr();
        Harness {
            mock,
            server: Some(server),
            addr,
            client: reqwest::Client::new(),
        }
    }

    /// A second condense in front of the same mock (a replica), with the
    /// default config adjusted by `tweak`; the caller shuts it down.
    pub async fn replica(&self, tweak: impl FnOnce(&mut Config)) -> Server {
        start_server(&self.mock, tweak).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The metrics text, once the work condense does after an answer has
    /// gone out (reading a JSON answer's usage) is done.
    pub async fn metrics(&self) -> String {
        if let Some(server) = &self.server {
            server.state().proxy.settled().await;
        }
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of one metric series (`name{labels}` exactly as rendered).
    pub async fn metric(&self, series: &str) -> Option<f64> {
        series_value(&self.metrics().await, series)
    }

    pub async fn shutdown(mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown().await.unwrap();
        }
    }
}

/// The value of one metric series (`name{labels}` exactly as rendered) in
/// a `/metrics` text.
pub fn series_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The value of one metric series of the condense at `addr` (0 when it
/// has none).
pub async fn metric_at(addr: SocketAddr, series: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    series_value(&text, series).unwrap_or(0.0)
}

/// An axum app served on 127.0.0.1, port 0, until dropped: the scripted
/// upstreams of the tests.
pub struct Served {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve(app: Router) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Served { addr, task }
}

/// POSTs `body` to condense at `path` with every API's credential headers
/// (and Anthropic's version): the status and the body's text.
pub async fn post(server: &Server, path: &str, body: &Value) -> (u16, String) {
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

/// A metric of condense's, once the work after its answers (their usage
/// read) is done.
pub async fn settled_metric(server: &Server, series: &str) -> f64 {
    server.state().proxy.settled().await;
    metric_at(server.local_addr(), series).await
}

/// A `[[models]]` profile: `pattern` gets a `window`-token context window.
pub fn profile(pattern: &str, window: u64) -> condense::config::ModelProfile {
    condense::config::ModelProfile {
        pattern: pattern.to_string(),
        context_window: window,
        encoding: None,
        trigger: None,
        target: None,
    }
}

/// A coding-agent session for `model` of `turns` tool calls whose results
/// have `lines` lines. With `think` words of reasoning per assistant
/// message, masking tool output alone cannot save it.
pub fn coding_session(model: &str, turns: usize, think: usize, lines: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the failing test in src/parser.rs"}),
    ];
    for t in 0..turns {
        let id = format!("call_{t}");
        let thought: String = (0..think).map(|w| format!("idea{t}x{w} ")).collect();
        messages.push(json!({"role": "assistant", "content": format!("Step {t}. {thought}"), "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": format!("{{\"cmd\":\"cat src/m{t}.rs\"}}")}}]}));
        let body: String = (0..lines)
            .map(|l| format!("{l:>4} let v{t}_{l} = parse(&input[{l}..]);\n"))
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("{body}error[E0308]: mismatched types in src/m{t}.rs\n")}));
    }
    json!({"model": model, "messages": messages, "max_tokens": 256})
}

/// The client's tools went upstream unchanged and first; after them, at
/// most condense's own (`condense_recall`, `compress_context`).
pub fn assert_client_tools_first(sent: &Value, original: &Value) {
    let (Some(sent), Some(original)) = (sent.as_array(), original.as_array()) else {
        assert_eq!(sent, original, "tools untouched");
        return;
    };
    assert_eq!(
        &sent[..original.len()],
        &original[..],
        "client tools first, untouched"
    );
    for extra in &sent[original.len()..] {
        let name = extra["name"]
            .as_str()
            .or(extra["function"]["name"].as_str());
        assert!(
            matches!(name, Some("condense_recall" | "compress_context")),
            "{extra}"
        );
    }
}

pub fn chat_body(stream: bool) -> Value {
    json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."}
        ],
        "stream": stream,
    })
}

/// A JSON response, as the scripted upstreams answer.
pub fn json_response(v: Value) -> Response {
    let mut r = v.to_string().into_response();
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

/// A throwaway redis-server on a free port, killed on drop. The tests that
/// use it are `#[ignore]`d with the reason, so that `cargo test` without
/// redis-server says it did not run them; `cargo test -- --ignored redis`
/// runs them (CI does), and fails when redis-server is missing.
pub struct Redis {
    pub child: std::process::Child,
    pub port: u16,
}

impl Redis {
    pub fn start() -> Redis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Redis {
            child: Redis::spawn(port),
            port,
        }
    }

    /// redis-server on `port`, once it accepts connections.
    fn spawn(port: u16) -> std::process::Child {
        let mut child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("redis-server is needed for this test: {e}"));
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return child;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("redis-server did not start");
    }

    /// Kills the server (what it held is gone).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A new, empty server on the same port.
    pub fn start_again(&mut self) {
        self.stop();
        self.child = Redis::spawn(self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client's Responses WebSocket to condense.
pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A Responses WebSocket to condense, with a key and the beta that asks
/// for sockets, as Codex opens it. Small buffers: the heap the 200-socket
/// test measures is condense's.
pub async fn connect(server: &Server) -> Ws {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
    let addr = server.local_addr();
    let mut req = format!("ws://{addr}/v1/responses")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", "Bearer sk-test".parse().unwrap());
    req.headers_mut().insert(
        "openai-beta",
        "responses_websockets=2026-02-06".parse().unwrap(),
    );
    let config = WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0);
    let (ws, resp) = tokio_tungstenite::connect_async_with_config(req, Some(config), false)
        .await
        .unwrap();
    assert_eq!(resp.status(), 101);
    ws
}

/// The next event on a Responses WebSocket (pings and pongs passed over),
/// within 20 s.
pub async fn next_event(ws: &mut Ws) -> Value {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(20), ws.next())
            .await
            .expect("an event within 20 s")
            .expect("the socket is open")
            .unwrap();
        match msg {
            Message::Text(t) => return serde_json::from_str(&t).unwrap(),
            Message::Ping(_) | Message::Pong(_) => continue,
            other => panic!("unexpected message {other:?}"),
        }
    }
}

/// Sends `create` on a Responses WebSocket and reads the events of its
/// response, up to its end (completed, incomplete, failed, or an error).
pub async fn response(ws: &mut Ws, create: Value) -> Vec<Value> {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::text(create.to_string())).await.unwrap();
    let mut events = Vec::new();
    loop {
        let e = next_event(ws).await;
        let end = matches!(
            e["type"].as_str(),
            Some("response.completed" | "response.incomplete" | "response.failed" | "error")
        );
        events.push(e);
        if end {
            return events;
        }
    }
}

/// A Responses user message.
pub fn user(text: &str) -> Value {
    json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
}

/// A condense process, killed when dropped: a failing test does not leave
/// it serving.
pub struct Running(pub std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` (condense serving), collecting its log; returns it with
/// the address it listens on (said within `deadline`), the log so far and
/// the thread reading it (which ends with the process).
pub fn spawn_logged(
    cmd: &mut std::process::Command,
    deadline: Duration,
) -> (
    Running,
    String,
    Arc<Mutex<String>>,
    std::thread::JoinHandle<()>,
) {
    let mut child = cmd
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let collected = log.clone();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            // The text log says `listen=<address>`, the JSON one
            // `"listen":"<address>"`.
            if let Some(rest) = line.split("listen=").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            } else if let Some(rest) = line.split("\"listen\":\"").nth(1) {
                let _ = tx.send(rest.split('"').next().unwrap_or("").to_string());
            }
            let mut log = collected.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
    let addr = rx.recv_timeout(deadline).unwrap_or_else(|_| {
        panic!(
            "condense never said where it listens: {}",
            log.lock().unwrap()
        )
    });
    (Running(child), addr, log, reader)
}
