//! Context-overflow errors: recognising them in every provider's wording,
//! and the budget a retry aims at.
//!
//! Detection is table-driven: each row names a provider format, the status
//! it answers with, what marks the error as that provider's overflow, and
//! how to read the numbers (the ceiling, the prompt size the provider
//! counted, the completion part). Rows are tried in order; the first that
//! matches wins. Fixtures with the exact bodies are in
//! `tests/fixtures/overflow/`.
//!
//! A row looks at the error's own fields, never at the body as a whole:
//! the message (`error.message`, a top-level `message`, or xAI's
//! `error` string) must *start* with the provider's sentence, after at most
//! a few wrapper prefixes such as `litellm.BadRequestError: ` or
//! `OpenAIException - `; or the error's `code` / `type` must be the
//! provider's overflow value exactly (`context_length_exceeded`,
//! llama.cpp's `exceed_context_size_error`). Upstreams echo client input in
//! their 400s (OpenAI's "Invalid value: '…'", vLLM's validation errors), and
//! the window an overflow names is shared by every tenant of the upstream:
//! a sentence quoted inside another error must not be read as one.
//!
//! What must never match: rate limits and quota errors, authentication
//! errors, a `max_tokens` that is too large on its own, and an overflow's
//! wording quoted inside another error: compacting the prompt cannot fix
//! those, and a throttled client must get its 429 (and `Retry-After`)
//! untouched.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::tokens::Correction;
use crate::tokens::calibration::{MAX_RATIO, MIN_RATIO};

/// What an overflow error says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Overflow {
    /// The `provider_format` label: which wording matched (one of
    /// [`crate::metrics::labels::OVERFLOW_FORMATS`]).
    pub format: &'static str,
    /// The ceiling: the context window (or request limit) in the provider's
    /// tokens. Never 0.
    pub limit: Option<u64>,
    /// The prompt size the provider counted (messages only when it says so).
    pub prompt: Option<u64>,
    /// The completion tokens the provider counted against the ceiling.
    pub completion: Option<u64>,
    /// True when `limit` is the model's context window; false when it is a
    /// limit of the caller's account (OpenAI's tokens per minute), which
    /// holds for the rejected request only and is not learned for the
    /// model.
    #[serde(skip)]
    pub names_window: bool,
}

/// The fields of an error body a row may look at.
struct ErrorFields<'a> {
    /// The message, lower-cased, with wrapper prefixes removed.
    message: Option<String>,
    /// `code` when it is a string.
    code: Option<&'a str>,
    /// `type` when it is a string.
    kind: Option<&'a str>,
    /// The object holding them (llama.cpp puts its counts there).
    object: &'a Map<String, Value>,
}

