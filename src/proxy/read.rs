//! Bounded reads: every body condense reads, from the client or from the
//! upstream, has a size limit, and every client body a deadline.
//!
//! - A client body read whole (chat requests, to be measured and compacted)
//!   must fit `server.max_body_bytes` (413, at once when its
//!   `Content-Length` says so), arrive within `server.body_timeout_seconds`
//!   (408), and find room in the bytes of bodies held at once,
//!   `server.max_buffered_bytes` (503), taken as its bytes arrive. The room
//!   covers every buffer the body is kept in, at every moment, and is held
//!   until the handler lets the body go. A body of unknown length (chunked,
//!   no `Content-Length`) in several chunks needs room for twice its bytes
//!   while it is put together in one piece.
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

use crate::error::ProxyError;
use crate::upstream::{self, BoxError, Outgoing, UpstreamResponse};

/// A response body on its way from the upstream.
pub type BodyStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Bytes, BoxError>> + Send>>;

/// The room for request bodies held in memory at once, counted in KiB.
#[derive(Clone)]
pub struct BodyBudget {
    kib: Arc<Semaphore>,
    max_bytes: u64,
}

/// Room taken in a [`BodyBudget`]; given back when dropped.
#[derive(Default)]
pub struct Held(Option<OwnedSemaphorePermit>);

impl Held {
    /// Gives back the room beyond `bytes`.
    fn keep(&mut self, bytes: u64) {
        let kib = usize::try_from(bytes.div_ceil(1024)).unwrap_or(usize::MAX);
        if let Some(permit) = &mut self.0
            && permit.num_permits() > kib
        {
            drop(permit.split(permit.num_permits() - kib));
        }
    }
}

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
/// The pieces a body of unknown length is gathered in.
const PIECE: usize = 64 * 1024;

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
    let mut gathered = Gathered {
        budget,
        declared,
        limit,
        len: 0,
        kept: Kept::Nothing,
    };
    let mut stream = body.into_data_stream();
    let read = async move {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ProxyError::BadRequestBody(e.to_string()))?;
            if gathered.len + chunk.len() as u64 > limit {
                return Err(ProxyError::BodyTooLarge(limit));
            }
            gathered.push(chunk)?;
        }
        gathered.finish()
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| Err(ProxyError::BodyTimeout(timeout.as_secs_f64())))
}

/// A body's bytes as they arrive, in memory that room in the budget covers
/// at every moment: room for a buffer is taken before it is allocated, and
/// while bytes are copied, both ends hold theirs.
///
/// Room is taken as the bytes come, never for bytes a client only
/// announced: headers claiming 32 MiB that never send them would otherwise
/// hold the whole budget for the body deadline. (The chunk being read is
/// the connection's own read buffer, not counted here.)
struct Gathered<'a> {
    budget: &'a BodyBudget,
    declared: Option<u64>,
    limit: u64,
    len: u64,
    kept: Kept,
}

enum Kept {
    Nothing,
    /// One chunk, as it came (most bodies arrive so), and room for it.
    One(Bytes, Held),
    /// A body of declared length in several chunks: its one buffer,
    /// allocated at that length, so it never moves. Its pages are backed
    /// only as bytes are written into them, and room is taken as they are
    /// (`reserved` bytes of it: doubling while small, then a step at a
    /// time, so few turns on the semaphore and at most a step ahead).
    Declared {
        buf: Vec<u8>,
        room: Held,
        reserved: u64,
        declared: u64,
    },
    /// A body of unknown length in several chunks: pieces of [`PIECE`]
    /// bytes (fewer where the limit is near), each allocated once, then one
    /// copy into a buffer of the body's length. A buffer grown as bytes
    /// come would hold its old and its new allocation at once each time it
    /// moved, twice its room.
    Pieces(Pieces),
}

impl Gathered<'_> {
    fn push(&mut self, chunk: Bytes) -> Result<(), ProxyError> {
        self.len += chunk.len() as u64;
        if self.declared.is_some_and(|d| self.len > d) {
            return Err(ProxyError::BadRequestBody(
                "the body is longer than its Content-Length".to_string(),
            ));
        }
        let budget = self.budget;
        self.kept = match std::mem::replace(&mut self.kept, Kept::Nothing) {
            Kept::Nothing => match self.declared {
                Some(declared) if declared > self.len => {
                    let mut buf = Vec::new();
                    buf.try_reserve_exact(usize::try_from(declared).unwrap_or(usize::MAX))
                        .map_err(|_| overloaded())?;
                    let mut room = Held::default();
                    let reserved = take_ahead(budget, &mut room, 0, self.len, declared)?;
                    buf.extend_from_slice(&chunk);
                    Kept::Declared {
                        buf,
                        room,
                        reserved,
                        declared,
                    }
                }
                _ => {
                    let mut room = Held::default();
                    budget.take(&mut room, chunk.len() as u64)?;
                    Kept::One(chunk, room)
                }
            },
            Kept::One(first, first_room) => {
                let mut pieces = Pieces::default();
                pieces.append(budget, self.limit, &first)?;
                // The first chunk, and its room, go before the next comes in.
                drop((first, first_room));
                pieces.append(budget, self.limit, &chunk)?;
                Kept::Pieces(pieces)
            }
            Kept::Declared {
                mut buf,
                mut room,
                reserved,
                declared,
            } => {
                let reserved = take_ahead(budget, &mut room, reserved, self.len, declared)?;
                buf.extend_from_slice(&chunk);
                Kept::Declared {
                    buf,
                    room,
                    reserved,
                    declared,
                }
            }
            Kept::Pieces(mut pieces) => {
                pieces.append(budget, self.limit, &chunk)?;
                Kept::Pieces(pieces)
            }
        };
        Ok(())
    }

    /// The body whole, with room for its bytes and no more.
    fn finish(self) -> Result<(Bytes, Held), ProxyError> {
        match self.kept {
            Kept::Nothing => Ok((Bytes::new(), Held::default())),
            Kept::One(chunk, room) => Ok((chunk, room)),
            Kept::Declared { buf, mut room, .. } => {
                room.keep(self.len);
                Ok((Bytes::from(buf), room))
            }
            Kept::Pieces(pieces) => {
                // Room for the whole is taken while the pieces still hold
                // theirs: both are in memory until the copy is done.
                let mut room = Held::default();
                self.budget.take(&mut room, self.len)?;
                let mut whole = Vec::new();
                whole
                    .try_reserve_exact(usize::try_from(self.len).unwrap_or(usize::MAX))
                    .map_err(|_| overloaded())?;
                for piece in pieces.pieces {
                    whole.extend_from_slice(&piece);
                }
                Ok((Bytes::from(whole), room))
            }
        }
    }
}

