//! Where turn state lives between turns, behind one trait with two implementations: `memory`
//! (embedded, one replica) and `postgres` (shared by any number of replicas).
//!
//! The contract is optimistic concurrency. `load` reads every key a turn needs in one consistent
//! read, each with the version that acts as its ETag. `commit` takes what the turn wrote and what
//! it only read, each with the version it saw, and applies all of it only if every one of those
//! versions still holds — all scopes together, or nothing. A failed precondition is an ordinary
//! outcome, [`CommitOutcome::Conflict`], which the engine answers by replaying the turn; only a
//! store that cannot answer is an error.
//!
//! A commit may also carry a receipt: the turn's answer, stored under the activity's key in the
//! same transaction, and read back by the next load of a redelivered activity. A receipt that
//! exists already is a conflict too. Receipts are opaque JSON to the store and pruned by age.
//!
//! For a conversation whose turns keep conflicting, or a bot whose runs are too costly to repeat,
//! a store shared by replicas also offers a queue: [`Store::lock_conversation`] holds the
//! conversation for one turn's load → run → commit, so that the replicas' turns of it wait in
//! the database instead of running the bot on state that is about to move. The conditional commit
//! stays the backstop: a turn that did not take the lock can still change the state meanwhile.

pub(crate) mod cached;
pub mod memory;
pub mod postgres;
mod receipt;
pub(crate) mod timed;
pub(crate) mod upkeep;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::activity::JsonMap;
use crate::state::StateKey;

pub use cached::CacheSize;
pub use receipt::Receipt;

/// The hasher of every map keyed by [`StateKey`]s: the state cache, the conversation queue, the
/// hot conversations, a snapshot's rows and a commit's versions.
///
/// foldhash (`quality`, seeded at random per process and map) rather than std's SipHash-1-3:
/// these keys are conversation ids that callers choose, so the hash must be keyed, or a caller
/// could send ids that all land in one bucket of the long-lived maps; a random seed is what
/// foldhash gives, at a fraction of SipHash's cost for keys of this length (`bench/RESULTS.md`). A [`StateKey`] hands it the hash
/// of its text that it took when it was made, itself keyed at random per process.
pub type KeyHasher = foldhash::quality::RandomState;

/// A map keyed by [`StateKey`]s, with [`KeyHasher`].
pub type KeyMap<V> = HashMap<StateKey, V, KeyHasher>;

/// The versions of a commit's keys after it applied, in no particular order.
///
/// A list, not a [`KeyMap`]: a commit has a handful of keys, one for most turns, and a hash map
/// of one entry cost each turn an allocation, a table and a hash (`bench/RESULTS.md`) to save a
/// search of one to four entries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Versions(Vec<(StateKey, Version)>);

impl Versions {
    /// The version of `key`, if the commit wrote it.
    pub fn get(&self, key: &StateKey) -> Option<&Version> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Whether the commit wrote `key`.
    pub fn contains_key(&self, key: &StateKey) -> bool {
        self.get(key).is_some()
    }

    /// Records `key` at `version`, replacing what it had.
    pub fn insert(&mut self, key: StateKey, version: Version) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = version,
            None => self.0.push((key, version)),
        }
    }

    /// Forgets `key` (a key the store wrote for itself, not the turn).
    pub fn remove(&mut self, key: &StateKey) {
        self.0.retain(|(k, _)| k != key);
    }

    /// How many keys it has.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it has no key.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each key with its version.
    pub fn iter(&self) -> impl Iterator<Item = (&StateKey, &Version)> {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl FromIterator<(StateKey, Version)> for Versions {
    fn from_iter<I: IntoIterator<Item = (StateKey, Version)>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut versions = Versions(Vec::with_capacity(iter.size_hint().0.max(1)));
        for (key, version) in iter {
            versions.insert(key, version);
        }
        versions
    }
}

impl IntoIterator for Versions {
    type Item = (StateKey, Version);
    type IntoIter = std::vec::IntoIter<(StateKey, Version)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl std::ops::Index<&StateKey> for Versions {
    type Output = Version;

    /// # Panics
    /// When the commit did not write `key`.
    fn index(&self, key: &StateKey) -> &Version {
        match self.get(key) {
            Some(version) => version,
            None => panic!("no version for {key}"),
        }
    }
}

/// A row's version: 1 when first written, one more at every change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Version(u64);

impl Version {
    /// The version of a newly created row.
    pub const FIRST: Version = Version(1);

