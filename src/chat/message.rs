//! One chat message: its exact bytes, plus a typed view of the fields the
//! pipeline reads. Unknown fields stay in the bytes; a message that no stage
//! rewrites is sent upstream exactly as the client sent it.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use super::object::{elements, members};

/// A message is its bytes and what has been read of them; a clone shares
/// both (the stages clone messages freely, and a deep copy of a parsed
/// `content` or of 80,000 parsed tool calls cost hundreds of megabytes).
#[derive(Debug, Clone)]
pub struct Message {
    raw: Bytes,
    read: Arc<Read>,
}

/// What is read of a message's bytes, each part on first use.
#[derive(Debug, Default)]
struct Read {
    /// Requests forwarded without compaction never pay for building it.
    view: OnceLock<View>,
    /// `content`, parsed apart: most of a conversation's bytes are tool
    /// output, and most stages only need the other fields.
    content: OnceLock<Option<Value>>,
    /// xxh3 of the bytes, taken once: the token caches and the recall
    /// state key messages by it, several times a request.
    digest: OnceLock<u64>,
}

/// The fields condense reads, but `content`. Everything is optional and
/// loosely typed: a message with odd fields is still forwarded, just not
/// understood. The three strings are kept only when they are strings (all
/// that is asked of them), in 16 bytes each: a turn of 80,000 tool calls
/// has 80,000 views.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
struct View {
    #[serde(default, deserialize_with = "string_only")]
    role: Option<Box<str>>,
    #[serde(default, deserialize_with = "string_only")]
    name: Option<Box<str>>,
    /// `tool_calls` as its bytes (arguments can be long).
    #[serde(default, deserialize_with = "raw_bytes")]
    tool_calls: Option<Bytes>,
    #[serde(default, deserialize_with = "string_only")]
    tool_call_id: Option<Box<str>>,
}

fn string_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Box<str>>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(s) => Some(s.into_boxed_str()),
        _ => None,
    })
}

fn raw_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Bytes>, D::Error> {
    let raw = Box::<RawValue>::deserialize(d)?;
    Ok(Some(Bytes::copy_from_slice(raw.get().as_bytes())))
}

#[derive(Default, Deserialize)]
struct Content {
    #[serde(default)]
    content: Option<Value>,
}

impl View {
    /// The view of a message's bytes: only the four fields' values are
    /// parsed, the rest (a long `content` most of all) is skipped by its
    /// delimiters. What `serde_json` would make of the bytes: a duplicate
    /// field makes the whole view empty, as the derived parse fails on one.
    fn read(raw: &Bytes) -> View {
        let mut view = View::default();
        let mut seen = [false; 4];
        let mut duplicate = false;
        let read = members(raw, |key, value| {
            let (slot, i) = match key {
                "role" => (&mut view.role, 0),
                "name" => (&mut view.name, 1),
                "tool_call_id" => (&mut view.tool_call_id, 3),
                "tool_calls" => {
                    duplicate |= std::mem::replace(&mut seen[2], true);
                    view.tool_calls = Some(raw.slice_ref(value));
                    return;
                }
                _ => return,
            };
            duplicate |= std::mem::replace(&mut seen[i], true);
            *slot = serde_json::from_slice::<String>(value)
                .ok()
                .map(String::into_boxed_str);
        });
        match (read, duplicate) {
            (Some(()), false) => view,
            (Some(()), true) => View::default(),
            (None, _) => serde_json::from_slice(raw).unwrap_or_default(),
        }
    }
}

/// A message's `content`, read as `View::read` reads its fields.
fn read_content(raw: &[u8]) -> Option<Value> {
    let (mut content, mut times) = (None, 0);
    let read = members(raw, |key, value| {
        if key == "content" {
            times += 1;
            content = serde_json::from_slice(value).unwrap_or_default();
        }
    });
    match (read, times) {
        (Some(()), 0 | 1) => content,
        (Some(()), _) => None,
        (None, _) => serde_json::from_slice::<Content>(raw)
            .map(|c| c.content)
            .unwrap_or_default(),
    }
}

impl Message {
    /// A message from its exact JSON bytes (which must be valid JSON).
    pub fn from_bytes(raw: Bytes) -> Message {
        Message {
            raw,
            read: Arc::default(),
        }
    }

    /// xxh3 of the message's bytes.
    pub fn digest(&self) -> u64 {
        *self.read.digest.get_or_init(|| xxh3_64(&self.raw))
    }

    fn view(&self) -> &View {
        self.read.view.get_or_init(|| View::read(&self.raw))
    }

