//! Turns of one conversation inside one replica wait their turn instead of racing.
//!
//! Two concurrent turns of the same conversation in the same process would otherwise both load
//! the same version and one would lose the commit, costing a replay and a database round trip for
//! a conflict the process could have seen coming. So each turn first takes an async lock for its
//! conversation's key; conflicts then come only from other replicas. tokio's mutex is fair, so
//! the waiting turns run in arrival order.
//!
//! The table holds an entry only while some turn holds or awaits it: the last guard to go removes
//! it, so the table never outgrows the number of conversations with a turn in flight. Each entry
//! carries a value of type `T` that the turns holding it hand on to each other and that goes
//! with the entry (the engine keeps a conversation's lease there: held while this replica has
//! turns of it queued, let go when the last one is done).

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::OwnedMutexGuard;

use crate::state::StateKey;
use crate::store::KeyMap;

type Slot<T> = Arc<tokio::sync::Mutex<T>>;

/// Per-key async locks that exist only while in use.
#[derive(Debug)]
pub(crate) struct KeyQueue<T> {
    slots: Arc<Mutex<KeyMap<Slot<T>>>>,
}

/// Holds a key's turn; releases it, and forgets the key when nobody else wants it, on drop.
#[derive(Debug)]
pub(crate) struct KeyTurn<T> {
    key: StateKey,
    slots: Arc<Mutex<KeyMap<Slot<T>>>>,
    guard: Option<OwnedMutexGuard<T>>,
}

impl<T: Default> KeyQueue<T> {
    /// An empty queue.
    pub fn new() -> Self {
        Self {
            slots: Arc::default(),
        }
    }

    /// Waits until no other turn of this replica holds `key`, then holds it.
    pub async fn enter(&self, key: &StateKey) -> KeyTurn<T> {
        let slot = Arc::clone(lock(&self.slots).entry(key.clone()).or_default());
        // Built before the wait, so that a cancelled wait still cleans up its table entry.
        let mut turn = KeyTurn {
            key: key.clone(),
            slots: Arc::clone(&self.slots),
            guard: None,
        };
        turn.guard = Some(slot.lock_owned().await);
        turn
    }

    /// How many keys have a turn in flight or waiting.
    pub fn len(&self) -> usize {
        lock(&self.slots).len()
    }
}

impl<T> KeyTurn<T> {
    /// Whether another turn of this key waits on this one.
    pub fn others_waiting(&self) -> bool {
        // The table's reference, this turn's guard's, and one per waiting turn.
        lock(&self.slots)
            .get(&self.key)
            .is_some_and(|slot| Arc::strong_count(slot) > 2)
    }

    /// The value the key's turns hand on to each other.
    pub fn held(&mut self) -> Option<&mut T> {
        self.guard.as_deref_mut()
    }
}

impl<T> Drop for KeyTurn<T> {
    fn drop(&mut self) {
        // Release the key before deciding whether anyone else still refers to its slot.
        self.guard.take();
        let mut slots = lock(&self.slots);
        // Only the table's own reference left: no turn holds or awaits this key.
        if slots
            .get(&self.key)
            .is_some_and(|slot| Arc::strong_count(slot) == 1)
        {
            slots.remove(&self.key);
        }
    }
}

/// The table's lock guards plain map operations only, never an `.await`; a panic cannot leave the
/// map inconsistent, so a poisoned lock is used as is.
fn lock<T>(slots: &Mutex<KeyMap<Slot<T>>>) -> MutexGuard<'_, KeyMap<Slot<T>>> {
    slots
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::incoming::{ChannelId, ConversationId};

    fn key(conversation: &str) -> StateKey {
        StateKey::conversation(
            "bot",
            &ChannelId::parse("test", "channel_id").expect("valid"),
            &ConversationId::parse(conversation, "conversation.id").expect("valid"),
        )
    }

    #[tokio::test]
    async fn turns_of_one_key_take_turns_and_the_table_empties() {
        let queue = Arc::new(KeyQueue::<()>::new());
        let first = queue.enter(&key("a")).await;
        let other_key = queue.enter(&key("b")).await;
        let waiting = {
            let queue = Arc::clone(&queue);
            tokio::spawn(async move { queue.enter(&key("a")).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "a second turn of `a` waits for the first"
        );
        drop(first);
        let second = waiting.await.expect("the waiter gets the key");
        assert_eq!(queue.len(), 2);
        drop(second);
        drop(other_key);
        assert_eq!(queue.len(), 0, "no turn in flight, no entry left");
    }

    /// Dropped with its entry: tells `dropped` so.
    #[derive(Default)]
    struct Held(Option<Arc<std::sync::atomic::AtomicBool>>);

    impl Drop for Held {
        fn drop(&mut self) {
            if let Some(dropped) = &self.0 {
                dropped.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }

    #[tokio::test]
    async fn the_held_value_passes_to_the_next_turn_and_goes_with_the_last_who_knows_it_is() {
        let queue = Arc::new(KeyQueue::<Held>::new());
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut first = queue.enter(&key("a")).await;
        assert!(!first.others_waiting(), "nobody else asked yet");
        if let Some(held) = first.held() {
            held.0 = Some(Arc::clone(&dropped));
        }
        let waiting = {
            let queue = Arc::clone(&queue);
            tokio::spawn(async move { queue.enter(&key("a")).await })
        };
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !first.others_waiting() {
            assert!(
                tokio::time::Instant::now() < until,
                "the waiter never showed"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        drop(first);
        let mut second = waiting.await.expect("the waiter gets the key");
        assert!(!second.others_waiting(), "the waiter was the last");
        assert!(
            second.held().is_some_and(|held| held.0.is_some()),
            "the value was not handed on"
        );
        assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
        drop(second);
        assert!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            "the value outlived the last turn"
        );
        assert_eq!(queue.len(), 0);
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_no_entry() {
        let queue = Arc::new(KeyQueue::<()>::new());
        let held = queue.enter(&key("a")).await;
        let waiting = {
            let queue = Arc::clone(&queue);
            tokio::spawn(async move { queue.enter(&key("a")).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        waiting.abort();
        let _ = waiting.await;
        drop(held);
        assert_eq!(queue.len(), 0);
    }
}
