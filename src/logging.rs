//! Log setup: `tracing` to stderr, text or JSON, filtered by `log.level` or
//! `RUST_LOG`. Nothing logs header values; `Authorization` and key headers
//! are additionally marked sensitive by the server's layer stack.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

pub fn init(config: &LogConfig) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_new(&config.level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    // A second init (tests) keeps the first subscriber; that is fine.
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
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
