//! Conversation shapes in all three wire formats, through the proxy, turn
//! by turn (`replay`), against a simulated provider that counts tokens its
//! own way (characters per token, where condense counts o200k): a huge
//! task, a huge latest result, whitespace-heavy and minified results,
//! hundreds of tiny results, parallel calls, images, thinking and
//! reasoning, non-English text, JSON outputs that wrap text.
//!
//! One abstract conversation is generated and written out as a chat
//! completions, an Anthropic Messages and a stateless Responses body. Each
//! turn's request is measured the way the provider counts: when its
//! protected minimum (the system prompt, the head shortened as `emergency`
//! shortens it, the last user message, and the turn in progress with its
//! results shortened) fits the window with room to spare, the turn must
//! not fail; when the system prompt and the last user message alone are
//! over the window, it must fail as the API fails (a 4xx), never as
//! condense's own 5xx. Every body the provider received must keep the
//! API's pairing rules; every body it accepted keeps the system prompt,
//! the last user message and (unless `emergency` ran) the unconsumed
//! results byte for byte, and its thinking and reasoning as the client's
//! bytes, each with its assistant turn.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use condense::config::Config;
use condense::offline::CompactOptions;
use condense::replay::{Provider, Report, replay_received};
use condense::simulate::{CountRule, OverflowStyle, Simulator};
use proptest::prelude::*;
use serde_json::{Value, json};

// ------------------------------------------------------------ the shapes

#[derive(Debug, Clone, Copy, PartialEq)]
enum Lang {
    English,
    Cjk,
    Cyrillic,
    Emoji,
}

/// What a tool result holds (sizes in characters).
#[derive(Debug, Clone)]
enum Shape {
    /// A command's log: short lines, an error now and then.
    Log(usize),
    /// Deeply indented code with blank lines and trailing spaces.
    Whitespace(usize),
    /// One long line (minified JSON or script).
    Minified(usize),
    /// `{"output": "<log>", "metadata": {"exit_code": 1, ...}}`.
    Wrapped(usize),
    /// Text in a language.
    Prose(Lang, usize),
    /// A few characters.
    Tiny,
}

#[derive(Debug, Clone)]
struct Call {
    shape: Shape,
    /// Characters of a long argument (a file written), if any.
    long_args: Option<usize>,
    /// Messages: the result carries a screenshot beside its text.
    image: bool,
    /// Responses: a `custom_tool_call` (apply_patch) rather than a
    /// `function_call`.
    custom: bool,
}

#[derive(Debug, Clone)]
struct Turn {
    /// Characters of thinking (Messages) / reasoning summary (Responses).
    thinking: Option<usize>,
    /// The language of the sentence the model writes before its calls.
    say: Lang,
    calls: Vec<Call>,
    /// A user message after the results: its language, with an image.
    user: Option<(Lang, bool)>,
}

#[derive(Debug, Clone)]
struct Conv {
    /// The language and size of the task, and whether it has an image.
    task: (Lang, usize, bool),
    /// An environment block before the task (Codex's
    /// `<environment_context>`, Claude Code's `<system-reminder>`).
    env: bool,
    turns: Vec<Turn>,
    max_tokens: Option<u64>,
}

// ------------------------------------------------------------ texts

/// Deterministic text: the same in every format.
fn prose(lang: Lang, n: usize, seed: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.chars().count() < n {
        let line = match lang {
            Lang::English => format!(
                "The parser reads the header of src/mod_{seed}.rs and returns {i} tokens to the caller. "
            ),
            Lang::Cjk => {
                format!("解析器读取文件头并返回第{i}个标记。错误发生在第{seed}行，请检查配置。")
            }
            Lang::Cyrillic => format!(
                "Парсер читает заголовок файла mod_{seed} и возвращает {i} токенов вызывающему коду. "
            ),
            Lang::Emoji => format!("Step {i} ✅ passed 🚀, warning ⚠️ in module 🦀{seed} 🎉. "),
        };
        s.push_str(&line);
        if i % 7 == 6 {
            s.push('\n');
        }
        i += 1;
    }
    s.chars().take(n.max(1)).collect()
}

fn log(n: usize, seed: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!(
            "   Compiling crate_{seed}_{i} v0.{i}.0 (/repo/crates/c{i})\n"
        ));
        if i % 13 == 5 {
            s.push_str(&format!(
                "error[E0308]: mismatched types at src/lib_{seed}.rs:{i}:9\n"
            ));
        }
        i += 1;
    }
    s
}

fn whitespace(n: usize, seed: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        let depth = 4 * (1 + i % 6);
        s.push_str(&" ".repeat(depth));
        s.push_str(&format!("value_{seed}_{i} = compute(value_{i})        \n"));
        s.push_str("\t\t\t\t    \n\n\n");
        i += 1;
    }
    s
}

fn minified(n: usize, seed: usize) -> String {
    let mut s = String::from("[");
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!(
            "{{\"id\":\"k{seed}_{i}\",\"n\":{i},\"ok\":true,\"f\":\"function(a){{return a*{i}}}\"}},"
        ));
        i += 1;
    }
    s.push(']');
    s
}

fn output(shape: &Shape, seed: usize) -> String {
    match shape {
        Shape::Log(n) => log(*n, seed),
        Shape::Whitespace(n) => whitespace(*n, seed),
        Shape::Minified(n) => minified(*n, seed),
        Shape::Wrapped(n) => json!({"output": log(*n, seed),
            "metadata": {"exit_code": 1, "duration_seconds": 0.4}})
        .to_string(),
        Shape::Prose(lang, n) => prose(*lang, *n, seed),
        Shape::Tiny => ["ok", "", "1 file changed", "exit 0", "✓"][seed % 5].to_string(),
    }
}

/// A 1×1 PNG (the simulator counts a data URL's characters: a real
/// screenshot's would be counted as tens of thousands of tokens, which no
/// provider does).
const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";

const SYSTEM: &str = "You are a coding agent. Use the tools to inspect and change the repository; say what you do before each call.";

fn env_text() -> String {
    "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"
        .to_string()
}

fn task_text(c: &Conv) -> String {
    let (lang, n, _) = c.task;
    format!("#task# Fix the failing build. {}", prose(lang, n, 999))
}

/// The tag that makes turn `t`'s user message unique.
fn user_tag(t: usize) -> String {
    format!("#u{t}#")
}

fn user_text(t: usize, lang: Lang) -> String {
    format!("{} {}", user_tag(t), prose(lang, 120, 500 + t))
}

fn say_text(t: usize, lang: Lang) -> String {
    match lang {
        Lang::English => format!("Let me look at step {t} next."),
        Lang::Cjk => format!("接下来我看看第{t}步。"),
        Lang::Cyrillic => format!("Теперь посмотрю шаг {t}."),
        Lang::Emoji => format!("Checking step {t} 🔍"),
    }
}

