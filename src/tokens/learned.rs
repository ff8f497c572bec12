//! Windows learned from context-overflow errors, per (upstream, model), and
//! what keeps them honest.
//!
//! An overflow error from one tenant's request sets the window every tenant
//! of that upstream and model is compacted for, so a learned window:
//! - never goes below a floor: the largest prompt the upstream accepted for
//!   the pair lately (the usage it reported on a success proves the window
//!   is at least that), and `tokens.min_learned_window`;
//! - expires after `tokens.learned_window_ttl_seconds` (a window named by
//!   an error) or [`BOUND_TTL`] (a bound from an error without numbers,
//!   which condense's own estimate may have set too low), so that a
//!   deployment that grew is noticed, and a mistake does not last;
//! - is a smaller one only: a larger learned value does not replace a
//!   smaller one that has not expired.
//!
//! The floor is applied when a window is read, so a prompt accepted after
//! the error raises it at once. A window picked up from another replica
//! (through the state store) keeps the time it has left there.

use std::time::{Duration, Instant};

use super::key::pair_key;
use crate::cache::{Bounded, PreHashed, one};

/// How long a bound from an overflow error that names no window lasts.
pub const BOUND_TTL: Duration = Duration::from_secs(600);

/// (upstream, model) pairs remembered in each table.
const MAX_PAIRS: usize = 4096;

/// A value and the instant it stops counting.
#[derive(Debug, Clone, Copy)]
struct Expiring {
    value: u64,
    until: Instant,
}

impl Expiring {
    fn live(self, now: Instant) -> Option<u64> {
        (now < self.until).then_some(self.value)
    }
}

/// Windows learned from overflow errors, with their floors.
pub struct Learned {
    /// Windows named by overflow errors.
    windows: Bounded<u64, Expiring, PreHashed>,
    /// Upper bounds from overflow errors without numbers (the prompt that
    /// was rejected, in process only).
    bounds: Bounded<u64, Expiring, PreHashed>,
    /// The largest prompt the upstream accepted (reported usage).
    accepted: Bounded<u64, Expiring, PreHashed>,
    /// The smallest window ever learned.
    min: u64,
    /// How long a window named by an error lasts.
    ttl: Duration,
}

impl Learned {
    /// `min` is raised to 1: a window of 0 is never learned.
    pub fn new(min: u64, ttl: Duration) -> Learned {
        let table = || Bounded::hashed(MAX_PAIRS, MAX_PAIRS as u64, one);
        Learned {
            windows: table(),
            bounds: table(),
            accepted: table(),
            min: min.max(1),
            ttl,
        }
    }

    /// How long a window named by an error lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Learns the window an overflow error named; returns the window that
    /// now applies to the pair (floored), the value to share, or None when
    /// nothing was learned (a window of 0).
    pub fn learn(&self, upstream: &str, model: &str, window: u64) -> Option<u64> {
        let key = pair_key(upstream, model);
        let now = Instant::now();
        self.keep_smaller(&self.windows, key, window, later(now, self.ttl), now);
        self.window_at(key, now)
    }

    /// Takes a window another replica learned, with the time it has left.
    pub fn adopt(&self, upstream: &str, model: &str, window: u64, left: Duration) {
        let now = Instant::now();
        let until = later(now, left.min(self.ttl));
        self.keep_smaller(&self.windows, pair_key(upstream, model), window, until, now);
    }

    /// Records an upper bound from an overflow error that named no window.
    pub fn bound(&self, upstream: &str, model: &str, bound: u64) {
        let now = Instant::now();
        let key = pair_key(upstream, model);
        self.keep_smaller(&self.bounds, key, bound, later(now, BOUND_TTL), now);
    }

    /// Records a prompt of `tokens` the upstream accepted for the pair.
    pub fn accepted(&self, upstream: &str, model: &str, tokens: u64) {
        self.accepted_at(pair_key(upstream, model), tokens, Instant::now());
    }

    /// The learned window of the pair with this [`pair_key`], floored; None
    /// when nothing is learned (or all of it expired). Asked on every
    /// request: when nothing is learned it costs two lookups and no clock.
    pub fn window_keyed(&self, key: u64) -> Option<u64> {
        let found = self.found(key);
        if found.iter().all(Option::is_none) {
            return None;
        }
        self.live_window(key, found, Instant::now())
    }

    fn window_at(&self, key: u64, now: Instant) -> Option<u64> {
        self.live_window(key, self.found(key), now)
    }

    /// What the window and bound tables hold for the pair.
    fn found(&self, key: u64) -> [Option<Expiring>; 2] {
        [self.windows.get(&key), self.bounds.get(&key)]
    }

    fn live_window(&self, key: u64, found: [Option<Expiring>; 2], now: Instant) -> Option<u64> {
        let learned = found
            .into_iter()
            .flatten()
            .filter_map(|e| e.live(now))
            .min()?;
        Some(learned.max(self.floor_at(key, now)))
    }

    /// The lowest window the pair may be given now.
    fn floor_at(&self, key: u64, now: Instant) -> u64 {
        let accepted = self.accepted.get(&key).and_then(|e| e.live(now));
        accepted.unwrap_or(0).max(self.min)
    }

    /// The largest accepted prompt is kept for `ttl` from when it was seen:
    /// a deployment that shrank is learned once that is over.
    fn accepted_at(&self, key: u64, tokens: u64, now: Instant) {
        let kept = self.accepted.get(&key).and_then(|e| e.live(now));
        if kept.is_none_or(|k| tokens >= k) {
            let until = later(now, self.ttl);
            self.accepted.insert(
                key,
                Expiring {
                    value: tokens,
                    until,
                },
            );
        }
    }

