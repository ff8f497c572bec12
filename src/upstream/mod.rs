//! The one HTTP client of every call condense makes: forwarded requests to
//! the upstream and to Anthropic's API, the `/models` listing, the
//! summarizer's calls. Each is an [`Upstream`] at its base URL; they share
//! one set of connection pools, timeouts and TLS roots.
//!
//! - `map.rs`: where a request goes: the client's path under the base URL,
//!   confined to it; credentials in the base URL sent as a header.
//! - `transport.rs`: the pools, one a worker thread, and what is sent again.
//! - `pool.rs`: the connections, kept open for the next request; HTTP/2
//!   ones shared up to the server's stream limit.
//! - `connect.rs`: opening one, straight or through an HTTP proxy.
//! - `settings.rs`: the HTTP/2 server's stream limit, read off the wire.
//! - `trust.rs`: the certificates TLS connections are verified against.
//! - `body.rs`, `error.rs`: what goes out and comes back, and how it fails.
//!
//! Why condense's own pool over hyper-util's (reqwest's) client: that one
//! keeps one HTTP/2 connection a host and queues requests past the
//! server's stream limit inside it, where their first-byte deadline runs,
//! and bounds idle connections per host only; on small requests it costs
//! about 11,700 instructions more (see `pool.rs`). reqwest served the
//! proxied path and the summarizer until both moved here: one set of
//! timeouts, TLS settings and tests.
//!
//! An [`Upstream`] adds the timeouts: for connecting, for the response
//! headers, and between two chunks of the body.

mod body;
mod connect;
mod error;
mod map;
mod pool;
mod settings;
pub mod socket;
mod transport;
pub mod trust;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Uri};

use crate::config::UpstreamConfig;
use map::BaseUrl;
use transport::Pools;
use trust::Trust;

pub use body::{Outgoing, ResponseBody, UpstreamResponse, content_length, whole_body};
pub use error::{BoxError, InvalidPath, SendError, UpstreamError, describe};

#[derive(Clone, Copy)]
struct Timeouts {
    connect: Duration,
    first_byte: Duration,
    idle: Duration,
}

/// Something that answers the upstream's requests in process, in place of
/// the network: `condense replay` sends every turn through the real proxy to
/// a provider of its own this way, and tests and benches may too. It gets
/// the method, the path and a body condense holds whole (empty when it was
/// streamed); no timeout, credential or connection applies.
pub trait InProcess: Send + Sync {
    fn respond(&self, method: &Method, path: &str, body: &Bytes) -> http::Response<Bytes>;
}

pub struct Upstream {
    pools: Pools,
    /// Whether a client socket's turns may take the upstream's own socket
    /// (`upstream.responses_websocket`; the main upstream only).
    websocket: bool,
    /// When the upstream last refused one.
    refused: Arc<socket::Refused>,
    /// Answers requests in place of the network, when set.
    in_process: Option<Arc<dyn InProcess>>,
    base: BaseUrl,
    timeouts: Timeouts,
    /// The roots TLS connections are verified against (kept for
    /// [`Upstream::rebased`] and for the summarizer).
    trust: Trust,
}

impl Upstream {
    /// The upstream `config` names, its TLS trusting the Mozilla roots and
    /// the private CA of `upstream.ca_file` or `SSL_CERT_FILE` (read now:
    /// a file that cannot serve is an error here, at start-up).
    pub fn new(config: &UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let timeouts = Timeouts {
            connect: Duration::from_secs_f64(config.connect_timeout_seconds),
            first_byte: Duration::from_secs_f64(config.first_byte_timeout_seconds),
            idle: Duration::from_secs_f64(config.idle_timeout_seconds),
        };
        let trust = Trust::from_config(config)?;
        let pools = transport::pools(
            trust.client_config()?,
            timeouts.connect,
            config.max_idle_connections,
        );
        let mut u = Upstream::with(&config.base_url, timeouts, pools, trust)?;
        u.websocket = config.responses_websocket;
        Ok(u)
    }

