//! What every request goes through, in order, written out as one function
//! ([`handle`]) instead of a stack of tower layers and axum's router: the
//! stack cost about 13 µs of latency and 18 µs of CPU per request (its own
//! futures, boxes and clones at each layer, a UUID from a system call),
//! which is most of what condense adds to a small request.
//!
//! In order, and what each step gives the next:
//!
//! 1. A panic anywhere becomes a 500 in the OpenAI error shape instead of a
//!    dropped connection.
//! 2. `Authorization`, `Proxy-Authorization`, `api-key` and `x-api-key` are
//!    marked sensitive, so no `Debug` print or trace can show them.
//! 3. A client's `x-request-id` longer than [`MAX_REQUEST_ID`] bytes or with
//!    characters other than letters, digits and `-_.:/+=` is dropped; a
//!    request without a sane one gets a new UUID. The id reaches the
//!    upstream and the logs, and the response carries the upstream's id,
//!    else this one.
//! 4. One access-log line and `condense_requests_total` per request.
//! 5. Client keys are checked, when `auth.client_keys` is set.
//! 6. Over `server.max_inflight_requests` (counted by the connections, over
//!    all of them), a request gets its API's overload error; condense's
//!    own endpoints are always answered, `/readyz` with `saturated`.
//! 7. The route: condense's own endpoints, the conversation routes (chat
//!    completions, Anthropic Messages, Responses; `POST` only), and
//!    everything else forwarded as it is.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;

use super::AppState;
use crate::error::ProxyError;
use crate::logging::AccessLine;
use crate::metrics::status_class;
use crate::proxy::ROUTE_PASSTHROUGH;
use crate::wire::Format;

/// Longest client `x-request-id` kept.
pub const MAX_REQUEST_ID: usize = 128;

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Headers whose values no log or `Debug` print may show.
const SENSITIVE: [HeaderName; 4] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-api-key"),
];

/// Serves one request, whatever it is; `saturated` when the requests in
/// flight, this one included, are over the cap.
pub async fn handle(app: Arc<AppState>, req: Request, saturated: bool) -> Response {
    guarded(serve(app, req, saturated)).await
}

/// `serve`'s response, or a 500 if it panics.
async fn guarded(serve: impl Future<Output = Response>) -> Response {
    AssertUnwindSafe(serve)
        .catch_unwind()
        .await
        .unwrap_or_else(|_| panic_response())
}

async fn serve(app: Arc<AppState>, mut req: Request, saturated: bool) -> Response {
    let headers = req.headers_mut();
    mark_sensitive(headers);
    let request_id = request_id(headers);
    let route = route_of(&req);
    // What the request's log line says of it, taken only when it is logged.
    let logged = !own_endpoint(route) && AccessLine::enabled();
    let line = logged.then(|| {
        (
            req.method().clone(),
            crate::logging::clip(req.uri().path()).to_string(),
        )
    });
    let head = req.method() == Method::HEAD;
    let start = Instant::now();
    let mut resp = match denied(&app, route, &req) {
        Some(refusal) => refusal,
        None if saturated && !own_endpoint(route) => overloaded(&app, &req),
        None => dispatch(&app, route, req, saturated).await,
    };
    let status = resp.status().as_u16();
    app.metrics
        .requests_total
        .with_label_values(&[route, status_class(status)])
        .inc();
    if let Some((method, path)) = line {
        let line = AccessLine {
            method,
            path,
            status,
            request_id: request_id.clone(),
            headers_ms: start.elapsed().as_secs_f64() * 1000.0,
        };
        // Formatted here, written by the log's writer thread: the client
        // does not wait for the write.
        line.log();
    }
    if !resp.headers().contains_key(&X_REQUEST_ID) {
        resp.headers_mut().insert(X_REQUEST_ID, request_id);
    }
    if head { without_body(resp) } else { resp }
}

/// The answer to a `HEAD` request: its headers, with the length its body
/// has, and no body. hyper leaves the body out over HTTP/1.1 itself, but
/// over HTTP/2 it would send it, and the client would reset the stream.
fn without_body(mut resp: Response) -> Response {
    if !resp.headers().contains_key(header::CONTENT_LENGTH)
        && let Some(n) = http_body::Body::size_hint(resp.body()).exact()
    {
        resp.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    resp.map(|_| Body::empty())
}

fn mark_sensitive(headers: &mut HeaderMap) {
    for name in SENSITIVE {
        if let header::Entry::Occupied(mut values) = headers.entry(name) {
            for value in values.iter_mut() {
                value.set_sensitive(true);
            }
        }
    }
}

/// The request's id: the client's when it sent one sane value, else a new
/// UUID, set on the request in either case. Every value is judged: only the
/// first would be logged, but all of them would be forwarded, so a sane
/// first one must not carry a 300 KB second one upstream.
fn request_id(headers: &mut HeaderMap) -> HeaderValue {
    let values = headers.get_all(&X_REQUEST_ID);
    let mut ids = values.iter();
    if let (Some(id), None) = (ids.next(), ids.next())
        && sane_request_id(id)
    {
        return id.clone();
    }
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let id = HeaderValue::from_str(crate::ids::fresh_uuid().hyphenated().encode_lower(&mut buf))
        .unwrap_or(HeaderValue::from_static("-"));
    headers.insert(X_REQUEST_ID, id.clone());
    id
}

fn sane_request_id(id: &HeaderValue) -> bool {
    id.len() <= MAX_REQUEST_ID
        && id
            .as_bytes()
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/+=".contains(b))
}

/// The route label of a request, for metrics and logs (and the dispatch).
fn route_of(req: &Request) -> &'static str {
    match req.uri().path() {
        "/healthz" => "healthz",
        "/readyz" => "readyz",
        "/metrics" => "metrics",
        path if req.method() == Method::POST => {
            Format::of_path(path).map_or(ROUTE_PASSTHROUGH, Format::route)
        }
        // A Responses WebSocket: condense serves it.
        path if Format::of_path(path) == Some(Format::Responses)
            && crate::proxy::socket::is_upgrade(req) =>
        {
            Format::Responses.route()
        }
        _ => ROUTE_PASSTHROUGH,
    }
}

