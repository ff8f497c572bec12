//! Replays of small synthetic conversations: what a probe is counted on,
//! and which probes the agent used again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use serde_json::{Value, json};

use super::measure::reused;
use super::*;

fn probe(text: &str, first_message_index: usize) -> Probe {
    Probe {
        text: text.to_string(),
        first_message_index,
        kind: None,
    }
}

async fn replay_of(body: &Value, probes: &[Probe]) -> Report {
    replay_with(
        &Config::default(),
        &Bytes::from(body.to_string()),
        &CompactOptions {
            model: None,
            window: Some(200_000),
        },
        probes,
        &Provider::default(),
        None,
    )
    .await
    .unwrap()
}

#[test]
fn a_fact_is_reused_when_a_later_assistant_message_quotes_it() {
    let texts: Vec<String> = [
        "Fix the bug in src/lib.rs",            // 0 user: the task
        "cat src/lib.rs",                       // 1 assistant call
        "fn parse() {}\nerror: E0308 in parse", // 2 tool result
        "{\"cmd\":\"grep parse src/lib.rs\"}",  // 3 assistant call quoting the task's path
        "parse found at line 3",                // 4 tool result
        "The error E0308 is fixed.",            // 5 assistant answer quoting the result
        "only read once: 42 files",             // 6 tool result never quoted
        "I will write tmp/out.txt",             // 7 assistant, the first to name it
        "tmp/out.txt written",                  // 8 tool result repeating it
    ]
    .map(String::from)
    .to_vec();
    let assistant = [false, true, false, true, false, true, false, true, false];
    let probes = [
        probe("src/lib.rs", 0),
        probe("E0308", 2),
        probe("42 files", 6),
        probe("tmp/out.txt", 7),
        probe("never anywhere", 0),
    ];
    assert_eq!(
        reused(&texts, &assistant, &probes),
        vec![true, true, false, false, false],
        "quoted later by the model: reused; read once, repeated only by a tool, or absent: not"
    );
}

/// A Claude Code turn answers several calls in one user message: the
/// pipeline's view has a message per tool result, the body one message
/// for all. A probe first found in a later body message must not count on
/// an earlier turn, whose view is longer than its body.
#[tokio::test]
async fn a_probe_counts_from_the_turn_whose_request_holds_it() {
    let results = |t: usize| -> Value {
        let blocks: Vec<Value> = (0..6)
            .map(|c| json!({"type": "tool_result", "tool_use_id": format!("t{t}_{c}"), "content": format!("result {t}.{c}")}))
            .collect();
        json!({"role": "user", "content": blocks})
    };
    let calls = |t: usize| -> Value {
        let blocks: Vec<Value> = (0..6)
            .map(|c| json!({"type": "tool_use", "id": format!("t{t}_{c}"), "name": "Read", "input": {"path": format!("f{t}_{c}.py")}}))
            .collect();
        json!({"role": "assistant", "content": blocks})
    };
    let messages = vec![
        json!({"role": "user", "content": "Read every file."}), // 0
        calls(0),                                               // 1
        results(0),                                             // 2
        calls(1),                                               // 3
        results(1),                                             // 4
        json!({"role": "assistant", "content": "Done."}),       // 5
        json!({"role": "user", "content": "Now look at LATE_FACT_7."}), // 6
        json!({"role": "assistant", "content": "LATE_FACT_7 is fine."}), // 7
        json!({"role": "user", "content": "Thanks."}),          // 8
    ];
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 1024,
        "system": "You are an agent.", "messages": messages});
    // Indexed by the body's messages, as the native traces' probes are.
    let report = replay_of(
        &body,
        &[probe("LATE_FACT_7", 6), probe("Read every file.", 0)],
    )
    .await;
    for t in &report.turns {
        assert_eq!(
            t.condense.retention,
            Some(1.0),
            "turn {}: {:?}",
            t.turn,
            t.lost
        );
        assert_eq!(t.condense.recoverable, Some(1.0), "turn {}", t.turn);
    }
    // The task is quoted by no assistant message; the late fact is.
    let last = report.turns.last().unwrap();
    assert_eq!(last.condense.reused, Some(1.0));
    assert_eq!(report.condense.reused_retention, Some(1.0));
    assert_eq!(report.condense.reused_recoverable, Some(1.0));
    assert_eq!(
        report.turns[0].condense.reused, None,
        "not yet in the request"
    );
}