    /// A version read back from a store.
    pub fn new(v: u64) -> Self {
        Self(v)
    }

    /// The version that follows this one.
    #[must_use]
    pub fn next(self) -> Version {
        Version(self.0 + 1)
    }

    /// The version as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// One key's stored state with its version.
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned {
    /// The state object, shared: a snapshot, the state cache and the turn's scope read one copy.
    pub state: Arc<JsonMap>,
    /// Its version.
    pub version: Version,
}

/// What one consistent read found; keys not present have never been written, or are
/// [gone](Snapshot::gone).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    rows: KeyMap<Versioned>,
    receipt: Option<Receipt>,
    /// Keys absent whose rows were deleted (erased, or expired and swept), each with the last
    /// version it had: a create must go above it. Few, and usually none.
    gone: Vec<(StateKey, Version)>,
    /// How long each row read of a scope with a time to live has before it expires (`None`: it
    /// has expired, and reads as empty at its version for good), for a cache to stop guessing
    /// then. Empty without expiry.
    expiries: Vec<(StateKey, Option<std::time::Duration>)>,
}

impl Snapshot {
    /// A snapshot of `rows`, and of the receipt asked for if it exists.
    pub fn new(rows: KeyMap<Versioned>, receipt: Option<Receipt>) -> Self {
        Self {
            rows,
            receipt,
            gone: Vec::new(),
            expiries: Vec::new(),
        }
    }

    /// The same snapshot, where `key`'s row expires in `remaining` (`None`: has expired).
    #[must_use]
    pub fn with_expiry(mut self, key: StateKey, remaining: Option<std::time::Duration>) -> Self {
        self.expiries.push((key, remaining));
        self
    }

    /// When `key`'s row, of a scope with a time to live, expires: `Some(Some(d))` in `d`,
    /// `Some(None)` expired already; `None` when the store said nothing of it.
    pub fn expiry(&self, key: &StateKey) -> Option<Option<std::time::Duration>> {
        self.expiries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, remaining)| *remaining)
    }

    /// The same snapshot, where `key`, absent, was deleted at `version`.
    #[must_use]
    pub fn with_gone(mut self, key: StateKey, version: Version) -> Self {
        if !self.rows.contains_key(&key) {
            self.gone.push((key, version));
        }
        self
    }

    /// The keys absent because their rows were deleted, with the versions they were deleted at.
    pub fn gone(&self) -> &[(StateKey, Version)] {
        &self.gone
    }

    /// The receipt the load asked for, if that turn committed already.
    pub fn receipt(&self) -> Option<&Receipt> {
        self.receipt.as_ref()
    }

    /// The row of `key`, if it exists.
    pub fn get(&self, key: &StateKey) -> Option<&Versioned> {
        self.rows.get(key)
    }

    /// The precondition that holds for `key` in this snapshot.
    pub fn precondition(&self, key: &StateKey) -> Expected {
        match self.rows.get(key) {
            Some(row) => Expected::Version(row.version),
            None => match self.gone.iter().find(|(k, _)| k == key) {
                Some((_, version)) => Expected::Gone(*version),
                None => Expected::Absent,
            },
        }
    }
}

/// What a turn saw of a key, which must still hold for its commit to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// The key did not exist, and never had (or its deletion was forgotten, a day later).
    Absent,
    /// The key did not exist: its row was deleted at this version (erased, or expired and swept).
    /// It is created at the next one, never again at the first: a turn that read the deleted row
    /// must not find its version again.
    Gone(Version),
    /// The key had this version.
    Version(Version),
}

impl Expected {
    /// Whether the key was absent (never written, or gone).
    pub fn is_absent(self) -> bool {
        !matches!(self, Expected::Version(_))
    }
}

/// One key in a commit: either written with new state, or only checked.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyChange {
    /// The key.
    pub key: StateKey,
    /// What the turn saw of it.
    pub expected: Expected,
    /// The new state, or `None` when the turn only read the key.
    pub write: Option<StateWrite>,
}

