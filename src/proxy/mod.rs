//! The forwarding path: from a client request to the upstream and back.
//!
//! The conversation routes (chat completions, Anthropic Messages,
//! Responses) go through phases, one file each, run in order by
//! `conversation`: `read` (the body, bounded), `prepare` (measure, compact,
//! summarize, offer condense's tools), `send` (the upstream request),
//! `recover` (one retry after a context overflow), `recall` (the model's
//! calls of condense's tools answered), `respond` (the answer relayed with
//! the usage tap). A Responses WebSocket (`socket.rs`) sends each of its
//! turns through the same phases. Any other request is streamed upstream and back
//! untouched (`send.rs`, `passthrough`). What differs between the APIs is
//! asked of `crate::wire`. With Redis, what the plan reads is shared by
//! the replicas (`shared.rs`).

pub mod auth;
mod conversation;
pub mod headers;
mod jobs;
pub mod learn;
pub mod listing;
mod prepare;
pub mod reached;
pub mod read;
mod recall;
mod recover;
pub mod respond;
mod send;
pub mod shared;
pub mod socket;
mod sockets;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::Response;
use http::HeaderName;

use crate::config::CompactionConfig;
use crate::config::Config;
use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::state::{StateError, StateStore};
use crate::summary::Summarizer;
use crate::tokens::TokenService;
use crate::upstream::{InvalidPath, SendError, Upstream, UpstreamError};
use crate::wire::{Api, Format, Provider};
use auth::Credentials;
use learn::Background;
use listing::ListingFetcher;
use read::BodyBudget;

/// The route label, for metrics and logs, of requests condense relays
/// without reading (a conversation's is its API's route label).
pub const ROUTE_PASSTHROUGH: &str = "passthrough";

/// Response headers that tell the client what condense did.
pub const X_TOKENS_BEFORE: HeaderName = HeaderName::from_static("x-condense-tokens-before");
pub const X_TOKENS_AFTER: HeaderName = HeaderName::from_static("x-condense-tokens-after");
pub const X_ACTIONS: HeaderName = HeaderName::from_static("x-condense-actions");

/// Where one API's requests go, and with which credentials.
pub struct Endpoint {
    pub upstream: Upstream,
    pub credentials: Credentials,
}

pub struct Proxy {
    /// The OpenAI-compatible upstream (`upstream.base_url`).
    pub upstream: Upstream,
    pub credentials: Credentials,
    /// Anthropic's API (`upstream.anthropic_base_url`).
    pub anthropic: Endpoint,
    pub metrics: Arc<Metrics>,
    pub tokens: Arc<TokenService>,
    listing: ListingFetcher,
    /// Parsing, counting and compacting large bodies, off the async
    /// workers and under a bound.
    jobs: jobs::Jobs,
    compaction: CompactionConfig,
    /// None when `summary.enabled` is false.
    /// The summarizer of chat completions and Responses requests (and of
    /// every request, when `summary.base_url` or `summary.api_key` is set).
    summarizer: Option<Summarizer>,
    /// Messages requests' summarizer: Anthropic's API, in its format.
    anthropic_summarizer: Option<Summarizer>,
    /// Responses requests' summarizer: the upstream's Responses API.
    responses_summarizer: Option<Summarizer>,
    pub state: Arc<StateStore>,
    /// Recall originals and agent points, apart from `state` so that they
    /// never crowd checkpoints out of the in-process store's bytes (the
    /// same Redis, when there is one).
    pub recall_state: Arc<StateStore>,
    /// What the plan reads, shared by the replicas (with Redis only).
    shared: Option<Arc<shared::SharedPlan>>,
    max_body_bytes: u64,
    body_timeout: Duration,
    /// Room for request bodies read whole.
    pub bodies: BodyBudget,
    /// Work done off the request path.
    background: Background,
    stream_usage: bool,
    learn_windows: bool,
    /// Which recall originals this process stored lately.
    recall_written: crate::recall::store::Written,
    /// Turns true when the shutdown grace is over: open streams end.
    streams_end: tokio::sync::watch::Sender<bool>,
    /// The Responses WebSockets open.
    pub sockets: sockets::Sockets,
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    State(#[from] StateError),
}

/// The client is answered for a request the upstream never answered: 504
/// for a timeout, 502 otherwise.
impl From<SendError> for ProxyError {
    fn from(e: SendError) -> ProxyError {
        match e {
            SendError::Timeout(seconds) => ProxyError::UpstreamTimeout(seconds),
            SendError::Unreachable(why) => ProxyError::UpstreamUnreachable(why),
        }
    }
}

/// A path that would leave the upstream's base URL is the client's error.
impl From<InvalidPath> for ProxyError {
    fn from(InvalidPath(why): InvalidPath) -> ProxyError {
        ProxyError::InvalidPath(why)
    }
}

/// Timestamps that split a request's time between condense and the upstream.
struct Timing {
    start: Instant,
    sent: Instant,
    /// Time before `sent` spent waiting on the upstream for something else
    /// (the `/models` listing).
    upstream_wait: Duration,
}

impl Proxy {
    pub fn new(config: Arc<Config>, metrics: Arc<Metrics>) -> Result<Proxy, SetupError> {
        let upstream = Upstream::new(&config.upstream)?;
        upstream.trust().log();
        Proxy::with_upstream(config, metrics, upstream)
    }

