//! Fuzz target over parse → compact → serialize, checking the pipeline's
//! invariants (DESIGN.md, "The pipeline") on every input.
//!
//! Bodies that parse as Anthropic Messages or stateless Responses are also
//! compacted through their view and written back, and must keep their
//! API's rules (generated conversations are tried as Responses input too).
//!
//! The first byte picks the mode: below 128 the rest is a request body as a
//! client would send it (JSON or not); otherwise the rest drives a generator
//! of structured agent conversations (calls, results, repeated ids, markers,
//! odd roles), which reaches deep into the stages far more often than raw
//! bytes would. The second byte scales the budget.
//!
//!   cargo fuzz run compact fuzz/seeds/compact          # until stopped
//!   cargo fuzz run compact fuzz/seeds/compact -- -max_total_time=600

#![no_main]

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use condense::chat::{ChatRequest, Message};
use condense::compaction::conversation::{Analysis, Role};
use condense::compaction::{self, Limits, Replacement};
use condense::config::{CompactionConfig, Config, SummaryConfig};
use condense::metrics::Metrics;
use condense::pipeline::CachedCounter;
use condense::tokens::{Encoding, TokenService};
use condense::wire::anthropic::MessagesRequest;
use condense::wire::responses::ResponsesRequest;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

fn service() -> &'static TokenService {
    static S: OnceLock<TokenService> = OnceLock::new();
    S.get_or_init(|| {
        let metrics = Metrics::new().expect("metrics");
        TokenService::new(Arc::new(Config::default()), &metrics)
    })
}

/// A structured conversation from bytes.
fn generate(data: &[u8]) -> Vec<Value> {
    let text = |n: u8, seed: usize| -> String {
        let lines = [
            "Traceback (most recent call last):",
            "  File \"/repo/src/app.py\", line 12, in main",
            "error[E0308]: mismatched types",
            "FAILED tests/test_x.py::test_y - AssertionError",
            "{\"id\": 7, \"status\": \"ok\", \"items\": [1, 2, 3]}",
            "Wait, actually that is wrong.",
            "plain output line",
            "ünïcödé ✓ 😀",
        ];
        (0..(n as usize % 40) * 3)
            .map(|i| lines[(seed + i) % lines.len()])
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut out = vec![json!({"role": "system", "content": "You are an agent."})];
    let mut open: Vec<String> = Vec::new();
    // A few hundred messages reach every stage; more only slow the fuzzer.
    for (i, pair) in data.chunks(2).take(400).enumerate() {
        let (op, n) = (pair[0], *pair.get(1).unwrap_or(&1));
        let m = match op % 9 {
            0 | 1 => {
                let ids: Vec<String> = (0..=(n % 3))
                    .map(|k| format!("c{}", (i + k as usize) % 5))
                    .collect();
                open = ids.clone();
                let calls: Vec<Value> = ids
                    .iter()
                    .map(|id| json!({"id": id, "type": "function", "function": {"name": "run", "arguments": json!({"cmd": text(n, i)}).to_string()}}))
                    .collect();
                json!({"role": "assistant", "content": if op % 2 == 0 { Value::Null } else { json!(text(n / 4, i)) }, "tool_calls": calls})
            }
            2 | 3 => match open.pop() {
                Some(id) => json!({"role": "tool", "tool_call_id": id, "content": text(n, i)}),
                None => json!({"role": "tool", "tool_call_id": "orphan", "content": text(n, i)}),
            },
            4 => json!({"role": "assistant", "content": text(n, i)}),
            5 => json!({"role": "user", "content": text(n / 2, i)}),
            6 => {
                json!({"role": "user", "content": [{"type": "text", "text": text(n, i)}, {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}]})
            }
            7 => json!({"role": "developer", "content": text(n / 8, i)}),
            _ => {
                json!({"role": "tool", "tool_call_id": format!("c{}", n % 5), "content": [{"type": "text", "text": text(n, i)}]})
            }
        };
        out.push(m);
    }
    out
}

/// Every tool result follows an assistant message that called its id (when
/// it did in the input).
fn paired(messages: &[Message]) -> Vec<bool> {
    let mut ok = Vec::with_capacity(messages.len());
    let mut open: Vec<String> = Vec::new();
    for m in messages {
        match m.role() {
            Some("assistant") => {
                open = m
                    .tool_calls()
                    .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_string))
                    .collect();
                ok.push(true);
            }
            Some("tool") => ok.push(
                m.tool_call_id()
                    .is_some_and(|id| open.iter().any(|o| o == id)),
            ),
            _ => ok.push(true),
        }
    }
    ok
}

