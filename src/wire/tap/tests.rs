use super::*;
use crate::chat::RawObject;
use crate::wire::Format;
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
    let mut t = JsonTap::new(Format::Responses.api(), Some(body.len() as u64));
    t.push(&body);
    t.finish();
    assert_eq!(t.usage().unwrap().prompt_tokens, 900);
    let stream = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null},\"sequence_number\":0}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\n",
        "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":77,\"output_tokens\":5,\"total_tokens\":82}},\"sequence_number\":2}\n\n",
    );
    let mut tap = SseTap::new(Format::Responses.api(), false);
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
        let mut tap = SseTap::new(Format::Responses.api(), false);
        let stream = ev(kind, 40);
        assert_eq!(run(&mut tap, &[&stream]), stream);
        assert_eq!(tap.usage().map(|u| u.prompt_tokens), read, "{kind}");
        assert!(tap.saw_done());
    }
    // Data split over several `data:` lines is joined.
    let split = "event: response.completed\ndata: {\"type\":\"response.completed\",\ndata: \"response\":{\"usage\":{\"input_tokens\":9}}}\n\n";
    let mut tap = SseTap::new(Format::Responses.api(), false);
    run(&mut tap, &[split]);
    assert_eq!(tap.usage().map(|u| u.prompt_tokens), Some(9));
    let split = "event: message_start\ndata: {\"type\":\"message_start\",\ndata: \"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n";
    let mut tap = SseTap::new(Format::Messages.api(), false);
    run(&mut tap, &[split]);
    assert_eq!(tap.usage().map(|u| u.prompt_tokens), Some(5));
}

#[test]
fn anthropic_usage_counts_cache_reads_and_writes_as_prompt() {
    let body = Bytes::from_static(br#"{"id":"msg_1","type":"message","usage":{"input_tokens":12,"cache_creation_input_tokens":100,"cache_read_input_tokens":3000,"output_tokens":7}}"#);
    let mut t = JsonTap::new(Format::Messages.api(), Some(body.len() as u64));
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
    let mut tap = SseTap::new(Format::Messages.api(), false);
    let (a, b) = stream.split_at(100);
    // The client gets the stream byte for byte.
    assert_eq!(run(&mut tap, &[a, b]), stream);
    let u = tap.usage().unwrap();
    assert_eq!((u.prompt_tokens, u.completion_tokens), (520, 42));
    assert!(tap.saw_done());
}

#[test]
fn stripping_removes_usage_chunk_and_null_usage_fields() {
    let mut tap = SseTap::new(Format::Chat.api(), true);
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
        let mut tap = SseTap::new(Format::Chat.api(), true);
        assert_eq!(run(&mut tap, &[event]), expected, "{event}");
        assert!(tap.usage().is_none());
    }
    // Where the chunk is read by parsing it (data on two lines, the
    // member twice), the usage goes too.
    for event in [
        "data: {\"id\":\"c\",\ndata: \"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"usage\":null,\"usage\":null}\n\n",
    ] {
        let mut tap = SseTap::new(Format::Chat.api(), true);
        assert_eq!(
            run(&mut tap, &[event]),
            "data: {\"id\":\"c\"}\n\n",
            "{event}"
        );
    }
    // Not an object: passed on as it came.
    let broken = "data: {\"id\":\"c\",\"usage\":null\n\n";
    assert_eq!(
        run(&mut SseTap::new(Format::Chat.api(), true), &[broken]),
        broken
    );
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
        let mut tap = SseTap::new(Format::Chat.api(), true);
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
    let mut tap = SseTap::new(Format::Chat.api(), false);
    let all = format!("{CHUNK}{USAGE}{DONE}");
    // Split inside the usage event to exercise reassembly.
    let (a, b) = all.split_at(CHUNK.len() + 20);
    assert_eq!(run(&mut tap, &[a, b]), all);
    assert_eq!(tap.usage().unwrap().total_tokens, 13);
}

#[test]
fn events_split_across_chunks_and_crlf_are_handled() {
    let mut tap = SseTap::new(Format::Chat.api(), true);
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
    let mut tap = SseTap::new(Format::Chat.api(), true);
    assert_eq!(run(&mut tap, &[ev]), ev);
    assert_eq!(tap.usage().unwrap().prompt_tokens, 5);
}

#[test]
fn a_long_stream_is_scanned_once_and_an_over_long_event_ends_the_tap() {
    // One byte at a time: each push scans only the new byte.
    let mut tap = SseTap::new(Format::Chat.api(), true);
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
    let mut tap = SseTap::new(Format::Chat.api(), true);
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
    let mut tap = SseTap::new(Format::Chat.api(), true);
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
    let mut tap = SseTap::new(Format::Chat.api(), true);
    let out = run(&mut tap, &[fin, USAGE, DONE]);
    assert_eq!(out, format!("{}{DONE}", fin.replace(",\"usage\":null", "")));
    // A stream that ends after the finishing chunk still sends it.
    let mut tap = SseTap::new(Format::Chat.api(), true);
    assert_eq!(run(&mut tap, &[fin]), fin.replace(",\"usage\":null", ""));
}

#[test]
fn json_tap_reads_usage() {
    let mut t = JsonTap::new(Format::Chat.api(), None);
    t.push(&Bytes::from_static(br#"{"id":"x","choices":[],"#));
    t.push(&Bytes::from_static(
        br#""usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
    ));
    assert_eq!(t.usage(), None, "usage is read when the body is complete");
    t.finish();
    assert_eq!(t.usage().unwrap().completion_tokens, 4);
    assert_eq!(JsonTap::new(Format::Chat.api(), None).usage(), None);
    // With a known length the tap tells when the last byte passed, in
    // one chunk or several; a body in one chunk is kept, not copied.
    let body = Bytes::from_static(br#"{"usage":{"prompt_tokens":9}}"#);
    let mut t = JsonTap::new(Format::Chat.api(), Some(body.len() as u64));
    t.push(&body);
    assert!(t.complete());
    assert!(
        t.whole
            .as_ref()
            .is_some_and(|w| w.as_ptr() == body.as_ptr())
    );
    t.finish();
    assert_eq!(t.usage().unwrap().prompt_tokens, 9);
    let mut t = JsonTap::new(Format::Chat.api(), Some(body.len() as u64));
    t.push(&body.slice(..5));
    assert!(!t.complete());
    t.push(&body.slice(5..));
    assert!(t.complete());
    t.finish();
    assert_eq!(t.usage().unwrap().prompt_tokens, 9);
    // Past the limit nothing is kept, and the usage stays unknown.
    let mut t = JsonTap::new(Format::Chat.api(), None);
    t.push(&Bytes::from(vec![b' '; JsonTap::MAX_BYTES]));
    t.push(&body);
    t.finish();
    assert_eq!((t.usage(), t.invalid()), (None, false));
}

/// What the tap reads from a complete body of `format`: its usage, and
/// whether it counts as invalid.
fn tapped(format: Format, body: &str) -> (Option<Usage>, bool) {
    let body = Bytes::copy_from_slice(body.as_bytes());
    let mut t = JsonTap::new(format.api(), Some(body.len() as u64));
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
    let mut t = JsonTap::new(Format::Chat.api(), Some(body.len() as u64));
    t.push(&body);
    t.finish();
    assert_eq!((t.usage(), t.invalid()), (None, true));
}
