//! `fit`: no single tool result or tool-call argument string may take more
//! than `compaction.fit_share` (30%) of the budget; one that does keeps its
//! head and tail up to that share. A 40k-token file dump would otherwise
//! crowd out the rest of the conversation on its own.
//!
//! Nor may the pinned head's user messages together (an agent's
//! instructions, environment and task, before its first turn), unless they
//! are the client's last words: the larger are cut to a common level, the
//! smaller stay whole. A head that fills most of the budget leaves the plan
//! no room to drop down to: every turn then dropped what it could and went
//! on to `emergency`, which cut the head by a share chosen per request, so
//! the request's largest part changed bytes from one turn to the next. On a
//! Codex session whose AGENTS.md and spec-kit task are 36 KB (0.8 of a 16k
//! window's budget), prefix stability went from 0.54 to 0.77 and retention
//! of the facts probed from 0.42 to 0.62 (`chars:3.6`), and at 32k
//! `chars:3.0` (0.45 of the budget) from 0.80 / 0.71 to 0.82 / 0.78. The
//! head is cut against the budget of the conversation's first compacted
//! turn, which a moving calibration ratio does not change: against today's
//! budget, the head took new bytes at every move of it. (That budget is the
//! oldest the conversation's record keeps, `proxy/reached.rs`: after eight
//! moves of the ratio it goes, and the head is cut once more.) Cut against
//! 40% of the budget instead of 30%, the 16k gains were smaller and 32k
//! lost 0.02.

use super::conversation::{Analysis, Role};
use super::text::content_text;
use super::{Counter, Limits, Settings, Work, cut_content, emergency, mask, shrinkable_result};

/// The size in tokens a message over the limit is cut to.
pub fn limit(budget: f64, share: f64) -> f64 {
    budget * share
}

/// Cuts every message over the limit to it, and the pinned head to the
/// limit of `head_budget` (the budget of the conversation's first compacted
/// turn: the head then stays the same bytes on every later turn).
pub(super) fn run(
    w: &mut Work,
    a: &Analysis,
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
    head_budget: f64,
) {
    let limit = limit(limits.budget, s.fit_share);
    let (mut count, mut saved) = (0, 0);
    for i in 0..w.cost.len() {
        if w.dropped[i] || (w.cost[i] as f64) <= limit {
            continue;
        }
        let sv = match a.roles[i] {
            _ if a.output(i) => match shrinkable_result(w, a, i) {
                Some(text) => cut_content(w, i, &text, limit, counter),
                None => 0,
            },
            Role::Assistant => {
                let m = w.current(i);
                let chars = mask::action_chars(&m);
                let keep = ((chars as f64) * limit / w.cost[i] as f64) as usize;
                let keep = keep.max(emergency::MIN_CHARS);
                match mask::shorten_args(&m, keep, keep, &|_| keep)
                    .or_else(|| mask::shorten_action(&m, keep, keep))
                {
                    Some(b) => w.replace(i, b, counter),
                    None => 0,
                }
            }
            _ => 0,
        };
        if sv > 0 {
            count += 1;
            saved += sv;
        }
    }
    let (hc, hs) = head(w, a, self::limit(head_budget, s.fit_share), counter);
    w.record("fit", count + hc, saved + hs);
}

/// Cuts the pinned head's user messages (the instructions, environment
/// and task before the model's first turn; see [`Analysis::pinned`]) to
/// `limit` tokens together, when they are over it: a level is found that
/// the smaller ones stay under whole, and the larger are cut to it.
/// System and developer messages, the client's last words and texts with
/// no plain text (an image) count at their size and are not cut. Returns
/// the messages cut and the tokens saved.
fn head(w: &mut Work, a: &Analysis, limit: f64, counter: &dyn Counter) -> (usize, u64) {
    let total: u64 = (a.base..a.head)
        .filter(|&i| !w.dropped[i])
        .map(|i| w.cost[i])
        .sum();
    if (total as f64) <= limit {
        return (0, 0);
    }
    let mut fixed = 0u64;
    let mut texts = Vec::new();
    for i in (a.base..a.head).filter(|&i| !w.dropped[i]) {
        let text = (a.roles[i] == Role::User && !a.protected(i))
            .then(|| content_text(w.current(i).content()).map(|t| t.into_owned()))
            .flatten();
        match text {
            Some(t) => texts.push((i, t)),
            None => fixed += w.cost[i],
        }
    }
    let mut room = (limit - fixed as f64).max(0.0);
    let mut sizes: Vec<u64> = texts.iter().map(|&(i, _)| w.cost[i]).collect();
    sizes.sort_unstable();
    let mut level = 0.0;
    for (k, &size) in sizes.iter().enumerate() {
        let even = room / (sizes.len() - k) as f64;
        if (size as f64) > even {
            level = even;
            break;
        }
        room -= size as f64;
    }
    let (mut count, mut saved) = (0, 0);
    for (i, text) in texts {
        let sv = cut_content(w, i, &text, level, counter);
        if sv > 0 {
            count += 1;
            saved += sv;
        }
    }
    (count, saved)
}
