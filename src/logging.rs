//! Log setup: `tracing` to stderr, text or JSON, filtered by `log.level` or
//! `RUST_LOG`. Nothing logs header values; `Authorization` and key headers
//! are additionally marked sensitive by the server's front.
//!
//! The access line (one per request, the event named [`ACCESS_EVENT`]) is
//! formatted by tracing-subscriber like every other line, but the thread
//! that served the request does not write it: it queues the line and goes
//! on, and a writer thread writes what has queued to stderr in one call,
//! [`GATHER`] after the first line of a batch arrived (as nginx's
//! `access_log ... flush=` does). A serving thread spends no system call on
//! the line, and under load one write carries many lines. The lines keep
//! their order; a line waits at most [`GATHER`] for others to join it, plus
//! any write under way, and all of them are written before the process
//! exits ([`flush`], after the server has drained). If stderr blocks
//! (nobody reads it), the queue holds [`QUEUED`] lines beside the batch
//! being written, and then serving threads wait for room, as they waited on
//! the write before: no line is dropped. Every other line goes straight to
//! stderr.
//!
//! The writer is hand-written because it saves more than 10 µs a request
//! over the maintained one, tracing-appender's `non_blocking` (lossless,
//! the same queue bound), which wakes its thread and writes once per line.
//! Side by side in one run (`BENCH_ACCESS_LOG=1 BENCH_BASELINE=<the other
//! build> cargo bench --bench passthrough`, one connection, 3,000 requests
//! a body), `non_blocking` cost 14 to 36 µs more of condense's CPU a small
//! request (87 against 73 µs for a small JSON request, 153 against 117 for
//! a small stream) and up to 39 µs more at p50. The formatter is
//! tracing-subscriber's: the hand-written copy of its output (with its own
//! calendar) that was here saved 0 to 6 µs a request, within the noise, in
//! a run of the old build beside this one (87 against 93 µs for a small
//! JSON request, the same p50 within 3 µs).

use std::io::{IsTerminal, Write as _};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tracing::{Dispatch, Metadata};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::writer::MakeWriterExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::config::{LogConfig, LogFormat};

/// The target of the access line, the one it has always had.
pub const ACCESS_TARGET: &str = "condense::server";

/// The name of the access line's event, which sends it to the writer
/// thread. Neither format writes event names.
pub const ACCESS_EVENT: &str = "access";

/// The writer thread's queue, once `init` started it.
static WRITER: OnceLock<&'static Writer> = OnceLock::new();

/// How long the writer waits, after a batch's first line, for more lines to
/// write with it.
pub const GATHER: Duration = Duration::from_millis(2);

/// Lines queued before serving threads wait for the writer.
pub const QUEUED: usize = 16_384;

pub fn init(config: &LogConfig) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_new(&config.level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal();
    // It lives as long as the process, as its thread does.
    let writer = Writer::spawn(Box::new(|out: &[u8]| {
        // As tracing-subscriber writes: stderr's lock, one call.
        let _ = std::io::stderr().lock().write_all(out);
    }));
    let queued = Queued(writer.as_ref().ok().copied());
    let dispatch = subscriber(config.format, ansi, filter, queued, std::io::stderr);
    // A second init (tests) keeps the first subscriber; that is fine.
    if dispatch.try_init().is_ok() {
        match writer {
            Ok(w) => {
                let _ = WRITER.set(w);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the log writer; access lines are written as they come");
            }
        }
    }
}

/// Returns once every access line queued so far is written to stderr.
/// The server calls it after draining, so no line is lost at exit.
pub fn flush() {
    if let Some(w) = WRITER.get() {
        w.flush();
    }
}

/// The subscriber [`init`] installs: tracing-subscriber's format, access
/// lines written to `access`, every other line to `rest`.
fn subscriber<A, R>(
    format: LogFormat,
    ansi: bool,
    filter: EnvFilter,
    access: A,
    rest: R,
) -> Dispatch
where
    A: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    R: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let writer = access.with_filter(is_access_line).or_else(rest);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    match format {
        LogFormat::Text => Dispatch::new(builder.finish()),
        LogFormat::Json => Dispatch::new(builder.json().finish()),
    }
}

fn is_access_line(meta: &Metadata<'_>) -> bool {
    meta.name() == ACCESS_EVENT && meta.target() == ACCESS_TARGET
}

