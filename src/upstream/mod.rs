//! The upstream: the URL mapping, the transport, and the timeouts.
//!
//! The upstream host is fixed by configuration. A request's path and query
//! are appended to `upstream.base_url`; nothing the client sends (an
//! absolute-form URI, a `Host` header, `..` segments, plain or
//! percent-encoded) can point condense at another host or at a path outside
//! `base_url`'s: with a base of `https://gw/tenant-a/v1`, no client reaches
//! `/tenant-b/...` with the upstream key condense adds.
//!
//! Requests go out on condense's connection pools ([`pool`]:
//! HTTP/1.1, or HTTP/2 where TLS negotiates it; rustls with the Mozilla
//! roots and any private CA, see [`trust`]). When the environment
//! names a proxy for the upstream (`HTTPS_PROXY`, `HTTP_PROXY`,
//! `ALL_PROXY`, minus `NO_PROXY`), they go through reqwest instead, which
//! speaks the proxy protocol (absolute-form requests, `CONNECT` tunnels,
//! proxy credentials from the proxy URL), trusting the same roots.
//! reqwest costs about 22 µs more CPU a request (it parses the URL three
//! times over), so it is kept off the direct path.

mod pool;
pub mod trust;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Either, Full};
use url::Url;

use crate::cache::Bounded;
use crate::config::UpstreamConfig;
use crate::error::ProxyError;
use crate::server::workers;
use pool::{Connector, Pool, PooledBody, RequestBody};
use trust::{Trust, TrustError};

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot set up TLS for the upstream: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Trust(#[from] TrustError),
    #[error("invalid upstream.base_url: {0}")]
    BaseUrl(#[from] url::ParseError),
    #[error("invalid upstream.base_url: {0}")]
    BaseUri(#[from] http::uri::InvalidUri),
}

/// An error of either client, or of a body on its way.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body from the upstream.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// A response from the upstream, its body still to come.
pub type UpstreamResponse = http::Response<ResponseBody>;

/// A request body for the upstream.
pub enum Outgoing {
    Empty,
    /// A body condense holds whole (its length is sent).
    Whole(Bytes),
    /// A body relayed as it comes.
    Streamed(UnsyncBoxBody<Bytes, BoxError>),
}

/// How requests reach the upstream.
#[derive(Clone)]
enum Transport {
    /// One pool per worker thread (and one for any other thread): a pooled
    /// connection's task runs on the thread that opened it, and a request
    /// on another thread would wake that one for every read and write.
    Direct(Arc<[Arc<Pool>]>),
    /// Through the proxy the environment names for the upstream.
    Proxied(reqwest::Client),
}

#[derive(Clone, Copy)]
struct Timeouts {
    connect: Duration,
    first_byte: Duration,
    idle: Duration,
}

impl Transport {
    /// The transport for `base`, trusting `trust`'s roots: proxied when
    /// the environment says so.
    fn for_base(
        base: &Uri,
        connect_timeout: Duration,
        direct: Option<&Arc<[Arc<Pool>]>>,
        trust: &Trust,
    ) -> Result<Transport, UpstreamError> {
        let matcher = hyper_util::client::proxy::matcher::Matcher::from_env();
        if matcher.intercept(base).is_some() {
            let builder = reqwest::Client::builder()
                .connect_timeout(connect_timeout)
                // A proxy relays redirects; it does not follow them.
                .redirect(reqwest::redirect::Policy::none())
                .tcp_nodelay(true)
                .pool_idle_timeout(pool::IDLE);
            let client = trust.reqwest(builder)?.build()?;
            return Ok(Transport::Proxied(client));
        }
        let pools = match direct {
            Some(pools) => pools.clone(),
            None => direct_pools(trust.client_config()?, connect_timeout),
        };
        Ok(Transport::Direct(pools))
    }

    /// Sends a request; the response comes back when its headers have.
    async fn send(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Outgoing,
    ) -> Result<UpstreamResponse, BoxError> {
        match self {
            Transport::Direct(pools) => {
                let pool = &pools[workers::slot() % pools.len()];
                let whole = match body {
                    Outgoing::Empty => Bytes::new(),
                    Outgoing::Whole(b) => b,
                    Outgoing::Streamed(b) => {
                        let req = direct_request(method, uri, headers, Either::Right(b));
                        return Ok(boxed(pool.send(req).await?));
                    }
                };
                // An HTTP/2 server may refuse a request it never processed
                // (GOAWAY while it was on its way, REFUSED_STREAM): a body
                // condense holds is sent again, twice at most, as reqwest
                // did. Only TLS negotiates HTTP/2 here.
                if uri.scheme() != Some(&http::uri::Scheme::HTTPS) {
                    let req = direct_request(method, uri, headers, Either::Left(Full::new(whole)));
                    return Ok(boxed(pool.send(req).await?));
                }
                let mut tried = 0;
                loop {
                    tried += 1;
                    let body = Either::Left(Full::new(whole.clone()));
                    let req = direct_request(method.clone(), uri.clone(), headers.clone(), body);
                    match pool.send(req).await {
                        Ok(resp) => return Ok(boxed(resp)),
                        Err(e) if tried < 3 && refused_unprocessed(&*e) => {
                            tracing::debug!(error = %e, "the upstream refused the request unprocessed; sending it again");
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Transport::Proxied(client) => {
                let url = Url::parse(&uri.to_string())?;
                let mut req = client.request(method, url).headers(headers);
                match body {
                    Outgoing::Empty => {}
                    Outgoing::Whole(b) => req = req.body(b),
                    Outgoing::Streamed(b) => {
                        req = req.body(reqwest::Body::wrap_stream(
                            http_body_util::BodyDataStream::new(b),
                        ))
                    }
                }
                let resp = req.send().await.map_err(|e| e.without_url())?;
                Ok(from_reqwest(resp))
            }
        }
    }
}

/// The connection pools over `tls`, one for each worker thread and one for
/// the other threads: HTTP/1.1, or HTTP/2 where the server picks it in the
/// TLS handshake (as api.openai.com does).
fn direct_pools(tls: rustls::ClientConfig, connect_timeout: Duration) -> Arc<[Arc<Pool>]> {
    let connector = Connector::new(tls, connect_timeout);
    (0..=workers::count())
        .map(|_| Arc::new(Pool::new(connector.clone())))
        .collect()
}

pub struct Upstream {
    transport: Transport,
    /// Set for `condense replay`: requests are answered in process.
    simulator: Option<std::sync::Arc<crate::simulate::Simulator>>,
    /// `base_url` without a trailing slash.
    base: String,
    /// The path of `base_url` without a trailing slash (`/v1`, or empty).
    base_path: String,
    host: Option<String>,
    /// `Authorization: Basic` from a `user:pass@` in `base_url`, sent when
    /// a request carries no `Authorization` of its own (as reqwest did).
    basic: Option<http::HeaderValue>,
    port: Option<u16>,
    timeouts: Timeouts,
    /// The roots TLS connections are verified against (kept for
    /// [`Upstream::rebased`] and for the summarizer).
    trust: Trust,
    /// URIs of paths (without a query) mapped lately: every request to a
    /// route would otherwise check and parse the same URL again.
    mapped: Bounded<String, Uri>,
}

/// Longest path whose URL is remembered.
const MAPPED_PATH_BYTES: usize = 256;

fn mapped_cache() -> Bounded<String, Uri> {
    Bounded::new(1024, 1 << 20, |path, uri| {
        let tail = uri.path_and_query().map_or(0, |p| p.as_str().len());
        (path.len() + tail + 64) as u64
    })
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
        Upstream::with(&config.base_url, timeouts, None, trust)
    }

    /// An upstream at `base_url`, sharing `direct`'s pool when it is reached
    /// directly.
    fn with(
        base_url: &str,
        t: Timeouts,
        direct: Option<&Arc<[Arc<Pool>]>>,
        trust: Trust,
    ) -> Result<Upstream, UpstreamError> {
        let parsed = Url::parse(base_url)?;
        let base_uri: Uri = parsed.as_str().parse()?;
        Ok(Upstream {
            transport: Transport::for_base(&base_uri, t.connect, direct, &trust)?,
            simulator: None,
            base: base_url.trim_end_matches('/').to_string(),
            base_path: parsed.path().trim_end_matches('/').to_string(),
            host: parsed.host_str().map(str::to_string),
            basic: basic_auth(&parsed),
            port: parsed.port_or_known_default(),
            timeouts: t,
            trust,
            mapped: mapped_cache(),
        })
    }

    /// An upstream whose requests `simulator` answers in process (for
    /// `condense replay`); everything else as [`Upstream::new`].
    pub fn simulated(
        config: &UpstreamConfig,
        simulator: std::sync::Arc<crate::simulate::Simulator>,
    ) -> Result<Upstream, UpstreamError> {
        let mut u = Upstream::new(config)?;
        u.simulator = Some(simulator);
        Ok(u)
    }

    /// The same client (and simulator) in front of another base URL.
    pub fn rebased(&self, base_url: &str) -> Result<Upstream, UpstreamError> {
        let direct = match &self.transport {
            Transport::Direct(c) => Some(c),
            Transport::Proxied(_) => None,
        };
        let mut u = Upstream::with(base_url, self.timeouts, direct, self.trust.clone())?;
        u.simulator = self.simulator.clone();
        Ok(u)
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
        &self.base
    }

    /// The upstream URL for a client path and query: `/v1/<rest>` and
    /// `/<rest>` both map to `<base_url>/<rest>`.
    pub fn url_for(&self, path: &str, query: Option<&str>) -> Result<Uri, ProxyError> {
        if query.is_some() || path.len() > MAPPED_PATH_BYTES {
            return self.map_url(path, query);
        }
        if let Some(uri) = self.mapped.get(path) {
            return Ok(uri);
        }
        let uri = self.map_url(path, None)?;
        self.mapped.insert(path.to_string(), uri.clone());
        Ok(uri)
    }

    fn map_url(&self, path: &str, query: Option<&str>) -> Result<Uri, ProxyError> {
        let rest = match path.strip_prefix("/v1") {
            Some(r) if r.is_empty() || r.starts_with('/') => r,
            _ => path,
        };
        // A dot segment or a backslash, as sent or decoded, is refused:
        // `Url` resolves the plain ones, but an upstream may decode `%2e%2e`
        // or `..%2f` itself (twice, behind another proxy: `%252e`) and walk
        // out of the base path, and Tomcat, Jetty and Spring read `..;x`
        // (a segment with parameters) as `..`.
        let decoded = decoded_fully(rest)
            .ok_or(ProxyError::InvalidPath("is percent-encoded too many times"))?;
        let dot = |seg: &str| matches!(seg.split(';').next(), Some("." | ".."));
        if decoded.contains('\\') || decoded.split('/').any(dot) {
            return Err(ProxyError::InvalidPath("may not contain dot segments"));
        }
        let mut s = String::with_capacity(self.base.len() + rest.len() + 32);
        s.push_str(&self.base);
        s.push_str(rest);
        if let Some(q) = query {
            s.push('?');
            s.push_str(q);
        }
        let mut url =
            Url::parse(&s).map_err(|_| ProxyError::InvalidPath("is not a valid URL path"))?;
        // Defence in depth: whatever the path held, the host stays ours and
        // the path stays under the base path.
        let under_base = url
            .path()
            .strip_prefix(self.base_path.as_str())
            .is_some_and(|r| r.is_empty() || r.starts_with('/'));
        if url.host_str() != self.host.as_deref()
            || url.port_or_known_default() != self.port
            || !under_base
        {
            return Err(ProxyError::InvalidPath("leaves the upstream's base path"));
        }
        // Credentials in the base go as a header (see `basic`): HTTP/1.1
        // would drop them, and HTTP/2 would send them in `:authority`.
        let _ = url.set_username("");
        let _ = url.set_password(None);
        // `Url` escapes what `Uri` refuses, as reqwest relies on too.
        url.as_str()
            .parse()
            .map_err(|_| ProxyError::InvalidPath("is not a valid URL path"))
    }

    /// Sends a request and waits for the response headers, within the
    /// first-byte timeout.
    pub async fn send(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Outgoing,
    ) -> Result<UpstreamResponse, ProxyError> {
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
    ) -> Result<UpstreamResponse, ProxyError> {
        if let Some(sim) = &self.simulator {
            let bytes = match body {
                Outgoing::Whole(b) => b,
                Outgoing::Empty | Outgoing::Streamed(_) => Bytes::new(),
            };
            return Ok(sim.respond(&method, uri.path(), &bytes).map(whole_body));
        }
        let mut headers = headers;
        if let Some(basic) = &self.basic
            && !headers.contains_key(http::header::AUTHORIZATION)
        {
            headers.insert(http::header::AUTHORIZATION, basic.clone());
        }
        let sending = self.transport.send(method, uri, headers, body);
        let t = self.timeouts;
        let waited_out = async {
            sent.await;
            tokio::time::sleep(t.first_byte).await;
        };
        let answer = tokio::select! {
            biased;
            answer = sending => answer,
            () = waited_out => return Err(ProxyError::UpstreamTimeout(t.first_byte.as_secs_f64())),
        };
        match answer {
            Ok(resp) => Ok(resp),
            Err(e) if timed_out(e.as_ref()) => {
                Err(ProxyError::UpstreamTimeout(t.connect.as_secs_f64()))
            }
            // reqwest's errors were stripped of the URL: it may carry
            // credentials, and the message reaches the client.
            Err(e) => Err(ProxyError::UpstreamUnreachable(describe(e.as_ref()))),
        }
    }
}

/// A reqwest response as the upstream's (errors without the URL: it may
/// carry credentials, and error messages reach the client).
pub fn from_reqwest(resp: reqwest::Response) -> UpstreamResponse {
    http::Response::from(resp).map(|b| {
        b.map_err(|e| BoxError::from(e.without_url()))
            .boxed_unsync()
    })
}

/// A body condense holds whole, as a response body.
pub fn whole_body(bytes: Bytes) -> ResponseBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn direct_request(
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: RequestBody,
) -> http::Request<RequestBody> {
    let mut req = http::Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req
}

/// A pooled connection's response with its body boxed.
fn boxed(resp: http::Response<PooledBody>) -> UpstreamResponse {
    resp.map(|b| b.map_err(BoxError::from).boxed_unsync())
}

/// Whether an HTTP/2 server turned the request away before processing it:
/// a graceful GOAWAY it arrived after, or REFUSED_STREAM (RFC 9113, 8.7).
fn refused_unprocessed(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e)
        .find_map(|cause| cause.downcast_ref::<h2::Error>())
        .is_some_and(|h2| {
            let go_away = h2.is_go_away() && h2.reason() == Some(h2::Reason::NO_ERROR);
            let refused = h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            h2.is_remote() && (go_away || refused)
        })
}

/// `e` and its sources, outermost first.
fn causes<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |cause| cause.source())
}

/// `Authorization: Basic` for the credentials in `url`, if it has any.
fn basic_auth(url: &Url) -> Option<http::HeaderValue> {
    use base64::Engine;
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let user = percent_decode(url.username());
    let password = percent_decode(url.password().unwrap_or(""));
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut value = http::HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// The length a response's headers announce for its body, if any.
pub fn content_length(resp: &UpstreamResponse) -> Option<u64> {
    http_body::Body::size_hint(resp.body()).exact()
}

/// Whether connecting timed out (the connector's timeout, or the system's).
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|cause| {
        cause
            .downcast_ref::<reqwest::Error>()
            .is_some_and(reqwest::Error::is_timeout)
            || cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// Times a path is decoded to find what an upstream could make of it.
const DECODE_ROUNDS: usize = 3;

/// `s` decoded until no escape is left to decode, or None when
/// [`DECODE_ROUNDS`] did not get there (no client encodes a path three
/// times; the bound keeps `%252525...` from costing a round per layer).
fn decoded_fully(s: &str) -> Option<String> {
    let mut decoded = percent_decode(s);
    for _ in 0..DECODE_ROUNDS {
        let again = percent_decode(&decoded);
        if again == decoded {
            return Some(decoded);
        }
        decoded = again;
    }
    None
}

/// `s` with its `%XX` escapes decoded (invalid ones kept as they are;
/// bytes that are not UTF-8 replaced).
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// A one-line description of a client error with its causes, such as
/// "cannot connect to the upstream: tcp connect error: Connection refused
/// (os error 111)" (an error's own Display stops at its first part: the
/// pool's "cannot connect to the upstream", reqwest's "error sending
/// request").
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    causes(e)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::rt::TokioExecutor;

    fn upstream(base: &str) -> Upstream {
        Upstream::new(&UpstreamConfig {
            base_url: base.to_string(),
            ..UpstreamConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn paths_map_onto_the_base_url() {
        let u = upstream("http://127.0.0.1:9000/v1/");
        let url = |p, q| u.url_for(p, q).unwrap().to_string();
        assert_eq!(
            url("/v1/chat/completions", None),
            "http://127.0.0.1:9000/v1/chat/completions"
        );
        assert_eq!(
            url("/chat/completions", None),
            "http://127.0.0.1:9000/v1/chat/completions"
        );
        assert_eq!(
            url("/v1/models", Some("a=1&b=2")),
            "http://127.0.0.1:9000/v1/models?a=1&b=2"
        );
        assert_eq!(url("/v1beta/x", None), "http://127.0.0.1:9000/v1/v1beta/x");
    }

    #[test]
    fn the_path_cannot_leave_the_base_path() {
        let u = upstream("http://127.0.0.1:9000/tenant-a/v1");
        for p in [
            "/v1/../../tenant-b/v1/models",
            "/v1/%2e%2e/%2E%2E/tenant-b/v1/models",
            "/v1/..%2f..%2ftenant-b/v1/models",
            "/v1/..%5c..%5ctenant-b",
            "/v1\\..\\..\\tenant-b",
            "/./models",
            "/v1/models/..",
            "/v1/..;/..;/tenant-b/v1/models",
            "/v1/..;jsessionid=x/tenant-b",
            "/v1/%252e%252e/%252e%252e/tenant-b/v1/models",
            "/v1/%25252e%25252e/x",
            "/v1/%2525252e%2525252e/x",
        ] {
            let e = u.url_for(p, None).unwrap_err();
            assert!(matches!(e, ProxyError::InvalidPath(_)), "{p}: {e}");
        }
        assert_eq!(
            u.url_for("/v1/models/gpt-4o%2Fmini", None).unwrap().path(),
            "/tenant-a/v1/models/gpt-4o%2Fmini"
        );
        assert_eq!(
            u.url_for("/v1/files/..file", None).unwrap().path(),
            "/tenant-a/v1/files/..file"
        );
        assert_eq!(
            u.url_for("/v1/files/a;b/100%25", None).unwrap().path(),
            "/tenant-a/v1/files/a;b/100%25"
        );
    }

    #[test]
    fn remembered_urls_are_the_ones_mapped_each_time() {
        for base in [
            "http://127.0.0.1:9000/v1/",
            "https://gw.example/tenant-a/v1",
        ] {
            let u = upstream(base);
            for p in ["/v1/chat/completions", "/messages", "/v1/files/f-1"] {
                // Mapped, then remembered: the same URL both times.
                for _ in 0..2 {
                    assert_eq!(u.url_for(p, None).unwrap(), u.map_url(p, None).unwrap());
                }
                assert!(u.mapped.get(p).is_some(), "{p}");
                assert_eq!(
                    u.url_for(p, Some("beta=true")).unwrap().query(),
                    Some("beta=true")
                );
            }
            // A refused path is refused every time, and never remembered.
            for _ in 0..2 {
                assert!(u.url_for("/v1/../x", None).is_err());
            }
            assert!(u.mapped.get("/v1/../x").is_none());
        }
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
    fn trusting_client() -> Transport {
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
        Transport::Direct(direct_pools(tls, Duration::from_secs(5)))
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
        u.transport = trusting_client();
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
            Err(ProxyError::UpstreamTimeout(s)) => assert_eq!(s, 0.2),
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
            Err(ProxyError::UpstreamUnreachable(why)) => {
                assert!(why.contains("certificate"), "{why}")
            }
            Err(e) => panic!("{e}"),
            Ok(r) => panic!("answered {}", r.status()),
        }
        assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[test]
    fn the_client_cannot_choose_the_host() {
        let u = upstream("http://127.0.0.1:9000/v1");
        for p in [
            "/v1/../../x",
            "//evil.example/v1",
            "/@evil.example",
            "/v1/..%2f..%2f",
        ] {
            if let Ok(uri) = u.url_for(p, None) {
                assert_eq!(uri.host(), Some("127.0.0.1"), "{p}");
                assert_eq!(uri.port_u16(), Some(9000), "{p}");
            }
        }
    }
}
