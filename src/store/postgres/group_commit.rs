//! Group commit: the single-scope commits of concurrent turns, whatever their conversations,
//! applied by one statement in one transaction.
//!
//! Why: a turn's own statement is cheap for PostgreSQL; what costs is everything around it — the
//! protocol exchange, starting and committing a transaction, flushing the WAL for it. pgbench on
//! this repository's machines: the commit statement for one turn ran about 8,000 times a second,
//! the same statement over 8 turns' keys about 3,000 times a second — 25,000 turns a second on the
//! same cores (`bench/RESULTS.md`).
//!
//! How: a set number of statements may be in flight at once (slots; one by default, see
//! [`super::DEFAULT_COMMITS_IN_FLIGHT`]). A commit that finds a slot free and nothing queued goes
//! at once, on its own task, by the plain single-scope statement. The others queue for the
//! store's committer task, which waits for a slot and sends everything queued by then as one
//! batch. So turns batch up only while the database is busy with earlier ones: the batches are as
//! large as the load makes them, and no turn waits for a timer.
//!
//! A batch runs on a lane: a pooled connection and the slot it takes. While every slot is taken,
//! the committer sends the next batch behind the one running on its lane, on the same
//! connection, as soon as as many commits wait as that one holds (fewer would split the waiting
//! turns into more, smaller transactions). PostgreSQL then starts it the moment the first has
//! committed, instead of after the answer has reached this server and a new statement has come
//! back: that round trip left the database idle for an eighth of every batch at 8 calls
//! (`bench/RESULTS.md`). A batch gives its lane up the moment the database has answered, before
//! it answers its turns, so that the next batch is on its way while they encode their replies.
//!
//! Each turn keeps its own outcome. A write whose key moved returns no row and that turn alone is
//! a conflict; a receipt is inserted only for a write that returned a row. Two things can fail the
//! statement as a whole — a receipt that exists already (the activity committed elsewhere) and a
//! deadlock with another replica's batch — and then each turn of the batch is committed alone, so
//! that each gets the outcome that is its own. A batch never holds two writes of one key, nor two
//! receipts of one activity: the second waits for the next batch.
//!
//! On Citus a statement over many conversations' rows would touch every node and commit in two
//! phases. There a batch is one statement per node instead (`turnstile_commit_many_in`, run whole
//! by the node that holds the shards of its writes, in one local transaction), all sent together
//! on the lane's connection: the committer sorts the batch by the node that holds each write's
//! shard, which it computes as Citus does ([`super::citus::ShardMap`]). Only a write whose key
//! and receipt share a shard comes here; the store commits any other on its own.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use anyhow::anyhow;
use deadpool_postgres::{ClientWrapper, Object, Pool};
use tokio::sync::{Notify, OnceCell, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::{Instant, timeout_at};
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::batch_failure::BatchFailure;
use super::citus::{self, Engine};
use super::deadlock;
use super::jsonb::Jsonb;
use super::task_queue::TaskQueue;
use super::timeouts::{CALL_TIMEOUT, no_answer, within_call_timeout, within_deadline};
use super::unexpected;
use super::{Sql, Statements, Via, classify_commit, client_of, is_conflict, taken_receipt};
use crate::state::StateKey;
use crate::store::{Commit, CommitOutcome, Expected, KeyChange, StoreError, Version};
use crate::store::{KeyHasher, Receipt, StateWrite};
use crate::telemetry::metrics::COMMIT_BATCH_SIZE;

/// The most turns in one batch.
const MAX_BATCH: usize = 64;

/// One written key and the turn's receipt as one plain statement. `$write` is the write: a
/// data-modifying statement that returns the key's new version, or no row when the key moved. The
/// receipt (parameters `$receipt_key`, `$receipt`, both NULL for a turn without one) is inserted,
/// in the slots `turnstile_receipt_slots` names, only when the write returned a row; one that
/// exists already (the same activity committed meanwhile) is a unique violation, which undoes the
/// write with it (`migrations/V5__receipt_slots.sql`).
macro_rules! write_one {
    ($write:expr, $receipt_key:literal, $receipt:literal) => {
        concat!(
            "WITH written AS (",
            $write,
            "), receipt AS (INSERT INTO turnstile_receipt (slot, key, payload) \
               SELECT unnest(turnstile_receipt_slots(",
            $receipt_key,
            "::text)), ",
            $receipt_key,
            "::text, ",
            $receipt,
            "::jsonb FROM written) SELECT version FROM written"
        )
    };
}
/// The common commit — one scope written over the version the turn read, and the receipt — as
/// one plain statement: PL/pgSQL costs the database about a third more per turn
/// (`bench/RESULTS.md`). The write is the check.
const UPDATE_ONE: Sql = Sql {
    text: write_one!(
        "UPDATE turnstile_state SET state = $2, version = version + 1, updated_at = now() \
          WHERE key = $1 AND version = $3 RETURNING version",
        "$4",
        "$5"
    ),
    types: &[Type::TEXT, Type::JSONB, Type::INT8, Type::TEXT, Type::JSONB],
    on_citus: None,
};
/// [`UPDATE_ONE`] with only the properties the turn changed (`$2`, [`StateWrite::changed_json`]),
/// merged over the row's own: the version check makes that row the one the turn read, so the
/// merge is the turn's whole state, and PostgreSQL parses a few properties instead of the state
/// (a third of its CPU per turn with 64 KiB states, `bench/RESULTS.md`).
const MERGE_ONE: Sql = Sql {
    text: write_one!(
        "UPDATE turnstile_state SET state = state || $2, version = version + 1, \
          updated_at = now() WHERE key = $1 AND version = $3 RETURNING version",
        "$4",
        "$5"
    ),
    types: &[Type::TEXT, Type::JSONB, Type::INT8, Type::TEXT, Type::JSONB],
    on_citus: None,
};
/// [`UPDATE_ONE`] for a key the turn found absent: created at the version `$5` encodes
/// ([`expected_version`]) if the key's tombstone is still the one before it; no row when the key
/// appeared, or was deleted again, meanwhile.
const CREATE_ONE: Sql = Sql {
    text: write_one!(
        concat!(
            "INSERT INTO turnstile_state (key, state, version) SELECT $1, $2, -$5::int8 \
              WHERE ",
            tombstone_version!("$1"),
            " = -$5::int8 - 1 \
             ON CONFLICT (key) DO NOTHING RETURNING version"
        ),
        "$3",
        "$4"
    ),
    types: &[Type::TEXT, Type::JSONB, Type::TEXT, Type::JSONB, Type::INT8],
    on_citus: None,
};
/// The single-scope commits of a batch, one row per turn (`ord` is the turn's place in the
/// batch, from 1), in one statement. Writes are the checks, as in [`UPDATE_ONE`]: an update whose
/// version moved and a create whose key appeared return no row, and only the turns whose write
/// returned a row insert their receipt. An update whose `merge` is set carries only the
/// properties its turn changed, merged over the row's as in [`MERGE_ONE`].
///
/// Each receipt is looked for in every slot, as `turnstile_receipt_slots` does for a commit
/// alone, but by subqueries of this statement: PostgreSQL sets their scans up once per batch and
/// only reruns them for each receipt, where a call of the function sets up and tears down a scan
/// of each slot for every receipt (`bench/RESULTS.md`, 2026-11-30: a sixth of the database's CPU
/// per turn). A receipt found is given to the function, which raises the unique violation a
/// commit alone meets (the batch then goes commit by commit, `Batch::run`); the others go to the
/// slots it names for a key no receipt has, the empty one, reckoned once per statement from
/// the statement's time as it would be for each.
///
/// Each `EXISTS` ends in `OFFSET 0`, which keeps it a probe by key for each receipt. Without it,
/// PostgreSQL may plan the alternative of reading the slots whole into a hash table once per
/// execution, and does when the slots were analyzed empty or never: a generic plan made then is
/// kept as the slot fills, and every batch read all of its receipts (a new deployment's first
/// minutes, or the minutes after a slot's turn to be emptied: 7 ms a batch instead of 0.7,
/// `bench/RESULTS.md`, 2026-11-30). PostgreSQL does not turn an `EXISTS` with an `OFFSET` into
/// that alternative (`simplify_EXISTS_query`).
///
/// The update names its keys a second time, as `key = ANY($1)`, for the same reason: with the
/// state table analyzed empty (nothing written yet, or everything expired), PostgreSQL planned
/// the join by walking the table's whole index, and every batch walked it as the table filled.
/// Named, the walk can only be one over the batch's keys, and with a full table's statistics the
/// plan reads them in one scan of the index (as many buffers a turn as a probe per key).
const WRITE_MANY: Sql = Sql {
    text: WRITE_MANY_TEXT,
    types: &[
        Type::TEXT_ARRAY,
        Type::JSONB_ARRAY,
        Type::INT8_ARRAY,
        Type::TEXT_ARRAY,
        Type::JSONB_ARRAY,
        Type::BOOL_ARRAY,
    ],
    on_citus: None,
};
const WRITE_MANY_TEXT: &str = concat!(
    "\
WITH input AS ( \
  SELECT * FROM unnest($1::text[], $2::jsonb[], $3::int8[], $4::text[], $5::jsonb[], \
                       $6::bool[]) \
    WITH ORDINALITY AS i(key, state, expected, receipt_key, receipt, merge, ord) \
), updated AS ( \
  UPDATE turnstile_state t \
     SET state = CASE WHEN i.merge THEN t.state || i.state ELSE i.state END, \
         version = t.version + 1, updated_at = now() \
    FROM input i WHERE i.expected > 0 AND t.key = i.key AND t.version = i.expected \
     AND t.key = ANY($1::text[]) \
  RETURNING i.ord, t.version \
), created AS ( \
  INSERT INTO turnstile_state (key, state, version) \
  SELECT key, state, -expected FROM input i WHERE expected < 0 \
     AND ",
    tombstone_version!("i.key"),
    " = -expected - 1 \
   ORDER BY key \
  ON CONFLICT (key) DO NOTHING RETURNING key, version \
), written AS ( \
  SELECT ord, version FROM updated \
  UNION ALL \
  SELECT i.ord, c.version FROM created c JOIN input i ON i.key = c.key AND i.expected < 0 \
), receipt AS ( \
  INSERT INTO turnstile_receipt (slot, key, payload) \
  SELECT unnest(CASE WHEN EXISTS (SELECT 1 FROM turnstile_receipt r \
                                   WHERE r.key = i.receipt_key OFFSET 0) \
                       OR ((SELECT legacy FROM turnstile_receipt_clock) \
                           AND EXISTS (SELECT 1 FROM turnstile_receipt_legacy l \
                                        WHERE l.key = i.receipt_key OFFSET 0)) \
                     THEN turnstile_receipt_slots(i.receipt_key) \
                     ELSE (SELECT turnstile_receipt_slots('')) END), \
         i.receipt_key, i.receipt \
    FROM written w JOIN input i USING (ord) \
   WHERE i.receipt_key IS NOT NULL \
) \
SELECT ord, version FROM written"
);

/// A commit that writes one key, and the turn's receipt if it has one: the common commit.
#[derive(Debug)]
pub(super) struct SingleWrite {
    pub key: StateKey,
    pub expected: Expected,
    pub state: StateWrite,
    pub receipt: Option<(StateKey, Receipt)>,
}

impl TryFrom<Commit> for SingleWrite {
    type Error = Commit;

    /// The commit as a single write, or the commit as it was when it checks or writes more keys.
    fn try_from(commit: Commit) -> Result<Self, Commit> {
        match commit.changes() {
            [only] if only.write.is_some() && commit.receipts_also().is_empty() => {}
            _ => return Err(commit),
        }
        let (changes, receipt) = commit.into_parts();
        let Some(KeyChange {
            key,
            expected,
            write: Some(state),
        }) = changes.into_iter().next()
        else {
            unreachable!("checked above: one change, a write")
        };
        Ok(Self {
            key,
            expected,
            state,
            receipt,
        })
    }
}

/// One queued commit, where its outcome goes, and when it must have gone there.
struct Queued {
    write: SingleWrite,
    outcome: oneshot::Sender<Result<CommitOutcome, StoreError>>,
    /// [`CALL_TIMEOUT`] after it was queued: by then the committer has answered it,
    /// unavailable if PostgreSQL has not.
    deadline: Instant,
}

/// The queue of a store's single-scope commits, and its committer task (started when first
/// needed, on the runtime of that use; it ends when the store is dropped).
pub(super) struct GroupCommit {
    shared: Arc<Shared>,
    queue: TaskQueue<Queued>,
}

/// Where the commits go: the pool, how statements are sent on its connections, and whether the
/// tables are distributed by Citus (learned by the store before its first commit).
struct Db {
    pool: Pool,
    statements: Statements,
    engine: Arc<Engine>,
}

impl Db {
    fn via(&self) -> Via {
        Via {
            statements: self.statements,
            citus: self.engine.is_citus(),
        }
    }
}

/// What the callers and the committer task share.
struct Shared {
    db: Db,
    /// One permit per lane: a connection with a batch's statement in flight.
    slots: Arc<Semaphore>,
    /// Told each time a batch's statement has answered, so that the committer can send the next
    /// batch behind the one now running on its lane.
    answered: Notify,
    counts: Counts,
}

/// What a store's group commit has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupCommitStats {
    /// Statements run, each for one batch.
    pub batches: u64,
    /// Commits in those batches.
    pub commits: u64,
    /// The most commits one batch has held.
    pub largest: u64,
    /// Batches sent on a connection behind another batch's statement, before it had answered.
    pub pipelined: u64,
}