/// A scope's new state and its JSON text, written once, when the turn's commit is built.
///
/// Why: the engine measures each written state against the size limit (and for the state-size
/// histogram), and the PostgreSQL store sends it as JSON text. Measuring it by a walk of its own
/// and writing it again at the commit looked at every string of the state twice, a thousand
/// instructions of a warm turn with a 1 KB state (`bench/RESULTS.md`); with the text written
/// first, its length is the size and the store copies it. The state is shared, so that the
/// state cache keeps it without copying; the cache keeps the state, not the text.
///
/// A large state whose turn changed only a few of its properties also carries those properties'
/// own text ([`StateWrite::changed_since`]): PostgreSQL parses every byte of JSON it is sent,
/// which was a third of its CPU per turn with 64 KiB states, and an update over the row the turn
/// read can send only what changed.
#[derive(Debug, Clone, PartialEq)]
pub struct StateWrite {
    state: Arc<JsonMap>,
    /// `state` as serde_json writes it: UTF-8 JSON text.
    json: bytes::Bytes,
    /// The properties that differ from those of the state the turn read, as one JSON object,
    /// when every property read is still there and sending them alone is worth it.
    changed: Option<bytes::Bytes>,
}

/// States from this size of JSON text on may be written as their changed properties: about
/// where PostgreSQL starts to compress a row (TOAST). At this size reading and merging the row
/// already cost PostgreSQL no more than parsing the whole state (`bench/RESULTS.md`).
pub const CHANGED_ONLY_FROM_BYTES: usize = 2048;

impl StateWrite {
    /// `state`, with its JSON text written.
    pub fn new(state: JsonMap) -> Self {
        Self {
            json: crate::state::json_text(&state).into_bytes().into(),
            state: Arc::new(state),
            changed: None,
        }
    }

    /// The same write, also carrying its properties that differ from `read`'s — the state as
    /// stored at the version the write expects — when that is worth sending instead of the whole:
    /// the state is [`CHANGED_ONLY_FROM_BYTES`] or larger, no property of `read` was removed (a
    /// merge cannot remove one), and the changed ones are at most half the text.
    ///
    /// The caller vouches for `read`: merged into the stored row, the changed properties must
    /// make exactly this state (not so for a row that expired, which the turn saw empty).
    #[must_use]
    pub fn changed_since(mut self, read: &JsonMap) -> Self {
        if self.json.len() < CHANGED_ONLY_FROM_BYTES
            || read.keys().any(|key| !self.state.contains_key(key))
        {
            return self;
        }
        let half = self.json.len() / 2;
        let changed: Vec<_> = self
            .state
            .iter()
            .filter(|(key, value)| read.get(key.as_str()) != Some(value))
            .collect();
        // Sized first: a turn that changed most of a large state (a conversation's history that
        // grows) would otherwise write it twice.
        let room = changed.iter().fold(2, |room, (key, value)| {
            room + crate::state::property_room(key, value)
        });
        if room > half {
            return self;
        }
        let mut text = String::with_capacity(room);
        crate::activity::json::write_entries(changed, &mut text);
        if text.len() <= half {
            self.changed = Some(text.into_bytes().into());
        }
        self
    }

    /// The changed properties as one JSON object's text, when [`StateWrite::changed_since`]
    /// found sending them alone worth it: merged over the stored row the write expects, they
    /// make [`StateWrite::state`].
    pub fn changed_json(&self) -> Option<&[u8]> {
        self.changed.as_deref()
    }

    /// The state.
    pub fn state(&self) -> &Arc<JsonMap> {
        &self.state
    }

    /// The state's JSON text, the same as serde_json writes.
    pub fn json(&self) -> &[u8] {
        &self.json
    }

    /// The length of the state's JSON text, in bytes: its size against the limit.
    pub fn json_len(&self) -> usize {
        self.json.len()
    }
}

impl From<JsonMap> for StateWrite {
    fn from(state: JsonMap) -> Self {
        Self::new(state)
    }
}

impl KeyChange {
    /// The version the key has once this change applied, when it writes: the first version for
    /// a key created, the next one for a key updated. Every store follows this one rule, and the
    /// engine checks that the version a store reports is this one.
    pub fn version_after(&self) -> Option<Version> {
        self.write.as_ref()?;
        Some(match self.expected {
            Expected::Absent => Version::FIRST,
            Expected::Gone(v) | Expected::Version(v) => v.next(),
        })
    }
}

