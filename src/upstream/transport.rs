//! How requests reach the upstream: on condense's own connection pools
//! ([`super::pool`]: HTTP/1.1, or HTTP/2 where TLS negotiates it; rustls
//! with the Mozilla roots and any private CA, see [`super::trust`]), or,
//! when the environment names a proxy for the upstream (`HTTPS_PROXY`,
//! `HTTP_PROXY`, `ALL_PROXY`, minus `NO_PROXY`), through reqwest, which
//! speaks the proxy protocol (absolute-form requests, `CONNECT` tunnels,
//! proxy credentials from the proxy URL), trusting the same roots.
//! reqwest costs about 22 µs more CPU a request (it parses the URL three
//! times over), so it is kept off the direct path.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Uri};
use http_body_util::{BodyExt, Either, Full};
use url::Url;

use super::body::{Outgoing, UpstreamResponse};
use super::error::{BoxError, UpstreamError, causes};
use super::pool::{self, Connector, Pool, PooledBody, RequestBody};
use super::trust::Trust;
use crate::server::workers;

/// One connection pool per worker thread, and one for the other threads.
pub(super) type Pools = Arc<[Arc<Pool>]>;

/// How requests reach the upstream.
#[derive(Clone)]
pub(super) enum Transport {
    /// One pool per worker thread (and one for any other thread): a pooled
    /// connection's task runs on the thread that opened it, and a request
    /// on another thread would wake that one for every read and write.
    Direct(Pools),
    /// Through the proxy the environment names for the upstream.
    Proxied(reqwest::Client),
}

impl Transport {
    /// The transport for `base`, trusting `trust`'s roots: proxied when
    /// the environment says so.
    pub(super) fn for_base(
        base: &Uri,
        connect_timeout: Duration,
        direct: Option<&Pools>,
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
    pub(super) async fn send(
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
pub(super) fn direct_pools(tls: rustls::ClientConfig, connect_timeout: Duration) -> Pools {
    let connector = Connector::new(tls, connect_timeout);
    (0..=workers::count())
        .map(|_| Arc::new(Pool::new(connector.clone())))
        .collect()
}

/// A reqwest response as the upstream's (errors without the URL: it may
/// carry credentials, and error messages reach the client).
pub fn from_reqwest(resp: reqwest::Response) -> UpstreamResponse {
    http::Response::from(resp).map(|b| {
        b.map_err(|e| BoxError::from(e.without_url()))
            .boxed_unsync()
    })
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