#[derive(Default)]
struct Counts {
    batches: AtomicU64,
    commits: AtomicU64,
    largest: AtomicU64,
    pipelined: AtomicU64,
}

impl Counts {
    fn record(&self, size: usize) {
        let size = size as u64;
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.commits.fetch_add(size, Ordering::Relaxed);
        self.largest.fetch_max(size, Ordering::Relaxed);
        metrics::histogram!(COMMIT_BATCH_SIZE).record(size as f64);
    }
}

impl GroupCommit {
    /// A group commit over `pool`, its statements sent as `statements` says and written for the
    /// layout `engine` learns, with at most `slots` statements in flight at once.
    pub fn new(pool: Pool, statements: Statements, engine: Arc<Engine>, slots: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                db: Db {
                    pool,
                    statements,
                    engine,
                },
                slots: Arc::new(Semaphore::new(slots.max(1))),
                answered: Notify::new(),
                counts: Counts::default(),
            }),
            queue: TaskQueue::new(),
        }
    }

    /// What the group commit has done so far.
    pub fn stats(&self) -> GroupCommitStats {
        let counts = &self.shared.counts;
        GroupCommitStats {
            batches: counts.batches.load(Ordering::Relaxed),
            commits: counts.commits.load(Ordering::Relaxed),
            largest: counts.largest.load(Ordering::Relaxed),
            pipelined: counts.pipelined.load(Ordering::Relaxed),
        }
    }

    /// Commits `write` with whatever other commits are queued, and returns its own outcome,
    /// unavailable when PostgreSQL has not answered within [`CALL_TIMEOUT`].
    ///
    /// When nothing is queued and a slot is free, the caller commits alone, at once, without
    /// passing through the committer task: a quiet store, or a hot conversation whose turns
    /// follow one another, pays no hand-off.
    ///
    /// A queued commit waits for its answer without a timer of its own: the committer answers
    /// it by its deadline, timing the wait for a slot and each statement to the earliest
    /// deadline it serves. A timer per commit, set and cancelled, cost every turn
    /// (`bench/RESULTS.md`).
    pub async fn commit(&self, write: SingleWrite) -> Result<CommitOutcome, StoreError> {
        let shared = &self.shared;
        let queue = self
            .queue
            .get(|receiver, waiting| committer(Arc::clone(shared), receiver, waiting));
        if queue.is_empty()
            && let Ok(_slot) = shared.slots.try_acquire()
        {
            shared.counts.record(1);
            // Boxed: the timer would otherwise move the whole statement's future.
            return within_call_timeout(Box::pin(async {
                let client = client_of(&shared.db.pool).await?;
                commit_alone(&client, shared.db.via(), &write).await
            }))
            .await;
        }
        let (outcome, answer) = oneshot::channel();
        let deadline = Instant::now() + CALL_TIMEOUT;
        if queue
            .send(Queued {
                write,
                outcome,
                deadline,
            })
            .is_err()
        {
            return Err(StoreError::Unavailable(anyhow!(
                "the store's committer task has stopped"
            )));
        }
        // Dropped unanswered only when the runtime shuts down mid-batch: the outcome is unknown,
        // which is what "unavailable" means for a commit.
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(anyhow!(
                "the store's committer task stopped during the commit"
            )))
        })
    }
}

