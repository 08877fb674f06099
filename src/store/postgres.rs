//! The PostgreSQL store: the one every replica shares, and the only place in the service with SQL.
//!
//! One row per key, its `version` column the ETag. A load is one `SELECT` of the turn's keys, a
//! single statement and so a single consistent snapshot; the loads of turns that arrive while
//! others run share one ([`group_load`]). A commit is one call of the
//! `turnstile_commit` function (see `migrations/V1__turn_state.sql`), which checks every key's
//! version, locks in key order and writes all scopes or none — one round trip, whatever the number
//! of scopes. The common commit, one scope written plus the receipt, skips the function for a
//! plain statement with the same outcome, shared by the concurrent turns of every conversation
//! ([`group_commit`]). Statements are prepared once per pooled connection, or, behind a pooler
//! in transaction mode, sent unnamed with their parameters so that none outlives its transaction
//! ([`Statements`]). Connections use TLS as libpq's `sslmode` and `sslrootcert` say ([`tls`]).
//! A locked turn holds its conversation in a transaction of its own ([`lock`]).
//!
//! The database URL is parsed at the start with errors that name the mistake ([`url`]), a
//! connection that fails says where to and why ([`diagnose`]), and a server started over a
//! schema its migrations have not reached holds turns at a gate until they have ([`schema`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use async_trait::async_trait;
use deadpool_postgres::{
    Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime, TimeoutType,
};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{Json, ToSql, Type};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, Expected, KeyHasher, KeyMap,
    Receipt, Snapshot, Store, StoreError, Version, Versioned, Versions,
};
use crate::activity::JsonMap;
use crate::state::StateKey;

/// Whether state row `s` has been unwritten for longer than its scope's time to live (`$3`
/// conversation, `$4` user, `$5` private conversation, in seconds; NULL: for ever).
macro_rules! idle_past_its_ttl {
    () => {
        "s.updated_at < now() - make_interval(secs => CASE \
            WHEN split_part(s.key, '/', 3) = 'users' AND split_part(s.key, '/', 5) = '' \
                 THEN $4::float8 \
            WHEN split_part(s.key, '/', 3) = 'conversations' \
                 AND split_part(s.key, '/', 5) = '' THEN $3::float8 \
            WHEN split_part(s.key, '/', 3) = 'conversations' \
                 AND split_part(s.key, '/', 5) = 'users' \
                 AND split_part(s.key, '/', 7) = '' THEN $5::float8 \
            END)"
    };
}

/// The tombstones older than a day, which [`PRUNE_TOMBSTONES`] deletes: a `FROM` clause, for
/// deleting them and for asking whether there are any.
macro_rules! old_tombstones {
    () => {
        "FROM turnstile_tombstone WHERE erased_at < now() - interval '1 day'"
    };
}

/// The tombstones of the rows a statement's `gone` deleted (`migrations/V4__erasure.sql`): a CTE,
/// for the erasures and the sweep on every engine.
macro_rules! tombstones_of_gone {
    () => {
        "tombs AS (INSERT INTO turnstile_tombstone (key_hash, version) \
           SELECT turnstile_key_hash(key), version FROM gone \
           ON CONFLICT (key_hash) DO UPDATE \
              SET version = greatest(turnstile_tombstone.version, excluded.version), \
                  erased_at = excluded.erased_at)"
    };
}

/// The end of a sweep's step: the tombstones of what it deleted, then the last key it looked at
/// (of `batch`), how many it looked at, and how many went (`gone`).
macro_rules! sweep_answer {
    () => {
        concat!(
            tombstones_of_gone!(),
            " SELECT (SELECT max(key) FROM batch), (SELECT count(*) FROM batch), \
                     (SELECT count(*) FROM gone)"
        )
    };
}

/// The hash by which the tombstone of the key that SQL expression `$key` gives is stored
/// (`migrations/V4__erasure.sql`), written out as `turnstile_key_hash` computes it. A call of that
/// SQL function costs PostgreSQL a plan of its body at every execution of the statement: a lookup
/// of a tombstone by it took 119 µs a round trip against 82 written out (`bench/RESULTS.md`).
macro_rules! key_hash {
    ($key:literal) => {
        concat!("sha256(convert_to(", $key, ", 'UTF8'))")
    };
}

/// The version of the tombstone of the key SQL expression `$key` gives, 0 when it has none: the
/// version a key is created above (`migrations/V4__erasure.sql`).
macro_rules! tombstone_version {
    ($key:literal) => {
        concat!(
            "coalesce((SELECT t.version FROM turnstile_tombstone t WHERE t.key_hash = ",
            key_hash!($key),
            "), 0)"
        )
    };
}

mod batch_failure;
mod bytewise;
mod deadlock;
mod diagnose;
mod group_commit;
mod group_load;
pub mod hold;
mod jsonb;
mod layout;
mod lock;
mod prepared;
mod receipts;
pub mod schema;
mod task_queue;
mod timeouts;
pub mod tls;
mod url;
mod waker;

pub use citus::{Citus, CitusError, CitusLayout};
pub use diagnose::ConnectError;
pub use group_commit::GroupCommitStats;
use group_commit::{GroupCommit, SingleWrite};
use group_load::GroupLoad;
pub use group_load::{GroupLoadStats, LOADS_IN_FLIGHT};
pub use lock::lock_table;
pub use schema::{SchemaBehind, SchemaStatus};
use timeouts::{CALL_TIMEOUT, STATEMENT_TIMEOUT, within_call_timeout};
pub use url::{DatabaseUrl, ParsedUrl, Schema, UrlError};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// The load's last part: the receipt of `$2`, when it is not NULL. `$receipt_and`, if given, is a
/// condition on the receipt put before its key's (`"shard = $3 AND "` on Citus).
macro_rules! load_receipt {
    () => {
        load_receipt!("")
    };
    ($receipt_and:literal) => {
        concat!(
            "SELECT 1::int2, key, payload, 0, NULL FROM ( \
               SELECT key, payload FROM turnstile_receipt WHERE ",
            $receipt_and,
            "key = $2 \
               UNION ALL \
               SELECT key, payload FROM turnstile_receipt_legacy WHERE ",
            $receipt_and,
            "key = $2 LIMIT 1) r"
        )
    };
}

/// The keys [`LOAD`] and [`LOAD_HOLDING`] read, one by one: `$1[1]` to `$1[3]` (the conversation,
/// user and private-conversation scopes of a turn; NULL past the array's end), so that
/// PostgreSQL's estimate for them is the same with and without the values. Written as
/// `key = ANY($1)` instead, the estimate of a generic plan assumes ten keys, a plan for the
/// values is always cheaper, and PostgreSQL plans the statement again at every execution: two
/// thirds of what a load cost it (`bench/RESULTS.md`). A load of more keys goes by
/// [`LOAD_ANY`].
const FEW_KEYS: usize = 3;
macro_rules! few_keys {
    () => {
        "IN (($1::text[])[1], ($1::text[])[2], ($1::text[])[3])"
    };
}
/// The same keys as a `FROM` item of one column.
macro_rules! few_key_rows {
    () => {
        "(VALUES (($1::text[])[1]), (($1::text[])[2]), (($1::text[])[3]))"
    };
}

/// The same for any number of keys.
macro_rules! any_keys {
    () => {
        "= ANY($1)"
    };
}

/// The tombstones (`migrations/V4__erasure.sql`) of those of the keys in `$keys` (a `FROM` item,
/// one column) that have no row, each looked up (and its key hashed, `key_hash!`) only when an
/// index-only probe finds no row (a one-time filter): for a load that reads its rows in another
/// part of its statement.
macro_rules! tombstones_of_absent {
    ($keys:expr) => {
        concat!(
            "SELECT 2::int2, v.k, NULL, t.version, NULL FROM ",
            $keys,
            " AS v(k) \
               JOIN LATERAL (SELECT version FROM turnstile_tombstone \
                              WHERE NOT EXISTS (SELECT FROM turnstile_state WHERE key = v.k) \
                                AND key_hash = ",
            key_hash!("v.k"),
            " OFFSET 0) t ON true \
              WHERE v.k IS NOT NULL"
        )
    };
}

/// The start of a load's state rows, with their ages: the key condition follows.
macro_rules! state_rows_where_key {
    () => {
        "SELECT 0::int2, key, state, version, extract(epoch FROM now() - updated_at)::float8 \
           FROM turnstile_state WHERE key "
    };
}

/// Each key's state row with its age (seconds since written, for expiry), or, when it has none,
/// its tombstone (`migrations/V4__erasure.sql`), if any: the first column says which, [`ROW`] or
/// [`GONE`]. `$keys` is a `FROM` item of the keys, one column. Each key is looked up by a subquery
/// of its own (`LATERAL … OFFSET 0`, which PostgreSQL cannot merge into a join): an index lookup
/// per key, whatever the estimates, and none for a NULL (past the end of [`LOAD`]'s array).
///
/// A key's tombstone is looked for (and its key hashed, `key_hash!`) only when it has no row, the
/// lookup gated by that (a one-time filter): most keys a turn loads exist, and a tombstone under a
/// row is ignored anyway. `$state_and`, if given, is a condition on the state row put before its
/// key's (`"shard = $3 AND "` on Citus).
macro_rules! rows_or_tombstones {
    ($keys:expr) => {
        rows_or_tombstones!($keys, "")
    };
    ($keys:expr, $state_and:literal) => {
        concat!(
            "SELECT (CASE WHEN s.version IS NULL THEN 2 ELSE 0 END)::int2, v.k, s.state, \
                    coalesce(s.version, t.version), \
                    extract(epoch FROM now() - s.updated_at)::float8 \
               FROM ",
            $keys,
            " AS v(k) \
               LEFT JOIN LATERAL (SELECT state, version, updated_at FROM turnstile_state \
                                   WHERE ",
            $state_and,
            "key = v.k OFFSET 0) s ON true \
               LEFT JOIN LATERAL (SELECT version FROM turnstile_tombstone \
                                   WHERE s.version IS NULL \
                                     AND key_hash = ",
            key_hash!("v.k"),
            " OFFSET 0) t ON true \
              WHERE v.k IS NOT NULL AND (s.version IS NOT NULL OR t.version IS NOT NULL)"
        )
    };
}