/// Everything one turn attempt wants applied atomically.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Commit {
    changes: Vec<KeyChange>,
    receipt: Option<(StateKey, Receipt)>,
    /// More receipts written with it, for activities answered by the same run; each one is
    /// skipped if it exists (the main receipt alone decides a conflict).
    also: Vec<(StateKey, Receipt)>,
}

impl Commit {
    /// A commit of `changes`, kept sorted by key so that every store locks keys in one order.
    pub fn new(mut changes: Vec<KeyChange>) -> Self {
        changes.sort_by(|a, b| a.key.cmp(&b.key));
        Self {
            changes,
            receipt: None,
            also: Vec::new(),
        }
    }

    /// The same commit, also creating receipt `key` with `payload`; it conflicts if that receipt
    /// exists.
    #[must_use]
    pub fn with_receipt(mut self, key: StateKey, payload: impl Into<Receipt>) -> Self {
        self.receipt = Some((key, payload.into()));
        self
    }

    /// The same commit, also writing receipt `key` with `payload` for another activity the same
    /// run answered (skipped if that receipt exists).
    #[must_use]
    pub fn with_receipt_also(mut self, key: StateKey, payload: impl Into<Receipt>) -> Self {
        self.also.push((key, payload.into()));
        self
    }

    /// The receipts written with the main one ([`Commit::with_receipt_also`]).
    pub fn receipts_also(&self) -> &[(StateKey, Receipt)] {
        &self.also
    }

    /// The changes, sorted by key.
    pub fn changes(&self) -> &[KeyChange] {
        &self.changes
    }

    /// The receipt to create, if any.
    pub fn receipt(&self) -> Option<&(StateKey, Receipt)> {
        self.receipt.as_ref()
    }

    /// The changes, sorted by key, and the receipt.
    pub fn into_parts(self) -> (Vec<KeyChange>, Option<(StateKey, Receipt)>) {
        (self.changes, self.receipt)
    }

    /// The version each changed key will have once this commit applies
    /// ([`KeyChange::version_after`]), for checking the store's answer against.
    pub fn implied_versions(&self) -> Vec<(StateKey, Version)> {
        self.changes
            .iter()
            .filter_map(|c| Some((c.key.clone(), c.version_after()?)))
            .collect()
    }

    /// Whether the commit writes anything at all (state or a receipt).
    pub fn writes_anything(&self) -> bool {
        self.receipt.is_some() || self.changes.iter().any(|c| c.write.is_some())
    }
}

/// How a commit ended, when the store could answer.
#[derive(Debug, Clone, PartialEq)]
pub enum CommitOutcome {
    /// Everything applied; the version of every key in the commit afterwards.
    Committed(Versions),
    /// Some key no longer matched what the turn saw; nothing was applied.
    Conflict {
        /// The first key found changed.
        key: StateKey,
    },
}