/// Forms batches from the queue and sends each on a lane, until the store is dropped and the
/// queue drained. It waits for a commit, then for a free slot — or, while every slot is taken,
/// for as many commits as the batch running on its last lane holds, which it then sends behind
/// that batch on the same connection. Whatever queued meanwhile joins the batch.
async fn committer(
    shared: Arc<Shared>,
    queue: mpsc::UnboundedReceiver<Queued>,
    waiting: Arc<AtomicUsize>,
) {
    // Behind a pooler in transaction mode, which may hand the connection to another client at
    // the first batch's end, a batch waits for a lane of its own.
    let pipelines = shared.db.statements == Statements::Prepared;
    let mut committer = Committer {
        shared,
        queue,
        waiting,
        held: VecDeque::new(),
        keys: KeySet::default(),
        last: None,
        open: true,
        pipelines,
    };
    while let Some(first) = committer.next_first().await {
        // `first` was queued before everything else pending: its deadline is the earliest.
        let room = match committer.wait_for_room(&first).await {
            Room::Closed => return,
            Room::Late => {
                committer.waiting.fetch_sub(1, Ordering::AcqRel);
                let _ = first.outcome.send(Err(no_answer()));
                continue;
            }
            Room::Lane(lane, behind) => (lane, behind),
        };
        let batch = committer.form_batch(first);
        if !batch.is_empty() {
            committer.dispatch(batch, room);
        }
    }
}

