//! condense's tools in a streamed answer: [`Gather`] reads the events of
//! one answer, tells as early as it can whether the answer starts with a
//! call of condense's tools, and gathers the events into the answer a JSON
//! response would have been; [`Filter`] edits the events the client gets
//! (a call of condense's tools after text already went out is taken out,
//! and the usage of the rounds condense answered is added).

use serde_json::{Value, json};

use super::tools::{Answer, Usage};
use super::{COMPRESS_TOOL, RECALL_TOOL};
use crate::wire::Format;

fn ours(name: Option<&str>) -> bool {
    name.is_some_and(super::is_own_tool)
}

/// What a tool name (or its first pieces, as some servers stream it) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Named {
    /// One of condense's tools, or the start of one that none of the
    /// client's tools starts with.
    Ours,
    /// The start of one of condense's tools and of a client's tool alike.
    Unknown,
    Theirs,
}

fn named(name: &str, client_tools: &[String]) -> Named {
    if super::is_own_tool(name) {
        return Named::Ours;
    }
    if ![RECALL_TOOL, COMPRESS_TOOL]
        .iter()
        .any(|t| t.starts_with(name))
    {
        return Named::Theirs;
    }
    match client_tools.iter().any(|c| c.starts_with(name)) {
        true => Named::Unknown,
        false => Named::Ours,
    }
}

fn str_at<'a>(v: &'a Value, at: &str) -> Option<&'a str> {
    v.pointer(at).and_then(Value::as_str)
}

/// What an answer's events tell so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Nothing yet (the start of the message, reasoning).
    Hold,
    /// The answer starts with text, or a call of the client's tools.
    Pass,
    /// The answer starts with a call of condense's tools.
    Ours,
}

/// One streamed answer, gathered.
pub struct Gather {
    format: Format,
    value: Value,
    /// Chat: the tool calls by index.
    calls: Vec<Value>,
    /// Messages: a tool_use block's input JSON by block index.
    partial: Vec<(usize, String)>,
    decision: Decision,
    /// The names of the client's tools.
    client_tools: Vec<String>,
}

impl Gather {
    pub fn new(format: Format) -> Gather {
        Gather {
            format,
            value: Value::Null,
            calls: Vec::new(),
            partial: Vec::new(),
            decision: Decision::Hold,
            client_tools: Vec::new(),
        }
    }

    /// Told the names of the client's tools (a name that comes in pieces
    /// is then told apart sooner).
    pub fn with_client_tools(mut self, names: Vec<String>) -> Gather {
        self.client_tools = names;
        self
    }

    /// Reads one event's data; returns what can be told once it is read
    /// (once told, it stays).
    pub fn event(&mut self, data: &Value) -> Decision {
        let now = match self.format {
            Format::Chat => self.chat(data),
            Format::Messages => self.messages(data),
            Format::Responses => self.responses(data),
        };
        if self.decision == Decision::Hold {
            self.decision = now;
        }
        self.decision
    }

