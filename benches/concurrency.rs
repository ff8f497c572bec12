//! Concurrency benchmark (issue 39, item 4): a thousand long streams through
//! condense at once, to an upstream that allows 100 concurrent HTTP/2
//! streams a connection, as OpenAI, Anthropic and Vertex do.
//!
//! Why: condense's upstream pool keeps one HTTP/2 connection per host per
//! worker thread and does not read the server's
//! SETTINGS_MAX_CONCURRENT_STREAMS. Past 100 streams on a connection, hyper
//! holds a new request inside it until a stream ends, and the request's
//! first-byte deadline runs all the while. This bench measures that wait,
//! and exits non-zero when any stream fails or has its first byte past the
//! deadline, so it is a check as well as a measurement.
//!
//! In this process: the mock upstream, HTTPS with ALPN `h2` only (the
//! certificate of `tests/fixtures/tls/` that its test CA signed; condense
//! trusts it through `upstream.ca_file`), hyper's HTTP/2 server with
//! `max_concurrent_streams(100)` and its other defaults, among them its
//! guard against rapid resets (a client that cancels many streams at once
//! gets GOAWAY, as from the providers' front ends). It answers a chat
//! completion as a model streams one: the response after
//! `CONCURRENCY_FIRST_BYTE_MS` (default 100), then a chunk every
//! `CONCURRENCY_CHUNK_MS` (default 250) for `CONCURRENCY_STREAM_SECONDS`
//! (default 3), then usage and `[DONE]`. It counts the TCP and TLS
//! connections it accepts, the most streams open at once on each
//! connection, and in all. And the load: `CONCURRENCY_STREAMS` (default
//! 1000 per condense process) HTTP/1.1 keep-alive clients, all connected
//! first, then all posting a small streamed chat request at the same moment
//! and reading the stream to its end.
//!
//! condense runs as its own process (this build's release binary, started
//! outside the checkout so that the environment alone configures it), with
//! `upstream.first_byte_timeout_seconds` set to
//! `CONCURRENCY_DEADLINE_SECONDS` (default 10) and its connection caps
//! above the load. Before the burst each worker thread's pool is warmed
//! with a quick request, as on a process that has been serving;
//! `CONCURRENCY_WARM=0` sends the burst to cold pools instead.
//! `CONCURRENCY_REPLICAS=3` starts three condense processes, the clients
//! spread round-robin over them, each process sent to its own listening
//! address of the one mock so that the mock can tell their connections
//! apart. `CONDENSE_BIN=<path>[,<path>]` runs the same load against other
//! condense binaries after this build's, rows side by side.
//! `CONCURRENCY_STREAMS_PER_CONNECTION` (default 100) sets the mock's
//! limit; `CONCURRENCY_LOG=<filter>` copies condense's log, at that
//! filter, to a file in the temporary directory.
//!
//! Reported per condense process and in total: streams completed with
//! `[DONE]`; errors (504 past the first-byte deadline, a 200 cut
//! mid-stream, any other); time to first byte at the client (p50, p99,
//! max, over the completed streams) and the part of it added to the
//! upstream's own delay; how many streams waited over a second more than
//! that; the upstream connections condense opened; the most streams on one
//! of them and at once in all; condense's peak RSS (`VmHWM`). On a failure,
//! what ended the streams, as the client, the mock and condense saw it.
//!
//! Run: `cargo bench --bench concurrency`, or `CONCURRENCY_REPLICAS=3
//! cargo bench --bench concurrency` (3000 streams). The open-file limit is
//! raised to hold the sockets (condense inherits it). Mock, clients and
//! condense share the machine's cores.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http1;
use hyper_util::rt::{TokioExecutor, TokioIo};

const CHUNK: &str = "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok \"},\"finish_reason\":null}]}\n\n";
const USAGE: &str = "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":12,\"total_tokens\":32}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

/// The model of the warm-up requests: the mock answers them at once.
const WARMUP_MODEL: &str = "bench-warmup";

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The bench's settings, from the environment.
#[derive(Clone, Copy)]
struct Knobs {
    streams: usize,
    replicas: usize,
    /// The upstream's own delay before its response.
    first_byte: Duration,
    /// How long each answer streams after its first byte.
    stream_for: Duration,
    chunk_every: Duration,
    /// condense's `upstream.first_byte_timeout_seconds`.
    deadline: Duration,
    /// The mock's SETTINGS_MAX_CONCURRENT_STREAMS.
    per_connection: u32,
    warm: bool,
}

