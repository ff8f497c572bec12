//! The compaction pipeline: invariants over generated conversations,
//! scenarios for each stage, and replays of a recorded session.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use bytes::Bytes;
use condense::chat::{ChatRequest, Message};
use condense::compaction::{self, Limits, Outcome, Replacement, Settings};
use condense::config::{CompactionConfig, Config};
use condense::metrics::Metrics;
use condense::pipeline::CachedCounter;
use condense::tokens::{Encoding, TokenService};
use proptest::prelude::*;
use serde_json::{Value, json};

fn service() -> TokenService {
    TokenService::new(Arc::new(Config::default()), &Metrics::new().unwrap())
}

fn msg(v: Value) -> Message {
    Message::from_bytes(Bytes::from(v.to_string()))
}

fn settings() -> Settings {
    CompactionConfig::default()
}

fn run(svc: &TokenService, messages: &[Message], budget: f64) -> Outcome {
    run_with(svc, messages, budget, &settings())
}

fn run_with(svc: &TokenService, messages: &[Message], budget: f64, s: &Settings) -> Outcome {
    let counter = CachedCounter::new(svc, Encoding::O200k);
    compaction::compact(messages, &limits(budget), s, &counter)
}

/// [`run`] for a request of a conversation whose earlier turns were
/// compacted: what they decided is in `earlier`.
fn run_after(
    svc: &TokenService,
    messages: &[Message],
    budget: f64,
    earlier: &compaction::Earlier,
) -> Outcome {
    let counter = CachedCounter::new(svc, Encoding::O200k);
    compaction::compact_until(
        messages,
        &limits(budget),
        &settings(),
        &counter,
        &Replacement::Digest,
        earlier,
    )
}

/// The limits the tests compact against: `budget`, a window 1.3 times it,
/// and 3 tokens of frame.
fn limits(budget: f64) -> Limits {
    Limits {
        budget,
        window: budget * 1.3,
        fixed: 3,
    }
}

/// The request's tokens: its messages and the 3 of its frame.
fn tokens(svc: &TokenService, messages: &[Message]) -> u64 {
    3 + messages_tokens(svc, messages)
}

/// The tokens of `messages` alone.
fn messages_tokens(svc: &TokenService, messages: &[Message]) -> u64 {
    messages
        .iter()
        .map(|m| svc.message_tokens(m.raw(), Encoding::O200k))
        .sum()
}

fn json_of(m: &Message) -> Value {
    serde_json::from_slice(m.raw()).unwrap()
}

/// Every tool message answers an earlier call (nearest earlier assistant
/// with the id) and every call has an answer.
fn well_paired(messages: &[Message]) -> bool {
    let mut open: Vec<(usize, String)> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let v = json_of(m);
        match v["role"].as_str() {
            Some("assistant") => {
                for c in v["tool_calls"].as_array().into_iter().flatten() {
                    open.push((i, c["id"].as_str().unwrap().to_string()));
                }
            }
            Some("tool") => {
                let id = v["tool_call_id"].as_str().unwrap();
                match open.iter().rposition(|(_, o)| o == id) {
                    Some(p) => {
                        open.remove(p);
                    }
                    None => return false,
                }
            }
            _ => {}
        }
    }
    open.is_empty()
}

// ---------------------------------------------------------------- generator

#[derive(Debug, Clone)]
enum Output {
    Text(usize),
    Json(usize),
    Empty,
    Parts(usize),
}

#[derive(Debug, Clone)]
struct TurnSpec {
    text: Option<String>,
    calls: Vec<(u8, Output)>,
    user_after: Option<String>,
}

fn output_strategy() -> impl Strategy<Value = Output> {
    prop_oneof![
        (0usize..6000).prop_map(Output::Text),
        (1usize..60).prop_map(Output::Json),
        Just(Output::Empty),
        (0usize..2000).prop_map(Output::Parts),
    ]
}

fn turn_strategy() -> impl Strategy<Value = TurnSpec> {
    (
        prop::option::of(prop_oneof![
            Just("Looking at the file now.".to_string()),
            Just("Wait, that is not right; let me reconsider.".to_string()),
            Just("The test fails in parse_header.".to_string()),
        ]),
        prop::collection::vec((0u8..4, output_strategy()), 0..3),
        prop::option::of(Just("Please also check the docs.".to_string())),
    )
        .prop_map(|(text, calls, user_after)| TurnSpec {
            text,
            calls,
            user_after,
        })
}

fn render_output(o: &Output, seed: usize) -> Value {
    match o {
        Output::Text(n) => {
            let mut s = String::new();
            let mut i = 0;
            while s.len() < *n {
                s.push_str(&format!(
                    "line {i} of output /src/mod_{seed}.rs: value={i}\n"
                ));
                if i % 17 == 3 {
                    s.push_str(&format!("Error: cannot parse item {seed}-{i}\n"));
                }
                i += 1;
            }
            Value::String(s)
        }
        Output::Json(n) => {
            let items: Vec<Value> = (0..*n)
                .map(|i| json!({"id": format!("ID{seed}X{i}"), "name": "item", "status": "ok"}))
                .collect();
            Value::String(Value::Array(items).to_string())
        }
        Output::Empty => Value::String(String::new()),
        Output::Parts(n) => json!([
            {"type": "text", "text": "x".repeat(*n)},
            {"type": "image_url", "image_url": {"url": "https://example.com/shot.png", "detail": "low"}}
        ]),
    }
}

fn build(turns: &[TurnSpec], end_with_user: bool) -> Vec<Message> {
    build_with(turns, end_with_user, 0)
}

