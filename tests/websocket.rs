//! The Responses WebSocket mode through condense, with a raw WebSocket
//! client (tokio-tungstenite's) against a mock Responses upstream that
//! streams as OpenAI does: warm-ups, chained turns that go upstream as
//! whole stateless requests (compacted when they must be), errors, a
//! client that goes away mid-response, an oversized message, the idle
//! deadline, shutdown, and 200 sockets at once (with the heap each holds).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{connect, next_event, response, user};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use condense::config::Config;
use condense::server::Server;
use futures_util::{SinkExt, StreamExt};
use peak_alloc::PeakAlloc;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

#[derive(Default)]
struct Mock {
    requests: Mutex<Vec<(http::HeaderMap, Value)>>,
    /// Streams opened and not yet dropped (a client gone mid-response
    /// drops its upstream request).
    open: Arc<AtomicUsize>,
    /// Answer with the first events, then nothing.
    stall: std::sync::atomic::AtomicBool,
    /// Answer with this status and an OpenAI error body.
    status: AtomicUsize,
    /// End the stream with response.incomplete (cut at max_output_tokens).
    incomplete: std::sync::atomic::AtomicBool,
    /// Stream text deltas without end.
    flood: std::sync::atomic::AtomicBool,
    /// Hold the stream open after the response's last event, as a relay
    /// that keeps its connection may.
    linger: std::sync::atomic::AtomicBool,
}

impl Mock {
    fn seen(&self) -> Vec<(http::HeaderMap, Value)> {
        self.requests.lock().unwrap().clone()
    }
}

struct Upstream {
    addr: SocketAddr,
    mock: Arc<Mock>,
    _served: common::Served,
}

async fn upstream() -> Upstream {
    let mock = Arc::new(Mock::default());
    let served = common::serve(Router::new().fallback(answer).with_state(mock.clone())).await;
    Upstream {
        addr: served.addr,
        mock,
        _served: served,
    }
}

/// Counts a stream as open until it is dropped.
struct Opened(Arc<AtomicUsize>);

