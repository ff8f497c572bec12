//! The HTTP server: routes, shared state, the tower stack, and graceful
//! shutdown. Connections (the cap, idle deadlines) are in `connections.rs`.

pub mod connections;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower::ServiceBuilder;
use tower::util::MapRequestLayer;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;

use crate::config::Config;
use crate::error::openai_error_body;
use crate::metrics::{Metrics, MetricsError, status_class};
use crate::proxy::{Proxy, ROUTE_CHAT, ROUTE_MESSAGES, ROUTE_PASSTHROUGH, ROUTE_RESPONSES};
use crate::tokens::Encoding;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Setup(#[from] crate::proxy::SetupError),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("server failed: {0}")]
    Io(#[from] std::io::Error),
}

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub proxy: Arc<Proxy>,
    pub metrics: Arc<Metrics>,
    pub metrics_public: bool,
    pub shutting_down: Arc<AtomicBool>,
}

impl AppState {
    pub fn new(config: &Config) -> Result<AppState, ServerError> {
        let metrics = Arc::new(Metrics::new()?);
        Ok(AppState {
            proxy: Arc::new(Proxy::new(Arc::new(config.clone()), metrics.clone())?),
            metrics,
            metrics_public: config.auth.metrics_public,
            shutting_down: Arc::new(AtomicBool::new(false)),
        })
    }
}

/// The whole service. Layers, outermost first, and what each gives the next:
///
/// 1. `CatchPanicLayer`: a panic anywhere becomes a 500 in the OpenAI error
///    shape instead of a dropped connection.
/// 2. `SetSensitiveRequestHeadersLayer`: `Authorization` and API-key headers
///    are marked sensitive, so no `Debug` print or trace can show them.
/// 3. `sane_request_id`: a client's `x-request-id` longer than
///    [`MAX_REQUEST_ID`] bytes or with characters other than letters,
///    digits and `-_.:/+=` is dropped (and replaced by ours next), so no
///    client can put 300 KB into every log line and echo.
/// 4. `SetRequestIdLayer` / `PropagateRequestIdLayer`: every request has an
///    `x-request-id` (the client's, or a new UUID) that reaches the upstream
///    and the logs; the response carries the upstream's id, else ours.
/// 5. `observe`: one access-log line and `condense_requests_total` per request.
/// 6. `authorize`: client keys, when `auth.client_keys` is set.
/// 7. The router: condense's own endpoints, the conversation routes (chat
///    completions, Anthropic Messages), and everything else forwarded as it
///    is.
pub fn app(state: AppState) -> Router {
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat).fallback(passthrough))
        .route("/chat/completions", post(chat).fallback(passthrough))
        .route("/v1/messages", post(messages).fallback(passthrough))
        .route("/messages", post(messages).fallback(passthrough))
        .route("/v1/responses", post(responses).fallback(passthrough))
        .route("/responses", post(responses).fallback(passthrough))
        .fallback(passthrough)
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state);
    router.layer(
        ServiceBuilder::new()
            .layer(CatchPanicLayer::custom(panic_response))
            .layer(SetSensitiveRequestHeadersLayer::new([
                header::AUTHORIZATION,
                header::PROXY_AUTHORIZATION,
                header::HeaderName::from_static("api-key"),
                header::HeaderName::from_static("x-api-key"),
            ]))
            .layer(MapRequestLayer::new(sane_request_id))
            .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
            .layer(PropagateRequestIdLayer::x_request_id()),
    )
}

/// Longest client `x-request-id` kept.
pub const MAX_REQUEST_ID: usize = 128;

/// Keeps a client's `x-request-id` only when it is one sane value. Every
/// value is judged: the id layers and the logs read the first, but all of
/// them would be forwarded, so a sane first one must not carry a 300 KB
/// second one upstream.
fn sane_request_id(mut req: Request) -> Request {
    let values = req.headers().get_all("x-request-id");
    let ok = values.iter().count() <= 1
        && values.iter().all(|v| {
            v.len() <= MAX_REQUEST_ID
                && v.as_bytes()
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:/+=".contains(b))
        });
    if !ok {
        req.headers_mut().remove("x-request-id");
    }
    req
}