/// [`build`], the task preceded by `instructions` lines of an agent's
/// instructions file (as Codex sends AGENTS.md) and an environment block.
fn build_with(turns: &[TurnSpec], end_with_user: bool, instructions: usize) -> Vec<Message> {
    let mut out = vec![msg(
        json!({"role": "system", "content": "You are an agent."}),
    )];
    if instructions > 0 {
        let lines: String = (0..instructions)
            .map(|l| {
                format!("- Rule {l}: run `make check-{l}` before committing to src/rule_{l}.rs\n")
            })
            .collect();
        out.push(msg(
            json!({"role": "user", "content": format!("# AGENTS.md\n\n{lines}")}),
        ));
        out.push(msg(
            json!({"role": "user", "content": "<environment_context><cwd>/repo</cwd></environment_context>"}),
        ));
    }
    out.push(msg(
        json!({"role": "user", "content": "Fix the bug in the parser."}),
    ));
    for (t, turn) in turns.iter().enumerate() {
        let calls: Vec<Value> = turn
            .calls
            .iter()
            .map(|(id, _)| json!({"id": format!("call_{id}"), "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("cat src/{t}.rs"), "body": "y".repeat(700 * (t % 3))}).to_string()}}))
            .collect();
        // Ids within one turn must be distinct for the request to be valid.
        let mut seen = std::collections::HashSet::new();
        let calls: Vec<Value> = calls
            .into_iter()
            .filter(|c| seen.insert(c["id"].as_str().unwrap().to_string()))
            .collect();
        let mut a = json!({"role": "assistant", "content": turn.text});
        if !calls.is_empty() {
            a["tool_calls"] = Value::Array(calls.clone());
        }
        out.push(msg(a));
        for (k, c) in calls.iter().enumerate() {
            let content = render_output(&turn.calls[k].1, t * 10 + k);
            out.push(msg(
                json!({"role": "tool", "tool_call_id": c["id"], "content": content}),
            ));
        }
        if let Some(u) = &turn.user_after {
            out.push(msg(json!({"role": "user", "content": u})));
        }
    }
    if end_with_user {
        out.push(msg(json!({"role": "user", "content": "What now?"})));
    }
    out
}

/// The conversation as an agent that acts in text would have it: each call
/// a fenced block ending the assistant's text, its results one `user`
/// message after it.
fn textual(messages: &[Message]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::new();
    let mut after_call = false;
    for m in messages {
        let v = json_of(m);
        match v["role"].as_str() {
            Some("assistant") if v["tool_calls"].is_array() => {
                let mut text = v["content"].as_str().unwrap_or_default().to_string();
                for c in v["tool_calls"].as_array().unwrap() {
                    let args = c["function"]["arguments"].as_str().unwrap();
                    text.push_str(&format!("\n```run\n{args}\n```"));
                }
                out.push(msg(json!({"role": "assistant", "content": text})));
                after_call = true;
            }
            Some("tool") => {
                let text = match &v["content"] {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                if after_call && out.last().is_some_and(|l| json_of(l)["role"] == "user") {
                    let mut last = json_of(out.last().unwrap());
                    let joined = format!("{}\n{text}", last["content"].as_str().unwrap());
                    last["content"] = Value::String(joined);
                    *out.last_mut().unwrap() = msg(last);
                } else {
                    out.push(msg(json!({"role": "user", "content": text})));
                }
            }
            _ => {
                out.push(m.clone());
                after_call = false;
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn invariants_hold(turns in prop::collection::vec(turn_strategy(), 1..14), end_with_user: bool, text_mode: bool, instructions in prop_oneof![Just(0usize), 10usize..400], budget in 300.0f64..12000.0) {
        let svc = service();
        let input = build_with(&turns, end_with_user, instructions);
        let input = if text_mode { textual(&input) } else { input };
        let before = tokens(&svc, &input);
        let out = run(&svc, &input, budget);
        let result = out.messages.clone().unwrap_or_else(|| input.clone());
        let emergency = out.stages.iter().any(|s| s.stage == "emergency");

        // Output never grows; the report matches the messages.
        prop_assert!(out.tokens_after <= out.tokens_before);
        prop_assert_eq!(out.tokens_before, before);
        prop_assert_eq!(tokens(&svc, &result), out.tokens_after);
        // Under the trigger nothing changes.
        if (before as f64) < 0.9 * budget {
            prop_assert!(out.messages.is_none());
        }
        // Valid JSON messages, tool calls still paired.
        prop_assert!(well_paired(&input));
        prop_assert!(well_paired(&result), "pairing broken: {:?}", out.stages);
        // Protected messages are byte-identical and still there.
        let a = compaction::conversation::Analysis::of(&input);
        for i in 0..input.len() {
            let system = matches!(a.roles[i], compaction::conversation::Role::System);
            let last_user = a.last_user == Some(i);
            let unconsumed = a.output(i) && !a.consumed[i];
            if system || last_user || (unconsumed && !emergency) {
                prop_assert!(result.iter().any(|m| m.raw() == input[i].raw()), "protected message {} changed ({:?})", i, out.stages);
            }
        }
        prop_assert!(result[0].raw() == input[0].raw(), "system prompt changed");
        // Idempotence: compacting an output that fits again changes nothing.
        if out.fits {
            let again = run(&svc, &result, budget);
            prop_assert!(again.messages.is_none(), "second pass changed it: {:?} then {:?}", out.stages, again.stages);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// With checkpoints instead of digests: the span is whole units after
    /// the pinned head (the system messages, then the instructions, the
    /// environment and the task before the first model turn), answered
    /// calls only; the checkpointed request keeps the head verbatim and in
    /// place, every protected message and every pairing, and is never
    /// larger.
    #[test]
    fn checkpoint_spans_keep_the_invariants(turns in prop::collection::vec(turn_strategy(), 1..14), end_with_user: bool, instructions in prop_oneof![Just(0usize), 10usize..400], budget in 300.0f64..12000.0) {
        let svc = service();
        let input = build_with(&turns, end_with_user, instructions);
        let counter = CachedCounter::new(&svc, Encoding::O200k);
        let limits = limits(budget);
        let trigger = condense::config::SummaryConfig::default().trigger;
        let pending = Replacement::Checkpoint { trigger, max_tokens: 60, message: None };
        let out = compaction::compact_with(&input, &limits, &settings(), &counter, &pending);
        let Some(span) = out.span.clone() else {
            prop_assert!(out.messages.is_none() || !out.stages.iter().any(|s| s.stage == "prune"));
            return Ok(());
        };
        prop_assert!(out.messages.is_none());
        let a = compaction::conversation::Analysis::of(&input);
        prop_assert_eq!(span.start, a.head);
        prop_assert!((a.base..a.head).all(|i| a.pinned[i]));
        prop_assert!(span.end > span.start && span.end <= input.len());
        prop_assert!(span.previous_ends.iter().all(|&p| p < span.end));
        for unit in &a.units {
            let inside = unit.iter().filter(|&&i| i >= span.start && i < span.end).count();
            prop_assert!(inside == 0 || inside == unit.len(), "span splits a unit");
        }
        for i in span.start..span.end {
            prop_assert!(a.roles[i] != compaction::conversation::Role::Tool || a.consumed[i]);
        }

        let checkpoint = Bytes::from(json!({"role": "user", "content": "[condense: checkpoint.] summary"}).to_string());
        let with = Replacement::Checkpoint { trigger, max_tokens: 60, message: Some(checkpoint.clone()) };
        let done = compaction::compact_with(&input, &limits, &settings(), &counter, &with);
        prop_assert!(done.span.is_none());
        let result = done.messages.clone().unwrap();
        prop_assert!(done.stages.iter().any(|s| s.stage == "summarize"));
        // The checkpoint, with the recall key of the span it replaces.
        let is_checkpoint = |m: &Message| {
            let raw = std::str::from_utf8(m.raw()).unwrap_or("");
            raw.contains("\"[condense: recall key: ") && raw.contains("; checkpoint.] summary\"")
        };
        let emergency = done.stages.iter().any(|s| s.stage == "emergency");
        // One checkpoint; the emergency stage's last resort may drop it
        // when even the head, the last user message and the turn in
        // progress alone do not fit otherwise.
        let checkpoints = result.iter().filter(|m| is_checkpoint(m)).count();
        prop_assert!(checkpoints == 1 || (emergency && checkpoints == 0), "{} checkpoints", checkpoints);
        prop_assert!(done.tokens_after <= done.tokens_before);
        prop_assert!(well_paired(&result));
        if !emergency {
            // The head in place: each message whole, or (when together
            // they are over the fit share of the budget) cut with the key
            // that recalls it.
            let head_tokens = messages_tokens(&svc, &input[a.base..a.head]);
            for i in 0..a.head {
                let kept = result[i].raw() == input[i].raw();
                let key = format!("recall key: {}", compaction::keys::key(input[i].raw()));
                let cut = head_tokens as f64 > settings().fit_share * budget
                    && std::str::from_utf8(result[i].raw()).is_ok_and(|r| r.contains(&key));
                prop_assert!(kept || cut, "head message {} changed", i);
            }
            prop_assert!(is_checkpoint(&result[a.head]), "the checkpoint is not right after the head");
        }
        for i in 0..input.len() {
            let system = matches!(a.roles[i], compaction::conversation::Role::System);
            let last_user = a.last_user == Some(i);
            if system || (last_user && !emergency) {
                prop_assert!(result.iter().any(|m| m.raw() == input[i].raw()), "protected message {} lost", i);
            }
        }
        // Nothing of the span but the last user message is left.
        for i in span.start..span.end {
            let twin = (0..input.len()).any(|j| (j < span.start || j >= span.end || a.last_user == Some(j)) && input[j].raw() == input[i].raw());
            if a.last_user != Some(i) && !twin {
                prop_assert!(!result.iter().any(|m| m.raw() == input[i].raw()), "message {} of the span kept", i);
            }
        }
    }
}

// ---------------------------------------------------------------- scenarios

fn agent_turns(n: usize, result_chars: usize) -> Vec<Message> {
    let mut out = vec![
        msg(json!({"role": "system", "content": "You are an agent."})),
        msg(json!({"role": "user", "content": "Fix the failing test test_parse_header."})),
    ];
    for t in 0..n {
        let id = format!("call_{t}");
        out.push(msg(json!({"role": "assistant", "content": format!("Step {t}: reading a file."), "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("cat -n src/module_{t}.py")}).to_string()}}]})));
        let mut body = String::new();
        for l in 0..result_chars / 40 {
            body.push_str(&format!("{l:>4}  x_{t}_{l} = compute({l})\n"));
        }
        body.push_str(&format!(
            "Traceback: File \"/repo/src/module_{t}.py\", line 7\nValueError: bad header {t}\n"
        ));
        out.push(msg(
            json!({"role": "tool", "tool_call_id": id, "content": body}),
        ));
    }
    out
}

/// The requests of `all` turn by turn (each prefix from `from` messages
/// on, two messages further each turn) as compacted at `budget`, each with
/// the number of messages the client sent.
fn turn_by_turn(
    svc: &TokenService,
    all: &[Message],
    from: usize,
    budget: f64,
) -> Vec<(usize, Vec<Message>)> {
    (from..all.len())
        .step_by(2)
        .map(|end| {
            let prefix = &all[..end];
            let out = run(svc, prefix, budget);
            (end, out.messages.unwrap_or_else(|| prefix.to_vec()))
        })
        .collect()
}

/// Where the digest stands in `m`, if there is one.
fn digest_at(m: &[Message]) -> Option<usize> {
    m.iter()
        .position(|m| content(m).contains("earlier messages were removed"))
}

/// How many messages `now` begins with as `prev` had them, byte for byte.
fn common_prefix(prev: &[Message], now: &[Message]) -> usize {
    prev.iter()
        .zip(now)
        .take_while(|(a, b)| a.raw() == b.raw())
        .count()
}

fn content(m: &Message) -> String {
    json_of(m)["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn under_the_trigger_nothing_changes() {
    let svc = service();
    let m = agent_turns(4, 400);
    let out = run(&svc, &m, 100_000.0);
    assert!(out.messages.is_none());
    assert_eq!(out.actions(), "none");
}

#[test]
fn mask_replaces_old_results_with_extractive_placeholders() {
    let svc = service();
    let m = agent_turns(12, 4000);
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 1.2);
    assert!(out.actions().contains("mask"), "{}", out.actions());
    let result = out.messages.unwrap();
    assert_eq!(result.len(), m.len());
    let first_result = content(&result[3]);
    // With its recall key (the request has tools, recall is on).
    let key = condense::compaction::keys::key(m[3].raw());
    assert!(
        first_result.starts_with(&format!(
            "[condense: recall key: {key}; earlier tool output elided:"
        )),
        "{first_result}"
    );
    assert!(
        first_result.contains("chars, "),
        "says how much was elided: {first_result}"
    );
    assert!(
        first_result.contains("/repo/src/module_0.py"),
        "keeps the path: {first_result}"
    );
    assert!(
        first_result.contains("ValueError: bad header 0"),
        "keeps the error: {first_result}"
    );
    // Assistant messages are never masked; the recent turns stay verbatim
    // but for answered results masked ahead of the frontier, each with its
    // own recall key; the unanswered last one is whole.
    assert_eq!(result[2].raw(), m[2].raw());
    let n = m.len();
    for i in n - 6..n {
        if result[i].raw() == m[i].raw() {
            continue;
        }
        let key = condense::compaction::keys::key(m[i].raw());
        assert!(
            i < n - 1
                && m[i].role() == Some("tool")
                && content(&result[i]).starts_with(&format!("[condense: recall key: {key};")),
            "recent message {i} changed"
        );
    }
    assert_eq!(result[n - 1].raw(), m[n - 1].raw());
    assert!(out.tokens_after as f64 <= 0.9 * before as f64 / 1.2);
}

#[test]
fn json_results_get_a_shape_digest() {
    let svc = service();
    let mut m = agent_turns(8, 3000);
    let items: Vec<Value> = (0..40)
        .map(|i| json!({"id": format!("RES{i:03}"), "name": "flight", "status": "booked"}))
        .collect();
    m[3] = msg(
        json!({"role": "tool", "tool_call_id": "call_0", "content": Value::Array(items).to_string()}),
    );
    let before = tokens(&svc, &m);
    let result = run(&svc, &m, before as f64 / 1.3).messages.unwrap();
    let c = content(&result[3]);
    assert!(
        c.contains("array of 40 objects with keys id, name, status"),
        "{c}"
    );
    assert!(c.contains("RES000"), "{c}");
}

#[test]
fn boundaries_stay_put_between_steps() {
    // Turn after turn, the compacted prefix is byte-identical until the
    // frontier has to move again: most turns keep everything but the new
    // messages, and the result the agent has just answered, which may be
    // masked ahead (it is the last message the provider cached, so only
    // its placeholder is new).
    let svc = service();
    let all = agent_turns(40, 2500);
    let budget = 9000.0;
    let requests = turn_by_turn(&svc, &all, 4, budget);
    for (_, now) in &requests {
        assert!(tokens(&svc, now) as f64 <= budget);
    }
    let (mut steady, mut moves) = (0, 0);
    for pair in requests.windows(2) {
        let (prev, now) = (&pair[0].1, &pair[1].1);
        let common = common_prefix(prev, now);
        let last = prev.len() - 1;
        if common == prev.len() || (common == last && content(&now[last]).starts_with("[condense:"))
        {
            steady += 1;
        } else {
            moves += 1;
        }
    }
    assert!(
        steady >= 2 * moves,
        "the boundary moved on {moves} turns and stayed on {steady}"
    );
}

#[test]
fn a_budget_that_grows_undoes_nothing_an_earlier_turn_decided() {
    // A conversation compacted against 9000 raw tokens; then calibration's
    // ratio fell, and the next request's budget is 20000. Replayed against
    // today's budget alone, no turn was ever over it and the request goes
    // out whole: every result masked on the turn before comes back.
    // Replayed against the budget each earlier turn had, each stays as it
    // was sent, byte for byte.
    let svc = service();
    let all = agent_turns(21, 2500);
    let (end, small, large) = (all.len() - 2, 9000.0, 20_000.0);
    let before = run(&svc, &all[..end], small);
    let sent = before.fates.expect("compacted against the small budget");
    let masked: Vec<usize> = (0..end).filter(|&i| sent.rewritten[i].is_some()).collect();
    assert!(masked.len() >= 5, "{masked:?}");

    assert!(run(&svc, &all, large).messages.is_none());

    let earlier = compaction::Earlier {
        due: Some(before.frontier),
        budgets: vec![(end, small)],
    };
    let now = run_after(&svc, &all, large, &earlier);
    let fates = now.fates.expect("still compacted");
    assert_eq!(fates.rewritten[..end], sent.rewritten[..]);
    assert_eq!(fates.dropped[..end], sent.dropped[..]);
    assert!(now.frontier >= before.frontier);
}

#[test]
fn a_budget_that_moves_leaves_the_digest_as_it_was() {
    // A long session whose old turns were dropped against 3000 raw tokens:
    // the digest's size is bounded by the room that budget leaves. Then the
    // ratio fell and today's budget is 3300, with nothing new to drop.
    // Sized by today's room, the digest kept more lines and was rewritten,
    // and everything after it lost the provider's cached prefix.
    let svc = service();
    let all = agent_turns(60, 400);
    let (end, small) = (all.len() - 2, 3000.0);
    let before = run(&svc, &all[..end], small);
    assert!(before.actions().contains("prune"), "{}", before.actions());
    let sent = before.fates.expect("compacted");
    let digest = sent.replacement.expect("a digest");

    let earlier = compaction::Earlier {
        due: Some(before.frontier),
        budgets: vec![(end, small)],
    };
    let now = run_after(&svc, &all, small * 1.1, &earlier);
    let fates = now.fates.expect("still compacted");
    assert_eq!(fates.dropped[..end], sent.dropped[..]);
    assert_eq!(
        String::from_utf8_lossy(&fates.replacement.expect("a digest")),
        String::from_utf8_lossy(&digest)
    );
}

#[test]
fn fit_cuts_a_single_huge_result() {
    let svc = service();
    let mut m = agent_turns(3, 300);
    let huge = "0123456789 abcdefghij\n".repeat(3000);
    m[5] = msg(json!({"role": "tool", "tool_call_id": "call_1", "content": huge}));
    let before = tokens(&svc, &m);
    let budget = before as f64 / 1.05;
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("fit"), "{}", out.actions());
    let result = out.messages.unwrap();
    let cut = svc.message_tokens(result[5].raw(), Encoding::O200k) as f64;
    assert!(
        cut <= 0.3 * budget * 1.05,
        "{cut} tokens left of a {budget}-token budget"
    );
    assert!(content(&result[5]).contains("[condense:"));
}

#[test]
fn unconsumed_results_are_untouched_until_emergency() {
    let svc = service();
    let mut m = agent_turns(2, 300);
    // The newest result is unconsumed: no assistant message after it.
    let huge = "data row\n".repeat(4000);
    let last = m.len() - 1;
    m[last] = msg(json!({"role": "tool", "tool_call_id": "call_1", "content": huge}));
    let before = tokens(&svc, &m);
    // A budget the unconsumed result alone exceeds: only emergency can help.
    let out = run(&svc, &m, before as f64 / 4.0);
    assert!(out.actions().contains("emergency"), "{}", out.actions());
    assert!(out.fits);
    let result = out.messages.unwrap();
    assert_eq!(result[0].raw(), m[0].raw());
    assert!(
        result.last().unwrap().raw() != m[last].raw(),
        "emergency shortened it"
    );
    // When masking older results is enough, the unconsumed one stays.
    let mut m = agent_turns(8, 4000);
    let last = m.len() - 1;
    m[last] =
        msg(json!({"role": "tool", "tool_call_id": "call_7", "content": "data row\n".repeat(800)}));
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 1.3);
    assert!(out.actions().contains("mask"), "{}", out.actions());
    assert!(!out.actions().contains("emergency"), "{}", out.actions());
    assert!(
        out.messages.unwrap().last().unwrap().raw() == m[last].raw(),
        "the unconsumed result changed"
    );
}

/// A tool result of about `chars` characters with a path and an error line
/// an extractive placeholder keeps.
fn big_result(id: &str, chars: usize) -> Message {
    let mut body = String::new();
    while body.len() < chars {
        body.push_str(&format!("{:>5}  row = fetch({})\n", body.len(), body.len()));
    }
    body.push_str("File \"/repo/src/big.py\", line 9\nKeyError: 'missing_header'\n");
    msg(json!({"role": "tool", "tool_call_id": id, "content": body}))
}

#[test]
fn large_answered_results_are_masked_ahead_of_the_recent_window() {
    // Once compaction has begun, a large result the agent has answered (or
    // large arguments of an answered call) is masked even inside the recent
    // turns: it sits near the end, so this costs the cache little. Small
    // recent results stay verbatim, and the masked form stays the same on
    // the next turn.
    let svc = service();
    let mut m = agent_turns(12, 1500);
    let big = 2 + 2 * 9 + 1; // turn 9's result, answered by turn 10
    m[big] = big_result("call_9", 6000);
    // Turn 10 writes a large file: its arguments count the same way.
    let result_10 = content(&m[big + 2]);
    write_turn(&mut m, 10, &result_10);
    let budget = tokens(&svc, &m) as f64 / 1.15;
    let out = run(&svc, &m, budget);
    let result = out.messages.expect("compacted");
    assert_eq!(result.len(), m.len(), "nothing was dropped");
    let masked = content(&result[big]);
    assert!(masked.starts_with("[condense:"), "{masked}");
    assert!(masked.contains("KeyError: 'missing_header'"), "{masked}");
    // The large arguments are shortened and stay valid JSON with the path.
    let call = &json_of(&result[big + 1])["tool_calls"][0]["function"]["arguments"];
    let shortened: Value = serde_json::from_str(call.as_str().unwrap()).unwrap();
    assert_eq!(shortened["path"], "/repo/src/handler.py");
    assert!(shortened["file_text"].as_str().unwrap().len() < 1000);
    // Turn 10's result, small and just as recent, is untouched; so is the
    // unanswered last one.
    assert!(result[big + 2].raw() == m[big + 2].raw());
    assert!(result[big + 4].raw() == m[big + 4].raw());

    // Next turn: the placeholder is byte-identical.
    let mut next = m.clone();
    next.push(msg(
        json!({"role": "assistant", "content": "Step 12: done reading."}),
    ));
    next.push(msg(json!({"role": "user", "content": "Thanks, go on."})));
    let again = run(&svc, &next, budget).messages.expect("compacted");
    assert!(
        again[big].raw() == result[big].raw(),
        "the placeholder changed"
    );

    // Without masking ahead, the recent window (the last 3 turns) would
    // keep it, were the window not limited to 20% of the budget.
    let off = Settings {
        ahead_share: 10.0,
        ..settings()
    };
    let capped = run_with(&svc, &m, budget, &off)
        .messages
        .expect("compacted");
    assert!(content(&capped[big]) == masked, "the recent window held it");
    let uncapped = Settings {
        recent_max_share: 10.0,
        ..off
    };
    let kept = run_with(&svc, &m, budget, &uncapped)
        .messages
        .expect("compacted");
    assert!(content(&kept[big]) != masked, "masked in the recent window");
}

#[test]
fn masking_ahead_stops_once_the_request_is_under_its_target() {
    // Each result here is large enough to be masked ahead. Masked all on
    // the turn the conversation first crossed the trigger, they left it at
    // a fraction of its budget, with results it had room for masked (a
    // browsing agent's pages). Masking ahead stops once the request is
    // under the target: a result it passes by stays whole until the
    // frontier comes, and one answered while the request is over the
    // target is masked as it is answered.
    let svc = service();
    let s = settings();
    let m = agent_turns(8, 5000);
    let budget = tokens(&svc, &m) as f64 / 1.1;
    let result = run(&svc, &m, budget).messages.expect("compacted");
    let whole = |r: &[Message]| {
        (0..r.len() - 1)
            .filter(|&i| json_of(&r[i])["role"] == "tool" && r[i].raw() == m[i].raw())
            .count()
    };
    let after = tokens(&svc, &result) as f64;
    assert!(after <= s.target * budget * 1.05, "{after} of {budget}");
    assert!(after >= (s.target - 0.1) * budget, "{after} of {budget}");
    assert!(whole(&result) >= 2, "answered results kept whole");

    // The next turn goes over the target: the result it answers is masked
    // ahead, and everything before it stays byte-identical, the results
    // passed by still whole.
    let mut next = m.clone();
    let more = agent_turns(9, 5000);
    next.extend_from_slice(&more[m.len()..]);
    assert!(tokens(&svc, &next) as f64 - (tokens(&svc, &m) as f64 - after) > s.target * budget);
    let again = run(&svc, &next, budget).messages.expect("compacted");
    let answered = m.len() - 1;
    for i in 0..answered {
        assert!(again[i].raw() == result[i].raw(), "message {i} changed");
    }
    assert!(whole(&again) >= 2, "the results passed by were masked");
    assert!(content(&again[answered]).starts_with("[condense:"));
    let later = tokens(&svc, &again) as f64;
    assert!(later <= s.target * budget * 1.05, "{later} of {budget}");
}

/// Turn `t` of [`agent_turns`] rewritten as a call that writes a large file,
/// with `result` as its tool result.
fn write_turn(m: &mut [Message], t: usize, result: &str) {
    let file = "def handler(request):\n    return respond(request)\n".repeat(120);
    let args = json!({"command": "create", "path": "/repo/src/handler.py", "file_text": file});
    let id = format!("call_{t}");
    m[2 + 2 * t] = msg(
        json!({"role": "assistant", "content": format!("Step {t}: writing the handler."), "tool_calls": [{"id": id, "type": "function", "function": {"name": "edit", "arguments": args.to_string()}}]}),
    );
    m[3 + 2 * t] = msg(json!({"role": "tool", "tool_call_id": id, "content": result}));
}

#[test]
fn a_large_write_is_shortened_as_soon_as_its_result_is_in() {
    // Once compaction has begun, the arguments of a call that wrote a whole
    // file are shortened in the very request that brings its result: they
    // are new in that request, so the cached prefix loses nothing, where
    // shortening them a turn later rewrites everything after them.
    let svc = service();
    let mut m = agent_turns(12, 1500);
    let last = m.len() - 1;
    write_turn(
        &mut m,
        11,
        "File created successfully at: /repo/src/handler.py",
    );
    let budget = tokens(&svc, &m) as f64 / 1.15;
    let result = run(&svc, &m, budget).messages.expect("compacted");
    let call = &json_of(&result[last - 1])["tool_calls"][0]["function"]["arguments"];
    let shortened: Value = serde_json::from_str(call.as_str().unwrap()).unwrap();
    assert_eq!(shortened["path"], "/repo/src/handler.py");
    assert!(shortened["file_text"].as_str().unwrap().len() < 1000);
    assert_eq!(content(&result[last - 1]), "Step 11: writing the handler.");
    assert!(result[last].raw() == m[last].raw(), "the result changed");

    // The next turn keeps the shortened call byte-identical.
    let mut next = m.clone();
    next.push(msg(
        json!({"role": "assistant", "content": "Step 12: running it.", "tool_calls": [{"id": "call_12", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"pytest\"}"}}]}),
    ));
    next.push(msg(
        json!({"role": "tool", "tool_call_id": "call_12", "content": "1 passed"}),
    ));
    let again = run(&svc, &next, budget).messages.expect("compacted");
    assert!(again.len() == next.len() && again[last - 1].raw() == result[last - 1].raw());

    // A write that failed keeps its arguments until the agent has answered
    // (it may retry with the same content) ...
    write_turn(
        &mut m,
        11,
        "ERROR: File already exists at: /repo/src/handler.py. Cannot overwrite files using command `create`.",
    );
    let failed = run(&svc, &m, budget).messages.expect("compacted");
    assert!(
        failed[last - 1].raw() == m[last - 1].raw(),
        "a failed call was shortened"
    );
}

/// A session of an agent that acts in text (mini-swe-agent's format): each
/// turn ends with a fenced command, its output comes back as a `user`
/// message.
fn text_agent_turns(n: usize, output_chars: usize) -> Vec<Message> {
    let mut out = vec![
        msg(json!({"role": "system", "content": "You are an agent. Reply with one bash block."})),
        msg(json!({"role": "user", "content": "Fix the failing test test_parse_header."})),
    ];
    for t in 0..n {
        out.push(msg(json!({"role": "assistant", "content": format!("THOUGHT: step {t}, reading a file.\n\n```bash\ncat -n src/module_{t}.py\n```")})));
        let mut body = String::from("<returncode>1</returncode>\n<output>\n");
        for l in 0..output_chars / 40 {
            body.push_str(&format!("{l:>4}  x_{t}_{l} = compute({l})\n"));
        }
        body.push_str(&format!(
            "Traceback: File \"/repo/src/module_{t}.py\", line 7\nValueError: bad header {t}\n</output>"
        ));
        out.push(msg(json!({"role": "user", "content": body})));
    }
    out
}

#[test]
fn a_text_mode_agent_has_its_old_outputs_masked_not_dropped() {
    // An agent without function calling gets its command outputs back as
    // user messages. Old ones are masked like tool results (rather than
    // whole turns being dropped); a person's message is not.
    let svc = service();
    let mut m = text_agent_turns(12, 4000);
    let note = format!(
        "Also keep the old API working. {}",
        "The callers in billing rely on parse_header returning None. ".repeat(40)
    );
    m[8] = msg(
        json!({"role": "assistant", "content": "The cause is in module_3. Shall I change it?"}),
    );
    m[9] = msg(json!({"role": "user", "content": note}));
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 1.2);
    assert!(!out.actions().contains("prune"), "{}", out.actions());
    let result = out.messages.expect("compacted");
    assert_eq!(result.len(), m.len());
    let first = content(&result[3]);
    assert!(
        first.starts_with("[condense: recall key: ")
            && first.contains("; earlier tool output elided:"),
        "{first}"
    );
    assert!(first.contains("/repo/src/module_0.py") && first.contains("ValueError: bad header 0"));
    assert!(
        result[9].raw() == m[9].raw(),
        "the person's message changed"
    );
    for i in (2..m.len()).step_by(2) {
        assert!(
            result[i].raw() == m[i].raw(),
            "assistant message {i} changed"
        );
    }
    let last = m.len() - 1;
    assert!(
        result[last].raw() == m[last].raw(),
        "the newest output changed"
    );
}

#[test]
fn a_text_mode_write_is_shortened_like_call_arguments() {
    // A file written through a heredoc is that agent's tool-call arguments:
    // once old, the action is cut and the words before it stay.
    let svc = service();
    let mut m = text_agent_turns(12, 1500);
    let file = "def handler(request):\n    return respond(request)\n".repeat(120);
    let prose = "THOUGHT: writing the handler.\n\n";
    m[2] = msg(
        json!({"role": "assistant", "content": format!("{prose}```bash\ncat <<'EOF' > /repo/src/handler.py\n{file}EOF\n```")}),
    );
    m[3] =
        msg(json!({"role": "user", "content": "<returncode>0</returncode>\n<output>\n</output>"}));
    let before = tokens(&svc, &m);
    let result = run(&svc, &m, before as f64 / 1.2)
        .messages
        .expect("compacted");
    let written = content(&result[2]);
    assert!(written.len() < 1000, "{}", written.len());
    assert!(written.starts_with(&format!(
        "{prose}```bash\ncat <<'EOF' > /repo/src/handler.py\n"
    )));
    assert!(
        written.contains("[condense:") && written.ends_with("EOF\n```"),
        "{written}"
    );
    // Compacting the result again changes nothing.
    let again = run(&svc, &result, before as f64 / 1.2);
    assert!(again.messages.is_none(), "{:?}", again.stages);
}

#[test]
fn a_huge_unanswered_result_does_not_take_the_history_with_it() {
    // The newest result (no answer yet, so untouchable) alone is more than
    // the target: drops go only as far as the request must, counting the
    // result at the size it will have once answered, and the next turn
    // replays exactly the same drops.
    let svc = service();
    // Results too short to mask: only drops make room.
    let mut m = agent_turns(10, 600);
    let last = m.len() - 1;
    m[last] = big_result("call_9", 100);
    let rest = tokens(&svc, &m) as f64;
    let budget = rest / 0.75;
    m[last] = big_result("call_9", (budget * 0.45 * 3.0) as usize);
    let out = run(&svc, &m, budget);
    assert!(
        out.fits && out.actions().contains("prune"),
        "{} -> {} of {budget}: {}",
        out.tokens_before,
        out.tokens_after,
        out.actions()
    );
    let result = out.messages.expect("compacted");
    assert!(result.last().unwrap().raw() == m[last].raw());
    // Dropping down to the target with the result at full size would take
    // every turn but its own; counted at its answered size, the next turn
    // lands at the target and older turns survive.
    let turns = result
        .iter()
        .filter(|x| json_of(x)["role"] == "assistant")
        .count();
    assert!(turns >= 4, "{turns} of 10 turns left");

    let mut next = m.clone();
    next.push(msg(
        json!({"role": "assistant", "content": "Step 10: found the bad key."}),
    ));
    next.push(msg(json!({"role": "user", "content": "Fix it."})));
    let again = run(&svc, &next, budget).messages.expect("compacted");
    let stable = result.len() - 1;
    assert!(
        again[..stable]
            .iter()
            .zip(&result[..stable])
            .all(|(x, y)| x.raw() == y.raw()),
        "the drops moved between turns"
    );
    // ... and the result, now answered, is a placeholder.
    assert!(content(&again[stable]).starts_with("[condense:"));
}

#[test]
fn prune_drops_whole_units_and_leaves_a_digest() {
    let svc = service();
    let m = agent_turns(30, 1500);
    let before = tokens(&svc, &m);
    let budget = before as f64 / 6.0;
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("prune"), "{}", out.actions());
    let result = out.messages.unwrap();
    assert!(well_paired(&result));
    assert!(result.len() < m.len());
    // The system prompt and the task stay; a digest stands in for the
    // turns dropped, the newest the frontier had passed (so that the
    // cached prefix holds up to them).
    assert_eq!(result[0].raw(), m[0].raw());
    assert_eq!(result[1].raw(), m[1].raw());
    let at = result
        .iter()
        .position(|r| content(r).contains("earlier messages were removed"))
        .unwrap();
    let digest = content(&result[at]);
    assert!(digest.starts_with("[condense:"), "{digest}");
    // The oldest turn is still there, masked, before it.
    assert!(at > 3);
    assert_eq!(json_of(&result[2])["tool_calls"][0]["id"], "call_0");
    assert!(content(&result[3]).starts_with("[condense:"));
    assert!(digest.contains("ValueError: bad header"), "{digest}");
    assert!(out.tokens_after as f64 <= budget);
}

#[test]
fn a_drop_keeps_the_cached_prefix_up_to_the_turns_it_removes() {
    // Turn after turn on a budget that keeps dropping: every turn that
    // drops more keeps the previous request's bytes past the task (the
    // older masked turns), as they were. Oldest first, each drop rewrote
    // everything after the task.
    let svc = service();
    let all = agent_turns(60, 2500);
    let removed = |m: &[Message]| {
        m.iter()
            .map(content)
            .find_map(|c| {
                let at = c.find(" earlier messages were removed")?;
                c[..at].rsplit(' ').next()?.parse::<usize>().ok()
            })
            .unwrap_or(0)
    };
    let mut drops = 0;
    for pair in turn_by_turn(&svc, &all, 4, 3000.0).windows(2) {
        let (prev, (end, now)) = (&pair[0].1, &pair[1]);
        if removed(now) > removed(prev) {
            drops += 1;
            let common = common_prefix(prev, now);
            assert!(
                common > 4,
                "the drop at {end} messages kept {common} of the previous request"
            );
        }
    }
    assert!(drops >= 3, "{drops} drops");
}

/// A session with a long prompt from the user (`lines` requirements) in
/// the middle: agent turns before it and after it (how many, and the
/// characters of each result), and where the prompt stands.
fn a_long_ask_between(
    before: (usize, usize),
    lines: usize,
    after: (usize, usize),
) -> (Vec<Message>, usize) {
    let mut all = agent_turns(before.0, before.1);
    let spec: String = (0..lines)
        .map(|i| format!("- Requirement {i}: the startup check waits for service {i} to answer.\n"))
        .collect();
    let long = all.len();
    all.push(msg(json!({"role": "user", "content": spec})));
    all.extend(agent_turns(after.0, after.1).into_iter().skip(2).map(|m| {
        // Other call ids than the turns' before.
        let v = json_of(&m).to_string().replace("\"call_", "\"call_b");
        msg(serde_json::from_str(&v).unwrap())
    }));
    (all, long)
}

#[test]
fn a_drop_past_a_long_user_message_leaves_it_cached() {
    // A long prompt from the user in the middle of a session (a spec-kit
    // command), with agent turns on both sides: drops take turns before
    // it and after it, and what the user wrote stays. Each drop after it
    // keeps it in the cached prefix: the digest stands past it. Before it,
    // each drop changed the digest in front of it and sent it again.
    let svc = service();
    let (all, long) = a_long_ask_between((20, 2500), 300, (40, 2500));
    let requests = turn_by_turn(&svc, &all, long + 3, 9000.0);
    let prompt_at = |m: &[Message]| {
        assert!(well_paired(m));
        let at = m.iter().position(|m| m.raw() == all[long].raw());
        at.expect("what the user wrote stays")
    };
    prompt_at(&requests[0].1);
    let mut past = 0;
    for pair in requests.windows(2) {
        let (prev, (end, now)) = (&pair[0].1, &pair[1]);
        let at = prompt_at(now);
        // From one drop to the next (the first rewrites from the first
        // message it removes, before the prompt).
        if digest_at(now).is_some_and(|d| d > at) && digest_at(prev).is_some() {
            past += 1;
            let common = common_prefix(prev, now);
            assert!(
                common > at,
                "a drop at {end} messages sent the user's prompt again"
            );
        }
    }
    assert!(past >= 3, "{past} requests with the digest past the prompt");
}

#[test]
fn a_digest_after_the_clients_last_words_leaves_them_theirs() {
    // A request as compaction leaves it when drops took every turn before
    // the user's long request and one after it: the digest, a user message,
    // stands past the request (`after_what_was_said`). Compacted again at
    // a budget it just fits, it must not change: the request is still the
    // client's last words, not the pinned head's to cut (it was, because
    // the digest read as the last user message).
    let svc = service();
    let ask: String = (0..240)
        .map(|i| format!("- Booking {i}: move the flight to the morning and keep seat {i}A.\n"))
        .collect();
    let out = [
        msg(json!({"role": "system", "content": "You are an agent."})),
        msg(json!({"role": "user", "content": ask})),
        msg(
            json!({"role": "assistant", "content": "Wait, actually the morning flights are full."}),
        ),
        msg(
            json!({"role": "user", "content": "[condense: recall key: 624176672068955; 12 earlier messages were removed to fit the context window.]"}),
        ),
        msg(
            json!({"role": "assistant", "content": "Checking the evening flights.", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{\"when\":\"evening\"}"}}]}),
        ),
        msg(
            json!({"role": "tool", "tool_call_id": "call_1", "content": "UA 12 18:05, UA 14 20:40"}),
        ),
    ];
    let budget = tokens(&svc, &out) as f64 / 0.99;
    let ask = messages_tokens(&svc, &out[1..2]) as f64;
    assert!(ask > settings().fit_share * budget, "over fit's share");
    let again = run(&svc, &out, budget);
    assert!(again.messages.is_none(), "{}", again.actions());
}

#[test]
fn a_request_that_fits_after_the_planned_stages_is_not_cut_further() {
    // An agent that runs four commands at once: on the turn their outputs
    // arrive, still unanswered, they hold the request over the trigger
    // after the plan masked what it may; on the next they are answered and
    // masked ahead. That first request fits: cut further on that turn
    // alone (`fade` did, from the trigger on), the recent results came
    // back whole on the next, and the cached prefix broke there. (A low
    // trigger leaves the shape room between it and the budget.)
    let svc = service();
    let s = Settings {
        trigger: 0.6,
        target: 0.4,
        ..settings()
    };
    let mut all = agent_turns(6, 1200);
    let calls: Vec<Value> = (0..4)
        .map(|k| json!({"id": format!("call_p{k}"), "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("pytest tests/test_{k}.py")}).to_string()}}))
        .collect();
    all.push(msg(
        json!({"role": "assistant", "content": "Running the four suites.", "tool_calls": calls}),
    ));
    for k in 0..4 {
        let out: String = (0..50)
            .map(|l| format!("tests/test_{k}.py::test_case_{l} PASSED [{l}%] in {k}.{l}s\n"))
            .collect();
        all.push(msg(
            json!({"role": "tool", "tool_call_id": format!("call_p{k}"), "content": out}),
        ));
    }
    all.push(msg(json!({"role": "assistant", "content": "All four pass. Checking the log.", "tool_calls": [{"id": "call_log", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"tail -3 log.txt\"}"}}]})));
    all.push(msg(
        json!({"role": "tool", "tool_call_id": "call_log", "content": "ok"}),
    ));
    let budget = 8000.0;
    let first = run_with(&svc, &all[..all.len() - 2], budget, &s);
    let next = run_with(&svc, &all, budget, &s);
    assert!(first.fits && first.tokens_before as f64 > s.trigger * budget);
    assert!(!first.actions().contains("fade"), "{}", first.actions());
    let sent = |o: Outcome, end: usize| o.messages.unwrap_or_else(|| all[..end].to_vec());
    let (prev, now) = (sent(first, all.len() - 2), sent(next, all.len()));
    for m in prev.iter().filter(|m| m.role() == Some("tool")) {
        if !content(m).contains("[condense:") {
            continue;
        }
        let id = m.tool_call_id();
        let whole = all
            .iter()
            .find(|o| o.role() == Some("tool") && o.tool_call_id() == id);
        assert!(
            !now.iter().any(|n| Some(n.raw()) == whole.map(Message::raw)),
            "{id:?}, cut on one turn, is whole on the next"
        );
    }
}

#[test]
fn a_digest_of_many_dropped_turns_keeps_more_of_their_key_lines() {
    let svc = service();
    // Only the largest results masked ahead: masked all, the recent ones
    // leave the shorter conversation under a sixth of its size with nothing
    // dropped, and the digest is what is measured here.
    let s = Settings {
        ahead_share: 0.1,
        ..settings()
    };
    let count = |m: &[Message], budget: f64| {
        let out = run_with(&svc, m, budget, &s);
        assert!(out.actions().contains("prune"), "{}", out.actions());
        assert!(out.tokens_after as f64 <= budget);
        let result = out.messages.unwrap();
        let digest = result
            .iter()
            .map(content)
            .find(|c| c.contains("earlier messages were removed"))
            .unwrap();
        (
            digest.matches("ValueError: bad header").count(),
            digest.len(),
        )
    };
    let few = agent_turns(30, 1500);
    let (few_errors, few_len) = count(&few, tokens(&svc, &few) as f64 / 6.0);
    let many = agent_turns(120, 1500);
    let (many_errors, many_len) = count(&many, tokens(&svc, &many) as f64 / 6.0);
    // 3 times the least at most, plus the frame.
    assert!(many_len < 3 * 1200 + 200, "{many_len}");
    assert!(10 * many_len > 18 * few_len, "{many_len} vs {few_len}");
    assert!(
        many_errors > 3 * few_errors,
        "{many_errors} vs {few_errors}"
    );
}

/// A session that opens with a greeting, then the user's `said` messages
/// after the model's hello, then `turns.0` agent turns with `correction`
/// after the first `turns.1` messages of them.
fn greeted(said: &[&str], turns: (usize, usize), correction: &str) -> Vec<Message> {
    let mut m = vec![
        msg(json!({"role": "system", "content": "You are an agent."})),
        msg(json!({"role": "user", "content": "hi"})),
        msg(json!({"role": "assistant", "content": "Hello! What can I do for you?"})),
    ];
    m.extend(
        said.iter()
            .map(|s| msg(json!({"role": "user", "content": s}))),
    );
    let agent = agent_turns(turns.0, 1500);
    let (first, second) = agent[2..].split_at(turns.1);
    m.extend_from_slice(first);
    m.push(msg(json!({"role": "user", "content": correction})));
    m.extend_from_slice(second);
    m
}

#[test]
fn what_the_user_wrote_after_the_first_answer_is_dropped_last() {
    // A greeting first, then the real task after the model's hello (as
    // Claude Code sessions begin), and a correction halfway.
    let svc = service();
    let m = greeted(
        &["Port the login page from template/login to src/pages."],
        (30, 30),
        "Keep the light theme, not the dark one.",
    );
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 6.0);
    assert!(out.actions().contains("prune"), "{}", out.actions());
    let result = out.messages.unwrap();
    assert!(well_paired(&result));
    let text: Vec<String> = result.iter().map(content).collect();
    for said in ["Port the login page", "Keep the light theme"] {
        assert!(
            text.iter().any(|t| t.starts_with(said)),
            "{said} was dropped: {:?}",
            out.stages
        );
    }
}

#[test]
fn a_digest_gives_what_the_user_wrote_in_the_turns_it_replaces() {
    // A greeting first, then the task after the model's hello, with the
    // IDE's note before it (Claude Code sends them as blocks of one turn)
    // and a pasted document after it; a correction later. On a budget too
    // small for the task, the digest gives it as the user wrote it, and
    // neither the IDE's note nor the document's head.
    let svc = service();
    let task = "阅读代码仓库，优化登陆/注册界面，参考内容为template/login和template/signup";
    let pasted = format!(
        "Here is the spec:\n{}",
        "The service shall start.\n".repeat(60)
    );
    let m = greeted(
        &[
            "<ide_opened_file>The user opened settings.json.</ide_opened_file>",
            task,
            &pasted,
        ],
        (40, 20),
        "Keep the   light theme,\nnot the dark one.",
    );
    let budget = tokens(&svc, &m) as f64 / 15.0;
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("prune"), "{}", out.actions());
    assert!(out.tokens_after as f64 <= budget);
    let result = out.messages.unwrap();
    assert!(well_paired(&result));
    let text: Vec<String> = result.iter().map(content).collect();
    for gone in [task, pasted.as_str()] {
        assert!(
            !text.iter().any(|t| t == gone),
            "{gone} was not dropped: {:?}",
            out.stages
        );
    }
    let digest = text
        .iter()
        .find(|t| t.contains("earlier messages were removed"))
        .expect("a digest");
    assert!(digest.contains("what the user wrote in them"), "{digest}");
    let said: Vec<&str> = digest.lines().filter(|l| l.starts_with("user: ")).collect();
    assert_eq!(said, [format!("user: {task}").as_str()], "{digest}");
    // The correction, dropped last, is still there on its own.
    assert!(text.iter().any(|t| t.starts_with("Keep the   light theme")));
    // The rest of the digest is key lines, as before.
    assert!(digest.contains("ValueError: bad header"), "{digest}");
}

#[test]
fn repeated_ids_are_paired_by_position_when_pruning() {
    let svc = service();
    let mut m = vec![
        msg(json!({"role": "system", "content": "s"})),
        msg(json!({"role": "user", "content": "task"})),
    ];
    for t in 0..30 {
        m.push(msg(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_same", "type": "function", "function": {"name": "lookup", "arguments": format!("{{\"n\":{t}}}")}}]})));
        m.push(msg(json!({"role": "tool", "tool_call_id": "call_same", "content": format!("result {t}: ").repeat(200)})));
    }
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 8.0);
    let result = out.messages.unwrap();
    assert!(well_paired(&result), "{:?}", out.stages);
}

#[test]
fn messages_with_epistemic_markers_are_kept_longer() {
    let svc = service();
    let mut m = agent_turns(14, 3000);
    // The assistant message at 6 revises itself; the result it answers
    // (message 5) is kept longer.
    m[6] = msg(
        json!({"role": "assistant", "content": "Wait, I was wrong about the header; let me reconsider.", "tool_calls": [{"id": "call_2", "type": "function", "function": {"name": "run", "arguments": "{}"}}]}),
    );
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 1.4);
    let result = out.messages.unwrap();
    assert!(
        content(&result[3]).starts_with("[condense:"),
        "an ordinary old result is masked"
    );
    assert_eq!(
        result[5].raw(),
        m[5].raw(),
        "the result the model reconsidered is kept"
    );
}

