//! The embedded store: the same optimistic-concurrency contract as PostgreSQL, in this process's
//! memory. It is the default so that `cargo run` works with nothing installed, and it serves one
//! replica only: two processes each have their own.
//!
//! A std `Mutex` rather than an async one: every critical section is a few map operations with no
//! `.await` inside, so holding it never blocks the runtime for long, and it is never held across
//! a suspension point.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{
    Commit, CommitOutcome, ConversationLock, Expected, KeyMap, Receipt, Snapshot, Store,
    StoreError, Versioned, Versions,
};
use crate::state::StateKey;

/// Turn state in this process's memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    tables: Mutex<Tables>,
}

#[derive(Debug, Default)]
struct Tables {
    rows: KeyMap<Versioned>,
    receipts: KeyMap<(Receipt, Instant)>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        // A panic while the lock was held cannot leave a half-applied commit behind: a commit
        // checks everything before it writes anything. So the data behind a poisoned lock is
        // consistent, and serving on is right.
        self.tables
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn load(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        let tables = self.tables();
        let found = keys
            .iter()
            .filter_map(|k| tables.rows.get(k).map(|row| (k.clone(), row.clone())))
            .collect();
        let receipt = receipt.and_then(|k| tables.receipts.get(k).map(|(r, _)| r.clone()));
        Ok(Snapshot::new(found, receipt))
    }

    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let mut tables = self.tables();
        let Tables { rows, receipts } = &mut *tables;
        if let Some((key, _)) = commit.receipt() {
            if receipts.contains_key(key) {
                return Ok(CommitOutcome::Conflict { key: key.clone() });
            }
        }
        for change in commit.changes() {
            let current = rows.get(&change.key).map(|row| row.version);
            let holds = match change.expected {
                Expected::Absent => current.is_none(),
                Expected::Version(v) => current == Some(v),
            };
            if !holds {
                return Ok(CommitOutcome::Conflict {
                    key: change.key.clone(),
                });
            }
        }
        let mut versions = Versions::default();
        for change in commit.changes() {
            let version = match (&change.write, change.version_after()) {
                (Some(state), Some(version)) => {
                    rows.insert(
                        change.key.clone(),
                        Versioned {
                            state: state.clone(),
                            version,
                        },
                    );
                    version
                }
                (_, _) => match change.expected {
                    Expected::Version(v) => v,
                    // A key checked for absence has no version; it is not reported.
                    Expected::Absent => continue,
                },
            };
            versions.insert(change.key.clone(), version);
        }
        if let Some((key, payload)) = commit.receipt() {
            receipts.insert(key.clone(), (payload.clone(), Instant::now()));
        }
        Ok(CommitOutcome::Committed(versions))
    }

    /// One process, one replica: its engine's queue already runs a conversation's turns one at
    /// a time, so there is nothing to lock.
    async fn lock_conversation(
        &self,
        _conversation: &StateKey,
        _keys: &[StateKey],
        _receipt: Option<&StateKey>,
        _wait: Duration,
    ) -> Result<ConversationLock, StoreError> {
        Ok(ConversationLock::NotNeeded)
    }

    /// One replica: nothing to hold, as for [`MemoryStore::lock_conversation`].
    async fn hold_conversation(
        &self,
        _conversation: &StateKey,
        _keys: &[StateKey],
        _receipt: Option<&StateKey>,
        _wait: Duration,
        _others: crate::store::Others,
    ) -> Result<ConversationLock, StoreError> {
        Ok(ConversationLock::NotNeeded)
    }

    async fn prune_receipts(&self, age: Duration) -> Result<u64, StoreError> {
        let mut tables = self.tables();
        let before = tables.receipts.len();
        let now = Instant::now();
        tables
            .receipts
            .retain(|_, (_, created)| now.duration_since(*created) < age);
        Ok((before - tables.receipts.len()) as u64)
    }
}
