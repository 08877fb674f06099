//! Double texting: a message that arrives while a turn of its conversation still runs. With the
//! bot's policy `reject` it is refused at once with `CONVERSATION_BUSY` (and a `RetryInfo`), on
//! the replica running the turn and on any other, and nothing is committed for it; a redelivery
//! of the running message itself is not refused but answered from its receipt; once the turn is
//! over, the conversation takes messages again. With the default, `enqueue`, the message waits
//! and runs. With `interrupt` it cancels the running turn, which commits nothing and is
//! receipted as superseded, and runs with that message handed to it. With `coalesce` the
//! messages arriving meanwhile are answered by one run, once. On real PostgreSQL, with two
//! replicas, and on the embedded store.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::bots::{DoubleTexts, Gated};
use support::{TestApp, message, texts};
use tokio::sync::Semaphore;
use tonic::Code;
use tonic_types::StatusExt as _;
use turnstile::DoubleText;
use turnstile::bot::BotRegistry;
use turnstile::grpc::pb;

async fn replicas(policy: DoubleText) -> (TestApp, TestApp, Arc<Semaphore>, String) {
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
    let a = TestApp::postgres().bots(bots()).spawn().await;
    let b = a.replica(bots()).await;
    let url = a.database_url().to_owned();
    (a, b, gate, url)
}

