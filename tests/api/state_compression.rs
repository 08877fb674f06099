//! Large states are compressed with LZ4 (`migrations/V6__state_lz4.sql`): every turn writes its
//! conversation's row whole, and PostgreSQL compresses a row over about 2 KB as it writes it,
//! which with pglz was the largest share of the database's work per turn at 64 KB of state
//! (`bench/RESULTS.md`). Rows written before the migration keep pglz, and are read and
//! rewritten as usual. On real PostgreSQL, which the test cluster's packages build with LZ4.
#![allow(clippy::unwrap_used)]

use serde_json::json;
use turnstile::BotRegistry;
use turnstile::bots::CounterBot;
use turnstile::grpc::convert::json_to_proto_value;
use turnstile::grpc::pb;

use crate::support::{self, TestApp, message, texts};

/// A message to the counter bot that keeps `pad` bytes of padding in the conversation's state.
fn padded(conversation: &str, pad: u64) -> pb::ProcessTurnRequest {
    let mut activity = message(conversation, "alice", "count");
    activity.value = Some(json_to_proto_value(json!({ "pad": pad })));
    support::request(activity)
}

/// How the conversation `lz4`'s state is stored: its compression and its size as JSON text.
async fn stored(db: &tokio_postgres::Client) -> (Option<String>, i32) {
    let row = db
        .query_one(
            "SELECT pg_column_compression(state), octet_length(state::text) \
               FROM turnstile_state WHERE key LIKE '%/conversations/lz4'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_state_is_written_lz4_compressed_and_an_older_pglz_row_still_serves() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("counter", CounterBot))
        .spawn()
        .await;
    let db = support::pg::session(app.database_url()).await;
    let mut turn = async |count: &str| {
        let reply = app.client.process_turn(padded("lz4", 16_384)).await;
        assert_eq!(texts(reply.unwrap().get_ref()), [count]);
    };

    // The server has migrated the schema once it answers a turn.
    turn("count: 1").await;
    let column: String = db
        .query_one(
            "SELECT attcompression::text FROM pg_attribute \
              WHERE attrelid = 'turnstile_state'::regclass AND attname = 'state'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(column, "l", "the state column's compression");
    let (compression, bytes) = stored(&db).await;
    assert_eq!(compression.as_deref(), Some("lz4"));
    assert!(bytes > 16_384, "{bytes} bytes");

    // A row as a release before this one left it, compressed with pglz: served and rewritten.
    db.batch_execute(
        "ALTER TABLE turnstile_state ALTER COLUMN state SET COMPRESSION pglz; \
         UPDATE turnstile_state SET state = state || '{\"older\": true}' \
          WHERE key LIKE '%/conversations/lz4'; \
         ALTER TABLE turnstile_state ALTER COLUMN state SET COMPRESSION lz4",
    )
    .await
    .unwrap();
    assert_eq!(stored(&db).await.0.as_deref(), Some("pglz"));
    turn("count: 2").await;
    assert_eq!(
        stored(&db).await.0.as_deref(),
        Some("lz4"),
        "rewritten by the next turn"
    );
}
