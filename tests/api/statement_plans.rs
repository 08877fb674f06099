//! What PostgreSQL plans for a turn: a statement the service prepares is planned once per
//! connection, not once per turn. Planning is most of what a simple statement costs the database:
//! a load planned again at every turn cost it three times as much as one planned once
//! (`bench/RESULTS.md`), and a deployment pays that on every turn that misses the state cache.
//!
//! Counted by PostgreSQL itself: `pg_stat_statements` with `track_planning` counts each
//! statement's plans and its executions, over every connection of the server's pool.

use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use tokio::sync::Semaphore;
use turnstile::bots::CounterBot;
use turnstile::store::postgres::Statements;
use turnstile::{BotRegistry, DoubleText};

use crate::double_text::{send, until_pending, until_running};
use crate::held_turns::with_pool;
use crate::support::bots::DoubleTexts;
use crate::support::{self, TestApp, message, say, texts};

/// A server with the counter bot over a fresh database of a cluster that counts plans, its state
/// table grown to a deployment's size (with `grown`), the counts reset; and a session to read
/// them.
async fn counted_app(grown: bool) -> (TestApp, tokio_postgres::Client, support::pg::Cluster) {
    let cluster = tokio::task::spawn_blocking(|| {
        support::pg::Cluster::start_with(
            &[
                "shared_preload_libraries=pg_stat_statements",
                "pg_stat_statements.track_planning=on",
            ],
            |_| {},
        )
    })
    .await
    .unwrap();
    let url = support::pg::fresh_database_in(&cluster).await;
    let admin = support::pg::session(&url).await;
    admin
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let mut app = TestApp::on(&url)
        .bots(BotRegistry::new("counter", CounterBot))
        .spawn()
        .await;

    // The server has migrated the schema once it answers a turn.
    say(&mut app.client, "plans-first", "one").await;
    // A state table of a deployment's size: over a few rows, any plan is cheap, and PostgreSQL
    // keeps a generic one whatever the statement.
    let rows = if grown { 100_000 } else { 10_000 };
    admin
        .batch_execute(&format!(
            "INSERT INTO turnstile_state (key, state, version) \
             SELECT 'other/test/conversations/c' || i, '{{}}', 1 FROM generate_series(1, {rows}) i; \
             ANALYZE turnstile_state; \
             SELECT pg_stat_statements_reset()"
        ))
        .await
        .unwrap();
    (app, admin, cluster)
}

