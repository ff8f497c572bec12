//! The usage tap: reads `usage` from chat responses as they pass, without
//! holding back what the client is waiting for.
//!
//! condense always asks streamed requests for `stream_options.include_usage`
//! because the upstream's own prompt token count is what calibrates condense's
//! estimate. A client that did not ask for usage must not see the difference,
//! so for it the tap drops the usage-only chunk (`"choices":[]`) and the
//! `"usage":null` field the upstream then adds to every other chunk.
//!
//! Some upstreams put more than usage on that chunk when asked for it, and
//! on the last chunk otherwise: llama.cpp's `timings`. So the tap holds the
//! chunk that finishes a choice until the next event: when that is the
//! usage-only chunk, the fields it has and the held chunk lacks (other than
//! `usage` and `choices`) are moved onto the held chunk, which then goes out.
//! The client receives what the upstream would have sent it had condense not
//! asked for usage.

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;
use serde::Deserialize;

use crate::chat::RawObject;
use crate::chat::object::members;
use crate::wire::Format;

/// Token usage as the upstream reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub total_tokens: u64,
}

/// Anthropic's usage object: the prompt is split into uncached, cache-read
/// and cache-written parts, which together are what the window holds.
#[derive(Debug, Default, Deserialize)]
struct AnthropicUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
}

impl AnthropicUsage {
    fn prompt(&self) -> Option<u64> {
        let parts = [
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ];
        parts
            .iter()
            .any(Option::is_some)
            .then(|| parts.iter().flatten().sum())
    }
}

impl Usage {
    /// Reads `usage` from a response object, when present and not null.
    fn from_object(obj: &RawObject) -> Option<Usage> {
        Usage::chat(obj.get("usage")?)
    }

    /// A chat `usage` value (None when it is null).
    fn chat(raw: &[u8]) -> Option<Usage> {
        serde_json::from_slice::<Option<Usage>>(raw).ok()?
    }

    /// An Anthropic `usage` value.
    fn anthropic(raw: &[u8]) -> Option<Usage> {
        let u: AnthropicUsage = serde_json::from_slice(raw).ok()?;
        let prompt = u.prompt()?;
        let completion = u.output_tokens.unwrap_or(0);
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        })
    }

    /// A `usage` value in `format`'s shape.
    fn of_format(format: Format, raw: &[u8]) -> Option<Usage> {
        match format {
            Format::Chat => Usage::chat(raw),
            Format::Messages => Usage::anthropic(raw),
            Format::Responses => Usage::responses(raw),
        }
    }

    /// A Responses `usage` value: `input_tokens` is the whole prompt
    /// (cached tokens included), `output_tokens` the completion.
    fn responses(raw: &[u8]) -> Option<Usage> {
        #[derive(Deserialize)]
        struct R {
            input_tokens: u64,
            #[serde(default)]
            output_tokens: u64,
        }
        let r: R = serde_json::from_slice::<Option<R>>(raw).ok()??;
        Some(Usage {
            prompt_tokens: r.input_tokens,
            completion_tokens: r.output_tokens,
            total_tokens: r.input_tokens + r.output_tokens,
        })
    }

    /// Reads `usage` from a complete non-streamed JSON response body.
    pub fn from_json_body(body: &Bytes) -> Option<Usage> {
        Usage::from_object(&RawObject::parse(body).ok()?)
    }

    /// A streamed Anthropic event's usage, from its data: `message_start`
    /// carries the prompt's in its message, `message_delta` the
    /// completion's (and, from some servers, the prompt's again); `seen` is
    /// what came before.
    fn from_anthropic_event(data: &[u8], seen: Option<Usage>) -> Option<Usage> {
        if let Some(message) = member(data, "message").flatten() {
            return Usage::anthropic(member(message, "usage").flatten()?);
        }
        let u: AnthropicUsage = serde_json::from_slice(member(data, "usage").flatten()?).ok()?;
        let before = seen.unwrap_or_default();
        let prompt = u.prompt().unwrap_or(before.prompt_tokens);
        let completion = u.output_tokens.unwrap_or(before.completion_tokens);
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        })
    }
}

/// Splits a Server-Sent-Events byte stream into events, reads usage from them
/// and, when `strip` is set, removes what the client did not ask for.
///
/// Linear in the stream's length (each byte is scanned for an event end
/// once) and bounded in memory: an event longer than [`MAX_EVENT_BYTES`]
/// ends the tap. What it holds is passed on, the rest of the stream is
/// relayed untouched, and its usage goes unread.
pub struct SseTap {
    format: Format,
    strip: bool,
    pending: BytesMut,
    /// Bytes of `pending` already scanned for an event end.
    scanned: usize,
    usage: Option<Usage>,
    /// Whether the `data: [DONE]` event went by.
    done: bool,
    /// Set once an over-long event ended the tap.
    ended: bool,
    /// When stripping: the last event that finished a choice, not yet sent.
    held: Option<Bytes>,
}

