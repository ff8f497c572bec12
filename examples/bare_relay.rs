//! The floor: the least a relay built on condense's stack (tokio, axum,
//! reqwest) does per request. It forwards any request to `UPSTREAM`
//! (default `http://127.0.0.1:18080`) with its headers and body streamed,
//! and the response back, with nothing else: no parsing, no logs, no
//! metrics, no request ids. Measured beside condense (same load, same
//! upstream) it says what of condense's cost per request is the stack's.
//!
//! `cargo build --release --example bare_relay`, then
//! `BENCH_BARE_RELAY=target/release/examples/bare_relay cargo bench --bench
//! passthrough` measures it beside condense; alone:
//! `target/release/examples/bare_relay 127.0.0.1:19100` (it prints
//! `listen=<address>`).
#![allow(clippy::print_stdout, clippy::expect_used, clippy::unwrap_used)]

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use axum::serve::ListenerExt;

async fn relay(State((client, base)): State<(reqwest::Client, String)>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let url = format!("{base}{}", parts.uri.path());
    let mut headers = parts.headers;
    headers.remove(http::header::HOST);
    let resp = client
        .request(parts.method, url)
        .headers(headers)
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await;
    match resp {
        Ok(r) => {
            let mut out = Response::builder().status(r.status());
            for (k, v) in r.headers() {
                out = out.header(k, v);
            }
            out.body(Body::from_stream(r.bytes_stream())).unwrap()
        }
        Err(_) => Response::builder().status(502).body(Body::empty()).unwrap(),
    }
}

#[tokio::main]
async fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:19100".into());
    let base = std::env::var("UPSTREAM").unwrap_or_else(|_| "http://127.0.0.1:18080".into());
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let app = axum::Router::new()
        .fallback(relay)
        .with_state((client, base));
    let listener = tokio::net::TcpListener::bind(&listen).await.unwrap();
    println!("listen={}", listener.local_addr().unwrap());
    // As condense does: without it, a response in several writes waits on
    // the client's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await.unwrap();
}
