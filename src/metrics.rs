//! The metric registry. Every metric condense exports is declared here, so
//! the names (the contract Prometheus dashboards rely on) live in one file.
//!
//! This module is at the bottom of the house: it imports nothing from the
//! rest of condense. The label values that are fixed sets live in [`labels`],
//! and the modules that count use them from there.
//!
//! Labels have few values: `route` and `status_class` are fixed sets, and the
//! client-chosen `model` label is capped (see [`Metrics::model_label`]) so a
//! client cannot blow up the series count by inventing model names.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus::core::Collector;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The label values that are known in advance. A metric's series for these
/// start at zero, so dashboards show 0 rather than "no data" until the first
/// event.
pub mod labels {
    /// The compaction stages, the `stage` label's values.
    pub const STAGES: &[&str] = &["fit", "mask", "summarize", "prune", "fade", "emergency"];

    /// The `outcome` label of `condense_recalls_total`.
    pub const RECALL_OUTCOMES: &[&str] = &[
        "answered",
        "unknown_key",
        "limit_reached",
        "stripped",
        "failed",
    ];

    /// Every value of `ProxyError::metric_label`, the `kind` label of
    /// `condense_proxy_errors_total`.
    pub const PROXY_ERROR_KINDS: &[&str] = &[
        "upstream_unreachable",
        "upstream_timeout",
        "request_too_large",
        "invalid_body",
        "request_timeout",
        "invalid_path",
        "method_not_allowed",
        "overloaded",
        "invalid_api_key",
        "shutting_down",
    ];

    /// The `cause` label of `condense_stream_interruptions_total`.
    pub const INTERRUPTION_CAUSES: &[&str] = &["idle_timeout", "upstream_error", "shutdown"];

    /// The `kind` label of `condense_upstream_invalid_responses_total`.
    pub const ANOMALIES: &[&str] = &["invalid_json", "sse_without_done", "sse_event_too_long"];

    /// The `provider_format` label of `condense_context_overflow_total`: the
    /// provider wordings the overflow table recognises, each once.
    pub const OVERFLOW_FORMATS: &[&str] = &[
        "llamacpp",
        "openai_tpm",
        "openrouter",
        "vllm",
        "openai",
        "anthropic",
        "mistral",
        "xai",
        "gemini",
    ];

    /// The `outcome` label of `condense_context_overflow_total`.
    pub const OVERFLOW_OUTCOMES: &[&str] = &["recovered", "failed", "not_recoverable"];

    /// The state store's operations, the `op` label of
    /// `condense_state_errors_total`.
    pub const STATE_OPS: &[&str] = &["get", "put", "lease", "release"];

    /// The `reason` label of `condense_connections_closed_total`.
    pub const CLOSE_REASONS: &[&str] = &["idle_timeout", "write_stalled", "evicted", "refused"];

    /// The `outcome` label of `condense_summarizer_calls_total`.
    pub const SUMMARIZER_OUTCOMES: &[&str] = &["ok", "reused", "error", "timeout"];

    /// The `reason` label of `condense_summary_fallbacks_total`.
    pub const FALLBACK_REASONS: &[&str] = &["failed", "cooldown"];

    /// The `outcome` label of `condense_prepare_jobs_total`.
    pub const JOB_OUTCOMES: &[&str] = &["run", "busy", "abandoned"];

    /// The `reason` label of `condense_stateful_requests_total`.
    pub const STATEFUL_REASONS: &[&str] = &["previous_response_id", "conversation"];

    /// The `outcome` label of `condense_agent_compactions_total`.
    pub const AGENT_COMPACTION_OUTCOMES: &[&str] = &["requested", "applied"];
}

use labels::*;

/// Distinct model label values kept before new ones are folded into "other".
const MAX_MODEL_LABELS: usize = 64;

/// Buckets for latencies spent inside condense: tens of microseconds to 1 s.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
/// Buckets for the upstream's time to first byte: 10 ms to 10 minutes.
const UPSTREAM_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

