//! The HTTP server: shared state, startup and graceful shutdown. What each
//! request goes through (request ids, logs, client keys, routes) is in
//! `front.rs`, connections (the cap, idle deadlines) in `connections.rs`,
//! the threads that serve them in `workers.rs`.

pub mod connections;
pub mod front;
mod refused;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::metrics::{Metrics, MetricsError};
use crate::proxy::Proxy;
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

/// Time the streams ended at the close of the shutdown grace get to reach
/// their clients before the remaining connections are cut.
const STREAMS_END: Duration = Duration::from_secs(1);

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
            config.server.max_inflight_requests,
            Duration::from_secs_f64(config.server.idle_timeout_seconds),
        );
        tracing::info!(
            max_connections = limits.max_connections,
            max_inflight_requests = limits.max_inflight,
            "client connection and request caps"
        );
        if limits.max_inflight < config.server.max_inflight_requests {
            tracing::warn!(
                max_inflight_requests = limits.max_inflight,
                configured = config.server.max_inflight_requests,
                "the open-file limit allows fewer requests in flight than server.max_inflight_requests; raise it (ulimit -n) to serve more"
            );
        }
        if limits.max_connections < config.server.max_connections {
            tracing::warn!(
                max_connections = limits.max_connections,
                configured = config.server.max_connections,
                "the open-file limit allows fewer client connections than server.max_connections; raise it (ulimit -n) to serve more"
            );
        }
        // A WebSocket holds a descriptor as a connection does (and one more
        // upstream while it answers): it shares the connections' room.
        let max_websockets = state.proxy.sockets.lower_to(limits.max_connections);
        if max_websockets < config.server.max_websockets {
            tracing::warn!(
                max_websockets,
                configured = config.server.max_websockets,
                "the open-file limit allows fewer WebSockets than server.max_websockets; raise it (ulimit -n) to serve more"
            );
        }
        let (stop, stopped) = watch::channel(false);
        let flag = state.shutting_down.clone();
        let mut on_stop = stopped.clone();
        tokio::spawn(async move {
            let _ = on_stop.wait_for(|s| *s).await;
            flag.store(true, Ordering::Relaxed);
        });
        let app = Arc::new(state.clone());
        let metrics = state.metrics.clone();
        let workers = workers::Workers::per_core()?;
        let task = tokio::spawn(async move {
            connections::serve(listener, app, limits, metrics, stopped, workers).await;
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
                tracing::warn!(grace = ?self.grace, "shutdown grace period over; ending open streams and closing remaining connections");
                // Streams end as the API ends a failed one (an error event,
                // then the body's end), and get a moment to be written.
                self.state.proxy.end_streams();
                if tokio::time::timeout(STREAMS_END, &mut task).await.is_err() {
                    task.abort();
                }
                Ok(())
            }
        }
    }

    /// Serves until `signal` resolves (see [`shutdown_signal`]), then shuts
    /// down gracefully.
    pub async fn run_until(self, signal: impl Future<Output = ()>) -> Result<(), ServerError> {
        signal.await;
        tracing::info!("shutdown signal received; draining");
        self.shutdown().await
    }
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is
/// called, not when the future is first polled: a signal that comes in
/// between (right after "listening" is logged) is not lost, and does not
/// kill the process with the default action.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{Signal, SignalKind, signal};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        let wait = |s: Option<Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        async move {
            tokio::select! {
                () = wait(term) => {},
                () = wait(int) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
