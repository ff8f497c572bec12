//! Client connections: accepted, capped, watched for idleness, and closed.
//!
//! axum's own `serve` keeps a connection for as long as the client likes: a
//! TCP connection that never sends a byte, or sends its headers at one byte
//! a second, is held forever, and enough of them exhaust the process's file
//! descriptors until nothing (not even `/healthz`) is answered. Here:
//!
//! - A connection on which nothing moves is closed after
//!   `server.idle_timeout_seconds`: one with no request in flight (a fresh
//!   one, one still sending its request headers, or an idle keep-alive one),
//!   or one whose client has stopped reading its response (every write has
//!   been blocked on a full socket buffer that long; the response's upstream
//!   connection goes with it). A request in flight that is merely slow is
//!   never cut by this: its body has its own deadline
//!   (`server.body_timeout_seconds`, in the proxy) and its response the
//!   upstream timeouts. The accept loop checks every connection's deadline
//!   every quarter of it, so a connection closes between one and one and a
//!   quarter deadlines.
//! - At most `max_connections` are open. A connection beyond that first
//!   makes room by closing the longest-idle connection that has no request
//!   in flight; when every connection is busy it is answered and closed:
//!   `GET /healthz` with its 200 (a busy process is alive), `GET /readyz`
//!   with a 503, anything else with a `503` in its API's error shape
//!   (`Retry-After: 1`).
//! - At most `max_inflight` requests are in flight over all connections
//!   together (an HTTP/2 connection carries up to `H2_STREAMS` at once,
//!   each holding an upstream socket): past it, the front answers a
//!   request with its API's overload error, and `/readyz` with a 503.
//! - On shutdown, idle connections close at once and busy ones after their
//!   response, so shutdown takes as long as the longest request, not the
//!   whole grace period.
//!
//! The accept loop asks a connection's task to close (or to look at its
//! deadline) with a flag and a wake-up; the task reads the flags when it
//! wakes. A `select!` over a shutdown watch, an eviction `Notify` and a
//! timer of its own polled all three on every wake-up of every connection,
//! about 1,500 instructions a request.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::refused::refuse;
use super::workers::Workers;
use super::{AppState, front};
use crate::metrics::Metrics;

/// File descriptors kept free for everything that is not a client
/// connection or a request's upstream socket (the listener, logs, Redis,
/// the upstream pool's idle ones), besides the connections being refused.
const RESERVED_FDS: u64 = 64;
/// Concurrent streams one HTTP/2 client connection may open, as OpenAI's
/// and Anthropic's own endpoints allow (hyper's default is 200).
const H2_STREAMS: u32 = 100;
/// The shortest interval between two checks of the connections' deadlines.
const MIN_TICK: Duration = Duration::from_millis(10);
/// Idle connections compared to pick one to evict.
const EVICTION_SAMPLE: usize = 64;
/// Connections being refused at once (at most; fewer under a low open-file
/// limit, see [`Limits::new`]); beyond it they are dropped unanswered.
const MAX_REFUSING: usize = 256;
/// Pause after an accept failure (out of file descriptors, ...), so the
/// loop does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How many connections and requests a server keeps, and for how long an
/// idle connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    /// Requests in flight across all connections (HTTP/2 streams count one
    /// each): each holds an upstream socket.
    pub max_inflight: usize,
    /// Connections over the cap being answered at once.
    pub max_refusing: usize,
    pub idle: Duration,
}

impl Limits {
    /// The configured caps, or lower ones when the process's open-file limit
    /// could not hold them. Each client connection takes a descriptor, and
    /// each request in flight one more to the upstream, whichever
    /// connection it came on; the connections being refused take theirs
    /// too. So the limit, less `RESERVED_FDS` and the refusals' share (a
    /// sixteenth, at most `MAX_REFUSING`), is split between connections
    /// and requests in flight, half each.
    pub fn new(configured: usize, inflight: usize, idle: Duration) -> Limits {
        let files = open_file_limit();
        let refusing = files.map_or(MAX_REFUSING, |n| {
            usize::try_from(n / 16)
                .unwrap_or(MAX_REFUSING)
                .clamp(1, MAX_REFUSING)
        });
        let by_files = files
            .map(|n| (n.saturating_sub(RESERVED_FDS + refusing as u64) / 2).max(1))
            .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
        Limits {
            max_connections: configured.min(by_files).max(1),
            max_inflight: inflight.min(by_files).max(1),
            max_refusing: refusing,
            idle,
        }
    }
}

