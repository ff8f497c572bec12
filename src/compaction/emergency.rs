//! `emergency`: when nothing else fits, every message but the system and
//! developer messages and the last user message keeps a shrinking share of
//! its text (head and tail), in steps, until the request fits. This is the
//! one stage allowed to shorten unconsumed tool results: a real trace has a
//! system prompt, a task and one fresh 8k-token result that together exceed
//! a 16k window. Reported as its own action. A text `fit` or `fade` cut
//! before is cut again from its original (a cut text holds condense's
//! marker, which `head_tail` leaves alone): a head `fit` cut to 30% of the
//! budget next to a last user message of 70% would otherwise not fit.
//!
//! When the turn in progress cut by the share found, and nothing else,
//! brings the request within its budget, that is what goes out: the prompt
//! before it stays byte-identical (see `fresh_only`).
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
//!
//! With recall on, what the last resort drops stays recoverable: the digest
//! (or checkpoint, or a one-line notice when there is none) comes to stand
//! for every dropped message, under one key for all of them, and when it
//! must go it leaves the notice holding that key. A drop without a key
//! would lose its turns for good, the one cut the agent could not ask for
//! again. The replacement then stands right after the last user message
//! (where the first dropped message stood when nothing follows it): its
//! key changes as turns go, and there it leaves the prefix up to the
//! client's last message byte-identical from turn to turn, the bulk of a
//! request whose last user message fills most of the window.

use bytes::Bytes;

use super::conversation::{Analysis, Role};
use super::text::{content_text, cut_middle_with, head_tail, with_string_field};
use super::{Counter, Work, keys, mask, prune};

/// The shares of each text tried, largest first.
pub const STEPS: &[f64] = &[0.5, 0.25, 0.1, 0.05, 0.0];
/// Characters every shortened text keeps at least.
pub const MIN_CHARS: usize = 64;

/// Shortens `w` towards `target`; with the last resort, until it is within
/// `budget`. The rest of the prompt is left whole when the turn in progress
/// alone, cut as deep, brings the request within `budget` (see
/// [`fresh_only`]).
pub(super) fn run(w: &mut Work, a: &Analysis, target: f64, budget: f64, counter: &dyn Counter) {
    let before = w.total();
    let snapshot = save(w);
    let all = eligible(w, a, 0);
    let (mut touched, share) = shorten(w, &all, &snapshot, STEPS, target, counter);
    if (w.total() as f64) > budget {
        let dropped = last_resort(w, a, budget, counter);
        if dropped > 0 {
            let left = eligible(w, a, 0);
            touched = dropped + shorten(w, &left, &snapshot, STEPS, target, counter).0;
        }
    } else if let Some(share) = share {
        touched = fresh_only(w, a, &snapshot, share, budget, counter).unwrap_or(touched);
    }
    let saved = before.saturating_sub(w.total());
    w.record("emergency", touched, saved);
}

/// The messages `emergency` may shorten, from `from` on: all but the
/// dropped ones, the system and developer messages and the client's last
/// words.
fn eligible(w: &Work, a: &Analysis, from: usize) -> Vec<usize> {
    (from..w.cost.len())
        .filter(|&i| {
            !w.dropped[i]
                && !matches!(a.roles[i], Role::System | Role::Developer)
                && !a.last_words(i)
        })
        .collect()
}

/// Cuts the turn in progress alone (the last assistant message and what
/// follows it), by the `share` every message was cut by, and leaves the
/// rest as it was before `emergency`, if the request is then within
/// `budget`; returns how many messages it changed, or None (leaving `w` as
/// it found it) when the request would not fit or there is no such turn.
///
/// All of the turn in progress is new in this request (the one before
/// ended before the model's answer), so cutting it costs nothing of the
/// prefix the provider has cached, and it keeps exactly what the cut of
/// every message gave it. Cutting the rest too rewrites the whole prompt,
/// and again on the next turn, when it comes back whole: a Codex session at
/// 16k (chars:3.6) read a 27k-token output, and its 9.7 KB instructions
/// went to 713 characters for that one turn.
fn fresh_only(
    w: &mut Work,
    a: &Analysis,
    snapshot: &[(Option<Bytes>, u64)],
    share: f64,
    budget: f64,
    counter: &dyn Counter,
) -> Option<usize> {
    let fresh = eligible(w, a, *a.assistants.last()?);
    let cut = save(w);
    let all = 0..w.cost.len();
    restore(w, snapshot, all.clone());
    let (touched, _) = shorten(w, &fresh, snapshot, &[share], budget, counter);
    if (w.total() as f64) <= budget {
        return Some(touched);
    }
    restore(w, &cut, all);
    None
}

/// Each message's bytes and cost as they are now.
fn save(w: &Work) -> Vec<(Option<Bytes>, u64)> {
    w.bytes
        .iter()
        .cloned()
        .zip(w.cost.iter().copied())
        .collect()
}