/// A store that could not give an answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached (down, restarting, pool exhausted past its wait timeout).
    /// Nothing was applied, unless the connection failed while a commit was in flight.
    #[error("state store unavailable")]
    Unavailable(#[source] anyhow::Error),
    /// The store answered with something it should never say (a broken schema, say).
    #[error("state store failed unexpectedly")]
    Unexpected(#[source] anyhow::Error),
}

/// Persistent, versioned turn state.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Reads `keys`, and the receipt `receipt` when given, in one consistent read.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer.
    async fn load(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError>;

    /// Applies `commit` if every key's expectation still holds, atomically.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer; a failed expectation is
    /// [`CommitOutcome::Conflict`], not an error.
    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError>;

    /// Deletes receipts older than `age`; returns how many.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer.
    async fn prune_receipts(&self, age: std::time::Duration) -> Result<u64, StoreError>;

    /// Holds `conversation` against the locked turns of every replica until the returned
    /// [`ConversationLock::Held`] is committed or released, waiting at most `wait` for it, and
    /// loads `keys` (and `receipt`) under the lock, as [`Store::load`] would. A store that
    /// serves one replica answers [`ConversationLock::NotNeeded`]: the engine's per-replica
    /// queue serializes already.
    ///
    /// The lock and the load are one request, so that a store across a network can send them
    /// together: the load runs the moment the lock is granted, without another round trip
    /// while the conversation is held.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer; a lock not granted in time is
    /// [`ConversationLock::NotGranted`], not an error.
    async fn lock_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: std::time::Duration,
    ) -> Result<ConversationLock, StoreError>;

    /// Holds `conversation` for one turn against every other replica's held turns, like
    /// [`Store::lock_conversation`], for a turn whose bot takes seconds to minutes (a language
    /// model): without a connection or a transaction held while the bot runs. The hold is
    /// fenced: the turn's commit (through [`ConversationLock::Held`]'s turn) checks that it
    /// still has it, so a holder that stalled past its time and was taken over replays instead
    /// of committing. `keys` and `receipt` are loaded once the hold is taken, in the same
    /// request; a redelivery of an activity whose turn held the conversation finds its receipt
    /// there. With [`Others::Refuse`], a conversation held by another activity's turn (`receipt`
    /// names this turn's) is [`ConversationLock::Busy`] at once. A store that serves one replica
    /// answers [`ConversationLock::NotNeeded`].
    ///
    /// Required of every store, so that a wrapper cannot switch holds off by forgetting it.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer; a hold not granted in time is
    /// [`ConversationLock::NotGranted`], not an error.
    async fn hold_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: std::time::Duration,
        others: Others,
    ) -> Result<ConversationLock, StoreError>;

    /// The rows of `keys` that exist, as stored, with when each was last written; and the
    /// receipts whose keys start with `receipts_under`, newest first, at most `receipts` of them.
    /// For operators (the admin service), not turns: it reads what a turn never needs.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer.
    async fn inspect(
        &self,
        keys: &[StateKey],
        receipts_under: &str,
        receipts: usize,
    ) -> Result<Inspected, StoreError>;

    /// The conversation scopes' rows whose keys start with `prefix`, in key order, after the key
    /// `after` (from the start when `None`), at most `limit` of them. For operators.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer.
    async fn list_conversations(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<InspectedRow>, StoreError>;

    /// Deletes, each with its tombstone, the expired rows among the `batch` keys after `after`
    /// (from the first when `None`), in key order: one bounded step of a sweep through the
    /// store, which a replica repeats in the background. Expired rows already read as absent
    /// (the store's [`Ttls`]); this gives their room back.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer.
    async fn sweep_expired(&self, after: Option<&str>, batch: usize) -> Result<Swept, StoreError>;

    /// Deletes everything of `erasure`'s user or conversation, for every bot: its state rows,
    /// each leaving a tombstone so that it is created again only above the version it had (a
    /// turn that read it cannot commit it back: its commit conflicts, and its replay finds it
    /// absent), and its receipts. For operators (the admin service).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer; nothing was deleted then, or everything.
    async fn erase(&self, erasure: &Erasure) -> Result<Erased, StoreError>;

    /// Adds `pending` to the activities of `conversation` waiting to be answered together by
    /// one run (the double-text policy `coalesce`), after the ones there, unless it is there
    /// already. The next turn to take the conversation's hold ([`Store::hold_conversation`])
    /// finds them in [`LockedTurn::handed`], and its commit answers them.
    ///
    /// Required of every store, like [`Store::hold_conversation`].
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer.
    async fn add_pending(
        &self,
        conversation: &StateKey,
        pending: &Pending,
    ) -> Result<(), StoreError>;

    /// Holds `conversation` for this replica — against every other replica's locked turns
    /// and leases — until the returned [`Lease`] ends, so that this replica can run several of
    /// the conversation's turns in a row, each an ordinary one (a guess from its cache and one
    /// commit), as a lone replica would. `keys` and `receipt` are loaded once the lease is held,
    /// in the same request. The lease ends when it is dropped, or with the commit of its last
    /// turn ([`Lease::into_last_turn`]), which lets the next holder in the moment it lands.
    ///
    /// A store that serves one replica, or that cannot keep a lease (behind a transaction-mode
    /// pooler), offers none: [`ConversationLease::NotOffered`], and the caller locks turn by
    /// turn. Required, like [`Store::pool_status`], with no default: a wrapper (a cache, a
    /// timer) must forward it, or it would switch leases off without a word.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot answer; a lease not granted in time is
    /// [`ConversationLease::NotGranted`], not an error.
    async fn lease_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: std::time::Duration,
    ) -> Result<ConversationLease, StoreError>;

    /// The connection pool's occupancy, for stores that pool connections; `None` for one that
    /// does not.
    fn pool_status(&self) -> Option<PoolStatus>;
}

