use super::*;

#[test]
fn the_metric_starts_a_series_for_each_wording_in_the_table() {
    let mut formats: Vec<&str> = Vec::new();
    for row in TABLE {
        if !formats.contains(&row.format) {
            formats.push(row.format);
        }
    }
    assert_eq!(formats, crate::metrics::labels::OVERFLOW_FORMATS);
}

#[test]
fn the_retry_budget_follows_what_the_error_says() {
    let o = |limit, prompt, completion| Overflow {
        format: "openai",
        limit,
        prompt,
        completion,
        names_window: true,
    };
    let sent = Rejected {
        raw: 10_000,
        bytes: 40_000,
        calibrated: 11_000,
        ratio: 1.1,
    };
    // Ceiling and count: the calibration ratio stays, and the
    // provider's tokens per byte (0.3, here 0.3 / 1.1 in raw tokens)
    // floor every message.
    let c = o(Some(8192), Some(12_000), Some(1000)).correction(&sent);
    assert_eq!(c.ratio, Some(1.1));
    assert_eq!(c.completion, Some(1000));
    assert_eq!(c.prompt_budget, None);
    assert!((c.density.unwrap() - 0.3 / 1.1).abs() < 1e-12);
    // No numbers: 70% of the rejected prompt, and the body's mean tokens
    // per byte as condense counted it (11,000 / 40,000, here over 1.1 in
    // raw tokens) floors every message.
    let c = o(None, None, None).correction(&sent);
    assert_eq!((c.ratio, c.prompt_budget), (Some(1.1), Some(7_700)));
    assert!((c.density.unwrap() - 11_000.0 / 40_000.0 / 1.1).abs() < 1e-12);
    // A ceiling without a count: the window, and 70% as a cap.
    let c = o(Some(8192), None, None).correction(&sent);
    assert_eq!(c.prompt_budget, Some(7_700));
    // A count without a ceiling: 70% of the provider's count.
    let c = o(None, Some(20_000), None).correction(&sent);
    assert_eq!(c.prompt_budget, Some(14_000));
}

/// An OpenAI-shaped error body with `message` and `code`.
fn openai(message: &str, code: &str) -> Vec<u8> {
    serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}})
        .to_string()
        .into_bytes()
}

fn read(status: u16, body: &[u8]) -> Option<(&'static str, Option<u64>, Option<u64>)> {
    detect(status, body).map(|o| (o.format, o.limit, o.prompt))
}

#[test]
fn a_providers_sentence_counts_only_where_it_starts_the_message() {
    let sentence = "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.";
    let found = Some(("openai", Some(8192), Some(9000)));
    assert_eq!(read(400, &openai(sentence, "x")), found);
    // Leading space and case do not matter.
    assert_eq!(
        read(400, &openai(&format!("  {}", sentence.to_uppercase()), "x")),
        found
    );
    // After the names of exceptions that gateways put first.
    for wrapped in [
        format!("litellm.BadRequestError: {sentence}"),
        format!("litellm.BadRequestError: OpenAIException - {sentence}"),
        format!("BadRequestError: ContextWindowExceededError: {sentence}"),
    ] {
        assert_eq!(read(400, &openai(&wrapped, "x")), found, "{wrapped}");
    }
    // Quoted, or after anything else, it is not the provider's.
    for echoed in [
        format!("Invalid value: '{sentence}'. Supported values are: 'low' and 'high'."),
        format!("Upstream said: {sentence}"),
        format!("user error: {sentence}"),
        format!("'{sentence}' is not one of ['low', 'high']"),
        format!("a.Error: b.Error: c.Error: d.Error: e.Error: {sentence}"),
        format!("{}Error: {sentence}", "x".repeat(80)),
    ] {
        assert_eq!(
            read(400, &openai(&echoed, "invalid_value")),
            None,
            "{echoed}"
        );
    }
}