    /// A proxy in front of `upstream` (a simulated one, for `condense
    /// replay`); Anthropic's API is reached through the same client.
    pub fn with_upstream(
        config: Arc<Config>,
        metrics: Arc<Metrics>,
        upstream: Upstream,
    ) -> Result<Proxy, SetupError> {
        let state = Arc::new(StateStore::new(&config.state, Some(metrics.clone()))?);
        let recall_state = Arc::new(StateStore::new(&config.state, Some(metrics.clone()))?);
        let summarizer = if config.summary.enabled {
            Some(Summarizer::new(
                &crate::wire::chat::Chat,
                &config.summary,
                &upstream,
                state.clone(),
                Some(metrics.clone()),
            )?)
        } else {
            None
        };
        let anthropic = Endpoint {
            upstream: upstream.rebased(&config.upstream.anthropic_base_url)?,
            credentials: Credentials::anthropic(
                &config.auth,
                config.upstream.anthropic_api_key.as_ref(),
            ),
        };
        // Messages and Responses requests get checkpoints from their own
        // API, in its format, with the key their request carries (an
        // upstream that speaks Responses may speak nothing else), unless a
        // summarizer of its own is configured (`summary.base_url`,
        // `summary.api_key`).
        let own_summarizer = config.summary.base_url.is_some() || config.summary.api_key.is_some();
        let own_format = |api, upstream: &Upstream| -> Result<Option<Summarizer>, SetupError> {
            if !config.summary.enabled || own_summarizer {
                return Ok(None);
            }
            Ok(Some(Summarizer::new(
                api,
                &config.summary,
                upstream,
                state.clone(),
                Some(metrics.clone()),
            )?))
        };
        let anthropic_summarizer =
            own_format(&crate::wire::anthropic::Messages, &anthropic.upstream)?;
        let responses_summarizer = own_format(&crate::wire::responses::Responses, &upstream)?;
        let tokens = Arc::new(TokenService::new(config.clone(), &metrics));
        let shared = (state.kind() == "redis").then(|| {
            Arc::new(shared::SharedPlan {
                state: state.clone(),
                tokens: tokens.clone(),
            })
        });
        Ok(Proxy {
            upstream,
            anthropic,
            summarizer,
            anthropic_summarizer,
            responses_summarizer,
            state,
            recall_state,
            shared,
            credentials: Credentials::new(&config.auth, config.upstream.api_key.as_ref()),
            tokens,
            jobs: jobs::Jobs::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
                metrics.prepare_jobs_total.clone(),
            ),
            metrics,
            listing: ListingFetcher::default(),
            compaction: config.compaction.clone(),
            max_body_bytes: config.server.max_body_bytes,
            body_timeout: Duration::from_secs_f64(config.server.body_timeout_seconds),
            bodies: BodyBudget::new(config.server.max_buffered_bytes),
            background: Background::default(),
            stream_usage: config.upstream.stream_usage,
            learn_windows: config.upstream.learn_windows,
            recall_written: crate::recall::store::Written::new(
                65_536,
                Duration::from_secs(config.state.ttl_seconds),
            ),
            streams_end: tokio::sync::watch::Sender::new(false),
            sockets: sockets::Sockets::new(
                config.server.max_websockets,
                Duration::from_secs_f64(config.server.websocket_idle_seconds),
                Duration::from_secs_f64(config.server.idle_timeout_seconds),
            ),
        })
    }

