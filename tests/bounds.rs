//! Bounded resources, end to end, the way a client or an upstream that means
//! harm would see them: idle and half-sent connections are closed, bodies
//! have deadlines and a shared memory budget, the connection cap answers
//! instead of hanging, oversized upstream bodies are relayed (or abandoned)
//! without being held, request paths stay under the upstream's base path,
//! client keys never reach the upstream, and client-chosen labels and ids
//! cannot grow without bound.
//!
//! Raw TCP is used wherever an HTTP client would tidy the attack away
//! (`..` segments, a malformed chunked body) or to withhold bytes. Every
//! wait is bounded by `tokio::time::timeout`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Harness, chat_body};
use condense::config::{Config, Secret, SummaryTrigger, TriggerKind};
use condense::server::Server;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest any single wait in these tests may take.
const LIMIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// `fut`, or a test failure naming `what` once [`LIMIT`] has passed.
async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {LIMIT:?}"))
}

fn server(h: &Harness) -> &Server {
    h.server.as_ref().unwrap()
}

/// Every sample of metric `name`, as (labels, value), read from the
/// server's registry directly: asking `/metrics` would open a connection,
/// which these tests count, cap and close.
fn samples(s: &Server, name: &str) -> Vec<(String, f64)> {
    s.state()
        .metrics
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let labels = match series.strip_prefix(name)? {
                "" => String::new(),
                rest if rest.starts_with('{') => rest.to_string(),
                _ => return None,
            };
            Some((labels, value.parse().ok()?))
        })
        .collect()
}

/// The value of one series (`name{labels}` as rendered); 0 when absent.
fn metric(s: &Server, series: &str) -> f64 {
    let (name, labels) = match series.find('{') {
        Some(i) => (&series[..i], &series[i..]),
        None => (series, ""),
    };
    samples(s, name)
        .into_iter()
        .find(|(l, _)| l == labels)
        .map_or(0.0, |(_, v)| v)
}

fn closed(s: &Server, reason: &str) -> f64 {
    metric(
        s,
        &format!("condense_connections_closed_total{{reason=\"{reason}\"}}"),
    )
}

/// Polls `cond` every 10 ms until it holds; fails after [`LIMIT`].
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    bounded(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A response read off a raw connection.
#[derive(Debug)]
struct Raw {
    status: u16,
    /// Header names lowercased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts an OpenAI-shaped error with `status` and `code`.
    fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{self:?}");
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some(), "{v}");
        assert_eq!(e["code"], code, "{v}");
    }
}

/// Reads one HTTP/1.1 response (Content-Length, chunked, or to EOF).
async fn read_response(s: &mut (impl AsyncRead + Unpin)) -> Raw {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.unwrap_or(0);
        assert!(
            n > 0,
            "connection closed before a response head: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {head:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut rest = buf[head_end..].to_vec();
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let body = if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while rest.len() < len {
            let n = s.read(&mut chunk).await.unwrap_or(0);
            assert!(n > 0, "body cut short");
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        rest
    } else if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                let n = s.read(&mut chunk).await.unwrap_or(0);
                assert!(n > 0, "chunked body cut short");
                rest.extend_from_slice(&chunk[..n]);
            };
            let size = usize::from_str_radix(
                String::from_utf8_lossy(&rest[..line_end])
                    .split(';')
                    .next()
                    .unwrap()
                    .trim(),
                16,
            )
            .unwrap();
            rest.drain(..line_end + 2);
            while rest.len() < size + 2 {
                let n = s.read(&mut chunk).await.unwrap_or(0);
                assert!(n > 0, "chunk cut short");
                rest.extend_from_slice(&chunk[..n]);
            }
            body.extend_from_slice(&rest[..size]);
            rest.drain(..size + 2);
            if size == 0 {
                break body;
            }
        }
    } else {
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break rest,
                Ok(n) => rest.extend_from_slice(&chunk[..n]),
            }
        }
    };
    Raw {
        status,
        headers,
        body,
    }
}

/// Sends `request` on a new connection and reads the response.
async fn raw(addr: SocketAddr, request: &[u8]) -> Raw {
    bounded("a raw request", async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        read_response(&mut s).await
    })
    .await
}

/// Reads until the peer closes the connection (EOF or reset); returns the
/// bytes read before that.
async fn until_closed(s: &mut (impl AsyncRead + Unpin)) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Opens `n` connections that send nothing.
async fn idle_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(bounded("connect", TcpStream::connect(addr)).await.unwrap());
    }
    conns
}

/// Writes `bytes` one at a time, `every` apart, until done or the
/// connection fails.
async fn drip(mut w: impl tokio::io::AsyncWrite + Unpin, bytes: Vec<u8>, every: Duration) {
    for b in bytes {
        if w.write_all(&[b]).await.is_err() {
            return;
        }
        tokio::time::sleep(every).await;
    }
}

// ---------------------------------------------------------------------------
// An upstream (or summarizer) that answers with oversized bodies
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Evil {
    /// Chat: a stream whose second event is one 10 MB line.
    LongSseLine,
    /// Chat: a 400 with a 5 MB chunked body.
    HugeError,
    /// `/models`: a listing that never ends; chat: a normal answer.
    EndlessListing,
    /// Chat: a 200 with a 10 MB body (a summarizer's answer).
    HugeAnswer,
}

struct EvilUpstream {
    addr: SocketAddr,
    /// Method and path of every request, in order.
    requests: Arc<Mutex<Vec<String>>>,
    /// Set once condense stopped reading a body the upstream was writing.
    abandoned: Arc<AtomicBool>,
}

