//! The compaction pipeline: free, deterministic stages that bring a long
//! conversation under its budget without a model call. A pure library: it
//! knows nothing of HTTP; the proxy and `condense compact`/`replay` call
//! [`compact`] the same way.
//!
//! Stages, in order, each only while the request is still above the target:
//!
//! | stage       | file           | what                                                 |
//! |-------------|----------------|------------------------------------------------------|
//! | `fit`       | `fit.rs`       | no single result or argument string over 30% of the budget, nor the pinned head's user messages together |
//! | `prune`     | `prune.rs`     | old units dropped, a digest in their place (replayed, only when masking cannot get under the budget) |
//! | `mask`      | `mask.rs`      | old tool output → extractive placeholder, old long arguments shortened (replayed frontier); large answered results masked ahead of it |
//! | `fade`      | `fade.rs`      | recent large results shrunk by age, in a request still over the budget |
//! | `emergency` | `emergency.rs` | everything but system/developer and the last user message shortened |
//!
//! `fit` runs first, whenever compaction is active: it depends on a message
//! and the budget alone, so it can be part of the replayed plan's costs and
//! a fitted message stays byte-identical on later turns. `fade` only runs
//! when the planned request is still at the trigger.
//!
//! Where the boundaries of `mask` and `prune` stand is decided by
//! `plan.rs`, replayed over the turns the request contains, so they stay put
//! for many turns and the provider's prompt cache stays warm; each earlier
//! turn against the budget it was planned against when the caller knows it
//! ([`Earlier`]), so that they never move back.
//!
//! Invariants (property-tested in `tests/compaction.rs`): system and developer
//! messages, the last user message and unconsumed tool results come out
//! byte-identical (except under `emergency`); every tool result still
//! follows the call it answers; the output never has more tokens than the
//! input; a request under the trigger is returned unchanged; compacting an
//! output that fits its budget again changes nothing (one that does not fit
//! was cut as far as one `emergency` pass goes, and a second pass may cut
//! more).

pub mod conversation;
pub mod emergency;
pub mod extract;
pub mod fade;
pub mod fit;
pub mod keys;
pub mod mask;
pub mod memo;
pub mod plan;
pub mod prune;
pub mod text;

use bytes::Bytes;
use serde::Serialize;

use crate::chat::Message;
use crate::config::{CompactionConfig, SummaryTrigger, TriggerKind};
use conversation::{Analysis, Role};
use text::{content_text, cut_middle_with, with_string_field};

/// Counts the tokens of one message (the proxy's implementation caches by
/// the message's bytes), and may remember per-message transforms.
pub trait Counter {
    fn message(&self, raw: &[u8]) -> u64;

    /// The pure transform `kind` of message `raw`, made by `build`. The
    /// proxy's implementation remembers it across requests.
    fn derived(
        &self,
        kind: u64,
        raw: &[u8],
        build: &mut dyn FnMut() -> Option<Bytes>,
    ) -> Option<Bytes> {
        let _ = (kind, raw);
        build()
    }
}

/// The stage settings: `[compaction]` with the model's own trigger and
/// target (see [`CompactionConfig::for_model`]).
pub type Settings = CompactionConfig;

/// The room a request has, in raw (uncalibrated) tokens.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub budget: f64,
    pub window: f64,
    /// Tokens outside the messages (reply priming, tool schemas).
    pub fixed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StageReport {
    pub stage: &'static str,
    pub messages: usize,
    pub tokens_saved: u64,
}

/// What takes the place of old turns when they must go.
#[derive(Debug, Clone)]
pub enum Replacement {
    /// A mechanical digest of the key lines they held (`prune`).
    Digest,
    /// A model-written checkpoint of one contiguous span (`summarize`).
    /// While `message` is None, [`compact`] stops at the plan and reports the
    /// span it needs a checkpoint for ([`Outcome::span`]).
    Checkpoint {
        trigger: SummaryTrigger,
        /// Most tokens the summary may have (the plan counts them, plus
        /// [`CHECKPOINT_FRAME_TOKENS`], for the checkpoint message).
        max_tokens: u64,
        message: Option<Bytes>,
    },
}