/// Where a batch can go, once [`Committer::wait_for_room`] has waited.
enum Room {
    /// On this lane: a free one, or (`true`) behind the batch running on the last one.
    Lane(Arc<Lane>, bool),
    /// Nowhere before the first commit's deadline: PostgreSQL did not answer.
    Late,
    /// The store is gone.
    Closed,
}

/// The committer task's state between batches.
struct Committer {
    shared: Arc<Shared>,
    queue: mpsc::UnboundedReceiver<Queued>,
    waiting: Arc<AtomicUsize>,
    /// Commits that could not join the previous batch (a key or receipt it already had), and
    /// those taken from the queue while waiting for room.
    held: VecDeque<Queued>,
    /// The keys and receipts of the batch being formed, kept from batch to batch: a set made
    /// anew for each grew its table two or three times per batch (`bench/RESULTS.md`).
    keys: KeySet,
    /// The lane of the batch sent last, and how many commits that batch holds.
    last: Option<(Weak<Lane>, usize)>,
    /// Whether the queue may still bring commits.
    open: bool,
    /// Whether a batch may be sent behind the running one on its connection.
    pipelines: bool,
}

impl Committer {
    /// The next batch's first commit: one held back, else the next queued; `None` once the
    /// queue is closed and drained.
    async fn next_first(&mut self) -> Option<Queued> {
        match self.held.pop_front() {
            Some(first) => Some(first),
            None if self.open => self.queue.recv().await,
            None => None,
        }
    }