// Declared below the macros its statements share (`rows_or_tombstones!`, `load_receipt!`): a
// macro is seen only after its definition.
mod citus;

/// The rows or tombstones of keys `$1` (`rows_or_tombstones!` of `$keys`) and, when `$2` is not
/// NULL, the receipt: one statement, so one snapshot. The first column says which: [`ROW`],
/// [`RECEIPT`] or [`GONE`].
macro_rules! load_text {
    ($keys:expr) => {
        concat!(rows_or_tombstones!($keys), " UNION ALL ", load_receipt!())
    };
}

/// The load of a turn holding its conversation lock, which also locks the conversation's row
/// (`$3`) against writes until the turn's transaction ends: another replica's optimistic
/// commit of that conversation waits, and then finds the version moved. So a turn holding the
/// lock is not beaten by one that did not take it.
macro_rules! load_holding_text {
    ($keys:expr, $tombstones:expr) => {
        concat!(
            state_rows_where_key!(),
            $keys,
            " AND key <> $3 \
             UNION ALL \
             SELECT 0::int2, key, state, version, age FROM ( \
               SELECT key, state, version, extract(epoch FROM now() - updated_at)::float8 AS age \
                 FROM turnstile_state WHERE key = $3 FOR UPDATE) held \
             UNION ALL ",
            $tombstones,
            " UNION ALL ",
            load_receipt!()
        )
    };
}

/// The load (`load_text!`) of up to [`FEW_KEYS`] keys; [`load_of`] chooses.
const LOAD: Sql = Sql {
    text: load_text!(few_key_rows!()),
    types: &[Type::TEXT_ARRAY, Type::TEXT],
    // On Citus a load goes shard by shard (`citus::load_by_shard`), not through this.
    on_citus: None,
};
/// [`LOAD`] for any number of keys.
const LOAD_ANY: Sql = Sql {
    text: load_text!("unnest($1::text[])"),
    types: &[Type::TEXT_ARRAY, Type::TEXT],
    on_citus: None,
};
/// The loads of many turns together ([`group_load`]): the rows or tombstones of every key `$1`
/// (each once; `rows_or_tombstones!`), and the receipts `$2` — one statement, so one snapshot.
/// Rows are told apart by key, as the plain load's are.
///
/// The arrays are read through `jsonb_array_elements_text`, whose row estimate is fixed, never
/// with `= ANY` or `unnest`, whose estimates follow the arrays' lengths: then a plan made for the
/// values of a small batch is cheaper than the generic plan, and PostgreSQL plans the statement
/// again at every execution, which cost more than the batch saved (`bench/RESULTS.md`). With a
/// fixed estimate the generic plan is as cheap, and is kept. As a join, a small state table (or a
/// large tombstone table) was read whole by every batch, its hundred estimated keys hashed
/// against it (`bench/RESULTS.md`).
const LOAD_MANY: Sql = Sql {
    text: concat!(
        rows_or_tombstones!("jsonb_array_elements_text(to_jsonb($1::text[]))"),
        " UNION ALL \
         SELECT 1::int2, x.key, x.payload, 0, NULL \
           FROM jsonb_array_elements_text(to_jsonb($2::text[])) AS r(key) \
           JOIN LATERAL (SELECT key, payload FROM turnstile_receipt WHERE key = r.key \
                         UNION ALL \
                         SELECT key, payload FROM turnstile_receipt_legacy WHERE key = r.key) x \
             ON true"
    ),
    types: &[Type::TEXT_ARRAY, Type::TEXT_ARRAY],
    on_citus: None,
};
/// The load of a turn holding its conversation lock (`load_holding_text!`), up to [`FEW_KEYS`].
const LOAD_HOLDING: Sql = Sql {
    text: load_holding_text!(few_keys!(), tombstones_of_absent!(few_key_rows!())),
    types: &[Type::TEXT_ARRAY, Type::TEXT, Type::TEXT],
    on_citus: Some(&citus::LOAD_HOLDING),
};
/// [`LOAD_HOLDING`] for any number of keys.
const LOAD_HOLDING_ANY: Sql = Sql {
    text: load_holding_text!(any_keys!(), tombstones_of_absent!("unnest($1::text[])")),
    types: &[Type::TEXT_ARRAY, Type::TEXT, Type::TEXT],
    on_citus: Some(&citus::LOAD_HOLDING),
};

/// The load of `keys`: [`LOAD_HOLDING`] or its [`LOAD_HOLDING_ANY`] when `holding`, else [`LOAD`]
/// or [`LOAD_ANY`], by how many keys there are.
fn load_of(keys: usize, holding: bool) -> &'static Sql {
    match (keys <= FEW_KEYS, holding) {
        (true, false) => &LOAD,
        (false, false) => &LOAD_ANY,
        (true, true) => &LOAD_HOLDING,
        (false, true) => &LOAD_HOLDING_ANY,
    }
}
/// Runs a load statement that takes `keys` (`$1`) and `receipts` (`$2`: one receipt key or an
/// array of them): [`LOAD`], [`LOAD_ANY`] or [`LOAD_MANY`].
async fn load_by_keys(
    sql: &Sql,
    client: &deadpool_postgres::ClientWrapper,
    via: Via,
    keys: &[&str],
    receipts: &(dyn ToSql + Sync),
) -> Result<Vec<Row>, tokio_postgres::Error> {
    sql.query(client, via, &[&keys, receipts]).await
}
/// What a row of [`LOAD`] is: a state row.
const ROW: i16 = 0;
/// ... the receipt.
const RECEIPT: i16 = 1;
/// ... the tombstone of a key whose row was deleted.
const GONE: i16 = 2;
const COMMIT: Sql = Sql {
    text: "SELECT conflict_key, versions FROM turnstile_commit($1, $2, $3, $4, $5)",
    types: &[
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::JSONB_ARRAY,
        Type::TEXT,
        Type::JSONB,
    ],
    on_citus: None,
};
/// [`COMMIT`], also writing the receipts `$6` with payloads `$7` if it applies (those of other
/// activities one run answered; one that exists is kept): one statement, so all or none.
const COMMIT_WITH_RECEIPTS: Sql = Sql {
    text: "WITH c AS (SELECT conflict_key, versions FROM turnstile_commit($1, $2, $3, $4, $5)), \
                also AS ( \
             INSERT INTO turnstile_receipt (slot, key, payload) \
             SELECT unnest(turnstile_receipt_slots(r.key, true)), r.key, r.payload \
               FROM unnest($6::text[], $7::jsonb[]) AS r(key, payload), c \
              WHERE c.conflict_key IS NULL) \
           SELECT conflict_key, versions FROM c",
    types: &[
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::JSONB_ARRAY,
        Type::TEXT,
        Type::JSONB,
        Type::TEXT_ARRAY,
        Type::JSONB_ARRAY,
    ],
    on_citus: Some(&citus::COMMIT_WITH_RECEIPTS),
};
/// The rows of keys `$1` as stored, with when each was last written (Unix seconds).
const INSPECT: Sql = Sql {
    text: "SELECT false, key, state, version, extract(epoch FROM updated_at)::float8 \
             FROM turnstile_state WHERE key = ANY($1)",
    types: &[Type::TEXT_ARRAY],
    on_citus: Some(&citus::INSPECT),
};
/// The newest `$2` receipts whose keys start with `$1` (a conversation's receipts' prefix), with
/// when each was written: found by the conversation's index (`migrations/V4__erasure.sql`), then
/// by the prefix (the bot); each once (a receipt may be in two slots,
/// `migrations/V5__receipt_slots.sql`).
const INSPECT_RECEIPTS: Sql = Sql {
    text: "SELECT key, payload, extract(epoch FROM created_at)::float8 FROM ( \
             SELECT DISTINCT ON (key) key, payload, created_at FROM ( \
               SELECT key, payload, created_at FROM turnstile_receipt \
                WHERE turnstile_key_conversation(key) = turnstile_key_conversation($1) \
                  AND starts_with(key, $1) \
               UNION ALL \
               SELECT key, payload, created_at FROM turnstile_receipt_legacy \
                WHERE turnstile_key_conversation(key) = turnstile_key_conversation($1) \
                  AND starts_with(key, $1)) r \
             ORDER BY key, created_at) d \
            ORDER BY created_at DESC, key LIMIT $2",
    types: &[Type::TEXT, Type::INT8],
    on_citus: None,
};
/// The conversation scopes' rows with keys starting with `$1`, after key `$2` (any when null),
/// in key order, at most `$3` of them.
const LIST_CONVERSATIONS: Sql = Sql {
    text: "SELECT false, key, state, version, extract(epoch FROM updated_at)::float8 \
             FROM turnstile_state \
            WHERE ($2::text IS NULL OR key > $2) AND starts_with(key, $1) \
              AND key ~ '^[^/]+/[^/]+/conversations/[^/]+$' \
            ORDER BY key LIMIT $3",
    types: &[Type::TEXT, Type::TEXT, Type::INT8],
    on_citus: None,
};
/// Deletes the rows whose keys `$2` names (`user`: `turnstile_key_user(key) = $1`,
/// `conversation`: `turnstile_key_conversation(key) = $1`), each leaving its tombstone, and the
/// receipts of that user's activities or that conversation; answers the keys deleted, the
/// receipts' count and the time. One statement: all of it or nothing. A turn committing one of
/// the rows meanwhile waits for it, and then finds its row gone: a conflict.
macro_rules! erase {
    ($state:literal, $receipts:literal) => {
        concat!(
            "WITH gone AS (DELETE FROM turnstile_state WHERE ",
            $state,
            " RETURNING key, version), ",
            tombstones_of_gone!(),
            ", receipts AS (DELETE FROM turnstile_receipt WHERE ",
            $receipts,
            " RETURNING key), \
             legacy AS (DELETE FROM turnstile_receipt_legacy WHERE ",
            $receipts,
            " RETURNING key) \
             SELECT coalesce((SELECT array_agg(key ORDER BY key) FROM gone), '{}'), \
                    coalesce((SELECT array_agg(version ORDER BY key) FROM gone), '{}'), \
                    (SELECT count(DISTINCT key) FROM \
                       (SELECT key FROM receipts UNION ALL SELECT key FROM legacy) r), \
                    extract(epoch FROM now())::float8"
        )
    };
}
const ERASE_USER: Sql = Sql {
    text: erase!(
        "turnstile_key_user(key) = $1",
        "payload ? 'user' AND payload->>'user' = $1"
    ),
    types: &[Type::TEXT],
    on_citus: None,
};
const DELETE_CONVERSATION: Sql = Sql {
    text: erase!(
        "turnstile_key_conversation(key) = $1",
        "turnstile_key_conversation(key) = $1"
    ),
    types: &[Type::TEXT],
    on_citus: None,
};
/// One step of the expiry sweep: of the `$2` keys after `$1` (from the first when NULL), deletes
/// the rows unwritten for longer than their scope's time to live (`$3` conversation, `$4` user,
/// `$5` private conversation, in seconds; NULL: for ever), each leaving its tombstone; answers
/// the last key looked at and how many went. A row a turn is writing is skipped (it is being
/// written, so not idle), and so is one another replica's sweep has.
const SWEEP: Sql = Sql {
    text: concat!(
        "WITH batch AS ( \
             SELECT key FROM turnstile_state WHERE $1::text IS NULL OR key > $1::text \
              ORDER BY key LIMIT $2), \
           expired AS ( \
             SELECT s.key FROM turnstile_state s \
              WHERE s.key IN (SELECT key FROM batch) AND ",
        idle_past_its_ttl!(),
        " FOR UPDATE SKIP LOCKED), \
           gone AS ( \
             DELETE FROM turnstile_state WHERE key IN (SELECT key FROM expired) \
             RETURNING key, version), ",
        sweep_answer!()
    ),
    types: &[
        Type::TEXT,
        Type::INT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
    ],
    on_citus: Some(&citus::SWEEP),
};
/// The receipt table's primary key: violating it means the activity has committed already.
/// `turnstile_receipt_slots` raises it by this name; each slot's own is `turnstile_receipt_N_pkey`
/// (`migrations/V5__receipt_slots.sql`).
const RECEIPT_KEY_CONSTRAINT: &str = "turnstile_receipt_pkey";
const PRUNE_BATCH: u64 = 1000;
/// Deletes one batch of tombstones older than a day (`migrations/V4__erasure.sql`): no turn
/// lives that long, nor does a cached guess (`cached::MAX_GUESS_AGE`).
const PRUNE_TOMBSTONES: Sql = Sql {
    text: concat!(
        "DELETE FROM turnstile_tombstone WHERE key_hash IN ( \
           SELECT key_hash ",
        old_tombstones!(),
        " LIMIT 1000 FOR UPDATE SKIP LOCKED)"
    ),
    types: &[],
    on_citus: None,
};
/// Whether [`PRUNE_TOMBSTONES`] has anything to delete: asked first, because on Citus the
/// tombstones are a reference table, every write of which (even one that deletes nothing) is a
/// two-phase commit over all the nodes.
const OLD_TOMBSTONES: Sql = Sql {
    text: concat!("SELECT EXISTS (SELECT 1 ", old_tombstones!(), ")"),
    types: &[],
    on_citus: None,
};

