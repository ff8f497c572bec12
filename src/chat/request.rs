//! A chat-completions request parsed without loss: the top-level object keeps
//! every field (known or not) as the client's bytes, and `messages` is split
//! into one raw slice per message. Serializing an unchanged request gives the
//! client's bytes back; serializing after a change rewrites only what changed.

use serde_json::value::RawValue;

use super::message::Message;
use super::object::{RawObject, raw};

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("body is not a JSON object: {0}")]
    NotAnObject(#[from] serde_json::Error),
    #[error("body has no \"messages\" array")]
    NoMessages,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    fields: RawObject,
    messages: Vec<Message>,
    messages_changed: bool,
    fields_changed: bool,
}

impl ChatRequest {
    /// Parses a request body. A body that is not a JSON object with a
    /// `messages` array is not a chat request condense can work on; the caller
    /// forwards it unchanged for the upstream to judge.
    pub fn parse(body: &[u8]) -> Result<ChatRequest, ParseError> {
        let fields = RawObject::parse(body)?;
        let list = fields.get("messages").ok_or(ParseError::NoMessages)?;
        let raws: Vec<Box<RawValue>> =
            serde_json::from_str(list.get()).map_err(|_| ParseError::NoMessages)?;
        Ok(ChatRequest {
            messages: raws.into_iter().map(Message::from_raw).collect(),
            fields,
            messages_changed: false,
            fields_changed: false,
        })
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Replaces the message list; the request will be re-serialized.
    pub fn set_messages(&mut self, messages: Vec<Message>) {
        self.messages = messages;
        self.messages_changed = true;
    }

    /// The requested model, when it is a string.
    pub fn model(&self) -> Option<String> {
        self.string_field("model")
    }

    fn string_field(&self, key: &str) -> Option<String> {
        serde_json::from_str::<String>(self.fields.get(key)?.get()).ok()
    }

    /// `stream: true` (anything else, including a wrongly typed value, counts
    /// as not streaming; the upstream judges such a request).
    pub fn is_stream(&self) -> bool {
        self.fields.get("stream").map(RawValue::get) == Some("true")
    }

    /// `max_completion_tokens`, else `max_tokens`, when a non-negative integer.
    pub fn max_completion_tokens(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| serde_json::from_str::<u64>(self.fields.get(k)?.get()).ok())
    }

    pub fn field(&self, key: &str) -> Option<&RawValue> {
        self.fields.get(key)
    }

    /// Whether the client asked for `stream_options.include_usage: true`.
    pub fn client_wants_stream_usage(&self) -> bool {
        self.stream_options()
            .and_then(|o| o.get("include_usage").map(|v| v.get() == "true"))
            .unwrap_or(false)
    }

    fn stream_options(&self) -> Option<RawObject> {
        RawObject::parse(self.fields.get("stream_options")?.get().as_bytes()).ok()
    }

    /// Sets `stream_options.include_usage: true`, keeping any other stream
    /// options the client sent.
    pub fn request_stream_usage(&mut self) {
        let mut options = self.stream_options().unwrap_or_default();
        options.set("include_usage", raw("true"));
        let bytes = options.to_vec();
        // The object was built from valid JSON values, so this parses.
        if let Ok(value) = RawValue::from_string(String::from_utf8_lossy(&bytes).into_owned()) {
            self.fields.set("stream_options", value);
            self.fields_changed = true;
        }
    }

    /// Whether serializing would produce anything but the original bytes.
    pub fn is_changed(&self) -> bool {
        self.messages_changed || self.fields_changed
    }

    /// The request body: unchanged messages keep their exact bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut fields = self.fields.clone();
        if self.messages_changed {
            let mut list =
                Vec::with_capacity(self.messages.iter().map(|m| m.raw().len() + 1).sum());
            list.push(b'[');
            for (i, m) in self.messages.iter().enumerate() {
                if i > 0 {
                    list.push(b',');
                }
                list.extend_from_slice(m.raw().as_bytes());
            }
            list.push(b']');
            if let Ok(v) = RawValue::from_string(String::from_utf8_lossy(&list).into_owned()) {
                fields.set("messages", v);
            }
        }
        fields.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = r#"{"model":"gpt-4o","x_vendor":{"a":[1,2]},"messages":[{"role":"system","content":"be brief","x":1},
        {"role":"user","content":[{"type":"text","text":"hi","extra":true}]}],"stream":true,"stream_options":{"other":5}}"#;

    #[test]
    fn reads_the_fields_condense_needs() {
        let r = ChatRequest::parse(BODY.as_bytes()).unwrap();
        assert_eq!(r.model().as_deref(), Some("gpt-4o"));
        assert!(r.is_stream());
        assert!(!r.client_wants_stream_usage());
        assert_eq!(r.messages().len(), 2);
        assert_eq!(r.messages()[0].role(), Some("system"));
    }

    #[test]
    fn stream_usage_is_added_and_everything_else_kept() {
        let mut r = ChatRequest::parse(BODY.as_bytes()).unwrap();
        r.request_stream_usage();
        let out = String::from_utf8(r.to_vec()).unwrap();
        assert!(
            out.contains(r#""stream_options":{"other":5,"include_usage":true}"#),
            "{out}"
        );
        assert!(out.contains(r#""x_vendor":{"a":[1,2]}"#));
        // Messages are re-emitted with their original bytes, whitespace included.
        assert!(out.contains("\n        {\"role\":\"user\""), "{out}");
    }

    #[test]
    fn rewritten_message_list_keeps_untouched_messages_verbatim() {
        let mut r = ChatRequest::parse(BODY.as_bytes()).unwrap();
        let kept = vec![r.messages()[1].clone()];
        r.set_messages(kept);
        let out = String::from_utf8(r.to_vec()).unwrap();
        assert!(out.contains(
            r#""messages":[{"role":"user","content":[{"type":"text","text":"hi","extra":true}]}]"#
        ), "{out}");
    }

    #[test]
    fn non_chat_bodies_are_refused() {
        assert!(ChatRequest::parse(b"not json").is_err());
        assert!(ChatRequest::parse(br#"{"model":"m"}"#).is_err());
        assert!(ChatRequest::parse(br#"{"messages":"nope"}"#).is_err());
        assert!(ChatRequest::parse(br#"[]"#).is_err());
    }

    #[test]
    fn max_tokens_fallback() {
        let r = ChatRequest::parse(br#"{"messages":[],"max_tokens":100}"#).unwrap();
        assert_eq!(r.max_completion_tokens(), Some(100));
        let r =
            ChatRequest::parse(br#"{"messages":[],"max_tokens":100,"max_completion_tokens":7}"#)
                .unwrap();
        assert_eq!(r.max_completion_tokens(), Some(7));
    }
}
