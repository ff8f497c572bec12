//! The glue between measuring a request (`tokens`) and compacting it
//! (`compaction`), shared by the proxy and the offline tools so that
//! `condense compact` and `condense replay` do exactly what the proxy does.

use bytes::Bytes;

use crate::chat::ChatRequest;
use crate::compaction::{self, Counter, Limits, Outcome};
use crate::config::CompactionConfig;
use crate::tokens::{Assessment, Encoding, ModelInfo, TokenService};

/// Message counts through the token service's cache.
pub struct CachedCounter<'a> {
    pub tokens: &'a TokenService,
    pub encoding: Encoding,
}

impl Counter for CachedCounter<'_> {
    fn message(&self, raw: &[u8]) -> u64 {
        self.tokens.message_tokens(raw, self.encoding)
    }

    fn derived(
        &self,
        kind: u64,
        raw: &[u8],
        build: &mut dyn FnMut() -> Option<Bytes>,
    ) -> Option<Bytes> {
        self.tokens.memo.get_or_build(kind, raw, build)
    }
}

/// A request measured and, when over its trigger, compacted.
pub struct Processed {
    pub request: ChatRequest,
    pub assessment: Assessment,
    /// None when compaction did not run (under the trigger, or the cheap path).
    pub outcome: Option<Outcome>,
    /// Calibrated estimate after compaction.
    pub tokens_after: u64,
    /// Raw count of the body as it will be sent (None on the cheap path).
    pub raw_after: Option<u64>,
}

impl Processed {
    pub fn actions(&self) -> String {
        self.outcome
            .as_ref()
            .map_or_else(|| "none".to_string(), Outcome::actions)
    }
}

/// Which model on which upstream a request is measured for.
pub struct Subject<'a> {
    pub upstream: &'a str,
    pub model: &'a str,
    pub info: ModelInfo,
}

/// Measures `req` for `subject`, and compacts it when its pressure reaches
/// the trigger.
pub fn process(
    tokens: &TokenService,
    compaction_config: &CompactionConfig,
    subject: Subject<'_>,
    mut req: ChatRequest,
    body: &Bytes,
    allow_cheap: bool,
) -> Processed {
    let Subject {
        upstream,
        model,
        info,
    } = subject;
    let assessment = tokens.assess_as(upstream, model, info.clone(), &req, body, allow_cheap);
    let Some(count) = assessment
        .count
        .as_ref()
        .filter(|_| assessment.pressure >= info.trigger)
    else {
        return Processed {
            tokens_after: assessment.tokens,
            raw_after: assessment.tokens_raw,
            request: req,
            assessment,
            outcome: None,
        };
    };
    let ratio = assessment.calibration_ratio.max(f64::MIN_POSITIVE);
    let limits = Limits {
        budget: assessment.budget.prompt_budget as f64 / ratio,
        window: assessment.budget.window as f64 / ratio,
        fixed: count.total - count.per_message.iter().sum::<u64>(),
    };
    let settings = compaction_config.for_model(info.trigger, info.target);
    let counter = CachedCounter {
        tokens,
        encoding: info.encoding,
    };
    let outcome = compaction::compact(req.messages(), &limits, &settings, &counter);
    if let Some(messages) = outcome.messages.clone() {
        req.set_messages(messages);
    }
    Processed {
        tokens_after: (outcome.tokens_after as f64 * ratio).round() as u64,
        raw_after: Some(outcome.tokens_after),
        request: req,
        assessment,
        outcome: Some(outcome),
    }
}
