//! Configuration errors, worded so that they never show a secret.
//!
//! figment's own messages quote the value that failed (`found string
//! "team-key-1, team-key-2", expected a sequence`), and a TOML syntax error
//! quotes the line it is on. For the keys that hold credentials (client and
//! API keys, URLs that may carry a password) the message names the key, the
//! variable or file it came from, and what is wrong with the value (its
//! kind, what was expected), never the value itself.

use std::path::PathBuf;

use figment::error::{Actual, Kind};

use super::env;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration file {0} does not exist")]
    MissingFile(PathBuf),
    /// figment's errors, already worded (see `describe`).
    #[error("invalid configuration: {0}")]
    Figment(String),
    #[error("invalid configuration: {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
}

impl From<figment::Error> for ConfigError {
    fn from(e: figment::Error) -> Self {
        ConfigError::Figment(describe(e))
    }
}

/// The keys whose values may hold a credential.
const SECRET_KEYS: [&[&str]; 8] = [
    &["auth", "client_keys"],
    &["upstream", "api_key"],
    &["upstream", "anthropic_api_key"],
    &["summary", "api_key"],
    &["state", "redis_url"],
    &["upstream", "base_url"],
    &["upstream", "anthropic_base_url"],
    &["summary", "base_url"],
];

/// Every error figment reports, one after the other.
fn describe(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| describe_one(&e))
        .collect::<Vec<_>>()
        .join("; ")
}

fn describe_one(e: &figment::Error) -> String {
    let from = origin(e);
    let what = if holds_secret(&e.path) {
        format!("{} (the value is not shown)", redacted(&e.kind))
    } else {
        match &e.kind {
            Kind::Message(m) => without_source_lines(m),
            kind => kind.to_string(),
        }
    };
    match (e.path.is_empty(), from) {
        (true, Some(from)) => format!("{from}: {what}"),
        (true, None) => what,
        (false, Some(from)) => format!("{} (from {from}): {what}", e.path.join(".")),
        (false, None) => format!("{}: {what}", e.path.join(".")),
    }
}

/// Where the failing value came from: the environment variable, the file,
/// or the provider's name.
fn origin(e: &figment::Error) -> Option<String> {
    let md = e.metadata.as_ref()?;
    if md.name.contains("environment variable") && !e.path.is_empty() {
        return Some(format!(
            "environment variable {}",
            env::variable_for(&e.path)
        ));
    }
    match &md.source {
        Some(figment::Source::File(path)) => Some(path.display().to_string()),
        _ => Some(md.name.to_string()),
    }
}

/// Whether a value at `path` may be, hold, or be held by a secret (the
/// whole document, at no path, is not: its errors are a parser's).
fn holds_secret(path: &[String]) -> bool {
    !path.is_empty()
        && SECRET_KEYS
            .iter()
            .any(|key| key.iter().zip(path).all(|(k, p)| p.eq_ignore_ascii_case(k)))
}

/// What is wrong, without the value.
fn redacted(kind: &Kind) -> String {
    match kind {
        Kind::InvalidType(actual, expected) => {
            format!("invalid type: found {}, expected {expected}", shape(actual))
        }
        Kind::InvalidValue(actual, expected) => {
            format!(
                "invalid value: found {}, expected {expected}",
                shape(actual)
            )
        }
        Kind::InvalidLength(n, expected) => format!("invalid length {n}, expected {expected}"),
        Kind::MissingField(field) => format!("missing field `{field}`"),
        Kind::UnknownField(..) => "unknown field".to_string(),
        Kind::UnknownVariant(..) => "unknown variant".to_string(),
        _ => "invalid value".to_string(),
    }
}

/// The kind of a value, without the value.
fn shape(actual: &Actual) -> String {
    match actual {
        Actual::Bool(_) => "a boolean".to_string(),
        Actual::Unsigned(_) | Actual::Signed(_) => "an integer".to_string(),
        Actual::Float(_) => "a number".to_string(),
        Actual::Char(_) => "a character".to_string(),
        Actual::Str(_) => "a string".to_string(),
        Actual::Bytes(_) => "bytes".to_string(),
        Actual::Other(_) => "a value".to_string(),
        // The rest carry no value: figment's name for them.
        other => other.to_string(),
    }
}

/// A parser's message without the lines that quote the source (a TOML
/// syntax error shows the line it is on, which may hold a key).
fn without_source_lines(message: &str) -> String {
    message
        .lines()
        .filter(|line| {
            let t = line.trim_start();
            let t = t
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start();
            !t.starts_with('|')
        })
        .collect::<Vec<_>>()
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}
