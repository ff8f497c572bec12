//! Fresh ids condense makes: request ids for requests that came without
//! one, response ids of its own (a WebSocket warm-up's).

/// A random (version 4) UUID without a system call: `Uuid::new_v4` asks
/// the kernel for 16 bytes each time (`getrandom`, about a microsecond on
/// every request that came without an id). Here each thread keys SipHash
/// once from the kernel's randomness (std's `RandomState`) and hashes a
/// counter: ids never repeat within a thread, differ between threads and
/// processes by their keys, and cannot be predicted without the key.
pub fn fresh_uuid() -> uuid::Uuid {
    use std::cell::Cell;
    use std::hash::{BuildHasher, RandomState};
    thread_local! {
        static NEXT: (RandomState, Cell<u64>) = (RandomState::new(), Cell::new(0));
    }
    let bits = NEXT.with(|(keys, n)| {
        let i = n.get();
        n.set(i.wrapping_add(1));
        (u128::from(keys.hash_one((i, 0u8))) << 64) | u128::from(keys.hash_one((i, 1u8)))
    });
    uuid::Builder::from_random_bytes(bits.to_le_bytes()).into_uuid()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_ids_are_random_version_4_uuids_unique_across_threads() {
        let ids: Vec<uuid::Uuid> = (0..4)
            .map(|_| std::thread::spawn(|| (0..2_000).map(|_| fresh_uuid()).collect::<Vec<_>>()))
            .flat_map(|t| t.join().unwrap())
            .collect();
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
        assert!(
            ids.iter()
                .all(|u| u.get_version_num() == 4 && u.get_variant() == uuid::Variant::RFC4122)
        );
        // Every one of the 122 random bits is set in about half the ids.
        let fixed: u128 = (0xF << 76) | (0x3 << 62);
        for bit in (0..128).filter(|b| fixed & (1 << b) == 0) {
            let set = ids.iter().filter(|u| u.as_u128() & (1 << bit) != 0).count();
            assert!(
                (3_500..4_500).contains(&set),
                "bit {bit} set in {set} of 8000"
            );
        }
    }
}