fn thinking_text(t: usize, n: usize) -> String {
    format!("**Step {t}** {}", prose(Lang::English, n, 700 + t))
}

fn call_id(t: usize, k: usize) -> String {
    format!("c{t}_{k}")
}

fn command(t: usize, k: usize) -> String {
    format!("cargo test -p crate_{t} -- case_{k}")
}

/// A call's arguments as a JSON object.
fn args(t: usize, k: usize, call: &Call) -> Value {
    match call.long_args {
        Some(n) => json!({"path": format!("src/gen_{t}_{k}.rs"), "content": log(n, 300 + t)}),
        None => json!({"command": command(t, k)}),
    }
}

fn result_text(t: usize, k: usize, call: &Call) -> String {
    output(&call.shape, t * 1000 + k)
}

// ------------------------------------------------------------ formats

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fmt {
    Chat,
    Messages,
    Responses,
}

/// The client's request for turn `k`: the head and the first `k` turns
/// (the replay cuts a conversation before each assistant turn).
fn render(c: &Conv, fmt: Fmt, k: usize) -> Value {
    match fmt {
        Fmt::Chat => chat(c, k),
        Fmt::Messages => messages(c, k),
        Fmt::Responses => responses(c, k),
    }
}

fn chat(c: &Conv, k: usize) -> Value {
    let mut m = vec![json!({"role": "system", "content": SYSTEM})];
    if c.env {
        m.push(json!({"role": "user", "content": env_text()}));
    }
    let image =
        |url: &str| json!({"type": "image_url", "image_url": {"url": url, "detail": "low"}});
    let data_url = format!("data:image/png;base64,{PNG}");
    let user = |text: String, img: bool| {
        if img {
            json!({"role": "user", "content": [{"type": "text", "text": text}, image(&data_url)]})
        } else {
            json!({"role": "user", "content": text})
        }
    };
    m.push(user(task_text(c), c.task.2));
    for (t, turn) in c.turns[..k].iter().enumerate() {
        let mut a = json!({"role": "assistant", "content": say_text(t, turn.say)});
        if !turn.calls.is_empty() {
            a["tool_calls"] = turn
                .calls
                .iter()
                .enumerate()
                .map(|(j, call)| {
                    let name = if call.long_args.is_some() {
                        "write"
                    } else {
                        "shell"
                    };
                    json!({"id": call_id(t, j), "type": "function",
                        "function": {"name": name, "arguments": args(t, j, call).to_string()}})
                })
                .collect();
        }
        m.push(a);
        for (j, call) in turn.calls.iter().enumerate() {
            m.push(json!({"role": "tool", "tool_call_id": call_id(t, j), "content": result_text(t, j, call)}));
        }
        if let Some((lang, img)) = turn.user {
            m.push(user(user_text(t, lang), img));
        }
    }
    let mut body = json!({"model": "gpt-4o", "messages": m, "tools": [
        {"type": "function", "function": {"name": "shell", "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "write", "description": "Write a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
    ]});
    if let Some(n) = c.max_tokens {
        body["max_tokens"] = json!(n);
    }
    body
}

fn image_block() -> Value {
    json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
}

fn messages(c: &Conv, k: usize) -> Value {
    let mut first = Vec::new();
    if c.env {
        first.push(
            json!({"type": "text", "text": format!("<system-reminder>\n{}\n</system-reminder>", env_text())}),
        );
    }
    first.push(json!({"type": "text", "text": task_text(c)}));
    if c.task.2 {
        first.push(image_block());
    }
    let mut m = vec![json!({"role": "user", "content": first})];
    let mut thinks = false;
    for (t, turn) in c.turns[..k].iter().enumerate() {
        let mut blocks = Vec::new();
        if let Some(n) = turn.thinking {
            thinks = true;
            if n % 5 == 0 {
                blocks.push(json!({"type": "redacted_thinking", "data": format!("EmwKAhgBEgy{t}{}", "R".repeat(n))}));
            } else {
                blocks.push(json!({"type": "thinking", "thinking": thinking_text(t, n),
                    "signature": format!("EqQBCkgIARABGAIiQL{t}{}", "s".repeat(120))}));
            }
        }
        blocks.push(json!({"type": "text", "text": say_text(t, turn.say)}));
        for (j, call) in turn.calls.iter().enumerate() {
            let name = if call.long_args.is_some() {
                "Write"
            } else {
                "Bash"
            };
            blocks.push(json!({"type": "tool_use", "id": call_id(t, j), "name": name, "input": args(t, j, call)}));
        }
        m.push(json!({"role": "assistant", "content": blocks}));
        let mut user = Vec::new();
        for (j, call) in turn.calls.iter().enumerate() {
            let text = result_text(t, j, call);
            let mut r = if call.image {
                json!({"type": "tool_result", "tool_use_id": call_id(t, j),
                    "content": [{"type": "text", "text": text}, image_block()]})
            } else {
                json!({"type": "tool_result", "tool_use_id": call_id(t, j), "content": text})
            };
            if matches!(call.shape, Shape::Wrapped(_)) {
                r["is_error"] = json!(true);
            }
            user.push(r);
        }
        if let Some((lang, img)) = turn.user {
            user.push(json!({"type": "text", "text": user_text(t, lang)}));
            if img {
                user.push(image_block());
            }
        }
        m.push(json!({"role": "user", "content": user}));
    }
    let mut body = json!({"model": "claude-sonnet-4-5", "max_tokens": c.max_tokens.unwrap_or(4096),
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
            {"name": "Write", "description": "Write a file.", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}
        ],
        "messages": m});
    if thinks {
        body["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    }
    body
}

fn responses(c: &Conv, k: usize) -> Value {
    let input_text = |text: String| json!({"type": "input_text", "text": text});
    let user = |text: String, img: bool| {
        let mut parts = vec![input_text(text)];
        if img {
            parts.push(json!({"type": "input_image", "image_url": format!("data:image/png;base64,{PNG}"), "detail": "low"}));
        }
        json!({"type": "message", "role": "user", "content": parts})
    };
    let mut items = Vec::new();
    if c.env {
        items.push(user(env_text(), false));
    }
    items.push(user(task_text(c), c.task.2));
    for (t, turn) in c.turns[..k].iter().enumerate() {
        if let Some(n) = turn.thinking {
            items.push(json!({"type": "reasoning", "id": format!("rs_{t}"),
                "summary": [{"type": "summary_text", "text": thinking_text(t, n)}],
                "encrypted_content": format!("gAAAAB{t}{}", "e".repeat(n))}));
        }
        items.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": say_text(t, turn.say), "annotations": []}]}));
        for (j, call) in turn.calls.iter().enumerate() {
            if call.custom {
                items.push(json!({"type": "custom_tool_call", "call_id": call_id(t, j), "name": "apply_patch",
                    "input": format!("*** Begin Patch\n*** Update File: src/f{t}.rs\n@@\n-old_{j}\n+new_{j}\n*** End Patch")}));
            } else {
                items.push(
                    json!({"type": "function_call", "call_id": call_id(t, j), "name": "shell",
                    "arguments": args(t, j, call).to_string()}),
                );
            }
        }
        for (j, call) in turn.calls.iter().enumerate() {
            let kind = if call.custom {
                "custom_tool_call_output"
            } else {
                "function_call_output"
            };
            items.push(
                json!({"type": kind, "call_id": call_id(t, j), "output": result_text(t, j, call)}),
            );
        }
        if let Some((lang, img)) = turn.user {
            items.push(user(user_text(t, lang), img));
        }
    }
    let mut body = json!({"model": "gpt-5-codex", "instructions": SYSTEM, "store": false,
        "include": ["reasoning.encrypted_content"],
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
            {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
        ],
        "input": items});
    if let Some(n) = c.max_tokens {
        body["max_output_tokens"] = json!(n);
    }
    body
}

// ------------------------------------------------------------ the minimum

/// A text as `emergency` leaves it at its smallest share (64 characters
/// and its marker), with room to spare.
fn shortened(s: &str) -> String {
    s.chars().take(200).collect()
}

/// The index of the turn whose user message is the last one in request
/// `k`, or None when it is the task.
fn last_user_turn(c: &Conv, k: usize) -> Option<usize> {
    (0..k).rev().find(|&t| c.turns[t].user.is_some())
}

/// Request `k`'s protected minimum as a chat body, counted by `sim` with
/// the tools of `fmt`: the system prompt, the head (shortened unless the
/// task is the last user message), the last user message, and the turn in
/// progress (its call, thinking whole, its results shortened). With
/// `whole`, only the system prompt and the last user message, unshortened.
fn minimum(c: &Conv, fmt: Fmt, k: usize, whole: bool) -> Value {
    let data_url = format!("data:image/png;base64,{PNG}");
    let user = |text: String, img: bool| {
        if img {
            json!({"role": "user", "content": [{"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": data_url, "detail": "low"}}]})
        } else {
            json!({"role": "user", "content": text})
        }
    };
    let mut m = vec![json!({"role": "system", "content": SYSTEM})];
    let last = last_user_turn(c, k);
    if !whole && c.env {
        m.push(user(shortened(&env_text()), false));
    }
    match last {
        None => m.push(user(task_text(c), c.task.2)),
        Some(t) => {
            if !whole {
                m.push(user(shortened(&task_text(c)), c.task.2));
            }
            let (lang, img) = c.turns[t].user.unwrap_or((Lang::English, false));
            m.push(user(user_text(t, lang), img));
        }
    }
    if !whole && k > 0 && !c.turns[k - 1].calls.is_empty() {
        let t = k - 1;
        let turn = &c.turns[t];
        let mut a = json!({"role": "assistant", "content": say_text(t, turn.say),
            "tool_calls": turn.calls.iter().enumerate().map(|(j, call)| json!({"id": call_id(t, j), "type": "function",
                "function": {"name": "shell", "arguments": shortened(&args(t, j, call).to_string())}})).collect::<Vec<_>>()});
        if let (Some(n), false) = (turn.thinking, fmt == Fmt::Chat) {
            a["reasoning_content"] = json!(thinking_text(t, n));
        }
        m.push(a);
        for (j, call) in turn.calls.iter().enumerate() {
            m.push(json!({"role": "tool", "tool_call_id": call_id(t, j), "content": shortened(&result_text(t, j, call))}));
        }
    }
    let mut body = chat(c, 0);
    body["messages"] = json!(m);
    if fmt != Fmt::Chat {
        // Their tools as the provider's view of them has them.
        body["tools"] = render(c, fmt, 0)["tools"].clone();
    }
    body
}

/// The completion the provider adds to the prompt against its window.
fn completion(c: &Conv, fmt: Fmt) -> u64 {
    match fmt {
        Fmt::Messages => c.max_tokens.unwrap_or(4096),
        _ => c.max_tokens.unwrap_or(0),
    }
}

/// Room left for what condense adds (its recall tool, a digest or notice,
/// placeholders' framing) and for its estimate missing the provider's
/// count on a first turn.
const SPARE: f64 = 0.2;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fit {
    /// The minimum fits with room to spare: the turn must succeed.
    Fits,
    /// The system prompt and the last user message alone are well over
    /// the window: the turn must fail as the API fails.
    Over,
    /// In between: no promise either way.
    Unknown,
}

fn fit(c: &Conv, fmt: Fmt, k: usize, sim: &Simulator) -> Fit {
    let (whole, least, room) = measure(c, fmt, k, sim);
    // Well over: the minimum is counted in chat form, which differs from
    // another API's view by a few tokens a message.
    if whole as f64 > room as f64 * 1.05 + 100.0 {
        return Fit::Over;
    }
    if (least as f64) <= room as f64 * (1.0 - SPARE) - 300.0 {
        return Fit::Fits;
    }
    Fit::Unknown
}

/// Request `k`'s system prompt and last user message, its protected
/// minimum, and the room the window leaves them, as `sim` counts.
fn measure(c: &Conv, fmt: Fmt, k: usize, sim: &Simulator) -> (u64, u64, u64) {
    let count = |v: Value| sim.count(&Bytes::from(v.to_string())).unwrap_or(u64::MAX);
    (
        count(minimum(c, fmt, k, true)),
        count(minimum(c, fmt, k, false)),
        sim.window.saturating_sub(completion(c, fmt)),
    )
}

// ------------------------------------------------------------ the checks

/// The string that first appears in request `k` (`k` ≥ 1): its last user
/// message's tag, or else the id of the first call whose results it ends
/// with. Both are protected, so the request of turn `k` always holds it.
fn marker(c: &Conv, k: usize) -> String {
    let t = k - 1;
    match c.turns[t].user {
        Some(_) => user_tag(t),
        None => format!("\"{}\"", call_id(t, 0)),
    }
}

/// The turn a body the provider received was sent for: the latest whose
/// marker it holds.
fn turn_of(c: &Conv, body: &[u8]) -> usize {
    let text = String::from_utf8_lossy(body);
    (1..=c.turns.len())
        .rev()
        .find(|&k| text.contains(&marker(c, k)))
        .unwrap_or(0)
}

fn arr(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn blocks_of<'a>(m: &'a Value, kind: &str) -> Vec<&'a Value> {
    arr(&m["content"])
        .iter()
        .filter(|b| b["type"] == kind)
        .collect()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// Chat: every tool message follows (among tool messages only) the
/// assistant message whose `tool_calls` has its id, and every call is
/// answered there, once.
fn chat_pairing(body: &Value) -> Result<(), String> {
    let m = arr(&body["messages"]);
    let mut i = 0;
    while i < m.len() {
        match m[i]["role"].as_str() {
            Some("tool") => return Err(format!("tool message {i} follows no call")),
            Some("assistant") => {
                let calls: Vec<String> = arr(&m[i]["tool_calls"])
                    .iter()
                    .map(|c| c["id"].as_str().unwrap_or_default().to_string())
                    .collect();
                let mut j = i + 1;
                let mut answered = Vec::new();
                while j < m.len() && m[j]["role"] == "tool" {
                    answered.push(
                        m[j]["tool_call_id"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                    );
                    j += 1;
                }
                if sorted(calls.clone()) != sorted(answered.clone()) {
                    return Err(format!(
                        "assistant message {i} calls {calls:?}, answered by {answered:?}"
                    ));
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    Ok(())
}

fn ids(blocks: &[&Value], key: &str) -> Vec<String> {
    blocks
        .iter()
        .map(|b| b[key].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Messages: roles alternate from a user message to a user message; every
/// `tool_use` is answered by a `tool_result` in the next message, which
/// holds no other, and tool results come first in their message.
fn messages_pairing(body: &Value) -> Result<(), String> {
    let m = arr(&body["messages"]);
    if m.first().map(|x| &x["role"]) != Some(&json!("user")) {
        return Err("the first message is not the user's".into());
    }
    if m.last().map(|x| &x["role"]) != Some(&json!("user")) {
        return Err("the last message is not the user's".into());
    }
    for (i, msg) in m.iter().enumerate() {
        let want = if i % 2 == 0 { "user" } else { "assistant" };
        if msg["role"] != want {
            return Err(format!("message {i} is {}, not {want}", msg["role"]));
        }
        let results = ids(&blocks_of(msg, "tool_result"), "tool_use_id");
        let uses = if i > 0 {
            ids(&blocks_of(&m[i - 1], "tool_use"), "id")
        } else {
            Vec::new()
        };
        if want == "user" && sorted(results.clone()) != sorted(uses.clone()) {
            return Err(format!(
                "message {i} answers {results:?}, the one before calls {uses:?}"
            ));
        }
        let content = arr(&msg["content"]);
        if let Some(first_other) = content.iter().position(|b| b["type"] != "tool_result")
            && content[first_other..]
                .iter()
                .any(|b| b["type"] == "tool_result")
        {
            return Err(format!("message {i} has a tool result after other blocks"));
        }
    }
    Ok(())
}

/// Responses: every output has its call (of its kind) earlier, once, and
/// every call has its output.
fn responses_pairing(body: &Value) -> Result<(), String> {
    let mut open: Vec<(String, &str)> = Vec::new();
    for (i, item) in arr(&body["input"]).iter().enumerate() {
        let id = item["call_id"].as_str().unwrap_or_default().to_string();
        match item["type"].as_str() {
            Some("function_call") => open.push((id, "function_call_output")),
            Some("custom_tool_call") => open.push((id, "custom_tool_call_output")),
            Some(kind @ ("function_call_output" | "custom_tool_call_output")) => {
                match open.iter().position(|(o, k)| *o == id && *k == kind) {
                    Some(p) => {
                        open.remove(p);
                    }
                    None => return Err(format!("item {i} ({kind} {id}) answers no open call")),
                }
            }
            _ => {}
        }
    }
    match open.is_empty() {
        true => Ok(()),
        false => Err(format!("calls never answered: {open:?}")),
    }
}

fn pairing(fmt: Fmt, body: &Value) -> Result<(), String> {
    match fmt {
        Fmt::Chat => chat_pairing(body),
        Fmt::Messages => messages_pairing(body),
        Fmt::Responses => responses_pairing(body),
    }
}

fn is_thinking(b: &Value) -> bool {
    b["type"] == "thinking" || b["type"] == "redacted_thinking"
}

/// Messages: an assistant message that stays keeps the client's thinking
/// blocks, byte for byte and all of them; no other thinking appears.
fn messages_thinking(sent: &Value, client: &Value) -> Result<(), String> {
    let theirs: Vec<&Value> = arr(&client["messages"])
        .iter()
        .filter(|m| m["role"] == "assistant")
        .collect();
    for (i, m) in arr(&sent["messages"]).iter().enumerate() {
        if m["role"] != "assistant" {
            continue;
        }
        let thinking: Vec<&Value> = arr(&m["content"])
            .iter()
            .filter(|b| is_thinking(b))
            .collect();
        // The client's message: the one with the same first call, or the
        // same text.
        let first_use = blocks_of(m, "tool_use").first().map(|b| b["id"].clone());
        let text = blocks_of(m, "text").first().map(|b| b["text"].clone());
        let original = theirs.iter().find(|o| match &first_use {
            Some(id) => blocks_of(o, "tool_use").first().map(|b| &b["id"]) == Some(id),
            None => blocks_of(o, "text").first().map(|b| b["text"].clone()) == text,
        });
        match original {
            Some(o) => {
                let want: Vec<&Value> = arr(&o["content"])
                    .iter()
                    .filter(|b| is_thinking(b))
                    .collect();
                if thinking != want {
                    return Err(format!(
                        "assistant message {i}: thinking {thinking:?}, the client's {want:?}"
                    ));
                }
                if let Some(first) = arr(&m["content"]).first()
                    && !want.is_empty()
                    && !is_thinking(first)
                {
                    return Err(format!(
                        "assistant message {i} does not start with its thinking"
                    ));
                }
            }
            None if !thinking.is_empty() => {
                return Err(format!(
                    "assistant message {i} has thinking but is not the client's"
                ));
            }
            None => {}
        }
    }
    Ok(())
}

/// Responses: a reasoning item is the client's, and stands right before
/// its run (the assistant message and calls after it) when the run stays.
fn responses_reasoning(sent: &Value, client: &Value) -> Result<(), String> {
    let theirs = arr(&client["input"]);
    let ours = arr(&sent["input"]);
    for item in ours.iter().filter(|i| i["type"] == "reasoning") {
        if !theirs.contains(item) {
            return Err(format!("reasoning not the client's: {item}"));
        }
    }
    for (p, r) in theirs.iter().enumerate() {
        if r["type"] != "reasoning" {
            continue;
        }
        // The run's first call: after the reasoning and the assistant's
        // message, if any.
        let is_call = |i: &Value| i["type"] == "function_call" || i["type"] == "custom_tool_call";
        let assistant = |i: &Value| i["type"] == "message" && i["role"] == "assistant";
        let mut j = p + 1;
        if theirs.get(j).is_some_and(assistant) {
            j += 1;
        }
        let Some(call) = theirs.get(j).filter(|i| is_call(i)) else {
            continue;
        };
        let Some(at) = ours
            .iter()
            .position(|i| i["call_id"] == call["call_id"] && i["type"] == call["type"])
        else {
            continue;
        };
        let mut q = at;
        while q > 0 && is_call(&ours[q - 1]) {
            q -= 1;
        }
        if q > 0 && assistant(&ours[q - 1]) {
            q -= 1;
        }
        if q == 0 || &ours[q - 1] != r {
            return Err(format!(
                "the run of {} stays without its reasoning",
                call["call_id"]
            ));
        }
    }
    Ok(())
}

/// Every item of `theirs` that answers one of `unconsumed` (by `key`) is
/// in `ours` as the client sent it.
fn kept_unconsumed(
    ours: &[Value],
    theirs: &[Value],
    key: &str,
    unconsumed: &[String],
) -> Result<(), String> {
    for m in theirs
        .iter()
        .filter(|m| unconsumed.iter().any(|id| m[key] == json!(id)))
    {
        if !ours.contains(m) {
            return Err(format!("unconsumed result {} changed", m[key]));
        }
    }
    Ok(())
}

/// The system prompt and the last user message, as the client sent them;
/// unless `emergency` ran, the unconsumed results too.
fn protected(
    fmt: Fmt,
    sent: &Value,
    client: &Value,
    c: &Conv,
    k: usize,
    emergency: bool,
) -> Result<(), String> {
    let results = !emergency;
    let unconsumed: Vec<String> = match k {
        0 => Vec::new(),
        _ => (0..c.turns[k - 1].calls.len())
            .map(|j| call_id(k - 1, j))
            .collect(),
    };
    match fmt {
        Fmt::Chat => {
            let (ms, theirs) = (arr(&sent["messages"]), arr(&client["messages"]));
            if ms.first() != theirs.first() {
                return Err("the system message changed".into());
            }
            let last = theirs.iter().rev().find(|m| m["role"] == "user");
            if let Some(last) = last
                && !ms.contains(last)
            {
                return Err("the last user message changed".into());
            }
            if results {
                kept_unconsumed(ms, theirs, "tool_call_id", &unconsumed)?;
            }
        }
        Fmt::Messages => {
            if sent["system"] != client["system"] {
                return Err("the system prompt changed".into());
            }
            let all = |v: &Value| -> Vec<Value> {
                arr(&v["messages"])
                    .iter()
                    .filter(|m| m["role"] == "user")
                    .flat_map(|m| arr(&m["content"]).to_vec())
                    .collect()
            };
            let (ours, theirs) = (all(sent), all(client));
            let last = arr(&client["messages"]).iter().rev().find(|m| {
                m["role"] == "user"
                    && arr(&m["content"])
                        .iter()
                        .any(|b| b["type"] != "tool_result")
            });
            let blocks: Vec<&Value> = last
                .map(|m| arr(&m["content"]))
                .unwrap_or_default()
                .iter()
                .filter(|b| b["type"] != "tool_result")
                .collect();
            for b in &blocks {
                if !ours.contains(b) {
                    return Err(format!("the last user message's block changed: {b}"));
                }
            }
            if results {
                kept_unconsumed(&ours, &theirs, "tool_use_id", &unconsumed)?;
            }
        }
        Fmt::Responses => {
            if sent["instructions"] != client["instructions"] {
                return Err("the instructions changed".into());
            }
            let (ours, theirs) = (arr(&sent["input"]), arr(&client["input"]));
            let last = theirs
                .iter()
                .rev()
                .find(|i| i["type"] == "message" && i["role"] == "user");
            if let Some(last) = last
                && !ours.contains(last)
            {
                return Err("the last user message changed".into());
            }
            if results {
                for i in theirs.iter().filter(|i| {
                    i["type"].as_str().is_some_and(|t| t.ends_with("_output"))
                        && unconsumed.iter().any(|id| i["call_id"] == json!(id))
                }) {
                    if !ours.contains(i) {
                        return Err(format!("unconsumed result {} changed", i["call_id"]));
                    }
                }
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------ one case

struct Outcome {
    report: Report,
    received: Vec<(Bytes, bool)>,
}

fn replay(c: &Conv, fmt: Fmt, window: u64, rule: CountRule, overflow: OverflowStyle) -> Outcome {
    let body = Bytes::from(render(c, fmt, c.turns.len()).to_string());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (report, received) = runtime
        .block_on(replay_received(
            &Config::default(),
            &body,
            &CompactOptions {
                model: None,
                window: Some(window),
            },
            &Provider {
                count: rule,
                window: None,
                overflow,
                lists_window: false,
            },
        ))
        .unwrap();
    Outcome { report, received }
}

/// Everything a replay of `c` in `fmt` must hold; the first broken rule.
fn check(
    c: &Conv,
    fmt: Fmt,
    window: u64,
    rule: CountRule,
    overflow: OverflowStyle,
) -> Result<(), String> {
    let Outcome { report, received } = replay(c, fmt, window, rule, overflow);
    let sim = Simulator::new(rule, window, overflow);
    let n = c.turns.len();
    if report.turns.len() != n + 1 {
        return Err(format!(
            "{} turns replayed, {} generated",
            report.turns.len(),
            n + 1
        ));
    }
    for (k, turn) in report.turns.iter().enumerate() {
        let status = turn.status;
        let ctx = || {
            format!(
                "turn {k} ({}): status {status}, actions {}",
                fit_name(fit(c, fmt, k, &sim)),
                turn.actions
            )
        };
        if !(200..500).contains(&status) {
            return Err(format!("condense's own failure: {}", ctx()));
        }
        match fit(c, fmt, k, &sim) {
            Fit::Fits if !(200..300).contains(&status) => {
                return Err(format!("a turn whose minimum fits failed: {}", ctx()));
            }
            Fit::Over if (200..300).contains(&status) => {
                return Err(format!("a turn over the window passed: {}", ctx()));
            }
            _ => {}
        }
    }
    if std::env::var_os("SHAPES_VERBOSE").is_some() {
        let fits: Vec<String> = (0..=n)
            .map(|k| match fit(c, fmt, k, &sim) {
                Fit::Fits => "F".to_string(),
                Fit::Over => "O".to_string(),
                Fit::Unknown => {
                    let (_, least, room) = measure(c, fmt, k, &sim);
                    format!("?{least}/{room}")
                }
            })
            .collect();
        let rows: Vec<String> = report
            .turns
            .iter()
            .zip(&fits)
            .map(|(t, f)| format!("{f}{}:{}", t.status, t.actions))
            .collect();
        eprintln!(
            "{fmt:?} {rule} w{window} rejections {}: {}",
            report.provider.rejections,
            rows.join(" ")
        );
    }
    let mut last_turn = 0;
    // Per turn, whether the last body it sent was accepted.
    let mut last_sent: Vec<Option<bool>> = vec![None; n + 1];
    for (i, (raw, accepted)) in received.iter().enumerate() {
        let k = turn_of(c, raw);
        last_sent[k] = Some(*accepted);
        if k < last_turn {
            return Err(format!(
                "body {i} belongs to turn {k}, after a body of turn {last_turn}"
            ));
        }
        last_turn = k;
        let sent: Value = serde_json::from_slice(raw).map_err(|e| format!("body {i}: {e}"))?;
        let client = render(c, fmt, k);
        let at = |e: String| {
            format!(
                "body {i} (turn {k}, accepted {accepted}, actions {}): {e}",
                report.turns[k].actions
            )
        };
        pairing(fmt, &sent).map_err(at)?;
        match fmt {
            Fmt::Messages => messages_thinking(&sent, &client).map_err(at)?,
            Fmt::Responses => responses_reasoning(&sent, &client).map_err(at)?,
            Fmt::Chat => {}
        }
        if *accepted {
            let emergency = report.turns[k].actions.contains("emergency");
            protected(fmt, &sent, &client, c, k, emergency).map_err(at)?;
        }
    }
    // A failed turn is the provider's error passed on (in its API's shape,
    // as the simulator writes it), or condense's own before sending; a
    // turn that passed was accepted last.
    for (k, turn) in report.turns.iter().enumerate() {
        let passed = (200..300).contains(&turn.status);
        if passed && last_sent[k] != Some(true) || !passed && last_sent[k] == Some(true) {
            return Err(format!(
                "turn {k}: status {}, the last body it sent accepted: {:?}",
                turn.status, last_sent[k]
            ));
        }
    }
    Ok(())
}

fn fit_name(f: Fit) -> &'static str {
    match f {
        Fit::Fits => "minimum fits",
        Fit::Over => "over the window",
        Fit::Unknown => "minimum near the window",
    }
}

// ------------------------------------------------------------ generators

fn lang() -> impl Strategy<Value = Lang> {
    prop_oneof![
        4 => Just(Lang::English),
        2 => Just(Lang::Cjk),
        1 => Just(Lang::Cyrillic),
        1 => Just(Lang::Emoji),
    ]
}

/// Mostly a few kilobytes; now and then more than a small window holds.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![6 => 0usize..10_000, 1 => 20_000usize..60_000]
}

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        3 => size().prop_map(Shape::Log),
        2 => size().prop_map(Shape::Whitespace),
        2 => size().prop_map(Shape::Minified),
        2 => size().prop_map(Shape::Wrapped),
        2 => (lang(), size()).prop_map(|(l, n)| Shape::Prose(l, n)),
        1 => Just(Shape::Tiny),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    (
        shape(),
        prop::option::weighted(0.1, 2000usize..10_000),
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(shape, long_args, image, custom)| Call {
            shape,
            long_args,
            image,
            custom,
        })
}

fn tiny() -> Call {
    Call {
        shape: Shape::Tiny,
        long_args: None,
        image: false,
        custom: false,
    }
}

fn calls() -> impl Strategy<Value = Vec<Call>> {
    prop_oneof![
        6 => prop::collection::vec(call(), 1..4),
        1 => (20usize..200).prop_map(|n| vec![tiny(); n]),
        1 => Just(Vec::new()),
    ]
}

fn turn() -> impl Strategy<Value = Turn> {
    (
        prop::option::weighted(0.4, 1usize..3000),
        lang(),
        calls(),
        prop::option::weighted(0.2, (lang(), prop::bool::weighted(0.3))),
    )
        .prop_map(|(thinking, say, calls, user)| Turn {
            thinking,
            say,
            // A model turn without calls is an answer: the user speaks next.
            user: user.or(calls.is_empty().then_some((Lang::English, false))),
            calls,
        })
}

fn conv() -> impl Strategy<Value = Conv> {
    (
        (
            lang(),
            prop_oneof![6 => 20usize..2000, 1 => 20_000usize..120_000],
            prop::bool::weighted(0.25),
        ),
        any::<bool>(),
        prop::collection::vec(turn(), 1..9),
        prop::option::of(prop_oneof![Just(512u64), Just(1024), Just(4096)]),
    )
        .prop_map(|(task, env, turns, max_tokens)| Conv {
            task,
            env,
            turns,
            max_tokens,
        })
}

/// Cases per run: few, for a debug build to run them in seconds;
/// `PROPTEST_CASES` asks for more.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

const RULES: [CountRule; 2] = [CountRule::Chars(3.6), CountRule::Chars(3.0)];
const FORMATS: [Fmt; 3] = [Fmt::Chat, Fmt::Messages, Fmt::Responses];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn every_shape_in_every_format_keeps_its_turns_and_rules(
        c in conv(),
        window in 8_000u64..32_000,
        bare in any::<bool>(),
        extra in prop_oneof![
            2 => Just(None),
            1 => Just(Some(CountRule::Bytes(4.0))),
            1 => Just(Some(CountRule::Mix { tools: 4.5, prose: 3.0 })),
        ],
    ) {
        let overflow = if bare { OverflowStyle::Bare } else { OverflowStyle::OpenAi };
        for fmt in FORMATS {
            for rule in RULES.into_iter().chain(extra) {
                if let Err(e) = check(&c, fmt, window, rule, overflow) {
                    prop_assert!(false, "{fmt:?}, {rule}, window {window}, {overflow:?}: {e}");
                }
            }
        }
    }
}

/// Each check fails on the body it is there to catch (the property only
/// ever shows them bodies condense wrote).
#[test]
fn the_checks_catch_what_they_name() {
    let c = Conv {
        task: (Lang::English, 20, false),
        env: false,
        turns: vec![Turn {
            thinking: Some(12),
            say: Lang::English,
            calls: vec![tiny(), tiny()],
            user: None,
        }],
        max_tokens: None,
    };
    for fmt in FORMATS {
        let good = render(&c, fmt, 1);
        assert_eq!(pairing(fmt, &good), Ok(()), "{fmt:?}");
        assert_eq!(protected(fmt, &good, &good, &c, 1, false), Ok(()));
    }
    // Chat: a result without its call; a call without its result.
    let mut chat = render(&c, Fmt::Chat, 1);
    chat["messages"].as_array_mut().unwrap().remove(2);
    assert!(chat_pairing(&chat).is_err());
    let mut chat = render(&c, Fmt::Chat, 1);
    chat["messages"].as_array_mut().unwrap().pop();
    assert!(chat_pairing(&chat).is_err());
    // Messages: a result gone, roles that do not alternate, changed
    // thinking, a changed newest result.
    let good = render(&c, Fmt::Messages, 1);
    let mut bad = good.clone();
    bad["messages"][2]["content"].as_array_mut().unwrap().pop();
    assert!(messages_pairing(&bad).is_err());
    let mut bad = good.clone();
    bad["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "more"}));
    assert!(messages_pairing(&bad).is_err());
    let mut bad = good.clone();
    bad["messages"][1]["content"][0]["signature"] = json!("forged");
    assert!(messages_thinking(&bad, &good).is_err());
    let mut bad = good.clone();
    bad["messages"][1]["content"]
        .as_array_mut()
        .unwrap()
        .remove(0);
    assert!(messages_thinking(&bad, &good).is_err());
    let mut bad = good.clone();
    bad["messages"][2]["content"][0]["content"] = json!("[masked]");
    assert!(protected(Fmt::Messages, &bad, &good, &c, 1, false).is_err());
    // Responses: an output before its call, reasoning detached from its
    // run, changed instructions.
    let good = render(&c, Fmt::Responses, 1);
    let mut bad = good.clone();
    bad["input"].as_array_mut().unwrap().swap(3, 5);
    assert!(responses_pairing(&bad).is_err());
    let mut bad = good.clone();
    bad["input"].as_array_mut().unwrap().remove(1);
    assert!(responses_reasoning(&bad, &good).is_err());
    let mut bad = good.clone();
    bad["instructions"] = json!("You are something else.");
    assert!(protected(Fmt::Responses, &bad, &good, &c, 1, true).is_err());
    // The last user message of the task.
    let good = render(&c, Fmt::Chat, 1);
    let mut bad = good.clone();
    bad["messages"][1]["content"] = json!("#task# Fix");
    assert!(protected(Fmt::Chat, &bad, &good, &c, 1, true).is_err());
}

/// Tiny results one turn after another (an agent polling a job, or
/// listing one file at a time): eighty requests, each a little longer, on
/// a small window (hundreds at once are the property's parallel calls).
#[test]
fn hundreds_of_tiny_turns_in_every_format() {
    let turn = |t: usize| Turn {
        thinking: t.is_multiple_of(3).then_some(40),
        say: [Lang::English, Lang::Cjk, Lang::Emoji][t % 3],
        calls: vec![tiny()],
        user: (t % 50 == 49).then_some((Lang::Cyrillic, false)),
    };
    let c = Conv {
        task: (Lang::English, 400, false),
        env: true,
        turns: (0..TINY_TURNS).map(turn).collect(),
        max_tokens: Some(1024),
    };
    for fmt in FORMATS {
        for rule in RULES {
            let checked = check(&c, fmt, 8000, rule, OverflowStyle::OpenAi);
            assert_eq!(checked, Ok(()), "{fmt:?}, {rule}");
        }
    }
}

const TINY_TURNS: usize = 80;

// ------------------------------------------------------------ found bugs

/// The task's text blocks, as every accepted body of a replay of `body`
/// has them, against the client's.
fn task_blocks_sent(body: &Value, window: u64) -> (Report, Vec<Value>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (report, received) = runtime
        .block_on(replay_received(
            &Config::default(),
            &Bytes::from(body.to_string()),
            &CompactOptions {
                model: None,
                window: Some(window),
            },
            &Provider {
                count: CountRule::Chars(3.0),
                window: None,
                overflow: OverflowStyle::OpenAi,
                lists_window: false,
            },
        ))
        .unwrap();
    let firsts = received
        .iter()
        .filter(|(_, ok)| *ok)
        .map(|(raw, _)| serde_json::from_slice::<Value>(raw).unwrap()["messages"][0].clone())
        .collect();
    (report, firsts)
}

/// A Messages task of a text and an image (a pasted screenshot), then one
/// call whose result alone is over a 8k window: `emergency` must shorten
/// that result, and never the task, which is the last user message. The
/// Messages view shows the message as one user message per block and
/// `Analysis::last_user` protects only the last (the image), so
/// `emergency::shorten` cuts the task's text to 64 bytes: the agent keeps
/// its screenshot and loses what it was asked. The same happens to any
/// last user message of several text blocks (Claude Code's
/// `<system-reminder>` beside the prompt) whose last block is not the
/// prompt.
#[test]
fn a_messages_last_user_message_of_several_blocks_stays_whole_under_emergency() {
    let task = json!({"role": "user", "content": [
        {"type": "text", "text": format!("Fix the failing build: the parser rejects every header since the last change to src/header.rs. Run the tests, find why, fix it. {}",
            prose(Lang::English, 600, 1))},
        image_block(),
    ]});
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": SYSTEM,
    "messages": [
        task,
        {"role": "assistant", "content": [{"type": "text", "text": "Running the tests."},
            {"type": "tool_use", "id": "c0", "name": "Bash", "input": {"command": "cargo test"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c0", "content": log(40_000, 1)}]},
    ]});
    let (report, firsts) = task_blocks_sent(&body, 8000);
    let last = report.turns.last().unwrap();
    assert_eq!(last.status, 200, "{}", last.actions);
    assert!(last.actions.contains("emergency"), "{}", last.actions);
    assert!(!firsts.is_empty());
    for first in firsts {
        assert_eq!(first, task, "the task as the provider got it");
    }
}

/// The same split, with no `emergency`: the user's latest words (a text
/// and a screenshot after two results) are the last user message of every
/// later turn. On turn 4 the provider rejects the request (whitespace it
/// counts in full) and condense's recovery prunes old turns: the image,
/// the view's last user message, stays (merged into the task's message),
/// the text beside it goes with the pruned span. The agent carries on
/// without what the user last said.
#[test]
fn a_messages_last_user_text_beside_an_image_survives_prune() {
    let plain = |shape| Call {
        shape,
        long_args: None,
        image: false,
        custom: false,
    };
    let c = Conv {
        task: (Lang::English, 20, false),
        env: false,
        turns: vec![
            Turn {
                thinking: None,
                say: Lang::English,
                calls: vec![
                    plain(Shape::Log(49)),
                    Call {
                        long_args: Some(2000),
                        ..plain(Shape::Wrapped(49))
                    },
                ],
                user: None,
            },
            Turn {
                thinking: None,
                say: Lang::English,
                calls: vec![plain(Shape::Log(256)), plain(Shape::Wrapped(205))],
                user: Some((Lang::English, true)),
            },
            Turn {
                thinking: None,
                say: Lang::Cyrillic,
                calls: vec![tiny(); 149],
                user: None,
            },
            Turn {
                thinking: None,
                say: Lang::Cyrillic,
                calls: vec![
                    Call {
                        long_args: Some(4959),
                        ..plain(Shape::Wrapped(835))
                    },
                    plain(Shape::Whitespace(7689)),
                    plain(Shape::Log(2420)),
                ],
                user: None,
            },
        ],
        max_tokens: Some(1024),
    };
    let checked = check(
        &c,
        Fmt::Messages,
        12_149,
        CountRule::Chars(3.0),
        OverflowStyle::OpenAi,
    );
    assert_eq!(checked, Ok(()));
}

/// A call, for the cases the property found, written out.
fn call_of(shape: Shape, long_args: Option<usize>, image: bool, custom: bool) -> Call {
    Call {
        shape,
        long_args,
        image,
        custom,
    }
}

/// A turn, for the cases the property found, written out.
fn turn_of_parts(
    thinking: Option<usize>,
    say: Lang,
    calls: Vec<Call>,
    user: Option<(Lang, bool)>,
) -> Turn {
    Turn {
        thinking,
        say,
        calls,
        user,
    }
}

/// An overflow's retry cut to its minimum goes out when its plain count
/// fits: here a turn of 88 parallel calls, whose framing the error's
/// bytes-per-token reading overcounts (found by the property in CI).
#[test]
fn a_retry_of_many_parallel_calls_goes_out_when_its_count_fits() {
    let call = |shape, image, custom| call_of(shape, None, image, custom);
    let turn = turn_of_parts;
    let c = Conv {
        task: (Lang::English, 1204, true),
        env: false,
        turns: vec![
            turn(
                Some(103),
                Lang::English,
                vec![],
                Some((Lang::English, false)),
            ),
            turn(
                None,
                Lang::Emoji,
                vec![call(Shape::Log(2585), false, false)],
                None,
            ),
            turn(
                None,
                Lang::English,
                vec![
                    call(Shape::Minified(54_459), true, true),
                    call(Shape::Log(6198), false, false),
                    call(Shape::Wrapped(1577), true, true),
                ],
                None,
            ),
            turn(
                Some(2437),
                Lang::Cjk,
                vec![
                    call(Shape::Minified(5951), false, true),
                    call(Shape::Whitespace(22_616), false, true),
                    call(Shape::Minified(8876), false, false),
                ],
                None,
            ),
            turn(
                Some(1001),
                Lang::English,
                vec![call(Shape::Minified(6828), false, false)],
                Some((Lang::English, false)),
            ),
            turn(None, Lang::Cjk, (0..88).map(|_| tiny()).collect(), None),
        ],
        max_tokens: Some(4096),
    };
    let got = check(
        &c,
        Fmt::Messages,
        8067,
        CountRule::Chars(3.0),
        OverflowStyle::Bare,
    );
    assert!(got.is_ok(), "{got:?}");
}

/// An overflow that names no numbers, on a turn whose fresh result is
/// 44 KB of indented code: a provider counting characters counts it at
/// about three times o200k, so the retry must see where the difference
/// is, not only cut to 70% (found by the property).
#[test]
fn a_blind_retry_cuts_the_whitespace_result_that_tipped_it_over() {
    let call = |shape, long_args, custom| call_of(shape, long_args, false, custom);
    let turn = |thinking, calls| turn_of_parts(thinking, Lang::English, calls, None);
    let c = Conv {
        task: (Lang::English, 20, false),
        env: true,
        turns: vec![
            turn(None, vec![call(Shape::Wrapped(23_283), None, false)]),
            turn(
                None,
                vec![
                    call(Shape::Prose(Lang::English, 4388), None, true),
                    call(Shape::Prose(Lang::English, 6973), None, false),
                ],
            ),
            turn(
                None,
                vec![
                    call(Shape::Wrapped(7803), None, false),
                    call(Shape::Prose(Lang::Emoji, 4972), Some(2093), false),
                    call(Shape::Log(1430), None, false),
                ],
            ),
            turn(None, vec![call(Shape::Tiny, Some(5982), false)]),
            turn(
                Some(1587),
                vec![
                    call(Shape::Whitespace(9977), None, true),
                    call(Shape::Whitespace(43_854), None, false),
                ],
            ),
        ],
        max_tokens: Some(1024),
    };
    let got = check(
        &c,
        Fmt::Chat,
        16_499,
        CountRule::Chars(3.6),
        OverflowStyle::Bare,
    );
    assert!(got.is_ok(), "{got:?}");
}

/// An overflow whose error names the provider's count, on a turn ending in
/// 44 KB of indented code: the retry's count is corrected by one reading
/// of the whole rejected body, and what the cut leaves counts denser than
/// what it took, so the retry keeps a larger reserve (found by the
/// property).
#[test]
fn a_retry_keeps_room_for_what_its_correction_misses() {
    let call = call_of;
    let turn = turn_of_parts;
    let c = Conv {
        task: (Lang::English, 1281, false),
        env: true,
        turns: vec![
            turn(
                None,
                Lang::English,
                vec![call(Shape::Wrapped(25_357), None, false, false)],
                None,
            ),
            turn(
                None,
                Lang::English,
                vec![
                    call(Shape::Prose(Lang::Cjk, 9237), None, false, true),
                    call(Shape::Prose(Lang::English, 6977), None, false, false),
                ],
                None,
            ),
            turn(
                None,
                Lang::English,
                vec![
                    call(Shape::Wrapped(7847), None, false, false),
                    call(Shape::Prose(Lang::Emoji, 4972), Some(2132), true, false),
                    call(Shape::Whitespace(2407), None, false, false),
                ],
                None,
            ),
            turn(None, Lang::English, (0..43).map(|_| tiny()).collect(), None),
            turn(
                None,
                Lang::Emoji,
                vec![call(Shape::Tiny, Some(6287), false, false)],
                Some((Lang::English, false)),
            ),
            turn(
                Some(1768),
                Lang::Cjk,
                vec![
                    call(Shape::Whitespace(9993), None, false, true),
                    call(Shape::Whitespace(43_900), None, false, false),
                ],
                None,
            ),
        ],
        max_tokens: Some(1024),
    };
    let got = check(
        &c,
        Fmt::Messages,
        17_785,
        CountRule::Chars(3.6),
        OverflowStyle::Bare,
    );
    assert!(got.is_ok(), "{got:?}");
}
