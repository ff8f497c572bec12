//! How requests reach the upstream: on condense's own connection pools
//! ([`super::pool`], one a worker thread; HTTP/1.1, or HTTP/2 where TLS
//! negotiates it; straight or through the environment's HTTP proxy, see
//! [`super::connect`]; rustls with the Mozilla roots and any private CA,
//! see [`super::trust`]), and what is sent again when an HTTP/2 server
//! refused it unprocessed.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Uri};
use http_body_util::{BodyExt, Either, Full};

use super::body::RequestBody;
use super::body::{Outgoing, UpstreamResponse};
use super::connect::Connector;
use super::error::{BoxError, causes};
use super::pool::{IdleBound, Pool, PooledBody};
use crate::server::workers;

/// One connection pool per worker thread, and one for the other threads: a
/// pooled connection's task runs on the thread that opened it, and a
/// request on another thread would wake that one for every read and write.
#[derive(Clone)]
pub(super) struct Pools {
    pools: Arc<[Arc<Pool>]>,
    /// What they open connections with (also for upgrades, which are not
    /// pooled).
    pub(super) connector: Connector,
}

impl Pools {
    /// Sends a request; the response comes back when its headers have.
    pub(super) async fn send(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Outgoing,
    ) -> Result<UpstreamResponse, BoxError> {
        let pool = &self.pools[workers::slot() % self.pools.len()];
        let whole = match body {
            Outgoing::Empty => Bytes::new(),
            Outgoing::Whole(b) => b,
            Outgoing::Streamed(b) => {
                let req = request(method, uri, headers, Either::Right(b));
                return Ok(boxed(pool.send(req).await?));
            }
        };
        // An HTTP/2 server may refuse a request it never processed (GOAWAY
        // while it was on its way, REFUSED_STREAM): a body condense holds
        // is sent again, twice at most. Only TLS negotiates HTTP/2 here.
        if uri.scheme() != Some(&http::uri::Scheme::HTTPS) {
            let req = request(method, uri, headers, Either::Left(Full::new(whole)));
            return Ok(boxed(pool.send(req).await?));
        }
        let mut tried = 0;
        loop {
            tried += 1;
            let body = Either::Left(Full::new(whole.clone()));
            let req = request(method.clone(), uri.clone(), headers.clone(), body);
            match pool.send(req).await {
                Ok(resp) => return Ok(boxed(resp)),
                Err(e) if tried < 3 && refused_unprocessed(&*e) => {
                    tracing::debug!(error = %e, "the upstream refused the request unprocessed; sending it again");
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The connection pools over `tls`, one for each worker thread and one for
/// the other threads, keeping at most `max_idle` unused HTTP/1.1
/// connections between them.
pub(super) fn pools(
    tls: rustls::ClientConfig,
    connect_timeout: Duration,
    max_idle: usize,
) -> Pools {
    let connector = Connector::new(tls, connect_timeout);
    let bound = IdleBound::new(max_idle);
    Pools {
        pools: (0..=workers::count())
            .map(|_| Arc::new(Pool::new(connector.clone(), bound.clone())))
            .collect(),
        connector,
    }
}

fn request(
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
