//! The response body relay: passes the upstream's bytes to the client as they
//! arrive (never buffering a stream), enforces the idle timeout between
//! chunks, feeds the usage tap, and keeps the in-flight gauge honest: the
//! guard lives inside the stream, so a client that disconnects drops the
//! stream, the guard, and with it the upstream connection. A stream still
//! open when the server's shutdown grace ends is closed the way the API
//! closes a failed one: an error event in its shape, then the body's proper
//! end (the chunked terminator), not a cut connection.
//!
//! With Redis, what the usage teaches is written to the replicas' shared
//! record before the response's last bytes go out (see `shared.rs`): a
//! JSON answer is read for its usage before its last chunk is passed on,
//! a stream's last event (or its end) waits for the write.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::watch;

use super::learn::Background;
use super::learn::UsageCallback;
use super::read::BodyStream;
use super::shared::Pending;
use super::{Proxy, Timing, headers};
use crate::metrics::Metrics;
use crate::upstream::{self, BoxError, Upstream, UpstreamResponse};
use crate::wire::Failure;
use crate::wire::tap::{JsonTap, SseTap};
use crate::wire::usage::Usage;

/// Time between a stream's error event and the body failing.
const FLUSH_BEFORE_ABORT: Duration = Duration::from_millis(20);

/// How a response body is inspected on its way through.
pub enum Tap {
    /// Bytes pass untouched and unread.
    None,
    /// A JSON chat response: a bounded copy is parsed for usage at the end.
    Json(JsonTap),
    /// A streamed chat response: events are read for usage (and filtered).
    Sse(SseTap),
}

impl Tap {
    fn push(&mut self, chunk: Bytes) -> Bytes {
        match self {
            Tap::None => chunk,
            Tap::Json(t) => {
                t.push(&chunk);
                chunk
            }
            Tap::Sse(t) => t.push(chunk),
        }
    }

    fn finish(&mut self) -> Bytes {
        match self {
            Tap::Sse(t) => t.finish(),
            Tap::Json(t) => {
                t.finish();
                Bytes::new()
            }
            Tap::None => Bytes::new(),
        }
    }

    /// What is wrong with the response so far (`ended`: the upstream
    /// finished it), if anything: one of [`crate::metrics::labels::ANOMALIES`].
    fn anomaly(&self, ended: bool) -> Option<&'static str> {
        match self {
            Tap::Json(t) if t.invalid() => Some("invalid_json"),
            Tap::Sse(t) if t.ended() => Some("sse_event_too_long"),
            Tap::Sse(t) if ended && !t.saw_done() => Some("sse_without_done"),
            _ => None,
        }
    }

    /// For a stream, an SSE event that tells the client (and its SDK, which
    /// raises it as an API error) why the stream stops here.
    fn error_event(&mut self, code: &str, message: &str) -> Option<Bytes> {
        let Tap::Sse(t) = self else {
            return None;
        };
        let lead = if t.at_event_boundary() { "" } else { "\n\n" };
        // A finishing chunk held back goes first.
        let mut out = t.take_held().map(Vec::from).unwrap_or_default();
        let failure = Failure {
            kind: "api_error",
            anthropic_kind: "api_error",
            code,
            message,
        };
        let event = format!("{lead}{}", t.api().stream_error(&failure));
        out.extend_from_slice(event.as_bytes());
        Some(Bytes::from(out))
    }

    fn usage(&self) -> Option<Usage> {
        match self {
            Tap::None => None,
            Tap::Json(t) => t.usage(),
            Tap::Sse(t) => t.usage(),
        }
    }
}

/// Counts a request as in flight for as long as it lives.
pub struct InflightGuard(Arc<Metrics>);

