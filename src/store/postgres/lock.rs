//! The conversation lock: a queue for one conversation's turns across replicas, kept by
//! PostgreSQL itself.
//!
//! A locked turn opens a transaction on one pooled connection and locks its conversation's
//! lock table in it, `LOCK TABLE turnstile_lock_NNNN IN EXCLUSIVE MODE` ([`lock_table`]). It
//! loads, runs its bot and commits inside that transaction, and the lock ends with it. So the
//! replicas' locked turns of one conversation wait for each other in the database, in the
//! order they asked, instead of running the bot on state that is about to move and replaying.
//!
//! Why this lock: it exists before the conversation has a row (its first turns are the ones most
//! often sent at once), and being transaction-scoped it ends with the transaction: on commit, on
//! rollback, and when the session dies with a replica, as soon as PostgreSQL sees the connection
//! close. Why a table's lock rather than an advisory lock on the key: a session waiting in
//! `pg_advisory_lock` runs a statement, so it holds a snapshot for all of its wait, and no row
//! version newer than the wait's start can be pruned. A hot conversation always has someone
//! waiting, so its row, which the holder updates turn after turn, bloated (one row reached 1,700
//! pages in 16,000 turns, and one update in seven was no longer HOT). `LOCK TABLE` waits without
//! a snapshot once the session has looked the table up, which the transaction's start does in a
//! message of its own, so a waiter holds nothing back (but for a wait right after the session's
//! caches were reset by a flood of catalog changes elsewhere, which looks the table up again and
//! holds a catalog snapshot for that wait). The
//! migrations create 1,024 such tables; two conversations that hash to the same one, contended
//! at the same moment, wait for each other as two turns of one would.
//!
//! The load under the lock also locks the conversation's row (`FOR UPDATE`), so that a turn of
//! another replica that did not take the lock (its optimistic first attempt) cannot commit in
//! between: its commit waits for this transaction and then conflicts, and it is that turn, not
//! this one, that runs again, under the lock. A turn holding the lock therefore commits on its
//! first try unless another scope it read (the user's, shared with the user's other
//! conversations) moved, or the conversation's first row appeared meanwhile. The price: a
//! group commit that carries such a losing write waits for the holder's bot; a replica sends a
//! conversation's turns to the lock for a few seconds after a conflict, so that is rare.
//!
//! Two round trips, and the conversation is held for about one of them: the transaction's start,
//! the lock and the load are sent together (the start and the lock as two messages, see
//! [`hold`]), and so are the commit and `COMMIT`. PostgreSQL runs
//! each batch in order, so the load runs the moment the lock is granted and the lock ends the
//! moment the commit has run; what the holder adds is the time its answers take to travel and
//! its bot's run. (Sent one at a time, as five round trips, the holder kept the conversation for
//! two and a half of them.)
//!
//! **Leases.** What still separates that queue from one replica's own, where a turn costs one
//! statement and hands over to the next without leaving the process, is the database's work per
//! locked turn: seven statements and a lock hand-over between backends, three times what an
//! ordinary turn costs PostgreSQL (`bench/RESULTS.md`). So a replica whose own queue holds more
//! turns of a contended conversation takes the lock for several of them: a lease. It is the same
//! transaction and lock, with the load not locking the row, kept open — idle, holding no
//! snapshot — on a connection the lease keeps out of the pool. The holder's turns meanwhile are
//! ordinary ones (a guess from its cache and the group commit), and every other replica's locked
//! turn or lease waits. The lease's last turn commits inside the lease's transaction
//! ([`Lease::into_last_turn`]): its commit and `COMMIT` go together, so the next holder is let in
//! the moment that commit lands, with no round trip of its own. A lease dropped without a last
//! turn rolls back. Only with prepared statements: behind a transaction-mode pooler the store
//! offers none (not measured there yet), and turns lock one by one.
//!
//! The wait is bounded by the turn's deadline (`lock_timeout`; the transaction's statement
//! timeout is raised past it, or a slow bot's lock would end every wait at 8 s); a lock not
//! granted in time (SQLSTATE 55P03, or 57014 from a role's own statement timeout) is an ordinary
//! outcome, [`ConversationLock::NotGranted`]. A replica alive but stuck while holding the lock
//! is cut off by `idle_in_transaction_session_timeout`, during a turn and between a lease's.

use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use async_trait::async_trait;
use tokio_postgres::SimpleQueryMessage;
use tokio_postgres::error::SqlState;

