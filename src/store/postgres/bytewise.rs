//! Receipt keys compared byte by byte, whatever the database's collation.
//!
//! Every commit looks its receipt's key up in each of the four slots (`turnstile_receipt_slots`)
//! and inserts it into one: five descents of a slot's unique index a turn. A B-tree on `text`
//! compares by the column's collation, which is the database's: in a database created with
//! `en_US.UTF-8` (what a packaged or hosted PostgreSQL often is) each comparison is a
//! locale-aware `strcoll`, several times the cost of the `memcmp` of `C`. Measured
//! (`bench/RESULTS.md`, 2026-11-29 13:40): PostgreSQL's CPU per turn 40 % higher than in a `C`
//! database, the throughput ratio to pgbench's naive SQL 0.77 against 1.07–1.13; 0.91–0.96 with
//! the slots' key indexes rebuilt as below.
//!
//! A receipt's key is an identifier: only its equality matters, and with a deterministic
//! collation equality is byte equality already. So on such a database each slot's key index is
//! rebuilt with `text_pattern_ops`, whose comparisons are bytewise, under the same name. The
//! statements need no change, an older replica's included: `key = $1` and a unique violation
//! named `turnstile_receipt_N_pkey` mean what they meant. The column keeps its type and
//! collation (changing those would break an older replica's prepared statements that return
//! it, and rebuild every index under an exclusive lock).
//!
//! Online, so that it can run while replicas serve: the new index is built `CONCURRENTLY` (turns
//! go on writing the slot meanwhile), then a moment's exclusive lock drops the old primary key
//! and gives the new index its name. The state table keeps its primary key: a warm turn reads it
//! once, and the expiry sweep pages through it in key order, which only the collation's own
//! B-tree serves. Not on Citus, which lays the slots out over its nodes itself.

use tokio_postgres::Client;

use super::Schema;

/// The receipt slots, `turnstile_receipt_N` (`migrations/V5__receipt_slots.sql`).
const SLOTS: u8 = 4;

/// Rebuilds each receipt slot's key index to compare bytewise, unless the database's collation
/// does already (`C` or `POSIX`) or the slot's index is rebuilt already. Returns how many slots
/// it rebuilt. Written to run again: an index a failed or interrupted build left invalid is
/// dropped and built again.
///
/// Runs outside a transaction (a concurrent build cannot run in one). The session's
/// `lock_timeout` bounds the exclusive lock of the rename, which would queue turns behind it;
/// the build itself waits as long as it needs, queuing nothing.
///
/// # Errors
/// A statement failed (the rename's lock wait ran out included: the migration tries again).
pub(super) async fn receipt_keys(
    client: &mut Client,
    schema: &Schema,
) -> Result<u8, tokio_postgres::Error> {
    let bytewise_already: bool = client
        .query_one(
            "SELECT datlocprovider = 'c' AND datcollate IN ('C', 'POSIX') \
               FROM pg_database WHERE datname = current_database()",
            &[],
        )
        .await?
        .get(0);
    if bytewise_already {
        return Ok(0);
    }
    let mut rebuilt = 0;
    for n in 0..SLOTS {
        let table = format!("{schema}.turnstile_receipt_{n}");
        let (done, leftover): (bool, Option<bool>) = {
            let row = client
                .query_one(
                    "SELECT coalesce((SELECT o.opcname = 'text_pattern_ops' \
                                        FROM pg_index i JOIN pg_opclass o ON o.oid = i.indclass[0] \
                                       WHERE i.indexrelid = to_regclass($1)), false), \
                            (SELECT i.indisvalid FROM pg_index i \
                              WHERE i.indexrelid = to_regclass($2))",
                    &[&format!("{table}_pkey"), &format!("{table}_bytewise")],
                )
                .await?;
            (row.get(0), row.get(1))
        };
        if done {
            continue;
        }
        let lock_timeout: String = client
            .query_one("SELECT current_setting('lock_timeout')", &[])
            .await?
            .get(0);
        tracing::info!(
            slot = %table,
            "rebuilding the receipt slot's key index to compare bytewise (the database's \
             collation is not C); turns go on meanwhile"
        );
        // The build waits for the transactions writing the slot when it starts, and again
        // before it is valid; none of them waits for it.
        client.batch_execute("SET lock_timeout = 0").await?;
        let built = async {
            if leftover == Some(false) {
                client
                    .batch_execute(&format!("DROP INDEX CONCURRENTLY {table}_bytewise"))
                    .await?;
            }
            client
                .batch_execute(&format!(
                    "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS turnstile_receipt_{n}_bytewise \
                       ON {table} (key text_pattern_ops)"
                ))
                .await
        }
        .await;
        client
            .batch_execute(&format!("SET lock_timeout = '{lock_timeout}'"))
            .await?;
        built?;
        // Old and new both unique meanwhile: a receipt written twice is refused by the older
        // (indexes are checked in the order they were made), under the name the statements
        // know.
        let swap = client.transaction().await?;
        swap.batch_execute(&format!(
            "ALTER TABLE {table} DROP CONSTRAINT turnstile_receipt_{n}_pkey; \
             ALTER INDEX {table}_bytewise RENAME TO turnstile_receipt_{n}_pkey"
        ))
        .await?;
        swap.commit().await?;
        rebuilt += 1;
    }
    Ok(rebuilt)
}
