//! Anthropic Messages streams: usage read from `message_start` and
//! `message_delta` (nothing is stripped: Anthropic always reports usage),
//! and condense's tools in a streamed answer.

use std::sync::LazyLock;

use bytes::BytesMut;
use memchr::memmem::Finder;
use serde_json::{Value, json};

use super::usage::{AnthropicUsage, usage};
use crate::wire::sse::data_of;
use crate::wire::stream::{Decision, Edit, Filter, Gather, append_text, ours, str_at};
use crate::wire::tap::{SseTap, member};
use crate::wire::usage::Usage;

struct Needles {
    usage: Finder<'static>,
    message_stop: Finder<'static>,
}

fn needles() -> &'static Needles {
    static NEEDLES: LazyLock<Needles> = LazyLock::new(|| Needles {
        usage: Finder::new(b"\"usage\""),
        message_stop: Finder::new(b"message_stop"),
    });
    &NEEDLES
}

/// Reads one event of a Messages stream.
pub(super) fn tap_event(tap: &mut SseTap, event: &[u8], _out: &mut BytesMut) {
    if needles().message_stop.find(event).is_some() {
        tap.done = true;
    }
    if needles().usage.find(event).is_some()
        && let Some(data) = data_of(event)
        && let Some(u) = event_usage(&data, tap.usage)
    {
        tap.usage = Some(u);
    }
}

/// A streamed event's usage, from its data: `message_start` carries the
/// prompt's in its message, `message_delta` the completion's (and, from
/// some servers, the prompt's again); `seen` is what came before.
fn event_usage(data: &[u8], seen: Option<Usage>) -> Option<Usage> {
    if let Some(message) = member(data, "message").flatten() {
        return usage(member(message, "usage").flatten()?);
    }
    let u: AnthropicUsage = serde_json::from_slice(member(data, "usage").flatten()?).ok()?;
    let before = seen.unwrap_or_default();
    let prompt = u.prompt().unwrap_or(before.prompt_tokens);
    let completion = u.output_tokens.unwrap_or(before.completion_tokens);
    Some(Usage::of(prompt, completion))
}

pub(super) fn gather(g: &mut Gather, data: &Value) -> Decision {
    let index = data
        .get("index")
        .and_then(Value::as_u64)
        .map(|i| i as usize);
    match data.get("type").and_then(Value::as_str) {
        Some("message_start") => {
            g.value = data
                .get("message")
                .filter(|m| m.is_object())
                .cloned()
                .unwrap_or(json!({}));
            if !g.value["content"].is_array() {
                g.value["content"] = json!([]);
            }
            Decision::Hold
        }
        Some("content_block_start") => {
            let mut block = data.get("content_block").cloned().unwrap_or(json!({}));
            let kind = str_at(&block, "/type").unwrap_or("").to_string();
            let now = match kind.as_str() {
                "tool_use" if ours(str_at(&block, "/name")) => Decision::Ours,
                "thinking" | "redacted_thinking" => Decision::Hold,
                _ => Decision::Pass,
            };
            if kind == "tool_use" {
                block["input"] = json!({});
                g.partial.push((index.unwrap_or(0), String::new()));
            }
            if let Some(content) = g.value.get_mut("content").and_then(Value::as_array_mut) {
                content.push(block);
            }
            now
        }
        Some("content_block_delta") => {
            let delta = data.get("delta").unwrap_or(&Value::Null);
            let at = index.unwrap_or(0);
            match str_at(delta, "/type") {
                Some("input_json_delta") => {
                    if let Some((_, p)) = g.partial.iter_mut().find(|(i, _)| *i == at) {
                        p.push_str(str_at(delta, "/partial_json").unwrap_or(""));
                    }
                }
                Some(kind) => {
                    let field = match kind {
                        "text_delta" => "text",
                        "thinking_delta" => "thinking",
                        "signature_delta" => "signature",
                        _ => return Decision::Hold,
                    };
                    if let Some(block) = g
                        .value
                        .pointer_mut(&format!("/content/{at}"))
                        .filter(|b| b.is_object())
                    {
                        let piece = str_at(delta, &format!("/{field}")).unwrap_or("");
                        append_text(&mut block[field], piece);
                    }
                }
                None => {}
            }
            Decision::Hold
        }
        Some("content_block_stop") => {
            let at = index.unwrap_or(0);
            if let Some((_, p)) = g.partial.iter().find(|(i, _)| *i == at)
                && let Ok(input) = serde_json::from_str::<Value>(p)
                && let Some(block) = g
                    .value
                    .pointer_mut(&format!("/content/{at}"))
                    .filter(|b| b.is_object())
            {
                block["input"] = input;
            }
            Decision::Hold
        }
        Some("message_delta") => {
            if !g.value.is_object() {
                g.value = json!({"content": []});
            }
            if let Some(d) = data.get("delta").and_then(Value::as_object) {
                for (k, v) in d {
                    g.value[k] = v.clone();
                }
            }
            if let Some(Value::Object(u)) = data.get("usage") {
                if !g.value["usage"].is_object() {
                    g.value["usage"] = json!({});
                }
                for (k, v) in u {
                    g.value["usage"][k] = v.clone();
                }
            }
            Decision::Hold
        }
        Some("message_stop" | "error") => Decision::Pass,
        _ => Decision::Hold,
    }
}

pub(super) fn filter(f: &mut Filter, data: &mut Value) -> Edit {
    let kind = data.get("type").and_then(Value::as_str).unwrap_or("");
    let index = data.get("index").and_then(Value::as_u64);
    if str_at(data, "/content_block/type") == Some("tool_use") {
        if ours(str_at(data, "/content_block/name")) {
            f.drop(index);
            return Edit::Drop;
        }
        if kind == "content_block_start" {
            f.client_calls = true;
        }
    }
    match kind {
        // A later round's start is not shown: its usage goes to its end.
        "message_start" if f.round > 0 => {
            f.start_usage = data.pointer("/message/usage").cloned();
            Edit::Drop
        }
        "message_start" => match f.usage(data.pointer_mut("/message/usage")) {
            true => Edit::Changed,
            false => Edit::Keep,
        },
        "message_delta" => {
            let mut changed = false;
            // The usage of the round's start that its end does not repeat
            // (the end's numbers are the whole message's).
            if let Some(Value::Object(start)) = f.start_usage.take() {
                if !data.get("usage").is_some_and(Value::is_object) {
                    data["usage"] = json!({});
                }
                if let Some(usage) = data.get_mut("usage").and_then(Value::as_object_mut) {
                    for (k, v) in start {
                        if v.is_number() && !usage.contains_key(&k) {
                            usage.insert(k, v);
                            changed = true;
                        }
                    }
                }
            }
            changed |= f.usage(data.get_mut("usage"));
            match str_at(data, "/delta/stop_reason") {
                // Only condense's calls were made: the turn is done.
                Some("tool_use") if !f.client_calls && !f.dropped.is_empty() => {
                    data["delta"]["stop_reason"] = json!("end_turn");
                    changed = true;
                }
                // A call of the client's went out in a round before.
                Some("end_turn") if f.client_calls => {
                    data["delta"]["stop_reason"] = json!("tool_use");
                    changed = true;
                }
                _ => {}
            }
            f.end(changed)
        }
        "message_stop" => f.end(false),
        _ => f.reindex(data, "index", index),
    }
}
