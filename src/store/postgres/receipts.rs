//! Receipt retention without row-by-row deletes: the four slots of `turnstile_receipt`, each
//! emptied whole once everything in it is past the retention (`migrations/V5__receipt_slots.sql`
//! says how receipts are laid out in them, and why).
//!
//! A slot is emptied in three steps, none of which makes a turn wait:
//! - `DETACH PARTITION … CONCURRENTLY`: the slot leaves the table for every statement that starts
//!   after it, and the detach waits for those already running; it takes no lock that a turn's
//!   reads or writes would queue behind (a `TRUNCATE` or `DROP` of the partition in place would:
//!   the lock queue stalls every turn behind it, and a leased conversation's transaction can hold
//!   the table for seconds);
//! - `TRUNCATE` of the detached table, which no statement uses any more;
//! - `ATTACH PARTITION`, ready for the window when the slot is written again.
//!
//! A slot is emptied only when none of its receipts is within the retention and it is neither the
//! slot being written nor one that is about to be, so no step can lose a receipt a redelivery
//! needs; it is checked again once the slot is detached. Every step can be cut short (a replica
//! killed, a statement timed out) and the next pass completes it from where it stopped: a detach
//! left pending is finished, a detached slot attached again. Replicas pass every few minutes
//! (`store::upkeep`); two doing it at once find the slot already detached or attached, and that
//! step fails harmlessly.
//!
//! The receipts of the releases before V5 stay in `turnstile_receipt_legacy`, read but never
//! written, until they are past the retention; then it is truncated, once, with a short lock
//! wait that is tried again at the next pass if a turn held it.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::{PostgresStore, Sql, StoreError, classify};

/// How many slots `turnstile_receipt` has (`migrations/V5__receipt_slots.sql`).
const SLOTS: i16 = 4;

/// The receipts' clock: the slots' width, in seconds, and whether the legacy table is still read.
/// Read before either is written, so that a pass that changes nothing writes nothing: on Citus
/// the clock is a reference table, whose every write is a two-phase commit over all the nodes,
/// whether it changes a row or not.
const CLOCK: Sql = Sql {
    text: "SELECT width_secs, legacy FROM turnstile_receipt_clock",
    types: &[],
    on_citus: None,
};

/// Sets the slots' width, in seconds, to `$1` (half the retention) if it is not that already.
const SET_WIDTH: Sql = Sql {
    text: "UPDATE turnstile_receipt_clock SET width_secs = $1 WHERE width_secs <> $1",
    types: &[Type::FLOAT8],
    on_citus: None,
};

/// One slot's row of [`STATUS`]: its number, whether it has a receipt, and whether it has one
/// newer than the cutoff (the retention, `$1` seconds, back from now).
macro_rules! slot_status {
    ($n:literal, $table:literal) => {
        concat!(
            "SELECT ",
            $n,
            ", EXISTS (SELECT 1 FROM ",
            $table,
            "), \
                    EXISTS (SELECT 1 FROM ",
            $table,
            " WHERE created_at > statement_timestamp() - make_interval(secs => $1))"
        )
    };
}

/// Each slot (0 to 3) and the legacy table (4): whether it is attached to `turnstile_receipt`, a
/// detach of it pending, its estimated rows, whether it has any, whether any is within the
/// retention (`$1`, seconds), and whether it is written now (in the current slot, or in the one
/// before during the current one's first seconds: `turnstile_receipt_slots`) or will be within a
/// minute (half a slot, if that is less): emptying a slot takes a few statements, each of which
/// may wait up to the statement timeout.
const STATUS: Sql = Sql {
    text: concat!(
        "WITH t(n, has_rows, has_recent) AS (",
        slot_status!("0", "turnstile_receipt_0"),
        " UNION ALL ",
        slot_status!("1", "turnstile_receipt_1"),
        " UNION ALL ",
        slot_status!("2", "turnstile_receipt_2"),
        " UNION ALL ",
        slot_status!("3", "turnstile_receipt_3"),
        " UNION ALL ",
        slot_status!("4", "turnstile_receipt_legacy"),
        "), \
           clock AS (SELECT width_secs FROM turnstile_receipt_clock) \
           SELECT t.n::int2, i.inhrelid IS NOT NULL, coalesce(i.inhdetachpending, false), \
                  c.reltuples::float8, t.has_rows, t.has_recent, \
                  t.n IN (turnstile_receipt_slot(statement_timestamp()), \
                          turnstile_receipt_slot(statement_timestamp() \
                              - make_interval(secs => least(10, w.width_secs / 4))), \
                          turnstile_receipt_slot(statement_timestamp() \
                              + make_interval(secs => least(60, w.width_secs / 2)))) \
             FROM t CROSS JOIN clock w \
             JOIN pg_class c ON c.oid = to_regclass(CASE WHEN t.n = 4 \
                  THEN 'turnstile_receipt_legacy' ELSE 'turnstile_receipt_' || t.n END) \
             LEFT JOIN pg_inherits i ON i.inhrelid = c.oid \
            ORDER BY t.n"
    ),
    types: &[Type::FLOAT8],
    on_citus: None,
};