    fn chat(&mut self, data: &Value) -> Decision {
        if self.value.is_null() {
            self.value = json!({"id": data.get("id"), "object": "chat.completion",
                "created": data.get("created"), "model": data.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": null},
                    "finish_reason": null}]});
        }
        if let Some(u) = data.get("usage").filter(|u| u.is_object()) {
            self.value["usage"] = u.clone();
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
            let message = &mut self.value["choices"][0]["message"];
            let before = message["content"].as_str().unwrap_or("").to_string();
            message["content"] = json!(before + text);
        }
        if delta.get("refusal").is_some_and(|r| !r.is_null()) {
            now = Decision::Pass;
        }
        for key in super::tools::REASONING_FIELDS {
            if let Some(piece) = delta.get(*key).and_then(Value::as_str) {
                let message = &mut self.value["choices"][0]["message"];
                let before = message[*key].as_str().unwrap_or("").to_string();
                message[*key] = json!(before + piece);
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
            while self.calls.len() <= i {
                self.calls.push(json!({"id": "", "type": "function",
                    "function": {"name": "", "arguments": ""}}));
            }
            let call = &mut self.calls[i];
            if let Some(id) = tc.get("id").and_then(Value::as_str) {
                call["id"] = json!(id);
            }
            if let Some(name) = str_at(tc, "/function/name") {
                let full = format!("{}{name}", call["function"]["name"].as_str().unwrap_or(""));
                // A name may come in pieces: one that may still become one
                // of condense's tools or a client's tool tells nothing yet.
                now = match named(&full, &self.client_tools) {
                    Named::Ours => Decision::Ours,
                    Named::Unknown => Decision::Hold,
                    Named::Theirs => Decision::Pass,
                };
                call["function"]["name"] = json!(full);
            }
            if let Some(args) = str_at(tc, "/function/arguments") {
                let full = format!(
                    "{}{args}",
                    call["function"]["arguments"].as_str().unwrap_or("")
                );
                call["function"]["arguments"] = json!(full);
            }
        }
        if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
            self.value["choices"][0]["finish_reason"] = reason.clone();
            if now == Decision::Hold {
                now = Decision::Pass;
            }
        }
        now
    }

    fn messages(&mut self, data: &Value) -> Decision {
        let index = data
            .get("index")
            .and_then(Value::as_u64)
            .map(|i| i as usize);
        match data.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                self.value = data
                    .get("message")
                    .filter(|m| m.is_object())
                    .cloned()
                    .unwrap_or(json!({}));
                if !self.value["content"].is_array() {
                    self.value["content"] = json!([]);
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
                    self.partial.push((index.unwrap_or(0), String::new()));
                }
                if let Some(content) = self.value.get_mut("content").and_then(Value::as_array_mut) {
                    content.push(block);
                }
                now
            }
            Some("content_block_delta") => {
                let delta = data.get("delta").unwrap_or(&Value::Null);
                let at = index.unwrap_or(0);
                match str_at(delta, "/type") {
                    Some("input_json_delta") => {
                        if let Some((_, p)) = self.partial.iter_mut().find(|(i, _)| *i == at) {
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
                        if let Some(block) = self
                            .value
                            .pointer_mut(&format!("/content/{at}"))
                            .filter(|b| b.is_object())
                        {
                            let piece = str_at(delta, &format!("/{field}")).unwrap_or("");
                            let before = block[field].as_str().unwrap_or("").to_string();
                            block[field] = json!(before + piece);
                        }
                    }
                    None => {}
                }
                Decision::Hold
            }
            Some("content_block_stop") => {
                let at = index.unwrap_or(0);
                if let Some((_, p)) = self.partial.iter().find(|(i, _)| *i == at)
                    && let Ok(input) = serde_json::from_str::<Value>(p)
                    && let Some(block) = self
                        .value
                        .pointer_mut(&format!("/content/{at}"))
                        .filter(|b| b.is_object())
                {
                    block["input"] = input;
                }
                Decision::Hold
            }
            Some("message_delta") => {
                if !self.value.is_object() {
                    self.value = json!({"content": []});
                }
                if let Some(d) = data.get("delta").and_then(Value::as_object) {
                    for (k, v) in d {
                        self.value[k] = v.clone();
                    }
                }
                if let Some(Value::Object(u)) = data.get("usage") {
                    if !self.value["usage"].is_object() {
                        self.value["usage"] = json!({});
                    }
                    for (k, v) in u {
                        self.value["usage"][k] = v.clone();
                    }
                }
                Decision::Hold
            }
            Some("message_stop" | "error") => Decision::Pass,
            _ => Decision::Hold,
        }
    }

    fn responses(&mut self, data: &Value) -> Decision {
        match data.get("type").and_then(Value::as_str) {
            Some("response.output_item.added") => {
                let item = data.get("item").unwrap_or(&Value::Null);
                match str_at(item, "/type") {
                    Some("function_call") if ours(str_at(item, "/name")) => Decision::Ours,
                    Some("reasoning") => Decision::Hold,
                    _ => Decision::Pass,
                }
            }
            Some("response.completed" | "response.incomplete" | "response.failed") => {
                self.value = data.get("response").cloned().unwrap_or(Value::Null);
                Decision::Pass
            }
            Some("error") => Decision::Pass,
            _ => Decision::Hold,
        }
    }

    /// The gathered answer (None when the stream gave none).
    pub fn answer(mut self) -> Option<Answer> {
        if self.format == Format::Chat && !self.calls.is_empty() {
            self.value["choices"][0]["message"]["tool_calls"] = Value::Array(self.calls);
        }
        self.value.is_object().then_some(Answer {
            format: self.format,
            value: self.value,
        })
    }
}

/// What to do with one event on its way to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    Keep,
    Drop,
    Changed,
}

/// Edits the events of the answer the client gets.
pub struct Filter {
    format: Format,
    /// The usage of the rounds condense answered.
    extra: Usage,
    /// Indices (tool call, content block or output item) of condense's
    /// calls taken out so far.
    dropped: Vec<u64>,
    client_calls: bool,
    /// How many calls were taken out.
    pub stripped: usize,
    /// The names of the client's tools.
    client_tools: Vec<String>,
    /// Chat: the name of each tool call so far, by index.
    names: Vec<(u64, String)>,
}

