//! Turnstile on Citus, PostgreSQL's extension for spreading tables over several nodes: a
//! capability of the PostgreSQL store, found once, not a store of its own.
//!
//! `turnstile migrate` on a Citus coordinator (the `citus` extension in the database; `--citus`
//! makes its absence an error instead of a single-node layout) applies the migrations as
//! anywhere, then distributes the tables by a `shard` column — a conversation's rows, its receipts
//! included, on one shard; a user's on another — and installs the bodies of Turnstile's functions
//! that name each row's shard (`citus/distribute.sql` and `citus/functions.sql` say how, and
//! why). The store learns from its first connection whether the tables it serves are laid out so
//! ([`Engine`]), and from then on sends the statements of this module in place of those that
//! would ask every shard ([`super::Sql::on`]): each names its rows by `shard =
//! turnstile_key_shard(key)`, which Citus turns into the one shard to ask before it runs the
//! statement, so the parameters are the same as on a single PostgreSQL.

use std::sync::{Arc, Mutex, PoisonError};

use tokio_postgres::types::Type;

use super::Sql;
use crate::store::StoreError;

/// Distributes the tables: run once, in the migration's transaction.
const DISTRIBUTE: &str = include_str!("citus/distribute.sql");
/// Turnstile's functions as Citus runs them: installed after every migration.
const FUNCTIONS: &str = include_str!("citus/functions.sql");
/// Once the tables are distributed: the functions the workers run. `turnstile_commit_in` and the
/// group commit's `turnstile_commit_many_in`, by their shard argument, run where that shard is. The migrations' functions that statements sent to a
/// worker call are made known to every node: Citus propagates a function created while it is
/// installed, but not one a database had before (a single PostgreSQL moved to Citus).
const DELEGATE: &str = "\
    SELECT create_distributed_function( \
        'turnstile_commit_in(text, text[], bigint[], jsonb[], text, jsonb)', 'p_shard', \
        colocate_with => 'turnstile_state'); \
    SELECT create_distributed_function( \
        'turnstile_commit_many_in(text, text[], jsonb[], bigint[], text[], jsonb[])', 'p_shard', \
        colocate_with => 'turnstile_state'); \
    SELECT create_distributed_function('turnstile_key_hash(text)'); \
    SELECT create_distributed_function('turnstile_key_conversation(text)'); \
    SELECT create_distributed_function('turnstile_key_user(text)'); \
    SELECT create_distributed_function('turnstile_receipt_slot(timestamptz)');";

/// Whether `turnstile migrate` lays the tables out for Citus.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CitusLayout {
    /// When the database has the `citus` extension.
    #[default]
    Detect,
    /// Always: a database without the extension is an error (`--citus`).
    Required,
}

/// What `turnstile migrate` found and did on Citus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Citus {
    /// No `citus` extension: a single PostgreSQL.
    Absent,
    /// The tables were distributed by this migration.
    Distributed,
    /// The tables were distributed already; the functions were installed again.
    AlreadyDistributed,
    /// A newer release migrated the database: its layout and functions are left as they are.
    LeftToNewer,
}

