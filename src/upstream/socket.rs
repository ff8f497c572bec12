//! The upstream's own Responses WebSocket, for the turns of a client's
//! socket (`upstream.responses_websocket`).
//!
//! condense holds a client socket's conversation and sends each turn
//! upstream as a full stateless request (see `proxy::socket`). Over HTTP
//! that is a POST a turn; with this setting, a client socket gets one
//! upstream socket of its own, opened at its first turn, and each turn is a
//! `response.create` message on it: no request setup per turn, as the
//! client meant. What comes back is read as the SSE stream the pipeline
//! reads ([`crate::wire::responses::upstream`]): usage, recall rounds and
//! overflow recovery (an `error` event that came instead of a response
//! reads as the HTTP API's error) work as over HTTP, and every request of
//! a turn (the retry after an overflow, recall follow-ups) takes the socket
//! too.
//!
//! Where the upstream offers no socket (its answer to the upgrade is not
//! 101), the turn goes over HTTP, as does every later turn of that client
//! socket, and new client sockets do not try again for
//! [`REFUSED_FOR`]. A socket that fails to open or send for another reason
//! (the network, the upstream closing it between turns) is opened again
//! once, then the turn goes over HTTP; the client sees no error the HTTP
//! request would not have given.
//!
//! The request path knows nothing of this: the proxy runs a client
//! socket's turns within [`over`], and [`super::Upstream::send`] takes the
//! socket for a streamed Responses request of the main upstream while one
//! is set. A response body dropped before its last event (the client went
//! away) closes the upstream socket: the next turn opens another rather
//! than read the rest of an old answer.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper_util::rt::TokioIo;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

use super::body::{ResponseBody, UpstreamResponse, whole_body};
use super::error::BoxError;
use super::transport::Pools;
use crate::wire::responses::upstream::{create_message, refusal, sse_frame};

/// How long an upstream that refused a socket is not asked again.
pub const REFUSED_FOR: Duration = Duration::from_secs(600);

/// Largest message read from the upstream's socket (a `response.completed`
/// carries the whole output).
const MAX_MESSAGE_BYTES: usize = 32 << 20;

type Upgraded = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

tokio::task_local! {
    static SOCKET: Arc<Session>;
}

/// Runs `turn` (a client socket's turn) with `session`'s upstream socket
/// available to the requests it sends.
pub async fn over<F: Future>(session: Arc<Session>, turn: F) -> F::Output {
    SOCKET.scope(session, turn).await
}

/// The session of the turn running now, if any.
pub(super) fn current() -> Option<Arc<Session>> {
    SOCKET.try_with(Arc::clone).ok()
}

/// When an upstream refused a socket (seconds since the epoch; 0: never),
/// shared by every client socket.
#[derive(Default)]
pub(super) struct Refused(AtomicU64);

impl Refused {
    fn now() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }

    fn lately(&self) -> bool {
        let at = self.0.load(Ordering::Acquire);
        at != 0 && Refused::now() < at.saturating_add(REFUSED_FOR.as_secs())
    }

    fn mark(&self) {
        self.0.store(Refused::now().max(1), Ordering::Release);
    }
}

enum State {
    /// None open; the next turn opens one.
    Closed,
    Open(Box<Upgraded>),
    /// The upstream offers none: HTTP for the rest of the client socket.
    Refused,
}

/// One client socket's upstream socket.
pub struct Session {
    state: Arc<Mutex<State>>,
    /// The `OpenAI-Beta` values of the client's upgrade that asked for the
    /// socket mode: asked of the upstream too.
    beta: Vec<HeaderValue>,
}

impl Session {
    pub fn new(beta: Vec<HeaderValue>) -> Arc<Session> {
        Arc::new(Session {
            state: Arc::new(Mutex::new(State::Closed)),
            beta,
        })
    }

