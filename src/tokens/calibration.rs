//! Calibration: how the upstream's token count relates to condense's.
//!
//! For every response that reports `usage.prompt_tokens`, the ratio of that
//! number to condense's raw estimate of exactly the body it sent is an
//! observation for (upstream, model). The *observed* ratio is the median of
//! the last few observations, each weighted by the size of its request: the
//! first observation already moves it (fast convergence), a single odd
//! response (a cached-prompt quirk, a provider that counts a hidden system
//! prompt once) cannot drag it away (outlier resistance), and the large
//! requests, whose fixed overheads matter least and whose fit matters most,
//! count most. Observations are clamped to a sane range, requests too small
//! to say much are ignored, and an unknown pair starts at 1.0.
//!
//! Two ratios come out of it:
//!
//! - the observed ratio, for what condense reports (`x-condense-tokens-*`,
//!   metrics): as close to the upstream's count as condense can get;
//! - the *plan* ratio, for where compaction's boundaries go. The replayed
//!   plan decides every earlier turn's boundaries from their raw counts
//!   against the budget in raw tokens (the prompt budget over this ratio):
//!   if that moved with every observation, earlier decisions would land
//!   elsewhere on the next turn and the provider's cached prefix would be
//!   lost. So the plan ratio stays put while the observed one drifts within
//!   [`PLAN_MARGIN`] of it (content mix, a CJK tool result, the lag of the
//!   median), and is set to the observed one only when that leaves the
//!   margin. Compacting with a ratio up to 8% low leaves the request up to 8%
//!   over the budget by the upstream's count: the reserve
//!   (`tokens.reserve_ratio`) takes part of it, overflow recovery the rest.
//!
//! What is known of one pair is a [`Pair`]: the window of observations and
//! the plan ratio, together, because the plan ratio is a function of the
//! whole sequence of observations (the margin is hysteresis). Replicas
//! sharing a Redis keep one [`Pair`] per pair there (see
//! [`crate::tokens::shared`]) and apply each observation to it with
//! [`Pair::observe`], as one process does to its own.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::key::pair_key;
use crate::cache::{Bounded, PreHashed, one};

/// Ratios outside this range are taken as the nearest bound.
pub const MIN_RATIO: f64 = 0.5;
pub const MAX_RATIO: f64 = 2.5;
/// Estimates below this many tokens are dominated by fixed overheads and
/// are not used.
pub const MIN_ESTIMATE: u64 = 64;
/// The plan ratio stays while the observed ratio is within this share of
/// it either way (observed / plan in [1 / 1.08, 1.08]).
pub const PLAN_MARGIN: f64 = 0.08;
/// Observations kept per (upstream, model).
pub const WINDOW: usize = 9;
/// Pairs kept; client-invented model names cannot grow memory forever (the
/// pairs in use survive a flood of names used once).
const MAX_PAIRS: usize = 4096;

/// What is known of one (upstream, model).
#[derive(Debug, Clone, PartialEq)]
pub struct Ratios {
    /// The median of the recent observations.
    pub observed: f64,
    /// The ratio compaction plans with.
    pub plan: f64,
}

impl Ratios {
    const UNKNOWN: Ratios = Ratios {
        observed: 1.0,
        plan: 1.0,
    };
}

/// What is known of one (upstream, model): the recent observations and
/// the plan ratio they led to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pair {
    /// (ratio, raw estimate of the request it was observed on), oldest
    /// first, at most [`WINDOW`].
    pub observations: VecDeque<(f64, u64)>,
    pub plan: Option<f64>,
}

impl Pair {
    pub fn ratios(&self) -> Ratios {
        let observed = median(&self.observations);
        Ratios {
            observed,
            plan: self.plan.unwrap_or(observed),
        }
    }

    /// Records that the upstream counted `reported` tokens for a body that
    /// condense estimated at `estimated` (raw); false when the observation
    /// was not used (too small to say much, or no usage).
    pub fn observe(&mut self, reported: u64, estimated: u64) -> bool {
        if estimated < MIN_ESTIMATE || reported == 0 {
            return false;
        }
        let x = (reported as f64 / estimated as f64).clamp(MIN_RATIO, MAX_RATIO);
        if self.observations.len() >= WINDOW {
            self.observations.pop_front();
        }
        self.observations.push_back((x, estimated));
        let observed = median(&self.observations);
        let drift = observed / self.plan.unwrap_or(1.0);
        if self.plan.is_none() || !(1.0 / (1.0 + PLAN_MARGIN)..=1.0 + PLAN_MARGIN).contains(&drift)
        {
            self.plan = Some(observed);
        }
        true
    }