/// The SQLSTATE `turnstile_commit` raises when a key it was to create appeared concurrently.
const COMMIT_CONFLICT: &str = "TS409";

/// Serializes `migrate` across replicas that start together: an arbitrary, fixed advisory lock id
/// ("turnstil" in ASCII), which `pg_locks` shows as an `advisory` lock with `classid` 1953854062
/// and `objid` 1937009004 (its high and low halves) while a migration runs.
pub const MIGRATION_LOCK: i64 = 0x7475_726e_7374_696c;

/// How long a turn waits for a pooled connection, or for a new one to be established, before the
/// store counts as unavailable.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a session outside the pool (`migrate`'s) waits for its connection (every host of the URL, TLS included) before it
/// gives up: a server that accepts the TCP connection and then says nothing must not hang a
/// start or a migration job.
const SESSION_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The planner setting of the store's sessions: a sequential scan only where no index serves.
///
/// Every statement of a turn finds its rows by key, and a connection keeps the plan it makes
/// for a prepared statement (and for the SQL functions it calls) until the statistics of a table
/// it reads change. A plan made while a table was empty, or analyzed empty, reads it whole, and
/// is kept while the table fills: a receipt slot is emptied before it is written again, and
/// autovacuum analyzes it empty; with the plans made then, each turn's receipt check read the
/// whole slot as it filled, 15 to 23 times fewer turns a second, until autovacuum analyzed it
/// again (`bench/RESULTS.md`; the state table on a new deployment does the same in its first
/// minute).
///
/// Off, a sequential scan costs the planner more than any index path, so it is chosen only where
/// no index serves (the receipts' clock, a sweep over a column without one).
///
/// JIT compilation goes off with it: a plan with such a scan then costs more than JIT's
/// threshold, and every execution of a statement of microseconds was compiled, in 50 ms (seen).
/// A URL whose options set `enable_seqscan` itself keeps its own options as they are. Sessions
/// through a transaction-mode pooler, which carry no startup options, get the same from the role
/// (`migrate` sets them there: `layout::settle`).
const PLANS_BY_INDEX: [(&str, &str); 2] = [("enable_seqscan", "off"), ("jit", "off")];

/// How statements reach PostgreSQL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Statements {
    /// Each statement is prepared once per connection and kept, so that a turn's statements
    /// are not parsed and planned again: the fast path, for a direct connection (or a pooler
    /// that keeps prepared statements, such as PgBouncer 1.21+ with `max_prepared_statements`).
    #[default]
    Prepared,
    /// Each statement is sent unnamed, with its parameters and their types, in one round trip,
    /// and nothing about the session is assumed to last beyond the transaction — not even the
    /// startup parameters: for PgBouncer in transaction mode and poolers like it.
    Unprepared,
}

/// How the store's statements reach PostgreSQL: prepared or sent unnamed, and written for a
/// single PostgreSQL or for a Citus cluster ([`citus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Via {
    pub(super) statements: Statements,
    /// Turnstile's tables are distributed by Citus: statements name each row's shard too.
    pub(super) citus: bool,
}

/// One of the store's statements: its text, its parameters' types for the unprepared path (the
/// prepared path asks the server for them once), and the statement a Citus cluster runs instead,
/// with the same parameters, when this one would ask every shard ([`citus`]).
pub(super) struct Sql {
    text: &'static str,
    types: &'static [Type],
    on_citus: Option<&'static Sql>,
}

impl Sql {
    /// The statement to send `via` there.
    fn on(&self, via: Via) -> &Self {
        match self.on_citus {
            Some(citus) if via.citus => citus,
            _ => self,
        }
    }

    /// `params` paired with the statement's parameter types, for an unnamed statement.
    fn typed<'p>(&self, params: &[&'p (dyn ToSql + Sync)]) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
        params
            .iter()
            .copied()
            .zip(self.types.iter().cloned())
            .collect()
    }

    /// Prepares the statement on `client` now, if `statements` says to prepare, so that a later
    /// call sends it the moment it is first polled. Calls on one connection that are polled
    /// together (`futures::join!`) then reach PostgreSQL in the order they are polled, in one
    /// round trip, and it runs them in that order.
    async fn ready(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        via: Via,
    ) -> Result<(), tokio_postgres::Error> {
        if let Statements::Prepared = via.statements {
            prepared::statement(client, self.on(via).text).await?;
        }
        Ok(())
    }

    /// Runs the statement on `client` the way `statements` says.
    async fn query(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        via: Via,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let sql = self.on(via);
        debug_assert_eq!(params.len(), sql.types.len(), "{}", sql.text);
        match via.statements {
            Statements::Prepared => {
                let statement = prepared::statement(client, sql.text).await?;
                client.query(&statement, params).await
            }
            Statements::Unprepared => client.query_typed(sql.text, &sql.typed(params)).await,
        }
    }

    /// Runs the statement on `client` the way `statements` says; returns the rows it changed.
    async fn execute(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        via: Via,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        let sql = self.on(via);
        debug_assert_eq!(params.len(), sql.types.len(), "{}", sql.text);
        match via.statements {
            Statements::Prepared => {
                let statement = prepared::statement(client, sql.text).await?;
                client.execute(&statement, params).await
            }
            Statements::Unprepared => client.execute_typed(sql.text, &sql.typed(params)).await,
        }
    }
}