/// How many times the statements whose text has every one of `parts` ran, and were planned.
async fn calls_and_plans(admin: &tokio_postgres::Client, parts: &[&str]) -> (i64, i64) {
    let filter: String = parts
        .iter()
        .map(|part| format!(" AND query LIKE '%{part}%'"))
        .collect();
    let row = admin
        .query_one(
            &format!(
                "SELECT coalesce(sum(calls), 0)::int8, coalesce(sum(plans), 0)::int8 \
                   FROM pg_stat_statements WHERE true{filter}"
            ),
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// PostgreSQL plans a prepared statement for its first five executions on a connection, then
/// keeps a generic plan if it costs no more: at most six plans per pooled connection (8).
fn planned_once_per_connection(what: &str, calls: i64, plans: i64) {
    assert!(
        plans <= 6 * 8 && plans * 2 < calls,
        "{plans} plans for {calls} {what}: the statement is planned again at every execution"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_is_planned_once_per_connection_not_once_per_turn() {
    let (mut app, admin, _cluster) = counted_app(true).await;
    // Every turn a conversation's first: none is in the server's state cache, so each loads.
    const TURNS: i64 = 120;
    for n in 0..TURNS {
        let reply = say(&mut app.client, &format!("plans-{n}"), "one").await;
        assert_eq!(support::texts(&reply), ["count: 1"]);
    }

    // The loads: the statements that read the state rows and the receipt together.
    let (calls, plans) = calls_and_plans(
        &admin,
        &["FROM turnstile_state", "turnstile_receipt_legacy"],
    )
    .await;
    assert!(calls >= TURNS, "{calls} loads for {TURNS} first turns");
    planned_once_per_connection("loads", calls, plans);
    app.stop().await.unwrap();
}

/// The same for the loads of turns that arrive together, read by one statement whatever their
/// number (`group_load`): batches of every size share one plan. Four callers make small batches,
/// the ones for which a statement whose estimates follow its arrays' lengths was planned again
/// at every execution (checked: 53 plans for 50 batches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_read_together_are_planned_once_per_connection() {
    let (app, admin, _cluster) = counted_app(true).await;
    const CALLERS: usize = 4;
    const TURNS: usize = 250;
    first_turns_at_once(&app, CALLERS, TURNS).await;

    let (together, together_plans) = calls_and_plans(&admin, &["jsonb_array_elements_text"]).await;
    assert!(
        together >= 100,
        "{together} statements read loads together for {} first turns from {CALLERS} callers",
        CALLERS * TURNS
    );
    planned_once_per_connection("statements of loads together", together, together_plans);
    app.stop().await.unwrap();
}

/// `callers` callers at once, each sending `turns` first turns of conversations of its own, one
/// after another: loads of turns that arrive together, read in small batches.
async fn first_turns_at_once(app: &TestApp, callers: usize, turns: usize) {
    turns_at_once(app, callers, turns, "count: 1").await;
}

/// The same, each turn answered `expected`: the conversations' next turns, to a replica that has
/// not cached them, read the rows the first turns wrote.
async fn turns_at_once(app: &TestApp, callers: usize, turns: usize, expected: &'static str) {
    let callers: Vec<_> = (0..callers)
        .map(|caller| {
            let mut client = app.client.clone();
            tokio::spawn(async move {
                for n in 0..turns {
                    let reply = say(&mut client, &format!("together-{caller}-{n}"), "one").await;
                    assert_eq!(support::texts(&reply), [expected]);
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
}

/// Scans of the state table so far, sequential and by index, as PostgreSQL's statistics have
/// them.
async fn state_scans(admin: &tokio_postgres::Client) -> (i64, i64) {
    scans_of(admin, "turnstile_state").await
}

/// Scans of `table` so far, sequential and by index.
async fn scans_of(admin: &tokio_postgres::Client, table: &str) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0) FROM pg_stat_user_tables \
              WHERE relname = $1",
            &[&table],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// The text of the load that goes alone ([`first_turns_at_once`] reads most together): its keys
/// in a `VALUES` list (`pg_stat_statements` shows the subscripts as parameters).
const ALONE: &str = "FROM (VALUES (($1::text[])";

/// What `read` reads once PostgreSQL's statistics have settled: backends report their counts
/// when idle, a second or more later, and when they exit.
async fn settled<T: PartialEq, F: std::future::Future<Output = T>>(read: impl Fn() -> F) -> T {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut last = read().await;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        let now = read().await;
        if now == last {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the statistics never settled"
        );
        last = now;
    }
}

/// Index scans of the tombstone table, once the statistics have settled.
async fn settled_tombstone_lookups(admin: &tokio_postgres::Client) -> i64 {
    settled(|| async { scans_of(admin, "turnstile_tombstone").await.1 }).await
}

/// A load looks for a key's erasure tombstone only when the key has no row: most keys a turn loads
/// exist, and a tombstone under a row is ignored. The first turns of conversations look (their
/// rows do not exist yet); their next turns, to a replica that has not cached them, read the rows
/// and never look up the tombstone table, alone or read together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_looks_for_tombstones_only_of_keys_without_a_row() {
    let (app, admin, _cluster) = counted_app(false).await;
    const CALLERS: usize = 4;
    const TURNS: usize = 50;
    // counted_app's rows were inserted past the tombstones' trigger, which looks each one up.
    let before = settled_tombstone_lookups(&admin).await;
    first_turns_at_once(&app, CALLERS, TURNS).await;
    let replica = app.replica(BotRegistry::new("counter", CounterBot)).await;
    app.stop().await.unwrap();
    let first = settled_tombstone_lookups(&admin).await;
    // Counted, and by index: the first turns' keys had no rows.
    assert!(
        first > before,
        "no tombstone lookup counted for the first turns"
    );

    let (alone_before, _) = calls_and_plans(&admin, &[ALONE]).await;
    let (together_before, _) = calls_and_plans(&admin, &["jsonb_array_elements_text"]).await;
    turns_at_once(&replica, CALLERS, TURNS, "count: 2").await;
    replica.stop().await.unwrap();
    let next = settled_tombstone_lookups(&admin).await;
    assert_eq!(
        next - first,
        0,
        "{} tombstone lookups for {} loads of keys with rows",
        next - first,
        CALLERS * TURNS
    );
    // Both kinds of load ran: alone and read together.
    let (alone, _) = calls_and_plans(&admin, &[ALONE]).await;
    let (together, _) = calls_and_plans(&admin, &["jsonb_array_elements_text"]).await;
    assert!(
        alone > alone_before && together > together_before,
        "loads alone {}, together {}",
        alone - alone_before,
        together - together_before
    );
}

/// Loads read together look each row up by the key's index, however small the table: as a
/// join on the batch's estimated hundred keys, a state table of 10,000 rows was read whole by
/// most batches (two rows found in 1.9 ms against 0.09 ms by index, `bench/RESULTS.md`); this
/// test then counted 33 whole reads for 51 batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_read_together_look_rows_up_by_index_in_a_small_table() {
    let (app, admin, _cluster) = counted_app(false).await;
    let (seq_before, idx_before) = state_scans(&admin).await;
    first_turns_at_once(&app, 4, 100).await;
    let (together, _) = calls_and_plans(&admin, &["jsonb_array_elements_text"]).await;
    assert!(
        together >= 20,
        "only {together} statements read loads together"
    );
    // Backends report their counts when idle, within seconds: wait until the batches' index
    // scans are counted, or a sequential scan is.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let (mut seq, mut idx) = state_scans(&admin).await;
    while idx - idx_before < together && seq == seq_before && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        (seq, idx) = state_scans(&admin).await;
    }
    assert_eq!(
        seq - seq_before,
        0,
        "the state table was read whole {} times by {together} batches",
        seq - seq_before
    );
    assert!(
        idx - idx_before >= together,
        "{} index scans",
        idx - idx_before
    );
    app.stop().await.unwrap();
}

/// The rows the tables whose names match `tables` (a regular expression) have returned so far,
/// by whole reads and through their indexes, once the statistics have settled: a probe by key
/// returns the rows it looks for, and a whole read (a scan, or an index walked whole for a hash
/// table or a join) every row.
async fn settled_rows_read(admin: &tokio_postgres::Client, tables: &str) -> (i64, i64) {
    settled(|| async {
        let row = admin
            .query_one(
                "SELECT (SELECT coalesce(sum(seq_tup_read), 0)::int8 FROM pg_stat_user_tables \
                          WHERE relname ~ $1), \
                        (SELECT coalesce(sum(idx_tup_read), 0)::int8 FROM pg_stat_user_indexes \
                          WHERE relname ~ $1)",
                &[&tables],
            )
            .await
            .unwrap();
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    })
    .await
}

/// The receipt slots' tables.
const SLOTS: &str = "^turnstile_receipt_[0-9]+$";
/// The state table.
const STATE: &str = "^turnstile_state$";

/// The slot being written filled with 20,000 receipts that nothing analyzes; then the receipts
/// read so far ([`settled_rows_read`]).
async fn slot_filled_unanalyzed(admin: &tokio_postgres::Client) -> (i64, i64) {
    admin
        .batch_execute(
            "INSERT INTO turnstile_receipt (key, payload) \
             SELECT 'grown/' || i, '{}' FROM generate_series(1, 20000) i",
        )
        .await
        .unwrap();
    settled_rows_read(admin, SLOTS).await
}

/// A receipt is looked up by its key's index however small its slot was when the plans were
/// made. A slot is emptied whole before it is written again, and autovacuum then analyzes it
/// empty; a connection keeps the plans it makes next, and a plan made for an empty slot reads
/// the slot whole. Kept while the slot fills, such plans read it whole at every turn's receipt
/// check: 15 to 23 times fewer turns a second until autovacuum analyzed it again
/// (`bench/RESULTS.md`). A whole read is a scan of the table, or of its index for a hash table
/// that a batch's receipt check then probes (an eighth of the throughput, 2026-11-30): both count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_are_looked_up_by_index_after_their_slot_was_analyzed_empty() {
    receipts_by_index_after_an_empty_analyze(Statements::Prepared).await;
}

/// The same through a transaction-mode pooler's sessions, which carry no startup options: the
/// statements are planned at each execution, but the receipt check's function keeps its plans
/// on the session as a prepared statement does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprepared_receipts_are_looked_up_by_index_after_their_slot_was_analyzed_empty() {
    receipts_by_index_after_an_empty_analyze(Statements::Unprepared).await;
}

async fn receipts_by_index_after_an_empty_analyze(statements: Statements) {
    let url = support::pg::fresh_database().await;
    let admin = support::pg::session(&url).await;
    let mut app = TestApp::on(&url)
        .bots(BotRegistry::new("counter", CounterBot))
        .config(|mut c| {
            c.statements = statements;
            c
        })
        .spawn()
        .await;
    say(&mut app.client, "slot-first", "one").await;
    // The slots analyzed (nearly) empty, as autovacuum does after a slot is emptied.
    admin
        .batch_execute("ANALYZE turnstile_receipt")
        .await
        .unwrap();
    // Plans made now and kept: more than five executions of each statement on each connection,
    // commits alone (one caller) and commits in batches (eight callers at once).
    for n in 0..60 {
        say(&mut app.client, &format!("slot-warm-{n}"), "one").await;
    }
    turns_at_once(&app, 8, 15, "count: 1").await;
    let before = slot_filled_unanalyzed(&admin).await;
    for n in 0..40 {
        say(&mut app.client, &format!("slot-after-{n}"), "one").await;
    }
    turns_at_once(&app, 8, 15, "count: 2").await;
    app.stop().await.unwrap();
    let after = settled_rows_read(&admin, SLOTS).await;
    // A probe returns at most the receipt it looks for (a turn's own, when its commit is sent
    // again, or a dead entry that a rolled-back batch left in the index): a few in all. A whole
    // read returns 20,000.
    let (scanned, by_index) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(scanned, 0, "160 turns ({statements:?}) scanned the slots");
    assert!(
        by_index < 160,
        "160 turns ({statements:?}), 120 of them from 8 callers at once, read {by_index} \
         receipts through the slots' indexes"
    );
}

/// A batch of commits updates its rows by their keys however small the state table was when it
/// was planned. A table analyzed empty (nothing written yet, or everything expired or erased)
/// made the batch's update walk the whole table's index for the rows it joins, a plan that a
/// connection keeps while the table fills, until autovacuum analyzes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_updates_its_rows_by_key_after_the_state_table_was_analyzed_empty() {
    let url = support::pg::fresh_database().await;
    let admin = support::pg::session(&url).await;
    let mut app = TestApp::on(&url)
        .bots(BotRegistry::new("counter", CounterBot))
        .spawn()
        .await;
    say(&mut app.client, "table-first", "one").await;
    admin
        .batch_execute("DELETE FROM turnstile_state; ANALYZE turnstile_state")
        .await
        .unwrap();
    // Plans made now and kept: batches of eight callers' first turns.
    turns_at_once(&app, 8, 15, "count: 1").await;
    // The table fills, and nothing analyzes it.
    admin
        .batch_execute(
            "INSERT INTO turnstile_state (key, state, version) \
             SELECT 'other/test/conversations/c' || i, '{}', 1 FROM generate_series(1, 50000) i",
        )
        .await
        .unwrap();
    let before = settled_rows_read(&admin, STATE).await.1;
    // The same conversations' next turns, cached by the server: commits of updates alone.
    turns_at_once(&app, 8, 15, "count: 2").await;
    app.stop().await.unwrap();
    let read = settled_rows_read(&admin, STATE).await.1 - before;
    assert!(
        read < 10 * 120,
        "120 updates in batches read {read} entries of the state table's index"
    );
}

