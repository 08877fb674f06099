//! Hot conversations across replicas: many concurrent turns of one conversation on several
//! replicas queue in PostgreSQL (the conversation lock, and leases of it) instead of racing. What
//! a user would notice: no acknowledged update is lost under either concurrency policy; a bot
//! under `serialized` runs exactly once per turn; a lock that cannot be had in time ends the call
//! with nothing committed; a replica that dies holding a lock stalls nobody; and a leased
//! conversation's queued turns share one lease, which ends with them.
#![allow(clippy::unwrap_used)]

use crate::support;
use crate::support::pg::session;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use support::fleet::Fleet;
use support::{TestApp, message, request, say, texts, toppings};
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;
use turnstile::activity::incoming::{ChannelId, ConversationId};
use turnstile::bots::PizzaBot;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::state::StateKey;
use turnstile::store::postgres::{self, DatabaseUrl, PostgresStore, Statements};
use turnstile::store::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, Expected, KeyChange, Others,
    Snapshot, Store, StoreError, Version,
};
use turnstile::{Bot, BotError, BotRegistry, ConcurrencyPolicy, TurnContext};

const TURNS: usize = 40;

/// The pizza bot, counting its runs across every replica of the test.
struct Counted(Arc<AtomicU32>);

#[async_trait]
impl Bot for Counted {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        PizzaBot.on_turn(turn).await
    }
}

/// [`Counted`], thinking for a moment first. On a Citus cluster sharing two cores with the rest
/// of the suite, a turn takes long enough that 40 sent at once can reach the bot one after
/// another, and never race; the pause keeps each turn's load and commit apart, so they do.
struct Pondering(Arc<AtomicU32>);

#[async_trait]
impl Bot for Pondering {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        Counted(Arc::clone(&self.0)).on_turn(turn).await
    }
}

/// Three replicas over one fresh database, each with its own pool, hosting the counted pizza bot
/// under `policy`; and the shared run counter.
async fn replicas(policy: ConcurrencyPolicy) -> (Vec<TestApp>, Arc<AtomicU32>) {
    replicas_on(&support::pg::fresh_database().await, policy, false).await
}

/// [`replicas`] over database `url`, the bot [`Pondering`] when `ponder` says so.
async fn replicas_on(
    url: &str,
    policy: ConcurrencyPolicy,
    ponder: bool,
) -> (Vec<TestApp>, Arc<AtomicU32>) {
    let runs = Arc::new(AtomicU32::new(0));
    let bots = || {
        if ponder {
            BotRegistry::new("pizza", Pondering(Arc::clone(&runs)))
        } else {
            BotRegistry::new("pizza", Counted(Arc::clone(&runs)))
        }
        .with_policy("pizza", policy)
        .unwrap()
    };
    let (a, b, c) = tokio::join!(
        TestApp::on(url).bots(bots()).spawn(),
        TestApp::on(url).bots(bots()).spawn(),
        TestApp::on(url).bots(bots()).spawn(),
    );
    (vec![a, b, c], runs)
}

/// Sends `add t00` … `add t39` at once, turn i through replica i % 3; returns each turn's
/// topping, reply and attempts. Each call has a deadline of a minute, as a gateway's would: a call
/// without one waits at most 5 s for its conversation, and a turn queued behind many others on a
/// busy machine waits longer than that.
async fn race(servers: &[TestApp], conversation: &str) -> Vec<(String, String, u32)> {
    race_of(servers, conversation, TURNS).await
}

/// [`race`] with `turns` turns.
async fn race_of(
    servers: &[TestApp],
    conversation: &str,
    turns: usize,
) -> Vec<(String, String, u32)> {
    let clients: Vec<_> = servers.iter().map(|app| app.client.clone()).collect();
    let calls: Vec<_> = (0..turns)
        .map(|i| {
            let mut client = clients[i % clients.len()].clone();
            let activity = message(conversation, &format!("user{i}"), &format!("add t{i:02}"));
            tokio::spawn(async move {
                let mut call = tonic::Request::new(request(activity));
                call.set_timeout(Duration::from_secs(60));
                let response = client
                    .process_turn(call)
                    .await
                    .unwrap_or_else(|s| panic!("add t{i:02} failed: {s:?}"))
                    .into_inner();
                (
                    format!("t{i:02}"),
                    texts(&response).join("\n"),
                    response.attempts,
                )
            })
        })
        .collect();
    let mut added = Vec::new();
    for call in calls {
        added.push(call.await.unwrap());
    }
    added
}