pub struct Metrics {
    registry: Registry,
    pub requests_total: IntCounterVec,
    pub upstream_seconds: HistogramVec,
    pub overhead_seconds: HistogramVec,
    pub upstream_prompt_tokens_total: IntCounterVec,
    pub upstream_completion_tokens_total: IntCounterVec,
    pub proxy_errors_total: IntCounterVec,
    pub stream_interruptions_total: IntCounterVec,
    pub inflight_requests: IntGauge,
    pub open_connections: IntGauge,
    pub connections_closed_total: IntCounterVec,
    pub token_cache_hits_total: IntCounter,
    pub token_cache_misses_total: IntCounter,
    pub calibration_ratio: GaugeVec,
    pub context_window_tokens: IntGaugeVec,
    pub pressure_ratio: Histogram,
    pub compaction_failures_total: IntCounter,
    pub compactions_total: IntCounterVec,
    pub tokens_saved_total: IntCounterVec,
    pub prompt_tokens_received_total: IntCounter,
    pub prompt_tokens_forwarded_total: IntCounter,
    pub summarizer_calls_total: IntCounterVec,
    pub summarizer_seconds: Histogram,
    pub summary_tokens: Histogram,
    pub summarizer_prompt_tokens_total: IntCounter,
    pub summary_fallbacks_total: IntCounterVec,
    pub state_errors_total: IntCounterVec,
    pub context_overflow_total: IntCounterVec,
    pub upstream_invalid_responses_total: IntCounterVec,
    pub stateful_requests_total: IntCounterVec,
    pub prepare_jobs_total: IntCounterVec,
    pub recalls_total: IntCounterVec,
    pub recalled_bytes_total: IntCounter,
    pub agent_compactions_total: IntCounterVec,
    /// Every metric name this registry exports.
    names: Vec<String>,
    /// Names are the client's, but the set is bounded: a cheap hash
    /// (SipHash took about 350 instructions a request) risks nothing.
    models_seen: Mutex<HashSet<String, xxhash_rust::xxh3::Xxh3Builder>>,
}

#[derive(Debug, thiserror::Error)]
#[error("metric registration failed: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

