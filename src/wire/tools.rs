//! The tools condense offers and answers itself: their names and
//! definitions, their calls found in a model's answer (a JSON body, or a
//! stream's events gathered into one), the follow-up request that carries
//! their results, and the answer the client sees without them. What is in
//! each API's shape is the API's (`OwnTools`: `tool`, `calls`, `follow_up`,
//! `strip_own_calls`); the rest is here.
//!
//! Answers are read as `serde_json::Value`: only requests that were offered
//! a tool pay for it, and the answer is small next to the request.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::usage::Sum;
use crate::chat::{ChatRequest, RawObject};

/// The tool the model recalls an original with.
pub const RECALL_TOOL: &str = "condense_recall";
/// The tool the model asks for compaction with (`compaction.agent_tool`).
pub const COMPRESS_TOOL: &str = "compress_context";

/// Whether a tool name is one of condense's own.
pub fn is_own_tool(name: &str) -> bool {
    name == RECALL_TOOL || name == COMPRESS_TOOL
}

const RECALL_DESCRIPTION: &str = "Returns the original text of something condense shortened or removed to fit the context window: a tool output, call arguments or earlier turns. Pass the key shown as `recall key: K` next to what was cut, and for a long original a line range or a search. Call it alone, when you need the exact text again.";
const KEY_DESCRIPTION: &str = "The recall key, as shown after `recall key:`.";
const START_DESCRIPTION: &str = "First line to return, from 1.";
const END_DESCRIPTION: &str = "Last line to return (inclusive).";
// Its "2 lines" is recall::read::CONTEXT (a test checks).
const SEARCH_DESCRIPTION: &str =
    "Return only the lines holding this text (ignoring case), numbered, with 2 lines around each.";
const COMPRESS_DESCRIPTION: &str = "Tells condense that a task or subtask is finished: the conversation up to here may then be compacted (older tool output shortened or summarized) from the next request on. Call it alone, at a task boundary, when the details so far will not be needed verbatim.";
const REASON_DESCRIPTION: &str = "What was finished, in a few words.";

/// What condense's tools ask of an API: their definitions in its shape,
/// their calls read from its answers, and its turn that answers them.
pub trait OwnTools: Sync + std::fmt::Debug {
    /// One of condense's tools in this API's shape.
    fn tool(&self, name: &str, description: &str, schema: Value) -> Value;

    /// The tool calls of an answer, with whether each is condense's own.
    fn calls(&self, answer: &Value) -> Vec<(Call, bool)>;

    /// The request that carries the results of condense's calls: `sent`
    /// with the answer's turn appended (its text, and of its calls those
    /// `kept`) and one result per kept call.
    fn follow_up(
        &self,
        answer: &Value,
        kept: &[Call],
        sent: &Bytes,
        results: &[(String, String)],
    ) -> Option<Bytes>;

    /// `answer` with what the client is to see of `earlier` (an answer
    /// whose calls of condense's tools were answered: its text and
    /// reasoning, not its calls) put before its own, as one message;
    /// unchanged when `earlier` has no text.
    fn prepend(&self, earlier: &Value, answer: &mut Value);

    /// Takes condense's calls out of an answer (the stop reason says
    /// "done" when no call of the client's is left).
    fn strip_own_calls(&self, answer: &mut Value);
}

/// A field of a format's view: the server keeps the request and its answer
/// (a Responses request with `store` not false).
pub const SERVER_KEEPS: &str = "x-condense-server-keeps";

/// Whether a request can be offered condense's tools:
/// - it carries a non-empty `tools` list (condense gives no tools to a
///   request that has none);
/// - the model chooses whether to call one (`tool_choice` absent, `auto`
///   or `{"type": "auto"}`: a forced call could be spent on condense's
///   tools, and `none` calls nothing);
/// - it asks for one answer (chat's `n`: condense reads the first choice);
/// - the server keeps nothing of it (a Responses `store` not false would
///   keep condense's turns where a later request could find them).
pub fn offered(req: &ChatRequest) -> bool {
    let choice_free = |c: &[u8]| {
        let c = c.trim_ascii();
        matches!(c, b"\"auto\"" | b"null")
            || serde_json::from_slice::<Value>(c)
                .is_ok_and(|v| v.get("type").and_then(Value::as_str) == Some("auto"))
    };
    req.field("tools").is_some_and(non_empty_list)
        && req.field("tool_choice").is_none_or(choice_free)
        && req
            .field("n")
            .is_none_or(|n| matches!(n.trim_ascii(), b"1" | b"null"))
        && req.field(SERVER_KEEPS).is_none()
}

