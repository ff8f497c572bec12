//! Originals in the state store: kept under `recall:{scope}:{key}` for
//! `state.ttl_seconds`, so that a replica sharing the Redis answers a key
//! another one wrote. The scope is a hash of the client's credentials: a
//! key found (or guessed) by one client never returns another's text.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;

use super::Recallable;
use crate::cache::{Bounded, PreHashed};
use crate::compaction::text::head_tail;
use crate::state::StateStore;

/// Headers a client's credentials come in.
const CREDENTIAL_HEADERS: &[&str] = &["authorization", "x-api-key", "api-key"];

/// The scope of a client's keys: a hash of the credentials it presented
/// (all clients without credentials share one).
pub fn scope(client_headers: &HeaderMap) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for name in CREDENTIAL_HEADERS {
        for v in client_headers.get_all(*name) {
            h.update(name.as_bytes());
            h.update(v.as_bytes());
        }
    }
    format!("{:016x}", h.digest())
}

fn store_key(scope: &str, key: &str) -> String {
    format!("recall:{scope}:{key}")
}

/// The originals one request can recall: its own (taken from the request
/// itself), then the state store's.
pub struct Originals {
    pub scope: String,
    pub own: Recallable,
}

impl Originals {
    /// The original of `key`, if this request or the store has it.
    pub async fn get(&self, store: &StateStore, key: &str) -> Option<String> {
        if let Some(text) = self.own.text(key) {
            return Some(text);
        }
        if !super::valid_key(key) {
            return None;
        }
        store.get(&store_key(&self.scope, key)).await
    }
}

/// Which originals this process stored lately, so that a conversation's
/// masked results are not written again on every turn.
pub struct Written {
    at: Bounded<u64, Instant, PreHashed>,
    /// An entry is written again once it is this old (the store's time to
    /// live runs from the last write).
    refresh: Duration,
}

impl Written {
    pub fn new(entries: usize, ttl: Duration) -> Written {
        Written {
            at: Bounded::hashed(entries, entries as u64, |_: &u64, _: &Instant| 1),
            refresh: ttl / 2,
        }
    }

    /// Stores the originals not written lately: in place for the in-process
    /// store, in the background for Redis (a slow Redis must not hold the
    /// request up; a key the request needs itself is answered from the
    /// request).
    pub async fn remember(&self, store: &Arc<StateStore>, originals: &Originals) {
        let mut todo = Vec::new();
        for key in originals.own.keys() {
            let full = store_key(&originals.scope, key);
            let id = xxhash_rust::xxh3::xxh3_64(full.as_bytes());
            if self.at.get(&id).is_some_and(|t| t.elapsed() < self.refresh) {
                continue;
            }
            if let Some(text) = originals.own.text(key) {
                self.at.insert(id, Instant::now());
                todo.push((full, text));
            }
        }
        if todo.is_empty() {
            return;
        }
        if store.kind() == "redis" {
            let store = store.clone();
            tokio::spawn(async move {
                for (k, v) in todo {
                    store.put(&k, &v).await;
                }
            });
        } else {
            for (k, v) in todo {
                store.put(&k, &v).await;
            }
        }
    }
}

/// A recalled text within `max_chars`: cut in the middle, saying so, when
/// it is longer.
pub fn within(text: &str, max_chars: usize) -> String {
    if text.len() <= max_chars {
        return text.to_string();
    }
    format!(
        "[condense: the original is {} chars; cut to fit the context window]\n{}",
        text.len(),
        head_tail(text, max_chars)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::chat::Message;
    use crate::compaction::Fates;
    use bytes::Bytes;

    #[tokio::test]
    async fn a_key_is_answered_from_the_request_then_the_store_in_its_scope() {
        let store = Arc::new(StateStore::memory(1 << 20, Duration::from_secs(60)));
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer a".parse().unwrap());
        let raw = br#"{"role":"tool","tool_call_id":"c","content":"first"}"#;
        let k = super::super::key(raw);
        let masked = super::super::tag(
            br#"{"role":"tool","tool_call_id":"c","content":"[condense: elided]"}"#,
            &k,
        );
        let fates = Fates {
            rewritten: vec![masked],
            dropped: vec![false],
            replacement: None,
            replaced: vec![false],
        };
        let own = Recallable::of(vec![Message::from_bytes(Bytes::from_static(raw))], &fates);
        let mine = Originals {
            scope: scope(&headers),
            own,
        };
        let written = Written::new(100, Duration::from_secs(60));
        written.remember(&store, &mine).await;
        assert_eq!(mine.get(&store, &k).await.as_deref(), Some("first"));
        let later = Originals {
            scope: scope(&headers),
            own: Recallable::default(),
        };
        assert_eq!(later.get(&store, &k).await.as_deref(), Some("first"));
        assert_eq!(later.get(&store, "key-two").await, None);
        headers.insert("authorization", "Bearer b".parse().unwrap());
        let other = Originals {
            scope: scope(&headers),
            own: Recallable::default(),
        };
        assert_eq!(other.get(&store, &k).await, None);
    }

    #[test]
    fn long_originals_are_cut_saying_so() {
        let text = "line\n".repeat(1000);
        let cut = within(&text, 500);
        assert!(cut.starts_with("[condense: the original is 5000 chars"));
        assert!(cut.len() < 700);
        assert_eq!(within("short", 500), "short");
    }
}
