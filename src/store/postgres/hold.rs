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
//! - **Committing under it**: the turn's commit carries the hold key as one more change, checked
//!   at the fence, not written. `turnstile_commit` checks it with the rest, atomically: a holder
//!   whose hold was taken over (it stalled past its time) cannot commit, and replays. The
//!   release follows on a task of its own, so the answer does not wait for it. No schema change:
//!   a replica of an older release ignores the row.
//! - **Letting it go** without a commit (the bot failed, or the turn was answered from its
//!   receipt) releases it in one statement, at once or, when dropped, on a task of its own.
//! - **Handing on** (double texting): the row also keeps what the conversation's turns leave to
//!   the next one ([`Handed`]), which is why the commit does not overwrite it. A message of an
//!   `interrupt` bot that finds the hold taken marks it and announces `turnstile_interrupt`; the
//!   holder hears it (or reads the mark at its next renewal), stops, commits its receipt, and
//!   releases handing its activity on as superseded. A message of a `coalesce` bot adds itself
//!   to the hold's waiting list before it asks for the hold; whoever takes it next gets the list
//!   (without the activities answered meanwhile), and its commit's release consumes it.
//!
//! A redelivered activity whose first turn still runs elsewhere waits for the hold like any turn
//! of its conversation, and once it has it finds the first turn's receipt in the same load: it
//! joins that turn's outcome instead of running the bot again.
//!
//! - **Waiting in line**: a turn that found the hold taken puts itself in the line kept in the
//!   row ([`QUEUE`]), and marks itself still there on every ask; the hold is granted only to the
//!   first in line among those still asking ([`STILL_WAITING`]), so the turns waiting for a
//!   conversation get it in the order they first asked, whichever replica they are on, and one
//!   that gave up holds nobody back for long.
//!
//! The price against the lock: a waiter learns of a release by asking again, at most
//! [`MAX_PAUSE`] late (or at once, woken by `waker`). For turns of seconds that is nothing; fast
//! bots keep the lock and the lease.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::types::Type;

