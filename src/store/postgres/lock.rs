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
//! The wait is bounded by the turn's deadline (`lock_timeout`); a lock not granted in time
//! (SQLSTATE 55P03, or 57014 when the statement timeout ends the wait first) is an ordinary
//! outcome, [`ConversationLock::NotGranted`]. A replica alive but stuck while holding the lock
//! is cut off by `idle_in_transaction_session_timeout`.

use std::time::Duration;

use anyhow::anyhow;
use async_trait::async_trait;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::{CALL_TIMEOUT, PostgresStore, Sql, Statements, classify, within_call_timeout};
use crate::state::StateKey;
use crate::store::{Commit, CommitOutcome, ConversationLock, LockedTurn, Snapshot, StoreError};

/// Waits until this transaction holds the conversation, or `lock_timeout` ends the wait.
const LOCK: Sql = Sql {
    text: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
    types: &[Type::TEXT],
};

/// How long past its lock wait a turn may hold the lock idle (its bot running) before
/// PostgreSQL ends the session: only a replica that stopped without dying gets there.
const HOLD_GRACE: Duration = Duration::from_secs(30);

/// Locks `conversation` in a new transaction on a connection of `store`'s pool.
pub(super) async fn lock_conversation(
    store: &PostgresStore,
    conversation: &StateKey,
    wait: Duration,
) -> Result<ConversationLock, StoreError> {
    let asked = std::time::Instant::now();
    let client = store.client().await?;
    // The wait for a pooled connection counts against the wait allowed.
    let wait = wait.saturating_sub(asked.elapsed());
    // Whole milliseconds, at least one: 0 would mean "wait forever".
    let wait_ms = wait.as_millis().clamp(1, u128::from(u32::MAX));
    let hold_ms = (wait + HOLD_GRACE).as_millis().min(u128::from(u32::MAX));
    // Numbers only in this text, so it can go as one simple query (one round trip), which a
    // transaction-mode pooler passes through like any other.
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = {wait_ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {hold_ms}"
    );
    within_call_timeout(async { client.batch_execute(&begin).await.map_err(classify) }).await?;
    let turn = PgLockedTurn {
        client: Some(client),
        statements: store.statements,
        conversation: conversation.clone(),
    };
    let key = conversation.as_str();
    let params: [&(dyn ToSql + Sync); 1] = [&key];
    let locked = tokio::time::timeout(
        wait + CALL_TIMEOUT,
        LOCK.execute(turn.client()?, turn.statements, &params),
    )
    .await;
    match locked {
        Ok(Ok(_)) => Ok(ConversationLock::Held(Box::new(turn))),
        Ok(Err(e)) if not_granted(&e) => {
            Box::new(turn).release().await;
            Ok(ConversationLock::NotGranted)
        }
        // Dropping `turn` rolls back.
        Ok(Err(e)) => Err(classify(e)),
        Err(_) => Err(StoreError::Unavailable(anyhow!(
            "no answer from PostgreSQL within {:?} of asking for a conversation lock",
            wait + CALL_TIMEOUT
        ))),
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
    /// The conversation held, whose row the load locks too.
    conversation: StateKey,
}

impl PgLockedTurn {
    fn client(&self) -> Result<&deadpool_postgres::Object, StoreError> {
        self.client
            .as_ref()
            .ok_or_else(|| StoreError::Unexpected(anyhow!("the locked turn has ended")))
    }

    /// Ends the transaction with `end` (`COMMIT` or `ROLLBACK`). A connection on which that
    /// failed is not given back to the pool: its session may still be in the transaction.
    async fn end(&mut self, end: &str) -> Result<(), StoreError> {
        let Some(client) = self.client.take() else {
            return Ok(());
        };
        match within_call_timeout(async { client.batch_execute(end).await.map_err(classify) }).await
        {
            Ok(()) => Ok(()),
            Err(e) => {
                drop(deadpool_postgres::Object::take(client));
                Err(e)
            }
        }
    }
}

#[async_trait]
impl LockedTurn for PgLockedTurn {
    async fn load(
        &mut self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        let client = self.client()?;
        let held = Some(&self.conversation);
        within_call_timeout(PostgresStore::load_on(
            client,
            self.statements,
            keys,
            receipt,
            held,
        ))
        .await
    }

    async fn commit(mut self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let client = self.client()?;
        let outcome =
            within_call_timeout(PostgresStore::commit_on(client, self.statements, &commit)).await;
        match outcome {
            Ok(CommitOutcome::Committed(versions)) => {
                // Until COMMIT answers, the outcome is unknown: a failure here is `Unavailable`,
                // which the engine resolves through the receipt.
                self.end("COMMIT").await?;
                Ok(CommitOutcome::Committed(versions))
            }
            Ok(conflict @ CommitOutcome::Conflict { .. }) => {
                let _ = self.end("ROLLBACK").await;
                Ok(conflict)
            }
            Err(e) => {
                let _ = self.end("ROLLBACK").await;
                Err(e)
            }
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
