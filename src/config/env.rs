//! Which environment variables are configuration.
//!
//! `CONDENSE_<SECTION>__<KEY>` (any variable with a `__` after the prefix)
//! and the top-level keys that are not sections
//! (`CONDENSE_DEFAULT_CONTEXT_WINDOW`, `CONDENSE_MODELS`) are configuration:
//! an unknown section or key among them is an error, as in the file. Any
//! other variable that merely starts with `CONDENSE_` (`CONDENSE_BIN` naming
//! the binary for a script, `CONDENSE_E2E_API_KEY` for a test) belongs to
//! something else: it is left alone, and named in a warning, so that it
//! cannot stop condense from starting.

use figment::providers::Env;

/// What every configuration variable starts with.
pub const PREFIX: &str = "CONDENSE_";

/// Separates a section from its key (and nested keys).
const NESTING: &str = "__";

/// The top-level keys set by one variable without a `__` (not sections).
const TOP_LEVEL: [&str; 2] = ["default_context_window", "models"];

/// The configuration variables, for figment.
pub fn provider() -> Env {
    Env::prefixed(PREFIX)
        .filter(|key| is_setting(key.as_str()))
        .split(NESTING)
}

/// Whether a variable named `PREFIX` + `key` is configuration.
fn is_setting(key: &str) -> bool {
    key.contains(NESTING)
        || TOP_LEVEL
            .iter()
            .any(|top| key.trim().eq_ignore_ascii_case(top))
}

/// The `CONDENSE_` variables in the environment that are not
/// configuration, by name (their values are never read).
pub fn ignored_variables() -> Vec<String> {
    let mut names: Vec<String> = std::env::vars_os()
        .map(|(name, _)| name.to_string_lossy().into_owned())
        .filter(|name| {
            strip_prefix(name).is_some_and(|key| !key.trim().is_empty() && !is_setting(key))
        })
        .collect();
    names.sort();
    names
}

/// `name` without the prefix, matched as figment matches it (ignoring case).
fn strip_prefix(name: &str) -> Option<&str> {
    let head = name.get(..PREFIX.len())?;
    head.eq_ignore_ascii_case(PREFIX)
        .then(|| &name[PREFIX.len()..])
}

/// The variable a value at `path` (`["auth", "client_keys", "1"]`) came
/// from: the one named by the whole path; else one below it (an unknown
/// key's error names only the first unknown part); else the longest part
/// of the path a variable names (the rest is inside its value); else the
/// name the whole path would have.
pub fn variable_for(path: &[String]) -> String {
    let name = |n: usize| format!("{PREFIX}{}", path[..n].join(NESTING)).to_ascii_uppercase();
    let settings: Vec<String> = std::env::vars_os()
        .map(|(name, _)| name.to_string_lossy().to_ascii_uppercase())
        .filter(|name| strip_prefix(name).is_some_and(is_setting))
        .collect();
    let whole = name(path.len());
    if settings.contains(&whole) {
        return whole;
    }
    let below = format!("{whole}{NESTING}");
    if let Some(v) = settings.iter().filter(|v| v.starts_with(&below)).min() {
        return v.clone();
    }
    (1..path.len())
        .rev()
        .map(name)
        .find(|candidate| settings.contains(candidate))
        .unwrap_or(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_and_top_level_keys_are_settings_and_nothing_else() {
        for key in [
            "SERVER__LISTEN",
            "server__listen",
            "SERVR__LISTEN",
            "SERVER__LISTN",
            "SUMMARY__TRIGGER__KIND",
            "DEFAULT_CONTEXT_WINDOW",
            "MODELS",
        ] {
            assert!(is_setting(key), "{key}");
        }
        for key in ["BIN", "EXTRA", "CONFIG", "E2E_API_KEY", "SERVER", "LOG"] {
            assert!(!is_setting(key), "{key}");
        }
        assert_eq!(strip_prefix("condense_bin"), Some("bin"));
        assert_eq!(strip_prefix("CONDENSER"), None);
        assert_eq!(strip_prefix("OTHER_CONDENSE_X"), None);
    }
}