/// Tokens a checkpoint message has beyond its summary (the marker line and
/// quoted revisions), as the plan counts them.
pub const CHECKPOINT_FRAME_TOKENS: u64 = 200;

/// Largest share of the prompt budget a summary may take: on a small
/// window, a checkpoint the size of `summary.max_tokens` would force large
/// drops every few turns.
pub const CHECKPOINT_BUDGET_SHARE: f64 = 0.12;

impl Replacement {
    /// This replacement for a request with `budget` raw tokens: the summary
    /// limited to [`CHECKPOINT_BUDGET_SHARE`] of it.
    pub fn for_budget(&self, budget: f64) -> Replacement {
        match self {
            Replacement::Checkpoint {
                trigger,
                max_tokens,
                message,
            } => Replacement::Checkpoint {
                trigger: *trigger,
                max_tokens: (*max_tokens)
                    .min((budget * CHECKPOINT_BUDGET_SHARE) as u64)
                    .max(64),
                message: message.clone(),
            },
            Replacement::Digest => Replacement::Digest,
        }
    }

    /// Whether a conversation of `messages` messages must be compacted
    /// whatever its token pressure (a checkpoint triggered by message count).
    pub fn forced(&self, messages: usize) -> bool {
        match self {
            Replacement::Checkpoint { trigger, .. } => {
                trigger.kind == TriggerKind::Messages && messages as f64 > trigger.value
            }
            Replacement::Digest => false,
        }
    }
}

/// The span a checkpoint must cover: `messages[start..end]`, except `kept`
/// (the last user message, which stays verbatim).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
    /// Where the span ended on the earlier turns it grew, newest first (a
    /// checkpoint stored for one of them can be updated instead of
    /// summarizing from scratch).
    pub previous_ends: Vec<usize>,
    pub kept: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    /// The new message list, or None when nothing changed.
    pub messages: Option<Vec<Message>>,
    /// The same decisions message by message (None when nothing changed),
    /// for a wire format that writes them back into its own body.
    pub fates: Option<Fates>,
    pub stages: Vec<StageReport>,
    pub tokens_before: u64,
    pub tokens_after: u64,
    /// Whether the result is within the budget.
    pub fits: bool,
    /// Set when a checkpoint is needed and was not given; nothing was
    /// compacted then.
    pub span: Option<Span>,
    /// Where the mask frontier stands (0 when nothing changed): the
    /// messages before it are compacted.
    pub frontier: usize,
}

impl Outcome {
    /// Stage names applied, comma-separated, or `none`.
    pub fn actions(&self) -> String {
        if self.stages.is_empty() {
            "none".to_string()
        } else {
            self.stages
                .iter()
                .map(|s| s.stage)
                .collect::<Vec<_>>()
                .join(",")
        }
    }
}

/// What compaction did to each message of the conversation it was given.
#[derive(Debug, Clone, PartialEq)]
pub struct Fates {
    /// Per message: its new bytes, when a stage rewrote it.
    pub rewritten: Vec<Option<Bytes>>,
    /// Per message: whether it was dropped.
    pub dropped: Vec<bool>,
    /// The digest or checkpoint message that stands where the first
    /// dropped message stood (or where `replacement_at` says).
    pub replacement: Option<Bytes>,
    /// The message the replacement stands before, when not the first
    /// dropped one: `emergency`'s last resort puts it right after the last
    /// user message (see `emergency.rs`), and a digest stands past what
    /// the user wrote between two runs of dropped messages when that
    /// outweighs it (`after_what_was_said`), which may also be right
    /// after the last user message.
    pub replacement_at: Option<usize>,
    /// Per message: whether the replacement stands for it (the messages
    /// dropped when it was made; with recall on, also those `emergency`'s
    /// last resort dropped after, whose key it then holds).
    pub replaced: Vec<bool>,
}

/// The working copy: the current bytes and cost of every message.
struct Work<'a> {
    src: &'a [Message],
    bytes: Vec<Option<Bytes>>,
    cost: Vec<u64>,
    dropped: Vec<bool>,
    digest: Option<(Bytes, u64)>,
    /// The messages the digest stands for.
    replaced: Vec<bool>,
    /// The message the digest stands before, when not the first dropped
    /// one.
    digest_at: Option<usize>,
    fixed: u64,
    stages: Vec<StageReport>,
    /// Whether rewrites carry their recall key (`compaction.recall`).
    recall: bool,
    /// Messages whose text `fit` or `fade` cut: `emergency` cuts them
    /// further from their original text.
    cut: Vec<bool>,
}

