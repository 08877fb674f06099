//! Receipt keys compared byte by byte, whatever the database's collation.
//!
//! Every commit looks its receipt's key up in each of the four slots (`turnstile_receipt_slots`)
//! and inserts it into one, and into the conversation's and the user's index over the slots: up
//! to seven index descents by a text a turn. A B-tree on `text` compares by the column's
//! collation, which is the database's: in a database created with `en_US.UTF-8` (what a
//! packaged or hosted PostgreSQL often is) each comparison is a locale-aware `strcoll`, several
//! times the cost of the `memcmp` of `C`. Measured (`bench/RESULTS.md`, 2026-11-29 13:40):
//! PostgreSQL's CPU per turn 40 % higher than in a `C` database, 10 % with these rebuilt.
//!
//! Receipt keys, conversations and users are identifiers: only their equality matters, and with
//! a deterministic collation equality is byte equality already. So on such a database these
//! indexes are rebuilt with `text_pattern_ops`, whose comparisons are bytewise, under the same
//! names. The statements need no change, an older replica's included: `key = $1` and a unique
//! violation named `turnstile_receipt_N_pkey` mean what they meant. The column keeps its type
//! and collation (changing those would break an older replica's prepared statements that
//! return it, and rebuild every index under an exclusive lock).
//!
//! Online, so that it can run while replicas serve: each new index is built `CONCURRENTLY`
//! (turns go on writing meanwhile), slot by slot, then a moment's exclusive lock drops the old
//! one and gives the new its name. The state table keeps its primary key: a warm turn reads it
//! once, and the expiry sweep pages through it in key order, which only the collation's own
//! B-tree serves. Not on Citus, which lays the slots out over its nodes itself.

use tokio_postgres::Client;

use super::Schema;

/// The receipt slots, `turnstile_receipt_N` (`migrations/V5__receipt_slots.sql`).
const SLOTS: u8 = 4;

/// Rebuilds the receipts' indexes on text to compare bytewise, unless the database's collation
/// does already (`C` or `POSIX`): each slot's key index, then the conversation's and the user's
/// index over all the slots; nothing once all are. Written to run again: an index a failed or
/// interrupted build left invalid is dropped and built again, a part of an index over the slots
/// that a slot has already is kept, and a rebuild that finds a slot detached (the upkeep
/// emptying it) is left for the next migration.
///
/// Runs outside a transaction (a concurrent build cannot run in one). The session's
/// `lock_timeout` bounds the exclusive locks of the swaps, which would queue turns behind them;
/// the builds wait as long as they need, queuing nothing.
///
/// # Errors
/// A statement failed (a swap's lock wait ran out included: the migration tries again).
pub(super) async fn rebuild(
    client: &mut Client,
    schema: &Schema,
) -> Result<(), tokio_postgres::Error> {
    let bytewise_already: bool = client
        .query_one(
            "SELECT datlocprovider = 'c' AND datcollate IN ('C', 'POSIX') \
               FROM pg_database WHERE datname = current_database()",
            &[],
        )
        .await?
        .get(0);
    if bytewise_already {
        return Ok(());
    }
    for n in 0..SLOTS {
        slot_key(client, schema, n).await?;
    }
    for index in [CONVERSATION, USER] {
        over_the_slots(client, schema, &index).await?;
    }
    Ok(())
}

/// Slot `n`'s key index, in place of its primary key, unless it is already.
async fn slot_key(
    client: &mut Client,
    schema: &Schema,
    n: u8,
) -> Result<(), tokio_postgres::Error> {
    let table = format!("{schema}.turnstile_receipt_{n}");
    if bytewise(client, &format!("{table}_pkey")).await? {
        return Ok(());
    }
    announce(&format!("{table}_pkey"));
    build_concurrently(
        client,
        &format!("{table}_bytewise"),
        &format!(
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS turnstile_receipt_{n}_bytewise \
               ON {table} (key text_pattern_ops)"
        ),
    )
    .await?;
    // Old and new both unique meanwhile: a receipt written twice is refused by the older
    // (indexes are checked in the order they were made), under the name the statements know.
    let swap = client.transaction().await?;
    swap.batch_execute(&format!(
        "ALTER TABLE {table} DROP CONSTRAINT turnstile_receipt_{n}_pkey; \
         ALTER INDEX {table}_bytewise RENAME TO turnstile_receipt_{n}_pkey"
    ))
    .await?;
    swap.commit().await?;
    Ok(())
}

/// An index over every slot of `turnstile_receipt` (`migrations/V5__receipt_slots.sql`).
struct OverTheSlots {
    /// Its name, and its partitions' names after the slot's (`turnstile_receipt_N_{suffix}`).
    name: &'static str,
    suffix: &'static str,
    /// What it indexes, and its predicate.
    expression: &'static str,
    predicate: &'static str,
}

const CONVERSATION: OverTheSlots = OverTheSlots {
    name: "turnstile_receipt_conversation",
    suffix: "conversation",
    expression: "turnstile_key_conversation(key)",
    predicate: "",
};
const USER: OverTheSlots = OverTheSlots {
    name: "turnstile_receipt_user",
    suffix: "user",
    expression: "(payload->>'user')",
    predicate: "WHERE payload ? 'user'",
};

