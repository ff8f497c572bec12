//! The Responses WebSocket mode: `GET /v1/responses` upgraded to a
//! WebSocket, as Codex (and OpenAI's SDKs) prefer.
//!
//! condense answers the upgrade itself and holds each socket's
//! conversation (`wire::responses::socket::History`). Each
//! `response.create` the client sends becomes a whole stateless Responses
//! request that goes through [`Proxy::conversation`], the same path as an
//! HTTP request (compaction, recall, overflow recovery, calibration,
//! metrics), upstream over HTTP; the events of its streamed answer go back
//! as WebSocket text messages, in order (what condense did, the HTTP
//! route's `x-condense-*` headers, in the `metadata` of the response each
//! turn's first and last events carry). A `generate: false` warm-up is
//! answered at once, as OpenAI does, and its input remembered.
//!
//! Bounds: at most `server.max_websockets` sockets (503 beyond); a message
//! of at most `server.max_body_bytes` (a larger one closes the socket with
//! 1009, as the protocol says); a socket's history of about
//! `server.max_body_bytes` (the oldest responses forgotten first); a socket
//! with no message for `server.websocket_idle_seconds` closed (1000); one
//! response at a time, later `response.create` messages queued (at most
//! [`MAX_QUEUED`]). A client that goes away mid-response, or stops reading
//! for `server.idle_timeout_seconds`, drops it, and its upstream request
//! with it. On shutdown, sockets close (1001) once their
//! response is done; past the grace period the response ends as any
//! stream does. The framing is tokio-tungstenite's.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::{Proxy, X_ACTIONS, X_TOKENS_AFTER, X_TOKENS_BEFORE};
use crate::error::ProxyError;
use crate::wire::Format;
use crate::wire::responses::socket::{
    Create, History, Outcome, Refusal, http_error_event, warmup_events, with_report,
};
use crate::wire::sse;

/// `response.create` messages waiting while a response is under way; past
/// it, a message gets an error event.
pub const MAX_QUEUED: usize = 16;
/// Longest error body read to pass on as an error event.
const MAX_ERROR_BYTES: usize = 64 * 1024;

type Socket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;
/// The socket's sending half, with how long a write may wait on a client
/// that does not read.
struct Tx {
    sink: SplitSink<Socket, Message>,
    stall: std::time::Duration,
}

impl Tx {
    /// Sends one message; a client that has not taken it within the stall
    /// deadline is gone (its socket closes, its response is dropped).
    async fn text(&mut self, text: String) -> Result<(), ()> {
        match tokio::time::timeout(self.stall, self.sink.send(Message::text(text))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(()),
            Err(_) => {
                tracing::debug!(stall = ?self.stall, "a WebSocket client stopped reading; closing it");
                Err(())
            }
        }
    }
}
type Rx = SplitStream<Socket>;

/// Whether `req` asks to upgrade its connection to a WebSocket.
pub fn is_upgrade(req: &Request<Body>) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        req.headers().get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    req.method() == Method::GET
        && req.version() == http::Version::HTTP_11
        && has(header::UPGRADE, "websocket")
        && has(header::CONNECTION, "upgrade")
}

/// Headers of the upgrade that are the socket's, not the requests'.
const SOCKET_HEADERS: [header::HeaderName; 6] = [
    header::SEC_WEBSOCKET_KEY,
    header::SEC_WEBSOCKET_VERSION,
    header::SEC_WEBSOCKET_EXTENSIONS,
    header::SEC_WEBSOCKET_PROTOCOL,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
];