impl<'a> ErrorFields<'a> {
    /// The error object of a body: `{"error": {...}}` (OpenAI, Anthropic,
    /// llama.cpp, and vLLM's newer shape), a top-level `message` (vLLM's
    /// older shape, Mistral), `{"error": "..."}` (xAI), or the first element
    /// of a list of any of these (Gemini's OpenAI-compatible endpoint).
    fn of(body: &'a Value) -> Option<ErrorFields<'a>> {
        let body = match body {
            Value::Array(items) => items.first()?,
            other => other,
        };
        let top = body.as_object()?;
        let (object, message) = match top.get("error") {
            Some(Value::Object(e)) => (e, e.get("message")),
            Some(Value::String(_)) => (top, top.get("error")),
            _ => (top, top.get("message")),
        };
        let text = |v: Option<&'a Value>| v.and_then(Value::as_str);
        Some(ErrorFields {
            message: text(message).map(|m| unwrapped(&m.trim().to_lowercase()).to_string()),
            code: text(object.get("code")),
            kind: text(object.get("type")),
            object,
        })
    }

    fn number(&self, key: &str) -> Option<u64> {
        self.object.get(key).and_then(Value::as_u64)
    }
}

/// Wrapper prefixes removed before a message is matched, at most this many.
const MAX_PREFIXES: usize = 4;

/// `message` without the prefixes that gateways and SDKs put before a
/// provider's message: an exception's name and `": "` or `" - "`
/// (`litellm.BadRequestError: `, `OpenAIException - `). Such a name is an
/// identifier ending in "error" or "exception", so it cannot carry the
/// text of a request.
fn unwrapped(mut message: &str) -> &str {
    for _ in 0..MAX_PREFIXES {
        let Some(end) = message.find([':', ' ']) else {
            break;
        };
        let (name, rest) = message.split_at(end);
        let identifier = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
            && (name.ends_with("error") || name.ends_with("exception"));
        let Some(rest) = rest
            .strip_prefix(": ")
            .or_else(|| rest.strip_prefix(" - "))
            .filter(|_| identifier)
        else {
            break;
        };
        message = rest.trim_start();
    }
    message
}

/// What marks an error as a provider's overflow.
enum Mark {
    /// The message starts with this (lower case) and then holds every one
    /// of the phrases.
    Starts(&'static str, &'static [&'static str]),
    /// `code` is exactly this, and the message, if `Some`, starts with it.
    Code(&'static str, Option<&'static str>),
    /// `type` is exactly this.
    Kind(&'static str),
}

/// (limit, prompt, completion) read from a matched error; None rejects the
/// match. `rest` is the message after the matched start.
type Reader = fn(rest: &str, message: &str, fields: &ErrorFields) -> Option<Numbers>;
type Numbers = (Option<u64>, Option<u64>, Option<u64>);

struct Row {
    format: &'static str,
    statuses: &'static [u16],
    mark: Mark,
    read: Reader,
    /// The limit is the model's window (not an account's limit).
    window: bool,
}

/// "This model's maximum context length is N tokens": OpenAI, Azure,
/// DeepSeek, vLLM.
const OPENAI_START: &str = "this model's maximum context length is ";

const TABLE: &[Row] = &[
    Row {
        format: "llamacpp",
        statuses: &[400],
        mark: Mark::Kind("exceed_context_size_error"),
        read: |_, _, f| Some((f.number("n_ctx"), f.number("n_prompt_tokens"), None)),
        window: true,
    },
    Row {
        format: "openai_tpm",
        statuses: &[429],
        // "Request too large for gpt-4o in organization org-1 on tokens per
        // min (TPM): Limit 30000, Requested 45120. ..."
        mark: Mark::Starts("request too large for ", &["tokens per min (tpm): "]),
        read: |rest, _, _| {
            // The model's name (the client's) comes before the counts: they
            // are read after the last "(tpm): ".
            let tpm = "(tpm): ";
            let counts = &rest[rest.rfind(tpm)? + tpm.len()..];
            let limit = number_at(counts.strip_prefix("limit ")?)?;
            let requested = number_after(counts, ", requested ")?;
            // Only a request larger than the limit is an overflow; anything
            // else is throttling.
            (requested > limit).then_some((Some(limit), Some(requested), None))
        },
        window: false,
    },
    Row {
        format: "openrouter",
        statuses: &[400, 413],
        mark: Mark::Starts("this endpoint's maximum context length is ", &[]),
        read: |rest, m, _| {
            Some((
                number_at(rest),
                prompt_part(m, "of text input").or(number_after(m, "requested about")),
                number_after_in(m, "of text input,", "in the output"),
            ))
        },
        window: true,
    },
    Row {
        format: "vllm",
        statuses: &[400, 413],
        mark: Mark::Starts(OPENAI_START, &["your prompt contains at least"]),
        read: |rest, m, _| {
            Some((
                number_at(rest),
                number_after(m, "prompt contains at least"),
                number_after(m, "you requested").filter(|_| m.contains("output tokens")),
            ))
        },
        window: true,
    },
    Row {
        format: "openai",
        statuses: &[400, 413],
        mark: Mark::Starts(OPENAI_START, &[]),
        read: |rest, m, _| {
            let total = number_after(m, "resulted in").or(number_after(m, "you requested"));
            let messages = prompt_part(m, "in the messages");
            let completion = number_after_in(m, "in the messages,", "in the completion");
            Some((number_at(rest), messages.or(total), completion))
        },
        window: true,
    },
    Row {
        format: "openai",
        statuses: &[400, 413],
        // "Input tokens exceed the configured limit of 272000 tokens. Your
        // messages resulted in 280512 tokens."
        mark: Mark::Code(
            "context_length_exceeded",
            Some("input tokens exceed the configured limit of "),
        ),
        read: |rest, m, _| Some((number_at(rest), number_after(m, "resulted in"), None)),
        window: true,
    },
    Row {
        format: "openai",
        statuses: &[400, 413],
        mark: Mark::Code("context_length_exceeded", None),
        read: |_, _, _| Some((None, None, None)),
        window: true,
    },
    Row {
        format: "anthropic",
        statuses: &[400, 413],
        // "input length and `max_tokens` exceed context limit: M + K > N"
        mark: Mark::Starts("input length and `max_tokens` exceed context limit: ", &[]),
        read: |rest, _, _| {
            Some((
                number_after(rest, " > "),
                number_at(rest),
                number_after(rest, " + "),
            ))
        },
        window: true,
    },
    Row {
        format: "anthropic",
        statuses: &[400, 413],
        // "prompt is too long: M tokens > N maximum"
        mark: Mark::Starts("prompt is too long: ", &[]),
        read: |rest, _, _| Some((number_after(rest, "tokens >"), number_at(rest), None)),
        window: true,
    },
    Row {
        format: "mistral",
        statuses: &[400, 413],
        // "Prompt contains M tokens and 0 draft tokens, too large for model
        // with N maximum context length"
        mark: Mark::Starts(
            "prompt contains ",
            &["too large for model with", "maximum context length"],
        ),
        read: |rest, m, _| {
            Some((
                number_after(m, "too large for model with"),
                number_at(rest),
                None,
            ))
        },
        window: true,
    },
    Row {
        format: "xai",
        statuses: &[400, 413],
        // "This model's maximum prompt length is N but the request contains
        // M tokens."
        mark: Mark::Starts("this model's maximum prompt length is ", &[]),
        read: |rest, m, _| Some((number_at(rest), number_after(m, "request contains"), None)),
        window: true,
    },
    Row {
        format: "gemini",
        statuses: &[400, 413],
        // "The input token count (M) exceeds the maximum number of tokens
        // allowed (N)."
        mark: Mark::Starts(
            "the input token count",
            &["exceeds the maximum number of tokens allowed"],
        ),
        read: |rest, m, _| {
            // The count, when given, comes first, in brackets.
            let count = rest.strip_prefix(" (").and_then(number_at);
            Some((number_after(m, "tokens allowed"), count, None))
        },
        window: true,
    },
];

impl Row {
    /// The numbers of `fields` when this row's mark is on them.
    fn read(&self, fields: &ErrorFields) -> Option<Numbers> {
        let message = fields.message.as_deref();
        let (rest, message) = match self.mark {
            Mark::Starts(start, phrases) => {
                let message = message?;
                let rest = message.strip_prefix(start)?;
                phrases
                    .iter()
                    .all(|p| rest.contains(p))
                    .then_some((rest, message))?
            }
            Mark::Code(code, start) => {
                if fields.code != Some(code) {
                    return None;
                }
                let message = message.unwrap_or_default();
                match start {
                    Some(start) => (message.strip_prefix(start)?, message),
                    None => (message, message),
                }
            }
            Mark::Kind(kind) => {
                if fields.kind != Some(kind) {
                    return None;
                }
                let message = message.unwrap_or_default();
                (message, message)
            }
        };
        (self.read)(rest, message, fields)
    }
}

/// Recognises an overflow error response.
pub fn detect(status: u16, body: &[u8]) -> Option<Overflow> {
    if !(400..500).contains(&status) || body.len() > 1 << 20 {
        return None;
    }
    let json: Value = serde_json::from_slice(body).ok()?;
    let fields = ErrorFields::of(&json)?;
    TABLE.iter().find_map(|row| {
        if !row.statuses.contains(&status) {
            return None;
        }
        let (limit, prompt, completion) = row.read(&fields)?;
        Some(Overflow {
            format: row.format,
            // A window of 0 is no window.
            limit: limit.filter(|&l| l > 0),
            prompt,
            completion,
            names_window: row.window,
        })
    })
}

/// The integer `text` starts with (digits may be grouped by commas or
/// underscores).
fn number_at(text: &str) -> Option<u64> {
    if !text.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    first_number(text, 0)
}

/// The first integer after `phrase` in `text` (digits may be grouped by
/// commas or underscores), within a short distance.
fn number_after(text: &str, phrase: &str) -> Option<u64> {
    let at = text.find(phrase)? + phrase.len();
    first_number(&text[at..], 24)
}

/// The integer just before `suffix` in the part of `text` after `after`.
fn number_after_in(text: &str, after: &str, suffix: &str) -> Option<u64> {
    let start = text.find(after)? + after.len();
    let rest = &text[start..];
    let end = rest.find(suffix)?;
    first_number(&rest[..end], 24)
}

/// The integer directly before ` suffix` (as in "(900 in the messages").
fn prompt_part(text: &str, suffix: &str) -> Option<u64> {
    let end = text.find(suffix)?;
    let head = text[..end].trim_end();
    let start = head
        .rfind(|c: char| !(c.is_ascii_digit() || c == ',' || c == '_'))
        .map_or(0, |i| i + 1);
    parse_digits(&head[start..])
}

fn first_number(s: &str, within: usize) -> Option<u64> {
    let start = s.find(|c: char| c.is_ascii_digit())?;
    if start > within {
        return None;
    }
    let digits: String = s[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',' || *c == '_')
        .collect();
    parse_digits(digits.trim_end_matches([',', '_']))
}

fn parse_digits(s: &str) -> Option<u64> {
    let d: String = s.chars().filter(char::is_ascii_digit).collect();
    d.parse().ok()
}

/// Share of the rejected prompt a retry aims at when the error gives no
/// numbers.
pub const BLIND_SHARE: f64 = 0.7;

/// condense's measure of the body the provider rejected.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rejected {
    /// The raw count.
    pub raw: u64,
    /// The body's length in bytes.
    pub bytes: usize,
    /// The calibrated estimate.
    pub calibrated: u64,
    /// The calibration ratio it was estimated with.
    pub ratio: f64,
}

impl Overflow {
    /// How the retry of the rejected request is measured.
    ///
    /// The provider's count says how far off the estimate was in total, not
    /// where: one whitespace-heavy result can hold the whole difference (a
    /// provider counting characters sees every space; o200k folds runs of
    /// them), or it can be spread evenly (a tokenizer that is simply
    /// coarser). So on the retry each message counts as the larger of two
    /// readings: its tokens at the calibration ratio, and its bytes at the
    /// provider's tokens per byte of the rejected body (`density`, in raw
    /// tokens at that ratio). Either kind of difference is then seen where
    /// it is, and the rejected body itself counts at least what the
    /// provider said. The ceiling is the window. Without a count, the retry
    /// aims at 70% of the rejected prompt, and each message counts at least
    /// its bytes at the rejected body's mean tokens per byte as condense
    /// counted it: what tips the body over may be one whitespace-heavy
    /// result, which the retry must then see (a chat request whose fresh
    /// 44 KB of indented code o200k counts at a third of a provider
    /// counting characters was cut to 70% everywhere else, left the result
    /// whole and was rejected again).
    pub fn correction(&self, sent: &Rejected) -> Correction {
        let ratio = sent.ratio.clamp(MIN_RATIO, MAX_RATIO);
        let density = match self.prompt {
            Some(p) if sent.bytes > 0 => Some(p as f64 / sent.bytes as f64 / ratio),
            None if sent.bytes > 0 && sent.calibrated > 0 => {
                Some(sent.calibrated as f64 / sent.bytes as f64 / ratio)
            }
            _ => None,
        };
        let counted = self.prompt.unwrap_or(sent.calibrated);
        let prompt_budget = (self.limit.is_none() || self.prompt.is_none())
            .then_some((counted as f64 * BLIND_SHARE).round() as u64);
        Correction {
            ratio: density.map(|_| ratio),
            completion: self.completion,
            prompt_budget,
            density,
        }
    }
}

#[cfg(test)]
mod tests;
