//! OpenAI Responses (`/v1/responses`), stateless: the request read
//! without loss and written back (`request.rs`), its usage, its errors,
//! condense's tools in its shape, its streams (`stream.rs`), and its
//! WebSocket mode's messages and history (`socket.rs`).

mod request;
pub mod socket;
mod stream;
pub mod upstream;

pub use request::{Origins, ParseError, ResponsesRequest, WriteError};

use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use super::api::{Api, NotUnderstood, Parsed, Provider, Rewritable, Rewrite};
use super::failure::{Errors, Failure};
use super::stream::{Decision, Edit, Filter, Gather, StreamEdit};
use super::summarize::{Summarize, Summarized};
use super::tap::{SseTap, TapRead};
use super::tools::{Call, OwnTools, append, names_own, text};
use super::usage::Usage;
use crate::compaction::Fates;
use stream::usage;

/// The Responses API.
#[derive(Debug)]
pub struct Responses;

fn strip_id(item: &mut Value) {
    if let Some(o) = item.as_object_mut() {
        o.remove("id");
        o.remove("status");
    }
}

/// Whether a JSON schema's `required` names each of its `properties`.
fn every_property_required(schema: &Value) -> bool {
    let required = schema.get("required").and_then(Value::as_array);
    let named = |k: &String| required.is_some_and(|r| r.iter().any(|n| n.as_str() == Some(k)));
    schema
        .get("properties")
        .and_then(Value::as_object)
        .is_none_or(|p| p.keys().all(named))
}

impl Errors for Responses {
    fn error_body(&self, f: &Failure) -> String {
        super::chat::error_body(f.message, f.kind, f.code)
    }

    /// The Responses stream's own error event, which the SDKs raise.
    fn stream_error(&self, f: &Failure) -> String {
        let error = json!({"type": "error", "code": f.code, "message": f.message, "param": null});
        format!("event: error\ndata: {error}\n\n")
    }
}

impl TapRead for Responses {
    fn usage(&self, raw: &[u8]) -> Option<Usage> {
        usage(raw)
    }

    fn tap_event(&self, tap: &mut SseTap, event: &[u8], out: &mut BytesMut) {
        stream::tap_event(tap, event, out);
    }
}

impl OwnTools for Responses {
    fn tool(&self, name: &str, description: &str, schema: Value) -> Value {
        // Strict only when every parameter is required: OpenAI rejects a
        // strict schema with an optional one (condense_recall's range and
        // search), and left out, `strict` defaults to true here and makes
        // them mandatory. Said explicitly either way.
        let strict = every_property_required(&schema);
        json!({"type": "function", "name": name,
            "description": description, "parameters": schema, "strict": strict})
    }

    fn calls(&self, answer: &Value) -> Vec<(Call, bool)> {
        let items = answer.get("output").and_then(Value::as_array);
        let mut out = Vec::new();
        for item in items.into_iter().flatten() {
            match item.get("type").and_then(Value::as_str) {
                Some("function_call") => out.push(Call::read(
                    item.get("call_id"),
                    item.get("name"),
                    item.get("arguments"),
                )),
                Some("custom_tool_call" | "local_shell_call" | "computer_call") => out.push((
                    Call::bare(text(item.get("call_id")), text(item.get("name"))),
                    false,
                )),
                _ => {}
            }
        }
        out
    }

    fn follow_up(
        &self,
        answer: &Value,
        kept: &[Call],
        sent: &Bytes,
        results: &[(String, String)],
    ) -> Option<Bytes> {
        let is_kept = |id: &str| kept.iter().any(|c| c.id == id);
        let mut turn = Vec::new();
        for item in answer.get("output")?.as_array()? {
            let kind = item.get("type").and_then(Value::as_str).unwrap_or("");
            let mut item = item.clone();
            match kind {
                // Without its encrypted content a reasoning item
                // refers to one stored on the server, which a
                // stateless request must not.
                "reasoning" if item.get("encrypted_content").is_none_or(Value::is_null) => {
                    continue;
                }
                "reasoning" => {}
                "function_call" => {
                    let id = item.get("call_id").and_then(Value::as_str);
                    if !id.is_some_and(is_kept) {
                        continue;
                    }
                    strip_id(&mut item);
                }
                "message" => strip_id(&mut item),
                _ => continue,
            }
            turn.push(item);
        }
        for (id, text) in results {
            turn.push(json!({"type": "function_call_output", "call_id": id, "output": text}));
        }
        append(sent, "input", &turn)
    }

