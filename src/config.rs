//! Configuration: built-in defaults < `config/condense.toml` (or `--config
//! PATH`) < `CONDENSE_*` environment variables with `__` for nesting.
//!
//! Loading happens in two steps, as the gateways we learn from do it: figment
//! merges the layers into the raw [`Config`] (every struct denies unknown
//! fields, so a typo fails at start-up instead of silently falling back to a
//! default), then [`Config::validate`] checks what types alone cannot.
//! Which variables are configuration is `env`'s to say; the wording of
//! errors, which never show a credential, `error`'s.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize, Serializer};

use crate::tokens::encoding::Encoding;

mod env;
mod error;
mod load;
mod validate;

pub use env::ignored_variables;
pub use error::ConfigError;

/// The file read when no `--config` is given and it exists.
pub const DEFAULT_CONFIG_PATH: &str = "config/condense.toml";

/// The longest `tokens.learned_window_ttl_seconds` (30 days): a learned
/// window is a cache of what the upstream said, not a setting.
const MAX_LEARNED_WINDOW_TTL: u64 = 30 * 24 * 3600;

/// A credential. Its `Debug` and `Serialize` never show the value, so it
/// cannot leak through logs or `condense check-config`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"[redacted]\"")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Context window assumed for a model no profile or listing describes.
    pub default_context_window: u64,
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub auth: AuthConfig,
    pub log: LogConfig,
    pub tokens: TokensConfig,
    pub compaction: CompactionConfig,
    pub summary: SummaryConfig,
    pub state: StateConfig,
    /// Model profiles, matched by glob against the requested model.
    pub models: Vec<ModelProfile>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            default_context_window: 32_768,
            server: ServerConfig::default(),
            upstream: UpstreamConfig::default(),
            auth: AuthConfig::default(),
            log: LogConfig::default(),
            tokens: TokensConfig::default(),
            compaction: CompactionConfig::default(),
            summary: SummaryConfig::default(),
            state: StateConfig::default(),
            models: default_models(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokensConfig {
    /// Message token counts kept in the per-message cache (≈ 24 bytes each).
    pub cache_entries: usize,
    /// Completion allowance when a request sets neither
    /// `max_completion_tokens` nor `max_tokens`.
    pub default_completion_tokens: u64,
    /// Share of the window kept free for the provider's framing and for
    /// estimation error.
    pub reserve_ratio: f64,
    /// The smallest window an overflow error may teach condense (an error
    /// naming less lowers it to this much only; the retry of the rejected
    /// request still aims at what the error names).
    pub min_learned_window: u64,
    /// How long a window learned from an overflow error lasts, in process
    /// and in the state store; so does the floor of the largest prompt the
    /// upstream accepted.
    pub learned_window_ttl_seconds: u64,
}

impl Default for TokensConfig {
    fn default() -> Self {
        TokensConfig {
            cache_entries: 200_000,
            default_completion_tokens: 4096,
            reserve_ratio: 0.05,
            min_learned_window: 1024,
            learned_window_ttl_seconds: 3600,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    /// Pressure (calibrated prompt estimate / prompt budget) at which
    /// compaction starts.
    pub trigger: f64,
    /// Pressure compaction brings a request down to once it starts.
    pub target: f64,
    /// The last this many turns (assistant messages with what follows them)
    /// are never masked.
    pub recent_turns: usize,
    /// ... nor, at least, the last this share of the window.
    pub recent_share: f64,
    /// ... but the recent turns kept that way take at most this share of the
    /// budget (the last turn always stays).
    pub recent_max_share: f64,
    /// Characters of key lines a masked 3 KB tool result keeps, for a
    /// window of 16k tokens or less (see
    /// [`crate::compaction::extract::placeholder_base`]).
    pub placeholder_chars: usize,
    /// Per-result allowance of `fade`, as a share of the budget (see
    /// `compaction::fade::allowance`).
    pub fade_share: f64,
    /// Largest share of the budget a single result or argument string may
    /// take, and the user messages of the pinned head together (`fit`).
    pub fit_share: f64,
    /// Once compaction has begun, an answered tool result whose masked
    /// form saves at least this share of the budget is masked even inside
    /// the recent window while the request is over `target`; so are the
    /// arguments of a call that large whose results are in and report no
    /// error, always.
    pub ahead_share: f64,
    /// Masked results, shortened arguments and replaced turns carry a
    /// recall key, and a request with `tools` that holds one is offered the
    /// `condense_recall` tool, which condense answers itself.
    pub recall: bool,
    /// Most recalls condense answers within one client request.
    pub max_recalls: u32,
    /// Offer `compress_context`: the model may ask for compaction at a
    /// task boundary, honoured on the next request.
    pub agent_tool: bool,
}

impl CompactionConfig {
    /// These settings with a model's own trigger and target.
    pub fn for_model(&self, trigger: f64, target: f64) -> CompactionConfig {
        CompactionConfig {
            trigger,
            target,
            ..self.clone()
        }
    }
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            trigger: 0.98,
            target: 0.50,
            recent_turns: 3,
            recent_share: 0.10,
            recent_max_share: 0.20,
            placeholder_chars: 300,
            fade_share: 0.05,
            fit_share: 0.30,
            ahead_share: 0.005,
            recall: true,
            max_recalls: 3,
            agent_tool: false,
        }
    }
}

/// What makes condense summarize instead of dropping old turns.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerKind {
    /// When the request with old tool output masked is still at `value`
    /// times its prompt budget.
    Ratio,
    /// When fewer than `value` tokens of the prompt budget would be left.
    RemainingTokens,
    /// When the request has more than `value` messages.
    Messages,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SummaryTrigger {
    pub kind: TriggerKind,
    pub value: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SummaryConfig {
    /// Replace the oldest span with a model-written checkpoint instead of
    /// dropping it.
    pub enabled: bool,
    /// The summarizer's OpenAI-compatible API; by default the upstream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The summarizer model; by default the request's own model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Key for the summarizer. Without it, the client's own credentials are
    /// used, and only when the summarizer is the upstream's host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
    /// Most tokens a checkpoint may have.
    pub max_tokens: u64,
    /// Time allowed for one summarizer call.
    pub timeout_seconds: f64,
    /// Cooldown for a conversation after a failed summarizer call; doubles
    /// with each consecutive failure up to `max_cooldown_seconds`.
    pub cooldown_seconds: f64,
    pub max_cooldown_seconds: f64,
    pub trigger: SummaryTrigger,
}

impl Default for SummaryConfig {
    fn default() -> Self {
        SummaryConfig {
            enabled: true,
            base_url: None,
            model: None,
            api_key: None,
            max_tokens: 1500,
            timeout_seconds: 60.0,
            cooldown_seconds: 30.0,
            max_cooldown_seconds: 900.0,
            trigger: SummaryTrigger {
                kind: TriggerKind::Ratio,
                value: 1.0,
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Redis shared by condense replicas (`redis://host:6379/0`); when unset,
    /// state is kept in process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_url: Option<Secret>,
    /// How long a stored entry lives.
    pub ttl_seconds: u64,
    /// Bytes the in-process store may hold.
    pub max_bytes: usize,
    /// Time allowed for one Redis operation; a slower Redis counts as a miss.
    pub redis_timeout_seconds: f64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            redis_url: None,
            ttl_seconds: 7 * 24 * 3600,
            max_bytes: 64 * 1024 * 1024,
            redis_timeout_seconds: 0.5,
        }
    }
}

/// One `[[models]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// Glob over model names (`*`, `?`; case-insensitive).
    #[serde(rename = "match")]
    pub pattern: String,
    pub context_window: u64,
    /// Tokenizer; by default chosen from the model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    /// Overrides `compaction.trigger` for these models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<f64>,
    /// Overrides `compaction.target` for these models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<f64>,
}

/// The shipped model table; `config/condense.toml` states the same.
pub fn default_models() -> Vec<ModelProfile> {
    use Encoding::{Cl100k, O200k};
    let table: &[(&str, u64, Option<Encoding>)] = &[
        // OpenAI
        ("gpt-4o*", 128_000, Some(O200k)),
        ("chatgpt-4o*", 128_000, Some(O200k)),
        ("gpt-4.1*", 1_047_576, Some(O200k)),
        ("gpt-5*", 272_000, Some(O200k)),
        ("o1*", 200_000, Some(O200k)),
        ("o3*", 200_000, Some(O200k)),
        ("o4*", 200_000, Some(O200k)),
        ("gpt-4-turbo*", 128_000, Some(Cl100k)),
        ("gpt-4-*-preview", 128_000, Some(Cl100k)),
        ("gpt-4", 8_192, Some(Cl100k)),
        ("gpt-4-0613", 8_192, Some(Cl100k)),
        ("gpt-4-32k*", 32_768, Some(Cl100k)),
        ("gpt-3.5-turbo*", 16_385, Some(Cl100k)),
        ("gpt-oss*", 131_072, Some(O200k)),
        // Anthropic through OpenAI-compatible gateways
        ("claude*", 200_000, None),
        // Meta Llama
        ("*llama-3.1*", 131_072, None),
        ("*llama-3.2*", 131_072, None),
        ("*llama-3.3*", 131_072, None),
        ("*llama-4*", 131_072, None),
        // Qwen
        ("*qwen2.5*", 32_768, None),
        ("*qwen3*", 32_768, None),
        // Mistral
        ("*mistral-large*", 131_072, None),
        ("*mistral-medium*", 131_072, None),
        ("*mistral-small*", 131_072, None),
        ("*ministral*", 131_072, None),
        ("*codestral*", 256_000, None),
        ("*mixtral*", 32_768, None),
        // DeepSeek
        ("*deepseek*", 131_072, None),
        // Google Gemini
        ("*gemini*", 1_048_576, None),
        // xAI
        ("*grok*", 131_072, None),
    ];
    table
        .iter()
        .map(|(pattern, window, encoding)| ModelProfile {
            pattern: (*pattern).to_string(),
            context_window: *window,
            encoding: *encoding,
            trigger: None,
            target: None,
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the proxy listens on.
    pub listen: SocketAddr,
    /// Largest request body accepted; larger ones get a 413.
    pub max_body_bytes: u64,
    /// Bytes of request bodies condense holds in memory at once (bodies it
    /// reads whole); a request that would pass it gets a 503. A body without
    /// a `Content-Length` needs room for twice its size while it is put
    /// together.
    pub max_buffered_bytes: u64,
    /// Time a request body has to arrive whole (408 after it).
    pub body_timeout_seconds: f64,
    /// Client connections open at once (fewer if the open-file limit cannot
    /// hold them). Beyond it the longest-idle connection is closed to make
    /// room, or, with every connection busy, the new one gets a 503.
    pub max_connections: usize,
    /// Requests in flight at once, across all connections: an HTTP/2
    /// connection carries many, each holding an upstream socket (fewer if
    /// the open-file limit cannot hold them). Beyond it a request gets its
    /// API's overload error (503, `Retry-After: 1`) and `/readyz` says
    /// `saturated`; `/healthz`, `/readyz` and `/metrics` are never refused.
    pub max_inflight_requests: usize,
    /// A client connection on which nothing moves is closed after this
    /// long: no request in flight (idle keep-alive, or still sending its
    /// request headers), or a client that stopped reading its response.
    pub idle_timeout_seconds: f64,
    /// After SIGTERM/SIGINT, how long in-flight requests and streams may run
    /// before condense exits anyway.
    pub shutdown_grace_seconds: f64,
    /// Responses WebSockets open at once (`GET /v1/responses` upgraded, as
    /// Codex prefers); beyond it an upgrade gets a 503 and the client falls
    /// back to HTTP.
    pub max_websockets: usize,
    /// A WebSocket on which the client sends nothing this long is closed
    /// (1000); Codex opens a new one for its next turn.
    pub websocket_idle_seconds: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 32 * 1024 * 1024,
            max_buffered_bytes: 128 * 1024 * 1024,
            body_timeout_seconds: 60.0,
            max_connections: 10_000,
            max_inflight_requests: 10_000,
            idle_timeout_seconds: 60.0,
            shutdown_grace_seconds: 30.0,
            max_websockets: 1000,
            websocket_idle_seconds: 900.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Where requests go: `/v1/<rest>` is forwarded to `<base_url>/<rest>`.
    pub base_url: String,
    /// Key sent upstream when the client sends none, or always when
    /// `auth.client_keys` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
    /// Where Anthropic Messages requests go (`/v1/messages` and its
    /// sub-routes, and any request carrying `anthropic-version`).
    pub anthropic_base_url: String,
    /// Key sent to the Anthropic upstream as `x-api-key` when the client
    /// sends none, or always when `auth.client_keys` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anthropic_api_key: Option<Secret>,
    /// Time allowed to open the TCP/TLS connection.
    pub connect_timeout_seconds: f64,
    /// Time allowed from sending the request to the response headers (for
    /// a client body streamed through, from its last byte). A non-streamed
    /// reasoning-model answer only starts when it is complete, so this is
    /// generous by default.
    pub first_byte_timeout_seconds: f64,
    /// Longest silence allowed between two chunks of a response body. There
    /// is no total timeout: a stream may run as long as it keeps talking.
    pub idle_timeout_seconds: f64,
    /// Ask for `stream_options.include_usage` on streamed chat requests (and
    /// strip the usage chunk again for clients that did not ask for it), so
    /// condense learns the upstream's real prompt token count. Turn off only
    /// for an upstream that rejects `stream_options`.
    pub stream_usage: bool,
    /// Read context windows from the upstream's `/models` listing (vLLM's
    /// `max_model_len`, OpenRouter's `context_length`, ...).
    pub learn_windows: bool,
    /// A PEM file of CA certificates trusted besides the Mozilla roots on
    /// every TLS connection condense opens (the upstreams, the summarizer,
    /// through an outbound proxy): a private CA, such as a TLS-inspecting
    /// proxy's. When unset, the file `SSL_CERT_FILE` names, if any. Read
    /// at start-up (see `upstream::trust`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Most unused HTTP/1.1 connections kept open to the upstreams, over
    /// every host (HTTP/2 ones are shared; an extra one left without
    /// streams closes within a minute). 0 keeps none.
    pub max_idle_connections: usize,
    /// Send the turns of a client's Responses WebSocket over a WebSocket
    /// of the upstream's own (one per client socket), where the upstream
    /// offers one at `/responses`; over HTTP otherwise.
    pub responses_websocket: bool,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            base_url: "https://api.openai.com/v1".to_string(),
            api_key: None,
            anthropic_base_url: "https://api.anthropic.com/v1".to_string(),
            anthropic_api_key: None,
            connect_timeout_seconds: 10.0,
            first_byte_timeout_seconds: 600.0,
            idle_timeout_seconds: 300.0,
            stream_usage: true,
            learn_windows: true,
            ca_file: None,
            max_idle_connections: 256,
            responses_websocket: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// When non-empty, clients must send one of these as their bearer token,
    /// and condense sends `upstream.api_key` upstream instead of it.
    pub client_keys: Vec<Secret>,
    /// Whether `/metrics` may be scraped without a client key.
    pub metrics_public: bool,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            client_keys: Vec::new(),
            metrics_public: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A tracing filter (`info`, `condense=debug,info`, ...). `RUST_LOG`
    /// overrides it when set.
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".to_string(),
            format: LogFormat::Text,
        }
    }
}

impl Config {
    /// The trigger and target for a model, profile first.
    pub fn thresholds(&self, profile: Option<&ModelProfile>) -> (f64, f64) {
        (
            profile
                .and_then(|p| p.trigger)
                .unwrap_or(self.compaction.trigger),
            profile
                .and_then(|p| p.target)
                .unwrap_or(self.compaction.target),
        )
    }

    /// The effective configuration as TOML, secrets redacted (keys, and a
    /// password in a URL).
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.upstream.base_url = redact_url(&self.upstream.base_url);
        shown.upstream.anthropic_base_url = redact_url(&self.upstream.anthropic_base_url);
        shown.summary.base_url = self.summary.base_url.as_deref().map(redact_url);
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }
}

/// A URL fit to print: credentials in it (`user:pass@`) replaced.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if !u.username().is_empty() || u.password().is_some() => {
            let _ = u.set_username("redacted");
            let _ = u.set_password(None);
            u.to_string()
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests;