fn non_empty_list(raw: &[u8]) -> bool {
    let t = raw.trim_ascii();
    t.first() == Some(&b'[') && t[1..].trim_ascii() != b"]"
}

/// One of condense's tools in `api`'s shape. Made of constants only, so
/// its bytes are the same on every request (a `Value`'s keys are written
/// in one fixed order).
pub fn definition(api: &dyn OwnTools, name: &str) -> Value {
    let (description, schema) = match name {
        COMPRESS_TOOL => (
            COMPRESS_DESCRIPTION,
            json!({
                "type": "object",
                "properties": {"reason": {"type": "string", "description": REASON_DESCRIPTION}},
                "required": ["reason"],
                "additionalProperties": false,
            }),
        ),
        _ => (
            RECALL_DESCRIPTION,
            json!({
                "type": "object",
                "properties": {
                    "key": {"type": "string", "description": KEY_DESCRIPTION},
                    "start_line": {"type": "integer", "description": START_DESCRIPTION},
                    "end_line": {"type": "integer", "description": END_DESCRIPTION},
                    "search": {"type": "string", "description": SEARCH_DESCRIPTION},
                },
                "required": ["key"],
                "additionalProperties": false,
            }),
        ),
    };
    api.tool(name, description, schema)
}

/// A body with condense's tools added.
pub struct Offered {
    pub body: Bytes,
    /// The `tools` list before and after (for counting what was added).
    pub before: Bytes,
    pub after: Bytes,
}

/// `body` with `names` added to its `tools` (after the client's, so the
/// client's tool definitions keep their bytes and their cached prefix).
/// None when the body has no tool list, or already names one of them.
pub fn offer(api: &dyn OwnTools, body: &Bytes, names: &[&str]) -> Option<Offered> {
    let mut obj = RawObject::parse(body).ok()?;
    let before = Bytes::copy_from_slice(obj.get("tools")?);
    let after = extended(api, &before, names)?;
    obj.set("tools", after.clone());
    Some(Offered {
        body: Bytes::from(obj.to_vec()),
        before,
        after,
    })
}

/// A `tools` list with `names` added after the client's; None when it is
/// empty or not a list, or already names one of them.
pub fn extended(api: &dyn OwnTools, tools: &[u8], names: &[&str]) -> Option<Bytes> {
    let tools = tools.trim_ascii();
    if !non_empty_list(tools) || names.iter().any(|n| contains(tools, n)) {
        return None;
    }
    let mut out = tools[..tools.len() - 1].to_vec();
    for name in names {
        out.push(b',');
        out.extend_from_slice(definition(api, name).to_string().as_bytes());
    }
    out.push(b']');
    Some(Bytes::from(out))
}

/// The names of the client's own tools in a request body (any format).
pub fn client_tool_names(body: &Bytes) -> Vec<String> {
    let tools = RawObject::parse(body)
        .ok()
        .and_then(|o| serde_json::from_slice::<Vec<Value>>(o.get("tools")?).ok())
        .unwrap_or_default();
    tools
        .iter()
        .filter_map(|t| {
            t.pointer("/function/name")
                .or_else(|| t.get("name"))
                .and_then(Value::as_str)
        })
        .filter(|n| !is_own_tool(n))
        .map(str::to_string)
        .collect()
}

fn contains(haystack: &[u8], name: &str) -> bool {
    memchr::memmem::find(haystack, format!("\"{name}\"").as_bytes()).is_some()
}

/// What part of an original a recall asks for, as the model gave it: a
/// value that is not what it should be is kept as `Err` with what was
/// given (shortened), for the result to say so (`recall::read`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Part {
    pub start_line: Option<Result<u64, String>>,
    pub end_line: Option<Result<u64, String>>,
    pub search: Option<Result<String, String>>,
}

