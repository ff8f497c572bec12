//! `prune`: whole old units (an assistant call with its results, or a single
//! message) dropped when even masking leaves the request over its budget,
//! with one short digest message in their place: where the first of them
//! stood, or past what the user wrote between them when that outweighs it
//! (`after_what_was_said` in `mod.rs`).
//!
//! Which units go is decided by the replayed plan (`plan.rs`): the newest
//! the frontier has passed first (so the cached prefix holds up to them),
//! those with epistemic markers later, what the user wrote last of all;
//! never the task, the client's last words or the recent window, and a
//! call always together with its results (so no orphan remains). The
//! digest gives what the user wrote in the dropped messages, then the key
//! lines they held (more of them the more it replaces) and the paths they
//! named, the most named first; a drop breaks the cached prefix anyway, so
//! the digest costs nothing extra in cache terms.
//!
//! What the user wrote comes first because nothing else stands for it: a
//! Claude Code session opened with a greeting and gave its task in the
//! second user message, which the pinned head (the messages before the
//! first answer) does not hold; at 16k its drops took the task away on
//! every later turn, and key lines, which score paths and errors, never
//! kept it. Each message is one line of at most [`USER_LINE`] characters,
//! the newest first within a third of the digest (what is left goes to
//! key lines); text the client's harness wraps in one tag
//! (`<system-reminder>…</system-reminder>`, an opened file, a background
//! task's notification) is not the user's.

use bytes::Bytes;
use serde_json::json;

use super::extract::{digest_size, key_lines, named_paths, push_labelled, readable};
use super::text::{MARK, content_text};
use crate::chat::Message;

/// Most characters of one user message a digest gives.
pub const USER_LINE: usize = 300;

/// Longest user message a digest gives as the user's words: a longer one
/// is a pasted document or an expanded command template (Codex's spec-kit
/// prompts, 2,750 to 49,000 characters), whose key lines say more than its
/// head. Given whole, their boilerplate heads took the room of key lines a
/// Codex session needed: its retention at 32k fell from 0.766 to 0.666.
pub const SAID_MAX: usize = 1000;

/// The digest message for the dropped messages: `dropped_tokens` and `room`
/// size it (see [`digest_size`]); `said(i)` is whether message `i` is one
/// the user wrote (not a tool's output).
pub fn digest(
    messages: &[Message],
    dropped: &[bool],
    said: impl Fn(usize) -> bool,
    dropped_tokens: u64,
    room: f64,
) -> Bytes {
    let size = digest_size(dropped_tokens, room);
    let words = user_words(messages, dropped, said, size / 3);
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
    // A quarter of it lists the paths the key lines do not name. On all
    // the shared traces this took mean retention of the facts the agent
    // used again from 0.844 to 0.885 at 16k (chars:3.6) and 0.948 to 0.962
    // at 32k; the key lines it displaced cost one Claude Code session
    // 0.05 of them (function definitions and an error line). Four tenths
    // for paths gained no more.
    let for_paths = size / 4;
    let for_lines = size.saturating_sub(words.len() + for_paths);
    let mut kept = key_lines(&text, for_lines);
    let paths = named_paths(&text, &kept, for_paths);
    push_labelled(&mut kept, "paths", &paths);
    let held = match (words.is_empty(), kept.is_empty()) {
        (true, true) => return notice(count),
        (true, false) => "key lines they held",
        (false, true) => "what the user wrote in them",
        (false, false) => "what the user wrote in them, then key lines they held",
    };
    let lines = [words, kept];
    let lines: Vec<&str> = lines
        .iter()
        .map(String::as_str)
        .filter(|l| !l.is_empty())
        .collect();
    let body = format!("{MARK} {count} {REMOVED}; {held}:]\n{}", lines.join("\n"));
    Bytes::from(json!({"role": "user", "content": body}).to_string())
}

/// The dropped messages the user wrote, one `user: …` line each (its
/// whitespace collapsed, at most [`USER_LINE`] characters), the newest
/// first within `budget` characters, in their original order. A message
/// over [`SAID_MAX`] characters is left to the key lines.
fn user_words(
    messages: &[Message],
    dropped: &[bool],
    said: impl Fn(usize) -> bool,
    budget: usize,
) -> String {
    let mut lines: Vec<String> = Vec::new();
    let mut used = 0;
    for i in (0..messages.len()).rev() {
        if !(dropped.get(i).copied().unwrap_or(false) && said(i)) {
            continue;
        }
        let Some(text) = content_text(messages[i].content()) else {
            continue;
        };
        let text = text.trim();
        if text.is_empty()
            || text.chars().nth(SAID_MAX).is_some()
            || text.starts_with(MARK)
            || harness_wrapped(text)
        {
            continue;
        }
        let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let line = match flat.char_indices().nth(USER_LINE) {
            Some((at, _)) => format!("user: {}…", &flat[..at]),
            None => format!("user: {flat}"),
        };
        let cost = line.chars().count() + 1;
        if used + cost > budget {
            break;
        }
        used += cost;
        lines.push(line);
    }
    lines.reverse();
    lines.join("\n")
}

/// Whether `text` is one tag's element as a client's harness writes it
/// into a user turn (`<system-reminder>…</system-reminder>`): not what the
/// user wrote.
fn harness_wrapped(text: &str) -> bool {
    let Some(rest) = text.strip_prefix('<') else {
        return false;
    };
    let name_len = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .unwrap_or(rest.len());
    let name = &rest[..name_len];
    !name.is_empty()
        && text
            .strip_suffix('>')
            .and_then(|t| t.strip_suffix(name))
            .is_some_and(|t| t.ends_with("</"))
}

/// What every digest and notice says (the replay tells a request's
/// stand-in for dropped turns by it).
pub const REMOVED: &str = "earlier messages were removed to fit the context window";

/// The shortest stand-in for `count` dropped messages: only that they went
/// (with recall on, the key that gives them back is written into it).
pub fn notice(count: usize) -> Bytes {
    let body = format!("{MARK} {count} {REMOVED}.]");
    Bytes::from(json!({"role": "user", "content": body}).to_string())
}