    /// Keeps what another process made of the pair to the bounds this one
    /// keeps (at most [`WINDOW`] observations, ratios in range), so that a
    /// record read from the store cannot make this process hold more.
    pub fn bounded(mut self) -> Pair {
        while self.observations.len() > WINDOW {
            self.observations.pop_front();
        }
        for o in &mut self.observations {
            o.0 = if o.0.is_finite() {
                o.0.clamp(MIN_RATIO, MAX_RATIO)
            } else {
                1.0
            };
        }
        self.plan = self
            .plan
            .filter(|p| p.is_finite())
            .map(|p| p.clamp(MIN_RATIO, MAX_RATIO));
        self
    }
}

pub struct Calibration {
    pairs: Bounded<u64, Arc<Mutex<Pair>>, PreHashed>,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            pairs: Bounded::hashed(MAX_PAIRS, MAX_PAIRS as u64, one),
        }
    }
}

impl Calibration {
    /// The ratios to multiply a raw estimate by (both 1.0 until observed).
    pub fn ratios(&self, upstream: &str, model: &str) -> Ratios {
        self.pairs
            .get(&pair_key(upstream, model))
            .and_then(|p| p.lock().ok().map(|p| p.ratios()))
            .unwrap_or(Ratios::UNKNOWN)
    }

    /// What this process knows of the pair with this [`pair_key`].
    pub fn pair(&self, key: u64) -> Pair {
        self.pairs
            .get(&key)
            .and_then(|p| p.lock().ok().map(|p| p.clone()))
            .unwrap_or_default()
    }

    /// Takes what the replicas know of the pair (read from, or just
    /// written to, the state store) as this process's own.
    pub fn set(&self, key: u64, pair: Pair) {
        let slot = self.pairs.get_or_insert_with(key, Default::default);
        if let Ok(mut p) = slot.lock() {
            *p = pair;
        }
    }

    /// The observed ratio (1.0 until observed).
    pub fn ratio(&self, upstream: &str, model: &str) -> f64 {
        self.ratios(upstream, model).observed
    }

    /// Records that the upstream counted `reported` tokens for a body that
    /// condense estimated at `estimated` (raw, before calibration). Returns
    /// the ratios now in use, or None when the observation was not used.
    pub fn observe(
        &self,
        upstream: &str,
        model: &str,
        reported: u64,
        estimated: u64,
    ) -> Option<Ratios> {
        if estimated < MIN_ESTIMATE || reported == 0 {
            return None;
        }
        let pair = self
            .pairs
            .get_or_insert_with(pair_key(upstream, model), Default::default);
        let mut pair = pair.lock().ok()?;
        pair.observe(reported, estimated).then(|| pair.ratios())
    }
}

/// The weighted median: the ratio at which half the weight lies on either
/// side (between the two middle ones when it falls exactly between).
fn median(w: &VecDeque<(f64, u64)>) -> f64 {
    if w.is_empty() {
        return 1.0;
    }
    let mut v: Vec<(f64, u64)> = w.iter().copied().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: u64 = v.iter().map(|(_, weight)| weight).sum();
    let mut below = 0;
    for (i, (ratio, weight)) in v.iter().enumerate() {
        below += weight;
        if 2 * below > total {
            return *ratio;
        }
        if 2 * below == total {
            return v.get(i + 1).map_or(*ratio, |next| (ratio + next.0) / 2.0);
        }
    }
    v[v.len() - 1].0
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
        assert!((c.ratios("u", "m").plan - 1.3).abs() < 1e-9);
        assert_eq!(c.ratio("u", "other"), 1.0);
        assert_eq!(c.ratio("v", "m"), 1.0);
    }

    #[test]
    fn large_requests_weigh_more() {
        let c = Calibration::default();
        c.observe("u", "m", 150, 100);
        c.observe("u", "m", 160, 100);
        c.observe("u", "m", 12_000, 10_000);
        assert!((c.ratio("u", "m") - 1.2).abs() < 1e-9);
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

    #[test]
    fn the_plan_ratio_holds_within_the_margin_and_follows_beyond_it() {
        let c = Calibration::default();
        c.observe("u", "m", 1400, 1000);
        // Drift within 8% either way: the plan stays, what is observed moves.
        for reported in [1450, 1500, 1480, 1350, 1320, 1460] {
            let r = c.observe("u", "m", reported, 1000).unwrap();
            assert!((r.plan - 1.4).abs() < 1e-9, "{r:?}");
        }
        assert!((c.ratio("u", "m") - 1.45).abs() < 1e-9);
        // A move beyond it: the plan follows.
        for _ in 0..5 {
            c.observe("u", "m", 1700, 1000);
        }
        let r = c.ratios("u", "m");
        assert_eq!(r.plan, r.observed);
        assert!((r.plan - 1.7).abs() < 1e-9, "{r:?}");
    }
}
