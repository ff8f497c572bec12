//! How many tokens a chat request costs, by the rules OpenAI documents in its
//! cookbook ("How to count tokens with tiktoken"), with condense's own
//! conventions where OpenAI documents none. A fixture computed with OpenAI's
//! own tokenizer (`tests/fixtures/tokens/`) checks these rules.
//!
//! - Request: 3 tokens priming the reply, plus every message, plus tool
//!   schemas.
//! - Message: 3 tokens, plus the tokens of every string field (`role`,
//!   `content`, `name`, `tool_call_id`, ...), plus 1 for a `name`.
//! - Multi-part `content`: text and refusal parts by their text, images by the
//!   tile rule (see `image.rs`), any other part (audio, file) by the tokens of
//!   its JSON, a stand-in that calibration corrects.
//! - Assistant tool calls (condense's convention): 3 tokens per call plus the
//!   function name and the arguments string; the legacy `function_call` the
//!   same without the 3.
//! - Tool schemas (the cookbook's rule for functions): per function 7 tokens
//!   (10 for cl100k models) plus `name:description`; when it has properties, 3
//!   plus, per property, 3 and `key:type:description` (enums: −3, then 3 and
//!   the item per value); 12 once for the whole list. Trailing periods of
//!   descriptions are dropped. Nested schemas (`properties`/`items` inside a
//!   property), which the cookbook ignores, add the tokens of their JSON.

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::{Map, Value};

use super::encoding::Encoding;
use super::image;
use crate::chat::object::{elements, members};

pub const PER_MESSAGE: u64 = 3;
pub const PER_NAME: u64 = 1;
pub const REPLY_PRIMING: u64 = 3;
pub const PER_TOOL_CALL: u64 = 3;

/// Tokens of one message given as JSON bytes. A message that is not a JSON
/// object costs the tokens of its text plus the per-message overhead.
///
/// The message is read field by field, and its content parts and tool
/// calls one at a time: parsed whole, a turn of 80,000 tool calls was a
/// hundred megabytes of maps. The count is what a parse would give.
pub fn message_tokens(enc: Encoding, raw: &[u8]) -> u64 {
    streamed_tokens(enc, raw).unwrap_or_else(|| parsed_tokens(enc, raw))
}

/// [`message_tokens`] from a parse of the whole message.
fn parsed_tokens(enc: Encoding, raw: &[u8]) -> u64 {
    match serde_json::from_slice::<Map<String, Value>>(raw) {
        Ok(obj) => object_tokens(enc, &obj),
        Err(_) => PER_MESSAGE + enc.count(&String::from_utf8_lossy(raw)),
    }
}

/// [`message_tokens`] field by field; None where the bytes are not an
/// object as `members` reads one (a parse then decides).
fn streamed_tokens(enc: Encoding, raw: &[u8]) -> Option<u64> {
    let mut fields: Vec<(String, &[u8])> = Vec::new();
    members(raw, |key, value| fields.push((key.to_string(), value)))?;
    // With a key twice the last counts, as in a parsed map.
    let last: HashMap<&str, usize> = fields
        .iter()
        .enumerate()
        .map(|(i, (k, _))| (k.as_str(), i))
        .collect();
    let mut n = PER_MESSAGE;
    for (i, (key, value)) in fields.iter().enumerate() {
        if last.get(key.as_str()) != Some(&i) {
            continue;
        }
        n += match (key.as_str(), value.first()) {
            (_, Some(b'"')) => {
                enc.count(&json_string(value)?) + if key == "name" { PER_NAME } else { 0 }
            }
            ("content", Some(b'[')) => each_tokens(value, |p| part_tokens(enc, p))?,
            ("tool_calls", Some(b'[')) => each_tokens(value, |c| tool_call_tokens(enc, c))?,
            ("function_call", Some(b'{')) => {
                function_tokens(enc, &serde_json::from_slice(value).ok()?)
            }
            _ => 0,
        };
    }
    Some(n)
}

