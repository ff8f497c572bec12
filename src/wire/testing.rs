//! What the format modules' tests share.

use bytes::Bytes;

use crate::chat::ChatRequest;
use crate::compaction::Fates;

/// The pipeline's decisions on a format's view, for the format modules'
/// tests: `view` measured for `model` in a `window`, compacted with
/// digests.
pub(crate) fn decide(view: ChatRequest, body: &Bytes, model: &str, window: u64) -> Fates {
    use std::sync::Arc;
    let config = crate::config::Config::default();
    let metrics = crate::metrics::Metrics::new().expect("metrics");
    let tokens = crate::tokens::TokenService::new(Arc::new(config.clone()), &metrics);
    let mut info = tokens.model_info("", model);
    info.window = window;
    let p = crate::pipeline::process(
        &tokens,
        &config.compaction,
        crate::pipeline::Subject {
            upstream: "",
            model,
            info,
            due: None,
            history: None,
        },
        view,
        body,
        false,
        &crate::compaction::Replacement::Digest,
    );
    p.outcome.and_then(|o| o.fates).expect("compacted")
}

/// `v` written as a client that puts `type` first writes it (Anthropic's
/// and OpenAI's SDKs do): objects' other keys follow in their order.
pub(crate) fn type_first(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort_by_key(|k| k.as_str() != "type");
            let members: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), type_first(&o[k])))
                .collect();
            format!("{{{}}}", members.join(","))
        }
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(type_first).collect::<Vec<_>>().join(",")
        ),
        other => other.to_string(),
    }
}

/// Whether every object with a `type` in the JSON text `raw` writes it
/// first, as [`type_first`] did.
pub(crate) fn types_first(raw: &[u8]) -> bool {
    let text = String::from_utf8_lossy(raw);
    // Every `"type":` follows an object's opening brace.
    text.match_indices("\"type\":")
        .all(|(at, _)| text[..at].ends_with('{'))
}

/// A long prompt from the user, as a spec-kit command sends mid-session:
/// 150 lines, the last `Requirement 149: …`.
pub(crate) fn long_prompt() -> String {
    (0..150)
        .map(|i| format!("Requirement {i}: the parser accepts header form {i}.\n"))
        .collect()
}
