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
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use serde::{Deserialize, Serialize, Serializer};

use crate::tokens::encoding::Encoding;

mod env;
mod error;

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
    /// Characters of key lines a masked tool result keeps.
    pub placeholder_chars: usize,
    /// Per-result allowance of `fade`, as a share of the budget.
    pub fade_share: f64,
    /// Largest share of the budget a single result or argument string may
    /// take (`fit`).
    pub fit_share: f64,
    /// Once compaction has begun, an answered tool result (or the
    /// arguments of a call whose results are in and report no error) whose
    /// masked form saves at least this share of the budget is masked even
    /// inside the recent window.
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
            ahead_share: 0.10,
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
    /// Loads the layered configuration. `path` is an explicit `--config`; it
    /// must exist. Without it, `config/condense.toml` is read if present.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        match path {
            Some(p) if !p.exists() => return Err(ConfigError::MissingFile(p.to_path_buf())),
            Some(p) => figment = figment.merge(Toml::file_exact(p)),
            None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
                figment = figment.merge(Toml::file_exact(DEFAULT_CONFIG_PATH))
            }
            None => {}
        }
        let mut config: Config = figment.merge(env::provider()).extract()?;
        config.unset_empty();
        config.validate()?;
        Ok(config)
    }

    /// Parses one TOML document over the defaults, without the environment.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let mut config: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(text))
            .extract()?;
        config.unset_empty();
        config.validate()?;
        Ok(config)
    }

    /// An optional key set to an empty string is unset (so a Compose file
    /// or a Kubernetes manifest can pass `CONDENSE_UPSTREAM__API_KEY=` through
    /// from an environment that may not have it).
    fn unset_empty(&mut self) {
        let secret = |s: &mut Option<Secret>| {
            if s.as_ref().is_some_and(|k| k.expose().is_empty()) {
                *s = None;
            }
        };
        secret(&mut self.upstream.api_key);
        secret(&mut self.upstream.anthropic_api_key);
        secret(&mut self.summary.api_key);
        secret(&mut self.state.redis_url);
        for s in [&mut self.summary.base_url, &mut self.summary.model] {
            if s.as_ref().is_some_and(String::is_empty) {
                *s = None;
            }
        }
        if self
            .upstream
            .ca_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            self.upstream.ca_file = None;
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, reason: &str| ConfigError::Invalid {
            key,
            reason: reason.to_string(),
        };
        check_http_url("upstream.base_url", &self.upstream.base_url)?;
        check_http_url(
            "upstream.anthropic_base_url",
            &self.upstream.anthropic_base_url,
        )?;
        for (key, v) in [
            (
                "upstream.connect_timeout_seconds",
                self.upstream.connect_timeout_seconds,
            ),
            (
                "upstream.first_byte_timeout_seconds",
                self.upstream.first_byte_timeout_seconds,
            ),
            (
                "upstream.idle_timeout_seconds",
                self.upstream.idle_timeout_seconds,
            ),
            (
                "server.shutdown_grace_seconds",
                self.server.shutdown_grace_seconds,
            ),
            (
                "server.body_timeout_seconds",
                self.server.body_timeout_seconds,
            ),
            (
                "server.idle_timeout_seconds",
                self.server.idle_timeout_seconds,
            ),
            ("summary.timeout_seconds", self.summary.timeout_seconds),
            ("summary.cooldown_seconds", self.summary.cooldown_seconds),
            (
                "summary.max_cooldown_seconds",
                self.summary.max_cooldown_seconds,
            ),
            (
                "state.redis_timeout_seconds",
                self.state.redis_timeout_seconds,
            ),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                return Err(invalid(key, "must be a number of seconds in (0, 86400]"));
            }
        }
        if self.server.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be greater than 0"));
        }
        if self.server.max_buffered_bytes < self.server.max_body_bytes {
            return Err(invalid(
                "server.max_buffered_bytes",
                "must be at least server.max_body_bytes (a body of the largest size must fit)",
            ));
        }
        if self.server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be greater than 0"));
        }
        if self.server.max_inflight_requests == 0 {
            return Err(invalid(
                "server.max_inflight_requests",
                "must be greater than 0",
            ));
        }
        for (i, k) in self.auth.client_keys.iter().enumerate() {
            if k.expose().is_empty() {
                return Err(invalid("auth.client_keys", "keys must not be empty"));
            }
            // A client could never present it.
            if let Some(why) = unfit_for_header(k.expose()) {
                return Err(ConfigError::Invalid {
                    key: "auth.client_keys",
                    reason: format!("key {} of the list {why}", i + 1),
                });
            }
        }
        for (key, secret) in [
            ("upstream.api_key", &self.upstream.api_key),
            (
                "upstream.anthropic_api_key",
                &self.upstream.anthropic_api_key,
            ),
            ("summary.api_key", &self.summary.api_key),
        ] {
            let Some(secret) = secret else { continue };
            if secret.expose().is_empty() {
                return Err(invalid(key, "must not be empty when set"));
            }
            // Such a key would not be sent at all (no header can hold it).
            if let Some(why) = unfit_for_header(secret.expose()) {
                return Err(ConfigError::Invalid { key, reason: why });
            }
        }
        if let Some(u) = &self.summary.base_url {
            check_http_url("summary.base_url", u)?;
        }
        if self.summary.model.as_ref().is_some_and(String::is_empty) {
            return Err(invalid("summary.model", "must not be empty when set"));
        }
        if !(64..=32_768).contains(&self.summary.max_tokens) {
            return Err(invalid("summary.max_tokens", "must be in [64, 32768]"));
        }
        let t = self.summary.trigger;
        let trigger_ok = t.value.is_finite()
            && match t.kind {
                TriggerKind::Ratio => t.value > 0.0 && t.value <= 10.0,
                TriggerKind::RemainingTokens => t.value >= 0.0,
                TriggerKind::Messages => t.value >= 2.0,
            };
        if !trigger_ok {
            return Err(invalid(
                "summary.trigger",
                "value must be in (0, 10] for ratio, >= 0 for remaining_tokens, >= 2 for messages",
            ));
        }
        if let Some(u) = &self.state.redis_url {
            let ok = url::Url::parse(u.expose())
                .is_ok_and(|u| matches!(u.scheme(), "redis" | "rediss" | "redis+unix" | "unix"));
            if !ok {
                return Err(invalid(
                    "state.redis_url",
                    "must be a redis://, rediss:// or redis+unix:// URL",
                ));
            }
        }
        if self.state.ttl_seconds == 0 {
            return Err(invalid("state.ttl_seconds", "must be greater than 0"));
        }
        if self.default_context_window < 1024 {
            return Err(invalid("default_context_window", "must be at least 1024"));
        }
        if !(0.0..0.5).contains(&self.tokens.reserve_ratio) {
            return Err(invalid("tokens.reserve_ratio", "must be in [0, 0.5)"));
        }
        if self.tokens.min_learned_window == 0 {
            return Err(invalid(
                "tokens.min_learned_window",
                "must be greater than 0",
            ));
        }
        if !(1..=MAX_LEARNED_WINDOW_TTL).contains(&self.tokens.learned_window_ttl_seconds) {
            return Err(invalid(
                "tokens.learned_window_ttl_seconds",
                "must be in [1, 2592000] (30 days)",
            ));
        }
        if self.tokens.cache_entries == 0 {
            return Err(invalid("tokens.cache_entries", "must be greater than 0"));
        }
        if self.compaction.max_recalls > 16 {
            return Err(invalid("compaction.max_recalls", "must be at most 16"));
        }
        check_thresholds(
            "compaction",
            self.compaction.trigger,
            self.compaction.target,
        )?;
        let c = &self.compaction;
        for (key, value, max) in [
            ("compaction.recent_share", c.recent_share, 1.0),
            ("compaction.recent_max_share", c.recent_max_share, 10.0),
            ("compaction.fade_share", c.fade_share, 1.0),
            ("compaction.fit_share", c.fit_share, 1.0),
            ("compaction.ahead_share", c.ahead_share, 10.0),
        ] {
            if !(value > 0.0 && value <= max) {
                return Err(invalid(
                    key,
                    &format!("must be in (0, {max}] (got {value})"),
                ));
            }
        }
        for m in &self.models {
            if m.pattern.is_empty() {
                return Err(invalid("models.match", "must not be empty"));
            }
            if m.context_window < 1024 {
                return Err(ConfigError::Invalid {
                    key: "models.context_window",
                    reason: format!("{}: must be at least 1024", m.pattern),
                });
            }
            check_thresholds(
                "models",
                m.trigger.unwrap_or(self.compaction.trigger),
                m.target.unwrap_or(self.compaction.target),
            )?;
        }
        tracing_subscriber::EnvFilter::try_new(&self.log.level)
            .map_err(|e| invalid("log.level", &e.to_string()))?;
        Ok(())
    }

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

