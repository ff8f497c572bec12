//! Log setup: `tracing` to stderr, text or JSON, filtered by `log.level` or
//! `RUST_LOG`. Nothing logs header values; `Authorization` and key headers
//! are additionally marked sensitive by the server's front.
//!
//! The access line (one per request) has a formatter of its own, which
//! writes what tracing-subscriber's would, byte for byte (a test compares
//! them): through tracing-subscriber (a timestamp, styling that does
//! nothing without colours, a visitor per field) a small request cost
//! 103,000 instructions, with it 97,000; the line, its task and its write
//! now take about 7,000 of them.

use std::io::{IsTerminal, Write as _};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing_subscriber::EnvFilter;

use crate::chat::object::write_json_string;
use crate::config::{LogConfig, LogFormat};

/// The target of the access line, the one it has always had.
pub const ACCESS_TARGET: &str = "condense::server";

/// The format `init` set up when the logs are plain (stderr is not a
/// terminal, so no colours): the access line is then written by
/// [`AccessLine::write`]'s own formatter.
static PLAIN: OnceLock<LogFormat> = OnceLock::new();

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
        let _ = PLAIN.set(config.format);
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

    /// Writes the line: with condense's formatter when the logs are plain,
    /// else through tracing (colours, or a subscriber `init` did not set).
    pub fn write(self) {
        match PLAIN.get() {
            Some(&format) => {
                let mut line = Vec::with_capacity(256);
                self.format(format, SystemTime::now(), &mut line);
                let _ = std::io::stderr().lock().write_all(&line);
            }
            None => self.through_tracing(),
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
    let _ = write!(
        out,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60,
        since.subsec_micros()
    );
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
