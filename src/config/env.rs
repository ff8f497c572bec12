//! The environment's part of the configuration: `CONDENSE_<SECTION>__<KEY>`
//! variables, and which variable a value came from (for error messages).

use figment::providers::Env;

/// What every configuration variable starts with.
pub const PREFIX: &str = "CONDENSE_";

/// Separates a section from its key (and nested keys).
const NESTING: &str = "__";

/// The configuration variables, for figment.
pub fn provider() -> Env {
    Env::prefixed(PREFIX).split(NESTING)
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
        .filter(|name| strip_prefix(name).is_some())
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
