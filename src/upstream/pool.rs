//! The upstream's connections, kept open for the next request: one pool for
//! each worker thread (see [`crate::server::workers`]), so a connection's
//! task runs on the thread whose requests use it.
//!
//! HTTP/1.1 connections are taken by one request at a time, from the most
//! recently used; one goes back to the pool when its response body has
//! been read to the end. A body dropped before its end (a client that went
//! away, an answer over the size limit) takes its connection down with it:
//! hyper-util's client let hyper drain what was left, when it could, and
//! kept the connection. Over TLS, a server that picks HTTP/2 in the
//! handshake gets one connection per host, shared by every request. A
//! connection unused for [`IDLE`] is closed, and one the server closed is
//! dropped when found. A request the pooled connection closed under before
//! sending any of it (the server timed the idle connection out as it was
//! taken) goes again, on another connection.
//!
//! hyper-util's pooled client did all of this for about 11,700
//! instructions a small request (its pool hashed the host with SipHash
//! several times a request, and spawned a task to put each HTTP/1.1
//! connection back); here it is a short lock on a list of hosts.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

// tokio's clock (the system's outside tests) so a test can move it on.
use tokio::time::Instant;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::rt::TokioExecutor;

use super::error::BoxError;

/// How long an unused connection is kept.
pub const IDLE: Duration = Duration::from_secs(90);

/// How often a pool looks for connections unused for [`IDLE`].
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Most unused HTTP/1.1 connections kept per host (the oldest go first).
const MAX_IDLE_PER_HOST: usize = 256;

/// Most hosts a pool keeps connections to. The hosts come from the
/// configuration (the upstream, Anthropic's, the summarizer's); past this,
/// a request gets a connection of its own.
const MAX_HOSTS: usize = 32;

/// A request body for the upstream: one condense holds whole, or one
/// relayed as it comes.
pub type RequestBody = Either<Full<Bytes>, UnsyncBoxBody<Bytes, BoxError>>;

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("the upstream URL has no host")]
    NoHost,
    #[error("cannot connect to the upstream")]
    Connect(#[source] BoxError),
    #[error("the HTTP handshake with the upstream failed")]
    Handshake(#[source] hyper::Error),
}

/// Opens connections: TCP (then TLS for https) within the connect timeout.
#[derive(Clone)]
pub struct Connector {
    inner: hyper_rustls::HttpsConnector<HttpConnector>,
    limit: Duration,
}

impl Connector {
    pub fn new(tls: rustls::ClientConfig, limit: Duration) -> Connector {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        // TCP keepalive and a user timeout, as reqwest set them: a long
        // silent answer stays open through NATs and load balancers with an
        // idle cutoff, and a peer that vanished is noticed in about a minute.
        http.set_keepalive(Some(Duration::from_secs(15)));
        http.set_keepalive_interval(Some(Duration::from_secs(15)));
        http.set_keepalive_retries(Some(3));
        #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
        http.set_tcp_user_timeout(Some(Duration::from_secs(30)));
        let inner = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        Connector { inner, limit }
    }

    /// A connection to `dst` (scheme and authority), handshake done: name
    /// lookup, TCP and TLS have `limit` to finish between them, after which
    /// the error is an `io::ErrorKind::TimedOut`.
    async fn connect(&self, dst: Uri) -> Result<Sender, PoolError> {
        use tower::ServiceExt;
        let limit = self.limit;
        let connecting = self.inner.clone().oneshot(dst);
        let io = match tokio::time::timeout(limit, connecting).await {
            Ok(io) => io.map_err(PoolError::Connect)?,
            Err(_) => {
                return Err(PoolError::Connect(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connecting took longer than {limit:?}"),
                ))));
            }
        };
        if io.connected().is_negotiated_h2() {
            let (mut tx, conn) = boxed(http2::Builder::new(TokioExecutor::new()).handshake(io))
                .await
                .map_err(PoolError::Handshake)?;
            run(conn, None);
            tx.ready().await.map_err(PoolError::Handshake)?;
            Ok(Sender::H2(tx))
        } else {
            let (mut tx, conn) = boxed(http1::Builder::new().handshake(io))
                .await
                .map_err(PoolError::Handshake)?;
            let (failed, why) = tokio::sync::oneshot::channel();
            run(conn, Some(failed));
            if let Err(e) = tx.ready().await {
                // The connection's own error says more than "closed".
                return Err(PoolError::Handshake(why.await.unwrap_or(e)));
            }
            Ok(Sender::H1(tx))
        }
    }
}

