//! The store's latency as the `turnstile_store_duration_seconds` histogram, by `op` (`load` |
//! `commit` | `lock`): a wrapper around any [`Store`], as IOx times its catalog with a metrics decorator,
//! so that neither the engine nor each store implementation has to remember to time its calls.
//!
//! It sits behind the state cache (see `cached`), so that it times the calls that reach the store
//! and a load the cache answered is not counted as a store call. A commit under a lock, a hold or
//! a lease is timed as a commit too: those are the contended conversations' commits, and a
//! histogram without them would show only the easy ones.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, Handed, Lease, LockedTurn,
    PoolStatus, Snapshot, Store, StoreError,
};
use crate::state::StateKey;
use crate::telemetry::metrics::STORE_DURATION;

/// A store whose loads and commits are timed.
#[derive(Clone)]
pub struct TimedStore {
    inner: Arc<dyn Store>,
    load: metrics::Histogram,
    commit: metrics::Histogram,
    lock: metrics::Histogram,
}

impl std::fmt::Debug for TimedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimedStore").finish_non_exhaustive()
    }
}

impl TimedStore {
    /// `lock`, whose turn's commit is timed.
    fn timing(&self, lock: ConversationLock) -> ConversationLock {
        match lock {
            ConversationLock::Held { snapshot, turn } => ConversationLock::Held {
                snapshot,
                turn: Box::new(TimedTurn {
                    inner: turn,
                    commit: self.commit.clone(),
                }),
            },
            other => other,
        }
    }

    /// `inner`, timed. The histograms' handles are taken once, here, rather than looked up by
    /// name and label at every call.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            load: metrics::histogram!(STORE_DURATION, "op" => "load"),
            commit: metrics::histogram!(STORE_DURATION, "op" => "commit"),
            lock: metrics::histogram!(STORE_DURATION, "op" => "lock"),
        }
    }
}

#[async_trait]
impl Store for TimedStore {
    async fn load(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        let started = Instant::now();
        let loaded = self.inner.load(keys, receipt).await;
        self.load.record(started.elapsed());
        loaded
    }

    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let started = Instant::now();
        let committed = self.inner.commit(commit).await;
        self.commit.record(started.elapsed());
        committed
    }

    async fn prune_receipts(&self, age: Duration) -> Result<u64, StoreError> {
        self.inner.prune_receipts(age).await
    }

    /// Times the wait for the lock with the load under it, and the locked turn's commit.
    async fn lock_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
    ) -> Result<ConversationLock, StoreError> {
        let started = Instant::now();
        let locked = self
            .inner
            .lock_conversation(conversation, keys, receipt, wait)
            .await;
        self.lock.record(started.elapsed());
        locked.map(|locked| self.timing(locked))
    }

    /// Times the wait for the hold with the load under it, as a lock, and the held turn's
    /// commit.
    async fn hold_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
        others: crate::store::Others,
    ) -> Result<ConversationLock, StoreError> {
        let started = Instant::now();
        let held = self
            .inner
            .hold_conversation(conversation, keys, receipt, wait, others)
            .await;
        self.lock.record(started.elapsed());
        held.map(|held| self.timing(held))
    }

    async fn sweep_expired(
        &self,
        after: Option<&str>,
        batch: usize,
    ) -> Result<crate::store::Swept, StoreError> {
        self.inner.sweep_expired(after, batch).await
    }

    async fn erase(
        &self,
        erasure: &crate::store::Erasure,
    ) -> Result<crate::store::Erased, StoreError> {
        self.inner.erase(erasure).await
    }

    async fn add_pending(
        &self,
        conversation: &StateKey,
        pending: &crate::store::Pending,
    ) -> Result<(), StoreError> {
        self.inner.add_pending(conversation, pending).await
    }

    async fn inspect(
        &self,
        keys: &[StateKey],
        receipts_under: &str,
        receipts: usize,
    ) -> Result<crate::store::Inspected, StoreError> {
        self.inner.inspect(keys, receipts_under, receipts).await
    }

    async fn list_conversations(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<crate::store::InspectedRow>, StoreError> {
        self.inner.list_conversations(prefix, after, limit).await
    }

    /// Times the wait for the lease with the load under it, as a lock, and the commit of the
    /// lease's last turn.
    async fn lease_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
    ) -> Result<ConversationLease, StoreError> {
        let started = Instant::now();
        let leased = self
            .inner
            .lease_conversation(conversation, keys, receipt, wait)
            .await;
        self.lock.record(started.elapsed());
        leased.map(|leased| match leased {
            ConversationLease::Held {
                lease,
                snapshot,
                waited,
            } => ConversationLease::Held {
                lease: Lease::new(Box::new(TimedTurn {
                    inner: lease.into_last_turn(),
                    commit: self.commit.clone(),
                })),
                snapshot,
                waited,
            },
            other => other,
        })
    }

    fn pool_status(&self) -> Option<PoolStatus> {
        self.inner.pool_status()
    }
}

/// A locked turn whose commit is timed as the store's commits are.
struct TimedTurn {
    inner: Box<dyn LockedTurn>,
    commit: metrics::Histogram,
}

#[async_trait]
impl LockedTurn for TimedTurn {
    async fn commit(self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let started = Instant::now();
        let committed = self.inner.commit(commit).await;
        self.commit.record(started.elapsed());
        committed
    }

    async fn release(self: Box<Self>) {
        self.inner.release().await;
    }

    fn handed(&self) -> &Handed {
        self.inner.handed()
    }

    fn interrupted(&self) -> futures::future::BoxFuture<'static, ()> {
        self.inner.interrupted()
    }

    async fn supersede(
        self: Box<Self>,
        commit: Commit,
        activity: serde_json::Value,
    ) -> Result<CommitOutcome, StoreError> {
        let started = Instant::now();
        let committed = self.inner.supersede(commit, activity).await;
        self.commit.record(started.elapsed());
        committed
    }
}

#[cfg(test)]
mod tests {
    use metrics_exporter_prometheus::PrometheusBuilder;

    use super::*;
    use crate::activity::JsonMap;
    use crate::activity::incoming::{ChannelId, ConversationId};
    use crate::store::memory::MemoryStore;
    use crate::store::{Expected, KeyChange, Others};

    #[tokio::test]
    async fn a_held_turns_commit_is_timed_as_a_commit() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let store = metrics::with_local_recorder(&recorder, || {
            TimedStore::new(Arc::new(MemoryStore::new()))
        });
        let key = StateKey::conversation(
            "bot",
            &ChannelId::parse("test", "channel_id").expect("valid"),
            &ConversationId::parse("held", "conversation.id").expect("valid"),
        );
        let keys = [key.clone()];
        let held = store
            .hold_conversation(&key, &keys, None, Duration::from_secs(1), Others::Wait)
            .await
            .expect("held");
        let ConversationLock::Held { turn, .. } = held else {
            panic!("not held: {held:?}");
        };
        let commit = Commit::new(vec![KeyChange {
            key,
            expected: Expected::Absent,
            write: Some(JsonMap::new().into()),
        }]);
        let committed = turn.commit(commit).await.expect("committed");
        assert!(matches!(committed, CommitOutcome::Committed(_)));
        let text = handle.render();
        assert!(
            text.contains(r#"turnstile_store_duration_seconds_count{op="commit"} 1"#),
            "{text}"
        );
    }
}
