//! Where a request goes. The upstream host is fixed by configuration: a
//! request's path and query are appended to `upstream.base_url`; nothing
//! the client sends (an absolute-form URI, a `Host` header, `..` segments,
//! plain or percent-encoded) can point condense at another host or at a
//! path outside `base_url`'s: with a base of `https://gw/tenant-a/v1`, no
//! client reaches `/tenant-b/...` with the upstream key condense adds.
//!
//! Credentials in the base URL (`https://user:pass@gw/v1`) go as an
//! `Authorization: Basic` header, never in the URL.

use http::{HeaderMap, HeaderValue, Uri};
use url::Url;

use super::error::{InvalidPath, UpstreamError};
use crate::cache::Bounded;

/// `upstream.base_url`, parsed once, and the client paths mapped under it.
pub(super) struct BaseUrl {
    /// `base_url` without a trailing slash.
    base: String,
    /// The path of `base_url` without a trailing slash (`/v1`, or empty).
    base_path: String,
    host: Option<String>,
    port: Option<u16>,
    /// `Authorization: Basic` from a `user:pass@` in `base_url`, sent when
    /// a request carries no `Authorization` of its own (as reqwest did).
    basic: Option<HeaderValue>,
    /// URIs of paths (without a query) mapped lately: every request to a
    /// route would otherwise check and parse the same URL again.
    mapped: Bounded<String, Uri>,
}

/// Longest path whose URL is remembered.
const MAPPED_PATH_BYTES: usize = 256;

fn mapped_cache() -> Bounded<String, Uri> {
    Bounded::new(1024, 1 << 20, |path, uri| {
        let tail = uri.path_and_query().map_or(0, |p| p.as_str().len());
        (path.len() + tail + 64) as u64
    })
}

impl BaseUrl {
    pub(super) fn new(base_url: &str) -> Result<BaseUrl, UpstreamError> {
        let parsed = Url::parse(base_url)?;
        // Every URL made from it must be a URI too.
        parsed.as_str().parse::<Uri>()?;
        Ok(BaseUrl {
            base: base_url.trim_end_matches('/').to_string(),
            base_path: parsed.path().trim_end_matches('/').to_string(),
            host: parsed.host_str().map(str::to_string),
            port: parsed.port_or_known_default(),
            basic: basic_auth(&parsed),
            mapped: mapped_cache(),
        })
    }

    /// The configured base URL, without a trailing slash.
    pub(super) fn as_str(&self) -> &str {
        &self.base
    }

    /// Adds the base URL's credentials to `headers` as `Authorization:
    /// Basic`, unless they carry an `Authorization` of their own.
    pub(super) fn authorize(&self, headers: &mut HeaderMap) {
        if let Some(basic) = &self.basic
            && !headers.contains_key(http::header::AUTHORIZATION)
        {
            headers.insert(http::header::AUTHORIZATION, basic.clone());
        }
    }

    /// The upstream URL for a client path and query: `/v1/<rest>` and
    /// `/<rest>` both map to `<base_url>/<rest>`.
    pub(super) fn url_for(&self, path: &str, query: Option<&str>) -> Result<Uri, InvalidPath> {
        if query.is_some() || path.len() > MAPPED_PATH_BYTES {
            return self.map_url(path, query);
        }
        if let Some(uri) = self.mapped.get(path) {
            return Ok(uri);
        }
        let uri = self.map_url(path, None)?;
        self.mapped.insert(path.to_string(), uri.clone());
        Ok(uri)
    }

    fn map_url(&self, path: &str, query: Option<&str>) -> Result<Uri, InvalidPath> {
        let rest = match path.strip_prefix("/v1") {
            Some(r) if r.is_empty() || r.starts_with('/') => r,
            _ => path,
        };
        // A dot segment or a backslash, as sent or decoded, is refused:
        // `Url` resolves the plain ones, but an upstream may decode `%2e%2e`
        // or `..%2f` itself (twice, behind another proxy: `%252e`) and walk
        // out of the base path, and Tomcat, Jetty and Spring read `..;x`
        // (a segment with parameters) as `..`.
        let decoded =
            decoded_fully(rest).ok_or(InvalidPath("is percent-encoded too many times"))?;
        let dot = |seg: &str| matches!(seg.split(';').next(), Some("." | ".."));
        if decoded.contains('\\') || decoded.split('/').any(dot) {
            return Err(InvalidPath("may not contain dot segments"));
        }
        let mut s = String::with_capacity(self.base.len() + rest.len() + 32);
        s.push_str(&self.base);
        s.push_str(rest);
        if let Some(q) = query {
            s.push('?');
            s.push_str(q);
        }
        let mut url = Url::parse(&s).map_err(|_| InvalidPath("is not a valid URL path"))?;
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
            return Err(InvalidPath("leaves the upstream's base path"));
        }
        // Credentials in the base go as a header (see `basic`): HTTP/1.1
        // would drop them, and HTTP/2 would send them in `:authority`.
        let _ = url.set_username("");
        let _ = url.set_password(None);
        // `Url` escapes what `Uri` refuses, as reqwest relies on too.
        url.as_str()
            .parse()
            .map_err(|_| InvalidPath("is not a valid URL path"))
    }
}

/// `Authorization: Basic` for the credentials in `url`, if it has any.
fn basic_auth(url: &Url) -> Option<HeaderValue> {
    use base64::Engine;
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let user = percent_decode(url.username());
    let password = percent_decode(url.password().unwrap_or(""));
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
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
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base_url(base: &str) -> BaseUrl {
        BaseUrl::new(base).unwrap()
    }

    #[test]
    fn paths_map_onto_the_base_url() {
        let u = base_url("http://127.0.0.1:9000/v1/");
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
        let u = base_url("http://127.0.0.1:9000/tenant-a/v1");
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
            assert!(matches!(e, InvalidPath(_)), "{p}: {e}");
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
            let u = base_url(base);
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
        let u = base_url("http://127.0.0.1:9000/v1");
        for p in [
            "/v1/../../x",
            "//evil.example/v1",
            "/@evil.example",
            "/v1/..%2f..%2f",
        ] {
            if let Ok(uri) = u.url_for(p, None) {
                assert_eq!(uri.host(), Some("127.0.0.1"), "{p}");
                assert_eq!(uri.port_u16(), Some(9000), "{p}");
            }
        }
    }
}
