//! The state store: the little condense remembers across requests
//! (checkpoints by the hash of the prefix they cover, what the plan reads
//! of each model: calibration and learned windows). In process by default,
//! bounded in bytes and age; in Redis when `state.redis_url` is set, so
//! every replica sees what one replica learned.
//! Entries live for `state.ttl_seconds`, or for the time they are stored
//! with ([`StateStore::put_for`]: a learned window lasts far less than a
//! checkpoint).
//!
//! The store is a cache, never a dependency: a Redis that errs, is slow or
//! is gone answers as a miss (and is counted), and condense carries on.
//! A Redis that is gone answers at once (connection refused); one that
//! hangs would cost every request `state.redis_timeout_seconds` on each
//! operation, so after [`TIMEOUTS_TO_PAUSE`] operations in a row time out,
//! the store is not asked for a pause (`Pause`: 1 s, doubling while it
//! still times out, at most [`MAX_PAUSE`]) and answers as a miss at once;
//! the first operation after the pause tries again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::cache::Bounded;
use crate::config::StateConfig;
use crate::metrics::Metrics;

/// All keys condense writes start with this.
const PREFIX: &str = "condense:";

/// Compare and set, in one round trip: KEYS[1] is set to ARGV[2] for
/// ARGV[3] ms when it holds ARGV[1] ('' for no value); either way the
/// answer is {1 when it was set, what it held ('' for nothing)}.
const SWAP: &str = r"
local held = redis.call('GET', KEYS[1]) or ''
if held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return {1, held}
end
return {0, held}
";

/// What [`StateStore::swap`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Swap {
    /// The key held what was expected, and now holds the new value.
    Done,
    /// The key held something else (None: nothing); nothing was written.
    Held(Option<String>),
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot use state.redis_url: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Operations timed out in a row that pause the store.
pub const TIMEOUTS_TO_PAUSE: u32 = 2;
/// The longest pause.
pub const MAX_PAUSE: Duration = Duration::from_secs(30);

/// Whether a Redis that keeps timing out is left alone for now.
#[derive(Default)]
struct Pause {
    /// Operations timed out in a row.
    timeouts: std::sync::atomic::AtomicU32,
    /// Until when (ms since `epoch`) operations are not tried; 0: none.
    until_ms: std::sync::atomic::AtomicU64,
    epoch: std::sync::OnceLock<Instant>,
}