/// A call of one of condense's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The call's string argument (`key` or `reason`), if it gave one.
    pub argument: Option<String>,
    /// The part of the original a recall asks for (`start_line`,
    /// `end_line`, `search`).
    pub part: Part,
}

impl Call {
    /// A call of `name` (with `id` and its `arguments`: a JSON string or
    /// object), and whether it is one of condense's own.
    pub(super) fn read(
        id: Option<&Value>,
        name: Option<&Value>,
        arguments: Option<&Value>,
    ) -> (Call, bool) {
        let args = arguments.and_then(object);
        let call = Call {
            id: text(id),
            name: text(name),
            argument: args.as_ref().and_then(argument),
            part: args.as_ref().map(part).unwrap_or_default(),
        };
        let own = is_own_tool(&call.name);
        (call, own)
    }

    /// A call condense does not read the arguments of.
    pub(super) fn bare(id: String, name: String) -> Call {
        Call {
            id,
            name,
            argument: None,
            part: Part::default(),
        }
    }
}

/// A string value, or "" when it is not one.
pub(super) fn text(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or("").to_string()
}

/// A call's arguments: a JSON object, or a string holding one.
fn object(v: &Value) -> Option<Map<String, Value>> {
    match v {
        Value::String(s) => match serde_json::from_str::<Value>(s).ok()? {
            Value::Object(o) => Some(o),
            _ => None,
        },
        Value::Object(o) => Some(o.clone()),
        _ => None,
    }
}

/// The string argument of a call (`key` or `reason`).
fn argument(o: &Map<String, Value>) -> Option<String> {
    // A key of digits may come back as a number.
    match o.get("key").or_else(|| o.get("reason"))? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The part of an original a recall asks for. A value that is not what it
/// should be is kept as what was given, for the result to say so; null,
/// and an empty string, stand for "not given" (models that fill every
/// field send them).
fn part(o: &Map<String, Value>) -> Part {
    Part {
        start_line: line_number(o.get("start_line")),
        end_line: line_number(o.get("end_line")),
        search: match o.get("search") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(Ok(s.clone())),
            Some(Value::Number(n)) => Some(Ok(n.to_string())),
            Some(other) => Some(Err(shown(other))),
        },
    }
}

/// A line number: a whole number, or a string holding one (`"120"`; one
/// too large for 64 bits is read as the largest, past any end).
fn line_number(v: Option<&Value>) -> Option<Result<u64, String>> {
    let whole = |f: f64| (f.is_finite() && f >= 0.0 && f.fract() == 0.0).then_some(f as u64);
    let v = v?;
    let n = match v {
        Value::Null => return None,
        Value::Number(n) => n.as_u64().or_else(|| n.as_f64().and_then(whole)),
        Value::String(s) => {
            let t = s.trim();
            if t.is_empty() {
                return None;
            }
            t.parse::<u64>()
                .ok()
                .or_else(|| t.bytes().all(|b| b.is_ascii_digit()).then_some(u64::MAX))
                .or_else(|| t.parse::<f64>().ok().and_then(whole))
        }
        _ => None,
    };
    Some(n.ok_or_else(|| shown(v)))
}

/// A value as a result names it: short ones as JSON, strings cut to 40
/// characters, lists and objects by kind.
fn shown(v: &Value) -> String {
    const MAX: usize = 40;
    match v {
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
        Value::String(s) if s.chars().nth(MAX).is_some() => {
            let head: String = s.chars().take(MAX).collect();
            format!("{}…", Value::String(head))
        }
        other => other.to_string(),
    }
}

/// Whether the string at `name_at` in `v` names one of condense's tools.
pub(super) fn names_own(v: &Value, name_at: &str) -> bool {
    v.pointer(name_at)
        .and_then(Value::as_str)
        .is_some_and(is_own_tool)
}

/// A model's answer (a JSON response body, or a stream gathered into one),
/// read for condense's own tool calls.
#[derive(Debug, Clone)]
pub struct Answer {
    pub api: &'static dyn OwnTools,
    pub value: Value,
}