use super::deadlock;
use super::timeouts::within_call_timeout;
use super::waker::Released;
use super::{PostgresStore, Sql, classify};
use crate::state::StateKey;
use crate::store::{
    Commit, CommitOutcome, ConversationLock, Expected, Handed, KeyChange, LockedTurn, Others,
    Pending, Snapshot, StoreError, Version,
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
/// `$3` seconds from now, if it is free (absent, released or run out): the fence, and what the
/// turns before left to the next ([`Handed`]: kept across holders until a commit consumes it;
/// pending activities answered already are left out); or, when someone has it — or ticket `$6`
/// is not first in the line of the turns waiting for it ([`QUEUE`]) that asked within `$5`
/// seconds — no fence and the activity its holder runs. Created at version 1, or the version after
/// the key's tombstone if a deletion left one (`migrations/V4__erasure.sql`): a holder of the
/// deleted row's fence can never match it.
///
/// Here and in the releases, a pending activity's receipt is looked for by an `EXISTS` that ends
/// in `OFFSET 0`: without it, PostgreSQL turns the `NOT EXISTS` into an anti-join, and with the
/// receipt slots analyzed empty (as after a slot's turn to be emptied) hashes every slot whole
/// for each statement, a plan a connection then keeps while the slot fills
/// (`group_commit::WRITE_MANY`).
const TAKE: Sql = Sql {
    text: concat!(
        "WITH taken AS ( \
             INSERT INTO turnstile_state AS s (key, state, version) \
             VALUES ($1, jsonb_build_object('holder', $2::text, 'activity', $4::text, \
                     'until', extract(epoch FROM clock_timestamp()) + $3::float8), \
                     ",
        tombstone_version!("$1"),
        " + 1) \
             ON CONFLICT (key) DO UPDATE \
                SET state = excluded.state || jsonb_build_object( \
                      'superseded', coalesce(s.state->'superseded', '[]'), \
                      'pending', coalesce(s.state->'pending', '[]'), \
                      'queue', coalesce((SELECT jsonb_agg(q.e ORDER BY q.n) \
                         FROM jsonb_array_elements(coalesce(s.state->'queue', '[]')) \
                              WITH ORDINALITY AS q(e, n) \
                        WHERE q.e->>'ticket' <> $6 \
                          AND (q.e->>'seen')::float8 \
                              > extract(epoch FROM clock_timestamp()) - $5::float8), '[]')), \
                    version = s.version + 1, updated_at = now() \
              WHERE (s.state->>'until')::float8 <= extract(epoch FROM clock_timestamp()) \
                AND NOT EXISTS ( \
                    SELECT 1 FROM jsonb_array_elements(coalesce(s.state->'queue', '[]')) \
                                  WITH ORDINALITY AS q(e, n) \
                     WHERE q.e->>'ticket' <> $6 \
                       AND (q.e->>'seen')::float8 > extract(epoch FROM clock_timestamp()) - $5::float8 \
                       AND q.n < coalesce(( \
                           SELECT m.n FROM jsonb_array_elements(coalesce(s.state->'queue', '[]')) \
                                           WITH ORDINALITY AS m(e, n) \
                            WHERE m.e->>'ticket' = $6 LIMIT 1), 9223372036854775807)) \
             RETURNING version, state) \
           SELECT version, NULL::text, state->'superseded', \
                  (SELECT jsonb_agg(p.entry ORDER BY p.n) \
                     FROM jsonb_array_elements(coalesce(state->'pending', '[]')) \
                          WITH ORDINALITY AS p(entry, n) \
                    WHERE NOT EXISTS (SELECT 1 FROM turnstile_receipt r \
                                       WHERE r.key = p.entry->>'receipt' OFFSET 0)) \
             FROM taken \
           UNION ALL \
           SELECT NULL::bigint, state->>'activity', NULL::jsonb, NULL::jsonb FROM turnstile_state \
            WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM taken)"
    ),
    types: &[
        Type::TEXT,
        Type::TEXT,
        Type::FLOAT8,
        Type::TEXT,
        Type::FLOAT8,
        Type::TEXT,
    ],
    on_citus: Some(&TAKE_ON_CITUS),
};
/// Puts waiter `$2` (its ticket) in the line for hold `$1`, at the end, or, when it is in the
/// line, marks it still waiting; drops the waiters who stopped asking ([`STILL_WAITING`]). A
/// turn's ticket is its activity's receipt key, so that a redelivery (its replica died while it
/// waited) takes up the place the first delivery had, if it comes back within that time.
const QUEUE: Sql = Sql {
    text: "UPDATE turnstile_state SET state = jsonb_set(state, '{queue}', coalesce(( \
             SELECT jsonb_agg(w.e ORDER BY w.n) FROM ( \
               SELECT CASE WHEN q.e->>'ticket' = $2 \
                           THEN jsonb_build_object('ticket', $2::text, \
                                'seen', extract(epoch FROM clock_timestamp())) \
                           ELSE q.e END AS e, q.n \
                 FROM jsonb_array_elements(coalesce(state->'queue', '[]')) \
                      WITH ORDINALITY AS q(e, n) \
                WHERE q.e->>'ticket' = $2 \
                   OR (q.e->>'seen')::float8 > extract(epoch FROM clock_timestamp()) - $3::float8 \
               UNION ALL \
               SELECT jsonb_build_object('ticket', $2::text, \
                      'seen', extract(epoch FROM clock_timestamp())), 9223372036854775807 \
                WHERE NOT coalesce(state->'queue', '[]') \
                          @> jsonb_build_array(jsonb_build_object('ticket', $2::text))) w), \
             '[]')) \
           WHERE key = $1",
    types: &[Type::TEXT, Type::TEXT, Type::FLOAT8],
    on_citus: Some(&QUEUE_ON_CITUS),
};
/// How long a waiter stays in the line for a hold without asking again: eight of the longest
/// pauses between two asks ([`MAX_PAUSE`]).
const STILL_WAITING: Duration = Duration::from_secs(2);
/// Pushes the time of hold `$1` at fence `$2` to `$3` seconds from now; no row changed: lost.
/// Answers whether its holder was asked to stop ([`INTERRUPT`]).
const RENEW: Sql = Sql {
    text: "UPDATE turnstile_state \
              SET state = jsonb_set(state, '{until}', \
                  to_jsonb(extract(epoch FROM clock_timestamp()) + $3::float8)) \
            WHERE key = $1 AND version = $2 RETURNING state ? 'interrupt'",
    types: &[Type::TEXT, Type::INT8, Type::FLOAT8],
    on_citus: Some(&RENEW_ON_CITUS),
};
/// Releases hold `$1` at fence `$2` (its time set to the past, the fence kept, what was handed
/// on kept), and announces it to the turns waiting for it (`waker`).
const RELEASE: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state SET state = jsonb_set(state, '{until}', '0') \
              WHERE key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8],
    on_citus: Some(&RELEASE_ON_CITUS),
};
/// Releases hold `$1` at fence `$2` after its turn committed: what was handed to that turn is
/// consumed (the superseded activities, and the pending ones whose receipts the commit wrote).
const RELEASE_COMMITTED: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state \
                SET state = (state - 'superseded' - 'pending' - 'interrupt') \
                    || jsonb_build_object('until', 0, 'pending', coalesce( \
                       (SELECT jsonb_agg(p.entry ORDER BY p.n) \
                          FROM jsonb_array_elements(coalesce(state->'pending', '[]')) \
                               WITH ORDINALITY AS p(entry, n) \
                         WHERE NOT EXISTS (SELECT 1 FROM turnstile_receipt r \
                                            WHERE r.key = p.entry->>'receipt' OFFSET 0)), '[]')) \
              WHERE key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8],
    on_citus: Some(&RELEASE_COMMITTED_ON_CITUS),
};
/// Releases hold `$1` at fence `$2` of a turn a later message interrupted, handing its activity
/// `$3` on to the next turn as superseded, after the ones handed to it.
const RELEASE_SUPERSEDED: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state \
                SET state = (state - 'interrupt') || jsonb_build_object('until', 0, \
                    'superseded', coalesce(state->'superseded', '[]') || jsonb_build_array($3::jsonb)) \
              WHERE key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8, Type::JSONB],
    on_citus: Some(&RELEASE_SUPERSEDED_ON_CITUS),
};
/// Asks the holder of hold `$1`, running activity `$2`, to stop for activity `$3`: marks the
/// hold (read by the holder's renewal) and announces it (heard by the holder at once). Nothing
/// when the hold is free or has another holder by now.
const INTERRUPT: Sql = Sql {
    text: "WITH marked AS ( \
             UPDATE turnstile_state SET state = state || jsonb_build_object('interrupt', $3::text) \
              WHERE key = $1 AND state->>'activity' = $2 \
                AND (state->>'until')::float8 > extract(epoch FROM clock_timestamp()) \
             RETURNING key) \
           SELECT pg_notify('turnstile_interrupt', key) FROM marked",
    types: &[Type::TEXT, Type::TEXT, Type::TEXT],
    on_citus: Some(&INTERRUPT_ON_CITUS),
};
/// Adds `$2` (receipt key `$3`) to the activities of hold `$1` waiting to be answered together,
/// unless it is there; the hold itself (its holder, time and fence) is left as it is.
const ADD_PENDING: Sql = Sql {
    text: concat!(
        "INSERT INTO turnstile_state AS s (key, state, version) \
           VALUES ($1, jsonb_build_object('until', 0, 'pending', jsonb_build_array($2::jsonb)), \
                   ",
        tombstone_version!("$1"),
        " + 1) \
           ON CONFLICT (key) DO UPDATE \
              SET state = jsonb_set(s.state, '{pending}', \
                  coalesce(s.state->'pending', '[]') || jsonb_build_array($2::jsonb)) \
            WHERE NOT coalesce(s.state->'pending', '[]') \
                      @> jsonb_build_array(jsonb_build_object('receipt', $3::text))"
    ),
    types: &[Type::TEXT, Type::JSONB, Type::TEXT],
    on_citus: Some(&ADD_PENDING_ON_CITUS),
};
/// [`QUEUE`] on Citus (`super::citus`): the row named by its shard too, and the clock the
/// statement's start, as Citus refuses a volatile function in a distributed update.
const QUEUE_ON_CITUS: Sql = Sql {
    text: "UPDATE turnstile_state SET state = jsonb_set(state, '{queue}', coalesce(( \
             SELECT jsonb_agg(w.e ORDER BY w.n) FROM ( \
               SELECT CASE WHEN q.e->>'ticket' = $2 \
                           THEN jsonb_build_object('ticket', $2::text, \
                                'seen', extract(epoch FROM statement_timestamp())) \
                           ELSE q.e END AS e, q.n \
                 FROM jsonb_array_elements(coalesce(state->'queue', '[]')) \
                      WITH ORDINALITY AS q(e, n) \
                WHERE q.e->>'ticket' = $2 \
                   OR (q.e->>'seen')::float8 > extract(epoch FROM statement_timestamp()) - $3::float8 \
               UNION ALL \
               SELECT jsonb_build_object('ticket', $2::text, \
                      'seen', extract(epoch FROM statement_timestamp())), 9223372036854775807 \
                WHERE NOT coalesce(state->'queue', '[]') \
                          @> jsonb_build_array(jsonb_build_object('ticket', $2::text))) w), \
             '[]')) \
           WHERE shard = turnstile_key_shard($1) AND key = $1",
    types: &[Type::TEXT, Type::TEXT, Type::FLOAT8],
    on_citus: None,
};
/// [`RENEW`] on Citus (`super::citus`): the row named by its shard too, and the clock the
/// statement's start, as Citus refuses a volatile function in a distributed update.
const RENEW_ON_CITUS: Sql = Sql {
    text: "UPDATE turnstile_state \
              SET state = jsonb_set(state, '{until}', \
                  to_jsonb(extract(epoch FROM statement_timestamp()) + $3::float8)) \
            WHERE shard = turnstile_key_shard($1) AND key = $1 AND version = $2 RETURNING state ? 'interrupt'",
    types: &[Type::TEXT, Type::INT8, Type::FLOAT8],
    on_citus: None,
};
/// [`RELEASE`] on Citus (`super::citus`): the row named by its shard too, and the clock the
/// statement's start, as Citus refuses a volatile function in a distributed update.
const RELEASE_ON_CITUS: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state SET state = jsonb_set(state, '{until}', '0') \
              WHERE shard = turnstile_key_shard($1) AND key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8],
    on_citus: None,
};
/// [`RELEASE_COMMITTED`] on Citus (`super::citus`): the row named by its shard too, and the clock the
/// statement's start, as Citus refuses a volatile function in a distributed update.
const RELEASE_COMMITTED_ON_CITUS: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state \
                SET state = (state - 'superseded' - 'pending' - 'interrupt') \
                    || jsonb_build_object('until', 0, 'pending', coalesce( \
                       (SELECT jsonb_agg(p.entry ORDER BY p.n) \
                          FROM jsonb_array_elements(coalesce(state->'pending', '[]')) \
                               WITH ORDINALITY AS p(entry, n) \
                         WHERE NOT EXISTS (SELECT 1 FROM turnstile_receipt r \
                                            WHERE r.shard = turnstile_key_shard($1) \
                                              AND r.key = p.entry->>'receipt' OFFSET 0)), '[]')) \
              WHERE shard = turnstile_key_shard($1) AND key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8],
    on_citus: None,
};
/// [`RELEASE_SUPERSEDED`] on Citus (`super::citus`): the row named by its shard too, and the clock the
/// statement's start, as Citus refuses a volatile function in a distributed update.
const RELEASE_SUPERSEDED_ON_CITUS: Sql = Sql {
    text: "WITH released AS ( \
             UPDATE turnstile_state \
                SET state = (state - 'interrupt') || jsonb_build_object('until', 0, \
                    'superseded', coalesce(state->'superseded', '[]') || jsonb_build_array($3::jsonb)) \
              WHERE shard = turnstile_key_shard($1) AND key = $1 AND version = $2 RETURNING key) \
           SELECT pg_notify('turnstile_hold', key) FROM released",
    types: &[Type::TEXT, Type::INT8, Type::JSONB],
    on_citus: None,
};
/// [`INTERRUPT`] on Citus (`super::citus`): the row named by its shard too, and the clock the
/// statement's start, as Citus refuses a volatile function in a distributed update.
const INTERRUPT_ON_CITUS: Sql = Sql {
    text: "WITH marked AS ( \
             UPDATE turnstile_state SET state = state || jsonb_build_object('interrupt', $3::text) \
              WHERE shard = turnstile_key_shard($1) AND key = $1 AND state->>'activity' = $2 \
                AND (state->>'until')::float8 > extract(epoch FROM statement_timestamp()) \
             RETURNING key) \
           SELECT pg_notify('turnstile_interrupt', key) FROM marked",
    types: &[Type::TEXT, Type::TEXT, Type::TEXT],
    on_citus: None,
};
/// [`TAKE`] on Citus: `turnstile_hold_take` (`citus/functions.sql`), the same rules in steps
/// Citus runs, as it refuses the statement's subqueries in an insert.
const TAKE_ON_CITUS: Sql = Sql {
    text: "SELECT fence, running, superseded, pending \
             FROM turnstile_hold_take($1, $2, $3, $4, $5, $6)",
    types: &[
        Type::TEXT,
        Type::TEXT,
        Type::FLOAT8,
        Type::TEXT,
        Type::FLOAT8,
        Type::TEXT,
    ],
    on_citus: None,
};
/// [`ADD_PENDING`] on Citus: `turnstile_hold_add_pending`, for the same reason.
const ADD_PENDING_ON_CITUS: Sql = Sql {
    text: "SELECT turnstile_hold_add_pending($1, $2, $3)",
    types: &[Type::TEXT, Type::JSONB, Type::TEXT],
    on_citus: None,
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
    let ticket = receipt.map_or(holder.as_str(), StateKey::as_str);
    let mut pause = FIRST_PAUSE;
    // Listening from before the first ask, so that a release between it and the wait is heard,
    // and, for a turn that may be interrupted, an interruption between its take and its run.
    let mut released = store.waker.subscribe();
    let mut interrupted: Option<String> = None;
    loop {
        match take(store, &key, &holder, ticket, keys, receipt).await? {
            Taken::Held(fence, snapshot, handed) => {
                let interruptible = (others == Others::Interrupt).then(|| store.waker.subscribe());
                let turn = HeldTurn::new(store.clone(), key, fence, handed, interruptible);
                return Ok(ConversationLock::Held {
                    snapshot,
                    turn: Box::new(turn),
                });
            }
            // Another activity's turn, not a redelivery's first run.
            Taken::By(Some(activity))
                if receipt.is_none_or(|r| r.as_str() != activity.as_str()) =>
            {
                match others {
                    Others::Refuse => return Ok(ConversationLock::Busy),
                    Others::Interrupt if interrupted.as_deref() != Some(activity.as_str()) => {
                        let by = receipt.map_or("", StateKey::as_str);
                        query(store, &INTERRUPT, &[&key.as_str(), &activity.as_str(), &by]).await?;
                        tracing::debug!(%key, "asked the conversation's running turn to stop");
                        interrupted = Some(activity);
                    }
                    Others::Wait | Others::Interrupt => {}
                }
            }
            Taken::By(_) => {}
        }
        // In line (or still in line) for it, so that the turns waiting for it get it in the
        // order they first asked, whichever replica they are on.
        let still = STILL_WAITING.as_secs_f64();
        query(store, &QUEUE, &[&key.as_str(), &ticket, &still]).await?;
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

/// Adds `pending` to the activities of `conversation` waiting to be answered together.
pub(super) async fn add_pending(
    store: &PostgresStore,
    conversation: &StateKey,
    pending: &Pending,
) -> Result<(), StoreError> {
    let key = StateKey::hold(conversation);
    let entry = pending.to_json();
    query(
        store,
        &ADD_PENDING,
        &[&key.as_str(), &entry, &pending.receipt.as_str()],
    )
    .await?;
    Ok(())
}

/// What one ask got.
enum Taken {
    /// The hold, at this fence, the load under it, and what the turns before left.
    Held(Version, Snapshot, Handed),
    /// Someone has it, running this activity (its receipt key; `None` if it names none).
    By(Option<String>),
}

/// One ask: the fence and the load when the hold was free, or whose it is.
async fn take(
    store: &PostgresStore,
    key: &StateKey,
    holder: &str,
    ticket: &str,
    keys: &[StateKey],
    receipt: Option<&StateKey>,
) -> Result<Taken, StoreError> {
    let client = store.client().await?;
    let via = store.via();
    within_call_timeout(async {
        // Prepared first, so that both leave together, in this order.
        TAKE.ready(&client, via).await.map_err(classify)?;
        super::load_of(keys.len(), false)
            .ready(&client, via)
            .await
            .map_err(classify)?;
        let seconds = HOLD_FOR.as_secs_f64();
        let key = key.as_str();
        let activity = receipt.map(StateKey::as_str);
        let still = STILL_WAITING.as_secs_f64();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
            [&key, &holder, &seconds, &activity, &still, &ticket];
        let (taken, loaded) = futures::join!(
            TAKE.query(&client, via, &params),
            PostgresStore::load_on(&client, via, keys, receipt, None, &store.ttls),
        );
        let unexpected = |e: tokio_postgres::Error| StoreError::Unexpected(e.into());
        let taken = match taken {
            // Citus cancels a transaction it takes to be in a distributed deadlock, and a crowd
            // of turns waiting for one hold row can look like one to it (citusdata/citus#1803:
            // the single statements it sends on their own count as one "local" transaction).
            // The take was undone whole: nothing taken, ask again.
            Err(e) if deadlock::is_victim(&e) => {
                return Ok(Taken::By(None));
            }
            taken => taken.map_err(classify)?,
        };
        let Some(row) = taken.into_iter().next() else {
            // Released and gone between the two halves of the statement: ask again.
            return Ok(Taken::By(None));
        };
        let fence: Option<i64> = row.try_get(0).map_err(unexpected)?;
        let Some(fence) = fence else {
            return Ok(Taken::By(row.try_get(1).map_err(unexpected)?));
        };
        let fence = u64::try_from(fence).map_err(|e| StoreError::Unexpected(e.into()))?;
        let list = |at: usize| -> Result<Vec<serde_json::Value>, StoreError> {
            let value: Option<serde_json::Value> = row.try_get(at).map_err(unexpected)?;
            Ok(match value {
                Some(serde_json::Value::Array(items)) => items,
                _ => Vec::new(),
            })
        };
        let handed = Handed {
            superseded: list(2)?,
            pending: list(3)?.iter().filter_map(Pending::from_json).collect(),
        };
        Ok(Taken::Held(Version::new(fence), loaded?, handed))
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
    handed: Handed,
    renewing: JoinHandle<()>,
    /// Set once a later message asked this turn to stop: by its renewal, or by a task hearing
    /// the announcement (for a turn that may be interrupted).
    interrupt: Arc<watch::Sender<bool>>,
    hearing: Option<JoinHandle<()>>,
    /// Whether the commit or the release ended it.
    ended: bool,
}

impl HeldTurn {
    fn new(
        store: PostgresStore,
        key: StateKey,
        fence: Version,
        handed: Handed,
        interruptible: Option<Released>,
    ) -> Self {
        let interrupt = Arc::new(watch::Sender::new(false));
        let renewing = tokio::spawn(renew(
            store.clone(),
            key.clone(),
            fence,
            Arc::clone(&interrupt),
        ));
        let hearing = interruptible.map(|mut heard| {
            let (key, interrupt) = (key.clone(), Arc::clone(&interrupt));
            tokio::spawn(async move {
                heard.interrupt_of(key.as_str()).await;
                interrupt.send_replace(true);
            })
        });
        Self {
            store,
            key,
            fence,
            handed,
            renewing,
            interrupt,
            hearing,
            ended: false,
        }
    }

    /// The change that checks, in the commit, that the hold is still this turn's. It is not
    /// written: what others add to the hold meanwhile (activities waiting to be answered) must
    /// survive the commit. The release follows it ([`RELEASE_COMMITTED`]).
    fn checked_in_commit(&self) -> KeyChange {
        KeyChange {
            key: self.key.clone(),
            expected: Expected::Version(self.fence),
            write: None,
        }
    }

    /// Stops renewing and hearing, and marks the turn ended.
    fn end(&mut self) {
        self.renewing.abort();
        if let Some(hearing) = &self.hearing {
            hearing.abort();
        }
        self.ended = true;
    }

    /// Applies `commit` with the hold's check in it: one statement, as any turn's.
    async fn commit_checked(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        let also: Vec<_> = commit.receipts_also().to_vec();
        let (mut changes, receipt) = commit.into_parts();
        changes.push(self.checked_in_commit());
        let mut held = Commit::new(changes);
        if let Some((key, payload)) = receipt {
            held = held.with_receipt(key, payload);
        }
        for (key, payload) in also {
            held = held.with_receipt_also(key, payload);
        }
        let outcome = crate::store::Store::commit(&self.store, held).await;
        match outcome {
            Ok(CommitOutcome::Conflict { key }) if key != self.key => {
                // Nothing was written: let the conversation go.
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
                versions.remove(&self.key);
                Ok(CommitOutcome::Committed(versions))
            }
            Err(e) => Err(e),
        }
    }
}

/// Renews the hold `key` at `fence` every [`RENEW_EVERY`] until aborted, or until it finds the
/// hold lost (then the commit will fail its check, and the turn replays); sets `interrupt` when
/// it finds its holder asked to stop.
async fn renew(
    store: PostgresStore,
    key: StateKey,
    fence: Version,
    interrupt: Arc<watch::Sender<bool>>,
) {
    let fence = i64::try_from(fence.get()).unwrap_or(i64::MAX);
    let seconds = HOLD_FOR.as_secs_f64();
    loop {
        tokio::time::sleep(RENEW_EVERY).await;
        let renewed = query(&store, &RENEW, &[&key.as_str(), &fence, &seconds]).await;
        match renewed.as_deref() {
            Ok([row]) => {
                if row.try_get::<_, bool>(0).unwrap_or(false) {
                    interrupt.send_replace(true);
                }
            }
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
        sql.query(&client, store.via(), params)
            .await
            .map_err(classify)
    })
    .await
}

/// Releases hold `key` at `fence` by `sql` (with `more` parameters after the two), and
/// announces it, on a task of its own: the committed turn's answer does not wait for it. Should
/// it fail, the hold runs out.
fn release_after_commit(
    store: &PostgresStore,
    key: &StateKey,
    fence: Version,
    sql: &'static Sql,
    more: Option<serde_json::Value>,
) {
    let (store, key) = (store.clone(), key.clone());
    let fence = i64::try_from(fence.get()).unwrap_or(i64::MAX);
    tokio::spawn(async move {
        let released = match &more {
            None => query(&store, sql, &[&key.as_str(), &fence]).await,
            Some(more) => query(&store, sql, &[&key.as_str(), &fence, more]).await,
        };
        if let Err(e) = released {
            tracing::info!(error = %e, "releasing a committed turn's hold failed; it runs out");
        }
    });
}

#[async_trait]
impl LockedTurn for HeldTurn {
    /// The commit, with the hold's check in it; then the release, consuming what was handed to
    /// this turn.
    async fn commit(mut self: Box<Self>, commit: Commit) -> Result<CommitOutcome, StoreError> {
        self.end();
        let outcome = self.commit_checked(commit).await;
        if let Ok(CommitOutcome::Committed(_)) = &outcome {
            release_after_commit(&self.store, &self.key, self.fence, &RELEASE_COMMITTED, None);
        }
        outcome
    }

    async fn release(mut self: Box<Self>) {
        self.end();
        if let Err(e) = release(&self.store, &self.key, self.fence).await {
            tracing::info!(error = %e, "releasing a conversation's hold failed; it runs out");
        }
    }

    fn handed(&self) -> &Handed {
        &self.handed
    }

    fn interrupted(&self) -> futures::future::BoxFuture<'static, ()> {
        let mut asked = self.interrupt.subscribe();
        Box::pin(async move {
            // Dropped with the turn: then nobody waits any more.
            if asked.wait_for(|asked| *asked).await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }

    /// The interrupted turn's receipt, with the hold's check; then the release, handing its
    /// activity on.
    async fn supersede(
        mut self: Box<Self>,
        commit: Commit,
        activity: serde_json::Value,
    ) -> Result<CommitOutcome, StoreError> {
        self.end();
        let outcome = self.commit_checked(commit).await;
        if let Ok(CommitOutcome::Committed(_)) = &outcome {
            release_after_commit(
                &self.store,
                &self.key,
                self.fence,
                &RELEASE_SUPERSEDED,
                Some(activity),
            );
        }
        outcome
    }
}

impl Drop for HeldTurn {
    fn drop(&mut self) {
        self.renewing.abort();
        if let Some(hearing) = &self.hearing {
            hearing.abort();
        }
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