/// Why the tables cannot be laid out for Citus.
#[derive(Debug, thiserror::Error)]
pub enum CitusError {
    /// `--citus`, and the database has no `citus` extension.
    #[error(
        "--citus was given, but the database has no citus extension: run `CREATE EXTENSION \
         citus` on the coordinator and add its workers first (or leave --citus out to migrate \
         a single PostgreSQL)"
    )]
    NoExtension,
    /// Replicas of a release before 0.2 may still use the views a migration left in `public`.
    #[error(
        "the views a migration left in public for replicas of 0.1.0 are still there: Citus cannot \
         serve those replicas. Stop them, run `turnstile migrate --drop-compat`, then migrate \
         again"
    )]
    OlderReplicaViews,
    /// A statement failed.
    #[error("{doing} failed")]
    Statement {
        /// What was being done.
        doing: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

/// After the migrations, on `client`'s session: distributes the tables if the database is a
/// Citus coordinator and they are not yet, and installs the functions' Citus bodies.
///
/// # Errors
/// [`CitusError`]: `--citus` without the extension, views left for older replicas, or a failed
/// statement (the distribution is undone whole).
pub(super) async fn apply(
    client: &mut tokio_postgres::Client,
    layout: CitusLayout,
) -> Result<Citus, CitusError> {
    let found = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus'), \
                    EXISTS (SELECT 1 FROM pg_views WHERE schemaname = 'public' \
                              AND viewname IN ('turnstile_state', 'turnstile_receipt') \
                              AND current_schema() <> 'public')",
            &[],
        )
        .await
        .map_err(failed("looking for the citus extension"))?;
    let (extension, compat_views): (bool, bool) = (found.get(0), found.get(1));
    if !extension {
        return match layout {
            CitusLayout::Detect => Ok(Citus::Absent),
            CitusLayout::Required => Err(CitusError::NoExtension),
        };
    }
    let distributed: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_dist_partition \
                             WHERE logicalrelid = 'turnstile_state'::regclass)",
            &[],
        )
        .await
        .map_err(failed("asking Citus whether the tables are distributed"))?
        .get(0);
    if !distributed && compat_views {
        return Err(CitusError::OlderReplicaViews);
    }
    let transaction = client
        .transaction()
        .await
        .map_err(failed("starting the Citus layout's transaction"))?;
    transaction
        .batch_execute(FUNCTIONS)
        .await
        .map_err(failed("installing the functions' Citus bodies"))?;
    if !distributed {
        transaction
            .batch_execute(DISTRIBUTE)
            .await
            .map_err(failed("distributing the tables over the Citus cluster"))?;
    }
    transaction
        .batch_execute(DELEGATE)
        .await
        .map_err(failed("distributing the commit function by its shard"))?;
    transaction
        .commit()
        .await
        .map_err(failed("committing the Citus layout"))?;
    Ok(if distributed {
        Citus::AlreadyDistributed
    } else {
        Citus::Distributed
    })
}

/// The error of a statement that failed while `doing` something.
fn failed(doing: &'static str) -> impl FnOnce(tokio_postgres::Error) -> CitusError {
    move |source| CitusError::Statement { doing, source }
}

/// Whether the tables a store serves are distributed by Citus: learned once, from the first
/// connection that finds them, then fixed for the store's life (a layout changes only by a
/// migration, which the replicas' restart follows). On Citus, also where the shards are
/// ([`ShardMap`]), which the group commit asks.
#[derive(Debug, Default)]
pub(super) struct Engine {
    citus: tokio::sync::OnceCell<bool>,
    shards: Mutex<Option<Arc<ShardMap>>>,
}

/// Why [`Engine::learn`] learned nothing.
enum NotLearned {
    /// The tables are not there, or not yet distributed on a Citus coordinator.
    Yet,
    /// No connection, or the query failed.
    Failed(StoreError),
}

impl Engine {
    /// Whether the store's statements must be Citus' ([`Sql::on`]); `false` until learned.
    pub(super) fn is_citus(&self) -> bool {
        self.citus.get().copied().unwrap_or(false)
    }

    /// Learns the layout on a connection from `pool`, unless known: a `shard` column on
    /// `turnstile_state` is Citus'. One caller asks; those that come meanwhile wait for its
    /// answer rather than each asking on a connection of its own (a fresh store's first calls
    /// would otherwise reach the database one connection apart). Nothing is learned while the
    /// table does not exist (a database not yet migrated), nor while a database with the `citus`
    /// extension has the table without the column: its migration has applied the migrations and
    /// not yet distributed the tables, which it does next.
    ///
    /// # Errors
    /// [`StoreError`] when no connection could be had or the query failed.
    pub(super) async fn learn(&self, pool: &deadpool_postgres::Pool) -> Result<(), StoreError> {
        if self.citus.initialized() {
            return Ok(());
        }
        let learned = self
            .citus
            .get_or_try_init(|| async {
                let client = super::client_of(pool).await.map_err(NotLearned::Failed)?;
                match layout_of(&client).await {
                    Ok(Some(citus)) => Ok(citus),
                    Ok(None) => Err(NotLearned::Yet),
                    Err(e) => Err(NotLearned::Failed(super::classify(e))),
                }
            })
            .await;
        match learned {
            Ok(_) | Err(NotLearned::Yet) => Ok(()),
            Err(NotLearned::Failed(e)) => Err(e),
        }
    }

