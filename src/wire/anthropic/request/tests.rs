use super::*;

/// The assistant view as it was built before: one value, serialized.
fn assistant_view_as_a_value(content: &Content) -> Bytes {
    let blocks = match content {
        Content::Text(s) => {
            return Bytes::from(json!({"role": "assistant", "content": decoded(s)}).to_string());
        }
        Content::Blocks(b) => b,
    };
    let text = joined_text(blocks);
    let calls: Vec<Value> = blocks
        .iter()
        .filter(|b| b.kind() == "tool_use")
        .map(|b| {
            json!({"id": b.str("id").unwrap_or_default(), "type": "function", "function": {
                "name": b.str("name").unwrap_or_default(),
                "arguments": b.value().get("input").map(Value::to_string).unwrap_or_default(),
            }})
        })
        .collect();
    let thinking: String = blocks
        .iter()
        .filter_map(|b| b.str("thinking"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut v = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }});
    if !calls.is_empty() {
        v["tool_calls"] = json!(calls);
    }
    if !thinking.is_empty() {
        v["thinking"] = json!(thinking);
    }
    Bytes::from(v.to_string())
}

#[test]
fn the_assistant_view_is_written_as_the_value_was() {
    let odd = json!({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "plain \"text\" é"},
        {"role": "user", "content": "on"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "n", "input": {"z": 1, "a": [true, null]}},
            {"type": "tool_use", "id": "b", "input": "not an object"},
            {"type": "tool_use", "name": "x"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "1"},
            {"type": "tool_result", "tool_use_id": "b", "content": "2"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "thinking", "thinking": "ok"},
            {"type": "text", "text": "done"}]},
        {"role": "assistant", "content": []}]});
    for body in [session(3), odd] {
        let req = MessagesRequest::parse(&Bytes::from(body.to_string())).unwrap();
        for turn in req.turns.iter().filter(|t| t.side == Side::Assistant) {
            assert_eq!(
                assistant_view(&turn.content),
                assistant_view_as_a_value(&turn.content),
                "{:?}",
                turn.raw
            );
        }
    }
}

/// An agent session in Messages form: a task, then `turns` rounds of a
/// thinking block, text and a tool call answered by a long result (with
/// a cache breakpoint on the newest one).
fn session(turns: usize) -> Value {
    let mut messages =
        vec![json!({"role": "user", "content": "Fix the failing test in parser.py"})];
    for t in 0..turns {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": format!("I should look at file {t}."), "signature": format!("sig{t}")},
            {"type": "text", "text": format!("Reading file {t}.")},
            {"type": "tool_use", "id": format!("toolu_{t}"), "name": "read", "input": {"path": format!("src/f{t}.py")}}
        ]}));
        let mut result = json!({"type": "tool_result", "tool_use_id": format!("toolu_{t}"),
            "content": format!("def f_{t}():\n{}", "    x = compute(value) + 1\n".repeat(120))});
        if t + 1 == turns {
            result["cache_control"] = json!({"type": "ephemeral"});
        }
        messages.push(json!({"role": "user", "content": [result]}));
    }
    json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": "You are a coding agent.",
           "tools": [{"name": "read", "input_schema": {"type": "object"}}],
           "messages": messages, "x_unknown": {"kept": true}})
}

fn compacted(body: &Value, window: u64) -> (Bytes, Value) {
    let bytes = Bytes::from(body.to_string());
    let req = MessagesRequest::parse(&bytes).unwrap();
    assert!(req.well_formed());
    let (view, origins) = req.view();
    let fates = crate::wire::testing::decide(view, &bytes, "claude-sonnet-4-5", window);
    let out = req.write_back(&origins, &fates).unwrap();
    let v = serde_json::from_slice(&out).unwrap();
    (out, v)
}

fn blocks_of<'a>(v: &'a Value, kind: &'a str) -> impl Iterator<Item = &'a Value> {
    v["messages"].as_array().unwrap().iter().flat_map(move |m| {
        m["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(move |b| b["type"] == kind)
    })
}

#[test]
fn the_view_is_the_conversation_as_chat() {
    let bytes = Bytes::from(session(2).to_string());
    let (view, _) = MessagesRequest::parse(&bytes).unwrap().view();
    let roles: Vec<_> = view
        .messages()
        .iter()
        .map(|m| m.role().unwrap().to_string())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "assistant", "tool"]
    );
    let a = &view.messages()[2];
    assert_eq!(
        a.tool_calls().next().unwrap()["function"]["arguments"],
        r#"{"path":"src/f0.py"}"#
    );
    assert_eq!(view.messages()[3].tool_call_id(), Some("toolu_0"));
    assert!(view.field("tools").is_some());
}