/// A conversation whose last user message fills most of the window, with
/// the agent's work before and after it, in `format` ("chat", "messages"
/// or "responses"), and a probe for a fact in each tool result.
fn crowded(format: &str) -> (Value, Vec<Probe>) {
    let filler: String = (0..2_750).map(|i| format!("w{} ", i % 97)).collect();
    // (call id, path, result holding its fact)
    let work = |from: usize, to: usize| -> Vec<(String, String, String)> {
        (from..to)
            .map(|t| {
                let result = format!(
                    "FACT_{t}: file_{t}.rs holds {} lines\n{}",
                    100 + t,
                    "let x = compute(x) + 1;\n".repeat(40)
                );
                (format!("call_{t}"), format!("src/file_{t}.rs"), result)
            })
            .collect()
    };
    let (before, after) = (work(0, 8), work(8, 13));
    let probes = (0..13).map(|t| probe(&format!("FACT_{t}:"), 0)).collect();
    let task = "Read every file and report on each.";
    let last = format!("Here is the whole specification to follow:\n{filler}");
    let tools_chat = json!([{"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]);
    let body = match format {
        "chat" => {
            let mut m = vec![
                json!({"role": "system", "content": "You are an agent."}),
                json!({"role": "user", "content": task}),
            ];
            let turn = |m: &mut Vec<Value>, (id, path, result): &(String, String, String)| {
                m.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
                    "function": {"name": "read", "arguments": json!({"path": path}).to_string()}}]}));
                m.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            };
            before.iter().for_each(|w| turn(&mut m, w));
            m.push(json!({"role": "user", "content": last}));
            after.iter().for_each(|w| turn(&mut m, w));
            json!({"model": "gpt-4o", "max_tokens": 1000, "tools": tools_chat, "messages": m})
        }
        "messages" => {
            let mut m = vec![json!({"role": "user", "content": task})];
            let mut pending: Vec<Value> = Vec::new();
            let turn = |m: &mut Vec<Value>,
                        pending: &mut Vec<Value>,
                        (id, path, result): &(String, String, String)| {
                let user = std::mem::take(pending);
                if !user.is_empty() {
                    m.push(json!({"role": "user", "content": user}));
                }
                m.push(json!({"role": "assistant", "content": [
                    {"type": "thinking", "thinking": format!("Read {path}."), "signature": format!("sig-{id}")},
                    {"type": "tool_use", "id": id, "name": "read", "input": {"path": path}}]}));
                pending.push(json!({"type": "tool_result", "tool_use_id": id, "content": result}));
            };
            before.iter().for_each(|w| turn(&mut m, &mut pending, w));
            pending.push(json!({"type": "text", "text": last}));
            after.iter().for_each(|w| turn(&mut m, &mut pending, w));
            m.push(json!({"role": "user", "content": pending}));
            json!({"model": "claude-sonnet-4-5", "max_tokens": 1000, "system": "You are an agent.",
                "tools": [{"name": "read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
                "messages": m})
        }
        _ => {
            let mut items = vec![
                json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": task}]}),
            ];
            let turn = |items: &mut Vec<Value>, (id, path, result): &(String, String, String)| {
                items.push(json!({"type": "function_call", "call_id": id, "name": "read", "arguments": json!({"path": path}).to_string()}));
                items
                    .push(json!({"type": "function_call_output", "call_id": id, "output": result}));
            };
            before.iter().for_each(|w| turn(&mut items, w));
            items.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": last}]}));
            after.iter().for_each(|w| turn(&mut items, w));
            json!({"model": "gpt-4o", "max_output_tokens": 1000, "store": false, "instructions": "You are an agent.",
                "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
                "input": items})
        }
    };
    (body, probes)
}