/// How a store's connection pool is used right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStatus {
    /// Connections lent to a call.
    pub in_use: usize,
    /// Open connections waiting to be lent.
    pub idle: usize,
    /// Calls waiting for a connection.
    pub waiting: usize,
}

/// What [`Store::lock_conversation`] got.
pub enum ConversationLock {
    /// The store serves one replica, whose queue serializes a conversation's turns already: the
    /// turn runs as an ordinary one.
    NotNeeded,
    /// The conversation is held for this turn until it commits or releases.
    Held {
        /// What the turn loaded under the lock.
        snapshot: Snapshot,
        /// The turn holding the lock, which commits or releases it.
        turn: Box<dyn LockedTurn>,
    },
    /// Another turn held the conversation for all of the wait allowed; nothing was done.
    NotGranted,
    /// Another activity's turn holds the conversation, and the hold was asked with
    /// [`Others::Refuse`]: nothing was done.
    Busy,
}

impl fmt::Debug for ConversationLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotNeeded => "NotNeeded",
            Self::Held { .. } => "Held",
            Self::NotGranted => "NotGranted",
            Self::Busy => "Busy",
        })
    }
}

/// What [`Store::hold_conversation`] does when another activity's turn holds the conversation
/// (a redelivery of the holder's own activity always waits, to be answered from its receipt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Others {
    /// Wait for it, within the wait allowed.
    Wait,
    /// Answer [`ConversationLock::Busy`] at once.
    Refuse,
    /// Ask the holder's turn to stop ([`LockedTurn::interrupted`]), wherever it runs, then wait
    /// for it: the double-text policy `interrupt`. Asked again of each new holder met.
    Interrupt,
}

/// What the conversation's earlier turns left to the turn that takes its hold next: the
/// activities of turns a later message interrupted, and the activities waiting to be answered
/// together. Kept with the hold until a turn that took it commits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Handed {
    /// The activities of turns interrupted before they committed, oldest first, each a Bot
    /// Framework JSON object.
    pub superseded: Vec<serde_json::Value>,
    /// The activities waiting to be answered by one run ([`Store::add_pending`]), in arrival
    /// order, without the ones answered already.
    pub pending: Vec<Pending>,
}

/// How long each scope's state lives unwritten before it reads as absent (expiry). `None`: for
/// ever, the default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ttls {
    /// A conversation's scope.
    pub conversation: Option<std::time::Duration>,
    /// A user's scope.
    pub user: Option<std::time::Duration>,
    /// A user's private scope in a conversation.
    pub private_conversation: Option<std::time::Duration>,
}

impl Ttls {
    /// No expiry.
    pub const NONE: Self = Self {
        conversation: None,
        user: None,
        private_conversation: None,
    };

    /// Whether any scope expires.
    pub fn any(&self) -> bool {
        *self != Self::NONE
    }

    /// The time to live of `key`'s scope; `None` for a key of no scope (a hold) or a scope
    /// that does not expire.
    pub fn of(&self, key: &StateKey) -> Option<std::time::Duration> {
        if !self.any() {
            // Every turn asks, for every key: without expiry, at no cost.
            return None;
        }
        if key.is_conversation() {
            self.conversation
        } else if key.is_hold() {
            None
        } else if key.is_under_conversation() {
            self.private_conversation
        } else if key.holds_user_data() {
            self.user
        } else {
            None
        }
    }

    /// The TTLs as seconds, conversation, user and private conversation, for SQL.
    pub fn seconds(&self) -> [Option<f64>; 3] {
        [self.conversation, self.user, self.private_conversation]
            .map(|ttl| ttl.map(|ttl| ttl.as_secs_f64()))
    }
}

/// What one batch of an expiry sweep did ([`Store::sweep_expired`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// The last key the batch looked at; the next batch starts after it. `None`: the sweep
    /// reached the end.
    pub next: Option<String>,
    /// Rows it deleted.
    pub deleted: u64,
}

