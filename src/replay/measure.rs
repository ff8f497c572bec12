//! The figures of one turn: tokens, prefix stability, uncached tokens,
//! probe retention (present, or recallable by a key the request holds),
//! and the same over the probes the agent used again (see [`reused`]):
//! a fact it quoted in a later call or answer is one it needed to do its
//! job, where many probes are only ever read once.
//!
//! And what a strategy's stability could have been ([`Growth`]): the
//! messages the client's request adds each turn are uncached whatever a
//! strategy does, so a strategy that never rewrote a byte it had sent
//! before still scores `1 - new / sent`, `new` counted as the strategy
//! sent those messages (cut, when it cut them), and the smaller its
//! requests, the lower that ceiling. The gap between the ceiling and the
//! stability is the cost of its rewrites alone, the part it controls.
//! They are the last messages of its request, as many as the client
//! added; where a digest stands among them (the last resort's place),
//! one of them is the digest, and the count is capped at the turn's
//! uncached tokens.

use bytes::Bytes;

use super::report::{Probe, Rewrites, Strategy, Totals};
use crate::chat::Message;
use crate::compaction::Counter;
use crate::compaction::prune::REMOVED;
use crate::compaction::text::{MARK, message_text};
use crate::proxy::Proxy;
use crate::recall::store::Originals;
use crate::summary::prompt::REPLACED;

/// One strategy's running state across turns.
#[derive(Default)]
pub(super) struct Track {
    previous: Option<Vec<Bytes>>,
    totals: Totals,
    stable_tokens: u64,
    new_tokens: u64,
    retention_sum: f64,
    recoverable_sum: f64,
    retention_turns: usize,
    reused_sum: f64,
    reused_recoverable_sum: f64,
    reused_turns: usize,
    /// Tokens sent again, by [`Cause`] (see [`Rewrites`]).
    rewritten: [u64; 6],
    /// Whether a request before rewrote anything.
    changed: bool,
}

/// What changed first in a request that rewrote part of the one before.
#[derive(Clone, Copy)]
enum Cause {
    First,
    Cut,
    Dropped,
    Restored,
    Recut,
    Other,
}

impl Cause {
    /// From the first message that differs, as it was (`before`) and as
    /// `request` has it (at `at`; either may be missing: a request that
    /// ends there). A message the request no longer has, with nothing cut
    /// in its place, was dropped when the request holds a digest or
    /// checkpoint somewhere else (the last resort puts its notice after
    /// the client's last words).
    fn of(before: Option<&[u8]>, request: &[Message], at: usize, changed: bool) -> Cause {
        fn text(b: Option<&[u8]>) -> &str {
            b.map_or("", |b| std::str::from_utf8(b).unwrap_or(""))
        }
        let stands_in = |t: &str| t.contains(REMOVED) || t.contains(REPLACED);
        let (before, after) = (text(before), text(request.get(at).map(|m| m.raw())));
        match (before.contains(MARK), after.contains(MARK)) {
            _ if !changed => Cause::First,
            _ if stands_in(before) || stands_in(after) => Cause::Dropped,
            (false, true) => Cause::Cut,
            (true, false) => Cause::Restored,
            (true, true) => Cause::Recut,
            (false, false) if request.iter().any(|m| stands_in(text(Some(m.raw())))) => {
                Cause::Dropped
            }
            (false, false) => Cause::Other,
        }
    }
}

/// What a turn is measured on: the probes its request (as the client sent
/// it) holds, among them those the agent used again, and how many
/// messages that request added to the one before ([`Growth`]).
pub(super) struct Here<'a> {
    pub all: Vec<&'a Probe>,
    pub reused: Vec<&'a Probe>,
    pub added: usize,
}

impl Track {
    /// Records one turn's request; `fits`: whether the provider took it;
    /// `recallable`: the originals its recall keys give back. The messages
    /// the client's request added are the last `probes.added` of
    /// `messages`.
    pub(super) fn turn(
        &mut self,
        messages: &[Message],
        fixed: u64,
        counter: &dyn Counter,
        probes: &Here,
        fits: bool,
        recallable: &str,
    ) -> Strategy {
        let first = self.previous.is_none();
        let (costs, common, before) = prefix(&mut self.previous, messages, counter);
        let tokens = fixed + costs.iter().sum::<u64>();
        let (stable, new) = match first {
            true => (0, tokens),
            false => (
                fixed + costs[..common].iter().sum::<u64>(),
                costs[costs.len().saturating_sub(probes.added)..]
                    .iter()
                    .sum(),
            ),
        };
        let new = new.min(tokens - stable);
        self.new_tokens += new;
        let again = tokens - stable - new;
        if again > 0 {
            let cause = Cause::of(
                before
                    .as_deref()
                    .and_then(|b| b.get(common))
                    .map(|b| &b[..]),
                messages,
                common,
                self.changed,
            );
            self.rewritten[cause as usize] += again;
            self.changed = true;
        }
        let hay = haystack(messages);
        let (retention, recoverable) = (
            share_kept(&hay, &probes.all, ""),
            share_kept(&hay, &probes.all, recallable),
        );
        let (reused, reused_recoverable) = (
            share_kept(&hay, &probes.reused, ""),
            share_kept(&hay, &probes.reused, recallable),
        );
        self.totals.tokens_sent += tokens;
        self.totals.uncached_tokens += tokens - stable;
        self.stable_tokens += stable;
        if let (Some(r), Some(rr)) = (retention, recoverable) {
            self.retention_sum += r;
            self.recoverable_sum += rr;
            self.retention_turns += 1;
        }
        if let (Some(r), Some(rr)) = (reused, reused_recoverable) {
            self.reused_sum += r;
            self.reused_recoverable_sum += rr;
            self.reused_turns += 1;
        }
        if !fits {
            self.totals.turns_not_fit += 1;
        }
        Strategy {
            tokens,
            stability: if tokens == 0 {
                1.0
            } else {
                stable as f64 / tokens as f64
            },
            uncached: tokens - stable,
            retention,
            recoverable,
            reused,
            reused_recoverable,
            fits,
        }
    }