#[test]
fn masked_results_keep_their_pairing_thinking_and_breakpoints() {
    let body = session(12);
    let (_, out) = compacted(&body, 16_000);
    // Untouched: everything outside `messages`.
    for key in ["system", "tools", "x_unknown", "max_tokens", "model"] {
        assert_eq!(out[key], body[key], "{key}");
    }
    // Every thinking block is one of the client's, byte for byte.
    let thinking: Vec<_> = blocks_of(&body, "thinking").collect();
    assert!(blocks_of(&out, "thinking").all(|b| thinking.contains(&b)));
    // Some results were masked, and the breakpoint on the last is kept.
    let before: usize = blocks_of(&body, "tool_result")
        .map(|b| b.to_string().len())
        .sum();
    let after: usize = blocks_of(&out, "tool_result")
        .map(|b| b.to_string().len())
        .sum();
    assert!(after < before / 2, "{after} vs {before}");
    let last = blocks_of(&out, "tool_result").last().unwrap();
    assert_eq!(last["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(last, blocks_of(&body, "tool_result").last().unwrap());
    assert_valid(&out);
}

#[test]
fn dropped_turns_leave_alternating_roles_and_a_digest() {
    let body = session(40);
    let (_, out) = compacted(&body, 4_000);
    let messages = out["messages"].as_array().unwrap();
    assert!(messages.len() < body["messages"].as_array().unwrap().len());
    // The task keeps its bytes, and so does the oldest turn: the turns
    // dropped are the newest the frontier has passed, so that the cached
    // prefix holds up to them.
    assert_eq!(messages[0], body["messages"][0]);
    assert_eq!(messages[1], body["messages"][1]);
    // Turns 8 to 35 went; the digest follows the tool results of the last
    // turn kept before them, where a chat request has it, and the results
    // of the first turn kept after them stand alone: masked on a later
    // turn, they do not send the digest again.
    let gone = |id: &str| !out.to_string().contains(id);
    assert!(gone("\"toolu_8\"") && gone("\"toolu_35\"") && !gone("\"toolu_7\""));
    let at = messages
        .iter()
        .position(|m| m.to_string().contains("earlier messages were removed"))
        .unwrap();
    assert_eq!(messages[at - 1]["content"][2]["id"], "toolu_7");
    let with = messages[at]["content"].as_array().unwrap();
    assert_eq!(with[0]["tool_use_id"], "toolu_7");
    assert_eq!(with.last().unwrap()["type"], "text");
    assert_eq!(messages[at + 1]["content"][2]["id"], "toolu_36");
    let results = messages[at + 2]["content"].as_array().unwrap();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["tool_use_id"], "toolu_36");
    assert_valid(&out);
    // The newest turn is the client's.
    assert_eq!(messages.last(), body["messages"].as_array().unwrap().last());
}

#[test]
fn a_digest_stands_past_a_long_prompt_between_dropped_turns() {
    // The user's long prompt after turn 20's results (Claude Code sends
    // it in the same message): turns before and after it are dropped, it
    // stays, and the digest goes past it, into a later user message, so
    // that a later drop leaves it cached.
    let mut body = session(40);
    let prompt = crate::wire::testing::long_prompt();
    body["messages"][42]["content"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "text", "text": prompt}));
    let (_, out) = compacted(&body, 6_000);
    assert_valid(&out);
    let messages = out["messages"].as_array().unwrap();
    let gone = |id: &str| !out.to_string().contains(id);
    assert!(gone("\"toolu_19\"") && gone("\"toolu_21\""));
    let holding = |needle: &str| {
        messages
            .iter()
            .position(|m| m.to_string().contains(needle))
            .unwrap()
    };
    let (at, digest) = (
        holding("Requirement 149"),
        holding("earlier messages were removed"),
    );
    assert!(digest > at, "the digest at {digest}, the prompt at {at}");
    let kept = messages[at]["content"].as_array().unwrap();
    assert_eq!(kept.last().unwrap()["text"], prompt);
}