#[test]
fn codes_and_types_count_only_as_the_whole_field() {
    let code_only = openai(
        "Please reduce the length of the messages.",
        "context_length_exceeded",
    );
    assert_eq!(read(400, &code_only), Some(("openai", None, None)));
    let quoted = openai("Invalid value: 'context_length_exceeded'.", "invalid_value");
    assert_eq!(read(400, &quoted), None);
    let llama = br#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9120,"n_ctx":8192}}"#;
    assert_eq!(read(400, llama), Some(("llamacpp", Some(8192), Some(9120))));
    let typed = br#"{"error":{"code":400,"message":"exceed_context_size_error","type":"invalid_request_error","n_prompt_tokens":9120,"n_ctx":50}}"#;
    assert_eq!(read(400, typed), None);
}

#[test]
fn a_window_of_zero_is_no_window() {
    let zero = openai(
        "This model's maximum context length is 0 tokens. However, your messages resulted in 9000 tokens.",
        "context_length_exceeded",
    );
    assert_eq!(read(400, &zero), Some(("openai", None, Some(9000))));
    let llama =
        br#"{"error":{"type":"exceed_context_size_error","n_prompt_tokens":9120,"n_ctx":0}}"#;
    assert_eq!(read(400, llama), Some(("llamacpp", None, Some(9120))));
}

#[test]
fn a_tokens_per_minute_limit_is_read_after_the_models_name_and_is_no_window() {
    // The model's name is the client's: counts inside it are not read.
    let body = openai(
        "Request too large for x (TPM): Limit 10, Requested 20 in organization org-1 on tokens per min (TPM): Limit 30000, Requested 45120. The input or output tokens must be reduced.",
        "rate_limit_exceeded",
    );
    let o = detect(429, &body).unwrap();
    assert_eq!(
        (o.format, o.limit, o.prompt, o.names_window),
        ("openai_tpm", Some(30000), Some(45120), false)
    );
    let o = detect(
        400,
        &openai("This model's maximum context length is 8192 tokens.", "x"),
    );
    assert!(o.unwrap().names_window);
}

