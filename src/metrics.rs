//! The metric registry. Every metric condense exports is declared here, once,
//! in the `metrics!` table, so the names (the contract Prometheus dashboards
//! rely on) live in one file and adding a metric is one entry.
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

use prometheus::core::{Collector, MetricVec, MetricVecBuilder};
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The label values that are known in advance. A metric's series for these
/// start at zero, so dashboards show 0 rather than "no data" until the first
/// event.
pub mod labels {
    /// A label whose values are not known in advance (route, model, ...):
    /// none of its series is pre-created.
    pub const OPEN: &[&str] = &[];

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

    /// The `outcome` label of `condense_websocket_responses_total`.
    pub const WEBSOCKET_OUTCOMES: &[&str] =
        &["completed", "incomplete", "warmup", "failed", "refused"];

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
    pub const STATE_OPS: &[&str] = &["get", "put", "lease", "release", "mget", "swap"];

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
/// Buckets for a prompt's size against its budget.
const PRESSURE_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0,
];
/// Buckets for a checkpoint's size in tokens.
const SUMMARY_BUCKETS: &[f64] = &[
    100.0, 250.0, 500.0, 750.0, 1000.0, 1500.0, 2000.0, 4000.0, 8000.0,
];

/// Declares [`Metrics`]: one public field per entry, built from its name,
/// help, labels (each with the values whose series start at zero; the
/// series pre-created are every combination of them) and, for histograms,
/// buckets, and registered.
macro_rules! metrics {
    (@buckets) => { &[] };
    (@buckets $buckets:expr) => { $buckets };
    ($(
        $field:ident: $ty:ident {
            name: $name:literal,
            help: $help:literal
            $(, labels: [$(($label:literal, $values:expr)),+ $(,)?])?
            $(, buckets: $buckets:expr)?
            $(,)?
        }
    ),+ $(,)?) => {
        pub struct Metrics {
            registry: Registry,
            $(pub $field: $ty,)+
            /// Every metric name this registry exports.
            names: Vec<String>,
            /// Names are the client's, but the set is bounded: a cheap hash
            /// (SipHash took about 350 instructions a request) risks nothing.
            models_seen: Mutex<HashSet<String, xxhash_rust::xxh3::Xxh3Builder>>,
        }

        impl Metrics {
            pub fn new() -> Result<Metrics, MetricsError> {
                let registry = Registry::new();
                let mut names = Vec::new();
                $(
                    let $field: $ty = declare(
                        &Spec {
                            name: $name,
                            help: $help,
                            labels: &[$($(($label, $values)),+)?],
                            buckets: metrics!(@buckets $($buckets)?),
                        },
                        &registry,
                        &mut names,
                    )?;
                )+
                Ok(Metrics {
                    registry,
                    $($field,)+
                    names,
                    models_seen: Mutex::new(HashSet::default()),
                })
            }

            /// Every metric, to read their descriptions in tests.
            #[cfg(test)]
            fn collectors(&self) -> Vec<Box<dyn Collector>> {
                vec![$(Box::new(self.$field.clone())),+]
            }
        }
    };
}