/// Where tracing-subscriber writes an access line: the writer thread's
/// queue (stderr, if the thread could not start). The line comes in one
/// write.
#[derive(Clone, Copy)]
struct Queued(Option<&'static Writer>);

impl std::io::Write for Queued {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        match self.0 {
            Some(w) => w.push(line),
            None => std::io::stderr().write_all(line)?,
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Queued {
    type Writer = Queued;

    fn make_writer(&'a self) -> Queued {
        *self
    }
}

/// Where the writer puts a batch of lines.
type Sink = Box<dyn Fn(&[u8]) + Send + Sync>;

/// The access lines waiting for the writer thread, and what it has done.
struct Writer {
    /// Where a batch goes: stderr, as tracing-subscriber writes to it.
    sink: Sink,
    queue: Mutex<Queue>,
    /// The writer waits here for a first line, or for a flush.
    wake: Condvar,
    /// Serving threads wait here for room, and `flush` for the writer.
    written: Condvar,
}

#[derive(Default)]
struct Queue {
    /// Whole lines, as tracing-subscriber formatted them.
    bytes: Vec<u8>,
    lines: usize,
    /// Lines ever queued and ever written: a flush waits until the second
    /// reaches what the first was when it was called.
    queued: u64,
    written: u64,
    /// The writer waits for a first line (a push must wake it).
    idle: bool,
    /// A flush waits: the writer writes without gathering.
    urgent: bool,
    /// Threads waiting on `written`.
    waiting: usize,
}

impl Writer {
    /// A writer for `sink`, its thread started.
    fn spawn(sink: Sink) -> std::io::Result<&'static Writer> {
        let w: &'static Writer = Box::leak(Box::new(Writer {
            sink,
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            written: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("condense-log".into())
            .spawn(move || w.run())?;
        Ok(w)
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock leaves nothing half done.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `line`; waits while the queue is full.
    fn push(&self, line: &[u8]) {
        let mut q = self.lock();
        while q.lines >= QUEUED {
            q.waiting += 1;
            q = self.written.wait(q).unwrap_or_else(|p| p.into_inner());
            q.waiting -= 1;
        }
        q.bytes.extend_from_slice(line);
        q.lines += 1;
        q.queued += 1;
        // The writer sleeps until a first line, and gathers until the queue
        // is full.
        if q.idle || q.lines >= QUEUED {
            q.idle = false;
            self.wake.notify_one();
        }
    }

    fn flush(&self) {
        let mut q = self.lock();
        let target = q.queued;
        while q.written < target {
            q.urgent = true;
            self.wake.notify_one();
            q.waiting += 1;
            q = self.written.wait(q).unwrap_or_else(|p| p.into_inner());
            q.waiting -= 1;
        }
    }

    /// The writer thread: waits for a line, gathers for [`GATHER`] and
    /// writes the batch in one call; for ever.
    fn run(&self) {
        let mut batch = Vec::with_capacity(64 * 1024);
        loop {
            let mut q = self.lock();
            while q.lines == 0 {
                q.idle = true;
                q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            q.idle = false;
            if !q.urgent {
                q = self
                    .wake
                    .wait_timeout_while(q, GATHER, |q| !q.urgent && q.lines < QUEUED)
                    .map_or_else(|p| p.into_inner().0, |(q, _)| q);
            }
            q.urgent = false;
            std::mem::swap(&mut q.bytes, &mut batch);
            let n = std::mem::take(&mut q.lines) as u64;
            if q.waiting > 0 {
                // Room again for serving threads that waited.
                self.written.notify_all();
            }
            drop(q);
            (self.sink)(&batch);
            batch.clear();
            // What a burst grew is given back (the queue gets this room at
            // the next swap).
            batch.shrink_to(64 * 1024);
            let mut q = self.lock();
            q.written += n;
            if q.waiting > 0 {
                self.written.notify_all();
            }
        }
    }
}

/// One request's access line.
pub struct AccessLine {
    pub method: http::Method,
    /// Clipped to [`MAX_LOGGED`].
    pub path: String,
    pub status: u16,
    pub request_id: http::HeaderValue,
    pub headers_ms: f64,
}

impl AccessLine {
    /// Whether access lines are logged at all (`RUST_LOG`, `log.level`).
    pub fn enabled() -> bool {
        tracing::enabled!(target: ACCESS_TARGET, tracing::Level::INFO)
    }

    /// Logs the line; with the subscriber [`init`] installed, it is queued
    /// for the writer thread.
    pub fn log(self) {
        tracing::info!(
            name: ACCESS_EVENT,
            target: ACCESS_TARGET,
            method = %self.method,
            path = self.path.as_str(),
            status = self.status,
            request_id = self.request_id.to_str().unwrap_or(""),
            headers_ms = self.headers_ms,
            "request"
        );
    }
}

/// Longest client-chosen string (model name, path) put into a log line.
pub const MAX_LOGGED: usize = 256;

/// `s` cut to [`MAX_LOGGED`] bytes (at a character boundary), so a client
/// cannot make every log line as long as its request.
pub fn clip(s: &str) -> &str {
    if s.len() <= MAX_LOGGED {
        return s;
    }
    let mut end = MAX_LOGGED;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    /// `init`'s subscriber without colours, access lines to `access`, the
    /// rest to the returned buffer.
    fn captured<A>(format: LogFormat, access: A) -> (Dispatch, Captured)
    where
        A: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    {
        let rest = Captured::default();
        let writer = rest.clone();
        let dispatch = subscriber(format, false, EnvFilter::new("info"), access, move || {
            writer.clone()
        });
        (dispatch, rest)
    }

    /// `text` with its timestamp (the first RFC 3339 one, with
    /// microseconds, in UTC) made `<t>`.
    fn untimed(text: &str) -> String {
        let start = text.find("20").unwrap();
        let end = start + text[start..].find('Z').unwrap() + 1;
        let t = &text.as_bytes()[start..end];
        assert_eq!(t.len(), "2026-11-24T03:36:37.846460Z".len(), "{text}");
        for (i, c) in t.iter().enumerate() {
            let sep = match i {
                4 | 7 => Some(b'-'),
                10 => Some(b'T'),
                13 | 16 => Some(b':'),
                19 => Some(b'.'),
                26 => Some(b'Z'),
                _ => None,
            };
            assert!(sep.map_or(c.is_ascii_digit(), |s| *c == s), "{text}");
        }
        format!("{}<t>{}", &text[..start], &text[end..])
    }

    #[test]
    fn the_access_line_says_what_it_always_said_and_only_it_is_queued() {
        let line = |path: &str| AccessLine {
            method: http::Method::POST,
            path: path.to_string(),
            status: 200,
            request_id: http::HeaderValue::from_static("trace-1:a/b+c="),
            headers_ms: 0.123456789,
        };
        let odd = "/v1/\"quoted\"\\back/é/\u{7}/tab\t";
        for (format, expected) in [
            (
                LogFormat::Text,
                [
                    r#"<t>  INFO condense::server: request method=POST path="/v1/chat/completions" status=200 request_id="trace-1:a/b+c=" headers_ms=0.123456789"#,
                    r#"<t>  INFO condense::server: request method=POST path="/v1/\"quoted\"\\back/é/\u{7}/tab\t" status=200 request_id="trace-1:a/b+c=" headers_ms=0.123456789"#,
                ],
            ),
            (
                LogFormat::Json,
                [
                    r#"{"timestamp":"<t>","level":"INFO","fields":{"message":"request","method":"POST","path":"/v1/chat/completions","status":200,"request_id":"trace-1:a/b+c=","headers_ms":0.123456789},"target":"condense::server"}"#,
                    r#"{"timestamp":"<t>","level":"INFO","fields":{"message":"request","method":"POST","path":"/v1/\"quoted\"\\back/é/\u0007/tab\t","status":200,"request_id":"trace-1:a/b+c=","headers_ms":0.123456789},"target":"condense::server"}"#,
                ],
            ),
        ] {
            for (path, expected) in ["/v1/chat/completions", odd].into_iter().zip(expected) {
                let access = Captured::default();
                let writer = access.clone();
                let (dispatch, rest) = captured(format, move || writer.clone());
                tracing::dispatcher::with_default(&dispatch, || {
                    line(path).log();
                    // The server's other lines, of the same target.
                    tracing::info!(target: ACCESS_TARGET, "shutdown signal received");
                });
                assert_eq!(
                    untimed(&access.text()),
                    format!("{expected}\n"),
                    "{format:?}"
                );
                let rest = rest.text();
                assert!(rest.contains("shutdown signal received"), "{rest}");
                assert!(!rest.contains("request"), "{rest}");
            }
        }
    }

    fn line(id: &str) -> AccessLine {
        AccessLine {
            method: http::Method::POST,
            path: "/v1/chat/completions".into(),
            status: 200,
            request_id: http::HeaderValue::from_str(id).unwrap(),
            headers_ms: 0.5,
        }
    }

    /// A writer whose batches land in the returned buffer, each after
    /// `gate` lets it (and `delay`), and `init`'s subscriber queueing
    /// access lines for it.
    fn captured_writer(
        delay: Duration,
        gate: Arc<(Mutex<bool>, Condvar)>,
    ) -> (&'static Writer, Dispatch, Captured) {
        let out = Captured::default();
        let sink = out.clone();
        let writer = Writer::spawn(Box::new(move |batch: &[u8]| {
            let (open, opened) = &*gate;
            drop(opened.wait_while(open.lock().unwrap(), |o| !*o).unwrap());
            std::thread::sleep(delay);
            sink.0.lock().unwrap().extend_from_slice(batch);
        }))
        .unwrap();
        let (dispatch, _) = captured(LogFormat::Text, Queued(Some(writer)));
        (writer, dispatch, out)
    }

    /// The request ids of the access lines in `out`, in their order; every
    /// line must be whole.
    fn ids(out: &Captured) -> Vec<String> {
        out.text()
            .lines()
            .map(|l| {
                assert!(l.ends_with("headers_ms=0.5"), "{l}");
                l.split("request_id=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn queued_lines_are_written_whole_in_order_and_flush_waits_for_them() {
        let gate = Arc::new((Mutex::new(true), Condvar::new()));
        // A slow stderr: each write takes 20 ms.
        let (writer, dispatch, out) = captured_writer(Duration::from_millis(20), gate);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let dispatch = dispatch.clone();
                std::thread::spawn(move || {
                    tracing::dispatcher::with_default(&dispatch, || {
                        for i in 0..2_000 {
                            line(&format!("t{t}-{i:05}")).log();
                        }
                    })
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        writer.flush();
        let ids = ids(&out);
        assert_eq!(ids.len(), 8_000);
        for t in 0..4 {
            let own: Vec<&String> = ids
                .iter()
                .filter(|i| i.starts_with(&format!("t{t}-")))
                .collect();
            let expected: Vec<String> = (0..2_000).map(|i| format!("t{t}-{i:05}")).collect();
            assert_eq!(own, expected.iter().collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_blocked_stderr_makes_serving_threads_wait_and_loses_no_line() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (writer, dispatch, out) = captured_writer(Duration::ZERO, gate.clone());
        let total = 3 * QUEUED;
        let pushed = Arc::new(AtomicUsize::new(0));
        let counter = pushed.clone();
        let pusher = std::thread::spawn(move || {
            tracing::dispatcher::with_default(&dispatch, || {
                for i in 0..total {
                    line(&format!("l{i:06}")).log();
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            })
        });
        // One batch is held in the blocked write, one queue's worth waits:
        // the pusher stalls there (however slowly a loaded machine gets it
        // there). One that never stalls pushes all of them.
        let mut stuck = 0;
        for _ in 0..300 {
            std::thread::sleep(Duration::from_millis(200));
            let now = pushed.load(Ordering::SeqCst);
            if now == stuck && now >= QUEUED {
                break;
            }
            stuck = now;
        }
        assert!((QUEUED..=2 * QUEUED).contains(&stuck), "{stuck} pushed");
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        pusher.join().unwrap();
        writer.flush();
        let expected: Vec<String> = (0..total).map(|i| format!("l{i:06}")).collect();
        assert_eq!(ids(&out), expected);
    }

    #[test]
    fn long_strings_are_clipped_at_a_character_boundary() {
        assert_eq!(clip("gpt-4o"), "gpt-4o");
        let long = "é".repeat(200);
        let c = clip(&long);
        assert!(
            c.len() <= MAX_LOGGED && c.chars().all(|ch| ch == 'é'),
            "{}",
            c.len()
        );
    }
}