#[test]
fn compacted_bodies_stay_valid_requests() {
    let svc = service();
    let m = agent_turns(20, 3000);
    let body = json!({"model": "gpt-4o", "messages": m.iter().map(json_of).collect::<Vec<_>>(), "temperature": 0.2, "x_vendor": {"keep": true}});
    let mut req = ChatRequest::parse(&Bytes::from(body.to_string())).unwrap();
    let out = run(&svc, req.messages(), 8000.0);
    req.set_messages(out.messages.unwrap());
    let v: Value = serde_json::from_slice(&req.to_bytes()).unwrap();
    assert_eq!(v["temperature"], 0.2);
    assert_eq!(v["x_vendor"]["keep"], true);
    assert!(v["messages"].as_array().unwrap().len() >= 3);
}

// ---------------------------------------------------------------- replay

/// The example session (`examples/agent-session.json`) replayed with its
/// probes in a `window`.
fn example_replay(window: u64) -> condense::replay::Report {
    let body = Bytes::from(std::fs::read("examples/agent-session.json").unwrap());
    let probes: Vec<condense::replay::Probe> =
        serde_json::from_slice(&std::fs::read("examples/agent-session.probes.json").unwrap())
            .unwrap();
    let options = condense::offline::CompactOptions {
        model: None,
        window: Some(window),
    };
    condense::replay::replay(&Config::default(), &body, &options, &probes).unwrap()
}

