//! The pizza race: many concurrent "add" turns on one conversation, spread over replicas. No
//! user may ever be told a topping was added when that addition did not survive.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use support::{TestApp, message, request, say, texts, toppings};
use turnstile::bots::PizzaBot;
use turnstile::store::Store;
use turnstile::store::memory::MemoryStore;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

const TURNS: usize = 40;

/// What one `add tNN` call got back.
struct Added {
    topping: String,
    reply: String,
    attempts: u32,
    version: u64,
}

/// Sends `add t00` … `add t39` at once, turn i through `clients[i % clients.len()]`.
async fn race(
    clients: &[turnstile::grpc::pb::turn_service_client::TurnServiceClient<
        tonic::transport::Channel,
    >],
    conversation: &str,
) -> Vec<Added> {
    let calls = (0..TURNS).map(|i| {
        let mut client = clients[i % clients.len()].clone();
        let conversation = conversation.to_owned();
        tokio::spawn(async move {
            let topping = format!("t{i:02}");
            let activity = message(
                &conversation,
                &format!("user{i}"),
                &format!("add {topping}"),
            );
            let response = client
                .process_turn(request(activity))
                .await
                .unwrap_or_else(|s| panic!("add {topping} failed: {s:?}"))
                .into_inner();
            let reply = texts(&response).join("\n");
            Added {
                topping,
                reply,
                attempts: response.attempts,
                version: response.version,
            }
        })
    });
    let mut added = Vec::new();
    for call in calls.collect::<Vec<_>>() {
        added.push(call.await.unwrap());
    }
    added
}