async fn chat(State(s): State<AppState>, req: Request) -> Response {
    s.proxy.clone().chat(req).await
}

async fn messages(State(s): State<AppState>, req: Request) -> Response {
    s.proxy.clone().messages(req).await
}

async fn responses(State(s): State<AppState>, req: Request) -> Response {
    s.proxy.clone().responses(req).await
}

async fn passthrough(State(s): State<AppState>, req: Request) -> Response {
    s.proxy.passthrough(req).await
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(s): State<AppState>) -> Response {
    if s.shutting_down.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
    } else {
        "ready".into_response()
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    let mut resp = s.metrics.render().into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// The route label of a request, for metrics and logs.
fn route_of(req: &Request) -> &'static str {
    match req.uri().path() {
        "/healthz" => "healthz",
        "/readyz" => "readyz",
        "/metrics" => "metrics",
        "/v1/chat/completions" | "/chat/completions" if req.method() == http::Method::POST => {
            ROUTE_CHAT
        }
        "/v1/messages" | "/messages" if req.method() == http::Method::POST => ROUTE_MESSAGES,
        "/v1/responses" | "/responses" if req.method() == http::Method::POST => ROUTE_RESPONSES,
        _ => ROUTE_PASSTHROUGH,
    }
}

async fn authorize(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let open = match req.uri().path() {
        "/healthz" | "/readyz" => true,
        "/metrics" => s.metrics_public,
        _ => false,
    };
    if !open && let Err(e) = s.proxy.credentials.check(req.headers()) {
        s.metrics
            .proxy_errors_total
            .with_label_values(&[e.metric_label()])
            .inc();
        let format = if crate::wire::is_anthropic(req.uri().path(), req.headers()) {
            crate::wire::Format::Messages
        } else {
            crate::wire::Format::Chat
        };
        return e.response_for(format);
    }
    next.run(req).await
}

