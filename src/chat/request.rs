//! A chat-completions request parsed without loss: the top-level object keeps
//! every field (known or not) as the client's bytes, and `messages` is split
//! into one raw slice per message, in a single pass and without copying.
//! Serializing an unchanged request gives the client's bytes back;
//! serializing after a change rewrites only what changed.

use bytes::Bytes;

use super::message::Message;
use super::object::RawObject;

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("body is not a JSON object with a \"messages\" array: {0}")]
    Invalid(#[from] serde_json::Error),
    #[error("body has no \"messages\" array")]
    NoMessages,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    source: Bytes,
    fields: RawObject,
    messages: Vec<Message>,
    changed: bool,
}

impl ChatRequest {
    /// Parses a request body. A body that is not a JSON object with a
    /// `messages` array is not a chat request condense can work on; the caller
    /// forwards it unchanged for the upstream to judge.
    pub fn parse(body: &Bytes) -> Result<ChatRequest, ParseError> {
        let (fields, list) = RawObject::parse_splitting(body, Some("messages"))?;
        let list = list.ok_or(ParseError::NoMessages)?;
        Ok(ChatRequest {
            source: body.clone(),
            messages: list.into_iter().map(Message::from_bytes).collect(),
            fields,
            changed: false,
        })
    }

    /// A request assembled from its top-level fields and messages (a wire
    /// format's conversation as the pipeline sees it); its bytes are always
    /// serialized from them.
    pub fn assembled(fields: RawObject, messages: Vec<Message>) -> ChatRequest {
        ChatRequest {
            source: Bytes::new(),
            fields,
            messages,
            changed: true,
        }
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Replaces the message list; the request will be re-serialized.
    pub fn set_messages(&mut self, messages: Vec<Message>) {
        self.messages = messages;
        self.changed = true;
    }

    /// Sets the messages and returns the ones they replace.
    pub fn replace_messages(&mut self, messages: Vec<Message>) -> Vec<Message> {
        self.changed = true;
        std::mem::replace(&mut self.messages, messages)
    }

    /// The requested model, when it is a string.
    pub fn model(&self) -> Option<String> {
        serde_json::from_slice::<String>(self.fields.get("model")?).ok()
    }

    /// `stream: true` (anything else, including a wrongly typed value, counts
    /// as not streaming; the upstream judges such a request).
    pub fn is_stream(&self) -> bool {
        self.fields.get("stream") == Some(b"true")
    }

    /// `max_completion_tokens`, else `max_tokens`, when a non-negative integer.
    pub fn max_completion_tokens(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| serde_json::from_slice::<u64>(self.fields.get(k)?).ok())
    }

    /// A top-level field's raw JSON bytes.
    pub fn field(&self, key: &str) -> Option<&[u8]> {
        self.fields.get(key)
    }

    /// Sets a top-level field (`value` must be valid JSON).
    pub fn set_field(&mut self, key: &str, value: Bytes) {
        self.fields.set(key, value);
        self.changed = true;
    }

    /// Whether the client asked for `stream_options.include_usage: true`.
    pub fn client_wants_stream_usage(&self) -> bool {
        self.stream_options()
            .and_then(|o| o.get("include_usage").map(|v| v == b"true"))
            .unwrap_or(false)
    }

    fn stream_options(&self) -> Option<RawObject> {
        let raw = self.fields.get("stream_options")?;
        RawObject::parse(&Bytes::copy_from_slice(raw)).ok()
    }

    /// Sets `stream_options.include_usage: true`, keeping any other stream
    /// options the client sent.
    pub fn request_stream_usage(&mut self) {
        let mut options = self.stream_options().unwrap_or_default();
        options.set("include_usage", Bytes::from_static(b"true"));
        self.fields
            .set("stream_options", Bytes::from(options.to_vec()));
        self.changed = true;
    }

    /// The request body: the client's bytes when nothing changed; otherwise
    /// re-serialized with every untouched value and message byte-identical.
    pub fn to_bytes(&self) -> Bytes {
        if !self.changed {
            return self.source.clone();
        }
        let size: usize = self.messages.iter().map(|m| m.raw().len() + 1).sum();
        let mut list = Vec::with_capacity(size + 2);
        list.push(b'[');
        for (i, m) in self.messages.iter().enumerate() {
            if i > 0 {
                list.push(b',');
            }
            list.extend_from_slice(m.raw());
        }
        list.push(b']');
        let mut fields = self.fields.clone();
        fields.set("messages", Bytes::from(list));
        Bytes::from(fields.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = r#"{"model":"gpt-4o","x_vendor":{"a":[1,2]},"messages":[{"role":"system","content":"be brief","x":1},
        {"role":"user","content":[{"type":"text","text":"hi","extra":true}]}],"stream":true,"stream_options":{"other":5}}"#;

    fn parse(s: &str) -> Result<ChatRequest, ParseError> {
        ChatRequest::parse(&Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn reads_the_fields_condense_needs() {
        let r = parse(BODY).unwrap();
        assert_eq!(r.model().as_deref(), Some("gpt-4o"));
        assert!(r.is_stream());
        assert!(!r.client_wants_stream_usage());
        assert_eq!(r.messages().len(), 2);
        assert_eq!(r.messages()[0].role(), Some("system"));
        assert_eq!(&r.to_bytes()[..], BODY.as_bytes());
    }

    #[test]
    fn stream_usage_is_added_and_everything_else_kept() {
        let mut r = parse(BODY).unwrap();
        r.request_stream_usage();
        let out = String::from_utf8(r.to_bytes().to_vec()).unwrap();
        assert_eq!(
            out,
            r#"{"model":"gpt-4o","x_vendor":{"a":[1,2]},"messages":[{"role":"system","content":"be brief","x":1},{"role":"user","content":[{"type":"text","text":"hi","extra":true}]}],"stream":true,"stream_options":{"other":5,"include_usage":true}}"#
        );
    }

    #[test]
    fn rewritten_message_list_keeps_untouched_messages_verbatim() {
        let mut r = parse(BODY).unwrap();
        let kept = vec![r.messages()[1].clone()];
        r.set_messages(kept);
        let out = String::from_utf8(r.to_bytes().to_vec()).unwrap();
        assert!(
            out.contains(
                r#""messages":[{"role":"user","content":[{"type":"text","text":"hi","extra":true}]}]"#
            ),
            "{out}"
        );
    }

    #[test]
    fn non_chat_bodies_are_refused() {
        for bad in [
            "not json",
            r#"{"model":"m"}"#,
            r#"{"messages":"nope"}"#,
            "[]",
            r#"{"messages":[]} trailing"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn max_tokens_fallback() {
        let r = parse(r#"{"messages":[],"max_tokens":100}"#).unwrap();
        assert_eq!(r.max_completion_tokens(), Some(100));
        let r = parse(r#"{"messages":[],"max_tokens":100,"max_completion_tokens":7}"#).unwrap();
        assert_eq!(r.max_completion_tokens(), Some(7));
    }
}
