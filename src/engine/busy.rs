//! The turns of bots that refuse double texts (`DoubleText::Reject`) in flight on this replica,
//! by conversation: a message arriving while another message's turn of its conversation is in
//! flight here is refused at once, without queueing. (Across replicas the conversation's hold
//! tells the same: see `Engine::attempt_held`.) A redelivery of a message in flight is let in:
//! it queues behind that turn and is answered from its receipt.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::state::StateKey;

/// The in-flight turns of refusing bots, by conversation: each one's activity (receipt key).
#[derive(Debug, Default)]
pub(super) struct Busy {
    // A std mutex: held for a map operation only, never across an await.
    turns: Mutex<HashMap<StateKey, Vec<Option<StateKey>>>>,
}

/// A turn let in, counted until dropped.
pub(super) struct Admitted {
    busy: Arc<Busy>,
    conversation: StateKey,
    activity: Option<StateKey>,
}

impl Busy {
    /// Lets in the turn of `activity` in `conversation` when no other message's turn of it is in
    /// flight here (or it is a redelivery of one that is); `None` when refused.
    pub(super) fn admit(
        self: &Arc<Self>,
        conversation: &StateKey,
        activity: Option<&StateKey>,
    ) -> Option<Admitted> {
        let mut turns = self.lock();
        let in_flight = turns.entry(conversation.clone()).or_default();
        let redelivery = activity.is_some() && in_flight.iter().any(|a| a.as_ref() == activity);
        if !in_flight.is_empty() && !redelivery {
            return None;
        }
        in_flight.push(activity.cloned());
        Some(Admitted {
            busy: Arc::clone(self),
            conversation: conversation.clone(),
            activity: activity.cloned(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StateKey, Vec<Option<StateKey>>>> {
        self.turns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut turns = self.busy.lock();
        if let Some(in_flight) = turns.get_mut(&self.conversation) {
            if let Some(at) = in_flight.iter().position(|a| *a == self.activity) {
                in_flight.swap_remove(at);
            }
            if in_flight.is_empty() {
                turns.remove(&self.conversation);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_message_is_refused_while_the_first_is_in_flight_but_its_redelivery_is_not() {
        let busy = Arc::new(Busy::default());
        let conversation = StateKey::from_stored("bot/test/conversations/c".into());
        let first = StateKey::from_stored("bot/test/conversations/c/activities/1".into());
        let second = StateKey::from_stored("bot/test/conversations/c/activities/2".into());
        let admitted = busy.admit(&conversation, Some(&first)).expect("first in");
        assert!(busy.admit(&conversation, Some(&second)).is_none());
        assert!(busy.admit(&conversation, None).is_none(), "no id: another");
        let again = busy
            .admit(&conversation, Some(&first))
            .expect("a redelivery");
        drop(admitted);
        assert!(busy.admit(&conversation, Some(&second)).is_none());
        drop(again);
        assert!(busy.admit(&conversation, Some(&second)).is_some());
        assert!(busy.lock().is_empty(), "nothing left once all ended");
    }
}