/// condense's own endpoints, answered whatever the load.
fn own_endpoint(route: &str) -> bool {
    matches!(route, "healthz" | "readyz" | "metrics")
}

/// The answer to a request over the in-flight cap: its API's overload
/// error, before anything of it is read.
fn overloaded(app: &AppState, req: &Request) -> Response {
    let e = ProxyError::Overloaded("too many requests in flight");
    app.metrics
        .proxy_errors_total
        .with_label_values(&[e.metric_label()])
        .inc();
    e.response_for(crate::wire::api_of(req.uri().path(), req.headers()))
}

/// The refusal of a request without a client key, when `auth.client_keys`
/// is set: the health endpoints are open, `/metrics` when
/// `auth.metrics_public` says so.
fn denied(app: &AppState, route: &str, req: &Request) -> Option<Response> {
    let open = match route {
        "healthz" | "readyz" => true,
        "metrics" => app.metrics_public,
        _ => false,
    };
    if open {
        return None;
    }
    let e = app.proxy.credentials.check(req.headers()).err()?;
    app.metrics
        .proxy_errors_total
        .with_label_values(&[e.metric_label()])
        .inc();
    Some(e.response_for(crate::wire::api_of(req.uri().path(), req.headers())))
}

/// The conversation routes' futures are several kilobytes each: they are
/// boxed here, so that this function's own future (moved into a box per
/// request by the connection) stays small.
async fn dispatch(app: &AppState, route: &'static str, req: Request, saturated: bool) -> Response {
    if let Some(format) = Format::of_route(route) {
        if req.method() == Method::GET {
            return Box::pin(app.proxy.clone().socket(req)).await;
        }
        return Box::pin(app.proxy.clone().conversation(format, req)).await;
    }
    match route {
        ROUTE_PASSTHROUGH => Box::pin(app.proxy.passthrough(req)).await,
        _ if !matches!(*req.method(), Method::GET | Method::HEAD) => {
            let mut resp = ProxyError::MethodNotAllowed(req.method().clone()).into_response();
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            resp
        }
        "healthz" => "ok".into_response(),
        "readyz" if app.shutting_down.load(Ordering::Relaxed) => {
            (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
        }
        // Liveness stays 200 under any load; readiness tells a balancer to
        // send its requests elsewhere for now.
        "readyz" if saturated => (StatusCode::SERVICE_UNAVAILABLE, "saturated").into_response(),
        "readyz" => "ready".into_response(),
        _ => metrics(app),
    }
}

fn metrics(app: &AppState) -> Response {
    let mut resp = app.metrics.render().into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

fn panic_response() -> Response {
    tracing::error!("a request handler panicked");
    let mut resp = (
        StatusCode::INTERNAL_SERVER_ERROR,
        crate::wire::chat::error_body("condense: internal error", "api_error", "internal_error"),
    )
        .into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(ids: &[&str]) -> Vec<String> {
        let mut headers = HeaderMap::new();
        for id in ids {
            headers.append(X_REQUEST_ID, HeaderValue::from_str(id).unwrap());
        }
        let id = request_id(&mut headers);
        let sent: Vec<String> = headers
            .get_all(X_REQUEST_ID)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect();
        assert_eq!(sent, vec![id.to_str().unwrap().to_string()]);
        sent
    }

    fn generated(ids: &[String]) -> bool {
        ids.len() == 1 && uuid::Uuid::parse_str(&ids[0]).is_ok_and(|u| u.get_version_num() == 4)
    }

    #[test]
    fn only_one_sane_request_id_is_kept_and_any_other_is_replaced_by_a_uuid() {
        assert_eq!(kept(&["trace-1:a/b+c="]), vec!["trace-1:a/b+c="]);
        assert!(generated(&kept(&["has space"])));
        let long = "a".repeat(MAX_REQUEST_ID + 1);
        assert!(generated(&kept(&[&long])));
        // A sane first value does not carry a bad second one along.
        assert!(generated(&kept(&["sane-1", &long])));
        assert!(generated(&kept(&[&long, "sane-1"])));
        assert!(generated(&kept(&["sane-1", "sane-2"])));
        assert!(generated(&kept(&[])));
        assert_ne!(kept(&[]), kept(&[]));
    }

    #[test]
    fn credentials_are_marked_sensitive_and_nothing_else() {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer a"));
        headers.append("x-api-key", HeaderValue::from_static("k1"));
        headers.append("x-api-key", HeaderValue::from_static("k2"));
        headers.insert("x-other", HeaderValue::from_static("v"));
        mark_sensitive(&mut headers);
        assert!(headers[header::AUTHORIZATION].is_sensitive());
        assert!(
            headers
                .get_all("x-api-key")
                .iter()
                .all(|v| v.is_sensitive())
        );
        assert!(!headers["x-other"].is_sensitive());
    }

    #[tokio::test]
    async fn a_panic_becomes_a_500_in_the_openai_shape() {
        let ok = guarded(async { "fine".into_response() }).await;
        assert_eq!(ok.status(), 200);
        let resp = guarded(async {
            let v: Vec<u8> = Vec::new();
            Response::new(Body::from(vec![v[1]]))
        })
        .await;
        assert_eq!(resp.status(), 500);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "internal_error");
    }
}
