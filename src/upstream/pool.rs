//! The upstream's connections, kept open for the next request: one pool for
//! each worker thread (see [`crate::server::workers`]), so a connection's
//! task runs on the thread whose requests use it. Every call condense makes
//! goes through here: the forwarded requests, the `/models` listing, the
//! summarizer's, through an HTTP proxy or not ([`super::connect`]).
//!
//! HTTP/1.1 connections are taken by one request at a time, from the most
//! recently used; one goes back to the pool when its response body has
//! been read to the end. A body dropped before its end (a client that went
//! away, an answer over the size limit) takes its connection down with it.
//! Unused HTTP/1.1 connections are bounded per host and, over every pool
//! and host, by `upstream.max_idle_connections`.
//!
//! Over TLS, a server that picks HTTP/2 in the handshake has its
//! connections shared: a request takes a stream on the first connection
//! with one free, by the server's own `SETTINGS_MAX_CONCURRENT_STREAMS`
//! ([`super::settings`]); when every stream is in use, one request opens
//! another connection and the requests arriving meanwhile wait for it
//! rather than each opening their own (so does the first burst to a host
//! whose protocol is not known yet). A stream is in use until its response
//! body has ended or been dropped. Past the server's limit hyper would
//! queue the request inside the connection, where its first-byte deadline
//! runs. An extra HTTP/2 connection left without streams is closed within
//! a minute; the first, after [`IDLE`].
//!
//! A connection unused for [`IDLE`] is closed, and one the server closed is
//! dropped when found. A request the pooled connection closed under before
//! sending any of it (the server timed the idle connection out as it was
//! taken) goes again, on another connection.
//!
//! hyper-util's pooled client (reqwest's) did the HTTP/1.1 part for about
//! 11,700 instructions a small request (its pool hashed the host with
//! SipHash several times a request, and spawned a task to put each HTTP/1.1
//! connection back), and for HTTP/2 kept one connection a host whatever the
//! server's stream limit; here it is a short lock on a list of hosts.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

// tokio's clock (the system's outside tests) so a test can move it on.
use tokio::time::Instant;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::{http1, http2};
use tokio::sync::Notify;

use super::body::RequestBody;
use super::connect::{Connector, Opened, Via};
use super::error::{BoxError, PoolError};

/// How long an unused connection is kept.
pub const IDLE: Duration = Duration::from_secs(90);

/// How often a pool looks for connections unused for [`IDLE`]; an extra
/// HTTP/2 connection without streams for this long is closed.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Most unused HTTP/1.1 connections kept per host (the oldest go first).
const MAX_IDLE_PER_HOST: usize = 256;

/// Most hosts a pool keeps connections to. The hosts come from the
/// configuration (the upstream, Anthropic's, the summarizer's); past this,
/// a request gets a connection of its own.
const MAX_HOSTS: usize = 32;

/// The unused HTTP/1.1 connections of every pool, and their bound.
pub struct IdleBound {
    now: AtomicUsize,
    max: usize,
}

impl IdleBound {
    pub fn new(max: usize) -> Arc<IdleBound> {
        Arc::new(IdleBound {
            now: AtomicUsize::new(0),
            max,
        })
    }

    /// Takes a place for one more; false when all are taken.
    fn take(&self) -> bool {
        self.now
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        self.now.fetch_sub(n, Ordering::AcqRel);
    }
}

/// A connection's request side, as a request takes it.
enum Sender {
    H1(http1::SendRequest<RequestBody>),
    /// With the stream it holds on the connection.
    H2(http2::SendRequest<RequestBody>, Stream),
}

/// A stream in use on a shared HTTP/2 connection, until dropped.
struct Stream(Arc<AtomicUsize>);

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An HTTP/1.1 connection waiting for a request.
struct Idle {
    tx: http1::SendRequest<RequestBody>,
    since: Instant,
}

/// A shared HTTP/2 connection.
struct Shared {
    tx: http2::SendRequest<RequestBody>,
    /// When a request last took a stream on it.
    used: Instant,
    /// Streams in use on it.
    streams: Arc<AtomicUsize>,
    /// How many the server allows at once.
    limit: Arc<AtomicUsize>,
}

