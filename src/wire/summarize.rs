//! A summarizer call in an API's own shape, and its answer read back.

use http::HeaderMap;
use serde_json::Value;

/// A summarizer's answer, in chat's words whatever API gave it.
#[derive(Debug, Clone)]
pub struct Summarized {
    pub content: String,
    /// `length` when the answer was cut at its token limit.
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// How an API is asked for a summary.
pub trait Summarize: Sync {
    /// A summarizer call in this API: the path under the API's base URL
    /// and the body asking `model` for at most `max_tokens` tokens in
    /// answer to `prompt` (`max_field`: the name chat gives that limit).
    fn summary_call(
        &self,
        model: &str,
        prompt: &str,
        max_tokens: u64,
        max_field: &str,
    ) -> (&'static str, Value);

    /// The summarizer's answer, or what is wrong with its shape.
    fn summary_answer(&self, answer: &Value) -> Result<Summarized, String>;

    /// Headers the API wants on a summarizer call besides the credentials
    /// (`client`: the headers the client's own request goes upstream
    /// with, when they may be used).
    fn summary_headers(&self, _client: Option<&HeaderMap>, _out: &mut HeaderMap) {}
}