    /// Waits for room for a batch: a free slot, or — while every slot is taken — as many
    /// commits as the batch running on the last lane holds, to send behind it; until `first`'s
    /// deadline. Commits queued meanwhile are held for the batch.
    async fn wait_for_room(&mut self, first: &Queued) -> Room {
        loop {
            if let Ok(slot) = Arc::clone(&self.shared.slots).try_acquire_owned() {
                return Room::Lane(Lane::new(slot), false);
            }
            let last_lane =
                self.last
                    .as_ref()
                    .filter(|_| self.pipelines)
                    .and_then(|(lane, size)| {
                        let lane = lane.upgrade()?;
                        let running = lane.batches.load(Ordering::Acquire);
                        Some((lane, running, *size))
                    });
            let wants_more = match &last_lane {
                Some((lane, 1, size)) if self.waiting.load(Ordering::Acquire) >= *size => {
                    return Room::Lane(Arc::clone(lane), true);
                }
                // One batch runs on the last lane: more commits may make the next worth sending
                // behind it.
                Some((_, 1, _)) => self.open,
                _ => false,
            };
            let watches_lane = last_lane.is_some();
            // Not held while waiting: the lane ends with its last batch.
            drop(last_lane);
            tokio::select! {
                biased;
                slot = timeout_at(first.deadline, Arc::clone(&self.shared.slots).acquire_owned()) => {
                    return match slot {
                        Ok(Ok(slot)) => Room::Lane(Lane::new(slot), false),
                        Ok(Err(_closed)) => Room::Closed,
                        // Every slot stayed busy past its time: PostgreSQL did not answer.
                        Err(_elapsed) => Room::Late,
                    };
                }
                () = self.shared.answered.notified(), if watches_lane => {}
                queued = self.queue.recv(), if wants_more => match queued {
                    Some(queued) => self.held.push_back(queued),
                    None => self.open = false,
                },
            }
        }
    }

    /// The batch of `first`, the commits held, and whatever else is queued, up to
    /// [`MAX_BATCH`]: each commit whose key or receipt the batch has already is held for the
    /// next one, and each past its deadline is answered instead.
    fn form_batch(&mut self, first: Queued) -> Vec<Queued> {
        self.keys.clear();
        let expected = 1 + self.held.len() + self.waiting.load(Ordering::Acquire);
        let mut batch = Batch {
            commits: Vec::with_capacity(expected.min(MAX_BATCH)),
            keys: &mut self.keys,
            now: Instant::now(),
            expired: 0,
        };
        let mut next_held = VecDeque::new();
        batch.add_or_hold(first, &mut next_held);
        for queued in self.held.drain(..) {
            batch.add_or_hold(queued, &mut next_held);
        }
        while self.open && batch.len() < MAX_BATCH {
            match self.queue.try_recv() {
                Ok(queued) => batch.add_or_hold(queued, &mut next_held),
                Err(_) => break,
            }
        }
        let expired = batch.expired;
        let batch = batch.commits;
        self.held = next_held;
        self.waiting
            .fetch_sub(batch.len() + expired, Ordering::AcqRel);
        batch
    }

    /// Sends `batch` on its lane (behind the batch running there, when `room` says so), on a
    /// task of its own.
    fn dispatch(&mut self, batch: Vec<Queued>, (lane, behind): (Arc<Lane>, bool)) {
        self.shared.counts.record(batch.len());
        if behind {
            self.shared.counts.pipelined.fetch_add(1, Ordering::Relaxed);
        }
        lane.batches.fetch_add(1, Ordering::AcqRel);
        self.last = Some((Arc::downgrade(&lane), batch.len()));
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move { Batch::run(batch, &shared, lane).await });
    }
}

/// A connection that group-commit batches run on, one statement after another, and the slot it
/// takes. A batch may be sent behind the one running, so that PostgreSQL starts it the moment
/// the first has committed, instead of after a round trip through the server and back.
///
/// It lasts as long as a batch on it: the last one's answer gives the connection back to the
/// pool and the slot back to the committer.
struct Lane {
    client: OnceCell<Object>,
    /// Batches sent on the lane whose statement has not answered yet.
    batches: AtomicUsize,
    _slot: OwnedSemaphorePermit,
}

impl Lane {
    fn new(slot: OwnedSemaphorePermit) -> Arc<Self> {
        Arc::new(Self {
            client: OnceCell::new(),
            batches: AtomicUsize::new(0),
            _slot: slot,
        })
    }

    /// The lane's connection, taken from `pool` by its first batch.
    async fn client(&self, pool: &Pool) -> Result<&ClientWrapper, StoreError> {
        Ok(self.client.get_or_try_init(|| client_of(pool)).await?)
    }

    /// [`commit_alone`] on the lane's connection.
    async fn commit_alone(
        &self,
        db: &Db,
        write: &SingleWrite,
    ) -> Result<CommitOutcome, StoreError> {
        commit_alone(self.client(&db.pool).await?, db.via(), write).await
    }

    /// [`commit_together`] on the lane's connection.
    async fn commit_together(
        &self,
        db: &Db,
        writes: &[&SingleWrite],
    ) -> Result<Together, StoreError> {
        commit_together(self.client(&db.pool).await?, db.via(), writes).await
    }

