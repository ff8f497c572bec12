//! Reversible compaction: what condense cut can be asked for again.
//!
//! - *Keys* (this file): every message a stage rewrites, and the turns a
//!   digest or checkpoint replaces, get a recall key derived from their
//!   original bytes. The key is written into the marker condense's own text
//!   starts with (`[condense: recall key: K; ...]`), so it is part of the
//!   pure transform: the same original gives the same bytes on every turn,
//!   and the provider's prompt cache stays warm.
//! - *Originals* ([`originals`]): what a key stands for, taken from the
//!   request condense compacted (the client always sends it whole), and
//!   kept in the state store (`store.rs`) so any replica can answer a key.
//! - *Tools* (`tools.rs`): `condense_recall` (and, when enabled,
//!   `compress_context`) offered to the model, their calls found in its
//!   answer and answered inside condense (`src/proxy/recall.rs`).

pub mod store;
pub mod stream;
pub mod tools;

use bytes::Bytes;
use memchr::memmem;
use serde_json::Value;

use crate::chat::Message;
use crate::compaction::Fates;
use crate::compaction::text::{MARK, content_text};

/// The tool the model recalls an original with.
pub const RECALL_TOOL: &str = "condense_recall";
/// The tool the model asks for compaction with (`compaction.agent_tool`).
pub const COMPRESS_TOOL: &str = "compress_context";

/// Whether a tool name is one of condense's own.
pub fn is_own_tool(name: &str) -> bool {
    name == RECALL_TOOL || name == COMPRESS_TOOL
}

/// What precedes a key in condense's markers.
const LABEL: &str = "recall key: ";
/// Characters a key adds to a marker (` recall key: K;`).
pub const TAG_CHARS: usize = LABEL.len() + KEY_CHARS + 2;
/// Digits of a key: about 50 bits of a 128-bit hash. Keys are scoped to a
/// client's credentials, so that is far from colliding; and a key costs
/// prompt tokens on every masked message: digits cost one token per three
/// in the tokenizers models use (5 here), where as many bits of base64
/// cost 8 to 11.
const KEY_CHARS: usize = 15;

/// The recall key of a message with these exact bytes.
pub fn key(raw: &[u8]) -> String {
    encode(xxhash_rust::xxh3::xxh3_128(raw))
}

/// The recall key of several messages replaced together (a digest's or a
/// checkpoint's span).
pub fn span_key<'a>(raws: impl Iterator<Item = &'a [u8]>) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"span");
    for raw in raws {
        h.update(&xxhash_rust::xxh3::xxh3_128(raw).to_le_bytes());
    }
    encode(h.digest128())
}

fn encode(h: u128) -> String {
    format!("{:015}", h % 10u128.pow(KEY_CHARS as u32))
}

