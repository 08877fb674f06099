//! The conversation lock: a queue for one conversation's turns across replicas, kept by
//! PostgreSQL itself.
//!
//! A serialized turn opens a transaction on one pooled connection and takes a transaction-scoped
//! advisory lock on its conversation key, `pg_advisory_xact_lock(hashtextextended(key, 0))`. It
//! loads, runs its bot and commits inside that transaction, and the lock ends with it. So the
//! replicas' serialized turns of one conversation wait for each other in the database, in the
//! order they asked, instead of running the bot on state that is about to move and replaying.
//!
//! Why this lock: it exists before the conversation has a row (its first turns are the ones most
//! often sent at once), and being transaction-scoped it works through PgBouncer in transaction
//! mode, where a session lock would stay with whichever client the pooler hands the server
//! connection to next. It ends with the transaction: on commit, on rollback, and when the session
//! dies with a replica, as soon as PostgreSQL sees the connection close.
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
//! the lock and the load are sent together, and so are the commit and `COMMIT`. PostgreSQL runs
//! each batch in order, so the load runs the moment the lock is granted and the lock ends the
//! moment the commit has run; what the holder adds is the time its answers take to travel and
//! its bot's run. (Sent one at a time, as five round trips, the holder kept the conversation for
//! two and a half of them.)
//!
//! **Leases.** What still separates that queue from one replica's own, where a turn costs one
//! statement and hands over to the next without leaving the process, is the database's work per
//! locked turn: seven statements and a lock hand-over between backends, three times what an
//! ordinary turn costs PostgreSQL (`bench/RESULTS.md`). So a replica whose own queue holds more
//! turns of a contended conversation takes the lock for all of them at once: a lease. It is the
//! same round trip as above with a *session* lock, `pg_advisory_lock`, in place of the
//! transaction's; the first turn commits under it as above, and the lock then stays with the
//! session, whose connection the lease keeps out of the pool. The holder's next turns are
//! ordinary ones (a guess from its cache and the group commit), and every other replica's
//! locked turn or lease waits. Dropping the lease runs `pg_advisory_unlock_all()` before the
//! connection goes back to the pool (or closes it). Only with prepared statements: behind a
//! transaction-mode pooler a session lock would stay with whichever client the pooler lends the
//! server connection to next, so there the store offers none, and turns lock one by one.
//!
//! The wait is bounded by the turn's deadline (`lock_timeout`); a lock not granted in time
//! (SQLSTATE 55P03, or 57014 when the statement timeout ends the wait first) is an ordinary
//! outcome, [`ConversationLock::NotGranted`]. A replica alive but stuck while holding the lock
//! is cut off by `idle_in_transaction_session_timeout` during a turn, and, between two turns of
//! a lease, by `idle_session_timeout`, set on the leased session only (PostgreSQL 14 or later).

use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use async_trait::async_trait;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::{
    CALL_TIMEOUT, COMMIT, LOAD, LOAD_HOLDING, PostgresStore, Sql, Statements, classify,
    within_call_timeout,
};
use crate::state::StateKey;
use crate::store::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, Lease, LockedTurn, StoreError,
};

/// Waits until this transaction holds the conversation, or `lock_timeout` ends the wait.
const LOCK: Sql = Sql {
    text: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
    types: &[Type::TEXT],
};

/// Waits until this session holds the conversation, or `lock_timeout` ends the wait; answers
/// whether it had to wait (another holder had it). A session lock: it outlasts the transaction
/// it was taken in, until `pg_advisory_unlock_all()` or the session's end.
const LEASE: Sql = Sql {
    text: "SELECT CASE WHEN pg_try_advisory_lock(hashtextextended($1, 0)) THEN false \
           ELSE (SELECT true FROM pg_advisory_lock(hashtextextended($1, 0))) END",
    types: &[Type::TEXT],
};

/// Ends a lease: its lock, and the session's time limit that came with it.
const UNLEASE: &str = "SELECT pg_advisory_unlock_all(); RESET idle_session_timeout";

/// How long a leased session may sit idle between its holder's turns before PostgreSQL ends it:
/// a holder hands its conversation to its next turn within microseconds, so only a replica that
/// stopped without dying gets there.
const LEASE_IDLE_LIMIT: Duration = Duration::from_secs(30);

/// How long past its lock wait a turn may hold the lock idle (its bot running) before
/// PostgreSQL ends the session: only a replica that stopped without dying gets there.
const HOLD_GRACE: Duration = Duration::from_secs(30);

/// Locks `conversation` in a new transaction on a connection of `store`'s pool, and loads
/// `keys` and `receipt` under the lock.
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
        match hold(store, Hold::Turn, conversation, keys, receipt, wait).await? {
            Held::Granted {
                snapshot,
                turn: Some(turn),
                ..
            } => ConversationLock::Held { snapshot, turn },
            Held::Granted { turn: None, .. } => {
                return Err(StoreError::Unexpected(anyhow!(
                    "a conversation lock came without its turn"
                )));
            }
            Held::NotGranted => ConversationLock::NotGranted,
        },
    )
}

