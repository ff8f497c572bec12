//! The replayed plan: where the mask frontier stands and which old units are
//! dropped, derived from the request alone.
//!
//! Providers cache prompt prefixes. A boundary that moves a little every turn
//! rewrites the prefix every turn and throws that cache away. Here a boundary
//! moves only on a turn where the compacted request would cross the trigger,
//! and then jumps straight to the target, so it stays put for many turns.
//! condense keeps no state for this: it replays the same decision over the
//! earlier turns the request itself contains (every prefix that ends before
//! an assistant message, then the whole request), using cached per-message
//! counts, so every replica and every restart reaches the same boundaries.
//!
//! Except the budget. It is in raw tokens, the prompt budget over the plan
//! ratio of calibration, and that ratio moves (against an upstream whose
//! tokens per byte depend on what a request holds, compaction itself moves
//! it). Replayed against a larger budget than it had, an earlier turn
//! masks and drops less, and what it had masked comes back. So a
//! conversation that has been compacted keeps the budgets its turns were
//! planned against (`proxy/reached.rs`, in the state store), each earlier
//! turn is replayed against its own ([`Costs::budgets`]), and only the
//! newest is planned against today's: boundaries move forward, never back.
//!
//! Drops (the `prune` stage) are replayed the same way, and only when masking
//! everything outside the recent window still leaves the request over its
//! budget; they also jump to the target, so they are rare and large. They
//! come before `fade` because a boundary that is not replayed cannot stay
//! put; `fade` then works on the current request only. They take the
//! newest turns the frontier has passed first (see `drop_order`).
//!
//! The recent window (the larger of `recent_turns` turns and `recent_share`
//! of the window, but at most `recent_max_share` of the budget and at least
//! the last turn) is protected from masking, with two exceptions:
//!
//! - Masking ahead: once the replay has crossed the trigger, every tool
//!   result an assistant message has answered, and every assistant message
//!   whose results are in and report no error, whose masked form saves at
//!   least `ahead_share` of the budget (0.5%: nearly every result `mask`
//!   would shorten) is masked, recent or not. Such a message sits near the
//!   end of the prompt, so masking it costs the cached prefix only the
//!   placeholder, while keeping it would bring the next frontier move or
//!   drop (which rewrite everything after them) sooner, and the frontier,
//!   when it comes, rewrites every result it passes a second time. A call's
//!   arguments cost nothing at all: they are new in the request that brings
//!   their results. A call that failed keeps them until the agent has
//!   answered, as it may retry with the same content.
//!
//!   But a result only while the request is over the target, oldest
//!   first (on a turn that moves the frontier, which rewrites what follows
//!   it anyway, from the frontier): a result it passes by stays whole until
//!   the frontier comes. Masking every large result took a browsing
//!   session, whose pages are 3k tokens each, to a quarter of its budget on
//!   the turn it first crossed the trigger and kept it under half to the
//!   end, with facts masked that it had room for. Stopping at the midpoint
//!   of target and trigger left a recall too little room: the request sat
//!   nearer the trigger, and a recalled 2.5 KB output came back cut to fit.
//!
//!   The target here is the room's (see `ahead_target`): `target` of what
//!   the fixed tokens and the pinned head leave of the budget, above them.
//!   Against the whole budget, a Claude Code session whose tool schemas and
//!   instructions take most of a small budget is over the target on every
//!   turn, and every result went the turn after the agent read it. And a
//!   result goes only while the request is over that target by more than
//!   a quarter of what masking it saves (`AHEAD_MARGIN`): masking a
//!   7k-token result in a request just over the target left it far under,
//!   and whether a request is just over depends on how its format counts
//!   (the Messages and chat forms of one OpenHands session went different
//!   ways on one turn, and 0.022 apart in stability at 32k chars:3.0).
//!
//!   At 10% of the budget, only the largest results went ahead; every
//!   other one waited for the frontier, which rewrote it, and everything
//!   after it, a second time. At 0.5%, with the room's target and the
//!   margin, over all the shared traces (natives included), mean prefix
//!   stability went from 0.912 to 0.920 at 32k (chars:3.6) and 0.901 to
//!   0.915 (chars:3.0), 0.850 to 0.859 and 0.832 to 0.839 at 16k, 0.938 to
//!   0.940 and 0.931 to 0.934 at 64k; probe retention from 0.962 to 0.962
//!   and 0.957 to 0.960 at 32k, 0.905 to 0.900 and 0.893 to 0.892 at 16k,
//!   0.987 to 0.986 and 0.985 to 0.980 at 64k. (1% kept 0.001 more
//!   retention at 32k, for 0.0005 less stability; 2% 0.003 less stability
//!   at 16k and 32k.) The largest loss: the Claude Code frontend session at
//!   16k, a 7k-token budget, lost 0.08 of probe retention (a file it had
//!   read went the turn after).
//! - When the recent turns alone still hold the request at the trigger after
//!   drops, the frontier moves into them, turn by turn, newest last. An
//!   extractive placeholder that stays put keeps more and breaks the cache
//!   less than `fade` cutting the same results differently on every turn.
//!   When that still leaves the request over its budget, drops come again,
//!   from the turns the frontier has just passed, as the next turn's replay
//!   would drop them (the frontier stands past them by then). Until then
//!   `emergency` cut the whole request for that one turn, the pinned head
//!   included, and the next turn sent it whole again: two rewrites of
//!   everything for one drop. A Codex session whose last user message takes
//!   59% of the budget went from 0.859 to 0.876 of stability at 32k
//!   (chars:3.0), the mean over all the shared traces from 0.9149 to
//!   0.9158, and no other replay moved (16k and 32k, chars:3.6 and 3.0).
//!   Only for what stays once the turn in progress is answered: its
//!   unanswered results are `emergency`'s, for that turn. Dropping for them
//!   too took a Claude Code session's recent turns on its first compacted
//!   turn (probe retention 0.868 to 0.821 at 16k, chars:3.6).
//!
//! Until a conversation has first been compacted, a turn is at the trigger
//! by its size as the client sent it, not as `fit` leaves it: the pipeline
//! compacts a request that size puts at the trigger, and `fit` cuts only in
//! one it compacts. When `fit` alone brought the request back under the
//! trigger, the turn went out with one old result cut, which broke the
//! cached prefix there, and no boundary move: the next turn moved it and
//! broke the prefix again. Against a provider that counts a Messages body
//! 5% larger than the same conversation as chat, the Messages form of an
//! OpenHands session fell into that on its first compacted turn and kept
//! 0.867 of its prefix at 32k (chars:3.6) where the chat form kept 0.897;
//! counted as sent, 0.901 and 0.897, and mean stability over all the shared
//! traces at 32k went from 0.910 to 0.912 (chars:3.6) and 0.897 to 0.899
//! (chars:3.0), 16k and 64k even.
//!
//! Results answered by no assistant message yet are never reached, and
//! `fit` leaves them whole; so an earlier turn is replayed with the results
//! that ended it at their full size (as that turn's request had them), and
//! drops count the newest results at the size they will have once answered
//! (a result larger than the target must not take every droppable turn with
//! it only to be masked on the next turn).

