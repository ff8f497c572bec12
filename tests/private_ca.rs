//! A private CA for the upstream. A TLS-inspecting corporate proxy re-signs
//! every upstream's certificate with its own CA, which no public root
//! vouches for: condense answered 502 `UnknownIssuer` to every request.
//! With `upstream.ca_file`, or `SSL_CERT_FILE`, naming that CA, every client
//! condense makes gets through: the forwarding pool, the summarizer's, and
//! the one behind an outbound proxy. A file that cannot serve stops condense
//! at start-up, naming it.
//!
//! The upstream here is HTTPS on 127.0.0.1 with a certificate for
//! `localhost` signed by the test CA of `tests/fixtures/tls/`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use condense::config::Config;
use condense::server::Server;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

/// The test CA's certificate.
fn ca() -> PathBuf {
    fixture("ca.pem")
}

/// An HTTPS upstream on 127.0.0.1 (HTTP/2 or HTTP/1.1) whose certificate
/// the test CA signed. Chat completions get an answer (a summarizer call,
/// one whose first message holds `<conversation>`, a checkpoint), `/models`
/// an empty listing, anything else `{"ok": true}`; it records each request
/// as `METHOD path`.
struct TlsUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsUpstream {
    async fn start() -> TlsUpstream {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_file_iter(fixture("leaf.pem"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(fixture("leaf-key.pem")).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (acceptor, log) = (acceptor.clone(), log.clone());
                tokio::spawn(async move {
                    // A client that does not trust the certificate ends
                    // here: no request is ever read.
                    let Ok(tls) = acceptor.accept(sock).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req| answer(req, log.clone()));
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
                });
            }
        });
        TlsUpstream { addr, seen, task }
    }

    fn base_url(&self) -> String {
        format!("https://localhost:{}/v1", self.addr.port())
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the test upstream says to a chat completion.
const ANSWER: &str = "through the private CA";

async fn answer(
    req: http::Request<hyper::body::Incoming>,
    log: Arc<Mutex<Vec<String>>>,
) -> Result<http::Response<Full<Bytes>>, hyper::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let path = parts.uri.path().to_string();
    log.lock().unwrap().push(format!("{} {path}", parts.method));
    let answer = if path.ends_with("/chat/completions") {
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let summary_call = request["messages"][0]["content"]
            .as_str()
            .is_some_and(|c| c.contains("<conversation>"));
        let content = if summary_call {
            "## Task intent\nFix the failing test.\n## Files and artifacts\nsrc/parser.rs\n## Decisions\nnone\n## Errors and blockers\nerror[E0308]\n## Current state\nreading files\n## Next steps\nfix it\n## Critical identifiers\ncheckpoint-0\n"
        } else {
            ANSWER
        };
        json!({
            "id": "chatcmpl-ca", "object": "chat.completion", "created": 0,
            "model": request["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": body.len() / 4, "completion_tokens": 5,
                "total_tokens": body.len() / 4 + 5}
        })
    } else if path.ends_with("/models") {
        json!({"object": "list", "data": []})
    } else {
        json!({"ok": true})
    };
    let mut resp = http::Response::new(Full::new(Bytes::from(answer.to_string())));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// condense in process on 127.0.0.1 port 0 in front of `upstream`, with
/// the default config adjusted by `tweak`.
async fn condense_for(upstream: &TlsUpstream, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.upstream.base_url = upstream.base_url();
    config.upstream.anthropic_base_url = upstream.base_url();
    tweak(&mut config);
    config.validate().unwrap();
    Server::start(&config).await.unwrap()
}

async fn chat(addr: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{addr}/v1/chat/completions"))
        .bearer_auth("sk-client-key")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

/// The 502 condense gives when it does not trust the upstream: the
/// client learns why.
async fn assert_unknown_issuer(resp: reqwest::Response) {
    assert_eq!(resp.status(), 502);
    let v: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("UnknownIssuer"), "{message}");
}

async fn assert_answered(resp: reqwest::Response) {
    assert_eq!(resp.status(), 200);
    let v: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER, "{v}");
}