/// `index`, rebuilt as a partitioned index made of one concurrent build per slot, then put in
/// place of the old one under its name (a partitioned index cannot be built concurrently
/// whole); unless it is already, or a slot is out of the table.
async fn over_the_slots(
    client: &mut Client,
    schema: &Schema,
    index: &OverTheSlots,
) -> Result<(), tokio_postgres::Error> {
    let OverTheSlots {
        name,
        suffix,
        expression,
        predicate,
    } = index;
    if bytewise(client, &format!("{schema}.{name}")).await? {
        return Ok(());
    }
    let in_the_table: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_inherits \
              WHERE inhparent = to_regclass($1) AND NOT inhdetachpending",
            &[&format!("{schema}.turnstile_receipt")],
        )
        .await?
        .get(0);
    if in_the_table != i64::from(SLOTS) {
        tracing::info!(
            index = %name,
            "a receipt slot is being emptied; the index is rebuilt to compare bytewise at the \
             next migration"
        );
        return Ok(());
    }
    announce(name);
    client
        .batch_execute(&format!(
            "CREATE INDEX IF NOT EXISTS {name}_bytewise ON ONLY {schema}.turnstile_receipt \
               ({expression} text_pattern_ops) {predicate}"
        ))
        .await?;
    // Each slot's part, unless the slot has one already: built by an earlier attempt, or made
    // by PostgreSQL when the upkeep attached a slot it had emptied meanwhile.
    let parent = format!("{schema}.{name}_bytewise");
    let attached = parts(client, &parent).await?;
    for n in 0..SLOTS {
        let slot = format!("turnstile_receipt_{n}");
        if attached.iter().any(|(table, _)| *table == slot) {
            continue;
        }
        let part = format!("{slot}_{suffix}_bytewise");
        build_concurrently(
            client,
            &format!("{schema}.{part}"),
            &format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {part} \
                   ON {schema}.{slot} ({expression} text_pattern_ops) {predicate}"
            ),
        )
        .await?;
        client
            .batch_execute(&format!(
                "ALTER INDEX {parent} ATTACH PARTITION {schema}.{part}"
            ))
            .await?;
    }
    // Valid now that every slot's part is attached. Each part is named after its slot.
    let mut swap = format!(
        "DROP INDEX {schema}.{name}; ALTER INDEX {schema}.{name}_bytewise RENAME TO {name};"
    );
    for (table, part) in parts(client, &parent).await? {
        swap.push_str(&format!(
            "ALTER INDEX {schema}.\"{part}\" RENAME TO \"{table}_{suffix}\";"
        ));
    }
    let transaction = client.transaction().await?;
    transaction.batch_execute(&swap).await?;
    transaction.commit().await?;
    Ok(())
}

/// Logs that `index` is being rebuilt: on a large receipt table it takes minutes.
fn announce(index: &str) {
    tracing::info!(
        index,
        "rebuilding a receipt index to compare bytewise (the database's collation is not C); \
         turns go on meanwhile"
    );
}

/// The partitions of partitioned index `parent` (schema-qualified): each one's table and name.
async fn parts(
    client: &Client,
    parent: &str,
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT t.relname::text, i.relname::text FROM pg_inherits h \
               JOIN pg_index x ON x.indexrelid = h.inhrelid \
               JOIN pg_class i ON i.oid = x.indexrelid \
               JOIN pg_class t ON t.oid = x.indrelid \
              WHERE h.inhparent = to_regclass($1)",
            &[&parent],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Whether `index` (schema-qualified) compares bytewise: its first column's operator class is
/// `text_pattern_ops`. False for an index that does not exist.
async fn bytewise(client: &Client, index: &str) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT coalesce((SELECT o.opcname = 'text_pattern_ops' \
                                FROM pg_index i JOIN pg_opclass o ON o.oid = i.indclass[0] \
                               WHERE i.indexrelid = to_regclass($1)), false)",
            &[&index],
        )
        .await?
        .get(0))
}

/// Runs `create`, a `CREATE INDEX CONCURRENTLY IF NOT EXISTS` of `index` (schema-qualified),
/// after dropping what an earlier build of it left invalid. The build waits for the
/// transactions writing the table when it starts, and again before the index is valid, however
/// long that takes (none of them waits for it); the session's lock timeout is put back after.
async fn build_concurrently(
    client: &Client,
    index: &str,
    create: &str,
) -> Result<(), tokio_postgres::Error> {
    let lock_timeout: String = client
        .query_one("SELECT current_setting('lock_timeout')", &[])
        .await?
        .get(0);
    client.batch_execute("SET lock_timeout = 0").await?;
    let built = async {
        let invalid: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_index \
                                 WHERE indexrelid = to_regclass($1) AND NOT indisvalid)",
                &[&index],
            )
            .await?
            .get(0);
        if invalid {
            client
                .batch_execute(&format!("DROP INDEX CONCURRENTLY {index}"))
                .await?;
        }
        client.batch_execute(create).await
    }
    .await;
    client
        .batch_execute(&format!("SET lock_timeout = '{lock_timeout}'"))
        .await?;
    built
}
