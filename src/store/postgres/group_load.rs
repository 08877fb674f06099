//! Group load: the loads of concurrent turns whose state this replica has not cached, whatever
//! their conversations, read by one statement.
//!
//! Why: a turn whose conversation is not in the state cache reads its rows before the bot runs.
//! For PostgreSQL that statement is cheap beside what surrounds it — the protocol exchange, the
//! executor started for each part of the union (three scopes' rows, their tombstones, the receipt
//! in each slot of the receipt table). Measured with pgbench over a million conversations, a
//! load alone cost PostgreSQL about 70 µs of CPU, eight turns' loads in one statement about 30 µs
//! each (`bench/RESULTS.md`). A deployment with many conversations pays it on nearly every turn.
//!
//! How: as the group commit ([`super::group_commit`]). A set number of load statements may be in
//! flight at once ([`LOADS_IN_FLIGHT`]). A load that finds a slot free and nothing queued goes at
//! once, on its caller's task, by the plain statement ([`super::load_of`]). The others queue for
//! the store's loader task, which waits for a slot and sends everything queued by then as one
//! statement ([`super::LOAD_MANY`]): batches are as large as the load makes them, and no load
//! waits for a timer.
//!
//! Each turn gets the rows of its own keys and its own receipt, all read by the one statement, so
//! from one snapshot, as a load alone. A key two turns share (one user in two conversations) is
//! read once and given to both. A statement that fails fails every load of its batch, each with
//! its own error sharing the one cause ([`BatchFailure`]).
//!
//! Not here: a load that locks its conversation's row (it runs in the lock's transaction), and
//! loads on Citus, which go shard by shard.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use anyhow::anyhow;
use deadpool_postgres::Pool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres::Row;

use super::batch_failure::BatchFailure;
use super::task_queue::TaskQueue;
use super::timeouts::{CALL_TIMEOUT, within_deadline};
use super::{LOAD_MANY, RECEIPT, Via, classify, client_of, load_by_keys, load_of, unexpected};
use crate::state::StateKey;
use crate::store::{KeyHasher, StoreError};
use crate::telemetry::metrics::LOAD_BATCH_SIZE;

/// How many load statements one replica keeps in flight at once: one. The loads that come while
/// it runs form the next batch, and a load that comes to a quiet store goes at once.
///
/// A second statement in flight took the loads that would have waited and split them into more,
/// smaller statements, each paying its protocol exchange and executor start-up: over 1,000,000
/// and 10,000,000 conversations at 32 calls, one in flight served 0.98 to 1.24 times the turns a
/// second of two (median 1.11, six alternating pairs), for 5 to 23 % less database CPU a turn in
/// every pair (`bench/RESULTS.md`, 2026-11-30). Loads wait on no flush, so nothing overlaps that
/// a second statement could fill.
pub const LOADS_IN_FLIGHT: usize = 1;

/// The most turns' loads in one statement.
const MAX_BATCH: usize = 64;

/// The rows of one load: those of a statement of its own, or its share of a batch's.
pub(super) struct Loaded {
    rows: Arc<Vec<Row>>,
    /// Which of `rows` are this load's.
    mine: Vec<usize>,
}

impl Loaded {
    /// The rows of a statement that served one load.
    fn alone(rows: Vec<Row>) -> Self {
        Self {
            mine: (0..rows.len()).collect(),
            rows: Arc::new(rows),
        }
    }

    /// This load's rows, as the plain load returns them.
    pub(super) fn rows(&self) -> impl Iterator<Item = &Row> {
        self.mine.iter().map(|&i| &self.rows[i])
    }
}

/// One queued load and where its rows go.
struct Queued {
    keys: Vec<StateKey>,
    receipt: Option<StateKey>,
    loaded: oneshot::Sender<Result<Loaded, StoreError>>,
    /// [`CALL_TIMEOUT`] after it was queued: past it, its caller has given up.
    deadline: Instant,
}