impl Pause {
    fn now_ms(&self) -> u64 {
        let epoch = *self.epoch.get_or_init(Instant::now);
        u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether operations are paused now.
    fn paused(&self) -> bool {
        use std::sync::atomic::Ordering;
        let until = self.until_ms.load(Ordering::Acquire);
        until != 0 && self.now_ms() < until
    }

    /// An operation answered: the pause is over.
    fn answered(&self) {
        use std::sync::atomic::Ordering;
        self.timeouts.store(0, Ordering::Release);
        self.until_ms.store(0, Ordering::Release);
    }

    /// An operation timed out; true when this starts a pause.
    fn timed_out(&self) -> bool {
        use std::sync::atomic::Ordering;
        let n = self.timeouts.fetch_add(1, Ordering::AcqRel) + 1;
        if n < TIMEOUTS_TO_PAUSE {
            return false;
        }
        let doublings = (n - TIMEOUTS_TO_PAUSE).min(5);
        let pause = Duration::from_secs(1 << doublings).min(MAX_PAUSE);
        let until = self
            .now_ms()
            .saturating_add(pause.as_millis() as u64)
            .max(1);
        self.until_ms.store(until, Ordering::Release);
        true
    }
}

pub struct StateStore {
    backend: Backend,
    /// A Redis that keeps timing out, left alone for a while.
    pause: Pause,
    /// Makes [`StateStore::swap`] one step in process.
    swapping: std::sync::Mutex<()>,
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
            pause: Pause::default(),
            swapping: std::sync::Mutex::new(()),
            ttl,
            metrics,
        })
    }

    /// An in-process store (offline tools, tests).
    pub fn memory(max_bytes: usize, ttl: Duration) -> StateStore {
        StateStore {
            backend: Backend::Memory(Memory::new(max_bytes)),
            pause: Pause::default(),
            swapping: std::sync::Mutex::new(()),
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

    /// The values stored under `keys`, in one round trip (`MGET`); None
    /// when the store failed (counted), as distinct from keys that hold
    /// nothing.
    pub async fn get_many(&self, keys: &[&str]) -> Option<Vec<Option<String>>> {
        match &self.backend {
            Backend::Memory(m) => Some(keys.iter().map(|k| m.get(k).map(|(v, _)| v)).collect()),
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let mut cmd = redis::cmd("MGET");
                for k in keys {
                    cmd.arg(format!("{PREFIX}{k}"));
                }
                let got = cmd.query_async::<Vec<Option<String>>>(&mut conn);
                self.redis("mget", *timeout, got).await
            }
        }
    }

    /// Sets `key` to `value` (for the configured time to live) if it holds
    /// `expected` (None: nothing), in one step and one round trip; None
    /// when the store failed (counted).
    pub async fn swap(&self, key: &str, expected: Option<&str>, value: &str) -> Option<Swap> {
        match &self.backend {
            Backend::Memory(m) => {
                let _one = self.swapping.lock().ok()?;
                let held = m.get(key).map(|(v, _)| v);
                if held.as_deref() == expected {
                    m.put(key, value, self.ttl);
                    Some(Swap::Done)
                } else {
                    Some(Swap::Held(held))
                }
            }
            Backend::Redis { conn, timeout } => {
                let mut conn = conn.clone();
                let ms = u64::try_from(self.ttl.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1);
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(SWAP)
                    .arg(1)
                    .arg(format!("{PREFIX}{key}"))
                    .arg(expected.unwrap_or(""))
                    .arg(value)
                    .arg(ms);
                let (done, held) = self
                    .redis(
                        "swap",
                        *timeout,
                        cmd.query_async::<(i64, String)>(&mut conn),
                    )
                    .await?;
                Some(match done {
                    1 => Swap::Done,
                    _ => Swap::Held(Some(held).filter(|h| !h.is_empty())),
                })
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
        if self.pause.paused() {
            return None;
        }
        let error = match tokio::time::timeout(timeout, f).await {
            Ok(Ok(v)) => {
                self.pause.answered();
                return Some(v);
            }
            // A quick failure (refused: Redis is down, or its connection
            // is being made again) costs no time: it neither pauses nor
            // ends a pause.
            Ok(Err(e)) => e.to_string(),
            Err(_) => {
                if self.pause.timed_out() {
                    tracing::warn!(op, "Redis keeps timing out; not asked for a while");
                }
                "timed out".to_string()
            }
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

    #[tokio::test]
    async fn a_redis_that_keeps_timing_out_is_left_alone_for_a_while() {
        // Takes connections and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut sockets = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                sockets.push(s);
            }
        });
        let metrics = Arc::new(Metrics::new().unwrap());
        let config = StateConfig {
            redis_url: Some(crate::config::Secret::new(format!("redis://{addr}/0"))),
            redis_timeout_seconds: 0.1,
            ..StateConfig::default()
        };
        let s = StateStore::new(&config, Some(metrics.clone())).unwrap();
        let errors = || metrics.state_errors_total.with_label_values(&["get"]).get();
        for _ in 0..TIMEOUTS_TO_PAUSE {
            assert_eq!(s.get("k").await, None);
        }
        assert_eq!(errors(), u64::from(TIMEOUTS_TO_PAUSE));
        // Paused: misses without asking.
        for _ in 0..5 {
            assert_eq!(s.get("k").await, None);
        }
        assert_eq!(errors(), u64::from(TIMEOUTS_TO_PAUSE));
        assert!(s.pause.paused());
        // After the pause, asked again.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert!(!s.pause.paused());
        assert_eq!(s.get("k").await, None);
        assert_eq!(errors(), u64::from(TIMEOUTS_TO_PAUSE) + 1);
        held.abort();
    }

    #[tokio::test]
    async fn a_swap_sets_only_what_holds_what_was_expected() {
        let s = StateStore::memory(1000, Duration::from_secs(60));
        assert_eq!(s.swap("k", Some("a"), "b").await, Some(Swap::Held(None)));
        assert_eq!(s.get("k").await, None);
        assert_eq!(s.swap("k", None, "a").await, Some(Swap::Done));
        assert_eq!(
            s.swap("k", None, "b").await,
            Some(Swap::Held(Some("a".into())))
        );
        assert_eq!(s.swap("k", Some("a"), "b").await, Some(Swap::Done));
        s.put("other", "x").await;
        assert_eq!(
            s.get_many(&["k", "missing", "other"]).await,
            Some(vec![Some("b".into()), None, Some("x".into())])
        );
    }
}