impl Knobs {
    fn from_env() -> Knobs {
        let ms = |name, default| Duration::from_secs_f64(env_f64(name, default) / 1000.0);
        let s = |name, default| Duration::from_secs_f64(env_f64(name, default));
        let replicas = (env_f64("CONCURRENCY_REPLICAS", 1.0) as usize).max(1);
        Knobs {
            streams: env_f64("CONCURRENCY_STREAMS", 1000.0 * replicas as f64) as usize,
            replicas,
            first_byte: ms("CONCURRENCY_FIRST_BYTE_MS", 100.0),
            stream_for: s("CONCURRENCY_STREAM_SECONDS", 3.0),
            chunk_every: ms("CONCURRENCY_CHUNK_MS", 250.0).max(Duration::from_millis(1)),
            deadline: s("CONCURRENCY_DEADLINE_SECONDS", 10.0),
            per_connection: env_f64("CONCURRENCY_STREAMS_PER_CONNECTION", 100.0) as u32,
            warm: std::env::var("CONCURRENCY_WARM").map_or(true, |v| v != "0"),
        }
    }

    /// Most streams sent to one condense process (round-robin).
    fn per_replica(&self) -> usize {
        self.streams.div_ceil(self.replicas)
    }
}

// ---------------------------------------------------------------------------
// The mock upstream