/// Why the database cannot be used: its URL, the connection, or a migration.
#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    /// The URL is not valid.
    #[error(transparent)]
    Url(#[from] UrlError),
    /// No connection could be made.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A statement of a session outside the pool failed.
    #[error("{doing} failed")]
    Session {
        /// What the session was doing.
        doing: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// Another session held the migration lock all the while this one was willing to wait:
    /// its migration stalled, or it holds the lock for something else.
    #[error(
        "another session held the migration lock (advisory lock {MIGRATION_LOCK}) for {waited:?}: \
         its migration has stalled; `pg_locks` names the session"
    )]
    MigrationLockHeld {
        /// How long this one waited.
        waited: Duration,
    },
    /// The sessions' `search_path` does not reach the schema that holds Turnstile's tables:
    /// sessions through a transaction-mode pooler, which carry no startup options, during a
    /// rollout from 0.1.0 (`layout::settle` gives the role the path only after it).
    #[error(
        "Turnstile's tables are in schema {schema}, which this server's sessions do not reach \
         (their search_path is {search_path}). Through a transaction-mode pooler a session gets \
         its path from its role, which `turnstile migrate` sets only once no 0.1.0 replica can \
         be serving (it would find the wrong tables): during a rollout from 0.1.0, connect \
         without the pooler and with `--prepared-statements true`; after it, run `turnstile \
         migrate --drop-compat` and have the pooler open its sessions again (PgBouncer: \
         `RECONNECT`)"
    )]
    SchemaUnreached {
        /// The schema holding the migration history.
        schema: String,
        /// The sessions' path.
        search_path: String,
    },
    /// A migration failed.
    #[error("applying the database migrations failed")]
    Migration(#[source] refinery::Error),
    /// The tables could not be laid out for Citus.
    #[error(transparent)]
    Citus(#[from] CitusError),
    /// The pool gave no connection for another reason than the connection's own failure.
    #[error("getting a pooled PostgreSQL connection failed")]
    Pool(#[source] PoolError),
    /// The pool could not be built.
    #[error("building the PostgreSQL connection pool failed")]
    PoolBuild(#[source] deadpool_postgres::BuildError),
}

impl DatabaseUrl {
    /// Parses the connection string ([`DatabaseUrl::parse`]) and adds what every connection of
    /// this service needs: timeouts, keepalives, the application name, and the TLS connector.
    ///
    /// # Errors
    /// [`UrlError`] when the string is not valid, or its TLS settings name a root certificate
    /// file that cannot be read.
    pub fn connector(&self, statements: Statements) -> Result<Connector, UrlError> {
        let ParsedUrl {
            mut config,
            tls: settings,
        } = self.parse()?;
        let mut mode = settings.driver_mode();
        let unix_only = config
            .get_hosts()
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)));
        if unix_only && settings.mode == tls::SslMode::Prefer {
            // libpq never asks for TLS over a Unix socket.
            mode = tokio_postgres::config::SslMode::Disable;
        }
        config.ssl_mode(mode);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECTION_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("turnstile");
        }
        if statements == Statements::Prepared {
            // Turnstile's schema first (`migrate` sets the same for the role, in this database,
            // for sessions through a pooler, which cannot carry options), after any options the
            // URL gives; and plans that find rows by index ([`PLANS_BY_INDEX`]).
            let search_path = format!("-c search_path={},public", self.schema());
            let options = match config.get_options() {
                None => format!(
                    "-c statement_timeout={} {search_path}",
                    STATEMENT_TIMEOUT.as_millis()
                ),
                Some(given) if given.contains("search_path") => given.to_owned(),
                Some(given) => format!("{given} {search_path}"),
            };
            let options = if options.contains("enable_seqscan") {
                options
            } else {
                PLANS_BY_INDEX
                    .iter()
                    .fold(options, |o, (name, value)| format!("{o} -c {name}={value}"))
            };
            config.options(options);
        }
        if config.get_tcp_user_timeout().is_none() {
            // Unacknowledged data this long means the peer is gone: fail the connection.
            config.tcp_user_timeout(CALL_TIMEOUT);
        }
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10));
        let tls = settings
            .connector()
            .map_err(|e| UrlError::TlsSetup(format!("{e:#}")))?;
        Ok(Connector {
            target: diagnose::Target::of(&config, &settings),
            config,
            tls,
            settings,
        })
    }
}

/// What opening a connection takes: the driver's configuration and the TLS connector.
pub struct Connector {
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    settings: tls::TlsSettings,
    /// Where the connections go, for the words of their errors.
    target: diagnose::Target,
}

impl Connector {
    /// The driver's configuration (hosts, timeouts, TLS mode as tokio-postgres knows it).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The TLS settings in effect.
    pub fn tls(&self) -> &tls::TlsSettings {
        &self.settings
    }

    /// Opens one connection, a session of its own outside any pool, and spawns its driver
    /// (returned, so that the caller can wait for the session to end).
    ///
    /// # Errors
    /// [`ConnectError`] when no host of the URL accepts the connection within
    /// [`SESSION_CONNECT_TIMEOUT`], saying where to, why, and which TLS settings were tried.
    pub async fn connect(
        &self,
    ) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), ConnectError> {
        let (client, connection) = match tokio::time::timeout(
            SESSION_CONNECT_TIMEOUT,
            self.config.connect(self.tls.clone()),
        )
        .await
        {
            Err(_) => return Err(self.target.no_answer(SESSION_CONNECT_TIMEOUT)),
            Ok(Err(e)) => return Err(self.target.diagnose(e).await),
            Ok(Ok(connected)) => connected,
        };
        let driver = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a PostgreSQL session closed with an error");
            }
        });
        Ok((client, driver))
    }
}

/// Applies the embedded migrations that `url`'s database lacks, under an advisory lock so that
/// replicas starting together take turns. Returns how many were applied. A database migrated
/// past this binary (a newer release's rolling upgrade, or a rollback of this one) is left as
/// it is, with a warning: migrations only add, so this binary serves beside it.
///
/// # Errors
/// [`DatabaseError`]: the URL is invalid, the database cannot be reached (the error says why),
/// or a migration fails.
pub async fn migrate(url: &DatabaseUrl) -> Result<usize, DatabaseError> {
    migrate_with(url, CitusLayout::Detect)
        .await
        .map(|(applied, _)| applied)
}

/// [`migrate`], laying the tables out for Citus as `layout` says ([`citus`]): returns how many
/// migrations were applied, and what was found and done on Citus.
///
/// # Errors
/// As [`migrate`]'s, and [`DatabaseError::Citus`].
pub async fn migrate_with(
    url: &DatabaseUrl,
    layout: CitusLayout,
) -> Result<(usize, Citus), DatabaseError> {
    // A session of its own, straight to PostgreSQL: the advisory lock and refinery's
    // transactions need one, so this URL must not go through a transaction-mode pooler.
    let (mut client, connection) = url.connector(Statements::Prepared)?.connect().await?;
    let applied = migrate_on(&mut client, url.schema(), layout).await;
    // Closing the session releases the advisory lock, even if the migration failed.
    drop(client);
    let _ = connection.await;
    applied
}

/// How long a migration's statement waits for a table lock before its attempt is undone and tried
/// again ([`migrate_on`]).
const MIGRATION_LOCK_WAIT: Duration = Duration::from_millis(200);
/// The pause between two attempts, and how many there are: about two minutes in all.
const MIGRATION_RETRY_PAUSE: Duration = Duration::from_millis(300);
const MIGRATION_ATTEMPTS: u32 = 240;
/// How long a replica waits for another replica's migration ([`take_migration_lock`]): the
/// other's own lock waits last about two minutes at most ([`MIGRATION_ATTEMPTS`]), and its
/// statements their `statement_timeout` each. A holder past this has stalled.
const MIGRATION_LOCK_PATIENCE: Duration = Duration::from_secs(300);
/// How often a replica waiting for another's migration asks for the migration lock again.
const MIGRATION_LOCK_POLL: Duration = Duration::from_millis(250);

/// Applies the migrations on `client`'s session, under the migration lock.
///
/// A migration that alters a table the serving replicas use (the move into the schema, V5's
/// rename of the receipts) needs that table's exclusive lock, and waits for every transaction
/// using it — a leased conversation's can last seconds. Waiting, it would queue every other
/// turn's statement behind it, and an older replica reports a turn whose lock wait ran out as an
/// internal error. So each statement waits at most [`MIGRATION_LOCK_WAIT`]; past that its
/// migration is undone whole (each runs in a transaction, and each is written to run again), and
/// tried again after a pause, while turns go on in between.
async fn migrate_on(
    client: &mut tokio_postgres::Client,
    schema: &Schema,
    layout: CitusLayout,
) -> Result<(usize, Citus), DatabaseError> {
    take_migration_lock(client).await?;
    // The statement timeout bounds a turn's statements, not a migration's: a migration's DDL
    // (V2's 1,024 lock tables; distributing the tables on Citus) runs for seconds on a busy
    // database, and each attempt is undone whole. Its waits for the serving replicas' locks are
    // what must stay short, and `lock_timeout` keeps them so.
    client
        .batch_execute(&format!(
            "SET statement_timeout = 0; SET lock_timeout = {}",
            MIGRATION_LOCK_WAIT.as_millis()
        ))
        .await
        .map_err(|source| DatabaseError::Session {
            doing: "bounding the migration's lock waits",
            source,
        })?;
    let mut attempt = 1;
    loop {
        match apply(client, schema, layout).await {
            Err(e) if waited_for_a_lock(&e) && attempt < MIGRATION_ATTEMPTS => {
                if attempt == 1 {
                    tracing::info!(
                        "a migration waited for a table that running turns hold; trying again \
                         between them"
                    );
                }
                attempt += 1;
                tokio::time::sleep(MIGRATION_RETRY_PAUSE).await;
            }
            applied => break applied,
        }
    }
}

/// Takes the migration lock on `client`'s session, waiting while another replica's migration
/// holds it, up to [`MIGRATION_LOCK_PATIENCE`].
///
/// Replicas started together on a fresh database all migrate, one after another. Waiting by
/// `pg_advisory_lock` would wait within the session's `statement_timeout`, and a migration takes
/// longer than that where tables are distributed (Citus) or the database is busy: the waiting
/// replica stopped with "canceling statement due to statement timeout". So it asks, and asks
/// again, each question a statement of its own.
async fn take_migration_lock(client: &tokio_postgres::Client) -> Result<(), DatabaseError> {
    let started = std::time::Instant::now();
    let mut told = false;
    loop {
        let taken: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(|source| DatabaseError::Session {
                doing: "taking the migration lock",
                source,
            })?
            .get(0);
        if taken {
            return Ok(());
        }
        if started.elapsed() >= MIGRATION_LOCK_PATIENCE {
            return Err(DatabaseError::MigrationLockHeld {
                waited: MIGRATION_LOCK_PATIENCE,
            });
        }
        if !told {
            tracing::info!("another replica is migrating the database; waiting for it to finish");
            told = true;
        }
        tokio::time::sleep(MIGRATION_LOCK_POLL).await;
    }
}