metrics! {
    requests_total: IntCounterVec {
        name: "condense_requests_total",
        help: "Requests answered, by route and status class of the response.",
        labels: [("route", OPEN), ("status_class", OPEN)],
    },
    upstream_seconds: HistogramVec {
        name: "condense_upstream_seconds",
        help: "Upstream time to first byte: from sending the request to its response headers.",
        labels: [("route", OPEN)],
        buckets: UPSTREAM_BUCKETS,
    },
    overhead_seconds: HistogramVec {
        name: "condense_overhead_seconds",
        help: "Time spent inside condense for a request, excluding the wait for the upstream.",
        labels: [("route", OPEN)],
        buckets: OVERHEAD_BUCKETS,
    },
    upstream_prompt_tokens_total: IntCounterVec {
        name: "condense_upstream_prompt_tokens_total",
        help: "Prompt tokens the upstream reported in usage, by requested model.",
        labels: [("model", OPEN)],
    },
    upstream_completion_tokens_total: IntCounterVec {
        name: "condense_upstream_completion_tokens_total",
        help: "Completion tokens the upstream reported in usage, by requested model.",
        labels: [("model", OPEN)],
    },
    proxy_errors_total: IntCounterVec {
        name: "condense_proxy_errors_total",
        help: "Errors condense itself answered with (upstream unreachable, timeout, body too large, ...).",
        labels: [("kind", PROXY_ERROR_KINDS)],
    },
    stream_interruptions_total: IntCounterVec {
        name: "condense_stream_interruptions_total",
        help: "Response bodies cut off after the headers were sent, by cause.",
        labels: [("cause", INTERRUPTION_CAUSES)],
    },
    inflight_requests: IntGauge {
        name: "condense_inflight_requests",
        help: "Proxied requests currently in flight, streams included.",
    },
    websockets_open: IntGauge {
        name: "condense_websockets_open",
        help: "Responses WebSockets open now.",
    },
    websocket_responses_total: IntCounterVec {
        name: "condense_websocket_responses_total",
        help: "response.create messages on Responses WebSockets, by outcome: completed (streamed to its end, its output remembered), incomplete (ended with response.incomplete, at max_output_tokens say; its output remembered too, as it can be continued), warmup (generate: false, answered at once), failed (the request got an error, or its stream ended early), refused (not a response.create condense reads, an unknown previous_response_id, or too large).",
        labels: [("outcome", WEBSOCKET_OUTCOMES)],
    },
    open_connections: IntGauge {
        name: "condense_open_connections",
        help: "Client connections open now.",
    },
    connections_closed_total: IntCounterVec {
        name: "condense_connections_closed_total",
        help: "Client connections condense closed itself, by reason: idle_timeout (no request in flight for server.idle_timeout_seconds), write_stalled (the client stopped reading its response for that long), evicted (idle, to make room at server.max_connections), refused (over the cap with every connection busy; answered 503).",
        labels: [("reason", CLOSE_REASONS)],
    },
    token_cache_hits_total: IntCounter {
        name: "condense_token_cache_hits_total",
        help: "Message token counts served from the per-message cache.",
    },
    token_cache_misses_total: IntCounter {
        name: "condense_token_cache_misses_total",
        help: "Messages (and tool lists) tokenized because their count was not cached.",
    },
    calibration_ratio: GaugeVec {
        name: "condense_calibration_ratio",
        help: "Upstream-reported prompt tokens / condense's raw estimate, per model (1.0 until observed).",
        labels: [("model", OPEN)],
    },
    context_window_tokens: IntGaugeVec {
        name: "condense_context_window_tokens",
        help: "Context window condense applies to a model (profile, listing or default).",
        labels: [("model", OPEN)],
    },
    pressure_ratio: Histogram {
        name: "condense_pressure_ratio",
        help: "Calibrated prompt estimate / prompt budget of chat requests as received.",
        buckets: PRESSURE_BUCKETS,
    },
    compaction_failures_total: IntCounter {
        name: "condense_compaction_failures_total",
        help: "Chat requests forwarded unchanged because measuring or compacting them failed inside condense.",
    },
    compactions_total: IntCounterVec {
        name: "condense_compactions_total",
        help: "Chat requests a compaction stage changed, by stage.",
        labels: [("stage", STAGES)],
    },
    tokens_saved_total: IntCounterVec {
        name: "condense_tokens_saved_total",
        help: "Prompt tokens (calibrated estimate) removed by each compaction stage.",
        labels: [("stage", STAGES)],
    },
    prompt_tokens_received_total: IntCounter {
        name: "condense_prompt_tokens_received_total",
        help: "Prompt tokens (calibrated estimate) of chat requests as clients sent them.",
    },
    prompt_tokens_forwarded_total: IntCounter {
        name: "condense_prompt_tokens_forwarded_total",
        help: "Prompt tokens (calibrated estimate) of chat requests as condense forwarded them.",
    },
    summarizer_calls_total: IntCounterVec {
        name: "condense_summarizer_calls_total",
        help: "Checkpoints needed, by outcome: ok (written), reused (found stored or shared with a concurrent request), error (failed or unusable answer), timeout.",
        labels: [("outcome", SUMMARIZER_OUTCOMES)],
    },
    summarizer_seconds: Histogram {
        name: "condense_summarizer_seconds",
        help: "Duration of summarizer calls, failed ones included.",
        buckets: UPSTREAM_BUCKETS,
    },
    summary_tokens: Histogram {
        name: "condense_summary_tokens",
        help: "Size of the checkpoints written, in tokens (the summarizer's completion tokens when reported).",
        buckets: SUMMARY_BUCKETS,
    },
    summarizer_prompt_tokens_total: IntCounter {
        name: "condense_summarizer_prompt_tokens_total",
        help: "Prompt tokens of the summarizer calls that wrote a checkpoint (as the summarizer reported them).",
    },
    summary_fallbacks_total: IntCounterVec {
        name: "condense_summary_fallbacks_total",
        help: "Requests that needed a checkpoint and dropped old turns mechanically instead, by reason (failed, cooldown).",
        labels: [("reason", FALLBACK_REASONS)],
    },
    state_errors_total: IntCounterVec {
        name: "condense_state_errors_total",
        help: "State store (Redis) operations that failed or timed out and were treated as misses, by operation.",
        labels: [("op", STATE_OPS)],
    },
    context_overflow_total: IntCounterVec {
        name: "condense_context_overflow_total",
        help: "Upstream context-overflow errors, by provider wording and outcome: recovered (the retry succeeded), failed (the retry was rejected too), not_recoverable (no smaller request could be made).",
        labels: [("provider_format", OVERFLOW_FORMATS), ("outcome", OVERFLOW_OUTCOMES)],
    },
    upstream_invalid_responses_total: IntCounterVec {
        name: "condense_upstream_invalid_responses_total",
        help: "Successful chat responses that ended malformed and were passed on as they were, by kind (invalid_json: not UTF-8 or not a JSON object by its structure; sse_without_done, sse_event_too_long).",
        labels: [("kind", ANOMALIES)],
    },
    stateful_requests_total: IntCounterVec {
        name: "condense_stateful_requests_total",
        help: "Responses requests whose history is on the server, forwarded unchanged because there is nothing to compact, by what holds it: previous_response_id, conversation.",
        labels: [("reason", STATEFUL_REASONS)],
    },
    prepare_jobs_total: IntCounterVec {
        name: "condense_prepare_jobs_total",
        help: "Jobs that prepare a body of 128 KB or more off the async workers (parsing one, or counting and compacting it), by outcome: run; busy (the lane's queue was full, so the request went upstream as it came); abandoned (the client went away while the job waited, so it never ran).",
        labels: [("outcome", JOB_OUTCOMES)],
    },
    recalls_total: IntCounterVec {
        name: "condense_recalls_total",
        help: "Calls of condense_recall, by outcome: answered (the original went back to the model), unknown_key (no original under that key, or it expired), limit_reached (compaction.max_recalls answered already; taken out of the answer), stripped (made in a stream that went out and could not go on: an event or answer past condense's limits; taken out), failed (the request carrying the result failed; the answer went to the client without the call).",
        labels: [("outcome", RECALL_OUTCOMES)],
    },
    recalled_bytes_total: IntCounter {
        name: "condense_recalled_bytes_total",
        help: "Bytes of originals condense gave back to models through condense_recall.",
    },
    agent_compactions_total: IntCounterVec {
        name: "condense_agent_compactions_total",
        help: "compress_context (compaction.agent_tool) by outcome: requested (the model called it; the point was recorded), applied (a later request was compacted up to a recorded point).",
        labels: [("outcome", AGENT_COMPACTION_OUTCOMES)],
    },
}

