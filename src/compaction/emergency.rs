//! `emergency`: when nothing else fits, every message but the system and
//! developer messages and the last user message keeps a shrinking share of
//! its text (head and tail), in steps, until the request fits. This is the
//! one stage allowed to shorten unconsumed tool results: a real trace has a
//! system prompt, a task and one fresh 8k-token result that together exceed
//! a 16k window. Reported as its own action.
//!
//! When even the smallest share leaves the request over its budget (a long
//! conversation on a small window: every kept message still costs its
//! framing), the last resort keeps only what a request cannot do without:
//! the head (the system and developer messages, and the instructions,
//! environment and task before the first model turn; shortened like the
//! rest, never dropped), the last user message and the turn in progress
//! (its unconsumed results with their call). Older turns are
//! dropped whole, oldest first, then the digest of earlier drops, and the
//! shares are tried again on what is left, which now has room. A client
//! gets an overflow error only when those alone do not fit.

use bytes::Bytes;

use super::conversation::{Analysis, Role};
use super::text::{content_text, head_tail, with_string_field};
use super::{Counter, Work, mask};

/// The shares of each text tried, largest first.
pub const STEPS: &[f64] = &[0.5, 0.25, 0.1, 0.05, 0.0];
/// Characters every shortened text keeps at least.
pub const MIN_CHARS: usize = 64;

/// Shortens `w` towards `target`; with the last resort, until it is within
/// `budget`.
pub(super) fn run(w: &mut Work, a: &Analysis, target: f64, budget: f64, counter: &dyn Counter) {
    let before = w.total();
    let snapshot: Vec<(Option<Bytes>, u64)> = w
        .bytes
        .iter()
        .cloned()
        .zip(w.cost.iter().copied())
        .collect();
    let mut touched = shorten(w, a, &snapshot, target, counter);
    if (w.total() as f64) > budget {
        let dropped = last_resort(w, a, budget);
        if dropped > 0 {
            touched = dropped + shorten(w, a, &snapshot, target, counter);
        }
    }
    let saved = before.saturating_sub(w.total());
    w.record("emergency", touched, saved);
}

/// Tries the shares from the largest, each from `snapshot`, until the
/// request is within `target`; returns how many messages the last share
/// tried changed.
fn shorten(
    w: &mut Work,
    a: &Analysis,
    snapshot: &[(Option<Bytes>, u64)],
    target: f64,
    counter: &dyn Counter,
) -> usize {
    let eligible: Vec<usize> = (0..w.cost.len())
        .filter(|&i| {
            !w.dropped[i]
                && !matches!(a.roles[i], Role::System | Role::Developer)
                && a.last_user != Some(i)
        })
        .collect();
    let mut touched = 0;
    for &share in STEPS {
        for &i in &eligible {
            w.bytes[i] = snapshot[i].0.clone();
            w.cost[i] = snapshot[i].1;
        }
        touched = 0;
        for &i in &eligible {
            let m = w.current(i);
            let mut changed = false;
            if let Some(text) = content_text(m.content()) {
                let keep = ((text.len() as f64 * share) as usize).max(MIN_CHARS);
                if keep < text.len()
                    && let Some(bytes) =
                        with_string_field(m.raw(), "content", &head_tail(&text, keep))
                    && w.replace(i, bytes, counter) > 0
                {
                    changed = true;
                }
            }
            let m = w.current(i);
            let chars = mask::args_chars(&m);
            let keep = ((chars as f64 * share) as usize).max(MIN_CHARS);
            if keep < chars
                && let Some(bytes) = mask::shorten_args(&m, keep, keep, keep)
                && w.replace(i, bytes, counter) > 0
            {
                changed = true;
            }
            touched += usize::from(changed);
        }
        if (w.total() as f64) <= target {
            break;
        }
    }
    touched
}

/// Drops whole turns, oldest first, and then the digest, until the request
/// is within `budget` or only what it cannot do without is left; returns
/// how many messages went.
fn last_resort(w: &mut Work, a: &Analysis, budget: f64) -> usize {
    let mut dropped = 0;
    for unit in &a.units {
        if (w.total() as f64) <= budget {
            return dropped;
        }
        // The head, the last user message and the turn in progress stay.
        if unit
            .iter()
            .any(|&i| w.dropped[i] || a.protected(i) || a.pinned[i])
        {
            continue;
        }
        for &i in unit {
            w.dropped[i] = true;
            dropped += 1;
        }
    }
    if (w.total() as f64) > budget && w.digest.take().is_some() {
        dropped += 1;
    }
    dropped
}
