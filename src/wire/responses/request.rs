//! OpenAI Responses (`/v1/responses`), stateless: the `input` item list
//! parsed without loss, shown to the pipeline as chat messages, and the
//! pipeline's decisions written back item by item.
//!
//! The view: `instructions` becomes a system message (counted, never
//! written back); a `message` item becomes a chat message of its role; a run
//! of an assistant `message` and the `function_call` (or
//! `custom_tool_call`) items after it becomes one assistant message with
//! those calls as `tool_calls`, as a chat assistant turn has them; a
//! `function_call_output` (or `custom_tool_call_output`) becomes a tool
//! message. `reasoning` items (encrypted), `compaction` items,
//! `item_reference` and item types condense does not know are not shown as
//! text any stage may change: one before an assistant run travels with it
//! and goes only when the whole run goes; another stands as a system
//! message of its own, which no stage rewrites.
//!
//! Writing back rewrites only the items whose view message changed: a
//! masked output gets the new text as its `output`, a shortened call the
//! new `arguments` (or `input`), rewritten assistant text replaces the
//! message's text parts. The digest or checkpoint becomes a user `message`
//! item where the first dropped item stood (or before the item of the view
//! message `Fates::replacement_at` names). The result is checked (every
//! output after its call, every call answered when it was before) before it
//! goes out; a body that breaks the rules already goes out as it came.
//!
//! A request with `previous_response_id` or `conversation` keeps its
//! history on the server: there is nothing to compact, and the caller
//! forwards it unchanged ([`ResponsesRequest::stateful`]).

use std::collections::HashSet;

use bytes::Bytes;
use serde_json::{Value, json};

use crate::chat::object::{member_value, members, write_json_string};
use crate::chat::{ChatRequest, Message, RawObject};
use crate::compaction::Fates;

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("body is not a JSON object with an \"input\" list: {0}")]
    Invalid(#[from] serde_json::Error),
    #[error("body has no \"input\" list")]
    NoInput,
    #[error("input item {0} is not a JSON object")]
    Item(usize),
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the compacted input breaks the Responses API's rules: {0}")]
    Invalid(&'static str),
    #[error("the pipeline's decisions do not match the input")]
    Mismatch,
}

/// An input item: its bytes, its kind and role. Its other fields are read
/// from the bytes when asked: 160,000 items held parsed were over a
/// hundred megabytes of maps.
#[derive(Debug, Clone)]
struct Item {
    raw: Bytes,
    kind: Box<str>,
    role: Box<str>,
}

impl Item {
    /// The item in `raw`; None when it is not a JSON object.
    fn parse(raw: Bytes) -> Option<Item> {
        let object = members(&raw, |_, _| ()).is_some()
            || serde_json::from_slice::<Value>(&raw).is_ok_and(|v| v.is_object());
        if !object {
            return None;
        }
        let kind = match member_value::<String>(&raw, "type") {
            Some(t) => t,
            // An "easy" input message: a role and content, no type.
            None if member_value::<Value>(&raw, "role").is_some() => "message".to_string(),
            None => String::new(),
        };
        let role = member_value::<String>(&raw, "role").unwrap_or_default();
        Some(Item {
            raw,
            kind: kind.into(),
            role: role.into(),
        })
    }

    fn kind(&self) -> &str {
        &self.kind
    }

    /// Field `key`, when it is a string.
    fn str(&self, key: &str) -> Option<String> {
        member_value(&self.raw, key)
    }

    /// Field `key`, parsed.
    fn get(&self, key: &str) -> Option<Value> {
        member_value(&self.raw, key)
    }

    fn role(&self) -> &str {
        &self.role
    }

    fn is_call(&self) -> bool {
        matches!(self.kind(), "function_call" | "custom_tool_call")
    }

    fn is_output(&self) -> bool {
        matches!(
            self.kind(),
            "function_call_output" | "custom_tool_call_output"
        )
    }

    fn is_assistant_message(&self) -> bool {
        self.kind() == "message" && self.role() == "assistant"
    }

    /// Items condense never shows as text: reasoning, compaction, item
    /// references, unknown types.
    fn is_opaque(&self) -> bool {
        !(self.kind() == "message" || self.is_call() || self.is_output())
    }

    /// The item with `key` set to `value`; its other fields kept.
    fn with(&self, key: &str, value: Value) -> Item {
        let value = Bytes::from(value.to_string());
        Item {
            // Its other fields keep their bytes and the client's order.
            raw: crate::compaction::text::with_raw_field(&self.raw, key, value)
                .unwrap_or_else(|| self.raw.clone()),
            kind: self.kind.clone(),
            role: self.role.clone(),
        }
    }
}

/// Where a view message came from: the items it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    Instructions,
    /// One item: a message, an output, or an opaque item standing alone.
    Item(usize),
    /// An assistant run: opaque items before it, an optional assistant
    /// message, then calls (all by index, in order).
    Run(Vec<usize>),
}