#[derive(Debug, thiserror::Error)]
#[error("metric registration failed: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

/// One entry of the `metrics!` table.
struct Spec {
    name: &'static str,
    help: &'static str,
    /// Each label's name and the values whose series start at zero.
    labels: &'static [(&'static str, &'static [&'static str])],
    /// Histograms only (prometheus's default buckets when empty).
    buckets: &'static [f64],
}

impl Spec {
    fn opts(&self) -> Opts {
        Opts::new(self.name, self.help)
    }

    fn histogram_opts(&self) -> HistogramOpts {
        HistogramOpts::new(self.name, self.help).buckets(self.buckets.to_vec())
    }

    fn label_names(&self) -> Vec<&'static str> {
        self.labels.iter().map(|(name, _)| *name).collect()
    }

    /// Every combination of the labels' known values: none when a label is
    /// open (or there are no labels).
    fn known_series(&self) -> Vec<Vec<&'static str>> {
        if self.labels.is_empty() {
            return Vec::new();
        }
        let mut series = vec![Vec::new()];
        for (_, values) in self.labels {
            series = series
                .iter()
                .flat_map(|prefix| {
                    values.iter().map(move |v| {
                        let mut s = prefix.clone();
                        s.push(*v);
                        s
                    })
                })
                .collect();
        }
        series
    }
}

