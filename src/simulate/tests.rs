use super::*;

fn body(v: Value) -> Bytes {
    Bytes::from(v.to_string())
}

#[test]
fn rules_count_text_their_own_way() {
    let b = body(json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "x".repeat(360)},
        {"role": "tool", "tool_call_id": "a", "content": " ".repeat(36)}]}));
    // Per message, rounded up: "user" + 360 "x" (364 characters, 102
    // tokens), "tool" + "a" + 36 spaces (41, 12), 3 each, 3 priming.
    assert_eq!(CountRule::Chars(3.6).count(&b), Some(102 + 12 + 6 + 3));
    assert_eq!(
        "bytes:4".parse::<CountRule>().unwrap().count(&body(
            json!({"messages": [{"role": "user", "content": "日本"}]})
        )),
        Some(((4 + 6) as f64 / 4.0).ceil() as u64 + 3 + 3)
    );
    assert!("chars:0".parse::<CountRule>().is_err());
    assert!("words:3".parse::<CountRule>().is_err());
    assert_eq!(
        CountRule::Chars(3.0).count(&Bytes::from_static(b"nope")),
        None
    );
}

#[test]
fn the_mix_rule_counts_tool_output_and_prose_at_their_own_rates() {
    let rule: CountRule = "mix:4,2".parse().unwrap();
    assert_eq!(rule.to_string(), "mix:4,2");
    // "user" + 36 "x" at 2 (20), "tool" + "a" + 36 "y" at 4 (11 rounded
    // up), "assistant" + "ok" at 2 and the call's "c", "run" and "{}" at 4
    // (5.5 + 1.5 = 7); 3 a message, 3 priming.
    let b = body(json!({"model": "m", "messages": [
        {"role": "user", "content": "x".repeat(36)},
        {"role": "assistant", "content": "ok", "tool_calls": [{"id": "c", "function": {"name": "run", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "y".repeat(36)}]}));
    assert_eq!(rule.count(&b), Some(20 + 7 + 11 + 9 + 3));
    for bad in ["mix:4", "mix:4,", "mix:0,3", "mix:a,b"] {
        assert!(bad.parse::<CountRule>().is_err(), "{bad}");
    }
}

/// A chat body whose prompt is `chars` + 10 tokens under `Chars(1.0)`
/// ("user" and the content, 3 for the message, 3 priming), asking for
/// `max_tokens` when given.
fn chat(chars: usize, max_tokens: Option<u64>) -> Bytes {
    let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(chars)}]});
    if let Some(m) = max_tokens {
        v["max_tokens"] = json!(m);
    }
    body(v)
}

type Read = (&'static str, Option<u64>, Option<u64>, Option<u64>);

/// The status `s` answers `b` at `path` with, the error's message, and
/// what condense reads from the error (format, limit, prompt,
/// completion).
fn answer(s: &Simulator, path: &str, b: &Bytes) -> (u16, String, Option<Read>) {
    let r = s.respond(&Method::POST, path, b);
    let status = r.status().as_u16();
    let v: Value = serde_json::from_slice(r.body()).unwrap();
    let message = v["error"]["message"].as_str().unwrap_or("").to_string();
    let read = crate::overflow::detect(status, r.body())
        .map(|o| (o.format, o.limit, o.prompt, o.completion));
    (status, message, read)
}

#[test]
fn a_fitting_request_is_answered_with_its_usage() {
    let s = Simulator::new(CountRule::Chars(1.0), 100, OverflowStyle::OpenAi);
    let small = body(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}));
    let r = s.respond(&Method::POST, "/v1/chat/completions", &small);
    assert_eq!(r.status(), 200);
    let v: Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 6 + 6);
}