use super::timeouts::{CALL_TIMEOUT, STATEMENT_TIMEOUT, within_call_timeout};
use super::{CommitBy, PostgresStore, Statements, Via, classify, classify_commit};
use crate::state::StateKey;
use crate::store::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, Lease, LockedTurn, Snapshot,
    StoreError,
};

/// How many lock tables `migrations/V2__conversation_locks.sql` creates.
const LOCK_TABLES: u64 = 1024;

/// How long past its lock wait a transaction holding a conversation may sit idle (its bot
/// running, or between a lease's turns) before PostgreSQL ends the session: a holder moves on
/// within milliseconds, so only a replica that stopped without dying gets there.
const HOLD_GRACE: Duration = Duration::from_secs(30);

/// The table whose lock stands for `conversation`'s (see the module's docs), the same on every
/// replica: FNV-1a of the key, a fixed function, so that replicas of different builds agree.
/// Changing it, or [`LOCK_TABLES`], is a change that every replica must take at once.
#[must_use]
pub fn lock_table(conversation: &StateKey) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in conversation.as_str().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("turnstile_lock_{:04}", hash % LOCK_TABLES)
}

/// Locks `conversation` in a new transaction on a connection of `store`'s pool, and loads
/// `keys` and `receipt` under the lock, the conversation's row locked too.
///
/// The transaction's start, the lock and the load go to PostgreSQL together, in one round trip:
/// it runs them in order, so the load runs the moment the lock is granted, and the conversation
/// is held for the time it takes the answer to reach the turn rather than for another round
/// trip.
pub(super) async fn lock_conversation(
    store: &PostgresStore,
    conversation: &StateKey,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
    wait: Duration,
) -> Result<ConversationLock, StoreError> {
    Ok(
        match hold(store, None, conversation, keys, receipt, wait).await? {
            Held::Granted { snapshot, turn, .. } => ConversationLock::Held { snapshot, turn },
            Held::NotGranted => ConversationLock::NotGranted,
        },
    )
}

/// Leases `conversation` to this replica: the lock of [`lock_conversation`], in a transaction
/// kept open on a connection that the lease keeps out of the pool until it ends, with `keys` and
/// `receipt` loaded under it (the row not locked: the holder's turns commit as any other).
///
/// Only with prepared statements: behind a transaction-mode pooler (`Statements::Unprepared`)
/// the store offers no lease.
pub(super) async fn lease_conversation(
    store: &PostgresStore,
    conversation: &StateKey,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
    wait: Duration,
) -> Result<ConversationLease, StoreError> {
    if store.statements == Statements::Unprepared {
        return Ok(ConversationLease::NotOffered);
    }
    // Half the pool at most, else a leased conversation's next turn could find no connection to
    // commit on: beyond that, turns lock one by one, each on one connection.
    let Some(slot) = store.leases.take() else {
        return Ok(ConversationLease::NotOffered);
    };
    Ok(
        match hold(store, Some(slot), conversation, keys, receipt, wait).await? {
            Held::Granted {
                snapshot,
                turn,
                waited,
            } => ConversationLease::Held {
                lease: Lease::new(turn),
                snapshot,
                waited,
            },
            Held::NotGranted => ConversationLease::NotGranted,
        },
    )
}

/// How many connections leases keep out of the pool, against a limit; clones count together.
#[derive(Debug, Clone)]
pub(super) struct LeaseSlots {
    taken: Arc<std::sync::atomic::AtomicUsize>,
    limit: usize,
}

impl LeaseSlots {
    /// At most `limit` leases at once.
    pub(super) fn new(limit: usize) -> Self {
        Self {
            taken: Arc::default(),
            limit,
        }
    }

    /// A slot for one more lease, if the limit allows.
    fn take(&self) -> Option<LeaseSlot> {
        use std::sync::atomic::Ordering;
        let taken = self
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            });
        taken.ok().map(|_| LeaseSlot(Arc::clone(&self.taken)))
    }
}

/// One lease's place among [`LeaseSlots`], given back when dropped.
struct LeaseSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for LeaseSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// What [`hold`] got.
enum Held {
    Granted {
        snapshot: Snapshot,
        /// The transaction holding the conversation.
        turn: Box<PgLockedTurn>,
        /// Whether the lock took more than a moment to come: another holder had it.
        waited: bool,
    },
    NotGranted,
}

/// Whether the statement that asks it took more than a moment since its message arrived: sent
/// after `LOCK TABLE` in one message, whether the lock was waited for (an uncontended one comes
/// within microseconds, once the session has the table and this expression in its caches).
const WAITED: &str = "clock_timestamp() - statement_timestamp() > interval '1 millisecond'";