/// Every reply names its topping, the acknowledged orders form one chain of sizes 1..=40, and
/// the final order holds every topping.
async fn assert_exact(added: &[(String, String, u32)], client: &mut TurnServiceClient<Channel>) {
    let mut orders: Vec<BTreeSet<String>> = Vec::new();
    for (topping, reply, _) in added {
        let order: BTreeSet<String> = toppings(reply).into_iter().collect();
        assert!(
            reply.starts_with(&format!("Added {topping}.")) && order.contains(topping),
            "the reply to `add {topping}` does not name it: {reply:?}"
        );
        orders.push(order);
    }
    orders.sort_by_key(BTreeSet::len);
    let sizes: Vec<usize> = orders.iter().map(BTreeSet::len).collect();
    assert_eq!(sizes, (1..=added.len()).collect::<Vec<_>>());
    for pair in orders.windows(2) {
        assert!(
            pair[0].is_subset(&pair[1]),
            "an acknowledged order was lost"
        );
    }
    let shown = say(client, "hot", "show").await;
    let final_order: BTreeSet<String> = toppings(&texts(&shown)[0]).into_iter().collect();
    let all: BTreeSet<String> = added.iter().map(|(t, _, _)| t.clone()).collect();
    assert_eq!(final_order, all, "`show` lists every acknowledged topping");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn optimistic_turns_that_conflict_queue_for_the_lock_and_run_at_most_twice() {
    optimistic_turns_queue_for_the_lock(replicas(ConcurrencyPolicy::Optimistic).await).await;
}

/// The same hot conversation with the tables distributed over a Citus coordinator and 2 workers:
/// the lock tables stay on the coordinator, where the replicas' locks meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_citus_optimistic_turns_that_conflict_queue_for_the_lock_and_run_at_most_twice() {
    if !support::citus::installed() {
        return;
    }
    let url = support::citus::shared().fresh_database().await;
    optimistic_turns_queue_for_the_lock(
        replicas_on(&url, ConcurrencyPolicy::Optimistic, true).await,
    )
    .await;
}

async fn optimistic_turns_queue_for_the_lock((servers, runs): (Vec<TestApp>, Arc<AtomicU32>)) {
    let added = race(&servers, "hot").await;
    let mut client = servers[0].client.clone();
    assert_exact(&added, &mut client).await;

    let attempts: Vec<u32> = added.iter().map(|(_, _, a)| *a).collect();
    let ran: u32 = attempts.iter().sum();
    eprintln!("attempts per turn: {attempts:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        ran + 1,
        "the bot ran once per reported attempt (and once for `show`)"
    );
    assert!(
        attempts.contains(&2),
        "no turn conflicted: the race never happened"
    );
    assert!(
        attempts.iter().all(|&a| a <= 2),
        "a turn holding the conversation lock lost again: {attempts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_serialized_bot_runs_exactly_once_per_turn() {
    serialized_runs_once(replicas(ConcurrencyPolicy::Serialized).await, TURNS).await;
}

/// The same on Citus, with 16 turns: each turn of a serialized conversation waits for all those
/// before it, each a round trip more than on one PostgreSQL (`bench/RESULTS.md`), and on a Citus
/// cluster sharing two cores with the rest of the suite 40 of them take long.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_citus_a_serialized_bot_runs_exactly_once_per_turn() {
    if !support::citus::installed() {
        return;
    }
    let url = support::citus::shared().fresh_database().await;
    serialized_runs_once(
        replicas_on(&url, ConcurrencyPolicy::Serialized, false).await,
        16,
    )
    .await;
}

async fn serialized_runs_once((servers, runs): (Vec<TestApp>, Arc<AtomicU32>), turns: usize) {
    let added = race_of(&servers, "hot", turns).await;
    let attempts: Vec<u32> = added.iter().map(|(_, _, a)| *a).collect();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        turns as u32,
        "one run per turn, none thrown away (attempts per turn: {attempts:?})"
    );
    assert!(added.iter().all(|(_, _, a)| *a == 1), "{added:?}");
    let mut client = servers[0].client.clone();
    assert_exact(&added, &mut client).await;
}

/// Takes the conversation lock of `conversation` for `bot` by hand on `session`, a session on
/// `url`, as another replica's turn would: a transaction holding its lock table, until `COMMIT`
/// or `ROLLBACK`. The database is migrated first (a server started just before may not have
/// got that far).
async fn hold_by_hand(session: &tokio_postgres::Client, url: &str, bot: &str, conversation: &str) {
    postgres::migrate(&DatabaseUrl::new(url)).await.unwrap();
    let key = StateKey::conversation(
        bot,
        &ChannelId::parse("test", "channelId").unwrap(),
        &ConversationId::parse(conversation, "conversation.id").unwrap(),
    );
    session
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {} IN EXCLUSIVE MODE",
            postgres::lock_table(&key)
        ))
        .await
        .unwrap();
}