    /// Where the cluster keeps the shards, as read on `client` at most [`ShardMap::FRESH_FOR`]
    /// ago; `None` when it cannot be read (the group commit then sends each write alone).
    pub(super) async fn shard_map(&self, client: &tokio_postgres::Client) -> Option<Arc<ShardMap>> {
        let known = self
            .shards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(map) = known.as_ref().filter(|map| map.is_fresh()) {
            return Some(Arc::clone(map));
        }
        match ShardMap::read(client).await {
            Ok(map) => {
                let map = Arc::new(map);
                *self.shards.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Arc::clone(&map));
                Some(map)
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read where Citus keeps the shards");
                known
            }
        }
    }
}

/// Where a Citus cluster keeps `turnstile_state`'s shards: for each shard's range of hash values,
/// the node group that holds it. Citus places a row by `hashtext` of its shard column; so does
/// [`ShardMap::node_of`], so that the group commit can send together the writes that one node
/// runs, without asking. A map that has gone stale (shards moved by a rebalance) costs speed,
/// never correctness: a write sent with another node's commits still commits, in two phases.
#[derive(Debug)]
pub(super) struct ShardMap {
    /// Each shard's highest hash value and its node group, by hash value.
    ranges: Vec<(i32, i32)>,
    read_at: std::time::Instant,
}

impl ShardMap {
    /// How long a map is trusted before it is read again.
    const FRESH_FOR: std::time::Duration = std::time::Duration::from_secs(60);

    /// The map as `client`'s coordinator has it now. A simple query: through a transaction-mode
    /// pooler too.
    async fn read(client: &tokio_postgres::Client) -> Result<Self, tokio_postgres::Error> {
        let messages = client
            .simple_query(
                "SELECT s.shardmaxvalue, min(p.groupid) \
                   FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) \
                  WHERE s.logicalrelid = 'turnstile_state'::regclass \
                  GROUP BY s.shardmaxvalue",
            )
            .await?;
        let mut ranges: Vec<(i32, i32)> = messages
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
                _ => None,
            })
            .filter_map(|row| {
                let max = row.get(0)?.parse().ok()?;
                let group = row.get(1)?.parse().ok()?;
                Some((max, group))
            })
            .collect();
        ranges.sort_unstable();
        Ok(Self {
            ranges,
            read_at: std::time::Instant::now(),
        })
    }

    fn is_fresh(&self) -> bool {
        self.read_at.elapsed() < Self::FRESH_FOR
    }

    /// The node group that holds `shard` (a value of the shard column, [`shard_of`]).
    pub(super) fn node_of(&self, shard: &str) -> Option<i32> {
        let hash = hashtext(shard.as_bytes());
        let at = self.ranges.partition_point(|(max, _)| *max < hash);
        self.ranges.get(at).map(|(_, group)| *group)
    }
}

