//! `mask`: old tool output (tool results, and observations: see
//! `conversation.rs`) replaced by an extractive placeholder, and long
//! tool-call arguments of the same old turns shortened, or, for an agent
//! that acts in text, the long action its message ends with.
//!
//! Applies below the frontier that `plan.rs` replays (one boundary for both,
//! so only one boundary ever moves). Only consumed results are masked (the
//! frontier never passes the last assistant message), assistant text other
//! than an action is never touched, and a message already rewritten by
//! condense is left as it is. Both transforms depend on the message alone,
//! so a masked message is byte-identical on every later turn.

use bytes::Bytes;
use serde_json::Value;

use super::conversation::{Analysis, Role, action_start};
use super::extract::{
    LABEL_CHARS, key_lines, names_left_out, placeholder, placeholder_size, push_labelled,
};
use super::plan::Plan;
use super::text::{
    MARK, ceil_boundary, content_text, floor_boundary, head_tail, with_raw_field, with_string_field,
};
use super::{Counter, Work};
use crate::chat::Message;
use crate::chat::object::{elements, member_value, members, write_json_string};

/// Tool-call arguments longer than this are shortened below the frontier.
const ARGS_MAX_CHARS: usize = 600;
/// A string inside arguments longer than this is cut to its head and tail.
const ARG_VALUE_MAX_CHARS: usize = 300;
/// The least such a string keeps; a longer one keeps what a tool result
/// of its size does ([`placeholder_size`]).
///
/// At a flat 200 characters, a 13 KB file a Claude Code session wrote
/// kept a line of its docstring, one definition and a `print`, and the
/// method the session called by name ninety turns on was gone from turn
/// 14. Scaled as results are, with the names of [`extractive_cut`], on all
/// the shared traces (natives included) mean retention went from 0.883 to
/// 0.890 at 16k (chars:3.6) and 0.859 to 0.866 (chars:3.0), 0.949 to
/// 0.953 and 0.942 to 0.946 at 32k, 0.986 to 0.986 and 0.979 to 0.985 at
/// 64k; retention of what the agent used again rose most (0.965 to 0.976
/// at 32k chars:3.6). Mean stability moved by 0.002 at most (32k chars:3.0
/// down). A Claude Code session that writes its Vue components lost 0.015
/// retention at 32k, and a Codex session 0.052 at 64k chars:3.6 (its
/// stability rose 0.015: it compacted at other turns); half the scale kept
/// no more than the flat size.
const ARG_VALUE_KEEP_CHARS: usize = 200;
/// What an action longer than [`ARGS_MAX_CHARS`] in an assistant message's
/// text is cut to.
const ACTION_KEEP_CHARS: usize = 400;

/// The masked form of message `i`, if masking would change it.
pub fn masked(
    a: &Analysis,
    messages: &[Message],
    i: usize,
    placeholder_chars: usize,
    recall: bool,
) -> Option<Bytes> {
    let m = &messages[i];
    match a.roles[i] {
        _ if a.output(i) => {
            let text = content_text(m.content())?;
            // Short results cost little and often hold exactly the line
            // that matters; masking them would save little and lose it.
            if text.starts_with(MARK) || text.len() <= placeholder_chars * 3 {
                return None;
            }
            // A recall key takes the place of some key lines, so that a
            // placeholder costs what it did without one.
            let scaled = placeholder_size(placeholder_chars, text.len());
            let keep = match recall {
                true => scaled.saturating_sub(super::keys::TAG_CHARS),
                false => scaled,
            };
            with_string_field(m.raw(), "content", &placeholder(&text, keep))
        }
        Role::Assistant => {
            // A file the agent wrote keeps as much as one it read.
            let keep =
                |len: usize| placeholder_size(placeholder_chars, len).max(ARG_VALUE_KEEP_CHARS);
            shorten_args(m, ARGS_MAX_CHARS, ARG_VALUE_MAX_CHARS, &keep)
                .or_else(|| shorten_action(m, ARGS_MAX_CHARS, ACTION_KEEP_CHARS))
        }
        _ => None,
    }
}

/// The assistant message with the action its text ends with (see
/// [`action_start`]) cut to about `keep` characters, if that action is longer
/// than `max_chars`: a text-mode agent's equivalent of its tool-call
/// arguments (a file written through a heredoc, an edit command with the new
/// code). The words before the action stay byte-identical.
pub fn shorten_action(m: &Message, max_chars: usize, keep: usize) -> Option<Bytes> {
    let start = action_start(m)?;
    let Some(Value::String(text)) = m.content() else {
        return None;
    };
    let action = &text[start..];
    if action.len() <= max_chars || action.contains(MARK) {
        return None;
    }
    let short = extractive_cut(action, keep);
    if short.len() >= action.len() {
        return None;
    }
    with_string_field(m.raw(), "content", &format!("{}{short}", &text[..start]))
}