#[test]
fn a_digest_goes_into_the_newest_user_message_when_that_is_the_first_kept() {
    // The turns between the task and the turn in progress are dropped.
    // Joined to the task's message, the digest changed the first message
    // of the request, and on the next turn (the newest message no longer
    // newest) it moved: the whole prompt was rewritten twice. In the
    // message after the drop, behind its tool results, it stays there.
    let body = session(3);
    let bytes = Bytes::from(body.to_string());
    let req = MessagesRequest::parse(&bytes).unwrap();
    let (view, origins) = req.view();
    let n = view.messages().len();
    let digest = json!({"role": "user", "content": "[condense: 4 earlier messages were removed]"});
    let dropped: Vec<bool> = (origins.0.iter())
        .map(|o| o.message().is_some_and(|t| (1..5).contains(&t)))
        .collect();
    let fates = Fates {
        rewritten: vec![None; n],
        replaced: dropped.clone(),
        dropped,
        replacement: Some(Bytes::from(digest.to_string())),
        replacement_at: None,
    };
    let out: Value = serde_json::from_slice(&req.write_back(&origins, &fates).unwrap()).unwrap();
    let messages = out["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(messages[0], body["messages"][0]);
    assert_eq!(messages[1], body["messages"][5]);
    let last = messages[2]["content"].as_array().unwrap();
    assert_eq!(last[0], body["messages"][6]["content"][0]);
    assert!(
        last[1]["text"]
            .as_str()
            .unwrap()
            .contains("earlier messages were removed")
    );
    assert_valid(&out);
}

#[test]
fn a_system_message_inside_messages_stays_where_it_was() {
    // Claude Code sends its environment as a system message after the
    // task.
    let mut body = session(40);
    let env = json!({"role": "system", "content": "<env>cwd: /repo</env>"});
    body["messages"]
        .as_array_mut()
        .unwrap()
        .insert(1, env.clone());
    let (_, out) = compacted(&body, 4_000);
    let messages = out["messages"].as_array().unwrap();
    assert_eq!(messages[1], env);
    assert!(messages.len() < body["messages"].as_array().unwrap().len());
    assert_valid(&out);
}

/// The Messages API's rules, checked on the JSON.
fn assert_valid(v: &Value) {
    let messages: Vec<&Value> = v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .collect();
    assert_eq!(messages[0]["role"], "user");
    for w in messages.windows(2) {
        assert_ne!(w[0]["role"], w[1]["role"]);
        let uses: Vec<_> = w[0]["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| b["id"].clone())
            .collect();
        let results: Vec<_> = w[1]["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| b["type"] == "tool_result")
            .map(|b| b["tool_use_id"].clone())
            .collect();
        assert_eq!(uses, results);
        for b in w[0]["content"].as_array().into_iter().flatten() {
            if b["type"] == "tool_use" {
                assert!(b["input"].is_object());
            }
        }
    }
    let points = messages
        .iter()
        .flat_map(|m| m["content"].as_array().into_iter().flatten())
        .filter(|b| b.get("cache_control").is_some())
        .count();
    assert!(points <= 4);
}

#[test]
fn bodies_condense_does_not_understand_are_refused() {
    for bad in [
        r#"{"model":"m"}"#,
        r#"{"messages":[{"role":"tool","content":"x"}]}"#,
        r#"{"messages":[{"role":"user","content":7}]}"#,
        r#"{"messages":[{"role":"user","content":[{"no_type":1}]}]}"#,
        "not json",
    ] {
        assert!(MessagesRequest::parse(&Bytes::from(bad)).is_err(), "{bad}");
    }
    // Parsed, but breaking the rules: forwarded as it came, not compacted.
    let orphan = r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"x","content":"a"}]}]}"#;
    assert!(
        !MessagesRequest::parse(&Bytes::from(orphan))
            .unwrap()
            .well_formed()
    );
    let two_users = r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#;
    assert!(
        !MessagesRequest::parse(&Bytes::from(two_users))
            .unwrap()
            .well_formed()
    );
}

#[test]
fn rewritten_blocks_keep_the_clients_key_order() {
    use crate::wire::testing::{type_first, types_first};
    let body = Bytes::from(type_first(&session(12)));
    assert!(types_first(&body));
    let req = MessagesRequest::parse(&body).unwrap();
    let (view, origins) = req.view();
    let fates = crate::wire::testing::decide(view, &body, "claude-sonnet-4-5", 6000);
    assert!(fates.rewritten.iter().any(Option::is_some));
    let out = req.write_back(&origins, &fates).unwrap();
    assert!(types_first(&out), "{}", String::from_utf8_lossy(&out));
}
