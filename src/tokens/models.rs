//! Model profiles and context windows.
//!
//! A model's window comes from, in order of trust:
//! 1. what condense learned at run time for this upstream: the upstream's own
//!    `/models` listing (`max_model_len` from vLLM, `context_length` from
//!    OpenRouter, Together and others, `context_window` from Groq,
//!    `max_context_length` from Mistral);
//! 2. the best-matching `[[models]]` profile;
//! 3. `default_context_window`.
//!
//! When both a listing and a profile name a window, the smaller one counts:
//! a listing smaller than the profile is the deployment's truth (a vLLM
//! started with a short `--max-model-len`), a profile smaller than the
//! listing is the user's wish to stay under it. A window learned from an
//! overflow error (see `learned`) applies below all of them.
//!
//! Profiles match by glob (`*` any run, `?` one character), case-insensitive,
//! against the model name and, failing that, against the part after its last
//! `/` (so `gpt-4o*` also matches `openai/gpt-4o` on a router). The most
//! specific pattern (most literal characters) wins; on a tie, the later
//! entry, so an entry appended to the table overrides a shipped one. A name
//! (or last part) longer than 256 bytes matches no profile.

use serde_json::Value;

use super::encoding::Encoding;
use super::key::{key_of, pair_key};
use crate::cache::{Bounded, PreHashed, one};
use crate::config::ModelProfile;

/// Where a model's window came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSource {
    Listing,
    Profile,
    Default,
    /// Given explicitly (`condense compact --window`).
    Override,
    /// Named by the upstream in a context-overflow error.
    Overflow,
}

/// What an overflow error taught about the request it rejected: applied to
/// that request's retry instead of the usual calibration and completion
/// allowance.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Correction {
    /// The provider's count of the rejected prompt / condense's raw estimate.
    pub ratio: Option<f64>,
    /// The completion tokens the provider counted against the window.
    pub completion: Option<u64>,
    /// The most the prompt may have (calibrated tokens), when the error gave
    /// no numbers to go by.
    pub prompt_budget: Option<u64>,
    /// Raw tokens per byte: on the retry no message counts less than its
    /// bytes at this density (see [`crate::overflow::Overflow::correction`]).
    pub density: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub window: u64,
    pub source: WindowSource,
    pub encoding: Encoding,
    pub trigger: f64,
    pub target: f64,
    /// Set for the retry of a request rejected for its length.
    pub correction: Option<Correction>,
    /// The calibration to measure with, when the replicas' shared record
    /// gave it (see [`crate::tokens::shared`]); else the process's own.
    pub ratios: Option<super::calibration::Ratios>,
}

