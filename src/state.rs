//! The state store: the little condense remembers across requests
//! (checkpoints by the hash of the prefix they cover, learned context
//! windows). In process by default, bounded in bytes and age; in Redis when
//! `state.redis_url` is set, so every replica sees what one replica learned.
//!
//! The store is a cache, never a dependency: a Redis that errs, is slow or
//! is gone answers as a miss (and is counted), and condense carries on.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

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
    Memory(Mutex<Memory>),
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
            None => Backend::Memory(Mutex::new(Memory::new(config.max_bytes))),
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
            backend: Backend::Memory(Mutex::new(Memory::new(max_bytes))),
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
            Backend::Memory(m) => m.lock().ok()?.get(key, self.ttl),
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let full = format!("{PREFIX}{key}");
                self.redis("get", *timeout, conn.get::<_, Option<String>>(full))
                    .await
                    .flatten()
            }
        }
    }

    /// Stores `value` under `key` for the configured time to live.
    pub async fn put(&self, key: &str, value: &str) {
        match &self.backend {
            Backend::Memory(m) => {
                if let Ok(mut m) = m.lock() {
                    m.put(key, value);
                }
            }
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let full = format!("{PREFIX}{key}");
                let ttl = self.ttl.as_secs().max(1);
                let put = conn.set_ex::<_, _, ()>(full, value, ttl);
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
    /// logged, counted and None.
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

/// The in-process backend: insertion order for eviction, bounded bytes.
struct Memory {
    map: HashMap<String, (String, Instant)>,
    order: VecDeque<String>,
    bytes: usize,
    max_bytes: usize,
}

impl Memory {
    fn new(max_bytes: usize) -> Memory {
        Memory {
            map: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_bytes,
        }
    }

    fn get(&self, key: &str, ttl: Duration) -> Option<String> {
        let (value, at) = self.map.get(key)?;
        (at.elapsed() < ttl).then(|| value.clone())
    }

    fn put(&mut self, key: &str, value: &str) {
        let size = key.len() + value.len();
        if size > self.max_bytes {
            return;
        }
        if let Some((old, _)) = self.map.remove(key) {
            self.bytes -= key.len() + old.len();
            self.order.retain(|k| k != key);
        }
        while self.bytes + size > self.max_bytes {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some((old, _)) = self.map.remove(&oldest) {
                self.bytes -= oldest.len() + old.len();
            }
        }
        self.map
            .insert(key.to_string(), (value.to_string(), Instant::now()));
        self.order.push_back(key.to_string());
        self.bytes += size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_store_keeps_within_its_bytes_and_age() {
        let s = StateStore::memory(100, Duration::from_secs(60));
        s.put("a", &"x".repeat(40)).await;
        s.put("b", &"y".repeat(40)).await;
        assert!(s.get("a").await.is_some());
        s.put("c", &"z".repeat(40)).await;
        assert_eq!(s.get("a").await, None, "the oldest entry made room");
        assert_eq!(s.get("c").await.map(|v| v.len()), Some(40));
        s.put("c", "short").await;
        assert_eq!(s.get("c").await.as_deref(), Some("short"));
        s.put("huge", &"h".repeat(200)).await;
        assert_eq!(s.get("huge").await, None);

        let expired = StateStore::memory(100, Duration::ZERO);
        expired.put("a", "1").await;
        assert_eq!(expired.get("a").await, None);
    }
}