    /// Puts `commits` in the order the batch's statements take them, and says how many each
    /// statement takes. On a single PostgreSQL, one statement, the commits sorted by key, so that
    /// batches lock rows in one order wherever the plan allows. On Citus, one per node, each
    /// run there whole ([`citus::COMMIT_MANY_IN`]): the commits sorted by the node that holds
    /// their shard, then by key. Without a map of the shards, each commit is a statement of its
    /// own, run where its shard is.
    async fn parts(&self, db: &Db, commits: &mut [Queued]) -> Result<Vec<usize>, StoreError> {
        // Unstable: no two commits of a batch share a key, and it sorts without a buffer.
        commits.sort_unstable_by(|a, b| a.write.key.cmp(&b.write.key));
        if !db.engine.is_citus() {
            return Ok(vec![commits.len()]);
        }
        let Some(map) = db.engine.shard_map(self.client(&db.pool).await?).await else {
            return Ok(vec![1; commits.len()]);
        };
        let node = |queued: &Queued| map.node_of(citus::shard_of(queued.write.key.as_str()));
        // Stable: each node's commits stay sorted by key.
        commits.sort_by_cached_key(node);
        Ok(commits
            .chunk_by(|a, b| node(a).is_some() && node(a) == node(b))
            .map(<[Queued]>::len)
            .collect())
    }
}

/// The keys and receipts of a batch.
type KeySet = HashSet<StateKey, KeyHasher>;

/// Commits bound for one statement, no two on one key or one receipt, while it is formed.
struct Batch<'k> {
    commits: Vec<Queued>,
    keys: &'k mut KeySet,
    /// When the batch is formed: a commit whose deadline has passed is answered, not added.
    now: Instant,
    /// How many commits were answered so.
    expired: usize,
}

impl Batch<'_> {
    fn len(&self) -> usize {
        self.commits.len()
    }

    /// Adds `queued` unless the batch is full or already has its key or receipt; then holds it
    /// for the next one.
    fn add_or_hold(&mut self, queued: Queued, held: &mut VecDeque<Queued>) {
        if queued.deadline <= self.now {
            self.expired += 1;
            let _ = queued.outcome.send(Err(no_answer()));
            return;
        }
        let write = &queued.write;
        let receipt = write.receipt.as_ref().map(|(key, _)| key);
        let clashes =
            self.keys.contains(&write.key) || receipt.is_some_and(|r| self.keys.contains(r));
        if clashes || self.commits.len() >= MAX_BATCH {
            held.push_back(queued);
            return;
        }
        self.keys.insert(write.key.clone());
        if let Some(receipt) = receipt {
            self.keys.insert(receipt.clone());
        }
        self.commits.push(queued);
    }

    /// Runs a formed batch on `lane` and answers every commit in it, each by its deadline.
    ///
    /// The lane is let go as soon as the statements have answered, before the turns are: the
    /// committer, woken by it, then sends the next batch while the turns just answered encode
    /// their replies, instead of after them. Answering first kept the database idle for about
    /// 0.3 ms between batches at 32 calls (`bench/RESULTS.md`).
    async fn run(mut commits: Vec<Queued>, shared: &Shared, lane: Arc<Lane>) {
        let db = &shared.db;
        let answered = |lane: Arc<Lane>| {
            lane.batches.fetch_sub(1, Ordering::AcqRel);
            drop(lane);
            shared.answered.notify_one();
        };
        if commits.len() == 1
            && let Some(only) = commits.pop()
        {
            let outcome = within_deadline(only.deadline, lane.commit_alone(db, &only.write)).await;
            answered(lane);
            let _ = only.outcome.send(outcome);
            return;
        }
        let Some(earliest) = commits.iter().map(|c| c.deadline).min() else {
            answered(lane);
            return;
        };
        let ran = match Self::send(&mut commits, earliest, db, &lane).await {
            Ok(ran) => ran,
            Err(e) => {
                answered(lane);
                // Unavailable, or unexpected, for every commit of the batch, for one cause.
                let failure = BatchFailure::new(e);
                for queued in commits {
                    let _ = queued.outcome.send(Err(failure.error()));
                }
                return;
            }
        };
        let (answers, alone) = Self::sort(commits, ran);
        let answer = |answers: Vec<Answer>| {
            for (queued, outcome) in answers {
                let _ = queued.outcome.send(outcome);
            }
        };
        if alone.is_empty() {
            answered(lane);
            answer(answers);
            return;
        }
        answer(answers);
        for queued in alone {
            let outcome = if queued.deadline <= Instant::now() {
                Err(no_answer())
            } else {
                within_deadline(queued.deadline, lane.commit_alone(db, &queued.write)).await
            };
            let _ = queued.outcome.send(outcome);
        }
        answered(lane);
    }

    /// Sends `commits` on `lane`, one statement per part (see [`Lane::parts`]), all together
    /// on the lane's connection, within `earliest`, the first of their deadlines: each part's
    /// length, and what its statement came to.
    async fn send(
        commits: &mut [Queued],
        earliest: Instant,
        db: &Db,
        lane: &Lane,
    ) -> Result<Vec<PartRan>, StoreError> {
        within_deadline(earliest, async {
            let parts = lane.parts(db, commits).await?;
            let writes: Vec<&SingleWrite> = commits.iter().map(|c| &c.write).collect();
            let mut from = 0;
            // Sent together on the lane's connection: one round trip for every part.
            let statements = parts.iter().map(|&len| {
                let part = &writes[from..from + len];
                from += len;
                lane.commit_together(db, part)
            });
            let together = futures::future::join_all(statements).await;
            Ok(parts.into_iter().zip(together).collect::<Vec<_>>())
        })
        .await
    }

    /// The answers the parts' statements (`ran`) gave `commits`, and the commits of the parts
    /// that failed together, to be committed each alone.
    fn sort(commits: Vec<Queued>, ran: Vec<PartRan>) -> (Vec<Answer>, Vec<Queued>) {
        let mut commits = commits.into_iter();
        let mut answers = Vec::with_capacity(commits.len());
        let mut alone = Vec::new();
        for (len, together) in ran {
            let part = commits.by_ref().take(len);
            match together {
                Ok(Together::Outcomes(outcomes)) => {
                    answers.extend(part.zip(outcomes.into_iter().map(Ok)));
                }
                // One turn's receipt, or a deadlock, failed them all: each alone, to find out
                // whose it was, on the same lane.
                Ok(Together::Failed(_)) => alone.extend(part),
                Err(e) => {
                    let failure = BatchFailure::new(e);
                    answers.extend(part.map(|queued| (queued, Err(failure.error()))));
                }
            }
        }
        (answers, alone)
    }
}

