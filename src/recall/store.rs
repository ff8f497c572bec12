//! Originals in the state store: kept under `recall:{scope}:{key}` for
//! `state.ttl_seconds`, so that a replica sharing the Redis answers a key
//! another one wrote. The scope is a hash of the client's API keys (not of
//! the headers they came in): a key found (or guessed) by one client never
//! returns another's text.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;

use super::Recallable;
use crate::cache::{Bounded, PreHashed};
use crate::chat::Message;
use crate::proxy::auth::{self, CREDENTIAL_HEADERS};
use crate::state::StateStore;

/// The scope of a client's keys: a hash of the keys it presented, each
/// once, however it sent them (`Authorization: Bearer K`, `x-api-key: K`
/// and `api-key: K` are one key `K`, so a key stored under one is found
/// under the other). All clients without credentials share one.
pub fn scope(client_headers: &HeaderMap) -> String {
    let mut keys: Vec<&[u8]> = CREDENTIAL_HEADERS
        .iter()
        .flat_map(|name| {
            client_headers
                .get_all(name)
                .iter()
                .map(move |v| auth::key_in(name, v))
        })
        .filter(|k| !k.is_empty())
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for k in keys {
        // Length first: two keys never read as one.
        h.update(&(k.len() as u64).to_le_bytes());
        h.update(k);
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
        if !crate::compaction::keys::valid_key(key) {
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
    /// Background writes to Redis under way (at most MAX_WRITERS; past
    /// that, originals are written on a later request).
    writers: Arc<AtomicUsize>,
}

/// Background Redis writes at once.
const MAX_WRITERS: usize = 16;

impl Written {
    pub fn new(entries: usize, ttl: Duration) -> Written {
        Written {
            at: Bounded::hashed(entries, entries as u64, |_: &u64, _: &Instant| 1),
            refresh: ttl / 2,
            writers: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Stores the originals not written lately: in place for the in-process
    /// store, in the background for Redis (a slow Redis must not hold the
    /// request up; a key the request needs itself is answered from the
    /// request).
    pub async fn remember(&self, store: &Arc<StateStore>, originals: &Originals) {
        let redis = store.kind() == "redis";
        if redis && self.writers.load(Ordering::Relaxed) >= MAX_WRITERS {
            return;
        }
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
        if redis {
            let (store, writers) = (store.clone(), self.writers.clone());
            writers.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                for (k, v) in todo {
                    store.put(&k, &v).await;
                }
                writers.fetch_sub(1, Ordering::Relaxed);
            });
        } else {
            for (k, v) in todo {
                store.put(&k, &v).await;
            }
        }
    }
}

/// Where a conversation stood when its model called `compress_context`:
/// stored under `agent:{scope}:{identity}` (the identity: a hash of the
/// messages up to the first user message, the task) as the number of
/// messages and a hash of them, so that a later request of the same
/// conversation finds it and checks it still starts that way.
pub struct AgentPoint {
    key: String,
    hashes: Vec<u64>,
}

impl AgentPoint {
    /// The point at the end of `messages`; None for a conversation without
    /// a user message.
    pub fn of(scope: &str, messages: &[Message]) -> Option<AgentPoint> {
        let task = messages.iter().position(|m| m.role() == Some("user"))?;
        let hashes: Vec<u64> = messages.iter().map(Message::digest).collect();
        let identity = fold(&hashes[..=task]);
        Some(AgentPoint {
            key: format!("agent:{scope}:{identity:016x}"),
            hashes,
        })
    }

    /// The point recorded for this conversation, if it still starts as it
    /// did then.
    pub async fn recorded(&self, store: &StateStore) -> Option<usize> {
        self.matches(&store.get(&self.key).await?)
    }

    /// The state-store key the point is recorded under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The point a value recorded under [`AgentPoint::key`] gives, if this
    /// conversation still starts as it did then.
    pub fn matches(&self, value: &str) -> Option<usize> {
        let (n, hash) = value.split_once(':')?;
        let n: usize = n.parse().ok()?;
        let matches = n <= self.hashes.len() && format!("{:016x}", fold(&self.hashes[..n])) == hash;
        matches.then_some(n)
    }

    /// Records this point.
    pub async fn record(&self, store: &StateStore) {
        let n = self.hashes.len();
        let value = format!("{n}:{:016x}", fold(&self.hashes));
        store.put(&self.key, &value).await;
    }
}

/// One hash of a run of message hashes (what a conversation point is
/// checked against).
pub(crate) fn fold(hashes: &[u64]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for x in hashes {
        h.update(&x.to_le_bytes());
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::compaction::Fates;
    use bytes::Bytes;

    #[tokio::test]
    async fn a_key_is_answered_from_the_request_then_the_store_in_its_scope() {
        let store = Arc::new(StateStore::memory(1 << 20, Duration::from_secs(60)));
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer a".parse().unwrap());
        let raw = br#"{"role":"tool","tool_call_id":"c","content":"first"}"#;
        let k = crate::compaction::keys::key(raw);
        let masked = crate::compaction::keys::tag(
            br#"{"role":"tool","tool_call_id":"c","content":"[condense: elided]"}"#,
            &k,
        );
        let fates = Fates {
            rewritten: vec![masked],
            dropped: vec![false],
            replacement: None,
            replacement_at: None,
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

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(
                http::HeaderName::try_from(*name).unwrap(),
                value.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_scope_is_the_key_however_it_is_sent() {
        let one = scope(&headers(&[("authorization", "Bearer sk-one")]));
        for same in [
            &[("authorization", "bearer sk-one")][..],
            &[("authorization", "BEARER   sk-one ")],
            &[("x-api-key", "sk-one")],
            &[("api-key", " sk-one")],
            &[("authorization", "Bearer sk-one"), ("x-api-key", "sk-one")],
        ] {
            assert_eq!(scope(&headers(same)), one, "{same:?}");
        }
        for other in [
            &[("authorization", "Bearer sk-two")][..],
            &[("x-api-key", "sk-two")],
            &[("authorization", "Basic sk-one")],
            &[("authorization", "Bearer sk-one"), ("x-api-key", "sk-two")],
            &[],
        ] {
            assert_ne!(scope(&headers(other)), one, "{other:?}");
        }
        // Two keys are never read as one.
        assert_ne!(
            scope(&headers(&[("x-api-key", "ab"), ("api-key", "c")])),
            scope(&headers(&[("x-api-key", "a"), ("api-key", "bc")]))
        );
    }

    #[tokio::test]
    async fn a_key_stored_for_a_bearer_token_is_found_for_the_same_key_in_x_api_key() {
        let store = Arc::new(StateStore::memory(1 << 20, Duration::from_secs(60)));
        let raw = br#"{"role":"tool","tool_call_id":"c","content":"kept"}"#;
        let k = crate::compaction::keys::key(raw);
        let masked = crate::compaction::keys::tag(
            br#"{"role":"tool","tool_call_id":"c","content":"[condense: elided]"}"#,
            &k,
        );
        let fates = Fates {
            rewritten: vec![masked],
            dropped: vec![false],
            replacement: None,
            replacement_at: None,
            replaced: vec![false],
        };
        let own = Recallable::of(vec![Message::from_bytes(Bytes::from_static(raw))], &fates);
        let written = Originals {
            scope: scope(&headers(&[("authorization", "Bearer sk-one")])),
            own,
        };
        Written::new(100, Duration::from_secs(60))
            .remember(&store, &written)
            .await;
        let later = |pairs: &[(&str, &str)]| Originals {
            scope: scope(&headers(pairs)),
            own: Recallable::default(),
        };
        for same in [("x-api-key", "sk-one"), ("api-key", "sk-one")] {
            let found = later(&[same]).get(&store, &k).await;
            assert_eq!(found.as_deref(), Some("kept"), "{same:?}");
        }
        assert_eq!(
            later(&[("x-api-key", "sk-two")]).get(&store, &k).await,
            None
        );
    }

    #[tokio::test]
    async fn a_point_is_found_again_only_by_the_conversation_that_recorded_it() {
        let store = StateStore::memory(1 << 20, Duration::from_secs(60));
        let msg = |s: &str| Message::from_bytes(Bytes::from(s.to_string()));
        let mut conv = vec![
            msg(r#"{"role":"system","content":"s"}"#),
            msg(r#"{"role":"user","content":"task"}"#),
            msg(r#"{"role":"assistant","content":"a"}"#),
        ];
        let at = AgentPoint::of("scope", &conv).unwrap();
        assert_eq!(at.recorded(&store).await, None);
        at.record(&store).await;
        conv.push(msg(r#"{"role":"user","content":"more"}"#));
        let later = AgentPoint::of("scope", &conv).unwrap();
        assert_eq!(later.recorded(&store).await, Some(3));
        // Another client, or the same task with another history, does not.
        assert_eq!(
            AgentPoint::of("other", &conv)
                .unwrap()
                .recorded(&store)
                .await,
            None
        );
        conv[2] = msg(r#"{"role":"assistant","content":"b"}"#);
        assert_eq!(
            AgentPoint::of("scope", &conv)
                .unwrap()
                .recorded(&store)
                .await,
            None
        );
    }
}