/// The same for a held turn's statements, which look up the receipts of the messages waiting
/// for it (`store::postgres::hold`): planned with the slots analyzed empty and kept while the
/// slot fills, they read every slot whole, hashed for an anti-join, at each take and release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turn_looks_waiting_receipts_up_by_index_after_their_slot_was_analyzed_empty() {
    let url = support::pg::fresh_database().await;
    let admin = support::pg::session(&url).await;
    let (gate, runs) = (Arc::new(Semaphore::new(0)), Arc::new(AtomicU32::new(0)));
    let bots = BotRegistry::new(
        "texts",
        DoubleTexts {
            gate: Arc::clone(&gate),
            runs: Arc::clone(&runs),
        },
    )
    .with_double_text("texts", DoubleText::Coalesce)
    .unwrap();
    // Two connections, so that the turns below plan each statement more than five times on
    // each: the plans then kept.
    let app = TestApp::on(&url)
        .bots(bots)
        .config(|c| with_pool(c, 2))
        .spawn()
        .await;
    let turn = |text: &str| send(&app, &message("held", "ada", text));
    turn("first").await.unwrap().unwrap();
    admin
        .batch_execute("ANALYZE turnstile_receipt")
        .await
        .unwrap();
    for n in 0..20 {
        turn(&format!("warm {n}")).await.unwrap().unwrap();
    }
    let before = slot_filled_unanalyzed(&admin).await;

    // A turn held while two messages wait for it: its release, and the take of the turn that
    // answers the two, look up their receipts.
    let running = turn("wait");
    until_running(&runs, 22).await;
    let mut waiting = Vec::new();
    for text in ["large", "no olives"] {
        let activity = message("held", "ada", text);
        waiting.push(send(&app, &activity));
        until_pending(Some(&url), activity.id.as_deref().unwrap()).await;
    }
    gate.add_permits(1);
    running.await.unwrap().unwrap();
    for call in waiting {
        let answered = call.await.unwrap().unwrap();
        assert_eq!(answered.coalesced.len(), 2, "{answered:?}");
        assert!(texts(&answered).len() <= 1, "{answered:?}");
    }
    app.stop().await.unwrap();
    let after = settled_rows_read(&admin, SLOTS).await;
    let read = (after.0 - before.0) + (after.1 - before.1);
    assert!(
        read < 100,
        "a held turn and the one answering its two waiting messages read {read} receipts"
    );
}
