//! Calibration: how the upstream's token count relates to condense's.
//!
//! For every response that reports `usage.prompt_tokens`, the ratio of that
//! number to condense's raw estimate of exactly the body it sent is an
//! observation for (upstream, model). The ratio in use is the median of the
//! last few observations: the first observation already moves it (fast
//! convergence), and a single odd response (a cached-prompt quirk, a provider
//! that counts a hidden system prompt once) cannot drag it away (outlier
//! resistance). Observations are clamped to a sane range, requests too small
//! to say much are ignored, and an unknown pair starts at 1.0.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::cache::{Bounded, PreHashed, one};
use crate::tokens::pair_key;

/// Ratios outside this range are taken as the nearest bound.
pub const MIN_RATIO: f64 = 0.5;
pub const MAX_RATIO: f64 = 2.5;
/// Estimates below this many tokens are dominated by fixed overheads and
/// are not used.
pub const MIN_ESTIMATE: u64 = 64;
/// Observations kept per (upstream, model).
const WINDOW: usize = 9;
/// Pairs kept; client-invented model names cannot grow memory forever (the
/// pairs in use survive a flood of names used once).
const MAX_PAIRS: usize = 4096;

type Observations = Arc<Mutex<VecDeque<f64>>>;

pub struct Calibration {
    pairs: Bounded<u64, Observations, PreHashed>,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            pairs: Bounded::hashed(MAX_PAIRS, MAX_PAIRS as u64, one),
        }
    }
}

impl Calibration {
    /// The ratio to multiply a raw estimate by (1.0 until observed).
    pub fn ratio(&self, upstream: &str, model: &str) -> f64 {
        self.pairs
            .get(&pair_key(upstream, model))
            .and_then(|w| w.lock().ok().map(|w| median(&w)))
            .unwrap_or(1.0)
    }

    /// The observations of a pair, created empty when there are none.
    fn window(&self, upstream: &str, model: &str) -> Observations {
        self.pairs
            .get_or_insert_with(pair_key(upstream, model), Observations::default)
    }

    /// Records that the upstream counted `reported` tokens for a body that
    /// condense estimated at `estimated` (raw, before calibration). Returns
    /// the ratio now in use, or None when the observation was not used.
    pub fn observe(
        &self,
        upstream: &str,
        model: &str,
        reported: u64,
        estimated: u64,
    ) -> Option<f64> {
        if estimated < MIN_ESTIMATE || reported == 0 {
            return None;
        }
        let x = (reported as f64 / estimated as f64).clamp(MIN_RATIO, MAX_RATIO);
        let window = self.window(upstream, model);
        let mut window = window.lock().ok()?;
        if window.len() == WINDOW {
            window.pop_front();
        }
        window.push_back(x);
        Some(median(&window))
    }

    /// Multiplies the stored ratio by `factor` (a correction learned outside
    /// usage, e.g. from an overflow error naming the provider's count).
    pub fn correct(&self, upstream: &str, model: &str, factor: f64) -> f64 {
        let window = self.window(upstream, model);
        let Ok(mut window) = window.lock() else {
            return 1.0;
        };
        if window.is_empty() {
            window.push_back(1.0);
        }
        for x in window.iter_mut() {
            *x = (*x * factor).clamp(MIN_RATIO, MAX_RATIO);
        }
        median(&window)
    }
}

fn median(w: &VecDeque<f64>) -> f64 {
    if w.is_empty() {
        return 1.0;
    }
    let mut v: Vec<f64> = w.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_at_one_and_converges_on_the_first_observation() {
        let c = Calibration::default();
        assert_eq!(c.ratio("u", "m"), 1.0);
        c.observe("u", "m", 1300, 1000);
        assert!((c.ratio("u", "m") - 1.3).abs() < 1e-9);
        assert_eq!(c.ratio("u", "other"), 1.0);
        assert_eq!(c.ratio("v", "m"), 1.0);
    }

    #[test]
    fn resists_outliers() {
        let c = Calibration::default();
        for _ in 0..4 {
            c.observe("u", "m", 800, 1000);
        }
        c.observe("u", "m", 2400, 1000);
        assert!((c.ratio("u", "m") - 0.8).abs() < 1e-9);
    }

    #[test]
    fn clamps_and_ignores_tiny_requests() {
        let c = Calibration::default();
        assert_eq!(c.observe("u", "m", 5, 10), None);
        c.observe("u", "m", 100_000, 1000);
        assert_eq!(c.ratio("u", "m"), MAX_RATIO);
    }
}