impl Metrics {
    pub fn new() -> Result<Metrics, MetricsError> {
        let registry = Registry::new();
        let requests_total = IntCounterVec::new(
            Opts::new(
                "condense_requests_total",
                "Requests answered, by route and status class of the response.",
            ),
            &["route", "status_class"],
        )?;
        let upstream_seconds = HistogramVec::new(
            HistogramOpts::new(
                "condense_upstream_seconds",
                "Upstream time to first byte: from sending the request to its response headers.",
            )
            .buckets(UPSTREAM_BUCKETS.to_vec()),
            &["route"],
        )?;
        let overhead_seconds = HistogramVec::new(
            HistogramOpts::new(
                "condense_overhead_seconds",
                "Time spent inside condense for a request, excluding the wait for the upstream.",
            )
            .buckets(OVERHEAD_BUCKETS.to_vec()),
            &["route"],
        )?;
        let upstream_prompt_tokens_total = IntCounterVec::new(
            Opts::new(
                "condense_upstream_prompt_tokens_total",
                "Prompt tokens the upstream reported in usage, by requested model.",
            ),
            &["model"],
        )?;
        let upstream_completion_tokens_total = IntCounterVec::new(
            Opts::new(
                "condense_upstream_completion_tokens_total",
                "Completion tokens the upstream reported in usage, by requested model.",
            ),
            &["model"],
        )?;
        let proxy_errors_total = IntCounterVec::new(
            Opts::new(
                "condense_proxy_errors_total",
                "Errors condense itself answered with (upstream unreachable, timeout, body too large, ...).",
            ),
            &["kind"],
        )?;
        let stream_interruptions_total = IntCounterVec::new(
            Opts::new(
                "condense_stream_interruptions_total",
                "Response bodies cut off after the headers were sent, by cause.",
            ),
            &["cause"],
        )?;
        let inflight_requests = IntGauge::new(
            "condense_inflight_requests",
            "Proxied requests currently in flight, streams included.",
        )?;
        let open_connections =
            IntGauge::new("condense_open_connections", "Client connections open now.")?;
        let connections_closed_total = IntCounterVec::new(
            Opts::new(
                "condense_connections_closed_total",
                "Client connections condense closed itself, by reason: idle_timeout (no request in flight for server.idle_timeout_seconds), write_stalled (the client stopped reading its response for that long), evicted (idle, to make room at server.max_connections), refused (over the cap with every connection busy; answered 503).",
            ),
            &["reason"],
        )?;
        for reason in CLOSE_REASONS {
            connections_closed_total.with_label_values(&[reason]);
        }
        let token_cache_hits_total = IntCounter::new(
            "condense_token_cache_hits_total",
            "Message token counts served from the per-message cache.",
        )?;
        let token_cache_misses_total = IntCounter::new(
            "condense_token_cache_misses_total",
            "Messages (and tool lists) tokenized because their count was not cached.",
        )?;
        let calibration_ratio = GaugeVec::new(
            Opts::new(
                "condense_calibration_ratio",
                "Upstream-reported prompt tokens / condense's raw estimate, per model (1.0 until observed).",
            ),
            &["model"],
        )?;
        let context_window_tokens = IntGaugeVec::new(
            Opts::new(
                "condense_context_window_tokens",
                "Context window condense applies to a model (profile, listing or default).",
            ),
            &["model"],
        )?;
        let pressure_ratio = Histogram::with_opts(
            HistogramOpts::new(
                "condense_pressure_ratio",
                "Calibrated prompt estimate / prompt budget of chat requests as received.",
            )
            .buckets(vec![
                0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0,
            ]),
        )?;
        let compaction_failures_total = IntCounter::new(
            "condense_compaction_failures_total",
            "Chat requests forwarded unchanged because measuring or compacting them failed inside condense.",
        )?;
        let compactions_total = IntCounterVec::new(
            Opts::new(
                "condense_compactions_total",
                "Chat requests a compaction stage changed, by stage.",
            ),
            &["stage"],
        )?;
        let tokens_saved_total = IntCounterVec::new(
            Opts::new(
                "condense_tokens_saved_total",
                "Prompt tokens (calibrated estimate) removed by each compaction stage.",
            ),
            &["stage"],
        )?;
        let prompt_tokens_received_total = IntCounter::new(
            "condense_prompt_tokens_received_total",
            "Prompt tokens (calibrated estimate) of chat requests as clients sent them.",
        )?;
        let prompt_tokens_forwarded_total = IntCounter::new(
            "condense_prompt_tokens_forwarded_total",
            "Prompt tokens (calibrated estimate) of chat requests as condense forwarded them.",
        )?;
        let summarizer_calls_total = IntCounterVec::new(
            Opts::new(
                "condense_summarizer_calls_total",
                "Checkpoints needed, by outcome: ok (written), reused (found stored or shared with a concurrent request), error (failed or unusable answer), timeout.",
            ),
            &["outcome"],
        )?;
        let summarizer_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "condense_summarizer_seconds",
                "Duration of summarizer calls, failed ones included.",
            )
            .buckets(UPSTREAM_BUCKETS.to_vec()),
        )?;
        let summary_tokens = Histogram::with_opts(
            HistogramOpts::new(
                "condense_summary_tokens",
                "Size of the checkpoints written, in tokens (the summarizer's completion tokens when reported).",
            )
            .buckets(vec![
                100.0, 250.0, 500.0, 750.0, 1000.0, 1500.0, 2000.0, 4000.0, 8000.0,
            ]),
        )?;
        let summarizer_prompt_tokens_total = IntCounter::new(
            "condense_summarizer_prompt_tokens_total",
            "Prompt tokens of the summarizer calls that wrote a checkpoint (as the summarizer reported them).",
        )?;
        let summary_fallbacks_total = IntCounterVec::new(
            Opts::new(
                "condense_summary_fallbacks_total",
                "Requests that needed a checkpoint and dropped old turns mechanically instead, by reason (failed, cooldown).",
            ),
            &["reason"],
        )?;
        let state_errors_total = IntCounterVec::new(
            Opts::new(
                "condense_state_errors_total",
                "State store (Redis) operations that failed or timed out and were treated as misses, by operation.",
            ),
            &["op"],
        )?;
        // Known label values start at zero, so dashboards see the series.
        for outcome in SUMMARIZER_OUTCOMES {
            summarizer_calls_total.with_label_values(&[outcome]);
        }
        for reason in FALLBACK_REASONS {
            summary_fallbacks_total.with_label_values(&[reason]);
        }
        let context_overflow_total = IntCounterVec::new(
            Opts::new(
                "condense_context_overflow_total",
                "Upstream context-overflow errors, by provider wording and outcome: recovered (the retry succeeded), failed (the retry was rejected too), not_recoverable (no smaller request could be made).",
            ),
            &["provider_format", "outcome"],
        )?;
        let prepare_jobs_total = IntCounterVec::new(
            Opts::new(
                "condense_prepare_jobs_total",
                "Jobs that prepare a body of 128 KB or more off the async workers (parsing one, or counting and compacting it), by outcome: run; busy (the lane's queue was full, so the request went upstream as it came); abandoned (the client went away while the job waited, so it never ran).",
            ),
            &["outcome"],
        )?;
        for outcome in JOB_OUTCOMES {
            prepare_jobs_total.with_label_values(&[outcome]);
        }
        let stateful_requests_total = IntCounterVec::new(
            Opts::new(
                "condense_stateful_requests_total",
                "Responses requests whose history is on the server, forwarded unchanged because there is nothing to compact, by what holds it: previous_response_id, conversation.",
            ),
            &["reason"],
        )?;
        for reason in STATEFUL_REASONS {
            stateful_requests_total.with_label_values(&[reason]);
        }
        let recalls_total = IntCounterVec::new(
            Opts::new(
                "condense_recalls_total",
                "Calls of condense_recall, by outcome: answered (the original went back to the model), unknown_key (no original under that key, or it expired), limit_reached (compaction.max_recalls answered already; taken out of the answer), stripped (made after text was streamed to the client; taken out), failed (the request carrying the result failed; the answer went to the client without the call).",
            ),
            &["outcome"],
        )?;
        for outcome in RECALL_OUTCOMES {
            recalls_total.with_label_values(&[outcome]);
        }
        let recalled_bytes_total = IntCounter::new(
            "condense_recalled_bytes_total",
            "Bytes of originals condense gave back to models through condense_recall.",
        )?;
        let agent_compactions_total = IntCounterVec::new(
            Opts::new(
                "condense_agent_compactions_total",
                "compress_context (compaction.agent_tool) by outcome: requested (the model called it; the point was recorded), applied (a later request was compacted up to a recorded point).",
            ),
            &["outcome"],
        )?;
        for outcome in AGENT_COMPACTION_OUTCOMES {
            agent_compactions_total.with_label_values(&[outcome]);
        }
        let upstream_invalid_responses_total = IntCounterVec::new(
            Opts::new(
                "condense_upstream_invalid_responses_total",
                "Successful chat responses that ended malformed and were passed on as they were, by kind (invalid_json: not UTF-8 or not a JSON object by its structure; sse_without_done, sse_event_too_long).",
            ),
            &["kind"],
        )?;
        // Known label values start at zero, so dashboards show 0 rather
        // than "no data" until the first event.
        for kind in PROXY_ERROR_KINDS {
            proxy_errors_total.with_label_values(&[kind]);
        }
        for cause in INTERRUPTION_CAUSES {
            stream_interruptions_total.with_label_values(&[cause]);
        }
        for kind in ANOMALIES {
            upstream_invalid_responses_total.with_label_values(&[kind]);
        }
        for format in OVERFLOW_FORMATS {
            for outcome in OVERFLOW_OUTCOMES {
                context_overflow_total.with_label_values(&[format, outcome]);
            }
        }
        for op in STATE_OPS {
            state_errors_total.with_label_values(&[op]);
        }
        let mut names = Vec::new();
        let mut register = |c: Box<dyn Collector>| {
            names.extend(c.desc().iter().map(|d| d.fq_name.clone()));
            registry.register(c)
        };
        for stage in STAGES {
            compactions_total.with_label_values(&[stage]);
            tokens_saved_total.with_label_values(&[stage]);
        }
        register(Box::new(context_overflow_total.clone()))?;
        register(Box::new(upstream_invalid_responses_total.clone()))?;
        register(Box::new(stateful_requests_total.clone()))?;
        register(Box::new(prepare_jobs_total.clone()))?;
        register(Box::new(recalls_total.clone()))?;
        register(Box::new(recalled_bytes_total.clone()))?;
        register(Box::new(agent_compactions_total.clone()))?;
        register(Box::new(summarizer_calls_total.clone()))?;
        register(Box::new(summarizer_seconds.clone()))?;
        register(Box::new(summary_tokens.clone()))?;
        register(Box::new(summarizer_prompt_tokens_total.clone()))?;
        register(Box::new(summary_fallbacks_total.clone()))?;
        register(Box::new(state_errors_total.clone()))?;
        register(Box::new(compactions_total.clone()))?;
        register(Box::new(tokens_saved_total.clone()))?;
        register(Box::new(prompt_tokens_received_total.clone()))?;
        register(Box::new(prompt_tokens_forwarded_total.clone()))?;
        register(Box::new(compaction_failures_total.clone()))?;
        register(Box::new(token_cache_hits_total.clone()))?;
        register(Box::new(token_cache_misses_total.clone()))?;
        register(Box::new(calibration_ratio.clone()))?;
        register(Box::new(context_window_tokens.clone()))?;
        register(Box::new(pressure_ratio.clone()))?;
        register(Box::new(requests_total.clone()))?;
        register(Box::new(upstream_seconds.clone()))?;
        register(Box::new(overhead_seconds.clone()))?;
        register(Box::new(upstream_prompt_tokens_total.clone()))?;
        register(Box::new(upstream_completion_tokens_total.clone()))?;
        register(Box::new(proxy_errors_total.clone()))?;
        register(Box::new(stream_interruptions_total.clone()))?;
        register(Box::new(inflight_requests.clone()))?;
        register(Box::new(open_connections.clone()))?;
        register(Box::new(connections_closed_total.clone()))?;
        Ok(Metrics {
            registry,
            requests_total,
            upstream_seconds,
            overhead_seconds,
            upstream_prompt_tokens_total,
            upstream_completion_tokens_total,
            proxy_errors_total,
            stream_interruptions_total,
            inflight_requests,
            open_connections,
            connections_closed_total,
            token_cache_hits_total,
            token_cache_misses_total,
            calibration_ratio,
            context_window_tokens,
            pressure_ratio,
            compaction_failures_total,
            compactions_total,
            tokens_saved_total,
            prompt_tokens_received_total,
            prompt_tokens_forwarded_total,
            summarizer_calls_total,
            summarizer_seconds,
            summary_tokens,
            summarizer_prompt_tokens_total,
            summary_fallbacks_total,
            state_errors_total,
            context_overflow_total,
            upstream_invalid_responses_total,
            stateful_requests_total,
            prepare_jobs_total,
            recalls_total,
            recalled_bytes_total,
            agent_compactions_total,
            names,
            models_seen: Mutex::new(HashSet::default()),
        })
    }

    /// The name of every metric condense exports (each also appears in
    /// [`Metrics::render`] once it has a value).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The label value to use for a client-supplied model name: the name
    /// itself, or `other` once [`MAX_MODEL_LABELS`] names are in use.
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        let Ok(mut seen) = self.models_seen.lock() else {
            return "other";
        };
        if seen.contains(model) {
            return model;
        }
        if seen.len() < MAX_MODEL_LABELS && model.len() <= 128 {
            seen.insert(model.to_string());
            return model;
        }
        "other"
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