/// A part of a batch: how many commits it has, and what its statement came to.
type PartRan = (usize, Result<Together, StoreError>);
/// A commit and its answer.
type Answer = (Queued, Result<CommitOutcome, StoreError>);

/// What one statement for a whole batch came to.
enum Together {
    /// Each commit's own outcome, in the batch's order.
    Outcomes(Vec<CommitOutcome>),
    /// The statement failed as a whole on a receipt that exists or a deadlock (this error);
    /// nothing applied.
    Failed(tokio_postgres::Error),
}

/// Commits `writes` on `client` by [`WRITE_MANY`], or on Citus by [`citus::COMMIT_MANY_IN`],
/// which the node holding the first write's shard runs (the committer sends together the writes
/// of one node, [`Lane::parts`]).
async fn commit_together(
    client: &ClientWrapper,
    via: Via,
    writes: &[&SingleWrite],
) -> Result<Together, StoreError> {
    let keys: Vec<&str> = writes.iter().map(|w| w.key.as_str()).collect();
    // On Citus every state goes whole: the function on the nodes merges nothing.
    let merge: Vec<bool> = writes.iter().map(|w| !via.citus && merges(w)).collect();
    let states: Vec<Jsonb<'_>> = writes
        .iter()
        .zip(&merge)
        .map(|(w, &merge)| Jsonb(sent_state(w, merge)))
        .collect();
    let expected = writes
        .iter()
        .map(|w| expected_version(w.expected))
        .collect::<Result<Vec<i64>, StoreError>>()?;
    let receipt_keys: Vec<Option<&str>> = writes
        .iter()
        .map(|w| w.receipt.as_ref().map(|(key, _)| key.as_str()))
        .collect();
    let receipts: Vec<Option<Jsonb<'_>>> = writes
        .iter()
        .map(|w| {
            w.receipt
                .as_ref()
                .map(|(_, payload)| Jsonb::text(payload.text()))
        })
        .collect();
    let queried = match keys.first() {
        Some(first) if via.citus => {
            let shard = citus::shard_of(first);
            let params: [&(dyn ToSql + Sync); 6] =
                [&shard, &keys, &states, &expected, &receipt_keys, &receipts];
            citus::COMMIT_MANY_IN.query(client, via, &params).await
        }
        _ => {
            let params: [&(dyn ToSql + Sync); 6] =
                [&keys, &states, &expected, &receipt_keys, &receipts, &merge];
            WRITE_MANY.query(client, via, &params).await
        }
    };
    let rows = match queried {
        Ok(rows) => rows,
        Err(e) if is_conflict(&e) => return Ok(Together::Failed(e)),
        Err(e) => return Err(classify_commit(e, via)),
    };
    let versions = if via.citus {
        delegated_versions(&rows, writes.len())?
    } else {
        written_versions(&rows, writes.len())?
    };
    Ok(Together::Outcomes(
        writes
            .iter()
            .zip(versions)
            .map(|(write, version)| outcome_of(write, version))
            .collect(),
    ))
}

/// The versions [`WRITE_MANY`]'s rows give `count` writes: a row `(ord, version)` for each
/// write that applied.
fn written_versions(rows: &[Row], count: usize) -> Result<Vec<Option<Version>>, StoreError> {
    let mut versions: Vec<Option<Version>> = vec![None; count];
    for row in rows {
        let ord: i64 = row.try_get(0).map_err(unexpected)?;
        let version: i64 = row.try_get(1).map_err(unexpected)?;
        let slot = usize::try_from(ord)
            .ok()
            .and_then(|ord| ord.checked_sub(1))
            .and_then(|i| versions.get_mut(i))
            .ok_or_else(|| StoreError::Unexpected(anyhow!("a batch commit returned row {ord}")))?;
        *slot = Some(stored_version(version)?);
    }
    Ok(versions)
}