/// Whether `e` is a lock wait that ran out ([`MIGRATION_LOCK_WAIT`]), anywhere in its chain.
fn waited_for_a_lock(e: &DatabaseError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = cause {
        if error
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(tokio_postgres::Error::code)
            == Some(&SqlState::LOCK_NOT_AVAILABLE)
        {
            return true;
        }
        cause = error.source();
    }
    false
}

/// One attempt of [`migrate_on`]: the move into the schema, the migrations, the settings, the
/// layout on Citus.
async fn apply(
    client: &mut tokio_postgres::Client,
    schema: &Schema,
    layout: CitusLayout,
) -> Result<(usize, Citus), DatabaseError> {
    let adopted =
        layout::prepare(client, schema)
            .await
            .map_err(|source| DatabaseError::Session {
                doing: "moving Turnstile's tables into their schema",
                source,
            })?;
    if adopted {
        tracing::info!(
            %schema,
            "moved Turnstile's tables from public into their schema, leaving views in public for \
             replicas of 0.1.0 (`turnstile migrate --drop-compat` removes them once none is left)"
        );
    }
    let found = schema::applied_version(client)
        .await
        .map_err(|source| DatabaseError::Session {
            doing: "reading the schema version",
            source,
        })?;
    if let status @ SchemaStatus::Ahead { .. } = SchemaStatus::of(found) {
        // refinery would refuse a history with versions it does not have.
        tracing::warn!("{status}; no migration to apply");
        return Ok((0, Citus::LeftToNewer));
    }
    let report = embedded::migrations::runner()
        .run_async(client)
        .await
        .map_err(DatabaseError::Migration)?;
    layout::settle(client, schema)
        .await
        .map_err(|source| DatabaseError::Session {
            doing: "pointing Turnstile's functions and role at its schema",
            source,
        })?;
    let citus = citus::apply(client, layout).await?;
    if citus == Citus::Absent {
        // Only faster: a rebuild that fails leaves the indexes as they were, correct, and the
        // next migration tries again. A swap that waited too long for its lock is tried again
        // now, with the rest of the attempt.
        match bytewise::rebuild(client, schema).await {
            Err(source) if source.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                return Err(DatabaseError::Session {
                    doing: "rebuilding the receipts' indexes to compare bytewise",
                    source,
                });
            }
            Err(error) => tracing::warn!(
                %error,
                "rebuilding the receipts' indexes to compare bytewise failed; they are left as \
                 they were, and the next migration tries again"
            ),
            Ok(()) => {}
        }
    }
    Ok((report.applied_migrations().len(), citus))
}

/// Removes the views and the function that a migration from a release before 0.2 left in
/// `public` for that release's replicas (`layout`): run once the rollout has replaced them all.
///
/// # Errors
/// [`DatabaseError`]: the database cannot be reached, or a statement failed.
pub async fn drop_compat(url: &DatabaseUrl) -> Result<(), DatabaseError> {
    let (client, connection) = url.connector(Statements::Prepared)?.connect().await?;
    let dropped = match client.batch_execute(&layout::compat_removal()).await {
        Err(source) => Err(DatabaseError::Session {
            doing: "removing the views left for older replicas",
            source,
        }),
        // With no older replica left, sessions without startup options (through a
        // transaction-mode pooler) now get the schema on their path from the role.
        Ok(()) => layout::settle(&client, url.schema())
            .await
            .map_err(|source| DatabaseError::Session {
                doing: "pointing the role's sessions at Turnstile's schema",
                source,
            }),
    };
    drop(client);
    let _ = connection.await;
    dropped
}

/// Turn state in PostgreSQL, shared by every replica.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    statements: Statements,
    group: Arc<GroupCommit>,
    /// The loads of turns whose state is not cached, read together while others run.
    loads: Arc<GroupLoad>,
    /// Connections kept out of the pool by conversation leases (held or asked for).
    leases: lock::LeaseSlots,
    /// Closed while the schema is behind this binary's, when the server asked for checks.
    schema: Arc<schema::SchemaGate>,
    /// Where the pool's connections go, for the words of their errors.
    target: Arc<diagnose::Target>,
    /// Wakes the turns waiting here for a conversation's hold when it is released.
    waker: Arc<waker::Waker>,
    /// How long each scope lives unwritten.
    ttls: super::Ttls,
    /// Whether the tables are distributed by Citus, learned from the first connection.
    engine: Arc<citus::Engine>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("pool", &self.pool.status())
            .finish()
    }
}

impl PostgresStore {
    /// A store over a pool of at most `pool_size` connections to `url`. Connections are opened on
    /// demand, so this succeeds while the database is down.
    ///
    /// # Errors
    /// [`DatabaseError::Url`] when the URL is invalid.
    pub fn connect(url: &DatabaseUrl, pool_size: usize) -> Result<Self, DatabaseError> {
        Self::connect_with(url, pool_size, Statements::Prepared)
    }

    /// [`PostgresStore::connect`], with statements sent as `statements` says.
    ///
    /// # Errors
    /// [`DatabaseError::Url`] when the URL or its TLS settings are invalid.
    pub fn connect_with(
        url: &DatabaseUrl,
        pool_size: usize,
        statements: Statements,
    ) -> Result<Self, DatabaseError> {
        let connector = url.connector(statements)?;
        let target = Arc::new(connector.target);
        let waker = Arc::new(waker::Waker::new(
            connector.config.clone(),
            connector.tls.clone(),
        ));
        let manager = Manager::from_config(
            connector.config,
            connector.tls,
            ManagerConfig {
                // A connection the server closed (restart, failover) is noticed and replaced
                // before a turn gets it; one that broke silently fails that turn as unavailable.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .wait_timeout(Some(CONNECTION_TIMEOUT))
            .create_timeout(Some(CONNECTION_TIMEOUT))
            .recycle_timeout(Some(CONNECTION_TIMEOUT))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(DatabaseError::PoolBuild)?;
        let engine = Arc::<citus::Engine>::default();
        Ok(Self {
            group: Arc::new(GroupCommit::new(
                pool.clone(),
                statements,
                Arc::clone(&engine),
                DEFAULT_COMMITS_IN_FLIGHT,
            )),
            loads: Arc::new(GroupLoad::new(pool.clone(), LOADS_IN_FLIGHT)),
            leases: lock::LeaseSlots::new(lease_slots(pool_size)),
            pool,
            statements,
            schema: Arc::new(schema::SchemaGate::open()),
            target,
            waker,
            ttls: super::Ttls::NONE,
            engine,
        })
    }

    /// This store, where a row unwritten for its scope's time to live reads as absent (empty, at
    /// its version, so that a turn's commit writes over it in place) and
    /// [`Store::sweep_expired`] deletes it.
    #[must_use]
    pub fn with_ttls(self, ttls: super::Ttls) -> Self {
        Self { ttls, ..self }
    }

    /// Refuses every call from now until [`PostgresStore::check_schema`] finds a schema this
    /// binary can serve: for a server that did not migrate on start. (A store is open at first,
    /// as one built by hand over a database its caller migrated.)
    pub fn hold_until_schema_checked(&self) {
        self.schema.close_until_checked();
    }

    /// Reads the database's schema version, compares it with this binary's, and opens or closes
    /// the store's gate as it says.
    ///
    /// # Errors
    /// [`DatabaseError`] when no connection can be had (saying why) or the version cannot be
    /// read; the gate stays as it was.
    pub async fn check_schema(&self) -> Result<SchemaStatus, DatabaseError> {
        let client = match self.pool.get().await {
            Ok(client) => client,
            Err(PoolError::Backend(e)) => return Err(self.target.diagnose(e).await.into()),
            Err(PoolError::Timeout(TimeoutType::Create)) => {
                return Err(self.target.no_answer(CONNECTION_TIMEOUT).into());
            }
            Err(e) => return Err(DatabaseError::Pool(e)),
        };
        let found =
            schema::applied_version(&client)
                .await
                .map_err(|source| DatabaseError::Session {
                    doing: "reading the schema version",
                    source,
                })?;
        if found.is_none()
            && let Some((schema, search_path)) =
                schema::unreached(&client)
                    .await
                    .map_err(|source| DatabaseError::Session {
                        doing: "looking for Turnstile's schema",
                        source,
                    })?
        {
            return Err(DatabaseError::SchemaUnreached {
                schema,
                search_path,
            });
        }
        let status = SchemaStatus::of(found);
        self.schema.record(status);
        Ok(status)
    }

    /// This store with at most `commits_in_flight` group-commit statements in flight at once,
    /// or [`DEFAULT_COMMITS_IN_FLIGHT`] for `None`.
    #[must_use]
    pub fn with_commits_in_flight(self, commits_in_flight: Option<usize>) -> Self {
        let Some(slots) = commits_in_flight else {
            return self;
        };
        Self {
            group: Arc::new(GroupCommit::new(
                self.pool.clone(),
                self.statements,
                Arc::clone(&self.engine),
                slots,
            )),
            ..self
        }
    }

    /// The connection pool's current size and waiters.
    pub fn pool_status(&self) -> deadpool_postgres::Status {
        self.pool.status()
    }

    /// What the group commit of this store has done so far.
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        self.group.stats()
    }

    /// What the group load has done so far.
    pub fn group_load_stats(&self) -> GroupLoadStats {
        self.loads.stats()
    }

    /// A pooled connection, once the store knows whether Citus distributes its tables.
    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.engine.learn(&self.pool).await?;
        client_of(&self.pool).await
    }

    /// How this store's statements are sent: as configured, in the dialect the tables need.
    pub(super) fn via(&self) -> Via {
        Via {
            statements: self.statements,
            citus: self.engine.is_citus(),
        }
    }
}

/// How many group-commit statements one replica keeps in flight by default: one, carrying every
/// commit that queued while the previous one ran, with the next sent behind it on its connection
/// once as many commits wait (not behind a pooler in transaction mode).
///
/// A database flushes its WAL one commit after another, so a second statement in flight mostly
/// waits for the first one's flush, and meanwhile splits the waiting turns into more, smaller
/// transactions, each with its own flush and its own per-statement work. At 32 calls one
/// statement in flight committed 1.3 to 1.4 times the turns a second of two, and 1.4 to 1.8 times
/// those of four (the earlier default), for less database CPU per turn; at 8 calls one and two
/// were alike (`bench/RESULTS.md`). A database whose round trip is long against its flush — a
/// distant one — is better served by more (`--commits-in-flight`).
pub const DEFAULT_COMMITS_IN_FLIGHT: usize = 1;

