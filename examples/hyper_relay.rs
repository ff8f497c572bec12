//! A lower floor: the least a relay built on hyper alone does per request,
//! with none of axum's routing and none of reqwest's layers (URL parsing,
//! redirects, proxies). A hyper 1 HTTP/1 server hands each request to
//! hyper-util's pooled legacy `Client` and its response back, both bodies
//! streamed through as they are; only the URI (pointed at `UPSTREAM`) and
//! `Host` change. Measured beside condense and `bare_relay` (same load,
//! same upstream), it says what of the stack's own cost is axum and
//! reqwest, and what hyper and tokio cost anyway.
//!
//! The runtime is tokio's `current_thread` (one thread: no wake-ups
//! between workers); `RELAY_RUNTIME=multi` selects the multi-thread
//! runtime, one worker per core, as condense and `bare_relay` run.
//!
//! Same contract as `bare_relay`: `cargo build --release --example
//! hyper_relay`, then
//! `BENCH_RELAYS=hyper=target/release/examples/hyper_relay cargo bench
//! --bench passthrough` measures it beside condense; alone:
//! `target/release/examples/hyper_relay 127.0.0.1:19100` (upstream from
//! `UPSTREAM`, default `http://127.0.0.1:18080`; it prints
//! `listen=<address>`).
#![allow(clippy::print_stdout, clippy::expect_used, clippy::unwrap_used)]

use std::convert::Infallible;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{StatusCode, Uri};
use http_body_util::{Either, Empty};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The upstream's response body as is, or nothing (a 502).
type Body = Either<Incoming, Empty<Bytes>>;

/// The pooled client and where it sends requests: the upstream's authority,
/// and the path its base URL puts before each request's path
/// (`UPSTREAM=http://host:port/v1`), as `bare_relay` prepends it.
struct Upstream {
    client: Client<HttpConnector, Incoming>,
    authority: Authority,
    prefix: String,
}

async fn relay(
    up: &'static Upstream,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let mut parts = std::mem::take(req.uri_mut()).into_parts();
    parts.scheme = Some(Scheme::HTTP);
    parts.authority = Some(up.authority.clone());
    if !up.prefix.is_empty() {
        let pq = parts
            .path_and_query
            .as_ref()
            .map_or("/", PathAndQuery::as_str);
        parts.path_and_query = Some(format!("{}{pq}", up.prefix).parse().unwrap());
    }
    *req.uri_mut() = Uri::from_parts(parts).unwrap();
    // The client sets it from the URI.
    req.headers_mut().remove(http::header::HOST);
    Ok(match up.client.request(req).await {
        Ok(r) => r.map(Either::Left),
        Err(_) => {
            let mut r = Response::new(Either::Right(Empty::new()));
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        }
    })
}

async fn serve(listen: String, authority: Authority, prefix: String) {
    let mut connector = HttpConnector::new();
    // As condense and `bare_relay` do, on the upstream side too.
    connector.set_nodelay(true);
    // Lives as long as the process: every connection's service borrows it,
    // with no reference count to touch per request.
    let up: &'static Upstream = Box::leak(Box::new(Upstream {
        client: Client::builder(TokioExecutor::new()).build(connector),
        authority,
        prefix,
    }));
    let listener = tokio::net::TcpListener::bind(&listen).await.unwrap();
    println!("listen={}", listener.local_addr().unwrap());
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        // Without it, a response in several writes waits on the client's
        // delayed ACK.
        let _ = tcp.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service_fn(|req| relay(up, req)))
                .await;
        });
    }
}

fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:19100".into());
    let base = std::env::var("UPSTREAM").unwrap_or_else(|_| "http://127.0.0.1:18080".into());
    let base: Uri = base.parse().expect("UPSTREAM is not a URL");
    assert!(
        base.scheme() == Some(&Scheme::HTTP),
        "UPSTREAM must be http://"
    );
    let authority = base.authority().expect("UPSTREAM has no host").clone();
    let prefix = base.path().trim_end_matches('/').to_string();
    let mut rt = match std::env::var("RELAY_RUNTIME").as_deref() {
        Ok("multi") => tokio::runtime::Builder::new_multi_thread(),
        Ok("current") | Err(_) => tokio::runtime::Builder::new_current_thread(),
        Ok(other) => {
            eprintln!("RELAY_RUNTIME is multi or current, not {other}");
            std::process::exit(2);
        }
    };
    rt.enable_all()
        .build()
        .unwrap()
        .block_on(serve(listen, authority, prefix));
}
