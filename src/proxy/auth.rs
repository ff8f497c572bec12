//! Credentials: who may use condense, and which key goes upstream.
//!
//! Without `auth.client_keys`, condense is transparent: the client's own
//! `Authorization` reaches the upstream, and `upstream.api_key` fills in only
//! when the client sends none. With `auth.client_keys`, condense is the
//! gatekeeper: a client must present one of those keys (as a bearer token,
//! or in `x-api-key` or `api-key`, as Anthropic and Azure clients send them),
//! and every credential header it sent is replaced by `upstream.api_key`, so
//! client keys never leave condense.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::config::{AuthConfig, Secret};
use crate::error::ProxyError;

/// The headers that carry a client's API key.
pub static CREDENTIAL_HEADERS: [HeaderName; 3] = [
    header::AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
];

#[derive(Clone)]
pub struct Credentials {
    client_keys: Vec<Secret>,
    /// The header and value that carry the operator's key upstream.
    upstream_key: Option<(HeaderName, HeaderValue)>,
    /// The headers by which a client brings its own key to this upstream.
    own_key_headers: &'static [HeaderName],
}

impl Credentials {
    /// For an OpenAI-compatible upstream: the key as a bearer token.
    pub fn new(auth: &AuthConfig, upstream_key: Option<&Secret>) -> Credentials {
        Credentials {
            client_keys: auth.client_keys.clone(),
            upstream_key: upstream_key
                .and_then(bearer)
                .map(|v| (header::AUTHORIZATION, v)),
            own_key_headers: &CREDENTIAL_HEADERS[..1],
        }
    }

    /// For Anthropic's API: the key in `x-api-key`; a client's own key
    /// comes in `x-api-key` or as a bearer token.
    pub fn anthropic(auth: &AuthConfig, upstream_key: Option<&Secret>) -> Credentials {
        let key = upstream_key.and_then(|k| {
            let mut v = HeaderValue::from_str(k.expose()).ok()?;
            v.set_sensitive(true);
            Some((CREDENTIAL_HEADERS[1].clone(), v))
        });
        Credentials {
            client_keys: auth.client_keys.clone(),
            upstream_key: key,
            own_key_headers: &CREDENTIAL_HEADERS[..2],
        }
    }

    /// Whether clients must present a key.
    pub fn gated(&self) -> bool {
        !self.client_keys.is_empty()
    }

    /// Checks the client's key when keys are configured.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ProxyError> {
        if !self.gated() {
            return Ok(());
        }
        // `Authorization` counts only as a bearer token.
        let presented = CREDENTIAL_HEADERS.iter().filter_map(|name| {
            let value = headers.get(name)?;
            match name == header::AUTHORIZATION {
                true => bearer_token(value.as_bytes().trim_ascii()),
                false => Some(key_in(name, value)),
            }
        });
        let mut ok = false;
        for token in presented {
            // Every header is compared with every key, so timing tells
            // nothing about which one matched.
            for k in &self.client_keys {
                ok |= ct_eq(k.expose().as_bytes(), token);
            }
        }
        if ok {
            Ok(())
        } else {
            Err(ProxyError::Unauthorized)
        }
    }

    /// Sets the credentials the upstream receives: in gated mode, every
    /// credential header the client sent is replaced by the upstream key.
    pub fn apply(&self, headers: &mut HeaderMap) {
        if self.gated() {
            for name in &CREDENTIAL_HEADERS {
                headers.remove(name);
            }
        }
        if !self.own_key_headers.iter().any(|h| headers.contains_key(h))
            && let Some((name, key)) = &self.upstream_key
        {
            headers.insert(name.clone(), key.clone());
        }
        for name in &CREDENTIAL_HEADERS {
            if let Some(v) = headers.get_mut(name) {
                v.set_sensitive(true);
            }
        }
    }
}

/// `Bearer <key>` as a header value marked sensitive (kept out of logs).
pub fn bearer(key: &Secret) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(&format!("Bearer {}", key.expose())).ok()?;
    v.set_sensitive(true);
    Some(v)
}

/// The key a credential header carries: a bearer token without its scheme
/// (`Bearer`, in any case), any other value as it is (`Basic ...` whole);
/// spaces around it trimmed. The same key sent as `Authorization: Bearer
/// K`, `x-api-key: K` or `api-key: K` is the same `K`.
pub fn key_in<'a>(name: &HeaderName, value: &'a HeaderValue) -> &'a [u8] {
    let value = value.as_bytes().trim_ascii();
    match name == header::AUTHORIZATION {
        true => bearer_token(value).unwrap_or(value),
        false => value,
    }
}