/// A metric type the `metrics!` table can declare.
trait Declare: Collector + Clone + Sized + 'static {
    fn build(spec: &Spec) -> prometheus::Result<Self>;

    /// Creates the series of the labels' known values.
    fn start_known_series(&self, _spec: &Spec) -> prometheus::Result<()> {
        Ok(())
    }
}

/// Builds one metric, starts its known series at zero and registers it.
fn declare<M: Declare>(
    spec: &Spec,
    registry: &Registry,
    names: &mut Vec<String>,
) -> prometheus::Result<M> {
    let metric = M::build(spec)?;
    metric.start_known_series(spec)?;
    names.extend(metric.desc().iter().map(|d| d.fq_name.clone()));
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn start_series<T: MetricVecBuilder>(vec: &MetricVec<T>, spec: &Spec) -> prometheus::Result<()> {
    for values in spec.known_series() {
        vec.get_metric_with_label_values(&values)?;
    }
    Ok(())
}

impl Declare for IntCounter {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        IntCounter::with_opts(spec.opts())
    }
}

impl Declare for IntGauge {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        IntGauge::with_opts(spec.opts())
    }
}

impl Declare for Histogram {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        Histogram::with_opts(spec.histogram_opts())
    }
}

impl Declare for IntCounterVec {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        IntCounterVec::new(spec.opts(), &spec.label_names())
    }

    fn start_known_series(&self, spec: &Spec) -> prometheus::Result<()> {
        start_series(self, spec)
    }
}

impl Declare for IntGaugeVec {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        IntGaugeVec::new(spec.opts(), &spec.label_names())
    }

    fn start_known_series(&self, spec: &Spec) -> prometheus::Result<()> {
        start_series(self, spec)
    }
}

impl Declare for GaugeVec {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        GaugeVec::new(spec.opts(), &spec.label_names())
    }

    fn start_known_series(&self, spec: &Spec) -> prometheus::Result<()> {
        start_series(self, spec)
    }
}

impl Declare for HistogramVec {
    fn build(spec: &Spec) -> prometheus::Result<Self> {
        HistogramVec::new(spec.histogram_opts(), &spec.label_names())
    }

    fn start_known_series(&self, spec: &Spec) -> prometheus::Result<()> {
        start_series(self, spec)
    }
}

impl Metrics {
    /// The name of every metric condense exports (each also appears in
    /// [`Metrics::render`] once it has a value).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The label value to use for a client-supplied model name: the name
    /// itself, or `other` once `MAX_MODEL_LABELS` names are in use.
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

#[cfg(test)]
mod tests;