/// PostgreSQL's `hashtext` of a text in a deterministic collation: its `hash_bytes` (Bob
/// Jenkins' lookup3, as `src/common/hashfn.c` has it on a little-endian server), by which Citus
/// places a row of a table distributed by a text column.
fn hashtext(key: &[u8]) -> i32 {
    /// `x -= z; x ^= rot(z, k); z += y`: one step of lookup3's `mix`.
    fn mix_step(x: &mut u32, y: u32, z: &mut u32, k: u32) {
        *x = x.wrapping_sub(*z);
        *x ^= z.rotate_left(k);
        *z = z.wrapping_add(y);
    }
    fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
        mix_step(a, *b, c, 4);
        mix_step(b, *c, a, 6);
        mix_step(c, *a, b, 8);
        mix_step(a, *b, c, 16);
        mix_step(b, *c, a, 19);
        mix_step(c, *a, b, 4);
    }
    /// `x ^= y; x -= rot(y, k)`: one step of lookup3's `final`.
    fn final_step(x: &mut u32, y: u32, k: u32) {
        *x ^= y;
        *x = x.wrapping_sub(y.rotate_left(k));
    }
    /// The bytes as a little-endian word, the missing high bytes zero.
    fn word(bytes: &[u8]) -> u32 {
        bytes
            .iter()
            .rev()
            .fold(0, |word, &byte| (word << 8) | u32::from(byte))
    }
    // Keys are far shorter than 4 GiB; PostgreSQL takes the length as an int.
    let len = u32::try_from(key.len()).unwrap_or(u32::MAX);
    let mut a = 0x9e37_79b9_u32.wrapping_add(len).wrapping_add(3_923_095);
    let (mut b, mut c) = (a, a);
    let mut chunks = key.chunks_exact(12);
    for chunk in chunks.by_ref() {
        a = a.wrapping_add(word(&chunk[0..4]));
        b = b.wrapping_add(word(&chunk[4..8]));
        c = c.wrapping_add(word(&chunk[8..12]));
        mix(&mut a, &mut b, &mut c);
    }
    let rest = chunks.remainder();
    a = a.wrapping_add(word(&rest[..rest.len().min(4)]));
    if rest.len() > 4 {
        b = b.wrapping_add(word(&rest[4..rest.len().min(8)]));
    }
    if rest.len() > 8 {
        // The lowest byte of `c` is left for the length.
        c = c.wrapping_add(word(&rest[8..]) << 8);
    }
    final_step(&mut c, b, 14);
    final_step(&mut a, c, 11);
    final_step(&mut b, a, 25);
    final_step(&mut c, b, 16);
    final_step(&mut a, c, 4);
    final_step(&mut b, a, 14);
    final_step(&mut c, b, 24);
    // The same bits, as PostgreSQL returns them: an int4.
    i32::from_ne_bytes(c.to_ne_bytes())
}

/// Whether `client`'s database has Turnstile's tables distributed by Citus; `None` while that
/// cannot be told yet ([`Engine::learn`]).
async fn layout_of(client: &tokio_postgres::Client) -> Result<Option<bool>, tokio_postgres::Error> {
    // A simple query: no prepared statement, so through a transaction-mode pooler too.
    let rows = client
        .simple_query(
            "SELECT to_regclass('turnstile_state') IS NOT NULL, EXISTS ( \
               SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('turnstile_state') \
                  AND attname = 'shard' AND NOT attisdropped), \
               EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')",
        )
        .await?;
    let row = rows.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    });
    Ok(row.and_then(|row| {
        let (table, shard, extension) = (row.get(0), row.get(1), row.get(2));
        (table == Some("t") && (shard == Some("t") || extension != Some("t")))
            .then_some(shard == Some("t"))
    }))
}

/// A turn's load on Citus from one shard (`$3`): the state rows of its keys `$1` with their
/// ages or, for a key without a row, its tombstone (a reference table, on every node), looked up
/// only then (`rows_or_tombstones!`), and receipt `$2` when it is on this shard. Every table it
/// reads is named by the shard or is a reference table, so Citus sends the whole statement to the
/// worker that holds the shard, as one query ([`load_by_shard`]).
const LOAD_SHARD: Sql = Sql {
    text: concat!(
        rows_or_tombstones!("unnest($1::text[])", "shard = $3 AND "),
        " UNION ALL ",
        load_receipt!("shard = $3 AND ")
    ),
    types: &[Type::TEXT_ARRAY, Type::TEXT, Type::TEXT],
    on_citus: None,
};

