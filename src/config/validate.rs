//! Validation: what the types alone cannot check (ranges, URLs, keys fit
//! for a header, thresholds in order), each error naming its key.

use super::*;

impl Config {
    /// Checks what the types cannot; the error names the key.
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
            (
                "server.websocket_idle_seconds",
                self.server.websocket_idle_seconds,
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