impl Shared {
    fn new(tx: http2::SendRequest<RequestBody>, limit: Arc<AtomicUsize>, now: Instant) -> Shared {
        Shared {
            tx,
            used: now,
            streams: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    fn streams(&self) -> usize {
        self.streams.load(Ordering::Acquire)
    }

    /// A stream on it, when one is free.
    fn stream(&mut self, now: Instant) -> Option<Sender> {
        if self.streams() >= self.limit.load(Ordering::Acquire) {
            return None;
        }
        self.streams.fetch_add(1, Ordering::AcqRel);
        self.used = now;
        Some(Sender::H2(self.tx.clone(), Stream(self.streams.clone())))
    }
}

/// A connection being opened that other requests wait for.
#[derive(Default)]
struct Opening {
    done: AtomicBool,
    /// Whether it failed (then each waiter opens its own).
    failed: AtomicBool,
    notify: Notify,
}

impl Opening {
    fn finish(&self, failed: bool) {
        self.failed.store(failed, Ordering::Release);
        self.done.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Waits (at most `limit`) until the connection is open or failed;
    /// whether it opened.
    async fn opened(&self, limit: Duration) -> bool {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !self.done.load(Ordering::Acquire) {
            let _ = tokio::time::timeout(limit, notified).await;
        }
        self.done.load(Ordering::Acquire) && !self.failed.load(Ordering::Acquire)
    }
}

/// Which protocol a host speaks, once a connection has told.
#[derive(Clone, Copy, PartialEq)]
enum Speaks {
    Unknown,
    H1,
    H2,
}

/// What a request finds in the pool.
enum Found {
    /// A connection, or a stream on one.
    Ready(Sender),
    /// Nothing; it opens a connection, which others may wait for.
    Open(Option<Arc<Opening>>),
    /// Another request is opening the connection this one can share.
    Wait(Arc<Opening>),
}

/// The connections to one host.
struct Host {
    https: bool,
    authority: Authority,
    via: Via,
    /// `Host` for HTTP/1.1 requests ([`host_header`]).
    host_header: Option<HeaderValue>,
    /// Oldest first.
    idle: Vec<Idle>,
    h2: Vec<Shared>,
    speaks: Speaks,
    opening: Option<Arc<Opening>>,
}

impl Host {
    fn new(https: bool, authority: &Authority, via: Via) -> Host {
        Host {
            https,
            authority: authority.clone(),
            via,
            host_header: host_header(https, authority),
            idle: Vec::new(),
            h2: Vec::new(),
            speaks: if https { Speaks::Unknown } else { Speaks::H1 },
            opening: None,
        }
    }

    /// Drops connections unused since before `cutoff` or closed, and extra
    /// HTTP/2 ones without streams since before `extra_cutoff`; returns how
    /// many HTTP/1.1 ones went.
    fn sweep(&mut self, cutoff: Instant, extra_cutoff: Instant) -> usize {
        let before = self.idle.len();
        self.idle.retain(|i| i.since >= cutoff && !i.tx.is_closed());
        let mut first = true;
        self.h2.retain(|s| {
            let unused_since = |t| s.streams() == 0 && s.used < t;
            let expired = unused_since(cutoff) || (!first && unused_since(extra_cutoff));
            let keep = !s.tx.is_closed() && !expired;
            first &= !keep;
            keep
        });
        before - self.idle.len()
    }

    /// A ready connection or stream: a free stream on an HTTP/2 one, or the
    /// most recently used HTTP/1.1 one. Closed and expired ones found on
    /// the way are dropped (the HTTP/1.1 ones given back to `bound`).
    fn take(&mut self, now: Instant, bound: &IdleBound) -> Found {
        self.h2.retain(|s| {
            !s.tx.is_closed() && (s.streams() > 0 || now.duration_since(s.used) < IDLE)
        });
        for shared in &mut self.h2 {
            if let Some(sender) = shared.stream(now) {
                return Found::Ready(sender);
            }
        }
        let mut i = self.idle.len();
        while i > 0 {
            i -= 1;
            let idle = &self.idle[i];
            if now.duration_since(idle.since) >= IDLE {
                // Older ones are older still.
                bound.give(i + 1);
                self.idle.drain(..=i);
                break;
            }
            if idle.tx.is_ready() {
                bound.give(1);
                return Found::Ready(Sender::H1(self.idle.remove(i).tx));
            }
            if idle.tx.is_closed() {
                bound.give(1);
                self.idle.remove(i);
            }
            // Else its connection has not yet taken in the end of its last
            // response; left for the next request.
        }
        if self.speaks == Speaks::H1 {
            return Found::Open(None);
        }
        match &self.opening {
            Some(o) => Found::Wait(o.clone()),
            None => {
                let o = Arc::new(Opening::default());
                self.opening = Some(o.clone());
                Found::Open(Some(o))
            }
        }
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
    /// Unused HTTP/1.1 connections, over every pool.
    bound: Arc<IdleBound>,
    /// Whether a task sweeps out unused connections.
    sweeping: AtomicBool,
}

/// Where a request's connection is pooled: an index into the hosts (hosts
/// are never removed), or none past [`MAX_HOSTS`].
type Slot = Option<usize>;

/// What a request needs of its host to be sent.
struct Checkout {
    slot: Slot,
    found: Found,
    host_header: Option<HeaderValue>,
    via: Via,
}

impl Pool {
    pub fn new(connector: Connector, bound: Arc<IdleBound>) -> Pool {
        Pool {
            connector,
            hosts: Mutex::new(Vec::new()),
            bound,
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
        let mut alone = false;
        loop {
            let Checkout {
                slot,
                found,
                host_header,
                via,
            } = self.checkout(https, &authority, alone);
            let (sender, reused) = match found {
                Found::Ready(sender) => (sender, true),
                Found::Wait(opening) => {
                    // The opener's connection, shared, or else one of its
                    // own.
                    alone = !opening.opened(self.connector.limit()).await;
                    continue;
                }
                Found::Open(opening) => {
                    // Told to the waiting requests however this ends,
                    // this future dropped included.
                    let mut opener = opening.map(|opening| Opener {
                        pool: self.clone(),
                        slot,
                        opening,
                        succeeded: false,
                    });
                    let opened = self.open(https, &authority, &via).await?;
                    let sender = self.opened(slot, opened);
                    if let Some(o) = &mut opener {
                        o.succeeded = true;
                    }
                    (sender, false)
                }
            };
            match sender {
                Sender::H1(mut tx) => {
                    if let Some(host) = host_header {
                        req.headers_mut().entry(http::header::HOST).or_insert(host);
                    }
                    // HTTP/1.1 sends the path alone (origin form), or the
                    // whole URI to a proxy.
                    let full = req.uri().clone();
                    if let Some(auth) = via.forward_auth() {
                        req.headers_mut()
                            .entry(http::header::PROXY_AUTHORIZATION)
                            .or_insert_with(|| auth.clone());
                    }
                    if !via.is_forward() {
                        *req.uri_mut() = origin_form(&full);
                    }
                    match tx.try_send_request(req).await {
                        Ok(resp) => {
                            let back = Back {
                                pool: self.clone(),
                                slot,
                                tx,
                            };
                            return Ok(resp.map(|body| PooledBody::new(body, Some(back), None)));
                        }
                        Err(mut e) => match e.take_message() {
                            Some(unsent) if reused => {
                                tracing::debug!(error = %e.error(), "a pooled connection closed before the request went out; sending it on another");
                                req = unsent;
                                *req.uri_mut() = full;
                                req.headers_mut().remove(http::header::PROXY_AUTHORIZATION);
                            }
                            _ => return Err(e.into_error().into()),
                        },
                    }
                }
                Sender::H2(mut tx, stream) => match tx.try_send_request(req).await {
                    Ok(resp) => {
                        return Ok(resp.map(|body| PooledBody::new(body, None, Some(stream))));
                    }
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

    /// A new connection to the host.
    async fn open(
        &self,
        https: bool,
        authority: &Authority,
        via: &Via,
    ) -> Result<Opened, BoxError> {
        Ok(self
            .connector
            .connect(host_uri(https, authority), via)
            .await?)
    }

    /// The pool slot of a host (added if new), what the pool has for a
    /// request to it, its `Host` header and its route. `alone`: a request
    /// whose shared opening failed opens its own connection.
    fn checkout(&self, https: bool, authority: &Authority, alone: bool) -> Checkout {
        let now = Instant::now();
        let mut hosts = self.hosts();
        let found = hosts
            .iter()
            .position(|h| h.https == https && h.authority.as_str() == authority.as_str());
        let slot = match found {
            Some(i) => i,
            None if hosts.len() < MAX_HOSTS => {
                let via = self.connector.via(&host_uri(https, authority));
                hosts.push(Host::new(https, authority, via));
                hosts.len() - 1
            }
            None => {
                drop(hosts);
                return Checkout {
                    slot: None,
                    found: Found::Open(None),
                    host_header: host_header(https, authority),
                    via: self.connector.via(&host_uri(https, authority)),
                };
            }
        };
        let host = &mut hosts[slot];
        let mut found = host.take(now, &self.bound);
        if alone && let Found::Wait(_) = found {
            found = Found::Open(None);
        }
        Checkout {
            slot: Some(slot),
            found,
            host_header: host.host_header.clone(),
            via: host.via.clone(),
        }
    }

    /// Notes a new connection: the host now known to speak its protocol,
    /// an HTTP/2 connection shared from now on (with a stream taken for
    /// this request); and the pool sweeps from now on.
    fn opened(self: &Arc<Pool>, slot: Slot, opened: Opened) -> Sender {
        let mut hosts = self.hosts();
        let host = slot.and_then(|s| hosts.get_mut(s));
        let sender = match (opened, host) {
            (Opened::H1(tx), host) => {
                if let Some(host) = host {
                    host.speaks = Speaks::H1;
                }
                Sender::H1(tx)
            }
            (Opened::H2(tx, limit), Some(host)) => {
                host.speaks = Speaks::H2;
                let shared = Shared::new(tx, limit, Instant::now());
                // Taken whatever the limit: the connection was opened for
                // this request.
                shared.streams.fetch_add(1, Ordering::AcqRel);
                let sender = Sender::H2(shared.tx.clone(), Stream(shared.streams.clone()));
                host.h2.push(shared);
                sender
            }
            (Opened::H2(tx, _), None) => Sender::H2(tx, Stream(Arc::new(AtomicUsize::new(1)))),
        };
        drop(hosts);
        self.sweep_from_now_on();
        sender
    }

    /// An HTTP/1.1 connection back from a request, its response read.
    fn put(&self, slot: Slot, tx: http1::SendRequest<RequestBody>) {
        let Some(slot) = slot else { return };
        if tx.is_closed() {
            return;
        }
        let mut hosts = self.hosts();
        let Some(host) = hosts.get_mut(slot) else {
            return;
        };
        if host.idle.len() >= MAX_IDLE_PER_HOST {
            host.idle.remove(0);
        } else if !self.bound.take() {
            // As many unused connections as allowed: this one closes.
            return;
        }
        // Read under the lock: the list stays in the order of its times.
        let since = Instant::now();
        host.idle.push(Idle { tx, since });
    }

    /// Drops the connections unused for [`IDLE`], the closed ones, and
    /// extra HTTP/2 ones without streams for [`SWEEP_EVERY`].
    fn sweep(&self, now: Instant) {
        let (Some(cutoff), Some(extra)) = (now.checked_sub(IDLE), now.checked_sub(SWEEP_EVERY))
        else {
            return;
        };
        let gone: usize = self
            .hosts()
            .iter_mut()
            .map(|h| h.sweep(cutoff, extra))
            .sum();
        self.bound.give(gone);
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
    /// and HTTP/2 ones without a stream.
    #[cfg(test)]
    fn unused(&self) -> usize {
        self.hosts()
            .iter()
            .map(|h| h.idle.len() + h.h2.iter().filter(|s| s.streams() == 0).count())
            .sum()
    }

    /// How many of those are still open.
    #[cfg(test)]
    fn unused_open(&self) -> usize {
        self.hosts()
            .iter()
            .map(|h| {
                let h1 = h.idle.iter().filter(|i| !i.tx.is_closed()).count();
                h1 + h
                    .h2
                    .iter()
                    .filter(|s| s.streams() == 0 && !s.tx.is_closed())
                    .count()
            })
            .sum()
    }
}

/// `scheme://authority/` of a host.
fn host_uri(https: bool, authority: &Authority) -> Uri {
    Uri::builder()
        .scheme(if https { Scheme::HTTPS } else { Scheme::HTTP })
        .authority(authority.clone())
        .path_and_query("/")
        .build()
        .unwrap_or_default()
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

/// The request opening a connection others wait for: when it is done (or
/// dropped), the host no longer waits on it and the waiting requests are
/// told.
struct Opener {
    pool: Arc<Pool>,
    slot: Slot,
    opening: Arc<Opening>,
    succeeded: bool,
}

impl Drop for Opener {
    fn drop(&mut self) {
        let mut hosts = self.pool.hosts();
        if let Some(host) = self.slot.and_then(|s| hosts.get_mut(s))
            && host
                .opening
                .as_ref()
                .is_some_and(|o| Arc::ptr_eq(o, &self.opening))
        {
            host.opening = None;
        }
        drop(hosts);
        self.opening.finish(!self.succeeded);
    }
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
    /// Its stream on a shared HTTP/2 connection, in use until the body
    /// is dropped.
    _stream: Option<Stream>,
}

impl PooledBody {
    fn new(body: Incoming, back: Option<Back>, stream: Option<Stream>) -> PooledBody {
        let mut b = PooledBody {
            body,
            back,
            _stream: stream,
        };
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
