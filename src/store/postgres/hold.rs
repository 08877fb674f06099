//! The fenced hold: one conversation's turn at a time across replicas, for as long as its bot
//! runs — seconds to minutes for a language model — without a connection or a transaction held
//! for that time.
//!
//! The conversation lock (`lock`) holds a transaction, and with it a pooled connection, for the
//! whole of the bot's run. That suits bots that answer in milliseconds. A streamed turn, a model
//! writing for twenty seconds, would hold a connection for each conversation it answers: a pod
//! with the default pool of 16 would run at most 16 such conversations, and the rest would wait
//! for a connection or fail. So such turns hold their conversation by a row instead: a lease
//! recorded in `turnstile_state` under the conversation's hold key ([`StateKey::hold`]), whose
//! `version` is the fence.
//!
//! - **Taking it** is one statement: create the row, or take it over when it is released or its
//!   time ran out, which bumps the version; the answer is the fence. It goes with the turn's load
//!   in one round trip, so the state is read after the hold was taken. Taken by someone else, the
//!   turn waits, asking again with a growing pause, within its deadline.
//! - **Keeping it**: while the bot runs, the holder pushes its time on every [`RENEW_EVERY`]
//!   (it lasts [`HOLD_FOR`]). A replica that dies lets it run out, and the next turn takes over.
//! - **Committing under it**: the turn's commit carries the hold key as one more change, expected
//!   at the fence and written released. `turnstile_commit` checks it with the rest, atomically:
//!   a holder whose hold was taken over (it stalled past its time) cannot commit, and replays.
//!   No new SQL, no schema change: a replica of an older release ignores the row.
//! - **Letting it go** without a commit (the bot failed, or the turn was answered from its
//!   receipt) releases it in one statement, at once or, when dropped, on a task of its own.
//!
//! A redelivered activity whose first turn still runs elsewhere waits for the hold like any turn
//! of its conversation, and once it has it finds the first turn's receipt in the same load: it
//! joins that turn's outcome instead of running the bot again.
//!
//! The price against the lock: a waiter learns of a release by asking again, at most
//! [`MAX_PAUSE`] late, and waiters are not served in the order they asked. For turns of seconds
//! that is nothing; fast bots keep the lock and the lease.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::task::JoinHandle;
use tokio_postgres::types::Type;

use super::{PostgresStore, Sql, classify, within_call_timeout};
use crate::state::StateKey;
use crate::store::{
    Commit, CommitOutcome, ConversationLock, Expected, KeyChange, LockedTurn, Others, Snapshot,
    StoreError, Version,
};

/// How long a hold lasts unless its holder renews it: how long a dead replica's conversation
/// waits before another replica takes over.
pub const HOLD_FOR: Duration = Duration::from_secs(6);
/// How often a holder renews its hold while its bot runs.
pub const RENEW_EVERY: Duration = Duration::from_secs(2);
/// The first pause before asking again for a hold someone else has; it doubles up to
/// [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two asks.
const MAX_PAUSE: Duration = Duration::from_millis(250);

/// Takes the hold `$1` for `$2` (who holds it), running activity `$4` (its receipt key), until
/// `$3` seconds from now, if it is free (absent, released or run out): the fence; or, when
/// someone has it, no fence and the activity its holder runs.
const TAKE: Sql = Sql {
    text: "WITH taken AS ( \
             INSERT INTO turnstile_state AS s (key, state, version) \
             VALUES ($1, jsonb_build_object('holder', $2::text, 'activity', $4::text, \
                     'until', extract(epoch FROM clock_timestamp()) + $3::float8), 1) \
             ON CONFLICT (key) DO UPDATE \
                SET state = excluded.state, version = s.version + 1, updated_at = now() \
              WHERE (s.state->>'until')::float8 <= extract(epoch FROM clock_timestamp()) \
             RETURNING version) \
           SELECT version, NULL::text FROM taken \
           UNION ALL \
           SELECT NULL::bigint, state->>'activity' FROM turnstile_state \
            WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM taken)",
    types: &[Type::TEXT, Type::TEXT, Type::FLOAT8, Type::TEXT],
};
/// Pushes the time of hold `$1` at fence `$2` to `$3` seconds from now; no row changed: lost.
const RENEW: Sql = Sql {
    text: "UPDATE turnstile_state \
              SET state = jsonb_set(state, '{until}', \
                  to_jsonb(extract(epoch FROM clock_timestamp()) + $3::float8)) \
            WHERE key = $1 AND version = $2 RETURNING 1",
    types: &[Type::TEXT, Type::INT8, Type::FLOAT8],
};
/// Releases hold `$1` at fence `$2` (its time set to the past, the fence kept), and announces
/// it to the turns waiting for it (`waker`).
const RELEASE: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state SET state = jsonb_set(state, '{until}', '0') \
              WHERE key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8],
};
/// Announces hold `$1` released (by a commit, which released it).
const ANNOUNCE: Sql = Sql {
    text: "SELECT pg_notify('turnstile_hold', $1)",
    types: &[Type::TEXT],
};

