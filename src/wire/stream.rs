//! condense's tools in a streamed answer: [`Gather`] reads the events of
//! one answer, tells as early as it can whether the answer starts with a
//! call of condense's tools, and gathers the events into the answer a JSON
//! response would have been; [`Filter`] edits the events the client gets.
//!
//! The filter takes out a call of condense's tools that comes after text
//! (or a call of the client's) already went out, and adds the usage of the
//! rounds condense answered. When the stream may go on (`continuable`), it
//! holds the events that end the answer (`Edit::Hold`) instead: condense
//! answers the call and the next round's events continue the same answer
//! ([`Filter::next_round`]): its start is not repeated, indices go on from
//! where the client's are, and its end (the final round's stop reason, the
//! usage of every round) ends the answer. What an event of each API means
//! is the API's (`StreamEdit`); the state and what all APIs share is here.

use serde_json::{Value, json};

use super::tools::{Answer, COMPRESS_TOOL, OwnTools, RECALL_TOOL, is_own_tool};
use super::usage::Sum;

/// What a streamed answer asks of an API: what its events mean for
/// condense's tools.
pub trait StreamEdit: OwnTools {
    /// Reads one streamed event's data into a gathered answer.
    fn gather(&self, g: &mut Gather, data: &Value) -> Decision;

    /// Finishes a gathered answer.
    fn gathered(&self, _g: &mut Gather) {}

    /// Edits one streamed event the client gets.
    fn filter(&self, f: &mut Filter, data: &mut Value) -> Edit;
}

/// Whether a tool name is one of condense's.
pub(super) fn ours(name: Option<&str>) -> bool {
    name.is_some_and(is_own_tool)
}

/// What a tool name (or its first pieces, as some servers stream it) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Named {
    /// One of condense's tools, or the start of one that none of the
    /// client's tools starts with.
    Ours,
    /// The start of one of condense's tools and of a client's tool alike.
    Unknown,
    Theirs,
}

pub(super) fn named(name: &str, client_tools: &[String]) -> Named {
    if is_own_tool(name) {
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

/// `piece` added to the string at `v` (which becomes one when it is not),
/// in place: a long answer comes in many pieces.
pub(super) fn append_text(v: &mut Value, piece: &str) {
    match v {
        Value::String(s) => s.push_str(piece),
        other => *other = Value::String(piece.to_string()),
    }
}

pub(super) fn str_at<'a>(v: &'a Value, at: &str) -> Option<&'a str> {
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
    api: &'static dyn StreamEdit,
    /// The answer so far, in its API's JSON shape.
    pub(super) value: Value,
    /// Chat: the tool calls by index.
    pub(super) calls: Vec<Value>,
    /// Messages: a tool_use block's input JSON by block index.
    pub(super) partial: Vec<(usize, String)>,
    decision: Decision,
    /// The names of the client's tools.
    pub(super) client_tools: Vec<String>,
}