/// A count of open streams and the most seen at once.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Gauge {
    fn up(&self) {
        let n = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(n, Ordering::Relaxed);
    }

    fn down(&self) {
        self.now.fetch_sub(1, Ordering::Relaxed);
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

/// What the mock saw on one listening address (one condense process's).
#[derive(Default)]
struct Site {
    tcp: AtomicUsize,
    tls: AtomicUsize,
    streams: Arc<Gauge>,
    /// Each TLS connection's streams.
    conns: Mutex<Vec<Arc<Gauge>>>,
    /// How the connections that ended in an error ended.
    failed: Mutex<Vec<String>>,
}

/// A stream open at the mock: counted on its connection, its site and in
/// all until its response ends, or is dropped (the client reset it).
struct Open([Arc<Gauge>; 3]);

impl Open {
    fn new(gauges: [Arc<Gauge>; 3]) -> Open {
        for g in &gauges {
            g.up();
        }
        Open(gauges)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        for g in &self.0 {
            g.down();
        }
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

/// TLS with the certificate the test CA signed, offering `h2` alone.
fn acceptor() -> tokio_rustls::TlsAcceptor {
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
    tls.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(tls))
}

/// One listening address of the mock per condense process, sharing the
/// total count of streams.
async fn start_mock(k: Knobs, total: &Arc<Gauge>) -> Vec<(SocketAddr, Arc<Site>)> {
    let acceptor = acceptor();
    let mut sites = Vec::new();
    for _ in 0..k.replicas {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let site = Arc::new(Site::default());
        sites.push((listener.local_addr().unwrap(), site.clone()));
        let (acceptor, total) = (acceptor.clone(), total.clone());
        tokio::spawn(async move {
            loop {
                let tcp = match listener.accept().await {
                    Ok((tcp, _)) => tcp,
                    Err(_) => {
                        // Out of descriptors: wait rather than spin.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                site.tcp.fetch_add(1, Ordering::Relaxed);
                let _ = tcp.set_nodelay(true);
                let (acceptor, site, total) = (acceptor.clone(), site.clone(), total.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    site.tls.fetch_add(1, Ordering::Relaxed);
                    let conn = Arc::new(Gauge::default());
                    site.conns.lock().unwrap().push(conn.clone());
                    let on_site = site.streams.clone();
                    let service = hyper::service::service_fn(move |req| {
                        let gauges = [conn.clone(), on_site.clone(), total.clone()];
                        answer(req, gauges, k)
                    });
                    let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(k.per_connection)
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                    if let Err(e) = served {
                        site.failed.lock().unwrap().push(describe(&e));
                    }
                });
            }
        });
    }
    sites
}

/// An error and its causes, on one line.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

type MockBody = UnsyncBoxBody<Bytes, Infallible>;

/// A chat completion streamed as a model does: nothing for `first_byte`,
/// then a chunk every `chunk_every` for `stream_for`, usage, `[DONE]`. A
/// warm-up request is answered at once.
async fn answer(
    req: http::Request<Incoming>,
    gauges: [Arc<Gauge>; 3],
    k: Knobs,
) -> Result<http::Response<MockBody>, hyper::Error> {
    let open = Open::new(gauges);
    let chat = req.uri().path().ends_with("/chat/completions");
    let body = req.into_body().collect().await?.to_bytes();
    if !chat {
        let mut r = http::Response::new(Full::new(Bytes::new()).boxed_unsync());
        *r.status_mut() = http::StatusCode::NOT_FOUND;
        return Ok(r);
    }
    let warmup = memchr::memmem::find(&body, WARMUP_MODEL.as_bytes()).is_some();
    let (chunks, every) = if warmup {
        (1, Duration::ZERO)
    } else {
        tokio::time::sleep(k.first_byte).await;
        let n = (k.stream_for.as_secs_f64() / k.chunk_every.as_secs_f64()).round();
        ((n as usize).max(1), k.chunk_every)
    };
    // Chunk i at first byte + i * every, usage one interval after the
    // last chunk, then [DONE]; `open` goes with the stream.
    let events = futures_util::stream::unfold((0usize, open), move |(i, open)| async move {
        let event = match i {
            i if i < chunks => CHUNK,
            i if i == chunks => USAGE,
            i if i == chunks + 1 => DONE,
            _ => return None,
        };
        if i > 0 && i <= chunks {
            tokio::time::sleep(every).await;
        }
        let frame = Frame::data(Bytes::from_static(event.as_bytes()));
        Some((Ok::<_, Infallible>(frame), (i + 1, open)))
    });
    let mut r = http::Response::new(StreamBody::new(events).boxed_unsync());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(r)
}

// ---------------------------------------------------------------------------
// condense

/// condense's log filter: access lines off, warnings (a 504 is one) kept.
const QUIET: &str = "warn,condense::server=warn,condense=info";

/// A condense process and the warnings it logged (a few kept).
struct Condense {
    child: Child,
    addr: SocketAddr,
    warnings: Arc<Mutex<(usize, Vec<String>)>>,
}

/// condense from `binary` in front of the mock at `upstream`, configured by
/// the environment alone: it runs from the temporary directory, where no
/// `config/condense.toml` is (an older binary refuses a newer file's keys).
fn start_condense(binary: &str, upstream: SocketAddr, k: Knobs, n: usize) -> Condense {
    let log = std::env::var("CONCURRENCY_LOG").ok();
    let log_file = log.as_ref().map(|_| {
        let path = std::env::temp_dir().join(format!("concurrency-condense-{n}.log"));
        println!("condense #{n} logs to {}", path.display());
        path
    });
    let base = format!("https://127.0.0.1:{}/v1", upstream.port());
    let caps = (k.per_replica() + 1000).to_string();
    let mut command = Command::new(binary);
    for proxy in ["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"] {
        command
            .env_remove(proxy)
            .env_remove(proxy.to_ascii_lowercase());
    }
    let mut child = command
        .current_dir(std::env::temp_dir())
        .env("CONDENSE_SERVER__LISTEN", "127.0.0.1:0")
        .env("CONDENSE_SERVER__MAX_CONNECTIONS", &caps)
        .env("CONDENSE_SERVER__MAX_INFLIGHT_REQUESTS", &caps)
        .env("CONDENSE_UPSTREAM__BASE_URL", &base)
        .env("CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL", &base)
        .env("CONDENSE_UPSTREAM__CA_FILE", fixture("ca.pem"))
        .env(
            "CONDENSE_UPSTREAM__FIRST_BYTE_TIMEOUT_SECONDS",
            k.deadline.as_secs_f64().to_string(),
        )
        .env("CONDENSE_UPSTREAM__LEARN_WINDOWS", "false")
        .env("RUST_LOG", log.as_deref().unwrap_or(QUIET))
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| give_up(&format!("cannot start {binary}: {e}")));
    let stderr = child.stderr.take().unwrap();
    let warnings = Arc::new(Mutex::new((0usize, Vec::new())));
    let kept = warnings.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut copy = log_file.map(|path| std::fs::File::create(path).unwrap());
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(f) = &mut copy {
                use std::io::Write;
                let _ = writeln!(f, "{line}");
            }
            if let Some(rest) = line.split("listen=").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            } else if line.contains("WARN") || line.contains("ERROR") {
                // Without its timestamp, each kind once.
                let line = line
                    .split_once(' ')
                    .map_or(line.as_str(), |(_, l)| l)
                    .trim();
                let mut kept = kept.lock().unwrap();
                kept.0 += 1;
                if kept.1.len() < 3 && !kept.1.iter().any(|l| l == line) {
                    kept.1.push(line.to_string());
                }
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| give_up(&format!("{binary} did not start")));
    Condense {
        child,
        addr: addr.parse().unwrap(),
        warnings,
    }
}

/// Says why the bench cannot run, and stops it.
fn give_up(why: &str) -> ! {
    eprintln!("concurrency bench: {why}");
    std::process::exit(2)
}

/// A process's peak resident memory (`VmHWM`), in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Raises the soft open-file limit to `need` (at most the hard limit):
/// every client socket is a descriptor here, and each stream takes two in
/// condense, which inherits the limit and sizes its caps by it. Returns
/// the soft limit now.
fn raise_open_files(need: u64) -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.is_none_or(|soft| soft >= need) {
        return limit.current.unwrap_or(u64::MAX);
    }
    limit.current = Some(limit.maximum.map_or(need, |hard| hard.min(need)));
    let _ = setrlimit(Resource::Nofile, limit);
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------
// The clients

fn chat_body(model: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": model,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write a haiku about queues."}
            ],
            "stream": true,
        })
        .to_string(),
    )
}