use super::conversation::{Analysis, Role};
use super::extract::{digest_tokens, placeholder_tokens};

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Messages in `[base, frontier)` are compacted (masked where maskable).
    pub frontier: usize,
    /// Large answered tool results and tool-call arguments at or past the
    /// frontier, masked ahead of it.
    pub ahead: Vec<bool>,
    pub dropped: Vec<bool>,
    /// With [`Drops::Span`]: where the dropped span ended after each drop
    /// event, oldest first (the last is the current end).
    pub span_ends: Vec<usize>,
    /// The room (see [`Costs::room_at`]) the digest of the dropped
    /// messages is sized by: that of the turn that last dropped more.
    pub digest_room: f64,
}

/// How old turns are dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Drops {
    /// The newest units the frontier has passed first, those with
    /// epistemic markers last; never the task or the last user message. A
    /// short digest takes their place.
    Units,
    /// One contiguous span from the first message after the leading
    /// system/developer ones, ending between units; the last user message
    /// stays (a checkpoint summarizing the span takes its place).
    Span,
}

/// When the plan drops, and what it drops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropPolicy {
    pub kind: Drops,
    /// Drop when the request would have more raw tokens than this ...
    pub over_tokens: f64,
    /// ... or more messages than this.
    pub over_messages: Option<usize>,
    /// What the plan counts for the message that replaces dropped ones: a
    /// checkpoint's most tokens, or (None) a digest's, which grows with
    /// what it replaces (see [`super::extract::digest_size`]); an upper
    /// bound either way, as the plan must not depend on its exact text.
    pub replacement_tokens: Option<u64>,
}