    /// An upstream at `base_url` on `pools`.
    fn with(
        base_url: &str,
        t: Timeouts,
        pools: Pools,
        trust: Trust,
    ) -> Result<Upstream, UpstreamError> {
        Ok(Upstream {
            pools,
            websocket: false,
            refused: Arc::default(),
            in_process: None,
            base: BaseUrl::new(base_url)?,
            timeouts: t,
            trust,
        })
    }

    /// An upstream whose requests `responder` answers in process;
    /// everything else as [`Upstream::new`].
    pub fn in_process(
        config: &UpstreamConfig,
        responder: Arc<dyn InProcess>,
    ) -> Result<Upstream, UpstreamError> {
        let mut u = Upstream::new(config)?;
        u.in_process = Some(responder);
        Ok(u)
    }

    /// The same client (connections, timeouts, in-process responder) in
    /// front of another base URL.
    pub fn rebased(&self, base_url: &str) -> Result<Upstream, UpstreamError> {
        let pools = self.pools.clone();
        let mut u = Upstream::with(base_url, self.timeouts, pools, self.trust.clone())?;
        u.in_process = self.in_process.clone();
        Ok(u)
    }

    /// The same client (connections, timeouts) in front of another base
    /// URL, on the network even when this one is answered in process: a
    /// summarizer of its own.
    pub fn elsewhere(&self, base_url: &str) -> Result<Upstream, UpstreamError> {
        let pools = self.pools.clone();
        Upstream::with(base_url, self.timeouts, pools, self.trust.clone())
    }

    /// The roots this upstream's TLS connections are verified against.
    pub fn trust(&self) -> &Trust {
        &self.trust
    }

    /// Longest silence allowed between two chunks of a response body.
    pub fn idle_timeout(&self) -> Duration {
        self.timeouts.idle
    }

    /// The configured base URL (also the calibration key for this upstream).
    pub fn base_url(&self) -> &str {
        self.base.as_str()
    }

    /// The upstream URL for a client path and query: `/v1/<rest>` and
    /// `/<rest>` both map to `<base_url>/<rest>`.
    pub fn url_for(&self, path: &str, query: Option<&str>) -> Result<Uri, InvalidPath> {
        self.base.url_for(path, query)
    }

    /// Sends a request and waits for the response headers, within the
    /// first-byte timeout.
    pub async fn send(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Outgoing,
    ) -> Result<UpstreamResponse, SendError> {
        self.send_after(method, uri, headers, body, std::future::ready(()))
            .await
    }

    /// [`Upstream::send`] for a body still on its way from the client: the
    /// first-byte timeout runs from when `sent` resolves. Until then the
    /// upstream waits for the client, whose body has its own deadline; a
    /// client that stalls mid-body is answered for that (408), not with
    /// the upstream's 504.
    pub async fn send_after(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Outgoing,
        sent: impl Future<Output = ()>,
    ) -> Result<UpstreamResponse, SendError> {
        if let Some(responder) = &self.in_process {
            let bytes = match body {
                Outgoing::Whole(b) => b,
                Outgoing::Empty | Outgoing::Streamed(_) => Bytes::new(),
            };
            return Ok(responder
                .respond(&method, uri.path(), &bytes)
                .map(whole_body));
        }
        let mut headers = headers;
        self.base.authorize(&mut headers);
        // A client socket's turn takes the upstream's socket, when it may.
        let over_socket = match &body {
            Outgoing::Whole(bytes)
                if self.websocket
                    && method == Method::POST
                    && uri.path().ends_with("/responses") =>
            {
                socket::current().map(|session| (session, bytes.clone()))
            }
            _ => None,
        };
        let sending = async {
            if let Some((session, bytes)) = over_socket
                && let Some(answer) = session
                    .send(&self.pools, &self.refused, &uri, &headers, &bytes)
                    .await
            {
                return answer;
            }
            self.pools.send(method, uri, headers, body).await
        };
        let t = self.timeouts;
        let waited_out = async {
            sent.await;
            tokio::time::sleep(t.first_byte).await;
        };
        let answer = tokio::select! {
            biased;
            answer = sending => answer,
            () = waited_out => return Err(SendError::Timeout(t.first_byte.as_secs_f64())),
        };
        match answer {
            Ok(resp) => Ok(resp),
            Err(e) if error::timed_out(e.as_ref()) => {
                Err(SendError::Timeout(t.connect.as_secs_f64()))
            }
            // No error of the pool names the URL: it may carry credentials,
            // and the message reaches the client.
            Err(e) => Err(SendError::Unreachable(describe(e.as_ref()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioExecutor;

    fn upstream(base: &str) -> Upstream {
        Upstream::new(&UpstreamConfig {
            base_url: base.to_string(),
            ..UpstreamConfig::default()
        })
        .unwrap()
    }

    /// A self-signed certificate for 127.0.0.1 and localhost, made for these
    /// tests (no public CA signed it).
    const TEST_CERT: &[u8] = include_bytes!("../../tests/fixtures/tls/cert.pem");
    const TEST_KEY: &[u8] = include_bytes!("../../tests/fixtures/tls/key.pem");

    fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
        std::sync::Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A TLS server on 127.0.0.1 offering `alpn`, handing each connection
    /// that completes its handshake to `serve`; its address.
    async fn serve_tls<F, Fut>(alpn: &[&[u8]], serve: F) -> std::net::SocketAddr
    where
        F: Fn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>) -> Fut
            + Send
            + Sync
            + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let acceptor = server_tls(alpn);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serve = std::sync::Arc::new(serve);
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (acceptor, serve) = (acceptor.clone(), serve.clone());
                tokio::spawn(async move {
                    if let Ok(tls) = acceptor.accept(sock).await {
                        serve(tls).await;
                    }
                });
            }
        });
        addr
    }