/// Takes `conversation`'s hold, waiting at most `wait` for it, and loads `keys` and `receipt`
/// under it in the same round trip.
pub(super) async fn hold_conversation(
    store: &PostgresStore,
    conversation: &StateKey,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
    wait: Duration,
    others: Others,
) -> Result<ConversationLock, StoreError> {
    let until = tokio::time::Instant::now() + wait;
    let key = StateKey::hold(conversation);
    let holder = holder();
    let mut pause = FIRST_PAUSE;
    // Listening from before the first ask, so that a release between it and the wait is heard.
    let mut released = store.waker.subscribe();
    loop {
        match take(store, &key, &holder, keys, receipt).await? {
            Taken::Held(fence, snapshot) => {
                let turn = HeldTurn::new(store.clone(), key, fence);
                return Ok(ConversationLock::Held {
                    snapshot,
                    turn: Box::new(turn),
                });
            }
            // Another activity's turn, not a redelivery's first run: refused if asked to.
            Taken::By(activity)
                if others == Others::Refuse
                    && (receipt.is_none()
                        || activity.as_deref() != receipt.map(StateKey::as_str)) =>
            {
                return Ok(ConversationLock::Busy);
            }
            Taken::By(_) => {}
        }
        let now = tokio::time::Instant::now();
        if now + pause >= until {
            return Ok(ConversationLock::NotGranted);
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => pause = (pause * 2).min(MAX_PAUSE),
            () = released.of(key.as_str()) => {}
        }
    }
}

/// What one ask got.
enum Taken {
    /// The hold, at this fence, and the load under it.
    Held(Version, Snapshot),
    /// Someone has it, running this activity (its receipt key; `None` if it names none).
    By(Option<String>),
}

/// One ask: the fence and the load when the hold was free, or whose it is.
async fn take(
    store: &PostgresStore,
    key: &StateKey,
    holder: &str,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
) -> Result<Taken, StoreError> {
    let client = store.client().await?;
    let statements = store.statements;
    within_call_timeout(async {
        // Prepared first, so that both leave together, in this order.
        TAKE.ready(&client, statements).await.map_err(classify)?;
        super::LOAD
            .ready(&client, statements)
            .await
            .map_err(classify)?;
        let seconds = HOLD_FOR.as_secs_f64();
        let key = key.as_str();
        let activity = receipt.map(StateKey::as_str);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&key, &holder, &seconds, &activity];
        let (taken, loaded) = futures::join!(
            TAKE.query(&client, statements, &params),
            PostgresStore::load_on(&client, statements, keys, receipt, None),
        );
        let unexpected = |e: tokio_postgres::Error| StoreError::Unexpected(e.into());
        let Some(row) = taken.map_err(classify)?.into_iter().next() else {
            // Released and gone between the two halves of the statement: ask again.
            return Ok(Taken::By(None));
        };
        let fence: Option<i64> = row.try_get(0).map_err(unexpected)?;
        let Some(fence) = fence else {
            return Ok(Taken::By(row.try_get(1).map_err(unexpected)?));
        };
        let fence = u64::try_from(fence).map_err(|e| StoreError::Unexpected(e.into()))?;
        Ok(Taken::Held(Version::new(fence), loaded?))
    })
    .await
}