impl Answer {
    pub fn parse(api: &'static dyn OwnTools, body: &[u8]) -> Option<Answer> {
        let value: Value = serde_json::from_slice(body).ok()?;
        value.is_object().then_some(Answer { api, value })
    }

    /// The answer's tool calls, with whether each is condense's own.
    fn calls(&self) -> Vec<(Call, bool)> {
        self.api.calls(&self.value)
    }

    /// condense's own calls in the answer.
    pub fn ours(&self) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|(_, own)| *own)
            .map(|(c, _)| c)
            .collect()
    }

    /// The answer's calls of the client's own tools.
    pub fn theirs(&self) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|(_, own)| !*own)
            .map(|(c, _)| c)
            .collect()
    }

    /// The numbers of the answer's `usage`.
    pub fn usage(&self) -> Sum {
        let mut u = Sum::default();
        u.add(self.value.get("usage"));
        u
    }

    /// The request that carries the results of condense's calls: `sent`
    /// with the answer's turn appended (the client's own calls left out:
    /// the model decides on them again once it has the results) and one
    /// result per call. None when `sent` cannot take it.
    pub fn follow_up(&self, sent: &Bytes, results: &[(String, String)]) -> Option<Bytes> {
        self.api.follow_up(&self.value, &self.ours(), sent, results)
    }

    /// The request that carries the results of condense's calls of an
    /// answer the client already saw part of: every call stays in the turn
    /// (the client runs its own, whose result here is `passed_on`), the
    /// results in the order of the calls.
    pub fn follow_up_shown(
        &self,
        sent: &Bytes,
        results: &[(String, String)],
        passed_on: &str,
    ) -> Option<Bytes> {
        let calls = self.calls();
        let ordered: Vec<(String, String)> = calls
            .iter()
            .filter_map(|(c, own)| match own {
                true => results.iter().find(|(id, _)| *id == c.id).cloned(),
                false => Some((c.id.clone(), passed_on.to_string())),
            })
            .collect();
        let all: Vec<Call> = calls.into_iter().map(|(c, _)| c).collect();
        self.api.follow_up(&self.value, &all, sent, &ordered)
    }

    /// The answer with the text of `earlier` rounds (whose calls of
    /// condense's tools were answered) before its own, as one message.
    pub fn after(mut self, earlier: &[Answer]) -> Answer {
        for e in earlier.iter().rev() {
            self.api.prepend(&e.value, &mut self.value);
        }
        self
    }

    /// The answer as the client sees it: condense's calls taken out (the
    /// stop reason says "done" when no call of the client's is left), and
    /// `extra` (the usage of the rounds condense answered) added to its
    /// usage.
    pub fn for_client(mut self, extra: &Sum) -> Bytes {
        self.api.strip_own_calls(&mut self.value);
        extra.add_to(&mut self.value);
        Bytes::from(self.value.to_string())
    }
}

