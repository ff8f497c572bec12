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
//! Drops (the `prune` stage) are replayed the same way, and only when masking
//! everything outside the recent window still leaves the request over its
//! budget; they also jump to the target, so they are rare and large. They
//! come before `fade` because a boundary that is not replayed cannot stay
//! put; `fade` then works on the current request only.
//!
//! The recent window (the larger of `recent_turns` turns and `recent_share`
//! of the window) is protected from masking, with one exception: when the
//! recent turns alone still hold the request at the trigger after drops
//! (a 16k window with 5k-token results), the frontier moves into them, turn
//! by turn, newest last. Results answered by no assistant message yet are
//! never reached. An extractive placeholder that stays put keeps more and
//! breaks the cache less than `fade` cutting the same results differently
//! on every turn (on the shared traces at 16k: prefix stability 0.80 and
//! probe retention 0.91, against 0.76 and 0.90).

use super::conversation::Analysis;

/// What the plan costs a digest message in place of dropped units (an upper
/// bound; the plan must not depend on the digest's exact text).
pub const DIGEST_ESTIMATE: u64 = 400;

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Messages in `[base, frontier)` are compacted (masked where maskable).
    pub frontier: usize,
    pub dropped: Vec<bool>,
    /// With [`Drops::Span`]: where the dropped span ended after each drop
    /// event, oldest first (the last is the current end).
    pub span_ends: Vec<usize>,
}

/// How old turns are dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Drops {
    /// Oldest units first, those with epistemic markers last; never the task
    /// or the last user message. A short digest takes their place.
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
    /// What the plan counts for the message that replaces dropped ones.
    pub replacement_tokens: u64,
}

impl DropPolicy {
    /// Drop units, with a digest, only when the request would not fit.
    pub fn units(budget: f64) -> DropPolicy {
        DropPolicy {
            kind: Drops::Units,
            over_tokens: budget,
            over_messages: None,
            replacement_tokens: DIGEST_ESTIMATE,
        }
    }
}

/// Token figures the plan works with, all in raw (uncalibrated) tokens.
pub struct Costs<'a> {
    /// Each message as it is.
    pub full: &'a [u64],
    /// Each message masked (equal to `full` when masking does not apply).
    pub masked: &'a [u64],
    /// Tokens outside the messages (reply priming, tool schemas).
    pub fixed: u64,
    pub budget: f64,
    pub window: f64,
    pub trigger: f64,
    pub target: f64,
    pub recent_turns: usize,
    pub recent_share: f64,
    pub drops: DropPolicy,
}

struct Sums {
    full: Vec<u64>,
    masked: Vec<u64>,
}

impl Sums {
    fn new(c: &Costs) -> Sums {
        let prefix = |v: &[u64]| {
            let mut out = Vec::with_capacity(v.len() + 1);
            out.push(0);
            for x in v {
                out.push(out.last().copied().unwrap_or(0) + x);
            }
            out
        };
        Sums {
            full: prefix(c.full),
            masked: prefix(c.masked),
        }
    }
}

