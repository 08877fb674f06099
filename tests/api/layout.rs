//! Turnstile's tables in a schema of their own: a fresh database keeps `public` empty; a database
//! an older release laid out in `public` is moved by the migrations with every row, redeliveries
//! answered across the move, and views left behind that such a release's statements still work
//! through, until `migrate --drop-compat` removes them. On real PostgreSQL.
#![allow(clippy::unwrap_used)]

use crate::support;

use serde_json::json;
use support::{TestApp, message, say, texts};
use turnstile::config::{Config, StoreConfig};
use turnstile::grpc::pb;
use turnstile::store::postgres::{self, DatabaseUrl, Schema};

/// Tables (and views) of `schema`, by kind: `r` tables, `v` views.
async fn relations(url: &str, schema: &str, kind: &str) -> i64 {
    support::pg::session(url)
        .await
        .query_one(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relkind::text = $2",
            &[&schema, &kind],
        )
        .await
        .unwrap()
        .get(0)
}

/// `config` with its tables in `schema` of the database at `url`.
fn in_schema(config: Config, url: &str, schema: &str) -> Config {
    Config {
        store: StoreConfig::Postgres {
            url: DatabaseUrl::new(url).with_schema(Schema::parse(schema).unwrap()),
            pool_size: 4,
            commits_in_flight: None,
        },
        ..config
    }
}

