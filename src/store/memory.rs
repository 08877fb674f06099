//! The embedded store: the same optimistic-concurrency contract as PostgreSQL, in this process's
//! memory. It is the default so that `cargo run` works with nothing installed, and it serves one
//! replica only: two processes each have their own.
//!
//! A std `Mutex` rather than an async one: every critical section is a few map operations with no
//! `.await` inside, so holding it never blocks the runtime for long, and it is never held across
//! a suspension point.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;

use super::{Commit, CommitOutcome, Expected, Snapshot, Store, StoreError, Version, Versioned};
use crate::state::StateKey;

/// Turn state in this process's memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    rows: Mutex<HashMap<StateKey, Versioned>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn rows(&self) -> MutexGuard<'_, HashMap<StateKey, Versioned>> {
        // A panic while the lock was held cannot leave a half-applied commit behind: a commit
        // checks everything before it writes anything. So the data behind a poisoned lock is
        // consistent, and serving on is right.
        self.rows
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn load(&self, keys: &[StateKey]) -> Result<Snapshot, StoreError> {
        let rows = self.rows();
        let found = keys
            .iter()
            .filter_map(|k| rows.get(k).map(|row| (k.clone(), row.clone())))
            .collect();
        Ok(Snapshot::new(found))
    }

    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let mut rows = self.rows();
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
        let mut versions = HashMap::with_capacity(commit.changes().len());
        for change in commit.changes() {
            let version = match (&change.write, change.expected) {
                (Some(state), expected) => {
                    let version = match expected {
                        Expected::Absent => Version::FIRST,
                        Expected::Version(v) => v.next(),
                    };
                    rows.insert(
                        change.key.clone(),
                        Versioned {
                            state: state.clone(),
                            version,
                        },
                    );
                    version
                }
                (None, Expected::Version(v)) => v,
                // A key checked for absence has no version; it is not reported.
                (None, Expected::Absent) => continue,
            };
            versions.insert(change.key.clone(), version);
        }
        Ok(CommitOutcome::Committed(versions))
    }
}
