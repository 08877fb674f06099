//! The turns of bots that interrupt on a double text (`DoubleText::Interrupt`) in flight on this
//! replica, by conversation: a message arriving while another message's turn of its
//! conversation is queued or running here cancels that turn at once, before queueing behind it.
//! (Across replicas the conversation's hold carries the same request: `Others::Interrupt`.) A
//! redelivery of a message in flight interrupts nothing: it queues behind that turn and is
//! answered from its receipt.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::state::StateKey;

/// The in-flight turns of interrupting bots, by conversation: each one's activity (receipt key)
/// and how to ask it to stop.
#[derive(Debug, Default)]
pub(super) struct Interrupts {
    // A std mutex: held for a map operation only, never across an await.
    turns: Mutex<HashMap<StateKey, Vec<Entry>>>,
}

#[derive(Debug)]
struct Entry {
    activity: Option<StateKey>,
    signal: Arc<Signal>,
}

/// One turn's "stop, a later message supersedes you".
#[derive(Debug, Default)]
pub(super) struct Signal {
    asked: AtomicBool,
    notify: Notify,
}

impl Signal {
    fn ask(&self) {
        self.asked.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether the turn was asked to stop.
    pub(super) fn asked(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// Resolves once the turn is asked to stop.
    pub(super) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.asked() {
                return;
            }
            notified.await;
        }
    }
}

/// A turn in flight, registered until dropped.
pub(super) struct InFlight {
    interrupts: Arc<Interrupts>,
    conversation: StateKey,
    signal: Arc<Signal>,
}

impl InFlight {
    /// This turn's signal: set when a later message asked it to stop.
    pub(super) fn signal(&self) -> &Arc<Signal> {
        &self.signal
    }
}

impl Interrupts {
    /// Registers the turn of `activity` in `conversation`, asking every other message's turn of
    /// it in flight here to stop (not the turns of `activity` itself: a redelivery).
    pub(super) fn enter(
        self: &Arc<Self>,
        conversation: &StateKey,
        activity: Option<&StateKey>,
    ) -> InFlight {
        let signal = Arc::new(Signal::default());
        let mut turns = self.lock();
        let in_flight = turns.entry(conversation.clone()).or_default();
        for other in in_flight.iter() {
            if activity.is_none() || other.activity.as_ref() != activity {
                other.signal.ask();
            }
        }
        in_flight.push(Entry {
            activity: activity.cloned(),
            signal: Arc::clone(&signal),
        });
        InFlight {
            interrupts: Arc::clone(self),
            conversation: conversation.clone(),
            signal,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StateKey, Vec<Entry>>> {
        self.turns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut turns = self.interrupts.lock();
        if let Some(in_flight) = turns.get_mut(&self.conversation) {
            in_flight.retain(|e| !Arc::ptr_eq(&e.signal, &self.signal));
            if in_flight.is_empty() {
                turns.remove(&self.conversation);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_later_message_stops_the_turns_before_it_but_a_redelivery_stops_none() {
        let interrupts = Arc::new(Interrupts::default());
        let conversation = StateKey::from_stored("bot/test/conversations/c".into());
        let first = StateKey::from_stored("bot/test/conversations/c/activities/1".into());
        let second = StateKey::from_stored("bot/test/conversations/c/activities/2".into());
        let running = interrupts.enter(&conversation, Some(&first));
        let again = interrupts.enter(&conversation, Some(&first));
        assert!(!running.signal().asked(), "a redelivery interrupts nothing");
        let later = interrupts.enter(&conversation, Some(&second));
        running.signal().wait().await;
        assert!(again.signal().asked());
        assert!(!later.signal().asked(), "the later one runs");
        drop((running, again, later));
        assert!(interrupts.lock().is_empty(), "nothing left once all ended");
    }
}
