//! Single flight: concurrent requests that need the same checkpoint share
//! one summarizer call. The call runs as its own task, so a client that
//! goes away does not cancel the work the others (and later turns) wait for.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

pub struct Flights<T> {
    inflight: Mutex<HashMap<u128, Arc<OnceCell<T>>>>,
}

impl<T: Clone + Send + Sync + 'static> Flights<T> {
    pub fn new() -> Flights<T> {
        Flights {
            inflight: Mutex::new(HashMap::new()),
        }
    }

    /// The result of `work` for `key`: run by the first caller, shared with
    /// every caller that arrives while it runs. The flag says whether this
    /// caller shared another's result.
    pub async fn run<F>(&self, key: u128, work: F, failed: T) -> (T, bool)
    where
        F: Future<Output = T> + Send + 'static,
    {
        let cell = {
            let Ok(mut map) = self.inflight.lock() else {
                return (failed, false);
            };
            let cell = map
                .entry(key)
                .and_modify(|c| {
                    if c.initialized() {
                        *c = Arc::new(OnceCell::new());
                    }
                })
                .or_insert_with(|| Arc::new(OnceCell::new()));
            cell.clone()
        };
        let mut ran = false;
        let out = cell
            .get_or_init(|| async {
                ran = true;
                tokio::spawn(work).await.unwrap_or(failed)
            })
            .await
            .clone();
        if let Ok(mut map) = self.inflight.lock()
            && map.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell))
        {
            map.remove(&key);
        }
        (out, !ran)
    }
}

impl<T: Clone + Send + Sync + 'static> Default for Flights<T> {
    fn default() -> Self {
        Flights::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn concurrent_callers_share_one_run() {
        let flights = Arc::new(Flights::<u32>::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (f, runs) = (flights.clone(), runs.clone());
            tasks.push(tokio::spawn(async move {
                let work = async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    7
                };
                f.run(1, work, 0).await
            }));
        }
        let mut shared = 0;
        for t in tasks {
            let (v, s) = t.await.unwrap();
            assert_eq!(v, 7);
            shared += usize::from(s);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(shared, 7);
        // Later, a new run.
        let (v, s) = flights.run(1, async { 9 }, 0).await;
        assert_eq!((v, s), (9, false));
    }
}
