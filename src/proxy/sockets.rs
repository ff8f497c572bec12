//! The Responses WebSockets open (`socket.rs` serves each): their cap,
//! their idle deadline, and the signal that closes them on shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, watch};

/// The sockets open, their cap and their settings.
pub struct Sockets {
    pub(super) permits: Arc<Semaphore>,
    max: AtomicU32,
    pub(super) idle: Duration,
    /// Longest a write waits on a client that does not read
    /// (`server.idle_timeout_seconds`, as for any connection).
    pub(super) stall: Duration,
    /// Turns true on shutdown: sockets close once their response is done.
    pub(super) closing: watch::Sender<bool>,
}

impl Sockets {
    pub fn new(max: usize, idle: Duration, stall: Duration) -> Sockets {
        let max = u32::try_from(max)
            .unwrap_or(u32::MAX)
            .min(Semaphore::MAX_PERMITS as u32);
        Sockets {
            permits: Arc::new(Semaphore::new(max as usize)),
            max: AtomicU32::new(max),
            idle,
            stall,
            closing: watch::Sender::new(false),
        }
    }

    /// Asks every socket to close once its response is done, and resolves
    /// once all are closed.
    pub async fn close_all(&self) {
        self.closing.send_replace(true);
        let _ = self
            .permits
            .acquire_many(self.max.load(Ordering::Relaxed))
            .await;
    }

    /// Lowers the cap to `max` (the open-file limit's room for client
    /// sockets), before any socket opened; the cap it has now.
    pub fn lower_to(&self, max: usize) -> usize {
        let max = u32::try_from(max).unwrap_or(u32::MAX).max(1);
        let now = self.max.load(Ordering::Relaxed);
        if max < now {
            let gone = self.permits.forget_permits((now - max) as usize);
            self.max.store(now - gone as u32, Ordering::Relaxed);
        }
        self.max.load(Ordering::Relaxed) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_cap_lowers_and_closing_waits_for_every_socket() {
        let s = Sockets::new(10, Duration::from_secs(1), Duration::from_secs(1));
        assert_eq!(s.lower_to(20), 10);
        assert_eq!(s.lower_to(3), 3);
        let held: Vec<_> = (0..3)
            .map(|_| s.permits.clone().try_acquire_owned().unwrap())
            .collect();
        assert!(s.permits.clone().try_acquire_owned().is_err());
        let closing = s.close_all();
        tokio::pin!(closing);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut closing)
                .await
                .is_err()
        );
        assert!(*s.closing.borrow());
        drop(held);
        tokio::time::timeout(Duration::from_secs(1), closing)
            .await
            .unwrap();
    }
}
