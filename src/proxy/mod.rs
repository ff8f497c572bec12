//! The forwarding path: from a client request to the upstream and back.
//!
//! Two handlers share it. `passthrough` streams any request to the upstream
//! and its response back, untouched. `chat` reads a chat-completions body,
//! parses it losslessly, prepares it (today: asks streams for usage), forwards
//! it, and taps usage from the response on the way back.

pub mod auth;
pub mod body;
pub mod headers;
pub mod learn;
pub mod listing;
pub mod relay;
pub mod upstream;
pub mod usage;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, Request, header};

use crate::cache::{Bounded, PreHashed, one};
use crate::chat::ChatRequest;
use crate::compaction::Replacement;
use crate::config::CompactionConfig;
use crate::config::Config;
use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::overflow;
use crate::pipeline;
use crate::state::{StateError, StateStore};
use crate::summary::Summarizer;
use crate::summary::client::CallError;
use crate::tokens::{ModelInfo, TokenService, pair_key};
use auth::Credentials;
use body::{BodyBudget, StreamFault};
use learn::{Background, Learner, Sent};
use listing::ListingFetcher;
use relay::{InflightGuard, Tap, UsageCallback};
use upstream::{Upstream, UpstreamError};
use usage::{JsonTap, SseTap};

/// Chat bodies with at least this many bytes of messages not seen before are
/// measured on the blocking pool.
const BLOCKING_PREPARE_BYTES: usize = 128 * 1024;

/// Statuses an overflow error can come with.
const OVERFLOW_STATUSES: &[u16] = &[400, 413, 429];
/// How often a replica looks for a window another one learned.
const SHARED_WINDOW_CHECK: Duration = Duration::from_secs(60);
/// Error bodies larger than this are not read for overflow detection.
const MAX_ERROR_BODY: usize = 1 << 20;

/// The state-store key of a window learned from an overflow.
fn window_key(upstream: &str, model: &str) -> String {
    let h = xxhash_rust::xxh3::xxh3_128(format!("{upstream}\0{model}").as_bytes());
    format!("window:{h:032x}")
}

/// Route labels for metrics and logs.
pub const ROUTE_CHAT: &str = "chat_completions";
pub const ROUTE_PASSTHROUGH: &str = "passthrough";

pub struct Proxy {
    pub upstream: Upstream,
    pub credentials: Credentials,
    pub metrics: Arc<Metrics>,
    pub tokens: Arc<TokenService>,
    listing: ListingFetcher,
    /// Slots for measuring large bodies on the blocking pool, one per core.
    prepare_slots: Arc<tokio::sync::Semaphore>,
    compaction: CompactionConfig,
    /// None when `summary.enabled` is false.
    summarizer: Option<Summarizer>,
    pub state: Arc<StateStore>,
    /// When each model's shared learned window was last looked up.
    window_checks: Bounded<u64, Instant, PreHashed>,
    max_body_bytes: u64,
    body_timeout: Duration,
    /// Room for request bodies read whole.
    pub bodies: BodyBudget,
    /// Work done off the request path.
    background: Background,
    stream_usage: bool,
    learn_windows: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("cannot set up the summarizer: {0}")]
    Summarizer(#[from] CallError),
}

/// Timestamps that split a request's time between condense and the upstream.
struct Timing {
    start: Instant,
    sent: Instant,
    /// Time before `sent` spent waiting on the upstream for something else
    /// (the `/models` listing).
    upstream_wait: Duration,
}

/// A chat request ready to forward.
struct Prepared {
    body: Bytes,
    model: Option<String>,
    strip_usage: bool,
    /// What the response headers report; None when condense did not measure.
    report: Option<Report>,
}

/// What condense measured and did, for the response headers.
#[derive(Clone)]
struct Report {
    tokens_before: u64,
    tokens_after: u64,
    actions: String,
    /// The raw count of the body sent, for calibration (None on the cheap
    /// path).
    raw_after: Option<u64>,
}