#[tokio::test]
async fn a_fresh_database_keeps_public_clean() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    assert_eq!(relations(&url, "public", "r").await, 0);
    assert_eq!(relations(&url, "public", "v").await, 0);
    // The state, the receipts' four slots and the legacy receipts, the slots' clock, tombstones,
    // the history and the 1,024 lock tables.
    assert_eq!(relations(&url, "turnstile", "r").await, 1033);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_laid_out_in_public_moves_with_every_row_and_keeps_serving_older_statements() {
    let url = support::pg::fresh_database().await;
    // An older release's layout: everything in public.
    let mut app = TestApp::on(&url)
        .config(|c| in_schema(c, &url, "public"))
        .spawn()
        .await;
    let first = message("moving", "ada", "add ham");
    let answered = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(first.clone(), ""))
        .await
        .unwrap()
        .into_inner();
    say(&mut app.client, "moving", "add olives").await;
    app.stop().await.unwrap();
    assert!(relations(&url, "public", "r").await > 1000);
    // What an earlier build of this release left for the role: the schema first on its path.
    support::pg::session(&url)
        .await
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER ROLE %I IN DATABASE %I \
             SET search_path = turnstile, public', current_user, current_database()); END $$",
        )
        .await
        .unwrap();

    // An older replica's long transaction (a leased conversation's) holds the receipts while the
    // migration starts. The migration waits for it between short attempts, and meanwhile the
    // other replicas' statements are not queued behind it for longer than one attempt's wait.
    let leased = support::pg::session(&url).await;
    leased
        .batch_execute("BEGIN; SELECT count(*) FROM public.turnstile_receipt")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let migration = tokio::spawn({
        let url = url.clone();
        async move { postgres::migrate(&DatabaseUrl::new(&url)).await }
    });
    let other = support::pg::session(&url).await;
    for _ in 0..10 {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let asked = std::time::Instant::now();
        other
            .query_one("SELECT count(*) FROM public.turnstile_state", &[])
            .await
            .unwrap();
        assert!(
            asked.elapsed() < std::time::Duration::from_millis(1_000),
            "a turn's statement waited {:?} behind the migration",
            asked.elapsed()
        );
    }
    assert!(!migration.is_finished(), "the migration did not wait");
    leased.batch_execute("COMMIT").await.unwrap();
    migration.await.unwrap().unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(1_500));
    assert_eq!(relations(&url, "public", "r").await, 0, "every table moved");
    assert_eq!(relations(&url, "turnstile", "r").await, 1033);

    // This release, in the schema: the rows came along, and a redelivery is answered from its
    // receipt.
    let mut app = TestApp::on(&url).spawn().await;
    let again = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(first, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(again.redelivered);
    assert_eq!(texts(&again), texts(&answered));
    let next = say(&mut app.client, "moving", "add cheese").await;
    assert!(
        texts(&next)[0].ends_with("ham, olives, cheese."),
        "{next:?}"
    );

    // An older replica's session opened now, as a pod restarted mid-rollout opens them, finds
    // its names in public: the role gives it no path of its own (the one set before is taken
    // back), so its statements go through the views. With the schema first they would reach
    // the slots' table itself.
    assert_eq!(
        without_options(&url, "search_path").await,
        "\"$user\", public"
    );
    let old = session_without_options(&url).await;
    // This release through a transaction-mode pooler meanwhile: refused, saying why.
    let pooled = postgres::PostgresStore::connect_with(
        &DatabaseUrl::new(&url),
        1,
        postgres::Statements::Unprepared,
    )
    .unwrap();
    let refused = pooled.check_schema().await.unwrap_err().to_string();
    assert!(
        refused.contains("schema turnstile") && refused.contains("--drop-compat"),
        "{refused}"
    );

    // The older release's statements, by their names in public, through the views.
    let key = "pizza/test/conversations/old-release";
    let created: i64 = old
        .query_one(
            "INSERT INTO turnstile_state (key, state, version) VALUES ($1, '{}', 1) \
             ON CONFLICT (key) DO NOTHING RETURNING version",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(created, 1);
    let row = old
        .query_one(
            "SELECT conflict_key, versions FROM turnstile_commit($1, $2, $3, $4, $5)",
            &[
                &vec![key],
                &vec![1_i64],
                &vec![tokio_postgres::types::Json(json!({"order": ["ham"]}))],
                &format!("{key}/activities/a1"),
                &tokio_postgres::types::Json(json!({"activities": []})),
            ],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<String>>(0), None);
    assert_eq!(row.get::<_, Vec<i64>>(1), vec![2]);
    old.batch_execute("BEGIN; LOCK TABLE turnstile_lock_0007 IN EXCLUSIVE MODE; COMMIT;")
        .await
        .unwrap();
    let receipts: i64 = old
        .query_one(
            "SELECT count(DISTINCT payload) FROM turnstile_receipt WHERE key = $1",
            &[&format!("{key}/activities/a1")],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(receipts, 1);

    // Once no older replica is left, what was kept for them goes; this release serves on.
    postgres::drop_compat(&DatabaseUrl::new(&url))
        .await
        .unwrap();
    assert_eq!(relations(&url, "public", "v").await, 0);
    assert_eq!(
        without_options(&url, "search_path").await,
        "turnstile, public"
    );
    // A pooler's sessions opened since (the role's settings apply as a session starts).
    let pooled = postgres::PostgresStore::connect_with(
        &DatabaseUrl::new(&url),
        1,
        postgres::Statements::Unprepared,
    )
    .unwrap();
    assert!(
        pooled.check_schema().await.unwrap().is_servable(),
        "through the pooler, once no older replica is left"
    );
    let functions: i64 = old
        .query_one(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
              WHERE n.nspname = 'public' AND p.proname LIKE 'turnstile%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(functions, 0);
    let last = say(&mut app.client, "moving", "add mushroom").await;
    assert!(texts(&last)[0].ends_with("cheese, mushroom."), "{last:?}");
    app.stop().await.unwrap();
}

/// What a session of `url` opened without startup options (as through a transaction-mode
/// pooler) gets for `setting`.
async fn without_options(url: &str, setting: &str) -> String {
    session_without_options(url)
        .await
        .query_one(&format!("SHOW {setting}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// A session of `url` opened without startup options, as an older release's or a pooler's.
async fn session_without_options(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// Sessions through a transaction-mode pooler carry no startup options: `migrate` sets for its
/// role, in this database, the schema and the planner settings a pooled connection of the
/// service's own starts with, and keeps any the operator set there before.
#[tokio::test]
async fn migrate_gives_the_role_the_sessions_settings_and_keeps_the_operators_own() {
    let url = support::pg::fresh_database().await;
    support::pg::session(&url)
        .await
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER ROLE %I IN DATABASE %I SET jit = on', \
             current_user, current_database()); END $$",
        )
        .await
        .unwrap();
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    assert_eq!(
        without_options(&url, "search_path").await,
        "turnstile, public"
    );
    assert_eq!(without_options(&url, "enable_seqscan").await, "off");
    assert_eq!(
        without_options(&url, "jit").await,
        "on",
        "the operator's own"
    );
    // Another database of the cluster is not touched.
    let other = support::pg::fresh_database().await;
    assert_eq!(without_options(&other, "enable_seqscan").await, "on");
}
