//! A single PostgreSQL's database moved to Citus, as `docs/scale-out.md` tells an operator to:
//! what the turns committed stays, and what they answered is still answered from its receipt.
#![allow(clippy::unwrap_used)]

use crate::support;

use support::{TestApp, message, request, texts};
use turnstile::activity::incoming::{ActivityId, ChannelId, ConversationId, UserId};
use turnstile::state::StateKey;
use turnstile::store::postgres::{self, Citus, CitusLayout, DatabaseUrl, PostgresStore};
use turnstile::store::{Commit, CommitOutcome, Expected, KeyChange, Store, Version};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_postgres_database_moved_to_citus_keeps_its_state_and_receipts() {
    if !support::citus::installed() {
        return;
    }
    let citus = support::citus::shared();
    let url = citus.plain_database().await;

    // Served as a single PostgreSQL: an order, and the activity that started it.
    let first = message("moved", "ann", "add mushroom");
    {
        let mut app = TestApp::on(&url).spawn().await;
        let added = app
            .client
            .process_turn(request(first.clone()))
            .await
            .unwrap()
            .into_inner();
        assert!(!added.redelivered);
        support::say(&mut app.client, "moved", "add cheese").await;
    }
    let (_, layout) = postgres::migrate_with(&DatabaseUrl::new(&url), CitusLayout::Detect)
        .await
        .unwrap();
    assert_eq!(
        layout,
        Citus::Absent,
        "no extension yet: a single PostgreSQL"
    );

    // The server becomes a coordinator: the extension, its workers; then `migrate --citus`.
    citus.make_distributed(&url).await;
    let (applied, layout) = postgres::migrate_with(&DatabaseUrl::new(&url), CitusLayout::Required)
        .await
        .unwrap();
    assert_eq!((applied, layout), (0, Citus::Distributed));
    let db = support::pg::session(&url).await;
    let distributed: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_dist_partition \
              WHERE logicalrelid IN ('turnstile_state'::regclass, 'turnstile_receipt'::regclass)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(distributed, 2, "state and receipts are distributed");
    let (_, again) = postgres::migrate_with(&DatabaseUrl::new(&url), CitusLayout::Required)
        .await
        .unwrap();
    assert_eq!(again, Citus::AlreadyDistributed);

    let mut app = TestApp::on(&url).spawn().await;
    // The first activity, delivered again: answered from its receipt, the bot not run.
    let again = app
        .client
        .process_turn(request(first))
        .await
        .unwrap()
        .into_inner();
    assert!(again.redelivered, "{again:?}");
    // The order goes on from what was committed before the move.
    let shown = support::say(&mut app.client, "moved", "add ham").await;
    let text = texts(&shown).join("\n");
    for topping in ["mushroom", "cheese", "ham"] {
        assert!(text.contains(topping), "{text}");
    }
}

#[tokio::test]
async fn migrate_with_citus_refuses_a_database_without_the_extension() {
    let url = DatabaseUrl::new(support::pg::fresh_database().await);
    let err = postgres::migrate_with(&url, CitusLayout::Required)
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("CREATE EXTENSION citus"),
        "{err:#}"
    );
}