impl Work<'_> {
    fn total(&self) -> u64 {
        let kept: u64 = (0..self.cost.len())
            .filter(|&i| !self.dropped[i])
            .map(|i| self.cost[i])
            .sum();
        self.fixed + kept + self.digest.as_ref().map_or(0, |d| d.1)
    }

    fn current(&self, i: usize) -> Message {
        match &self.bytes[i] {
            Some(b) => Message::from_bytes(b.clone()),
            None => self.src[i].clone(),
        }
    }

    /// The opening of a notice condense writes into message `i`'s own
    /// text: with recall on, it carries the message's key already, so that
    /// the key goes into this notice and not into a marker the text quotes.
    fn mark(&self, i: usize) -> String {
        match self.recall {
            true => keys::opening(&keys::key(self.src[i].raw())),
            false => text::MARK.to_string(),
        }
    }

    /// Replaces message `i` when that saves tokens; returns the saving.
    /// With recall on, the new bytes carry the original's recall key.
    fn replace(&mut self, i: usize, bytes: Bytes, counter: &dyn Counter) -> u64 {
        let bytes = match self.recall {
            true => keys::tag(&bytes, &keys::key(self.src[i].raw())).unwrap_or(bytes),
            false => bytes,
        };
        let cost = counter.message(&bytes);
        if cost >= self.cost[i] {
            return 0;
        }
        let saved = self.cost[i] - cost;
        self.bytes[i] = Some(bytes);
        self.cost[i] = cost;
        saved
    }

    fn record(&mut self, stage: &'static str, messages: usize, saved: u64) {
        if messages == 0 {
            return;
        }
        match self.stages.iter_mut().find(|s| s.stage == stage) {
            Some(s) => {
                s.messages += messages;
                s.tokens_saved += saved;
            }
            None => self.stages.push(StageReport {
                stage,
                messages,
                tokens_saved: saved,
            }),
        }
    }

    fn into_messages(self) -> (Vec<Message>, Fates) {
        let mut out = Vec::with_capacity(self.src.len());
        let placed = self.digest_at.filter(|&i| i < self.src.len());
        let at = placed.or_else(|| self.dropped.iter().position(|d| *d));
        for i in 0..self.src.len() {
            if Some(i) == at
                && let Some((d, _)) = &self.digest
            {
                out.push(Message::from_bytes(d.clone()));
            }
            if !self.dropped[i] {
                out.push(self.current(i));
            }
        }
        let fates = Fates {
            rewritten: self.bytes,
            dropped: self.dropped,
            replacement_at: self.digest.as_ref().and(placed),
            replacement: self.digest.map(|d| d.0),
            replaced: self.replaced,
        };
        (out, fates)
    }
}

/// Compacts a conversation to its budget, dropping old turns with a digest
/// when it must. Pure: the same messages, limits and settings give the same
/// result.
pub fn compact(
    messages: &[Message],
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
) -> Outcome {
    compact_with(messages, limits, s, counter, &Replacement::Digest)
}

/// [`compact`], with `replacement` for dropped turns.
pub fn compact_with(
    messages: &[Message],
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
    replacement: &Replacement,
) -> Outcome {
    compact_until(
        messages,
        limits,
        s,
        counter,
        replacement,
        &Earlier::default(),
    )
}

/// What earlier turns of the conversation decided, which this request
/// keeps: [`compact_until`] compacts whatever the pressure when it has any.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Earlier {
    /// The messages before this index are compacted: the model asked for it
    /// at that point (`compress_context`), or an earlier turn's frontier
    /// stood there. The frontier stays there on every later request, so the
    /// prefix stays byte-identical as with any boundary.
    pub due: Option<usize>,
    /// The budget, in raw tokens, each earlier turn was planned against
    /// (see `plan::Costs::budgets`): the plan replays it so, and a budget
    /// that moved since (a new calibration ratio, a learned window) changes
    /// only what this turn decides.
    pub budgets: Vec<(usize, f64)>,
}