/// Runs a connection's task on this thread's runtime; its error, if it
/// ends with one, goes to `failed`.
fn run<C>(conn: C, failed: Option<tokio::sync::oneshot::Sender<hyper::Error>>)
where
    C: std::future::Future<Output = Result<(), hyper::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "an upstream connection ended with an error");
            if let Some(failed) = failed {
                let _ = failed.send(e);
            }
        }
    });
}

/// A connection's request side.
enum Sender {
    H1(http1::SendRequest<RequestBody>),
    H2(http2::SendRequest<RequestBody>),
}

/// An HTTP/1.1 connection waiting for a request.
struct Idle {
    tx: http1::SendRequest<RequestBody>,
    since: Instant,
}

/// A shared HTTP/2 connection and when a request last took it.
struct Shared {
    tx: http2::SendRequest<RequestBody>,
    used: Instant,
}

/// The connections to one host.
struct Host {
    https: bool,
    authority: Authority,
    /// `Host` for HTTP/1.1 requests ([`host_header`]).
    host_header: Option<HeaderValue>,
    /// Oldest first.
    idle: Vec<Idle>,
    h2: Option<Shared>,
}

impl Host {
    fn new(https: bool, authority: &Authority) -> Host {
        Host {
            https,
            authority: authority.clone(),
            host_header: host_header(https, authority),
            idle: Vec::new(),
            h2: None,
        }
    }

    /// Drops connections unused since before `cutoff` or closed.
    fn sweep(&mut self, cutoff: Instant) {
        self.idle.retain(|i| i.since >= cutoff && !i.tx.is_closed());
        if self
            .h2
            .as_ref()
            .is_some_and(|s| s.used < cutoff || s.tx.is_closed())
        {
            self.h2 = None;
        }
    }

    /// A ready connection: the HTTP/2 one, or the most recently used
    /// HTTP/1.1 one. Closed and expired ones found on the way are dropped.
    fn take(&mut self, now: Instant) -> Option<Sender> {
        if let Some(shared) = &mut self.h2 {
            if !shared.tx.is_closed() && now.duration_since(shared.used) < IDLE {
                shared.used = now;
                return Some(Sender::H2(shared.tx.clone()));
            }
            self.h2 = None;
        }
        let mut i = self.idle.len();
        while i > 0 {
            i -= 1;
            let idle = &self.idle[i];
            if now.duration_since(idle.since) >= IDLE {
                // Older ones are older still.
                self.idle.drain(..=i);
                return None;
            }
            if idle.tx.is_ready() {
                return Some(Sender::H1(self.idle.remove(i).tx));
            }
            if idle.tx.is_closed() {
                self.idle.remove(i);
            }
            // Else its connection has not yet taken in the end of its last
            // response; left for the next request.
        }
        None
    }
}

/// `Host` for HTTP/1.1 requests to `authority`: without a default port.
fn host_header(https: bool, authority: &Authority) -> Option<HeaderValue> {
    let default_port = if https { 443 } else { 80 };
    let host = match authority.port_u16() {
        Some(p) if p != default_port => format!("{}:{p}", authority.host()),
        _ => authority.host().to_string(),
    };
    HeaderValue::from_str(&host).ok()
}

/// One worker thread's connections to the upstream hosts.
pub struct Pool {
    connector: Connector,
    hosts: Mutex<Vec<Host>>,
    /// Whether a task sweeps out unused connections.
    sweeping: AtomicBool,
}

/// Where a request's connection is pooled: an index into the hosts (hosts
/// are never removed), or none past [`MAX_HOSTS`].
type Slot = Option<usize>;

impl Pool {
    pub fn new(connector: Connector) -> Pool {
        Pool {
            connector,
            hosts: Mutex::new(Vec::new()),
            sweeping: AtomicBool::new(false),
        }
    }