/// What Citus counted on the coordinator since the cluster started: statements it sent to one
/// shard and to several (`citus_stat_counters`), and transactions it committed in two phases
/// (`pg_dist_transaction`, kept while recovery is off).
async fn counted(db: &tokio_postgres::Client) -> (i64, i64, i64) {
    let row = db
        .query_one(
            "SELECT sum(query_execution_single_shard)::int8, sum(query_execution_multi_shard)::int8, \
                    (SELECT count(*) FROM pg_dist_transaction) \
               FROM citus_stat_counters",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A turn that writes only its conversation's state commits on that conversation's shard without
/// two-phase commit, and one that also writes its user's state commits on both shards with it.
/// Counted by Citus itself, with its recovery of two-phase commits off so that their records
/// stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_only_turns_commit_without_two_phase_commit() {
    if !support::citus::installed() {
        return;
    }
    let citus = tokio::task::spawn_blocking(|| {
        support::citus::CitusCluster::start_with(
            2,
            &[
                "citus.recover_2pc_interval=-1",
                "citus.enable_stat_counters=on",
            ],
        )
    })
    .await
    .unwrap();
    let url = citus.fresh_database().await;
    let mut app = TestApp::on(&url).spawn().await;
    support::say(&mut app.client, "warm-up", "add mushroom").await;
    let db = support::pg::session(&url).await;
    // The server's first upkeep pass, at its start, writes the reference tables (the receipts'
    // clock, the tombstones), which Citus always commits in two phases: counted once it is over.
    // Its last writes set the receipts' clock to this retention and leave the legacy table
    // behind; on a loaded machine the pass can still be going after the first turn, and a pause
    // in it looked like its end.
    let width = turnstile::Config::default().receipt_retention.as_secs_f64() / 2.0;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let clock = db
            .query_one(
                "SELECT width_secs = $1 AND NOT legacy FROM turnstile_receipt_clock",
                &[&width],
            )
            .await
            .unwrap();
        if clock.get::<_, bool>(0) {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the server's first upkeep pass did not set the receipts' clock in 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut two_phase = counted(&db).await.2;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
        let now = counted(&db).await.2;
        if now == two_phase {
            break;
        }
        two_phase = now;
    }

    let (single, multi, two_phase) = counted(&db).await;
    for i in 0..20 {
        support::say(&mut app.client, &format!("c{i}"), "add cheese").await;
    }
    let (single_after, multi_after, two_phase_after) = counted(&db).await;
    eprintln!(
        "20 conversation-only turns: {} single-shard statements, {} multi-shard, {} two-phase \
         commits",
        single_after - single,
        multi_after - multi,
        two_phase_after - two_phase
    );
    assert_eq!(
        two_phase_after, two_phase,
        "a conversation-only turn committed in two phases"
    );
    assert!(single_after - single >= 20, "each commit asks one shard");
}

/// The group commit on Citus sends together the single-scope writes whose shards one node holds,
/// and that node runs them in one local transaction: the commits of many conversations that
/// arrive at once batch up, and no node commits in two phases (a write sent to a node that does
/// not hold its shard would be committed in two phases by that node, and counted there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_batches_by_node_without_two_phase_commit() {
    if !support::citus::installed() {
        return;
    }
    let citus = tokio::task::spawn_blocking(|| {
        support::citus::CitusCluster::start_with(2, &["citus.recover_2pc_interval=-1"])
    })
    .await
    .unwrap();
    let (url, _, nodes) = migrated_on_every_node(&citus).await;
    let two_phase = || async {
        let mut counts = Vec::new();
        for node in &nodes {
            let row = node
                .query_one("SELECT count(*) FROM pg_dist_transaction", &[])
                .await
                .unwrap();
            counts.push(row.get::<_, i64>(0));
        }
        counts
    };
    let before = two_phase().await;

    let store = PostgresStore::connect(&url, 4).unwrap();
    let channel = ChannelId::parse("test", "channel_id").unwrap();
    let conversations: Vec<ConversationId> = (0..48)
        .map(|i| ConversationId::parse(&format!("node-batch-{i}"), "conversation.id").unwrap())
        .collect();
    let turn = |round: u64, conversation: &ConversationId| {
        let key = StateKey::conversation("bot", &channel, conversation);
        let expected = match round {
            0 => Expected::Absent,
            n => Expected::Version(Version::new(n)),
        };
        let activity = ActivityId::parse(&format!("a{round}"), "id").unwrap();
        let receipt = StateKey::receipt("bot", &channel, conversation, &activity);
        Commit::new(vec![KeyChange {
            key,
            expected,
            write: Some(serde_json::Map::from_iter([("round".to_owned(), round.into())]).into()),
        }])
        .with_receipt(receipt, serde_json::json!({ "round": round }))
    };
    for round in 0..3 {
        let commits = conversations.iter().map(|c| store.commit(turn(round, c)));
        for outcome in futures::future::join_all(commits).await {
            match outcome.unwrap() {
                CommitOutcome::Committed(_) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
    }
    let stats = store.group_commit_stats();
    eprintln!("group commit on Citus: {stats:?}");
    assert_eq!(stats.commits, 3 * 48, "{stats:?}");
    assert!(
        stats.largest >= 8,
        "the commits that arrived together were not batched: {stats:?}"
    );
    assert_eq!(
        two_phase().await,
        before,
        "a node committed a batch in two phases (coordinator, worker 1, worker 2)"
    );

    // The receipts' upkeep writes the clock, a reference table (every write of which Citus
    // commits in two phases on all nodes), only when it changes: on its first pass, not after.
    let retention = std::time::Duration::from_secs(3600);
    store.prune_receipts(retention).await.unwrap();
    let settled = two_phase().await;
    store.prune_receipts(retention).await.unwrap();
    assert_eq!(
        two_phase().await,
        settled,
        "a pass of the receipts' upkeep that changed nothing committed in two phases"
    );
}

/// A load on Citus looks for a key's erasure tombstone only when the key has no row, as on a
/// single PostgreSQL (`statement_plans::a_load_looks_for_tombstones_only_of_keys_without_a_row`):
/// loads of a conversation's and a user's rows (two shards, two statements), alone or under the
/// conversation's lock, scan no placement of the tombstones' reference table on any node; loads
/// of keys without rows do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_on_citus_looks_for_tombstones_only_of_keys_without_a_row() {
    if !support::citus::installed() {
        return;
    }
    let citus = support::citus::shared();
    let (url, name, nodes) = migrated_on_every_node(citus).await;
    // Citus hides its shards from the catalog (so from the statistics' views) unless asked.
    for node in &nodes {
        node.batch_execute("SET citus.show_shards_for_app_name_prefixes = '*'")
            .await
            .unwrap();
    }
    // Scans of the tombstones' placements on every node. A backend reports its counts when it
    // has been idle for a while, and at once when it exits: so each step below ends its
    // connections (and with them the coordinator's to the workers) before this counts.
    let lookups = || async {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut last = None;
        loop {
            let mut now = 0;
            for node in &nodes {
                let row = node
                    .query_one(
                        "SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0)::int8 \
                           FROM pg_stat_user_tables WHERE relname LIKE 'turnstile_tombstone%'",
                        &[],
                    )
                    .await
                    .unwrap();
                now += row.get::<_, i64>(0);
            }
            if last == Some(now) {
                return now;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the statistics never settled"
            );
            last = Some(now);
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        }
    };

    let channel = ChannelId::parse("test", "channel_id").unwrap();
    let turn_keys = |i: usize| {
        let conversation = ConversationId::parse(&format!("gate-{i}"), "conversation.id").unwrap();
        let user = UserId::parse(&format!("gate-user-{i}"), "from.id").unwrap();
        let activity = ActivityId::parse("a1", "id").unwrap();
        (
            vec![
                StateKey::conversation("bot", &channel, &conversation),
                StateKey::user("bot", &channel, &user),
            ],
            StateKey::receipt("bot", &channel, &conversation, &activity),
        )
    };
    const TURNS: usize = 20;
    // Loads of turns `from..from + TURNS`, each finding rows or not, on a store of their own.
    let loads = |from: usize, rows: bool| {
        let url = url.clone();
        async move {
            let store = PostgresStore::connect(&url, 4).unwrap();
            for i in from..from + TURNS {
                let (keys, receipt) = turn_keys(i);
                let snapshot = store.load(&keys, Some(&receipt)).await.unwrap();
                assert!(keys.iter().all(|key| snapshot.get(key).is_some() == rows));
            }
        }
    };
    // The same under the conversation's lock (`turnstile_load`, `citus/functions.sql`).
    let held_loads = |from: usize| {
        let coordinator = citus.coordinator.url(&name);
        async move {
            let session = support::pg::session(&coordinator).await;
            for i in from..from + TURNS {
                let (keys, _) = turn_keys(i);
                let names: Vec<&str> = keys.iter().map(StateKey::as_str).collect();
                session
                    .query(
                        "SELECT * FROM turnstile_load($1, NULL, $2)",
                        &[&names, &names[0]],
                    )
                    .await
                    .unwrap();
            }
        }
    };

    {
        let store = PostgresStore::connect(&url, 4).unwrap();
        for i in 0..TURNS {
            let (keys, _) = turn_keys(i);
            let changes = keys
                .into_iter()
                .map(|key| KeyChange {
                    key,
                    expected: Expected::Absent,
                    write: Some(serde_json::Map::new().into()),
                })
                .collect();
            match store.commit(Commit::new(changes)).await.unwrap() {
                CommitOutcome::Committed(_) => {}
                other => panic!("{other:?}"),
            }
        }
    }
    // The creates looked their keys' tombstones up (the insert trigger): counted before.
    let before = lookups().await;

    loads(0, true).await;
    held_loads(0).await;
    let with_rows = lookups().await;
    assert_eq!(
        with_rows - before,
        0,
        "{} tombstone lookups for {TURNS} loads and {TURNS} held loads of keys with rows",
        with_rows - before
    );

    loads(TURNS, false).await;
    let without_rows = lookups().await;
    assert!(
        without_rows - with_rows >= 2 * TURNS as i64,
        "{} tombstone lookups for {TURNS} loads of two keys without rows",
        without_rows - with_rows
    );
    held_loads(TURNS).await;
    let held_without_rows = lookups().await;
    assert!(
        held_without_rows - without_rows >= 2 * TURNS as i64,
        "{} tombstone lookups for {TURNS} held loads of two keys without rows",
        held_without_rows - without_rows
    );
}

/// A fresh database of `citus` migrated into Citus' layout: its URL and name, and a session on it
/// on every node, the coordinator's first.
async fn migrated_on_every_node(
    citus: &support::citus::CitusCluster,
) -> (DatabaseUrl, String, Vec<tokio_postgres::Client>) {
    let url = citus.fresh_database().await;
    let name = url
        .parse::<tokio_postgres::Config>()
        .unwrap()
        .get_dbname()
        .unwrap()
        .to_owned();
    let url = DatabaseUrl::new(url);
    postgres::migrate_with(&url, CitusLayout::Required)
        .await
        .unwrap();
    let mut nodes = vec![support::pg::session(&citus.coordinator.url(&name)).await];
    for worker in &citus.workers {
        nodes.push(support::pg::session(&worker.url(&name)).await);
    }
    (url, name, nodes)
}