/// Who holds a hold, for whoever reads the row: this process and a random tag.
fn holder() -> String {
    format!(
        "pid {} turn {:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// A conversation held for one turn: renewed on a task while the turn runs, released by its
/// commit or its release, or when dropped.
struct HeldTurn {
    store: PostgresStore,
    key: StateKey,
    fence: Version,
    renewing: JoinHandle<()>,
    /// Whether the commit or the release ended it.
    ended: bool,
}

impl HeldTurn {
    fn new(store: PostgresStore, key: StateKey, fence: Version) -> Self {
        let renewing = tokio::spawn(renew(store.clone(), key.clone(), fence));
        Self {
            store,
            key,
            fence,
            renewing,
            ended: false,
        }
    }

    /// The change that checks the hold is still this turn's and releases it, in the commit.
    fn release_in_commit(&self) -> KeyChange {
        let mut released = serde_json::Map::new();
        released.insert("until".into(), serde_json::Value::from(0));
        KeyChange {
            key: self.key.clone(),
            expected: Expected::Version(self.fence),
            write: Some(Arc::new(released)),
        }
    }
}

/// Renews the hold `key` at `fence` every [`RENEW_EVERY`] until aborted, or until it finds the
/// hold lost (then the commit will fail its check, and the turn replays).
async fn renew(store: PostgresStore, key: StateKey, fence: Version) {
    let fence = i64::try_from(fence.get()).unwrap_or(i64::MAX);
    let seconds = HOLD_FOR.as_secs_f64();
    loop {
        tokio::time::sleep(RENEW_EVERY).await;
        let renewed = query(&store, &RENEW, &[&key.as_str(), &fence, &seconds])
            .await
            .map(|rows| rows.len());
        match renewed {
            Ok(1) => {}
            Ok(_) => {
                tracing::warn!(%key, "a conversation's hold was taken over while its turn ran");
                return;
            }
            // Tried again at the next beat; the hold lasts three of them.
            Err(error) => tracing::info!(%key, %error, "renewing a conversation's hold failed"),
        }
    }
}

/// Releases hold `key` at `fence`.
async fn release(store: &PostgresStore, key: &StateKey, fence: Version) -> Result<(), StoreError> {
    let fence = i64::try_from(fence.get()).map_err(|e| StoreError::Unexpected(e.into()))?;
    query(store, &RELEASE, &[&key.as_str(), &fence]).await?;
    Ok(())
}

/// Runs `sql` with `params` on a pooled connection, within the store's call timeout.
async fn query(
    store: &PostgresStore,
    sql: &Sql,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, StoreError> {
    let client = store.client().await?;
    within_call_timeout(async {
        sql.query(&client, store.statements, params)
            .await
            .map_err(classify)
    })
    .await
}

/// Announces hold `key`, released by a commit, to the turns waiting for it, on a task of its
/// own: the committed turn's answer does not wait for it.
fn announce(store: &PostgresStore, key: &StateKey) {
    let (store, key) = (store.clone(), key.clone());
    tokio::spawn(async move {
        let announced = query(&store, &ANNOUNCE, &[&key.as_str()]).await;
        if let Err(e) = announced {
            tracing::debug!(error = %e, "announcing a released hold failed; waiters ask again");
        }
    });
}

#[async_trait]
impl LockedTurn for HeldTurn {
    /// The commit, with the hold's check and release in it: one statement, as any turn's.
    async fn commit(mut self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        self.renewing.abort();
        self.ended = true;
        let (mut changes, receipt) = commit.into_parts();
        changes.push(self.release_in_commit());
        let mut held = Commit::new(changes);
        if let Some((key, payload)) = receipt {
            held = held.with_receipt(key, payload);
        }
        let outcome = crate::store::Store::commit(&self.store, held).await;
        match outcome {
            Ok(CommitOutcome::Conflict { key }) if key != self.key => {
                // Nothing was written, the release neither: let the conversation go.
                if let Err(e) = release(&self.store, &self.key, self.fence).await {
                    tracing::info!(error = %e, "releasing a conversation's hold failed");
                }
                Ok(CommitOutcome::Conflict { key })
            }
            Ok(CommitOutcome::Conflict { key }) => {
                tracing::warn!(%key, "a stalled turn lost its conversation's hold; it replays");
                Ok(CommitOutcome::Conflict { key })
            }
            Ok(CommitOutcome::Committed(mut versions)) => {
                announce(&self.store, &self.key);
                versions.remove(&self.key);
                Ok(CommitOutcome::Committed(versions))
            }
            Err(e) => Err(e),
        }
    }

    async fn release(mut self: Box<Self>) {
        self.renewing.abort();
        self.ended = true;
        if let Err(e) = release(&self.store, &self.key, self.fence).await {
            tracing::info!(error = %e, "releasing a conversation's hold failed; it runs out");
        }
    }
}

impl Drop for HeldTurn {
    fn drop(&mut self) {
        self.renewing.abort();
        if self.ended {
            return;
        }
        // Dropped mid-turn (the call was cancelled, or the turn stopped): let the conversation go
        // now rather than when its time runs out.
        let (store, key, fence) = (self.store.clone(), self.key.clone(), self.fence);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = release(&store, &key, fence).await {
                    tracing::info!(error = %e, "releasing a conversation's hold failed");
                }
            });
        }
    }
}

impl std::fmt::Debug for HeldTurn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldTurn")
            .field("key", &self.key)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}
