//! What PostgreSQL plans for a turn: a statement the service prepares is planned once per
//! connection, not once per turn. Planning is most of what a simple statement costs the database:
//! a load planned again at every turn cost it three times as much as one planned once
//! (`bench/RESULTS.md`), and a deployment pays that on every turn that misses the state cache.
//!
//! Counted by PostgreSQL itself: `pg_stat_statements` with `track_planning` counts each
//! statement's plans and its executions, over every connection of the server's pool.

use turnstile::BotRegistry;
use turnstile::bots::CounterBot;

use crate::support::{self, TestApp, say};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_is_planned_once_per_connection_not_once_per_turn() {
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
    admin
        .batch_execute(
            "INSERT INTO turnstile_state (key, state, version) \
             SELECT 'other/test/conversations/c' || i, '{}', 1 FROM generate_series(1, 100000) i; \
             ANALYZE turnstile_state; \
             SELECT pg_stat_statements_reset()",
        )
        .await
        .unwrap();
    // Every turn a conversation's first: none is in the server's state cache, so each loads.
    const TURNS: i64 = 120;
    for n in 0..TURNS {
        let reply = say(&mut app.client, &format!("plans-{n}"), "one").await;
        assert_eq!(support::texts(&reply), ["count: 1"]);
    }

    // The loads: the statements that read the state rows and the receipt together.
    let row = admin
        .query_one(
            "SELECT coalesce(sum(calls), 0)::int8, coalesce(sum(plans), 0)::int8 \
               FROM pg_stat_statements \
              WHERE query LIKE '%FROM turnstile_state%' AND query LIKE '%turnstile_receipt_legacy%'",
            &[],
        )
        .await
        .unwrap();
    let (calls, plans): (i64, i64) = (row.get(0), row.get(1));
    assert!(calls >= TURNS, "{calls} loads for {TURNS} first turns");
    // PostgreSQL plans a prepared statement for its first five executions on a connection, then
    // keeps a generic plan if it costs no more: at most six plans per pooled connection (8).
    assert!(
        plans <= 6 * 8 && plans * 2 < calls,
        "{plans} plans for {calls} loads: the load is planned again at every execution"
    );
    app.stop().await.unwrap();
}
