use super::*;

/// The run view as it was built before: one value, serialized.
fn run_view_as_a_value(r: &ResponsesRequest, members: &[usize]) -> Bytes {
    let items: Vec<&Item> = members.iter().map(|&k| &r.items[k]).collect();
    let text = items
        .iter()
        .filter(|i| i.is_assistant_message())
        .map(|i| message_text(i))
        .collect::<Vec<_>>()
        .join("\n");
    let calls: Vec<Value> = items
        .iter()
        .filter(|i| i.is_call())
        .map(|i| {
            let args = i.str("arguments").or(i.str("input")).unwrap_or_default();
            json!({"id": i.str("call_id").unwrap_or_default(), "type": "function",
                "function": {"name": i.str("name").unwrap_or_default(), "arguments": args}})
        })
        .collect();
    let reasoning: String = items
        .iter()
        .filter(|i| i.is_opaque())
        .map(|i| opaque_text(i))
        .collect::<Vec<_>>()
        .join("\n");
    let mut v = json!({"role": "assistant",
        "content": if text.is_empty() { Value::Null } else { json!(text) }});
    if !calls.is_empty() {
        v["tool_calls"] = json!(calls);
    }
    if !reasoning.is_empty() {
        v["reasoning"] = json!(reasoning);
    }
    Bytes::from(v.to_string())
}

#[test]
fn the_run_view_is_written_as_the_value_was() {
    let odd = json!({"model": "m", "store": false, "input": [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "think \"hard\""}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "é"}]},
        {"type": "function_call", "call_id": "a", "name": "n", "arguments": "{\"z\":1}"},
        {"type": "custom_tool_call", "call_id": "b", "name": "c", "input": "raw"},
        {"type": "function_call", "call_id": "c"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "custom_tool_call_output", "call_id": "b", "output": "2"},
        {"type": "function_call_output", "call_id": "c", "output": "3"},
        {"type": "item_reference", "id": "x"},
        {"type": "message", "role": "assistant", "content": "plain"}]});
    for body in [session(3), odd] {
        let r = ResponsesRequest::parse(&Bytes::from(body.to_string())).unwrap();
        let (_, origins) = r.view();
        let runs: Vec<&Vec<usize>> = origins
            .0
            .iter()
            .filter_map(|o| match o {
                Origin::Run(m) => Some(m),
                _ => None,
            })
            .collect();
        assert!(runs.len() >= 2, "{body}");
        for m in runs {
            assert_eq!(r.run_view(m), run_view_as_a_value(&r, m), "{m:?}");
        }
    }
}

/// A coding session as Responses input: a task, then `turns` rounds of
/// reasoning, text, a call and a long output.
fn session(turns: usize) -> Value {
    let mut input = vec![json!({"role": "user", "content": "Fix the failing test in parser.py"})];
    for t in 0..turns {
        input.push(
            json!({"type": "reasoning", "id": format!("rs_{t}"), "summary": [],
            "encrypted_content": format!("gAAAA{t}")}),
        );
        input.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": format!("Reading file {t}."), "annotations": []}]}));
        input.push(
            json!({"type": "function_call", "call_id": format!("call_{t}"), "name": "read",
            "arguments": json!({"path": format!("src/f{t}.py")}).to_string()}),
        );
        input.push(
            json!({"type": "function_call_output", "call_id": format!("call_{t}"),
            "output": format!("def f_{t}():\n{}", "    x = compute(value) + 1\n".repeat(120))}),
        );
    }
    json!({"model": "gpt-4o", "instructions": "You are a coding agent.", "store": false,
        "include": ["reasoning.encrypted_content"], "tools": [{"type": "function", "name": "read"}],
        "input": input, "x_unknown": 1})
}

fn compacted(body: &Value, window: u64) -> Value {
    let bytes = Bytes::from(body.to_string());
    let req = ResponsesRequest::parse(&bytes).unwrap();
    assert!(req.well_formed());
    let (view, origins) = req.view();
    let fates = crate::wire::testing::decide(view, &bytes, "gpt-4o", window);
    serde_json::from_slice(&req.write_back(&origins, &fates).unwrap()).unwrap()
}

