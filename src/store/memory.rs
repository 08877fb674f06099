//! The embedded store: the same optimistic-concurrency contract as PostgreSQL, in this process's
//! memory. It is the default so that `cargo run` works with nothing installed, and it serves one
//! replica only: two processes each have their own.
//!
//! A std `Mutex` rather than an async one: every critical section is a few map operations with no
//! `.await` inside, so holding it never blocks the runtime for long, and it is never held across
//! a suspension point.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;

use super::{
    Commit, CommitOutcome, ConversationLock, Erased, Erasure, Expected, Handed, Inspected,
    InspectedReceipt, InspectedRow, KeyMap, LockedTurn, Others, Pending, Receipt, Snapshot, Store,
    StoreError, Swept, Ttls, Version, Versioned, Versions,
};
use crate::state::StateKey;

/// How long a deleted key's last version is kept.
const TOMBSTONE_LIFE: Duration = Duration::from_secs(24 * 60 * 60);

/// Turn state in this process's memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    tables: Arc<Mutex<Tables>>,
    /// Each conversation's hold ([`Store::hold_conversation`]), by conversation; kept for the
    /// store's life, as its rows are.
    holds: Mutex<KeyMap<Arc<Hold>>>,
    /// How long each scope lives unwritten.
    ttls: Ttls,
}

/// One conversation's hold in memory: a fair async mutex, so that the turns waiting for it get
/// it first come, first served, and the activity of the turn holding it.
#[derive(Debug, Default)]
struct Hold {
    turn: Arc<tokio::sync::Mutex<()>>,
    holder: Mutex<Option<StateKey>>,
}

impl Hold {
    fn holder(&self) -> MutexGuard<'_, Option<StateKey>> {
        // Held for an assignment or a clone, never across an await.
        self.holder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[derive(Debug, Default)]
struct Tables {
    rows: KeyMap<Versioned>,
    /// When each row was last written, for operators.
    written: KeyMap<SystemTime>,
    receipts: KeyMap<(Receipt, Instant)>,
    /// When each receipt was written, for operators.
    receipted: KeyMap<SystemTime>,
    /// What each conversation's turns hand on to the next (double texting), by conversation.
    handed: KeyMap<Handed>,
    /// The last version of each key whose row was deleted (erased or expired): it is created
    /// again above it (`migrations/V4__erasure.sql` explains why).
    gone: KeyMap<(Version, Instant)>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// This store, where a row unwritten for its scope's time to live reads as absent (empty, at
    /// its version) and [`Store::sweep_expired`] deletes it.
    #[must_use]
    pub fn with_ttls(self, ttls: Ttls) -> Self {
        Self { ttls, ..self }
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        lock(&self.tables)
    }
}

fn lock(tables: &Mutex<Tables>) -> MutexGuard<'_, Tables> {
    // A panic while the lock was held cannot leave a half-applied commit behind: a commit checks
    // everything before it writes anything. So the data behind a poisoned lock is consistent,
    // and serving on is right.
    tables
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Tables {
    /// [`Store::commit`] on these tables.
    fn commit(&mut self, commit: &Commit) -> CommitOutcome {
        if let Some((key, _)) = commit.receipt() {
            if self.receipts.contains_key(key) {
                return CommitOutcome::Conflict { key: key.clone() };
            }
        }
        for change in commit.changes() {
            let current = self.rows.get(&change.key).map(|row| row.version);
            let gone = self.gone.get(&change.key).map(|(version, _)| *version);
            let holds = match change.expected {
                // A create must go above the key's deletion; a check for absence need not.
                Expected::Absent => current.is_none() && (change.write.is_none() || gone.is_none()),
                Expected::Gone(v) => {
                    current.is_none() && (change.write.is_none() || gone == Some(v))
                }
                Expected::Version(v) => current == Some(v),
            };
            if !holds {
                return CommitOutcome::Conflict {
                    key: change.key.clone(),
                };
            }
        }
        let Self {
            rows,
            written,
            receipts,
            receipted,
            ..
        } = self;
        let mut versions = Versions::default();
        for change in commit.changes() {
            let version = match (&change.write, change.version_after()) {
                (Some(state), Some(version)) => {
                    written.insert(change.key.clone(), SystemTime::now());
                    rows.insert(
                        change.key.clone(),
                        Versioned {
                            state: state.state().clone(),
                            version,
                        },
                    );
                    version
                }
                (_, _) => match change.expected {
                    Expected::Version(v) => v,
                    // A key checked for absence has no version; it is not reported.
                    Expected::Absent | Expected::Gone(_) => continue,
                },
            };
            versions.insert(change.key.clone(), version);
        }
        let now = Instant::now();
        for (key, payload) in commit.receipt().into_iter().chain(commit.receipts_also()) {
            receipts.entry(key.clone()).or_insert_with(|| {
                receipted.insert(key.clone(), SystemTime::now());
                (payload.clone(), now)
            });
        }
        CommitOutcome::Committed(versions)
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
        let mut expiries = Vec::new();
        let found = keys
            .iter()
            .filter_map(|k| {
                let row = tables.rows.get(k)?;
                let Some(ttl) = self.ttls.of(k) else {
                    return Some((k.clone(), row.clone()));
                };
                let age = tables
                    .written
                    .get(k)
                    .and_then(|at| at.elapsed().ok())
                    .unwrap_or_default();
                let remaining = ttl.checked_sub(age).filter(|r| !r.is_zero());
                expiries.push((k.clone(), remaining));
                Some(match remaining {
                    Some(_) => (k.clone(), row.clone()),
                    // Expired: absent to the turn, its version kept for the commit.
                    None => (
                        k.clone(),
                        Versioned {
                            state: Arc::default(),
                            version: row.version,
                        },
                    ),
                })
            })
            .collect();
        let receipt = receipt.and_then(|k| tables.receipts.get(k).map(|(r, _)| r.clone()));
        let mut snapshot = Snapshot::new(found, receipt);
        for (key, remaining) in expiries {
            snapshot = snapshot.with_expiry(key, remaining);
        }
        for key in keys {
            if let Some((version, _)) = tables.gone.get(key) {
                snapshot = snapshot.with_gone(key.clone(), *version);
            }
        }
        Ok(snapshot)
    }

    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        Ok(self.tables().commit(&commit))
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

    /// One replica, whose held turns wait for each other here, first come, first served; with
    /// what the conversation's turns hand on to the next ([`Handed`]). A turn of this process
    /// asked to stop is asked by its engine, so [`Others::Interrupt`] waits as
    /// [`Others::Wait`] does.
    async fn hold_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
        others: Others,
    ) -> Result<ConversationLock, StoreError> {
        let hold = {
            let mut holds = self
                .holds
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(holds.entry(conversation.clone()).or_default())
        };
        let guard = match Arc::clone(&hold.turn).try_lock_owned() {
            Ok(guard) => guard,
            Err(_) => {
                let own = receipt.is_some() && hold.holder().as_ref() == receipt;
                if others == Others::Refuse && !own {
                    return Ok(ConversationLock::Busy);
                }
                match tokio::time::timeout(wait, Arc::clone(&hold.turn).lock_owned()).await {
                    Ok(guard) => guard,
                    Err(_) => return Ok(ConversationLock::NotGranted),
                }
            }
        };
        *hold.holder() = receipt.cloned();
        let snapshot = self.load(keys, receipt).await?;
        let mut tables = self.tables();
        let Tables {
            receipts, handed, ..
        } = &mut *tables;
        let mut left = handed.get(conversation).cloned().unwrap_or_default();
        left.pending.retain(|p| !receipts.contains_key(&p.receipt));
        Ok(ConversationLock::Held {
            snapshot,
            turn: Box::new(MemoryHeldTurn {
                tables: Arc::clone(&self.tables),
                conversation: conversation.clone(),
                handed: left,
                _held: HeldGuard {
                    hold,
                    _guard: guard,
                },
            }),
        })
    }

