//! `fade`: when the planned boundaries leave the request over its budget,
//! the larger tool results of the recent turns are shrunk too, older ones
//! more than newer ones.
//!
//! Each consumed result not already masked gets an allowance: a share of the
//! budget (`compaction.fade_share`) times [`OVER_BUDGET`], times a recency
//! weight from 0.2 for the oldest to 1.0 for the newest. A result over its
//! allowance keeps its head and tail.
//!
//! Only over the budget, not from the trigger on: `fade` is decided on each
//! request, not replayed, so what it cut on a turn at the trigger came back
//! whole on the next, once the newest results were masked ahead and the
//! request was under it, and everything after the first restored result
//! left the cached prefix (a Codex session lost 5,500 tokens of it so,
//! twice). A request between the trigger and the budget fits: it goes out,
//! and the next turn's plan moves its boundaries, which stay. On the shared
//! traces (natives included) mean stability at 16k rose from 0.849 to 0.850
//! (chars:3.6) and 0.831 to 0.832 (chars:3.0), retention held or rose, no
//! replay lost, 32k and 64k even; the Codex session gained 0.013 and an
//! OpenHands session 0.029. The pressure bands that shrank results less
//! between 0.80 and 0.99 of the budget went with it: no request reaches
//! `fade` there.

use super::conversation::Analysis;
use super::{Counter, Limits, Settings, Work, cut_content, shrinkable_result};

/// The share of its allowance a result keeps in a request over the budget
/// (the factor of the pressure band above 0.99 the bands had).
pub const OVER_BUDGET: f64 = 0.05;

/// The allowance, in tokens, of the `rank`-th of `count` candidates (0 is
/// the oldest).
pub fn allowance(budget: f64, share: f64, rank: usize, count: usize) -> f64 {
    let weight = if count <= 1 {
        1.0
    } else {
        0.2 + 0.8 * rank as f64 / (count - 1) as f64
    };
    budget * share * OVER_BUDGET * weight
}

/// Shrinks the larger consumed results by their allowances.
pub(super) fn run(
    w: &mut Work,
    a: &Analysis,
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
) {
    let candidates: Vec<(usize, String)> = (0..w.cost.len())
        .filter_map(|i| shrinkable_result(w, a, i).map(|t| (i, t)))
        .collect();
    let (mut count, mut saved) = (0, 0);
    let k = candidates.len();
    for (rank, (i, text)) in candidates.into_iter().enumerate() {
        let limit = allowance(limits.budget, s.fade_share, rank, k);
        let sv = cut_content(w, i, &text, limit, counter);
        if sv > 0 {
            count += 1;
            saved += sv;
        }
    }
    w.record("fade", count, saved);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_results_get_less() {
        let oldest = allowance(10_000.0, 0.1, 0, 5);
        let newest = allowance(10_000.0, 0.1, 4, 5);
        assert!((oldest - 10.0).abs() < 1e-9 && (newest - 50.0).abs() < 1e-9);
        assert!((allowance(10_000.0, 0.1, 0, 1) - 50.0).abs() < 1e-9);
    }
}
