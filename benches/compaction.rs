//! Compaction cost on a 128k-token agent conversation in a 128k window:
//! cold (nothing cached) and warm (the same history plus one new message,
//! as the agent's next turn sends it), including measuring, planning,
//! rewriting and serializing the body.
//!
//! Also the hostile case of a tool result the agent read: 16 MB of
//! distinct path lines (each one scored and deduplicated when the result is
//! masked; this cost minutes when the paths seen were kept in a list).
//!
//! Run: `cargo bench --bench compaction`. Uses the shared traces when
//! `../shared/traces/` is beside the repository, else a synthetic session.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use condense::chat::ChatRequest;
use condense::compaction::Replacement;
use condense::config::Config;
use condense::metrics::Metrics;
use condense::pipeline::{self, Subject};
use condense::tokens::{Encoding, TokenService};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use serde_json::{Value, json};

fn conversation() -> Value {
    let dir = Path::new("../shared/traces/conversations");
    let parts: Vec<Value> = ["oh_django-14351.json", "oh_requests-1921.json"]
        .iter()
        .filter_map(|p| serde_json::from_str(&std::fs::read_to_string(dir.join(p)).ok()?).ok())
        .collect();
    let mut messages: Vec<Value> = Vec::new();
    if parts.len() == 2 {
        for p in &parts {
            messages.extend(p["messages"].as_array().unwrap().iter().cloned());
        }
    } else {
        messages.push(json!({"role": "system", "content": "You are a coding agent."}));
        messages.push(json!({"role": "user", "content": "Fix the bug."}));
        for i in 0..400 {
            let id = format!("call_{i}");
            messages.push(json!({"role": "assistant", "content": format!("Step {i}."), "tool_calls": [{"id": id, "type": "function", "function": {"name": "run", "arguments": format!("{{\"cmd\":\"cat src/m{i}.rs\"}}")}}]}));
            let out: String = (0..40)
                .map(|l| format!("{l:>4}  let v{i}_{l} = parse(&input[{l}..]);\n"))
                .collect();
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
        }
    }
    let mut body = json!({"model": "gpt-4o", "messages": []});
    loop {
        body["messages"] = Value::Array(messages.clone());
        let req = ChatRequest::parse(&Bytes::from(body.to_string())).unwrap();
        if condense::tokens::count_request(&req, Encoding::O200k) <= 128_000 {
            return body;
        }
        messages.pop();
    }
}

/// A conversation whose one tool result is `lines` distinct path lines
/// (400k lines: 16 MB), answered, so that it is masked.
fn distinct_paths(lines: usize) -> Bytes {
    let out: String = (0..lines)
        .map(|i| format!("src/module_{i}/sub_{}/file_{i}.py: ok\n", i * 7))
        .collect();
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Look at the tree."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{\"cmd\":\"find .\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": out},
        {"role": "assistant", "content": "Seen it."},
        {"role": "user", "content": "Now what?"},
    ]});
    Bytes::from(body.to_string())
}

fn run(svc: &TokenService, config: &Config, body: &Bytes) -> usize {
    let req = ChatRequest::parse(body).unwrap();
    let mut info = svc.model_info("", "gpt-4o");
    info.window = 128_000;
    let p = pipeline::process(
        svc,
        &config.compaction,
        Subject {
            upstream: "",
            model: "gpt-4o",
            info,
            due: None,
            history: None,
        },
        req,
        body,
        true,
        &Replacement::Digest,
    );
    p.request.to_bytes().len()
}

fn benches(c: &mut Criterion) {
    Encoding::warm_up();
    let config = Arc::new(Config::default());
    let base = conversation();
    let bytes = Bytes::from(base.to_string());
    let svc = TokenService::new(config.clone(), &Metrics::new().unwrap());
    let out = run(&svc, &config, &bytes);
    println!(
        "128k conversation: {} bytes in, {out} bytes out",
        bytes.len()
    );

    let mut group = c.benchmark_group("compaction 128k");
    group.sample_size(10);
    group.bench_function("cold", |b| {
        b.iter_batched(
            || TokenService::new(config.clone(), &Metrics::new().unwrap()),
            |svc| run(&svc, &config, &bytes),
            BatchSize::LargeInput,
        )
    });
    let turn = AtomicU64::new(0);
    let mut next = base.clone();
    group.sample_size(30);
    group.bench_function("warm (+1 new message)", |b| {
        b.iter_batched(
            || {
                let n = turn.fetch_add(1, Ordering::Relaxed);
                next["messages"].as_array_mut().unwrap().push(
                    json!({"role": "user", "content": format!("Turn {n}: run the tests again.")}),
                );
                let body = Bytes::from(next.to_string());
                next["messages"].as_array_mut().unwrap().pop();
                body
            },
            |body| run(&svc, &config, &body),
            BatchSize::LargeInput,
        )
    });
    group.finish();

    let hostile = distinct_paths(400_000);
    println!("distinct path lines: {} bytes in", hostile.len());
    let mut group = c.benchmark_group("hostile tool result");
    group.sample_size(10);
    group.bench_function("16 MB of distinct path lines (cold)", |b| {
        b.iter_batched(
            || TokenService::new(config.clone(), &Metrics::new().unwrap()),
            |svc| run(&svc, &config, &hostile),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(compaction, benches);
criterion_main!(compaction);