    fn prepend(&self, earlier: &Value, answer: &mut Value) {
        let is = |i: &Value, kind: &str| i.get("type").and_then(Value::as_str) == Some(kind);
        let shown: Vec<Value> = earlier
            .get("output")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|i| !is(i, "function_call"))
            .cloned()
            .collect();
        if let Some(output) = answer.get_mut("output").and_then(Value::as_array_mut)
            && shown.iter().any(|i| is(i, "message"))
        {
            output.splice(0..0, shown);
        }
    }

    fn strip_own_calls(&self, answer: &mut Value) {
        if let Some(output) = answer.get_mut("output").and_then(Value::as_array_mut) {
            output.retain(|i| !names_own(i, "/name"));
        }
    }
}

impl StreamEdit for Responses {
    fn gather(&self, g: &mut Gather, data: &Value) -> Decision {
        stream::gather(g, data)
    }

    fn filter(&self, f: &mut Filter, data: &mut Value) -> Edit {
        stream::filter(f, data)
    }
}

impl Summarize for Responses {
    fn summary_call(
        &self,
        model: &str,
        prompt: &str,
        max_tokens: u64,
        _max_field: &str,
    ) -> (&'static str, Value) {
        let body = json!({
            "model": model,
            "input": [{"role": "user", "content": prompt}],
            "max_output_tokens": max_tokens,
            "store": false,
        });
        ("/responses", body)
    }

    /// The output text of its messages joined; an answer left incomplete
    /// at `max_output_tokens` is chat's `length`.
    fn summary_answer(&self, v: &Value) -> Result<Summarized, String> {
        let output = v
            .get("output")
            .and_then(Value::as_array)
            .ok_or("no output")?;
        let content: Vec<&str> = output
            .iter()
            .filter(|i| i.get("type").and_then(Value::as_str) == Some("message"))
            .filter_map(|i| i.get("content").and_then(Value::as_array))
            .flatten()
            .filter(|c| c.get("type").and_then(Value::as_str) == Some("output_text"))
            .filter_map(|c| c.get("text").and_then(Value::as_str))
            .collect();
        let cut = v
            .pointer("/incomplete_details/reason")
            .and_then(Value::as_str)
            == Some("max_output_tokens");
        Ok(Summarized {
            content: content.join(""),
            finish_reason: cut.then(|| "length".to_string()),
            prompt_tokens: v.pointer("/usage/input_tokens").and_then(Value::as_u64),
            completion_tokens: v.pointer("/usage/output_tokens").and_then(Value::as_u64),
        })
    }
}

impl Api for Responses {
    fn parse(&self, body: &Bytes) -> Result<Parsed, NotUnderstood> {
        let req = ResponsesRequest::parse(body).map_err(NotUnderstood::parse)?;
        if let Some(reason) = req.stateful() {
            return Err(NotUnderstood::Stateful(reason));
        }
        if !req.well_formed() {
            return Err(NotUnderstood::IllFormed);
        }
        let (conversation, origins) = req.view();
        Ok(Parsed {
            conversation,
            writer: Box::new(Rewrite {
                api: &Responses,
                req,
                origins,
            }),
        })
    }

    fn provider(&self) -> Provider {
        Provider::OpenAi
    }

    fn parses_into_a_view(&self) -> bool {
        true
    }
}

impl Rewritable for ResponsesRequest {
    type Origins = Origins;
    type Error = request::WriteError;

    fn is_stream(&self) -> bool {
        ResponsesRequest::is_stream(self)
    }

    fn source(&self) -> &Bytes {
        ResponsesRequest::source(self)
    }

    fn write_back(&self, origins: &Origins, fates: &Fates) -> Result<Bytes, request::WriteError> {
        ResponsesRequest::write_back(self, origins, fates)
    }
}
