use super::*;
use http_body_util::{BodyExt, Either, Full};
use std::sync::atomic::AtomicUsize;

/// What a test server saw: connections opened and ended, and the
/// request target and `Host` of each request.
#[derive(Default)]
struct Seen {
    opened: AtomicUsize,
    ended: AtomicUsize,
    requests: Mutex<Vec<(String, String)>>,
}

/// An HTTP/1.1 server on 127.0.0.1 answering every request with
/// `body`; its address and what it saw.
async fn server(body: &'static str) -> (std::net::SocketAddr, Arc<Seen>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            s.opened.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            tokio::spawn(async move {
                let s2 = s.clone();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let host = req
                        .headers()
                        .get(http::header::HOST)
                        .map_or("-", |h| h.to_str().unwrap_or("?"));
                    s2.requests
                        .lock()
                        .unwrap()
                        .push((req.uri().to_string(), host.to_string()));
                    async move {
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                            Bytes::from_static(body.as_bytes()),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), service)
                    .await;
                s.ended.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (addr, seen)
}

fn pool() -> Arc<Pool> {
    pool_bounded(IdleBound::new(256))
}

fn pool_bounded(bound: Arc<IdleBound>) -> Arc<Pool> {
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let no_proxy = hyper_util::client::proxy::matcher::Matcher::builder().build();
    let connector = Connector::with_proxies(tls, Duration::from_secs(5), no_proxy);
    Arc::new(Pool::new(connector, bound))
}

fn get(addr: std::net::SocketAddr, path: &str) -> Request<RequestBody> {
    let mut req = Request::new(Either::Left(Full::new(Bytes::new())));
    *req.uri_mut() = format!("http://{addr}{path}").parse().unwrap();
    req
}

