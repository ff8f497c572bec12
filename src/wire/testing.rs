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
        },
        view,
        body,
        false,
        &crate::compaction::Replacement::Digest,
    );
    p.outcome.and_then(|o| o.fates).expect("compacted")
}