/// The longest SSE event the tap holds (a chat chunk is a few hundred
/// bytes; a whole answer in one event a few hundred kilobytes).
pub const MAX_EVENT_BYTES: usize = 4 << 20;

impl SseTap {
    /// A chat stream's tap; with `strip`, the usage condense asked for is
    /// taken out again.
    pub fn new(strip: bool) -> SseTap {
        SseTap::for_format(Format::Chat, strip)
    }

    pub fn for_format(format: Format, strip: bool) -> SseTap {
        SseTap {
            format,
            strip,
            pending: BytesMut::new(),
            scanned: 0,
            usage: None,
            done: false,
            ended: false,
            held: None,
        }
    }

    pub fn format(&self) -> Format {
        self.format
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
        !self.ended && (self.strip || self.pending.is_empty())
    }

    /// Takes a chunk from the upstream; returns the bytes to send the client
    /// now. Without stripping the chunk passes through as it is (only a copy
    /// of an unfinished event is kept for scanning); with stripping, complete
    /// events are sent and an unfinished one waits for its end.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        if self.ended {
            return chunk;
        }
        self.pending.extend_from_slice(&chunk);
        let mut out = if self.strip {
            BytesMut::with_capacity(chunk.len())
        } else {
            BytesMut::new()
        };
        while let Some(end) = find_event_end(&self.pending, self.scanned) {
            let event = self.pending.split_to(end);
            self.scanned = 0;
            self.process(&event, &mut out);
        }
        // The end of an event can straddle chunks: rescan the last two
        // bytes with the next chunk, never what came before them.
        self.scanned = self.pending.len().saturating_sub(2);
        if self.pending.len() > MAX_EVENT_BYTES {
            tracing::warn!(
                bytes = self.pending.len(),
                "an SSE event is longer than the tap reads; relaying the rest of the stream unread"
            );
            self.ended = true;
            let rest = self.pending.split();
            self.pending = BytesMut::new();
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
            out.extend_from_slice(&self.pending.split());
        }
        out.freeze()
    }

    /// The held event, to be sent before anything condense adds itself.
    pub fn take_held(&mut self) -> Option<Bytes> {
        self.held.take()
    }

    fn flush_held(&mut self, out: &mut BytesMut) {
        if let Some(h) = self.held.take() {
            out.extend_from_slice(&h);
        }
    }

    /// The usage seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Reads one complete event and, when stripping, appends to `out` what
    /// the client gets for it.
    fn process(&mut self, event: &[u8], out: &mut BytesMut) {
        if self.format == Format::Responses {
            // The last event carries the response, usage and all.
            if let Some((end, _)) = needles().ends.iter().find(|(_, f)| f.find(event).is_some()) {
                self.done = true;
                if end == b"response.completed" || end == b"response.incomplete" {
                    let usage = data_of(event).and_then(|data| {
                        let response = member(&data, "response").flatten()?;
                        Usage::responses(member(response, "usage").flatten()?)
                    });
                    if usage.is_some() {
                        self.usage = usage;
                    }
                }
            }
            return;
        }
        if self.format == Format::Messages {
            // Nothing is stripped from an Anthropic stream: it always
            // reports usage.
            if needles().message_stop.find(event).is_some() {
                self.done = true;
            }
            if needles().usage.find(event).is_some()
                && let Some(data) = data_of(event)
                && let Some(u) = Usage::from_anthropic_event(&data, self.usage)
            {
                self.usage = Some(u);
            }
            return;
        }
        let n = needles();
        if n.done.find(event).is_some() || n.done_tight.find(event).is_some() {
            self.done = true;
        }
        let mentions_usage = n.usage.find(event).is_some();
        // The usual chunk of a stream that reports usage: `"usage":null`,
        // read and (when stripping) cut out without parsing the chunk.
        if mentions_usage && let Some(cut) = null_usage(event) {
            if self.strip {
                let event = match cut {
                    Some(cut) => [&event[..cut.start], &event[cut.end..]].concat().into(),
                    None => Bytes::copy_from_slice(event),
                };
                let finishing = finishes(&event);
                self.pass(event, finishing, out);
            }
            return;
        }
        let parsed = if mentions_usage {
            parse_event(event)
        } else {
            None
        };
        let usage = parsed.as_ref().and_then(|(_, o)| Usage::from_object(o));
        if usage.is_some() {
            self.usage = usage;
        }
        if !self.strip {
            return;
        }
        let Some((text, mut obj)) = parsed else {
            self.pass(Bytes::copy_from_slice(event), finishes(event), out);
            return;
        };
        if usage.is_some() && obj.get("choices") == Some(b"[]") {
            // The usage-only chunk the client did not ask for: dropped, its
            // other fields moved onto the chunk that finished the answer.
            if let Some(held) = self.held.take() {
                out.extend_from_slice(&merge_extra_fields(held, &obj));
            }
            return;
        }
        let event = if obj.get("usage") == Some(b"null") {
            obj.remove("usage");
            rebuild_event(text, &obj.to_vec())
        } else {
            Bytes::copy_from_slice(event)
        };
        let finishing = finishes(&event);
        self.pass(event, finishing, out);
    }

    /// Sends an event after the held one; an event that finishes a choice
    /// is held instead until the next one.
    fn pass(&mut self, event: Bytes, finishing: bool, out: &mut BytesMut) {
        self.flush_held(out);
        if finishing {
            self.held = Some(event);
        } else {
            out.extend_from_slice(&event);
        }
    }
}