/// Opens a transaction on a pooled connection, locks `conversation` in it and loads `keys` and
/// `receipt` under the lock, all in one round trip: for a lease (`lease`, its place among the
/// store's), without locking the row; for one turn, with.
async fn hold(
    store: &PostgresStore,
    lease: Option<LeaseSlot>,
    conversation: &StateKey,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
    wait: Duration,
) -> Result<Held, StoreError> {
    let asked = std::time::Instant::now();
    let client = store.client().await?;
    let via = store.via();
    let (load, holding) = match lease {
        None => (super::load_of(keys.len(), true), Some(conversation)),
        Some(_) => (super::load_of(keys.len(), false), None),
    };
    // Prepared before anything is sent (at once when the connection has it), so that the
    // requests below leave in the order they are written.
    within_call_timeout(async { load.ready(&client, via).await.map_err(classify) }).await?;
    // The wait for a pooled connection counts against the wait allowed.
    let wait = wait.saturating_sub(asked.elapsed());
    // Whole milliseconds, at least one: 0 would mean "wait forever".
    let wait_ms = wait.as_millis().clamp(1, u128::from(u32::MAX));
    let hold_ms = (wait + HOLD_GRACE).as_millis().min(u128::from(u32::MAX));
    // The statement timeout must not end the wait first (it would end a wait the deadline allows
    // at 8 s): within this transaction it is the wait plus the usual limit.
    let statement_ms = (wait + STATEMENT_TIMEOUT)
        .as_millis()
        .min(u128::from(u32::MAX));
    // Numbers and the table's name only in these texts, so that each can go as one simple query,
    // which a transaction-mode pooler passes through like any other.
    //
    // The transaction's start is a message of its own, which also looks the lock table up as
    // `LOCK TABLE` will (its name and the role's privileges on it) and plans the question the
    // lock's message ends with. A session new to the table would otherwise read the catalog
    // inside `LOCK TABLE` and wait holding that catalog snapshot, and with it the pruning of
    // every row version newer than it; between messages PostgreSQL lets it go. And the lock's
    // last statement, asked of its own message's arrival, then measures the lock alone: on a new
    // session the first lock, planning and all, took 0.5–1.4 ms from the transaction's start
    // uncontended, and counted as waited for.
    //
    // The idle limit comes after the load, and as a simple query for a reason: the load's
    // portal, which holds its snapshot — and with it the pruning of every row version newer than
    // the snapshot — until the session's next statement, goes with it, so that a lease sits idle
    // holding nothing back.
    let table = lock_table(conversation);
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = {wait_ms}; \
         SET LOCAL statement_timeout = {statement_ms}; \
         SELECT has_table_privilege('{table}', 'UPDATE'), {WAITED}"
    );
    let lock = format!("LOCK TABLE {table} IN EXCLUSIVE MODE; SELECT {WAITED}");
    let idle_limit = format!("SET LOCAL idle_in_transaction_session_timeout = {hold_ms}");
    let turn = Box::new(PgLockedTurn {
        client: Some(client),
        via,
        lease,
    });
    let client = turn.client()?;
    // `join!` polls in the order written, and each request is sent when first polled.
    let answered = tokio::time::timeout(wait + CALL_TIMEOUT, async {
        futures::join!(
            client.batch_execute(&begin),
            client.simple_query(&lock),
            PostgresStore::load_on(client, via, keys, receipt, holding, &store.ttls),
            client.batch_execute(&idle_limit),
        )
    })
    .await;
    let Ok((begun, locked, loaded, limited)) = answered else {
        // Dropping `turn` rolls back.
        return Err(StoreError::Unavailable(anyhow!(
            "no answer from PostgreSQL within {:?} of asking for a conversation lock",
            wait + CALL_TIMEOUT
        )));
    };
    // A lock after a start that failed fails too: the start's error says what happened.
    held(turn, begun.and(locked), loaded, limited).await
}

/// What the lock's answers came to: the transaction's start and the lock (`locked`, whose last
/// row says whether the lock was waited for), the load under it, and the idle limit.
async fn held(
    turn: Box<PgLockedTurn>,
    locked: Result<Vec<SimpleQueryMessage>, tokio_postgres::Error>,
    loaded: Result<Snapshot, StoreError>,
    limited: Result<(), tokio_postgres::Error>,
) -> Result<Held, StoreError> {
    match locked {
        Ok(answer) => {
            let waited = answer.iter().any(|message| {
                matches!(message, SimpleQueryMessage::Row(row) if row.get(0) == Some("t"))
            });
            // A load after a lock not granted fails too, as the transaction has: the lock's
            // error is the one that says what happened.
            let snapshot = loaded?;
            limited.map_err(classify)?;
            Ok(Held::Granted {
                snapshot,
                turn,
                waited,
            })
        }
        Err(e) if not_granted(&e) => {
            // Nothing held: the connection goes back to the pool.
            turn.release().await;
            Ok(Held::NotGranted)
        }
        // Dropping `turn` rolls back.
        Err(e) => Err(classify(e)),
    }
}

