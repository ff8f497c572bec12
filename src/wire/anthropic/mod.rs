//! Anthropic Messages (`/v1/messages`): the request read without loss
//! and written back (`request.rs`), its usage, its errors, condense's
//! tools in its shape, and its streams (`stream.rs`).

mod request;
mod stream;
mod usage;

pub use request::{MessagesRequest, Origins, ParseError, WriteError};

use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use super::api::{Api, NotUnderstood, Parsed, Provider, Rewritable, Rewrite};
use super::failure::{Errors, Failure};
use super::stream::{Decision, Edit, Filter, Gather, StreamEdit};
use super::summarize::{Summarize, Summarized};
use super::tap::{SseTap, TapRead};
use super::tools::{Call, OwnTools, append, names_own};
use super::usage::Usage;
use crate::compaction::Fates;
use usage::{AnthropicUsage, usage};

const ANTHROPIC_VERSION: http::HeaderName = http::HeaderName::from_static("anthropic-version");

/// The Messages API.
#[derive(Debug)]
pub struct Messages;

/// Anthropic's error object (the body's and the stream event's data).
fn error_value(f: &Failure) -> Value {
    json!({"type": "error", "error": {
        "type": f.anthropic_kind, "message": format!("{} ({})", f.message, f.code)}})
}

fn blocks(value: &Value) -> impl Iterator<Item = &Value> {
    value
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

impl Errors for Messages {
    fn error_body(&self, f: &Failure) -> String {
        error_value(f).to_string()
    }

    /// Anthropic's SDKs raise an `error` event as an API error.
    fn stream_error(&self, f: &Failure) -> String {
        format!("event: error\ndata: {}\n\n", error_value(f))
    }
}

impl TapRead for Messages {
    fn usage(&self, raw: &[u8]) -> Option<Usage> {
        usage(raw)
    }

    fn tap_event(&self, tap: &mut SseTap, event: &[u8], out: &mut BytesMut) {
        stream::tap_event(tap, event, out);
    }
}

impl OwnTools for Messages {
    fn tool(&self, name: &str, description: &str, schema: Value) -> Value {
        json!({"name": name, "description": description, "input_schema": schema})
    }

    fn calls(&self, answer: &Value) -> Vec<(Call, bool)> {
        blocks(answer)
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
            .map(|b| Call::read(b.get("id"), b.get("name"), b.get("input")))
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
        let content: Vec<Value> = blocks(answer)
            .filter(|b| {
                b.get("type").and_then(Value::as_str) != Some("tool_use")
                    || b.get("id").and_then(Value::as_str).is_some_and(is_kept)
            })
            .cloned()
            .collect();
        let results: Vec<Value> = results
            .iter()
            .map(|(id, text)| json!({"type": "tool_result", "tool_use_id": id, "content": text}))
            .collect();
        let turn = [
            json!({"role": "assistant", "content": content}),
            json!({"role": "user", "content": results}),
        ];
        append(sent, "messages", &turn)
    }

    fn prepend(&self, earlier: &Value, answer: &mut Value) {
        let is = |b: &Value, kind: &str| b.get("type").and_then(Value::as_str) == Some(kind);
        let shown: Vec<Value> = blocks(earlier)
            .filter(|b| !is(b, "tool_use"))
            .cloned()
            .collect();
        let texted = shown.iter().any(|b| {
            is(b, "text")
                && b.get("text")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
        });
        if let Some(content) = answer.get_mut("content").and_then(Value::as_array_mut)
            && texted
        {
            content.splice(0..0, shown);
        }
    }

    fn strip_own_calls(&self, answer: &mut Value) {
        if let Some(content) = answer.get_mut("content").and_then(Value::as_array_mut) {
            content.retain(|b| !names_own(b, "/name"));
            let left = content
                .iter()
                .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"));
            if !left && answer.get("stop_reason").and_then(Value::as_str) == Some("tool_use") {
                answer["stop_reason"] = json!("end_turn");
            }
        }
    }
}

impl StreamEdit for Messages {
    fn gather(&self, g: &mut Gather, data: &Value) -> Decision {
        stream::gather(g, data)
    }

    fn filter(&self, f: &mut Filter, data: &mut Value) -> Edit {
        stream::filter(f, data)
    }
}

impl Summarize for Messages {
    fn summary_call(
        &self,
        model: &str,
        prompt: &str,
        max_tokens: u64,
        _max_field: &str,
    ) -> (&'static str, Value) {
        let body = json!({
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        });
        ("/messages", body)
    }

    /// The client's `anthropic-version`, or the one condense speaks.
    fn summary_headers(&self, client: Option<&http::HeaderMap>, out: &mut http::HeaderMap) {
        let version = client
            .and_then(|c| c.get(ANTHROPIC_VERSION))
            .cloned()
            .unwrap_or(http::HeaderValue::from_static("2023-06-01"));
        out.insert(ANTHROPIC_VERSION, version);
    }

    /// The text blocks joined; `max_tokens` as the stop reason is chat's
    /// `length`.
    fn summary_answer(&self, v: &Value) -> Result<Summarized, String> {
        if !v.get("content").is_some_and(Value::is_array) {
            return Err("no content".to_string());
        }
        let content: Vec<&str> = blocks(v)
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect();
        let finish_reason = v.get("stop_reason").and_then(Value::as_str).map(|r| {
            match r {
                "max_tokens" => "length",
                other => other,
            }
            .to_string()
        });
        let u = v
            .get("usage")
            .and_then(|u| serde_json::from_value::<AnthropicUsage>(u.clone()).ok());
        Ok(Summarized {
            content: content.join(""),
            finish_reason,
            prompt_tokens: u.as_ref().and_then(AnthropicUsage::prompt),
            completion_tokens: u.and_then(|u| u.output_tokens),
        })
    }
}

impl Api for Messages {
    fn parse(&self, body: &Bytes) -> Result<Parsed, NotUnderstood> {
        let req = MessagesRequest::parse(body).map_err(NotUnderstood::parse)?;
        if !req.well_formed() {
            return Err(NotUnderstood::IllFormed);
        }
        let (conversation, origins) = req.view();
        Ok(Parsed {
            conversation,
            writer: Box::new(Rewrite {
                api: &Messages,
                req,
                origins,
            }),
        })
    }

    fn provider(&self) -> Provider {
        Provider::Anthropic
    }

    fn parses_into_a_view(&self) -> bool {
        true
    }
}

impl Rewritable for MessagesRequest {
    type Origins = Origins;
    type Error = request::WriteError;

    fn is_stream(&self) -> bool {
        MessagesRequest::is_stream(self)
    }

    fn source(&self) -> &Bytes {
        MessagesRequest::source(self)
    }

    fn write_back(&self, origins: &Origins, fates: &Fates) -> Result<Bytes, request::WriteError> {
        MessagesRequest::write_back(self, origins, fates)
    }
}
