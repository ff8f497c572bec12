//! What the usage tap costs a streamed answer, per event, in each format:
//! a 500-delta answer as an upstream streams it (one event a chunk),
//! pushed through the tap condense puts on the response.
//!
//! - chat, usage stripped: condense asked for `include_usage` and the
//!   client did not, so every chunk's `"usage":null` is taken out again
//!   (`upstream.stream_usage`, on by default);
//! - chat, usage kept: the client asked for it;
//! - chat, no usage: nobody asked (`stream_usage` off);
//! - Anthropic Messages and Responses streams (they always report usage).
//!
//! Run: `cargo bench --bench stream_tap`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use bytes::Bytes;
use condense::wire::Format;
use condense::wire::tap::SseTap;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const DELTAS: usize = 500;

fn chat(usage_null: bool, usage_chunk: bool) -> Vec<Bytes> {
    let head = r#"{"id":"chatcmpl-AbCdEf0123456789","object":"chat.completion.chunk","created":1732400000,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_831e067d82","choices":[{"index":0,"#;
    let tail = if usage_null { r#","usage":null}"# } else { "}" };
    let mut events = vec![format!(
        "data: {head}\"delta\":{{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null}},\"logprobs\":null,\"finish_reason\":null}}]{tail}\n\n"
    )];
    for i in 0..DELTAS {
        events.push(format!(
            "data: {head}\"delta\":{{\"content\":\" word{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]{tail}\n\n"
        ));
    }
    events.push(format!(
        "data: {head}\"delta\":{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}]{tail}\n\n"
    ));
    if usage_chunk {
        events.push(format!(
            "data: {{\"id\":\"chatcmpl-AbCdEf0123456789\",\"object\":\"chat.completion.chunk\",\"created\":1732400000,\"model\":\"gpt-4o-2024-08-06\",\"system_fingerprint\":\"fp_831e067d82\",\"choices\":[],\"usage\":{{\"prompt_tokens\":2500,\"completion_tokens\":{DELTAS},\"total_tokens\":{}}}}}\n\n",
            2500 + DELTAS
        ));
    }
    events.push("data: [DONE]\n\n".to_string());
    events.into_iter().map(Bytes::from).collect()
}

fn messages() -> Vec<Bytes> {
    let mut events = vec![
        r#"event: message_start
data: {"type":"message_start","message":{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":2500,"cache_creation_input_tokens":0,"cache_read_input_tokens":2000,"output_tokens":1}}}

"#.to_string(),
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n".to_string(),
    ];
    for i in 0..DELTAS {
        events.push(format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\" word{i}\"}}}}\n\n"
        ));
    }
    events.push(
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
            .to_string(),
    );
    events.push(format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\",\"stop_sequence\":null}},\"usage\":{{\"output_tokens\":{DELTAS}}}}}\n\n"));
    events.push("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_string());
    events.into_iter().map(Bytes::from).collect()
}

fn responses() -> Vec<Bytes> {
    let mut events = vec![
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null},\"sequence_number\":0}\n\n".to_string(),
    ];
    let mut text = String::new();
    for i in 0..DELTAS {
        text.push_str(&format!(" word{i}"));
        events.push(format!(
            "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\" word{i}\",\"sequence_number\":{}}}\n\n",
            i + 1
        ));
    }
    events.push(format!(
        "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"output\":[{{\"type\":\"message\",\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[{{\"type\":\"output_text\",\"text\":\"{text}\"}}]}}],\"usage\":{{\"input_tokens\":2500,\"output_tokens\":{DELTAS},\"total_tokens\":{}}}}},\"sequence_number\":{}}}\n\n",
        2500 + DELTAS,
        DELTAS + 1
    ));
    events.into_iter().map(Bytes::from).collect()
}

fn benches(c: &mut Criterion) {
    let streams = [
        ("chat, usage stripped", Format::Chat, true, chat(true, true)),
        ("chat, usage kept", Format::Chat, false, chat(true, true)),
        ("chat, no usage", Format::Chat, false, chat(false, false)),
        ("messages", Format::Messages, false, messages()),
        ("responses", Format::Responses, false, responses()),
    ];
    let mut group = c.benchmark_group("stream tap, per event");
    for (name, format, strip, events) in streams {
        // Each event is checked once: the tap must read the usage.
        let mut tap = SseTap::new(format.api(), strip);
        for e in &events {
            tap.push(e.clone());
        }
        tap.finish();
        assert!(tap.usage().is_some() || name == "chat, no usage", "{name}");
        group.throughput(Throughput::Elements(events.len() as u64));
        group.bench_function(name, |b| {
            b.iter_batched(
                || SseTap::new(format.api(), strip),
                |mut tap| {
                    let mut n = 0;
                    for e in &events {
                        n += tap.push(e.clone()).len();
                    }
                    n + tap.finish().len()
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(stream_tap, benches);
criterion_main!(stream_tap);