/// The loads of a store, and its loader task (started when first needed, on the runtime of that
/// use; it ends when the store is dropped).
pub(super) struct GroupLoad {
    shared: Arc<Shared>,
    queue: TaskQueue<Queued>,
}

/// What the callers and the loader task share.
struct Shared {
    pool: Pool,
    /// One permit per load statement in flight.
    slots: Arc<Semaphore>,
    counts: Counts,
}

/// What a store's group load has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupLoadStats {
    /// Statements run, each for one load or for a batch.
    pub statements: u64,
    /// Loads those statements served.
    pub loads: u64,
    /// The most loads one statement has served.
    pub largest: u64,
}

#[derive(Default)]
struct Counts {
    statements: AtomicU64,
    loads: AtomicU64,
    largest: AtomicU64,
}

impl Counts {
    fn record(&self, size: usize) {
        let size = size as u64;
        self.statements.fetch_add(1, Ordering::Relaxed);
        self.loads.fetch_add(size, Ordering::Relaxed);
        self.largest.fetch_max(size, Ordering::Relaxed);
        metrics::histogram!(LOAD_BATCH_SIZE).record(size as f64);
    }
}

impl GroupLoad {
    /// A group load over `pool` with at most `slots` statements in flight at once.
    pub fn new(pool: Pool, slots: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                pool,
                slots: Arc::new(Semaphore::new(slots.max(1))),
                counts: Counts::default(),
            }),
            queue: TaskQueue::new(),
        }
    }

    /// What the group load has done so far.
    pub fn stats(&self) -> GroupLoadStats {
        let counts = &self.shared.counts;
        GroupLoadStats {
            statements: counts.statements.load(Ordering::Relaxed),
            loads: counts.loads.load(Ordering::Relaxed),
            largest: counts.largest.load(Ordering::Relaxed),
        }
    }

    /// The rows of `keys` and of `receipt`, read `via` (not on Citus) with whatever other loads
    /// are queued, or alone at once when nothing is queued and a slot is free. The caller times
    /// the call ([`super::within_call_timeout`]); a batch is timed by its first load's deadline.
    pub async fn load(
        &self,
        via: Via,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Loaded, StoreError> {
        let shared = &self.shared;
        let queue = self
            .queue
            .get(|receiver, waiting| loader(Arc::clone(shared), via, receiver, waiting));
        if queue.is_empty()
            && let Ok(_slot) = shared.slots.try_acquire()
        {
            shared.counts.record(1);
            let client = client_of(&shared.pool).await?;
            let names: Vec<&str> = keys.iter().map(StateKey::as_str).collect();
            let receipt = receipt.map(StateKey::as_str);
            let rows = load_by_keys(load_of(names.len(), false), &client, via, &names, &receipt)
                .await
                .map_err(classify)?;
            return Ok(Loaded::alone(rows));
        }
        let (loaded, answer) = oneshot::channel();
        let queued = Queued {
            keys: keys.to_vec(),
            receipt: receipt.cloned(),
            loaded,
            deadline: Instant::now() + CALL_TIMEOUT,
        };
        if queue.send(queued).is_err() {
            return Err(StoreError::Unavailable(anyhow!(
                "the store's loader task has stopped"
            )));
        }
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(anyhow!(
                "the store's loader task stopped during the load"
            )))
        })
    }
}

/// Takes the queued loads, waits for a slot, and sends everything queued by then as one batch on
/// a task of its own, until the store is dropped and the queue drained.
async fn loader(
    shared: Arc<Shared>,
    via: Via,
    mut queue: mpsc::UnboundedReceiver<Queued>,
    waiting: Arc<AtomicUsize>,
) {
    while let Some(first) = queue.recv().await {
        // `first` was queued before everything else pending: its deadline is the earliest.
        let slot =
            tokio::time::timeout_at(first.deadline, Arc::clone(&shared.slots).acquire_owned())
                .await;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH
            && let Ok(next) = queue.try_recv()
        {
            batch.push(next);
        }
        waiting.fetch_sub(batch.len(), Ordering::AcqRel);
        // A load whose caller has given up is not read for nobody.
        batch.retain(|queued| !queued.loaded.is_closed());
        match slot {
            Ok(Ok(slot)) if !batch.is_empty() => {
                tokio::spawn(run(Arc::clone(&shared), via, batch, slot));
            }
            Ok(Ok(_)) => {}
            // The semaphore is never closed; no slot before the deadline: PostgreSQL is not
            // answering the loads in flight.
            Ok(Err(_)) | Err(_) => {
                for queued in batch {
                    let _ = queued.loaded.send(Err(super::timeouts::no_answer()));
                }
            }
        }
    }
}