    /// Stores `value` unless a smaller one is live; 0 is never stored.
    fn keep_smaller(
        &self,
        table: &Bounded<u64, Expiring, PreHashed>,
        key: u64,
        value: u64,
        until: Instant,
        now: Instant,
    ) {
        if value == 0 || until <= now {
            return;
        }
        let kept = table.get(&key).and_then(|e| e.live(now));
        if kept.is_none_or(|k| value <= k) {
            table.insert(key, Expiring { value, until });
        }
    }
}

/// `now` plus `d`, or as late as the clock goes.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn learned() -> (Learned, u64) {
        (Learned::new(1024, HOUR), pair_key("u", "m"))
    }

    /// [`Learned::learn`] at a given instant.
    fn learn_at(l: &Learned, key: u64, window: u64, now: Instant) {
        l.keep_smaller(&l.windows, key, window, later(now, l.ttl), now);
    }

    #[test]
    fn a_window_is_never_below_the_minimum_nor_zero() {
        let (l, key) = learned();
        assert_eq!(l.window_keyed(key), None);
        assert_eq!(l.learn("u", "m", 0), None, "0 is not learned");
        assert_eq!(l.window_keyed(key), None);
        assert_eq!(l.learn("u", "m", 50), Some(1024));
        assert_eq!(l.window_keyed(key), Some(1024));
        let no_minimum = Learned::new(0, HOUR);
        assert_eq!(no_minimum.learn("u", "m", 0), None);
        assert_eq!(no_minimum.learn("u", "m", 1), Some(1));
        // Scoped to the pair.
        assert_eq!(l.window_keyed(pair_key("u", "other")), None);
        assert_eq!(l.window_keyed(pair_key("v", "m")), None);
    }

    #[test]
    fn a_window_is_never_below_the_largest_prompt_accepted() {
        let (l, key) = learned();
        l.accepted("u", "m", 20_000);
        l.accepted("u", "m", 9_000);
        assert_eq!(l.learn("u", "m", 8192), Some(20_000));
        l.accepted("u", "m", 30_000);
        assert_eq!(l.window_keyed(key), Some(30_000), "floored when read");
        // A window above the floor is learned as it is.
        let (l, key) = learned();
        l.accepted("u", "m", 5_000);
        assert_eq!(l.learn("u", "m", 8192), Some(8192));
        assert_eq!(l.window_keyed(key), Some(8192));
        // The floor is per pair.
        l.accepted("u", "other", 100_000);
        assert_eq!(l.window_keyed(key), Some(8192));
    }

    #[test]
    fn a_smaller_window_replaces_a_larger_and_not_the_other_way() {
        let (l, key) = learned();
        l.learn("u", "m", 16_384);
        l.learn("u", "m", 8_192);
        l.learn("u", "m", 32_768);
        assert_eq!(l.window_keyed(key), Some(8_192));
        // A bound without numbers counts too, the smaller of the two.
        l.bound("u", "m", 6_000);
        assert_eq!(l.window_keyed(key), Some(6_000));
        l.bound("u", "m", 0);
        assert_eq!(l.window_keyed(key), Some(6_000));
    }

    #[test]
    fn windows_bounds_and_floors_expire() {
        let (l, key) = learned();
        let t0 = Instant::now();
        learn_at(&l, key, 8192, t0);
        assert_eq!(
            l.window_at(key, t0 + HOUR - Duration::from_secs(1)),
            Some(8192)
        );
        assert_eq!(l.window_at(key, t0 + HOUR), None);
        // Expired, a larger window is learned again.
        learn_at(&l, key, 16_384, t0 + HOUR);
        assert_eq!(l.window_at(key, t0 + HOUR), Some(16_384));

        let (l, key) = learned();
        l.keep_smaller(&l.bounds, key, 5000, t0 + BOUND_TTL, t0);
        assert_eq!(l.window_at(key, t0), Some(5000));
        assert_eq!(l.window_at(key, t0 + BOUND_TTL), None);

        // The floor of an accepted prompt lasts as long, then the window
        // learned after it applies.
        let (l, key) = learned();
        l.accepted_at(key, 20_000, t0);
        learn_at(&l, key, 8192, t0 + HOUR / 2);
        assert_eq!(l.window_at(key, t0 + HOUR / 2), Some(20_000));
        assert_eq!(l.window_at(key, t0 + HOUR), Some(8192));
        // A smaller accepted prompt does not lower a live floor, but one
        // seen after it expired is the floor.
        l.accepted_at(key, 10_000, t0 + HOUR / 2);
        assert_eq!(l.floor_at(key, t0 + HOUR / 2), 20_000);
        l.accepted_at(key, 10_000, t0 + HOUR);
        assert_eq!(l.floor_at(key, t0 + HOUR), 10_000);
    }

    #[test]
    fn an_adopted_window_keeps_the_time_it_has_left() {
        let (l, key) = learned();
        l.adopt("u", "m", 8192, Duration::from_secs(10));
        let now = Instant::now();
        assert_eq!(l.window_at(key, now), Some(8192));
        assert_eq!(l.window_at(key, now + Duration::from_secs(11)), None);
        // Never longer than the configured time.
        l.adopt("u", "m", 4096, 100 * HOUR);
        assert_eq!(l.window_at(key, now + HOUR + Duration::from_secs(1)), None);
        l.adopt("u", "m", 2048, Duration::ZERO);
        assert_eq!(l.window_at(key, now), Some(4096));
    }
}