async fn observe(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route = route_of(&req);
    // What the request's log line says of it, taken only when it is logged.
    let logged = matches!(
        route,
        ROUTE_CHAT | ROUTE_MESSAGES | ROUTE_RESPONSES | ROUTE_PASSTHROUGH
    ) && tracing::enabled!(tracing::Level::INFO);
    let line = logged.then(|| {
        let request_id = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        (
            req.method().clone(),
            crate::logging::clip(req.uri().path()).to_string(),
            request_id.to_string(),
        )
    });
    let start = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    s.metrics
        .requests_total
        .with_label_values(&[route, status_class(status)])
        .inc();
    if let Some((method, path, request_id)) = line {
        let headers_ms = start.elapsed().as_secs_f64() * 1000.0;
        // Written once the response is on its way: formatting and writing
        // the line takes about 10 µs, which the client need not wait for.
        tokio::spawn(async move {
            tracing::info!(%method, path, status, request_id, headers_ms, "request");
        });
    }
    resp
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response<Body> {
    tracing::error!("a request handler panicked");
    let mut resp = (
        StatusCode::INTERNAL_SERVER_ERROR,
        openai_error_body("condense: internal error", "api_error", "internal_error"),
    )
        .into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    state: AppState,
    stop: watch::Sender<bool>,
    task: JoinHandle<std::io::Result<()>>,
    grace: Duration,
}

impl Server {
    /// Binds `server.listen` (port 0 picks a free port) and starts serving.
    pub async fn start(config: &Config) -> Result<Server, ServerError> {
        // Build the tokenizers now, not on the first request.
        tokio::task::spawn_blocking(Encoding::warm_up)
            .await
            .map_err(std::io::Error::other)?;
        let state = AppState::new(config)?;
        let listener = TcpListener::bind(config.server.listen)
            .await
            .map_err(|source| ServerError::Bind {
                addr: config.server.listen,
                source,
            })?;
        let addr = listener.local_addr()?;
        for (key, set) in [
            ("upstream.api_key", config.upstream.api_key.is_some()),
            (
                "upstream.anthropic_api_key",
                config.upstream.anthropic_api_key.is_some(),
            ),
        ] {
            if set && config.auth.client_keys.is_empty() && !addr.ip().is_loopback() {
                tracing::warn!(
                    listen = %addr,
                    key,
                    "an operator key is set and auth.client_keys is empty on an address other hosts can reach: anyone who reaches condense spends that key; set auth.client_keys"
                );
            }
        }
        let limits = connections::Limits::new(
            config.server.max_connections,
            Duration::from_secs_f64(config.server.idle_timeout_seconds),
        );
        tracing::info!(
            max_connections = limits.max_connections,
            "client connection cap"
        );
        if limits.max_connections < config.server.max_connections {
            tracing::warn!(
                max_connections = limits.max_connections,
                configured = config.server.max_connections,
                "the open-file limit allows fewer client connections than server.max_connections; raise it (ulimit -n) to serve more"
            );
        }
        let (stop, stopped) = watch::channel(false);
        let flag = state.shutting_down.clone();
        let mut on_stop = stopped.clone();
        tokio::spawn(async move {
            let _ = on_stop.wait_for(|s| *s).await;
            flag.store(true, Ordering::Relaxed);
        });
        let router = app(state.clone());
        let metrics = state.metrics.clone();
        let workers = workers::Workers::per_core()?;
        let task = tokio::spawn(async move {
            connections::serve(listener, router, limits, metrics, stopped, workers).await;
            Ok(())
        });
        Ok(Server {
            addr,
            state,
            stop,
            task,
            grace: Duration::from_secs_f64(config.server.shutdown_grace_seconds),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Stops accepting connections, closes idle ones, lets in-flight
    /// requests and streams finish within the grace period, then returns
    /// (cutting off whatever is still running).
    pub async fn shutdown(self) -> Result<(), ServerError> {
        let _ = self.stop.send(true);
        let mut task = self.task;
        match tokio::time::timeout(self.grace, &mut task).await {
            Ok(Ok(result)) => Ok(result?),
            Ok(Err(join)) => Err(ServerError::Io(std::io::Error::other(join))),
            Err(_) => {
                tracing::warn!(grace = ?self.grace, "shutdown grace period over; closing remaining connections");
                task.abort();
                Ok(())
            }
        }
    }

    /// Serves until SIGTERM or SIGINT, then shuts down gracefully.
    pub async fn run_until_signal(self) -> Result<(), ServerError> {
        shutdown_signal().await;
        tracing::info!("shutdown signal received; draining");
        self.shutdown().await
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_ids(ids: &[&str]) -> Request {
        let mut req = Request::new(Body::empty());
        for id in ids {
            req.headers_mut()
                .append("x-request-id", HeaderValue::from_str(id).unwrap());
        }
        req
    }

    fn kept(ids: &[&str]) -> Vec<String> {
        sane_request_id(with_ids(ids))
            .headers()
            .get_all("x-request-id")
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn only_one_sane_request_id_is_kept() {
        assert_eq!(kept(&["trace-1:a/b+c="]), vec!["trace-1:a/b+c="]);
        assert!(kept(&["has space"]).is_empty());
        let long = "a".repeat(MAX_REQUEST_ID + 1);
        assert!(kept(&[&long]).is_empty());
        // A sane first value does not carry a bad second one along.
        assert!(kept(&["sane-1", &long]).is_empty());
        assert!(kept(&[&long, "sane-1"]).is_empty());
        assert!(kept(&["sane-1", "sane-2"]).is_empty());
        assert!(kept(&[]).is_empty());
    }
}
