//! The usage tap: reads `usage` from responses as they pass, without
//! holding back what the client is waiting for. What is read from which
//! event, and what is stripped, is each API's own (`Api::tap_event`); the
//! framing, the bounds and the held event are here.
//!
//! condense always asks streamed chat requests for
//! `stream_options.include_usage` because the upstream's own prompt token
//! count is what calibrates condense's estimate. A client that did not ask
//! for usage must not see the difference, so for it the tap strips what
//! condense asked for (see `wire::chat::stream`).

use bytes::{Bytes, BytesMut};

use super::Format;
use super::sse::Reader;
use super::usage::Usage;
use crate::chat::object::members;

/// Splits a Server-Sent-Events byte stream into events, reads usage from them
/// and, when `strip` is set, removes what the client did not ask for.
///
/// Linear in the stream's length (each byte is scanned for an event end
/// once) and bounded in memory: an event longer than [`MAX_EVENT_BYTES`]
/// ends the tap. What it holds is passed on, the rest of the stream is
/// relayed untouched, and its usage goes unread.
pub struct SseTap {
    format: Format,
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
    pub fn new(format: Format, strip: bool) -> SseTap {
        SseTap {
            format,
            strip,
            reader: Reader::default(),
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
        let api = self.format.api();
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
    pub fn usage_of_stream(format: Format, stream: &Bytes) -> Option<Usage> {
        let mut tap = SseTap::new(format, false);
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

    pub fn new(format: Format, expected_len: Option<u64>) -> JsonTap {
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

    /// The usage of a whole JSON body already read.
    pub fn usage_of_body(format: Format, body: &Bytes) -> Option<Usage> {
        let mut tap = JsonTap::new(format, Some(body.len() as u64));
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
            Some(usage) => self.usage = usage.and_then(|u| self.format.api().usage(u)),
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
    use crate::chat::RawObject;
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
        let mut t = JsonTap::new(Format::Responses, Some(body.len() as u64));
        t.push(&body);
        t.finish();
        assert_eq!(t.usage().unwrap().prompt_tokens, 900);
        let stream = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null},\"sequence_number\":0}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":77,\"output_tokens\":5,\"total_tokens\":82}},\"sequence_number\":2}\n\n",
        );
        let mut tap = SseTap::new(Format::Responses, false);
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
            let mut tap = SseTap::new(Format::Responses, false);
            let stream = ev(kind, 40);
            assert_eq!(run(&mut tap, &[&stream]), stream);
            assert_eq!(tap.usage().map(|u| u.prompt_tokens), read, "{kind}");
            assert!(tap.saw_done());
        }
        // Data split over several `data:` lines is joined.
        let split = "event: response.completed\ndata: {\"type\":\"response.completed\",\ndata: \"response\":{\"usage\":{\"input_tokens\":9}}}\n\n";
        let mut tap = SseTap::new(Format::Responses, false);
        run(&mut tap, &[split]);
        assert_eq!(tap.usage().map(|u| u.prompt_tokens), Some(9));
        let split = "event: message_start\ndata: {\"type\":\"message_start\",\ndata: \"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
        let mut tap = SseTap::new(Format::Messages, false);
        run(&mut tap, &[split]);
        assert_eq!(tap.usage().map(|u| u.prompt_tokens), Some(5));
    }

    #[test]
    fn anthropic_usage_counts_cache_reads_and_writes_as_prompt() {
        let body = Bytes::from_static(br#"{"id":"msg_1","type":"message","usage":{"input_tokens":12,"cache_creation_input_tokens":100,"cache_read_input_tokens":3000,"output_tokens":7}}"#);
        let mut t = JsonTap::new(Format::Messages, Some(body.len() as u64));
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
        let mut tap = SseTap::new(Format::Messages, false);
        let (a, b) = stream.split_at(100);
        // The client gets the stream byte for byte.
        assert_eq!(run(&mut tap, &[a, b]), stream);
        let u = tap.usage().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (520, 42));
        assert!(tap.saw_done());
    }

    #[test]
    fn stripping_removes_usage_chunk_and_null_usage_fields() {
        let mut tap = SseTap::new(Format::Chat, true);
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
            let mut tap = SseTap::new(Format::Chat, true);
            assert_eq!(run(&mut tap, &[event]), expected, "{event}");
            assert!(tap.usage().is_none());
        }
        // Where the chunk is read by parsing it (data on two lines, the
        // member twice), the usage goes too.
        for event in [
            "data: {\"id\":\"c\",\ndata: \"usage\":null}\n\n",
            "data: {\"id\":\"c\",\"usage\":null,\"usage\":null}\n\n",
        ] {
            let mut tap = SseTap::new(Format::Chat, true);
            assert_eq!(
                run(&mut tap, &[event]),
                "data: {\"id\":\"c\"}\n\n",
                "{event}"
            );
        }
        // Not an object: passed on as it came.
        let broken = "data: {\"id\":\"c\",\"usage\":null\n\n";
        assert_eq!(run(&mut SseTap::new(Format::Chat, true), &[broken]), broken);
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
            let mut tap = SseTap::new(Format::Chat, true);
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
        let mut tap = SseTap::new(Format::Chat, false);
        let all = format!("{CHUNK}{USAGE}{DONE}");
        // Split inside the usage event to exercise reassembly.
        let (a, b) = all.split_at(CHUNK.len() + 20);
        assert_eq!(run(&mut tap, &[a, b]), all);
        assert_eq!(tap.usage().unwrap().total_tokens, 13);
    }