#[test]
fn anthropic_says_too_long_for_the_prompt_alone_and_names_max_tokens_otherwise() {
    let mut s = Simulator::new(CountRule::Chars(1.0), 0, OverflowStyle::OpenAi);
    let b = body(
        json!({"model": "claude-x", "max_tokens": 100, "messages": [{"role": "user", "content": "x".repeat(500)}]}),
    );
    let p = s.count_view(&MessagesRequest::parse(&b).unwrap().view().0);
    let path = "/v1/messages";
    s.window = p + 100;
    assert_eq!(answer(&s, path, &b).0, 200);
    // The prompt fits (up to the whole window), the prompt plus
    // max_tokens does not.
    for w in [p + 99, p] {
        s.window = w;
        let (status, message, read) = answer(&s, path, &b);
        assert_eq!(status, 400);
        assert_eq!(
            message,
            format!(
                "input length and `max_tokens` exceed context limit: {p} + 100 > {w}, decrease input length or `max_tokens` and try again"
            )
        );
        assert_eq!(read, Some(("anthropic", Some(w), Some(p), Some(100))));
    }
    // The prompt alone is over; the chat style is not Anthropic's.
    s.window = p - 1;
    s.overflow = OverflowStyle::LlamaCpp;
    let (status, message, read) = answer(&s, path, &b);
    assert_eq!(status, 400);
    assert_eq!(
        message,
        format!("prompt is too long: {p} tokens > {} maximum", p - 1)
    );
    assert_eq!(read, Some(("anthropic", Some(p - 1), Some(p), None)));
    assert_eq!(
        s.received().iter().map(|(_, ok)| *ok).collect::<Vec<_>>(),
        [true, false, false, false]
    );
}

#[test]
fn openai_names_the_completion_whenever_the_request_sets_one() {
    let mut s = Simulator::new(CountRule::Chars(1.0), 100, OverflowStyle::OpenAi);
    let path = "/v1/chat/completions";
    assert_eq!(answer(&s, path, &chat(80, Some(10))).0, 200);
    // 95 tokens: the messages fit, not with the completion.
    let (status, message, read) = answer(&s, path, &chat(85, Some(10)));
    assert_eq!(status, 400);
    assert_eq!(
        message,
        "This model's maximum context length is 100 tokens. However, you requested 105 tokens (95 in the messages, 10 in the completion). Please reduce the length of the messages or completion."
    );
    assert_eq!(read, Some(("openai", Some(100), Some(95), Some(10))));
    // Over on their own: the same form.
    let (_, _, read) = answer(&s, path, &chat(100, Some(10)));
    assert_eq!(read, Some(("openai", Some(100), Some(110), Some(10))));
    let mut newer: Value = serde_json::from_slice(&chat(85, None)).unwrap();
    newer["max_completion_tokens"] = json!(10);
    let (_, _, read) = answer(&s, path, &body(newer));
    assert_eq!(read, Some(("openai", Some(100), Some(95), Some(10))));
    // No max_tokens: only the messages count, and only they are named.
    assert_eq!(answer(&s, path, &chat(90, None)).0, 200);
    let (status, message, read) = answer(&s, path, &chat(100, None));
    assert_eq!(status, 400);
    assert_eq!(
        message,
        "This model's maximum context length is 100 tokens. However, your messages resulted in 110 tokens. Please reduce the length of the messages."
    );
    assert_eq!(read, Some(("openai", Some(100), Some(110), None)));
    // Without numbers.
    s.overflow = OverflowStyle::Bare;
    let (status, _, read) = answer(&s, path, &chat(85, Some(10)));
    assert_eq!(status, 400);
    assert_eq!(read, Some(("openai", None, None, None)));
}

#[test]
fn llamacpp_refuses_only_a_prompt_that_fills_the_context() {
    let s = Simulator::new(CountRule::Chars(1.0), 100, OverflowStyle::LlamaCpp);
    let path = "/v1/chat/completions";
    // max_tokens past the context ends the answer early; no error.
    assert_eq!(answer(&s, path, &chat(85, Some(10))).0, 200);
    assert_eq!(answer(&s, path, &chat(89, Some(1000))).0, 200);
    // A prompt of the whole context leaves no cell to decode into.
    let (status, message, read) = answer(&s, path, &chat(90, None));
    assert_eq!(status, 400);
    assert_eq!(
        message,
        "request (100 tokens) exceeds the available context size (100 tokens), try increasing it"
    );
    assert_eq!(read, Some(("llamacpp", Some(100), Some(100), None)));
    assert_eq!(
        s.received().iter().map(|(_, ok)| *ok).collect::<Vec<_>>(),
        [true, true, false]
    );
    assert!(s.accepts("/v1/chat/completions", 99, 1000));
    assert!(!s.accepts("/v1/messages", 99, 1000));
    assert!(!s.accepts("/v1/responses", 99, 2));
}