/// How one stream ended.
enum Outcome {
    /// `[DONE]` arrived; the first body byte came this long after sending.
    Done(Duration),
    Status(u16),
    /// A 200 whose stream ended without `[DONE]` (condense writes an error
    /// event when the upstream fails mid-stream): what ended it.
    Cut(String),
    /// No answer: the connection to condense failed, or the stream stalled.
    Broken(String),
}

/// A keep-alive HTTP/1.1 connection to condense.
async fn connect(addr: SocketAddr) -> http1::SendRequest<Full<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| give_up(&format!("cannot connect to condense: {e}")));
    let _ = tcp.set_nodelay(true);
    let (tx, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    tx
}

/// The end of a stream kept to check it and describe a broken one.
const TAIL: usize = 300;

/// Posts a streamed chat request and reads the answer to its end.
async fn stream_once(
    tx: &mut http1::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    body: Bytes,
) -> Outcome {
    if let Err(e) = tx.ready().await {
        return Outcome::Broken(e.to_string());
    }
    let req = http::Request::post("/v1/chat/completions")
        .header(http::header::HOST, addr.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::AUTHORIZATION, "Bearer sk-bench")
        .body(Full::new(body))
        .unwrap();
    let sent = Instant::now();
    let resp = match tx.send_request(req).await {
        Ok(r) => r,
        Err(e) => return Outcome::Broken(e.to_string()),
    };
    let status = resp.status();
    let mut body = resp.into_body();
    let mut first = None;
    let mut tail = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(data) = f.data_ref().filter(|d| !d.is_empty()) {
                    first.get_or_insert_with(|| sent.elapsed());
                    tail.extend_from_slice(data);
                    let cut = tail.len().saturating_sub(TAIL);
                    tail.drain(..cut);
                }
            }
            Err(e) if status == http::StatusCode::OK => return Outcome::Cut(e.to_string()),
            Err(e) => return Outcome::Broken(e.to_string()),
        }
    }
    match first {
        _ if status != http::StatusCode::OK => Outcome::Status(status.as_u16()),
        Some(ttfb) if tail.ends_with(DONE.as_bytes()) => Outcome::Done(ttfb),
        _ => {
            // The last event says why, when there is one.
            let tail = String::from_utf8_lossy(&tail);
            let last = tail.trim_end().rsplit("\n\n").next().unwrap_or("");
            Outcome::Cut(format!(
                "the stream ended without [DONE] after {:.1} s: {last}",
                sent.elapsed().as_secs_f64()
            ))
        }
    }
}

/// Connects every client (stream `i` to condense `i % replicas`), warms
/// each condense's pools (a quick request on each of its first
/// connections, one at a time: condense hands accepted connections to its
/// worker threads in turn), then sends every stream at once. Returns each
/// stream's condense and outcome.
async fn load(k: Knobs, targets: Vec<SocketAddr>) -> Vec<(usize, Outcome)> {
    let mut clients = Vec::with_capacity(k.streams);
    for i in 0..k.streams {
        let r = i % targets.len();
        clients.push((r, connect(targets[r]).await));
    }
    if k.warm {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (i, (r, tx)) in clients.iter_mut().enumerate() {
            if i >= 2 * workers * targets.len() {
                break;
            }
            // A warm-up that fails shows again in the burst.
            let _ = stream_once(tx, targets[*r], chat_body(WARMUP_MODEL)).await;
        }
    }
    // A stream that takes longer than this has stalled.
    let limit = k.deadline + k.first_byte + k.stream_for + Duration::from_secs(30);
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|(r, mut tx)| {
            let addr = targets[r];
            tokio::spawn(async move {
                let once = stream_once(&mut tx, addr, chat_body("gpt-4o"));
                let outcome = tokio::time::timeout(limit, once)
                    .await
                    .unwrap_or_else(|_| Outcome::Broken(format!("stalled for {limit:?}")));
                (r, outcome)
            })
        })
        .collect();
    futures_util::stream::iter(tasks)
        .then(|t| async move { t.await.unwrap() })
        .collect()
        .await
}

