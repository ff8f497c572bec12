//! Wire formats: one folder per API (`chat/`, `anthropic/`, `responses/`),
//! each behind the one trait the request path calls, [`Api`]. Each parses
//! its API's request body without loss, shows the pipeline its
//! conversation as a chat-shaped message list (the view the stages, the
//! plan, the budget and the stores work on), and writes the pipeline's
//! decisions back into its own body, rewriting only the parts that
//! changed (chat completions is the view itself). Each also reads the
//! usage its responses report, renders condense's errors in its shape,
//! offers and answers condense's own tools, and edits its streams.
//!
//! Outside this folder only routing names a format ([`Format`]); a fourth
//! API is a folder here, an arm in [`Format::api`] and a route.

pub mod anthropic;
pub mod api;
pub mod chat;
pub mod failure;
pub mod responses;
pub mod sse;
pub mod stream;
pub mod summarize;
pub mod tap;
pub mod tools;
pub mod usage;
pub mod view;

#[cfg(test)]
pub(crate) mod testing;

use bytes::Bytes;

pub use api::{Api, NotUnderstood, Parsed, Provider, WriteBack, WriteError, Writer};
pub use failure::Failure;
pub use summarize::Summarized;

use crate::chat::ChatRequest;
use anthropic::MessagesRequest;
use responses::ResponsesRequest;

/// The API a conversation request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenAI chat completions (`/v1/chat/completions`).
    Chat,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
    /// OpenAI Responses (`/v1/responses`), stateless.
    Responses,
}

impl Format {
    /// The API itself.
    pub fn api(self) -> &'static dyn Api {
        match self {
            Format::Chat => &chat::Chat,
            Format::Messages => &anthropic::Messages,
            Format::Responses => &responses::Responses,
        }
    }

    /// Every API, in the order metrics list them.
    pub const ALL: [Format; 3] = [Format::Chat, Format::Messages, Format::Responses];

    /// The API whose conversation route `path` is (with or without `/v1`).
    pub fn of_path(path: &str) -> Option<Format> {
        Format::ALL
            .into_iter()
            .find(|f| path.strip_prefix("/v1").unwrap_or(path) == &f.path()[3..])
    }

    /// The API of a `route` label.
    pub fn of_route(route: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.route() == route)
    }

    /// Its conversation route.
    pub const fn path(self) -> &'static str {
        match self {
            Format::Chat => "/v1/chat/completions",
            Format::Messages => "/v1/messages",
            Format::Responses => "/v1/responses",
        }
    }

    /// The `route` label of the metrics.
    pub const fn route(self) -> &'static str {
        match self {
            Format::Chat => "chat_completions",
            Format::Messages => "messages",
            Format::Responses => "responses",
        }
    }

    /// The format of a request body read from a file (the offline tools):
    /// Responses when it has `input` and no `messages`; Messages when it
    /// has a top-level `system` or content blocks only Anthropic has; chat
    /// otherwise.
    pub fn detect(body: &[u8]) -> Format {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
            return Format::Chat;
        };
        if v.get("input").is_some() && v.get("messages").is_none() {
            return Format::Responses;
        }
        let anthropic_block = |b: &serde_json::Value| {
            matches!(
                b.get("type").and_then(serde_json::Value::as_str),
                Some("tool_use" | "tool_result" | "thinking" | "redacted_thinking")
            )
        };
        let blocks = v
            .get("messages")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|m| m.get("content")?.as_array())
            .flatten();
        if v.get("system").is_some() || blocks.into_iter().any(anthropic_block) {
            Format::Messages
        } else {
            Format::Chat
        }
    }
}

/// The API of a request condense does not read (passed through, or
/// refused before it is read), for where it goes and the shape of
/// condense's errors: Anthropic's for its Messages routes
/// (`/v1/messages...`, also without `/v1`) and anything an Anthropic
/// client sends (it always sends `anthropic-version`), else OpenAI's.
pub fn api_of(path: &str, headers: &http::HeaderMap) -> Format {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    if path == "/messages"
        || path.starts_with("/messages/")
        || headers.contains_key("anthropic-version")
    {
        Format::Messages
    } else {
        Format::Chat
    }
}