/// The soft limit on open files (Linux: `/proc/self/limits`).
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// One open connection, as the accept loop and its own task see it.
struct Conn {
    /// Requests in flight: from the handler's start to the end (or drop) of
    /// the response body.
    active: AtomicUsize,
    /// Milliseconds since the registry's epoch at which `active` last
    /// changed (or the connection was accepted).
    since: AtomicU64,
    /// What the accept loop asks of the connection's task ([`ASK_EVICT`],
    /// [`ASK_STOP`], [`ASK_CHECK`]), read when the task wakes.
    asked: AtomicU8,
    /// The connection's task, woken when something is asked.
    task: AtomicWaker,
    /// Set while an eviction is asked and not yet answered, so that a burst
    /// of new connections evicts as many idle ones.
    evicting: AtomicBool,
    /// Milliseconds since the registry's epoch (plus one) at which writes to
    /// the client started to block; 0 while they go through.
    write_blocked: AtomicU64,
}

/// Close if idle: another connection needs the room.
const ASK_EVICT: u8 = 1;
/// The server stops: close once idle, take no new request.
const ASK_STOP: u8 = 2;
/// A deadline may have passed: look.
const ASK_CHECK: u8 = 4;

/// The open connections.
struct Registry {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next_id: AtomicU64,
    epoch: Instant,
    /// Requests in flight on all connections together.
    requests: AtomicUsize,
}

impl Registry {
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn len(&self) -> usize {
        self.conns.lock().map_or(0, |c| c.len())
    }

    fn add(&self) -> (u64, Arc<Conn>) {
        let conn = Arc::new(Conn {
            active: AtomicUsize::new(0),
            since: AtomicU64::new(self.now()),
            asked: AtomicU8::new(0),
            task: AtomicWaker::new(),
            evicting: AtomicBool::new(false),
            write_blocked: AtomicU64::new(0),
        });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut c) = self.conns.lock() {
            c.insert(id, conn.clone());
        }
        (id, conn)
    }

    fn remove(&self, id: u64) {
        if let Ok(mut c) = self.conns.lock() {
            c.remove(&id);
        }
    }

    /// Asks the connection idle longest among a sample of idle ones to
    /// close; false when none is idle. The sample bounds the work an accept
    /// at the cap does (a flood of them would otherwise scan every open
    /// connection each time), as Redis samples keys to evict.
    fn evict_idle(&self) -> bool {
        let Ok(conns) = self.conns.lock() else {
            return false;
        };
        let oldest = conns
            .values()
            .filter(|c| c.idle() && !c.evicting.load(Ordering::Relaxed))
            .take(EVICTION_SAMPLE)
            .min_by_key(|c| c.since.load(Ordering::Relaxed));
        match oldest {
            Some(c) => {
                c.evicting.store(true, Ordering::Relaxed);
                c.ask(ASK_EVICT);
                true
            }
            None => false,
        }
    }

    /// Asks every connection whose deadline has passed to close.
    fn check_deadlines(&self, idle: Duration) {
        self.ask_each(ASK_CHECK, |c| c.overdue(idle, self).is_some());
    }

    /// Tells every connection that the server stops.
    fn stop_all(&self) {
        self.ask_each(ASK_STOP, |_| true);
    }

    /// Asks `what` of every connection `which` picks.
    fn ask_each(&self, what: u8, which: impl Fn(&Conn) -> bool) {
        if let Ok(conns) = self.conns.lock() {
            for c in conns.values().filter(|c| which(c)) {
                c.ask(what);
            }
        }
    }
}

impl Conn {
    /// Asks the connection's task for `what` and wakes it.
    fn ask(&self, what: u8) {
        self.asked.fetch_or(what, Ordering::AcqRel);
        self.task.wake();
    }

    /// No request in flight and nothing left to write: hyper lets a
    /// response body (and with it the request's count) go before its last
    /// bytes are flushed, and a connection closed then would cut the
    /// response short.
    fn idle(&self) -> bool {
        self.active.load(Ordering::Acquire) == 0 && self.write_blocked.load(Ordering::Acquire) == 0
    }

