//! Chat completions streams: the usage tap's reading (and stripping of
//! what condense asked for), and condense's tools in a streamed answer.
//!
//! condense always asks streamed requests for `stream_options.include_usage`
//! because the upstream's own prompt token count is what calibrates condense's
//! estimate. A client that did not ask for usage must not see the difference,
//! so for it the tap drops the usage-only chunk (`"choices":[]`) and the
//! `"usage":null` field the upstream then adds to every other chunk.
//!
//! Some upstreams put more than usage on that chunk when asked for it, and
//! on the last chunk otherwise: llama.cpp's `timings`. So the tap holds the
//! chunk that finishes a choice until the next event: when that is the
//! usage-only chunk, the fields it has and the held chunk lacks (other than
//! `usage` and `choices`) are moved onto the held chunk, which then goes out.
//! The client receives what the upstream would have sent it had condense not
//! asked for usage.

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;
use serde_json::{Value, json};

use crate::chat::RawObject;
use crate::chat::object::members;
use crate::wire::sse::{event_data, rebuild_event, single_data_line};
use crate::wire::stream::{Decision, Edit, Filter, Gather, Named, append_text, named, str_at};
use crate::wire::tap::SseTap;
use crate::wire::tools::is_own_tool;
use crate::wire::usage::Usage;

/// Fields of a chat assistant message that hold its reasoning.
pub const REASONING_FIELDS: &[&str] = &["reasoning_content", "reasoning"];

/// A chat `usage` value (None when it is null).
pub(super) fn usage(raw: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<Option<Usage>>(raw).ok()?
}

/// Reads one event of a chat stream (see the module doc).
pub(super) fn tap_event(tap: &mut SseTap, event: &[u8], out: &mut BytesMut) {
    let n = needles();
    if n.done.find(event).is_some() || n.done_tight.find(event).is_some() {
        tap.done = true;
    }
    let mentions_usage = n.usage.find(event).is_some();
    // The usual chunk of a stream that reports usage: `"usage":null`,
    // read and (when stripping) cut out without parsing the chunk.
    if mentions_usage && let Some(cut) = null_usage(event) {
        if tap.strip {
            let event = match cut {
                Some(cut) => [&event[..cut.start], &event[cut.end..]].concat().into(),
                None => Bytes::copy_from_slice(event),
            };
            let finishing = finishes(&event);
            tap.pass(event, finishing, out);
        }
        return;
    }
    let parsed = if mentions_usage {
        parse_event(event)
    } else {
        None
    };
    let usage = parsed.as_ref().and_then(|(_, o)| usage_of_object(o));
    if usage.is_some() {
        tap.usage = usage;
    }
    if !tap.strip {
        return;
    }
    let Some((text, mut obj)) = parsed else {
        tap.pass(Bytes::copy_from_slice(event), finishes(event), out);
        return;
    };
    if usage.is_some() && obj.get("choices") == Some(b"[]") {
        // The usage-only chunk the client did not ask for: dropped, its
        // other fields moved onto the chunk that finished the answer.
        if let Some(held) = tap.held.take() {
            out.extend_from_slice(&merge_extra_fields(held, &obj));
        }
        return;
    }
    let event = if obj.get("usage") == Some(b"null") {
        obj.remove("usage");
        rebuild_event(text, &obj.to_vec())
    } else {
        Bytes::copy_from_slice(event)
    };
    let finishing = finishes(&event);
    tap.pass(event, finishing, out);
}

/// Reads `usage` from a response object, when present and not null.
fn usage_of_object(obj: &RawObject) -> Option<Usage> {
    usage(obj.get("usage")?)
}