impl DropPolicy {
    /// Drop units, with a digest, only when the request would not fit.
    pub fn units(budget: f64) -> DropPolicy {
        DropPolicy {
            kind: Drops::Units,
            over_tokens: budget,
            over_messages: None,
            replacement_tokens: None,
        }
    }
}

/// Token figures the plan works with, all in raw (uncalibrated) tokens.
pub struct Costs<'a> {
    /// Each message as it is (after `fit`).
    pub full: &'a [u64],
    /// Each message as the client sent it: `fit` leaves results no
    /// assistant message has answered yet alone, so in an earlier turn's
    /// request the results that ended it were at this size.
    pub sent: &'a [u64],
    /// The most tokens `fit` leaves an answered result.
    pub fit_limit: f64,
    /// The characters of key lines a placeholder keeps for a 3 KB output
    /// (see [`super::extract::placeholder_size`]).
    pub placeholder_chars: usize,
    /// The pinned head: the messages before [`Analysis::head`].
    pub head: u64,
    /// Each message masked (equal to `full` when masking does not apply).
    pub masked: &'a [u64],
    /// Assistant messages a result of whose calls reports a failure.
    pub failed: &'a [bool],
    /// Tokens outside the messages (reply priming, tool schemas).
    pub fixed: u64,
    pub budget: f64,
    pub window: f64,
    pub trigger: f64,
    pub target: f64,
    pub recent_turns: usize,
    pub recent_share: f64,
    pub recent_max_share: f64,
    /// An answered tool result or assistant message whose masked form saves
    /// at least this many tokens is masked ahead of the frontier.
    pub ahead_saving: f64,
    pub drops: DropPolicy,
    /// The budget each earlier turn was planned against: `(from, budget)`
    /// pairs, ascending by `from`. A prefix that ends at `e`, short of the
    /// whole request, was planned against the budget of the last pair with
    /// `from <= e` (of the first pair when none is), and every threshold
    /// drawn from the budget scales with it. Empty: every turn against
    /// `budget`.
    pub budgets: &'a [(usize, f64)],
}

impl Costs<'_> {
    /// The budget the prefix ending at `e` is planned against (see
    /// [`Costs::budgets`]).
    fn budget_at(&self, e: usize) -> f64 {
        if e >= self.full.len() {
            return self.budget;
        }
        let after = self.budgets.partition_point(|&(from, _)| from <= e);
        self.budgets
            .get(after.saturating_sub(1))
            .map_or(self.budget, |&(_, b)| b)
    }

    /// What the prefix ending at `e` has for the conversation: its budget
    /// less the fixed tokens and the pinned head.
    pub fn room_at(&self, e: usize) -> f64 {
        self.budget_at(e) - (self.fixed + self.head) as f64
    }

    /// [`Costs::budget_at`] as a share of `budget`, for the thresholds drawn
    /// from it.
    fn scale(&self, e: usize) -> f64 {
        self.budget_at(e) / self.budget
    }
}

fn prefix_sums(v: &[u64]) -> Vec<u64> {
    let mut out = vec![0; v.len() + 1];
    refresh_sums(&mut out, v, 0);
    out
}

/// Brings the prefix sums `sums` of `v` up to date after a change at `k`
/// and later: masking ahead changes messages near the end of the prefix,
/// nearly every turn, so only the sums after them are recomputed.
fn refresh_sums(sums: &mut [u64], v: &[u64], k: usize) {
    for j in k..v.len() {
        sums[j + 1] = sums[j] + v[j];
    }
}

/// Prefix sums of the message costs; `full` counts a message masked ahead of
/// the frontier at its masked cost.
struct Sums {
    full: Vec<u64>,
    masked: Vec<u64>,
    /// Of the messages as they are (for the recent window's size).
    raw: Vec<u64>,
    /// Of the messages as the client sent them (for the trigger before
    /// compaction has begun).
    sent: Vec<u64>,
    /// For the prefix ending at `e`: what its trailing unanswered results
    /// have beyond their fitted size.
    unfit: Vec<u64>,
    /// For the prefix ending at `e`: what its trailing unanswered results
    /// have beyond what `fit` leaves of them once they are answered.
    relief: Vec<u64>,
}