/// Puts the messages `which` back as `state` (from [`save`]) had them.
fn restore(w: &mut Work, state: &[(Option<Bytes>, u64)], which: impl IntoIterator<Item = usize>) {
    for i in which {
        w.bytes[i] = state[i].0.clone();
        w.cost[i] = state[i].1;
    }
}

/// Tries `steps`' shares from the largest on the `eligible` messages, each
/// from `snapshot`, until the request is within `target`; returns how many
/// messages the last share tried changed, and that share if the request is
/// within `target` with it.
fn shorten(
    w: &mut Work,
    eligible: &[usize],
    snapshot: &[(Option<Bytes>, u64)],
    steps: &[f64],
    target: f64,
    counter: &dyn Counter,
) -> (usize, Option<f64>) {
    // A text `fit` or `fade` cut holds its marker, which `head_tail` leaves
    // alone: it is cut again from the original, read once for all shares,
    // as is the opening of the notice a cut of the client's text gets.
    let src = w.src;
    let originals: Vec<Option<String>> = eligible
        .iter()
        .map(|&i| match w.cut[i] {
            true => content_text(src[i].content()).map(|t| t.into_owned()),
            false => None,
        })
        .collect();
    let marks: Vec<String> = eligible.iter().map(|&i| w.mark(i)).collect();
    let mut touched = 0;
    for &share in steps {
        restore(w, snapshot, eligible.iter().copied());
        touched = 0;
        for ((&i, original), mark) in eligible.iter().zip(&originals).zip(&marks) {
            let m = w.current(i);
            let mut changed = false;
            if let Some(text) = content_text(m.content()) {
                let keep = ((text.len() as f64 * share) as usize).max(MIN_CHARS);
                if keep < text.len() {
                    // The client's text is cut whatever it holds (its key
                    // in the notice condense writes, not in a marker the
                    // text quotes); what condense rewrote on this request
                    // and did not cut (a placeholder, shortened arguments)
                    // keeps its notices.
                    let (raw, cut) = match original {
                        Some(o) => (src[i].raw(), cut_middle_with(o, keep, mark)),
                        None if w.bytes[i].is_none() => {
                            (m.raw(), cut_middle_with(&text, keep, mark))
                        }
                        None => (m.raw(), head_tail(&text, keep)),
                    };
                    if let Some(bytes) = with_string_field(raw, "content", &cut)
                        && w.replace(i, bytes, counter) > 0
                    {
                        changed = true;
                    }
                }
            }
            let m = w.current(i);
            let chars = mask::args_chars(&m);
            let keep = ((chars as f64 * share) as usize).max(MIN_CHARS);
            if keep < chars
                && let Some(bytes) = mask::shorten_args(&m, keep, keep, &|_| keep)
                && w.replace(i, bytes, counter) > 0
            {
                changed = true;
            }
            touched += usize::from(changed);
        }
        if (w.total() as f64) <= target {
            return (touched, Some(share));
        }
    }
    (touched, None)
}

/// Drops whole turns, oldest first, and then the digest, until the request
/// is within `budget` or only what it cannot do without is left; returns
/// how many messages went. With recall on, the digest is cut to a notice
/// holding the key of every dropped message instead of going.
fn last_resort(w: &mut Work, a: &Analysis, budget: f64, counter: &dyn Counter) -> usize {
    let mut dropped = 0;
    for unit in &a.units {
        if (w.total() as f64) <= budget {
            break;
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
    if w.recall && dropped > 0 {
        cover(w, a, false, counter);
    }
    if (w.total() as f64) > budget && w.digest.is_some() {
        match w.recall {
            true => cover(w, a, true, counter),
            false => w.digest = None,
        }
        dropped += 1;
    }
    dropped
}

/// Makes the replacement stand for every dropped message, under their span
/// key: the digest or checkpoint with its key changed, or (`bare`, or with
/// none yet) a notice; right after the last user message.
fn cover(w: &mut Work, a: &Analysis, bare: bool, counter: &dyn Counter) {
    let count = w.dropped.iter().filter(|d| **d).count();
    if count == 0 {
        return;
    }
    w.replaced = w.dropped.clone();
    let span = (0..w.src.len())
        .filter(|&i| w.replaced[i])
        .map(|i| w.src[i].raw());
    let k = keys::span_key(span);
    let kept = match (&w.digest, bare) {
        (Some((d, _)), false) => keys::retag(d, &k),
        _ => None,
    };
    let notice = || {
        let n = prune::notice(count);
        keys::tag(&n, &k).unwrap_or(n)
    };
    let d = kept.unwrap_or_else(notice);
    let cost = counter.message(&d);
    w.digest = Some((d, cost));
    w.digest_at = a.last_user.map(|u| u + 1).filter(|&i| i < w.src.len());
}