#[test]
fn each_wording_is_anchored() {
    // (status, body, format) of each provider's sentence, and the same
    // sentence quoted after other text.
    let cases: &[(u16, &str, &str)] = &[
        (
            400,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 208462 tokens > 200000 maximum"}}"#,
            "anthropic",
        ),
        (
            400,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 187254 + 20000 > 204798, decrease input length"}}"#,
            "anthropic",
        ),
        (
            400,
            r#"{"error":{"message":"This endpoint's maximum context length is 131072 tokens. However, you requested about 140234 tokens (136138 of text input, 4096 in the output).","code":400}}"#,
            "openrouter",
        ),
        (
            400,
            r#"{"error":{"message":"This model's maximum context length is 16384 tokens. However, you requested 1024 output tokens and your prompt contains at least 15361 input tokens, for a total of at least 16385 tokens.","type":"BadRequestError","code":400}}"#,
            "vllm",
        ),
        (
            400,
            r#"{"object":"error","message":"Prompt contains 40123 tokens and 0 draft tokens, too large for model with 32768 maximum context length","type":"invalid_request_message_error","code":"3051"}"#,
            "mistral",
        ),
        (
            400,
            r#"{"code":"Client specified an invalid argument","error":"This model's maximum prompt length is 131072 but the request contains 150321 tokens."}"#,
            "xai",
        ),
        (
            400,
            r#"[{"error":{"code":400,"message":"The input token count (1200456) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]"#,
            "gemini",
        ),
        (
            400,
            r#"{"error":{"message":"Input tokens exceed the configured limit of 272000 tokens. Your messages resulted in 280512 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
            "openai",
        ),
        (
            429,
            r#"{"error":{"message":"Request too large for gpt-4o in organization org-1 on tokens per min (TPM): Limit 30000, Requested 45120.","type":"tokens","code":"rate_limit_exceeded"}}"#,
            "openai_tpm",
        ),
    ];
    for &(status, body, format) in cases {
        let o = detect(status, body.as_bytes()).unwrap_or_else(|| panic!("{body}"));
        assert_eq!(o.format, format, "{body}");
        assert!(o.limit.is_some(), "{body}");
        // The same error with its message quoted inside another: no
        // overflow. (The code of the newer OpenAI wording would still
        // mark it, as any error carrying it: that code is OpenAI's.)
        let echoed = body
            .replace(r#""message":""#, r#""message":"Invalid value: '"#)
            .replace(r#""error":"This"#, r#""error":"Invalid value: 'This"#)
            .replace("context_length_exceeded", "invalid_value");
        assert_ne!(echoed, body);
        assert_eq!(detect(status, echoed.as_bytes()), None, "{echoed}");
    }
}

/// (format, limit, prompt, completion).
type Read = (&'static str, Option<u64>, Option<u64>, Option<u64>);

/// What condense reads from an error.
fn numbers(status: u16, body: &str) -> Option<Read> {
    detect(status, body.as_bytes()).map(|o| (o.format, o.limit, o.prompt, o.completion))
}

#[test]
fn anthropics_prompt_too_long_names_the_window_and_the_prompt() {
    let body = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 208462 tokens > 200000 maximum"},"request_id":"req_1"}"#;
    assert_eq!(
        numbers(400, body),
        Some(("anthropic", Some(200_000), Some(208_462), None))
    );
}

#[test]
fn anthropics_input_and_max_tokens_over_the_limit_names_all_three() {
    let body = r#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 187254 + 20000 > 200000, decrease input length or `max_tokens` and try again"}}"#;
    let o = detect(400, body.as_bytes()).unwrap();
    // The window is the limit W, not W - M: the prompt fit in it.
    assert_eq!(
        (o.format, o.limit, o.prompt, o.completion, o.names_window),
        (
            "anthropic",
            Some(200_000),
            Some(187_254),
            Some(20_000),
            true
        )
    );
    // The retry keeps the completion the provider counted and, with
    // both numbers given, needs no blind share.
    let sent = Rejected {
        raw: 170_000,
        bytes: 700_000,
        calibrated: 180_000,
        ratio: 1.1,
    };
    let c = o.correction(&sent);
    assert_eq!((c.completion, c.prompt_budget), (Some(20_000), None));
    assert!(c.density.is_some());
}

#[test]
fn openais_messages_resulted_in_names_the_window_and_the_messages() {
    let body = openai(
        "This model's maximum context length is 128000 tokens. However, your messages resulted in 130412 tokens. Please reduce the length of the messages.",
        "context_length_exceeded",
    );
    assert_eq!(
        numbers(400, std::str::from_utf8(&body).unwrap()),
        Some(("openai", Some(128_000), Some(130_412), None))
    );
}

#[test]
fn openais_you_requested_names_the_messages_and_the_completion() {
    let body = openai(
        "This model's maximum context length is 16385 tokens. However, you requested 17153 tokens (13057 in the messages, 4096 in the completion). Please reduce the length of the messages or completion.",
        "context_length_exceeded",
    );
    assert_eq!(
        numbers(400, std::str::from_utf8(&body).unwrap()),
        Some(("openai", Some(16_385), Some(13_057), Some(4_096)))
    );
}

#[test]
fn llamacpps_error_is_read_from_its_fields_whatever_its_message() {
    for message in [
        "the request exceeds the available context size, try increasing it",
        "request (9120 tokens) exceeds the available context size (8192 tokens), try increasing it",
    ] {
        let body = serde_json::json!({"error": {"code": 400, "message": message,
            "type": "exceed_context_size_error", "n_prompt_tokens": 9120, "n_ctx": 8192}});
        assert_eq!(
            numbers(400, &body.to_string()),
            Some(("llamacpp", Some(8192), Some(9120), None)),
            "{message}"
        );
    }
}

#[test]
fn numbers_are_read_with_grouping_and_nearby_only() {
    assert_eq!(
        number_after("allowed (1,048,576).", "allowed"),
        Some(1_048_576)
    );
    assert_eq!(
        number_after("limit 30000, requested 45000", "requested "),
        Some(45000)
    );
    assert_eq!(
        number_after("is x y z and so on for a while 12", "is"),
        None
    );
    assert_eq!(
        prompt_part("(900 in the messages", "in the messages"),
        Some(900)
    );
    assert_eq!(number_at("12,345 tokens"), Some(12_345));
    assert_eq!(number_at(" 12"), None);
}
