//! A bounded memo of per-message transforms.
//!
//! Masking is a pure function of a message's bytes, and an agent re-sends the
//! same old messages every turn, so the masked form of each is computed once
//! and kept under a hash of the source bytes and the transform, in a
//! [`Bounded`] cache limited in bytes.

use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

use crate::cache::{Bounded, PreHashed};

/// What an entry costs beyond its bytes (key, bookkeeping).
const ENTRY_OVERHEAD: u64 = 48;
/// The average entry the cache is sized for.
const TYPICAL_ENTRY: u64 = 1024;

pub struct Memo {
    forms: Bounded<u64, Option<Bytes>, PreHashed>,
}

impl Memo {
    pub fn new(max_bytes: usize) -> Memo {
        let capacity = max_bytes as u64;
        Memo {
            forms: Bounded::hashed(
                (capacity / TYPICAL_ENTRY) as usize,
                capacity,
                |_, v: &Option<Bytes>| v.as_ref().map_or(0, |b| b.len() as u64) + ENTRY_OVERHEAD,
            ),
        }
    }

    /// The transform `kind` of `source`, built by `build` on a miss.
    pub fn get_or_build(
        &self,
        kind: u64,
        source: &[u8],
        build: impl FnOnce() -> Option<Bytes>,
    ) -> Option<Bytes> {
        self.forms.get_or_insert_with(xxh3_64(source) ^ kind, build)
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
        assert!(m.forms.weight() <= 10_000, "{}", m.forms.weight());
    }
}