#[test]
fn replay_of_the_example_session_fits_every_turn_and_keeps_facts() {
    let r = example_replay(12_000);
    assert_eq!(r.condense.turns_not_fit, 0);
    assert!(
        r.turns.iter().any(|t| t.actions != "none"),
        "the replay never compacted"
    );
    assert!(
        r.condense.prefix_stability >= 0.6,
        "{}",
        r.condense.prefix_stability
    );
    let ours = r.condense.probe_retention.unwrap();
    assert!(
        ours >= r.drop_oldest.probe_retention.unwrap(),
        "{ours} vs drop-oldest"
    );
    assert!(r.condense.tokens_sent <= r.last_10_results.tokens_sent);
}

#[test]
fn the_stability_ceiling_is_what_rewrites_leave_out() {
    // Nothing compacted: every strategy forwards what the client sent, and
    // what each turn adds is all it does not send cached.
    let wide = example_replay(1_000_000);
    assert!(wide.turns.iter().all(|t| t.actions == "none"));
    for t in [&wide.condense, &wide.drop_oldest, &wide.last_10_results] {
        assert!(t.stability_ceiling < 1.0);
        assert!(
            (t.stability_ceiling - t.prefix_stability).abs() < 1e-9,
            "{} vs {}",
            t.stability_ceiling,
            t.prefix_stability
        );
    }
    // Compacted: smaller requests lower the ceiling, and rewrites keep the
    // stability under it.
    let tight = example_replay(12_000);
    let (c, w) = (&tight.condense, &wide.condense);
    assert!(c.tokens_sent < w.tokens_sent);
    assert!(c.stability_ceiling < w.stability_ceiling);
    assert!(c.prefix_stability < c.stability_ceiling);
    assert!(tight.drop_oldest.prefix_stability <= tight.drop_oldest.stability_ceiling);
}