/// The length of the longest string `fit` may cut in an assistant message:
/// a tool call's arguments, or the action its text ends with.
pub fn action_chars(m: &Message) -> usize {
    let text = match (action_start(m), m.content()) {
        (Some(start), Some(Value::String(t))) => t.len() - start,
        _ => 0,
    };
    args_chars(m).max(text)
}

/// The length of the longest tool-call arguments string of a message.
pub fn args_chars(m: &Message) -> usize {
    m.tool_calls()
        .filter_map(|c| Some(c.pointer("/function/arguments")?.as_str()?.len()))
        .max()
        .unwrap_or(0)
}

/// The assistant message with every tool-call arguments string longer than
/// `max_chars` shortened: long string values inside the JSON cut to
/// `keep` characters (the arguments stay valid JSON, which gateways that
/// translate tool calls for other providers require), or, for arguments that
/// are not JSON, the whole string cut. Only the arguments strings change:
/// every call and its `function` keep the client's bytes and key order.
pub fn shorten_args(
    m: &Message,
    max_chars: usize,
    value_max: usize,
    keep: &dyn Fn(usize) -> usize,
) -> Option<Bytes> {
    // Most messages have no long arguments: nothing is written for them.
    if args_chars(m) <= max_chars {
        return None;
    }
    let raw_calls = raw_member(m.raw(), "tool_calls")?;
    let mut calls = Vec::new();
    elements(raw_calls, |c| calls.push(c))?;
    let mut changed = false;
    let mut out = Vec::with_capacity(raw_calls.len());
    out.push(b'[');
    for (i, call) in calls.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        match shorten_call(call, max_chars, value_max, keep) {
            Some(short) => {
                changed = true;
                out.extend_from_slice(&short);
            }
            None => out.extend_from_slice(call),
        }
    }
    out.push(b']');
    if !changed {
        return None;
    }
    with_raw_field(m.raw(), "tool_calls", Bytes::from(out))
}

/// One call (its exact bytes) with its arguments shortened; None when they
/// are short enough (or the call is not as expected).
fn shorten_call(
    call: &[u8],
    max_chars: usize,
    value_max: usize,
    keep: &dyn Fn(usize) -> usize,
) -> Option<Bytes> {
    let function = raw_member(call, "function")?;
    let args: String = member_value(function, "arguments")?;
    if args.len() <= max_chars {
        return None;
    }
    // Valid JSON (nested no deeper than serde_json reads) is shortened
    // member by member, in its order.
    let short = match serde_json::from_str::<serde::de::IgnoredAny>(&args) {
        Ok(_) => {
            let mut out = Vec::with_capacity(args.len().min(max_chars * 2));
            shorten_strings(args.as_bytes(), value_max, keep, &mut out)
                .and_then(|()| String::from_utf8(out).ok())
                .unwrap_or_else(|| head_tail(&args, keep(args.len())))
        }
        Err(_) => head_tail(&args, keep(args.len())),
    };
    if short.len() >= args.len() {
        return None;
    }
    let function = with_string_field(function, "arguments", &short)?;
    with_raw_field(call, "function", function)
}

/// The exact bytes of the last `key` member of the object `raw`.
fn raw_member<'a>(raw: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let mut found = None;
    members(raw, |k, v| {
        if k == key {
            found = Some(v);
        }
    })?;
    found
}

/// The JSON value `raw` written to `out` compactly, each string longer than
/// `max` cut to about `keep` characters; keys keep their order. `raw` must
/// be valid JSON.
fn shorten_strings(
    raw: &[u8],
    max: usize,
    keep: &dyn Fn(usize) -> usize,
    out: &mut Vec<u8>,
) -> Option<()> {
    let raw = raw.trim_ascii();
    match raw.first()? {
        b'{' => {
            let mut entries = Vec::new();
            members(raw, |k, v| entries.push((k.to_string(), v)))?;
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json_string(out, &k);
                out.push(b':');
                shorten_strings(v, max, keep, out)?;
            }
            out.push(b'}');
        }
        b'[' => {
            let mut items = Vec::new();
            elements(raw, |v| items.push(v))?;
            out.push(b'[');
            for (i, v) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                shorten_strings(v, max, keep, out)?;
            }
            out.push(b']');
        }
        b'"' if raw.len() > max => {
            let s: String = serde_json::from_slice(raw).ok()?;
            match s.len() > max {
                true => write_json_string(out, &extractive_cut(&s, keep(s.len()))),
                false => out.extend_from_slice(raw),
            }
        }
        _ => out.extend_from_slice(raw),
    }
    Some(())
}

