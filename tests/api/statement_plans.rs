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

/// A server with the counter bot over a fresh database of a cluster that counts plans, its state
/// table grown to a deployment's size, the counts reset; and a session to read them.
async fn counted_app() -> (TestApp, tokio_postgres::Client, support::pg::Cluster) {
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
    let (mut app, admin, _cluster) = counted_app().await;
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
    let (app, admin, _cluster) = counted_app().await;
    const CALLERS: usize = 4;
    const TURNS: usize = 250;
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let mut client = app.client.clone();
            tokio::spawn(async move {
                for n in 0..TURNS {
                    let reply = say(&mut client, &format!("together-{caller}-{n}"), "one").await;
                    assert_eq!(support::texts(&reply), ["count: 1"]);
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }

    let (together, together_plans) = calls_and_plans(&admin, &["jsonb_array_elements_text"]).await;
    assert!(
        together >= 100,
        "{together} statements read loads together for {} first turns from {CALLERS} callers",
        CALLERS * TURNS
    );
    planned_once_per_connection("statements of loads together", together, together_plans);
    app.stop().await.unwrap();
}