/// The JSON string `raw` decoded: its own bytes when it has no escape (a
/// message's text may be megabytes), else a copy.
fn json_string(raw: &[u8]) -> Option<Cow<'_, str>> {
    match raw {
        [b'"', inner @ .., b'"'] if memchr::memchr(b'\\', inner).is_none() => {
            std::str::from_utf8(inner).ok().map(Cow::Borrowed)
        }
        _ => serde_json::from_slice::<String>(raw).ok().map(Cow::Owned),
    }
}

/// The sum of `tokens` over the elements of the array `raw`, each parsed
/// alone.
fn each_tokens(raw: &[u8], tokens: impl Fn(&Value) -> u64) -> Option<u64> {
    let mut sum = Some(0);
    elements(raw, |e| {
        sum = sum.and_then(|s| Some(s + tokens(&serde_json::from_slice(e).ok()?)));
    })?;
    sum
}

fn object_tokens(enc: Encoding, msg: &Map<String, Value>) -> u64 {
    let mut n = PER_MESSAGE;
    for (key, value) in msg {
        n += match (key.as_str(), value) {
            ("name", Value::String(s)) => enc.count(s) + PER_NAME,
            (_, Value::String(s)) => enc.count(s),
            ("content", Value::Array(parts)) => parts.iter().map(|p| part_tokens(enc, p)).sum(),
            ("tool_calls", Value::Array(calls)) => {
                calls.iter().map(|c| tool_call_tokens(enc, c)).sum()
            }
            ("function_call", Value::Object(f)) => function_tokens(enc, f),
            _ => 0,
        };
    }
    n
}

fn part_tokens(enc: Encoding, part: &Value) -> u64 {
    let text = |k: &str| part.get(k).and_then(Value::as_str);
    match part.get("type").and_then(Value::as_str) {
        Some("text") => text("text").map_or(0, |t| enc.count(t)),
        Some("refusal") => text("refusal").map_or(0, |t| enc.count(t)),
        Some("image_url") => {
            let img = part.get("image_url");
            let url = img
                .and_then(|i| i.get("url").and_then(Value::as_str).or_else(|| i.as_str()))
                .unwrap_or("");
            let detail = img.and_then(|i| i.get("detail")).and_then(Value::as_str);
            image::image_tokens(url, detail)
        }
        _ => match part {
            Value::String(s) => enc.count(s),
            other => enc.count(&other.to_string()),
        },
    }
}

fn function_tokens(enc: Encoding, f: &Map<String, Value>) -> u64 {
    let s = |k: &str| f.get(k).and_then(Value::as_str).map_or(0, |t| enc.count(t));
    s("name") + s("arguments")
}

fn tool_call_tokens(enc: Encoding, call: &Value) -> u64 {
    match call.get("function").and_then(Value::as_object) {
        Some(f) => PER_TOOL_CALL + function_tokens(enc, f),
        None => PER_TOOL_CALL + enc.count(&call.to_string()),
    }
}