    /// The message's exact JSON bytes.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    pub fn role(&self) -> Option<&str> {
        self.view().role.as_deref()
    }

    /// `content`: a string, an array of parts, null, or absent.
    pub fn content(&self) -> Option<&Value> {
        self.read
            .content
            .get_or_init(|| read_content(&self.raw))
            .as_ref()
    }

    pub fn name(&self) -> Option<&str> {
        self.view().name.as_deref()
    }

    /// Its tool calls (the elements of `tool_calls` when it is an array),
    /// each parsed as it is reached: a turn of 80,000 calls parsed whole
    /// was a hundred megabytes of maps, held as long as the message.
    pub fn tool_calls(&self) -> impl Iterator<Item = Value> + '_ {
        let raw = self.view().tool_calls.as_deref().unwrap_or_default();
        let mut each = Vec::new();
        // Not an array as `elements` expects: what a parse makes of it.
        let whole = match raw.is_empty() || elements(raw, |c| each.push(c)).is_some() {
            true => Vec::new(),
            false => {
                each.clear();
                match serde_json::from_slice(raw) {
                    Ok(Value::Array(calls)) => calls,
                    _ => Vec::new(),
                }
            }
        };
        each.into_iter()
            .filter_map(|c| serde_json::from_slice(c).ok())
            .chain(whole)
    }

    /// Whether the message makes a tool call: `tool_calls` is an array
    /// with an element.
    pub fn has_tool_calls(&self) -> bool {
        let Some(raw) = &self.view().tool_calls else {
            return false;
        };
        let mut any = false;
        match elements(raw, |_| any = true) {
            Some(()) => any,
            None => self.tool_calls().next().is_some(),
        }
    }

    /// The `id` of each tool call that has a string one, in order, read
    /// without parsing the calls' arguments.
    pub fn tool_call_ids(&self) -> Vec<String> {
        let mut ids = Vec::new();
        let Some(raw) = &self.view().tool_calls else {
            return ids;
        };
        let read = elements(raw, |call| {
            let mut id = None;
            // A call that is not an object has no id; with the key twice,
            // the last counts, as in a parsed map.
            let _ = members(call, |key, value| {
                if key == "id" {
                    id = serde_json::from_slice::<String>(value).ok();
                }
            });
            ids.extend(id);
        });
        match read {
            Some(()) => ids,
            None => self
                .tool_calls()
                .filter_map(|c| c.get("id")?.as_str().map(str::to_string))
                .collect(),
        }
    }

    pub fn tool_call_id(&self) -> Option<&str> {
        self.view().tool_call_id.as_deref()
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
        assert_eq!(a.tool_calls().count(), 1);
        let t = msg(r#"{"role":"tool","tool_call_id":"c1","content":"a.txt"}"#);
        assert_eq!(t.tool_call_id(), Some("c1"));
    }

    #[test]
    fn fields_read_apart_are_what_a_parse_reads() {
        for s in [
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{\"a\":\"}]\"}"}}]}"#,
            r#"{ "role" : "tool" , "tool_call_id" : "c\u0031", "content" : "a\n\"b\"\\" , "x" : [1, {"y": "}"}] }"#,
            r#"{"content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:,"}}],"name":"ann","role":"user"}"#,
            r#"{"r\u006fle":"user","content":"escaped key"}"#,
            r#"{"role":"user","role":"assistant","content":"twice"}"#,
            r#"{"role":"user","content":"a","content":"b"}"#,
            r#"{"role":null,"name":5,"tool_calls":{},"content":7}"#,
            r#"{"role":"assistant","tool_calls":[]}"#,
            r#"{"role":"assistant","tool_calls":null}"#,
            r#"{"role":"assistant","tool_calls":[{"id":"a","id":"b"},7,{"id":5},{"type":"x"},{"id":"c\u00e9","function":{"arguments":"[\"id\"]"}}]}"#,
            r#"{}"#,
            r#""a string""#,
            r#"[{"role":"user"}]"#,
        ] {
            let m = msg(s);
            let parsed: View = serde_json::from_slice(s.as_bytes()).unwrap_or_default();
            let content: Option<Value> = serde_json::from_slice::<Content>(s.as_bytes())
                .map(|c| c.content)
                .unwrap_or_default();
            assert_eq!(m.view(), &parsed, "{s}");
            assert_eq!(m.content(), content.as_ref(), "{s}");
            // The calls as a full parse of the message sees them.
            let value: Value = serde_json::from_str(s).unwrap();
            let calls = value.get("tool_calls").and_then(Value::as_array);
            let each: Vec<Value> = m.tool_calls().collect();
            assert_eq!(each, calls.cloned().unwrap_or_default(), "{s}");
            assert_eq!(
                m.has_tool_calls(),
                calls.is_some_and(|c| !c.is_empty()),
                "{s}"
            );
            let ids: Vec<String> = calls
                .into_iter()
                .flatten()
                .filter_map(|c| c.get("id")?.as_str().map(str::to_string))
                .collect();
            assert_eq!(m.tool_call_ids(), ids, "{s}");
        }
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