    /// The summarizer for requests of `format`, and whether the client's
    /// credentials may go to it (it is their upstream's own API).
    fn summarizer_for(&self, format: Format) -> Option<(&Summarizer, bool)> {
        let own_format = match format {
            Format::Messages => self.anthropic_summarizer.as_ref(),
            Format::Responses => self.responses_summarizer.as_ref(),
            Format::Chat => None,
        };
        match (own_format, format.api().provider()) {
            (Some(s), _) => Some((s, true)),
            (None, Provider::Anthropic) => self.summarizer.as_ref().map(|s| (s, false)),
            (None, Provider::OpenAi) => self.summarizer.as_ref().map(|s| (s, true)),
        }
    }

    /// The upstream and credentials for requests of `api`.
    fn endpoint(&self, api: &dyn Api) -> (&Upstream, &Credentials) {
        match api.provider() {
            Provider::OpenAi => (&self.upstream, &self.credentials),
            Provider::Anthropic => (&self.anthropic.upstream, &self.anthropic.credentials),
        }
    }

    /// Runs the preparation of a body of `bytes` off the async workers, in
    /// its lane (see `jobs.rs`). None when it did not run: its lane was
    /// full, or it panicked; the request then goes on without it.
    async fn off_workers<T: Send + 'static>(
        &self,
        bytes: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        self.jobs.run(bytes, work).await.ok()
    }

    /// Ends every stream still open with an error event in its API's shape
    /// and the body's proper end (the shutdown grace is over).
    pub fn end_streams(&self) {
        self.streams_end.send_replace(true);
    }

    /// Waits until the work started off the request path (counting bodies
    /// for calibration) is done: `condense replay` and tests use it to see
    /// each turn's effect before the next.
    pub async fn settled(&self) {
        self.background.settled().await;
    }

    fn fail(&self, route: &str, format: Format, e: ProxyError) -> Response {
        self.metrics
            .proxy_errors_total
            .with_label_values(&[e.metric_label()])
            .inc();
        tracing::warn!(route, error = %e, "request failed in condense");
        e.response_for(format)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_upstream_client_fails_at_reads_the_same_as_condense_s_error() {
        for (e, status, text) in [
            (
                ProxyError::from(SendError::Timeout(0.2)),
                504,
                "the upstream did not answer within 0.2 seconds",
            ),
            (
                ProxyError::from(SendError::Unreachable("refused".into())),
                502,
                "the upstream could not be reached: refused",
            ),
            (
                ProxyError::from(InvalidPath("may not contain dot segments")),
                400,
                "the request path may not contain dot segments",
            ),
        ] {
            assert_eq!(
                (e.status().as_u16(), e.to_string().as_str()),
                (status, text)
            );
        }
        assert_eq!(
            SendError::Unreachable("refused".into()).to_string(),
            "the upstream could not be reached: refused"
        );
    }
}