fn check(req: &ChatRequest, budget: f64, replacement: &Replacement, strict: bool) {
    let messages = req.messages();
    let counter = CachedCounter::new(service(), Encoding::O200k);
    let limits = Limits {
        budget,
        window: budget * 1.3,
        fixed: 3,
    };
    let s = CompactionConfig::default();
    let out = compaction::compact_with(messages, &limits, &s, &counter, replacement);
    assert!(out.tokens_after <= out.tokens_before);
    if (out.tokens_before as f64) < s.trigger * budget && out.span.is_none() {
        assert!(out.messages.is_none(), "changed under the trigger");
    }
    let Some(result) = out.messages.clone() else {
        return;
    };
    // Serializes to a request that parses again.
    let mut again = req.clone();
    again.set_messages(result.clone());
    let bytes = again.to_bytes();
    let reparsed = ChatRequest::parse(&bytes).expect("the compacted request parses");
    assert_eq!(reparsed.messages().len(), result.len());
    // Protected messages survive byte for byte.
    let a = Analysis::of(messages);
    let emergency = out.stages.iter().any(|st| st.stage == "emergency");
    for i in 0..messages.len() {
        let system = matches!(a.roles[i], Role::System | Role::Developer) && i < a.base;
        let last_user = a.last_user == Some(i);
        let unconsumed = a.roles[i] == Role::Tool && !a.consumed[i];
        if system || (!emergency && (last_user || unconsumed)) {
            assert!(
                result.iter().any(|m| m.raw() == messages[i].raw()),
                "protected message {i} lost"
            );
        }
    }
    // No result lost its call (if it had one).
    let before = paired(messages);
    let after = paired(&result);
    let paired_in = before.iter().filter(|p| **p).count();
    let orphans_out = after.iter().filter(|p| !**p).count();
    let orphans_in = before.len() - paired_in;
    assert!(
        orphans_out <= orphans_in,
        "compaction orphaned a tool result"
    );
    // Idempotent.
    let second = compaction::compact_with(&result, &limits, &s, &counter, replacement);
    // A result that still does not fit was cut as far as `emergency` goes
    // in one pass; cutting it again may take more.
    if strict && out.fits {
        assert!(
            second.messages.is_none(),
            "compacting the output again changed it: {:?} (fits {}, {} -> {}) then {:?} ({} -> {}), budget {budget}",
            out.stages,
            out.fits,
            out.tokens_before,
            out.tokens_after,
            second.stages,
            second.tokens_before,
            second.tokens_after
        );
    }
}

/// The compaction of a format's view at `budget`, when it changes anything.
fn decide(view: &ChatRequest, budget: f64) -> Option<compaction::Fates> {
    let counter = CachedCounter::new(service(), Encoding::O200k);
    let limits = Limits {
        budget,
        window: budget * 1.3,
        fixed: 3,
    };
    let s = CompactionConfig::default();
    compaction::compact_with(view.messages(), &limits, &s, &counter, &Replacement::Digest).fates
}

/// A Messages or Responses body condense understands, compacted through its
/// view and written back: the result parses again and keeps its API's
/// rules, or the write-back refuses it (and the client's body goes out).
fn check_wire(body: &Bytes, budget: f64) {
    if let Ok(r) = MessagesRequest::parse(body)
        && r.well_formed()
    {
        let (view, origins) = r.view();
        if let Some(fates) = decide(&view, budget)
            && let Ok(out) = r.write_back(&origins, &fates)
        {
            let again = MessagesRequest::parse(&out).expect("written-back Messages parses");
            assert!(
                again.well_formed(),
                "written-back Messages breaks the rules"
            );
        }
    }
    if let Ok(r) = ResponsesRequest::parse(body)
        && r.well_formed()
    {
        let (view, origins) = r.view();
        if let Some(fates) = decide(&view, budget)
            && let Ok(out) = r.write_back(&origins, &fates)
        {
            let again = ResponsesRequest::parse(&out).expect("written-back Responses parses");
            assert!(
                again.well_formed(),
                "written-back Responses breaks the pairing"
            );
        }
    }
}

/// A generated chat conversation as Responses input items.
fn as_responses(messages: &[Value]) -> Value {
    let mut input = Vec::new();
    for m in messages.iter().skip(1) {
        match m["role"].as_str() {
            Some("tool") => input.push(json!({"type": "function_call_output",
                "call_id": m["tool_call_id"], "output": m["content"].as_str().unwrap_or("")})),
            Some("assistant") => {
                if let Some(t) = m["content"].as_str() {
                    input.push(json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": t}]}));
                }
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    input.push(json!({"type": "function_call", "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"]}));
                }
            }
            Some(role) => {
                input.push(json!({"type": "message", "role": role, "content": m["content"]}))
            }
            None => {}
        }
    }
    json!({"model": "gpt-4o", "instructions": "You are an agent.", "input": input})
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Some((&scale, rest)) = rest.split_first() else {
        return;
    };
    let budget = 200.0 + scale as f64 * 60.0;
    let body = if mode < 128 {
        Bytes::copy_from_slice(rest)
    } else {
        let messages = generate(rest);
        check_wire(&Bytes::from(as_responses(&messages).to_string()), budget);
        Bytes::from(json!({"model": "gpt-4o", "messages": messages}).to_string())
    };
    check_wire(&body, budget);
    let Ok(req) = ChatRequest::parse(&body) else {
        return;
    };
    // An unchanged request serializes to the client's exact bytes.
    assert_eq!(req.to_bytes(), body);
    check(&req, budget, &Replacement::Digest, true);
    let trigger = SummaryConfig::default().trigger;
    let checkpoint =
        Bytes::from(json!({"role": "user", "content": "[condense: checkpoint.] ok"}).to_string());
    let with_checkpoint = Replacement::Checkpoint {
        trigger,
        max_tokens: 60,
        message: Some(checkpoint),
    };
    check(&req, budget, &with_checkpoint, false);
});
