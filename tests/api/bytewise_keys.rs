//! Receipt keys compared bytewise on a database whose collation is a locale's
//! (`src/store/postgres/bytewise.rs`): `migrate` rebuilds each receipt slot's key index, and the
//! conversation's and the user's index over the slots, with `text_pattern_ops` under their old
//! names; leaves a `C` database's as they are; finishes what an interrupted build left; waits for
//! a slot being emptied; and redeliveries are still answered from their receipts. On real
//! PostgreSQL, with ICU's `en-US` collation.
#![allow(clippy::unwrap_used)]

use crate::support;

use support::{TestApp, message, texts};
use turnstile::grpc::pb;
use turnstile::store::postgres::{self, DatabaseUrl};

/// Each slot's `turnstile_receipt_N_pkey`: its operator class, whether it is unique and valid,
/// and whether a constraint owns it.
async fn slot_keys(url: &str) -> Vec<(String, bool, bool, bool)> {
    support::pg::session(url)
        .await
        .query(
            "SELECT o.opcname::text, i.indisunique, i.indisvalid, \
                    EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid) \
               FROM generate_series(0, 3) n \
               JOIN pg_index i ON i.indexrelid = \
                    format('turnstile.turnstile_receipt_%s_pkey', n)::regclass \
               JOIN pg_opclass o ON o.oid = i.indclass[0] \
              ORDER BY n",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// The conversation's and the user's index over the slots: operator class and validity, and
/// how many slots' parts each has.
async fn over_the_slots(url: &str) -> Vec<(String, bool, i64)> {
    support::pg::session(url)
        .await
        .query(
            "SELECT o.opcname::text, i.indisvalid, \
                    (SELECT count(*) FROM pg_inherits h WHERE h.inhparent = i.indexrelid) \
               FROM unnest(ARRAY['turnstile_receipt_conversation', 'turnstile_receipt_user']) \
                    WITH ORDINALITY AS x(name, n) \
               JOIN pg_index i ON i.indexrelid = format('turnstile.%s', x.name)::regclass \
               JOIN pg_opclass o ON o.oid = i.indclass[0] \
              ORDER BY x.n",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// The first column of what `sql` answers, as text.
async fn strings(session: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    session
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// How many `_bytewise` indexes are left over.
async fn leftovers(url: &str) -> i64 {
    support::pg::session(url)
        .await
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname LIKE 'turnstile_receipt_%_bytewise'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Activity `id` of conversation `c1` to the counter bot.
async fn counted(app: &mut TestApp, id: &str) -> pb::ProcessTurnResponse {
    let activity = pb::Activity {
        id: Some(id.into()),
        ..message("c1", "alice", "hi")
    };
    app.client
        .process_turn(pb::ProcessTurnRequest::typed(activity, "counter"))
        .await
        .unwrap()
        .into_inner()
}

/// A new database collated by ICU's `en-US`, migrated.
async fn migrated_collated() -> String {
    let url = support::pg::fresh_database_collated("en-US").await;
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    url
}

/// The conversation's index over the slots as the release before left it.
const CONVERSATION_AS_BEFORE: &str = "DROP INDEX turnstile_receipt_conversation; \
     CREATE INDEX turnstile_receipt_conversation \
         ON turnstile_receipt (turnstile_key_conversation(key));";

/// Migrates `url` again, and finds every index rebuilt and nothing left over.
async fn migrate_to_all_rebuilt(url: &str) {
    postgres::migrate(&DatabaseUrl::new(url)).await.unwrap();
    assert_eq!(slot_keys(url).await, rebuilt());
    assert_eq!(over_the_slots(url).await, slots_rebuilt());
    assert_eq!(leftovers(url).await, 0);
}

fn rebuilt() -> Vec<(String, bool, bool, bool)> {
    vec![("text_pattern_ops".into(), true, true, false); 4]
}

fn slots_rebuilt() -> Vec<(String, bool, i64)> {
    vec![("text_pattern_ops".into(), true, 4); 2]
}

#[tokio::test]
async fn on_a_locale_collated_database_receipt_keys_are_compared_bytewise_by_the_same_names() {
    let url = support::pg::fresh_database_collated("en-US").await;
    migrate_to_all_rebuilt(&url).await;

    // The receipt check's lookup, and an erasure's of a conversation's and of a user's receipts,
    // go through them.
    let session = support::pg::session(&url).await;
    for (condition, index) in [
        ("key = 'x/y'", "pkey"),
        (
            "turnstile_key_conversation(key) = 'webchat/c1'",
            "conversation",
        ),
        (
            "payload ? 'user' AND payload->>'user' = 'webchat/u1'",
            "user",
        ),
    ] {
        let plan = strings(
            &session,
            &format!("EXPLAIN (COSTS OFF) SELECT 1 FROM turnstile_receipt WHERE {condition}"),
        )
        .await;
        for n in 0..4 {
            assert!(
                plan.iter()
                    .any(|l| l.contains(&format!("turnstile_receipt_{n}_{index}"))),
                "slot {n} read by its {index} index: {plan:#?}"
            );
        }
    }

    // Migrating again changes nothing.
    migrate_to_all_rebuilt(&url).await;

    // Exactly once, as before: a redelivery is answered from its receipt, the bot not run again.
    let mut app = TestApp::on(&url).spawn().await;
    let first = counted(&mut app, "a1").await;
    assert_eq!(texts(&first), ["count: 1"]);
    let again = counted(&mut app, "a1").await;
    assert!(again.redelivered, "answered from the receipt");
    assert_eq!(again.activities, first.activities);
    let next = counted(&mut app, "a2").await;
    assert_eq!(texts(&next), ["count: 2"], "the redelivery did not count");

    // A receipt written twice is refused under the name the statements know.
    let slot: i16 = session
        .query_one("SELECT slot FROM turnstile_receipt LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    let twice = session
        .batch_execute(&format!(
            "INSERT INTO turnstile_receipt (slot, key, payload) \
             SELECT slot, key, payload FROM turnstile_receipt WHERE slot = {slot} LIMIT 1"
        ))
        .await
        .unwrap_err();
    let db = twice.as_db_error().unwrap();
    assert_eq!(
        db.code(),
        &tokio_postgres::error::SqlState::UNIQUE_VIOLATION
    );
    assert_eq!(
        db.constraint(),
        Some(format!("turnstile_receipt_{slot}_pkey").as_str())
    );
}

#[tokio::test]
async fn a_database_that_compares_bytewise_keeps_its_primary_keys() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    assert_eq!(
        slot_keys(&url).await,
        vec![("text_ops".into(), true, true, true); 4]
    );
    assert_eq!(
        over_the_slots(&url).await,
        vec![("text_ops".into(), true, 4); 2]
    );
}

#[tokio::test]
async fn an_index_over_the_slots_waits_for_a_slot_being_emptied() {
    let url = migrated_collated().await;
    // The conversation's index as the release before left it, and slot 3 out of the table, as
    // the upkeep takes a slot out to empty it.
    let session = support::pg::session(&url).await;
    session
        .batch_execute(&format!(
            "{CONVERSATION_AS_BEFORE} \
             ALTER TABLE turnstile_receipt DETACH PARTITION turnstile_receipt_3"
        ))
        .await
        .unwrap();
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    assert_eq!(
        over_the_slots(&url).await[0],
        ("text_ops".into(), true, 3),
        "left as it was"
    );
    assert_eq!(leftovers(&url).await, 0, "nothing begun");

    session
        .batch_execute(
            "ALTER TABLE turnstile_receipt ATTACH PARTITION turnstile_receipt_3 FOR VALUES IN (3)",
        )
        .await
        .unwrap();
    migrate_to_all_rebuilt(&url).await;
}

#[tokio::test]
async fn a_build_left_invalid_is_done_again() {
    let url = migrated_collated().await;
    // Slot 0 with its primary key, as the release before left it; then a build of its that
    // failed (two receipts written at one moment are not unique by time), invalid, as an
    // interrupted migration leaves it.
    let session = support::pg::session(&url).await;
    session
        .batch_execute(
            "DROP INDEX turnstile_receipt_0_pkey; \
             ALTER TABLE turnstile_receipt_0 ADD CONSTRAINT turnstile_receipt_0_pkey \
                 PRIMARY KEY (key); \
             INSERT INTO turnstile_receipt_0 (slot, key, payload) \
                 VALUES (0, 'a', '{}'), (0, 'b', '{}')",
        )
        .await
        .unwrap();
    let failed = session
        .batch_execute(
            "CREATE UNIQUE INDEX CONCURRENTLY turnstile_receipt_0_bytewise \
                 ON turnstile_receipt_0 (created_at)",
        )
        .await;
    assert!(failed.is_err(), "the build fails");
    assert_eq!(leftovers(&url).await, 1, "and leaves its index behind");
    assert_eq!(slot_keys(&url).await[0].0, "text_ops");

    migrate_to_all_rebuilt(&url).await;
}

#[tokio::test]
async fn a_rebuild_begun_before_goes_on_from_where_it_was() {
    let url = migrated_collated().await;
    // The conversation's index as the release before left it; then a rebuild begun and cut
    // short: the new index over the slots with slot 0's part, and slot 3 emptied and attached
    // again meanwhile, which gives it a part of PostgreSQL's making.
    support::pg::session(&url)
        .await
        .batch_execute(&format!(
            "{CONVERSATION_AS_BEFORE} \
             CREATE INDEX turnstile_receipt_conversation_bytewise ON ONLY turnstile_receipt \
                 (turnstile_key_conversation(key) text_pattern_ops); \
             CREATE INDEX turnstile_receipt_0_conversation_bytewise ON turnstile_receipt_0 \
                 (turnstile_key_conversation(key) text_pattern_ops); \
             ALTER INDEX turnstile_receipt_conversation_bytewise \
                 ATTACH PARTITION turnstile_receipt_0_conversation_bytewise; \
             ALTER TABLE turnstile_receipt DETACH PARTITION turnstile_receipt_3; \
             ALTER TABLE turnstile_receipt ATTACH PARTITION turnstile_receipt_3 FOR VALUES IN (3)"
        ))
        .await
        .unwrap();
    migrate_to_all_rebuilt(&url).await;
    let parts = strings(
        &support::pg::session(&url).await,
        "SELECT c.relname::text FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid \
          WHERE h.inhparent = 'turnstile.turnstile_receipt_conversation'::regclass ORDER BY 1",
    )
    .await;
    assert_eq!(
        parts,
        (0..4)
            .map(|n| format!("turnstile_receipt_{n}_conversation"))
            .collect::<Vec<_>>(),
        "one part a slot, each named after it"
    );
}