impl Filter {
    pub fn new(format: Format, extra: Usage) -> Filter {
        Filter {
            format,
            extra,
            dropped: Vec::new(),
            client_calls: false,
            stripped: 0,
            client_tools: Vec::new(),
            names: Vec::new(),
        }
    }

    /// Told the names of the client's tools: a chat call whose name comes
    /// in pieces is then taken out from its first piece, when that can
    /// only start one of condense's tools.
    pub fn with_client_tools(mut self, names: Vec<String>) -> Filter {
        self.client_tools = names;
        self
    }

    /// Takes out the call at `index` (and every later event of it).
    fn drop(&mut self, index: Option<u64>) {
        match index {
            Some(i) if self.dropped.contains(&i) => {}
            Some(i) => {
                self.dropped.push(i);
                self.stripped += 1;
            }
            None => self.stripped += 1,
        }
    }

    /// The index `i` once the calls taken out before it are gone.
    fn shifted(&self, i: u64) -> u64 {
        i - self.dropped.iter().filter(|&&d| d < i).count() as u64
    }

    /// An event of the block or item at `index` (under `key`): gone with a
    /// call taken out, else moved up past the ones taken out before it.
    fn reindex(&self, data: &mut Value, key: &str, index: Option<u64>) -> Edit {
        let Some(i) = index else {
            return Edit::Keep;
        };
        if self.dropped.contains(&i) {
            return Edit::Drop;
        }
        let s = self.shifted(i);
        if s == i {
            return Edit::Keep;
        }
        data[key] = json!(s);
        Edit::Changed
    }

    pub fn event(&mut self, data: &mut Value) -> Edit {
        match self.format {
            Format::Chat => self.chat(data),
            Format::Messages => self.messages(data),
            Format::Responses => self.responses(data),
        }
    }

    fn usage(&self, usage: Option<&mut Value>) -> bool {
        match usage {
            Some(u) if u.is_object() && !self.extra.is_empty() => {
                let mut holder = json!({"usage": u.take()});
                self.extra.add_to(&mut holder);
                *u = holder["usage"].take();
                true
            }
            _ => false,
        }
    }

