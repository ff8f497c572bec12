//! One chat message: its exact bytes, plus a typed view of the fields the
//! pipeline reads. Unknown fields stay in the bytes; a message that no stage
//! rewrites is sent upstream exactly as the client sent it.

use std::sync::OnceLock;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone)]
pub struct Message {
    raw: Bytes,
    /// Parsed on first use: requests forwarded without compaction never pay
    /// for building it.
    view: OnceLock<View>,
    /// `content`, parsed apart and on first use: most of a conversation's
    /// bytes are tool output, and most stages only need the other fields.
    content: OnceLock<Option<Value>>,
}

/// The fields condense reads, but `content`. Everything is optional and
/// loosely typed: a message with odd fields is still forwarded, just not
/// understood.
#[derive(Debug, Clone, Default, Deserialize)]
struct View {
    #[serde(default)]
    role: Option<Value>,
    #[serde(default)]
    name: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Value>,
    #[serde(default)]
    tool_call_id: Option<Value>,
}

#[derive(Default, Deserialize)]
struct Content {
    #[serde(default)]
    content: Option<Value>,
}

impl Message {
    /// A message from its exact JSON bytes (which must be valid JSON).
    pub fn from_bytes(raw: Bytes) -> Message {
        Message {
            raw,
            view: OnceLock::new(),
            content: OnceLock::new(),
        }
    }

    fn view(&self) -> &View {
        self.view
            .get_or_init(|| serde_json::from_slice(&self.raw).unwrap_or_default())
    }

    /// The message's exact JSON bytes.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    pub fn role(&self) -> Option<&str> {
        self.view().role.as_ref()?.as_str()
    }

    /// `content`: a string, an array of parts, null, or absent.
    pub fn content(&self) -> Option<&Value> {
        self.content
            .get_or_init(|| {
                serde_json::from_slice::<Content>(&self.raw)
                    .map(|c| c.content)
                    .unwrap_or_default()
            })
            .as_ref()
    }

    pub fn name(&self) -> Option<&str> {
        self.view().name.as_ref()?.as_str()
    }

    pub fn tool_calls(&self) -> Option<&Vec<Value>> {
        self.view().tool_calls.as_ref()?.as_array()
    }

    pub fn tool_call_id(&self) -> Option<&str> {
        self.view().tool_call_id.as_ref()?.as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(s: &str) -> Message {
        Message::from_bytes(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn typed_view_of_a_tool_call_round() {
        let a = msg(
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]}"#,
        );
        assert_eq!(a.role(), Some("assistant"));
        assert_eq!(a.tool_calls().map(Vec::len), Some(1));
        let t = msg(r#"{"role":"tool","tool_call_id":"c1","content":"a.txt"}"#);
        assert_eq!(t.tool_call_id(), Some("c1"));
    }

    #[test]
    fn odd_messages_are_kept_not_understood() {
        let m = msg(r#"{"role":7,"content":{"weird":true}}"#);
        assert_eq!(m.role(), None);
        assert_eq!(m.raw(), br#"{"role":7,"content":{"weird":true}}"#);
        let m = msg(r#""just a string""#);
        assert_eq!(m.role(), None);
    }
}