/// How many connections of a pool of `pool_size` conversation leases may keep: half, so that the
/// leased conversations' turns, which load and commit on other connections, always find one.
fn lease_slots(pool_size: usize) -> usize {
    (pool_size / 2).max(1)
}

/// The snapshot a load's `rows` make (a state row, a tombstone or the receipt each, as [`LOAD`]
/// returns them), each row older than its scope's time to live in `ttls` read as absent.
fn snapshot_of<'r>(
    rows: impl IntoIterator<Item = &'r Row>,
    ttls: &super::Ttls,
) -> Result<Snapshot, StoreError> {
    let rows = rows.into_iter();
    let mut states = KeyMap::with_capacity_and_hasher(rows.size_hint().0, KeyHasher::default());
    let mut found_receipt = None;
    let mut gone = Vec::new();
    let mut expiries = Vec::new();
    for row in rows {
        match row.try_get::<_, i16>(0).map_err(unexpected)? {
            RECEIPT => {
                let jsonb::JsonbText(payload) = row.try_get(2).map_err(unexpected)?;
                let payload = Receipt::from_text(payload)
                    .map_err(|e| StoreError::Unexpected(anyhow::Error::new(e)))?;
                found_receipt = Some(payload);
            }
            GONE => {
                let key: String = row.try_get(1).map_err(unexpected)?;
                let version: i64 = row.try_get(3).map_err(unexpected)?;
                let version =
                    u64::try_from(version).map_err(|e| StoreError::Unexpected(e.into()))?;
                gone.push((StateKey::from_stored(key), Version::new(version)));
            }
            ROW => {
                let (key, mut versioned) = read_row(row).map_err(StoreError::Unexpected)?;
                if let Some(ttl) = ttls.of(&key) {
                    let age: Option<f64> = row.try_get(4).map_err(unexpected)?;
                    let age = Duration::try_from_secs_f64(age.unwrap_or(0.0).max(0.0))
                        .unwrap_or(Duration::MAX);
                    let remaining = ttl.checked_sub(age).filter(|r| !r.is_zero());
                    if remaining.is_none() {
                        // Expired: absent to the turn, its version kept, so that the turn's
                        // commit writes over the row in place (or conflicts with the sweep).
                        versioned.state = Arc::default();
                    }
                    expiries.push((key.clone(), remaining));
                }
                states.insert(key, versioned);
            }
            other => {
                return Err(StoreError::Unexpected(anyhow!(
                    "a load row of kind {other}"
                )));
            }
        }
    }
    // A key is gone only while it has no row: a tombstone stays after the key is created
    // again (above it), and is then ignored.
    let snapshot = gone.into_iter().fold(
        Snapshot::new(states, found_receipt),
        |snapshot, (key, version)| snapshot.with_gone(key, version),
    );
    Ok(expiries
        .into_iter()
        .fold(snapshot, |snapshot, (key, remaining)| {
            snapshot.with_expiry(key, remaining)
        }))
}

/// A connection from `pool`, or why there is none.
async fn client_of(pool: &Pool) -> Result<deadpool_postgres::Object, StoreError> {
    pool.get().await.map_err(|e| match e {
        PoolError::Backend(e) => classify(e),
        PoolError::Timeout(_) | PoolError::Closed => StoreError::Unavailable(e.into()),
        other => StoreError::Unexpected(other.into()),
    })
}

#[async_trait]
impl Store for PostgresStore {
    #[tracing::instrument(level = "debug", skip_all, fields(keys = keys.len()))]
    async fn load(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        self.schema.admit()?;
        within_call_timeout(self.load_now(keys, receipt)).await
    }

