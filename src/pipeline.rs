//! The glue between measuring a request (`tokens`) and compacting it
//! (`compaction`), shared by the proxy and the offline tools so that
//! `condense compact` and `condense replay` do exactly what the proxy does.

use bytes::Bytes;
use http::HeaderMap;

use crate::chat::ChatRequest;
use crate::compaction::{self, Counter, Earlier, Limits, Outcome, Replacement, Span};
use crate::config::CompactionConfig;
use crate::recall::Recallable;
use crate::summary::{Checkpoint, Failure, Need, Summarizer};
use crate::tokens::{Assessment, Encoding, ModelInfo, TokenService};

/// Message counts through the token service's cache.
pub struct CachedCounter<'a> {
    pub tokens: &'a TokenService,
    pub encoding: Encoding,
    /// Raw tokens per byte no message counts below (0: none; see
    /// [`crate::tokens::Correction::density`]).
    pub density: f64,
}

impl<'a> CachedCounter<'a> {
    pub fn new(tokens: &'a TokenService, encoding: Encoding) -> CachedCounter<'a> {
        CachedCounter {
            tokens,
            encoding,
            density: 0.0,
        }
    }
}

impl Counter for CachedCounter<'_> {
    fn message(&self, raw: &[u8]) -> u64 {
        let counted = self.tokens.message_tokens(raw, self.encoding);
        if self.density > 0.0 {
            crate::tokens::floored(counted, raw.len(), self.density)
        } else {
            counted
        }
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
    /// Set when the plan replaces old turns with a checkpoint and none was
    /// given: `request` is unchanged until [`finish`] gets one (or not).
    pub pending: Option<Pending>,
    /// The recall keys the compacted request holds (`compaction.recall`,
    /// a request with tools).
    pub recallable: Option<Recallable>,
    /// What this request's compaction did, when it changed anything: for
    /// the conversation's [`History`].
    pub reached: Option<Reached>,
}

/// What compaction did on one request of a conversation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reached {
    /// The messages the request had.
    pub messages: usize,
    /// The budget it was planned against, in raw tokens (the prompt budget
    /// over the plan ratio).
    pub budget: f64,
    /// Where its mask frontier stood.
    pub frontier: usize,
}

/// What the earlier turns of a conversation were planned against and
/// reached (`proxy/reached.rs` keeps it per conversation). The plan replays
/// every earlier turn against the budget it was planned against, so that a
/// move of the learned ratio (or window) changes no decision made before
/// it: nothing an earlier turn masked or dropped comes back, and only this
/// turn is planned against today's budget.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    /// `(messages, budget)`, oldest first: from the request with `messages`
    /// messages on, the conversation was planned against `budget` raw
    /// tokens (the first pair also holds for the turns before it).
    pub budgets: Vec<(usize, f64)>,
    /// The furthest frontier an earlier turn reached: the least this
    /// turn's is (should the budgets not replay it).
    pub frontier: usize,
}

/// A compaction waiting for a checkpoint of `span`.
pub struct Pending {
    pub span: Span,
    setup: Setup,
}

/// How a request is compacted: fixed when it is measured, used again when
/// its checkpoint comes.
struct Setup {
    limits: Limits,
    earlier: Earlier,
    settings: CompactionConfig,
    replacement: Replacement,
    encoding: Encoding,
    ratio: f64,
    density: f64,
}

impl Pending {
    /// Most tokens the checkpoint's summary may have.
    pub fn summary_tokens(&self) -> u64 {
        match &self.setup.replacement {
            Replacement::Checkpoint { max_tokens, .. } => *max_tokens,
            Replacement::Digest => 0,
        }
    }
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
    /// The model asked for the messages before this index to be compacted
    /// (`compress_context`): they are, whatever the pressure.
    pub due: Option<usize>,
    /// What the earlier turns of this conversation were planned against
    /// and reached: the request is compacted whatever its pressure, each
    /// earlier turn replayed as it was planned.
    pub history: Option<History>,
}

