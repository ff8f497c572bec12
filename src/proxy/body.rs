//! Bounded reads: every body condense reads, from the client or from the
//! upstream, has a size limit, and every client body a deadline.
//!
//! - A client body read whole (chat requests, to be measured and compacted)
//!   must fit `server.max_body_bytes` (413, at once when its
//!   `Content-Length` says so), arrive within `server.body_timeout_seconds`
//!   (408), and find room in the bytes of bodies held at once,
//!   `server.max_buffered_bytes` (503), taken as its bytes arrive. The room
//!   is held until the handler lets the body go.
//! - A client body streamed upstream unread (passthrough routes) has the
//!   same size limit and deadline; when it fails, the client learns whose
//!   fault it was (413, 408, or 400 for a malformed body) rather than a 502.
//!   The upstream's first-byte timeout starts only once the body is sent:
//!   until then the client is the one keeping the upstream waiting.
//! - An upstream body condense reads itself (an error body it inspects for
//!   overflow, a model listing, a summarizer answer) is read up to a limit;
//!   an error body over it is passed on unread.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::HeaderMap;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;

use super::relay::BodyStream;
use super::upstream::{self, BoxError, Outgoing, UpstreamResponse};
use crate::error::ProxyError;

/// The room for request bodies held in memory at once, counted in KiB.
#[derive(Clone)]
pub struct BodyBudget {
    kib: Arc<Semaphore>,
    max_bytes: u64,
}

/// Room taken in a [`BodyBudget`]; given back when dropped.
pub struct Held(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

impl BodyBudget {
    pub fn new(max_bytes: u64) -> BodyBudget {
        let kib = usize::try_from(max_bytes.div_ceil(1024))
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        BodyBudget {
            kib: Arc::new(Semaphore::new(kib)),
            max_bytes,
        }
    }

    /// Bytes of bodies held now.
    pub fn held_bytes(&self) -> u64 {
        let free = self.kib.available_permits() as u64 * 1024;
        self.max_bytes.saturating_sub(free)
    }

    /// Takes room for `bytes` more, without waiting: a body that finds none
    /// is refused at once rather than queued holding what it has.
    fn take(&self, held: &mut Held, bytes: u64) -> Result<(), ProxyError> {
        let kib = u32::try_from(bytes.div_ceil(1024)).map_err(|_| overloaded())?;
        if kib == 0 {
            return Ok(());
        }
        let permit = self
            .kib
            .clone()
            .try_acquire_many_owned(kib)
            .map_err(|_| overloaded())?;
        match &mut held.0 {
            Some(p) => p.merge(permit),
            None => held.0 = Some(permit),
        }
        Ok(())
    }
}

fn overloaded() -> ProxyError {
    ProxyError::Overloaded("request bodies held in memory are at server.max_buffered_bytes")
}

/// The `Content-Length` a request declares.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The most room taken for a body beyond its bytes so far.
const STEP: u64 = 1 << 20;

/// Reads a whole client body within `limit` bytes, `timeout` and the
/// `budget`; returns it with the room it holds.
pub async fn read_request(
    body: Body,
    declared: Option<u64>,
    limit: u64,
    timeout: Duration,
    budget: &BodyBudget,
) -> Result<(Bytes, Held), ProxyError> {
    if declared.is_some_and(|n| n > limit) {
        return Err(ProxyError::BodyTooLarge(limit));
    }
    let mut held = Held(None);
    // Room is taken as the bytes come, never for bytes a client only
    // announced: headers claiming 32 MiB that never send them would
    // otherwise hold the whole budget for the body deadline. A body that
    // arrives in one chunk (most do) is kept as it came; one in several
    // chunks is copied into a buffer grown exactly to the room taken (never
    // doubled), so what is held stays within a step of the bytes received.
    let mut first: Option<Bytes> = None;
    let mut buf: Vec<u8> = Vec::new();
    let mut len = 0u64;
    let mut reserved = 0u64;
    let mut stream = body.into_data_stream();
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ProxyError::BadRequestBody(e.to_string()))?;
            len += chunk.len() as u64;
            if len > limit {
                return Err(ProxyError::BodyTooLarge(limit));
            }
            if len > reserved {
                // Doubling while small, then a step at a time: few turns on
                // the semaphore, and at most a step held beyond the bytes.
                let want = len.max((reserved * 2).min(len + STEP)).min(limit);
                budget.take(&mut held, want - reserved)?;
                reserved = want;
            }
            match first.take() {
                None if buf.is_empty() => first = Some(chunk),
                earlier => {
                    let room = usize::try_from(reserved).unwrap_or(usize::MAX);
                    buf.reserve_exact(room.saturating_sub(buf.len()));
                    if let Some(earlier) = earlier {
                        buf.extend_from_slice(&earlier);
                    }
                    buf.extend_from_slice(&chunk);
                }
            }
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(())) => Ok((first.unwrap_or_else(|| Bytes::from(buf)), held)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ProxyError::BodyTimeout(timeout.as_secs_f64())),
    }
}