impl Proxy {
    /// Answers a WebSocket upgrade on the Responses route: 101, and the
    /// socket served on its own task.
    pub async fn socket(self: Arc<Self>, mut req: Request<Body>) -> Response {
        let version_ok = req
            .headers()
            .get(header::SEC_WEBSOCKET_VERSION)
            .is_some_and(|v| v.as_bytes() == b"13");
        let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned() else {
            return refusal(
                StatusCode::BAD_REQUEST,
                "a WebSocket upgrade needs Sec-WebSocket-Key",
            );
        };
        if !version_ok {
            let mut r = refusal(
                StatusCode::UPGRADE_REQUIRED,
                "condense speaks WebSocket version 13",
            );
            r.headers_mut().insert(
                header::SEC_WEBSOCKET_VERSION,
                HeaderValue::from_static("13"),
            );
            return r;
        }
        let Ok(permit) = self.sockets.permits.clone().try_acquire_owned() else {
            self.metrics
                .proxy_errors_total
                .with_label_values(&["overloaded"])
                .inc();
            return ProxyError::Overloaded("too many WebSockets open (server.max_websockets)")
                .response_for(Format::Responses);
        };
        let upgrade = hyper::upgrade::on(&mut req);
        let path = req.uri().path().to_string();
        let mut headers = req.headers().clone();
        for name in SOCKET_HEADERS {
            headers.remove(name);
        }
        // The beta that asks for sockets is the socket's; the requests go
        // over HTTP.
        let (socket_beta, beta): (Vec<HeaderValue>, Vec<HeaderValue>) = headers
            .get_all("openai-beta")
            .iter()
            .cloned()
            .partition(|v| v.as_bytes().starts_with(b"responses_websockets"));
        headers.remove("openai-beta");
        for v in beta {
            headers.append("openai-beta", v);
        }
        // Asked of the upstream's own socket, if it is to have one.
        let upstream = crate::upstream::socket::Session::new(socket_beta);
        let proxy = self.clone();
        tokio::spawn(async move {
            let upgraded = match upgrade.await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "a WebSocket upgrade did not complete");
                    return;
                }
            };
            let config = WebSocketConfig::default()
                .read_buffer_size(16 * 1024)
                .write_buffer_size(16 * 1024)
                .max_message_size(Some(proxy.max_body_bytes as usize))
                .max_frame_size(Some(proxy.max_body_bytes as usize));
            let ws = WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                Role::Server,
                Some(config),
            )
            .await;
            proxy
                .serve_socket(
                    ws,
                    Held {
                        headers,
                        path,
                        upstream,
                        _permit: permit,
                    },
                )
                .await;
        });
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
        let mut resp = StatusCode::SWITCHING_PROTOCOLS.into_response();
        let h = resp.headers_mut();
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        if let Ok(v) = HeaderValue::from_str(&accept) {
            h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
        }
        resp
    }

    async fn serve_socket(self: Arc<Self>, ws: Socket, held: Held) {
        self.metrics.websockets_open.inc();
        let (sink, mut rx) = ws.split();
        let mut tx = Tx {
            sink,
            stall: self.sockets.stall,
        };
        let mut socket = Open {
            history: History::new(self.max_body_bytes as usize),
            queue: VecDeque::new(),
            held,
        };
        let mut closing = self.sockets.closing.subscribe();
        let idle = self.sockets.idle;
        let ended = loop {
            let text = match socket.queue.pop_front() {
                Some(t) => t,
                None => {
                    if *closing.borrow() {
                        break Some(CloseCode::Away);
                    }
                    tokio::select! {
                        next = tokio::time::timeout(idle, rx.next()) => match next {
                            Err(_) => break Some(CloseCode::Normal),
                            Ok(next) => match read(next) {
                                Read::Text(t) => t,
                                Read::Other => continue,
                                Read::Binary => {
                                    let e = Refusal {
                                        status: 400,
                                        code: None,
                                        message: "condense reads text messages only".to_string(),
                                        param: None,
                                    };
                                    if send(&mut tx, &e.event()).await.is_err() {
                                        break None;
                                    }
                                    continue;
                                }
                                Read::Gone(code) => break code,
                            },
                        },
                        () = closed(&mut closing) => break Some(CloseCode::Away),
                    }
                }
            };
            match self.respond_on(&text, &mut socket, &mut tx, &mut rx).await {
                Ok(()) => {}
                Err(code) => break code,
            }
        };
        // The close, too, waits no longer than a write may.
        let close = async {
            if let Some(code) = ended {
                let frame = CloseFrame {
                    code,
                    reason: "".into(),
                };
                let _ = tx.sink.send(Message::Close(Some(frame))).await;
            }
            let _ = tx.sink.close().await;
        };
        let _ = tokio::time::timeout(tx.stall, close).await;
        self.metrics.websockets_open.dec();
    }

    /// Answers one client message; Err when the socket is to close (with
    /// that code, or none when the client is gone).
    async fn respond_on(
        self: &Arc<Self>,
        text: &Bytes,
        socket: &mut Open,
        tx: &mut Tx,
        rx: &mut Rx,
    ) -> Result<(), Option<CloseCode>> {
        let outcomes = &self.metrics.websocket_responses_total;
        let create = match Create::parse(text) {
            Ok(c) => c,
            Err(e) => return refuse(self, tx, e).await,
        };
        let input = match socket
            .history
            .input(create.previous.as_deref(), &create.input)
        {
            Ok(i) => i,
            Err(e) => return refuse(self, tx, e).await,
        };
        if !create.generate {
            let id = fresh_id();
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let events = warmup_events(&id, create.model().as_deref(), now);
            // Remembered and counted before the client sees it, as a
            // response is.
            socket
                .history
                .record(&id, create.previous.as_deref(), create.input, Vec::new());
            outcomes.with_label_values(&["warmup"]).inc();
            for event in events {
                send(tx, &event).await.map_err(|_| None)?;
            }
            return Ok(());
        }
        let body = create.body(&input);
        if body.len() as u64 > self.max_body_bytes {
            let e = Refusal {
                status: 413,
                code: None,
                message: format!(
                    "The conversation on this socket is {} bytes, more than condense takes in one request (server.max_body_bytes = {}). Start a new one.",
                    body.len(),
                    self.max_body_bytes
                ),
                param: Some("input"),
            };
            return refuse(self, tx, e).await;
        }
        let mut req = Request::new(Body::from(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = socket
            .held
            .path
            .parse()
            .unwrap_or_else(|_| http::Uri::from_static("/v1/responses"));
        *req.headers_mut() = socket.held.headers.clone();
        // Each turn is a request of its own, with an id of its own, and the
        // headers its client would have sent with it over HTTP.
        if let Ok(id) = HeaderValue::from_str(&crate::ids::fresh_uuid().to_string()) {
            req.headers_mut().insert("x-request-id", id);
        }
        for (name, value) in &create.headers {
            if let (Ok(n), Ok(v)) = (
                header::HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) && !matches!(n.as_str(), "x-request-id" | "x-api-key")
            {
                req.headers_mut().insert(n, v);
            }
        }
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let answer = Box::pin(crate::upstream::socket::over(
            socket.held.upstream.clone(),
            self.clone().conversation(Format::Responses, req),
        ));
        let resp = tokio::select! {
            resp = answer => resp,
            gone = watch_client(rx, &mut socket.queue) => return Err(gone),
        };
        // What condense did to this turn, for the response's metadata.
        let report: Vec<(&str, String)> = [
            ("condense_tokens_before", X_TOKENS_BEFORE),
            ("condense_tokens_after", X_TOKENS_AFTER),
            ("condense_actions", X_ACTIONS),
        ]
        .into_iter()
        .filter_map(|(key, name)| {
            let v = resp.headers().get(name)?.to_str().ok()?;
            Some((key, v.to_string()))
        })
        .collect();
        let status = resp.status();
        let is_sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut body = resp.into_body().into_data_stream();
        if !status.is_success() || !is_sse {
            let mut read = Vec::new();
            loop {
                tokio::select! {
                    chunk = body.next() => match chunk {
                        Some(Ok(c)) if read.len() < MAX_ERROR_BYTES => read.extend_from_slice(&c),
                        Some(Ok(_)) => {}
                        _ => break,
                    },
                    gone = watch_client(rx, &mut socket.queue) => return Err(gone),
                }
            }
            let event = match status.is_success() {
                true => http_error_event(
                    502,
                    b"the upstream answered a streamed request with a body that is not a stream",
                ),
                false => http_error_event(status.as_u16(), &read),
            };
            outcomes.with_label_values(&["failed"]).inc();
            return send(tx, &event).await.map_err(|_| None);
        }
        let mut events = sse::Reader::default();
        let mut outcome = Outcome::default();
        // The turn's input, until its response has finished and is
        // remembered.
        let mut input = Some(create.input);
        loop {
            let chunk = tokio::select! {
                chunk = body.next() => chunk,
                gone = watch_client(rx, &mut socket.queue) => return Err(gone),
            };
            let done = !matches!(chunk, Some(Ok(_)));
            match chunk {
                Some(Ok(c)) => events.push(&c),
                // The relay ended the stream with its own error event.
                _ => {
                    let rest = events.take_rest();
                    if !rest.is_empty() {
                        events.push(&rest);
                        events.push(b"\n\n");
                    }
                }
            }
            while let Some(event) = events.next_event() {
                let Some(data) = sse::data_of(&event) else {
                    continue;
                };
                if data.trim_ascii() == b"[DONE]" || data.trim_ascii().is_empty() {
                    continue;
                }
                outcome.event(&data);
                // A response that ended is remembered and counted before
                // its last event goes out: a client (or a scrape) that has
                // seen it end finds it continued and counted.
                if (outcome.finished || outcome.failed)
                    && let Some(input) = input.take()
                {
                    let label = match (outcome.finished, outcome.id.clone()) {
                        (true, Some(id)) => {
                            let output = outcome.take_output();
                            let previous = create.previous.as_deref();
                            socket.history.record(&id, previous, input, output);
                            match outcome.incomplete {
                                true => "incomplete",
                                false => "completed",
                            }
                        }
                        _ => "failed",
                    };
                    outcomes.with_label_values(&[label]).inc();
                }
                let text = match with_report(&data, &report) {
                    Some(edited) => String::from_utf8_lossy(&edited).into_owned(),
                    None => String::from_utf8_lossy(&data).into_owned(),
                };
                tx.text(text).await.map_err(|_| None)?;
                if input.is_none() {
                    // The response is over, and the client may send its
                    // next turn now, whatever the upstream still holds
                    // open. The rest is read apart, for as long as a write
                    // may stall, so its connection can serve again.
                    let stall = tx.stall;
                    tokio::spawn(async move {
                        let rest = async { while body.next().await.is_some() {} };
                        let _ = tokio::time::timeout(stall, rest).await;
                    });
                    return Ok(());
                }
            }
            if done {
                break;
            }
        }
        if input.is_some() {
            outcomes.with_label_values(&["failed"]).inc();
        }
        Ok(())
    }
}

/// What a socket holds besides its history.
struct Held {
    /// The upgrade request's headers, less the socket's own: every request
    /// made for the socket carries them.
    headers: HeaderMap,
    path: String,
    /// The upstream's socket for this one's turns
    /// (`upstream.responses_websocket`).
    upstream: Arc<crate::upstream::socket::Session>,
    _permit: OwnedSemaphorePermit,
}

struct Open {
    history: History,
    /// Messages that came while a response was under way.
    queue: VecDeque<Bytes>,
    held: Held,
}

/// What a read from the client gave.
enum Read {
    Text(Bytes),
    Binary,
    /// A ping, a pong (answered by the framing) or a bare frame.
    Other,
    /// The client closed, went away, or broke the protocol (the close code
    /// to answer with, if any).
    Gone(Option<CloseCode>),
}

fn read(next: Option<Result<Message, WsError>>) -> Read {
    match next {
        Some(Ok(Message::Text(t))) => Read::Text(Bytes::from(t)),
        Some(Ok(Message::Binary(_))) => Read::Binary,
        Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => Read::Other,
        // The framing answers a close itself.
        Some(Ok(Message::Close(_))) | None => Read::Gone(None),
        Some(Err(WsError::Capacity(e))) => {
            tracing::debug!(error = %e, "a WebSocket message over server.max_body_bytes");
            Read::Gone(Some(CloseCode::Size))
        }
        Some(Err(WsError::Protocol(e))) => {
            tracing::debug!(error = %e, "a WebSocket client broke the protocol");
            Read::Gone(Some(CloseCode::Protocol))
        }
        Some(Err(e)) => {
            tracing::debug!(error = %e, "a WebSocket read failed");
            Read::Gone(None)
        }
    }
}

/// Reads the client while a response is under way: messages are queued;
/// resolves once the client is gone (its response is then dropped).
async fn watch_client(rx: &mut Rx, queue: &mut VecDeque<Bytes>) -> Option<CloseCode> {
    loop {
        match read(rx.next().await) {
            Read::Text(t) if queue.len() < MAX_QUEUED => queue.push_back(t),
            Read::Text(_) => {
                tracing::debug!(
                    "a WebSocket client queued more than {MAX_QUEUED} responses; closing it"
                );
                return Some(CloseCode::Policy);
            }
            Read::Binary | Read::Other => {}
            Read::Gone(code) => return code,
        }
    }
}

/// Answers a message with an error event, counted as refused.
async fn refuse(proxy: &Proxy, tx: &mut Tx, e: Refusal) -> Result<(), Option<CloseCode>> {
    proxy
        .metrics
        .websocket_responses_total
        .with_label_values(&["refused"])
        .inc();
    send(tx, &e.event()).await.map_err(|_| None)
}

/// Resolves once `closing` turns true.
async fn closed(closing: &mut watch::Receiver<bool>) {
    let _ = closing.wait_for(|c| *c).await;
}

/// A response id of condense's own (a warm-up's).
fn fresh_id() -> String {
    format!("resp_{}", crate::ids::fresh_uuid().simple())
}

async fn send(tx: &mut Tx, event: &Value) -> Result<(), ()> {
    tx.text(event.to_string()).await
}

/// An upgrade condense does not accept, in the Responses error shape.
fn refusal(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error",
        "param": null, "code": null}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
