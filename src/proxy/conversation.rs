//! The request path of the conversation routes (`/v1/chat/completions`,
//! `/v1/messages`, `/v1/responses`), as its phases: read the request,
//! prepare it (measure, compact, summarize, offer condense's tools:
//! `prepare.rs`), send it, recover from a context overflow (`recover.rs`),
//! answer the model's calls of condense's tools (`recall.rs`), respond with
//! the usage tap. The format decides only where the request goes and how
//! its body is read and written back.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use http::{HeaderValue, Request, header};

use super::headers;
use super::learn::{Learner, Sent};
use super::prepare::Report;
use super::recall::Again;
use super::recover::OVERFLOW_STATUSES;
use super::respond::{InflightGuard, Reply, Tap};
use super::{Proxy, Timing, X_ACTIONS, X_TOKENS_AFTER, X_TOKENS_BEFORE};
use super::{read, send};
use crate::error::ProxyError;
use crate::upstream::Outgoing;
use crate::wire::Format;
use crate::wire::tap::{JsonTap, SseTap};

impl Proxy {
    /// A conversation request of `format` (`POST /v1/chat/completions`,
    /// `/v1/messages`, `/v1/responses`).
    pub async fn conversation(self: Arc<Self>, format: Format, req: Request<Body>) -> Response {
        let start = Instant::now();
        // What condense measured, kept for the response headers even when
        // sending fails: condense's own errors say what it did too.
        let mut report = None;
        let mut response = self
            .phases(format, req, start, &mut report)
            .await
            .unwrap_or_else(|e| self.fail(format.route(), format, e));
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

    async fn phases(
        self: &Arc<Self>,
        format: Format,
        req: Request<Body>,
        start: Instant,
        report: &mut Option<Report>,
    ) -> Result<Response, ProxyError> {
        let (upstream, credentials) = self.endpoint(format.api());
        // Read.
        let (parts, body) = req.into_parts();
        let url = upstream.url_for(parts.uri.path(), parts.uri.query())?;
        // `held` keeps the body's room in the budget until the response is
        // on its way (or, when it is counted after it, until counted).
        let (bytes, held) = read::read_request(
            body,
            read::content_length(&parts.headers),
            self.max_body_bytes,
            self.body_timeout,
            &self.bodies,
        )
        .await?;
        let opt_out = parts
            .headers
            .get(headers::X_CONDENSE)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"off"));
        // The same headers are made again for a retry or a follow-up, which
        // few requests need, rather than kept as a copy by every one.
        let upstream_headers = || send::upstream_headers(&parts.headers, credentials);
        let headers = upstream_headers();

        // Prepare.
        let (prepared, upstream_wait) = self
            .prepare(format, &bytes, opt_out, &headers, &parts.headers)
            .await;
        report.clone_from(&prepared.report);

        // Send.
        let guard = InflightGuard::new(self.metrics.clone());
        let sent = Instant::now();
        // A request condense measured can be recovered from an overflow.
        let retry = prepared
            .report
            .is_some()
            .then(|| (parts.method.clone(), url.clone()));
        let resp = upstream
            .send(
                parts.method,
                url,
                headers,
                Outgoing::Whole(prepared.body.clone()),
            )
            .await?;

        // Recover. The retry and the recall rounds are boxed: their futures
        // are large, and every request's future (which the server moves
        // into a box of its own) would otherwise carry their room, 17 KB
        // instead of 7.
        let (resp, mut prepared) = match &retry {
            Some((method, url)) if OVERFLOW_STATUSES.contains(&resp.status().as_u16()) => {
                let retry = (method.clone(), url.clone(), upstream_headers());
                Box::pin(self.recover(format, resp, prepared, &bytes, &retry)).await?
            }
            _ => (resp, prepared),
        };
        *report = prepared.report.take();

        // Recall: condense's own tools answered. The originals go to the
        // state store first, for the replicas that get a later key.
        if let Some(offer) = prepared.offer.as_ref() {
            self.recall_written
                .remember(&self.recall_state, &offer.originals)
                .await;
        }
        let (resp, first_round) = match (prepared.offer.take(), retry) {
            (Some(offer), Some((method, url))) if resp.status().is_success() => {
                // Follow-ups carrying condense's tool results go the same
                // way (a request recovered from an overflow may be offered
                // the tools too).
                let again = Again {
                    method,
                    url,
                    headers: upstream_headers(),
                };
                let answered =
                    Box::pin(self.answer_tools(format, *offer, prepared.body.clone(), resp, again))
                        .await?;
                (answered.reply, (answered.first_round, answered.continued))
            }
            _ => (Reply::from(resp), (None, None)),
        };
        let (first_round, continued) = first_round;

        // Respond.
        let tap = match (resp.status.is_success(), resp.is_sse()) {
            (false, _) => Tap::None,
            (true, true) => Tap::Sse(SseTap::new(format.api(), prepared.strip_usage)),
            (true, false) => Tap::Json(JsonTap::new(format.api(), resp.content_length)),
        };
        let learner = prepared.model.map(|model| {
            // With Redis, what the response teaches goes to the replicas'
            // record, as this request read it (or, not read, as this
            // process knows it).
            let shared = self.shared.as_ref().map(|plan| {
                let snap = prepared
                    .shared
                    .take()
                    .unwrap_or_else(|| plan.not_read(upstream.base_url(), &model));
                (plan.clone(), snap)
            });
            Learner {
                metrics: self.metrics.clone(),
                tokens: self.tokens.clone(),
                upstream: upstream.base_url().to_string(),
                model,
                format,
                shared,
            }
        });
        let counted = match (&learner, report.as_ref().and_then(|r| r.raw_after)) {
            (_, Some(raw)) => Sent::Counted(raw),
            (Some(l), None) if resp.status.is_success() => {
                l.count_later(prepared.body.clone(), held, &self.jobs, &self.background)
            }
            _ => Sent::Unknown,
        };
        let mut on_usage = learner.map(|l| l.on_usage(counted));
        // After condense answered its tools, the final answer's usage
        // covers requests larger than the one prepared: calibration learns
        // from the first round's, or not at all.
        if let Some(first) = first_round
            && let Some(learn) = on_usage.take()
            && let Some(usage) = first
            && let Some(written) = learn(usage)
        {
            written.await;
        }
        // A stream that went on after its first round: likewise, once it
        // did.
        if let Some(cell) = continued
            && let Some(learn) = on_usage.take()
        {
            on_usage = Some(Box::new(move |usage| match cell.get() {
                Some(Some(first)) => learn(*first),
                Some(None) => None,
                None => learn(usage),
            }));
        }
        let mut response = self.respond(
            format.route(),
            upstream,
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
        if prepared.strip_usage {
            response.headers_mut().remove(header::CONTENT_LENGTH);
        }
        Ok(response)
    }
}
