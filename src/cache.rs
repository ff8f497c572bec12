//! The one bounded cache type condense keeps in memory: per-message token
//! counts, memoized per-message transforms, the in-process state store,
//! learned windows and calibration all live in a [`Bounded`].
//!
//! It is `quick_cache` (sharded, S3-FIFO eviction) with a weight per entry:
//! entries are evicted once their total weight passes the capacity, so no
//! client can grow condense's memory by inventing keys (model names,
//! conversations), and keys that a live conversation keeps using survive a
//! flood of keys used once.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};

use quick_cache::Weighter;
use quick_cache::sync::Cache;

/// The weight of an entry (bytes, or 1 for a count of entries).
pub type Weigh<K, V> = fn(&K, &V) -> u64;

pub struct FnWeighter<K, V>(Weigh<K, V>);

// By hand: a derive would ask for `K: Clone, V: Clone`.
impl<K, V> Clone for FnWeighter<K, V> {
    fn clone(&self) -> Self {
        FnWeighter(self.0)
    }
}

impl<K, V> Weighter<K, V> for FnWeighter<K, V> {
    fn weight(&self, key: &K, val: &V) -> u64 {
        (self.0)(key, val)
    }
}

/// One entry counts 1: the capacity is a number of entries.
pub fn one<K, V>(_: &K, _: &V) -> u64 {
    1
}

/// A bounded concurrent cache. Values are cloned out on a hit: keep them
/// small or cheap to clone (`Bytes`, numbers).
pub struct Bounded<K, V, B = RandomState> {
    inner: Cache<K, V, FnWeighter<K, V>, B>,
}

impl<K: Eq + Hash, V: Clone> Bounded<K, V, RandomState> {
    /// A cache of at most `capacity` weight, with about `items` entries when
    /// full. Keys are hashed with a per-process random seed: keys that come
    /// from clients cannot be chosen to collide.
    pub fn new(items: usize, capacity: u64, weigh: Weigh<K, V>) -> Self {
        Bounded::with_hasher(items, capacity, weigh, RandomState::new())
    }
}

/// Keys that are already uniform 64-bit hashes (xxh3 of a message's bytes)
/// are used as their own hash.
pub type PreHashed = BuildHasherDefault<IdentityHasher>;

impl<V: Clone> Bounded<u64, V, PreHashed> {
    /// A cache keyed by 64-bit hashes of content.
    pub fn hashed(items: usize, capacity: u64, weigh: Weigh<u64, V>) -> Self {
        Bounded::with_hasher(items, capacity, weigh, PreHashed::default())
    }
}

impl<K: Eq + Hash, V: Clone, B: BuildHasher + Clone> Bounded<K, V, B> {
    fn with_hasher(items: usize, capacity: u64, weigh: Weigh<K, V>, hasher: B) -> Self {
        Bounded {
            inner: Cache::with(
                items.max(1),
                capacity.max(1),
                FnWeighter(weigh),
                hasher,
                Default::default(),
            ),
        }
    }

    pub fn get<Q>(&self, key: &Q) -> Option<V>
    where
        Q: Hash + quick_cache::Equivalent<K> + ?Sized,
    {
        self.inner.get(key)
    }

    pub fn contains<Q>(&self, key: &Q) -> bool
    where
        Q: Hash + quick_cache::Equivalent<K> + ?Sized,
    {
        self.inner.contains_key(key)
    }

    /// Stores `value` (an entry heavier than a shard's share of the capacity
    /// is not kept).
    pub fn insert(&self, key: K, value: V) {
        self.inner.insert(key, value);
    }

    pub fn remove<Q>(&self, key: &Q)
    where
        Q: Hash + quick_cache::Equivalent<K> + ?Sized,
    {
        self.inner.remove(key);
    }

    /// The value under `key`, made by `make` and stored on a miss. Two
    /// threads missing the same key at once may both make it (the second
    /// store wins); nothing waits on another thread's work.
    pub fn get_or_insert_with(&self, key: K, make: impl FnOnce() -> V) -> V {
        if let Some(v) = self.inner.get(&key) {
            return v;
        }
        let v = make();
        self.inner.insert(key, v.clone());
        v
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// Total weight held now.
    pub fn weight(&self) -> u64 {
        self.inner.weight()
    }
}

impl<K: Eq + Hash, V: Clone, B: BuildHasher + Clone> std::fmt::Debug for Bounded<K, V, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded")
            .field("entries", &self.len())
            .field("weight", &self.weight())
            .finish()
    }
}

/// The hasher for [`PreHashed`] keys: the key is the hash.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_stays_within_the_capacity() {
        let c: Bounded<String, String> =
            Bounded::new(100, 10_000, |k, v| (k.len() + v.len()) as u64);
        for i in 0..10_000 {
            c.insert(format!("key-{i}"), "v".repeat(100));
        }
        assert!(c.weight() <= 10_000, "{}", c.weight());
        assert!(c.len() > 10, "{}", c.len());
    }

    #[test]
    fn a_hot_key_survives_a_flood_of_keys_used_once() {
        let c: Bounded<u64, u32, PreHashed> = Bounded::hashed(1000, 1000, one);
        let hot = 0x9e37_79b9_7f4a_7c15_u64;
        c.insert(hot, 7);
        for i in 1..100_000u64 {
            c.insert(i.wrapping_mul(0xff51_afd7_ed55_8ccd), 1);
            assert_eq!(c.get(&hot), Some(7), "evicted after {i} other keys");
        }
        assert!(c.len() <= 1000);
    }

    #[test]
    fn get_or_insert_makes_once() {
        let c: Bounded<u64, u32, PreHashed> = Bounded::hashed(10, 10, one);
        let mut made = 0;
        for _ in 0..3 {
            assert_eq!(
                c.get_or_insert_with(5, || {
                    made += 1;
                    9
                }),
                9
            );
        }
        assert_eq!(made, 1);
    }
}
