//! The usage tap: reads `usage` from responses as they pass, without
//! holding back what the client is waiting for. What is read from which
//! event, and what is stripped, is each API's own (`TapRead`); the
//! framing, the bounds and the held event are here.
//!
//! condense always asks streamed chat requests for
//! `stream_options.include_usage` because the upstream's own prompt token
//! count is what calibrates condense's estimate. A client that did not ask
//! for usage must not see the difference, so for it the tap strips what
//! condense asked for (see `wire::chat::stream`).

use bytes::{Bytes, BytesMut};

use super::failure::Errors;
use super::sse::Reader;
use super::usage::Usage;
use crate::chat::object::members;

/// What the tap asks of an API: where its responses say their usage, and
/// what it strips from its streams (and, for the relay, how its errors
/// look).
pub trait TapRead: Errors {
    /// A `usage` value of this API's responses.
    fn usage(&self, raw: &[u8]) -> Option<Usage>;

    /// Reads one whole stream event on its way through the usage tap,
    /// appending to `out` what the client gets for it when the tap strips.
    fn tap_event(&self, tap: &mut SseTap, event: &[u8], out: &mut BytesMut);
}

/// Splits a Server-Sent-Events byte stream into events, reads usage from them
/// and, when `strip` is set, removes what the client did not ask for.
///
/// Linear in the stream's length (each byte is scanned for an event end
/// once) and bounded in memory: an event longer than [`MAX_EVENT_BYTES`]
/// ends the tap. What it holds is passed on, the rest of the stream is
/// relayed untouched, and its usage goes unread.
pub struct SseTap {
    api: &'static dyn TapRead,
    pub(super) strip: bool,
    reader: Reader,
    pub(super) usage: Option<Usage>,
    /// Whether the stream's last event went by (`data: [DONE]`,
    /// Anthropic's `message_stop`, the Responses end events).
    pub(super) done: bool,
    /// Set once an over-long event ended the tap.
    ended: bool,
    /// When stripping: the last event that finished a choice, not yet sent.
    pub(super) held: Option<Bytes>,
}

/// The longest SSE event the tap holds (a chat chunk is a few hundred
/// bytes; a whole answer in one event a few hundred kilobytes).
pub const MAX_EVENT_BYTES: usize = 4 << 20;

impl SseTap {
    /// A stream's tap; with `strip`, the usage condense asked for is taken
    /// out again.
    pub fn new(api: &'static dyn TapRead, strip: bool) -> SseTap {
        SseTap {
            api,
            strip,
            reader: Reader::default(),
            usage: None,
            done: false,
            ended: false,
            held: None,
        }
    }

    /// The API of the stream.
    pub fn api(&self) -> &'static dyn TapRead {
        self.api
    }

    /// Whether the stream ended properly, with `data: [DONE]` (Anthropic:
    /// `message_stop`).
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// Whether an over-long event ended the tap.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Whether the client has been sent whole events only, so an event
    /// condense adds starts cleanly.
    pub fn at_event_boundary(&self) -> bool {
        !self.ended && (self.strip || self.reader.pending() == 0)
    }

    /// Takes a chunk from the upstream; returns the bytes to send the client
    /// now. Without stripping the chunk passes through as it is (only a copy
    /// of an unfinished event is kept for scanning); with stripping, complete
    /// events are sent and an unfinished one waits for its end.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        if self.ended {
            return chunk;
        }
        self.reader.push(&chunk);
        let mut out = if self.strip {
            BytesMut::with_capacity(chunk.len())
        } else {
            BytesMut::new()
        };
        let api = self.api;
        while let Some(event) = self.reader.next_event() {
            api.tap_event(self, &event, &mut out);
        }
        if self.reader.pending() > MAX_EVENT_BYTES {
            tracing::warn!(
                bytes = self.reader.pending(),
                "an SSE event is longer than the tap reads; relaying the rest of the stream unread"
            );
            self.ended = true;
            let rest = self.reader.take_rest();
            self.reader = Reader::default();
            if self.strip {
                self.flush_held(&mut out);
                out.extend_from_slice(&rest);
            }
        }
        if self.strip { out.freeze() } else { chunk }
    }

    /// The stream ended: returns what is still held back (an unterminated
    /// last event is passed on as it is).
    pub fn finish(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        self.flush_held(&mut out);
        if self.strip {
            out.extend_from_slice(&self.reader.take_rest());
        }
        out.freeze()
    }

    /// The held event, to be sent before anything condense adds itself.
    pub fn take_held(&mut self) -> Option<Bytes> {
        self.held.take()
    }

    /// Sends an event after the held one; an event that finishes a choice
    /// is held instead until the next one.
    pub(super) fn pass(&mut self, event: Bytes, finishing: bool, out: &mut BytesMut) {
        self.flush_held(out);
        if finishing {
            self.held = Some(event);
        } else {
            out.extend_from_slice(&event);
        }
    }

    pub(super) fn flush_held(&mut self, out: &mut BytesMut) {
        if let Some(h) = self.held.take() {
            out.extend_from_slice(&h);
        }
    }

    /// The usage seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// The usage of a whole stream already read (a round condense answered
    /// itself).
    pub fn usage_of_stream(api: &'static dyn TapRead, stream: &Bytes) -> Option<Usage> {
        let mut tap = SseTap::new(api, false);
        tap.push(stream.clone());
        tap.finish();
        tap.usage()
    }
}