/// `sent` with `items` appended to its list `key` (a string `input` becomes
/// a list first). The list's elements keep the bytes the client sent: only
/// the new items are written, so the round condense sends shares its
/// prefix with the request it follows, and the provider's prompt cache
/// holds (re-serializing the list would reorder every object's keys).
pub(super) fn append(sent: &Bytes, key: &str, items: &[Value]) -> Option<Bytes> {
    let mut obj = RawObject::parse(sent).ok()?;
    let list = obj.get(key)?.trim_ascii();
    let mut out = Vec::with_capacity(list.len() + 256);
    match list.first()? {
        // A parsed array: it ends with its closing bracket.
        b'[' => {
            let open = &list[..list.len() - 1];
            out.extend_from_slice(open);
            if !open[1..].trim_ascii().is_empty() {
                out.push(b',');
            }
        }
        b'"' if key == "input" => {
            let s: String = serde_json::from_slice(list).ok()?;
            out.push(b'[');
            out.extend_from_slice(json!({"role": "user", "content": s}).to_string().as_bytes());
            out.push(b',');
        }
        _ => return None,
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(item.to_string().as_bytes());
    }
    if items.is_empty() && out.last() == Some(&b',') {
        out.pop();
    }
    out.push(b']');
    obj.set(key, Bytes::from(out));
    Some(Bytes::from(obj.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Format;

    fn body(v: Value) -> Bytes {
        Bytes::from(v.to_string())
    }

    #[test]
    fn the_tool_goes_after_the_clients_and_only_once() {
        let sent = body(
            json!({"model": "m", "messages": [], "tools": [{"type": "function",
            "function": {"name": "read", "parameters": {}}}]}),
        );
        let out = offer(Format::Chat.api(), &sent, &[RECALL_TOOL])
            .unwrap()
            .body;
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["tools"][0]["function"]["name"], "read");
        assert_eq!(v["tools"][1]["function"]["name"], RECALL_TOOL);
        assert_eq!(
            v["tools"][1]["function"]["parameters"]["required"],
            json!(["key"])
        );
        assert!(offer(Format::Chat.api(), &out, &[RECALL_TOOL]).is_none());
        let none = body(json!({"model": "m", "messages": [], "tools": []}));
        assert!(offer(Format::Chat.api(), &none, &[RECALL_TOOL]).is_none());
        let anthropic = body(
            json!({"model": "m", "messages": [], "tools": [{"name": "read", "input_schema": {}}]}),
        );
        let out = offer(
            Format::Messages.api(),
            &anthropic,
            &[RECALL_TOOL, COMPRESS_TOOL],
        )
        .unwrap()
        .body;
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["tools"][1]["input_schema"]["properties"]["key"]["type"],
            "string"
        );
        assert_eq!(v["tools"][2]["name"], COMPRESS_TOOL);
    }

    #[test]
    fn only_requests_whose_model_chooses_freely_and_statelessly_get_tools() {
        let req = |extra: Value| {
            let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "read"}}]});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            ChatRequest::parse(&body(v)).unwrap()
        };
        assert!(offered(&req(json!({}))));
        assert!(offered(&req(json!({"tool_choice": "auto", "n": 1}))));
        assert!(offered(&req(json!({"tool_choice": {"type": "auto"}}))));
        assert!(!offered(&req(json!({"tool_choice": "required"}))));
        assert!(!offered(&req(json!({"tool_choice": {"type": "any"}}))));
        assert!(!offered(&req(
            json!({"tool_choice": {"type": "function", "function": {"name": "read"}}})
        )));
        assert!(!offered(&req(json!({"n": 2}))));
        assert!(!offered(&req(json!({"tools": []}))));
        assert!(!offered(&req(json!({SERVER_KEEPS: true}))));
        // A Responses request the server keeps (store absent or true).
        let responses = |store: Value| {
            let mut v = json!({"model": "m", "input": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "name": "read"}]});
            if !store.is_null() {
                v["store"] = store;
            }
            let r = crate::wire::responses::ResponsesRequest::parse(&body(v)).unwrap();
            offered(&r.view().0)
        };
        assert!(responses(json!(false)));
        assert!(!responses(json!(true)));
        assert!(!responses(Value::Null));
    }

    #[test]
    fn chat_answer_calls_are_told_apart_and_answered() {
        let answer = json!({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null, "refusal": null, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": RECALL_TOOL, "arguments": "{\"key\":\"abcdefgh\"}"}},
                {"id": "b", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}});
        let a = Answer::parse(Format::Chat.api(), answer.to_string().as_bytes()).unwrap();
        assert_eq!(
            a.ours(),
            vec![Call {
                id: "a".into(),
                name: RECALL_TOOL.into(),
                argument: Some("abcdefgh".into()),
                part: Part::default(),
            }]
        );
        assert_eq!(a.theirs().len(), 1);
        let sent = body(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}));
        let next = a
            .follow_up(&sent, &[("a".into(), "the original".into())])
            .unwrap();
        let v: Value = serde_json::from_slice(&next).unwrap();
        let m = v["messages"].as_array().unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[1]["tool_calls"].as_array().unwrap().len(), 1);
        assert_eq!(
            m[2],
            json!({"role": "tool", "tool_call_id": "a", "content": "the original"})
        );

        let mut extra = Sum::default();
        extra.add(answer.get("usage"));
        let shown: Value = serde_json::from_slice(&a.for_client(&extra)).unwrap();
        assert_eq!(shown["usage"]["prompt_tokens"], 20);
        let calls = shown["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "read");
        assert_eq!(shown["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn the_tools_are_the_same_bytes_on_every_request() {
        let chat = |name| definition(Format::Chat.api(), name).to_string();
        assert_eq!(chat(RECALL_TOOL), chat(RECALL_TOOL));
        // Keys in one fixed (alphabetical) order: a change here changes
        // every request's tools, and their cached prefix, once.
        assert_eq!(
            chat(RECALL_TOOL),
            r#"{"function":{"description":"Returns the original text of something condense shortened or removed to fit the context window: a tool output, call arguments or earlier turns. Pass the key shown as `recall key: K` next to what was cut, and for a long original a line range or a search. Call it alone, when you need the exact text again.","name":"condense_recall","parameters":{"additionalProperties":false,"properties":{"end_line":{"description":"Last line to return (inclusive).","type":"integer"},"key":{"description":"The recall key, as shown after `recall key:`.","type":"string"},"search":{"description":"Return only the lines holding this text (ignoring case), numbered, with 2 lines around each.","type":"string"},"start_line":{"description":"First line to return, from 1.","type":"integer"}},"required":["key"],"type":"object"}},"type":"function"}"#
        );
        // compress_context as it was before the recall tool took a range.
        assert_eq!(
            chat(COMPRESS_TOOL),
            json!({"type": "function", "function": {"name": COMPRESS_TOOL,
                "description": COMPRESS_DESCRIPTION, "parameters": {"type": "object",
                "properties": {"reason": {"type": "string", "description": REASON_DESCRIPTION}},
                "required": ["reason"], "additionalProperties": false}}})
            .to_string()
        );
        assert!(SEARCH_DESCRIPTION.contains(&format!(
            "with {} lines around",
            crate::recall::read::CONTEXT
        )));
        // Responses: strict only where every parameter is required (OpenAI
        // rejects a strict schema with optional ones).
        let responses = |name| definition(Format::Responses.api(), name);
        assert_eq!(responses(RECALL_TOOL)["strict"], false);
        assert_eq!(responses(COMPRESS_TOOL)["strict"], true);
        let messages = definition(Format::Messages.api(), RECALL_TOOL);
        assert_eq!(messages["input_schema"]["required"], json!(["key"]));
    }

    #[test]
    fn recall_arguments_are_read_from_a_string_or_an_object() {
        let read = |args: Value| Call::read(None, Some(&json!(RECALL_TOOL)), Some(&args)).0;
        let string = read(json!(
            r#"{"key":"abcdefgh","start_line":120,"end_line":"180","search":"Error"}"#
        ));
        let object = read(
            json!({"key": "abcdefgh", "start_line": "120", "end_line": 180.0,
            "search": "Error"}),
        );
        assert_eq!(string, object);
        assert_eq!(string.argument.as_deref(), Some("abcdefgh"));
        assert_eq!(
            string.part,
            Part {
                start_line: Some(Ok(120)),
                end_line: Some(Ok(180)),
                search: Some(Ok("Error".into())),
            }
        );
        // Null and empty are "not given"; a key alone asks for all of it.
        let blank = read(
            json!({"key": "abcdefgh", "start_line": null, "end_line": " ",
            "search": null}),
        );
        assert_eq!(blank.part, Part::default());
        assert_eq!(
            read(json!({"key": 12345678})).argument.as_deref(),
            Some("12345678")
        );
        // What is not a line number is kept, shortened, to be named.
        let bad = read(json!({"key": "k", "start_line": "ten", "end_line": -3,
            "search": {"a": 1}}));
        assert_eq!(bad.part.start_line, Some(Err("\"ten\"".into())));
        assert_eq!(bad.part.end_line, Some(Err("-3".into())));
        assert_eq!(bad.part.search, Some(Err("an object".into())));
        let long = read(json!({"key": "k", "start_line": "x".repeat(1000), "end_line": 1.5}));
        assert_eq!(
            long.part.start_line,
            Some(Err(format!("\"{}\"…", "x".repeat(40))))
        );
        assert_eq!(long.part.end_line, Some(Err("1.5".into())));
        let huge = read(json!({"key": "k", "start_line": "99999999999999999999999"}));
        assert_eq!(huge.part.start_line, Some(Ok(u64::MAX)));
        // Arguments that are no object: nothing read.
        assert_eq!(read(json!("{not json")).part, Part::default());
        assert_eq!(read(json!([1, 2])).argument, None);
        // compress_context's reason still reads.
        let reason = Call::read(
            None,
            Some(&json!(COMPRESS_TOOL)),
            Some(&json!({"reason": "done"})),
        );
        assert_eq!(reason.0.argument.as_deref(), Some("done"));
    }

    #[test]
    fn messages_and_responses_turns_keep_their_rules() {
        let answer = json!({"type": "message", "role": "assistant", "stop_reason": "tool_use", "content": [
            {"type": "thinking", "thinking": "t", "signature": "s"},
            {"type": "tool_use", "id": "tu1", "name": RECALL_TOOL, "input": {"key": "abcdefgh"}}],
            "usage": {"input_tokens": 5, "output_tokens": 1}});
        let a = Answer::parse(Format::Messages.api(), answer.to_string().as_bytes()).unwrap();
        let sent = body(
            json!({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}),
        );
        let v: Value = serde_json::from_slice(
            &a.follow_up(&sent, &[("tu1".into(), "orig".into())])
                .unwrap(),
        )
        .unwrap();
        let m = v["messages"].as_array().unwrap();
        assert_eq!(m[1]["content"][0]["signature"], "s");
        assert_eq!(m[2]["content"][0]["tool_use_id"], "tu1");
        let shown: Value = serde_json::from_slice(&a.for_client(&Sum::default())).unwrap();
        assert_eq!(shown["stop_reason"], "end_turn");
        assert_eq!(shown["content"].as_array().unwrap().len(), 1);

        let answer = json!({"object": "response", "output": [
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "e"},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": RECALL_TOOL, "arguments": "{\"key\":\"abcdefgh\"}", "status": "completed"}]});
        let a = Answer::parse(Format::Responses.api(), answer.to_string().as_bytes()).unwrap();
        let sent = body(json!({"model": "m", "input": "hi"}));
        let v: Value =
            serde_json::from_slice(&a.follow_up(&sent, &[("c1".into(), "orig".into())]).unwrap())
                .unwrap();
        let input = v["input"].as_array().unwrap();
        assert_eq!(input.len(), 4, "{input:?}");
        assert_eq!(input[1]["id"], "rs_2");
        assert!(input[2].get("id").is_none());
        assert_eq!(input[3]["output"], "orig");
    }

    #[test]
    fn an_appended_turn_leaves_the_clients_bytes_as_they_were() {
        // Keys out of order and spaces, as a client may write them.
        let first = r#"{"role":"user","content":[{"type":"text","text":"<system-reminder>\u00e9</system-reminder>"}]}"#;
        let sent = Bytes::from(format!(
            r#"{{"model":"m","messages":[ {first} , {{"role":"assistant","content":"ok"}} ],"stream":true}}"#
        ));
        let turn = [json!({"role": "user", "content": "more"})];
        let out = append(&sent, "messages", &turn).unwrap();
        let text = std::str::from_utf8(&out).unwrap();
        assert!(
            text.contains(&format!(
                r#"[ {first} , {{"role":"assistant","content":"ok"}} ,{{"#
            )),
            "{text}"
        );
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["messages"].as_array().unwrap().len(), 3);
        assert_eq!(v["messages"][2]["content"], "more");
        assert_eq!(v["stream"], true);
        // An empty list, and a string input, take the items alone.
        let empty = append(&Bytes::from(r#"{"input":[ ]}"#), "input", &turn).unwrap();
        let v: Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(v["input"], json!([{"role": "user", "content": "more"}]));
        let string = append(&Bytes::from(r#"{"input":"hi"}"#), "input", &turn).unwrap();
        let v: Value = serde_json::from_slice(&string).unwrap();
        assert_eq!(v["input"][0]["content"], "hi");
        assert_eq!(v["input"][1]["content"], "more");
        assert!(append(&Bytes::from(r#"{"messages":"hi"}"#), "messages", &turn).is_none());
    }
}