    /// An HTTPS server offering `alpn`, answering each request with the HTTP
    /// version it came in, the authority it was addressed to and its
    /// `Authorization`, one per line; its address, and how many requests it
    /// answered.
    async fn tls_server(
        alpn: &[&[u8]],
    ) -> (
        std::net::SocketAddr,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = answered.clone();
        let addr = serve_tls(alpn, move |tls| {
            let count = count.clone();
            let service = hyper::service::service_fn(move |req: http::Request<_>| {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let header = |name| {
                    req.headers()
                        .get(name)
                        .and_then(|v: &http::HeaderValue| v.to_str().ok())
                        .unwrap_or("-")
                        .to_string()
                };
                let authority = req
                    .uri()
                    .authority()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| header(http::header::HOST));
                let seen = format!(
                    "{:?}\n{authority}\n{}",
                    req.version(),
                    header(http::header::AUTHORIZATION)
                );
                async move {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(
                        seen,
                    ))))
                }
            });
            async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            }
        })
        .await;
        (addr, answered)
    }

    /// The client condense uses, trusting the test certificate.
    fn trusting_client() -> Pools {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(TEST_CERT) {
            roots.add(cert.unwrap()).unwrap();
        }
        let tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        transport::pools(tls, Duration::from_secs(5), 256)
    }

    /// What the test server saw of a GET through `u`: the HTTP version, the
    /// authority and the `Authorization` header (`-` for none).
    async fn seen_by_server(u: &Upstream, headers: HeaderMap) -> (http::Version, String, String) {
        let uri = u.url_for("/v1/models", None).unwrap();
        let resp = u
            .send(Method::GET, uri, headers, Outgoing::Empty)
            .await
            .unwrap();
        let version = resp.version();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(body.to_vec()).unwrap();
        let mut lines = text.lines().map(str::to_string);
        assert_eq!(lines.next().unwrap(), format!("{version:?}"));
        (version, lines.next().unwrap(), lines.next().unwrap())
    }

    /// An upstream at `base` whose client trusts the test certificate.
    fn trusting(base: &str) -> Upstream {
        let mut u = upstream(base);
        u.pools = trusting_client();
        u
    }

    #[tokio::test]
    async fn https_upstreams_get_http2_when_their_tls_offers_it_and_http1_otherwise() {
        let (h2, _) = tls_server(&[b"h2", b"http/1.1"]).await;
        let (h1, _) = tls_server(&[b"http/1.1"]).await;
        for (addr, version) in [(h2, http::Version::HTTP_2), (h1, http::Version::HTTP_11)] {
            let authority = format!("localhost:{}", addr.port());
            let u = trusting(&format!("https://{authority}/v1"));
            assert_eq!(
                seen_by_server(&u, HeaderMap::new()).await,
                (version, authority, "-".to_string())
            );
        }
    }

    #[tokio::test]
    async fn requests_to_an_http2_upstream_share_one_connection() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let connections = std::sync::Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        let addr = serve_tls(&[b"h2"], move |tls| {
            count.fetch_add(1, Ordering::SeqCst);
            let service = hyper::service::service_fn(|_req: http::Request<_>| async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                    Bytes::from_static(b"ok"),
                )))
            });
            async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            }
        })
        .await;
        let u = trusting(&format!("https://localhost:{}/v1", addr.port()));
        let get = || async {
            let uri = u.url_for("/v1/models", None).unwrap();
            let resp = u
                .send(Method::GET, uri, HeaderMap::new(), Outgoing::Empty)
                .await
                .unwrap();
            let version = resp.version();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (version, body)
        };
        let ok = (http::Version::HTTP_2, Bytes::from_static(b"ok"));
        // The first request opens the connection; the next ones, at once,
        // share it.
        assert_eq!(get().await, ok);
        let (a, b, c) = tokio::join!(get(), get(), get());
        assert_eq!([a, b, c], [ok.clone(), ok.clone(), ok]);
        assert_eq!(connections.load(Ordering::SeqCst), 1);
    }

    /// An HTTP/2 server allowing `streams` streams a connection, holding
    /// each answer `hold`; its address, the connections it took, and the
    /// most streams one connection carried at once.
    async fn limited_h2_server(
        streams: u32,
        hold: Duration,
    ) -> (
        std::net::SocketAddr,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let connections = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (c, m) = (connections.clone(), most.clone());
        let addr = serve_tls(&[b"h2"], move |tls| {
            c.fetch_add(1, Ordering::SeqCst);
            let (m, now) = (m.clone(), Arc::new(AtomicUsize::new(0)));
            let service = hyper::service::service_fn(move |_req: http::Request<_>| {
                let (m, now) = (m.clone(), now.clone());
                async move {
                    let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(n, Ordering::SeqCst);
                    tokio::time::sleep(hold).await;
                    now.fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                        Bytes::from_static(b"ok"),
                    )))
                }
            });
            async move {
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(streams)
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            }
        })
        .await;
        (addr, connections, most)
    }

    /// The body of a GET of `/v1/models` through `u`.
    async fn models(u: &Upstream) -> Bytes {
        let uri = u.url_for("/v1/models", None).unwrap();
        let resp = u
            .send(Method::GET, uri, HeaderMap::new(), Outgoing::Empty)
            .await
            .unwrap();
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    #[tokio::test]
    async fn past_the_servers_stream_limit_another_http2_connection_is_opened() {
        use std::sync::atomic::Ordering;
        let (addr, connections, most) = limited_h2_server(3, Duration::from_millis(300)).await;
        let u = trusting(&format!("https://localhost:{}/v1", addr.port()));
        // One request first, so the server's SETTINGS are known.
        assert_eq!(models(&u).await, "ok");
        let answers = futures_util::future::join_all((0..10).map(|_| models(&u))).await;
        assert!(answers.iter().all(|a| a == "ok"));
        // Ten at once, three a connection: four connections, where one
        // would have queued seven inside it.
        assert_eq!(connections.load(Ordering::SeqCst), 4);
        assert_eq!(most.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_burst_to_a_new_http2_host_waits_for_one_connection() {
        use std::sync::atomic::Ordering;
        let (addr, connections, most) = limited_h2_server(100, Duration::from_millis(50)).await;
        let u = trusting(&format!("https://localhost:{}/v1", addr.port()));
        let answers = futures_util::future::join_all((0..50).map(|_| models(&u))).await;
        assert!(answers.iter().all(|a| a == "ok"));
        assert_eq!(connections.load(Ordering::SeqCst), 1);
        assert_eq!(most.load(Ordering::SeqCst), 50);
    }

    #[tokio::test]
    async fn credentials_in_the_base_url_go_as_basic_auth_unless_the_request_has_its_own() {
        let (h2, _) = tls_server(&[b"h2", b"http/1.1"]).await;
        let (h1, _) = tls_server(&[b"http/1.1"]).await;
        for addr in [h2, h1] {
            let authority = format!("localhost:{}", addr.port());
            let u = trusting(&format!("https://gw-user:p%40ss@{authority}/v1"));
            // base64("gw-user:p@ss")
            let basic = "Basic Z3ctdXNlcjpwQHNz".to_string();
            let (_, seen_authority, auth) = seen_by_server(&u, HeaderMap::new()).await;
            // The credentials are in the header only: not in `:authority`
            // (HTTP/2) or `Host` (HTTP/1.1).
            assert_eq!((seen_authority, auth), (authority.clone(), basic));
            let mut own = HeaderMap::new();
            own.insert(
                http::header::AUTHORIZATION,
                http::HeaderValue::from_static("Bearer sk-client"),
            );
            let (_, _, auth) = seen_by_server(&u, own).await;
            assert_eq!(auth, "Bearer sk-client");
        }
    }

    /// The TLS config of the test servers, offering `alpn`.
    fn server_tls(alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_slice_iter(TEST_CERT)
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(TEST_KEY).unwrap();
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
    }

    #[tokio::test]
    async fn a_request_an_http2_upstream_refused_unprocessed_is_sent_again() {
        // An HTTP/2 server that refuses the first stream of each connection
        // (REFUSED_STREAM) and answers the others.
        let streams = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = streams.clone();
        let addr = serve_tls(&[b"h2"], move |tls| {
            let count = count.clone();
            async move {
                let mut conn = h2::server::handshake(tls).await.unwrap();
                let mut first = true;
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if std::mem::take(&mut first) {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let mut body = respond
                        .send_response(http::Response::new(()), false)
                        .unwrap();
                    body.send_data(Bytes::from_static(b"answered"), true)
                        .unwrap();
                }
            }
        })
        .await;
        let u = trusting(&format!("https://localhost:{}/v1", addr.port()));
        let uri = u.url_for("/v1/chat/completions", None).unwrap();
        let resp = u
            .send(
                Method::POST,
                uri,
                HeaderMap::new(),
                Outgoing::Whole(Bytes::from("{}")),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"answered");
        assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_tls_handshake_that_never_ends_is_a_connect_timeout() {
        // Accepts connections and never says a word.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((sock, _)) = listener.accept().await {
                held.push(sock);
            }
        });
        let u = Upstream::new(&UpstreamConfig {
            base_url: format!("https://localhost:{}/v1", addr.port()),
            connect_timeout_seconds: 0.2,
            first_byte_timeout_seconds: 5.0,
            ..UpstreamConfig::default()
        })
        .unwrap();
        let uri = u.url_for("/v1/models", None).unwrap();
        let sent = u
            .send(Method::GET, uri, HeaderMap::new(), Outgoing::Empty)
            .await;
        match sent {
            Err(SendError::Timeout(s)) => assert_eq!(s, 0.2),
            Err(e) => panic!("{e}"),
            Ok(r) => panic!("answered {}", r.status()),
        }
    }

    #[tokio::test]
    async fn an_upstream_whose_certificate_does_not_verify_never_gets_the_request() {
        let (addr, answered) = tls_server(&[b"h2", b"http/1.1"]).await;
        let u = upstream(&format!("https://localhost:{}/v1", addr.port()));
        let uri = u.url_for("/v1/chat/completions", None).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_static("Bearer sk-secret"),
        );
        let sent = u
            .send(
                Method::POST,
                uri,
                headers,
                Outgoing::Whole(Bytes::from("{}")),
            )
            .await;
        match sent {
            Err(SendError::Unreachable(why)) => {
                assert!(why.contains("certificate"), "{why}")
            }
            Err(e) => panic!("{e}"),
            Ok(r) => panic!("answered {}", r.status()),
        }
        assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
