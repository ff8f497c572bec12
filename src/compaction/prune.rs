//! `prune`: whole old units (an assistant call with its results, or a single
//! message) dropped when even masking leaves the request over its budget,
//! with one short digest message in their place.
//!
//! Which units go is decided by the replayed plan (`plan.rs`): the oldest
//! first, those with epistemic markers later, what the user wrote last of
//! all; never the task, the client's last words or the recent window, and
//! a call always together with its results (so no orphan remains). The digest lists the key lines and paths
//! the dropped messages held; a drop breaks the cached prefix anyway, so the
//! digest costs nothing extra in cache terms.

use bytes::Bytes;
use serde_json::json;

use super::extract::{digest_size, key_lines, readable};
use super::text::{MARK, content_text};
use crate::chat::Message;

/// The digest message for the dropped messages: `dropped_tokens` and `room`
/// size it (see [`digest_size`]).
pub fn digest(messages: &[Message], dropped: &[bool], dropped_tokens: u64, room: f64) -> Bytes {
    let mut text = String::new();
    let mut count = 0;
    for (m, _) in messages.iter().zip(dropped).filter(|(_, d)| **d) {
        count += 1;
        // Each piece on its own: a JSON output or arguments string has its
        // lines read out of its strings.
        if let Some(content) = content_text(m.content()) {
            text.push_str(&readable(&content));
            text.push('\n');
        }
        for call in m.tool_calls() {
            if let Some(args) = call.pointer("/function/arguments").and_then(|a| a.as_str()) {
                text.push_str(&readable(args));
                text.push('\n');
            }
        }
    }
    let kept = key_lines(&text, digest_size(dropped_tokens, room));
    if kept.is_empty() {
        return notice(count);
    }
    let body = format!(
        "{MARK} {count} earlier messages were removed to fit the context window; key lines they held:]\n{kept}"
    );
    Bytes::from(json!({"role": "user", "content": body}).to_string())
}

/// The shortest stand-in for `count` dropped messages: only that they went
/// (with recall on, the key that gives them back is written into it).
pub fn notice(count: usize) -> Bytes {
    let body = format!("{MARK} {count} earlier messages were removed to fit the context window.]");
    Bytes::from(json!({"role": "user", "content": body}).to_string())
}
