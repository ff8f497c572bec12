//! The per-message token count cache.
//!
//! An agent re-sends its whole history every turn, so almost every message of
//! a request was counted on an earlier turn. Counts are kept under a fast
//! 64-bit hash (xxh3) of the message's exact bytes and the encoding; a
//! re-sent history costs one hash and one lookup per message, and only the
//! new message is tokenized.
//!
//! Memory is bounded by two generations per shard: new entries go into the
//! young generation; when it is full the old one is dropped and the young one
//! takes its place. An entry found in the old generation is copied into the
//! young one, so messages of live conversations survive while abandoned ones
//! age out: an approximate LRU without per-entry bookkeeping.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use prometheus::IntCounter;

const SHARDS: usize = 16;

/// The keys are already uniform hashes; hashing them again would be waste.
#[derive(Default)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Map = HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>;

#[derive(Default)]
struct Shard {
    young: Map,
    old: Map,
}

pub struct CountCache {
    shards: Vec<Mutex<Shard>>,
    /// Entries per generation per shard.
    generation_cap: usize,
    hits: IntCounter,
    misses: IntCounter,
}

impl CountCache {
    /// A cache holding at most about `entries` counts (≈ 24 bytes each).
    pub fn new(entries: usize, hits: IntCounter, misses: IntCounter) -> CountCache {
        CountCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            generation_cap: (entries / SHARDS / 2).max(1),
            hits,
            misses,
        }
    }

    /// The count for `key`, computing and storing it on a miss.
    pub fn get_or_insert_with(&self, key: u64, count: impl FnOnce() -> u64) -> u64 {
        if let Some(n) = self.get(key) {
            self.hits.inc();
            return n;
        }
        self.misses.inc();
        let n = count();
        self.insert(key, n);
        n
    }

    /// Whether `key` is cached (no counters, no promotion).
    pub fn contains(&self, key: u64) -> bool {
        self.shard(key)
            .is_some_and(|s| s.young.contains_key(&key) || s.old.contains_key(&key))
    }

    fn shard(&self, key: u64) -> Option<std::sync::MutexGuard<'_, Shard>> {
        // The top bits pick the shard; the map uses the whole key.
        self.shards[(key >> 60) as usize % SHARDS].lock().ok()
    }

    fn get(&self, key: u64) -> Option<u64> {
        let mut shard = self.shard(key)?;
        if let Some(n) = shard.young.get(&key) {
            return Some(u64::from(*n));
        }
        let n = *shard.old.get(&key)?;
        self.promote(&mut shard, key, n);
        Some(u64::from(n))
    }

    fn insert(&self, key: u64, n: u64) {
        if let Some(mut shard) = self.shard(key) {
            self.promote(&mut shard, key, u32::try_from(n).unwrap_or(u32::MAX));
        }
    }

    fn promote(&self, shard: &mut Shard, key: u64, n: u32) {
        if shard.young.len() >= self.generation_cap {
            shard.old = std::mem::take(&mut shard.young);
        }
        shard.young.insert(key, n);
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .filter_map(|s| s.lock().ok().map(|s| s.young.len() + s.old.len()))
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    #[test]
    fn recently_used_entries_survive_eviction() {
        let c = cache(64); // 2 per generation per shard
        let hot = 5u64 << 60;
        c.get_or_insert_with(hot, || 9);
        for i in 1..1000u64 {
            c.get_or_insert_with((5u64 << 60) | i, || 1);
            // The live conversation touches its message every turn.
            assert_eq!(c.get_or_insert_with(hot, || 0), 9, "evicted at {i}");
        }
    }
}