/// Matches `name` against a glob `pattern`, ASCII case-insensitively.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && p[pi] == b'*' {
            backtrack = Some((pi, ni));
            pi += 1;
        } else if pi < p.len() && (p[pi] == b'?' || p[pi].eq_ignore_ascii_case(&n[ni])) {
            pi += 1;
            ni += 1;
        } else if let Some((bp, bn)) = backtrack {
            pi = bp + 1;
            ni = bn + 1;
            backtrack = Some((bp, bn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

fn specificity(pattern: &str) -> usize {
    pattern.bytes().filter(|&c| c != b'*' && c != b'?').count()
}

/// Longest name matched against the profiles. Real model ids are tens of
/// bytes; matching costs time linear in the name for each of the ~40
/// profiles, on the request's async worker, so a client's 30 MB `model`
/// would cost seconds of CPU per request and stall every other request.
const MAX_MATCHED_NAME: usize = 256;

/// Where in `profiles` the profile for a model name is, if any matches: the
/// most specific pattern, the later of equally specific ones. A name (or
/// part after the last `/`) longer than `MAX_MATCHED_NAME` matches none.
pub fn best_profile_index(profiles: &[ModelProfile], model: &str) -> Option<usize> {
    let short = model.rsplit('/').next().unwrap_or(model);
    let pick = |name: &str| {
        if name.len() > MAX_MATCHED_NAME {
            return None;
        }
        profiles
            .iter()
            .enumerate()
            .filter(|(_, p)| glob_match(&p.pattern, name))
            // max_by_key keeps the last of equal keys: later entries win ties.
            .max_by_key(|(_, p)| specificity(&p.pattern))
            .map(|(i, _)| i)
    };
    pick(model).or_else(|| if short != model { pick(short) } else { None })
}

/// Windows learned per (upstream, model) from upstreams' `/models`
/// listings. Bounded in entries; keys are hashes, so a long model name
/// costs no more than a short one.
pub struct Listings {
    windows: Bounded<u64, u64, PreHashed>,
}

impl Default for Listings {
    fn default() -> Self {
        Listings {
            windows: Bounded::hashed(Self::MAX_ENTRIES, Self::MAX_ENTRIES as u64, one),
        }
    }
}

impl Listings {
    /// Windows kept (a router's listing names a few hundred models).
    const MAX_ENTRIES: usize = 8192;

    pub fn get(&self, upstream: &str, model: &str) -> Option<u64> {
        self.get_keyed(pair_key(upstream, model))
    }

    /// [`Listings::get`] by the pair's [`pair_key`].
    pub fn get_keyed(&self, key: u64) -> Option<u64> {
        self.windows.get(&key)
    }

    /// Stores the windows of a listing response body; returns how many.
    /// A listing of exactly one model (a llama.cpp or single-model vLLM
    /// server, which serves it whatever name a request gives) also sets the
    /// window of every model name the listing does not know.
    pub fn learn(&self, upstream: &str, body: &[u8]) -> usize {
        let (found, listed) = parse_listing_counted(body);
        for (id, window) in &found {
            self.windows.insert(pair_key(upstream, id), *window);
        }
        if let [(_, window)] = found.as_slice()
            && listed == 1
        {
            self.windows.insert(only_model_key(upstream), *window);
        }
        found.len()
    }

    /// The window for `model`: its own, or the only model's.
    pub fn window(&self, upstream: &str, model: &str) -> Option<u64> {
        self.window_keyed(upstream, pair_key(upstream, model))
    }

    /// [`Listings::window`] by the pair's [`pair_key`].
    pub fn window_keyed(&self, upstream: &str, key: u64) -> Option<u64> {
        self.get_keyed(key)
            .or_else(|| self.windows.get(&only_model_key(upstream)))
    }
}

/// Where a `/models` entry states the window it is served with, first
/// found wins: vLLM `max_model_len`; llama.cpp server `meta.n_ctx` (the
/// context it was started with; not `n_ctx_train`, which `-c` may cut);
/// LM Studio `loaded_context_length` (then `max_context_length`, also
/// Mistral's); OpenRouter, Together and Fireworks `context_length`; Groq
/// `context_window`; LiteLLM-style `max_input_tokens`; OpenRouter's
/// `top_provider.context_length`.
const WINDOW_FIELDS: &[&str] = &[
    "/max_model_len",
    "/meta/n_ctx",
    "/n_ctx",
    "/loaded_context_length",
    "/context_length",
    "/context_window",
    "/max_context_length",
    "/max_input_tokens",
    "/top_provider/context_length",
];

/// The key under which a single-model listing's window is kept: not the
/// key of any model name (those hash a 0 byte after the upstream).
fn only_model_key(upstream: &str) -> u64 {
    // As `pair_key(upstream + "\u{1}", "only")`, no model's key, without
    // building that string on every lookup.
    key_of(&[upstream.as_bytes(), &[1, 0], b"only"])
}

/// (model id, context window) for every model of a `/models` response that
/// carries a window.
pub fn parse_listing(body: &[u8]) -> Vec<(String, u64)> {
    parse_listing_counted(body).0
}

/// [`parse_listing`], and how many models the listing names in all.
fn parse_listing_counted(body: &[u8]) -> (Vec<(String, u64)>, usize) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return (Vec::new(), 0);
    };
    let Some(models) = v.get("data").and_then(Value::as_array) else {
        return (Vec::new(), 0);
    };
    let window_of = |m: &Value| {
        WINDOW_FIELDS
            .iter()
            .find_map(|pointer| m.pointer(pointer).and_then(Value::as_u64))
            .filter(|w| *w >= 256)
    };
    let found = models
        .iter()
        .filter_map(|m| Some((m.get("id")?.as_str()?.to_string(), window_of(m)?)))
        .collect();
    (found, models.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn best_profile<'a>(profiles: &'a [ModelProfile], model: &str) -> Option<&'a ModelProfile> {
        best_profile_index(profiles, model).and_then(|i| profiles.get(i))
    }

    fn profile(pattern: &str, window: u64) -> ModelProfile {
        ModelProfile {
            pattern: pattern.to_string(),
            context_window: window,
            encoding: None,
            trigger: None,
            target: None,
        }
    }

    #[test]
    fn globs() {
        assert!(glob_match("gpt-4o*", "gpt-4o-mini"));
        assert!(glob_match("gpt-4o*", "GPT-4o"));
        assert!(!glob_match("gpt-4o*", "gpt-4"));
        assert!(glob_match(
            "*llama-3.1*",
            "meta-llama/Llama-3.1-8B-Instruct"
        ));
        assert!(glob_match("o?-mini", "o3-mini"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("a*b", "acbc"));
        assert!(glob_match("a*b*c", "axxbyyc"));
    }

    #[test]
    fn most_specific_then_latest_profile_wins() {
        let p = vec![
            profile("gpt-4*", 8192),
            profile("gpt-4o*", 128_000),
            profile("gpt-4o-mini*", 64_000),
            profile("gpt-4o*", 100_000),
        ];
        assert_eq!(best_profile(&p, "gpt-4-0613").unwrap().context_window, 8192);
        assert_eq!(
            best_profile(&p, "gpt-4o-2024-08-06")
                .unwrap()
                .context_window,
            100_000
        );
        assert_eq!(
            best_profile(&p, "gpt-4o-mini").unwrap().context_window,
            64_000
        );
        assert_eq!(
            best_profile(&p, "openai/gpt-4o").unwrap().context_window,
            100_000
        );
        assert!(best_profile(&p, "claude-3").is_none());
    }

    #[test]
    fn overlong_names_match_no_profile_but_their_last_part_still_does() {
        let p = vec![profile("*", 8192), profile("gpt-4o*", 128_000)];
        let long = "m".repeat(MAX_MATCHED_NAME + 1);
        assert!(best_profile(&p, &long).is_none());
        let at_limit = "m".repeat(MAX_MATCHED_NAME);
        assert_eq!(best_profile(&p, &at_limit).unwrap().context_window, 8192);
        let routed = format!("{long}/gpt-4o");
        assert_eq!(best_profile(&p, &routed).unwrap().context_window, 128_000);
    }

    #[test]
    fn listings_of_vllm_and_openrouter() {
        let vllm = br#"{"object":"list","data":[{"id":"Qwen/Qwen2.5-7B-Instruct","object":"model","max_model_len":16384}]}"#;
        assert_eq!(
            parse_listing(vllm),
            vec![("Qwen/Qwen2.5-7B-Instruct".to_string(), 16384)]
        );
        let openrouter = br#"{"data":[{"id":"openai/gpt-4o","context_length":128000,"top_provider":{"context_length":128000}},{"id":"x/y","top_provider":{"context_length":32768}},{"id":"no/window"}]}"#;
        assert_eq!(parse_listing(openrouter).len(), 2);
        let openai =
            br#"{"object":"list","data":[{"id":"gpt-4o","object":"model","owned_by":"system"}]}"#;
        assert!(parse_listing(openai).is_empty());
        assert!(parse_listing(b"<html>").is_empty());
        let llamacpp = br#"{"object":"list","data":[{"id":"gemma-3-270m-it-Q4_K_M.gguf","object":"model","owned_by":"llamacpp","meta":{"vocab_type":2,"n_vocab":262144,"n_ctx_train":32768,"n_ctx":4096,"n_embd":640}}]}"#;
        assert_eq!(
            parse_listing(llamacpp),
            vec![("gemma-3-270m-it-Q4_K_M.gguf".to_string(), 4096)]
        );
        let lmstudio = br#"{"data":[{"id":"qwen3-8b","max_context_length":40960,"loaded_context_length":8192}]}"#;
        assert_eq!(
            parse_listing(lmstudio),
            vec![("qwen3-8b".to_string(), 8192)]
        );
        let l = Listings::default();
        assert_eq!(l.learn("u", vllm), 1);
        assert_eq!(l.get("u", "Qwen/Qwen2.5-7B-Instruct"), Some(16384));
        assert_eq!(l.get("other", "Qwen/Qwen2.5-7B-Instruct"), None);
        // One model served: its window for any name a request gives.
        assert_eq!(l.window("u", "whatever-the-client-says"), Some(16384));
        l.learn("v", openrouter);
        assert_eq!(l.window("v", "whatever-the-client-says"), None);
    }
}