impl EvilUpstream {
    fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

const EVENT: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
const MIB: usize = 1 << 20;

/// The stream [`Evil::LongSseLine`] sends: a normal event, a 10 MB
/// `data:` line with no newline, then the end of that event and `[DONE]`.
fn long_sse_body() -> Vec<u8> {
    let mut b = EVENT.as_bytes().to_vec();
    b.extend_from_slice(b"data: ");
    b.resize(b.len() + 10 * MIB, b'x');
    b.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    b
}

/// The error [`Evil::HugeError`] sends: an overflow error, padded to 5 MB.
fn huge_error_body() -> Vec<u8> {
    let pad = "p".repeat(5 * MIB);
    json!({"error": {
        "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
        "padding": pad}})
    .to_string()
    .into_bytes()
}

/// A well-formed checkpoint answer, padded to 10 MB: read whole, it would be
/// a usable summary.
fn huge_answer_body() -> Vec<u8> {
    let content = "## Task intent\nFix the failing test.\n## Files and artifacts\nsrc/parser.rs\n## Decisions\nnone\n## Errors and blockers\nerror[E0308]\n## Current state\nreading files\n## Next steps\nfix it\n## Critical identifiers\ncheckpoint-0\n";
    json!({
        "id": "chatcmpl-sum", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 60, "total_tokens": 1060},
        "padding": "p".repeat(10 * MIB),
    })
    .to_string()
    .into_bytes()
}

const OK_ANSWER: &str = r#"{"id":"ok","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"fine"},"finish_reason":"stop"}]}"#;

/// Reads one request (head and Content-Length body); returns its request
/// line's method and path.
async fn read_upstream_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = head.lines().next()?;
    let mut parts = line.split(' ');
    Some(format!("{} {}", parts.next()?, parts.next()?))
}

/// Writes `body` as chunks of 64 KiB; false when the peer went away.
async fn write_chunked(s: &mut TcpStream, body: &[u8]) -> bool {
    for part in body.chunks(64 * 1024) {
        if !write_chunked_part(s, part).await {
            return false;
        }
    }
    s.write_all(b"0\r\n\r\n").await.is_ok()
}

async fn evil_upstream(mode: Evil) -> EvilUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let abandoned = Arc::new(AtomicBool::new(false));
    let (seen, gone) = (requests.clone(), abandoned.clone());
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let (seen, gone) = (seen.clone(), gone.clone());
            tokio::spawn(async move {
                let Some(request) = read_upstream_request(&mut s).await else {
                    return;
                };
                seen.lock().unwrap().push(request.clone());
                let models = request.ends_with("/models");
                let written = match (mode, models) {
                    (Evil::LongSseLine, false) => {
                        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                        s.write_all(head.as_bytes()).await.is_ok()
                            && write_chunked(&mut s, &long_sse_body()).await
                    }
                    (Evil::HugeError, false) => {
                        let head = "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                        s.write_all(head.as_bytes()).await.is_ok()
                            && write_chunked(&mut s, &huge_error_body()).await
                    }
                    (Evil::HugeAnswer, false) => {
                        let body = huge_answer_body();
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                            body.len()
                        );
                        s.write_all(head.as_bytes()).await.is_ok()
                            && s.write_all(&body).await.is_ok()
                    }
                    (Evil::EndlessListing, true) => {
                        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                        let mut ok = s.write_all(head.as_bytes()).await.is_ok()
                            && write_chunked_part(&mut s, b"{\"object\":\"list\",\"data\":[").await;
                        let entry = br#"{"id":"gpt-4o","object":"model","max_model_len":1000},"#
                            .repeat(1000);
                        while ok {
                            ok = write_chunked_part(&mut s, &entry).await;
                        }
                        false
                    }
                    _ => {
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                            OK_ANSWER.len()
                        );
                        s.write_all(head.as_bytes()).await.is_ok()
                            && s.write_all(OK_ANSWER.as_bytes()).await.is_ok()
                    }
                };
                if !written {
                    gone.store(true, Ordering::SeqCst);
                }
            });
        }
    });
    EvilUpstream {
        addr,
        requests,
        abandoned,
    }
}

/// Writes one chunk of a chunked body; false when the peer went away.
async fn write_chunked_part(s: &mut TcpStream, part: &[u8]) -> bool {
    let mut frame = format!("{:x}\r\n", part.len()).into_bytes();
    frame.extend_from_slice(part);
    frame.extend_from_slice(b"\r\n");
    s.write_all(&frame).await.is_ok()
}

/// condense on 127.0.0.1 port 0 in front of `base_url`.
async fn start_in_front_of(base_url: String, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = base_url;
    config.upstream.learn_windows = false;
    tweak(&mut config);
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(LIMIT).build().unwrap()
}

/// A coding-agent session of `turns` tool calls.
fn session(turns: usize) -> Value {
    common::coding_session("agent-small", turns, 1, 30)
}

/// Summarize once a request has more than 20 messages (so `session(12)`
/// asks for a checkpoint though it fits).
fn summarize_by_messages(c: &mut Config) {
    c.models.push(common::profile("agent-*", 8192));
    c.summary.model = Some("gpt-4o".to_string());
    c.summary.trigger = SummaryTrigger {
        kind: TriggerKind::Messages,
        value: 20.0,
    };
}

// ---------------------------------------------------------------------------
// 1, 2, 15: connections
// ---------------------------------------------------------------------------