/// Leases `conversation` to this replica on a connection of `store`'s pool, which the lease
/// keeps out of the pool until it ends: a session lock, taken in the transaction of the lease's
/// first turn, with that turn's load (`FOR UPDATE`) in the same round trip, as in
/// [`lock_conversation`].
///
/// Only with prepared statements: behind a transaction-mode pooler (`Statements::Unprepared`)
/// a session lock would stay with whichever client the pooler lends the server connection to
/// next, so there the store offers no lease.
pub(super) async fn lease_conversation(
    store: &PostgresStore,
    conversation: &StateKey,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
    wait: Duration,
    rows: bool,
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
        match hold(
            store,
            Hold::Lease { slot, rows },
            conversation,
            keys,
            receipt,
            wait,
        )
        .await?
        {
            Held::Granted {
                snapshot,
                turn,
                home,
                waited,
            } => ConversationLease::Held {
                lease: Lease::new(LeaseGuard { _home: home }),
                snapshot,
                turn,
                waited,
            },
            Held::NotGranted => ConversationLease::NotGranted,
        },
    )
}

/// What [`hold`] takes.
enum Hold {
    /// The conversation for one turn (a transaction lock).
    Turn,
    /// The conversation for a lease (a session lock), in this slot; with `rows`, for its first
    /// turn also the conversation's row, as [`Hold::Turn`] does.
    Lease { slot: LeaseSlot, rows: bool },
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
        snapshot: crate::store::Snapshot,
        /// The turn holding the conversation's row: always for [`Hold::Turn`], for a lease
        /// only when asked.
        turn: Option<Box<dyn LockedTurn>>,
        /// The lease's connection, once its first turn has ended (always set for a lease).
        home: Arc<LeaseHome>,
        /// Whether another holder had the conversation when asked (leases only).
        waited: bool,
    },
    NotGranted,
}