    /// Why the connection should close now, if it should: nothing in
    /// flight for `idle`, or writes blocked for that long.
    fn overdue(&self, idle: Duration, registry: &Registry) -> Option<&'static str> {
        let now = registry.now();
        let limit = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let blocked = self.write_blocked.load(Ordering::Acquire);
        if blocked != 0 && now.saturating_sub(blocked - 1) >= limit {
            return Some("write_stalled");
        }
        let quiet = now.saturating_sub(self.since.load(Ordering::Relaxed));
        (self.idle() && quiet >= limit).then_some("idle_timeout")
    }
}

/// The client's socket, telling its [`Conn`] when writes block and when
/// they go through again.
struct Watched {
    tcp: TcpStream,
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

impl Watched {
    /// Records when writes start to block, and that they go through again.
    fn note<T>(&self, poll: Poll<T>) -> Poll<T> {
        let blocked = &self.conn.write_blocked;
        let was = blocked.load(Ordering::Acquire) != 0;
        let now = poll.is_pending();
        if now != was {
            blocked.store(
                if now { self.registry.now() + 1 } else { 0 },
                Ordering::Release,
            );
        }
        poll
    }
}

impl tokio::io::AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.tcp).poll_write(cx, buf);
        self.note(poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs);
        self.note(poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.tcp).poll_flush(cx);
        self.note(poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Counts a request in flight, on its connection and in all, until dropped.
struct Active {
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

impl Active {
    /// The request counted, and how many are in flight with it.
    fn new(conn: Arc<Conn>, registry: Arc<Registry>) -> (Active, usize) {
        conn.active.fetch_add(1, Ordering::AcqRel);
        conn.since.store(registry.now(), Ordering::Relaxed);
        let inflight = registry.requests.fetch_add(1, Ordering::AcqRel) + 1;
        (Active { conn, registry }, inflight)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.registry.requests.fetch_sub(1, Ordering::AcqRel);
        self.conn.active.fetch_sub(1, Ordering::AcqRel);
        self.conn
            .since
            .store(self.registry.now(), Ordering::Relaxed);
    }
}

/// The service of one connection: every request is counted in flight until
/// its response body has been sent (or dropped).
struct Tracked {
    app: Arc<AppState>,
    conn: Arc<Conn>,
    registry: Arc<Registry>,
    /// Requests in flight in all beyond which a request is refused.
    max_inflight: usize,
}

impl Service<Request<Incoming>> for Tracked {
    type Response = Response;
    type Error = Infallible;
    type Future = Handling;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let (active, inflight) = Active::new(self.conn.clone(), self.registry.clone());
        // Over the cap with this one: the front refuses it, unless it is
        // one of condense's own endpoints.
        let saturated = inflight > self.max_inflight;
        Handling {
            // Boxed where it is made: wrapped in an `async` block first, the
            // request's whole future (kilobytes) was copied twice more.
            handled: Box::pin(front::handle(
                self.app.clone(),
                req.map(Body::new),
                saturated,
            )),
            active: Some(active),
        }
    }
}

/// A request being handled; its response's body keeps it counted.
struct Handling {
    handled: Pin<Box<dyn Future<Output = Response> + Send>>,
    active: Option<Active>,
}

impl Future for Handling {
    type Output = Result<Response, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let resp = std::task::ready!(self.handled.as_mut().poll(cx));
        let active = self.active.take();
        Poll::Ready(Ok(resp.map(|body| {
            Body::new(Counted {
                body,
                _active: active,
            })
        })))
    }
}