    fn hosts(&self) -> MutexGuard<'_, Vec<Host>> {
        self.hosts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends `req` (its URI absolute) on a pooled connection, or a new one;
    /// the response comes back when its headers have.
    pub async fn send(
        self: &Arc<Pool>,
        mut req: Request<RequestBody>,
    ) -> Result<Response<PooledBody>, BoxError> {
        let https = req.uri().scheme() == Some(&Scheme::HTTPS);
        let authority = req.uri().authority().cloned().ok_or(PoolError::NoHost)?;
        loop {
            let (slot, pooled, host_header) = self.checkout(https, &authority);
            let reused = pooled.is_some();
            let sender = match pooled {
                Some(s) => s,
                None => {
                    let dst = Uri::builder()
                        .scheme(if https { Scheme::HTTPS } else { Scheme::HTTP })
                        .authority(authority.clone())
                        .path_and_query("/")
                        .build()?;
                    let sender = self.connector.connect(dst).await?;
                    self.opened(slot, &sender);
                    sender
                }
            };
            match sender {
                Sender::H1(mut tx) => {
                    if let Some(host) = host_header {
                        req.headers_mut().entry(http::header::HOST).or_insert(host);
                    }
                    // HTTP/1.1 sends the path alone (origin form).
                    let origin = origin_form(req.uri());
                    let full = std::mem::replace(req.uri_mut(), origin);
                    match tx.try_send_request(req).await {
                        Ok(resp) => {
                            let back = Back {
                                pool: self.clone(),
                                slot,
                                tx,
                            };
                            return Ok(resp.map(|body| PooledBody::new(body, Some(back))));
                        }
                        Err(mut e) => match e.take_message() {
                            Some(unsent) if reused => {
                                tracing::debug!(error = %e.error(), "a pooled connection closed before the request went out; sending it on another");
                                req = unsent;
                                *req.uri_mut() = full;
                            }
                            _ => return Err(e.into_error().into()),
                        },
                    }
                }
                Sender::H2(mut tx) => match tx.try_send_request(req).await {
                    Ok(resp) => return Ok(resp.map(|body| PooledBody::new(body, None))),
                    Err(mut e) => match e.take_message() {
                        Some(unsent) if reused => {
                            tracing::debug!(error = %e.error(), "a pooled HTTP/2 connection closed before the request went out; sending it on another");
                            req = unsent;
                        }
                        _ => return Err(e.into_error().into()),
                    },
                },
            }
        }
    }

    /// The pool slot of a host (added if new), a ready connection to it if
    /// one is pooled, and its `Host` header.
    fn checkout(
        &self,
        https: bool,
        authority: &Authority,
    ) -> (Slot, Option<Sender>, Option<HeaderValue>) {
        let now = Instant::now();
        let mut hosts = self.hosts();
        let found = hosts
            .iter()
            .position(|h| h.https == https && h.authority.as_str() == authority.as_str());
        let slot = match found {
            Some(i) => i,
            None if hosts.len() < MAX_HOSTS => {
                hosts.push(Host::new(https, authority));
                hosts.len() - 1
            }
            None => {
                drop(hosts);
                return (None, None, host_header(https, authority));
            }
        };
        let host = &mut hosts[slot];
        (Some(slot), host.take(now), host.host_header.clone())
    }

    /// Notes a new connection: an HTTP/2 one is shared from now on (unless
    /// the host already has one), and the pool starts sweeping.
    fn opened(self: &Arc<Pool>, slot: Slot, sender: &Sender) {
        if let (Some(slot), Sender::H2(tx)) = (slot, sender) {
            let mut hosts = self.hosts();
            if let Some(host) = hosts.get_mut(slot)
                && host.h2.as_ref().is_none_or(|s| s.tx.is_closed())
            {
                host.h2 = Some(Shared {
                    tx: tx.clone(),
                    used: Instant::now(),
                });
            }
        }
        self.sweep_from_now_on();
    }