/// Tokens of a `tools` (or legacy `functions`) array given as JSON bytes.
pub fn tools_tokens(enc: Encoding, raw: &[u8]) -> u64 {
    let Ok(tools) = serde_json::from_slice::<Vec<Value>>(raw) else {
        return enc.count(&String::from_utf8_lossy(raw));
    };
    if tools.is_empty() {
        return 0;
    }
    let func_init: i64 = if enc == Encoding::Cl100k { 10 } else { 7 };
    let (prop_init, prop_key, enum_init, enum_item, func_end) = (3i64, 3i64, -3i64, 3i64, 12i64);
    let count = |s: &str| enc.count(s) as i64;
    let mut total: i64 = 0;
    for tool in &tools {
        // `{"type":"function","function":{...}}`, or a legacy bare function.
        let Some(f) = tool
            .get("function")
            .or_else(|| tool.get("name").map(|_| tool))
        else {
            total += count(&tool.to_string());
            continue;
        };
        total += func_init;
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        let desc = f.get("description").and_then(Value::as_str).unwrap_or("");
        total += count(&format!(
            "{name}:{}",
            desc.strip_suffix('.').unwrap_or(desc)
        ));
        let props = f
            .get("parameters")
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        if let Some(props) = props.filter(|p| !p.is_empty()) {
            total += prop_init;
            for (key, p) in props {
                total += prop_key;
                if let Some(items) = p.get("enum").and_then(Value::as_array) {
                    total += enum_init;
                    for item in items {
                        total += enum_item;
                        total += match item {
                            Value::String(s) => count(s),
                            other => count(&other.to_string()),
                        };
                    }
                }
                let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                let d = p.get("description").and_then(Value::as_str).unwrap_or("");
                total += count(&format!("{key}:{ty}:{}", d.strip_suffix('.').unwrap_or(d)));
                for nested in ["properties", "items"] {
                    if let Some(v) = p.get(nested) {
                        total += count(&v.to_string());
                    }
                }
            }
        }
    }
    total += func_end;
    total.max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: Encoding = Encoding::O200k;

    #[test]
    fn message_overheads() {
        // 3 + "user"(1) + "hello world"(2)
        assert_eq!(
            message_tokens(E, br#"{"role":"user","content":"hello world"}"#),
            6
        );
        // + name "bob"(1) + 1
        assert_eq!(
            message_tokens(
                E,
                br#"{"role":"user","name":"bob","content":"hello world"}"#
            ),
            8
        );
        // null content costs nothing
        assert_eq!(
            message_tokens(E, br#"{"role":"assistant","content":null}"#),
            4
        );
    }

    #[test]
    fn parts_and_tool_calls() {
        let multi = br#"{"role":"user","content":[{"type":"text","text":"hello world"},{"type":"image_url","image_url":{"url":"https://x/a.png","detail":"low"}}]}"#;
        assert_eq!(message_tokens(E, multi), 3 + 1 + 2 + 85);
        let call = br#"{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"ls","arguments":"{}"}}]}"#;
        let expected = 3 + 1 + PER_TOOL_CALL + E.count("ls") + E.count("{}");
        assert_eq!(message_tokens(E, call), expected);
    }

    #[test]
    fn a_message_read_field_by_field_counts_as_parsed() {
        for m in [
            r#"{"role":"user","content":"hello world"}"#,
            r#"{"role":"user","name":"bob","content":"hello world"}"#,
            r#"{ "role" : "tool" , "tool_call_id" : "c\u0031", "content" : "a\n\"b\"\\" , "x" : [1, {"y": "}"}] }"#,
            r#"{"content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"https://x/a.png","detail":"low"}},{"type":"input_audio","input_audio":{"data":"QUJD"}},"bare",7],"name":"ann","role":"user"}"#,
            r#"{"r\u006fle":"user","content":"escaped key"}"#,
            r#"{"role":"user","role":"assistant","content":"twice"}"#,
            r#"{"role":"user","content":"a","content":["b"],"content":[{"type":"text","text":"c d"}]}"#,
            r#"{"role":null,"name":5,"tool_calls":{},"content":7}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"a","id":"b","function":{"name":"ls","arguments":"{\"p\":1}"}},7,{"id":5},{"type":"x"},{"function":"f"}]}"#,
            r#"{"role":"assistant","function_call":{"name":"f","arguments":"{}"},"function_call":{"name":"g h","arguments":"[1]"}}"#,
            r#"{"role":"assistant","function_call":"not an object"}"#,
            r#"{}"#,
            r#""a string""#,
            r#"[{"role":"user"}]"#,
            "not json at all",
        ] {
            assert_eq!(
                message_tokens(E, m.as_bytes()),
                parsed_tokens(E, m.as_bytes()),
                "{m}"
            );
        }
    }

    #[test]
    fn tools_follow_the_cookbook_shape() {
        assert_eq!(tools_tokens(E, b"[]"), 0);
        let t = br#"[{"type":"function","function":{"name":"get_weather","description":"Get weather.","parameters":{"type":"object","properties":{"city":{"type":"string","description":"City"},"unit":{"type":"string","enum":["c","f"]}}}}}]"#;
        let func = 7 + E.count("get_weather:Get weather");
        let city = 3 + E.count("city:string:City");
        // prop_key (3) and enum_init (-3) cancel out.
        let unit = (3 + E.count("c")) + (3 + E.count("f")) + E.count("unit:string:");
        let expected = func + 3 + city + unit + 12;
        assert_eq!(tools_tokens(E, t), expected);
    }
}
