//! Which headers cross the proxy, in both directions.
//!
//! Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the
//! message, so they are dropped at each side, together with any header the
//! `Connection` header names. `Host` is set by the HTTP client for the
//! upstream. Everything else passes unchanged.

use http::header::{self, HeaderMap, HeaderName};

static HOP_BY_HOP: [HeaderName; 8] = [
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
    // Only the names present are removed (each removal hashes its name),
    // found in one pass over the keys: most messages carry none, and most
    // others `Connection: keep-alive` alone.
    let mut present = [false; 8];
    let mut any = false;
    for key in headers.keys() {
        if let Some(i) = hop_by_hop_index(key) {
            present[i] = true;
            any = true;
        }
    }
    if !any {
        return;
    }
    // The names `Connection` lists besides the hop-by-hop names removed
    // anyway (`keep-alive` among them): rare, so only then collected.
    let named: Vec<HeaderName> = if present[0] {
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|n| {
                !n.is_empty()
                    && !HOP_BY_HOP
                        .iter()
                        .any(|h| n.eq_ignore_ascii_case(h.as_str()))
            })
            .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
            .collect()
    } else {
        Vec::new()
    };
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        headers.remove(name);
    }
    for name in &named {
        headers.remove(name);
    }
}

/// Where `name` is in [`HOP_BY_HOP`]. Their lengths are looked at first:
/// most names have none of them, and comparing every name with the eight
/// cost about a thousand instructions a response.
fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    let name = name.as_str();
    if !matches!(name.len(), 2 | 7 | 10 | 17 | 18 | 19) {
        return None;
    }
    HOP_BY_HOP.iter().position(|h| h.as_str() == name)
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
        // `Connection` with options, hop-by-hop names in any case and a
        // name it lists: every name it lists is removed, whatever its case
        // (a field named by the `close` option too), and only those.
        let mut h = plain.clone();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("Keep-Alive, close, X-Hop, TE,"),
        );
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("close", HeaderValue::from_static("1"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert_eq!(to_client(h), plain);
        let mut h = plain.clone();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert_eq!(to_client(h), plain);
        // Every hop-by-hop name is found, and no other.
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name), Some(i));
        }
        for name in [
            "te2",
            "trailers",
            "connections",
            "upgrade-insecure-requests",
        ] {
            let name = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert_eq!(hop_by_hop_index(&name), None);
        }
    }
}