impl Prepared {
    fn unchanged(body: Bytes, model: Option<String>) -> Prepared {
        Prepared {
            body,
            model,
            strip_usage: false,
            report: None,
        }
    }
}

/// Response headers that tell the client what condense did.
pub const X_TOKENS_BEFORE: HeaderName = HeaderName::from_static("x-condense-tokens-before");
pub const X_TOKENS_AFTER: HeaderName = HeaderName::from_static("x-condense-tokens-after");
pub const X_ACTIONS: HeaderName = HeaderName::from_static("x-condense-actions");

impl Proxy {
    pub fn new(config: Arc<Config>, metrics: Arc<Metrics>) -> Result<Proxy, SetupError> {
        let upstream = Upstream::new(&config.upstream)?;
        Proxy::with_upstream(config, metrics, upstream)
    }

    /// A proxy in front of `upstream` (a simulated one, for `condense
    /// replay`).
    pub fn with_upstream(
        config: Arc<Config>,
        metrics: Arc<Metrics>,
        upstream: Upstream,
    ) -> Result<Proxy, SetupError> {
        let state = Arc::new(StateStore::new(&config.state, Some(metrics.clone()))?);
        let summarizer = if config.summary.enabled {
            Some(Summarizer::new(
                &config.summary,
                upstream.base_url(),
                state.clone(),
                Some(metrics.clone()),
            )?)
        } else {
            None
        };
        Ok(Proxy {
            upstream,
            summarizer,
            state,
            window_checks: Bounded::hashed(4096, 4096, one),
            credentials: Credentials::new(&config.auth, config.upstream.api_key.as_ref()),
            tokens: Arc::new(TokenService::new(config.clone(), &metrics)),
            metrics,
            listing: ListingFetcher::default(),
            prepare_slots: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            compaction: config.compaction.clone(),
            max_body_bytes: config.server.max_body_bytes,
            body_timeout: Duration::from_secs_f64(config.server.body_timeout_seconds),
            bodies: BodyBudget::new(config.server.max_buffered_bytes),
            background: Background::default(),
            stream_usage: config.upstream.stream_usage,
            learn_windows: config.upstream.learn_windows,
        })
    }

    /// Any request condense does not handle itself: streamed to the upstream
    /// and back unchanged (apart from hop-by-hop headers and credentials).
    pub async fn passthrough(&self, req: Request<Body>) -> Response {
        let start = Instant::now();
        self.passthrough_inner(req, start)
            .await
            .unwrap_or_else(|e| self.fail(ROUTE_PASSTHROUGH, e))
    }

    async fn passthrough_inner(
        &self,
        req: Request<Body>,
        start: Instant,
    ) -> Result<Response, ProxyError> {
        let (parts, body) = req.into_parts();
        // CONNECT would make the upstream a tunnel; TRACE echoes the request
        // back, credentials condense added included.
        if matches!(parts.method, http::Method::CONNECT | http::Method::TRACE) {
            return Err(ProxyError::MethodNotAllowed(parts.method));
        }
        let url = self.upstream.url_for(parts.uri.path(), parts.uri.query())?;
        if body::content_length(&parts.headers).is_some_and(|n| n > self.max_body_bytes) {
            return Err(ProxyError::BodyTooLarge(self.max_body_bytes));
        }
        let mut headers = headers::to_upstream(&parts.headers, true);
        self.credentials.apply(&mut headers);
        let fault = StreamFault::default();
        let body = if axum::body::HttpBody::size_hint(&body).exact() == Some(0) {
            None
        } else {
            Some(body::streamed_request(
                body,
                self.max_body_bytes,
                self.body_timeout,
                fault.clone(),
            ))
        };
        let guard = InflightGuard::new(self.metrics.clone());
        let sent = Instant::now();
        let resp = self
            .upstream
            .send(parts.method, url, headers, body)
            .await
            .map_err(|e| fault.or(self.max_body_bytes, self.body_timeout, e))?;
        Ok(self.respond(
            ROUTE_PASSTHROUGH,
            resp,
            Tap::None,
            None,
            guard,
            Timing {
                start,
                sent,
                upstream_wait: Duration::ZERO,
            },
        ))
    }

