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
pub mod chat;
pub mod responses;
pub mod sse;
pub mod stream;
pub mod tap;
pub mod tools;
pub mod usage;

#[cfg(test)]
pub(crate) mod testing;

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use crate::chat::ChatRequest;
use crate::compaction::Fates;
use anthropic::{MessagesRequest, Origins};
use responses::ResponsesRequest;
use stream::{Decision, Edit, Filter, Gather};
use tap::SseTap;
use tools::Call;
use usage::Usage;

/// What differs between the APIs condense reads: the request path, the
/// usage tap, condense's tools and its errors call these, never a
/// format's module directly.
pub trait Api: Sync {
    /// The body parsed in this API: the pipeline's view and how its
    /// decisions are written back.
    fn parse(&self, body: &Bytes) -> Result<Parsed, NotUnderstood>;

    /// Who serves it: where it goes, whose key it carries, what the
    /// provider's model listing tells.
    fn provider(&self) -> Provider;

    /// Whether a body is parsed item by item into a view of its own (a
    /// large one is then work for the blocking pool); chat's view is the
    /// body itself.
    fn parses_into_a_view(&self) -> bool;

    /// A `usage` value of this API's responses.
    fn usage(&self, raw: &[u8]) -> Option<Usage>;

    /// Reads one whole stream event on its way through the usage tap,
    /// appending to `out` what the client gets for it when the tap strips.
    fn tap_event(&self, tap: &mut SseTap, event: &[u8], out: &mut BytesMut);

    /// condense's own error as this API's JSON error body.
    fn error_body(&self, failure: &Failure) -> String;

    /// condense's own error as this API's stream error event (whole, with
    /// its blank line).
    fn stream_error(&self, failure: &Failure) -> String;

    /// One of condense's tools in this API's shape.
    fn tool(&self, name: &str, description: &str, schema: Value) -> Value;

    /// The tool calls of an answer, with whether each is condense's own.
    fn calls(&self, answer: &Value) -> Vec<(Call, bool)>;

    /// The request that carries the results of condense's calls `ours`:
    /// `sent` with the answer's turn appended (the client's own calls left
    /// out) and one result per call.
    fn follow_up(
        &self,
        answer: &Value,
        ours: &[Call],
        sent: &Bytes,
        results: &[(String, String)],
    ) -> Option<Bytes>;

    /// Takes condense's calls out of an answer (the stop reason says
    /// "done" when no call of the client's is left).
    fn strip_own_calls(&self, answer: &mut Value);

    /// Reads one streamed event's data into a gathered answer.
    fn gather(&self, g: &mut Gather, data: &Value) -> Decision;

    /// Finishes a gathered answer.
    fn gathered(&self, _g: &mut Gather) {}

    /// Edits one streamed event the client gets.
    fn filter(&self, f: &mut Filter, data: &mut Value) -> Edit;

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
}

/// A summarizer's answer, in chat's words whatever API gave it.
#[derive(Debug, Clone)]
pub struct Summarized {
    pub content: String,
    /// `length` when the answer was cut at its token limit.
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// Who serves an API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// An OpenAI-compatible upstream (`upstream.base_url`): chat
    /// completions and Responses share it, its keys and its listing.
    OpenAi,
    /// Anthropic's (`upstream.anthropic_base_url`).
    Anthropic,
}

/// One of condense's own failures, as each API renders it.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    /// OpenAI's error `type`.
    pub kind: &'a str,
    /// Anthropic's error `type`.
    pub anthropic_kind: &'a str,
    /// The `code` (OpenAI) condense names it by.
    pub code: &'a str,
    pub message: &'a str,
}

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

