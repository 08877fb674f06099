//! Exactly-once turns: a redelivered activity — in a row, all at once, or after its response was
//! lost — gets the answer its first processing committed, and the bot runs once.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::time::Duration;

use async_trait::async_trait;
use support::{TestApp, message, spawn_app, texts};
use tonic::Code;
use turnstile::bots::CounterBot;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

fn counted(activity: pb::Activity) -> pb::ProcessTurnRequest {
    pb::ProcessTurnRequest::typed(activity, "counter")
}

fn with_id(id: &str) -> pb::Activity {
    pb::Activity {
        id: Some(id.into()),
        ..message("c1", "alice", "hi")
    }
}

async fn send(
    client: &mut TurnServiceClient<tonic::transport::Channel>,
    activity: pb::Activity,
) -> pb::ProcessTurnResponse {
    client
        .process_turn(counted(activity))
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test]
async fn the_same_activity_twice_in_a_row_runs_once() {
    let mut app = spawn_app().await;

    let first = send(&mut app.client, with_id("a1")).await;
    assert_eq!(texts(&first), ["count: 1"]);
    assert!(!first.redelivered);
    let again = send(&mut app.client, with_id("a1")).await;
    assert!(again.redelivered, "recognized as a redelivery");
    assert_eq!(
        again.activities, first.activities,
        "the same answer, to the field"
    );
    assert_eq!(
        (again.attempts, again.version),
        (first.attempts, first.version)
    );

    let next = send(&mut app.client, with_id("a2")).await;
    assert_eq!(texts(&next), ["count: 2"], "the redelivery did not count");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_copies_at_once_across_replicas_run_once() {
    let a = spawn_app().await;
    let b = a.replica(turnstile::bots::samples()).await;
    let clients = [a.client.clone(), b.client.clone()];
    let calls: Vec<_> = (0..10)
        .map(|i| {
            let mut client = clients[i % 2].clone();
            tokio::spawn(async move { send(&mut client, with_id("burst")).await })
        })
        .collect();
    let mut responses = Vec::new();
    for call in calls {
        responses.push(call.await.unwrap());
    }
    let originals = responses.iter().filter(|r| !r.redelivered).count();
    assert_eq!(
        originals, 1,
        "one delivery ran the bot, nine got its receipt"
    );
    for r in &responses {
        assert_eq!(r.activities, responses[0].activities);
        assert_eq!(r.version, responses[0].version);
    }
    assert_eq!(texts(&responses[0]), ["count: 1"]);
    let mut client = clients[0].clone();
    let next = send(&mut client, with_id("after-burst")).await;
    assert_eq!(texts(&next), ["count: 2"]);
}

/// The counter bot, slow enough for a caller to give up on it.
struct SlowCounter;

#[async_trait]
impl Bot for SlowCounter {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        tokio::time::sleep(Duration::from_millis(400)).await;
        CounterBot.on_turn(turn).await
    }
}

#[tokio::test]
async fn a_lost_response_is_answered_from_the_receipt() {
    let bots = BotRegistry::new("counter", SlowCounter);
    let mut app = TestApp::postgres().bots(bots).spawn().await;

    // The gateway gives up before the turn finishes: its response is lost.
    let mut hasty = tonic::Request::new(counted(with_id("slow")));
    hasty.set_timeout(Duration::from_millis(100));
    let status = app.client.process_turn(hasty).await.expect_err("times out");
    // tonic's client reports its own timeout as CANCELLED; a server would say DEADLINE_EXCEEDED.
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );

    // The turn still finished and committed; the gateway's retry gets its answer.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let retried = send(&mut app.client, with_id("slow")).await;
    assert!(
        retried.redelivered,
        "answered from the receipt, not run again"
    );
    assert_eq!(texts(&retried), ["count: 1"]);
    let next = send(&mut app.client, with_id("slow-2")).await;
    assert_eq!(texts(&next), ["count: 2"], "the bot ran once for `slow`");
}

#[tokio::test]
async fn activities_without_an_id_are_not_deduplicated() {
    let mut app = TestApp::memory().spawn().await;
    let no_id = || pb::Activity {
        id: None,
        ..message("c1", "alice", "hi")
    };
    assert_eq!(texts(&send(&mut app.client, no_id()).await), ["count: 1"]);
    let second = send(&mut app.client, no_id()).await;
    assert_eq!(texts(&second), ["count: 2"]);
    assert!(!second.redelivered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_queues_its_own_turns_instead_of_conflicting() {
    let app = spawn_app().await;
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let mut client = app.client.clone();
            tokio::spawn(async move {
                let activity = message("hot", &format!("u{i}"), "hi");
                send(&mut client, activity).await
            })
        })
        .collect();
    let mut counts = Vec::new();
    for call in calls {
        let response = call.await.unwrap();
        assert_eq!(
            response.attempts, 1,
            "no turn of this replica conflicted with another"
        );
        counts.push(texts(&response)[0].clone());
    }
    counts.sort_by_key(|c| c.trim_start_matches("count: ").parse::<u32>().unwrap());
    let expected: Vec<String> = (1..=40).map(|n| format!("count: {n}")).collect();
    assert_eq!(counts, expected);
}

/// The counter bot, counting its runs; a run of a message `hold` waits for a permit first.
struct RunCounting {
    runs: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

#[async_trait]
impl Bot for RunCounting {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if turn.text() == "hold" {
            self.gate.acquire().await?.forget();
        }
        CounterBot.on_turn(turn).await
    }
}

/// A channel's resend reaching the replica that holds the conversation in its state cache —
/// after the first delivery committed, or while it still runs (it queues behind it) — is
/// answered from the receipt without running the bot again: the cache never guesses past a
/// receipt this replica committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_to_the_replica_that_committed_it_does_not_run_the_bot_again() {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let bots = BotRegistry::new(
        "counter",
        RunCounting {
            runs: std::sync::Arc::clone(&runs),
            gate: std::sync::Arc::clone(&gate),
        },
    );
    let mut app = TestApp::postgres().bots(bots).spawn().await;
    let ran = || runs.load(std::sync::atomic::Ordering::SeqCst);

    // Cached: the conversation's state after a first turn.
    send(&mut app.client, with_id("warm")).await;
    let first = send(&mut app.client, with_id("again")).await;
    let resent = send(&mut app.client, with_id("again")).await;
    assert!(resent.redelivered);
    assert_eq!(resent.activities, first.activities);
    assert_eq!(ran(), 2, "the resend did not run the bot");

    // A resend while the first delivery still runs queues behind it, then is answered.
    let hold = pb::Activity {
        text: Some("hold".into()),
        ..with_id("long")
    };
    let mut first_client = app.client.clone();
    let first_hold = hold.clone();
    let running = tokio::spawn(async move { send(&mut first_client, first_hold).await });
    while ran() < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut resend_client = app.client.clone();
    let resend = tokio::spawn(async move { send(&mut resend_client, hold).await });
    // The resend is queued behind the running turn; let the first finish.
    gate.add_permits(1);
    let first = running.await.unwrap();
    let resend = resend.await.unwrap();
    assert!(!first.redelivered);
    assert!(resend.redelivered);
    assert_eq!(resend.activities, first.activities);
    assert_eq!(ran(), 3, "the bot ran once for `long`");
    let next = send(&mut app.client, with_id("next")).await;
    assert_eq!(texts(&next), ["count: 4"]);
}