/// A client body streamed upstream, as its handler sees it: when it is
/// done with (the upstream's first-byte clock starts then), and why it
/// failed, if it did, for the error the client gets.
pub struct Upload {
    fault: Arc<AtomicU8>,
    /// Closed (its sender dropped) once the body has ended, failed, or been
    /// let go of; nothing is ever sent on it.
    done: watch::Receiver<()>,
    deadline: Instant,
}

const FAULT_TOO_LARGE: u8 = 1;
const FAULT_TIMEOUT: u8 = 2;
const FAULT_CLIENT: u8 = 3;

impl Upload {
    /// Resolves once the body is sent whole, has failed or was let go of,
    /// or at its deadline (an upstream that stops reading it never lets the
    /// deadline be checked).
    pub async fn sent(&self) {
        let mut done = self.done.clone();
        let closed = async { while done.changed().await.is_ok() {} };
        let _ = tokio::time::timeout_at(self.deadline, closed).await;
    }

    /// The client's error for a failed upstream exchange, when the client
    /// body is what failed; `otherwise` when it is not.
    pub fn or(&self, limit: u64, timeout: Duration, otherwise: ProxyError) -> ProxyError {
        match self.fault.load(Ordering::Relaxed) {
            FAULT_TOO_LARGE => ProxyError::BodyTooLarge(limit),
            FAULT_TIMEOUT => ProxyError::BodyTimeout(timeout.as_secs_f64()),
            FAULT_CLIENT => {
                ProxyError::BadRequestBody("the request body ended malformed".to_string())
            }
            _ => otherwise,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed: {0}")]
struct ClientBodyError(&'static str);

/// Streams a client body upstream, failing it once it passes `limit` bytes,
/// takes longer than `timeout`, or breaks (and recording which).
pub fn streamed_request(body: Body, limit: u64, timeout: Duration) -> (Outgoing, Upload) {
    let deadline = Instant::now() + timeout;
    let fault = Arc::new(AtomicU8::new(0));
    let (done, done_rx) = watch::channel(());
    // `done` lives in the stream's state: it is dropped when the stream
    // ends, fails, or is dropped itself.
    let start = Some((body.into_data_stream(), 0u64, done));
    let failed = fault.clone();
    let stream = futures_util::stream::unfold(start, move |state| {
        let fault = failed.clone();
        async move {
            let (mut body, mut seen, done) = state?;
            // After a failure the stream ends (state None).
            let fail = |code: u8, why: &'static str| {
                fault.store(code, Ordering::Relaxed);
                let e: BoxError = Box::new(ClientBodyError(why));
                Some((Err(e), None))
            };
            match tokio::time::timeout_at(deadline, body.next()).await {
                Err(_) => fail(FAULT_TIMEOUT, "deadline passed"),
                Ok(None) => None,
                Ok(Some(Err(_))) => fail(FAULT_CLIENT, "malformed"),
                Ok(Some(Ok(chunk))) => {
                    seen += chunk.len() as u64;
                    if seen > limit {
                        fail(FAULT_TOO_LARGE, "over the limit")
                    } else {
                        Some((Ok(chunk), Some((body, seen, done))))
                    }
                }
            }
        }
    });
    let frames = stream.map(|chunk| chunk.map(http_body::Frame::data));
    let upload = Upload {
        fault,
        done: done_rx,
        deadline,
    };
    (
        Outgoing::Streamed(http_body_util::StreamBody::new(frames).boxed_unsync()),
        upload,
    )
}

/// What reading an upstream body up to a limit gave.
pub enum Limited {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// The body passed the limit (or stalled): what was read, and the rest
    /// unread.
    Over { head: Bytes, rest: BodyStream },
}

/// Reads an upstream response body up to `limit` bytes. With `idle`, a
/// body that stalls longer than that between two chunks is not waited for:
/// it comes back as [`Limited::Over`], for a relay to pass on (under its own
/// idle timeout).
pub async fn read_upstream(
    resp: UpstreamResponse,
    limit: usize,
    idle: Option<Duration>,
) -> Result<Limited, BoxError> {
    let mut stream: BodyStream = Box::pin(http_body_util::BodyDataStream::new(resp.into_body()));
    let mut buf = BytesMut::new();
    loop {
        let next = match idle {
            Some(idle) => match tokio::time::timeout(idle, stream.next()).await {
                Ok(next) => next,
                Err(_) => break,
            },
            None => stream.next().await,
        };
        let Some(chunk) = next else {
            return Ok(Limited::Whole(buf.freeze()));
        };
        buf.extend_from_slice(&chunk?);
        if buf.len() > limit {
            break;
        }
    }
    Ok(Limited::Over {
        head: buf.freeze(),
        rest: stream,
    })
}

/// Reads an upstream body whole when it fits `limit` bytes; None when it
/// does not (or fails).
pub async fn read_upstream_whole(resp: UpstreamResponse, limit: usize) -> Option<Bytes> {
    if upstream::content_length(&resp).is_some_and(|n| n > limit as u64) {
        return None;
    }
    match read_upstream(resp, limit, None).await {
        Ok(Limited::Whole(b)) => Some(b),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(parts: Vec<&'static [u8]>) -> Body {
        let s = futures_util::stream::iter(
            parts
                .into_iter()
                .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p))),
        );
        Body::from_stream(s)
    }

    #[tokio::test]
    async fn a_body_is_read_whole_within_its_limits_and_its_room_is_given_back() {
        let budget = BodyBudget::new(64 * 1024);
        let (b, held) = read_request(
            chunked(vec![b"hello ", b"world"]),
            None,
            1000,
            Duration::from_secs(5),
            &budget,
        )
        .await
        .unwrap();
        assert_eq!(&b[..], b"hello world");
        assert!(budget.held_bytes() > 0);
        drop(held);
        assert_eq!(budget.held_bytes(), 0);
        let over = read_request(
            chunked(vec![b"0123456789"]),
            None,
            5,
            Duration::from_secs(5),
            &budget,
        )
        .await;
        assert!(matches!(over, Err(ProxyError::BodyTooLarge(5))));
        let declared =
            read_request(Body::empty(), Some(6), 5, Duration::from_secs(5), &budget).await;
        assert!(matches!(declared, Err(ProxyError::BodyTooLarge(5))));
    }

    #[tokio::test]
    async fn bodies_beyond_the_room_are_refused_at_once() {
        let budget = BodyBudget::new(10 * 1024);
        let first = read_request(
            Body::from(vec![b'x'; 6 * 1024]),
            Some(6 * 1024),
            1 << 20,
            Duration::from_secs(5),
            &budget,
        )
        .await
        .unwrap();
        let second = read_request(
            Body::from(vec![b'x'; 6 * 1024]),
            Some(6 * 1024),
            1 << 20,
            Duration::from_secs(5),
            &budget,
        )
        .await;
        assert!(matches!(second, Err(ProxyError::Overloaded(_))));
        drop(first);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_ends_times_out() {
        let budget = BodyBudget::new(1 << 20);
        let never =
            Body::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>());
        let r = read_request(never, None, 100, Duration::from_secs(60), &budget).await;
        assert!(matches!(r, Err(ProxyError::BodyTimeout(_))));
        assert_eq!(budget.held_bytes(), 0);
    }
}