/// [`super::LOAD`]'s rows on Citus: one [`LOAD_SHARD`] per shard of `keys` (and of `receipt`),
/// sent together on `client`, so in one round trip: a turn reads its conversation's shard and its
/// user's. The parts are not one snapshot, and need not be: the commit checks every key the turn
/// read against the version it saw.
///
/// # Errors
/// A statement failed.
pub(super) async fn load_by_shard(
    client: &deadpool_postgres::ClientWrapper,
    via: super::Via,
    keys: &[&str],
    receipt: Option<&str>,
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let mut shards: Vec<(&str, Vec<&str>)> = Vec::new();
    for key in keys.iter().copied().chain(receipt) {
        let shard = shard_of(key);
        let keys_of = match shards.iter_mut().find(|(s, _)| *s == shard) {
            Some((_, keys_of)) => keys_of,
            None => {
                shards.push((shard, Vec::new()));
                &mut shards.last_mut().expect("just pushed").1
            }
        };
        if Some(key) != receipt {
            keys_of.push(key);
        }
    }
    let parts = shards.iter().map(|(shard, keys_of)| {
        let receipt = receipt.filter(|r| shard_of(r) == *shard);
        async move {
            LOAD_SHARD
                .query(client, via, &[keys_of, &receipt, shard])
                .await
        }
    });
    let parts = futures::future::try_join_all(parts).await?;
    Ok(parts.into_iter().flatten().collect())
}

/// [`super::LOAD_HOLDING`] on Citus: `turnstile_load` (`citus/functions.sql`), which locks the
/// conversation's row too.
pub(super) const LOAD_HOLDING: Sql = Sql {
    text: "SELECT kind, key, state, version, age FROM turnstile_load($1, $2, $3)",
    types: &[Type::TEXT_ARRAY, Type::TEXT, Type::TEXT],
    on_citus: None,
};
/// [`super::COMMIT_WITH_RECEIPTS`] on Citus: `turnstile_commit_also`, the other receipts written
/// one router-planned insert at a time (`turnstile_receipt_write`), after the commit and only if
/// it applied.
pub(super) const COMMIT_WITH_RECEIPTS: Sql = Sql {
    text: "SELECT conflict_key, versions FROM turnstile_commit_also($1, $2, $3, $4, $5, $6, $7)",
    types: &[
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::JSONB_ARRAY,
        Type::TEXT,
        Type::JSONB,
        Type::TEXT_ARRAY,
        Type::JSONB_ARRAY,
    ],
    on_citus: None,
};
/// [`super::INSPECT`] on Citus.
pub(super) const INSPECT: Sql = Sql {
    text: "SELECT false, key, state, version, extract(epoch FROM updated_at)::float8 \
             FROM turnstile_state WHERE shard = ANY(turnstile_key_shards($1)) AND key = ANY($1)",
    types: &[Type::TEXT_ARRAY],
    on_citus: None,
};
/// [`super::SWEEP`] on Citus, which refuses `FOR UPDATE` in a statement over several shards:
/// the delete checks each row's age itself, on the row's latest version, so that a row a turn
/// writes meanwhile is waited for and then kept (written, so not idle).
pub(super) const SWEEP: Sql = Sql {
    text: concat!(
        "WITH batch AS ( \
             SELECT key FROM turnstile_state WHERE $1::text IS NULL OR key > $1::text \
              ORDER BY key LIMIT $2), \
           gone AS ( \
             DELETE FROM turnstile_state s WHERE s.key IN (SELECT key FROM batch) AND ",
        idle_past_its_ttl!(),
        " RETURNING s.key, s.version), ",
        sweep_answer!()
    ),
    types: &[
        Type::TEXT,
        Type::INT8,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::FLOAT8,
    ],
    on_citus: None,
};
/// A commit whose keys and receipt all share one shard (`$1`, [`shard_of`]):
/// `turnstile_commit_in`, which Citus runs on the worker holding that shard, whole.
pub(super) const COMMIT_IN: Sql = Sql {
    text: "SELECT turnstile_commit_in($1, $2, $3, $4, $5, $6)",
    types: &[
        Type::TEXT,
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::JSONB_ARRAY,
        Type::TEXT,
        Type::JSONB,
    ],
    on_citus: None,
};