/// A response body that keeps its request counted in flight.
struct Counted {
    body: Body,
    _active: Option<Active>,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Serves `app` on `listener` until `stop` turns true, then waits for
/// the open connections to finish (the caller bounds that wait). Each
/// connection is served on one of `workers`' threads, in turn.
pub async fn serve(
    listener: TcpListener,
    app: Arc<AppState>,
    limits: Limits,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
    mut workers: Workers,
) {
    let registry = Arc::new(Registry {
        conns: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(0),
        epoch: Instant::now(),
        requests: AtomicUsize::new(0),
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(H2_STREAMS);
    let builder = Arc::new(builder);
    let mut tasks = JoinSet::new();
    let refusing = Arc::new(AtomicUsize::new(0));
    let mut deadlines = tokio::time::interval((limits.idle / 4).max(MIN_TICK));
    deadlines.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            // Before the joins: a run of closing connections must not put
            // the deadlines off.
            _ = deadlines.tick() => registry.check_deadlines(limits.idle),
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            accepted = listener.accept() => {
                let tcp = match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of file descriptors (or another resource):
                        // idle connections give theirs back.
                        tracing::warn!(error = %e, "cannot accept a connection");
                        registry.evict_idle();
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                // Streams are relayed chunk by chunk: without TCP_NODELAY,
                // Nagle's algorithm holds each small chunk until the
                // client's delayed ACK (about 40 ms per chunk on Linux).
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY on a client connection");
                }
                if registry.len() >= limits.max_connections && !registry.evict_idle() {
                    refuse(tcp, &refusing, limits.max_refusing, &metrics);
                    continue;
                }
                let (id, conn) = registry.add();
                metrics.open_connections.inc();
                // Leaves the registry (and the gauge) however the task
                // ends, aborted before its first poll included.
                let registered = Registered {
                    registry: registry.clone(),
                    metrics: metrics.clone(),
                    id,
                };
                let service = Tracked {
                    app: app.clone(),
                    conn: conn.clone(),
                    registry: registry.clone(),
                    max_inflight: limits.max_inflight,
                };
                let serving = Serving {
                    service,
                    builder: builder.clone(),
                    idle: limits.idle,
                    metrics: metrics.clone(),
                    registered,
                };
                // The socket moves to the worker's own event loop.
                match tcp.into_std() {
                    Ok(std) => {
                        tasks.spawn_on(
                            async move {
                                match TcpStream::from_std(std) {
                                    Ok(tcp) => connection(tcp, serving).await,
                                    Err(e) => tracing::warn!(error = %e, "cannot serve a connection"),
                                }
                            },
                            workers.next_runtime(),
                        );
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot serve a connection"),
                }
            }
        }
    }
    // Every connection spawned is in the registry by now.
    registry.stop_all();
    drop(listener);
    // Deadlines still hold while connections finish: a client that stopped
    // reading its response must not hold the shutdown for the whole grace
    // period.
    loop {
        tokio::select! {
            joined = tasks.join_next() => if joined.is_none() { break },
            _ = deadlines.tick() => registry.check_deadlines(limits.idle),
        }
    }
    // Responses WebSockets live on the workers' event loops, off hyper's
    // connections: they close (once their response is done) before the
    // loops stop.
    app.proxy.sockets.close_all().await;
    workers.stop().await;
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// What serving a connection takes besides its socket.
struct Serving {
    service: Tracked,
    builder: Arc<Builder<TokioExecutor>>,
    idle: Duration,
    metrics: Arc<Metrics>,
    registered: Registered,
}

/// Serves one connection until it ends, is idle too long, is evicted while
/// idle, or the server stops.
async fn connection(tcp: TcpStream, serving: Serving) {
    let Serving {
        service,
        builder,
        idle,
        metrics,
        registered,
    } = serving;
    let conn = service.conn.clone();
    let registry = service.registry.clone();
    let io = Watched {
        tcp,
        conn: conn.clone(),
        registry: registry.clone(),
    };
    // Upgrades: a Responses WebSocket (see `proxy/socket.rs`).
    let served = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(served);
    let mut draining = false;
    let closed = std::future::poll_fn(|cx| {
        // Registered before the flags are read, so that nothing asked
        // after the read goes unnoticed.
        conn.task.register(cx.waker());
        let asked = conn.asked.swap(0, Ordering::AcqRel);
        if asked & ASK_STOP != 0 && !draining {
            draining = true;
            served.as_mut().graceful_shutdown();
            // hyper waits for the first bytes of a connection that has
            // sent none; an idle connection has nothing to finish.
            if conn.idle() {
                return Poll::Ready(None);
            }
        }
        if asked & ASK_EVICT != 0 {
            if conn.idle() {
                return Poll::Ready(Some("evicted"));
            }
            // It became busy meanwhile: it may be chosen again later.
            conn.evicting.store(false, Ordering::Relaxed);
        }
        if asked & ASK_CHECK != 0
            && let Some(reason) = conn.overdue(idle, &registry)
        {
            return Poll::Ready(Some(reason));
        }
        served.as_mut().poll(cx).map(|result| {
            if let Err(e) = result {
                tracing::debug!(error = %e, "client connection ended with an error");
            }
            None
        })
    })
    .await;
    // Out of the registry and the gauge before the close is counted, so
    // that no one sees it both closed and open.
    drop(registered);
    if let Some(reason) = closed {
        metrics
            .connections_closed_total
            .with_label_values(&[reason])
            .inc();
    }
}

/// An open connection's place in the registry and the gauge.
struct Registered {
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.remove(self.id);
        self.metrics.open_connections.dec();
    }
}