    async fn inspect(
        &self,
        keys: &[StateKey],
        receipts_under: &str,
        receipts: usize,
    ) -> Result<Inspected, StoreError> {
        let tables = self.tables();
        let rows = keys
            .iter()
            .filter_map(|key| {
                Some(InspectedRow {
                    key: key.clone(),
                    row: tables.rows.get(key)?.clone(),
                    updated_at: tables.written.get(key).copied(),
                })
            })
            .collect();
        let mut found: Vec<InspectedReceipt> = tables
            .receipts
            .iter()
            .filter(|(key, _)| key.as_str().starts_with(receipts_under))
            .map(|(key, (payload, _))| InspectedReceipt {
                key: key.clone(),
                payload: payload.clone(),
                created_at: tables.receipted.get(key).copied(),
            })
            .collect();
        found.sort_by_key(|r| std::cmp::Reverse(r.created_at));
        found.truncate(receipts);
        Ok(Inspected {
            rows,
            receipts: found,
        })
    }

    async fn list_conversations(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<InspectedRow>, StoreError> {
        let tables = self.tables();
        let mut found: Vec<InspectedRow> = tables
            .rows
            .iter()
            .filter(|(key, _)| {
                key.as_str().starts_with(prefix)
                    && after.is_none_or(|after| key.as_str() > after)
                    && key.is_conversation()
            })
            .map(|(key, row)| InspectedRow {
                key: key.clone(),
                row: row.clone(),
                updated_at: tables.written.get(key).copied(),
            })
            .collect();
        found.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
        found.truncate(limit);
        Ok(found)
    }

    async fn sweep_expired(&self, after: Option<&str>, batch: usize) -> Result<Swept, StoreError> {
        let mut tables = self.tables();
        let Tables {
            rows,
            written,
            gone,
            ..
        } = &mut *tables;
        let mut keys: Vec<&StateKey> = rows
            .keys()
            .filter(|k| after.is_none_or(|after| k.as_str() > after))
            .collect();
        keys.sort();
        keys.truncate(batch);
        let next = (keys.len() == batch)
            .then(|| keys.last().map(|k| k.as_str().to_owned()))
            .flatten();
        let expired: Vec<StateKey> = keys
            .into_iter()
            .filter(|k| {
                let age = written.get(*k).and_then(|at| at.elapsed().ok());
                matches!((self.ttls.of(k), age), (Some(ttl), Some(age)) if age >= ttl)
            })
            .cloned()
            .collect();
        for key in &expired {
            if let Some(row) = rows.remove(key) {
                gone.insert(key.clone(), (row.version, Instant::now()));
            }
            written.remove(key);
        }
        Ok(Swept {
            next,
            deleted: expired.len() as u64,
        })
    }

    async fn erase(&self, erasure: &Erasure) -> Result<Erased, StoreError> {
        let mut tables = self.tables();
        let Tables {
            rows,
            written,
            receipts,
            receipted,
            handed,
            gone,
        } = &mut *tables;
        let mut keys: Vec<StateKey> = rows.keys().filter(|k| erasure.covers(k)).cloned().collect();
        keys.sort();
        let mut erased = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(row) = rows.remove(&key) {
                gone.insert(key.clone(), (row.version, Instant::now()));
                erased.push((key.clone(), row.version));
            }
            written.remove(&key);
        }
        if let Erasure::Conversation(_) = erasure {
            handed.retain(|conversation, _| !erasure.covers(conversation));
        }
        let doomed: Vec<StateKey> = receipts
            .iter()
            .filter(|(key, (payload, _))| match erasure {
                Erasure::Conversation(_) => erasure.covers(key),
                Erasure::User(subject) => payload
                    .to_value()
                    .ok()
                    .is_some_and(|v| v.get("user").and_then(|u| u.as_str()) == Some(subject)),
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in &doomed {
            receipts.remove(key);
            receipted.remove(key);
        }
        Ok(Erased {
            rows: erased,
            receipts: doomed.len() as u64,
            at: Some(SystemTime::now()),
        })
    }

    async fn add_pending(
        &self,
        conversation: &StateKey,
        pending: &Pending,
    ) -> Result<(), StoreError> {
        let mut tables = self.tables();
        let waiting = &mut tables
            .handed
            .entry(conversation.clone())
            .or_default()
            .pending;
        if !waiting.iter().any(|p| p.receipt == pending.receipt) {
            waiting.push(pending.clone());
        }
        Ok(())
    }

    /// One process, no other replica to hold a conversation against.
    async fn lease_conversation(
        &self,
        _conversation: &StateKey,
        _keys: &[StateKey],
        _receipt: Option<&StateKey>,
        _wait: Duration,
    ) -> Result<super::ConversationLease, StoreError> {
        Ok(super::ConversationLease::NotOffered)
    }

    fn pool_status(&self) -> Option<super::PoolStatus> {
        None
    }

    async fn prune_receipts(&self, age: Duration) -> Result<u64, StoreError> {
        let mut tables = self.tables();
        let before = tables.receipts.len();
        let now = Instant::now();
        let Tables {
            receipts,
            receipted,
            gone,
            ..
        } = &mut *tables;
        // Tombstones after a day, as PostgreSQL's (`migrations/V4__erasure.sql`).
        gone.retain(|_, (_, at)| now.duration_since(*at) < TOMBSTONE_LIFE);
        receipts.retain(|key, (_, created)| {
            let kept = now.duration_since(*created) < age;
            if !kept {
                receipted.remove(key);
            }
            kept
        });
        Ok((before - receipts.len()) as u64)
    }
}

/// A conversation held for one turn in memory: what it commits clears what was handed to it.
#[derive(Debug)]
struct MemoryHeldTurn {
    tables: Arc<Mutex<Tables>>,
    conversation: StateKey,
    handed: Handed,
    /// The hold, let go when the turn ends (committed, released or dropped).
    _held: HeldGuard,
}

/// A hold held: its holder named until it is let go.
#[derive(Debug)]
struct HeldGuard {
    hold: Arc<Hold>,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for HeldGuard {
    fn drop(&mut self) {
        // Before the guard goes (fields drop after this): the next holder names itself after.
        *self.hold.holder() = None;
    }
}

#[async_trait]
impl LockedTurn for MemoryHeldTurn {
    async fn commit(self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let mut tables = lock(&self.tables);
        let outcome = tables.commit(&commit);
        if matches!(outcome, CommitOutcome::Committed(_)) {
            let Tables {
                receipts, handed, ..
            } = &mut *tables;
            if let Some(left) = handed.get_mut(&self.conversation) {
                left.superseded.clear();
                left.pending.retain(|p| !receipts.contains_key(&p.receipt));
                if left.pending.is_empty() {
                    handed.remove(&self.conversation);
                }
            }
        }
        Ok(outcome)
    }

    async fn release(self: Box<Self>) {}

    fn handed(&self) -> &Handed {
        &self.handed
    }

    async fn supersede(
        self: Box<Self>,
        commit: Commit,
        activity: serde_json::Value,
    ) -> Result<CommitOutcome, StoreError> {
        let mut tables = lock(&self.tables);
        let outcome = tables.commit(&commit);
        if matches!(outcome, CommitOutcome::Committed(_)) {
            tables
                .handed
                .entry(self.conversation.clone())
                .or_default()
                .superseded
                .push(activity);
        }
        Ok(outcome)
    }
}