async fn text(resp: Response<PooledBody>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Waits (a few seconds at most) for `done`.
async fn eventually(done: impl Fn() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("not within 5 s");
}

#[tokio::test]
async fn a_connection_is_used_again_once_its_answer_is_read() {
    let (addr, seen) = server("ok").await;
    let pool = pool();
    for i in 0..3 {
        let resp = pool.send(get(addr, &format!("/v1/x?i={i}"))).await.unwrap();
        assert_eq!(text(resp).await, "ok");
    }
    assert_eq!(seen.opened.load(Ordering::SeqCst), 1);
    assert_eq!(pool.unused(), 1);
    // HTTP/1.1 gets the path alone and a Host header.
    let requests = seen.requests.lock().unwrap().clone();
    let host = addr.to_string();
    assert_eq!(
        requests,
        (0..3)
            .map(|i| (format!("/v1/x?i={i}"), host.clone()))
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_connection_whose_answer_was_not_read_to_the_end_is_not_used_again() {
    let (addr, seen) = server("a body of some length").await;
    let pool = pool();
    let unread = pool.send(get(addr, "/a")).await.unwrap();
    assert!(!unread.body().is_end_stream());
    drop(unread);
    assert_eq!(pool.unused(), 0);
    // The next request gets a connection of its own; the dropped one
    // is closed.
    let resp = pool.send(get(addr, "/b")).await.unwrap();
    assert_eq!(text(resp).await, "a body of some length");
    assert_eq!(seen.opened.load(Ordering::SeqCst), 2);
    eventually(|| seen.ended.load(Ordering::SeqCst) == 1).await;
}

#[tokio::test]
async fn requests_at_once_get_a_connection_each_and_all_are_kept() {
    let (addr, seen) = server("ok").await;
    let pool = pool();
    let first = pool.send(get(addr, "/1")).await.unwrap();
    let second = pool.send(get(addr, "/2")).await.unwrap();
    assert_eq!(seen.opened.load(Ordering::SeqCst), 2);
    assert_eq!(
        (text(first).await, text(second).await),
        ("ok".into(), "ok".into())
    );
    assert_eq!(pool.unused(), 2);
    let again = pool.send(get(addr, "/3")).await.unwrap();
    assert_eq!(text(again).await, "ok");
    assert_eq!(seen.opened.load(Ordering::SeqCst), 2);
}

/// A pool holding one unused connection, and what its server saw.
async fn one_pooled() -> (Arc<Pool>, Arc<Seen>) {
    let (addr, seen) = server("ok").await;
    let pool = pool();
    let resp = pool.send(get(addr, "/")).await.unwrap();
    assert_eq!(text(resp).await, "ok");
    assert_eq!(pool.unused(), 1);
    (pool, seen)
}

#[tokio::test]
async fn connections_unused_for_the_idle_time_are_closed() {
    let (pool, seen) = one_pooled().await;
    pool.sweep(Instant::now() + IDLE / 2);
    assert_eq!(pool.unused(), 1, "still within the idle time");
    pool.sweep(Instant::now() + IDLE + Duration::from_millis(1));
    assert_eq!(pool.unused(), 0);
    eventually(|| seen.ended.load(Ordering::SeqCst) == 1).await;
}

/// A server that writes `answer` to each request (GETs, without a
/// body), and closes each connection after its first answer if `once`,
/// without saying so; its address and how many connections it took.
async fn raw_server(answer: &'static [u8], once: bool) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let opened = Arc::new(AtomicUsize::new(0));
    let o = opened.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            o.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                loop {
                    while let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..at + 4);
                        if sock.write_all(answer).await.is_err() || once {
                            return;
                        }
                    }
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    (addr, opened)
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

#[tokio::test]
async fn a_connection_the_server_closed_while_pooled_is_not_used() {
    let (addr, opened) = raw_server(OK, true).await;
    let pool = pool();
    for path in ["/1", "/2", "/3"] {
        let resp = pool.send(get(addr, path)).await.unwrap();
        assert_eq!(text(resp).await, "ok");
        // The close reaches the pooled connection.
        eventually(|| pool.unused_open() == 0).await;
    }
    assert_eq!(opened.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn answers_without_a_body_or_chunked_give_their_connection_back() {
    for answer in [
        &b"HTTP/1.1 204 No Content\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-done\r\n\r\n2\r\nok\r\n0\r\nx-done: 1\r\n\r\n",
    ] {
        let (addr, opened) = raw_server(answer, false).await;
        let pool = pool();
        for _ in 0..3 {
            let mut body = pool.send(get(addr, "/")).await.unwrap().into_body();
            // Read frame by frame, as the server relays it: nothing
            // after the last frame.
            while !body.is_end_stream() {
                match body.frame().await {
                    Some(frame) => {
                        if frame.unwrap().is_trailers() {
                            break;
                        }
                    }
                    None => break,
                }
            }
            drop(body);
        }
        assert_eq!(opened.load(Ordering::SeqCst), 1, "{}", String::from_utf8_lossy(answer));
    }
}

#[tokio::test]
async fn the_pool_closes_connections_unused_for_the_idle_time_on_its_own() {
    let (pool, seen) = one_pooled().await;
    // A second at a time on tokio's clock, until the pool has swept it.
    tokio::time::pause();
    let mut waited = Duration::ZERO;
    while pool.unused() > 0 {
        assert!(
            waited <= IDLE + 2 * SWEEP_EVERY,
            "not swept after {waited:?}"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        waited += Duration::from_secs(1);
    }
    tokio::time::resume();
    assert!(waited >= IDLE, "swept after {waited:?}");
    eventually(|| seen.ended.load(Ordering::SeqCst) == 1).await;
}

#[tokio::test]
async fn an_unreachable_host_is_a_connect_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let Err(e) = pool().send(get(addr, "/")).await else {
        panic!("nothing listens there")
    };
    assert!(
        matches!(e.downcast_ref::<PoolError>(), Some(PoolError::Connect(_))),
        "{e}"
    );
}

#[tokio::test]
async fn unused_connections_are_bounded_over_every_pool_and_host() {
    let (a, seen_a) = server("ok").await;
    let (b, seen_b) = server("ok").await;
    let bound = IdleBound::new(2);
    let (p, q) = (pool_bounded(bound.clone()), pool_bounded(bound));
    // Four connections at once: three to one host from one pool, one to
    // another host from another pool.
    let (r1, r2, r3, r4) = tokio::join!(
        p.send(get(a, "/1")),
        p.send(get(a, "/2")),
        p.send(get(a, "/3")),
        q.send(get(b, "/4")),
    );
    for r in [r1, r2, r3, r4] {
        assert_eq!(text(r.unwrap()).await, "ok");
    }
    assert_eq!(seen_a.opened.load(Ordering::SeqCst), 3);
    assert_eq!(p.unused() + q.unused(), 2, "two kept, over both pools");
    eventually(|| seen_a.ended.load(Ordering::SeqCst) + seen_b.ended.load(Ordering::SeqCst) == 2)
        .await;
    // A taken connection frees its place.
    let again = p.send(get(a, "/5")).await.unwrap();
    assert_eq!(text(again).await, "ok");
    assert_eq!(p.unused() + q.unused(), 2);
}
