//! Learning from responses: the usage a response reports is counted in the
//! metrics and calibrates condense's estimate, set against condense's raw
//! count of exactly the body that went upstream. Its prompt tokens are also
//! a prompt the upstream accepted: the floor under any window an overflow
//! error teaches for the model (see [`crate::tokens::learned`]).
//!
//! A body condense did not count on the way (the cheap path, an opted-out
//! request) is counted off the request path, on the blocking pool, as soon
//! as it has been sent: the count and the usage meet whichever comes first,
//! the body is let go once counted (long before a stream ends), and the next
//! turn finds its messages counted. Such counting takes one of the slots
//! the request path measures large bodies in, and only when one is free:
//! under load some bodies go uncounted rather than queue, so this costs
//! requests no time and holds no memory beyond those slots.
//!
//! With Redis, what a response teaches goes to the replicas' shared record
//! (see `shared.rs`), and the response's last bytes wait until it is there:
//! for a body counted off the path, until it is counted too (it nearly
//! always is by the time an upstream answers).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{Notify, OwnedSemaphorePermit, oneshot};

use super::read::Held;
use super::shared::{Change, Pending, SharedPlan, Snapshot, spawned};
use crate::metrics::Metrics;
use crate::tokens::TokenService;
use crate::wire::Format;
use crate::wire::usage::Usage;

/// Called once with the usage the response reported; what it returns (a
/// write to the replicas' shared record) is waited for before the
/// response's last bytes go to the client.
pub type UsageCallback = Box<dyn FnOnce(Usage) -> Option<Pending> + Send>;

/// Bodies at least this long are counted on the blocking pool (as on the
/// request path).
const BLOCKING_BYTES: usize = super::jobs::BLOCKING_PREPARE_BYTES;

/// Where a response's usage is learned for.
#[derive(Clone)]
pub struct Learner {
    pub metrics: Arc<Metrics>,
    pub tokens: Arc<TokenService>,
    pub upstream: String,
    pub model: String,
    /// The format of the bodies sent.
    pub format: Format,
    /// With Redis: the replicas' record, as the request read it.
    pub shared: Option<(Arc<SharedPlan>, Snapshot)>,
}

/// condense's raw count of the body sent, as calibration gets it.
pub enum Sent {
    /// Counted on the way.
    Counted(u64),
    /// Being counted off the request path.
    Counting(Arc<Meeting>),
    /// Being counted off the request path, the usage waiting for the
    /// count (with Redis: the observation must be shared before the
    /// response ends). Nothing comes when counting failed.
    Coming(oneshot::Receiver<u64>),
    /// Not counted (no slot was free): the usage is only shown.
    Unknown,
}

/// Where a count made off the request path meets the usage of its response.
#[derive(Default)]
pub struct Meeting {
    /// (raw count, reported prompt tokens), each once known.
    halves: Mutex<(Option<u64>, Option<u64>)>,
}

impl Meeting {
    /// Adds one half; the pair when this completed it.
    fn meet(&self, raw: Option<u64>, reported: Option<u64>) -> Option<(u64, u64)> {
        let mut h = self.halves.lock().ok()?;
        h.0 = h.0.or(raw);
        h.1 = h.1.or(reported);
        match *h {
            (Some(raw), Some(reported)) => {
                // Consumed: the other side, coming later, finds nothing.
                *h = (None, None);
                Some((raw, reported))
            }
            _ => None,
        }
    }
}

impl Learner {
    /// Counts `body` off the request path when a slot is free; `held` (its
    /// room in the body budget) goes when it is counted.
    pub fn count_later(
        &self,
        body: Bytes,
        held: Held,
        jobs: &super::jobs::Jobs,
        background: &Background,
    ) -> Sent {
        let Some(slot) = jobs.try_slot(body.len()) else {
            return Sent::Unknown;
        };
        if self.shared.is_some() {
            let (tx, rx) = oneshot::channel();
            let learner = self.clone();
            background.spawn(body.len() >= BLOCKING_BYTES, move || {
                let _slot: OwnedSemaphorePermit = slot;
                let _held = held;
                if let Some(raw) = learner.raw_count(&body) {
                    let _ = tx.send(raw);
                }
            });
            return Sent::Coming(rx);
        }
        let meeting = Arc::new(Meeting::default());
        let (learner, met) = (self.clone(), meeting.clone());
        background.spawn(body.len() >= BLOCKING_BYTES, move || {
            let _slot: OwnedSemaphorePermit = slot;
            let _held = held;
            let Some(raw) = learner.raw_count(&body) else {
                return;
            };
            drop(body);
            if let Some((raw, reported)) = met.meet(Some(raw), None) {
                let label = learner.metrics.model_label(&learner.model);
                learner.calibrate(reported, raw, label);
            }
        });
        Sent::Counting(meeting)
    }