/// Whether the detached slot table `table` holds a receipt within the retention (`retention`,
/// seconds), and, when PostgreSQL has no estimate of its rows (`known`), how many it holds.
fn recheck(table: &str, retention: f64, known: bool) -> String {
    let count = if known {
        "0".to_owned()
    } else {
        format!("(SELECT count(*) FROM {table})")
    };
    format!(
        "SELECT EXISTS (SELECT 1 FROM {table} \
          WHERE created_at > statement_timestamp() - make_interval(secs => {retention})), {count}"
    )
}

/// One slot's (or the legacy table's) state, as [`STATUS`] read it.
#[derive(Debug)]
struct Slot {
    n: i16,
    attached: bool,
    detaching: bool,
    /// PostgreSQL's estimate of its rows; negative when it has none (never analyzed).
    rows: f64,
    has_rows: bool,
    has_recent: bool,
    busy: bool,
}

impl Slot {
    fn table(&self) -> String {
        if self.n == SLOTS {
            "turnstile_receipt_legacy".to_owned()
        } else {
            format!("turnstile_receipt_{}", self.n)
        }
    }
}

/// Empties the slots whose receipts are all past `retention`, completes what an earlier pass
/// left half done, and sets the slots' width from `retention`. Returns about how many receipts
/// went (the tables' row estimates: counting them would read them).
pub(super) async fn prune(store: &PostgresStore, retention: Duration) -> Result<u64, StoreError> {
    let client = store.client().await?;
    let width = (retention.as_secs_f64() / 2.0).max(1.0);
    let clock = CLOCK
        .query(&client, store.via(), &[])
        .await
        .map_err(classify)?;
    let (set_width, legacy_read): (f64, bool) = match clock.first() {
        Some(row) => (
            row.try_get(0).map_err(classify)?,
            row.try_get(1).map_err(classify)?,
        ),
        None => (f64::NAN, true),
    };
    // Exact: the width stored is this very value when it was set from the same retention.
    #[allow(clippy::float_cmp)]
    if set_width != width {
        SET_WIDTH
            .execute(&client, store.via(), &[&width])
            .await
            .map_err(classify)?;
    }
    let retention = retention.as_secs_f64();
    let slots: Vec<Slot> = STATUS
        .query(&client, store.via(), &[&retention])
        .await
        .map_err(classify)?
        .iter()
        .map(|row| {
            Ok(Slot {
                n: row.try_get(0)?,
                attached: row.try_get(1)?,
                detaching: row.try_get(2)?,
                rows: row.try_get(3)?,
                has_rows: row.try_get(4)?,
                has_recent: row.try_get(5)?,
                busy: row.try_get(6)?,
            })
        })
        .collect::<Result<_, tokio_postgres::Error>>()
        .map_err(classify)?;
    let mut pruned = 0.0;
    let mut failed = None;
    let citus = store.via().citus;
    for slot in &slots {
        let outcome = if slot.n == SLOTS {
            empty_legacy(&client, slot, legacy_read, citus).await
        } else if citus {
            recycle_in_place(&client, slot).await
        } else {
            recycle(&client, slot, retention).await
        };
        match outcome {
            Ok(Some(rows)) => pruned += rows,
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(
                    table = %slot.table(),
                    error = %e,
                    "emptying a receipt slot stopped; the next pass goes on from there"
                );
                failed.get_or_insert(e);
            }
        }
    }
    // A pass that left a slot behind is a failed pass (`turnstile_receipts_pruned_timestamp_seconds`
    // stays where it was), once the others have had theirs.
    if let Some(e) = failed {
        return Err(classify(e));
    }
    // Estimates are whole numbers, not negative, and far below 2^53.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(pruned as u64)
}