/// Takes `conversation`'s fenced hold for `bot` on the `test` channel by hand, with `session`,
/// as a replica whose serialized turn runs a slow bot would hold it (`store::postgres::hold`).
async fn take_hold_by_hand(
    session: &tokio_postgres::Client,
    url: &str,
    bot: &str,
    conversation: &str,
) {
    postgres::migrate(&DatabaseUrl::new(url)).await.unwrap();
    session
        .execute(
            "INSERT INTO turnstile_state (key, state, version) \
             VALUES ($1 || '/%hold', '{\"holder\": \"by hand\", \"until\": 1e12}', 1)",
            &[&conversation_key(bot, conversation)],
        )
        .await
        .unwrap();
}

/// Releases the hold [`take_hold_by_hand`] took, and announces it as a replica does.
async fn release_hold_by_hand(session: &tokio_postgres::Client, bot: &str, conversation: &str) {
    let key = format!("{}/%hold", conversation_key(bot, conversation));
    session
        .batch_execute(&format!(
            "UPDATE turnstile_state SET state = jsonb_set(state, '{{until}}', '0') \
              WHERE key = '{key}'; SELECT pg_notify('turnstile_hold', '{key}')"
        ))
        .await
        .unwrap();
}

/// How many conversations' fenced holds are held right now in `db`'s database.
async fn holds_held(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT count(*) FROM turnstile_state WHERE key LIKE '%/\\%hold' \
            AND (state->>'until')::float8 > extract(epoch FROM clock_timestamp())",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// The conversation scope's key of `conversation` for `bot` on the `test` channel.
fn conversation_key(bot: &str, conversation: &str) -> String {
    StateKey::conversation(
        bot,
        &ChannelId::parse("test", "channelId").unwrap(),
        &ConversationId::parse(conversation, "conversation.id").unwrap(),
    )
    .as_str()
    .to_owned()
}

/// How many sessions wait for a conversation lock in `db`'s database right now.
async fn lock_waiters(db: &tokio_postgres::Client) -> i64 {
    conversation_locks(db, false).await
}

/// How many conversation locks (locks of the lock tables) of `db`'s database are held
/// (`granted`) or waited for right now.
async fn conversation_locks(db: &tokio_postgres::Client, granted: bool) -> i64 {
    db.query_one(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
          WHERE l.locktype = 'relation' AND c.relname LIKE 'turnstile\\_lock\\_%' \
            AND l.granted = $1 \
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        &[&granted],
    )
    .await
    .unwrap()
    .get(0)
}

/// How many sessions of `db`'s database hold back the pruning of row versions (a snapshot's
/// `xmin`) while they wait for a lock or sit idle in a transaction — as a lease does between its
/// turns.
async fn holding_back_pruning(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
            AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL \
            AND (wait_event_type = 'Lock' OR state = 'idle in transaction')",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Waits until no conversation lock is held in `db`'s database: every lease and lock has ended,
/// and no connection went back to a pool still holding one.
async fn until_nothing_is_held(db: &tokio_postgres::Client, what: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while conversation_locks(db, true).await > 0 {
        assert!(Instant::now() < until, "{what}: a lock is still held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until someone waits for a conversation lock in `db`'s database.
async fn until_someone_waits(db: &tokio_postgres::Client, what: &str) {
    let until = Instant::now() + Duration::from_secs(20);
    while lock_waiters(db).await == 0 {
        assert!(Instant::now() < until, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A lease holds its conversation against every other replica's lock and lease across its
/// holder's turns, whose commits go through; the next holder waits without holding back the
/// pruning of row versions (even on a connection of its own), learns that it had to wait, and
/// gets in with the commit of the lease's last turn, on what it committed; nothing of either is
/// left in PostgreSQL once they ended; and behind a transaction-mode pooler no lease is offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_holds_the_conversation_across_turns_until_dropped() {
    // A cluster of its own: other tests' migrations (a thousand tables each) overflow a shared
    // cluster's cache-invalidation queue, and a session whose caches were reset looks the lock
    // table up again inside its wait, holding a catalog snapshot for that one wait.
    let cluster = support::pg::Cluster::start();
    let url = support::pg::fresh_database_in(&cluster).await;
    let db_url = DatabaseUrl::new(url.clone());
    postgres::migrate(&db_url).await.unwrap();
    let holder = PostgresStore::connect(&db_url, 4).unwrap();
    let other = PostgresStore::connect(&db_url, 4).unwrap();
    let observer = session(&url).await;
    let key = StateKey::conversation(
        "pizza",
        &ChannelId::parse("test", "channelId").unwrap(),
        &ConversationId::parse("leased", "conversation.id").unwrap(),
    );
    let keys = [key.clone()];
    let wait = Duration::from_secs(10);
    let short = Duration::from_millis(300);
    let written = |expected, n: u64| {
        Commit::new(vec![KeyChange {
            key: key.clone(),
            expected,
            write: Some(serde_json::Map::from_iter([("n".to_owned(), n.into())]).into()),
        }])
    };

    let ConversationLease::Held {
        lease,
        snapshot,
        waited,
    } = holder
        .lease_conversation(&key, &keys, None, wait)
        .await
        .unwrap()
    else {
        panic!("an idle conversation's lease was not granted");
    };
    assert!(!waited, "nobody else held the conversation");
    assert!(snapshot.get(&key).is_none());
    // The lease's turns commit as any other.
    let first = holder.commit(written(Expected::Absent, 1)).await.unwrap();
    assert!(matches!(first, CommitOutcome::Committed(_)), "{first:?}");

    // Leases keep at most half the pool (of 4): a second conversation's is granted, a third's is
    // not offered — that turn locks on its own — and the slot comes back with the lease.
    let others: Vec<StateKey> = ["leased-2", "leased-3"]
        .iter()
        .map(|id| {
            StateKey::conversation(
                "pizza",
                &ChannelId::parse("test", "channelId").unwrap(),
                &ConversationId::parse(id, "conversation.id").unwrap(),
            )
        })
        .collect();
    let second_lease = holder
        .lease_conversation(&others[0], &others[..1], None, wait)
        .await
        .unwrap();
    let ConversationLease::Held {
        lease: second_lease,
        ..
    } = second_lease
    else {
        panic!("a second lease in a pool of 4: {second_lease:?}");
    };
    let third = holder
        .lease_conversation(&others[1], &others[1..], None, wait)
        .await;
    assert!(
        matches!(third, Ok(ConversationLease::NotOffered)),
        "a third lease in a pool of 4: {third:?}"
    );
    drop(second_lease);
    let third = holder
        .lease_conversation(&others[1], &others[1..], None, wait)
        .await;
    assert!(
        matches!(third, Ok(ConversationLease::Held { .. })),
        "the second lease's slot did not come back: {third:?}"
    );
    drop(third);

    // The first turn is over; the lease is not, and holds nothing back meanwhile.
    assert_eq!(
        holding_back_pruning(&observer).await,
        0,
        "an idle lease holds back the pruning of row versions"
    );
    let lock = other.lock_conversation(&key, &keys, None, short).await;
    assert!(
        matches!(lock, Ok(ConversationLock::NotGranted)),
        "another replica's lock got in: {lock:?}"
    );
    let leased = other.lease_conversation(&key, &keys, None, short).await;
    assert!(
        matches!(leased, Ok(ConversationLease::NotGranted)),
        "another replica's lease got in: {leased:?}"
    );
    // The holder's next turns are ordinary commits.
    let second = holder
        .commit(written(Expected::Version(Version::FIRST), 2))
        .await
        .unwrap();
    assert!(matches!(second, CommitOutcome::Committed(_)), "{second:?}");

    // The next holder waits — holding back no row version while it does, on a connection new
    // to the lock table too — and the commit of the lease's last turn lets it in, on what that
    // turn committed.
    let next_holder = PostgresStore::connect(&db_url, 4).unwrap();
    let waiting = tokio::spawn({
        let key = key.clone();
        async move {
            next_holder
                .lease_conversation(&key, std::slice::from_ref(&key), None, wait)
                .await
        }
    });
    until_someone_waits(&observer, "the other replica never asked for the lease").await;
    assert_eq!(
        holding_back_pruning(&observer).await,
        0,
        "the holder or the waiter holds back the pruning of row versions"
    );
    let last = lease
        .into_last_turn()
        .commit(written(Expected::Version(Version::new(2)), 3))
        .await
        .unwrap();
    assert!(matches!(last, CommitOutcome::Committed(_)), "{last:?}");
    let ConversationLease::Held {
        lease: next,
        snapshot,
        waited,
    } = waiting.await.unwrap().unwrap()
    else {
        panic!("the lease was not handed on with its last turn's commit");
    };
    assert!(waited, "the next holder did not learn that it waited");
    assert_eq!(
        snapshot.get(&key).map(|row| row.version),
        Some(Version::new(3))
    );
    drop(next);
    until_nothing_is_held(&observer, "after both leases ended").await;

    let pooled = PostgresStore::connect_with(&db_url, 2, Statements::Unprepared).unwrap();
    let offered = pooled.lease_conversation(&key, &keys, None, short).await;
    assert!(
        matches!(offered, Ok(ConversationLease::NotOffered)),
        "a lease behind a transaction-mode pooler: {offered:?}"
    );
}

/// The store of one replica, counting how often its engine asks for the conversation.
struct CountingHolds {
    inner: PostgresStore,
    holds: AtomicU32,
}

#[async_trait]
impl Store for CountingHolds {
    async fn load(
        &self,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
    ) -> Result<Snapshot, StoreError> {
        self.inner.load(keys, receipt).await
    }

    async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
        self.inner.commit(commit).await
    }

    async fn prune_receipts(&self, age: Duration) -> Result<u64, StoreError> {
        self.inner.prune_receipts(age).await
    }

    async fn sweep_expired(
        &self,
        after: Option<&str>,
        batch: usize,
    ) -> Result<turnstile::store::Swept, StoreError> {
        self.inner.sweep_expired(after, batch).await
    }

    async fn erase(
        &self,
        erasure: &turnstile::store::Erasure,
    ) -> Result<turnstile::store::Erased, StoreError> {
        self.inner.erase(erasure).await
    }

    async fn add_pending(
        &self,
        conversation: &StateKey,
        pending: &turnstile::store::Pending,
    ) -> Result<(), StoreError> {
        self.inner.add_pending(conversation, pending).await
    }

    async fn inspect(
        &self,
        keys: &[StateKey],
        receipts_under: &str,
        receipts: usize,
    ) -> Result<turnstile::store::Inspected, StoreError> {
        self.inner.inspect(keys, receipts_under, receipts).await
    }

    async fn list_conversations(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<turnstile::store::InspectedRow>, StoreError> {
        self.inner.list_conversations(prefix, after, limit).await
    }

    async fn lock_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
    ) -> Result<ConversationLock, StoreError> {
        self.holds.fetch_add(1, Ordering::SeqCst);
        self.inner
            .lock_conversation(conversation, keys, receipt, wait)
            .await
    }

    async fn hold_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
        others: turnstile::store::Others,
    ) -> Result<ConversationLock, StoreError> {
        self.holds.fetch_add(1, Ordering::SeqCst);
        self.inner
            .hold_conversation(conversation, keys, receipt, wait, others)
            .await
    }

    async fn lease_conversation(
        &self,
        conversation: &StateKey,
        keys: &[StateKey],
        receipt: Option<&StateKey>,
        wait: Duration,
    ) -> Result<ConversationLease, StoreError> {
        self.holds.fetch_add(1, Ordering::SeqCst);
        self.inner
            .lease_conversation(conversation, keys, receipt, wait)
            .await
    }

    fn pool_status(&self) -> Option<turnstile::store::PoolStatus> {
        Store::pool_status(&self.inner)
    }
}

/// Turns of a hot conversation queued on one replica run on one lease, each once, rather than
/// taking the conversation one by one; and the lease ends with the last of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_conversations_queued_turns_share_one_lease() {
    queued_turns_share_one_lease(&support::pg::fresh_database().await).await;
}

/// The same on Citus: the lease's lock table on the coordinator, its turns' rows on a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_citus_a_hot_conversations_queued_turns_share_one_lease() {
    if !support::citus::installed() {
        return;
    }
    queued_turns_share_one_lease(&support::citus::shared().fresh_database().await).await;
}

async fn queued_turns_share_one_lease(url: &str) {
    const QUEUED: usize = 10;
    let url = url.to_owned();
    let db_url = DatabaseUrl::new(url.clone());
    postgres::migrate(&db_url).await.unwrap();
    let store = Arc::new(CountingHolds {
        inner: PostgresStore::connect(&db_url, 8).unwrap(),
        holds: AtomicU32::new(0),
    });
    let runs = Arc::new(AtomicU32::new(0));
    let mut app = TestApp::shared(Arc::clone(&store) as Arc<dyn Store>)
        .bots(BotRegistry::new("pizza", Counted(Arc::clone(&runs))))
        .spawn()
        .await;
    let observer = session(&url).await;
    let key = conversation_key("pizza", "queue");

    say(&mut app.client, "queue", "add ham").await;
    // Another replica moves the conversation on, and holds it.
    observer
        .execute(
            "UPDATE turnstile_state SET version = version + 1 WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap();
    let other = session(&url).await;
    hold_by_hand(&other, &url, "pizza", "queue").await;

    // This replica's next turn conflicts, and asks for the conversation; the others queue here.
    let started = Instant::now();
    let send = |i: usize| {
        let mut client = app.client.clone();
        tokio::spawn(async move {
            client
                .process_turn(request(message("queue", "alice", &format!("add q{i:02}"))))
                .await
                .unwrap_or_else(|s| panic!("add q{i:02} failed: {s:?}"))
                .into_inner()
        })
    };
    let first = send(0);
    until_someone_waits(
        &observer,
        "the conflicting turn never asked for the conversation",
    )
    .await;
    let queued: Vec<_> = (1..=QUEUED).map(send).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    other.batch_execute("COMMIT").await.unwrap();

    assert_eq!(
        first.await.unwrap().attempts,
        2,
        "the first turn conflicted once"
    );
    for turn in queued {
        assert_eq!(turn.await.unwrap().attempts, 1, "a queued turn ran twice");
    }
    let elapsed = started.elapsed();
    let shown = say(&mut app.client, "queue", "show").await;
    assert_eq!(toppings(&texts(&shown)[0]).len(), QUEUED + 2);
    assert_eq!(runs.load(Ordering::SeqCst) as usize, 1 + 2 + QUEUED + 1);

    // One lease for all, give or take one per `LEASE_TIME` (50 ms) the turns took; holding
    // the conversation turn by turn would ask for it once per turn.
    let holds = store.holds.load(Ordering::SeqCst) as usize;
    let allowed = 2 + usize::try_from(elapsed.as_millis() / 50).unwrap();
    eprintln!(
        "{} turns asked for the conversation {holds} times in {elapsed:?}",
        QUEUED + 1
    );
    assert!(
        holds < QUEUED && holds <= allowed,
        "{holds} holds for {} turns in {elapsed:?}",
        QUEUED + 1
    );
    until_nothing_is_held(&observer, "after the queue emptied").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_not_granted_in_time_ends_the_turn_with_nothing_committed() {
    let runs = Arc::new(AtomicU32::new(0));
    let bots = BotRegistry::new("pizza", Counted(Arc::clone(&runs)))
        .with_policy("pizza", ConcurrencyPolicy::Serialized)
        .unwrap();
    let mut app = TestApp::postgres().bots(bots).spawn().await;
    let url = app.database_url().to_owned();

    // Another party holds the conversation, as a replica with a slow turn would.
    let holder = session(&url).await;
    take_hold_by_hand(&holder, &url, "pizza", "held").await;

    // With a deadline: DEADLINE_EXCEEDED, at the deadline.
    let asked = Instant::now();
    let mut call = tonic::Request::new(request(message("held", "alice", "add ham")));
    call.set_timeout(Duration::from_secs(2));
    let status = app.client.process_turn(call).await.unwrap_err();
    // The server gives up a little before the deadline to say so; on a loaded machine tonic's
    // client may still see its own timer first, which it reports as CANCELLED.
    assert!(
        matches!(
            status.code(),
            Code::DeadlineExceeded | Code::Aborted | Code::Cancelled
        ),
        "{status:?}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "{:?}",
        asked.elapsed()
    );
    // Waiting held nothing in PostgreSQL: no transaction stayed open for it.
    let observer = session(&url).await;
    assert_eq!(holding_back_pruning(&observer).await, 0);

    // Without a deadline the server bounds the wait itself and says so: the status is its own.
    let started = Instant::now();
    let status = app
        .client
        .process_turn(request(message("held", "alice", "add olives")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    // It says the conversation was held, not that its state kept changing: the bot never ran.
    let info = tonic_types::StatusExt::get_details_error_info(&status).expect("an ErrorInfo");
    assert_eq!(info.reason, "CONVERSATION_HELD", "{status:?}");
    assert!(
        status.message().contains("held it for all of the 5s")
            && status.message().contains("nothing was committed"),
        "{status:?}"
    );
    assert!(
        tonic_types::StatusExt::get_details_retry_info(&status).is_some(),
        "{status:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );

    assert_eq!(runs.load(Ordering::SeqCst), 0, "the bot never ran");
    let rows: i64 = observer
        .query_one(
            "SELECT (SELECT count(*) FROM turnstile_state WHERE key NOT LIKE '%/\\%hold') \
                  + (SELECT count(DISTINCT key) FROM turnstile_receipt)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "nothing was committed");

    // Once the holder is done, the conversation serves again.
    release_hold_by_hand(&holder, "pizza", "held").await;
    let added = say(&mut app.client, "held", "add ham").await;
    assert_eq!(toppings(&texts(&added)[0]), ["ham"]);
}

/// The hold and the load under it go to PostgreSQL together; the load must still run after the
/// hold is taken, so that a waiting turn sees what the turn before it committed — here a
/// conversation that did not exist when the waiter asked — and runs once; and the release's
/// announcement lets it in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_waiting_for_the_hold_loads_what_was_committed_while_it_waited() {
    let runs = Arc::new(AtomicU32::new(0));
    let serialized = BotRegistry::new("pizza", Counted(Arc::clone(&runs)))
        .with_policy("pizza", ConcurrencyPolicy::Serialized)
        .unwrap();
    let waiter = TestApp::postgres().bots(serialized).spawn().await;
    let url = waiter.database_url();
    // Another replica whose bot is not serialized, so it commits without the hold.
    let mut other = waiter.replica(BotRegistry::new("pizza", PizzaBot)).await;

    let holder = session(url).await;
    take_hold_by_hand(&holder, url, "pizza", "queued").await;

    let mut client = waiter.client.clone();
    let waiting = tokio::spawn(async move {
        client
            .process_turn(request(message("queued", "alice", "add olives")))
            .await
            .map(tonic::Response::into_inner)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the turn waits for the hold"
    );
    // While it waits, the conversation comes into being elsewhere.
    let added = say(&mut other.client, "queued", "add ham").await;
    assert_eq!(toppings(&texts(&added)[0]), ["ham"]);
    let released = Instant::now();
    release_hold_by_hand(&holder, "pizza", "queued").await;

    let response = waiting.await.unwrap().unwrap();
    eprintln!(
        "the waiter answered {:?} after the release",
        released.elapsed()
    );
    let mut order = toppings(&texts(&response)[0]);
    order.sort();
    assert_eq!(order, ["ham", "olives"], "{:?}", texts(&response));
    assert_eq!(
        response.attempts, 1,
        "the waiter ran on state loaded once it held the conversation"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A `slow` turn on the given conversation, through `addr`, with a deadline of `timeout`.
async fn slow_turn(
    addr: std::net::SocketAddr,
    conversation: &str,
    timeout: Duration,
) -> Result<pb::ProcessTurnResponse, tonic::Status> {
    let mut client = TurnServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let mut call = tonic::Request::new(pb::ProcessTurnRequest::typed(
        message(conversation, "alice", "hi"),
        "slow",
    ));
    call.set_timeout(timeout);
    client
        .process_turn(call)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_while_holding_a_conversation_stalls_it_only_until_its_hold_runs_out() {
    const BOT_DELAY: Duration = Duration::from_secs(2);
    let url = support::pg::fresh_database().await;
    let mut fleet = Fleet::start_with_env(
        3,
        &url,
        &[
            ("TURNSTILE_SERIALIZED_BOTS", "slow"),
            ("TURNSTILE_SLOW_BOT_DELAY_MS", "2000"),
        ],
    )
    .await;
    let addrs = fleet.addrs();
    let observer = session(&url).await;

    // Replica 0 takes the conversation and runs its slow bot…
    let doomed = tokio::spawn(slow_turn(addrs[0], "kill", Duration::from_secs(30)));
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        if holds_held(&observer).await > 0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "replica 0 never held the conversation in PostgreSQL"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // …and dies holding it, long before its bot is done.
    fleet.kill(0);
    assert!(
        doomed.await.unwrap().is_err(),
        "the killed replica answered"
    );

    // The other replicas get the conversation once the dead replica's hold runs out (it is not
    // renewed any more): each turn waits for that, and for its own bot and the other's, not for
    // the dead replica's bot.
    let started = Instant::now();
    let (one, two) = tokio::join!(
        slow_turn(addrs[1], "kill", Duration::from_secs(30)),
        slow_turn(addrs[2], "kill", Duration::from_secs(30)),
    );
    let elapsed = started.elapsed();
    let mut counts: Vec<String> = [one, two]
        .into_iter()
        .map(|r| texts(&r.unwrap()).join(""))
        .collect();
    counts.sort();
    assert_eq!(
        counts,
        ["count: 1", "count: 2"],
        "the killed turn committed nothing; the two others one each, in turn"
    );
    assert!(
        elapsed
            < 2 * BOT_DELAY + turnstile::store::postgres::hold::HOLD_FOR + Duration::from_secs(6),
        "the survivors were stalled: {elapsed:?}"
    );
    eprintln!("two serialized slow turns after the kill took {elapsed:?}");
    for (status, log) in fleet.stop() {
        assert!(status.success(), "{status}: {log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_wait_lasts_as_long_as_the_turn_allows_past_the_statement_timeout() {
    // A slow bot's turn holds the lock for longer than one statement may take (8 s): another
    // replica's turn, allowed to wait longer, gets the lock when it is let go, not a refusal at
    // the statement timeout that would read as its deadline.
    let url = support::pg::fresh_database().await;
    let db_url = DatabaseUrl::new(url.clone());
    postgres::migrate(&db_url).await.unwrap();
    let holder = PostgresStore::connect(&db_url, 2).unwrap();
    let other = Arc::new(PostgresStore::connect(&db_url, 2).unwrap());
    let key = StateKey::conversation(
        "slow",
        &ChannelId::parse("test", "channelId").unwrap(),
        &ConversationId::parse("long", "conversation.id").unwrap(),
    );
    let keys = [key.clone()];
    let ConversationLock::Held { turn, .. } = holder
        .lock_conversation(&key, &keys, None, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("the first lock");
    };
    let waiting = tokio::spawn({
        let (other, keys) = (Arc::clone(&other), keys.clone());
        async move {
            other
                .lock_conversation(&keys[0], &keys, None, Duration::from_secs(20))
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(
        !waiting.is_finished(),
        "the wait ended at the statement timeout"
    );
    turn.release().await;
    let granted = waiting.await.unwrap().unwrap();
    assert!(
        matches!(granted, ConversationLock::Held { .. }),
        "{granted:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivery_takes_up_the_place_its_first_delivery_had_in_the_line() {
    // Turns waiting for a conversation's hold line up in the order they asked. A waiting turn
    // whose call went away (its replica died) stops asking; its redelivery, coming back at once,
    // takes up the first delivery's place instead of lining up behind the turns that came later.
    let url = support::pg::fresh_database().await;
    let db_url = DatabaseUrl::new(url.clone());
    postgres::migrate(&db_url).await.unwrap();
    let store = Arc::new(PostgresStore::connect(&db_url, 8).unwrap());
    let channel = ChannelId::parse("test", "channelId").unwrap();
    let conversation_id = ConversationId::parse("line", "conversation.id").unwrap();
    let key = StateKey::conversation("slow", &channel, &conversation_id);
    let receipt = |id: &str| {
        StateKey::receipt(
            "slow",
            &channel,
            &conversation_id,
            &turnstile::activity::incoming::ActivityId::parse(id, "id").unwrap(),
        )
    };
    let keys = [key.clone()];
    let wait = Duration::from_secs(10);
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hold = |id: &'static str| {
        let (store, keys, receipt) = (Arc::clone(&store), keys.clone(), receipt(id));
        let order = Arc::clone(&order);
        tokio::spawn(async move {
            let held = store
                .hold_conversation(&keys[0], &keys, Some(&receipt), wait, Others::Wait)
                .await
                .unwrap();
            let ConversationLock::Held { turn, .. } = held else {
                panic!("{id}: {held:?}");
            };
            order.lock().unwrap().push(id);
            tokio::time::sleep(Duration::from_millis(100)).await;
            turn.release().await;
        })
    };
    let held = store
        .hold_conversation(&key, &keys, Some(&receipt("running")), wait, Others::Wait)
        .await
        .unwrap();
    let ConversationLock::Held { turn: running, .. } = held else {
        panic!("the running turn's hold: {held:?}");
    };
    let lost = hold("first");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = hold("second");
    tokio::time::sleep(Duration::from_millis(300)).await;
    lost.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = hold("first");
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.release().await;
    again.await.unwrap();
    second.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["first", "second"]);
}

/// A turn holding the conversation lock commits before any turn that took no lock, however its
/// connection came: the other turn's commit waits for the held row and then conflicts. The
/// holder's store is fresh, so its connection has prepared nothing yet: a commit statement
/// prepared on the way would leave after the `COMMIT` sent with it, and run once the lock had
/// ended (the Citus commit of one shard did, until it was prepared first too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lock_holder_commits_before_a_turn_that_took_no_lock() {
    holder_commits_first(support::pg::fresh_database().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_citus_the_lock_holder_commits_before_a_turn_that_took_no_lock() {
    if !support::citus::installed() {
        return;
    }
    holder_commits_first(support::citus::shared().fresh_database().await).await;
}

async fn holder_commits_first(url: String) {
    let db_url = DatabaseUrl::new(url);
    postgres::migrate(&db_url).await.unwrap();
    let other = Arc::new(PostgresStore::connect(&db_url, 2).unwrap());
    let key = StateKey::conversation(
        "pizza",
        &ChannelId::parse("test", "channelId").unwrap(),
        &ConversationId::parse("held-row", "conversation.id").unwrap(),
    );
    let written = |expected, by: &str| {
        let state = serde_json::Map::from_iter([("by".to_owned(), by.into())]);
        Commit::new(vec![KeyChange {
            key: key.clone(),
            expected,
            write: Some(state.into()),
        }])
    };
    let first = other
        .commit(written(Expected::Absent, "first"))
        .await
        .unwrap();
    assert!(matches!(first, CommitOutcome::Committed(_)), "{first:?}");

    let holder = PostgresStore::connect(&db_url, 2).unwrap();
    let keys = [key.clone()];
    let ConversationLock::Held { turn, snapshot } = holder
        .lock_conversation(&key, &keys, None, Duration::from_secs(5))
        .await
        .unwrap()
    else {
        panic!("the lock of a conversation nobody holds");
    };
    assert_eq!(
        snapshot.get(&key).map(|row| row.version),
        Some(Version::FIRST)
    );
    let racing = tokio::spawn({
        let other = Arc::clone(&other);
        let commit = written(Expected::Version(Version::FIRST), "racing");
        async move { other.commit(commit).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !racing.is_finished(),
        "a commit that took no lock got past the held row"
    );
    let held = turn
        .commit(written(Expected::Version(Version::FIRST), "holder"))
        .await
        .unwrap();
    assert!(
        matches!(held, CommitOutcome::Committed(_)),
        "the lock holder lost: {held:?}"
    );
    let racing = racing.await.unwrap().unwrap();
    assert!(
        matches!(racing, CommitOutcome::Conflict { .. }),
        "{racing:?}"
    );
}
