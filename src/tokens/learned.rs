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
//! the error raises it at once. What is learned of one pair is one
//! [`Windows`] record, its times on the wall clock (milliseconds since the
//! Unix epoch) rather than a process's monotonic clock, because replicas
//! sharing a Redis keep the record there and read each other's times (see
//! [`crate::tokens::shared`]).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::key::pair_key;
use crate::cache::{Bounded, PreHashed, one};

/// How long a bound from an overflow error that names no window lasts.
pub const BOUND_TTL: Duration = Duration::from_secs(600);

/// (upstream, model) pairs remembered.
const MAX_PAIRS: usize = 4096;

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A value and the time (milliseconds since the Unix epoch) it stops
/// counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub value: u64,
    pub until: u64,
}

impl Stamp {
    fn live(self, now: u64) -> Option<u64> {
        (now < self.until).then_some(self.value)
    }
}

/// What is learned of one pair's window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Windows {
    /// The window an overflow error named.
    pub window: Option<Stamp>,
    /// An upper bound from an overflow error without numbers (the prompt
    /// that was rejected).
    pub bound: Option<Stamp>,
    /// The largest prompt the upstream accepted (reported usage).
    pub accepted: Option<Stamp>,
}

impl Windows {
    /// Learns the window an overflow error named, for `ttl`.
    pub fn learn(&mut self, window: u64, ttl: Duration, now: u64) {
        keep_smaller(&mut self.window, window, later(now, ttl), now);
    }

    /// Records an upper bound from an overflow error that named no window.
    pub fn bound(&mut self, bound: u64, now: u64) {
        keep_smaller(&mut self.bound, bound, later(now, BOUND_TTL), now);
    }

    /// Records a prompt of `tokens` the upstream accepted. The largest is
    /// kept for `ttl` from when it was seen: a deployment that shrank is
    /// learned once that is over.
    pub fn accepted(&mut self, tokens: u64, ttl: Duration, now: u64) {
        let kept = self.accepted.and_then(|e| e.live(now));
        if kept.is_none_or(|k| tokens >= k) {
            self.accepted = Some(Stamp {
                value: tokens,
                until: later(now, ttl),
            });
        }
    }

    /// Whether a window or a bound was learned (live or not): without one
    /// there is no learned window, and no clock need be read.
    pub fn learned_any(&self) -> bool {
        self.window.is_some() || self.bound.is_some()
    }

    /// The learned window at `now`, floored (never below `min`); None when
    /// nothing is learned, or all of it expired.
    pub fn window(&self, min: u64, now: u64) -> Option<u64> {
        let learned = [self.window, self.bound]
            .into_iter()
            .flatten()
            .filter_map(|e| e.live(now))
            .min()?;
        Some(learned.max(self.floor(min, now)))
    }

    /// The lowest window the pair may be given at `now`.
    fn floor(&self, min: u64, now: u64) -> u64 {
        let accepted = self.accepted.and_then(|e| e.live(now));
        accepted.unwrap_or(0).max(min)
    }
}

/// Windows learned from overflow errors, with their floors.
pub struct Learned {
    pairs: Bounded<u64, Windows, PreHashed>,
    /// The smallest window ever learned.
    min: u64,
    /// How long a window named by an error lasts.
    ttl: Duration,
}

impl Learned {
    /// `min` is raised to 1: a window of 0 is never learned.
    pub fn new(min: u64, ttl: Duration) -> Learned {
        Learned {
            pairs: Bounded::hashed(MAX_PAIRS, MAX_PAIRS as u64, one),
            min: min.max(1),
            ttl,
        }
    }

    /// How long a window named by an error lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The smallest window ever learned.
    pub fn min(&self) -> u64 {
        self.min
    }

    /// Learns the window an overflow error named; returns the window that
    /// now applies to the pair (floored), or None when nothing was learned
    /// (a window of 0).
    pub fn learn(&self, upstream: &str, model: &str, window: u64) -> Option<u64> {
        let (ttl, key) = (self.ttl, pair_key(upstream, model));
        let (w, now) = self.update(key, |w, now| w.learn(window, ttl, now));
        w.window(self.min, now)
    }

    /// Records an upper bound from an overflow error that named no window.
    pub fn bound(&self, upstream: &str, model: &str, bound: u64) {
        self.update(pair_key(upstream, model), |w, now| w.bound(bound, now));
    }

