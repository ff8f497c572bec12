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
use serde_json::{Value, json};

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

const RECALL_DESCRIPTION: &str = "Returns the original text of something condense shortened or removed to fit the context window: a tool output, call arguments or earlier turns. Pass the key shown as `recall key: K` next to what was cut. Call it alone, when you need the exact text again.";
const KEY_DESCRIPTION: &str = "The recall key, as shown after `recall key:`.";
const COMPRESS_DESCRIPTION: &str = "Tells condense that a task or subtask is finished: the conversation up to here may then be compacted (older tool output shortened or summarized) from the next request on. Call it alone, at a task boundary, when the details so far will not be needed verbatim.";
const REASON_DESCRIPTION: &str = "What was finished, in a few words.";

/// What condense's tools ask of an API: their definitions in its shape,
/// their calls read from its answers, and its turn that answers them.
pub trait OwnTools: Sync + std::fmt::Debug {
    /// One of condense's tools in this API's shape.
    fn tool(&self, name: &str, description: &str, schema: Value) -> Value;

    /// The tool calls of an answer, with whether each is condense's own.
    fn calls(&self, answer: &Value) -> Vec<(Call, bool)>;

    /// The request that carries the results of condense's calls `ours`:
    /// `sent` with the answer's turn appended (the client's own calls left
    /// out) and one result per call.
    fn follow_up(
        &self,
        answer: &Value,
        ours: &[Call],
        sent: &Bytes,
        results: &[(String, String)],
    ) -> Option<Bytes>;

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

/// One of condense's tools in `api`'s shape.
pub fn definition(api: &dyn OwnTools, name: &str) -> Value {
    let (description, param, param_description) = match name {
        COMPRESS_TOOL => (COMPRESS_DESCRIPTION, "reason", REASON_DESCRIPTION),
        _ => (RECALL_DESCRIPTION, "key", KEY_DESCRIPTION),
    };
    let schema = json!({
        "type": "object",
        "properties": {param: {"type": "string", "description": param_description}},
        "required": [param],
        "additionalProperties": false,
    });
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

/// A call of one of condense's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The call's one string argument (`key` or `reason`), if it gave one.
    pub argument: Option<String>,
}

impl Call {
    /// A call of `name` (with `id` and its `arguments`: a JSON string or
    /// object), and whether it is one of condense's own.
    pub(super) fn read(
        id: Option<&Value>,
        name: Option<&Value>,
        arguments: Option<&Value>,
    ) -> (Call, bool) {
        let call = Call {
            id: text(id),
            name: text(name),
            argument: argument(arguments),
        };
        let own = is_own_tool(&call.name);
        (call, own)
    }
}

/// A string value, or "" when it is not one.
pub(super) fn text(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or("").to_string()
}

/// The one string argument of a call (`key` or `reason`) in its
/// arguments, a JSON object or a string holding one.
fn argument(v: Option<&Value>) -> Option<String> {
    let obj = match v? {
        Value::String(s) => serde_json::from_str::<Value>(s).ok()?,
        other => other.clone(),
    };
    let o = obj.as_object()?;
    // A key of digits may come back as a number.
    match o.get("key").or_else(|| o.get("reason"))? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
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

    /// How many calls of the client's own tools the answer makes.
    pub fn theirs(&self) -> usize {
        self.calls().iter().filter(|(_, own)| !own).count()
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
                argument: Some("abcdefgh".into())
            }]
        );
        assert_eq!(a.theirs(), 1);
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
