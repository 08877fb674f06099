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
//! two and a half of them.) What still separates this queue from one replica's own, where a
//! turn costs one statement and hands over to the next without leaving the process, is the
//! database's work per locked turn (seven statements and a lock hand-over between backends):
//! `bench/RESULTS.md` measures both.
//!
//! The wait is bounded by the turn's deadline (`lock_timeout`); a lock not granted in time
//! (SQLSTATE 55P03, or 57014 when the statement timeout ends the wait first) is an ordinary
//! outcome, [`ConversationLock::NotGranted`]. A replica alive but stuck while holding the lock
//! is cut off by `idle_in_transaction_session_timeout`.

use std::time::Duration;

use anyhow::anyhow;
use async_trait::async_trait;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::{
    CALL_TIMEOUT, COMMIT, LOAD_HOLDING, PostgresStore, Sql, Statements, classify,
    within_call_timeout,
};
use crate::state::StateKey;
use crate::store::{Commit, CommitOutcome, ConversationLock, LockedTurn, StoreError};

/// Waits until this transaction holds the conversation, or `lock_timeout` ends the wait.
const LOCK: Sql = Sql {
    text: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
    types: &[Type::TEXT],
};

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
    let asked = std::time::Instant::now();
    let client = store.client().await?;
    let statements = store.statements;
    // Prepared before anything is sent (at once when the connection has them), so that the
    // three requests below leave in the order they are written.
    within_call_timeout(async {
        LOCK.ready(&client, statements).await.map_err(classify)?;
        LOAD_HOLDING
            .ready(&client, statements)
            .await
            .map_err(classify)
    })
    .await?;
    // The wait for a pooled connection counts against the wait allowed.
    let wait = wait.saturating_sub(asked.elapsed());
    // Whole milliseconds, at least one: 0 would mean "wait forever".
    let wait_ms = wait.as_millis().clamp(1, u128::from(u32::MAX));
    let hold_ms = (wait + HOLD_GRACE).as_millis().min(u128::from(u32::MAX));
    // Numbers only in this text, so it can go as one simple query, which a transaction-mode
    // pooler passes through like any other.
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = {wait_ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {hold_ms}"
    );
    let turn = PgLockedTurn {
        client: Some(client),
        statements,
    };
    let key = conversation.as_str();
    let params: [&(dyn ToSql + Sync); 1] = [&key];
    let client = turn.client()?;
    // `join!` polls in the order written, and each request is sent when first polled.
    let answered = tokio::time::timeout(wait + CALL_TIMEOUT, async {
        futures::join!(
            client.batch_execute(&begin),
            LOCK.execute(client, statements, &params),
            PostgresStore::load_on(client, statements, keys, receipt, Some(conversation)),
        )
    })
    .await;
    let Ok((began, locked, loaded)) = answered else {
        // Dropping `turn` rolls back.
        return Err(StoreError::Unavailable(anyhow!(
            "no answer from PostgreSQL within {:?} of asking for a conversation lock",
            wait + CALL_TIMEOUT
        )));
    };
    began.map_err(classify)?;
    match locked {
        Ok(_) => Ok(ConversationLock::Held {
            // A load after a lock not granted fails too, as the transaction has: the lock's
            // error is the one that says what happened.
            snapshot: loaded?,
            turn: Box::new(turn),
        }),
        Err(e) if not_granted(&e) => {
            Box::new(turn).release().await;
            Ok(ConversationLock::NotGranted)
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
    /// connection on which ending it failed is not given back: its session may still be in the
    /// transaction.
    fn ended(&mut self, ended: Result<(), StoreError>) -> Result<(), StoreError> {
        let Some(client) = self.client.take() else {
            return ended;
        };
        if ended.is_err() {
            drop(deadpool_postgres::Object::take(client));
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
        // Dropped mid-turn (the call was cancelled, or an error cut the turn short): roll back
        // before the connection serves anyone else. Without a runtime to do that on, the
        // connection is closed instead, which ends the transaction just the same.
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