    pub(super) fn finish(mut self) -> Totals {
        let sent = self.totals.tokens_sent as f64;
        (self.totals.prefix_stability, self.totals.stability_ceiling) = match sent > 0.0 {
            true => (
                self.stable_tokens as f64 / sent,
                1.0 - self.new_tokens as f64 / sent,
            ),
            false => (1.0, 1.0),
        };
        let share = |c: Cause| match sent > 0.0 {
            true => self.rewritten[c as usize] as f64 / sent,
            false => 0.0,
        };
        self.totals.rewrites = Rewrites {
            first: share(Cause::First),
            cut: share(Cause::Cut),
            dropped: share(Cause::Dropped),
            restored: share(Cause::Restored),
            recut: share(Cause::Recut),
            other: share(Cause::Other),
        };
        let turns = self.retention_turns as f64;
        self.totals.probe_retention =
            (self.retention_turns > 0).then(|| self.retention_sum / turns);
        self.totals.recoverable_retention =
            (self.retention_turns > 0).then(|| self.recoverable_sum / turns);
        let turns = self.reused_turns as f64;
        self.totals.reused_retention = (self.reused_turns > 0).then(|| self.reused_sum / turns);
        self.totals.reused_recoverable =
            (self.reused_turns > 0).then(|| self.reused_recoverable_sum / turns);
        self.totals
    }
}

/// The client's requests, turn after turn: which messages each adds to
/// the one before, which no strategy can send cached.
#[derive(Default)]
pub(super) struct Growth {
    previous: Option<Vec<Bytes>>,
}

impl Growth {
    /// The tokens of `messages` (the turn as the client sent it), and how
    /// many of its last messages are not in the client's previous turn.
    pub(super) fn turn(
        &mut self,
        messages: &[Message],
        fixed: u64,
        counter: &dyn Counter,
    ) -> (u64, usize) {
        let (costs, common, _) = prefix(&mut self.previous, messages, counter);
        (fixed + costs.iter().sum::<u64>(), messages.len() - common)
    }
}

/// A request's per-message tokens, how many of its first messages are
/// byte for byte those of `previous` (the request before, which `messages`
/// then replaces), and that request before.
fn prefix(
    previous: &mut Option<Vec<Bytes>>,
    messages: &[Message],
    counter: &dyn Counter,
) -> (Vec<u64>, usize, Option<Vec<Bytes>>) {
    let costs: Vec<u64> = messages.iter().map(|m| counter.message(m.raw())).collect();
    let raws: Vec<Bytes> = messages
        .iter()
        .map(|m| Bytes::copy_from_slice(m.raw()))
        .collect();
    let common = previous.as_deref().map_or(0, |prev| {
        prev.iter().zip(&raws).take_while(|(a, b)| a == b).count()
    });
    let before = previous.replace(raws);
    (costs, common, before)
}

/// The share of `probes` whose text is still present in `hay` (a
/// request's [`haystack`]), or in `recallable`.
pub(super) fn share_kept(hay: &str, probes: &[&Probe], recallable: &str) -> Option<f64> {
    if probes.is_empty() {
        return None;
    }
    let kept = probes
        .iter()
        .filter(|p| hay.contains(&p.text) || recallable.contains(&p.text))
        .count();
    Some(kept as f64 / probes.len() as f64)
}

/// The originals the recall keys in `hay` give back, as the proxy would
/// answer them (from its state store), one after another.
pub(super) async fn recallable(proxy: &Proxy, hay: &str) -> String {
    let originals = Originals {
        scope: crate::recall::store::scope(&http::HeaderMap::new()),
        own: Default::default(),
    };
    let mut keys: Vec<&str> = crate::compaction::keys::keys_in(hay).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut out = String::new();
    for k in keys {
        if let Some(text) = originals.get(&proxy.recall_state, k).await {
            out.push_str(&text);
            out.push('\n');
        }
    }
    out
}

/// Per probe: whether the agent used it again, i.e. an assistant message
/// (its text or a tool call's arguments) holds it after the first message
/// that does. `texts`: each message's [`message_text`] of the whole
/// conversation; `assistant`: whether each message is the model's.
/// Thinking and reasoning are not read (they are not in [`message_text`],
/// and Codex's are encrypted): what the agent wrote or called counts.
pub(super) fn reused(texts: &[String], assistant: &[bool], probes: &[Probe]) -> Vec<bool> {
    probes
        .iter()
        .map(|p| {
            let mut holding = texts
                .iter()
                .enumerate()
                .filter(|(_, t)| t.contains(&p.text));
            holding.next().is_some()
                && holding.any(|(i, _)| assistant.get(i).copied().unwrap_or(false))
        })
        .collect()
}

/// The text a probe is looked for in: message contents and tool-call
/// arguments.
pub(super) fn haystack(messages: &[Message]) -> String {
    messages
        .iter()
        .map(message_text)
        .collect::<Vec<_>>()
        .join("\n")
}
