//! A bounded memo of per-message transforms.
//!
//! Masking is a pure function of a message's bytes, and an agent re-sends the
//! same old messages every turn, so the masked form of each is computed once
//! and kept under a hash of the source bytes and the transform. Memory is
//! bounded in bytes by two generations, like the token count cache: when the
//! young generation passes half the limit, the old one is dropped; a hit in
//! the old generation is copied to the young one.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Mutex;

use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

use crate::tokens::cache::IdentityHasher;

type Map = HashMap<u64, Option<Bytes>, BuildHasherDefault<IdentityHasher>>;

#[derive(Default)]
struct Generations {
    young: Map,
    old: Map,
    young_bytes: usize,
}

pub struct Memo {
    inner: Mutex<Generations>,
    max_bytes: usize,
}

impl Memo {
    pub fn new(max_bytes: usize) -> Memo {
        Memo {
            inner: Mutex::new(Generations::default()),
            max_bytes,
        }
    }

    /// The transform `kind` of `source`, built by `build` on a miss.
    pub fn get_or_build(
        &self,
        kind: u64,
        source: &[u8],
        build: impl FnOnce() -> Option<Bytes>,
    ) -> Option<Bytes> {
        let key = xxh3_64(source) ^ kind;
        if let Ok(mut g) = self.inner.lock() {
            if let Some(v) = g.young.get(&key) {
                return v.clone();
            }
            if let Some(v) = g.old.remove(&key) {
                self.insert(&mut g, key, v.clone());
                return v;
            }
        }
        let value = build();
        if let Ok(mut g) = self.inner.lock() {
            self.insert(&mut g, key, value.clone());
        }
        value
    }

    fn insert(&self, g: &mut Generations, key: u64, value: Option<Bytes>) {
        let size = value.as_ref().map_or(0, Bytes::len) + 32;
        if g.young_bytes + size > self.max_bytes / 2 {
            g.old = std::mem::take(&mut g.young);
            g.young_bytes = 0;
        }
        g.young_bytes += size;
        g.young.insert(key, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_once_and_stays_bounded() {
        let m = Memo::new(10_000);
        let mut builds = 0;
        for _ in 0..3 {
            let v = m.get_or_build(1, b"source", || {
                builds += 1;
                Some(Bytes::from_static(b"masked"))
            });
            assert_eq!(v.as_deref(), Some(&b"masked"[..]));
        }
        assert_eq!(builds, 1);
        // Another kind is another entry.
        assert!(m.get_or_build(2, b"source", || None).is_none());
        for i in 0..10_000u32 {
            m.get_or_build(3, &i.to_le_bytes(), || Some(Bytes::from(vec![0u8; 100])));
        }
        let g = m.inner.lock().unwrap();
        let held: usize = g
            .young
            .values()
            .chain(g.old.values())
            .map(|v| v.as_ref().map_or(0, Bytes::len) + 32)
            .sum();
        assert!(held <= 10_000, "{held}");
    }
}
