//! The turns of bots with a double-text policy in flight on this replica, by conversation: what a
//! message arriving while another message's turn of its conversation is queued or running here
//! does to that turn, before it queues behind it. Under `reject` it is refused at once
//! ([`InFlight::admit`]); under `interrupt` it asks the turns in flight to stop
//! ([`InFlight::enter`]). Across replicas the conversation's hold carries the same decisions
//! (`Others::Refuse`, `Others::Interrupt`). A redelivery of a message in flight is neither refused
//! nor interrupting: it queues behind that turn and is answered from its receipt.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::state::StateKey;

/// The in-flight turns, by conversation: each one's activity (receipt key) and how to ask it to
/// stop.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    // A std mutex: held for a map operation only, never across an await.
    turns: Mutex<HashMap<StateKey, Vec<Entry>>>,
}

#[derive(Debug)]
struct Entry {
    activity: Option<StateKey>,
    signal: Arc<Signal>,
}

impl Entry {
    /// Whether this entry is another message's turn than `activity`'s (one without id always is).
    fn is_other_than(&self, activity: Option<&StateKey>) -> bool {
        activity.is_none() || self.activity.as_ref() != activity
    }
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
pub(super) struct Registered {
    in_flight: Arc<InFlight>,
    conversation: StateKey,
    signal: Arc<Signal>,
}

impl Registered {
    /// This turn's signal: set when a later message asked it to stop.
    pub(super) fn signal(&self) -> &Arc<Signal> {
        &self.signal
    }
}

impl InFlight {
    /// `reject`: lets in the turn of `activity` in `conversation` when no other message's turn of
    /// it is in flight here (or it is a redelivery of one that is); `None` when refused.
    pub(super) fn admit(
        self: &Arc<Self>,
        conversation: &StateKey,
        activity: Option<&StateKey>,
    ) -> Option<Registered> {
        let mut turns = self.lock();
        let in_flight = turns.entry(conversation.clone()).or_default();
        if in_flight.iter().any(|other| other.is_other_than(activity)) {
            return None;
        }
        Some(self.register(in_flight, conversation, activity))
    }

    /// `interrupt`: registers the turn of `activity` in `conversation`, asking every other
    /// message's turn of it in flight here to stop.
    pub(super) fn enter(
        self: &Arc<Self>,
        conversation: &StateKey,
        activity: Option<&StateKey>,
    ) -> Registered {
        let mut turns = self.lock();
        let in_flight = turns.entry(conversation.clone()).or_default();
        for other in in_flight
            .iter()
            .filter(|other| other.is_other_than(activity))
        {
            other.signal.ask();
        }
        self.register(in_flight, conversation, activity)
    }

    fn register(
        self: &Arc<Self>,
        in_flight: &mut Vec<Entry>,
        conversation: &StateKey,
        activity: Option<&StateKey>,
    ) -> Registered {
        let signal = Arc::new(Signal::default());
        in_flight.push(Entry {
            activity: activity.cloned(),
            signal: Arc::clone(&signal),
        });
        Registered {
            in_flight: Arc::clone(self),
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

impl Drop for Registered {
    fn drop(&mut self) {
        let mut turns = self.in_flight.lock();
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

    fn keys() -> (StateKey, StateKey, StateKey) {
        (
            StateKey::from_stored("bot/test/conversations/c".into()),
            StateKey::from_stored("bot/test/conversations/c/activities/1".into()),
            StateKey::from_stored("bot/test/conversations/c/activities/2".into()),
        )
    }

    #[test]
    fn a_second_message_is_refused_while_the_first_is_in_flight_but_its_redelivery_is_not() {
        let in_flight = Arc::new(InFlight::default());
        let (conversation, first, second) = keys();
        let admitted = in_flight
            .admit(&conversation, Some(&first))
            .expect("first in");
        assert!(in_flight.admit(&conversation, Some(&second)).is_none());
        assert!(
            in_flight.admit(&conversation, None).is_none(),
            "no id: another"
        );
        let again = in_flight
            .admit(&conversation, Some(&first))
            .expect("a redelivery");
        drop(admitted);
        assert!(in_flight.admit(&conversation, Some(&second)).is_none());
        drop(again);
        assert!(in_flight.admit(&conversation, Some(&second)).is_some());
        assert!(in_flight.lock().is_empty(), "nothing left once all ended");
    }

    #[tokio::test]
    async fn a_later_message_stops_the_turns_before_it_but_a_redelivery_stops_none() {
        let in_flight = Arc::new(InFlight::default());
        let (conversation, first, second) = keys();
        let running = in_flight.enter(&conversation, Some(&first));
        let again = in_flight.enter(&conversation, Some(&first));
        assert!(!running.signal().asked(), "a redelivery interrupts nothing");
        let later = in_flight.enter(&conversation, Some(&second));
        running.signal().wait().await;
        assert!(again.signal().asked());
        assert!(!later.signal().asked(), "the later one runs");
        drop((running, again, later));
        assert!(in_flight.lock().is_empty(), "nothing left once all ended");
    }
}
