//! Responses streams: usage read from the event that ends the stream
//! (`response.completed`, `response.incomplete`), and condense's tools in a
//! streamed answer.

use std::sync::LazyLock;

use bytes::BytesMut;
use memchr::memmem::Finder;
use serde_json::{Value, json};

use crate::wire::sse::data_of;
use crate::wire::stream::{Decision, Edit, Filter, Gather, ours, str_at};
use crate::wire::tap::{SseTap, member};
use crate::wire::usage::Usage;
use serde::Deserialize;

/// A Responses `usage` value: `input_tokens` is the whole prompt (cached
/// tokens included), `output_tokens` the completion.
pub(super) fn usage(raw: &[u8]) -> Option<Usage> {
    #[derive(Deserialize)]
    struct R {
        input_tokens: u64,
        #[serde(default)]
        output_tokens: u64,
    }
    let r: R = serde_json::from_slice::<Option<R>>(raw).ok()??;
    Some(Usage::of(r.input_tokens, r.output_tokens))
}

/// The events that end a stream, each searcher built once.
fn ends() -> &'static [(&'static [u8], Finder<'static>); 3] {
    static ENDS: LazyLock<[(&'static [u8], Finder<'static>); 3]> = LazyLock::new(|| {
        let end = |e: &'static [u8]| (e, Finder::new(e));
        [
            end(b"response.completed"),
            end(b"response.incomplete"),
            end(b"response.failed"),
        ]
    });
    &ENDS
}

/// Reads one event of a Responses stream: the last one carries the
/// response, usage and all.
pub(super) fn tap_event(tap: &mut SseTap, event: &[u8], _out: &mut BytesMut) {
    if let Some((end, _)) = ends().iter().find(|(_, f)| f.find(event).is_some()) {
        tap.done = true;
        if end == b"response.completed" || end == b"response.incomplete" {
            let usage = data_of(event).and_then(|data| {
                let response = member(&data, "response").flatten()?;
                usage(member(response, "usage").flatten()?)
            });
            if usage.is_some() {
                tap.usage = usage;
            }
        }
    }
}

pub(super) fn gather(g: &mut Gather, data: &Value) -> Decision {
    match data.get("type").and_then(Value::as_str) {
        Some("response.output_item.added") => {
            let item = data.get("item").unwrap_or(&Value::Null);
            match str_at(item, "/type") {
                Some("function_call") if ours(str_at(item, "/name")) => Decision::Ours,
                Some("reasoning") => Decision::Hold,
                _ => Decision::Pass,
            }
        }
        Some("response.completed" | "response.incomplete" | "response.failed") => {
            g.value = data.get("response").cloned().unwrap_or(Value::Null);
            Decision::Pass
        }
        Some("error") => Decision::Pass,
        _ => Decision::Hold,
    }
}

pub(super) fn filter(f: &mut Filter, data: &mut Value) -> Edit {
    let kind = data
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let kind = kind.as_str();
    let index = data.get("output_index").and_then(Value::as_u64);
    if f.first_id.is_none() {
        f.first_id = data.pointer("/response/id").cloned();
    }
    // An event that carries one of condense's calls (`added`, or a
    // `done` without it) goes, and takes its output index with it.
    if str_at(data, "/item/type") == Some("function_call") {
        if ours(str_at(data, "/item/name")) {
            f.drop(index);
            return Edit::Drop;
        }
        if kind == "response.output_item.added" {
            f.client_calls = true;
        }
    }
    // A later round's start is not shown.
    if f.round > 0 && matches!(kind, "response.created" | "response.in_progress") {
        return Edit::Drop;
    }
    let mut changed = false;
    // The whole response (`response.completed`, `incomplete`, `failed`).
    if data
        .pointer("/response/output")
        .is_some_and(Value::is_array)
    {
        changed |= f.usage(data.pointer_mut("/response/usage"));
        if let Some(output) = data
            .pointer_mut("/response/output")
            .and_then(Value::as_array_mut)
        {
            let before = output.len();
            output.retain(|i| {
                !(str_at(i, "/type") == Some("function_call") && ours(str_at(i, "/name")))
            });
            changed |= output.len() != before;
            // It holds every item the client saw, of every round.
            if !f.output.is_empty() {
                output.splice(0..0, f.output.iter().cloned());
                changed = true;
            }
        }
        if f.round > 0
            && let (Some(first), Some(id)) = (&f.first_id, data.pointer_mut("/response/id"))
            && id != first
        {
            *id = first.clone();
            changed = true;
        }
    } else {
        match f.reindex(data, "output_index", index) {
            Edit::Drop => return Edit::Drop,
            edit => changed |= edit == Edit::Changed,
        }
    }
    // The events the client gets are numbered without a gap where one was
    // taken out, and later rounds' on from the first round's.
    if let Some(seq) = data.get("sequence_number").and_then(Value::as_u64) {
        let next = *f.next_seq.get_or_insert(seq);
        if seq != next {
            data["sequence_number"] = json!(next);
            changed = true;
        }
        f.next_seq = Some(next.saturating_add(1));
    }
    if kind == "response.completed" {
        // Held: another round may go on from here.
        if f.continuable {
            if let Some(output) = data.pointer("/response/output").and_then(Value::as_array) {
                f.round_output = output[f.output.len().min(output.len())..].to_vec();
            }
            // Its number is the next round's, should it be dropped.
            if let Some(next) = f.next_seq.as_mut() {
                *next = next.saturating_sub(1);
            }
        }
        return f.end(changed);
    }
    if changed { Edit::Changed } else { Edit::Keep }
}