#[tokio::test]
async fn an_upstream_signed_by_a_private_ca_is_a_502_unknown_issuer_until_ca_file_names_the_ca() {
    let upstream = TlsUpstream::start().await;

    let server = condense_for(&upstream, |_| {}).await;
    let addr = server.local_addr().to_string();
    assert_unknown_issuer(chat(&addr, &common::chat_body(false)).await).await;
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    server.shutdown().await.unwrap();

    let server = condense_for(&upstream, |c| c.upstream.ca_file = Some(ca())).await;
    let addr = server.local_addr().to_string();
    assert_answered(chat(&addr, &common::chat_body(false)).await).await;
    assert!(
        upstream
            .seen()
            .contains(&"POST /v1/chat/completions".to_string()),
        "{:?}",
        upstream.seen()
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_summarizer_trusts_the_ca_file_too() {
    let upstream = TlsUpstream::start().await;
    // An 8k window and a session far over it: old turns are summarized,
    // by the upstream itself (summary.base_url unset).
    let server = condense_for(&upstream, |c| {
        c.upstream.ca_file = Some(ca());
        c.models.push(common::profile("agent-*", 8192));
    })
    .await;
    let addr = server.local_addr().to_string();
    let resp = chat(&addr, &common::coding_session("agent-small", 14, 120, 30)).await;
    let actions = resp.headers()["x-condense-actions"]
        .to_str()
        .unwrap()
        .to_string();
    // A summarizer that could not connect falls back to dropping turns.
    assert!(actions.contains("summarize"), "{actions}");
    assert_answered(resp).await;
    let calls = upstream
        .seen()
        .iter()
        .filter(|r| *r == "POST /v1/chat/completions")
        .count();
    assert!(calls >= 2, "a summarizer call and the request: {calls}");
    server.shutdown().await.unwrap();

    // The summarizer's own client, without the CA: the reason it names.
    let client = condense::summary::client::Client::new(
        &condense::wire::chat::Chat,
        condense::upstream::Upstream::new(&condense::config::UpstreamConfig {
            base_url: upstream.base_url(),
            ..Default::default()
        })
        .unwrap(),
        None,
    );
    let err = client
        .call(client.headers(None, false), "m", "hi", 64, "max_tokens")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");
}

/// The real binary with `env` (and no `CONDENSE_*`, `RUST_LOG`, proxy or
/// `SSL_CERT_FILE` variable of this process's), killed when dropped.
struct Condense {
    child: std::process::Child,
    addr: String,
}

impl Drop for Condense {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn command(env: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_condense"));
    for (k, _) in std::env::vars() {
        let proxy = ["http_proxy", "https_proxy", "all_proxy", "no_proxy"]
            .contains(&k.to_lowercase().as_str());
        if k.starts_with("CONDENSE_") || k == "RUST_LOG" || k == "SSL_CERT_FILE" || proxy {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd
}

/// Starts `condense serve` in front of `upstream` with `env`.
fn serve(upstream: &TlsUpstream, env: &[(&str, String)]) -> Condense {
    let mut cmd = command(env);
    cmd.env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_UPSTREAM__BASE_URL", upstream.base_url())
        .env("CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL", upstream.base_url())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listen=").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("condense never said where it listens");
    Condense { child, addr }
}

#[tokio::test]
async fn ssl_cert_file_set_for_condense_alone_makes_it_trust_the_ca() {
    let upstream = TlsUpstream::start().await;
    let without = serve(&upstream, &[]);
    assert_unknown_issuer(chat(&without.addr, &common::chat_body(false)).await).await;
    drop(without);
    let with = serve(&upstream, &[("SSL_CERT_FILE", ca().display().to_string())]);
    assert_answered(chat(&with.addr, &common::chat_body(false)).await).await;
}

/// An HTTP proxy on 127.0.0.1 that opens `CONNECT` tunnels, recording each
/// request line.
async fn connect_proxy() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut client = tokio::io::BufReader::new(sock);
                let mut line = String::new();
                client.read_line(&mut line).await.unwrap();
                loop {
                    let mut header = String::new();
                    client.read_line(&mut header).await.unwrap();
                    if header.trim().is_empty() {
                        break;
                    }
                }
                let line = line.trim().to_string();
                log.lock().unwrap().push(line.clone());
                let target = line.split(' ').nth(1).unwrap().to_string();
                let mut server = tokio::net::TcpStream::connect(target).await.unwrap();
                client
                    .get_mut()
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
                    .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn behind_an_outbound_proxy_the_ca_file_is_trusted_too() {
    let upstream = TlsUpstream::start().await;
    let (proxy, tunnels) = connect_proxy().await;
    let condense = serve(
        &upstream,
        &[
            ("HTTPS_PROXY", format!("http://{proxy}")),
            ("CONDENSE_UPSTREAM__CA_FILE", ca().display().to_string()),
        ],
    );
    assert_answered(chat(&condense.addr, &common::chat_body(false)).await).await;
    // Anthropic's API, a client of its own behind the proxy.
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://{}/v1/messages/batches", condense.addr))
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-ant-client")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(v, json!({"ok": true}));
    let connect = format!("CONNECT localhost:{} HTTP/1.1", upstream.addr.port());
    let tunnels = tunnels.lock().unwrap().clone();
    assert!(
        !tunnels.is_empty() && tunnels.iter().all(|t| *t == connect),
        "{tunnels:?}"
    );
    let seen = upstream.seen();
    for request in ["POST /v1/chat/completions", "GET /v1/messages/batches"] {
        assert!(seen.iter().any(|r| r == request), "{request}: {seen:?}");
    }
}

/// `cmd`'s exit status and standard error; it must exit within 20 s.
fn run_to_exit(mut cmd: Command) -> (std::process::ExitStatus, String) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut text).unwrap();
        text
    });
    for _ in 0..400 {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    panic!("condense did not exit");
}

#[test]
fn a_ca_file_that_cannot_serve_stops_condense_at_start_up_naming_it() {
    let missing = "/nonexistent/condense/corp-ca.pem".to_string();
    let key_only = fixture("leaf-key.pem").display().to_string();
    for (args, env, file, says) in [
        (
            ["check-config"],
            ("CONDENSE_UPSTREAM__CA_FILE", missing.clone()),
            missing.as_str(),
            "cannot read",
        ),
        (
            ["serve"],
            ("CONDENSE_UPSTREAM__CA_FILE", key_only.clone()),
            key_only.as_str(),
            "holds no certificate",
        ),
        (
            ["serve"],
            ("SSL_CERT_FILE", missing.clone()),
            missing.as_str(),
            "cannot read",
        ),
    ] {
        let mut cmd = command(std::slice::from_ref(&env));
        cmd.args(args).env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0");
        let (status, stderr) = run_to_exit(cmd);
        assert!(!status.success(), "{args:?} {env:?}");
        let setting = match env.0 {
            "SSL_CERT_FILE" => "SSL_CERT_FILE",
            _ => "upstream.ca_file",
        };
        let named = format!("{file} (named by {setting})");
        assert!(
            stderr.contains(&named) && stderr.contains(says),
            "{args:?} {env:?}: {stderr}"
        );
    }
}