impl InflightGuard {
    pub fn new(metrics: Arc<Metrics>) -> InflightGuard {
        metrics.inflight_requests.inc();
        InflightGuard(metrics)
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight_requests.dec();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("the upstream sent nothing for {0:?}")]
    IdleTimeout(Duration),
    #[error("the upstream connection failed mid-body: {0}")]
    Upstream(#[source] BoxError),
}

/// An upstream answer to relay: the upstream's response as it came, or one
/// condense finished reading (the answer after condense's own tool calls).
pub struct Reply {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    pub body: BodyStream,
    /// The body's length, when known.
    pub content_length: Option<u64>,
}

impl From<UpstreamResponse> for Reply {
    fn from(resp: UpstreamResponse) -> Reply {
        let content_length = upstream::content_length(&resp);
        let (parts, body) = resp.into_parts();
        Reply {
            status: parts.status,
            headers: parts.headers,
            content_length,
            body: Box::pin(http_body_util::BodyDataStream::new(body)),
        }
    }
}

impl Reply {
    /// An answer whose whole body condense holds.
    pub fn whole(status: http::StatusCode, mut headers: http::HeaderMap, body: Bytes) -> Reply {
        headers.insert(
            http::header::CONTENT_LENGTH,
            http::HeaderValue::from(body.len()),
        );
        Reply {
            status,
            headers,
            content_length: Some(body.len() as u64),
            body: Box::pin(futures_util::stream::once(async move { Ok(body) })),
        }
    }

    /// `head`, then the rest of the body as it comes: an answer condense
    /// read part of before deciding to pass it on.
    pub fn prefixed(head: Bytes, rest: BodyStream) -> BodyStream {
        Box::pin(futures_util::stream::once(async move { Ok(head) }).chain(rest))
    }

    pub fn is_sse(&self) -> bool {
        self.headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"))
    }
}

struct State {
    upstream: BodyStream,
    /// What reads the body and learns from it.
    settle: Settle,
    idle: Duration,
    done: bool,
    /// An error to end the body with, after the event that announces it.
    failure: Option<RelayError>,
    /// Turns true when the server's shutdown grace is over (streams only).
    cut: Option<watch::Receiver<bool>>,
    _inflight: InflightGuard,
}

/// The tap, and what is done with what it reads: the usage reported, a
/// malformed response counted.
struct Settle {
    tap: Tap,
    on_usage: Option<UsageCallback>,
    metrics: Arc<Metrics>,
    anomaly_counted: bool,
    /// Where the work left for after the answer is counted.
    background: Background,
    /// Whether what the usage teaches must be learned before the answer
    /// ends (with Redis).
    ordered: bool,
    /// A write the answer's last bytes wait for.
    pending: Option<Pending>,
}

impl Settle {
    fn report_usage(&mut self) {
        if self.on_usage.is_some()
            && let Some(usage) = self.tap.usage()
            && let Some(f) = self.on_usage.take()
        {
            self.pending = f(usage);
        }
    }

    /// Whether the bytes about to go out end the answer for the client: a
    /// complete JSON body, a stream's last event.
    fn at_end(&self) -> bool {
        match &self.tap {
            Tap::Json(t) => t.complete(),
            Tap::Sse(t) => t.saw_done(),
            Tap::None => false,
        }
    }

    /// Waits for the write what the usage taught went to, if any.
    async fn written(&mut self) {
        if let Some(p) = self.pending.take() {
            p.await;
        }
    }

    /// Counts a malformed response once.
    fn check(&mut self, ended: bool) {
        if self.anomaly_counted {
            return;
        }
        if let Some(kind) = self.tap.anomaly(ended) {
            self.anomaly_counted = true;
            tracing::warn!(kind, "upstream response is malformed; passed on as it is");
            self.metrics
                .upstream_invalid_responses_total
                .with_label_values(&[kind])
                .inc();
        }
    }

    /// Reads a complete JSON body and learns from it once the connection's
    /// task has written the last bytes to the client (see
    /// [`Background::after_yield`], which `Proxy::settled` waits for):
    /// reading the usage and calibrating took about 7,000 instructions a
    /// small answer between the upstream's last byte and the client's.
    ///
    /// With Redis the answer is read now instead, so that what it teaches
    /// is shared before its last bytes go out.
    fn json_later(&mut self) {
        let Tap::Json(_) = self.tap else {
            return;
        };
        if self.ordered {
            self.end();
            return;
        }
        let mut json = Settle {
            tap: std::mem::replace(&mut self.tap, Tap::None),
            on_usage: self.on_usage.take(),
            metrics: self.metrics.clone(),
            anomaly_counted: self.anomaly_counted,
            background: self.background.clone(),
            ordered: false,
            pending: None,
        };
        self.background.after_yield(move || json.end());
    }

