//! `fit`: no single tool result or tool-call argument string may take more
//! than `compaction.fit_share` (30%) of the budget; one that does keeps its
//! head and tail up to that share. A 40k-token file dump would otherwise
//! crowd out the rest of the conversation on its own.

use super::conversation::{Analysis, Role};
use super::{Counter, Limits, Settings, Work, cut_content, emergency, mask, shrinkable_result};

/// The size in tokens a message over the limit is cut to.
pub fn limit(budget: f64, share: f64) -> f64 {
    budget * share
}

/// Cuts every message over the limit to it.
pub(super) fn run(
    w: &mut Work,
    a: &Analysis,
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
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
                match mask::shorten_args(&m, keep, keep, keep)
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
    w.record("fit", count, saved);
}
