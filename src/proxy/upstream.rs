//! The upstream: one pooled HTTP client, the URL mapping, and the timeouts.
//!
//! The upstream host is fixed by configuration. A request's path and query
//! are appended to `upstream.base_url`; nothing the client sends (an
//! absolute-form URI, a `Host` header, `..` segments) can point condense at
//! another host.

use std::time::Duration;

use http::{HeaderMap, Method};
use url::Url;

use crate::config::UpstreamConfig;
use crate::error::ProxyError;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("invalid upstream.base_url: {0}")]
    BaseUrl(#[from] url::ParseError),
}

pub struct Upstream {
    client: reqwest::Client,
    /// `base_url` without a trailing slash.
    base: String,
    host: Option<String>,
    port: Option<u16>,
    first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
}

impl Upstream {
    pub fn new(config: &UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let connect_timeout = Duration::from_secs_f64(config.connect_timeout_seconds);
        let client = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            // A proxy relays redirects; it does not follow them.
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(90))
            .build()?;
        let parsed = Url::parse(&config.base_url)?;
        Ok(Upstream {
            client,
            base: config.base_url.trim_end_matches('/').to_string(),
            host: parsed.host_str().map(str::to_string),
            port: parsed.port_or_known_default(),
            first_byte_timeout: Duration::from_secs_f64(config.first_byte_timeout_seconds),
            idle_timeout: Duration::from_secs_f64(config.idle_timeout_seconds),
            connect_timeout,
        })
    }

    /// The configured base URL (also the calibration key for this upstream).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The upstream URL for a client path and query: `/v1/<rest>` and
    /// `/<rest>` both map to `<base_url>/<rest>`.
    pub fn url_for(&self, path: &str, query: Option<&str>) -> Result<Url, ProxyError> {
        let rest = match path.strip_prefix("/v1") {
            Some(r) if r.is_empty() || r.starts_with('/') => r,
            _ => path,
        };
        let mut s = String::with_capacity(self.base.len() + rest.len() + 32);
        s.push_str(&self.base);
        s.push_str(rest);
        if let Some(q) = query {
            s.push('?');
            s.push_str(q);
        }
        let url = Url::parse(&s)
            .map_err(|e| ProxyError::BadRequestBody(format!("invalid request path: {e}")))?;
        // Defence in depth: whatever the path held, the host stays ours.
        if url.host_str().map(str::to_string) != self.host
            || url.port_or_known_default() != self.port
        {
            return Err(ProxyError::BadRequestBody(
                "invalid request path".to_string(),
            ));
        }
        Ok(url)
    }

    /// Sends a request and waits for the response headers, within the
    /// first-byte timeout.
    pub async fn send(
        &self,
        method: Method,
        url: Url,
        headers: HeaderMap,
        body: Option<reqwest::Body>,
    ) -> Result<reqwest::Response, ProxyError> {
        let mut req = self.client.request(method, url).headers(headers);
        if let Some(b) = body {
            req = req.body(b);
        }
        match tokio::time::timeout(self.first_byte_timeout, req.send()).await {
            Err(_) => Err(ProxyError::UpstreamTimeout(
                self.first_byte_timeout.as_secs_f64(),
            )),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_timeout() => Err(ProxyError::UpstreamTimeout(
                self.connect_timeout.as_secs_f64(),
            )),
            Ok(Err(e)) => Err(ProxyError::UpstreamUnreachable(describe(&e))),
        }
    }
}

/// A one-line description of a client error with its causes (reqwest's own
/// Display stops at "error sending request"). URLs carry no credentials here.
fn describe(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_client_cannot_choose_the_host() {
        let u = upstream("http://127.0.0.1:9000/v1");
        for p in [
            "/v1/../../x",
            "//evil.example/v1",
            "/@evil.example",
            "/v1/..%2f..%2f",
        ] {
            if let Ok(url) = u.url_for(p, None) {
                assert_eq!(url.host_str(), Some("127.0.0.1"), "{p}");
                assert_eq!(url.port(), Some(9000), "{p}");
            }
        }
    }
}
