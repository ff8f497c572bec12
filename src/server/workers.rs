//! The threads that serve client connections: one single-threaded tokio
//! runtime per core, each handed accepted connections in turn.
//!
//! On tokio's work-stealing runtime, a request's server task, the
//! upstream connection's task and the relay wake each other across worker
//! threads: each hop is a futex wake-up and a cold cache. Measured with one
//! client connection, that was 14 µs of CPU and 19 µs of latency a small
//! request. Here a connection lives on one thread for its whole life, with
//! everything it spawns (the upstream client's connection tasks included),
//! and the threads share nothing but the proxy's state.
//!
//! The trade is work stealing: a connection waits while its thread does
//! another's CPU work. That work is small on the async threads: counting
//! and compacting a large request runs on the blocking pool.

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::task::{Poll, Waker};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

thread_local! {
    /// 1 + this thread's worker number, on a worker thread; else 0.
    static SLOT: Cell<usize> = const { Cell::new(0) };
    /// Work left for after the running task yields; None on a thread
    /// without a [`run_later`] task.
    static LATER: RefCell<Option<Later>> = const { RefCell::new(None) };
}

/// A worker thread's work for later, and the task that does it.
struct Later {
    jobs: Vec<Box<dyn FnOnce() + Send>>,
    waker: Waker,
}

/// Runs `job` on this thread once the task running now yields: on a
/// worker thread, that is after a connection's task has written what it
/// had to the client, so what the client does not wait for (reading the
/// usage of an answer just sent, learning from it) is not in its way. A
/// task spawned per job would do the same for about 2,000 instructions;
/// this is a push and a wake-up of one task per thread. Elsewhere (a thread
/// that is not a worker), `job` runs at once. A job that panics is dropped;
/// the ones after it still run. Jobs still queued when the worker stops
/// are dropped unrun.
pub fn after_yield(job: impl FnOnce() + Send + 'static) {
    let job: Box<dyn FnOnce() + Send> = Box::new(job);
    let mut job = Some(job);
    // Not while the thread's locals are being torn down: then at once.
    let _ = LATER.try_with(|later| {
        if let Ok(Some(later)) = later.try_borrow_mut().as_deref_mut()
            && let Some(job) = job.take()
        {
            later.jobs.push(job);
            later.waker.wake_by_ref();
        }
    });
    if let Some(job) = job {
        job();
    }
}

/// The task that runs a worker thread's [`after_yield`] jobs, for as long
/// as its runtime runs.
async fn run_later() {
    let mut batch: Vec<Box<dyn FnOnce() + Send>> = Vec::new();
    std::future::poll_fn(|cx| {
        LATER.with(|later| {
            let mut later = later.borrow_mut();
            match later.as_mut() {
                Some(l) => {
                    std::mem::swap(&mut l.jobs, &mut batch);
                    if !l.waker.will_wake(cx.waker()) {
                        l.waker = cx.waker().clone();
                    }
                }
                None => {
                    *later = Some(Later {
                        jobs: Vec::new(),
                        waker: cx.waker().clone(),
                    })
                }
            }
        });
        // No borrow is held while the jobs run: they may queue more.
        for job in batch.drain(..) {
            if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
                tracing::error!("work left for after a response panicked");
            }
        }
        Poll::<()>::Pending
    })
    .await
}

/// How many worker threads a server starts: one per core the process may
/// use.
pub fn count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A per-thread resource's slot for the calling thread: 1 + its worker
/// number on a worker thread, 0 on any other (`count() + 1` slots).
pub fn slot() -> usize {
    SLOT.with(Cell::get)
}

/// Connection-serving runtimes; they stop when this is dropped (whatever
/// they still run is cut off), or, waiting for their threads, with
/// [`Workers::stop`].
pub struct Workers {
    handles: Vec<Handle>,
    next: usize,
    /// Dropping these ends each thread's `block_on`.
    stop: Vec<oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Blocking-pool threads of all the workers together (tokio's default for
/// one runtime).
const BLOCKING_THREADS: usize = 512;

impl Workers {
    /// `n` threads (at least one), each running a runtime of its own.
    pub fn start(n: usize) -> std::io::Result<Workers> {
        let n = n.max(1);
        let mut handles = Vec::with_capacity(n);
        let mut stops = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .max_blocking_threads((BLOCKING_THREADS / n).max(1))
                .build()?;
            handles.push(runtime.handle().clone());
            runtime.spawn(run_later());
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            let thread = std::thread::Builder::new()
                .name(format!("condense-conn-{i}"))
                .spawn(move || {
                    SLOT.with(|s| s.set(i + 1));
                    runtime.block_on(async {
                        let _ = stopped.await;
                        // Tasks ready now (the usage of a response just
                        // sent, its log line when logs go through tracing)
                        // run before the runtime goes.
                        tokio::task::yield_now().await;
                    });
                })?;
            threads.push(thread);
        }
        Ok(Workers {
            handles,
            next: 0,
            stop: stops,
            threads,
        })
    }

    /// Stops the threads and waits until each has run what was ready on it
    /// (a just-sent response's log line) and ended.
    pub async fn stop(self) {
        let Workers { stop, threads, .. } = self;
        drop(stop);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }

    /// One thread per core the process may use.
    pub fn per_core() -> std::io::Result<Workers> {
        Workers::start(count())
    }

    /// The runtime for the next connection (in turn).
    pub fn next_runtime(&mut self) -> &Handle {
        let i = self.next % self.handles.len();
        self.next = self.next.wrapping_add(1);
        &self.handles[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_left_for_later_runs_once_the_task_yields_and_a_panic_spares_the_rest() {
        use std::sync::{Arc, Mutex};
        let mut workers = Workers::start(1).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let during = workers
            .next_runtime()
            .spawn(async move {
                // The runner is up once the runtime has polled it.
                tokio::task::yield_now().await;
                let l = log.clone();
                after_yield(move || l.lock().unwrap().push("first"));
                after_yield(|| panic!("a job that fails"));
                let l = log.clone();
                after_yield(move || l.lock().unwrap().push("second"));
                log.lock().unwrap().push("task");
                let during = log.lock().unwrap().clone();
                tokio::task::yield_now().await;
                during
            })
            .await
            .unwrap();
        assert_eq!(during, ["task"], "nothing runs before the task yields");
        assert_eq!(*seen.lock().unwrap(), ["task", "first", "second"]);
        workers.stop().await;
        // Not on a worker thread: at once.
        let log = seen.clone();
        after_yield(move || log.lock().unwrap().push("here"));
        assert_eq!(seen.lock().unwrap().last(), Some(&"here"));
    }

    #[tokio::test]
    async fn connections_go_to_each_thread_in_turn_and_the_threads_stop_with_the_workers() {
        let mut workers = Workers::start(2).unwrap();
        let mut slots = Vec::new();
        for _ in 0..4 {
            slots.push(
                workers
                    .next_runtime()
                    .spawn(async { slot() })
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(slots, [1, 2, 1, 2]);
        assert_eq!(slot(), 0, "not a worker thread");
        let handle = workers.next_runtime().clone();
        workers.stop().await;
        // The runtime is gone: what is spawned on it never runs.
        let mut cancelled = false;
        for _ in 0..100 {
            if handle.spawn(async {}).await.is_err() {
                cancelled = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(cancelled);
    }
}