// ---------------------------------------------------------------------------
// The report

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    ms(sorted[((sorted.len() as f64 - 1.0) * p).round() as usize])
}

/// One row of the table: one condense process, or the total.
#[derive(Default)]
struct Row {
    streams: usize,
    ttfb: Vec<Duration>,
    /// 504: no answer within the first-byte deadline.
    past_deadline: usize,
    /// A 200 that ended without `[DONE]`.
    cut: usize,
    /// Any other status, or no answer.
    other: usize,
    tcp: usize,
    tls: usize,
    max_per_conn: usize,
    peak_streams: usize,
    rss_mib: f64,
    /// How the first cut stream and the first other failure ended.
    examples: [Option<String>; 2],
}

impl Row {
    fn add(&mut self, outcome: Outcome) {
        self.streams += 1;
        match outcome {
            Outcome::Done(t) => self.ttfb.push(t),
            Outcome::Status(504) => self.past_deadline += 1,
            Outcome::Cut(e) => {
                self.cut += 1;
                self.examples[0].get_or_insert(e);
            }
            Outcome::Status(s) => {
                self.other += 1;
                self.examples[1].get_or_insert(format!("status {s}"));
            }
            Outcome::Broken(e) => {
                self.other += 1;
                self.examples[1].get_or_insert(e);
            }
        }
    }

    /// Adds a condense process's row to the total.
    fn sum(&mut self, row: &Row) {
        self.streams += row.streams;
        self.ttfb.extend(&row.ttfb);
        self.past_deadline += row.past_deadline;
        self.cut += row.cut;
        self.other += row.other;
        self.tcp += row.tcp;
        self.tls += row.tls;
        self.max_per_conn = self.max_per_conn.max(row.max_per_conn);
        self.rss_mib += row.rss_mib;
        for (mine, theirs) in self.examples.iter_mut().zip(&row.examples) {
            if mine.is_none() {
                mine.clone_from(theirs);
            }
        }
    }

    fn errors(&self) -> usize {
        self.past_deadline + self.cut + self.other
    }

    fn print(&mut self, name: &str, k: Knobs) {
        self.ttfb.sort();
        let added: Vec<Duration> = self
            .ttfb
            .iter()
            .map(|t| t.saturating_sub(k.first_byte))
            .collect();
        let waited = added
            .iter()
            .filter(|a| **a > Duration::from_secs(1))
            .count();
        println!(
            "| {name} | {} | {} | {} / {} / {} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} | {waited} | {} / {} | {} | {} | {:.1} |",
            self.streams,
            self.ttfb.len(),
            self.past_deadline,
            self.cut,
            self.other,
            pct(&self.ttfb, 0.5),
            pct(&self.ttfb, 0.99),
            pct(&self.ttfb, 1.0),
            pct(&added, 0.5),
            pct(&added, 0.99),
            pct(&added, 1.0),
            self.tcp,
            self.tls,
            self.max_per_conn,
            self.peak_streams,
            self.rss_mib,
        );
    }
}

