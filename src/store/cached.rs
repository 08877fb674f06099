//! What this replica last committed, so that the next turn of the same conversation can skip the
//! load and go straight to the conditional commit: one database round trip instead of two.
//!
//! A wrapper around any [`Store`], as IOx wraps its catalog in a caching one, rather than a cache
//! the engine consults and updates at every step: the engine reads load → run → commit and asks
//! for a guess ([`CachedStore::guess`]) only where one will do. It sits in `store` because it speaks the
//! store's contract (snapshots, commits, versions) and nothing of turns or bots.
//!
//! The cache is only a guess about the current version. A guess that is wrong — another replica
//! committed meanwhile — costs a conflict, a real load and a replay, never a wrong answer: the
//! commit checks every version the turn relied on. That is also why a guess is given only for a
//! load that asks for a receipt (activities with an id always commit, their receipt is written):
//! a turn that commits nothing would never find out that its cached state was stale. And only
//! when the caller asks for one: the engine's replay follows a guess that was wrong, and loads.
//!
//! It also remembers the receipts this replica committed, so that a redelivery of an activity it
//! answered — a channel's resend that queued here behind the turn it repeats, say — is not
//! guessed past: its load reads the store, finds the receipt and answers from it, instead of
//! running the bot again only for its commit to meet the receipt.
//!
//! Bounded by quick_cache's eviction policy (CLOCK-PRO, close to S3-FIFO): an entry used again
//! stays, one seen once leaves first, and the cache keeps to its bytes entry by entry. It used to
//! keep two generations and drop the older half whenever the younger filled: cheap, but at any
//! moment it held between half and all of its bytes, so with more conversations than fit —
//! 10,000 of 8 KiB against 64 MiB — barely half the turns found their state, where a policy that
//! evicts one entry at a time finds about as many as fit (`bench/RESULTS.md`). Bytes are counted
//! as the memory an entry holds (its key, its JSON values, their strings, maps and arrays:
//! [`entry_bytes`]), so that a replica serving bots with large states (a language model's
//! transcript) stays within its memory limit; counting entries alone let 12,700 conversations of
//! 8 KB take 130 MB.

use std::mem;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use super::timed::TimedStore;
use super::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, KeyHasher, KeyMap, Lease,
    LockedTurn, PoolStatus, Snapshot, Store, StoreError, Ttls, Versioned,
};
use crate::activity::JsonMap;
use crate::state::StateKey;

/// A key's last known row: `None` for a key known not to exist.
type Entry = Option<Versioned>;

/// The rows get all of the cache's bytes but a `RECEIPT_SHARE`th, which the receipts' keys get: a
/// key is about a tenth of a small state, and there is one per turn.
const RECEIPT_SHARE: usize = 8;
/// A remembered receipt's map slot and key header, beside the key's text.
const RECEIPT_SLOT: usize = 48;
/// Bytes of the cache per key it is expected to hold, for quick_cache's sizing: its table grows
/// as keys come, and it remembers about half as many evicted keys (ghosts, outside the count, a
/// key's `Arc` each) so that a key coming back soon after its eviction is kept longer.
const EXPECTED_ENTRY: usize = 1024;
/// The oldest entry given as a guess. A deleted row's versions are kept from coming back by its
/// tombstone, kept a day (`migrations/V4__erasure.sql`); an entry older than that could name a
/// version the key reaches again once its tombstone is gone. An hour is far inside the day, and
/// an entry unused for an hour saves little.
const MAX_GUESS_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// A cached entry: the row, what it weighs, and when it was remembered.
#[derive(Debug)]
struct Cached {
    entry: Entry,
    /// The bytes it holds ([`entry_bytes`]), or the rows' share per key if more.
    weight: u64,
    at: std::time::Instant,
    /// When it expires ([`Ttls`]): no guess after that.
    until: Option<std::time::Instant>,
}

/// What a row counts against the cache's bytes: the weight it was given when remembered.
#[derive(Debug, Clone, Copy)]
struct Weight;

impl quick_cache::Weighter<StateKey, Cached> for Weight {
    fn weight(&self, _key: &StateKey, cached: &Cached) -> u64 {
        cached.weight
    }
}

type Rows = quick_cache::unsync::Cache<StateKey, Cached, Weight, KeyHasher>;

