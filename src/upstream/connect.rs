//! Opening a connection to an upstream host: straight to it, or through
//! the HTTP proxy the environment names for it (`HTTPS_PROXY`,
//! `HTTP_PROXY`, `ALL_PROXY`, minus `NO_PROXY`, read as curl reads them):
//! a `CONNECT` tunnel for an https host, with TLS to the host inside it;
//! for an http host, a connection to the proxy that requests go on in
//! absolute form. Credentials in the proxy's URL go as
//! `Proxy-Authorization`, to the proxy only. Name lookup, TCP, the proxy's
//! answer and TLS have the connect timeout between them. TLS is rustls
//! with [`super::trust`]'s roots, offering HTTP/2 and HTTP/1.1; an HTTP/2
//! connection's incoming bytes pass through [`super::settings`], so the
//! pool knows how many streams the server lets it carry.
//!
//! hyper-util does each piece (its connector, its `CONNECT` tunnel, its
//! reading of the proxy variables); what is condense's is choosing among
//! them per host.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use http::uri::Scheme;
use http::{HeaderValue, Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper::rt::{Read, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::proxy::Tunnel;
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tower::ServiceExt;

use super::body::RequestBody;
use super::error::PoolError;
use super::settings::{ASSUMED_STREAMS, Sniffed};

/// How a host is reached.
#[derive(Clone, Debug)]
pub enum Via {
    Direct,
    /// A `CONNECT` tunnel through this proxy (an https host).
    Tunnel {
        proxy: Uri,
        auth: Option<HeaderValue>,
    },
    /// Requests in absolute form to this proxy (an http host).
    Forward {
        proxy: Uri,
        auth: Option<HeaderValue>,
    },
}

impl Via {
    /// `Proxy-Authorization` for requests sent in absolute form.
    pub fn forward_auth(&self) -> Option<&HeaderValue> {
        match self {
            Via::Forward { auth, .. } => auth.as_ref(),
            _ => None,
        }
    }

    pub fn is_forward(&self) -> bool {
        matches!(self, Via::Forward { .. })
    }
}

/// A new connection's request side.
pub enum Opened {
    H1(http1::SendRequest<RequestBody>),
    /// With the number of streams the server allows at once, kept current.
    H2(http2::SendRequest<RequestBody>, Arc<AtomicUsize>),
}

/// Opens connections within the connect timeout.
#[derive(Clone)]
pub struct Connector {
    https: HttpsConnector<HttpConnector>,
    /// HTTP/1.1 only: to proxies (TLS to an https proxy offers no h2),
    /// and for upgrades to a WebSocket.
    http1_only: HttpsConnector<HttpConnector>,
    tls: rustls::ClientConfig,
    proxies: Arc<Matcher>,
    limit: Duration,
}

impl Connector {
    /// A connector trusting `tls`'s roots, taking proxies from the
    /// environment.
    pub fn new(tls: rustls::ClientConfig, limit: Duration) -> Connector {
        Connector::with_proxies(tls, limit, Matcher::from_env())
    }

    pub fn with_proxies(tls: rustls::ClientConfig, limit: Duration, proxies: Matcher) -> Connector {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        // TCP keepalive and a user timeout: a long silent answer stays open
        // through NATs and load balancers with an idle cutoff, and a peer
        // that vanished is noticed in about a minute.
        http.set_keepalive(Some(Duration::from_secs(15)));
        http.set_keepalive_interval(Some(Duration::from_secs(15)));
        http.set_keepalive_retries(Some(3));
        #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
        http.set_tcp_user_timeout(Some(Duration::from_secs(30)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http.clone());
        let http1_only = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Connector {
            https,
            http1_only,
            tls,
            proxies: Arc::new(proxies),
            limit,
        }
    }

    /// The connect timeout.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// How `dst` (scheme and authority) is reached.
    pub fn via(&self, dst: &Uri) -> Via {
        let Some(proxy) = self.proxies.intercept(dst) else {
            return Via::Direct;
        };
        let (proxy, auth) = (proxy.uri().clone(), proxy.basic_auth().cloned());
        if dst.scheme() == Some(&Scheme::HTTPS) {
            Via::Tunnel { proxy, auth }
        } else {
            Via::Forward { proxy, auth }
        }
    }

    /// A connection to `dst` (scheme and authority) by `via`, handshake
    /// done; past the connect timeout the error is an
    /// `io::ErrorKind::TimedOut`.
    pub async fn connect(&self, dst: Uri, via: &Via) -> Result<Opened, PoolError> {
        let connecting = async {
            match via {
                Via::Direct => {
                    let io = self.https.clone().oneshot(dst).await;
                    handshake(io.map_err(PoolError::Connect)?).await
                }
                Via::Forward { proxy, .. } => {
                    let io = self.http1_only.clone().oneshot(proxy.clone()).await;
                    handshake(io.map_err(PoolError::Connect)?).await
                }
                Via::Tunnel { proxy, auth } => {
                    let io = hyper_rustls::HttpsConnectorBuilder::new()
                        .with_tls_config(self.tls.clone())
                        .https_only()
                        .enable_all_versions()
                        .wrap_connector(self.tunnel(proxy, auth.as_ref()))
                        .oneshot(dst)
                        .await;
                    handshake(io.map_err(PoolError::Connect)?).await
                }
            }
        };
        within(self.limit, connecting).await
    }

    /// A `CONNECT` tunnel through `proxy`.
    fn tunnel(
        &self,
        proxy: &Uri,
        auth: Option<&HeaderValue>,
    ) -> Tunnel<HttpsConnector<HttpConnector>> {
        let tunnel = Tunnel::new(proxy.clone(), self.http1_only.clone());
        match auth {
            Some(auth) => tunnel.with_auth(auth.clone()),
            None => tunnel,
        }
    }

    /// Sends `req`, an upgrade, on a new HTTP/1.1 connection to `dst` by
    /// `via` (a proxy's `CONNECT` tunnel for a proxied host, whatever its
    /// scheme), within the connect timeout; the answer, which
    /// `hyper::upgrade::on` turns into the upgraded connection on a 101.
    pub async fn upgrade(
        &self,
        dst: Uri,
        via: &Via,
        req: Request<RequestBody>,
    ) -> Result<Response<Incoming>, PoolError> {
        let upgrading = async {
            match via {
                Via::Direct => {
                    let io = self.http1_only.clone().oneshot(dst).await;
                    send_upgrade(io.map_err(PoolError::Connect)?, req).await
                }
                Via::Tunnel { proxy, auth } | Via::Forward { proxy, auth } => {
                    let io = hyper_rustls::HttpsConnectorBuilder::new()
                        .with_tls_config(self.tls.clone())
                        .https_or_http()
                        .enable_http1()
                        .wrap_connector(self.tunnel(proxy, auth.as_ref()))
                        .oneshot(dst)
                        .await;
                    send_upgrade(io.map_err(PoolError::Connect)?, req).await
                }
            }
        };
        within(self.limit, upgrading).await
    }
}

/// `connecting`, or a `TimedOut` error after `limit`.
async fn within<T>(
    limit: Duration,
    connecting: impl Future<Output = Result<T, PoolError>>,
) -> Result<T, PoolError> {
    match tokio::time::timeout(limit, connecting).await {
        Ok(done) => done,
        Err(_) => Err(PoolError::Connect(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("connecting took longer than {limit:?}"),
        )))),
    }
}

/// An upgrade request on a new HTTP/1.1 connection, which stays to be
/// upgraded.
async fn send_upgrade<T>(io: T, req: Request<RequestBody>) -> Result<Response<Incoming>, PoolError>
where
    T: Read + Write + Unpin + Send + 'static,
{
    let (mut tx, conn) = boxed(http1::Builder::new().handshake(io))
        .await
        .map_err(PoolError::Handshake)?;
    run(conn.with_upgrades(), None);
    boxed(async move { tx.send_request(req).await })
        .await
        .map_err(PoolError::Handshake)
}

/// The HTTP handshake on a connection: HTTP/2 where TLS negotiated it.
async fn handshake<T>(io: MaybeHttpsStream<T>) -> Result<Opened, PoolError>
where
    T: Read + Write + Connection + Unpin + Send + 'static,
{
    let h2 = io.connected().is_negotiated_h2();
    match io {
        MaybeHttpsStream::Https(tls) if h2 => {
            let streams = Arc::new(AtomicUsize::new(ASSUMED_STREAMS));
            let io = TokioIo::new(Sniffed::new(tls.into_inner(), streams.clone()));
            let (mut tx, conn) = boxed(http2::Builder::new(TokioExecutor::new()).handshake(io))
                .await
                .map_err(PoolError::Handshake)?;
            run(conn, None);
            tx.ready().await.map_err(PoolError::Handshake)?;
            Ok(Opened::H2(tx, streams))
        }
        io => {
            let (mut tx, conn) = boxed(http1::Builder::new().handshake(io))
                .await
                .map_err(PoolError::Handshake)?;
            let (failed, why) = tokio::sync::oneshot::channel();
            run(conn, Some(failed));
            if let Err(e) = tx.ready().await {
                // The connection's own error says more than "closed".
                return Err(PoolError::Handshake(why.await.unwrap_or(e)));
            }
            Ok(Opened::H1(tx))
        }
    }
}

/// Runs a connection's task on this thread's runtime; its error, if it
/// ends with one, goes to `failed`.
fn run<C>(conn: C, failed: Option<tokio::sync::oneshot::Sender<hyper::Error>>)
where
    C: std::future::Future<Output = Result<(), hyper::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "an upstream connection ended with an error");
            if let Some(failed) = failed {
                let _ = failed.send(e);
            }
        }
    });
}

/// One of hyper's futures, boxed. Awaited in an `async fn` as it is, the
/// compiler cannot prove that `async fn`'s future `Send`: it would need
/// hyper's future `Send` for every lifetime the request body's error type
/// could have (rust-lang/rust#64552). Here, with the type known, it can.
fn boxed<T>(
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>> {
    Box::pin(f)
}
