//! Prepare: a conversation request measured, compacted when it is under
//! pressure, its checkpoint fetched when the plan needs one, and written
//! back in its own format. Fails open: whatever goes wrong here, the
//! client's request goes upstream exactly as it came, and the failure is
//! counted. A bug in condense must never become the client's error.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::HeaderMap;

use super::Proxy;
use super::jobs::BLOCKING_PREPARE_BYTES;
use super::reached::Course;
use super::recall::Offer;
use super::shared::Snapshot;
use crate::compaction::Replacement;
use crate::pipeline::{self, History, Reached};
use crate::recall::{self, store::AgentPoint, store::Originals};
use crate::tokens::ModelInfo;
use crate::wire::{Format, NotUnderstood, Parsed, Provider, Writer};

/// A conversation request ready to forward.
pub struct Prepared {
    pub body: Bytes,
    pub model: Option<String>,
    pub strip_usage: bool,
    /// What the response headers report; None when condense did not measure.
    pub report: Option<Report>,
    /// condense's own tools offered to the model, and what answers them.
    pub offer: Option<Box<Offer>>,
    /// The replicas' record the request was measured with (with Redis).
    pub shared: Option<Snapshot>,
    /// The conversation's record of what compaction did on its earlier
    /// turns (see `reached.rs`), when one was read: a retry keeps it too.
    pub course: Option<Box<Course>>,
}

/// What condense measured and did, for the response headers.
#[derive(Clone)]
pub struct Report {
    pub tokens_before: u64,
    pub tokens_after: u64,
    pub actions: String,
    /// The raw count of the body sent, for calibration (None on the cheap
    /// path).
    pub raw_after: Option<u64>,
    /// What compaction did to the request, when it changed it (for the
    /// conversation's record).
    pub reached: Option<Reached>,
}

impl Prepared {
    pub fn unchanged(body: Bytes, model: Option<String>) -> Prepared {
        Prepared {
            body,
            model,
            strip_usage: false,
            report: None,
            offer: None,
            shared: None,
            course: None,
        }
    }
}

/// What the pipeline reads besides the request: a compaction the model
/// asked for, and what the conversation's earlier turns reached.
#[derive(Debug, Clone, Default)]
pub struct Own {
    /// The model asked for compaction up to this message.
    pub due: Option<usize>,
    /// What the conversation's earlier turns were planned against and
    /// reached.
    pub history: Option<History>,
}

/// A measured request on its way: the pipeline's result and how it is
/// written back.
pub type Measured = (pipeline::Processed, Writer);