/// Where each message of the pipeline's view came from.
#[derive(Debug, Clone)]
pub struct Origins(Vec<Origin>);

/// A Responses request: its top-level fields as the client's bytes, and
/// each input item.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    source: Bytes,
    fields: RawObject,
    items: Vec<Item>,
}

impl ResponsesRequest {
    /// Parses a request whose `input` is a list of items. A string `input`
    /// (or no list) is not one condense works on.
    pub fn parse(body: &Bytes) -> Result<ResponsesRequest, ParseError> {
        let (fields, list) = RawObject::parse_splitting(body, Some("input"))?;
        let list = list.ok_or(ParseError::NoInput)?;
        let items = list
            .into_iter()
            .enumerate()
            .map(|(i, raw)| Item::parse(raw).ok_or(ParseError::Item(i)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ResponsesRequest {
            source: body.clone(),
            fields,
            items,
        })
    }

    /// The server holds the history (`previous_response_id` or
    /// `conversation` set): nothing here to compact.
    pub fn stateful(&self) -> Option<&'static str> {
        let set = |k: &str| self.fields.get(k).is_some_and(|v| v != b"null");
        if set("previous_response_id") {
            Some("previous_response_id")
        } else if set("conversation") {
            Some("conversation")
        } else {
            None
        }
    }

    pub fn source(&self) -> &Bytes {
        &self.source
    }