/// [`crowded`] in `format` replayed at a 7,000-token window, and the
/// provider that received its turns.
async fn crowded_replay(format: &str) -> (Report, Arc<Simulator>) {
    let (body, probes) = crowded(format);
    run(
        &Config::default(),
        &Bytes::from(body.to_string()),
        &CompactOptions {
            model: None,
            window: Some(7_000),
        },
        &probes,
        &Provider::default(),
        None,
    )
    .await
    .unwrap()
}

/// When even the last resort must drop turns (a last user message that
/// fills most of the window), what it drops stays recallable, in every
/// format: the turns used to go with no key, and with them the digest of
/// earlier drops. And the request up to the client's last message keeps
/// its bytes while the agent works after it.
#[tokio::test]
async fn what_the_last_resort_drops_stays_recallable_in_every_format() {
    for format in ["chat", "messages", "responses"] {
        let (report, provider) = crowded_replay(format).await;
        // Every request keeps its API's rules: thinking first in an
        // assistant message that has it, calls answered.
        let mut notices_in_assistant = 0;
        for (sent, _) in provider.received() {
            match format {
                "messages" => {
                    let m = crate::wire::anthropic::MessagesRequest::parse(&sent).unwrap();
                    assert!(m.well_formed(), "{}", String::from_utf8_lossy(&sent));
                    let v: Value = serde_json::from_slice(&sent).unwrap();
                    for msg in v["messages"].as_array().unwrap() {
                        let blocks = msg["content"].as_array().cloned().unwrap_or_default();
                        let thinking = blocks.iter().position(|b| b["type"] == "thinking");
                        assert!(thinking.is_none_or(|p| p == 0), "{msg}");
                        // The notice after the client's last words, when
                        // the user message after them is the newest: in
                        // the assistant message between, behind its
                        // thinking, so that the last words keep their bytes.
                        if msg["role"] == "assistant" && msg.to_string().contains("recall key") {
                            assert_eq!(blocks[1]["type"], "text", "{msg}");
                            notices_in_assistant += 1;
                        }
                    }
                }
                "responses" => {
                    let r = crate::wire::responses::ResponsesRequest::parse(&sent).unwrap();
                    assert!(r.well_formed());
                }
                _ => {}
            }
        }
        assert_eq!(notices_in_assistant > 0, format == "messages");
        let crowded: Vec<&Turn> = report
            .turns
            .iter()
            .filter(|t| t.actions.contains("emergency"))
            .collect();
        assert!(
            crowded.len() >= 3,
            "{format}: the last resort never ran: {:?}",
            report.turns.iter().map(|t| &t.actions).collect::<Vec<_>>()
        );
        for t in &report.turns {
            assert_eq!(t.status, 200, "{format} turn {}", t.turn);
            assert!(
                t.unrecoverable.is_empty(),
                "{format} turn {} ({}): {:?} lost for good",
                t.turn,
                t.actions,
                t.unrecoverable
            );
        }
        // After the first turns of work past the last user message, each
        // turn's request up to it is the previous one's.
        for t in &crowded[2..] {
            assert!(
                t.condense.stability > 0.8,
                "{format} turn {}: stability {}",
                t.turn,
                t.condense.stability
            );
        }
    }
}

/// The rewrites add up to what stability lost to them (the ceiling less
/// the stability), in every format; a conversation that must drop turns
/// to fit shows its first compaction and its drops.
#[tokio::test]
async fn the_rewrites_add_up_to_the_gap_between_ceiling_and_stability() {
    for format in ["chat", "messages", "responses"] {
        let (report, _) = crowded_replay(format).await;
        for (name, t) in [
            ("condense", &report.condense),
            ("drop_oldest", &report.drop_oldest),
            ("last_10_results", &report.last_10_results),
        ] {
            let r = &t.rewrites;
            let sum = r.first + r.cut + r.dropped + r.restored + r.recut + r.other;
            let gap = t.stability_ceiling - t.prefix_stability;
            assert!(
                (sum - gap).abs() < 1e-9,
                "{format} {name}: {r:?} add up to {sum}, the gap is {gap}"
            );
        }
        let r = &report.condense.rewrites;
        assert!(r.first > 0.0 && r.dropped > 0.0, "{format}: {r:?}");
        assert!(render(&report).contains("by what changed first: first compaction"));
    }
}