/// The load against `binary`'s processes; prints their rows and returns
/// what went wrong, if anything did (errors, or a first byte past the
/// deadline).
fn run(binary: (&str, &str), k: Knobs, mock: &tokio::runtime::Runtime) -> Vec<String> {
    let total_streams = Arc::new(Gauge::default());
    let sites = mock.block_on(start_mock(k, &total_streams));
    let mut condenses: Vec<Condense> = sites
        .iter()
        .enumerate()
        .map(|(i, (addr, _))| start_condense(binary.1, *addr, k, i + 1))
        .collect();
    let targets: Vec<SocketAddr> = condenses.iter().map(|c| c.addr).collect();
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let outcomes = clients.block_on(load(k, targets));
    let took = started.elapsed();
    let mut rows: Vec<Row> = (0..k.replicas).map(|_| Row::default()).collect();
    for (r, outcome) in outcomes {
        rows[r].add(outcome);
    }
    let mut total = Row::default();
    for ((row, (_, site)), c) in rows.iter_mut().zip(&sites).zip(&condenses) {
        row.tcp = site.tcp.load(Ordering::Relaxed);
        row.tls = site.tls.load(Ordering::Relaxed);
        row.max_per_conn = site
            .conns
            .lock()
            .unwrap()
            .iter()
            .map(|g| g.peak())
            .max()
            .unwrap_or(0);
        row.peak_streams = site.streams.peak();
        row.rss_mib = peak_rss_mib(c.child.id());
        total.sum(row);
    }
    total.peak_streams = total_streams.peak();
    for (i, row) in rows.iter_mut().enumerate() {
        row.print(&format!("{} #{}", binary.0, i + 1), k);
    }
    if k.replicas > 1 {
        total.print(&format!("{} total", binary.0), k);
    }
    let late = total.ttfb.iter().filter(|t| **t > k.deadline).count();
    let errors = total.errors();
    let mut notes = Vec::new();
    if errors > 0 || late > 0 {
        notes.push(format!(
            "{}: {errors} of {} streams failed ({} past the {:.0} s first-byte deadline, {} cut mid-stream, {} other), {late} more had their first byte after the deadline; the load took {:.1} s",
            binary.0,
            total.streams,
            total.past_deadline,
            k.deadline.as_secs_f64(),
            total.cut,
            total.other,
            took.as_secs_f64()
        ));
        let [cut, other] = &total.examples;
        if let Some(e) = cut {
            notes.push(format!("  a cut stream: {e}"));
        }
        if let Some(e) = other {
            notes.push(format!("  another failure: {e}"));
        }
        let failed: Vec<String> = sites
            .iter()
            .flat_map(|(_, site)| site.failed.lock().unwrap().clone())
            .collect();
        if let Some(e) = failed.first() {
            notes.push(format!(
                "  the mock's connections that ended in an error: {}, e.g. {e}",
                failed.len()
            ));
        }
        for (i, c) in condenses.iter().enumerate() {
            let (n, lines) = &*c.warnings.lock().unwrap();
            for line in lines {
                notes.push(format!("  condense #{} ({n} warnings): {line}", i + 1));
            }
        }
    }
    for c in &mut condenses {
        let _ = c.child.kill();
        let _ = c.child.wait();
    }
    clients.shutdown_background();
    notes
}

fn main() {
    let k = Knobs::from_env();
    let need = (k.streams + 1024).max(2 * k.per_replica() + 1024) as u64;
    let files = raise_open_files(need);
    if files < need {
        give_up(&format!(
            "the open-file limit is {files}, {need} are needed for {} streams; raise the hard limit (ulimit -Hn)",
            k.streams
        ));
    }
    let mut binaries = vec![(
        "this build".to_string(),
        env!("CARGO_BIN_EXE_condense").to_string(),
    )];
    for path in std::env::var("CONDENSE_BIN")
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.is_empty())
    {
        binaries.push((path.to_string(), path.to_string()));
    }
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "concurrency bench: {} streams over {} condense process(es) ({workers} worker threads each), all sent at once{}; the upstream allows {} streams a connection, answers after {:.0} ms and streams for {:.1} s (a chunk every {:.0} ms); first-byte deadline {:.0} s; open-file limit {files}\n",
        k.streams,
        k.replicas,
        if k.warm {
            ", pools warmed first"
        } else {
            " to cold pools"
        },
        k.per_connection,
        ms(k.first_byte),
        k.stream_for.as_secs_f64(),
        ms(k.chunk_every),
        k.deadline.as_secs_f64(),
    );
    println!(
        "| condense | streams | completed | errors: 504 past deadline / cut mid-stream / other | TTFB ms p50 / p99 / max | added to the upstream's {:.0} ms: p50 / p99 / max | waited > 1 s | upstream connections TCP / TLS | max streams on a connection | peak streams at once | peak RSS MiB |",
        ms(k.first_byte)
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mock = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let notes: Vec<String> = binaries
        .iter()
        .flat_map(|(name, path)| run((name, path), k, &mock))
        .collect();
    mock.shutdown_background();
    if !notes.is_empty() {
        println!("\nFAILED\n{}", notes.join("\n"));
        std::process::exit(1);
    }
}