fn assert_valid(out: &Value, body: &Value) {
    let items = out["input"].as_array().unwrap();
    let mut calls = Vec::new();
    for it in items {
        match it["type"].as_str() {
            Some("function_call") => calls.push(it["call_id"].clone()),
            Some("function_call_output") => assert!(calls.contains(&it["call_id"])),
            Some("reasoning") => {
                assert!(body["input"].as_array().unwrap().contains(it), "{it}")
            }
            _ => {}
        }
    }
    for key in [
        "instructions",
        "tools",
        "store",
        "include",
        "x_unknown",
        "model",
    ] {
        assert_eq!(out[key], body[key], "{key}");
    }
}

#[test]
fn the_view_is_the_conversation_as_chat() {
    let (view, _) = ResponsesRequest::parse(&Bytes::from(session(2).to_string()))
        .unwrap()
        .view();
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
    assert_eq!(a.tool_calls().next().unwrap()["id"], "call_0");
    assert_eq!(a.content().unwrap(), "Reading file 0.");
}

#[test]
fn masked_outputs_keep_pairing_and_reasoning() {
    let body = session(12);
    let out = compacted(&body, 16_000);
    assert_valid(&out, &body);
    let size = |v: &Value| v["input"].to_string().len();
    assert!(size(&out) < size(&body) / 2);
    // The newest output is the client's.
    assert_eq!(
        out["input"].as_array().unwrap().last(),
        body["input"].as_array().unwrap().last()
    );
}

#[test]
fn dropped_turns_go_with_their_reasoning_and_leave_a_digest() {
    let body = session(40);
    let out = compacted(&body, 4_000);
    assert_valid(&out, &body);
    let items = out["input"].as_array().unwrap();
    assert!(items.len() < body["input"].as_array().unwrap().len());
    assert_eq!(items[0], body["input"][0]);
    // The oldest turns keep their place (masked); the digest stands for
    // the newest the frontier has passed, just before the recent turns.
    assert_eq!(items[1]["type"], "reasoning");
    let at = items
        .iter()
        .position(|i| i.to_string().contains("earlier messages were removed"))
        .unwrap();
    assert!(at > 1);
    assert_eq!(items[at]["role"], "user");
    assert_eq!(items[at + 1]["type"], "reasoning");
    assert!(items[at + 1..].iter().all(|i| i["role"] != "user"));
}

#[test]
fn a_digest_stands_past_a_long_prompt_between_dropped_turns() {
    // The user's long prompt after turn 20: turns before and after it are
    // dropped, it stays, and the digest follows it, so that a later drop
    // leaves it cached.
    let mut body = session(40);
    let prompt = crate::wire::testing::long_prompt();
    let item = json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": prompt}]});
    body["input"]
        .as_array_mut()
        .unwrap()
        .insert(1 + 21 * 4, item.clone());
    let out = compacted(&body, 8_000);
    assert_valid(&out, &body);
    let items = out["input"].as_array().unwrap();
    let gone = |id: &str| !out.to_string().contains(id);
    assert!(gone("\"call_19\"") && gone("\"call_21\""));
    let at = items.iter().position(|i| *i == item).unwrap();
    let digest = items
        .iter()
        .position(|i| i.to_string().contains("earlier messages were removed"))
        .unwrap();
    assert!(digest > at, "the digest at {digest}, the prompt at {at}");
}

#[test]
fn what_is_not_a_stateless_item_list_is_told() {
    let s = |v: Value| ResponsesRequest::parse(&Bytes::from(v.to_string()));
    assert!(s(json!({"model": "m", "input": "hello"})).is_err());
    assert!(s(json!({"model": "m", "input": [1]})).is_err());
    let r = s(json!({"model": "m", "previous_response_id": "resp_1", "input": []})).unwrap();
    assert_eq!(r.stateful(), Some("previous_response_id"));
    let r = s(json!({"model": "m", "previous_response_id": null, "input": []})).unwrap();
    assert_eq!(r.stateful(), None);
    let orphan =
        s(json!({"input": [{"type": "function_call_output", "call_id": "x", "output": "a"}]}))
            .unwrap();
    assert!(!orphan.well_formed());
}

#[test]
fn rewritten_items_keep_the_clients_key_order() {
    use crate::wire::testing::{type_first, types_first};
    let body = Bytes::from(type_first(&session(12)));
    assert!(types_first(&body));
    let req = ResponsesRequest::parse(&body).unwrap();
    let (view, origins) = req.view();
    let fates = crate::wire::testing::decide(view, &body, "gpt-4o", 6000);
    assert!(fates.rewritten.iter().any(Option::is_some));
    let out = req.write_back(&origins, &fates).unwrap();
    assert!(types_first(&out), "{}", String::from_utf8_lossy(&out));
}