impl Proxy {
    /// The request to send for the client's `bytes`, and how long condense
    /// waited on the upstream meanwhile (for the `/models` listing).
    /// `headers` go upstream; `client_headers` are the client's own.
    pub(super) async fn prepare(
        self: &Arc<Self>,
        format: Format,
        bytes: &Bytes,
        opt_out: bool,
        headers: &HeaderMap,
        client_headers: &HeaderMap,
    ) -> (Prepared, Duration) {
        // Recall keys and agent points belong to the client's credentials
        // (a hash of them, worked out only for the requests that use it).
        let scope = || recall::store::scope(client_headers);
        // A large Messages or Responses body is parsed item by item, which
        // is work for the blocking pool, as counting is.
        let parsed = if format.api().parses_into_a_view() && bytes.len() >= BLOCKING_PREPARE_BYTES {
            let body = bytes.clone();
            self.off_workers(body.len(), move || format.api().parse(&body))
                .await
        } else {
            Some(format.api().parse(bytes))
        };
        let parsed = match parsed {
            Some(Ok(p)) => p,
            Some(Err(NotUnderstood::Stateful(reason))) => {
                self.metrics
                    .stateful_requests_total
                    .with_label_values(&[reason])
                    .inc();
                return (Prepared::unchanged(bytes.clone(), None), Duration::ZERO);
            }
            // Not a request condense understands: the upstream judges it.
            Some(Err(e)) => {
                tracing::debug!(error = %e, "conversation body not understood; forwarding unchanged");
                return (Prepared::unchanged(bytes.clone(), None), Duration::ZERO);
            }
            None => return (self.forward_unchanged(bytes, ""), Duration::ZERO),
        };
        let model = parsed.model().unwrap_or_default();
        if opt_out {
            return (
                Prepared::unchanged(bytes.clone(), Some(model).filter(|m| !m.is_empty())),
                Duration::ZERO,
            );
        }
        let (upstream, _) = self.endpoint(format.api());
        let mut waited = Duration::ZERO;
        // Anthropic's listing names no windows; Responses shares chat's.
        if self.learn_windows && format.api().provider() == Provider::OpenAi && !model.is_empty() {
            waited = self
                .listing
                .ensure(upstream, &self.tokens.listings, &model, headers)
                .await;
        }
        // Where the model asked for compaction (`compress_context`), and
        // where this request would record it.
        let point = (self.compaction.agent_tool
            && crate::wire::tools::offered(&parsed.conversation))
        .then(|| AgentPoint::of(&scope(), parsed.conversation.messages()))
        .flatten();
        let (snapshot, info, due) = self
            .what_the_plan_reads(upstream.base_url(), &model, point.as_ref())
            .await;
        // What compaction did on the conversation's earlier turns, read
        // for a request that may be at its trigger at all (see
        // `reached.rs`).
        let mut course = self
            .tokens
            .may_reach_trigger(&info, &parsed.conversation, bytes)
            .then(|| Course::of(&scope(), parsed.conversation.messages()))
            .flatten();
        if let Some(c) = course.as_mut() {
            c.read(&self.state).await;
        }
        let own = Own {
            due,
            history: course.as_ref().and_then(|c| c.history.clone()),
        };
        let measured = if bytes.len() >= BLOCKING_PREPARE_BYTES
            && self
                .tokens
                .uncached_bytes(&parsed.conversation, info.encoding)
                >= BLOCKING_PREPARE_BYTES
        {
            let (this, body, name) = (self.clone(), bytes.clone(), model.clone());
            self.off_workers(bytes.len(), move || {
                this.measure_or_forward(format, parsed, &body, &name, info, own)
            })
            .await
            .unwrap_or_else(|| Err(Box::new(Prepared::unchanged(bytes.clone(), None))))
        } else {
            self.measure_or_forward(format, parsed, bytes, &model, info, own)
        };
        let mut prepared = match measured {
            Ok(m) => self.complete(format, m, bytes, model, headers).await,
            Err(unchanged) => *unchanged,
        };
        prepared.shared = snapshot;
        if due.is_some()
            && prepared
                .report
                .as_ref()
                .is_some_and(|r| r.actions != "none")
        {
            self.metrics
                .agent_compactions_total
                .with_label_values(&["applied"])
                .inc();
        }
        if let Some(offer) = prepared.offer.as_mut() {
            offer.originals.scope = scope();
            offer.point = point;
        }
        if let Some(c) = course {
            self.record_reached(&c, &prepared).await;
            prepared.course = Some(Box::new(c));
        }
        (prepared, waited)
    }

    /// The window, calibration and agent point a request of `model` is
    /// planned with: with Redis, the replicas' (one read for all of them,
    /// see `shared.rs`), kept as the request's snapshot for what its
    /// response teaches; else (or when Redis fails) this process's own.
    async fn what_the_plan_reads(
        &self,
        upstream: &str,
        model: &str,
        point: Option<&AgentPoint>,
    ) -> (Option<Snapshot>, ModelInfo, Option<usize>) {
        match &self.shared {
            Some(shared) if !model.is_empty() => {
                let extra: Vec<&str> = point.iter().map(|p| p.key()).collect();
                let (snap, values) = shared.read(upstream, model, &extra).await;
                let due = match (point, values.as_deref()) {
                    (Some(p), Some([Some(v), ..])) => p.matches(v),
                    _ => None,
                };
                let info = if snap.found() {
                    self.tokens
                        .model_info_shared(upstream, model, &snap.record(&self.tokens))
                } else {
                    self.tokens.model_info(upstream, model)
                };
                (Some(snap), info, due)
            }
            _ => {
                let due = match point {
                    Some(p) => p.recorded(&self.recall_state).await,
                    None => None,
                };
                (None, self.tokens.model_info(upstream, model), due)
            }
        }
    }