/// Whether `s` has the shape of a key (6–64 of `[A-Za-z0-9_-]`).
pub fn valid_key(s: &str) -> bool {
    (6..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The message `raw` (condense's own rewrite of it) with `key` written into
/// its first marker, unless it carries a key already or has no marker.
pub fn tag(raw: &[u8], key: &str) -> Option<Bytes> {
    if memmem::find(raw, LABEL.as_bytes()).is_some() {
        return None;
    }
    let at = memmem::find(raw, MARK.as_bytes())? + MARK.len();
    let mut out = Vec::with_capacity(raw.len() + LABEL.len() + key.len() + 3);
    out.extend_from_slice(&raw[..at]);
    out.extend_from_slice(b" ");
    out.extend_from_slice(LABEL.as_bytes());
    out.extend_from_slice(key.as_bytes());
    out.push(b';');
    // The marker's own text went on after a space.
    let rest = &raw[at..];
    out.extend_from_slice(rest);
    Some(Bytes::from(out))
}

/// Whether any of `messages` mentions a recall key.
pub fn mentions_key(messages: &[Message]) -> bool {
    let finder = memmem::Finder::new(LABEL.as_bytes());
    messages.iter().any(|m| finder.find(m.raw()).is_some())
}

/// The recall keys `text` holds, in order.
pub fn keys_in(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices(LABEL).filter_map(|(at, _)| {
        let rest = &text[at + LABEL.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(rest.len());
        Some(&rest[..end]).filter(|k| valid_key(k))
    })
}

/// Whether `raw` holds the key `key` in one of condense's markers.
pub fn holds(raw: &[u8], key: &str) -> bool {
    let needle = format!("{LABEL}{key}");
    memmem::find(raw, needle.as_bytes()).is_some()
}

/// What a recall of one message returns: its text, and each tool call it
/// made with its arguments.
pub fn original(m: &Message) -> String {
    let mut text = content_text(m.content())
        .map(std::borrow::Cow::into_owned)
        .unwrap_or_default();
    for call in m.tool_calls() {
        let name = call
            .pointer("/function/name")
            .and_then(Value::as_str)
            .unwrap_or("tool");
        let args = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!("[call {name}] {args}"));
    }
    text
}

/// What a recall of a replaced span returns: each message with its role.
pub fn transcript<'a>(messages: impl Iterator<Item = &'a Message>) -> String {
    let mut out = String::new();
    for m in messages {
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(&format!("[{}]\n", m.role().unwrap_or("message")));
        out.push_str(&original(m));
    }
    out
}

/// The keys a compacted request holds, with what each stands for in the
/// conversation as the client sent it; texts are made when asked for.
#[derive(Debug, Clone, Default)]
pub struct Recallable {
    messages: Vec<Message>,
    /// Per message: whether the replaced span holds it.
    replaced: Vec<bool>,
    entries: Vec<(String, Entry)>,
}

#[derive(Debug, Clone)]
enum Entry {
    /// One rewritten message.
    Message(usize),
    /// The span a digest or checkpoint replaced.
    Span,
}

impl Recallable {
    /// The keys of the rewritten `messages` (the conversation compaction
    /// was given) whose new bytes carry them, and of the replaced span.
    pub fn of(messages: Vec<Message>, fates: &Fates) -> Recallable {
        let mut entries = Vec::new();
        for (i, new) in fates.rewritten.iter().enumerate() {
            let (Some(new), Some(m)) = (new, messages.get(i)) else {
                continue;
            };
            let k = key(m.raw());
            if holds(new, &k) {
                entries.push((k, Entry::Message(i)));
            }
        }
        if let Some(replacement) = &fates.replacement {
            let span = messages
                .iter()
                .zip(&fates.replaced)
                .filter(|(_, r)| **r)
                .map(|(m, _)| m.raw());
            let k = span_key(span);
            if holds(replacement, &k) {
                entries.push((k, Entry::Span));
            }
        }
        Recallable {
            messages,
            replaced: fates.replaced.clone(),
            entries,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// The original text under `key`, if this request holds it.
    pub fn text(&self, key: &str) -> Option<String> {
        let (_, entry) = self.entries.iter().find(|(k, _)| k == key)?;
        Some(match entry {
            Entry::Message(i) => original(&self.messages[*i]),
            Entry::Span => transcript(
                self.messages
                    .iter()
                    .zip(&self.replaced)
                    .filter(|(_, r)| **r)
                    .map(|(m, _)| m),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_short_and_found_again() {
        let k = key(b"{\"role\":\"tool\",\"content\":\"x\"}");
        assert_eq!(k, key(b"{\"role\":\"tool\",\"content\":\"x\"}"));
        assert_ne!(k, key(b"{\"role\":\"tool\",\"content\":\"y\"}"));
        assert_eq!(k.len(), KEY_CHARS);
        assert!(valid_key(&k));
        let raw = br#"{"role":"tool","content":"[condense: earlier tool output elided: 9 chars]"}"#;
        let tagged = tag(raw, &k).unwrap();
        let text = std::str::from_utf8(&tagged).unwrap();
        assert!(
            text.contains(&format!("[condense: recall key: {k}; earlier tool output")),
            "{text}"
        );
        assert_eq!(keys_in(text).collect::<Vec<_>>(), vec![k.as_str()]);
        assert!(holds(&tagged, &k));
        // Tagged once only; nothing to tag without a marker.
        assert!(tag(&tagged, "other-key").is_none());
        assert!(tag(br#"{"content":"plain"}"#, &k).is_none());
    }

    #[test]
    fn keys_in_ignores_what_is_not_a_key() {
        let t = "recall key: ab; recall key: abcdef_-9] and recall key: ";
        assert_eq!(keys_in(t).collect::<Vec<_>>(), vec!["abcdef_-9"]);
    }
}
