//! Building view messages: the chat-shaped messages a format shows the
//! pipeline, written straight into bytes of their own length.

use bytes::Bytes;

/// The text of a chat message's `content`, or of a content value itself: a
/// string, or the text of its parts.
pub(crate) fn text_of(v: &serde_json::Value) -> String {
    use serde_json::Value;
    let content = match v {
        Value::Object(o) => o.get("content").unwrap_or(&Value::Null),
        other => other,
    };
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// `bytes` as `Bytes` in an allocation of their length: `Bytes::from` keeps
/// a vector's spare capacity, up to as much again as it holds when it grew
/// by doubling, for as long as the view lives (a view message each).
pub(crate) fn exact(mut bytes: Vec<u8>) -> Bytes {
    bytes.shrink_to_fit();
    Bytes::from(bytes)
}

/// Writes the `tool_calls` of an assistant view message being written into
/// `out` (after its other fields, before its closing brace), one call at a
/// time: (id, name, arguments as a JSON string's contents). Nothing is
/// written when there are none.
pub(crate) fn write_tool_calls(
    out: &mut Vec<u8>,
    calls: impl Iterator<Item = (String, String, String)>,
) {
    let mut written = 0;
    for (id, name, arguments) in calls {
        out.extend_from_slice(if written == 0 {
            b",\"tool_calls\":["
        } else {
            b","
        });
        let call = serde_json::json!({"id": id, "type": "function",
            "function": {"name": name, "arguments": arguments}});
        // Writing a value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, &call);
        written += 1;
    }
    if written > 0 {
        out.push(b']');
    }
}

/// A view message from its value, in an allocation of its length.
pub(crate) fn view_bytes(v: &serde_json::Value) -> Bytes {
    exact(serde_json::to_vec(v).unwrap_or_default())
}

/// A chat message of `role` with `text` as its content, in the bytes
/// `json!({"role": role, "content": text})` gives, without a copy of the
/// text in a value first.
pub(crate) fn chat_text(role: &str, text: &str) -> Bytes {
    let mut out = Vec::with_capacity(text.len() + role.len() + 24);
    out.extend_from_slice(b"{\"content\":");
    crate::chat::object::write_json_string(&mut out, text);
    out.extend_from_slice(b",\"role\":");
    crate::chat::object::write_json_string(&mut out, role);
    out.push(b'}');
    exact(out)
}

/// A JSON array of raw values.
pub(crate) fn raw_list<'a>(raws: impl Iterator<Item = &'a Bytes>) -> Bytes {
    let mut out = vec![b'['];
    for (i, r) in raws.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(r);
    }
    out.push(b']');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_message_is_written_as_its_value_would_be() {
        for (role, text) in [
            ("user", "hi"),
            ("assistant", ""),
            ("system", "quote \" backslash \\ line\n tab\t nul\u{0} é 🎉"),
        ] {
            let value = serde_json::json!({"role": role, "content": text});
            assert_eq!(
                chat_text(role, text),
                value.to_string().as_bytes(),
                "{text:?}"
            );
        }
    }
}
