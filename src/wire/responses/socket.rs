//! The Responses WebSocket mode's messages, and what a socket remembers.
//!
//! On a socket (`GET /v1/responses` upgraded) the client sends
//! `response.create` messages: the fields of a Responses request at the top
//! level, only the new input items, and `previous_response_id` naming the
//! response they continue (Codex sends a warm-up with `generate: false`
//! first, then each turn chained to the last). The server answers with the
//! events an SSE stream carries, one JSON text message each, and errors as
//! `{"type":"error","status":…,"error":{…}}`.
//!
//! condense holds the conversation itself ([`History`]): for each response
//! id, the items it continued from, its new input and its output. Each
//! `response.create` becomes a full stateless request ([`Create::body`]),
//! which goes through the same pipeline as an HTTP request: the history
//! lives here, not on the upstream, so it can be compacted.
//!
//! A socket's history is bounded in bytes: the oldest responses are
//! forgotten first (a later `previous_response_id` naming one gets
//! `previous_response_not_found`, and the client sends its whole input
//! again, as it does when OpenAI's own cache misses).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::chat::RawObject;
use crate::chat::object::elements;

/// Fields of a `response.create` that belong to the socket, not to the
/// request: they are not sent upstream.
const ENVELOPE: &[&str] = &[
    "type",
    "generate",
    "previous_response_id",
    "stream",
    "stream_id",
    "client_metadata",
    "background",
];

/// Why a client message gets an error event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub code: Option<&'static str>,
    pub message: String,
    pub param: Option<&'static str>,
}

impl Refusal {
    fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Refusal {
        Refusal {
            status: 400,
            code: None,
            message: message.into(),
            param,
        }
    }

    /// A `previous_response_id` this socket does not hold.
    pub fn not_found(id: &str) -> Refusal {
        Refusal {
            status: 400,
            code: Some("previous_response_not_found"),
            message: format!("Previous response with id '{id}' not found."),
            param: Some("previous_response_id"),
        }
    }

    /// The error event, as OpenAI sends one on a socket.
    pub fn event(&self) -> Value {
        error_event(
            self.status,
            json!({"type": error_type(self.status), "code": self.code,
                "message": self.message, "param": self.param}),
        )
    }
}

