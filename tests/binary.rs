//! The real `condense` binary, end to end: configuration checks, serving in
//! front of the mock upstream, logs, and shutdown on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{MockUpstream, Running, chat_body, spawn_logged};

fn condense() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_condense"));
    // Start from a clean environment as far as condense is concerned.
    for (k, _) in std::env::vars() {
        if k.starts_with("CONDENSE_") || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn check_config_prints_the_effective_config_with_secrets_redacted() {
    let out = condense()
        .arg("check-config")
        .env("CONDENSE_UPSTREAM__API_KEY", "sk-top-secret")
        .env("CONDENSE_UPSTREAM__BASE_URL", "http://127.0.0.1:9/v1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("base_url = \"http://127.0.0.1:9/v1\""),
        "{text}"
    );
    assert!(text.contains("api_key = \"[redacted]\""), "{text}");
    assert!(!text.contains("sk-top-secret"));
}

#[test]
fn check_config_fails_on_unknown_or_invalid_keys() {
    let dir = std::env::temp_dir().join(format!("condense-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[upstream]\nbase_urll = \"http://x\"\n").unwrap();
    let out = condense()
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("base_urll"));

    let out = condense()
        .arg("check-config")
        .env("CONDENSE_SERVER__MAX_BODY_BYTES", "lots")
        .output()
        .unwrap();
    assert!(!out.status.success());

    let out = condense()
        .args(["check-config", "--config", "/nonexistent/condense.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn check_config_refuses_a_key_no_header_can_carry_and_does_not_print_it() {
    // (The environment's values are trimmed: a trailing newline is gone
    // before condense sees it.)
    for (var, value) in [
        (
            "CONDENSE_UPSTREAM__API_KEY",
            "sk-top-secret\r\nX-Injected: 1",
        ),
        ("CONDENSE_UPSTREAM__ANTHROPIC_API_KEY", "sk-top-secret\u{1}"),
        ("CONDENSE_SUMMARY__API_KEY", "sk-top-secret\u{e9}"),
    ] {
        let out = condense()
            .arg("check-config")
            .env(var, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}={value:?} was accepted");
        let key = var
            .trim_start_matches("CONDENSE_")
            .replace("__", ".")
            .to_lowercase();
        assert!(stderr.contains(&key), "{var}: {stderr}");
        assert!(!stderr.contains("top-secret"), "{var}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn check_config_names_a_malformed_secret_by_its_variable_without_its_value() {
    // A list without its brackets: a string where a sequence belongs.
    let out = condense()
        .arg("check-config")
        .env("CONDENSE_AUTH__CLIENT_KEYS", "team-key-1, team-key-2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("CONDENSE_AUTH__CLIENT_KEYS") && stderr.contains("expected a sequence"),
        "{stderr}"
    );
    assert!(!stderr.contains("team-key"), "{stderr}");
}

#[tokio::test]
async fn stray_condense_variables_are_named_in_a_warning_and_never_stop_condense() {
    let mock = MockUpstream::start().await;
    let mut cmd = condense();
    cmd.env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_UPSTREAM__BASE_URL", mock.base_url())
        .env("CONDENSE_UPSTREAM__LEARN_WINDOWS", "false")
        // A script's and a test's variables, not condense's.
        .env("CONDENSE_BIN", "/opt/never-log-this/condense")
        .env("CONDENSE_E2E_API_KEY", "sk-never-log-this");
    let (child, addr, log, reader) = spawn_logged(&mut cmd, Duration::from_secs(20));
    let resp = reqwest::get(format!("http://{addr}/healthz"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    terminate(&child);
    let log = exit_log(child, log, reader).await;
    for name in ["CONDENSE_BIN", "CONDENSE_E2E_API_KEY"] {
        assert!(
            log.lines()
                .any(|l| l.contains("WARN") && l.contains(name) && l.contains("ignored")),
            "{name}:\n{log}"
        );
    }
    assert!(!log.contains("never-log-this"), "{log}");

    let out = condense()
        .arg("check-config")
        .env("CONDENSE_EXTRA", "1")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("warning: CONDENSE_EXTRA"), "{stderr}");

    // A misspelled key of a section is still an error.
    let out = condense()
        .arg("check-config")
        .env("CONDENSE_SERVER__LISTN", "127.0.0.1:1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("CONDENSE_SERVER__LISTN"), "{stderr}");
}

#[tokio::test]
async fn serves_in_front_of_the_upstream_never_logs_keys_and_stops_on_sigterm() {
    let mock = MockUpstream::start().await;
    // The summarizer (the mock) answers 401 quoting the key it was sent.
    mock.set_summary_mode("echo_key");
    let mut cmd = condense();
    cmd.env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_UPSTREAM__BASE_URL", mock.base_url())
        // Summaries for any request of more than 6 messages, on a small
        // window, so that the summarizer path runs too.
        .env("CONDENSE_SUMMARY__TRIGGER__KIND", "messages")
        .env("CONDENSE_SUMMARY__TRIGGER__VALUE", "6")
        .env("CONDENSE_DEFAULT_CONTEXT_WINDOW", "2048")
        .env("RUST_LOG", "trace");
    let (child, addr, log, reader) = spawn_logged(&mut cmd, Duration::from_secs(20));

    let client = reqwest::Client::new();
    for stream in [false, true] {
        let resp = client
            .post(format!("http://{addr}/v1/chat/completions"))
            .bearer_auth("sk-never-log-this-key")
            .header("api-key", "azure-never-log-this")
            .body(chat_body(stream).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
    }
    assert_eq!(
        mock.last().headers["authorization"],
        "Bearer sk-never-log-this-key"
    );
    // A long session: the summarizer is called (with the client's key, on
    // the upstream's host) and fails; then an overflow is recovered.
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "s"}),
        serde_json::json!({"role": "user", "content": "task"}),
    ];
    for t in 0..10 {
        messages.push(serde_json::json!({"role": "assistant", "content": format!("step {t}")}));
        messages.push(serde_json::json!({"role": "user", "content": format!("ok {t}")}));
    }
    let long = serde_json::json!({"model": "small-model", "messages": messages, "max_tokens": 64});
    // The overflowing one with a 100 KB model name: no log line carries it.
    let mut huge_name = long.clone();
    huge_name["model"] = serde_json::json!(format!("small-model-{}", "m".repeat(100_000)));
    for extra in [None, Some(("x-mock-window", "100"))] {
        let long = if extra.is_some() { &huge_name } else { &long };
        let mut req = client
            .post(format!("http://{addr}/v1/chat/completions"))
            .bearer_auth("sk-never-log-this-key")
            .header("x-mock-token-factor", "1.0");
        if let Some((k, v)) = extra {
            req = req.header(k, v);
        }
        let resp = req.body(long.to_string()).send().await.unwrap();
        // The overflow may be beyond recovery; either way it is logged.
        assert!(resp.status() == 200 || extra.is_some(), "{}", resp.status());
        resp.text().await.unwrap();
    }
    let calls = mock.summary_calls();
    assert!(!calls.is_empty(), "the summarizer path ran");
    assert_eq!(
        calls[0].headers["authorization"],
        "Bearer sk-never-log-this-key"
    );
    assert!(
        mock.state
            .overflows
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 1
    );

    terminate(&child);
    let log = exit_log(child, log, reader).await;
    assert!(log.contains("shutdown signal received"), "{log}");
    // A line for each request, written after its response went out: the
    // four answered by the upstream (the 400 is the overflow passed on).
    let answered = |status: u16| {
        let line = format!(
            "condense::server: request method=POST path=\"/v1/chat/completions\" status={status} "
        );
        log.lines().filter(|l| l.contains(&line)).count()
    };
    assert_eq!((answered(200), answered(400)), (3, 1), "{log}");
    assert!(log.contains("summarizer call failed"), "{log}");
    assert!(log.contains("upstream context overflow"), "{log}");
    assert!(
        !log.contains("never-log-this"),
        "a key reached the logs:\n{log}"
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 4096, "a log line of {longest} bytes");
}

#[tokio::test]
async fn every_access_line_reaches_the_log_whole_and_in_order_by_exit() {
    let mock = MockUpstream::start().await;
    let mut cmd = condense();
    cmd.env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_UPSTREAM__BASE_URL", mock.base_url())
        .env("CONDENSE_UPSTREAM__LEARN_WINDOWS", "false")
        .env("CONDENSE_LOG__FORMAT", "json");
    let (child, addr, log, reader) = spawn_logged(&mut cmd, Duration::from_secs(20));
    let client = reqwest::Client::new();
    let send = |id: String, sleep_ms: u32| {
        let req = client
            .post(format!("http://{addr}/v1/chat/completions"))
            .header("x-request-id", id)
            .header("x-mock-sleep-ms", sleep_ms.to_string())
            .body(chat_body(false).to_string());
        async move {
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap();
        }
    };
    // One after another on one connection; then many at once, still in
    // flight when the signal comes: their lines are queued moments before
    // the process ends.
    for i in 0..300 {
        send(format!("serial-{i:03}"), 0).await;
    }
    let burst = tokio::spawn(futures_util::future::join_all(
        (0..200).map(|i| send(format!("burst-{i:03}"), 1_000)),
    ));
    // The signal comes once the upstream has all of them (a request still
    // in the listen backlog would be refused, as it should be).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while mock.requests().len() < 500 {
        assert!(
            std::time::Instant::now() < deadline,
            "the burst never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    terminate(&child);
    burst.await.unwrap();
    let log = exit_log(child, log, reader).await;
    // Every line whole (JSON), each request's once.
    let ids: Vec<String> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"))
        })
        .filter(|v| v["fields"]["message"] == "request")
        .map(|v| {
            assert_eq!(v["fields"]["status"], 200, "{v}");
            v["fields"]["request_id"].as_str().unwrap().to_string()
        })
        .collect();
    let serial: Vec<&String> = ids.iter().filter(|i| i.starts_with("serial-")).collect();
    let expected: Vec<String> = (0..300).map(|i| format!("serial-{i:03}")).collect();
    assert_eq!(
        serial,
        expected.iter().collect::<Vec<_>>(),
        "in the order served"
    );
    let mut burst: Vec<&String> = ids.iter().filter(|i| i.starts_with("burst-")).collect();
    burst.sort();
    burst.dedup();
    assert_eq!((burst.len(), ids.len()), (200, 500));
}

#[test]
fn compact_prints_the_body_and_a_report() {
    let dir = std::env::temp_dir().join(format!("condense-compact-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("req.json");
    let body = r#"{"model":"gpt-4o", "messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hello world"}],"max_tokens":100}"#;
    std::fs::write(&file, body).unwrap();
    let out = condense()
        .arg("compact")
        .arg(&file)
        .args(["--window", "16000"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8(out.stdout).unwrap(), body);
    let report: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(report["window"], 16000);
    assert_eq!(report["window_source"], "override");
    assert_eq!(report["prompt_budget"], 16000 - 100 - 800);
    // 3 priming + (3 + "system" + "Be brief.") + (3 + "user" + "hello world")
    assert_eq!(report["tokens_before"], 3 + (3 + 1 + 3) + (3 + 1 + 2));
    assert_eq!(report["actions"], serde_json::json!([]));
    assert!(report["pressure"].as_f64().unwrap() > 0.0);

    // --model picks the profile (gpt-3.5-turbo: 16385 tokens, cl100k).
    let out = condense()
        .args(["compact", "-", "--model", "gpt-3.5-turbo"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(report["window"], 16385);
    assert_eq!(report["encoding"], "cl100k_base");

    let out = condense()
        .args(["compact", "/nonexistent.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    std::fs::write(&file, "not json").unwrap();
    let out = condense().arg("compact").arg(&file).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("not a chat completions or Anthropic Messages request")
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn replay_with_an_upstream_summarizes_old_turns_and_counts_the_calls() {
    let mock = MockUpstream::start().await;
    let run = |extra: Vec<String>| {
        let mut c = condense();
        c.args([
            "replay",
            "examples/agent-session.json",
            "--window",
            "5120",
            "--json",
        ])
        .args(extra);
        c
    };
    let url = mock.base_url();
    let out =
        tokio::task::spawn_blocking(move || run(vec!["--upstream".into(), url]).output().unwrap())
            .await
            .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let calls = report["summarizer"]["calls"].as_u64().unwrap();
    assert!(calls >= 1, "{report}");
    assert_eq!(mock.summary_calls().len() as u64, calls);
    assert!(report["summarizer"]["reused"].as_u64().unwrap() >= 1);
    assert_eq!(report["condense"]["turns_not_fit"], 0);
    let turns = report["turns"].as_array().unwrap();
    assert!(
        turns
            .iter()
            .any(|t| t["actions"].as_str().unwrap().contains("summarize"))
    );

    // Offline (no --upstream) stays mechanical and makes no calls.
    let out = tokio::task::spawn_blocking(move || run(vec![]).output().unwrap())
        .await
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report.get("summarizer").is_none());
    assert_eq!(mock.summary_calls().len() as u64, calls);
}

#[tokio::test]
async fn healthcheck_exits_zero_only_when_the_proxy_answers() {
    let h = common::Harness::start().await;
    let port = h.addr.port();
    let ok = tokio::task::spawn_blocking(move || {
        // The listen address as a container sets it: 0.0.0.0 is checked on
        // 127.0.0.1.
        condense()
            .arg("healthcheck")
            .env("CONDENSE_SERVER__LISTEN", format!("0.0.0.0:{port}"))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    h.shutdown().await;
    let down = tokio::task::spawn_blocking(move || {
        condense()
            .args([
                "healthcheck",
                "--url",
                &format!("http://127.0.0.1:{port}/healthz"),
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(!down.status.success());
    assert!(String::from_utf8_lossy(&down.stderr).contains("is not healthy"));
}

#[test]
fn replay_of_several_conversations_reports_each_and_their_means() {
    let dir = std::env::temp_dir().join(format!("condense-suite-{}", std::process::id()));
    let probes = dir.join("probes");
    std::fs::create_dir_all(&probes).unwrap();
    let session: serde_json::Value =
        serde_json::from_slice(&std::fs::read("examples/agent-session.json").unwrap()).unwrap();
    // A second, shorter conversation: the first 20 messages of the example.
    let mut short = session.clone();
    short["messages"] =
        serde_json::Value::Array(session["messages"].as_array().unwrap()[..20].to_vec());
    std::fs::write(dir.join("long.json"), session.to_string()).unwrap();
    std::fs::write(dir.join("short.json"), short.to_string()).unwrap();
    // Probes in both layouts: NAME.probes.json, and the conversation's name.
    std::fs::copy(
        "examples/agent-session.probes.json",
        probes.join("long.probes.json"),
    )
    .unwrap();
    std::fs::copy(
        "examples/agent-session.probes.json",
        probes.join("short.json"),
    )
    .unwrap();

    let run = |json: bool| {
        let mut c = condense();
        c.arg("replay")
            .arg(dir.join("long.json"))
            .arg(dir.join("short.json"))
            .arg("--probes")
            .arg(&probes)
            .args(["--window", "12000"]);
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    let out = run(true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let suite: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let each = suite["conversations"].as_array().unwrap();
    assert_eq!(each.len(), 2);
    assert_eq!(each[0]["conversation"], "long.json");
    assert_eq!(each[1]["conversation"], "short.json");
    assert!(each[0]["turns"].as_u64().unwrap() > each[1]["turns"].as_u64().unwrap());
    for strategy in ["condense", "drop_oldest", "last_10_results"] {
        let (a, b, all) = (
            &each[0][strategy],
            &each[1][strategy],
            &suite["all"][strategy],
        );
        assert!(a["probe_retention"].is_f64() && b["probe_retention"].is_f64());
        let sum = |k: &str| a[k].as_u64().unwrap() + b[k].as_u64().unwrap();
        assert_eq!(all["tokens_sent"].as_u64().unwrap(), sum("tokens_sent"));
        assert_eq!(
            all["uncached_tokens"].as_u64().unwrap(),
            sum("uncached_tokens")
        );
        let mean = |k: &str| (a[k].as_f64().unwrap() + b[k].as_f64().unwrap()) / 2.0;
        for k in ["prefix_stability", "probe_retention"] {
            assert!(
                (all[k].as_f64().unwrap() - mean(k)).abs() < 1e-9,
                "{strategy} {k}"
            );
        }
    }
    // The long one needs compaction at this window: condense beats
    // drop-oldest on what the cache serves.
    assert!(
        each[0]["condense"]["uncached_tokens"].as_u64().unwrap()
            < each[0]["drop_oldest"]["uncached_tokens"].as_u64().unwrap()
    );

    let text = String::from_utf8(run(false).stdout).unwrap();
    assert!(
        text.contains("long.json  (model gpt-4o, window 12000"),
        "{text}"
    );
    assert!(text.contains("all 2 conversations"), "{text}");

    // --dump writes what the provider received, turn by turn, per
    // conversation: the long one's later requests carry condense's marks.
    let dumped = dir.join("dumped");
    let out = condense()
        .arg("replay")
        .arg(dir.join("long.json"))
        .arg(dir.join("short.json"))
        .args(["--window", "12000", "--dump"])
        .arg(&dumped)
        .output()
        .unwrap();
    assert!(out.status.success());
    let bodies = |name: &str| {
        let mut files: Vec<_> = std::fs::read_dir(dumped.join(name))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        files
    };
    let (long, short) = (bodies("long"), bodies("short"));
    assert!(long.len() >= each[0]["turns"].as_u64().unwrap() as usize);
    assert!(short.len() >= each[1]["turns"].as_u64().unwrap() as usize);
    assert!(long[0].ends_with("0001.json"));
    let last: serde_json::Value =
        serde_json::from_slice(&std::fs::read(long.last().unwrap()).unwrap()).unwrap();
    assert!(last["messages"].to_string().contains("[condense:"));

    // With several conversations, one probe file cannot serve them all.
    let out = condense()
        .arg("replay")
        .arg(dir.join("long.json"))
        .arg(dir.join("short.json"))
        .arg("--probes")
        .arg(probes.join("short.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--probes names a directory"));
    std::fs::remove_dir_all(&dir).ok();
}

/// A forward proxy on 127.0.0.1 that answers every request itself with a
/// chat completion, and records each request line it got.
async fn forward_proxy() -> (std::net::SocketAddr, Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut sock = tokio::io::BufReader::new(sock);
                loop {
                    let mut line = String::new();
                    if sock.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut length = 0;
                    let mut seen = line.trim().to_string();
                    loop {
                        let mut h = String::new();
                        sock.read_line(&mut h).await.unwrap();
                        if h.trim().is_empty() {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                length = v.trim().parse().unwrap();
                            }
                            if k.eq_ignore_ascii_case("proxy-authorization") {
                                seen = format!("{seen} ({})", v.trim());
                            }
                        }
                    }
                    let mut body = vec![0; length];
                    sock.read_exact(&mut body).await.unwrap();
                    log.lock().unwrap().push(seen);
                    let answer = serde_json::json!({
                        "id": "chatcmpl-proxied", "object": "chat.completion", "created": 0,
                        "model": "gpt-4o", "choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "via the proxy"}}],
                        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
                    })
                    .to_string();
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        answer.len()
                    );
                    let out = sock.get_mut();
                    out.write_all(head.as_bytes()).await.unwrap();
                    out.write_all(answer.as_bytes()).await.unwrap();
                }
            });
        }
    });
    (addr, seen)
}

/// Starts condense with `env` and returns it with the address it listens on.
fn serve(env: &[(&str, String)]) -> (Running, String) {
    let mut cmd = condense();
    for k in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"] {
        cmd.env_remove(k).env_remove(k.to_lowercase());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_UPSTREAM__LEARN_WINDOWS", "false");
    let (child, addr, _, _) = spawn_logged(&mut cmd, Duration::from_secs(20));
    (child, addr)
}

/// Sends condense SIGTERM.
fn terminate(child: &Running) {
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits for condense to exit, which it must do successfully, and returns
/// everything it logged.
async fn exit_log(
    mut child: Running,
    log: Arc<Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
) -> String {
    let exit = tokio::task::spawn_blocking(move || child.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "condense exited with {exit}");
    reader.join().unwrap();
    log.lock().unwrap().clone()
}

#[tokio::test]
async fn a_proxy_named_in_the_environment_carries_the_requests_unless_no_proxy_says_otherwise() {
    let (proxy, seen) = forward_proxy().await;
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let chat = |addr: String| {
        client
            .post(format!("http://{addr}/v1/chat/completions"))
            .bearer_auth("sk-test")
            .body(chat_body(false).to_string())
            .send()
    };

    // Nothing listens on port 1: only the proxy can answer for it. The
    // credentials in its URL go to it, as Proxy-Authorization.
    let (child, addr) = serve(&[
        ("HTTP_PROXY", format!("http://px-user:px%40pass@{proxy}")),
        (
            "CONDENSE_UPSTREAM__BASE_URL",
            "http://127.0.0.1:1/v1".to_string(),
        ),
    ]);
    let resp = chat(addr).await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "via the proxy");
    assert_eq!(
        *seen.lock().unwrap(),
        // base64("px-user:px@pass")
        ["POST http://127.0.0.1:1/v1/chat/completions HTTP/1.1 (Basic cHgtdXNlcjpweEBwYXNz)"]
    );
    drop(child);

    // NO_PROXY names the upstream: condense goes straight to it.
    let mock = MockUpstream::start().await;
    let (_child, addr) = serve(&[
        ("HTTP_PROXY", format!("http://{proxy}")),
        ("NO_PROXY", "127.0.0.1".to_string()),
        ("CONDENSE_UPSTREAM__BASE_URL", mock.base_url()),
    ]);
    let resp = chat(addr).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    assert_eq!(mock.chat_requests().len(), 1);
    assert_eq!(seen.lock().unwrap().len(), 1, "the proxy got no more");
}

/// An upstream that takes every request and never answers, holding the
/// sockets until dropped; says how many it holds.
async fn silent_upstream() -> (
    String,
    Arc<std::sync::atomic::AtomicUsize>,
    tokio::task::JoinHandle<()>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let held = Arc::new(AtomicUsize::new(0));
    let count = held.clone();
    let task = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            sockets.push(s);
        }
    });
    (base, held, task)
}

/// How many files the process `pid` has open.
fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The attack of 5 HTTP/2 connections with 200 slow streams each, against
/// condense under a 1,024 open-file limit: each stream held an upstream
/// socket, the descriptors ran out, and nothing was answered any more,
/// `/healthz` included. Requests in flight are capped over all connections
/// now: the streams past it get the overload error at once, the process
/// stays under its limit, liveness answers 200 and readiness 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn h2c_streams_cannot_exhaust_file_descriptors_and_liveness_still_answers() {
    use std::sync::atomic::Ordering;
    let (base, held, upstream) = silent_upstream().await;
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "ulimit -n 1024 && exec \"$0\"",
        env!("CARGO_BIN_EXE_condense"),
    ]);
    for (k, _) in std::env::vars() {
        if k.starts_with("CONDENSE_") || k == "RUST_LOG" || k.to_lowercase().ends_with("_proxy") {
            cmd.env_remove(k);
        }
    }
    cmd.env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_UPSTREAM__LEARN_WINDOWS", "false")
        .env("CONDENSE_UPSTREAM__BASE_URL", &base)
        .env("CONDENSE_UPSTREAM__FIRST_BYTE_TIMEOUT_SECONDS", "60");
    let (child, addr, log, _) = spawn_logged(&mut cmd, Duration::from_secs(20));
    let pid = child.0.id();
    let url = format!("http://{addr}/v1/chat/completions");
    let body = serde_json::to_vec(&chat_body(false)).unwrap();
    let mut streams = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let client = reqwest::Client::builder()
            .no_proxy()
            .http2_prior_knowledge()
            .timeout(Duration::from_secs(90))
            .build()
            .unwrap();
        for _ in 0..200 {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            streams.spawn(async move {
                match client.post(url).body(body).send().await {
                    Ok(r) => r.status().as_u16(),
                    Err(_) => 0,
                }
            });
        }
    }
    // The cap condense chose under this limit, from its start-up line.
    let cap: usize = log
        .lock()
        .unwrap()
        .split("max_inflight_requests=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("condense names its cap of requests in flight");
    assert!(cap < 500, "a cap of {cap} under a 1,024 open-file limit");
    // Each connection takes 100 streams at once (the client queues the
    // rest): the streams past the cap are refused at once, the others held.
    let mut refused = 0;
    let settled = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if held.load(Ordering::SeqCst) == cap && refused >= 500 - cap {
                break;
            }
            // The upstream may take its last sockets after the last
            // refusal: look again every so often.
            if let Ok(joined) =
                tokio::time::timeout(Duration::from_millis(50), streams.join_next()).await
            {
                let status = joined.unwrap().unwrap();
                assert_eq!(status, 503, "a stream neither held nor refused");
                refused += 1;
            }
        }
    })
    .await;
    let held_now = held.load(Ordering::SeqCst);
    assert!(
        settled.is_ok(),
        "{held_now} held upstream, {refused} refused, cap {cap}"
    );
    let files = open_files(pid);
    assert!(files < 1000, "condense has {files} files open");

    // A new connection is still answered, liveness 200, readiness 503.
    let probe = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let live = probe
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200);
    let ready = probe
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert_eq!(ready.text().await.unwrap(), "saturated");
    // A refused stream got the API's overload error, in its shape.
    let over = probe.post(&url).body(body.clone()).send().await.unwrap();
    assert_eq!(over.status(), 503);
    assert_eq!(over.headers()["retry-after"], "1");
    let v: serde_json::Value = serde_json::from_slice(&over.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    let over = probe
        .post(format!("http://{addr}/v1/messages"))
        .body("{}")
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&over.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["type"], "overloaded_error");

    // Once the upstream lets go, the held streams end and condense is
    // ready again.
    upstream.abort();
    let _ = tokio::time::timeout(Duration::from_secs(60), async {
        while streams.join_next().await.is_some() {}
    })
    .await;
    let ready = probe
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
}