#[tokio::test]
async fn idle_connections_beyond_the_cap_are_evicted_and_health_still_answers() {
    let h = Harness::with(|c| {
        c.server.max_connections = 64;
        c.server.idle_timeout_seconds = 60.0;
    })
    .await;
    let s = server(&h);
    let mut conns = idle_connections(h.addr, 200).await;
    let resp = bounded("/healthz behind 200 idle connections", async {
        client().get(h.url("/healthz")).send().await
    })
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "ok");
    // Accepting a connection only asks an idle one to go; each is counted
    // by its own task as it goes.
    eventually("the evictions counted", || closed(s, "evicted") >= 136.0).await;
    assert_eq!(closed(s, "refused"), 0.0);
    // The longest-idle connections went first, and they are really closed.
    bounded("an evicted connection closes", until_closed(&mut conns[0])).await;
    eventually("open connections back under the cap", || {
        metric(s, "condense_open_connections") <= 64.0
    })
    .await;
    drop(conns);
    h.shutdown().await;
}

#[tokio::test]
async fn idle_connections_close_after_the_idle_deadline() {
    let h = Harness::with(|c| c.server.idle_timeout_seconds = 1.0).await;
    let s = server(&h);
    let conns = idle_connections(h.addr, 5).await;
    eventually("5 connections open", || {
        metric(s, "condense_open_connections") == 5.0
    })
    .await;
    let started = Instant::now();
    let closes = conns.into_iter().map(|mut c| async move {
        tokio::time::timeout(Duration::from_secs(3), until_closed(&mut c))
            .await
            .is_ok()
    });
    let all = futures_util::future::join_all(closes).await;
    assert!(
        all.iter().all(|c| *c),
        "idle connections still open after {:?}",
        started.elapsed()
    );
    eventually("5 idle timeouts counted", || {
        closed(s, "idle_timeout") == 5.0
    })
    .await;
    assert_eq!(metric(s, "condense_open_connections"), 0.0);
    assert_eq!(closed(s, "evicted"), 0.0);
    h.shutdown().await;
}

#[tokio::test]
async fn a_slowloris_sending_headers_byte_by_byte_is_closed_at_the_idle_deadline() {
    let h = Harness::with(|c| c.server.idle_timeout_seconds = 1.0).await;
    let s = server(&h);
    let conn = TcpStream::connect(h.addr).await.unwrap();
    let (mut r, w) = conn.into_split();
    // 60 bytes at 200 ms: 12 s to send it whole, far past the deadline.
    let request =
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaa\r\n\r\n".to_vec();
    let writer = tokio::spawn(drip(w, request, Duration::from_millis(200)));
    let got = tokio::time::timeout(Duration::from_secs(4), until_closed(&mut r))
        .await
        .expect("the half-sent request was still open after 4 s");
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    writer.abort();
    eventually("the idle timeout counted", || {
        closed(s, "idle_timeout") == 1.0
    })
    .await;
    assert_eq!(h.mock.requests().len(), 0, "nothing may reach the upstream");
    h.shutdown().await;
}

#[tokio::test]
async fn shutdown_with_only_idle_connections_returns_at_once() {
    let mut h = Harness::with(|c| {
        c.server.shutdown_grace_seconds = 30.0;
        c.server.idle_timeout_seconds = 60.0;
    })
    .await;
    let mut conns = idle_connections(h.addr, 20).await;
    // One idle keep-alive connection that has served a request, and one
    // that has sent half a request head.
    let keep_alive = client();
    let resp = keep_alive.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(resp.text().await.unwrap(), "ok");
    let mut half = TcpStream::connect(h.addr).await.unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHo")
        .await
        .unwrap();
    let s = h.server.take().unwrap();
    eventually("22 connections open", || {
        metric(&s, "condense_open_connections") == 22.0
    })
    .await;
    tokio::time::timeout(Duration::from_secs(5), s.shutdown())
        .await
        .unwrap_or_else(|_| panic!("shutdown took the grace period with only idle connections"))
        .unwrap();
    for c in &mut conns {
        bounded("an idle connection closed on shutdown", until_closed(c)).await;
    }
    bounded(
        "a half-sent request closed on shutdown",
        until_closed(&mut half),
    )
    .await;
}

// ---------------------------------------------------------------------------
// 3, 4, 12: request bodies
// ---------------------------------------------------------------------------

/// Drips a 100-byte body to `path` and returns the response.
async fn slow_body(addr: SocketAddr, path: &str) -> Raw {
    let conn = TcpStream::connect(addr).await.unwrap();
    let (mut r, mut w) = conn.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    );
    w.write_all(head.as_bytes()).await.unwrap();
    let writer = tokio::spawn(drip(w, vec![b' '; 100], Duration::from_millis(200)));
    let resp = tokio::time::timeout(Duration::from_secs(5), read_response(&mut r))
        .await
        .unwrap_or_else(|_| panic!("{path}: no answer to a dripped body after 5 s"));
    writer.abort();
    resp
}

#[tokio::test]
async fn a_body_sent_byte_by_byte_gets_a_408_on_chat_and_passthrough_routes() {
    let h = Harness::with(|c| {
        c.server.body_timeout_seconds = 1.0;
        c.server.idle_timeout_seconds = 1.0;
    })
    .await;
    let s = server(&h);
    let resp = slow_body(h.addr, "/v1/chat/completions").await;
    resp.assert_error(408, "request_timeout");
    assert_eq!(resp.header("connection"), Some("close"));
    assert!(h.mock.chat_requests().is_empty());

    // Streamed upstream as it comes: the 408 is still the client's, not a
    // 502 from the failed upstream exchange.
    let resp = slow_body(h.addr, "/v1/embeddings").await;
    resp.assert_error(408, "request_timeout");
    assert_eq!(
        metric(s, "condense_proxy_errors_total{kind=\"request_timeout\"}"),
        2.0
    );
    assert_eq!(
        metric(
            s,
            "condense_proxy_errors_total{kind=\"upstream_unreachable\"}"
        ),
        0.0
    );
    h.shutdown().await;
}