/// A long string (typically code an agent wrote) cut to about `keep`
/// characters: its head and tail, with the definitions and error lines of
/// the middle kept between them, and (for source code) the names the
/// middle defines that none of these holds, as a placeholder gives them.
///
/// A file the agent wrote is one it reads, runs and edits again. On all the
/// shared traces, with the scaled sizes of `ARG_VALUE_KEEP_CHARS`, the
/// names took mean retention from 0.887 to 0.890 at 16k (chars:3.6) and
/// 0.864 to 0.866 (chars:3.0), 0.951 to 0.953 and 0.944 to 0.946 at 32k;
/// retention of what the agent used again from 0.971 to 0.976 at 32k
/// (chars:3.6); stability even but for 16k chars:3.6 (0.839 to 0.842).
pub fn extractive_cut(s: &str, keep: usize) -> String {
    if s.len() <= keep || s.contains(MARK) || !s.contains('\n') {
        return head_tail(s, keep);
    }
    // The head gives up an eighth of it; in source code that lists the
    // names the middle defines that nothing kept names (`names_left_out`).
    // Given up only by source code, the cuts of other strings kept more,
    // and mean stability at 16k (chars:3.6) fell from 0.842 to 0.839.
    let for_names = keep / 8;
    let head = floor_boundary(s, keep / 3 - for_names);
    let tail = ceil_boundary(s, s.len() - keep / 6);
    if tail <= head {
        return head_tail(s, keep);
    }
    let (head, middle, tail) = (&s[..head], &s[head..tail], &s[tail..]);
    let mut kept = key_lines(middle, keep / 2);
    let held = format!("{head}\n{kept}\n{tail}");
    let names = names_left_out(middle, &held, for_names.saturating_sub(LABEL_CHARS));
    push_labelled(&mut kept, "names", &names);
    let chars = middle.chars().count();
    if kept.is_empty() {
        format!("{head}\n{MARK} {chars} chars elided]\n{tail}")
    } else {
        format!(
            "{head}\n{MARK} {chars} chars elided; key lines kept:]\n{kept}\n{MARK} end]\n{tail}"
        )
    }
}

