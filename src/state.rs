//! The state store: the little condense remembers across requests
//! (checkpoints by the hash of the prefix they cover, learned context
//! windows). In process by default, bounded in bytes and age; in Redis when
//! `state.redis_url` is set, so every replica sees what one replica learned.
//! Entries live for `state.ttl_seconds`, or for the time they are stored
//! with ([`StateStore::put_for`]: a learned window lasts far less than a
//! checkpoint).
//!
//! The store is a cache, never a dependency: a Redis that errs, is slow or
//! is gone answers as a miss (and is counted), and condense carries on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::cache::Bounded;
use crate::config::StateConfig;
use crate::metrics::Metrics;

/// All keys condense writes start with this.
const PREFIX: &str = "condense:";

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot use state.redis_url: {0}")]
    Redis(#[from] redis::RedisError),
}

pub struct StateStore {
    backend: Backend,
    ttl: Duration,
    metrics: Option<Arc<Metrics>>,
}

enum Backend {
    Memory(Memory),
    Redis {
        conn: ConnectionManager,
        timeout: Duration,
    },
}

impl StateStore {
    /// The store `config` asks for. A Redis store connects lazily: condense
    /// starts while Redis is down and uses it once it is up.
    pub fn new(config: &StateConfig, metrics: Option<Arc<Metrics>>) -> Result<Self, StateError> {
        let ttl = Duration::from_secs(config.ttl_seconds);
        let backend = match &config.redis_url {
            None => Backend::Memory(Memory::new(config.max_bytes)),
            Some(url) => {
                let timeout = Duration::from_secs_f64(config.redis_timeout_seconds);
                let client = redis::Client::open(url.expose())?;
                let manager = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_secs(2));
                Backend::Redis {
                    conn: ConnectionManager::new_lazy_with_config(client, manager)?,
                    timeout,
                }
            }
        };
        Ok(StateStore {
            backend,
            ttl,
            metrics,
        })
    }

    /// An in-process store (offline tools, tests).
    pub fn memory(max_bytes: usize, ttl: Duration) -> StateStore {
        StateStore {
            backend: Backend::Memory(Memory::new(max_bytes)),
            ttl,
            metrics: None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self.backend {
            Backend::Memory(_) => "memory",
            Backend::Redis { .. } => "redis",
        }
    }

    /// The value stored under `key`, if any (a store error is a miss).
    pub async fn get(&self, key: &str) -> Option<String> {
        match &self.backend {
            Backend::Memory(m) => m.get(key).map(|(v, _)| v),
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let full = format!("{PREFIX}{key}");
                self.redis("get", *timeout, conn.get::<_, Option<String>>(full))
                    .await
                    .flatten()
            }
        }
    }

    /// The value stored under `key` and the time it has left, if any.
    pub async fn get_expiring(&self, key: &str) -> Option<(String, Duration)> {
        match &self.backend {
            Backend::Memory(m) => m.get(key),
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let full = format!("{PREFIX}{key}");
                let mut pipe = redis::pipe();
                pipe.get(&full).pttl(&full);
                let (value, ms) = self
                    .redis(
                        "get",
                        *timeout,
                        pipe.query_async::<(Option<String>, i64)>(&mut conn),
                    )
                    .await?;
                // PTTL: -1 for a key without expiry (none of condense's),
                // -2 for one that is gone.
                let left = match u64::try_from(ms) {
                    Ok(ms) => Duration::from_millis(ms),
                    Err(_) if ms == -1 => self.ttl,
                    Err(_) => return None,
                };
                Some((value?, left))
            }
        }
    }

    /// Stores `value` under `key` for the configured time to live.
    pub async fn put(&self, key: &str, value: &str) {
        self.put_for(key, value, self.ttl).await;
    }

    /// Stores `value` under `key` for `ttl` (at least a millisecond).
    pub async fn put_for(&self, key: &str, value: &str, ttl: Duration) {
        match &self.backend {
            Backend::Memory(m) => m.put(key, value, ttl),
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let full = format!("{PREFIX}{key}");
                let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
                let put = conn.pset_ex::<_, _, ()>(full, value, ms);
                self.redis("put", *timeout, put).await;
            }
        }
    }

    /// Takes a lease on `key` for `ttl`, so that one replica does a piece
    /// of work the others then find stored. True when this caller holds it;
    /// in process always (single flight covers one process), and also when
    /// Redis fails (doing the work twice beats not doing it).
    pub async fn lease(&self, key: &str, ttl: Duration) -> bool {
        let Backend::Redis { conn, timeout } = &self.backend else {
            return true;
        };
        let mut conn = conn.clone();
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd("SET");
        cmd.arg(format!("{PREFIX}lease:{key}"))
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(ms);
        let set = cmd.query_async::<Option<String>>(&mut conn);
        self.redis("lease", *timeout, set)
            .await
            .is_none_or(|taken| taken.is_some())
    }

    /// Gives up a lease taken with [`StateStore::lease`] (the work failed;
    /// another replica may try at once).
    pub async fn release(&self, key: &str) {
        let Backend::Redis { conn, timeout } = &self.backend else {
            return;
        };
        let mut conn = conn.clone();
        let del = conn.del::<_, ()>(format!("{PREFIX}lease:{key}"));
        self.redis("release", *timeout, del).await;
    }

    /// One Redis operation within `timeout`; an error or a timeout is
    /// logged, counted (`op` is one of [`crate::metrics::labels::STATE_OPS`])
    /// and None.
    async fn redis<T>(
        &self,
        op: &'static str,
        timeout: Duration,
        f: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        let error = match tokio::time::timeout(timeout, f).await {
            Ok(Ok(v)) => return Some(v),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_string(),
        };
        tracing::warn!(op, error, "state store unavailable; carrying on without it");
        if let Some(m) = &self.metrics {
            m.state_errors_total.with_label_values(&[op]).inc();
        }
        None
    }
}