/// [`compact_with`], keeping what `earlier` turns decided.
pub fn compact_until(
    messages: &[Message],
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
    replacement: &Replacement,
    earlier: &Earlier,
) -> Outcome {
    let due = earlier.due;
    let full: Vec<u64> = messages.iter().map(|m| counter.message(m.raw())).collect();
    let before = limits.fixed + full.iter().sum::<u64>();
    let unchanged = |fits| Outcome {
        messages: None,
        fates: None,
        stages: Vec::new(),
        tokens_before: before,
        tokens_after: before,
        fits,
        span: None,
        frontier: 0,
    };
    if (before as f64) < s.trigger * limits.budget
        && !replacement.forced(messages.len())
        && due.is_none()
    {
        return unchanged(true);
    }
    let a = Analysis::of(messages);
    let n = messages.len();
    let target = s.target * limits.budget;

    let mut w = Work {
        src: messages,
        bytes: vec![None; n],
        cost: full.clone(),
        dropped: vec![false; n],
        digest: None,
        replaced: vec![false; n],
        digest_at: None,
        fixed: limits.fixed,
        stages: Vec::new(),
        recall: s.recall,
        cut: vec![false; n],
    };

    // fit first: it depends on the message and the budget alone, so the
    // plan below can count on it and it stays the same turn after turn.
    // The head against the budget of the first compacted turn (see
    // `fit.rs`).
    let head_budget = earlier.budgets.first().map_or(limits.budget, |b| b.1);
    fit::run(&mut w, &a, limits, s, counter, head_budget);

    // The masked form of every message that has one.
    let masked_bytes: Vec<Option<Bytes>> = (0..n)
        .map(|i| {
            let eligible =
                i >= a.base && !a.protected(i) && (a.output(i) || a.roles[i] == Role::Assistant);
            if eligible {
                // The masked form depends on the message, the placeholder
                // size and whether it carries a recall key alone (the role
                // is in the bytes).
                let kind = 0x6d61_736b_0000_0000
                    ^ s.placeholder_chars as u64
                    ^ (u64::from(s.recall) << 32);
                counter.derived(kind, messages[i].raw(), &mut || {
                    let m = mask::masked(&a, messages, i, s.placeholder_chars, s.recall)?;
                    match s.recall {
                        true => keys::tag(&m, &keys::key(messages[i].raw())).or(Some(m)),
                        false => Some(m),
                    }
                })
            } else {
                None
            }
        })
        .collect();
    let masked_cost: Vec<u64> = (0..n)
        .map(|i| match &masked_bytes[i] {
            Some(b) => counter.message(b).min(w.cost[i]),
            None => w.cost[i],
        })
        .collect();
    // The plan masks messages with epistemic markers only as a last resort.
    let plan_masked: Vec<u64> = (0..n)
        .map(|i| {
            if a.marker[i] {
                w.cost[i]
            } else {
                masked_cost[i]
            }
        })
        .collect();
    // Whether a large call's results report a failure (only calls large
    // enough to be masked ahead, on this turn or an earlier one, are read).
    let ahead_saving = s.ahead_share * limits.budget;
    let least_scale = earlier
        .budgets
        .iter()
        .fold(1.0_f64, |m, &(_, b)| m.min(b / limits.budget));
    let mut failed = vec![false; n];
    for i in 0..n {
        if let Some(o) = a.owner[i]
            && !failed[o]
            && (w.cost[o].saturating_sub(plan_masked[o]) as f64) >= ahead_saving * least_scale
        {
            failed[o] =
                content_text(messages[i].content()).is_some_and(|t| extract::reports_error(&t));
        }
    }
    let costs = plan::Costs {
        full: &w.cost,
        sent: &full,
        fit_limit: fit::limit(limits.budget, s.fit_share),
        placeholder_chars: s.placeholder_chars,
        head: w.cost[..a.head].iter().sum(),
        masked: &plan_masked,
        fixed: limits.fixed,
        budget: limits.budget,
        window: limits.window,
        trigger: s.trigger,
        target: s.target,
        recent_turns: s.recent_turns,
        recent_share: s.recent_share,
        recent_max_share: s.recent_max_share,
        failed: &failed,
        ahead_saving,
        drops: drop_policy(replacement, limits),
        budgets: &earlier.budgets,
    };
    let mut plan = plan::plan(&a, &costs);
    // The point the model asked for, up to the turn in progress.
    if let Some(due) = due {
        let last_assistant = (0..n).rev().find(|&i| a.roles[i] == Role::Assistant);
        plan.frontier = plan.frontier.max(due.min(last_assistant.unwrap_or(0)));
    }
    w.dropped = plan.dropped.clone();

    // prune or summarize (as planned)
    let dropped_count = w.dropped.iter().filter(|d| **d).count();
    if dropped_count > 0 {
        let (d, stage) = match replacement {
            Replacement::Digest => {
                // Sized as the plan counted it.
                let dropped_tokens = (0..n).filter(|&i| w.dropped[i]).map(|i| plan_masked[i]);
                let d = prune::digest(
                    messages,
                    &w.dropped,
                    |i| a.said(i),
                    dropped_tokens.sum(),
                    plan.digest_room,
                );
                (d, "prune")
            }
            Replacement::Checkpoint {
                message: Some(m), ..
            } => (m.clone(), "summarize"),
            Replacement::Checkpoint { message: None, .. } => {
                let end = plan.span_ends.last().copied().unwrap_or(a.head);
                return Outcome {
                    span: Some(Span {
                        start: a.head,
                        end,
                        previous_ends: plan.span_ends.iter().rev().skip(1).copied().collect(),
                        kept: a.last_user.filter(|&u| u >= a.head && u < end),
                    }),
                    ..unchanged(false)
                };
            }
        };
        let d = match s.recall {
            true => {
                let span = (0..n).filter(|&i| w.dropped[i]).map(|i| messages[i].raw());
                keys::tag(&d, &keys::span_key(span)).unwrap_or(d)
            }
            false => d,
        };
        w.replaced = w.dropped.clone();
        let d_cost = counter.message(&d);
        // A checkpoint says the messages "that stood here" were replaced,
        // and its placement is not measured: it stays where they stood.
        if matches!(replacement, Replacement::Digest) {
            w.digest_at = after_what_was_said(&w.dropped, &w.cost, |i| a.said(i), d_cost);
        }
        let removed: u64 = (0..n).filter(|&i| w.dropped[i]).map(|i| w.cost[i]).sum();
        w.digest = Some((d, d_cost));
        w.record(stage, dropped_count, removed.saturating_sub(d_cost));
    }

    // mask (below the planned frontier; markers only if still needed)
    mask::run(
        &mut w,
        &a,
        &plan,
        &masked_bytes,
        s.trigger * limits.budget,
        counter,
    );

    // The planned boundaries leave the request between target and trigger
    // on most turns; that is the hysteresis working, not a reason to cut
    // more. Only a request still over the budget goes on to the per-request
    // stages (at the trigger it fits, and what `fade` cut there came back
    // on the next turn; see `fade.rs`); `emergency` then aims at the target.
    if (w.total() as f64) > limits.budget {
        fade::run(&mut w, &a, limits, s, counter);
    }
    if (w.total() as f64) > limits.budget {
        emergency::run(&mut w, &a, target, limits.budget, counter);
    }

    let after = w.total();
    if w.stages.is_empty() || after >= before {
        return unchanged((before as f64) <= limits.budget);
    }
    let fits = (after as f64) <= limits.budget;
    let stages = std::mem::take(&mut w.stages);
    let (messages, fates) = w.into_messages();
    Outcome {
        messages: Some(messages),
        fates: Some(fates),
        stages,
        tokens_before: before,
        tokens_after: after,
        fits,
        span: None,
        frontier: plan.frontier,
    }
}