/// For an event whose data (one `data:` line) is a JSON object with a
/// top-level `"usage":null` or no top-level `usage`: the bytes of `event` to
/// cut to take that member out (with its comma), or None when there is none.
/// None (the outer one) for anything else (data on several lines, not an
/// object by its structure, a usage that is not null, a key written with
/// escapes, the member twice): the caller parses the event then.
///
/// An OpenAI stream asked for usage puts `"usage":null` on every chunk:
/// parsing each to learn that, and writing it out again without the
/// member, cost several times what walking its members does.
fn null_usage(event: &[u8]) -> Option<Option<std::ops::Range<usize>>> {
    let (offset, data) = single_data_line(event)?;
    // OpenAI's own chunks end with it, written compactly. In a JSON object
    // that ends `,"usage":null}`, that is the last top-level member: a
    // nested one would be followed by another closing bracket, and a
    // quote inside a string is escaped (`\"`). Mentioned once, and with
    // no `\u` escape that could spell the key another way, it is the only
    // one; no need to walk the members.
    const TAIL: &[u8] = b",\"usage\":null}";
    let trimmed = data.trim_ascii_end();
    let n = needles();
    if trimmed.ends_with(TAIL)
        && data.trim_ascii_start().starts_with(b"{")
        && n.usage.find_iter(data).nth(1).is_none()
        && n.unicode_escape.find(data).is_none()
    {
        let start = offset + trimmed.len() - TAIL.len();
        return Some(Some(start..start + TAIL.len() - 1));
    }
    let mut found = None;
    let mut twice = false;
    members(data, |key, value| {
        if key == "usage" {
            twice |= found.is_some();
            found = Some(value);
        }
    })?;
    if twice {
        return None;
    }
    let Some(value) = found else {
        return Some(None);
    };
    if value != b"null" {
        return None;
    }
    // Where the value sits in `data`, then its key (written plainly) and
    // the comma before it, or else the one after it.
    let value_start = (value.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
    let value_end = value_start + value.len();
    let before = data[..value_start].trim_ascii_end().strip_suffix(b":")?;
    let key_start = before.trim_ascii_end().strip_suffix(b"\"usage\"")?.len();
    let head = data[..key_start].trim_ascii_end();
    let cut = match head.strip_suffix(b",") {
        Some(kept) => kept.trim_ascii_end().len()..value_end,
        // The first member: up to the next one's key.
        None => match data[value_end..].trim_ascii_start().strip_prefix(b",") {
            Some(next) => key_start..data.len() - next.trim_ascii_start().len(),
            None => key_start..value_end,
        },
    };
    Some(Some(offset + cut.start..offset + cut.end))
}

/// An event's one `data:` line, as the offset of its data in `event` and
/// the data (after `data:` and one space, without the line end); None
/// when the event has no data line or several.
fn single_data_line(event: &[u8]) -> Option<(usize, &[u8])> {
    let mut found = None;
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', event).chain(std::iter::once(event.len()));
    for end in ends {
        let line = event.get(start..end)?;
        let line_start = start;
        start = end + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(data) = line.strip_prefix(b"data:") {
            if found.is_some() {
                return None;
            }
            let (skip, data) = match data.strip_prefix(b" ") {
                Some(d) => (6, d),
                None => (5, data),
            };
            found = Some((line_start + skip, data));
        }
    }
    found
}

/// What the tap looks for in events, each searcher built once: building
/// one (`memmem::find` does, every call) cost more than searching a chunk
/// with it, and several searches run on every event of a stream.
struct Needles {
    usage: Finder<'static>,
    done: Finder<'static>,
    done_tight: Finder<'static>,
    message_stop: Finder<'static>,
    /// The Responses events that end a stream.
    ends: [(&'static [u8], Finder<'static>); 3],
    finish_reason: Finder<'static>,
    finish_null: Finder<'static>,
    finish_null_spaced: Finder<'static>,
    unicode_escape: Finder<'static>,
}

fn needles() -> &'static Needles {
    static NEEDLES: LazyLock<Needles> = LazyLock::new(|| {
        let end = |e: &'static [u8]| (e, Finder::new(e));
        Needles {
            usage: Finder::new(b"\"usage\""),
            done: Finder::new(b"data: [DONE]"),
            done_tight: Finder::new(b"data:[DONE]"),
            message_stop: Finder::new(b"message_stop"),
            ends: [
                end(b"response.completed"),
                end(b"response.incomplete"),
                end(b"response.failed"),
            ],
            finish_reason: Finder::new(b"\"finish_reason\""),
            finish_null: Finder::new(b"\"finish_reason\":null"),
            finish_null_spaced: Finder::new(b"\"finish_reason\": null"),
            unicode_escape: Finder::new(b"\\u"),
        }
    });
    &NEEDLES
}

