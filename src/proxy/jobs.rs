//! CPU-heavy preparation (parsing, counting and compacting a large body)
//! run on the blocking pool, under a bound, so that no client can make
//! another wait on its work:
//!
//! - Bodies under [`BLOCKING_PREPARE_BYTES`] are prepared on the
//!   async workers and never queue.
//! - Medium bodies (under [`LARGE_BYTES`]) and large ones have a lane each,
//!   with slots of their own: a burst of 16 MB bodies fills the large lane
//!   while an ordinary 272 KB request still finds a medium slot. The large
//!   lane has half the cores, the medium lane all of them.
//! - Each lane queues at most a few jobs per slot. A job past that is not
//!   run: its request goes upstream as it came (fail open), counted as
//!   `condense_prepare_jobs_total{outcome="busy"}`. The bodies themselves
//!   are held within `server.max_buffered_bytes` already.
//! - A job waits for its slot inside its request's future: when the client
//!   goes away, the server drops that future and the job is never run
//!   (`outcome="abandoned"`). A job that started runs to its end; every
//!   pass over a body is linear, so that end is near.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus::IntCounterVec;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Conversation bodies with at least this many bytes of messages not seen
/// before are measured on the blocking pool.
pub(super) const BLOCKING_PREPARE_BYTES: usize = 128 * 1024;

/// Bodies of at least this many bytes take the large lane.
pub const LARGE_BYTES: usize = 2 * 1024 * 1024;
/// Jobs a lane holds waiting, per slot, before it turns more away.
const WAITING_PER_SLOT: usize = 2;

/// Why a job did not run (its request goes on without it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotRun {
    /// Its lane's queue was full.
    Busy,
    /// The work panicked.
    Failed,
}

/// The lanes of preparation work.
pub struct Jobs {
    medium: Lane,
    large: Lane,
    outcomes: IntCounterVec,
}

struct Lane {
    slots: Arc<Semaphore>,
    /// Jobs waiting for a slot or running.
    queued: Arc<AtomicUsize>,
    max_queued: usize,
}

impl Lane {
    fn new(slots: usize) -> Lane {
        Lane {
            slots: Arc::new(Semaphore::new(slots)),
            queued: Arc::new(AtomicUsize::new(0)),
            max_queued: slots * (1 + WAITING_PER_SLOT),
        }
    }
}

/// A job's place in its lane's queue, given back when it ends or is
/// dropped unrun.
struct Place {
    queued: Arc<AtomicUsize>,
    ran: bool,
    outcomes: IntCounterVec,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
        if !self.ran {
            self.outcomes.with_label_values(&["abandoned"]).inc();
        }
    }
}

impl Jobs {
    /// Lanes sized for `cores`; `outcomes` counts what became of each job.
    pub fn new(cores: usize, outcomes: IntCounterVec) -> Jobs {
        let cores = cores.max(1);
        Jobs {
            medium: Lane::new(cores),
            large: Lane::new((cores / 2).max(1)),
            outcomes,
        }
    }

    fn lane(&self, bytes: usize) -> &Lane {
        if bytes >= LARGE_BYTES {
            &self.large
        } else {
            &self.medium
        }
    }

    /// Runs `work` (on a body of `bytes`) on the blocking pool once its lane
    /// has a slot; refused at once when the lane's queue is full.
    pub async fn run<T: Send + 'static>(
        &self,
        bytes: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, NotRun> {
        let lane = self.lane(bytes);
        if lane.queued.fetch_add(1, Ordering::AcqRel) >= lane.max_queued {
            lane.queued.fetch_sub(1, Ordering::AcqRel);
            self.outcomes.with_label_values(&["busy"]).inc();
            return Err(NotRun::Busy);
        }
        let mut place = Place {
            queued: lane.queued.clone(),
            ran: false,
            outcomes: self.outcomes.clone(),
        };
        // Dropped here while waiting, the job is abandoned and never runs.
        let permit = lane.slots.clone().acquire_owned().await;
        place.ran = true;
        self.outcomes.with_label_values(&["run"]).inc();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let _place = place;
            work()
        })
        .await
        .map_err(|_| NotRun::Failed)
    }

    /// A slot for work on a body of `bytes` that is worth doing only if one
    /// is free now (counting a body after its answer, for calibration).
    pub fn try_slot(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        self.lane(bytes).slots.clone().try_acquire_owned().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Opts;
    use std::time::Duration;

    fn jobs(cores: usize) -> Jobs {
        let outcomes =
            IntCounterVec::new(Opts::new("jobs", "test"), &["outcome"]).unwrap_or_else(|e| {
                unreachable!("{e}");
            });
        Jobs::new(cores, outcomes)
    }

    fn count(j: &Jobs, outcome: &str) -> u64 {
        j.outcomes.with_label_values(&[outcome]).get()
    }

    /// Work that runs until told to finish.
    fn blocker() -> (impl FnOnce() + Send + 'static, std::sync::mpsc::Sender<()>) {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        (
            move || {
                let _ = rx.recv_timeout(Duration::from_secs(30));
            },
            tx,
        )
    }

    #[tokio::test]
    async fn large_jobs_queue_apart_from_medium_ones_and_past_the_bound_are_refused() {
        let j = Arc::new(jobs(2));
        // Two cores: one large slot, three large jobs queued at most.
        let mut running = Vec::new();
        let mut release = Vec::new();
        for _ in 0..3 {
            let (work, tx) = blocker();
            let j = j.clone();
            running.push(tokio::spawn(async move { j.run(LARGE_BYTES, work).await }));
            release.push(tx);
        }
        tokio::time::timeout(Duration::from_secs(10), async {
            while j.large.queued.load(Ordering::Acquire) < 3 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| unreachable!("three large jobs queue"));
        assert_eq!(j.run(LARGE_BYTES, || ()).await, Err(NotRun::Busy));
        assert_eq!(count(&j, "busy"), 1);
        // A medium job runs at once while every large one waits.
        let medium = tokio::time::timeout(Duration::from_secs(10), j.run(300_000, || 7)).await;
        assert_eq!(medium.ok(), Some(Ok(7)));
        for tx in release {
            let _ = tx.send(());
        }
        for r in running {
            assert_eq!(r.await.ok(), Some(Ok(())));
        }
        assert_eq!(count(&j, "run"), 4);
        assert_eq!(j.large.queued.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn a_job_dropped_while_it_waits_never_runs() {
        let j = Arc::new(jobs(1));
        let (work, tx) = blocker();
        let j1 = j.clone();
        let first = tokio::spawn(async move { j1.run(LARGE_BYTES, work).await });
        tokio::time::timeout(Duration::from_secs(10), async {
            while j.large.slots.available_permits() > 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| unreachable!("the first job takes the slot"));
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        let j2 = j.clone();
        let second = tokio::spawn(async move {
            j2.run(LARGE_BYTES, move || flag.store(true, Ordering::SeqCst))
                .await
        });
        tokio::time::timeout(Duration::from_secs(10), async {
            while j.large.queued.load(Ordering::Acquire) < 2 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| unreachable!("the second job queues"));
        second.abort();
        let _ = second.await;
        let _ = tx.send(());
        assert_eq!(first.await.ok(), Some(Ok(())));
        assert!(!ran.load(Ordering::SeqCst));
        assert_eq!(count(&j, "abandoned"), 1);
        assert_eq!(j.large.queued.load(Ordering::Acquire), 0);
    }
}