/// Where the digest stands when not where the first dropped message
/// stood: where the last run of dropped messages starts, when what the
/// user wrote between the first dropped message and that run costs at
/// least twice the digest (`d_cost`).
///
/// Drops take units on both sides of what the user wrote, which is
/// dropped last: a Codex session's 49,000-character spec-kit prompt came
/// in the middle of the conversation, and every drop after it changed the
/// digest standing before it, so every drop sent it again, uncached. Past
/// it, a drop rewrites from there and leaves it cached. Mean stability over
/// the shared traces rose 0.001-0.002 at 16k and at 32k chars:3.0 (even at
/// 32k chars:3.6 and 64k), all of it that session's (at 16k 0.789 to
/// 0.798 with chars:3.6 and 0.749 to 0.783 with chars:3.0; at 32k
/// chars:3.0 0.828 to 0.846); every other replay and every retention
/// figure moved less than 0.0005. Counting whatever is kept between the
/// runs, not only what the user wrote, moved the digest on Claude Code
/// sessions too; as a Messages body it then joined the next user message
/// there, often the newest tool result, which is masked ahead on the next
/// turn and sent it again: their stability fell up to 0.006. (Measured
/// before the writer put the digest behind the tool results before it,
/// `place_digest`.)
///
/// Decided on each request: a digest that grows past half of what the
/// user wrote goes back in front of it, on a turn that drops more and
/// rewrites from the first message it drops anyway. Standing right after
/// the client's last words, it takes the last resort's place in a
/// Messages body (`place_digest` in the writer). A checkpoint stays where
/// the first message it replaces stood: its text says so, and summaries
/// were not measured this way.
fn after_what_was_said(
    dropped: &[bool],
    cost: &[u64],
    said: impl Fn(usize) -> bool,
    d_cost: u64,
) -> Option<usize> {
    let first = dropped.iter().position(|d| *d)?;
    let last = dropped.iter().rposition(|d| *d)?;
    let start = (first + 1..=last).rev().find(|&i| !dropped[i - 1])?;
    let between: u64 = (first..start)
        .filter(|&i| !dropped[i] && said(i))
        .map(|i| cost[i])
        .sum();
    (between >= 2 * d_cost).then_some(start)
}