/// The versions [`citus::COMMIT_MANY_IN`]'s one row gives `count` writes: an array with each
/// write's version, NULL for one that did not apply.
fn delegated_versions(rows: &[Row], count: usize) -> Result<Vec<Option<Version>>, StoreError> {
    let [row] = rows else {
        return Err(StoreError::Unexpected(anyhow!(
            "turnstile_commit_many_in returned {} rows",
            rows.len()
        )));
    };
    let versions: Vec<Option<i64>> = row.try_get(0).map_err(unexpected)?;
    if versions.len() != count {
        return Err(StoreError::Unexpected(anyhow!(
            "turnstile_commit_many_in returned {} versions for {count} writes",
            versions.len()
        )));
    }
    versions
        .into_iter()
        .map(|version| version.map(stored_version).transpose())
        .collect()
}

/// Commits `write` by itself on `client`, by [`UPDATE_ONE`] or [`CREATE_ONE`]; on Citus, by the
/// batch statement with one write, which the node holding its shard runs. Its own transaction: a
/// deadlock's victim is sent again (`super::deadlock`).
async fn commit_alone(
    client: &ClientWrapper,
    via: Via,
    write: &SingleWrite,
) -> Result<CommitOutcome, StoreError> {
    if via.citus {
        let one = [write];
        let together = deadlock::resending(
            || commit_together(client, via, &one),
            |together| matches!(together, Ok(Together::Failed(e)) if deadlock::is_victim(e)),
        )
        .await;
        return match together? {
            Together::Outcomes(mut outcomes) if outcomes.len() == 1 => Ok(outcomes.remove(0)),
            Together::Outcomes(outcomes) => Err(StoreError::Unexpected(anyhow!(
                "a commit of one write had {} outcomes",
                outcomes.len()
            ))),
            Together::Failed(e) => Ok(CommitOutcome::Conflict {
                key: conflict_key(&e, write).clone(),
            }),
        };
    }
    let key = write.key.as_str();
    let merge = merges(write);
    let state = Jsonb(sent_state(write, merge));
    let receipt_key = write.receipt.as_ref().map(|(key, _)| key.as_str());
    let receipt = write
        .receipt
        .as_ref()
        .map(|(_, payload)| Jsonb::text(payload.text()));
    let expected = expected_version(write.expected)?;
    let (statement, params): (&Sql, [&(dyn ToSql + Sync); 5]) = match write.expected {
        Expected::Absent | Expected::Gone(_) => (
            &CREATE_ONE,
            [&key, &state, &receipt_key, &receipt, &expected],
        ),
        Expected::Version(_) => (
            if merge { &MERGE_ONE } else { &UPDATE_ONE },
            [&key, &state, &expected, &receipt_key, &receipt],
        ),
    };
    let rows = deadlock::resending(
        || statement.query(client, via, &params),
        |rows| matches!(rows, Err(e) if deadlock::is_victim(e)),
    )
    .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) if is_conflict(&e) => {
            return Ok(CommitOutcome::Conflict {
                key: conflict_key(&e, write).clone(),
            });
        }
        Err(e) => return Err(classify_commit(e, via)),
    };
    let version = match rows.first() {
        Some(row) => Some(stored_version(row.try_get(0).map_err(unexpected)?)?),
        None => None,
    };
    Ok(outcome_of(write, version))
}

/// Whether `write` is sent as the properties its turn changed, to merge over the row it read:
/// an update that has them ([`StateWrite::changed_json`]); a create writes its state whole.
fn merges(write: &SingleWrite) -> bool {
    matches!(write.expected, Expected::Version(_)) && write.state.changed_json().is_some()
}

/// The JSON text `write` sends: its changed properties when it `merge`s ([`merges`]), else its
/// state.
fn sent_state(write: &SingleWrite, merge: bool) -> &[u8] {
    match write.state.changed_json() {
        Some(changed) if merge => changed,
        _ => write.state.json(),
    }
}

/// The key a commit of `write` that failed with `e` conflicted on: its receipt when that exists
/// already (or `e`'s DETAIL names it, as `turnstile_commit` raises it on Citus), else its key.
fn conflict_key<'w>(e: &tokio_postgres::Error, write: &'w SingleWrite) -> &'w StateKey {
    let detail = e.as_db_error().and_then(|db| db.detail());
    match &write.receipt {
        Some((receipt, _)) if detail == Some(receipt.as_str()) => receipt,
        _ => taken_receipt(e, write.receipt.as_ref()).unwrap_or(&write.key),
    }
}

/// The outcome of `write`, given the version its key has now if the write applied.
fn outcome_of(write: &SingleWrite, version: Option<Version>) -> CommitOutcome {
    match version {
        Some(version) => {
            CommitOutcome::Committed(std::iter::once((write.key.clone(), version)).collect())
        }
        None => CommitOutcome::Conflict {
            key: write.key.clone(),
        },
    }
}

/// A version as the statements return it.
fn stored_version(version: i64) -> Result<Version, StoreError> {
    u64::try_from(version)
        .map(Version::new)
        .map_err(|e| StoreError::Unexpected(e.into()))
}

/// The version a write expects, as the statements take it ([`super::expected_param`]).
fn expected_version(expected: Expected) -> Result<i64, StoreError> {
    super::expected_param(expected)
}
