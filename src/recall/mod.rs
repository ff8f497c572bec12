//! Reversible compaction: what condense cut can be asked for again.
//!
//! - *Keys* (`compaction/keys.rs`): every message a stage rewrites, and the turns a
//!   digest or checkpoint replaces, get a recall key derived from their
//!   original bytes. The key is written into the marker condense's own text
//!   starts with (`[condense: recall key: K; ...]`), so it is part of the
//!   pure transform: the same original gives the same bytes on every turn,
//!   and the provider's prompt cache stays warm.
//! - *Originals* ([`store::Originals`]): what a key stands for, taken from the
//!   request condense compacted (the client always sends it whole), and
//!   kept in the state store (`store.rs`) so any replica can answer a key.
//! - *Tools* (`wire/tools.rs`, each API's shape in its folder):
//!   `condense_recall` (and, when enabled, `compress_context`) offered to
//!   the model, their calls found in its answer and answered inside
//!   condense (`src/proxy/recall.rs`).
//! - *Reading* ([`read`]): what a recall returns, the whole original or
//!   the part asked for (a line range, a search), within the room left.

pub mod read;
pub mod store;

use serde_json::Value;

use crate::chat::Message;
use crate::compaction::Fates;
use crate::compaction::keys::{holds, key, span_key};
use crate::compaction::text::content_text;

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
