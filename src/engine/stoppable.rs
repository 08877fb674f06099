//! The streamed turns running on this replica that a stop can reach, by their activity's
//! receipt key (bot, channel, conversation, activity id: how a stop names a turn).
//!
//! Only a streamed turn of an activity with an id is here: its user watched the reply being
//! written, so a stop has something to keep, and its receipt makes what the stop commits the
//! answer to a redelivery too. A redelivery that arrives while the turn runs finds the first
//! call's entry and leaves it: the stop reaches the run that drafts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::drafts::{Drafts, Stop};
use crate::state::StateKey;

/// This replica's stoppable turns.
#[derive(Debug, Default)]
pub(super) struct Stoppable {
    // A std mutex: held for a map operation only, never across an await.
    turns: Mutex<HashMap<StateKey, Drafts>>,
}

/// A turn's entry, removed when dropped (the turn ended, or its task was dropped).
pub(super) struct Entry {
    stoppable: Arc<Stoppable>,
    key: StateKey,
    drafts: Drafts,
}

impl Stoppable {
    /// Enters the turn of receipt `key` that drafts to `drafts`, unless a turn of that activity
    /// is entered already.
    pub(super) fn enter(self: &Arc<Self>, key: &StateKey, drafts: &Drafts) -> Option<Entry> {
        let mut turns = self.lock();
        if turns.contains_key(key) {
            return None;
        }
        turns.insert(key.clone(), drafts.clone());
        Some(Entry {
            stoppable: Arc::clone(self),
            key: key.clone(),
            drafts: drafts.clone(),
        })
    }

    /// Stops the turn of receipt `key`, if it runs here (`None` if not).
    pub(super) fn stop(&self, key: &StateKey, shown: Option<&str>) -> Option<Stop> {
        let drafts = self.lock().get(key).cloned()?;
        Some(drafts.stop(shown))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StateKey, Drafts>> {
        self.turns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut turns = self.stoppable.lock();
        if turns.get(&self.key).is_some_and(|d| d.same(&self.drafts)) {
            turns.remove(&self.key);
        }
    }
}