/// What the plan has dropped: its raw tokens (at their masked size), and
/// the room of the turn that last dropped more, which the digest is sized
/// by. A later turn's room moves with the plan ratio; sized by it, the
/// digest was rewritten with the same turns dropped, and everything after
/// it lost the provider's cached prefix.
#[derive(Debug, Clone, Copy)]
struct Dropped {
    tokens: u64,
    room: f64,
}

/// The planned request's cost for the prefix ending at `e` with the
/// frontier at `f`, `gone` of it dropped.
fn cost(sums: &Sums, c: &Costs, e: usize, f: usize, gone: Dropped) -> f64 {
    let replacement = match c.drops.replacement_tokens {
        _ if gone.tokens == 0 => 0,
        Some(tokens) => tokens,
        None => digest_tokens(gone.tokens, gone.room),
    };
    (c.fixed + sums.masked[f] + (sums.full[e] - sums.full[f]) + sums.unfit[e] + replacement)
        .saturating_sub(gone.tokens) as f64
}

pub fn plan(a: &Analysis, c: &Costs) -> Plan {
    let n = c.full.len();
    let mut full = c.full.to_vec();
    let mut sums = Sums {
        full: prefix_sums(&full),
        masked: prefix_sums(c.masked),
        raw: prefix_sums(c.full),
        sent: prefix_sums(c.sent),
        unfit: tail_sums(a, c, |i, _| c.sent[i].saturating_sub(c.full[i])),
        relief: tail_sums(a, c, |i, e| {
            c.sent[i].saturating_sub(answered_cost(c, i, c.scale(e)))
        }),
    };
    let mut frontier = a.base;
    let mut dropped = vec![false; n];
    let mut ahead = vec![false; n];
    let mut engaged = false;
    let mut ahead_from = a.base;
    let mut gone = Dropped {
        tokens: 0,
        room: c.room_at(n),
    };
    let mut dropped_count = 0usize;
    // A replaced span starts after the pinned head: the client's
    // instructions, environment and task stay verbatim and in place.
    let mut span_end = a.head;
    let mut span_ends = Vec::new();
    let mut ends: Vec<usize> = a.assistants.clone();
    ends.push(n);
    let p = &c.drops;
    let kept = |e: usize, dropped_count: usize| e - dropped_count + usize::from(dropped_count > 0);
    let over_messages = |e: usize, dropped_count: usize, limit: Option<usize>| {
        limit.is_some_and(|m| kept(e, dropped_count) > m)
    };
    for &e in &ends {
        if e <= a.base || e < frontier {
            continue;
        }
        // This turn's budget: an earlier turn is replayed against the one
        // it was planned against.
        let budget = c.budget_at(e);
        let ahead_at = ahead_target(c, budget);
        // Once compaction has begun, results the agent has answered whose
        // placeholder saves `ahead_share` of the budget are masked ahead of
        // the frontier while the request is over the room's target, by the
        // margin (see the module notes).
        if engaged {
            let over = cost(&sums, c, e, frontier, gone) - ahead_at;
            if let Some(k) = mask_answered(a, c, e, over, &mut ahead_from, &mut full, &mut ahead) {
                refresh_sums(&mut sums.full, &full, k);
            }
        }
        // Until compaction has begun, a turn is at the trigger as the
        // client sent it, as the pipeline measured it: `fit` cuts only in a
        // request compacted anyway, and one it alone brought under the
        // trigger broke the cached prefix at the result it cut, for a turn
        // with no boundary move (see the module notes).
        let hot = cost(&sums, c, e, frontier, gone) >= c.trigger * budget
            || (!engaged && (c.fixed + sums.sent[e]) as f64 >= c.trigger * budget);
        if !hot && !over_messages(e, dropped_count, p.over_messages) {
            continue;
        }
        let limit = protect_start(a, &sums, c, e);
        if hot && limit > frontier {
            // Candidate boundaries: turn starts (assistant messages) up to
            // the recent window; the smallest that reaches the target.
            let lo = a.assistants.partition_point(|&x| x <= frontier);
            let hi = a.assistants.partition_point(|&x| x <= limit);
            let mut candidates: Vec<usize> = a.assistants[lo..hi].to_vec();
            if candidates.last() != Some(&limit) {
                candidates.push(limit);
            }
            let first_ok =
                candidates.partition_point(|&f| cost(&sums, c, e, f, gone) > c.target * budget);
            frontier = candidates.get(first_ok).copied().unwrap_or(limit);
        }
        // A turn that moves the frontier rewrites everything after it, so
        // masking ahead there costs the cache nothing more: large answered
        // results past the frontier are masked while the request is over
        // the target, those passed by before included.
        if hot {
            engaged = true;
            let over = cost(&sums, c, e, frontier, gone) - ahead_at;
            let mut from = frontier;
            if let Some(k) = mask_answered(a, c, e, over, &mut from, &mut full, &mut ahead) {
                refresh_sums(&mut sums.full, &full, k);
            }
            ahead_from = ahead_from.max(from);
        }
        // Drops; then the recent window, and when the frontier moved into
        // it, drops again (see the module notes).
        let mut into_recent = false;
        let span_before = span_end;
        // Drops go down to the target (and to half the message limit), so
        // they are rare and large.
        let half = p.over_messages.map(|m| m / 2);
        // Results the agent has not answered yet count at the size `fit`
        // gives them once it has: a result too large for the target now
        // must not take every droppable turn with it.
        let over_tokens = p.over_tokens * c.scale(e);
        loop {
            // Into the recent window, only for what stays once the turn in
            // progress is answered: its unanswered results alone are
            // `emergency`'s, for this turn. The pass starts and stops on
            // that same measure.
            let relief = if into_recent { sums.relief[e] } else { 0 } as f64;
            let done = |sums: &Sums, gone: Dropped, count: usize| {
                let now = cost(sums, c, e, frontier, gone);
                now - sums.relief[e] as f64 <= c.target * budget
                    && now - relief <= over_tokens.min(budget)
                    && !over_messages(e, count, half)
            };
            if cost(&sums, c, e, frontier, gone) - relief > over_tokens
                || over_messages(e, dropped_count, p.over_messages)
            {
                match p.kind {
                    Drops::Units => {
                        for u in drop_order(a, frontier, &dropped) {
                            if done(&sums, gone, dropped_count) {
                                break;
                            }
                            for &i in &a.units[u] {
                                dropped[i] = true;
                                gone.tokens += c.masked[i];
                                dropped_count += 1;
                            }
                            gone.room = c.room_at(e);
                        }
                    }
                    Drops::Span => {
                        for cut in span_cuts(a, span_end, frontier.max(limit)) {
                            if done(&sums, gone, dropped_count) {
                                break;
                            }
                            for i in span_end..cut {
                                if !a.last_words(i) {
                                    dropped[i] = true;
                                    gone.tokens += c.masked[i];
                                    dropped_count += 1;
                                }
                            }
                            span_end = cut;
                        }
                    }
                }
            }
            if into_recent {
                break;
            }
            // When the recent turns alone hold the request at the trigger, the
            // recent window yields to masking (turn by turn, newest last): an
            // extractive placeholder that stays put beats cutting the same
            // results differently on every turn.
            if cost(&sums, c, e, frontier, gone) >= c.trigger * budget {
                let last = a.assistants.partition_point(|&x| x < e);
                let lo = a.assistants.partition_point(|&x| x <= frontier);
                let candidates: Vec<usize> = a.assistants[lo..last].to_vec();
                let first_ok =
                    candidates.partition_point(|&f| cost(&sums, c, e, f, gone) > c.target * budget);
                if let Some(&f) = candidates.get(first_ok).or(candidates.last()) {
                    into_recent = f > frontier;
                    frontier = f;
                }
            }
            if !into_recent {
                break;
            }
        }
        // One drop event a turn, however many passes it took.
        if span_end > span_before {
            span_ends.push(span_end);
        }
    }
    for (i, masked_ahead) in ahead.iter_mut().enumerate() {
        *masked_ahead &= i >= frontier && !dropped[i];
    }
    Plan {
        frontier,
        ahead,
        dropped,
        span_ends,
        digest_room: gone.room,
    }
}