/// Takes room ahead of a body's `len` bytes once they pass the `reserved`
/// room: doubling while small, then a step at a time, never past `cap`.
/// Returns the room now reserved.
fn take_ahead(
    budget: &BodyBudget,
    room: &mut Held,
    reserved: u64,
    len: u64,
    cap: u64,
) -> Result<u64, ProxyError> {
    if len <= reserved {
        return Ok(reserved);
    }
    let want = len.max((reserved * 2).min(len + STEP)).min(cap);
    budget.take(room, want.saturating_sub(reserved))?;
    Ok(want)
}

/// A body gathered in pieces, and the room they hold.
#[derive(Default)]
struct Pieces {
    pieces: Vec<Vec<u8>>,
    /// Bytes allocated for them.
    allocated: u64,
    room: Held,
}

impl Pieces {
    /// Copies `bytes` in, taking room for each new piece before it is
    /// allocated; all pieces together stay within `limit` bytes.
    fn append(
        &mut self,
        budget: &BodyBudget,
        limit: u64,
        mut bytes: &[u8],
    ) -> Result<(), ProxyError> {
        while !bytes.is_empty() {
            match self.pieces.last_mut() {
                Some(piece) if piece.len() < piece.capacity() => {
                    let n = (piece.capacity() - piece.len()).min(bytes.len());
                    piece.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                }
                _ => {
                    let size = (PIECE as u64).min(limit.saturating_sub(self.allocated));
                    if size == 0 {
                        return Err(ProxyError::BodyTooLarge(limit));
                    }
                    budget.take(&mut self.room, size)?;
                    self.pieces
                        .push(Vec::with_capacity(usize::try_from(size).unwrap_or(PIECE)));
                    self.allocated += size;
                }
            }
        }
        Ok(())
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

    /// `total` bytes in chunks of `chunk` bytes.
    fn in_chunks(total: usize, chunk: usize) -> Body {
        let parts: Vec<Result<Bytes, std::io::Error>> = (0..total.div_ceil(chunk))
            .map(|i| {
                let n = chunk.min(total - i * chunk);
                Ok(Bytes::from(vec![b'a' + (i % 26) as u8; n]))
            })
            .collect();
        Body::from_stream(futures_util::stream::iter(parts))
    }

    #[tokio::test]
    async fn a_body_in_many_chunks_keeps_room_for_its_bytes_only() {
        const LEN: usize = 600 * 1024;
        let budget = BodyBudget::new(8 << 20);
        for declared in [None, Some(LEN as u64)] {
            let (b, held) = read_request(
                in_chunks(LEN, 100 * 1024),
                declared,
                1 << 20,
                Duration::from_secs(5),
                &budget,
            )
            .await
            .unwrap();
            assert_eq!(b.len(), LEN);
            assert!(b[..100 * 1024].iter().all(|&c| c == b'a'));
            assert!(b[500 * 1024..].iter().all(|&c| c == b'f'));
            assert_eq!(budget.held_bytes(), LEN as u64, "{declared:?}");
            drop(held);
            assert_eq!(budget.held_bytes(), 0);
        }
    }

    #[tokio::test]
    async fn a_body_of_unknown_length_is_put_together_within_the_budget() {
        const LEN: usize = 1 << 20;
        let read = |budget: u64, declared: Option<u64>| async move {
            let budget = BodyBudget::new(budget);
            let r = read_request(
                in_chunks(LEN, 64 * 1024),
                declared,
                LEN as u64,
                Duration::from_secs(5),
                &budget,
            )
            .await
            .map(|(b, _)| b.len());
            assert_eq!(budget.held_bytes(), 0);
            r
        };
        // Its pieces and the whole they are copied into are in memory at
        // once, and so is their room.
        assert_eq!(read(2 * LEN as u64, None).await.unwrap(), LEN);
        let short = read(2 * LEN as u64 - 1024, None).await;
        assert!(matches!(short, Err(ProxyError::Overloaded(_))));
        // A body that declares its length is read into one buffer.
        assert_eq!(read(LEN as u64, Some(LEN as u64)).await.unwrap(), LEN);
    }

    #[tokio::test]
    async fn a_body_longer_than_it_declared_is_refused() {
        let budget = BodyBudget::new(1 << 20);
        for chunk in [10, 3] {
            let r = read_request(
                in_chunks(10, chunk),
                Some(5),
                100,
                Duration::from_secs(5),
                &budget,
            )
            .await;
            assert!(matches!(r, Err(ProxyError::BadRequestBody(_))), "{chunk}");
            assert_eq!(budget.held_bytes(), 0);
        }
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