/// The token of a `Bearer` credential (the scheme in any case).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|&b| b == b' ')?;
    value[..space]
        .eq_ignore_ascii_case(b"bearer")
        .then(|| value[space..].trim_ascii())
}

/// Compares without an early exit, so response timing does not reveal how
/// much of a key was right.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(keys: &[&str], upstream: Option<&str>) -> Credentials {
        let auth = AuthConfig {
            client_keys: keys.iter().map(|k| Secret::new(*k)).collect(),
            ..AuthConfig::default()
        };
        Credentials::new(&auth, upstream.map(Secret::new).as_ref())
    }

    fn with_auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn transparent_mode_keeps_client_key_and_fills_in_missing_one() {
        let c = creds(&[], Some("sk-up"));
        let mut h = with_auth("Bearer sk-client");
        c.check(&h).unwrap();
        c.apply(&mut h);
        assert_eq!(h[header::AUTHORIZATION], "Bearer sk-client");
        let mut h = HeaderMap::new();
        c.apply(&mut h);
        assert_eq!(h[header::AUTHORIZATION], "Bearer sk-up");
    }

    #[test]
    fn gated_mode_checks_and_swaps_the_key() {
        let c = creds(&["ck-1", "ck-2"], Some("sk-up"));
        assert!(c.check(&HeaderMap::new()).is_err());
        assert!(c.check(&with_auth("Bearer ck-3")).is_err());
        assert!(c.check(&with_auth("Bearer ck-")).is_err());
        assert!(c.check(&with_auth("Basic ck-1")).is_err());
        assert!(c.check(&with_auth("ck-1")).is_err());
        let mut h = with_auth("bearer ck-2");
        c.check(&h).unwrap();
        c.apply(&mut h);
        assert_eq!(h[header::AUTHORIZATION], "Bearer sk-up");
        // No upstream key: the client's key is removed, not forwarded.
        let c = creds(&["ck-1"], None);
        let mut h = with_auth("Bearer ck-1");
        c.apply(&mut h);
        assert!(!h.contains_key(header::AUTHORIZATION));
    }

    #[test]
    fn gated_mode_takes_the_key_in_any_credential_header_and_forwards_none() {
        let c = creds(&["ck-1"], Some("sk-up"));
        for name in ["x-api-key", "api-key"] {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static("ck-1"));
            c.check(&h).unwrap();
            h.insert(name, HeaderValue::from_static("ck-2"));
            assert!(c.check(&h).is_err(), "{name}");
            // Whatever the client sent, no credential of its own goes on.
            h.insert(
                header::AUTHORIZATION,
                HeaderValue::from_static("Bearer ck-1"),
            );
            c.apply(&mut h);
            assert!(!h.contains_key("x-api-key") && !h.contains_key("api-key"));
            assert_eq!(h[header::AUTHORIZATION], "Bearer sk-up");
        }
    }

    #[test]
    fn anthropic_keys_travel_in_x_api_key() {
        let auth = AuthConfig::default();
        let c = Credentials::anthropic(&auth, Some(&Secret::new("sk-ant-up")));
        // The client's own key, either way it sends it, goes on alone.
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("sk-ant-client"));
        c.apply(&mut h);
        assert_eq!(h["x-api-key"], "sk-ant-client");
        assert!(!h.contains_key(header::AUTHORIZATION));
        let mut h = with_auth("Bearer sk-ant-client");
        c.apply(&mut h);
        assert!(!h.contains_key("x-api-key"));
        // None: the operator's fills in.
        let mut h = HeaderMap::new();
        c.apply(&mut h);
        assert_eq!(h["x-api-key"], "sk-ant-up");
        assert!(h["x-api-key"].is_sensitive());
        // Gated: every client credential replaced.
        let gated = AuthConfig {
            client_keys: vec![Secret::new("ck-1")],
            ..AuthConfig::default()
        };
        let c = Credentials::anthropic(&gated, Some(&Secret::new("sk-ant-up")));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("ck-1"));
        c.check(&h).unwrap();
        c.apply(&mut h);
        assert_eq!(h["x-api-key"], "sk-ant-up");
    }
}
