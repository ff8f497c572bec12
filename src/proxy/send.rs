//! Send: what goes upstream. A conversation request's headers (the
//! client's, minus hop-by-hop ones, with condense's credentials, asking for
//! an uncompressed answer the usage tap can read), made again for a retry
//! or a follow-up; and every other request, streamed to its upstream
//! unread and its answer back untouched (`passthrough`).

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Request};

use super::auth::Credentials;
use super::respond::{InflightGuard, Tap};
use super::{Proxy, ROUTE_PASSTHROUGH, Timing, headers, read};
use crate::error::ProxyError;
use crate::upstream::Outgoing;
use crate::wire::Format;

/// The headers a conversation request goes upstream with.
pub(super) fn upstream_headers(client: &HeaderMap, credentials: &Credentials) -> HeaderMap {
    let mut headers = headers::to_upstream(client, false);
    credentials.apply(&mut headers);
    // The usage tap reads the response, so ask for it uncompressed.
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    headers
}

impl Proxy {
    /// Any request condense does not handle itself: streamed to the upstream
    /// and back unchanged (apart from hop-by-hop headers and credentials).
    /// Anthropic's routes (`/v1/messages/...`, or any request with an
    /// `anthropic-version` header) go to Anthropic's API.
    pub async fn passthrough(&self, req: Request<Body>) -> Response {
        let start = Instant::now();
        let format = crate::wire::api_of(req.uri().path(), req.headers());
        self.passthrough_inner(req, format, start)
            .await
            .unwrap_or_else(|e| self.fail(ROUTE_PASSTHROUGH, format, e))
    }

    async fn passthrough_inner(
        &self,
        req: Request<Body>,
        format: Format,
        start: Instant,
    ) -> Result<Response, ProxyError> {
        let (upstream, credentials) = self.endpoint(format.api());
        let (parts, body) = req.into_parts();
        // CONNECT would make the upstream a tunnel; TRACE echoes the request
        // back, credentials condense added included.
        if matches!(parts.method, http::Method::CONNECT | http::Method::TRACE) {
            return Err(ProxyError::MethodNotAllowed(parts.method));
        }
        let url = upstream.url_for(parts.uri.path(), parts.uri.query())?;
        if read::content_length(&parts.headers).is_some_and(|n| n > self.max_body_bytes) {
            return Err(ProxyError::BodyTooLarge(self.max_body_bytes));
        }
        let mut headers = headers::to_upstream(&parts.headers, true);
        credentials.apply(&mut headers);
        let (body, upload) = if axum::body::HttpBody::size_hint(&body).exact() == Some(0) {
            (Outgoing::Empty, None)
        } else {
            let (body, upload) =
                read::streamed_request(body, self.max_body_bytes, self.body_timeout);
            (body, Some(upload))
        };
        let guard = InflightGuard::new(self.metrics.clone());
        let sent = Instant::now();
        let body_sent = async {
            if let Some(upload) = &upload {
                upload.sent().await;
            }
        };
        let resp = upstream
            .send_after(parts.method, url, headers, body, body_sent)
            .await
            .map_err(|e| match &upload {
                Some(upload) => upload.or(self.max_body_bytes, self.body_timeout, e.into()),
                None => e.into(),
            })?;
        Ok(self.respond(
            ROUTE_PASSTHROUGH,
            upstream,
            resp.into(),
            Tap::None,
            None,
            guard,
            Timing {
                start,
                sent,
                upstream_wait: Duration::ZERO,
            },
        ))
    }
}