pub fn plan(a: &Analysis, c: &Costs) -> Plan {
    let n = c.full.len();
    let sums = Sums::new(c);
    let mut frontier = a.base;
    let mut dropped = vec![false; n];
    let mut dropped_cost = 0u64;
    let mut dropped_count = 0usize;
    let mut span_end = a.base;
    let mut span_ends = Vec::new();
    let mut ends: Vec<usize> = a.assistants.clone();
    ends.push(n);
    let p = &c.drops;
    let cost = |e: usize, f: usize, dropped_cost: u64| -> f64 {
        let replacement = if dropped_cost > 0 {
            p.replacement_tokens
        } else {
            0
        };
        (c.fixed + sums.masked[f] + (sums.full[e] - sums.full[f]) + replacement)
            .saturating_sub(dropped_cost) as f64
    };
    let kept = |e: usize, dropped_count: usize| e - dropped_count + usize::from(dropped_count > 0);
    let over_messages = |e: usize, dropped_count: usize, limit: Option<usize>| {
        limit.is_some_and(|m| kept(e, dropped_count) > m)
    };
    for &e in &ends {
        if e <= a.base || e < frontier {
            continue;
        }
        let hot = cost(e, frontier, dropped_cost) >= c.trigger * c.budget;
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
                candidates.partition_point(|&f| cost(e, f, dropped_cost) > c.target * c.budget);
            frontier = candidates.get(first_ok).copied().unwrap_or(limit);
        }
        // Drops go down to the target (and to half the message limit), so
        // they are rare and large.
        let half = p.over_messages.map(|m| m / 2);
        let done = |dc: u64, count: usize| {
            cost(e, frontier, dc) <= c.target * c.budget && !over_messages(e, count, half)
        };
        if cost(e, frontier, dropped_cost) > p.over_tokens
            || over_messages(e, dropped_count, p.over_messages)
        {
            match p.kind {
                Drops::Units => {
                    for u in drop_order(a, frontier, &dropped) {
                        if done(dropped_cost, dropped_count) {
                            break;
                        }
                        for &i in &a.units[u] {
                            dropped[i] = true;
                            dropped_cost += c.masked[i];
                            dropped_count += 1;
                        }
                    }
                }
                Drops::Span => {
                    let before = span_end;
                    for cut in span_cuts(a, span_end, frontier.max(limit)) {
                        if done(dropped_cost, dropped_count) {
                            break;
                        }
                        for i in span_end..cut {
                            if a.last_user != Some(i) {
                                dropped[i] = true;
                                dropped_cost += c.masked[i];
                                dropped_count += 1;
                            }
                        }
                        span_end = cut;
                    }
                    if span_end > before {
                        span_ends.push(span_end);
                    }
                }
            }
        }
        // When the recent turns alone hold the request at the trigger, the
        // recent window yields to masking (turn by turn, newest last): an
        // extractive placeholder that stays put beats cutting the same
        // results differently on every turn.
        if cost(e, frontier, dropped_cost) >= c.trigger * c.budget {
            let last = a.assistants.partition_point(|&x| x < e);
            let lo = a.assistants.partition_point(|&x| x <= frontier);
            let candidates: Vec<usize> = a.assistants[lo..last].to_vec();
            let first_ok =
                candidates.partition_point(|&f| cost(e, f, dropped_cost) > c.target * c.budget);
            if let Some(&f) = candidates.get(first_ok).or(candidates.last()) {
                frontier = f;
            }
        }
    }
    Plan {
        frontier,
        dropped,
        span_ends,
    }
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
/// the window, starting at an assistant message (so everything before it is
/// consumed).
fn protect_start(a: &Analysis, sums: &Sums, c: &Costs, e: usize) -> usize {
    let idx = a.assistants.partition_point(|&x| x < e);
    if idx < c.recent_turns.max(1) {
        return a.base;
    }
    let mut pos = idx - c.recent_turns.max(1);
    let min_tokens = c.recent_share * c.window;
    while pos > 0 && ((sums.full[e] - sums.full[a.assistants[pos]]) as f64) < min_tokens {
        pos -= 1;
    }
    a.assistants[pos].max(a.base)
}

/// Units that may be dropped below `frontier`, in the order to drop them:
/// the oldest first, those with epistemic markers after all others. Never
/// the task, the last user message, or anything of the recent window.
fn drop_order(a: &Analysis, frontier: usize, dropped: &[bool]) -> Vec<usize> {
    let eligible = |u: &Vec<usize>| {
        u.iter().all(|&i| {
            i >= a.base && i < frontier && !a.pinned[i] && a.last_user != Some(i) && !dropped[i]
        })
    };
    let mut order: Vec<usize> = (0..a.units.len())
        .filter(|&u| eligible(&a.units[u]))
        .collect();
    order.sort_by_key(|&u| (a.units[u].iter().any(|&i| a.marker[i]), a.units[u][0]));
    order
}