/// The last committed state of recently used keys.
#[derive(Debug)]
pub(crate) struct StateCache {
    size: CacheSize,
    /// The least an entry weighs: the rows' bytes over the keys allowed, so that the bound on
    /// bytes also keeps the count of keys within [`CacheSize::entries`].
    row_floor: u64,
    /// The most a row may weigh to be cached: half the rows' bytes.
    row_limit: u64,
    /// Receipts per generation.
    receipt_generation: usize,
    /// Bytes of receipts per generation.
    receipt_generation_bytes: usize,
    /// None when the cache is off.
    caches: Option<Mutex<Caches>>,
    /// How long each scope lives unwritten: a row is guessed only until it would expire.
    ttls: Ttls,
}

/// How much a cache may hold: at most `entries` keys and `bytes` bytes; either 0 disables it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSize {
    /// Keys.
    pub entries: usize,
    /// Bytes of memory its entries hold ([`entry_bytes`]).
    pub bytes: usize,
}

impl CacheSize {
    /// No cache.
    pub const NONE: Self = Self {
        entries: 0,
        bytes: 0,
    };
}

#[derive(Debug)]
struct Caches {
    rows: Rows,
    /// Receipts committed here, in two generations: when the young one fills it becomes the old
    /// one, and the old one is dropped. Never looked up again but by a redelivery, so the newest
    /// are the ones worth keeping, first in first out, which is what generations give for free.
    receipts: KeyMap<()>,
    /// The bytes of the young receipts' keys and slots.
    receipts_bytes: usize,
    old_receipts: KeyMap<()>,
}

impl StateCache {
    /// A cache of at most `size`, empty.
    pub(crate) fn new(size: CacheSize) -> Self {
        // Rows and receipts share the bytes: the rows (RECEIPT_SHARE - 1) parts of
        // RECEIPT_SHARE, the receipts the last part.
        let receipts = (size.bytes / RECEIPT_SHARE) as u64;
        let rows = size.bytes as u64 - receipts;
        let receipt_generation = size.entries / 2;
        let receipt_generation_bytes = receipts as usize / 2;
        let on = receipt_generation > 0 && receipt_generation_bytes > 0;
        let expected = size.entries.min(size.bytes / EXPECTED_ENTRY).max(1);
        Self {
            size,
            row_floor: rows.div_ceil(size.entries.max(1) as u64),
            row_limit: rows / 2,
            receipt_generation,
            receipt_generation_bytes,
            caches: on.then(|| {
                Mutex::new(Caches {
                    rows: Rows::with(
                        expected,
                        rows,
                        Weight,
                        KeyHasher::default(),
                        Default::default(),
                    ),
                    receipts: KeyMap::default(),
                    receipts_bytes: 0,
                    old_receipts: KeyMap::default(),
                })
            }),
            ttls: Ttls::NONE,
        }
    }

    /// This cache, empty, guessing rows of scopes with a time to live only until they expire.
    pub(crate) fn with_ttls(self, ttls: Ttls) -> Self {
        Self {
            ttls,
            ..Self::new(self.size)
        }
    }

    /// Whether the cache holds anything at all (capacity above 0).
    pub(crate) fn is_enabled(&self) -> bool {
        self.caches.is_some()
    }

    /// A snapshot of `keys` if every one of them is cached, for a turn whose receipt is
    /// `receipt`: none when this replica committed that receipt, since the turn is then a
    /// redelivery that only the store's receipt can answer.
    pub(crate) fn snapshot(&self, keys: &[StateKey], receipt: &StateKey) -> Option<Snapshot> {
        let caches = self.lock()?;
        if caches.receipts.contains_key(receipt) || caches.old_receipts.contains_key(receipt) {
            return None;
        }
        let mut rows = KeyMap::with_capacity_and_hasher(keys.len(), KeyHasher::default());
        let mut expiries = Vec::new();
        let now = std::time::Instant::now();
        for key in keys {
            let cached = caches.rows.get(key)?;
            if now.duration_since(cached.at) >= MAX_GUESS_AGE
                || cached.until.is_some_and(|until| now >= until)
            {
                return None;
            }
            if let (Some(_), Some(_)) = (&cached.entry, self.ttls.of(key)) {
                // When each guessed row of a scope with a time to live expires, as its load said.
                let remaining = cached
                    .until
                    .map(|until| until.saturating_duration_since(now));
                expiries.push((key.clone(), remaining));
            }
            if let Some(row) = &cached.entry {
                rows.insert(key.clone(), row.clone());
            }
        }
        Some(
            expiries
                .into_iter()
                .fold(Snapshot::new(rows, None), |snapshot, (key, remaining)| {
                    snapshot.with_expiry(key, remaining)
                }),
        )
    }

