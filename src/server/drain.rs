//! Draining on shutdown: refuse new turns, let the ones in flight finish, then stop.
//!
//! tonic's own graceful shutdown stops accepting connections at once and waits for the handlers
//! it knows of. That is not enough here: a turn runs on its own task and may outlive its handler
//! (a caller that hung up), and probes should see `NOT_SERVING` while the server still answers.
//! So shutdown comes in two steps: first [`Drain::start`] makes new turns fail fast with
//! `UNAVAILABLE` (safe to retry on another replica) and [`Drain::idle`] waits for every turn
//! already started; only then is the gRPC server told to stop.
//!
//! The same count bounds the load: past `max_in_flight` turns (those whose caller hung up
//! included, since they still hold memory and a place in their conversation's queue), a new turn
//! is refused at once with `RESOURCE_EXHAUSTED`. An overloaded replica so sheds load instead of
//! queueing without bound, and a gateway learns it in a round trip rather than at its deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

use crate::grpc::error::{Reason, Refusal};
use crate::telemetry::metrics::REFUSALS;

/// Shared between the handler and the server: whether we are draining, and the turns in flight.
#[derive(Debug)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    max_in_flight: usize,
    idle: Notify,
    /// [`REFUSALS`] by reason, taken once: a replica sheds load fastest when refusing is cheap.
    overloaded: metrics::Counter,
    shutting_down: metrics::Counter,
}

/// One turn in flight; dropping it ends the turn's part in the drain.
#[derive(Debug)]
pub struct InFlight(Arc<Drain>);

impl Drain {
    /// A drain not yet started, admitting at most `max_in_flight` turns at a time.
    pub fn new(max_in_flight: usize) -> Arc<Self> {
        Arc::new(Self {
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            max_in_flight,
            idle: Notify::new(),
            overloaded: metrics::counter!(REFUSALS, "reason" => Reason::Overloaded.as_str()),
            shutting_down: metrics::counter!(REFUSALS, "reason" => Reason::ShuttingDown.as_str()),
        })
    }

    /// Registers a new turn, or says why it must be refused: draining has started, or
    /// `max_in_flight` turns are already in flight.
    ///
    /// # Errors
    /// [`Refusal::ShuttingDown`] or [`Refusal::Overloaded`].
    pub fn enter(self: &Arc<Self>) -> Result<InFlight, Refusal> {
        // Count first, then check: a turn that slips in just as draining starts is either
        // refused or counted, never missed by `idle`; and of turns racing for the last slot,
        // exactly those that counted within the limit are admitted.
        let before = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let turn = InFlight(Arc::clone(self));
        if self.draining.load(Ordering::SeqCst) {
            self.shutting_down.increment(1);
            return Err(Refusal::ShuttingDown);
        }
        if before >= self.max_in_flight {
            self.overloaded.increment(1);
            return Err(Refusal::Overloaded {
                limit: self.max_in_flight,
            });
        }
        Ok(turn)
    }

    /// Starts draining: every later [`Drain::enter`] is refused.
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
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
        let drain = Drain::new(8);
        let running = drain.enter().expect("not draining yet");
        drain.start();
        assert_eq!(drain.enter().err(), Some(Refusal::ShuttingDown));
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

    #[test]
    fn turns_past_the_limit_are_refused_until_one_ends() {
        let drain = Drain::new(2);
        let first = drain.enter().expect("room");
        let _second = drain.enter().expect("room");
        assert_eq!(drain.enter().err(), Some(Refusal::Overloaded { limit: 2 }));
        assert_eq!(drain.in_flight(), 2, "a refusal leaves no count behind");
        drop(first);
        assert!(drain.enter().is_ok(), "a slot freed");
    }
}