/// The group commit's statement on Citus: the single-scope writes of many turns (`$2`…`$6`, as
/// [`super::group_commit`]'s own statement takes them), each by `turnstile_commit`, in one call
/// that Citus runs on the node holding shard `$1`. Answers each write's new version, NULL where
/// its key moved.
pub(super) const COMMIT_MANY_IN: Sql = Sql {
    text: "SELECT turnstile_commit_many_in($1, $2, $3, $4, $5, $6)",
    types: &[
        Type::TEXT,
        Type::TEXT_ARRAY,
        Type::JSONB_ARRAY,
        Type::INT8_ARRAY,
        Type::TEXT_ARRAY,
        Type::JSONB_ARRAY,
    ],
    on_citus: None,
};

/// The shard of a key, as `turnstile_key_shard` computes it: its first four `/`-separated parts
/// (`{bot}/{channel}/conversations/{conversation}` or `{bot}/{channel}/users/{user}`; no part of
/// a key holds a `/`, `crate::state::key`), or the whole key when it has fewer.
pub(super) fn shard_of(key: &str) -> &str {
    key.match_indices('/')
        .nth(3)
        .map_or(key, |(at, _)| &key[..at])
}

/// The one shard that every key of `keys` is on, if there is one.
pub(super) fn one_shard<'k>(mut keys: impl Iterator<Item = &'k str>) -> Option<&'k str> {
    let first = shard_of(keys.next()?);
    keys.all(|key| shard_of(key) == first).then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_shard_is_its_conversation_or_its_user() {
        assert_eq!(
            shard_of("bot/ch/conversations/c1"),
            "bot/ch/conversations/c1"
        );
        assert_eq!(
            shard_of("bot/ch/conversations/c1/users/u1"),
            "bot/ch/conversations/c1"
        );
        assert_eq!(
            shard_of("bot/ch/conversations/c1/%hold"),
            "bot/ch/conversations/c1"
        );
        assert_eq!(
            shard_of("bot/ch/conversations/c1/activities/a1"),
            "bot/ch/conversations/c1"
        );
        assert_eq!(shard_of("bot/ch/users/u1"), "bot/ch/users/u1");
        assert_eq!(shard_of("short/key"), "short/key");
        assert_eq!(
            one_shard(
                [
                    "bot/ch/conversations/c1",
                    "bot/ch/conversations/c1/activities/a"
                ]
                .into_iter()
            ),
            Some("bot/ch/conversations/c1")
        );
        assert_eq!(
            one_shard(["bot/ch/conversations/c1", "bot/ch/users/u1"].into_iter()),
            None
        );
    }

    /// Values read from PostgreSQL 15's `SELECT hashtext(s)`: every length of tail (0 to 11
    /// bytes after the 12-byte blocks), several blocks, and multi-byte UTF-8.
    #[test]
    fn keys_hash_as_postgresql_hashes_them() {
        for (text, expected) in [
            ("", -1_477_818_771),
            ("a", 1_075_015_857),
            ("ab", 1_718_550_461),
            ("abc", -785_388_649),
            ("abcd", -393_934_804),
            ("abcde", -445_659_580),
            ("abcdefg", 501_636_814),
            ("abcdefgh", -1_960_928_205),
            ("abcdefghi", -92_131_489),
            ("abcdefghijk", -1_483_803_693),
            ("abcdefghijkl", -1_586_087_212),
            ("abcdefghijklm", 405_849_808),
            ("b/web/conversations/c3", 924_467_343),
            ("bot/msteams/users/29:1Xy-ünïcødé€", 2_087_928_496),
            (
                "bot/directline/conversations/ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdef",
                -1_806_019_949,
            ),
        ] {
            assert_eq!(hashtext(text.as_bytes()), expected, "hashtext({text:?})");
        }
    }

    #[test]
    fn a_shard_is_on_the_node_whose_range_holds_its_hash() {
        let map = ShardMap {
            ranges: vec![(-1, 1), (i32::MAX, 2)],
            read_at: std::time::Instant::now(),
        };
        // hashtext("b/web/conversations/c3") = 924467343: the upper half.
        assert_eq!(map.node_of("b/web/conversations/c3"), Some(2));
        assert_eq!(map.node_of("abc"), Some(1));
        let empty = ShardMap {
            ranges: Vec::new(),
            read_at: std::time::Instant::now(),
        };
        assert_eq!(empty.node_of("abc"), None);
    }
}