    /// Remembers `entry` as the current row of `key`, just written: it expires after its scope's
    /// time to live.
    pub(crate) fn remember(&self, key: StateKey, entry: Entry) {
        let until = match (&entry, self.ttls.of(&key)) {
            (Some(_), Some(ttl)) => std::time::Instant::now().checked_add(ttl),
            _ => None,
        };
        self.remember_until(key, entry, until);
    }

    /// Remembers `entry` as the current row of `key`, as `snapshot` read it: a row of a scope
    /// with a time to live only if the store said when it expires.
    pub(crate) fn remember_read(&self, key: &StateKey, snapshot: &Snapshot) {
        let entry = snapshot.get(key).cloned();
        let until = match (&entry, self.ttls.of(key), snapshot.expiry(key)) {
            (None, _, _) | (_, None, _) => None,
            (Some(_), Some(_), Some(Some(remaining))) => {
                std::time::Instant::now().checked_add(remaining)
            }
            // Expired: it reads as empty at its version until written again.
            (Some(_), Some(_), Some(None)) => None,
            (Some(_), Some(_), None) => {
                self.forget([key]);
                return;
            }
        };
        self.remember_until(key.clone(), entry, until);
    }

    fn remember_until(&self, key: StateKey, entry: Entry, until: Option<std::time::Instant>) {
        if !self.is_enabled() {
            return;
        }
        // Counted before the lock is taken: the walk is the costly part.
        let weight = (entry_bytes(&key, &entry) as u64).max(self.row_floor);
        let Some(mut caches) = self.lock() else {
            return;
        };
        if weight > self.row_limit {
            // Larger than half the cache: not kept, so that one state cannot empty it, and
            // the key's older row is not guessed from either.
            caches.rows.remove(&key);
            return;
        }
        let cached = Cached {
            entry,
            weight,
            at: std::time::Instant::now(),
            until,
        };
        // A row this turn found here, or loaded, and now wrote: its use was counted when it was
        // looked up or loaded, so writing it counts for nothing more (`soft`). A conversation
        // seen once then leaves before those used again and again.
        if let Err((key, cached)) = caches.rows.replace(key, cached, true) {
            caches.rows.insert(key, cached);
        }
    }

    /// Remembers that this replica committed `receipt`.
    pub(crate) fn remember_receipt(&self, receipt: StateKey) {
        let Some(mut guard) = self.lock() else {
            return;
        };
        let caches = &mut *guard;
        caches.receipts_bytes += RECEIPT_SLOT + receipt.as_str().len();
        caches.receipts.insert(receipt, ());
        if caches.receipts.len() >= self.receipt_generation
            || caches.receipts_bytes >= self.receipt_generation_bytes
        {
            caches.receipts_bytes = 0;
            caches.old_receipts = mem::take(&mut caches.receipts);
        }
    }