#[test]
#[ignore = "needs ../shared/traces beside the repository; run with `cargo test -- --ignored shared_traces`"]
fn replay_of_the_shared_traces() {
    // ../shared/traces is internal material beside the repository, not
    // part of the project.
    let dir = std::path::Path::new("../shared/traces");
    for name in ["oh_django-14351", "tau_airline_task2_trial1"] {
        let body =
            Bytes::from(std::fs::read(dir.join(format!("conversations/{name}.json"))).unwrap());
        let probes: Vec<condense::replay::Probe> = serde_json::from_slice(
            &std::fs::read(dir.join(format!("probes/{name}.json"))).unwrap(),
        )
        .unwrap();
        let options = condense::offline::CompactOptions {
            model: None,
            window: Some(32_000),
        };
        let r = condense::replay::replay(&Config::default(), &body, &options, &probes).unwrap();
        assert_eq!(r.condense.turns_not_fit, 0, "{name}");
        assert!(
            r.condense.prefix_stability >= 0.85,
            "{name}: {}",
            r.condense.prefix_stability
        );
        assert!(
            r.condense.probe_retention >= r.drop_oldest.probe_retention,
            "{name}"
        );
    }
}

// ------------------------------------------------- calibration drift

/// The conversation as a chat request body.
fn request_body(messages: &[Message]) -> Bytes {
    let list: Vec<Value> = messages.iter().map(json_of).collect();
    Bytes::from(json!({"model": "gpt-4o", "messages": list}).to_string())
}