/// Measures `req` for `subject`, and compacts it when its pressure reaches
/// the trigger. Old turns that must go are replaced as `replacement` says;
/// with a checkpoint not yet written, the result is [`Processed::pending`].
pub fn process(
    tokens: &TokenService,
    compaction_config: &CompactionConfig,
    subject: Subject<'_>,
    req: ChatRequest,
    body: &Bytes,
    allow_cheap: bool,
    replacement: &Replacement,
) -> Processed {
    let Subject {
        upstream,
        model,
        info,
        due,
        history,
    } = subject;
    let n = req.messages().len();
    let due = due.filter(|&d| d > 0 && d <= n);
    let history = history.filter(|h| h.frontier <= n);
    let forced = replacement.forced(n) || due.is_some() || history.is_some();
    let assessment = tokens.assess_as(
        upstream,
        model,
        info.clone(),
        &req,
        body,
        allow_cheap && !forced,
    );
    let Some(count) = assessment
        .count
        .as_ref()
        .filter(|_| assessment.pressure >= info.trigger || forced)
    else {
        return Processed {
            tokens_after: assessment.tokens,
            raw_after: assessment.tokens_raw,
            request: req,
            assessment,
            outcome: None,
            pending: None,
            recallable: None,
            reached: None,
        };
    };
    // Boundaries are planned with the plan ratio, which a small drift of
    // calibration does not move; what is reported uses the observed one.
    let plan = assessment.plan_ratio.max(f64::MIN_POSITIVE);
    let ratio = assessment.calibration_ratio;
    let mut settings = compaction_config.for_model(info.trigger, info.target);
    settings.placeholder_chars = crate::compaction::extract::placeholder_base(
        settings.placeholder_chars,
        assessment.budget.window,
    );
    // A recall key is of use only to a model that can call the tool.
    let offered = crate::wire::tools::offered(&req);
    settings.recall &= offered;
    // The tools condense may add (about 110 tokens) are not planned for:
    // the budget's margins hold them, keeping them out keeps the plan's
    // boundaries where they are without them, and an overflow retry goes
    // without them.
    let limits = Limits {
        budget: assessment.budget.prompt_budget as f64 / plan,
        window: assessment.budget.window as f64 / plan,
        fixed: count.total - count.per_message.iter().sum::<u64>(),
    };
    // Earlier turns are replayed against the budgets they were planned
    // against, and the frontier they reached stays the least (see
    // `compact_until`).
    let earlier = match history {
        None => Earlier {
            due,
            budgets: Vec::new(),
        },
        Some(h) => Earlier {
            due: Some(due.unwrap_or(0).max(h.frontier)),
            budgets: h
                .budgets
                .into_iter()
                .filter(|&(m, b)| m < n && b > 0.0)
                .collect(),
        },
    };
    let setup = Setup {
        limits,
        earlier,
        settings,
        replacement: replacement.for_budget(limits.budget),
        encoding: info.encoding,
        ratio,
        density: info
            .correction
            .as_ref()
            .and_then(|c| c.density)
            .unwrap_or(0.0),
    };
    apply(tokens, req, assessment, setup)
}

/// Finishes a [`Processed::pending`] request: old turns replaced by
/// `checkpoint` (a checkpoint message), or, without one, dropped with a
/// digest. A request with nothing pending is returned as it is.
pub fn finish(tokens: &TokenService, mut p: Processed, checkpoint: Option<Bytes>) -> Processed {
    let Some(Pending { mut setup, .. }) = p.pending.take() else {
        return p;
    };
    setup.replacement = match (setup.replacement, checkpoint) {
        (
            Replacement::Checkpoint {
                trigger,
                max_tokens,
                ..
            },
            Some(message),
        ) => Replacement::Checkpoint {
            trigger,
            max_tokens,
            message: Some(message),
        },
        _ => Replacement::Digest,
    };
    apply(tokens, p.request, p.assessment, setup)
}

fn apply(
    tokens: &TokenService,
    mut req: ChatRequest,
    assessment: Assessment,
    setup: Setup,
) -> Processed {
    let counter = CachedCounter {
        tokens,
        encoding: setup.encoding,
        density: setup.density,
    };
    let messages = req.messages().len();
    let outcome = compaction::compact_until(
        req.messages(),
        &setup.limits,
        &setup.settings,
        &counter,
        &setup.replacement,
        &setup.earlier,
    );
    let mut recallable = None;
    if let Some(messages) = outcome.messages.clone() {
        let original = req.replace_messages(messages);
        if setup.settings.recall
            && let Some(fates) = &outcome.fates
        {
            recallable = Some(Recallable::of(original, fates)).filter(|r| !r.is_empty());
        }
    }
    let ratio = setup.ratio;
    // With a density floor the outcome is counted in floored units, which
    // the ratio was made for; calibration wants the plain count. (The tools
    // condense offers are counted when it adds them.)
    let raw_after = if setup.density > 0.0 {
        tokens.count(&req, setup.encoding).total
    } else {
        outcome.tokens_after
    };
    let reached = outcome.messages.is_some().then_some(Reached {
        messages,
        budget: setup.limits.budget,
        frontier: outcome.frontier,
    });
    let pending = outcome.span.clone().map(|span| Pending { span, setup });
    Processed {
        tokens_after: (outcome.tokens_after as f64 * ratio).round() as u64,
        raw_after: Some(raw_after),
        request: req,
        assessment,
        outcome: Some(outcome),
        pending,
        recallable,
        reached,
    }
}

/// Share of the summarizer model's window its input may fill.
const SUMMARIZER_INPUT_SHARE: f64 = 0.7;

/// Gets the checkpoint a [`Processed::pending`] request needs and finishes
/// it; without a checkpoint (failure, cooldown) the old turns are dropped
/// mechanically, and the request still goes out. `headers` are the ones
/// sent upstream (the client's credentials, used only on the upstream's
/// own host).
pub async fn summarize(
    tokens: &TokenService,
    summarizer: &Summarizer,
    upstream: &str,
    model: &str,
    headers: Option<&HeaderMap>,
    p: Processed,
) -> (Processed, Option<Result<Checkpoint, Failure>>) {
    let Some(pending) = &p.pending else {
        return (p, None);
    };
    let summary_model = summarizer.model(model);
    let window = if summary_model == model {
        p.assessment.budget.window
    } else {
        tokens.model_info(upstream, summary_model).window
    };
    let max_field = if p.request.field("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let need = Need {
        upstream,
        model,
        messages: p.request.messages(),
        span: &pending.span,
        client_headers: headers,
        max_field,
        max_tokens: pending.summary_tokens(),
        input_tokens: (window as f64 * SUMMARIZER_INPUT_SHARE) as u64,
    };
    let result = summarizer.checkpoint(&need).await;
    let message = result.as_ref().ok().map(|c| c.message.clone());
    (finish(tokens, p, message), Some(result))
}