    /// Forgets `keys`, whose cached rows proved stale or uncertain.
    pub(crate) fn forget<'a>(&self, keys: impl IntoIterator<Item = &'a StateKey>) {
        if let Some(mut caches) = self.lock() {
            for key in keys {
                caches.rows.remove(key);
            }
        }
    }

    /// How many bytes the cached entries weigh ([`entry_bytes`], or the share per key if more).
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.lock()
            .map_or(0, |caches| caches.rows.weight() as usize)
    }

    /// How many keys are cached.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().map_or(0, |caches| caches.rows.len())
    }

    /// Plain cache operations only, never held across an `.await`; a poisoned lock still guards
    /// a consistent cache, and at worst a stale guess, which the commit catches. None when the
    /// cache is off.
    fn lock(&self) -> Option<MutexGuard<'_, Caches>> {
        let caches = self.caches.as_ref()?;
        Some(caches.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The memory `entry` holds under `key` in the cache, about: the key, the map's slot, and the
/// state's JSON values with what they own on the heap. Walked, not serialized: a walk allocates
/// nothing.
pub(crate) fn entry_bytes(key: &StateKey, entry: &Entry) -> usize {
    /// A map slot: the key (a pointer and a length), the entry, and the table's control bytes.
    const SLOT: usize = 64;
    let state = entry.as_ref().map_or(0, |row| map_bytes(&row.state));
    SLOT + key.as_str().len() + state
}

/// The memory a JSON object's entries hold: each key's string, each value, and the tree's nodes.
fn map_bytes(map: &JsonMap) -> usize {
    /// A B-tree node's share per entry, beyond the key and value themselves.
    const NODE: usize = 16;
    map.iter()
        .map(|(k, v)| NODE + mem::size_of::<String>() + k.capacity() + value_bytes(v))
        .sum()
}

/// The memory `value` holds: itself, and what it owns on the heap.
fn value_bytes(value: &serde_json::Value) -> usize {
    use serde_json::Value;
    mem::size_of::<Value>()
        + match value {
            Value::String(s) => s.capacity(),
            Value::Array(items) => {
                (items.capacity() - items.len()) * mem::size_of::<Value>()
                    + items.iter().map(value_bytes).sum::<usize>()
            }
            Value::Object(map) => map_bytes(map),
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        }
}

/// A store in front of which this replica remembers what it last read and committed.
#[derive(Debug)]
pub struct CachedStore<S> {
    inner: S,
    cache: Arc<StateCache>,
}

impl<S: Store> CachedStore<S> {
    /// `inner`, remembering the last committed state of keys within `size`; a size of 0 turns
    /// the cache off, and every call goes to `inner`.
    pub fn new(inner: S, size: CacheSize) -> Self {
        Self {
            inner,
            cache: Arc::new(StateCache::new(size)),
        }
    }
}

/// The store as the turn engine uses it: its calls timed ([`TimedStore`]), behind this
/// replica's state cache.
pub type TurnStore = CachedStore<TimedStore>;

impl TurnStore {
    /// `store` as the turn engine uses it: timed, behind a cache of `size` (0 turns it off)
    /// that guesses a row of a scope with a time to live (`ttls`) only until it would expire.
    pub fn for_turns(store: Arc<dyn Store>, size: CacheSize, ttls: Ttls) -> Self {
        Self {
            inner: TimedStore::new(store),
            cache: Arc::new(StateCache::new(size).with_ttls(ttls)),
        }
    }
}

impl<S> CachedStore<S> {
    /// The times to live its cache keeps to.
    pub fn ttls(&self) -> Ttls {
        self.cache.ttls
    }
}

impl<S: Store> CachedStore<S> {
    /// This replica's last committed rows of `keys` when it has them all, else a load. The
    /// caller's commit checks every version it read, so a stale guess costs a conflict and a
    /// [`Store::load`], never a wrong answer; which is why a guess is given only to a load that
    /// asks for a `receipt` (whose turn always commits, creating it), and never holds a receipt:
    /// the commit's receipt conflicts instead.
    ///
    /// # Errors
    /// [`StoreError`] when the cache has no guess and the store cannot answer.
    pub async fn guess(
        &self,
        keys: &[StateKey],
        receipt: &StateKey,
    ) -> Result<Snapshot, StoreError> {
        match self.cache.snapshot(keys, receipt) {
            Some(snapshot) => Ok(snapshot),
            None => self.load(keys, Some(receipt)).await,
        }
    }
}

#[async_trait]
impl<S: Store> Store for CachedStore<S> {
    async fn load(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        let snapshot = self.inner.load(keys, receipt).await?;
        self.remember_loaded(keys, &snapshot);
        Ok(snapshot)
    }

    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        if !self.cache.is_enabled() {
            return self.inner.commit(commit).await;
        }
        let written = Written::of(&commit);
        let result = self.inner.commit(commit).await;
        written.settle(&self.cache, &result);
        result
    }

    async fn prune_receipts(&self, age: std::time::Duration) -> Result<u64, StoreError> {
        self.inner.prune_receipts(age).await
    }

    /// A locked turn's load is current, and its commit moves the conversation on: both are
    /// remembered, as an ordinary load's and commit's are, so that the next turn here (a leased
    /// conversation's next turn, say) goes straight to its commit.
    async fn lock_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: std::time::Duration,
    ) -> Result<ConversationLock, StoreError> {
        Ok(
            match self
                .inner
                .lock_conversation(conversation, keys, receipt, wait)
                .await?
            {
                ConversationLock::Held { snapshot, turn } => {
                    self.remember_loaded(keys, &snapshot);
                    ConversationLock::Held {
                        turn: self.remembering(turn),
                        snapshot,
                    }
                }
                other => other,
            },
        )
    }

    /// Remembers the load under the hold, and the commit under it, as
    /// [`CachedStore::lock_conversation`] does.
    async fn hold_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: std::time::Duration,
        others: crate::store::Others,
    ) -> Result<ConversationLock, StoreError> {
        Ok(
            match self
                .inner
                .hold_conversation(conversation, keys, receipt, wait, others)
                .await?
            {
                ConversationLock::Held { snapshot, turn } => {
                    self.remember_loaded(keys, &snapshot);
                    ConversationLock::Held {
                        turn: self.remembering(turn),
                        snapshot,
                    }
                }
                other => other,
            },
        )
    }

    async fn sweep_expired(
        &self,
        after: Option<&str>,
        batch: usize,
    ) -> Result<crate::store::Swept, StoreError> {
        self.inner.sweep_expired(after, batch).await
    }

    /// Erases in the store, and forgets what this replica cached of it.
    async fn erase(
        &self,
        erasure: &crate::store::Erasure,
    ) -> Result<crate::store::Erased, StoreError> {
        let erased = self.inner.erase(erasure).await?;
        self.cache.forget(erased.rows.iter().map(|(key, _)| key));
        Ok(erased)
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

    /// Remembers the load under the lease, and the commit of the lease's last turn, as
    /// [`CachedStore::lock_conversation`] does.
    async fn lease_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: std::time::Duration,
    ) -> Result<ConversationLease, StoreError> {
        Ok(
            match self
                .inner
                .lease_conversation(conversation, keys, receipt, wait)
                .await?
            {
                ConversationLease::Held {
                    lease,
                    snapshot,
                    waited,
                } => {
                    self.remember_loaded(keys, &snapshot);
                    ConversationLease::Held {
                        lease: Lease::new(self.remembering(lease.into_last_turn())),
                        snapshot,
                        waited,
                    }
                }
                other => other,
            },
        )
    }

    fn pool_status(&self) -> Option<PoolStatus> {
        self.inner.pool_status()
    }
}