/// Whether `e` ended a lock wait: `lock_timeout` (55P03) or a statement timeout (57014).
fn not_granted(e: &tokio_postgres::Error) -> bool {
    e.code()
        .is_some_and(|c| *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::QUERY_CANCELED)
}

/// A transaction holding a conversation lock, for one turn or a lease, on a connection taken from
/// the pool. Dropped before it committed or released, it rolls back on a task of its own before
/// the connection returns to the pool.
struct PgLockedTurn {
    /// `None` once the transaction has ended.
    client: Option<deadpool_postgres::Object>,
    via: Via,
    /// A lease's place among the store's leases, given back with the connection.
    lease: Option<LeaseSlot>,
}

impl PgLockedTurn {
    fn client(&self) -> Result<&deadpool_postgres::Object, StoreError> {
        self.client
            .as_ref()
            .ok_or_else(|| StoreError::Unexpected(anyhow!("the locked turn has ended")))
    }

    /// Ends the transaction with `end` (`COMMIT` or `ROLLBACK`).
    async fn end(&mut self, end: &str) -> Result<(), StoreError> {
        let Some(client) = self.client.as_ref() else {
            return Ok(());
        };
        let ended =
            within_call_timeout(async { client.batch_execute(end).await.map_err(classify) }).await;
        self.ended(ended)
    }

    /// Gives the connection back to the pool once its transaction ended, as `ended` says. A
    /// connection on which ending it failed is closed instead: its session may still be in the
    /// transaction.
    fn ended(&mut self, ended: Result<(), StoreError>) -> Result<(), StoreError> {
        if let Some(client) = self.client.take() {
            if ended.is_err() {
                drop(deadpool_postgres::Object::take(client));
            }
        }
        ended
    }
}

#[async_trait]
impl LockedTurn for PgLockedTurn {
    /// The commit and `COMMIT` go together, in one round trip. After a conflict (nothing
    /// written) or an error (the transaction failed, so `COMMIT` rolls back) the `COMMIT` ends
    /// the transaction just as a `ROLLBACK` would.
    async fn commit(mut self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let client = self.client()?;
        let via = self.via;
        let answered = within_call_timeout(async {
            // Prepared first, so that it leaves before the `COMMIT`: prepared as part of the
            // query, it would leave after, and run on its own once the transaction, and the lock
            // with it, had ended.
            CommitBy::of(via, &commit)
                .statement()
                .ready(client, via)
                .await
                .map_err(classify)?;
            Ok(futures::join!(
                PostgresStore::commit_on(client, via, &commit),
                client.batch_execute("COMMIT"),
            ))
        })
        .await;
        let (outcome, ended) = match answered {
            Ok(answers) => answers,
            // Dropping `self` rolls back, or closes the connection.
            Err(e) => return Err(e),
        };
        let ended = self.ended(ended.map_err(|e| classify_commit(e, via)));
        match outcome {
            // Until COMMIT answered, the outcome was unknown: its failure is `Unavailable`,
            // which the engine resolves through the receipt.
            Ok(CommitOutcome::Committed(versions)) => {
                ended.map(|()| CommitOutcome::Committed(versions))
            }
            other => other,
        }
    }

    async fn release(mut self: Box<Self>) {
        if let Err(e) = self.end("ROLLBACK").await {
            tracing::debug!(error = %e, "releasing a conversation lock failed; connection dropped");
        }
    }
}

impl Drop for PgLockedTurn {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        // A lease's place is free again at once; its connection goes back after the rollback.
        self.lease.take();
        // Dropped mid-turn (the call was cancelled, an error cut the turn short, or a lease ended
        // without a last turn): roll back before the connection serves anyone else. Without a
        // runtime to do that on, the connection is closed instead, which ends the transaction
        // just the same.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if client.batch_execute("ROLLBACK").await.is_err() {
                        drop(deadpool_postgres::Object::take(client));
                    }
                });
            }
            Err(_) => drop(deadpool_postgres::Object::take(client)),
        }
    }
}
