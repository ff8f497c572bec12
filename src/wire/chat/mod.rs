//! OpenAI chat completions (`/v1/chat/completions`): the request is the
//! pipeline's view itself (`crate::chat`); here is what else the API is:
//! its usage, its errors, condense's tools in its shape, and its streams
//! (`stream.rs`).

mod stream;

pub use stream::REASONING_FIELDS;
use stream::usage;

use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use super::api::{Api, NotUnderstood, Parsed, Provider, WriteBack, WriteError};
use super::failure::{Errors, Failure};
use super::stream::{Decision, Edit, Filter, Gather, StreamEdit};
use super::summarize::{Summarize, Summarized};
use super::tap::{SseTap, TapRead};
use super::tools::{Call, OwnTools, append, names_own};
use super::usage::Usage;
use crate::chat::ChatRequest;
use crate::compaction::Fates;

/// The chat completions API.
#[derive(Debug)]
pub struct Chat;

/// OpenAI's error body for a message, type and code (also Responses').
pub fn error_body(message: &str, kind: &str, code: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

impl Errors for Chat {
    fn error_body(&self, f: &Failure) -> String {
        error_body(f.message, f.kind, f.code)
    }

    fn stream_error(&self, f: &Failure) -> String {
        format!("data: {}\n\n", error_body(f.message, f.kind, f.code))
    }
}

impl TapRead for Chat {
    fn usage(&self, raw: &[u8]) -> Option<Usage> {
        usage(raw)
    }

    fn tap_event(&self, tap: &mut SseTap, event: &[u8], out: &mut BytesMut) {
        stream::tap_event(tap, event, out);
    }
}

impl OwnTools for Chat {
    fn tool(&self, name: &str, description: &str, schema: Value) -> Value {
        json!({"type": "function", "function": {
            "name": name, "description": description, "parameters": schema}})
    }

    fn calls(&self, answer: &Value) -> Vec<(Call, bool)> {
        let calls = answer.pointer("/choices/0/message/tool_calls");
        calls
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|c| {
                Call::read(
                    c.get("id"),
                    c.pointer("/function/name"),
                    c.pointer("/function/arguments"),
                )
            })
            .collect()
    }

    fn follow_up(
        &self,
        answer: &Value,
        kept: &[Call],
        sent: &Bytes,
        results: &[(String, String)],
    ) -> Option<Bytes> {
        let is_kept = |id: &str| kept.iter().any(|c| c.id == id);
        let message = answer.pointer("/choices/0/message")?;
        let calls: Vec<Value> = message
            .get("tool_calls")?
            .as_array()?
            .iter()
            .filter(|c| c.get("id").and_then(Value::as_str).is_some_and(is_kept))
            .cloned()
            .collect();
        let content = message.get("content").cloned().unwrap_or(Value::Null);
        let mut assistant = json!({"role": "assistant", "content": content, "tool_calls": calls});
        // Reasoning some servers send beside the content (DeepSeek's
        // `reasoning_content`, OpenRouter's `reasoning`) goes back with
        // the calls it led to, as their tool loops expect.
        for key in REASONING_FIELDS {
            if let Some(r) = message.get(*key).filter(|r| !r.is_null()) {
                assistant[*key] = r.clone();
            }
        }
        let mut turn = vec![assistant];
        for (id, text) in results {
            turn.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
        }
        append(sent, "messages", &turn)
    }

    fn prepend(&self, earlier: &Value, answer: &mut Value) {
        let Some(text) = earlier
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        else {
            return;
        };
        if let Some(content) = answer.pointer_mut("/choices/0/message/content") {
            *content = match content.as_str() {
                Some(later) if !later.is_empty() => json!(format!("{text}\n\n{later}")),
                _ => json!(text),
            };
        }
    }

    fn strip_own_calls(&self, answer: &mut Value) {
        let choices = answer.get_mut("choices").and_then(Value::as_array_mut);
        for choice in choices.into_iter().flatten() {
            let Some(message) = choice.get_mut("message").and_then(Value::as_object_mut) else {
                continue;
            };
            let left = match message.get_mut("tool_calls").and_then(Value::as_array_mut) {
                Some(calls) => {
                    calls.retain(|c| !names_own(c, "/function/name"));
                    calls.len()
                }
                None => 0,
            };
            if left == 0 && message.remove("tool_calls").is_some() {
                if message.get("content").is_none_or(Value::is_null) {
                    message.insert("content".into(), Value::String(String::new()));
                }
                if choice.get("finish_reason").and_then(Value::as_str) == Some("tool_calls") {
                    choice["finish_reason"] = json!("stop");
                }
            }
        }
    }
}

impl StreamEdit for Chat {
    fn gather(&self, g: &mut Gather, data: &Value) -> Decision {
        stream::gather(g, data)
    }

    fn gathered(&self, g: &mut Gather) {
        if !g.calls.is_empty() {
            g.value["choices"][0]["message"]["tool_calls"] =
                Value::Array(std::mem::take(&mut g.calls));
        }
    }

    fn filter(&self, f: &mut Filter, data: &mut Value) -> Edit {
        stream::filter(f, data)
    }
}

impl Summarize for Chat {
    fn summary_call(
        &self,
        model: &str,
        prompt: &str,
        max_tokens: u64,
        max_field: &str,
    ) -> (&'static str, Value) {
        let mut body = json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": false,
        });
        body[max_field] = json!(max_tokens);
        ("/chat/completions", body)
    }

    fn summary_answer(&self, v: &Value) -> Result<Summarized, String> {
        let choice = v.pointer("/choices/0").ok_or("no choices")?;
        let content = choice
            .pointer("/message/content")
            .and_then(Value::as_str)
            .ok_or("no message content")?
            .to_string();
        Ok(Summarized {
            content,
            finish_reason: choice
                .get("finish_reason")
                .and_then(Value::as_str)
                .map(str::to_string),
            prompt_tokens: v.pointer("/usage/prompt_tokens").and_then(Value::as_u64),
            completion_tokens: v
                .pointer("/usage/completion_tokens")
                .and_then(Value::as_u64),
        })
    }
}

impl Api for Chat {
    fn parse(&self, body: &Bytes) -> Result<Parsed, NotUnderstood> {
        Ok(Parsed {
            conversation: ChatRequest::parse(body).map_err(NotUnderstood::parse)?,
            writer: Box::new(Written),
        })
    }

    fn provider(&self) -> Provider {
        Provider::OpenAi
    }

    fn parses_into_a_view(&self) -> bool {
        false
    }
}

/// A chat body's way back: the conversation is the body.
struct Written;

impl WriteBack for Written {
    fn api(&self) -> &'static dyn Api {
        &Chat
    }

    fn is_stream(&self, conversation: &ChatRequest) -> bool {
        conversation.is_stream()
    }

    fn body(&self, conversation: &ChatRequest, _: Option<&Fates>) -> Result<Bytes, WriteError> {
        Ok(conversation.to_bytes())
    }
}