    /// Measures a parsed request and compacts it when it is under pressure
    /// (a checkpoint it needs is left pending). If anything in it panics,
    /// the client's request goes out as it came.
    pub(super) fn measure_or_forward(
        &self,
        format: Format,
        parsed: Parsed,
        body: &Bytes,
        model: &str,
        info: ModelInfo,
        own: Own,
    ) -> Result<Measured, Box<Prepared>> {
        let Own { due, history } = own;
        let replacement = self
            .summarizer_for(format)
            .map_or(Replacement::Digest, |(s, _)| s.replacement());
        let (upstream, _) = self.endpoint(format.api());
        let subject = pipeline::Subject {
            upstream: upstream.base_url(),
            model,
            info,
            due,
            history,
        };
        let Parsed {
            conversation,
            writer,
        } = parsed;
        // Rewrites carry recall keys (when recall is on) on every request,
        // an overflow's retry included, which offers no tools: a retry that
        // wrote its placeholders without keys was rewritten by the next
        // turn at its first masked message, and a Claude Code session lost
        // its whole cached prefix twice in a row (stability 0.848 against
        // 0.856 with keys, at 32k chars:3.0; no other replay moved).
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            pipeline::process(
                &self.tokens,
                &self.compaction,
                subject,
                conversation,
                body,
                true,
                &replacement,
            )
        }))
        .map(|p| (p, writer))
        .map_err(|_| Box::new(self.forward_unchanged(body, model)))
    }

    /// Adds what `prepared`'s compaction did to its conversation's record
    /// (which changes only when the budget or the frontier moved).
    pub(super) async fn record_reached(&self, course: &Course, prepared: &Prepared) {
        if let Some(now) = prepared.report.as_ref().and_then(|r| r.reached) {
            course.record(&self.state, now).await;
        }
    }

    /// Counts a failure inside condense; the request goes out as it came.
    pub(super) fn forward_unchanged(&self, body: &Bytes, model: &str) -> Prepared {
        self.metrics.compaction_failures_total.inc();
        tracing::error!("preparing a request failed; forwarding it unchanged");
        Prepared::unchanged(
            body.clone(),
            Some(model.to_string()).filter(|m| !m.is_empty()),
        )
    }

    /// Gets a pending checkpoint, then readies the request for the upstream.
    async fn complete(
        &self,
        format: Format,
        (p, writer): Measured,
        body: &Bytes,
        model: String,
        headers: &HeaderMap,
    ) -> Prepared {
        let Some(p) = self.checkpointed(format, p, &model, headers, true).await else {
            return self.forward_unchanged(body, &model);
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.ready(p, &writer, &model, true))) {
            Ok(Some(prepared)) => prepared,
            Ok(None) | Err(_) => self.forward_unchanged(body, &model),
        }
    }

    /// Finishes a request whose plan needs a checkpoint: with one from the
    /// summarizer, or (with `mechanical_fallback`) with the mechanical plan
    /// when none comes. None when it cannot be finished (no checkpoint and
    /// no fallback, or a panic). The client's own key goes along only to
    /// the API it was meant for: chat completions and Responses share the
    /// OpenAI-side summarizer, Messages requests have Anthropic's (unless a
    /// summarizer of its own is configured, which never gets their key).
    pub(super) async fn checkpointed(
        &self,
        format: Format,
        p: pipeline::Processed,
        model: &str,
        headers: &HeaderMap,
        mechanical_fallback: bool,
    ) -> Option<pipeline::Processed> {
        match (&p.pending, self.summarizer_for(format)) {
            (None, _) => Some(p),
            (Some(_), None) => Some(pipeline::finish(&self.tokens, p, None)),
            (Some(_), Some((summarizer, own_upstream))) => {
                let (upstream, _) = self.endpoint(format.api());
                // The client's key goes only to its upstream's own API.
                let client_headers = own_upstream.then_some(headers);
                let work = pipeline::summarize(
                    &self.tokens,
                    summarizer,
                    upstream.base_url(),
                    model,
                    client_headers,
                    p,
                );
                // Boxed: a large future only the requests that summarize
                // need room for.
                match AssertUnwindSafe(Box::pin(work)).catch_unwind().await {
                    Ok((_, Some(Err(_)))) if !mechanical_fallback => None,
                    Ok((p, _)) => Some(p),
                    Err(_) => None,
                }
            }
        }
    }

    /// Counts what compaction did and writes the request for the upstream;
    /// None when its format cannot take the result (it then goes out as the
    /// client sent it).
    pub(super) fn ready(
        &self,
        p: pipeline::Processed,
        writer: &Writer,
        model: &str,
        offer_tools: bool,
    ) -> Option<Prepared> {
        // Another format writes the decisions back into its own body first:
        // when that fails, nothing was done.
        let written = match writer.api().parses_into_a_view() {
            // The conversation is the body.
            false => None,
            true => {
                let fates = p.outcome.as_ref().and_then(|o| o.fates.as_ref());
                match writer.body(&p.request, fates) {
                    Ok(b) => Some(b),
                    Err(e) => {
                        tracing::error!(error = %e, "writing the compacted request back failed");
                        return None;
                    }
                }
            }
        };
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
            reached: p.reached,
        };
        let offered = crate::wire::tools::offered(&p.request);
        let room = p
            .assessment
            .budget
            .prompt_budget
            .saturating_sub(p.tokens_after);
        // condense's tools, when the request can call them and has use for
        // them: compress_context first (it is offered on every request),
        // the recall tool joining it once a key appears (this request's
        // compaction wrote one, or the client's messages hold one already,
        // from a conversation another replica compacted).
        let mut names = Vec::new();
        if offer_tools && self.compaction.agent_tool && offered {
            names.push(crate::wire::tools::COMPRESS_TOOL);
        }
        if offer_tools
            && (p.recallable.is_some()
                || (self.compaction.recall
                    && offered
                    && crate::compaction::keys::mentions_key(p.request.messages())))
        {
            names.push(crate::wire::tools::RECALL_TOOL);
        }
        let api = writer.api();
        // The tool lists before and after, when they were added.
        let mut tools = None;
        let (body, strip_usage) = match written {
            Some(body) if !names.is_empty() => {
                match crate::wire::tools::offer(api, &body, &names) {
                    Some(o) => {
                        tools = Some((o.before, o.after));
                        (o.body, false)
                    }
                    None => (body, false),
                }
            }
            Some(body) => (body, false),
            None => {
                let mut chat = p.request;
                let strip =
                    self.stream_usage && chat.is_stream() && !chat.client_wants_stream_usage();
                if strip {
                    chat.request_stream_usage();
                }
                // In place: the body is written once.
                if !names.is_empty()
                    && let Some(before) = chat.field("tools").map(Bytes::copy_from_slice)
                    && let Some(after) = crate::wire::tools::extended(api, &before, &names)
                {
                    chat.set_field("tools", after.clone());
                    tools = Some((before, after));
                }
                (chat.to_bytes(), strip)
            }
        };
        let mut prepared = Prepared {
            body,
            model: Some(model.to_string()).filter(|m| !m.is_empty()),
            strip_usage,
            report: Some(report),
            offer: None,
            shared: None,
            course: None,
        };
        if let Some((before, after)) = tools {
            // What the tools add is part of what is sent (and of what the
            // upstream reports, which calibration compares it with).
            let (upstream, _) = self.endpoint(api);
            let enc = self.tokens.model_info(upstream.base_url(), model).encoding;
            let added = self
                .tokens
                .tools_tokens(&after, enc)
                .saturating_sub(self.tokens.tools_tokens(&before, enc));
            if let Some(r) = prepared.report.as_mut() {
                r.raw_after = r.raw_after.map(|n| n + added);
                r.tokens_after += (added as f64 * p.assessment.calibration_ratio).round() as u64;
            }
            prepared.offer = Some(Box::new(Offer {
                originals: Originals {
                    scope: String::new(),
                    own: p.recallable.unwrap_or_default(),
                },
                // About three characters a token.
                room_chars: usize::try_from(room.saturating_mul(3)).unwrap_or(usize::MAX),
                point: None,
            }));
        }
        Some(prepared)
    }
}