/// A result is masked ahead only while the request is over its target by
/// more than this share of what masking it saves (see the module notes).
const AHEAD_MARGIN: f64 = 0.25;

/// The target masking ahead aims at in a turn planned against `budget`:
/// `target` of what the fixed tokens and the pinned head leave of it,
/// above them. The share of the whole budget when they are small; a
/// reachable one when they take most of it.
fn ahead_target(c: &Costs, budget: f64) -> f64 {
    let pinned = (c.fixed + c.head) as f64;
    pinned + c.target * (budget - pinned).max(0.0)
}

/// Masks ahead of the frontier, in `[*from, e)`, every tool result a later
/// assistant message before `e` answers and every assistant message whose
/// calls have done their work (see below), if its masked form saves at
/// least `c.ahead_saving`: the calls always, the results oldest first
/// while the request is `over` its target (by more than [`AHEAD_MARGIN`]
/// of what each saves) once what is masked is taken off.
/// Moves `*from` to the last assistant message before `e` (a result it
/// passes stays whole until the frontier comes). Returns the first it
/// masked, if any.
fn mask_answered(
    a: &Analysis,
    c: &Costs,
    e: usize,
    mut over: f64,
    from: &mut usize,
    full: &mut [u64],
    ahead: &mut [bool],
) -> Option<usize> {
    let answered_before = match a.assistants.partition_point(|&x| x < e) {
        0 => return None,
        k => a.assistants[k - 1],
    };
    let mut first = None;
    let saving = c.ahead_saving * c.scale(e);
    for i in *from..e {
        let done = match a.roles[i] {
            _ if a.output(i) => i < answered_before,
            // A call has done its work once its results are in, unless one
            // reports a failure (the agent may retry it).
            Role::Assistant => i < answered_before || !c.failed[i],
            _ => false,
        };
        // A call's arguments go whenever they are large: they are new in
        // the request that brings their results, so that costs the cache
        // nothing; a result only while the request is over by more than
        // the margin.
        let saves = full[i].saturating_sub(c.masked[i]) as f64;
        let wanted = over > saves * AHEAD_MARGIN || a.roles[i] == Role::Assistant;
        if wanted && done && !ahead[i] && saves >= saving {
            over -= saves;
            ahead[i] = true;
            full[i] = c.masked[i];
            first = first.or(Some(i));
        }
    }
    *from = (*from).max(answered_before);
    first
}