/// Why a key cannot travel as an HTTP header value as it is, if it cannot:
/// a line break or other control character, a character outside ASCII (an
/// HTTP header carries bytes; no API key has one), or whitespace around it
/// (often a newline left by the file or command it came from). The reason
/// never quotes the key.
fn unfit_for_header(key: &str) -> Option<String> {
    let len = key.len();
    let at = |i: usize| format!("at byte {} of {len}; the key is not shown", i + 1);
    for (i, b) in key.bytes().enumerate() {
        let what = match b {
            b'\r' | b'\n' => "a line break",
            0..0x20 | 0x7f => "a control character",
            0x80.. => "a character outside ASCII",
            _ => continue,
        };
        return Some(format!(
            "contains {what}, which an HTTP header cannot carry ({})",
            at(i)
        ));
    }
    if key.trim() != key {
        return Some("has a space at its start or end; the key is not shown".to_string());
    }
    None
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

fn check_http_url(key: &'static str, value: &str) -> Result<(), ConfigError> {
    let invalid = |reason: &str| ConfigError::Invalid {
        key,
        reason: reason.to_string(),
    };
    let url = url::Url::parse(value).map_err(|e| invalid(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(invalid("must be an http:// or https:// URL with a host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid("must not carry a query string or fragment"));
    }
    Ok(())
}

fn check_thresholds(section: &'static str, trigger: f64, target: f64) -> Result<(), ConfigError> {
    if !(trigger > 0.0 && trigger <= 10.0 && target > 0.0 && target < trigger) {
        return Err(ConfigError::Invalid {
            key: section,
            reason: format!(
                "thresholds need 0 < target < trigger <= 10 (got trigger {trigger}, target {target})"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_file_states_every_default() {
        let text = include_str!("../config/condense.toml");
        let parsed = Config::from_toml(text).unwrap();
        assert_eq!(parsed, Config::default());
        // Not only equal in effect: the file spells out every key.
        let file: toml::Value = toml::from_str(text).unwrap();
        let defaults = toml::Value::try_from(Config::default()).unwrap();
        assert_eq!(file, defaults);
    }

    #[test]
    fn a_models_table_replaces_the_shipped_one() {
        let c = Config::from_toml(
            "[[models]]\nmatch = \"my-*\"\ncontext_window = 8192\nencoding = \"cl100k_base\"\ntrigger = 0.85\ntarget = 0.4\n",
        )
        .unwrap();
        assert_eq!(c.models.len(), 1);
        assert_eq!(c.models[0].encoding, Some(Encoding::Cl100k));
        assert_eq!(c.thresholds(Some(&c.models[0])), (0.85, 0.4));
        assert_eq!(c.thresholds(None), (0.98, 0.5));
    }

    #[test]
    fn unknown_keys_are_errors() {
        let err = Config::from_toml("[upstream]\nbase_ur = \"http://x\"\n").unwrap_err();
        assert!(err.to_string().contains("base_ur"), "{err}");
        assert!(Config::from_toml("listen = \"1.2.3.4:5\"\n").is_err());
    }

    #[test]
    fn invalid_values_are_errors() {
        assert!(Config::from_toml("[upstream]\nbase_url = \"ftp://x\"\n").is_err());
        assert!(Config::from_toml("[upstream]\nidle_timeout_seconds = 0\n").is_err());
        assert!(Config::from_toml("[server]\nlisten = \"nowhere\"\n").is_err());
        assert!(Config::from_toml("[log]\nformat = \"xml\"\n").is_err());
        assert!(Config::from_toml("[compaction]\ntrigger = 0.5\ntarget = 0.7\n").is_err());
        for bad in [
            "fit_share = 0.0",
            "fit_share = 1.5",
            "recent_share = -0.1",
            "ahead_share = nan",
            "recent_max_share = 0",
            "fade_share = inf",
        ] {
            let err = Config::from_toml(&format!("[compaction]\n{bad}\n")).unwrap_err();
            let key = bad.split(' ').next().unwrap();
            assert!(err.to_string().contains(key), "{bad}: {err}");
        }
        // Out of reach on purpose: turns a mechanism off.
        assert!(Config::from_toml("[compaction]\nahead_share = 10\n").is_ok());
        for bad in [
            "min_learned_window = 0",
            "learned_window_ttl_seconds = 0",
            "learned_window_ttl_seconds = 2592001",
        ] {
            let err = Config::from_toml(&format!("[tokens]\n{bad}\n")).unwrap_err();
            let key = bad.split(' ').next().unwrap();
            assert!(err.to_string().contains(key), "{bad}: {err}");
        }
        assert!(Config::from_toml("[[models]]\nmatch = \"x\"\ncontext_window = 10\n").is_err());
        assert!(
            Config::from_toml(
                "[[models]]\nmatch = \"x\"\ncontext_window = 8192\nencoding = \"p50k\"\n"
            )
            .is_err()
        );
        assert!(
            Config::from_toml("[[models]]\nmatch = \"x\"\ncontext_window = 8192\nwindow = 1\n")
                .is_err()
        );
    }

    #[test]
    #[allow(clippy::result_large_err)]
    fn environment_overrides_file_with_double_underscore_nesting() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[upstream]\nbase_url = \"http://file:1/v1\"\n")?;
            jail.set_env("CONDENSE_UPSTREAM__BASE_URL", "http://env:2/v1");
            jail.set_env("CONDENSE_SERVER__LISTEN", "0.0.0.0:9999");
            jail.set_env("CONDENSE_AUTH__CLIENT_KEYS", "[k1, k2]");
            let c = Config::load(Some(Path::new("c.toml"))).unwrap();
            assert_eq!(c.upstream.base_url, "http://env:2/v1");
            assert_eq!(c.server.listen.port(), 9999);
            assert_eq!(c.auth.client_keys.len(), 2);
            jail.set_env("CONDENSE_UPSTREAM__NOPE", "1");
            assert!(Config::load(Some(Path::new("c.toml"))).is_err());
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)]
    fn an_empty_optional_key_is_unset() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("CONDENSE_UPSTREAM__API_KEY", "");
            jail.set_env("CONDENSE_STATE__REDIS_URL", "");
            jail.set_env("CONDENSE_SUMMARY__MODEL", "");
            jail.set_env("CONDENSE_UPSTREAM__CA_FILE", "");
            let c = Config::load(None).unwrap();
            assert!(c.upstream.api_key.is_none() && c.state.redis_url.is_none());
            assert!(c.summary.model.is_none() && c.upstream.ca_file.is_none());
            jail.set_env("CONDENSE_UPSTREAM__CA_FILE", "/etc/condense/ca.pem");
            let c = Config::load(None).unwrap();
            assert_eq!(
                c.upstream.ca_file.as_deref(),
                Some(Path::new("/etc/condense/ca.pem"))
            );
            Ok(())
        });
    }

    #[test]
    fn a_key_no_http_header_can_carry_is_refused_without_being_shown() {
        let secret = "sk-do-not-print-me";
        for (bad, why) in [
            (format!("{secret}\n"), "line break"),
            (format!("{secret}\r\nX-Injected: 1"), "line break"),
            (format!("{secret}\u{7f}"), "control character"),
            (format!("{secret}\tx"), "control character"),
            (format!("{secret}\u{e9}"), "outside ASCII"),
            (format!(" {secret}"), "space"),
        ] {
            type Set = fn(&mut Config, Secret);
            let set: [(&str, Set); 4] = [
                ("upstream.api_key", |c, k| c.upstream.api_key = Some(k)),
                ("upstream.anthropic_api_key", |c, k| {
                    c.upstream.anthropic_api_key = Some(k)
                }),
                ("summary.api_key", |c, k| c.summary.api_key = Some(k)),
                ("auth.client_keys", |c, k| {
                    c.auth.client_keys = vec![Secret::new("fine"), k]
                }),
            ];
            for (key, set) in set {
                let mut c = Config::default();
                set(&mut c, Secret::new(bad.clone()));
                let err = c.validate().unwrap_err().to_string();
                assert!(err.contains(key) && err.contains(why), "{err}");
                assert!(!err.contains("do-not-print"), "{err}");
            }
        }
        let mut c = Config::default();
        c.upstream.api_key = Some(Secret::new("sk-proj-AZaz09_-.~+/="));
        c.validate().unwrap();
    }

    #[test]
    #[allow(clippy::result_large_err)]
    fn a_malformed_secret_is_named_with_its_variable_but_never_shown() {
        for (var, value, wrong) in [
            // The common slip: no brackets around the list.
            (
                "CONDENSE_AUTH__CLIENT_KEYS",
                "sekrit-1, sekrit-2",
                "found a string, expected a sequence",
            ),
            (
                "CONDENSE_AUTH__CLIENT_KEYS",
                "[sekrit-1",
                "expected a sequence",
            ),
            (
                "CONDENSE_AUTH__CLIENT_KEYS",
                "[ok, 8675309]",
                "found an integer, expected a string",
            ),
            ("CONDENSE_UPSTREAM__API_KEY", "8675309", "found an integer"),
            (
                "CONDENSE_UPSTREAM__ANTHROPIC_API_KEY",
                "8675309",
                "found an integer",
            ),
            ("CONDENSE_SUMMARY__API_KEY", "true", "found a boolean"),
            ("CONDENSE_STATE__REDIS_URL", "8675309", "found an integer"),
            ("CONDENSE_UPSTREAM__BASE_URL", "8675309", "found an integer"),
        ] {
            figment::Jail::expect_with(|jail| {
                jail.set_env(var, value);
                let err = Config::load(None).unwrap_err().to_string();
                assert!(err.contains(var) && err.contains(wrong), "{var}: {err}");
                assert!(err.contains("not shown"), "{var}: {err}");
                assert!(
                    !err.contains("sekrit") && !err.contains("8675309") && !err.contains("true"),
                    "{var}: {err}"
                );
                Ok(())
            });
        }
        // The same from a file, and a file that does not parse (whose
        // error would quote the line).
        for text in [
            "[auth]\nclient_keys = \"sekrit\"\n",
            "[upstream]\napi_key = sekrit-unquoted\n",
        ] {
            let err = Config::from_toml(text).unwrap_err().to_string();
            assert!(!err.contains("sekrit"), "{err}");
            assert!(
                err.contains("client_keys") || err.contains("line 2"),
                "{err}"
            );
        }
        // Other values are still quoted: they help, and are not secret.
        figment::Jail::expect_with(|jail| {
            jail.set_env("CONDENSE_SERVER__MAX_BODY_BYTES", "lots");
            let err = Config::load(None).unwrap_err().to_string();
            assert!(
                err.contains("CONDENSE_SERVER__MAX_BODY_BYTES") && err.contains("\"lots\""),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)]
    fn stray_condense_variables_are_ignored_and_named_but_typos_in_settings_are_not() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("CONDENSE_EXTRA", "1");
            jail.set_env("CONDENSE_BIN", "/usr/local/bin/condense");
            jail.set_env("CONDENSE_E2E_API_KEY", "sk-test");
            jail.set_env("CONDENSE_SERVER", "x");
            jail.set_env("CONDENSE_DEFAULT_CONTEXT_WINDOW", "4096");
            let c = Config::load(None).unwrap();
            assert_eq!(c.default_context_window, 4096);
            assert_eq!(
                ignored_variables(),
                [
                    "CONDENSE_BIN",
                    "CONDENSE_E2E_API_KEY",
                    "CONDENSE_EXTRA",
                    "CONDENSE_SERVER"
                ]
            );
            Ok(())
        });
        for typo in ["CONDENSE_SERVER__LISTN", "CONDENSE_SERVR__LISTEN"] {
            figment::Jail::expect_with(|jail| {
                jail.set_env("CONDENSE_EXTRA", "1");
                jail.set_env(typo, "127.0.0.1:1");
                let err = Config::load(None).unwrap_err().to_string();
                assert!(err.contains(typo) && err.contains("unknown field"), "{err}");
                Ok(())
            });
        }
    }

    #[test]
    fn redacted_rendering_hides_secrets() {
        let mut c = Config::default();
        c.upstream.api_key = Some(Secret::new("sk-very-secret"));
        c.auth.client_keys = vec![Secret::new("client-secret")];
        c.upstream.base_url = "https://bob:hunter2@gw.example/v1".to_string();
        let text = c.to_redacted_toml();
        assert!(!text.contains("sk-very-secret") && !text.contains("client-secret"));
        assert!(!text.contains("hunter2") && !text.contains("bob"), "{text}");
        assert!(text.contains("https://redacted@gw.example/v1"), "{text}");
        assert!(text.contains("[redacted]"));
        assert!(!format!("{c:?}").contains("sk-very-secret"));
    }
}
