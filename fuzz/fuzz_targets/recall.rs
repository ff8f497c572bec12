//! Fuzz target over what an upstream answers a request condense offered its
//! tools: a JSON body and an SSE stream, in each format, read for
//! condense's calls, answered, and edited for the client. Upstream answers
//! are input condense does not control; none may make it panic, and what
//! the client gets must never name condense's tools.
//!
//! The first byte picks the format and whether the rest is a JSON answer or
//! a stream (events split on blank lines).
//!
//!   cargo fuzz run recall fuzz/seeds/recall -- -max_total_time=600

#![no_main]

use bytes::Bytes;
use condense::wire::stream::{Edit, Filter, Gather};
use condense::wire::tools::{Answer, COMPRESS_TOOL, RECALL_TOOL};
use condense::wire::usage::Sum;
use condense::wire::Format;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

fn ours(n: Option<&str>) -> bool {
    matches!(n, Some(RECALL_TOOL | COMPRESS_TOOL))
}

fn list<'a>(v: &'a Value, at: &str) -> impl Iterator<Item = &'a Value> {
    v.pointer(at).and_then(Value::as_array).into_iter().flatten()
}

/// Whether an answer (or, `stream`, one event) calls one of condense's
/// tools where a client reads calls.
fn calls_ours(format: Format, v: &Value, stream: bool) -> bool {
    let name = |c: &Value, at: &str| ours(c.pointer(at).and_then(Value::as_str));
    let kind = |c: &Value, k: &str| c.get("type").and_then(Value::as_str) == Some(k);
    match (format, stream) {
        (Format::Chat, false) => list(v, "/choices")
            .flat_map(|c| list(c, "/message/tool_calls"))
            .any(|c| name(c, "/function/name")),
        (Format::Chat, true) => list(v, "/choices")
            .flat_map(|c| list(c, "/delta/tool_calls"))
            .any(|c| name(c, "/function/name")),
        (Format::Messages, false) => list(v, "/content").any(|b| kind(b, "tool_use") && name(b, "/name")),
        (Format::Messages, true) => v
            .get("content_block")
            .is_some_and(|b| kind(b, "tool_use") && name(b, "/name")),
        (Format::Responses, false) => {
            list(v, "/output").any(|i| kind(i, "function_call") && name(i, "/name"))
        }
        (Format::Responses, true) => {
            v.get("item").is_some_and(|i| kind(i, "function_call") && name(i, "/name"))
                || list(v, "/response/output").any(|i| kind(i, "function_call") && name(i, "/name"))
        }
    }
}

fn sent(format: Format) -> Bytes {
    let body = match format {
        Format::Chat => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        Format::Messages => {
            json!({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]})
        }
        Format::Responses => json!({"model": "m", "input": "hi"}),
    };
    Bytes::from(body.to_string())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let format = match mode % 3 {
        0 => Format::Chat,
        1 => Format::Messages,
        _ => Format::Responses,
    };
    let mut extra = Sum::default();
    extra.add(Some(&json!({"input_tokens": 3, "prompt_tokens": 3})));
    if mode & 0x80 == 0 {
        // A JSON answer.
        let Some(answer) = Answer::parse(format.api(), rest) else {
            return;
        };
        let ours = answer.ours();
        let _ = answer.theirs();
        let _ = answer.usage();
        let results: Vec<(String, String)> = ours
            .iter()
            .map(|c| (c.id.clone(), "original".to_string()))
            .collect();
        if let Some(next) = answer.follow_up(&sent(format), &results) {
            let v: Value = serde_json::from_slice(&next).expect("a follow-up is JSON");
            assert!(v.is_object());
        }
        if let Some(next) = answer.follow_up_shown(&sent(format), &results, "passed on") {
            let v: Value = serde_json::from_slice(&next).expect("a follow-up is JSON");
            assert!(v.is_object());
        }
        // The text of an earlier round before the answer's own.
        let answer = answer.clone().after(&[answer]);
        let shown: Value =
            serde_json::from_slice(&answer.for_client(&extra)).expect("the client's answer is JSON");
        assert!(
            !calls_ours(format, &shown, false),
            "condense's call reached the client: {shown}"
        );
        return;
    }
    // A stream: gathered as condense reads it, then filtered for the client.
    let text = String::from_utf8_lossy(rest);
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| {
            let data: String = e
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            serde_json::from_str(&data).ok()
        })
        .collect();
    let mut gather = Gather::new(format.api());
    for e in &events {
        gather.event(e);
    }
    if let Some(answer) = gather.answer() {
        let _ = answer.ours();
        let _ = answer.follow_up(&sent(format), &[]);
    }
    let mut filter = Filter::new(format.api(), extra.clone());
    // Held ends, and a next round that goes on from the middle.
    filter.continuable = mode & 0x40 != 0;
    let middle = events.len() / 2;
    for (n, mut e) in events.into_iter().enumerate() {
        if filter.continuable && n == middle {
            filter.next_round(extra.clone());
        }
        // Only the first choice of a chat stream is edited: condense offers
        // no tools to a request that asks for several.
        if format == Format::Chat
            && list(&e, "/choices").any(|c| c.get("index").and_then(Value::as_u64) != Some(0))
        {
            continue;
        }
        if filter.event(&mut e) != Edit::Drop {
            assert!(
                !calls_ours(format, &e, true),
                "condense's call reached the client: {e}"
            );
        }
    }
});
