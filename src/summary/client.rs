//! The summarizer call: one non-streamed answer from the summarizer's API
//! (chat completions on an OpenAI-compatible API; the request and the
//! answer are the API's own, `wire::summarize::Summarize`), and what may
//! authenticate it. It goes out on condense's one client
//! ([`crate::upstream`]): the same connections, TLS roots, proxy and
//! timeouts as the forwarded requests.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, header};
use serde_json::Value;

use crate::config::Secret;
use crate::proxy::auth::bearer;
use crate::upstream::{Outgoing, SendError, Upstream};
use crate::wire::Api;

/// Headers that say whose account a call is for; with the client's keys
/// (`proxy::auth::CREDENTIAL_HEADERS`) they go to the summarizer only when
/// it is the upstream's own host.
static ACCOUNT_HEADERS: [HeaderName; 2] = [
    HeaderName::from_static("openai-organization"),
    HeaderName::from_static("openai-project"),
];

/// Every header of the client's that the summarizer may get.
fn client_credentials() -> impl Iterator<Item = &'static HeaderName> {
    crate::proxy::auth::CREDENTIAL_HEADERS
        .iter()
        .chain(ACCOUNT_HEADERS.iter())
}

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("summarizer unreachable: {0}")]
    Transport(String),
    #[error("summarizer answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("summarizer answer is not a chat completion: {0}")]
    Shape(String),
}

/// A summarizer's answer.
pub type Answer = crate::wire::Summarized;

pub struct Client {
    /// The client at the summarizer's base URL.
    http: Upstream,
    /// The API it speaks.
    api: &'static dyn Api,
    /// scheme://host:port of the summarizer.
    origin: String,
    api_key: Option<HeaderValue>,
}

impl Client {
    /// A client for the API at `http`'s base URL.
    pub fn new(api: &'static dyn Api, http: Upstream, api_key: Option<&Secret>) -> Client {
        Client {
            origin: origin(http.base_url()).unwrap_or_default(),
            http,
            api,
            api_key: api_key.and_then(bearer),
        }
    }

    /// Whether `base_url` is on the summarizer's host (same scheme, host and
    /// port).
    pub fn same_origin(&self, base_url: &str) -> bool {
        origin(base_url).is_some_and(|o| o == self.origin)
    }

    /// The headers a call sends: the configured key, or else the client's
    /// credentials from `client_headers` (the headers condense sends the
    /// upstream) when they may go here.
    pub fn headers(&self, client_headers: Option<&HeaderMap>, may_use_client: bool) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(key) = &self.api_key {
            h.insert(header::AUTHORIZATION, key.clone());
        } else if may_use_client && let Some(client) = client_headers {
            for name in client_credentials() {
                if let Some(v) = client.get(name) {
                    let mut v = v.clone();
                    v.set_sensitive(true);
                    h.insert(name.clone(), v);
                }
            }
        }
        self.api
            .summary_headers(client_headers.filter(|_| may_use_client), &mut h);
        h
    }

    /// Asks `model` for at most `max_tokens` tokens in answer to `prompt`.
    /// `max_field` is `max_tokens` or `max_completion_tokens`.
    pub async fn call(
        &self,
        headers: HeaderMap,
        model: &str,
        prompt: &str,
        max_tokens: u64,
        max_field: &str,
    ) -> Result<Answer, CallError> {
        let (path, body) = self.api.summary_call(model, prompt, max_tokens, max_field);
        let secrets: Vec<String> = headers
            .iter()
            .filter(|(name, _)| client_credentials().any(|c| c == *name))
            .filter_map(|(_, v)| v.to_str().ok())
            .map(|v| v.trim_start_matches("Bearer ").to_string())
            .filter(|v| v.len() >= 8)
            .collect();
        let uri = self
            .http
            .url_for(path, None)
            .map_err(|e| CallError::Transport(e.to_string()))?;
        let body = Outgoing::Whole(Bytes::from(body.to_string()));
        // The error says why with its causes (a TLS failure says
        // `UnknownIssuer` there), never the URL.
        let resp = self
            .http
            .send(Method::POST, uri, headers, body)
            .await
            .map_err(|e| {
                CallError::Transport(match e {
                    SendError::Unreachable(why) => why,
                    SendError::Timeout(s) => format!("no answer within {s} seconds"),
                })
            })?;
        let status = resp.status();
        // A checkpoint is a few kilobytes; an answer far larger is not one,
        // and reading it whole would let the summarizer fill memory.
        let idle = Some(self.http.idle_timeout());
        let bytes = match crate::proxy::read::read_upstream(resp, MAX_ANSWER_BYTES, idle).await {
            Ok(crate::proxy::read::Limited::Whole(b)) => b,
            Ok(crate::proxy::read::Limited::Over { .. }) => {
                return Err(CallError::Shape(format!(
                    "the answer is longer than {MAX_ANSWER_BYTES} bytes"
                )));
            }
            Err(e) => return Err(CallError::Transport(e.to_string())),
        };
        if !status.is_success() {
            // The error is logged: a summarizer that echoes the key it was
            // sent must not put it in the logs.
            let mut body = String::from_utf8_lossy(&bytes).to_string();
            for s in &secrets {
                body = body.replace(s.as_str(), "[redacted]");
            }
            let cut = crate::compaction::text::floor_boundary(&body, 300);
            body.truncate(cut);
            return Err(CallError::Status {
                status: status.as_u16(),
                body,
            });
        }
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| CallError::Shape(e.to_string()))?;
        self.api.summary_answer(&v).map_err(CallError::Shape)
    }
}

/// Largest summarizer answer read.
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// `scheme://host:port` of a URL, with the scheme's default port filled in.
fn origin(base_url: &str) -> Option<String> {
    let u = url::Url::parse(base_url).ok()?;
    Some(format!(
        "{}://{}:{}",
        u.scheme(),
        u.host_str()?.to_ascii_lowercase(),
        u.port_or_known_default()?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(base_url: &str) -> Upstream {
        Upstream::new(&crate::config::UpstreamConfig {
            base_url: base_url.to_string(),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn client_credentials_go_only_to_the_upstreams_own_host() {
        let c = Client::new(
            &crate::wire::chat::Chat,
            upstream("https://api.openai.com/v1"),
            None,
        );
        assert!(c.same_origin("https://API.openai.com:443/v1/"));
        assert!(!c.same_origin("http://api.openai.com/v1"));
        assert!(!c.same_origin("https://api.openai.com.evil.example/v1"));
        let mut client = HeaderMap::new();
        client.insert(
            "authorization",
            HeaderValue::from_static("Bearer sk-client"),
        );
        client.insert("x-other", HeaderValue::from_static("1"));
        let h = c.headers(Some(&client), true);
        assert_eq!(h["authorization"], "Bearer sk-client");
        assert!(h.get("x-other").is_none());
        assert!(
            c.headers(Some(&client), false)
                .get("authorization")
                .is_none()
        );

        let keyed = Client::new(
            &crate::wire::chat::Chat,
            upstream("http://127.0.0.1:1/v1"),
            Some(&Secret::new("sk-sum")),
        );
        assert_eq!(
            keyed.headers(Some(&client), true)["authorization"],
            "Bearer sk-sum"
        );
    }
}