impl<S> CachedStore<S> {
    /// Remembers `keys` as a load under a lock or lease found them: current.
    fn remember_loaded(&self, keys: &[StateKey], snapshot: &Snapshot) {
        if self.cache.is_enabled() {
            for key in keys {
                self.cache.remember_read(key, snapshot);
            }
        }
    }

    /// `turn`, whose commit is remembered when it lands.
    fn remembering(&self, turn: Box<dyn LockedTurn>) -> Box<dyn LockedTurn> {
        if !self.cache.is_enabled() {
            return turn;
        }
        Box::new(RememberingTurn {
            inner: turn,
            cache: Arc::clone(&self.cache),
        })
    }
}

/// What a commit writes, taken before the store consumes it, to remember once it landed. The
/// written states are shared with the commit, not copied; each key is copied once (a list of the
/// keys beside one of the rows copied every written key twice, `bench/RESULTS.md`).
struct Written {
    /// Every key the commit changes, with the version and state it writes, if it writes one.
    changes: Vec<(StateKey, Option<Versioned>)>,
    receipt: Option<StateKey>,
}

impl Written {
    fn of(commit: &Commit) -> Self {
        Self {
            changes: commit
                .changes()
                .iter()
                .map(|c| {
                    let row = c
                        .version_after()
                        .zip(c.write.as_ref())
                        .map(|(version, write)| Versioned {
                            state: write.state().clone(),
                            version,
                        });
                    (c.key.clone(), row)
                })
                .collect(),
            receipt: commit.receipt().map(|(key, _)| key.clone()),
        }
    }

    /// Remembers the rows written, or forgets every key of the commit when `result` leaves them
    /// uncertain.
    fn settle(self, cache: &StateCache, result: &Result<CommitOutcome, StoreError>) {
        match result {
            // Remembered only when the store wrote the version the commit implied; a store that
            // says otherwise fails the turn (the engine checks), and its rows are not guessed at.
            Ok(CommitOutcome::Committed(versions))
                if self.changes.iter().all(|(key, row)| {
                    row.as_ref()
                        .is_none_or(|row| versions.get(key) == Some(&row.version))
                }) =>
            {
                for (key, row) in self.changes {
                    if row.is_some() {
                        cache.remember(key, row);
                    }
                }
                if let Some(receipt) = self.receipt {
                    cache.remember_receipt(receipt);
                }
            }
            // A conflict proves the guess stale; an error leaves the rows uncertain.
            _ => cache.forget(self.changes.iter().map(|(key, _)| key)),
        }
    }
}

