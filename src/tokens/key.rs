//! Keys of what condense learns per (upstream, model), hashed with a seed
//! drawn per process.

/// The key of what condense learns per (upstream, model): a hash, so that
/// a client-chosen model name of any length costs a fixed few bytes, with a
/// seed drawn per process, so that no client can pick names that collide.
pub fn pair_key(upstream: &str, model: &str) -> u64 {
    key_of(&[upstream.as_bytes(), &[0], model.as_bytes()])
}

/// The key of the concatenation of `parts`, with the process's seed.
pub fn key_of(parts: &[&[u8]]) -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(0u8)
    });
    // A short key (an upstream and a model name, usually) is gathered on
    // the stack and hashed in one call: xxh3's streaming state costs a
    // copy per part and a 64-byte state to set up, four times the hash
    // (several keys are looked up for every request). Both give the same
    // value.
    let mut short = [0u8; 256];
    let mut len = 0;
    for part in parts {
        match short.get_mut(len..len + part.len()) {
            Some(room) => room.copy_from_slice(part),
            None => {
                let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
                for part in parts {
                    h.update(part);
                }
                return h.digest();
            }
        }
        len += part.len();
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(&short[..len], seed)
}