/// A `ProcessTurn` of `activity` on `app`, on a task of its own.
pub(crate) fn send(
    app: &TestApp,
    activity: &pb::Activity,
) -> tokio::task::JoinHandle<Result<pb::ProcessTurnResponse, tonic::Status>> {
    let mut client = app.client.clone();
    let activity = activity.clone();
    tokio::spawn(async move {
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
    let (mut a, mut b, gate, url) = replicas(DoubleText::Reject).await;
    let first = message("busy", "ada", "wait");
    let running = send(&a, &first);
    // The first message's turn runs its bot.
    support::pg::until_held(&url, "busy").await;

    for client in [&mut a.client, &mut b.client] {
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
    let next = b
        .client
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
    let (a, mut b, gate, url) = replicas(DoubleText::Enqueue).await;
    let running = send(&a, &message("queue", "ada", "wait"));
    support::pg::until_held(&url, "queue").await;
    let here = send(&a, &message("queue", "ada", "second"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!here.is_finished(), "it waits for the running turn");
    gate.add_permits(1);
    assert_eq!(texts(&running.await.unwrap().unwrap()), ["wait"]);
    assert_eq!(texts(&here.await.unwrap().unwrap()), ["wait, second"]);
    let third = b
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("queue", "ada", "third"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&third), ["wait, second, third"]);
}

/// Where [`recording`]'s replicas keep their state.
#[derive(Clone, Copy)]
enum On {
    /// One replica's in-memory store.
    Embedded,
    /// A fresh database of the shared PostgreSQL.
    Postgres,
    /// A fresh database of the shared Citus cluster.
    Citus,
}

/// Two replicas over one fresh database — or, [`On::Embedded`], one replica over its in-memory
/// store, named twice — of the [`DoubleTexts`] bot with `policy`; its gate and run count, and
/// the database's URL.
async fn recording(
    policy: DoubleText,
    on: On,
) -> (
    TestApp,
    Option<TestApp>,
    Arc<Semaphore>,
    Arc<AtomicU32>,
    Option<String>,
) {
    let gate = Arc::new(Semaphore::new(0));
    let runs = Arc::new(AtomicU32::new(0));
    let bots = || {
        BotRegistry::new(
            "texts",
            DoubleTexts {
                gate: Arc::clone(&gate),
                runs: Arc::clone(&runs),
            },
        )
        .with_double_text("texts", policy)
        .unwrap()
    };
    let a = match on {
        On::Embedded => {
            let only = TestApp::memory().bots(bots()).spawn().await;
            return (only, None, gate, runs, None);
        }
        On::Postgres => TestApp::postgres().bots(bots()).spawn().await,
        On::Citus => {
            let url = support::citus::shared().fresh_database().await;
            TestApp::on(&url).bots(bots()).spawn().await
        }
    };
    let b = a.replica(bots()).await;
    let url = a.database_url().to_owned();
    (a, Some(b), gate, runs, Some(url))
}

/// Until activity `id` is among those the hold of the only conversation in the database at
/// `url` lists as waiting to be answered together; without a database, a moment (one replica's
/// in-memory store registers a waiting message at once).
pub(crate) async fn until_pending(url: Option<&str>, id: &str) {
    let Some(url) = url else {
        tokio::time::sleep(Duration::from_millis(150)).await;
        return;
    };
    let db = support::pg::session(url).await;
    // The activity's JSON in the list holds `"id": "<id>"`: the id quoted is found nowhere else.
    let quoted = format!("\"{id}\"");
    for _ in 0..1000 {
        let waiting: bool = db
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM turnstile_state \
                  WHERE right(key, 5) = '%hold' AND strpos(state->>'pending', $1) > 0)",
                &[&quoted],
            )
            .await
            .unwrap()
            .get(0);
        if waiting {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{id} never waited at the hold");
}

/// Until the bot's `n`th run holds on the gate: up to 30 s, since a first turn on Citus can take seconds on a
/// loaded machine (its connections, its first statements planned on every node).
pub(crate) async fn until_running(runs: &AtomicU32, n: u32) {
    for _ in 0..3000 {
        if runs.load(Ordering::SeqCst) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the bot never ran {n} times");
}

async fn interrupt_hands_the_running_message_on(on: On) {
    let (a, b, _gate, runs, _) = recording(DoubleText::Interrupt, on).await;
    let b = b.as_ref().unwrap_or(&a);
    let first = message("int", "ada", "wait");
    let running = send(&a, &first);
    until_running(&runs, 1).await;

    // The second message, on the other replica: the first turn stops (its gate never opens),
    // and the second runs with the first handed to it.
    let second = send(b, &message("int", "ada", "make it large"))
        .await
        .unwrap()
        .unwrap();
    let stopped = running.await.unwrap().unwrap();
    assert!(stopped.superseded, "{stopped:?}");
    assert!(stopped.activities.is_empty(), "{stopped:?}");
    assert_eq!(texts(&second), ["make it large | superseded: wait"]);
    assert!(!second.superseded);

    // Nothing of the interrupted run was kept: no `tool_use` without its `tool_result`, and the
    // list holds the second message only. The next turn has nothing handed to it.
    let third = send(&a, &message("int", "ada", "thanks"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(texts(&third), ["make it large, thanks | superseded: "]);
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // The interrupted message, delivered again: answered from its receipt, superseded.
    let again = send(b, &first).await.unwrap().unwrap();
    assert!(again.superseded && again.redelivered, "{again:?}");
    assert!(again.activities.is_empty());
    assert_eq!(runs.load(Ordering::SeqCst), 3, "a redelivery does not run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_stops_the_running_turn_on_another_replica_and_hands_its_message_on() {
    interrupt_hands_the_running_message_on(On::Postgres).await;
}

/// The same with the tables distributed by Citus: the mark and its announcement, and the hand-on,
/// through the hold's Citus statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_citus_interrupt_stops_the_running_turn_on_another_replica_and_hands_its_message_on() {
    if !support::citus::installed() {
        return;
    }
    interrupt_hands_the_running_message_on(On::Citus).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_on_the_embedded_store_hands_the_running_message_on() {
    interrupt_hands_the_running_message_on(On::Embedded).await;
}

async fn coalesce_answers_the_waiting_messages_in_one_run(on: On) {
    let (a, b, gate, runs, url) = recording(DoubleText::Coalesce, on).await;
    let b = b.as_ref().unwrap_or(&a);
    let first = message("co", "ada", "wait");
    let running = send(&a, &first);
    until_running(&runs, 1).await;

    // Three more while it runs, on both replicas, one after the other: each sent once the one
    // before waits at the hold (150 ms apart was not always enough on a loaded Citus cluster).
    let mut later = Vec::new();
    for (n, text) in ["large", "no olives", "and a coke"].into_iter().enumerate() {
        let activity = message("co", "ada", text);
        let server = if n % 2 == 0 { b } else { &a };
        let id = activity.id.clone().unwrap();
        later.push((id.clone(), send(server, &activity), activity));
        until_pending(url.as_deref(), &id).await;
    }
    assert!(
        later.iter().all(|(_, call, _)| !call.is_finished()),
        "they wait"
    );
    gate.add_permits(1);

    let alone = running.await.unwrap().unwrap();
    assert_eq!(texts(&alone), ["wait | superseded: "]);
    assert!(alone.coalesced.is_empty(), "a batch of one: {alone:?}");
    let ids: Vec<String> = later.iter().map(|(id, _, _)| id.clone()).collect();
    let mut answered = Vec::new();
    let mut activities = Vec::new();
    for (_, call, activity) in later {
        answered.push(call.await.unwrap().unwrap());
        activities.push(activity);
    }
    // One run answered the three, in arrival order, and its answer is delivered once.
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    for outcome in &answered {
        assert_eq!(outcome.coalesced, ids, "{outcome:?}");
    }
    let replies: Vec<Vec<String>> = answered
        .iter()
        .map(texts)
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(
        replies,
        [["wait, large+no olives+and a coke | superseded: "]],
        "{answered:?}"
    );

    // Each one, delivered again, is answered from its receipt without a third run.
    for (activity, outcome) in activities.iter().zip(&answered) {
        let again = send(&a, activity).await.unwrap().unwrap();
        assert!(again.redelivered, "{again:?}");
        assert_eq!(again.coalesced, ids);
        assert_eq!(again.activities.len(), outcome.activities.len());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The conversation goes on, its next message alone.
    let next = send(b, &message("co", "ada", "thanks"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        texts(&next),
        ["wait, large+no olives+and a coke, thanks | superseded: "]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesce_answers_the_messages_of_a_running_turn_in_one_run_across_replicas() {
    coalesce_answers_the_waiting_messages_in_one_run(On::Postgres).await;
}

/// The same with the tables distributed by Citus (`turnstile_hold_add_pending`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_citus_coalesce_answers_the_messages_of_a_running_turn_in_one_run_across_replicas() {
    if !support::citus::installed() {
        return;
    }
    coalesce_answers_the_waiting_messages_in_one_run(On::Citus).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesce_on_the_embedded_store_answers_the_waiting_messages_in_one_run() {
    coalesce_answers_the_waiting_messages_in_one_run(On::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_serves_the_waiting_turns_of_every_replica_in_arrival_order() {
    // A bot named with `enqueue` holds its conversations: its waiting turns line up at the hold.
    let (a, b, gate, runs, _) = recording(DoubleText::Enqueue, On::Postgres).await;
    let b = b.unwrap();
    // Both replicas connected and ready, so that a message reaches the database when it is sent.
    for server in [&a, &b] {
        send(server, &message("warm", "ada", "hello"))
            .await
            .unwrap()
            .unwrap();
    }
    let running = send(&a, &message("line", "ada", "wait"));
    until_running(&runs, 3).await;

    // Six more while it runs, alternating between the replicas, one after the other.
    let said = ["one", "two", "three", "four", "five", "six"];
    let mut waiting = Vec::new();
    for (n, text) in said.into_iter().enumerate() {
        let server = if n % 2 == 0 { &b } else { &a };
        waiting.push(send(server, &message("line", "ada", text)));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(waiting.iter().all(|call| !call.is_finished()), "they wait");
    gate.add_permits(1);
    assert_eq!(
        texts(&running.await.unwrap().unwrap()),
        ["wait | superseded: "]
    );
    let mut last = Vec::new();
    for call in waiting {
        last = texts(&call.await.unwrap().unwrap());
    }
    // Each turn appended its message to the list on the state the one before left: the list is
    // the order they ran in.
    assert_eq!(
        last,
        ["wait, one, two, three, four, five, six | superseded: "]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_streamed_turn_resets_its_drafts_and_ends_superseded() {
    use support::streams;
    let (a, b, _gate, runs, _) = recording(DoubleText::Interrupt, On::Postgres).await;
    let b = b.unwrap();
    // The first message's turn is streamed; its bot drafts, then holds.
    let first = message("stream", "ada", "wait");
    let (call, seen) = streams::open_until(&a, &first, |e| {
        matches!(e, pb::stream_turn_response::Event::Draft(_))
    })
    .await;
    let second = send(&b, &message("stream", "ada", "make it large"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(texts(&second), ["make it large | superseded: wait"]);
    let (events, ended) = streams::collect(call, seen).await;
    ended.unwrap();
    assert_eq!(
        streams::kinds(&events),
        ["draft 1 looking at the menu", "reset 1", "outcome 1"]
    );
    let outcome = streams::outcome(&events);
    assert!(
        outcome.superseded && outcome.activities.is_empty(),
        "{outcome:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_streamed_turns_are_answered_by_one_run_whose_reply_comes_once() {
    use support::streams;
    let (a, b, gate, runs, _) = recording(DoubleText::Coalesce, On::Postgres).await;
    let b = b.unwrap();
    let running = send(&a, &message("streams", "ada", "wait"));
    until_running(&runs, 1).await;
    // Two more, each streamed, on either replica, one after the other: they wait, drafting
    // nothing.
    let mut later = Vec::new();
    for (text, server) in [("large", &a), ("no olives", &b)] {
        let (activity, mut client) = (message("streams", "ada", text), server.client.clone());
        later.push(tokio::spawn(async move {
            let stream = client
                .stream_turn(pb::StreamTurnRequest::typed(activity, ""))
                .await
                .unwrap()
                .into_inner();
            streams::collect(stream, Vec::new()).await
        }));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    gate.add_permits(1);
    running.await.unwrap().unwrap();
    let mut answered = Vec::new();
    for call in later {
        let (events, ended) = call.await.unwrap();
        ended.unwrap();
        answered.push(events);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one run for the two");
    // One call ran the batch and delivers its reply; the other only gets the outcome.
    let replies: Vec<Vec<String>> = answered
        .iter()
        .map(|events| texts(streams::outcome(events)))
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(replies, [["wait, large+no olives | superseded: "]]);
    for events in &answered {
        assert_eq!(streams::outcome(events).coalesced.len(), 2, "{events:?}");
    }
}