    /// `POST /v1/chat/completions`.
    pub async fn chat(self: Arc<Self>, req: Request<Body>) -> Response {
        let start = Instant::now();
        // What condense measured, kept for the response headers even when
        // sending fails: condense's own errors say what it did too.
        let mut report = None;
        let mut response = self
            .chat_inner(req, start, &mut report)
            .await
            .unwrap_or_else(|e| self.fail(ROUTE_CHAT, e));
        let h = response.headers_mut();
        match report {
            Some(r) => {
                h.insert(X_TOKENS_BEFORE, HeaderValue::from(r.tokens_before));
                h.insert(X_TOKENS_AFTER, HeaderValue::from(r.tokens_after));
                h.insert(
                    X_ACTIONS,
                    HeaderValue::from_str(&r.actions).unwrap_or(HeaderValue::from_static("none")),
                );
            }
            None => {
                h.insert(X_ACTIONS, HeaderValue::from_static("none"));
            }
        }
        response
    }

    async fn chat_inner(
        self: &Arc<Self>,
        req: Request<Body>,
        start: Instant,
        report: &mut Option<Report>,
    ) -> Result<Response, ProxyError> {
        let (parts, body) = req.into_parts();
        let url = self.upstream.url_for(parts.uri.path(), parts.uri.query())?;
        // `held` keeps the body's room in the budget until the response is
        // on its way (or, when it is counted after it, until counted).
        let (bytes, held) = body::read_request(
            body,
            body::content_length(&parts.headers),
            self.max_body_bytes,
            self.body_timeout,
            &self.bodies,
        )
        .await?;
        let opt_out = parts
            .headers
            .get(headers::X_CONDENSE)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"off"));

        let mut headers = headers::to_upstream(&parts.headers, false);
        self.credentials.apply(&mut headers);
        // The usage tap reads the response, so ask for it uncompressed.
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );

        let mut upstream_wait = Duration::ZERO;
        let prepared = match ChatRequest::parse(&bytes) {
            Ok(chat) if !opt_out => {
                let model = chat.model().unwrap_or_default();
                if self.learn_windows && !model.is_empty() {
                    upstream_wait = self
                        .listing
                        .ensure(&self.upstream, &self.tokens.listings, &model, &headers)
                        .await;
                }
                self.shared_window(&model).await;
                let info = self.tokens.model_info(self.upstream.base_url(), &model);
                let measured = if bytes.len() >= BLOCKING_PREPARE_BYTES
                    && self.tokens.uncached_bytes(&chat, info.encoding) >= BLOCKING_PREPARE_BYTES
                {
                    let (this, body, name) = (self.clone(), bytes.clone(), model.clone());
                    self.off_workers(move || this.measure_or_forward(chat, &body, &name, info))
                        .await
                        .unwrap_or_else(|| Err(Prepared::unchanged(bytes.clone(), None)))
                } else {
                    self.measure_or_forward(chat, &bytes, &model, info)
                };
                match measured {
                    Ok(p) => self.complete(p, &bytes, model, &headers).await,
                    Err(unchanged) => unchanged,
                }
            }
            Ok(chat) => Prepared::unchanged(bytes.clone(), chat.model()),
            // Not a chat request condense understands: the upstream judges it.
            Err(e) => {
                tracing::debug!(error = %e, "chat body not parsed; forwarding unchanged");
                Prepared::unchanged(bytes.clone(), None)
            }
        };

        report.clone_from(&prepared.report);
        let guard = InflightGuard::new(self.metrics.clone());
        let sent = Instant::now();
        // A request condense measured can be recovered from an overflow.
        let retry = prepared
            .report
            .is_some()
            .then(|| (parts.method.clone(), url.clone(), headers.clone()));
        let resp = self
            .upstream
            .send(
                parts.method,
                url,
                headers,
                Some(reqwest::Body::from(prepared.body.clone())),
            )
            .await?;
        let (resp, mut prepared) = match retry {
            Some(retry) if OVERFLOW_STATUSES.contains(&resp.status().as_u16()) => {
                self.recover(resp, prepared, &bytes, retry).await?
            }
            _ => (resp, prepared),
        };
        *report = prepared.report.take();

        let is_sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let tap = match (resp.status().is_success(), is_sse) {
            (false, _) => Tap::None,
            (true, true) => Tap::Sse(SseTap::new(prepared.strip_usage)),
            (true, false) => Tap::Json(JsonTap::new(resp.content_length())),
        };
        let learner = prepared.model.map(|model| Learner {
            metrics: self.metrics.clone(),
            tokens: self.tokens.clone(),
            upstream: self.upstream.base_url().to_string(),
            model,
        });
        let counted = match (&learner, report.as_ref().and_then(|r| r.raw_after)) {
            (_, Some(raw)) => Sent::Counted(raw),
            (Some(l), None) if resp.status().is_success() => l.count_later(
                prepared.body.clone(),
                held,
                &self.prepare_slots,
                &self.background,
            ),
            _ => Sent::Unknown,
        };
        let on_usage = learner.map(|l| l.on_usage(counted));
        let mut response = self.respond(
            ROUTE_CHAT,
            resp,
            tap,
            on_usage,
            guard,
            Timing {
                start,
                sent,
                upstream_wait,
            },
        );
        let h = response.headers_mut();
        if prepared.strip_usage {
            h.remove(header::CONTENT_LENGTH);
        }
        Ok(response)
    }

    /// Picks up a window another replica learned from an overflow (through
    /// Redis), checking each model at most once a minute.
    async fn shared_window(&self, model: &str) {
        if self.state.kind() != "redis" || model.is_empty() {
            return;
        }
        let upstream = self.upstream.base_url();
        let key = pair_key(upstream, model);
        let now = Instant::now();
        let due = self
            .window_checks
            .get(&key)
            .is_none_or(|at| now.duration_since(at) >= SHARED_WINDOW_CHECK);
        if !due {
            return;
        }
        self.window_checks.insert(key, now);
        if let Some(window) = self
            .state
            .get(&window_key(upstream, model))
            .await
            .and_then(|v| v.parse::<u64>().ok())
        {
            self.tokens.overflows.set(upstream, model, window);
        }
    }

    /// Handles an error response to a measured chat request: when it says
    /// the context overflowed, learns the window (and the provider's count),
    /// compacts the client's original request against it, and sends that
    /// once. Returns the response for the client (the retry's, or the
    /// upstream's error unchanged) and what was sent.
    async fn recover(
        &self,
        resp: reqwest::Response,
        prepared: Prepared,
        original: &Bytes,
        (method, url, headers): (http::Method, url::Url, HeaderMap),
    ) -> Result<(reqwest::Response, Prepared), ProxyError> {
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_ERROR_BODY as u64)
        {
            return Ok((resp, prepared));
        }
        let status = resp.status();
        let version = resp.version();
        let resp_headers = resp.headers().clone();
        let read = body::read_upstream(resp, MAX_ERROR_BODY, Some(self.upstream.idle_timeout))
            .await
            .map_err(|e| {
                ProxyError::UpstreamUnreachable(format!(
                    "reading the error body: {}",
                    e.without_url()
                ))
            })?;
        let body = match read {
            body::Limited::Whole(b) => b,
            // Too long to be an overflow error (or stalled): passed on as it
            // is, the bytes read first and then the rest as it comes.
            body::Limited::Over { head, rest } => {
                let whole = futures_util::stream::once(async move { Ok(head) }).chain(rest);
                let mut r = http::Response::new(reqwest::Body::wrap_stream(whole));
                *r.status_mut() = status;
                *r.version_mut() = version;
                *r.headers_mut() = resp_headers;
                return Ok((reqwest::Response::from(r), prepared));
            }
        };
        let unchanged = || {
            let mut r = http::Response::new(body.clone());
            *r.status_mut() = status;
            *r.version_mut() = version;
            *r.headers_mut() = resp_headers.clone();
            reqwest::Response::from(r)
        };
        let Some(o) = overflow::detect(status.as_u16(), &body) else {
            return Ok((unchanged(), prepared));
        };
        let model = prepared.model.clone().unwrap_or_default();
        let count = |outcome: &str| {
            self.metrics
                .context_overflow_total
                .with_label_values(&[o.format, outcome])
                .inc();
        };
        let upstream = self.upstream.base_url();
        tracing::info!(
            model = crate::logging::clip(&model),
            format = o.format,
            limit = ?o.limit,
            prompt = ?o.prompt,
            "upstream context overflow"
        );
        let encoding = self.tokens.model_info(upstream, &model).encoding;
        let calibrated = prepared.report.as_ref().map_or(0, |r| r.tokens_after);
        // The ratio the rejected body was estimated with, before this
        // overflow's own observation moves it.
        let ratio = self.tokens.calibration.ratio(upstream, &model);
        let Some((rejected, requested)) = self
            .measure_rejected(&prepared.body, encoding, calibrated, ratio)
            .await
        else {
            count("not_recoverable");
            return Ok((unchanged(), prepared));
        };
        // The window as the error names it, learned and shared. An error
        // without it still bounds the window by what was just rejected (the
        // prompt as the provider counted it, or as condense estimates it,
        // plus the completion asked for); without that, a provider whose
        // errors carry no numbers would reject every later request of the
        // conversation once. condense's estimate may be low, so that bound
        // stays in process and expires.
        if let Some(limit) = o.limit {
            self.tokens.overflows.set(upstream, &model, limit);
            self.state
                .put(&window_key(upstream, &model), &limit.to_string())
                .await;
        } else {
            let bound = o
                .prompt
                .unwrap_or(calibrated)
                .saturating_add(requested.unwrap_or(0));
            if bound > 0 {
                self.tokens.bounds.set(upstream, &model, bound);
            }
        }
        let mut info = self.tokens.model_info(upstream, &model);
        if let Some(p) = o.prompt {
            self.tokens
                .calibration
                .observe(upstream, &model, p, rejected.raw);
        }
        info.correction = Some(o.correction(&rejected));

        let Some(retry) = self.prepare_retry(original, &model, info, &headers).await else {
            count("not_recoverable");
            return Ok((unchanged(), prepared));
        };
        let resp = self
            .upstream
            .send(
                method,
                url,
                headers,
                Some(reqwest::Body::from(retry.body.clone())),
            )
            .await?;
        count(if resp.status().is_success() {
            "recovered"
        } else {
            "failed"
        });
        Ok((resp, retry))
    }

    /// condense's measure of a body the provider rejected (counted now
    /// where the cheap path did not; off the async workers when it is
    /// large, as on the way in), and the completion it asked for.
    async fn measure_rejected(
        &self,
        body: &Bytes,
        encoding: crate::tokens::Encoding,
        calibrated: u64,
        ratio: f64,
    ) -> Option<(overflow::Rejected, Option<u64>)> {
        let large = body.len() >= BLOCKING_PREPARE_BYTES;
        let (tokens, body) = (self.tokens.clone(), body.clone());
        let measure = move || {
            let req = ChatRequest::parse(&body).ok()?;
            let rejected = overflow::Rejected {
                raw: tokens.count(&req, encoding).total,
                bytes: body.len(),
                calibrated,
                ratio,
            };
            Some((rejected, req.max_completion_tokens()))
        };
        if large {
            self.off_workers(measure).await.flatten()
        } else {
            measure()
        }
    }

    /// Runs long counting work off the async workers, in one of the slots
    /// (one per core). Counting a large history the cache has not seen
    /// takes tens of milliseconds; with at most one such job per core, a
    /// burst of new conversations queues instead of starting hundreds of
    /// threads that all count the same messages at once (the ones that
    /// wait find them cached). None when the work did not finish (a panic).
    async fn off_workers<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let permit = self.prepare_slots.clone().acquire_owned().await;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .ok()
    }

    /// The client's original request compacted for a retry after an
    /// overflow, or None when no smaller request that fits the window can
    /// be made (the system and developer messages and the last user
    /// message alone are too long, by the provider's measure). The retry
    /// aims at the budget, but goes out whenever it fits the window: a
    /// budget's completion allowance and reserve are condense's margins,
    /// not the provider's limit. On this path a needed checkpoint that
    /// cannot be had is no reason to drop history mechanically: the client
    /// gets the upstream's error.
    async fn prepare_retry(
        &self,
        original: &Bytes,
        model: &str,
        info: ModelInfo,
        headers: &HeaderMap,
    ) -> Option<Prepared> {
        let chat = ChatRequest::parse(original).ok()?;
        let completion = info
            .correction
            .as_ref()
            .and_then(|c| c.completion)
            .or(chat.max_completion_tokens())
            .unwrap_or(0);
        let window = info.window;
        let p = self.measure_or_forward(chat, original, model, info).ok()?;
        let p = self.checkpointed(p, model, headers, false).await?;
        let outcome = p.outcome.as_ref()?;
        if outcome.messages.is_none() || p.tokens_after + completion > window {
            return None;
        }
        std::panic::catch_unwind(AssertUnwindSafe(|| self.ready(p, model))).ok()
    }

    /// Measures a parsed chat request and compacts it when it is under
    /// pressure (a checkpoint it needs is left pending). Fails open: if
    /// anything in it panics, the client's request goes upstream exactly as
    /// it came, and the failure is counted. A bug in condense must never
    /// become the client's error.
    fn measure_or_forward(
        &self,
        chat: ChatRequest,
        body: &Bytes,
        model: &str,
        info: ModelInfo,
    ) -> Result<pipeline::Processed, Prepared> {
        let replacement = self
            .summarizer
            .as_ref()
            .map_or(Replacement::Digest, Summarizer::replacement);
        let subject = pipeline::Subject {
            upstream: self.upstream.base_url(),
            model,
            info,
        };
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            pipeline::process(
                &self.tokens,
                &self.compaction,
                subject,
                chat,
                body,
                true,
                &replacement,
            )
        }))
        .map_err(|_| self.forward_unchanged(body, model))
    }

    /// Counts a failure inside condense; the request goes out as it came.
    fn forward_unchanged(&self, body: &Bytes, model: &str) -> Prepared {
        self.metrics.compaction_failures_total.inc();
        tracing::error!("preparing a chat request failed; forwarding it unchanged");
        Prepared::unchanged(
            body.clone(),
            Some(model.to_string()).filter(|m| !m.is_empty()),
        )
    }

    /// Gets a pending checkpoint, then readies the request for the upstream.
    /// Fails open like [`Proxy::measure_or_forward`].
    async fn complete(
        &self,
        p: pipeline::Processed,
        body: &Bytes,
        model: String,
        headers: &HeaderMap,
    ) -> Prepared {
        let Some(p) = self.checkpointed(p, &model, headers, true).await else {
            return self.forward_unchanged(body, &model);
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.ready(p, &model))) {
            Ok(prepared) => prepared,
            Err(_) => self.forward_unchanged(body, &model),
        }
    }

    /// Finishes a request whose plan needs a checkpoint: with one from the
    /// summarizer, or (with `mechanical_fallback`) with the mechanical plan
    /// when none comes. None when it cannot be finished (no checkpoint and
    /// no fallback, or a panic).
    async fn checkpointed(
        &self,
        p: pipeline::Processed,
        model: &str,
        headers: &HeaderMap,
        mechanical_fallback: bool,
    ) -> Option<pipeline::Processed> {
        match (&p.pending, &self.summarizer) {
            (None, _) => Some(p),
            (Some(_), None) => Some(pipeline::finish(&self.tokens, p, None)),
            (Some(_), Some(summarizer)) => {
                let work = pipeline::summarize(
                    &self.tokens,
                    summarizer,
                    self.upstream.base_url(),
                    model,
                    Some(headers),
                    p,
                );
                match AssertUnwindSafe(work).catch_unwind().await {
                    Ok((_, Some(Err(_)))) if !mechanical_fallback => None,
                    Ok((p, _)) => Some(p),
                    Err(_) => None,
                }
            }
        }
    }

    /// Counts what compaction did and readies the request for the upstream.
    fn ready(&self, p: pipeline::Processed, model: &str) -> Prepared {
        let m = &self.metrics;
        m.pressure_ratio.observe(p.assessment.pressure);
        let label = m.model_label(model);
        m.context_window_tokens
            .with_label_values(&[&label])
            .set(i64::try_from(p.assessment.budget.window).unwrap_or(i64::MAX));
        m.prompt_tokens_received_total.inc_by(p.assessment.tokens);
        m.prompt_tokens_forwarded_total.inc_by(p.tokens_after);
        if let Some(outcome) = &p.outcome {
            let ratio = p.assessment.calibration_ratio;
            for stage in &outcome.stages {
                m.compactions_total.with_label_values(&[stage.stage]).inc();
                m.tokens_saved_total
                    .with_label_values(&[stage.stage])
                    .inc_by((stage.tokens_saved as f64 * ratio).round() as u64);
            }
            if !outcome.stages.is_empty() {
                tracing::debug!(
                    model = crate::logging::clip(model),
                    before = p.assessment.tokens,
                    after = p.tokens_after,
                    actions = %outcome.actions(),
                    fits = outcome.fits,
                    "compacted"
                );
            }
        }
        let report = Report {
            tokens_before: p.assessment.tokens,
            tokens_after: p.tokens_after,
            actions: p.actions(),
            raw_after: p.raw_after,
        };
        let mut chat = p.request;
        let mut strip_usage = false;
        if self.stream_usage && chat.is_stream() && !chat.client_wants_stream_usage() {
            chat.request_stream_usage();
            strip_usage = true;
        }
        Prepared {
            body: chat.to_bytes(),
            model: Some(model.to_string()).filter(|m| !m.is_empty()),
            strip_usage,
            report: Some(report),
        }
    }

    /// Waits until the work started off the request path (counting bodies
    /// for calibration) is done: `condense replay` and tests use it to see
    /// each turn's effect before the next.
    pub async fn settled(&self) {
        self.background.settled().await;
    }

    /// Turns the upstream's response into the client's: same status, same
    /// headers (minus hop-by-hop), body relayed as it arrives.
    fn respond(
        &self,
        route: &str,
        resp: reqwest::Response,
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
        let status = resp.status();
        let headers = headers::to_client(resp.headers());
        let body = relay::relay(
            resp,
            tap,
            on_usage,
            self.upstream.idle_timeout,
            self.metrics.clone(),
            guard,
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

    fn fail(&self, route: &str, e: ProxyError) -> Response {
        self.metrics
            .proxy_errors_total
            .with_label_values(&[e.metric_label()])
            .inc();
        tracing::warn!(route, error = %e, "request failed in condense");
        e.into_response()
    }
}