/// Opens a transaction on a pooled connection, takes `how`'s lock on `conversation` in it and
/// loads `keys` and `receipt` under the lock, all in one round trip.
async fn hold(
    store: &PostgresStore,
    how: Hold,
    conversation: &StateKey,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
    wait: Duration,
) -> Result<Held, StoreError> {
    let asked = std::time::Instant::now();
    let client = store.client().await?;
    let statements = store.statements;
    let (lock, rows) = match how {
        Hold::Turn => (LOCK, true),
        Hold::Lease { rows, .. } => (LEASE, rows),
    };
    let load = if rows { LOAD_HOLDING } else { LOAD };
    // Prepared before anything is sent (at once when the connection has them), so that the
    // requests below leave in the order they are written.
    within_call_timeout(async {
        lock.ready(&client, statements).await.map_err(classify)?;
        load.ready(&client, statements).await.map_err(classify)
    })
    .await?;
    // The wait for a pooled connection counts against the wait allowed.
    let wait = wait.saturating_sub(asked.elapsed());
    // Whole milliseconds, at least one: 0 would mean "wait forever".
    let wait_ms = wait.as_millis().clamp(1, u128::from(u32::MAX));
    let hold_ms = (wait + HOLD_GRACE).as_millis().min(u128::from(u32::MAX));
    // Numbers only in this text, so it can go as one simple query, which a transaction-mode
    // pooler passes through like any other. A lease's session limit outlasts the transaction
    // (`SET`, not `SET LOCAL`), as its lock does, until the lease ends (`UNLEASE`).
    let idle_limit = match how {
        Hold::Turn => String::new(),
        Hold::Lease { .. } => format!(
            "; SET idle_session_timeout = {}",
            LEASE_IDLE_LIMIT.as_millis()
        ),
    };
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = {wait_ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {hold_ms}{idle_limit}"
    );
    let leased = matches!(how, Hold::Lease { .. });
    let home = Arc::new(LeaseHome {
        client: std::sync::Mutex::default(),
        _slot: match how {
            Hold::Turn => None,
            Hold::Lease { slot, .. } => Some(slot),
        },
    });
    let mut turn = PgLockedTurn {
        client: Some(client),
        statements,
        home: leased.then(|| Arc::clone(&home)),
    };
    let key = conversation.as_str();
    let params: [&(dyn ToSql + Sync); 1] = [&key];
    let client = turn.client()?;
    // `join!` polls in the order written, and each request is sent when first polled. Without
    // `rows`, the transaction ends with the lock taken, and the load runs after it, unlocked.
    let answered = tokio::time::timeout(wait + CALL_TIMEOUT, async {
        if rows {
            let (began, locked, loaded) = futures::join!(
                client.batch_execute(&begin),
                lock.query(client, statements, &params),
                PostgresStore::load_on(client, statements, keys, receipt, Some(conversation)),
            );
            (began, locked, Ok(()), loaded)
        } else {
            futures::join!(
                client.batch_execute(&begin),
                lock.query(client, statements, &params),
                client.batch_execute("COMMIT"),
                PostgresStore::load_on(client, statements, keys, receipt, None),
            )
        }
    })
    .await;
    let Ok((began, locked, ended, loaded)) = answered else {
        // Dropping `turn` rolls back.
        return Err(StoreError::Unavailable(anyhow!(
            "no answer from PostgreSQL within {:?} of asking for a conversation lock",
            wait + CALL_TIMEOUT
        )));
    };
    began.map_err(classify)?;
    match locked {
        Ok(answer) => {
            let waited = leased
                && answer
                    .first()
                    .map(|row| row.try_get::<_, bool>(0))
                    .transpose()
                    .map_err(super::unexpected)?
                    .unwrap_or(false);
            // A load after a lock not granted fails too, as the transaction has: the lock's
            // error is the one that says what happened.
            let snapshot = loaded?;
            let turn: Option<Box<dyn LockedTurn>> = if rows {
                Some(Box::new(turn))
            } else {
                // The lease's connection, its transaction over, goes to the lease.
                turn.ended(ended.map_err(classify))?;
                None
            };
            Ok(Held::Granted {
                snapshot,
                turn,
                home,
                waited,
            })
        }
        Err(e) if not_granted(&e) => {
            // No lock to end: the connection goes back to the pool.
            turn.home = None;
            Box::new(turn).release().await;
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

/// A transaction holding a conversation lock, on a connection taken from the pool. Dropped before
/// it committed or released, it rolls back on a task of its own before the connection returns
/// to the pool.
struct PgLockedTurn {
    /// `None` once the transaction has ended.
    client: Option<deadpool_postgres::Object>,
    statements: Statements,
    /// Where the connection goes once the transaction ended, for a lease's first turn: it stays
    /// out of the pool, holding the lease. `None`: back to the pool.
    home: Option<Arc<LeaseHome>>,
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

    /// Gives the connection back (to the pool, or to its lease) once its transaction ended, as
    /// `ended` says. A connection on which ending it failed is closed instead: its session may
    /// still be in the transaction (a lease on it ends with it).
    fn ended(&mut self, ended: Result<(), StoreError>) -> Result<(), StoreError> {
        let Some(client) = self.client.take() else {
            return ended;
        };
        match (&ended, &self.home) {
            (Err(_), _) => drop(deadpool_postgres::Object::take(client)),
            (Ok(()), Some(home)) => home.keep(client),
            (Ok(()), None) => drop(client),
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
        let statements = self.statements;
        let answered = within_call_timeout(async {
            // Prepared first, so that it leaves before the `COMMIT`.
            COMMIT.ready(client, statements).await.map_err(classify)?;
            Ok(futures::join!(
                PostgresStore::commit_on(client, statements, &commit),
                client.batch_execute("COMMIT"),
            ))
        })
        .await;
        let (outcome, ended) = match answered {
            Ok(answers) => answers,
            // Dropping `self` rolls back, or closes the connection.
            Err(e) => return Err(e),
        };
        let ended = self.ended(ended.map_err(classify));
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
        let home = self.home.take();
        // Dropped mid-turn (the call was cancelled, or an error cut the turn short): roll back
        // before the connection serves anyone else. Without a runtime to do that on, the
        // connection is closed instead, which ends the transaction just the same.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    match (client.batch_execute("ROLLBACK").await, home) {
                        (Err(_), _) => drop(deadpool_postgres::Object::take(client)),
                        (Ok(()), Some(home)) => home.keep(client),
                        (Ok(()), None) => drop(client),
                    }
                });
            }
            Err(_) => drop(deadpool_postgres::Object::take(client)),
        }
    }
}

/// A lease's connection between its first turn's end and the lease's: it holds the session lock,
/// so it must not go back to the pool before [`UNLEASE`] ran on it. Whoever lets go of this
/// last — the lease, or a first turn that outlived it — ends the lease.
struct LeaseHome {
    client: std::sync::Mutex<Option<deadpool_postgres::Object>>,
    /// The lease's place among the store's, given back with this.
    _slot: Option<LeaseSlot>,
}

impl LeaseHome {
    /// Keeps the lease's connection, its first turn over.
    fn keep(&self, client: deadpool_postgres::Object) {
        *self
            .client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(client);
    }
}

impl Drop for LeaseHome {
    fn drop(&mut self) {
        let client = self
            .client
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(client) = client else {
            // Never granted, or its connection failed: no lock is left on any session.
            return;
        };
        // Unlocked before the connection serves anyone else; a connection that cannot say so, or
        // that has no runtime to say it on, is closed, which ends the lock just the same.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if let Err(e) = client.batch_execute(UNLEASE).await {
                        tracing::debug!(error = %e, "ending a conversation lease failed; connection dropped");
                        drop(deadpool_postgres::Object::take(client));
                    }
                });
            }
            Err(_) => drop(deadpool_postgres::Object::take(client)),
        }
    }
}

/// What the holder of a lease keeps: the lease ends when the last of it and its first turn goes.
struct LeaseGuard {
    _home: Arc<LeaseHome>,
}
