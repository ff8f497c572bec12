//! What the plan reads, shared by replicas through Redis: each (upstream,
//! model)'s record of calibration and learned windows (see
//! [`crate::tokens::shared`]) under `plan:{hash}`, read on the way in and
//! changed on the way out, so that a conversation is compacted
//! byte-identically whichever replica serves each turn.
//!
//! - **Read**: a measured request reads its pair's record (and its
//!   conversation's agent point, when it may have one) in one `MGET`,
//!   decides with it, and keeps what it read.
//! - **Write**: what its response teaches (an observation, a larger
//!   accepted prompt, a window from an overflow) is applied to that record
//!   and written back with a compare-and-set (a short Lua script, one round
//!   trip); when another replica wrote first, the change is applied to what
//!   it wrote and tried again, so concurrent conversations lose an
//!   observation only when they keep colliding.
//! - **Ordering**: the write completes before the response's last bytes
//!   reach the client (the relay waits for it; see
//!   [`crate::proxy::respond`]), so the turn a client sends the moment it
//!   has read an answer is planned with what that answer taught, on any
//!   replica. A response that changes nothing writes nothing; one that
//!   does costs one Redis round trip at its end, not before its first
//!   byte. Waiting only for changes of the plan ratio would not do: the
//!   observations decide later plan changes, and a write still in flight
//!   when the next turn's response is learned on another replica would
//!   reorder them.
//! - **Failing open**: a store that fails or is slow (within
//!   `state.redis_timeout_seconds`, counted in
//!   `condense_state_errors_total`) leaves the request with this process's
//!   own record, which mirrors the last shared one it read or wrote and
//!   learns on its own meanwhile; the next request that reads the store
//!   uses the shared record again. A pair the store has no record of (a
//!   Redis restarted empty) starts from this process's record, which the
//!   next write shares.
//!
//! In process (no Redis) none of this runs: the process's own record is
//! the only one, at no cost.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::state::{StateStore, Swap};
use crate::tokens::shared::Shared;
use crate::tokens::{TokenService, learned, pair_key};

/// Work the response's last bytes wait for.
pub type Pending = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A change to a pair's record at a time (ms since the Unix epoch); it is
/// applied again to what another replica wrote when that came first.
pub type Change = Arc<dyn Fn(&mut Shared, u64) + Send + Sync>;

/// Compare-and-set attempts for one change before it is given up (an
/// observation lost to concurrent conversations, as calibration allows).
const MAX_SWAPS: usize = 4;

/// The replicas' records in the state store (Redis).
pub struct SharedPlan {
    pub state: Arc<StateStore>,
    pub tokens: Arc<TokenService>,
}

/// The state-store key of a pair's record.
fn record_key(upstream: &str, model: &str) -> String {
    let h = xxhash_rust::xxh3::xxh3_128(format!("{upstream}\0{model}").as_bytes());
    format!("plan:{h:032x}")
}

/// One request's view of its pair's record.
#[derive(Clone)]
pub struct Snapshot {
    key: String,
    pair: u64,
    held: Held,
    /// What `held` holds, read (None: nothing, or not a record).
    record: Option<Shared>,
}

#[derive(Clone)]
enum Held {
    /// What the store held (None: nothing) when last read or written.
    Read(Option<String>),
    /// Not read: this process's record is the best guess of it.
    NotRead,
    /// The store failed: this process's record is used, and changed alone.
    Failed,
}

impl Snapshot {
    /// The record this request decides with: the one read, else this
    /// process's own.
    pub fn record(&self, tokens: &TokenService) -> Shared {
        match &self.record {
            Some(record) => record.clone(),
            None => tokens.local_record(self.pair),
        }
    }

    /// Whether the store answered with a record of the pair.
    pub fn found(&self) -> bool {
        self.record.is_some()
    }
}

impl SharedPlan {
    /// Reads the pair's record and the values under `extra`, in one round
    /// trip; the record read becomes this process's own. The values are
    /// None when the store failed.
    pub async fn read(
        &self,
        upstream: &str,
        model: &str,
        extra: &[&str],
    ) -> (Snapshot, Option<Vec<Option<String>>>) {
        let key = record_key(upstream, model);
        let pair = pair_key(upstream, model);
        let mut keys = vec![key.as_str()];
        keys.extend_from_slice(extra);
        let Some(mut values) = self.state.get_many(&keys).await else {
            let snap = Snapshot {
                key,
                pair,
                held: Held::Failed,
                record: None,
            };
            return (snap, None);
        };
        let held = if values.is_empty() {
            None
        } else {
            values.remove(0)
        };
        let record = held.as_deref().and_then(Shared::decode);
        if let Some(record) = &record {
            self.tokens.adopt(pair, record);
        }
        let snap = Snapshot {
            key,
            pair,
            held: Held::Read(held),
            record,
        };
        (snap, Some(values))
    }

    /// The view of a request that did not read the record (it decided
    /// nothing by it): its changes start from this process's record.
    pub fn not_read(&self, upstream: &str, model: &str) -> Snapshot {
        Snapshot {
            key: record_key(upstream, model),
            pair: pair_key(upstream, model),
            held: Held::NotRead,
            record: None,
        }
    }