/// An event's data: borrowed when it is on one `data:` line, as it is in
/// practice, else its lines joined.
fn data_of(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    match single_data_line(event) {
        Some((_, data)) => Some(data.into()),
        None => event_data(event).map(|(_, data)| data.into_bytes().into()),
    }
}

/// The value of the top-level member `key` of the JSON object `raw` (the
/// last one, if it is there twice; None inside when there is none), found
/// by walking the members: nothing of an answer is copied or parsed to read
/// its usage. None when `raw` is not a JSON object by its structure.
fn member<'a>(raw: &'a [u8], key: &str) -> Option<Option<&'a [u8]>> {
    let mut found = None;
    members(raw, |k, v| {
        if k == key {
            found = Some(v);
        }
    })?;
    Some(found)
}

/// The data of an SSE event as a JSON object, with the event's text.
fn parse_event(event: &[u8]) -> Option<(&str, RawObject)> {
    let (text, data) = event_data(event)?;
    Some((text, RawObject::parse(&Bytes::from(data)).ok()?))
}

/// An SSE event's text and its data (its `data:` lines joined).
pub(crate) fn event_data(event: &[u8]) -> Option<(&str, String)> {
    let text = std::str::from_utf8(event).ok()?;
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n");
    Some((text, data))
}

/// Whether an event finishes a choice: it has a `finish_reason` that is not
/// null.
fn finishes(event: &[u8]) -> bool {
    let n = needles();
    let all = n.finish_reason.find_iter(event).count();
    if all == 0 {
        return false;
    }
    let null =
        n.finish_null.find_iter(event).count() + n.finish_null_spaced.find_iter(event).count();
    all > null
}

/// Fields every chunk of an OpenAI-style stream carries: a usage chunk with
/// no others has nothing to move, and the held chunk need not be parsed.
const CHUNK_FIELDS: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "system_fingerprint",
    "service_tier",
    "obfuscation",
    "choices",
    "usage",
];

/// `held` with the top-level fields of `usage_chunk` it lacks added (not
/// `usage`, not `choices`); unchanged when there are none.
fn merge_extra_fields(held: Bytes, usage_chunk: &RawObject) -> Bytes {
    if usage_chunk.keys().all(|k| CHUNK_FIELDS.contains(&k)) {
        return held;
    }
    let Some((text, mut obj)) = parse_event(&held) else {
        return held;
    };
    let extra: Vec<&str> = usage_chunk
        .keys()
        .filter(|k| !matches!(*k, "usage" | "choices") && obj.get(k).is_none())
        .collect();
    if extra.is_empty() {
        return held;
    }
    for k in extra {
        if let Some(v) = usage_chunk.get(k) {
            obj.set(k, Bytes::copy_from_slice(v));
        }
    }
    rebuild_event(text, &obj.to_vec())
}

/// The event with its data lines replaced by one `data:` line holding `json`.
pub(crate) fn rebuild_event(text: &str, json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(text.len());
    let mut data_written = false;
    for line in text.lines().filter(|l| !l.is_empty()) {
        if line.starts_with("data:") {
            if !data_written {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(json);
                out.push(b'\n');
                data_written = true;
            }
        } else {
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
    }
    out.push(b'\n');
    Bytes::from(out)
}

/// The index just past the blank line that ends the first event, if any,
/// looking from `from` on.
pub(crate) fn find_event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut from = from;
    while let Some(i) = memchr::memchr(b'\n', &buf[from..]).map(|i| i + from) {
        match (buf.get(i + 1), buf.get(i + 2)) {
            (Some(b'\n'), _) => return Some(i + 2),
            (Some(b'\r'), Some(b'\n')) => return Some(i + 3),
            _ => from = i + 1,
        }
    }
    None
}

/// Keeps a bounded copy of a JSON response body to read its usage at the end.
pub struct JsonTap {
    format: Format,
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