/// When and how the plan drops old turns under `replacement`.
fn drop_policy(replacement: &Replacement, limits: &Limits) -> plan::DropPolicy {
    match replacement {
        Replacement::Digest => plan::DropPolicy::units(limits.budget),
        Replacement::Checkpoint {
            trigger,
            max_tokens,
            ..
        } => {
            let (over_tokens, over_messages) = match trigger.kind {
                TriggerKind::Ratio => (trigger.value * limits.budget, None),
                TriggerKind::RemainingTokens => ((limits.budget - trigger.value).max(0.0), None),
                TriggerKind::Messages => (limits.budget, Some(trigger.value as usize)),
            };
            plan::DropPolicy {
                kind: plan::Drops::Span,
                over_tokens,
                over_messages,
                replacement_tokens: Some(max_tokens + CHECKPOINT_FRAME_TOKENS),
            }
        }
    }
}

/// Candidates for shrinking a tool result: consumed, unprotected, not
/// masked (a result `fit` cut stays one, and [`cut_content`] leaves it as
/// it is). Known by what this request did, not by what the text holds: a
/// result that quotes condense's marker (the agent read this README, or a
/// page written to look compacted) is the client's text like any other,
/// and is cut when it is too large.
fn shrinkable_result(w: &Work, a: &Analysis, i: usize) -> Option<String> {
    let masked = w.bytes[i].is_some() && !w.cut[i];
    if w.dropped[i] || !a.output(i) || a.protected(i) || masked {
        return None;
    }
    Some(content_text(w.src[i].content())?.into_owned())
}

/// Cuts message `i`'s text content (the client's `text`, whatever it
/// holds) to `limit` tokens (proportionally in characters); returns the
/// saving. A message cut already on this request stays as it is (`fade`
/// after `fit`; `emergency` cuts from the original).
fn cut_content(w: &mut Work, i: usize, text: &str, limit: f64, counter: &dyn Counter) -> u64 {
    let cost = w.cost[i] as f64;
    if cost <= limit || cost == 0.0 || w.cut[i] {
        return 0;
    }
    let keep = ((text.len() as f64) * limit / cost) as usize;
    let Some(b) = with_string_field(
        w.current(i).raw(),
        "content",
        &cut_middle_with(text, keep.max(emergency::MIN_CHARS), &w.mark(i)),
    ) else {
        return 0;
    };
    let saved = w.replace(i, b, counter);
    w.cut[i] |= saved > 0;
    saved
}
