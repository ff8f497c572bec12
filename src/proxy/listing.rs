//! Learning context windows from the upstream's `/models` listing.
//!
//! vLLM reports `max_model_len`, OpenRouter `context_length`, and so on (see
//! `tokens::models`). condense asks once, on the first chat request, and
//! again at most every ten minutes while a requested model is missing from
//! what it learned. Requests that arrive during a fetch wait for it (at most
//! a few seconds), so the first large request is already measured against the
//! real window. A failed fetch changes nothing: profiles and the default
//! window still apply.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, Method, header};
use tokio::sync::Mutex;

use crate::tokens::models::Listings;
use crate::upstream::{Outgoing, Upstream};

const REFRESH: Duration = Duration::from_secs(600);
const TIMEOUT: Duration = Duration::from_secs(3);
const MAX_BYTES: usize = 8 * 1024 * 1024;

pub struct ListingFetcher {
    last_attempt: Mutex<Option<Instant>>,
    /// Seconds since `started` of the last attempt (0: none yet), read
    /// without the lock so that the common case (nothing to do) costs every
    /// request one atomic load, not a turn on a shared mutex.
    attempted_at: AtomicU64,
    started: Instant,
}

impl Default for ListingFetcher {
    fn default() -> Self {
        ListingFetcher {
            last_attempt: Mutex::new(None),
            attempted_at: AtomicU64::new(0),
            started: Instant::now(),
        }
    }
}

impl ListingFetcher {
    /// Makes sure the listing was consulted for `model`; returns how long
    /// this call waited on the upstream.
    pub async fn ensure(
        &self,
        upstream: &Upstream,
        listings: &Listings,
        model: &str,
        request_headers: &HeaderMap,
    ) -> Duration {
        if listings.window(upstream.base_url(), model).is_some() {
            return Duration::ZERO;
        }
        let at = self.attempted_at.load(Ordering::Relaxed);
        if at > 0 && self.started.elapsed().as_secs().saturating_sub(at) < REFRESH.as_secs() {
            return Duration::ZERO;
        }
        let mut last = self.last_attempt.lock().await;
        if listings.window(upstream.base_url(), model).is_some()
            || last.is_some_and(|t| t.elapsed() < REFRESH)
        {
            return Duration::ZERO;
        }
        *last = Some(Instant::now());
        self.attempted_at
            .store(self.started.elapsed().as_secs().max(1), Ordering::Relaxed);
        let started = Instant::now();
        // Boxed: the fetch's future is large, and every request's future
        // would carry its room.
        match tokio::time::timeout(TIMEOUT, Box::pin(fetch(upstream, request_headers))).await {
            Ok(Some(body)) => {
                let n = listings.learn(upstream.base_url(), &body);
                tracing::info!(
                    windows = n,
                    "learned context windows from the upstream's /models listing"
                );
            }
            Ok(None) => {}
            Err(_) => tracing::debug!("the upstream's /models listing did not answer in time"),
        }
        started.elapsed()
    }
}

async fn fetch(upstream: &Upstream, request_headers: &HeaderMap) -> Option<bytes::Bytes> {
    let url = upstream.url_for("/models", None).ok()?;
    let mut headers = request_headers.clone();
    for h in [header::CONTENT_TYPE, header::CONTENT_LENGTH, header::ACCEPT] {
        headers.remove(h);
    }
    headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    let resp = upstream
        .send(Method::GET, url, headers, Outgoing::Empty)
        .await
        .ok()?;
    if !resp.status().is_success() {
        tracing::debug!(status = %resp.status(), "no /models listing from the upstream");
        return None;
    }
    super::read::read_upstream_whole(resp, MAX_BYTES).await
}