/// What the proxy would forward for `body` with the calibration `svc` has
/// learned, and the observed ratio it reported with.
fn forwarded(svc: &TokenService, body: &Bytes, window: u64) -> (Bytes, f64) {
    let mut info = svc.model_info("u", "gpt-4o");
    info.window = window;
    let p = condense::pipeline::process(
        svc,
        &CompactionConfig::default(),
        condense::pipeline::Subject {
            upstream: "u",
            model: "gpt-4o",
            info,
            due: None,
            history: None,
        },
        ChatRequest::parse(body).unwrap(),
        body,
        false,
        &Replacement::Digest,
    );
    (p.request.to_bytes(), p.assessment.calibration_ratio)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// A calibration ratio that drifts within half the plan margin either
    /// way moves no boundary: the same conversation compacted under r and
    /// under r·(1 ± margin/2) is forwarded byte for byte the same, while
    /// the ratio the headers report does follow the drift.
    #[test]
    fn a_calibration_drift_within_the_margin_moves_no_boundary(
        turns in prop::collection::vec(turn_strategy(), 1..14),
        ratio in 0.6f64..2.2,
        up: bool,
        window in 2500u64..30_000,
    ) {
        use condense::tokens::calibration::PLAN_MARGIN;
        let body = request_body(&build(&turns, false));
        let drift = if up { 1.0 + PLAN_MARGIN / 2.0 } else { 1.0 / (1.0 + PLAN_MARGIN / 2.0) };
        let steady = service();
        steady.calibration.observe("u", "gpt-4o", (ratio * 100_000.0) as u64, 100_000);
        let drifting = service();
        drifting.calibration.observe("u", "gpt-4o", (ratio * 100_000.0) as u64, 100_000);
        for _ in 0..9 {
            drifting.calibration.observe("u", "gpt-4o", (ratio * drift * 100_000.0) as u64, 100_000);
        }
        let (a, reported_a) = forwarded(&steady, &body, window);
        let (b, reported_b) = forwarded(&drifting, &body, window);
        prop_assert!((reported_b / reported_a - drift).abs() < 1e-3, "{reported_a} {reported_b}");
        prop_assert!(a == b, "a drift of {drift} moved a boundary");
    }
}

#[test]
fn on_a_tiny_budget_only_the_system_prompt_the_task_and_the_turn_in_progress_are_left() {
    let svc = service();
    let mut messages = vec![
        msg(json!({"role": "system", "content": "You are an agent."})),
        msg(json!({"role": "user", "content": "Fix the failing test in src/parser.rs."})),
    ];
    for t in 0..80 {
        let id = format!("call_{t}");
        messages.push(msg(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("cat src/file_{t}.rs")}).to_string()}}]})));
        messages.push(msg(
            json!({"role": "tool", "tool_call_id": id, "content": format!("fn f_{t}() {{}}\n").repeat(8)}),
        ));
    }
    // Each turn costs ~50 tokens even cut to the bone: 80 of them cannot
    // fit 600, whatever is cut; the three messages that matter can.
    let out = run(&svc, &messages, 600.0);
    let result = out.messages.expect("compacted");
    assert!(
        out.fits,
        "{} tokens after {:?}",
        out.tokens_after, out.stages
    );
    assert!(out.stages.iter().any(|s| s.stage == "emergency"));
    assert!(well_paired(&result));
    assert!(result[0].raw() == messages[0].raw() && result[1].raw() == messages[1].raw());
    let last = json_of(result.last().unwrap());
    assert_eq!(
        last["tool_call_id"], "call_79",
        "the turn in progress stays"
    );
    assert!(
        result.len() < 40,
        "old turns were dropped: {}",
        result.len()
    );
}

