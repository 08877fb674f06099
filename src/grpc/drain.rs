//! Draining on shutdown: refuse new turns, let the ones in flight finish, then stop.
//!
//! tonic's own graceful shutdown stops accepting connections at once and waits for the handlers
//! it knows of. That is not enough here: a turn runs on its own task and may outlive its handler
//! (a caller that hung up), and probes should see `NOT_SERVING` while the server still answers.
//! So shutdown comes in two steps: first [`Drain::start`] makes new turns fail fast with
//! `UNAVAILABLE` (safe to retry on another replica) and [`Drain::idle`] waits for every turn
//! already started; only then is the gRPC server told to stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Shared between the handler and the server: whether we are draining, and the turns in flight.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
}

/// One turn in flight; dropping it ends the turn's part in the drain.
#[derive(Debug)]
pub struct InFlight(Arc<Drain>);

impl Drain {
    /// A drain not yet started.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Registers a new turn, or `None` when draining has started and it must be refused.
    pub fn enter(self: &Arc<Self>) -> Option<InFlight> {
        // Count first, then check: a turn that slips in just as draining starts is either
        // refused or counted, never missed by `idle`.
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let turn = InFlight(Arc::clone(self));
        if self.draining.load(Ordering::SeqCst) {
            return None;
        }
        Some(turn)
    }

    /// Starts draining: every later [`Drain::enter`] is refused.
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether draining has started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// How many turns are in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Completes when no turn is in flight.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a turn ending in between still wakes us.
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn draining_refuses_new_turns_and_waits_for_running_ones() {
        let drain = Drain::new();
        let running = drain.enter().expect("not draining yet");
        drain.start();
        assert!(drain.enter().is_none(), "refused once draining");
        let idle = tokio::spawn({
            let drain = Arc::clone(&drain);
            async move { drain.idle().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!idle.is_finished(), "a turn is still running");
        drop(running);
        tokio::time::timeout(Duration::from_secs(1), idle)
            .await
            .expect("idle once the turn ended")
            .expect("no panic");
        assert_eq!(drain.in_flight(), 0);
    }
}
