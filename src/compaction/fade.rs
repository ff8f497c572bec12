//! `fade`: when masking old turns is not enough, the larger tool results of
//! the recent turns are shrunk too, the more the higher the pressure, and
//! older ones more than newer ones.
//!
//! Each consumed result not already masked gets an allowance: a share of the
//! budget (`compaction.fade_share`), times the pressure band's factor
//! (pressure ≥ 0.80 → 1.0, ≥ 0.85 → 0.5, ≥ 0.90 → 0.2, ≥ 0.99 → 0.05), times
//! a recency weight from 0.2 for the oldest to 1.0 for the newest. A result
//! over its allowance keeps its head and tail.

use super::conversation::Analysis;
use super::{Counter, Limits, Settings, Work, cut_content, shrinkable_result};

/// The band factor for a pressure.
pub fn band(pressure: f64) -> f64 {
    if pressure >= 0.99 {
        0.05
    } else if pressure >= 0.90 {
        0.2
    } else if pressure >= 0.85 {
        0.5
    } else {
        1.0
    }
}

/// The allowance, in tokens, of the `rank`-th of `count` candidates (0 is
/// the oldest).
pub fn allowance(budget: f64, share: f64, pressure: f64, rank: usize, count: usize) -> f64 {
    let weight = if count <= 1 {
        1.0
    } else {
        0.2 + 0.8 * rank as f64 / (count - 1) as f64
    };
    budget * share * band(pressure) * weight
}

/// Shrinks the larger consumed results by their allowances.
pub(super) fn run(
    w: &mut Work,
    a: &Analysis,
    limits: &Limits,
    s: &Settings,
    counter: &dyn Counter,
) {
    let pressure = w.total() as f64 / limits.budget;
    let candidates: Vec<(usize, String)> = (0..w.cost.len())
        .filter_map(|i| shrinkable_result(w, a, i).map(|t| (i, t)))
        .collect();
    let (mut count, mut saved) = (0, 0);
    let k = candidates.len();
    for (rank, (i, text)) in candidates.into_iter().enumerate() {
        let limit = allowance(limits.budget, s.fade_share, pressure, rank, k);
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
    fn bands_and_recency() {
        assert_eq!(band(0.8), 1.0);
        assert_eq!(band(0.86), 0.5);
        assert_eq!(band(0.95), 0.2);
        assert_eq!(band(1.5), 0.05);
        let oldest = allowance(10_000.0, 0.1, 0.8, 0, 5);
        let newest = allowance(10_000.0, 0.1, 0.8, 4, 5);
        assert!((oldest - 200.0).abs() < 1e-9 && (newest - 1000.0).abs() < 1e-9);
    }
}
