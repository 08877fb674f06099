//! What this replica last committed, so that the next turn of the same conversation can skip the
//! load and go straight to the conditional commit: one database round trip instead of two.
//!
//! The cache is only a guess about the current version. A guess that is wrong — another replica
//! committed meanwhile — costs a conflict, a real load and a replay, never a wrong answer: the
//! commit checks every version the turn relied on. That is also why the engine uses it only for
//! turns that will commit (activities with an id always do, their receipt is written): a turn that
//! commits nothing would never find out that its cached state was stale.
//!
//! Bounded with two generations: entries go into the young map; when it fills, it becomes the old
//! map and the previous old map is dropped. A hit in the old map moves the entry back. That is a
//! cheap approximation of least-recently-used that never scans.

use std::collections::HashMap;
use std::mem;
use std::sync::{Mutex, MutexGuard};

use crate::state::StateKey;
use crate::store::{Snapshot, Versioned};

/// A key's last known row: `None` for a key known not to exist.
type Entry = Option<Versioned>;

/// The last committed state of recently used keys.
#[derive(Debug)]
pub(crate) struct StateCache {
    generation: usize,
    maps: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    young: HashMap<StateKey, Entry>,
    old: HashMap<StateKey, Entry>,
}

impl StateCache {
    /// A cache of at most about `capacity` keys; 0 disables it.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            generation: capacity / 2,
            maps: Mutex::default(),
        }
    }

    /// Whether the cache holds anything at all (capacity above 0).
    pub(crate) fn is_enabled(&self) -> bool {
        self.generation > 0
    }

    /// A snapshot of `keys` if every one of them is cached.
    pub(crate) fn snapshot(&self, keys: &[StateKey]) -> Option<Snapshot> {
        if self.generation == 0 {
            return None;
        }
        let mut maps = self.lock();
        let mut rows = HashMap::with_capacity(keys.len());
        for key in keys {
            let entry = match maps.young.get(key) {
                Some(entry) => entry.clone(),
                None => {
                    let entry = maps.old.remove(key)?;
                    maps.young.insert(key.clone(), entry.clone());
                    entry
                }
            };
            if let Some(row) = entry {
                rows.insert(key.clone(), row);
            }
        }
        self.rotate(&mut maps);
        Some(Snapshot::new(rows, None))
    }

    /// Remembers `entry` as the current row of `key`.
    pub(crate) fn remember(&self, key: StateKey, entry: Entry) {
        if self.generation == 0 {
            return;
        }
        let mut maps = self.lock();
        maps.old.remove(&key);
        maps.young.insert(key, entry);
        self.rotate(&mut maps);
    }

    /// Forgets `keys`, whose cached rows proved stale or uncertain.
    pub(crate) fn forget<'a>(&self, keys: impl IntoIterator<Item = &'a StateKey>) {
        if self.generation == 0 {
            return;
        }
        let mut maps = self.lock();
        for key in keys {
            maps.young.remove(key);
            maps.old.remove(key);
        }
    }

    /// How many keys are cached.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        let maps = self.lock();
        maps.young.len() + maps.old.len()
    }

    fn rotate(&self, maps: &mut Generations) {
        if maps.young.len() >= self.generation {
            maps.old = mem::take(&mut maps.young);
        }
    }

    /// Plain map operations only, never held across an `.await`; a poisoned lock still guards a
    /// consistent map, and at worst a stale guess, which the commit catches.
    fn lock(&self) -> MutexGuard<'_, Generations> {
        self.maps.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::incoming::{ChannelId, ConversationId};
    use crate::store::Version;

    fn key(n: usize) -> StateKey {
        StateKey::conversation(
            "bot",
            &ChannelId::parse("test", "channel_id").expect("valid"),
            &ConversationId::parse(&format!("c{n}"), "conversation.id").expect("valid"),
        )
    }

    fn row(v: u64) -> Entry {
        Some(Versioned {
            state: Default::default(),
            version: Version::new(v),
        })
    }

    #[test]
    fn a_snapshot_needs_every_key_and_keeps_absent_ones_absent() {
        let cache = StateCache::new(100);
        cache.remember(key(1), row(3));
        assert!(cache.snapshot(&[key(1), key(2)]).is_none(), "key 2 unknown");
        cache.remember(key(2), None);
        let snapshot = cache.snapshot(&[key(1), key(2)]).expect("both known");
        assert_eq!(
            snapshot.get(&key(1)).map(|r| r.version),
            Some(Version::new(3))
        );
        assert!(snapshot.get(&key(2)).is_none());
        cache.forget([&key(1)]);
        assert!(cache.snapshot(&[key(1)]).is_none());
    }

    #[test]
    fn the_cache_stays_bounded_and_keeps_what_is_used() {
        let cache = StateCache::new(10);
        for n in 0..1000 {
            cache.remember(key(n), row(1));
            // Key 0 is used all the time and survives every rotation.
            assert!(
                cache.snapshot(&[key(0)]).is_some(),
                "lost the hot key at {n}"
            );
        }
        assert!(cache.len() <= 10, "{} entries", cache.len());
    }

    #[test]
    fn capacity_zero_disables_it() {
        let cache = StateCache::new(0);
        cache.remember(key(1), row(1));
        assert!(cache.snapshot(&[key(1)]).is_none());
    }
}
