//! Which headers cross the proxy, in both directions.
//!
//! Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the
//! message, so they are dropped at each side, together with any header the
//! `Connection` header names. `Host` is set by the HTTP client for the
//! upstream. Everything else passes unchanged.

use http::header::{self, HeaderMap, HeaderName};

const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The per-request opt-out header; it is condense's own and not forwarded.
pub const X_CONDENSE: HeaderName = HeaderName::from_static("x-condense");

/// Removes hop-by-hop headers, including those listed in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none (a `Connection` header is one of them):
    // looked for first, as every removal hashes its name.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// The headers to send upstream for a client's request headers.
/// `keep_length` keeps `Content-Length` for bodies relayed unchanged; a body
/// condense re-serializes gets its length from the HTTP client.
pub fn to_upstream(client: &HeaderMap, keep_length: bool) -> HeaderMap {
    let mut headers = client.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(X_CONDENSE);
    if !keep_length {
        headers.remove(header::CONTENT_LENGTH);
    }
    headers
}

/// The headers to send the client for the upstream's response headers.
pub fn to_client(mut headers: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn drops_hop_by_hop_host_and_connection_listed_headers() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("proxy:8080"));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("openai-organization", HeaderValue::from_static("org-1"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        h.insert(X_CONDENSE, HeaderValue::from_static("off"));
        let out = to_upstream(&h, true);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out.contains_key("openai-organization"));
        assert!(out.contains_key(header::CONTENT_LENGTH));
        assert!(!to_upstream(&h, false).contains_key(header::CONTENT_LENGTH));
        // Without a `Connection` header the others still go, and a message
        // without any keeps everything.
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let plain = h.clone();
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        assert_eq!(to_client(h), plain);
        assert_eq!(to_client(plain.clone()), plain);
    }
}