    #[test]
    fn events_split_across_chunks_and_crlf_are_handled() {
        let mut tap = SseTap::new(Format::Chat, true);
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
        let mut tap = SseTap::new(Format::Chat, true);
        assert_eq!(run(&mut tap, &[ev]), ev);
        assert_eq!(tap.usage().unwrap().prompt_tokens, 5);
    }

    #[test]
    fn a_long_stream_is_scanned_once_and_an_over_long_event_ends_the_tap() {
        // One byte at a time: each push scans only the new byte.
        let mut tap = SseTap::new(Format::Chat, true);
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
        let mut tap = SseTap::new(Format::Chat, true);
        let mut sent = 0;
        let line = Bytes::from(vec![b'x'; 1 << 20]);
        tap.push(Bytes::from_static(b"data: "));
        for _ in 0..8 {
            sent += tap.push(line.clone()).len();
            assert!(tap.reader.pending() <= MAX_EVENT_BYTES + line.len());
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
        let mut tap = SseTap::new(Format::Chat, true);
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
        let mut tap = SseTap::new(Format::Chat, true);
        let out = run(&mut tap, &[fin, USAGE, DONE]);
        assert_eq!(out, format!("{}{DONE}", fin.replace(",\"usage\":null", "")));
        // A stream that ends after the finishing chunk still sends it.
        let mut tap = SseTap::new(Format::Chat, true);
        assert_eq!(run(&mut tap, &[fin]), fin.replace(",\"usage\":null", ""));
    }

    #[test]
    fn json_tap_reads_usage() {
        let mut t = JsonTap::new(Format::Chat, None);
        t.push(&Bytes::from_static(br#"{"id":"x","choices":[],"#));
        t.push(&Bytes::from_static(
            br#""usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
        ));
        assert_eq!(t.usage(), None, "usage is read when the body is complete");
        t.finish();
        assert_eq!(t.usage().unwrap().completion_tokens, 4);
        assert_eq!(JsonTap::new(Format::Chat, None).usage(), None);
        // With a known length the tap tells when the last byte passed, in
        // one chunk or several; a body in one chunk is kept, not copied.
        let body = Bytes::from_static(br#"{"usage":{"prompt_tokens":9}}"#);
        let mut t = JsonTap::new(Format::Chat, Some(body.len() as u64));
        t.push(&body);
        assert!(t.complete());
        assert!(
            t.whole
                .as_ref()
                .is_some_and(|w| w.as_ptr() == body.as_ptr())
        );
        t.finish();
        assert_eq!(t.usage().unwrap().prompt_tokens, 9);
        let mut t = JsonTap::new(Format::Chat, Some(body.len() as u64));
        t.push(&body.slice(..5));
        assert!(!t.complete());
        t.push(&body.slice(5..));
        assert!(t.complete());
        t.finish();
        assert_eq!(t.usage().unwrap().prompt_tokens, 9);
        // Past the limit nothing is kept, and the usage stays unknown.
        let mut t = JsonTap::new(Format::Chat, None);
        t.push(&Bytes::from(vec![b' '; JsonTap::MAX_BYTES]));
        t.push(&body);
        t.finish();
        assert_eq!((t.usage(), t.invalid()), (None, false));
    }

    /// What the tap reads from a complete body of `format`: its usage, and
    /// whether it counts as invalid.
    fn tapped(format: Format, body: &str) -> (Option<Usage>, bool) {
        let body = Bytes::copy_from_slice(body.as_bytes());
        let mut t = JsonTap::new(format, Some(body.len() as u64));
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
        let mut t = JsonTap::new(Format::Chat, Some(body.len() as u64));
        t.push(&body);
        t.finish();
        assert_eq!((t.usage(), t.invalid()), (None, true));
    }
}