    /// An HTTP/1.1 connection back from a request, its response read.
    fn put(&self, slot: Slot, tx: http1::SendRequest<RequestBody>) {
        let Some(slot) = slot else { return };
        if tx.is_closed() {
            return;
        }
        let mut hosts = self.hosts();
        // Read under the lock: the list stays in the order of its times.
        let since = Instant::now();
        if let Some(host) = hosts.get_mut(slot) {
            if host.idle.len() >= MAX_IDLE_PER_HOST {
                host.idle.remove(0);
            }
            host.idle.push(Idle { tx, since });
        }
    }

    /// Drops the connections unused for [`IDLE`], and the closed ones.
    fn sweep(&self, now: Instant) {
        let Some(cutoff) = now.checked_sub(IDLE) else {
            return;
        };
        for host in self.hosts().iter_mut() {
            host.sweep(cutoff);
        }
    }

    /// Starts the task that sweeps the pool, on this thread's runtime,
    /// unless one runs. It ends with the pool, or with its runtime (the
    /// next connection opened starts another).
    fn sweep_from_now_on(self: &Arc<Pool>) {
        if self.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeping.store(false, Ordering::Release);
            return;
        };
        let pool = Arc::downgrade(self);
        // Made before the task is: a task dropped unpolled (its runtime
        // shutting down) still clears the mark.
        let done = Unmark(pool.clone());
        runtime.spawn(async move {
            let _done = done;
            let mut every = tokio::time::interval(SWEEP_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                match pool.upgrade() {
                    Some(pool) => pool.sweep(Instant::now()),
                    None => break,
                }
            }
        });
    }

    /// How many connections the pool holds unused: HTTP/1.1 ones waiting,
    /// and the shared HTTP/2 ones.
    #[cfg(test)]
    fn unused(&self) -> usize {
        self.hosts()
            .iter()
            .map(|h| h.idle.len() + usize::from(h.h2.is_some()))
            .sum()
    }

    /// How many of those are still open.
    #[cfg(test)]
    fn unused_open(&self) -> usize {
        self.hosts()
            .iter()
            .map(|h| {
                let h1 = h.idle.iter().filter(|i| !i.tx.is_closed()).count();
                h1 + usize::from(h.h2.as_ref().is_some_and(|s| !s.tx.is_closed()))
            })
            .sum()
    }
}

/// Clears the pool's `sweeping` mark when its sweeping task ends.
struct Unmark(Weak<Pool>);

impl Drop for Unmark {
    fn drop(&mut self) {
        if let Some(pool) = self.0.upgrade() {
            pool.sweeping.store(false, Ordering::Release);
        }
    }
}

/// One of hyper's futures, boxed. Awaited in an `async fn` as it is, the
/// compiler cannot prove that `async fn`'s future `Send`: it would need
/// hyper's future `Send` for every lifetime the request body's error type
/// could have (rust-lang/rust#64552). Here, with the type known, it can.
fn boxed<T>(
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> Pin<Box<dyn std::future::Future<Output = T> + Send>> {
    Box::pin(f)
}

/// `uri` with only its path and query.
fn origin_form(uri: &Uri) -> Uri {
    match uri.path_and_query() {
        Some(p) if p.as_str() != "/" => {
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = Some(p.clone());
            Uri::from_parts(parts).unwrap_or_default()
        }
        _ => Uri::default(),
    }
}

/// An HTTP/1.1 connection to put back once its response is read.
struct Back {
    pool: Arc<Pool>,
    slot: Slot,
    tx: http1::SendRequest<RequestBody>,
}

/// A response body from the upstream; at its end, its HTTP/1.1 connection
/// goes back to the pool.
pub struct PooledBody {
    body: Incoming,
    back: Option<Back>,
}

impl PooledBody {
    fn new(body: Incoming, back: Option<Back>) -> PooledBody {
        let mut b = PooledBody { body, back };
        if b.body.is_end_stream() {
            b.give_back();
        }
        b
    }

    fn give_back(&mut self) {
        if let Some(Back { pool, slot, tx }) = self.back.take() {
            pool.put(slot, tx);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.give_back(),
            // Trailers are the last frame; a server that wrote them need
            // not poll again.
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() || this.body.is_end_stream() => {
                this.give_back()
            }
            // A connection that failed mid-body is not reused.
            Poll::Ready(Some(Err(_))) => this.back = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests;