/// What [`Store::erase`] deletes: a user's data or a conversation's, named by channel and id,
/// escaped as in keys (`crate::state::subject`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Erasure {
    /// `{channelId}/{userId}`: the user scope, the user's private conversation scopes, and the
    /// receipts of the user's activities.
    User(String),
    /// `{channelId}/{conversationId}`: the conversation scope, its private scopes, its hold, and
    /// its receipts.
    Conversation(String),
}

impl Erasure {
    /// The channel and id it names, escaped.
    pub fn subject(&self) -> &str {
        match self {
            Erasure::User(subject) | Erasure::Conversation(subject) => subject,
        }
    }

    /// Whether `key`'s row is among those it deletes.
    pub fn covers(&self, key: &StateKey) -> bool {
        match self {
            Erasure::User(subject) => key.user_subject().as_deref() == Some(subject),
            Erasure::Conversation(subject) => {
                key.conversation_subject().as_deref() == Some(subject)
            }
        }
    }
}

/// What a [`Store::erase`] deleted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Erased {
    /// The state rows' keys, in key order, each with the last version it had.
    pub rows: Vec<(StateKey, Version)>,
    /// How many receipts.
    pub receipts: u64,
    /// When, by the store's clock.
    pub at: Option<std::time::SystemTime>,
}

/// What [`Store::inspect`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inspected {
    /// The rows that exist.
    pub rows: Vec<InspectedRow>,
    /// The receipts, newest first.
    pub receipts: Vec<InspectedReceipt>,
}

/// A row as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct InspectedRow {
    /// Its key.
    pub key: StateKey,
    /// Its state and version.
    pub row: Versioned,
    /// When it was last written, if the store records it.
    pub updated_at: Option<std::time::SystemTime>,
}

/// A receipt as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct InspectedReceipt {
    /// Its key.
    pub key: StateKey,
    /// The stored answer.
    pub payload: Receipt,
    /// When its turn committed, if the store records it.
    pub created_at: Option<std::time::SystemTime>,
}

/// The empty [`Handed`], for turns holding nothing.
pub static NOTHING_HANDED: Handed = Handed {
    superseded: Vec::new(),
    pending: Vec::new(),
};

/// An activity waiting to be answered together with the others that arrived while a turn of its
/// conversation ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    /// Its receipt's key: the run that answers it writes that receipt.
    pub receipt: StateKey,
    /// The activity, as its Bot Framework JSON object.
    pub activity: serde_json::Value,
}

impl Pending {
    /// The entry as it is kept with the hold: `{"receipt": …, "activity": {…}}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "receipt": self.receipt.as_str(), "activity": self.activity })
    }

    /// An entry as kept with the hold; `None` for one that is not.
    pub fn from_json(entry: &serde_json::Value) -> Option<Self> {
        Some(Self {
            receipt: StateKey::from_stored(entry.get("receipt")?.as_str()?.to_owned()),
            activity: entry.get("activity")?.clone(),
        })
    }
}

/// What [`Store::lease_conversation`] got.
pub enum ConversationLease {
    /// The store offers no leases; lock turn by turn ([`Store::lock_conversation`]).
    NotOffered,
    /// The conversation is this replica's until `lease` ends.
    Held {
        /// Holds the conversation; dropping it lets the next holder in.
        lease: Lease,
        /// What was loaded under the lease.
        snapshot: Snapshot,
        /// Whether another holder had the conversation when this replica asked: it is contended.
        waited: bool,
    },
    /// Another holder kept the conversation for all of the wait allowed; nothing was done.
    NotGranted,
}

impl fmt::Debug for ConversationLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotOffered => f.write_str("NotOffered"),
            Self::Held { waited, .. } => f.debug_struct("Held").field("waited", waited).finish(),
            Self::NotGranted => f.write_str("NotGranted"),
        }
    }
}

/// A conversation held by this replica (see [`Store::lease_conversation`]): the store's
/// [`LockedTurn`], kept open across the holder's turns. Dropping it releases the conversation;
/// so does the commit of the turn it becomes, [`Lease::into_last_turn`].
pub struct Lease {
    turn: Box<dyn LockedTurn>,
}

