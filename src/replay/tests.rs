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