/// The value of the top-level member `key` of the JSON object `raw` (the
/// last one, if it is there twice; None inside when there is none), found
/// by walking the members: nothing of an answer is copied or parsed to read
/// its usage. None when `raw` is not a JSON object by its structure.
pub(super) fn member<'a>(raw: &'a [u8], key: &str) -> Option<Option<&'a [u8]>> {
    let mut found = None;
    members(raw, |k, v| {
        if k == key {
            found = Some(v);
        }
    })?;
    Some(found)
}

/// Keeps a bounded copy of a JSON response body to read its usage at the end.
pub struct JsonTap {
    api: &'static dyn TapRead,
    /// The body so far, when it came in several chunks.
    buf: BytesMut,
    /// The body, when it came in one chunk (the usual small answer): kept,
    /// not copied.
    whole: Option<Bytes>,
    overflowed: bool,
    usage: Option<Usage>,
    /// The upstream's Content-Length. The server stops polling a body once
    /// that many bytes went out, so the end of the stream may never be seen:
    /// [`JsonTap::complete`] tells when the last byte passed.
    expected_len: Option<u64>,
    seen: u64,
    finished: bool,
    /// The complete body was not a JSON object.
    invalid: bool,
}

impl JsonTap {
    /// Bodies larger than this are not inspected (usage is then unknown).
    const MAX_BYTES: usize = 8 * 1024 * 1024;

    pub fn new(api: &'static dyn TapRead, expected_len: Option<u64>) -> JsonTap {
        JsonTap {
            api,
            buf: BytesMut::new(),
            whole: None,
            overflowed: false,
            usage: None,
            expected_len,
            seen: 0,
            finished: false,
            invalid: false,
        }
    }

    /// The usage of a whole JSON body already read.
    pub fn usage_of_body(api: &'static dyn TapRead, body: &Bytes) -> Option<Usage> {
        let mut tap = JsonTap::new(api, Some(body.len() as u64));
        tap.push(body);
        tap.finish();
        tap.usage()
    }

    /// Keeps a chunk of the body; nothing is read until [`JsonTap::finish`].
    pub fn push(&mut self, chunk: &Bytes) {
        self.seen += chunk.len() as u64;
        let held = self.buf.len() + self.whole.as_ref().map_or(0, Bytes::len);
        if self.overflowed || held + chunk.len() > Self::MAX_BYTES {
            self.overflowed = true;
            self.buf = BytesMut::new();
            self.whole = None;
            return;
        }
        if held == 0 && self.expected_len == Some(self.seen) {
            self.whole = Some(chunk.clone());
            return;
        }
        if let Some(first) = self.whole.take() {
            self.buf.extend_from_slice(&first);
        }
        self.buf.extend_from_slice(chunk);
    }

    /// Whether the last byte the upstream announced has passed.
    pub fn complete(&self) -> bool {
        self.expected_len == Some(self.seen)
    }

    /// The body is complete: read its usage (once; not on every chunk).
    pub fn finish(&mut self) {
        let body = match self.whole.take() {
            Some(whole) => whole,
            None => self.buf.split().freeze(),
        };
        self.read(&body);
    }

    /// Reads the complete body's usage. The body's members are found by
    /// their delimiters (`members`), and only `usage` is parsed: a full
    /// parse of a small answer cost about 7,000 instructions a request, on
    /// the client's time. A body that is not UTF-8 or not a JSON object by
    /// its structure (an HTML page, a truncated or empty body, an array) is
    /// invalid; errors inside an object's values (a `NaN`, a bad escape, a
    /// raw line break in a string) are not looked for.
    fn read(&mut self, body: &[u8]) {
        if self.finished || self.overflowed {
            return;
        }
        self.finished = true;
        match std::str::from_utf8(body)
            .ok()
            .and_then(|_| member(body, "usage"))
        {
            Some(usage) => self.usage = usage.and_then(|u| self.api.usage(u)),
            None => self.invalid = true,
        }
    }

    /// Whether the complete body was not a JSON object.
    pub fn invalid(&self) -> bool {
        self.invalid
    }

    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }
}

#[cfg(test)]
mod tests;