impl Drop for Opened {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn answer(State(mock): State<Arc<Mock>>, req: Request) -> Response {
    let headers = req.headers().clone();
    let bytes = axum::body::to_bytes(req.into_body(), usize::MAX)
        .await
        .unwrap();
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return common::json_response(json!({"object": "list", "data": []}));
    };
    let n = {
        let mut r = mock.requests.lock().unwrap();
        r.push((headers, body.clone()));
        r.len()
    };
    let status = mock.status.load(Ordering::SeqCst);
    if status != 0 {
        let error = json!({"error": {"message": "Incorrect API key provided: sk-te***", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
        let mut r = common::json_response(error);
        *r.status_mut() = http::StatusCode::from_u16(status as u16).unwrap();
        return r;
    }
    let items = body["input"].as_array().map_or(0, Vec::len);
    let text = format!("answer {n} to {items} items");
    let id = format!("resp_up{n}");
    let msg = json!({"type": "message", "id": format!("msg_{n}"), "status": "completed",
        "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]});
    let base = json!({"id": id, "object": "response", "status": "in_progress", "model": body["model"], "output": []});
    let mut events = vec![
        json!({"type": "response.created", "response": base}),
        json!({"type": "response.in_progress", "response": base}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": format!("msg_{n}"), "status": "in_progress", "role": "assistant", "content": []}}),
        json!({"type": "response.output_text.delta", "output_index": 0, "item_id": format!("msg_{n}"), "content_index": 0, "delta": text}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": msg}),
    ];
    let mut done = base.clone();
    done["status"] = json!("completed");
    done["output"] = json!([msg]);
    done["usage"] = json!({"input_tokens": bytes.len() / 4, "output_tokens": 5, "total_tokens": bytes.len() / 4 + 5});
    if mock.incomplete.load(Ordering::SeqCst) {
        done["status"] = json!("incomplete");
        done["incomplete_details"] = json!({"reason": "max_output_tokens"});
        events.push(json!({"type": "response.incomplete", "response": done}));
    } else {
        events.push(json!({"type": "response.completed", "response": done}));
    }
    let sse: Vec<String> = events
        .into_iter()
        .enumerate()
        .map(|(i, mut e)| {
            e["sequence_number"] = json!(i);
            format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap())
        })
        .collect();
    mock.open.fetch_add(1, Ordering::SeqCst);
    let opened = Opened(mock.open.clone());
    if mock.flood.load(Ordering::SeqCst) {
        let delta = format!(
            "data: {}\n\n",
            json!({"type": "response.output_text.delta", "output_index": 0, "delta": "x".repeat(4000)})
        );
        let head = futures_util::stream::iter(sse[..3].to_vec());
        let endless = futures_util::stream::repeat(delta).map(move |d| {
            let _ = &opened;
            d
        });
        let stream = head.chain(endless).map(Ok::<_, std::io::Error>);
        return (
            [("content-type", "text/event-stream")],
            Body::from_stream(stream),
        )
            .into_response();
    }
    let stall = mock.stall.load(Ordering::SeqCst);
    let linger = mock.linger.load(Ordering::SeqCst);
    let first: Vec<String> = sse[..2].to_vec();
    let stream = futures_util::stream::iter(if stall { first } else { sse })
        .map(Ok::<_, std::io::Error>)
        .chain(futures_util::stream::poll_fn(move |_| {
            let _ = &opened;
            match stall || linger {
                true => std::task::Poll::Pending,
                false => std::task::Poll::Ready(None),
            }
        }));
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Whether `cond` holds within `limit`, polled every 50 ms.
async fn within(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = tokio::time::Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether every stream the upstream opened is closed within 5 s.
async fn upstream_closed(up: &Upstream) -> bool {
    within(Duration::from_secs(5), || {
        up.mock.open.load(Ordering::SeqCst) == 0
    })
    .await
}

async fn condense(up: &Upstream, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = format!("http://{}/v1", up.addr);
    config.models.push(common::profile("agent-*", 8192));
    tweak(&mut config);
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

fn create(input: Vec<Value>, previous: Option<&str>) -> Value {
    let mut c = json!({"type": "response.create", "model": "agent-small", "store": false,
        "input": input, "tools": [], "client_metadata": {"session_id": "s1"}, "stream": true});
    if let Some(p) = previous {
        c["previous_response_id"] = json!(p);
    }
    c
}

#[tokio::test]
async fn each_create_goes_upstream_as_the_whole_conversation_and_events_come_back_in_order() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    let mut ws = connect(&server).await;
    // The warm-up is answered at once, with an id to chain from.
    let mut warm = create(vec![user("AGENTS.md: run the tests")], None);
    warm["generate"] = json!(false);
    let events = response(&mut ws, warm).await;
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["response.created", "response.completed"]);
    assert_eq!(events[1]["response"]["output"], json!([]));
    let warm_id = events[1]["response"]["id"].as_str().unwrap().to_string();
    assert_eq!(
        common::metric_at(
            server.local_addr(),
            "condense_websocket_responses_total{outcome=\"warmup\"}"
        )
        .await,
        1.0
    );
    assert!(
        up.mock.requests.lock().unwrap().is_empty(),
        "no upstream call"
    );

    let mut turn = create(vec![user("fix the bug")], Some(&warm_id));
    turn["client_metadata"]["x-codex-turn-metadata"] = json!("{\"turn_id\":\"t1\"}");
    let events = response(&mut ws, turn).await;
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.output_text.delta",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(i));
    }
    let first_id = events[5]["response"]["id"].as_str().unwrap().to_string();
    {
        let seen = up.mock.seen();
        let (headers, body) = &seen[0];
        // A whole stateless request: the warm-up's input, then the new one.
        assert_eq!(
            body["input"],
            json!([user("AGENTS.md: run the tests"), user("fix the bug")])
        );
        assert_eq!(body["stream"], true);
        assert_eq!(body["store"], false);
        for gone in [
            "type",
            "previous_response_id",
            "generate",
            "client_metadata",
        ] {
            assert!(body.get(gone).is_none(), "{gone} went upstream");
        }
        assert_eq!(headers["authorization"], "Bearer sk-test");
        // The turn's `x-` metadata goes as the headers HTTP would carry.
        assert_eq!(headers["x-codex-turn-metadata"], "{\"turn_id\":\"t1\"}");
        assert!(headers.get("session_id").is_none());
        assert!(headers.get("openai-beta").is_none());
        assert!(headers.get("sec-websocket-key").is_none());
    }

    // The next turn continues the first: its output is in the history.
    let output = json!({"type": "function_call_output", "call_id": "c1", "output": "ok"});
    let events = response(&mut ws, create(vec![output.clone()], Some(&first_id))).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let seen = up.mock.seen();
    // Each turn is a request with an id of its own.
    assert_ne!(seen[0].0["x-request-id"], seen[1].0["x-request-id"]);
    let input = seen[1].1["input"].as_array().unwrap();
    assert_eq!(input.len(), 4);
    assert_eq!(input[2]["content"][0]["text"], "answer 1 to 2 items");
    assert_eq!(input[3], output);
    assert_eq!(
        common::metric_at(
            server.local_addr(),
            "condense_websocket_responses_total{outcome=\"completed\"}"
        )
        .await,
        2.0
    );
    ws.close(None).await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_unknown_previous_response_and_upstream_errors_are_error_events_and_the_socket_goes_on()
{
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    let mut ws = connect(&server).await;
    let events = response(&mut ws, create(vec![user("hi")], Some("resp_nowhere"))).await;
    assert_eq!(
        events,
        [json!({"type": "error", "status": 400, "error": {
            "type": "invalid_request_error", "code": "previous_response_not_found",
            "message": "Previous response with id 'resp_nowhere' not found.",
            "param": "previous_response_id"}})]
    );
    // Not JSON, another event type: error events too.
    let events = response(&mut ws, json!({"type": "response.cancel"})).await;
    assert_eq!(events[0]["error"]["param"], "type");
    // The upstream's own error goes back in its shape, with its status.
    up.mock.status.store(401, Ordering::SeqCst);
    let events = response(&mut ws, create(vec![user("hi")], None)).await;
    assert_eq!(events[0]["type"], "error");
    assert_eq!(events[0]["status"], 401);
    assert_eq!(events[0]["error"]["code"], "invalid_api_key");
    up.mock.status.store(0, Ordering::SeqCst);
    // The socket still serves.
    let events = response(&mut ws, create(vec![user("hi")], None)).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_incomplete_response_is_remembered_and_can_be_continued() {
    // A response cut at max_output_tokens ends with response.incomplete;
    // the client may go on from it ("continue"), as it can on OpenAI's
    // socket. Until condense remembered it, that got
    // previous_response_not_found.
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    let mut ws = connect(&server).await;
    up.mock.incomplete.store(true, Ordering::SeqCst);
    let events = response(&mut ws, create(vec![user("write it all")], None)).await;
    let end = events.last().unwrap();
    assert_eq!(end["type"], "response.incomplete", "{end}");
    let id = end["response"]["id"].as_str().unwrap().to_string();
    up.mock.incomplete.store(false, Ordering::SeqCst);
    let events = response(&mut ws, create(vec![user("go on")], Some(&id))).await;
    let end = events.last().unwrap();
    assert_eq!(end["type"], "response.completed", "{end}");
    let seen = up.mock.seen();
    assert_eq!(seen.len(), 2);
    let input = seen[1].1["input"].as_array().unwrap();
    assert_eq!(input.len(), 3, "{input:?}");
    assert_eq!(input[0], user("write it all"));
    assert_eq!(input[1]["content"][0]["text"], "answer 1 to 1 items");
    assert_eq!(input[2], user("go on"));
    for (outcome, n) in [("incomplete", 1.0), ("completed", 1.0), ("failed", 0.0)] {
        let name = format!("condense_websocket_responses_total{{outcome=\"{outcome}\"}}");
        assert_eq!(
            common::metric_at(server.local_addr(), &name).await,
            n,
            "{name}"
        );
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_conversation_on_a_socket_is_compacted_like_any_other() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    let mut ws = connect(&server).await;
    let mut previous: Option<String> = None;
    let output: String = (0..80)
        .map(|l| format!("{l:>4} let value_{l} = parse(&input[{l}..]);\n"))
        .collect();
    for t in 0..16 {
        let items = vec![
            json!({"type": "function_call", "call_id": format!("c{t}"), "name": "shell", "arguments": "{\"cmd\":\"cat\"}"}),
            json!({"type": "function_call_output", "call_id": format!("c{t}"), "output": output}),
        ];
        let events = response(&mut ws, create(items, previous.as_deref())).await;
        let end = events.last().unwrap();
        assert_eq!(end["type"], "response.completed", "{end}");
        previous = Some(end["response"]["id"].as_str().unwrap().to_string());
        // What condense did, as the HTTP route's headers say it, is in the
        // response's metadata at its start and its end.
        for e in [&events[0], end] {
            let meta = &e["response"]["metadata"];
            assert!(
                meta["condense_tokens_before"]
                    .as_str()
                    .unwrap()
                    .parse::<u64>()
                    .is_ok()
            );
            assert!(meta["condense_actions"].is_string(), "{e}");
        }
        if t == 15 {
            let actions = end["response"]["metadata"]["condense_actions"]
                .as_str()
                .unwrap();
            assert!(actions.contains("mask"), "{actions}");
        }
    }
    let seen = up.mock.seen();
    let last = seen.last().unwrap().1.to_string();
    // The whole conversation went up, shortened to fit the window.
    assert!(last.contains("[condense:"), "not compacted");
    assert!(last.len() < 16 * output.len());
    assert!(last.contains("c0") && last.contains("c15"));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_response_is_over_at_its_last_event_though_the_upstream_holds_its_stream_open() {
    let up = upstream().await;
    let server = condense(&up, |c| {
        c.server.idle_timeout_seconds = 1.0;
        c.upstream.idle_timeout_seconds = 1.0;
    })
    .await;
    up.mock.linger.store(true, Ordering::SeqCst);
    let completed = "condense_websocket_responses_total{outcome=\"completed\"}";
    let mut ws = connect(&server).await;
    let events = response(&mut ws, create(vec![user("hi")], None)).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    // Counted and remembered before the client saw it end.
    assert_eq!(common::metric_at(server.local_addr(), completed).await, 1.0);
    let id = events.last().unwrap()["response"]["id"].as_str().unwrap();
    // The next turn is answered while the first one's stream is still open.
    let output = json!({"type": "function_call_output", "call_id": "c1", "output": "ok"});
    let events = response(&mut ws, create(vec![output], Some(id))).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    assert_eq!(up.mock.seen()[1].1["input"].as_array().unwrap().len(), 3);
    assert_eq!(common::metric_at(server.local_addr(), completed).await, 2.0);
    // What the upstream still held open is let go within a write's stall.
    assert!(
        upstream_closed(&up).await,
        "a lingering upstream stream was held"
    );
    // A stream that stalls is ended by condense with an error event, the
    // turn counted as failed before it goes out.
    up.mock.stall.store(true, Ordering::SeqCst);
    let events = response(&mut ws, create(vec![user("hi")], None)).await;
    assert_eq!(events.last().unwrap()["type"], "error", "{events:?}");
    let failed = "condense_websocket_responses_total{outcome=\"failed\"}";
    assert_eq!(common::metric_at(server.local_addr(), failed).await, 1.0);
    ws.close(None).await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_gone_mid_response_drops_it_and_an_oversized_message_closes_with_1009() {
    let up = upstream().await;
    let server = condense(&up, |c| c.server.max_body_bytes = 64 * 1024).await;
    up.mock.stall.store(true, Ordering::SeqCst);
    let mut ws = connect(&server).await;
    ws.send(Message::text(create(vec![user("hi")], None).to_string()))
        .await
        .unwrap();
    assert_eq!(next_event(&mut ws).await["type"], "response.created");
    assert_eq!(up.mock.open.load(Ordering::SeqCst), 1);
    drop(ws);
    // The upstream request goes with the client.
    assert!(
        upstream_closed(&up).await,
        "the upstream stream outlived its client"
    );

    up.mock.stall.store(false, Ordering::SeqCst);
    let mut ws = connect(&server).await;
    let big = create(vec![user(&"x".repeat(100 * 1024))], None);
    ws.send(Message::text(big.to_string())).await.unwrap();
    let close = loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .unwrap()
        {
            Some(Ok(Message::Close(frame))) => break frame,
            Some(Ok(_)) => continue,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(close.unwrap().code, CloseCode::Size);
    assert_eq!(
        up.mock.requests.lock().unwrap().len(),
        1,
        "nothing more went up"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_that_stops_reading_is_closed_and_its_upstream_request_dropped() {
    let up = upstream().await;
    let server = condense(&up, |c| c.server.idle_timeout_seconds = 1.0).await;
    up.mock.flood.store(true, Ordering::SeqCst);
    let mut ws = connect(&server).await;
    ws.send(Message::text(create(vec![user("hi")], None).to_string()))
        .await
        .unwrap();
    // The client reads nothing more; the upstream streams without end.
    let gone = within(Duration::from_secs(10), || {
        up.mock.open.load(Ordering::SeqCst) == 0 && !up.mock.seen().is_empty()
    })
    .await;
    assert!(
        gone,
        "a client that stopped reading held its upstream stream"
    );
    // The socket closes too, its close frame given as long as a write.
    let mut open = 1.0;
    for _ in 0..100 {
        open = common::metric_at(server.local_addr(), "condense_websockets_open").await;
        if open == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(open, 0.0);
    drop(ws);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_idle_socket_is_closed_and_shutdown_closes_with_1001() {
    let up = upstream().await;
    let server = condense(&up, |c| c.server.websocket_idle_seconds = 0.5).await;
    let mut ws = connect(&server).await;
    let frame = match tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .unwrap()
    {
        Some(Ok(Message::Close(frame))) => frame.unwrap(),
        other => panic!("{other:?}"),
    };
    assert_eq!(frame.code, CloseCode::Normal);
    server.shutdown().await.unwrap();

    let server = condense(&up, |_| {}).await;
    let mut ws = connect(&server).await;
    let events = response(&mut ws, create(vec![user("hi")], None)).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let stopping = tokio::spawn(server.shutdown());
    let frame = match tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .unwrap()
    {
        Some(Ok(Message::Close(frame))) => frame.unwrap(),
        other => panic!("{other:?}"),
    };
    assert_eq!(frame.code, CloseCode::Away);
    drop(ws);
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_sockets_at_once_each_hold_their_own_conversation() {
    let up = upstream().await;
    let server = condense(&up, |_| {}).await;
    let base = HEAP.current_usage();
    let mut sockets = Vec::new();
    for _ in 0..200 {
        sockets.push(connect(&server).await);
    }
    let connected = HEAP.current_usage().saturating_sub(base);
    println!(
        "heap with 200 sockets connected: {} KB a socket",
        connected / 1024 / 200
    );
    let tasks: Vec<_> = sockets
        .into_iter()
        .enumerate()
        .map(|(i, mut ws)| {
            tokio::spawn(async move {
                let first =
                    response(&mut ws, create(vec![user(&format!("socket {i}"))], None)).await;
                let id = first.last().unwrap()["response"]["id"]
                    .as_str()
                    .unwrap()
                    .to_string();
                let second = response(&mut ws, create(vec![user("again")], Some(&id))).await;
                assert_eq!(second.last().unwrap()["type"], "response.completed");
                ws
            })
        })
        .collect();
    let mut open = Vec::new();
    for t in tasks {
        open.push(t.await.unwrap());
    }
    assert_eq!(
        common::metric_at(server.local_addr(), "condense_websockets_open").await,
        200.0
    );
    // The heap held with 200 sockets open, each with a two-turn history
    // (the test's own client sockets included, about half of it).
    let held = HEAP.current_usage().saturating_sub(base);
    println!(
        "heap with 200 open sockets: {} KB, {} KB a socket (client and server)",
        held / 1024,
        held / 1024 / 200
    );
    assert!(held < 200 * 256 * 1024, "{held} bytes for 200 sockets");
    // Each socket's second request held its own first turn only.
    let seen = up.mock.seen();
    assert_eq!(seen.len(), 400);
    for (_, body) in seen
        .iter()
        .filter(|(_, b)| b["input"].as_array().unwrap().len() == 3)
    {
        let text = body["input"][0]["content"][0]["text"].as_str().unwrap();
        assert!(text.starts_with("socket "));
    }
    assert_eq!(
        seen.iter()
            .filter(|(_, b)| b["input"].as_array().unwrap().len() == 3)
            .count(),
        200
    );
    for mut ws in open {
        ws.close(None).await.unwrap();
    }
    server.shutdown().await.unwrap();
}
