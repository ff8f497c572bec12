//! Recover: a measured request the upstream rejected for its length is
//! compacted again against the window the error names (or, without one,
//! against what was just rejected) and sent once more. The window learned
//! is shared with the other replicas through the state store (the pair's
//! record, see `shared.rs`, written before the retry is sent), for
//! `tokens.learned_window_ttl_seconds`, and never below its floor (see
//! [`crate::tokens::learned`]): one tenant's error sizes every tenant's
//! requests.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use http::HeaderMap;

use super::jobs::BLOCKING_PREPARE_BYTES;
use super::prepare::{Own, Prepared};
use super::reached::Course;
use super::respond::Reply;
use super::shared::Change;
use super::{Proxy, read};
use crate::error::ProxyError;
use crate::overflow;
use crate::tokens::{ModelInfo, WindowSource, pair_key};
use crate::upstream::{self, Outgoing, ResponseBody, UpstreamResponse};
use crate::wire::Format;

/// Statuses an overflow error can come with.
pub(super) const OVERFLOW_STATUSES: &[u16] = &[400, 413, 429];
/// Error bodies larger than this are not read for overflow detection.
const MAX_ERROR_BODY: usize = 1 << 20;

impl Proxy {
    /// Handles an error response to a measured chat request: when it says
    /// the context overflowed, learns the window (and the provider's count),
    /// compacts the client's original request against it, and sends that
    /// once. Returns the response for the client (the retry's, or the
    /// upstream's error unchanged) and what was sent.
    pub(super) async fn recover(
        &self,
        format: Format,
        resp: UpstreamResponse,
        prepared: Prepared,
        original: &Bytes,
        (method, url, headers): &(http::Method, http::Uri, HeaderMap),
    ) -> Result<(UpstreamResponse, Prepared), ProxyError> {
        if upstream::content_length(&resp).is_some_and(|n| n > MAX_ERROR_BODY as u64) {
            return Ok((resp, prepared));
        }
        let status = resp.status();
        let version = resp.version();
        let resp_headers = resp.headers().clone();
        let (endpoint, _) = self.endpoint(format.api());
        let read = read::read_upstream(resp, MAX_ERROR_BODY, Some(endpoint.idle_timeout()))
            .await
            .map_err(|e| {
                ProxyError::UpstreamUnreachable(format!(
                    "reading the error body: {}",
                    upstream::describe(e.as_ref())
                ))
            })?;
        let body = match read {
            read::Limited::Whole(b) => b,
            // Too long to be an overflow error (or stalled): passed on as it
            // is, the bytes read first and then the rest as it comes.
            read::Limited::Over { head, rest } => {
                let whole = Reply::prefixed(head, rest).map(|c| c.map(http_body::Frame::data));
                let mut r =
                    http::Response::new(ResponseBody::new(http_body_util::StreamBody::new(whole)));
                *r.status_mut() = status;
                *r.version_mut() = version;
                *r.headers_mut() = resp_headers;
                return Ok((r, prepared));
            }
        };
        let unchanged = || {
            let mut r = http::Response::new(upstream::whole_body(body.clone()));
            *r.status_mut() = status;
            *r.version_mut() = version;
            *r.headers_mut() = resp_headers.clone();
            r
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
        let upstream = endpoint.base_url();
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
        let ratio = match &prepared.shared {
            Some(snap) => snap.record(&self.tokens).calibration.ratios().observed,
            None => self.tokens.calibration.ratio(upstream, &model),
        };
        let Some((rejected, requested)) = self
            .measure_rejected(format, &prepared.body, encoding, calibrated, ratio)
            .await
        else {
            count("not_recoverable");
            return Ok((unchanged(), prepared));
        };
        // The window as the error names it, learned (floored) and shared.
        // An account's limit (tokens per minute) is no model's window: it
        // sizes this retry only. An error without a limit still bounds the
        // window by what was just rejected (the prompt as the provider
        // counted it, or as condense estimates it, plus the completion
        // asked for); without that, a provider whose errors carry no
        // numbers would reject every later request of the conversation
        // once. condense's estimate may be low, so that bound expires
        // sooner. When the error names the provider's count, it is an
        // observation too.
        let ttl = self.tokens.learned.ttl();
        let (limit, names_window, prompt) = (o.limit, o.names_window, o.prompt);
        let bound = prompt
            .unwrap_or(calibrated)
            .saturating_add(requested.unwrap_or(0));
        let raw = rejected.raw;
        let change: Change = Arc::new(move |s, now| {
            match limit {
                Some(limit) if names_window => s.windows.learn(limit, ttl, now),
                Some(_) => {}
                None => s.windows.bound(bound, now),
            }
            if let Some(p) = prompt {
                s.calibration.observe(p, raw);
            }
        });
        let mut snapshot = prepared.shared.clone();
        let mut info = match (&self.shared, snapshot.as_mut()) {
            (Some(plan), Some(snap)) => {
                // Written before the retry goes: the client's next turn,
                // on any replica, is planned with it.
                if let Some(written) = plan.update(snap, change) {
                    written.await;
                }
                let record = snap.record(&self.tokens);
                self.tokens.model_info_shared(upstream, &model, &record)
            }
            _ => {
                self.tokens.change(pair_key(upstream, &model), &*change);
                self.tokens.model_info(upstream, &model)
            }
        };
        // The retry aims at the limit the error names even where the learned
        // window stays above it (its floor): it is this request's own
        // answer, and a retry sized to more would be rejected again.
        if let Some(limit) = o.limit.filter(|&l| l < info.window) {
            info.window = limit;
            info.source = WindowSource::Overflow;
        }
        info.correction = Some(o.correction(&rejected));

        // The retry keeps what the conversation's earlier turns did, and
        // records what it does.
        let course = prepared.course.as_deref();
        let Some(mut retry) = self
            .prepare_retry(format, original, &model, info, headers, course)
            .await
        else {
            count("not_recoverable");
            return Ok((unchanged(), prepared));
        };
        retry.shared = snapshot;
        if let Some(c) = course {
            self.record_reached(c, &retry).await;
        }
        let resp = endpoint
            .send(
                method.clone(),
                url.clone(),
                headers.clone(),
                Outgoing::Whole(retry.body.clone()),
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
        format: Format,
        body: &Bytes,
        encoding: crate::tokens::Encoding,
        calibrated: u64,
        ratio: f64,
    ) -> Option<(overflow::Rejected, Option<u64>)> {
        let large = body.len() >= BLOCKING_PREPARE_BYTES;
        let (tokens, size, body) = (self.tokens.clone(), body.len(), body.clone());
        let measure = move || {
            let req = crate::wire::conversation_of(format, &body)?;
            let rejected = overflow::Rejected {
                raw: tokens.count(&req, encoding).total,
                bytes: body.len(),
                calibrated,
                ratio,
            };
            Some((rejected, req.max_completion_tokens()))
        };
        if large {
            self.off_workers(size, measure).await.flatten()
        } else {
            measure()
        }
    }

    /// The client's original request compacted for a retry after an
    /// overflow, or None when no smaller request that fits the window can
    /// be made (the system and developer messages and the last user
    /// message alone are too long, by the provider's measure, or the
    /// completion asked for leaves no room). The prompt is what shrinks:
    /// it must fit the window less the completion (the provider's count of
    /// it, else the request's `max_tokens`), which the retry asks for
    /// unchanged. The retry aims at the budget, but goes out whenever it
    /// fits the window: a budget's reserve, and a completion allowance the
    /// request did not ask for, are condense's margins, not the provider's
    /// limit. Whether it fits is read the lenient way: the retry is cut
    /// against each message counted at the larger of its tokens and its
    /// bytes at the error's density (see [`overflow::Overflow::correction`]),
    /// a bound meant to cut deep enough, which overshoots framing-heavy
    /// messages (a hundred small parallel calls, JSON keys the provider
    /// does not count as text); it goes out when its plain count, at the
    /// calibration ratio, fits. A retry rejected again costs one round trip
    /// and gives the client the provider's own error; one not sent would cut
    /// short a turn the provider might take. On this path a needed
    /// checkpoint that cannot be had is no reason to drop history
    /// mechanically: the client gets the upstream's error.
    async fn prepare_retry(
        &self,
        format: Format,
        original: &Bytes,
        model: &str,
        info: ModelInfo,
        headers: &HeaderMap,
        course: Option<&Course>,
    ) -> Option<Prepared> {
        let parsed = format.api().parse(original).ok()?;
        let completion = info
            .correction
            .as_ref()
            .and_then(|c| c.completion)
            .or(parsed.max_completion_tokens())
            .unwrap_or(0);
        let window = info.window;
        // The client's `max_tokens` is never changed: when it alone fills
        // the window (Anthropic's "input length and `max_tokens` exceed
        // context limit" for any prompt), no prompt can be made to fit, and
        // nothing is compacted or summarized for it.
        if completion >= window {
            return None;
        }
        let own = Own {
            history: course.and_then(|c| c.history.clone()),
            ..Own::default()
        };
        let (p, writer) = self
            .measure_or_forward(format, parsed, original, model, info, own)
            .ok()?;
        let p = self.checkpointed(format, p, model, headers, false).await?;
        let outcome = p.outcome.as_ref()?;
        let plain = p.raw_after.map_or(p.tokens_after, |raw| {
            (raw as f64 * p.assessment.calibration_ratio).round() as u64
        });
        if outcome.messages.is_none() || p.tokens_after.min(plain) + completion > window {
            return None;
        }
        // The retry offers none of condense's tools: it is sized to the
        // window just learned, and the next request offers them again. Its
        // placeholders carry their recall keys, as the next request's do,
        // so that one's cached prefix survives.
        std::panic::catch_unwind(AssertUnwindSafe(|| self.ready(p, &writer, model, false)))
            .ok()
            .flatten()
    }
}
