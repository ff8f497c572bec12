//! Context-overflow errors: recognising them in every provider's wording,
//! and the budget a retry aims at.
//!
//! Detection is table-driven: each row names a provider format, the status
//! it answers with, text that must be present, and how to read the numbers
//! (the ceiling, the prompt size the provider counted, the completion part).
//! Rows are tried in order; the first that matches wins. Fixtures with the
//! exact bodies are in `tests/fixtures/overflow/`.
//!
//! What must never match: rate limits and quota errors, authentication
//! errors, and a `max_tokens` that is too large on its own: compacting the
//! prompt cannot fix those, and a throttled client must get its 429 (and
//! `Retry-After`) untouched.

use serde::Serialize;
use serde_json::Value;

use crate::tokens::Correction;
use crate::tokens::calibration::{MAX_RATIO, MIN_RATIO};

/// What an overflow error says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Overflow {
    /// The `provider_format` label: which wording matched.
    pub format: &'static str,
    /// The ceiling: the context window (or request limit) in the provider's
    /// tokens.
    pub limit: Option<u64>,
    /// The prompt size the provider counted (messages only when it says so).
    pub prompt: Option<u64>,
    /// The completion tokens the provider counted against the ceiling.
    pub completion: Option<u64>,
}

type Reader = fn(&str, &Value) -> Option<(Option<u64>, Option<u64>, Option<u64>)>;

struct Row {
    format: &'static str,
    statuses: &'static [u16],
    /// Lower-case phrases that must all be in the error text.
    needles: &'static [&'static str],
    /// Reads (limit, prompt, completion); None rejects the match.
    read: Reader,
}

const TABLE: &[Row] = &[
    Row {
        format: "llamacpp",
        statuses: &[400],
        needles: &["exceed_context_size_error"],
        read: |_, v| {
            let e = v.get("error").unwrap_or(v);
            let n = |k: &str| e.get(k).and_then(Value::as_u64);
            Some((n("n_ctx"), n("n_prompt_tokens"), None))
        },
    },
    Row {
        format: "openai_tpm",
        statuses: &[429],
        needles: &["request too large", "limit", "requested"],
        read: |t, _| {
            let limit = number_after(t, "limit ")?;
            let requested = number_after(t, "requested ")?;
            // Only a request larger than the limit is an overflow; anything
            // else is throttling.
            (requested > limit).then_some((Some(limit), Some(requested), None))
        },
    },
    Row {
        format: "openrouter",
        statuses: &[400, 413],
        needles: &["endpoint's maximum context length is"],
        read: |t, _| {
            Some((
                number_after(t, "maximum context length is"),
                number_after(t, "requested about"),
                number_after_in(t, "of text input,", "in the output"),
            ))
            .map(|(l, total, out)| (l, prompt_part(t, "of text input").or(total), out))
        },
    },
    Row {
        format: "vllm",
        statuses: &[400, 413],
        needles: &["maximum context length is", "your prompt contains at least"],
        read: |t, _| {
            Some((
                number_after(t, "maximum context length is"),
                number_after(t, "prompt contains at least"),
                number_after(t, "you requested").filter(|_| t.contains("output tokens")),
            ))
        },
    },
    Row {
        format: "openai",
        statuses: &[400, 413],
        needles: &["maximum context length is"],
        read: |t, _| {
            let limit = number_after(t, "maximum context length is");
            let total = number_after(t, "resulted in").or(number_after(t, "you requested"));
            let messages = prompt_part(t, "in the messages");
            let completion = number_after_in(t, "in the messages,", "in the completion");
            Some((limit, messages.or(total), completion))
        },
    },
    Row {
        format: "openai",
        statuses: &[400, 413],
        needles: &["context_length_exceeded", "limit of"],
        read: |t, _| {
            Some((
                number_after(t, "limit of"),
                number_after(t, "resulted in"),
                None,
            ))
        },
    },
    Row {
        format: "openai",
        statuses: &[400, 413],
        needles: &["context_length_exceeded"],
        read: |_, _| Some((None, None, None)),
    },
    Row {
        format: "anthropic",
        statuses: &[400, 413],
        needles: &["exceed context limit"],
        // "input length and `max_tokens` exceed context limit: M + K > N"
        read: |t, _| {
            Some((
                number_after(t, " > "),
                number_after(t, "context limit:"),
                number_after(t, " + "),
            ))
        },
    },
    Row {
        format: "anthropic",
        statuses: &[400, 413],
        needles: &["prompt is too long"],
        read: |t, _| {
            Some((
                number_after(t, "tokens >"),
                number_after(t, "prompt is too long:"),
                None,
            ))
        },
    },
    Row {
        format: "mistral",
        statuses: &[400, 413],
        needles: &["too large for model with", "maximum context length"],
        read: |t, _| {
            Some((
                number_after(t, "too large for model with"),
                number_after(t, "prompt contains"),
                None,
            ))
        },
    },
    Row {
        format: "xai",
        statuses: &[400, 413],
        needles: &["maximum prompt length is"],
        read: |t, _| {
            Some((
                number_after(t, "maximum prompt length is"),
                number_after(t, "request contains"),
                None,
            ))
        },
    },
    Row {
        format: "gemini",
        statuses: &[400, 413],
        needles: &["input token count", "exceeds the maximum number of tokens"],
        read: |t, _| {
            Some((
                number_after(t, "tokens allowed"),
                number_after(t, "input token count"),
                None,
            ))
        },
    },
];

/// Every `provider_format` label, each once.
pub fn formats() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for row in TABLE {
        if !out.contains(&row.format) {
            out.push(row.format);
        }
    }
    out
}

/// The `outcome` label of `condense_context_overflow_total`.
pub const OUTCOMES: &[&str] = &["recovered", "failed", "not_recoverable"];

/// Recognises an overflow error response.
pub fn detect(status: u16, body: &[u8]) -> Option<Overflow> {
    if !(400..500).contains(&status) || body.len() > 1 << 20 {
        return None;
    }
    let json: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let text = String::from_utf8_lossy(body).to_lowercase();
    TABLE.iter().find_map(|row| {
        if !row.statuses.contains(&status) || !row.needles.iter().all(|n| text.contains(n)) {
            return None;
        }
        let (limit, prompt, completion) = (row.read)(&text, &json)?;
        Some(Overflow {
            format: row.format,
            limit,
            prompt,
            completion,
        })
    })
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
    /// aims at 70% of the rejected prompt.
    pub fn correction(&self, sent: &Rejected) -> Correction {
        let ratio = sent.ratio.clamp(MIN_RATIO, MAX_RATIO);
        let density = match self.prompt {
            Some(p) if sent.bytes > 0 => Some(p as f64 / sent.bytes as f64 / ratio),
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
mod tests {
    use super::*;

    #[test]
    fn the_retry_budget_follows_what_the_error_says() {
        let o = |limit, prompt, completion| Overflow {
            format: "openai",
            limit,
            prompt,
            completion,
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
        // No numbers: 70% of the rejected prompt, no floor.
        let c = o(None, None, None).correction(&sent);
        assert_eq!(
            (c.ratio, c.prompt_budget, c.density),
            (None, Some(7_700), None)
        );
        // A ceiling without a count: the window, and 70% as a cap.
        let c = o(Some(8192), None, None).correction(&sent);
        assert_eq!(c.prompt_budget, Some(7_700));
        // A count without a ceiling: 70% of the provider's count.
        let c = o(None, Some(20_000), None).correction(&sent);
        assert_eq!(c.prompt_budget, Some(14_000));
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
    }
}
