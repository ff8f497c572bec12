//! The turns of a client's Responses WebSocket over the upstream's own
//! socket (`upstream.responses_websocket`), against a mock upstream that
//! serves `/v1/responses` both ways, as OpenAI does: upgraded to a
//! WebSocket (one `response.create` message a turn, events back, an
//! `error` event for a request it refuses) and as HTTP POSTs. Also: an
//! upstream that offers no socket (every turn over HTTP, and no new client
//! socket asks again), one that closes its socket after every answer, and
//! an overflow `error` event recovered from like an HTTP 400.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Ws, connect, response, user};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use condense::config::Config;
use condense::server::Server;
use futures_util::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

#[derive(Default)]
struct Mock {
    /// Whether `/v1/responses` upgrades.
    offer: AtomicBool,
    /// Close the socket after each answer.
    close_after: AtomicBool,
    /// Refuse the next request on a socket with an overflow error event.
    overflow_next: AtomicBool,
    /// The headers of every upgrade asked for.
    upgrades: Mutex<Vec<http::HeaderMap>>,
    /// Every request: over a socket (true) or HTTP, and its body.
    requests: Mutex<Vec<(bool, Value)>>,
    answered: AtomicUsize,
}

struct Upstream {
    addr: SocketAddr,
    mock: Arc<Mock>,
    _served: common::Served,
}

async fn upstream(offer: bool) -> Upstream {
    let mock = Arc::new(Mock::default());
    mock.offer.store(offer, Ordering::SeqCst);
    let served = common::serve(Router::new().fallback(answer).with_state(mock.clone())).await;
    Upstream {
        addr: served.addr,
        mock,
        _served: served,
    }
}

