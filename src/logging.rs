//! Log setup: `tracing` to stderr, text or JSON, filtered by `log.level` or
//! `RUST_LOG`. Nothing logs header values; `Authorization` and key headers
//! are additionally marked sensitive by the server's front.
//!
//! The access line (one per request) has a formatter of its own, which
//! writes what tracing-subscriber's would, byte for byte (a test compares
//! them): through tracing-subscriber (a timestamp, styling that does
//! nothing without colours, a visitor per field) a small request cost
//! 103,000 instructions, with it 97,000.
//!
//! Nor is it written by the thread that served the request: that thread
//! queues the line's fields and goes on, and a writer thread formats what
//! has queued and writes it to stderr in one call, [`GATHER`] after the
//! first line of a batch arrived (as nginx's `access_log ... flush=` does).
//! A serving thread spends no task, no formatting and no system call on
//! the line, and under load one write carries many lines. The lines keep
//! their order and their timestamps (taken when queued); a line waits at
//! most [`GATHER`] for others to join it, plus any write under way, and
//! all of them are written before the process exits ([`flush`], after the
//! server has drained). If stderr blocks (nobody reads it), the queue
//! holds [`QUEUED`] lines beside the batch being written, and then serving
//! threads wait for room, as they waited on the write before: no line is
//! dropped.

use std::io::{IsTerminal, Write as _};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing_subscriber::EnvFilter;

use crate::chat::object::write_json_string;
use crate::config::{LogConfig, LogFormat};

/// The target of the access line, the one it has always had.
pub const ACCESS_TARGET: &str = "condense::server";

/// The writer thread's queue, when `init` set up plain logs (stderr is not
/// a terminal, so no colours): access lines are then formatted by
/// [`AccessLine::format`] and written by the writer thread.
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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    // A second init (tests) keeps the first subscriber; that is fine.
    let installed = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if installed.is_ok() && !ansi {
        Writer::start(config.format);
    }
}

/// Returns once every access line queued so far is written to stderr.
/// The server calls it after draining, so no line is lost at exit.
pub fn flush() {
    if let Some(w) = WRITER.get() {
        w.flush();
    }
}

/// Where the writer puts a batch of lines.
type Sink = Box<dyn Fn(&[u8]) + Send + Sync>;

/// The access lines waiting for the writer thread, and what it has done.
struct Writer {
    format: LogFormat,
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
    lines: Vec<(AccessLine, SystemTime)>,
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
    /// Starts the writer thread; if it cannot start, access lines go
    /// through tracing as before.
    fn start(format: LogFormat) {
        if WRITER.get().is_some() {
            return;
        }
        // As tracing-subscriber writes: stderr's lock, one call.
        let sink = |out: &[u8]| {
            let _ = std::io::stderr().lock().write_all(out);
        };
        // It lives as long as the process, as its thread does.
        match Writer::spawn(format, Box::new(sink)) {
            Ok(w) => {
                let _ = WRITER.set(w);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the log writer; access lines go through tracing");
            }
        }
    }