/// For an event whose data (one `data:` line) is a JSON object with a
/// top-level `"usage":null` or no top-level `usage`: the bytes of `event` to
/// cut to take that member out (with its comma), or None when there is none.
/// None (the outer one) for anything else (data on several lines, not an
/// object by its structure, a usage that is not null, a key written with
/// escapes, the member twice): the caller parses the event then.
///
/// An OpenAI stream asked for usage puts `"usage":null` on every chunk:
/// parsing each to learn that, and writing it out again without the
/// member, cost several times what walking its members does.
fn null_usage(event: &[u8]) -> Option<Option<std::ops::Range<usize>>> {
    let (offset, data) = single_data_line(event)?;
    // OpenAI's own chunks end with it, written compactly. In a JSON object
    // that ends `,"usage":null}`, that is the last top-level member: a
    // nested one would be followed by another closing bracket, and a
    // quote inside a string is escaped (`\"`). Mentioned once, and with
    // no `\u` escape that could spell the key another way, it is the only
    // one; no need to walk the members.
    const TAIL: &[u8] = b",\"usage\":null}";
    let trimmed = data.trim_ascii_end();
    let n = needles();
    if trimmed.ends_with(TAIL)
        && data.trim_ascii_start().starts_with(b"{")
        && n.usage.find_iter(data).nth(1).is_none()
        && n.unicode_escape.find(data).is_none()
    {
        let start = offset + trimmed.len() - TAIL.len();
        return Some(Some(start..start + TAIL.len() - 1));
    }
    let mut found = None;
    let mut twice = false;
    members(data, |key, value| {
        if key == "usage" {
            twice |= found.is_some();
            found = Some(value);
        }
    })?;
    if twice {
        return None;
    }
    let Some(value) = found else {
        return Some(None);
    };
    if value != b"null" {
        return None;
    }
    // Where the value sits in `data`, then its key (written plainly) and
    // the comma before it, or else the one after it.
    let value_start = (value.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
    let value_end = value_start + value.len();
    let before = data[..value_start].trim_ascii_end().strip_suffix(b":")?;
    let key_start = before.trim_ascii_end().strip_suffix(b"\"usage\"")?.len();
    let head = data[..key_start].trim_ascii_end();
    let cut = match head.strip_suffix(b",") {
        Some(kept) => kept.trim_ascii_end().len()..value_end,
        // The first member: up to the next one's key.
        None => match data[value_end..].trim_ascii_start().strip_prefix(b",") {
            Some(next) => key_start..data.len() - next.trim_ascii_start().len(),
            None => key_start..value_end,
        },
    };
    Some(Some(offset + cut.start..offset + cut.end))
}

/// What the tap looks for in events, each searcher built once: building
/// one (`memmem::find` does, every call) cost more than searching a chunk
/// with it, and several searches run on every event of a stream.
struct Needles {
    usage: Finder<'static>,
    done: Finder<'static>,
    done_tight: Finder<'static>,
    finish_reason: Finder<'static>,
    finish_null: Finder<'static>,
    finish_null_spaced: Finder<'static>,
    unicode_escape: Finder<'static>,
}

fn needles() -> &'static Needles {
    static NEEDLES: LazyLock<Needles> = LazyLock::new(|| Needles {
        usage: Finder::new(b"\"usage\""),
        done: Finder::new(b"data: [DONE]"),
        done_tight: Finder::new(b"data:[DONE]"),
        finish_reason: Finder::new(b"\"finish_reason\""),
        finish_null: Finder::new(b"\"finish_reason\":null"),
        finish_null_spaced: Finder::new(b"\"finish_reason\": null"),
        unicode_escape: Finder::new(b"\\u"),
    });
    &NEEDLES
}

/// The data of an SSE event as a JSON object, with the event's text.
fn parse_event(event: &[u8]) -> Option<(&str, RawObject)> {
    let (text, data) = event_data(event)?;
    Some((text, RawObject::parse(&Bytes::from(data)).ok()?))
}

/// Whether an event finishes a choice: it has a `finish_reason` that is not
/// null.
fn finishes(event: &[u8]) -> bool {
    let n = needles();
    let all = n.finish_reason.find_iter(event).count();
    if all == 0 {
        return false;
    }
    let null =
        n.finish_null.find_iter(event).count() + n.finish_null_spaced.find_iter(event).count();
    all > null
}

/// Fields every chunk of an OpenAI-style stream carries: a usage chunk with
/// no others has nothing to move, and the held chunk need not be parsed.
const CHUNK_FIELDS: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "system_fingerprint",
    "service_tier",
    "obfuscation",
    "choices",
    "usage",
];

/// `held` with the top-level fields of `usage_chunk` it lacks added (not
/// `usage`, not `choices`); unchanged when there are none.
fn merge_extra_fields(held: Bytes, usage_chunk: &RawObject) -> Bytes {
    if usage_chunk.keys().all(|k| CHUNK_FIELDS.contains(&k)) {
        return held;
    }
    let Some((text, mut obj)) = parse_event(&held) else {
        return held;
    };
    let extra: Vec<&str> = usage_chunk
        .keys()
        .filter(|k| !matches!(*k, "usage" | "choices") && obj.get(k).is_none())
        .collect();
    if extra.is_empty() {
        return held;
    }
    for k in extra {
        if let Some(v) = usage_chunk.get(k) {
            obj.set(k, Bytes::copy_from_slice(v));
        }
    }
    rebuild_event(text, &obj.to_vec())
}