    pub fn new(expected_len: Option<u64>) -> JsonTap {
        JsonTap::for_format(Format::Chat, expected_len)
    }

    pub fn for_format(format: Format, expected_len: Option<u64>) -> JsonTap {
        JsonTap {
            format,
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
            Some(usage) => self.usage = usage.and_then(|u| Usage::of_format(self.format, u)),
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CHUNK: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n";
    const USAGE: &str = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":2,\"total_tokens\":13}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn run(tap: &mut SseTap, chunks: &[&str]) -> String {
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&tap.push(Bytes::copy_from_slice(c.as_bytes())));
        }
        out.extend_from_slice(&tap.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn responses_usage_comes_from_the_body_or_the_completed_event() {
        let body = Bytes::from_static(br#"{"id":"resp_1","object":"response","usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":800},"output_tokens":12,"total_tokens":912}}"#);
        let mut t = JsonTap::for_format(Format::Responses, Some(body.len() as u64));
        t.push(&body);
        t.finish();
        assert_eq!(t.usage().unwrap().prompt_tokens, 900);
        let stream = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null},\"sequence_number\":0}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":77,\"output_tokens\":5,\"total_tokens\":82}},\"sequence_number\":2}\n\n",
        );
        let mut tap = SseTap::for_format(Format::Responses, false);
        assert_eq!(run(&mut tap, &[stream]), stream);
        assert_eq!(tap.usage().unwrap().prompt_tokens, 77);
        assert!(tap.saw_done());
    }

    #[test]
    fn usage_is_read_from_incomplete_responses_and_data_on_several_lines_not_from_failed_ones() {
        let ev = |kind: &str, n: u64| {
            format!(
                "event: {kind}\ndata: {{\"type\":\"{kind}\",\"response\":{{\"output\":[],\"usage\":{{\"input_tokens\":{n},\"output_tokens\":1}}}}}}\n\n"
            )
        };
        for (kind, read) in [("response.incomplete", Some(40)), ("response.failed", None)] {
            let mut tap = SseTap::for_format(Format::Responses, false);
            let stream = ev(kind, 40);
            assert_eq!(run(&mut tap, &[&stream]), stream);
            assert_eq!(tap.usage().map(|u| u.prompt_tokens), read, "{kind}");
            assert!(tap.saw_done());
        }
        // Data split over several `data:` lines is joined.
        let split = "event: response.completed\ndata: {\"type\":\"response.completed\",\ndata: \"response\":{\"usage\":{\"input_tokens\":9}}}\n\n";
        let mut tap = SseTap::for_format(Format::Responses, false);
        run(&mut tap, &[split]);
        assert_eq!(tap.usage().map(|u| u.prompt_tokens), Some(9));
        let split = "event: message_start\ndata: {\"type\":\"message_start\",\ndata: \"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
        let mut tap = SseTap::for_format(Format::Messages, false);
        run(&mut tap, &[split]);
        assert_eq!(tap.usage().map(|u| u.prompt_tokens), Some(5));
    }

