//! Per-conversation cooldown after summarizer failures: a conversation whose
//! checkpoint failed is not summarized again for a while (doubling with each
//! consecutive failure), so a broken summarizer costs one timeout, not one
//! per turn. A success resets it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Conversations tracked before expired entries are swept.
const SWEEP_AT: usize = 10_000;

pub struct Backoff {
    base: Duration,
    max: Duration,
    state: Mutex<HashMap<u128, (u32, Instant)>>,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max,
            state: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `conversation` is cooling down now.
    pub fn cooling(&self, conversation: u128) -> bool {
        self.state
            .lock()
            .ok()
            .and_then(|s| {
                s.get(&conversation)
                    .map(|(_, until)| Instant::now() < *until)
            })
            .unwrap_or(false)
    }

    pub fn failed(&self, conversation: u128) {
        let Ok(mut s) = self.state.lock() else {
            return;
        };
        let now = Instant::now();
        if s.len() >= SWEEP_AT {
            s.retain(|_, (_, until)| *until > now);
        }
        let failures = s.get(&conversation).map_or(0, |(f, _)| *f) + 1;
        let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
        let wait = self.base.saturating_mul(factor).min(self.max);
        s.insert(conversation, (failures, now + wait));
    }

    pub fn succeeded(&self, conversation: u128) {
        if let Ok(mut s) = self.state.lock() {
            s.remove(&conversation);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cooldown_doubles_up_to_the_cap_and_resets_on_success() {
        let b = Backoff::new(Duration::from_secs(10), Duration::from_secs(25));
        assert!(!b.cooling(1));
        b.failed(1);
        assert!(b.cooling(1) && !b.cooling(2));
        let until = |b: &Backoff| b.state.lock().unwrap()[&1].1 - Instant::now();
        assert!(until(&b) <= Duration::from_secs(10));
        b.failed(1);
        assert!(until(&b) > Duration::from_secs(10));
        b.failed(1);
        assert!(until(&b) <= Duration::from_secs(25));
        b.succeeded(1);
        assert!(!b.cooling(1));

        let none = Backoff::new(Duration::ZERO, Duration::ZERO);
        none.failed(1);
        assert!(!none.cooling(1));
    }
}