/// Reads `batch` by one statement on a connection of its own, and gives each load its rows.
async fn run(shared: Arc<Shared>, via: Via, batch: Vec<Queued>, _slot: OwnedSemaphorePermit) {
    shared.counts.record(batch.len());
    let deadline = batch
        .iter()
        .map(|queued| queued.deadline)
        .min()
        .unwrap_or_else(|| Instant::now() + CALL_TIMEOUT);
    match within_deadline(deadline, load_together(&shared.pool, via, &batch)).await {
        Ok(rows) => share(batch, rows),
        Err(e) => {
            let failure = BatchFailure::new(e);
            for queued in batch {
                let _ = queued.loaded.send(Err(failure.error()));
            }
        }
    }
}

/// The rows of every key and receipt of `batch`, each key once, by [`LOAD_MANY`].
async fn load_together(pool: &Pool, via: Via, batch: &[Queued]) -> Result<Vec<Row>, StoreError> {
    let mut names: Vec<&str> = batch
        .iter()
        .flat_map(|queued| queued.keys.iter().map(StateKey::as_str))
        .collect();
    names.sort_unstable();
    names.dedup();
    let receipts: Vec<&str> = batch
        .iter()
        .filter_map(|queued| queued.receipt.as_ref().map(StateKey::as_str))
        .collect();
    let client = client_of(pool).await?;
    load_by_keys(&LOAD_MANY, &client, via, &names, &receipts)
        .await
        .map_err(classify)
}

/// Gives each load of `batch` the rows of its keys and its receipt.
fn share(batch: Vec<Queued>, rows: Vec<Row>) {
    match shares(&batch, &rows) {
        Ok(shares) => {
            let rows = Arc::new(rows);
            for (queued, mine) in batch.into_iter().zip(shares) {
                let _ = queued.loaded.send(Ok(Loaded {
                    rows: Arc::clone(&rows),
                    mine,
                }));
            }
        }
        Err(e) => {
            let failure = BatchFailure::new(unexpected(e));
            for queued in batch {
                let _ = queued.loaded.send(Err(failure.error()));
            }
        }
    }
}

/// Which of `rows` each load of `batch` gets, in the batch's order. Row kinds are the plain
/// load's: every row but a receipt is a key's (its row or its tombstone). A receipt stored twice
/// (in the receipt table and in the one from before it) is given once, as the plain load's
/// `LIMIT 1` does.
fn shares(batch: &[Queued], rows: &[Row]) -> Result<Vec<Vec<usize>>, tokio_postgres::Error> {
    let mut of_key: HashMap<&str, Vec<usize>, KeyHasher> =
        HashMap::with_capacity_and_hasher(rows.len(), KeyHasher::default());
    let mut receipts: HashMap<&str, usize, KeyHasher> = HashMap::default();
    for (i, row) in rows.iter().enumerate() {
        let key: &str = row.try_get(1)?;
        if row.try_get::<_, i16>(0)? == RECEIPT {
            receipts.entry(key).or_insert(i);
        } else {
            of_key.entry(key).or_default().push(i);
        }
    }
    Ok(batch
        .iter()
        .map(|queued| {
            let receipt = queued
                .receipt
                .as_ref()
                .and_then(|r| receipts.get(r.as_str()).copied());
            queued
                .keys
                .iter()
                .filter_map(|key| of_key.get(key.as_str()))
                .flatten()
                .copied()
                .chain(receipt)
                .collect()
        })
        .collect())
}