/// The turns the last resort drops, and the digest it drops after them,
/// stay recallable: the replacement (a one-line notice when the digest
/// must go too) holds one key for every dropped message, and it stands
/// right after the last user message, so that a request whose last user
/// message fills the window keeps its bytes up to it turn after turn.
#[test]
fn what_the_last_resort_drops_is_under_one_key_after_the_last_user_message() {
    let svc = service();
    let turn = |t: usize| {
        let id = format!("call_{t}");
        [
            msg(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("cat src/file_{t}.rs")}).to_string()}}]})),
            msg(
                json!({"role": "tool", "tool_call_id": id, "content": format!("FACT_{t}\n{}", "fn f() {}\n".repeat(30))}),
            ),
        ]
    };
    let mut messages = vec![
        msg(json!({"role": "system", "content": "You are an agent."})),
        msg(json!({"role": "user", "content": "Fix the failing test in src/parser.rs."})),
    ];
    (0..20).for_each(|t| messages.extend(turn(t)));
    let spec: String = (0..700).map(|i| format!("w{} ", i % 97)).collect();
    messages.push(msg(json!({"role": "user", "content": spec})));
    let last_user = messages.len() - 1;
    (20..26).for_each(|t| messages.extend(turn(t)));

    let raws = |ms: &[Message]| ms.iter().map(|m| m.raw().to_vec()).collect::<Vec<_>>();
    let mut previous: Option<Vec<Message>> = None;
    for end in [messages.len() - 2, messages.len()] {
        let input = &messages[..end];
        let out = run(&svc, input, 1_700.0);
        assert!(
            out.stages.iter().any(|s| s.stage == "emergency"),
            "{:?}",
            out.stages
        );
        let fates = out.fates.clone().unwrap();
        let result = out.messages.unwrap();
        assert!(well_paired(&result));
        // The system prompt, the task, the last user message, then the
        // replacement.
        assert!(raws(&result[..2]) == raws(&input[..2]));
        assert!(
            result[2].raw() == input[last_user].raw(),
            "the last user message moved"
        );
        let notice = String::from_utf8_lossy(result[3].raw()).into_owned();
        assert!(notice.contains("earlier messages were removed"), "{notice}");
        if let Some(prev) = &previous {
            assert!(
                raws(&prev[..3]) == raws(&result[..3]),
                "the request up to the last user message changed"
            );
        }
        // Every fact is in the request or behind one of its keys.
        let recallable = condense::recall::Recallable::of(input.to_vec(), &fates);
        let text: String = result
            .iter()
            .map(|m| String::from_utf8_lossy(m.raw()).into_owned())
            .collect();
        let recalled: String = compaction::keys::keys_in(&text)
            .filter_map(|k| recallable.text(k))
            .collect();
        for t in 0..26 {
            let fact = format!("FACT_{t}\\n");
            let held = |s: &str| s.contains(&fact) || s.contains(&fact.replace("\\n", "\n"));
            if input
                .iter()
                .any(|m| held(&String::from_utf8_lossy(m.raw())))
            {
                assert!(
                    held(&text) || held(&recalled),
                    "FACT_{t} lost for good (end {end})"
                );
            }
        }
        previous = Some(result);
    }
}

/// When nothing but the last resort fits, older turns go whole, but the
/// head stays: the environment and the task (shortened at worst), so a
/// Messages body still starts with the client's first user message.
#[test]
fn the_last_resort_keeps_the_environment_and_the_task() {
    let svc = service();
    let calls: Vec<Value> = (0..200)
        .map(|i| json!({"id": format!("c{i}"), "type": "function", "function": {"name": "run", "arguments": json!({"cmd": format!("stat src/file_{i}.rs")}).to_string()}}))
        .collect();
    let mut messages = vec![
        msg(json!({"role": "system", "content": "You are an agent."})),
        msg(
            json!({"role": "user", "content": "<environment_context><cwd>/repo</cwd></environment_context>"}),
        ),
        msg(json!({"role": "user", "content": "Stat every file, one call each."})),
        msg(json!({"role": "assistant", "content": null, "tool_calls": calls})),
    ];
    for i in 0..200 {
        messages.push(msg(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": format!("src/file_{i}.rs: {} bytes, modified today", 1000 + i)})));
    }
    messages.push(msg(
        json!({"role": "assistant", "content": "All files are there."}),
    ));
    messages.push(msg(
        json!({"role": "user", "content": "Which is the largest?"}),
    ));
    let out = run(&svc, &messages, 400.0);
    assert!(
        out.stages.iter().any(|s| s.stage == "emergency"),
        "{:?}",
        out.stages
    );
    let result = out.messages.unwrap();
    let texts: Vec<String> = result
        .iter()
        .map(|m| json_of(m)["content"].to_string())
        .collect();
    assert_eq!(json_of(&result[0])["role"], "system");
    assert!(texts[1].contains("environment_context"), "{texts:?}");
    assert!(texts[2].contains("Stat every file"), "{texts:?}");
    assert_eq!(
        result.last().map(|m| m.raw().to_vec()),
        messages.last().map(|m| m.raw().to_vec())
    );
    assert!(well_paired(&result));
}

/// A Codex-like head: instructions (an AGENTS.md), an environment block
/// and a long task, then `n` turns of `result_chars` results and a later
/// user message (so the head is no longer the client's last words).
fn heavy_head(n: usize, result_chars: usize) -> Vec<Message> {
    let rules: String = (0..300)
        .map(|l| format!("- Rule {l}: run `make check-{l}` before touching src/rule_{l}.rs\n"))
        .collect();
    let task: String = (0..600)
        .map(|l| format!("Requirement FR-{l:03}: the tauri app shows panel {l} at startup.\n"))
        .collect();
    let mut m = vec![
        msg(json!({"role": "system", "content": "You are a coding agent."})),
        msg(json!({"role": "user", "content": format!("# AGENTS.md\n{rules}")})),
        msg(
            json!({"role": "user", "content": "<environment_context><cwd>/repo</cwd></environment_context>"}),
        ),
        msg(json!({"role": "user", "content": task})),
    ];
    m.extend(agent_turns(n, result_chars).into_iter().skip(2));
    m.push(msg(
        json!({"role": "user", "content": "Now also check the docs."}),
    ));
    m
}

/// A head that fills most of the budget is cut to the fit share, the
/// larger messages first, against the budget of the conversation's first
/// compacted turn: a moved budget leaves it the same bytes.
#[test]
fn a_head_over_the_fit_share_is_cut_to_it_and_stays_cut_alike() {
    let svc = service();
    let m = heavy_head(20, 1500);
    let head = messages_tokens(&svc, &m[1..4]);
    let budget = head as f64 / 0.7;
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("fit"), "{}", out.actions());
    let result = out.messages.expect("compacted");
    // The system prompt, the environment and the last user message whole.
    for i in [0, 2, m.len() - 1] {
        assert!(result.iter().any(|x| x.raw() == m[i].raw()), "{i} changed");
    }
    // The instructions and the task cut to one level, each with its
    // recall key, to the fit share together.
    for i in [1, 3] {
        let text = content(&result[i]);
        let key = compaction::keys::key(m[i].raw());
        assert!(text.contains(&format!("recall key: {key}")), "{text}");
        assert!(text.len() < content(&m[i]).len(), "{i} kept whole");
    }
    let size = |x: &Message| svc.message_tokens(x.raw(), Encoding::O200k) as f64;
    let (a, b) = (size(&result[1]), size(&result[3]));
    assert!((a - b).abs() < 0.1 * a.max(b), "{a} and {b}");
    assert!(content(&result[1]).starts_with("# AGENTS.md"));
    let kept = messages_tokens(&svc, &result[1..4]);
    let limit = settings().fit_share * budget;
    assert!(
        kept as f64 <= limit * 1.05 && kept as f64 >= limit * 0.8,
        "{kept} of {limit}"
    );
    // The next request, its budget moved by a new calibration ratio: the
    // head is cut against the first compacted turn's budget, the same.
    let mut next = m.clone();
    next.push(msg(
        json!({"role": "assistant", "content": "Docs checked."}),
    ));
    next.push(msg(json!({"role": "user", "content": "Thanks."})));
    let moved = budget * 0.9;
    let earlier = compaction::Earlier {
        due: Some(out.frontier),
        budgets: vec![(m.len(), budget)],
    };
    let again = run_after(&svc, &next, moved, &earlier);
    let again = again.messages.expect("compacted");
    assert_eq!(
        again[..4].iter().map(|x| x.raw()).collect::<Vec<_>>(),
        result[..4].iter().map(|x| x.raw()).collect::<Vec<_>>()
    );
}

/// A head the client just sent (its last words) is not cut, however large.
#[test]
fn a_head_that_is_the_clients_last_words_stays_whole() {
    let svc = service();
    let mut m = heavy_head(0, 0);
    m.pop();
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 1.01);
    let result = out.messages.unwrap_or_else(|| m.clone());
    for (i, x) in m.iter().enumerate() {
        assert!(result.iter().any(|r| r.raw() == x.raw()), "{i} changed");
    }
}

/// A fresh result far over the window is cut alone when that is enough:
/// the instructions, the task and the turns before it go out byte-identical
/// (the provider's cached prefix), where cutting every message by the same
/// share cut the instructions too for that one turn, and rewrote the whole
/// prompt twice. The result keeps what that cut gave it.
#[test]
fn emergency_cuts_the_turn_in_progress_alone_when_that_is_enough() {
    let svc = service();
    let rules: String = (0..30)
        .map(|l| format!("- Rule {l}: run `make check-{l}` before touching src/rule_{l}.rs\n"))
        .collect();
    let mut m = vec![
        msg(json!({"role": "system", "content": "You are a coding agent."})),
        msg(json!({"role": "user", "content": format!("# AGENTS.md\n{rules}")})),
    ];
    m.extend(agent_turns(4, 600).into_iter().skip(1));
    // The client's last words come after the instructions: they are not
    // part of them, and `emergency` may cut the instructions.
    m.push(msg(
        json!({"role": "user", "content": "Now run the workers."}),
    ));
    m.push(msg(
        json!({"role": "assistant", "content": "Running them.", "tool_calls": [{"id": "call_w", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"make workers\"}"}}]}),
    ));
    let rest = messages_tokens(&svc, &m) as f64;
    let budget = rest / 0.6;
    // A result of about four budgets: cut to a tenth, it fits beside the
    // rest, which is six tenths of the budget.
    let log = |n: usize| -> Message {
        let text: String = (0..n)
            .map(|l| format!("log line {l}: worker {l} finished\n"))
            .collect();
        msg(json!({"role": "tool", "tool_call_id": "call_w", "content": text}))
    };
    let per_line = svc.message_tokens(log(1000).raw(), Encoding::O200k) as f64 / 1000.0;
    m.push(log((4.0 * budget / per_line) as usize));
    let last = m.len() - 1;
    let huge = svc.message_tokens(m[last].raw(), Encoding::O200k) as f64;
    assert!(
        huge > 3.5 * budget && huge < 4.5 * budget,
        "{huge} of {budget}"
    );
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("emergency"), "{}", out.actions());
    assert!(out.fits, "{} of {budget}", out.tokens_after);
    let out_actions = out.actions();
    let result = out.messages.expect("compacted");
    // The plan drops old turns (no drop makes room for a result this
    // large); what stays of the prompt before the turn in progress is
    // byte-identical, the instructions first.
    assert!(
        result[1].raw() == m[1].raw(),
        "the instructions were cut: {} {}",
        out_actions,
        content(&result[1])
    );
    let call = result.len() - 2;
    for (i, r) in result[..call].iter().enumerate() {
        let same = m.iter().any(|x| x.raw() == r.raw());
        assert!(
            same || content(r).contains("earlier messages were removed"),
            "message {i} changed"
        );
    }
    assert!(result[call].raw() == m[last - 1].raw(), "the call changed");
    let last = result.len() - 1;
    let kept = content(&result[last]);
    assert!(kept.contains("[condense:"), "{kept}");
    assert!(kept.len() < 20_000, "{} characters kept", kept.len());
    assert!(kept.starts_with("log line 0: worker 0 finished"), "{kept}");
}

