//! Anthropic's usage: the prompt split into uncached, cache-read and
//! cache-written parts, which together are what the window holds.

use serde::Deserialize;

use crate::wire::usage::Usage;

/// Anthropic's usage object: the prompt is split into uncached, cache-read
/// and cache-written parts, which together are what the window holds.
#[derive(Debug, Default, Deserialize)]
pub(super) struct AnthropicUsage {
    #[serde(default)]
    pub(super) input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    pub(super) output_tokens: Option<u64>,
}

impl AnthropicUsage {
    pub(super) fn prompt(&self) -> Option<u64> {
        let parts = [
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ];
        parts
            .iter()
            .any(Option::is_some)
            .then(|| parts.iter().flatten().sum())
    }
}

/// An Anthropic `usage` value.
pub(super) fn usage(raw: &[u8]) -> Option<Usage> {
    let u: AnthropicUsage = serde_json::from_slice(raw).ok()?;
    let prompt = u.prompt()?;
    Some(Usage::of(prompt, u.output_tokens.unwrap_or(0)))
}
