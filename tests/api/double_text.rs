//! Double texting: a message that arrives while a turn of its conversation still runs. With the
//! bot's policy `reject` it is refused at once with `CONVERSATION_BUSY` (and a `RetryInfo`), on
//! the replica running the turn and on any other, and nothing is committed for it; a redelivery
//! of the running message itself is not refused but answered from its receipt; once the turn is
//! over, the conversation takes messages again. With the default, `enqueue`, the message waits
//! and runs. On real PostgreSQL, with two replicas.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use support::bots::Gated;
use support::{TestServer, message, postgres_config, texts};
use tokio::sync::Semaphore;
use tonic::Code;
use tonic_types::StatusExt as _;
use turnstile::DoubleText;
use turnstile::bot::BotRegistry;
use turnstile::grpc::pb;

async fn replicas(policy: DoubleText) -> (TestServer, TestServer, Arc<Semaphore>) {
    let url = support::pg::fresh_database().await;
    let gate = Arc::new(Semaphore::new(0));
    let bots = || {
        BotRegistry::new(
            "gated",
            Gated {
                gate: Arc::clone(&gate),
            },
        )
        .with_double_text("gated", policy)
        .unwrap()
    };
    (
        TestServer::start(postgres_config(&url), bots()).await,
        TestServer::start(postgres_config(&url), bots()).await,
        gate,
    )
}

/// A `ProcessTurn` of `activity` on `server`, on a task of its own.
fn send(
    server: &TestServer,
    activity: &pb::Activity,
) -> tokio::task::JoinHandle<Result<pb::ProcessTurnResponse, tonic::Status>> {
    let addr = server.addr;
    let activity = activity.clone();
    tokio::spawn(async move {
        let mut client =
            pb::turn_service_client::TurnServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
        client
            .process_turn(pb::ProcessTurnRequest::typed(activity, ""))
            .await
            .map(tonic::Response::into_inner)
    })
}

/// Checks that `status` is the named refusal of a double text.
fn assert_busy(status: &tonic::Status) {
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let details = status.get_error_details();
    assert_eq!(
        details.error_info().map(|i| i.reason.as_str()),
        Some("CONVERSATION_BUSY"),
        "{status:?}"
    );
    assert!(details.retry_info().is_some(), "{status:?}");
    assert!(status.message().contains("reject"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_refuses_a_double_text_on_every_replica_and_commits_nothing_for_it() {
    let (a, b, gate) = replicas(DoubleText::Reject).await;
    let first = message("busy", "ada", "wait");
    let running = send(&a, &first);
    // The first message's turn runs its bot (it drafts nothing here: wait until it holds).
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut a_client = a.client().await;
    let mut b_client = b.client().await;
    for client in [&mut a_client, &mut b_client] {
        let status = client
            .process_turn(pb::ProcessTurnRequest::typed(
                message("busy", "ada", "make it large"),
                "",
            ))
            .await
            .unwrap_err();
        assert_busy(&status);
    }
    // The running message itself, sent again to the other replica: not refused, it waits.
    let redelivered = send(&b, &first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !redelivered.is_finished(),
        "the redelivery waits for the turn"
    );

    gate.add_permits(1);
    let committed = running.await.unwrap().unwrap();
    assert_eq!(texts(&committed), ["wait"]);
    let joined = redelivered.await.unwrap().unwrap();
    assert!(joined.redelivered, "{joined:?}");
    assert_eq!(texts(&joined), ["wait"]);

    // Nothing was committed for the refused messages; the conversation takes messages again.
    let next = b_client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("busy", "ada", "make it large"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&next), ["wait, make it large"]);
    assert_eq!(next.version, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_lets_a_double_text_wait_and_run_after_the_turn() {
    let (a, b, gate) = replicas(DoubleText::Enqueue).await;
    let running = send(&a, &message("queue", "ada", "wait"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let here = send(&a, &message("queue", "ada", "second"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!here.is_finished(), "it waits for the running turn");
    gate.add_permits(1);
    assert_eq!(texts(&running.await.unwrap().unwrap()), ["wait"]);
    assert_eq!(texts(&here.await.unwrap().unwrap()), ["wait, second"]);
    let mut b_client = b.client().await;
    let third = b_client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("queue", "ada", "third"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&third), ["wait, second, third"]);
}