/// The events of an answer to `body`, as OpenAI streams them.
fn events(mock: &Mock, body: &Value) -> Vec<Value> {
    let n = mock.answered.fetch_add(1, Ordering::SeqCst) + 1;
    let items = body["input"].as_array().map_or(0, Vec::len);
    let text = format!("answer {n} to {items} items");
    let msg = json!({"type": "message", "id": format!("msg_{n}"), "status": "completed",
        "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]});
    let base = json!({"id": format!("resp_up{n}"), "object": "response", "status": "in_progress",
        "model": body["model"], "output": []});
    let mut done = base.clone();
    done["status"] = json!("completed");
    done["output"] = json!([msg]);
    let size = body.to_string().len() as u64;
    done["usage"] =
        json!({"input_tokens": size / 4, "output_tokens": 5, "total_tokens": size / 4 + 5});
    let mut events = vec![
        json!({"type": "response.created", "response": base}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": format!("msg_{n}"), "status": "in_progress", "role": "assistant", "content": []}}),
        json!({"type": "response.output_text.delta", "output_index": 0, "item_id": format!("msg_{n}"), "content_index": 0, "delta": text}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": msg}),
        json!({"type": "response.completed", "response": done}),
    ];
    for (i, e) in events.iter_mut().enumerate() {
        e["sequence_number"] = json!(i);
    }
    events
}

async fn answer(State(mock): State<Arc<Mock>>, mut req: Request) -> Response {
    if req.headers().contains_key("upgrade") {
        mock.upgrades.lock().unwrap().push(req.headers().clone());
        if !mock.offer.load(Ordering::SeqCst) {
            let error = json!({"error": {"message": "Invalid URL (GET /v1/responses)", "type": "invalid_request_error", "param": null, "code": null}});
            let mut r = common::json_response(error);
            *r.status_mut() = http::StatusCode::NOT_FOUND;
            return r;
        }
        let key = req.headers()["sec-websocket-key"].clone();
        let upgrade = hyper::upgrade::on(&mut req);
        let mock = mock.clone();
        tokio::spawn(async move {
            let upgraded = upgrade.await.unwrap();
            let ws =
                WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
            serve_socket(mock, ws).await;
        });
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
        return http::Response::builder()
            .status(101)
            .header("upgrade", "websocket")
            .header("connection", "Upgrade")
            .header("sec-websocket-accept", accept)
            .body(Body::empty())
            .unwrap();
    }
    let bytes = axum::body::to_bytes(req.into_body(), usize::MAX)
        .await
        .unwrap();
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return common::json_response(json!({"object": "list", "data": []}));
    };
    mock.requests.lock().unwrap().push((false, body.clone()));
    let sse: String = events(&mock, &body)
        .into_iter()
        .map(|e| format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap()))
        .collect();
    ([("content-type", "text/event-stream")], sse).into_response()
}

async fn serve_socket(mock: Arc<Mock>, mut ws: WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>) {
    while let Some(Ok(msg)) = ws.next().await {
        let Message::Text(text) = msg else { continue };
        let body: Value = serde_json::from_str(&text).unwrap();
        mock.requests.lock().unwrap().push((true, body.clone()));
        if mock.overflow_next.swap(false, Ordering::SeqCst) {
            let e = json!({"type": "error", "status": 400, "error": {"type": "invalid_request_error",
                "code": "context_length_exceeded",
                "message": "Your input exceeds the context window of this model. Please adjust your input and try again.",
                "param": "input"}});
            ws.send(Message::text(e.to_string())).await.unwrap();
            continue;
        }
        for e in events(&mock, &body) {
            ws.send(Message::text(e.to_string())).await.unwrap();
        }
        if mock.close_after.load(Ordering::SeqCst) {
            let _ = ws.close(None).await;
            return;
        }
    }
}

async fn condense(up: &Upstream) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = format!("http://{}/v1", up.addr);
    config.upstream.responses_websocket = true;
    config.models.push(common::profile("agent-*", 8192));
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

fn create(input: Vec<Value>, previous: Option<&str>) -> Value {
    let mut c = json!({"type": "response.create", "model": "agent-small", "store": false,
        "input": input, "tools": [], "stream": true});
    if let Some(p) = previous {
        c["previous_response_id"] = json!(p);
    }
    c
}

/// Three chained turns; the id of the last response.
async fn three_turns(ws: &mut Ws) -> String {
    let mut previous: Option<String> = None;
    for turn in ["fix the bug", "run the tests", "commit"] {
        let events = response(ws, create(vec![user(turn)], previous.as_deref())).await;
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.completed", "{events:?}");
        previous = Some(last["response"]["id"].as_str().unwrap().to_string());
    }
    previous.unwrap()
}

#[tokio::test]
async fn a_client_sockets_turns_go_over_one_upstream_socket_as_whole_stateless_requests() {
    let up = upstream(true).await;
    let server = condense(&up).await;
    let mut ws = connect(&server).await;
    three_turns(&mut ws).await;
    let requests = up.mock.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 3);
    assert!(
        requests.iter().all(|(socket, _)| *socket),
        "all over the socket"
    );
    // One upstream socket for the three turns, asked for with the client's
    // key and the beta that asks for sockets.
    let upgrades = up.mock.upgrades.lock().unwrap().clone();
    assert_eq!(upgrades.len(), 1);
    assert_eq!(upgrades[0]["authorization"], "Bearer sk-test");
    assert_eq!(
        upgrades[0]["openai-beta"],
        "responses_websockets=2026-02-06"
    );
    for (i, (_, body)) in requests.iter().enumerate() {
        assert_eq!(body["type"], "response.create");
        assert_eq!(body["store"], false);
        for gone in ["stream", "previous_response_id", "background"] {
            assert!(body.get(gone).is_none(), "{gone} went upstream");
        }
        // The whole conversation each time: every user turn so far, and
        // the answers between them.
        assert_eq!(body["input"].as_array().unwrap().len(), 2 * i + 1);
    }
    assert_eq!(
        requests[2].1["input"][1]["content"][0]["text"],
        "answer 1 to 1 items"
    );
    ws.close(None).await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_upstream_without_sockets_gets_every_turn_over_http_and_is_not_asked_again() {
    let up = upstream(false).await;
    let server = condense(&up).await;
    let mut ws = connect(&server).await;
    three_turns(&mut ws).await;
    // A second client socket does not ask again.
    let mut other = connect(&server).await;
    three_turns(&mut other).await;
    let requests = up.mock.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 6);
    assert!(requests.iter().all(|(socket, _)| !socket), "all over HTTP");
    assert!(requests.iter().all(|(_, b)| b["stream"] == true));
    assert_eq!(up.mock.upgrades.lock().unwrap().len(), 1);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_upstream_socket_closed_between_turns_is_opened_again() {
    let up = upstream(true).await;
    up.mock.close_after.store(true, Ordering::SeqCst);
    let server = condense(&up).await;
    let mut ws = connect(&server).await;
    three_turns(&mut ws).await;
    let requests = up.mock.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|(socket, _)| *socket));
    assert_eq!(up.mock.upgrades.lock().unwrap().len(), 3);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_overflow_error_event_is_recovered_from_over_the_socket() {
    let up = upstream(true).await;
    up.mock.overflow_next.store(true, Ordering::SeqCst);
    let server = condense(&up).await;
    let mut ws = connect(&server).await;
    // An old tool result large enough to be worth shortening, well within
    // the configured window, which the upstream says is too long.
    let log: String = (0..400)
        .map(|i| format!("test_case_{i} ... ok (0.{i:03}s)\n"))
        .collect();
    let input = vec![
        user("run the test suite and fix what fails"),
        json!({"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{\"cmd\":\"cargo test\"}"}),
        json!({"type": "function_call_output", "call_id": "c1", "output": log}),
        json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "All 400 pass."}]}),
        user("now commit"),
    ];
    let events = response(&mut ws, create(input, None)).await;
    assert_eq!(
        events.last().unwrap()["type"],
        "response.completed",
        "{events:?}"
    );
    let requests = up.mock.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2, "the refused request and its retry");
    assert!(requests.iter().all(|(socket, _)| *socket));
    let (first, retry) = (requests[0].1.to_string(), requests[1].1.to_string());
    assert!(retry.len() < first.len(), "the retry was compacted");
    assert_eq!(
        common::metric_at(
            server.local_addr(),
            "condense_context_overflow_total{outcome=\"recovered\",provider_format=\"openai\"}"
        )
        .await,
        1.0
    );
    server.shutdown().await.unwrap();
}