    #[test]
    fn anthropic_usage_counts_cache_reads_and_writes_as_prompt() {
        let body = Bytes::from_static(br#"{"id":"msg_1","type":"message","usage":{"input_tokens":12,"cache_creation_input_tokens":100,"cache_read_input_tokens":3000,"output_tokens":7}}"#);
        let mut t = JsonTap::for_format(Format::Messages, Some(body.len() as u64));
        t.push(&body);
        t.finish();
        let u = t.usage().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (3112, 7));

        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":20,\"cache_read_input_tokens\":500,\"cache_creation_input_tokens\":null,\"output_tokens\":1}}}\n\n",
            "event: ping\ndata: {\"type\":\"ping\"}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"usage\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":42}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let mut tap = SseTap::for_format(Format::Messages, false);
        let (a, b) = stream.split_at(100);
        // The client gets the stream byte for byte.
        assert_eq!(run(&mut tap, &[a, b]), stream);
        let u = tap.usage().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (520, 42));
        assert!(tap.saw_done());
    }

    #[test]
    fn stripping_removes_usage_chunk_and_null_usage_fields() {
        let mut tap = SseTap::new(true);
        let out = run(&mut tap, &[CHUNK, USAGE, DONE]);
        assert_eq!(
            out,
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n"
        );
        assert_eq!(tap.usage().unwrap().prompt_tokens, 11);
    }

    #[test]
    fn a_null_usage_is_cut_out_wherever_it_sits_and_nothing_else_changes() {
        // (event, what the client gets): the usage member goes with one
        // comma; the rest, the event's other lines and its line ends stay.
        let cases = [
            (
                "data: {\"id\":\"c\",\"choices\":[],\"usage\":null}\n\n",
                "data: {\"id\":\"c\",\"choices\":[]}\n\n",
            ),
            (
                "data: {\"usage\":null,\"id\":\"c\"}\n\n",
                "data: {\"id\":\"c\"}\n\n",
            ),
            ("data:{\"usage\":null}\n\n", "data:{}\n\n"),
            (
                "event: chunk\r\ndata: { \"id\" : \"c\" , \"usage\" : null }\r\n\r\n",
                "event: chunk\r\ndata: { \"id\" : \"c\" }\r\n\r\n",
            ),
            (
                "data: {\"usage\" :null , \"id\":\"c\"}\n\n",
                "data: {\"id\":\"c\"}\n\n",
            ),
            // Only the top level's: a nested one, or one inside a string,
            // is content.
            (
                "data: {\"x\":{\"usage\":null},\"t\":\"\\\"usage\\\":null\",\"usage\":null}\n\n",
                "data: {\"x\":{\"usage\":null},\"t\":\"\\\"usage\\\":null\"}\n\n",
            ),
            (
                "data: {\"x\":{\"usage\":null}}\n\n",
                "data: {\"x\":{\"usage\":null}}\n\n",
            ),
        ];
        for (event, expected) in cases {
            let mut tap = SseTap::new(true);
            assert_eq!(run(&mut tap, &[event]), expected, "{event}");
            assert!(tap.usage().is_none());
        }
        // Where the chunk is read by parsing it (data on two lines, the
        // member twice), the usage goes too.
        for event in [
            "data: {\"id\":\"c\",\ndata: \"usage\":null}\n\n",
            "data: {\"id\":\"c\",\"usage\":null,\"usage\":null}\n\n",
        ] {
            let mut tap = SseTap::new(true);
            assert_eq!(
                run(&mut tap, &[event]),
                "data: {\"id\":\"c\"}\n\n",
                "{event}"
            );
        }
        // Not an object: passed on as it came.
        let broken = "data: {\"id\":\"c\",\"usage\":null\n\n";
        assert_eq!(run(&mut SseTap::new(true), &[broken]), broken);
    }

    /// A chunk's members, as (key, value) JSON texts: keys that repeat
    /// across chunks, values that mention usage where it is content.
    fn member() -> impl Strategy<Value = (String, String)> {
        let keys = prop::sample::select(vec!["id", "usage", "choices", "a", "z"]);
        let values = prop::sample::select(vec![
            "null",
            "1",
            "\"x\"",
            "\"usage\"",
            "\"\\\"usage\\\":null}\"",
            "\"a\\\\\"",
            "{\"usage\":null}",
            "[{\"usage\":null},{\"b\":[]}]",
            "{\"a\":{\"usage\":null}}",
            "{\"us\\u0061ge\":1}",
        ]);
        (keys, values).prop_map(|(k, v)| (format!("\"{k}\""), v.to_string()))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Whatever the chunk, stripping takes out a top-level null usage
        /// and nothing else; a chunk without one passes byte for byte.
        #[test]
        fn stripping_takes_out_a_top_level_null_usage_and_nothing_else(
            members in prop::collection::vec(member(), 0..6),
            usage_at in prop::option::of(0usize..6),
            escaped_at in prop::option::of(0usize..6),
            spaces in prop::collection::vec(prop::sample::select(vec!["", " ", "\t"]), 16),
            named in proptest::bool::ANY,
            crlf in proptest::bool::ANY,
            tight in proptest::bool::ANY,
        ) {
            let mut members: Vec<(String, String)> = members;
            members.dedup_by(|a, b| a.0 == b.0);
            members.retain(|(k, _)| k != "\"usage\"");
            if let Some(at) = usage_at {
                members.insert(at.min(members.len()), ("\"usage\"".into(), "null".into()));
            }
            // The same key spelled with an escape.
            if let Some(at) = escaped_at {
                members.insert(at.min(members.len()), ("\"us\\u0061ge\"".into(), "null".into()));
            }
            let ws = |i: usize| spaces[i % spaces.len()];
            let body = members
                .iter()
                .enumerate()
                .map(|(i, (k, v))| format!("{}{k}{}:{}{v}{}", ws(i), ws(i + 3), ws(i + 5), ws(i + 7)))
                .collect::<Vec<_>>()
                .join(",");
            let end = if crlf { "\r\n" } else { "\n" };
            let name = if named { format!("event: chunk{end}") } else { String::new() };
            let field = if tight { "data:" } else { "data: " };
            let event = format!("{name}{field}{}{{{body}}}{}{end}{end}", ws(1), ws(2));
            let mut tap = SseTap::new(true);
            let out = run(&mut tap, &[&event]);
            prop_assert!(tap.usage().is_none());
            // The members, in order and with their bytes, as the parser
            // reads them (duplicates included).
            let data = |e: &str| -> RawObject {
                let line = e.lines().find_map(|l| l.strip_prefix("data:")).unwrap();
                RawObject::parse(&Bytes::copy_from_slice(line.as_bytes())).unwrap()
            };
            // A chunk that never spells "usage" plainly is not looked at.
            if !event.contains("\"usage\"") || data(&event).get("usage").is_none() {
                prop_assert_eq!(out, event);
            } else {
                let mut expected = data(&event);
                expected.remove("usage");
                prop_assert_eq!(data(&out).to_vec(), expected.to_vec());
                // The event's other lines stay (where the chunk is parsed,
                // it is written again with `\n` line ends).
                let others = |e: &str| -> Vec<String> {
                    e.lines().filter(|l| !l.starts_with("data:")).map(str::to_string).collect()
                };
                prop_assert_eq!(others(&out), others(&event));
                prop_assert!(out.ends_with(&format!("{end}{end}")) || out.ends_with("\n\n"), "{}", out);
            }
        }
    }

    #[test]
    fn without_stripping_bytes_pass_unchanged_and_usage_is_read() {
        let mut tap = SseTap::new(false);
        let all = format!("{CHUNK}{USAGE}{DONE}");
        // Split inside the usage event to exercise reassembly.
        let (a, b) = all.split_at(CHUNK.len() + 20);
        assert_eq!(run(&mut tap, &[a, b]), all);
        assert_eq!(tap.usage().unwrap().total_tokens, 13);
    }

    #[test]
    fn events_split_across_chunks_and_crlf_are_handled() {
        let mut tap = SseTap::new(true);
        let usage = USAGE.replace("\n\n", "\r\n\r\n");
        let (a, b) = usage.split_at(17);
        let out = run(&mut tap, &[": keep-alive\n\n", a, b, DONE]);
        assert_eq!(out, ": keep-alive\n\ndata: [DONE]\n\n");
        assert_eq!(tap.usage().unwrap().completion_tokens, 2);
    }

    #[test]
    fn usage_inside_a_content_chunk_is_kept() {
        // Some upstreams put usage on the last content chunk; it is content,
        // so it is never dropped.
        let ev = "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":5}}\n\n";
        let mut tap = SseTap::new(true);
        assert_eq!(run(&mut tap, &[ev]), ev);
        assert_eq!(tap.usage().unwrap().prompt_tokens, 5);
    }

    #[test]
    fn a_long_stream_is_scanned_once_and_an_over_long_event_ends_the_tap() {
        // One byte at a time: each push scans only the new byte.
        let mut tap = SseTap::new(true);
        let all = format!("{CHUNK}{USAGE}{DONE}");
        let parts: Vec<String> = all.chars().map(String::from).collect();
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        let out = run(&mut tap, &refs);
        assert!(
            out.ends_with(DONE) && !out.contains("prompt_tokens"),
            "{out}"
        );
        assert_eq!(tap.usage().unwrap().prompt_tokens, 11);

        // An event without end: held only up to the limit, then passed on.
        let mut tap = SseTap::new(true);
        let mut sent = 0;
        let line = Bytes::from(vec![b'x'; 1 << 20]);
        tap.push(Bytes::from_static(b"data: "));
        for _ in 0..8 {
            sent += tap.push(line.clone()).len();
            assert!(tap.pending.len() <= MAX_EVENT_BYTES + line.len());
        }
        assert!(tap.ended());
        assert_eq!(sent, 6 + 8 * line.len(), "every byte reached the client");
        assert_eq!(
            &tap.push(Bytes::from_static(USAGE.as_bytes()))[..],
            USAGE.as_bytes()
        );
    }

    #[test]
    fn fields_beside_usage_move_onto_the_finishing_chunk() {
        // llama.cpp with include_usage: `timings` rides on the usage chunk;
        // without it, on the chunk with the finish_reason.
        let fin = "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"id\":\"c\",\"usage\":null}\n\n";
        let usage = "data: {\"choices\":[],\"id\":\"c\",\"usage\":{\"prompt_tokens\":9},\"timings\":{\"prompt_ms\":1.5}}\n\n";
        let mut tap = SseTap::new(true);
        let out = run(&mut tap, &[CHUNK, fin, usage, DONE]);
        assert_eq!(
            out,
            format!(
                "{}data: {{\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}],\"id\":\"c\",\"timings\":{{\"prompt_ms\":1.5}}}}\n\n{DONE}",
                CHUNK.replace(",\"usage\":null", "")
            )
        );
        assert_eq!(tap.usage().unwrap().prompt_tokens, 9);
        // OpenAI: nothing beside usage that the last chunk lacks; bytes as
        // before.
        let mut tap = SseTap::new(true);
        let out = run(&mut tap, &[fin, USAGE, DONE]);
        assert_eq!(out, format!("{}{DONE}", fin.replace(",\"usage\":null", "")));
        // A stream that ends after the finishing chunk still sends it.
        let mut tap = SseTap::new(true);
        assert_eq!(run(&mut tap, &[fin]), fin.replace(",\"usage\":null", ""));
    }

    #[test]
    fn json_tap_reads_usage() {
        let mut t = JsonTap::new(None);
        t.push(&Bytes::from_static(br#"{"id":"x","choices":[],"#));
        t.push(&Bytes::from_static(
            br#""usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
        ));
        assert_eq!(t.usage(), None, "usage is read when the body is complete");
        t.finish();
        assert_eq!(t.usage().unwrap().completion_tokens, 4);
        assert_eq!(JsonTap::new(None).usage(), None);
        // With a known length the tap tells when the last byte passed, in
        // one chunk or several; a body in one chunk is kept, not copied.
        let body = Bytes::from_static(br#"{"usage":{"prompt_tokens":9}}"#);
        let mut t = JsonTap::new(Some(body.len() as u64));
        t.push(&body);
        assert!(t.complete());
        assert!(
            t.whole
                .as_ref()
                .is_some_and(|w| w.as_ptr() == body.as_ptr())
        );
        t.finish();
        assert_eq!(t.usage().unwrap().prompt_tokens, 9);
        let mut t = JsonTap::new(Some(body.len() as u64));
        t.push(&body.slice(..5));
        assert!(!t.complete());
        t.push(&body.slice(5..));
        assert!(t.complete());
        t.finish();
        assert_eq!(t.usage().unwrap().prompt_tokens, 9);
        // Past the limit nothing is kept, and the usage stays unknown.
        let mut t = JsonTap::new(None);
        t.push(&Bytes::from(vec![b' '; JsonTap::MAX_BYTES]));
        t.push(&body);
        t.finish();
        assert_eq!((t.usage(), t.invalid()), (None, false));
    }

    /// What the tap reads from a complete body of `format`: its usage, and
    /// whether it counts as invalid.
    fn tapped(format: Format, body: &str) -> (Option<Usage>, bool) {
        let body = Bytes::copy_from_slice(body.as_bytes());
        let mut t = JsonTap::for_format(format, Some(body.len() as u64));
        t.push(&body);
        t.finish();
        (t.usage(), t.invalid())
    }

    #[test]
    fn json_tap_reads_only_the_top_level_usage_of_each_format() {
        let u = |p, c| {
            Some(Usage {
                prompt_tokens: p,
                completion_tokens: c,
                total_tokens: p + c,
            })
        };
        let chat = r#"{"id":"c","choices":[{"message":{"content":"\"usage\": {\"prompt_tokens\":1}","usage":{"prompt_tokens":2}}}],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}"#;
        assert_eq!(tapped(Format::Chat, chat), (u(7, 1), false));
        // With duplicate keys the last counts, as in the parsers.
        let twice = r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#;
        assert_eq!(tapped(Format::Chat, twice), (u(5, 2), false));
        assert_eq!(tapped(Format::Chat, r#"{"usage":null}"#), (None, false));
        assert_eq!(tapped(Format::Chat, r#" { "id" : "x" } "#), (None, false));
        let messages = r#"{"type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":3,"cache_read_input_tokens":10,"output_tokens":2}}"#;
        assert_eq!(tapped(Format::Messages, messages), (u(13, 2), false));
        let responses = r#"{"object":"response","output":[],"usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":800},"output_tokens":12,"total_tokens":912}}"#;
        assert_eq!(tapped(Format::Responses, responses), (u(900, 12), false));
    }

    #[test]
    fn a_body_that_is_not_a_json_object_is_invalid() {
        for body in [
            "<html>oops</html> not json",
            "",
            "   ",
            r#"{"usage":{"prompt_tokens":3}"#,
            r#"{"id":"x","usage":{"prompt_tokens":3}} trailing"#,
            r#"{"id":"unterminated}"#,
            r#"[{"usage":{"prompt_tokens":3}}]"#,
            r#""a string""#,
            r#"{"id" "x"}"#,
            r#"{"id":"x",}"#,
        ] {
            for format in [Format::Chat, Format::Messages, Format::Responses] {
                assert_eq!(tapped(format, body), (None, true), "{body:?}");
            }
        }
        // A multi-byte character cut in two.
        let body = Bytes::from_static(b"{\"content\":\"\xc3\",\"usage\":{\"prompt_tokens\":3}}");
        let mut t = JsonTap::new(Some(body.len() as u64));
        t.push(&body);
        t.finish();
        assert_eq!((t.usage(), t.invalid()), (None, true));
    }
}