    fn chat(&mut self, data: &mut Value) -> Edit {
        let mut changed = self.usage(data.get_mut("usage"));
        let mut empty = false;
        if let Some(choice) = data.pointer_mut("/choices/0") {
            if let Some(calls) = choice
                .pointer_mut("/delta/tool_calls")
                .and_then(Value::as_array_mut)
            {
                for tc in calls.iter() {
                    let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                    if let Some(piece) = str_at(tc, "/function/name") {
                        let full = match self.names.iter_mut().find(|(at, _)| *at == i) {
                            Some((_, n)) => {
                                n.push_str(piece);
                                n.clone()
                            }
                            None => {
                                self.names.push((i, piece.to_string()));
                                piece.to_string()
                            }
                        };
                        // A client that replaces the name with each piece
                        // would see the piece itself.
                        let named = match super::is_own_tool(piece) {
                            true => Named::Ours,
                            false => named(&full, &self.client_tools),
                        };
                        match named {
                            Named::Ours if !self.dropped.contains(&i) => {
                                self.dropped.push(i);
                                self.stripped += 1;
                            }
                            Named::Ours => {}
                            Named::Unknown | Named::Theirs => self.client_calls = true,
                        }
                    }
                }
                let before = calls.len();
                calls.retain(|tc| {
                    let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                    !self.dropped.contains(&i)
                });
                changed |= calls.len() != before;
                for tc in calls.iter_mut() {
                    let i = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                    let s = self.shifted(i);
                    if s != i {
                        tc["index"] = json!(s);
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
            if choice.get("finish_reason").and_then(Value::as_str) == Some("tool_calls")
                && !self.client_calls
                && !self.dropped.is_empty()
            {
                choice["finish_reason"] = json!("stop");
                changed = true;
            }
            if empty && choice.get("finish_reason").is_none_or(Value::is_null) {
                return Edit::Drop;
            }
        }
        if changed { Edit::Changed } else { Edit::Keep }
    }

    fn messages(&mut self, data: &mut Value) -> Edit {
        let kind = data.get("type").and_then(Value::as_str).unwrap_or("");
        let index = data.get("index").and_then(Value::as_u64);
        if str_at(data, "/content_block/type") == Some("tool_use") {
            if ours(str_at(data, "/content_block/name")) {
                self.drop(index);
                return Edit::Drop;
            }
            if kind == "content_block_start" {
                self.client_calls = true;
            }
        }
        match kind {
            "message_start" => {
                return match self.usage(data.pointer_mut("/message/usage")) {
                    true => Edit::Changed,
                    false => Edit::Keep,
                };
            }
            "message_delta" => {
                let mut changed = self.usage(data.get_mut("usage"));
                if str_at(data, "/delta/stop_reason") == Some("tool_use")
                    && !self.client_calls
                    && !self.dropped.is_empty()
                {
                    data["delta"]["stop_reason"] = json!("end_turn");
                    changed = true;
                }
                return if changed { Edit::Changed } else { Edit::Keep };
            }
            _ => {}
        }
        self.reindex(data, "index", index)
    }

    fn responses(&mut self, data: &mut Value) -> Edit {
        let kind = data.get("type").and_then(Value::as_str).unwrap_or("");
        let index = data.get("output_index").and_then(Value::as_u64);
        // An event that carries one of condense's calls (`added`, or a
        // `done` without it) goes, and takes its output index with it.
        if str_at(data, "/item/type") == Some("function_call") {
            if ours(str_at(data, "/item/name")) {
                self.drop(index);
                return Edit::Drop;
            }
            if kind == "response.output_item.added" {
                self.client_calls = true;
            }
        }
        // The whole response (`response.completed`, `incomplete`, `failed`).
        if data
            .pointer("/response/output")
            .is_some_and(Value::is_array)
        {
            let mut changed = self.usage(data.pointer_mut("/response/usage"));
            if let Some(output) = data
                .pointer_mut("/response/output")
                .and_then(Value::as_array_mut)
            {
                let before = output.len();
                output.retain(|i| {
                    !(str_at(i, "/type") == Some("function_call") && ours(str_at(i, "/name")))
                });
                changed |= output.len() != before;
            }
            return if changed { Edit::Changed } else { Edit::Keep };
        }
        self.reindex(data, "output_index", index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(format: Format, events: &[Value]) -> (Decision, Option<Answer>) {
        let mut g = Gather::new(format);
        let mut d = Decision::Hold;
        for e in events {
            d = g.event(e);
        }
        (d, g.answer())
    }

    #[test]
    fn a_chat_stream_that_starts_with_a_recall_is_gathered_whole() {
        let events = [
            json!({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1",
                "type": "function", "function": {"name": RECALL_TOOL, "arguments": ""}}]}}]}),
            json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                "function": {"arguments": "{\"key\":\"abc"}}]}}]}),
            json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                "function": {"arguments": "defg\"}"}}]}, "finish_reason": "tool_calls"}]}),
        ];
        let mut g = Gather::new(Format::Chat);
        assert_eq!(g.event(&events[0]), Decision::Hold);
        assert_eq!(g.event(&events[1]), Decision::Ours);
        g.event(&events[2]);
        g.event(&events[3]);
        let a = g.answer().unwrap();
        let ours = a.ours();
        assert_eq!(ours.len(), 1);
        assert_eq!(ours[0].id, "call_1");
        assert_eq!(ours[0].argument.as_deref(), Some("abcdefg"));

        let text = [json!({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})];
        assert_eq!(run(Format::Chat, &text).0, Decision::Pass);
        // A name in pieces: told at once when only condense's tools start
        // that way, else once it can no longer be one of them.
        let piece = |name: &str| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                "function": {"name": name}}]}}]})
        };
        let mut g = Gather::new(Format::Chat);
        assert_eq!(g.event(&piece("condense_")), Decision::Ours);
        let client = || vec!["condense_logs".to_string()];
        let mut g = Gather::new(Format::Chat).with_client_tools(client());
        assert_eq!(g.event(&piece("condense_")), Decision::Hold);
        assert_eq!(g.event(&piece("recall")), Decision::Ours);
        let mut g = Gather::new(Format::Chat).with_client_tools(client());
        assert_eq!(g.event(&piece("condense_")), Decision::Hold);
        assert_eq!(g.event(&piece("x")), Decision::Pass);
    }

    #[test]
    fn a_late_chat_recall_is_taken_out_and_indices_close_up() {
        let mut f = Filter::new(Format::Chat, Usage::default());
        let mut start = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x",
            "function": {"name": RECALL_TOOL, "arguments": ""}}]}}]});
        assert_eq!(f.event(&mut start), Edit::Drop);
        let mut args = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
            "function": {"arguments": "{}"}}]}}]});
        assert_eq!(f.event(&mut args), Edit::Drop);
        let mut theirs = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "y",
            "function": {"name": "read", "arguments": "{}"}}]}}]});
        assert_eq!(f.event(&mut theirs), Edit::Changed);
        assert_eq!(theirs["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        let mut end =
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]});
        assert_eq!(f.event(&mut end), Edit::Keep);
        assert_eq!(f.stripped, 1);

        // A name in pieces is taken out from its first piece, when no
        // client tool starts the same way.
        let piece = |i: u64, name: &str| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i,
                "function": {"name": name}}]}}]})
        };
        let mut f =
            Filter::new(Format::Chat, Usage::default()).with_client_tools(vec!["read".into()]);
        assert_eq!(f.event(&mut piece(0, "condense_")), Edit::Drop);
        assert_eq!(f.event(&mut piece(0, "recall")), Edit::Drop);
        assert_eq!(f.event(&mut piece(1, "re")), Edit::Changed);
        assert_eq!(f.stripped, 1);
        let mut g = Gather::new(Format::Chat).with_client_tools(vec!["condense_logs".into()]);
        assert_eq!(g.event(&piece(0, "condense_")), Decision::Hold);
        assert_eq!(g.event(&piece(0, "logs")), Decision::Pass);
    }

    #[test]
    fn malformed_events_neither_panic_nor_let_a_call_through() {
        // Found by the fuzz target: a block that is not an object, a
        // message that is not one, calls in events of unknown types.
        let mut g = Gather::new(Format::Messages);
        g.event(&json!({"type": "message_start", "message": 7}));
        g.event(&json!({"type": "message_start", "message": {"content": [3]}}));
        g.event(&json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}));
        g.event(&json!({"type": "content_block_stop", "index": 0}));
        assert!(g.answer().is_some());
        let mut f = Filter::new(Format::Responses, Usage::default());
        let mut odd = json!({"type": "response.output_item.idded",
            "item": {"type": "function_call", "name": RECALL_TOOL}});
        assert_eq!(f.event(&mut odd), Edit::Drop);
        let mut whole = json!({"type": "reesponse.completed", "response": {"output": [
            {"type": "function_call", "name": RECALL_TOOL}]}});
        assert_eq!(f.event(&mut whole), Edit::Changed);
        assert_eq!(whole["response"]["output"], json!([]));
        let mut f = Filter::new(Format::Messages, Usage::default());
        let mut delta = json!({"type": "message_delta", "delta": {},
            "content_block": {"type": "tool_use", "name": RECALL_TOOL}});
        assert_eq!(f.event(&mut delta), Edit::Drop);
    }

    #[test]
    fn messages_and_responses_streams_are_gathered_and_filtered() {
        let events = [
            json!({"type": "message_start", "message": {"id": "m", "role": "assistant", "content": [],
                "usage": {"input_tokens": 7, "output_tokens": 1}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "tu", "name": RECALL_TOOL, "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"key\": \"abcdefg\"}"}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
            json!({"type": "message_stop"}),
        ];
        let (d, a) = run(Format::Messages, &events);
        assert_eq!(d, Decision::Ours);
        let a = a.unwrap();
        assert_eq!(a.value["content"][0]["signature"], "sig");
        assert_eq!(a.ours()[0].argument.as_deref(), Some("abcdefg"));
        assert_eq!(a.value["usage"]["output_tokens"], 9);

        // After text, the same call is taken out of what the client sees.
        let mut extra = Usage::default();
        extra.add(Some(&json!({"input_tokens": 100, "output_tokens": 10})));
        let mut f = Filter::new(Format::Messages, extra);
        let mut start = events[0].clone();
        assert_eq!(f.event(&mut start), Edit::Changed);
        assert_eq!(start["message"]["usage"]["input_tokens"], 107);
        let mut tool = events[5].clone();
        assert_eq!(f.event(&mut tool), Edit::Drop);
        let mut delta = events[8].clone();
        assert_eq!(f.event(&mut delta), Edit::Changed);
        assert_eq!(delta["delta"]["stop_reason"], "end_turn");
        assert_eq!(delta["usage"]["output_tokens"], 19);

        let added = json!({"type": "response.output_item.added", "output_index": 0,
            "item": {"type": "function_call", "name": RECALL_TOOL, "call_id": "c"}});
        assert_eq!(run(Format::Responses, &[added]).0, Decision::Ours);
        let reasoning = json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning"}});
        assert_eq!(run(Format::Responses, &[reasoning]).0, Decision::Hold);
    }
}