    /// condense's raw count of a body sent; None when it is not a
    /// conversation.
    fn raw_count(&self, body: &Bytes) -> Option<u64> {
        let req = crate::wire::conversation_of(self.format, body)?;
        let encoding = self.tokens.model_info(&self.upstream, &self.model).encoding;
        Some(self.tokens.count(&req, encoding).total)
    }

    /// What to do with the usage the response reports.
    pub fn on_usage(mut self, sent: Sent) -> UsageCallback {
        Box::new(move |usage| {
            let label = self.metrics.model_label(&self.model);
            self.metrics
                .upstream_prompt_tokens_total
                .with_label_values(&[&label])
                .inc_by(usage.prompt_tokens);
            self.metrics
                .upstream_completion_tokens_total
                .with_label_values(&[&label])
                .inc_by(usage.completion_tokens);
            if let Some(shared) = self.shared.take() {
                return self.share(shared, sent, usage.prompt_tokens);
            }
            self.tokens
                .learned
                .accepted(&self.upstream, &self.model, usage.prompt_tokens);
            match sent {
                Sent::Counted(raw) => self.calibrate(usage.prompt_tokens, raw, label),
                Sent::Counting(meeting) => {
                    if let Some((raw, reported)) = meeting.meet(None, Some(usage.prompt_tokens)) {
                        self.calibrate(reported, raw, label);
                    }
                }
                Sent::Coming(_) | Sent::Unknown => self.show_ratio(label),
            }
            None
        })
    }

    /// What a response teaches, applied to the replicas' record: the
    /// prompt it accepted, and the observation once the body's count is
    /// known (waited for when it is still being counted).
    fn share(
        self,
        (plan, mut snap): (Arc<SharedPlan>, Snapshot),
        sent: Sent,
        reported: u64,
    ) -> Option<Pending> {
        let mut learn = move |raw: Option<u64>| {
            let ttl = self.tokens.learned.ttl();
            let change: Change = Arc::new(move |s, now| {
                s.windows.accepted(reported, ttl, now);
                if let Some(raw) = raw {
                    s.calibration.observe(reported, raw);
                }
            });
            let written = plan.update(&mut snap, change);
            self.show_ratio(self.metrics.model_label(&self.model));
            written
        };
        match sent {
            Sent::Counted(raw) => learn(Some(raw)),
            Sent::Coming(count) => Some(spawned(async move {
                let raw = count.await.ok();
                if let Some(written) = learn(raw) {
                    written.await;
                }
            })),
            Sent::Counting(_) | Sent::Unknown => learn(None),
        }
    }

    /// One observation; the ratio gauge is set from the first usage on,
    /// whether or not the observation was large enough to count.
    fn calibrate(&self, reported: u64, raw: u64, label: &str) {
        self.tokens
            .calibration
            .observe(&self.upstream, &self.model, reported, raw);
        self.show_ratio(label);
    }

    fn show_ratio(&self, label: &str) {
        self.metrics
            .calibration_ratio
            .with_label_values(&[label])
            .set(self.tokens.calibration.ratio(&self.upstream, &self.model));
    }
}

/// Blocking work started off the request path, and a way to wait for it.
#[derive(Clone, Default)]
pub struct Background {
    running: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Background {
    /// Runs `work` on the blocking pool when `blocking` (long work), as a
    /// task otherwise (a thread handoff costs more than counting a small
    /// body whose history is cached), or here, outside a runtime.
    pub fn spawn(&self, blocking: bool, work: impl FnOnce() + Send + 'static) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            work();
            return;
        };
        let run = self.counted(work);
        if blocking {
            runtime.spawn_blocking(run);
        } else {
            runtime.spawn(async move { run() });
        }
    }

    /// Runs `work` on this thread once the task running now yields (see
    /// [`crate::server::workers::after_yield`]), counted as running until
    /// it is done, so that [`Background::settled`] waits for it too.
    pub fn after_yield(&self, work: impl FnOnce() + Send + 'static) {
        crate::server::workers::after_yield(self.counted(work));
    }

    /// `work`, counted as running from now until it has run.
    fn counted(&self, work: impl FnOnce() + Send + 'static) -> impl FnOnce() + Send + 'static {
        self.running.fetch_add(1, Ordering::AcqRel);
        let this = self.clone();
        move || {
            // A panic in the work must not leave `running` up.
            let _ = std::panic::catch_unwind(AssertUnwindSafe(work));
            if this.running.fetch_sub(1, Ordering::AcqRel) == 1 {
                this.idle.notify_waiters();
            }
        }
    }

    /// Resolves once no work is running.
    pub async fn settled(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.running.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_and_the_usage_meet_in_either_order_once() {
        let m = Meeting::default();
        assert_eq!(m.meet(Some(100), None), None);
        assert_eq!(m.meet(None, Some(130)), Some((100, 130)));
        assert_eq!(m.meet(None, Some(130)), None);
        let m = Meeting::default();
        assert_eq!(m.meet(None, Some(7)), None);
        assert_eq!(m.meet(Some(5), None), Some((5, 7)));
    }
}