pub(super) fn gather(g: &mut Gather, data: &Value) -> Decision {
    if g.value.is_null() {
        g.value = json!({"id": data.get("id"), "object": "chat.completion",
            "created": data.get("created"), "model": data.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": null},
                "finish_reason": null}]});
    }
    if let Some(u) = data.get("usage").filter(|u| u.is_object()) {
        g.value["usage"] = u.clone();
    }
    let Some(choice) = data.pointer("/choices/0") else {
        return Decision::Hold;
    };
    let mut now = Decision::Hold;
    let delta = choice.get("delta").unwrap_or(&Value::Null);
    if let Some(text) = delta.get("content").and_then(Value::as_str) {
        if !text.is_empty() {
            now = Decision::Pass;
        }
        append_text(&mut g.value["choices"][0]["message"]["content"], text);
    }
    if delta.get("refusal").is_some_and(|r| !r.is_null()) {
        now = Decision::Pass;
    }
    for key in REASONING_FIELDS {
        if let Some(piece) = delta.get(*key).and_then(Value::as_str) {
            append_text(&mut g.value["choices"][0]["message"][*key], piece);
        }
    }
    for tc in delta
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        if i > 64 {
            continue;
        }
        while g.calls.len() <= i {
            g.calls.push(json!({"id": "", "type": "function",
                "function": {"name": "", "arguments": ""}}));
        }
        let call = &mut g.calls[i];
        if let Some(id) = tc.get("id").and_then(Value::as_str) {
            call["id"] = json!(id);
        }
        if let Some(name) = str_at(tc, "/function/name") {
            let full = format!("{}{name}", call["function"]["name"].as_str().unwrap_or(""));
            // A name may come in pieces: one that may still become one
            // of condense's tools or a client's tool tells nothing yet.
            now = match named(&full, &g.client_tools) {
                Named::Ours => Decision::Ours,
                Named::Unknown => Decision::Hold,
                Named::Theirs => Decision::Pass,
            };
            call["function"]["name"] = json!(full);
        }
        if let Some(args) = str_at(tc, "/function/arguments") {
            append_text(&mut call["function"]["arguments"], args);
        }
    }
    if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
        g.value["choices"][0]["finish_reason"] = reason.clone();
        if now == Decision::Hold {
            now = Decision::Pass;
        }
    }
    now
}

pub(super) fn filter(f: &mut Filter, data: &mut Value) -> Edit {
    let mut changed = f.usage(data.get_mut("usage"));
    // A later round's chunks carry the first round's id.
    match (&f.first_id, data.get_mut("id")) {
        (None, Some(id)) => f.first_id = Some(id.clone()),
        (Some(first), Some(id)) if f.round > 0 && id != first => {
            *id = first.clone();
            changed = true;
        }
        _ => {}
    }
    let mut empty = false;
    let mut ends = false;
    if data
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
    {
        // The usage-only chunk comes after the one that ends the answer.
        ends = data.get("usage").is_some_and(Value::is_object);
    }
    if let Some(choice) = data.pointer_mut("/choices/0") {
        if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
            if f.round > 0 && delta.remove("role").is_some() {
                changed = true;
                empty = delta.is_empty();
            }
            if let Some(Value::String(text)) = delta.get_mut("content")
                && !text.is_empty()
            {
                // A later round's text is set apart from the text before.
                if f.apart {
                    text.insert_str(0, "\n\n");
                    f.apart = false;
                    changed = true;
                }
                f.texted = true;
                empty = false;
            }
        }
        if let Some(calls) = choice
            .pointer_mut("/delta/tool_calls")
            .and_then(Value::as_array_mut)
        {
            for tc in calls.iter() {
                let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                if let Some(piece) = str_at(tc, "/function/name") {
                    let full = match f.names.iter_mut().find(|(at, _)| *at == i) {
                        Some((_, n)) => {
                            n.push_str(piece);
                            n.clone()
                        }
                        None => {
                            f.names.push((i, piece.to_string()));
                            piece.to_string()
                        }
                    };
                    // A client that replaces the name with each piece
                    // would see the piece itself.
                    let named = match is_own_tool(piece) {
                        true => Named::Ours,
                        false => named(&full, &f.client_tools),
                    };
                    match named {
                        Named::Ours if !f.dropped.contains(&i) => {
                            f.dropped.push(i);
                            f.stripped += 1;
                        }
                        Named::Ours => {}
                        Named::Unknown | Named::Theirs => f.client_calls = true,
                    }
                }
            }
            let before = calls.len();
            calls.retain(|tc| {
                let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                !f.dropped.contains(&i)
            });
            changed |= calls.len() != before;
            // An entry that is not an object (an upstream's malformed
            // chunk) is passed on as it came.
            for tc in calls.iter_mut().filter_map(Value::as_object_mut) {
                let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                let s = f.shifted(i);
                if s != i {
                    tc.insert("index".to_string(), json!(s));
                    changed = true;
                }
            }
            if calls.is_empty()
                && let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut)
            {
                delta.remove("tool_calls");
                empty = delta.keys().all(|k| k == "role");
            }
        }
        match choice.get("finish_reason").and_then(Value::as_str) {
            // Only condense's calls were made: the turn is done.
            Some("tool_calls") if !f.client_calls && !f.dropped.is_empty() => {
                choice["finish_reason"] = json!("stop");
                changed = true;
            }
            // A call of the client's went out in a round before: the
            // client is to run it.
            Some("stop") if f.client_calls => {
                choice["finish_reason"] = json!("tool_calls");
                changed = true;
            }
            _ => {}
        }
        if choice.get("finish_reason").is_some_and(|r| !r.is_null()) {
            ends = true;
        } else if empty {
            return Edit::Drop;
        }
    }
    if ends {
        return f.end(changed);
    }
    if changed { Edit::Changed } else { Edit::Keep }
}