/// What a result that came in at `c.sent[i]` is expected to cost once it is
/// answered, in a turn whose budget is `scale` times this one's: a
/// placeholder if it is large enough to be masked ahead of the frontier,
/// else what `fit` leaves of it. Masked ahead only while the request is
/// over its target, it may stay whole, but then the request is under the
/// target anyway, which is all the drops that count on this figure ask.
/// It depends on the sent size and that budget alone, so every later turn
/// replays the same figure.
fn answered_cost(c: &Costs, i: usize, scale: f64) -> u64 {
    let fitted = c.sent[i].min((c.fit_limit * scale) as u64);
    let placeholder = placeholder_tokens(c.placeholder_chars, fitted);
    if (fitted.saturating_sub(placeholder)) as f64 >= c.ahead_saving * scale {
        placeholder
    } else {
        fitted
    }
}

/// For every prefix end `e` (an assistant message or the whole request;
/// 0 elsewhere), `excess(i, e)` summed over the tool results `i` after its
/// last assistant message.
fn tail_sums(a: &Analysis, c: &Costs, excess: impl Fn(usize, usize) -> u64) -> Vec<u64> {
    let n = c.full.len();
    let mut out = vec![0; n + 1];
    let mut tail = Vec::new();
    for e in 0..=n {
        if e == n || a.roles[e] == Role::Assistant {
            out[e] = tail.iter().map(|&i| excess(i, e)).sum();
            tail.clear();
        } else if a.output(e) {
            tail.push(e);
        }
    }
    out
}