/// Brings slot `slot` to its next state: detached (or its pending detach finished) when all of it
/// is past the retention and nobody writes it, then emptied and attached. Returns about how many
/// receipts it held when it was emptied.
async fn recycle(
    client: &tokio_postgres::Client,
    slot: &Slot,
    retention: f64,
) -> Result<Option<f64>, tokio_postgres::Error> {
    let table = slot.table();
    let expired = slot.has_rows && !slot.has_recent && !slot.busy;
    if slot.attached && !slot.detaching && !expired {
        return Ok(None);
    }
    if slot.detaching {
        client
            .batch_execute(&format!(
                "ALTER TABLE turnstile_receipt DETACH PARTITION {table} FINALIZE"
            ))
            .await?;
    } else if slot.attached {
        client
            .batch_execute(&format!(
                "ALTER TABLE turnstile_receipt DETACH PARTITION {table} CONCURRENTLY"
            ))
            .await?;
    }
    // Detached: no statement starting now reads or writes it. Checked again, as it is now.
    let known = slot.rows >= 0.0;
    let (recent, counted) = client
        .simple_query(&recheck(&table, retention, known))
        .await?
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some((
                row.get(0) != Some("f"),
                row.get(1)
                    .and_then(|n| n.parse::<f64>().ok())
                    .unwrap_or(0.0),
            )),
            _ => None,
        })
        .unwrap_or((true, 0.0));
    let emptied = (!recent).then_some(if known { slot.rows } else { counted });
    if emptied.is_some() {
        client.batch_execute(&format!("TRUNCATE {table}")).await?;
    }
    client
        .batch_execute(&format!(
            "ALTER TABLE turnstile_receipt ATTACH PARTITION {table} FOR VALUES IN ({})",
            slot.n
        ))
        .await?;
    if let Some(rows) = emptied {
        tracing::debug!(%table, rows, "emptied a receipt slot");
    }
    Ok(emptied)
}

/// [`recycle`] on Citus, which cannot detach a partition concurrently: slot `slot` truncated where
/// it is once all of it is past the retention and nobody writes it, waiting at most a moment for
/// its lock ([`truncate_briefly`]); a pass that did not get it is a failed pass, and the next one
/// tries again. (A slot left detached, by a pass of the single-node recycler before the database
/// moved to Citus, is attached again.) Returns about how many receipts it held.
async fn recycle_in_place(
    client: &tokio_postgres::Client,
    slot: &Slot,
) -> Result<Option<f64>, tokio_postgres::Error> {
    let table = slot.table();
    if !slot.attached {
        client
            .batch_execute(&format!(
                "ALTER TABLE turnstile_receipt ATTACH PARTITION {table} FOR VALUES IN ({})",
                slot.n
            ))
            .await?;
    }
    if !(slot.has_rows && !slot.has_recent && !slot.busy) {
        return Ok(None);
    }
    let rows = shard_rows(client, &table).await?;
    truncate_briefly(client, &table, true).await?;
    tracing::debug!(%table, rows, "emptied a receipt slot");
    Ok(Some(rows))
}

/// About how many rows distributed table `table` has: its shards' estimates (the coordinator's
/// table is an empty shell), or its count when a shard has none yet (never analyzed).
async fn shard_rows(
    client: &tokio_postgres::Client,
    table: &str,
) -> Result<f64, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT coalesce(sum(greatest(result::float8, 0)), 0), \
                    coalesce(bool_or(result::float8 < 0), false) \
               FROM run_command_on_shards($1::text::regclass, \
                    $c$SELECT reltuples FROM pg_class WHERE oid = '%s'::regclass$c$)",
            &[&table],
        )
        .await?;
    if !row.get::<_, bool>(1) {
        return Ok(row.get(0));
    }
    let counted: i64 = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await?
        .get(0);
    // Far below 2^53.
    #[allow(clippy::cast_precision_loss)]
    Ok(counted as f64)
}

/// `TRUNCATE table`, waiting at most 100 ms for its lock (a turn reading the table holds it until
/// its transaction ends, and the statements queued behind the truncate would wait with it). One
/// statement, so one transaction, which a failure ends whole. On Citus the wait is bounded on the
/// workers too, where the shards' locks are taken.
async fn truncate_briefly(
    client: &tokio_postgres::Client,
    table: &str,
    citus: bool,
) -> Result<(), tokio_postgres::Error> {
    let propagate = if citus {
        "PERFORM set_config('citus.propagate_set_commands', 'local', true); "
    } else {
        ""
    };
    client
        .batch_execute(&format!(
            "DO $$ BEGIN {propagate}\
               PERFORM set_config('lock_timeout', '100ms', true); \
               TRUNCATE {table}; \
             END $$"
        ))
        .await
}

/// Once nothing in the legacy table is within the retention: stops reading it (if the turns
/// still do, `read`), and truncates it, waiting at most a moment for the lock (a turn reading it
/// holds it until its transaction ends). Returns about how many receipts it held when it was
/// truncated.
async fn empty_legacy(
    client: &tokio_postgres::Client,
    legacy: &Slot,
    read: bool,
    citus: bool,
) -> Result<Option<f64>, tokio_postgres::Error> {
    if legacy.has_recent {
        return Ok(None);
    }
    if read {
        client
            .batch_execute("UPDATE turnstile_receipt_clock SET legacy = false WHERE legacy")
            .await?;
    }
    if !legacy.has_rows {
        return Ok(None);
    }
    truncate_briefly(client, "turnstile_receipt_legacy", citus).await?;
    Ok(Some(legacy.rows.max(0.0)))
}
