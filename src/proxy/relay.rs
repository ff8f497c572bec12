//! The response body relay: passes the upstream's bytes to the client as they
//! arrive (never buffering a stream), enforces the idle timeout between
//! chunks, feeds the usage tap, and keeps the in-flight gauge honest: the
//! guard lives inside the stream, so a client that disconnects drops the
//! stream, the guard, and with it the upstream connection.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use super::usage::{JsonTap, SseTap, Usage};
use crate::metrics::Metrics;

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

    fn usage(&self) -> Option<Usage> {
        match self {
            Tap::None => None,
            Tap::Json(t) => t.usage(),
            Tap::Sse(t) => t.usage(),
        }
    }
}

/// Called once with the usage the response reported.
pub type UsageCallback = Box<dyn FnOnce(Usage) + Send>;

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
    Upstream(#[from] reqwest::Error),
}

type Upstream = Pin<Box<dyn Stream<Item = Result<Bytes, reqwest::Error>> + Send>>;

struct State {
    upstream: Upstream,
    tap: Tap,
    on_usage: Option<UsageCallback>,
    idle: Duration,
    metrics: Arc<Metrics>,
    done: bool,
    _inflight: InflightGuard,
}

impl State {
    fn report_usage(&mut self) {
        if self.on_usage.is_some()
            && let Some(usage) = self.tap.usage()
            && let Some(f) = self.on_usage.take()
        {
            f(usage);
        }
    }

    fn interrupted(&mut self, cause: &str) {
        self.done = true;
        self.metrics
            .stream_interruptions_total
            .with_label_values(&[cause])
            .inc();
    }
}

/// The client-facing body for an upstream response.
pub fn relay(
    response: reqwest::Response,
    tap: Tap,
    on_usage: Option<UsageCallback>,
    idle: Duration,
    metrics: Arc<Metrics>,
    inflight: InflightGuard,
) -> Body {
    let state = State {
        upstream: Box::pin(response.bytes_stream()),
        tap,
        on_usage,
        idle,
        metrics,
        done: false,
        _inflight: inflight,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            match tokio::time::timeout(st.idle, st.upstream.next()).await {
                Err(_) => {
                    st.interrupted("idle_timeout");
                    tracing::warn!(idle = ?st.idle, "upstream stream idle too long; cutting it off");
                    let idle = st.idle;
                    return Some((Err(RelayError::IdleTimeout(idle)), st));
                }
                Ok(Some(Ok(chunk))) => {
                    let out = st.tap.push(chunk);
                    st.report_usage();
                    if !out.is_empty() {
                        return Some((Ok(out), st));
                    }
                }
                Ok(Some(Err(e))) => {
                    st.interrupted("upstream_error");
                    tracing::warn!(error = %e, "upstream body failed mid-response");
                    return Some((Err(RelayError::Upstream(e)), st));
                }
                Ok(None) => {
                    st.done = true;
                    let rest = st.tap.finish();
                    st.report_usage();
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