/// Every acknowledgment is true: each reply names its own topping, the replies' orders form one
/// chain (sizes 1..=40, each contained in the next), the final order holds all 40, and replays
/// really happened.
async fn assert_no_lost_update(
    added: &[Added],
    client: &mut turnstile::grpc::pb::turn_service_client::TurnServiceClient<
        tonic::transport::Channel,
    >,
    conversation: &str,
) {
    let mut orders: Vec<BTreeSet<String>> = Vec::new();
    for a in added {
        let order: BTreeSet<String> = toppings(&a.reply).into_iter().collect();
        assert!(
            a.reply.starts_with(&format!("Added {}.", a.topping)) && order.contains(&a.topping),
            "the reply to `add {}` does not name it: {:?}",
            a.topping,
            a.reply
        );
        orders.push(order);
    }
    orders.sort_by_key(BTreeSet::len);
    let sizes: Vec<usize> = orders.iter().map(BTreeSet::len).collect();
    assert_eq!(
        sizes,
        (1..=TURNS).collect::<Vec<_>>(),
        "every turn saw a distinct order size"
    );
    for pair in orders.windows(2) {
        assert!(
            pair[0].is_subset(&pair[1]),
            "an acknowledged order was lost: {:?} is not contained in {:?}",
            pair[0],
            pair[1]
        );
    }
    let mut versions: Vec<u64> = added.iter().map(|a| a.version).collect();
    versions.sort_unstable();
    assert_eq!(
        versions,
        (1..=TURNS as u64).collect::<Vec<_>>(),
        "one version per commit"
    );

    let shown = say(client, conversation, "show").await;
    let final_order: BTreeSet<String> = toppings(&texts(&shown)[0]).into_iter().collect();
    let all: BTreeSet<String> = added.iter().map(|a| a.topping.clone()).collect();
    assert_eq!(
        final_order, all,
        "`show` lists every topping that was acknowledged"
    );

    let replays = added.iter().filter(|a| a.attempts > 1).count();
    assert!(
        replays > 0,
        "no turn needed a second attempt: the race never happened"
    );
    eprintln!(
        "{replays} of {TURNS} turns were replayed; most attempts {}",
        added.iter().map(|a| a.attempts).max().unwrap_or(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_on_postgres_never_acknowledge_a_lost_topping() {
    three_replicas_race(&support::pg::fresh_database().await).await;
}

/// The same race with the tables distributed over a Citus coordinator and 2 workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_on_citus_never_acknowledge_a_lost_topping() {
    if !support::citus::installed() {
        return;
    }
    three_replicas_race(&support::citus::shared().fresh_database().await).await;
}

async fn three_replicas_race(url: &str) {
    three_replicas_race_of(url, turnstile::bots::samples).await;
}

/// The race over three replicas hosting `bots`, on database `url`.
async fn three_replicas_race_of(url: &str, bots: impl Fn() -> BotRegistry) {
    // Three replicas start together, each migrating on start, each with its own pool and port.
    let start = || TestApp::on(url).bots(bots()).spawn();
    let (a, b, c) = tokio::join!(start(), start(), start());
    let clients = [a.client.clone(), b.client.clone(), c.client.clone()];
    // Each replica serves a turn first, so that all three meet the race with their connections
    // open: a replica still connecting would start its turns after the others had finished theirs
    // (seen on Citus), and the race would not happen.
    for (i, client) in clients.iter().enumerate() {
        say(&mut client.clone(), &format!("warm-up-{i}"), "show").await;
    }
    let added = race(&clients, "pizza-race").await;
    let mut client = clients[0].clone();
    assert_no_lost_update(&added, &mut client, "pizza-race").await;
}

/// The pizza bot, taking a moment to think: on the memory store a turn otherwise never yields
/// between its load and its commit, and the replicas would never overlap.
struct Pondering;

#[async_trait]
impl Bot for Pondering {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        PizzaBot.on_turn(turn).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_engines_on_one_memory_store_never_acknowledge_a_lost_topping() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let start = || {
        TestApp::shared(Arc::clone(&store))
            .bots(BotRegistry::new("pizza", Pondering))
            .spawn()
    };
    let (a, b, c) = tokio::join!(start(), start(), start());
    let clients = [a.client.clone(), b.client.clone(), c.client.clone()];
    let added = race(&clients, "pizza-race").await;
    let mut client = clients[0].clone();
    assert_no_lost_update(&added, &mut client, "pizza-race").await;
}

/// The pizza bot with a large menu kept in its conversation's state, written once: each later
/// commit sends only the properties its turn changed (the order, the dialogs), merged over the
/// row its version check names (`StateWrite::changed_since`), a commit at a time (a batch holds
/// one write of a key; `store_conformance` has the batches).
struct WithMenu;

/// The menu: 8,800 bytes, well over the size from which a state's changes go alone.
fn menu() -> String {
    "margherita ".repeat(800)
}

/// Sets the menu on the conversation's first turn, and fails a turn that finds an order without
/// it: a commit that lost the properties it did not send.
#[async_trait]
impl Bot for WithMenu {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let read: Option<String> = turn.conversation_state().get("menu")?;
        let order: Vec<String> = turn.conversation_property("order")?;
        match read {
            Some(read) if read == menu() => {}
            None if order.is_empty() => turn.conversation_state().set("menu", &menu())?,
            other => {
                return Err(BotError::msg(format!(
                    "an order of {} with the menu {}",
                    order.len(),
                    other.map_or("lost", |_| "changed")
                )));
            }
        }
        PizzaBot.on_turn(turn).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_merging_a_large_state_never_acknowledge_a_lost_topping() {
    let url = support::pg::fresh_database().await;
    // The race's first commit creates the row whole; every later one merges over it.
    three_replicas_race_of(&url, || BotRegistry::new("pizza", WithMenu)).await;
    let db = support::pg::session(&url).await;
    let row = db
        .query_one(
            "SELECT state->>'menu', jsonb_array_length(state->'order') FROM turnstile_state \
              WHERE key LIKE '%/conversations/pizza-race'",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, String>(0) == menu(), "the menu is intact");
    assert_eq!(row.get::<_, i32>(1), i32::try_from(TURNS).unwrap());
}
