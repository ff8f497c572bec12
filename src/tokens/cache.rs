//! The per-message token count cache.
//!
//! An agent re-sends its whole history every turn, so almost every message of
//! a request was counted on an earlier turn. Counts are kept under a fast
//! 64-bit hash (xxh3) of the message's exact bytes and the encoding; a
//! re-sent history costs one hash and one lookup per message, and only the
//! new message is tokenized. The cache is a [`Bounded`] of at most
//! `tokens.cache_entries` counts: messages of live conversations survive,
//! abandoned ones age out.

use prometheus::IntCounter;

use crate::cache::{Bounded, PreHashed, one};

pub struct CountCache {
    counts: Bounded<u64, u32, PreHashed>,
    hits: IntCounter,
    misses: IntCounter,
}

impl CountCache {
    /// A cache holding at most `entries` counts.
    pub fn new(entries: usize, hits: IntCounter, misses: IntCounter) -> CountCache {
        CountCache {
            counts: Bounded::hashed(entries, entries as u64, one),
            hits,
            misses,
        }
    }

    /// The count for `key`, computing and storing it on a miss.
    pub fn get_or_insert_with(&self, key: u64, count: impl FnOnce() -> u64) -> u64 {
        if let Some(n) = self.counts.get(&key) {
            self.hits.inc();
            return u64::from(n);
        }
        self.misses.inc();
        let n = count();
        self.counts
            .insert(key, u32::try_from(n).unwrap_or(u32::MAX));
        n
    }

    /// The count for `key` when cached (a hit is counted; a miss is not:
    /// [`CountCache::get_or_insert_with`] counts it).
    pub fn hit(&self, key: u64) -> Option<u64> {
        let n = self.counts.get(&key).map(u64::from);
        if n.is_some() {
            self.hits.inc();
        }
        n
    }

    /// The count for `key` when cached (no counters).
    pub fn peek(&self, key: u64) -> Option<u64> {
        self.counts.get(&key).map(u64::from)
    }

    /// Whether `key` is cached (no counters).
    pub fn contains(&self, key: u64) -> bool {
        self.counts.contains(&key)
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(entries: usize) -> CountCache {
        CountCache::new(
            entries,
            IntCounter::new("h", "h").unwrap(),
            IntCounter::new("m", "m").unwrap(),
        )
    }

    #[test]
    fn counts_once_then_hits() {
        let c = cache(1000);
        let mut calls = 0;
        for _ in 0..3 {
            assert_eq!(
                c.get_or_insert_with(42, || {
                    calls += 1;
                    7
                }),
                7
            );
        }
        assert_eq!(calls, 1);
        assert_eq!((c.hits.get(), c.misses.get()), (2, 1));
    }

    #[test]
    fn memory_stays_bounded() {
        let c = cache(320);
        for k in 0..100_000u64 {
            c.get_or_insert_with(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), || 1);
        }
        assert!(c.len() <= 320, "{}", c.len());
    }
}