    pub fn is_stream(&self) -> bool {
        self.fields.get("stream") == Some(b"true")
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Indices of the items that start an assistant turn (its reasoning,
    /// message or first call).
    pub fn assistant_turns(&self) -> Vec<usize> {
        self.view()
            .1
            .0
            .iter()
            .filter_map(|o| match o {
                Origin::Run(m) => m.first().copied(),
                _ => None,
            })
            .collect()
    }

    /// The request with its first `end` items only (and `model`, when
    /// given).
    pub fn prefix(&self, end: usize, model: Option<&str>) -> Bytes {
        let mut fields = self.fields.clone();
        fields.set(
            "input",
            crate::wire::view::raw_list(self.items.iter().take(end).map(|i| &i.raw)),
        );
        if let Some(m) = model {
            fields.set("model", Bytes::from(json!(m).to_string()));
        }
        Bytes::from(fields.to_vec())
    }

    /// Every output answers an earlier call, and every call is answered,
    /// except calls after the last output (a turn in progress).
    pub fn well_formed(&self) -> bool {
        check(&self.items.iter().collect::<Vec<_>>()).is_ok()
    }

    /// The input as chat messages, with `model`, the output limit and
    /// `tools` beside them.
    pub fn view(&self) -> (ChatRequest, Origins) {
        let mut messages = Vec::with_capacity(self.items.len() + 1);
        let mut origins = Vec::with_capacity(self.items.len() + 1);
        let mut push = |v: Bytes, o: Origin| {
            messages.push(Message::from_bytes(v));
            origins.push(o);
        };
        let bytes = |v: Value| crate::wire::view::view_bytes(&v);
        if let Some(text) = self
            .fields
            .get("instructions")
            .and_then(|v| serde_json::from_slice::<String>(v).ok())
        {
            push(
                bytes(json!({"role": "system", "content": text})),
                Origin::Instructions,
            );
        }
        let mut i = 0;
        let n = self.items.len();
        while i < n {
            // An assistant run: opaque items, then an assistant message
            // and/or calls.
            let mut j = i;
            while j < n && self.items[j].is_opaque() {
                j += 1;
            }
            let run_start = j;
            if j < n && self.items[j].is_assistant_message() {
                j += 1;
            }
            while j < n && self.items[j].is_call() {
                j += 1;
            }
            if j > run_start {
                let members: Vec<usize> = (i..j).collect();
                push(self.run_view(&members), Origin::Run(members));
                i = j;
                continue;
            }
            // Not a run: the opaque items stand alone, then one item.
            for k in i..run_start {
                push(bytes(opaque_view(&self.items[k])), Origin::Item(k));
            }
            if run_start < n {
                let item = &self.items[run_start];
                let v = if item.is_output() {
                    bytes(
                        json!({"role": "tool", "tool_call_id": item.str("call_id").unwrap_or_default(),
                        "content": output_text(item)}),
                    )
                } else {
                    let role = match item.role() {
                        "system" | "developer" | "user" | "assistant" => item.role(),
                        _ => "user",
                    };
                    crate::wire::view::chat_text(role, &message_text(item))
                };
                push(v, Origin::Item(run_start));
            }
            i = run_start + 1;
        }
        let mut fields = RawObject::default();
        for (from, to) in [
            ("model", "model"),
            ("max_output_tokens", "max_tokens"),
            ("tools", "tools"),
            ("tool_choice", "tool_choice"),
        ] {
            if let Some(v) = self.fields.get(from) {
                fields.set(to, Bytes::copy_from_slice(v));
            }
        }
        // With `store` (true by default) the server keeps what this
        // request and its answer hold, and a later request may go on from
        // it: condense's tools must then stay out of it.
        if self.fields.get("store").map(<[u8]>::trim_ascii) != Some(b"false") {
            fields.set(
                crate::wire::tools::SERVER_KEEPS,
                Bytes::from_static(b"true"),
            );
        }
        (ChatRequest::assembled(fields, messages), Origins(origins))
    }

    /// The chat view of an assistant run, as JSON bytes: its text, its
    /// calls as `tool_calls`, its opaque items' text as `reasoning`.
    /// Written call by call (80,000 calls built as one value were a hundred
    /// megabytes), in the bytes `serde_json` gives the same message built
    /// as a value: keys in order, no spaces.
    fn run_view(&self, members: &[usize]) -> Bytes {
        let items: Vec<&Item> = members.iter().map(|&k| &self.items[k]).collect();
        let text = items
            .iter()
            .filter(|i| i.is_assistant_message())
            .map(|i| message_text(i))
            .collect::<Vec<_>>()
            .join("\n");
        let reasoning: String = items
            .iter()
            .filter(|i| i.is_opaque())
            .map(|i| opaque_text(i))
            .collect::<Vec<_>>()
            .join("\n");
        let mut out = Vec::with_capacity(text.len() + reasoning.len() + 64);
        out.extend_from_slice(b"{\"content\":");
        match text.is_empty() {
            true => out.extend_from_slice(b"null"),
            false => write_json_string(&mut out, &text),
        }
        if !reasoning.is_empty() {
            out.extend_from_slice(b",\"reasoning\":");
            write_json_string(&mut out, &reasoning);
        }
        out.extend_from_slice(b",\"role\":\"assistant\"");
        crate::wire::view::write_tool_calls(
            &mut out,
            items.iter().filter(|i| i.is_call()).map(|i| {
                (
                    i.str("call_id").unwrap_or_default(),
                    i.str("name").unwrap_or_default(),
                    i.str("arguments").or(i.str("input")).unwrap_or_default(),
                )
            }),
        );
        out.push(b'}');
        crate::wire::view::exact(out)
    }

    /// The request with the pipeline's decisions on the view applied.
    pub fn write_back(&self, origins: &Origins, fates: &Fates) -> Result<Bytes, WriteError> {
        let origins = &origins.0;
        let n = origins.len();
        if fates.dropped.len() != n || fates.rewritten.len() != n {
            return Err(WriteError::Mismatch);
        }
        // Per item: gone, or its replacement.
        let mut gone = vec![false; self.items.len()];
        let mut replaced: Vec<Option<Item>> = vec![None; self.items.len()];
        // Where the replacement stands: before the item(s) of view message
        // `replacement_at`, else where the first dropped one stood.
        let first_item = |o: &Origin| match o {
            Origin::Instructions => None,
            Origin::Item(k) => Some(*k),
            Origin::Run(m) => m.first().copied(),
        };
        let mut digest_at = fates
            .replacement_at
            .and_then(|j| origins.get(j))
            .and_then(first_item);
        for (j, o) in origins.iter().enumerate() {
            let members: &[usize] = match o {
                Origin::Instructions => {
                    if fates.dropped[j] || fates.rewritten[j].is_some() {
                        return Err(WriteError::Invalid("the instructions changed"));
                    }
                    continue;
                }
                Origin::Item(k) => std::slice::from_ref(k),
                Origin::Run(m) => m,
            };
            if fates.dropped[j] {
                if digest_at.is_none() {
                    digest_at = members.first().copied();
                }
                for &k in members {
                    gone[k] = true;
                }
                continue;
            }
            let Some(raw) = &fates.rewritten[j] else {
                continue;
            };
            // Read through Message: its calls one at a time.
            serde_json::from_slice::<serde::de::IgnoredAny>(raw)
                .map_err(|_| WriteError::Mismatch)?;
            let v = Message::from_bytes(raw.clone());
            let text = crate::wire::view::text_of(v.content().unwrap_or(&Value::Null));
            match o {
                Origin::Item(k) => {
                    let item = &self.items[*k];
                    replaced[*k] = Some(if item.is_output() {
                        item.with("output", json!(text))
                    } else if item.is_opaque() {
                        return Err(WriteError::Invalid("an opaque item changed"));
                    } else {
                        with_text(item, &text)
                    });
                }
                Origin::Run(m) => {
                    let mut calls = v.tool_calls();
                    for &k in m {
                        let item = &self.items[k];
                        if item.is_assistant_message() && text != message_text(item) {
                            replaced[k] = Some(with_text(item, &text));
                        } else if item.is_call() {
                            let call = calls.next();
                            let args = call
                                .as_ref()
                                .and_then(|c| c.pointer("/function/arguments"))
                                .and_then(Value::as_str);
                            let key = if item.kind() == "custom_tool_call" {
                                "input"
                            } else {
                                "arguments"
                            };
                            if let Some(a) = args.filter(|a| Some(*a) != item.str(key).as_deref()) {
                                replaced[k] = Some(item.with(key, json!(a)));
                            }
                        }
                    }
                }
                Origin::Instructions => {}
            }
        }
        let digest = fates.replacement.as_ref().map(|d| {
            let text = serde_json::from_slice::<Value>(d)
                .map(|v| crate::wire::view::text_of(&v))
                .unwrap_or_default();
            let v = json!({"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]});
            Item {
                raw: Bytes::from(v.to_string()),
                kind: "message".into(),
                role: "user".into(),
            }
        });
        let mut out: Vec<&Item> = Vec::with_capacity(self.items.len() + 1);
        for (k, item) in self.items.iter().enumerate() {
            if digest_at == Some(k)
                && let Some(d) = &digest
            {
                out.push(d);
            }
            if gone[k] {
                continue;
            }
            out.push(replaced[k].as_ref().unwrap_or(item));
        }
        check(&out)?;
        let mut fields = self.fields.clone();
        fields.set(
            "input",
            crate::wire::view::raw_list(out.iter().map(|i| &i.raw)),
        );
        Ok(Bytes::from(fields.to_vec()))
    }
}

/// The Responses API's pairing rules on an item list: an output answers an
/// earlier call by `call_id`; a call before the last output is answered.
fn check(items: &[&Item]) -> Result<(), WriteError> {
    // Sets of ids: a turn of many calls is checked in linear time.
    let mut calls: HashSet<String> = HashSet::new();
    let mut answered: HashSet<String> = HashSet::new();
    for item in items {
        if item.is_call() {
            calls.insert(item.str("call_id").unwrap_or_default());
        } else if item.is_output() {
            let id = item.str("call_id").unwrap_or_default();
            if !calls.contains(&id) {
                return Err(WriteError::Invalid("an output answers no call"));
            }
            answered.insert(id);
        }
    }
    let last_output = items.iter().rposition(|i| i.is_output());
    for (k, item) in items.iter().enumerate() {
        if item.is_call()
            && last_output.is_some_and(|l| k < l)
            && !answered.contains(&item.str("call_id").unwrap_or_default())
        {
            return Err(WriteError::Invalid("a call is not answered"));
        }
    }
    Ok(())
}

/// The text of a message item's content (a string, or parts).
fn message_text(item: &Item) -> String {
    crate::wire::view::text_of(&item.get("content").unwrap_or(Value::Null))
}

/// The text of an output (a string, or content parts).
fn output_text(item: &Item) -> String {
    match item.get("output") {
        Some(Value::String(s)) => s,
        Some(v @ Value::Array(_)) => crate::wire::view::text_of(&v),
        _ => String::new(),
    }
}

/// What an opaque item shows the counter: a reasoning summary's text, or
/// the item's type.
fn opaque_text(item: &Item) -> String {
    let summary = item.get("summary");
    let summary: Vec<&str> = summary
        .as_ref()
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.get("text").and_then(Value::as_str))
        .collect();
    if summary.is_empty() {
        format!("[{}]", item.kind())
    } else {
        summary.join("\n")
    }
}

fn opaque_view(item: &Item) -> Value {
    json!({"role": "system", "content": opaque_text(item)})
}

/// A message item with its text replaced: string content stays a string;
/// parts become one text part of the message's kind (other parts, images
/// among them, go with the old text, as a masked chat message loses them).
fn with_text(item: &Item, text: &str) -> Item {
    match item.get("content") {
        Some(Value::Array(_)) => {
            let kind = if item.role() == "assistant" {
                "output_text"
            } else {
                "input_text"
            };
            let mut part = json!({"type": kind, "text": text});
            if kind == "output_text" {
                part["annotations"] = json!([]);
            }
            item.with("content", json!([part]))
        }
        _ => item.with("content", json!(text)),
    }
}

#[cfg(test)]
mod tests;
