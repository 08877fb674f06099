//! Conversations this replica has seen contended lately: their turns lease the conversation from
//! the first attempt.
//!
//! A conflict, or a lease that had to wait for another replica's, says another replica is working
//! on the same conversation now, and a busy conversation (a group chat, a user sending several
//! messages at once) stays busy for a while. Its next turns here would most likely run the bot on
//! state about to move, lose, and only then queue for the lease; remembering the contention for a
//! few seconds sends them to the queue at once. A conversation without contention is never in
//! this table, so its turns stay optimistic: one round trip. The table is small and forgets on
//! its own: entries expire, and when it is full the expired ones go (or, if none has, all of
//! them, which only costs a conflict each).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::state::StateKey;
use crate::store::KeyMap;

/// How long contention keeps a conversation's turns leased on this replica.
const REMEMBERED_FOR: Duration = Duration::from_secs(5);
/// The most conversations remembered at once.
const CAPACITY: usize = 4096;

/// Conversation keys with the time their last contention here stops counting.
#[derive(Debug, Default)]
pub(crate) struct HotConversations {
    until: Mutex<KeyMap<Instant>>,
    /// Whether the table may have entries: the uncontended turn skips the lock entirely.
    any: AtomicBool,
}

impl HotConversations {
    /// Whether `conversation` was contended on this replica within the last few seconds.
    pub fn is_hot(&self, conversation: &StateKey) -> bool {
        if !self.any.load(Ordering::Relaxed) {
            return false;
        }
        let now = Instant::now();
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        match until.get(conversation) {
            Some(&end) if end > now => true,
            Some(_) => {
                until.remove(conversation);
                if until.is_empty() {
                    self.any.store(false, Ordering::Relaxed);
                }
                false
            }
            None => false,
        }
    }

    /// Remembers that a turn of `conversation` just met another replica's: it lost a conflict,
    /// or waited for another replica's lease.
    pub fn contended(&self, conversation: &StateKey) {
        let now = Instant::now();
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if until.len() >= CAPACITY && !until.contains_key(conversation) {
            until.retain(|_, end| *end > now);
            if until.len() >= CAPACITY {
                until.clear();
            }
        }
        until.insert(conversation.clone(), now + REMEMBERED_FOR);
        self.any.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: usize) -> StateKey {
        StateKey::from_stored(format!("c{n}"))
    }

    #[test]
    fn a_conflict_is_remembered_and_only_for_its_conversation() {
        let hot = HotConversations::default();
        assert!(!hot.is_hot(&key(1)));
        hot.contended(&key(1));
        assert!(hot.is_hot(&key(1)));
        assert!(!hot.is_hot(&key(2)));
    }

    #[test]
    fn the_table_stays_bounded() {
        let hot = HotConversations::default();
        for n in 0..=CAPACITY {
            hot.contended(&key(n));
        }
        let len = hot.until.lock().map(|t| t.len()).unwrap_or_default();
        assert!(len <= CAPACITY, "{len}");
        assert!(hot.is_hot(&key(CAPACITY)), "the newest is kept");
    }
}
