//! A Responses request sent over the upstream's own WebSocket, and its
//! events read back as the SSE stream the rest of condense reads.
//!
//! On a socket, a request is a `response.create` message: the fields of
//! the HTTP request at the top level, without `stream` (implicit) or
//! `background` (not supported there). The answer is one JSON message an
//! event, each with its `type`; a request refused before it started is an
//! `error` event carrying the HTTP status and error object the HTTP API
//! would have answered with.

use bytes::Bytes;
use serde::Deserialize;

use crate::chat::RawObject;

/// Fields of an HTTP request that a socket's `response.create` leaves out.
const NOT_ON_A_SOCKET: &[&str] = &["type", "stream", "background"];

/// The `response.create` message for a Responses request body (None when
/// the body is not a JSON object). The request's own fields keep their
/// order and their bytes.
pub fn create_message(body: &Bytes) -> Option<Vec<u8>> {
    let mut fields = RawObject::parse(body).ok()?;
    for key in NOT_ON_A_SOCKET {
        fields.remove(key);
    }
    let rest = fields.to_vec();
    let mut out = Vec::with_capacity(rest.len() + 32);
    out.extend_from_slice(br#"{"type":"response.create""#);
    if rest.len() > 2 {
        out.push(b',');
        out.extend_from_slice(&rest[1..]);
    } else {
        out.push(b'}');
    }
    Some(out)
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<std::borrow::Cow<'a, str>>,
    status: Option<u16>,
    #[serde(borrow)]
    error: Option<&'a serde_json::value::RawValue>,
}

/// An event message from the upstream's socket.
pub struct Framed {
    /// The event as an SSE frame (`event:` and `data:` lines).
    pub frame: Vec<u8>,
    /// Whether it ends the response.
    pub last: bool,
}

/// The SSE frame an event message is carried in over HTTP, and whether
/// the response ends with it.
pub fn sse_frame(message: &[u8]) -> Framed {
    let kind = serde_json::from_slice::<Event>(message)
        .ok()
        .and_then(|e| e.kind.map(|k| k.into_owned()))
        .unwrap_or_default();
    let last = matches!(
        kind.as_str(),
        "response.completed" | "response.failed" | "response.incomplete" | "error"
    );
    let mut frame = Vec::with_capacity(message.len() + kind.len() + 16);
    if !kind.is_empty() && !kind.contains(['\n', '\r']) {
        frame.extend_from_slice(b"event: ");
        frame.extend_from_slice(kind.as_bytes());
        frame.push(b'\n');
    }
    frame.extend_from_slice(b"data: ");
    // A JSON message holds no raw line break; any other is split as SSE
    // would carry it.
    for (i, line) in message.split(|b| *b == b'\n').enumerate() {
        if i > 0 {
            frame.extend_from_slice(b"\ndata: ");
        }
        frame.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
    }
    frame.extend_from_slice(b"\n\n");
    Framed { frame, last }
}

/// For an `error` event that came instead of a response: the status and
/// body the HTTP API answers such a request with (`{"error": {...}}`), so
/// that overflow recovery and error relaying read it as they read HTTP.
pub fn refusal(message: &[u8]) -> Option<(u16, Bytes)> {
    let e = serde_json::from_slice::<Event>(message).ok()?;
    if e.kind.as_deref() != Some("error") {
        return None;
    }
    let status = e.status.filter(|s| (400..600).contains(s)).unwrap_or(400);
    let error = e.error.map_or("null", |r| r.get());
    Some((status, Bytes::from(format!(r#"{{"error":{error}}}"#))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_becomes_a_create_message_without_stream_or_background() {
        let body = Bytes::from_static(
            br#"{"model":"gpt-5","input":[{"type":"message","role":"user","content":"hi"}],"stream":true,"store":false,"background":false}"#,
        );
        let m = create_message(&body).unwrap();
        assert_eq!(
            String::from_utf8(m).unwrap(),
            r#"{"type":"response.create","model":"gpt-5","input":[{"type":"message","role":"user","content":"hi"}],"store":false}"#
        );
        assert_eq!(
            create_message(&Bytes::from_static(br#"{"stream":true}"#)).unwrap(),
            br#"{"type":"response.create"}"#
        );
        assert!(create_message(&Bytes::from_static(b"[1]")).is_none());
    }

    #[test]
    fn events_become_sse_frames_and_the_last_ones_end_the_response() {
        let delta = sse_frame(br#"{"type":"response.output_text.delta","delta":"a"}"#);
        assert_eq!(
            delta.frame,
            b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n"
        );
        assert!(!delta.last);
        for last in [
            "response.completed",
            "response.failed",
            "response.incomplete",
            "error",
        ] {
            let m = format!(r#"{{"type":"{last}"}}"#);
            assert!(sse_frame(m.as_bytes()).last, "{last}");
        }
        // Not JSON: carried, without an event name.
        assert_eq!(sse_frame(b"x\ny").frame, b"data: x\ndata: y\n\n");
    }

    #[test]
    fn an_error_event_reads_as_the_http_apis_error() {
        let e = br#"{"type":"error","status":400,"error":{"type":"invalid_request_error","code":"context_length_exceeded","message":"Your input exceeds the context window of this model.","param":"input"}}"#;
        let (status, body) = refusal(e).unwrap();
        assert_eq!(status, 400);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(
            refusal(br#"{"type":"error","error":{"message":"x"}}"#)
                .unwrap()
                .0,
            400
        );
        assert!(refusal(br#"{"type":"response.created"}"#).is_none());
    }
}