    #[tracing::instrument(level = "debug", skip_all, fields(keys = commit.changes().len()))]
    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        self.schema.admit()?;
        // Each commit's future boxed where it is made: unboxed, it made this future kilobytes
        // large, and the timeout, the span wrapper and `async_trait`'s box each copied it whole
        // (`bench/RESULTS.md`).
        self.engine.learn(&self.pool).await?;
        if self.engine.is_citus() && one_shard_of(&commit).is_none() {
            // A user's scope written with a conversation's receipt: two shards, so two-phase
            // commit, by the coordinator. The group commit sends together the writes that one
            // node runs whole.
            return within_call_timeout(Box::pin(self.commit_now(&commit))).await;
        }
        match SingleWrite::try_from(commit) {
            // Within `CALL_TIMEOUT` too, by timers the group commit sets per batch rather
            // than one per commit (`GroupCommit::commit`).
            Ok(write) => Box::pin(self.group.commit(write)).await,
            Err(commit) => within_call_timeout(Box::pin(self.commit_now(&commit))).await,
        }
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn lock_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
    ) -> Result<ConversationLock, StoreError> {
        self.schema.admit()?;
        lock::lock_conversation(self, conversation, keys, receipt, wait).await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn hold_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
        others: crate::store::Others,
    ) -> Result<ConversationLock, StoreError> {
        self.schema.admit()?;
        hold::hold_conversation(self, conversation, keys, receipt, wait, others).await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn inspect(
        &self,
        keys: &[StateKey],
        receipts_under: &str,
        receipts: usize,
    ) -> Result<crate::store::Inspected, StoreError> {
        self.schema.admit()?;
        let client = self.client().await?;
        let names: Vec<&str> = keys.iter().map(StateKey::as_str).collect();
        let limit = i64::try_from(receipts).unwrap_or(i64::MAX);
        within_call_timeout(async {
            let rows = INSPECT
                .query(&client, self.via(), &[&names])
                .await
                .map_err(classify)?;
            let found = INSPECT_RECEIPTS
                .query(&client, self.via(), &[&receipts_under, &limit])
                .await
                .map_err(classify)?;
            let mut rows = rows
                .iter()
                .map(inspected_row)
                .collect::<anyhow::Result<Vec<_>>>()
                .map_err(StoreError::Unexpected)?;
            // In the order asked, as the rows come from several shards on Citus.
            rows.sort_by_key(|row| keys.iter().position(|k| *k == row.key));
            let receipts = found
                .iter()
                .map(|row| {
                    let key: String = row.try_get(0)?;
                    let jsonb::JsonbText(payload) = row.try_get(1)?;
                    let created: Option<f64> = row.try_get(2)?;
                    Ok(crate::store::InspectedReceipt {
                        key: StateKey::from_stored(key),
                        payload: Receipt::from_text(payload)?,
                        created_at: created.and_then(unix_time),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()
                .map_err(StoreError::Unexpected)?;
            Ok(crate::store::Inspected { rows, receipts })
        })
        .await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn list_conversations(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<crate::store::InspectedRow>, StoreError> {
        self.schema.admit()?;
        let client = self.client().await?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        within_call_timeout(async {
            let rows = LIST_CONVERSATIONS
                .query(&client, self.via(), &[&prefix, &after, &limit])
                .await
                .map_err(classify)?;
            rows.iter()
                .map(inspected_row)
                .collect::<anyhow::Result<Vec<_>>>()
                .map_err(StoreError::Unexpected)
        })
        .await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn sweep_expired(
        &self,
        after: Option<&str>,
        batch: usize,
    ) -> Result<crate::store::Swept, StoreError> {
        self.schema.admit()?;
        let client = self.client().await?;
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let [conversation, user, private] = self.ttls.seconds();
        within_call_timeout(async {
            let row = SWEEP
                .query(
                    &client,
                    self.via(),
                    &[&after, &limit, &conversation, &user, &private],
                )
                .await
                .map_err(classify)?
                .into_iter()
                .next()
                .ok_or_else(|| StoreError::Unexpected(anyhow!("a sweep answered no row")))?;
            let last: Option<String> = row.try_get(0).map_err(unexpected)?;
            let looked: i64 = row.try_get(1).map_err(unexpected)?;
            let deleted: i64 = row.try_get(2).map_err(unexpected)?;
            Ok(crate::store::Swept {
                next: last.filter(|_| looked >= limit),
                deleted: u64::try_from(deleted).unwrap_or_default(),
            })
        })
        .await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn erase(
        &self,
        erasure: &crate::store::Erasure,
    ) -> Result<crate::store::Erased, StoreError> {
        self.schema.admit()?;
        let client = self.client().await?;
        let statement = match erasure {
            crate::store::Erasure::User(_) => &ERASE_USER,
            crate::store::Erasure::Conversation(_) => &DELETE_CONVERSATION,
        };
        let subject = erasure.subject();
        within_call_timeout(async {
            let rows = statement
                .query(&client, self.via(), &[&subject])
                .await
                .map_err(|e| {
                    if is_conflict(&e) {
                        // A deadlock with a turn's commit: nothing was deleted; asked again,
                        // it goes through.
                        StoreError::Unavailable(e.into())
                    } else {
                        classify(e)
                    }
                })?;
            let row = rows
                .first()
                .ok_or_else(|| StoreError::Unexpected(anyhow!("an erasure answered no row")))?;
            let keys: Vec<String> = row.try_get(0).map_err(unexpected)?;
            let versions: Vec<i64> = row.try_get(1).map_err(unexpected)?;
            let receipts: i64 = row.try_get(2).map_err(unexpected)?;
            let at: Option<f64> = row.try_get(3).map_err(unexpected)?;
            let rows = keys
                .into_iter()
                .zip(versions)
                .map(|(key, version)| {
                    let version =
                        u64::try_from(version).map_err(|e| StoreError::Unexpected(e.into()))?;
                    Ok((StateKey::from_stored(key), Version::new(version)))
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            Ok(crate::store::Erased {
                rows,
                receipts: u64::try_from(receipts).unwrap_or_default(),
                at: at.and_then(unix_time),
            })
        })
        .await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn add_pending(
        &self,
        conversation: &StateKey,
        pending: &crate::store::Pending,
    ) -> Result<(), StoreError> {
        self.schema.admit()?;
        hold::add_pending(self, conversation, pending).await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn lease_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
    ) -> Result<ConversationLease, StoreError> {
        self.schema.admit()?;
        lock::lease_conversation(self, conversation, keys, receipt, wait).await
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn prune_receipts(&self, age: Duration) -> Result<u64, StoreError> {
        self.schema.admit()?;
        let pruned = receipts::prune(self, age).await?;
        let client = self.client().await?;
        // Tombstones, on the same schedule: few, and usually none.
        let any = OLD_TOMBSTONES
            .query(&client, self.via(), &[])
            .await
            .map_err(classify)?
            .first()
            .is_some_and(|row| row.get::<_, bool>(0));
        while any
            && PRUNE_TOMBSTONES
                .execute(&client, self.via(), &[])
                .await
                .map_err(classify)?
                >= PRUNE_BATCH
        {}
        Ok(pruned)
    }

    fn pool_status(&self) -> Option<super::PoolStatus> {
        let status = self.pool.status();
        Some(super::PoolStatus {
            in_use: status.size.saturating_sub(status.available),
            idle: status.available,
            waiting: status.waiting,
        })
    }
}

impl PostgresStore {
    async fn load_now(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        self.engine.learn(&self.pool).await?;
        let via = self.via();
        if via.citus {
            let client = client_of(&self.pool).await?;
            return Self::load_on(&client, via, keys, receipt, None, &self.ttls).await;
        }
        let loaded = self.loads.load(via, keys, receipt).await?;
        snapshot_of(loaded.rows(), &self.ttls)
    }

    /// [`Store::commit`] by `turnstile_commit`, in a transaction of its own: a deadlock's victim
    /// is sent again (`deadlock`).
    async fn commit_now(&self, commit: &Commit) -> Result<CommitOutcome, StoreError> {
        let client = self.client().await?;
        let via = self.via();
        let sent = deadlock::resending(
            || Self::send_commit(&client, via, commit),
            |sent| matches!(sent, Ok(Err(e)) if deadlock::is_victim(e)),
        )
        .await?;
        commit_answer(sent, via, commit)
    }

    /// [`Store::load`] on `client`; with `held`, a conversation key whose row it also locks
    /// until the transaction ends.
    async fn load_on(
        client: &deadpool_postgres::ClientWrapper,
        via: Via,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        held: Option<&StateKey>,
        ttls: &super::Ttls,
    ) -> Result<Snapshot, StoreError> {
        let names: Vec<&str> = keys.iter().map(StateKey::as_str).collect();
        let receipt_key = receipt.map(StateKey::as_str);
        let rows = match held {
            None if via.citus => citus::load_by_shard(client, via, &names, receipt_key).await,
            None => {
                load_by_keys(
                    load_of(names.len(), false),
                    client,
                    via,
                    &names,
                    &receipt_key,
                )
                .await
            }
            Some(held) => {
                let params: [&(dyn ToSql + Sync); 3] = [&names, &receipt_key, &held.as_str()];
                load_of(names.len(), true).query(client, via, &params).await
            }
        }
        .map_err(classify)?;
        snapshot_of(&rows, ttls)
    }

    /// [`Store::commit`] by `turnstile_commit` on `client`, in whatever transaction it has.
    async fn commit_on(
        client: &deadpool_postgres::ClientWrapper,
        via: Via,
        commit: &Commit,
    ) -> Result<CommitOutcome, StoreError> {
        commit_answer(Self::send_commit(client, via, commit).await?, via, commit)
    }

    /// Sends `commit` by `turnstile_commit` on `client`: PostgreSQL's answer, its rows or its
    /// error, for [`commit_answer`].
    async fn send_commit(
        client: &deadpool_postgres::ClientWrapper,
        via: Via,
        commit: &Commit,
    ) -> Result<Result<CommitSent, tokio_postgres::Error>, StoreError> {
        let changes = commit.changes();
        let keys: Vec<&str> = changes.iter().map(|c| c.key.as_str()).collect();
        let expected = changes
            .iter()
            .map(|c| expected_param(c.expected))
            .collect::<Result<Vec<i64>, _>>()?;
        let states: Vec<Option<jsonb::Jsonb<'_>>> = changes
            .iter()
            .map(|c| c.write.as_ref().map(|w| jsonb::Jsonb(w.json())))
            .collect();

        let receipt_key = commit.receipt().map(|(k, _)| k.as_str());
        let receipt = commit
            .receipt()
            .map(|(_, payload)| jsonb::Jsonb::text(payload.text()));

        let params: [&(dyn ToSql + Sync); 5] = [&keys, &expected, &states, &receipt_key, &receipt];
        let also_keys: Vec<&str> = commit
            .receipts_also()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        let also: Vec<jsonb::Jsonb<'_>> = commit
            .receipts_also()
            .iter()
            .map(|(_, payload)| jsonb::Jsonb::text(payload.text()))
            .collect();
        if let CommitBy::Shard(shard) = CommitBy::of(via, commit) {
            // On Citus, a commit on one shard goes to the worker that holds it, whole.
            let params: [&(dyn ToSql + Sync); 6] =
                [&shard, &keys, &expected, &states, &receipt_key, &receipt];
            return Ok(citus::COMMIT_IN
                .query(client, via, &params)
                .await
                .map(CommitSent::Delegated));
        }
        let queried = if also.is_empty() {
            COMMIT.query(client, via, &params).await
        } else {
            let params: [&(dyn ToSql + Sync); 7] = [
                &keys,
                &expected,
                &states,
                &receipt_key,
                &receipt,
                &also_keys,
                &also,
            ];
            COMMIT_WITH_RECEIPTS.query(client, via, &params).await
        };
        Ok(queried.map(CommitSent::Rows))
    }
}

/// What `turnstile_commit` answered ([`PostgresStore::send_commit`]).
enum CommitSent {
    /// Its rows.
    Rows(Vec<tokio_postgres::Row>),
    /// On Citus, the rows of the commit the node of its one shard ran ([`citus::COMMIT_IN`]).
    Delegated(Vec<tokio_postgres::Row>),
}

/// The outcome of `commit` from what PostgreSQL answered to it.
fn commit_answer(
    sent: Result<CommitSent, tokio_postgres::Error>,
    via: Via,
    commit: &Commit,
) -> Result<CommitOutcome, StoreError> {
    match sent {
        Ok(CommitSent::Rows(rows)) => outcome_of(&rows, commit.changes()),
        Ok(CommitSent::Delegated(rows)) => delegated_outcome(&rows, commit.changes()),
        Err(e) if is_conflict(&e) => Ok(conflict_from(&e, commit)),
        Err(e) => Err(classify_commit(e, via)),
    }
}

/// The one Citus shard of every key `commit` writes or checks and of its receipt, if there is one.
fn one_shard_of(commit: &Commit) -> Option<&str> {
    let keys = commit.changes().iter().map(|c| c.key.as_str());
    let receipt = commit.receipt().map(|(key, _)| key.as_str());
    citus::one_shard(keys.chain(receipt))
}

/// Which statement [`PostgresStore::commit_on`] sends for a commit.
enum CommitBy<'c> {
    /// On Citus, a commit on this one shard, without other receipts: [`citus::COMMIT_IN`].
    Shard(&'c str),
    /// A commit that also writes the receipts of other activities: [`COMMIT_WITH_RECEIPTS`].
    WithReceipts,
    /// Any other: [`COMMIT`].
    Plain,
}

impl<'c> CommitBy<'c> {
    fn of(via: Via, commit: &'c Commit) -> Self {
        if !commit.receipts_also().is_empty() {
            return Self::WithReceipts;
        }
        match one_shard_of(commit) {
            Some(shard) if via.citus => Self::Shard(shard),
            _ => Self::Plain,
        }
    }

    /// The statement, for preparing it before it is sent with others ([`Sql::ready`]).
    pub(super) fn statement(&self) -> &'static Sql {
        match self {
            Self::Shard(_) => &citus::COMMIT_IN,
            Self::WithReceipts => &COMMIT_WITH_RECEIPTS,
            Self::Plain => &COMMIT,
        }
    }
}

/// What `turnstile_commit`'s one row says of a commit of `changes`: the key that conflicted, or
/// every written or checked key's version.
fn outcome_of(rows: &[Row], changes: &[super::KeyChange]) -> Result<CommitOutcome, StoreError> {
    let [row] = rows else {
        return Err(StoreError::Unexpected(anyhow!(
            "turnstile_commit returned {} rows",
            rows.len()
        )));
    };
    let conflict_key: Option<String> = row.try_get(0).map_err(unexpected)?;
    if let Some(key) = conflict_key {
        return Ok(CommitOutcome::Conflict {
            key: StateKey::from_stored(key),
        });
    }
    versions_of(row.try_get(1).map_err(unexpected)?, changes)
}

/// What `turnstile_commit_in`'s JSON answer (`citus/functions.sql`) says of a commit of
/// `changes`: as [`outcome_of`].
fn delegated_outcome(
    rows: &[Row],
    changes: &[super::KeyChange],
) -> Result<CommitOutcome, StoreError> {
    #[derive(serde::Deserialize)]
    struct Answer {
        conflict: Option<String>,
        versions: Option<Vec<i64>>,
    }
    let [row] = rows else {
        return Err(StoreError::Unexpected(anyhow!(
            "turnstile_commit_in returned {} rows",
            rows.len()
        )));
    };
    let Json(answer): Json<Answer> = row.try_get(0).map_err(unexpected)?;
    match answer {
        Answer {
            conflict: Some(key),
            ..
        } => Ok(CommitOutcome::Conflict {
            key: StateKey::from_stored(key),
        }),
        Answer {
            versions: Some(versions),
            ..
        } => versions_of(versions, changes),
        Answer { .. } => Err(StoreError::Unexpected(anyhow!(
            "turnstile_commit_in answered neither a conflict nor versions"
        ))),
    }
}

/// The versions a commit of `changes` wrote or checked, one per change (0: checked absent).
fn versions_of(
    versions: Vec<i64>,
    changes: &[super::KeyChange],
) -> Result<CommitOutcome, StoreError> {
    if versions.len() != changes.len() {
        return Err(StoreError::Unexpected(anyhow!(
            "turnstile_commit returned {} versions for {} keys",
            versions.len(),
            changes.len()
        )));
    }
    let versions = changes
        .iter()
        .zip(versions)
        .filter(|(_, v)| *v > 0)
        .map(|(c, v)| Ok((c.key.clone(), Version::new(u64::try_from(v)?))))
        .collect::<Result<Versions, std::num::TryFromIntError>>()
        .map_err(|e| StoreError::Unexpected(e.into()))?;
    Ok(CommitOutcome::Committed(versions))
}

/// What a commit expects of a key, as `turnstile_commit` and the group commit's statements take
/// it: the version it read, or for a key it found absent a negative number, `-n`: create it at
/// version `n` (1 for a key never written, the version after its deletion for a key gone) if its
/// tombstone is still the version before, else nothing (`migrations/V4__erasure.sql`). 0, a
/// create at 1 refused over any tombstone, is what releases before 0.2 send.
pub(super) fn expected_param(expected: Expected) -> Result<i64, StoreError> {
    let param = match expected {
        Expected::Absent => Ok(-1),
        Expected::Gone(v) => i64::try_from(v.next().get()).map(|n| -n),
        Expected::Version(v) => i64::try_from(v.get()),
    };
    param.map_err(|e| StoreError::Unexpected(e.into()))
}

/// A row of [`INSPECT`] or [`LIST_CONVERSATIONS`]: [`read_row`]'s columns, then when it was
/// written.
fn inspected_row(row: &Row) -> anyhow::Result<crate::store::InspectedRow> {
    let (key, versioned) = read_row(row)?;
    let updated: Option<f64> = row.try_get(4)?;
    Ok(crate::store::InspectedRow {
        key,
        row: versioned,
        updated_at: updated.and_then(unix_time),
    })
}

/// The time `seconds` after the Unix epoch.
fn unix_time(seconds: f64) -> Option<std::time::SystemTime> {
    std::time::Duration::try_from_secs_f64(seconds)
        .ok()
        .map(|since| std::time::UNIX_EPOCH + since)
}

fn read_row(row: &Row) -> anyhow::Result<(StateKey, Versioned)> {
    let key: String = row.try_get(1)?;
    let Json(state): Json<JsonMap> = row
        .try_get(2)
        .with_context(|| format!("state of {key} is not a JSON object"))?;
    let version: i64 = row.try_get(3)?;
    let version = Version::new(u64::try_from(version).context("negative version")?);
    Ok((
        StateKey::from_stored(key),
        Versioned {
            state: state.into(),
            version,
        },
    ))
}

fn is_conflict(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        db.code().code() == COMMIT_CONFLICT
            || is_receipt_taken(db)
            || *db.code() == SqlState::T_R_SERIALIZATION_FAILURE
    }) || deadlock::is_victim(e)
}

/// The key of `receipt`, when `e` says it exists already.
fn taken_receipt<'a>(
    e: &tokio_postgres::Error,
    receipt: Option<&'a (StateKey, Receipt)>,
) -> Option<&'a StateKey> {
    let (key, _) = receipt?;
    e.as_db_error().is_some_and(is_receipt_taken).then_some(key)
}

/// Whether `db` says the receipt being created exists already.
fn is_receipt_taken(db: &tokio_postgres::error::DbError) -> bool {
    *db.code() == SqlState::UNIQUE_VIOLATION
        && db.constraint().is_some_and(|name| {
            name == RECEIPT_KEY_CONSTRAINT
                || name
                    .strip_prefix("turnstile_receipt_")
                    .and_then(|rest| rest.strip_suffix("_pkey"))
                    .is_some_and(|slot| slot.bytes().all(|b| b.is_ascii_digit()))
        })
}

/// The conflict a failed commit reports: the receipt's key when it exists already, else the key
/// named by the DETAIL of an error raised by `turnstile_commit`.
fn conflict_from(e: &tokio_postgres::Error, commit: &Commit) -> CommitOutcome {
    if let Some(receipt) = taken_receipt(e, commit.receipt()) {
        return CommitOutcome::Conflict {
            key: receipt.clone(),
        };
    }
    let mut keys = commit
        .changes()
        .iter()
        .map(|c| &c.key)
        .chain(commit.receipt().map(|(k, _)| k));
    let detail = e.as_db_error().and_then(|db| db.detail());
    let key = keys
        .clone()
        .find(|k| Some(k.as_str()) == detail)
        .or_else(|| keys.next())
        .cloned()
        .unwrap_or_else(|| StateKey::from_stored(String::new()));
    CommitOutcome::Conflict { key }
}

fn unexpected(e: tokio_postgres::Error) -> StoreError {
    StoreError::Unexpected(e.into())
}

/// [`classify`] for a commit's error. On Citus a commit the coordinator could not finish on a
/// worker (one lost at that moment: "could not commit transaction for shard … on at least one
/// active node") may have committed there or not, as when the connection itself is lost; Citus
/// raises it as an internal error (XX000), with no class of its own. So there an internal error
/// is an unknown outcome, which the engine resolves through the turn's receipt.
pub(super) fn classify_commit(e: tokio_postgres::Error, via: Via) -> StoreError {
    if via.citus && e.code() == Some(&SqlState::INTERNAL_ERROR) {
        StoreError::Unavailable(e.into())
    } else {
        classify(e)
    }
}

/// Sorts a driver error into "could not reach the database" and "something is wrong", by what
/// the error is (the server's SQLSTATE, a closed connection, an I/O failure underneath), never by
/// its message text.
fn classify(e: tokio_postgres::Error) -> StoreError {
    let unreachable = match e.code() {
        Some(code) => is_unreachable_state(code),
        // No answer from the server at all: a closed connection, or an I/O error (refused, reset,
        // a connect or TCP user timeout) anywhere under the driver's error.
        None => e.is_closed() || io_kind(&e).is_some(),
    };
    if unreachable {
        StoreError::Unavailable(e.into())
    } else {
        StoreError::Unexpected(e.into())
    }
}

/// Whether the server's `code` says it cannot serve now, rather than that the request is wrong:
/// class 08 (connection exceptions); class 57P (shutting down, starting, database dropped);
/// 53300 (too many connections); 57014 (a statement cancelled by `statement_timeout`: the
/// database is too slow or a lock is held too long, so retry later).
fn is_unreachable_state(code: &SqlState) -> bool {
    let class = code.code().get(..3).unwrap_or_default();
    class.starts_with("08")
        || class == "57P"
        || *code == SqlState::TOO_MANY_CONNECTIONS
        || *code == SqlState::QUERY_CANCELED
}

/// The kind of the I/O error under `e`, if one is in its chain of sources.
fn io_kind(e: &tokio_postgres::Error) -> Option<std::io::ErrorKind> {
    diagnose::io_error(e).map(std::io::Error::kind)
}

#[cfg(test)]
mod tests {
    use std::str::FromStr as _;

    use super::*;

    #[test]
    fn connection_states_are_unavailability_and_others_are_not() {
        for code in [
            SqlState::CONNECTION_EXCEPTION,
            SqlState::CONNECTION_FAILURE,
            SqlState::SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::QUERY_CANCELED,
        ] {
            assert!(is_unreachable_state(&code), "{}", code.code());
        }
        for code in [
            SqlState::UNDEFINED_TABLE,
            SqlState::UNIQUE_VIOLATION,
            SqlState::SYNTAX_ERROR,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::OUT_OF_MEMORY,
            SqlState::from_code("TS409"),
        ] {
            assert!(!is_unreachable_state(&code), "{}", code.code());
        }
    }

    #[tokio::test]
    async fn a_refused_connection_is_unavailable() {
        // A port that was just free: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let Err(e) = tokio_postgres::connect(
            &format!("host=127.0.0.1 port={port} user=nobody connect_timeout=5"),
            tokio_postgres::NoTls,
        )
        .await
        else {
            panic!("a connection where nothing listens");
        };
        assert_eq!(io_kind(&e), Some(std::io::ErrorKind::ConnectionRefused));
        assert!(matches!(classify(e), StoreError::Unavailable(_)));
    }

    /// The options a pooled connection starts with, for `url`.
    fn startup_options(url: &str, statements: Statements) -> Option<String> {
        let connector = DatabaseUrl::new(url).connector(statements).expect("a URL");
        connector.config().get_options().map(str::to_owned)
    }

    #[test]
    fn sessions_plan_by_index_unless_the_url_sets_enable_seqscan() {
        let plain = startup_options("postgres://app@h/db", Statements::Prepared).expect("options");
        assert!(plain.contains("-c search_path="), "{plain}");
        assert!(
            plain.ends_with("-c enable_seqscan=off -c jit=off"),
            "{plain}"
        );
        let given = startup_options(
            "postgres://app@h/db?options=-c%20enable_seqscan%3Don%20-c%20work_mem%3D8MB",
            Statements::Prepared,
        )
        .expect("the URL's options");
        assert!(
            given.starts_with("-c enable_seqscan=on -c work_mem=8MB"),
            "{given}"
        );
        assert!(given.contains("-c search_path="), "{given}");
        assert!(
            !given.contains("enable_seqscan=off") && !given.contains("jit"),
            "{given}"
        );
        // Behind a transaction-mode pooler: no startup options at all (the role carries them).
        assert_eq!(
            startup_options("postgres://app@h/db", Statements::Unprepared),
            None
        );
    }

    #[test]
    fn a_driver_error_without_state_or_io_underneath_is_unexpected() {
        let e = tokio_postgres::Config::from_str("port=not-a-number").expect_err("invalid");
        assert!(matches!(classify(e), StoreError::Unexpected(_)));
    }
}