/// Where a span that now ends at `from` may end next, ascending: between
/// units (a call never apart from its results), at most at `frontier`.
fn span_cuts(a: &Analysis, from: usize, frontier: usize) -> Vec<usize> {
    // A cut at `c` splits a unit when the unit has members below and at or
    // above `c`.
    let mut split = vec![0i32; frontier + 2];
    for unit in &a.units {
        let (Some(&lo), Some(&hi)) = (unit.iter().min(), unit.iter().max()) else {
            continue;
        };
        if lo < hi && lo < frontier {
            split[lo + 1] += 1;
            split[(hi + 1).min(frontier + 1)] -= 1;
        }
    }
    let mut open = 0;
    let mut cuts = Vec::new();
    for cut in 0..=frontier {
        open += split[cut];
        if cut > from && open == 0 {
            cuts.push(cut);
        }
    }
    cuts
}

/// Where the protected recent window starts in the prefix ending at `e`: the
/// larger of the last `recent_turns` turns and the last `recent_share` of
/// the window, at most `recent_max_share` of the budget, starting at an
/// assistant message (so everything before it is consumed).
fn protect_start(a: &Analysis, sums: &Sums, c: &Costs, e: usize) -> usize {
    let idx = a.assistants.partition_point(|&x| x < e);
    if idx < c.recent_turns.max(1) {
        return a.base;
    }
    let mut pos = idx - c.recent_turns.max(1);
    let scale = c.scale(e);
    let min_tokens = c.recent_share * c.window * scale;
    while pos > 0 && ((sums.raw[e] - sums.raw[a.assistants[pos]]) as f64) < min_tokens {
        pos -= 1;
    }
    // ... but at most `recent_max_share` of the budget (at least one turn):
    // on a small window, three turns of large results cannot all stay.
    let max_tokens = c.recent_max_share * c.budget_at(e);
    while pos + 1 < idx && ((sums.raw[e] - sums.raw[a.assistants[pos]]) as f64) > max_tokens {
        pos += 1;
    }
    a.assistants[pos].max(a.base)
}

/// Units that may be dropped below `frontier`, in the order to drop them:
/// the newest first, those with epistemic markers after the others, what
/// the user wrote after all of them (the oldest of it first). Never the
/// task, the client's last words (see [`Analysis::last_words`]), or
/// anything of the recent window.
///
/// The newest first because a drop rewrites the request from the first
/// message it removes, and the digest stands there. Taken from just below
/// the frontier, the older masked turns before them keep their bytes and
/// the provider's cached prefix holds up to the drop; oldest first, every
/// drop rewrote everything after the task, and the next one did again.
/// Over all the shared traces this took mean prefix stability at 16k from
/// 0.843 to 0.848 (chars:3.6) and 0.826 to 0.828 (chars:3.0), at 32k
/// from 0.911 to 0.912 and 0.899 to 0.900; probe retention at 16k from
/// 0.913 to 0.905 and 0.889 to 0.893, at 32k from 0.960 to 0.962 and
/// 0.954 to 0.957; facts the agent used again at 16k from 0.942 to 0.939
/// and 0.919 to 0.934, 32k even; 64k even. The OpenHands requests session
/// gained 0.025 of stability at 16k (chars:3.6) and lost 0.05 of
/// retention there (an early traceback's frames, which a digest of the
/// oldest turns had kept and its placeholder did not); the Claude Code
/// musdb session gained 0.047 of retention at 16k (chars:3.0), Codex's
/// openprintkit 0.051 of facts used again.
fn drop_order(a: &Analysis, frontier: usize, dropped: &[bool]) -> Vec<usize> {
    let eligible = |u: &Vec<usize>| {
        u.iter().all(|&i| {
            i >= a.base && i < frontier && !a.pinned[i] && !a.last_words(i) && !dropped[i]
        })
    };
    let mut order: Vec<usize> = (0..a.units.len())
        .filter(|&u| eligible(&a.units[u]))
        .collect();
    // What the user wrote goes last of all: an agent's later instructions
    // (the real task after a greeting, a correction) are few and short,
    // and nothing else stands for them. Among them the oldest first: a
    // later one (a correction) may overrule it, and the digest gives it.
    let said = |u: usize| a.units[u].iter().any(|&i| a.said(i));
    order.sort_by_key(|&u| {
        let at = a.units[u][0] as i64;
        (
            said(u),
            a.units[u].iter().any(|&i| a.marker[i]),
            if said(u) { at } else { -at },
        )
    });
    order
}