    /// A writer for `sink`, its thread started.
    fn spawn(format: LogFormat, sink: Sink) -> std::io::Result<&'static Writer> {
        let w: &'static Writer = Box::leak(Box::new(Writer {
            format,
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
    fn push(&self, line: AccessLine, at: SystemTime) {
        let mut q = self.lock();
        while q.lines.len() >= QUEUED {
            q.waiting += 1;
            q = self.written.wait(q).unwrap_or_else(|p| p.into_inner());
            q.waiting -= 1;
        }
        q.lines.push((line, at));
        q.queued += 1;
        // The writer sleeps until a first line, and gathers until the queue
        // is full.
        if q.idle || q.lines.len() >= QUEUED {
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

    /// The writer thread: waits for a line, gathers for [`GATHER`], formats
    /// the batch and writes it in one call; for ever.
    fn run(&self) {
        let mut batch = Vec::new();
        let mut out = Vec::with_capacity(64 * 1024);
        loop {
            let mut q = self.lock();
            while q.lines.is_empty() {
                q.idle = true;
                q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            q.idle = false;
            if !q.urgent {
                q = self
                    .wake
                    .wait_timeout_while(q, GATHER, |q| !q.urgent && q.lines.len() < QUEUED)
                    .map_or_else(|p| p.into_inner().0, |(q, _)| q);
            }
            q.urgent = false;
            std::mem::swap(&mut q.lines, &mut batch);
            let n = batch.len() as u64;
            if q.waiting > 0 {
                // Room again for serving threads that waited.
                self.written.notify_all();
            }
            drop(q);
            for (line, at) in batch.drain(..) {
                line.format(self.format, at, &mut out);
            }
            (self.sink)(&out);
            out.clear();
            // What a burst grew is given back (the queue gets `batch`'s
            // room at the next swap).
            out.shrink_to(64 * 1024);
            batch.shrink_to(1024);
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

    /// Logs the line: queued for the writer thread when the logs are plain,
    /// else through tracing (colours, or a subscriber `init` did not set)
    /// once the response is on its way.
    pub fn log(self) {
        match WRITER.get() {
            Some(w) => w.push(self, SystemTime::now()),
            None => {
                tokio::spawn(async move { self.through_tracing() });
            }
        }
    }

    /// The line as a tracing event, for the subscriber to format.
    fn through_tracing(&self) {
        tracing::info!(
            target: ACCESS_TARGET,
            method = %self.method,
            path = self.path.as_str(),
            status = self.status,
            request_id = self.request_id.to_str().unwrap_or(""),
            headers_ms = self.headers_ms,
            "request"
        );
    }

    /// The line as tracing-subscriber's `Full` text or `Json` format writes
    /// that event without colours.
    fn format(&self, format: LogFormat, now: SystemTime, out: &mut Vec<u8>) {
        let request_id = self.request_id.to_str().unwrap_or("");
        // Writing into a Vec cannot fail.
        match format {
            LogFormat::Text => {
                write_timestamp(now, out);
                let _ = writeln!(
                    out,
                    "  INFO {ACCESS_TARGET}: request method={} path={:?} status={} request_id={:?} headers_ms={:?}",
                    self.method, self.path, self.status, request_id, self.headers_ms
                );
            }
            LogFormat::Json => {
                out.extend_from_slice(b"{\"timestamp\":\"");
                write_timestamp(now, out);
                out.extend_from_slice(
                    b"\",\"level\":\"INFO\",\"fields\":{\"message\":\"request\",\"method\":",
                );
                write_json_string(out, self.method.as_str());
                out.extend_from_slice(b",\"path\":");
                write_json_string(out, &self.path);
                let _ = write!(out, ",\"status\":{},\"request_id\":", self.status);
                write_json_string(out, request_id);
                out.extend_from_slice(b",\"headers_ms\":");
                let _ = serde_json::to_writer(&mut *out, &self.headers_ms);
                let _ = writeln!(out, "}},\"target\":\"{ACCESS_TARGET}\"}}");
            }
        }
    }
}

/// `now` as tracing-subscriber's default timer writes it: RFC 3339 in UTC
/// with microseconds (`2026-11-24T03:36:37.846460Z`).
fn write_timestamp(now: SystemTime, out: &mut Vec<u8>) {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // By hand: `write!` with padded fields cost 2,000 instructions a line.
    let year = u64::try_from(year).unwrap_or(0);
    let (month, day) = (month as u64, day as u64);
    for (n, width, then) in [
        (year, 4, b'-'),
        (month, 2, b'-'),
        (day, 2, b'T'),
        (rem / 3_600, 2, b':'),
        (rem % 3_600 / 60, 2, b':'),
        (rem % 60, 2, b'.'),
        (u64::from(since.subsec_micros()), 6, b'Z'),
    ] {
        push_padded(out, n, width);
        out.push(then);
    }
}

/// `n` in decimal, zero-padded to `width` digits (more if it needs them).
fn push_padded(out: &mut Vec<u8>, n: u64, width: usize) {
    let mut digits = [b'0'; 20];
    let mut at = digits.len();
    let mut rest = n;
    while rest > 0 || at == digits.len() {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    let at = at.min(digits.len() - width.min(digits.len()));
    out.extend_from_slice(&digits[at..]);
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
    use std::sync::{Arc, Mutex};
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

    /// What tracing-subscriber writes for `line` in `format`, colours off.
    fn tracing_writes(format: LogFormat, line: &AccessLine) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone());
        let event = || line.through_tracing();
        match format {
            LogFormat::Text => tracing::subscriber::with_default(builder.finish(), event),
            LogFormat::Json => tracing::subscriber::with_default(builder.json().finish(), event),
        }
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    /// `text` with its timestamp (the first RFC 3339 one) made `<t>`.
    fn untimed(text: &str) -> String {
        let start = text.find("20").unwrap();
        let end = start + text[start..].find('Z').unwrap() + 1;
        format!("{}<t>{}", &text[..start], &text[end..])
    }

    #[test]
    fn the_access_line_is_what_tracing_subscriber_writes() {
        let paths = [
            "/v1/chat/completions",
            "/v1/\"quoted\"\\back/é/\u{7}/tab\t",
            "",
        ];
        for (i, path) in paths.iter().enumerate() {
            for headers_ms in [0.0, 1.0, 0.123456789, 1e-7, 12345.678] {
                let line = AccessLine {
                    method: if i == 1 {
                        http::Method::GET
                    } else {
                        http::Method::POST
                    },
                    path: path.to_string(),
                    status: [200, 401, 502][i],
                    request_id: http::HeaderValue::from_static("trace-1:a/b+c="),
                    headers_ms,
                };
                for format in [LogFormat::Text, LogFormat::Json] {
                    let mut ours = Vec::new();
                    line.format(format, SystemTime::now(), &mut ours);
                    let ours = String::from_utf8(ours).unwrap();
                    let theirs = tracing_writes(format, &line);
                    assert_eq!(untimed(&ours), untimed(&theirs), "{format:?}");
                }
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
    /// `gate` lets it (and `delay`).
    fn captured_writer(
        delay: Duration,
        gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
    ) -> (&'static Writer, Captured) {
        let out = Captured::default();
        let sink = out.clone();
        let writer = Writer::spawn(
            LogFormat::Text,
            Box::new(move |batch: &[u8]| {
                let (open, opened) = &*gate;
                drop(opened.wait_while(open.lock().unwrap(), |o| !*o).unwrap());
                std::thread::sleep(delay);
                sink.0.lock().unwrap().extend_from_slice(batch);
            }),
        )
        .unwrap();
        (writer, out)
    }

    /// The request ids of the access lines in `out`, in their order; every
    /// line must be whole.
    fn ids(out: &Captured) -> Vec<String> {
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text.lines()
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
        let gate = Arc::new((Mutex::new(true), std::sync::Condvar::new()));
        // A slow stderr: each write takes 20 ms.
        let (writer, out) = captured_writer(Duration::from_millis(20), gate);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        writer.push(line(&format!("t{t}-{i:05}")), SystemTime::now());
                    }
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
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let (writer, out) = captured_writer(Duration::ZERO, gate.clone());
        let total = 3 * QUEUED;
        let pushed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = pushed.clone();
        let pusher = std::thread::spawn(move || {
            for i in 0..total {
                writer.push(line(&format!("l{i:06}")), SystemTime::now());
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        // One batch is held in the blocked write, one queue's worth waits.
        std::thread::sleep(Duration::from_millis(300));
        let stuck = pushed.load(std::sync::atomic::Ordering::SeqCst);
        assert!((QUEUED..=2 * QUEUED).contains(&stuck), "{stuck} pushed");
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        pusher.join().unwrap();
        writer.flush();
        let expected: Vec<String> = (0..total).map(|i| format!("l{i:06}")).collect();
        assert_eq!(ids(&out), expected);
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_microseconds() {
        for (secs, micros, expected) in [
            (0, 0, "1970-01-01T00:00:00.000000Z"),
            (951_782_400, 7, "2000-02-29T00:00:00.000007Z"),
            (1_795_491_397, 846_460, "2026-11-24T03:36:37.846460Z"),
            (1_709_251_199, 999_999, "2024-02-29T23:59:59.999999Z"),
            (4_107_542_399, 500_000, "2100-02-28T23:59:59.500000Z"),
        ] {
            let at = UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros);
            let mut out = Vec::new();
            write_timestamp(at, &mut out);
            assert_eq!(String::from_utf8(out).unwrap(), expected);
        }
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
