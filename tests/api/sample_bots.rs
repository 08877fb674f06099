//! The dialog-based sample bots through the gRPC API: the subtract bot behaves as the seed sample
//! does, on either store and across replicas, and the pizza bot's `clear` question.
#![allow(clippy::unwrap_used)]

use crate::support;

use support::{TestApp, message, say, spawn_app, texts};
use tonic::transport::Channel;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

async fn tell(
    client: &mut TurnServiceClient<Channel>,
    bot: &str,
    conversation: &str,
    text: &str,
) -> Vec<String> {
    let response = client
        .process_turn(pb::ProcessTurnRequest::typed(
            message(conversation, "alice", text),
            bot,
        ))
        .await
        .unwrap_or_else(|s| panic!("`{text}` failed: {s:?}"))
        .into_inner();
    texts(&response)
}

/// The seed sample's conversation, twice over, alternating between `clients` turn by turn.
async fn subtract_conversation(clients: &mut [TurnServiceClient<Channel>], conversation: &str) {
    let script: [(&str, &str); 10] = [
        ("hello", "Enter a number."),
        ("apple", "Enter a number."),
        ("10", "I have 10 now enter another number"),
        ("3.5", "I have 10 now enter another number"),
        ("orange", "I have 10 now enter another number"),
        ("-4", "The result of the first minus the second is 14."),
        ("again", "Enter a number."),
        ("twenty one", "I have 21 now enter another number"),
        (
            "one hundred",
            "The result of the first minus the second is -79.",
        ),
        ("and again", "Enter a number."),
    ];
    let n = clients.len();
    for (i, (said, answer)) in script.into_iter().enumerate() {
        let client = &mut clients[i % n];
        assert_eq!(
            tell(client, "subtract", conversation, said).await,
            [answer],
            "after `{said}`"
        );
    }
}

#[tokio::test]
async fn subtract_behaves_as_the_seed_sample_on_the_memory_store() {
    let app = TestApp::memory().spawn().await;
    subtract_conversation(&mut [app.client.clone()], "subtract-memory").await;
}

#[tokio::test]
async fn subtract_continues_on_another_replica_over_postgres() {
    let a = spawn_app().await;
    let b = a.replica(turnstile::bots::samples()).await;
    // Every turn runs on the other replica than the one before: the dialog stack lives in the
    // store, not in a process.
    subtract_conversation(&mut [a.client.clone(), b.client.clone()], "subtract-pg").await;
}

#[tokio::test]
async fn pizza_asks_before_clearing_and_any_other_command_drops_the_question() {
    let app = TestApp::memory().spawn().await;
    let c = "pizza-clear";
    let said = |text: &'static str| {
        let mut client = app.client.clone();
        async move { texts(&say(&mut client, c, text).await) }
    };
    assert_eq!(said("add ham").await, ["Added ham. Your pizza has: ham."]);
    assert_eq!(
        said("clear").await,
        ["Clear your whole order (ham)? Say yes or no."]
    );
    assert_eq!(
        said("add cheese").await,
        ["Added cheese. Your pizza has: ham, cheese."],
        "a command interrupts the question"
    );
    assert_eq!(
        said("yes").await.len(),
        1,
        "no question is pending any more"
    );
    assert_eq!(
        said("clear").await,
        ["Clear your whole order (ham, cheese)? Say yes or no."]
    );
    assert_eq!(
        said("nope").await,
        ["Kept your order. Your pizza has: ham, cheese."]
    );
    said("clear").await;
    assert_eq!(
        said("yes please").await,
        ["Cleared your order. Your pizza has no toppings."]
    );
    assert_eq!(
        said("clear").await,
        ["Cleared your order. Your pizza has no toppings."],
        "nothing to confirm on an empty pizza"
    );
    assert_eq!(said("show").await, ["Your pizza has no toppings."]);
}