impl Lease {
    /// A lease held by `turn`, which ends it: committed, released or dropped.
    pub fn new(turn: Box<dyn LockedTurn>) -> Self {
        Self { turn }
    }

    /// The lease as its last turn: a [`LockedTurn`] that commits under the lease (or releases
    /// it) and so ends it, letting the next holder in the moment the commit lands rather than
    /// after another request.
    #[must_use]
    pub fn into_last_turn(self) -> Box<dyn LockedTurn> {
        self.turn
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Lease")
    }
}

/// One turn holding its conversation, which loaded under the lock: at most one commit, which
/// ends the lock, as [`LockedTurn::release`] does, or dropping this (a replica that dies releases
/// it with its connection).
#[async_trait]
pub trait LockedTurn: Send {
    /// [`Store::commit`], under the lock, which it then releases.
    ///
    /// # Errors
    /// As [`Store::commit`].
    async fn commit(self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError>;

    /// Releases the lock without writing anything.
    async fn release(self: Box<Self>);

    /// What the conversation's earlier turns left to this one (a hold's; a lock keeps nothing).
    fn handed(&self) -> &Handed {
        &NOTHING_HANDED
    }

    /// A future that resolves when a turn of another activity asked this one to stop
    /// ([`Others::Interrupt`]), on any replica; never for a turn that cannot be asked (a lock's).
    fn interrupted(&self) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(std::future::pending())
    }

    /// Ends an interrupted turn: `commit` (its receipt, marking it superseded) applies and the
    /// conversation is let go, handing `activity` on to the next turn as superseded, after the
    /// ones handed to this turn ([`Handed::superseded`]). A lock cannot hand anything on: it
    /// commits and releases.
    ///
    /// # Errors
    /// As [`Store::commit`].
    async fn supersede(
        self: Box<Self>,
        commit: Commit,
        activity: serde_json::Value,
    ) -> Result<CommitOutcome, StoreError> {
        let _ = activity;
        self.commit(commit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(value: serde_json::Value) -> JsonMap {
        match value {
            serde_json::Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    fn changed(write: &StateWrite) -> Option<serde_json::Value> {
        write
            .changed_json()
            .map(|text| serde_json::from_slice(text).expect("the changed properties' JSON"))
    }

    #[test]
    fn a_large_state_carries_the_properties_changed_since_the_one_read() {
        let pad = ".".repeat(CHANGED_ONLY_FROM_BYTES);
        let read = map(serde_json::json!({ "pad": pad, "count": 1, "gone": null }));
        let write = StateWrite::new(map(
            serde_json::json!({ "pad": pad, "count": 2, "gone": null, "added": "a\"b" }),
        ))
        .changed_since(&read);
        assert_eq!(
            changed(&write),
            Some(serde_json::json!({ "count": 2, "added": "a\"b" }))
        );
        // Nothing changed (a state written again to refresh its expiry): an empty object.
        let same = StateWrite::new(read.clone()).changed_since(&read);
        assert_eq!(changed(&same), Some(serde_json::json!({})));
    }

    #[test]
    fn a_state_is_written_whole_when_small_when_a_property_went_or_when_most_of_it_changed() {
        let pad = ".".repeat(CHANGED_ONLY_FROM_BYTES);
        let small = map(serde_json::json!({ "count": 1, "pad": "..." }));
        let mut next = small.clone();
        next.insert("count".into(), 2.into());
        assert_eq!(changed(&StateWrite::new(next).changed_since(&small)), None);

        let read = map(serde_json::json!({ "pad": pad, "count": 1, "other": 1 }));
        let removed = map(serde_json::json!({ "pad": pad, "count": 2 }));
        assert_eq!(
            changed(&StateWrite::new(removed).changed_since(&read)),
            None,
            "a merge cannot remove a property"
        );
        let rewritten =
            map(serde_json::json!({ "pad": pad.replace('.', "-"), "count": 1, "other": 1 }));
        assert_eq!(
            changed(&StateWrite::new(rewritten).changed_since(&read)),
            None,
            "more than half the text changed"
        );
        // Read empty (created, or expired and seen empty): everything is changed.
        let whole = map(serde_json::json!({ "pad": pad }));
        assert_eq!(
            changed(&StateWrite::new(whole).changed_since(&JsonMap::new())),
            None
        );
    }
}
