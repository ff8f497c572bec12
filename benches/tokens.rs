//! Token counting cost on real agent conversations: cold (empty cache),
//! warm (the same history plus one new message, as an agent re-sends it),
//! and the cheap path that skips tokenizing.
//!
//! Run: `cargo bench --bench tokens`. Reads the django conversation from
//! `../shared/traces/` when it is there (it is internal material and not
//! part of this repository); a 128k-token conversation is made by joining
//! the shared traces, or synthesized when they are absent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use condense::chat::ChatRequest;
use condense::config::Config;
use condense::metrics::Metrics;
use condense::tokens::{Encoding, TokenService, upper_bound};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};

const TRACES: &str = "../shared/traces/conversations";

fn trace(name: &str) -> Option<Value> {
    let text = std::fs::read_to_string(Path::new(TRACES).join(name)).ok()?;
    serde_json::from_str(&text).ok()
}

fn synthetic(tokens: u64) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
    let mut i = 0;
    loop {
        let body = json!({"model": "gpt-4o", "messages": messages});
        let req = ChatRequest::parse(&Bytes::from(body.to_string())).unwrap();
        if condense::tokens::count_request(&req, Encoding::O200k) >= tokens {
            return body;
        }
        for _ in 0..50 {
            let id = format!("call_{i}");
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": format!("{{\"cmd\":\"sed -n 1,80p src/mod_{i}.rs\"}}")}}]}));
            let out: String = (0..60)
                .map(|l| {
                    format!(
                        "{l:>4}  let v{i}_{l} = parse_field(&input[{l}..], Kind::K{}); // {i}\n",
                        l % 7
                    )
                })
                .collect();
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
            i += 1;
        }
    }
}

/// About 128k o200k tokens: the shared traces joined, else synthetic.
fn big_conversation() -> Value {
    let parts = ["oh_django-14351.json", "oh_requests-1921.json"];
    let loaded: Vec<Value> = parts.iter().filter_map(|p| trace(p)).collect();
    if loaded.len() < 2 {
        return synthetic(128_000);
    }
    let mut messages: Vec<Value> = Vec::new();
    for t in &loaded {
        messages.extend(t["messages"].as_array().unwrap().iter().cloned());
    }
    let mut body = loaded[0].clone();
    loop {
        body["messages"] = Value::Array(messages.clone());
        let req = ChatRequest::parse(&Bytes::from(body.to_string())).unwrap();
        if condense::tokens::count_request(&req, Encoding::O200k) <= 128_000 {
            return body;
        }
        messages.pop();
    }
}

fn bench_conversation(c: &mut Criterion, label: &str, body: &Value) {
    let bytes = Bytes::from(body.to_string());
    let req = ChatRequest::parse(&bytes).unwrap();
    let total = condense::tokens::count_request(&req, Encoding::O200k);
    println!(
        "{label}: {} messages, {} bytes, {total} tokens",
        req.messages().len(),
        bytes.len()
    );
    let config = Arc::new(Config::default());
    let mut group = c.benchmark_group(label);
    group.sample_size(10);
    group.throughput(Throughput::Elements(total));
    group.bench_function("cold count", |b| {
        b.iter_batched(
            || TokenService::new(config.clone(), &Metrics::new().unwrap()),
            |svc| svc.count(&req, Encoding::O200k).total,
            BatchSize::LargeInput,
        )
    });
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("parse", |b| {
        b.iter(|| ChatRequest::parse(&bytes).unwrap().messages().len())
    });

    // Warm: the cache holds the history; each iteration adds a message never
    // seen before, as the next turn of an agent does.
    let svc = TokenService::new(config.clone(), &Metrics::new().unwrap());
    svc.count(&req, Encoding::O200k);
    let turn = AtomicU64::new(0);
    let mut base = body.clone();
    group.sample_size(50);
    group.throughput(Throughput::Elements(1));
    group.bench_function("warm count (+1 new message)", |b| {
        b.iter_batched(
            || {
                let n = turn.fetch_add(1, Ordering::Relaxed);
                base["messages"].as_array_mut().unwrap().push(json!({"role": "user", "content": format!("Turn {n}: now run the test suite again and report failures.")}));
                let r = ChatRequest::parse(&Bytes::from(base.to_string())).unwrap();
                base["messages"].as_array_mut().unwrap().pop();
                r
            },
            |r| svc.count(&r, Encoding::O200k).total,
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    Encoding::warm_up();
    let django = trace("oh_django-14351.json").unwrap_or_else(|| synthetic(70_000));
    bench_conversation(c, "django (~70k tokens)", &django);
    bench_conversation(c, "128k tokens", &big_conversation());

    let small = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Summarize the attached notes in three bullet points, please."}]});
    let bytes = Bytes::from(small.to_string());
    let req = ChatRequest::parse(&bytes).unwrap();
    let svc = TokenService::new(Arc::new(Config::default()), &Metrics::new().unwrap());
    let mut group = c.benchmark_group("small request");
    group.bench_function("cheap path (assess, not tokenized)", |b| {
        b.iter(|| {
            let a = svc.assess("u", &req, &bytes, true);
            assert!(a.cheap_path);
            a.tokens
        })
    });
    group.bench_function("upper bound only", |b| b.iter(|| upper_bound(&bytes)));
    group.bench_function("tokenized (assess, no cheap path, cached)", |b| {
        b.iter(|| svc.assess("u", &req, &bytes, false).tokens)
    });
    group.finish();
}

criterion_group!(tokens, benches);
criterion_main!(tokens);