    /// Sends a Responses request body over the upstream's socket at `uri`
    /// with `headers`; None when it is to go over HTTP instead (no socket
    /// offered or none could be opened, or the body is not a request).
    pub(super) async fn send(
        &self,
        pools: &Pools,
        refused: &Refused,
        uri: &Uri,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> Option<Result<UpstreamResponse, BoxError>> {
        let message = Utf8Bytes::try_from(Bytes::from(create_message(body)?)).ok()?;
        let mut state = self.state.clone().lock_owned().await;
        for attempt in 0..2 {
            if matches!(*state, State::Refused) {
                return None;
            }
            if matches!(*state, State::Closed) {
                if refused.lately() {
                    *state = State::Refused;
                    return None;
                }
                match self.open(pools, uri, headers).await {
                    Opening::Open(ws) => *state = State::Open(ws),
                    Opening::Refused(status) => {
                        tracing::info!(%status, "the upstream offers no Responses WebSocket; turns go over HTTP");
                        refused.mark();
                        *state = State::Refused;
                        return None;
                    }
                    Opening::Failed(e) => {
                        tracing::debug!(error = %e, "the upstream's WebSocket did not open; this turn goes over HTTP");
                        return None;
                    }
                }
            }
            let State::Open(ws) = &mut *state else {
                return None;
            };
            let sent = ws.send(Message::Text(message.clone())).await;
            let first = match sent {
                Ok(()) => next_text(ws).await,
                Err(e) => Err(e.into()),
            };
            match first {
                Ok(first) => return Some(Ok(answer(state, first))),
                // Closed by the upstream since the last turn (an idle or
                // age limit): opened again, once.
                Err(e) => {
                    *state = State::Closed;
                    tracing::debug!(error = %e, attempt, "the upstream's WebSocket failed; opening another");
                }
            }
        }
        None
    }

    /// Opens the upstream's socket at `uri`.
    async fn open(&self, pools: &Pools, uri: &Uri, headers: &HeaderMap) -> Opening {
        let Some(authority) = uri.authority().cloned() else {
            return Opening::Failed("the upstream URL has no host".into());
        };
        let key = generate_key();
        let mut req = Request::new(Either::Left(Full::new(Bytes::new())));
        *req.method_mut() = Method::GET;
        *req.uri_mut() = uri.path_and_query().map_or_else(
            || Uri::from_static("/"),
            |p| Uri::try_from(p.as_str()).unwrap_or_else(|_| Uri::from_static("/")),
        );
        let h = req.headers_mut();
        *h = headers.clone();
        for name in [header::CONTENT_TYPE, header::CONTENT_LENGTH] {
            h.remove(name);
        }
        for v in &self.beta {
            h.append("openai-beta", v.clone());
        }
        if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
            h.insert(header::HOST, host);
        }
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        if let Ok(k) = HeaderValue::from_str(&key) {
            h.insert(header::SEC_WEBSOCKET_KEY, k);
        }
        let dst = match Uri::builder()
            .scheme(uri.scheme().cloned().unwrap_or(http::uri::Scheme::HTTPS))
            .authority(authority)
            .path_and_query("/")
            .build()
        {
            Ok(d) => d,
            Err(e) => return Opening::Failed(e.into()),
        };
        let via = pools.connector.via(&dst);
        let resp = match pools.connector.upgrade(dst, &via, req).await {
            Ok(r) => r,
            Err(e) => return Opening::Failed(e.into()),
        };
        let accepted = resp
            .headers()
            .get(header::SEC_WEBSOCKET_ACCEPT)
            .is_some_and(|a| a.as_bytes() == derive_accept_key(key.as_bytes()).as_bytes());
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS || !accepted {
            return Opening::Refused(resp.status());
        }
        match hyper::upgrade::on(resp).await {
            Ok(upgraded) => {
                let config = WebSocketConfig::default()
                    .max_message_size(Some(MAX_MESSAGE_BYTES))
                    .max_frame_size(Some(MAX_MESSAGE_BYTES));
                Opening::Open(Box::new(
                    WebSocketStream::from_raw_socket(
                        TokioIo::new(upgraded),
                        Role::Client,
                        Some(config),
                    )
                    .await,
                ))
            }
            Err(e) => Opening::Failed(e.into()),
        }
    }
}

enum Opening {
    Open(Box<Upgraded>),
    /// The upstream answered the upgrade with this status, not a socket.
    Refused(StatusCode),
    Failed(BoxError),
}

/// The next text message; pings are answered by the framing, pongs and
/// empty frames passed over.
async fn next_text(ws: &mut Upgraded) -> Result<Bytes, BoxError> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(t))) => return Ok(Bytes::from(t)),
            Some(Ok(Message::Binary(b))) => return Ok(b),
            Some(Ok(Message::Close(frame))) => {
                return Err(format!("the upstream closed its WebSocket ({frame:?})").into());
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => return Err("the upstream closed its WebSocket".into()),
        }
    }
}

/// The answer that begins with `first`: the HTTP API's error for an
/// `error` event, or else a stream of every event to the last, read from
/// the socket in `state` as the body is read.
fn answer(state: OwnedMutexGuard<State>, first: Bytes) -> UpstreamResponse {
    if let Some((status, body)) = refusal(&first) {
        let mut r = http::Response::new(whole_body(body));
        *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return r;
    }
    let reading = Reading {
        state: Some(state),
        first: Some(first),
    };
    let events = futures_util::stream::unfold(reading, |mut r| async move {
        let message = match (r.first.take(), r.state.as_deref_mut()) {
            (Some(m), _) => Ok(m),
            (None, Some(State::Open(ws))) => next_text(ws).await,
            // The last event went out.
            (None, None) => return None,
            (None, Some(_)) => Err("the upstream's WebSocket is closed".into()),
        };
        match message {
            Ok(m) => {
                let framed = sse_frame(&m);
                if framed.last {
                    // The socket is free for the next request (a recall
                    // follow-up may come before this body is dropped).
                    r.state = None;
                }
                Some((Ok(http_body::Frame::data(Bytes::from(framed.frame))), r))
            }
            Err(e) => {
                r.close();
                Some((Err(e), r))
            }
        }
    });
    let body: ResponseBody = BodyExt::boxed_unsync(StreamBody::new(events));
    let mut r = http::Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// A response being read off the socket, holding it until its last event;
/// dropped before that, it closes the socket.
struct Reading {
    state: Option<OwnedMutexGuard<State>>,
    first: Option<Bytes>,
}

impl Reading {
    fn close(&mut self) {
        if let Some(mut state) = self.state.take() {
            *state = State::Closed;
        }
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.close();
    }
}