/// Replaces every message below the plan's frontier (and the large ones it
/// masks ahead of it) with its masked form; messages with epistemic markers
/// only when the request is still at `trigger` (tokens) without them.
pub(super) fn run(
    w: &mut Work,
    a: &Analysis,
    plan: &Plan,
    masked: &[Option<Bytes>],
    trigger: f64,
    counter: &dyn Counter,
) {
    let n = w.cost.len();
    for markers in [false, true] {
        if markers && (w.total() as f64) < trigger {
            break;
        }
        let (mut count, mut saved) = (0, 0);
        let ahead = (plan.frontier..n).filter(|&i| plan.ahead[i]);
        for i in (a.base..plan.frontier.min(n)).chain(ahead) {
            if w.dropped[i] || a.marker[i] != markers {
                continue;
            }
            if let Some(b) = masked[i].clone() {
                let sv = w.replace(i, b, counter);
                if sv > 0 {
                    count += 1;
                    saved += sv;
                }
            }
        }
        w.record("mask", count, saved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(s: &str) -> Message {
        Message::from_bytes(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn a_file_the_agent_wrote_keeps_what_a_file_it_read_would_and_names_the_rest() {
        // A 13 KB module written whole: 40 methods among filler.
        let mut file = String::from("\"\"\"A dataset.\"\"\"\nimport math\n\nclass Songs:\n");
        for i in 0..40 {
            file.push_str(&format!("    def _load_{i:02}(self, root):\n"));
            for _ in 0..6 {
                file.push_str("        value = value + compute_something(root)  # filler\n");
            }
        }
        let args = serde_json::json!({"file_path": "/w/songs.py", "content": file}).to_string();
        let call = serde_json::json!({"role": "assistant", "content": "Writing it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "write", "arguments": args}}]});
        let result = r#"{"role":"tool","tool_call_id":"c1","content":"File written."}"#;
        let answer = r#"{"role":"assistant","content":"Done."}"#;
        let messages = vec![msg(&call.to_string()), msg(result), msg(answer)];
        let a = super::super::conversation::Analysis::of(&messages);
        let out = masked(&a, &messages, 0, 300, false).unwrap();
        let m: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let args = m["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        let content = serde_json::from_str::<serde_json::Value>(args).unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string();
        let named: std::collections::HashSet<&str> = content
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("_load_"))
            .collect();
        // At a flat 200 characters it named 4 of them.
        assert!(named.len() >= 15, "{}: {content}", named.len());
        let names = content.lines().find(|l| l.starts_with("names: ")).unwrap();
        // The list gives only what the lines above it do not.
        for n in names["names: ".len()..].split(", ") {
            assert_eq!(content.matches(n).count(), 1, "{n}: {content}");
        }
        assert!(out.len() < 1500, "{}", out.len());
    }

    #[test]
    fn a_whole_file_keeps_more_of_its_definitions_than_a_short_output() {
        // A 25 KB source file read whole: 60 definitions among filler.
        let mut file = String::new();
        for i in 0..60 {
            file.push_str(&format!("def step_{i:02}(x):\n"));
            for _ in 0..8 {
                file.push_str("    value = value + compute_something(x)  # filler\n");
            }
        }
        let call = r#"{"role":"assistant","content":"Reading it.","tool_calls":[{"id":"c1","type":"function","function":{"name":"read","arguments":"{}"}}]}"#;
        let result = serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": file});
        let answer = r#"{"role":"assistant","content":"Done."}"#;
        let messages = vec![msg(call), msg(&result.to_string()), msg(answer)];
        let a = super::super::conversation::Analysis::of(&messages);
        let out = masked(&a, &messages, 1, 300, false).unwrap();
        let kept = String::from_utf8_lossy(&out).matches("def step_").count();
        // A flat 300 characters kept 18 of them.
        assert!(kept >= 40, "{kept}: {}", String::from_utf8_lossy(&out));
        assert!(out.len() < 2000, "{}", out.len());
        assert!(
            super::placeholder_size(300, 500) < 300 && super::placeholder_size(300, 1 << 20) == 900
        );
    }

    #[test]
    fn long_arguments_stay_valid_json_and_keep_short_fields() {
        let text = "x".repeat(5000);
        let args =
            serde_json::json!({"command": "create", "path": "/repo/a.py", "file_text": text})
                .to_string();
        let raw = serde_json::json!({"role": "assistant", "content": "Creating it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "edit", "arguments": args}}]});
        let m = msg(&raw.to_string());
        let out = shorten_args(&m, 600, 300, &|_| 200).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        let new_args: Value = serde_json::from_str(
            v["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(new_args["path"], "/repo/a.py");
        assert!(
            new_args["file_text"]
                .as_str()
                .unwrap()
                .contains("[condense:")
        );
        assert_eq!(v["content"], "Creating it.");
        // Idempotent.
        assert!(
            shorten_args(&msg(std::str::from_utf8(&out).unwrap()), 600, 300, &|_| 200).is_none()
        );
    }

    #[test]
    fn shortened_calls_keep_the_clients_bytes_and_key_order() {
        let text = "y".repeat(5000);
        // Keys in an order no sorting gives, a short call left as it is.
        let args = format!(
            "{{\"path\":\"/repo/a.py\",\"file_text\":\"{text}\",\"mode\":[\"w\",{{\"z\":1,\"a\":2}}]}}"
        );
        let long = format!(
            "{{\"type\":\"function\",\"id\":\"c1\",\"function\":{{\"name\":\"edit\",\"arguments\":{}}}}}",
            serde_json::to_string(&args).unwrap()
        );
        let short =
            r#"{"type": "function", "id": "c2", "function": {"name": "ls", "arguments": "{}"}}"#;
        let raw = format!(r#"{{"role":"assistant","content":null,"tool_calls":[{long},{short}]}}"#);
        let out = shorten_args(&msg(&raw), 600, 300, &|_| 200).unwrap();
        let out = std::str::from_utf8(&out).unwrap();
        assert!(
            out.starts_with(r#"{"role":"assistant","content":null,"tool_calls":[{"type":"function","id":"c1","function":{"name":"edit","arguments":"{\"path\":\"/repo/a.py\",\"file_text\":"#),
            "{out}"
        );
        assert!(
            out.contains(r#",\"mode\":[\"w\",{\"z\":1,\"a\":2}]}"}}"#),
            "{out}"
        );
        assert!(out.ends_with(&format!(",{short}]}}")), "{out}");
        let v: Value = serde_json::from_str(out).unwrap();
        let args = v["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        assert!(serde_json::from_str::<Value>(args).is_ok());
        assert!(args.len() < 1000);
    }

    #[test]
    fn a_cut_lists_key_lines_only_when_it_kept_some() {
        let code = format!(
            "import os\n{}def handler(request):\n{}    return None\n",
            "x = 1\n".repeat(100),
            "    y = 2\n".repeat(100)
        );
        let cut = extractive_cut(&code, 300);
        assert!(cut.starts_with("import os\n") && cut.ends_with("return None\n"));
        assert!(
            cut.contains("chars elided; key lines kept:]\ndef handler(request):\n[condense: end]"),
            "{cut}"
        );
        let filler = "x = 1\n".repeat(300);
        let cut = extractive_cut(&filler, 300);
        assert!(cut.contains("\n[condense: 1687 chars elided]\n"), "{cut}");
        assert!(!cut.contains("key lines") && !cut.contains("end]"), "{cut}");
    }
}