    /// Records a prompt of `tokens` the upstream accepted for the pair.
    pub fn accepted(&self, upstream: &str, model: &str, tokens: u64) {
        let ttl = self.ttl;
        self.update(pair_key(upstream, model), |w, now| {
            w.accepted(tokens, ttl, now);
        });
    }

    /// The learned window of the pair with this [`pair_key`], floored; None
    /// when nothing is learned (or all of it expired). Asked on every
    /// request: when nothing is learned it costs a lookup and no clock.
    pub fn window_keyed(&self, key: u64) -> Option<u64> {
        let w = self.pairs.get(&key)?;
        if !w.learned_any() {
            return None;
        }
        w.window(self.min, now_ms())
    }

    /// What this process knows of the pair with this [`pair_key`].
    pub fn windows(&self, key: u64) -> Windows {
        self.pairs.get(&key).unwrap_or_default()
    }

    /// Takes what the replicas know of the pair (read from, or just
    /// written to, the state store) as this process's own.
    pub fn set(&self, key: u64, windows: Windows) {
        self.pairs.insert(key, windows);
    }

    /// Changes the pair's record (stored only when that changed it); the
    /// record and the time it was changed at.
    fn update(&self, key: u64, change: impl FnOnce(&mut Windows, u64)) -> (Windows, u64) {
        let now = now_ms();
        let before = self.windows(key);
        let mut w = before;
        change(&mut w, now);
        if w != before {
            self.pairs.insert(key, w);
        }
        (w, now)
    }
}

/// Sets `slot` to `value` until `until` unless a smaller value is live; 0
/// is never stored.
fn keep_smaller(slot: &mut Option<Stamp>, value: u64, until: u64, now: u64) {
    if value == 0 || until <= now {
        return;
    }
    let kept = slot.and_then(|e| e.live(now));
    if kept.is_none_or(|k| value <= k) {
        *slot = Some(Stamp { value, until });
    }
}

/// `now` plus `d`, in milliseconds, as late as a u64 goes.
pub fn later(now: u64, d: Duration) -> u64 {
    now.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);
    const HOUR_MS: u64 = 3_600_000;

    fn learned() -> (Learned, u64) {
        (Learned::new(1024, HOUR), pair_key("u", "m"))
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
        assert_eq!(l.window_keyed(key), None, "a floor alone is no window");
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
        let t0 = now_ms();
        let mut w = Windows::default();
        w.learn(8192, HOUR, t0);
        assert_eq!(w.window(1024, t0 + HOUR_MS - 1000), Some(8192));
        assert_eq!(w.window(1024, t0 + HOUR_MS), None);
        // Expired, a larger window is learned again.
        w.learn(16_384, HOUR, t0 + HOUR_MS);
        assert_eq!(w.window(1024, t0 + HOUR_MS), Some(16_384));

        let mut w = Windows::default();
        w.bound(5000, t0);
        let bound_ms = BOUND_TTL.as_millis() as u64;
        assert_eq!(w.window(1024, t0), Some(5000));
        assert_eq!(w.window(1024, t0 + bound_ms), None);

        // The floor of an accepted prompt lasts as long, then the window
        // learned after it applies.
        let mut w = Windows::default();
        w.accepted(20_000, HOUR, t0);
        w.learn(8192, HOUR, t0 + HOUR_MS / 2);
        assert_eq!(w.window(1024, t0 + HOUR_MS / 2), Some(20_000));
        assert_eq!(w.window(1024, t0 + HOUR_MS), Some(8192));
        // A smaller accepted prompt does not lower a live floor, but one
        // seen after it expired is the floor.
        w.accepted(10_000, HOUR, t0 + HOUR_MS / 2);
        assert_eq!(w.floor(1024, t0 + HOUR_MS / 2), 20_000);
        w.accepted(10_000, HOUR, t0 + HOUR_MS);
        assert_eq!(w.floor(1024, t0 + HOUR_MS), 10_000);
    }

    #[test]
    fn a_record_set_from_another_process_keeps_its_times() {
        let (l, key) = learned();
        let now = now_ms();
        let mut w = Windows::default();
        w.learn(8192, Duration::from_secs(10), now);
        l.set(key, w);
        assert_eq!(l.window_keyed(key), Some(8192));
        assert_eq!(l.windows(key).window(1024, now + 11_000), None);
        // A record whose window has passed applies nothing.
        let mut gone = Windows::default();
        gone.learn(4096, Duration::from_millis(1), now - 10);
        l.set(key, gone);
        assert_eq!(l.window_keyed(key), None);
    }
}