/// The `type` of an error of `status`, as OpenAI names them.
fn error_type(status: u16) -> &'static str {
    match status {
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// An error event carrying `error` (an error object in OpenAI's shape).
pub fn error_event(status: u16, error: Value) -> Value {
    json!({"type": "error", "status": status, "error": error})
}

/// The error event for a request the pipeline answered with `status` and
/// `body` (an error body of the HTTP API, or anything else).
pub fn http_error_event(status: u16, body: &[u8]) -> Value {
    let error = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").filter(|e| e.is_object()).cloned())
        .unwrap_or_else(|| {
            json!({"type": error_type(status), "code": null,
                "message": String::from_utf8_lossy(&body[..body.len().min(2000)]), "param": null})
        });
    error_event(status, error)
}

/// A `response.create` message, read.
#[derive(Debug)]
pub struct Create {
    /// The request's own fields, in the client's order (none of the
    /// envelope's, no `input`).
    fields: RawObject,
    /// The new input items, each as its bytes.
    pub input: Vec<Bytes>,
    pub previous: Option<String>,
    /// False for a warm-up (`generate: false`): no answer is generated.
    pub generate: bool,
    /// The `x-` entries of `client_metadata`: what a client sends on a
    /// socket in place of the headers it sends with each HTTP request
    /// (Codex: `x-codex-turn-metadata`, `x-codex-turn-state`, ...).
    pub headers: Vec<(String, String)>,
}

/// Headers taken from one message's `client_metadata`, at most.
const MAX_METADATA_HEADERS: usize = 16;
/// Longest header value taken from `client_metadata`.
const MAX_METADATA_VALUE: usize = 8 * 1024;

impl Create {
    /// Reads a client message.
    pub fn parse(text: &[u8]) -> Result<Create, Refusal> {
        let src = Bytes::copy_from_slice(text);
        let mut fields = RawObject::parse(&src).map_err(|e| {
            Refusal::invalid(format!("The message is not a JSON object: {e}"), None)
        })?;
        let kind: Option<String> = fields
            .get("type")
            .and_then(|t| serde_json::from_slice(t).ok());
        match kind.as_deref() {
            Some("response.create") => {}
            Some(other) => {
                return Err(Refusal::invalid(
                    format!("Unsupported event type '{other}': condense serves 'response.create'."),
                    Some("type"),
                ));
            }
            None => {
                return Err(Refusal::invalid(
                    "The message has no event 'type'.",
                    Some("type"),
                ));
            }
        }
        let generate = !matches!(fields.get("generate"), Some(g) if g.trim_ascii() == b"false");
        let previous = match fields.get("previous_response_id") {
            None => None,
            Some(raw) => serde_json::from_slice::<Option<String>>(raw).map_err(|_| {
                Refusal::invalid(
                    "'previous_response_id' must be a string.",
                    Some("previous_response_id"),
                )
            })?,
        };
        let input = match fields.get("input").map(<[u8]>::trim_ascii) {
            None | Some(b"null") => Vec::new(),
            Some(raw) if raw.first() == Some(&b'"') => {
                let text: String = serde_json::from_slice(raw)
                    .map_err(|_| Refusal::invalid("'input' is not valid.", Some("input")))?;
                let item = json!({"type": "message", "role": "user", "content": text});
                vec![Bytes::from(item.to_string())]
            }
            Some(raw) => {
                let mut items = Vec::new();
                elements(raw, |e| items.push(Bytes::copy_from_slice(e))).ok_or_else(|| {
                    Refusal::invalid("'input' must be a string or a list.", Some("input"))
                })?;
                items
            }
        };
        let headers = fields
            .get("client_metadata")
            .and_then(|m| serde_json::from_slice::<serde_json::Map<String, Value>>(m).ok())
            .map(|m| {
                m.into_iter()
                    .filter_map(|(k, v)| match v {
                        Value::String(v)
                            if k.len() > 2
                                && k[..2].eq_ignore_ascii_case("x-")
                                && v.len() <= MAX_METADATA_VALUE =>
                        {
                            Some((k.to_ascii_lowercase(), v))
                        }
                        _ => None,
                    })
                    .take(MAX_METADATA_HEADERS)
                    .collect()
            })
            .unwrap_or_default();
        for key in ENVELOPE.iter().chain(&["input"]) {
            fields.remove(key);
        }
        Ok(Create {
            fields,
            input,
            previous,
            generate,
            headers,
        })
    }

    /// The stateless request this message stands for: its fields, the
    /// whole `input` (the history it continues, then its new items),
    /// streamed, not stored unless the client asked for it.
    pub fn body(&self, input: &[Bytes]) -> Bytes {
        let mut fields = self.fields.clone();
        let mut list = Vec::with_capacity(input.iter().map(|i| i.len() + 1).sum::<usize>() + 2);
        list.push(b'[');
        for (n, item) in input.iter().enumerate() {
            if n > 0 {
                list.push(b',');
            }
            list.extend_from_slice(item);
        }
        list.push(b']');
        fields.set("input", Bytes::from(list));
        fields.set("stream", Bytes::from_static(b"true"));
        if fields.get("store").is_none() {
            fields.set("store", Bytes::from_static(b"false"));
        }
        Bytes::from(fields.to_vec())
    }

    /// The model the request names, if any.
    pub fn model(&self) -> Option<String> {
        serde_json::from_slice(self.fields.get("model")?).ok()
    }
}

/// The events that answer a warm-up (`generate: false`): the response is
/// created and completed at once, with no output, under `id`.
pub fn warmup_events(id: &str, model: Option<&str>, created_at: u64) -> [Value; 2] {
    let response = |status: &str| {
        json!({"id": id, "object": "response", "created_at": created_at, "status": status,
            "model": model, "output": [], "usage": null})
    };
    let mut done = response("completed");
    done["usage"] = json!({"input_tokens": 0, "output_tokens": 0, "total_tokens": 0});
    [
        json!({"type": "response.created", "sequence_number": 0, "response": response("in_progress")}),
        json!({"type": "response.completed", "sequence_number": 1, "response": done}),
    ]
}

/// The event `data` with condense's report (`x-condense-*` as the HTTP
/// route sends them: tokens before and after, actions) in the `metadata`
/// of the response it carries, when it is the event that starts or ends
/// the response; None for any other event (it goes as it came). A socket
/// has no headers per turn: the response's metadata is where they fit.
pub fn with_report(data: &[u8], report: &[(&str, String)]) -> Option<Vec<u8>> {
    const CARRIERS: [&[u8]; 3] = [
        b"response.created",
        b"response.completed",
        b"response.incomplete",
    ];
    if report.is_empty()
        || !CARRIERS
            .iter()
            .any(|c| memchr::memmem::find(data, c).is_some())
    {
        return None;
    }
    let mut v: Value = serde_json::from_slice(data).ok()?;
    let kind = v.get("type").and_then(Value::as_str)?;
    if !CARRIERS.iter().any(|c| c == &kind.as_bytes()) {
        return None;
    }
    let response = v.get_mut("response").filter(|r| r.is_object())?;
    if !response.get("metadata").is_some_and(Value::is_object) {
        response["metadata"] = json!({});
    }
    for (k, val) in report {
        response["metadata"][*k] = json!(val);
    }
    serde_json::to_vec(&v).ok()
}

/// What one streamed response told, read from its events: its id and its
/// output items.
#[derive(Debug, Default)]
pub struct Outcome {
    pub id: Option<String>,
    /// The items of `response.output_item.done` events, by output index.
    done: Vec<(u64, Bytes)>,
    /// The `output` of `response.completed` (or `response.incomplete`),
    /// when it had one.
    completed: Option<Vec<Bytes>>,
    /// Whether the response ended: completed, or incomplete (cut at
    /// `max_output_tokens`, say). Either can be continued with
    /// `previous_response_id`, so either is remembered.
    pub finished: bool,
    /// Whether it ended incomplete.
    pub incomplete: bool,
    /// Whether it ended in failure: `response.failed`, or an `error` event
    /// (the upstream's, or the relay's own when the stream broke off).
    pub failed: bool,
}

impl Outcome {
    /// Reads one event's data. The items are kept as the upstream wrote
    /// them (the client sends them back so after a reconnect, and condense
    /// compacts by their bytes).
    pub fn event(&mut self, data: &[u8]) {
        #[derive(Deserialize)]
        struct Event<'a> {
            #[serde(rename = "type", borrow)]
            kind: Option<Cow<'a, str>>,
            output_index: Option<u64>,
            #[serde(borrow)]
            item: Option<&'a RawValue>,
            #[serde(borrow)]
            response: Option<Response<'a>>,
        }
        #[derive(Deserialize)]
        struct Response<'a> {
            #[serde(borrow)]
            id: Option<Cow<'a, str>>,
            #[serde(borrow)]
            output: Option<Vec<&'a RawValue>>,
        }
        let Ok(e) = serde_json::from_slice::<Event>(data) else {
            return;
        };
        let raw = |v: &RawValue| Bytes::copy_from_slice(v.get().as_bytes());
        let id = e.response.as_ref().and_then(|r| r.id.as_deref());
        if let Some(id) = id
            && self.id.is_none()
        {
            self.id = Some(id.to_string());
        }
        match e.kind.as_deref() {
            Some("response.output_item.done") => {
                if let (Some(i), Some(item)) = (e.output_index, e.item)
                    && item.get().starts_with('{')
                {
                    self.done.push((i, raw(item)));
                }
            }
            Some(kind @ ("response.completed" | "response.incomplete")) => {
                self.finished = true;
                self.incomplete = kind == "response.incomplete";
                if let Some(id) = id {
                    self.id = Some(id.to_string());
                }
                self.completed = e
                    .response
                    .and_then(|r| r.output)
                    .filter(|o| !o.is_empty())
                    .map(|o| o.into_iter().map(raw).collect());
            }
            Some("response.failed" | "error") => self.failed = true,
            _ => {}
        }
    }

    /// The response's output items, taken out of the outcome.
    pub fn take_output(&mut self) -> Vec<Bytes> {
        if let Some(output) = self.completed.take() {
            return output;
        }
        let mut done = std::mem::take(&mut self.done);
        done.sort_by_key(|(i, _)| *i);
        done.into_iter().map(|(_, item)| item).collect()
    }
}

