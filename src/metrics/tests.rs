use super::*;

/// The names, label names and help texts: the contract dashboards and
/// the README rely on, so a change here is a deliberate one.
#[test]
fn every_metric_is_exported_with_its_labels_and_help() {
    let metrics = Metrics::new().unwrap();
    let mut exported: Vec<(String, Vec<String>, String)> = metrics
        .collectors()
        .iter()
        .flat_map(|c| c.desc().into_iter().cloned().collect::<Vec<_>>())
        .map(|d| (d.fq_name, d.variable_labels, d.help))
        .collect();
    exported.sort();
    let expected: &[(&str, &[&str], &str)] = &[
        (
            "condense_agent_compactions_total",
            &["outcome"],
            "compress_context (compaction.agent_tool) by outcome: requested (the model called it; the point was recorded), applied (a later request was compacted up to a recorded point).",
        ),
        (
            "condense_calibration_ratio",
            &["model"],
            "Upstream-reported prompt tokens / condense's raw estimate, per model (1.0 until observed).",
        ),
        (
            "condense_compaction_failures_total",
            &[],
            "Chat requests forwarded unchanged because measuring or compacting them failed inside condense.",
        ),
        (
            "condense_compactions_total",
            &["stage"],
            "Chat requests a compaction stage changed, by stage.",
        ),
        (
            "condense_connections_closed_total",
            &["reason"],
            "Client connections condense closed itself, by reason: idle_timeout (no request in flight for server.idle_timeout_seconds), write_stalled (the client stopped reading its response for that long), evicted (idle, to make room at server.max_connections), refused (over the cap with every connection busy; answered 503).",
        ),
        (
            "condense_context_overflow_total",
            &["provider_format", "outcome"],
            "Upstream context-overflow errors, by provider wording and outcome: recovered (the retry succeeded), failed (the retry was rejected too), not_recoverable (no smaller request could be made).",
        ),
        (
            "condense_context_window_tokens",
            &["model"],
            "Context window condense applies to a model (profile, listing or default).",
        ),
        (
            "condense_inflight_requests",
            &[],
            "Proxied requests currently in flight, streams included.",
        ),
        (
            "condense_open_connections",
            &[],
            "Client connections open now.",
        ),
        (
            "condense_overhead_seconds",
            &["route"],
            "Time spent inside condense for a request, excluding the wait for the upstream.",
        ),
        (
            "condense_prepare_jobs_total",
            &["outcome"],
            "Jobs that prepare a body of 128 KB or more off the async workers (parsing one, or counting and compacting it), by outcome: run; busy (the lane's queue was full, so the request went upstream as it came); abandoned (the client went away while the job waited, so it never ran).",
        ),
        (
            "condense_pressure_ratio",
            &[],
            "Calibrated prompt estimate / prompt budget of chat requests as received.",
        ),
        (
            "condense_prompt_tokens_forwarded_total",
            &[],
            "Prompt tokens (calibrated estimate) of chat requests as condense forwarded them.",
        ),
        (
            "condense_prompt_tokens_received_total",
            &[],
            "Prompt tokens (calibrated estimate) of chat requests as clients sent them.",
        ),
        (
            "condense_proxy_errors_total",
            &["kind"],
            "Errors condense itself answered with (upstream unreachable, timeout, body too large, ...).",
        ),
        (
            "condense_recalled_bytes_total",
            &[],
            "Bytes of originals condense gave back to models through condense_recall.",
        ),
        (
            "condense_recalls_total",
            &["outcome"],
            "Calls of condense_recall, by outcome: answered (the original went back to the model), unknown_key (no original under that key, or it expired), limit_reached (compaction.max_recalls answered already; taken out of the answer), stripped (made in a stream that went out and could not go on: an event or answer past condense's limits; taken out), failed (the request carrying the result failed; the answer went to the client without the call).",
        ),
        (
            "condense_requests_total",
            &["route", "status_class"],
            "Requests answered, by route and status class of the response.",
        ),
        (
            "condense_state_errors_total",
            &["op"],
            "State store (Redis) operations that failed or timed out and were treated as misses, by operation.",
        ),
        (
            "condense_stateful_requests_total",
            &["reason"],
            "Responses requests whose history is on the server, forwarded unchanged because there is nothing to compact, by what holds it: previous_response_id, conversation.",
        ),
        (
            "condense_stream_interruptions_total",
            &["cause"],
            "Response bodies cut off after the headers were sent, by cause.",
        ),
        (
            "condense_summarizer_calls_total",
            &["outcome"],
            "Checkpoints needed, by outcome: ok (written), reused (found stored or shared with a concurrent request), error (failed or unusable answer), timeout.",
        ),
        (
            "condense_summarizer_prompt_tokens_total",
            &[],
            "Prompt tokens of the summarizer calls that wrote a checkpoint (as the summarizer reported them).",
        ),
        (
            "condense_summarizer_seconds",
            &[],
            "Duration of summarizer calls, failed ones included.",
        ),
        (
            "condense_summary_fallbacks_total",
            &["reason"],
            "Requests that needed a checkpoint and dropped old turns mechanically instead, by reason (failed, cooldown).",
        ),
        (
            "condense_summary_tokens",
            &[],
            "Size of the checkpoints written, in tokens (the summarizer's completion tokens when reported).",
        ),
        (
            "condense_token_cache_hits_total",
            &[],
            "Message token counts served from the per-message cache.",
        ),
        (
            "condense_token_cache_misses_total",
            &[],
            "Messages (and tool lists) tokenized because their count was not cached.",
        ),
        (
            "condense_tokens_saved_total",
            &["stage"],
            "Prompt tokens (calibrated estimate) removed by each compaction stage.",
        ),
        (
            "condense_upstream_completion_tokens_total",
            &["model"],
            "Completion tokens the upstream reported in usage, by requested model.",
        ),
        (
            "condense_upstream_invalid_responses_total",
            &["kind"],
            "Successful chat responses that ended malformed and were passed on as they were, by kind (invalid_json: not UTF-8 or not a JSON object by its structure; sse_without_done, sse_event_too_long).",
        ),
        (
            "condense_upstream_prompt_tokens_total",
            &["model"],
            "Prompt tokens the upstream reported in usage, by requested model.",
        ),
        (
            "condense_upstream_seconds",
            &["route"],
            "Upstream time to first byte: from sending the request to its response headers.",
        ),
        (
            "condense_websocket_responses_total",
            &["outcome"],
            "response.create messages on Responses WebSockets, by outcome: completed (streamed to its end, its output remembered), incomplete (ended with response.incomplete, at max_output_tokens say; its output remembered too, as it can be continued), warmup (generate: false, answered at once), failed (the request got an error, or its stream ended early), refused (not a response.create condense reads, an unknown previous_response_id, or too large).",
        ),
        (
            "condense_websockets_open",
            &[],
            "Responses WebSockets open now.",
        ),
    ];
    assert_eq!(exported.len(), expected.len());
    for ((name, labels, help), (want_name, want_labels, want_help)) in exported.iter().zip(expected)
    {
        assert_eq!(name, want_name);
        assert_eq!(labels, want_labels, "{name}");
        assert_eq!(help, want_help, "{name}");
    }
    let mut names = metrics.names().to_vec();
    names.sort();
    assert_eq!(names, expected.iter().map(|e| e.0).collect::<Vec<_>>());
}

#[test]
fn known_series_are_every_combination_of_known_values() {
    let spec = |labels| Spec {
        name: "x",
        help: "x",
        labels,
        buckets: &[],
    };
    assert!(spec(&[]).known_series().is_empty());
    assert!(spec(&[("route", OPEN)]).known_series().is_empty());
    assert!(
        spec(&[("a", &["1", "2"]), ("b", OPEN)])
            .known_series()
            .is_empty()
    );
    assert_eq!(
        spec(&[("a", &["1", "2"]), ("b", &["x", "y"])]).known_series(),
        [["1", "x"], ["1", "y"], ["2", "x"], ["2", "y"]]
    );
}