impl Gather {
    pub fn new(api: &'static dyn StreamEdit) -> Gather {
        Gather {
            api,
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
        let now = self.api.gather(self, data);
        if self.decision == Decision::Hold {
            self.decision = now;
        }
        self.decision
    }

    /// The gathered answer (None when the stream gave none).
    pub fn answer(mut self) -> Option<Answer> {
        self.api.gathered(&mut self);
        self.value.is_object().then_some(Answer {
            api: self.api,
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
    /// It ends the answer (as changed, when it was): held until it is
    /// known whether the answer goes on with another round.
    Hold,
}

/// Edits the events of the answer the client gets.
pub struct Filter {
    api: &'static dyn StreamEdit,
    /// The usage of the rounds condense answered.
    pub(super) extra: Sum,
    /// Indices (tool call, content block or output item) of condense's
    /// calls taken out of this round so far.
    pub(super) dropped: Vec<u64>,
    /// Whether a call of the client's went by (in any round).
    pub(super) client_calls: bool,
    /// How many calls were taken out of this round.
    pub stripped: usize,
    /// The names of the client's tools.
    pub(super) client_tools: Vec<String>,
    /// Chat: the name of each tool call of this round so far, by index.
    pub(super) names: Vec<(u64, String)>,
    /// Whether the events that end the answer are held (another round may
    /// continue it).
    pub continuable: bool,
    /// The rounds the client saw before this one.
    pub(super) round: usize,
    /// Indices the client saw in the rounds before: this round's go on
    /// from there.
    pub(super) offset: u64,
    /// Indices the client saw in this round (the highest, plus one).
    pub(super) shown: u64,
    /// Chat: whether the client saw text, and whether this round's first
    /// text is to be set apart from it.
    pub(super) texted: bool,
    pub(super) apart: bool,
    /// The first round's id (chat's chunk id, a response's id): later
    /// rounds' events carry it.
    pub(super) first_id: Option<Value>,
    /// Responses: the next event's sequence number, once renumbered.
    pub(super) next_seq: Option<u64>,
    /// Responses: the output items the client saw, in rounds before and in
    /// the held end of this one.
    pub(super) output: Vec<Value>,
    pub(super) round_output: Vec<Value>,
    /// Messages: the usage of a later round's start (not shown), added to
    /// its end.
    pub(super) start_usage: Option<Value>,
}

impl Filter {
    pub fn new(api: &'static dyn StreamEdit, extra: Sum) -> Filter {
        Filter {
            api,
            extra,
            dropped: Vec::new(),
            client_calls: false,
            stripped: 0,
            client_tools: Vec::new(),
            names: Vec::new(),
            continuable: false,
            round: 0,
            offset: 0,
            shown: 0,
            texted: false,
            apart: false,
            first_id: None,
            next_seq: None,
            output: Vec::new(),
            round_output: Vec::new(),
            start_usage: None,
        }
    }

    /// Told the names of the client's tools: a chat call whose name comes
    /// in pieces is then taken out from its first piece, when that can
    /// only start one of condense's tools.
    pub fn with_client_tools(mut self, names: Vec<String>) -> Filter {
        self.client_tools = names;
        self
    }

    /// Whether a call of the client's went out in any round.
    pub fn client_calls(&self) -> bool {
        self.client_calls
    }

    /// The next round continues the answer: its indices go on after the
    /// ones the client saw, and `extra` (every round before it) is added
    /// to its usage.
    pub fn next_round(&mut self, extra: Sum) {
        self.extra = extra;
        self.offset = self.offset.saturating_add(self.shown);
        self.shown = 0;
        self.round += 1;
        self.dropped.clear();
        self.names.clear();
        self.stripped = 0;
        self.start_usage = None;
        self.apart = self.texted;
        self.output.append(&mut self.round_output);
    }

    /// Takes out the call at `index` (and every later event of it).
    pub(super) fn drop(&mut self, index: Option<u64>) {
        match index {
            Some(i) if self.dropped.contains(&i) => {}
            Some(i) => {
                self.dropped.push(i);
                self.stripped += 1;
            }
            None => self.stripped += 1,
        }
    }

    /// The index `i` as the client sees it: moved up past the calls taken
    /// out before it, after the indices of the rounds before; counted as
    /// shown. An upstream's index can be any u64: the sums saturate.
    pub(super) fn shifted(&mut self, i: u64) -> u64 {
        let s = i - self.dropped.iter().filter(|&&d| d < i).count() as u64;
        self.shown = self.shown.max(s.saturating_add(1));
        s.saturating_add(self.offset)
    }

    /// An event of the block or item at `index` (under `key`): gone with a
    /// call taken out, else moved as [`Filter::shifted`] says.
    pub(super) fn reindex(&mut self, data: &mut Value, key: &str, index: Option<u64>) -> Edit {
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

    /// An event that ends the answer: held when another round may go on.
    pub(super) fn end(&self, changed: bool) -> Edit {
        match (self.continuable, changed) {
            (true, _) => Edit::Hold,
            (false, true) => Edit::Changed,
            (false, false) => Edit::Keep,
        }
    }

    pub fn event(&mut self, data: &mut Value) -> Edit {
        self.api.filter(self, data)
    }

    /// Adds the usage of the rounds condense answered to a `usage`
    /// value; whether it changed.
    pub(super) fn usage(&self, usage: Option<&mut Value>) -> bool {
        self.extra.add_to_usage(usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Format;

    fn run(api: &'static dyn StreamEdit, events: &[Value]) -> (Decision, Option<Answer>) {
        let mut g = Gather::new(api);
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
        let mut g = Gather::new(Format::Chat.api());
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
        assert_eq!(run(Format::Chat.api(), &text).0, Decision::Pass);
        // A name in pieces: told at once when only condense's tools start
        // that way, else once it can no longer be one of them.
        let piece = |name: &str| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                "function": {"name": name}}]}}]})
        };
        let mut g = Gather::new(Format::Chat.api());
        assert_eq!(g.event(&piece("condense_")), Decision::Ours);
        let client = || vec!["condense_logs".to_string()];
        let mut g = Gather::new(Format::Chat.api()).with_client_tools(client());
        assert_eq!(g.event(&piece("condense_")), Decision::Hold);
        assert_eq!(g.event(&piece("recall")), Decision::Ours);
        let mut g = Gather::new(Format::Chat.api()).with_client_tools(client());
        assert_eq!(g.event(&piece("condense_")), Decision::Hold);
        assert_eq!(g.event(&piece("x")), Decision::Pass);
    }

    #[test]
    fn a_late_chat_recall_is_taken_out_and_indices_close_up() {
        let mut f = Filter::new(Format::Chat.api(), Sum::default());
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
            Filter::new(Format::Chat.api(), Sum::default()).with_client_tools(vec!["read".into()]);
        assert_eq!(f.event(&mut piece(0, "condense_")), Edit::Drop);
        assert_eq!(f.event(&mut piece(0, "recall")), Edit::Drop);
        assert_eq!(f.event(&mut piece(1, "re")), Edit::Changed);
        assert_eq!(f.stripped, 1);
        let mut g = Gather::new(Format::Chat.api()).with_client_tools(vec!["condense_logs".into()]);
        assert_eq!(g.event(&piece(0, "condense_")), Decision::Hold);
        assert_eq!(g.event(&piece(0, "logs")), Decision::Pass);
    }

    #[test]
    fn malformed_events_neither_panic_nor_let_a_call_through() {
        // Found by the fuzz target: a block that is not an object, a
        // message that is not one, calls in events of unknown types.
        let mut g = Gather::new(Format::Messages.api());
        g.event(&json!({"type": "message_start", "message": 7}));
        g.event(&json!({"type": "message_start", "message": {"content": [3]}}));
        g.event(&json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}));
        g.event(&json!({"type": "content_block_stop", "index": 0}));
        assert!(g.answer().is_some());
        let mut f = Filter::new(Format::Responses.api(), Sum::default());
        let mut odd = json!({"type": "response.output_item.idded",
            "item": {"type": "function_call", "name": RECALL_TOOL}});
        assert_eq!(f.event(&mut odd), Edit::Drop);
        let mut whole = json!({"type": "reesponse.completed", "response": {"output": [
            {"type": "function_call", "name": RECALL_TOOL}]}});
        assert_eq!(f.event(&mut whole), Edit::Changed);
        assert_eq!(whole["response"]["output"], json!([]));
        let mut f = Filter::new(Format::Messages.api(), Sum::default());
        let mut delta = json!({"type": "message_delta", "delta": {},
            "content_block": {"type": "tool_use", "name": RECALL_TOOL}});
        assert_eq!(f.event(&mut delta), Edit::Drop);
        // A chat call entry that is a number, in a round whose indices go
        // on after the last one's: passed on as it came.
        let mut f = Filter::new(Format::Chat.api(), Sum::default());
        let mut call = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "y",
            "function": {"name": "shell", "arguments": "{}"}}]}}]});
        f.event(&mut call);
        f.next_round(Sum::default());
        let mut odd = json!({"choices": [{"index": 0, "delta": {"tool_calls": [7]}}]});
        f.event(&mut odd);
        assert_eq!(odd["choices"][0]["delta"]["tool_calls"], json!([7]));
    }

    #[test]
    fn every_indexed_write_meets_only_the_shapes_it_indexes() {
        // Each place the gatherers and filters write with `value[..] =`
        // (serde_json's IndexMut panics on a non-object, or an index past
        // an array's end) is fed upstream events of every other shape
        // where it indexes: nothing panics, and the filters pass the odd
        // pieces on as they came.
        let odd = [
            json!(7),
            json!("x"),
            json!([1]),
            json!(null),
            json!(true),
            json!({}),
        ];
        for format in Format::ALL {
            for o in &odd {
                let events = [
                    o.clone(),
                    // A call shown in the first round: a later round's
                    // indices are moved past it.
                    json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "y",
                        "function": {"name": "shell", "arguments": "{}"}}]}}]}),
                    json!({"type": "message_start", "message": o}),
                    json!({"type": "content_block_start", "index": 0, "content_block": o}),
                    json!({"type": "content_block_start", "index": 1,
                        "content_block": {"type": "tool_use", "name": "shell", "input": o}}),
                    json!({"type": "content_block_delta", "index": 0, "delta": o}),
                    json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": o}}),
                    json!({"type": "content_block_stop", "index": 1}),
                    json!({"type": "message_delta", "delta": {"content": o, "usage": o}, "usage": o}),
                    json!({"type": "message_delta", "delta": o, "usage": {"output_tokens": 1}}),
                    json!({"type": "message_delta", "delta": {"stop_reason": o}}),
                    json!({"choices": o, "usage": o}),
                    json!({"choices": [o]}),
                    json!({"choices": [{"delta": o, "finish_reason": o}]}),
                    json!({"choices": [{"delta": {"content": o, "reasoning_content": o,
                        "tool_calls": [o, {"index": o, "id": o, "function": o}]}}]}),
                    json!({"choices": [{"delta": {"tool_calls": [{"index": 3,
                        "function": {"name": "shell", "arguments": o}}]}, "finish_reason": "stop"}]}),
                    json!({"type": "response.output_item.added", "output_index": 0, "item": o,
                        "sequence_number": o}),
                    json!({"type": "response.completed", "response": o}),
                    json!({"type": "response.completed", "response": {"output": [o], "usage": o}}),
                ];
                let mut g = Gather::new(format.api());
                for e in &events {
                    g.event(e);
                }
                if let Some(a) = g.answer() {
                    let _ = a.ours();
                }
                for continuable in [false, true] {
                    let mut f = Filter::new(format.api(), Sum::default());
                    f.continuable = continuable;
                    for (n, e) in events.iter().enumerate() {
                        if n == events.len() / 2 {
                            f.next_round(Sum::default());
                        }
                        let mut e = e.clone();
                        f.event(&mut e);
                    }
                }
            }
        }
        // A later round's chat chunk whose first choice is not an object:
        // passed on as it came.
        let mut f = Filter::new(Format::Chat.api(), Sum::default());
        f.next_round(Sum::default());
        let mut chunk = json!({"id": "c", "choices": ["stop"]});
        assert_eq!(f.event(&mut chunk), Edit::Keep);
        assert_eq!(chunk, json!({"id": "c", "choices": ["stop"]}));
        // A Messages end whose delta is not an object keeps it.
        let mut f = Filter::new(Format::Messages.api(), Sum::default());
        let mut end = json!({"type": "message_delta", "delta": 5, "usage": {"output_tokens": 1}});
        assert_eq!(f.event(&mut end), Edit::Keep);
        assert_eq!(end["delta"], 5);
    }

    #[test]
    fn indices_and_sequence_numbers_at_the_top_of_u64_do_not_overflow() {
        // An upstream's index or sequence number can be any u64: the
        // filter's counts saturate instead of overflowing (a panic where
        // overflow is checked).
        let max = u64::MAX;
        let mut f = Filter::new(Format::Chat.api(), Sum::default());
        let mut call = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": max,
            "id": "y", "function": {"name": "shell", "arguments": "{}"}}]}}]});
        assert_eq!(f.event(&mut call), Edit::Keep);
        assert_eq!(call["choices"][0]["delta"]["tool_calls"][0]["index"], max);
        let mut f = Filter::new(Format::Messages.api(), Sum::default());
        let mut block = json!({"type": "content_block_start", "index": max,
            "content_block": {"type": "text", "text": ""}});
        assert_eq!(f.event(&mut block), Edit::Keep);
        let mut f = Filter::new(Format::Responses.api(), Sum::default());
        let mut item = json!({"type": "response.output_item.added", "output_index": max,
            "sequence_number": max, "item": {"type": "message"}});
        assert_eq!(f.event(&mut item), Edit::Keep);
        // Two ends of a held round, the first numbered 0, the second not
        // numbered: the next number does not go below 0.
        let mut f = Filter::new(Format::Responses.api(), Sum::default());
        f.continuable = true;
        let mut end = json!({"type": "response.completed", "sequence_number": 0,
            "response": {"id": "r", "output": []}});
        assert_eq!(f.event(&mut end), Edit::Hold);
        let mut again =
            json!({"type": "response.completed", "response": {"id": "r", "output": []}});
        assert_eq!(f.event(&mut again), Edit::Hold);
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
        let (d, a) = run(Format::Messages.api(), &events);
        assert_eq!(d, Decision::Ours);
        let a = a.unwrap();
        assert_eq!(a.value["content"][0]["signature"], "sig");
        assert_eq!(a.ours()[0].argument.as_deref(), Some("abcdefg"));
        assert_eq!(a.value["usage"]["output_tokens"], 9);

        // After text, the same call is taken out of what the client sees.
        let mut extra = Sum::default();
        extra.add(Some(&json!({"input_tokens": 100, "output_tokens": 10})));
        let mut f = Filter::new(Format::Messages.api(), extra);
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
        assert_eq!(run(Format::Responses.api(), &[added]).0, Decision::Ours);
        let reasoning = json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning"}});
        assert_eq!(run(Format::Responses.api(), &[reasoning]).0, Decision::Hold);
    }

    #[test]
    fn a_continued_messages_answer_goes_on_from_the_blocks_the_client_saw() {
        let mut f = Filter::new(Format::Messages.api(), Sum::default());
        f.continuable = true;
        let start = |input: u64| {
            json!({"type": "message_start", "message": {"id": "m", "content": [],
                "usage": {"input_tokens": input, "output_tokens": 1}}})
        };
        let block = |i: u64, kind: &str, name: &str| {
            json!({"type": "content_block_start", "index": i,
                "content_block": {"type": kind, "name": name, "id": "t"}})
        };
        let end = |stop: &str| json!({"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 5}});
        assert_eq!(f.event(&mut start(100)), Edit::Keep);
        assert_eq!(f.event(&mut block(0, "text", "")), Edit::Keep);
        assert_eq!(f.event(&mut block(1, "tool_use", RECALL_TOOL)), Edit::Drop);
        assert_eq!(f.event(&mut end("tool_use")), Edit::Hold);
        assert_eq!(f.event(&mut json!({"type": "message_stop"})), Edit::Hold);
        // The next round: no second start, its first block is the client's
        // second, its end has every round's usage.
        let mut extra = Sum::default();
        extra.add(Some(&json!({"input_tokens": 100, "output_tokens": 5})));
        f.next_round(extra);
        f.continuable = false;
        assert_eq!(f.event(&mut start(150)), Edit::Drop);
        let mut text = block(0, "text", "");
        assert_eq!(f.event(&mut text), Edit::Changed);
        assert_eq!(text["index"], 1);
        let mut delta = json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "x"}});
        assert_eq!(f.event(&mut delta), Edit::Changed);
        assert_eq!(delta["index"], 1);
        let mut last = end("end_turn");
        assert_eq!(f.event(&mut last), Edit::Changed);
        assert_eq!(last["usage"]["input_tokens"], 250);
        assert_eq!(last["usage"]["output_tokens"], 10);
        assert_eq!(last["delta"]["stop_reason"], "end_turn");
        assert_eq!(f.event(&mut json!({"type": "message_stop"})), Edit::Keep);
    }
}
