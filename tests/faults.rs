//! Fault injection: an upstream that misbehaves at the TCP and HTTP level.
//! For each fault the client gets something well-formed (an OpenAI-shaped
//! error, or the upstream's own response), nothing hangs, condense keeps
//! serving, and the fault shows in `/metrics`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use condense::config::Config;
use condense::server::Server;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Reads one HTTP request (headers and a Content-Length body); returns the
/// value of its `x-evil` header.
async fn read_request(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = s.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return String::new();
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            l.strip_prefix(&format!("{name}: "))
                .map(|v| v.trim().to_string())
        })
    };
    let len: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    header("x-evil").unwrap_or_default()
}

const EVENT: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

/// An upstream that misbehaves as the request's `x-evil` header says.
async fn evil_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mode = read_request(&mut s).await;
                let sse = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                match mode.as_str() {
                    "reset" => {
                        #[allow(deprecated)]
                        s.set_linger(Some(Duration::ZERO)).unwrap();
                        drop(s);
                    }
                    "close" => drop(s),
                    "garbage_status" => {
                        let _ = s.write_all(b"THIS IS NOT HTTP\r\n\r\n").await;
                    }
                    "garbage_json" => {
                        let body = "<html>oops</html> not json";
                        let _ = s
                            .write_all(format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes())
                            .await;
                    }
                    "cut_stream" => {
                        let _ = s
                            .write_all(format!("{sse}{}", chunk(EVENT)).as_bytes())
                            .await;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        #[allow(deprecated)]
                        s.set_linger(Some(Duration::ZERO)).unwrap();
                        drop(s);
                    }
                    "no_done" => {
                        let _ = s
                            .write_all(format!("{sse}{}0\r\n\r\n", chunk(EVENT)).as_bytes())
                            .await;
                    }
                    "503" => {
                        let body = json!({"error": {"message": "overloaded", "type": "server_error", "param": null, "code": null}}).to_string();
                        let _ = s
                            .write_all(format!("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 3\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes())
                            .await;
                    }
                    _ => {
                        let body = json!({"id": "ok", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}]}).to_string();
                        let _ = s
                            .write_all(format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes())
                            .await;
                    }
                }
            });
        }
    });
    addr
}

struct Setup {
    server: Server,
    client: reqwest::Client,
}

impl Setup {
    async fn start() -> Setup {
        let upstream = evil_upstream().await;
        let mut config = Config::default();
        config.server.listen = "127.0.0.1:0".parse().unwrap();
        config.upstream.base_url = format!("http://{upstream}/v1");
        config.upstream.learn_windows = false;
        config.upstream.idle_timeout_seconds = 2.0;
        Setup {
            server: Server::start(&config).await.unwrap(),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
        }
    }

    async fn send(&self, evil: &str, stream: bool) -> reqwest::Response {
        let mut body = common::chat_body(stream);
        if !stream {
            body.as_object_mut().unwrap().remove("stream");
        }
        self.client
            .post(format!(
                "http://{}/v1/chat/completions",
                self.server.local_addr()
            ))
            .header("x-evil", evil)
            .body(body.to_string())
            .send()
            .await
            .unwrap()
    }

    /// A metric, once the work after an answer (its usage read) is done.
    async fn metric(&self, series: &str) -> f64 {
        self.server.state().proxy.settled().await;
        common::metric_at(self.server.local_addr(), series).await
    }

    /// condense still answers a good request.
    async fn still_serving(&self) {
        let resp = self.send("none", false).await;
        assert_eq!(resp.status(), 200);
        let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "fine");
    }
}

async fn assert_openai_error(resp: reqwest::Response, status: u16, code: &str) {
    assert_eq!(resp.status(), status);
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    let e = &v["error"];
    assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some());
    assert_eq!(e["code"], code, "{v}");
}

#[tokio::test]
async fn connection_reset_or_closed_before_headers_is_a_502() {
    let s = Setup::start().await;
    for (mode, n) in [("reset", 1.0), ("close", 2.0), ("garbage_status", 3.0)] {
        assert_openai_error(s.send(mode, false).await, 502, "upstream_unreachable").await;
        assert_eq!(
            s.metric("condense_proxy_errors_total{kind=\"upstream_unreachable\"}")
                .await,
            n,
            "{mode}"
        );
        s.still_serving().await;
    }
    // Streamed requests fail the same way: the fault comes before any byte.
    assert_openai_error(s.send("reset", true).await, 502, "upstream_unreachable").await;
    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn garbage_instead_of_json_reaches_the_client_as_the_upstream_sent_it() {
    let s = Setup::start().await;
    let resp = s.send("garbage_json", false).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "<html>oops</html> not json");
    assert_eq!(
        s.metric("condense_upstream_invalid_responses_total{kind=\"invalid_json\"}")
            .await,
        1.0
    );
    s.still_serving().await;
    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_reset_midway_ends_with_an_error_event() {
    let s = Setup::start().await;
    let resp = s.send("cut_stream", true).await;
    assert_eq!(resp.status(), 200);
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    use futures_util::StreamExt;
    while let Some(part) = stream.next().await {
        match part {
            Ok(b) => body.extend_from_slice(&b),
            Err(_) => break,
        }
    }
    let text = String::from_utf8(body).unwrap();
    assert!(text.starts_with(EVENT), "{text}");
    let last = text.trim_end().lines().last().unwrap();
    let event: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(event["error"]["code"], "upstream_stream_interrupted");
    assert!(!text.contains("[DONE]"), "never a complete-looking stream");
    assert_eq!(
        s.metric("condense_stream_interruptions_total{cause=\"upstream_error\"}")
            .await,
        1.0
    );
    s.still_serving().await;
    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_without_done_is_passed_on_and_counted() {
    let s = Setup::start().await;
    let resp = s.send("no_done", true).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), EVENT);
    assert_eq!(
        s.metric("condense_upstream_invalid_responses_total{kind=\"sse_without_done\"}")
            .await,
        1.0
    );
    s.still_serving().await;
    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_5xx_passes_through_with_its_retry_after() {
    let s = Setup::start().await;
    let resp = s.send("503", false).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "3");
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["message"], "overloaded");
    assert_eq!(
        s.metric("condense_requests_total{route=\"chat_completions\",status_class=\"5xx\"}")
            .await,
        1.0
    );
    s.still_serving().await;
    s.server.shutdown().await.unwrap();
}
