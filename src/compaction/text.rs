//! Text helpers shared by the stages: reading a message's text, writing a
//! message back with new text (every other field byte-identical), and
//! head+tail truncation that never splits a character.

use std::borrow::Cow;

use bytes::Bytes;
use serde_json::Value;

use crate::chat::RawObject;
use crate::chat::object::{members, write_json_string};

/// The marker every text condense writes starts with, so a later pass (and
/// an idempotent second compaction) recognises its own work.
pub const MARK: &str = "[condense:";

/// A message's text content: the string (borrowed: a message's text may
/// be megabytes, and most callers only read it), or its text parts joined.
pub fn content_text(content: Option<&Value>) -> Option<Cow<'_, str>> {
    match content? {
        Value::String(s) => Some(Cow::Borrowed(s)),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            (!texts.is_empty()).then(|| Cow::Owned(texts.join("\n")))
        }
        _ => None,
    }
}

/// Everything a message says in text: its content and the arguments of its
/// tool calls, one per line.
pub fn message_text(m: &crate::chat::Message) -> String {
    let mut text = content_text(m.content())
        .map(Cow::into_owned)
        .unwrap_or_default();
    for call in m.tool_calls() {
        if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str) {
            text.push('\n');
            text.push_str(args);
        }
    }
    text
}

/// The message `raw` with `key` set to the JSON string `text`; other fields
/// keep their bytes and order.
pub fn with_string_field(raw: &[u8], key: &str, text: &str) -> Option<Bytes> {
    let mut value = Vec::with_capacity(text.len() + 2);
    write_json_string(&mut value, text);
    with_raw_field(raw, key, Bytes::from(value))
}

/// The message `raw` with `key` set to `value`, which must be valid JSON;
/// other fields keep their bytes and order. Written from the members of
/// `raw` as they are read, without a copy of it (a message may be
/// megabytes): the bytes a `RawObject` parsed from it would write.
pub fn with_raw_field(raw: &[u8], key: &str, value: Bytes) -> Option<Bytes> {
    let mut entries: Vec<(String, &[u8])> = Vec::new();
    if members(raw, |k, v| entries.push((k.to_string(), v))).is_none() {
        let mut obj = RawObject::parse(&Bytes::copy_from_slice(raw)).ok()?;
        obj.set(key, value);
        return Some(Bytes::from(obj.to_vec()));
    }
    // As `RawObject::set`: the last occurrence of the key, else appended.
    let at = entries.iter().rposition(|(k, _)| k == key);
    // Room for the result, not for both values: the result is kept, with
    // whatever room it was given, for as long as the request is.
    let replaced = at.map_or(0, |i| entries[i].1.len());
    let mut out = Vec::with_capacity(raw.len() - replaced + value.len() + key.len() + 8);
    out.push(b'{');
    let put = |out: &mut Vec<u8>, k: &str, v: &[u8]| {
        if out.len() > 1 {
            out.push(b',');
        }
        write_json_string(out, k);
        out.push(b':');
        out.extend_from_slice(v);
    };
    for (i, (k, v)) in entries.iter().enumerate() {
        put(&mut out, k, if at == Some(i) { &value } else { v });
    }
    if at.is_none() {
        put(&mut out, key, &value);
    }
    out.push(b'}');
    out.shrink_to_fit();
    Some(Bytes::from(out))
}

/// The largest char boundary at or below `i`.
pub fn floor_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The smallest char boundary at or above `i`.
pub fn ceil_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// `s` cut to about `keep` bytes: its head and tail with a marker saying how
/// much was elided between them. Text already short enough, or already cut
/// by condense, comes back as is (so a second compaction changes nothing).
pub fn head_tail(s: &str, keep: usize) -> String {
    if s.len() <= keep || s.contains(MARK) {
        return s.to_string();
    }
    cut_middle(s, keep)
}

/// `s` cut to about `keep` bytes, its head and tail kept, whatever it
/// holds (see [`head_tail`] for text condense may have cut before).
pub fn cut_middle(s: &str, keep: usize) -> String {
    cut_middle_with(s, keep, MARK)
}

/// [`cut_middle`], its notice opening with `mark` (the marker, or the
/// marker with a recall key: see `keys::opening`).
pub fn cut_middle_with(s: &str, keep: usize, mark: &str) -> String {
    if s.len() <= keep {
        return s.to_string();
    }
    let head_len = floor_boundary(s, keep * 2 / 3);
    let tail_start = ceil_boundary(s, s.len() - (keep - keep * 2 / 3));
    let elided = &s[head_len..tail_start];
    format!(
        "{}\n{mark} {} chars, {} lines elided]\n{}",
        &s[..head_len],
        elided.chars().count(),
        elided.matches('\n').count(),
        &s[tail_start..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_tail_keeps_both_ends_and_char_boundaries() {
        let s = "é".repeat(1000);
        let out = head_tail(&s, 300);
        assert!(out.starts_with("éé") && out.ends_with("éé"));
        assert!(out.contains("[condense:"));
        assert!(out.len() < 400);
        assert_eq!(head_tail("short", 300), "short");
    }

    #[test]
    fn rewriting_keeps_other_fields() {
        let raw = br#"{"role":"tool","tool_call_id":"c1","content":"long","x-extra":{"a":1}}"#;
        let out = with_string_field(raw, "content", "short \"q\"").unwrap();
        assert_eq!(
            &out[..],
            br#"{"role":"tool","tool_call_id":"c1","content":"short \"q\"","x-extra":{"a":1}}"#
        );
    }

    #[test]
    fn a_field_is_set_as_a_raw_object_sets_it() {
        for (raw, key) in [
            (r#"{"role":"tool","content":"long","x":{"a":1}}"#, "content"),
            (r#"{ "role" : "tool" , "content" : [1, "}"] }"#, "content"),
            (r#"{"role":"user"}"#, "content"),
            (r#"{}"#, "content"),
            (
                r#"{"content":"a","content":"b","c\u006fntent":"c"}"#,
                "content",
            ),
            (r#"{"k\"ey":1,"tool_calls":[]}"#, "tool_calls"),
            (r#""not an object""#, "content"),
            (r#"[1]"#, "content"),
        ] {
            let value = Bytes::from_static(br#""new \"text\"""#);
            let expected = RawObject::parse(&Bytes::copy_from_slice(raw.as_bytes()))
                .ok()
                .map(|mut o| {
                    o.set(key, value.clone());
                    Bytes::from(o.to_vec())
                });
            assert_eq!(
                with_raw_field(raw.as_bytes(), key, value),
                expected,
                "{raw}"
            );
        }
    }

    #[test]
    fn text_of_parts() {
        let v: Value = serde_json::from_str(r#"[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]"#).unwrap();
        assert_eq!(content_text(Some(&v)).as_deref(), Some("a\nb"));
        assert_eq!(content_text(Some(&Value::Null)), None);
    }
}