/// A request body of any API, parsed as it is (no rule of its API checked):
/// what the offline tools read.
pub enum Request {
    Chat(ChatRequest),
    Messages(MessagesRequest),
    Responses(ResponsesRequest),
}

/// Why a body is not a request of its API.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("not a chat completions request: {0}")]
    Chat(#[from] crate::chat::ParseError),
    #[error("not an Anthropic Messages request: {0}")]
    Messages(#[from] anthropic::ParseError),
    #[error("not a stateless Responses request: {0}")]
    Responses(#[from] responses::ParseError),
}

impl Request {
    pub fn parse(format: Format, body: &Bytes) -> Result<Request, RequestError> {
        Ok(match format {
            Format::Chat => Request::Chat(ChatRequest::parse(body)?),
            Format::Messages => Request::Messages(MessagesRequest::parse(body)?),
            Format::Responses => Request::Responses(ResponsesRequest::parse(body)?),
        })
    }
}

/// The conversation in a body of `format`, for counting what was sent.
pub fn conversation_of(format: Format, body: &Bytes) -> Option<ChatRequest> {
    format.api().parse(body).ok().map(|p| p.conversation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_told_apart_by_their_own_fields() {
        let chat = br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#;
        assert_eq!(Format::detect(chat), Format::Chat);
        let messages = br#"{"model":"m","system":"s","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(Format::detect(messages), Format::Messages);
        let tools = br#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"x"}]}]}"#;
        assert_eq!(Format::detect(tools), Format::Messages);
        assert_eq!(Format::detect(b"nonsense"), Format::Chat);
    }

    #[test]
    fn each_api_makes_a_summarizer_call_and_reads_its_answer() {
        use serde_json::json;
        let (path, body) =
            Format::Chat
                .api()
                .summary_call("m", "sum up", 500, "max_completion_tokens");
        assert_eq!(path, "/chat/completions");
        assert_eq!(
            body,
            json!({"model": "m", "messages": [{"role": "user", "content": "sum up"}],
                "stream": false, "max_completion_tokens": 500})
        );
        let (path, body) = Format::Messages
            .api()
            .summary_call("c", "sum up", 500, "max_tokens");
        assert_eq!(path, "/messages");
        assert_eq!(body["max_tokens"], 500);
        assert_eq!(body["messages"][0]["content"], "sum up");
        let (path, body) = Format::Responses
            .api()
            .summary_call("g", "sum up", 500, "max_tokens");
        assert_eq!(path, "/responses");
        assert_eq!(
            (body["max_output_tokens"].as_u64(), body["store"].as_bool()),
            (Some(500), Some(false))
        );

        let chat = json!({"choices": [{"message": {"content": "S"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2}});
        let messages = json!({"content": [{"type": "thinking", "thinking": "t"}, {"type": "text", "text": "S"}],
            "stop_reason": "max_tokens", "usage": {"input_tokens": 4, "cache_read_input_tokens": 5, "output_tokens": 2}});
        let responses = json!({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "reasoning", "summary": []}, {"type": "message", "content": [{"type": "output_text", "text": "S"}]}],
            "usage": {"input_tokens": 9, "output_tokens": 2}});
        for (format, answer) in [
            (Format::Chat, chat),
            (Format::Messages, messages),
            (Format::Responses, responses),
        ] {
            let s = format.api().summary_answer(&answer).unwrap();
            assert_eq!(
                (
                    s.content.as_str(),
                    s.finish_reason.as_deref(),
                    s.prompt_tokens,
                    s.completion_tokens
                ),
                ("S", Some("length"), Some(9), Some(2)),
                "{format:?}"
            );
            assert!(
                format.api().summary_answer(&json!({})).is_err(),
                "{format:?}"
            );
        }
    }
}