/// Why a body is not a conversation condense works on (it goes upstream
/// unchanged).
#[derive(Debug, thiserror::Error)]
pub enum NotUnderstood {
    #[error(transparent)]
    Chat(#[from] crate::chat::ParseError),
    #[error(transparent)]
    Messages(#[from] anthropic::ParseError),
    #[error(transparent)]
    Responses(#[from] responses::ParseError),
    #[error("the conversation does not keep its API's pairing rules")]
    IllFormed,
    /// The server holds the history (`previous_response_id`,
    /// `conversation`).
    #[error("the history is on the server ({0})")]
    Stateful(&'static str),
}

/// A request body of any API, parsed as it is (no rule of its API checked):
/// what the offline tools read.
pub enum Request {
    Chat(ChatRequest),
    Messages(MessagesRequest),
    Responses(ResponsesRequest),
}

impl Request {
    pub fn parse(format: Format, body: &Bytes) -> Result<Request, NotUnderstood> {
        Ok(match format {
            Format::Chat => Request::Chat(ChatRequest::parse(body)?),
            Format::Messages => Request::Messages(MessagesRequest::parse(body)?),
            Format::Responses => Request::Responses(ResponsesRequest::parse(body)?),
        })
    }
}

/// A request body parsed in its format: the conversation the pipeline works
/// on, and how its decisions go back into the body.
pub struct Parsed {
    pub conversation: ChatRequest,
    pub writer: Writer,
}

/// How the pipeline's result becomes the body sent upstream.
pub enum Writer {
    /// The conversation is the body.
    Chat,
    Messages(MessagesRequest, Origins),
    Responses(ResponsesRequest, responses::Origins),
}

impl Parsed {
    pub fn parse(format: Format, body: &Bytes) -> Result<Parsed, NotUnderstood> {
        format.api().parse(body)
    }

    /// The requested model, when it is a string.
    pub fn model(&self) -> Option<String> {
        self.conversation.model()
    }

    /// `stream: true`.
    pub fn is_stream(&self) -> bool {
        match &self.writer {
            Writer::Chat => self.conversation.is_stream(),
            Writer::Messages(r, _) => r.is_stream(),
            Writer::Responses(r, _) => r.is_stream(),
        }
    }

    /// `max_tokens` (or chat's `max_completion_tokens`).
    pub fn max_completion_tokens(&self) -> Option<u64> {
        self.conversation.max_completion_tokens()
    }
}

impl Writer {
    /// The format it writes.
    pub fn format(&self) -> Format {
        match self {
            Writer::Chat => Format::Chat,
            Writer::Messages(..) => Format::Messages,
            Writer::Responses(..) => Format::Responses,
        }
    }

    /// The body to send: for chat, `conversation` itself; for another
    /// format, its request with `fates` written back (its own bytes when
    /// nothing changed).
    pub fn body(
        &self,
        conversation: &ChatRequest,
        fates: Option<&Fates>,
    ) -> Result<Bytes, WriteError> {
        match self {
            Writer::Chat => Ok(conversation.to_bytes()),
            Writer::Messages(req, origins) => match fates {
                Some(f) => Ok(req.write_back(origins, f)?),
                None => Ok(req.source().clone()),
            },
            Writer::Responses(req, origins) => match fates {
                Some(f) => Ok(req.write_back(origins, f)?),
                None => Ok(req.source().clone()),
            },
        }
    }
}

/// The text of a chat message's `content`, or of a content value itself: a
/// string, or the text of its parts.
pub(crate) fn text_of(v: &serde_json::Value) -> String {
    use serde_json::Value;
    let content = match v {
        Value::Object(o) => o.get("content").unwrap_or(&Value::Null),
        other => other,
    };
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// `bytes` as `Bytes` in an allocation of their length: `Bytes::from` keeps
/// a vector's spare capacity, up to as much again as it holds when it grew
/// by doubling, for as long as the view lives (a view message each).
pub(crate) fn exact(mut bytes: Vec<u8>) -> Bytes {
    bytes.shrink_to_fit();
    Bytes::from(bytes)
}

/// Writes the `tool_calls` of an assistant view message being written into
/// `out` (after its other fields, before its closing brace), one call at a
/// time: (id, name, arguments as a JSON string's contents). Nothing is
/// written when there are none.
pub(crate) fn write_tool_calls(
    out: &mut Vec<u8>,
    calls: impl Iterator<Item = (String, String, String)>,
) {
    let mut written = 0;
    for (id, name, arguments) in calls {
        out.extend_from_slice(if written == 0 {
            b",\"tool_calls\":["
        } else {
            b","
        });
        let call = serde_json::json!({"id": id, "type": "function",
            "function": {"name": name, "arguments": arguments}});
        // Writing a value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, &call);
        written += 1;
    }
    if written > 0 {
        out.push(b']');
    }
}

/// A view message from its value, in an allocation of its length.
pub(crate) fn view_bytes(v: &serde_json::Value) -> Bytes {
    exact(serde_json::to_vec(v).unwrap_or_default())
}

/// A chat message of `role` with `text` as its content, in the bytes
/// `json!({"role": role, "content": text})` gives, without a copy of the
/// text in a value first.
pub(crate) fn chat_text(role: &str, text: &str) -> Bytes {
    let mut out = Vec::with_capacity(text.len() + role.len() + 24);
    out.extend_from_slice(b"{\"content\":");
    crate::chat::object::write_json_string(&mut out, text);
    out.extend_from_slice(b",\"role\":");
    crate::chat::object::write_json_string(&mut out, role);
    out.push(b'}');
    exact(out)
}

/// A JSON array of raw values.
pub(crate) fn raw_list<'a>(raws: impl Iterator<Item = &'a Bytes>) -> Bytes {
    let mut out = vec![b'['];
    for (i, r) in raws.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(r);
    }
    out.push(b']');
    Bytes::from(out)
}

/// A format's decisions could not be written back.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Messages(#[from] anthropic::WriteError),
    #[error(transparent)]
    Responses(#[from] responses::WriteError),
}

/// The conversation in a body of `format`, for counting what was sent.
pub fn conversation_of(format: Format, body: &Bytes) -> Option<ChatRequest> {
    Parsed::parse(format, body).ok().map(|p| p.conversation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_message_is_written_as_its_value_would_be() {
        for (role, text) in [
            ("user", "hi"),
            ("assistant", ""),
            ("system", "quote \" backslash \\ line\n tab\t nul\u{0} é 🎉"),
        ] {
            let value = serde_json::json!({"role": role, "content": text});
            assert_eq!(
                chat_text(role, text),
                value.to_string().as_bytes(),
                "{text:?}"
            );
        }
    }

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