/// A locked turn whose commit the cache remembers.
struct RememberingTurn {
    inner: Box<dyn LockedTurn>,
    cache: Arc<StateCache>,
}

#[async_trait]
impl LockedTurn for RememberingTurn {
    async fn commit(self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let written = Written::of(&commit);
        let result = self.inner.commit(commit).await;
        written.settle(&self.cache, &result);
        result
    }

    async fn release(self: Box<Self>) {
        self.inner.release().await;
    }

    fn handed(&self) -> &crate::store::Handed {
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
        let written = Written::of(&commit);
        let result = self.inner.supersede(commit, activity).await;
        written.settle(&self.cache, &result);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::incoming::{ChannelId, ConversationId};
    use crate::store::{Expected, KeyChange, Version, Versions};

    fn key(n: usize) -> StateKey {
        StateKey::conversation(
            "bot",
            &ChannelId::parse("test", "channel_id").expect("valid"),
            &ConversationId::parse(&format!("c{n}"), "conversation.id").expect("valid"),
        )
    }

    /// A cache bounded by `n` entries alone.
    fn entries(n: usize) -> CacheSize {
        CacheSize {
            entries: n,
            bytes: usize::MAX,
        }
    }

    fn row(v: u64) -> Entry {
        Some(Versioned {
            state: Default::default(),
            version: Version::new(v),
        })
    }

    #[test]
    fn a_snapshot_needs_every_key_and_keeps_absent_ones_absent() {
        let cache = StateCache::new(entries(100));
        cache.remember(key(1), row(3));
        assert!(
            cache.snapshot(&[key(1), key(2)], &key(99)).is_none(),
            "key 2 unknown"
        );
        cache.remember(key(2), None);
        let snapshot = cache
            .snapshot(&[key(1), key(2)], &key(99))
            .expect("both known");
        assert_eq!(
            snapshot.get(&key(1)).map(|r| r.version),
            Some(Version::new(3))
        );
        assert!(snapshot.get(&key(2)).is_none());
        cache.forget([&key(1)]);
        assert!(cache.snapshot(&[key(1)], &key(99)).is_none());
    }

    #[test]
    fn the_cache_stays_bounded_and_keeps_what_is_used() {
        let cache = StateCache::new(entries(10));
        for n in 0..1000 {
            cache.remember(key(n), row(1));
            // Key 0 is used all the time and survives every rotation.
            assert!(
                cache.snapshot(&[key(0)], &key(99)).is_some(),
                "lost the hot key at {n}"
            );
        }
        assert!(cache.len() <= 10, "{} entries", cache.len());
    }

    /// A commit's written rows are remembered once it lands at the versions it implied; when it
    /// conflicts, fails or lands otherwise, every key it touched is forgotten, read ones too.
    #[test]
    fn a_commit_is_remembered_when_it_lands_and_forgotten_when_it_does_not() {
        let commit = || {
            Commit::new(vec![
                KeyChange {
                    key: key(1),
                    expected: Expected::Version(Version::new(3)),
                    write: Some(JsonMap::new().into()),
                },
                KeyChange {
                    key: key(2),
                    expected: Expected::Version(Version::new(7)),
                    write: None,
                },
            ])
        };
        let versions = |v: u64| -> Versions { [(key(1), Version::new(v))].into_iter().collect() };
        let cached = |cache: &StateCache| {
            cache
                .snapshot(&[key(1), key(2)], &key(99))
                .map(|s| [key(1), key(2)].map(|k| s.get(&k).map(|r| r.version.get())))
        };
        let outcomes = [
            Ok(CommitOutcome::Committed(versions(4))),
            Ok(CommitOutcome::Committed(versions(5))),
            Ok(CommitOutcome::Conflict { key: key(2) }),
            Err(StoreError::Unavailable(anyhow::anyhow!("gone"))),
        ];
        for (n, outcome) in outcomes.iter().enumerate() {
            let cache = StateCache::new(entries(100));
            cache.remember(key(1), row(3));
            cache.remember(key(2), row(7));
            Written::of(&commit()).settle(&cache, outcome);
            if n == 0 {
                assert_eq!(cached(&cache), Some([Some(4), Some(7)]), "landed");
            } else {
                assert!(cache.snapshot(&[key(1)], &key(99)).is_none(), "{outcome:?}");
                assert!(cache.snapshot(&[key(2)], &key(99)).is_none(), "{outcome:?}");
            }
        }
    }

    #[test]
    fn the_cache_stays_within_its_bytes_and_counts_what_states_hold() {
        let big = |v: u64| {
            let mut state = JsonMap::new();
            state.insert("transcript".into(), serde_json::json!(["x".repeat(8000)]));
            Some(Versioned {
                state: Arc::new(state),
                version: Version::new(v),
            })
        };
        assert!(entry_bytes(&key(1), &big(1)) > 8000);
        assert!(entry_bytes(&key(1), &row(1)) < 200);
        let limit = 100_000;
        let cache = StateCache::new(CacheSize {
            entries: 1_000_000,
            bytes: limit,
        });
        for n in 0..1000 {
            cache.remember(key(n), big(1));
            cache.remember(key(n), big(2));
            assert!(cache.bytes() <= limit, "{} bytes at {n}", cache.bytes());
        }
        assert!(cache.len() >= 5, "it still caches: {}", cache.len());
        cache.forget((0..1000).map(key).collect::<Vec<_>>().iter());
        assert_eq!(cache.bytes(), 0);
    }

    /// More conversations than fit, each turn at one drawn at random: about as many turns find
    /// their state as the cache holds states. Two generations dropping the older half at once
    /// found 47 % here (`bench/RESULTS.md`), at any moment holding between half and all it could.
    #[test]
    fn with_more_conversations_than_fit_about_as_many_turns_hit_as_fit() {
        use rand::{Rng as _, SeedableRng as _};
        let state = |v: u64| {
            let mut state = JsonMap::new();
            state.insert("pad".into(), serde_json::json!("x".repeat(1000)));
            Some(Versioned {
                state: Arc::new(state),
                version: Version::new(v),
            })
        };
        const CONVERSATIONS: usize = 1000;
        let fit = 700;
        let bytes = entry_bytes(&key(0), &state(1)) * fit * RECEIPT_SHARE / (RECEIPT_SHARE - 1);
        let cache = StateCache::new(CacheSize {
            entries: 100_000,
            bytes,
        });
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut versions = [1; CONVERSATIONS];
        let mut hits = 0;
        let turns = 20 * CONVERSATIONS;
        for turn in 0..2 * turns {
            let n = rng.random_range(0..CONVERSATIONS);
            // A turn: its state from the cache, or loaded; then its commit.
            if cache.snapshot(&[key(n)], &key(usize::MAX)).is_some() {
                hits += usize::from(turn >= turns);
            } else {
                cache.remember(key(n), state(versions[n]));
            }
            versions[n] += 1;
            cache.remember(key(n), state(versions[n]));
            assert!(
                cache.bytes() <= bytes,
                "{} bytes at turn {turn}",
                cache.bytes()
            );
        }
        let rate = hits as f64 / turns as f64;
        assert!(
            rate > 0.6,
            "{:.2} of the turns found their state where {:.2} fit",
            rate,
            fit as f64 / CONVERSATIONS as f64
        );
    }

    #[test]
    fn a_receipt_committed_here_is_never_guessed_past() {
        let cache = StateCache::new(entries(100));
        cache.remember(key(1), row(3));
        assert!(cache.snapshot(&[key(1)], &key(50)).is_some());
        cache.remember_receipt(key(50));
        assert!(
            cache.snapshot(&[key(1)], &key(50)).is_none(),
            "a redelivery reads the store, where its receipt answers it"
        );
        assert!(
            cache.snapshot(&[key(1)], &key(51)).is_some(),
            "another turn guesses"
        );
        for n in 0..200 {
            cache.remember_receipt(key(1000 + n));
        }
        assert!(
            cache.snapshot(&[key(1)], &key(50)).is_some(),
            "receipts are bounded like the rows"
        );
    }

    #[test]
    fn capacity_zero_disables_it() {
        let cache = StateCache::new(CacheSize::NONE);
        cache.remember(key(1), row(1));
        assert!(cache.snapshot(&[key(1)], &key(99)).is_none());
    }
}