    /// Applies `change` to the record `snap` holds, here at once and in the
    /// store; what to wait for before the client may see the effect, None
    /// when nothing changed (or the store failed when read, and the change
    /// stays in this process).
    pub fn update(&self, snap: &mut Snapshot, change: Change) -> Option<Pending> {
        let base = snap.record(&self.tokens);
        let mut record = base.clone();
        change(&mut record, learned::now_ms());
        if record == base {
            return None;
        }
        self.tokens.adopt(snap.pair, &record);
        let expected = match &snap.held {
            Held::Read(held) => held.clone(),
            Held::NotRead => Some(base.encode()).filter(|_| base != Shared::default()),
            Held::Failed => return None,
        };
        let value = record.encode();
        snap.held = Held::Read(Some(value.clone()));
        snap.record = Some(record);
        let (state, tokens) = (self.state.clone(), self.tokens.clone());
        let (key, pair) = (snap.key.clone(), snap.pair);
        let write = async move {
            let (mut expected, mut value) = (expected, value);
            for _ in 0..MAX_SWAPS {
                let held = match state.swap(&key, expected.as_deref(), &value).await {
                    // Failed (counted): this process keeps the change.
                    None | Some(Swap::Done) => return,
                    Some(Swap::Held(held)) => held,
                };
                // Another replica wrote first: the change goes on top of
                // what it wrote (or, when the store holds nothing, on top
                // of what this request started from).
                let mut theirs = held
                    .as_deref()
                    .and_then(Shared::decode)
                    .unwrap_or_else(|| base.clone());
                change(&mut theirs, learned::now_ms());
                tokens.adopt(pair, &theirs);
                expected = held;
                value = theirs.encode();
            }
            tracing::debug!("a change to the shared plan record kept colliding; dropped");
        };
        Some(spawned(write))
    }
}

/// `work` running on its own (a client that goes away does not stop it),
/// as something to wait for.
pub fn spawned(work: impl Future<Output = ()> + Send + 'static) -> Pending {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            let handle = runtime.spawn(work);
            Box::pin(async move {
                let _ = handle.await;
            })
        }
        Err(_) => Box::pin(work),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn plan() -> SharedPlan {
        let metrics = crate::metrics::Metrics::new().unwrap();
        SharedPlan {
            state: Arc::new(StateStore::memory(1 << 20, Duration::from_secs(60))),
            tokens: Arc::new(TokenService::new(
                Arc::new(crate::config::Config::default()),
                &metrics,
            )),
        }
    }

    fn observe(reported: u64, estimated: u64) -> Change {
        Arc::new(move |s: &mut Shared, _| {
            s.calibration.observe(reported, estimated);
        })
    }

    /// Two replicas (two token services) sharing one store: what one
    /// learned, the other reads; turns alternating between them end with
    /// the record one process would have.
    #[tokio::test]
    async fn turns_alternating_between_replicas_build_the_record_one_would() {
        let a = plan();
        let b = SharedPlan {
            state: a.state.clone(),
            tokens: plan().tokens,
        };
        let one = crate::tokens::calibration::Calibration::default();
        for (turn, reported) in [1400u64, 1450, 1800, 1850, 1790, 1420].iter().enumerate() {
            let replica = if turn % 2 == 0 { &a } else { &b };
            let (mut snap, _) = replica.read("u", "m", &[]).await;
            assert_eq!(
                snap.record(&replica.tokens).calibration.ratios(),
                one.ratios("u", "m"),
                "turn {turn} reads what one process knows"
            );
            if let Some(w) = replica.update(&mut snap, observe(*reported, 1000)) {
                w.await;
            }
            one.observe("u", "m", *reported, 1000);
        }
        let (snap, _) = b.read("u", "m", &[]).await;
        assert!(snap.found());
        assert_eq!(
            snap.record(&b.tokens).calibration,
            one.pair(pair_key("u", "m"))
        );
        // Each replica's own record mirrors the last it read or wrote.
        assert_eq!(b.tokens.calibration.ratios("u", "m"), one.ratios("u", "m"));
        assert_ne!(a.tokens.calibration.ratios("u", "m"), one.ratios("u", "m"));
        a.read("u", "m", &[]).await;
        assert_eq!(a.tokens.calibration.ratios("u", "m"), one.ratios("u", "m"));
    }

    /// A change made from a stale view goes on top of what another
    /// replica wrote meanwhile: neither observation is lost.
    #[tokio::test]
    async fn a_change_from_a_stale_view_is_applied_on_top_of_the_newer_record() {
        let a = plan();
        let b = SharedPlan {
            state: a.state.clone(),
            tokens: plan().tokens,
        };
        let (mut stale, _) = a.read("u", "m", &[]).await;
        let (mut fresh, _) = b.read("u", "m", &[]).await;
        b.update(&mut fresh, observe(1400, 1000)).unwrap().await;
        a.update(&mut stale, observe(1500, 2000)).unwrap().await;
        let (snap, _) = b.read("u", "m", &[]).await;
        let obs = snap.record(&b.tokens).calibration.observations;
        assert_eq!(obs.len(), 2, "{obs:?}");
        assert_eq!(obs[0], (1.4, 1000));
        // A change that changes nothing writes nothing.
        let (mut snap, _) = a.read("u", "m", &[]).await;
        assert!(a.update(&mut snap, observe(10, 20)).is_none());
        // Extra keys come back in the same read.
        a.state.put("agent:x", "3:abc").await;
        let (_, extra) = a.read("u", "m", &["agent:x", "none"]).await;
        assert_eq!(extra, Some(vec![Some("3:abc".into()), None]));
    }

    /// Not read (an opted-out request), a change starts from the process's
    /// record and still lands on the store's.
    #[tokio::test]
    async fn a_change_not_read_first_lands_on_the_store_s_record() {
        let a = plan();
        let (mut snap, _) = a.read("u", "m", &[]).await;
        a.update(&mut snap, observe(1400, 1000)).unwrap().await;
        let b = SharedPlan {
            state: a.state.clone(),
            tokens: plan().tokens,
        };
        let mut blind = b.not_read("u", "m");
        b.update(&mut blind, observe(1450, 1000)).unwrap().await;
        let (snap, _) = a.read("u", "m", &[]).await;
        assert_eq!(snap.record(&a.tokens).calibration.observations.len(), 2);
    }
}