/// When the client's last message alone takes most of the budget, a head
/// `fit` cut is cut further by `emergency`: the request fits.
#[test]
fn emergency_cuts_a_fitted_head_further() {
    let svc = service();
    let mut m = heavy_head(4, 800);
    let head = messages_tokens(&svc, &m[1..4]);
    let budget = head as f64 / 0.8;
    let spec: String = (0..1000)
        .map(|l| format!("Spec line {l}: the panel renders in under {l} ms.\n"))
        .collect();
    let last = m.len() - 1;
    m[last] = msg(json!({"role": "user", "content": spec}));
    let spec_tokens = svc.message_tokens(m[last].raw(), Encoding::O200k) as f64;
    assert!(
        spec_tokens > 0.6 * budget && spec_tokens < 0.8 * budget,
        "{spec_tokens} of {budget}"
    );
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("emergency"), "{}", out.actions());
    assert!(out.fits, "{} of {budget}", out.tokens_after);
    let result = out.messages.expect("compacted");
    assert_eq!(result.last().map(|x| x.raw()), m.last().map(|x| x.raw()));
    let key = compaction::keys::key(m[3].raw());
    assert!(content(&result[3]).contains(&format!("recall key: {key}")));
}

/// The first turn whose request, as the client sent it, is at the trigger
/// moves the frontier, even when `fit` alone would bring it back under:
/// otherwise it goes out with one old result cut (the cached prefix broken
/// there) and no boundary move, and the next turn breaks it again.
#[test]
fn the_first_turn_at_the_trigger_moves_the_frontier_though_fit_alone_would_do() {
    let svc = service();
    let mut m = agent_turns(14, 1200);
    let listing = "src/pkg/module_x.py  src/pkg/module_y.py  docs/index.rst\n".repeat(500);
    m[3] = msg(json!({"role": "tool", "tool_call_id": "call_0", "content": listing}));
    let total = tokens(&svc, &m) as f64;
    let listing_tokens = svc.message_tokens(m[3].raw(), Encoding::O200k) as f64;
    let budget = total / 0.99;
    let s = settings();
    assert!(
        listing_tokens > s.fit_share * budget
            && total - (listing_tokens - s.fit_share * budget) < s.trigger * budget,
        "fit alone would not bring it under: {listing_tokens} of {total}"
    );
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("mask"), "{}", out.actions());
    assert!(out.frontier > 3, "{}", out.frontier);
    assert!(
        (out.tokens_after as f64) < 0.75 * budget,
        "{} of {budget}",
        out.tokens_after
    );
}

#[test]
fn masking_ahead_aims_at_the_room_the_pinned_head_leaves() {
    // Instructions that take two fifths of the budget: once the agent has
    // worked a while, the request is over half the budget on every turn,
    // whatever condense masks. Against that target every result would go
    // the turn after the agent read it; against the target share of the
    // room the instructions leave, a request with room to spare keeps the
    // newest whole. (One recent turn: the result before the last is out of
    // the recent window, so only masking ahead could take it.)
    let svc = service();
    let s = Settings {
        ahead_share: 0.01,
        recent_turns: 1,
        recent_share: 0.0,
        ..settings()
    };
    let rules: String = (0..570)
        .map(|l| format!("Rule {l}: keep the public API of module_{l} stable.\n"))
        .collect();
    let mut all = agent_turns(13, 3000);
    all[0] = msg(json!({"role": "system", "content": rules}));
    let budget = 20_000.0;
    let head = tokens(&svc, &all[..2]) as f64;
    assert!(head > 0.35 * budget && head < 0.45 * budget, "{head}");
    let out = run_with(&svc, &all, budget, &s);
    assert!(out.actions().contains("mask"), "{}", out.actions());
    assert!(out.tokens_after as f64 > s.target * budget);
    let room_target = head + s.target * (budget - head);
    assert!(
        (out.tokens_after as f64) < room_target,
        "{} {room_target} {}",
        out.tokens_after,
        out.actions()
    );
    let sent = out.messages.expect("compacted");
    // The newest answered result, and the unanswered last one, are whole.
    let n = all.len();
    assert!(sent[n - 3].raw() == all[n - 3].raw(), "masked ahead");
    assert!(sent[n - 1].raw() == all[n - 1].raw());
}

#[test]
fn masking_ahead_leaves_a_request_just_over_the_target_whole() {
    // A compacted conversation whose newest answered result is large: as
    // the last (unanswered) output grows, the request goes over the room's
    // target. Masked the moment it is over, the result would leave the
    // request far under it, and whether a request is just over depends on
    // how its format counts; it goes only once the request is over by more
    // than a quarter of what masking it saves, so the request never lands
    // more than three quarters of that saving under the target.
    let svc = service();
    let s = Settings {
        recent_turns: 1,
        recent_share: 0.0,
        ..settings()
    };
    let mut all = agent_turns(12, 2000);
    let newest = agent_turns(1, 5000);
    all.extend_from_slice(&newest[2..]);
    let id = "call_last";
    all.push(msg(json!({"role": "assistant", "content": "The header parser drops the last field.", "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"pytest -x\"}"}}]})));
    let r = all.len() - 2;
    let budget = 11_000.0;
    let head = tokens(&svc, &all[..2]) as f64;
    let target = head + s.target * (budget - head);
    let (mut kept_over, mut masked) = (false, false);
    for lines in (0..120).step_by(4) {
        let log: String = (0..lines)
            .map(|l| format!("tests/test_header.py::test_field_{l} PASSED\n"))
            .collect();
        let mut m = all.clone();
        m.push(msg(
            json!({"role": "tool", "tool_call_id": id, "content": format!("{log}1 failed")}),
        ));
        let out = run_with(&svc, &m, budget, &s);
        assert!(
            out.fits && !out.actions().contains("prune"),
            "{}",
            out.actions()
        );
        let sent = out.messages.expect("compacted");
        assert_eq!(sent.len(), m.len());
        let after = out.tokens_after as f64;
        if sent[r].raw() == m[r].raw() {
            assert!(!masked, "{lines} lines: a smaller request masked it");
            kept_over |= after > target;
        } else {
            masked = true;
            let saves = (tokens(&svc, &m[r..r + 1]) - tokens(&svc, &sent[r..r + 1])) as f64;
            assert!(saves > 0.1 * budget, "{saves}");
            assert!(
                after >= target - 0.75 * saves - 0.01 * budget,
                "{lines} lines: {after} tokens, target {target}, masking saved {saves}"
            );
        }
    }
    assert!(kept_over && masked, "the sweep crosses the margin");
}

#[test]
fn a_request_over_its_budget_drops_what_the_frontier_passed_before_emergency_cuts_it() {
    // A Codex session: two turns, then a user message that takes most of
    // the budget, and the agent's calls after it. On a turn where masking
    // the recent window leaves the request just over its budget, the
    // turns the frontier has just passed go, as they would on the next
    // turn. `emergency` cut the whole request instead, for that turn, and
    // the next turn sent it whole again.
    let svc = service();
    let (all, long) = a_long_ask_between((2, 2500), 400, (30, 600));
    let head = messages_tokens(&svc, &all[..2]) + messages_tokens(&svc, &all[long..long + 1]);
    // Budgets the task and the user message take 84-85% of: with a little
    // less, the digest of everything dropped no longer fits beside them,
    // whatever the plan does.
    for share in [0.84, 0.845, 0.85] {
        let budget = head as f64 / share;
        // A service of its own: masked forms are kept as first made.
        let svc = service();
        let mut dropped = 0;
        for end in (long + 3..all.len()).step_by(2) {
            let out = run(&svc, &all[..end], budget);
            let actions = out.actions();
            assert!(
                !actions.contains("emergency"),
                "{share}, at {end} messages: {actions}"
            );
            assert!(out.fits, "{share}, at {end} messages");
            dropped += usize::from(actions.contains("prune"));
            assert!(well_paired(
                &out.messages.unwrap_or_else(|| all[..end].to_vec())
            ));
        }
        assert!(dropped > 10, "{share}: {dropped} requests dropped turns");
    }
}

/// A tool result that quotes condense's own marker (the agent read this
/// README, or a page made to look compacted) is the client's text: `fit`
/// cuts it when it is large, and `emergency` when it is the newest result
/// and alone over the budget, with its recall key in the notice condense
/// writes. Recognized by its content, it was never cut, and such a turn
/// went upstream over the window.
#[test]
fn a_result_that_quotes_the_marker_is_cut_like_any_other() {
    let svc = service();
    let huge = format!(
        "[condense: 120 chars, 3 lines elided] is what the proxy writes.\n{}",
        "0123456789 abcdefghij\n".repeat(3000)
    );
    let mut m = agent_turns(3, 300);
    m[5] = msg(json!({"role": "tool", "tool_call_id": "call_1", "content": huge.clone()}));
    let before = tokens(&svc, &m);
    let budget = before as f64 / 1.05;
    let out = run(&svc, &m, budget);
    assert!(out.actions().contains("fit"), "{}", out.actions());
    assert!(out.fits);
    let result = out.messages.unwrap();
    let cut = svc.message_tokens(result[5].raw(), Encoding::O200k) as f64;
    assert!(cut <= 0.3 * budget * 1.05, "{cut} of {budget}");
    // The quote stays as the client sent it; the recall key goes into the
    // notice condense wrote.
    let text = content(&result[5]);
    assert!(
        text.starts_with("[condense: 120 chars, 3 lines elided] is what"),
        "{}",
        &text[..120]
    );
    assert!(text.contains("\n[condense: recall key: "), "{text}");

    let mut m = agent_turns(2, 300);
    let last = m.len() - 1;
    m[last] = msg(json!({"role": "tool", "tool_call_id": "call_1", "content": huge}));
    let before = tokens(&svc, &m);
    let out = run(&svc, &m, before as f64 / 4.0);
    assert!(out.actions().contains("emergency"), "{}", out.actions());
    assert!(out.fits, "{} of {}", out.tokens_after, before / 4);
    assert!(well_paired(&out.messages.unwrap()));
}