/// The in-process backend: a [`Bounded`] cache limited in bytes, each entry
/// stamped with the time it expires.
struct Memory {
    entries: Bounded<String, (Arc<str>, Instant)>,
}

impl Memory {
    /// The average entry (a checkpoint of a few kilobytes) the cache is
    /// sized for.
    const TYPICAL_ENTRY: usize = 4096;

    fn new(max_bytes: usize) -> Memory {
        Memory {
            entries: Bounded::new(
                max_bytes / Self::TYPICAL_ENTRY,
                max_bytes as u64,
                |k: &String, v: &(Arc<str>, Instant)| (k.len() + v.0.len()) as u64,
            ),
        }
    }

    /// The value and the time it has left.
    fn get(&self, key: &str) -> Option<(String, Duration)> {
        let (value, until) = self.entries.get(key)?;
        let left = until.saturating_duration_since(Instant::now());
        if left > Duration::ZERO {
            Some((value.to_string(), left))
        } else {
            self.entries.remove(key);
            None
        }
    }

    fn put(&self, key: &str, value: &str, ttl: Duration) {
        let now = Instant::now();
        // A time to live past what the clock holds is as good as forever.
        let until = now
            .checked_add(ttl)
            .or_else(|| now.checked_add(Duration::from_secs(u64::from(u32::MAX))))
            .unwrap_or(now);
        self.entries
            .insert(key.to_string(), (Arc::from(value), until));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_store_keeps_within_its_bytes_and_age() {
        let s = StateStore::memory(100, Duration::from_secs(60));
        for k in 0..50 {
            s.put(&format!("k{k:02}"), &"x".repeat(40)).await;
        }
        let mut kept = 0;
        for k in 0..50 {
            kept += usize::from(s.get(&format!("k{k:02}")).await.is_some());
        }
        assert!((1..=2).contains(&kept), "{kept} entries of 43 bytes in 100");
        s.put("c", "short").await;
        s.put("c", "shorter").await;
        assert_eq!(s.get("c").await.as_deref(), Some("shorter"));
        s.put("huge", &"h".repeat(200)).await;
        assert_eq!(s.get("huge").await, None);

        let expired = StateStore::memory(100, Duration::ZERO);
        expired.put("a", "1").await;
        assert_eq!(expired.get("a").await, None);
    }

    #[tokio::test]
    async fn an_entry_lives_for_the_time_it_was_stored_for() {
        let s = StateStore::memory(1000, Duration::from_secs(3600));
        s.put_for("short", "1", Duration::ZERO).await;
        assert_eq!(s.get("short").await, None);
        s.put_for("window", "8192", Duration::from_secs(60)).await;
        let (value, left) = s.get_expiring("window").await.unwrap();
        assert_eq!(value, "8192");
        assert!(left <= Duration::from_secs(60) && left > Duration::from_secs(50));
        s.put("checkpoint", "c").await;
        let (_, left) = s.get_expiring("checkpoint").await.unwrap();
        assert!(left > Duration::from_secs(3500), "{left:?}");
        // A time to live past the clock's reach does not panic.
        s.put_for("long", "x", Duration::MAX).await;
        assert_eq!(s.get("long").await.as_deref(), Some("x"));
    }
}