/// Bytes a held item costs besides its own: its handle and allocation.
const ITEM_OVERHEAD: usize = 48;
/// Bytes a held response costs besides its items and id: its turn, its
/// entries in the map and the order.
const TURN_OVERHEAD: usize = 160;

/// A socket's conversation: every response it made, by id.
pub struct History {
    responses: HashMap<String, Arc<Turn>>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    /// Bytes of every turn still held (a forgotten response's turn stays
    /// while a later one continues it).
    live: Arc<AtomicUsize>,
    cap: usize,
}

/// One response: what it continued, its new input and its output.
struct Turn {
    parent: Option<Arc<Turn>>,
    items: Vec<Bytes>,
    bytes: usize,
    live: Arc<AtomicUsize>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.live.fetch_sub(self.bytes, Ordering::Relaxed);
        // A long chain is let go one turn at a time, not by recursion.
        let mut next = self.parent.take();
        while let Some(turn) = next {
            next = match Arc::try_unwrap(turn) {
                Ok(mut t) => t.parent.take(),
                Err(_) => None,
            };
        }
    }
}

impl History {
    /// A history of at most about `cap` bytes.
    pub fn new(cap: usize) -> History {
        History {
            responses: HashMap::new(),
            order: VecDeque::new(),
            live: Arc::new(AtomicUsize::new(0)),
            cap,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The whole input of a request continuing `previous` with `new`.
    pub fn input(&self, previous: Option<&str>, new: &[Bytes]) -> Result<Vec<Bytes>, Refusal> {
        let mut chain = Vec::new();
        if let Some(id) = previous {
            let mut at = Some(
                self.responses
                    .get(id)
                    .ok_or_else(|| Refusal::not_found(id))?,
            );
            while let Some(turn) = at {
                chain.push(turn);
                at = turn.parent.as_ref();
            }
        }
        let n = chain.iter().map(|t| t.items.len()).sum::<usize>() + new.len();
        let mut items = Vec::with_capacity(n);
        for turn in chain.iter().rev() {
            items.extend(turn.items.iter().cloned());
        }
        items.extend(new.iter().cloned());
        Ok(items)
    }

    /// Records response `id`: it continued `previous` with `input` and
    /// answered `output`. The oldest responses are forgotten past the cap.
    pub fn record(
        &mut self,
        id: &str,
        previous: Option<&str>,
        input: Vec<Bytes>,
        output: Vec<Bytes>,
    ) {
        let parent = previous.and_then(|p| self.responses.get(p).cloned());
        let mut items = input;
        items.extend(output);
        // What the turn holds besides its items' bytes counts too: a client
        // that sends warm-ups without input must not grow the map unbounded.
        let bytes = items.iter().map(|i| i.len() + ITEM_OVERHEAD).sum::<usize>()
            + TURN_OVERHEAD
            + 2 * id.len();
        self.live.fetch_add(bytes, Ordering::Relaxed);
        let turn = Arc::new(Turn {
            parent,
            items,
            bytes,
            live: self.live.clone(),
        });
        if self.responses.insert(id.to_string(), turn).is_none() {
            self.order.push_back(id.to_string());
        }
        while self.bytes() > self.cap && self.order.len() > 1 {
            if let Some(old) = self.order.pop_front() {
                self.responses.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(text: &str) -> Bytes {
        Bytes::from(json!({"type": "message", "role": "user", "content": text}).to_string())
    }

    #[test]
    fn a_create_is_read_and_becomes_a_whole_stateless_request() {
        let msg = br#"{"type":"response.create","model":"gpt-x","generate":false,"stream":true,
            "previous_response_id":"resp_1","input":[{"type":"message","role":"user","content":"hi"}],
            "tools":[],"client_metadata":{"a":"b","x-codex-turn-metadata":"{\"turn_id\":\"t1\"}","x-n":7}}"#;
        let c = Create::parse(msg).unwrap();
        assert!(!c.generate);
        assert_eq!(c.previous.as_deref(), Some("resp_1"));
        assert_eq!(c.input.len(), 1);
        assert_eq!(c.model().as_deref(), Some("gpt-x"));
        // Its `x-` metadata strings are the turn's headers.
        assert_eq!(
            c.headers,
            [(
                "x-codex-turn-metadata".to_string(),
                r#"{"turn_id":"t1"}"#.to_string()
            )]
        );
        let body: Value = serde_json::from_slice(&c.body(&[item("a"), item("b")])).unwrap();
        assert_eq!(body["input"].as_array().unwrap().len(), 2);
        assert_eq!(body["stream"], true);
        assert_eq!(body["store"], false);
        for gone in [
            "type",
            "generate",
            "previous_response_id",
            "client_metadata",
        ] {
            assert!(body.get(gone).is_none(), "{gone}");
        }
        // The client's fields keep their order.
        let text = String::from_utf8(c.body(&[]).to_vec()).unwrap();
        assert!(text.starts_with(r#"{"model":"gpt-x","tools":[]"#), "{text}");

        let c =
            Create::parse(br#"{"type":"response.create","input":"hello","store":true}"#).unwrap();
        assert!(c.generate);
        let body: Value = serde_json::from_slice(&c.body(&c.input)).unwrap();
        assert_eq!(body["input"][0]["content"], "hello");
        assert_eq!(body["store"], true);

        for bad in [
            &br#"{"type":"response.cancel"}"#[..],
            br#"{"model":"x"}"#,
            br#"[1]"#,
            br#"{"type":"response.create","input":7}"#,
            br#"{"type":"response.create","previous_response_id":7}"#,
        ] {
            let e = Create::parse(bad).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.event()["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn the_history_chains_responses_and_forgets_the_oldest_past_its_cap() {
        let mut h = History::new(10_000);
        assert!(h.input(Some("resp_x"), &[]).is_err());
        let e = h.input(Some("resp_x"), &[]).unwrap_err();
        assert_eq!(e.event()["error"]["code"], "previous_response_not_found");
        h.record("r1", None, vec![item("a")], vec![item("A")]);
        h.record("r2", Some("r1"), vec![item("b")], vec![item("B")]);
        let all = h.input(Some("r2"), &[item("c")]).unwrap();
        let texts: Vec<String> = all
            .iter()
            .map(|b| {
                serde_json::from_slice::<Value>(b).unwrap()["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(texts, ["a", "A", "b", "B", "c"]);
        // A fork from r1 leaves r2 alone.
        assert_eq!(h.input(Some("r1"), &[]).unwrap().len(), 2);

        // Past the cap the oldest ids go; a turn still continued stays in
        // memory (and counted) through the one that continues it.
        let mut h = History::new(300);
        let big = item(&"x".repeat(100));
        h.record("r1", None, vec![big.clone()], vec![]);
        h.record("r2", Some("r1"), vec![big.clone()], vec![]);
        h.record("r3", Some("r2"), vec![big.clone()], vec![]);
        assert!(h.input(Some("r1"), &[]).is_err());
        assert_eq!(h.input(Some("r3"), &[]).unwrap().len(), 3);
        assert!(h.bytes() > 300);
        drop(h);

        // Responses without input still count: a client cannot grow the
        // map past the cap with empty warm-ups.
        let mut h = History::new(100_000);
        for n in 0..100_000 {
            h.record(&format!("resp_{n}"), None, Vec::new(), Vec::new());
        }
        assert!(h.responses.len() < 1000, "{}", h.responses.len());
        assert!(h.bytes() <= 100_000);

        // A long chain is let go without deep recursion.
        let mut h = History::new(usize::MAX);
        let mut prev: Option<String> = None;
        for n in 0..200_000 {
            let id = format!("r{n}");
            h.record(&id, prev.as_deref(), vec![Bytes::from_static(b"1")], vec![]);
            prev = Some(id);
        }
        let live = h.live.clone();
        drop(h);
        assert_eq!(live.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_outcome_reads_the_id_and_the_output_as_the_upstream_wrote_it() {
        let mut o = Outcome::default();
        o.event(br#"{"type":"response.created","response":{"id":"resp_1","output":[]}}"#);
        o.event(
            br#"{"type":"response.output_item.done","output_index":1,"item":{"id":"b","a":1}}"#,
        );
        o.event(br#"{"type":"response.output_item.done","output_index":0,"item":{"id":"a"}}"#);
        o.event(b"not json");
        assert!(!o.finished);
        o.event(br#"{"type":"response.completed","response":{"id":"resp_1","output":[]}}"#);
        assert!(o.finished && !o.incomplete);
        assert_eq!(o.id.as_deref(), Some("resp_1"));
        // In output-index order, each item's bytes (and key order) kept.
        assert_eq!(
            o.take_output(),
            [
                Bytes::from(r#"{"id":"a"}"#),
                Bytes::from(r#"{"id":"b","a":1}"#)
            ]
        );
        // A response cut at max_output_tokens ends with response.incomplete
        // and its output so far: it ended, and can be continued.
        let mut o = Outcome::default();
        o.event(br#"{"type":"response.created","response":{"id":"resp_2","output":[]}}"#);
        o.event(
            br#"{"type":"response.incomplete","response":{"id":"resp_2","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[{"type":"reasoning","id":"rs_1","summary":[]}]}}"#,
        );
        assert!(o.finished && o.incomplete);
        assert_eq!(o.id.as_deref(), Some("resp_2"));
        assert_eq!(
            o.take_output(),
            [Bytes::from(
                r#"{"type":"reasoning","id":"rs_1","summary":[]}"#
            )]
        );
        let report = [("condense_actions", "mask".to_string())];
        let start = with_report(
            br#"{"type":"response.created","response":{"id":"r","metadata":{"a":"b"}}}"#,
            &report,
        )
        .unwrap();
        let start: Value = serde_json::from_slice(&start).unwrap();
        assert_eq!(
            start["response"]["metadata"],
            json!({"a": "b", "condense_actions": "mask"})
        );
        let end = with_report(
            br#"{"type":"response.completed","response":{"id":"r"}}"#,
            &report,
        );
        assert!(end.is_some());
        // Other events go as they came, even ones that mention the name.
        let delta = br#"{"type":"response.output_text.delta","delta":"response.created"}"#;
        assert!(with_report(delta, &report).is_none());
        assert!(with_report(br#"{"type":"response.created","response":{}}"#, &[]).is_none());
        // A response or a metadata that is not an object: the event goes
        // as it came, or gets a metadata object in place of the odd one.
        assert!(with_report(br#"{"type":"response.created","response":7}"#, &report).is_none());
        assert!(with_report(br#"{"type":"response.created","response":[1]}"#, &report).is_none());
        let odd = with_report(
            br#"{"type":"response.completed","response":{"id":"r","metadata":[1]}}"#,
            &report,
        )
        .unwrap();
        let odd: Value = serde_json::from_slice(&odd).unwrap();
        assert_eq!(
            odd["response"]["metadata"],
            json!({"condense_actions": "mask"})
        );
        let [created, done] = warmup_events("resp_w", Some("m"), 1);
        assert_eq!(created["response"]["status"], "in_progress");
        assert_eq!(done["response"]["output"], json!([]));
        assert_eq!(
            http_error_event(
                401,
                br#"{"error":{"message":"bad key","type":"invalid_request_error"}}"#
            )["error"]["message"],
            "bad key"
        );
        assert_eq!(
            http_error_event(502, b"gateway")["error"]["type"],
            "server_error"
        );
    }

    proptest::proptest! {
        /// Any message is read or refused, never a panic; any history is
        /// held within its cap, but for the chain of the newest turn.
        #[test]
        fn any_message_and_any_history_stay_in_bounds(
            text in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            turns in proptest::collection::vec((0usize..40, 0usize..5, 0usize..400), 1..60),
        ) {
            let _ = Create::parse(&text);
            let json = format!(r#"{{"type":"response.create","input":{}}}"#, String::from_utf8_lossy(&text));
            if let Ok(c) = Create::parse(json.as_bytes()) {
                let _ = c.body(&c.input);
            }
            let mut h = History::new(4_000);
            for (n, (parent, items, size)) in turns.iter().enumerate() {
                let previous = format!("r{}", n.saturating_sub(1 + parent));
                let input = vec![Bytes::from(vec![b'x'; *size]); *items];
                let _ = h.input(Some(&previous), &input);
                h.record(&format!("r{n}"), Some(&previous), input, Vec::new());
                // Past the cap only what the newest turn continues is held.
                let chain: usize = h.input(Some(&format!("r{n}")), &[]).unwrap().iter().map(|b| b.len() + ITEM_OVERHEAD).sum::<usize>()
                    + (n + 1) * (TURN_OVERHEAD + 2 * 4);
                proptest::prop_assert!(h.bytes() <= 4_000 + chain);
            }
        }
    }
}