    /// The body is over: what is left in the tap is read and learned from.
    fn end(&mut self) {
        self.tap.finish();
        self.report_usage();
        self.check(true);
    }
}

impl State {
    /// `cause` is one of [`crate::metrics::labels::INTERRUPTION_CAUSES`].
    fn interrupted(&mut self, cause: &str) {
        self.done = true;
        self.settle
            .metrics
            .stream_interruptions_total
            .with_label_values(&[cause])
            .inc();
    }
}

/// Resolves once `cut` turns true; never when its sender is gone.
async fn cut_off(cut: &mut watch::Receiver<bool>) {
    if cut.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The client-facing body for an upstream response. A stream (an SSE tap)
/// ends with an error event once `cut` turns true. With `ordered`, what
/// the usage teaches is learned before the answer's last bytes go out.
#[allow(clippy::too_many_arguments)]
pub fn relay(
    body: BodyStream,
    tap: Tap,
    on_usage: Option<UsageCallback>,
    ordered: bool,
    idle: Duration,
    metrics: Arc<Metrics>,
    inflight: InflightGuard,
    background: &Background,
    cut: &watch::Sender<bool>,
) -> Body {
    let cut = matches!(tap, Tap::Sse(_)).then(|| cut.subscribe());
    let state = State {
        upstream: body,
        settle: Settle {
            tap,
            on_usage,
            metrics,
            anomaly_counted: false,
            background: background.clone(),
            ordered,
            pending: None,
        },
        idle,
        done: false,
        failure: None,
        cut,
        _inflight: inflight,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(e) = st.failure.take() {
                // Let the server flush the error event before the body
                // fails (a failing body aborts the connection at once).
                tokio::time::sleep(FLUSH_BEFORE_ABORT).await;
                return Some((Err(e), st));
            }
            if st.done {
                st.settle.written().await;
                return None;
            }
            let next = tokio::time::timeout(st.idle, st.upstream.next());
            let polled = match st.cut.as_mut() {
                Some(cut) => tokio::select! {
                    biased;
                    () = cut_off(cut) => None,
                    polled = next => Some(polled),
                },
                None => Some(next.await),
            };
            let Some(polled) = polled else {
                st.interrupted("shutdown");
                tracing::warn!("stream still open at the end of the shutdown grace; ending it");
                let message = "condense is shutting down; the stream ends here";
                return st
                    .settle
                    .tap
                    .error_event("shutting_down", message)
                    .map(|event| (Ok(event), st));
            };
            match polled {
                Err(_) => {
                    st.interrupted("idle_timeout");
                    tracing::warn!(idle = ?st.idle, "upstream stream idle too long; cutting it off");
                    let idle = st.idle;
                    let message = format!(
                        "the upstream sent nothing for {idle:?}; condense ended the stream"
                    );
                    if let Some(event) =
                        st.settle.tap.error_event("upstream_idle_timeout", &message)
                    {
                        st.failure = Some(RelayError::IdleTimeout(idle));
                        return Some((Ok(event), st));
                    }
                    return Some((Err(RelayError::IdleTimeout(idle)), st));
                }
                Ok(Some(Ok(chunk))) => {
                    let out = st.settle.tap.push(chunk);
                    match &st.settle.tap {
                        // The server stops polling a body once its
                        // Content-Length went out: the end may never come.
                        Tap::Json(t) if t.complete() => st.settle.json_later(),
                        Tap::Json(_) => {}
                        _ => {
                            st.settle.report_usage();
                            st.settle.check(false);
                        }
                    }
                    if st.settle.at_end() {
                        st.settle.written().await;
                    }
                    if !out.is_empty() {
                        return Some((Ok(out), st));
                    }
                }
                Ok(Some(Err(e))) => {
                    st.interrupted("upstream_error");
                    tracing::warn!(error = %e, "upstream body failed mid-response");
                    let message = "the upstream connection failed mid-stream";
                    if let Some(event) = st
                        .settle
                        .tap
                        .error_event("upstream_stream_interrupted", message)
                    {
                        return Some((Ok(event), st));
                    }
                    return Some((Err(RelayError::Upstream(e)), st));
                }
                Ok(None) => {
                    st.done = true;
                    st.settle.json_later();
                    let rest = st.settle.tap.finish();
                    st.settle.report_usage();
                    st.settle.check(true);
                    st.settle.written().await;
                    if !rest.is_empty() {
                        return Some((Ok(rest), st));
                    }
                    return None;
                }
            }
        }
    });
    Body::from_stream(stream)
}
impl Proxy {
    /// Turns the upstream's response into the client's: same status, same
    /// headers (minus hop-by-hop), body relayed as it arrives.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn respond(
        &self,
        route: &str,
        upstream: &Upstream,
        resp: Reply,
        tap: Tap,
        on_usage: Option<UsageCallback>,
        guard: InflightGuard,
        timing: Timing,
    ) -> Response {
        let headers_at = Instant::now();
        self.metrics
            .upstream_seconds
            .with_label_values(&[route])
            .observe((headers_at - timing.sent).as_secs_f64());
        let status = resp.status;
        let headers = headers::to_client(resp.headers);
        let body = relay(
            resp.body,
            tap,
            on_usage,
            self.shared.is_some(),
            upstream.idle_timeout(),
            self.metrics.clone(),
            guard,
            &self.background,
            &self.streams_end,
        );
        let mut response = Response::new(body);
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        let overhead = (timing.sent - timing.start).saturating_sub(timing.upstream_wait)
            + headers_at.elapsed();
        self.metrics
            .overhead_seconds
            .with_label_values(&[route])
            .observe(overhead.as_secs_f64());
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Format;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A write to the shared record that takes a few turns of the
    /// scheduler, and says when it is done; polled only by whoever waits
    /// for it.
    fn slow_write(done: Arc<AtomicBool>) -> UsageCallback {
        Box::new(move |_| {
            Some(Box::pin(async move {
                for _ in 0..5 {
                    tokio::task::yield_now().await;
                }
                done.store(true, Ordering::SeqCst);
            }))
        })
    }

    /// The frames of `body` in order, each with whether the write was done
    /// when it came out.
    async fn frames(body: Body, done: &AtomicBool) -> Vec<(Bytes, bool)> {
        let mut body = body;
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                out.push((data, done.load(Ordering::SeqCst)));
            }
        }
        out
    }

    fn relayed(chunks: Vec<&'static str>, tap: Tap, on_usage: UsageCallback) -> Body {
        let stream: BodyStream = Box::pin(futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok(Bytes::from_static(c.as_bytes()))),
        ));
        let metrics = Arc::new(Metrics::new().unwrap());
        relay(
            stream,
            tap,
            Some(on_usage),
            true,
            Duration::from_secs(5),
            metrics.clone(),
            InflightGuard::new(metrics),
            &Background::default(),
            &watch::Sender::new(false),
        )
    }

    /// With ordered learning (Redis), the client cannot see an answer end
    /// before what its usage taught is shared: the turn it sends next, on
    /// any replica, is planned with it.
    #[tokio::test]
    async fn with_ordered_learning_the_last_bytes_wait_for_the_write() {
        let api = Format::Chat.api();
        // A JSON answer with its length: its last chunk waits.
        let json = [
            r#"{"id":"c","choices":[{"message":{"role":"assistant","content":"ok"}}],"#,
            r#""usage":{"prompt_tokens":1200,"completion_tokens":1,"total_tokens":1201}}"#,
        ];
        let len = json.iter().map(|c| c.len()).sum::<usize>() as u64;
        let done = Arc::new(AtomicBool::new(false));
        let body = relayed(
            json.to_vec(),
            Tap::Json(JsonTap::new(api, Some(len))),
            slow_write(done.clone()),
        );
        let got = frames(body, &done).await;
        assert_eq!(got.len(), 2);
        assert!(!got[0].1, "the first chunk does not wait");
        assert!(
            got[1].1,
            "the last chunk went out before the write was done"
        );

        // A stream: the usage chunk passes, `[DONE]` waits.
        let sse = [
            "data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1200,\"completion_tokens\":1,\"total_tokens\":1201}}\n\n",
            "data: [DONE]\n\n",
        ];
        let done = Arc::new(AtomicBool::new(false));
        let body = relayed(
            sse.to_vec(),
            Tap::Sse(SseTap::new(api, false)),
            slow_write(done.clone()),
        );
        let got = frames(body, &done).await;
        let end = got
            .iter()
            .position(|(b, _)| b.ends_with(b"data: [DONE]\n\n"))
            .unwrap();
        assert!(got[end].1, "[DONE] went out before the write was done");
    }
}
