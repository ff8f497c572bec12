//! The upstream: one pooled HTTP client, the URL mapping, and the timeouts.
//!
//! The upstream host is fixed by configuration. A request's path and query
//! are appended to `upstream.base_url`; nothing the client sends (an
//! absolute-form URI, a `Host` header, `..` segments, plain or
//! percent-encoded) can point condense at another host or at a path outside
//! `base_url`'s: with a base of `https://gw/tenant-a/v1`, no client reaches
//! `/tenant-b/...` with the upstream key condense adds.

use std::time::Duration;

use http::{HeaderMap, Method};
use url::Url;

use crate::cache::Bounded;
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
    /// Set for `condense replay`: requests are answered in process.
    simulator: Option<std::sync::Arc<crate::simulate::Simulator>>,
    /// `base_url` without a trailing slash.
    base: String,
    /// The path of `base_url` without a trailing slash (`/v1`, or empty).
    base_path: String,
    host: Option<String>,
    port: Option<u16>,
    first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
    /// URLs of paths (without a query) mapped lately: every request to a
    /// route would otherwise check and parse the same URL again.
    mapped: Bounded<String, Url>,
}

/// Longest path whose URL is remembered.
const MAPPED_PATH_BYTES: usize = 256;

fn mapped_cache() -> Bounded<String, Url> {
    Bounded::new(1024, 1 << 20, |path, url| {
        (path.len() + url.as_str().len() + 64) as u64
    })
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
            simulator: None,
            base: config.base_url.trim_end_matches('/').to_string(),
            base_path: parsed.path().trim_end_matches('/').to_string(),
            host: parsed.host_str().map(str::to_string),
            port: parsed.port_or_known_default(),
            first_byte_timeout: Duration::from_secs_f64(config.first_byte_timeout_seconds),
            idle_timeout: Duration::from_secs_f64(config.idle_timeout_seconds),
            connect_timeout,
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
        let parsed = Url::parse(base_url)?;
        Ok(Upstream {
            client: self.client.clone(),
            simulator: self.simulator.clone(),
            base: base_url.trim_end_matches('/').to_string(),
            base_path: parsed.path().trim_end_matches('/').to_string(),
            host: parsed.host_str().map(str::to_string),
            port: parsed.port_or_known_default(),
            first_byte_timeout: self.first_byte_timeout,
            idle_timeout: self.idle_timeout,
            connect_timeout: self.connect_timeout,
            mapped: mapped_cache(),
        })
    }

    /// The configured base URL (also the calibration key for this upstream).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The upstream URL for a client path and query: `/v1/<rest>` and
    /// `/<rest>` both map to `<base_url>/<rest>`.
    pub fn url_for(&self, path: &str, query: Option<&str>) -> Result<Url, ProxyError> {
        if query.is_some() || path.len() > MAPPED_PATH_BYTES {
            return self.map_url(path, query);
        }
        if let Some(url) = self.mapped.get(path) {
            return Ok(url);
        }
        let url = self.map_url(path, None)?;
        self.mapped.insert(path.to_string(), url.clone());
        Ok(url)
    }

    fn map_url(&self, path: &str, query: Option<&str>) -> Result<Url, ProxyError> {
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
        let url = Url::parse(&s).map_err(|_| ProxyError::InvalidPath("is not a valid URL path"))?;
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
        if let Some(sim) = &self.simulator {
            let bytes = body
                .as_ref()
                .and_then(reqwest::Body::as_bytes)
                .map(bytes::Bytes::copy_from_slice)
                .unwrap_or_default();
            return Ok(reqwest::Response::from(sim.respond(
                &method,
                url.path(),
                &bytes,
            )));
        }
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
            // Without the URL: it may carry credentials, and the message
            // reaches the client.
            Ok(Err(e)) => Err(ProxyError::UpstreamUnreachable(describe(&e.without_url()))),
        }
    }
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
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A one-line description of a client error with its causes (reqwest's own
/// Display stops at "error sending request").
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