#[tokio::test]
async fn a_body_that_stops_mid_way_on_a_passthrough_route_is_the_clients_408() {
    // The upstream's first-byte timeout is the shorter: it must not run
    // while the upstream is still waiting for the client's body.
    let h = Harness::with(|c| {
        c.server.body_timeout_seconds = 1.0;
        c.upstream.first_byte_timeout_seconds = 0.3;
    })
    .await;
    let conn = TcpStream::connect(h.addr).await.unwrap();
    let (mut r, mut w) = conn.into_split();
    w.write_all(
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: 100\r\n\r\nhalf of it",
    )
    .await
    .unwrap();
    let resp = bounded("an answer to a stalled body", read_response(&mut r)).await;
    resp.assert_error(408, "request_timeout");
    drop(w);
    let s = server(&h);
    assert_eq!(
        metric(s, "condense_proxy_errors_total{kind=\"upstream_timeout\"}"),
        0.0
    );

    // A body sent whole still gives a slow upstream its 504.
    let resp = h
        .client
        .post(h.url("/v1/files"))
        .header("x-mock-sleep-ms", "3000")
        .body(vec![b'x'; 100])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 504);
    h.shutdown().await;
}

#[tokio::test]
async fn withheld_bodies_cannot_hold_more_than_the_buffer_budget() {
    const DECLARED: usize = 1536 * 1024; // 1.5 MiB
    const CAP: u64 = 4 * MIB as u64;
    let h = Harness::with(|c| {
        c.server.max_body_bytes = 2 * MIB as u64;
        c.server.max_buffered_bytes = CAP;
        c.server.body_timeout_seconds = 30.0;
    })
    .await;
    let bodies = server(&h).state().proxy.bodies.clone();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {DECLARED}\r\n\r\n"
    );
    let overloaded = || {
        metric(
            server(&h),
            "condense_proxy_errors_total{kind=\"overloaded\"}",
        )
    };
    let mut holding = Vec::new();
    let mut refused = Vec::new();
    for i in 0..5 {
        let mut c = TcpStream::connect(h.addr).await.unwrap();
        c.write_all(head.as_bytes()).await.unwrap();
        let refusals = overloaded();
        // Everything but the last byte, then the client waits. Room is
        // taken as the bytes come; a body that finds none is refused
        // part-way (the write may then break off).
        let _ = c.write_all(&vec![b' '; DECLARED - 1]).await;
        let floor = (holding.len() * (DECLARED - 1)) as u64;
        let held = bounded("room taken or refused", async {
            loop {
                if bodies.held_bytes() >= floor + (DECLARED - 1) as u64 {
                    return true;
                }
                if overloaded() > refusals {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        if held {
            holding.push(c);
        } else {
            // The 503 is on its way unless the unread body reset it.
            if let Ok(resp) =
                tokio::time::timeout(Duration::from_secs(2), read_response(&mut c)).await
                && resp.status != 0
            {
                resp.assert_error(503, "overloaded");
                assert_eq!(resp.header("retry-after"), Some("1"), "client {i}");
            }
            refused.push(i);
        }
        assert!(bodies.held_bytes() <= CAP, "{} held", bodies.held_bytes());
    }
    assert_eq!(holding.len(), 2, "two 1.5 MiB bodies fit in 4 MiB");
    assert_eq!(refused, vec![2, 3, 4]);
    assert_eq!(overloaded(), 3.0);
    assert!(h.mock.chat_requests().is_empty());
    // The clients give up: their room comes back.
    drop(holding);
    eventually("held bytes back to 0", || bodies.held_bytes() == 0).await;
    // And a normal request finds room again.
    let resp = client()
        .post(h.url("/v1/chat/completions"))
        .body(chat_body(false).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    h.shutdown().await;
}

#[tokio::test]
async fn a_malformed_chunked_body_on_a_passthrough_route_is_a_400() {
    let h = Harness::start().await;
    let resp = raw(
        h.addr,
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nZZZ-not-hex\r\n\r\n",
    )
    .await;
    resp.assert_error(400, "invalid_body");
    assert_eq!(
        metric(
            server(&h),
            "condense_proxy_errors_total{kind=\"upstream_unreachable\"}"
        ),
        0.0
    );
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// 5: every connection busy
// ---------------------------------------------------------------------------

/// `n` connections, each with a request in flight for 1.5 s (the mock
/// holds its answer), once the mock has all of them.
async fn busy_connections(
    h: &Harness,
    n: usize,
) -> Vec<tokio::task::JoinHandle<reqwest::StatusCode>> {
    let busy: Vec<_> = (0..n)
        .map(|_| {
            let url = h.url("/v1/files");
            tokio::spawn(async move {
                // One client each: one connection each.
                client()
                    .get(url)
                    .header("x-mock-sleep-ms", "1500")
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    eventually("the requests in flight", || h.mock.requests().len() == n).await;
    busy
}

#[tokio::test]
async fn with_every_connection_busy_a_new_one_gets_a_503_and_is_closed() {
    let h = Harness::with(|c| c.server.max_connections = 4).await;
    let s = server(&h);
    let busy = busy_connections(&h, 4).await;
    let mut fifth = TcpStream::connect(h.addr).await.unwrap();
    let resp = bounded("the refusal", read_response(&mut fifth)).await;
    resp.assert_error(503, "overloaded");
    assert_eq!(resp.header("retry-after"), Some("1"));
    assert_eq!(resp.header("content-type"), Some("application/json"));
    bounded("the refused connection closes", until_closed(&mut fifth)).await;
    assert_eq!(closed(s, "refused"), 1.0);
    assert_eq!(closed(s, "evicted"), 0.0);
    for b in busy {
        assert_eq!(bounded("a busy request", b).await.unwrap(), 200);
    }
    // Once they are done, a new connection is served again.
    let resp = client().get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    h.shutdown().await;
}

/// Under HTTP/1.1 load every connection is busy and a new one is refused;
/// a liveness probe on it must still get its 200 (else the pod is restarted
/// for being busy), and a readiness probe its 503.
#[tokio::test]
async fn with_every_connection_busy_liveness_answers_200_and_readiness_503() {
    let h = Harness::with(|c| c.server.max_connections = 2).await;
    let s = server(&h);
    let busy = busy_connections(&h, 2).await;
    let live = raw(h.addr, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert_eq!(live.status, 200, "{:?}", live.body);
    assert_eq!(live.body, b"ok");
    let ready = raw(h.addr, b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert_eq!(ready.status, 503);
    assert_eq!(ready.body, b"saturated");
    let messages = raw(
        h.addr,
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    assert_eq!(messages.status, 503);
    assert_eq!(messages.json()["error"]["type"], "overloaded_error");
    // Only the API request counts as refused.
    assert_eq!(closed(s, "refused"), 1.0);
    for b in busy {
        assert_eq!(bounded("a busy request", b).await.unwrap(), 200);
    }
    h.shutdown().await;
}

/// A chat body whose one tool result is `lines` distinct path lines, each
/// line tagged with `tag` (so no two bodies share a message to count).
fn distinct_paths_body(lines: usize, tag: &str) -> Vec<u8> {
    let out: String = (0..lines)
        .map(|i| format!("src/{tag}/module_{i}/file_{i}.py: ok\n"))
        .collect();
    serde_json::to_vec(&json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "Look at the tree."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": out},
        {"role": "assistant", "content": "Seen it."},
        {"role": "user", "content": "Now what?"},
    ]}))
    .unwrap()
}

/// Large bodies are prepared in a lane of their own, which an ordinary
/// request never waits behind; a queued job whose client hung up is never
/// run. (Before, all bodies of 128 KB or more shared one set of slots: an
/// ordinary 272 KB request waited 79 s behind three crafted ones, and the
/// jobs of clients that had gone still ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_jobs_cannot_delay_ordinary_requests_and_abandoned_ones_never_run() {
    let h = Harness::start().await;
    let s = server(&h);
    let jobs = |outcome: &str| {
        metric(
            s,
            &format!("condense_prepare_jobs_total{{outcome=\"{outcome}\"}}"),
        )
    };
    // Every slot of the large lane busy with a large body (28 MB each,
    // under the 32 MB limit: at 8 MB, a release build prepared one in less
    // time than the steps below take once scoring lines got cheaper).
    let large_slots = (std::thread::available_parallelism().map_or(2, |n| n.get()) / 2).max(1);
    let busy: Vec<_> = (0..large_slots)
        .map(|i| {
            let url = h.url("/v1/chat/completions");
            let body = distinct_paths_body(650_000, &format!("busy{i}"));
            tokio::spawn(async move {
                client()
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .timeout(Duration::from_secs(120))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    eventually("the large lane busy", || jobs("run") >= large_slots as f64).await;

    // A large body whose client hangs up while its job waits.
    let gone = distinct_paths_body(60_000, "gone");
    let mut conn = TcpStream::connect(h.addr).await.unwrap();
    conn.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            gone.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    conn.write_all(&gone).await.unwrap();
    // Read by condense, its job waiting behind the busy ones: then the
    // client goes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        busy.iter().all(|b| !b.is_finished()),
        "the large lane emptied too soon"
    );
    drop(conn);
    eventually("the waiting job abandoned", || jobs("abandoned") == 1.0).await;

    // An ordinary 300 KB request is answered while the large lane is still
    // busy (none of the large ones has been forwarded yet).
    let ordinary = distinct_paths_body(8_000, "ordinary");
    assert!(ordinary.len() > 128 * 1024 && ordinary.len() < 2 << 20);
    let resp = bounded(
        "an ordinary request",
        client()
            .post(h.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(ordinary)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        busy.iter().any(|b| !b.is_finished()),
        "the large jobs finished before the ordinary request was answered: nothing was shown"
    );
    for b in busy {
        let status = tokio::time::timeout(Duration::from_secs(120), b)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(status, 200);
    }
    // The abandoned job never ran: only the busy ones and the ordinary one.
    assert_eq!(jobs("run"), large_slots as f64 + 1.0);
    assert_eq!(jobs("abandoned"), 1.0);
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// 6, 7, 8, 9: oversized upstream bodies
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_newline_free_sse_line_is_relayed_whole_and_counted() {
    let evil = evil_upstream(Evil::LongSseLine).await;
    let s = start_in_front_of(evil.base_url(), |_| {}).await;
    let expected = long_sse_body();
    let url = format!("http://{}/v1/chat/completions", s.local_addr());
    let mut asked = chat_body(true);
    asked["stream_options"] = json!({"include_usage": true});
    // Without usage asked for, condense asks for it and strips it again;
    // with it, the stream passes through unfiltered.
    for (n, body) in [chat_body(true), asked].into_iter().enumerate() {
        let resp = bounded(
            "the long stream",
            client().post(&url).body(body.to_string()).send(),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200);
        let got = bounded("the long stream's body", resp.bytes())
            .await
            .unwrap();
        assert_eq!(got.len(), expected.len(), "request {n}");
        assert!(
            got[..] == expected[..],
            "request {n}: the stream was altered"
        );
        assert_eq!(
            metric(
                &s,
                "condense_upstream_invalid_responses_total{kind=\"sse_event_too_long\"}"
            ),
            (n + 1) as f64
        );
    }
    // The over-long event ended the tap, so no "stream without [DONE]".
    assert_eq!(
        metric(
            &s,
            "condense_upstream_invalid_responses_total{kind=\"sse_without_done\"}"
        ),
        0.0
    );
    s.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_huge_chunked_error_body_is_relayed_byte_for_byte_and_not_read_as_an_overflow() {
    let evil = evil_upstream(Evil::HugeError).await;
    let s = start_in_front_of(evil.base_url(), |_| {}).await;
    let resp = bounded(
        "the error",
        client()
            .post(format!("http://{}/v1/chat/completions", s.local_addr()))
            .body(chat_body(false).to_string())
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 400);
    let got = bounded("the error body", resp.bytes()).await.unwrap();
    let expected = huge_error_body();
    assert_eq!(got.len(), expected.len());
    assert!(got[..] == expected[..], "the error body was altered");
    assert_eq!(
        evil.requests(),
        vec!["post /v1/chat/completions"],
        "no retry"
    );
    let overflows: f64 = samples(&s, "condense_context_overflow_total")
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(overflows, 0.0);
    s.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_endless_models_listing_is_abandoned_and_the_chat_request_answered() {
    let evil = evil_upstream(Evil::EndlessListing).await;
    let s = start_in_front_of(evil.base_url(), |c| c.upstream.learn_windows = true).await;
    let resp = bounded(
        "a chat request behind an endless listing",
        client()
            .post(format!("http://{}/v1/chat/completions", s.local_addr()))
            .body(chat_body(false).to_string())
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "fine");
    assert_eq!(
        evil.requests(),
        vec!["get /v1/models", "post /v1/chat/completions"]
    );
    // condense hung up on the listing instead of reading it forever.
    eventually("the listing abandoned", || {
        evil.abandoned.load(Ordering::SeqCst)
    })
    .await;
    s.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_summarizer_answering_10_mb_is_a_failed_call_and_the_request_falls_back() {
    let evil = evil_upstream(Evil::HugeAnswer).await;
    let h = Harness::with(|c| {
        summarize_by_messages(c);
        c.summary.base_url = Some(evil.base_url());
        c.summary.model = Some("summarizer-mini".to_string());
        c.summary.timeout_seconds = 10.0;
        c.models.push(common::profile("summarizer-*", 128_000));
    })
    .await;
    let body = session(12);
    let resp = bounded(
        "a request whose summarizer answers 10 MB",
        h.client
            .post(h.url("/v1/chat/completions"))
            .body(body.to_string())
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let actions = resp.headers()["x-condense-actions"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(!actions.contains("summarize"), "{actions}");
    let _ = resp.text().await.unwrap();
    assert_eq!(evil.requests(), vec!["post /v1/chat/completions"]);
    let s = server(&h);
    assert_eq!(
        metric(s, "condense_summarizer_calls_total{outcome=\"error\"}"),
        1.0
    );
    assert_eq!(
        metric(s, "condense_summarizer_calls_total{outcome=\"ok\"}"),
        0.0
    );
    // Nothing dropped mechanically: the request fitted, it went as it came.
    assert_eq!(h.mock.chat_requests().pop().unwrap().json(), body);
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// 10, 13: what reaches the upstream
// ---------------------------------------------------------------------------

#[tokio::test]
async fn dot_segments_cannot_leave_the_upstream_base_path() {
    let mock = common::MockUpstream::start().await;
    let s = start_in_front_of(format!("http://{}/tenant-a/v1", mock.addr), |_| {}).await;
    for path in [
        "/v1/../../tenant-b/v1/models",
        "/v1/%2e%2e/%2e%2e/tenant-b/v1/models",
        "/v1/%2E%2E/%2E%2E/tenant-b/v1/models",
        "/v1/..%2f..%2ftenant-b/v1/models",
        "/../tenant-b/v1/models",
        // What Tomcat, Jetty and Spring read as `..`, and what an upstream
        // behind another decoding proxy reads as `..`.
        "/v1/..;/..;/tenant-b/v1/models",
        "/v1/%252e%252e/%252e%252e/tenant-b/v1/models",
    ] {
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        raw(s.local_addr(), req.as_bytes())
            .await
            .assert_error(400, "invalid_path");
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        raw(s.local_addr(), req.as_bytes())
            .await
            .assert_error(400, "invalid_path");
    }
    assert!(mock.requests().is_empty(), "{:?}", mock.requests());
    // The same request without the escape reaches the tenant's own path.
    let resp = raw(
        s.local_addr(),
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(mock.last().path, "/tenant-a/v1/models");
    s.shutdown().await.unwrap();
}

#[tokio::test]
async fn connect_and_trace_are_refused_and_never_forwarded() {
    let h = Harness::start().await;
    let resp = raw(
        h.addr,
        format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", h.mock.addr).as_bytes(),
    )
    .await;
    resp.assert_error(405, "method_not_allowed");
    let resp = raw(
        h.addr,
        b"TRACE /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-x\r\nConnection: close\r\n\r\n",
    )
    .await;
    resp.assert_error(405, "method_not_allowed");
    let resp = h
        .client
        .request(reqwest::Method::TRACE, h.url("/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    assert!(h.mock.requests().is_empty(), "{:?}", h.mock.requests());
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// 11: gated mode
// ---------------------------------------------------------------------------

#[tokio::test]
async fn in_gated_mode_no_client_key_reaches_the_upstream_in_any_header() {
    const KEY: &str = "ck-bounds-client-key-4f1d9a";
    const UPSTREAM_KEY: &str = "sk-upstream-key";
    let h = Harness::with(|c| {
        summarize_by_messages(c);
        c.auth.client_keys = vec![Secret::new(KEY)];
        c.upstream.api_key = Some(Secret::new(UPSTREAM_KEY));
    })
    .await;
    let bearer = format!("Bearer {KEY}");
    let forms: [(&str, &str); 3] = [
        ("x-api-key", KEY),
        ("api-key", KEY),
        ("authorization", &bearer),
    ];
    for (i, (name, value)) in forms.iter().enumerate() {
        // A chat request that asks for a checkpoint (the first one also
        // makes condense fetch the /models listing).
        let resp = h
            .client
            .post(h.url("/v1/chat/completions"))
            .header(*name, *value)
            .body(session(12 + i).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{name}");
        let _ = resp.text().await.unwrap();
        let resp = h
            .client
            .post(h.url("/v1/embeddings"))
            .header(*name, *value)
            .body(r#"{"input":"x"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{name}");
        let resp = h
            .client
            .get(h.url("/v1/models"))
            .header(*name, *value)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{name}");
    }
    // A wrong key in any of them is still refused.
    let resp = h
        .client
        .get(h.url("/v1/models"))
        .header("x-api-key", "ck-wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);

    let seen = h.mock.requests();
    let models = seen.iter().filter(|r| r.path == "/v1/models").count();
    assert_eq!(models, 4, "three listings relayed and condense's own fetch");
    assert!(!h.mock.summary_calls().is_empty(), "a summarizer call");
    assert_eq!(h.mock.chat_requests().len(), 3);
    assert_eq!(
        seen.iter().filter(|r| r.path == "/v1/embeddings").count(),
        3
    );
    for r in &seen {
        for (name, value) in &r.headers {
            let v = String::from_utf8_lossy(value.as_bytes());
            assert!(
                !v.contains(KEY) && !v.contains(&KEY[3..]),
                "{} {}: the client key in {name}",
                r.method,
                r.path
            );
        }
        assert_eq!(
            r.headers["authorization"],
            format!("Bearer {UPSTREAM_KEY}").as_str(),
            "{} {}",
            r.method,
            r.path
        );
        assert!(!r.headers.contains_key("x-api-key") && !r.headers.contains_key("api-key"));
    }
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// 14, 16: client-chosen ids and labels
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_huge_request_id_is_replaced_not_forwarded_or_echoed() {
    let h = Harness::start().await;
    let huge = "a".repeat(300 * 1024);
    let resp = h
        .client
        .post(h.url("/v1/embeddings"))
        .header("x-request-id", &huge)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let echoed = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let forwarded = h.mock.last().headers["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        forwarded.len(),
        36,
        "a generated UUID, got {} bytes",
        forwarded.len()
    );
    assert_eq!(echoed, forwarded);
    // Characters outside the allowed set are dropped the same way.
    let resp = h
        .client
        .post(h.url("/v1/embeddings"))
        .header("x-request-id", "id with spaces<script>")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"].len(), 36);
    assert_eq!(h.mock.last().headers["x-request-id"].len(), 36);
    // A sane first id does not carry a huge second one upstream.
    let resp = raw(
        h.addr,
        format!(
            "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Request-Id: sane-1\r\nX-Request-Id: {huge}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(resp.status, 200);
    let forwarded: Vec<usize> = h
        .mock
        .last()
        .headers
        .get_all("x-request-id")
        .iter()
        .map(|v| v.len())
        .collect();
    assert_eq!(forwarded, vec![36], "a generated id only");
    assert_eq!(resp.header("x-request-id").map(str::len), Some(36));
    // A sane id still goes through both ways.
    let resp = h
        .client
        .post(h.url("/v1/embeddings"))
        .header("x-request-id", "trace-42:a/b+c=")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"], "trace-42:a/b+c=");
    assert_eq!(h.mock.last().headers["x-request-id"], "trace-42:a/b+c=");
    h.shutdown().await;
}

#[tokio::test]
async fn distinct_long_model_names_keep_the_model_label_bounded() {
    // A small window for every model, so every request is measured (not
    // judged by its length alone) and its usage calibrates.
    let h = Harness::with(|c| c.models.push(common::profile("*", 1024))).await;
    let filler = "Please look at the parser and tell me what is wrong. ".repeat(20);
    // 300 distinct names past the label length limit (30 of them 200 KB,
    // the rest 1 KB, which keeps the test fast), then 100 short distinct
    // ones, more than the 64 labels kept.
    let names: Vec<String> = (0..300)
        .map(|i| {
            let len = if i < 30 { 200 * 1024 } else { 1024 };
            format!("{i}-{}", "m".repeat(len))
        })
        .chain((0..100).map(|i| format!("short-model-{i}")))
        .collect();
    let url = h.url("/v1/chat/completions");
    let statuses: Vec<u16> = bounded(
        "400 requests with distinct model names",
        futures_util::stream::iter(names)
            .map(|model| {
                let body = json!({"model": model, "max_tokens": 16,
                    "messages": [{"role": "user", "content": filler}]})
                .to_string();
                let req = h
                    .client
                    .post(&url)
                    .header("x-mock-token-factor", "1.1")
                    .body(body);
                async move { req.send().await.unwrap().status().as_u16() }
            })
            .buffer_unordered(8)
            .collect(),
    )
    .await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let s = server(&h);
    for name in [
        "condense_calibration_ratio",
        "condense_context_window_tokens",
    ] {
        let labels: HashSet<String> = samples(s, name).into_iter().map(|(l, _)| l).collect();
        assert!(labels.len() <= 65, "{name}: {} series", labels.len());
        assert!(labels.contains("{model=\"other\"}"), "{name}: {labels:?}");
        assert!(
            labels.iter().any(|l| l.contains("short-model-")),
            "{name}: {labels:?}"
        );
        assert!(labels.iter().all(|l| l.len() < 200), "{name}: a long label");
    }
    h.shutdown().await;
}

// ---------------------------------------------------------------------------
// A client that never reads its response
// ---------------------------------------------------------------------------

/// A client that sends an 8 MB body to be echoed back (the mock echoes
/// embeddings requests) and never reads: the answer is more than the
/// socket buffers hold with a 4 KiB receive buffer, so condense's writes
/// block.
async fn stalled_client(addr: SocketAddr) -> TcpStream {
    let body = vec![b'a'; 8 * MIB];
    let head = format!(
        "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut c = sock.connect(addr).await.unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    c.write_all(&body).await.unwrap();
    c
}

/// A client that stopped reading keeps its request in flight (so the
/// connection is never idle) and the relay unpolled (so the upstream idle
/// timeout never fires); without a deadline on blocked writes,
/// `max_connections` such clients would make condense refuse everyone else.
/// Their connections close once writes have been blocked for the idle
/// deadline.
#[tokio::test]
async fn clients_that_never_read_their_responses_do_not_hold_the_connection_cap() {
    let h = Harness::with(|c| {
        c.server.max_connections = 2;
        c.server.idle_timeout_seconds = 1.0;
        c.server.body_timeout_seconds = 1.0;
        c.upstream.idle_timeout_seconds = 1.0;
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..2 {
        stalled.push(stalled_client(h.addr).await);
    }
    // `/readyz`: a connection refused at the cap answers `/healthz` 200
    // too, but `/readyz` only once it is really served.
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut c = TcpStream::connect(h.addr).await.unwrap();
            c.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            if read_response(&mut c).await.status == 200 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    let refused = closed(server(&h), "refused");
    assert!(
        served.is_ok(),
        "two clients that never read held both connections for 10 s ({refused} refused)"
    );
    // The connection's slot is freed a moment before its close is counted.
    eventually("a stalled close counted", || {
        closed(server(&h), "write_stalled") >= 1.0
    })
    .await;
    drop(stalled);
    h.shutdown().await;
}

/// Shutdown waits for responses in flight, but not for a client that
/// stopped reading its own: its connection still closes once writes have
/// been blocked for the idle deadline, not after the whole grace period.
#[tokio::test]
async fn a_client_that_stopped_reading_does_not_hold_the_shutdown_for_the_grace_period() {
    let mut h = Harness::with(|c| {
        c.server.idle_timeout_seconds = 1.0;
        c.server.shutdown_grace_seconds = 30.0;
        c.upstream.idle_timeout_seconds = 30.0;
    })
    .await;
    let stalled = stalled_client(h.addr).await;
    let s = h.server.take().unwrap();
    // The answer is on its way: the connection is busy, not idle.
    eventually("the echo under way", || h.mock.requests().len() == 1).await;
    let started = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), s.shutdown())
        .await
        .unwrap_or_else(|_| panic!("a client that stopped reading held the shutdown"))
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(stalled);
}

/// A stream still open when the shutdown grace ends gets an error event in
/// its API's shape and the body's proper end (the chunked terminator), so
/// the client's SDK raises an API error instead of a broken connection.
#[tokio::test]
async fn streams_open_at_the_end_of_the_grace_end_with_an_error_event() {
    let mut h = Harness::with(|c| {
        c.server.shutdown_grace_seconds = 0.5;
        c.upstream.idle_timeout_seconds = 30.0;
    })
    .await;
    let resp = client()
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-stall", "1")
        .header("content-type", "application/json")
        .body(chat_body(true).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = bounded("the first chunk", stream.next())
        .await
        .unwrap()
        .unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    let s = h.server.take().unwrap();
    let stopped = tokio::spawn(s.shutdown());
    let mut rest = Vec::new();
    bounded("the stream's end", async {
        while let Some(chunk) = stream.next().await {
            // A cut connection would be an error here.
            rest.extend_from_slice(&chunk.unwrap());
        }
    })
    .await;
    let rest = String::from_utf8(rest).unwrap();
    let data = rest
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .next_back()
        .unwrap_or_else(|| panic!("no event after the first: {rest:?}"));
    let event: Value = serde_json::from_str(data).unwrap();
    assert_eq!(event["error"]["code"], "shutting_down", "{rest}");
    bounded("the shutdown", stopped).await.unwrap().unwrap();
}

/// Headers that announce bodies never sent take no room: four clients each
/// declaring 32 MiB and sending nothing more leave the budget to others.
#[tokio::test]
async fn announced_bodies_that_never_come_take_no_room() {
    let h = Harness::with(|c| {
        c.server.max_buffered_bytes = 128 * MIB as u64;
        c.server.body_timeout_seconds = 30.0;
    })
    .await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        32 * MIB
    );
    let mut silent = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(h.addr).await.unwrap();
        c.write_all(head.as_bytes()).await.unwrap();
        silent.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(server(&h).state().proxy.bodies.held_bytes() < MIB as u64);
    let resp = client()
        .post(h.url("/v1/chat/completions"))
        .body(chat_body(false).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    drop(silent);
    h.shutdown().await;
}
