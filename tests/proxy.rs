//! The proxy as a client sees it: condense in front of a mock upstream.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Harness, chat_body};
use futures_util::StreamExt;
use serde_json::{Value, json};

async fn post_chat(h: &Harness, body: &Value) -> reqwest::Response {
    h.client
        .post(h.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-client")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn any_path_is_forwarded_with_method_query_headers_and_body() {
    let h = Harness::start().await;
    let resp = h
        .client
        .post(h.url("/v1/embeddings?api-version=2024&x=1"))
        .header("openai-organization", "org-42")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "must-not-pass")
        .body("{\"input\":\"abc\"}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-mock-echo"], "yes");
    let rec = h.mock.last();
    assert_eq!(rec.method, "POST");
    assert_eq!(rec.path, "/v1/embeddings");
    assert_eq!(rec.query.as_deref(), Some("api-version=2024&x=1"));
    assert_eq!(rec.headers["openai-organization"], "org-42");
    assert!(
        !rec.headers.contains_key("x-hop"),
        "hop-by-hop header leaked"
    );
    assert_eq!(rec.headers["host"], h.mock.addr.to_string());
    assert_eq!(&rec.body[..], b"{\"input\":\"abc\"}");

    // The same path without /v1 maps to the same upstream path.
    let resp = h
        .client
        .delete(h.url("/files/file-1"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rec = h.mock.last();
    assert_eq!(
        (rec.method.as_str(), rec.path.as_str()),
        ("DELETE", "/v1/files/file-1")
    );
}

#[tokio::test]
async fn models_listing_is_passed_through_without_a_body() {
    let h = Harness::start().await;
    let resp = h.client.get(h.url("/v1/models")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["data"][0]["id"], "gpt-4o");
    let rec = h.mock.last();
    assert_eq!(rec.method, "GET");
    assert!(rec.body.is_empty());
    assert!(!rec.headers.contains_key("transfer-encoding"));
}

#[tokio::test]
async fn upstream_errors_pass_through_unchanged() {
    let h = Harness::start().await;
    let body = r#"{"error":{"message":"Rate limit reached for gpt-4o","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
    for path in ["/v1/chat/completions", "/v1/embeddings"] {
        let resp = h
            .client
            .post(h.url(path))
            .header("x-mock-status", "429")
            .header("x-mock-body", body)
            .body(chat_body(false).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(resp.headers()["retry-after"], "7");
        assert_eq!(resp.text().await.unwrap(), body);
    }
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-status", "503")
        .body(chat_body(false).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.text().await.unwrap().contains("mock failure"));
}

#[tokio::test]
async fn chat_body_with_unknown_fields_reaches_upstream_byte_for_byte() {
    let h = Harness::start().await;
    let raw = "{ \"model\" : \"gpt-4o\", \"vendor_ext\": {\"deep\": [1, {\"x\": null}]},\n \"messages\": [ {\"role\":\"user\", \"content\":[{\"type\":\"text\",\"text\":\"h\\u00e9\",\"cache_control\":{\"type\":\"ephemeral\"}}], \"x-meta\": 5} ] }";
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(raw)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(std::str::from_utf8(&h.mock.last().body).unwrap(), raw);
}

#[tokio::test]
async fn streamed_chat_gets_usage_injected_and_stripped() {
    let h = Harness::start().await;
    let resp = post_chat(&h, &chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = resp.text().await.unwrap();
    // The upstream was asked for usage ...
    let sent = h.mock.last().json();
    assert_eq!(sent["stream_options"]["include_usage"], json!(true));
    // ... and the client, which did not ask, sees none of it.
    assert!(!text.contains("usage"), "{text}");
    assert!(text.contains("\"content\":\"Hello\""));
    assert!(text.ends_with("data: [DONE]\n\n"));
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 5, "{text}");
    // condense read the usage all the same.
    let expected = (sent.to_string().len() / 4) as f64;
    let seen = h
        .metric("condense_upstream_prompt_tokens_total{model=\"gpt-4o\"}")
        .await
        .unwrap();
    assert!((seen - expected).abs() <= 2.0, "{seen} vs {expected}");
}

#[tokio::test]
async fn streamed_chat_that_asked_for_usage_gets_it_verbatim() {
    let h = Harness::start().await;
    let mut body = chat_body(true);
    body["stream_options"] = json!({"include_usage": true});
    let text = post_chat(&h, &body).await.text().await.unwrap();
    let usage_event = text
        .split("\n\n")
        .find(|e| e.contains("\"choices\":[]"))
        .expect("no usage-only chunk");
    assert!(usage_event.contains("\"prompt_tokens\":"), "{text}");
    assert_eq!(text.matches("\"usage\":null").count(), 4);
    // The request went out unchanged.
    assert_eq!(h.mock.last().json(), body);
}

#[tokio::test]
async fn opt_out_header_forwards_the_stream_request_untouched() {
    let h = Harness::start().await;
    let raw = chat_body(true).to_string();
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-condense", "off")
        .body(raw.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rec = h.mock.last();
    assert_eq!(std::str::from_utf8(&rec.body).unwrap(), raw);
    assert!(!rec.headers.contains_key("x-condense"));
}

#[tokio::test]
async fn json_chat_usage_is_recorded_per_model() {
    let h = Harness::start().await;
    let resp = post_chat(&h, &chat_body(false)).await;
    assert_eq!(resp.status(), 200);
    // The upstream's own request id reaches the client.
    assert_eq!(resp.headers()["x-request-id"], "req_mock_upstream");
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        h.metric("condense_upstream_prompt_tokens_total{model=\"gpt-4o\"}")
            .await,
        Some(prompt as f64)
    );
}

#[tokio::test]
async fn stream_reaches_the_client_before_the_upstream_has_finished() {
    let h = Harness::start().await;
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-chunk-delay-ms", "300")
        .body(chat_body(true).to_string())
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(std::str::from_utf8(&first).unwrap().contains("Hello"));
    assert!(
        !h.mock.state.stream_finished.load(Ordering::SeqCst),
        "the first chunk only arrived after the upstream finished: the stream was buffered"
    );
    let mut rest = Vec::new();
    while let Some(c) = body.next().await {
        rest.extend_from_slice(&c.unwrap());
    }
    assert!(h.mock.state.stream_finished.load(Ordering::SeqCst));
    assert!(
        String::from_utf8(rest)
            .unwrap()
            .ends_with("data: [DONE]\n\n")
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_releases_the_upstream() {
    let h = Harness::start().await;
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-chunk-delay-ms", "200")
        .body(chat_body(true).to_string())
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    for _ in 0..50 {
        if h.mock.state.streams_dropped.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(h.mock.state.streams_dropped.load(Ordering::SeqCst), 1);
    assert_eq!(h.metric("condense_inflight_requests").await, Some(0.0));
}

#[tokio::test]
async fn unreachable_upstream_is_a_502_in_openai_shape() {
    // A port that was just free: nothing listens there.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let h = Harness::with(|c| c.upstream.base_url = format!("http://127.0.0.1:{port}/v1")).await;
    let resp = post_chat(&h, &chat_body(false)).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(resp.headers()["content-type"], "application/json");
    // condense's own error still says what it measured and did.
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    let before: u64 = resp.headers()["x-condense-tokens-before"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(before > 0);
    assert_eq!(
        resp.headers()["x-condense-tokens-after"],
        resp.headers()["x-condense-tokens-before"]
    );
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable");
    assert_eq!(v["error"]["type"], "api_error");
    assert!(v["error"]["param"].is_null());
    assert_eq!(
        h.metric("condense_proxy_errors_total{kind=\"upstream_unreachable\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        h.metric("condense_requests_total{route=\"chat_completions\",status_class=\"5xx\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn slow_upstream_is_a_504() {
    let h = Harness::with(|c| c.upstream.first_byte_timeout_seconds = 0.2).await;
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-sleep-ms", "3000")
        .body(chat_body(false).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 504);
    assert_eq!(resp.headers()["x-condense-actions"], "none");
    assert!(resp.headers().contains_key("x-condense-tokens-before"));
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "upstream_timeout");
}

#[tokio::test]
async fn stalled_stream_is_cut_off_after_the_idle_timeout() {
    let h = Harness::with(|c| c.upstream.idle_timeout_seconds = 0.3).await;
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-stall", "1")
        .body(chat_body(true).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(std::str::from_utf8(&first).unwrap().contains("Hello"));
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(c) = body.next().await {
            if c.is_err() {
                return true;
            }
        }
        false
    })
    .await
    .expect("the stalled stream was never cut off");
    assert!(
        end,
        "a cut-off stream must end in an error, not a clean end"
    );
    assert_eq!(
        h.metric("condense_stream_interruptions_total{cause=\"idle_timeout\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn bodies_over_the_limit_get_a_413() {
    let h = Harness::with(|c| c.server.max_body_bytes = 1000).await;
    let big = format!(
        "{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
        "x".repeat(2000)
    );
    for path in ["/v1/chat/completions", "/v1/embeddings"] {
        let resp = h
            .client
            .post(h.url(path))
            .body(big.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 413, "{path}");
        // Not measured: the chat route says it did nothing.
        let chat = path == "/v1/chat/completions";
        assert_eq!(resp.headers().contains_key("x-condense-actions"), chat);
        assert!(!resp.headers().contains_key("x-condense-tokens-before"));
        let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        assert_eq!(v["error"]["code"], "request_too_large");
    }
    // A chunked upload without Content-Length is stopped too.
    let chunks =
        futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>("y".repeat(300))));
    let resp = h
        .client
        .post(h.url("/v1/files"))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert!(h.mock.requests().iter().all(|r| r.body.len() <= 1000));
}

#[tokio::test]
async fn client_key_passes_through_by_default_and_upstream_key_fills_in() {
    let h =
        Harness::with(|c| c.upstream.api_key = Some(condense::config::Secret::new("sk-upstream")))
            .await;
    post_chat(&h, &chat_body(false)).await;
    assert_eq!(h.mock.last().headers["authorization"], "Bearer sk-client");
    h.client.get(h.url("/v1/models")).send().await.unwrap();
    assert_eq!(h.mock.last().headers["authorization"], "Bearer sk-upstream");
}

#[tokio::test]
async fn client_keys_gate_every_proxied_route_and_are_swapped_upstream() {
    let h = Harness::with(|c| {
        c.auth.client_keys = vec![condense::config::Secret::new("ck-good")];
        c.upstream.api_key = Some(condense::config::Secret::new("sk-upstream"));
    })
    .await;
    for path in ["/v1/chat/completions", "/v1/models"] {
        let resp = h.client.post(h.url(path)).body("{}").send().await.unwrap();
        assert_eq!(resp.status(), 401, "{path}");
        let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let resp = h
            .client
            .post(h.url(path))
            .bearer_auth("ck-wrong")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
    }
    assert!(
        h.mock.requests().is_empty(),
        "a rejected request reached the upstream"
    );
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .bearer_auth("ck-good")
        .body(chat_body(false).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(h.mock.last().headers["authorization"], "Bearer sk-upstream");
    // Health endpoints stay open; metrics are public by default.
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(
            h.client.get(h.url(path)).send().await.unwrap().status(),
            200,
            "{path}"
        );
    }
}

/// Over HTTP/2 a `HEAD` answer must carry no body, or the client resets
/// the stream: condense's own errors included.
#[tokio::test]
async fn head_answers_have_no_body_over_http2_errors_included() {
    let h = Harness::with(|c| {
        c.auth.client_keys = vec![condense::config::Secret::new("ck")];
    })
    .await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let resp = h2.head(h.url("/v1/models")).send().await.unwrap();
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 401);
    assert!(resp.headers().contains_key("content-length"));
    assert!(resp.bytes().await.unwrap().is_empty());
    let resp = h2.head(h.url("/healthz")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-length"], "2");
    assert!(resp.bytes().await.unwrap().is_empty());
}

#[tokio::test]
async fn metrics_can_require_a_client_key() {
    let h = Harness::with(|c| {
        c.auth.client_keys = vec![condense::config::Secret::new("ck")];
        c.auth.metrics_public = false;
    })
    .await;
    assert_eq!(
        h.client
            .get(h.url("/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let resp = h
        .client
        .get(h.url("/metrics"))
        .bearer_auth("ck")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn condense_endpoints_answer_head_and_refuse_other_methods_without_forwarding() {
    let h = Harness::start().await;
    for path in ["/healthz", "/readyz", "/metrics"] {
        let resp = h.client.head(h.url(path)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "HEAD {path}");
        let length: usize = resp.headers()["content-length"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(length > 0, "HEAD {path}");
        assert!(resp.bytes().await.unwrap().is_empty(), "HEAD {path}");
        let resp = h.client.post(h.url(path)).body("{}").send().await.unwrap();
        assert_eq!(resp.status(), 405, "POST {path}");
        assert_eq!(resp.headers()["allow"], "GET, HEAD", "POST {path}");
        let v: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
        assert_eq!(v["error"]["code"], "method_not_allowed", "POST {path}");
    }
    // GET on a conversation route is not condense's: it goes upstream.
    let resp = h
        .client
        .get(h.url("/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(h.mock.last().path, "/v1/chat/completions");
    assert_eq!(h.mock.last().method, "GET");
    drop(resp);
    assert_eq!(h.mock.requests().len(), 1, "{:?}", h.mock.requests());
}

#[tokio::test]
async fn health_readiness_and_metrics_endpoints() {
    let h = Harness::start().await;
    assert_eq!(
        h.client
            .get(h.url("/healthz"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "ok"
    );
    assert_eq!(
        h.client
            .get(h.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    post_chat(&h, &chat_body(false)).await.text().await.unwrap();
    let text = h.metrics().await;
    for name in [
        "condense_requests_total{route=\"chat_completions\",status_class=\"2xx\"} 1",
        "condense_upstream_seconds_count{route=\"chat_completions\"} 1",
        "condense_overhead_seconds_count{route=\"chat_completions\"} 1",
        "condense_upstream_prompt_tokens_total{model=\"gpt-4o\"}",
        "# TYPE condense_overhead_seconds histogram",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
}

#[tokio::test]
async fn request_ids_are_propagated_or_generated() {
    let h = Harness::start().await;
    h.client
        .post(h.url("/v1/embeddings"))
        .header("x-request-id", "my-trace-1")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(h.mock.last().headers["x-request-id"], "my-trace-1");
    let resp = h
        .client
        .post(h.url("/v1/embeddings"))
        .body("{}")
        .send()
        .await
        .unwrap();
    let generated = h.mock.last().headers["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(generated.len(), 36, "expected a UUID, got {generated}");
    assert_eq!(resp.headers()["x-request-id"].to_str().unwrap(), generated);
}

#[tokio::test]
async fn shutdown_lets_an_inflight_stream_finish() {
    let mut h = Harness::start().await;
    let resp = h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-mock-chunk-delay-ms", "150")
        .body(chat_body(true).to_string())
        .send()
        .await
        .unwrap();
    let server = h.server.take().unwrap();
    let stopping = tokio::spawn(server.shutdown());
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    stopping.await.unwrap().unwrap();
    // New connections are refused once it stopped.
    assert!(
        reqwest::Client::new()
            .get(h.url("/healthz"))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test]
async fn labelled_counters_show_zero_before_anything_happens() {
    let h = Harness::start().await;
    for series in [
        "condense_proxy_errors_total{kind=\"upstream_unreachable\"}",
        "condense_proxy_errors_total{kind=\"overloaded\"}",
        "condense_stream_interruptions_total{cause=\"idle_timeout\"}",
        "condense_upstream_invalid_responses_total{kind=\"sse_without_done\"}",
        "condense_context_overflow_total{outcome=\"recovered\",provider_format=\"openai\"}",
        "condense_context_overflow_total{outcome=\"not_recoverable\",provider_format=\"llamacpp\"}",
        "condense_state_errors_total{op=\"get\"}",
        "condense_summarizer_calls_total{outcome=\"error\"}",
        "condense_connections_closed_total{reason=\"idle_timeout\"}",
    ] {
        assert_eq!(h.metric(series).await, Some(0.0), "{series}");
    }
    h.shutdown().await;
}
